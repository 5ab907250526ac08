//! The socket layer: listeners (TCP, Unix, systemd socket activation), streams with
//! tuned buffers, and vectored sends that never split a reply into extra syscalls.
//!
//! This is the one crate of ferry that may use `unsafe`, and every block says why it
//! is sound.
//!
//! # What this crate owns
//!
//! `Listener` (TCP, Unix, systemd `LISTEN_FDS`), `Stream` (buffer sizes, `send_all` =
//! writev of many slices, looping only on short writes; `send_zerocopy` = the same with
//! `MSG_ZEROCOPY`, with completions read from the error queue by
//! `reap_zerocopy`/`wait_zerocopy`), `AlignedBuf` (page-aligned buffers in their own
//! anonymous mappings: the server's receive buffer, reply arena and WRITE payloads, and the
//! copy engine's buffers)
//!
//! `unsafe`: only here, each block with a `// SAFETY:` comment.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod zerocopy;
pub use zerocopy::{zerocopy_supported, Reaped};

/// Send buffer set on Unix stream sockets unless overridden (seed 000: the default
/// ~200 KiB buffer limits a Unix socket to about a third of its throughput).
pub const DEFAULT_UNIX_SNDBUF: usize = 4 << 20;
/// Largest number of iovecs one sendmsg takes on Linux (`IOV_MAX`).
pub const IOV_MAX: usize = 1024;

/// Socket buffer settings, applied right after accept or connect.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BufferConfig {
    /// SO_SNDBUF in bytes; `None` leaves the kernel default (and TCP autotuning) alone.
    pub sndbuf: Option<usize>,
    /// SO_RCVBUF in bytes; `None` leaves the kernel default.
    pub rcvbuf: Option<usize>,
}

impl BufferConfig {
    /// The configuration for a Unix socket: a 4 MiB send buffer unless the environment
    /// variable `FERRY_SOCKET_SNDBUF` (bytes) or an explicit value says otherwise.
    pub fn for_unix(explicit: BufferConfig) -> BufferConfig {
        let env = std::env::var("FERRY_SOCKET_SNDBUF").ok().and_then(|v| v.trim().parse().ok());
        BufferConfig { sndbuf: explicit.sndbuf.or(env).or(Some(DEFAULT_UNIX_SNDBUF)), rcvbuf: explicit.rcvbuf }
    }
}

/// What a connection did on its socket, for `--stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// sendmsg/writev calls and the bytes and iovecs they carried.
    pub sends: u64,
    pub send_bytes: u64,
    pub iovecs: u64,
    /// sendfile calls and their bytes.
    pub sendfiles: u64,
    pub sendfile_bytes: u64,
    /// read calls, their bytes, and how many returned less than asked.
    pub recvs: u64,
    pub recv_bytes: u64,
    pub short_recvs: u64,
    /// Requests handled (counted by the protocol layer above).
    pub requests: u64,
    /// Of the sendmsg calls above, those made with MSG_ZEROCOPY, and their bytes.
    pub zc_sends: u64,
    pub zc_bytes: u64,
    /// Zero-copy sends the kernel reported it copied after all (SO_EE_CODE_ZEROCOPY_COPIED:
    /// always on loopback).
    pub zc_copied: u64,
    /// Zero-copy sends refused with ENOBUFS (then retried after reaping completions).
    pub zc_nobufs: u64,
}

impl Counters {
    pub fn add(&mut self, o: &Counters) {
        self.sends += o.sends;
        self.send_bytes += o.send_bytes;
        self.iovecs += o.iovecs;
        self.sendfiles += o.sendfiles;
        self.sendfile_bytes += o.sendfile_bytes;
        self.recvs += o.recvs;
        self.recv_bytes += o.recv_bytes;
        self.short_recvs += o.short_recvs;
        self.requests += o.requests;
        self.zc_sends += o.zc_sends;
        self.zc_bytes += o.zc_bytes;
        self.zc_copied += o.zc_copied;
        self.zc_nobufs += o.zc_nobufs;
    }
}

impl std::fmt::Display for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        write!(
            f,
            "{} requests; sent {} bytes in {} writev ({:.1} iovecs each) + {} bytes in {} sendfile; \
             received {} bytes in {} reads ({:.1}% short)",
            self.requests,
            self.send_bytes,
            self.sends,
            per(self.iovecs, self.sends),
            self.sendfile_bytes,
            self.sendfiles,
            self.recv_bytes,
            self.recvs,
            100.0 * per(self.short_recvs, self.recvs),
        )?;
        if self.zc_sends > 0 || self.zc_nobufs > 0 {
            write!(
                f,
                "; zero-copy: {} bytes in {} sendmsg, {} copied by the kernel, {} ENOBUFS",
                self.zc_bytes, self.zc_sends, self.zc_copied, self.zc_nobufs
            )?;
        }
        Ok(())
    }
}

#[derive(Debug)]
enum Inner {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// When a send that the peer does not let progress gives up (see
/// [`Stream::set_send_limit`]). The default never gives up.
#[derive(Debug, Clone, Default)]
pub struct SendLimit {
    /// Give up at this instant (a handshake's deadline).
    pub deadline: Option<Instant>,
    /// Give up once this flag (the server's "stop") has been seen set for this long.
    pub stop: Option<(Arc<AtomicBool>, Duration)>,
}

impl SendLimit {
    fn is_set(&self) -> bool {
        self.deadline.is_some() || self.stop.is_some()
    }
}

/// A connected stream socket, TCP or Unix, that counts what it does.
#[derive(Debug)]
pub struct Stream {
    inner: Inner,
    pub stats: Counters,
    /// Zero-copy completion tracking, once `SO_ZEROCOPY` is set.
    zc: Option<zerocopy::Tracker>,
    /// The send limit, if any, and when a send first saw its stop flag set (boxed: most
    /// streams have none, and the stream stays small).
    limit: Option<Box<(SendLimit, Option<Instant>)>>,
}

impl Stream {
    fn new(inner: Inner) -> Stream {
        Stream { inner, stats: Counters::default(), zc: None, limit: None }
    }

    /// Bounds every later send (`send_all`, `send_file`, `send_zerocopy`, the wait for
    /// zero-copy completions): a send the peer does not read fails with `TimedOut` once
    /// `limit` says so, instead of blocking for as long as the peer likes. The socket
    /// gets a send timeout of `tick` (`SO_SNDTIMEO`), so a blocked send looks at the
    /// limit at least that often; a send that progresses costs nothing more than one
    /// atomic load per call. `SendLimit::default()` removes the bound.
    pub fn set_send_limit(&mut self, limit: SendLimit, tick: Duration) -> io::Result<()> {
        let timeout = limit.is_set().then_some(tick.max(Duration::from_millis(1)));
        match &self.inner {
            Inner::Tcp(s) => s.set_write_timeout(timeout)?,
            Inner::Unix(s) => s.set_write_timeout(timeout)?,
        }
        self.limit = limit.is_set().then(|| Box::new((limit, None)));
        Ok(())
    }

    /// `Err(TimedOut)` once the send limit is reached; called before each send syscall
    /// and after each one the socket's send timeout interrupted.
    fn check_send_limit(&mut self) -> io::Result<()> {
        let Some(b) = self.limit.as_deref_mut() else { return Ok(()) };
        let (limit, stop_seen) = (&b.0, &mut b.1);
        if let Some(d) = limit.deadline {
            if Instant::now() >= d {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the peer did not read what was sent before the deadline",
                ));
            }
        }
        if let Some((flag, grace)) = &limit.stop {
            if flag.load(Ordering::Relaxed) {
                let seen = *stop_seen.get_or_insert_with(Instant::now);
                if seen.elapsed() >= *grace {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the server is stopping and the peer read nothing for the {grace:?} grace period"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// After a send failed with `e`: `Ok` to try again (it was interrupted, or the send
    /// timeout passed within the send limit), else the error to return.
    fn retry_send(&mut self, e: io::Error) -> io::Result<()> {
        match e.kind() {
            io::ErrorKind::Interrupted => Ok(()),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut if self.limit.is_some() => self.check_send_limit(),
            _ => Err(e),
        }
    }

    /// Connects to a Unix socket path.
    pub fn connect_unix(path: &Path) -> io::Result<Stream> {
        Ok(Stream::new(Inner::Unix(UnixStream::connect(path)?)))
    }

    /// Connects to a TCP address, with TCP_NODELAY.
    pub fn connect_tcp(addr: &SocketAddr) -> io::Result<Stream> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        Ok(Stream::new(Inner::Tcp(s)))
    }

    pub fn is_unix(&self) -> bool {
        matches!(self.inner, Inner::Unix(_))
    }

    /// Applies buffer sizes; returns the send buffer the kernel actually gave (it
    /// doubles the request and clips it at net.core.wmem_max).
    pub fn apply(&self, cfg: BufferConfig) -> io::Result<Option<usize>> {
        let sock = socket2::SockRef::from(self);
        if let Some(n) = cfg.rcvbuf {
            sock.set_recv_buffer_size(n)?;
        }
        if let Some(n) = cfg.sndbuf {
            sock.set_send_buffer_size(n)?;
            let got = sock.send_buffer_size()?;
            if got < n {
                log::debug!("asked for a {n}-byte send buffer, the kernel gave {got} (raise net.core.wmem_max)");
            }
            return Ok(Some(got));
        }
        Ok(None)
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match &self.inner {
            Inner::Tcp(s) => s.set_read_timeout(t),
            Inner::Unix(s) => s.set_read_timeout(t),
        }
    }

    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match &self.inner {
            Inner::Tcp(s) => s.shutdown(how),
            Inner::Unix(s) => s.shutdown(how),
        }
    }

    /// A second handle on the same socket (with its own counters).
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(Stream::new(match &self.inner {
            Inner::Tcp(s) => Inner::Tcp(s.try_clone()?),
            Inner::Unix(s) => Inner::Unix(s.try_clone()?),
        }))
    }

    /// A short description of the peer for logs.
    pub fn peer(&self) -> String {
        match &self.inner {
            Inner::Tcp(s) => s.peer_addr().map_or_else(|_| "tcp:?".into(), |a| a.to_string()),
            Inner::Unix(_) => "unix".into(),
        }
    }

    /// The peer's IP address (TCP only), for per-client limits.
    pub fn peer_ip(&self) -> Option<std::net::IpAddr> {
        match &self.inner {
            Inner::Tcp(s) => s.peer_addr().ok().map(|a| a.ip()),
            Inner::Unix(_) => None,
        }
    }

    /// Sends every byte of `bufs` in as few syscalls as possible: one writev per up to
    /// `IOV_MAX` slices, looping only on short writes. Returns the syscalls made.
    pub fn send_all(&mut self, mut bufs: &mut [IoSlice<'_>]) -> io::Result<u32> {
        let mut calls = 0;
        while !bufs.is_empty() {
            self.check_send_limit()?;
            let n = bufs.len().min(IOV_MAX);
            let written = match self.write_vectored(&bufs[..n]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(w) => w,
                Err(e) => {
                    self.retry_send(e)?;
                    continue;
                }
            };
            calls += 1;
            self.stats.iovecs += n as u64;
            IoSlice::advance_slices(&mut bufs, written);
        }
        Ok(calls)
    }
}

impl Stream {
    /// Sends `len` bytes of `file` from `offset` with sendfile(2): page-cache data goes to
    /// the socket without passing through user space. Returns the syscalls made.
    pub fn send_file(&mut self, file: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<u32> {
        self.send_file_counted(file, offset, len, &mut 0)
    }

    /// [`Stream::send_file`], adding the bytes sent to `sent` as they go: after an error
    /// (the file ended early, a read error, the socket), it says how much of the range
    /// the peer was sent.
    pub fn send_file_counted(
        &mut self,
        file: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        sent: &mut usize,
    ) -> io::Result<u32> {
        let mut off = offset;
        let mut left = len;
        let mut calls = 0;
        while left > 0 {
            self.check_send_limit()?;
            match rustix::fs::sendfile(&*self, file, Some(&mut off), left) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the file ended before the range being sent (was it truncated?)",
                    ))
                }
                Ok(n) => {
                    left -= n;
                    *sent += n;
                    self.stats.sendfile_bytes += n as u64;
                }
                Err(e) => self.retry_send(e.into())?,
            }
            calls += 1;
        }
        self.stats.sendfiles += u64::from(calls);
        Ok(calls)
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = match &mut self.inner {
            Inner::Tcp(s) => s.read(buf),
            Inner::Unix(s) => s.read(buf),
        }?;
        self.stats.recvs += 1;
        self.stats.recv_bytes += n as u64;
        if n < buf.len() {
            self.stats.short_recvs += 1;
        }
        Ok(n)
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let n = match &mut self.inner {
            Inner::Tcp(s) => s.write_vectored(bufs),
            Inner::Unix(s) => s.write_vectored(bufs),
        }?;
        self.stats.sends += 1;
        self.stats.send_bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match &self.inner {
            Inner::Tcp(s) => s.as_fd(),
            Inner::Unix(s) => s.as_fd(),
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        self.as_fd().as_raw_fd()
    }
}

/// A listening socket.
#[derive(Debug)]
pub enum Listener {
    Tcp(TcpListener),
    /// The path is removed when the listener is dropped, if ferry created it.
    Unix(UnixListener, Option<PathBuf>),
}

impl Listener {
    /// Listens on a Unix socket path, replacing a stale socket file left by a dead server.
    pub fn bind_unix(path: &Path) -> io::Result<Listener> {
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            use std::os::unix::fs::FileTypeExt;
            if meta.file_type().is_socket() && UnixStream::connect(path).is_err() {
                std::fs::remove_file(path)?;
            }
        }
        let l = UnixListener::bind(path)?;
        Ok(Listener::Unix(l, Some(path.to_owned())))
    }

    /// Listens on a TCP address.
    pub fn bind_tcp(addr: &SocketAddr) -> io::Result<Listener> {
        Ok(Listener::Tcp(TcpListener::bind(addr)?))
    }

    /// Accepts one connection. TCP streams get TCP_NODELAY: replies are already
    /// grouped into one send, so Nagle would only add latency.
    pub fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                s.set_nodelay(true)?;
                s.set_nonblocking(false)?;
                Ok(Stream::new(Inner::Tcp(s)))
            }
            Listener::Unix(l, _) => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(false)?;
                Ok(Stream::new(Inner::Unix(s)))
            }
        }
    }

    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Listener::Tcp(l) => l.set_nonblocking(on),
            Listener::Unix(l, _) => l.set_nonblocking(on),
        }
    }

    /// The TCP address, for `$uri` and `$port`.
    pub fn local_tcp_addr(&self) -> Option<SocketAddr> {
        match self {
            Listener::Tcp(l) => l.local_addr().ok(),
            Listener::Unix(..) => None,
        }
    }

    /// The Unix socket path, for `$uri` and `$unixsocket`.
    pub fn unix_path(&self) -> Option<PathBuf> {
        match self {
            Listener::Unix(l, _) => l.local_addr().ok().and_then(|a| a.as_pathname().map(Path::to_owned)),
            Listener::Tcp(_) => None,
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, Some(p)) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Tcp(l) => l.as_fd(),
            Listener::Unix(l, _) => l.as_fd(),
        }
    }
}

/// The first file descriptor systemd passes (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: RawFd = 3;

/// More sockets than any socket unit passes: a larger `LISTEN_FDS` is refused.
const MAX_LISTEN_FDS: RawFd = 4096;

/// Reads an integer `SOL_SOCKET` option of descriptor `fd`, which may be closed or not a
/// socket (then the error says so).
fn socket_option(fd: RawFd, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt only reads the descriptor number (EBADF or ENOTSOCK when it is
    // not an open socket) and writes at most `len` bytes to `value`, a live c_int, and
    // the length to `len`.
    let r = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, name, (&mut value as *mut libc::c_int).cast(), &mut len) };
    if r == 0 {
        Ok(value)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether `fd` is a listening stream socket; if not, what it is instead.
fn check_listening(fd: RawFd) -> Result<(), String> {
    match socket_option(fd, libc::SO_ACCEPTCONN) {
        Ok(0) => return Err("a socket that is not listening".into()),
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::EBADF) => return Err("not open".into()),
        Err(e) if e.raw_os_error() == Some(libc::ENOTSOCK) => return Err("not a socket".into()),
        Err(e) => return Err(format!("not usable as a listener ({e})")),
    }
    match socket_option(fd, libc::SO_TYPE) {
        Ok(libc::SOCK_STREAM) => Ok(()),
        Ok(t) => Err(format!("a listening socket of type {t}, not a stream socket")),
        Err(e) => Err(format!("not usable as a listener ({e})")),
    }
}

/// Listeners passed by systemd socket activation (`LISTEN_PID`, `LISTEN_FDS`), if this
/// process was started that way. The variables are removed so children do not see them.
/// Each descriptor must be a listening stream socket (`SO_ACCEPTCONN`), or none is taken
/// and the error names the first that is not: call this before opening any file, so a
/// count larger than what was passed cannot reach a descriptor of this process.
pub fn listen_fds() -> io::Result<Option<Vec<Listener>>> {
    let pid = std::env::var("LISTEN_PID").ok();
    let fds = std::env::var("LISTEN_FDS").ok();
    let (Some(pid), Some(fds)) = (pid, fds) else { return Ok(None) };
    if pid.trim().parse::<u32>().ok() != Some(std::process::id()) {
        return Ok(None);
    }
    let n: RawFd = fds
        .trim()
        .parse()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("LISTEN_FDS={fds:?} is not a number")))?;
    std::env::remove_var("LISTEN_PID");
    std::env::remove_var("LISTEN_FDS");
    std::env::remove_var("LISTEN_FDNAMES");
    if !(0..=MAX_LISTEN_FDS).contains(&n) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("LISTEN_FDS={n} is not a plausible number of sockets (0 to {MAX_LISTEN_FDS})"),
        ));
    }
    // Every descriptor is checked before any is taken: a count larger than what was
    // passed would otherwise make this process own (and later close) descriptors that
    // are something else, such as a file opened since.
    for fd in LISTEN_FDS_START..LISTEN_FDS_START + n {
        check_listening(fd).map_err(|why| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "LISTEN_FDS={n}, but descriptor {fd} is {why}; the service manager must pass \
                     exactly LISTEN_FDS listening stream sockets from descriptor 3 on"
                ),
            )
        })?;
    }
    let mut out = Vec::new();
    for fd in LISTEN_FDS_START..LISTEN_FDS_START + n {
        // SAFETY: under the socket-activation protocol the service manager hands this
        // process fds 3..3+LISTEN_FDS, open and owned by nobody else in it; LISTEN_PID
        // matched our pid, `check_listening` found each one a listening stream socket
        // (so not a descriptor this process opened itself: it opens no listeners before
        // this), and the variables were removed above so nothing else in the process
        // takes ownership of the same fds.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let sock = socket2::Socket::from(owned);
        let listener = match sock.local_addr()?.as_socket() {
            Some(_) => Listener::Tcp(TcpListener::from(OwnedFd::from(sock))),
            None => Listener::Unix(UnixListener::from(OwnedFd::from(sock)), None),
        };
        listener.set_nonblocking(false)?;
        out.push(listener);
    }
    Ok(Some(out))
}

/// A byte buffer in its own anonymous memory mapping: page-aligned, zeroed when made,
/// and given back to the kernel when dropped or replaced.
///
/// Page alignment: the kernel's copy out of a socket (whose payload pages start
/// page-aligned when the peer sends from a file) measured faster into an aligned
/// destination than into a heap block's usual 16-byte alignment, and the copy out of it
/// into the page cache too. Its own mapping: a connection that goes idle drops its
/// buffers, and they must leave the process then (thousands of idle connections, each
/// with up to 1.5 MiB of buffers), whatever glibc's allocator would do with a freed heap
/// block. The allocator's own tuning is left alone, so libraries that allocate large
/// buffers per request (librbd's messenger) keep glibc's adaptive reuse: fixing glibc's
/// mmap threshold instead cost librbd a page fault per 4 KiB of every read (BENCHMARKING).
#[derive(Debug)]
pub struct AlignedBuf {
    /// Start of the mapping (dangling when `cap` is 0).
    ptr: std::ptr::NonNull<u8>,
    /// Bytes mapped (a multiple of the page size).
    cap: usize,
    /// Bytes in use, at most `cap`.
    len: usize,
}

// SAFETY: the buffer owns its mapping exclusively (no other pointer to it escapes except
// through borrows of `self`), like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads, through `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl Default for AlignedBuf {
    fn default() -> Self {
        AlignedBuf { ptr: std::ptr::NonNull::dangling(), cap: 0, len: 0 }
    }
}

impl AlignedBuf {
    pub const ALIGN: usize = 4096;

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A zeroed buffer of `len` bytes.
    pub fn zeroed(len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::default();
        b.reserve(len);
        b
    }

    /// Makes the buffer at least `len` bytes long. When it has to grow, it is replaced
    /// by a zeroed one: the contents are not kept.
    pub fn reserve(&mut self, len: usize) {
        if self.len >= len {
            return;
        }
        if self.cap < len {
            *self = AlignedBuf::default();
            let cap = len.div_ceil(Self::ALIGN) * Self::ALIGN;
            // SAFETY: a new private anonymous mapping (no address hint, no file); the
            // result is checked before use.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    cap,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            let layout = std::alloc::Layout::from_size_align(cap, Self::ALIGN);
            match std::ptr::NonNull::new(p.cast::<u8>()) {
                Some(ptr) if p != libc::MAP_FAILED => self.ptr = ptr,
                _ => std::alloc::handle_alloc_error(layout.unwrap_or(std::alloc::Layout::new::<u8>())),
            }
            self.cap = cap;
        }
        // Bytes past the old length were zeroed when mapped or by `truncate`.
        self.len = len;
    }

    /// Makes the buffer `len` bytes long, keeping its contents (up to `len`); new bytes
    /// read as zero.
    pub fn resize(&mut self, len: usize) {
        if len <= self.len {
            self.truncate(len);
            return;
        }
        if len <= self.cap {
            self.len = len;
            return;
        }
        let mut bigger = AlignedBuf::zeroed(len.max(self.cap * 2));
        bigger.len = len;
        bigger[..self.len].copy_from_slice(self);
        *self = bigger;
    }

    /// Shortens the buffer to `len` bytes, zeroing the bytes dropped so that growing it
    /// again shows zeroes, as a new buffer would.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self[len..].fill(0);
            self.len = len;
        }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.cap > 0 {
            // SAFETY: `ptr..ptr+cap` is the mapping made in `reserve`, unmapped once here;
            // no borrow of it outlives `self`.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.cap) };
        }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len <= cap` initialized (zero-filled or written)
        // bytes, or dangling with `len == 0`, which a slice allows.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsMut<[u8]> for AlignedBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buffers_start_page_aligned_and_hold_their_length() {
        for len in [1, 4095, 4096, 1 << 20, (2 << 20) + 3] {
            let mut b = AlignedBuf::default();
            b.reserve(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % AlignedBuf::ALIGN, 0, "length {len}");
            b[len - 1] = 7;
            assert_eq!(b.iter().filter(|&&x| x != 0).count(), 1);
        }
        let mut b = AlignedBuf::default();
        b.reserve(100);
        b.reserve(10);
        assert_eq!(b.len(), 100, "a large enough buffer is kept");
    }

    #[test]
    fn aligned_buffers_resize_keeping_contents() {
        let mut b = AlignedBuf::zeroed(10);
        b.copy_from_slice(b"0123456789");
        b.resize(5000);
        assert_eq!(&b[..10], b"0123456789");
        assert!(b[10..].iter().all(|&x| x == 0));
        b.resize(3 << 20);
        assert_eq!(&b[..10], b"0123456789");
        assert_eq!(b.len(), 3 << 20);
        b.truncate(4);
        b.resize(8);
        assert_eq!(&b[..], b"0123\0\0\0\0", "truncated bytes read as zero again");
    }

    #[test]
    fn only_listening_stream_sockets_pass_as_activated_listeners() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert_eq!(check_listening(l.as_raw_fd()), Ok(()));
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        assert_eq!(check_listening(c.as_raw_fd()), Err("a socket that is not listening".into()));
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert_eq!(check_listening(f.as_raw_fd()), Err("not a socket".into()));
        assert_eq!(check_listening(999_999), Err("not open".into()));
        let u = std::os::unix::net::UnixDatagram::unbound().unwrap();
        assert!(check_listening(u.as_raw_fd()).is_err());
    }

    /// A peer that reads nothing: sends give up at the deadline, or once the stop flag
    /// has been set for the grace period; without a limit they would block for ever.
    #[test]
    fn sends_to_a_peer_that_never_reads_give_up_at_the_limit() {
        let (a, _peer) = UnixStream::pair().unwrap();
        let mut s = Stream::new(Inner::Unix(a));
        let big = vec![7u8; 1 << 20];
        let tick = Duration::from_millis(20);
        let t = Instant::now();
        let limit = SendLimit { deadline: Some(t + Duration::from_millis(200)), stop: None };
        s.set_send_limit(limit, tick).unwrap();
        let e = loop {
            if let Err(e) = s.send_all(&mut [IoSlice::new(&big)]) {
                break e;
            }
        };
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        let stop = Arc::new(AtomicBool::new(false));
        s.set_send_limit(SendLimit { deadline: None, stop: Some((stop.clone(), Duration::from_millis(200))) }, tick)
            .unwrap();
        // Not stopping: a blocked send keeps waiting.
        let flag = stop.clone();
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            flag.store(true, Ordering::SeqCst);
        });
        let t = Instant::now();
        let e = s.send_all(&mut [IoSlice::new(&big)]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(t.elapsed() >= Duration::from_millis(450), "gave up before stop + grace: {:?}", t.elapsed());
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        setter.join().unwrap();
    }

    #[test]
    fn unix_send_all_and_buffers() {
        let dir = std::env::temp_dir().join(format!("ferry-sock-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s");
        let l = Listener::bind_unix(&path).unwrap();
        let mut c = Stream::connect_unix(&path).unwrap();
        let mut s = l.accept().unwrap();
        let got = s.apply(BufferConfig::for_unix(BufferConfig::default())).unwrap();
        assert!(got.unwrap() > 0);
        let a = vec![1u8; 100_000];
        let b = vec![2u8; 3];
        let t = std::thread::spawn(move || {
            let mut v = vec![0u8; 100_003];
            c.read_exact(&mut v).unwrap();
            v
        });
        let mut io = [IoSlice::new(&a), IoSlice::new(&b)];
        s.send_all(&mut io).unwrap();
        let v = t.join().unwrap();
        assert_eq!(&v[..100_000], &a[..]);
        assert_eq!(&v[100_000..], &b[..]);
        drop(l);
        assert!(!path.exists());
    }
}
