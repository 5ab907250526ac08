//! A [`Backend`] as a `ferry copy` source and destination: memory to memory, memory to a
//! file and an NBD server and back, holes skipped, zero extents written as zeroes, a
//! small or read-only destination refused before anything is written.

use ferry_backend::{Backend, Capabilities, Extent, MemoryBackend, ReadOnly, ZeroMode};
use ferry_client::copy::{copy, BackendEndpoint, CopyOptions, Endpoint, Progress};
use ferry_client::Uri;
use ferry_server::{Config, Export, Exports, Server};
use ferry_sock::Listener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

/// 8 MiB: data at 0..1M, a hole at 1M..3M, data (with a zero 256K block inside) at 3M..5M,
/// a hole to 7.5M, data to the end.
fn source() -> (Arc<MemoryBackend>, Vec<u8>) {
    let size = 8 * MIB;
    let mut want = vec![0u8; size as usize];
    for (i, b) in want.iter_mut().enumerate() {
        let at = i as u64;
        let data = at < MIB || (3 * MIB..5 * MIB).contains(&at) && !(4 * MIB..4 * MIB + (256 << 10)).contains(&at);
        if data || at >= 7 * MIB + MIB / 2 {
            *b = (i % 251) as u8 + 1;
        }
    }
    let m = Arc::new(MemoryBackend::new(size));
    m.write(&want, 0, false).unwrap();
    m.zero(MIB, 2 * MIB, ZeroMode { may_trim: true, fast: false }, false).unwrap();
    m.zero(5 * MIB, 2 * MIB + MIB / 2, ZeroMode { may_trim: true, fast: false }, false).unwrap();
    (m, want)
}

fn read_all(b: &dyn Backend) -> Vec<u8> {
    let mut v = vec![0u8; b.size() as usize];
    b.read(&mut v, 0).unwrap();
    v
}

fn ep(name: &str, b: Arc<dyn Backend>) -> Endpoint {
    Endpoint::Backend(BackendEndpoint::new(name.into(), b))
}

/// Counts what reaches the backend it wraps.
struct Counting {
    inner: MemoryBackend,
    written: AtomicU64,
    zeroed: AtomicU64,
    zero: bool,
    /// Reports its allocation map (else all data, the trait's default).
    map: bool,
}

impl Backend for Counting {
    fn describe(&self) -> String {
        "counting".into()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn caps(&self) -> Capabilities {
        Capabilities { zero: self.zero, ..self.inner.caps() }
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> ferry_backend::Result<()> {
        self.inner.read(buf, offset)
    }
    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> ferry_backend::Result<()> {
        self.written.fetch_add(buf.len() as u64, Ordering::SeqCst);
        self.inner.write(buf, offset, fua)
    }
    fn flush(&self) -> ferry_backend::Result<()> {
        self.inner.flush()
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> ferry_backend::Result<()> {
        self.inner.trim(offset, length, fua)
    }
    fn zero(&self, offset: u64, length: u64, mode: ZeroMode, fua: bool) -> ferry_backend::Result<()> {
        assert!(self.zero, "zero called on a backend that did not declare it");
        assert!(mode.may_trim && !mode.fast);
        self.zeroed.fetch_add(length, Ordering::SeqCst);
        self.inner.zero(offset, length, mode, fua)
    }
    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> ferry_backend::Result<()> {
        match self.map {
            true => self.inner.extents(offset, length, max, out),
            false => {
                out.push(Extent { length, flags: 0 });
                Ok(())
            }
        }
    }
}

fn counting(size: u64, zero: bool) -> Arc<Counting> {
    let c = Counting { inner: MemoryBackend::new(size), written: 0.into(), zeroed: 0.into(), zero, map: true };
    // Old contents everywhere: every zero the copy skips would show.
    c.inner.write(&vec![0xAA; size as usize], 0, false).unwrap();
    Arc::new(c)
}

#[test]
fn backend_to_backend_skips_holes_and_zeroes_them() {
    let (src, want) = source();
    for zero in [true, false] {
        for connections in [1, 3] {
            let dst = counting(10 * MIB, zero);
            let opts = CopyOptions { connections, flush: true, ..CopyOptions::default() };
            let r =
                copy(&ep("mem-src", src.clone()), &ep("mem-dst", dst.clone()), &opts, &Progress::default()).unwrap();
            let back = read_all(&*dst);
            assert!(back[..want.len()] == want[..], "zero {zero}, {connections} connection(s): content differs");
            assert!(back[want.len()..].iter().all(|&b| b == 0xAA), "wrote past the source's end");
            // The memory backend keeps no zero chunks: the zero block is a hole too.
            assert_eq!((r.bytes, r.hole_bytes, r.zero_bytes), (8 * MIB, 4 * MIB + MIB / 2 + (256 << 10), 0));
            assert_eq!(r.data_bytes, 8 * MIB - r.hole_bytes - r.zero_bytes);
            assert_eq!(r.connections, connections);
            // Holes and the zero block went as zeroes, not data, where the backend can zero.
            let (w, z) = (dst.written.load(Ordering::SeqCst), dst.zeroed.load(Ordering::SeqCst));
            if zero {
                assert_eq!((w, z), (r.data_bytes, r.hole_bytes + r.zero_bytes));
            } else {
                assert_eq!((w, z), (8 * MIB, 0));
            }
        }
    }
}

#[test]
fn a_source_without_a_map_has_its_zeroes_detected() {
    let (src, want) = source();
    let unmapped = counting(8 * MIB, true);
    unmapped.inner.write(&want, 0, false).unwrap();
    let unmapped = Arc::new(Counting { map: false, ..Arc::into_inner(unmapped).unwrap() });
    drop(src);
    let dst = counting(8 * MIB, true);
    let r = copy(&ep("unmapped", unmapped), &ep("dst", dst.clone()), &CopyOptions::default(), &Progress::default())
        .unwrap();
    assert!(read_all(&*dst) == want);
    assert_eq!((r.hole_bytes, r.zero_bytes), (0, 4 * MIB + MIB / 2 + (256 << 10)));
    assert_eq!(dst.zeroed.load(Ordering::SeqCst), r.zero_bytes);
}

#[test]
fn the_hash_of_a_backend_is_the_hash_of_its_bytes() {
    let (src, want) = source();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("same.img");
    std::fs::write(&file, &want).unwrap();
    let hash = |e: &Endpoint| {
        let h = Arc::new(ferry_hash::BlockHasher::new(ferry_hash::Algorithm::Sha256, 64 << 10));
        let opts = CopyOptions { hash: Some(h), ..CopyOptions::default() };
        copy(e, &Endpoint::Null, &opts, &Progress::default()).unwrap().digest.unwrap()
    };
    assert_eq!(hash(&ep("src", src)), hash(&Endpoint::File(file)));
}

#[test]
fn a_zeroed_destination_gets_no_zeroes() {
    let (src, want) = source();
    let dst = counting(8 * MIB, true);
    dst.inner.zero(0, 8 * MIB, ZeroMode::default(), false).unwrap();
    let d = Endpoint::Backend(BackendEndpoint::new("fresh".into(), dst.clone()).zeroed());
    let r = copy(&ep("src", src), &d, &CopyOptions::default(), &Progress::default()).unwrap();
    assert!(read_all(&*dst) == want);
    assert_eq!(dst.zeroed.load(Ordering::SeqCst), 0);
    assert_eq!(dst.written.load(Ordering::SeqCst), r.data_bytes);
}

#[test]
fn backend_to_file_and_nbd_and_back() {
    let (src, want) = source();
    let dir = tempfile::tempdir().unwrap();
    // Backend -> file -> backend.
    let file = dir.path().join("out.img");
    copy(&ep("src", src.clone()), &Endpoint::File(file.clone()), &CopyOptions::default(), &Progress::default())
        .unwrap();
    assert!(std::fs::read(&file).unwrap() == want);
    let back = Arc::new(MemoryBackend::new(8 * MIB));
    copy(&Endpoint::File(file), &ep("back", back.clone()), &CopyOptions::default(), &Progress::default()).unwrap();
    assert!(read_all(&*back) == want);
    // Backend -> NBD server -> backend.
    let served = Arc::new(MemoryBackend::new(8 * MIB));
    let sock = dir.path().join("s");
    let mut exports = Exports::new();
    exports.add(Export { name: String::new(), description: "t".into(), backend: served.clone() }).unwrap();
    let mut server = Server::new(exports, Config::default()).unwrap();
    let handle = server.shutdown_handle();
    let listener = Listener::bind_unix(&sock).unwrap();
    let thread = std::thread::spawn(move || server.run(&[listener]).unwrap());
    let uri = Uri::parse(&format!("nbd+unix:///?socket={}", sock.display())).unwrap();
    copy(&ep("src", src), &Endpoint::Nbd(uri.clone()), &CopyOptions::default(), &Progress::default()).unwrap();
    assert!(read_all(&*served) == want);
    let back = Arc::new(MemoryBackend::new(8 * MIB));
    let r =
        copy(&Endpoint::Nbd(uri), &ep("back", back.clone()), &CopyOptions::default(), &Progress::default()).unwrap();
    assert!(read_all(&*back) == want);
    assert!(r.hole_bytes > 0, "the NBD source's holes were read");
    handle.shutdown();
    thread.join().unwrap();
}

#[test]
fn small_or_read_only_destinations_are_refused_untouched() {
    let (src, _) = source();
    let small = counting(8 * MIB - 512, true);
    let e =
        copy(&ep("src", src.clone()), &ep("small.img", small.clone()), &CopyOptions::default(), &Progress::default())
            .unwrap_err()
            .to_string();
    assert!(e.contains("small.img") && e.contains("smaller than the 8388608-byte source"), "{e}");
    assert_eq!(small.written.load(Ordering::SeqCst) + small.zeroed.load(Ordering::SeqCst), 0);
    let ro: Arc<dyn Backend> = Arc::new(ReadOnly(Arc::new(MemoryBackend::new(8 * MIB))));
    let e = copy(&ep("src", src), &ep("ro.img", ro), &CopyOptions::default(), &Progress::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("ro.img is read-only"), "{e}");
}

/// Reads fail from 2 MiB on.
struct FailingReads(MemoryBackend);

impl Backend for FailingReads {
    fn describe(&self) -> String {
        "failing".into()
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn caps(&self) -> Capabilities {
        self.0.caps()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> ferry_backend::Result<()> {
        if offset >= 2 * MIB {
            return Err(ferry_backend::Error::new(ferry_backend::ErrorKind::Io, "read", offset, buf.len() as u64));
        }
        self.0.read(buf, offset)
    }
    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> ferry_backend::Result<()> {
        self.0.write(buf, offset, fua)
    }
    fn flush(&self) -> ferry_backend::Result<()> {
        Ok(())
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> ferry_backend::Result<()> {
        self.0.trim(offset, length, fua)
    }
    fn zero(&self, offset: u64, length: u64, mode: ZeroMode, fua: bool) -> ferry_backend::Result<()> {
        self.0.zero(offset, length, mode, fua)
    }
}

#[test]
fn a_failed_backend_read_names_its_range() {
    let src = FailingReads(MemoryBackend::new(4 * MIB));
    src.0.write(&vec![7u8; 4 * MIB as usize], 0, false).unwrap();
    let opts = CopyOptions { connections: 1, requests: 1, ..CopyOptions::default() };
    let e = copy(&ep("bad", Arc::new(src)), &Endpoint::Null, &opts, &Progress::default()).unwrap_err().to_string();
    assert!(e.starts_with("read at offset 2097152 (1048576 bytes) failed"), "{e}");
}
