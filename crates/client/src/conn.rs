//! One client connection: connect, handshake, submit requests, receive completions.

use crate::uri::{Transport, Uri, UriError};
use ferry_proto::client::{ClientConfig, ClientError, ClientHandshake, ClientNegotiated, ClientProgress};
use ferry_proto::consts::*;
use ferry_proto::reply::{
    parse_block_status, parse_error_chunk, Extent, ReadCoverage, ReplyError, ReplyHeader, ReplyMode,
};
use ferry_proto::request::RequestHeader;
use ferry_sock::{BufferConfig, Stream};
use ferry_tls::{ClientTls, TlsError, Transport as Channel};
use std::io::{self, IoSlice, Read};
use std::net::ToSocketAddrs;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

/// An error from the server for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteError {
    /// NBD error value (`NBD_EIO` = 5, ...).
    pub errno: u32,
    pub message: String,
    /// Offset the error applies to, when the server said.
    pub offset: Option<u64>,
}

impl std::fmt::Display for RemoteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.errno {
            1 => "EPERM",
            5 => "EIO",
            12 => "ENOMEM",
            22 => "EINVAL",
            28 => "ENOSPC",
            75 => "EOVERFLOW",
            95 => "ENOTSUP",
            108 => "ESHUTDOWN",
            _ => "error",
        };
        write!(f, "server replied {name} ({})", self.errno)?;
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

/// Why a connection failed. Wrapped errors are part of the message, not a `source()`,
/// so `{:#}` chains print each cause once.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Uri(UriError),
    #[error("cannot connect to {target}: {reason}")]
    Connect { target: String, reason: io::Error },
    #[error("socket error: {0}")]
    Io(io::Error),
    #[error("handshake: {0}")]
    Handshake(ClientError),
    #[error("the server closed the connection")]
    Closed,
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("{0}")]
    Reply(ReplyError),
    #[error("{0}")]
    Remote(RemoteError),
    #[error("TLS: {0}")]
    Tls(TlsError),
}

macro_rules! wrap {
    ($($from:ty => $variant:ident),*) => {$(
        impl From<$from> for Error {
            fn from(e: $from) -> Error {
                Error::$variant(e)
            }
        }
    )*};
}
wrap!(UriError => Uri, io::Error => Io, ClientError => Handshake, ReplyError => Reply, TlsError => Tls);

/// How to connect.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Ask for extended headers (64-bit requests and replies) when the server has them.
    pub extended: bool,
    /// Ask for structured replies.
    pub structured: bool,
    /// Ask for the metadata contexts in `contexts` (block status).
    pub meta_context: bool,
    /// The metadata contexts to select, by exact name (default: `base:allocation`); see
    /// [`Connection::contexts`] for which the server granted.
    pub contexts: Vec<String>,
    /// Socket buffers (default: 4 MiB send buffer on Unix sockets).
    pub buffers: BufferConfig,
    /// Give up on the handshake after this long.
    pub handshake_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            extended: true,
            structured: true,
            meta_context: true,
            contexts: vec![META_BASE_ALLOCATION.to_string()],
            buffers: BufferConfig::default(),
            handshake_timeout: Duration::from_secs(30),
        }
    }
}

/// A request to submit. `slot` is the caller's tag, returned in the completion; for READ
/// it also names the buffer (in the slice passed to [`Connection::receive`]) that
/// receives the data, starting at index 0.
#[derive(Debug, Clone, Copy)]
pub struct Submit<'a> {
    pub cmd: u16,
    pub flags: u16,
    pub offset: u64,
    pub length: u64,
    pub payload: Option<Payload<'a>>,
    pub slot: usize,
}

/// A WRITE payload.
#[derive(Debug, Clone, Copy)]
pub enum Payload<'a> {
    Bytes(&'a [u8]),
    /// `len` bytes of a file from `offset`, sent with sendfile(2): page-cache data goes to
    /// the socket without passing through user space. Only on plaintext connections
    /// (see [`Connection::can_send_file`]).
    File {
        fd: BorrowedFd<'a>,
        offset: u64,
        len: usize,
    },
}

impl Payload<'_> {
    pub fn len(&self) -> usize {
        match self {
            Payload::Bytes(b) => b.len(),
            Payload::File { len, .. } => *len,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A finished request.
#[derive(Debug, Clone)]
pub struct Completion {
    pub cookie: u64,
    pub cmd: u16,
    pub offset: u64,
    pub length: u64,
    pub slot: usize,
    pub result: Result<(), RemoteError>,
    /// BLOCK_STATUS: the `base:allocation` extents.
    pub extents: Vec<Extent>,
    /// BLOCK_STATUS: the extents of every other context that answered, by context id
    /// (each checked like `extents`: in the request, none empty, one chunk per context).
    pub status: Vec<(u32, Vec<Extent>)>,
    /// READ: bytes the server sent as holes (already zero-filled in the buffer).
    pub hole_bytes: u64,
}

struct InFlight {
    cmd: u16,
    offset: u64,
    length: u64,
    slot: usize,
    error: Option<RemoteError>,
    /// BLOCK_STATUS: the extents of each context that answered (a second chunk for one
    /// context is an error).
    status: Vec<(u32, Vec<Extent>)>,
    /// BLOCK_STATUS: extents kept so far over every context (bounded).
    status_extents: usize,
    /// READ: which bytes of the request the chunks covered.
    coverage: ReadCoverage,
    hole_bytes: u64,
    /// Error chunks received (a server could send them forever without DONE).
    errors: u32,
}

/// Error chunks taken for one request: a READ may get one per failed range.
const MAX_ERROR_CHUNKS: u32 = 4096;

const RECV_BUF: usize = 256 * 1024;
/// Largest non-data chunk payload accepted (block status of 2^20 extents, 16 bytes each).
const MAX_META_CHUNK: u64 = 16 * 1024 * 1024 + 64;
/// Most extents kept for one BLOCK_STATUS reply over all its contexts (16 bytes each).
pub const MAX_STATUS_EXTENTS: usize = 4 << 20;

pub struct Connection {
    stream: Channel,
    info: ClientNegotiated,
    mode: ReplyMode,
    rx: Vec<u8>,
    head: usize,
    tail: usize,
    /// Requests in flight, indexed by cookie - 1; freed indexes are reused, so cookies
    /// stay small and a lookup is an index, not a hash.
    inflight: Vec<Option<InFlight>>,
    free: Vec<usize>,
    in_flight: usize,
    hdrs: Vec<u8>,
    stash: Vec<Completion>,
    /// READs of at least [`LARGE_READ`] bytes in flight (see [`Connection::fill`]).
    large_reads: usize,
}

/// READ length from which payloads are worth receiving without the receive buffer.
const LARGE_READ: u64 = 64 * 1024;

fn open_stream(uri: &Uri, opts: &ConnectOptions) -> Result<Stream, Error> {
    let stream = match &uri.transport {
        Transport::Unix { path } => {
            let s = Stream::connect_unix(path)
                .map_err(|source| Error::Connect { target: path.display().to_string(), reason: source })?;
            s.apply(BufferConfig::for_unix(opts.buffers))?;
            s
        }
        Transport::Tcp { host, port } => {
            let target = format!("{host}:{port}");
            let addrs = (host.as_str(), *port)
                .to_socket_addrs()
                .map_err(|reason| Error::Connect { target: target.clone(), reason })?;
            let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
            let mut found = None;
            for a in addrs {
                match Stream::connect_tcp(&a) {
                    Ok(s) => {
                        found = Some(s);
                        break;
                    }
                    Err(e) => last = e,
                }
            }
            let s = found.ok_or(Error::Connect { target, reason: last })?;
            s.apply(opts.buffers)?;
            s
        }
    };
    Ok(stream)
}

/// The TLS context for a URI's credentials, built once per process: a copy opens
/// several connections to each end, and each would otherwise read and parse the same
/// certificate, key and CA files again.
fn client_tls(cfg: &ferry_tls::ClientTlsConfig) -> Result<ClientTls, TlsError> {
    static CACHE: std::sync::Mutex<Vec<(ferry_tls::ClientTlsConfig, ClientTls)>> = std::sync::Mutex::new(Vec::new());
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, t)) = cache.iter().find(|(c, _)| c == cfg) {
        return Ok(t.clone());
    }
    let t = ClientTls::new(cfg)?;
    cache.push((cfg.clone(), t.clone()));
    Ok(t)
}

/// Opens the socket a URI names and runs the handshake on it, upgrading to TLS when the
/// URI asks for it. Returns the connection, the progress and any bytes that arrived
/// after the handshake.
fn open(uri: &Uri, opts: &ConnectOptions, mut cfg: ClientConfig) -> Result<(Channel, ClientProgress, Vec<u8>), Error> {
    let tls = uri.tls.as_ref().map(client_tls).transpose()?;
    cfg.tls = tls.is_some();
    let mut stream = Channel::from(open_stream(uri, opts)?);
    let (p, leftover) = handshake(&mut stream, cfg, opts.handshake_timeout, tls.as_ref())?;
    Ok((stream, p, leftover))
}

/// Runs a client handshake over `stream`. Returns the progress and any bytes that
/// arrived after it.
fn handshake(
    stream: &mut Channel,
    cfg: ClientConfig,
    timeout: Duration,
    tls: Option<&ClientTls>,
) -> Result<(ClientProgress, Vec<u8>), Error> {
    let deadline = std::time::Instant::now() + timeout;
    let mut hs = ClientHandshake::new(cfg);
    let mut buf = vec![0u8; 128 * 1024];
    let (mut head, mut tail) = (0, 0);
    let mut out = Vec::new();
    loop {
        loop {
            let (n, p) = hs.feed(&buf[head..tail], &mut out)?;
            head += n;
            if !out.is_empty() {
                stream.send_all(&mut [IoSlice::new(&out)])?;
                out.clear();
            }
            if p == ClientProgress::StartTls {
                if head != tail {
                    return Err(Error::Protocol("the server sent data after accepting STARTTLS, before TLS".into()));
                }
                (head, tail) = (0, 0);
                stream.start_tls_client(tls.expect("STARTTLS is only sent with a TLS context"))?;
                hs.tls_started(&mut out);
                stream.send_all(&mut [IoSlice::new(&out)])?;
                out.clear();
                continue;
            }
            if p != ClientProgress::Continue {
                stream.set_read_timeout(None)?;
                return Ok((p, buf[head..tail].to_vec()));
            }
            if n == 0 {
                break;
            }
        }
        buf.copy_within(head..tail, 0);
        tail -= head;
        head = 0;
        // The timeout covers the whole handshake, not each read: a server trickling a
        // byte now and then must not hold the client forever.
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(Error::Protocol(format!("the server did not finish the handshake within {timeout:?}")));
        }
        stream.set_read_timeout(Some(left))?;
        let n = match stream.read(&mut buf[tail..]) {
            Ok(0) => return Err(Error::Closed),
            Ok(n) => n,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(Error::Protocol(format!("the server did not finish the handshake within {timeout:?}")))
            }
            Err(e) => return Err(e.into()),
        };
        tail += n;
    }
}

/// The sending half of [`Connection::submit`]: `hdrs` holds one `hlen`-byte header per
/// request, in order.
fn send_batch(stream: &mut Channel, hdrs: &[u8], hlen: usize, reqs: &[Submit<'_>]) -> io::Result<()> {
    let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(reqs.len() * 2);
    let mut last_hdr_end = 0usize;
    for (i, r) in reqs.iter().enumerate() {
        let end = (i + 1) * hlen;
        match r.payload.filter(|p| !p.is_empty()) {
            Some(Payload::Bytes(p)) => {
                iov.push(IoSlice::new(&hdrs[last_hdr_end..end]));
                iov.push(IoSlice::new(p));
                last_hdr_end = end;
            }
            Some(Payload::File { fd, offset, len }) => {
                iov.push(IoSlice::new(&hdrs[last_hdr_end..end]));
                last_hdr_end = end;
                stream.send_all(&mut iov)?;
                iov.clear();
                stream.send_file(fd, offset, len)?;
            }
            None => {}
        }
    }
    if last_hdr_end < hdrs.len() {
        iov.push(IoSlice::new(&hdrs[last_hdr_end..]));
    }
    stream.send_all(&mut iov)
}

impl Connection {
    /// Connects to the export a URI names.
    pub fn connect(uri: &Uri, opts: &ConnectOptions) -> Result<Connection, Error> {
        let cfg = ClientConfig {
            export: uri.export.clone(),
            extended: opts.extended,
            structured: opts.structured,
            meta_context: opts.meta_context,
            contexts: opts.contexts.clone(),
            list: false,
            list_contexts: false,
            tls: false,
        };
        let (stream, p, leftover) = open(uri, opts, cfg)?;
        let ClientProgress::Connected(info) = p else {
            return Err(Error::Protocol("unexpected handshake result".into()));
        };
        let mut rx = vec![0u8; RECV_BUF];
        rx[..leftover.len()].copy_from_slice(&leftover);
        Ok(Connection {
            stream,
            mode: info.reply_mode(),
            info: *info,
            rx,
            head: 0,
            tail: leftover.len(),
            inflight: Vec::new(),
            free: Vec::new(),
            in_flight: 0,
            hdrs: Vec::with_capacity(4096),
            stash: Vec::new(),
            large_reads: 0,
        })
    }

    /// Lists the exports of the server a URI names: (name, description) pairs.
    pub fn list(uri: &Uri, opts: &ConnectOptions) -> Result<Vec<(String, String)>, Error> {
        let mut cfg = ClientConfig::new(&uri.export);
        cfg.list = true;
        match open(uri, opts, cfg)?.1 {
            ClientProgress::Listed(l) => Ok(l),
            _ => Err(Error::Protocol("unexpected handshake result".into())),
        }
    }

    /// The metadata contexts the export a URI names offers (`NBD_OPT_LIST_META_CONTEXT`
    /// with no query), for messages naming what a server has.
    pub fn list_contexts(uri: &Uri, opts: &ConnectOptions) -> Result<Vec<String>, Error> {
        let mut cfg = ClientConfig::new(&uri.export);
        cfg.list_contexts = true;
        cfg.extended = opts.extended;
        match open(uri, opts, cfg)?.1 {
            ClientProgress::ContextsListed(l) => Ok(l),
            _ => Err(Error::Protocol("unexpected handshake result".into())),
        }
    }

    pub fn info(&self) -> &ClientNegotiated {
        &self.info
    }
    pub fn size(&self) -> u64 {
        self.info.size
    }
    pub fn flags(&self) -> u16 {
        self.info.flags
    }
    pub fn has_flag(&self, f: u16) -> bool {
        self.info.flags & f != 0
    }
    pub fn mode(&self) -> ReplyMode {
        self.mode
    }
    /// WRITE payloads may be [`Payload::File`]: the connection is not encrypted.
    pub fn can_send_file(&self) -> bool {
        !self.stream.is_tls()
    }
    /// The connection is over a Unix socket.
    pub fn is_unix(&self) -> bool {
        self.stream.is_unix()
    }
    /// `base:allocation` was granted.
    pub fn can_block_status(&self) -> bool {
        self.info.meta_context.is_some()
    }
    /// Every metadata context the server granted: (id, name).
    pub fn contexts(&self) -> &[(u32, String)] {
        &self.info.contexts
    }
    /// Largest length one BLOCK_STATUS may ask about: the whole export with extended
    /// headers, just under 4 GiB (32-bit lengths) otherwise.
    pub fn max_status_length(&self) -> u64 {
        if self.mode == ReplyMode::Extended {
            u64::MAX
        } else {
            0xFFFF_F000
        }
    }
    /// Largest READ/WRITE payload the server accepts.
    pub fn max_payload(&self) -> u32 {
        self.info.block_size.map_or(MAX_PAYLOAD, |b| b.maximum.min(MAX_PAYLOAD)).max(512)
    }
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn track(&mut self, f: InFlight) -> u64 {
        let i = self.free.pop().unwrap_or_else(|| {
            self.inflight.push(None);
            self.inflight.len() - 1
        });
        self.inflight[i] = Some(f);
        self.in_flight += 1;
        i as u64 + 1
    }
    pub fn stream(&self) -> &Channel {
        &self.stream
    }
    /// What this connection did on its socket.
    pub fn stats(&self) -> ferry_sock::Counters {
        self.stream.stats()
    }

    /// Sends requests in one vectored send (headers and WRITE payloads interleaved; a
    /// [`Payload::File`] goes with its own sendfile). Returns the cookie of the last one.
    /// A send that fails part way leaves the stream out of step, so the connection is
    /// then closed: every later call fails.
    pub fn submit(&mut self, reqs: &[Submit<'_>]) -> Result<u64, Error> {
        if !self.can_send_file() && reqs.iter().any(|r| matches!(r.payload, Some(Payload::File { .. }))) {
            return Err(Error::Io(io::Error::new(
                io::ErrorKind::Unsupported,
                "a file payload needs a plaintext connection (TLS must see the bytes): send bytes instead",
            )));
        }
        let extended = self.mode == ReplyMode::Extended;
        let hlen = RequestHeader::wire_len(extended);
        let mut last = 0;
        self.hdrs.clear();
        for r in reqs {
            let mut flags = r.flags;
            let length = match &r.payload {
                Some(p) => {
                    if extended {
                        flags |= CMD_FLAG_PAYLOAD_LEN;
                    }
                    p.len() as u64
                }
                None => r.length,
            };
            let cookie = self.track(InFlight {
                cmd: r.cmd,
                offset: r.offset,
                length,
                slot: r.slot,
                error: None,
                status: Vec::new(),
                status_extents: 0,
                coverage: ReadCoverage::new(),
                hole_bytes: 0,
                errors: 0,
            });
            last = cookie;
            RequestHeader { flags, cmd: r.cmd, cookie, offset: r.offset, length }.encode(extended, &mut self.hdrs);
            if r.cmd == CMD_READ && length >= LARGE_READ {
                self.large_reads += 1;
            }
        }
        if let Err(e) = send_batch(&mut self.stream, &self.hdrs, hlen, reqs) {
            self.stream = Channel::Broken;
            return Err(e.into());
        }
        self.stream.count_requests(reqs.len() as u64);
        Ok(last)
    }

    /// Makes sure at least `n` unparsed bytes are in the receive buffer.
    ///
    /// While large READs are in flight, it reads no more than it needs: the payload that
    /// follows a header is then read straight into its destination instead of landing in
    /// the receive buffer and being copied out (one copy less per byte). With small
    /// requests in flight it reads as much as the kernel has, many replies per call.
    fn fill(&mut self, n: usize) -> Result<(), Error> {
        while self.tail - self.head < n {
            if self.rx.len() - self.head < n {
                self.rx.copy_within(self.head..self.tail, 0);
                self.tail -= self.head;
                self.head = 0;
            }
            let end = if self.large_reads > 0 && self.large_reads * 2 >= self.in_flight {
                // A reply header and a data chunk's offset, not one payload byte more: the
                // payload then lands in its buffer from its first byte, with the source
                // and destination of the kernel's copy aligned alike (an unaligned copy
                // measured far slower).
                (self.head + n.max(self.lookahead())).min(self.rx.len())
            } else {
                self.rx.len()
            };
            match self.stream.read(&mut self.rx[self.tail..end]) {
                Ok(0) => return Err(Error::Closed),
                Ok(k) => self.tail += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Bytes from a reply's start to the first payload byte of a READ: the reply header,
    /// plus the offset that starts a structured data chunk.
    fn lookahead(&self) -> usize {
        match self.mode {
            ReplyMode::Simple => 16,
            ReplyMode::Structured => 20 + 8,
            ReplyMode::Extended => 32 + 8,
        }
    }

    /// Receives `dest.len()` payload bytes: what is buffered is copied, the rest is read
    /// straight into `dest`.
    fn recv_into(&mut self, dest: &mut [u8]) -> Result<(), Error> {
        let have = (self.tail - self.head).min(dest.len());
        dest[..have].copy_from_slice(&self.rx[self.head..self.head + have]);
        self.head += have;
        if have < dest.len() {
            self.stream.read_exact(&mut dest[have..]).map_err(|e| {
                if e.kind() == io::ErrorKind::UnexpectedEof {
                    Error::Closed
                } else {
                    e.into()
                }
            })?;
        }
        Ok(())
    }

    /// Receives a small chunk payload (status, hole, error) into an owned buffer.
    fn recv_meta(&mut self, n: u64) -> Result<Vec<u8>, Error> {
        if n > MAX_META_CHUNK {
            return Err(Error::Protocol(format!("a {n}-byte reply chunk is too large")));
        }
        let mut v = vec![0u8; n as usize];
        self.recv_into(&mut v)?;
        Ok(v)
    }

    /// Whether unparsed reply bytes are already in the receive buffer, or decrypted
    /// bytes wait in the TLS layer (no syscall needed either way).
    pub fn buffered(&self) -> bool {
        self.tail > self.head || self.stream.buffered()
    }

    /// Whether a reply is already buffered or the socket is readable now.
    pub fn readable(&self, timeout: Option<Duration>) -> io::Result<bool> {
        if self.buffered() {
            return Ok(true);
        }
        let mut fds = [rustix::event::PollFd::new(&self.stream, rustix::event::PollFlags::IN)];
        let ts = timeout
            .map(|d| rustix::event::Timespec { tv_sec: d.as_secs() as i64, tv_nsec: i64::from(d.subsec_nanos()) });
        loop {
            match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(n) => return Ok(n > 0),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Waits for the next request to finish. READ data lands in `bufs[slot]`.
    pub fn receive(&mut self, bufs: &mut [Vec<u8>]) -> Result<Completion, Error> {
        self.receive_into(bufs)
    }

    /// [`Connection::receive`] into any buffers (page-aligned ones, say: the kernel
    /// copies into an aligned destination faster).
    pub fn receive_into<B: AsMut<[u8]>>(&mut self, bufs: &mut [B]) -> Result<Completion, Error> {
        if let Some(c) = self.stash.pop() {
            return Ok(c);
        }
        loop {
            self.fill(4)?;
            let hdr = loop {
                match ReplyHeader::parse(&self.rx[self.head..self.tail], self.mode)? {
                    Some(h) => break h,
                    None => {
                        let need = self.tail - self.head + 1;
                        self.fill(need)?;
                    }
                }
            };
            let (h, hlen) = hdr;
            self.head += hlen;
            let cookie = h.cookie();
            let index = cookie.wrapping_sub(1) as usize;
            let Some(mut f) = self.inflight.get_mut(index).and_then(Option::take) else {
                return Err(Error::Protocol(format!("reply for unknown cookie {cookie}")));
            };
            let done = match h {
                ReplyHeader::Simple { error, .. } => {
                    if error != 0 {
                        f.error = Some(RemoteError { errno: error, message: String::new(), offset: None });
                    } else if f.cmd == CMD_READ {
                        if self.mode != ReplyMode::Simple {
                            return Err(Error::Protocol("simple reply with data to a structured READ".into()));
                        }
                        let dest = bufs
                            .get_mut(f.slot)
                            .and_then(|b| b.as_mut().get_mut(..f.length as usize))
                            .ok_or_else(|| Error::Protocol("READ buffer too small".into()))?;
                        self.recv_into(dest)?;
                        f.coverage = ReadCoverage::whole(f.length);
                    }
                    true
                }
                ReplyHeader::Chunk { flags, ty, length, .. } => {
                    self.chunk(&mut f, flags, ty, length, bufs)?;
                    flags & REPLY_FLAG_DONE != 0
                }
            };
            if !done {
                self.inflight[index] = Some(f);
                continue;
            }
            self.free.push(index);
            self.in_flight -= 1;
            if f.cmd == CMD_READ && f.length >= LARGE_READ {
                self.large_reads -= 1;
            }
            if f.cmd == CMD_READ && f.error.is_none() && f.coverage.covered() != f.length {
                return Err(Error::Protocol(format!(
                    "READ at offset {} of {} bytes: the server sent only {} bytes before finishing",
                    f.offset,
                    f.length,
                    f.coverage.covered()
                )));
            }
            return Ok(Completion {
                cookie,
                cmd: f.cmd,
                offset: f.offset,
                length: f.length,
                slot: f.slot,
                result: f.error.map_or(Ok(()), Err),
                extents: match f.status.iter().position(|c| Some(c.0) == self.info.meta_context) {
                    Some(i) => f.status.swap_remove(i).1,
                    None => Vec::new(),
                },
                status: f.status,
                hole_bytes: f.hole_bytes,
            });
        }
    }

    fn chunk<B: AsMut<[u8]>>(
        &mut self,
        f: &mut InFlight,
        flags: u16,
        ty: u16,
        length: u64,
        bufs: &mut [B],
    ) -> Result<(), Error> {
        match ty {
            REPLY_TYPE_NONE => {
                if length != 0 || flags & REPLY_FLAG_DONE == 0 {
                    return Err(Error::Protocol("a NONE chunk must be empty and the last of its reply".into()));
                }
            }
            REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE if f.cmd == CMD_READ => {
                let prefix = if ty == REPLY_TYPE_OFFSET_DATA { 8 } else { 12 };
                if length < prefix || (ty == REPLY_TYPE_OFFSET_HOLE && length != 12) {
                    return Err(ReplyError::Malformed("read").into());
                }
                self.fill(prefix as usize)?;
                let p = &self.rx[self.head..self.head + prefix as usize];
                let off = u64::from_be_bytes(p[..8].try_into().unwrap_or_default());
                let n = if ty == REPLY_TYPE_OFFSET_DATA {
                    length - 8
                } else {
                    u64::from(u32::from_be_bytes(p[8..12].try_into().unwrap_or_default()))
                };
                self.head += prefix as usize;
                // Every byte of the request exactly once: a chunk outside it, over bytes
                // already sent, or of no bytes at all ends the connection.
                let rel = off.checked_sub(f.offset).unwrap_or(u64::MAX);
                if let Err(why) = f.coverage.add(rel, n, f.length) {
                    return Err(Error::Protocol(format!(
                        "server sent {n} bytes at offset {off} for the READ of {} bytes at {}: {why}",
                        f.length, f.offset
                    )));
                }
                let dest = bufs
                    .get_mut(f.slot)
                    .and_then(|b| b.as_mut().get_mut(rel as usize..(rel + n) as usize))
                    .ok_or_else(|| Error::Protocol("READ buffer too small".into()))?;
                if ty == REPLY_TYPE_OFFSET_DATA {
                    self.recv_into(dest)?;
                } else {
                    dest.fill(0);
                    f.hole_bytes += n;
                }
            }
            REPLY_TYPE_BLOCK_STATUS | REPLY_TYPE_BLOCK_STATUS_EXT if f.cmd == CMD_BLOCK_STATUS => {
                let p = self.recv_meta(length)?;
                let mut extents = Vec::new();
                let id = parse_block_status(ty, &p, &mut extents)?;
                let at = f.offset;
                let Some(name) = self.info.context_name(id) else {
                    return Err(Error::Protocol(format!(
                        "the server sent block status at offset {at} for context {id}, which was not negotiated \
                         (granted: {})",
                        granted(&self.info.contexts)
                    )));
                };
                if f.status.iter().any(|c| c.0 == id) {
                    return Err(Error::Protocol(format!(
                        "the server sent two block status chunks for one context ({name}) in the reply at offset {at}"
                    )));
                }
                let kept = check_extents(&extents, f.length).map_err(|why| {
                    Error::Protocol(format!("the server's block status for {name} at offset {at} {why}"))
                })?;
                // The last extent may run past the request: clipped to it.
                let before: u64 = extents[..kept - 1].iter().map(|e| e.length).sum();
                extents.truncate(kept);
                if let Some(last) = extents.last_mut() {
                    last.length = last.length.min(f.length - before);
                }
                f.status_extents += extents.len();
                if f.status_extents > MAX_STATUS_EXTENTS {
                    return Err(Error::Protocol(format!(
                        "the server sent more than {MAX_STATUS_EXTENTS} extents for the block status at offset {at}"
                    )));
                }
                f.status.push((id, extents));
            }
            t if t & 0x8000 != 0 => {
                f.errors += 1;
                if f.errors > MAX_ERROR_CHUNKS {
                    return Err(Error::Protocol(format!(
                        "more than {MAX_ERROR_CHUNKS} error chunks for the {} at offset {}",
                        command_name(f.cmd),
                        f.offset
                    )));
                }
                let p = self.recv_meta(length)?;
                let (errno, message, offset) = parse_error_chunk(t, &p)?;
                f.error.get_or_insert(RemoteError { errno, message, offset });
            }
            t => return Err(Error::Protocol(format!("unexpected reply chunk type {t} to {}", command_name(f.cmd)))),
        }
        Ok(())
    }

    /// Submits one request and waits for it (other completions are kept for `receive`).
    fn call(&mut self, s: Submit<'_>, bufs: &mut [Vec<u8>]) -> Result<Completion, Error> {
        let cookie = self.submit(&[s])?;
        loop {
            let c = self.receive(bufs)?;
            if c.cookie == cookie {
                return Ok(c);
            }
            self.stash.push(c);
        }
    }

    fn simple(&mut self, cmd: u16, flags: u16, offset: u64, length: u64) -> Result<(), Error> {
        let c = self.call(Submit { cmd, flags, offset, length, payload: None, slot: 0 }, &mut [])?;
        c.result.map_err(Error::Remote)
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn pread(&mut self, buf: &mut Vec<u8>, offset: u64) -> Result<(), Error> {
        let len = buf.len() as u64;
        let c = self.call(
            Submit { cmd: CMD_READ, flags: 0, offset, length: len, payload: None, slot: 0 },
            std::slice::from_mut(buf),
        )?;
        c.result.map_err(Error::Remote)
    }

    /// Writes `data` at `offset`.
    pub fn pwrite(&mut self, data: &[u8], offset: u64, fua: bool) -> Result<(), Error> {
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        let c = self.call(
            Submit {
                cmd: CMD_WRITE,
                flags,
                offset,
                length: data.len() as u64,
                payload: Some(Payload::Bytes(data)),
                slot: 0,
            },
            &mut [],
        )?;
        c.result.map_err(Error::Remote)
    }

    pub fn flush(&mut self) -> Result<(), Error> {
        self.simple(CMD_FLUSH, 0, 0, 0)
    }

    pub fn trim(&mut self, offset: u64, length: u64) -> Result<(), Error> {
        self.simple(CMD_TRIM, 0, offset, length)
    }

    pub fn zero(&mut self, offset: u64, length: u64, may_trim: bool) -> Result<(), Error> {
        self.simple(CMD_WRITE_ZEROES, if may_trim { 0 } else { CMD_FLAG_NO_HOLE }, offset, length)
    }

    /// `base:allocation` extents from `offset` (at least one on success).
    pub fn block_status(&mut self, offset: u64, length: u64) -> Result<Vec<Extent>, Error> {
        let c =
            self.call(Submit { cmd: CMD_BLOCK_STATUS, flags: 0, offset, length, payload: None, slot: 0 }, &mut [])?;
        c.result.map_err(Error::Remote)?;
        if c.extents.is_empty() {
            return Err(Error::Protocol("block status reply without base:allocation extents".into()));
        }
        Ok(c.extents)
    }

    /// The extents of every granted context from `offset` (at most `length` bytes, each
    /// list at least one extent), in the order of [`Connection::contexts`]. A context the
    /// server left out of a successful reply is an error.
    pub fn block_status_all(&mut self, offset: u64, length: u64) -> Result<Vec<(u32, Vec<Extent>)>, Error> {
        let c =
            self.call(Submit { cmd: CMD_BLOCK_STATUS, flags: 0, offset, length, payload: None, slot: 0 }, &mut [])?;
        c.result.map_err(Error::Remote)?;
        let mut status = c.status;
        if let Some(id) = self.info.meta_context {
            status.push((id, c.extents));
        }
        let mut out = Vec::with_capacity(self.info.contexts.len());
        for (id, name) in &self.info.contexts {
            match status.iter().position(|s| s.0 == *id) {
                Some(i) if !status[i].1.is_empty() => out.push(status.swap_remove(i)),
                _ => {
                    return Err(Error::Protocol(format!(
                        "the server's block status reply at offset {offset} has no extents for {name}"
                    )))
                }
            }
        }
        Ok(out)
    }

    /// Ends the session now, keeping the object: `NBD_CMD_DISC` is sent and the socket
    /// closed; every later call fails.
    pub fn close(&mut self) {
        self.hdrs.clear();
        let extended = self.mode == ReplyMode::Extended;
        RequestHeader { flags: 0, cmd: CMD_DISC, cookie: 0, offset: 0, length: 0 }.encode(extended, &mut self.hdrs);
        let _ = self.stream.send_all(&mut [IoSlice::new(&self.hdrs)]);
        self.stream = Channel::Broken;
    }

    /// Ends the session cleanly (`NBD_CMD_DISC`).
    pub fn disconnect(mut self) -> Result<(), Error> {
        self.hdrs.clear();
        let extended = self.mode == ReplyMode::Extended;
        RequestHeader { flags: 0, cmd: CMD_DISC, cookie: 0, offset: 0, length: 0 }.encode(extended, &mut self.hdrs);
        self.stream.send_all(&mut [IoSlice::new(&self.hdrs)])?;
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        Ok(())
    }
}

/// Granted contexts for a message: "base:allocation (1), ...".
fn granted(contexts: &[(u32, String)]) -> String {
    if contexts.is_empty() {
        return "none".into();
    }
    contexts.iter().map(|(id, n)| format!("{n} ({id})")).collect::<Vec<_>>().join(", ")
}

/// Checks a context's extents against a request of `length` bytes: none empty, and none
/// starting at or past the request's end (the last one may run past it: the spec allows
/// that, and it is clipped). Returns how many to keep, or what is wrong.
pub fn check_extents(extents: &[Extent], length: u64) -> Result<usize, String> {
    if extents.is_empty() {
        return Err("has no extents".into());
    }
    let mut pos = 0u64;
    for (i, e) in extents.iter().enumerate() {
        if e.length == 0 {
            return Err(format!("has a zero-length extent (extent {i}), which does not advance"));
        }
        if pos >= length {
            return Err(format!("goes past the end of the {length}-byte request (extent {i} starts at +{pos})"));
        }
        pos = pos.saturating_add(e.length);
    }
    Ok(extents.len())
}

impl AsFd for Connection {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(v: &[u64]) -> Vec<Extent> {
        v.iter().map(|&length| Extent { length, flags: 0 }).collect()
    }

    #[test]
    fn extents_must_advance_and_stay_in_the_request() {
        assert_eq!(check_extents(&ex(&[10, 20, 70]), 100), Ok(3));
        // The last one may run past the end (clipped by the caller).
        assert_eq!(check_extents(&ex(&[10, 1000]), 100), Ok(2));
        assert!(check_extents(&ex(&[]), 100).unwrap_err().contains("no extents"));
        assert!(check_extents(&ex(&[10, 0, 90]), 100).unwrap_err().contains("zero-length"));
        assert!(check_extents(&ex(&[100, 1]), 100).unwrap_err().contains("past the end"));
        assert!(check_extents(&ex(&[u64::MAX, u64::MAX]), 100).unwrap_err().contains("past the end"));
    }
}
