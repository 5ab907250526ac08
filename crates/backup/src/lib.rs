//! ferry's backup engine: a new snapshot of a disk in a backup repository, below the
//! command line. `ferry backup SRC REPO::NAME` and `ferry backup libvirt:DOMAIN REPO`
//! (one snapshot per disk, all through one opened repository) call it; the binary only
//! parses flags and prints the [`Report`]s.
//!
//! [`Engine::open`] opens (and unlocks: one passphrase derivation) the repository once;
//! [`Engine::backup`] then makes one new snapshot of a disk from a [`Plan`]: the source
//! is opened as `ferry copy` opens it; the destination is a [`ferry_repo::SnapshotWriter`]
//! on top of the disk's latest snapshot (the base, chosen again once the disk's lock is
//! held), and the copy engine moves the data: every range without a change map, only the
//! changed ranges with a dirty bitmap, an extents file or ferry's own bitmap of a local
//! qcow2 image (`tracker`) (everything else is the base's, which `since` must name and
//! a sample of the source must match: see `base`). Holes and zero ranges are never
//! stored: they are written as zeroes (an entry, no data), never read. A checkpoint is
//! stored every `checkpoint_every`; an interrupted backup is resumed or discarded.
//!
//! `unsafe`: forbidden.

#![forbid(unsafe_code)]

mod base;
mod ranges;
mod tracker;

use anyhow::{bail, Context, Result};
use base::MapCommand;
use ferry_client::copy::{copy, BackendEndpoint, CopyOptions, Endpoint, Progress};
use ferry_client::ConnectOptions;
use ferry_open::{shown, Location};
use ferry_proto::consts::META_DIRTY_BITMAP_PREFIX;
use ferry_repo::format::Changes;
use ferry_repo::known::OnRollback;
use ferry_repo::{BackupOptions, Repository, SnapshotInfo, SnapshotWriter};
use ranges::{merge, ranges_digest, subtract, widen};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tracker::Tracker;

/// Packs are closed at this size: few objects (and requests, on S3) per backup.
const PACK_SIZE: usize = 32 << 20;
/// zstd level of new chunks: 1, measured (ARCHITECTURE.md, "zstd") at 220-415 MB/s to 0.29
/// of a binary's size against level 3's 200-250 MB/s to 0.27.
const LEVEL: i32 = 1;

/// A snapshot id as lists show it: its first 8 hex digits.
pub fn short_id(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

/// Bytes for people: `512 B`, `64.0 KiB`, `1.5 GiB`.
pub fn human(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// A change map: which ranges of the source changed since the snapshot `since` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Map {
    /// The source's dirty bitmap (its `qemu:dirty-bitmap:NAME` context).
    DirtyBitmap(String),
    /// The ranges listed in a file (as `ferry copy --extents-from` takes them).
    ExtentsFrom(String),
}

impl Map {
    /// The flag that gives it, as messages name it.
    pub fn flag(&self) -> &'static str {
        match self {
            Map::DirtyBitmap(_) => "--dirty-bitmap",
            Map::ExtentsFrom(_) => "--extents-from",
        }
    }

    fn value(&self) -> &str {
        match self {
            Map::DirtyBitmap(v) | Map::ExtentsFrom(v) => v,
        }
    }
}

/// One disk's backup: what to read, where to store it and how.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// The source, as `ferry copy` takes it.
    pub src: String,
    /// The repository disk (NAME of REPO::NAME).
    pub name: String,
    /// The change map, if the source has one; `None` reads everything (or what ferry's own
    /// bitmap of a local qcow2 image marks).
    pub map: Option<Map>,
    /// The snapshot the change map continues (an id or a unique prefix).
    pub since: Option<String>,
    /// Continue an interrupted backup of the disk instead of discarding it.
    pub resume: bool,
    /// With `resume` from an NBD export: it is the same point in time as the interrupted run.
    pub same_source: bool,
    /// Read a local source while another program writes it.
    pub force_share: bool,
    /// Keep no change-tracking bitmap in a local qcow2 image.
    pub no_bitmap: bool,
    /// Accept the store's state when the disk's snapshots went back.
    pub accept_rollback: bool,
    /// Connections to the source; `None`: as the source allows, else the run's default.
    pub connections: Option<usize>,
    /// Most bytes read per second.
    pub rate: Option<u64>,
    pub retries: u32,
    pub retry_delay: Duration,
    /// How long to wait for the disk's lock.
    pub wait: Option<Duration>,
    pub tags: Vec<String>,
    pub note: Option<String>,
}

impl Plan {
    /// Checks the plan before anything is opened: the source is a spec ferry reads and no
    /// snapshot, and `since` comes with a change map.
    pub fn check(&self) -> Result<Location> {
        let src = Location::parse(&self.src).with_context(|| format!("source {:?}", shown(&self.src)))?;
        self.check_parsed(&src)?;
        Ok(src)
    }

    fn check_parsed(&self, src: &Location) -> Result<()> {
        if self.since.is_some() && self.map.is_none() {
            bail!(
                "--since names the snapshot a change map continues: give it with --dirty-bitmap or --extents-from (a \
                 backup without a change map reads everything and continues no snapshot)"
            );
        }
        if matches!(src, Location::Repo { .. }) {
            bail!(
                "the source {:?} is a snapshot already: restore it with ferry copy, or back up the disk itself",
                self.src
            );
        }
        Ok(())
    }

    /// What the repository does when this disk's snapshots went back since this host last
    /// used it (`spec`: the repository as given).
    pub fn on_rollback(&self, spec: &str) -> OnRollback {
        let name = &self.name;
        match self.accept_rollback {
            true => OnRollback::Accept,
            false => OnRollback::Refuse {
                disk: Some(name.clone()),
                back: true,
                way_out: format!(
                    "a backup now would continue an older state of {name}. Find out why first (`ferry repo list \
                     {spec}`, the store's logs); if the snapshot was removed on purpose, run the backup again with \
                     --accept-rollback, which makes the store's state the one this host knows"
                ),
                // A change map continues the latest; a backup without one reads everything.
                damaged: self
                    .map
                    .as_ref()
                    .map(|m| format!("or back up without {}: a backup that reads the whole disk goes on", m.flag())),
            },
        }
    }
}

/// REPO and NAME of a backup's destination `REPO::NAME` (`dst`).
pub fn target(dst: &str) -> Result<(String, String)> {
    match Location::parse(dst).with_context(|| format!("{:?}", shown(dst)))? {
        Location::Repo { repo, name, id: None } => Ok((repo, name)),
        Location::Repo { repo, name, id: Some(_) } => {
            bail!("a backup makes a new snapshot of a disk: write {repo}::{name}, without @ID")
        }
        _ => bail!("{:?} is not a disk in a backup repository: write REPO::NAME", shown(dst)),
    }
}

/// How the engine runs, the same for every disk of a run.
#[derive(Clone)]
pub struct Settings {
    /// No notices on stderr (progress neither).
    pub quiet: bool,
    /// Shows a copy's progress until the flag is set (run on its own thread); `None`: none.
    pub progress: Option<fn(&Progress, &AtomicBool)>,
    /// Set to stop the backup (a signal): what is stored so far is kept for a resume.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Connections to a source that does not say how many it takes.
    pub connections: usize,
    /// Seconds between checkpoints of a running backup.
    pub checkpoint_every: Duration,
    /// The time snapshots record instead of this host's clock.
    pub time: Option<jiff::Timestamp>,
}

/// A disk's new snapshot, committed.
#[derive(Debug, Clone)]
pub struct Report {
    pub snapshot: SnapshotInfo,
    /// The bytes read from the source (data and zeroes).
    pub read: u64,
}

/// A repository opened (and unlocked) once, and the backups made through it.
pub struct Engine {
    repo: Arc<Repository>,
    spec: String,
    remote: ferry_open::Remote,
    settings: Settings,
}

impl Engine {
    /// Opens the repository `spec` (its passphrase from `password_file`, else as
    /// [`ferry_open::repo`] finds one: derived once for every backup of the run); `on`:
    /// what a listing does when the store went back (each backup then holds its own disk
    /// to [`Plan::on_rollback`]).
    pub fn open(
        spec: &str,
        remote: ferry_open::Remote,
        password_file: Option<&Path>,
        on: OnRollback,
        settings: Settings,
    ) -> Result<Engine> {
        let repo = ferry_open::repo::open_repository_with(spec, &remote, password_file, on)?;
        Ok(Engine { repo, spec: spec.to_string(), remote, settings })
    }

    /// The repository, for what a caller records beside the snapshots (points).
    pub fn repository(&self) -> &Arc<Repository> {
        &self.repo
    }

    /// The repository as the caller gave it.
    pub fn spec(&self) -> &str {
        &self.spec
    }

    /// One new snapshot of `plan.name` from `plan.src`, committed. Prints nothing on
    /// stdout (progress and notices go to stderr).
    pub fn backup(&self, plan: &Plan) -> Result<Report> {
        let src_loc = plan.check()?;
        let (repo, name, repo_spec) = (&self.repo, &plan.name, &self.spec);
        let quiet = self.settings.quiet;
        let target = format!("{repo_spec}::{name}");
        if let Some(k) = repo.known() {
            k.hold_to(plan.on_rollback(repo_spec));
        }
        let mut remote = self.remote.clone();
        remote.http.retries = plan.retries;
        remote.http.retry_delay = plan.retry_delay;
        // A stopped VM's local qcow2 image without a change map given: ferry keeps its change
        // tracking itself (see `Tracker`).
        let tracked = plan.map.is_none() && !plan.force_share && !plan.no_bitmap;
        let tracker = match tracked {
            true => ferry_open::open_local_qcow2_for_backup(&src_loc)
                .with_context(|| {
                    format!(
                        "source {:?} (opened for writing, to keep its change-tracking bitmap; --no-bitmap reads it \
                         without one)",
                        shown(&plan.src)
                    )
                })?
                .map(|q| Tracker::new(q, &repo.config().id, name)),
            false => None,
        };
        if tracker.is_some() && plan.resume {
            bail!(
                "--resume cannot continue a backup of a local qcow2 image that ferry tracks itself (opened for writing, \
                 it cannot tell whether the image changed since the interrupted run): back up with --no-bitmap (it \
                 reads the image read-only, and a resume checks that the file did not change), or without --resume"
            );
        }
        let source = match &tracker {
            Some(t) => {
                ferry_open::Source::plain(Endpoint::Backend(BackendEndpoint::new(shown(&plan.src), t.q.clone())))
            }
            None => ferry_open::source(&src_loc, plan.force_share, &remote)
                .with_context(|| format!("source {:?}", shown(&plan.src)))?,
        };
        let src = &source.endpoint;
        let size = ferry_open::source_size(src).with_context(|| format!("source {:?}", shown(&plan.src)))?;
        let (mut identity, verified) = source_identity(&source, &shown(&plan.src));
        if plan.resume && !verified && !plan.same_source {
            bail!(
                "--resume: ferry cannot tell whether the disk behind {} changed since the interrupted backup, and \
                 continuing it from a changed one would store a mix of two versions. If it is the same point in time \
                 (the same backup job, still running), add --same-source; otherwise back up without --resume",
                shown(&plan.src)
            );
        }
        // The change map's ranges, read once: widened to whole chunks for the copy, and
        // part of the identity a resume must match.
        let mut want: Option<Vec<(u64, u64)>> = match &plan.map {
            Some(Map::ExtentsFrom(f)) => Some(
                ferry_client::copy::ranges::parse_extents_from(f)
                    .map_err(|e| anyhow::anyhow!("--extents-from: {e}"))?,
            ),
            Some(Map::DirtyBitmap(b)) => {
                let o = CopyOptions {
                    select_context: Some(format!("{META_DIRTY_BITMAP_PREFIX}{b}")),
                    ..CopyOptions::default()
                };
                Some(
                    ferry_client::copy::selected_ranges(src, &o)
                        .with_context(|| format!("reading the dirty bitmap {b} of {}", shown(&plan.src)))?,
                )
            }
            None => None,
        };
        if let Some(w) = &want {
            identity = format!("{identity} map={}", ranges_digest(w));
        }
        let ranges: Option<Arc<Vec<(u64, u64)>>> = None;
        let asked = match &plan.map {
            Some(Map::DirtyBitmap(b)) => Changes::DirtyBitmap { bitmap: b.clone() },
            Some(Map::ExtentsFrom(f)) => Changes::ExtentsFrom { file: f.clone() },
            None => Changes::Full,
        };
        let shown_src = shown(&plan.src);
        let map_cmd = plan.map.as_ref().map(|m| MapCommand {
            flag: m.flag(),
            value: m.value(),
            src: &shown_src,
            target: &target,
            name,
        });
        let map = map_cmd.as_ref().map(|c| (c, plan.since.as_deref()));
        // The base is read again once the disk's lock is held: a backup of the disk that
        // ended while this one waited for the lock made a newer snapshot, and a change map
        // continues the latest one.
        let mut tries = 0;
        let (writer, changes, base) = loop {
            let base = choose_base(repo, name, &target, size, map)?;
            let base_id = base.as_ref().map(|b| b.id.clone());
            let changes = match (&tracker, &base) {
                (Some(t), Some(b)) => match t.continuing(&b.id) {
                    Some(bitmap) => Changes::DirtyBitmap { bitmap },
                    None => {
                        log::info!(
                            "{} has no bitmap {} continuing snapshot {} of {name}: reading all of it",
                            shown(&plan.src),
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
                source: shown(&plan.src),
                changes: changes.clone(),
                pack_size: PACK_SIZE,
                level: LEVEL,
                wait_lock: plan.wait,
                identity: identity.clone(),
                checkpoint_every: Some(self.settings.checkpoint_every),
                tags: plan.tags.clone(),
                note: plan.note.clone().unwrap_or_default(),
                time: self.settings.time,
            };
            let Some(writer) = start_or_resume(repo, opts, plan.resume, name, &target)? else {
                tries += 1;
                if tries > 3 {
                    bail!("the interrupted backup of {target} keeps changing while this backup starts: try again");
                }
                continue;
            };
            let now = choose_base(repo, name, &target, size, map)?.map(|s| s.id);
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
            connections: plan
                .connections
                .or_else(|| {
                    let dst = Location::Repo { repo: repo_spec.clone(), name: name.clone(), id: None };
                    ferry_open::copy_workers(&src_loc, &dst)
                })
                .unwrap_or(self.settings.connections),
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
                retries: plan.retries,
                delay: plan.retry_delay,
                request_timeout: None,
            },
            rate: plan.rate,
            journal: None,
            cancel: self.settings.cancel.clone(),
            existing: false,
        };
        // A change map is copied as ranges widened to whole chunks (a finer map would leave
        // parts of chunks waiting in memory until the commit).
        let mut copy_opts = copy_opts;
        if want.is_none() && copy_opts.select_context.is_some() {
            // ferry's own bitmap of a local qcow2 image.
            want = Some(
                ferry_client::copy::selected_ranges(src, &copy_opts)
                    .with_context(|| format!("reading the change map of {}", shown(&plan.src)))?,
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
            base::sample(cmd, &writer, b, src, r, &copy_opts)?;
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
            let (p, st) = (&progress, &stop);
            let bar = self.settings.progress.filter(|_| !quiet).map(|show| s.spawn(move || show(p, st)));
            let r = copy(src, &dst, &copy_opts, &progress);
            stop.store(true, Ordering::SeqCst);
            if let Some(h) = bar {
                let _ = h.join();
            }
            r
        });
        let report = report.and_then(|r| {
            if copy_opts.cancelled() {
                Err(ferry_client::copy::CopyError::Interrupted)
            } else {
                Ok(r)
            }
        });
        if report.is_err() {
            // What is stored so far is kept for --resume (the writer refuses when a write to
            // the repository failed: then nothing new is claimed).
            match writer.checkpoint() {
                Ok(()) => log::info!("what was stored is kept: `ferry backup --resume` continues this backup"),
                Err(e) => log::debug!("no checkpoint after the failure: {e}"),
            }
        }
        let report =
            report.with_context(|| format!("backing up {} into {target} (no snapshot was made)", shown(&plan.src)))?;
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
                    shown(&plan.src)
                );
            }
        }
        Ok(Report { snapshot: snap, read })
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
    #[test]
    fn human_sizes() {
        assert_eq!(super::human(0), "0 B");
        assert_eq!(super::human(1023), "1023 B");
        assert_eq!(super::human(65536), "64.0 KiB");
        assert_eq!(super::human(3 << 29), "1.5 GiB");
    }
}
