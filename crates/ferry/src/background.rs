//! Commands that go to the background once they are up (`ferry serve --fork`, `ferry mount
//! --daemon`): the command line runs again as a second process, marked by an environment
//! variable, whose standard output (or error) is a pipe to the first. The second says it is up with
//! one line on that pipe; the first returns 0 then, or, when the second ends without saying
//! so, with its exit status (its errors went to the same standard error).
//!
//! Also the log sink of such a background process: once it is up, its log lines go to a
//! file or to syslog instead of the terminal it was started from.

use anyhow::{bail, Context, Result};
use std::io::Write;
use std::sync::Mutex;

/// What the background process writes once it is up, before the rest of its line (serve:
/// its URI): on its standard output ...
const READY: &str = "ready ";
/// ... or, where its standard error is the channel, a line no log line starts with.
const READY_ON_STDERR: &str = "\u{1}ferry is up ";

/// The longest line read from the background process.
const MAX_LINE: u64 = 8192;

/// Where the background process says it is up.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    /// Its standard output, a pipe to the first process, which reads one line from it (its
    /// standard error is the first's).
    Stdout,
    /// Its standard error, a pipe to the first process, which passes on every line before
    /// the one that says it is up (its standard output is /dev/null): nothing the first
    /// process's caller reads stays open once it returns.
    Stderr,
}

/// Whether this process is the background one that [`start`] started with `marker`.
pub fn is_background(marker: &str) -> bool {
    std::env::var_os(marker).is_some()
}

/// Runs this command line again with `marker` set in its environment, the `channel` a pipe
/// to this process; in a process group of its own when `new_group`, with standard input
/// /dev/null, else in this one's, with this one's standard input, so that it can still ask
/// for a passphrase on the terminal (until it is up: [`detach`]). `flag` names the option,
/// for messages. Returns what the new process said once it is up (`Ok`), or its exit status
/// once it ended without saying so (`Err`). That it ended is seen even while something it
/// started (a password command's agent) still holds the pipe open.
pub fn start(marker: &str, new_group: bool, channel: Channel, flag: &str) -> Result<std::result::Result<String, i32>> {
    use std::io::{BufRead, Read};
    use std::os::unix::process::CommandExt;
    use std::process::Stdio;
    use std::sync::mpsc::RecvTimeoutError;
    let exe = std::env::current_exe().with_context(|| format!("{flag}: cannot find ferry's own executable"))?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(std::env::args_os().skip(1)).env(marker, "1");
    match channel {
        Channel::Stdout => cmd.stdout(Stdio::piped()),
        Channel::Stderr => cmd.stdout(Stdio::null()).stderr(Stdio::piped()),
    };
    if new_group {
        cmd.process_group(0).stdin(Stdio::null());
    }
    let mut child = cmd.spawn().with_context(|| format!("{flag}: cannot start the background process"))?;
    let pipe: Box<dyn Read + Send> = match channel {
        Channel::Stdout => Box::new(child.stdout.take().with_context(|| format!("{flag}: no pipe"))?),
        Channel::Stderr => Box::new(child.stderr.take().with_context(|| format!("{flag}: no pipe"))?),
    };
    // The pipe is read on a thread of its own, which sends each line (empty at its end),
    // so that this one also sees the process end.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::Builder::new()
        .name("background-pipe".into())
        .spawn(move || {
            let mut lines = std::io::BufReader::new(pipe);
            loop {
                let mut line = String::new();
                // Bounded lines: a longer one comes in pieces.
                let end = !matches!(lines.by_ref().take(MAX_LINE).read_line(&mut line), Ok(n) if n > 0);
                if tx.send(if end { String::new() } else { line }).is_err() || end {
                    return;
                }
            }
        })
        .with_context(|| format!("{flag}: cannot start a thread"))?;
    let ready = if channel == Channel::Stdout { READY } else { READY_ON_STDERR };
    // Once the process has ended, what it wrote before is still passed on, for a moment.
    let mut ended_at: Option<std::time::Instant> = None;
    loop {
        let line = match rx.recv_timeout(std::time::Duration::from_millis(100)) {
            Ok(line) if line.is_empty() => break,
            Ok(line) => line,
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {
                match ended_at {
                    Some(t) if t.elapsed() > std::time::Duration::from_millis(500) => break,
                    Some(_) => {}
                    None => {
                        if child
                            .try_wait()
                            .with_context(|| format!("{flag}: waiting for the background process"))?
                            .is_some()
                        {
                            ended_at = Some(std::time::Instant::now());
                        }
                    }
                }
                continue;
            }
        };
        if let Some(rest) = line.strip_prefix(ready).and_then(|l| l.strip_suffix('\n')) {
            log::debug!("the background process (pid {}) is up: {rest}", child.id());
            return Ok(Ok(rest.to_string()));
        }
        match channel {
            // The process says READY and one line, nothing else.
            Channel::Stdout => break,
            Channel::Stderr => eprint!("{line}"),
        }
    }
    let status = child.wait().with_context(|| format!("{flag}: waiting for the background process"))?;
    match status.code() {
        Some(c) if c != 0 => Ok(Err(c)),
        _ => bail!("{flag}: the background process ended ({status}) before it was up"),
    }
}

/// The background process tells the first that it is up (`what`: the rest of the line) on
/// `channel`, which the first reads no more.
pub fn say_ready(channel: Channel, what: &str) {
    // The first process may be gone (killed): nothing to tell then.
    let _ = match channel {
        Channel::Stdout => std::io::stdout().lock().write_all(format!("{READY}{what}\n").as_bytes()),
        Channel::Stderr => std::io::stderr().lock().write_all(format!("{READY_ON_STDERR}{what}\n").as_bytes()),
    };
    let _ = std::io::stdout().flush();
}

/// Whether [`detach`] ran: the process's errors go to its log then.
static DETACHED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The background process, once up and its log lines [`redirect`]ed, lets go of the first
/// process's pipe and terminal: standard input, output and error become /dev/null (a
/// later write to the pipe, which the first no longer reads, would fail). Its final error
/// goes to the log from now on ([`detached`]).
pub fn detach() -> Result<()> {
    let null = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null").context("opening /dev/null")?;
    rustix::stdio::dup2_stdin(&null).context("standard input to /dev/null")?;
    rustix::stdio::dup2_stdout(&null).context("standard output to /dev/null")?;
    rustix::stdio::dup2_stderr(&null).context("standard error to /dev/null")?;
    DETACHED.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Whether this process has [`detach`]ed: its errors go to the log, not to standard error.
pub fn detached() -> bool {
    DETACHED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Where the log lines of a background process go: standard error until [`redirect`].
static SINK: Mutex<Option<Box<dyn Write + Send>>> = Mutex::new(None);

/// The logger's target in a background process: standard error, or what [`redirect`] set.
pub struct LogSink;

impl Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match SINK.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            Some(w) => w.write(buf),
            None => std::io::stderr().write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match SINK.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            Some(w) => w.flush(),
            None => std::io::stderr().flush(),
        }
    }
}

/// From now on the log lines go to `to`.
pub fn redirect(to: Box<dyn Write + Send>) {
    *SINK.lock().unwrap_or_else(|e| e.into_inner()) = Some(to);
}

/// Where log lines go in the background: appended to a file, each with its time.
pub struct LogFile(std::fs::File);

impl LogFile {
    /// Opens (or creates, readable by its owner only) `path` to append to.
    pub fn open(path: &std::path::Path) -> Result<LogFile> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(path)
            .with_context(|| format!("--log {}", path.display()))?;
        Ok(LogFile(f))
    }
}

impl Write for LogFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // The logger writes a record at once: each gets the time in front.
        let time = jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ ").to_string();
        let mut line = time.into_bytes();
        line.extend_from_slice(buf);
        self.0.write_all(&line)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// Where log lines go in the background without --log: the local syslog (`/dev/log`), as
/// `ferry[PID]` of the daemon facility, each line a message of the level it was logged at.
pub struct Syslog {
    socket: std::os::unix::net::UnixDatagram,
    pending: Vec<u8>,
}

/// The syslog socket of this machine.
const SYSLOG: &str = "/dev/log";

impl Syslog {
    /// Connects to the local syslog; an error says what to do without one.
    pub fn connect() -> Result<Syslog> {
        Syslog::connect_to(std::path::Path::new(SYSLOG))
    }

    fn connect_to(path: &std::path::Path) -> Result<Syslog> {
        let socket = std::os::unix::net::UnixDatagram::unbound().context("cannot make a socket for syslog")?;
        socket.connect(path).with_context(|| {
            format!("no syslog at {}: give --log FILE for the messages of the background process", path.display())
        })?;
        Ok(Syslog { socket, pending: Vec::new() })
    }

    /// RFC 3164's priority of a line as the logger writes it (`[LEVEL ...] text`), of the
    /// daemon facility (3).
    fn priority(line: &[u8]) -> u8 {
        let head = &line[..line.len().min(8)];
        let has = |w: &[u8]| head.windows(w.len()).any(|x| x == w);
        let severity = if has(b"ERROR") {
            3
        } else if has(b"WARN") {
            4
        } else if has(b"INFO") {
            6
        } else {
            7
        };
        3 * 8 + severity
    }
}

impl Write for Syslog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.pending.extend_from_slice(buf);
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            let text = &line[..line.len() - 1];
            let mut msg = format!("<{}>ferry[{}]: ", Syslog::priority(text), std::process::id()).into_bytes();
            msg.extend_from_slice(text);
            // A syslog that went away loses the line: nothing else could take it.
            let _ = self.socket.send(&msg);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Syslog;
    use std::io::Write;

    /// Each line the logger writes, whole or in pieces, is one datagram to the syslog
    /// socket, with its level's priority and ferry's pid; a socket that is not there is an
    /// error that names --log.
    #[test]
    fn log_lines_reach_syslog_one_datagram_each() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("log");
        let server = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        let mut w = Syslog::connect_to(&path).unwrap();
        w.write_all(b"[WARN ] first\n[INFO ] sec").unwrap();
        w.write_all(b"ond\n").unwrap();
        let mut buf = [0u8; 256];
        let pid = std::process::id();
        for want in [format!("<28>ferry[{pid}]: [WARN ] first"), format!("<30>ferry[{pid}]: [INFO ] second")] {
            let n = server.recv(&mut buf).unwrap();
            assert_eq!(std::str::from_utf8(&buf[..n]).unwrap(), want);
        }
        let e = Syslog::connect_to(&d.path().join("none")).err().unwrap();
        assert!(format!("{e:#}").contains("--log FILE"), "{e:#}");
    }

    #[test]
    fn syslog_priorities_follow_the_level() {
        assert_eq!(Syslog::priority(b"[ERROR] x"), 27);
        assert_eq!(Syslog::priority(b"[WARN ] x"), 28);
        assert_eq!(Syslog::priority(b"[INFO ] x"), 30);
        assert_eq!(Syslog::priority(b"[DEBUG] x"), 31);
        assert_eq!(Syslog::priority(b""), 31);
    }
}
