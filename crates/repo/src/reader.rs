//! A snapshot as a read-only image: chunks fetched from packs, decoded, checked against
//! their digests, and cached; zero chunks never read. Its extents come from the index.
//!
//! A read fetches the chunks it needs that lie next to each other in one pack with one
//! ranged read, then decodes them on the calling thread: reads from many threads run side
//! by side, with no lock held around I/O or decoding. A chunk the read wants whole (a
//! restore's reads) is decoded straight into the reader's buffer and its digest checked
//! there, before the read returns: no copy of it is made, and a chunk that fails its
//! check fails the read. The requests of one NBD connection run side by side too:
//! [`Backend::io_queue`] hands them to a pool of threads ([`pool_threads`]: one per core,
//! at least 4, for a store on this machine, at least 8 for an object store's latency), answered in
//! order; a small one whose chunks are all cached (or zero) is answered at once, on the
//! connection's thread. A connection queues the reads of one receive and then wakes the
//! pool; a thread that finds more queued than the threads not busy would take one each
//! takes up to 4 small reads (each of part of one chunk, from a store on this machine) and
//! checks their chunks together, their SHA-256s side by side ([`ferry_hash::sha256_group`]:
//! a served miss's check alone was a third of its CPU); fewer queued reads, and larger
//! ones, still run one a thread, side by side. Chunks read in part (small random
//! reads, as a VM booting from `ferry serve` makes) are kept, checked, in a cache shared
//! by every thread, sized by the memory this process may use ([`default_cache_bytes`]);
//! chunks read whole (a restore) are not, except by a served snapshot while its cache is
//! at most half full ([`SnapshotImage::keep_whole_reads`]). A chunk that fails its check is never cached.
//! Once the cache is full, a miss decodes into the buffer of the chunk its shard last
//! evicted: the decoded chunk takes no new buffer, so no fresh pages for the kernel to
//! zero. A miss still allocates the buffer the store reads the stored bytes into (their
//! length: at most a chunk and a blob's header), in an encrypted repository the buffer
//! they are decrypted into, and lists of a few words per chunk it wants (measured in
//! docs/benchmarks-history.md §35: reading the stored bytes into a reused buffer changed
//! neither the page faults nor the CPU of a miss).
use crate::format::{self, BlobKind, Digest, ZERO};
use crate::repo::{blkhash_of, pack_name, ChunkHints, Location, Repository, SnapshotInfo};
use crate::runs::{BlobLookup, RunIndex};
use crate::Result;
use ferry_backend::{push_extent, Backend, Capabilities, Extent, IoQueue, DATA, HOLE};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock, Weak};

/// Cache shards (each with its own lock), and the fewest chunks each keeps.
const SHARDS: usize = 16;
const PER_SHARD_MIN: usize = 16;
/// The fewest bytes of chunks the cache of one snapshot keeps, whatever the budget: a
/// reader of small sequential reads needs its current chunks (256 chunks of 64 KiB).
pub const MIN_CACHE_BYTES: u64 = 16 << 20;
/// Bytes of decoded chunks in the caches of every snapshot this process has open: what
/// [`SnapshotImage::cache_budget`] bounds.
static CACHED: AtomicU64 = AtomicU64::new(0);
/// Stored bytes between two blobs of one pack that a read still fetches in one request
/// rather than two.
const GAP: u64 = 64 << 10;
/// Reads shorter than this that continue an earlier one bring this many bytes of the
/// following chunks into the cache.
const AHEAD_BELOW: u64 = 256 << 10;
const AHEAD_BYTES: u64 = 1 << 20;
/// A read of a connection's queue at most this long whose chunks are all cached (or
/// zero) is answered on the connection's thread, not the pool's.
const KNOWN_INLINE: u64 = 256 << 10;

/// The most the default cache budget takes: decoded chunks are the process's own memory,
/// which the kernel cannot reclaim as it does the page cache.
pub const MAX_DEFAULT_CACHE_BYTES: u64 = 1 << 30;

/// The default cache budget: a sixteenth of the memory this process may use (the
/// machine's, or its control group's limit), at least [`MIN_CACHE_BYTES`] and at most
/// 1 GiB.
pub fn default_cache_bytes() -> u64 {
    crate::memory::limit().map_or(MIN_CACHE_BYTES, |m| (m / 16).min(MAX_DEFAULT_CACHE_BYTES)).max(MIN_CACHE_BYTES)
}

/// The largest cache budget a process may ask for: half the memory it may use (decoded
/// chunks are its own memory, which the kernel cannot take back under pressure as it does
/// the page cache); no bound where that memory is not known.
pub fn max_cache_bytes() -> u64 {
    crate::memory::limit().map_or(u64::MAX, |m| (m / 2).max(MIN_CACHE_BYTES))
}

/// The ends of the last reads, to see sequential readers among several clients. Atomics,
/// not a lock: every small read notes itself here, from any thread.
#[derive(Default)]
struct Recent {
    ends: [AtomicU64; 8],
    next: AtomicUsize,
}

pub struct SnapshotImage {
    /// This image, for the threads of [`Backend::io_queue`].
    me: Weak<SnapshotImage>,
    pool: OnceLock<Option<Pool>>,
    /// The threads of `pool` ([`SnapshotImage::read_threads`]).
    threads: usize,
    repo: Arc<Repository>,
    snap: SnapshotInfo,
    /// Reloaded when a pack it names is gone (a gc moved the blobs while we read). A
    /// located snapshot (FORMAT.md §7c) opens it only when a hint fails.
    index: RwLock<Option<Arc<RunIndex>>>,
    /// Where the chunks are hinted to be (a located snapshot); tried before the index.
    hints: ChunkHints,
    reload: Mutex<()>,
    /// Packs found missing: a chunk with another copy is read from that one. `any_gone`
    /// keeps the common read (no pack missing) from taking this lock.
    gone: RwLock<HashSet<Digest>>,
    any_gone: AtomicBool,
    recent: Recent,
    entries: Vec<Digest>,
    cs: u64,
    size: u64,
    cache: Vec<Mutex<Shard>>,
    /// The bytes of every snapshot's caches in this process may reach this (each keeps
    /// at least [`MIN_CACHE_BYTES`]).
    cache_budget: u64,
    /// The bytes cached by every image sharing the budget: the process's ([`CACHED`]);
    /// a test's own, so that no test depends on what others cache.
    shared: &'static AtomicU64,
    /// Bytes in this image's cache.
    cached: AtomicU64,
    /// Chunks read whole are kept too while the cache is at most half full ([`SnapshotImage::keep_whole_reads`]).
    keep_whole: AtomicBool,
    /// The most chunks one batch of reads checked together ([`SnapshotImage::read_batch`]).
    #[cfg(test)]
    largest_batch: AtomicUsize,
}

/// A least-recently-used set of chunks.
#[derive(Default)]
struct Shard {
    tick: u64,
    chunks: HashMap<u64, (Arc<Vec<u8>>, u64)>,
    /// Chunk by the tick of its last use: the least recently used first.
    by_use: BTreeMap<u64, u64>,
    /// The buffer of the last chunk evicted (unless a reader still held it), for the
    /// next miss in this shard to decode into: a full cache's miss then decodes its chunk
    /// into no new buffer, and faults in no fresh pages for it (the allocator gives freed
    /// chunks back to the kernel, and faulting 64 KiB in again cost a seventh of a miss's
    /// CPU); it still allocates what the module doc says. At most one chunk per shard,
    /// outside the budget.
    spare: Option<Vec<u8>>,
}

impl Shard {
    fn get(&mut self, ci: u64) -> Option<Arc<Vec<u8>>> {
        self.tick += 1;
        let t = self.tick;
        let (c, used) = self.chunks.get_mut(&ci)?;
        self.by_use.remove(used);
        *used = t;
        self.by_use.insert(t, ci);
        Some(c.clone())
    }
    /// Removes the least recently used chunk, its buffer kept as the spare; its length,
    /// and the spare it displaced, for the caller to free once the shard is unlocked (a
    /// free may hand memory back to the kernel, a system call the hits of this shard
    /// would otherwise wait on).
    fn evict(&mut self) -> Option<(u64, Option<Vec<u8>>)> {
        let (_, ci) = self.by_use.pop_first()?;
        let (c, _) = self.chunks.remove(&ci)?;
        let len = c.len() as u64;
        let displaced = Arc::try_unwrap(c).ok().and_then(|v| self.spare.replace(v));
        Some((len, displaced))
    }
}

impl SnapshotImage {
    /// Loads the index and the snapshot's pages; the cache budget is
    /// [`default_cache_bytes`].
    pub fn open(repo: Arc<Repository>, snap: &SnapshotInfo) -> Result<Arc<SnapshotImage>> {
        SnapshotImage::open_with_cache(repo, snap, default_cache_bytes())
    }

    /// As [`SnapshotImage::open`], with chunks read in part cached up to `cache_bytes`
    /// for all the snapshots this process has open together (each keeps at least
    /// [`MIN_CACHE_BYTES`]).
    pub fn open_with_cache(repo: Arc<Repository>, snap: &SnapshotInfo, cache_bytes: u64) -> Result<Arc<SnapshotImage>> {
        SnapshotImage::open_sharing(repo, snap, cache_bytes, &CACHED)
    }

    /// As [`SnapshotImage::open_with_cache`], the budget shared with the images opened
    /// with the same `shared` count only.
    pub(crate) fn open_sharing(
        repo: Arc<Repository>,
        snap: &SnapshotInfo,
        cache_bytes: u64,
        shared: &'static AtomicU64,
    ) -> Result<Arc<SnapshotImage>> {
        let threads = match read_threads_from(std::env::var(READ_THREADS_ENV).ok().as_deref())? {
            Some(n) => n,
            None => pool_threads(repo.store.local()),
        };
        let (index, entries, hints) = if snap.manifest.version == format::LOCATED_VERSION {
            let lazy = LazyIndex::new(&repo);
            let got = repo.entries_hinted(&lazy, snap, true);
            let (index, failed) = lazy.into_parts();
            match (got, failed) {
                (Ok((entries, hints)), _) => (index, entries, hints),
                (Err(_), Some(e)) => return Err(e),
                (Err(e), None) => return Err(e),
            }
        } else {
            let index = RunIndex::open(&repo)?;
            let entries = repo.entries(&index, snap)?;
            (Some(Arc::new(index)), entries, ChunkHints::default())
        };
        Ok(Arc::new_cyclic(|me| SnapshotImage {
            me: me.clone(),
            pool: OnceLock::new(),
            threads,
            cache_budget: cache_bytes,
            shared,
            cached: AtomicU64::new(0),
            cs: repo.config.chunk_size as u64,
            size: snap.manifest.size,
            repo,
            snap: snap.clone(),
            index: RwLock::new(index),
            hints,
            reload: Mutex::new(()),
            gone: RwLock::new(HashSet::new()),
            any_gone: AtomicBool::new(false),
            recent: Recent::default(),
            keep_whole: AtomicBool::new(false),
            #[cfg(test)]
            largest_batch: AtomicUsize::new(0),
            entries,
            cache: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
        }))
    }

    /// The cache budget this image was opened with.
    pub fn cache_budget(&self) -> u64 {
        self.cache_budget
    }

    /// The blkhash (SHA-256, 64 KiB blocks) of the snapshot, from its entries alone;
    /// `None` when the repository's chunks are not 64 KiB.
    pub fn blkhash(&self) -> Option<Digest> {
        (self.cs == 65536).then(|| blkhash_of(&self.entries, self.size, self.cs as u32))
    }

    pub fn info(&self) -> &SnapshotInfo {
        &self.snap
    }

    /// The chunk digests (zero entries for zero chunks).
    pub fn entries(&self) -> &[Digest] {
        &self.entries
    }

    /// The repository's chunk size: entry `i` is the digest of bytes `i * chunk_size..`.
    pub fn chunk_size(&self) -> u64 {
        self.cs
    }

    fn chunk_len(&self, ci: u64) -> usize {
        (self.size - ci * self.cs).min(self.cs) as usize
    }

    /// The threads its connections' reads run on: `FERRY_REPO_READ_THREADS` where it is
    /// set, else one a core (at least 4) for a store on this machine
    /// ([`crate::store::Store::local`]), at least 8 for any other.
    pub fn read_threads(&self) -> usize {
        self.threads
    }

    /// Bytes in this image's cache.
    pub fn cached_bytes(&self) -> u64 {
        self.cached.load(Ordering::Relaxed)
    }

    /// Where the cached copy of chunk `ci` lies in memory, if it is cached: for tests of
    /// the reuse of evicted chunks' buffers.
    #[cfg(test)]
    pub(crate) fn cached_at(&self, ci: u64) -> Option<usize> {
        let s = self.cache[ci as usize % SHARDS].lock().unwrap_or_else(|e| e.into_inner());
        s.chunks.get(&ci).map(|(c, _)| c.as_ptr() as usize)
    }

    /// The most chunks a batch of queued reads has checked together, for tests.
    #[cfg(test)]
    pub(crate) fn largest_batch(&self) -> usize {
        self.largest_batch.load(Ordering::Relaxed)
    }

    /// Where the spare buffer of chunk `ci`'s shard lies in memory, if it has one: for
    /// tests of the reuse of evicted chunks' buffers.
    #[cfg(test)]
    pub(crate) fn spare_at(&self, ci: u64) -> Option<usize> {
        let s = self.cache[ci as usize % SHARDS].lock().unwrap_or_else(|e| e.into_inner());
        s.spare.as_ref().map(|v| v.as_ptr() as usize)
    }

    fn is_cached(&self, ci: u64) -> bool {
        self.cache[ci as usize % SHARDS].lock().unwrap_or_else(|e| e.into_inner()).chunks.contains_key(&ci)
    }

    /// Reads chunks ahead of a sequential reader into the cache; failures are left for
    /// the read that needs the chunk to report.
    fn fetch_ahead(&self, pack: &str, start: u64, end: u64, wants: &mut [Want]) -> io::Result<()> {
        let bytes = self.repo.store.get_range(pack, start, end - start)?;
        let plains = self.decode_run(&bytes, start, wants, None);
        for (w, plain) in wants.iter().zip(plains) {
            if let Ok(Some(plain)) = plain {
                self.remember(w.ci, Arc::new(plain));
            }
        }
        Ok(())
    }

    /// The chunks of one ranged read (`bytes`, from pack offset `start`) decoded, and
    /// checked against their ids: their digests computed side by side. With `into` (the
    /// buffer of a read at `offset`), a chunk the read wants whole is decoded straight into
    /// its place there (`Ok(None)`: no copy of it is made); the others (a part of a
    /// chunk, a chunk read ahead) come back as their own bytes. A chunk whose check
    /// fails is an error, whatever its bytes in the buffer are: the read fails.
    fn decode_run(
        &self,
        bytes: &[u8],
        start: u64,
        wants: &mut [Want],
        mut into: Option<(&mut [u8], u64)>,
    ) -> Vec<Result<Option<Vec<u8>>, String>> {
        let mut scratch = Vec::new();
        // Where in the read's buffer chunk `w` goes, when it goes there whole.
        let whole = |w: &Want, buf_len: usize, offset: u64| -> Option<(usize, usize)> {
            let (bs, be, at) = self.span(w.ci, offset, offset + buf_len as u64);
            (!w.ahead && at == 0 && be - bs == self.chunk_len(w.ci)).then_some((bs, be))
        };
        // Where each chunk decoded in place lies, worked out once: the check below reads
        // exactly these ranges, and a chunk that fails has its range zeroed, so the buffer
        // never holds bytes that were not checked, even after an error.
        let spans: Vec<Option<(usize, usize)>> =
            wants.iter().map(|w| into.as_ref().and_then(|(buf, offset)| whole(w, buf.len(), *offset))).collect();
        let mut out: Vec<Result<Option<Vec<u8>>, String>> = wants
            .iter_mut()
            .zip(&spans)
            .map(|(w, span)| {
                let s = (w.loc.offset as u64 - start) as usize;
                let stored = bytes.get(s..s + w.loc.stored_len as usize).unwrap_or(&[]);
                if stored.len() != w.loc.stored_len as usize {
                    return Err(format!("blob {} at offset {} is cut short", format::hex(&w.id), w.loc.offset));
                }
                if let Some((buf, _)) = into.as_mut() {
                    if let Some((bs, be)) = *span {
                        let crypto = &self.repo.crypto;
                        return crate::blob::decode_unchecked_into(
                            crypto,
                            BlobKind::Data,
                            &w.id,
                            stored,
                            &mut buf[bs..be],
                            &mut scratch,
                        )
                        .map(|()| None)
                        .map_err(|e| format!("blob {} at offset {}: {e}", format::hex(&w.id), w.loc.offset));
                    }
                }
                self.decode_plain(w, stored, &mut scratch).map(Some)
            })
            .collect();
        let view = into.as_ref().map(|(b, o)| (&**b, *o));
        let decoded: Vec<(usize, &[u8])> = out
            .iter()
            .enumerate()
            .filter_map(|(k, r)| match r {
                Ok(Some(p)) => Some((k, p.as_slice())),
                // Every chunk decoded in place has its span (it was decoded there): the
                // empty slice of an impossible miss fails the digest check, never skips it.
                Ok(None) => {
                    let buf = view.map(|(b, _)| b).unwrap_or(&[]);
                    Some((k, spans[k].and_then(|(bs, be)| buf.get(bs..be)).unwrap_or(&[])))
                }
                Err(_) => None,
            })
            .collect();
        let blocks: Vec<&[u8]> = decoded.iter().map(|(_, b)| *b).collect();
        let mut digests = vec![0u8; blocks.len() * 32];
        ferry_hash::Algorithm::Sha256.digest_many(&blocks, &mut digests);
        let bad: Vec<usize> = decoded
            .iter()
            .zip(digests.chunks_exact(32))
            .filter(|((k, _), d)| {
                let d: Digest = (*d).try_into().unwrap_or([0; 32]);
                self.repo.crypto.blob_id(&d) != wants[*k].id
            })
            .map(|((k, _), _)| *k)
            .collect();
        drop(blocks);
        drop(decoded);
        for k in bad {
            out[k] = Err(format!(
                "blob {} at offset {}: its plain bytes do not match its id (their digest differs)",
                format::hex(&wants[k].id),
                wants[k].loc.offset
            ));
        }
        if let Some((buf, _)) = into.as_mut() {
            for (r, span) in out.iter().zip(&spans) {
                if let (Err(_), Some((bs, be))) = (r, span) {
                    buf[*bs..*be].fill(0);
                }
            }
        }
        out
    }

    /// Chunk `w` decoded from its `stored` bytes into a buffer of its own, not yet checked
    /// against its id.
    fn decode_plain(&self, w: &mut Want, stored: &[u8], scratch: &mut Vec<u8>) -> Result<Vec<u8>, String> {
        let want = self.chunk_len(w.ci);
        if w.loc.plain_len as usize != want {
            return Err(format!("chunk {} has {} bytes, not {want}", format::hex(&w.id), w.loc.plain_len));
        }
        // Into an evicted chunk's buffer where there is one (its length is a chunk's:
        // resizing it writes nothing), else a new one.
        let mut plain = w.spare.take().unwrap_or_default();
        plain.resize(want, 0);
        crate::blob::decode_unchecked_into(&self.repo.crypto, BlobKind::Data, &w.id, stored, &mut plain, scratch)
            .map_err(|e| format!("blob {} at offset {}: {e}", format::hex(&w.id), w.loc.offset))?;
        Ok(plain)
    }

    /// The reads of one batch of a pool's thread (reads of this image queued by its
    /// connections), each result in its read's place. A read of part of one chunk that
    /// misses the cache (a small random read) is fetched and decoded here, and the chunks of
    /// the batch are then checked together: SHA-256 kernels hash several messages of equal
    /// length side by side ([`ferry_hash::sha256_group`]; SHA-NI: 4 chunks in the time of 2),
    /// where one miss's check alone was a third of a served miss's CPU. Any other read, and
    /// one whose fetch, decoding or check fails here, takes [`Backend::read`]'s own path,
    /// which reads it again from any copy and says what is wrong.
    fn read_batch(&self, reads: &mut [(Vec<u8>, u64)]) -> Vec<ferry_backend::Result<()>> {
        /// A chunk fetched and decoded for read `k`, whose part from byte `at` it wants.
        struct Fetched {
            k: usize,
            ci: u64,
            id: Digest,
            at: usize,
            plain: Vec<u8>,
        }
        let index = self.index.read().unwrap_or_else(|e| e.into_inner()).clone();
        let mut results: Vec<Option<ferry_backend::Result<()>>> = reads.iter().map(|_| None).collect();
        let mut fetched: Vec<Fetched> = Vec::new();
        let mut scratch = Vec::new();
        for (k, (buf, offset)) in reads.iter_mut().enumerate() {
            let (offset, length) = (*offset, buf.len() as u64);
            let Some(end) = offset.checked_add(length).filter(|&e| e <= self.size && length > 0) else {
                results[k] = Some(self.read(buf, offset));
                continue;
            };
            let ahead = self.ahead_for(offset, end);
            let ci = offset / self.cs;
            if ahead > 0 || (end - 1) / self.cs != ci || length as usize == self.chunk_len(ci) {
                results[k] = Some(self.read_after(buf, offset, ahead));
                continue;
            }
            let at = (offset - ci * self.cs) as usize;
            let spare = match self.fill_or_spare(ci, buf, at, true) {
                Ok(()) => {
                    results[k] = Some(Ok(()));
                    continue;
                }
                Err(spare) => spare,
            };
            match self.fetch_plain(index.as_deref(), ci, spare, &mut scratch) {
                Ok(Some((id, plain))) => fetched.push(Fetched { k, ci, id, at, plain }),
                Ok(None) => results[k] = Some(self.read_after(buf, offset, 0)),
                // The store failed (not damage): said as [`Backend::read`] says it, not
                // asked again.
                Err(why) => results[k] = Some(Err(self.unreadable(offset, length, ci, why))),
            }
        }
        #[cfg(test)]
        self.largest_batch.fetch_max(fetched.len(), Ordering::Relaxed);
        let blocks: Vec<&[u8]> = fetched.iter().map(|f| f.plain.as_slice()).collect();
        let mut digests = vec![0u8; blocks.len() * 32];
        ferry_hash::Algorithm::Sha256.digest_many(&blocks, &mut digests);
        drop(blocks);
        for (f, d) in fetched.into_iter().zip(digests.chunks_exact(32)) {
            let (buf, offset) = &mut reads[f.k];
            let d: Digest = d.try_into().unwrap_or([0; 32]);
            if self.repo.crypto.blob_id(&d) != f.id {
                results[f.k] = Some(self.read_after(buf, *offset, 0));
                continue;
            }
            let len = buf.len();
            buf.copy_from_slice(&f.plain[f.at..f.at + len]);
            self.remember(f.ci, Arc::new(f.plain));
            results[f.k] = Some(Ok(()));
        }
        reads
            .iter()
            .zip(results)
            .map(|((buf, offset), r)| {
                r.unwrap_or_else(|| {
                    let why = io::Error::other("a read of a batch was left unanswered (a defect: see the log)");
                    Err(ferry_backend::Error::io("read", *offset, buf.len() as u64, why))
                })
            })
            .collect()
    }

    /// Chunk `ci` (blob id and bytes, decoded into `spare` where given, not yet checked)
    /// from where [`SnapshotImage::pick`] says it is; `None` when it is not found there, its
    /// pack is missing or cut short, or it does not decode: damage, which
    /// [`Backend::read`]'s path then looks for elsewhere and reports; an error (what failed)
    /// when the store fails otherwise, as [`SnapshotImage::read_with`] tells them apart.
    fn fetch_plain(
        &self,
        index: Option<&RunIndex>,
        ci: u64,
        spare: Option<Vec<u8>>,
        scratch: &mut Vec<u8>,
    ) -> Result<Option<(Digest, Vec<u8>)>, String> {
        let id = self.repo.crypto.blob_id(&self.entries[ci as usize]);
        let Some(loc) = self.pick(index, ci, &id) else { return Ok(None) };
        let pack = pack_name(&loc.pack);
        let stored = match self.repo.store.get_range(&pack, loc.offset as u64, loc.stored_len as u64) {
            Ok(b) if b.len() == loc.stored_len as usize => b,
            Ok(_) => return Ok(None),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData
                ) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(format!("cannot read {pack}: {e}")),
        };
        let mut w = Want { ci, id, loc, ahead: false, spare };
        Ok(self.decode_plain(&mut w, &stored, scratch).ok().map(|plain| (id, plain)))
    }

    /// [`Backend::read`] of a checked range once its read-ahead is known.
    fn read_after(&self, buf: &mut [u8], offset: u64, ahead: u64) -> ferry_backend::Result<()> {
        let length = buf.len() as u64;
        let index = self.index.read().unwrap_or_else(|e| e.into_inner()).clone();
        match self.read_with(index.as_deref(), buf, offset, ahead) {
            Ok(()) => Ok(()),
            Err(Failure::Unreadable(e)) => Err(e),
            // A copy missing or damaged (or a hint wrong): each chunk from any of its copies.
            Err(_) => match self.open_index() {
                Err(e) => Err(ferry_backend::Error::io("read", offset, length, io::Error::other(e.to_string()))),
                Ok(index) => match self.read_each(&index, buf, offset) {
                    Err(Failure::PackGone(_)) => {
                        // A gc repacked what this snapshot uses: its blobs are in new packs.
                        let fresh = self.reload_index(&index).map_err(|e| {
                            ferry_backend::Error::io("read", offset, length, io::Error::other(e.to_string()))
                        })?;
                        self.read_each(&fresh, buf, offset).map_err(Failure::into_error)
                    }
                    r => r.map_err(Failure::into_error),
                },
            },
        }
    }

    /// How many chunks to read ahead for a read at `offset..end`: some when it continues
    /// one of the last reads and is small (a large reader keeps enough in flight itself).
    fn ahead_for(&self, offset: u64, end: u64) -> u64 {
        if end - offset >= AHEAD_BELOW {
            return 0;
        }
        let r = &self.recent;
        let sequential = offset != 0 && r.ends.iter().any(|e| e.load(Ordering::Relaxed) == offset);
        let at = r.next.fetch_add(1, Ordering::Relaxed) % r.ends.len();
        r.ends[at].store(end, Ordering::Relaxed);
        if sequential {
            (AHEAD_BYTES / self.cs).max(1)
        } else {
            0
        }
    }

    /// The most chunks one shard holds: its share of the budget (at least
    /// [`PER_SHARD_MIN`]), so the shards together hold at most the budget.
    fn shard_cap(&self) -> usize {
        ((self.cache_budget.max(MIN_CACHE_BYTES) / self.cs.max(1)) as usize / SHARDS).max(PER_SHARD_MIN)
    }

    /// Keeps a chunk in the cache: beyond the budget (all snapshots' caches together),
    /// this shard's least recently used chunk makes room, unless this image keeps no
    /// more than its minimum.
    fn remember(&self, ci: u64, chunk: Arc<Vec<u8>>) {
        let len = chunk.len() as u64;
        let mut s = self.cache[ci as usize % SHARDS].lock().unwrap_or_else(|e| e.into_inner());
        if s.get(ci).is_some() {
            return;
        }
        let over = |mine: u64| {
            mine > MIN_CACHE_BYTES && self.shared.load(Ordering::Relaxed).saturating_add(len) > self.cache_budget
        };
        let cap = self.shard_cap();
        let mut displaced = Vec::new();
        while s.chunks.len() >= cap || (!s.chunks.is_empty() && over(self.cached.load(Ordering::Relaxed))) {
            let Some((freed, spare)) = s.evict() else { break };
            self.cached.fetch_sub(freed, Ordering::Relaxed);
            self.shared.fetch_sub(freed, Ordering::Relaxed);
            displaced.extend(spare);
        }
        self.shared.fetch_add(len, Ordering::Relaxed);
        self.insert(&mut s, ci, chunk);
        drop(s);
        drop(displaced);
    }

    /// Puts a chunk into shard `s` (locked), the most recently used, and counts it in
    /// this image's bytes (the caller has counted it in the shared ones).
    fn insert(&self, s: &mut Shard, ci: u64, chunk: Arc<Vec<u8>>) {
        let len = chunk.len() as u64;
        s.tick += 1;
        let t = s.tick;
        s.chunks.insert(ci, (chunk, t));
        s.by_use.insert(t, ci);
        self.cached.fetch_add(len, Ordering::Relaxed);
    }

    /// Keeps a copy of chunk `ci`, read whole and checked (`plain`), while the caches
    /// sharing the budget fill at most half of it, without evicting anything
    /// ([`SnapshotImage::keep_whole_reads`]): one snapshot read through in large reads
    /// never takes the room other snapshots' small reads need. The room is reserved
    /// before the copy is made (given back if refused), and the copy is made before the
    /// shard is locked: cached reads waiting on the lock do not wait for it.
    fn keep_if_room(&self, ci: u64, plain: &[u8]) {
        let len = plain.len() as u64;
        let before = self.shared.fetch_add(len, Ordering::Relaxed);
        if before.saturating_add(len) > self.cache_budget / 2 {
            self.shared.fetch_sub(len, Ordering::Relaxed);
            return;
        }
        let chunk = Arc::new(plain.to_vec());
        let mut s = self.cache[ci as usize % SHARDS].lock().unwrap_or_else(|e| e.into_inner());
        if s.chunks.len() >= self.shard_cap() || s.chunks.contains_key(&ci) {
            drop(s);
            self.shared.fetch_sub(len, Ordering::Relaxed);
            return;
        }
        self.insert(&mut s, ci, chunk);
    }

    /// Chunks read whole are kept in the cache too, but only while it is at most half
    /// full: a reader of large parts of the disk (a VM booting from `ferry serve`, a first
    /// copy through it) fills half an idle cache with checked chunks that later small
    /// reads then find, and never pushes out the chunks small reads use, its own or
    /// another snapshot's. For a served snapshot; a restore,
    /// which reads each chunk once, leaves it off (its memory stays small).
    pub fn keep_whole_reads(&self) {
        self.keep_whole.store(true, Ordering::Relaxed);
    }

    /// The index again, unless another thread has just reloaded it.
    fn reload_index(&self, used: &Arc<RunIndex>) -> Result<Arc<RunIndex>> {
        let _one = self.reload.lock().unwrap_or_else(|e| e.into_inner());
        let cur = self.index.read().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(cur) = cur.filter(|c| !Arc::ptr_eq(c, used)) {
            return Ok(cur);
        }
        let fresh = Arc::new(RunIndex::open(&self.repo)?);
        *self.index.write().unwrap_or_else(|e| e.into_inner()) = Some(fresh.clone());
        Ok(fresh)
    }

    /// The index, opened now if no read needed it before (a located snapshot whose hint
    /// failed: FORMAT.md §7c).
    fn open_index(&self) -> Result<Arc<RunIndex>> {
        if let Some(i) = self.index.read().unwrap_or_else(|e| e.into_inner()).clone() {
            return Ok(i);
        }
        let _one = self.reload.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = self.index.read().unwrap_or_else(|e| e.into_inner()).clone() {
            return Ok(i);
        }
        log::info!("a hint of snapshot {} failed: its chunks are looked up in the index from now on", self.shown_id());
        let fresh = Arc::new(RunIndex::open(&self.repo)?);
        *self.index.write().unwrap_or_else(|e| e.into_inner()) = Some(fresh.clone());
        Ok(fresh)
    }

    /// Chunk `ci`'s hinted place as a location, unless it has none or its pack was found
    /// missing.
    fn hinted(&self, ci: u64) -> Option<Location> {
        let at = self.hints.get(ci as usize)?;
        if self.any_gone.load(Ordering::Relaxed)
            && self.gone.read().unwrap_or_else(|e| e.into_inner()).contains(&at.pack)
        {
            return None;
        }
        Some(Location {
            pack: at.pack,
            kind: BlobKind::Data,
            offset: at.offset,
            stored_len: at.stored_len,
            plain_len: self.chunk_len(ci) as u32,
        })
    }

    /// An I/O error for a range whose data could not be had from the store (a network or
    /// storage failure, not damage).
    fn unreadable(&self, offset: u64, length: u64, ci: u64, why: String) -> ferry_backend::Error {
        let text = format!("cannot read bytes {} of snapshot {}: {why}", self.chunk_range(ci), self.shown_id());
        ferry_backend::Error::io("read", offset, length, io::Error::other(text))
    }

    /// Chunk `ci`'s bytes in the disk, as `START..END`.
    fn chunk_range(&self, ci: u64) -> String {
        let start = ci * self.cs;
        format!("{start}..{}", start + self.chunk_len(ci) as u64)
    }

    /// `NAME@ID8`.
    fn shown_id(&self) -> String {
        format!("{}@{}", self.snap.manifest.name, &self.snap.id[..8.min(self.snap.id.len())])
    }

    /// An I/O error naming the snapshot's range and what failed.
    fn damage(&self, offset: u64, length: u64, ci: u64, why: String) -> ferry_backend::Error {
        ferry_backend::Error::io(
            "read",
            offset,
            length,
            // Carried as a repository error: the binary's exit status says "damage found".
            io::Error::other(crate::Error::damaged(
                format!(
                    "bytes {} of snapshot {} of {}",
                    self.chunk_range(ci),
                    self.shown_id(),
                    self.repo.store.describe()
                ),
                why,
            )),
        )
    }

    /// The part of a read of `offset..end` that chunk `ci` fills (its start and end in the
    /// read's buffer), and where in the chunk that part starts.
    fn span(&self, ci: u64, offset: u64, end: u64) -> (usize, usize, usize) {
        let cstart = ci * self.cs;
        let s = offset.max(cstart);
        let e = end.min(cstart + self.chunk_len(ci) as u64);
        ((s - offset) as usize, (e - offset) as usize, (s - cstart) as usize)
    }

    /// Fills `part` (chunk `ci` from its byte `at`) if it needs no read: a zero chunk, or
    /// one in the cache.
    fn fill_known(&self, ci: u64, part: &mut [u8], at: usize) -> bool {
        self.fill_or_spare(ci, part, at, false).is_ok()
    }

    /// [`SnapshotImage::fill_known`]; when the chunk must be read and `spare`, the buffer
    /// an evicted chunk left in its shard, taken under the lock the lookup holds anyway.
    fn fill_or_spare(&self, ci: u64, part: &mut [u8], at: usize, spare: bool) -> Result<(), Option<Vec<u8>>> {
        if self.entries[ci as usize] == ZERO {
            part.fill(0);
            return Ok(());
        }
        let mut s = self.cache[ci as usize % SHARDS].lock().unwrap_or_else(|e| e.into_inner());
        match s.get(ci) {
            Some(c) => {
                drop(s);
                part.copy_from_slice(&c[at..at + part.len()]);
                Ok(())
            }
            None if spare => Err(s.spare.take()),
            None => Err(None),
        }
    }

    /// Fills `buf` with the bytes at `offset` when that needs no read of the store (each
    /// chunk it covers zero or cached), noting the read as [`Backend::read`] does; false
    /// (`buf` then holds no meaningful bytes) when a chunk is not at hand.
    fn read_known(&self, buf: &mut [u8], offset: u64) -> bool {
        let length = buf.len() as u64;
        let Some(end) = offset.checked_add(length).filter(|&e| e <= self.size && length > 0) else {
            return false;
        };
        for ci in offset / self.cs..=(end - 1) / self.cs {
            let (bs, be, at) = self.span(ci, offset, end);
            if !self.fill_known(ci, &mut buf[bs..be], at) {
                return false;
            }
        }
        // A sequential reader's next miss still sees it as one (read ahead).
        self.ahead_for(offset, end);
        true
    }

    /// The location to read chunk `ci` (blob `id`) from: its hint, else its first copy
    /// in the index, unless that pack was found missing and another copy is not.
    fn pick(&self, index: Option<&RunIndex>, ci: u64, id: &Digest) -> Option<Location> {
        if let Some(l) = self.hinted(ci) {
            return Some(l);
        }
        let index = index?;
        let first = index.first(id)?;
        if !self.any_gone.load(Ordering::Relaxed) {
            return Some(first);
        }
        let gone = self.gone.read().unwrap_or_else(|e| e.into_inner());
        if !gone.contains(&first.pack) {
            return Some(first);
        }
        Some(index.locations(id).into_iter().find(|l| !gone.contains(&l.pack)).unwrap_or(first))
    }

    fn mark_gone(&self, pack: &Digest) {
        self.gone.write().unwrap_or_else(|e| e.into_inner()).insert(*pack);
        self.any_gone.store(true, Ordering::Relaxed);
    }

    /// Chunk `ci` (blob `id`) from the first of its copies that reads and checks well.
    /// A chunk none of whose copies is in the store is `PackGone` (a gc may have moved it).
    fn read_chunk_any(
        &self,
        index: &RunIndex,
        ci: u64,
        id: Digest,
        offset: u64,
        length: u64,
    ) -> Result<Vec<u8>, Failure> {
        let mut whys: Vec<String> = Vec::new();
        let (mut all_gone, mut store_error) = (true, None);
        // The hint first (FORMAT.md §7c); the index's copies after it.
        let hinted = self.hinted(ci);
        let copies = index.locations(&id).into_iter().filter(|l| Some(*l) != hinted);
        for loc in hinted.into_iter().chain(copies) {
            let pack = pack_name(&loc.pack);
            match self.repo.store.get_range(&pack, loc.offset as u64, loc.stored_len as u64) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    self.mark_gone(&loc.pack);
                    whys.push(format!("{pack} is missing"));
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData) => {
                    all_gone = false;
                    whys.push(format!("cannot read {pack}: {e}"));
                }
                Err(e) => {
                    all_gone = false;
                    store_error = Some(format!("cannot read {pack}: {e}"));
                }
                Ok(bytes) => {
                    let mut want = Want { ci, id, loc, ahead: false, spare: None };
                    match self.decode_run(&bytes, loc.offset as u64, std::slice::from_mut(&mut want), None).pop() {
                        Some(Ok(Some(plain))) => return Ok(plain),
                        Some(Ok(None)) => all_gone = false,
                        Some(Err(why)) => {
                            all_gone = false;
                            whys.push(format!("{pack}: {why}"));
                        }
                        None => all_gone = false,
                    }
                }
            }
        }
        if let Some(why) = store_error {
            return Err(Failure::Unreadable(self.unreadable(offset, length, ci, why)));
        }
        if whys.is_empty() {
            let why = format!("its chunk {} is in no index object", format::hex(&id));
            return Err(Failure::PackGone(self.damage(offset, length, ci, why)));
        }
        let e = self.damage(offset, length, ci, whys.join("; "));
        Err(if all_gone { Failure::PackGone(e) } else { Failure::Damaged(e) })
    }

    /// The read that [`SnapshotImage::read_with`] could not make whole: chunk by chunk,
    /// each from any of its copies. Slower, but only run when a copy failed.
    fn read_each(&self, index: &RunIndex, buf: &mut [u8], offset: u64) -> Result<(), Failure> {
        let length = buf.len() as u64;
        let end = offset + length;
        for ci in offset / self.cs..=(end - 1) / self.cs {
            let (bs, be, at) = self.span(ci, offset, end);
            if self.fill_known(ci, &mut buf[bs..be], at) {
                continue;
            }
            let id = self.repo.crypto.blob_id(&self.entries[ci as usize]);
            let plain = self.read_chunk_any(index, ci, id, offset, length)?;
            buf[bs..be].copy_from_slice(&plain[at..at + (be - bs)]);
            if be - bs != plain.len() {
                self.remember(ci, Arc::new(plain));
            }
        }
        Ok(())
    }

    fn read_with(&self, index: Option<&RunIndex>, buf: &mut [u8], offset: u64, ahead: u64) -> Result<(), Failure> {
        let length = buf.len() as u64;
        let end = offset + length;
        let first = offset / self.cs;
        let last = (end - 1) / self.cs;
        let span = |ci: u64| self.span(ci, offset, end);
        let mut wants: Vec<Want> = Vec::new();
        for ci in first..=last {
            let (bs, be, at) = span(ci);
            // A chunk read in part is decoded into a buffer of its own (then cached): an
            // evicted chunk's, where its shard has one.
            let spare = match self.fill_or_spare(ci, &mut buf[bs..be], at, be - bs != self.chunk_len(ci)) {
                Ok(()) => continue,
                Err(spare) => spare,
            };
            let id = self.repo.crypto.blob_id(&self.entries[ci as usize]);
            let Some(loc) = self.pick(index, ci, &id) else {
                return Err(Failure::PackGone(self.damage(
                    offset,
                    length,
                    ci,
                    format!("its chunk {} is in no index object", format::hex(&id)),
                )));
            };
            wants.push(Want { ci, id, loc, ahead: false, spare });
        }
        // A sequential reader that missed the cache: the chunks after this read come with
        // it, into the cache (one request instead of one per chunk on an object store).
        if !wants.is_empty() && ahead > 0 {
            let stop = (last + 1 + ahead).min(self.entries.len() as u64);
            for ci in last + 1..stop {
                let d = &self.entries[ci as usize];
                if *d == ZERO || self.is_cached(ci) {
                    continue;
                }
                let id = self.repo.crypto.blob_id(d);
                if let Some(loc) = self.pick(index, ci, &id) {
                    wants.push(Want { ci, id, loc, ahead: true, spare: None });
                }
            }
        }
        // Runs of blobs next to each other in one pack: one ranged read each.
        wants.sort_unstable_by_key(|w| (w.loc.pack, w.loc.offset));
        let mut i = 0;
        while i < wants.len() {
            let mut j = i + 1;
            let mut run_end = wants[i].loc.offset as u64 + wants[i].loc.stored_len as u64;
            while j < wants.len()
                && wants[j].loc.pack == wants[i].loc.pack
                && (wants[j].loc.offset as u64) <= run_end + GAP
            {
                run_end = run_end.max(wants[j].loc.offset as u64 + wants[j].loc.stored_len as u64);
                j += 1;
            }
            let run_start = wants[i].loc.offset as u64;
            let pack = pack_name(&wants[i].loc.pack);
            if wants[i..j].iter().all(|w| w.ahead) {
                // Only chunks ahead: fetched when they are read, if they are not here.
                let _ = self.fetch_ahead(&pack, run_start, run_end, &mut wants[i..j]);
                i = j;
                continue;
            }
            let bytes = self.repo.store.get_range(&pack, run_start, run_end - run_start).map_err(|e| {
                let ci = wants[i].ci;
                match e.kind() {
                    io::ErrorKind::NotFound => {
                        self.mark_gone(&wants[i].loc.pack);
                        Failure::PackGone(self.damage(offset, length, ci, format!("{pack} is missing")))
                    }
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData => {
                        Failure::Damaged(self.damage(offset, length, ci, format!("cannot read {pack}: {e}")))
                    }
                    _ => Failure::Unreadable(self.unreadable(offset, length, ci, format!("cannot read {pack}: {e}"))),
                }
            })?;
            let plains = self.decode_run(&bytes, run_start, &mut wants[i..j], Some((&mut *buf, offset)));
            for (w, plain) in wants[i..j].iter().zip(plains) {
                let plain = match plain {
                    // Decoded and checked in its place in `buf`.
                    Ok(None) => {
                        if self.keep_whole.load(Ordering::Relaxed) {
                            let (bs, be, _) = span(w.ci);
                            self.keep_if_room(w.ci, &buf[bs..be]);
                        }
                        continue;
                    }
                    Ok(Some(p)) => p,
                    Err(_) if w.ahead => continue,
                    Err(why) => {
                        return Err(Failure::Damaged(self.damage(offset, length, w.ci, format!("{pack}: {why}"))))
                    }
                };
                if w.ahead {
                    self.remember(w.ci, Arc::new(plain));
                    continue;
                }
                let (bs, be, at) = span(w.ci);
                buf[bs..be].copy_from_slice(&plain[at..at + (be - bs)]);
                if be - bs != plain.len() {
                    self.remember(w.ci, Arc::new(plain));
                }
            }
            i = j;
        }
        Ok(())
    }
}

impl Drop for SnapshotImage {
    fn drop(&mut self) {
        self.shared.fetch_sub(self.cached.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// The index opened on its first lookup: a located snapshot's pages are read where
/// their hints say, and the index only where one fails (FORMAT.md §7c).
struct LazyIndex<'a> {
    repo: &'a Arc<Repository>,
    index: OnceLock<Option<Arc<RunIndex>>>,
    failed: Mutex<Option<crate::Error>>,
}

impl<'a> LazyIndex<'a> {
    fn new(repo: &'a Arc<Repository>) -> LazyIndex<'a> {
        LazyIndex { repo, index: OnceLock::new(), failed: Mutex::new(None) }
    }
    fn get(&self) -> Option<&RunIndex> {
        self.index
            .get_or_init(|| match RunIndex::open(self.repo) {
                Ok(i) => Some(Arc::new(i)),
                Err(e) => {
                    *self.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    None
                }
            })
            .as_deref()
    }
    /// The index if it was opened, and why it could not be.
    fn into_parts(self) -> (Option<Arc<RunIndex>>, Option<crate::Error>) {
        let failed = self.failed.into_inner().unwrap_or_else(|e| e.into_inner());
        (self.index.into_inner().flatten(), failed)
    }
}

impl BlobLookup for LazyIndex<'_> {
    fn locations(&self, id: &Digest) -> Vec<Location> {
        self.get().map_or_else(Vec::new, |i| i.locations(id))
    }
    fn first(&self, id: &Digest) -> Option<Location> {
        self.get()?.first(id)
    }
    fn contains(&self, id: &Digest) -> bool {
        self.get().is_some_and(|i| i.contains(id))
    }
}

/// The blkhash (SHA-256, 64 KiB blocks) of a snapshot, from its pages alone, read and
/// checked a window at a time (as [`SnapshotImage::blkhash`] gives it, without holding
/// its entries: a 1 TiB snapshot's are 512 MiB); `None` when the repository's chunks are
/// not 64 KiB. What it holds grows with the snapshot's page list only (one digest per
/// page of its entries). The index is opened only where a page's hint fails (or for a
/// snapshot that is not located).
pub fn snapshot_blkhash(repo: &Arc<Repository>, snap: &SnapshotInfo) -> Result<Option<Digest>> {
    let m = &snap.manifest;
    if repo.config.chunk_size != 65536 || m.chunk_size != 65536 {
        return Ok(None);
    }
    crate::repo::entry_list_fits(m.chunks(), &crate::repo::snap_object(snap), crate::memory::limit())?;
    let lazy = LazyIndex::new(repo);
    let mut h = crate::repo::BlkHasher::new(m.chunks(), m.size, m.chunk_size);
    let got = repo.each_page_entries(&lazy, snap, |_, page| {
        h.feed(page);
        Ok(())
    });
    match (got, lazy.into_parts().1) {
        (Ok(_), _) => Ok(Some(h.finish())),
        (Err(_), Some(e)) => Err(e),
        (Err(e), None) => Err(e),
    }
}

/// A read handed to the pool: where it reads, into what, and where its result goes.
struct QueuedRead {
    image: Arc<SnapshotImage>,
    buf: Vec<u8>,
    offset: u64,
    slot: Arc<Slot>,
    /// Of part of one chunk: what [`SnapshotImage::read_batch`] reads and checks with
    /// others. Only such reads are taken together, so none waits behind a large one.
    small: bool,
}

/// What a pool's thread runs.
enum Job {
    /// A read of a connection's queue. A thread takes several at once where more are
    /// queued than the idle threads would take one each ([`Jobs::take`]), and reads them
    /// as one batch ([`SnapshotImage::read_batch`]).
    Read(QueuedRead),
    /// Anything else (the pool's own tests).
    #[cfg(test)]
    Run(Box<dyn FnOnce() + Send>),
}

impl Job {
    fn small(&self) -> bool {
        match self {
            Job::Read(r) => r.small,
            #[cfg(test)]
            Job::Run(_) => false,
        }
    }
}

/// Runs `jobs`, taken together: the reads of one image as one batch. A batch that
/// panics fails its own reads alone: their slots are still finished (their connections
/// wait for them in order), and the thread goes on.
fn run_jobs(jobs: Vec<Job>) {
    let mut reads = Vec::with_capacity(jobs.len());
    #[cfg(test)]
    let mut others = Vec::new();
    for job in jobs {
        match job {
            Job::Read(r) => reads.push(r),
            #[cfg(test)]
            Job::Run(f) => others.push(f),
        }
    }
    while let Some(first) = reads.first() {
        let image = first.image.clone();
        let same = reads.iter().position(|r| !Arc::ptr_eq(&r.image, &image)).unwrap_or(reads.len());
        let rest = reads.split_off(same);
        let mut io = Vec::with_capacity(reads.len());
        let mut slots = Vec::with_capacity(reads.len());
        for r in reads {
            io.push((r.buf, r.offset));
            slots.push(r.slot);
        }
        // One read alone takes the path of any other read (an object store's reads, a
        // connection with one in flight): exactly as before batches.
        let batch = || {
            if io.len() == 1 {
                let (buf, offset) = &mut io[0];
                vec![image.read(buf, *offset)]
            } else {
                image.read_batch(&mut io)
            }
        };
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(batch)) {
            Ok(results) => {
                for (((buf, _), slot), r) in io.into_iter().zip(slots).zip(results) {
                    slot.finish(buf, r);
                }
            }
            // Each read again alone: one that panics fails alone, not its batch.
            Err(_) => {
                for ((mut buf, offset), slot) in io.into_iter().zip(slots) {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| image.read(&mut buf, offset)))
                        .unwrap_or_else(|_| {
                            let why = io::Error::other("the read of a snapshot failed unexpectedly (see the log)");
                            Err(ferry_backend::Error::io("read", offset, buf.len() as u64, why))
                        });
                    slot.finish(buf, r);
                }
            }
        }
        reads = rest;
    }
    #[cfg(test)]
    for f in others {
        f();
    }
}

/// The threads that serve the [`IoQueue`]s of one image: they end when it is dropped
/// and the jobs handed to them are done.
struct Pool {
    queue: Arc<JobQueue>,
}

/// The jobs not yet taken, whether the pool is dropped, and how many of its threads are
/// alive and busy. One lock and one condition: jobs handed to an idle pool wake as many
/// threads as there are jobs, at most (a channel's receiver, shared behind a lock, woke
/// a second thread for each job, to wait in its place).
#[derive(Default)]
struct JobQueue {
    jobs: Mutex<Jobs>,
    cv: Condvar,
}

#[derive(Default)]
struct Jobs {
    queue: VecDeque<Job>,
    dropped: bool,
    /// Threads that have not ended: none left, a job is run by whoever hands it over.
    live: usize,
    /// Threads running jobs.
    busy: usize,
    /// The most jobs a thread takes at once.
    batch: usize,
}

impl Jobs {
    /// How many jobs a thread takes now: its share of those queued, the threads not busy
    /// (waiting, or starting) taking theirs, from 1 to `batch`. A queue no deeper than
    /// the free threads is read one job a thread, side by side (a cold disk's reads in
    /// flight together); a deeper one (the threads busy: CPU-bound) in batches whose
    /// chunks are checked together.
    /// Only small reads are taken together (a run of them at the front of the queue).
    fn take(&self) -> Option<usize> {
        let free = self.live.saturating_sub(self.busy).max(1);
        let share = self.queue.len().div_ceil(free).clamp(1, self.batch.max(1));
        let small = self.queue.iter().take(share).take_while(|j| j.small()).count();
        (!self.queue.is_empty()).then_some(small.max(1))
    }
}

/// Held by a pool's thread: counts it out of [`Jobs::live`] however it ends (a panic
/// too); the last one out runs the jobs still queued, which no thread would take.
struct Live(Arc<JobQueue>);

impl Drop for Live {
    fn drop(&mut self) {
        let left = {
            let mut g = self.0.jobs.lock().unwrap_or_else(|e| e.into_inner());
            g.live -= 1;
            if g.live == 0 {
                std::mem::take(&mut g.queue)
            } else {
                VecDeque::new()
            }
        };
        run_jobs(left.into());
    }
}

impl Pool {
    /// `threads` threads, each taking up to `batch` jobs at once, or `None` when none
    /// could be started.
    fn start(threads: usize, batch: usize) -> Option<Pool> {
        let queue = Arc::new(JobQueue::default());
        queue.jobs.lock().unwrap_or_else(|e| e.into_inner()).batch = batch;
        for i in 0..threads {
            // Counted in before it starts, so that a job handed over meanwhile waits for it.
            queue.jobs.lock().unwrap_or_else(|e| e.into_inner()).live += 1;
            let live = Live(queue.clone());
            let t = std::thread::Builder::new().name(format!("repo-read-{i}")).spawn(move || {
                let q = &live.0;
                let mut was_busy = false;
                loop {
                    // The lock is held only to take jobs, not while they run.
                    let mut g = q.jobs.lock().unwrap_or_else(|e| e.into_inner());
                    if was_busy {
                        g.busy -= 1;
                    }
                    let jobs: Vec<Job> = loop {
                        if let Some(n) = g.take() {
                            g.busy += 1;
                            break g.queue.drain(..n).collect();
                        }
                        if g.dropped {
                            return;
                        }
                        g = q.cv.wait(g).unwrap_or_else(|e| e.into_inner());
                    };
                    drop(g);
                    was_busy = true;
                    run_jobs(jobs);
                }
            });
            // A thread not started dropped its `Live` with the closure: counted out.
            drop(t);
        }
        let started = queue.jobs.lock().unwrap_or_else(|e| e.into_inner()).live;
        (started > 0).then_some(Pool { queue })
    }

    /// Queues `job` for a thread, which [`Pool::wake`] wakes: a connection queues the
    /// reads of one receive, then wakes the threads once, so that threads that find
    /// more jobs than idle threads take several. Runs it here when the pool has no thread
    /// left (each one ended by a panic outside its job's own catch), where it would wait
    /// for ever.
    fn queue(&self, job: Job) {
        let mut g = self.queue.jobs.lock().unwrap_or_else(|e| e.into_inner());
        if g.live == 0 {
            drop(g);
            return run_jobs(vec![job]);
        }
        g.queue.push_back(job);
    }

    /// Wakes a thread for each job queued, at most every thread (one that is busy takes
    /// jobs when it is done; waking it too costs nothing, and a thread that ended while
    /// busy leaves `busy` counting it, which must never keep an idle one asleep).
    fn wake(&self) {
        let n = {
            let g = self.queue.jobs.lock().unwrap_or_else(|e| e.into_inner());
            g.live.min(g.queue.len())
        };
        for _ in 0..n {
            self.queue.cv.notify_one();
        }
    }

    /// [`Pool::queue`], then [`Pool::wake`].
    #[cfg(test)]
    fn submit(&self, job: Job) {
        self.queue(job);
        self.wake();
    }
}

impl Drop for Pool {
    /// The threads take the jobs left, then end.
    fn drop(&mut self) {
        self.queue.jobs.lock().unwrap_or_else(|e| e.into_inner()).dropped = true;
        self.queue.cv.notify_all();
    }
}

/// Threads for a snapshot's reads, from a store on this machine or not
/// ([`crate::store::Store::local`]). Decoding and checking a chunk is CPU work: from a
/// local store, one thread per core (on 2 cores, 2 threads served 4 KiB random misses faster
/// than 8 on a warm page cache, and 4 no slower than 2: docs/benchmarks-history.md §39);
/// but at least 4, as a cold or slow local disk
/// (a network block device under a local file system, a disk after a reboot) needs reads
/// in flight. An object store's reads wait on the network: at least
/// [`crate::repo::FETCH_THREADS`] in flight. At most 32.
pub(crate) fn pool_threads(local: bool) -> usize {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    cores.clamp(if local { 4 } else { crate::repo::FETCH_THREADS }, 32)
}

/// The variable that sets the threads of a served snapshot's reads.
pub(crate) const READ_THREADS_ENV: &str = "FERRY_REPO_READ_THREADS";

/// The most threads [`READ_THREADS_ENV`] may ask for.
pub(crate) const MAX_READ_THREADS: usize = 64;

/// The read threads `var` (the value of [`READ_THREADS_ENV`]) asks for: `None` where it
/// is unset or empty; an error that names the accepted range where it is not a number
/// from 1 to [`MAX_READ_THREADS`].
pub(crate) fn read_threads_from(var: Option<&str>) -> Result<Option<usize>> {
    match var.map(str::trim) {
        None | Some("") => Ok(None),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if (1..=MAX_READ_THREADS).contains(&n) => Ok(Some(n)),
            _ => Err(crate::Error::Invalid(format!(
                "{READ_THREADS_ENV}={v:?}: give a number of threads from 1 to {MAX_READ_THREADS}, or unset it"
            ))),
        },
    }
}

/// A read in flight: its buffer and result once done.
#[derive(Default)]
struct Slot {
    done: Mutex<Option<(Vec<u8>, ferry_backend::Result<()>)>>,
    cv: Condvar,
}

impl Slot {
    fn finish(&self, buf: Vec<u8>, r: ferry_backend::Result<()>) {
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) = Some((buf, r));
        self.cv.notify_all();
    }
    fn is_done(&self) -> bool {
        self.done.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }
    fn wait(&self) -> (Vec<u8>, ferry_backend::Result<()>) {
        let mut d = self.done.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = d.take() {
                return r;
            }
            d = self.cv.wait(d).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The reads of one connection, run side by side on the image's pool and handed back in
/// the order they came.
struct ReadQueue {
    image: Arc<SnapshotImage>,
    pending: VecDeque<Arc<Slot>>,
}

impl ReadQueue {
    /// Wakes the pool's threads for the reads queued (none without a pool: read at once).
    fn wake(&self) {
        if let Some(pool) = self.image.pool.get().and_then(Option::as_ref) {
            pool.wake();
        }
    }
}

impl IoQueue for ReadQueue {
    fn submit_read(&mut self, mut buf: Vec<u8>, offset: u64) {
        let slot = Arc::new(Slot::default());
        self.pending.push_back(slot.clone());
        // A small read the cache answers (or zero chunks) is answered here: handing it to
        // a pool thread and back would cost more than the read. The server sends such
        // answers as they are made, not once every request received is read (which kept
        // client and server in step, each waiting on the other: half the IOPS).
        if buf.len() as u64 <= KNOWN_INLINE && self.image.read_known(&mut buf, offset) {
            slot.finish(buf, Ok(()));
            return;
        }
        let cs = self.image.cs;
        let small = !buf.is_empty()
            && offset
                .checked_add(buf.len() as u64)
                .is_some_and(|end| end <= self.image.size && (end - 1) / cs == offset / cs)
            && buf.len() < self.image.chunk_len(offset / cs);
        let job = Job::Read(QueuedRead { image: self.image.clone(), buf, offset, slot, small });
        match self.image.pool.get().and_then(Option::as_ref) {
            // Started at the end of the run of requests this one is in, or before a wait.
            Some(pool) => pool.queue(job),
            // No pool to take it: read here.
            None => run_jobs(vec![job]),
        }
    }
    fn submitted(&mut self) {
        self.wake();
    }
    fn submit_write(&mut self, buf: Vec<u8>, offset: u64) {
        // Wrapped in ferry_backend::read_only_queue: never called.
        let len = buf.len() as u64;
        let slot = Arc::new(Slot::default());
        slot.finish(buf, Err(ferry_backend::Error::new(ferry_backend::ErrorKind::ReadOnly, "write", offset, len)));
        self.pending.push_back(slot);
    }
    fn len(&self) -> usize {
        self.pending.len()
    }
    fn oldest_done(&self) -> bool {
        self.pending.front().is_some_and(|s| s.is_done())
    }
    fn complete(&mut self) -> Option<(Vec<u8>, ferry_backend::Result<()>)> {
        // The oldest may be queued with no thread woken for it yet.
        if !self.oldest_done() {
            self.wake();
        }
        self.pending.pop_front().map(|s| s.wait())
    }
}

impl Drop for ReadQueue {
    /// Waits for the reads in flight (IoQueue's contract).
    fn drop(&mut self) {
        self.wake();
        for s in self.pending.drain(..) {
            drop(s.wait());
        }
    }
}

/// Why a read failed: a pack that is gone may be found again in a reloaded index, and a
/// damaged copy may have another; a store that fails (network, I/O) is reported as is.
enum Failure {
    PackGone(ferry_backend::Error),
    Damaged(ferry_backend::Error),
    Unreadable(ferry_backend::Error),
}

impl Failure {
    fn into_error(self) -> ferry_backend::Error {
        match self {
            Failure::PackGone(e) | Failure::Damaged(e) | Failure::Unreadable(e) => e,
        }
    }
}

/// A chunk to fetch for one read.
struct Want {
    ci: u64,
    id: Digest,
    loc: Location,
    /// Read ahead: into the cache only, and its failures are not this read's.
    ahead: bool,
    /// A buffer to decode the chunk into (an evicted chunk's), when it is not decoded in
    /// the read's own buffer.
    spare: Option<Vec<u8>>,
}

impl Backend for SnapshotImage {
    fn describe(&self) -> String {
        format!("{}::{}", self.repo.store.describe(), self.shown_id())
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn caps(&self) -> Capabilities {
        Capabilities {
            read_only: true,
            flush: true,
            fua: false,
            trim: false,
            zero: false,
            fast_zero: false,
            multi_conn: true,
            cache: false,
            extents: true,
        }
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> ferry_backend::Result<()> {
        let length = buf.len() as u64;
        if offset.checked_add(length).is_none_or(|e| e > self.size) {
            return Err(ferry_backend::Error::new(ferry_backend::ErrorKind::Invalid, "read", offset, length));
        }
        if length == 0 {
            return Ok(());
        }
        let ahead = self.ahead_for(offset, offset + length);
        self.read_after(buf, offset, ahead)
    }
    /// The requests of one connection read side by side on a pool of threads.
    fn io_queue(&self) -> Option<Box<dyn IoQueue>> {
        let image = self.me.upgrade()?;
        // Misses checked a batch at a time where reads are CPU work (a store on this
        // machine); an object store's reads wait on the network side by side, one a thread.
        let batch = if self.repo.store.local() { ferry_hash::sha256_group() } else { 1 };
        self.pool.get_or_init(|| Pool::start(self.read_threads(), batch)).as_ref()?;
        Some(ferry_backend::read_only_queue(Box::new(ReadQueue { image, pending: VecDeque::new() })))
    }
    fn flush(&self) -> ferry_backend::Result<()> {
        Ok(())
    }
    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> ferry_backend::Result<()> {
        let end = offset.saturating_add(length).min(self.size);
        if offset >= end {
            out.push(Extent { length, flags: DATA });
            return Ok(());
        }
        let mut mine: Vec<Extent> = Vec::new();
        let mut pos = offset;
        while pos < end {
            let ci = pos / self.cs;
            let cend = (ci * self.cs + self.chunk_len(ci) as u64).min(end);
            let flags = if self.entries[ci as usize] == ZERO { HOLE } else { DATA };
            if mine.len() >= max.max(1) && mine.last().is_some_and(|l| l.flags != flags) {
                break;
            }
            push_extent(&mut mine, cend - pos, flags);
            pos = cend;
        }
        out.extend(mine);
        Ok(())
    }
    fn identity(&self) -> Option<String> {
        Some(format!("ferry-repo:{}:{}", self.repo.config.id, self.snap.id))
    }
}

#[cfg(test)]
mod tests {
    use super::{Job, Pool};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Barrier};
    use std::time::{Duration, Instant};

    /// Waits up to 5 s for `flag`.
    fn set_soon(flag: &AtomicBool) -> bool {
        let t = Instant::now();
        while !flag.load(Ordering::SeqCst) && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(2));
        }
        flag.load(Ordering::SeqCst)
    }

    /// A pool one of whose threads ended while busy (a panic outside a read's own catch)
    /// still wakes the others for the jobs handed to it later.
    #[test]
    fn a_thread_that_ends_busy_leaves_the_others_woken() {
        let pool = Pool::start(2, 1).unwrap();
        pool.submit(Job::Run(Box::new(|| panic!("a job that kills its thread (a test)"))));
        let live = || pool.queue.jobs.lock().unwrap_or_else(|e| e.into_inner()).live;
        let t = Instant::now();
        while live() > 1 && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(live(), 1, "the thread did not end");
        std::thread::sleep(Duration::from_millis(20));
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        pool.submit(Job::Run(Box::new(move || r.store(true, Ordering::SeqCst))));
        assert!(set_soon(&ran), "a job handed to the thread left was never run");
    }

    /// A pool whose threads have all ended (a panic outside a job's own catch) runs the
    /// jobs queued when the last one ended, and then each job where it is handed over:
    /// none waits for ever for a thread.
    #[test]
    fn a_pool_with_no_thread_left_still_runs_its_jobs() {
        // One job at a time: the job queued behind the one that kills the thread is the
        // last thread's to run as it ends.
        let pool = Pool::start(1, 1).unwrap();
        let (go, queued) = (Arc::new(Barrier::new(2)), Arc::new(AtomicBool::new(false)));
        let g = go.clone();
        pool.submit(Job::Run(Box::new(move || {
            g.wait();
            panic!("a job that kills its thread (a test)");
        })));
        let q = queued.clone();
        pool.submit(Job::Run(Box::new(move || q.store(true, Ordering::SeqCst))));
        go.wait();
        assert!(set_soon(&queued), "the job queued when the pool's last thread ended never ran");
        while pool.queue.jobs.lock().unwrap_or_else(|e| e.into_inner()).live > 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
        let later = Arc::new(AtomicBool::new(false));
        let l = later.clone();
        let job = Job::Run(Box::new(move || l.store(true, Ordering::SeqCst)));
        pool.submit(job);
        assert!(later.load(Ordering::SeqCst), "a job handed to a pool with no thread was not run at once");
    }
}
