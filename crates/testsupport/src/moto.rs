//! moto's `moto_server` (`pip install 'moto[server]'`) as an S3 API, started once per test
//! binary on 127.0.0.1 and a free port, and stopped when the binary exits: a shell holds
//! its PID and kills it once our end of its standard input closes.

use crate::{free_port, installed};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

pub struct Moto {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    _child: Child,
    /// Never written: when the test binary exits it closes, and the shell kills moto.
    _stdin: Mutex<ChildStdin>,
}

/// This test binary's moto_server, started by the first call; fails the test when
/// moto_server is not installed or does not answer within 60 s.
pub fn moto() -> &'static Moto {
    static MOTO: OnceLock<Moto> = OnceLock::new();
    MOTO.get_or_init(start)
}

fn start() -> Moto {
    assert!(
        installed("moto_server"),
        "moto_server is not installed: install it with `pip install 'moto[server]'` (scripts/test does)"
    );
    let port = free_port();
    let log = std::env::temp_dir().join(format!("ferry-moto-{}.log", std::process::id()));
    let script = "moto_server -H 127.0.0.1 -p \"$1\" >\"$2\" 2>&1 & pid=$!; read _; kill $pid; wait $pid; rm -f \"$2\"";
    let (port_arg, log_arg) = (port.to_string(), log.display().to_string());
    let mut child = Command::new("sh")
        .args(["-c", script, "sh", &port_arg, &log_arg])
        .stdin(Stdio::piped())
        .spawn()
        .expect("cannot run sh to start moto_server");
    let stdin = child.stdin.take().unwrap();
    let endpoint = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !answers_200(port) {
        if Instant::now() > deadline || child.try_wait().ok().flatten().is_some() {
            let out = std::fs::read_to_string(&log).unwrap_or_default();
            panic!("moto_server did not come up on port {port} within 60 s; its output:\n{out}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Moto { endpoint, _child: child, _stdin: Mutex::new(stdin) }
}

/// Whether `GET /` on `port` is answered with a 2xx status.
fn answers_200(port: u16) -> bool {
    let Ok(mut c) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = c.write_all(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    let mut first = [0u8; 12];
    c.read_exact(&mut first).is_ok() && first.starts_with(b"HTTP/1.") && first[9] == b'2'
}
