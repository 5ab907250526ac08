//! Snapshots copied from one repository into another (`ferry repo copy`): directory to
//! S3 and back, encrypted or not, under other keys and other chunk sizes.
//!
//! Each snapshot is written through the destination's own [`SnapshotWriter`], so its
//! packs, pages, index objects, checkpoints and locks follow the destination's rules; no
//! object is written here. With the same chunk size a snapshot's entries are carried
//! over as they are: an entry whose blob the destination has costs nothing, and only the
//! chunks it lacks are read from the source (decoded, their SHA-256 checked against the
//! entry) and stored. Ids differ between repositories (an encrypted one keys them), so
//! each is derived again from the digest. With another chunk size the snapshot is read
//! as a disk and written as a backup is, skipping the ranges where it equals the
//! snapshot the destination's previous copy was made of.
//!
//! A copy keeps what means something in the destination: the disk's name, the time (no
//! later than the copier's clock), host, source, tags, note and blkhash; its `parent` is
//! the destination's copy of the source snapshot's parent when it has one (the source's
//! order carries over, whatever its clocks said), else the destination's latest snapshot
//! of the disk whose order time is no later than the source snapshot's order time
//! (FORMAT.md §7), so that a copy of an old snapshot never becomes the disk's latest; and
//! `copied_from` says where it came from (FORMAT.md §7), which makes a second copy of it
//! a no-op: rerunning is the resume (and an interrupted snapshot continues from the
//! writer's last checkpoint).
//!
//! Locks: a `forget` lock on the source, which is exclusive (backups of it go on; a forget
//! or gc, which could remove what is being copied, and another copy from it are refused,
//! or wait when asked to), and each disk's `backup` lock on the destination, as a backup
//! takes it. A shared kind of lock for readers is not used: a ferry that predates it would
//! not know it (an unknown lock conflicts with every other, backups too).
use crate::format::{CopiedFrom, Digest, LockKind, ZERO};
use crate::repo::{order_keys, parse_time};
use crate::writer::{checkpoint_mismatch, copy_time, CopyOrigin};
use crate::{
    lock, resolve_in, BackupOptions, Error, Repository, Result, SnapshotImage, SnapshotInfo, SnapshotWriter,
    MIN_CACHE_BYTES,
};
use ferry_backend::{Backend, ZeroMode};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Which snapshots of the source are copied.
#[derive(Debug, Clone)]
pub enum Select {
    /// Every snapshot.
    All,
    /// Every snapshot of one disk.
    Disk(String),
    /// One snapshot: a disk and a unique prefix of its id.
    One { name: String, id: String },
}

/// Called with the bytes about to be read from the source, before they are read (a rate
/// limit sleeps there).
pub type Throttle = Arc<dyn Fn(u64) + Send + Sync>;

#[derive(Clone)]
pub struct CopyOptions {
    /// Chunks read and stored side by side.
    pub threads: usize,
    /// The destination writer's checkpoints (FORMAT.md §7a), so that an interrupted
    /// copy of a snapshot continues where it was.
    pub checkpoint_every: Option<Duration>,
    /// Wait this long for a lock (the source's forget lock, a disk's backup lock in the
    /// destination), instead of failing.
    pub wait_lock: Option<Duration>,
    /// Set (by a signal handler) to stop: the snapshot being copied is checkpointed.
    pub cancel: Option<Arc<AtomicBool>>,
    /// What waits before each read from the source (`--rate`).
    pub throttle: Option<Throttle>,
}

impl Default for CopyOptions {
    fn default() -> CopyOptions {
        CopyOptions {
            threads: std::thread::available_parallelism().map_or(4, |n| n.get()).clamp(4, 16),
            checkpoint_every: Some(crate::DEFAULT_CHECKPOINT_EVERY),
            wait_lock: None,
            cancel: None,
            throttle: None,
        }
    }
}

/// The bytes of the snapshot being copied that are dealt with, of those to deal with.
#[derive(Debug, Default)]
pub struct Progress {
    pub done: AtomicU64,
    pub total: AtomicU64,
}

/// A snapshot copied.
#[derive(Debug, Clone, Serialize)]
pub struct Copied {
    pub name: String,
    /// Its id in the source.
    pub source_id: String,
    /// The copy's id in the destination.
    pub id: String,
    pub time: String,
    pub size: u64,
    /// The copy's parent in the destination.
    pub parent: Option<String>,
    /// Chunks stored in the destination (it lacked them).
    pub chunks_sent: u64,
    /// Stored bytes added to the destination (chunks, pages, index objects).
    pub bytes_sent: u64,
    /// Bytes of chunks read from the source.
    pub bytes_read: u64,
    /// It continued an interrupted copy.
    pub resumed: bool,
    /// The chunk sizes differ: the snapshot was cut into the destination's chunks again.
    pub rechunked: bool,
}

/// A snapshot not copied because the destination has it already.
#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    pub name: String,
    pub source_id: String,
    /// The destination's snapshot that is it.
    pub id: String,
}

/// A snapshot that could not be copied.
#[derive(Debug, Clone, Serialize)]
pub struct Failed {
    /// Its disk, or empty when its manifest cannot be read.
    pub name: String,
    pub source_id: String,
    pub error: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct CopyReport {
    pub copied: Vec<Copied>,
    pub skipped: Vec<Skipped>,
    pub failed: Vec<Failed>,
    pub chunks_sent: u64,
    pub bytes_sent: u64,
    pub bytes_read: u64,
}

/// What the copy is doing, as it happens (for progress and messages).
#[derive(Debug)]
pub enum Event<'a> {
    /// Snapshot `at` (from 0) of `of` is being copied; `resumed`: bytes stored already by
    /// the interrupted copy it continues.
    Start {
        snap: &'a SnapshotInfo,
        at: usize,
        of: usize,
        resumed: Option<u64>,
    },
    Copied(&'a Copied),
    Skipped(&'a Skipped),
    Failed(&'a Failed),
}

/// How the checkpoint of a copy names what it copies (its `identity`), before the ids.
const COPY_IDENTITY: &str = "ferry repo copy of snapshot";

/// The `identity` of the checkpoint of a copy of the snapshot `from` names (the first
/// snapshot of a chain of copies): every copy of one snapshot has the same, whichever
/// repository it is copied from, so a copy made (`copied_from`) tells its leftover
/// checkpoint.
pub(crate) fn copy_identity(from: &CopiedFrom) -> String {
    format!("{COPY_IDENTITY} {} of repository {}", from.snapshot, from.repository)
}

/// What a copy of `snap` (of the repository `src_id`) says it came from: its own
/// `copied_from` for a copy (a copy of a copy names the first snapshot), else `snap`.
fn origin_of(snap: &SnapshotInfo, src_id: &str) -> CopiedFrom {
    snap.manifest.copied_from.clone().unwrap_or_else(|| CopiedFrom {
        repository: src_id.to_string(),
        snapshot: snap.id.clone(),
        time: snap.manifest.time.clone(),
    })
}

/// Removes disk `name`'s checkpoint in `dst` when it is one of a copy of the snapshot
/// `from` names, which the destination has (a copy stopped between storing its manifest
/// and removing its checkpoint). Under the disk's backup lock, so that no copy or backup
/// of the disk is writing it meanwhile; a lock not had leaves it for a later run.
fn discard_leftover(dst: &Arc<Repository>, name: &str, from: &CopiedFrom, wait: Option<Duration>) {
    let identity = copy_identity(from);
    let is_leftover =
        |dst: &Repository| matches!(dst.checkpoint(name), Ok(Some(ck)) if ck.checkpoint.identity == identity);
    if !is_leftover(dst) {
        return;
    }
    let shown = dst.store.describe();
    let _lock = match lock::acquire(&dst.store, LockKind::Backup, Some(dst.crypto.disk_tag(name)), wait) {
        Ok(g) => g,
        Err(e) => {
            log::info!("the leftover checkpoint of a finished copy of {name} in {shown} stays: {e}");
            return;
        }
    };
    // Read again under the lock: a copy that held it may have replaced it.
    if is_leftover(dst) {
        match dst.discard_checkpoint(name) {
            Ok(()) => log::info!("removed the leftover checkpoint of a finished copy of {name} from {shown}"),
            Err(e) => log::warn!("the leftover checkpoint of a finished copy of {name} in {shown} stays: {e}"),
        }
    }
}

/// Whether a checkpoint is that of an interrupted copy (which `ferry repo copy` run again
/// continues), not of a backup.
pub fn is_copy(ck: &crate::format::Checkpoint) -> bool {
    ck.identity.starts_with(COPY_IDENTITY)
}

/// Chunks classified and entered at a time: bounds the lists a copy keeps beside the
/// writer's own (a chunk index and a digest each).
const BATCH: usize = 1 << 20;
/// Bytes read from the source at once by one thread (neighbouring chunks of one pack
/// come in one ranged read).
const READ_BYTES: u64 = 1 << 20;

/// Copies the snapshots `select` names from `src` into `dst`, oldest first, each after
/// its parent: skips those `dst` has already, goes on past one that fails (the report
/// says which and why). An error is returned for what stops every snapshot: a lock not
/// had, a store that cannot be listed, an interruption.
pub fn copy(
    src: &Arc<Repository>,
    dst: &Arc<Repository>,
    select: &Select,
    opts: &CopyOptions,
    progress: &Progress,
    on: &dyn Fn(Event),
) -> Result<CopyReport> {
    // A source the copy cannot write (read-only credentials, a read-only mount) is read
    // as restores read, without a lock: a forget or gc of it meanwhile can only make the
    // copy of a snapshot fail (named, with nothing wrong stored).
    let src_lock = match lock::acquire_shared(&src.store, opts.wait_lock) {
        Ok(g) => Some(g),
        Err(Error::Store { what, source })
            if matches!(
                source.kind(),
                std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem
            ) =>
        {
            log::warn!(
                "cannot lock {} ({what}: {source}): copying without a lock; a forget or gc of it meanwhile can make a \
                 snapshot's copy fail",
                src.store.describe()
            );
            None
        }
        Err(e) => return Err(e),
    };
    let (all, bad) = src.snapshots_lenient()?;
    let shown = src.store.describe();
    let chosen: Vec<SnapshotInfo> = match select {
        Select::All => all.clone(),
        Select::Disk(name) => {
            let v: Vec<SnapshotInfo> = all.iter().filter(|s| s.manifest.name == *name).cloned().collect();
            if v.is_empty() && bad.is_empty() {
                resolve_in(&all, &bad, &shown, name, None)?;
            }
            v
        }
        Select::One { name, id } => vec![resolve_in(&all, &bad, &shown, name, Some(id))?],
    };
    let mut report = CopyReport::default();
    // A manifest that cannot be read may be of any disk, the one asked for too: a
    // failure whatever is selected (the command then exits non-zero).
    for (object, e) in &bad {
        let f = Failed {
            name: String::new(),
            source_id: object.strip_prefix("snapshots/").unwrap_or(object).to_string(),
            error: format!("{object} in {shown} cannot be read (it may be of any disk): {}", e.reason()),
        };
        on(Event::Failed(&f));
        report.failed.push(f);
    }
    let (mut theirs, _) = dst.snapshots_skipping()?;
    let src_id = src.config().id.clone();
    // Each source snapshot's order time (FORMAT.md §7), for the parent of its copy.
    let order: HashMap<&str, jiff::Timestamp> =
        all.iter().zip(order_keys(&all)).filter_map(|(s, (t, _))| Some((s.id.as_str(), t?))).collect();
    let source = Source { all: &all, order: &order, index: std::sync::OnceLock::new() };
    for (at, snap) in chosen.iter().enumerate() {
        if opts.cancel.as_ref().is_some_and(|c| c.load(Ordering::SeqCst)) {
            return Err(Error::Interrupted);
        }
        let skip = |have: String| {
            discard_leftover(dst, &snap.manifest.name, &origin_of(snap, &src_id), opts.wait_lock);
            Skipped { name: snap.manifest.name.clone(), source_id: snap.id.clone(), id: have }
        };
        if let Some(have) = already(&theirs, &src_id, &dst.config().id, snap) {
            let s = skip(have);
            on(Event::Skipped(&s));
            report.skipped.push(s);
            continue;
        }
        // What is read from the source must stay there: a forget or gc would have
        // waited for this lock, unless it was lost (a stopped host).
        if let Some(l) = &src_lock {
            l.check()?;
        }
        match copy_one(src, dst, snap, &source, &theirs, opts, progress, &|resumed| {
            on(Event::Start { snap, at, of: chosen.len(), resumed })
        }) {
            // Another copy stored it since the listing: the listing under the lock has it.
            Ok(Done::There(have, fresh)) => {
                theirs = fresh;
                let s = skip(have);
                on(Event::Skipped(&s));
                report.skipped.push(s);
            }
            Ok(Done::Copied(done)) => {
                let (c, info) = *done;
                report.chunks_sent += c.chunks_sent;
                report.bytes_sent += c.bytes_sent;
                report.bytes_read += c.bytes_read;
                on(Event::Copied(&c));
                report.copied.push(c);
                theirs.push(info);
                crate::repo::sort_snapshots(&mut theirs);
            }
            Err(Error::Interrupted) => return Err(Error::Interrupted),
            Err(e) => {
                let f = Failed {
                    name: snap.manifest.name.clone(),
                    source_id: snap.id.clone(),
                    error: format!(
                        "snapshot {} of {} in {shown}: {e}",
                        &snap.id[..snap.id.len().min(8)],
                        snap.manifest.name
                    ),
                };
                on(Event::Failed(&f));
                report.failed.push(f);
            }
        }
    }
    Ok(report)
}

/// The destination's snapshot that `snap` (of the repository `src_id`) is already, if
/// any: one copied from it, the one it was copied from (a copy back), a copy of the
/// snapshot it is a copy of (`copied_from` names the first snapshot of a chain of
/// copies), or the very same manifest.
fn already(theirs: &[SnapshotInfo], src_id: &str, dst_id: &str, snap: &SnapshotInfo) -> Option<String> {
    let from = snap.manifest.copied_from.as_ref();
    theirs
        .iter()
        .filter(|t| t.manifest.name == snap.manifest.name)
        .find(|t| {
            let theirs_from = t.manifest.copied_from.as_ref();
            t.id == snap.id
                || theirs_from.is_some_and(|c| c.repository == src_id && c.snapshot == snap.id)
                || from.is_some_and(|c| c.repository == dst_id && c.snapshot == t.id)
                || from.zip(theirs_from).is_some_and(|(a, b)| a.repository == b.repository && a.snapshot == b.snapshot)
        })
        .map(|t| t.id.clone())
}

/// The source's snapshots (as listed), their order times by id, and its index once a
/// copy needs it (opened once for every snapshot copied).
struct Source<'a> {
    all: &'a [SnapshotInfo],
    order: &'a HashMap<&'a str, jiff::Timestamp>,
    index: std::sync::OnceLock<Option<crate::RunIndex>>,
}

/// The parent of the copy of `snap` (of the repository `src_id`) in a destination
/// (`dst_id`) holding `theirs` (oldest first, FORMAT.md §7's order): the destination's
/// copy of `snap`'s parent, when it has one, so that the source's order carries over
/// whatever its clocks said; else the latest snapshot of the disk whose order time is no
/// later than `snap`'s order time in the source. The copy then sorts right after it, and
/// before every snapshot dated later: a copy of an old snapshot does not become the
/// disk's latest.
fn parent_for<'a>(
    source: &Source,
    theirs: &'a [SnapshotInfo],
    src_id: &str,
    dst_id: &str,
    snap: &SnapshotInfo,
) -> Option<&'a SnapshotInfo> {
    let name = &snap.manifest.name;
    let parent = snap.manifest.parent.as_deref().and_then(|p| source.all.iter().find(|s| s.id == p));
    if let Some(have) = parent.and_then(|p| already(theirs, src_id, dst_id, p)) {
        return theirs.iter().find(|t| t.id == have);
    }
    let t = source.order.get(snap.id.as_str()).copied().or_else(|| parse_time(&snap.manifest.time))?;
    let keys = order_keys(theirs);
    theirs
        .iter()
        .zip(keys)
        .filter(|(s, (k, _))| s.manifest.name == *name && k.is_some_and(|k| k <= t))
        .map(|(s, _)| s)
        .next_back()
}

/// What [`copy_one`] did.
enum Done {
    /// Copied: the report of it, and the new snapshot.
    Copied(Box<(Copied, SnapshotInfo)>),
    /// Found in the destination once its disk's lock was held (another copy stored it
    /// since the destination was listed): the copy there, and the destination's snapshots
    /// as listed under the lock.
    There(String, Vec<SnapshotInfo>),
}

/// Copies one snapshot, unless the destination has it once the disk's lock is held.
#[allow(clippy::too_many_arguments)]
fn copy_one(
    src: &Arc<Repository>,
    dst: &Arc<Repository>,
    snap: &SnapshotInfo,
    source: &Source,
    theirs: &[SnapshotInfo],
    opts: &CopyOptions,
    progress: &Progress,
    started: &dyn Fn(Option<u64>),
) -> Result<Done> {
    let m = &snap.manifest;
    let name = m.name.clone();
    let time = copy_time(&m.time, jiff::Timestamp::now());
    let image = SnapshotImage::open_with_cache(src.clone(), snap, MIN_CACHE_BYTES)?;
    let src_cs = src.config().chunk_size as u64;
    let blkhash = image.blkhash().map(|d| crate::format::hex(&d));
    if m.blkhash.is_some() && blkhash.is_some() && m.blkhash != blkhash {
        return Err(Error::damaged(
            format!("snapshots/{}", snap.id),
            "its blkhash is not that of its chunks' digests: the manifest or its pages are damaged",
        ));
    }
    // A copy of a copy names the snapshot the first copy was made of: every copy of one
    // snapshot, however it travelled, is known as the same one.
    let from = origin_of(snap, &src.config().id);
    let identity = copy_identity(&from);
    let origin = CopyOrigin { host: m.host.clone(), time, from };
    let mut theirs = theirs.to_vec();
    let (parent, writer, resumed) = loop {
        let parent = parent_for(source, &theirs, &src.config().id, &dst.config().id, snap).cloned();
        let backup = BackupOptions {
            base: parent.clone(),
            source: m.source.clone(),
            identity: identity.clone(),
            checkpoint_every: opts.checkpoint_every,
            wait_lock: opts.wait_lock,
            tags: m.tags.clone(),
            note: m.note.clone(),
            ..BackupOptions::new(&name, m.size)
        };
        let (writer, resumed) = start_or_resume(dst, backup, &theirs)?;
        // Listed again now that the writer holds the disk's lock: a copy of the same snapshot
        // that committed since `theirs` was listed (a `ferry repo copy` beside this one) must
        // not be stored twice, and one of another snapshot may be a nearer base.
        let (fresh, _) = dst.snapshots_skipping()?;
        if let Some(have) = already(&fresh, &src.config().id, &dst.config().id, snap) {
            drop(writer);
            return Ok(Done::There(have, fresh));
        }
        let now = parent_for(source, &fresh, &src.config().id, &dst.config().id, snap);
        if now.map(|p| &p.id) == parent.as_ref().map(|p| &p.id) {
            break (parent, writer, resumed);
        }
        log::debug!("the base of the copy of {name} changed while its lock was awaited: starting again on it");
        drop(writer);
        theirs = fresh;
    };
    started(resumed.then(|| writer.done_ranges().iter().map(|r| r.1).sum()));
    let rechunked = src_cs != dst.config().chunk_size as u64;
    let source_of = parent.as_ref().and_then(|p| p.manifest.copied_from.as_ref());
    let copied = match rechunked {
        false => copy_entries(&image, &writer, opts, progress),
        true => copy_bytes(src, source, &image, &writer, source_of, opts, progress),
    };
    let read = match copied {
        Ok(read) => read,
        Err(e) => {
            // What is stored so far is kept for the next run, when one is due anyway.
            if matches!(e, Error::Interrupted) {
                if let Err(c) = writer.checkpoint() {
                    log::debug!("no checkpoint of the copy of {name} after the interruption: {c}");
                }
            }
            return Err(e);
        }
    };
    let info = writer.commit_copy(read, &origin)?;
    // No blkhash check after the commit: a copy has one only with 64 KiB chunks, so only
    // a copy of a 64 KiB snapshot with its entries carried over as they are, whose blkhash
    // is that of the source's entries, checked above against the source manifest's.
    let latest = theirs.iter().rev().find(|s| s.manifest.name == name);
    if let Some(k) = dst.known().filter(|_| latest.map(|l| &l.id) == parent.as_ref().map(|p| &p.id)) {
        k.committed(&info);
    }
    let s = writer.stats();
    let c = Copied {
        name,
        source_id: snap.id.clone(),
        id: info.id.clone(),
        time: info.manifest.time.clone(),
        size: m.size,
        parent: info.manifest.parent.clone(),
        chunks_sent: s.new_chunks,
        bytes_sent: info.manifest.stats.new_stored,
        bytes_read: read,
        resumed,
        rechunked,
    };
    Ok(Done::Copied(Box::new((c, info))))
}

/// A writer for the copy `opts` describes: continuing the interrupted copy of the same
/// snapshot onto the same parent when the destination (holding `theirs`) has its
/// checkpoint (`true`), else a new one (the checkpoint of anything else of the disk is
/// replaced by this copy's).
fn start_or_resume(
    dst: &Arc<Repository>,
    opts: BackupOptions,
    theirs: &[SnapshotInfo],
) -> Result<(Arc<SnapshotWriter>, bool)> {
    let shown = dst.store.describe();
    match dst.checkpoint(&opts.name) {
        // Left by a copy or backup stopped between its snapshot and removing it.
        Ok(Some(ck)) if ck.superseded_by(theirs).is_some() => {
            log::info!("the checkpoint of {} in {shown} is a leftover of a finished copy or backup", opts.name)
        }
        Ok(Some(ck)) if ck.checkpoint.identity == opts.identity => {
            let differs = checkpoint_mismatch(&ck.checkpoint, &opts);
            if differs.is_empty() {
                match SnapshotWriter::resume(dst.clone(), opts.clone(), &ck) {
                    Ok(w) => return Ok((w, true)),
                    // What stops a fresh copy too: a lock not had, a store that fails.
                    Err(e @ (Error::Locked(_) | Error::Store { .. } | Error::Interrupted)) => return Err(e),
                    // A checkpoint that cannot be continued (its pages damaged or gone,
                    // its base changed) must not block the disk's copies for ever.
                    Err(e) => log::warn!(
                        "the interrupted copy of {} into {shown} cannot be continued ({e}): copying it again",
                        opts.name
                    ),
                }
            } else {
                log::info!(
                    "the interrupted copy of {} into {shown} cannot be continued ({}): copying it again",
                    opts.name,
                    differs.join(", ")
                );
            }
        }
        Ok(Some(ck)) => log::warn!(
            "{shown} holds an interrupted {} of {} ({} of {} bytes stored): this copy replaces its checkpoint",
            if is_copy(&ck.checkpoint) { "copy of another snapshot" } else { "backup" },
            opts.name,
            ck.checkpoint.done_bytes(),
            ck.checkpoint.size
        ),
        Ok(None) => {}
        Err(e) => log::warn!("the checkpoint of {} in {shown} cannot be read ({e}): this copy replaces it", opts.name),
    }
    Ok((SnapshotWriter::start(dst.clone(), opts)?, false))
}

/// Runs `f` on each of `items` on `threads` threads, stopping at the first error (or when
/// `cancel` is set: [`Error::Interrupted`]).
fn for_each<T: Sync>(
    items: &[T],
    threads: usize,
    cancel: Option<&AtomicBool>,
    f: impl Fn(&T) -> Result<()> + Sync,
) -> Result<()> {
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, items.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= items.len() || stop.load(Ordering::Relaxed) {
                    return;
                }
                let r = match cancel.is_some_and(|c| c.load(Ordering::SeqCst)) {
                    true => Err(Error::Interrupted),
                    false => f(&items[i]),
                };
                if let Err(e) = r {
                    stop.store(true, Ordering::Relaxed);
                    failed.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
                    return;
                }
            });
        }
    });
    match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A read from the source that failed: the snapshot's chunks there are damaged or gone.
fn read_error(image: &SnapshotImage, offset: u64, e: ferry_backend::Error) -> Error {
    Error::damaged(
        format!("snapshots/{}", image.info().id),
        format!("reading its bytes at offset {offset} failed: {e}"),
    )
}

/// Chunk runs `[first, count]` (sorted, disjoint) as a set test.
fn chunk_set(ranges: &[(u64, u64)], cs: u64) -> HashSet<u64> {
    ranges.iter().flat_map(|(o, l)| o / cs..(o + l).div_ceil(cs)).collect()
}

/// Same chunk size: the snapshot's entries, carried over. A chunk whose entry the
/// writer holds already (its parent's, or the resumed copy's) and whose blob is there is
/// left as it is; a zero entry stays zero; an entry whose blob the destination has is
/// set; the chunks it lacks are read (each distinct one once) and stored. Returns the
/// bytes read from the source.
fn copy_entries(
    image: &SnapshotImage,
    writer: &Arc<SnapshotWriter>,
    opts: &CopyOptions,
    progress: &Progress,
) -> Result<u64> {
    let src = image.entries();
    let cs = image.info().manifest.chunk_size as u64;
    let size = image.info().manifest.size;
    let lost = chunk_set(&writer.lost_ranges(), cs);
    // The chunks whose entry changes, those whose blob is lost, and those the parent has
    // at another length (its last one, or this disk's): the writer would make these
    // again at commit from the parent's bytes.
    let parts: HashSet<u64> = writer.partial_chunks().into_iter().collect();
    let todo: Vec<u64> = writer.with_entries(|cur, n| {
        (0..src.len() as u64)
            .filter(|&ci| ci >= n || cur(ci) != src[ci as usize] || lost.contains(&ci) || parts.contains(&ci))
            .collect()
    })?;
    let len = |ci: u64| (size - ci * cs).min(cs);
    progress.total.store(todo.iter().map(|&ci| len(ci)).sum(), Ordering::Relaxed);
    progress.done.store(0, Ordering::Relaxed);
    let read = AtomicU64::new(0);
    let cancel = opts.cancel.as_deref();
    for batch in todo.chunks(BATCH) {
        // The distinct digests this batch needs, and which the destination lacks.
        let mut wanted: Vec<Digest> = batch.iter().map(|&ci| src[ci as usize]).filter(|d| *d != ZERO).collect();
        wanted.sort_unstable();
        wanted.dedup();
        let lacks = writer.lacks(&wanted)?;
        let missing: HashSet<&Digest> = wanted.iter().zip(&lacks).filter(|(_, l)| **l).map(|(d, _)| d).collect();
        // Each missing digest is read at its first chunk; its other chunks wait for it.
        let mut first_of: HashMap<&Digest, u64> = HashMap::new();
        let (mut now, mut fetch, mut later) = (Vec::new(), Vec::new(), Vec::new());
        for &ci in batch {
            let d = &src[ci as usize];
            match (missing.contains(d), first_of.get(d)) {
                (false, _) => now.push(ci),
                (true, None) => {
                    first_of.insert(d, ci);
                    fetch.push(ci);
                }
                (true, Some(_)) => later.push(ci),
            }
        }
        enter_runs(writer, src, &now, cancel, progress, cs, size)?;
        let reads = read_runs(&fetch, cs);
        for_each(&reads, opts.threads, cancel, |&(first, n)| {
            let off = first * cs;
            let bytes = ((first + n) * cs).min(size) - off;
            let mut buf = vec![0u8; bytes as usize];
            if let Some(t) = &opts.throttle {
                t(bytes);
            }
            image.read(&mut buf, off).map_err(|e| read_error(image, off, e))?;
            read.fetch_add(bytes, Ordering::Relaxed);
            for (i, chunk) in buf.chunks(cs as usize).enumerate() {
                let ci = first + i as u64;
                writer.enter_new(ci, &src[ci as usize], chunk)?;
                progress.done.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
            Ok(())
        })?;
        enter_runs(writer, src, &later, cancel, progress, cs, size)?;
    }
    Ok(read.into_inner())
}

/// Enters the chunks `cis` (sorted), whose blobs the destination has, a run at a time.
fn enter_runs(
    writer: &SnapshotWriter,
    src: &[Digest],
    cis: &[u64],
    cancel: Option<&AtomicBool>,
    progress: &Progress,
    cs: u64,
    size: u64,
) -> Result<()> {
    let mut at = 0;
    while at < cis.len() {
        if cancel.is_some_and(|c| c.load(Ordering::SeqCst)) {
            return Err(Error::Interrupted);
        }
        let first = cis[at];
        let mut n = 1;
        while at + n < cis.len() && cis[at + n] == first + n as u64 && n < 4096 {
            n += 1;
        }
        writer.enter_present(first, &src[first as usize..first as usize + n])?;
        let bytes = ((first + n as u64) * cs).min(size) - first * cs;
        progress.done.fetch_add(bytes, Ordering::Relaxed);
        at += n;
    }
    Ok(())
}

/// The chunks `cis` (sorted) as runs `(first, count)` of neighbours, each at most
/// [`READ_BYTES`] (one chunk at least): what one thread reads at once.
fn read_runs(cis: &[u64], cs: u64) -> Vec<(u64, u64)> {
    let most = (READ_BYTES / cs).max(1);
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &ci in cis {
        match runs.last_mut() {
            Some((f, n)) if *f + *n == ci && *n < most => *n += 1,
            _ => runs.push((ci, 1)),
        }
    }
    runs
}

/// Another chunk size: the snapshot read as a disk and written as a backup is, in blocks
/// of whole chunks of both sizes. Where the writer starts from a parent that was copied
/// from a snapshot of the source of the same size (`source_of`), a block whose chunks
/// equal that snapshot's is left as the parent has it. Returns the bytes read.
#[allow(clippy::too_many_arguments)]
fn copy_bytes(
    src: &Arc<Repository>,
    source: &Source,
    image: &SnapshotImage,
    writer: &Arc<SnapshotWriter>,
    source_of: Option<&CopiedFrom>,
    opts: &CopyOptions,
    progress: &Progress,
) -> Result<u64> {
    let entries = image.entries();
    let m = &image.info().manifest;
    let (size, cs) = (m.size, m.chunk_size as u64);
    let dst_cs = writer.chunk_size();
    let block = cs.max(dst_cs).max(1 << 20);
    // The source's snapshot the writer's starting point holds the bytes of, chunk by
    // chunk: blocks where this snapshot's entries equal it need not be written.
    let same = match (source_of, writer.starts_zeroed()) {
        (Some(from), false) if from.repository == src.config().id => {
            earlier_entries(src, source, &from.snapshot, m.size)
        }
        _ => None,
    };
    let must = chunk_set(&writer.lost_ranges(), dst_cs);
    let done = chunk_set(&writer.done_ranges(), dst_cs);
    let blocks: Vec<u64> = (0..size.div_ceil(block))
        .filter(|&b| {
            let (off, end) = (b * block, ((b + 1) * block).min(size));
            let dst_chunks = off / dst_cs..end.div_ceil(dst_cs);
            if dst_chunks.clone().any(|c| must.contains(&c)) {
                return true;
            }
            if dst_chunks.clone().all(|c| done.contains(&c)) {
                return false;
            }
            let src_chunks = (off / cs) as usize..end.div_ceil(cs) as usize;
            same.as_ref().is_none_or(|e| e[src_chunks.clone()] != entries[src_chunks])
        })
        .collect();
    progress.total.store(blocks.iter().map(|b| (size - b * block).min(block)).sum(), Ordering::Relaxed);
    progress.done.store(0, Ordering::Relaxed);
    let read = AtomicU64::new(0);
    for_each(&blocks, opts.threads, opts.cancel.as_deref(), |&b| {
        let off = b * block;
        let len = (size - off).min(block);
        let src_chunks = (off / cs) as usize..(off + len).div_ceil(cs) as usize;
        let wrote = if entries[src_chunks].iter().all(|e| *e == ZERO) {
            writer.zero(off, len, ZeroMode::default(), false)
        } else {
            let mut buf = vec![0u8; len as usize];
            if let Some(t) = &opts.throttle {
                t(len);
            }
            image.read(&mut buf, off).map_err(|e| read_error(image, off, e))?;
            read.fetch_add(len, Ordering::Relaxed);
            writer.write(&buf, off, false)
        };
        wrote.map_err(|e| Error::Invalid(format!("writing the copy at offset {off} failed: {e}")))?;
        progress.done.fetch_add(len, Ordering::Relaxed);
        Ok(())
    })?;
    Ok(read.into_inner())
}

/// The entries of the source's snapshot `id`, if it is there and of `size` bytes (else
/// `None`: nothing is skipped): found in the list taken when the copy started, read
/// through the source's index, opened once.
fn earlier_entries(src: &Arc<Repository>, source: &Source, id: &str, size: u64) -> Option<Vec<Digest>> {
    let snap = source.all.iter().find(|s| s.id == id && s.manifest.size == size)?;
    let index = source.index.get_or_init(|| crate::RunIndex::open(src).ok()).as_ref()?;
    src.entries(index, snap).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_runs_of_neighbours_bounded_in_bytes() {
        let cs = 256 << 10;
        assert_eq!(read_runs(&[0, 1, 2, 5, 6, 9], cs), [(0, 3), (5, 2), (9, 1)]);
        // 1 MiB at most: four 256 KiB chunks a run.
        assert_eq!(read_runs(&[0, 1, 2, 3, 4, 5], cs), [(0, 4), (4, 2)]);
        // A chunk larger than a read is read alone.
        assert_eq!(read_runs(&[0, 1], 4 << 20), [(0, 1), (1, 1)]);
    }
}
