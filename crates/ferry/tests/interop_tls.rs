//! TLS interop, both ways: ferry serve with libnbd (nbdinfo, nbdcopy), qemu-img and
//! ferry's own client; ferry copy/info/hash against nbdkit and qemu-nbd with TLS.
//! X.509 and PSK, Unix and TCP. Certificates and keys are made by each test with
//! certtool and psktool (gnutls-bin), never checked in. Then every refusal the issue
//! lists: wrong CA, wrong key, unknown identity, plaintext against `require`, TLS
//! against `off`, a client that stops half way, and bytes injected after STARTTLS.

use crate::common::raw::RawClient;
use crate::common::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const OPT_STARTTLS: u32 = 5;
const REP_ACK: u32 = 1;

fn certtool(dir: &Path, args: &[&str]) {
    require("certtool");
    run_ok(Command::new("certtool").current_dir(dir).args(args));
}

/// A CA, a server certificate for localhost/127.0.0.1 and a client certificate, in the
/// layout nbdkit, qemu and libnbd read (ca-cert.pem, server-*.pem, client-*.pem).
pub(crate) fn make_pki(cn: &str) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    fs::write(p.join("ca.info"), format!("cn = {cn}\nca\ncert_signing_key\ncrl_signing_key\nexpiration_days = 2\n"))
        .unwrap();
    fs::write(
        p.join("server.info"),
        "organization = ferry tests\ncn = localhost\ndns_name = localhost\nip_address = 127.0.0.1\n\
         tls_www_server\nencryption_key\nsigning_key\nexpiration_days = 2\n",
    )
    .unwrap();
    fs::write(
        p.join("client.info"),
        "organization = ferry tests\ncn = client\ntls_www_client\nencryption_key\nsigning_key\nexpiration_days = 2\n",
    )
    .unwrap();
    certtool(p, &["--generate-privkey", "--outfile", "ca-key.pem"]);
    certtool(
        p,
        &[
            "--generate-self-signed",
            "--load-privkey",
            "ca-key.pem",
            "--template",
            "ca.info",
            "--outfile",
            "ca-cert.pem",
        ],
    );
    for who in ["server", "client"] {
        let (key, cert, info) = (format!("{who}-key.pem"), format!("{who}-cert.pem"), format!("{who}.info"));
        certtool(p, &["--generate-privkey", "--outfile", &key]);
        certtool(
            p,
            &[
                "--generate-certificate",
                "--load-ca-certificate",
                "ca-cert.pem",
                "--load-ca-privkey",
                "ca-key.pem",
                "--load-privkey",
                &key,
                "--template",
                &info,
                "--outfile",
                &cert,
            ],
        );
    }
    d
}

/// A directory holding `keys.psk` with a fresh key for `identity` (qemu's
/// tls-creds-psk wants a directory; nbdkit, libnbd and ferry take the file).
fn psk(identity: &str) -> tempfile::TempDir {
    require("psktool");
    let d = tempfile::tempdir().unwrap();
    run_ok(Command::new("psktool").args(["-u", identity, "-p"]).arg(d.path().join("keys.psk")));
    d
}

fn keys(d: &tempfile::TempDir) -> PathBuf {
    d.path().join("keys.psk")
}

/// ferry serve's URI with the TLS scheme and query parameters.
fn tls_uri(s: &Server, user: Option<&str>, query: &str) -> String {
    let user = user.map(|u| format!("{u}@")).unwrap_or_default();
    match &s.addr {
        Addr::Unix(p) => format!("nbds+unix://{user}/?socket={}&{query}", p.display()),
        Addr::Tcp(port) => format!("nbds://{user}127.0.0.1:{port}/?{query}"),
    }
}

fn ferry(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args);
    c
}

fn random_file(dir: &Path, len: usize, seed: u64) -> (PathBuf, Vec<u8>) {
    let data = data_with_holes(len, seed);
    let p = dir.join(format!("src-{seed}.img"));
    fs::write(&p, &data).unwrap();
    (p, data)
}

fn server_log_has(s: &Server, needle: &str) -> bool {
    wait_until(Duration::from_secs(5), || s.stderr().contains(needle))
}

#[test]
fn x509_ferry_serve_with_libnbd_qemu_and_ferry() {
    require("nbdinfo");
    require("nbdcopy");
    require("qemu-img");
    let pki = make_pki("ferry test CA");
    let dir = pki.path().to_str().unwrap();
    let s = Server::tcp("memory:8M", &["--tls=require", "--tls-certificates", dir]);
    let Addr::Tcp(port) = s.addr else { unreachable!() };
    let uri = tls_uri(&s, None, &format!("tls-certificates={dir}"));
    let out = run_ok(Command::new("nbdinfo").arg(&uri));
    assert!(out.stdout.contains("with TLS"), "nbdinfo did not see TLS:\n{}", out.describe());

    let work = tempfile::tempdir().unwrap();
    let (src, data) = random_file(work.path(), 8 << 20, 1);
    // qemu-img writes through tls-creds-x509 (it also presents client-cert.pem).
    run_ok(Command::new("qemu-img").args([
        "convert",
        "-n",
        "-f",
        "raw",
        "--object",
        &format!("tls-creds-x509,id=tls0,endpoint=client,dir={dir}"),
        "--target-image-opts",
        src.to_str().unwrap(),
        &format!("driver=nbd,host=127.0.0.1,port={port},tls-creds=tls0"),
    ]));
    // nbdcopy and ferry copy read it back.
    let back = work.path().join("back-nbdcopy.img");
    run_ok(Command::new("nbdcopy").arg(&uri).arg(&back));
    assert_file_eq(&back, &data);
    let back = work.path().join("back-ferry.img");
    run_ok(&mut ferry(&["copy", &uri, back.to_str().unwrap()]));
    assert_file_eq(&back, &data);
    let info = run_ok(&mut ferry(&["info", "--json", &uri]));
    let v: serde_json::Value = serde_json::from_str(&info.stdout).unwrap();
    assert_eq!(v["TLS"], true, "{}", info.stdout);
    // The same digest over TLS as from the file.
    let h = run_ok(&mut ferry(&["hash", src.to_str().unwrap(), &uri]));
    let digests: Vec<&str> = h.stdout.lines().map(|l| l.split_whitespace().next().unwrap()).collect();
    assert_eq!(digests[0], digests[1], "{}", h.stdout);
}

#[test]
fn psk_ferry_serve_over_unix_with_nbdcopy_qemu_and_ferry() {
    require("nbdcopy");
    require("qemu-img");
    let k = psk("alice");
    let work = tempfile::tempdir().unwrap();
    let (src, data) = random_file(work.path(), 6 << 20, 2);
    let disk = work.path().join("disk.img");
    fs::File::create(&disk).unwrap().set_len(6 << 20).unwrap();
    // A file export over a Unix socket: sendfile would apply without TLS.
    let s = Server::unix(&format!("file:{}", disk.display()), &["--tls-psk", keys(&k).to_str().unwrap()]);
    let uri = tls_uri(&s, Some("alice"), &format!("tls-psk-file={}", keys(&k).display()));
    run_ok(Command::new("nbdcopy").arg(&src).arg(&uri));
    let Addr::Unix(sock) = &s.addr else { unreachable!() };
    let back = work.path().join("back-qemu.img");
    run_ok(Command::new("qemu-img").args([
        "convert",
        "-O",
        "raw",
        "--object",
        &format!("tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice", k.path().display()),
        "--image-opts",
        &format!("driver=nbd,server.type=unix,server.path={},tls-creds=tls0", sock.display()),
        back.to_str().unwrap(),
    ]));
    assert_file_eq(&back, &data);
    let back = work.path().join("back-ferry.img");
    run_ok(&mut ferry(&["copy", "-C", "2", &uri, back.to_str().unwrap()]));
    assert_file_eq(&back, &data);
    assert_eq!(fs::read(&disk).unwrap(), data, "the server's file holds what was written");
}

/// nbdkit or qemu-nbd with TLS, on a Unix socket or TCP port.
struct Peer {
    child: Child,
    uri: String,
    _dir: tempfile::TempDir,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_peer(program: &str, args: &[String], dir: tempfile::TempDir, uri: String, ready: &dyn Fn() -> bool) -> Peer {
    require(program);
    let child = Command::new(program).args(args).stdin(Stdio::null()).spawn().expect("start peer");
    let p = Peer { child, uri, _dir: dir };
    assert!(wait_until(Duration::from_secs(10), ready), "{program} did not start: {args:?}");
    p
}

fn unix_ready(p: PathBuf) -> impl Fn() -> bool {
    move || std::os::unix::net::UnixStream::connect(&p).is_ok()
}

fn tcp_ready(port: u16) -> impl Fn() -> bool {
    move || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

#[test]
fn ferry_client_against_nbdkit_and_qemu_nbd_with_tls() {
    let pki = make_pki("peer CA");
    let pkid = pki.path().display().to_string();
    let k = psk("alice");
    let kf = keys(&k).display().to_string();
    let size = 4u64 << 20;
    let mut peers = Vec::new();
    // nbdkit, X.509 over TCP.
    {
        let d = tempfile::tempdir().unwrap();
        let port = free_port();
        let args = [
            "-f",
            "--exit-with-parent",
            "--tls=require",
            &format!("--tls-certificates={pkid}"),
            "-p",
            &port.to_string(),
            "memory",
            &size.to_string(),
        ]
        .map(String::from);
        let uri = format!("nbds://127.0.0.1:{port}/?tls-certificates={pkid}");
        peers.push(("nbdkit x509 tcp", start_peer("nbdkit", &args, d, uri, &tcp_ready(port))));
    }
    // nbdkit, PSK over Unix.
    {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("k.sock");
        let args = [
            "-f".into(),
            "--exit-with-parent".into(),
            "--tls=require".into(),
            format!("--tls-psk={kf}"),
            "-U".into(),
            sock.display().to_string(),
            "memory".into(),
            size.to_string(),
        ];
        let uri = format!("nbds+unix://alice@/?socket={}&tls-psk-file={kf}", sock.display());
        peers.push(("nbdkit psk unix", start_peer("nbdkit", &args, d, uri, &unix_ready(sock.clone()))));
    }
    // qemu-nbd, X.509 over TCP (qemu verifies the client's certificate by default).
    {
        let d = tempfile::tempdir().unwrap();
        let img = d.path().join("q.img");
        fs::File::create(&img).unwrap().set_len(size).unwrap();
        let port = free_port();
        let args = [
            "-t".into(),
            "-f".into(),
            "raw".into(),
            "--object".into(),
            format!("tls-creds-x509,id=tls0,endpoint=server,dir={pkid}"),
            "--tls-creds".into(),
            "tls0".into(),
            "-b".into(),
            "127.0.0.1".into(),
            "-p".into(),
            port.to_string(),
            img.display().to_string(),
        ];
        let uri = format!("nbds://127.0.0.1:{port}/?tls-certificates={pkid}");
        peers.push(("qemu-nbd x509 tcp", start_peer("qemu-nbd", &args, d, uri, &tcp_ready(port))));
    }
    // qemu-nbd, PSK over Unix.
    {
        let d = tempfile::tempdir().unwrap();
        let img = d.path().join("q.img");
        fs::File::create(&img).unwrap().set_len(size).unwrap();
        let sock = d.path().join("q.sock");
        let args = [
            "-t".into(),
            "-f".into(),
            "raw".into(),
            "--object".into(),
            format!("tls-creds-psk,id=tls0,endpoint=server,dir={}", k.path().display()),
            "--tls-creds".into(),
            "tls0".into(),
            "-k".into(),
            sock.display().to_string(),
            img.display().to_string(),
        ];
        let uri = format!("nbds+unix://alice@/?socket={}&tls-psk-file={kf}", sock.display());
        peers.push(("qemu-nbd psk unix", start_peer("qemu-nbd", &args, d, uri, &unix_ready(sock.clone()))));
    }
    let work = tempfile::tempdir().unwrap();
    for (i, (name, p)) in peers.iter().enumerate() {
        let (src, data) = random_file(work.path(), size as usize, 10 + i as u64);
        run_ok(&mut ferry(&["copy", src.to_str().unwrap(), &p.uri]));
        let back = work.path().join(format!("back-{i}.img"));
        run_ok(&mut ferry(&["copy", &p.uri, back.to_str().unwrap()]));
        assert_file_eq(&back, &data);
        let info = run_ok(&mut ferry(&["info", "--json", &p.uri]));
        let v: serde_json::Value = serde_json::from_str(&info.stdout).unwrap();
        assert_eq!(v["TLS"], true, "{name}: {}", info.stdout);
        let plain = p.uri.replacen("nbds", "nbd", 1);
        let plain = plain.split_once('?').map_or(plain.clone(), |(a, q)| {
            let socket: Vec<&str> = q.split('&').filter(|kv| kv.starts_with("socket=")).collect();
            if socket.is_empty() {
                a.to_string()
            } else {
                format!("{a}?{}", socket.join("&"))
            }
        });
        let plain = plain.replace("alice@", "");
        let out = run_fails(&mut ferry(&["info", &plain]));
        assert!(out.stderr.contains("requires TLS"), "{name}: plaintext against TLS-only:\n{}", out.describe());
    }
}

#[test]
fn tls_refusals_are_clear_and_harm_nobody_else() {
    let pki = make_pki("right CA");
    let other = make_pki("wrong CA");
    let k = psk("alice");
    let wrong = psk("alice");
    let dir = pki.path().to_str().unwrap();
    let s = Server::tcp(
        "memory:1M",
        &[
            "--tls=require",
            "--tls-certificates",
            dir,
            "--tls-psk",
            keys(&k).to_str().unwrap(),
            "--handshake-timeout",
            "2",
        ],
    );
    let good = tls_uri(&s, None, &format!("tls-certificates={dir}"));
    let ok = || {
        let out = run_ok(&mut ferry(&["info", "--size", &good]));
        assert_eq!(out.stdout.trim(), "1048576");
    };

    // A certificate from a CA the client does not trust.
    let out =
        run_fails(&mut ferry(&["info", &tls_uri(&s, None, &format!("tls-certificates={}", other.path().display()))]));
    assert!(out.stderr.contains("certificate verification failed"), "{}", out.describe());
    assert!(server_log_has(&s, "unknown ca"), "server log: {}", s.stderr());
    ok();
    // The right identity with the wrong key.
    let out = run_fails(&mut ferry(&[
        "info",
        &tls_uri(&s, Some("alice"), &format!("tls-psk-file={}", keys(&wrong).display())),
    ]));
    assert!(out.stderr.contains("TLS handshake failed"), "{}", out.describe());
    ok();
    // An identity the server does not know (libnbd's client, so the server decides).
    let mallory = psk("mallory");
    let out = run_fails(Command::new("nbdinfo").arg(tls_uri(
        &s,
        Some("mallory"),
        &format!("tls-psk-file={}", keys(&mallory).display()),
    )));
    assert!(!out.status.success());
    assert!(server_log_has(&s, "unknown PSK identity \"mallory\""), "server log: {}", s.stderr());
    ok();
    // An identity missing from the client's own file.
    let out =
        run_fails(&mut ferry(&["info", &tls_uri(&s, Some("bob"), &format!("tls-psk-file={}", keys(&k).display()))]));
    assert!(out.stderr.contains("no key for identity \"bob\""), "{}", out.describe());
    // Plaintext against require: nothing is answered, not even the list.
    let out = run_fails(&mut ferry(&["info", "--list", &s.uri()]));
    assert!(out.stderr.contains("requires TLS"), "{}", out.describe());
    let out = run_fails(Command::new("nbdinfo").arg("--list").arg(s.uri()));
    assert!(!out.stdout.contains("export="), "the export list leaked: {}", out.describe());
    ok();
    // A client that stops half way through the TLS handshake is dropped by the
    // handshake timeout; a client that sends plaintext right after STARTTLS (the
    // injection of CVE-2021-3716's kind) is dropped at once.
    let mut half = RawClient::connect(&s);
    half.read_greeting();
    half.send_client_flags(3);
    half.send_option(OPT_STARTTLS, b"");
    assert_eq!(half.read_opt_reply().typ, REP_ACK);
    half.send(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]); // the start of a ClientHello, then silence
    ok();
    assert!(half.closed_within(Duration::from_secs(6)), "half-finished TLS handshake was not dropped");
    assert!(server_log_has(&s, "did not finish the TLS handshake in time"), "server log: {}", s.stderr());
    let mut inject = RawClient::connect(&s);
    inject.read_greeting();
    inject.send_client_flags(3);
    let mut b = RawClient::option_bytes(OPT_STARTTLS, b"");
    b.extend(RawClient::option_bytes(3, b"")); // NBD_OPT_LIST, in plaintext, before TLS
    inject.send(&b);
    assert!(inject.closed_within(Duration::from_secs(5)), "injected bytes after STARTTLS were accepted");
    assert!(server_log_has(&s, "after NBD_OPT_STARTTLS"), "server log: {}", s.stderr());
    let mut garbage = RawClient::connect(&s);
    garbage.read_greeting();
    garbage.send_client_flags(3);
    garbage.send_option(OPT_STARTTLS, b"");
    assert_eq!(garbage.read_opt_reply().typ, REP_ACK);
    garbage.send(b"this is not a TLS ClientHello at all\r\n");
    assert!(garbage.closed_within(Duration::from_secs(5)), "garbage after STARTTLS was not refused");
    ok();

    // A TLS client against a server without TLS.
    let plain = Server::tcp("memory:1M", &[]);
    let out = run_fails(&mut ferry(&["info", &tls_uri(&plain, None, &format!("tls-certificates={dir}"))]));
    assert!(out.stderr.contains("refused NBD_OPT_STARTTLS"), "{}", out.describe());
}

/// Writes `ca-crl.pem` into `dir`, revoking `who`'s certificate (server or client).
fn revoke(dir: &Path, who: &str) {
    fs::write(dir.join("crl.info"), "crl_next_update = 2\ncrl_number = 1\n").unwrap();
    let cert = format!("{who}-cert.pem");
    certtool(
        dir,
        &[
            "--generate-crl",
            "--load-ca-privkey",
            "ca-key.pem",
            "--load-ca-certificate",
            "ca-cert.pem",
            "--load-certificate",
            &cert,
            "--template",
            "crl.info",
            "--outfile",
            "ca-crl.pem",
        ],
    );
}

#[test]
fn revoked_certificates_are_refused_on_both_sides() {
    // The client reads ca-crl.pem from its tls-certificates directory: a revoked server
    // certificate is refused, the same certificate without the CRL is accepted.
    let pki = make_pki("CRL CA");
    let dir = pki.path().to_str().unwrap();
    let s = Server::tcp("memory:1M", &["--tls=require", "--tls-certificates", dir]);
    let uri = tls_uri(&s, None, &format!("tls-certificates={dir}"));
    run_ok(&mut ferry(&["info", "--size", &uri]));
    revoke(pki.path(), "server");
    let out = run_fails(&mut ferry(&["info", &uri]));
    assert!(out.stderr.contains("certificate revoked"), "{}", out.describe());
    fs::remove_file(pki.path().join("ca-crl.pem")).unwrap();

    // The server reads it with --tls-verify-peer: a revoked client certificate is refused.
    revoke(pki.path(), "client");
    let s = Server::tcp("memory:1M", &["--tls=require", "--tls-certificates", dir, "--tls-verify-peer"]);
    let client = tempfile::tempdir().unwrap();
    for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
        fs::copy(pki.path().join(f), client.path().join(f)).unwrap();
    }
    let out =
        run_fails(&mut ferry(&["info", &tls_uri(&s, None, &format!("tls-certificates={}", client.path().display()))]));
    assert!(out.stderr.contains("TLS"), "{}", out.describe());
    assert!(server_log_has(&s, "certificate revoked"), "server log: {}", s.stderr());
}

#[test]
fn tls_on_serves_both_and_verify_peer_wants_a_client_certificate() {
    let pki = make_pki("ferry CA");
    let dir = pki.path().to_str().unwrap();
    let s = Server::unix("memory:1M", &["--tls=on", "--tls-certificates", dir]);
    run_ok(&mut ferry(&["info", &s.uri()]));
    // Over a Unix socket there is no host name to check: tls-hostname gives one.
    run_ok(&mut ferry(&["info", &tls_uri(&s, None, &format!("tls-certificates={dir}&tls-hostname=localhost"))]));
    let out =
        run_fails(&mut ferry(&["info", &tls_uri(&s, None, &format!("tls-certificates={dir}&tls-hostname=evil"))]));
    assert!(out.stderr.contains("certificate verification failed"), "{}", out.describe());

    let s = Server::tcp("memory:1M", &["--tls=require", "--tls-certificates", dir, "--tls-verify-peer"]);
    run_ok(&mut ferry(&["info", &tls_uri(&s, None, &format!("tls-certificates={dir}"))]));
    let ca_only = tempfile::tempdir().unwrap();
    fs::copy(pki.path().join("ca-cert.pem"), ca_only.path().join("ca-cert.pem")).unwrap();
    let out =
        run_fails(&mut ferry(&["info", &tls_uri(&s, None, &format!("tls-certificates={}", ca_only.path().display()))]));
    assert!(out.stderr.contains("TLS"), "{}", out.describe());
    assert!(server_log_has(&s, "certificate"), "server log: {}", s.stderr());

    // Start-up errors name the missing piece.
    let out = run_fails(&mut ferry(&["serve", "--tls=require", "memory:1M"]));
    assert!(out.stderr.contains("--tls-certificates DIR or --tls-psk FILE"), "{}", out.describe());
    let k = psk("alice");
    let out = run_fails(&mut ferry(&["serve", "--zerocopy=on", "--tls-psk", keys(&k).to_str().unwrap(), "memory:1M"]));
    assert!(out.stderr.contains("--zerocopy=on cannot work with TLS"), "{}", out.describe());
    let empty = tempfile::tempdir().unwrap();
    let out = run_fails(&mut ferry(&["serve", "--tls-certificates", empty.path().to_str().unwrap(), "memory:1M"]));
    assert!(out.stderr.contains("server-cert.pem"), "{}", out.describe());
}
