//! ferry-s3 against a real S3 API: moto's `moto_server` (`pip install 'moto[server]'`),
//! started once for this test binary on 127.0.0.1 and a free port by ferry-testsupport,
//! and stopped when the binary exits.

mod common;

use common::{http, pattern, url, S3Server, MIB};
use ferry_backend::{Backend, MemoryBackend, ZeroMode};
use ferry_client::copy::{copy, BackendEndpoint, CopyOptions, Endpoint, Progress};
use ferry_s3::{open_source, pending_uploads, S3Config, S3Error, S3Writer, WriterOptions};
use std::net::TcpListener;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const PART: u64 = 5 * MIB;

struct Moto {
    s3: S3Server,
}

fn moto() -> &'static Moto {
    static MOTO: OnceLock<Moto> = OnceLock::new();
    MOTO.get_or_init(|| {
        let endpoint = ferry_testsupport::moto::moto().endpoint.clone();
        let s3 = S3Server { endpoint, access_key_id: "testing-key".into(), secret_access_key: "testing-secret".into() };
        Moto { s3 }
    })
}

fn config() -> S3Config {
    moto().s3.config()
}

fn make_bucket(name: &str) {
    moto().s3.make_bucket(name)
}

fn get(bucket: &str, key: &str) -> Result<Vec<u8>, u16> {
    moto().s3.get(bucket, key)
}

fn opts() -> WriterOptions {
    WriterOptions { part_size: Some(PART), ..WriterOptions::default() }
}

#[test]
fn parallel_out_of_order_writes_with_zeros_and_duplicates_make_the_object() {
    make_bucket("parallel");
    let size = 3 * PART + 2 * MIB + 12345; // four parts, the last one short and odd
    let mut want = pattern(size as usize, 7);
    // Zero ranges: one inside the first part, one covering the whole third part and
    // spilling into the fourth.
    let zeros = [(MIB, MIB + 300_000), (2 * PART, 3 * PART + MIB)];
    for &(s, e) in &zeros {
        want[s as usize..e as usize].fill(0);
    }
    let u = url("parallel", "dir/disk.img");
    let w = Arc::new(S3Writer::create_with(&u, &config(), &http(), size, &opts()).unwrap());
    assert_eq!((w.part_size(), w.parts()), (PART, 4));
    assert_eq!(pending_uploads(&u, &config(), &http()).unwrap(), [w.upload_id().unwrap().to_string()]);

    // 1 MiB requests (the data ones outside the zero ranges), in a shuffled order, with
    // some sent twice and some halves sent again.
    let mut reqs: Vec<(u64, u64, bool)> = Vec::new();
    let mut at = 0;
    while at < size {
        let end = (at + MIB).min(size);
        let mut pos = at;
        for &(zs, ze) in &zeros {
            if zs < end && ze > pos {
                if zs > pos {
                    reqs.push((pos, zs, false));
                }
                pos = pos.max(ze.min(end));
            }
        }
        if pos < end {
            reqs.push((pos, end, false));
        }
        at = end;
    }
    for &(s, e) in &zeros {
        reqs.push((s, e, true));
    }
    let n = reqs.len();
    for i in (0..n).step_by(3) {
        let (s, e, z) = reqs[i];
        reqs.push((s, e, z)); // duplicate
        reqs.push((s, s + (e - s) / 2, z)); // overlapping half
    }
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    let mut x = 12345u64;
    for i in (1..order.len()).rev() {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        order.swap(i, (x >> 33) as usize % (i + 1));
    }
    let queue = Arc::new(Mutex::new(order.into_iter().map(|i| reqs[i]).collect::<Vec<_>>()));
    let want = Arc::new(want);
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (w, q, want) = (w.clone(), queue.clone(), want.clone());
            std::thread::spawn(move || loop {
                let Some((s, e, zero)) = q.lock().unwrap().pop() else { break };
                match zero {
                    true => w.zero(s, e - s, ZeroMode { may_trim: true, fast: false }, false).unwrap(),
                    false => w.write(&want[s as usize..e as usize], s, false).unwrap(),
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    w.complete().unwrap();
    w.complete().unwrap(); // harmless twice
    let got = get("parallel", "dir/disk.img").unwrap();
    assert_eq!(got.len(), size as usize);
    assert!(got == *want, "the object differs from what was written");
    assert!(pending_uploads(&u, &config(), &http()).unwrap().is_empty());
    let e = w.write(&[1], 0, false).unwrap_err().to_string();
    assert!(e.contains("already complete"), "{e}");

    // Reading it back through open_source (ferry-http's HttpBackend with presigned URLs).
    let src = open_source(&u, &config(), &http()).unwrap();
    assert_eq!(src.size(), size);
    assert!(src.caps().read_only);
    let mut buf = vec![0u8; size as usize];
    for (i, chunk) in buf.chunks_mut(3 * MIB as usize).enumerate() {
        src.read(chunk, i as u64 * 3 * MIB).unwrap();
    }
    assert!(buf == *want, "open_source read other bytes than were written");
}

#[test]
fn an_object_of_one_short_part_and_an_empty_one() {
    make_bucket("small");
    let data = pattern(1000, 3);
    // A key that needs escaping in a URL, taken literally (no percent-decoding).
    let key = "dir one/ü+%41 &=?#.img";
    let u = url("small", key);
    assert_eq!(u.key, key);
    let w = S3Writer::create(&u, &config(), &http(), 1000).unwrap();
    assert_eq!((w.part_size(), w.parts()), (8 * MIB, 1));
    w.write(&data[500..], 500, false).unwrap();
    w.write(&data[..500], 0, false).unwrap();
    w.complete().unwrap();
    assert_eq!(get("small", key).unwrap(), data);
    assert_eq!(get("small", "dir one/ü+A &=?#.img"), Err(404), "%41 is not decoded");
    let src = open_source(&u, &config(), &http()).unwrap();
    let mut buf = vec![0; 1000];
    src.read(&mut buf, 0).unwrap();
    assert_eq!(buf, data);
    assert!(src.describe().contains(key), "{}", src.describe());

    let u = url("small", "empty");
    let w = S3Writer::create(&u, &config(), &http(), 0).unwrap();
    assert!(w.upload_id().is_none());
    w.complete().unwrap();
    assert_eq!(get("small", "empty").unwrap(), Vec::<u8>::new());
    let src = open_source(&u, &config(), &http()).unwrap();
    assert_eq!(src.size(), 0);
}

#[test]
fn complete_names_the_bytes_never_written() {
    make_bucket("holes");
    let u = url("holes", "k");
    let w = S3Writer::create_with(&u, &config(), &http(), 2 * PART, &opts()).unwrap();
    w.write(&pattern(PART as usize, 1), 0, false).unwrap();
    w.write(&[1; 100], PART, false).unwrap();
    w.write(&[1; 100], PART + 200, false).unwrap();
    let e = w.complete().unwrap_err().to_string();
    assert!(e.contains(&format!("bytes {}..{} were never written", PART + 100, PART + 200)), "{e}");
    assert!(e.contains("s3://holes/k"), "{e}");
    // The writer is still usable: fill the rest and complete.
    w.zero(PART + 100, 100, ZeroMode::default(), false).unwrap();
    w.zero(PART + 300, PART - 300, ZeroMode::default(), false).unwrap();
    w.complete().unwrap();
    let got = get("holes", "k").unwrap();
    assert_eq!(got.len(), 2 * PART as usize);
    assert_eq!(&got[PART as usize..PART as usize + 100], &[1; 100]);
    assert!(got[PART as usize + 300..].iter().all(|&b| b == 0));
}

#[test]
fn abort_leaves_no_upload_and_no_object() {
    make_bucket("abort");
    let u = url("abort", "a/b");
    let w = S3Writer::create_with(&u, &config(), &http(), 3 * PART, &opts()).unwrap();
    w.write(&pattern(PART as usize, 2), 0, false).unwrap(); // part 1 stored
    w.write(&[9; 4096], PART, false).unwrap(); // part 2 half-filled
    assert_eq!(pending_uploads(&u, &config(), &http()).unwrap().len(), 1);
    w.abort().unwrap();
    w.abort().unwrap();
    assert!(pending_uploads(&u, &config(), &http()).unwrap().is_empty());
    assert_eq!(get("abort", "a/b"), Err(404));
    let e = w.write(&[1], 0, false).unwrap_err().to_string();
    assert!(e.contains("aborted"), "{e}");
    assert!(w.complete().unwrap_err().to_string().contains("aborted"));
}

#[test]
fn dropping_an_unfinished_writer_aborts_it() {
    make_bucket("drop");
    let u = url("drop", "x");
    {
        let w = S3Writer::create_with(&u, &config(), &http(), 2 * PART, &opts()).unwrap();
        w.write(&pattern(PART as usize, 4), 0, false).unwrap();
        assert_eq!(pending_uploads(&u, &config(), &http()).unwrap().len(), 1);
    }
    assert!(pending_uploads(&u, &config(), &http()).unwrap().is_empty());
    assert_eq!(get("drop", "x"), Err(404));
}

#[test]
fn writes_too_far_out_of_order_for_the_memory_limit_fail_clearly() {
    make_bucket("memory");
    let u = url("memory", "m");
    let o = WriterOptions { part_size: Some(PART), memory_limit: 0, stall_timeout: Duration::from_millis(500) };
    let w = S3Writer::create_with(&u, &config(), &http(), 5 * PART, &o).unwrap();
    // The limit is raised to three parts; a fourth partial part has to wait, and nothing
    // can free memory.
    for p in 0..3 {
        w.write(&[1; 10], p * PART, false).unwrap();
    }
    let t = Instant::now();
    let e = w.write(&[1; 10], 3 * PART, false).unwrap_err().to_string();
    assert!(t.elapsed() >= Duration::from_millis(500));
    assert!(e.contains("out of order") && e.contains("s3://memory/m"), "{e}");
    w.abort().unwrap();
    // A waiting write goes on once another write completes a part.
    let o = WriterOptions { stall_timeout: Duration::from_secs(60), ..o };
    let w = Arc::new(S3Writer::create_with(&u, &config(), &http(), 5 * PART, &o).unwrap());
    for p in 0..3 {
        w.write(&[1; 10], p * PART, false).unwrap();
    }
    let rest = pattern(PART as usize - 10, 5);
    let w2 = w.clone();
    let waiter = std::thread::spawn(move || {
        let t = Instant::now();
        w2.write(&[2; 10], 3 * PART, false).map(|_| t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    w.write(&rest, 10, false).unwrap(); // completes part 1, which frees its buffer
    let waited = waiter.join().unwrap().unwrap();
    assert!(waited >= Duration::from_millis(250), "the fourth part waited for memory ({waited:?})");
    w.abort().unwrap();
}

#[test]
fn resume_keeps_the_parts_already_stored() {
    make_bucket("resume");
    let u = url("resume", "r");
    let size = 3 * PART + 77;
    let data = pattern(size as usize, 11);
    let first = S3Writer::create_with(&u, &config(), &http(), size, &opts()).unwrap();
    first.write(&data[..PART as usize], 0, false).unwrap();
    first.write(&data[2 * PART as usize..3 * PART as usize], 2 * PART, false).unwrap();
    // Interrupted: the process dies without aborting.
    std::mem::forget(first);
    let w = S3Writer::resume(&u, &config(), &http(), size, &opts()).unwrap();
    assert_eq!(w.stored_ranges(), [0..PART, 2 * PART..3 * PART]);
    // Writes into stored parts are dropped (here other bytes, to show it); the rest is sent.
    w.write(&vec![0xee; PART as usize], 0, false).unwrap();
    w.write(&data[PART as usize..2 * PART as usize], PART, false).unwrap();
    w.write(&vec![0xee; PART as usize], 2 * PART, false).unwrap();
    w.write(&data[3 * PART as usize..], 3 * PART, false).unwrap();
    w.complete().unwrap();
    assert!(get("resume", "r").unwrap() == data, "the resumed object differs");
    // A different part size is refused.
    let other = S3Writer::create_with(&u, &config(), &http(), size, &opts()).unwrap();
    other.write(&data[..PART as usize], 0, false).unwrap();
    std::mem::forget(other);
    let o = WriterOptions { part_size: Some(2 * PART), ..WriterOptions::default() };
    let e = S3Writer::resume(&u, &config(), &http(), size, &o).err().unwrap().to_string();
    assert!(e.contains("cannot resume") && e.contains("part 1"), "{e}");
    // ...and the upload is left for a try with the right options.
    assert_eq!(pending_uploads(&u, &config(), &http()).unwrap().len(), 1);
    let w = S3Writer::resume(&u, &config(), &http(), size, &opts()).unwrap();
    assert_eq!(w.unstored_ranges(), [(PART, size - PART)]);
    w.abort().unwrap();
    for id in pending_uploads(&u, &config(), &http()).unwrap() {
        moto().s3.abort_upload("resume", "r", &id);
    }
}

#[test]
fn missing_bucket_and_object_say_so() {
    make_bucket("present");
    let e = S3Writer::create(&url("no-such-bucket", "k"), &config(), &http(), 10).err().unwrap();
    assert_eq!(e.code(), Some("NoSuchBucket"), "{e}");
    let m = e.to_string();
    assert!(m.contains("s3://no-such-bucket/k") && m.contains("bucket no-such-bucket does not exist"), "{m}");

    let e = open_source(&url("present", "nothing/here"), &config(), &http()).err().unwrap();
    assert_eq!(e.code(), Some("NoSuchKey"), "{e}");
    let m = e.to_string();
    assert!(m.starts_with("s3://present/nothing/here: GetObject failed: the object does not exist"), "{m}");
    let e = open_source(&url("no-such-bucket", "k"), &config(), &http()).err().unwrap();
    assert_eq!(e.code(), Some("NoSuchBucket"), "{e}");
}

#[test]
fn an_unreachable_endpoint_is_named() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let cfg = S3Config::with_endpoint(&format!("http://127.0.0.1:{port}"), "k", "s", "us-east-1");
    let e = S3Writer::create(&url("b", "k"), &cfg, &http(), 10).err().unwrap();
    assert!(matches!(e, S3Error::Transport { .. }), "{e:?}");
    let m = e.to_string();
    assert!(m.contains(&format!("127.0.0.1:{port}")) && m.contains("after 3 tries"), "{m}");
}

/// A source of `size` bytes: pattern data with zero stretches (one a whole part).
fn source(size: u64) -> (Arc<MemoryBackend>, Vec<u8>) {
    let mut data = pattern(size as usize, 21);
    data[(PART + 4096) as usize..(2 * PART) as usize].fill(0);
    data[(3 * PART) as usize..(4 * PART) as usize].fill(0);
    let m = Arc::new(MemoryBackend::new(size));
    m.write(&data, 0, false).unwrap();
    (m, data)
}

#[test]
fn the_copy_engine_fills_an_s3_writer() {
    make_bucket("engine");
    let size = 5 * PART + 777;
    let (src, data) = source(size);
    let u = url("engine", "copied.img");
    let w = Arc::new(S3Writer::create_with(&u, &config(), &http(), size, &opts()).unwrap());
    let s = Endpoint::Backend(BackendEndpoint::new("mem".into(), src));
    // Not `.zeroed()`: an object has no holes, every byte must be written.
    let d = Endpoint::Backend(BackendEndpoint::new(u.to_string(), w.clone()));
    let o = CopyOptions { connections: 4, requests: 4, request_size: 1 << 20, ..CopyOptions::default() };
    let r = copy(&s, &d, &o, &Progress::default()).unwrap();
    assert_eq!(r.bytes, size);
    assert!(r.zero_bytes + r.hole_bytes >= PART, "zero stretches went as zero requests: {r:?}");
    w.complete().unwrap();
    assert!(get("engine", "copied.img").unwrap() == data);
}

#[test]
fn a_resumed_upload_is_finished_by_a_copy_of_the_ranges_not_stored() {
    make_bucket("engine-resume");
    let size = 5 * PART + 777;
    let (src, data) = source(size);
    let u = url("engine-resume", "r.img");
    let first = S3Writer::create_with(&u, &config(), &http(), size, &opts()).unwrap();
    first.write(&data[..PART as usize], 0, false).unwrap();
    first.write(&data[(4 * PART) as usize..(5 * PART) as usize], 4 * PART, false).unwrap();
    std::mem::forget(first); // interrupted
    let w = Arc::new(S3Writer::resume(&u, &config(), &http(), size, &opts()).unwrap());
    let stored = w.stored_ranges();
    assert_eq!(stored, [0..PART, 4 * PART..5 * PART]);
    let todo = w.unstored_ranges();
    assert_eq!(todo, [(PART, 3 * PART), (5 * PART, 777)]);
    let s = Endpoint::Backend(BackendEndpoint::new("mem".into(), src));
    let d = Endpoint::Backend(BackendEndpoint::new(u.to_string(), w.clone()));
    let o = CopyOptions { ranges: Some(Arc::new(todo)), ..CopyOptions::default() };
    let r = copy(&s, &d, &o, &Progress::default()).unwrap();
    assert_eq!(r.selected_bytes, Some(3 * PART + 777));
    w.complete().unwrap();
    assert!(get("engine-resume", "r.img").unwrap() == data);
}
