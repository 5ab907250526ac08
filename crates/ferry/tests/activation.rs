//! systemd socket activation: ferry serves on the socket passed as fd 3 with
//! LISTEN_PID/LISTEN_FDS, and ignores its own -U option then.

use std::process::Command;

#[test]
fn serves_on_a_socket_passed_by_the_service_manager() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/socket_activation.py");
    let ferry = std::env::var("FERRY_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_ferry").to_string());
    assert!(
        Command::new("/usr/bin/python3").args(["-c", "import nbd"]).status().is_ok_and(|s| s.success()),
        "libnbd's Python bindings are missing: apt-get install python3-libnbd"
    );
    let out = Command::new("/usr/bin/python3").arg(script).arg(ferry).output().expect("run python3");
    assert!(
        out.status.success(),
        "socket activation test failed:\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
