//! The accept loop: listeners, connection limits, and clean shutdown.

use crate::conn;
use crate::exports::Exports;
use crate::poller::Poller;
use crate::zerocopy::ZeroCopy;
use ferry_sock::{BufferConfig, Counters, Listener, Stream};
use rustix::event::{poll, PollFd, PollFlags};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::IpAddr;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Server settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Connections over this many are closed at once (see [`connection_ceiling`]).
    pub max_connections: usize,
    /// Connections from one client IP address over this many are closed at once
    /// (TCP only; `None`: no per-client limit).
    pub max_connections_per_client: Option<usize>,
    /// Close a connection that sent nothing for this long, once everything it asked for
    /// is answered (`None`: never).
    pub idle_timeout: Option<Duration>,
    /// A connection whose thread waited this long for a request gives its buffers back
    /// and is parked on the poller thread until the socket is readable again.
    pub idle_grace: Duration,
    /// A client that has not finished the handshake by then is dropped (reading or
    /// sending: a client that does not read the replies is dropped too).
    pub handshake_timeout: Duration,
    /// After a shutdown is asked for, a connection whose client reads nothing of what is
    /// sent to it for this long is dropped, so the server stops within about this
    /// long whatever its peers do.
    pub shutdown_grace: Duration,
    /// Buffers for Unix-socket connections (see [`BufferConfig::for_unix`]).
    pub unix_buffers: BufferConfig,
    /// Buffers for TCP connections (default: leave autotuning alone).
    pub tcp_buffers: BufferConfig,
    /// Serve large reads of file exports with sendfile(2) (page cache to socket, no
    /// copy through user space).
    pub sendfile: bool,
    /// Log each connection's socket statistics when it closes.
    pub stats: bool,
    /// Replies are grouped into one vectored send until this much payload is queued or
    /// no complete request is left to execute; 0 sends every reply on its own (for
    /// measuring what grouping is worth).
    pub send_batch: usize,
    /// `--tls=off|on|require`.
    pub tls_policy: ferry_proto::TlsPolicy,
    /// Credentials; present whenever `tls_policy` is not `Off`.
    pub tls: Option<ferry_tls::ServerTls>,
    /// MSG_ZEROCOPY for large READ replies on TCP (see [`ZeroCopy`]).
    pub zerocopy: ZeroCopy,
}

/// Default of [`Config::idle_grace`]: long enough that a client with requests in flight
/// or a short pause between bursts keeps its thread (parking and waking cost a thread
/// start and a fresh buffer), short enough that thousands of idle connections hold
/// neither threads nor buffers.
pub const DEFAULT_IDLE_GRACE: Duration = Duration::from_millis(250);

/// Default of [`Config::shutdown_grace`].
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// File descriptors kept out of the connection ceiling: stdio, listeners, export files,
/// the poller's epoll and wake-up descriptors, log files, `--run`'s pipes.
pub const RESERVED_FDS: u64 = 64;

impl Default for Config {
    fn default() -> Self {
        Config {
            max_connections: 10_000,
            max_connections_per_client: None,
            idle_timeout: None,
            idle_grace: DEFAULT_IDLE_GRACE,
            handshake_timeout: Duration::from_secs(10),
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            unix_buffers: BufferConfig::for_unix(BufferConfig::default()),
            tcp_buffers: BufferConfig::default(),
            sendfile: true,
            stats: false,
            send_batch: crate::conn::DEFAULT_SEND_BATCH,
            tls_policy: ferry_proto::TlsPolicy::Off,
            tls: None,
            zerocopy: ZeroCopy::default(),
        }
    }
}

/// Raises `RLIMIT_NOFILE`'s soft limit to its hard limit and returns the new soft limit
/// (unchanged if it cannot be raised). Each connection holds one descriptor.
pub fn raise_fd_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let lim = getrlimit(Resource::Nofile);
    if lim.current.is_some() && lim.current != lim.maximum {
        let raised = rustix::process::Rlimit { current: lim.maximum, maximum: lim.maximum };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            log::debug!("cannot raise RLIMIT_NOFILE to its hard limit: {e}");
        }
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// How many connections `nofile` descriptors can hold, beside [`RESERVED_FDS`].
pub fn connection_ceiling(nofile: u64) -> usize {
    nofile.saturating_sub(RESERVED_FDS).max(1).min(usize::MAX as u64) as usize
}

/// Asks a running server to stop: stop accepting, let every connection finish the
/// requests it has received, flush the backends, return from [`Server::run`].
#[derive(Clone)]
pub struct ShutdownHandle {
    flag: Arc<AtomicBool>,
    stats_flag: Arc<AtomicBool>,
    wake: Arc<Mutex<UnixStream>>,
}

impl ShutdownHandle {
    pub fn shutdown(&self) {
        self.flag.store(true, Ordering::SeqCst);
        let _ = self.wake.lock().unwrap_or_else(|e| e.into_inner()).write(&[1]);
    }

    /// The flag that means "stop": a signal handler sets it, then writes to [`wake_fd`].
    ///
    /// [`wake_fd`]: ShutdownHandle::wake_fd
    pub fn shutdown_flag(&self) -> Arc<AtomicBool> {
        self.flag.clone()
    }

    /// The flag that means "log statistics now" (SIGUSR1).
    pub fn stats_flag(&self) -> Arc<AtomicBool> {
        self.stats_flag.clone()
    }

    /// A descriptor that wakes the server when a byte is written to it (for signal
    /// handlers, which may only write to a pipe); it then looks at the two flags.
    pub fn wake_fd(&self) -> io::Result<OwnedFd> {
        let s = self.wake.lock().unwrap_or_else(|e| e.into_inner()).try_clone()?;
        Ok(OwnedFd::from(s))
    }
}

/// Live connections: counts (in total and per client address) and statistics.
#[derive(Default)]
pub(crate) struct Registry {
    next: AtomicU64,
    active: AtomicUsize,
    per_client: Mutex<HashMap<IpAddr, usize>>,
    /// Counters of live connections (each published by its thread) ...
    live: Mutex<HashMap<u64, Arc<Mutex<Counters>>>>,
    /// ... and the sum over closed ones.
    closed: Mutex<Counters>,
}

impl Registry {
    fn totals(&self) -> Counters {
        let mut t = *lock(&self.closed);
        for c in lock(&self.live).values() {
            t.add(&lock(c));
        }
        t
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A connection's place in the registry; dropping it (wherever the connection ends:
/// its thread or the poller) removes the connection.
pub(crate) struct Slot {
    id: u64,
    ip: Option<IpAddr>,
    reg: Arc<Registry>,
    pub(crate) counters: Arc<Mutex<Counters>>,
}

impl Slot {
    pub(crate) fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(c) = lock(&self.reg.live).remove(&self.id) {
            lock(&self.reg.closed).add(&lock(&c));
        }
        if let Some(ip) = self.ip {
            let mut m = lock(&self.reg.per_client);
            if let Some(n) = m.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&ip);
                }
            }
        }
        self.reg.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What every connection thread and the poller share.
pub(crate) struct Shared {
    pub(crate) exports: Arc<Exports>,
    pub(crate) config: Config,
    /// Set on shutdown: threads stop reading, the poller closes parked connections.
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) poller: Poller,
}

/// Stack of connection threads. Their deepest path is a backend call from the
/// transmission loop (or OpenSSL's handshake) with every buffer on the heap; 256 KiB
/// is several times what they touch, and only touched pages are resident.
pub const CONN_STACK: usize = 256 * 1024;

impl Shared {
    /// Runs `f` on a new connection thread; `false` if no thread could be started (then
    /// `f`, and the connection it owns, is dropped: the socket closes).
    pub(crate) fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> bool {
        match std::thread::Builder::new().name(name).stack_size(CONN_STACK).spawn(f) {
            Ok(_) => true,
            Err(e) => {
                log::error!("cannot start a connection thread: {e}");
                false
            }
        }
    }
}

/// A warning that is logged at most once per interval, with a count of the ones
/// held back.
struct RateLimited {
    last: Option<Instant>,
    held: u64,
}

impl RateLimited {
    const INTERVAL: Duration = Duration::from_secs(5);

    fn warn(&mut self, msg: std::fmt::Arguments<'_>) {
        if self.last.is_some_and(|t| t.elapsed() < Self::INTERVAL) {
            self.held += 1;
            return;
        }
        if self.held > 0 {
            log::warn!("{msg} ({} more like this in the last {} s)", self.held, Self::INTERVAL.as_secs());
        } else {
            log::warn!("{msg}");
        }
        self.last = Some(Instant::now());
        self.held = 0;
    }
}

pub struct Server {
    exports: Arc<Exports>,
    config: Config,
    flag: Arc<AtomicBool>,
    wake_rx: UnixStream,
    handle: ShutdownHandle,
    totals: Counters,
}

impl Server {
    pub fn new(exports: Exports, config: Config) -> io::Result<Server> {
        let (rx, tx) = UnixStream::pair()?;
        rx.set_nonblocking(true)?;
        let flag = Arc::new(AtomicBool::new(false));
        let stats_flag = Arc::new(AtomicBool::new(false));
        let handle = ShutdownHandle { flag: flag.clone(), stats_flag, wake: Arc::new(Mutex::new(tx)) };
        Ok(Server { exports: Arc::new(exports), config, flag, wake_rx: rx, handle, totals: Counters::default() })
    }

    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.handle.clone()
    }

    pub fn exports(&self) -> &Exports {
        &self.exports
    }

    /// Socket statistics summed over every connection of the last [`Server::run`].
    pub fn totals(&self) -> Counters {
        self.totals
    }

    /// Serves until shut down. Returns after every connection has finished.
    pub fn run(&mut self, listeners: &[Listener]) -> io::Result<()> {
        for l in listeners {
            l.set_nonblocking(true)?;
        }
        let reg = Arc::new(Registry::default());
        let shared = Arc::new(Shared {
            exports: self.exports.clone(),
            config: self.config.clone(),
            stop: self.flag.clone(),
            poller: Poller::new()?,
        });
        let poller = shared.poller.start(shared.clone())?;
        let mut refusals = RateLimited { last: None, held: 0 };
        let mut accept_errors = RateLimited { last: None, held: 0 };
        while !self.flag.load(Ordering::SeqCst) {
            let mut fds: Vec<PollFd> = listeners.iter().map(|l| PollFd::new(l, PollFlags::IN)).collect();
            fds.push(PollFd::new(&self.wake_rx, PollFlags::IN));
            match poll(&mut fds, None) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
            drop(fds);
            if ready[listeners.len()] {
                let mut b = [0u8; 64];
                while matches!((&self.wake_rx).read(&mut b), Ok(n) if n > 0) {}
                if self.handle.stats_flag.swap(false, Ordering::SeqCst) {
                    let live = reg.active.load(Ordering::SeqCst);
                    let parked = shared.poller.parked();
                    log::info!("statistics ({live} connections open, {parked} of them idle): {}", reg.totals());
                }
                if self.flag.load(Ordering::SeqCst) {
                    break;
                }
                continue;
            }
            for (l, _) in listeners.iter().zip(&ready).filter(|(_, r)| **r) {
                loop {
                    let stream = match l.accept() {
                        Ok(s) => s,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            // EMFILE and friends: log, back off, keep serving the others.
                            let open = reg.active.load(Ordering::SeqCst);
                            accept_errors.warn(format_args!(
                                "accept failed with {open} connections open: {e} (raise the hard \
                                 RLIMIT_NOFILE, or lower --max-connections)"
                            ));
                            std::thread::sleep(Duration::from_millis(50));
                            break;
                        }
                    };
                    match self.admit(&stream, &reg) {
                        Ok(slot) => self.spawn(stream, slot, &shared),
                        Err(why) => refusals.warn(format_args!("refusing connection from {}: {why}", stream.peer())),
                    }
                }
            }
        }
        log::info!("shutting down: finishing in-flight requests");
        shared.poller.wake();
        // Threads see the flag within one idle grace period (their read timeout), or
        // after answering what they are executing; the poller closes parked ones.
        while reg.active.load(Ordering::SeqCst) > 0 {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = poller.join();
        self.totals = reg.totals();
        for e in self.exports.iter() {
            if let Err(err) = e.backend.flush() {
                log::error!("flushing export {:?} at shutdown: {err}", e.name);
            }
        }
        Ok(())
    }

    /// Counts a new connection in, or says which limit refuses it.
    fn admit(&self, stream: &Stream, reg: &Arc<Registry>) -> Result<Slot, String> {
        let max = self.config.max_connections;
        if reg.active.load(Ordering::SeqCst) >= max {
            return Err(format!("{max} connections already open (--max-connections)"));
        }
        // Clients are counted by address only where a per-client limit is set.
        let ip = self.config.max_connections_per_client.and_then(|_| stream.peer_ip());
        if let (Some(ip), Some(limit)) = (ip, self.config.max_connections_per_client) {
            let mut m = lock(&reg.per_client);
            let n = m.entry(ip).or_insert(0);
            if *n >= limit {
                return Err(format!("{limit} connections from {ip} already open (--max-connections-per-client)"));
            }
            *n += 1;
        }
        reg.active.fetch_add(1, Ordering::SeqCst);
        let id = reg.next.fetch_add(1, Ordering::SeqCst);
        let counters = Arc::new(Mutex::new(Counters::default()));
        lock(&reg.live).insert(id, counters.clone());
        Ok(Slot { id, ip, reg: reg.clone(), counters })
    }

    fn spawn(&self, stream: Stream, slot: Slot, shared: &Arc<Shared>) {
        let shared = shared.clone();
        let name = format!("conn-{}", slot.id);
        Shared::spawn(name, move || {
            let bufs = if stream.is_unix() { shared.config.unix_buffers } else { shared.config.tcp_buffers };
            if let Err(e) = stream.apply(bufs) {
                log::warn!("{}: cannot set socket buffers: {e}", stream.peer());
            }
            conn::serve(stream, slot, shared);
        });
    }
}
