//! Connections at scale: thousands of idle clients cost the server neither threads nor
//! buffers, do not lock anyone out, and the limits that exist say so in the log.

use crate::common::raw::*;
use crate::common::*;
use std::io::{Read, Write};
use std::thread;
use std::time::{Duration, Instant};

/// This test process opens thousands of sockets: raise its own descriptor limit.
fn raise_nofile(need: u64) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let lim = getrlimit(Resource::Nofile);
    let _ = setrlimit(Resource::Nofile, Rlimit { current: lim.maximum, maximum: lim.maximum });
    let now = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
    assert!(now >= need, "this test needs {need} file descriptors but the hard RLIMIT_NOFILE is {now}: raise it");
}

/// The server's resident memory (KiB) and thread count.
fn server_status(server: &Server) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{}/status", server.pid())).expect("server status");
    let field = |name: &str| -> u64 {
        let l = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no {name} in status"));
        l[name.len()..].split_whitespace().next().unwrap().parse().unwrap()
    };
    (field("VmRSS:"), field("Threads:"))
}

fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        thread::sleep(Duration::from_millis(50));
    }
    f()
}

/// Writes then reads back 64 KiB at `offset`.
#[track_caller]
fn roundtrip(c: &mut RawClient, offset: u64, seed: u64) {
    let data = Rng::new(seed).bytes(64 * 1024);
    assert_eq!(c.write(offset, &data, 0), 0, "write at {offset} failed");
    let got = c.read(offset, data.len() as u32).unwrap_or_else(|e| panic!("read at {offset} failed: errno {e}"));
    assert_same_bytes(&got, &data, "read back");
}

fn open_idle(server: &Server, n: usize) -> Vec<RawClient> {
    (0..n).map(|i| RawClient::try_handshake(server).unwrap_or_else(|e| panic!("idle connection {i}: {e}")).0).collect()
}

/// Before: 100 idle clients (the old default --max-connections) locked out every
/// further client. Now the ceiling comes from RLIMIT_NOFILE, and the log says so.
#[test]
fn a_hundred_and_one_idle_clients_lock_nobody_out() {
    let server = Server::unix("memory:16M", &[]);
    let err = server.stderr();
    assert!(
        err.contains("accepting up to") && err.contains("RLIMIT_NOFILE="),
        "the connection ceiling must be logged at start:\n{err}"
    );
    let mut idle = open_idle(&server, 101);
    let (mut c, _, _) = RawClient::try_handshake(&server).expect("client 102 must get in");
    c.set_timeout(Duration::from_secs(5));
    roundtrip(&mut c, 0, 1);
    // The idle ones still work, after having been parked.
    thread::sleep(Duration::from_millis(600));
    roundtrip(&mut idle[0], MIB, 2);
    roundtrip(&mut idle[100], 2 * MIB, 3);
    assert!(!server.stderr().contains("refusing"), "nobody may be refused:\n{}", server.stderr());
}

/// 2,000 idle handshaken connections: the server holds them with a few threads and
/// little memory, a normal client (nbdcopy, 4 connections) is served at once, and
/// parked connections wake up when they send a request.
#[test]
fn two_thousand_idle_connections_cost_little_and_a_client_is_served() {
    const IDLE: usize = 2000;
    require("nbdcopy");
    raise_nofile(IDLE as u64 + 200);
    let server = Server::unix("memory:64M", &[]);
    let (rss0, _) = server_status(&server);
    let t0 = Instant::now();
    let mut idle = open_idle(&server, IDLE);
    assert!(t0.elapsed() < Duration::from_secs(20), "opening {IDLE} connections took {:?}", t0.elapsed());
    // Past the idle grace period (250 ms) every one of them is parked on the poller.
    let mut status = server_status(&server);
    wait_until(Duration::from_secs(5), || {
        status = server_status(&server);
        status.1 <= 4
    });
    let (rss, threads) = status;
    eprintln!("{IDLE} idle connections: server RSS {rss0} -> {rss} KiB, {threads} threads");
    // main + poller (+ one thread that may be finishing). Thread per connection had 2,001.
    assert!(threads <= 4, "{IDLE} idle connections hold {threads} threads");
    // A parked connection is its socket and session state: about 1 KiB in the server,
    // a few KiB with the allocator's slack. 24 KiB each is less than the stack pages
    // alone of a thread per connection (measured 33 to 75 KiB each with threads).
    let bound = rss0 + IDLE as u64 * 24;
    assert!(rss <= bound, "{IDLE} idle connections: RSS {rss} KiB (was {rss0} KiB before), bound {bound} KiB");

    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let back = dir.path().join("back");
    let data = Rng::new(7).bytes(32 * MIB as usize);
    std::fs::write(&src, &data).unwrap();
    let t1 = Instant::now();
    run_timeout(&mut cmd("nbdcopy", [src.to_str().unwrap(), &server.uri()]), Duration::from_secs(20));
    run_timeout(&mut cmd("nbdcopy", [&server.uri(), back.to_str().unwrap()]), Duration::from_secs(20));
    let took = t1.elapsed();
    eprintln!("nbdcopy 32 MiB there and back beside them: {took:?}");
    let got = std::fs::read(&back).unwrap();
    assert_same_bytes(&got[..data.len()], &data, "nbdcopy round trip beside 2,000 idle connections");
    assert!(took < Duration::from_secs(10), "nbdcopy of 32 MiB both ways took {took:?} beside idle connections");

    // Parked connections wake up on a request: a few of them, spread out.
    for (k, i) in [0, 777, 1999].into_iter().enumerate() {
        idle[i].set_timeout(Duration::from_secs(5));
        roundtrip(&mut idle[i], 40 * MIB + k as u64 * MIB, 10 + k as u64);
    }
    let (rss_after, _) = server_status(&server);
    // 32 MiB were written into the memory export; the connections add nothing lasting.
    let bound = rss0 + IDLE as u64 * 24 + 48 * 1024;
    assert!(rss_after <= bound, "RSS after the copy: {rss_after} KiB, bound {bound} KiB");
}

/// `--idle-timeout 1`: a silent connection is closed; one whose WRITE payload takes
/// three seconds to arrive is not, and gets its reply.
#[test]
fn idle_timeout_closes_silent_connections_not_long_requests() {
    let server = Server::unix("memory:16M", &["--idle-timeout", "1"]);
    let (mut silent, _, _) = RawClient::handshake(&server);
    let (mut slow, _, _) = RawClient::handshake(&server);
    slow.set_timeout(Duration::from_secs(10));
    let t0 = Instant::now();
    // A 4 MiB WRITE whose payload trickles in over 3 s.
    let len = 4 * MIB as usize;
    let data = Rng::new(3).bytes(len);
    slow.send(&RawClient::request_bytes(0, CMD_WRITE, 77, 0, len as u32));
    for piece in data.chunks(len / 20) {
        slow.send(piece);
        thread::sleep(Duration::from_millis(150));
    }
    let (err, cookie) = slow.read_simple_reply();
    assert_eq!((err, cookie), (0, 77), "the slow WRITE must be answered");
    assert!(t0.elapsed() >= Duration::from_secs(3));
    // Meanwhile the silent one was closed, between 1 s and 1 s + a quarter.
    assert!(silent.closed_within(Duration::from_secs(1)), "the silent connection must be closed after 1 s");
    // Right after its reply, the slow one goes on.
    let got = slow.read(0, 4096).expect("read after the slow write");
    assert_same_bytes(&got, &data[..4096], "data of the slow write");
    // And once it falls silent, it is closed too.
    let t1 = Instant::now();
    assert!(slow.closed_within(Duration::from_secs(4)), "the slow connection must be closed once silent");
    assert!(t1.elapsed() >= Duration::from_millis(900), "closed after only {:?}", t1.elapsed());
    assert!(server.stderr().contains("--idle-timeout"), "the closing must be logged:\n{}", server.stderr());
}

/// `--max-connections-per-client 3`: the fourth connection from 127.0.0.1 is closed at
/// once with a warning naming the limit; when one leaves, another gets in.
#[test]
fn per_client_limit_refuses_with_a_log_line() {
    let server = Server::tcp("memory:16M", &["--max-connections-per-client", "3"]);
    // The readiness probe's connection may take a moment to be forgotten.
    let mut clients = Vec::new();
    for i in 0..3 {
        let c = RawClient::handshake_within(&server, Duration::from_secs(5));
        clients.push(c.unwrap_or_else(|| panic!("client {i} could not connect")));
    }
    assert!(RawClient::try_handshake(&server).is_err(), "a fourth connection from the same address must be refused");
    let err = server.stderr();
    assert!(
        err.contains("refusing connection from 127.0.0.1") && err.contains("--max-connections-per-client"),
        "the refusal must be logged with the limit that caused it:\n{err}"
    );
    for (i, c) in clients.iter_mut().enumerate() {
        roundtrip(c, i as u64 * MIB, i as u64);
    }
    clients.pop().unwrap().disconnect();
    assert!(
        wait_until(Duration::from_secs(5), || RawClient::try_handshake(&server).is_ok()),
        "after one left, a new connection must get in"
    );
}

/// A parked TLS connection (PSK) wakes up and goes on: OpenSSL's state travels with it.
#[test]
fn parked_tls_connection_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.psk");
    std::fs::write(&keys, "alice:0123456789abcdef0123456789abcdef\n").unwrap();
    let server = Server::unix("memory:16M", &["--tls-psk", keys.to_str().unwrap()]);
    let Addr::Unix(sock) = &server.addr else { unreachable!() };
    let uri = format!("nbds+unix://alice@/?socket={}&tls-psk-file={}", sock.display(), keys.display());
    let uri = ferry_client::Uri::parse(&uri).unwrap();
    let mut c = ferry_client::Connection::connect(&uri, &Default::default()).expect("TLS connection");
    let data = Rng::new(5).bytes(256 * 1024);
    let mut bufs = vec![vec![0u8; data.len()]];
    for round in 0..3u64 {
        // Longer than the idle grace period: the connection is parked each time.
        thread::sleep(Duration::from_millis(600));
        let offset = round * MIB;
        let w = ferry_client::Submit {
            cmd: CMD_WRITE,
            flags: 0,
            offset,
            length: data.len() as u64,
            payload: Some(ferry_client::Payload::Bytes(&data)),
            slot: 0,
        };
        c.submit(&[w]).unwrap();
        c.receive(&mut bufs).unwrap().result.expect("write after parking");
        thread::sleep(Duration::from_millis(600));
        let r =
            ferry_client::Submit { cmd: CMD_READ, flags: 0, offset, length: data.len() as u64, payload: None, slot: 0 };
        c.submit(&[r]).unwrap();
        c.receive(&mut bufs).unwrap().result.expect("read after parking");
        assert_same_bytes(&bufs[0], &data, "TLS read after parking");
    }
}

/// SIGTERM with many parked connections: the server closes them and exits promptly.
#[test]
fn sigterm_with_parked_connections_exits_promptly() {
    raise_nofile(600);
    let mut server = Server::unix("memory:16M", &[]);
    let mut idle = open_idle(&server, 500);
    thread::sleep(Duration::from_millis(600));
    let t0 = Instant::now();
    let st = server.signal_and_wait(libc::SIGTERM, Duration::from_secs(10));
    assert!(st.success(), "server exit status {st}");
    assert!(t0.elapsed() < Duration::from_secs(3), "exit took {:?}", t0.elapsed());
    let mut b = [0u8; 1];
    for c in idle.iter_mut().take(10) {
        c.set_timeout(Duration::from_secs(2));
        assert!(matches!(c.s.read(&mut b), Ok(0) | Err(_)), "connection must be closed");
        let _ = c.s.write(b"x");
    }
}
