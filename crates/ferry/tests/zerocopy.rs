//! `ferry serve --zerocopy`: MSG_ZEROCOPY replies over TCP carry the right bytes, the
//! statistics count zero-copy sends and the kernel's copies, auto mode stops after the
//! kernel's first COPIED report (always on loopback), and `on` is refused where it
//! cannot work.

use crate::common::*;
use std::process::Command;
use std::time::Duration;

/// The zero-copy part of a `--stats` line: (bytes, sendmsg calls, copied by the kernel).
fn zerocopy_counts(line: &str) -> Option<(u64, u64, u64)> {
    let rest = &line[line.find("zero-copy: ")? + "zero-copy: ".len()..];
    let words: Vec<&str> = rest.split([' ', ',']).filter(|w| !w.is_empty()).collect();
    // "<bytes> bytes in <sends> sendmsg <copied> copied by the kernel <n> ENOBUFS"
    match words.as_slice() {
        [b, "bytes", "in", s, "sendmsg", c, "copied", ..] => Some((b.parse().ok()?, s.parse().ok()?, c.parse().ok()?)),
        _ => None,
    }
}

/// Stops the server and returns its `total:` line and its per-connection lines.
fn stop_and_stats(server: &mut Server) -> (String, Vec<String>) {
    let st = server.stop();
    let err = server.stderr();
    assert!(st.success(), "server exited with {st}\n{err}");
    let total = err.lines().find(|l| l.contains("total: ")).unwrap_or_else(|| panic!("no total line\n{err}"));
    let conns = err.lines().filter(|l| l.contains("127.0.0.1:") && l.contains(" requests; ")).map(String::from);
    (total.to_string(), conns.collect())
}

#[test]
fn zerocopy_on_reads_right_bytes_with_qemu_img_and_counts_sends() {
    require("qemu-img");
    let size = 64 * MIB as usize;
    let mut server = ServerBuilder::new(&format!("pattern:{size}")).tcp().args(&["--zerocopy=on", "--stats"]).start();
    let out = server.dir.path().join("out.raw");
    run_ok(&mut cmd("qemu-img", ["convert", "-f", "raw", "-O", "raw", &server.uri(), out.to_str().unwrap()]));
    let got = std::fs::read(&out).unwrap();
    assert_same_bytes(&got, &pattern_bytes(0, size), "qemu-img convert from ferry serve --zerocopy=on");
    let (total, _) = stop_and_stats(&mut server);
    let (bytes, sends, copied) =
        zerocopy_counts(&total).unwrap_or_else(|| panic!("--stats does not report zero-copy sends: {total}"));
    assert!(sends > 0 && bytes >= size as u64 / 2, "most READ data must go out zero-copy: {total}");
    // Over loopback the kernel copies every zero-copy send, and `on` keeps sending them.
    assert_eq!(copied, sends, "loopback: every zero-copy send is reported copied: {total}");
}

/// Data written through the server comes back intact when every large batch is a
/// zero-copy send whose arenas are swapped out: ferry copy in, ferry copy out.
#[test]
fn zerocopy_on_memory_roundtrip_with_ferry_copy() {
    let size = 48 * MIB as usize;
    let mut server = ServerBuilder::new("memory:48M").tcp().args(&["--zerocopy=on", "--stats"]).start();
    let data = data_with_holes(size, 77);
    let input = write_sparse_file(server.dir.path(), "in.img", &data);
    let output = server.dir.path().join("out.img");
    let ferry = |a: &[&str]| {
        let mut c = Command::new(ferry_bin());
        c.args(a);
        c
    };
    run_ok(&mut ferry(&["copy", input.to_str().unwrap(), &server.uri()]));
    // Several request sizes: replies of 64 KiB (each batch at the threshold) up to 4 MiB.
    for rs in ["64K", "1M", "4M"] {
        let _ = std::fs::remove_file(&output);
        run_ok(&mut ferry(&["copy", "--request-size", rs, &server.uri(), output.to_str().unwrap()]));
        assert_file_eq(&output, &data);
    }
    let (total, _) = stop_and_stats(&mut server);
    let (_, sends, _) = zerocopy_counts(&total).unwrap_or_else(|| panic!("no zero-copy sends reported: {total}"));
    assert!(sends > 10, "{total}");
}

/// auto: one zero-copy send per connection (the probe); the kernel reports it copied
/// (loopback), and the connection sends plainly from then on.
#[test]
fn zerocopy_auto_stops_after_the_first_copied_report() {
    let size = 64 * MIB as usize;
    let mut server = ServerBuilder::new(&format!("pattern:{size}")).tcp().args(&["--zerocopy=auto", "--stats"]).start();
    let out = server.dir.path().join("out.raw");
    let mut c = Command::new(ferry_bin());
    c.args(["copy", "--connections", "2", &server.uri(), out.to_str().unwrap()]);
    run_ok(&mut c);
    assert_same_bytes(&std::fs::read(&out).unwrap(), &pattern_bytes(0, size), "ferry copy, --zerocopy=auto");
    let (total, conns) = stop_and_stats(&mut server);
    let err = server.stderr();
    let busy: Vec<&String> = conns.iter().filter(|l| l.contains("zero-copy: ")).collect();
    assert_eq!(busy.len(), 2, "both copy connections made their probe\n{err}");
    for l in busy {
        assert_eq!(zerocopy_counts(l).map(|(_, s, c)| (s, c)), Some((1, 1)), "one probe, copied: {l}");
    }
    assert!(err.contains("zero-copy off for this connection"), "{err}");
    let (_, sends, copied) = zerocopy_counts(&total).expect("total counts zero-copy sends");
    assert_eq!((sends, copied), (2, 2), "{total}");
}

#[test]
fn zerocopy_off_makes_no_zero_copy_send() {
    let mut server = ServerBuilder::new("pattern:16M").tcp().args(&["--zerocopy=off", "--stats"]).start();
    let out = server.dir.path().join("out.raw");
    let mut c = Command::new(ferry_bin());
    c.args(["copy", &server.uri(), out.to_str().unwrap()]);
    run_ok(&mut c);
    assert_same_bytes(&std::fs::read(&out).unwrap(), &pattern_bytes(0, 16 * MIB as usize), "--zerocopy=off");
    let (total, _) = stop_and_stats(&mut server);
    assert!(!total.contains("zero-copy"), "{total}");
}

#[test]
fn zerocopy_on_with_unix_socket_fails_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let mut c = Command::new(ferry_bin());
    c.args(["serve", "--zerocopy=on", "--unix", sock.to_str().unwrap(), "memory:1M"]);
    let out = run_timeout(&mut c, Duration::from_secs(15));
    assert!(!out.status.success(), "--zerocopy=on over a Unix socket must fail\n{}", out.describe());
    assert!(
        out.stderr.contains("--zerocopy=on needs TCP") && out.stderr.contains("Unix socket"),
        "the error must say why\n{}",
        out.describe()
    );
    assert!(!sock.exists(), "no socket file is left behind");
    // auto over a Unix socket simply does not use zero-copy.
    let mut c = Command::new(ferry_bin());
    c.args(["serve", "--zerocopy=auto", "--unix", sock.to_str().unwrap(), "--run", "true", "memory:1M"]);
    let out = run_timeout(&mut c, Duration::from_secs(15));
    assert!(out.status.success(), "{}", out.describe());
}
