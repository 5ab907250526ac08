//! Misbehaving clients, spoken to with the raw client in common/raw.rs: the server
//! must drop (only) the offending connection, never buffer what a client claims it
//! will send, enforce its limits, and keep serving everyone else.

use crate::common::raw::*;
use crate::common::*;
use std::io::{ErrorKind, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

const RSS_LIMIT: u64 = 200 * MIB;

/// Sends `bytes` after the greeting (or without reading it) and expects the server
/// to close the connection, while `bystander` and fresh clients keep working.
fn expect_dropped(
    server: &mut Server,
    bystander: &mut RawClient,
    what: &str,
    read_greeting: bool,
    bytes: &[u8],
    n: u64,
) {
    let mut c = RawClient::connect(server);
    if read_greeting {
        c.read_greeting();
    }
    // The server may hang up while we are still sending; that is fine.
    let _ = c.try_send(bytes);
    assert!(c.closed_within(Duration::from_secs(5)), "{what}: the server must close the connection");
    server.assert_alive();
    io_roundtrip(bystander, n * MIB, n);
    fresh_client_works(server, n * MIB + 512 * KIB, n + 100);
}

fn garbage(seed: u64, n: usize) -> Vec<u8> {
    Rng::new(seed).bytes(n)
}

#[test]
fn garbage_and_bad_magic_in_handshake_close_only_that_connection() {
    let mut server = Server::unix("memory:64M", &[]);
    let (mut bystander, size, _) = RawClient::handshake(&server);
    assert_eq!(size, 64 * MIB);

    // Garbage straight after connecting, greeting unread.
    expect_dropped(&mut server, &mut bystander, "garbage without reading greeting", false, &garbage(1, 4096), 1);
    // Valid client flags, then garbage where an option header should be.
    let mut b = (CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES).to_be_bytes().to_vec();
    b.extend(garbage(2, 200));
    expect_dropped(&mut server, &mut bystander, "garbage instead of an option", true, &b, 2);
    // Wrong option magic, otherwise well-formed option.
    let mut b = (CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES).to_be_bytes().to_vec();
    let mut opt = RawClient::option_bytes(OPT_EXPORT_NAME, b"");
    opt[..8].copy_from_slice(&0x4948_4156_454F_5055u64.to_be_bytes());
    b.extend(opt);
    expect_dropped(&mut server, &mut bystander, "wrong option magic", true, &b, 3);
    // Unknown client flags (fixed newstyle: the server must refuse them).
    let mut b = 0xffff_fffcu32.to_be_bytes().to_vec();
    b.extend(RawClient::option_bytes(OPT_EXPORT_NAME, b""));
    expect_dropped(&mut server, &mut bystander, "unknown client flags", true, &b, 4);
    // Client flags without FIXED_NEWSTYLE... then an HTTP request, as a confused client.
    expect_dropped(&mut server, &mut bystander, "HTTP request", false, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 5);
}

#[test]
fn truncated_handshakes_and_requests_leave_server_healthy() {
    let mut server = Server::tcp("memory:64M", &[]);
    let (mut bystander, _, _) = RawClient::handshake(&server);
    let flags = (CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES).to_be_bytes().to_vec();
    let mut cases: Vec<(&str, bool, Vec<u8>)> = vec![
        ("connect and close at once", false, vec![]),
        ("read greeting and close", true, vec![]),
        ("half the client flags", true, flags[..2].to_vec()),
        ("client flags only", true, flags.clone()),
    ];
    let mut half_opt = flags.clone();
    half_opt.extend(&RawClient::option_bytes(OPT_GO, b"")[..10]);
    cases.push(("half an option header", true, half_opt));
    let mut short_data = flags.clone();
    let mut o = RawClient::option_bytes(OPT_INFO, &[0u8; 10]);
    o[12..16].copy_from_slice(&1000u32.to_be_bytes()); // claims 1000 bytes, sends 10
    short_data.extend(o);
    cases.push(("option data shorter than its length", true, short_data));
    let mut short_name = flags.clone();
    let mut o = RawClient::option_bytes(OPT_EXPORT_NAME, b"ab");
    o[12..16].copy_from_slice(&5u32.to_be_bytes());
    short_name.extend(o);
    cases.push(("export name cut short", true, short_name));

    for (i, (what, greet, bytes)) in cases.into_iter().enumerate() {
        let mut c = RawClient::connect(&server);
        if greet {
            c.read_greeting();
        }
        let _ = c.try_send(&bytes);
        drop(c);
        thread::sleep(Duration::from_millis(50));
        server.assert_alive();
        io_roundtrip(&mut bystander, i as u64 * MIB, 10 + i as u64);
        eprintln!("ok: {what}");
    }

    // Requests cut short after a good handshake: a WRITE header with part of its
    // payload, a lone half header, and a READ whose reply is never read.
    let (mut c, _, _) = RawClient::handshake(&server);
    let mut b = RawClient::request_bytes(0, CMD_WRITE, 1, 0, 1 << 20);
    b.extend(vec![0x77u8; 100_000]);
    c.send(&b);
    drop(c);
    let (mut c, _, _) = RawClient::handshake(&server);
    c.send(&RawClient::request_bytes(0, CMD_READ, 2, 0, 4096)[..13]);
    drop(c);
    let (mut c, _, _) = RawClient::handshake(&server);
    c.send_request(0, CMD_READ, 3, 0, 32 << 20);
    drop(c);
    thread::sleep(Duration::from_millis(200));
    server.assert_alive();
    io_roundtrip(&mut bystander, 20 * MIB, 20);
    fresh_client_works(&server, 21 * MIB, 21);
}

#[test]
fn bad_request_magic_closes_only_that_connection() {
    let mut server = Server::unix("memory:16M", &[]);
    let (mut bystander, _, _) = RawClient::handshake(&server);
    let (mut bad, _, _) = RawClient::handshake(&server);
    io_roundtrip(&mut bad, 0, 1);
    let mut req = RawClient::request_bytes(0, CMD_READ, 9, 0, 4096);
    req[..4].copy_from_slice(&0xdead_beefu32.to_be_bytes());
    bad.send(&req);
    assert!(bad.closed_within(Duration::from_secs(5)), "bad request magic must close the connection");
    server.assert_alive();
    io_roundtrip(&mut bystander, MIB, 2);
    fresh_client_works(&server, 2 * MIB, 3);

    // Random garbage as requests.
    let (mut bad, _, _) = RawClient::handshake(&server);
    let _ = bad.try_send(&garbage(7, 1000));
    assert!(bad.closed_within(Duration::from_secs(5)), "garbage requests must close the connection");
    io_roundtrip(&mut bystander, 3 * MIB, 4);
}

#[test]
fn unknown_command_and_flags_get_einval_and_connection_survives() {
    let server = Server::unix("memory:16M", &[]);
    let (mut c, size, _) = RawClient::handshake(&server);
    io_roundtrip(&mut c, 0, 1);
    assert_eq!(c.simple_cmd(0, 99, 0, 4096), EINVAL, "unknown command type");
    io_roundtrip(&mut c, 0, 2);
    assert_eq!(c.simple_cmd(1 << 12, CMD_READ, 0, 4096), EINVAL, "READ with an unknown flag");
    io_roundtrip(&mut c, 0, 3);
    assert_eq!(c.simple_cmd(1 << 12, CMD_FLUSH, 0, 0), EINVAL, "FLUSH with an unknown flag");
    io_roundtrip(&mut c, 0, 4);
    // BLOCK_STATUS without a negotiated meta context is invalid.
    assert_eq!(c.simple_cmd(0, CMD_BLOCK_STATUS, 0, 4096), EINVAL, "BLOCK_STATUS without meta context");
    io_roundtrip(&mut c, 0, 5);
    // Out of range READ / TRIM -> EINVAL, WRITE / WRITE_ZEROES -> ENOSPC.
    assert_eq!(c.read(size, 4096), Err(EINVAL), "READ past the end");
    assert_eq!(c.read(size - 4096, 8192), Err(EINVAL), "READ straddling the end");
    assert_eq!(c.read(u64::MAX - 4095, 4096), Err(EINVAL), "READ at an offset that overflows");
    assert_eq!(c.simple_cmd(0, CMD_TRIM, size, 4096), EINVAL, "TRIM past the end");
    assert_eq!(c.write(size - 4096, &[0xee; 8192], 0), ENOSPC, "WRITE straddling the end");
    // The refused write's payload was consumed: the connection is still in sync.
    io_roundtrip(&mut c, 0, 6);
    assert_eq!(c.read(size - 4096, 4096), Ok(vec![0u8; 4096]), "a refused write must write nothing");
    assert_eq!(c.write(size, &[0xee; 4096], CMD_FLAG_FUA), ENOSPC, "WRITE past the end");
    assert_eq!(c.simple_cmd(0, CMD_WRITE_ZEROES, size - 512, 1024), ENOSPC, "WRITE_ZEROES past the end");
    io_roundtrip(&mut c, 0, 7);
    // Reads and writes right up to the end are fine.
    assert_eq!(c.write(size - 4096, &[0xab; 4096], 0), 0);
    assert_eq!(c.read(size - 4096, 4096), Ok(vec![0xab; 4096]));
    assert_eq!(c.simple_cmd(0, CMD_FLUSH, 0, 0), 0, "FLUSH");
    assert_eq!(c.simple_cmd(0, CMD_CACHE, 0, 4096), 0, "CACHE");
    c.disconnect();
    assert!(c.closed_within(Duration::from_secs(5)), "NBD_CMD_DISC must end the connection");
}

#[test]
fn read_only_export_refuses_writes_with_eperm() {
    let server = Server::unix("memory:16M", &["--read-only"]);
    let (mut c, _, flags) = RawClient::handshake(&server);
    assert_ne!(flags & TFLAG_READ_ONLY, 0, "read-only flag must be set");
    assert_eq!(flags & (TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES), 0, "no trim/zero on read-only");
    assert_eq!(c.write(0, &[1u8; 4096], 0), EPERM, "WRITE to read-only export");
    assert_eq!(c.read(0, 4096), Ok(vec![0u8; 4096]), "connection in sync, nothing written");
    assert_eq!(c.simple_cmd(0, CMD_WRITE_ZEROES, 0, 4096), EPERM, "WRITE_ZEROES to read-only export");
    assert_eq!(c.simple_cmd(0, CMD_TRIM, 0, 4096), EPERM, "TRIM on read-only export");
    assert_eq!(c.read(0, 16), Ok(vec![0u8; 16]));
}

#[test]
fn pipelined_requests_are_all_answered() {
    let server = Server::tcp("memory:16M", &[]);
    let (mut c, _, _) = RawClient::handshake(&server);
    let n = 32u64;
    let blk = 64 * 1024usize;
    // 32 writes sent back to back, then all the replies.
    let mut out = Vec::new();
    let mut blocks = Vec::new();
    for i in 0..n {
        let d = Rng::new(1000 + i).bytes(blk);
        out.extend(RawClient::request_bytes(0, CMD_WRITE, 0x1000 + i, i * blk as u64, blk as u32));
        out.extend(&d);
        blocks.push(d);
    }
    // Send from another thread so a server that answers before reading everything
    // cannot deadlock the test.
    let mut w = c.s.try_clone();
    let sender = thread::spawn(move || w.write_all(&out));
    let mut seen = std::collections::HashSet::new();
    for _ in 0..n {
        let (err, cookie) = c.read_simple_reply();
        assert_eq!(err, 0, "write {cookie:#x} failed");
        assert!((0x1000..0x1000 + n).contains(&cookie), "unknown cookie {cookie:#x}");
        assert!(seen.insert(cookie), "cookie {cookie:#x} answered twice");
    }
    sender.join().unwrap().unwrap();
    // 32 reads back to back; replies may come in any order.
    let mut out = Vec::new();
    for i in 0..n {
        out.extend(RawClient::request_bytes(0, CMD_READ, 0x2000 + i, i * blk as u64, blk as u32));
    }
    c.send(&out);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..n {
        let (err, cookie) = c.read_simple_reply();
        assert_eq!(err, 0);
        let i = cookie.checked_sub(0x2000).filter(|i| *i < n).unwrap_or_else(|| panic!("bad cookie {cookie:#x}"));
        assert!(seen.insert(cookie));
        let data = c.read_exact_buf(blk);
        assert_same_bytes(&data, &blocks[i as usize], &format!("pipelined read {i}"));
    }
}

#[test]
fn many_concurrent_clients() {
    let server = Server::unix("memory:64M", &[]);
    thread::scope(|s| {
        for t in 0..16u64 {
            let server = &server;
            s.spawn(move || {
                let (mut c, _, _) = RawClient::handshake(server);
                for k in 0..4u64 {
                    io_roundtrip(&mut c, t * 4 * MIB + k * MIB, t * 100 + k);
                }
                c.disconnect();
            });
        }
    });
    // Everything each client wrote is still there.
    let (mut c, _, _) = RawClient::handshake(&server);
    for t in 0..16u64 {
        for k in 0..4u64 {
            let want = Rng::new(t * 100 + k).bytes(256 * 1024);
            let got = c.read(t * 4 * MIB + k * MIB, 256 * 1024).unwrap();
            assert_same_bytes(&got, &want, &format!("client {t} block {k}"));
        }
    }
}

#[test]
fn option_negotiation_raw() {
    let server = ServerBuilder::new("memory:16M").export("other", "memory:1M").start();
    let mut c = RawClient::connect(&server);
    let gflags = c.read_greeting();
    assert_eq!(gflags & (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    // Without NO_ZEROES: EXPORT_NAME must be followed by 124 zero bytes.
    c.send_client_flags(CFLAG_FIXED_NEWSTYLE);
    c.send_option(OPT_STARTTLS, b"");
    let r = c.read_opt_reply();
    assert_eq!((r.opt, r.typ), (OPT_STARTTLS, REP_ERR_UNSUP), "STARTTLS must be answered with ERR_UNSUP");
    c.send_option(0x1234, b"xyz");
    let r = c.read_opt_reply();
    assert_eq!(r.opt, 0x1234);
    assert_eq!(r.typ, REP_ERR_UNSUP, "unknown option must be answered with ERR_UNSUP");
    c.send_option(OPT_LIST, b"");
    let mut names = Vec::new();
    loop {
        let r = c.read_opt_reply();
        assert_eq!(r.opt, OPT_LIST);
        match r.typ {
            REP_SERVER => {
                let n = u32::from_be_bytes(r.data[..4].try_into().unwrap()) as usize;
                names.push(String::from_utf8(r.data[4..4 + n].to_vec()).unwrap());
            }
            REP_ACK => break,
            t => panic!("unexpected LIST reply {t:#x}"),
        }
    }
    names.sort();
    assert_eq!(names, vec!["".to_string(), "other".to_string()]);
    // LIST with data is invalid, but the connection goes on.
    c.send_option(OPT_LIST, b"junk");
    let r = c.read_opt_reply();
    assert!(r.typ & 0x8000_0000 != 0, "LIST with data must get an error reply, got {:#x}", r.typ);
    let (size, flags) = c.export_name("", false);
    assert_eq!(size, 16 * MIB);
    assert_ne!(flags & TFLAG_HAS_FLAGS, 0);
    assert_ne!(flags & TFLAG_SEND_FLUSH, 0);
    assert_ne!(flags & TFLAG_CAN_MULTI_CONN, 0);
    io_roundtrip(&mut c, 0, 1);

    // OPT_ABORT ends the session.
    let mut c = RawClient::connect(&server);
    c.read_greeting();
    c.send_client_flags(CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES);
    c.send_option(OPT_ABORT, b"");
    assert!(c.closed_within(Duration::from_secs(5)), "OPT_ABORT must close the connection");

    // EXPORT_NAME of a missing export: the server closes the connection.
    let mut c = RawClient::connect(&server);
    c.read_greeting();
    c.send_client_flags(CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES);
    c.send_option(OPT_EXPORT_NAME, b"missing");
    assert!(c.closed_within(Duration::from_secs(5)), "EXPORT_NAME of a missing export must close");

    // GO for a missing export fails, a later GO works on the same connection.
    let mut c = RawClient::connect(&server);
    c.read_greeting();
    c.send_client_flags(CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES);
    let e = c.go("missing").expect_err("GO for a missing export must fail");
    assert_eq!(e, REP_ERR_UNKNOWN, "GO for a missing export: ERR_UNKNOWN");
    let (size, _) = c.go("").expect("GO for the default export");
    assert_eq!(size, 16 * MIB);
    io_roundtrip(&mut c, MIB, 2);
}

/// A client that stops mid-handshake is dropped after --handshake-timeout; the limit
/// covers the whole handshake (slow drip feeding does not extend it) and does not
/// apply once transmission has begun. (ferry-only: nbdkit has no such option.)
#[test]
fn handshake_timeout_drops_stalled_clients() {
    let server = Server::unix("memory:16M", &["--handshake-timeout", "1"]);
    // A client that finished its handshake may idle.
    let (mut idle, _, _) = RawClient::handshake(&server);

    let t0 = Instant::now();
    let mut a = RawClient::connect(&server);
    a.read_greeting();
    a.send_client_flags(CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES);
    let mut b = RawClient::connect(&server); // never reads the greeting
    assert!(a.closed_within(Duration::from_secs(5)), "stalled client must be dropped");
    let ta = t0.elapsed();
    assert!(b.closed_within(Duration::from_secs(2)), "client that never read the greeting must be dropped");
    assert!(
        ta >= Duration::from_millis(700) && ta <= Duration::from_secs(4),
        "dropped after {ta:?}, expected about 1 s"
    );

    // Drip-feed a long option one byte every 200 ms: still dropped after ~1 s.
    let t0 = Instant::now();
    let mut c = RawClient::connect(&server);
    c.read_greeting();
    c.send_client_flags(CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES);
    let opt = RawClient::option_bytes(OPT_INFO, &[0u8; 200]);
    let mut dropped = false;
    for byte in opt.chunks(1) {
        if c.try_send(byte).is_err() || c.closed_within(Duration::from_millis(200)) {
            dropped = true;
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "slow client not dropped after 5 s");
    }
    assert!(dropped, "slow client must be dropped");
    assert!(t0.elapsed() <= Duration::from_secs(4), "slow client dropped only after {:?}", t0.elapsed());

    // The client that completed its handshake long ago still works.
    thread::sleep(Duration::from_millis(1500));
    io_roundtrip(&mut idle, 0, 1);
    fresh_client_works(&server, MIB, 2);
}

#[test]
fn max_connections_cap() {
    let server = Server::unix("memory:16M", &["--max-connections", "2"]);
    // The readiness probe's connection may take a moment to be forgotten.
    let connect_ok = || {
        RawClient::handshake_within(&server, Duration::from_secs(5))
            .expect("could not connect within the connection cap")
    };
    let mut c1 = connect_ok();
    let mut c2 = connect_ok();
    io_roundtrip(&mut c1, 0, 1);
    io_roundtrip(&mut c2, MIB, 2);

    // A third connection is closed at once (well before any handshake timeout).
    for _ in 0..3 {
        match server.connect() {
            Err(_) => {}
            Ok(s) => {
                let mut c3 = RawClient { s };
                assert!(c3.closed_within(Duration::from_secs(3)), "third connection must be closed");
            }
        }
        assert!(RawClient::try_handshake(&server).is_err(), "no third session may be established");
    }
    io_roundtrip(&mut c1, 2 * MIB, 3);
    io_roundtrip(&mut c2, 3 * MIB, 4);

    // After one leaves, a new client gets in.
    c1.disconnect();
    assert!(c1.closed_within(Duration::from_secs(5)));
    drop(c1);
    let mut c4 = connect_ok();
    io_roundtrip(&mut c4, 4 * MIB, 5);
    io_roundtrip(&mut c2, 5 * MIB, 6);
}

/// Streams `len` bytes of payload on a clone of `c`'s socket while sampling the
/// server's RSS; returns (bytes sent, send error, peak RSS).
fn stream_and_watch(server: &Server, c: &RawClient, len: u64) -> (u64, Option<std::io::Error>, u64) {
    let mut w = c.s.try_clone();
    w.set_write_timeout(Some(Duration::from_secs(30)));
    let done = Arc::new(AtomicBool::new(false));
    let done2 = done.clone();
    let writer = thread::spawn(move || {
        let chunk = vec![0xabu8; 1 << 20];
        let mut sent = 0u64;
        let mut err = None;
        while sent < len {
            let n = chunk.len().min((len - sent) as usize);
            if let Err(e) = w.write_all(&chunk[..n]) {
                err = Some(e);
                break;
            }
            sent += n as u64;
        }
        done2.store(true, Ordering::SeqCst);
        (sent, err)
    });
    let mut peak = 0;
    while !done.load(Ordering::SeqCst) {
        if let Some(r) = rss_of(server.pid()) {
            peak = peak.max(r);
        }
        thread::sleep(Duration::from_millis(10));
    }
    let (sent, err) = writer.join().unwrap();
    if let Some(r) = rss_of(server.pid()) {
        peak = peak.max(r);
    }
    (sent, err, peak)
}

/// After a huge request: either the server closed the connection, or it answered
/// with an error (and is still in sync). Panics if it claimed success.
fn refused_or_closed(c: &mut RawClient, cookie: u64, what: &str) {
    c.set_timeout(Duration::from_secs(10));
    let mut hdr = [0u8; 16];
    match c.s.read_exact(&mut hdr) {
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            panic!("{what}: server neither answered nor closed the connection")
        }
        Err(_) => eprintln!("{what}: connection closed"),
        Ok(()) => {
            let magic = u32::from_be_bytes(hdr[..4].try_into().unwrap());
            let err = u32::from_be_bytes(hdr[4..8].try_into().unwrap());
            let ck = u64::from_be_bytes(hdr[8..].try_into().unwrap());
            assert_eq!(magic, SIMPLE_REPLY_MAGIC, "{what}: bad reply magic");
            assert_eq!(ck, cookie, "{what}: reply cookie");
            assert_ne!(err, 0, "{what}: a request over 32 MiB must not succeed");
            eprintln!("{what}: refused with errno {err}");
        }
    }
}

#[test]
fn oversized_write_is_refused_without_buffering() {
    let mut server = Server::unix("memory:1G", &[]);
    let (mut bystander, _, _) = RawClient::handshake(&server);
    io_roundtrip(&mut bystander, 0, 1);
    let base = server.rss_bytes();

    let (mut c, _, _) = RawClient::handshake(&server);
    let len: u64 = 256 * MIB;
    c.send_request(0, CMD_WRITE, 0xb16, 0, len as u32);
    let (sent, err, peak) = stream_and_watch(&server, &c, len);
    eprintln!("sent {sent} of {len} payload bytes (error: {err:?}); server RSS {base} -> peak {peak}");
    if let Some(e) = &err {
        assert!(
            !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "the server neither read the payload nor closed the connection: {e}"
        );
    } else {
        refused_or_closed(&mut c, 0xb16, "256 MiB WRITE");
    }
    assert!(peak < RSS_LIMIT, "server RSS reached {peak} bytes while a 256 MiB write was streamed");
    server.assert_alive();
    io_roundtrip(&mut bystander, MIB, 2);
    fresh_client_works(&server, 2 * MIB, 3);
    // Nothing of the refused write landed.
    let got = bystander.read(512 * MIB, 4096).unwrap();
    assert_eq!(got, vec![0u8; 4096], "the refused write must not have written data");
}

#[test]
fn oversized_read_is_refused_without_buffering() {
    let mut server = Server::unix("memory:2G", &[]);
    let (mut bystander, _, _) = RawClient::handshake(&server);
    let (mut c, _, _) = RawClient::handshake(&server);
    // Fill some memory so a server that did serve the read would have data to copy.
    io_roundtrip(&mut c, 0, 1);
    c.send_request(0, CMD_READ, 0xbead, 0, (1 << 30) - 4096);
    let t0 = Instant::now();
    let mut peak = 0;
    while t0.elapsed() < Duration::from_millis(500) {
        peak = peak.max(server.rss_bytes());
        thread::sleep(Duration::from_millis(10));
    }
    refused_or_closed(&mut c, 0xbead, "1 GiB READ");
    peak = peak.max(server.rss_bytes());
    assert!(peak < RSS_LIMIT, "server RSS reached {peak} bytes for a 1 GiB read request");
    server.assert_alive();
    io_roundtrip(&mut bystander, MIB, 2);
}

/// An option whose data is far over the 64 KiB option limit: the server either hangs
/// up, or discards the data without keeping it and answers with an error (ferry:
/// NBD_REP_ERR_TOO_BIG), after which the handshake can go on.
#[test]
fn oversized_option_is_refused_without_buffering() {
    let mut server = Server::unix("memory:16M", &[]);
    let (mut bystander, _, _) = RawClient::handshake(&server);
    let mut c = RawClient::connect(&server);
    c.read_greeting();
    c.send_client_flags(CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES);
    let len = 256 * MIB;
    let mut hdr = RawClient::option_bytes(OPT_GO, b"");
    hdr[12..16].copy_from_slice(&(len as u32).to_be_bytes());
    c.send(&hdr);
    let (sent, err, peak) = stream_and_watch(&server, &c, len);
    eprintln!("sent {sent} of {len} option bytes (error: {err:?}); server RSS peak {peak}");
    assert!(peak < RSS_LIMIT, "server RSS reached {peak} bytes while a 256 MiB option was streamed");
    if let Some(e) = &err {
        assert!(
            !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "the server neither read the option data nor closed the connection: {e}"
        );
    } else {
        // Either EOF, or an error reply and a usable connection.
        let mut m = [0u8; 8];
        c.set_timeout(Duration::from_secs(10));
        match c.s.read_exact(&mut m) {
            Err(e) => {
                assert!(
                    !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
                    "the server neither answered the oversized option nor closed the connection"
                );
            }
            Ok(()) => {
                assert_eq!(u64::from_be_bytes(m), OPT_REPLY_MAGIC, "bad option reply magic");
                let opt = c.u32();
                let typ = c.u32();
                let n = c.u32();
                c.read_exact_buf(n as usize);
                assert_eq!(opt, OPT_GO);
                assert!(typ & 0x8000_0000 != 0, "an oversized option must get an error reply, got {typ:#x}");
                let (size, _) = c.export_name("", true);
                assert_eq!(size, 16 * MIB);
                io_roundtrip(&mut c, 2 * MIB, 2);
            }
        }
    }
    server.assert_alive();
    io_roundtrip(&mut bystander, 0, 1);
}

/// Extended headers (NBD_OPT_EXTENDED_HEADERS) by hand: 32-byte requests, 32-byte
/// reply chunks. (ferry-only: nbdkit 1.32 does not offer extended headers.)
#[test]
fn extended_headers_raw() {
    let server = Server::unix("memory:16M", &[]);
    let mut c = RawClient::connect(&server);
    c.read_greeting();
    c.send_client_flags(CFLAG_FIXED_NEWSTYLE | CFLAG_NO_ZEROES);
    c.send_option(OPT_EXTENDED_HEADERS, b"");
    let r = c.read_opt_reply();
    assert_eq!((r.opt, r.typ), (OPT_EXTENDED_HEADERS, REP_ACK), "extended headers must be accepted");
    let (size, _) = c.go("").expect("GO");
    assert_eq!(size, 16 * MIB);

    let ext_req = RawClient::ext_request_bytes;
    let data = Rng::new(5).bytes(8192);
    let mut req = ext_req(0, CMD_WRITE, 7, 4096, 8192);
    req.extend(&data);
    c.send(&req);
    let ch = c.read_extended_chunk();
    assert_eq!(ch.cookie, 7);
    assert_ne!(ch.flags & REPLY_FLAG_DONE, 0, "write reply must be final");
    assert_eq!(ch.typ, REPLY_TYPE_NONE, "write succeeds with a NONE chunk, got type {:#x} {:?}", ch.typ, ch.payload);

    // Read [0, 16 KiB): hole, data, hole.
    c.send(&ext_req(0, CMD_READ, 8, 0, 16384));
    let mut buf = vec![0x55u8; 16384];
    let mut covered = 0u64;
    loop {
        let ch = c.read_extended_chunk();
        assert_eq!(ch.cookie, 8);
        match ch.typ {
            REPLY_TYPE_OFFSET_DATA => {
                let off = u64::from_be_bytes(ch.payload[..8].try_into().unwrap()) as usize;
                let d = &ch.payload[8..];
                buf[off..off + d.len()].copy_from_slice(d);
                covered += d.len() as u64;
            }
            REPLY_TYPE_OFFSET_HOLE => {
                let off = u64::from_be_bytes(ch.payload[..8].try_into().unwrap()) as usize;
                let n = u32::from_be_bytes(ch.payload[8..12].try_into().unwrap()) as usize;
                buf[off..off + n].fill(0);
                covered += n as u64;
            }
            REPLY_TYPE_NONE => {}
            t => panic!("unexpected chunk type {t:#x} in read reply: {:?}", ch.payload),
        }
        if ch.flags & REPLY_FLAG_DONE != 0 {
            break;
        }
    }
    assert_eq!(covered, 16384, "read chunks must cover the request");
    let mut want = vec![0u8; 16384];
    want[4096..12288].copy_from_slice(&data);
    assert_same_bytes(&buf, &want, "extended-header read");

    // An out-of-range read gets an error chunk, and the connection goes on.
    c.send(&ext_req(0, CMD_READ, 9, size, 4096));
    let ch = c.read_extended_chunk();
    assert_eq!(ch.cookie, 9);
    assert!(ch.typ & 0x8000 != 0, "out-of-range read must get an error chunk, got {:#x}", ch.typ);
    assert_eq!(u32::from_be_bytes(ch.payload[..4].try_into().unwrap()), EINVAL);
    assert_ne!(ch.flags & REPLY_FLAG_DONE, 0);
    c.send(&ext_req(0, CMD_FLUSH, 10, 0, 0));
    let ch = c.read_extended_chunk();
    assert_eq!((ch.cookie, ch.typ), (10, REPLY_TYPE_NONE));
}
