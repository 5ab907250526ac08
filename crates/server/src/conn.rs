//! One connection: the handshake, then the transmission loop.
//!
//! The transmission loop is built to make as few syscalls and copies as possible:
//! - one `read` fills a large receive buffer; every complete request in it is parsed
//!   and executed before the next `read`;
//! - WRITE payloads already in the receive buffer go to the backend straight from it;
//!   a payload larger than what arrived is received straight into a buffer the
//!   backend then writes from;
//! - READ data is read by the backend straight into an arena the reply is sent from;
//! - replies are queued (headers in one arena, payloads in another) and go out in one
//!   vectored send when the receive buffer is drained, or as soon as 64 KiB of
//!   payload or 16 replies are queued, so small replies are grouped and nothing waits
//!   behind a long batch.

use crate::exports::{Export, Exports};
use crate::server::{Config, Shared, Slot};
use crate::zerocopy::ZeroCopySender;
use ferry_backend::{Extent, MetaContext, ZeroMode};
use ferry_proto::consts::{command_name, NbdError, CMD_BLOCK_STATUS, CMD_FLAG_PAYLOAD_LEN};
use ferry_proto::handshake::{Progress, ServerHandshake};
use ferry_proto::reply::ReplyWriter;
use ferry_proto::request::{block_status_filter, Command, PayloadPlan, RequestError, RequestHeader, Session};
use ferry_sock::{AlignedBuf, SendLimit, Stream};
use ferry_tls::Transport;
use std::collections::VecDeque;
use std::io::{self, IoSlice, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a connection ended early.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
    #[error("handshake failed: {0}")]
    Handshake(#[from] ferry_proto::HandshakeError),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("handshake did not finish within {0:?}")]
    HandshakeTimeout(std::time::Duration),
    #[error("client closed the connection during the handshake")]
    HandshakeEof,
    #[error("{0}")]
    Request(#[from] RequestError),
    #[error("{0}")]
    Tls(#[from] ferry_tls::TlsError),
    #[error("client sent {0} bytes after NBD_OPT_STARTTLS without waiting for the TLS handshake (dropped: they could have been injected)")]
    DataAfterStartTls(usize),
}

/// Receive buffer size: many requests (and small write payloads) per `read`.
const RECV_BUF: usize = 512 * 1024;
/// Send as soon as this much payload is queued.
/// Default of [`Config::send_batch`]: small enough that a client with one connection
/// gets replies (and sends new requests) while the server is still executing the rest
/// of a batch; large enough that 4 KiB replies go 16 to a syscall. Measured with
/// `ferry bench nbd`: see BENCHMARKING.md.
pub const DEFAULT_SEND_BATCH: usize = 64 * 1024;
/// Replies grouped into one send at most (with the default send batch).
const SEND_BATCH_REPLIES: usize = 16;
/// Reads this long or longer are sent with sendfile(2) when the export is a file:
/// below it, one pread into the batch arena and one grouped writev cost less.
const SENDFILE_MIN: usize = 64 * 1024;
/// Most bytes of READ and WRITE data in flight at once on one connection whose backend
/// keeps requests in flight ([`ferry_backend::Backend::io_queue`]); a single read of the maximum payload
/// always fits.
const IN_FLIGHT_BYTES: usize = 32 << 20;
/// Most requests in flight at once on such a connection.
const IN_FLIGHT: usize = 64;
/// WRITE payloads this large are received straight into the write buffer (see `run`).
const LARGE_PAYLOAD: usize = 64 * 1024;
/// Most extents returned for one BLOCK_STATUS, shared among the contexts it answers
/// (bounded reply size).
const MAX_EXTENTS: usize = 64 * 1024;
/// The longest request header (extended): less than this is all a parked connection
/// keeps of a request.
const MAX_HEADER: usize = 32;
/// Handshake receive buffer at most: the largest option (64 KiB of data) plus its header.
const HANDSHAKE_BUF: usize = ferry_proto::consts::MAX_OPTION_DATA as usize + 64;
/// ... and at first: every option a real client sends fits.
const HANDSHAKE_BUF_START: usize = 4096;

/// Serves a new connection on its own thread: the handshake, then requests until the
/// client leaves or goes idle (then the connection is parked on the poller).
pub(crate) fn serve(stream: Stream, slot: Slot, shared: Arc<Shared>) {
    let peer = stream.peer();
    let mut stream = Transport::from(stream);
    let negotiated = match handshake(&mut stream, &shared.exports, &shared.config, &shared.stop) {
        Ok(Some(n)) => n,
        Ok(None) => return end(stream, &slot, &shared.config, Ok(())),
        Err(e) => return end(stream, &slot, &shared.config, Err(e)),
    };
    let (negotiated, leftover) = negotiated;
    let export = shared.exports.get(&negotiated.export.name).expect("negotiated export exists").clone();
    // The selected contexts, by the indexes the handshake recorded into this export's list.
    let offered = shared.exports.meta_contexts(&export.name);
    let contexts: Vec<(u32, Arc<dyn MetaContext>)> =
        negotiated.meta_contexts.iter().filter_map(|&(id, i)| offered.get(i).map(|c| (id, c.clone()))).collect();
    log::debug!(
        "{peer}: export {:?} ({}), {:?} replies, flags 0x{:04x}, {}",
        export.name,
        export.backend.describe(),
        negotiated.mode,
        negotiated.flags,
        stream.tls_description().unwrap_or_else(|| "no TLS".into())
    );
    let config = &shared.config;
    let mut t = Box::new(Transmission::new(
        stream,
        slot,
        shared.clone(),
        export,
        negotiated.session(),
        ReplyWriter::new(negotiated.mode),
        contexts,
    ));
    // sendfile pays on Unix sockets (one copy instead of two); on TCP loopback it measured
    // slower than pread + writev (BENCHMARKING.md), so TCP keeps the buffered path.
    // Under TLS the bytes must pass through the cipher, so sendfile cannot apply.
    t.sendfile = config.sendfile && t.stream.is_unix() && !t.stream.is_tls() && t.export.backend.file_fd().is_some();
    t.flush_bytes = config.send_batch;
    if config.send_batch == 0 {
        t.flush_replies = 1;
    }
    // Zero-copy needs the kernel to send the very bytes of the arena: never under TLS
    // (`--zerocopy=on` with TLS is refused at start).
    if let Some(s) = t.stream.plain_mut() {
        match ZeroCopySender::new(config.zerocopy, s) {
            Ok(zc) => t.zc = zc,
            Err(e) => return t.close(Err(e.into())),
        }
    }
    // Requests stay on this thread while they come; a read that waits longer than the
    // idle grace period returns, and the connection is parked (see `Transmission::run`).
    if let Err(e) = t.stream.set_read_timeout(Some(config.idle_grace)) {
        return t.close(Err(e.into()));
    }
    // A client that stops reading replies holds this thread in a send, which looks at the
    // stop flag once per idle grace period: after a shutdown, it gives up within the
    // shutdown grace period.
    if let Err(e) = t.stream.set_send_limit(shutdown_limit(&shared), config.idle_grace) {
        return t.close(Err(e.into()));
    }
    t.acquire();
    t.rx[..leftover.len()].copy_from_slice(&leftover);
    t.tail = leftover.len();
    drive(t);
}

/// Takes a parked connection back on a new thread (the poller saw its socket readable).
pub(crate) fn resume(mut t: Box<Transmission>) {
    t.acquire();
    drive(t);
}

/// Serves requests until the client leaves (the connection ends here) or goes idle
/// (it is parked).
fn drive(mut t: Box<Transmission>) {
    match t.run() {
        // Shutting down: an idle connection has nothing in flight, so it ends here.
        Ok(Step::Idle) if t.shared.stop.load(Ordering::SeqCst) => t.close(Ok(())),
        Ok(Step::Idle) => {
            t.release();
            let shared = t.shared.clone();
            shared.poller.park(t);
        }
        Ok(Step::Closed) => t.close(Ok(())),
        Err(e) => t.close(Err(e)),
    }
}

/// The end of a connection: statistics, the log line. The registry slot goes with it.
fn end(mut stream: Transport, slot: &Slot, config: &Config, result: Result<(), ConnError>) {
    let peer = stream.peer();
    if stream.is_tls() {
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
    *slot.counters.lock().unwrap_or_else(|e| e.into_inner()) = stream.stats();
    if config.stats {
        log::info!("{peer}: {}", stream.stats());
    }
    match result {
        Ok(()) => log::debug!("{peer}: connection closed"),
        Err(e) => log::info!("{peer}: connection dropped: {e}"),
    }
}

/// Why [`Transmission::run`] returned.
enum Step {
    /// The client disconnected (or the server is stopping): close.
    Closed,
    /// Nothing came for the idle grace period and nothing is left to answer: park.
    Idle,
}

/// Sends during transmission give up once the server has been stopping for the shutdown
/// grace period.
fn shutdown_limit(shared: &Shared) -> SendLimit {
    SendLimit { deadline: None, stop: Some((shared.stop.clone(), shared.config.shutdown_grace)) }
}

/// Runs the handshake. `Ok(None)`: the client aborted cleanly.
fn handshake(
    stream: &mut Transport,
    exports: &Exports,
    config: &Config,
    stop: &Arc<AtomicBool>,
) -> Result<Option<(ferry_proto::Negotiated, Vec<u8>)>, ConnError> {
    let deadline = Instant::now() + config.handshake_timeout;
    // The deadline bounds sends too: a client that sends options and never reads the
    // replies is dropped at the deadline, not left holding this thread in `send`.
    let limit = SendLimit { deadline: Some(deadline), stop: Some((stop.clone(), config.shutdown_grace)) };
    stream.set_send_limit(limit, config.idle_grace)?;
    let timed_out = |e: io::Error| {
        if e.kind() == io::ErrorKind::TimedOut && Instant::now() >= deadline {
            ConnError::HandshakeTimeout(config.handshake_timeout)
        } else {
            ConnError::Io(e)
        }
    };
    let mut out = Vec::new();
    let mut hs = ServerHandshake::with_tls(&mut out, config.tls_policy);
    // Grows (up to the largest option) only when a message does not fit.
    let mut buf = vec![0u8; HANDSHAKE_BUF_START];
    let (mut head, mut tail) = (0usize, 0usize);
    loop {
        // Consume every complete message already received.
        loop {
            let (n, progress) = hs.feed(&buf[head..tail], exports, &mut out)?;
            head += n;
            match progress {
                Progress::Continue if n > 0 => continue,
                Progress::Continue => break,
                Progress::Abort => {
                    send_plain(stream, &out).map_err(timed_out)?;
                    return Ok(None);
                }
                Progress::Transmission(neg) => {
                    send_plain(stream, &out).map_err(timed_out)?;
                    stream.set_read_timeout(None)?;
                    return Ok(Some((*neg, buf[head..tail].to_vec())));
                }
                Progress::StartTls => {
                    send_plain(stream, &out).map_err(timed_out)?;
                    out.clear();
                    if head != tail {
                        return Err(ConnError::DataAfterStartTls(tail - head));
                    }
                    (head, tail) = (0, 0);
                    let tls = config.tls.as_ref().expect("TLS policy on implies a TLS context");
                    // Each wait ends within a grace period, to look at the deadline and at
                    // the stop flag: a peer stalled in the TLS handshake holds neither the
                    // handshake nor a shutdown beyond them.
                    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
                    stream.set_read_timeout(Some(left.min(config.idle_grace)))?;
                    stream.start_tls_server(tls, || Instant::now() < deadline && !stop.load(Ordering::SeqCst))?;
                    hs.tls_started();
                    log::debug!("{}: TLS started: {}", stream.peer(), stream.tls_description().unwrap_or_default());
                }
            }
        }
        send_plain(stream, &out).map_err(timed_out)?;
        out.clear();
        if head == tail {
            head = 0;
            tail = 0;
        } else if tail == buf.len() && head > 0 {
            buf.copy_within(head..tail, 0);
            tail -= head;
            head = 0;
        } else if tail == buf.len() {
            buf.resize((buf.len() * 4).min(HANDSHAKE_BUF), 0);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ConnError::HandshakeTimeout(config.handshake_timeout));
        }
        if stop.load(Ordering::SeqCst) {
            return Err(ConnError::ShuttingDown);
        }
        // Wake up at least once a grace period to see whether the server is stopping.
        stream.set_read_timeout(Some(left.min(config.idle_grace)))?;
        match stream.read(&mut buf[tail..]) {
            Ok(0) => return Err(ConnError::HandshakeEof),
            Ok(n) => tail += n,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// The plaintext socket under a transport that zero-copy is set up on.
fn plain(t: &mut Transport) -> io::Result<&mut Stream> {
    t.plain_mut().ok_or_else(|| io::Error::other("zero-copy on a TLS connection"))
}

fn send_plain(stream: &mut Transport, out: &[u8]) -> io::Result<()> {
    if !out.is_empty() {
        stream.send_all(&mut [IoSlice::new(out)])?;
    }
    Ok(())
}

/// A piece of the next vectored send.
#[derive(Clone, Copy)]
enum Part {
    /// Bytes `start..end` of the header arena.
    Header(usize, usize),
    /// Bytes `start..end` of the data arena.
    Data(usize, usize),
    /// A READ's data sent from the export's file with sendfile(2).
    File(FilePart),
    /// All of `bufs[i]`: the buffer a queued read filled.
    Buf(usize),
}

/// The data of a READ chunk that goes out with sendfile(2), and what a failure of the
/// file under it (a read error, or the file cut short) turns into.
///
/// The chunk's header is out before sendfile reads the file, so with structured replies
/// the data chunk never carries DONE: a NONE chunk follows it to end the reply (20 bytes,
/// 32 with extended headers: the cost of sendfile per READ), and if the file fails, the
/// data chunk is made up to the length it declared with zeroes and an EIO error chunk
/// takes the NONE chunk's place. The client gets EIO and the connection goes on. With
/// simple replies there is no way to report an error after the header: the connection is
/// dropped, so the client never takes the zeroes for data.
#[derive(Clone, Copy)]
struct FilePart {
    /// Where the data lies in the file, and its length.
    at: u64,
    len: usize,
    /// The request and the export offset of the data, for the error chunk.
    cookie: u64,
    req_offset: u64,
    pos: u64,
    /// Bytes of the NONE chunk that follows this part in the header arena (0: none; other
    /// chunks of the reply follow, or replies are simple).
    trailer: usize,
    /// The chunk ends the reply (the error chunk then carries DONE).
    last: bool,
}

/// Zeroes to make up a data chunk whose file failed under sendfile.
static ZEROES: [u8; 64 * 1024] = [0; 64 * 1024];

/// Ends the reply of a READ whose file failed under sendfile after `sent` of its bytes
/// (see [`FilePart`]). Returns how many bytes of the header arena to skip (the NONE
/// chunk replaced by the error chunk), or the error when the connection must be dropped.
fn file_failed(
    stream: &mut Transport,
    writer: &ReplyWriter,
    f: &FilePart,
    sent: usize,
    e: io::Error,
) -> io::Result<usize> {
    // The socket failing (the client left, or stopped reading past the send limit) ends
    // the connection; anything else is the file's failure.
    let socket = matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::NotConnected
            | io::ErrorKind::TimedOut
    );
    if !writer.chunked() || socket {
        return Err(e);
    }
    let msg = format!("reading {} bytes of the export's file at {} for sendfile: {e}", f.len, f.at);
    log::warn!("{}: {msg}; the client gets EIO for the READ at {}", stream.peer(), f.pos);
    let mut left = f.len - sent;
    while left > 0 {
        let mut iov = Vec::new();
        let mut batch = 0;
        while batch < left && iov.len() < 64 {
            let n = (left - batch).min(ZEROES.len());
            iov.push(IoSlice::new(&ZEROES[..n]));
            batch += n;
        }
        stream.send_all(&mut iov)?;
        left -= batch;
    }
    let mut chunk = Vec::new();
    let at = f.pos + sent as u64;
    writer.error_chunk_at(f.cookie, f.req_offset, NbdError::Io, &msg, at, f.last, &mut chunk);
    stream.send_all(&mut [IoSlice::new(&chunk)])?;
    Ok(f.trailer)
}

/// Replies waiting to be sent: headers and read data in two arenas, and the order.
struct SendQueue {
    headers: Vec<u8>,
    /// Read data; `used` is the fill level.
    data: AlignedBuf,
    used: usize,
    parts: Vec<Part>,
    /// Buffers of completed queued reads, sent without a copy, and their total length.
    bufs: Vec<Vec<u8>>,
    buf_bytes: usize,
}

impl SendQueue {
    /// Records that header bytes from `start` to the arena's end belong next in line.
    fn header_from(&mut self, start: usize) {
        let end = self.headers.len();
        if let Some(Part::Header(_, e)) = self.parts.last_mut() {
            if *e == start {
                *e = end;
                return;
            }
        }
        self.parts.push(Part::Header(start, end));
    }

    /// Reserves `n` bytes of the data arena (growing it only when one read needs more
    /// than it ever had). The caller flushes first when the arena is partly used.
    fn reserve(&mut self, n: usize) -> (usize, usize) {
        let start = self.used;
        if start + n > self.data.len() {
            self.data.resize(start + n);
        }
        self.used += n;
        (start, start + n)
    }

    fn pending(&self) -> bool {
        !self.parts.is_empty()
    }
}

/// A connection in the transmission phase: its socket, session and buffers. Buffers
/// exist only while a thread serves it ([`Transmission::acquire`]); a parked
/// connection is this struct with empty buffers.
pub(crate) struct Transmission {
    stream: Transport,
    /// Its place in the registry, and where it publishes its statistics (read on SIGUSR1).
    slot: Slot,
    shared: Arc<Shared>,
    /// When the client last sent something or was last answered (for `--idle-timeout`).
    last_active: Instant,
    export: Arc<Export>,
    session: Session,
    writer: ReplyWriter,
    rx: AlignedBuf,
    head: usize,
    tail: usize,
    /// Buffer for WRITE payloads larger than what one `read` brought (page-aligned: the
    /// kernel copies into and out of an aligned buffer faster).
    wbuf: AlignedBuf,
    tx: SendQueue,
    extents: Vec<Extent>,
    /// The metadata contexts the client selected: (context id, context), in the
    /// export's order; BLOCK_STATUS answers each (or those its payload names).
    contexts: Vec<(u32, Arc<dyn MetaContext>)>,
    /// The context ids of the current BLOCK_STATUS's filter payload.
    filter: Vec<u32>,
    sparse_threshold: Option<u64>,
    /// The last request carried a payload of at least [`LARGE_PAYLOAD`] bytes.
    large_writes: bool,
    /// Send queued replies once this much payload is queued (0: after every reply) ...
    flush_bytes: usize,
    /// ... or once this many replies are queued, so replies without payload (WRITE,
    /// FLUSH) reach the client while the rest of a large batch is executed.
    flush_replies: usize,
    /// Replies queued since the last send.
    queued: usize,
    /// Data reads of at least [`SENDFILE_MIN`] bytes go out with sendfile(2).
    sendfile: bool,
    /// While a thread serves the connection, the queue that keeps its READs and WRITEs
    /// (without FUA) in flight, when the backend has one ([`ferry_backend::Backend::io_queue`]) and no READ has
    /// its holes checked first.
    queue: Option<Box<dyn ferry_backend::IoQueue>>,
    /// The header of each request in `queue` (a READ or a WRITE), oldest first, and their
    /// bytes.
    in_flight: VecDeque<RequestHeader>,
    in_flight_bytes: usize,
    /// Buffers of answered queued requests, for the next ones.
    pool: Vec<Vec<u8>>,
    /// Bytes queued for sendfile since the last flush.
    file_bytes: usize,
    /// Large batches go out with MSG_ZEROCOPY (`--zerocopy`, TCP only).
    zc: Option<ZeroCopySender>,
    disconnect: bool,
    /// While parked: the start of a request header received before the client went
    /// quiet (fewer bytes than a header), put back in front of the receive buffer when
    /// a thread takes the connection again.
    partial: Vec<u8>,
}

impl Transmission {
    fn new(
        stream: Transport,
        slot: Slot,
        shared: Arc<Shared>,
        export: Arc<Export>,
        session: Session,
        writer: ReplyWriter,
        contexts: Vec<(u32, Arc<dyn MetaContext>)>,
    ) -> Self {
        let sparse_threshold = if writer.chunked() { export.backend.sparse_read_threshold() } else { None };
        Transmission {
            stream,
            slot,
            shared,
            last_active: Instant::now(),
            export,
            session,
            writer,
            rx: AlignedBuf::default(),
            head: 0,
            tail: 0,
            wbuf: AlignedBuf::default(),
            tx: SendQueue {
                headers: Vec::new(),
                data: AlignedBuf::default(),
                used: 0,
                parts: Vec::new(),
                bufs: Vec::new(),
                buf_bytes: 0,
            },
            extents: Vec::new(),
            contexts,
            filter: Vec::new(),
            sparse_threshold,
            large_writes: false,
            flush_bytes: DEFAULT_SEND_BATCH,
            flush_replies: SEND_BATCH_REPLIES,
            queued: 0,
            sendfile: false,
            queue: None,
            in_flight: VecDeque::new(),
            in_flight_bytes: 0,
            pool: Vec::new(),
            file_bytes: 0,
            zc: None,
            disconnect: false,
            partial: Vec::new(),
        }
    }

    /// A zero-copy send (or the wait after it) failed part way: the kernel may still
    /// hold pages of every buffer the batch named and send them later, so none may be
    /// freed and reused (other data would go out to this peer). The arenas wait with
    /// those in flight (freed once complete, at the latest when the connection closes;
    /// leaked if never); read buffers of a request queue are leaked. The connection
    /// ends with `e`.
    fn abandon_batch(&mut self, e: io::Error) -> io::Error {
        match (&mut self.zc, self.stream.plain_mut()) {
            (Some(zc), Some(s)) => zc.abandon(s, &mut self.tx.headers, &mut self.tx.data),
            _ => {
                std::mem::forget(std::mem::take(&mut self.tx.headers));
                std::mem::forget(std::mem::take(&mut self.tx.data));
            }
        }
        for b in self.tx.bufs.drain(..) {
            std::mem::forget(b);
        }
        e
    }

    /// Allocates the buffers a thread serves the connection with.
    fn acquire(&mut self) {
        self.rx = AlignedBuf::zeroed(RECV_BUF);
        let partial = std::mem::take(&mut self.partial);
        self.rx[..partial.len()].copy_from_slice(&partial);
        (self.head, self.tail) = (0, partial.len());
        self.tx.headers = Vec::with_capacity(64 * 1024);
        self.tx.data = AlignedBuf::zeroed(1 << 20);
        if self.sparse_threshold.is_none() && !self.sendfile {
            self.queue = self.export.backend.io_queue();
        }
    }

    /// Gives every buffer back before the connection is parked: nothing is queued and
    /// at most the start of a request header is received (see `run`), which is kept.
    /// Zero-copy arenas the kernel still holds are waited for first.
    fn release(&mut self) {
        debug_assert!(self.tail - self.head < MAX_HEADER && !self.tx.pending() && self.in_flight.is_empty());
        if let (Some(zc), Some(s)) = (&mut self.zc, self.stream.plain_mut()) {
            zc.finish(s);
        }
        self.partial = self.rx[self.head..self.tail].to_vec();
        (self.rx, self.head, self.tail) = (AlignedBuf::default(), 0, 0);
        self.wbuf = AlignedBuf::default();
        self.tx.headers = Vec::new();
        self.tx.data = AlignedBuf::default();
        self.tx.parts = Vec::new();
        self.tx.bufs = Vec::new();
        self.queue = None;
        self.in_flight = VecDeque::new();
        self.pool = Vec::new();
        self.extents = Vec::new();
        self.stream.release_buffers();
        self.publish();
    }

    /// Ends the connection (TLS close_notify, statistics, the log line).
    pub(crate) fn close(mut self: Box<Self>, result: Result<(), ConnError>) {
        if let (Some(zc), Some(s)) = (&mut self.zc, self.stream.plain_mut()) {
            zc.finish(s);
        }
        let t = *self;
        end(t.stream, &t.slot, &t.shared.config, result);
    }

    /// Publishes the socket statistics where SIGUSR1 and the totals read them.
    fn publish(&self) {
        *self.slot.counters.lock().unwrap_or_else(|e| e.into_inner()) = self.stream.stats();
    }

    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.stream.as_fd()
    }

    pub(crate) fn id(&self) -> u64 {
        self.slot.id()
    }

    pub(crate) fn peer(&self) -> String {
        self.stream.peer()
    }

    pub(crate) fn last_active(&self) -> Instant {
        self.last_active
    }

    /// `--idle-timeout` has passed since the client was last heard from or answered.
    fn timed_out(&self) -> bool {
        self.shared.config.idle_timeout.is_some_and(|t| self.last_active.elapsed() >= t)
    }

    /// Reads into `rx[tail..end]`. `Ok(None)`: nothing came within the idle grace period.
    fn read_more(&mut self, end: usize) -> io::Result<Option<usize>> {
        loop {
            return match self.stream.read(&mut self.rx[self.tail..end]) {
                Ok(n) => {
                    self.last_active = Instant::now();
                    Ok(Some(n))
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e),
            };
        }
    }

    /// Fills `buf` from the socket, however long the client takes (a payload in
    /// flight is not idleness), unless the server is stopping.
    fn read_full(stream: &mut Transport, stop: &AtomicBool, mut buf: &mut [u8]) -> io::Result<()> {
        while !buf.is_empty() {
            match stream.read(buf) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => buf = &mut buf[n..],
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
                    ) =>
                {
                    if stop.load(Ordering::SeqCst) {
                        return Err(io::Error::other("the server is shutting down"));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn run(&mut self) -> Result<Step, ConnError> {
        let ext = self.session.extended;
        let hlen = RequestHeader::wire_len(ext);
        loop {
            // Execute every complete request in the receive buffer.
            while !self.disconnect {
                if self.queue.is_some() {
                    self.queue_reads(ext)?;
                    // The run of reads at the front of the receive buffer is submitted:
                    // a queue that gathers them starts the rest now.
                    if let Some(queue) = self.queue.as_mut() {
                        queue.submitted();
                    }
                }
                let Some(h) = RequestHeader::parse(&self.rx[self.head..self.tail], ext)? else { break };
                // Other requests run beside those in flight: the protocol orders no two
                // requests in flight, and a client that interleaves BLOCK_STATUS with its
                // reads (qemu-img convert) must not drain the queue each time. A FLUSH
                // (in `request`) and a disconnect are answered after everything before them.
                self.answer_queued(if h.cmd == ferry_proto::consts::CMD_DISC { usize::MAX } else { 0 })?;
                match h.check_payload(ext)? {
                    PayloadPlan::Receive(n) => {
                        self.large_writes = n >= LARGE_PAYLOAD;
                        let start = self.head + hlen;
                        if self.tail - start >= n {
                            self.head = start + n;
                            self.request(&h, Some((start, start + n)))?;
                        } else {
                            self.receive_large_payload(start, n)?;
                            self.request(&h, None)?;
                        }
                    }
                    PayloadPlan::Drain(n) => {
                        self.head += hlen;
                        self.drain(n)?;
                        let msg = format!("{} payload of {n} bytes exceeds the 32 MiB maximum", command_name(h.cmd));
                        self.error(&h, NbdError::Inval, &msg);
                    }
                }
                self.queued += 1;
                self.flush_if_full()?;
            }
            self.flush()?;
            if self.disconnect || self.shared.stop.load(Ordering::SeqCst) {
                return Ok(Step::Closed);
            }
            // Requests in flight: answer every one that has completed. Wait for the oldest
            // only when the client has sent nothing new, so new requests join those in
            // flight as soon as they arrive.
            if !self.in_flight.is_empty() {
                let done = self.queue.as_ref().is_some_and(|q| q.oldest_done());
                if done || !self.readable_now() {
                    self.answer_queued(if done { 0 } else { 1 })?;
                    continue;
                }
            }
            // Keep the partial header (under 32 bytes) at the front, then read more.
            self.rx.copy_within(self.head..self.tail, 0);
            self.tail -= self.head;
            self.head = 0;
            // After a large WRITE, expect another: read only its header, so its payload is
            // then read straight into the write buffer instead of through `rx` (one copy
            // less per byte). Otherwise read as much as has arrived.
            let end = if self.large_writes { hlen.max(self.tail + 1) } else { self.rx.len() };
            match self.read_more(end)? {
                Some(0) => return Ok(Step::Closed),
                Some(n) => self.tail += n,
                // Requests in flight are answered before anything else is decided.
                None if !self.in_flight.is_empty() => {}
                // The read waited the idle grace period. Everything received is answered.
                None if self.timed_out() => {
                    log::debug!(
                        "{}: closing: no request for {:?} (--idle-timeout)",
                        self.peer(),
                        self.last_active.elapsed()
                    );
                    return Ok(Step::Closed);
                }
                // Plaintext OpenSSL holds: wait on this thread.
                None if self.stream.buffered() => {}
                // Nothing, or the start of a header (kept while parked, a few bytes):
                // every request received is answered, so the connection is idle. A
                // client that sends one byte must not pin a thread.
                None => return Ok(Step::Idle),
            }
        }
    }

    /// Moves the part of a payload already received into `wbuf` and reads the rest
    /// straight into it. Pending replies go out first: nothing waits behind a
    /// blocking read.
    fn receive_large_payload(&mut self, start: usize, n: usize) -> io::Result<()> {
        self.flush()?;
        self.wbuf.reserve(n);
        let have = self.tail - start;
        self.wbuf[..have].copy_from_slice(&self.rx[start..self.tail]);
        self.head = self.tail;
        Self::read_full(&mut self.stream, &self.shared.stop, &mut self.wbuf[have..n])?;
        self.last_active = Instant::now();
        Ok(())
    }

    /// Reads and discards `n` payload bytes that are too large to accept.
    fn drain(&mut self, mut n: u64) -> io::Result<()> {
        let have = ((self.tail - self.head) as u64).min(n);
        self.head += have as usize;
        n -= have;
        self.flush()?;
        while n > 0 {
            let want = n.min(self.rx.len() as u64) as usize;
            Self::read_full(&mut self.stream, &self.shared.stop, &mut self.rx[..want])?;
            n -= want as u64;
        }
        self.head = 0;
        self.tail = 0;
        Ok(())
    }

    /// Sends every queued reply: one vectored send, split only around file ranges that
    /// go out with sendfile(2).
    fn flush(&mut self) -> io::Result<()> {
        if !self.tx.pending() {
            return Ok(());
        }
        let zerocopy = match &mut self.zc {
            // Zero-copy sends only the data arena, whose retired copies it swaps in.
            Some(zc) if self.tx.bufs.is_empty() => zc.wants(plain(&mut self.stream)?, self.tx.used)?,
            _ => false,
        };
        let tx = &self.tx;
        let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(tx.parts.len());
        // Header bytes not to send: a NONE chunk whose READ ended with an error chunk.
        let mut skip = 0;
        for p in &tx.parts {
            match p {
                Part::Header(a, b) => {
                    let a = (a + skip).min(*b);
                    if a < *b {
                        iov.push(IoSlice::new(&tx.headers[a..*b]));
                    }
                    skip = 0;
                }
                Part::Data(a, b) => iov.push(IoSlice::new(&tx.data[*a..*b])),
                Part::Buf(i) => iov.push(IoSlice::new(&tx.bufs[*i])),
                Part::File(f) => {
                    self.stream.send_all(&mut iov)?;
                    iov.clear();
                    let fd = self.export.backend.file_fd().ok_or_else(|| io::Error::other("export has no file"))?;
                    let mut sent = 0;
                    if let Err(e) = self.stream.send_file_counted(fd, f.at, f.len, &mut sent) {
                        skip = file_failed(&mut self.stream, &self.writer, f, sent, e)?;
                    }
                }
            }
        }
        let zc_sent = match &mut self.zc {
            Some(zc) if zerocopy => Some(zc.send(plain(&mut self.stream)?, &mut iov)),
            _ => {
                self.stream.send_all(&mut iov)?;
                None
            }
        };
        drop(iov);
        let zc_ticket = match zc_sent {
            Some(Err(e)) => return Err(self.abandon_batch(e)),
            Some(Ok(t)) => Some(t),
            None => None,
        };
        if let (Some(ticket), Some(zc)) = (zc_ticket, &mut self.zc) {
            // The kernel holds the arenas just sent until `ticket` completes: swap in others.
            let retired =
                plain(&mut self.stream).and_then(|s| zc.retire(s, ticket, &mut self.tx.headers, &mut self.tx.data));
            if let Err(e) = retired {
                return Err(self.abandon_batch(e));
            }
        }
        self.tx.parts.clear();
        self.tx.headers.clear();
        self.tx.used = 0;
        self.pool.append(&mut self.tx.bufs);
        self.tx.buf_bytes = 0;
        self.file_bytes = 0;
        self.queued = 0;
        self.last_active = Instant::now();
        self.publish();
        Ok(())
    }

    /// Validates and executes one request, queueing its reply. `payload` is the range of
    /// the receive buffer holding the WRITE data, or `None` when it is in `wbuf`.
    fn request(&mut self, h: &RequestHeader, payload: Option<(usize, usize)>) -> io::Result<()> {
        self.stream.count_requests(1);
        let validated = if h.cmd == CMD_BLOCK_STATUS && h.flags & CMD_FLAG_PAYLOAD_LEN != 0 {
            // A context filter: checked whole here, its ids kept for the reply.
            let data = match payload {
                Some((a, b)) => &self.rx[a..b],
                None => self.wbuf.get(..h.length as usize).unwrap_or_default(),
            };
            let v = self.session.validate_with(h, data);
            self.filter.clear();
            if let Ok(Command::BlockStatus { filtered: true, .. }) = v {
                self.filter.extend(block_status_filter(data));
            }
            v
        } else {
            self.session.validate(h)
        };
        let cmd = match validated {
            Ok(c) => c,
            Err(err) => {
                let msg = self.reject_message(h, err);
                log::debug!("{}: {msg}", self.stream.peer());
                self.error(h, err, &msg);
                return Ok(());
            }
        };
        match cmd {
            // A WRITE without FUA joins the requests in flight; its reply comes when it
            // completes.
            Command::Write { length, fua: false, .. } if self.queue.is_some() => {
                return self.queue_write(h, payload, length as usize);
            }
            // A FLUSH covers every write before it: answer those in flight first.
            Command::Flush => self.answer_queued(usize::MAX)?,
            _ => {}
        }
        let backend = &self.export.backend;
        let result = match cmd {
            Command::Read { offset, length, df } => return self.read(h, offset, length, df),
            Command::Write { offset, length, fua } => {
                let data = match payload {
                    Some((a, b)) => &self.rx[a..b],
                    None => &self.wbuf[..length as usize],
                };
                backend.write(data, offset, fua)
            }
            Command::Disc => {
                self.disconnect = true;
                return Ok(());
            }
            Command::Flush => backend.flush(),
            Command::Trim { offset, length, fua } => backend.trim(offset, length, fua),
            Command::Cache { offset, length } => backend.cache(offset, length),
            Command::WriteZeroes { offset, length, fua, no_hole, fast } => {
                backend.zero(offset, length, ZeroMode { may_trim: !no_hole, fast }, fua)
            }
            Command::BlockStatus { offset, length, req_one, filtered } => {
                return self.block_status(h, offset, length, req_one, filtered)
            }
        };
        self.reply(h, result);
        Ok(())
    }

    /// Queues the reply to a request that carries no data back: success or its error.
    fn reply(&mut self, h: &RequestHeader, result: ferry_backend::Result<()>) {
        match result {
            Ok(()) => {
                let s = self.tx.headers.len();
                self.writer.ok(h.cookie, h.offset, &mut self.tx.headers);
                self.tx.header_from(s);
            }
            Err(e) => {
                log::debug!("{}: export {:?}: {e}", self.stream.peer(), self.export.name);
                self.error(h, e.nbd_error(), &e.to_string());
            }
        }
    }

    fn error(&mut self, h: &RequestHeader, err: NbdError, msg: &str) {
        let s = self.tx.headers.len();
        self.writer.error(h.cookie, h.offset, err, msg, &mut self.tx.headers);
        self.tx.header_from(s);
    }

    fn reject_message(&self, h: &RequestHeader, err: NbdError) -> String {
        let what = format!("{} at offset {} length {}", command_name(h.cmd), h.offset, h.length);
        match err {
            NbdError::Perm => format!("{what}: export {:?} is read-only", self.export.name),
            NbdError::NoSpc => format!("{what}: beyond the end of the {}-byte export", self.session.size),
            NbdError::Overflow => {
                format!("{what}: longer than the {}-byte maximum; retry smaller", self.session.max_payload)
            }
            _ if h.offset.checked_add(h.length).is_none_or(|e| e > self.session.size) => {
                format!("{what}: beyond the end of the {}-byte export", self.session.size)
            }
            _ => format!("{what} (flags 0x{:x}): invalid request ({})", h.flags, err.text()),
        }
    }

    fn read(&mut self, h: &RequestHeader, offset: u64, length: u32, df: bool) -> io::Result<()> {
        let len = length as usize;
        if self.tx.used > 0 && self.tx.used + len > self.tx.data.len() {
            self.flush()?;
        }
        // Sparse read: holes go back as OFFSET_HOLE chunks, only data is read and sent.
        if !df && self.sparse_threshold.is_some_and(|t| u64::from(length) >= t) {
            self.extents.clear();
            if self.export.backend.extents(offset, u64::from(length), 1024, &mut self.extents).is_ok()
                && self.extents.iter().any(|e| e.flags & ferry_proto::consts::STATE_ZERO != 0)
                && self.extents.iter().map(|e| e.length).sum::<u64>() == u64::from(length)
            {
                return self.read_sparse(h, offset);
            }
        }
        let in_file = if self.sendfile && len >= SENDFILE_MIN {
            self.export.backend.file_offset(offset, u64::from(length))
        } else {
            None
        };
        if let Some(at) = in_file {
            self.queue_file(h, offset, at, len, true);
            return Ok(());
        }
        let (a, b) = self.tx.reserve(len);
        let result = self.export.backend.read(&mut self.tx.data[a..b], offset);
        if result.is_err() {
            // Nothing of this read is sent: the next one may reuse its space.
            self.tx.used = a;
        }
        self.read_reply(h, offset, b - a, result.map(|()| Part::Data(a, b)));
        Ok(())
    }

    /// Queues a chunk of READ data (`len` bytes at export offset `pos`) that goes out with
    /// sendfile from file offset `at`; `last`: it ends the reply (see [`FilePart`]).
    fn queue_file(&mut self, h: &RequestHeader, pos: u64, at: u64, len: usize, last: bool) {
        let s = self.tx.headers.len();
        self.writer.data(h.cookie, h.offset, pos, len, false, &mut self.tx.headers);
        self.tx.header_from(s);
        let mut f = FilePart { at, len, cookie: h.cookie, req_offset: h.offset, pos, trailer: 0, last };
        let i = self.tx.parts.len();
        self.tx.parts.push(Part::File(f));
        if last && self.writer.chunked() {
            let t = self.tx.headers.len();
            self.writer.done(h.cookie, h.offset, &mut self.tx.headers);
            self.tx.header_from(t);
            f.trailer = self.tx.headers.len() - t;
            self.tx.parts[i] = Part::File(f);
        }
        self.file_bytes += len;
    }

    /// Queues the reply to a READ of `len` bytes at `offset`: its data (where the backend
    /// put it), or the backend's error.
    fn read_reply(&mut self, h: &RequestHeader, offset: u64, len: usize, result: ferry_backend::Result<Part>) {
        let s = self.tx.headers.len();
        match result {
            Ok(data) => {
                self.writer.data(h.cookie, h.offset, offset, len, true, &mut self.tx.headers);
                self.tx.header_from(s);
                self.tx.parts.push(data);
            }
            Err(e) => {
                log::debug!("{}: export {:?}: {e}", self.stream.peer(), self.export.name);
                self.writer.error_offset(
                    h.cookie,
                    h.offset,
                    e.nbd_error(),
                    &e.to_string(),
                    offset,
                    &mut self.tx.headers,
                );
                self.tx.header_from(s);
            }
        }
    }

    /// Submits the run of valid READ requests at the front of the receive buffer to the
    /// queue, answering the oldest requests in flight whenever the next would not fit
    /// ([`IN_FLIGHT`], [`IN_FLIGHT_BYTES`]). Stops at the first request that
    /// is anything else (or incomplete), which the caller then handles.
    fn queue_reads(&mut self, ext: bool) -> io::Result<()> {
        let hlen = RequestHeader::wire_len(ext);
        loop {
            let Ok(Some(h)) = RequestHeader::parse(&self.rx[self.head..self.tail], ext) else { return Ok(()) };
            if h.check_payload(ext) != Ok(PayloadPlan::Receive(0)) {
                return Ok(());
            }
            let Ok(Command::Read { offset, length, .. }) = self.session.validate(&h) else { return Ok(()) };
            let len = length as usize;
            let buf = self.queue_buffer(len)?;
            let Some(queue) = self.queue.as_mut() else { return Ok(()) };
            self.head += hlen;
            self.stream.count_requests(1);
            queue.submit_read(buf, offset);
            self.in_flight.push_back(h);
            self.in_flight_bytes += len;
            self.large_writes = false;
            // Reads the queue answered at once (a snapshot's cached chunks) go out in
            // batches as they are answered, so the client works on them while the rest
            // are read: answered only after every request received, client and server
            // took turns, each idle while the other worked (half the IOPS).
            if self.queue.as_ref().is_some_and(|q| q.oldest_done()) {
                self.answer_queued(0)?;
            }
        }
    }

    /// Makes room for `len` more bytes in flight (answering the oldest requests until the
    /// limits allow it) and returns a buffer of `len` bytes for them.
    fn queue_buffer(&mut self, len: usize) -> io::Result<Vec<u8>> {
        while !self.in_flight.is_empty()
            && (self.in_flight.len() >= IN_FLIGHT || self.in_flight_bytes + len > IN_FLIGHT_BYTES)
        {
            self.answer_queued(1)?;
        }
        Ok(match self.pool.pop() {
            Some(mut b) if b.capacity() >= len => {
                b.resize(len, 0);
                b
            }
            _ => vec![0u8; len],
        })
    }

    /// Submits a validated WRITE (without FUA) to the queue, with a copy of its payload
    /// (`payload` as in [`Transmission::request`]).
    fn queue_write(&mut self, h: &RequestHeader, payload: Option<(usize, usize)>, len: usize) -> io::Result<()> {
        let mut buf = self.queue_buffer(len)?;
        buf.copy_from_slice(match payload {
            Some((a, b)) => &self.rx[a..b],
            None => &self.wbuf[..len],
        });
        let Some(queue) = self.queue.as_mut() else { return Err(io::Error::other("no queue to write through")) };
        queue.submit_write(buf, h.offset);
        self.in_flight.push_back(*h);
        self.in_flight_bytes += len;
        Ok(())
    }

    /// Queues the replies of every completed request in flight, and of the oldest `wait`
    /// ones whether completed or not (waiting for them), sending as the batch fills.
    fn answer_queued(&mut self, mut wait: usize) -> io::Result<()> {
        while let Some(queue) = self.queue.as_mut() {
            if queue.is_empty() || (wait == 0 && !queue.oldest_done()) {
                break;
            }
            wait = wait.saturating_sub(1);
            let (Some((buf, result)), Some(h)) = (queue.complete(), self.in_flight.pop_front()) else {
                return Err(io::Error::other("the request queue is out of step with the requests in flight"));
            };
            let len = buf.len();
            self.in_flight_bytes -= len;
            if h.cmd == ferry_proto::consts::CMD_WRITE {
                self.pool.push(buf);
                self.reply(&h, result);
            } else {
                let data = match result {
                    Ok(()) => {
                        self.tx.bufs.push(buf);
                        self.tx.buf_bytes += len;
                        Ok(Part::Buf(self.tx.bufs.len() - 1))
                    }
                    Err(e) => {
                        self.pool.push(buf);
                        Err(e)
                    }
                };
                self.read_reply(&h, h.offset, len, data);
            }
            self.queued += 1;
            self.flush_if_full()?;
        }
        Ok(())
    }

    /// Sends the queued replies once the batch is full (bytes or replies).
    fn flush_if_full(&mut self) -> io::Result<()> {
        if self.tx.used + self.file_bytes + self.tx.buf_bytes >= self.flush_bytes || self.queued >= self.flush_replies {
            self.flush()?;
        }
        Ok(())
    }

    /// The client has sent something not yet read (in the socket or the TLS layer).
    fn readable_now(&self) -> bool {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        if self.stream.buffered() {
            return true;
        }
        let mut fds = [PollFd::new(&self.stream, PollFlags::IN)];
        matches!(poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })), Ok(n) if n > 0)
    }

    /// A read whose range holds holes (`self.extents` covers it exactly).
    fn read_sparse(&mut self, h: &RequestHeader, offset: u64) -> io::Result<()> {
        let extents = std::mem::take(&mut self.extents);
        let mut pos = offset;
        let last = extents.len() - 1;
        for (i, e) in extents.iter().enumerate() {
            let done = i == last;
            let s = self.tx.headers.len();
            if e.flags & ferry_proto::consts::STATE_ZERO != 0 {
                self.writer.hole(h.cookie, h.offset, pos, e.length as u32, done, &mut self.tx.headers);
                self.tx.header_from(s);
            } else if let Some(at) = (self.sendfile && e.length as usize >= SENDFILE_MIN)
                .then(|| self.export.backend.file_offset(pos, e.length))
                .flatten()
            {
                self.queue_file(h, pos, at, e.length as usize, done);
            } else {
                let (a, b) = self.tx.reserve(e.length as usize);
                if let Err(err) = self.export.backend.read(&mut self.tx.data[a..b], pos) {
                    self.tx.used = a;
                    let msg = err.to_string();
                    self.writer.error_offset(h.cookie, h.offset, err.nbd_error(), &msg, pos, &mut self.tx.headers);
                    self.tx.header_from(s);
                    break;
                }
                self.writer.data(h.cookie, h.offset, pos, e.length as usize, done, &mut self.tx.headers);
                self.tx.header_from(s);
                self.tx.parts.push(Part::Data(a, b));
            }
            pos += e.length;
        }
        self.extents = extents;
        Ok(())
    }

    /// Answers a BLOCK_STATUS from every selected context (or those its filter names):
    /// one chunk each, DONE on the last. A context that fails ends the reply with an
    /// error chunk (the chunks before it are void).
    fn block_status(
        &mut self,
        h: &RequestHeader,
        offset: u64,
        length: u64,
        req_one: bool,
        filtered: bool,
    ) -> io::Result<()> {
        let wanted = |filter: &[u32], id: u32| !filtered || filter.contains(&id);
        let answered = self.contexts.iter().filter(|(id, _)| wanted(&self.filter, *id)).count();
        let s = self.tx.headers.len();
        let Some(last) = self.contexts.iter().rposition(|(id, _)| wanted(&self.filter, *id)) else {
            // Validation lets no BLOCK_STATUS through without a context to answer.
            self.writer.error(
                h.cookie,
                h.offset,
                NbdError::Inval,
                "no metadata context selected",
                &mut self.tx.headers,
            );
            self.tx.header_from(s);
            return Ok(());
        };
        let max = if req_one { 1 } else { (MAX_EXTENTS / answered.max(1)).max(1) };
        for i in 0..=last {
            let (id, ctx) = (self.contexts[i].0, self.contexts[i].1.clone());
            if !wanted(&self.filter, id) {
                continue;
            }
            self.extents.clear();
            match ctx.extents(offset, length, max, &mut self.extents) {
                Ok(()) => {
                    clip_extents(&mut self.extents, length, max);
                    if self.extents.is_empty() {
                        let msg = format!("metadata context {} returned no extents", ctx.name());
                        self.writer.error(h.cookie, h.offset, NbdError::Io, &msg, &mut self.tx.headers);
                        break;
                    }
                    self.writer.block_status_chunk(
                        h.cookie,
                        h.offset,
                        id,
                        &self.extents,
                        i == last,
                        &mut self.tx.headers,
                    );
                }
                Err(e) => {
                    log::debug!("{}: export {:?}: {}: {e}", self.stream.peer(), self.export.name, ctx.name());
                    let msg = format!("{}: {e}", ctx.name());
                    self.writer.error(h.cookie, h.offset, e.nbd_error(), &msg, &mut self.tx.headers);
                    break;
                }
            }
        }
        self.tx.header_from(s);
        Ok(())
    }
}

/// Keeps a context's answer within the request: no empty extent, nothing past
/// `length` bytes (so compact replies' 32-bit lengths hold), at most `max` extents.
fn clip_extents(extents: &mut Vec<Extent>, length: u64, max: usize) {
    extents.retain(|e| e.length > 0);
    let mut left = length;
    let mut keep = 0;
    for e in extents.iter_mut() {
        if left == 0 || keep == max {
            break;
        }
        e.length = e.length.min(left);
        left -= e.length;
        keep += 1;
    }
    extents.truncate(keep);
}
