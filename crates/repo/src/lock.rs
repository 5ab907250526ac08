//! Repository locks (FORMAT.md §8) over a [`Store`].
//!
//! Taking a lock writes it, then lists `locks/`: of two conflicting locks that see each
//! other, the one with the earlier `(time, name)` holds and the other removes itself. Times
//! have nanoseconds, so the order is the order in which they were taken. A holder rewrites
//! its lock every [`REFRESH`]; a lock not refreshed for [`STALE_AFTER`] (by its own time
//! and, where the store tells it, by the store's time of its last write: [`stale_by_time`]),
//! or left on this host by a process that no longer runs ([`holder_gone`]: none with its
//! number, a zombie, or another process started since under that number), is stale and
//! removed by whoever meets it.
use crate::format::{self, Lock, LockKind};
use crate::repo::{hostname, parse_time};
use crate::store::{Store, StoreTime};
use crate::{Error, Result};
use std::io;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

/// How often a holder rewrites its lock.
pub const REFRESH: Duration = Duration::from_secs(5 * 60);
/// The first retry after a refresh that failed (a network error): then twice as long each
/// time, up to [`REFRESH`] ([`retry_after`]), so that a short outage costs seconds, not a
/// fifth of the [`LOST_AFTER`] budget.
const RETRY_FIRST: Duration = Duration::from_secs(10);

/// How long the refresher waits before its next write after `failures` failed ones in a
/// row: [`REFRESH`] when the last one succeeded.
fn retry_after(failures: u32) -> Duration {
    match failures {
        0 => REFRESH,
        n => RETRY_FIRST.saturating_mul(1 << (n - 1).min(16)).min(REFRESH),
    }
}

/// How long a new lock waits for a later conflicting lock to go away before it gives
/// way to it.
const SETTLE: Duration = Duration::from_secs(3);
/// A lock not refreshed for this long is stale.
pub const STALE_AFTER: Duration = Duration::from_secs(30 * 60);
/// A holder counts its lock lost once it has not confirmed a refresh for this long,
/// though the object be there: another process may have taken it for stale and removed
/// it, and a refresh that landed late (a stopped process, a retried PUT) written it
/// again. The slack covers clocks that run at other rates.
pub const LOST_AFTER: Duration = Duration::from_secs(25 * 60);

/// When the lock was last confirmed written: the start of the last write of it that
/// succeeded, by [`boot_clock`].
type Confirmed = Arc<Mutex<Duration>>;

/// The time since boot, counting the time the machine slept (CLOCK_BOOTTIME): a stopped
/// or suspended process still sees it advance, and a step of the wall clock (NTP setting
/// the clock of a machine without one at boot) does not move it.
fn boot_clock() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    Duration::new(t.tv_sec.max(0) as u64, t.tv_nsec.clamp(0, 999_999_999) as u32)
}

/// How long ago the lock was last confirmed written, when that is more than
/// [`LOST_AFTER`].
fn unconfirmed(confirmed: &Confirmed) -> Option<Duration> {
    let at = *confirmed.lock().unwrap_or_else(|e| e.into_inner());
    let ago = boot_clock().saturating_sub(at);
    (ago > LOST_AFTER).then_some(ago)
}

/// A held lock: refreshed in the background every 5 minutes, removed when dropped.
pub struct LockGuard {
    _store: Arc<dyn Store>,
    name: String,
    stop: Arc<(Mutex<bool>, Condvar)>,
    refresher: Option<JoinHandle<()>>,
    /// The lock object was found gone (removed by another process that took it for stale),
    /// or not confirmed refreshed for [`LOST_AFTER`].
    lost: Arc<std::sync::atomic::AtomicBool>,
    confirmed: Confirmed,
}

impl LockGuard {
    /// The lock's object name (`locks/...`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Set once the lock is found gone (by [`LockGuard::check`] or the refresher): a
    /// flag a hot path may test without I/O.
    pub(crate) fn lost_flag(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.lost.clone()
    }

    /// Whether the lock is still held: its object is there, was never found gone, and a
    /// refresh of it was confirmed less than [`LOST_AFTER`] ago (after the store said it
    /// is there: a process stopped meanwhile counts from when it was). Called before a
    /// backup stores an index object, a checkpoint or its manifest, and before a gc
    /// deletes, so that a process whose lock another one removed as stale stops instead
    /// of acting unprotected. A store that cannot tell fails it too.
    pub fn check(&self) -> Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        if !self.lost.load(SeqCst) {
            if let Some(ago) = unconfirmed(&self.confirmed) {
                log::warn!(
                    "the lock {} of this process was last confirmed refreshed {} minutes ago: another process may \
                     have taken it for stale",
                    self.name,
                    ago.as_secs() / 60
                );
                self.lost.store(true, SeqCst);
            }
        }
        if !self.lost.load(SeqCst) {
            match self._store.len(&self.name) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => self.lost.store(true, SeqCst),
                Err(e) => {
                    return Err(Error::store(
                        format!(
                            "cannot tell whether the lock {} of this process is still in {}; stopping before anything \
                             else is stored or deleted: run it again",
                            self.name,
                            self._store.describe()
                        ),
                        e,
                    ))
                }
            }
        }
        if self.lost.load(SeqCst) {
            return Err(crate::Error::Locked(format!(
                "the lock {} of this process was removed from {} while it ran, or went unrefreshed for long enough \
                 to be (another process took it for stale: the process stopped or frozen, a clock far off, or \
                 refreshes failing for 25 minutes); stopping before anything else is stored or deleted: run it again",
                self.name,
                self._store.describe()
            )));
        }
        Ok(())
    }

    /// Makes the last confirmed refresh `ago` earlier.
    #[cfg(test)]
    pub(crate) fn confirmed_earlier(&self, ago: Duration) {
        let mut c = self.confirmed.lock().unwrap();
        *c = c.saturating_sub(ago);
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        {
            let (m, c) = &*self.stop;
            *m.lock().unwrap_or_else(|e| e.into_inner()) = true;
            c.notify_all();
        }
        if let Some(t) = self.refresher.take() {
            let _ = t.join();
        }
        if let Err(e) = self._store.delete(&self.name) {
            log::warn!(
                "cannot remove the lock {} from {}: {e}; it goes stale in 30 minutes",
                self.name,
                self._store.describe()
            );
        }
    }
}

/// The lock's time format: RFC 3339 UTC with nanoseconds, so that both the parsed times
/// and the strings order as the locks were taken.
fn now_precise() -> String {
    jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S%.9fZ").to_string()
}

/// The lock a process asks for: its kind, its disk's tag (backups), whether it follows
/// the condemned-pack rules ([`Lock::condemned`]) and whether it is a reader's shared one
/// ([`Lock::shared`]).
#[derive(Debug, Clone, Copy)]
pub struct Wanted<'a> {
    pub kind: LockKind,
    pub disk: Option<&'a str>,
    pub condemned: bool,
    pub shared: bool,
}

/// Whether the lock `mine` conflicts with `other`. A gc and a backup that both follow
/// the condemned-pack rules run side by side (FORMAT.md §8a); so do shared (reader)
/// locks, which exclude every other forget and gc.
pub fn conflicts(mine: &Wanted, other: &Lock) -> bool {
    use LockKind::*;
    match (mine.kind, other.kind) {
        (Gc, Backup) | (Backup, Gc) => !(mine.condemned && other.condemned),
        (Gc, _) | (_, Gc) => true,
        (Backup, Backup) => mine.disk.is_some() && mine.disk == other.disk.as_deref(),
        (Forget, Forget) => !(mine.shared && other.shared),
        _ => false,
    }
}

/// Whether `lock` is stale now (FORMAT.md §8), and why; `at`: when the store says the lock
/// object was last written, where it can tell.
pub fn stale(lock: &Lock, at: Option<StoreTime>) -> Option<String> {
    if let Some(why) = stale_by_time(lock, at, SystemTime::now()) {
        return Some(why);
    }
    // A PID means something only in its machine's boot and PID namespace: a container
    // with the host's name, or a cloned machine, has other processes under those numbers.
    if lock.host == hostname() && lock.boot.is_some() && lock.boot == this_boot() {
        return holder_gone(lock.pid, lock.pid_start).map(|why| format!("{why} on {}", lock.host));
    }
    None
}

/// What `/proc/PID/stat` says of a process of this PID namespace: its state letter and
/// when it started (clock ticks after the boot, field 22). `Err` with `NotFound` when no
/// process has that number.
fn proc_stat(pid: &str) -> io::Result<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat(&text).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("/proc/{pid}/stat: {text:?}")))
}

/// The state and start time in a `/proc/PID/stat` line. The command name (field 2) is in
/// parentheses and may hold spaces and parentheses itself: the fields after it start
/// after the last `)`.
fn parse_stat(text: &str) -> Option<(char, u64)> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 3 is the state; field 22 the start time.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// Whether `/proc`, as `/proc/self/mountinfo` shows its mount, hides the processes of
/// other users (`hidepid=` 1, 2, `noaccess` or `invisible`).
fn hides_processes(mountinfo: &str) -> bool {
    mountinfo.lines().any(|l| {
        let (mount, sup) = l.split_once(" - ").unwrap_or((l, ""));
        mount.split(' ').nth(4) == Some("/proc")
            && sup.split([' ', ',']).any(|o| o.strip_prefix("hidepid=").is_some_and(|v| v != "0" && v != "off"))
    })
}

/// This process's start time, as a lock records it ([`Lock::pid_start`]).
pub fn this_start() -> Option<u64> {
    proc_stat("self").ok().map(|(_, start)| start)
}

/// Why the holder of a lock of this machine and PID namespace, process `pid` started at
/// `start` (when the lock says), is gone, or `None` while it runs (or this cannot be
/// told). Gone: no process has the number; the process has exited and only its exit
/// status is left for a parent that does not collect it (a zombie: a container whose
/// first process reaps no children keeps a killed holder as one for ever); or the
/// number is another process's now (started at another time: the PID was reused).
pub fn holder_gone(pid: u32, start: Option<u64>) -> Option<String> {
    if pid == 0 {
        return Some("process 0 is no holder".into());
    }
    match proc_stat(&pid.to_string()) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // With /proc mounted hidepid=2 (systemd's ProtectProc=invisible) the processes
            // of other users are not shown: then a missing number says nothing.
            let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
            if hides_processes(&mountinfo) || (std::process::id() != 1 && !std::path::Path::new("/proc/1").exists()) {
                return None;
            }
            Some(format!("process {pid} no longer runs"))
        }
        Err(_) => None,
        Ok(('Z' | 'X' | 'x', _)) => Some(format!("process {pid} has exited (its parent has not collected it yet)")),
        Ok((_, now)) => match start {
            Some(s) if s != now => Some(format!(
                "process {pid} is another process now (it started at tick {now} after boot, the holder at {s}): the \
                 holder is gone and its number was reused"
            )),
            _ => None,
        },
    }
}

/// Whether `lock` went unrefreshed for [`STALE_AFTER`] at `now` (this host's clock): by
/// its `refreshed` time (its writer's clock) and, where the store tells when it was last
/// written (`at`), also by that time, measured against the store's clock when it tells
/// it (else this host's). Both must say so: a clock that is off (the writer's, this
/// host's or the store's) can make a lock stale late, never early, unless two are off.
pub fn stale_by_time(lock: &Lock, at: Option<StoreTime>, now: SystemTime) -> Option<String> {
    let refreshed = parse_time(&lock.refreshed)?;
    let now_ts = jiff::Timestamp::try_from(now).ok()?;
    let limit = jiff::SignedDuration::try_from(STALE_AFTER).unwrap_or(jiff::SignedDuration::MAX);
    if now_ts.duration_since(refreshed) <= limit {
        return None;
    }
    let Some(at) = at else {
        return Some(format!("not refreshed since {}", lock.refreshed));
    };
    let store_now = at.now.unwrap_or(now);
    let written_ago = store_now.duration_since(at.modified).unwrap_or_default();
    if written_ago <= STALE_AFTER {
        return None;
    }
    let written = jiff::Timestamp::try_from(at.modified).map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string());
    Some(format!(
        "not refreshed since {} (the store last wrote it {} minutes ago{})",
        lock.refreshed,
        written_ago.as_secs() / 60,
        written.map(|w| format!(", at {w} by its clock")).unwrap_or_default()
    ))
}

/// This machine's boot id and this process's PID namespace, as a lock records them.
pub fn this_boot() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let ns = std::fs::read_link("/proc/self/ns/pid").ok()?;
    Some(format!("{} {}", boot.trim(), ns.display()))
}

fn describe(name: &str, l: &Lock) -> String {
    format!("a {} by process {} on {} since {} ({name})", l.what(), l.pid, l.host, l.time)
}

/// The locks in the store, each with whether it is stale (and why), and the names of
/// those that cannot be read, with why.
#[allow(clippy::type_complexity)]
pub(crate) fn read_locks(
    store: &Arc<dyn Store>,
) -> Result<(Vec<(String, Lock, Option<String>)>, Vec<(String, String)>)> {
    let names =
        store.list("locks/").map_err(|e| Error::store(format!("cannot list the locks of {}", store.describe()), e))?;
    let mut out = Vec::new();
    let mut unreadable = Vec::new();
    for (name, _) in names {
        match store.get_timed(&name, format::MAX_LOCK) {
            Ok((bytes, at)) => match Lock::parse(&bytes) {
                Ok(l) => {
                    let s = stale(&l, at);
                    out.push((name, l, s))
                }
                Err(e) => unreadable.push((name, e.to_string())),
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) if e.kind() == io::ErrorKind::InvalidData => unreadable.push((name, e.to_string())),
            Err(e) => return Err(Error::store(format!("cannot read {name} from {}", store.describe()), e)),
        }
    }
    Ok((out, unreadable))
}

/// The live locks in the store (stale ones are removed when `remove`, with a warning
/// naming their holder; a caller that must change nothing, as gc's dry run, passes false
/// and they are only skipped), and the names of those that cannot be read, with why.
#[allow(clippy::type_complexity)]
pub(crate) fn live_locks(store: &Arc<dyn Store>, remove: bool) -> Result<(Vec<(String, Lock)>, Vec<(String, String)>)> {
    let (locks, unreadable) = read_locks(store)?;
    let mut live = Vec::new();
    for (name, l, stale) in locks {
        match stale {
            Some(why) if remove => {
                log::warn!("removing the stale lock of {} from {}: {why}", describe(&name, &l), store.describe());
                let _ = store.delete(&name);
            }
            Some(why) => log::warn!("the lock of {} in {} is stale: {why}", describe(&name, &l), store.describe()),
            None => live.push((name, l)),
        }
    }
    Ok((live, unreadable))
}

/// The conflicting live locks seen beside ours (`mine`, or none yet): the earliest of
/// those earlier than ours (every one, without ours), and one later than ours. Stale locks
/// met on the way are removed.
#[allow(clippy::type_complexity)]
fn conflicting(
    store: &Arc<dyn Store>,
    wanted: &Wanted,
    mine: Option<(&str, &Lock)>,
) -> Result<(Option<(String, Lock)>, Option<(String, Lock)>)> {
    let mut earliest: Option<(String, Lock)> = None;
    let mut later: Option<(String, Lock)> = None;
    let (locks, unreadable) = read_locks(store)?;
    // A lock that cannot be read may be anyone's: it conflicts with everything.
    if let Some((name, why)) = unreadable.into_iter().next() {
        return Err(Error::Locked(format!(
            "{name} in {} is not a lock this ferry can read ({why}): if no ferry process uses the \
             repository, remove it (`ferry repo unlock --force`)",
            store.describe()
        )));
    }
    for (name, l, stale) in locks {
        if Some(name.as_str()) == mine.map(|m| m.0) {
            continue;
        }
        if let Some(why) = stale {
            log::warn!("removing the stale lock of {} from {}: {why}", describe(&name, &l), store.describe());
            let _ = store.delete(&name);
            continue;
        }
        if !conflicts(wanted, &l) {
            continue;
        }
        let earlier = match mine {
            None => true,
            Some((my_name, m)) => lock_key(&l.time, &name) < lock_key(&m.time, my_name),
        };
        if !earlier {
            later = Some((name, l));
        } else if earliest.as_ref().is_none_or(|(bn, b)| lock_key(&l.time, &name) < lock_key(&b.time, bn)) {
            earliest = Some((name, l));
        }
    }
    Ok((earliest, later))
}

fn lock_key(time: &str, name: &str) -> (Option<jiff::Timestamp>, String) {
    (parse_time(time), name.to_string())
}

/// Takes a lock of `kind` (`disk`: the disk's tag, for backups). A conflicting lock held
/// by a live process gives [`crate::Error::Locked`] naming its holder (kind, host, pid,
/// since when), unless `wait` is given: then it is retried until it is free or `wait`
/// has passed. Stale locks are removed with a warning. A backup lock follows the
/// condemned-pack rules ([`Lock::condemned`]); a gc lock taken here does not (it excludes
/// every backup, as repair's): see [`acquire_gc`].
pub fn acquire(
    store: &Arc<dyn Store>,
    kind: LockKind,
    disk: Option<String>,
    wait: Option<Duration>,
) -> Result<LockGuard> {
    acquire_as(store, kind, disk, wait, kind == LockKind::Backup, false)
}

/// A reader's shared lock ([`Lock::shared`], a `forget` lock to ferries that do not know
/// it): taken by `repo copy` on its source, so that no forget or gc removes what it reads,
/// while other readers (a second copy to another repository) and backups run beside it.
pub fn acquire_shared(store: &Arc<dyn Store>, wait: Option<Duration>) -> Result<LockGuard> {
    acquire_as(store, LockKind::Forget, None, wait, false, true)
}

/// A `gc` lock that follows the condemned-pack rules: it conflicts with other gc,
/// forget and repair locks and with backup locks of older ferries, not with the backups
/// of this one (FORMAT.md §8a).
pub fn acquire_gc(store: &Arc<dyn Store>, wait: Option<Duration>) -> Result<LockGuard> {
    acquire_as(store, LockKind::Gc, None, wait, true, false)
}

fn acquire_as(
    store: &Arc<dyn Store>,
    kind: LockKind,
    disk: Option<String>,
    wait: Option<Duration>,
    condemned: bool,
    shared: bool,
) -> Result<LockGuard> {
    // A lock that others cannot parse would hold nobody off.
    let tag_ok = disk
        .as_deref()
        .is_some_and(|d| d.len() == 64 && d.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
    if (kind == LockKind::Backup) != tag_ok {
        return Err(Error::Invalid(
            "a backup lock names its disk by its tag (64 hex digits, Crypto::disk_tag), and only a backup lock does"
                .into(),
        ));
    }
    let wanted = Wanted { kind, disk: disk.as_deref(), condemned, shared };
    let start = Instant::now();
    let deadline = wait.map(|w| start + w);
    let host = hostname();
    let pid = std::process::id();
    let mut pause = Duration::from_millis(200);
    let locked = |name: &str, l: &Lock| {
        Error::Locked(format!(
            "{} is locked by {}: wait for it to end (--wait SECS), or, if that process is gone, \
             remove {name} from the repository (`ferry repo unlock`; with --force for a live-looking lock)",
            store.describe(),
            describe(name, l)
        ))
    };
    loop {
        // Wait without writing while a holder is there.
        if let (Some((name, l)), _) = conflicting(store, &wanted, None)? {
            match deadline {
                Some(d) if Instant::now() < d => {
                    std::thread::sleep(pause.min(d.saturating_duration_since(Instant::now())));
                    pause = (pause * 2).min(Duration::from_secs(1));
                    continue;
                }
                _ => return Err(locked(&name, &l)),
            }
        }
        let time = now_precise();
        let lock = Lock {
            kind,
            disk: disk.clone(),
            host: host.clone(),
            pid,
            time: time.clone(),
            refreshed: time,
            boot: this_boot(),
            pid_start: this_start(),
            condemned,
            shared,
        };
        let name = format!("locks/{}", format::hex(&crate::crypto::random::<16>()));
        let written = boot_clock();
        store
            .put(&name, &lock.to_bytes())
            .map_err(|e| Error::store(format!("cannot write a lock to {}", store.describe()), e))?;
        // Ours holds once no conflicting lock is left: an earlier one wins at once; a later
        // one removes itself when its writer sees ours, unless its writer listed before
        // ours was written and holds (then it stays, and ours gives way).
        let settle = Instant::now() + SETTLE;
        let holder = loop {
            match conflicting(store, &wanted, Some((&name, &lock))) {
                Ok((None, None)) => return Ok(start_refresh(store.clone(), name, lock, written)),
                Ok((Some(h), _)) => break h,
                Ok((None, Some(h))) if Instant::now() >= settle => break h,
                Ok((None, Some(_))) => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => {
                    let _ = store.delete(&name);
                    return Err(e);
                }
            }
        };
        let _ = store.delete(&name);
        match deadline {
            Some(d) if Instant::now() < d => {
                std::thread::sleep(pause.min(d.saturating_duration_since(Instant::now())));
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            _ => return Err(locked(&holder.0, &holder.1)),
        }
    }
}

/// Starts the thread that refreshes the lock `name` (`lock`), written just before `at`.
fn start_refresh(store: Arc<dyn Store>, name: String, lock: Lock, at: Duration) -> LockGuard {
    use std::sync::atomic::Ordering::SeqCst;
    let stop = Arc::new((Mutex::new(false), Condvar::new()));
    let lost = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let confirmed: Confirmed = Arc::new(Mutex::new(at));
    let refresher = {
        let (store, name, stop, lost, confirmed) =
            (store.clone(), name.clone(), stop.clone(), lost.clone(), confirmed.clone());
        std::thread::Builder::new()
            .name("repo-lock".into())
            .spawn(move || {
                let mut lock = lock;
                let (m, c) = &*stop;
                let mut stopped = m.lock().unwrap_or_else(|e| e.into_inner());
                let mut failures = 0;
                loop {
                    if *stopped {
                        return;
                    }
                    let (s, timeout) =
                        c.wait_timeout(stopped, retry_after(failures)).unwrap_or_else(|e| e.into_inner());
                    stopped = s;
                    if timeout.timed_out() && !*stopped && !lost.load(SeqCst) {
                        // A lock removed by another process is not made again: the
                        // holder finds it lost (LockGuard::check) and stops. Nor is one
                        // unconfirmed for so long that another may have removed it.
                        if let Some(ago) = unconfirmed(&confirmed) {
                            log::warn!(
                                "the lock {name} in {} was last confirmed refreshed {} minutes ago: it is not \
                                 written again (another process may have taken it for stale)",
                                store.describe(),
                                ago.as_secs() / 60
                            );
                            lost.store(true, SeqCst);
                            continue;
                        }
                        if matches!(store.len(&name), Err(e) if e.kind() == std::io::ErrorKind::NotFound) {
                            log::warn!("the lock {name} was removed from {} by another process", store.describe());
                            lost.store(true, SeqCst);
                            continue;
                        }
                        let at = boot_clock();
                        lock.refreshed = now_precise();
                        match store.put(&name, &lock.to_bytes()) {
                            // A write that took so long that the lock may have been taken
                            // for stale meanwhile may have landed after it was removed.
                            Ok(()) if unconfirmed(&confirmed).is_some() => {
                                log::warn!(
                                    "refreshing the lock {name} in {} took so long that another process may have \
                                     taken it for stale meanwhile: it counts as lost",
                                    store.describe()
                                );
                                lost.store(true, SeqCst);
                            }
                            Ok(()) => {
                                *confirmed.lock().unwrap_or_else(|e| e.into_inner()) = at;
                                failures = 0;
                            }
                            Err(e) => {
                                failures += 1;
                                log::warn!(
                                    "cannot refresh the lock {name} in {}: {e} (tried again in {} s)",
                                    store.describe(),
                                    retry_after(failures).as_secs()
                                );
                            }
                        }
                    }
                }
            })
            .ok()
    };
    if refresher.is_none() {
        log::warn!("cannot start the thread that refreshes the lock {name}: it goes stale in 30 minutes");
    }
    LockGuard { _store: store, name, stop, refresher, lost, confirmed }
}

/// The locks in the repository now, with whether each is stale (for `ferry repo list`
/// and messages).
pub fn list(store: &Arc<dyn Store>) -> Result<Vec<(String, crate::format::Lock, bool)>> {
    let (locks, unreadable) = read_locks(store)?;
    for (name, why) in unreadable {
        log::warn!("{name} in {} is not a lock this ferry can read: {why}", store.describe());
    }
    Ok(locks.into_iter().map(|(n, l, s)| (n, l, s.is_some())).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refresh that failed is tried again within seconds, then less and less often (at
    /// most every REFRESH): an outage of a few minutes costs a few minutes of the
    /// LOST_AFTER budget, not REFRESH per failure (it was 5 minutes a try).
    #[test]
    fn a_failed_refresh_is_tried_again_soon_then_backs_off() {
        assert_eq!(retry_after(0), REFRESH);
        assert!(retry_after(1) <= Duration::from_secs(10));
        for n in 1..40 {
            assert!(retry_after(n) <= retry_after(n + 1) && retry_after(n) <= REFRESH, "{n}");
        }
        assert_eq!(retry_after(40), REFRESH);
        // Tries before a lock refreshed last at 0 counts as lost, when every one fails.
        let (mut t, mut tries) = (REFRESH, 1);
        while t + retry_after(tries) < LOST_AFTER {
            t += retry_after(tries);
            tries += 1;
        }
        assert!(tries >= 8, "{tries} tries");
    }

    /// A lock whose refresh was last confirmed longer ago than another process waits to
    /// take it for stale counts as lost, though its object is there (again: a refresh
    /// that landed after another process removed it), and stays lost.
    #[test]
    fn a_lock_unconfirmed_for_longer_than_the_stale_bound_is_lost_though_its_object_is_there() {
        let store: Arc<dyn Store> = Arc::new(crate::store::MemStore::new());
        let g = acquire(&store, LockKind::Backup, Some("d".repeat(64)), None).unwrap();
        g.check().unwrap();
        let bytes = store.get(g.name(), format::MAX_LOCK).unwrap();
        g.confirmed_earlier(LOST_AFTER / 2);
        g.check().unwrap();
        // Removed as stale, then written back by a late refresh.
        store.delete(g.name()).unwrap();
        store.put(g.name(), &bytes).unwrap();
        g.confirmed_earlier(LOST_AFTER);
        let e = g.check().unwrap_err();
        assert!(matches!(e, Error::Locked(_)), "{e}");
        g.confirmed_earlier(Duration::ZERO);
        assert!(store.len(g.name()).is_ok());
        assert!(matches!(g.check(), Err(Error::Locked(_))), "a lost lock was found again");
        assert!(g.lost_flag().load(std::sync::atomic::Ordering::SeqCst));
    }

    /// A store that cannot say whether the lock is there fails the check (it may be gone),
    /// without counting the lock lost for good.
    #[test]
    fn a_lock_check_fails_closed_on_a_store_error() {
        use crate::tests::{Op, When};
        let failing = Arc::new(crate::tests::Hooked::new(Arc::new(crate::store::MemStore::new())));
        let store: Arc<dyn Store> = failing.clone();
        let g = acquire(&store, LockKind::Backup, Some("d".repeat(64)), None).unwrap();
        g.check().unwrap();
        // `len` fails (not with NotFound).
        failing.set_hook(Some(Box::new(|_, when, op, _| match (when, op) {
            (When::Before, Op::Len) => Err(io::Error::other("the store is unreachable")),
            _ => Ok(()),
        })));
        let e = g.check().unwrap_err();
        assert!(matches!(e, Error::Store { .. }) && e.to_string().contains("run it again"), "{e}");
        failing.set_hook(None);
        g.check().unwrap();
    }

    #[test]
    fn stat_lines_parse_whatever_the_command_name() {
        let line = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1 2 3\n";
        assert_eq!(parse_stat(line), Some(('S', 987654)));
        assert_eq!(parse_stat("7 (z) Z 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 55 0 0"), Some(('Z', 55)));
        for bad in ["", "7 (x", "7 (x) S 1 2", "7 (x) S 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 later"] {
            assert_eq!(parse_stat(bad), None, "{bad:?}");
        }
        let (state, start) = proc_stat("self").unwrap();
        assert!(state != 'Z' && Some(start) == this_start(), "{state} {start}");
    }

    #[test]
    fn hidden_processes_are_told_from_the_proc_mount() {
        let plain = "22 27 0:21 / /proc rw,relatime - proc proc rw\n30 1 8:1 / / rw - ext4 /dev/sda1 rw\n";
        assert!(!hides_processes(plain));
        for o in ["hidepid=2", "hidepid=invisible", "hidepid=1", "hidepid=noaccess"] {
            let m = format!("22 27 0:21 / /proc rw,nosuid - proc proc rw,{o},subset=pid\n");
            assert!(hides_processes(&m), "{o}");
        }
        assert!(!hides_processes("22 27 0:21 / /proc rw - proc proc rw,hidepid=0\n"));
        assert!(!hides_processes("22 27 0:21 / /mnt/proc rw - proc proc rw,hidepid=2\n"));
    }

    /// A holder killed and never collected by its parent (here: this test, until it
    /// waits) is a zombie: gone. Collected, it is gone too.
    #[test]
    fn a_zombie_holder_is_gone() {
        let mut child = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let pid = child.id();
        let (_, start) = proc_stat(&pid.to_string()).unwrap();
        assert_eq!(holder_gone(pid, Some(start)), None, "a running holder was taken for gone");
        child.kill().unwrap();
        // Until the kernel has turned it into a zombie.
        let t0 = Instant::now();
        while holder_gone(pid, Some(start)).is_none() && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(matches!(proc_stat(&pid.to_string()), Ok(('Z', _))), "not a zombie");
        let why = holder_gone(pid, Some(start)).unwrap();
        assert!(why.contains("has exited"), "{why}");
        assert!(holder_gone(pid, None).is_some(), "a zombie of a lock without a start time is live");
        child.wait().unwrap();
        assert!(holder_gone(pid, Some(start)).unwrap().contains("no longer runs"));
    }

    /// A lock whose PID runs now, started at another time than the lock says: the number
    /// was reused by another process.
    #[test]
    fn a_reused_pid_is_gone() {
        let me = std::process::id();
        let start = this_start().unwrap();
        assert_eq!(holder_gone(me, Some(start)), None);
        assert_eq!(holder_gone(me, None), None, "a lock without a start time is told by its PID alone");
        let why = holder_gone(me, Some(start + 1)).unwrap();
        assert!(why.contains("reused"), "{why}");
        let now = now_precise();
        let l = Lock {
            kind: LockKind::Gc,
            disk: None,
            host: hostname(),
            pid: me,
            time: now.clone(),
            refreshed: now,
            boot: this_boot(),
            pid_start: Some(start.wrapping_sub(1)),
            condemned: false,
            shared: false,
        };
        assert!(stale(&l, None).is_some_and(|w| w.contains("reused")));
        assert!(stale(&Lock { pid_start: Some(start), ..l.clone() }, None).is_none());
        // The start time of another boot or namespace is never compared.
        assert!(stale(&Lock { boot: Some("another-boot pid:[1]".into()), ..l }, None).is_none());
    }
}
