//! ferry-s3 against a scripted HTTP server on 127.0.0.1: the answers a real server gives
//! rarely or only when something is wrong (refused credentials, 503, a dropped
//! connection, a 200 whose body is an error), and what ferry-s3 does with them.

use ferry_backend::Backend;
use ferry_http::HttpOptions;
use ferry_s3::{open_source, S3Config, S3Url, S3Writer, WriterOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// One request as the server saw it.
#[derive(Debug, Clone)]
struct Req {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Req {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// An answer, or `None` to drop the connection without one.
type Answer = Option<(u16, Vec<(String, String)>, String)>;

struct Fake {
    endpoint: String,
    seen: Arc<Mutex<Vec<Req>>>,
}

/// Serves every request with `answer(request, how many came before)`.
fn serve(answer: impl Fn(&Req, usize) -> Answer + Send + Sync + 'static) -> Fake {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", l.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (seen2, answer) = (seen.clone(), Arc::new(answer));
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(conn) = conn else { break };
            let (seen, answer) = (seen2.clone(), answer.clone());
            std::thread::spawn(move || connection(conn, &seen, &*answer));
        }
    });
    Fake { endpoint, seen }
}

fn connection(conn: TcpStream, seen: &Mutex<Vec<Req>>, answer: &(dyn Fn(&Req, usize) -> Answer + Send + Sync)) {
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(conn.try_clone().unwrap());
    let mut w = conn;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, target) = (parts.next().unwrap_or("").to_string(), parts.next().unwrap_or("").to_string());
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.push((k.trim().to_string(), v.trim().to_string()));
            }
        }
        let len: usize = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        let mut body = vec![0; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        let req = Req { method, target, headers, body };
        let n = {
            let mut s = seen.lock().unwrap();
            s.push(req.clone());
            s.len() - 1
        };
        let Some((status, headers, body)) = answer(&req, n) else { return };
        // An answer may give its own Content-Length (a HEAD's, with no body).
        let mut out = format!("HTTP/1.1 {status} X\r\n");
        if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-length")) {
            out += &format!("Content-Length: {}\r\n", body.len());
        }
        for (k, v) in headers {
            out += &format!("{k}: {v}\r\n");
        }
        out += "\r\n";
        out += &body;
        if w.write_all(out.as_bytes()).is_err() {
            return;
        }
    }
}

fn error(status: u16, code: &str) -> Answer {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>scripted {code}</Message>\
         <RequestId>1</RequestId></Error>"
    );
    Some((status, vec![("Content-Type".into(), "application/xml".into())], body))
}

fn ok(body: &str) -> Answer {
    Some((200, Vec::new(), body.to_string()))
}

const INITIATED: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<InitiateMultipartUploadResult \
     xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Bucket>b</Bucket><Key>k</Key><UploadId>UP1</UploadId>\
     </InitiateMultipartUploadResult>";
const COMPLETED: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<CompleteMultipartUploadResult \
     xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Location>x</Location><Bucket>b</Bucket><Key>k</Key>\
     <ETag>\"abc-2\"</ETag></CompleteMultipartUploadResult>";

fn config(f: &Fake) -> S3Config {
    S3Config::with_endpoint(&f.endpoint, "AKIDEXAMPLE", "very-secret-value", "us-east-1")
}

fn http() -> HttpOptions {
    HttpOptions { retries: 3, retry_delay: Duration::from_millis(10), ..HttpOptions::default() }
}

fn url() -> S3Url {
    S3Url::parse("s3://b/k").unwrap()
}

/// A server that does multipart uploads, with `part` deciding each UploadPart's answer
/// (given how many UploadParts came before) and `complete` each CompleteMultipartUpload's.
fn uploads(
    part: impl Fn(usize) -> Answer + Send + Sync + 'static,
    complete: impl Fn(usize) -> Answer + Send + Sync + 'static,
) -> Fake {
    let counts = Mutex::new((0usize, 0usize));
    serve(move |r, _| {
        let mut c = counts.lock().unwrap();
        if r.method == "POST" && r.target.contains("uploads") {
            ok(INITIATED)
        } else if r.method == "PUT" && r.target.contains("partNumber") {
            c.0 += 1;
            let n = c.0 - 1;
            drop(c);
            part(n).map(|(s, mut h, b)| {
                if s == 200 {
                    h.push(("ETag".into(), format!("\"etag{n}\"")));
                }
                (s, h, b)
            })
        } else if r.method == "POST" && r.target.contains("uploadId") {
            c.1 += 1;
            let n = c.1 - 1;
            drop(c);
            complete(n)
        } else if r.method == "DELETE" {
            Some((204, Vec::new(), String::new()))
        } else {
            error(400, "Unexpected")
        }
    })
}

#[test]
fn refused_credentials_are_explained_without_the_secret() {
    for (code, says) in [
        ("InvalidAccessKeyId", "does not know the access key ID"),
        ("SignatureDoesNotMatch", "secret access key from the caller does not match its key ID"),
        ("AccessDenied", "access denied"),
        ("ExpiredToken", "session token"),
    ] {
        let f = serve(move |_, _| error(403, code));
        let e = S3Writer::create(&url(), &config(&f), &http(), 10).err().unwrap();
        assert_eq!(e.code(), Some(code));
        let m = e.to_string();
        assert!(m.contains("s3://b/k") && m.contains(says), "{code}: {m}");
        assert!(!m.contains("very-secret-value"), "{m}");
        assert_eq!(f.seen.lock().unwrap().len(), 1, "{code} is not retried");

        let e = open_source(&url(), &config(&f), &http()).err().unwrap();
        assert_eq!(e.code(), Some(code), "{e}");
        assert!(e.to_string().contains(says));
    }
    // Requests are presigned: the secret never travels, the key ID does.
    let f = serve(|_, _| error(403, "AccessDenied"));
    let _ = S3Writer::create(&url(), &config(&f), &http(), 10);
    let r = f.seen.lock().unwrap()[0].clone();
    assert!(r.target.contains("X-Amz-Signature=") && r.target.contains("AKIDEXAMPLE"), "{}", r.target);
    assert!(!format!("{r:?}").contains("very-secret-value"));
}

#[test]
fn parts_are_sent_again_after_5xx_and_dropped_connections_with_their_sha256_signed() {
    // Part 1: 503 SlowDown, then a dropped connection, then stored.
    let f = uploads(
        |n| match n {
            0 => error(503, "SlowDown"),
            1 => None,
            _ => ok(""),
        },
        |_| ok(COMPLETED),
    );
    let opts = WriterOptions { part_size: Some(5 * MIB), ..WriterOptions::default() };
    let w = S3Writer::create_with(&url(), &config(&f), &http(), 5 * MIB + 3, &opts).unwrap();
    let data: Vec<u8> = (0..5 * MIB + 3).map(|i| (i * 7 % 251) as u8).collect();
    w.write(&data, 0, false).unwrap();
    w.complete().unwrap();
    let seen = f.seen.lock().unwrap();
    let puts: Vec<&Req> = seen.iter().filter(|r| r.method == "PUT").collect();
    assert_eq!(puts.len(), 4, "three tries of part 1, one of part 2");
    let p1: Vec<&&Req> = puts.iter().filter(|r| r.target.contains("partNumber=1&")).collect();
    assert_eq!(p1.len(), 3);
    for r in &p1 {
        assert_eq!(r.body.len(), 5 * MIB as usize);
        // The part's SHA-256, signed in the Authorization header (the server checks it);
        // no Content-MD5 (it costs twice the CPU), no presigned URL (it signs no payload).
        assert_eq!(r.header("x-amz-content-sha256"), Some(sha256_hex(&data[..5 * MIB as usize]).as_str()));
        assert_eq!(r.header("content-md5"), None);
        let auth = r.header("authorization").unwrap_or_default();
        assert!(auth.starts_with("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/"), "{auth}");
        assert!(auth.contains("SignedHeaders=host;x-amz-content-sha256;x-amz-date,"), "{auth}");
        assert!(!r.target.contains("X-Amz-Signature"), "{}", r.target);
    }
    // CompleteMultipartUpload lists the ETags in part order.
    let complete = seen.iter().find(|r| r.method == "POST" && r.target.contains("uploadId")).unwrap();
    let body = String::from_utf8_lossy(&complete.body);
    let (a, b) = (body.find("etag2").unwrap(), body.find("etag3").unwrap());
    assert!(
        a < b && body.contains("<PartNumber>1</PartNumber>") && body.contains("<PartNumber>2</PartNumber>"),
        "{body}"
    );
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn a_part_that_cannot_be_stored_fails_its_write_and_is_sent_again_by_complete() {
    let f = uploads(|n| if n < 4 { error(500, "InternalError") } else { ok("") }, |_| ok(COMPLETED));
    let w = S3Writer::create(&url(), &config(&f), &http(), 100).unwrap();
    let e = w.write(&[5; 100], 0, false).unwrap_err().to_string();
    assert!(e.contains("UploadPart 1") && e.contains("after 4 tries"), "{e}");
    w.complete().unwrap();
    let seen = f.seen.lock().unwrap();
    assert_eq!(seen.iter().filter(|r| r.method == "PUT").count(), 5);
    assert!(seen.iter().filter(|r| r.method == "PUT").all(|r| r.body == [5; 100]));
}

#[test]
fn a_complete_answered_200_with_an_error_is_retried_or_reported() {
    // InternalError in a 200: tried again, then done.
    let f = uploads(
        |_| ok(""),
        |n| match n {
            0 => Some((200, Vec::new(), error(200, "InternalError").unwrap().2)),
            _ => ok(COMPLETED),
        },
    );
    let w = S3Writer::create(&url(), &config(&f), &http(), 10).unwrap();
    w.write(&[1; 10], 0, false).unwrap();
    w.complete().unwrap();
    let completes =
        f.seen.lock().unwrap().iter().filter(|r| r.method == "POST" && r.target.contains("uploadId")).count();
    assert_eq!(completes, 2);

    // A lasting error in a 200: reported with S3's code.
    let f = uploads(|_| ok(""), |_| Some((200, Vec::new(), error(200, "InvalidPart").unwrap().2)));
    let w = S3Writer::create(&url(), &config(&f), &http(), 10).unwrap();
    w.write(&[1; 10], 0, false).unwrap();
    let e = w.complete().unwrap_err();
    assert_eq!(e.code(), Some("InvalidPart"));
    assert!(e.to_string().contains("CompleteMultipartUpload"), "{e}");
    // Dropping the writer aborts the upload it could not complete.
    drop(w);
    assert!(f.seen.lock().unwrap().iter().any(|r| r.method == "DELETE" && r.target.contains("uploadId=UP1")));
}

#[test]
fn objects_too_large_for_s3_are_refused_before_any_request() {
    let f = serve(|_, _| ok(INITIATED));
    let e = S3Writer::create(&url(), &config(&f), &http(), (5 << 40) + 1).err().unwrap().to_string();
    assert!(e.contains("s3://b/k") && e.contains("5 TiB"), "{e}");
    let o = WriterOptions { part_size: Some(MIB), ..WriterOptions::default() };
    let e = S3Writer::create_with(&url(), &config(&f), &http(), 10, &o).err().unwrap().to_string();
    assert!(e.contains("5 MiB to 5 GiB"), "{e}");
    assert!(f.seen.lock().unwrap().is_empty());
    // Writes past the end are refused.
    let w = S3Writer::create(&url(), &config(&f), &http(), 10).unwrap();
    let e = w.write(&[0; 4], 8, false).unwrap_err().to_string();
    assert!(e.contains("past the object's end"), "{e}");
    assert!(w.read(&mut [0; 4], 0).is_err());
}

#[test]
fn a_lost_completion_counts_only_for_an_object_with_our_multipart_etag() {
    use md5::Digest as _;
    let body = [3u8; 10];
    let part = md5::Md5::digest(body);
    let ours = format!("{:x}-1", md5::Md5::digest(part));
    // CompleteMultipartUpload finds no upload (an earlier completion whose answer was
    // lost, or another's abort), and the key holds an object of our size: ours only if
    // its ETag is the one our parts make.
    for (etag, ours_expected) in [(ours.clone(), true), ("0123456789abcdef0123456789abcdef-1".to_string(), false)] {
        let part_etag = format!("\"{part:x}\"");
        let head_etag = format!("\"{etag}\"");
        let f = serve(move |r, _| {
            if r.method == "POST" && r.target.contains("uploads") {
                ok(INITIATED)
            } else if r.method == "PUT" {
                Some((200, vec![("ETag".into(), part_etag.clone())], String::new()))
            } else if r.method == "POST" {
                error(404, "NoSuchUpload")
            } else if r.method == "HEAD" {
                Some((
                    200,
                    vec![("Content-Length".into(), "10".into()), ("ETag".into(), head_etag.clone())],
                    String::new(),
                ))
            } else {
                Some((204, Vec::new(), String::new()))
            }
        });
        let w = S3Writer::create(&url(), &config(&f), &http(), 10).unwrap();
        w.write(&body, 0, false).unwrap();
        let r = w.complete();
        assert_eq!(r.is_ok(), ours_expected, "HEAD ETag {etag}: {r:?}");
        if let Err(e) = r {
            assert_eq!(e.code(), Some("NoSuchUpload"), "{e}");
        }
    }
}

#[test]
fn the_users_x_amz_headers_are_signed_on_upload_part() {
    let f = uploads(|_| ok(""), |_| ok(COMPLETED));
    let mut http = http();
    http.headers = vec![
        ("X-Amz-Server-Side-Encryption-Customer-Algorithm".into(), "AES256".into()),
        ("x-amz-server-side-encryption-customer-key-MD5".into(), "bWQ1".into()),
        ("X-Not-Amz".into(), "unsigned".into()),
    ];
    let w = S3Writer::create(&url(), &config(&f), &http, 100).unwrap();
    w.write(&[5; 100], 0, false).unwrap();
    w.complete().unwrap();
    let seen = f.seen.lock().unwrap();
    let put = seen.iter().find(|r| r.method == "PUT").unwrap();
    assert_eq!(put.header("x-amz-server-side-encryption-customer-algorithm"), Some("AES256"));
    assert_eq!(put.header("x-not-amz"), Some("unsigned"));
    let auth = put.header("authorization").unwrap_or_default();
    assert!(
        auth.contains(
            "SignedHeaders=host;x-amz-content-sha256;x-amz-date;x-amz-server-side-encryption-customer-algorithm;\
             x-amz-server-side-encryption-customer-key-md5,"
        ),
        "{auth}"
    );
}

/// A server that answers CreateMultipartUpload at once, or (with `trickle_create`) with
/// its body one byte a second, and every UploadPart with its body one byte a second.
fn trickling(trickle_create: bool) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", l.local_addr().unwrap());
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(conn) = conn else { break };
            std::thread::spawn(move || {
                let mut r = BufReader::new(conn.try_clone().unwrap());
                let mut w = conn;
                loop {
                    let (mut first, mut len) = (String::new(), 0usize);
                    if r.read_line(&mut first).unwrap_or(0) == 0 {
                        return;
                    }
                    loop {
                        let mut h = String::new();
                        if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                            break;
                        }
                        if let Some((k, v)) = h.split_once(':') {
                            if k.trim().eq_ignore_ascii_case("content-length") {
                                len = v.trim().parse().unwrap_or(0);
                            }
                        }
                    }
                    let mut body = vec![0; len];
                    if r.read_exact(&mut body).is_err() {
                        return;
                    }
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nETag: \"e\"\r\n\r\n{INITIATED}",
                        INITIATED.len()
                    );
                    if first.starts_with("POST") && !trickle_create {
                        if w.write_all(answer.as_bytes()).is_err() {
                            return;
                        }
                        continue;
                    }
                    // The head at once (`timeout_recv_response` bounds that), the body
                    // trickled.
                    let (head, body) = answer.split_at(answer.find("\r\n\r\n").unwrap() + 4);
                    if w.write_all(head.as_bytes()).is_err() {
                        return;
                    }
                    for b in body.as_bytes() {
                        if w.write_all(&[*b]).is_err() {
                            return;
                        }
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
            });
        }
    });
    endpoint
}

#[test]
fn answers_trickled_a_byte_a_second_end_within_the_request_timeout() {
    let http = HttpOptions { retries: 0, timeout: Some(Duration::from_secs(2)), ..HttpOptions::default() };
    let cfg = |e: &str| S3Config::with_endpoint(e, "AKIDEXAMPLE", "very-secret-value", "us-east-1");
    let started = std::time::Instant::now();
    let e = S3Writer::create(&url(), &cfg(&trickling(true)), &http, 100).err().unwrap().to_string();
    assert!(e.contains("CreateMultipartUpload"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5), "CreateMultipartUpload took {:?}", started.elapsed());

    let w = S3Writer::create(&url(), &cfg(&trickling(false)), &http, 100).unwrap();
    let started = std::time::Instant::now();
    let e = w.write(&[5; 100], 0, false).unwrap_err().to_string();
    assert!(e.contains("UploadPart 1"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5), "UploadPart took {:?}", started.elapsed());
}
