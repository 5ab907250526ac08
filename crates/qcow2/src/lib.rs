//! qcow2 disk images as [`Backend`]s: the format layer between a store (a file, or any
//! backend) and the NBD server or the copy engine.
//!
//! Reading: versions 2 and 3, cluster sizes 512 B to 2 MiB, backing chains (relative
//! names resolved against the image's directory, raw or qcow2 backing files,
//! `backing_fmt` honoured), zero clusters, compressed clusters (deflate and zstd),
//! extended L2 entries with subclusters, external data files. Block status comes from the
//! L2 tables. Writing (version 3, 16-bit refcounts, no snapshots, no subclusters, no
//! external data file): freed clusters are allocated again (else the file grows),
//! partial clusters are filled from the backing file, WRITE_ZEROES makes zero clusters,
//! TRIM deallocates (freed clusters are punched out of the file, free ones at its end cut
//! off), and FLUSH writes data first, then metadata in dependency order, so a crash
//! leaves at most leaked clusters.
//!
//! A writable image's file is written through `overlap::Guard`s: a write that would
//! overwrite metadata is refused and the image marked corrupt (as qemu does), enabled
//! dirty bitmaps are marked in use before the first write, and an image using clusters
//! past the end of its file is not written unless [`Options::allow_truncated`].
//!
//! Persistent dirty bitmaps stay true: loaded at open (`bitmaps.rs`), every WRITE,
//! WRITE_ZEROES and TRIM recorded in the enabled ones, written back with `in_use`
//! cleared on a clean close (`persist.rs`), offered as `qemu:dirty-bitmap:NAME`
//! metadata contexts, and managed with [`Qcow2::bitmap_add`] and its siblings.
//!
//! One mutex guards the metadata (L1, L2 cache, refcounts); data is read and written
//! outside it, straight into and out of the caller's buffers.
//!
//! # The format layer (qcow2)
//!
//! A disk image format is a `Backend` on top of a store, the way qemu's qcow2 driver sits on
//! its `file` or `rbd` protocol driver:
//!
//! ```text
//! NBD server / copy engine ──▶ Arc<dyn Backend> = Qcow2 ──▶ Store: FileStore (pread/pwrite)
//!                                  │                         or BackendStore(any Backend)
//!                                  └─ backing: Arc<dyn Backend> (Qcow2 or FileBackend)
//! ```
//!
//! **The path of a qcow2 READ.** Steps 1–3 of the READ path (ARCHITECTURE.md, "The path of one READ") are unchanged; at step 4
//! `Qcow2::read` takes the metadata mutex once, walks the L1 entry and the (cached) L2 table
//! of every cluster in the request and builds merged runs (`Zero`, `Unallocated`,
//! `Data(host)` with contiguous host offsets joined, `Compressed`), and releases the lock.
//! Then each run is served into the server's buffer directly: `Data` is one `pread` at the
//! host offset of the image (or its external data file), `Zero` a fill, `Unallocated` a read
//! of the same range of the backing file (zeroes past its end, or without one), `Compressed`
//! a read of the compressed bytes and one inflate (a cluster read whole is inflated straight
//! into the buffer; a partial one goes through a one-cluster cache so sequential small reads
//! inflate once). Block status walks the same map: unallocated and zero clusters are holes
//! that read as zeroes, unallocated ones fall through to the backing file's extents. Over a
//! Unix socket, a read that lies in one run of data clusters goes out with sendfile(2) like a
//! raw file's: `Backend::file_offset` maps the guest range to the image file's offset (the
//! identity for raw files), and the server sends that file range. Reads of 64 KiB or more
//! ask the map first, so unallocated and zero clusters go back as hole chunks.
//!
//! **Writes** take the mutex to look up or allocate (a freed cluster first, found by a scan
//! of the refcounts from a hint, qemu's `free_cluster_index`; else at the end of the
//! allocated area), write partial clusters (old contents
//! from the backing file, a zero cluster or a compressed cluster, plus the new bytes) under
//! it, and write whole clusters and already-owned clusters after releasing it. FLUSH: sync
//! the data; write refcount blocks (and a grown refcount table, then the header); sync;
//! write L2 tables; sync; write L1 entries; sync; then apply the frees of replaced clusters;
//! sync. Each step only makes metadata point at things already on disk, so a crash can leak
//! clusters but never leave a reference to an uncounted or unwritten cluster. A cluster is
//! free to allocate again only from that last step on, when no L2 entry on disk points at
//! it; the step first waits (an `RwLock`, `io_gate`) for writes landing outside the mutex,
//! so none lands in a cluster already given to another guest range. Clusters freed by TRIM
//! and WRITE_ZEROES are then punched out of the file (`Store::discard`) and free clusters at
//! the file's end cut off (`Store::truncate`). Frees waiting for a FLUSH are applied without
//! one once 8 MiB of them wait and a write finds no free cluster, so a client that never
//! flushes does not grow the file either. `ferry serve --discard=ignore` is a filter
//! (`ferry_backend::IgnoreDiscard`: TRIM does nothing, WRITE_ZEROES never deallocates); with
//! NO_HOLE the qcow2 layer keeps owned clusters as preallocated zero clusters and writes into
//! them in place. A FLUSH takes `io_gate` exclusively before it syncs anything, so no L2
//! entry or refcount reaches the disk before the data it describes. A write whose data fails
//! to land (EIO, ENOSPC) puts back the clusters it mapped (`undo_fresh`: a zero cluster, or
//! the preallocated zeroes it was, and the new cluster freed), so its range reads zeroes, never
//! a reused cluster's old bytes, and no counted cluster is left past the end of the file.
//! Closing writes the dirty metadata the same way. A new image that `ferry copy` writes
//! without `--flush` (`Qcow2::without_sync_on_close`) closes in that order without the syncs,
//! like a raw destination and `qemu-img convert`, which sync nothing: on a disk file system a
//! sync of the whole new image was about 40% of the conversion (docs/benchmarks-history.md, section 13).
//!
//! **Persistent bitmaps and allocation depth.** Each metadata context is one
//! `ferry_backend::MetaContext` (a name and an `extents` call); a backend lists its own with
//! `Backend::meta_contexts`, and the server (`ferry serve`) and the client side (`ferry info
//! --map`, `ferry copy --dirty-bitmap` on a local image) use that one list, so neither knows
//! what a context means. For qcow2:
//!
//! ```text
//! Qcow2 ──meta_contexts()──▶ AllocationDepth (depth.rs: walks this layer's map, then the
//!    │                        next qcow2 layer's, `backing_image`; raw layers allocate all)
//!    └──────────────────────▶ DirtyContext per consistent bitmap (bitmaps.rs: Arc<Bits>)
//! write/zero/trim ─▶ before_write (overlap.rs: in_use set and synced, once)
//!                 ─▶ Bits::mark(granules) in every enabled bitmap (atomic ORs, multi-conn)
//! close/finish ───▶ persist.rs: changed bitmaps to new clusters, new directory with in_use
//!                   cleared, synced; header extension switched; then old clusters freed
//! ```
//!
//! Bits live in memory as words of atomics (a 1 TiB disk at 64 KiB granularity is 2 MiB;
//! 512 MiB of bits in all is the bound, checked before allocating); a table entry of 0 or 1
//! (all clear, all set) costs nothing. An extent query walks words, skipping whole zero or
//! all-ones words a word at a time, so 100,000 dirty runs over 1 TiB are walked in well
//! under a second. A bitmap `in_use` at
//! open was left by a crash: never loaded, offered or changed. `ferry bitmap` (add, remove,
//! clear, enable, disable, merge) is the same in-memory set changed under the image's write
//! lock and written back by the same close. A new overlay (`Qcow2::create_with`, `ferry copy
//! --backing`) stores its backing file's name relative to its own directory and the backing
//! format extension; its destination endpoint is not "zeroed", so zero ranges of the source
//! become zero clusters instead of reading through.
//!
//! **Why our own crate and not `imago`.** imago (the Rust qcow2 library) has no zstd
//! compression, and is async-first with synchronous wrappers over its own runtime, where
//! ferry is threads with blocking I/O. We want the hot path in our hands: one lock per
//! request for the whole mapping, reads landing straight in the server's buffers, block
//! status straight from the L2 tables, and the store being any `Backend` (so qcow2 on RBD is
//! the same code). The format is small enough to own: about 2,200 lines with its unit tests.
//!
//! # Safety: overlap checks, bitmaps, untrusted images
//!
//! - **Metadata overlap** (`ferry-qcow2`'s `overlap.rs`): a writable image writes its file
//!   through two `overlap::Guard` stores (guest data, metadata) sharing an ordered set of
//!   metadata clusters, built at open from the header, L1, the L2 offsets in L1, the
//!   refcount table and blocks, and the bitmap directory and tables (no L2 contents read),
//!   and kept current by `Store::metadata_allocated`/`cluster_freed`. Guest data may touch no
//!   metadata; a metadata write may not touch a cluster another kind of metadata claims;
//!   discard and truncate may touch none. A conflict: EIO, the corrupt bit set and synced,
//!   an error naming both, every later write refused, reads go on. Clusters referenced past
//!   the end of the file are found at open (L1, refcount table, highest counted cluster)
//!   and when an L2 table loads.
//! - **Dirty bitmaps** (`bitmaps.rs`, `persist.rs`): kept true, as qemu keeps them (see
//!   "Persistent bitmaps and allocation depth" above); the first write to a writable image
//!   (the guard's `before_write`, before any byte reaches the file, the direct write path
//!   included) sets `in_use` on every enabled bitmap, clears unknown autoclear bits, and
//!   syncs. A corrupt-bit image opens read-only only.
//! - **Untrusted images** (`ferry-qcow2`, `ferry-open`): an image opened on a store other
//!   than a local file (`Qcow2::open_on`: HTTP, S3, RBD, memory) is refused
//!   (`Qcow2Error::Refused`) when its header names a backing or external data file, before
//!   any name is resolved. A writable local file whose raw format `open_backend` guessed is
//!   wrapped in `ferry_backend::GuessedRaw`: requests reaching into its first 4 bytes take
//!   turns and are checked against the bytes there (read-modify check), and one that would
//!   leave the qcow2 magic is refused with EPERM and logged, as qemu guards "probed raw"
//!   images. `destination` refuses to update in place a file only its bytes call qcow2, and
//!   a local image opened as qcow2 on its bytes alone (`ferry_qcow2::Options::guessed`: no
//!   `qcow2:`, no `*.qcow2` name) is refused when it names a backing or data file.
//!
//! # What this crate owns
//!
//! The qcow2 format layer: `header` (parse and validate, refusals naming the feature),
//! `map` (L1/L2 lookup to `Mapping::{Unallocated, Zero, Data, Compressed}`, subclusters, L2
//! cache), `compressed` (zlib via flate2/zlib-rs, zstd via ruzstd), `refcount` + `write`
//! (allocation, copy-on-write, ordered flush), `create`; `Qcow2` is a `Backend` over a
//! `Store` (a file, or any `Backend`)
//!
//! `unsafe`: forbidden.
#![forbid(unsafe_code)]

mod bitmaps;
mod compressed;
mod create;
mod depth;
mod header;
mod map;
mod overlap;
mod persist;
mod refcount;
mod store;
mod write;

pub use bitmaps::{BitmapInfo, Bits};
pub use create::Backing;
pub use header::{has_qcow2_magic, is_qcow2, Compression, Header, MAGIC};
pub use map::Mapping;
pub use overlap::Metadata;
pub use store::{BackendStore, FileStore, Store};

use ferry_backend::{
    push_extent, Access, Backend, Capabilities, Error, ErrorKind, Extent, FileBackend, ImageUse, OpenFile, ZeroMode,
    DATA, HOLE,
};
use map::{Geometry, L2Cache, L2Table, OFFSET_MASK};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// Backing chains deeper than this are refused (a loop would otherwise never end).
const MAX_CHAIN: usize = 16;
/// Clean L2 tables kept in memory, in bytes.
const L2_CACHE_BYTES: usize = 64 << 20;

/// Why an image cannot be opened or used.
#[derive(Debug, thiserror::Error)]
pub enum Qcow2Error {
    #[error("not a qcow2 image (no QFI\\xfb magic)")]
    NotQcow2,
    #[error("not a valid qcow2 image: {0}")]
    Invalid(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("the image is corrupt: {0}; check it with qemu-img check")]
    Corrupt(String),
    /// An image that may not be opened as it is (it names files it may not name).
    #[error("{0}")]
    Refused(String),
    /// A bitmap operation that cannot be done (no such bitmap, an inconsistent one).
    #[error("{0}")]
    Bitmap(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// The refusal of an image on a store other than a local file that names a file
/// (`what`: "a backing file", "an external data file") as `n`.
fn remote_names_file(image: &str, what: &str, n: &str) -> Qcow2Error {
    let (shown, cut) = shown_name(n);
    Qcow2Error::Refused(format!(
        "the qcow2 image on {image} names {what} {shown:?}{cut}: an image that is not in a local file may not \
         name backing or data files (its author would choose which local file ferry reads); copy the image \
         and the files it needs to local files and open it there (raw:URL reads its container as it is)"
    ))
}

/// The refusal of a local image whose qcow2 format was guessed from its bytes (at `depth`
/// in its chain: 0 for the image named) that names a file (`what`) as `n`.
fn guessed_names_file(image: &str, what: &str, n: &str, depth: usize) -> Qcow2Error {
    let (shown, cut) = shown_name(n);
    let way_out = if depth == 0 {
        format!(
            "write qcow2:{image} (or name the file *.qcow2) if it is a qcow2 image you trust, or raw:{image} if \
             it is a raw disk"
        )
    } else {
        "if it is a qcow2 image you trust, record its format in the image that names it \
         (qemu-img rebase -u -b BACKING -F qcow2 IMAGE)"
            .to_string()
    };
    Qcow2Error::Refused(format!(
        "{image} was taken for a qcow2 image from its first bytes alone, and it names {what} {shown:?}{cut}: the \
         guest of a raw disk can write such a header to make ferry read any file, so ferry opens files named by \
         an image only when its format was named: {way_out}"
    ))
}

/// A file name from an image as messages show it: names are at most a cluster long, but
/// a log line need not carry all of one.
fn shown_name(n: &str) -> (String, &'static str) {
    let shown: String = n.chars().take(256).collect();
    let cut = if shown.len() < n.len() { "..." } else { "" };
    (shown, cut)
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Qcow2Error {
    let what = what.into();
    move |source| Qcow2Error::Io { what, source }
}

/// How an image is opened.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    pub read_only: bool,
    /// Write to an image even though clusters it uses lie past the end of its file (a
    /// truncated image; the missing clusters read as zeroes). Without it such an image
    /// opens read-only only (with a warning).
    pub allow_truncated: bool,
    /// The image was taken for qcow2 from its first bytes only (the user named no
    /// format). Such an image that names a backing or external data file is refused
    /// ([`Qcow2Error::Refused`]): a raw disk's guest can write a qcow2 header naming any
    /// file, and the next probe would read that file.
    pub guessed: bool,
}

/// One layer of a backing chain, as `ferry info` shows it.
#[derive(Debug, Clone)]
pub struct ChainEntry {
    /// The name as written in the image that refers to it.
    pub name: String,
    /// The path it was opened from.
    pub path: PathBuf,
    pub format: String,
    pub virtual_size: u64,
}

/// What an image is.
#[derive(Debug, Clone)]
pub struct Info {
    pub version: u32,
    pub virtual_size: u64,
    pub cluster_size: u64,
    pub compression: &'static str,
    pub extended_l2: bool,
    pub refcount_bits: u32,
    pub snapshots: u32,
    pub data_file: Option<String>,
    /// The backing chain, nearest first.
    pub backing_chain: Vec<ChainEntry>,
    pub file_size: u64,
    /// The corrupt bit (incompatible feature 1): the image is read, never written.
    pub corrupt: bool,
    /// The lazy refcounts bit (compatible feature 0).
    pub lazy_refcounts: bool,
}

/// How the image's guest bytes are stored in this layer (not counting backing files).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Allocation {
    pub data: u64,
    pub compressed: u64,
    pub zero: u64,
    pub unallocated: u64,
}

struct State {
    l1: Vec<u64>,
    /// L1 entries changed since the last flush.
    l1_dirty: std::collections::BTreeSet<usize>,
    l2: L2Cache,
    /// Present when the image is writable.
    refs: Option<refcount::Refcounts>,
}

/// An open qcow2 image.
pub struct Qcow2 {
    name: String,
    store: Arc<dyn Store>,
    /// The store holding guest data: `store` itself, or the external data file.
    data: Arc<dyn Store>,
    backing: Option<Arc<dyn Backend>>,
    /// The backing file when it is a qcow2 image (for `qemu:allocation-depth`).
    backing_image: Option<Arc<Qcow2>>,
    header: Header,
    geo: Geometry,
    writable: bool,
    /// Closing syncs the data and each metadata step (see `write.rs`); off for a new
    /// image whose writer did not ask for durability.
    sync_on_close: bool,
    state: Mutex<State>,
    /// The last decompressed cluster: (host offset, bytes).
    zcache: Mutex<Option<(u64, Arc<Vec<u8>>)>>,
    /// Held shared by writes landing outside the metadata lock, exclusively while frees
    /// are applied (see `write.rs`).
    io_gate: std::sync::RwLock<()>,
    info: Info,
    /// The metadata map and the first-write duties of a writable image (`overlap.rs`).
    safety: overlap::Safety,
    /// The local files this image keeps open: its own, its data file, its backing chain's.
    files: Vec<OpenFile>,
    /// The persistent dirty bitmaps (`bitmaps.rs`, `persist.rs`).
    bitmaps: Mutex<bitmaps::Set>,
    /// The enabled ones' bits, where writes are recorded (writable images only).
    recording: std::sync::RwLock<Vec<Arc<bitmaps::Bits>>>,
    /// `recording` is not empty: checked first, so a write to an image without enabled
    /// bitmaps (the usual case) takes no lock shared by every connection.
    recording_any: std::sync::atomic::AtomicBool,
    /// A bitmap was added, removed, enabled or disabled since the directory was written.
    bitmaps_changed: std::sync::atomic::AtomicBool,
}

impl Qcow2 {
    /// Opens the image at `path` and its backing chain (always read-only), locked as
    /// `ferry serve` locks it (as qemu-nbd does).
    pub fn open(path: &Path, read_only: bool) -> Result<Qcow2, Qcow2Error> {
        Self::open_with(path, &Options { read_only, ..Options::default() })
    }

    /// Opens the image at `path` as `opts` say, and its backing chain (read-only), locked
    /// as `ferry serve` locks it (as qemu-nbd does).
    pub fn open_with(path: &Path, opts: &Options) -> Result<Qcow2, Qcow2Error> {
        Self::open_for(path, opts, ImageUse::serve(opts.read_only))
    }

    /// Opens the image at `path` as `opts` say, and its backing chain, each file locked
    /// for `usage` (see [`ferry_backend::lock`]) as long as the image is open.
    pub fn open_for(path: &Path, opts: &Options, usage: ImageUse) -> Result<Qcow2, Qcow2Error> {
        Self::open_depth(path, opts, usage, 0)
    }

    fn open_depth(path: &Path, opts: &Options, usage: ImageUse, depth: usize) -> Result<Qcow2, Qcow2Error> {
        let store = FileStore::open(path, !opts.read_only, usage.qcow2())
            .map_err(io_err(format!("cannot open {}", path.display())))?;
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::open_store(Arc::new(store), path.display().to_string(), opts, usage, Some(&dir), depth)
    }

    /// Opens an image held by any backend (memory, a network store), read-only. Such an
    /// image may not name backing or external data files, absolute, relative or `json:`:
    /// one that does is refused ([`Qcow2Error::Refused`]) before any file is opened, as
    /// its author, not the user, would choose which local file is read. (Writing would
    /// need allocation to start from the refcounts, not from the end of a store that
    /// cannot grow.)
    pub fn open_on(store: Arc<dyn Backend>) -> Result<Qcow2, Qcow2Error> {
        let name = store.describe();
        Self::open_store(
            Arc::new(BackendStore(store)),
            name,
            &Options { read_only: true, ..Options::default() },
            ImageUse::new(Access::Export),
            None,
            0,
        )
    }

    fn open_store(
        store: Arc<dyn Store>,
        name: String,
        opts: &Options,
        usage: ImageUse,
        dir: Option<&Path>,
        depth: usize,
    ) -> Result<Qcow2, Qcow2Error> {
        let read_only = opts.read_only;
        let file_len = store.size();
        let first = (file_len.min(2 << 20)) as usize;
        let mut buf = vec![0u8; first];
        store.read_at(&mut buf, 0).map_err(io_err("cannot read the header"))?;
        let header = Header::parse(&buf, file_len)?;
        let cs = header.cluster_size() as usize;
        buf.truncate(cs);
        let header = Header::parse(&buf, file_len)?;
        let geo = Geometry::new(&header);
        let writable = !read_only;
        if writable {
            write::check_writable(&header)?;
        } else if header.incompatible & header::INCOMPAT_CORRUPT != 0 && depth == 0 {
            log::warn!("the image has the corrupt bit set: it is read as it is, and may read wrong where its metadata is damaged; repair it with qemu-img check -r all");
        }

        // The first file the header names: its external data file, else its backing file.
        // An image not in a local file (HTTP, S3, RBD, memory) names none at all: whoever
        // wrote it would otherwise choose a local file (a secret, a block device) for
        // ferry to read and serve. Nor does a local one whose format was only guessed.
        // Both are checked before anything is opened.
        let named = header
            .data_file
            .as_deref()
            .map(|n| ("an external data file", n))
            .or(header.backing_file.as_deref().map(|n| ("a backing file", n)));
        if let Some((what, n)) = named {
            if dir.is_none() {
                return Err(remote_names_file(&name, what, n));
            }
            if opts.guessed {
                return Err(guessed_names_file(&name, what, n, depth));
            }
        }
        let resolve = |what: &str, n: &str| -> Result<PathBuf, Qcow2Error> {
            if n.contains("://") || n.starts_with("json:") {
                return Err(Qcow2Error::Unsupported(format!("{what} {n:?} is not a local file")));
            }
            let p = Path::new(n);
            match dir {
                Some(_) if p.is_absolute() => Ok(p.to_path_buf()),
                Some(d) => Ok(d.join(p)),
                None => Err(remote_names_file(&name, what, n)),
            }
        };

        let data: Arc<dyn Store> = match &header.data_file {
            Some(n) => {
                let p = resolve("external data file", n)?;
                Arc::new(
                    FileStore::open(&p, writable, usage.data_file())
                        .map_err(io_err(format!("cannot open the external data file {}", p.display())))?,
                )
            }
            None => store.clone(),
        };
        let mut files: Vec<OpenFile> = store.open_file().into_iter().collect();
        if header.data_file.is_some() {
            files.extend(data.open_file());
        }

        let mut chain = Vec::new();
        let mut backing_image = None;
        let backing: Option<Arc<dyn Backend>> = match &header.backing_file {
            Some(n) => {
                if depth + 1 >= MAX_CHAIN {
                    return Err(Qcow2Error::Unsupported(format!("backing chain longer than {MAX_CHAIN} images")));
                }
                let p = resolve("backing file", n)?;
                let format = match header.backing_format.as_deref() {
                    Some(f) => f.to_string(),
                    None => {
                        std::fs::File::open(&p).map_err(io_err(format!("cannot open backing file {}", p.display())))?;
                        if has_qcow2_magic(&p) {
                            // As qemu probes; but a raw backing file a guest wrote could
                            // hold a header of its own choosing.
                            log::warn!(
                                "{name}: backing file {} has no recorded format and starts with a qcow2 header: \
                                 read as qcow2; if it is a raw disk, record that with \
                                 qemu-img rebase -u -b {n:?} -F raw {name}",
                                p.display()
                            );
                            "qcow2"
                        } else {
                            "raw"
                        }
                        .to_string()
                    }
                };
                let b: Arc<dyn Backend> = match format.as_str() {
                    "qcow2" => {
                        // Probed, not recorded: it too may name no file.
                        let guessed = header.backing_format.is_none();
                        let q = Qcow2::open_depth(
                            &p,
                            &Options { read_only: true, guessed, ..Options::default() },
                            usage.backing(),
                            depth + 1,
                        )
                        .map_err(|e| match e {
                            Qcow2Error::Io { what, source } => {
                                Qcow2Error::Io { what: format!("backing file: {what}"), source }
                            }
                            other => Qcow2Error::Invalid(format!("backing file {}: {other}", p.display())),
                        })?;
                        chain.push(ChainEntry { name: n.clone(), path: p.clone(), format, virtual_size: q.geo.size });
                        chain.extend(q.info.backing_chain.iter().cloned());
                        files.extend(q.files.iter().cloned());
                        let q = Arc::new(q);
                        backing_image = Some(q.clone());
                        q
                    }
                    "raw" | "file" => {
                        let f = FileBackend::open_with(&p, true, usage.backing().raw())
                            .map_err(io_err(format!("cannot open backing file {}", p.display())))?;
                        files.extend(f.open_file().ok());
                        chain.push(ChainEntry {
                            name: n.clone(),
                            path: p.clone(),
                            format: "raw".into(),
                            virtual_size: f.size(),
                        });
                        Arc::new(f)
                    }
                    other => {
                        return Err(Qcow2Error::Unsupported(format!(
                            "backing file {} has format {other:?} (ferry reads qcow2 and raw backing files)",
                            p.display()
                        )))
                    }
                };
                Some(b)
            }
            None => None,
        };

        let mut l1raw = vec![0u8; header.l1_size as usize * 8];
        store.read_at(&mut l1raw, header.l1_table_offset).map_err(io_err("cannot read the L1 table"))?;
        let l1: Vec<u64> = l1raw.chunks_exact(8).map(|c| u64::from_be_bytes(c.try_into().unwrap_or([0; 8]))).collect();
        let refs = if writable { Some(refcount::Refcounts::load(&*store, &header)?) } else { None };
        // The bitmaps of the image itself (a backing file's are never used).
        let set = match depth {
            0 => match bitmaps::load(&*store, &header) {
                Ok(s) => s,
                Err(e) if writable => return Err(overlap::cannot_mark(e)),
                Err(e) => {
                    log::warn!("{name}: {e}; its persistent dirty bitmaps are not offered");
                    bitmaps::Set::default()
                }
            },
            _ => bitmaps::Set::default(),
        };
        let safety = overlap::Safety::open(&name, &store, &header, &l1, writable, opts.allow_truncated, &set)?;
        let recording = match writable {
            true => set.recording(),
            false => Vec::new(),
        };
        let (store, data) = safety.wrap(store, data);
        let info = Info {
            version: header.version,
            virtual_size: header.size,
            cluster_size: geo.cluster_size,
            compression: header.compression.name(),
            extended_l2: geo.extended_l2,
            refcount_bits: 1 << header.refcount_order,
            snapshots: header.nb_snapshots,
            data_file: header.data_file.clone(),
            backing_chain: chain,
            file_size: file_len,
            corrupt: header.incompatible & header::INCOMPAT_CORRUPT != 0,
            lazy_refcounts: header.compatible & 1 != 0,
        };
        Ok(Qcow2 {
            name,
            store,
            data,
            backing,
            backing_image,
            state: Mutex::new(State {
                l1,
                l1_dirty: Default::default(),
                l2: L2Cache::new(L2_CACHE_BYTES / geo.cluster_size as usize),
                refs,
            }),
            header,
            geo,
            writable,
            sync_on_close: true,
            zcache: Mutex::new(None),
            io_gate: Default::default(),
            info,
            safety,
            files,
            bitmaps: Mutex::new(set),
            recording_any: std::sync::atomic::AtomicBool::new(!recording.is_empty()),
            recording: std::sync::RwLock::new(recording),
            bitmaps_changed: Default::default(),
        })
    }

    /// Closing writes the metadata in FLUSH's order but syncs nothing, as closing a raw
    /// file does: for an image a copy writes without `--flush` (qemu-img convert does not
    /// sync either). A FLUSH still syncs. Until the kernel has written it back, a crash
    /// can leave such an image inconsistent, not just its data stale.
    pub fn without_sync_on_close(mut self) -> Qcow2 {
        self.sync_on_close = false;
        self
    }

    /// Writes the dirty metadata and the persistent bitmaps as closing would (synced
    /// unless [`Qcow2::without_sync_on_close`]), reporting failures that closing can only
    /// log.
    pub fn finish(&self) -> Result<(), Qcow2Error> {
        self.close_inner()
    }

    pub fn info(&self) -> &Info {
        &self.info
    }

    /// The local files this image keeps open (its own first, then its external data
    /// file and its backing chain's files), with whether each is written.
    pub fn open_files(&self) -> &[OpenFile] {
        &self.files
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Walks the mapping of `offset..offset + len`, calling `f(length, mapping)` for each
    /// piece in order until it returns false.
    fn walk(
        &self,
        st: &mut State,
        offset: u64,
        len: u64,
        mut f: impl FnMut(u64, Mapping) -> bool,
    ) -> Result<(), Qcow2Error> {
        let geo = self.geo;
        let span = geo.l2_span();
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let l1_idx = (pos / span) as usize;
            let table_end = end.min((l1_idx as u64 + 1) * span);
            let l2_off = st.l1.get(l1_idx).copied().unwrap_or(0) & OFFSET_MASK;
            if l2_off == 0 {
                if !f(table_end - pos, Mapping::Unallocated) {
                    return Ok(());
                }
                pos = table_end;
                continue;
            }
            let table = self.l2_table(st, l2_off)?;
            while pos < table_end {
                let idx = ((pos >> geo.cluster_bits) & (geo.l2_entries - 1)) as usize;
                let (e, bm) =
                    if geo.extended_l2 { (table.raw[2 * idx], table.raw[2 * idx + 1]) } else { (table.raw[idx], 0) };
                let (m, run) = geo.decode(e, bm, pos)?;
                let n = run.min(table_end - pos);
                if !f(n, m) {
                    return Ok(());
                }
                pos += n;
            }
        }
        Ok(())
    }

    /// The L2 table at host offset `l2_off`, read on a cache miss.
    fn l2_table<'a>(&self, st: &'a mut State, l2_off: u64) -> Result<&'a mut L2Table, Qcow2Error> {
        if l2_off & (self.geo.cluster_size - 1) != 0 {
            return Err(Qcow2Error::Corrupt(format!("unaligned L2 table offset {l2_off:#x}")));
        }
        if st.l2.get(l2_off).is_none() {
            let mut b = vec![0u8; self.geo.cluster_size as usize];
            self.store.read_at(&mut b, l2_off).map_err(io_err(format!("cannot read the L2 table at {l2_off:#x}")))?;
            let t = L2Table::from_bytes(&b);
            // Writable: past every cluster counted or allocated (then a later allocation
            // would hand out a cluster in use); read-only: past the end of the file.
            let limit = st.refs.as_ref().map_or_else(|| self.data.size(), |r| r.high_water());
            self.safety.l2_loaded(&self.name, &self.geo, l2_off, &t.raw, limit);
            st.l2.insert(l2_off, t);
        }
        st.l2.get(l2_off).ok_or_else(|| Qcow2Error::Corrupt("L2 cache lost a table".into()))
    }

    /// The mapping of a range as merged runs: (length, mapping).
    fn runs(&self, offset: u64, len: u64) -> Result<Vec<(u64, Mapping)>, Qcow2Error> {
        let mut out: Vec<(u64, Mapping)> = Vec::new();
        let mut st = self.lock();
        self.walk(&mut st, offset, len, |n, m| {
            push_run(&mut out, n, m);
            true
        })?;
        Ok(out)
    }

    fn read_impl(&self, buf: &mut [u8], offset: u64) -> Result<(), Qcow2Error> {
        let runs = self.runs(offset, buf.len() as u64)?;
        let mut pos = 0usize;
        for (n, m) in runs {
            let b = &mut buf[pos..pos + n as usize];
            let guest = offset + pos as u64;
            match m {
                Mapping::Zero => b.fill(0),
                Mapping::Unallocated => self.read_backing(b, guest)?,
                Mapping::Data(host) => {
                    self.data.read_at(b, host).map_err(io_err(format!("cannot read data at host offset {host:#x}")))?
                }
                Mapping::Compressed { host, len, skip } => self.read_compressed(host, len, skip, b)?,
            }
            pos += n as usize;
        }
        Ok(())
    }

    fn read_backing(&self, b: &mut [u8], guest: u64) -> Result<(), Qcow2Error> {
        let Some(bk) = &self.backing else {
            b.fill(0);
            return Ok(());
        };
        let avail = bk.size().saturating_sub(guest).min(b.len() as u64) as usize;
        let (head, tail) = b.split_at_mut(avail);
        tail.fill(0);
        if !head.is_empty() {
            bk.read(head, guest)
                .map_err(|e| Qcow2Error::Io { what: "backing file".into(), source: std::io::Error::other(e) })?;
        }
        Ok(())
    }

    /// Decompresses one cluster (or takes it from the one-cluster cache) and copies the
    /// part wanted. Decompression runs outside every lock.
    fn read_compressed(&self, host: u64, len: u64, skip: u64, b: &mut [u8]) -> Result<(), Qcow2Error> {
        let cs = self.geo.cluster_size as usize;
        {
            let z = self.zcache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((h, data)) = z.as_ref() {
                if *h == host {
                    b.copy_from_slice(&data[skip as usize..skip as usize + b.len()]);
                    return Ok(());
                }
            }
        }
        let mut input = vec![0u8; len as usize];
        self.store.read_at(&mut input, host).map_err(io_err(format!("cannot read compressed cluster at {host:#x}")))?;
        if skip == 0 && b.len() == cs {
            return compressed::decompress(self.header.compression, &input, b)
                .map_err(|e| Qcow2Error::Corrupt(format!("compressed cluster at host offset {host:#x}: {e}")));
        }
        let mut out = vec![0u8; cs];
        compressed::decompress(self.header.compression, &input, &mut out)
            .map_err(|e| Qcow2Error::Corrupt(format!("compressed cluster at host offset {host:#x}: {e}")))?;
        b.copy_from_slice(&out[skip as usize..skip as usize + b.len()]);
        *self.zcache.lock().unwrap_or_else(|e| e.into_inner()) = Some((host, Arc::new(out)));
        Ok(())
    }

    fn extents_impl(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> Result<(), Qcow2Error> {
        let max = max.max(1);
        let mut runs: Vec<(u64, Mapping)> = Vec::new();
        {
            let mut st = self.lock();
            self.walk(&mut st, offset, length, |n, m| {
                let m = match m {
                    Mapping::Data(_) | Mapping::Compressed { .. } => Mapping::Data(0),
                    other => other,
                };
                match runs.last_mut() {
                    Some((l, last)) if *last == m => *l += n,
                    _ => runs.push((n, m)),
                }
                runs.len() <= max
            })?;
        }
        let start = out.len();
        let mut pos = offset;
        for (n, m) in runs {
            if out.len() - start >= max {
                break;
            }
            match (m, &self.backing) {
                (Mapping::Unallocated, Some(bk)) => {
                    let bsize = bk.size();
                    let inside = bsize.saturating_sub(pos).min(n);
                    if inside > 0 {
                        let mut sub = Vec::new();
                        bk.extents(pos, inside, max - (out.len() - start), &mut sub).map_err(|e| Qcow2Error::Io {
                            what: "backing file".into(),
                            source: std::io::Error::other(e),
                        })?;
                        let mut covered = 0;
                        for e in sub {
                            let l = e.length.min(inside - covered);
                            push_extent(out, l, e.flags);
                            covered += l;
                            if covered == inside {
                                break;
                            }
                        }
                        if covered < inside {
                            return Ok(());
                        }
                    }
                    push_extent(out, n - inside, HOLE);
                }
                (Mapping::Unallocated | Mapping::Zero, _) => push_extent(out, n, HOLE),
                _ => push_extent(out, n, DATA),
            }
            pos += n;
        }
        Ok(())
    }

    /// Counts how this layer stores the guest bytes (scans every L2 table).
    pub fn allocation(&self) -> Result<Allocation, Qcow2Error> {
        let mut a = Allocation::default();
        let mut st = self.lock();
        self.walk(&mut st, 0, self.geo.size, |n, m| {
            match m {
                Mapping::Unallocated => a.unallocated += n,
                Mapping::Zero => a.zero += n,
                Mapping::Data(_) => a.data += n,
                Mapping::Compressed { .. } => a.compressed += n,
            }
            true
        })?;
        Ok(a)
    }

    fn to_backend_error(&self, op: &'static str, offset: u64, length: u64, e: Qcow2Error) -> Error {
        let (kind, source) = match e {
            Qcow2Error::Io { what, source } => {
                let mut err = Error::io(op, offset, length, source);
                let source = std::io::Error::new(
                    err.source.as_ref().map_or(std::io::ErrorKind::Other, |s| s.kind()),
                    format!("{}: {what}: {}", self.name, err.source.as_ref().map_or(String::new(), |s| s.to_string())),
                );
                err.source = Some(source);
                return err;
            }
            Qcow2Error::Unsupported(m) => {
                (ErrorKind::NotSupported, std::io::Error::other(format!("{}: {m}", self.name)))
            }
            other => (ErrorKind::Io, std::io::Error::other(format!("{}: {other}", self.name))),
        };
        Error { kind, op, offset, length, source: Some(source) }
    }
}

/// What the `qcow2` fuzz target does with each input: opens it as an image held in
/// memory, then reads and asks block status at a few places. Must never panic, hang or
/// allocate without bound, whatever the bytes.
#[doc(hidden)]
pub fn fuzz_image(data: &[u8]) {
    let mem = Arc::new(ferry_backend::MemoryBackend::new(data.len() as u64));
    if mem.write(data, 0, false).is_err() {
        return;
    }
    let Ok(q) = Qcow2::open_on(mem) else { return };
    let size = q.size();
    let mut buf = vec![0u8; 128 << 10];
    let window = 16u64 << 20;
    for at in [0, size / 3, size.saturating_sub(buf.len() as u64)] {
        let n = (buf.len() as u64).min(size - at.min(size)) as usize;
        if n > 0 {
            let _ = q.read(&mut buf[..n], at);
        }
        let len = window.min(size - at.min(size));
        if len > 0 {
            let mut ex = Vec::new();
            if q.extents(at, len, 64, &mut ex).is_ok() {
                let total: u64 = ex.iter().map(|e| e.length).sum();
                assert!(!ex.is_empty() && ex.len() <= 64 && total <= len, "bad extents {ex:?} for {len}");
            }
        }
    }
    let _ = q.info();
    let _ = q.bitmaps();
    bitmaps::fuzz_bitmaps(data);
}

pub use bitmaps::fuzz_bitmaps;

/// Appends a run, merging it with the previous one when it continues it.
fn push_run(out: &mut Vec<(u64, Mapping)>, n: u64, m: Mapping) {
    if let Some((l, last)) = out.last_mut() {
        let merge = match (*last, m) {
            (Mapping::Zero, Mapping::Zero) | (Mapping::Unallocated, Mapping::Unallocated) => true,
            (Mapping::Data(a), Mapping::Data(b)) => a + *l == b,
            _ => false,
        };
        if merge {
            *l += n;
            return;
        }
    }
    out.push((n, m));
}

impl Backend for Qcow2 {
    fn describe(&self) -> String {
        format!("qcow2:{}", self.name)
    }
    fn identity(&self) -> Option<String> {
        self.store.identity().map(|id| format!("qcow2 on {id}"))
    }
    fn size(&self) -> u64 {
        self.geo.size
    }
    fn caps(&self) -> Capabilities {
        let rw = self.writable;
        Capabilities {
            read_only: !rw,
            flush: true,
            fua: rw,
            trim: rw,
            zero: rw,
            fast_zero: false,
            // One object shared by every connection: FLUSH on one covers all.
            multi_conn: true,
            cache: false,
            extents: true,
        }
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> ferry_backend::Result<()> {
        self.read_impl(buf, offset).map_err(|e| self.to_backend_error("read", offset, buf.len() as u64, e))
    }
    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> ferry_backend::Result<()> {
        self.write_impl(buf, offset, fua).map_err(|e| self.to_backend_error("write", offset, buf.len() as u64, e))
    }
    fn flush(&self) -> ferry_backend::Result<()> {
        self.flush_impl().map_err(|e| self.to_backend_error("flush", 0, self.geo.size, e))
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> ferry_backend::Result<()> {
        self.discard_impl(offset, length, false, true, fua)
            .map_err(|e| self.to_backend_error("trim", offset, length, e))
    }
    fn zero(&self, offset: u64, length: u64, mode: ZeroMode, fua: bool) -> ferry_backend::Result<()> {
        self.discard_impl(offset, length, true, mode.may_trim, fua)
            .map_err(|e| self.to_backend_error("zero", offset, length, e))
    }
    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> ferry_backend::Result<()> {
        self.extents_impl(offset, length, max, out)
            .map_err(|e| self.to_backend_error("block status", offset, length, e))
    }
    /// The data store's file: a range in one data cluster run goes out with sendfile(2).
    fn file_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.data.fd()
    }
    fn file_offset(&self, offset: u64, length: u64) -> Option<u64> {
        match self.runs(offset, length).ok()?.as_slice() {
            // Only inside the file: sendfile stops short at its end.
            [(_, Mapping::Data(host))] if host.checked_add(length).is_some_and(|e| e <= self.data.size()) => {
                Some(*host)
            }
            _ => None,
        }
    }
    /// Every read asks the map first, so zero clusters and unallocated ones (where the
    /// backing chain has none) go back as holes at any read size, as qemu-nbd answers.
    /// The map is in memory: the lookup costs far less than a raw file's SEEK_HOLE,
    /// which is why raw files check only large reads.
    fn sparse_read_threshold(&self) -> Option<u64> {
        Some(0)
    }
    /// `qemu:dirty-bitmap:NAME` for each consistent persistent bitmap (and
    /// `qemu:allocation-depth`).
    fn meta_contexts(self: Arc<Self>) -> Vec<Arc<dyn ferry_backend::MetaContext>> {
        let mut v: Vec<Arc<dyn ferry_backend::MetaContext>> = vec![self.allocation_depth()];
        let set = self.bitmaps.lock().unwrap_or_else(|e| e.into_inner());
        for l in &set.list {
            if let Some(b) = &l.bits {
                v.push(Arc::new(bitmaps::DirtyContext {
                    name: format!("qemu:dirty-bitmap:{}", l.entry.name),
                    bits: b.clone(),
                }));
            }
        }
        v
    }
}

impl Drop for Qcow2 {
    fn drop(&mut self) {
        // A corrupt image takes no more writes (that was logged when it was marked).
        if let Err(e) = self.close_inner() {
            log::error!("{}: writing metadata and bitmaps on close failed: {e}", self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closing_without_sync_still_writes_the_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.qcow2");
        {
            let q = Qcow2::create(&p, 4 << 20, 65536).unwrap().without_sync_on_close();
            q.write(&[5u8; 200_000], 70_000, false).unwrap();
        }
        let q = Qcow2::open(&p, true).unwrap();
        let mut b = vec![1u8; 300_000];
        q.read(&mut b, 0).unwrap();
        assert!(b[..70_000].iter().all(|&x| x == 0) && b[270_000..].iter().all(|&x| x == 0));
        assert!(b[70_000..270_000].iter().all(|&x| x == 5));
    }

    #[test]
    fn create_write_read_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.qcow2");
        let size = 3 << 20;
        {
            let q = Qcow2::create(&p, size, 4096).unwrap();
            assert_eq!(q.size(), size);
            q.write(&[7u8; 10000], 5000, false).unwrap();
            q.write(&[9u8; 8192], 1 << 20, true).unwrap();
            q.zero(1 << 20, 4096, ZeroMode { may_trim: true, fast: false }, false).unwrap();
            let mut b = vec![1u8; 20000];
            q.read(&mut b, 0).unwrap();
            assert!(b[..5000].iter().all(|&x| x == 0));
            assert!(b[5000..15000].iter().all(|&x| x == 7));
            assert!(b[15000..].iter().all(|&x| x == 0));
            let mut ex = Vec::new();
            q.extents(0, size, 100, &mut ex).unwrap();
            assert_eq!(ex.iter().map(|e| e.length).sum::<u64>(), size);
            assert_eq!(ex[0], Extent { length: 4096, flags: HOLE });
            assert_eq!(ex[1], Extent { length: 12288, flags: DATA });
            q.flush().unwrap();
        }
        let q = Qcow2::open(&p, true).unwrap();
        assert!(q.caps().read_only);
        let mut b = vec![1u8; 8192];
        q.read(&mut b, 1 << 20).unwrap();
        assert!(b[..4096].iter().all(|&x| x == 0) && b[4096..].iter().all(|&x| x == 9));
        assert_eq!(
            q.allocation().unwrap(),
            Allocation { data: 16384, compressed: 0, zero: 0, unallocated: size - 16384 }
        );
        assert!(q.write(&[1], 0, false).is_err());
    }

    /// A small deterministic version of the fuzz target: qemu-made-like images (made
    /// here) with bytes flipped all over the metadata.
    #[test]
    fn hostile_images_never_panic() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.qcow2");
        {
            let q = Qcow2::create(&p, 4 << 20, 4096).unwrap();
            for i in 0..40u64 {
                q.write(&[i as u8 + 1; 3000], i * 70001, false).unwrap();
            }
            q.zero(1 << 20, 65536, ZeroMode::default(), false).unwrap();
        }
        let mut images = vec![std::fs::read(&p).unwrap()];
        // The fuzz seeds: qemu-made images (512 B clusters, v2, zlib, zstd, subclusters).
        let seeds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/qcow2");
        for e in std::fs::read_dir(&seeds).unwrap() {
            images.push(std::fs::read(e.unwrap().path()).unwrap());
        }
        assert!(images.len() >= 6, "fuzz seeds missing in {}", seeds.display());
        for good in images {
            mutate(&good);
        }
    }

    fn mutate(good: &[u8]) {
        // The unmutated image reads whole.
        let mem = Arc::new(ferry_backend::MemoryBackend::new(good.len() as u64));
        mem.write(good, 0, false).unwrap();
        let q = Qcow2::open_on(mem).unwrap();
        let mut all = vec![0u8; q.size() as usize];
        q.read(&mut all, 0).unwrap();
        assert!(all.iter().any(|&x| x != 0));
        fuzz_image(good);
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        // The metadata lives in the first clusters and in the L2 tables after the data.
        for _ in 0..300 {
            let mut b = good.to_vec();
            for _ in 0..1 + next() % 8 {
                let at = (next() % b.len() as u64) as usize;
                let at = if next() % 2 == 0 { at % 16384 } else { at };
                b[at] = next() as u8;
            }
            fuzz_image(&b);
        }
        for cut in [0, 3, 71, 103, 4095, 4097, good.len() / 2] {
            fuzz_image(&good[..cut]);
        }
    }

    #[test]
    fn opens_from_any_backend() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.qcow2");
        {
            let q = Qcow2::create(&p, 1 << 20, 65536).unwrap();
            q.write(&[3u8; 512], 70000, false).unwrap();
        }
        let bytes = std::fs::read(&p).unwrap();
        let mem = Arc::new(ferry_backend::MemoryBackend::new(bytes.len() as u64));
        mem.write(&bytes, 0, false).unwrap();
        let q = Qcow2::open_on(mem).unwrap();
        let mut b = vec![0u8; 1024];
        q.read(&mut b, 69888).unwrap();
        assert!(b[..112].iter().all(|&x| x == 0) && b[112..624].iter().all(|&x| x == 3));
        assert!(Qcow2::open_on(Arc::new(ferry_backend::MemoryBackend::new(4096))).is_err());
    }

    /// Reads of any size are checked for holes (the server then sends zero and
    /// unallocated clusters as hole chunks), and the map says which small ranges are.
    #[test]
    fn small_reads_of_zero_and_unallocated_clusters_are_holes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.qcow2");
        let q = Qcow2::create(&p, 1 << 20, 65536).unwrap();
        q.write(&[9u8; 65536], 0, false).unwrap();
        q.write(&[9u8; 65536], 65536, false).unwrap();
        q.zero(65536, 65536, ZeroMode::default(), false).unwrap();
        for len in [512u64, 4096, 32768] {
            assert!(q.sparse_read_threshold().is_some_and(|t| len >= t), "a {len}-byte read is not checked");
            for (at, flags) in [(0, DATA), (65536, HOLE), (4 * 65536, HOLE)] {
                let mut out = Vec::new();
                q.extents(at + 512, len, 1024, &mut out).unwrap();
                assert_eq!(out, [Extent { length: len, flags }], "{len} bytes at {}", at + 512);
            }
        }
    }

    /// An image on another store (HTTP, S3, RBD: here memory) that names a backing file,
    /// absolute or relative, is refused, naming the image and the name, and the file is
    /// never read.
    #[test]
    fn an_image_not_in_a_file_names_no_backing_file() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, vec![0x5a; 1 << 20]).unwrap();
        let abs = secret.to_str().unwrap().to_string();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        for name in [abs.as_str(), "../secret"] {
            let p = dir.path().join("sub/overlay.qcow2");
            let _ = std::fs::remove_file(&p);
            let backing = Backing { name: name.into(), format: "raw".into() };
            drop(Qcow2::create_with(&p, 1 << 20, 65536, Some(&backing)).unwrap());
            // The same image in a file reads its backing file (a relative name from its
            // directory).
            let mut b = [0u8; 16];
            Qcow2::open(&p, true).unwrap().read(&mut b, 0).unwrap();
            assert_eq!(b, [0x5a; 16]);
            let bytes = std::fs::read(&p).unwrap();
            let mem = Arc::new(ferry_backend::MemoryBackend::new(bytes.len() as u64));
            mem.write(&bytes, 0, false).unwrap();
            let e = Qcow2::open_on(mem).err().expect("an image in memory naming a backing file must be refused");
            assert!(matches!(e, Qcow2Error::Refused(_)), "{e}");
            let msg = e.to_string();
            assert!(msg.contains(&format!("{name:?}")) && msg.contains("backing file"), "{msg}");
            assert!(msg.contains("copy the image"), "{msg}");
        }
    }
}
