//! The local index cache (not part of the format: FORMAT.md, "Local index cache"): the
//! repository's index objects, kept on this host as sorted, immutable run files, so that a
//! backup, a restore, `serve` and `hash` look blobs up by reading a block of a file instead
//! of holding every index entry in memory.
//!
//! A run file: a header (magic, version, counts, the checksum of the tables), the names
//! of the index objects it covers, a table of pack rows (pack id, which covered object
//! listed it, how many entries it has), then fixed-stride 48-byte entries sorted by (blob
//! id, row, offset) in blocks of `BLOCK` entries, then the fence: each block's first id
//! and CRC-32. Opening a run reads its header and tables only; a lookup reads one block
//! per run (`pread`), checks its CRC and order, and binary-searches it.
//!
//! Beside each run `run-X`, its filter `filter-X` (`bloom`: 12 bits an entry,
//! built with the run, checked against the run's table checksum and entry count and its
//! own CRC when read): a lookup of an id that a run does not hold (most of a backup's new
//! chunks) reads one 64-byte block of the filter instead of a block of the run, and about
//! 0.5% of them read the run's block anyway. A filter is read (1.5 bytes an entry, held
//! while the run is open) on the first lookup of a backup, never by restore, `serve` or
//! `hash`, whose ids are present. A filter that is missing or fails its checks is built
//! again from the run then.
//!
//! Nothing in the cache is trusted blindly: a run whose tables or a block fail their
//! checks is discarded (with a warning) and built again from the index objects in the
//! store, which are read (one group at a time, bounded memory) only when no run covers
//! them: a warm start reads only the index objects that are new since the last one (after
//! a gc, only those it stored: it keeps the others, FORMAT.md §9). An index object that is
//! gone from the store (gc rewrote it) makes its entries dead: skipped at lookup, dropped
//! by the next merge. Runs are merged (a streaming k-way
//! merge) so that there are at most `MAX_RUNS` and each is over 4 times the size of
//! the runs after it. A `runs` file names the current runs (written atomically), and an
//! exclusive `flock` of `lock` is held around every update, so that two processes on one
//! host never both build.
//!
//! [`BlobLookup`] is what readers and writers ask: implemented by the in-memory [`Index`]
//! (check, verify, gc) and by [`RunIndex`], this cache seen with the damage records and,
//! for a backup, the packs present in the store.
use crate::bloom::{self, Bloom};
use crate::damage::DamageSet;
use crate::format::{self, BlobKind, Digest, PackBlobs};
use crate::repo::{par_map, Index, Location, Repository, FETCH_THREADS};
use crate::{Error, Result};
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

/// The environment variable that names the cache directory.
pub const CACHE_DIR_ENV: &str = "FERRY_CACHE_DIR";

const MAGIC: &[u8; 8] = b"ferryrun";
const RUN_VERSION: u32 = 1;
const HEADER: usize = 64;
const ENTRY: usize = 48;
const ROW: usize = 40;
const FENCE: usize = 36;
/// Entries per block written.
pub(crate) const BLOCK: u32 = 128;
/// The most entries per block a run may declare.
const MAX_BLOCK: usize = 256;
/// The most bytes of a run's tables (object names, pack rows, fence) read into memory.
const MAX_TABLES: u64 = 1 << 30;
/// Runs kept at most (a lookup reads one block of each).
pub(crate) const MAX_RUNS: usize = 4;
/// The top bit of an entry's plain length: a page blob.
const PAGE_BIT: u32 = 1 << 31;
/// With [`PAGE_BIT`], the next bit: a located page (FORMAT.md §7c). Plain lengths stay
/// far below it (a located page is at most 2 + 74 * 65536 bytes).
const LOCATED_BIT: u32 = 1 << 30;
/// Other repositories' cache directories unused this long are removed.
const PRUNE_AFTER: Duration = Duration::from_secs(30 * 86400);
/// Entries gathered from index objects before they are written as a run.
const BUILD_ENTRIES: usize = 1 << 20;
/// Stored bytes of index objects read at once (side by side) when runs are built (or one
/// larger object alone): each is held parsed until its entries are gathered.
const READ_GROUP_BYTES: u64 = 16 << 20;
const MANIFEST: &str = "runs";
const MANIFEST_HEAD: &str = "ferry index cache 1";

/// Where a blob is, as readers and backups ask it.
pub trait BlobLookup: Sync {
    /// Every location of `id`, in the order to try them (copies recorded damaged last);
    /// none when it is in no index object.
    fn locations(&self, id: &Digest) -> Vec<Location>;
    /// The first location of `id`.
    fn first(&self, id: &Digest) -> Option<Location> {
        self.locations(id).into_iter().next()
    }
    /// Whether `id` has a location.
    fn contains(&self, id: &Digest) -> bool {
        self.first(id).is_some()
    }
    /// [`BlobLookup::contains`] of each of `ids`, which are sorted (neighbours share
    /// the blocks they are read from).
    fn contains_each(&self, ids: &[Digest]) -> Vec<bool> {
        ids.iter().map(|id| self.contains(id)).collect()
    }
}

impl BlobLookup for Index {
    fn locations(&self, id: &Digest) -> Vec<Location> {
        Index::locations(self, id).copied().collect()
    }
    fn first(&self, id: &Digest) -> Option<Location> {
        self.blobs.get(id).copied()
    }
    fn contains(&self, id: &Digest) -> bool {
        self.blobs.contains_key(id)
    }
}

/// Where a run's bytes are read from: its file, or bytes in memory (tests, fuzzing).
trait Source {
    fn read_at(&self, buf: &mut [u8], at: u64) -> io::Result<()>;
}

impl Source for File {
    fn read_at(&self, buf: &mut [u8], at: u64) -> io::Result<()> {
        self.read_exact_at(buf, at)
    }
}

impl Source for [u8] {
    fn read_at(&self, buf: &mut [u8], at: u64) -> io::Result<()> {
        let s = usize::try_from(at).ok().filter(|s| s.checked_add(buf.len()).is_some_and(|e| e <= self.len()));
        let s = s.ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(&self[s..s + buf.len()]);
        Ok(())
    }
}

/// A pack as listed by one covered index object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Row {
    pack: Digest,
    object: u32,
    count: u32,
}

/// One entry of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ent {
    id: Digest,
    row: u32,
    offset: u32,
    stored_len: u32,
    /// The plain length, with [`PAGE_BIT`] for a page.
    plain: u32,
}

impl Ent {
    fn read(b: &[u8]) -> Ent {
        let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut id = [0u8; 32];
        id.copy_from_slice(&b[..32]);
        Ent { id, row: u(32), offset: u(36), stored_len: u(40), plain: u(44) }
    }
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id);
        for v in [self.row, self.offset, self.stored_len, self.plain] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    fn key(&self) -> (Digest, u32, u32) {
        (self.id, self.row, self.offset)
    }
    fn location(&self, rows: &[Row]) -> Location {
        Location {
            pack: rows[self.row as usize].pack,
            kind: match (self.plain & PAGE_BIT != 0, self.plain & LOCATED_BIT != 0) {
                (false, _) => BlobKind::Data,
                (true, false) => BlobKind::Page,
                (true, true) => BlobKind::Located,
            },
            offset: self.offset,
            stored_len: self.stored_len,
            plain_len: self.plain & !(PAGE_BIT | LOCATED_BIT),
        }
    }
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn digest_at(b: &[u8], i: usize) -> Digest {
    let mut d = [0u8; 32];
    d.copy_from_slice(&b[i..i + 32]);
    d
}

/// A run's tables: what opening it reads.
#[derive(Debug)]
struct Meta {
    block: u32,
    /// The checksum of its header and tables (what its filter is bound to).
    crc: u32,
    objects: Vec<Digest>,
    rows: Vec<Row>,
    fence: Vec<Digest>,
    sums: Vec<u32>,
    entries: u64,
}

/// The byte offsets of a run's entries and fence, and its length, from its counts.
fn layout(objects: u64, rows: u64, entries: u64, block: u32) -> Option<(u64, u64, u64)> {
    let blocks = entries.div_ceil(block as u64);
    let entries_at =
        (HEADER as u64).checked_add(objects.checked_mul(32)?)?.checked_add(rows.checked_mul(ROW as u64)?)?;
    let fence_at = entries_at.checked_add(entries.checked_mul(ENTRY as u64)?)?;
    Some((entries_at, fence_at, fence_at.checked_add(blocks.checked_mul(FENCE as u64)?)?))
}

/// The CRC-32 of a run's header (before the checksum) and tables.
fn tables_crc(head: &[u8], objects: &[u8], rows: &[u8], fence: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for part in [head, objects, rows, fence] {
        h.update(part);
    }
    h.finalize()
}

impl Meta {
    /// Reads and checks a run's header and tables (`len`: its length). Every count is
    /// checked against the length before anything is allocated.
    fn parse<S: Source + ?Sized>(src: &S, len: u64) -> Result<Meta, String> {
        let mut h = [0u8; HEADER];
        src.read_at(&mut h, 0).map_err(|e| format!("its header cannot be read: {e}"))?;
        if &h[..8] != MAGIC {
            return Err("it is not a run file (wrong magic)".into());
        }
        if u32_at(&h, 8) != RUN_VERSION {
            return Err(format!("it is of version {}, not {RUN_VERSION}", u32_at(&h, 8)));
        }
        let block = u32_at(&h, 12);
        let (n_objects, n_rows) = (u32_at(&h, 16) as u64, u32_at(&h, 20) as u64);
        let entries = u64::from_le_bytes(h[24..32].try_into().unwrap_or_default());
        if block == 0 || block as usize > MAX_BLOCK {
            return Err(format!("its blocks of {block} entries are out of bounds"));
        }
        let (entries_at, fence_at, total) = layout(n_objects, n_rows, entries, block).ok_or("its counts overflow")?;
        if total != len {
            return Err(format!("it has {len} bytes, its counts say {total}"));
        }
        let tables = (entries_at - HEADER as u64) + (total - fence_at);
        if tables > MAX_TABLES {
            return Err(format!("its tables of {tables} bytes are beyond {MAX_TABLES}"));
        }
        let read = |at: u64, n: u64| -> Result<Vec<u8>, String> {
            let mut v = vec![0u8; n as usize];
            src.read_at(&mut v, at).map_err(|e| format!("its tables cannot be read: {e}"))?;
            Ok(v)
        };
        let objects_b = read(HEADER as u64, n_objects * 32)?;
        let rows_b = read(HEADER as u64 + n_objects * 32, n_rows * ROW as u64)?;
        let fence_b = read(fence_at, total - fence_at)?;
        let crc = u32_at(&h, 32);
        if tables_crc(&h[..32], &objects_b, &rows_b, &fence_b) != crc {
            return Err("its header or tables fail their checksum".into());
        }
        let objects: Vec<Digest> = objects_b.chunks_exact(32).map(|c| digest_at(c, 0)).collect();
        if objects.windows(2).any(|w| w[0] >= w[1]) {
            return Err("its object names are not sorted".into());
        }
        let rows: Vec<Row> = rows_b
            .chunks_exact(ROW)
            .map(|c| Row { pack: digest_at(c, 0), object: u32_at(c, 32), count: u32_at(c, 36) })
            .collect();
        if rows.iter().any(|r| r.object as u64 >= n_objects)
            || rows.windows(2).any(|w| (w[0].object, w[0].pack) >= (w[1].object, w[1].pack))
        {
            return Err("its pack table is out of order or names no object of it".into());
        }
        if rows.iter().map(|r| r.count as u64).sum::<u64>() != entries {
            return Err("its pack table's counts do not add up to its entries".into());
        }
        let fence: Vec<Digest> = fence_b.chunks_exact(FENCE).map(|c| digest_at(c, 0)).collect();
        let sums: Vec<u32> = fence_b.chunks_exact(FENCE).map(|c| u32_at(c, 32)).collect();
        if fence.windows(2).any(|w| w[0] > w[1]) {
            return Err("its fence is not sorted".into());
        }
        Ok(Meta { block, crc, objects, rows, fence, sums, entries })
    }

    fn entries_at(&self) -> u64 {
        HEADER as u64 + self.objects.len() as u64 * 32 + self.rows.len() as u64 * ROW as u64
    }

    /// Block `b`'s entries, read into `buf` and checked: its CRC, its first id (the
    /// fence's), its order, its rows.
    fn read_block<'a, S: Source + ?Sized>(&self, src: &S, b: usize, buf: &'a mut Vec<u8>) -> Result<&'a [u8], String> {
        let first = b as u64 * self.block as u64;
        let n = (self.entries - first).min(self.block as u64) as usize;
        buf.resize(n * ENTRY, 0);
        src.read_at(buf, self.entries_at() + first * ENTRY as u64)
            .map_err(|e| format!("block {b} cannot be read: {e}"))?;
        if crc32fast::hash(buf) != self.sums[b] {
            return Err(format!("block {b} fails its checksum"));
        }
        // In order by (id, row, offset), every row in the table: ids compared as bytes,
        // the rest only between copies of one id.
        let bad = || format!("block {b} is out of order or names a pack row it does not have");
        let mut prev: &[u8] = &[];
        for c in buf.chunks_exact(ENTRY) {
            if u32_at(c, 32) as usize >= self.rows.len() {
                return Err(bad());
            }
            if !prev.is_empty() {
                match prev[..32].cmp(&c[..32]) {
                    std::cmp::Ordering::Greater => return Err(bad()),
                    std::cmp::Ordering::Equal
                        if (u32_at(prev, 32), u32_at(prev, 36)) > (u32_at(c, 32), u32_at(c, 36)) =>
                    {
                        return Err(bad())
                    }
                    _ => {}
                }
            }
            prev = c;
        }
        if buf.get(..32) != Some(&self.fence[b][..]) {
            return Err(format!("block {b} does not start with its fence's id"));
        }
        Ok(buf)
    }

    /// Calls `f` with each entry of `id`, reading the blocks that may hold it (one,
    /// unless its copies cross a block's end). `cache` keeps the last block read, for a
    /// caller that looks up sorted ids.
    fn lookup<S: Source + ?Sized>(
        &self,
        src: &S,
        id: &Digest,
        cache: &mut BlockCache,
        mut f: impl FnMut(&Ent),
    ) -> Result<(), String> {
        let p = self.fence.partition_point(|d| d < id);
        if p == 0 && self.fence.first() != Some(id) {
            return Ok(());
        }
        let mut b = p.saturating_sub(1);
        loop {
            if cache.at != Some(b) {
                cache.at = None;
                self.read_block(src, b, &mut cache.bytes)?;
                cache.at = Some(b);
            }
            let block = &cache.bytes;
            let n = block.len() / ENTRY;
            // The first entry not below `id`.
            let (mut lo, mut hi) = (0, n);
            while lo < hi {
                let mid = (lo + hi) / 2;
                if block[mid * ENTRY..mid * ENTRY + 32] < id[..] {
                    lo = mid + 1;
                } else {
                    hi = mid;
                }
            }
            let mut i = lo;
            while i < n && block[i * ENTRY..i * ENTRY + 32] == id[..] {
                f(&Ent::read(&block[i * ENTRY..(i + 1) * ENTRY]));
                i += 1;
            }
            b += 1;
            if b >= self.fence.len() || self.fence[b] != *id {
                return Ok(());
            }
        }
    }
}

/// The last block a lookup read.
#[derive(Default)]
struct BlockCache {
    at: Option<usize>,
    bytes: Vec<u8>,
}

thread_local! {
    /// Each thread's buffer for the block a single lookup reads (no allocation per lookup).
    static BLOCK_BUF: std::cell::RefCell<BlockCache> = std::cell::RefCell::new(BlockCache::default());
}

/// Checks a run given as bytes, and looks up a few ids in it, and the same bytes as a
/// list of runs: what fuzzing drives. Never panics, whatever the bytes.
pub fn fuzz(data: &[u8]) {
    // The same bytes as a list of runs, for the key its second line names.
    if let Ok(text) = std::str::from_utf8(data) {
        let key = text.lines().nth(1).and_then(|l| l.strip_prefix("key ")).unwrap_or_default();
        if let Listed::Runs(names) = listed_runs(text, key) {
            assert!(names.iter().all(|n| valid_run_name(n)));
        }
    }
    let Ok(meta) = Meta::parse(data, data.len() as u64) else { return };
    let mut cache = BlockCache::default();
    let probes = [[0u8; 32], [0xff; 32], meta.fence.first().copied().unwrap_or_default()];
    for id in probes.iter().chain(meta.fence.iter().take(8)) {
        let _ = meta.lookup(data, id, &mut cache, |e| {
            let _ = e.location(&meta.rows);
        });
    }
}

/// Checks a stored filter of the local index cache given as bytes (see `bloom`): what
/// fuzzing drives. Never panics, whatever the bytes.
pub fn fuzz_filter(data: &[u8]) {
    bloom::fuzz(data);
}

/// An open run file, with its filter ([`Bloom`]: `None` for a run too large to have one),
/// loaded on the first [`Run::may_hold`] (only a backup asks: restore, serve and hash
/// look up ids that are present, where a filter saves nothing).
struct Run {
    file: File,
    dir: PathBuf,
    name: String,
    meta: Meta,
    filter: OnceLock<Option<Bloom>>,
}

/// The name of the filter file of run `run` (`run-X`: `filter-X`).
fn filter_name(run: &str) -> String {
    format!("filter-{}", run.strip_prefix("run-").unwrap_or(run))
}

/// Removes run `name` and its filter.
fn remove_run(dir: &Path, name: &str) {
    let _ = std::fs::remove_file(dir.join(name));
    let _ = std::fs::remove_file(dir.join(filter_name(name)));
}

impl Run {
    /// Opens run `name` in `dir` and checks its tables; its filter is the one given (just
    /// built with it), else loaded when first asked for ([`Run::filter`]).
    fn open(dir: &Path, name: &str, filter: Option<Bloom>) -> Result<Run, String> {
        let file = File::open(dir.join(name)).map_err(|e| format!("it cannot be opened: {e}"))?;
        let len = file.metadata().map_err(|e| format!("it cannot be read: {e}"))?.len();
        let meta = Meta::parse(&file, len)?;
        let run = Run { file, dir: dir.into(), name: name.into(), meta, filter: OnceLock::new() };
        if let Some(f) = filter {
            let _ = run.filter.set(Some(f));
        }
        Ok(run)
    }

    /// The filter: its file, checked against the run; one that is missing or fails its
    /// checks is built again from the run's entries (each block checked) and written
    /// (where the directory can be written). `None` for a run too large to have one, or
    /// whose blocks fail their checks (its lookups then find that and fall back).
    fn filter(&self) -> Option<&Bloom> {
        self.filter
            .get_or_init(|| match self.read_filter(&self.dir) {
                Ok(f) => f,
                Err(why) => {
                    log::debug!("the filter of the index cache's run {} is built again: {why}", self.name);
                    let f = self.build_filter().unwrap_or_else(|why| {
                        log::debug!("the filter of the index cache's run {} is not built: {why}", self.name);
                        None
                    });
                    if let Some(f) = &f {
                        self.write_filter(&self.dir, f);
                    }
                    f
                }
            })
            .as_ref()
    }

    /// The filter file, checked; `Ok(None)` for a run too large to have a filter.
    fn read_filter(&self, dir: &Path) -> Result<Option<Bloom>, String> {
        let Some(want) = Bloom::stored_len(self.meta.entries) else { return Ok(None) };
        let path = dir.join(filter_name(&self.name));
        let f = File::open(&path).map_err(|e| format!("it cannot be opened: {e}"))?;
        let len = f.metadata().map_err(|e| format!("it cannot be read: {e}"))?.len();
        if len != want {
            return Err(format!("it has {len} bytes, not {want}"));
        }
        // The header first, checked against the run; then the bits, read once into the
        // filter's own buffer (no copy), their size the one the header was checked for.
        let mut h = [0u8; bloom::HEADER];
        f.read_exact_at(&mut h, 0).map_err(|e| format!("it cannot be read: {e}"))?;
        let h = Bloom::check_header(&h, self.meta.crc, self.meta.entries)?;
        let mut bits = vec![0u8; h.bits_len];
        f.read_exact_at(&mut bits, bloom::HEADER as u64).map_err(|e| format!("it cannot be read: {e}"))?;
        Bloom::from_bits(h, bits).map(Some)
    }

    /// The filter of every entry of the run, its blocks read and checked.
    fn build_filter(&self) -> Result<Option<Bloom>, String> {
        let Some(mut f) = Bloom::new(self.meta.entries) else { return Ok(None) };
        let mut buf = Vec::new();
        for b in 0..self.meta.fence.len() {
            let block = self.meta.read_block(&self.file, b, &mut buf)?;
            for e in block.chunks_exact(ENTRY) {
                f.insert(&digest_at(e, 0));
            }
        }
        Ok(Some(f))
    }

    /// Writes the filter file (a temporary file renamed: never seen in part). A cache
    /// that cannot be written (read-only, full) keeps the filter in memory only, and says
    /// so once a process: each later run of ferry builds it again from the run.
    fn write_filter(&self, dir: &Path, f: &Bloom) {
        let tmp = dir.join(random_name("tmp-"));
        let path = dir.join(filter_name(&self.name));
        let r = private_file(&tmp)
            .and_then(|mut out| {
                out.write_all(&f.header(self.meta.crc, self.meta.entries))?;
                out.write_all(f.bits())
            })
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = r {
            let _ = std::fs::remove_file(&tmp);
            if e.kind() == io::ErrorKind::NotFound {
                // Its temporary file removed by another process's clean-up of the cache
                // (which takes it for a stray): the next run writes the filter.
                log::debug!("the index cache's filter {} is not written: {e}", path.display());
                return;
            }
            static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                log::warn!(
                    "the index cache's filter {} cannot be written ({e}): it is kept in memory only, and each \
                     later run reads its whole run again to build it (lookups of new chunks are slower until the \
                     cache directory can be written: free space or fix its permissions)",
                    path.display()
                );
            } else {
                log::debug!("the index cache's filter {} cannot be written: {e}", path.display());
            }
        }
    }

    /// Whether the run may hold `id`: false only when it holds no entry of it.
    fn may_hold(&self, id: &Digest) -> bool {
        self.filter().is_none_or(|f| f.may_contain(id))
    }

    /// How many entries of the rows `live` keeps.
    fn live_entries(&self, live: &[bool]) -> u64 {
        self.meta.rows.iter().zip(live).filter(|(_, l)| **l).map(|(r, _)| r.count as u64).sum()
    }
}

/// A run being written: a temporary file, renamed once whole; or a file with no name
/// (a backup's own runs, [`OwnRuns`]), which goes when it is closed.
struct RunOut {
    out: BufWriter<File>,
    /// The temporary name; `None` for a file with no name.
    tmp: Option<PathBuf>,
    objects: Vec<Digest>,
    rows: Vec<Row>,
    block: Vec<u8>,
    in_block: u32,
    fence: Vec<u8>,
    entries: u64,
    /// The filter of the entries pushed (sized for the entries expected).
    filter: Option<Bloom>,
}

fn random_name(prefix: &str) -> String {
    format!("{prefix}{}", format::hex(&crate::crypto::random::<12>()))
}

fn private_file(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl RunOut {
    /// A run of about `expected` entries (what its filter is sized for).
    /// `unlinked`: in a file with no name ([`crate::entries::unlinked`]).
    fn create(dir: &Path, objects: Vec<Digest>, rows: Vec<Row>, expected: u64, unlinked: bool) -> io::Result<RunOut> {
        let (file, tmp) = match unlinked {
            true => (crate::entries::unlinked(dir, "ownrun")?, None),
            false => {
                let tmp = dir.join(random_name("tmp-"));
                (private_file(&tmp)?, Some(tmp))
            }
        };
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&[0u8; HEADER])?;
        for o in &objects {
            out.write_all(o)?;
        }
        for r in &rows {
            out.write_all(&r.pack)?;
            out.write_all(&r.object.to_le_bytes())?;
            out.write_all(&r.count.to_le_bytes())?;
        }
        Ok(RunOut {
            out,
            tmp,
            objects,
            rows,
            block: Vec::new(),
            in_block: 0,
            fence: Vec::new(),
            entries: 0,
            filter: Bloom::new(expected),
        })
    }

    fn push(&mut self, e: &Ent) -> io::Result<()> {
        if self.in_block == 0 {
            self.fence.extend_from_slice(&e.id);
        }
        e.write(&mut self.block);
        if let Some(f) = &mut self.filter {
            f.insert(&e.id);
        }
        self.in_block += 1;
        self.entries += 1;
        if self.in_block == BLOCK {
            self.end_block()?;
        }
        Ok(())
    }

    fn end_block(&mut self) -> io::Result<()> {
        if self.in_block > 0 {
            self.fence.extend_from_slice(&crc32fast::hash(&self.block).to_le_bytes());
            self.out.write_all(&self.block)?;
            self.block.clear();
            self.in_block = 0;
        }
        Ok(())
    }

    /// Writes the fence and the header, makes the file durable and names it `run-…`.
    fn finish(mut self, dir: &Path) -> io::Result<Run> {
        let r = self.finish_inner(dir);
        if r.is_err() {
            self.remove();
        }
        r
    }

    /// Removes the temporary file (one with no name goes when it is closed).
    fn remove(&self) {
        if let Some(tmp) = &self.tmp {
            let _ = std::fs::remove_file(tmp);
        }
    }

    fn finish_inner(&mut self, dir: &Path) -> io::Result<Run> {
        self.end_block()?;
        self.out.write_all(&self.fence)?;
        self.out.flush()?;
        let mut h = [0u8; HEADER];
        h[..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&RUN_VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&BLOCK.to_le_bytes());
        h[16..20].copy_from_slice(&(self.objects.len() as u32).to_le_bytes());
        h[20..24].copy_from_slice(&(self.rows.len() as u32).to_le_bytes());
        h[24..32].copy_from_slice(&self.entries.to_le_bytes());
        let objects: Vec<u8> = self.objects.concat();
        let mut rows = Vec::with_capacity(self.rows.len() * ROW);
        for r in &self.rows {
            rows.extend_from_slice(&r.pack);
            rows.extend_from_slice(&r.object.to_le_bytes());
            rows.extend_from_slice(&r.count.to_le_bytes());
        }
        let crc = tables_crc(&h[..32], &objects, &rows, &self.fence);
        h[32..36].copy_from_slice(&crc.to_le_bytes());
        let file = self.out.get_ref();
        file.write_all_at(&h, 0)?;
        // The filter as sized for the entries expected, if that is how many came (else
        // it is built again for the count, when the run is opened).
        let filter = self.filter.take().filter(|f| f.sized_for(self.entries));
        let Some(tmp) = &self.tmp else {
            // A file with no name, read through this handle, never by another process.
            let file = file.try_clone()?;
            let len = file.metadata()?.len();
            let meta = Meta::parse(&file, len)
                .map_err(|why| io::Error::other(format!("the run just written (no name): {why}")))?;
            let run = Run { file, dir: dir.into(), name: String::new(), meta, filter: OnceLock::new() };
            let f = match filter {
                Some(f) => Some(f),
                None => run.build_filter().map_err(io::Error::other)?,
            };
            let _ = run.filter.set(f);
            return Ok(run);
        };
        file.sync_all()?;
        let name = random_name("run-");
        std::fs::rename(tmp, dir.join(&name))?;
        sync_dir(dir)?;
        let given = filter.is_some();
        let run = Run::open(dir, &name, filter)
            .map_err(|why| io::Error::other(format!("the run just written, {name}: {why}")))?;
        if let Some(f) = run.filter.get().and_then(Option::as_ref).filter(|_| given) {
            run.write_filter(dir, f);
        }
        Ok(run)
    }
}

/// Entries of index objects gathered for one run, each object's packs converted (and
/// freed) as it is added: a large index object is held once, not twice.
#[derive(Default)]
struct Pending {
    /// The objects, in the order added.
    objects: Vec<Digest>,
    /// Rows as (object, pack, entries), in the order met.
    rows: Vec<(u32, Digest, u32)>,
    row_of: HashMap<(u32, Digest), u32>,
    ents: Vec<Ent>,
}

impl Pending {
    fn add(&mut self, name: Digest, packs: Vec<PackBlobs>) {
        if self.objects.contains(&name) {
            return;
        }
        let o = self.objects.len() as u32;
        self.objects.push(name);
        // Exactly what this object adds: doubling would hold up to twice a large object's
        // entries (a backup's 64 MiB object lists about 1.5M).
        self.ents.reserve_exact(packs.iter().map(|p| p.blobs.len()).sum());
        for p in packs {
            let rows = &mut self.rows;
            let row = *self.row_of.entry((o, p.pack)).or_insert_with(|| {
                rows.push((o, p.pack, 0));
                rows.len() as u32 - 1
            });
            self.rows[row as usize].2 += p.blobs.len() as u32;
            for b in p.blobs {
                let page = match b.kind {
                    BlobKind::Data => 0,
                    BlobKind::Page => PAGE_BIT,
                    BlobKind::Located => PAGE_BIT | LOCATED_BIT,
                };
                self.ents.push(Ent {
                    id: b.id,
                    row,
                    offset: b.offset,
                    stored_len: b.stored_len,
                    plain: b.plain_len | page,
                });
            }
        }
    }

    /// Writes the entries, sorted, as one run: its objects sorted by name, its rows by
    /// (object, pack).
    fn write(self, dir: &Path) -> io::Result<Run> {
        self.write_as(dir, false)
    }

    /// [`Pending::write`], in a file with no name where `unlinked`.
    fn write_as(self, dir: &Path, unlinked: bool) -> io::Result<Run> {
        let Pending { objects, rows, mut ents, .. } = self;
        let mut order: Vec<u32> = (0..objects.len() as u32).collect();
        order.sort_by_key(|&o| objects[o as usize]);
        let mut ordinal = vec![0u32; objects.len()];
        for (new, &old) in order.iter().enumerate() {
            ordinal[old as usize] = new as u32;
        }
        let mut by: Vec<u32> = (0..rows.len() as u32).collect();
        by.sort_by_key(|&r| (ordinal[rows[r as usize].0 as usize], rows[r as usize].1));
        let mut row_at = vec![0u32; rows.len()];
        for (new, &old) in by.iter().enumerate() {
            row_at[old as usize] = new as u32;
        }
        for e in ents.iter_mut() {
            e.row = row_at[e.row as usize];
        }
        ents.sort_unstable_by_key(|e| e.key());
        let names: Vec<Digest> = order.iter().map(|&o| objects[o as usize]).collect();
        let table: Vec<Row> = by
            .iter()
            .map(|&r| {
                let (o, pack, count) = rows[r as usize];
                Row { pack, object: ordinal[o as usize], count }
            })
            .collect();
        let mut out = RunOut::create(dir, names, table, ents.len() as u64, unlinked)?;
        for e in &ents {
            out.push(e)?;
        }
        drop(ents);
        out.finish(dir)
    }
}

/// A source run in a merge: its next entry.
struct MergeSource<'a> {
    run: &'a Run,
    /// The new row of each of its rows, `None` where dead.
    map: Vec<Option<u32>>,
    block: usize,
    buf: Vec<u8>,
    at: usize,
}

impl MergeSource<'_> {
    /// The next live entry (its row mapped), or `None` at the end.
    fn next(&mut self) -> Result<Option<Ent>, String> {
        loop {
            if self.at * ENTRY >= self.buf.len() {
                if self.block >= self.run.meta.fence.len() {
                    return Ok(None);
                }
                self.run.meta.read_block(&self.run.file, self.block, &mut self.buf)?;
                self.block += 1;
                self.at = 0;
            }
            let mut e = Ent::read(&self.buf[self.at * ENTRY..(self.at + 1) * ENTRY]);
            self.at += 1;
            if let Some(row) = self.map[e.row as usize] {
                e.row = row;
                return Ok(Some(e));
            }
        }
    }
}

/// Why a merge or build stopped: a run that failed its checks (to discard), or the cache
/// that could not be written.
enum Stop {
    Bad(usize, String),
    Io(io::Error),
}

/// Merges `runs` (their live rows: `live[k]`) into one, in bounded memory.
/// `unlinked`: the new run in a file with no name (a backup's own runs, [`OwnRuns`]).
/// `cancel`: once set, the merge stops between two entries (its file removed).
fn merge(
    dir: &Path,
    runs: &[&Run],
    live: &[Vec<bool>],
    unlinked: bool,
    cancel: Option<&std::sync::atomic::AtomicBool>,
) -> Result<Run, Stop> {
    // The new object table: the live objects of every run, sorted.
    let mut objects: Vec<Digest> = Vec::new();
    for (run, l) in runs.iter().zip(live) {
        for (r, ok) in run.meta.rows.iter().zip(l) {
            if *ok {
                objects.push(run.meta.objects[r.object as usize]);
            }
        }
    }
    objects.sort_unstable();
    objects.dedup();
    let obj_at: HashMap<Digest, u32> = objects.iter().enumerate().map(|(i, o)| (*o, i as u32)).collect();
    let mut rows: Vec<Row> = Vec::new();
    for (run, l) in runs.iter().zip(live) {
        for (r, ok) in run.meta.rows.iter().zip(l) {
            if *ok {
                rows.push(Row { pack: r.pack, object: obj_at[&run.meta.objects[r.object as usize]], count: r.count });
            }
        }
    }
    rows.sort_by_key(|a| (a.object, a.pack));
    let mut merged: Vec<Row> = Vec::with_capacity(rows.len());
    for r in rows {
        match merged.last_mut() {
            Some(m) if (m.object, m.pack) == (r.object, r.pack) => m.count = m.count.saturating_add(r.count),
            _ => merged.push(r),
        }
    }
    let row_at: HashMap<(u32, Digest), u32> =
        merged.iter().enumerate().map(|(i, r)| ((r.object, r.pack), i as u32)).collect();
    let mut sources: Vec<MergeSource> = runs
        .iter()
        .zip(live)
        .map(|(run, l)| MergeSource {
            run,
            map: run
                .meta
                .rows
                .iter()
                .zip(l)
                .map(|(r, ok)| ok.then(|| row_at[&(obj_at[&run.meta.objects[r.object as usize]], r.pack)]))
                .collect(),
            block: 0,
            buf: Vec::new(),
            at: 0,
        })
        .collect();
    let expected = merged.iter().map(|r| r.count as u64).sum();
    let mut out = RunOut::create(dir, objects, merged, expected, unlinked).map_err(Stop::Io)?;
    let mut heap = BinaryHeap::new();
    for (k, s) in sources.iter_mut().enumerate() {
        if let Some(e) = s.next().map_err(|why| Stop::Bad(k, why))? {
            heap.push(std::cmp::Reverse((e.key(), k, HeapEnt(e))));
        }
    }
    let r = (|| {
        while let Some(std::cmp::Reverse((_, k, HeapEnt(e)))) = heap.pop() {
            if cancel.is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed)) {
                return Err(Stop::Io(io::Error::other("the merge was cancelled")));
            }
            out.push(&e).map_err(Stop::Io)?;
            if let Some(n) = sources[k].next().map_err(|why| Stop::Bad(k, why))? {
                heap.push(std::cmp::Reverse((n.key(), k, HeapEnt(n))));
            }
        }
        Ok(())
    })();
    match r {
        Ok(()) => out.finish(dir).map_err(Stop::Io),
        Err(e) => {
            out.remove();
            Err(e)
        }
    }
}

/// An entry in the merge's heap (ordered by the key beside it alone).
struct HeapEnt(Ent);
impl PartialEq for HeapEnt {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for HeapEnt {}
impl PartialOrd for HeapEnt {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for HeapEnt {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

/// Which tail of the runs (oldest first, `sizes` their live entries) to merge into one,
/// if any: the runs after the first that is over 4 times the size of all the runs after
/// it, and always enough that at most [`MAX_RUNS`] remain.
fn merge_plan(sizes: &[u64]) -> Option<usize> {
    let n = sizes.len();
    if n < 2 {
        return None;
    }
    let mut j = n - 1;
    let mut sum = sizes[j];
    while j > 0 && (j + 1 > MAX_RUNS || sizes[j - 1] <= sum.saturating_mul(4)) {
        j -= 1;
        sum += sizes[j];
    }
    (j < n - 1).then_some(j)
}

/// This host's cache directory of one repository.
pub(crate) struct Cache {
    /// `<root>/<config id>/index`, or a private temporary directory's `index`.
    dir: PathBuf,
    /// The private temporary directory, removed when this is dropped.
    private: Option<PathBuf>,
    /// Entries gathered from index objects before they are written as a run.
    build_entries: usize,
}

impl Drop for Cache {
    fn drop(&mut self) {
        if let Some(p) = &self.private {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// The cache root: `FERRY_CACHE_DIR`, else `$XDG_CACHE_HOME/ferry`, else `~/.cache/ferry`.
pub fn cache_root() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = var(CACHE_DIR_ENV) {
        return Some(d);
    }
    if let Some(x) = var("XDG_CACHE_HOME").filter(|p| p.is_absolute()) {
        return Some(x.join("ferry"));
    }
    var("HOME").filter(|p| p.is_absolute()).map(|h| h.join(".cache/ferry"))
}

/// Why `dir` may not hold a cache: not a directory, another user's, or writable by
/// group or others.
fn untrusted(dir: &Path, follow: bool) -> Option<String> {
    let m = if follow { std::fs::metadata(dir) } else { std::fs::symlink_metadata(dir) };
    let m = match m {
        Ok(m) => m,
        Err(e) => return Some(format!("it cannot be read ({e})")),
    };
    if !m.is_dir() {
        return Some("it is not a directory".into());
    }
    if m.uid() != rustix::process::geteuid().as_raw() {
        return Some(format!("it belongs to user {}, not to this one", m.uid()));
    }
    if m.mode() & 0o022 != 0 {
        return Some(format!("other users may write it (mode {:o})", m.mode() & 0o7777));
    }
    None
}

fn make_dir(dir: &Path) -> io::Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        r => r,
    }
}

/// `<root>/<id>/index`, made (0700) and checked; the other repositories' directories
/// unused for [`PRUNE_AFTER`] removed.
fn trusted_dir(root: &Path, id: &str) -> Result<PathBuf, String> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(root)
        .map_err(|e| format!("it cannot be made ({e})"))?;
    if let Some(why) = untrusted(root, true) {
        return Err(why);
    }
    let repo = root.join(id);
    let dir = repo.join("index");
    for d in [&repo, &dir] {
        make_dir(d).map_err(|e| format!("{} cannot be made ({e})", d.display()))?;
        if let Some(why) = untrusted(d, false) {
            return Err(format!("{}: {why}", d.display()));
        }
    }
    // Used now: its time keeps it from being pruned.
    if let Ok(f) = File::open(&repo) {
        let _ = f.set_modified(SystemTime::now());
    }
    prune(root, id);
    Ok(dir)
}

/// Removes the cache directories of other repositories unused for [`PRUNE_AFTER`] (by
/// their time, which each use sets).
fn prune(root: &Path, id: &str) {
    let Ok(list) = std::fs::read_dir(root) else { return };
    let now = SystemTime::now();
    for e in list.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if name == id || format::parse_digest(name).is_none() {
            continue;
        }
        let old = e
            .metadata()
            .ok()
            .filter(|m| m.is_dir())
            .and_then(|m| m.modified().ok())
            .and_then(|t| now.duration_since(t).ok())
            .is_some_and(|age| age > PRUNE_AFTER);
        if old {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

impl Cache {
    /// The cache of the repository whose config id is `id`, in the cache root, or in a
    /// private temporary directory (removed when dropped) where the root cannot be used;
    /// `None` where neither can be made.
    pub(crate) fn for_repo(id: &str) -> Option<Cache> {
        if format::parse_digest(id).is_some() {
            match cache_root() {
                Some(root) => match trusted_dir(&root, id) {
                    Ok(dir) => return Some(Cache::at(dir)),
                    Err(why) => log::warn!(
                        "the index cache directory {} is not used: {why}; this command keeps its index cache in a \
                         private temporary directory instead (give ferry a directory only you can write: \
                         {CACHE_DIR_ENV}=DIR)",
                        root.display()
                    ),
                },
                None => log::debug!("no cache directory ({CACHE_DIR_ENV}, XDG_CACHE_HOME and HOME are unset)"),
            }
        }
        Cache::private()
    }

    /// A cache in a new private temporary directory.
    pub(crate) fn private() -> Option<Cache> {
        let root = std::env::temp_dir().join(random_name(&format!("ferry-index-{}-", std::process::id())));
        let made = std::fs::DirBuilder::new().mode(0o700).create(&root).and_then(|()| make_dir(&root.join("index")));
        match made {
            Ok(()) => Some(Cache { dir: root.join("index"), private: Some(root), build_entries: BUILD_ENTRIES }),
            Err(e) => {
                log::warn!("no index cache can be made ({e}): the index is read into memory");
                let _ = std::fs::remove_dir_all(&root);
                None
            }
        }
    }

    /// Where a backup keeps its chunk list ([`crate::entries`]): this repository's cache
    /// directory, beside its `index`.
    pub(crate) fn spill_dir(&self) -> &Path {
        self.dir.parent().unwrap_or(&self.dir)
    }

    /// A cache in `dir`, as it is (tests).
    #[cfg(test)]
    pub(crate) fn in_dir(dir: PathBuf) -> Cache {
        Cache::at(dir)
    }

    /// A cache in `dir`, as it is (trusted).
    fn at(dir: PathBuf) -> Cache {
        Cache { dir, private: None, build_entries: BUILD_ENTRIES }
    }

    /// Brings the cache up to date with the index objects `listed` (name, stored size)
    /// and returns its runs: runs that fail their checks are discarded, index objects no
    /// run covers are read and written as new runs (those that cannot be read are
    /// skipped with a warning, as the in-memory index skips them), runs are merged.
    /// Holds the cache's lock meanwhile. `Ok(Err(e))`: the cache could not be written.
    /// `index/` is listed once the lock is held (another process may have held it for
    /// long, adding runs of objects stored after a listing taken before); the listing
    /// comes back too. Where another process has held the lock for [`LOCK_WAIT`], the
    /// runs as they are come back, read only (the listed objects they do not cover are
    /// read by the caller), with `true`.
    fn update_listing(&self, repo: &Repository) -> Result<(Listing, io::Result<Vec<Run>>, bool)> {
        let list = || {
            repo.store
                .list("index/")
                .map_err(|e| Error::store(format!("cannot list the index of {}", repo.store.describe()), e))
        };
        let lock = match self.lock_file() {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                log::warn!(
                    "the index cache {} is not brought up to date ({e}): this command uses its runs as they are, and \
                     reads the index objects stored since into memory",
                    self.dir.display()
                );
                let listed = list()?;
                return Ok((listed, Ok(self.read_runs(&key_fingerprint(repo), false)), true));
            }
            Err(e) => return Ok((list()?, Err(e), false)),
        };
        let listed_at = std::time::SystemTime::now();
        let listed = list()?;
        let runs = self.update_locked(repo, &listed, listed_at)?;
        drop(lock);
        Ok((listed, runs, false))
    }

    /// The cache's lock file, locked; waits at most [`LOCK_WAIT`] for another process
    /// that holds it (one stopped or hung must not hold every ferry on the host: past
    /// that, this command uses the runs read only: [`Cache::update_listing`]).
    fn lock_file(&self) -> io::Result<File> {
        let lock = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(self.dir.join("lock"))?;
        let start = std::time::Instant::now();
        let mut told = false;
        loop {
            match lock.try_lock() {
                Ok(()) => return Ok(lock),
                Err(std::fs::TryLockError::Error(e)) => return Err(e),
                Err(std::fs::TryLockError::WouldBlock) => {}
            }
            let waited = start.elapsed();
            if waited >= LOCK_WAIT {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("another process has held its lock for more than {} s", LOCK_WAIT.as_secs()),
                ));
            }
            if !told && waited >= std::time::Duration::from_secs(5) {
                log::info!("waiting for another process to bring the index cache {} up to date", self.dir.display());
                told = true;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// [`Cache::update_listing`] with a listing of `index/` begun at `listed_at` (a run
    /// written after then keeps the rows of objects the listing lacks: they may be newer
    /// than it).
    #[cfg(test)]
    fn update(
        &self,
        repo: &Repository,
        listed: &[(String, u64)],
        listed_at: std::time::SystemTime,
    ) -> Result<io::Result<Vec<Run>>> {
        let lock = match self.lock_file() {
            Ok(f) => f,
            Err(e) => return Ok(Err(e)),
        };
        let runs = self.update_locked(repo, listed, listed_at)?;
        drop(lock);
        Ok(runs)
    }

    /// The update, with the cache's lock held.
    fn update_locked(
        &self,
        repo: &Repository,
        listed: &[(String, u64)],
        listed_at: std::time::SystemTime,
    ) -> Result<io::Result<Vec<Run>>> {
        let key = key_fingerprint(repo);
        let mut runs = self.read_manifest(&key);
        let before: Vec<String> = runs.iter().map(|r| r.name.clone()).collect();
        self.remove_strays(&runs);
        let names: HashMap<Digest, &str> = listed
            .iter()
            .filter_map(|(n, _)| n.strip_prefix("index/").and_then(format::parse_digest).map(|d| (d, n.as_str())))
            .collect();
        for _attempt in 0..4 {
            let covered: HashSet<Digest> = runs.iter().flat_map(|r| r.meta.objects.iter().copied()).collect();
            let new: Vec<&(String, u64)> = listed
                .iter()
                .filter(|(n, _)| {
                    n.strip_prefix("index/").and_then(format::parse_digest).is_none_or(|d| !covered.contains(&d))
                })
                .collect();
            match self.build(repo, &new)? {
                Ok(built) => runs.extend(built),
                Err(e) => return Ok(Err(e)),
            }
            match self.compact(&mut runs, &names, listed_at) {
                Ok(()) => break,
                Err(Stop::Io(e)) => return Ok(Err(e)),
                Err(Stop::Bad(k, why)) => {
                    let r = runs.remove(k);
                    self.discard(&r.name, &why);
                }
            }
        }
        let after: Vec<String> = runs.iter().map(|r| r.name.clone()).collect();
        if after != before {
            if let Err(e) = self.write_manifest(&key, &after) {
                return Ok(Err(e));
            }
            for name in before.iter().filter(|n| !after.contains(n)) {
                remove_run(&self.dir, name);
            }
        }
        Ok(Ok(runs))
    }

    fn discard(&self, name: &str, why: &str) {
        log::warn!(
            "the index cache's run {} is discarded: {why}; it is built again from the repository's index",
            self.dir.join(name).display()
        );
        remove_run(&self.dir, name);
    }

    /// The runs the manifest names, each opened and checked (one that fails is
    /// discarded); none when the manifest is missing, damaged or of another key.
    fn read_manifest(&self, key: &str) -> Vec<Run> {
        self.read_runs(key, true)
    }

    /// The runs the manifest lists; one that fails its checks is discarded where
    /// `discard` (with the lock held), else only left out.
    fn read_runs(&self, key: &str, discard: bool) -> Vec<Run> {
        let text = match std::fs::read(self.dir.join(MANIFEST)) {
            Ok(t) if t.len() <= 1 << 20 => String::from_utf8(t).unwrap_or_default(),
            Ok(_) => String::new(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
            Err(_) => String::new(),
        };
        let names = match listed_runs(&text, key) {
            Listed::Runs(names) => names,
            Listed::OtherKey => {
                log::info!("the index cache {} is of another key or damaged: it is built again", self.dir.display());
                return Vec::new();
            }
            Listed::Damaged => {
                log::warn!("the index cache's list of runs {} is damaged: it is built again", self.dir.display());
                return Vec::new();
            }
        };
        let mut runs = Vec::new();
        for name in names {
            match Run::open(&self.dir, name, None) {
                Ok(r) => runs.push(r),
                Err(why) if discard => self.discard(name, &why),
                Err(why) => log::debug!("the index cache's run {name} is not used: {why}"),
            }
        }
        runs
    }

    fn write_manifest(&self, key: &str, names: &[String]) -> io::Result<()> {
        let mut text = format!("{MANIFEST_HEAD}\nkey {key}\n");
        for n in names {
            text.push_str(&format!("run {n}\n"));
        }
        let tmp = self.dir.join(random_name("tmp-"));
        let r = (|| {
            let mut f = private_file(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, self.dir.join(MANIFEST))?;
            sync_dir(&self.dir)
        })();
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r
    }

    /// Removes run and temporary files that the manifest does not name (left by a
    /// process that stopped midway).
    fn remove_strays(&self, runs: &[Run]) {
        let Ok(list) = std::fs::read_dir(&self.dir) else { return };
        for e in list.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let of_a_run = |r: &Run| r.name == name || filter_name(&r.name) == name;
            let ours = name.starts_with("tmp-") || name.starts_with("run-") || name.starts_with("filter-");
            if ours && !runs.iter().any(of_a_run) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    /// New runs of the index objects `new`, read a group at a time (at most
    /// [`READ_GROUP_BYTES`] stored bytes, side by side) and written every
    /// [`BUILD_ENTRIES`] entries.
    fn build(&self, repo: &Repository, new: &[&(String, u64)]) -> Result<io::Result<Vec<Run>>> {
        let mut runs = Vec::new();
        let mut pending = Pending::default();
        let write = |pending: &mut Pending, runs: &mut Vec<Run>| -> io::Result<()> {
            runs.push(std::mem::take(pending).write(&self.dir)?);
            Ok(())
        };
        let mut i = 0;
        while i < new.len() {
            let mut j = i + 1;
            let mut bytes = new[i].1;
            while j < new.len() && j - i < FETCH_THREADS && bytes + new[j].1 <= READ_GROUP_BYTES {
                bytes += new[j].1;
                j += 1;
            }
            let names: Vec<&str> = new[i..j].iter().map(|(n, _)| n.as_str()).collect();
            for (name, r) in names.iter().zip(par_map(&names, FETCH_THREADS, |n| repo.read_index_object(n))) {
                match r {
                    Ok(packs) => {
                        let Some(d) = name.strip_prefix("index/").and_then(format::parse_digest) else { continue };
                        // Written before it would pass its size: what is gathered stays
                        // within one run's entries, or one object's alone.
                        let n: usize = packs.iter().map(|p| p.blobs.len()).sum();
                        if !pending.objects.is_empty() && pending.ents.len() + n > self.build_entries {
                            if let Err(e) = write(&mut pending, &mut runs) {
                                return Ok(Err(e));
                            }
                        }
                        pending.add(d, packs);
                    }
                    Err(e @ Error::Store { .. }) => return Err(e),
                    Err(e) => {
                        log::warn!("skipping {name}: {e}; `ferry repo repair` rebuilds the index from the packs")
                    }
                }
            }
            i = j;
            if pending.ents.len() >= self.build_entries || (i == new.len() && !pending.objects.is_empty()) {
                if let Err(e) = write(&mut pending, &mut runs) {
                    return Ok(Err(e));
                }
            }
        }
        Ok(Ok(runs))
    }

    /// Merges runs until [`merge_plan`] has none to merge; a run whose entries are more
    /// than a quarter dead (their objects gone from `listed`) is merged with every run written
    /// after it (none where it is the newest), one whose entries are all dead dropped.
    fn compact(
        &self,
        runs: &mut Vec<Run>,
        listed: &HashMap<Digest, &str>,
        listed_at: std::time::SystemTime,
    ) -> Result<(), Stop> {
        // An object the listing lacks is dead only when the listing began after its run
        // was written: a run written since may hold objects stored after the listing. A
        // file's time comes from the kernel's coarse clock, which lags the clock the
        // listing's time was read from by up to a tick: a run written just after the
        // listing began can look older, so it must be older by a margin.
        const TICK_MARGIN: std::time::Duration = std::time::Duration::from_millis(100);
        let listing_newer = |r: &Run| {
            r.file.metadata().and_then(|m| m.modified()).is_ok_and(|written| written + TICK_MARGIN < listed_at)
        };
        let live_of = |r: &Run| -> Vec<bool> {
            let newer = listing_newer(r);
            r.meta.rows.iter().map(|row| !newer || listed.contains_key(&r.meta.objects[row.object as usize])).collect()
        };
        runs.retain(|r| {
            let keep = r.live_entries(&live_of(r)) > 0;
            if !keep {
                remove_run(&self.dir, &r.name);
            }
            keep
        });
        loop {
            let live: Vec<Vec<bool>> = runs.iter().map(live_of).collect();
            let sizes: Vec<u64> = runs.iter().zip(&live).map(|(r, l)| r.live_entries(l)).collect();
            let dead = runs.iter().zip(&sizes).position(|(r, s)| (r.meta.entries - s) * 4 > r.meta.entries);
            let from = match (merge_plan(&sizes), dead) {
                (Some(a), Some(b)) => a.min(b),
                (a, b) => match a.or(b) {
                    Some(f) => f,
                    None => return Ok(()),
                },
            };
            let srcs: Vec<&Run> = runs[from..].iter().collect();
            let merged = merge(&self.dir, &srcs, &live[from..], false, None).map_err(|s| match s {
                Stop::Bad(k, why) => Stop::Bad(from + k, why),
                s => s,
            })?;
            for r in runs.drain(from..) {
                drop(r);
            }
            runs.push(merged);
        }
    }
}

/// How long a process waits for another that brings the cache up to date (reading a
/// large index object takes minutes on a slow store) before it does without the cache.
#[cfg(not(test))]
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(600);
#[cfg(test)]
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A listing of `index/`: names and stored sizes.
type Listing = Vec<(String, u64)>;
/// The name of an index object (`index/ID`).
type IndexObjectName = String;

/// What a list of runs (the `runs` file) says.
#[derive(Debug, PartialEq, Eq)]
enum Listed<'a> {
    /// The runs it names, in order.
    Runs(Vec<&'a str>),
    /// It is not a list, or of another key.
    OtherKey,
    /// A line after its head is not `run NAME`.
    Damaged,
}

/// The list of runs `text`, checked, for the key `key` (pure).
fn listed_runs<'a>(text: &'a str, key: &str) -> Listed<'a> {
    let mut lines = text.lines();
    if lines.next() != Some(MANIFEST_HEAD) || lines.next() != Some(&format!("key {key}")) {
        return Listed::OtherKey;
    }
    lines
        .map(|line| line.strip_prefix("run ").filter(|n| valid_run_name(n)))
        .collect::<Option<Vec<_>>>()
        .map_or(Listed::Damaged, Listed::Runs)
}

fn valid_run_name(n: &str) -> bool {
    n.strip_prefix("run-").is_some_and(|h| h.len() == 24 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// What identifies the repository's key in its cache: ids are keyed, so a cache made
/// under another key (the same config id, given another key) is not used.
fn key_fingerprint(repo: &Repository) -> String {
    let probe = crate::repo::sha256(b"ferry index cache");
    format::hex(&crate::repo::sha256(&repo.crypto.blob_id(&probe)))
}

/// A backup's own blobs, moved out of its memory once an index object lists them (the
/// writer's list of the packs it stored): runs of this cache's format, each in a file with
/// no name in the cache directory (the system's temporary directory where there is none),
/// which goes when the last handle is closed, however the process ends. Each run keeps its
/// filter (1.5 bytes an entry) and its fence (about 0.3 bytes an entry) in memory, and they
/// are merged as the cache's are ([`OwnMerge`], beside the backup), so that about
/// [`MAX_RUNS`] are read by a lookup. A value is a snapshot: [`OwnRuns::with`] and
/// [`OwnRuns::with_merged`] make the next one, and the runs they replace stay readable
/// through any copy still held.
#[derive(Clone, Default)]
pub(crate) struct OwnRuns {
    runs: Vec<Arc<Run>>,
    /// Batches moved in so far (each is one object of its run).
    batches: u32,
}

impl OwnRuns {
    /// These runs and the blobs of `packs` (one batch) as a new run in `dir` (about 48
    /// bytes an entry).
    #[cfg(test)]
    pub(crate) fn with(&self, dir: &Path, packs: Vec<PackBlobs>) -> io::Result<OwnRuns> {
        Ok(self.and(self.write_batch(dir, packs)?))
    }

    /// The blobs of `packs` (the next batch after these runs') as a run in `dir`, not
    /// yet among them ([`OwnRuns::and`] adds it).
    pub(crate) fn write_batch(&self, dir: &Path, packs: Vec<PackBlobs>) -> io::Result<OwnBatch> {
        let mut name = [0u8; 32];
        name[..4].copy_from_slice(&self.batches.to_le_bytes());
        let mut pending = Pending::default();
        pending.add(name, packs);
        Ok(OwnBatch(Arc::new(pending.write_as(dir, true)?)))
    }

    /// These runs and the run `b` after them.
    pub(crate) fn and(&self, b: OwnBatch) -> OwnRuns {
        let mut runs = self.runs.clone();
        runs.push(b.0);
        OwnRuns { runs, batches: self.batches + 1 }
    }

    /// The runs that the merge plan says are merged into one now, if any.
    pub(crate) fn merge_due(&self) -> Option<OwnMerge> {
        let sizes: Vec<u64> = self.runs.iter().map(|r| r.meta.entries).collect();
        merge_plan(&sizes).map(|from| OwnMerge { runs: self.runs[from..].to_vec(), merged: None })
    }

    /// These runs with those of `m` (merged) replaced by its run, where they are still
    /// here (runs added since stay after it).
    pub(crate) fn with_merged(&self, m: &OwnMerge) -> Option<OwnRuns> {
        let merged = m.merged.clone()?;
        let n = m.runs.len();
        let at = (0..=self.runs.len().checked_sub(n)?)
            .find(|&k| self.runs[k..k + n].iter().zip(&m.runs).all(|(a, b)| Arc::ptr_eq(a, b)))?;
        let mut runs = self.runs[..at].to_vec();
        runs.push(merged);
        runs.extend_from_slice(&self.runs[at + n..]);
        Some(OwnRuns { runs, batches: self.batches })
    }

    /// The entries in the runs.
    pub(crate) fn entries(&self) -> u64 {
        self.runs.iter().map(|r| r.meta.entries).sum()
    }

    /// Whether a run may hold `id`: false (most new chunks) is known from the filters in
    /// memory, without reading a file.
    pub(crate) fn may_hold(&self, id: &Digest) -> bool {
        self.runs.iter().any(|r| r.may_hold(id))
    }

    /// The first place of `id`: in the oldest run that holds it, its first entry.
    pub(crate) fn find(&self, id: &Digest) -> io::Result<Option<Location>> {
        let mut caches: Vec<BlockCache> = self.runs.iter().map(|_| BlockCache::default()).collect();
        self.find_cached(id, &mut caches)
    }

    /// [`OwnRuns::find`] of each of `ids`, which are sorted: each run's last block read
    /// is kept from one id to the next.
    pub(crate) fn find_each(&self, ids: &[Digest]) -> io::Result<Vec<Option<Location>>> {
        let mut caches: Vec<BlockCache> = self.runs.iter().map(|_| BlockCache::default()).collect();
        ids.iter().map(|id| self.find_cached(id, &mut caches)).collect()
    }

    fn find_cached(&self, id: &Digest, caches: &mut [BlockCache]) -> io::Result<Option<Location>> {
        for (run, cache) in self.runs.iter().zip(caches) {
            if !run.may_hold(id) {
                continue;
            }
            let mut found = None;
            run.meta
                .lookup(&run.file, id, cache, |e| {
                    found = found.or(Some(e.location(&run.meta.rows)));
                })
                .map_err(|why| io::Error::other(format!("a run of this backup's own blobs: {why}")))?;
            if found.is_some() {
                return Ok(found);
            }
        }
        Ok(None)
    }

    /// How many runs a lookup reads (tests).
    #[cfg(test)]
    pub(crate) fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Calls `f` with each entry (its id and place) in a pack that `packs` holds, the
    /// runs read a block at a time.
    pub(crate) fn each_in(
        &self,
        packs: &HashSet<&Digest>,
        mut f: impl FnMut(&Digest, Location) -> crate::Result<()>,
    ) -> crate::Result<()> {
        let mut buf = Vec::new();
        for run in &self.runs {
            if !run.meta.rows.iter().any(|r| packs.contains(&r.pack)) {
                continue;
            }
            for b in 0..run.meta.fence.len() {
                let block = run
                    .meta
                    .read_block(&run.file, b, &mut buf)
                    .map_err(|why| Error::Invalid(format!("a run of this backup's own blobs cannot be read: {why}")))?;
                for e in block.chunks_exact(ENTRY).map(Ent::read) {
                    let loc = e.location(&run.meta.rows);
                    if packs.contains(&loc.pack) {
                        f(&e.id, loc)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// A run written by [`OwnRuns::write_batch`].
pub(crate) struct OwnBatch(Arc<Run>);

/// Runs of a backup's own ([`OwnRuns::merge_due`]) to merge into one: the new run is
/// written (about 48 bytes an entry, before the old ones go) while the backup goes on.
pub(crate) struct OwnMerge {
    runs: Vec<Arc<Run>>,
    merged: Option<Arc<Run>>,
}

impl OwnMerge {
    /// Writes the merged run in `dir` (a file with no name); it stops, failing, once
    /// `cancel` is set.
    pub(crate) fn run(&mut self, dir: &Path, cancel: &std::sync::atomic::AtomicBool) -> io::Result<()> {
        let srcs: Vec<&Run> = self.runs.iter().map(|r| &**r).collect();
        let live: Vec<Vec<bool>> = srcs.iter().map(|r| vec![true; r.meta.rows.len()]).collect();
        let merged = merge(dir, &srcs, &live, true, Some(cancel)).map_err(|s| match s {
            Stop::Io(e) => e,
            Stop::Bad(k, why) => io::Error::other(format!("run {k} of this backup's own: {why}")),
        })?;
        self.merged = Some(Arc::new(merged));
        Ok(())
    }
}

/// A part of a [`RunIndex`]: a run file, or the index read into memory (where the cache
/// cannot be used, or a run failed its checks after it was opened).
struct Part {
    run: Option<Run>,
    /// Per row of the run: whether its object is still in the store.
    live: Vec<bool>,
    /// The run's objects read from the store, once the run failed a check.
    fallback: OnceLock<Index>,
}

/// The repository's index through the local cache, for readers and backups: every
/// location of a blob, copies recorded damaged last (or, for a backup, left out), and,
/// where `present` is set, only copies in packs present in the store.
#[derive(Clone)]
pub struct RunIndex {
    repo: Arc<Repository>,
    parts: Vec<Arc<Part>>,
    /// Per part, per row: live, and in a present pack where that is asked.
    usable: Vec<Arc<Vec<bool>>>,
    damage: Arc<DamageSet>,
    present: Option<Arc<HashSet<Digest>>>,
    skip_damaged: bool,
    /// Keeps the cache directory while its runs are used.
    _cache: Option<Arc<Cache>>,
}

impl RunIndex {
    /// The index of `repo` through its cache, brought up to date: what
    /// `load_index_lenient` gives, without holding it in memory.
    pub fn open(repo: &Arc<Repository>) -> Result<RunIndex> {
        let damage = Arc::new(repo.damage()?);
        let cache = repo.index_cache();
        let (listed, runs, read_only) = match &cache {
            Some(c) => c.update_listing(repo)?,
            None => (Vec::new(), Ok(Vec::new()), false),
        };
        let runs = match &cache {
            Some(c) => match runs {
                Ok(runs) => Some(runs),
                Err(e) => {
                    log::warn!(
                        "the index cache {} cannot be written ({e}): this command reads the index into memory",
                        c.dir.display()
                    );
                    None
                }
            },
            None => None,
        };
        let parts: Vec<Arc<Part>> = match runs {
            Some(runs) => {
                let names: HashSet<Digest> = listed
                    .iter()
                    .filter_map(|(n, _)| n.strip_prefix("index/").and_then(format::parse_digest))
                    .collect();
                // Read only (another process holds the cache's lock): the listed objects
                // that no run covers are read into memory, and only those.
                let uncovered: Vec<IndexObjectName> = match read_only {
                    true => {
                        let covered: HashSet<&Digest> = runs.iter().flat_map(|r| r.meta.objects.iter()).collect();
                        listed
                            .iter()
                            .filter(|(n, _)| {
                                n.strip_prefix("index/")
                                    .and_then(format::parse_digest)
                                    .is_none_or(|d| !covered.contains(&d))
                            })
                            .map(|(n, _)| n.clone())
                            .collect()
                    }
                    false => Vec::new(),
                };
                let mut parts: Vec<Arc<Part>> = runs
                    .into_iter()
                    .map(|run| {
                        let live = run
                            .meta
                            .rows
                            .iter()
                            .map(|r| names.contains(&run.meta.objects[r.object as usize]))
                            .collect();
                        Arc::new(Part { run: Some(run), live, fallback: OnceLock::new() })
                    })
                    .collect();
                if !uncovered.is_empty() {
                    let mut objects = Vec::new();
                    for name in uncovered {
                        match repo.read_index_object(&name) {
                            Ok(p) => objects.push((name, p)),
                            Err(e @ Error::Store { .. }) => return Err(e),
                            Err(e) => {
                                log::warn!(
                                    "skipping {name}: {e}; `ferry repo repair` rebuilds the index from the packs"
                                )
                            }
                        }
                    }
                    let ix = crate::repo::build_index(objects);
                    parts.push(Arc::new(Part { run: None, live: Vec::new(), fallback: OnceLock::from(ix) }));
                }
                parts
            }
            None => {
                let ix = repo.load_index_lenient()?;
                vec![Arc::new(Part { run: None, live: Vec::new(), fallback: OnceLock::from(ix) })]
            }
        };
        let mut ix = RunIndex {
            repo: repo.clone(),
            usable: Vec::new(),
            parts,
            damage,
            present: None,
            skip_damaged: false,
            _cache: cache,
        };
        ix.set_usable();
        Ok(ix)
    }

    fn set_usable(&mut self) {
        let present = self.present.clone();
        self.usable = self
            .parts
            .iter()
            .map(|p| {
                let rows = p.run.as_ref().map_or(&[][..], |r| &r.meta.rows[..]);
                Arc::new(
                    rows.iter()
                        .zip(&p.live)
                        .map(|(r, l)| *l && present.as_ref().is_none_or(|s| s.contains(&r.pack)))
                        .collect(),
                )
            })
            .collect();
    }

    /// The same, with only the copies in `present` packs.
    pub(crate) fn only_present(mut self, present: HashSet<Digest>) -> RunIndex {
        self.present = Some(Arc::new(present));
        self.set_usable();
        self
    }

    /// The same, without the copies recorded damaged (a backup's view: what has no good
    /// copy is stored again).
    pub(crate) fn without_damaged(&self) -> RunIndex {
        RunIndex { skip_damaged: true, ..self.clone() }
    }

    pub(crate) fn damage(&self) -> &DamageSet {
        &self.damage
    }

    /// The packs the live index objects list that are not present (for a warning).
    pub(crate) fn packs_gone(&self) -> usize {
        let Some(present) = &self.present else { return 0 };
        let mut gone = HashSet::new();
        for p in &self.parts {
            if let Some(run) = &p.run {
                for (r, l) in run.meta.rows.iter().zip(&p.live) {
                    if *l && !present.contains(&r.pack) {
                        gone.insert(r.pack);
                    }
                }
            }
            if let Some(ix) = p.fallback.get() {
                for loc in ix.blobs.values().chain(ix.more.values().flatten()) {
                    if !present.contains(&loc.pack) {
                        gone.insert(loc.pack);
                    }
                }
            }
        }
        gone.len()
    }

    /// How many runs a lookup reads (tests, stats).
    pub fn runs(&self) -> usize {
        self.parts.iter().filter(|p| p.run.is_some()).count()
    }

    /// The in-memory index of a run that failed a check after it was opened: its live
    /// objects read from the store (the run file is removed, so the next command builds
    /// it again).
    fn fallback<'a>(&self, part: &'a Part, why: &str) -> &'a Index {
        part.fallback.get_or_init(|| {
            let Some(run) = &part.run else { return Index::default() };
            if let Some(c) = &self._cache {
                c.discard(&run.name, why);
            }
            let mut objects = Vec::new();
            for (o, d) in run.meta.objects.iter().enumerate() {
                let live = run.meta.rows.iter().zip(&part.live).any(|(r, l)| *l && r.object as usize == o);
                if !live {
                    continue;
                }
                let name = format!("index/{}", format::hex(d));
                match self.repo.read_index_object(&name) {
                    Ok(p) => objects.push((name, p)),
                    Err(e) => log::warn!("skipping {name}: {e}; `ferry repo repair` rebuilds the index from the packs"),
                }
            }
            crate::repo::build_index(objects)
        })
    }

    fn usable_loc(&self, loc: &Location) -> bool {
        self.present.as_ref().is_none_or(|s| s.contains(&loc.pack))
    }

    /// [`BlobLookup::locations`] of each of `ids`, which are sorted: each run's last
    /// block read is kept from one id to the next, so neighbouring ids read a block once
    /// (a single lookup reads its block afresh).
    pub(crate) fn locations_each(&self, ids: &[Digest]) -> Vec<Vec<Location>> {
        let mut caches: Vec<BlockCache> = self.parts.iter().map(|_| BlockCache::default()).collect();
        ids.iter()
            .map(|id| {
                let mut out = Vec::new();
                self.gather(id, &mut out, Some(&mut caches));
                out.into_iter().map(|(_, l)| l).collect()
            })
            .collect()
    }

    /// Every location of `id` with the object that lists it, in index order. `caches`:
    /// one per part, kept between lookups of sorted ids; else this thread's buffer.
    fn gather(&self, id: &Digest, out: &mut Vec<(Digest, Location)>, mut caches: Option<&mut [BlockCache]>) {
        for (k, part) in self.parts.iter().enumerate() {
            let from_memory = |ix: &Index, out: &mut Vec<(Digest, Location)>| {
                out.extend(Index::locations(ix, id).filter(|l| self.usable_loc(l)).map(|l| ([0xff; 32], *l)));
            };
            if let Some(ix) = part.fallback.get() {
                from_memory(ix, out);
                continue;
            }
            // Only a backup's view asks the filter: other lookups are of present ids.
            let Some(run) = part.run.as_ref().filter(|r| !self.skip_damaged || r.may_hold(id)) else { continue };
            let usable = &self.usable[k];
            let before = out.len();
            let mut push = |e: &Ent| {
                if usable[e.row as usize] {
                    let object = run.meta.objects[run.meta.rows[e.row as usize].object as usize];
                    out.push((object, e.location(&run.meta.rows)));
                }
            };
            let r = match caches.as_deref_mut() {
                Some(c) => run.meta.lookup(&run.file, id, &mut c[k], &mut push),
                None => BLOCK_BUF.with(|cache| {
                    let mut cache = cache.borrow_mut();
                    // The buffer is this thread's; the block in it is not kept between lookups.
                    cache.at = None;
                    run.meta.lookup(&run.file, id, &mut cache, &mut push)
                }),
            };
            if let Err(why) = r {
                out.truncate(before);
                from_memory(self.fallback(part, &why), out);
            }
        }
        if out.len() > 1 {
            out.sort_by_key(|a| (a.0, a.1.pack, a.1.offset));
            let mut seen = HashSet::new();
            out.retain(|(_, l)| seen.insert((l.pack, l.offset)));
        }
        if !self.damage.is_empty() {
            if self.skip_damaged {
                out.retain(|(_, l)| !self.damage.is_damaged(&l.pack, id));
            } else {
                out.sort_by_key(|(_, l)| self.damage.is_damaged(&l.pack, id));
            }
        }
    }
}

impl BlobLookup for RunIndex {
    fn locations(&self, id: &Digest) -> Vec<Location> {
        let mut out = Vec::new();
        self.gather(id, &mut out, None);
        out.into_iter().map(|(_, l)| l).collect()
    }

    fn contains_each(&self, ids: &[Digest]) -> Vec<bool> {
        let mut found = vec![false; ids.len()];
        let counts = |l: &Location, id: &Digest| {
            self.usable_loc(l) && !(self.skip_damaged && self.damage.is_damaged(&l.pack, id))
        };
        for (k, part) in self.parts.iter().enumerate() {
            let mut ix = part.fallback.get();
            if ix.is_none() {
                let Some(run) = &part.run else { continue };
                let usable = &self.usable[k];
                let mut cache = BlockCache::default();
                let mut failed = None;
                for (i, id) in ids.iter().enumerate() {
                    if found[i] || !run.may_hold(id) {
                        continue;
                    }
                    let mut hit = false;
                    let r = run.meta.lookup(&run.file, id, &mut cache, |e| {
                        hit |= usable[e.row as usize] && counts(&e.location(&run.meta.rows), id);
                    });
                    if let Err(why) = r {
                        failed = Some(why);
                        break;
                    }
                    found[i] = hit;
                }
                match failed {
                    None => continue,
                    Some(why) => ix = Some(self.fallback(part, &why)),
                }
            }
            if let Some(ix) = ix {
                for (i, id) in ids.iter().enumerate() {
                    found[i] = found[i] || Index::locations(ix, id).any(|l| counts(l, id));
                }
            }
        }
        found
    }
}

#[cfg(test)]
mod tests;
