//! ferry-http against a real nginx (Debian package `nginx`), plus a small faulty proxy in
//! front of it and a hostile raw server.
//!
//! One nginx serves every test of this binary: started lazily (a `OnceLock`) by
//! ferry-testsupport's harness, with its own configuration, certificates and logs in a
//! temporary directory, on two free loopback ports (HTTP and HTTPS), and stopped when the
//! test process ends in any way.

use ferry_backend::Backend;
use ferry_http::{HttpBackend, HttpOptions};
use ferry_testsupport::http::{proxy, read_head, Verdict as Fault};
use ferry_testsupport::nginx::{Nginx, NginxConf, NginxSetup};
use ferry_testsupport::{installed, run};
use std::io::{BufReader, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const IMG_LEN: usize = 5 * 1024 * 1024 + 12345;
const SMALL_LEN: usize = 1000;

/// The nginx of this binary and the image it serves as `img`.
struct Served {
    nginx: Nginx,
    img: Vec<u8>,
}

impl std::ops::Deref for Served {
    type Target = Nginx;
    fn deref(&self) -> &Nginx {
        &self.nginx
    }
}

/// Bytes nobody would mistake for another offset's: a 64-bit mix of the position.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8);
    let mut i = 0u64;
    while v.len() < len {
        let mut x = (i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 29;
        v.extend_from_slice(&x.to_le_bytes());
        i += 1;
    }
    v.truncate(len);
    v
}

fn nginx() -> &'static Served {
    static NGINX: OnceLock<Served> = OnceLock::new();
    NGINX.get_or_init(start_nginx)
}

fn start_nginx() -> Served {
    let setup = NginxSetup::new("ferry-http-nginx");
    let (dir, data) = (setup.dir().display().to_string(), setup.data());
    let img = pattern(IMG_LEN, 1);
    std::fs::write(data.join("img"), &img).unwrap();
    std::fs::write(data.join("small"), pattern(SMALL_LEN, 2)).unwrap();
    std::fs::write(data.join("empty"), b"").unwrap();
    setup.htpasswd("ferry", "s3cr:t p");
    let http = format!(
        "log_format conn '$connection $status $request';\n\
         access_log {dir}/logs/access.log conn;"
    );
    let server = format!(
        "location /noranges/ {{ alias {dir}/data/; max_ranges 0; }}\n\
         location /reuse/ {{ alias {dir}/data/; access_log {dir}/logs/reuse.log conn; }}\n\
         location = /moved/img {{ return 302 /img; }}\n\
         location = /loop {{ return 302 /loop; }}\n\
         location /forbidden/ {{ deny all; }}\n\
         location /auth/ {{ alias {dir}/data/; auth_basic \"ferry\"; auth_basic_user_file {dir}/htpasswd; }}"
    );
    let nginx = setup.start(&NginxConf { ca_name: "ferry-http test CA", http: &http, server: &server });
    Served { nginx, img }
}

fn opts() -> HttpOptions {
    HttpOptions { retry_delay: Duration::from_millis(1), ..HttpOptions::default() }
}

/// Offsets and lengths spread over `len`, from a fixed seed.
fn ranges(len: u64, count: usize, seed: u64) -> Vec<(u64, usize)> {
    let mut x = seed | 1;
    (0..count)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let l = (x % 300_000) as usize + 1;
            let o = (x >> 20) % (len - l as u64);
            (o, l)
        })
        .collect()
}

fn check_random_reads(b: &HttpBackend, want: &[u8], count: usize, seed: u64) {
    check_random_reads_of(b, want, count, seed)
}

/// Reads all of `b` in `chunk`-byte requests from `threads` threads taking the next chunk
/// in turn, as the copy engine's workers do.
fn read_all(b: &HttpBackend, threads: usize, chunk: usize) -> std::result::Result<Vec<u8>, String> {
    let size = b.size() as usize;
    let next = AtomicU64::new(0);
    let out = Mutex::new(vec![0u8; size]);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> std::result::Result<(), String> {
                    let mut buf = vec![0u8; chunk];
                    loop {
                        let o = next.fetch_add(chunk as u64, Ordering::SeqCst) as usize;
                        if o >= size {
                            return Ok(());
                        }
                        let l = chunk.min(size - o);
                        b.read(&mut buf[..l], o as u64).map_err(|e| e.to_string())?;
                        out.lock().unwrap()[o..o + l].copy_from_slice(&buf[..l]);
                    }
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| h.join().unwrap())
    })?;
    Ok(out.into_inner().unwrap())
}

#[test]
fn sizes_and_content() {
    let n = nginx();
    let b = HttpBackend::open(&n.url("img"), &opts()).unwrap();
    assert_eq!(b.size(), IMG_LEN as u64);
    assert!(!b.is_stream());
    assert!(b.caps().read_only);
    assert_eq!(b.describe(), n.url("img"));
    check_random_reads(&b, &n.img, 200, 7);
    // The last byte, the first byte, and the head's edge.
    for (o, l) in [(IMG_LEN as u64 - 1, 1), (0, 1), (65535, 2), (0, IMG_LEN)] {
        let mut buf = vec![0; l];
        b.read(&mut buf, o).unwrap();
        assert!(buf == n.img[o as usize..o as usize + l]);
    }
    // Beyond the end: refused without asking the server.
    assert!(b.read(&mut [0; 2], IMG_LEN as u64 - 1).is_err());

    let small = HttpBackend::open(&n.url("small"), &opts()).unwrap();
    assert_eq!(small.size(), SMALL_LEN as u64);
    let mut buf = vec![0; SMALL_LEN];
    small.read(&mut buf, 0).unwrap();
    assert_eq!(buf, pattern(SMALL_LEN, 2));
    assert_eq!(small.requests(), 1, "a small object is read whole by the first GET");

    let empty = HttpBackend::open(&n.url("empty"), &opts()).unwrap();
    assert_eq!(empty.size(), 0);
}

#[test]
fn concurrent_reads_from_8_threads() {
    let n = nginx();
    let b = HttpBackend::open(&n.url("img"), &opts()).unwrap();
    std::thread::scope(|s| {
        for t in 0..8 {
            let b = &b;
            s.spawn(move || check_random_reads(b, &n.img, 60, 100 + t));
        }
    });
    assert_eq!(read_all(&b, 8, 1 << 20).unwrap(), n.img);
    assert_eq!(b.retries_done(), 0);
}

#[test]
fn connections_are_kept_alive() {
    let n = nginx();
    let b = HttpBackend::open(&n.url("reuse/img"), &opts()).unwrap();
    check_random_reads(&b, &n.img, 100, 3);
    assert_eq!(read_all(&b, 4, 256 << 10).unwrap(), n.img);
    let log = std::fs::read_to_string(n.dir.join("logs/reuse.log")).unwrap();
    let conns: std::collections::BTreeSet<&str> = log.lines().filter_map(|l| l.split(' ').next()).collect();
    let lines = log.lines().count();
    assert!(lines as u64 >= b.requests() && lines > 100, "{lines} requests logged");
    assert!(conns.len() <= 6, "{} connections for {lines} requests: connections are not reused", conns.len());
}

#[test]
fn https_with_the_ca_option() {
    let n = nginx();
    let o = HttpOptions { ca: Some(n.ca()), ..opts() };
    let b = HttpBackend::open(&n.https_url("img"), &o).unwrap();
    assert_eq!(b.size(), IMG_LEN as u64);
    check_random_reads(&b, &n.img, 30, 11);
    assert_eq!(read_all(&b, 4, 1 << 20).unwrap(), n.img);
}

/// Runs `env_child` in a child process with `env` set (SSL_CERT_FILE and the proxy
/// variables are read for the whole process) and asserts that it passed.
fn in_child(mode: &str, url: &str, env: &[(&str, String)]) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "env_child", "--ignored", "--nocapture", "--test-threads=1"]);
    for v in ["SSL_CERT_FILE", "SSL_CERT_DIR", "http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"] {
        cmd.env_remove(v);
    }
    for v in ["all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"] {
        cmd.env_remove(v);
    }
    cmd.env("FERRY_HTTP_CHILD_MODE", mode).env("FERRY_HTTP_CHILD_URL", url);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "child {mode} failed:\n{text}");
}

/// Run by the tests that need a process-wide environment, in a child process.
#[test]
#[ignore = "run in a child process by in_child()"]
fn env_child() {
    let mode = std::env::var("FERRY_HTTP_CHILD_MODE").expect("run by in_child()");
    let url = std::env::var("FERRY_HTTP_CHILD_URL").unwrap();
    let opened = HttpBackend::open(&url, &HttpOptions { retries: 0, ..opts() });
    match mode.as_str() {
        "works" => {
            let b = opened.unwrap();
            assert_eq!(b.size(), IMG_LEN as u64);
            let mut buf = vec![0; 100_000];
            b.read(&mut buf, 1_000_000).unwrap();
            assert!(buf == pattern(IMG_LEN, 1)[1_000_000..1_100_000]);
        }
        "fails" => {
            let e = opened.err().expect("opening should fail").to_string();
            assert!(e.contains(&url), "{e}");
        }
        m => panic!("unknown mode {m}"),
    }
}

#[test]
fn https_with_ssl_cert_file() {
    let n = nginx();
    in_child("works", &n.https_url("img"), &[("SSL_CERT_FILE", n.ca().display().to_string())]);
}

#[test]
fn proxies_from_the_environment() {
    let n = nginx();
    // The faulty proxy with no fault forwards absolute-form requests to nginx, which
    // serves them: it is an HTTP proxy for any URL. Port 9 (discard) has no server here.
    let (port, count) = faulty_proxy(n.http, Fault::Status503, u64::MAX);
    let proxy = format!("http://127.0.0.1:{port}");
    let url = "http://127.0.0.1:9/img";
    in_child("works", url, &[("http_proxy", proxy.clone())]);
    assert!(count.load(Ordering::SeqCst) >= 2, "the requests went through the proxy");
    in_child("works", url, &[("HTTP_PROXY", proxy.clone())]);
    in_child("works", url, &[("all_proxy", proxy.clone())]);
    let before = count.load(Ordering::SeqCst);
    in_child("fails", url, &[("http_proxy", proxy.clone()), ("no_proxy", "localhost, 127.0.0.1".into())]);
    in_child("fails", url, &[("https_proxy", proxy.clone())]);
    assert_eq!(count.load(Ordering::SeqCst), before, "no_proxy and https_proxy bypass the proxy for this URL");
}

/// Where every GET goes through a fresh "signature" in the query, as presigned S3 URLs do.
struct Signed {
    base: String,
    signed: AtomicU64,
}

impl ferry_http::Locator for Signed {
    fn get(
        &self,
        range: Option<std::ops::Range<u64>>,
    ) -> Result<(String, Vec<(String, String)>), ferry_http::HttpError> {
        let n = self.signed.fetch_add(1, Ordering::SeqCst);
        let hdr = match range {
            Some(r) => vec![("Range".to_string(), format!("bytes={}-{}", r.start, r.end - 1))],
            None => Vec::new(),
        };
        Ok((format!("{}?X-Signature=secret{n}", self.base), hdr))
    }
    fn describe(&self) -> String {
        format!("s3://bucket/{}", self.base.rsplit('/').next().unwrap_or(""))
    }
}

#[test]
fn a_locator_signs_each_get() {
    let n = nginx();
    let loc = Arc::new(Signed { base: n.url("img"), signed: AtomicU64::new(0) });
    let b = HttpBackend::open_located(loc.clone(), &opts()).unwrap();
    assert_eq!(b.describe(), "s3://bucket/img");
    check_random_reads(&b, &n.img, 20, 21);
    assert_eq!(loc.signed.load(Ordering::SeqCst), b.requests());
    let loc = Arc::new(Signed { base: n.url("nothing"), signed: AtomicU64::new(0) });
    let e = HttpBackend::open_located(loc, &opts()).err().unwrap().to_string();
    assert_eq!(e, "HTTP 404 Not Found for s3://bucket/nothing: the object does not exist");
}

#[test]
fn untrusted_certificate_is_a_clear_error() {
    let n = nginx();
    let url = n.https_url("img");
    let t = Instant::now();
    let e = HttpBackend::open(&url, &HttpOptions { retry_delay: Duration::from_secs(5), ..opts() }).err().unwrap();
    let m = e.to_string();
    assert!(m.contains(&url) && m.contains("--ca") && m.contains("certificate"), "{m}");
    assert!(t.elapsed() < Duration::from_secs(4), "a TLS failure must not be retried");
}

#[test]
fn insecure_skips_verification() {
    let n = nginx();
    let b = HttpBackend::open(&n.https_url("img"), &HttpOptions { insecure: true, ..opts() }).unwrap();
    assert_eq!(b.size(), IMG_LEN as u64);
    check_random_reads(&b, &n.img, 10, 5);
}

#[test]
fn not_found_is_a_clear_error_and_not_retried() {
    let n = nginx();
    let url = n.url("missing.img");
    let t = Instant::now();
    let e = HttpBackend::open(&url, &HttpOptions { retry_delay: Duration::from_secs(5), ..opts() }).err().unwrap();
    assert_eq!(e.status(), Some(404));
    assert_eq!(e.to_string(), format!("HTTP 404 Not Found for {url}: the object does not exist"));
    assert!(t.elapsed() < Duration::from_secs(4), "a 404 must not be retried");

    let url = n.url("forbidden/img");
    let e = HttpBackend::open(&url, &HttpOptions { retry_delay: Duration::from_secs(5), ..opts() }).err().unwrap();
    assert_eq!(
        e.to_string(),
        format!("HTTP 403 Forbidden for {url}: access denied: check the credentials or the presigned URL's expiry")
    );
}

#[test]
fn redirects_are_followed() {
    let n = nginx();
    let b = HttpBackend::open(&n.url("moved/img"), &opts()).unwrap();
    assert_eq!(b.size(), IMG_LEN as u64);
    check_random_reads(&b, &n.img, 10, 9);
    let log = std::fs::read_to_string(n.dir.join("logs/access.log")).unwrap();
    assert_eq!(log.lines().filter(|l| l.contains(" 302 GET /moved/img ")).count(), 1, "{log}");
    let e = HttpBackend::open(&n.url("loop"), &opts()).err().unwrap().to_string();
    assert!(e.contains("redirects") && e.contains(&n.url("loop")), "{e}");
}

#[test]
fn identity_is_the_redacted_url_size_and_etag_and_a_replaced_file_is_refused() {
    let n = nginx();
    std::fs::write(n.dir.join("data/replaced"), &n.img).unwrap();
    let url = format!("http://ferry:s3cr%3At%20p@127.0.0.1:{}/auth/replaced?sig=1", n.http);
    let b = HttpBackend::open(&url, &opts()).unwrap();
    let id = b.identity().unwrap();
    let prefix = format!("{} size={IMG_LEN} etag=\"", n.url("auth/replaced"));
    assert!(id.starts_with(&prefix) && id.ends_with('"'), "{id}");
    assert!(!id.contains("s3cr") && !id.contains("sig"), "{id}");
    check_random_reads(&b, &n.img, 5, 3);
    // Same size, other bytes and so another ETag (nginx's is mtime and size): nginx
    // answers If-Match with 412.
    let mut other = n.img.clone();
    other[IMG_LEN - 1] ^= 0xff;
    std::thread::sleep(Duration::from_millis(1100));
    std::fs::write(n.dir.join("data/replaced"), &other).unwrap();
    let mut buf = vec![0; 100_000];
    let e = b.read(&mut buf, 100_000).unwrap_err().to_string();
    assert!(e.contains("changed while it was read") && e.contains(&n.url("auth/replaced")), "{e}");
    assert_eq!(b.retries_done(), 0, "a change is not retried");
    std::fs::remove_file(n.dir.join("data/replaced")).unwrap();
}

/// A server that answers its `i`-th request (from 0) with a 302 to `targets[i]` (the last
/// one for every later request); returns its port and how many it answered.
fn redirector(targets: Vec<String>) -> (u16, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let count = Arc::new(AtomicU64::new(0));
    let c = count.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let Ok(Some(_)) = read_head(&mut BufReader::new(conn.try_clone().unwrap())) else { continue };
            let i = c.fetch_add(1, Ordering::SeqCst) as usize;
            let to = &targets[i.min(targets.len() - 1)];
            let _ =
                write!(conn, "HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    (port, count)
}

#[test]
fn a_redirect_is_remembered_until_its_target_fails() {
    let n = nginx();
    for f in ["copy1", "copy2"] {
        std::fs::hard_link(n.dir.join("data/img"), n.dir.join("data").join(f)).unwrap();
    }
    let (port, asked) = redirector(vec![n.url("copy1"), n.url("copy2")]);
    let b = HttpBackend::open(&format!("http://127.0.0.1:{port}/img"), &opts()).unwrap();
    check_random_reads(&b, &n.img, 10, 23);
    assert_eq!(asked.load(Ordering::SeqCst), 1, "later GETs go straight to the redirect's target");
    std::fs::remove_file(n.dir.join("data/copy1")).unwrap();
    check_random_reads(&b, &n.img, 10, 29);
    assert_eq!(asked.load(Ordering::SeqCst), 2, "the URL is asked again once its target fails");
    assert_eq!(b.retries_done(), 0);
    std::fs::remove_file(n.dir.join("data/copy2")).unwrap();
}

#[test]
fn basic_auth_from_the_url() {
    let n = nginx();
    let with = format!("http://ferry:s3cr%3At%20p@127.0.0.1:{}/auth/img", n.http);
    let b = HttpBackend::open(&with, &opts()).unwrap();
    assert_eq!(b.size(), IMG_LEN as u64);
    assert_eq!(b.describe(), n.url("auth/img"), "no credentials in the name");
    check_random_reads(&b, &n.img, 10, 13);

    let without = n.url("auth/img");
    let e = HttpBackend::open(&without, &opts()).err().unwrap();
    assert_eq!(e.status(), Some(401));
    assert!(e.to_string().contains(&without) && e.to_string().contains("credentials"), "{e}");

    let wrong = format!("http://ferry:wrong@127.0.0.1:{}/auth/img", n.http);
    let e = HttpBackend::open(&wrong, &opts()).err().unwrap().to_string();
    assert!(e.contains("401") && !e.contains("wrong"), "{e}");

    // An Authorization header from the options works too.
    let hdr = HttpOptions { headers: vec![("Authorization".into(), "Basic ZmVycnk6czNjcjp0IHA=".into())], ..opts() };
    assert_eq!(HttpBackend::open(&without, &hdr).unwrap().size(), IMG_LEN as u64);
}

#[test]
fn a_server_without_ranges_is_read_as_a_stream() {
    let n = nginx();
    let b = HttpBackend::open(&n.url("noranges/img"), &opts()).unwrap();
    assert!(b.is_stream());
    assert_eq!(b.size(), IMG_LEN as u64);
    // Four workers, 1 MiB each, slightly out of order.
    assert_eq!(read_all(&b, 4, 1 << 20).unwrap(), n.img);
    assert_eq!(b.stream_restarts(), 0, "ascending reads by a few workers need no second GET");
    // A read behind the stream starts it again and is still right.
    let mut buf = vec![0; 300_000];
    b.read(&mut buf, 100_000).unwrap();
    assert!(buf == n.img[100_000..400_000]);
    b.read(&mut buf, 2_000_000).unwrap();
    assert!(buf == n.img[2_000_000..2_300_000]);
    b.read(&mut buf, 1_000_000).unwrap();
    assert!(buf == n.img[1_000_000..1_300_000]);
    assert!(b.stream_restarts() >= 1);
    check_random_reads(&b, &n.img, 20, 17);
}

#[test]
fn a_qcow2_image_over_http() {
    let n = nginx();
    which("qemu-img", "qemu-utils");
    let raw = n.dir.join("data/q.raw");
    // Data with holes: every other MiB stays zero, so the image has unallocated clusters.
    let mut want = pattern(6 << 20, 31);
    for chunk in want.chunks_mut(2 << 20) {
        chunk[1 << 20..].fill(0);
    }
    std::fs::write(&raw, &want).unwrap();
    let qcow2 = n.dir.join("data/q.qcow2");
    run(Command::new("qemu-img").args(["convert", "-f", "raw", "-O", "qcow2"]).arg(&raw).arg(&qcow2));
    let http = Arc::new(HttpBackend::open(&n.url("q.qcow2"), &opts()).unwrap());
    let img = ferry_qcow2::Qcow2::open_on(http.clone()).unwrap();
    assert_eq!(img.size(), want.len() as u64);
    let mut got = vec![0; want.len()];
    for (i, chunk) in got.chunks_mut(1 << 20).enumerate() {
        img.read(chunk, (i as u64) << 20).unwrap();
    }
    assert!(got == want, "the qcow2 image read over HTTP differs from its raw source");
    check_random_reads_of(&img, &want, 20, 37);
}

fn which(program: &str, package: &str) {
    assert!(installed(program), "{program} is not installed: apt-get install {package} (scripts/test installs it)");
}

fn check_random_reads_of(b: &dyn Backend, want: &[u8], count: usize, seed: u64) {
    for (o, l) in ranges(want.len() as u64, count, seed) {
        let mut buf = vec![0; l];
        b.read(&mut buf, o).unwrap_or_else(|e| panic!("read of {l} at {o}: {e}"));
        assert!(buf == want[o as usize..o as usize + l], "bytes differ at {o}+{l}");
    }
}

/// A proxy in front of nginx that spoils every `every`-th request (counting from 1) with
/// `fault` (`Fault::SizeChange` says the object is one byte longer than it is). Returns
/// its port and the request counter.
fn faulty_proxy(upstream: u16, fault: Fault, every: u64) -> (u16, Arc<AtomicU64>) {
    faulty_proxy_limited(upstream, fault, every, u64::MAX)
}

/// [`faulty_proxy`] that spoils at most `max_faults` requests.
fn faulty_proxy_limited(upstream: u16, fault: Fault, every: u64, max_faults: u64) -> (u16, Arc<AtomicU64>) {
    let faults = AtomicU64::new(max_faults);
    let count = Arc::new(AtomicU64::new(0));
    let c = count.clone();
    let port = proxy(upstream, move |_| {
        let n = c.fetch_add(1, Ordering::SeqCst) + 1;
        let bad = n.is_multiple_of(every)
            && faults.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |f| f.checked_sub(1)).is_ok();
        if bad {
            fault
        } else {
            Fault::Forward
        }
    });
    (port, count)
}

#[test]
fn transient_failures_are_retried() {
    let n = nginx();
    for fault in [Fault::Status503, Fault::Status416, Fault::Drop, Fault::ShortBody] {
        let (port, count) = faulty_proxy(n.http, fault, 3);
        let url = format!("http://127.0.0.1:{port}/img");
        let b = HttpBackend::open(&url, &opts()).unwrap_or_else(|e| panic!("{fault:?}: {e}"));
        assert_eq!(b.size(), IMG_LEN as u64);
        assert_eq!(read_all(&b, 4, 256 << 10).unwrap_or_else(|e| panic!("{fault:?}: {e}")), n.img, "{fault:?}");
        let sent = count.load(Ordering::SeqCst);
        assert!(
            b.retries_done() >= sent / 3 - 1 && b.retries_done() > 5,
            "{fault:?}: {} retries for {sent} requests",
            b.retries_done()
        );

        // Without retries the same fault is an error naming the URL and the range.
        let b = HttpBackend::open(&url, &HttpOptions { retries: 0, ..opts() });
        let e = match b {
            Err(e) => e.to_string(),
            Ok(b) => read_all(&b, 1, 256 << 10).err().unwrap_or_default(),
        };
        assert!(e.contains(&url) && e.contains("failed"), "{fault:?}: {e}");
    }
    // In stream mode a failure in the middle of the body reads the object again.
    for fault in [Fault::ShortBody, Fault::Drop, Fault::Status503] {
        let (port, _) = faulty_proxy_limited(n.http, fault, 1, 1);
        let url = format!("http://127.0.0.1:{port}/noranges/img");
        let b = HttpBackend::open(&url, &opts()).unwrap_or_else(|e| panic!("{fault:?}: {e}"));
        assert!(b.is_stream());
        assert_eq!(read_all(&b, 2, 1 << 20).unwrap_or_else(|e| panic!("{fault:?}: {e}")), n.img, "{fault:?}");
        assert!(b.retries_done() >= 1, "{fault:?}");
        if let Fault::ShortBody = fault {
            assert!(b.stream_restarts() >= 1, "the first body was cut in the middle");
        }
    }
}

#[test]
fn a_size_change_is_an_error_without_retries() {
    let n = nginx();
    let (port, count) = faulty_proxy(n.http, Fault::SizeChange, 2);
    let url = format!("http://127.0.0.1:{port}/img");
    let b = HttpBackend::open(&url, &opts()).unwrap();
    let mut buf = vec![0; 1 << 20];
    let e = b.read(&mut buf, 1 << 20).err().unwrap().to_string();
    assert!(e.contains("size changed") && e.contains(&url), "{e}");
    assert_eq!(b.retries_done(), 0);
    assert_eq!(count.load(Ordering::SeqCst), 2);
}

/// A server that answers each connection with `reply` and closes.
fn raw_server(reply: Vec<u8>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in listener.incoming() {
            let Ok(mut c) = c else { return };
            let reply = reply.clone();
            std::thread::spawn(move || {
                let _ = read_head(&mut BufReader::new(c.try_clone().unwrap()));
                let _ = c.write_all(&reply);
            });
        }
    });
    port
}

#[test]
fn hostile_servers_give_errors_not_panics() {
    let huge = b"HTTP/1.1 200 OK\r\nContent-Length: 18446744073709551615\r\n\r\nabc".to_vec();
    let mut endless = b"HTTP/1.1 206 Partial Content\r\n".to_vec();
    for i in 0..20_000 {
        endless.extend_from_slice(format!("X-Filler-{i}: aaaaaaaaaaaaaaaaaaaa\r\n").as_bytes());
    }
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (huge, "after 3 of 65536 bytes"),
        (endless, "header"),
        (
            b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-65535/99999999999999999999999\r\nContent-Length: 3\r\n\r\nabc"
                .to_vec(),
            "Content-Range",
        ),
        (
            b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-65535/100000\r\nContent-Length: 3\r\n\r\nabc".to_vec(),
            "announced 3",
        ),
        (b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-1/*\r\n\r\nab".to_vec(), "size"),
        (b"HTTP/1.1 200 OK\r\n\r\nabc".to_vec(), "Content-Length"),
        (b"garbage\r\n\r\n".to_vec(), "failed"),
    ];
    // A server that accepts and then says nothing: the timeout ends each attempt.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming().take(4) {
            held.push(c);
        }
        std::thread::sleep(Duration::from_secs(30));
    });
    let t = Instant::now();
    let o = HttpOptions { retries: 1, timeout: Some(Duration::from_millis(300)), ..opts() };
    let e = HttpBackend::open(&format!("http://127.0.0.1:{port}/x"), &o).err().unwrap().to_string();
    assert!(e.contains("timed out") && e.contains("after 1 retries"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());

    for (reply, want) in cases {
        let port = raw_server(reply);
        let url = format!("http://127.0.0.1:{port}/x?secret=1");
        let e = HttpBackend::open(&url, &HttpOptions { retries: 1, ..opts() }).err().unwrap().to_string();
        assert!(e.contains(want) && e.contains(&format!("127.0.0.1:{port}/x")), "want {want:?}: {e}");
        assert!(!e.contains("secret"), "{e}");
    }
}

/// Reads all of `b` in 1 MiB requests from `threads` threads (the copy engine's pattern,
/// into a reused buffer and no further); the seconds it took.
fn timed_read(b: &HttpBackend, threads: usize) -> f64 {
    let t = Instant::now();
    let next = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    let o = next.fetch_add(1 << 20, Ordering::SeqCst);
                    if o >= b.size() {
                        return;
                    }
                    let l = (1u64 << 20).min(b.size() - o) as usize;
                    b.read(&mut buf[..l], o).unwrap();
                }
            });
        }
    });
    t.elapsed().as_secs_f64()
}

/// Throughput against `curl -o /dev/null` (and nbdkit-curl + nbdcopy when present), over
/// HTTP and HTTPS:
/// `FERRY_HTTP_BENCH_MIB=4096 cargo test --release -p ferry-http --test nginx -- --ignored --exact bench --nocapture`
#[test]
#[ignore = "a benchmark: run by hand"]
fn bench() {
    let n = nginx();
    let mib: u64 = std::env::var("FERRY_HTTP_BENCH_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(1024);
    let threads: usize = std::env::var("FERRY_HTTP_BENCH_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let path = n.dir.join("data/big");
    if std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0) != mib << 20 {
        let mut f = std::fs::File::create(&path).unwrap();
        let block = pattern(1 << 20, 9);
        for _ in 0..mib {
            f.write_all(&block).unwrap();
        }
    }
    // Warm the page cache.
    let _ = Command::new("cat").arg(&path).stdout(Stdio::null()).status();
    let mbs = |secs: f64| (mib << 20) as f64 / secs / 1e6;
    let curl = |args: &[&str]| {
        let t = Instant::now();
        let st = Command::new("curl").args(["-s", "-o", "/dev/null"]).args(args).status().unwrap();
        assert!(st.success());
        t.elapsed().as_secs_f64()
    };

    let secs = curl(&[&n.url("big")]);
    println!("HTTP  curl -o /dev/null: {secs:.2} s, {:.0} MB/s", mbs(secs));
    let b = HttpBackend::open(&n.url("big"), &opts()).unwrap();
    let secs = timed_read(&b, threads);
    println!("HTTP  ferry-http {threads} threads x 1 MiB: {secs:.2} s, {:.0} MB/s ({} GETs)", mbs(secs), b.requests());

    let ca = n.ca().display().to_string();
    let secs = curl(&["--cacert", &ca, &n.https_url("big")]);
    println!("HTTPS curl -o /dev/null: {secs:.2} s, {:.0} MB/s", mbs(secs));
    let b = HttpBackend::open(&n.https_url("big"), &HttpOptions { ca: Some(n.ca()), ..opts() }).unwrap();
    let secs = timed_read(&b, threads);
    println!("HTTPS ferry-http {threads} threads x 1 MiB: {secs:.2} s, {:.0} MB/s", mbs(secs));

    if Command::new("nbdkit").arg("--version").output().is_ok() {
        let t = Instant::now();
        let st = Command::new("nbdkit")
            .args(["-U", "-", "curl", &n.url("big"), "--run", "nbdcopy \"$uri\" null:"])
            .status()
            .unwrap();
        let secs = t.elapsed().as_secs_f64();
        println!("HTTP  nbdkit curl + nbdcopy: {secs:.2} s, {:.0} MB/s (ok: {})", mbs(secs), st.success());
    }
}
