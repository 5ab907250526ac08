//! The accept loop: listeners, the connection cap, and clean shutdown.

use crate::conn;
use crate::exports::Exports;
use crate::zerocopy::ZeroCopy;
use ferry_sock::{BufferConfig, Counters, Listener, Stream};
use rustix::event::{poll, PollFd, PollFlags};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Server settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Connections over this many are closed at once.
    pub max_connections: usize,
    /// A client that has not finished the handshake by then is dropped.
    pub handshake_timeout: Duration,
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

impl Default for Config {
    fn default() -> Self {
        Config {
            max_connections: 100,
            handshake_timeout: Duration::from_secs(10),
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

/// Live connections, so shutdown can stop them reading.
#[derive(Default)]
struct Registry {
    next: AtomicU64,
    active: AtomicUsize,
    streams: Mutex<HashMap<u64, Stream>>,
    /// Counters of live connections (each published by its thread) ...
    live: Mutex<HashMap<u64, Arc<Mutex<Counters>>>>,
    /// ... and the sum over closed ones.
    closed: Mutex<Counters>,
}

impl Registry {
    fn totals(&self) -> Counters {
        let mut t = *self.closed.lock().unwrap_or_else(|e| e.into_inner());
        for c in self.live.lock().unwrap_or_else(|e| e.into_inner()).values() {
            t.add(&c.lock().unwrap_or_else(|e| e.into_inner()));
        }
        t
    }
}

/// Removes a connection from the registry when its thread ends, however it ends.
struct Slot {
    id: u64,
    reg: Arc<Registry>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.reg.streams.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
        if let Some(c) = self.reg.live.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id) {
            self.reg.closed.lock().unwrap_or_else(|e| e.into_inner()).add(&c.lock().unwrap_or_else(|e| e.into_inner()));
        }
        self.reg.active.fetch_sub(1, Ordering::SeqCst);
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
        let mut threads: Vec<JoinHandle<()>> = Vec::new();
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
                    log::info!("statistics ({live} connections open): {}", reg.totals());
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
                            log::warn!("accept failed: {e}");
                            std::thread::sleep(Duration::from_millis(50));
                            break;
                        }
                    };
                    if let Some(t) = self.spawn(stream, &reg) {
                        threads.push(t);
                    }
                }
            }
            threads.retain(|t| !t.is_finished());
        }
        log::info!("shutting down: finishing in-flight requests");
        for s in reg.streams.lock().unwrap_or_else(|e| e.into_inner()).values() {
            let _ = s.shutdown(Shutdown::Read);
        }
        for t in threads {
            let _ = t.join();
        }
        self.totals = reg.totals();
        for e in self.exports.iter() {
            if let Err(err) = e.backend.flush() {
                log::error!("flushing export {:?} at shutdown: {err}", e.name);
            }
        }
        Ok(())
    }

    fn spawn(&self, stream: Stream, reg: &Arc<Registry>) -> Option<JoinHandle<()>> {
        let peer = stream.peer();
        if reg.active.load(Ordering::SeqCst) >= self.config.max_connections {
            log::warn!(
                "refusing connection from {peer}: {} connections already open (--max-connections)",
                self.config.max_connections
            );
            return None;
        }
        reg.active.fetch_add(1, Ordering::SeqCst);
        let id = reg.next.fetch_add(1, Ordering::SeqCst);
        let slot = Slot { id, reg: reg.clone() };
        if let Ok(clone) = stream.try_clone() {
            reg.streams.lock().unwrap_or_else(|e| e.into_inner()).insert(id, clone);
        }
        let counters = Arc::new(Mutex::new(Counters::default()));
        reg.live.lock().unwrap_or_else(|e| e.into_inner()).insert(id, counters.clone());
        if self.flag.load(Ordering::SeqCst) {
            return None;
        }
        let exports = self.exports.clone();
        let config = self.config.clone();
        let peer2 = peer.clone();
        let spawned = std::thread::Builder::new().name(format!("conn-{id}")).spawn(move || {
            let _slot = slot;
            let peer = peer2;
            let bufs = if stream.is_unix() { config.unix_buffers } else { config.tcp_buffers };
            if let Err(e) = stream.apply(bufs) {
                log::warn!("{peer}: cannot set socket buffers: {e}");
            }
            match conn::serve(stream, &exports, &config, &counters) {
                Ok(()) => log::debug!("{peer}: connection closed"),
                Err(e) => log::info!("{peer}: connection dropped: {e}"),
            }
        });
        match spawned {
            Ok(t) => Some(t),
            Err(e) => {
                log::error!("cannot start a thread for {peer}: {e}");
                None
            }
        }
    }
}
