//! `ferry restore REPO::DOMAIN[@ID] --to DIR`: every disk of a point of a libvirt domain
//! (`ferry backup libvirt:DOMAIN`) written into DIR through `ferry copy`'s engine, and the
//! domain's XML rewritten to point at them; `--define NEWNAME` defines that copy in
//! libvirt under a new name (libvirt gives it a new UUID and new MAC addresses).

use crate::libvirt_virsh::{Hypervisor, Virsh};
use crate::repo::short_id;
use anyhow::{bail, Context, Result};
use clap::{Args, Parser};
use ferry_open::Location;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// The point: REPO::DOMAIN for the domain's latest, REPO::DOMAIN@ID for the point whose
    /// id `ferry backup libvirt:DOMAIN` printed (a unique prefix of at least 4 hex digits).
    point: String,
    /// Where to write the disks (DOMAIN-TARGET.raw or .qcow2) and DOMAIN.xml; made if missing.
    #[arg(long, value_name = "DIR")]
    to: PathBuf,
    /// The disks' format.
    #[arg(long, value_name = "FORMAT", default_value = "raw", value_parser = ["raw", "qcow2"])]
    format: String,
    /// Define the restored copy in libvirt as NEWNAME (new UUID and MAC addresses).
    #[arg(long, value_name = "NEWNAME")]
    define: Option<String>,
    /// The libvirt connection for --define, as `virsh -c` takes it (default:
    /// LIBVIRT_DEFAULT_URI, else virsh's default). Of this host only: a remote one is refused.
    #[arg(long, value_name = "URI")]
    connect: Option<String>,
    /// The repository's passphrase: the first line of FILE (else FERRY_PASSWORD, else
    /// FERRY_PASSWORD_FILE).
    #[arg(long, value_name = "FILE")]
    password_file: Option<PathBuf>,
    /// Of the points of REPO::DOMAIN, those of the domain with this UUID (two hosts'
    /// domains of one name, or one defined anew, each have theirs; `ferry repo list`
    /// shows them).
    #[arg(long, value_name = "UUID")]
    uuid: Option<String>,
    /// Show progress of each disk's copy.
    #[arg(short, long)]
    progress: bool,
}

/// `ferry copy`'s command line, parsed as ferry parses it.
#[derive(Parser)]
struct CopyLine {
    #[command(flatten)]
    args: crate::copy::CopyArgs,
}

pub fn run(args: RestoreArgs, quiet: bool) -> Result<i32> {
    let (spec, domain, id) = match Location::parse(&args.point).with_context(|| format!("{:?}", args.point))? {
        Location::Repo { repo, name, id } => (repo, name, id),
        _ => bail!("{:?} is not a point: write REPO::DOMAIN or REPO::DOMAIN@ID", args.point),
    };
    // A connection that cannot define the copy is refused before any disk is restored.
    let virsh = args.define.as_ref().map(|_| Virsh::new(args.connect.as_deref())).transpose()?;
    let repo = ferry_open::repo::open_repository_with(
        &spec,
        &ferry_open::Remote::default(),
        args.password_file.as_deref(),
        ferry_repo::known::OnRollback::Warn,
    )?;
    let (listed, _) = repo.snapshots_skipping().context("cannot list the snapshots of the repository")?;
    let (points, bad) = repo
        .points_of(&domain, &listed, ferry_repo::PointsFor::Restore)
        .context("cannot read the points of the repository")?;
    let there = |p: &ferry_repo::PointRecord| p.disks.iter().all(|d| listed.iter().any(|s| s.id == d.snapshot));
    for (object, e) in &bad {
        log::warn!("skipping {object}: {e}");
    }
    let want_uuid = args.uuid.as_deref().map(str::to_ascii_lowercase);
    let mine: Vec<&(String, ferry_repo::PointRecord)> = points
        .iter()
        .filter(|(_, p)| p.domain == domain && want_uuid.as_ref().is_none_or(|u| p.uuid.as_ref() == Some(u)))
        .collect();
    if id.is_none() && want_uuid.is_none() {
        let mut uuids: Vec<(&str, &str)> =
            mine.iter().filter_map(|(_, p)| Some((p.uuid.as_deref()?, p.host.as_str()))).collect();
        uuids.sort();
        uuids.dedup_by_key(|u| u.0);
        if uuids.len() > 1 {
            let shown: Vec<String> = uuids.iter().map(|(u, h)| format!("{u} (host {h})")).collect();
            bail!(
                "the points of {domain} in {spec} are of {} domains of that name: {}; choose one with --uuid UUID, or \
                 a point with {spec}::{domain}@ID",
                uuids.len(),
                shown.join(", ")
            );
        }
    }
    let (pid, point) = match &id {
        None => {
            mine.last().with_context(|| {
                format!("{spec} has no point of {domain} (`ferry backup libvirt:{domain} {spec}` makes one)")
            })?;
            let newest = mine.iter().rev().find(|(_, p)| there(p)).with_context(|| {
                format!(
                    "every point of {domain} in {spec} names a snapshot that is gone (`ferry repo list` shows them)"
                )
            })?;
            if !std::ptr::eq(*newest, *mine.last().unwrap_or(newest)) {
                log::warn!(
                    "the newest point of {domain} names a snapshot that is gone: restoring point {}, the newest whole one",
                    short_id(&newest.0)
                );
            }
            *newest
        }
        Some(want) => {
            let want = want.to_ascii_lowercase();
            if want.len() < 4 {
                bail!("@{want}: write at least 4 hex digits of the point's id");
            }
            let found: Vec<_> = mine.iter().filter(|(i, _)| i.starts_with(&want)).collect();
            match found.as_slice() {
                [one] => **one,
                [] => bail!("{domain} has no point {want} in {spec} (`ferry repo list {spec}` lists them)"),
                _ => bail!("@{want} names several points of {domain}: write more of its id"),
            }
        }
    };
    std::fs::create_dir_all(&args.to).with_context(|| format!("cannot make {}", args.to.display()))?;
    let dir = std::fs::canonicalize(&args.to)?;
    let xml_path = dir.join(format!("{}.xml", args.define.as_deref().unwrap_or(&domain)));
    // Every target is checked before anything is written: nothing is overwritten.
    let paths: Vec<PathBuf> =
        point.disks.iter().map(|d| dir.join(format!("{}-{}.{}", domain, d.target, args.format))).collect();
    if let Some(p) = paths.iter().chain([&xml_path]).find(|p| p.symlink_metadata().is_ok()) {
        bail!("{} exists: restore into an empty directory (nothing is overwritten)", p.display());
    }
    // Every disk is read through the repository opened above: one passphrase asked for,
    // one key derivation, one listing.
    let cache = ferry_open::repo::cache_bytes()?;
    let mut files = Vec::new();
    for (d, path) in point.disks.iter().zip(paths) {
        let shown = format!("{spec}::{}@{}", d.name, d.snapshot);
        let snap = listed
            .iter()
            .find(|s| s.id == d.snapshot)
            .with_context(|| format!("{shown}: the snapshot of disk {} is gone", d.target))?;
        let img = ferry_repo::SnapshotImage::open_with_cache(repo.clone(), snap, cache)
            .with_context(|| format!("cannot open the snapshot {shown}"))?;
        let source = ferry_open::Source::plain(ferry_client::copy::Endpoint::Backend(
            ferry_client::copy::BackendEndpoint::new(shown.clone(), img),
        ));
        let mut line = vec!["copy".to_string(), shown];
        line.push(path.to_string_lossy().into_owned());
        if args.progress {
            line.push("-p".into());
        }
        let copy = CopyLine::try_parse_from(&line).map_err(|e| anyhow::anyhow!("{e}"))?;
        let status = crate::copy::run_from(copy.args, quiet, Some(source))
            .with_context(|| format!("restoring disk {} of {domain}", d.target))?;
        if status != 0 {
            bail!("restoring disk {} of {domain}: the copy ended with status {status}", d.target);
        }
        files.push((d.target.clone(), path.to_string_lossy().into_owned(), args.format.clone()));
    }
    let xml = crate::libvirt_xml::rewrite(&point.xml, &files, args.define.as_deref())?;
    if args.define.is_some() && crate::libvirt_xml::has_nvram(&point.xml) {
        log::warn!(
            "{domain} has UEFI variables (<nvram>): the copy does not share the original's; libvirt makes it new ones \
             from the firmware's template (boot entries the guest stored there are not restored)"
        );
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&xml_path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, xml.as_bytes()))
        .with_context(|| format!("cannot write {}", xml_path.display()))?;
    if let (Some(name), Some(virsh)) = (&args.define, &virsh) {
        virsh.define(&xml, &dir).with_context(|| {
            format!("the disks and {} are restored, but defining {name} failed", xml_path.display())
        })?;
        let _ = std::fs::remove_file(dir.join(crate::libvirt_virsh::DEFINE_FILE));
    }
    println!(
        "point {} of {domain} ({}): {} disks and {} in {}",
        short_id(pid),
        point.time,
        files.len(),
        xml_path.file_name().unwrap_or_default().to_string_lossy(),
        dir.display()
    );
    Ok(0)
}

/// `ferry repo list`'s points of libvirt domains: each point with its disks' snapshots
/// (those of `name` only, when given; a snapshot no longer there is marked).
pub(crate) fn print_points(repo: &ferry_repo::Repository, name: Option<&str>, all: &[ferry_repo::SnapshotInfo]) {
    let (points, bad) = match repo.points_in(all) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("cannot list the points of libvirt domains: {e}");
            return;
        }
    };
    for (object, e) in bad {
        eprintln!("unreadable point {object}: {e}");
    }
    let shown: Vec<_> =
        points.iter().filter(|(_, p)| name.is_none_or(|n| p.disks.iter().any(|d| d.name == n))).collect();
    if shown.is_empty() {
        return;
    }
    println!();
    println!(
        "{:<8}  {:<30}  {:<20}  DISKS (restore: ferry restore REPO::DOMAIN@POINT --to DIR)",
        "POINT", "TIME", "DOMAIN"
    );
    for (id, p) in shown {
        let disks: Vec<String> = p
            .disks
            .iter()
            .map(|d| {
                let gone = if all.iter().any(|s| s.id == d.snapshot) { "" } else { " (gone)" };
                format!("{}@{}{gone}", d.name, short_id(&d.snapshot))
            })
            .collect();
        println!("{:<8}  {:<30}  {:<20}  {}", short_id(id), p.time, p.domain, disks.join(" "));
    }
}
