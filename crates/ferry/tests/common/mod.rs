//! Shared harness for the integration tests that drive the real `ferry` binary with
//! third-party NBD clients (qemu-img/qemu-io, libnbd's nbdinfo/nbdcopy/Python
//! bindings, fio) and with the minimal raw client in [`raw`].
//!
//! * [`ServerBuilder`] / [`Server`]: one server per test, on a Unix socket in its own
//!   temporary directory or on a free TCP port of 127.0.0.1; killed (SIGTERM, then
//!   SIGKILL if it lingers) when dropped, its stderr printed if the test failed.
//! * [`run_ok`] / [`run`]: run a command with a time limit, with its output shown on
//!   failure.
//! * [`require`]: a missing tool fails the test with the Debian package to install;
//!   nothing here ever skips.
//! * [`Rng`], [`data_with_holes`], [`pattern_bytes`]: deterministic test data.
//!
//! `FERRY_BIN` overrides the binary under test (e.g. a wrapper script); otherwise the
//! `ferry` binary cargo built for this test run is used.

#![allow(dead_code)]

pub mod json;
pub mod raw;

use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * 1024;

/// The interpreter that has libnbd's Python bindings (Debian's python3-libnbd installs
/// them for the system Python only; a `python3` earlier on PATH may lack them).
pub const SYSTEM_PYTHON: &str = "/usr/bin/python3";

/// Default time limit for one external command.
pub const CMD_TIMEOUT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------------
// Tools
// ---------------------------------------------------------------------------------

/// `ferry ARGS...` for tests of remote images: no proxy, TLS trust or log settings come
/// from the environment (loopback URLs only; tests that want a setting set it).
pub fn ferry_remote<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut c = Command::new(ferry_bin());
    c.args(args);
    for v in [
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "http_proxy",
        "HTTP_PROXY",
        "https_proxy",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
        "RUST_LOG",
    ] {
        c.env_remove(v);
    }
    c
}

/// The binary under test.
pub fn ferry_bin() -> PathBuf {
    match std::env::var_os("FERRY_BIN") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_BIN_EXE_ferry")),
    }
}

/// The Debian package that provides `tool`.
fn package_of(tool: &str) -> &'static str {
    match tool {
        "qemu-img" | "qemu-io" | "qemu-nbd" => "qemu-utils",
        "nbdinfo" | "nbdcopy" | "nbdsh" => "libnbd-bin",
        "nbdkit" => "nbdkit",
        "certtool" | "psktool" => "gnutls-bin",
        "fio" => "fio",
        "python3-libnbd" => "python3-libnbd",
        _ => "the package that provides it",
    }
}

/// Finds `tool` on PATH.
pub fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(tool)).find(|p| {
        use std::os::unix::fs::PermissionsExt;
        fs::metadata(p).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
    })
}

/// Fails the test (never skips it) when `tool` is not installed.
/// `"python3-libnbd"` checks that `/usr/bin/python3 -c 'import nbd'` works.
pub fn require(tool: &str) {
    if tool == "python3-libnbd" {
        let ok = Command::new(SYSTEM_PYTHON)
            .args(["-c", "import nbd"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(
            ok,
            "libnbd's Python bindings are missing: `{SYSTEM_PYTHON} -c 'import nbd'` failed. \
             Install the Debian package python3-libnbd (apt-get install python3-libnbd)"
        );
        return;
    }
    assert!(
        which(tool).is_some(),
        "required tool `{tool}` is not on PATH: install the Debian package {} (apt-get install {})",
        package_of(tool),
        package_of(tool)
    );
}

// ---------------------------------------------------------------------------------
// Running commands
// ---------------------------------------------------------------------------------

/// What a finished command printed.
#[derive(Debug)]
pub struct Output {
    pub what: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn describe(&self) -> String {
        format!(
            "command: {}\nstatus: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.what, self.status, self.stdout, self.stderr
        )
    }
}

fn describe_cmd(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        let a = a.to_string_lossy();
        if a.contains(' ') || a.is_empty() {
            s.push_str(&format!(" '{a}'"));
        } else {
            s.push(' ');
            s.push_str(&a);
        }
    }
    s
}

/// Reads a pipe to its end on a thread; the result comes through the receiver.
fn drain<R: Read + Send + 'static>(mut r: R) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        let _ = tx.send(v);
    });
    rx
}

/// What a drained pipe held; gives up after `wait` if something (a grandchild that
/// inherited the pipe) keeps it open.
fn collect(rx: &mpsc::Receiver<Vec<u8>>, wait: Duration) -> String {
    match rx.recv_timeout(wait) {
        Ok(v) => String::from_utf8_lossy(&v).into_owned(),
        Err(_) => "<output not closed: a leftover child process holds the pipe>".to_string(),
    }
}

/// Runs `cmd` (stdin closed) and returns what it printed; panics if it runs longer
/// than `timeout`. The command runs in its own process group, and on timeout the
/// whole group is killed (so e.g. the child of `ferry serve --run` goes too).
/// Spawns `cmd` while no other thread of this test binary is between fork and exec: a
/// child holds a copy of every descriptor until it execs, so an image a test just closed
/// would otherwise still hold its locks for that instant and a qemu-img run right after
/// could find it "in use".
pub fn spawn_serialized(cmd: &mut Command) -> std::io::Result<std::process::Child> {
    static SPAWN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = SPAWN.lock().unwrap_or_else(|e| e.into_inner());
    cmd.spawn()
}

pub fn run_timeout(cmd: &mut Command, timeout: Duration) -> Output {
    use std::os::unix::process::CommandExt;
    let what = describe_cmd(cmd);
    let mut child =
        spawn_serialized(cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0))
            .unwrap_or_else(|e| panic!("cannot start `{what}`: {e}"));
    let to = drain(child.stdout.take().unwrap());
    let te = drain(child.stderr.take().unwrap());
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > deadline {
            unsafe {
                libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL);
            }
            let _ = child.kill();
            let _ = child.wait();
            let out = collect(&to, Duration::from_secs(5));
            let err = collect(&te, Duration::from_secs(5));
            panic!("`{what}` did not finish within {timeout:?}; killed\n--- stdout ---\n{out}\n--- stderr ---\n{err}");
        }
        thread::sleep(Duration::from_millis(20));
    };
    let stdout = collect(&to, Duration::from_secs(30));
    let stderr = collect(&te, Duration::from_secs(30));
    Output { what, status, stdout, stderr }
}

/// Runs `cmd` with the default time limit, whatever its exit status.
pub fn run(cmd: &mut Command) -> Output {
    run_timeout(cmd, CMD_TIMEOUT)
}

/// Runs `cmd` and asserts that it exits 0, printing everything it said if not.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = run(cmd);
    assert!(out.status.success(), "command failed\n{}", out.describe());
    out
}

/// Runs `cmd` and asserts that it fails.
pub fn run_fails(cmd: &mut Command) -> Output {
    let out = run(cmd);
    assert!(!out.status.success(), "command should have failed but succeeded\n{}", out.describe());
    out
}

/// `Command::new(program)` with args.
pub fn cmd<I, S>(program: &str, args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut c = Command::new(program);
    c.args(args);
    c
}

/// Path of a libnbd Python test script in tests/python.
pub fn python_script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("python").join(name)
}

/// Runs tests/python/`script` with the system Python and asserts that it exits 0.
pub fn run_python(script: &str, args: &[&str]) -> Output {
    require("python3-libnbd");
    let path = python_script(script);
    assert!(path.exists(), "missing test script {}", path.display());
    let mut c = Command::new(SYSTEM_PYTHON);
    c.arg("-u").arg(&path).args(args);
    run_ok(&mut c)
}

/// Runs tests/python/`script` with `args` while `server` serves for `run_for`, then kills
/// the server with SIGKILL. Asserts the script then exits 0, and returns the largest `k`
/// of the "flushed k" lines it printed (`None`: it printed none).
pub fn kill_during_python(server: &mut Server, script: &str, args: &[&str], run_for: Duration) -> Option<usize> {
    require("python3-libnbd");
    let mut py = Command::new(SYSTEM_PYTHON);
    py.arg("-u").arg(python_script(script)).args(args);
    py.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = py.spawn().unwrap();
    thread::sleep(run_for);
    server.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout.lines().filter_map(|l| l.strip_prefix("flushed ")?.parse::<usize>().ok()).max()
}

/// The guest bytes of a qcow2 image a killed server left (qemu-img convert to raw),
/// once `qemu-img check` found no error and no corruption in it (leaked clusters are
/// what a crash may leave).
pub fn crashed_qcow2_contents(img: &Path) -> Vec<u8> {
    require("qemu-img");
    let check = run(&mut cmd("qemu-img", ["check", "--output=json", img.to_str().unwrap()]));
    let v: serde_json::Value =
        serde_json::from_str(&check.stdout).unwrap_or_else(|e| panic!("{e}: {}", check.describe()));
    assert_eq!(v.get("check-errors").and_then(|c| c.as_u64()), Some(0), "{}", check.describe());
    assert!(v.get("corruptions").is_none_or(|c| c == 0), "{}", check.describe());
    let raw = img.with_extension("crash.raw");
    run_ok(&mut cmd("qemu-img", ["convert", "-O", "raw", img.to_str().unwrap(), raw.to_str().unwrap()]));
    fs::read(&raw).unwrap()
}

// ---------------------------------------------------------------------------------
// The server under test
// ---------------------------------------------------------------------------------

/// Where a server listens.
#[derive(Debug, Clone)]
pub enum Addr {
    Unix(PathBuf),
    Tcp(u16),
}

/// A TCP port on 127.0.0.1 that was free a moment ago, never the same one twice in one
/// test process (shared with the nginx and moto harnesses of ferry-testsupport).
pub use ferry_testsupport::free_port;

pub struct ServerBuilder {
    spec: String,
    args: Vec<String>,
    tcp: bool,
    bind: Option<String>,
    wrapper: Vec<String>,
}

impl ServerBuilder {
    pub fn new(spec: &str) -> Self {
        ServerBuilder { spec: spec.to_string(), args: Vec::new(), tcp: false, bind: None, wrapper: Vec::new() }
    }

    /// Start the server as `ARGV... ferry serve ...` (e.g. under `unshare`); the wrapper
    /// must `exec` the server, so the process id stays the server's.
    pub fn wrapper(mut self, argv: &[&str]) -> Self {
        self.wrapper = argv.iter().map(|s| s.to_string()).collect();
        self
    }

    /// Listen on a free TCP port of 127.0.0.1 (default address) instead of a Unix socket.
    pub fn tcp(mut self) -> Self {
        self.tcp = true;
        self
    }

    /// Listen on TCP with an explicit `--bind ADDR`.
    pub fn bind(mut self, addr: &str) -> Self {
        self.tcp = true;
        self.bind = Some(addr.to_string());
        self
    }

    pub fn arg(mut self, a: &str) -> Self {
        self.args.push(a.to_string());
        self
    }

    pub fn args(mut self, a: &[&str]) -> Self {
        self.args.extend(a.iter().map(|s| s.to_string()));
        self
    }

    pub fn read_only(self) -> Self {
        self.arg("--read-only")
    }

    /// `--export NAME=SPEC`.
    pub fn export(self, name: &str, spec: &str) -> Self {
        self.arg("--export").arg(&format!("{name}={spec}"))
    }

    pub fn start(self) -> Server {
        let dir = tempfile::Builder::new().prefix("ferry-it").tempdir().expect("tempdir");
        let addr = if self.tcp { Addr::Tcp(free_port()) } else { Addr::Unix(dir.path().join("nbd.sock")) };
        let mut c = match self.wrapper.split_first() {
            Some((prog, rest)) => {
                let mut c = Command::new(prog);
                c.args(rest).arg(ferry_bin());
                c
            }
            None => Command::new(ferry_bin()),
        };
        c.arg("serve");
        match &addr {
            Addr::Unix(p) => {
                c.arg("--unix").arg(p);
            }
            Addr::Tcp(port) => {
                c.arg("--port").arg(port.to_string());
                if let Some(b) = &self.bind {
                    c.arg("--bind").arg(b);
                }
            }
        }
        c.args(&self.args).arg(&self.spec);
        let what = describe_cmd(&c);
        let stderr_path = dir.path().join("server.stderr");
        let stdout_path = dir.path().join("server.stdout");
        c.stdin(Stdio::null())
            .stdout(fs::File::create(&stdout_path).unwrap())
            .stderr(fs::File::create(&stderr_path).unwrap());
        if std::env::var_os("RUST_LOG").is_none() {
            c.env("RUST_LOG", "info");
        }
        let child = c.spawn().unwrap_or_else(|e| {
            panic!("cannot start the server `{what}`: {e} (set FERRY_BIN or build the ferry binary)")
        });
        let mut s = Server { child: Some(child), addr, dir, stderr_path, stdout_path, what };
        s.wait_ready(Duration::from_secs(10));
        s
    }
}

pub struct Server {
    child: Option<Child>,
    pub addr: Addr,
    /// Temporary directory of this server (socket, logs); tests may put files here.
    pub dir: tempfile::TempDir,
    stderr_path: PathBuf,
    stdout_path: PathBuf,
    what: String,
}

/// A connected stream to a server, Unix or TCP.
pub enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    pub fn set_read_timeout(&self, d: Option<Duration>) {
        match self {
            Stream::Unix(s) => s.set_read_timeout(d).unwrap(),
            Stream::Tcp(s) => s.set_read_timeout(d).unwrap(),
        }
    }
    pub fn set_write_timeout(&self, d: Option<Duration>) {
        match self {
            Stream::Unix(s) => s.set_write_timeout(d).unwrap(),
            Stream::Tcp(s) => s.set_write_timeout(d).unwrap(),
        }
    }
    pub fn shutdown_write(&self) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Write),
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Write),
        };
    }
    pub fn try_clone(&self) -> Stream {
        match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone().unwrap()),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone().unwrap()),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Server {
    /// A server on a Unix socket serving `spec` with `extra` options.
    pub fn unix(spec: &str, extra: &[&str]) -> Server {
        ServerBuilder::new(spec).args(extra).start()
    }

    /// A server on a free TCP port of 127.0.0.1 serving `spec` with `extra` options.
    pub fn tcp(spec: &str, extra: &[&str]) -> Server {
        ServerBuilder::new(spec).tcp().args(extra).start()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server already stopped").id()
    }

    pub fn stderr(&self) -> String {
        fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    pub fn stdout(&self) -> String {
        fs::read_to_string(&self.stdout_path).unwrap_or_default()
    }

    /// The NBD URI of the default export.
    pub fn uri(&self) -> String {
        self.uri_export("")
    }

    /// The NBD URI of export `name` (names used in tests need no escaping).
    pub fn uri_export(&self, name: &str) -> String {
        match &self.addr {
            Addr::Unix(p) => format!("nbd+unix:///{name}?socket={}", p.display()),
            Addr::Tcp(port) => format!("nbd://127.0.0.1:{port}/{name}"),
        }
    }

    /// A plain connection (no handshake done).
    pub fn connect(&self) -> std::io::Result<Stream> {
        let s = match &self.addr {
            Addr::Unix(p) => Stream::Unix(UnixStream::connect(p)?),
            Addr::Tcp(port) => {
                let s = TcpStream::connect(("127.0.0.1", *port))?;
                s.set_nodelay(true).ok();
                Stream::Tcp(s)
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(10)));
        s.set_write_timeout(Some(Duration::from_secs(10)));
        Ok(s)
    }

    /// Panics unless the server process is still running.
    pub fn assert_alive(&mut self) {
        let child = self.child.as_mut().expect("server already stopped");
        if let Some(st) = child.try_wait().unwrap() {
            panic!("server exited unexpectedly with {st}\n--- server stderr ---\n{}", self.stderr());
        }
    }

    fn wait_ready(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut last_err: String;
        loop {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                let err = self.stderr();
                self.child = None;
                panic!(
                    "server `{}` exited with {st} before accepting connections\n--- server stderr ---\n{err}",
                    self.what
                );
            }
            match self.connect() {
                Ok(mut s) => {
                    // Read the greeting, so we know it is an NBD server (and ours).
                    s.set_read_timeout(Some(Duration::from_secs(2)));
                    let mut g = [0u8; 18];
                    match s.read_exact(&mut g) {
                        Ok(()) if g[..8] == raw::NBDMAGIC.to_be_bytes() && g[8..16] == raw::IHAVEOPT.to_be_bytes() => {
                            return
                        }
                        Ok(()) => last_err = format!("unexpected greeting {g:02x?}"),
                        Err(e) => last_err = format!("reading greeting: {e}"),
                    }
                }
                Err(e) => last_err = format!("connect: {e}"),
            }
            if Instant::now() > deadline {
                let err = self.stderr();
                panic!(
                    "server `{}` did not accept NBD connections within {timeout:?} (last: {last_err})\n--- server stderr ---\n{err}",
                    self.what
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `sig` to the server and waits (up to `timeout`) for it to exit.
    pub fn signal_and_wait(&mut self, sig: i32, timeout: Duration) -> ExitStatus {
        let mut child = self.child.take().expect("server already stopped");
        unsafe {
            libc::kill(child.id() as libc::pid_t, sig);
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                return st;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "server did not exit within {timeout:?} of signal {sig}; killed\n--- server stderr ---\n{}",
                    self.stderr()
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM and wait; returns the exit status.
    pub fn stop(&mut self) -> ExitStatus {
        self.signal_and_wait(libc::SIGTERM, Duration::from_secs(10))
    }

    /// Resident memory of the server process in bytes (from /proc/PID/status VmRSS).
    pub fn rss_bytes(&self) -> u64 {
        rss_of(self.pid()).unwrap_or_else(|| panic!("cannot read VmRSS of server pid {}", self.pid()))
    }
}

pub fn rss_of(pid: u32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(20)),
                    _ => {
                        eprintln!("server did not exit within 5 s of SIGTERM; killing it");
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
        if thread::panicking() {
            eprintln!("--- server `{}` stderr ---\n{}", self.what, self.stderr());
        }
    }
}

// ---------------------------------------------------------------------------------
// Test data
// ---------------------------------------------------------------------------------

/// xorshift64*: small, deterministic, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.fill(&mut v);
        v
    }
}

/// `len` bytes of random data with zero runs: whole zero MiBs (holes for sparse
/// copies), zero runs of assorted sizes inside data, and random data elsewhere.
/// Never all zero; the first MiB is data, the second is zero.
pub fn data_with_holes(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut v = rng.bytes(len);
    let mib = MIB as usize;
    let blocks = len.div_ceil(mib);
    for b in 0..blocks {
        let start = b * mib;
        let end = (start + mib).min(len);
        let whole_zero = b == 1 || (b > 1 && rng.below(3) == 0);
        if whole_zero {
            v[start..end].fill(0);
        } else {
            // A few zero runs inside the data, 1 byte to 96 KiB.
            for _ in 0..rng.below(4) {
                let n = 1 + rng.below(96 * 1024) as usize;
                let at = start + rng.below((end - start) as u64) as usize;
                let e = (at + n).min(end);
                v[at..e].fill(0);
            }
        }
    }
    v
}

/// Writes `data` to a new file `name` in `dir` and returns the path; zero runs of
/// whole 4 KiB blocks are left as holes when the file system supports it.
pub fn write_sparse_file(dir: &Path, name: &str, data: &[u8]) -> PathBuf {
    use std::io::{Seek, SeekFrom};
    let p = dir.join(name);
    let mut f = fs::File::create(&p).unwrap();
    f.set_len(data.len() as u64).unwrap();
    for (i, c) in data.chunks(4096).enumerate() {
        if c.iter().any(|&b| b != 0) {
            f.seek(SeekFrom::Start(i as u64 * 4096)).unwrap();
            f.write_all(c).unwrap();
        }
    }
    f.sync_all().unwrap();
    p
}

/// The bytes of nbdkit's pattern plugin (and ferry's `pattern:`) at `offset..offset+len`:
/// each aligned 8-byte word holds its own offset, big-endian.
pub fn pattern_bytes(offset: u64, len: usize) -> Vec<u8> {
    (offset..offset + len as u64).map(|pos| (pos & !7).to_be_bytes()[(pos & 7) as usize]).collect()
}

/// Asserts two byte strings are equal, reporting the first difference instead of
/// dumping megabytes.
#[track_caller]
pub fn assert_same_bytes(got: &[u8], want: &[u8], what: &str) {
    if got == want {
        return;
    }
    if got.len() != want.len() {
        panic!("{what}: length {} differs from expected {}", got.len(), want.len());
    }
    let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap();
    let end = (i + 16).min(got.len());
    let bad = got[i..].iter().zip(&want[i..]).filter(|(a, b)| a != b).count();
    panic!(
        "{what}: first difference at byte {i} (0x{i:x}): got {:02x?}, want {:02x?}; {bad} bytes differ",
        &got[i..end],
        &want[i..end]
    );
}

/// Asserts the file at `path` holds exactly `want`.
#[track_caller]
pub fn assert_file_eq(path: &Path, want: &[u8]) {
    let got = fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    assert_same_bytes(&got, want, &format!("contents of {}", path.display()));
}

/// Polls `f` every 50 ms until it returns true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// An nbdkit server on a Unix socket (stderr discarded), killed with -9 when dropped.
pub struct Nbdkit {
    child: Child,
    sock: PathBuf,
}

impl Nbdkit {
    /// `nbdkit -f -U SOCK ARGS...`, once it accepts connections (a stale SOCK is removed).
    pub fn start_at(sock: &Path, args: &[&str]) -> Nbdkit {
        require("nbdkit");
        let _ = fs::remove_file(sock);
        let child = spawn_serialized(
            Command::new("nbdkit")
                .args(["-f", "--exit-with-parent", "-U"])
                .arg(sock)
                .args(args)
                .stdin(Stdio::null())
                .stderr(Stdio::null()),
        )
        .expect("start nbdkit");
        let ok = wait_until(Duration::from_secs(10), || UnixStream::connect(sock).is_ok());
        assert!(ok, "nbdkit did not start listening on {}", sock.display());
        Nbdkit { child, sock: sock.to_owned() }
    }

    /// The same on `DIR/nbdkit.sock`.
    pub fn start(dir: &Path, args: &[&str]) -> Nbdkit {
        Nbdkit::start_at(&dir.join("nbdkit.sock"), args)
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.sock.display())
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        self.kill9();
    }
}
