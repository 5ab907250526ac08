//! The copy engine behind `ferry copy`: NBD, local files and block devices, stdin/stdout
//! and `null:`, in any combination.
//!
//! The source's allocation map is read first (NBD block status or SEEK_DATA/SEEK_HOLE),
//! so holes are never read. Data is cut into requests of `request_size` bytes, handed
//! out from a shared queue to `connections` workers; each worker keeps `requests` of
//! them in flight on its own connections, reading into its own buffers and writing from
//! the same buffers (no copy between source and destination). With `sparse`, blocks of
//! zeroes are not written: the destination gets WRITE_ZEROES, or is left as a hole.
//!
//! Zero detection works on blocks of `zero_block` bytes (256 KiB) inside each request, so
//! requests can be large (1 MiB: fewer per-request costs on both sides) without writing
//! zero blocks as data: a request becomes a run of WRITEs and WRITE_ZEROES.
//!
//! From a local file to a plaintext NBD connection the data does not pass through user
//! space at all: WRITE payloads go from the file's page cache to the socket with
//! sendfile(2). Zero detection then reads only each block's first [`PROBE`] bytes, and
//! the rest of a block only when those are all zero.

use crate::conn::{Completion, ConnectOptions, Connection, Error as ConnError, Payload, Submit};
use crate::uri::Uri;
use ferry_backend::{Backend, ZeroMode};
use ferry_hash::BlockHasher;
use ferry_proto::consts::*;
use ferry_proto::reply::Extent;
use ferry_sock::AlignedBuf;
use rustix::event::{poll, PollFd, PollFlags};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One end of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Nbd(Uri),
    File(PathBuf),
    /// `-`: stdin as a source, stdout as a destination (sequential).
    Stdio,
    /// `null:`: a destination that discards.
    Null,
    /// Any [`Backend`] (a disk image format, a network store), opened by the caller.
    Backend(BackendEndpoint),
}

/// A [`Backend`] as a copy source or destination, shared by every worker (backends are
/// `Send + Sync`).
///
/// As a source its `extents` are the allocation map (holes and zero extents are not
/// read); as a destination it must be at least as large as the source and writable, and
/// zeroes go through `Backend::zero` where the backend declares it.
#[derive(Clone)]
pub struct BackendEndpoint {
    name: String,
    backend: Arc<dyn Backend>,
    zeroed: bool,
}

impl BackendEndpoint {
    /// `name` is what error messages call it (usually the path or spec it was opened from).
    pub fn new(name: String, backend: Arc<dyn Backend>) -> BackendEndpoint {
        BackendEndpoint { name, backend, zeroed: false }
    }

    /// Declares that the backend reads as zeroes everywhere (it was just created), so as a
    /// destination its holes and zero blocks need no writing.
    pub fn zeroed(mut self) -> BackendEndpoint {
        self.zeroed = true;
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }
}

impl std::fmt::Debug for BackendEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendEndpoint").field("name", &self.name).field("backend", &self.backend.describe()).finish()
    }
}

/// The same name and the same backend object.
impl PartialEq for BackendEndpoint {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && self.zeroed == other.zeroed && Arc::ptr_eq(&self.backend, &other.backend)
    }
}

impl Eq for BackendEndpoint {}

impl Endpoint {
    pub fn parse(s: &str) -> Result<Endpoint, crate::uri::UriError> {
        if s == "-" {
            Ok(Endpoint::Stdio)
        } else if s == "null:" {
            Ok(Endpoint::Null)
        } else if Uri::looks_like(s) {
            Ok(Endpoint::Nbd(Uri::parse(s)?))
        } else {
            Ok(Endpoint::File(PathBuf::from(s)))
        }
    }
}

#[derive(Debug, Clone)]
pub struct CopyOptions {
    pub connections: usize,
    pub requests: usize,
    pub request_size: usize,
    /// Zero detection granularity with `sparse` (raised to 1/128 of a request if that is
    /// larger).
    pub zero_block: usize,
    pub sparse: bool,
    /// Send WRITE payloads from a local file with sendfile(2) where the connection allows.
    pub send_file: bool,
    pub flush: bool,
    pub connect: ConnectOptions,
    /// Compute a blkhash of the data on the way through (`ferry copy --hash`, `ferry hash`).
    pub hash: Option<Arc<BlockHasher>>,
}

impl Default for CopyOptions {
    fn default() -> Self {
        CopyOptions {
            connections: 4,
            requests: 4,
            request_size: 1 << 20,
            zero_block: DEFAULT_ZERO_BLOCK,
            sparse: true,
            send_file: true,
            flush: false,
            connect: ConnectOptions::default(),
            hash: None,
        }
    }
}

/// Counters a progress display can read while the copy runs.
#[derive(Debug, Default)]
pub struct Progress {
    /// Bytes of the source dealt with (written, zeroed or skipped as holes).
    pub done: AtomicU64,
    /// Source size, or 0 while unknown (stdin).
    pub total: AtomicU64,
}

/// Why a copy failed.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("{what}: {source}")]
    Connect { what: &'static str, source: ConnError },
    #[error("{0}")]
    Setup(String),
    #[error("{what} {path}: {source}")]
    Local { what: &'static str, path: String, source: io::Error },
    #[error("{op} at offset {offset} ({length} bytes) failed: {message}")]
    Request { op: &'static str, offset: u64, length: u64, message: String },
}

impl CopyError {
    /// A failed request (or local read/write) of `length` bytes at `offset`.
    fn request(op: &'static str, offset: u64, length: u64, e: impl std::fmt::Display) -> CopyError {
        CopyError::Request { op, offset, length, message: e.to_string() }
    }
}

/// What a finished copy did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CopyReport {
    pub bytes: u64,
    /// Bytes read and written as data.
    pub data_bytes: u64,
    /// Bytes not read because the source said they were holes.
    pub hole_bytes: u64,
    /// Bytes read but found to be zero and not written as data.
    pub zero_bytes: u64,
    pub connections: usize,
    /// The blkhash of the data, when one was asked for.
    pub digest: Option<Vec<u8>>,
    /// Socket statistics summed over every NBD connection.
    pub socket: ferry_sock::Counters,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Data,
    Zero,
}

#[derive(Debug, Clone, Copy)]
struct Item {
    offset: u64,
    len: usize,
    kind: Kind,
}

/// Hands out pieces of the source in order.
struct Queue {
    extents: Vec<(u64, u64, Kind)>,
    idx: usize,
    pos: u64,
    request_size: u64,
    zero_chunk: u64,
    /// Streaming source: hand out sequential data items until told to stop.
    streaming: bool,
    stream_end: bool,
}

/// Default of [`CopyOptions::zero_block`]: nbdcopy's request size, whose requests of
/// zeroes it skips.
pub const DEFAULT_ZERO_BLOCK: usize = 256 * 1024;

/// WRITE_ZEROES pieces stay well inside a 32-bit length.
const ZERO_CHUNK: u64 = 1 << 30;

impl Queue {
    fn next(&mut self) -> Option<Item> {
        if self.streaming {
            if self.stream_end {
                return None;
            }
            let it = Item { offset: self.pos, len: self.request_size as usize, kind: Kind::Data };
            self.pos += self.request_size;
            return Some(it);
        }
        while self.idx < self.extents.len() {
            let (start, len, kind) = self.extents[self.idx];
            let end = start + len;
            if self.pos < start {
                self.pos = start;
            }
            if self.pos >= end {
                self.idx += 1;
                continue;
            }
            let max = if kind == Kind::Zero { self.zero_chunk } else { self.request_size };
            let n = (end - self.pos).min(max);
            let it = Item { offset: self.pos, len: n as usize, kind };
            self.pos += n;
            return Some(it);
        }
        None
    }
}

enum Src {
    Nbd(Box<Connection>),
    File(File),
    Stdin(io::Stdin),
    Backend(Arc<dyn Backend>),
}

enum Dst {
    Nbd(Box<Connection>),
    /// A file; `fresh` when it was just created or truncated (so holes need no writing).
    File {
        file: File,
        fresh: bool,
        block: bool,
    },
    Stdout(io::Stdout),
    Null,
    Backend(BackendEndpoint),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Reading,
    Full,
    Writing,
}

struct Shared<'a> {
    queue: Mutex<Queue>,
    abort: AtomicBool,
    error: Mutex<Option<CopyError>>,
    progress: &'a Progress,
    opts: &'a CopyOptions,
    data_bytes: AtomicU64,
    hole_bytes: AtomicU64,
    zero_bytes: AtomicU64,
}

impl Shared<'_> {
    fn fail(&self, e: CopyError) {
        self.abort.store(true, Ordering::SeqCst);
        let mut g = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(e);
        }
    }
}

fn is_zero(b: &[u8]) -> bool {
    let (head, rest) = b.split_at(b.len() % 16);
    head.iter().all(|&x| x == 0) && rest.chunks_exact(16).all(|c| u128::from_ne_bytes(c.try_into().unwrap()) == 0)
}

fn local<'p>(what: &'static str, path: &'p std::path::Path) -> impl FnOnce(io::Error) -> CopyError + 'p {
    move |source| CopyError::Local { what, path: path.display().to_string(), source }
}

fn connect(uri: &Uri, opts: &ConnectOptions, what: &'static str) -> Result<Connection, CopyError> {
    Connection::connect(uri, opts).map_err(|source| CopyError::Connect { what, source })
}

fn remote(op: &'static str, c: &Completion, e: impl std::fmt::Display) -> CopyError {
    CopyError::request(op, c.offset, c.length, e)
}

/// Allocation map of an NBD source: (start, length, kind) covering the export.
fn nbd_map(c: &mut Connection, size: u64) -> Result<Vec<(u64, u64, Kind)>, CopyError> {
    let mut out: Vec<(u64, u64, Kind)> = Vec::new();
    let mut pos = 0;
    // Compact headers carry 32-bit lengths: ask in pieces below 4 GiB.
    let step = if c.mode() == ferry_proto::ReplyMode::Extended { u64::MAX } else { 0xFFFF_F000 };
    while pos < size {
        let len = (size - pos).min(step);
        let ex = c.block_status(pos, len).map_err(|e| CopyError::request("block status", pos, len, e))?;
        for Extent { length, flags } in ex {
            let length = length.min(size - pos);
            if length == 0 {
                break;
            }
            push_extent(&mut out, pos, length, flags);
            pos += length;
        }
    }
    Ok(out)
}

/// Appends a `base:allocation` extent at `pos` to an allocation map, merging it with the
/// previous one when both are of one kind.
fn push_extent(out: &mut Vec<(u64, u64, Kind)>, pos: u64, length: u64, flags: u32) {
    let kind = if flags & STATE_ZERO != 0 { Kind::Zero } else { Kind::Data };
    match out.last_mut() {
        Some(last) if last.2 == kind && last.0 + last.1 == pos => last.1 += length,
        _ => out.push((pos, length, kind)),
    }
}

/// Allocation map of a backend source, from its `extents`.
fn backend_map(b: &dyn Backend, name: &str, size: u64) -> Result<Vec<(u64, u64, Kind)>, CopyError> {
    let mut out = Vec::new();
    let mut ex = Vec::new();
    let mut pos = 0;
    while pos < size {
        ex.clear();
        b.extents(pos, size - pos, 1 << 16, &mut ex).map_err(|e| CopyError::request("extents", pos, size - pos, e))?;
        let before = pos;
        for Extent { length, flags } in ex.drain(..) {
            let length = length.min(size - pos);
            if length == 0 {
                break;
            }
            push_extent(&mut out, pos, length, flags);
            pos += length;
        }
        if pos == before {
            return Err(CopyError::Setup(format!("source {name} reported no extent at offset {pos}")));
        }
    }
    Ok(out)
}

/// Rounds holes inward to whole hash blocks: a block that is partly data is read.
fn align_extents(extents: Vec<(u64, u64, Kind)>, bs: u64) -> Vec<(u64, u64, Kind)> {
    let end = extents.last().map_or(0, |e| e.0 + e.1);
    let mut out: Vec<(u64, u64, Kind)> = Vec::new();
    let push = |start: u64, stop: u64, kind: Kind, out: &mut Vec<(u64, u64, Kind)>| {
        if stop <= start {
            return;
        }
        match out.last_mut() {
            Some(last) if last.2 == kind && last.0 + last.1 == start => last.1 += stop - start,
            _ => out.push((start, stop - start, kind)),
        }
    };
    for (start, len, kind) in extents {
        let stop = start + len;
        if kind == Kind::Data {
            push(start, stop, Kind::Data, &mut out);
            continue;
        }
        // A hole ending at the end of the disk keeps its partial last block.
        let a = start.div_ceil(bs) * bs;
        let b = if stop == end { stop } else { stop / bs * bs };
        if a >= b {
            push(start, stop, Kind::Data, &mut out);
        } else {
            push(start, a, Kind::Data, &mut out);
            push(a, b, Kind::Zero, &mut out);
            push(b, stop, Kind::Data, &mut out);
        }
    }
    out
}

/// Allocation map of a local file, from SEEK_DATA/SEEK_HOLE (all data where unsupported).
fn file_map(f: &File, size: u64) -> Vec<(u64, u64, Kind)> {
    use rustix::fs::{seek, SeekFrom};
    use std::os::unix::fs::MetadataExt;
    // On tmpfs one SEEK_HOLE scans every page up to the next hole (24 ms for 2 GiB, all
    // before the first byte is copied), so a tmpfs file with as many bytes allocated as it
    // is long is taken as all data without asking. The one case that misses: fallocated
    // pages never written read as zeroes, which zero detection then finds. Elsewhere
    // (ext4, XFS: extent maps) asking is cheap, and preallocated files are common there.
    const TMPFS_MAGIC: u64 = 0x0102_1994;
    let tmpfs = rustix::fs::fstatfs(f).is_ok_and(|s| s.f_type as u64 == TMPFS_MAGIC);
    if tmpfs && f.metadata().is_ok_and(|m| m.is_file() && m.blocks().saturating_mul(512) >= size) {
        return vec![(0, size, Kind::Data)];
    }
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < size {
        let data = match seek(f, SeekFrom::Data(pos)) {
            Ok(d) => d.min(size),
            Err(rustix::io::Errno::NXIO) => size,
            Err(_) => return vec![(0, size, Kind::Data)],
        };
        if data > pos {
            out.push((pos, data - pos, Kind::Zero));
            pos = data;
            continue;
        }
        let hole = match seek(f, SeekFrom::Hole(pos)) {
            Ok(h) => h.clamp(pos + 1, size),
            Err(_) => size,
        };
        out.push((pos, hole - pos, Kind::Data));
        pos = hole;
    }
    out
}

/// Copies `src` to `dst`.
pub fn copy(src: &Endpoint, dst: &Endpoint, opts: &CopyOptions, progress: &Progress) -> Result<CopyReport, CopyError> {
    if opts.request_size == 0 || opts.requests == 0 || opts.connections == 0 {
        return Err(CopyError::Setup("--connections, --requests and --request-size must be at least 1".into()));
    }
    // Open the source and learn its size.
    let (first_src, src_size, multi_src) = match src {
        Endpoint::Nbd(u) => {
            let c = connect(u, &opts.connect, "source")?;
            let (size, multi) = (c.size(), c.has_flag(FLAG_CAN_MULTI_CONN));
            (Src::Nbd(Box::new(c)), Some(size), multi)
        }
        Endpoint::File(p) => {
            let f = File::open(p).map_err(local("cannot open source", p))?;
            let meta = f.metadata().map_err(local("cannot stat source", p))?;
            let size = if meta.file_type().is_block_device() {
                rustix::fs::seek(&f, rustix::fs::SeekFrom::End(0))
                    .map_err(|e| local("cannot size source", p)(e.into()))?
            } else {
                meta.len()
            };
            (Src::File(f), Some(size), true)
        }
        Endpoint::Stdio => (Src::Stdin(io::stdin()), None, false),
        Endpoint::Null => return Err(CopyError::Setup("null: can only be a destination".into())),
        Endpoint::Backend(b) => (Src::Backend(b.backend.clone()), Some(b.backend.size()), true),
    };
    // Open the destination, check it can take the source.
    let (first_dst, multi_dst) = match dst {
        Endpoint::Nbd(u) => {
            let c = connect(u, &opts.connect, "destination")?;
            if c.has_flag(FLAG_READ_ONLY) {
                return Err(CopyError::Setup(format!("destination {u} is read-only")));
            }
            if let Some(s) = src_size {
                if c.size() < s {
                    return Err(CopyError::Setup(format!(
                        "destination {u} is {} bytes, smaller than the {s}-byte source; nothing was written",
                        c.size()
                    )));
                }
            }
            let multi = c.has_flag(FLAG_CAN_MULTI_CONN);
            (Dst::Nbd(Box::new(c)), multi)
        }
        Endpoint::File(p) => {
            let exists = std::fs::metadata(p).ok();
            let block = exists.as_ref().is_some_and(|m| m.file_type().is_block_device());
            let file =
                OpenOptions::new().write(true).create(!block).open(p).map_err(local("cannot open destination", p))?;
            if block {
                let dsize = rustix::fs::seek(&file, rustix::fs::SeekFrom::End(0))
                    .map_err(|e| local("cannot size destination", p)(e.into()))?;
                if let Some(s) = src_size.filter(|s| *s > dsize) {
                    return Err(CopyError::Setup(format!(
                        "destination {} is {dsize} bytes, smaller than the {s}-byte source; nothing was written",
                        p.display()
                    )));
                }
            } else {
                // A copy makes the file exactly the source: empty it, then size it (all hole).
                file.set_len(0).map_err(local("cannot truncate destination", p))?;
                if let Some(s) = src_size {
                    file.set_len(s).map_err(local("cannot size destination", p))?;
                }
            }
            (Dst::File { file, fresh: !block, block }, true)
        }
        Endpoint::Stdio => (Dst::Stdout(io::stdout()), false),
        Endpoint::Null => (Dst::Null, true),
        Endpoint::Backend(b) => {
            let name = &b.name;
            if b.backend.caps().read_only {
                return Err(CopyError::Setup(format!("destination {name} is read-only")));
            }
            let dsize = b.backend.size();
            if let Some(s) = src_size.filter(|s| *s > dsize) {
                return Err(CopyError::Setup(format!(
                    "destination {name} is {dsize} bytes, smaller than the {s}-byte source; nothing was written"
                )));
            }
            (Dst::Backend(b.clone()), true)
        }
    };
    let mut first_src = first_src;
    let streaming = src_size.is_none();
    let src_size = src_size.unwrap_or(0);
    progress.total.store(src_size, Ordering::SeqCst);
    let extents = match &mut first_src {
        Src::Nbd(c) if opts.sparse && c.can_block_status() => nbd_map(c, src_size)?,
        Src::File(f) if opts.sparse => file_map(f, src_size),
        Src::Backend(b) if opts.sparse => {
            let name = match src {
                Endpoint::Backend(e) => e.name.as_str(),
                _ => "",
            };
            backend_map(&**b, name, src_size)?
        }
        _ => vec![(0, src_size, Kind::Data)],
    };
    let mut request_size = opts.request_size as u64;
    let extents = match &opts.hash {
        Some(h) => {
            let bs = h.block_size() as u64;
            request_size = request_size.div_ceil(bs) * bs;
            align_extents(extents, bs)
        }
        None => extents,
    };
    let workers = if matches!(first_dst, Dst::Stdout(_)) || streaming {
        1
    } else {
        let mut n = opts.connections;
        if matches!(first_src, Src::Nbd(_)) && !multi_src {
            n = 1;
        }
        if matches!(first_dst, Dst::Nbd(_)) && !multi_dst {
            n = 1;
        }
        n
    };
    let shared = Shared {
        queue: Mutex::new(Queue {
            extents,
            idx: 0,
            pos: 0,
            request_size,
            zero_chunk: opts
                .hash
                .as_ref()
                .map_or(ZERO_CHUNK, |h| ZERO_CHUNK / h.block_size() as u64 * h.block_size() as u64)
                .max(request_size),
            streaming,
            stream_end: false,
        }),
        abort: AtomicBool::new(false),
        error: Mutex::new(None),
        progress,
        opts,
        data_bytes: AtomicU64::new(0),
        hole_bytes: AtomicU64::new(0),
        zero_bytes: AtomicU64::new(0),
    };
    // Worker 0 uses the connections opened above; the others open their own.
    let mut ends = vec![(first_src, first_dst)];
    for _ in 1..workers {
        let s = match (&ends[0].0, src) {
            (Src::Nbd(_), Endpoint::Nbd(u)) => Src::Nbd(Box::new(connect(u, &opts.connect, "source")?)),
            (Src::File(f), Endpoint::File(p)) => Src::File(f.try_clone().map_err(local("cannot reopen source", p))?),
            (Src::Backend(b), _) => Src::Backend(b.clone()),
            _ => unreachable!("only NBD and file sources get several workers"),
        };
        let d = match (&ends[0].1, dst) {
            (Dst::Nbd(_), Endpoint::Nbd(u)) => Dst::Nbd(Box::new(connect(u, &opts.connect, "destination")?)),
            (Dst::File { file, fresh, block }, Endpoint::File(p)) => Dst::File {
                file: file.try_clone().map_err(local("cannot reopen destination", p))?,
                fresh: *fresh,
                block: *block,
            },
            (Dst::Null, _) => Dst::Null,
            (Dst::Backend(b), _) => Dst::Backend(b.clone()),
            _ => unreachable!("only NBD, file and null destinations get several workers"),
        };
        ends.push((s, d));
    }
    let mut finished: Vec<(Src, Dst, u64)> = Vec::new();
    std::thread::scope(|scope| {
        let handles: Vec<_> = ends
            .into_iter()
            .map(|(s, d)| {
                let shared = &shared;
                scope.spawn(move || worker(s, d, shared))
            })
            .collect();
        for h in handles {
            match h.join() {
                Ok(r) => finished.push(r),
                Err(_) => shared.fail(CopyError::Setup("a copy worker panicked".into())),
            }
        }
    });
    if let Some(e) = shared.error.lock().unwrap_or_else(|e| e.into_inner()).take() {
        return Err(e);
    }
    let written: u64 = finished.iter().map(|f| f.2).sum();
    if streaming {
        if let Some((_, Dst::File { file, block: false, .. }, _)) = finished.first() {
            let _ = file.set_len(written);
        }
    }
    // Finish: flush once (FLUSH covers every connection of a multi-conn server), then
    // disconnect cleanly.
    let mut socket = ferry_sock::Counters::default();
    for (s, d, _) in &finished {
        if let Src::Nbd(c) = s {
            socket.add(&c.stats());
        }
        if let Dst::Nbd(c) = d {
            socket.add(&c.stats());
        }
    }
    for (i, (s, d, _)) in finished.into_iter().enumerate() {
        match d {
            Dst::Nbd(mut c) => {
                if opts.flush && i == 0 {
                    c.flush().map_err(|e| CopyError::request("flush", 0, 0, e))?;
                }
                let _ = c.disconnect();
            }
            Dst::File { file, .. } if opts.flush && i == 0 => {
                file.sync_all().map_err(|e| CopyError::Local {
                    what: "cannot flush",
                    path: "destination".into(),
                    source: e,
                })?;
            }
            Dst::Stdout(mut o) => {
                let _ = o.flush();
            }
            Dst::Backend(b) if opts.flush && i == 0 => {
                b.backend.flush().map_err(|e| CopyError::request("flush", 0, 0, e))?;
            }
            _ => {}
        }
        if let Src::Nbd(c) = s {
            let _ = c.disconnect();
        }
    }
    let total = if streaming { written } else { src_size };
    let (data_bytes_total, hole_bytes_total, zero_bytes_total) = (
        shared.data_bytes.load(Ordering::SeqCst),
        shared.hole_bytes.load(Ordering::SeqCst),
        shared.zero_bytes.load(Ordering::SeqCst),
    );
    let digest = match &opts.hash {
        Some(h) => Some(h.finish(total).map_err(CopyError::Setup)?),
        None => None,
    };
    Ok(CopyReport {
        digest,
        socket,
        bytes: total,
        data_bytes: data_bytes_total,
        hole_bytes: hole_bytes_total,
        zero_bytes: zero_bytes_total,
        connections: workers,
    })
}

struct Slot {
    state: SlotState,
    item: Item,
    /// The data is still in the source file (sent with sendfile), not in the buffer.
    in_file: bool,
    /// Which blocks of the request (see [`zero_block_size`]) are all zeroes.
    zeros: u128,
    /// Requests sent to the destination for this slot and not yet answered.
    pending: u32,
    /// Counted (and hashed) already: stdout may visit a full slot several times.
    counted: bool,
}

/// One worker: keeps up to `requests` pieces moving from its source to its destination.
/// Returns its endpoints (for the final flush) and the bytes it wrote.
fn worker(mut src: Src, mut dst: Dst, sh: &Shared<'_>) -> (Src, Dst, u64) {
    let q = sh.opts.requests;
    let mut bufs: Vec<AlignedBuf> = (0..q).map(|_| AlignedBuf::default()).collect();
    let mut slots: Vec<Slot> = (0..q)
        .map(|_| Slot {
            state: SlotState::Free,
            item: Item { offset: 0, len: 0, kind: Kind::Data },
            in_file: false,
            zeros: 0,
            pending: 0,
            counted: false,
        })
        .collect();
    let mut no_more_work = false;
    let mut next_out = 0u64; // stdout writes in order
    let mut written = 0u64;
    let mut subs: Vec<(usize, u64, usize)> = Vec::new();
    let write_zeroes = matches!(&dst, Dst::Nbd(c) if c.has_flag(FLAG_SEND_WRITE_ZEROES));
    // File to plaintext NBD over a Unix socket: payloads go with sendfile. The hash needs
    // the bytes. Over TCP loopback sendfile measured slower than read + send (2.64 against
    // 2.89 GiB/s, BENCHMARKING.md), as it did for the server's reads.
    let send_file = sh.opts.send_file
        && sh.opts.hash.is_none()
        && matches!((&src, &dst), (Src::File(f), Dst::Nbd(c)) if c.can_send_file() && c.is_unix() && sendfile_works(f));
    loop {
        if sh.abort.load(Ordering::SeqCst) {
            break;
        }
        // 1. Start reading into free slots.
        subs.clear();
        if !no_more_work {
            for (i, slot) in slots.iter_mut().enumerate() {
                if slot.state != SlotState::Free {
                    continue;
                }
                let Some(mut item) = sh.queue.lock().unwrap_or_else(|e| e.into_inner()).next() else {
                    no_more_work = true;
                    break;
                };
                if item.kind == Kind::Data {
                    bufs[i].reserve(item.len);
                }
                slot.item = item;
                slot.counted = false;
                slot.in_file = false;
                slot.zeros = 0;
                if item.kind == Kind::Zero {
                    sh.hole_bytes.fetch_add(item.len as u64, Ordering::Relaxed);
                    slot.state = SlotState::Full;
                    continue;
                }
                match &mut src {
                    Src::Nbd(_) => {
                        subs.push((i, item.offset, item.len));
                        slot.state = SlotState::Reading;
                    }
                    Src::File(f) => {
                        // Small requests: one read costs less than a probe plus a sendfile.
                        let r = if send_file && item.len >= SENDFILE_MIN {
                            slot.in_file = true;
                            let zb = zero_block_size(sh.opts.zero_block, item.len);
                            let buf = &mut bufs[i][..item.len];
                            probe(f, buf, item.offset, zb, sh.opts.sparse).map(|z| slot.zeros = z)
                        } else {
                            f.read_exact_at(&mut bufs[i][..item.len], item.offset)
                        };
                        if let Err(e) = r {
                            sh.fail(CopyError::request("read", item.offset, item.len as u64, e));
                            return (src, dst, written);
                        }
                        slot.state = SlotState::Full;
                    }
                    Src::Backend(b) => {
                        if let Err(e) = b.read(&mut bufs[i][..item.len], item.offset) {
                            sh.fail(CopyError::request("read", item.offset, item.len as u64, e));
                            return (src, dst, written);
                        }
                        slot.state = SlotState::Full;
                    }
                    Src::Stdin(s) => {
                        let mut got = 0;
                        while got < item.len {
                            match s.read(&mut bufs[i][got..item.len]) {
                                Ok(0) => break,
                                Ok(n) => got += n,
                                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                                Err(e) => {
                                    sh.fail(CopyError::Local { what: "reading", path: "stdin".into(), source: e });
                                    return (src, dst, written);
                                }
                            }
                        }
                        if got < item.len {
                            let mut qg = sh.queue.lock().unwrap_or_else(|e| e.into_inner());
                            qg.stream_end = true;
                            no_more_work = true;
                        }
                        if got == 0 {
                            slot.state = SlotState::Free;
                            break;
                        }
                        item.len = got;
                        slot.item = item;
                        slot.state = SlotState::Full;
                        if no_more_work {
                            break;
                        }
                    }
                }
            }
        }
        if let (Src::Nbd(c), false) = (&mut src, subs.is_empty()) {
            let reqs: Vec<Submit<'_>> = subs
                .iter()
                .map(|&(slot, offset, len)| Submit {
                    cmd: CMD_READ,
                    flags: 0,
                    offset,
                    length: len as u64,
                    payload: None,
                    slot,
                })
                .collect();
            if let Err(e) = c.submit(&reqs) {
                sh.fail(CopyError::request("read", subs[0].1, subs[0].2 as u64, e));
                return (src, dst, written);
            }
        }
        // 2. Hand full slots to the destination.
        let mut wsubs: Vec<Submit<'_>> = Vec::new();
        loop {
            let mut progressed = false;
            for (i, slot) in slots.iter_mut().enumerate() {
                if slot.state != SlotState::Full {
                    continue;
                }
                let item = slot.item;
                let data = &bufs[i][..if item.kind == Kind::Data && !slot.in_file { item.len } else { 0 }];
                let zb = zero_block_size(sh.opts.zero_block, item.len);
                if !slot.counted {
                    slot.counted = true;
                    // Zero detection only where it changes what is written (`null:` discards
                    // anyway, and the hash finds zero blocks itself). Data sent from the file
                    // was probed when it was read.
                    if item.kind == Kind::Data && !slot.in_file && sh.opts.sparse && !matches!(dst, Dst::Null) {
                        slot.zeros = zero_blocks(data, zb);
                    }
                    if item.kind == Kind::Data {
                        for (a, b, zero) in runs(item.len, zb, slot.zeros) {
                            let counter = if zero { &sh.zero_bytes } else { &sh.data_bytes };
                            counter.fetch_add((b - a) as u64, Ordering::Relaxed);
                        }
                    }
                    if let Some(h) = &sh.opts.hash {
                        if item.kind == Kind::Zero || all_zero(item.len, zb, slot.zeros) {
                            h.add_zeroes(item.offset, item.len as u64);
                        } else {
                            h.add(item.offset, data);
                        }
                    }
                }
                let res: io::Result<()> = match &mut dst {
                    Dst::Null => Ok(()),
                    Dst::File { file, fresh, block } => {
                        pieces(item, zb, slot.zeros).try_for_each(|(a, b, zero)| match (zero, *fresh) {
                            (true, true) => Ok(()),
                            (true, false) => zero_file(file, *block, item.offset + a as u64, (b - a) as u64),
                            (false, _) => file.write_all_at(&data[a..b], item.offset + a as u64),
                        })
                    }
                    Dst::Backend(ep) => {
                        let (be, zeroed) = (&ep.backend, ep.zeroed);
                        let zero = be.caps().zero;
                        let mode = ZeroMode { may_trim: true, fast: false };
                        pieces(item, zb, slot.zeros).try_for_each(|(a, b, z)| {
                            let (at, len) = (item.offset + a as u64, (b - a) as u64);
                            match z {
                                false => be.write(&data[a..b], at, false),
                                true if zeroed => Ok(()),
                                true if zero => be.zero(at, len, mode, false),
                                true => zero_chunks(at, len).try_for_each(|(at, k)| be.write(&ZEROES[..k], at, false)),
                            }
                            .map_err(io::Error::other)
                        })
                    }
                    Dst::Stdout(o) => {
                        if item.offset != next_out {
                            continue;
                        }
                        next_out += item.len as u64;
                        if item.kind == Kind::Zero {
                            write_zeroes_to(o, item.len as u64)
                        } else {
                            o.write_all(data)
                        }
                    }
                    Dst::Nbd(_) => {
                        for (a, b, zero) in pieces(item, zb, slot.zeros) {
                            let (offset, len) = (item.offset + a as u64, b - a);
                            if zero && !write_zeroes {
                                // The server has no WRITE_ZEROES: zeroes go as data.
                                for (at, n) in zero_chunks(offset, len as u64) {
                                    let payload = Some(Payload::Bytes(&ZEROES[..n]));
                                    let length = n as u64;
                                    wsubs.push(Submit {
                                        cmd: CMD_WRITE,
                                        flags: 0,
                                        offset: at,
                                        length,
                                        payload,
                                        slot: i,
                                    });
                                    slot.pending += 1;
                                }
                                continue;
                            }
                            let (cmd, payload) = match &src {
                                _ if zero => (CMD_WRITE_ZEROES, None),
                                Src::File(f) if slot.in_file => {
                                    (CMD_WRITE, Some(Payload::File { fd: f.as_fd(), offset, len }))
                                }
                                _ => (CMD_WRITE, Some(Payload::Bytes(&data[a..b]))),
                            };
                            wsubs.push(Submit { cmd, flags: 0, offset, length: len as u64, payload, slot: i });
                            slot.pending += 1;
                        }
                        slot.state = SlotState::Writing;
                        continue;
                    }
                };
                if let Err(e) = res {
                    sh.fail(CopyError::request("write", item.offset, item.len as u64, e));
                    return (src, dst, written);
                }
                written += item.len as u64;
                sh.progress.done.fetch_add(item.len as u64, Ordering::Relaxed);
                slot.state = SlotState::Free;
                progressed = true;
            }
            // Stdout may have released the slot that unblocks the next in order.
            if !(progressed && matches!(dst, Dst::Stdout(_))) {
                break;
            }
        }
        if let (Dst::Nbd(c), false) = (&mut dst, wsubs.is_empty()) {
            if let Err(e) = c.submit(&wsubs) {
                // The batch's whole range: any of its requests may be the one that failed.
                let start = wsubs.iter().map(|w| w.offset).min().unwrap_or(0);
                let end = wsubs.iter().map(|w| w.offset + w.length).max().unwrap_or(0);
                sh.fail(CopyError::request("write", start, end - start, e));
                return (src, dst, written);
            }
        }
        drop(wsubs);
        // 3. Wait for the network.
        let reading = slots.iter().any(|s| s.state == SlotState::Reading);
        let writing = slots.iter().any(|s| s.state == SlotState::Writing);
        if !reading && !writing {
            if no_more_work && slots.iter().all(|s| s.state == SlotState::Free) {
                break;
            }
            if slots.iter().all(|s| s.state != SlotState::Free) || no_more_work {
                // Only Full slots waiting on ordered output: loop to flush them.
                if slots.iter().any(|s| s.state == SlotState::Full) {
                    continue;
                }
            }
            continue;
        }
        let (src_ready, dst_ready) = match wait(&src, reading, &dst, writing) {
            Ok(r) => r,
            Err(e) => {
                sh.fail(CopyError::Local { what: "poll", path: "sockets".into(), source: e });
                break;
            }
        };
        if src_ready {
            if let Src::Nbd(c) = &mut src {
                let r = drain_completions(c, &mut bufs, "read", |done| {
                    done.result.as_ref().map_err(|e| remote("read", &done, e))?;
                    slots[done.slot].state = SlotState::Full;
                    Ok(())
                });
                if let Err(e) = r {
                    sh.fail(e);
                    return (src, dst, written);
                }
            }
        }
        if dst_ready {
            if let Dst::Nbd(c) = &mut dst {
                let r = drain_completions(c, &mut [] as &mut [AlignedBuf], "write", |done| {
                    let op = if done.cmd == CMD_WRITE { "write" } else { "write zeroes" };
                    done.result.as_ref().map_err(|e| remote(op, &done, e))?;
                    written += done.length;
                    sh.progress.done.fetch_add(done.length, Ordering::Relaxed);
                    let slot = &mut slots[done.slot];
                    slot.pending -= 1;
                    if slot.pending == 0 {
                        slot.state = SlotState::Free;
                    }
                    Ok(())
                });
                if let Err(e) = r {
                    sh.fail(e);
                    return (src, dst, written);
                }
            }
        }
    }
    (src, dst, written)
}

/// The source's file system can feed sendfile(2) (not all implement it): one byte is
/// sent into a pipe to find out, before any request depends on it.
fn sendfile_works(f: &File) -> bool {
    let Ok((_r, w)) = rustix::pipe::pipe() else { return false };
    rustix::fs::sendfile(&w, f, Some(&mut 0), 1).is_ok()
}

/// Requests shorter than this are read into their buffer even where sendfile could send them.
const SENDFILE_MIN: usize = 64 * 1024;

/// Bytes of a block [`probe`] reads to tell data from zeroes.
const PROBE: usize = 4096;

/// The zero detection block size for a request of `len` bytes: `zero_block`, or larger
/// so that a request has at most 128 blocks (one bit each in a `u128`).
fn zero_block_size(zero_block: usize, len: usize) -> usize {
    zero_block.max(len.div_ceil(128)).max(1)
}

/// Which `zb`-byte blocks of `data` are all zeroes (bit i: block i).
fn zero_blocks(data: &[u8], zb: usize) -> u128 {
    data.chunks(zb).enumerate().filter(|(_, c)| is_zero(c)).fold(0, |m, (i, _)| m | 1 << i)
}

/// Every block of a `len`-byte request is zero.
fn all_zero(len: usize, zb: usize, zeros: u128) -> bool {
    let n = len.div_ceil(zb);
    n > 0 && zeros.count_ones() as usize == n
}

/// The request's blocks as maximal runs of one kind: (start, end, all zeroes).
fn runs(len: usize, zb: usize, zeros: u128) -> impl Iterator<Item = (usize, usize, bool)> {
    assert!(len.div_ceil(zb) <= 128, "at most 128 blocks per request (see zero_block_size)");
    let mut a = 0;
    std::iter::from_fn(move || {
        if a >= len {
            return None;
        }
        let zero = zeros >> (a / zb) & 1 == 1;
        let mut b = a;
        while b < len && (zeros >> (b / zb) & 1 == 1) == zero {
            b = (b + zb).min(len);
        }
        let run = (a, b, zero);
        a = b;
        Some(run)
    })
}

/// What to write for an item: a hole is one run of zeroes, data its blocks' runs.
fn pieces(item: Item, zb: usize, zeros: u128) -> impl Iterator<Item = (usize, usize, bool)> {
    let zeros = if item.kind == Kind::Zero { u128::MAX } else { zeros };
    runs(item.len, zb, zeros)
}

/// Zero detection for data sent with sendfile: for each `zb`-byte block of `buf`'s range
/// at `offset`, reads the first [`PROBE`] bytes and, only if they are all zero, the rest.
/// Returns which blocks are all zeroes; the data itself stays in the file. Without
/// `sparse`, reads nothing.
fn probe(f: &File, buf: &mut [u8], offset: u64, zb: usize, sparse: bool) -> io::Result<u128> {
    let mut zeros = 0;
    if !sparse {
        return Ok(zeros);
    }
    for (i, block) in buf.chunks_mut(zb).enumerate() {
        let at = offset + (i * zb) as u64;
        let head = block.len().min(PROBE);
        f.read_exact_at(&mut block[..head], at)?;
        if !is_zero(&block[..head]) {
            continue;
        }
        f.read_exact_at(&mut block[head..], at + head as u64)?;
        if is_zero(block) {
            zeros |= 1 << i;
        }
    }
    Ok(zeros)
}

/// Receives every completion already at hand on `c` (at least one, blocking for it),
/// handing each to `f`; a socket error is reported as a failed `op`.
fn drain_completions<B: AsMut<[u8]>>(
    c: &mut Connection,
    bufs: &mut [B],
    op: &'static str,
    mut f: impl FnMut(Completion) -> Result<(), CopyError>,
) -> Result<(), CopyError> {
    loop {
        let done = c.receive_into(bufs).map_err(|e| CopyError::request(op, 0, 0, e))?;
        f(done)?;
        if c.in_flight() == 0 || !c.buffered() {
            return Ok(());
        }
    }
}

/// Blocks until the source (if reading) or destination (if writing) has a reply.
fn wait(src: &Src, reading: bool, dst: &Dst, writing: bool) -> io::Result<(bool, bool)> {
    let s = match src {
        Src::Nbd(c) if reading => Some(c),
        _ => None,
    };
    let d = match dst {
        Dst::Nbd(c) if writing => Some(c),
        _ => None,
    };
    // Bytes already buffered count as ready without a syscall.
    let sb = s.is_some_and(|c| c.buffered());
    let db = d.is_some_and(|c| c.buffered());
    if sb || db {
        return Ok((sb, db));
    }
    let mut fds = Vec::with_capacity(2);
    if let Some(c) = s {
        fds.push(PollFd::new(c, PollFlags::IN));
    }
    if let Some(c) = d {
        fds.push(PollFd::new(c, PollFlags::IN));
    }
    loop {
        match poll(&mut fds, None) {
            Ok(_) => break,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    let mut it = fds.iter();
    let sr = s.is_some() && !it.next().map(|f| f.revents().is_empty()).unwrap_or(true);
    let dr = d.is_some() && !it.next().map(|f| f.revents().is_empty()).unwrap_or(true);
    Ok((sr, dr))
}

static ZEROES: [u8; 1 << 20] = [0; 1 << 20];

/// `start..start + len` in pieces of at most `ZEROES.len()` bytes: (offset, length).
fn zero_chunks(start: u64, len: u64) -> impl Iterator<Item = (u64, usize)> {
    (start..start + len).step_by(ZEROES.len()).map(move |at| (at, (start + len - at).min(ZEROES.len() as u64) as usize))
}

fn write_zeroes_to(o: &mut impl Write, n: u64) -> io::Result<()> {
    zero_chunks(0, n).try_for_each(|(_, k)| o.write_all(&ZEROES[..k]))
}

/// Zeroes a range of an existing file or block device.
fn zero_file(f: &File, block: bool, offset: u64, len: u64) -> io::Result<()> {
    use rustix::fs::{fallocate, FallocateFlags};
    let flags = if block { FallocateFlags::ZERO_RANGE } else { FallocateFlags::PUNCH_HOLE } | FallocateFlags::KEEP_SIZE;
    if fallocate(f, flags, offset, len).is_ok() {
        return Ok(());
    }
    zero_chunks(offset, len).try_for_each(|(at, k)| f.write_all_at(&ZEROES[..k], at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_blocks_of_a_kind_and_cover_the_request() {
        let r: Vec<_> = runs(10, 3, 0b0110).collect();
        assert_eq!(r, vec![(0, 3, false), (3, 9, true), (9, 10, false)]);
        assert_eq!(runs(10, 3, 0).collect::<Vec<_>>(), vec![(0, 10, false)]);
        assert_eq!(runs(10, 3, 0b1111).collect::<Vec<_>>(), vec![(0, 10, true)]);
        assert!(all_zero(10, 3, 0b1111) && !all_zero(10, 3, 0b0111) && !all_zero(0, 3, 0));
        assert_eq!(zero_block_size(256 << 10, 1 << 20), 256 << 10);
        assert_eq!(zero_block_size(256 << 10, 64 << 20), 512 << 10);
        assert_eq!(zero_block_size(4096, 100), 4096);
    }

    #[test]
    fn zero_blocks_and_the_file_probe_agree() {
        let zb = 16 * 1024;
        let mut data = vec![0u8; 5 * zb + 100];
        data[10] = 1; // block 0: data in its probe
        data[zb + PROBE + 7] = 2; // block 1: data only after its probe
        data[4 * zb + 1] = 3; // block 4: data; blocks 2 and 3 zero
                              // block 5 (100 bytes) zero
        let want = 0b101100u128;
        assert_eq!(zero_blocks(&data, zb), want);
        let dir = std::env::temp_dir().join(format!("ferry-probe-{}", std::process::id()));
        std::fs::write(&dir, [vec![9u8; 1000], data.clone()].concat()).unwrap();
        let f = File::open(&dir).unwrap();
        let mut buf = vec![0xEEu8; data.len()];
        assert_eq!(probe(&f, &mut buf, 1000, zb, true).unwrap(), want);
        assert_eq!(probe(&f, &mut buf, 1000, zb, false).unwrap(), 0);
        assert!(sendfile_works(&f));
        assert!(!sendfile_works(&File::open(std::env::temp_dir()).unwrap()), "a directory cannot feed sendfile");
        std::fs::remove_file(&dir).unwrap();
    }
}
