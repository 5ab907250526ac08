//! `ferry copy/hash` against remotes that misbehave or are fooled: small HTTP servers
//! written here (a `TcpListener` thread each) that redirect across origins, trickle, or
//! replace the object mid-read, and moto_server for S3 keys that URL code would resolve.
//!
//! What must hold: credentials and user headers never reach another origin (scheme, host,
//! port), `--request-timeout` bounds a whole GET, an object replaced while it is read is
//! an error naming it ("changed while it was read"), an S3 key with a `.` or `..` segment
//! is refused, `ferry hash` names exactly the spec it read, and `-vv` prints no signature,
//! session token or password.

use crate::common::ferry_remote as ferry;
use crate::common::*;
use ferry_testsupport::http::{header, read_head};
use ferry_testsupport::moto::moto;
use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

// ---------------------------------------------------------------------------------
// A tiny HTTP/1.1 server
// ---------------------------------------------------------------------------------

/// One answer of a [`server`].
enum Reply {
    /// Sent whole, at once.
    Now(Vec<u8>),
    /// The first `n` bytes at once, then the rest one byte a second.
    Trickle(Vec<u8>, usize),
}

/// A request as a [`server`]'s handler sees it: its header block and its number (from 0,
/// over all connections).
struct Request<'a> {
    head: &'a str,
    n: u64,
}

impl Request<'_> {
    fn path(&self) -> &str {
        self.head.split_whitespace().nth(1).unwrap_or("")
    }
    fn header(&self, name: &str) -> Option<String> {
        header(self.head, name)
    }
}

/// A server on 127.0.0.1 answering each request (kept-alive connections, a thread each)
/// with what `handle` says; returns its port and every request head it got.
fn server(handle: impl Fn(&Request) -> Reply + Send + Sync + 'static) -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let (h, handle, count) = (heads.clone(), Arc::new(handle), Arc::new(AtomicU64::new(0)));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let (h, handle, count) = (h.clone(), handle.clone(), count.clone());
            std::thread::spawn(move || {
                let _ = serve_connection(conn, &h, &*handle, &count);
            });
        }
    });
    (port, heads)
}

fn serve_connection(
    mut conn: TcpStream,
    heads: &Mutex<Vec<String>>,
    handle: &dyn Fn(&Request) -> Reply,
    count: &AtomicU64,
) -> std::io::Result<()> {
    let mut r = BufReader::new(conn.try_clone()?);
    while let Some(head) = read_head(&mut r)? {
        heads.lock().unwrap().push(head.clone());
        let n = count.fetch_add(1, Ordering::SeqCst);
        match handle(&Request { head: &head, n }) {
            Reply::Now(bytes) => conn.write_all(&bytes)?,
            Reply::Trickle(bytes, at_once) => {
                conn.write_all(&bytes[..at_once])?;
                for b in &bytes[at_once..] {
                    std::thread::sleep(Duration::from_secs(1));
                    conn.write_all(std::slice::from_ref(b))?;
                }
            }
        }
    }
    Ok(())
}

/// An answer with `status` and `headers`, and `body`.
fn answer(status: &str, headers: &[(&str, String)], body: &[u8]) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\n", body.len()).into_bytes();
    for (n, v) in headers {
        out.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

fn redirect(to: &str) -> Reply {
    Reply::Now(answer("302 Found", &[("Location", to.to_string())], b""))
}

/// `data` as a server with ranges answers `req`: 206 and the range asked for, else 200;
/// with `validators` (e.g. `ETag`) on each answer.
fn ranged(req: &Request, data: &[u8], validators: &[(&str, String)]) -> Vec<u8> {
    let range = req.header("range").and_then(|r| {
        let (a, b) = r.strip_prefix("bytes=")?.split_once('-')?;
        let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
        Some((a, b.min(data.len() - 1)))
    });
    match range {
        Some((a, b)) => {
            let mut h = validators.to_vec();
            h.push(("Content-Range", format!("bytes {a}-{b}/{}", data.len())));
            answer("206 Partial Content", &h, &data[a..=b])
        }
        None => answer("200 OK", validators, data),
    }
}

const LEN: usize = 3 << 20;

// ---------------------------------------------------------------------------------
// Redirects: credentials go to their own origin only
// ---------------------------------------------------------------------------------

const PASSWORD: &str = "Pa55-never-elsewhere";
const COOKIE: &str = "session=cookie-never-elsewhere";
const TOKEN: &str = "token-never-elsewhere";

/// `Basic base64("u:PASSWORD")`.
fn basic() -> String {
    let creds = format!("u:{PASSWORD}");
    let out = Command::new("sh").args(["-c", "printf %s \"$1\" | base64 -w0", "sh", &creds]).output().unwrap();
    format!("Basic {}", String::from_utf8(out.stdout).unwrap())
}

#[test]
fn redirects_keep_credentials_and_user_headers_to_their_origin() {
    let data = Arc::new(data_with_holes(LEN, 31));
    // Another port of the same host: serves anyone.
    let d = data.clone();
    let (other, other_heads) = server(move |req| Reply::Now(ranged(req, &d, &[])));
    // The origin: /obj wants the credentials; /same redirects to it, /cross-port to the
    // other port, /cross-host to this port under another host name (localhost).
    let d = data.clone();
    let auth = basic();
    let (port, heads) = server(move |req| match req.path() {
        "/same" => redirect("/obj"),
        "/same-absolute" => redirect(&format!("http://127.0.0.1:{}/obj", port_of(req))),
        "/cross-port" => redirect(&format!("http://127.0.0.1:{other}/obj")),
        "/cross-host" => redirect(&format!("http://localhost:{}/open", port_of(req))),
        "/open" => Reply::Now(ranged(req, &d, &[])),
        "/obj" if req.header("authorization").as_deref() == Some(auth.as_str()) => Reply::Now(ranged(req, &d, &[])),
        _ => Reply::Now(answer("401 Unauthorized", &[("WWW-Authenticate", "Basic".into())], b"")),
    });
    let tmp = tempfile::tempdir().unwrap();
    let copy = |path: &str| {
        let out = tmp.path().join(path.trim_start_matches('/'));
        let url = format!("http://u:{PASSWORD}@127.0.0.1:{port}{path}");
        let o = run_ok(&mut ferry([
            "copy",
            "--header",
            &format!("Cookie: {COOKIE}"),
            "--header",
            &format!("X-Token: {TOKEN}"),
            &url,
            s(&out),
        ]));
        assert_file_eq(&out, &data);
        for secret in [PASSWORD, COOKIE, TOKEN] {
            assert!(!format!("{}{}", o.stdout, o.stderr).contains(secret), "{}", o.describe());
        }
    };
    // Same origin, relative and absolute Location: the credentials go along.
    copy("/same");
    copy("/same-absolute");
    let secret_free = |head: &String| {
        let h = head.to_ascii_lowercase();
        !h.contains("authorization")
            && !h.contains("cookie")
            && !h.contains("x-token")
            && !h.contains("never-elsewhere")
    };
    // Another port of the same host: it gets every read, and never a credential.
    copy("/cross-port");
    let got = other_heads.lock().unwrap().clone();
    assert!(got.len() >= 3, "the reads went to the redirect's target: {got:?}");
    assert!(got.iter().all(secret_free), "a credential went to another port: {got:#?}");
    // Another host name on the same port.
    copy("/cross-host");
    let got: Vec<String> =
        heads.lock().unwrap().iter().filter(|h| h.to_ascii_lowercase().contains("host: localhost")).cloned().collect();
    assert!(got.len() >= 3, "the reads went to the redirect's target: {got:?}");
    assert!(got.iter().all(secret_free), "a credential went to another host: {got:#?}");
}

/// The port a request was sent to, from its Host header.
fn port_of(req: &Request) -> u16 {
    req.header("host").and_then(|h| h.rsplit_once(':').and_then(|(_, p)| p.parse().ok())).unwrap_or(0)
}

// ---------------------------------------------------------------------------------
// --request-timeout bounds a whole request
// ---------------------------------------------------------------------------------

#[test]
fn a_trickling_server_fails_within_the_request_timeout() {
    let data = Arc::new(data_with_holes(1 << 20, 3));
    // The first GET (the size and head) is answered at once; every later body trickles.
    let d = data.clone();
    let (body_port, _) = server(move |req| match req.n {
        0 => Reply::Now(ranged(req, &d, &[])),
        _ => Reply::Trickle(ranged(req, &d, &[]), 200),
    });
    // Headers that trickle, from the first GET on.
    let d = data.clone();
    let (head_port, _) = server(move |req| Reply::Trickle(ranged(req, &d, &[]), 5));
    let tmp = tempfile::tempdir().unwrap();
    for port in [body_port, head_port] {
        let url = format!("http://127.0.0.1:{port}/img");
        let t = Instant::now();
        let out = run_timeout(
            &mut ferry(["copy", "--retries", "0", "--request-timeout", "2", &url, s(&tmp.path().join("out"))]),
            Duration::from_secs(30),
        );
        assert!(!out.status.success(), "{}", out.describe());
        assert!(out.stderr.contains("timed out"), "{}", out.describe());
        assert!(t.elapsed() < Duration::from_secs(8), "took {:?}: {}", t.elapsed(), out.describe());
    }
}

// ---------------------------------------------------------------------------------
// An object replaced while it is read
// ---------------------------------------------------------------------------------

/// How a server whose object is replaced after its third request behaves.
#[derive(Clone, Copy, Debug)]
enum Replaced {
    /// Strong ETags, `If-Match` honoured (412).
    Honours,
    /// Strong ETags, `If-Match` ignored: the new bytes with the new ETag.
    IgnoresIfMatch,
    /// A weak ETag and Last-Modified, conditions ignored: only the date changes.
    WeakEtag,
}

fn replacing_server(mode: Replaced) -> u16 {
    let old = data_with_holes(LEN, 1);
    let mut new = old.clone();
    new[LEN - 100..].fill(0xee);
    new[70_000..70_100].fill(0xee);
    let (port, _) = server(move |req| {
        let replaced = req.n >= 3;
        let (data, etag, date) = match replaced {
            false => (&old, "\"v1\"", "Thu, 01 Jan 2026 00:00:00 GMT"),
            true => (&new, "\"v2\"", "Fri, 02 Jan 2026 00:00:00 GMT"),
        };
        let validators = match mode {
            Replaced::WeakEtag => vec![("ETag", "W/\"same\"".to_string()), ("Last-Modified", date.to_string())],
            _ => vec![("ETag", etag.to_string())],
        };
        if let (Replaced::Honours, Some(m)) = (mode, req.header("if-match")) {
            if m != etag {
                return Reply::Now(answer("412 Precondition Failed", &[], b""));
            }
        }
        Reply::Now(ranged(req, data, &validators))
    });
    port
}

#[test]
fn an_object_replaced_while_it_is_read_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    for mode in [Replaced::Honours, Replaced::IgnoresIfMatch, Replaced::WeakEtag] {
        let port = replacing_server(mode);
        let url = format!("http://127.0.0.1:{port}/disk.raw");
        let out = run(&mut ferry([
            "copy",
            "--verify",
            "--connections",
            "1",
            "--request-size",
            "256K",
            &url,
            s(&tmp.path().join(format!("{mode:?}"))),
        ]));
        assert!(!out.status.success(), "{mode:?}: a copy of a replaced object succeeded:\n{}", out.describe());
        assert!(
            out.stderr.contains("changed while it was read") && out.stderr.contains(&url),
            "{mode:?}:\n{}",
            out.describe()
        );
    }
}

// ---------------------------------------------------------------------------------
// S3 (moto_server)
// ---------------------------------------------------------------------------------

const KEY_ID: &str = "AKIDHOSTILEREMOTES";
const SECRET: &str = "hostile-remotes-secret-never-printed";
const SESSION: &str = "hostile-remotes-session-token-never-printed";

fn s3ferry<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut c = ferry(args);
    for v in
        ["AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_DEFAULT_REGION"]
    {
        c.env_remove(v);
    }
    c.env("AWS_ENDPOINT_URL", &moto().endpoint)
        .env("AWS_ACCESS_KEY_ID", KEY_ID)
        .env("AWS_SECRET_ACCESS_KEY", SECRET)
        .env("AWS_REGION", "us-east-1");
    c
}

/// Runs a boto3 snippet against moto (`s3` is a client); what it printed.
fn boto3(code: &str) -> String {
    let script = format!(
        "import boto3\ns3 = boto3.client('s3', endpoint_url='{}', aws_access_key_id='{KEY_ID}', \
         aws_secret_access_key='{SECRET}', region_name='us-east-1')\n{code}\n",
        moto().endpoint
    );
    run_ok(&mut cmd("python3", ["-c", &script])).stdout
}

fn keys(bucket: &str) -> Vec<String> {
    boto3(&format!("for o in s3.list_objects_v2(Bucket='{bucket}').get('Contents', []): print(repr(o['Key']))"))
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn s3_keys_with_dot_segments_are_refused() {
    moto();
    boto3("s3.create_bucket(Bucket='hr-dots')\ns3.create_bucket(Bucket='hr-other')");
    let tmp = tempfile::tempdir().unwrap();
    let src = write_sparse_file(tmp.path(), "src.raw", &data_with_holes(1 << 20, 9));
    for spec in [
        "s3://hr-dots/../hr-other/k",
        "s3://hr-dots/d/./s/../k",
        "s3://hr-dots/k/..",
        "s3://../hr-other/k",
        "s3://./hr-other/k",
        "s3://hr-dots/%2e%2e/hr-other/k",
        "s3://hr-dots/a/%2E/k",
    ] {
        let out = run_fails(&mut s3ferry(["copy", s(&src), spec]));
        assert!(out.stderr.contains("segment") && out.stderr.contains(spec), "{}", out.describe());
    }
    assert_eq!(keys("hr-dots"), Vec::<String>::new(), "a refused key was written");
    assert_eq!(keys("hr-other"), Vec::<String>::new(), "a key resolved into another bucket");
    // Read: `s3://b/..` would be the bucket's listing.
    for spec in ["s3://hr-dots/..", "s3://hr-dots/x/%2e%2e"] {
        let out = run_fails(&mut s3ferry(["hash", spec]));
        assert!(out.stderr.contains("segment") && out.stdout.is_empty(), "{}", out.describe());
    }
}

#[test]
fn s3_specs_are_used_and_printed_exactly_as_given() {
    moto();
    boto3("s3.create_bucket(Bucket='hr-exact')\ns3.put_object(Bucket='hr-exact', Key='q', Body=b'another object')");
    let tmp = tempfile::tempdir().unwrap();
    let data = data_with_holes(1 << 20, 12);
    let src = write_sparse_file(tmp.path(), "src.raw", &data);
    let want = run_ok(&mut ferry(["hash", s(&src)])).stdout.split_whitespace().next().unwrap().to_string();
    let spec = "s3://hr-exact/q?x=1#f";
    run_ok(&mut s3ferry(["copy", s(&src), spec]));
    let mut k = keys("hr-exact");
    k.sort();
    assert_eq!(k, ["'q'", "'q?x=1#f'"], "the key is stored literally, as the AWS CLI stores it");
    let out = run_ok(&mut s3ferry(["hash", spec]));
    assert_eq!(out.stdout.trim(), format!("{want}  {spec}"), "{}", out.describe());
    let back = tmp.path().join("back.raw");
    run_ok(&mut s3ferry(["copy", spec, s(&back)]));
    assert_file_eq(&back, &data);
}

#[test]
fn very_verbose_logs_print_no_signature_token_or_password() {
    moto();
    boto3("s3.create_bucket(Bucket='hr-logs')");
    let tmp = tempfile::tempdir().unwrap();
    let data = data_with_holes(1 << 20, 4);
    let src = write_sparse_file(tmp.path(), "src.raw", &data);
    let mut outs = Vec::new();
    let mut up = s3ferry(["-vv", "copy", s(&src), "s3://hr-logs/obj"]);
    up.env("AWS_SESSION_TOKEN", SESSION);
    outs.push(run_ok(&mut up));
    let mut down = s3ferry(["-vv", "copy", "s3://hr-logs/obj", s(&tmp.path().join("back"))]);
    down.env("AWS_SESSION_TOKEN", SESSION);
    outs.push(run_ok(&mut down));
    assert_file_eq(&tmp.path().join("back"), &data);
    // RUST_LOG naming the HTTP library's modules is no way around it either.
    let mut named = s3ferry(["copy", "s3://hr-logs/obj", s(&tmp.path().join("named"))]);
    named.env("AWS_SESSION_TOKEN", SESSION).env("RUST_LOG", "trace,ureq=trace,ureq::run=trace,ureq_proto=trace");
    outs.push(run_ok(&mut named));

    let d = Arc::new(data);
    let auth = basic();
    let (port, _) = server(move |req| match req.header("authorization") {
        Some(a) if a == auth => Reply::Now(ranged(req, &d, &[("ETag", "\"e\"".into())])),
        _ => Reply::Now(answer("401 Unauthorized", &[], b"")),
    });
    let url = format!("http://u:{PASSWORD}@127.0.0.1:{port}/img");
    outs.push(run_ok(&mut ferry(["-vv", "copy", &url, s(&tmp.path().join("http"))])));
    let b64 = basic();
    let b64 = b64.trim_start_matches("Basic ");
    for o in &outs {
        let all = format!("{}{}", o.stdout, o.stderr);
        assert!(all.lines().count() > 5, "-vv logged next to nothing: {}", o.describe());
        for secret in ["X-Amz-Signature", "X-Amz-Security-Token", "X-Amz-Credential", SECRET, SESSION, PASSWORD, b64] {
            assert!(!all.contains(secret), "{secret} was printed:\n{}", o.describe());
        }
    }
}
