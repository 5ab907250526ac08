//! Backends: where an export's bytes live.
//!
//! A backend declares what it can do ([`Capabilities`]) and implements the operations;
//! the server derives the transmission flags from the declaration, validates every
//! request once, and only then calls the backend. A backend never sees an offset
//! outside `0..size()` or a flag it did not declare. Filters (such as [`ReadOnly`])
//! wrap a backend and are backends themselves.
//!
//! Besides the protocol crate, OS bindings, logging and errors it uses **percent-encoding**, to
//! read `rbd:` option names as the RBD parser does when hiding a key ([`redact_rbd`]).
//!
//! # Safety: locks
//!
//! `ferry_backend::lock`: one module for every local image file. An opening
//! names its role (`ImageUse`: `Write`, `Export`, `Source`, `Backing`, `Inspect`,
//! `Destination`, plus `force_share`) and the kind of file (`raw()`, `qcow2()`,
//! `data_file()`), which gives the permission bytes held and not shared, as measured on
//! qemu 10 (table in `lock.rs`). Like qemu it takes every lock as an OFD read lock first,
//! then tests with `F_OFD_GETLK` for a conflicting holder, so of two programs opening at
//! once at least one sees the other. Locks live on the open file description, so they
//! last exactly as long as the file is open and a second opening in the same process
//! conflicts too. A conflict names the holder from `/proc/*/fdinfo` (OFD locks report
//! pid -1). `FileBackend::open_with`, `FileStore::open` (qcow2 files, backing files, data
//! files) and `Qcow2::create` lock; `Qcow2::open_files()` lists (device, inode, writable) of
//! every file an image keeps open, which `ferry serve` (one file, one writer across
//! exports) and `ferry copy` (`copy_guard.rs`: no destination that is the source, its
//! backing chain, or its own export) compare.
//!
//! # What this crate owns
//!
//! `Backend` trait: `caps()` declares what the backend can do, operations get validated
//! ranges only; `memory`, `file`, `null`, `pattern`; the `ReadOnly`, `IgnoreDiscard` and
//! `GuessedRaw` filters; `lock` (qemu's image locks: see "Safety: where it lives" below);
//! spec parsing (`memory:1G`); two hooks for layers above files: `file_offset` (where a
//! guest range lies in the file, so a format's data clusters go out with sendfile) and
//! `io_queue` (READs and WRITEs kept in flight per connection and answered as each
//! completes, for stores such as RBD that complete them in parallel)
//!
//! `unsafe`: forbidden.
#![forbid(unsafe_code)]

mod file;
pub mod lock;
mod memory;
mod null;
mod pattern;
mod spec;

pub use ferry_proto::reply::Extent;
pub use ferry_proto::Capabilities;
pub use file::FileBackend;
pub use lock::{Access, FileId, Holder, ImageUse, LockError, Locking, OpenFile};
pub use memory::MemoryBackend;
pub use null::NullBackend;
pub use pattern::PatternBackend;
pub use spec::{open, parse_size, redact_rbd, SpecError};

use ferry_proto::consts::{NbdError, STATE_HOLE, STATE_ZERO};
use std::io;
use std::sync::Arc;

/// What went wrong, in the terms a client can be told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The storage failed; the request failed, the connection is fine.
    Io,
    /// No space left (or quota, or file too big).
    NoSpace,
    /// The operation cannot be done fast (FAST_ZERO) or at all.
    NotSupported,
    /// The export is read-only.
    ReadOnly,
    /// The request makes no sense for this backend.
    Invalid,
}

/// A backend error with the context needed to act on it: operation, range, cause.
#[derive(Debug, thiserror::Error)]
#[error("{op} of {length} bytes at offset {offset} failed: {}", match .source { Some(e) => e.to_string(), None => format!("{:?}", .kind) })]
pub struct Error {
    pub kind: ErrorKind,
    pub op: &'static str,
    pub offset: u64,
    pub length: u64,
    #[source]
    pub source: Option<io::Error>,
}

impl Error {
    pub fn new(kind: ErrorKind, op: &'static str, offset: u64, length: u64) -> Self {
        Error { kind, op, offset, length, source: None }
    }

    /// Wraps an OS error, classifying it by errno.
    pub fn io(op: &'static str, offset: u64, length: u64, e: io::Error) -> Self {
        let kind = match e.raw_os_error() {
            Some(libc_enospc) if libc_enospc == rustix::io::Errno::NOSPC.raw_os_error() => ErrorKind::NoSpace,
            Some(c) if c == rustix::io::Errno::DQUOT.raw_os_error() || c == rustix::io::Errno::FBIG.raw_os_error() => {
                ErrorKind::NoSpace
            }
            Some(c) if c == rustix::io::Errno::ROFS.raw_os_error() || c == rustix::io::Errno::PERM.raw_os_error() => {
                ErrorKind::ReadOnly
            }
            Some(c) if c == rustix::io::Errno::OPNOTSUPP.raw_os_error() => ErrorKind::NotSupported,
            _ => ErrorKind::Io,
        };
        Error { kind, op, offset, length, source: Some(e) }
    }

    /// The NBD error value for this failure (proto.md "Error values").
    pub fn nbd_error(&self) -> NbdError {
        match self.kind {
            ErrorKind::Io => NbdError::Io,
            ErrorKind::NoSpace => NbdError::NoSpc,
            ErrorKind::NotSupported => NbdError::NotSup,
            ErrorKind::ReadOnly => NbdError::Perm,
            ErrorKind::Invalid => NbdError::Inval,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// How WRITE_ZEROES may be carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ZeroMode {
    /// The range may be deallocated (no `NBD_CMD_FLAG_NO_HOLE`).
    pub may_trim: bool,
    /// Fail with [`ErrorKind::NotSupported`] unless it is faster than writing zeroes.
    pub fast: bool,
}

/// Reads and writes in flight for one connection (see [`Backend::io_queue`]). Requests
/// complete in the order they were submitted; each buffer belongs to the queue from its
/// submission until [`IoQueue::complete`] hands it back, so no request can outlive the
/// memory it fills or sends. Dropping a queue waits for whatever is still in flight.
pub trait IoQueue: Send {
    /// Starts filling `buf` (all of it) with the bytes at `offset`, a range already
    /// validated against the size. A failure to start is reported by `complete`, in order.
    /// A queue may hold it until [`IoQueue::submitted`] or [`IoQueue::complete`] (a
    /// snapshot's gathers a run of reads to check several chunks at once): a caller that
    /// polls [`IoQueue::oldest_done`] calls `submitted` first.
    fn submit_read(&mut self, buf: Vec<u8>, offset: u64);
    /// Starts writing `buf` (all of it) at `offset`, a range already validated against
    /// the size; it is durable after a later FLUSH, as [`Backend::write`] without FUA.
    fn submit_write(&mut self, buf: Vec<u8>, offset: u64);
    /// Requests submitted and not yet handed back.
    fn len(&self) -> usize;
    /// No request is in flight.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The oldest request has finished: [`IoQueue::complete`] returns without waiting
    /// (a request held until [`IoQueue::submitted`] has not).
    fn oldest_done(&self) -> bool;
    /// Waits for the oldest request and hands back its buffer with its result (`None`
    /// when the queue is empty).
    fn complete(&mut self) -> Option<(Vec<u8>, Result<()>)>;
    /// The caller has submitted what it has for now (the requests of one receive): a
    /// queue that gathers requests to start several together starts those it holds. It
    /// also does so before [`IoQueue::complete`] waits.
    fn submitted(&mut self) {}
}

/// `inner` for reads, with each write answered in its turn by the error a read-only
/// backend's [`Backend::write`] gives: the queue of a read-only backend.
pub fn read_only_queue(inner: Box<dyn IoQueue>) -> Box<dyn IoQueue> {
    Box::new(ReadOnlyQueue { inner, order: std::collections::VecDeque::new() })
}

struct ReadOnlyQueue {
    inner: Box<dyn IoQueue>,
    /// Per request in flight, oldest first: `None` for one in `inner`, or a refused
    /// write's buffer and offset.
    order: std::collections::VecDeque<Option<(Vec<u8>, u64)>>,
}

impl IoQueue for ReadOnlyQueue {
    fn submit_read(&mut self, buf: Vec<u8>, offset: u64) {
        self.inner.submit_read(buf, offset);
        self.order.push_back(None);
    }
    fn submit_write(&mut self, buf: Vec<u8>, offset: u64) {
        self.order.push_back(Some((buf, offset)));
    }
    fn len(&self) -> usize {
        self.order.len()
    }
    fn oldest_done(&self) -> bool {
        match self.order.front() {
            Some(None) => self.inner.oldest_done(),
            Some(Some(_)) => true,
            None => false,
        }
    }
    fn submitted(&mut self) {
        self.inner.submitted();
    }
    fn complete(&mut self) -> Option<(Vec<u8>, Result<()>)> {
        match self.order.pop_front()? {
            None => self.inner.complete(),
            Some((buf, offset)) => {
                let len = buf.len() as u64;
                Some((buf, Err(Error::new(ErrorKind::ReadOnly, "write", offset, len))))
            }
        }
    }
}

/// An export's storage. Implementations must be safe to call from many connections at once.
pub trait Backend: Send + Sync {
    /// Short description for logs, e.g. `memory:1G`.
    fn describe(&self) -> String;
    /// Size in bytes.
    fn size(&self) -> u64;
    /// What this backend can do.
    fn caps(&self) -> Capabilities;
    /// Fills `buf` with the bytes at `offset`. On an error the contents of `buf` are
    /// unspecified: a caller never passes them on.
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()>;
    /// A queue that keeps many READs and WRITEs of one connection in flight at once, for
    /// backends whose requests each wait on the network and cost about as long together
    /// as one (RBD). The server submits every READ and WRITE (without FUA) it has received
    /// into it and answers each as soon as it completes. `None` (the default): the server
    /// calls the backend on the connection's thread, one request at a time (local storage).
    fn io_queue(&self) -> Option<Box<dyn IoQueue>> {
        None
    }
    /// Writes `buf` at `offset`; with `fua`, durably before returning. By default
    /// refused as read-only: a read-only backend (`caps().read_only`) needs no write path.
    fn write(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        Err(Error::new(ErrorKind::ReadOnly, "write", offset, buf.len() as u64))
    }
    /// Makes every completed write durable.
    fn flush(&self) -> Result<()>;
    /// Discards a range (advisory: contents become unspecified). Refused by default, as
    /// `write`.
    fn trim(&self, offset: u64, length: u64, _fua: bool) -> Result<()> {
        Err(Error::new(ErrorKind::ReadOnly, "trim", offset, length))
    }
    /// Makes a range read as zeroes. Refused by default, as `write`.
    fn zero(&self, offset: u64, length: u64, _mode: ZeroMode, _fua: bool) -> Result<()> {
        Err(Error::new(ErrorKind::ReadOnly, "zero", offset, length))
    }
    /// Appends `base:allocation` extents covering `offset..` (at least one, at most `max`,
    /// never past `offset + length`).
    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> Result<()> {
        let _ = max;
        out.push(Extent { length, flags: 0 });
        let _ = offset;
        Ok(())
    }
    /// Hints that a range will be read soon.
    fn cache(&self, _offset: u64, _length: u64) -> Result<()> {
        Ok(())
    }
    /// A file holding the export's bytes at the same offsets, when reads may be served
    /// straight from it with sendfile(2) instead of through a buffer.
    fn file_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }
    /// Where `offset..offset + length` of the export lies in the file of
    /// [`Backend::file_fd`], when it lies there in one piece: image formats map guest
    /// offsets to other file offsets. `None`: read this range through [`Backend::read`].
    /// Default: at the same offsets.
    fn file_offset(&self, offset: u64, _length: u64) -> Option<u64> {
        Some(offset)
    }
    /// Reads at least this long are checked for holes first, so holes go back as
    /// OFFSET_HOLE chunks instead of zero bytes. `None`: never worth checking.
    fn sparse_read_threshold(&self) -> Option<u64> {
        None
    }
    /// The metadata contexts this backend describes besides `base:allocation` (which
    /// [`Backend::extents`] answers and [`BaseAllocation`] wraps): a qcow2 image offers
    /// `qemu:allocation-depth` and a `qemu:dirty-bitmap:NAME` per consistent persistent
    /// bitmap. Default: none. Filters pass their inner backend's on.
    fn meta_contexts(self: Arc<Self>) -> Vec<Arc<dyn MetaContext>> {
        Vec::new()
    }
    /// What pins this backend's content for a resumed copy, without any secret: for a
    /// remote object the redacted URL, its size and its validator (strong ETag,
    /// Last-Modified, S3 version id). A resumed copy whose source gives another identity
    /// is refused. `None` (the default): the caller identifies the source otherwise (a
    /// local file by device, inode and mtime). Filters and formats pass their store's on.
    fn identity(&self) -> Option<String> {
        None
    }
}

/// One NBD metadata context (`base:allocation`, `qemu:dirty-bitmap:NAME`,
/// `qemu:allocation-depth`): a name and the extents it describes. The server offers
/// each context an export has, answers BLOCK_STATUS from every one a client selected,
/// and knows nothing of what a context means; a local copy reads them the same way.
pub trait MetaContext: Send + Sync {
    /// The full context name, e.g. `qemu:dirty-bitmap:b0`.
    fn name(&self) -> &str;
    /// Appends extents covering `offset..` (at least one, at most `max`, never past
    /// `offset + length`; the range is already validated against the size), each with
    /// this context's value in `flags` (base:allocation: HOLE/ZERO bits; a dirty bitmap:
    /// STATE_DIRTY; allocation depth: the depth).
    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> Result<()>;
}

/// `base:allocation` of any backend, as a [`MetaContext`].
pub struct BaseAllocation(pub Arc<dyn Backend>);

impl MetaContext for BaseAllocation {
    fn name(&self) -> &str {
        ferry_proto::consts::META_BASE_ALLOCATION
    }
    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> Result<()> {
        self.0.extents(offset, length, max, out)
    }
}

/// Every context of `backend`: `base:allocation` first, then the backend's own.
pub fn all_meta_contexts(backend: &Arc<dyn Backend>) -> Vec<Arc<dyn MetaContext>> {
    let mut v: Vec<Arc<dyn MetaContext>> = vec![Arc::new(BaseAllocation(backend.clone()))];
    v.extend(backend.clone().meta_contexts());
    v
}

/// An extent flagged as a hole that reads as zeroes.
pub const HOLE: u32 = STATE_HOLE | STATE_ZERO;
/// An extent holding data.
pub const DATA: u32 = 0;

/// Appends an extent, merging with the previous one when the flags match.
pub fn push_extent(out: &mut Vec<Extent>, length: u64, flags: u32) {
    if length == 0 {
        return;
    }
    if let Some(last) = out.last_mut() {
        if last.flags == flags {
            last.length += length;
            return;
        }
    }
    out.push(Extent { length, flags });
}

/// The methods a filter that changes no read passes to its inner backend (`self.0`)
/// unchanged: block status, cache hints and the sendfile hooks.
macro_rules! forward_reads {
    () => {
        fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> Result<()> {
            self.0.extents(offset, length, max, out)
        }
        fn cache(&self, offset: u64, length: u64) -> Result<()> {
            self.0.cache(offset, length)
        }
        fn sparse_read_threshold(&self) -> Option<u64> {
            self.0.sparse_read_threshold()
        }
        fn file_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
            self.0.file_fd()
        }
        fn file_offset(&self, offset: u64, length: u64) -> Option<u64> {
            self.0.file_offset(offset, length)
        }
        fn meta_contexts(self: Arc<Self>) -> Vec<Arc<dyn MetaContext>> {
            self.0.clone().meta_contexts()
        }
        fn identity(&self) -> Option<String> {
            self.0.identity()
        }
    };
}

/// A filter that makes any backend read-only.
pub struct ReadOnly(pub Arc<dyn Backend>);

impl Backend for ReadOnly {
    fn describe(&self) -> String {
        format!("{} (read-only)", self.0.describe())
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn caps(&self) -> Capabilities {
        Capabilities { read_only: true, trim: false, zero: false, fast_zero: false, ..self.0.caps() }
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.0.read(buf, offset)
    }
    /// The inner queue for reads; writes are refused in order, as [`Backend::write`] is.
    fn io_queue(&self) -> Option<Box<dyn IoQueue>> {
        Some(read_only_queue(self.0.io_queue()?))
    }
    fn write(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        Err(Error::new(ErrorKind::ReadOnly, "write", offset, buf.len() as u64))
    }
    fn flush(&self) -> Result<()> {
        self.0.flush()
    }
    fn trim(&self, offset: u64, length: u64, _fua: bool) -> Result<()> {
        Err(Error::new(ErrorKind::ReadOnly, "trim", offset, length))
    }
    fn zero(&self, offset: u64, length: u64, _mode: ZeroMode, _fua: bool) -> Result<()> {
        Err(Error::new(ErrorKind::ReadOnly, "zero", offset, length))
    }
    forward_reads!();
}

/// A filter that ignores discards, as qemu-nbd's `--discard=ignore`: TRIM succeeds and
/// does nothing, and WRITE_ZEROES never deallocates (as with `NBD_CMD_FLAG_NO_HOLE`).
pub struct IgnoreDiscard(pub Arc<dyn Backend>);

impl Backend for IgnoreDiscard {
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn caps(&self) -> Capabilities {
        self.0.caps()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.0.read(buf, offset)
    }
    fn io_queue(&self) -> Option<Box<dyn IoQueue>> {
        self.0.io_queue()
    }
    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.0.write(buf, offset, fua)
    }
    fn flush(&self) -> Result<()> {
        self.0.flush()
    }
    /// Advisory: doing nothing is a valid TRIM; with FUA, earlier writes are still made
    /// durable as the client asked.
    fn trim(&self, _offset: u64, _length: u64, fua: bool) -> Result<()> {
        match fua {
            true => self.0.flush(),
            false => Ok(()),
        }
    }
    fn zero(&self, offset: u64, length: u64, mode: ZeroMode, fua: bool) -> Result<()> {
        self.0.zero(offset, length, ZeroMode { may_trim: false, ..mode }, fua)
    }
    forward_reads!();
}

/// `length` bytes of another backend from `offset`, as a read-only backend of their own
/// (`ferry copy --offset/--length`: a byte range of a disk or snapshot). Any byte offset
/// and length: each read is the inner backend's read of the same bytes.
pub struct Window {
    inner: Arc<dyn Backend>,
    offset: u64,
    length: u64,
}

impl Window {
    /// The window, or why it does not fit in `inner`.
    pub fn new(inner: Arc<dyn Backend>, offset: u64, length: Option<u64>) -> std::result::Result<Window, String> {
        let size = inner.size();
        let length = length.unwrap_or(size.saturating_sub(offset));
        match offset.checked_add(length) {
            Some(end) if end <= size => Ok(Window { inner, offset, length }),
            _ => Err(format!(
                "the range of {length} bytes at offset {offset} is not inside {} ({size} bytes)",
                inner.describe()
            )),
        }
    }
}

impl Backend for Window {
    fn describe(&self) -> String {
        format!("{} (bytes {}..{})", self.inner.describe(), self.offset, self.offset + self.length)
    }
    fn size(&self) -> u64 {
        self.length
    }
    fn caps(&self) -> Capabilities {
        Capabilities { read_only: true, ..self.inner.caps() }
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner.read(buf, self.offset + offset)
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> Result<()> {
        self.inner.extents(self.offset + offset, length, max, out)
    }
    fn sparse_read_threshold(&self) -> Option<u64> {
        self.inner.sparse_read_threshold()
    }
    fn file_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.inner.file_fd()
    }
    fn file_offset(&self, offset: u64, length: u64) -> Option<u64> {
        self.inner.file_offset(self.offset + offset, length)
    }
}

/// A filter for a writable image whose raw format was guessed (no `raw:` named it): a
/// write that would make its first bytes look like another format to the next probe
/// (`ferry serve/copy/info PATH`, qemu) is refused with EPERM and logged, as qemu
/// restricts writes to block 0 of a "probed raw" image. Otherwise a guest could write a
/// qcow2 header naming any local file as its backing file into sector 0 of its disk, and
/// the next opening of the path would serve that file's bytes. Writes that leave the
/// first bytes raw (a partition table, a boot sector) pass.
///
/// Only requests reaching into the first `head` bytes are checked (the fast path costs
/// one comparison); such requests take turns, each checked against the bytes the one
/// before it left, so two partial writes cannot build a header between them. WRITE_ZEROES
/// and TRIM (whose range may read as zeroes after) are checked as writes of zeroes.
/// Requests are made on the connection's thread ([`Backend::io_queue`] is `None`).
pub struct GuessedRaw(Arc<dyn Backend>, Sector0);

struct Sector0 {
    /// The image in logs and errors (its path).
    name: String,
    /// What the probe takes the first bytes for, when not raw (a format name).
    probe: fn(&[u8]) -> Option<&'static str>,
    /// How many first bytes the probe looks at.
    head: u64,
    /// Checked requests take turns here.
    turn: std::sync::Mutex<()>,
    /// Requests refused so far: only the first few are logged as warnings.
    refused: std::sync::atomic::AtomicU64,
}

/// Refusals logged as warnings; later ones are logged at debug level.
const GUESSED_RAW_WARNINGS: u64 = 8;

impl GuessedRaw {
    /// Guards `inner` (the image `name`, for logs): `probe` says what format its first
    /// `head` bytes would be taken for, `None` for raw.
    pub fn new(inner: Arc<dyn Backend>, name: String, probe: fn(&[u8]) -> Option<&'static str>, head: u64) -> Self {
        let s = Sector0 { name, probe, head, turn: Default::default(), refused: Default::default() };
        GuessedRaw(inner, s)
    }

    /// Runs `op` (a request writing `data` at `offset`, `None`: zeroes) unless it would
    /// make the first bytes probe as another format. The caller checked `offset < head`.
    fn checked(
        &self,
        what: &'static str,
        offset: u64,
        length: u64,
        data: Option<&[u8]>,
        op: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let s = &self.1;
        let _turn = s.turn.lock().unwrap_or_else(|e| e.into_inner());
        let len = s.head.min(self.0.size()) as usize;
        let mut first = vec![0u8; len];
        let covered = offset == 0 && length >= len as u64;
        if !covered {
            self.0.read(&mut first, 0)?;
        }
        let end = offset.saturating_add(length).min(len as u64) as usize;
        let start = offset as usize;
        if start < end {
            match data {
                Some(d) => first[start..end].copy_from_slice(&d[..end - start]),
                None => first[start..end].fill(0),
            }
        }
        let Some(format) = (s.probe)(&first) else { return op() };
        let n = s.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let msg = format!(
            "{}: refused a {what} of {length} bytes at offset {offset}: it would make the image start like a \
             {format} image, and its raw format was only guessed (the next opening would take it for {format}); \
             serve it as raw:{} to allow such writes",
            s.name, s.name
        );
        match n {
            ..GUESSED_RAW_WARNINGS => log::warn!("{msg}"),
            GUESSED_RAW_WARNINGS => log::warn!("{msg} (further refusals are logged at debug level)"),
            _ => log::debug!("{msg}"),
        }
        let e = io::Error::new(io::ErrorKind::PermissionDenied, msg);
        Err(Error { kind: ErrorKind::ReadOnly, op: what, offset, length, source: Some(e) })
    }
}

impl Backend for GuessedRaw {
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn caps(&self) -> Capabilities {
        self.0.caps()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.0.read(buf, offset)
    }
    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        if offset >= self.1.head {
            return self.0.write(buf, offset, fua);
        }
        self.checked("write", offset, buf.len() as u64, Some(buf), || self.0.write(buf, offset, fua))
    }
    fn flush(&self) -> Result<()> {
        self.0.flush()
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        if offset >= self.1.head {
            return self.0.trim(offset, length, fua);
        }
        self.checked("trim", offset, length, None, || self.0.trim(offset, length, fua))
    }
    fn zero(&self, offset: u64, length: u64, mode: ZeroMode, fua: bool) -> Result<()> {
        if offset >= self.1.head {
            return self.0.zero(offset, length, mode, fua);
        }
        self.checked("zero", offset, length, None, || self.0.zero(offset, length, mode, fua))
    }
    forward_reads!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ignore_discard_keeps_data_and_never_lets_zero_deallocate() {
        struct Spy(MemoryBackend, std::sync::Mutex<Vec<bool>>);
        impl Backend for Spy {
            fn describe(&self) -> String {
                self.0.describe()
            }
            fn size(&self) -> u64 {
                self.0.size()
            }
            fn caps(&self) -> Capabilities {
                self.0.caps()
            }
            fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
                self.0.read(buf, offset)
            }
            fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
                self.0.write(buf, offset, fua)
            }
            fn flush(&self) -> Result<()> {
                self.0.flush()
            }
            fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
                self.0.trim(offset, length, fua)
            }
            fn zero(&self, offset: u64, length: u64, mode: ZeroMode, fua: bool) -> Result<()> {
                self.1.lock().unwrap().push(mode.may_trim);
                self.0.zero(offset, length, mode, fua)
            }
        }
        let spy = Arc::new(Spy(MemoryBackend::new(1 << 20), Default::default()));
        let b = IgnoreDiscard(spy.clone());
        b.write(&[7; 4096], 0, false).unwrap();
        b.trim(0, 1 << 20, true).unwrap();
        let mut buf = [0u8; 4096];
        b.read(&mut buf, 0).unwrap();
        assert_eq!(buf, [7; 4096]);
        b.zero(0, 4096, ZeroMode { may_trim: true, fast: false }, false).unwrap();
        b.read(&mut buf, 0).unwrap();
        assert_eq!(buf, [0; 4096]);
        assert_eq!(*spy.1.lock().unwrap(), [false]);
    }

    fn qcow2_probe(first: &[u8]) -> Option<&'static str> {
        first.starts_with(b"QFI\xfb").then_some("qcow2")
    }

    #[test]
    fn a_guessed_raw_image_takes_no_header_of_another_format() {
        let mem = Arc::new(MemoryBackend::new(1 << 20));
        let b = GuessedRaw::new(mem.clone(), "disk.img".into(), qcow2_probe, 4);
        let head = |mem: &MemoryBackend| {
            let mut h = [0u8; 4];
            mem.read(&mut h, 0).unwrap();
            h
        };
        // A whole header in one write: refused with EPERM, naming the image and raw:.
        let mut sector = vec![0u8; 512];
        sector[..8].copy_from_slice(b"QFI\xfb\0\0\0\x03");
        let e = b.write(&sector, 0, false).unwrap_err();
        assert_eq!((e.kind, e.nbd_error()), (ErrorKind::ReadOnly, NbdError::Perm));
        assert!(e.to_string().contains("raw:disk.img") && e.to_string().contains("qcow2"), "{e}");
        assert_eq!(head(&mem), [0; 4]);
        // A partition table in sector 0 passes.
        let mut mbr = vec![0u8; 512];
        mbr[..3].copy_from_slice(b"\xebZ\x90");
        mbr[510..].copy_from_slice(&[0x55, 0xaa]);
        b.write(&mbr, 0, false).unwrap();
        assert_eq!(head(&mem), [0xeb, b'Z', 0x90, 0]);
        // A header built from two writes: the second one is checked against the first.
        b.write(b"QFI", 0, false).unwrap();
        let e = b.write(b"\xfb", 3, false).unwrap_err();
        assert_eq!(e.kind, ErrorKind::ReadOnly);
        assert_eq!(head(&mem), *b"QFI\0");
        // ... and the other way round.
        b.write(b"x", 0, false).unwrap();
        mem.write(b"\xfb", 3, false).unwrap();
        assert!(b.write(b"QFI", 0, false).is_err());
        assert!(b.write(b"Q", 0, false).is_err());
        b.write(b"P", 0, false).unwrap();
        // Past the first bytes anything goes, zeroing and trimming the start too.
        b.write(&sector, 4096, false).unwrap();
        b.write(&sector[..8], 4, false).unwrap();
        b.zero(0, 4096, ZeroMode::default(), false).unwrap();
        b.trim(0, 4096, false).unwrap();
        assert_eq!(head(&mem), [0; 4]);
        // A probe that would take zeroes for a format refuses zeroing and trimming them in.
        mem.write(b"abcd", 0, false).unwrap();
        let zeroes = GuessedRaw::new(mem.clone(), "z".into(), |f| (f == [0; 4]).then_some("zeroes"), 4);
        assert!(zeroes.zero(0, 512, ZeroMode::default(), false).is_err());
        assert!(zeroes.trim(2, 2, false).is_ok(), "ab\\0\\0 is not all zeroes");
        assert!(zeroes.trim(0, 2, false).is_err());
        // An image shorter than the probe's head: nothing it can be written to probes.
        let tiny = GuessedRaw::new(Arc::new(MemoryBackend::new(3)), "t".into(), qcow2_probe, 4);
        tiny.write(b"QFI", 0, false).unwrap();
    }

    /// Reads of `fill`-valued bytes, completed at once, in order.
    struct Filled(std::collections::VecDeque<Vec<u8>>);

    impl IoQueue for Filled {
        fn submit_read(&mut self, mut buf: Vec<u8>, _: u64) {
            buf.fill(7);
            self.0.push_back(buf);
        }
        fn submit_write(&mut self, buf: Vec<u8>, _: u64) {
            self.0.push_back(buf);
        }
        fn len(&self) -> usize {
            self.0.len()
        }
        fn oldest_done(&self) -> bool {
            !self.0.is_empty()
        }
        fn complete(&mut self) -> Option<(Vec<u8>, Result<()>)> {
            self.0.pop_front().map(|b| (b, Ok(())))
        }
    }

    #[test]
    fn a_read_only_queue_refuses_writes_in_their_turn() {
        let mut q = read_only_queue(Box::new(Filled(Default::default())));
        q.submit_read(vec![0; 3], 0);
        q.submit_write(vec![1; 5], 4096);
        q.submit_read(vec![0; 2], 0);
        assert_eq!(q.len(), 3);
        let (b, r) = q.complete().unwrap();
        assert_eq!((b, r.is_ok()), (vec![7; 3], true));
        assert!(q.oldest_done());
        let (b, r) = q.complete().unwrap();
        assert_eq!(b, vec![1; 5], "the refused write's buffer comes back");
        assert_eq!(r.unwrap_err().kind, ErrorKind::ReadOnly);
        let (b, r) = q.complete().unwrap();
        assert_eq!((b, r.is_ok()), (vec![7; 2], true));
        assert!(q.complete().is_none() && q.is_empty());
    }
}
