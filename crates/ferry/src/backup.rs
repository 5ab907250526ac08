//! `ferry backup SRC REPO::NAME`: a new snapshot of the disk NAME in a backup repository.
//!
//! The flags are parsed here and the result printed; the backup itself (the base choice,
//! the change map, checkpoints, resume, commit) is the engine's, [`ferry_backup`], which
//! `ferry backup libvirt:` ([`crate::libvirt`]) calls too, once per disk through one
//! opened repository.

use crate::remote_args::shown;
use crate::repo::{human, short_id};
use anyhow::{Context, Result};
use clap::Args;
use ferry_backup::{Engine, Map, Plan, Settings};
use ferry_open::Location;
use ferry_repo::known::OnRollback;
use std::time::Duration;

#[derive(Args, Debug, Clone)]
pub struct BackupArgs {
    /// What to back up: anything `ferry copy` reads (an NBD URI such as qemu-nbd -B's or a
    /// libvirt pull-mode backup's export, a raw or qcow2 image, rbd:, http(s)://, s3://),
    /// or libvirt:DOMAIN: every disk of a libvirt domain at one instant, ferry driving the
    /// backup job and its checkpoints (see --connect, --disk, --exclude).
    pub(crate) src: String,
    /// The disk's snapshots: REPO::NAME, REPO a directory made by `ferry repo init` or
    /// s3://BUCKET/PREFIX; NAME 1 to 200 of A-Z a-z 0-9 . _ - (not starting with . or -).
    /// For libvirt:DOMAIN, REPO alone: each disk goes into REPO::DOMAIN-TARGET.
    pub(crate) dst: String,
    /// Read only the ranges the source's dirty bitmap BITMAP marks (its
    /// qemu:dirty-bitmap:BITMAP context: qemu-nbd -B, libvirt pull mode,
    /// qemu-storage-daemon, ferry serve -B); everything else is taken from NAME's latest
    /// snapshot, which --since must name. The bitmap must hold every change since that
    /// snapshot was taken.
    #[arg(long, value_name = "BITMAP", conflicts_with = "extents_from")]
    pub(crate) dirty_bitmap: Option<String>,
    /// Read only the ranges listed in FILE (as `ferry copy --extents-from` takes them);
    /// everything else is taken from NAME's latest snapshot, which --since must name.
    #[arg(long, value_name = "FILE")]
    pub(crate) extents_from: Option<String>,
    /// The snapshot the change map continues: the id `ferry backup` printed (`--json`:
    /// "id") for the backup after which the bitmap was started or cleared (a unique
    /// prefix of at least 4 hex digits). Refused unless it is NAME's latest snapshot.
    #[arg(long, value_name = "ID")]
    pub(crate) since: Option<String>,
    /// Print the new snapshot as one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
    /// Show progress: a bar with rate and ETA on a terminal, percentages otherwise.
    #[arg(short, long)]
    pub(crate) progress: bool,
    /// Most bytes read per second (K, M, G suffixes; 1K to 1T). Holes and zero ranges are free.
    #[arg(long, value_name = "BYTES_PER_SEC", value_parser = crate::copy::parse_rate)]
    pub(crate) rate: Option<u64>,
    /// Retries of a failed NBD request or connection, as `ferry copy --retries` (0 to 100).
    #[arg(long, value_name = "N", default_value_t = ferry_client::copy::DEFAULT_RETRIES,
          value_parser = clap::value_parser!(u32).range(0..=ferry_client::copy::MAX_RETRIES as i64))]
    pub(crate) retries: u32,
    /// Seconds before the first retry, doubled for each further one (0 to 60).
    #[arg(long, value_name = "SECS", default_value = "0.5", value_parser = crate::copy::parse_retry_delay)]
    pub(crate) retry_delay: Duration,
    /// Connections to the NBD server (where it allows several), as `ferry copy -C`.
    #[arg(short = 'C', long, value_name = "N")]
    pub(crate) connections: Option<usize>,
    /// Read a local source even while another program writes it (qemu-img's -U); the
    /// snapshot may then not match any state of the source.
    #[arg(short = 'U', long)]
    pub(crate) force_share: bool,
    #[command(flatten)]
    pub(crate) password: crate::password_args::PasswordArgs,
    /// Wait up to SECS for a running backup of the same disk (or a repair, or a gc of an
    /// older ferry: gc runs beside backups) to end, instead of failing at once.
    #[arg(long, value_name = "SECS", value_parser = crate::copy::parse_secs)]
    pub(crate) wait: Option<Duration>,
    /// For a local qcow2 image: do not keep a change-tracking bitmap in it (every backup
    /// then reads all of it; the image is opened read-only).
    #[arg(long)]
    pub(crate) no_bitmap: bool,
    /// Continue an interrupted backup of NAME (it stores a checkpoint every 30 seconds)
    /// instead of starting again: what it stored is not read again. The source, its size,
    /// the base snapshot and the change map must be those of the interrupted run. Without
    /// --resume, an interrupted backup of NAME is discarded.
    #[arg(long)]
    pub(crate) resume: bool,
    /// With --resume from an NBD export: it is the same point in time as in the
    /// interrupted run (the same backup job, still running; the same qemu-nbd of a stopped
    /// image). ferry cannot tell from an export whether its disk changed, and a resume
    /// from a changed one would mix two versions of the disk.
    #[arg(long, requires = "resume")]
    pub(crate) same_source: bool,
    /// Accept the repository as the store has it when its snapshots went back since
    /// this host last used it (NAME's newest snapshot gone, a forgotten one back): this
    /// host's record of it then follows the store. Without it such a backup is refused.
    #[arg(long)]
    pub(crate) accept_rollback: bool,
    /// Tag the snapshot T (repeatable; 1 to 64 of A-Z a-z 0-9 . _ - + @ : =, at most 16):
    /// `ferry repo list --tag` selects by it, `ferry repo forget --keep-tag` keeps by it.
    #[arg(long = "tag", value_name = "T", value_parser = parse_tag)]
    pub(crate) tags: Vec<String>,
    /// A note kept with the snapshot and shown by `ferry repo list` (one line, at most
    /// 1024 bytes).
    #[arg(long, value_name = "TEXT", value_parser = parse_note)]
    pub(crate) note: Option<String>,
    #[command(flatten)]
    pub(crate) remote: crate::remote_args::RemoteArgs,
    #[command(flatten)]
    pub(crate) libvirt: crate::libvirt::LibvirtArgs,
}

fn parse_tag(s: &str) -> Result<String, String> {
    match ferry_repo::format::valid_tag(s) {
        true => Ok(s.to_string()),
        false => Err("a tag is 1 to 64 of A-Z a-z 0-9 . _ - + @ : =".into()),
    }
}

fn parse_note(s: &str) -> Result<String, String> {
    match ferry_repo::format::valid_note(s) {
        true => Ok(s.to_string()),
        false => Err(format!(
            "a note is one line of at most {} bytes, without control or format characters (bidirectional, zero-width)",
            ferry_repo::format::MAX_NOTE
        )),
    }
}

/// The time the new snapshot records instead of this host's clock, as RFC 3339 (for tests
/// that need a calendar of snapshots). A time before the disk's latest snapshot's is
/// refused: a snapshot without a parent is ordered by its time alone, so it could reorder
/// the disk's snapshots.
const TIME_ENV: &str = "FERRY_BACKUP_TIME";

fn backup_time() -> Result<Option<jiff::Timestamp>> {
    match std::env::var(TIME_ENV) {
        Err(_) => Ok(None),
        Ok(v) => {
            let t = v
                .parse::<jiff::Timestamp>()
                .with_context(|| format!("{TIME_ENV}={v:?} is not an RFC 3339 time such as 2026-11-28T12:00:00Z"))?;
            eprintln!("warning: {TIME_ENV} is set: this snapshot records {t}, not this host's clock");
            Ok(Some(t))
        }
    }
}

/// Seconds between checkpoints of a running backup (or copy), instead of 30 (for tests).
const CHECKPOINT_ENV: &str = "FERRY_CHECKPOINT_SECS";

pub(crate) fn checkpoint_every() -> Result<Duration> {
    match std::env::var(CHECKPOINT_ENV) {
        Err(_) => Ok(ferry_repo::DEFAULT_CHECKPOINT_EVERY),
        Ok(v) => v
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0 && *s <= 86400.0)
            .map(Duration::from_secs_f64)
            .with_context(|| format!("{CHECKPOINT_ENV}={v:?} is not a number of seconds from 0 to 86400")),
    }
}

impl BackupArgs {
    /// The plan of a backup of `src` into the repository disk `name`, as the flags say.
    pub(crate) fn plan(&self, src: String, name: String) -> Plan {
        let map = match (&self.dirty_bitmap, &self.extents_from) {
            (Some(b), _) => Some(Map::DirtyBitmap(b.clone())),
            (None, Some(f)) => Some(Map::ExtentsFrom(f.clone())),
            (None, None) => None,
        };
        Plan {
            src,
            name,
            map,
            since: self.since.clone(),
            resume: self.resume,
            same_source: self.same_source,
            force_share: self.force_share,
            no_bitmap: self.no_bitmap,
            accept_rollback: self.accept_rollback,
            connections: self.connections,
            rate: self.rate,
            retries: self.retries,
            retry_delay: self.retry_delay,
            wait: self.wait,
            tags: self.tags.clone(),
            note: self.note.clone(),
        }
    }

    /// The engine of this run: the repository `spec` opened once (`on`: what a listing
    /// does when the store went back), stopped by SIGINT or SIGTERM.
    pub(crate) fn engine(&self, spec: &str, on: OnRollback, quiet: bool) -> Result<Engine> {
        let settings = Settings {
            quiet,
            progress: if self.progress { Some(crate::copy::show_progress) } else { None },
            cancel: Some(crate::interrupt::install()?),
            connections: crate::copy::default_connections(),
            checkpoint_every: checkpoint_every()?,
            time: backup_time()?,
        };
        let mut remote = self.remote.remote();
        remote.http.retries = self.retries;
        remote.http.retry_delay = self.retry_delay;
        Engine::open(spec, remote, self.password.install(), on, settings)
    }
}

pub fn run(args: BackupArgs, quiet: bool) -> Result<i32> {
    if let Some(domain) = args.src.strip_prefix(crate::libvirt::SCHEME) {
        return crate::libvirt::run(domain, &args, quiet);
    }
    args.libvirt.refuse_without_domain()?;
    Location::parse(&args.src).with_context(|| format!("source {:?}", shown(&args.src)))?;
    let (spec, name) = ferry_backup::target(&args.dst)?;
    let plan = args.plan(args.src.clone(), name);
    plan.check()?;
    let engine = args.engine(&spec, plan.on_rollback(&spec), quiet)?;
    let r = engine.backup(&plan)?;
    let (snap, read) = (&r.snapshot, r.read);
    let m = &snap.manifest;
    if args.json {
        println!("{}", snapshot_json(snap, read));
    } else {
        println!(
            "snapshot {} of {}: {}, {} read, {} added ({} new chunks)",
            short_id(&snap.id),
            m.name,
            human(m.size),
            human(read),
            human(m.stats.new_stored),
            m.stats.new_chunks
        );
    }
    Ok(0)
}

/// A new snapshot as `--json` prints it (`read`: the bytes read from the source).
pub(crate) fn snapshot_json(snap: &ferry_repo::SnapshotInfo, read: u64) -> serde_json::Value {
    let m = &snap.manifest;
    serde_json::json!({
        "id": snap.id,
        "name": m.name,
        "time": m.time,
        "size": m.size,
        "read": read,
        "new_chunks": m.stats.new_chunks,
        "new_stored": m.stats.new_stored,
        "parent": m.parent,
        "changes": m.changes,
    })
}
