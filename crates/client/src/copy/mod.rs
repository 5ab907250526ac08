//! The copy engine behind `ferry copy`: NBD, local files and block devices, streams
//! (stdin/stdout, FIFOs, character devices), `null:` and any [`ferry_backend::Backend`],
//! in any combination.
//!
//! Each kind of endpoint is one file behind one interface (`endpoint::Ops`: size, what
//! it can do, allocation map, batched reads and writes, flush), the way nbdcopy keeps
//! its per-endpoint operations apart: `nbd.rs`, `file.rs` (files and block devices),
//! `pipe.rs` (streams), `null.rs` and `backend.rs`. This file plans the copy and runs
//! the workers, which move buffers between two endpoints and know none of their kinds.
//!
//! The source's allocation map is read first (NBD block status, SEEK_DATA/SEEK_HOLE,
//! `Backend::extents`), so holes are never read. Data is cut into requests of
//! `request_size` bytes, handed out from a shared queue to `connections` workers; each
//! worker keeps `requests` of them in flight on its own openings of both ends, reading
//! into its own buffers and writing from the same buffers (no copy between source and
//! destination). With `sparse`, blocks of zeroes are not written as data: the
//! destination gets zero requests (WRITE_ZEROES, fallocate), or nothing at all when it
//! reads as zeroes already (a new file).
//!
//! Zero detection works on blocks of `zero_block` bytes (256 KiB) inside each request, so
//! requests can be large (1 MiB: fewer per-request costs on both sides) without writing
//! zero blocks as data: a request becomes a run of WRITEs and WRITE_ZEROES.
//!
//! From a source that offers its file (`endpoint::Ops::file`) to a destination that
//! takes file payloads (plaintext NBD over a Unix socket) the data does not pass through
//! user space at all: WRITE payloads go from the file's page cache to the socket with
//! sendfile(2). Zero detection then reads only each block's first `PROBE` bytes, and
//! the rest of a block only when those are all zero.

mod backend;
pub mod contexts;
mod endpoint;
mod file;
pub mod journal;
mod nbd;
mod null;
mod pipe;
pub mod ranges;
mod rate;
mod retry;
mod verify;

pub use backend::BackendEndpoint;
pub use rate::{RateLimit, MAX_RATE, MIN_RATE};
pub use retry::{RetryPolicy, DEFAULT_DELAY, DEFAULT_RETRIES, MAX_DELAY, MAX_RETRIES, MAX_TIMEOUT};
pub use verify::{first_difference, hash_range};

use crate::conn::{ConnectOptions, Error as ConnError};
use crate::uri::Uri;
use endpoint::{Data, Kind, Map, Ops, Read, Write};
use ferry_hash::BlockHasher;
use ferry_sock::AlignedBuf;
use rustix::event::{poll, PollFd, PollFlags};
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
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
    /// Any [`ferry_backend::Backend`] (a disk image format, a network store), opened by
    /// the caller.
    Backend(BackendEndpoint),
}

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

    /// Opens the endpoint as the copy's source. The one place that knows the kinds.
    fn open_source(&self, opts: &CopyOptions) -> Result<Box<dyn Ops>, CopyError> {
        Ok(match self {
            Endpoint::Nbd(u) => {
                // The context a selection reads is asked for with the others.
                let mut c = opts.connect.clone();
                if let Some(ctx) = opts.select_context.as_ref().filter(|x| !c.contexts.contains(x)) {
                    c.contexts.push(ctx.clone());
                }
                Box::new(nbd::open(u, &c, "source")?)
            }
            Endpoint::File(p) => file::open_source(p)?,
            Endpoint::Stdio => Box::new(pipe::stdin()),
            Endpoint::Null => return Err(CopyError::Setup("null: can only be a destination".into())),
            Endpoint::Backend(b) => Box::new(b.clone()),
        })
    }

    /// Opens the endpoint as the destination of a source of `src_size` bytes (a new file
    /// is made that size), then checks it can take the source: writable, large enough.
    /// Nothing is written before these checks.
    fn open_destination(
        &self,
        src_size: Option<u64>,
        opts: &CopyOptions,
        resumed: bool,
    ) -> Result<Box<dyn Ops>, CopyError> {
        let d: Box<dyn Ops> = match self {
            Endpoint::Nbd(u) => Box::new(nbd::open(u, &opts.connect, "destination")?),
            Endpoint::File(p) if resumed && std::fs::symlink_metadata(p).is_err() => {
                return Err(CopyError::Setup(format!(
                    "destination {} is gone, so the copy its resume journal records cannot be resumed; use \
                     --restart to copy from the beginning",
                    p.display()
                )))
            }
            Endpoint::File(p) => file::open_destination(p, src_size, opts.selective() || resumed || opts.existing)?,
            Endpoint::Stdio => Box::new(pipe::stdout()),
            Endpoint::Null => Box::new(null::Null),
            Endpoint::Backend(b) => Box::new(b.clone()),
        };
        if d.caps().read_only {
            return Err(CopyError::Setup(format!("destination {} is read-only", d.name())));
        }
        if let (Some(s), Some(dsize), true) = (src_size, d.size(), opts.selective()) {
            if dsize != s {
                return Err(CopyError::Setup(format!(
                    "destination {} is {dsize} bytes, the source {s}: a copy of selected ranges goes onto a copy \
                     of the same size; nothing was written",
                    d.name()
                )));
            }
        }
        if let (Some(s), Some(dsize)) = (src_size, d.size()) {
            if dsize < s {
                return Err(CopyError::Setup(format!(
                    "destination {} is {dsize} bytes, smaller than the {s}-byte source; nothing was written",
                    d.name()
                )));
            }
        }
        Ok(d)
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
    /// Copy only the ranges the source's metadata context of this name marks dirty
    /// ([`ferry_proto::consts::STATE_DIRTY`]), e.g. `qemu:dirty-bitmap:NAME`
    /// (`ferry copy --dirty-bitmap`). See [`CopyOptions::ranges`] for what that means.
    pub select_context: Option<String>,
    /// Copy only these ranges of the source: (offset, length), sorted, disjoint, inside
    /// the source (`ferry copy --extents-from`). The destination is touched nowhere else
    /// (it is never taken for zeroed: it holds the previous copy, or is an overlay); in
    /// the ranges, data is read and written, and what the source's allocation map says
    /// reads as zeroes is written as zeroes without being read.
    pub ranges: Option<Arc<Vec<(u64, u64)>>>,
    /// Retries of failed NBD requests and connections (none by default).
    pub retry: RetryPolicy,
    /// Most bytes of data read per second, over all connections (`--rate`); holes are free.
    pub rate: Option<u64>,
    /// `ferry copy --resume`: the journal of how much is written and flushed (see
    /// [`journal`]). A stored watermark W is resumed: the source below W is neither read
    /// nor written. While the copy runs, a worker flushes the destination and stores a
    /// new W every journal interval; the journal is removed once the copy is complete
    /// and flushed. Without it nothing is journalled.
    pub journal: Option<Arc<journal::Journal>>,
    /// Set from outside (a signal handler) to stop the copy: each worker checks it between
    /// batches, so what is in flight finishes and the copy fails with
    /// [`CopyError::Interrupted`] soon after (nothing is flushed, no journal watermark
    /// stored beyond the last one).
    pub cancel: Option<Arc<AtomicBool>>,
    /// `ferry copy -n` (qemu-img convert's -n): a file destination must exist and is
    /// written in place, never created, emptied or sized (what lies past the source's end
    /// stays); it is not taken for zeroed, so the source's holes are written as zeroes.
    pub existing: bool,
}

impl CopyOptions {
    /// [`CopyOptions::cancel`] is set.
    pub fn cancelled(&self) -> bool {
        self.cancel.as_ref().is_some_and(|c| c.load(Ordering::SeqCst))
    }

    /// Only selected ranges are copied ([`CopyOptions::select_context`],
    /// [`CopyOptions::ranges`]).
    pub fn selective(&self) -> bool {
        self.select_context.is_some() || self.ranges.is_some()
    }
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
            select_context: None,
            ranges: None,
            retry: RetryPolicy::default(),
            rate: None,
            journal: None,
            cancel: None,
            existing: false,
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
    /// The connection to an NBD endpoint failed as a whole (the server broke the
    /// protocol or went away): no single request is to blame.
    #[error("{what} {name}: {error}")]
    Peer { what: &'static str, name: String, error: ConnError },
    /// `cause`: a backend's error, kept so that the caller can tell what failed (a
    /// repository's damage has an exit status of its own); `message` is its text.
    #[error("{op} at offset {offset} ({length} bytes) failed: {message}")]
    Request {
        op: &'static str,
        offset: u64,
        length: u64,
        message: String,
        #[source]
        cause: Option<Box<ferry_backend::Error>>,
    },
    /// An NBD server's error reply to one request (`errno`: the NBD error value).
    #[error("{op} at offset {offset} ({length} bytes) failed: {message}")]
    Remote { op: &'static str, offset: u64, length: u64, errno: u32, message: String },
    /// [`CopyOptions::cancel`] was set: the copy stopped before it was complete.
    #[error("stopped before the end (interrupted)")]
    Interrupted,
}

impl CopyError {
    /// A failed request (or local read/write) of `length` bytes at `offset`.
    fn request<E: std::fmt::Display + 'static>(op: &'static str, offset: u64, length: u64, e: E) -> CopyError {
        let message = e.to_string();
        let any: Box<dyn std::any::Any> = Box::new(e);
        CopyError::Request { op, offset, length, message, cause: any.downcast::<ferry_backend::Error>().ok() }
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
    /// With a selection ([`CopyOptions::select_context`], [`CopyOptions::ranges`]): the
    /// bytes selected (dirty, changed); `data_bytes` of them were copied as data, and
    /// `hole_bytes` + `zero_bytes` written as zeroes.
    pub selected_bytes: Option<u64>,
    /// Socket statistics summed over every NBD connection.
    pub socket: ferry_sock::Counters,
    /// Requests sent again and connections reopened after failures.
    pub retries: u64,
    /// Times the destination's connection was lost and reopened. Writes it acknowledged
    /// before that are only there if the server kept them (a restarted server that had
    /// them in its own memory did not).
    pub dst_reconnects: u64,
    /// Of those, the reconnects after which what the lost connection may have lost was
    /// not sent again: a copy without a journal does not know what was flushed, so it is
    /// proven only by reading back. A journalled copy (`--resume`) sends everything
    /// acknowledged since the last flush again (`dst_resent` bytes) and counts none here.
    pub dst_reconnects_unproven: u64,
    /// Bytes sent again after destination reconnects (see `dst_reconnects_unproven`).
    pub dst_resent: u64,
}

#[derive(Debug, Clone, Copy)]
struct Item {
    offset: u64,
    len: usize,
    kind: Kind,
    /// Handed out again after a destination reconnect (see [`Queue::rewind`]): counted
    /// and hashed the first time already.
    again: bool,
}

/// Hands out pieces of the source in order.
struct Queue {
    extents: Map,
    idx: usize,
    pos: u64,
    request_size: u64,
    zero_chunk: u64,
    /// Streaming source: hand out sequential data items until told to stop.
    streaming: bool,
    stream_end: bool,
    /// With a journal: the offsets of the items handed out and not yet finished at the
    /// destination, each with how many times it is out (an item handed out again after a
    /// rewind may still be finishing on a lost connection); the lowest is the watermark.
    pending: Option<std::collections::BTreeMap<u64, u32>>,
    /// The furthest `pos` has been: items below it were handed out before.
    high: u64,
}

/// Default of [`CopyOptions::zero_block`]: nbdcopy's request size, whose requests of
/// zeroes it skips.
pub const DEFAULT_ZERO_BLOCK: usize = 256 * 1024;

/// How often a copy waiting for replies looks at [`CopyOptions::cancel`].
const CANCEL_CHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// WRITE_ZEROES pieces stay well inside a 32-bit length.
const ZERO_CHUNK: u64 = 1 << 30;

impl Queue {
    fn next(&mut self) -> Option<Item> {
        if self.streaming {
            if self.stream_end {
                return None;
            }
            let it = Item { offset: self.pos, len: self.request_size as usize, kind: Kind::Data, again: false };
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
            let it = Item { offset: self.pos, len: n as usize, kind, again: self.pos < self.high };
            self.pos += n;
            self.high = self.high.max(self.pos);
            if let Some(p) = &mut self.pending {
                *p.entry(it.offset).or_insert(0) += 1;
            }
            return Some(it);
        }
        None
    }

    /// Every byte below this is finished at the destination: the lowest unfinished item,
    /// or where the next one starts, whichever is lower (after a rewind, items above
    /// `pos` may still be out).
    fn watermark(&self) -> u64 {
        let first = self.pending.as_ref().and_then(|p| p.keys().next().copied());
        first.map_or(self.pos, |f| f.min(self.pos))
    }

    /// An item handed out at `offset` is finished at the destination.
    fn finished(&mut self, offset: u64) {
        if let Some(p) = &mut self.pending {
            if let Some(n) = p.get_mut(&offset) {
                *n -= 1;
                if *n == 0 {
                    p.remove(&offset);
                }
            }
        }
    }

    /// Hands the source from `to` (an item boundary: a watermark) on out again: what
    /// the destination acknowledged above it may be lost.
    fn rewind(&mut self, to: u64) {
        if to < self.pos {
            self.high = self.high.max(self.pos);
            self.pos = to;
            self.idx = 0;
        }
    }
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
    /// Only selected ranges are copied: the destination is not taken for zeroed.
    selective: bool,
    data_bytes: AtomicU64,
    hole_bytes: AtomicU64,
    zero_bytes: AtomicU64,
    retries: AtomicU64,
    dst_reconnects: AtomicU64,
    rate: Option<rate::RateLimit>,
    /// A resumed copy's destination read as zeroes when its first run began.
    resumed_zeroed: bool,
    /// A worker is storing a journal watermark.
    checkpointing: AtomicBool,
    /// With a journal: the watermark of the last successful flush of the destination
    /// (every byte below it was acknowledged before that flush, so it is stable). A
    /// destination reconnect hands everything above it out again: the lost server may
    /// have acknowledged writes it never flushed.
    flushed: AtomicU64,
    /// Bytes handed out again after destination reconnects.
    resent: AtomicU64,
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

/// Rounds holes inward to whole hash blocks: a block that is partly data is read.
fn align_extents(extents: Map, bs: u64) -> Map {
    let end = extents.last().map_or(0, |e| e.0 + e.1);
    let mut out: Map = Vec::new();
    let push = |start: u64, stop: u64, kind: Kind, out: &mut Map| {
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

/// Checks a list of ranges against a source of `size` bytes: sorted, disjoint, none
/// empty, inside the source.
pub fn check_ranges(r: &[(u64, u64)], size: u64) -> Result<(), CopyError> {
    let mut end = 0u64;
    for (i, &(s, l)) in r.iter().enumerate() {
        let e = s.checked_add(l).filter(|&e| e <= size).ok_or_else(|| {
            CopyError::Setup(format!("range {i} ({l} bytes at offset {s}) goes past the end of the {size}-byte source"))
        })?;
        if l == 0 {
            return Err(CopyError::Setup(format!("range {i} (at offset {s}) is empty")));
        }
        if i > 0 && s < end {
            return Err(CopyError::Setup(format!(
                "range {i} (offset {s}) overlaps or comes before the one before it (which ends at {end}): \
                 ranges must be sorted and disjoint"
            )));
        }
        end = e;
    }
    Ok(())
}

/// Sleeps for `d`, or less if `stop()` turns true meanwhile (checked every 50 ms).
fn nap(d: std::time::Duration, stop: impl Fn() -> bool) {
    let end = std::time::Instant::now() + d;
    loop {
        let now = std::time::Instant::now();
        if now >= end || stop() {
            return;
        }
        std::thread::sleep((end - now).min(std::time::Duration::from_millis(50)));
    }
}

/// Copies `src` to `dst` without hashing on the way, then hashes the whole source with
/// `opts.hash` (if any) for the report's digest: for copies that skip part of the source
/// (a resumed copy), whose digest must still cover every byte.
pub fn copy_then_hash(
    src: &Endpoint,
    dst: &Endpoint,
    opts: &CopyOptions,
    progress: &Progress,
) -> Result<CopyReport, CopyError> {
    let inner = CopyOptions { hash: None, ..opts.clone() };
    let mut report = copy(src, dst, &inner, progress)?;
    if let Some(h) = &opts.hash {
        let fresh = BlockHasher::new(h.algorithm(), h.block_size());
        report.digest = Some(hash_range(src, report.bytes, &fresh, &inner)?);
    }
    Ok(report)
}

/// The ranges (offset, length; sorted, merged) of `src` that a copy with these options
/// selects by [`CopyOptions::select_context`]: for a caller that continues an interrupted
/// copy of them and passes what is left as [`CopyOptions::ranges`] (`ferry backup
/// --resume --dirty-bitmap`).
pub fn selected_ranges(src: &Endpoint, opts: &CopyOptions) -> Result<Vec<(u64, u64)>, CopyError> {
    let Some(ctx) = &opts.select_context else {
        return Err(CopyError::Setup("no metadata context to select ranges by".into()));
    };
    let mut s = src.open_source(opts)?;
    let Some(size) = s.size() else {
        return Err(CopyError::Setup("a stream cannot be copied in selected ranges: it has no offsets".into()));
    };
    let map = s.select(ctx, ferry_proto::consts::STATE_DIRTY, size)?;
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(map.len());
    for (off, len, _) in map {
        match out.last_mut() {
            Some(last) if last.0 + last.1 == off => last.1 += len,
            _ if len > 0 => out.push((off, len)),
            _ => {}
        }
    }
    Ok(out)
}

/// Copies `src` to `dst`.
pub fn copy(src: &Endpoint, dst: &Endpoint, opts: &CopyOptions, progress: &Progress) -> Result<CopyReport, CopyError> {
    if opts.request_size == 0 || opts.requests == 0 || opts.connections == 0 {
        return Err(CopyError::Setup("--connections, --requests and --request-size must be at least 1".into()));
    }
    let resumed = opts.journal.as_ref().and_then(|j| j.resumed());
    if let (Some(_), Some((w, _))) = (&opts.hash, resumed) {
        if w > 0 {
            // The source below the watermark is not read again, so its hash cannot be
            // computed on the way.
            return copy_then_hash(src, dst, opts, progress);
        }
    }
    let mut first_src = src.open_source(opts)?;
    let src_size = first_src.size();
    if let Some(j) = &opts.journal {
        if opts.selective() {
            return Err(CopyError::Setup(
                "--resume cannot be combined with --dirty-bitmap or --extents-from: run the incremental copy again \
                 without --resume (it rewrites only the selected ranges)"
                    .into(),
            ));
        }
        match src_size {
            None => {
                return Err(CopyError::Setup(format!(
                    "--resume needs a source with offsets: {} is a stream, which cannot be read from the middle",
                    first_src.name()
                )))
            }
            Some(s) if s != j.source_size() => {
                return Err(CopyError::Setup(format!(
                    "source {} is {s} bytes, but the resume journal {} was made for {} bytes; use --restart to copy \
                     from the beginning",
                    first_src.name(),
                    j.path().display(),
                    j.source_size()
                )))
            }
            Some(_) => {}
        }
    }
    // A resumed destination is opened as it is (never emptied again).
    let first_dst = dst.open_destination(src_size, opts, resumed.is_some())?;
    let (scaps, dcaps) = (first_src.caps(), first_dst.caps());
    if opts.journal.is_some() && (dcaps.in_order || scaps.in_order) {
        return Err(CopyError::Setup(format!(
            "--resume needs ends with offsets: {} is written (or {} read) in order, as a stream, and cannot be resumed",
            first_dst.name(),
            first_src.name()
        )));
    }
    let streaming = src_size.is_none();
    let src_size = src_size.unwrap_or(0);
    progress.total.store(src_size, Ordering::SeqCst);
    let selective = opts.selective();
    let (start, resumed_zeroed) = resumed.unwrap_or((0, false));
    if start > 0 {
        log::info!("resuming at offset {start} of {src_size}: the source below it is written and flushed");
    }
    progress.done.store(start, Ordering::SeqCst);
    if selective {
        if streaming {
            return Err(CopyError::Setup("a stream cannot be copied in selected ranges: it has no offsets".into()));
        }
        if opts.hash.is_some() {
            return Err(CopyError::Setup("a hash needs every byte of the source, not selected ranges".into()));
        }
        if opts.select_context.is_some() && opts.ranges.is_some() {
            return Err(CopyError::Setup("select ranges by a metadata context or by a list, not both".into()));
        }
    }
    let extents = if let Some(ctx) = &opts.select_context {
        first_src.select(ctx, ferry_proto::consts::STATE_DIRTY, src_size)?
    } else {
        let map = match opts.sparse && scaps.extents && !streaming {
            true => first_src.extents(src_size)?,
            false => vec![(0, src_size, Kind::Data)],
        };
        match &opts.ranges {
            Some(r) => {
                check_ranges(r, src_size)?;
                contexts::restrict(&map, r).map_err(CopyError::Setup)?
            }
            None => map,
        }
    };
    let selected_bytes = selective.then(|| extents.iter().map(|e| e.1).sum::<u64>());
    if let Some(n) = selected_bytes {
        progress.total.store(n, Ordering::SeqCst);
    }
    let mut request_size = opts.request_size as u64;
    let extents = match &opts.hash {
        Some(h) => {
            let bs = h.block_size() as u64;
            request_size = request_size.div_ceil(bs) * bs;
            align_extents(extents, bs)
        }
        None => extents,
    };
    let one = streaming || scaps.in_order || dcaps.in_order || !scaps.parallel || !dcaps.parallel;
    let workers = if one { 1 } else { opts.connections };
    let shared = Shared {
        queue: Mutex::new(Queue {
            extents,
            idx: 0,
            pos: start,
            request_size,
            zero_chunk: opts
                .hash
                .as_ref()
                .map_or(ZERO_CHUNK, |h| ZERO_CHUNK / h.block_size() as u64 * h.block_size() as u64)
                .max(request_size),
            streaming,
            stream_end: false,
            pending: opts.journal.as_ref().map(|_| Default::default()),
            high: start,
        }),
        abort: AtomicBool::new(false),
        error: Mutex::new(None),
        progress,
        opts,
        selective,
        data_bytes: AtomicU64::new(0),
        hole_bytes: AtomicU64::new(0),
        zero_bytes: AtomicU64::new(0),
        retries: AtomicU64::new(0),
        dst_reconnects: AtomicU64::new(0),
        rate: opts.rate.map(rate::RateLimit::new),
        resumed_zeroed,
        checkpointing: AtomicBool::new(false),
        flushed: AtomicU64::new(start),
        resent: AtomicU64::new(0),
    };
    if let (Some(j), None) = (&opts.journal, resumed) {
        // The first run: the destination is open (a new file emptied, a new image made),
        // nothing is written yet. From now on the copy can be resumed.
        j.store(0, write_caps(&shared, &*first_dst).zeroed, 0).map_err(|e| CopyError::Setup(e.to_string()))?;
    }
    // Worker 0 uses the endpoints opened above; the others open their own.
    let mut ends = Vec::with_capacity(workers);
    for _ in 1..workers {
        ends.push((first_src.reopen()?, first_dst.reopen()?));
    }
    ends.insert(0, (first_src, first_dst));
    let mut finished: Vec<Finished> = Vec::new();
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
    // Finish: flush once (FLUSH covers every connection of a multi-conn server), then
    // disconnect cleanly.
    let mut socket = ferry_sock::Counters::default();
    for (s, d, _) in &finished {
        for c in [s.socket_stats(), d.socket_stats()].into_iter().flatten() {
            socket.add(&c);
        }
    }
    if let Some(((_, d0, _), rest)) = finished.split_first_mut() {
        if streaming {
            d0.set_stream_length(written)?;
        }
        if opts.flush || opts.journal.is_some() {
            final_flush(d0, rest, opts)?;
        }
        if let Some(j) = &opts.journal {
            // Complete and flushed: nothing left to resume.
            j.finish().map_err(|e| CopyError::Setup(e.to_string()))?;
        }
    }
    for (s, d, _) in finished {
        d.close();
        s.close();
    }
    let total = if streaming { written } else { src_size };
    let digest = match &opts.hash {
        Some(h) => Some(h.finish(total).map_err(CopyError::Setup)?),
        None => None,
    };
    Ok(CopyReport {
        digest,
        selected_bytes,
        socket,
        bytes: total,
        data_bytes: shared.data_bytes.load(Ordering::SeqCst),
        hole_bytes: shared.hole_bytes.load(Ordering::SeqCst),
        zero_bytes: shared.zero_bytes.load(Ordering::SeqCst),
        connections: workers,
        retries: shared.retries.load(Ordering::SeqCst),
        dst_reconnects: shared.dst_reconnects.load(Ordering::SeqCst),
        dst_reconnects_unproven: match opts.journal {
            Some(_) => 0,
            None => shared.dst_reconnects.load(Ordering::SeqCst),
        },
        dst_resent: shared.resent.load(Ordering::SeqCst),
    })
}

/// The last flush of a copy, on the first worker's destination. A journalled copy whose
/// first connection was lost after its worker finished tries the others': one opened
/// after a reconnect reaches the server that holds everything (each reconnect sent again
/// what the lost server had not flushed).
fn final_flush(d0: &mut Box<dyn Ops>, rest: &mut [Finished], opts: &CopyOptions) -> Result<(), CopyError> {
    let e = match d0.flush() {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    if opts.journal.is_none()
        || opts.retry.retries == 0
        || retry::classify(&e, d0.reconnects()) != retry::Failure::Connection
    {
        return Err(e);
    }
    for (_, d, _) in rest {
        if d.flush().is_ok() {
            return Ok(());
        }
    }
    Err(e)
}

struct Slot {
    state: SlotState,
    item: Item,
    /// The data is still in the source file (sent with sendfile), not in the buffer.
    in_file: bool,
    /// Which blocks of the request (see [`zero_block_size`]) are all zeroes.
    zeros: u128,
    /// Bytes of the request the destination has not finished yet.
    remaining: u64,
    /// Counted (and hashed) already: an in-order destination may leave a full slot
    /// waiting for its turn.
    counted: bool,
    /// Retries of this slot's requests so far.
    attempts: u32,
}

/// A worker's own state beside its endpoints and buffers.
struct Worker<'s, 'a> {
    sh: &'s Shared<'a>,
    slots: Vec<Slot>,
    no_more_work: bool,
    /// Bytes finished at the destination.
    written: u64,
    /// Taking no new work until the slots are empty, to store a journal watermark.
    draining: bool,
}

impl Worker<'_, '_> {
    /// A read finished with `got` bytes; fewer than asked is the end of a stream.
    fn read_done(&mut self, i: usize, got: u64) {
        let slot = &mut self.slots[i];
        if got < slot.item.len as u64 {
            self.sh.queue.lock().unwrap_or_else(|e| e.into_inner()).stream_end = true;
            self.no_more_work = true;
            slot.item.len = got as usize;
        }
        slot.state = if got == 0 { SlotState::Free } else { SlotState::Full };
    }

    /// The destination finished `n` bytes of slot `i`'s request.
    fn write_done(&mut self, i: usize, n: u64) {
        self.written += n;
        self.sh.progress.done.fetch_add(n, Ordering::Relaxed);
        let slot = &mut self.slots[i];
        slot.remaining -= n;
        if slot.remaining == 0 {
            slot.state = SlotState::Free;
            if self.sh.opts.journal.is_some() {
                self.sh.queue.lock().unwrap_or_else(|e| e.into_inner()).finished(slot.item.offset);
            }
        }
    }

    /// Counts a full slot's bytes and hashes them, once; finds its zero blocks where that
    /// changes what is written.
    fn count(&mut self, i: usize, buf: &[u8], detect: bool) {
        let (sh, slot) = (self.sh, &mut self.slots[i]);
        if slot.counted {
            return;
        }
        slot.counted = true;
        let item = slot.item;
        let data = &buf[..if item.kind == Kind::Data && !slot.in_file { item.len } else { 0 }];
        let zb = zero_block_size(sh.opts.zero_block, item.len);
        // Data sent from the file was probed when it was read.
        if item.kind == Kind::Data && !slot.in_file && sh.opts.sparse && detect {
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
}

/// A worker's endpoints when it is done, and the bytes it wrote.
type Finished = (Box<dyn Ops>, Box<dyn Ops>, u64);

/// One worker: keeps up to `requests` pieces moving from its source to its destination.
/// Returns its endpoints (for the final flush) and the bytes it wrote.
fn worker(mut src: Box<dyn Ops>, mut dst: Box<dyn Ops>, sh: &Shared<'_>) -> Finished {
    let q = sh.opts.requests;
    let mut bufs: Vec<AlignedBuf> = (0..q).map(|_| AlignedBuf::default()).collect();
    let slot = Slot {
        state: SlotState::Free,
        item: Item { offset: 0, len: 0, kind: Kind::Data, again: false },
        in_file: false,
        zeros: 0,
        remaining: 0,
        counted: false,
        attempts: 0,
    };
    let mut w = Worker {
        sh,
        slots: (0..q).map(|_| Slot { ..slot }).collect(),
        no_more_work: false,
        written: 0,
        draining: false,
    };
    // Data stays in the source's file and goes with sendfile where the destination takes
    // file payloads. The hash needs the bytes.
    let send_file = sh.opts.send_file
        && sh.opts.hash.is_none()
        && dst.caps().file_payloads
        && src.file().is_some_and(sendfile_works);
    if let Err(e) = run(&mut w, &mut src, &mut dst, &mut bufs, send_file) {
        sh.fail(e);
    }
    (src, dst, w.written)
}

/// The worker's loop: read into free slots, write full ones, wait for replies.
fn run(
    w: &mut Worker<'_, '_>,
    src: &mut Box<dyn Ops>,
    dst: &mut Box<dyn Ops>,
    bufs: &mut [AlignedBuf],
    send_file: bool,
) -> Result<(), CopyError> {
    let sh = w.sh;
    let dcaps = write_caps(sh, &**dst);
    let mut next_out = 0u64; // where an in-order destination is
    let mut reads: Vec<Read> = Vec::new();
    loop {
        if sh.abort.load(Ordering::SeqCst) {
            return Ok(());
        }
        if sh.opts.cancelled() {
            return Err(CopyError::Interrupted);
        }
        // 0. A journal watermark due: one worker empties its slots (the others go on),
        // flushes and stores it.
        if let Some(j) = &sh.opts.journal {
            if !w.draining
                && j.due(sh.progress.done.load(Ordering::Relaxed))
                && !sh.checkpointing.swap(true, Ordering::SeqCst)
            {
                w.draining = true;
            }
            if w.draining && w.slots.iter().all(|s| s.state == SlotState::Free) {
                let r = checkpoint(sh, j, &mut **dst);
                w.draining = false;
                sh.checkpointing.store(false, Ordering::SeqCst);
                if let Err(e) = r {
                    // A flush on a lost connection: reconnect (which rewinds), and the
                    // next watermark is stored later.
                    recover(w, End::Dst, e, src, dst, bufs)?;
                }
            }
        }
        // 1. Start reading into free slots, one batch.
        reads.clear();
        for (i, slot) in w.slots.iter_mut().enumerate() {
            if w.no_more_work || w.draining || slot.state != SlotState::Free {
                continue;
            }
            let Some(item) = sh.queue.lock().unwrap_or_else(|e| e.into_inner()).next() else {
                w.no_more_work = true;
                break;
            };
            *slot = Slot {
                state: SlotState::Full,
                item,
                in_file: false,
                zeros: 0,
                remaining: 0,
                // Sent again after a destination reconnect: counted and hashed before.
                counted: item.again,
                attempts: 0,
            };
            if item.kind == Kind::Zero {
                if !item.again {
                    sh.hole_bytes.fetch_add(item.len as u64, Ordering::Relaxed);
                }
                continue;
            }
            if let Some(r) = &sh.rate {
                r.take(item.len as u64, || sh.opts.cancelled());
            }
            bufs[i].reserve(item.len);
            // Small requests: one read costs less than a probe plus a sendfile.
            match src.file() {
                Some(f) if send_file && item.len >= SENDFILE_MIN => {
                    slot.in_file = true;
                    let zb = zero_block_size(sh.opts.zero_block, item.len);
                    slot.zeros = probe(f, &mut bufs[i][..item.len], item.offset, zb, sh.opts.sparse)
                        .map_err(|e| CopyError::request("read", item.offset, item.len as u64, e))?;
                }
                _ => {
                    slot.state = SlotState::Reading;
                    reads.push(Read { slot: i, offset: item.offset, len: item.len });
                }
            }
        }
        if let Err(e) = src.read(&reads, bufs, &mut |i, got| w.read_done(i, got)) {
            recover(w, End::Src, e, src, dst, bufs)?;
        }
        // 2. Hand full slots to the destination, one batch (in order where it must be).
        let mut order: Vec<usize> = Vec::new();
        if dcaps.in_order {
            while let Some(i) = w.slots.iter().position(|s| s.state == SlotState::Full && s.item.offset == next_out) {
                next_out += w.slots[i].item.len as u64;
                w.slots[i].state = SlotState::Writing;
                order.push(i);
            }
        } else {
            for (i, s) in w.slots.iter_mut().enumerate().filter(|(_, s)| s.state == SlotState::Full) {
                s.state = SlotState::Writing;
                order.push(i);
            }
        }
        let mut writes: Vec<Write<'_>> = Vec::new();
        let mut skipped: Vec<(usize, u64)> = Vec::new();
        for &i in &order {
            w.count(i, &bufs[i], !dcaps.discards);
            let slot = &mut w.slots[i];
            slot.remaining = slot.item.len as u64;
            slot_writes(i, slot, bufs, src.file(), dcaps, sh.opts.zero_block, &mut writes, &mut skipped);
        }
        for (i, n) in skipped {
            w.write_done(i, n);
        }
        let sent = dst.write(&writes, &mut |i, n| w.write_done(i, n));
        drop(writes);
        if let Err(e) = sent {
            recover(w, End::Dst, e, src, dst, bufs)?;
        }
        // 3. Wait for replies.
        let reading = w.slots.iter().any(|s| s.state == SlotState::Reading);
        let writing = w.slots.iter().any(|s| s.state == SlotState::Writing);
        if !reading && !writing {
            if w.no_more_work && w.slots.iter().all(|s| s.state == SlotState::Free) {
                return Ok(());
            }
            continue;
        }
        let cancel = sh.opts.cancel.as_deref();
        let (src_ready, dst_ready) = match wait(&**src, reading, &**dst, writing, sh.opts.retry.request_timeout, cancel)
        {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Err(CopyError::Interrupted),
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                // No reply in time: the connections waited on are dropped and reopened.
                let t = sh.opts.retry.request_timeout.unwrap_or_default();
                for (end, busy) in [(End::Src, reading), (End::Dst, writing)] {
                    let ops = if end == End::Src { &**src } else { &**dst };
                    if busy && ops.poll_fd().is_some() {
                        let error = crate::conn::Error::Io(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("no reply within the request timeout ({} s)", t.as_secs_f64()),
                        ));
                        let e = CopyError::Peer { what: end.what(), name: ops.name(), error };
                        recover(w, end, e, src, dst, bufs)?;
                    }
                }
                continue;
            }
            Err(e) => return Err(CopyError::Local { what: "poll", path: "sockets".into(), source: e }),
        };
        if src_ready {
            if let Err(e) = src.complete(bufs, &mut |i, got| w.read_done(i, got)) {
                recover(w, End::Src, e, src, dst, bufs)?;
            }
        }
        if dst_ready {
            if let Err(e) = dst.complete(bufs, &mut |i, n| w.write_done(i, n)) {
                recover(w, End::Dst, e, src, dst, bufs)?;
            }
        }
    }
}

/// Stores a journal watermark: every item below it is finished (its writes replied to,
/// on whichever connection), so one flush here covers them (NBD multi-conn: a FLUSH
/// covers the writes every connection had replied to; a file's fsync covers every
/// opening of it), and then the watermark is stored.
///
/// A watermark is stored only after a flush on a connection that is still up: the
/// writes below it were acknowledged by the server that flushed them, or, acknowledged by
/// a server lost since, handed out again (see [`rewind`]) and not finished yet, so that
/// the watermark stays below them.
fn checkpoint(sh: &Shared<'_>, j: &journal::Journal, dst: &mut dyn Ops) -> Result<(), CopyError> {
    let done = sh.progress.done.load(Ordering::Relaxed);
    let w = sh.queue.lock().unwrap_or_else(|e| e.into_inner()).watermark();
    dst.flush()?;
    sh.flushed.fetch_max(w, Ordering::SeqCst);
    j.store(w, write_caps(sh, dst).zeroed, done).map_err(|e| CopyError::Setup(e.to_string()))
}

/// After a destination reconnect of a journalled copy: the lost server may have
/// acknowledged writes it never flushed (a write-back cache, a server that keeps them in
/// memory), so everything above the last flushed watermark is handed out again, and the
/// watermark cannot pass it until it is written again. The worker takes work again even
/// if it had run out.
fn rewind(w: &mut Worker<'_, '_>) {
    let sh = w.sh;
    if sh.opts.journal.is_none() {
        return;
    }
    let to = sh.flushed.load(Ordering::SeqCst);
    let mut q = sh.queue.lock().unwrap_or_else(|e| e.into_inner());
    if to < q.pos {
        log::warn!(
            "destination reconnected: sending {}..{} again, which the lost connection acknowledged after the last \
             flush",
            to,
            q.pos
        );
        sh.resent.fetch_add(q.pos - to, Ordering::Relaxed);
        q.rewind(to);
        w.no_more_work = false;
    }
}

/// Appends the writes of slot `i`'s item to `writes` (data, zeroes, or file payloads),
/// and to `skipped` the bytes a zeroed destination needs no write for.
#[allow(clippy::too_many_arguments)]
fn slot_writes<'b>(
    i: usize,
    slot: &Slot,
    bufs: &'b [AlignedBuf],
    file: Option<&'b File>,
    dcaps: endpoint::Caps,
    zero_block: usize,
    writes: &mut Vec<Write<'b>>,
    skipped: &mut Vec<(usize, u64)>,
) {
    let item = slot.item;
    let zb = zero_block_size(zero_block, item.len);
    for (a, b, zero) in pieces(item, zb, slot.zeros) {
        let (offset, len) = (item.offset + a as u64, b - a);
        let data = match (zero, file) {
            (true, _) if dcaps.zeroed => {
                skipped.push((i, len as u64));
                continue;
            }
            (true, _) if dcaps.zero => Data::Zero(len as u64),
            (true, _) => {
                // Zeroes as data, from a static page of them.
                for (at, n) in zero_chunks(offset, len as u64) {
                    writes.push(Write { slot: i, offset: at, data: Data::Bytes(&ZEROES[..n]) });
                }
                continue;
            }
            (false, Some(f)) if slot.in_file => Data::File { fd: f.as_fd(), len },
            (false, _) => Data::Bytes(&bufs[i][a..b]),
        };
        writes.push(Write { slot: i, offset, data });
    }
}

/// Which end of a worker failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Src,
    Dst,
}

impl End {
    fn what(self) -> &'static str {
        if self == End::Src {
            "source"
        } else {
            "destination"
        }
    }
}

/// Deals with a failure `e` of the worker's end `end` under `--retries`: sends one
/// failed request again, or reopens a lost connection and sends again everything that
/// was in flight on it. Returns the error when it is permanent or the retries are spent.
/// The destination's capabilities as writes use them, first sends and retries alike:
/// outside the selected ranges of a selective copy the destination holds anything, so it
/// is never taken for zeroed.
fn write_caps(sh: &Shared<'_>, dst: &dyn Ops) -> endpoint::Caps {
    let mut caps = dst.caps();
    caps.zeroed = (caps.zeroed || sh.resumed_zeroed) && !sh.selective;
    caps
}

fn recover(
    w: &mut Worker<'_, '_>,
    end: End,
    e: CopyError,
    src: &mut Box<dyn Ops>,
    dst: &mut Box<dyn Ops>,
    bufs: &mut [AlignedBuf],
) -> Result<(), CopyError> {
    let sh = w.sh;
    let policy = sh.opts.retry;
    if sh.opts.cancelled() {
        return Err(CopyError::Interrupted);
    }
    if policy.retries == 0 || sh.abort.load(Ordering::SeqCst) {
        return Err(e);
    }
    let ops: &dyn Ops = if end == End::Src { &**src } else { &**dst };
    match retry::classify(&e, ops.reconnects()) {
        retry::Failure::Permanent => Err(e),
        retry::Failure::Request { offset } => {
            let found = w.slots.iter().position(|s| {
                let (a, b) = (s.item.offset, s.item.offset + s.item.len as u64);
                match end {
                    End::Src => s.state == SlotState::Reading && a == offset,
                    End::Dst => s.state == SlotState::Writing && a <= offset && offset < b,
                }
            });
            let Some(i) = found else { return Err(e) };
            w.slots[i].attempts += 1;
            let attempt = w.slots[i].attempts;
            if attempt > policy.retries {
                return Err(gave_up(e, policy.retries));
            }
            log::warn!("{} retry {attempt} of {}: {e}", end.what(), policy.retries);
            sh.retries.fetch_add(1, Ordering::Relaxed);
            nap(policy.backoff(attempt), || sh.opts.cancelled());
            let r = match end {
                End::Src => {
                    let item = w.slots[i].item;
                    src.read(&[Read { slot: i, offset, len: item.len }], bufs, &mut |i, got| w.read_done(i, got))
                }
                End::Dst => {
                    let (mut writes, mut skipped) = (Vec::new(), Vec::new());
                    slot_writes(
                        i,
                        &w.slots[i],
                        bufs,
                        src.file(),
                        write_caps(sh, &**dst),
                        sh.opts.zero_block,
                        &mut writes,
                        &mut skipped,
                    );
                    writes.retain(|x| x.offset == offset);
                    dst.write(&writes, &mut |i, n| w.write_done(i, n))
                }
            };
            match r {
                Ok(()) => Ok(()),
                Err(e) => recover(w, end, e, src, dst, bufs),
            }
        }
        retry::Failure::Connection => {
            // Every request in flight on the connection counts an attempt, so a server
            // that fails each connection after a while still ends the copy.
            let busy = if end == End::Src { SlotState::Reading } else { SlotState::Writing };
            let (mut most, mut lo, mut hi) = (0, u64::MAX, 0);
            for s in w.slots.iter_mut().filter(|s| s.state == busy) {
                s.attempts += 1;
                most = most.max(s.attempts);
                lo = lo.min(s.item.offset);
                hi = hi.max(s.item.offset + s.item.len as u64);
            }
            let inflight = match lo < hi {
                true => format!("; in flight: {lo}..{hi} ({} bytes at most)", hi - lo),
                false => String::new(),
            };
            if most > policy.retries {
                return Err(gave_up(e, policy.retries));
            }
            let mut last = None;
            let mut reconnects = 0;
            let fresh = loop {
                reconnects += 1;
                if reconnects > policy.retries {
                    let why = last.map_or(String::new(), |l: CopyError| format!("; reopening it failed: {l}"));
                    return Err(CopyError::Setup(format!("{e}{why} (after {} retries)", policy.retries)));
                }
                let what = last.as_ref().unwrap_or(&e);
                log::warn!(
                    "{} reconnecting, attempt {} of {}: {what}{inflight}",
                    end.what(),
                    reconnects,
                    policy.retries
                );
                sh.retries.fetch_add(1, Ordering::Relaxed);
                nap(policy.backoff(reconnects), || sh.opts.cancelled());
                let old: &dyn Ops = if end == End::Src { &**src } else { &**dst };
                match old.reopen() {
                    Ok(o) => break o,
                    Err(e2) if retry::classify(&e2, true) == retry::Failure::Connection => last = Some(e2),
                    Err(e2) => return Err(e2),
                }
            };
            if end == End::Dst {
                sh.dst_reconnects.fetch_add(1, Ordering::Relaxed);
                rewind(w);
            }
            let old = if end == End::Src { std::mem::replace(src, fresh) } else { std::mem::replace(dst, fresh) };
            drop(old);
            // Everything in flight on the lost connection goes again.
            let r = match end {
                End::Src => {
                    let reads: Vec<Read> = w
                        .slots
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| s.state == SlotState::Reading)
                        .map(|(i, s)| Read { slot: i, offset: s.item.offset, len: s.item.len })
                        .collect();
                    src.read(&reads, bufs, &mut |i, got| w.read_done(i, got))
                }
                End::Dst => {
                    let (mut writes, mut skipped) = (Vec::new(), Vec::new());
                    let dcaps = write_caps(sh, &**dst);
                    for i in 0..w.slots.len() {
                        if w.slots[i].state != SlotState::Writing {
                            continue;
                        }
                        // Written again in full: what was counted as done is not.
                        let slot = &mut w.slots[i];
                        let done = slot.item.len as u64 - slot.remaining;
                        slot.remaining = slot.item.len as u64;
                        w.written -= done;
                        sh.progress.done.fetch_sub(done, Ordering::Relaxed);
                        slot_writes(
                            i,
                            &w.slots[i],
                            bufs,
                            src.file(),
                            dcaps,
                            sh.opts.zero_block,
                            &mut writes,
                            &mut skipped,
                        );
                    }
                    for (i, n) in skipped {
                        w.write_done(i, n);
                    }
                    dst.write(&writes, &mut |i, n| w.write_done(i, n))
                }
            };
            match r {
                Ok(()) => Ok(()),
                Err(e) => recover(w, end, e, src, dst, bufs),
            }
        }
    }
}

/// The error that ended a copy after `retries` retries.
fn gave_up(e: CopyError, retries: u32) -> CopyError {
    match e {
        CopyError::Remote { op, offset, length, errno, message } => {
            CopyError::Remote { op, offset, length, errno, message: format!("{message} (after {retries} retries)") }
        }
        CopyError::Request { op, offset, length, message, cause } => {
            CopyError::Request { op, offset, length, message: format!("{message} (after {retries} retries)"), cause }
        }
        e => CopyError::Setup(format!("{e} (after {retries} retries)")),
    }
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

static ZEROES: [u8; 1 << 20] = [0; 1 << 20];

/// `start..start + len` in pieces of at most `ZEROES.len()` bytes: (offset, length).
fn zero_chunks(start: u64, len: u64) -> impl Iterator<Item = (u64, usize)> {
    (start..start + len).step_by(ZEROES.len()).map(move |at| (at, (start + len - at).min(ZEROES.len() as u64) as usize))
}

/// Blocks until the source (if reading) or destination (if writing) has a reply.
fn wait(
    src: &dyn Ops,
    reading: bool,
    dst: &dyn Ops,
    writing: bool,
    timeout: Option<std::time::Duration>,
    cancel: Option<&AtomicBool>,
) -> io::Result<(bool, bool)> {
    let s = if reading { src.poll_fd().map(|fd| (fd, src.buffered())) } else { None };
    let d = if writing { dst.poll_fd().map(|fd| (fd, dst.buffered())) } else { None };
    // Replies already buffered count as ready without a syscall.
    let sb = s.is_some_and(|s| s.1);
    let db = d.is_some_and(|d| d.1);
    if sb || db {
        return Ok((sb, db));
    }
    let ends = [s, d];
    let mut fds: Vec<PollFd<'_>> = ends.iter().flatten().map(|(fd, _)| PollFd::new(fd, PollFlags::IN)).collect();
    let deadline = timeout.map(|t| std::time::Instant::now() + t);
    // With a cancel flag, the wait is cut into slices so that a stop is seen while the
    // replies are slow (the signal that sets it interrupts one thread's poll at most).
    let slice = cancel.map(|_| CANCEL_CHECK);
    let cancelled = || cancel.is_some_and(|c| c.load(Ordering::SeqCst));
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
        let wait = match (left, slice) {
            (Some(l), Some(s)) => Some(l.min(s)),
            (l, s) => l.or(s),
        };
        let ts = wait.map(|l| rustix::event::Timespec { tv_sec: l.as_secs() as i64, tv_nsec: l.subsec_nanos() as i64 });
        match poll(&mut fds, ts.as_ref()) {
            Ok(0) if fds.is_empty() => break,
            Ok(0) if left.is_some_and(|l| l.is_zero() || Some(l) == wait) => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "no reply in time"))
            }
            Ok(0) | Err(rustix::io::Errno::INTR) if cancelled() => {
                return Err(io::Error::new(io::ErrorKind::Interrupted, "stopped"))
            }
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => break,
            Err(e) => return Err(e.into()),
        }
    }
    let mut it = fds.iter();
    let sr = s.is_some() && !it.next().map(|f| f.revents().is_empty()).unwrap_or(true);
    let dr = d.is_some() && !it.next().map(|f| f.revents().is_empty()).unwrap_or(true);
    Ok((sr, dr))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
    fn a_resumed_copy_skips_the_source_below_the_watermark() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst, j) = (dir.path().join("src"), dir.path().join("dst"), dir.path().join("dst.ferry-resume"));
        let size = 8usize << 20;
        let data: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8 + 1).collect();
        std::fs::write(&src, &data).unwrap();
        // What a first run left: 0xAA stands for what it wrote below the watermark.
        std::fs::write(&dst, vec![0xAAu8; size]).unwrap();
        let key = journal::Record {
            ferry_version: "t".into(),
            source: "s".into(),
            destination: "d".into(),
            options: "o".into(),
            source_size: size as u64,
            watermark: 0,
            destination_zeroed: false,
        };
        let w = 3u64 << 20;
        journal::store(&j, &journal::Record { watermark: w, ..key.clone() }).unwrap();
        let jn = journal::Journal::open(j.clone(), key.clone(), false).unwrap().interval(1, Duration::from_millis(1));
        assert_eq!(jn.resumed(), Some((w, false)));
        let opts = CopyOptions { connections: 2, requests: 2, journal: Some(Arc::new(jn)), ..Default::default() };
        let progress = Progress::default();
        copy(&Endpoint::File(src.clone()), &Endpoint::File(dst.clone()), &opts, &progress).unwrap();
        let got = std::fs::read(&dst).unwrap();
        assert!(got[..w as usize].iter().all(|&b| b == 0xAA), "the part below the watermark was written again");
        assert!(got[w as usize..] == data[w as usize..], "the part above the watermark was not copied");
        assert!(!j.exists(), "the journal outlived the copy");
        // A first run (no journal stored) with a store after every byte: same result.
        let jn = journal::Journal::open(j.clone(), key, false).unwrap().interval(1, Duration::from_millis(1));
        assert_eq!(jn.resumed(), None);
        let opts = CopyOptions { journal: Some(Arc::new(jn)), request_size: 64 << 10, ..opts };
        copy(&Endpoint::File(src), &Endpoint::File(dst.clone()), &opts, &Progress::default()).unwrap();
        assert!(std::fs::read(&dst).unwrap() == data);
        assert!(!j.exists());
    }

    #[test]
    fn a_rewound_queue_hands_out_again_and_its_watermark_waits_for_it() {
        let mut q = Queue {
            extents: vec![(0, 4 << 20, Kind::Data), (4 << 20, 4 << 20, Kind::Zero)],
            idx: 0,
            pos: 0,
            request_size: 1 << 20,
            zero_chunk: 1 << 30,
            streaming: false,
            stream_end: false,
            pending: Some(Default::default()),
            high: 0,
        };
        let first: Vec<Item> = (0..3).map(|_| q.next().unwrap()).collect();
        assert!(first.iter().all(|i| !i.again));
        q.finished(0);
        q.finished(1 << 20);
        assert_eq!(q.watermark(), 2 << 20);
        // A destination reconnect: what was flushed ends at 1 MiB.
        q.rewind(1 << 20);
        assert_eq!(q.watermark(), 1 << 20, "the watermark may not pass what goes again");
        let again = q.next().unwrap();
        assert_eq!((again.offset, again.again), (1 << 20, true));
        let dup = q.next().unwrap();
        assert_eq!((dup.offset, dup.again), (2 << 20, true), "the item still out is handed out again too");
        // The lost connection's late reply for the first hand-out of 2 MiB does not
        // finish its second.
        q.finished(1 << 20);
        q.finished(2 << 20);
        assert_eq!(q.watermark(), 2 << 20);
        q.finished(2 << 20);
        assert_eq!(q.watermark(), 3 << 20);
        let fresh = q.next().unwrap();
        assert_eq!((fresh.offset, fresh.again), (3 << 20, false));
        let zero = q.next().unwrap();
        assert_eq!((zero.offset, zero.kind, zero.again), (4 << 20, Kind::Zero, false));
        assert!(q.next().is_none());
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
