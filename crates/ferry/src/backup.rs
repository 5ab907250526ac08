//! `ferry backup SRC REPO::NAME`: a new snapshot of the disk NAME in a backup repository.
//!
//! The source is opened as `ferry copy` opens it; the destination is a
//! [`ferry_repo::SnapshotWriter`] on top of NAME's latest snapshot (the base), and the copy
//! engine moves the data: every range without a change map, only the changed ranges with
//! `--dirty-bitmap` or `--extents-from` (everything else is the base's, which `--since`
//! must name and a sample of the source must match: see [`crate::backup_base`]). Holes and
//! zero ranges are never stored: they are written as zeroes (an entry, no data), never read.

use crate::backup_base::MapCommand;
use crate::remote_args::shown;
use crate::repo::{human, short_id};
use anyhow::{bail, Context, Result};
use clap::Args;
use ferry_client::copy::{copy, BackendEndpoint, CopyOptions, Endpoint, Progress};
use ferry_client::ConnectOptions;
use ferry_open::Location;
use ferry_proto::consts::META_DIRTY_BITMAP_PREFIX;
use ferry_repo::format::Changes;
use ferry_repo::known::OnRollback;
use ferry_repo::{BackupOptions, SnapshotWriter};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Packs are closed at this size: few objects (and requests, on S3) per backup.
const PACK_SIZE: usize = 32 << 20;
/// zstd level of new chunks: 1, measured (ARCHITECTURE.md, "zstd") at 220-415 MB/s to 0.29
/// of a binary's size against level 3's 200-250 MB/s to 0.27.
const LEVEL: i32 = 1;

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
    /// The repository's passphrase: the first line of FILE (else --password-command,
    /// FERRY_PASSWORD, FERRY_PASSWORD_FILE, FERRY_PASSWORD_COMMAND, a prompt on a terminal).
    #[arg(long, value_name = "FILE")]
    pub(crate) password_file: Option<std::path::PathBuf>,
    /// The passphrase: the first line CMD prints, run by /bin/sh -c (its standard input
    /// and error are ferry's; a failing CMD is an error).
    #[arg(long, value_name = "CMD", conflicts_with = "password_file")]
    pub(crate) password_command: Option<String>,
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

/// What identifies the source's content, for a resume to compare: its local files (path,
/// device, inode, size, mtime), a remote object's validator, or the source as shown.
fn source_identity(source: &ferry_open::Source, shown_src: &str) -> (String, bool) {
    use std::os::unix::fs::MetadataExt;
    let file = |p: &std::path::Path| match std::fs::metadata(p) {
        Ok(m) => format!(
            "file:{} dev={} ino={} size={} mtime={}.{:09}",
            std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()).display(),
            m.dev(),
            m.ino(),
            m.size(),
            m.mtime(),
            m.mtime_nsec()
        ),
        Err(_) => format!("file:{}", p.display()),
    };
    if !source.files.is_empty() {
        return (source.files.iter().map(|f| file(&f.path)).collect::<Vec<_>>().join(" + "), true);
    }
    match &source.endpoint {
        Endpoint::File(p) => (file(p), true),
        Endpoint::Backend(b) => match b.backend().identity() {
            Some(id) => (id, true),
            None => (shown_src.to_string(), false),
        },
        _ => (shown_src.to_string(), false),
    }
}

/// A digest of a change map's ranges, so that a resume with another map is refused.
fn ranges_digest(ranges: &[(u64, u64)]) -> String {
    let mut bytes = Vec::with_capacity(ranges.len() * 16);
    for (o, l) in ranges {
        bytes.extend_from_slice(&o.to_le_bytes());
        bytes.extend_from_slice(&l.to_le_bytes());
    }
    let mut d = [0u8; 32];
    ferry_hash::Algorithm::Sha256.digest_into(&bytes, &mut d);
    ferry_hash::hex(&d)
}

/// `ranges` (sorted, disjoint) widened to whole chunks of `chunk` bytes, inside `size`:
/// the writer then gets whole chunks, never parts it would keep until the commit.
fn widen(ranges: &[(u64, u64)], chunk: u64, size: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for &(o, l) in ranges {
        let start = o / chunk * chunk;
        let end = o.saturating_add(l).div_ceil(chunk).saturating_mul(chunk).min(size);
        if end <= start {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.0 + last.1 >= start => last.1 = last.1.max(end - last.0),
            _ => out.push((start, end - start)),
        }
    }
    out
}

/// `ranges` in any order, overlapping or not, as sorted disjoint ranges.
fn merge(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.retain(|r| r.1 > 0);
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (o, l) in ranges {
        match out.last_mut() {
            Some(last) if o <= last.0 + last.1 => last.1 = last.1.max(o + l - last.0),
            _ => out.push((o, l)),
        }
    }
    out
}

/// `ranges` (sorted, disjoint) without `done` (sorted, disjoint).
fn subtract(ranges: &[(u64, u64)], done: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut d = 0;
    for &(start, len) in ranges {
        let end = start + len;
        let mut pos = start;
        while d < done.len() && done[d].0 + done[d].1 <= pos {
            d += 1;
        }
        let mut k = d;
        while pos < end {
            match done.get(k) {
                Some(&(ds, dl)) if ds < end => {
                    if ds > pos {
                        out.push((pos, ds - pos));
                    }
                    pos = pos.max(ds + dl);
                    k += 1;
                }
                _ => {
                    out.push((pos, end - pos));
                    pos = end;
                }
            }
        }
    }
    out
}

pub fn run(args: BackupArgs, quiet: bool) -> Result<i32> {
    if let Some(domain) = args.src.strip_prefix(crate::libvirt::SCHEME) {
        return crate::libvirt::run(domain, &args, quiet);
    }
    args.libvirt.refuse_without_domain()?;
    let (snap, read) = backup(&args, quiet)?;
    let m = &snap.manifest;
    if args.json {
        println!("{}", snapshot_json(&snap, read));
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

/// The backup engine: one new snapshot of `args.dst` from `args.src`, committed; the
/// snapshot and the bytes read from the source. Prints nothing on stdout (progress and
/// notices go to stderr), so that `ferry backup libvirt:` calls it once per disk.
pub(crate) fn backup(args: &BackupArgs, quiet: bool) -> Result<(ferry_repo::SnapshotInfo, u64)> {
    let cancel = crate::interrupt::install()?;
    let src_loc = Location::parse(&args.src).with_context(|| format!("source {:?}", shown(&args.src)))?;
    let (repo_spec, name) = match Location::parse(&args.dst).with_context(|| format!("{:?}", shown(&args.dst)))? {
        Location::Repo { repo, name, id: None } => (repo, name),
        Location::Repo { repo, name, id: Some(_) } => {
            bail!("a backup makes a new snapshot of a disk: write {repo}::{name}, without @ID")
        }
        _ => bail!("{:?} is not a disk in a backup repository: write REPO::NAME", shown(&args.dst)),
    };
    let target = format!("{repo_spec}::{name}");
    if args.since.is_some() && args.dirty_bitmap.is_none() && args.extents_from.is_none() {
        bail!(
            "--since names the snapshot a change map continues: give it with --dirty-bitmap or --extents-from (a \
             backup without a change map reads everything and continues no snapshot)"
        );
    }
    if matches!(src_loc, Location::Repo { .. }) {
        bail!(
            "the source {:?} is a snapshot already: restore it with ferry copy, or back up the disk itself",
            args.src
        );
    }
    let mut remote = args.remote.remote();
    remote.http.retries = args.retries;
    remote.http.retry_delay = args.retry_delay;
    let map_flag = match (&args.dirty_bitmap, &args.extents_from) {
        (Some(_), _) => Some("--dirty-bitmap"),
        (None, Some(_)) => Some("--extents-from"),
        (None, None) => None,
    };
    let on = match args.accept_rollback {
        true => OnRollback::Accept,
        false => OnRollback::Refuse {
            disk: Some(name.clone()),
            back: true,
            way_out: format!(
                "a backup now would continue an older state of {name}. Find out why first (`ferry repo list \
                 {repo_spec}`, the store's logs); if the snapshot was removed on purpose, run the backup again with \
                 --accept-rollback, which makes the store's state the one this host knows"
            ),
            // A change map continues the latest; a backup without one reads everything.
            damaged: map_flag
                .map(|flag| format!("or back up without {flag}: a backup that reads the whole disk goes on")),
        },
    };
    ferry_open::repo::set_password_command(args.password_command.as_deref());
    let repo = ferry_open::repo::open_repository_with(&repo_spec, &remote, args.password_file.as_deref(), on)?;

    // A stopped VM's local qcow2 image without a change map given: ferry keeps its change
    // tracking itself (see `Tracker`).
    let tracked = args.dirty_bitmap.is_none() && args.extents_from.is_none() && !args.force_share && !args.no_bitmap;
    let tracker = match tracked {
        true => ferry_open::open_local_qcow2_for_backup(&src_loc)
            .with_context(|| {
                format!(
                    "source {:?} (opened for writing, to keep its change-tracking bitmap; --no-bitmap reads it \
                     without one)",
                    shown(&args.src)
                )
            })?
            .map(|q| Tracker::new(q, &repo.config().id, &name)),
        false => None,
    };
    if tracker.is_some() && args.resume {
        bail!(
            "--resume cannot continue a backup of a local qcow2 image that ferry tracks itself (opened for writing, \
             it cannot tell whether the image changed since the interrupted run): back up with --no-bitmap (it \
             reads the image read-only, and a resume checks that the file did not change), or without --resume"
        );
    }
    let source = match &tracker {
        Some(t) => ferry_open::Source::plain(Endpoint::Backend(BackendEndpoint::new(shown(&args.src), t.q.clone()))),
        None => ferry_open::source(&src_loc, args.force_share, &remote)
            .with_context(|| format!("source {:?}", shown(&args.src)))?,
    };
    let src = &source.endpoint;
    let size = ferry_open::source_size(src).with_context(|| format!("source {:?}", shown(&args.src)))?;
    let (mut identity, verified) = source_identity(&source, &shown(&args.src));
    if args.resume && !verified && !args.same_source {
        bail!(
            "--resume: ferry cannot tell whether the disk behind {} changed since the interrupted backup, and \
             continuing it from a changed one would store a mix of two versions. If it is the same point in time \
             (the same backup job, still running), add --same-source; otherwise back up without --resume",
            shown(&args.src)
        );
    }
    let every = checkpoint_every()?;
    // The change map's ranges, read once: widened to whole chunks for the copy, and
    // part of the identity a resume must match.
    let mut want: Option<Vec<(u64, u64)>> = match (&args.extents_from, &args.dirty_bitmap) {
        (Some(f), _) => Some(
            ferry_client::copy::ranges::parse_extents_from(f).map_err(|e| anyhow::anyhow!("--extents-from: {e}"))?,
        ),
        (None, Some(b)) => {
            let o = CopyOptions {
                select_context: Some(format!("{META_DIRTY_BITMAP_PREFIX}{b}")),
                ..CopyOptions::default()
            };
            Some(
                ferry_client::copy::selected_ranges(src, &o)
                    .with_context(|| format!("reading the dirty bitmap {b} of {}", shown(&args.src)))?,
            )
        }
        (None, None) => None,
    };
    if let Some(w) = &want {
        identity = format!("{identity} map={}", ranges_digest(w));
    }
    let ranges: Option<Arc<Vec<(u64, u64)>>> = None;
    let asked = match (&args.dirty_bitmap, &args.extents_from) {
        (Some(b), _) => Changes::DirtyBitmap { bitmap: b.clone() },
        (None, Some(f)) => Changes::ExtentsFrom { file: f.clone() },
        (None, None) => Changes::Full,
    };
    let shown_src = shown(&args.src);
    let map_cmd = match (&args.dirty_bitmap, &args.extents_from) {
        (Some(v), _) => Some(("--dirty-bitmap", v)),
        (None, Some(v)) => Some(("--extents-from", v)),
        (None, None) => None,
    }
    .map(|(flag, value)| MapCommand { flag, value, src: &shown_src, target: &target, name: &name });
    let map = map_cmd.as_ref().map(|c| (c, args.since.as_deref()));
    // The base is read again once the disk's lock is held: a backup of the disk that
    // ended while this one waited for the lock made a newer snapshot, and a change map
    // continues the latest one.
    let fixed_time = backup_time()?;
    let mut tries = 0;
    let (writer, changes, base) = loop {
        let base = choose_base(&repo, &name, &target, size, map)?;
        let base_id = base.as_ref().map(|b| b.id.clone());
        let changes = match (&tracker, &base) {
            (Some(t), Some(b)) => match t.continuing(&b.id) {
                Some(bitmap) => Changes::DirtyBitmap { bitmap },
                None => {
                    log::info!(
                        "{} has no bitmap {} continuing snapshot {} of {name}: reading all of it",
                        shown(&args.src),
                        t.name_for(&b.id),
                        short_id(&b.id)
                    );
                    Changes::Full
                }
            },
            _ => asked.clone(),
        };
        let opts = BackupOptions {
            name: name.clone(),
            size,
            base: base.clone(),
            source: shown(&args.src),
            changes: changes.clone(),
            pack_size: PACK_SIZE,
            level: LEVEL,
            wait_lock: args.wait,
            identity: identity.clone(),
            checkpoint_every: Some(every),
            tags: args.tags.clone(),
            note: args.note.clone().unwrap_or_default(),
            time: fixed_time,
        };
        let Some(writer) = start_or_resume(&repo, opts, args.resume, &name, &target)? else {
            tries += 1;
            if tries > 3 {
                bail!("the interrupted backup of {target} keeps changing while this backup starts: try again");
            }
            continue;
        };
        let now = choose_base(&repo, &name, &target, size, map)?.map(|s| s.id);
        if now == base_id {
            break (writer, changes, base);
        }
        // Released by the drop; taken again with the newer base.
        drop(writer);
        tries += 1;
        if tries > 3 {
            bail!("the snapshots of {target} keep changing while this backup starts: try again");
        }
    };
    let dst = BackendEndpoint::new(target.clone(), writer.clone());
    // Never declared as reading zeroes, even without a base: the copy engine then sends
    // the source's holes as zero requests (free: an entry each), so every chunk that data
    // and holes share is completed as it goes, instead of waiting in memory for the commit
    // (64 KiB a chunk, for every such chunk of a sparse disk).
    let dst = Endpoint::Backend(dst);

    let request_size = 1usize << 20;
    let copy_opts = CopyOptions {
        connections: args
            .connections
            .or_else(|| {
                let dst = Location::Repo { repo: repo_spec.clone(), name: name.clone(), id: None };
                ferry_open::copy_workers(&src_loc, &dst)
            })
            .unwrap_or_else(crate::copy::default_connections),
        requests: 4,
        request_size,
        zero_block: ferry_client::copy::DEFAULT_ZERO_BLOCK,
        sparse: true,
        send_file: false,
        flush: false,
        connect: ConnectOptions::default(),
        hash: None,
        select_context: match &changes {
            Changes::DirtyBitmap { bitmap } => Some(format!("{META_DIRTY_BITMAP_PREFIX}{bitmap}")),
            _ => None,
        },
        ranges,
        retry: ferry_client::copy::RetryPolicy {
            retries: args.retries,
            delay: args.retry_delay,
            request_timeout: None,
        },
        rate: args.rate,
        journal: None,
        cancel: Some(cancel),
        existing: false,
    };
    // A change map is copied as ranges widened to whole chunks (a finer map would leave
    // parts of chunks waiting in memory until the commit).
    let mut copy_opts = copy_opts;
    if want.is_none() && copy_opts.select_context.is_some() {
        // ferry's own bitmap of a local qcow2 image.
        want = Some(
            ferry_client::copy::selected_ranges(src, &copy_opts)
                .with_context(|| format!("reading the change map of {}", shown(&args.src)))?,
        );
    }
    let chunk_size = repo.config().chunk_size as u64;
    if let Some(w) = &want {
        // Chunks of the base that are lost (their packs are gone) are read again too: the
        // new snapshot must not name them (the writer refuses to commit it otherwise).
        let mut w = w.clone();
        w.extend(writer.lost_ranges());
        copy_opts.ranges = Some(Arc::new(widen(&merge(w), chunk_size, size)));
        copy_opts.select_context = None;
    }
    // A map of the caller's is checked against its base before anything is read: a sample
    // of the chunks it calls unchanged must be the base's.
    if let (Some(cmd), Some(b), Some(r)) = (&map_cmd, &base, &copy_opts.ranges) {
        crate::backup_base::sample(cmd, &writer, b, src, r, &copy_opts)?;
    }
    // A resumed backup reads what its checkpoint does not hold: of the change map's
    // ranges, or of the whole disk.
    let done = writer.done_ranges();
    if !done.is_empty() {
        let want = match &copy_opts.ranges {
            Some(r) => r.to_vec(),
            None => vec![(0, size)],
        };
        let left = subtract(&want, &done);
        let total: u64 = want.iter().map(|r| r.1).sum();
        let stored = total - left.iter().map(|r| r.1).sum::<u64>();
        if !quiet {
            eprintln!("resuming the backup of {name}: {} of {} already stored", human(stored), human(total));
        }
        copy_opts.select_context = None;
        copy_opts.ranges = Some(Arc::new(left));
    }
    let progress = Progress::default();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let report = std::thread::scope(|s| {
        let bar = (args.progress && !quiet).then(|| s.spawn(|| crate::copy::show_progress(&progress, &stop)));
        let r = copy(src, &dst, &copy_opts, &progress);
        stop.store(true, Ordering::SeqCst);
        if let Some(h) = bar {
            let _ = h.join();
        }
        r
    });
    let report =
        report
            .and_then(|r| if copy_opts.cancelled() { Err(ferry_client::copy::CopyError::Interrupted) } else { Ok(r) });
    if report.is_err() {
        // What is stored so far is kept for --resume (the writer refuses when a write to
        // the repository failed: then nothing new is claimed).
        match writer.checkpoint() {
            Ok(()) => log::info!("what was stored is kept: `ferry backup --resume` continues this backup"),
            Err(e) => log::debug!("no checkpoint after the failure: {e}"),
        }
    }
    let report =
        report.with_context(|| format!("backing up {} into {target} (no snapshot was made)", shown(&args.src)))?;
    let read = report.data_bytes + report.zero_bytes;
    let snap = writer.commit(read).with_context(|| format!("cannot store the snapshot of {target}"))?;
    if let Some(k) = repo.known() {
        k.committed(&snap);
    }
    drop(dst);
    drop(source);
    if let Some(t) = tracker {
        if let Err(e) = t.restart(&snap.id) {
            log::warn!(
                "the snapshot is stored, but the change tracking of {} could not restart ({e:#}): the next backup \
                 of it reads all of it",
                shown(&args.src)
            );
        }
    }
    Ok((snap, read))
}

/// The writer of this backup: a new one, or with `resume` the continuation of NAME's
/// interrupted backup when there is one. Without `resume`, an interrupted backup is
/// discarded (once this one holds the disk's lock). `None`: the checkpoint changed while
/// waiting for the lock; try again.
fn start_or_resume(
    repo: &Arc<ferry_repo::Repository>,
    opts: BackupOptions,
    resume: bool,
    name: &str,
    target: &str,
) -> Result<Option<Arc<SnapshotWriter>>> {
    let found = repo.checkpoint(name);
    // A checkpoint that the disk's latest snapshot supersedes (its backup stored the
    // snapshot and was stopped before removing it) holds nothing to resume: discarded,
    // with a notice, by the plain backup below once it holds the disk's lock.
    let found = match found {
        Ok(Some(ck)) => {
            match repo.snapshots_lenient().ok().and_then(|(all, _)| ck.superseded_by(&all).map(|s| s.id.clone())) {
                Some(by) => {
                    let plain = SnapshotWriter::start(repo.clone(), opts)
                        .with_context(|| format!("cannot back up into {target}"))?;
                    return discard_superseded(repo, plain, &ck, &by, resume, name, target);
                }
                None => Ok(Some(ck)),
            }
        }
        other => other,
    };
    if resume {
        match found {
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!(
                    "cannot resume the backup of {target}: back up without --resume (which discards the checkpoint)"
                )))
            }
            Ok(None) => {
                log::info!("{target} has no interrupted backup to resume: backing up from the start");
                let w = SnapshotWriter::start(repo.clone(), opts)
                    .with_context(|| format!("cannot back up into {target}"))?;
                return Ok(Some(w));
            }
            Ok(Some(ck)) => {
                let differs = ferry_repo::checkpoint_mismatch(&ck.checkpoint, &opts);
                if !differs.is_empty() {
                    bail!(
                        "the interrupted backup of {target} cannot be resumed: {}; back up without --resume (which \
                         discards it, and reads again what it had read)",
                        differs.join("; ")
                    );
                }
                return match SnapshotWriter::resume(repo.clone(), opts, &ck) {
                    Ok(w) => Ok(Some(w)),
                    Err(ferry_repo::Error::Invalid(why)) if why.contains("changed or went away") => Ok(None),
                    Err(e) => Err(anyhow::Error::new(e).context(format!("cannot resume the backup of {target}"))),
                };
            }
        }
    }
    let writer = SnapshotWriter::start(repo.clone(), opts).with_context(|| format!("cannot back up into {target}"))?;
    match found {
        Ok(None) => {}
        Ok(Some(ck)) => {
            log::info!(
                "discarding the interrupted backup of {target} ({} of {} stored; --resume would have continued it)",
                human(ck.checkpoint.done_bytes()),
                human(ck.checkpoint.size)
            );
            repo.discard_checkpoint(name).with_context(|| format!("cannot discard the checkpoint of {target}"))?;
        }
        Err(e) => {
            log::info!("discarding the interrupted backup of {target}: {e}");
            repo.discard_checkpoint(name).with_context(|| format!("cannot discard the checkpoint of {target}"))?;
        }
    }
    Ok(Some(writer))
}

/// Removes `ck`, the checkpoint of `name` that snapshot `by` supersedes, holding the
/// disk's lock (`writer`'s), and says so; `None` (try again) if another backup changed
/// the checkpoint while this one waited for the lock.
fn discard_superseded(
    repo: &Arc<ferry_repo::Repository>,
    writer: Arc<SnapshotWriter>,
    ck: &ferry_repo::CheckpointInfo,
    by: &str,
    resume: bool,
    name: &str,
    target: &str,
) -> Result<Option<Arc<SnapshotWriter>>> {
    match repo.checkpoint(name) {
        Ok(Some(now)) if now.checkpoint == ck.checkpoint => {}
        Ok(None) => {}
        _ => return Ok(None),
    }
    log::info!(
        "discarding the checkpoint of {target} since {}: its backup stored snapshot {} and stopped before removing \
         it, so there is nothing to resume{}",
        ck.checkpoint.time,
        short_id(by),
        if resume { "; backing up without resuming" } else { "" }
    );
    repo.discard_checkpoint(name).with_context(|| format!("cannot discard the checkpoint of {target}"))?;
    Ok(Some(writer))
}

/// Bitmaps ferry keeps in a local qcow2 image it backs up are named
/// `ferry-REPO8-NAME-ID16`: REPO8 the first 8 characters of the repository's id (so one
/// image backed up into two repositories keeps a bitmap for each), NAME the disk, ID16
/// the first 16 hex digits of the snapshot whose read they follow. Earlier ferry named
/// them `ferry-NAME-ID16`: such a bitmap of the disk is removed at the next restart.
const TRACK_PREFIX: &str = "ferry-";
const TRACK_ID: usize = 16;
const TRACK_REPO: usize = 8;

/// The change tracking of a stopped VM's local qcow2 image, kept by ferry. The image is
/// opened for writing (so no one else writes it while it is backed up), read, and only
/// once the snapshot is committed is the bitmap restarted: a bitmap named after the new
/// snapshot is added and the older ones of the same repository and disk removed, while
/// the image is still held, so no write can fall between. A backup reads only what a
/// bitmap marks when it is named after the disk's latest snapshot, enabled and
/// consistent; anything else (the first backup, a failed or interrupted one, a crash
/// between commit and restart, a snapshot forgotten, a bitmap left `in-use` by a crashed
/// VM) reads the whole image. No run can leave a bitmap that misses changes or blocks the
/// next run.
struct Tracker {
    q: Arc<ferry_qcow2::Qcow2>,
    /// `ferry-REPO8-`.
    repo_prefix: String,
    name: String,
}

impl Tracker {
    fn new(q: Arc<ferry_qcow2::Qcow2>, repo_id: &str, name: &str) -> Tracker {
        let repo: String = repo_id.chars().filter(char::is_ascii_alphanumeric).take(TRACK_REPO).collect();
        Tracker { q, repo_prefix: format!("{TRACK_PREFIX}{repo}-"), name: name.to_string() }
    }

    fn name_for(&self, snapshot: &str) -> String {
        format!("{}{}-{}", self.repo_prefix, self.name, &snapshot[..TRACK_ID.min(snapshot.len())])
    }

    /// Whether `bitmap` is one of this repository's and disk's (any snapshot), or one an
    /// earlier ferry kept for this disk: the disk's name must match whole, so that `vm1`
    /// never takes `vm1-off`'s.
    fn is_ours(&self, bitmap: &str) -> bool {
        let of_disk = |rest: &str| {
            rest.rsplit_once('-').is_some_and(|(name, id)| {
                name == self.name && id.len() == TRACK_ID && id.bytes().all(|b| b.is_ascii_hexdigit())
            })
        };
        bitmap.strip_prefix(&self.repo_prefix).is_some_and(of_disk)
            || bitmap.strip_prefix(TRACK_PREFIX).is_some_and(of_disk)
    }

    /// The bitmap that holds every change since `snapshot` was read, if there is one.
    fn continuing(&self, snapshot: &str) -> Option<String> {
        let want = self.name_for(snapshot);
        self.q.bitmaps().into_iter().find(|b| b.name == want && b.auto && !b.in_use).map(|b| b.name)
    }

    /// After `snapshot` is committed: a new, empty bitmap for it; the older ones removed;
    /// the image closed (bitmaps written back).
    fn restart(self, snapshot: &str) -> Result<()> {
        let new = self.name_for(snapshot);
        let old: Vec<String> =
            self.q.bitmaps().into_iter().map(|b| b.name).filter(|n| self.is_ours(n) && *n != new).collect();
        if !self.q.bitmaps().iter().any(|b| b.name == new) {
            self.q.bitmap_add(&new, None, false).with_context(|| format!("adding the bitmap {new}"))?;
        }
        for n in &old {
            self.q.bitmap_remove(n).with_context(|| format!("removing the bitmap {n}"))?;
        }
        // Still shared, it is written back when the last user drops it.
        if let Ok(q) = Arc::try_unwrap(self.q) {
            q.close().context("writing the bitmaps back")?;
        }
        Ok(())
    }
}

/// The latest snapshot of `name`, if it has one. A manifest that cannot be read is
/// skipped with a warning (once), unless the backup reads a change map (`selective`, with
/// `flag`): that damaged manifest may be the disk's latest snapshot (it does not say its
/// disk), and a map continues the latest, so guessing an older one as the base would miss
/// changes.
fn latest(
    repo: &ferry_repo::Repository,
    name: &str,
    target: &str,
    selective: bool,
    flag: &str,
) -> Result<Option<ferry_repo::SnapshotInfo>> {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let (all, bad) =
        repo.snapshots_lenient().with_context(|| format!("cannot find the latest snapshot of {target}"))?;
    if let Some((object, e)) = bad.first() {
        if selective {
            bail!(
                "{object} cannot be read ({}), and it may be the latest snapshot of {name} (a damaged manifest does \
                 not say its disk): {flag} continues the latest snapshot, so this backup cannot tell what it \
                 continues, and nothing was stored. Back up without {flag} (it reads the whole disk)",
                e.reason()
            );
        }
        if !WARNED.swap(true, Ordering::Relaxed) {
            let why = if flag.is_empty() {
                "this backup reads the whole disk".to_string()
            } else {
                format!("{flag} continues the snapshot --since names")
            };
            for (object, e) in &bad {
                log::warn!("skipping {object}: it cannot be read ({}); {why}, so it needs nothing from it", e.reason());
            }
        }
    }
    match ferry_repo::resolve_in(&all, &bad, &repo.store().describe(), name, None) {
        Ok(s) => Ok(Some(s)),
        Err(ferry_repo::Error::NotFound(_)) => Ok(None),
        Err(e) => Err(anyhow::Error::new(e).context(format!("cannot find the latest snapshot of {target}"))),
    }
}

/// What the new snapshot starts from: the latest of the disk, unless there is none or it
/// has another size. A change map (`map`: its command line and `--since`) needs one of
/// the source's size, named by `--since`.
fn choose_base(
    repo: &ferry_repo::Repository,
    name: &str,
    target: &str,
    size: u64,
    map: Option<(&MapCommand<'_>, Option<&str>)>,
) -> Result<Option<ferry_repo::SnapshotInfo>> {
    // A map named by --since needs no guess at the latest: the id says what it continues.
    let guessing = map.is_some_and(|(_, since)| since.is_none());
    let latest = latest(repo, name, target, guessing, map.map_or("", |(cmd, _)| cmd.flag))?;
    let Some((cmd, since)) = map else {
        return Ok(match latest {
            Some(b) if b.manifest.size != size => {
                log::info!(
                    "the source is {size} bytes, the latest snapshot of {name} {}: reading everything (what is \
                     stored already is not stored again)",
                    b.manifest.size
                );
                None
            }
            b => b,
        });
    };
    let flag = cmd.flag;
    let Some(b) = latest else {
        bail!("{target} has no snapshot yet, and the first backup of {name} reads everything: run it without {flag}")
    };
    if b.manifest.size != size {
        bail!(
            "the source is {size} bytes but the latest snapshot of {name} ({}) is {} bytes: a change map cannot \
             continue a disk of another size; take a full backup (without {flag})",
            short_id(&b.id),
            b.manifest.size
        );
    }
    let Some(since) = since else { return Err(cmd.needs_since(&b)) };
    cmd.check_since(since, &b, || repo.resolve(name, Some(since)))?;
    Ok(Some(b))
}

#[cfg(test)]
mod tests {
    use super::{merge, subtract, widen};

    #[test]
    fn merge_ranges() {
        assert_eq!(merge(vec![(10, 5), (0, 4), (4, 2), (12, 10), (30, 0)]), vec![(0, 6), (10, 12)]);
        assert_eq!(merge(vec![]), vec![]);
    }

    #[test]
    fn widen_to_chunks() {
        let k = 1024;
        assert_eq!(
            widen(&[(4 * k, 4 * k), (60 * k, 8 * k), (200 * k, 1)], 64 * k, 1 << 20),
            [(0, 128 * k), (192 * k, 64 * k)]
        );
        // The short last chunk, and a range past the end.
        assert_eq!(widen(&[(130 * k, 1)], 64 * k, 150 * k), [(128 * k, 22 * k)]);
        assert_eq!(widen(&[(200 * k, 5)], 64 * k, 150 * k), []);
    }

    #[test]
    fn subtract_ranges() {
        assert_eq!(subtract(&[(0, 100)], &[]), vec![(0, 100)]);
        assert_eq!(subtract(&[(0, 100)], &[(0, 100)]), vec![]);
        assert_eq!(subtract(&[(0, 100)], &[(10, 20), (50, 10)]), vec![(0, 10), (30, 20), (60, 40)]);
        assert_eq!(subtract(&[(0, 10), (20, 10), (40, 10)], &[(5, 20), (45, 100)]), vec![(0, 5), (25, 5), (40, 5)]);
        assert_eq!(subtract(&[(100, 10)], &[(0, 50), (200, 5)]), vec![(100, 10)]);
    }
}
