//! The S3 store against a real S3 API: moto's `moto_server`, started once for this test
//! binary on 127.0.0.1 by ferry-testsupport.

use ferry_repo::store::{S3Store, Store};
use std::io::{self, Read, Write};
use std::time::Duration;

fn config() -> ferry_s3::S3Config {
    let endpoint = &ferry_testsupport::moto::moto().endpoint;
    ferry_s3::S3Config::with_endpoint(endpoint, "testing-key", "testing-secret", "us-east-1")
}

fn http() -> ferry_http::HttpOptions {
    ferry_http::HttpOptions { retries: 1, retry_delay: Duration::from_millis(20), ..Default::default() }
}

/// Makes bucket `name` (moto takes unsigned requests).
fn make_bucket(name: &str) {
    let endpoint = &ferry_testsupport::moto::moto().endpoint;
    let addr = endpoint.trim_start_matches("http://");
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    write!(c, "PUT /{name} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").unwrap();
    let mut answer = String::new();
    c.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "CreateBucket {name}: {answer}");
}

fn sorted(mut v: Vec<(String, u64)>) -> Vec<(String, u64)> {
    v.sort();
    v
}

#[test]
fn objects_are_written_read_listed_and_deleted() {
    make_bucket("repo-objects");
    let s = S3Store::open("s3://repo-objects/backups/r1/", &config(), &http()).unwrap();
    assert_eq!(s.describe(), "s3://repo-objects/backups/r1");
    let pack: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
    s.put("config", b"{}").unwrap();
    s.put("data/ab/ab12", &pack).unwrap();
    s.put("snapshots/ee", b"m").unwrap();
    assert_eq!(s.get("data/ab/ab12", 100_000).unwrap(), pack);
    assert_eq!(s.len("data/ab/ab12").unwrap(), 100_000);
    assert_eq!(s.get_range("data/ab/ab12", 99_990, 10).unwrap(), &pack[99_990..]);
    assert_eq!(s.get_range("data/ab/ab12", 5, 3).unwrap(), &pack[5..8]);
    assert_eq!(s.get_range("data/ab/ab12", 100_000, 0).unwrap(), b"");

    // Limits and ranges past the end.
    let e = s.get("data/ab/ab12", 99_999).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    assert!(e.to_string().contains("s3://repo-objects/backups/r1/data/ab/ab12"), "{e}");
    for (o, l) in [(99_999, 2), (100_000, 1), (200_000, 5), (100_001, 0)] {
        let e = s.get_range("data/ab/ab12", o, l).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{o} {l}: {e}");
    }

    // Missing objects.
    for r in [s.get("index/00", 10).map(drop), s.get_range("index/00", 0, 1).map(drop), s.len("index/00").map(drop)] {
        let e = r.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
    }

    // Listing: relative names, only under the prefix, and only objects' names.
    let other = S3Store::open("s3://repo-objects/backups/r10", &config(), &http()).unwrap();
    other.put("data/ab/ff", b"not r1's").unwrap();
    let top = S3Store::open("s3://repo-objects", &config(), &http()).unwrap();
    top.put("snapshots/zz", b"top").unwrap();
    assert_eq!(s.list("data/").unwrap(), [("data/ab/ab12".to_string(), 100_000)]);
    assert_eq!(s.list("snapshots/").unwrap(), [("snapshots/ee".to_string(), 1)]);
    assert_eq!(s.list("locks/").unwrap(), []);
    assert_eq!(sorted(s.list("").unwrap()).len(), 3);
    assert_eq!(top.list("snapshots/").unwrap(), [("snapshots/zz".to_string(), 3)]);
    assert_eq!(top.get("backups/r1/config", 10).unwrap(), b"{}");

    // A rewrite replaces; deleting twice is fine.
    s.put("config", b"{\"v\":2}").unwrap();
    assert_eq!(s.get("config", 100).unwrap(), b"{\"v\":2}");
    s.delete("data/ab/ab12").unwrap();
    s.delete("data/ab/ab12").unwrap();
    assert_eq!(s.get("data/ab/ab12", 10).unwrap_err().kind(), io::ErrorKind::NotFound);
    assert_eq!(s.list("data/").unwrap(), []);

    // Names are checked before anything is sent.
    for bad in ["../config", "/x", "A", "a//b", ""] {
        assert_eq!(s.put(bad, b"x").unwrap_err().kind(), io::ErrorKind::InvalidInput, "{bad:?}");
    }
}

#[test]
fn listings_follow_continuation_tokens() {
    make_bucket("repo-pages");
    let s = S3Store::open("s3://repo-pages/r", &config(), &http()).unwrap().with_page_keys(7);
    let mut want = Vec::new();
    for i in 0..30u32 {
        let name = format!("data/{:02x}/{i:08x}", i % 3);
        s.put(&name, &i.to_le_bytes()[..(i % 4) as usize]).unwrap();
        want.push((name, (i % 4) as u64));
    }
    want.sort();
    assert_eq!(sorted(s.list("data/").unwrap()), want);
    assert_eq!(s.list("data/01/").unwrap().len(), 10);
}

/// A prefix with characters URLs escape: the keys are signed, sent and listed back as
/// they are.
#[test]
fn prefixes_with_spaces_and_symbols() {
    make_bucket("repo-odd");
    let s = S3Store::open("s3://repo-odd/my backups/a+b&c=d%20é/", &config(), &http()).unwrap();
    s.put("config", b"x").unwrap();
    s.put("locks/0123", b"l").unwrap();
    assert_eq!(s.get("config", 1).unwrap(), b"x");
    assert_eq!(s.get_range("locks/0123", 0, 1).unwrap(), b"l");
    assert_eq!(sorted(s.list("").unwrap()), [("config".to_string(), 1), ("locks/0123".to_string(), 1)]);
    assert_eq!(s.list("locks/").unwrap(), [("locks/0123".to_string(), 1)]);
    s.delete("locks/0123").unwrap();
    assert_eq!(s.list("locks/").unwrap(), []);
}

#[test]
fn a_missing_bucket_is_an_error_not_an_empty_repository() {
    let s = S3Store::open("s3://no-such-bucket-here/r", &config(), &http()).unwrap();
    let e = s.get("config", 100).unwrap_err();
    assert_ne!(e.kind(), io::ErrorKind::NotFound, "{e}");
    assert!(e.to_string().contains("no-such-bucket-here"), "{e}");
    assert!(s.put("config", b"x").is_err());
    assert!(S3Store::open("http://x/y", &config(), &http()).is_err());
    assert!(S3Store::open("s3://b/a/../c", &config(), &http()).is_err());
    let e = S3Store::open("s3://KEY:SECRET@b/p", &config(), &http()).err().unwrap();
    assert!(!e.to_string().contains("SECRET"), "{e}");
}

/// A lock's age by the server's clock alone: `Last-Modified` with the answer's `Date`.
#[test]
fn objects_are_read_with_the_servers_times() {
    make_bucket("repo-times");
    let s = S3Store::open("s3://repo-times/r", &config(), &http()).unwrap();
    s.put("locks/00", b"{}").unwrap();
    let (data, t) = s.get_timed("locks/00", 10).unwrap();
    assert_eq!(data, b"{}");
    let t = t.expect("moto sends Last-Modified");
    let now = t.now.expect("moto sends Date");
    // Whole seconds, the same clock: written within the last minute, not in the future.
    let age = now.duration_since(t.modified).expect("Last-Modified after Date");
    assert!(age < Duration::from_secs(60), "{age:?}");
    assert_eq!(s.get_timed("locks/01", 10).unwrap_err().kind(), io::ErrorKind::NotFound);
}

/// A directory store gives a file's modification time, and no clock of its own.
#[test]
fn directory_objects_are_read_with_their_modification_time() {
    let dir = tempfile::tempdir().unwrap();
    let s = ferry_repo::store::DirStore::create(&dir.path().join("r")).unwrap();
    s.put("locks/00", b"{}").unwrap();
    let (data, t) = s.get_timed("locks/00", 10).unwrap();
    assert_eq!(data, b"{}");
    let t = t.expect("a file has a modification time");
    let age = std::time::SystemTime::now().duration_since(t.modified).unwrap_or_default();
    assert!(age < Duration::from_secs(60), "{age:?}");
    // The file system's clock now: a file created beside it, just written.
    let now = t.now.expect("the directory's clock");
    assert!(now >= t.modified && now.duration_since(t.modified).unwrap() < Duration::from_secs(60), "{t:?}");
}
