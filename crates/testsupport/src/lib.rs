//! What the integration tests of ferry-http, ferry-s3 and ferry share (a dev-dependency
//! only, never published):
//!
//! * [`nginx`]: an nginx with its own configuration, test CA and server certificate,
//!   on two free loopback ports (HTTP and HTTPS), stopped when the test binary exits;
//! * [`moto`]: moto's `moto_server` as an S3 API, started once per test binary and
//!   stopped when it exits;
//! * [`http`]: reading HTTP header blocks and a proxy that spoils chosen requests;
//! * [`free_port`], [`run`], [`installed`].
//!
//! A missing tool fails the test saying what to install; nothing here ever skips.

#![forbid(unsafe_code)]

pub mod http;
pub mod moto;
pub mod nginx;

use std::collections::HashSet;
use std::net::TcpListener;
use std::process::Command;
use std::sync::Mutex;

static PORTS_GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A TCP port on 127.0.0.1 that was free a moment ago (bound to :0 and released);
/// never the same one twice in one test process.
pub fn free_port() -> u16 {
    let mut given = PORTS_GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    for _ in 0..100 {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = l.local_addr().unwrap().port();
        drop(l);
        if given.insert(port) {
            return port;
        }
    }
    panic!("no free TCP port found");
}

/// Runs `cmd`, fails the test unless it succeeds, and returns its standard output.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether `program` is on PATH (`command -v`).
pub fn installed(program: &str) -> bool {
    Command::new("sh").args(["-c", "command -v \"$1\"", "sh", program]).output().is_ok_and(|o| o.status.success())
}
