//! The poller: one thread that watches every idle ("parked") connection.
//!
//! A connection's thread that waited [`Config::idle_grace`] for a request with nothing
//! left to answer gives its buffers back and hands the connection (socket and session
//! state, a few hundred bytes) to this thread, then ends. The poller keeps parked
//! connections in one epoll set; when one becomes readable (a request, or the client
//! closing) it starts a thread that takes the connection back and serves it as before.
//! With `--idle-timeout` it also closes connections that stayed silent for that long.
//!
//! [`Config::idle_grace`]: crate::Config::idle_grace

use crate::conn::Transmission;
use crate::server::Shared;
use rustix::event::epoll;
use rustix::event::{eventfd, EventfdFlags};
use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The key of the wake-up eventfd in the epoll set (connections use their ids + 1).
const WAKE: u64 = 0;
/// Events taken per `epoll_wait`.
const BATCH: usize = 256;

pub(crate) struct Poller {
    epoll: OwnedFd,
    wake: OwnedFd,
    tx: Sender<Box<Transmission>>,
    rx: Mutex<Option<Receiver<Box<Transmission>>>>,
    parked: AtomicUsize,
}

impl Poller {
    pub(crate) fn new() -> io::Result<Poller> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        epoll::add(&epoll, &wake, epoll::EventData::new_u64(WAKE), epoll::EventFlags::IN)?;
        let (tx, rx) = channel();
        Ok(Poller { epoll, wake, tx, rx: Mutex::new(Some(rx)), parked: AtomicUsize::new(0) })
    }

    /// Connections parked now.
    pub(crate) fn parked(&self) -> usize {
        self.parked.load(Ordering::Relaxed)
    }

    /// Starts the poller thread (once).
    pub(crate) fn start(&self, shared: Arc<Shared>) -> io::Result<JoinHandle<()>> {
        let rx = self.rx.lock().unwrap_or_else(|e| e.into_inner()).take().expect("the poller starts once");
        std::thread::Builder::new().name("poller".into()).spawn(move || run(&shared, rx))
    }

    /// Hands an idle connection (buffers already released) to the poller thread.
    pub(crate) fn park(&self, t: Box<Transmission>) {
        self.parked.fetch_add(1, Ordering::Relaxed);
        let sent = self.tx.send(t);
        if let Err(std::sync::mpsc::SendError(t)) = sent {
            // The poller has ended (shutdown): close it here, as the poller would have.
            self.parked.fetch_sub(1, Ordering::Relaxed);
            t.close(Ok(()));
            return;
        }
        self.wake();
    }

    /// Makes the poller look at new connections and the stop flag.
    pub(crate) fn wake(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }
}

fn run(shared: &Arc<Shared>, rx: Receiver<Box<Transmission>>) {
    let p = &shared.poller;
    let mut conns: HashMap<u64, Box<Transmission>> = HashMap::new();
    let mut next_key = WAKE + 1;
    let mut events: Vec<epoll::Event> = Vec::with_capacity(BATCH);
    let idle_timeout = shared.config.idle_timeout;
    // How often silent connections are looked for: a quarter of the timeout, so one is
    // closed at most 25% late.
    let tick = idle_timeout.map(|t| (t / 4).clamp(Duration::from_millis(50), Duration::from_secs(1)));
    let mut next_scan = tick.map(|t| Instant::now() + t);
    loop {
        let timeout = next_scan.map(|at| {
            let d = at.saturating_duration_since(Instant::now());
            rustix::event::Timespec { tv_sec: d.as_secs() as i64, tv_nsec: i64::from(d.subsec_nanos()) }
        });
        events.clear();
        match epoll::wait(&p.epoll, rustix::buffer::spare_capacity(&mut events), timeout.as_ref()) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                log::error!("poller: epoll_wait failed: {e}; closing {} idle connections", conns.len());
                break;
            }
        }
        for ev in &events {
            let key = ev.data.u64();
            if key == WAKE {
                let mut b = [0u8; 8];
                let _ = rustix::io::read(&p.wake, &mut b);
                continue;
            }
            if let Some(t) = conns.remove(&key) {
                p.parked.fetch_sub(1, Ordering::Relaxed);
                let _ = epoll::delete(&p.epoll, t.fd());
                Shared::spawn(format!("conn-{}", t.id()), move || crate::conn::resume(t));
            }
        }
        while let Ok(t) = rx.try_recv() {
            let key = next_key;
            next_key += 1;
            let flags = epoll::EventFlags::IN | epoll::EventFlags::RDHUP;
            match epoll::add(&p.epoll, t.fd(), epoll::EventData::new_u64(key), flags) {
                Ok(()) => {
                    conns.insert(key, t);
                }
                Err(e) => {
                    log::warn!("{}: cannot watch an idle connection ({e}); closing it", t.peer());
                    p.parked.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        if let (Some(limit), Some(at), Some(tick)) = (idle_timeout, next_scan, tick) {
            let now = Instant::now();
            if now >= at {
                let silent: Vec<u64> = conns
                    .iter()
                    .filter(|(_, t)| now.duration_since(t.last_active()) >= limit)
                    .map(|(k, _)| *k)
                    .collect();
                for key in &silent {
                    if let Some(t) = conns.remove(key) {
                        log::debug!("{}: closing after {limit:?} without a request (--idle-timeout)", t.peer());
                        let _ = epoll::delete(&p.epoll, t.fd());
                        t.close(Ok(()));
                    }
                }
                if !silent.is_empty() {
                    p.parked.fetch_sub(silent.len(), Ordering::Relaxed);
                    log::info!("closed {} connections idle for {limit:?} or more (--idle-timeout)", silent.len());
                }
                next_scan = Some(now + tick);
            }
        }
    }
    // Shutdown: parked connections have nothing in flight; closing them is all there is.
    p.parked.fetch_sub(conns.len(), Ordering::Relaxed);
    for (_, t) in conns.drain() {
        t.close(Ok(()));
    }
    // Connections sent before the receiver goes are closed here; any parked after it find
    // it gone and close themselves (`park`).
    for t in rx.try_iter() {
        p.parked.fetch_sub(1, Ordering::Relaxed);
        t.close(Ok(()));
    }
    drop(rx);
}
