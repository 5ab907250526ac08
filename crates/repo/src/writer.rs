//! A backup in progress: a write-only image that the copy engine writes into, on top of
//! the disk's previous snapshot (or of zeroes), committed as a new snapshot.
//!
//! The copy engine's workers call [`Backend::write`], [`Backend::zero`] and
//! [`Backend::trim`] from many threads at once. Each whole chunk is hashed (SHA-256, several
//! chunks side by side), recognised as zero, found in the index (deduplicated), or
//! compressed and sealed by the calling thread; only the append to the open pack happens
//! under a lock. A pack that reaches the pack size is closed and stored by the thread that
//! filled it, with at most two packs on their way to the store at once. Requests that
//! cover part of a chunk are kept until the rest of it arrives, or completed at
//! [`SnapshotWriter::commit`] from the chunk's previous content.
//!
//! Nothing is visible in the repository before `commit` writes the manifest: a writer
//! dropped before that leaves only orphan packs, which `gc` frees (FORMAT.md §9).
use crate::blob;
use crate::checkpoint::{CheckpointInfo, AAD_CHECKPOINT};
use crate::entries::Entries;
use crate::format::{
    self, BlobEntry, BlobKind, Changes, Checkpoint, Digest, LockKind, Manifest, PackBlobs, SnapshotStats, ZERO,
};
use crate::lock::{self, LockGuard};
use crate::repo::{hostname, pack_name, parse_time, sha256, Repository, SnapshotInfo, AAD_SNAPSHOT, AAD_TRAILER};
use crate::runs::{BlobLookup, OwnRuns, RunIndex};
use crate::{Error, Result};
use ferry_backend::{Backend, Capabilities, ZeroMode};
use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct BackupOptions {
    /// The disk's name.
    pub name: String,
    /// The disk's size (the source's).
    pub size: u64,
    /// What the new snapshot starts from: unwritten ranges keep this snapshot's content
    /// (incremental backups), or read as zeroes when `None`.
    ///
    /// With a base, the copy must write every range of the source that it reads, zeroes
    /// included (through `write` or `zero`): do not declare the destination as reading
    /// zeroes (see [`SnapshotWriter::starts_zeroed`]), or holes of the source keep the
    /// base's data.
    ///
    /// Its size may differ from `size` (the writer does not refuse that; whether a source
    /// whose size changed may be backed up incrementally is the caller's policy): chunks
    /// past the base's end start as zeroes, and the base's chunks past `size` are dropped.
    pub base: Option<SnapshotInfo>,
    /// The source, as shown (credentials removed).
    pub source: String,
    pub changes: Changes,
    /// Close packs at this size.
    pub pack_size: usize,
    /// zstd level.
    pub level: i32,
    /// Wait this long for a backup of the same disk (or a repair, or an older ferry's gc) to
    /// end, instead of failing.
    pub wait_lock: Option<Duration>,
    /// What identifies the source's content (its backend's identity, or `source`): a
    /// checkpoint records it, and a resume compares it.
    pub identity: String,
    /// Store a checkpoint (FORMAT.md §7a) this often while writes come in, so that an
    /// interrupted backup can be resumed ([`SnapshotWriter::resume`]); never when `None`.
    pub checkpoint_every: Option<Duration>,
    /// Tags and a note for the snapshot (FORMAT.md §7; checked when the manifest is).
    pub tags: Vec<String>,
    pub note: String,
    /// The time the manifest records instead of this host's clock: for tests that need a
    /// calendar of snapshots (`FERRY_BACKUP_TIME`). Lists still order a snapshot after its
    /// parent whatever it says (FORMAT.md §7's order time), and one earlier than the disk's
    /// latest order time is refused (a snapshot without a parent is ordered by it alone).
    pub time: Option<jiff::Timestamp>,
}

impl BackupOptions {
    /// A full backup of `name` (`size` bytes) with the default pack size and level.
    pub fn new(name: &str, size: u64) -> BackupOptions {
        BackupOptions {
            name: name.into(),
            size,
            base: None,
            source: String::new(),
            changes: Changes::Full,
            pack_size: DEFAULT_PACK_SIZE,
            level: DEFAULT_LEVEL,
            wait_lock: None,
            identity: String::new(),
            checkpoint_every: None,
            tags: Vec::new(),
            note: String::new(),
            time: None,
        }
    }
}

/// How often `ferry backup` checkpoints by default.
pub const DEFAULT_CHECKPOINT_EVERY: Duration = Duration::from_secs(30);

/// Packs are closed at 32 MiB by default.
pub const DEFAULT_PACK_SIZE: usize = 32 << 20;
/// zstd's fastest level that still compresses well.
pub const DEFAULT_LEVEL: i32 = 1;
/// The largest pack size a writer accepts (offsets in a pack are 32-bit; packs ≤ 1 GiB).
pub const MAX_PACK_SIZE: usize = 512 << 20;
/// Packs being stored at once, per writer: bounds the memory of a backup.
const UPLOADS: usize = 2;
/// Chunks hashed side by side.
const BATCH: usize = 16;
/// Blobs this writer stored that its memory lists at most before an index object lists
/// them and they move to its own runs ([`OwnRuns`]): about 48 bytes each in `done` and
/// 60 in `claimed`, so that a backup holds about 14 MB of them whatever it writes.
#[cfg(not(test))]
const OWN_IN_MEMORY: usize = 1 << 17;
/// A few in the crate's tests, so that their backups move most blobs out.
#[cfg(test)]
const OWN_IN_MEMORY: usize = 24;
/// The least time between two checkpoints that [`OWN_IN_MEMORY`] calls for (one that
/// fails is not tried again at each write).
#[cfg(not(test))]
const CHECKPOINT_GAP: Duration = Duration::from_millis(250);
#[cfg(test)]
const CHECKPOINT_GAP: Duration = Duration::ZERO;
/// Pages whose chunks' own places are looked up at once when located pages are made (their
/// ids sorted: the runs are read in order).
const PLACE_WINDOW_PAGES: usize = 128;
/// Pages a checkpoint copies from the chunk list at once (2 MiB of entries at the
/// default 256 a page): its memory does not grow with the disk.
const CHECKPOINT_PAGES: usize = 256;

#[derive(Debug, Clone, Default)]
pub struct WriterStats {
    pub written_chunks: u64,
    pub zero_chunks: u64,
    pub new_chunks: u64,
    pub new_plain: u64,
    pub new_stored: u64,
}

#[derive(Default)]
struct Counters {
    written_chunks: AtomicU64,
    zero_chunks: AtomicU64,
    new_chunks: AtomicU64,
    new_plain: AtomicU64,
    new_stored: AtomicU64,
}

/// The chunk list being built, and which pages changed.
struct State {
    /// In memory for a small disk, else in a file ([`crate::entries`]).
    entries: Entries,
    /// Pages whose entries changed since `pages` was last made.
    dirty: Vec<bool>,
    /// Each page's digest ([`ZERO`] for a zero page) where it is not dirty: the base's,
    /// the resumed checkpoint's, or the last checkpoint's.
    pages: Vec<Digest>,
    /// One bit per chunk: entered whole by this backup (or the one it resumes).
    done: Vec<u64>,
}

impl State {
    fn is_done(&self, ci: u64) -> bool {
        self.done[(ci / 64) as usize] & (1 << (ci % 64)) != 0
    }
    fn mark_done(&mut self, first: u64, n: u64) {
        for ci in first..first + n {
            self.done[(ci / 64) as usize] |= 1 << (ci % 64);
        }
    }
    /// The done chunks as sorted `[first, count]` runs.
    fn done_runs(&self, chunks: u64) -> Vec<[u64; 2]> {
        let mut runs: Vec<[u64; 2]> = Vec::new();
        let mut ci = 0;
        while ci < chunks {
            let w = self.done[(ci / 64) as usize];
            if ci % 64 == 0 && (w == 0 || w == u64::MAX) && ci + 64 <= chunks {
                if w == u64::MAX {
                    push_run(&mut runs, ci, 64);
                }
                ci += 64;
                continue;
            }
            if w & (1 << (ci % 64)) != 0 {
                push_run(&mut runs, ci, 1);
            }
            ci += 1;
        }
        runs
    }
}

fn push_run(runs: &mut Vec<[u64; 2]>, first: u64, n: u64) {
    match runs.last_mut() {
        Some(last) if last[0] + last[1] == first => last[1] += n,
        _ => runs.push([first, n]),
    }
}

/// Packs taken from the open pack and not yet stored (their sequence numbers).
#[derive(Default)]
struct Flight {
    next: u64,
    pending: BTreeSet<u64>,
}

/// The blobs this writer stored or is storing: the ids in memory, stored (true) or being
/// stored (false); and the runs ([`OwnRuns`]) of those an index object lists, moved out of
/// memory (a blob is in one or the other, or both for a moment, never neither).
#[derive(Default)]
struct Claimed {
    ids: HashMap<Digest, bool>,
    own: Arc<OwnRuns>,
}

/// A chunk written in part.
struct Partial {
    buf: Vec<u8>,
    /// Covered byte ranges, sorted and merged.
    covered: Vec<(usize, usize)>,
}

struct OpenPack {
    buf: Vec<u8>,
    entries: Vec<BlobEntry>,
}

thread_local! {
    /// Each worker's buffer for a blob's stored form.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

pub struct SnapshotWriter {
    repo: Arc<Repository>,
    name: String,
    size: u64,
    base: Option<SnapshotInfo>,
    source: String,
    changes: Changes,
    pack_size: usize,
    level: i32,
    cs: u64,
    pe: u64,
    chunks: u64,
    /// The index through the local cache, as a backup sees it: copies in present packs
    /// only, none recorded damaged. This writer's own blobs are in `claimed` and in its
    /// own runs.
    index: RunIndex,
    state: Mutex<State>,
    partials: Mutex<HashMap<u64, Partial>>,
    /// The blobs this writer stored or is storing; the condvar is told when one is
    /// appended to a pack.
    claimed: Arc<(Mutex<Claimed>, Condvar)>,
    /// Set while a merge of the own runs runs beside the backup ([`Self::move_own`]).
    merging: Arc<AtomicBool>,
    /// The thread of the last merge, joined at commit and when the writer is dropped.
    merge_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Set to stop a merge that runs (it is then not installed).
    merge_cancel: Arc<AtomicBool>,
    /// After a move to the own runs failed: the blobs in memory that the next attempt
    /// waits for (twice as many as then); 0 while none failed.
    move_again_at: AtomicUsize,
    pack: Mutex<OpenPack>,
    /// The packs this writer stored whose blobs are not in its own runs yet.
    done: Mutex<Vec<PackBlobs>>,
    /// How many of `done` an index object lists already (stored by a checkpoint, or once
    /// [`Self::own_in_memory`] blobs wait for one).
    indexed: Mutex<usize>,
    /// The blobs of `done` after `indexed`.
    unindexed: AtomicUsize,
    /// How many of its blobs this writer keeps in memory before they move to its own runs
    /// ([`OWN_IN_MEMORY`]; fewer in tests).
    own_in_memory: AtomicUsize,
    /// Where its own runs are written: the repository's cache directory, else the
    /// system's temporary directory.
    own_dir: std::path::PathBuf,
    uploads: (Mutex<usize>, Condvar),
    flight: (Mutex<Flight>, Condvar),
    identity: String,
    checkpoint_every: Option<Duration>,
    tags: Vec<String>,
    note: String,
    time: Option<jiff::Timestamp>,
    /// Held while a checkpoint (or the commit) runs.
    checkpointing: Mutex<()>,
    last_checkpoint: Mutex<Instant>,
    /// The chunk runs already stored when this writer resumed a checkpoint.
    resumed: Vec<[u64; 2]>,
    /// The chunk runs whose entry (the base's, or the resumed checkpoint's) names a blob
    /// with no copy in a present pack: the backup must write them (see
    /// [`SnapshotWriter::lost_ranges`]), or the commit refuses.
    lost: Vec<[u64; 2]>,
    pool: Mutex<Vec<Vec<u8>>>,
    counters: Counters,
    failed: Mutex<Option<String>>,
    committed: AtomicBool,
    lock: Mutex<Option<LockGuard>>,
    /// The packs condemned by gc when this backup started (FORMAT.md §8a): absent to it.
    condemned: HashSet<Digest>,
    /// The packs condemned since, as read at commit ([`Self::store_condemned_again`]): a
    /// pack sealed after must not have their names either.
    condemned_since: Mutex<HashSet<Digest>>,
    /// Set once the lock is found gone ([`LockGuard::lost_flag`]): writes then fail.
    lock_lost: Arc<AtomicBool>,
    /// The repository's snapshots are located (version 3, FORMAT.md §7c): the manifest's
    /// pages are located pages.
    located: bool,
    /// Where the base's chunks are hinted to be, in packs present and not condemned
    /// (others dropped); empty without a located base.
    base_hints: BaseHints,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A repository error as a backend error for the copy engine, keeping the OS error's
/// class (a full disk stays ENOSPC).
fn backend_error(op: &'static str, offset: u64, length: u64, e: Error) -> ferry_backend::Error {
    let kind = match &e {
        Error::Store { source, .. } => match source.raw_os_error() {
            Some(code) => ferry_backend::Error::io(op, offset, length, io::Error::from_raw_os_error(code)).kind,
            None => ferry_backend::ErrorKind::Io,
        },
        Error::Invalid(_) => ferry_backend::ErrorKind::Invalid,
        _ => ferry_backend::ErrorKind::Io,
    };
    ferry_backend::Error { kind, op, offset, length, source: Some(io::Error::other(e.to_string())) }
}

/// Refuses a fixed time (`opts.time`) earlier than the latest order time of the disk's
/// snapshots (FORMAT.md §7): a snapshot without a parent is ordered by its time alone, so
/// such a time would list it before snapshots taken earlier, and a backup would continue
/// an older one. Called holding the disk's lock.
fn check_fixed_time(repo: &Repository, opts: &BackupOptions) -> Result<()> {
    let Some(t) = opts.time else { return Ok(()) };
    let snaps: Vec<SnapshotInfo> = repo.snapshots()?.into_iter().filter(|s| s.manifest.name == opts.name).collect();
    let latest = crate::repo::order_keys(&snaps).into_iter().filter_map(|k| k.0).max();
    match latest {
        Some(l) if t < l => Err(Error::Invalid(format!(
            "the time given for this backup of {} ({t}) is before its latest snapshot's ({l}): it would be listed \
             before snapshots taken earlier",
            opts.name
        ))),
        _ => Ok(()),
    }
}

impl SnapshotWriter {
    /// Takes the disk's backup lock and loads the index and the base's pages.
    pub fn start(repo: Arc<Repository>, opts: BackupOptions) -> Result<Arc<SnapshotWriter>> {
        Self::check_opts(&repo, &opts)?;
        let cs = repo.config.chunk_size as u64;
        let pe = repo.config.page_entries as u64;
        let chunks = opts.size.div_ceil(cs);
        let tag = repo.crypto.disk_tag(&opts.name);
        let guard = lock::acquire(&repo.store, LockKind::Backup, Some(tag), opts.wait_lock)?;
        // A migrate that ran since `repo` was opened (no migrate runs beside the lock).
        crate::migrate::refuse_if_changed(&repo)?;
        check_fixed_time(&repo, &opts)?;
        // What gc condemned, read after the lock is taken and before `data/` is listed.
        let condemned = repo.condemned_packs()?;
        let (index, kept) = Self::load_index(&repo, &condemned)?;
        let mut opts = opts;
        let what = format!("the backup of {}", opts.name);
        let base = opts.base.clone();
        let located = repo.config.version >= format::LOCATED_CONFIG_VERSION;
        let mut base_hints = BaseHints::none();
        let (entries, base_chunks, base_pages) = match &base {
            Some(b) => {
                match Self::load_entries(&repo, &index, b, chunks, &what, located.then_some((&mut base_hints, &kept))) {
                    Ok((e, pages)) => (e, b.manifest.chunks(), pages),
                    Err(e @ Error::Damaged { .. }) => {
                        Self::unreadable_base(&opts, b, e)?;
                        // A full backup of a disk whose previous snapshot cannot be read: a new start.
                        opts.base = None;
                        base_hints = BaseHints::none();
                        (Self::new_entries(&repo, chunks, &what)?, 0, Vec::new())
                    }
                    Err(e) => return Err(e),
                }
            }
            None => (Self::new_entries(&repo, chunks, &what)?, 0, Vec::new()),
        };
        let index = Self::exclude_damaged(&repo, index.only_present(kept));
        let n_pages = chunks.div_ceil(pe) as usize;
        // The base's pages stand where nothing changes, unless the extent of the pages
        // differs: then every page is made again.
        let (pages, mut dirty) = match &opts.base {
            Some(_) if base_chunks == chunks && base_pages.len() == n_pages => (base_pages, vec![false; n_pages]),
            _ => (vec![ZERO; n_pages], vec![true; n_pages]),
        };
        // A base page with no copy left in the index (its only copy recorded damaged) is
        // made again from its entries, not named again.
        for (p, d) in pages.iter().zip(dirty.iter_mut()).filter(|(p, d)| !**d && **p != ZERO) {
            *d = !index.contains(&repo.crypto.blob_id(p));
        }
        let state = State { entries, dirty, pages, done: vec![0; chunks.div_ceil(64) as usize] };
        Self::build(repo, opts, guard, index, state, base_chunks, Vec::new(), condemned, base_hints)
    }

    /// Continues the interrupted backup that stored `checkpoint` (of `opts.name`, read
    /// with [`Repository::checkpoint`]): the new snapshot starts from the checkpoint's
    /// entries, and [`SnapshotWriter::done_ranges`] says what need not be written again.
    /// `opts` must describe the same backup: size, base, changes and source identity
    /// (see [`checkpoint_mismatch`]).
    pub fn resume(
        repo: Arc<Repository>,
        opts: BackupOptions,
        checkpoint: &CheckpointInfo,
    ) -> Result<Arc<SnapshotWriter>> {
        Self::check_opts(&repo, &opts)?;
        let differs = checkpoint_mismatch(&checkpoint.checkpoint, &opts);
        let mut opts = opts;
        if checkpoint.checkpoint.base.is_none() {
            // A full backup that went on without its base (unreadable): it continues so.
            opts.base = None;
        }
        if !differs.is_empty() {
            return Err(Error::Invalid(format!(
                "the interrupted backup of {} ({}) cannot be resumed: {}; back up without resuming (which discards it)",
                opts.name,
                checkpoint.object,
                differs.join(", ")
            )));
        }
        let cs = repo.config.chunk_size as u64;
        let chunks = opts.size.div_ceil(cs);
        let tag = repo.crypto.disk_tag(&opts.name);
        let guard = lock::acquire(&repo.store, LockKind::Backup, Some(tag), opts.wait_lock)?;
        // A migrate that ran since `repo` was opened (no migrate runs beside the lock).
        crate::migrate::refuse_if_changed(&repo)?;
        check_fixed_time(&repo, &opts)?;
        // Read again under the lock: another resume may have committed it meanwhile.
        let checkpoint = match repo.checkpoint(&opts.name)? {
            Some(c) if c.checkpoint == checkpoint.checkpoint => c,
            _ => {
                return Err(Error::Invalid(format!(
                    "the checkpoint of {} changed or went away while this backup waited for its lock (another \
                     backup of it ran): start again",
                    opts.name
                )))
            }
        };
        let condemned = repo.condemned_packs()?;
        let (index, kept) = Self::load_index(&repo, &condemned)?;
        let what = format!("the backup of {}", opts.name);
        let (entries, _) = Self::load_entries(&repo, &index, &checkpoint.as_snapshot(), chunks, &what, None)?;
        let index = Self::exclude_damaged(&repo, index.only_present(kept));
        let base_chunks = opts.base.as_ref().map_or(0, |b| b.manifest.chunks());
        let n_pages = checkpoint.checkpoint.pages.count() as usize;
        let mut state = State {
            entries,
            dirty: vec![false; n_pages],
            pages: checkpoint.checkpoint.pages.to_vec(),
            done: vec![0; chunks.div_ceil(64) as usize],
        };
        for [first, n] in &checkpoint.checkpoint.done {
            state.mark_done(*first, *n);
        }
        // A checkpoint page with no copy left in the index (only in a condemned pack, or
        // recorded damaged) is made again from its entries, not named again.
        for (p, d) in state.pages.iter().zip(state.dirty.iter_mut()).filter(|(p, _)| **p != ZERO) {
            *d = !index.contains(&repo.crypto.blob_id(p));
        }
        // A done chunk whose pack is gone since is read again.
        for ci in missing_chunks(&repo, &index, &state.entries, |ci| state.is_done(ci))? {
            state.done[(ci / 64) as usize] &= !(1 << (ci % 64));
        }
        let resumed = state.done_runs(chunks);
        Self::build(repo, opts, guard, index, state, base_chunks, resumed, condemned, BaseHints::none())
    }

    /// A zero chunk list of `chunks` entries for `what` ([`Entries::zeroes`]), in the
    /// repository's cache directory where it does not fit in memory.
    fn new_entries(repo: &Repository, chunks: u64, what: &str) -> Result<Entries> {
        let cache = repo.index_cache();
        Entries::zeroes(chunks, cache.as_ref().map(|c| c.spill_dir()), what)
    }

    /// The chunk list of `snap` (the base, or a checkpoint) as the start of a list of
    /// `chunks` entries: cut where it is longer, zeroes after it where it is shorter.
    /// Read a window of pages at a time: only the list is kept (in a file for a large
    /// disk), not the pages. With the snapshot's page digests.
    fn load_entries(
        repo: &Repository,
        index: &RunIndex,
        snap: &SnapshotInfo,
        chunks: u64,
        what: &str,
        hints: Option<(&mut BaseHints, &HashSet<Digest>)>,
    ) -> Result<(Entries, Vec<Digest>)> {
        let mut entries = Self::new_entries(repo, chunks, what)?;
        // The base's hints (FORMAT.md §7c) into packs present and not condemned, kept as
        // the list is: in memory, or in a file for a large disk.
        let (mut hints, kept) = match hints {
            Some((h, kept)) if snap.manifest.version == format::LOCATED_VERSION => {
                h.at = Some(Self::new_entries(repo, chunks, what)?);
                (Some(h), kept)
            }
            _ => (None, &HashSet::new()),
        };
        let mut numbers: HashMap<Digest, u32> = HashMap::new();
        let mut records: Vec<Digest> = Vec::new();
        let damage = index.damage();
        let pages = repo.each_located_page(index, snap, |first, page| {
            // The list starts as zeroes: a zero page (most of a sparse disk) is not written.
            if first >= chunks || page.entries.iter().all(|e| *e == ZERO) {
                return Ok(());
            }
            let n = page.entries.len().min((chunks - first) as usize);
            entries.write(first, &page.entries[..n]).map_err(|e| spill_error(what, e))?;
            let Some(h) = hints.as_deref_mut() else { return Ok(()) };
            records.clear();
            records.resize(n, ZERO);
            let mut any = false;
            for (k, hint) in page.hints.iter().enumerate().take(n).filter(|(_, h)| !h.is_none()) {
                let Some(pack) = page.packs.get(hint.pack as usize).filter(|p| kept.contains(*p)) else { continue };
                // A copy that verify recorded damaged is no place to name: the index's
                // good copy is named instead, or the chunk is stored again.
                if damage.is_damaged_with(pack, || repo.crypto.blob_id(&page.entries[k])) {
                    continue;
                }
                let next = h.packs.len() as u32;
                let no = *numbers.entry(*pack).or_insert(next);
                if no == next {
                    h.packs.push(*pack);
                }
                records[k] = BaseHints::record(no, hint.offset, hint.stored_len, &page.entries[k]);
                any = true;
            }
            if any {
                if let Some(at) = h.at.as_mut() {
                    at.write(first, &records).map_err(|e| spill_error(what, e))?;
                }
            }
            Ok(())
        })?;
        Ok((entries, pages))
    }

    /// The base snapshot's pages cannot be read (`e`): a backup that reads the whole disk
    /// needs nothing from it and goes on without it (`Ok`, with a warning); one that
    /// reads only a change map's ranges cannot, and is refused.
    fn unreadable_base(opts: &BackupOptions, base: &SnapshotInfo, e: Error) -> Result<()> {
        let id = &base.id[..8.min(base.id.len())];
        if opts.changes == Changes::Full {
            log::warn!(
                "the previous snapshot of {} ({id}) cannot be read ({}); this backup reads the whole disk, needs \
                 nothing from it, and goes on without it (the new snapshot has no parent)",
                opts.name,
                e.reason()
            );
            return Ok(());
        }
        Err(Error::Invalid(format!(
            "the previous snapshot of {} ({id}) cannot be read ({}), and a change map only says what changed since \
             it: nothing was stored. Back up without the change map (without --dirty-bitmap or --extents-from; \
             --no-bitmap for a qcow2 image that ferry tracks): that reads the whole disk and needs nothing from it",
            opts.name,
            e.reason()
        )))
    }

    /// The repository's index, without the blobs whose pack is gone: chunks in them are
    /// not reused (a new snapshot would reference the lost data again, and the
    /// repository would never heal). Packs that gc condemned are gone to a backup too
    /// (FORMAT.md §8a): a later gc deletes them without waiting for it. They are still in
    /// the index returned, for reading the base's (or the checkpoint's) pages through it;
    /// the set returned is the packs to keep after ([`RunIndex::only_present`]), which
    /// leaves them out, so that what only they hold is stored again.
    fn load_index(repo: &Arc<Repository>, condemned: &HashSet<Digest>) -> Result<(RunIndex, HashSet<Digest>)> {
        let index = RunIndex::open(repo)?;
        let present = repo.present_packs()?;
        let index = index.only_present(present.clone());
        let gone = index.packs_gone();
        let held = present.iter().filter(|p| condemned.contains(*p)).count();
        if held > 0 {
            log::info!(
                "{held} pack(s) of {} are condemned by gc: the chunks only they hold are stored again where this \
                 backup reads them",
                repo.store.describe()
            );
        }
        let kept = present.into_iter().filter(|p| !condemned.contains(p)).collect();
        if gone > 0 {
            log::warn!(
                "{gone} pack(s) that the index of {} lists are gone: this backup reads again the chunks of them its \
                 disk's previous snapshot uses, and stores again any it reads (`ferry repo check` names the \
                 snapshots that lost them)",
                repo.store.describe()
            );
        }
        Ok((index, kept))
    }

    /// Drops the copies that `verify` recorded damaged from the index (once the base's
    /// pages are read through it): their content is stored again where this backup reads
    /// it, instead of being deduplicated against a copy that does not read back.
    fn exclude_damaged(repo: &Repository, index: RunIndex) -> RunIndex {
        let backup = index.without_damaged();
        let damaged: HashSet<&Digest> = index.damage().packs.values().flat_map(|c| c.blobs.iter()).collect();
        let n = damaged.into_iter().filter(|id| index.contains(id) && !backup.contains(id)).count();
        if n > 0 {
            log::info!(
                "{n} chunk(s) of {} are recorded damaged with no good copy: stored again where this backup reads them",
                repo.store.describe()
            );
        }
        backup
    }

    /// The checks of the options that `start` and `resume` share.
    fn check_opts(repo: &Repository, opts: &BackupOptions) -> Result<()> {
        if !format::valid_name(&opts.name) {
            return Err(Error::Invalid(format!(
                "{:?} is not a disk name: use 1 to 200 of A-Z a-z 0-9 . _ -, not starting with . or -",
                opts.name
            )));
        }
        if let Some(t) = opts.tags.iter().find(|t| !format::valid_tag(t)) {
            return Err(Error::Invalid(format!("{t:?} is not a tag: use 1 to 64 of A-Z a-z 0-9 . _ - + @ : =")));
        }
        if opts.tags.len() > format::MAX_TAGS {
            return Err(Error::Invalid(format!("a snapshot has at most {} tags", format::MAX_TAGS)));
        }
        if !format::valid_note(&opts.note) {
            return Err(Error::Invalid(format!(
                "a note is at most {} bytes, without control characters (newlines included)",
                format::MAX_NOTE
            )));
        }
        if opts.pack_size == 0 || opts.pack_size > MAX_PACK_SIZE {
            return Err(Error::Invalid(format!("the pack size must be from 1 byte to {MAX_PACK_SIZE} bytes")));
        }
        let cs = repo.config.chunk_size as u64;
        let pe = repo.config.page_entries as u64;
        let chunks = opts.size.div_ceil(cs);
        if opts.size > 1 << 63 || chunks.div_ceil(pe) > format::MAX_PAGES {
            return Err(Error::Invalid(format!(
                "a disk of {} bytes is larger than this repository can hold (its chunk and page sizes allow {} bytes)",
                opts.size,
                (format::MAX_PAGES * pe * cs).min(1 << 63)
            )));
        }
        if let Some(b) = &opts.base {
            if b.manifest.chunk_size != repo.config.chunk_size || b.manifest.page_entries != repo.config.page_entries {
                return Err(Error::damaged(
                    format!("snapshots/{}", b.id),
                    "its chunk size or page size is not the repository's",
                ));
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        repo: Arc<Repository>,
        opts: BackupOptions,
        guard: LockGuard,
        index: RunIndex,
        state: State,
        base_chunks: u64,
        resumed: Vec<[u64; 2]>,
        condemned: HashSet<Digest>,
        base_hints: BaseHints,
    ) -> Result<Arc<SnapshotWriter>> {
        let cs = repo.config.chunk_size as u64;
        let pe = repo.config.page_entries as u64;
        let chunks = opts.size.div_ceil(cs);
        // A chunk that is the last of one size and not of the other changes length: it is
        // made again at commit from its old content, cut or extended with zeroes (unless
        // the backup writes all of it).
        let mut partials = HashMap::new();
        if let Some(b) = &opts.base {
            for end in [b.manifest.size, opts.size] {
                let ci = end / cs;
                if end % cs != 0 && ci < chunks.min(base_chunks) && !state.is_done(ci) {
                    let clen = (opts.size - ci * cs).min(cs) as usize;
                    partials.insert(ci, Partial { buf: vec![0; clen], covered: Vec::new() });
                }
            }
        }
        let pack_size = opts.pack_size;
        let lost = lost_runs(&repo, &index, &state)?;
        if !lost.is_empty() {
            let n: u64 = lost.iter().map(|r| r[1]).sum();
            log::warn!(
                "{n} chunk(s) of the previous snapshot of {} are lost (their packs are gone, or `ferry repo verify` \
                 recorded them damaged): this backup reads them from the source again",
                opts.name
            );
        }
        Ok(Arc::new(SnapshotWriter {
            name: opts.name,
            size: opts.size,
            base: opts.base,
            source: opts.source,
            changes: opts.changes,
            pack_size,
            level: opts.level,
            cs,
            pe,
            chunks,
            index,
            state: Mutex::new(state),
            partials: Mutex::new(partials),
            claimed: Arc::new((Mutex::new(Claimed::default()), Condvar::new())),
            merging: Arc::new(AtomicBool::new(false)),
            merge_thread: Mutex::new(None),
            merge_cancel: Arc::new(AtomicBool::new(false)),
            move_again_at: AtomicUsize::new(0),
            pack: Mutex::new(OpenPack { buf: Vec::new(), entries: Vec::new() }),
            done: Mutex::new(Vec::new()),
            indexed: Mutex::new(0),
            unindexed: AtomicUsize::new(0),
            own_in_memory: AtomicUsize::new(OWN_IN_MEMORY),
            own_dir: repo.index_cache().map_or_else(std::env::temp_dir, |c| c.spill_dir().to_path_buf()),
            uploads: (Mutex::new(0), Condvar::new()),
            flight: (Mutex::new(Flight::default()), Condvar::new()),
            identity: opts.identity,
            checkpoint_every: opts.checkpoint_every,
            tags: opts.tags,
            note: opts.note,
            time: opts.time,
            checkpointing: Mutex::new(()),
            last_checkpoint: Mutex::new(Instant::now()),
            resumed,
            lost,
            pool: Mutex::new(Vec::new()),
            counters: Counters::default(),
            failed: Mutex::new(None),
            committed: AtomicBool::new(false),
            lock_lost: guard.lost_flag(),
            lock: Mutex::new(Some(guard)),
            condemned,
            condemned_since: Mutex::new(HashSet::new()),
            located: repo.config.version >= format::LOCATED_CONFIG_VERSION,
            base_hints,
            repo,
        }))
    }

    /// Whether a merge of the own runs runs now, and a handle that outlives the writer
    /// only while its thread does (tests).
    #[cfg(test)]
    pub(crate) fn merge_running(&self) -> (bool, std::sync::Weak<AtomicBool>) {
        (self.merging.load(Ordering::SeqCst), Arc::downgrade(&self.merging))
    }

    /// Keeps up to `blobs` of its blobs in memory ([`OWN_IN_MEMORY`]; tests).
    #[cfg(test)]
    pub(crate) fn keep_in_memory(&self, blobs: usize) {
        self.own_in_memory.store(blobs, Ordering::Relaxed);
    }

    /// The ids in `claimed`, the blobs in `done` and the entries in the own runs (tests).
    #[cfg(test)]
    pub(crate) fn own_held(&self) -> (usize, usize, u64) {
        let (ids, own) = {
            let cl = locked(&self.claimed.0);
            (cl.ids.len(), cl.own.entries())
        };
        (ids, locked(&self.done).iter().map(|p| p.blobs.len()).sum(), own)
    }

    /// The byte ranges (offset, length) that the checkpoint this writer resumed had
    /// stored already: a resumed copy need not write them again. Empty for `start`.
    pub fn done_ranges(&self) -> Vec<(u64, u64)> {
        runs_to_ranges(&self.resumed, self.cs, self.size)
    }

    /// The byte ranges (offset, length) where the snapshot this backup continues (or the
    /// checkpoint it resumes) names chunks that are lost (no copy in a present pack): the
    /// copy must read them from the source too, whatever its change map says, or the
    /// commit refuses. Empty in a healthy repository.
    pub fn lost_ranges(&self) -> Vec<(u64, u64)> {
        runs_to_ranges(&self.lost, self.cs, self.size)
    }

    fn chunk_len(&self, ci: u64) -> usize {
        (self.size - ci * self.cs).min(self.cs) as usize
    }

    /// The repository's chunk size.
    pub(crate) fn chunk_size(&self) -> u64 {
        self.cs
    }

    /// The chunks waiting to be completed at commit from what they held (a chunk of
    /// another length in the base: its last, or this disk's last).
    pub(crate) fn partial_chunks(&self) -> Vec<u64> {
        locked(&self.partials).keys().copied().collect()
    }

    /// For a copy from another repository ([`crate::copy`]): whether each digest's blob
    /// is missing here (no copy in a present pack, none stored by this writer). Looked
    /// up sorted, as [`missing_chunks`] does.
    pub(crate) fn lacks(&self, digests: &[Digest]) -> Result<Vec<bool>> {
        let mut keyed: Vec<(Digest, usize)> =
            digests.iter().enumerate().map(|(i, d)| (self.repo.crypto.blob_id(d), i)).collect();
        keyed.sort_unstable();
        let ids: Vec<Digest> = keyed.iter().map(|k| k.0).collect();
        let found = self.index.contains_each(&ids);
        let (stored, own) = {
            let claimed = locked(&self.claimed.0);
            (ids.iter().map(|id| claimed.ids.get(id) == Some(&true)).collect::<Vec<bool>>(), claimed.own.clone())
        };
        let mut out = vec![false; digests.len()];
        let mut ask: Vec<usize> = Vec::new();
        for (k, ((id, i), f)) in keyed.iter().zip(found).enumerate() {
            out[*i] = !f && !stored[k];
            if out[*i] && own.may_hold(id) {
                ask.push(k);
            }
        }
        if !ask.is_empty() {
            let asked: Vec<Digest> = ask.iter().map(|k| ids[*k]).collect();
            let places = own.find_each(&asked).map_err(|e| own_error(&self.name, e))?;
            for (k, at) in ask.iter().zip(places) {
                out[keyed[*k].1] = at.is_none();
            }
        }
        Ok(out)
    }

    /// The checks of a write that [`Self::apply`] makes, for the copy's entry points.
    fn writable(&self, first: u64, n: u64) -> Result<()> {
        if first.checked_add(n).is_none_or(|e| e > self.chunks) {
            return Err(Error::Invalid(format!(
                "chunks {first}..{} are past the end of the disk ({} chunks)",
                first.saturating_add(n),
                self.chunks
            )));
        }
        if self.committed.load(Ordering::Relaxed) {
            return Err(Error::Invalid("the backup is already committed".into()));
        }
        if self.lock_lost.load(Ordering::Relaxed) {
            self.check_lock()?;
        }
        Ok(())
    }

    /// For a copy: sets the entries of chunks `first..` to `digests`, each zero or
    /// naming a blob this repository has (in a present pack, or stored by this writer):
    /// nothing is read or stored. A digest whose blob is missing is refused (the caller
    /// asked [`Self::lacks`] and must store it with [`Self::enter_new`]).
    pub(crate) fn enter_present(&self, first: u64, digests: &[Digest]) -> Result<()> {
        self.writable(first, digests.len() as u64)?;
        let nonzero: Vec<Digest> = digests.iter().filter(|d| **d != ZERO).copied().collect();
        if let Some(at) = self.lacks(&nonzero)?.iter().position(|l| *l) {
            return Err(Error::Invalid(format!(
                "chunk {} of the copy of {} is not in the repository, and was not stored",
                format::hex(&nonzero[at]),
                self.name
            )));
        }
        let zeros = (digests.len() - nonzero.len()) as u64;
        self.counters.zero_chunks.fetch_add(zeros, Ordering::Relaxed);
        self.counters.written_chunks.fetch_add(digests.len() as u64, Ordering::Relaxed);
        self.enter(first, digests)?;
        self.maybe_checkpoint()
    }

    /// For a copy: stores chunk `ci`, whose bytes are `plain` and whose SHA-256 is
    /// `digest` (the source's reader checked them against each other: they are not hashed
    /// again), unless the repository has it, and enters it.
    pub(crate) fn enter_new(&self, ci: u64, digest: &Digest, plain: &[u8]) -> Result<()> {
        self.writable(ci, 1)?;
        if plain.len() != self.chunk_len(ci) || *digest == ZERO {
            return Err(Error::Invalid(format!(
                "chunk {ci} of the copy of {} has {} bytes, not {} (or a zero digest)",
                self.name,
                plain.len(),
                self.chunk_len(ci)
            )));
        }
        self.store_blob(digest, BlobKind::Data, plain)?;
        self.counters.written_chunks.fetch_add(1, Ordering::Relaxed);
        self.enter(ci, std::slice::from_ref(digest))?;
        self.maybe_checkpoint()
    }

    /// Stores a blob unless the repository or this writer has it already: compressed
    /// and sealed here, appended to the open pack under its lock.
    fn store_blob(&self, digest: &Digest, kind: BlobKind, plain: &[u8]) -> Result<()> {
        let id = self.repo.crypto.blob_id(digest);
        if self.index.contains(&id) {
            return Ok(());
        }
        if !self.claim(&id)? {
            return Ok(());
        }
        let r = self.store_new_blob(&id, kind, plain);
        locked(&self.claimed.0).ids.insert(id, true);
        self.claimed.1.notify_all();
        r
    }

    /// Whether this thread is to store blob `id` (claimed for it now), or this writer has
    /// it already: stored, in its own runs, or being stored by another thread (waited
    /// for, so that a chunk entered, and so counted done by a checkpoint, always has its
    /// blob in a pack). The own runs' filters are asked under the lock (memory only); a
    /// run's block is read without it, only where a filter says the id may be there.
    fn claim(&self, id: &Digest) -> Result<bool> {
        let (m, c) = &*self.claimed;
        let mut cl = locked(m);
        let mut asked = false;
        loop {
            match cl.ids.get(id) {
                Some(true) => return Ok(false),
                Some(false) => {
                    while cl.ids.get(id) == Some(&false) {
                        cl = c.wait(cl).unwrap_or_else(|e| e.into_inner());
                    }
                    return Ok(false);
                }
                None if asked || !cl.own.may_hold(id) => {
                    cl.ids.insert(*id, false);
                    return Ok(true);
                }
                None => {
                    // A blob moves to the runs before it leaves `ids`: one not in the
                    // runs now and not in `ids` when the lock is taken again is new.
                    let own = cl.own.clone();
                    drop(cl);
                    if own.find(id).map_err(|e| own_error(&self.name, e))?.is_some() {
                        return Ok(false);
                    }
                    cl = locked(m);
                    // Runs installed meanwhile may hold it (moved out of `ids`): ask again.
                    asked = Arc::ptr_eq(&own, &cl.own);
                }
            }
        }
    }

    /// Whether this writer stored, or is storing, blob `id`.
    fn has_own(&self, id: &Digest) -> Result<bool> {
        let own = {
            let cl = locked(&self.claimed.0);
            if cl.ids.contains_key(id) {
                return Ok(true);
            }
            cl.own.clone()
        };
        Ok(own.may_hold(id) && own.find(id).map_err(|e| own_error(&self.name, e))?.is_some())
    }

    fn store_new_blob(&self, id: &Digest, kind: BlobKind, plain: &[u8]) -> Result<()> {
        let id = *id;
        if kind == BlobKind::Data {
            self.counters.new_chunks.fetch_add(1, Ordering::Relaxed);
        }
        self.counters.new_plain.fetch_add(plain.len() as u64, Ordering::Relaxed);
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            s.clear();
            blob::encode_into(&self.repo.crypto, kind, &id, plain, self.level, &mut s);
            self.append(id, kind, &s, plain.len())
        })
    }

    fn append(&self, id: Digest, kind: BlobKind, stored: &[u8], plain_len: usize) -> Result<()> {
        let full = {
            let mut p = locked(&self.pack);
            if p.buf.capacity() == 0 {
                p.buf = self.take_buf();
            }
            let offset = p.buf.len() as u32;
            p.buf.extend_from_slice(stored);
            p.entries.push(BlobEntry {
                id,
                kind,
                offset,
                stored_len: stored.len() as u32,
                plain_len: plain_len as u32,
            });
            p.buf.len() >= self.pack_size || p.entries.len() >= format::PACK_BLOBS
        };
        self.counters.new_stored.fetch_add(stored.len() as u64, Ordering::Relaxed);
        if full {
            self.close_pack(false)?;
        }
        Ok(())
    }

    fn take_buf(&self) -> Vec<u8> {
        locked(&self.pool).pop().unwrap_or_else(|| Vec::with_capacity(self.pack_size + 2 * self.cs as usize + 4096))
    }

    /// Closes the open pack when it is full (or, with `force`, when it holds anything) and
    /// stores it, waiting while [`UPLOADS`] packs are on their way.
    fn close_pack(&self, force: bool) -> Result<()> {
        let (m, c) = &self.uploads;
        {
            let mut n = locked(m);
            while *n >= UPLOADS {
                n = c.wait(n).unwrap_or_else(|e| e.into_inner());
            }
            *n += 1;
        }
        struct Slot<'a>(&'a (Mutex<usize>, Condvar));
        impl Drop for Slot<'_> {
            fn drop(&mut self) {
                *locked(&self.0 .0) -= 1;
                self.0 .1.notify_one();
            }
        }
        let _slot = Slot(&self.uploads);
        let (taken, seq) = {
            let mut p = locked(&self.pack);
            if p.entries.is_empty() || (!force && p.buf.len() < self.pack_size && p.entries.len() < format::PACK_BLOBS)
            {
                return Ok(());
            }
            let mut f = locked(&self.flight.0);
            let seq = f.next;
            f.next += 1;
            f.pending.insert(seq);
            (std::mem::replace(&mut *p, OpenPack { buf: Vec::new(), entries: Vec::new() }), seq)
        };
        struct InFlight<'a>(&'a (Mutex<Flight>, Condvar), u64);
        impl Drop for InFlight<'_> {
            fn drop(&mut self) {
                locked(&self.0 .0).pending.remove(&self.1);
                self.0 .1.notify_all();
            }
        }
        let _in_flight = InFlight(&self.flight, seq);
        let OpenPack { mut buf, mut entries } = taken;
        let before = buf.len();
        let digest = self.seal_pack(&mut buf, &mut entries);
        let name = pack_name(&digest);
        if let Err(e) = self.repo.store.put(&name, &buf) {
            let e = Error::store(format!("cannot store {name} in {}", self.repo.store.describe()), e);
            // Chunks whose blobs it held are entered already: no checkpoint may count them.
            self.note_failure(&e);
            return Err(e);
        }
        self.counters.new_stored.fetch_add((buf.len() - before) as u64, Ordering::Relaxed);
        // Counted before it is in `done`, where an index object may take it (and subtract).
        self.unindexed.fetch_add(entries.len(), Ordering::SeqCst);
        locked(&self.done).push(PackBlobs { pack: digest, blobs: entries });
        buf.clear();
        let mut pool = locked(&self.pool);
        if pool.len() < UPLOADS {
            pool.push(buf);
        }
        Ok(())
    }

    /// Whole chunks `first..` with their bytes in `data` (each `chunk_len` long, at most
    /// [`BATCH`] of them): hashed together, stored, entered.
    fn full_chunks(&self, first: u64, data: &[u8]) -> Result<()> {
        let mut lens = [0usize; BATCH];
        let mut zero = [false; BATCH];
        let mut blocks: [&[u8]; BATCH] = [&[]; BATCH];
        let mut digests = [0u8; BATCH * 32];
        let mut n = 0;
        let mut hashed = 0;
        let mut at = 0;
        while at < data.len() {
            let len = self.chunk_len(first + n as u64);
            let chunk = &data[at..at + len];
            lens[n] = len;
            if ferry_hash::is_zero(chunk) {
                zero[n] = true;
            } else {
                blocks[hashed] = chunk;
                hashed += 1;
            }
            at += len;
            n += 1;
        }
        ferry_hash::Algorithm::Sha256.digest_many(&blocks[..hashed], &mut digests[..hashed * 32]);
        let mut out = [ZERO; BATCH];
        let mut h = 0;
        for (i, o) in out.iter_mut().enumerate().take(n) {
            if !zero[i] {
                o.copy_from_slice(&digests[h * 32..h * 32 + 32]);
                self.store_blob(o, BlobKind::Data, blocks[h])?;
                h += 1;
            }
        }
        let zeros = zero[..n].iter().filter(|z| **z).count() as u64;
        self.counters.zero_chunks.fetch_add(zeros, Ordering::Relaxed);
        self.counters.written_chunks.fetch_add(n as u64, Ordering::Relaxed);
        self.enter(first, &out[..n])
    }

    /// Sets the entries of chunks `first..`, dropping any part written before.
    fn enter(&self, first: u64, digests: &[Digest]) -> Result<()> {
        {
            let mut parts = locked(&self.partials);
            if !parts.is_empty() {
                for i in 0..digests.len() as u64 {
                    parts.remove(&(first + i));
                }
            }
        }
        let mut st = locked(&self.state);
        st.entries.write(first, digests).map_err(|e| spill_error(&self.name, e))?;
        st.mark_done(first, digests.len() as u64);
        let (p0, p1) = (first / self.pe, (first + digests.len() as u64 - 1) / self.pe);
        st.dirty[p0 as usize..=p1 as usize].iter_mut().for_each(|d| *d = true);
        Ok(())
    }

    /// Zero entries for whole chunks `first..first + n`.
    fn zero_chunks(&self, first: u64, n: u64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        {
            let mut parts = locked(&self.partials);
            if !parts.is_empty() {
                parts.retain(|ci, _| *ci < first || *ci >= first + n);
            }
        }
        let mut st = locked(&self.state);
        st.entries.zero(first, n).map_err(|e| spill_error(&self.name, e))?;
        st.mark_done(first, n);
        let (p0, p1) = (first / self.pe, (first + n - 1) / self.pe);
        st.dirty[p0 as usize..=p1 as usize].iter_mut().for_each(|d| *d = true);
        drop(st);
        self.counters.zero_chunks.fetch_add(n, Ordering::Relaxed);
        self.counters.written_chunks.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }

    /// Part of chunk `ci` from byte `at` of it: `data`, or `len` zeroes.
    fn partial(&self, ci: u64, at: usize, data: Option<&[u8]>, len: usize) -> Result<()> {
        let clen = self.chunk_len(ci);
        let complete = {
            let mut parts = locked(&self.partials);
            let p = parts.entry(ci).or_insert_with(|| Partial { buf: vec![0; clen], covered: Vec::new() });
            match data {
                Some(d) => p.buf[at..at + len].copy_from_slice(d),
                None => p.buf[at..at + len].fill(0),
            }
            add_range(&mut p.covered, (at, at + len));
            if p.covered == [(0, clen)] {
                parts.remove(&ci)
            } else {
                None
            }
        };
        match complete {
            Some(p) => self.full_chunks(ci, &p.buf),
            None => Ok(()),
        }
    }

    /// Splits a request into whole chunks (in batches) and parts of chunks.
    fn apply(&self, offset: u64, length: u64, data: Option<&[u8]>) -> Result<()> {
        if offset.checked_add(length).is_none_or(|e| e > self.size) {
            return Err(Error::Invalid(format!(
                "{length} bytes at offset {offset} go past the end of the disk ({} bytes)",
                self.size
            )));
        }
        if self.committed.load(Ordering::Relaxed) {
            return Err(Error::Invalid("the backup is already committed".into()));
        }
        if self.lock_lost.load(Ordering::Relaxed) {
            self.check_lock()?;
        }
        let end = offset + length;
        let mut pos = offset;
        while pos < end {
            let ci = pos / self.cs;
            let cstart = ci * self.cs;
            let cend = cstart + self.chunk_len(ci) as u64;
            if pos == cstart && end >= cend {
                // Whole chunks: up to BATCH of them, or every one for zeroes.
                let last_whole = if end == self.size { self.chunks } else { end / self.cs };
                match data {
                    Some(d) => {
                        let n = (last_whole - ci).min(BATCH as u64);
                        let stop = ((ci + n) * self.cs).min(self.size);
                        self.full_chunks(ci, &d[(pos - offset) as usize..(stop - offset) as usize])?;
                        pos = stop;
                    }
                    None => {
                        self.zero_chunks(ci, last_whole - ci)?;
                        pos = (last_whole * self.cs).min(self.size);
                    }
                }
            } else {
                let stop = end.min(cend);
                let len = (stop - pos) as usize;
                let d = data.map(|d| &d[(pos - offset) as usize..(stop - offset) as usize]);
                self.partial(ci, (pos - cstart) as usize, d, len)?;
                pos = stop;
            }
        }
        Ok(())
    }

    /// Fails once this backup's lock is gone (FORMAT.md §8): a process that took it for
    /// stale may have run gc, which deletes the packs of this backup that no index object
    /// lists yet as orphans, so an index object or a checkpoint stored now could name
    /// packs that are gone. Checked before each index object, checkpoint and manifest;
    /// once it failed, every later write, checkpoint and the commit fail too.
    fn check_lock(&self) -> Result<()> {
        let Some(g) = locked(&self.lock).as_ref().map(|g| g.check()) else { return Ok(()) };
        g.map_err(|e| match e {
            // What it stored up to its last checkpoint is whole (gc kept it).
            Error::Locked(why) if self.checkpoint_every.is_some() => Error::Locked(format!(
                "{why} (`ferry backup --resume` continues from its last checkpoint, if it stored one)"
            )),
            e => e,
        })
    }

    fn fail(&self, op: &'static str, offset: u64, length: u64, e: Error) -> ferry_backend::Error {
        self.note_failure(&e);
        backend_error(op, offset, length, e)
    }

    fn note_failure(&self, e: &Error) {
        let mut f = locked(&self.failed);
        if f.is_none() {
            *f = Some(e.to_string());
        }
    }

    /// The current content of chunk `ci` (to complete a part of it): zeroes, a blob in
    /// the repository, or one this writer stored.
    fn current_chunk(&self, ci: u64) -> Result<Vec<u8>> {
        let clen = self.chunk_len(ci);
        let d = locked(&self.state).entries.get(ci).map_err(|e| spill_error(&self.name, e))?;
        if d == ZERO {
            return Ok(vec![0; clen]);
        }
        let id = self.repo.crypto.blob_id(&d);
        let what = || format!("chunk {ci} of the previous snapshot of {}", self.name);
        let plain = if self.index.contains(&id) {
            self.repo.read_blob_any(&self.index, &id, BlobKind::Data).map_err(|why| Error::damaged(what(), why))?
        } else {
            self.session_blob(&id).ok_or_else(|| Error::damaged(what(), "it is nowhere"))??
        };
        // A chunk that was the last of a disk of another size is cut or extended.
        let mut plain = plain;
        plain.resize(clen, 0);
        Ok(plain)
    }

    /// A blob this writer stored: from the open pack, or from a pack it closed.
    fn session_blob(&self, id: &Digest) -> Option<Result<Vec<u8>>> {
        let loc_of = |pack: Digest, e: &BlobEntry| crate::BlobLocation {
            pack,
            kind: e.kind,
            offset: e.offset,
            stored_len: e.stored_len,
            plain_len: e.plain_len,
        };
        {
            let p = locked(&self.pack);
            if let Some(e) = p.entries.iter().find(|e| e.id == *id) {
                let stored = &p.buf[e.offset as usize..(e.offset + e.stored_len) as usize];
                return Some(
                    self.repo
                        .decode_blob(id, &loc_of(ZERO, e), e.kind, stored)
                        .map_err(|why| Error::damaged("the pack being written", why)),
                );
            }
        }
        {
            let done = locked(&self.done);
            for p in done.iter() {
                if let Some(e) = p.blobs.iter().find(|e| e.id == *id) {
                    let loc = loc_of(p.pack, e);
                    return Some(
                        self.repo.read_blob(id, &loc, e.kind).map_err(|why| Error::damaged(pack_name(&p.pack), why)),
                    );
                }
            }
        }
        // Moved to the runs after the look above: they have it.
        let own = locked(&self.claimed.0).own.clone();
        match own.find(id) {
            Ok(Some(loc)) => {
                Some(self.repo.read_blob(id, &loc, loc.kind).map_err(|why| Error::damaged(pack_name(&loc.pack), why)))
            }
            Ok(None) => None,
            Err(e) => Some(Err(own_error(&self.name, e))),
        }
    }

    /// The entries of page `i` (read into `buf` where the list is in a file).
    fn page<'a>(&self, st: &'a State, i: usize, buf: &'a mut Vec<Digest>) -> Result<&'a [Digest]> {
        let first = i as u64 * self.pe;
        let n = (self.chunks - first).min(self.pe) as usize;
        st.entries.read(first, n, buf).map_err(|e| spill_error(&self.name, e))
    }

    /// The blkhash of the chunk list (FORMAT.md §7), read a window at a time.
    fn blkhash(&self, st: &State) -> Result<Digest> {
        let mut h = crate::repo::BlkHasher::new(self.chunks, self.size, self.cs as u32);
        st.entries.each_window(
            |e| spill_error(&self.name, e),
            |_, w| {
                h.feed(w);
                Ok(())
            },
        )?;
        Ok(h.finish())
    }

    /// Stores what is pending (partial chunks are completed from the base), the index
    /// object and the manifest, then releases the lock. `read` is the bytes read from the
    /// source, for the manifest's stats.
    pub fn commit(&self, read: u64) -> Result<SnapshotInfo> {
        self.commit_with(read, None)
    }

    /// [`SnapshotWriter::commit`] of a copy of another repository's snapshot
    /// ([`crate::copy`]): the manifest is dated `origin.time` (the source manifest's own
    /// time, unless it is ahead of the copier's clock: see [`copy_time`]), keeps its
    /// `host`, and says where it came from (`copied_from`, FORMAT.md §7).
    pub(crate) fn commit_copy(&self, read: u64, origin: &CopyOrigin) -> Result<SnapshotInfo> {
        self.commit_with(read, Some(origin))
    }

    fn commit_with(&self, read: u64, origin: Option<&CopyOrigin>) -> Result<SnapshotInfo> {
        let _no_checkpoint = locked(&self.checkpointing);
        self.stop_merge();
        if self.committed.swap(true, Ordering::SeqCst) {
            return Err(Error::Invalid("this backup is already committed".into()));
        }
        if self.lock_lost.load(Ordering::SeqCst) {
            self.check_lock()?;
        }
        if let Some(why) = locked(&self.failed).clone() {
            return Err(Error::Invalid(format!(
                "a write to the backup failed ({why}), so the snapshot would not be whole; nothing was committed: \
                 run the backup again"
            )));
        }
        // Complete the parts of chunks from what the chunks held.
        let parts: Vec<(u64, Partial)> = locked(&self.partials).drain().collect();
        for (ci, mut p) in parts {
            let cur = self.current_chunk(ci)?;
            let mut at = 0;
            for &(s, e) in p.covered.iter().chain(std::iter::once(&(p.buf.len(), p.buf.len()))) {
                p.buf[at..s].copy_from_slice(&cur[at..s]);
                at = e;
            }
            self.full_chunks(ci, &p.buf)?;
        }
        // Pages: the base's (or the last checkpoint's) where nothing changed, else made
        // again. Located pages (FORMAT.md §7c) name where their chunks are: the data packs
        // are closed first, so that this backup's own chunks have their places.
        if self.located {
            self.close_pack(true)?;
            self.wait_packs();
        }
        let own = if self.located { self.own_places(BlobKind::Data) } else { Vec::new() };
        // The places of the chunks moved to the runs, a window of pages at a time.
        let mut moved: (Option<usize>, Vec<(Digest, format::BlobAt)>) = (None, Vec::new());
        let page_kind = if self.located { BlobKind::Located } else { BlobKind::Page };
        let st = locked(&self.state);
        let pe = self.pe as usize;
        let mut pages = Vec::with_capacity(st.dirty.len());
        let mut page_buf = Vec::with_capacity(pe * 32);
        let mut entries_buf = Vec::with_capacity(pe);
        for i in 0..st.dirty.len() {
            let first = i * pe;
            if !st.dirty[i] && !self.located {
                pages.push(st.pages[i]);
                continue;
            }
            let slice = self.page(&st, i, &mut entries_buf)?;
            if !st.dirty[i] && self.base_page_holds(&st, first, slice)? {
                pages.push(st.pages[i]);
                continue;
            }
            if slice.iter().all(|e| *e == ZERO) {
                pages.push(ZERO);
            } else {
                if self.located {
                    let w = i / PLACE_WINDOW_PAGES;
                    if moved.0 != Some(w) {
                        let places = self.moved_places(&st, w * PLACE_WINDOW_PAGES, PLACE_WINDOW_PAGES)?;
                        moved = (Some(w), places);
                    }
                    page_buf = self.located_page(&st, first, slice, &own, &moved.1)?;
                } else {
                    page_buf.clear();
                    slice.iter().for_each(|e| page_buf.extend_from_slice(e));
                }
                let d = sha256(&page_buf);
                self.store_blob(&d, page_kind, &page_buf)?;
                pages.push(d);
            }
        }
        drop(own);
        drop(moved);
        self.store_condemned_again(&st, &pages, page_kind)?;
        self.refuse_lost(&st, &pages)?;
        self.close_pack(true)?;
        let (page_packs, pages) = if self.located {
            self.wait_packs();
            self.hinted_pages(pages)?
        } else {
            (format::PackIds::default(), pages.into_iter().collect())
        };
        // One index object for every pack of this backup since its last checkpoint.
        self.check_lock()?;
        self.store_index(false)?;
        let blkhash = match self.cs {
            65536 => Some(format::hex(&self.blkhash(&st)?)),
            _ => None,
        };
        drop(st);
        // The time of this host's clock, never the parent's (a parent dated in the future
        // would otherwise date every later snapshot of the disk the same, and retention
        // would see one day): lists order a snapshot after its parent whatever the times
        // say (FORMAT.md §7). Nanoseconds: two snapshots of one disk taken within a second
        // (a full read after the disk's size changed has no parent to order it by) still
        // have an order.
        let now = jiff::Timestamp::now();
        let time = match origin {
            Some(o) => o.time.clone(),
            None => {
                let now = self.time.unwrap_or(now);
                if let Some(b) = &self.base {
                    warn_future_parent(&self.name, b, now);
                }
                now.to_string()
            }
        };
        let s = self.stats();
        let manifest = Manifest {
            version: if self.located { format::LOCATED_VERSION } else { format::VERSION },
            name: self.name.clone(),
            time,
            size: self.size,
            chunk_size: self.cs as u32,
            page_entries: self.pe as u32,
            page_packs,
            pages,
            parent: self.base.as_ref().map(|b| b.id.clone()),
            migrated_from: None,
            source: self.source.clone(),
            changes: self.changes.clone(),
            blkhash,
            stats: SnapshotStats {
                read,
                written_chunks: s.written_chunks,
                new_chunks: s.new_chunks,
                new_stored: s.new_stored,
                zero_chunks: s.zero_chunks,
            },
            host: origin.map_or_else(hostname, |o| o.host.clone()),
            ferry: env!("CARGO_PKG_VERSION").into(),
            copied_from: origin.map(|o| o.from.clone()),
            tags: self.tags.clone(),
            note: self.note.clone(),
        };
        let sealed = self.repo.crypto.seal(AAD_SNAPSHOT, &manifest.to_bytes());
        let id = format::hex(&sha256(&sealed));
        let name = format!("snapshots/{id}");
        // Our lock must still be there: a gc that took it for stale may have freed our
        // packs as orphans, and a snapshot listed now could lack them.
        if let Some(g) = locked(&self.lock).as_ref() {
            g.check()?;
        }
        self.repo
            .store
            .put(&name, &sealed)
            .map_err(|e| Error::store(format!("cannot store {name} in {}", self.repo.store.describe()), e))?;
        self.check_lock_after(&name, &sealed)?;
        // The interrupted backup this one continued (or its own checkpoint) is done with.
        if let Err(e) = self.repo.discard_checkpoint(&self.name) {
            log::warn!("snapshot {id} is stored, but its checkpoint stays: {e}");
        }
        drop(locked(&self.lock).take());
        Ok(SnapshotInfo::new(id, manifest))
    }

    /// Appends the trailer and the tail to a pack's blobs (`buf`, listed in `entries`); its
    /// digest. A pack must not have the name of one that gc condemned (the same bytes
    /// written again, as an unencrypted repository's backup of data stored before in
    /// the same order makes them): a later gc deletes that name. Such a pack gets a
    /// second copy of its first blob, which makes other bytes (FORMAT.md §8a).
    fn seal_pack(&self, buf: &mut Vec<u8>, entries: &mut Vec<BlobEntry>) -> Digest {
        loop {
            let blobs_end = buf.len();
            let trailer = format::encode_trailer(entries);
            self.repo.crypto.seal_into(AAD_TRAILER, &trailer, buf);
            let sealed_len = (buf.len() - blobs_end) as u32;
            buf.extend_from_slice(&format::pack_tail(sealed_len));
            let digest = sha256(buf);
            let taken = self.condemned.contains(&digest) || locked(&self.condemned_since).contains(&digest);
            if !taken || entries.len() >= format::MAX_TRAILER_ENTRIES as usize {
                return digest;
            }
            log::info!(
                "a new pack would have the name of a condemned one, {}: it is stored with a blob twice",
                pack_name(&digest)
            );
            buf.truncate(blobs_end);
            let first = entries[0];
            buf.extend_from_within(first.offset as usize..first.offset as usize + first.stored_len as usize);
            entries.push(BlobEntry { offset: blobs_end as u32, ..first });
        }
    }

    /// Stores again, before the manifest, the blobs that the new snapshot uses and whose
    /// every copy is in a pack that gc condemned since this backup started (FORMAT.md
    /// §8a): deduplicated against then, or the base's. The condemned packs are still in
    /// the store (the gc that deletes them waits for this backup's lock to go), so each
    /// blob is read from there.
    fn store_condemned_again(&self, st: &State, pages: &[Digest], page_kind: BlobKind) -> Result<()> {
        // A backup whose lock went stale meanwhile stops here: the gc that took it for
        // stale may have deleted those packs.
        self.check_lock()?;
        let now = self.repo.condemned_packs()?;
        let new: HashSet<&Digest> = now.iter().filter(|p| !self.condemned.contains(*p)).collect();
        if new.is_empty() {
            return Ok(());
        }
        // The blobs stored again below must not land in a pack named as one of these.
        locked(&self.condemned_since).extend(new.iter().copied().copied());
        self.store_own_condemned_again(&new)?;
        // Every copy in a pack condemned since, and none stored by this backup.
        let doomed = |id: &Digest, locs: &[crate::BlobLocation]| {
            // One whose own copy cannot be looked up is stored again: always safe.
            !locs.is_empty() && locs.iter().all(|l| new.contains(&l.pack)) && !self.has_own(id).unwrap_or(false)
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut again = 0u64;
        // The index as it is now, read where a chunk seems doomed: a gc stores the index
        // objects of the packs it copied the live blobs to before its record, so what it
        // condemned is found in its new packs, and is not stored again.
        // If it cannot be read (a listing or an index object gc deletes meanwhile), those
        // chunks are stored again, as before the reload: always safe.
        let mut index_now: Option<Option<RunIndex>> = None;
        // A batch of ids, sorted: looked up on every core, a slice of neighbours each
        // (they share the index blocks read), and what only condemned packs hold stored.
        let mut store_batch = |keyed: Vec<(Digest, u64)>, kind: BlobKind| -> Result<()> {
            let mut ids: Vec<Digest> = keyed.into_iter().map(|k| k.0).collect();
            ids.dedup();
            let parts: Vec<&[Digest]> = ids.chunks(1 << 14).collect();
            let found = crate::repo::par_map(&parts, threads, |part| {
                let locs = self.index.locations_each(part);
                part.iter().zip(locs).filter(|(id, l)| doomed(id, l)).map(|(id, _)| *id).collect::<Vec<Digest>>()
            });
            let mut found: Vec<Digest> = found.into_iter().flatten().collect();
            if !found.is_empty() {
                let index_now = index_now.get_or_insert_with(|| match self.index_now(&now) {
                    Ok(ix) => Some(ix),
                    Err(e) => {
                        log::warn!(
                            "cannot read the index as it is now ({e}): the chunks of {} in packs gc condemned \
                             meanwhile are stored again",
                            self.name
                        );
                        None
                    }
                });
                if let Some(index_now) = index_now {
                    let elsewhere = index_now.locations_each(&found);
                    let mut kept = elsewhere.iter().map(|l| l.is_empty());
                    found.retain(|_| kept.next().unwrap_or(true));
                }
            }
            for id in found {
                if self.has_own(&id).unwrap_or(false) {
                    continue;
                }
                let plain = self.repo.read_blob_any(&self.index, &id, kind).map_err(|why| {
                    Error::Invalid(format!(
                        "a chunk of the snapshot of {} is in a pack that gc condemned while this backup ran, and \
                         cannot be read to be stored again ({why}): nothing was committed; run the backup again",
                        self.name
                    ))
                })?;
                self.store_new_blob(&id, kind, &plain)?;
                locked(&self.claimed.0).ids.insert(id, true);
                again += 1;
            }
            Ok(())
        };
        // The snapshot's blobs: its pages, then its chunks, a window at a time.
        let all = |_: u64| true;
        let mut k = Keyed { repo: &self.repo, keyed: Vec::new() };
        k.add(0, pages, &all);
        store_batch(k.take(), page_kind)?;
        st.entries.each_window(
            |e| spill_error(&self.name, e),
            |first, w| {
                k.add(first, w, &all);
                if k.full() {
                    store_batch(k.take(), BlobKind::Data)?;
                }
                Ok(())
            },
        )?;
        store_batch(k.take(), BlobKind::Data)?;
        if again > 0 {
            log::info!(
                "{again} blob(s) of the snapshot of {} were in packs condemned meanwhile: stored again",
                self.name
            );
        }
        Ok(())
    }

    /// The repository's index as it is now (the index objects stored since this backup
    /// started read into the cache), with only the copies in packs present and condemned
    /// neither when this backup started nor in `condemned`, and none recorded damaged.
    fn index_now(&self, condemned: &HashSet<Digest>) -> Result<RunIndex> {
        let index = RunIndex::open(&self.repo)?;
        let mut present = self.repo.present_packs()?;
        present.retain(|p| !condemned.contains(p) && !self.condemned.contains(p));
        Ok(index.only_present(present).without_damaged())
    }

    /// Stores again the blobs of this backup's own packs that took the name of a pack gc
    /// condemned since this backup started (`new`): an unencrypted pack sealed before the
    /// commit, with the very bytes of an orphan condemned meanwhile, has its name, and
    /// the disk's next backup treats it as absent (a later gc deletes it once it is
    /// unused). The pack is still in the store (the gc that deletes it waits for this
    /// backup's lock), so each blob is read from there; the copies made now go to a pack
    /// of another name ([`Self::seal_pack`] sees `condemned_since`).
    fn store_own_condemned_again(&self, new: &HashSet<&Digest>) -> Result<()> {
        let again = |id: &Digest, loc: crate::BlobLocation| -> Result<()> {
            let plain = self.repo.read_blob(id, &loc, loc.kind).map_err(|why| {
                Error::Invalid(format!(
                    "a pack of the backup of {} took the name of one gc condemned meanwhile, and cannot be read to \
                     store its blobs again ({why}): nothing was committed; run the backup again",
                    self.name
                ))
            })?;
            self.store_new_blob(id, loc.kind, &plain)
        };
        // Those moved to the runs (read a block at a time), then those in memory.
        let own = locked(&self.claimed.0).own.clone();
        let mut told = HashSet::new();
        own.each_in(new, |id, loc| {
            if told.insert(loc.pack) {
                log::info!(
                    "a pack of this backup has the name of one gc condemned meanwhile, {}: its blobs are stored again",
                    pack_name(&loc.pack)
                );
            }
            again(id, loc)
        })?;
        let in_memory: Vec<PackBlobs> = locked(&self.done).iter().filter(|p| new.contains(&p.pack)).cloned().collect();
        for p in &in_memory {
            log::info!(
                "a pack of this backup has the name of one gc condemned meanwhile, {}: its blobs are stored again",
                pack_name(&p.pack)
            );
            for e in &p.blobs {
                again(&e.id, crate::BlobLocation::of(p.pack, e))?;
            }
        }
        Ok(())
    }

    /// After the manifest (or a checkpoint) is stored as `sealed`: the lock must still be
    /// ours. A process frozen between its last check and the store (a stopped host) may
    /// have lost it meanwhile, and a gc that took it for stale may have deleted what the
    /// object names: then the object is removed again, and the backup fails. Only while
    /// it still holds what this backup stored: a checkpoint has the disk's name, and the
    /// backup that took the disk over once the lock went may have stored its own there.
    fn check_lock_after(&self, object: &str, sealed: &[u8]) -> Result<()> {
        let Some(r) = locked(&self.lock).as_ref().map(|g| g.check()) else { return Ok(()) };
        match r {
            Ok(()) => Ok(()),
            // Lost: a gc may have deleted what the object names.
            Err(e @ Error::Locked(_)) => {
                match self.repo.store.get(object, sealed.len() as u64 + 1) {
                    Ok(there) if there != sealed => {
                        log::warn!(
                            "{object} is not removed: another backup of {} stored its own there since this one's \
                             lock went",
                            self.name
                        );
                        return Err(e);
                    }
                    Err(g) if g.kind() == io::ErrorKind::NotFound => return Err(e),
                    // Ours, or it cannot be told: what a gc may have emptied goes (a
                    // checkpoint costs only resume progress; one naming deleted packs
                    // would stop every gc).
                    _ => {}
                }
                if let Err(d) = self.repo.store.delete(object) {
                    log::warn!(
                        "cannot remove {object} from {}: {d}; run `ferry repo check`",
                        self.repo.store.describe()
                    );
                }
                Err(e)
            }
            // The store could not say (a network error): the lock was confirmed less than
            // LOST_AFTER ago, so no gc took it for stale; what was stored stays.
            Err(e) => {
                log::warn!("{object} is stored, but the lock could not be checked after it: {e}");
                Ok(())
            }
        }
    }

    /// The last guard before the manifest: it must name no blob that is neither in a
    /// present pack nor stored by this backup. Chunks this backup wrote were stored as
    /// they came; the others are the base's (or the resumed checkpoint's), checked when
    /// the writer started (condemned packs counted as absent): only those found lost then
    /// can be missing, and each must have been written since; what sits only in packs
    /// condemned since was stored again just before ([`Self::store_condemned_again`]), and
    /// the gc that deletes those packs waits for this backup's lock. Pages kept from the
    /// base were read through present packs when the writer started.
    fn refuse_lost(&self, st: &State, pages: &[Digest]) -> Result<()> {
        let unread: Vec<u64> = self.lost.iter().flat_map(|[f, n]| *f..f + n).filter(|ci| !st.is_done(*ci)).collect();
        let mut page_gone = None;
        for (p, _) in pages.iter().zip(&st.dirty).filter(|(p, dirty)| **p != ZERO && !**dirty) {
            let id = self.repo.crypto.blob_id(p);
            if !self.index.contains(&id) && !self.has_own(&id)? {
                page_gone = Some((p, ()));
                break;
            }
        }
        if let Some(first) = unread.first() {
            return Err(Error::Invalid(format!(
                "the snapshot of {} would use {} chunk(s) that are lost from the repository (their packs are \
                 gone, or their only copies are recorded damaged) and that this backup did not read (the first at byte {}): nothing was committed. Run a backup \
                 that reads the whole disk (without a change map)",
                self.name,
                unread.len(),
                first * self.cs
            )));
        }
        if let Some((p, _)) = page_gone {
            return Err(Error::Invalid(format!(
                "the snapshot of {} would use page {} of its previous snapshot, which is in no present pack: \
                 nothing was committed. Run a backup that reads the whole disk (without a change map)",
                self.name,
                format::hex(p)
            )));
        }
        Ok(())
    }

    /// This backup's stored blobs of `kind`, as (pack, blob) numbers into `done`, sorted by
    /// id: 8 bytes a blob beside what `done` holds already.
    fn own_places(&self, kind: BlobKind) -> Vec<(u32, u32)> {
        let done = locked(&self.done);
        let mut v: Vec<(u32, u32)> = done
            .iter()
            .enumerate()
            .flat_map(|(p, pb)| {
                pb.blobs.iter().enumerate().filter(|(_, b)| b.kind == kind).map(move |(b, _)| (p as u32, b as u32))
            })
            .collect();
        v.sort_unstable_by_key(|&(p, b)| done[p as usize].blobs[b as usize].id);
        v
    }

    /// Where this backup stored blob `id`, looked up in `own` ([`Self::own_places`]) and
    /// `done` (locked by the caller).
    fn own_place(done: &[PackBlobs], own: &[(u32, u32)], id: &Digest) -> Option<format::BlobAt> {
        let blob = |&(p, b): &(u32, u32)| &done[p as usize].blobs[b as usize];
        let k = own.binary_search_by(|x| blob(x).id.cmp(id)).ok()?;
        let (p, e) = (done[own[k].0 as usize].pack, blob(&own[k]));
        Some(format::BlobAt { pack: p, offset: e.offset, stored_len: e.stored_len })
    }

    /// Whether the base's page holds for the page of chunks `first..` (`slice`): a located
    /// page in the index, none of its chunks written by this backup, and each one that is
    /// not zero hinted at a pack that is present and not condemned. Otherwise the page is
    /// made again with current places.
    fn base_page_holds(&self, st: &State, first: usize, slice: &[Digest]) -> Result<bool> {
        let page = st.pages[first / self.pe as usize];
        // A located page of the repository (not one this backup's checkpoint stored, of
        // kind 1, nor one whose only copy is gone).
        let located = page == ZERO
            || self.index.first(&self.repo.crypto.blob_id(&page)).is_some_and(|l| l.kind == BlobKind::Located);
        if !located || self.base_hints.is_empty() {
            return Ok(false);
        }
        let base = self.base_hints.range(first as u64, slice.len(), &self.name)?;
        Ok(slice.iter().zip(&base).enumerate().all(|(k, (d, h))| {
            let ci = first + k;
            !st.is_done(ci as u64) && (*d == ZERO || h.is_some())
        }))
    }

    /// The located page (FORMAT.md §7c) of chunks `first..` (`slice`, one page's entries):
    /// each chunk's place is where this backup stored it, else the base's hint for the
    /// same chunk (an entry this backup did not write) where its pack is present and not
    /// condemned, else the index's first usable copy.
    fn located_page(
        &self,
        st: &State,
        first: usize,
        slice: &[Digest],
        own: &[(u32, u32)],
        moved: &[(Digest, format::BlobAt)],
    ) -> Result<Vec<u8>> {
        let ids: Vec<Digest> = slice.iter().map(|d| self.repo.crypto.blob_id(d)).collect();
        let mut at: Vec<Option<format::BlobAt>> = {
            let done = locked(&self.done);
            slice
                .iter()
                .zip(&ids)
                .map(|(d, id)| match *d == ZERO {
                    true => None,
                    false => Self::own_place(&done, own, id).or_else(|| moved_place(moved, id)),
                })
                .collect()
        };
        let base = self.base_hints.range(first as u64, slice.len(), &self.name)?;
        for (k, a) in at.iter_mut().enumerate().filter(|(k, a)| a.is_none() && slice[*k] != ZERO) {
            let ci = first + k;
            // The base's hint holds for an entry this backup did not write, and for one it
            // wrote with the base's content (a full backup reads every chunk again): an
            // unchanged page is then the same bytes as the base's, and is stored once.
            *a = match &base[k] {
                Some(h) if !st.is_done(ci as u64) || h.is_of(&slice[k]) => Some(h.at),
                _ => crate::repo::first_at(&self.index, &ids[k], BlobKind::Data),
            };
        }
        Ok(format::encode_located_page(slice, &at))
    }

    /// The manifest's pages with their hints (FORMAT.md §7c): where this backup stored each
    /// page blob, else the index's first usable copy; and the packs they name, in order of
    /// first use.
    fn hinted_pages(&self, pages: Vec<Digest>) -> Result<(format::PackIds, format::Pages)> {
        let own = self.own_places(BlobKind::Located);
        let ids: Vec<Digest> = pages.iter().filter(|d| **d != ZERO).map(|d| self.repo.crypto.blob_id(d)).collect();
        let moved = self.moved_places_of(ids, BlobKind::Located)?;
        let done = locked(&self.done);
        let places: Vec<(Digest, Option<format::BlobAt>)> = pages
            .into_iter()
            .map(|d| {
                let id = self.repo.crypto.blob_id(&d);
                let at = (d != ZERO)
                    .then(|| {
                        Self::own_place(&done, &own, &id)
                            .or_else(|| moved_place(&moved, &id))
                            .or_else(|| crate::repo::first_at(&self.index, &id, BlobKind::Located))
                    })
                    .flatten();
                (d, at)
            })
            .collect();
        Ok(format::hinted_pages(places))
    }

    /// The places of the data blobs that this writer moved to its runs, for the non-zero
    /// chunks of pages `first..first + n`: sorted by id, looked up in order.
    fn moved_places(&self, st: &State, first: usize, n: usize) -> Result<Vec<(Digest, format::BlobAt)>> {
        let mut ids = Vec::new();
        let mut buf = Vec::new();
        if locked(&self.claimed.0).own.entries() == 0 {
            return Ok(Vec::new());
        }
        for i in first..(first + n).min(st.dirty.len()) {
            let slice = self.page(st, i, &mut buf)?;
            ids.extend(slice.iter().filter(|d| **d != ZERO).map(|d| self.repo.crypto.blob_id(d)));
        }
        self.moved_places_of(ids, BlobKind::Data)
    }

    /// [`Self::moved_places`] of `ids`.
    fn moved_places_of(&self, mut ids: Vec<Digest>, kind: BlobKind) -> Result<Vec<(Digest, format::BlobAt)>> {
        let own = locked(&self.claimed.0).own.clone();
        if own.entries() == 0 {
            return Ok(Vec::new());
        }
        ids.retain(|id| own.may_hold(id));
        ids.sort_unstable();
        ids.dedup();
        let found = own.find_each(&ids).map_err(|e| own_error(&self.name, e))?;
        Ok(ids
            .into_iter()
            .zip(found)
            .filter_map(|(id, l)| {
                l.filter(|l| l.kind == kind)
                    .map(|l| (id, format::BlobAt { pack: l.pack, offset: l.offset, stored_len: l.stored_len }))
            })
            .collect())
    }

    /// Stores the index objects for the packs closed since the last ones.
    /// `move_out`: then the blobs they list move to this writer's own runs, where enough
    /// of them are in memory (never at commit: it holds places by their number in `done`).
    fn store_index(&self, move_out: bool) -> Result<()> {
        self.store_index_locked(locked(&self.indexed), move_out)
    }

    fn store_index_locked(&self, mut indexed: MutexGuard<'_, usize>, move_out: bool) -> Result<()> {
        let packs: Vec<PackBlobs> = locked(&self.done)[*indexed..].to_vec();
        if !packs.is_empty() {
            let (_, stored) = self.repo.put_index(&packs)?;
            self.counters.new_stored.fetch_add(stored, Ordering::Relaxed);
            *indexed += packs.len();
            self.unindexed.fetch_sub(packs.iter().map(|p| p.blobs.len()).sum(), Ordering::SeqCst);
        }
        drop(packs);
        if move_out {
            self.move_own(&mut indexed)?;
        }
        Ok(())
    }

    /// Moves the blobs of the packs that an index object lists (`done[..indexed]`) to this
    /// writer's own runs, where there are a quarter of [`Self::own_in_memory`] or more: the
    /// runs first, then they leave `claimed` and `done` (a blob is always in one or the
    /// other). Runs due to be merged are merged by a thread of their own, one merge at a
    /// time.
    fn move_own(&self, indexed: &mut usize) -> Result<()> {
        let (packs, blobs) = {
            let done = locked(&self.done);
            let blobs: usize = done[..*indexed].iter().map(|p| p.blobs.len()).sum();
            if *indexed == 0
                || blobs < self.own_in_memory.load(Ordering::Relaxed) / 4
                || blobs < self.move_again_at.load(Ordering::Relaxed)
            {
                return Ok(());
            }
            (done[..*indexed].to_vec(), blobs)
        };
        let n = packs.len();
        // Only here are runs added (under `indexed`): the batch is the next of `own` now.
        let own = locked(&self.claimed.0).own.clone();
        let batch = match own.write_batch(&self.own_dir, packs) {
            Ok(b) => b,
            Err(e) => {
                // The blobs stay in memory (as they did before they moved): the backup
                // goes on, and tries again once twice as many wait.
                if self.move_again_at.swap(blobs.saturating_mul(2), Ordering::Relaxed) == 0 {
                    log::warn!(
                        "the backup of {} cannot move the list of the chunks it stored to {} ({e}): it stays in \
                         memory, and the backup goes on (free space there, or set FERRY_CACHE_DIR, to keep its memory \
                         bounded)",
                        self.name,
                        self.own_dir.display()
                    );
                }
                return Ok(());
            }
        };
        // `claimed` is locked before `done` (nowhere else are both held).
        let mut cl = locked(&self.claimed.0);
        cl.own = Arc::new(cl.own.and(batch));
        let mut done = locked(&self.done);
        for b in done[..n].iter().flat_map(|p| &p.blobs) {
            if cl.ids.get(&b.id) == Some(&true) {
                cl.ids.remove(&b.id);
            }
        }
        cl.ids.shrink_to_fit();
        let merge = cl.own.merge_due().filter(|_| !self.merging.swap(true, Ordering::SeqCst));
        drop(cl);
        done.drain(..n);
        *indexed -= n;
        drop(done);
        if let Some(mut m) = merge {
            // Beside the backup: the checkpoints (and so the moves) go on meanwhile. The
            // runs stay as they are where it fails (lookups read one more).
            let (claimed, merging, cancel, dir, name) = (
                self.claimed.clone(),
                self.merging.clone(),
                self.merge_cancel.clone(),
                self.own_dir.clone(),
                self.name.clone(),
            );
            // The last merge ended (`merging` was clear): its thread is joined at once.
            let mut slot = locked(&self.merge_thread);
            if let Some(t) = slot.take() {
                let _ = t.join();
            }
            let r = std::thread::Builder::new().name("ferry-own-merge".into()).spawn(move || {
                match m.run(&dir, &cancel) {
                    Ok(()) => {
                        let mut cl = locked(&claimed.0);
                        if let Some(next) = cl.own.with_merged(&m) {
                            cl.own = Arc::new(next);
                        }
                    }
                    Err(_) if cancel.load(Ordering::Relaxed) => {}
                    Err(e) => log::warn!("{}", own_error(&name, e)),
                }
                merging.store(false, Ordering::SeqCst);
            });
            match r {
                Ok(t) => *slot = Some(t),
                Err(e) => {
                    self.merging.store(false, Ordering::SeqCst);
                    log::warn!("{}", own_error(&self.name, e));
                }
            }
        }
        Ok(())
    }

    /// Stops the merge of the own runs that runs beside the backup, if any, and waits for
    /// its thread: the runs stay as they were.
    fn stop_merge(&self) {
        self.merge_cancel.store(true, Ordering::SeqCst);
        if let Some(t) = locked(&self.merge_thread).take() {
            let _ = t.join();
        }
    }

    /// Waits until every pack taken from the open pack so far is stored (or failed).
    fn wait_packs(&self) {
        let (m, c) = &self.flight;
        let mut f = locked(m);
        let target = f.next;
        while f.pending.first().is_some_and(|s| *s < target) {
            f = c.wait(f).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Makes what this backup wrote so far durable and records it (FORMAT.md §7a): the
    /// open pack and the changed pages are stored, one index object lists the packs
    /// since the last checkpoint, and `checkpoints/TAG` says which chunks are done. A
    /// backup interrupted after this can be resumed ([`SnapshotWriter::resume`]).
    /// Writes may go on meanwhile (they are in the next checkpoint).
    pub fn checkpoint(&self) -> Result<()> {
        let _one = locked(&self.checkpointing);
        self.checkpoint_locked()
    }

    /// A checkpoint if one is due and none is running (from the write path): every
    /// `checkpoint_every`, and as soon as [`Self::own_in_memory`] blobs this writer stored
    /// wait for an index object (the checkpoint stores one, and they move out of memory).
    /// A failed one is only warned about (the backup goes on), unless the lock is gone:
    /// then the backup stops, with that error. A writer without checkpoints keeps its
    /// blobs in memory: an index object alone would list packs that no checkpoint uses,
    /// which a gc beside it condemns as unused.
    fn maybe_checkpoint(&self) -> Result<()> {
        let Some(every) = self.checkpoint_every else { return Ok(()) };
        let full = || self.unindexed.load(Ordering::Relaxed) >= self.own_in_memory.load(Ordering::Relaxed);
        let due = |every: Duration| {
            let since = locked(&self.last_checkpoint).elapsed();
            !self.committed.load(Ordering::Relaxed) && (since >= every || full() && since >= CHECKPOINT_GAP)
        };
        if !due(every) {
            return Ok(());
        }
        let Ok(_one) = self.checkpointing.try_lock() else { return Ok(()) };
        if !due(every) {
            return Ok(());
        }
        let r = self.checkpoint_locked();
        *locked(&self.last_checkpoint) = Instant::now();
        match r {
            Err(e) if self.lock_lost.load(Ordering::SeqCst) => Err(e),
            Err(e) => {
                log::warn!(
                    "no checkpoint of the backup of {} (it goes on, but cannot be resumed from here): {e}",
                    self.name
                );
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    fn checkpoint_locked(&self) -> Result<()> {
        if self.committed.load(Ordering::SeqCst) {
            return Err(Error::Invalid("the backup is already committed".into()));
        }
        if self.lock_lost.load(Ordering::SeqCst) {
            self.check_lock()?;
        }
        let failed =
            || locked(&self.failed).clone().map(|why| Error::Invalid(format!("a write to the backup failed ({why})")));
        if let Some(e) = failed() {
            return Err(e);
        }
        // The chunks done as of now, then the changed pages' entries, a group of pages
        // at a time (each page holds at least what was done now; a chunk entered since
        // that it holds has its blob stored too, before the packs are closed below).
        let done = locked(&self.state).done_runs(self.chunks);
        let n_pages = locked(&self.state).dirty.len();
        let mut pages = vec![ZERO; n_pages];
        let mut taken: Vec<usize> = Vec::new();
        let mut r = Ok(());
        let mut buf = Vec::new();
        for group in (0..n_pages).step_by(CHECKPOINT_PAGES) {
            let todo = {
                let mut st = locked(&self.state);
                let mut todo: Vec<(usize, Vec<Digest>)> = Vec::new();
                let end = (group + CHECKPOINT_PAGES).min(n_pages);
                for (i, page) in pages.iter_mut().enumerate().take(end).skip(group) {
                    if !st.dirty[i] {
                        *page = st.pages[i];
                        continue;
                    }
                    match self.page(&st, i, &mut buf) {
                        Ok(p) => todo.push((i, p.to_vec())),
                        Err(e) => {
                            r = Err(e);
                            break;
                        }
                    }
                    st.dirty[i] = false;
                    taken.push(i);
                }
                todo
            };
            if r.is_ok() {
                r = self.checkpoint_pages(&todo, &mut pages);
            }
            if r.is_err() {
                break;
            }
        }
        let r = r.and_then(|()| self.checkpoint_store(&pages, done)).and_then(|()| failed().map_or(Ok(()), Err));
        let mut st = locked(&self.state);
        for i in &taken {
            match r {
                Ok(()) => st.pages[*i] = pages[*i],
                Err(_) => st.dirty[*i] = true,
            }
        }
        r
    }

    /// Stores the pages `todo` (page number, entries) and sets their digests in `pages`.
    fn checkpoint_pages(&self, todo: &[(usize, Vec<Digest>)], pages: &mut [Digest]) -> Result<()> {
        let mut page_buf = Vec::with_capacity(self.pe as usize * 32);
        for (i, entries) in todo {
            if entries.iter().all(|e| *e == ZERO) {
                pages[*i] = ZERO;
            } else {
                page_buf.clear();
                entries.iter().for_each(|e| page_buf.extend_from_slice(e));
                let d = sha256(&page_buf);
                self.store_blob(&d, BlobKind::Page, &page_buf)?;
                pages[*i] = d;
            }
        }
        Ok(())
    }

    fn checkpoint_store(&self, pages: &[Digest], done: Vec<[u64; 2]>) -> Result<()> {
        // Every blob of a chunk entered before now is in the open pack or in one on its way.
        self.close_pack(true)?;
        self.wait_packs();
        if let Some(why) = locked(&self.failed).clone() {
            return Err(Error::Invalid(format!("a write to the backup failed ({why})")));
        }
        self.check_lock()?;
        self.store_index(true)?;
        let ck = Checkpoint {
            version: format::VERSION,
            name: self.name.clone(),
            time: crate::repo::now_seconds(),
            size: self.size,
            chunk_size: self.cs as u32,
            page_entries: self.pe as u32,
            base: self.base.as_ref().map(|b| b.id.clone()),
            source: self.source.clone(),
            identity: self.identity.clone(),
            changes: self.changes.clone(),
            pages: pages.iter().copied().collect(),
            done,
        };
        let sealed = self.repo.crypto.seal(AAD_CHECKPOINT, &ck.to_bytes());
        if sealed.len() as u64 > format::MAX_CHECKPOINT {
            return Err(Error::Invalid(format!(
                "the checkpoint would be {} bytes, more than the {} a checkpoint may have",
                sealed.len(),
                format::MAX_CHECKPOINT
            )));
        }
        let object = self.repo.checkpoint_object(&self.name);
        self.check_lock()?;
        self.repo
            .store
            .put(&object, &sealed)
            .map_err(|e| Error::store(format!("cannot store {object} in {}", self.repo.store.describe()), e))?;
        // Stored after the lock went, it may name packs a gc deleted meanwhile: removed.
        self.check_lock_after(&object, &sealed)
    }

    /// Calls `f` with the chunk list as it stands, as a function from a chunk's number to
    /// its entry (one digest per chunk, [`ZERO`] for a zero chunk), and the number of
    /// chunks: before the copy writes anything, the base's (or the resumed checkpoint's),
    /// for a caller that checks a change map against it. Neighbouring chunks are read a
    /// window at a time. A part of the list that cannot be read (the file a large disk's
    /// list is kept in) makes the whole call an error, whatever `f` made of it.
    pub fn with_entries<R>(&self, f: impl FnOnce(&dyn Fn(u64) -> Digest, u64) -> R) -> Result<R> {
        let st = locked(&self.state);
        let window: RefCell<(u64, Vec<Digest>)> = RefCell::new((u64::MAX, Vec::new()));
        let failed: RefCell<Option<std::io::Error>> = RefCell::new(None);
        let entry = |ci: u64| {
            let mut w = window.borrow_mut();
            let start = ci - ci % crate::entries::WINDOW as u64;
            if w.0 != start {
                let n = (self.chunks - start).min(crate::entries::WINDOW as u64) as usize;
                let mut buf = Vec::new();
                let read = match st.entries.read(start, n, &mut buf) {
                    Ok(e) => e.to_vec(),
                    Err(e) => {
                        failed.borrow_mut().get_or_insert(e);
                        vec![ZERO; n]
                    }
                };
                *w = (start, read);
            }
            w.1[(ci - start) as usize]
        };
        let r = f(&entry, self.chunks);
        match failed.into_inner() {
            Some(e) => Err(spill_error(&self.name, e)),
            None => Ok(r),
        }
    }

    /// Whether the new snapshot reads as zeroes where nothing is written (no base): then
    /// the copy engine may skip the source's holes and zero ranges.
    pub fn starts_zeroed(&self) -> bool {
        self.base.is_none()
    }

    pub fn stats(&self) -> WriterStats {
        let c = &self.counters;
        WriterStats {
            written_chunks: c.written_chunks.load(Ordering::Relaxed),
            zero_chunks: c.zero_chunks.load(Ordering::Relaxed),
            new_chunks: c.new_chunks.load(Ordering::Relaxed),
            new_plain: c.new_plain.load(Ordering::Relaxed),
            new_stored: c.new_stored.load(Ordering::Relaxed),
        }
    }
}

/// What a copied snapshot keeps of its source ([`SnapshotWriter::commit_copy`]).
#[derive(Debug, Clone)]
pub(crate) struct CopyOrigin {
    /// The source snapshot's host.
    pub host: String,
    /// The copy's `time`: [`copy_time`] of the source manifest's own time (not of
    /// `from.time`, the first snapshot of a chain of copies).
    pub time: String,
    /// The source repository's id, the snapshot's id and time there.
    pub from: format::CopiedFrom,
}

/// The `time` of a copy of a snapshot dated `source` made `now`: the source's, unless
/// it is later than `now` (a clock that was ahead, or a forged time): then `now`, so that
/// a copy never sorts after what this repository gets later (FORMAT.md §7).
pub(crate) fn copy_time(source: &str, now: jiff::Timestamp) -> String {
    match parse_time(source) {
        Some(t) if t <= now => source.to_string(),
        _ => {
            log::warn!(
                "the snapshot copied is dated {source}, after this host's clock ({now}): the copy is dated now (its \
                 `copied_from` keeps the time it had)"
            );
            now.to_string()
        }
    }
}

/// A parent dated more than this ahead of the writer's clock is warned about (less is the
/// skew of two hosts' clocks).
const FUTURE_SKEW: jiff::SignedDuration = jiff::SignedDuration::from_secs(60);

/// Warns when `parent`, the base of a snapshot of `name` committed `now`, is dated in the
/// future: a clock that was ahead (or this one is behind). Returns whether it warned.
pub(crate) fn warn_future_parent(name: &str, parent: &SnapshotInfo, now: jiff::Timestamp) -> bool {
    let Some(t) = parse_time(&parent.manifest.time).filter(|t| *t > now + FUTURE_SKEW) else { return false };
    log::warn!(
        "snapshot {} of {name}, the base of this backup, is dated {} ({} ahead of this host's clock, {now}; the host \
         that wrote it had a clock ahead, or this one is behind): the new snapshot records this host's time, and lists \
         order it after its base; retention (`ferry repo forget --keep-*`) files each snapshot under its own time",
        &parent.id[..parent.id.len().min(8)],
        parent.manifest.time,
        ahead(t.as_second() - now.as_second()),
    );
    true
}

/// `secs` for people: minutes, hours or days.
fn ahead(secs: i64) -> String {
    match secs {
        s if s >= 2 * 86400 => format!("{} days", s / 86400),
        s if s >= 2 * 3600 => format!("{} hours", s / 3600),
        s => format!("{} minutes", s / 60),
    }
}

/// How `opts` differs from the backup that stored `ck` (empty when it may be resumed):
/// disk, size, base snapshot, change map, source identity.
pub fn checkpoint_mismatch(ck: &Checkpoint, opts: &BackupOptions) -> Vec<String> {
    let mut v = Vec::new();
    if ck.name != opts.name {
        v.push(format!("it is of disk {}, not {}", ck.name, opts.name));
    }
    if ck.size != opts.size {
        v.push(format!("the source was {} bytes and is {} now", ck.size, opts.size));
    }
    let base = opts.base.as_ref().map(|b| b.id.as_str());
    // A full backup needs nothing from a base: one that went on without its base (which
    // could not be read) is continued without it.
    let baseless_full = ck.base.is_none() && opts.changes == Changes::Full && ck.changes == Changes::Full;
    // A base migrated since (`ferry repo migrate`) is the same snapshot under its new id.
    let migrated =
        ck.base.is_some() && ck.base.as_deref() == opts.base.as_ref().and_then(|b| b.manifest.migrated_from.as_deref());
    if ck.base.as_deref() != base && !baseless_full && !migrated {
        let show = |b: Option<&str>| b.map_or("none".to_string(), |b| format!("snapshot {}", &b[..b.len().min(8)]));
        v.push(format!("it continued {}, this backup {}", show(ck.base.as_deref()), show(base)));
    }
    if ck.changes != opts.changes {
        v.push(format!("it read {}, this backup {}", read_what(&ck.changes), read_what(&opts.changes)));
    }
    if ck.identity != opts.identity {
        v.push(format!("the source was {:?} and is {:?} now", ck.identity, opts.identity));
    }
    v
}

/// Chunk runs `[first, count]` as byte ranges (offset, length) of a disk of `size` bytes.
/// The base snapshot's chunk hints (FORMAT.md §7c) that point into packs present and not
/// condemned, at copies not recorded damaged: the packs they name and, per chunk, a 32-byte
/// record kept as the chunk list is ([`Entries`]: in memory, or in a file for a large
/// disk): the pack's number plus one (0: no hint), the offset and the stored length,
/// little-endian, then the first [`BASE_DIGEST`] bytes of the base's digest there (so that
/// a chunk written again with the same content keeps its hint).
struct BaseHints {
    packs: Vec<Digest>,
    at: Option<Entries>,
}

/// The bytes of the base's chunk digest a [`BaseHints`] record keeps.
const BASE_DIGEST: usize = 20;

/// One chunk's base hint: where the base found it, and (a prefix of) the digest it had.
#[derive(Clone, Copy)]
struct BaseHint {
    at: format::BlobAt,
    digest: [u8; BASE_DIGEST],
}

impl BaseHint {
    /// Whether the hint is of a chunk of digest `d` (the base's chunk at the position).
    fn is_of(&self, d: &Digest) -> bool {
        d[..BASE_DIGEST] == self.digest
    }
}

impl BaseHints {
    fn none() -> BaseHints {
        BaseHints { packs: Vec::new(), at: None }
    }

    fn is_empty(&self) -> bool {
        self.at.is_none()
    }

    fn record(pack: u32, offset: u32, stored_len: u32, digest: &Digest) -> Digest {
        let mut r = ZERO;
        r[0..4].copy_from_slice(&(pack + 1).to_le_bytes());
        r[4..8].copy_from_slice(&offset.to_le_bytes());
        r[8..12].copy_from_slice(&stored_len.to_le_bytes());
        r[12..].copy_from_slice(&digest[..BASE_DIGEST]);
        r
    }

    /// The hints of chunks `first..first + n` (`None` where there is none).
    fn range(&self, first: u64, n: usize, what: &str) -> Result<Vec<Option<BaseHint>>> {
        let Some(at) = &self.at else { return Ok(vec![None; n]) };
        let mut buf = Vec::new();
        let records = at.read(first, n, &mut buf).map_err(|e| spill_error(what, e))?;
        let word = |r: &Digest, i: usize| u32::from_le_bytes([r[i], r[i + 1], r[i + 2], r[i + 3]]);
        Ok(records
            .iter()
            .map(|r| {
                let no = word(r, 0).checked_sub(1)?;
                let pack = *self.packs.get(no as usize)?;
                let at = format::BlobAt { pack, offset: word(r, 4), stored_len: word(r, 8) };
                Some(BaseHint { at, digest: r[12..].try_into().expect("a record's digest bytes") })
            })
            .collect())
    }
}

fn runs_to_ranges(runs: &[[u64; 2]], cs: u64, size: u64) -> Vec<(u64, u64)> {
    runs.iter()
        .map(|[f, n]| {
            let start = f * cs;
            (start, ((f + n) * cs).min(size) - start)
        })
        .collect()
}

/// The runs of chunks not done whose entry names a blob that `index` (present packs only)
/// does not have. Every entry is looked at: this is what lets the commit trust the
/// entries a backup does not write.
fn lost_runs(repo: &Repository, index: &dyn BlobLookup, state: &State) -> Result<Vec<[u64; 2]>> {
    let mut runs = Vec::new();
    for ci in missing_chunks(repo, index, &state.entries, |ci| !state.is_done(ci))? {
        push_run(&mut runs, ci, 1);
    }
    Ok(runs)
}

/// Blob ids with a position each, gathered from windows of digests and handed out
/// sorted, a batch at a time: neighbouring ids share the blocks of the index cache they
/// are looked up in, so a disk of 16M chunks costs a read of each block per batch, not a
/// block per chunk; and a batch bounds the memory (40 bytes an id).
struct Keyed<'a> {
    repo: &'a Repository,
    keyed: Vec<(Digest, u64)>,
}

impl Keyed<'_> {
    const BATCH: usize = 1 << 18;

    /// Adds the ids of `digests` (the first at position `first`) that are not zero and
    /// that `pick` selects (by position). The ids are made on several threads (a keyed
    /// hash each when encrypted).
    fn add(&mut self, first: u64, digests: &[Digest], pick: &(dyn Fn(u64) -> bool + Sync)) {
        const SLICE: usize = 1 << 12;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let slices: Vec<usize> = (0..digests.len()).step_by(SLICE).collect();
        let keyed = crate::repo::par_map(&slices, threads, |&s| {
            (s..(s + SLICE).min(digests.len()))
                .filter(|&i| digests[i] != ZERO && pick(first + i as u64))
                .map(|i| (self.repo.crypto.blob_id(&digests[i]), first + i as u64))
                .collect::<Vec<(Digest, u64)>>()
        });
        self.keyed.extend(keyed.into_iter().flatten());
    }

    fn full(&self) -> bool {
        self.keyed.len() >= Self::BATCH
    }

    /// What was added since the last batch, sorted by id.
    fn take(&mut self) -> Vec<(Digest, u64)> {
        let mut k = std::mem::take(&mut self.keyed);
        k.sort_unstable();
        k
    }
}

/// The chunks, in order, that `pick` selects whose entry is not zero and names a blob
/// that `index` does not have (looked up sorted, a batch at a time: [`Keyed`]).
fn missing_chunks(
    repo: &Repository,
    index: &dyn BlobLookup,
    entries: &Entries,
    pick: impl Fn(u64) -> bool + Sync,
) -> Result<Vec<u64>> {
    let mut missing = Vec::new();
    let lookup = |keyed: Vec<(Digest, u64)>, missing: &mut Vec<u64>| {
        let mut ids: Vec<Digest> = keyed.iter().map(|k| k.0).collect();
        ids.dedup();
        let found = index.contains_each(&ids);
        let mut at = 0;
        for (id, ci) in keyed {
            while ids[at] != id {
                at += 1;
            }
            if !found[at] {
                missing.push(ci);
            }
        }
    };
    let mut k = Keyed { repo, keyed: Vec::new() };
    entries.each_window(
        |e| spill_error("a backup", e),
        |first, w| {
            k.add(first, w, &pick);
            if k.full() {
                lookup(k.take(), &mut missing);
            }
            Ok(())
        },
    )?;
    lookup(k.take(), &mut missing);
    missing.sort_unstable();
    Ok(missing)
}

/// The place of `id` in `moved` ([`SnapshotWriter::moved_places`]).
fn moved_place(moved: &[(Digest, format::BlobAt)], id: &Digest) -> Option<format::BlobAt> {
    moved.binary_search_by(|m| m.0.cmp(id)).ok().map(|k| moved[k].1)
}

fn own_error(what: &str, e: io::Error) -> Error {
    Error::Invalid(format!(
        "the list of the chunks that the backup of {what} stored, moved to files in the cache directory, cannot be \
         read or written: {e}; free space there (or set FERRY_CACHE_DIR to a directory with room), then run the \
         backup again"
    ))
}

/// An error of the file that holds a backup's chunk list ([`crate::entries`]).
fn spill_error(what: &str, e: io::Error) -> Error {
    Error::Invalid(format!(
        "the chunk list of {what} cannot be read or written in its file in the cache directory: {e}; free space \
         there (or set FERRY_CACHE_DIR to a directory with room), then run the backup again"
    ))
}

/// What a backup with these changes reads, for messages.
fn read_what(c: &Changes) -> String {
    match c {
        Changes::Full => "the whole disk".into(),
        Changes::DirtyBitmap { bitmap } => format!("the ranges of the dirty bitmap {bitmap:?}"),
        Changes::ExtentsFrom { file } => format!("the ranges listed in {file:?}"),
    }
}

/// Adds `r` to sorted, merged ranges.
fn add_range(v: &mut Vec<(usize, usize)>, r: (usize, usize)) {
    v.push(r);
    v.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(v.len());
    for &(s, e) in v.iter() {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    *v = out;
}

impl Drop for SnapshotWriter {
    fn drop(&mut self) {
        self.stop_merge();
    }
}

impl Backend for SnapshotWriter {
    fn describe(&self) -> String {
        format!("{}::{} (backup in progress)", self.repo.store.describe(), self.name)
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn caps(&self) -> Capabilities {
        Capabilities {
            read_only: false,
            flush: true,
            fua: false,
            trim: true,
            zero: true,
            fast_zero: true,
            multi_conn: false,
            cache: false,
            extents: false,
        }
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> ferry_backend::Result<()> {
        Err(ferry_backend::Error {
            kind: ferry_backend::ErrorKind::NotSupported,
            op: "read",
            offset,
            length: buf.len() as u64,
            source: Some(io::Error::other(
                "a backup in progress cannot be read: read the snapshot once it is committed",
            )),
        })
    }
    fn write(&self, buf: &[u8], offset: u64, _fua: bool) -> ferry_backend::Result<()> {
        let len = buf.len() as u64;
        self.apply(offset, len, Some(buf))
            .and_then(|()| self.maybe_checkpoint())
            .map_err(|e| self.fail("write", offset, len, e))
    }
    /// Nothing is durable before [`SnapshotWriter::commit`]: a backup is whole or absent.
    fn flush(&self) -> ferry_backend::Result<()> {
        Ok(())
    }
    /// The range reads as zeroes in the snapshot (zero entries where it covers chunks).
    fn trim(&self, offset: u64, length: u64, _fua: bool) -> ferry_backend::Result<()> {
        self.apply(offset, length, None)
            .and_then(|()| self.maybe_checkpoint())
            .map_err(|e| self.fail("trim", offset, length, e))
    }
    fn zero(&self, offset: u64, length: u64, _mode: ZeroMode, _fua: bool) -> ferry_backend::Result<()> {
        self.apply(offset, length, None)
            .and_then(|()| self.maybe_checkpoint())
            .map_err(|e| self.fail("zero", offset, length, e))
    }
}
