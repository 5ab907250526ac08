//! `ferry backup libvirt:DOMAIN REPO`: a point of every disk of a libvirt domain, each
//! disk into `REPO::DOMAIN-TARGET` through the backup engine ([`ferry_backup::Engine`]):
//! the repository is opened (its key derived from the passphrase) once for all the disks.
//!
//! A running domain is read through one pull-mode backup job for all its disks (so they
//! are of one instant), exported on a Unix socket in a private 0700 directory. The job
//! creates a checkpoint `ferry-REPOID16-NANOS` at that instant; once every disk's
//! snapshot is committed, a point (`points/TAG/ID`, FORMAT.md "Points") records the snapshot
//! ids, the checkpoint and the domain's XML, and only then are this repository's older
//! checkpoints deleted. A disk continues from a checkpoint only when the newest point
//! naming it also names the disk's latest snapshot and libvirt still has it tracking the
//! disk: anything else (the first backup, a checkpoint libvirt lost, a run that failed
//! half-way) reads the disk whole, with a notice. A run that fails ends its job and
//! deletes its new checkpoint; a run killed outright leaves both, and the next run ends
//! the job (found by its socket's directory name) and deletes checkpoints of this
//! repository that no point names. Checkpoints ferry did not create (other names, other
//! repositories' ids) are never deleted.
//!
//! A shut-off domain is backed up from its images, as `ferry backup IMAGE` does (qcow2
//! with ferry's own change tracking, raw read whole).

use crate::backup::BackupArgs;
use crate::libvirt_virsh::{Host, Hypervisor, Virsh};
use crate::libvirt_xml::{self as xml, Disk, Export, Mode};
use crate::repo::{human, short_id};
use anyhow::{bail, Context, Result};
use clap::Args;
use ferry_backup::{Engine, Map, Report};
use ferry_repo::known::OnRollback;
use ferry_repo::{PointDisk, PointRecord, Repository};
use std::path::{Path, PathBuf};

/// The source prefix that names a libvirt domain.
pub(crate) const SCHEME: &str = "libvirt:";
/// The prefix of the checkpoints ferry creates; the repository's id follows.
const CHECKPOINT_PREFIX: &str = "ferry-";
/// The prefix of the private directory a backup job's socket is in.
const RUNDIR_PREFIX: &str = "ferry-libvirt-";

#[derive(Args, Debug, Clone)]
pub struct LibvirtArgs {
    /// With a libvirt:DOMAIN source: the libvirt connection, as `virsh -c` takes it
    /// (default: LIBVIRT_DEFAULT_URI, else virsh's default). One to another host
    /// (qemu+ssh://HOST/system) backs up a running domain there over --export tcp.
    #[arg(long, value_name = "URI")]
    pub connect: Option<String>,
    /// With a libvirt:DOMAIN source of a running domain: how its backup job exports the
    /// disks to ferry: `unix` (a private Unix socket; the domain is on this host) or `tcp`
    /// (NBD over TCP with TLS: needs --tls-certs). Default: tcp when --connect is to
    /// another host, else unix.
    #[arg(long, value_name = "KIND")]
    pub export: Option<ExportKind>,
    /// With --export tcp: the name or address qemu listens on and ferry connects to; the
    /// host's certificate must name it. A name is resolved on this host and qemu is given
    /// that address (resolved there, a host's own name may be loopback, an ssh alias
    /// nothing). Default: the host --connect names (127.0.0.1 for a connection of this
    /// host).
    #[arg(long, value_name = "HOST")]
    pub export_host: Option<String>,
    /// With --export tcp: the port qemu listens on. Default: a free one of this host for a
    /// connection of this host, else 10809 (open it in the domain's host's firewall; runs
    /// at the same time against one host need one port each).
    #[arg(long, value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    pub export_port: Option<u16>,
    /// With --export tcp: ferry's TLS credentials, in qemu's layout: ca-cert.pem (the CA
    /// that signed the certificate of the host's qemu.conf backup_tls_x509_cert_dir), and
    /// client-cert.pem and client-key.pem when the host verifies clients
    /// (backup_tls_x509_verify).
    #[arg(long, value_name = "DIR")]
    pub tls_certs: Option<PathBuf>,
    /// With --export tcp: export the disks without TLS. Anyone on the network between the
    /// hosts can then read the disks and change what ferry stores: only for a network you
    /// trust entirely.
    #[arg(long, conflicts_with = "tls_certs")]
    pub insecure_export: bool,
    /// With a libvirt:DOMAIN source: back up only this disk (its target, e.g. vda;
    /// repeatable). Default: every disk.
    #[arg(long = "disk", value_name = "TARGET")]
    pub disks: Vec<String>,
    /// With a libvirt:DOMAIN source: leave this disk out (repeatable).
    #[arg(long, value_name = "TARGET")]
    pub exclude: Vec<String>,
    /// With a libvirt:DOMAIN source: freeze the guest's file systems through the qemu guest
    /// agent for the instant the backup starts (fails if no agent answers).
    #[arg(long)]
    pub quiesce: bool,
    /// With a libvirt:DOMAIN source of a running domain: where the backup job's private
    /// directory goes (its Unix socket, and its scratch files: what the guest overwrites
    /// while the job runs, up to the size of the disks backed up). qemu must reach it. For
    /// a domain of another host (--connect) it is a directory ON THAT HOST, where qemu
    /// writes the scratch files (DIR/RUN.TARGET.scratch; default /var/tmp there); ferry
    /// keeps the job's XML in its own private directory on this host.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_SCRATCH)]
    pub scratch_dir: PathBuf,
    /// With a libvirt:DOMAIN source: back it up although the repository's latest point of
    /// that name is of another domain (another UUID: a domain of that name on another host,
    /// or one defined anew). Its history starts over; the other's points stay.
    #[arg(long)]
    pub new_domain: bool,
}

/// How a backup job exports the disks (--export).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportKind {
    Unix,
    Tcp,
}

/// The port a TCP export of a domain on another host listens on by default (NBD's).
const NBD_PORT: u16 = 10809;

/// Where a backup job's directory goes by default: on disk (not a tmpfs TMPDIR, which holds
/// scratch files in memory), and reachable by qemu (not a pam_tmpdir private TMPDIR).
pub(crate) const DEFAULT_SCRATCH: &str = "/var/tmp";

impl Default for LibvirtArgs {
    fn default() -> LibvirtArgs {
        LibvirtArgs {
            connect: None,
            export: None,
            export_host: None,
            export_port: None,
            tls_certs: None,
            insecure_export: false,
            disks: Vec::new(),
            exclude: Vec::new(),
            quiesce: false,
            scratch_dir: PathBuf::from(DEFAULT_SCRATCH),
            new_domain: false,
        }
    }
}

impl LibvirtArgs {
    /// Refuses these flags with a source that is no domain.
    pub(crate) fn refuse_without_domain(&self) -> Result<()> {
        let scratch = self.scratch_dir != Path::new(DEFAULT_SCRATCH);
        let any = self.connect.is_some() || !self.disks.is_empty() || !self.exclude.is_empty();
        let export = self.export.is_some() || self.export_host.is_some() || self.export_port.is_some();
        if any
            || export
            || self.tls_certs.is_some()
            || self.insecure_export
            || self.quiesce
            || scratch
            || self.new_domain
        {
            bail!(
                "--connect, --disk, --exclude, --export, --export-host, --export-port, --tls-certs, --insecure-export, \
                 --quiesce, --scratch-dir and --new-domain are for a libvirt:DOMAIN source"
            );
        }
        Ok(())
    }

    /// How the backup job of a running domain on `host` exports its disks, as the flags
    /// say; a TCP export's port is 0 when ferry is to choose a free one.
    fn export(&self, host: &Host) -> Result<Export> {
        let kind = self.export.unwrap_or(match host {
            Host::This => ExportKind::Unix,
            Host::Other(_) => ExportKind::Tcp,
        });
        if kind == ExportKind::Unix {
            if let Host::Other(h) = host {
                bail!(
                    "--export unix: the domain is on another host ({}), where its backup job's Unix socket is: \
                     use --export tcp (with --tls-certs), or run ferry on that host",
                    h.as_deref().unwrap_or("an alias URI")
                );
            }
            if self.export_host.is_some()
                || self.export_port.is_some()
                || self.tls_certs.is_some()
                || self.insecure_export
            {
                bail!("--export-host, --export-port, --tls-certs and --insecure-export are for --export tcp");
            }
            return Ok(Export::Unix);
        }
        let name = match (&self.export_host, host) {
            (Some(n), _) => n.clone(),
            (None, Host::This) => "127.0.0.1".to_string(),
            (None, Host::Other(Some(h))) => h.clone(),
            (None, Host::Other(None)) => bail!(
                "--export tcp: the connection {} names no host: give the name or address of the domain's host with \
                 --export-host",
                self.connect.as_deref().unwrap_or("LIBVIRT_DEFAULT_URI")
            ),
        };
        if name.is_empty() || name.chars().any(|c| c.is_whitespace() || "/?#@[]".contains(c) || c.is_control()) {
            bail!("--export-host {name:?} is not a host name or an address");
        }
        let tls = match (&self.tls_certs, self.insecure_export) {
            (Some(dir), _) => {
                let ca = dir.join("ca-cert.pem");
                if !ca.is_file() {
                    bail!(
                        "--tls-certs {}: no ca-cert.pem there (the CA that signed the certificate in the domain's \
                         host's backup_tls_x509_cert_dir; client-cert.pem and client-key.pem beside it when that host \
                         verifies clients)",
                        dir.display()
                    );
                }
                true
            }
            (None, true) => false,
            (None, false) => bail!(
                "--export tcp sends the disks over the network: give ferry the CA of the domain's host's \
                 certificates with --tls-certs DIR (ca-cert.pem, and client-cert.pem and client-key.pem if the \
                 host verifies clients); docs/backups.md says what to set on the host. --insecure-export sends \
                 them in clear instead"
            ),
        };
        let port = match (self.export_port, host) {
            (Some(p), _) => p,
            (None, Host::This) => 0,
            (None, Host::Other(_)) => NBD_PORT,
        };
        let remote_scratch = (*host != Host::This).then(|| self.scratch_dir.to_string_lossy().into_owned());
        Ok(Export::Tcp { host: name, port, tls, remote_scratch })
    }

    /// The NBD URI ferry reads disk `target` of the job of directory `dir` at; with
    /// `tls_name`, the name the host's certificate must have (the export's host being the
    /// address ferry resolved that name to).
    fn source(&self, export: &Export, dir: &Path, target: &str, tls_name: Option<&str>) -> String {
        let shown = dir.to_string_lossy();
        let name = uri_escape(&export.name(&shown, target));
        match export {
            Export::Unix => {
                format!("nbd+unix:///{name}?socket={}", uri_escape(&format!("{shown}/{}", xml::SOCKET)))
            }
            Export::Tcp { host, port, tls, .. } => {
                let host = if host.contains(':') { format!("[{host}]") } else { host.clone() };
                match (tls, &self.tls_certs) {
                    (true, Some(c)) => {
                        let check = tls_name.map(|n| format!("&tls-hostname={}", uri_escape(n))).unwrap_or_default();
                        format!(
                            "nbds://{host}:{port}/{name}?tls-certificates={}{check}",
                            uri_escape(&c.to_string_lossy())
                        )
                    }
                    _ => format!("nbd://{host}:{port}/{name}"),
                }
            }
        }
    }
}

/// The repository disk of a domain's disk.
fn disk_name(domain: &str, target: &str) -> Result<String> {
    let name = format!("{domain}-{target}");
    if !ferry_repo::format::valid_name(&name) {
        bail!(
            "the domain {domain:?} and disk {target:?} make the disk name {name:?}, which is not 1 to 200 of A-Z a-z \
             0-9 . _ - (not starting with . or -): rename the domain to back it up"
        );
    }
    Ok(name)
}

/// The disks to back up, as --disk and --exclude choose them.
fn choose(all: Vec<Disk>, a: &LibvirtArgs, domain: &str) -> Result<Vec<Disk>> {
    for t in a.disks.iter().chain(&a.exclude) {
        if !all.iter().any(|d| &d.target == t) {
            let have: Vec<&str> = all.iter().map(|d| d.target.as_str()).collect();
            bail!("{domain} has no disk {t:?} (its disks: {})", have.join(", "));
        }
    }
    let chosen: Vec<Disk> = all
        .into_iter()
        .filter(|d| (a.disks.is_empty() || a.disks.contains(&d.target)) && !a.exclude.contains(&d.target))
        .collect();
    if chosen.is_empty() {
        bail!("no disk of {domain} to back up (--disk and --exclude leave none)");
    }
    if let Some(d) = chosen.iter().find(|d| d.device != "disk") {
        bail!(
            "{domain}: disk {} is a {} (device='{}'), which libvirt's backup job does not read: leave it out with \
             --exclude {} (a restored copy then has no such disk)",
            d.target,
            if d.device == "lun" { "SCSI LUN passed through" } else { "device" },
            d.device,
            d.target
        );
    }
    Ok(chosen)
}

/// The engine of the run: the repository of `args.dst` (REPO, without ::NAME), opened
/// once for every disk. Its listings warn when the store went back; each disk's backup
/// refuses it for that disk (unless --accept-rollback).
fn open_repo(args: &BackupArgs, quiet: bool) -> Result<Engine> {
    let spec = args.dst.clone();
    if spec.contains("::") {
        bail!("ferry backup libvirt:DOMAIN takes the repository alone (REPO): each disk goes into REPO::DOMAIN-TARGET");
    }
    args.engine(&spec, OnRollback::Warn, quiet)
}

/// A private directory for the job's socket and scratch files: 0700, a new random name in
/// `base` (--scratch-dir), owned by qemu's user `owner` (uid, gid) when ferry runs as root
/// (qemu creates the socket and the scratch files; ferry, as root, still reaches them).
fn rundir(owner: Option<(u32, u32)>, base: &Path) -> Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::Builder::new()
        .prefix(RUNDIR_PREFIX)
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir_in(base)
        .with_context(|| format!("cannot make a private directory in {}", base.display()))?;
    if let (Some((uid, gid)), true) = (owner, rustix::process::geteuid().is_root()) {
        std::os::unix::fs::chown(d.path(), Some(uid), Some(gid))
            .with_context(|| format!("cannot give {} to qemu's user", d.path().display()))?;
    }
    Ok(d)
}

/// What one run does to a domain's disk.
struct Plan {
    disk: Disk,
    name: String,
    mode: Mode,
    /// The snapshot the incremental continues.
    since: Option<String>,
    /// Whether the new checkpoint tracks it (a qcow2 image).
    tracked: bool,
}

pub(crate) fn run(domain: &str, args: &BackupArgs, quiet: bool) -> Result<i32> {
    if domain.is_empty() {
        bail!("name the domain: libvirt:DOMAIN");
    }
    let own = [
        ("--dirty-bitmap", args.dirty_bitmap.is_some()),
        ("--extents-from", args.extents_from.is_some()),
        ("--since", args.since.is_some()),
        ("--resume", args.resume),
        ("-U", args.force_share),
        ("--no-bitmap", args.no_bitmap),
    ];
    if let Some((flag, _)) = own.iter().find(|f| f.1) {
        bail!(
            "{flag} is not for a libvirt:DOMAIN source: ferry chooses each disk's change map itself (a killed run is \
             not resumed: the next run reads what changed since the last good one)"
        );
    }
    // First of all: a SIGINT or SIGTERM while libvirt answers, the passphrase is asked for
    // or a slow store opens only asks the run to stop, and it stops before the backup job
    // starts (nothing made in libvirt: see `stop_if_asked`); later, the job and checkpoint
    // are cleaned up. A second signal exits at once.
    crate::interrupt::install()?;
    let virsh = Virsh::any_host(args.libvirt.connect.as_deref());
    let (points_id, snaps) = backup_domain(&virsh, domain, args, quiet, &state_dir()?)?;
    if args.json {
        let doc = serde_json::json!({
            "domain": domain,
            "point": points_id,
            "disks": snaps.iter().map(|(s, read)| crate::backup::snapshot_json(s, *read)).collect::<Vec<_>>(),
        });
        println!("{doc}");
    } else {
        println!("point {} of {domain}: {} disks", short_id(&points_id), snaps.len());
    }
    Ok(0)
}

/// Fails when a SIGINT or SIGTERM asked the run to stop: before the backup job starts,
/// the run ends with nothing made in libvirt.
fn stop_if_asked(domain: &str) -> Result<()> {
    if crate::interrupt::received().is_some() {
        bail!("stopped before the backup job of {domain} started: no job, checkpoint or snapshot was made");
    }
    Ok(())
}

/// Backs up `domain`; the point's id and each disk's snapshot with the bytes read.
/// `dir`: the host's directory of ferry's libvirt locks and freeze marks ([`state_dir`]).
pub(crate) fn backup_domain(
    h: &dyn Hypervisor,
    domain: &str,
    args: &BackupArgs,
    quiet: bool,
    dir: &Path,
) -> Result<(String, Vec<(ferry_repo::SnapshotInfo, u64)>)> {
    // A second run at once would take the first one's job for a leftover and end it; the
    // lock (this host's, of the domain of that connection's host) is taken before libvirt
    // is asked, so that no other run changes the answers.
    let host = h.host();
    let connect = args.libvirt.connect.clone().or_else(|| std::env::var("LIBVIRT_DEFAULT_URI").ok());
    let key = run_key(&host, connect.as_deref(), domain);
    let _one = one_run(dir, &key, domain)?;
    let frozen = dir.join(format!("{key}.frozen"));
    // What this run needs to know of the domain, asked in one go (one virsh process).
    let survey = h.survey(domain);
    let live = survey.live?;
    let state = survey.state?;
    let chosen = choose(xml::disks(&live)?, &args.libvirt, domain)?;
    let stopped = state.starts_with("shut off") || state.starts_with("crashed");
    if stopped && host != Host::This {
        bail!(
            "{domain} is shut off on another host: ferry reads a shut-off domain's images directly, which are on \
             that host: start the domain (its backup job then exports the disks over --export tcp), or run ferry \
             on its host"
        );
    }
    // The export flags are checked whatever the state (a nightly run's flags fail on the
    // first night, not on the first night the domain runs); a shut-off domain has no job.
    let mut export = args.libvirt.export(&host)?;
    // A Ctrl-C while libvirt answered stops the run before the passphrase is asked for.
    stop_if_asked(domain)?;
    let engine = open_repo(args, quiet)?;
    stop_if_asked(domain)?;
    let (spec, repo) = (engine.spec(), engine.repository());
    let names: Vec<String> = chosen.iter().map(|d| disk_name(domain, &d.target)).collect::<Result<_>>()?;
    let inactive = survey.inactive.unwrap_or_else(|_| live.clone());
    let uuid = xml::uuid(&live);
    // Where this host's directory of a run's job goes: --scratch-dir, except for a domain
    // of another host, whose scratch files are in --scratch-dir of that host: its job's
    // directory here holds only the job's XML, in the state directory.
    let local_base = match host {
        Host::This => args.libvirt.scratch_dir.as_path(),
        Host::Other(_) => dir,
    };
    if host == Host::This {
        // The mark of a ferry before marks were named by host (a guest it left frozen).
        thaw_leftover(h, domain, stopped, &dir.join(format!("libvirt-{}.frozen", file_safe(domain))))?;
    }
    thaw_leftover(h, domain, stopped, &frozen)?;
    // Each disk's snapshot id as the listing has it now (`ferry repo migrate` gives new ids).
    let (listed, _) = repo.snapshots_lenient().context("cannot list the snapshots of the repository")?;
    // Whether a backup of this host moved every older point (`points/ID`) of `domain` under
    // its TAG: marked once `points_of` returned, so that a run stopped midway leaves no mark
    // and the next one reads and moves the rest. The mark names the repository and domain
    // by their TAG; a host without it (another host, or /run emptied at boot) reads the
    // older points again, and finds none of the domain's left.
    let moved_mark = dir.join(format!(
        "libvirt-points-{}.moved",
        repo.points_prefix(domain).trim_matches('/').trim_start_matches("points/")
    ));
    let moved = moved_mark.exists();
    let (points, bad) = repo
        .points_of(domain, &listed, ferry_repo::PointsFor::Backup { moved })
        .context("cannot read the points of the repository")?;
    if !moved {
        if let Err(e) = std::fs::write(&moved_mark, b"") {
            log::warn!("cannot write {}: {e}; the next backup reads the older points again", moved_mark.display());
        }
    }
    for (object, e) in &bad {
        log::warn!("skipping {object}: {e}; disks it named are read whole");
    }
    let points = same_domain(&points, domain, uuid.as_deref(), args.libvirt.new_domain, spec)?;
    if stopped {
        return backup_stopped(domain, uuid, &chosen, &names, &engine, &inactive, args);
    }
    for d in &chosen {
        if d.kind == "network" || d.kind == "volume" && d.source.is_none() {
            log::info!("{domain}: disk {} is a {} disk: read through libvirt's backup job", d.target, d.kind);
        }
    }
    let repo_id = repo.config().id.clone();
    let prefix = format!("{CHECKPOINT_PREFIX}{}-", &repo_id[..16.min(repo_id.len())]);
    end_leftover_job(h, domain, survey.job?, local_base)?;
    let ours: Vec<String> = survey.checkpoints?.into_iter().filter(|c| c.starts_with(&prefix)).collect();
    // Checkpoints of this repository that no point names: left by a run that failed or
    // was killed. Deleting one merges what it tracked into its parent: nothing is lost.
    let (named, leftovers): (Vec<&String>, Vec<&String>) =
        ours.iter().partition(|c| points.iter().any(|p| p.checkpoint.as_deref() == Some(c.as_str())));
    for c in leftovers {
        log::info!("{domain}: deleting checkpoint {c}, left by a backup that did not finish");
        h.checkpoint_delete(domain, c).with_context(|| format!("cannot delete the leftover checkpoint {c}"))?;
    }
    // The disks each checkpoint a point names tracks, asked in one go; one that cannot be
    // read tracks none.
    let tracking: Vec<(&str, Vec<String>)> = named
        .iter()
        .map(|c| c.as_str())
        .zip(h.checkpoint_xmls(domain, &named.iter().map(|c| c.as_str()).collect::<Vec<_>>()))
        .map(|(c, x)| (c, x.ok().and_then(|x| xml::checkpoint_disks(&x).ok()).unwrap_or_default()))
        .collect();
    let mut plans = Vec::new();
    for (d, name) in chosen.iter().zip(&names) {
        let tracked = d.format.as_deref() == Some("qcow2");
        let (mode, since) = match continuing(repo, domain, name, &d.target, &points, &tracking)? {
            Some((c, s)) if tracked => (Mode::Incremental(c), Some(s)),
            _ => (Mode::Full, None),
        };
        if !tracked {
            log::info!(
                "{domain}: disk {} is {}: libvirt tracks changes of qcow2 images only, so each backup reads all of it \
                 (what is stored already is not stored again)",
                d.target,
                d.format.as_deref().unwrap_or("of no format")
            );
        }
        plans.push(Plan { disk: d.clone(), name: name.clone(), mode, since, tracked });
    }
    let all: Vec<String> = xml::disks(&live)?.into_iter().map(|d| d.target).collect();
    let checkpoint =
        format!("{prefix}{}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos());
    let owner = if host == Host::This { xml::qemu_owner(&live) } else { None };
    let dir = rundir(owner, local_base)?;
    let mut tls_name = None;
    if let Export::Tcp { host, port, tls, .. } = &mut export {
        // qemu would resolve a name on the domain's host, where it may mean loopback
        // (Debian maps a host's own name to 127.0.1.1) or nothing (an ssh alias): it is
        // given the address the name has here, and the certificate is checked against
        // the name.
        if host.parse::<std::net::IpAddr>().is_err() {
            let ip = resolve(host)?;
            tls_name = Some(std::mem::replace(host, ip.to_string()));
        }
        if *port == 0 {
            *port = free_port(host)?;
        }
        if !*tls {
            let at = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
            eprintln!(
                "warning: --insecure-export: the disks of {domain} are exported without TLS: any process that can \
                 reach {at}, on this host too, can read them while the job runs, and anyone between the hosts can \
                 change what is stored"
            );
        }
    }
    // A signal so far stops the run here: no job started, no checkpoint made. From here on
    // it only asks the run to stop (between the freeze and the thaw, it waits for the
    // thaw); the job and checkpoint are then cleaned up.
    stop_if_asked(domain)?;
    let quiesce = args.libvirt.quiesce.then_some(frozen.as_path());
    let job = Job::begin(h, domain, &plans, &all, &checkpoint, dir.path(), &export, quiesce)?;
    let mut snaps = Vec::new();
    for p in &plans {
        let mode = job.modes.iter().find(|m| m.0 == p.disk.target).map(|m| m.1.clone()).unwrap_or(Mode::Full);
        let src = args.libvirt.source(&export, dir.path(), &p.disk.target, tls_name.as_deref());
        let mut plan = args.plan(src, p.name.clone());
        (plan.map, plan.since) = match mode {
            Mode::Incremental(_) => (Some(Map::DirtyBitmap(format!("backup-{}", p.disk.target))), p.since.clone()),
            _ => (None, None),
        };
        let Report { snapshot: snap, read } = engine
            .backup(&plan)
            .with_context(|| format!("{domain}: disk {} (nothing of this run is kept as a point)", p.disk.target))?;
        if !args.json {
            let m = &snap.manifest;
            println!(
                "snapshot {} of {}: {}, {} read, {} added ({}{})",
                short_id(&snap.id),
                m.name,
                human(m.size),
                human(read),
                human(m.stats.new_stored),
                if matches!(mode, Mode::Incremental(_)) { "changes since checkpoint " } else { "full read" },
                match &mode {
                    Mode::Incremental(c) => c.as_str(),
                    _ => "",
                }
            );
        }
        snaps.push((snap, read));
    }
    job.end()?;
    let disks = plans
        .iter()
        .zip(&snaps)
        .map(|(p, (s, _))| PointDisk {
            target: p.disk.target.clone(),
            name: p.name.clone(),
            snapshot: s.id.clone(),
            tracked: p.tracked,
        })
        .collect();
    let point = PointRecord::new(domain, uuid, Some(checkpoint.clone()), inactive, disks);
    let id = repo.put_point(&point).context("the snapshots are stored, but the point that binds them is not")?;
    job.keep_checkpoint();
    // Only now: the new checkpoint is the one the next run continues (and those of the
    // disks this run left out, which continue from their own newest point).
    let left_out = points.iter().flat_map(|p| &p.disks).filter(|d| !plans.iter().any(|q| q.name == d.name));
    let others: Vec<&str> = left_out
        .filter_map(|d| points.iter().rev().find(|p| p.disks.iter().any(|e| e.name == d.name))?.checkpoint.as_deref())
        .collect();
    // This repository's checkpoints are now those listed above that a point names, and the
    // new one: none is made meanwhile (no other run of this domain: the lock above; another
    // repository's have another prefix), so they are not listed again (a virsh call less).
    for c in named.into_iter().filter(|c| !others.contains(&c.as_str())) {
        if let Err(e) = h.checkpoint_delete(domain, c) {
            log::warn!("{domain}: cannot delete the older checkpoint {c} ({e:#}); the next backup deletes it");
        }
    }
    Ok((id, snaps))
}

/// The points of `domain` of this domain (its UUID `uuid`; a point that records none is
/// taken for one), oldest first. Refused when the latest point of that name is of another
/// domain, unless `new_domain`: two hosts' domains of one name must not share a history.
fn same_domain<'p>(
    points: &'p [(String, PointRecord)],
    domain: &str,
    uuid: Option<&str>,
    new_domain: bool,
    spec: &str,
) -> Result<Vec<&'p PointRecord>> {
    let named: Vec<&PointRecord> = points.iter().filter(|(_, p)| p.domain == domain).map(|(_, p)| p).collect();
    let other = |p: &PointRecord| matches!((p.uuid.as_deref(), uuid), (Some(a), Some(b)) if a != b);
    if let Some(last) = named.last().filter(|p| other(p) && !new_domain) {
        bail!(
            "the latest point of {domain} in {spec} is of another domain of that name: uuid {}, backed up by ferry \
             on {} (this one is {}): back up with --new-domain if this domain replaces it (its history starts \
             over), or give this domain another name",
            last.uuid.as_deref().unwrap_or_default(),
            last.host,
            uuid.unwrap_or_default()
        );
    }
    Ok(named.into_iter().filter(|p| !other(p)).collect())
}

/// The checkpoint `name`'s next backup continues from, with the snapshot it continues:
/// the newest point of the domain naming the disk's latest snapshot, if its checkpoint
/// is still there and tracks the disk (`tracking`: this repository's checkpoints that
/// libvirt has, with the disks each tracks). `None`, with a notice why, otherwise.
fn continuing(
    repo: &Repository,
    domain: &str,
    name: &str,
    target: &str,
    points: &[&PointRecord],
    tracking: &[(&str, Vec<String>)],
) -> Result<Option<(String, String)>> {
    let latest = match repo.resolve(name, None) {
        Ok(s) => s,
        Err(ferry_repo::Error::NotFound(_)) => return Ok(None),
        Err(e) => return Err(anyhow::Error::new(e).context(format!("cannot find the latest snapshot of {name}"))),
    };
    let found = points.iter().rev().find_map(|p| {
        let d = p.disks.iter().find(|d| d.name == name && d.snapshot == latest.id && d.tracked)?;
        Some((p.checkpoint.clone()?, d.snapshot.clone()))
    });
    let Some((c, snap)) = found else {
        log::info!(
            "{domain}: disk {target}: no checkpoint continues snapshot {} of {name} (its backup did not finish, or was \
             not of the running domain): reading all of it",
            short_id(&latest.id)
        );
        return Ok(None);
    };
    let tracks = tracking.iter().any(|(t, disks)| *t == c && disks.iter().any(|d| d == target));
    if !tracks {
        log::info!(
            "{domain}: disk {target}: libvirt no longer has checkpoint {c} tracking it (the domain was redefined, or \
             its checkpoint metadata or disk replaced): reading all of it"
        );
        return Ok(None);
    }
    Ok(Some((c, snap)))
}

/// `s` percent-encoded for an NBD URI's path or query value: all but unreserved bytes and `/`.
fn uri_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'/' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `domain` as a file name: letters, digits, `-` and `_`, anything else `_`.
fn file_safe(domain: &str) -> String {
    domain.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

/// The host's directory of ferry's libvirt locks and freeze marks: /run/ferry for root,
/// else $XDG_RUNTIME_DIR/ferry, else /tmp/ferry-UID; made 0700 if missing.
fn state_dir() -> Result<PathBuf> {
    let euid = rustix::process::geteuid();
    let dir = match std::env::var_os("XDG_RUNTIME_DIR").filter(|x| !x.is_empty() && !euid.is_root()) {
        _ if euid.is_root() => PathBuf::from("/run/ferry"),
        Some(x) => PathBuf::from(x).join("ferry"),
        None => PathBuf::from(format!("/tmp/ferry-{}", euid.as_raw())),
    };
    private_dir(&dir, euid.as_raw())?;
    Ok(dir)
}

/// Makes `dir` (0700) if missing, and refuses it unless it is a directory (not a link) of
/// the user `uid` that no one else can write.
fn private_dir(dir: &Path, uid: u32) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(anyhow::Error::new(e).context(format!("cannot make {}", dir.display())))
        }
        _ => {}
    }
    let m = std::fs::symlink_metadata(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    if !m.is_dir() || m.uid() != uid || m.mode() & 0o077 != 0 {
        bail!(
            "{} is not a private directory of this user (a directory, not a link, mode 0700): remove it (ferry \
             makes it again) and back up again",
            dir.display()
        );
    }
    Ok(())
}

/// The name of the lock and the freeze mark of a domain's runs in the state directory:
/// `libvirt-HOST+DOMAIN`, HOST the connection's (`local` for this host's, else the host the
/// URI names, or the URI of an alias; a domain's name is unique on its host): vm1 of kvm1
/// and vm1 of kvm2 are two domains, neither blocks nor thaws the other. Known before
/// libvirt is asked anything, so the lock is taken first.
fn run_key(host: &Host, connect: Option<&str>, domain: &str) -> String {
    let at = match host {
        Host::This => "local",
        Host::Other(Some(h)) => h.as_str(),
        Host::Other(None) => connect.unwrap_or("default"),
    };
    // Each part escaped so that no two (host, domain) pairs give one key: `-` and letters
    // and digits kept, any other byte `_XX`; `+` (never in a part) between them.
    let part = |v: &str| -> String {
        v.bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' => (b as char).to_string(),
                _ => format!("_{b:02x}"),
            })
            .collect()
    };
    format!("libvirt-{}+{}", part(at), part(domain))
}

/// Holds this host's lock of `domain`'s backups (a file `KEY.lock` in `dir`, `key` from
/// run_key, never followed as a link, locked while the run lasts).
fn one_run(dir: &Path, key: &str, domain: &str) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(format!("{key}.lock"));
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .with_context(|| format!("cannot open the lock file {}", path.display()))?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => bail!(
            "another `ferry backup libvirt:{domain}` runs on this host: wait for it to end (two at once would end \
             each other's backup job)"
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(anyhow::Error::new(e).context(format!("cannot lock {}", path.display())))
        }
    }
}

/// How long an ended job of a run may still be listed before the run ends anyway.
const JOB_GONE: std::time::Duration = std::time::Duration::from_secs(10);

/// libvirt ends a job's block jobs after domjobabort returns: until they are gone the job
/// is still listed, and a run starting then would take it for another ferry's. Waits for
/// that (up to [`JOB_GONE`]).
fn wait_job_gone(h: &dyn Hypervisor, domain: &str, mark: &Option<String>) {
    let deadline = std::time::Instant::now() + JOB_GONE;
    while std::time::Instant::now() < deadline {
        match h.backup_xml(domain) {
            Ok(Some(x)) if xml::job_mark(&x) == *mark => std::thread::sleep(std::time::Duration::from_millis(100)),
            _ => break,
        }
    }
}

/// How many times, a pause more apart each time, a thaw is tried.
const THAW_TRIES: u32 = 4;
const THAW_PAUSE: std::time::Duration = std::time::Duration::from_millis(if cfg!(test) { 1 } else { 1000 });

/// Thaws the guest's file systems, trying again on failure.
fn thaw(h: &dyn Hypervisor, domain: &str) -> Result<()> {
    let mut tries = 1;
    loop {
        match h.freeze(domain, false) {
            Ok(()) => return Ok(()),
            Err(e) if tries >= THAW_TRIES => return Err(e),
            Err(e) => log::warn!("{domain}: thawing the guest's file systems: {e:#}; trying again"),
        }
        std::thread::sleep(THAW_PAUSE * tries);
        tries += 1;
    }
}

/// Thaws a guest a run stopped between freeze and thaw left frozen (its mark `frozen` is
/// there); a domain that is not running has no frozen guest.
fn thaw_leftover(h: &dyn Hypervisor, domain: &str, stopped: bool, frozen: &Path) -> Result<()> {
    if !frozen.exists() {
        return Ok(());
    }
    if !stopped {
        log::warn!("{domain}: a run stopped while the guest's file systems were frozen (--quiesce): thawing them");
        thaw(h, domain).with_context(|| {
            format!(
                "{domain} may still be frozen by a stopped ferry: thaw it (`virsh domfsthaw {domain}`), then remove {} \
                 and back up again",
                frozen.display()
            )
        })?;
    }
    std::fs::remove_file(frozen).with_context(|| format!("cannot remove {}", frozen.display()))
}

/// The address `name` has on this host (its first), for a TCP export.
fn resolve(name: &str) -> Result<std::net::IpAddr> {
    use std::net::ToSocketAddrs;
    let first = (name, 0).to_socket_addrs().ok().and_then(|mut a| a.next());
    first.map(|a| a.ip()).with_context(|| {
        format!(
            "--export tcp: {name} has no address on this host (an ssh alias is not a host name): give the domain's \
             host's address with --export-host"
        )
    })
}

/// A free TCP port of this host on `host`'s address, for a TCP export of a domain of
/// this host (qemu binds it a moment later; one taken meanwhile fails the job's start).
fn free_port(host: &str) -> Result<u16> {
    let l = std::net::TcpListener::bind((host, 0)).with_context(|| {
        format!("cannot find a free TCP port on {host} for the export: give one with --export-port")
    })?;
    Ok(l.local_addr()?.port())
}

/// Ends a backup job a killed ferry left on the domain (`job`, the domain's running job,
/// marked by the name of a directory
/// ferry makes: its socket's, or its export names' prefix); refuses one that is not ferry's.
/// Its directory goes too: the one its XML names (its socket's or its scratch files', for a
/// domain of this host) if named after the run, else the one of that name in `base` (for
/// a job of another host's domain, whose scratch files are in a directory of that host).
/// A job whose directory is not on this host is another ferry's (another backup host's,
/// of the same domain), maybe running: it is refused, not ended.
fn end_leftover_job(h: &dyn Hypervisor, domain: &str, job: Option<String>, base: &Path) -> Result<()> {
    let Some(job) = job else { return Ok(()) };
    let mark = xml::job_mark(&job).filter(|m| m.starts_with(RUNDIR_PREFIX));
    let Some(mark) = mark else {
        bail!(
            "{domain} runs a backup job ferry did not start: wait for it to end (or end it with `virsh domjobabort \
             {domain}`), then back up again"
        );
    };
    // Its directory holds the socket and the scratch files (what the guest overwrote
    // while it ran: up to the size of the disks), or for a domain of another host only
    // the job's XML.
    let named = |d: &PathBuf| d.file_name().is_some_and(|n| n.to_string_lossy() == mark.as_str());
    let dir = xml::job_dir(&job).filter(named).unwrap_or_else(|| base.join(&mark));
    if !dir.exists() {
        bail!(
            "another ferry runs a backup of {domain} (job {mark}); wait for it or end it with virsh domjobabort \
             {domain}"
        );
    }
    log::info!("{domain}: ending the backup job a stopped ferry left running");
    h.job_abort(domain).context("cannot end the backup job a stopped ferry left")?;
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        log::warn!("{domain}: cannot remove {} that the stopped backup left ({e}): remove it by hand", dir.display());
    }
    Ok(())
}

/// A running backup job: ended, and its checkpoint deleted unless kept, however the run
/// ends.
struct Job<'a> {
    h: &'a dyn Hypervisor,
    domain: &'a str,
    checkpoint: String,
    /// The mark of the job (its directory's name), which tells it from another job of the
    /// domain.
    mark: Option<String>,
    modes: Vec<(String, Mode)>,
    ended: std::cell::Cell<bool>,
    keep: std::cell::Cell<bool>,
}

impl<'a> Job<'a> {
    #[allow(clippy::too_many_arguments)]
    fn begin(
        h: &'a dyn Hypervisor,
        domain: &'a str,
        plans: &[Plan],
        all: &[String],
        checkpoint: &str,
        dir: &Path,
        export: &Export,
        quiesce: Option<&Path>,
    ) -> Result<Job<'a>> {
        let tracked: Vec<String> = plans.iter().filter(|p| p.tracked).map(|p| p.disk.target.clone()).collect();
        let modes_of = |full: bool| -> Vec<(String, Mode)> {
            all.iter()
                .map(|t| {
                    let m = match plans.iter().find(|p| &p.disk.target == t) {
                        None => Mode::Skip,
                        Some(_) if full => Mode::Full,
                        Some(p) => p.mode.clone(),
                    };
                    (t.clone(), m)
                })
                .collect()
        };
        let cxml = xml::checkpoint_xml(checkpoint, all, &tracked);
        let shown = dir.to_string_lossy();
        let start = |modes: &[(String, Mode)]| -> Result<()> {
            // The last moment a signal stops the run with nothing made in libvirt.
            stop_if_asked(domain)?;
            let Some(frozen) = quiesce else {
                return h.backup_begin(domain, &xml::backup_xml(&shown, export, modes), &cxml, dir);
            };
            // The mark first: a run killed while the guest is frozen leaves it, and the
            // next run thaws the guest.
            std::fs::write(frozen, domain).with_context(|| format!("cannot write {}", frozen.display()))?;
            if let Err(e) = h.freeze(domain, true) {
                // Nothing is frozen: the agent thaws what it froze when a freeze fails.
                let _ = std::fs::remove_file(frozen);
                return Err(e);
            }
            let r = h.backup_begin(domain, &xml::backup_xml(&shown, export, modes), &cxml, dir);
            if let Err(e) = thaw(h, domain) {
                if r.is_ok() {
                    let _ = h.job_abort(domain);
                    let _ = h.checkpoint_delete(domain, checkpoint);
                }
                return Err(e.context(format!(
                    "{domain} may still be frozen: thaw it (`virsh domfsthaw {domain}`); the next backup tries too"
                )));
            }
            std::fs::remove_file(frozen).with_context(|| format!("cannot remove {}", frozen.display()))?;
            r
        };
        // A TCP export's port another run's export (or any program) holds: say which flag
        // chooses another (two runs against one host need two ports).
        let failed = |e: anyhow::Error| {
            let e = e.context(format!("cannot start the backup job of {domain}"));
            match export {
                Export::Tcp { host, port, .. } if format!("{e:#}").contains("Address already in use") => {
                    e.context(format!(
                        "port {port} of {host} is in use (by another backup's export, or another program): give each \
                         run against one host its own --export-port"
                    ))
                }
                _ => e,
            }
        };
        // A start that failed may have started the job all the same (a Ctrl-C at the
        // terminal kills virsh backup-begin, which runs in ferry's process group, after
        // libvirtd began the job): a job of this run's mark is ended and its checkpoint
        // deleted, as a Job's drop does (one that cannot be is the next backup's leftover).
        let undo = |modes: &[(String, Mode)]| {
            let ours = xml::job_mark(&xml::backup_xml(&shown, export, modes));
            let Ok(Some(running)) = h.backup_xml(domain) else { return };
            if ours.is_none() || xml::job_mark(&running) != ours {
                return;
            }
            log::info!("{domain}: the backup job started although its start failed: ending it");
            if let Err(e) = h.job_abort(domain) {
                log::warn!("{domain}: cannot end the backup job ({e:#}); the next backup ends it");
            } else {
                wait_job_gone(h, domain, &ours);
            }
            if let Err(e) = h.checkpoint_delete(domain, checkpoint) {
                log::debug!("{domain}: deleting checkpoint {checkpoint}: {e:#}");
            }
        };
        let mut modes = modes_of(false);
        if let Err(e) = start(&modes) {
            undo(&modes);
            // A port in use fails the full backup too; a run asked to stop stops: no
            // second job.
            let taken = format!("{e:#}").contains("Address already in use");
            if taken
                || crate::interrupt::received().is_some()
                || !modes.iter().any(|m| matches!(m.1, Mode::Incremental(_)))
            {
                return Err(failed(e));
            }
            log::info!("{domain}: the incremental backup job did not start ({e:#}): reading every disk whole instead");
            modes = modes_of(true);
            if let Err(e) = start(&modes) {
                undo(&modes);
                return Err(failed(e));
            }
        }
        Ok(Job {
            h,
            domain,
            checkpoint: checkpoint.to_string(),
            mark: xml::job_mark(&xml::backup_xml(&shown, export, &modes)),
            modes,
            ended: false.into(),
            keep: false.into(),
        })
    }

    /// Ends the domain's backup job if it is this one (of its mark): a job that replaced
    /// it (this one ended by libvirt, another started) is not ours to end.
    fn abort(&self) -> Result<()> {
        match self.h.backup_xml(self.domain)? {
            Some(x) if self.mark.is_some() && xml::job_mark(&x) == self.mark => {
                self.h.job_abort(self.domain)?;
                wait_job_gone(self.h, self.domain, &self.mark);
                Ok(())
            }
            Some(_) => {
                log::warn!("{}: its backup job is no longer ferry's: leaving it running", self.domain);
                Ok(())
            }
            None => Ok(()),
        }
    }

    fn end(&self) -> Result<()> {
        self.ended.set(true);
        self.abort().with_context(|| format!("cannot end the backup job of {}", self.domain))
    }

    fn keep_checkpoint(&self) {
        self.keep.set(true);
    }
}

impl Drop for Job<'_> {
    fn drop(&mut self) {
        if !self.ended.get() {
            if let Err(e) = self.abort() {
                log::debug!("{}: ending the backup job: {e:#}", self.domain);
            }
        }
        if !self.keep.get() {
            if let Err(e) = self.h.checkpoint_delete(self.domain, &self.checkpoint) {
                log::warn!(
                    "{}: cannot delete checkpoint {} of the failed backup ({e:#}); the next backup deletes it",
                    self.domain,
                    self.checkpoint
                );
            }
        }
    }
}

/// A shut-off domain: each disk from its image, as `ferry backup IMAGE` reads it.
fn backup_stopped(
    domain: &str,
    uuid: Option<String>,
    chosen: &[Disk],
    names: &[String],
    engine: &Engine,
    inactive: &str,
    args: &BackupArgs,
) -> Result<(String, Vec<(ferry_repo::SnapshotInfo, u64)>)> {
    if args.libvirt.quiesce {
        bail!("--quiesce: {domain} is shut off, so there is no guest to freeze; back up without --quiesce");
    }
    log::info!("{domain} is shut off: backing up its disk images directly");
    // Every disk is checked before any is read: a run stopped by its second disk would
    // leave the first one's snapshot without a point.
    let mut sources = Vec::new();
    for d in chosen {
        let Some(path) = d.source.as_ref().filter(|_| d.kind == "file" || d.kind == "block") else {
            bail!(
                "{domain}: disk {} is a {} disk, which ferry reads only through a running domain's backup job: start \
                 the domain, or leave the disk out with --exclude {}",
                d.target,
                d.kind,
                d.target
            );
        };
        sources.push(match d.format.as_deref() {
            Some("qcow2") => format!("qcow2:{path}"),
            Some("raw") | None => format!("raw:{path}"),
            Some(f) => bail!(
                "{domain}: disk {} is a {f} image, which ferry cannot read: convert it to qcow2 or raw, or leave it \
                 out with --exclude {}",
                d.target,
                d.target
            ),
        });
    }
    let mut snaps = Vec::new();
    for ((d, name), src) in chosen.iter().zip(names).zip(sources) {
        let Report { snapshot: snap, read } =
            engine.backup(&args.plan(src, name.clone())).with_context(|| format!("{domain}: disk {}", d.target))?;
        if !args.json {
            let m = &snap.manifest;
            println!(
                "snapshot {} of {}: {}, {} read, {} added",
                short_id(&snap.id),
                m.name,
                human(m.size),
                human(read),
                human(m.stats.new_stored)
            );
        }
        snaps.push((snap, read));
    }
    let disks = chosen
        .iter()
        .zip(names)
        .zip(&snaps)
        .map(|((d, n), (s, _))| PointDisk {
            target: d.target.clone(),
            name: n.clone(),
            snapshot: s.id.clone(),
            tracked: false,
        })
        .collect();
    let point = PointRecord::new(domain, uuid, None, inactive.to_string(), disks);
    let id = engine
        .repository()
        .put_point(&point)
        .context("the snapshots are stored, but the point that binds them is not")?;
    Ok((id, snaps))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disks_are_chosen_by_target() {
        let d =
            |t: &str| Disk { target: t.into(), kind: "file".into(), format: None, source: None, device: "disk".into() };
        let all = vec![d("vda"), d("vdb")];
        // A LUN is refused unless left out.
        let lun = Disk { device: "lun".into(), ..d("sda") };
        let with_lun = vec![d("vda"), lun];
        let e = format!("{:#}", choose(with_lun.clone(), &LibvirtArgs::default(), "vm").unwrap_err());
        assert!(e.contains("--exclude sda"), "{e}");
        let a = LibvirtArgs { exclude: vec!["sda".into()], ..Default::default() };
        assert_eq!(choose(with_lun.clone(), &a, "vm").unwrap(), [d("vda")]);
        let a = LibvirtArgs { disks: vec!["vda".into()], ..Default::default() };
        assert_eq!(choose(with_lun, &a, "vm").unwrap(), [d("vda")]);
        let a = LibvirtArgs { exclude: vec!["vda".into()], ..Default::default() };
        assert_eq!(choose(all.clone(), &a, "vm").unwrap(), [d("vdb")]);
        let a = LibvirtArgs { disks: vec!["vdc".into()], ..Default::default() };
        assert!(format!("{:#}", choose(all.clone(), &a, "vm").unwrap_err()).contains("no disk \"vdc\""));
        let a = LibvirtArgs { disks: vec!["vda".into()], exclude: vec!["vda".into()], ..Default::default() };
        assert!(choose(all, &a, "vm").is_err());
        assert!(disk_name("my vm", "vda").is_err());
        assert_eq!(disk_name("vm1", "vda").unwrap(), "vm1-vda");
    }

    /// A domain whose calls are recorded; its thaw fails `thaw_fails` times.
    #[derive(Default)]
    struct Fake {
        calls: std::cell::RefCell<Vec<String>>,
        thaw_fails: std::cell::Cell<u32>,
        /// The running job's XML.
        job: std::cell::RefCell<Option<String>>,
        /// The freeze mark, which must be there when the guest is frozen.
        mark: Option<PathBuf>,
        /// What backup-begin fails with, if it does.
        begin_error: Option<String>,
        /// backup-begin fails: `Some(true)` having started the job (virsh killed after
        /// libvirtd began it), `Some(false)` before.
        begin_fails: std::cell::Cell<Option<bool>>,
    }

    impl Hypervisor for Fake {
        fn domain_xml(&self, _: &str, _: bool) -> Result<String> {
            unreachable!()
        }
        fn state(&self, _: &str) -> Result<String> {
            Ok("running".into())
        }
        fn checkpoints(&self, _: &str) -> Result<Vec<String>> {
            Ok(Vec::new())
        }
        fn checkpoint_xml(&self, _: &str, _: &str) -> Result<String> {
            unreachable!()
        }
        fn checkpoint_delete(&self, _: &str, name: &str) -> Result<()> {
            self.calls.borrow_mut().push(format!("checkpoint-delete {name}"));
            Ok(())
        }
        fn backup_begin(&self, _: &str, backup: &str, _: &str, _: &Path) -> Result<()> {
            self.calls.borrow_mut().push("backup-begin".into());
            if let Some(e) = &self.begin_error {
                bail!("virsh backup-begin on kvm1: {e}");
            }
            if self.begin_fails.get() == Some(false) {
                bail!("refused");
            }
            *self.job.borrow_mut() = Some(backup.to_string());
            if self.begin_fails.get() == Some(true) {
                bail!("virsh was killed");
            }
            Ok(())
        }
        fn backup_xml(&self, _: &str) -> Result<Option<String>> {
            Ok(self.job.borrow().clone())
        }
        fn job_abort(&self, _: &str) -> Result<()> {
            self.calls.borrow_mut().push("abort".into());
            *self.job.borrow_mut() = None;
            Ok(())
        }
        fn define(&self, _: &str, _: &Path) -> Result<()> {
            unreachable!()
        }
        fn freeze(&self, _: &str, freeze: bool) -> Result<()> {
            if let Some(m) = &self.mark {
                assert!(m.exists(), "the guest is frozen or thawed with no mark");
            }
            self.calls.borrow_mut().push(if freeze { "freeze" } else { "thaw" }.into());
            if !freeze && self.thaw_fails.get() > 0 {
                self.thaw_fails.set(self.thaw_fails.get() - 1);
                bail!("the agent did not answer");
            }
            Ok(())
        }
    }

    fn plans() -> Vec<Plan> {
        let disk = Disk {
            target: "vda".into(),
            kind: "file".into(),
            format: Some("qcow2".into()),
            source: None,
            device: "disk".into(),
        };
        vec![Plan { disk, name: "vm-vda".into(), mode: Mode::Full, since: None, tracked: true }]
    }

    #[test]
    fn a_quiesced_guest_is_marked_before_freezing_and_thawed_however_long_it_takes() {
        let dir = tempfile::tempdir().unwrap();
        let mark = dir.path().join("vm.frozen");
        let all = ["vda".to_string()];
        // A thaw that fails twice is tried again: the run goes on, and the mark goes.
        let h = Fake { mark: Some(mark.clone()), ..Default::default() };
        h.thaw_fails.set(2);
        let job = Job::begin(&h, "vm", &plans(), &all, "ferry-1", dir.path(), &Export::Unix, Some(&mark)).unwrap();
        assert_eq!(*h.calls.borrow(), ["freeze", "backup-begin", "thaw", "thaw", "thaw"]);
        assert!(!mark.exists());
        job.keep_checkpoint();
        job.end().unwrap();
        drop(job);
        // One that keeps failing fails the run, ends its job and keeps the mark...
        let h = Fake { mark: Some(mark.clone()), ..Default::default() };
        h.thaw_fails.set(THAW_TRIES);
        let e = Job::begin(&h, "vm", &plans(), &all, "ferry-2", dir.path(), &Export::Unix, Some(&mark)).err().unwrap();
        assert!(format!("{e:#}").contains("domfsthaw"), "{e:#}");
        assert!(h.calls.borrow().contains(&"abort".to_string()) && mark.exists());
        // ...and the next run thaws the guest first.
        let h = Fake { mark: Some(mark.clone()), ..Default::default() };
        thaw_leftover(&h, "vm", false, &mark).unwrap();
        assert_eq!(*h.calls.borrow(), ["thaw"]);
        assert!(!mark.exists());
        thaw_leftover(&h, "vm", false, &mark).unwrap();
        assert_eq!(h.calls.borrow().len(), 1, "no mark, no thaw");
    }

    #[test]
    fn a_job_ends_only_the_backup_job_it_started() {
        let dir = tempfile::tempdir().unwrap();
        let all = ["vda".to_string()];
        let h = Fake::default();
        let job = Job::begin(&h, "vm", &plans(), &all, "ferry-1", dir.path(), &Export::Unix, None).unwrap();
        // libvirt ended it, and someone else started another.
        let other = xml::backup_xml("/elsewhere", &Export::Unix, &[("vda".into(), Mode::Full)]);
        *h.job.borrow_mut() = Some(other.clone());
        job.end().unwrap();
        drop(job);
        assert!(!h.calls.borrow().contains(&"abort".to_string()), "{:?}", h.calls.borrow());
        assert_eq!(h.job.borrow().as_deref(), Some(other.as_str()));
        let job = Job::begin(&h, "vm", &plans(), &all, "ferry-2", dir.path(), &Export::Unix, None).unwrap();
        drop(job);
        assert!(h.calls.borrow().contains(&"abort".to_string()));
    }

    /// A job that started although its start failed (virsh killed by a Ctrl-C after
    /// libvirtd began it) is ended and its checkpoint deleted; another's job is left.
    #[test]
    fn a_job_whose_start_failed_after_it_began_is_ended() {
        let dir = tempfile::tempdir().unwrap();
        let all = ["vda".to_string()];
        let h = Fake::default();
        h.begin_fails.set(Some(true));
        assert!(Job::begin(&h, "vm", &plans(), &all, "ferry-1", dir.path(), &Export::Unix, None).is_err());
        assert_eq!(*h.calls.borrow(), ["backup-begin", "abort", "checkpoint-delete ferry-1"]);
        assert!(h.job.borrow().is_none());
        // A failed start with another's job running leaves it.
        let h = Fake::default();
        h.begin_fails.set(Some(false));
        let other = xml::backup_xml("/elsewhere", &Export::Unix, &[("vda".into(), Mode::Full)]);
        *h.job.borrow_mut() = Some(other.clone());
        assert!(Job::begin(&h, "vm", &plans(), &all, "ferry-2", dir.path(), &Export::Unix, None).is_err());
        assert_eq!(*h.calls.borrow(), ["backup-begin"]);
        assert_eq!(h.job.borrow().as_deref(), Some(other.as_str()));
    }

    #[test]
    fn a_port_in_use_names_export_port_and_is_not_retried_as_a_full_backup() {
        let dir = tempfile::tempdir().unwrap();
        let all = ["vda".to_string()];
        let mut plans = plans();
        plans[0].mode = Mode::Incremental("ferry-0".into());
        let tcp = Export::Tcp { host: "kvm1".into(), port: NBD_PORT, tls: true, remote_scratch: Some("/x".into()) };
        let used = "internal error: unable to execute QEMU command 'nbd-server-start': Failed to bind socket: \
                    Address already in use";
        let h = Fake { begin_error: Some(used.into()), ..Default::default() };
        let e = Job::begin(&h, "vm", &plans, &all, "ferry-1", dir.path(), &tcp, None).err().unwrap();
        let e = format!("{e:#}");
        assert!(e.contains("port 10809 of kvm1 is in use") && e.contains("--export-port"), "{e}");
        assert!(e.contains("Address already in use"), "libvirt's own words stay: {e}");
        assert_eq!(*h.calls.borrow(), ["backup-begin"], "a full job would fail the same way");
        // Another failure says nothing of ports.
        let h = Fake { begin_error: Some("some other error".into()), ..Default::default() };
        let e = format!("{:#}", Job::begin(&h, "vm", &plans, &all, "ferry-1", dir.path(), &tcp, None).err().unwrap());
        assert!(!e.contains("--export-port"), "{e}");
        assert_eq!(h.calls.borrow().len(), 2, "the incremental, then a full job");
    }

    #[test]
    fn the_lock_is_in_a_private_directory_and_never_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let uid = rustix::process::geteuid().as_raw();
        let dir = t.path().join("ferry");
        private_dir(&dir, uid).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        private_dir(&dir, uid).unwrap();
        let key = run_key(&Host::This, None, "vm 1");
        let lock = one_run(&dir, &key, "vm 1").unwrap();
        assert!(one_run(&dir, &key, "vm 1").is_err(), "a second run is refused");
        drop(lock);
        std::fs::remove_file(dir.join("libvirt-local+vm_201.lock")).unwrap();
        std::os::unix::fs::symlink(t.path().join("target"), dir.join("libvirt-local+vm_201.lock")).unwrap();
        assert!(one_run(&dir, &key, "vm 1").is_err(), "a link is not followed");
        assert!(!t.path().join("target").exists());
        let open = t.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(private_dir(&open, uid).is_err());
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(private_dir(&link, uid).is_err());
    }

    #[test]
    fn a_domain_of_the_same_name_with_another_uuid_is_refused_unless_new() {
        let disk = PointDisk { target: "vda".into(), name: "vm-vda".into(), snapshot: "a".repeat(64), tracked: true };
        let at = |uuid: Option<&str>, host: &str| {
            let mut p = PointRecord::new("vm", uuid.map(String::from), None, "<domain/>".into(), vec![disk.clone()]);
            p.host = host.into();
            (format!("{host}{}", uuid.unwrap_or("")), p)
        };
        let points = vec![at(None, "old"), at(Some("aaaa"), "a"), at(Some("bbbb"), "b")];
        let e = format!("{:#}", same_domain(&points, "vm", Some("aaaa"), false, "/r").unwrap_err());
        assert!(e.contains("bbbb") && e.contains("backed up by ferry on b") && e.contains("--new-domain"), "{e}");
        let mine = same_domain(&points, "vm", Some("aaaa"), true, "/r").unwrap();
        assert_eq!(mine.iter().map(|p| p.host.as_str()).collect::<Vec<_>>(), ["old", "a"]);
        assert_eq!(same_domain(&points, "vm", Some("bbbb"), false, "/r").unwrap().len(), 2);
        assert!(same_domain(&points, "other", Some("cccc"), false, "/r").unwrap().is_empty());
    }

    /// A shut-off domain of two raw disks, `imgs`.
    struct Stopped {
        imgs: [PathBuf; 2],
    }

    impl Hypervisor for Stopped {
        fn domain_xml(&self, name: &str, _: bool) -> Result<String> {
            let disk = |t: &str, p: &Path| {
                format!(
                    "<disk type='file' device='disk'><driver name='qemu' type='raw'/><source file='{}'/><target \
                     dev='{t}' bus='virtio'/></disk>",
                    p.display()
                )
            };
            let (a, b) = (disk("vda", &self.imgs[0]), disk("vdb", &self.imgs[1]));
            Ok(format!("<domain type='kvm'><name>{name}</name><devices>{a}{b}</devices></domain>"))
        }
        fn state(&self, _: &str) -> Result<String> {
            Ok("shut off".into())
        }
        fn checkpoints(&self, _: &str) -> Result<Vec<String>> {
            Ok(Vec::new())
        }
        fn checkpoint_xml(&self, _: &str, _: &str) -> Result<String> {
            unreachable!()
        }
        fn checkpoint_delete(&self, _: &str, _: &str) -> Result<()> {
            unreachable!()
        }
        fn backup_begin(&self, _: &str, _: &str, _: &str, _: &Path) -> Result<()> {
            unreachable!("a shut-off domain is read from its images")
        }
        fn backup_xml(&self, _: &str) -> Result<Option<String>> {
            bail!("Requested operation is not valid: domain is not running")
        }
        fn job_abort(&self, _: &str) -> Result<()> {
            unreachable!()
        }
        fn define(&self, _: &str, _: &Path) -> Result<()> {
            unreachable!()
        }
        fn freeze(&self, _: &str, _: bool) -> Result<()> {
            unreachable!()
        }
    }

    #[test]
    fn the_disks_of_a_run_share_one_opened_repository_and_one_key_derivation() {
        use clap::Parser;
        #[derive(Parser)]
        struct Line {
            #[command(flatten)]
            args: BackupArgs,
        }
        let t = tempfile::tempdir().unwrap();
        let repo = t.path().join("repo");
        let store = std::sync::Arc::new(ferry_repo::store::DirStore::create(&repo).unwrap());
        let cost = ferry_repo::format::KdfCost { m_kib: 8192, t: 1, p: 1 };
        let opts = ferry_repo::InitOptions {
            encrypt: Some((ferry_repo::Passphrase::new(b"two disks".to_vec()), cost)),
            ..Default::default()
        };
        Repository::init(store, &opts).unwrap();
        // The passphrase file is this test's FIFO, whose writer counts the times it is read.
        let pw = t.path().join("pw");
        assert!(std::process::Command::new("mkfifo").arg(&pw).status().unwrap().success());
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let server = {
            let (pw, stop) = (pw.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut served = 0;
                loop {
                    // Blocks until a reader opens the FIFO.
                    let mut w = std::fs::OpenOptions::new().write(true).open(&pw).unwrap();
                    if stop.load(std::sync::atomic::Ordering::SeqCst) {
                        return served;
                    }
                    let _ = std::io::Write::write_all(&mut w, b"two disks\n");
                    served += 1;
                    // Until the reader closes its end (POLLERR): the next open is another reading.
                    let mut fds = [rustix::event::PollFd::new(&w, rustix::event::PollFlags::empty())];
                    let _ = rustix::event::poll(&mut fds, None);
                }
            })
        };
        let imgs = [t.path().join("a.img"), t.path().join("b.img")];
        for (i, img) in imgs.iter().enumerate() {
            std::fs::write(img, vec![i as u8 + 1; 256 << 10]).unwrap();
        }
        let h = Stopped { imgs };
        let repo = repo.to_str().unwrap();
        let line =
            Line::try_parse_from(["backup", "--password-file", pw.to_str().unwrap(), "libvirt:vm", repo]).unwrap();
        let state = t.path().join("state");
        private_dir(&state, rustix::process::geteuid().as_raw()).unwrap();
        let (point, snaps) = backup_domain(&h, "vm", &line.args, true, &state).unwrap();
        // Two disks, one point, one passphrase read (so one key derivation).
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        {
            use std::os::unix::fs::OpenOptionsExt;
            let _wake = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&pw).unwrap();
            assert_eq!(server.join().unwrap(), 1, "the repository is opened once per run");
        }
        assert_eq!(snaps.iter().map(|(s, _)| s.manifest.name.as_str()).collect::<Vec<_>>(), ["vm-vda", "vm-vdb"]);
        assert_eq!(snaps.iter().map(|(_, read)| *read).collect::<Vec<_>>(), [256 << 10, 256 << 10]);
        assert_eq!(point.len(), 64);
    }

    #[test]
    fn export_flags_are_checked_before_the_repository_is_opened_whatever_the_state() {
        use clap::Parser;
        #[derive(Parser)]
        struct Line {
            #[command(flatten)]
            args: BackupArgs,
        }
        let h = Stopped { imgs: [PathBuf::from("/nonexistent/a"), PathBuf::from("/nonexistent/b")] };
        let line = Line::try_parse_from(["backup", "--export", "tcp", "libvirt:vm", "/nonexistent/repo"]).unwrap();
        let state = tempfile::tempdir().unwrap();
        let e = format!("{:#}", backup_domain(&h, "vm", &line.args, true, state.path()).unwrap_err());
        assert!(e.contains("--tls-certs") && !e.contains("/nonexistent/repo"), "{e}");
    }

    #[test]
    fn a_disk_whose_snapshots_went_back_is_refused_unless_accept_rollback() {
        use clap::Parser;
        use ferry_repo::store::Store;
        #[derive(Parser)]
        struct Line {
            #[command(flatten)]
            args: BackupArgs,
        }
        let t = tempfile::tempdir().unwrap();
        let repo = t.path().join("repo");
        let store = std::sync::Arc::new(ferry_repo::store::DirStore::create(&repo).unwrap());
        Repository::init(store.clone(), &ferry_repo::InitOptions::default()).unwrap();
        let imgs = [t.path().join("a.img"), t.path().join("b.img")];
        for (i, img) in imgs.iter().enumerate() {
            std::fs::write(img, vec![i as u8 + 1; 64 << 10]).unwrap();
        }
        let h = Stopped { imgs };
        let domain = "rollback";
        let state = t.path().join("state");
        private_dir(&state, rustix::process::geteuid().as_raw()).unwrap();
        let (src, repo) = (format!("libvirt:{domain}"), repo.to_str().unwrap());
        let line = |extra: &[&str]| {
            let mut argv = vec!["backup"];
            argv.extend_from_slice(extra);
            argv.extend([src.as_str(), repo]);
            Line::try_parse_from(argv).unwrap().args
        };
        let (_, snaps) = backup_domain(&h, domain, &line(&[]), true, &state).unwrap();
        // The store goes back: vda's newest snapshot is gone from it.
        let vda = &snaps[0].0;
        assert_eq!(vda.manifest.name, format!("{domain}-vda"));
        store.delete(&format!("snapshots/{}", vda.id)).unwrap();
        let e = format!("{:#}", backup_domain(&h, domain, &line(&[]), true, &state).unwrap_err());
        assert!(e.contains(&format!("{domain}-vda")) && e.contains("--accept-rollback"), "{e}");
        backup_domain(&h, domain, &line(&["--accept-rollback"]), true, &state).unwrap();
    }

    #[test]
    fn a_tcp_job_left_by_a_killed_run_is_ended_with_its_directory_and_another_one_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let run = t.path().join("ferry-libvirt-Ab12Cd");
        std::fs::create_dir(&run).unwrap();
        std::fs::write(run.join("backup.xml"), "<domainbackup/>").unwrap();
        let modes = [("vda".to_string(), Mode::Full)];
        // A domain of another host: backup-dumpxml as libvirt gives it names the scratch
        // files of that host (in its /var/tmp), no directory of this run.
        let h = Fake::default();
        *h.job.borrow_mut() = Some(
            "<domainbackup mode='pull'>\n  <server transport='tcp' tls='yes' name='kvm1' port='10809'/>\n  <disks>\n    \
             <disk name='vda' backup='yes' type='file' backupmode='full' exportname='ferry-libvirt-Ab12Cd-vda' \
             index='3'>\n      <driver type='qcow2'/>\n      \
             <scratch file='/var/tmp/ferry-libvirt-Ab12Cd.vda.scratch'/>\n    </disk>\n  </disks>\n</domainbackup>\n"
                .to_string(),
        );
        end_leftover_job(&h, "vm", h.backup_xml("vm").unwrap(), t.path()).unwrap();
        assert_eq!(*h.calls.borrow(), ["abort"]);
        assert!(!run.exists(), "the killed run's directory is left");
        // One of this host: its scratch files' directory.
        std::fs::create_dir(&run).unwrap();
        let here = Export::Tcp { host: "127.0.0.1".into(), port: 10900, tls: true, remote_scratch: None };
        *h.job.borrow_mut() = Some(xml::backup_xml(&run.to_string_lossy(), &here, &modes));
        end_leftover_job(&h, "vm", h.backup_xml("vm").unwrap(), Path::new("/nonexistent")).unwrap();
        assert!(!run.exists());
        // Someone else's TCP job (its own export names) is neither ended nor cleaned up.
        let other = "<domainbackup mode='pull'><server transport='tcp' name='h' port='1' tls='yes'/><disks>\
            <disk name='vda' backup='yes' exportname='vda'/></disks></domainbackup>";
        let h = Fake::default();
        *h.job.borrow_mut() = Some(other.to_string());
        let e = format!("{:#}", end_leftover_job(&h, "vm", h.backup_xml("vm").unwrap(), t.path()).unwrap_err());
        assert!(e.contains("ferry did not start"), "{e}");
        assert!(h.calls.borrow().is_empty());
    }

    #[test]
    fn a_job_of_another_ferry_is_refused_and_each_host_domain_has_its_own_lock() {
        // Another backup host's run of the same domain: a ferry mark, but no directory of
        // that run here. It may be running: neither ended nor cleaned up.
        let t = tempfile::tempdir().unwrap();
        let modes = [("vda".to_string(), Mode::Full)];
        let theirs = Export::Tcp { host: "kvm1".into(), port: NBD_PORT, tls: true, remote_scratch: Some("/x".into()) };
        let h = Fake::default();
        *h.job.borrow_mut() = Some(xml::backup_xml("/run/ferry/ferry-libvirt-Zz9", &theirs, &modes));
        let e = format!("{:#}", end_leftover_job(&h, "vm1", h.backup_xml("vm1").unwrap(), t.path()).unwrap_err());
        assert!(
            e.contains("another ferry runs a backup of vm1 (job ferry-libvirt-Zz9)") && e.contains("virsh domjobabort"),
            "{e}"
        );
        assert!(h.calls.borrow().is_empty(), "{:?}", h.calls.borrow());
        // One lock (and freeze mark) per connection host and domain.
        let (kvm1, kvm2) = (Host::Other(Some("kvm1".into())), Host::Other(Some("kvm2".into())));
        let k1 = run_key(&kvm1, None, "vm1");
        assert_eq!(k1, "libvirt-kvm1+vm1");
        assert_ne!(k1, run_key(&kvm2, None, "vm1"), "one name on two hosts");
        assert_ne!(k1, run_key(&Host::This, None, "vm1"));
        assert_ne!(k1, run_key(&kvm1, None, "vm2"));
        assert_eq!(run_key(&Host::Other(None), Some("myalias"), "vm 1"), "libvirt-myalias+vm_201");
        let (kvm, kvm_1) = (Host::Other(Some("kvm".into())), Host::Other(Some("kvm-1".into())));
        assert_ne!(run_key(&kvm, None, "1-web"), run_key(&kvm_1, None, "web"), "no two pairs share a key");
        assert_ne!(run_key(&kvm, None, "a.b"), run_key(&kvm, None, "a_b"));
        let dir = t.path().join("state");
        private_dir(&dir, rustix::process::geteuid().as_raw()).unwrap();
        let lock = one_run(&dir, &k1, "vm1").unwrap();
        let other = one_run(&dir, &run_key(&kvm2, None, "vm1"), "vm1").unwrap();
        assert!(one_run(&dir, &k1, "vm1").is_err(), "a second run of kvm1's vm1 is refused");
        drop((lock, other));
    }

    #[test]
    fn a_tcp_export_needs_tls_unless_insecure_and_is_chosen_for_another_host() {
        let other = Host::Other(Some("kvm1".into()));
        let e = |a: &LibvirtArgs, h: &Host| format!("{:#}", a.export(h).unwrap_err());
        assert_eq!(LibvirtArgs::default().export(&Host::This).unwrap(), Export::Unix);
        // Another host: TCP, never in clear without being told.
        let msg = e(&LibvirtArgs::default(), &other);
        assert!(msg.contains("--tls-certs") && msg.contains("--insecure-export"), "{msg}");
        let insecure = LibvirtArgs { insecure_export: true, ..Default::default() };
        let tcp = |host: &str, port, tls, here: bool| Export::Tcp {
            host: host.into(),
            port,
            tls,
            remote_scratch: (!here).then(|| DEFAULT_SCRATCH.to_string()),
        };
        assert_eq!(insecure.export(&other).unwrap(), tcp("kvm1", NBD_PORT, false, false));
        let unix = LibvirtArgs { export: Some(ExportKind::Unix), ..Default::default() };
        assert!(e(&unix, &other).contains("--export tcp"));
        assert!(e(&insecure, &Host::Other(None)).contains("--export-host"));
        // Certificates: ca-cert.pem must be there.
        let t = tempfile::tempdir().unwrap();
        let certs = LibvirtArgs {
            export: Some(ExportKind::Tcp),
            tls_certs: Some(t.path().to_path_buf()),
            export_port: Some(10900),
            ..Default::default()
        };
        assert!(e(&certs, &Host::This).contains("ca-cert.pem"));
        std::fs::write(t.path().join("ca-cert.pem"), "").unwrap();
        assert_eq!(certs.export(&Host::This).unwrap(), tcp("127.0.0.1", 10900, true, true));
        let named = LibvirtArgs { export_host: Some("10.0.0.5".into()), ..certs.clone() };
        assert_eq!(named.export(&other).unwrap(), tcp("10.0.0.5", 10900, true, false));
        let bad = LibvirtArgs { export_host: Some("a/b".into()), ..certs.clone() };
        assert!(e(&bad, &Host::This).contains("not a host name"));
        // TCP flags without a TCP export are refused, not ignored.
        let stray = LibvirtArgs { export_port: Some(1), ..Default::default() };
        assert!(e(&stray, &Host::This).contains("--export tcp"));
        // What ferry reads: TLS with the certificates, the job's mark in each export name.
        let dir = Path::new("/var/tmp/ferry-libvirt-x y");
        let ex = tcp("fd00::1", 10900, true, false);
        assert_eq!(
            certs.source(&ex, dir, "vda", None),
            format!("nbds://[fd00::1]:10900/ferry-libvirt-x%20y-vda?tls-certificates={}", t.path().display())
        );
        assert_eq!(insecure.source(&tcp("h", 1, false, false), dir, "vda", None), "nbd://h:1/ferry-libvirt-x%20y-vda");
        // A name resolved here: the address is read, the certificate checked against the name.
        assert_eq!(
            certs.source(&tcp("10.0.0.5", 10900, true, false), dir, "vda", Some("kvm1")),
            format!(
                "nbds://10.0.0.5:10900/ferry-libvirt-x%20y-vda?tls-certificates={}&tls-hostname=kvm1",
                t.path().display()
            )
        );
        assert!(resolve("localhost").unwrap().is_loopback());
        assert!(format!("{:#}", resolve("no-such-host.invalid").unwrap_err()).contains("--export-host"));
        assert_eq!(
            certs.source(&Export::Unix, dir, "vda", None),
            "nbd+unix:///vda?socket=/var/tmp/ferry-libvirt-x%20y/nbd.sock"
        );
        assert!(free_port("127.0.0.1").unwrap() > 0);
    }

    #[test]
    fn an_nbd_uri_escapes_the_socket_path() {
        assert_eq!(
            uri_escape("/var/tmp/ferry-libvirt-a b?c&d%/nbd.sock"),
            "/var/tmp/ferry-libvirt-a%20b%3Fc%26d%25/nbd.sock"
        );
    }
}
