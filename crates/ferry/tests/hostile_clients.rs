//! The server under hostile clients (issue 19): clients that send and never read, that
//! hold a connection with one byte of a request, a file that fails under sendfile, a
//! client that tries the TLS policy with an oversized option, a service manager that
//! overstates LISTEN_FDS, and ranges that cost time in proportion to their length.
//! Every byte on the wire is written by hand (common/raw.rs); every wait is bounded.

use crate::common::raw::*;
use crate::common::*;
use std::fs;
use std::io::{ErrorKind, Write};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const OPT_REPLY_ERR_TLS_REQD: u32 = 0x8000_0005;
const CMD_FLAG_DF: u16 = 1 << 2;
const REPLY_TYPE_ERROR_OFFSET: u16 = 0x8002;

fn threads_of(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/PID/status");
    let line = status.lines().find(|l| l.starts_with("Threads:")).expect("Threads: in status");
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("a number of threads")
}

/// Reads greeting, sends client flags, then NBD_OPT_LIST after NBD_OPT_LIST without ever
/// reading a reply, until the server hangs up (`Some(when)`) or `limit` passes (`None`).
fn flood_options_without_reading(c: &mut RawClient, limit: Duration) -> Option<Duration> {
    c.read_greeting();
    c.send_client_flags(CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES);
    c.s.set_write_timeout(Some(Duration::from_millis(100)));
    let batch: Vec<u8> = (0..256).flat_map(|_| RawClient::option_bytes(OPT_LIST, b"")).collect();
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        match c.s.write(&batch) {
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
            // EPIPE or a reset: the server closed the connection.
            Err(_) => return Some(t0.elapsed()),
        }
    }
    None
}

#[test]
fn a_client_that_sends_options_and_never_reads_is_dropped_at_the_handshake_deadline() {
    let server = Server::unix("memory:1M", &["--handshake-timeout", "1"]);
    let mut c = RawClient::connect(&server);
    let closed = flood_options_without_reading(&mut c, Duration::from_secs(8));
    let took = closed
        .unwrap_or_else(|| panic!("the server still holds a client that never reads after 8 s\n{}", server.stderr()));
    assert!(took < Duration::from_secs(4), "dropped after {took:?}, the handshake timeout is 1 s");
    assert!(
        wait_until(Duration::from_secs(2), || server.stderr().contains("handshake did not finish within")),
        "the drop must be logged as a handshake timeout:\n{}",
        server.stderr()
    );
    fresh_client_works(&server, 0, 1);
}

/// SIGTERM while one client floods options in the handshake and another pipelines large
/// READs, neither reading anything: the server exits within the shutdown grace period.
#[test]
fn sigterm_stops_the_server_within_the_grace_period_whatever_clients_do() {
    let mut server = Server::unix("memory:1G", &["--handshake-timeout", "60", "--shutdown-grace", "1"]);
    let mut flooder = RawClient::connect(&server);
    let flood = thread::spawn(move || {
        flood_options_without_reading(&mut flooder, Duration::from_secs(20));
        flooder
    });
    let (mut reader, _, _) = RawClient::handshake(&server);
    reader.s.set_write_timeout(Some(Duration::from_secs(5)));
    let reqs: Vec<u8> =
        (0..64u64).flat_map(|i| RawClient::request_bytes(0, CMD_READ, i, (i % 100) * 8 * MIB, 8 << 20)).collect();
    reader.send(&reqs);
    // Both connections' threads are stuck in a send by now.
    thread::sleep(Duration::from_millis(1500));
    server.assert_alive();
    let t = Instant::now();
    let st = server.signal_and_wait(libc::SIGTERM, Duration::from_secs(10));
    let took = t.elapsed();
    assert!(st.success(), "exit status after SIGTERM: {st}");
    assert!(took < Duration::from_secs(4), "the server took {took:?} to stop with a 1 s grace period");
    drop(reader);
    flood.join().unwrap();
}

/// SIGTERM while a client that sent NBD_OPT_STARTTLS stalls in the TLS handshake: the
/// server does not wait for the handshake deadline.
#[test]
fn sigterm_stops_the_server_while_a_client_stalls_in_the_tls_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.psk");
    fs::write(&keys, "alice:00112233445566778899aabbccddeeff\n").unwrap();
    let psk = ["--tls-psk", keys.to_str().unwrap(), "--tls", "on", "--handshake-timeout", "60"];
    let mut server = Server::unix("memory:1M", &psk);
    let mut c = RawClient::connect(&server);
    c.set_timeout(Duration::from_secs(10));
    c.read_greeting();
    c.send_client_flags(CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES);
    c.send_option(OPT_STARTTLS, b"");
    assert_eq!(c.read_opt_reply().typ, REP_ACK);
    // No ClientHello follows.
    thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    let st = server.signal_and_wait(libc::SIGTERM, Duration::from_secs(10));
    let took = t.elapsed();
    assert!(st.success(), "exit status after SIGTERM: {st}");
    assert!(took < Duration::from_secs(3), "the server took {took:?} to stop");
}

/// One byte of a request header on an idle connection must not pin a thread: the
/// connection is parked with the byte kept, and the request completes when the rest comes.
#[test]
fn idle_connections_holding_part_of_a_header_hold_no_thread() {
    const N: usize = 100;
    let server = Server::unix("pattern:16M", &[]);
    let pid = server.pid();
    let base = threads_of(pid);
    let mut conns = Vec::new();
    for i in 0..N {
        let (mut c, _, _) = RawClient::handshake(&server);
        let req = RawClient::request_bytes(0, CMD_READ, i as u64, (i as u64) * 4096, 4096);
        // Some send one byte, some all but one.
        let split = if i % 2 == 0 { 1 } else { req.len() - 1 };
        c.send(&req[..split]);
        conns.push((c, req, split));
    }
    let parked = wait_until(Duration::from_secs(5), || threads_of(pid) <= base + 4);
    let now = threads_of(pid);
    assert!(parked, "{N} connections with part of a header hold {now} threads (baseline {base})");
    for (i, (c, req, split)) in conns.iter_mut().enumerate() {
        c.send(&req[*split..]);
        let (err, cookie) = c.read_simple_reply();
        assert_eq!((err, cookie), (0, i as u64), "reply to the request completed after parking");
        let off = (i as u64) * 4096;
        assert_same_bytes(&c.read_exact_buf(4096), &pattern_bytes(off, 4096), "READ after parking");
    }
}

/// One structured or extended reply chunk: (flags, type, cookie, payload).
fn read_chunk(c: &mut RawClient, extended: bool) -> (u16, u16, u64, Vec<u8>) {
    if extended {
        let ch = c.read_extended_chunk();
        return (ch.flags, ch.typ, ch.cookie, ch.payload);
    }
    let m = c.u32();
    assert_eq!(m, STRUCTURED_REPLY_MAGIC, "expected a structured reply chunk, got magic {m:#x}");
    let flags = c.u16();
    let typ = c.u16();
    let cookie = c.u64();
    let len = c.u32();
    (flags, typ, cookie, c.read_exact_buf(len as usize))
}

fn read_request(extended: bool, flags: u16, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
    if extended {
        RawClient::ext_request_bytes(flags, CMD_READ, cookie, offset, u64::from(len))
    } else {
        RawClient::request_bytes(flags, CMD_READ, cookie, offset, len)
    }
}

/// A READ's reply: the data chunks laid out in a buffer, and the error chunks'
/// (errno, offset).
fn read_reply(c: &mut RawClient, extended: bool, cookie: u64, offset: u64, len: usize) -> (Vec<u8>, Vec<(u32, u64)>) {
    let mut buf = vec![0x55u8; len];
    let mut errors = Vec::new();
    loop {
        let (flags, typ, got, p) = read_chunk(c, extended);
        assert_eq!(got, cookie, "chunk of another request");
        match typ {
            REPLY_TYPE_OFFSET_DATA => {
                let at = (u64::from_be_bytes(p[..8].try_into().unwrap()) - offset) as usize;
                buf[at..at + p.len() - 8].copy_from_slice(&p[8..]);
            }
            REPLY_TYPE_NONE => assert!(p.is_empty()),
            REPLY_TYPE_ERROR_OFFSET => {
                let errno = u32::from_be_bytes(p[..4].try_into().unwrap());
                let mlen = u16::from_be_bytes([p[4], p[5]]) as usize;
                errors.push((errno, u64::from_be_bytes(p[6 + mlen..14 + mlen].try_into().unwrap())));
            }
            t => panic!("unexpected chunk type {t:#x}: {p:?}"),
        }
        if flags & REPLY_FLAG_DONE != 0 {
            return (buf, errors);
        }
    }
}

/// A file that fails under sendfile (cut short after the reply header went out) gives
/// the client EIO for that READ, and the connection goes on: with structured replies and
/// with extended headers.
#[test]
fn a_sendfile_read_whose_file_fails_gets_eio_and_the_connection_goes_on() {
    for extended in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let data = Rng::new(9).bytes(8 << 20);
        let path = dir.path().join("disk.img");
        fs::write(&path, &data).unwrap();
        let server = Server::unix(&format!("file:{}", path.display()), &[]);
        let mut c = RawClient::connect(&server);
        c.read_greeting();
        c.send_client_flags(CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES);
        let opt = if extended { OPT_EXTENDED_HEADERS } else { OPT_STRUCTURED_REPLY };
        c.send_option(opt, b"");
        assert_eq!(c.read_opt_reply().typ, REP_ACK);
        c.go("").expect("GO");
        c.set_timeout(Duration::from_secs(10));
        // DF: one data chunk, so the whole range goes out with sendfile.
        let read = |c: &mut RawClient, cookie: u64, off: u64, len: u32| {
            c.send(&read_request(extended, CMD_FLAG_DF, cookie, off, len));
            read_reply(c, extended, cookie, off, len as usize)
        };
        let (got, errors) = read(&mut c, 1, 4 * MIB, 1 << 20);
        assert!(errors.is_empty(), "{errors:?}");
        assert_same_bytes(&got, &data[4 << 20..5 << 20], "sendfile READ");
        let cut = MIB + 4096;
        fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(cut).unwrap();
        // Straddling the new end, then wholly past it.
        for (cookie, off) in [(2, MIB), (3, 4 * MIB)] {
            let (got, errors) = read(&mut c, cookie, off, 1 << 20);
            assert_eq!(errors, vec![(EIO, off.max(cut))], "READ at {off} of a file cut at {cut}");
            if off < cut {
                let n = (cut - off) as usize;
                assert_same_bytes(&got[..n], &data[off as usize..cut as usize], "bytes before the cut");
            }
        }
        let (got, errors) = read(&mut c, 4, 0, 256 * 1024);
        assert!(errors.is_empty(), "{errors:?}");
        assert_same_bytes(&got, &data[..256 * 1024], "READ after the failed ones");
        assert!(server.stderr().contains("for sendfile"), "the failure is logged:\n{}", server.stderr());
    }
}

#[test]
fn tls_require_answers_an_oversized_option_with_tls_reqd() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.psk");
    fs::write(&keys, "alice:00112233445566778899aabbccddeeff\n").unwrap();
    let server = Server::unix("memory:1M", &["--tls-psk", keys.to_str().unwrap(), "--tls", "require"]);
    let mut c = RawClient::connect(&server);
    c.set_timeout(Duration::from_secs(10));
    c.read_greeting();
    c.send_client_flags(CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES);
    for (opt, len) in [(OPT_GO, 70 * 1024), (OPT_INFO, 64 * 1024 + 1), (OPT_LIST, 0), (OPT_STRUCTURED_REPLY, 1 << 20)] {
        c.send_option(opt, &vec![0u8; len]);
        let r = c.read_opt_reply();
        assert_eq!((r.opt, r.typ), (opt, OPT_REPLY_ERR_TLS_REQD), "option {opt} with {len} bytes before STARTTLS");
    }
    c.send_option(OPT_ABORT, b"");
    assert_eq!(c.read_opt_reply().typ, REP_ACK);
}

/// Starts `ferry serve SPEC` as a service manager would, with LISTEN_FDS=2 but only one
/// listening socket at fd 3; fd 4 is `fd4` (a path opened read-only) or not open.
fn serve_activated(spec: &str, fd4: Option<&std::path::Path>) -> Output {
    let script = r#"
import os, socket, subprocess, sys, tempfile
ferry, spec, fd4 = sys.argv[1], sys.argv[2], sys.argv[3]
d = tempfile.mkdtemp()
l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
l.bind(os.path.join(d, "s"))
l.listen(4)
f = os.open(fd4, os.O_RDONLY) if fd4 else None
def setup():
    os.dup2(l.fileno(), 3)
    os.set_inheritable(3, True)
    if f is not None:
        os.dup2(f, 4)
        os.set_inheritable(4, True)
    else:
        try:
            os.close(4)
        except OSError:
            pass
p = subprocess.run(["sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=2 exec "$0" serve "$1"', ferry, spec],
                   preexec_fn=setup, close_fds=False, capture_output=True, timeout=20)
sys.stderr.write(p.stderr.decode())
sys.exit(p.returncode)
"#;
    let fd4 = fd4.map(|p| p.to_str().unwrap().to_string()).unwrap_or_default();
    run_timeout(
        Command::new("/usr/bin/python3").args(["-c", script]).arg(ferry_bin()).arg(spec).arg(fd4),
        Duration::from_secs(30),
    )
}

#[test]
fn an_overstated_listen_fds_is_refused_before_any_export_is_opened() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain.txt");
    fs::write(&plain, "not a socket").unwrap();
    // fd 4 is a regular file; the export does not exist: the refusal names fd 4, and comes
    // before the export is looked at.
    let out = serve_activated(dir.path().join("missing.img").to_str().unwrap(), Some(&plain));
    assert!(!out.status.success(), "{}", out.describe());
    assert!(out.stderr.contains("LISTEN_FDS=2, but descriptor 4 is not a socket"), "{}", out.describe());
    assert!(!out.stderr.contains("cannot serve"), "the export was opened first:\n{}", out.describe());
    // fd 4 not passed at all, and the export a real file (which would get fd 4).
    let disk = dir.path().join("disk.img");
    fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let out = serve_activated(disk.to_str().unwrap(), None);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(out.stderr.contains("LISTEN_FDS=2, but descriptor 4 is not open"), "{}", out.describe());
}

/// TRIM and WRITE_ZEROES of a whole 64 TiB memory: export, each one 32-byte request,
/// cost what is stored, not the length: they return at once.
#[test]
fn memory_trim_and_zero_of_64_tib_cost_what_is_stored() {
    let size = 64u64 << 40;
    let server = Server::unix("memory:64T", &[]);
    let mut c = RawClient::connect(&server);
    c.read_greeting();
    c.send_client_flags(CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES);
    c.send_option(OPT_EXTENDED_HEADERS, b"");
    assert_eq!(c.read_opt_reply().typ, REP_ACK);
    assert_eq!(c.go("").expect("GO").0, size);
    c.set_timeout(Duration::from_secs(60));
    let spots = [0, 5 * MIB + 17, size / 2, size - 4096];
    let mut cookie = 0u64;
    let mut call = |c: &mut RawClient, req: Vec<u8>| {
        cookie += 1;
        let mut req = req;
        req[8..16].copy_from_slice(&cookie.to_be_bytes());
        let t = Instant::now();
        c.send(&req);
        let ch = c.read_extended_chunk();
        assert_eq!((ch.cookie, ch.typ), (cookie, REPLY_TYPE_NONE), "{:?}", ch.payload);
        t.elapsed()
    };
    for (typ, what) in [(CMD_TRIM, "TRIM"), (CMD_WRITE_ZEROES, "WRITE_ZEROES")] {
        for &at in &spots {
            let mut w = RawClient::ext_request_bytes(0, CMD_WRITE, 0, at, 4096);
            w.extend(Rng::new(at).bytes(4096));
            call(&mut c, w);
        }
        let took = call(&mut c, RawClient::ext_request_bytes(0, typ, 0, 0, size));
        assert!(took < Duration::from_secs(1), "{what} of 64 TiB took {took:?}");
        for &at in &spots {
            c.send(&RawClient::ext_request_bytes(CMD_FLAG_DF, CMD_READ, 99, at, 4096));
            let ch = c.read_extended_chunk();
            assert_eq!(ch.typ, REPLY_TYPE_OFFSET_DATA);
            assert!(ch.payload[8..].iter().all(|&b| b == 0), "{what}: data left at {at}");
        }
    }
}

/// MSG_ZEROCOPY over IPv6: the completions come as IPV6_RECVERR control messages (60
/// bytes written, 64 reported), which `reap_zerocopy` must read from a zeroed buffer.
/// The kernel reports every loopback send as copied, so the statistics show the
/// completions were read.
#[test]
fn zerocopy_completions_are_reaped_over_ipv6() {
    let server = ServerBuilder::new("pattern:64M").bind("::").args(&["--zerocopy", "on", "--stats"]).start();
    let Addr::Tcp(port) = server.addr else { unreachable!() };
    let s = std::net::TcpStream::connect(("::1", port)).expect("connect over IPv6 loopback");
    let mut c = RawClient { s: Stream::Tcp(s) };
    c.set_timeout(Duration::from_secs(10));
    c.read_greeting();
    c.send_client_flags(CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES);
    c.export_name("", true);
    for i in 0..32u64 {
        let got = c.read(i * MIB, 1 << 20).expect("READ");
        assert_same_bytes(&got, &pattern_bytes(i * MIB, 1 << 20), "zero-copy READ over IPv6");
    }
    c.disconnect();
    let copied = |log: &str| {
        log.lines()
            .filter_map(|l| l.split(" copied by the kernel").next()?.rsplit(", ").next()?.parse::<u64>().ok())
            .sum::<u64>()
    };
    assert!(
        wait_until(Duration::from_secs(5), || copied(&server.stderr()) > 0),
        "no zero-copy completion was reaped:\n{}",
        server.stderr()
    );
}
