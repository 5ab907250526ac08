//! ferry-s3 against Ceph's radosgw: scripts/ceph-cluster starts a throwaway cluster (one
//! monitor, one memstore OSD, cephx) with radosgw (`CEPH_RGW=1`) in a temporary
//! directory. The cases run one after another in one test, so the cluster starts once
//! per test binary; a failing case does not stop the others, the cluster is stopped
//! whatever happens, and the test fails listing every case that failed.
//!
//! Needs Debian's ceph-mon, ceph-osd, ceph-common, uuid-runtime and radosgw (scripts/test
//! installs them); without them the test fails saying so.

mod common;

use common::{http, pattern, url, S3Server, MIB};
use ferry_backend::{Backend, MemoryBackend, ZeroMode};
use ferry_client::copy::{copy, BackendEndpoint, CopyOptions, Endpoint, Progress};
use ferry_s3::{open_source, pending_uploads, S3Config, S3Writer, WriterOptions};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

struct Cluster {
    dir: PathBuf,
    script: PathBuf,
    s3: S3Server,
}

fn installed(tool: &str) -> bool {
    Command::new("sh").args(["-c", "command -v \"$1\"", "sh", tool]).output().is_ok_and(|o| o.status.success())
}

impl Cluster {
    fn start() -> Cluster {
        for (tool, package) in [
            ("ceph-mon", "ceph-mon"),
            ("ceph-osd", "ceph-osd"),
            ("ceph", "ceph-common"),
            ("rbd", "ceph-common"),
            ("uuidgen", "uuid-runtime"),
            ("radosgw", "radosgw"),
            ("radosgw-admin", "radosgw"),
            ("curl", "curl"),
        ] {
            assert!(
                installed(tool),
                "`{tool}` is not installed: apt-get install {package} (scripts/test installs what these tests need)"
            );
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster");
        let dir = std::env::temp_dir().join(format!("ferry-rgw-{}", std::process::id()));
        // The script's every wait is bounded (60 s), and it stops what it started when it
        // fails, so its output comes back.
        let out = Command::new(&script)
            .arg("start")
            .arg(&dir)
            .env("CEPH_RGW", "1")
            .env("CEPH_MEMSTORE_BYTES", (2u64 << 30).to_string())
            .output()
            .expect("cannot run scripts/ceph-cluster");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "starting the Ceph cluster with radosgw failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let value = |name: &str| {
            stdout
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
                .unwrap_or_else(|| panic!("scripts/ceph-cluster printed no {name}= line:\n{stdout}"))
                .to_string()
        };
        let s3 = S3Server {
            endpoint: value("RGW_ENDPOINT"),
            access_key_id: value("AWS_ACCESS_KEY_ID"),
            secret_access_key: value("AWS_SECRET_ACCESS_KEY"),
        };
        Cluster { dir, script, s3 }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(&self.script).arg("stop").arg(&self.dir).status();
    }
}

/// 40 MiB and an odd tail of pattern bytes, with zero stretches: one inside the first
/// 8 MiB part, one that is the whole third part, and one across the fourth and fifth.
fn source_data(seed: u64) -> Vec<u8> {
    let size = 40 * MIB + 12_345;
    let mut v = pattern(size as usize, seed);
    for (s, e) in [(MIB, MIB + 300_000), (16 * MIB, 24 * MIB), (30 * MIB, 33 * MIB + 4096)] {
        v[s as usize..e as usize].fill(0);
    }
    v
}

fn memory_with(data: &[u8]) -> Arc<MemoryBackend> {
    let m = Arc::new(MemoryBackend::new(data.len() as u64));
    m.write(data, 0, false).unwrap();
    m
}

/// Copies all of `src` into a new memory backend with the copy engine (4 connections of
/// 4 requests of 1 MiB) and returns its bytes.
fn read_all(src: Arc<dyn Backend>, name: &str) -> Vec<u8> {
    let size = src.size();
    let dst = Arc::new(MemoryBackend::new(size));
    let s = Endpoint::Backend(BackendEndpoint::new(name.into(), src));
    let d = Endpoint::Backend(BackendEndpoint::new("mem".into(), dst.clone()));
    let o = CopyOptions { connections: 4, requests: 4, request_size: MIB as usize, ..CopyOptions::default() };
    copy(&s, &d, &o, &Progress::default()).unwrap();
    let mut v = vec![0; size as usize];
    dst.read(&mut v, 0).unwrap();
    v
}

/// The copy engine, 4 connections, fills a new object through an S3Writer with the
/// default part size (8 MiB here: six parts, the last one short and odd); read back
/// with open_source (ranged GETs, through the engine) and with one plain GET.
fn copy_in_and_out(c: &Cluster) {
    let s3 = &c.s3;
    s3.make_bucket("engine");
    let data = source_data(21);
    let size = data.len() as u64;
    let u = url("engine", "dir/disk.img");
    let w = Arc::new(S3Writer::create(&u, &s3.config(), &http(), size).unwrap());
    assert_eq!((w.part_size(), w.parts()), (8 * MIB, 6));
    assert_eq!(pending_uploads(&u, &s3.config(), &http()).unwrap(), [w.upload_id().unwrap().to_string()]);
    let s = Endpoint::Backend(BackendEndpoint::new("mem".into(), memory_with(&data)));
    // Not `.zeroed()`: an object has no holes, every byte must be written.
    let d = Endpoint::Backend(BackendEndpoint::new(u.to_string(), w.clone()));
    let o = CopyOptions { connections: 4, requests: 4, request_size: MIB as usize, ..CopyOptions::default() };
    let r = copy(&s, &d, &o, &Progress::default()).unwrap();
    assert_eq!(r.bytes, size);
    assert!(r.zero_bytes + r.hole_bytes >= 8 * MIB, "zero stretches went as zero requests: {r:?}");
    w.complete().unwrap();
    w.complete().unwrap(); // harmless twice
    assert!(pending_uploads(&u, &s3.config(), &http()).unwrap().is_empty());
    let e = w.write(&[1], 0, false).unwrap_err().to_string();
    assert!(e.contains("already complete"), "{e}");

    let got = s3.get("engine", "dir/disk.img").unwrap();
    assert_eq!(got.len(), data.len());
    assert!(got == data, "the object radosgw serves differs from what was written");
    let src = open_source(&u, &s3.config(), &http()).unwrap();
    assert_eq!(src.size(), size);
    assert!(src.caps().read_only);
    assert!(read_all(src, &u.to_string()) == data, "open_source read other bytes than were written");
}

/// Writes from four threads of our own, out of order, with zero requests, duplicates
/// and overlapping halves, with 5 MiB parts.
fn threads_out_of_order(c: &Cluster) {
    let s3 = &c.s3;
    s3.make_bucket("threads");
    let part = 5 * MIB;
    let data = Arc::new(source_data(7));
    let size = data.len() as u64;
    let u = url("threads", "t.img");
    let o = WriterOptions { part_size: Some(part), ..WriterOptions::default() };
    let w = Arc::new(S3Writer::create_with(&u, &s3.config(), &http(), size, &o).unwrap());
    assert_eq!(w.parts(), 9);
    // 1 MiB requests; an all-zero one goes as a zero request.
    let mut reqs: Vec<(u64, u64)> = (0..size).step_by(MIB as usize).map(|s| (s, (s + MIB).min(size))).collect();
    for i in (0..reqs.len()).step_by(3) {
        let (s, e) = reqs[i];
        reqs.push((s, e));
        reqs.push((s, s + (e - s) / 2));
    }
    let mut x = 99u64;
    for i in (1..reqs.len()).rev() {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        reqs.swap(i, (x >> 33) as usize % (i + 1));
    }
    let queue = Arc::new(std::sync::Mutex::new(reqs));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (w, q, data) = (w.clone(), queue.clone(), data.clone());
            std::thread::spawn(move || loop {
                let Some((s, e)) = q.lock().unwrap().pop() else { break };
                let bytes = &data[s as usize..e as usize];
                if bytes.iter().all(|&b| b == 0) {
                    w.zero(s, e - s, ZeroMode { may_trim: true, fast: false }, false).unwrap();
                } else {
                    w.write(bytes, s, false).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    w.complete().unwrap();
    assert!(s3.get("threads", "t.img").unwrap() == *data, "the object differs from what was written");
}

/// A short object under a key that needs escaping, and an empty one.
fn small_and_empty(c: &Cluster) {
    let s3 = &c.s3;
    s3.make_bucket("small");
    let data = pattern(1000, 3);
    let key = "dir one/ü+%41 &=?#.img";
    let u = url("small", key);
    let w = S3Writer::create(&u, &s3.config(), &http(), 1000).unwrap();
    w.write(&data[500..], 500, false).unwrap();
    w.write(&data[..500], 0, false).unwrap();
    w.complete().unwrap();
    assert_eq!(s3.get("small", key).unwrap(), data);
    assert_eq!(s3.get("small", "dir one/ü+A &=?#.img"), Err(404), "%41 is not decoded");
    let src = open_source(&u, &s3.config(), &http()).unwrap();
    let mut buf = vec![0; 1000];
    src.read(&mut buf, 0).unwrap();
    assert_eq!(buf, data);

    let u = url("small", "empty");
    let w = S3Writer::create(&u, &s3.config(), &http(), 0).unwrap();
    w.complete().unwrap();
    assert_eq!(s3.get("small", "empty").unwrap(), Vec::<u8>::new());
    assert_eq!(open_source(&u, &s3.config(), &http()).unwrap().size(), 0);
}

/// Abort (and dropping an unfinished writer) leaves neither an upload nor an object.
fn abort_leaves_nothing(c: &Cluster) {
    let s3 = &c.s3;
    s3.make_bucket("abort");
    let part = 5 * MIB;
    let o = WriterOptions { part_size: Some(part), ..WriterOptions::default() };
    let u = url("abort", "a/b");
    let w = S3Writer::create_with(&u, &s3.config(), &http(), 3 * part, &o).unwrap();
    w.write(&pattern(part as usize, 2), 0, false).unwrap(); // part 1 stored
    w.write(&[9; 4096], part, false).unwrap(); // part 2 half-filled
    assert_eq!(pending_uploads(&u, &s3.config(), &http()).unwrap().len(), 1);
    w.abort().unwrap();
    w.abort().unwrap();
    assert!(pending_uploads(&u, &s3.config(), &http()).unwrap().is_empty());
    assert_eq!(s3.get("abort", "a/b"), Err(404));
    let e = w.write(&[1], 0, false).unwrap_err().to_string();
    assert!(e.contains("aborted"), "{e}");
    assert!(w.complete().unwrap_err().to_string().contains("aborted"));
    let e = open_source(&u, &s3.config(), &http()).err().unwrap();
    assert_eq!(e.code(), Some("NoSuchKey"), "{e}");

    let u = url("abort", "dropped");
    {
        let w = S3Writer::create_with(&u, &s3.config(), &http(), 2 * part, &o).unwrap();
        w.write(&pattern(part as usize, 4), 0, false).unwrap();
        assert_eq!(pending_uploads(&u, &s3.config(), &http()).unwrap().len(), 1);
    }
    assert!(pending_uploads(&u, &s3.config(), &http()).unwrap().is_empty());
    assert_eq!(s3.get("abort", "dropped"), Err(404));
}

/// An upload interrupted after two of six parts is resumed: the stored parts are kept and
/// the copy engine sends only the ranges not stored.
fn resume_an_interrupted_upload(c: &Cluster) {
    let s3 = &c.s3;
    s3.make_bucket("resume");
    let data = source_data(11);
    let size = data.len() as u64;
    let part = 8 * MIB;
    let u = url("resume", "r.img");
    let first = S3Writer::create(&u, &s3.config(), &http(), size).unwrap();
    assert_eq!(first.part_size(), part);
    first.write(&data[..part as usize], 0, false).unwrap();
    first.write(&data[(3 * part) as usize..(4 * part) as usize], 3 * part, false).unwrap();
    std::mem::forget(first); // the process dies without aborting
    let w = Arc::new(S3Writer::resume(&u, &s3.config(), &http(), size, &WriterOptions::default()).unwrap());
    assert_eq!(w.stored_ranges(), [0..part, 3 * part..4 * part]);
    let todo = w.unstored_ranges();
    assert_eq!(todo, [(part, 2 * part), (4 * part, size - 4 * part)]);
    let s = Endpoint::Backend(BackendEndpoint::new("mem".into(), memory_with(&data)));
    let d = Endpoint::Backend(BackendEndpoint::new(u.to_string(), w.clone()));
    let o = CopyOptions { ranges: Some(Arc::new(todo)), ..CopyOptions::default() };
    let r = copy(&s, &d, &o, &Progress::default()).unwrap();
    assert_eq!(r.selected_bytes, Some(size - 2 * part));
    w.complete().unwrap();
    assert!(s3.get("resume", "r.img").unwrap() == data, "the resumed object differs");

    // A different part size is refused, and the upload is left for the right options.
    let first = S3Writer::create(&u, &s3.config(), &http(), size).unwrap();
    first.write(&data[..part as usize], 0, false).unwrap();
    std::mem::forget(first);
    let o = WriterOptions { part_size: Some(5 * MIB), ..WriterOptions::default() };
    let e = S3Writer::resume(&u, &s3.config(), &http(), size, &o).err().unwrap().to_string();
    assert!(e.contains("cannot resume") && e.contains("part 1"), "{e}");
    let ids = pending_uploads(&u, &s3.config(), &http()).unwrap();
    assert_eq!(ids.len(), 1);
    s3.abort_upload("resume", "r.img", &ids[0]);
    assert!(pending_uploads(&u, &s3.config(), &http()).unwrap().is_empty());
    // The completed object is still there.
    assert!(s3.get("resume", "r.img").unwrap() == data);
}

/// A missing key, a missing bucket, a wrong secret and an unknown key ID give radosgw's
/// error code and a message that names the object and says what to do.
fn errors_say_what_to_do(c: &Cluster) {
    let s3 = &c.s3;
    s3.make_bucket("present");
    let cfg = s3.config();

    let e = open_source(&url("present", "nothing/here"), &cfg, &http()).err().unwrap();
    assert_eq!(e.code(), Some("NoSuchKey"), "{e}");
    let m = e.to_string();
    assert!(m.starts_with("s3://present/nothing/here: GetObject failed: the object does not exist"), "{m}");

    let e = open_source(&url("no-such-bucket", "k"), &cfg, &http()).err().unwrap();
    assert_eq!(e.code(), Some("NoSuchBucket"), "{e}");
    let m = e.to_string();
    assert!(m.contains("s3://no-such-bucket/k") && m.contains("bucket no-such-bucket does not exist"), "{m}");
    let e = S3Writer::create(&url("no-such-bucket", "k"), &cfg, &http(), 10).err().unwrap();
    assert_eq!(e.code(), Some("NoSuchBucket"), "{e}");
    let m = e.to_string();
    assert!(m.contains("s3://no-such-bucket/k") && m.contains(&format!("does not exist at {}", s3.endpoint)), "{m}");

    let secret = "0123456789abcdef0123456789abcdef01234567";
    let wrong = S3Config::with_endpoint(&s3.endpoint, &s3.access_key_id, secret, "us-east-1");
    let e = open_source(&url("present", "k"), &wrong, &http()).err().unwrap();
    assert_eq!(e.code(), Some("SignatureDoesNotMatch"), "{e}");
    let m = e.to_string();
    assert!(m.contains("s3://present/k") && m.contains("does not match its key ID: check the secret key"), "{m}");
    assert!(!m.contains(secret) && !m.contains(&s3.secret_access_key), "a secret key is in the message: {m}");
    let e = S3Writer::create(&url("present", "k"), &wrong, &http(), 10).err().unwrap();
    assert_eq!(e.code(), Some("SignatureDoesNotMatch"), "{e}");

    let unknown = S3Config::with_endpoint(&s3.endpoint, "NOSUCHKEYID000000000", &s3.secret_access_key, "us-east-1");
    let e = S3Writer::create(&url("present", "k"), &unknown, &http(), 10).err().unwrap();
    assert_eq!(e.code(), Some("InvalidAccessKeyId"), "{e}");
    let m = e.to_string();
    assert!(m.contains(&format!("{} does not know the access key ID", s3.endpoint)), "{m}");
    assert!(!m.contains(&s3.secret_access_key), "the secret key is in the message: {m}");
    // Nothing was left behind by the refused requests.
    assert!(pending_uploads(&url("present", "k"), &cfg, &http()).unwrap().is_empty());
}

#[test]
fn radosgw_cluster() {
    let t0 = Instant::now();
    let cluster = Cluster::start();
    eprintln!("cluster with radosgw up in {:?} at {}", t0.elapsed(), cluster.s3.endpoint);
    type Case = fn(&Cluster);
    let cases: [(&str, Case); 6] = [
        ("copy_in_and_out", copy_in_and_out),
        ("threads_out_of_order", threads_out_of_order),
        ("small_and_empty", small_and_empty),
        ("abort_leaves_nothing", abort_leaves_nothing),
        ("resume_an_interrupted_upload", resume_an_interrupted_upload),
        ("errors_say_what_to_do", errors_say_what_to_do),
    ];
    let mut failed = Vec::new();
    for (name, case) in cases {
        let t = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(&cluster)));
        eprintln!("{name}: {} in {:?}", if r.is_ok() { "ok" } else { "FAILED" }, t.elapsed());
        if r.is_err() {
            failed.push(name);
        }
    }
    let log = cluster.dir.join("log/client.rgw.a.log");
    let tail = match failed.is_empty() {
        true => String::new(),
        false => {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(30)..].join("\n")
        }
    };
    drop(cluster);
    assert!(failed.is_empty(), "failed cases: {failed:?}; the end of radosgw's log ({}):\n{tail}", log.display());
}
