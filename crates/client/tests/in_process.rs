//! The client against ferry's own server, in one process: every command, pipelining,
//! all three reply modes.

use ferry_backend::MemoryBackend;
use ferry_client::{ConnectOptions, Connection, Payload, Submit, Uri};
use ferry_proto::consts::*;
use ferry_server::{Config, Export, Exports, Server};
use ferry_sock::Listener;
use std::sync::Arc;

struct Running {
    _dir: tempfile::TempDir,
    uri: Uri,
    handle: ferry_server::ShutdownHandle,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.handle.shutdown();
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

fn serve(size: u64) -> Running {
    serve_backend(Arc::new(MemoryBackend::new(size)), tempfile::tempdir().unwrap())
}

fn serve_backend(backend: Arc<dyn ferry_backend::Backend>, dir: tempfile::TempDir) -> Running {
    let path = dir.path().join("s");
    let mut exports = Exports::new();
    exports.add(Export { name: String::new(), description: "in-process".into(), backend }).unwrap();
    let mut server = Server::new(exports, Config::default()).unwrap();
    let handle = server.shutdown_handle();
    let listener = Listener::bind_unix(&path).unwrap();
    let thread = std::thread::spawn(move || server.run(&[listener]).unwrap());
    let uri = Uri::parse(&format!("nbd+unix:///?socket={}", path.display())).unwrap();
    Running { _dir: dir, uri, handle, thread: Some(thread) }
}

fn modes() -> Vec<ConnectOptions> {
    let ext = ConnectOptions::default();
    let structured = ConnectOptions { extended: false, ..ConnectOptions::default() };
    let simple = ConnectOptions { extended: false, structured: false, ..ConnectOptions::default() };
    vec![ext, structured, simple]
}

#[test]
fn every_command_in_every_reply_mode() {
    let srv = serve(8 << 20);
    for opts in modes() {
        let mut c = Connection::connect(&srv.uri, &opts).unwrap();
        assert_eq!(c.size(), 8 << 20);
        assert!(c.has_flag(FLAG_CAN_MULTI_CONN));
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 253) as u8 + 1).collect();
        c.pwrite(&data, 1 << 20, false).unwrap();
        let mut back = vec![0u8; data.len()];
        c.pread(&mut back, 1 << 20).unwrap();
        assert_eq!(back, data);
        // a read spanning hole and data (sparse chunks with structured replies)
        let mut span = vec![9u8; 1 << 20];
        c.pread(&mut span, 512 * 1024).unwrap();
        assert!(span[..512 * 1024].iter().all(|&b| b == 0));
        assert_eq!(&span[512 * 1024..512 * 1024 + data.len()], &data[..]);
        c.zero(1 << 20, 4096, true).unwrap();
        c.trim(2 << 20, 1 << 20).unwrap();
        c.flush().unwrap();
        c.pread(&mut back, 1 << 20).unwrap();
        assert!(back[..4096].iter().all(|&b| b == 0));
        assert_eq!(&back[4096..], &data[4096..]);
        if c.can_block_status() {
            let ex = c.block_status(0, 8 << 20).unwrap();
            assert_eq!(ex[0].flags & STATE_HOLE, STATE_HOLE);
            assert!(ex.iter().any(|e| e.flags == 0));
        }
        // errors come back per request and the connection goes on
        let mut tail = vec![0u8; 10];
        let err = c.pread(&mut tail, (8 << 20) - 5).unwrap_err().to_string();
        assert!(err.contains("EINVAL"), "{err}");
        let err = c.pwrite(&[1; 10], (8 << 20) - 5, false).unwrap_err().to_string();
        assert!(err.contains("ENOSPC"), "{err}");
        c.pread(&mut back, 1 << 20).unwrap();
        c.disconnect().unwrap();
    }
}

#[test]
fn many_requests_in_flight() {
    let srv = serve(16 << 20);
    let mut c = Connection::connect(&srv.uri, &ConnectOptions::default()).unwrap();
    let blocks: Vec<Vec<u8>> = (0..64u8).map(|i| vec![i.wrapping_mul(3).wrapping_add(1); 65536]).collect();
    let subs: Vec<Submit> = blocks
        .iter()
        .enumerate()
        .map(|(i, b)| Submit {
            cmd: CMD_WRITE,
            flags: 0,
            offset: i as u64 * 65536,
            length: 0,
            payload: Some(Payload::Bytes(b)),
            slot: i,
        })
        .collect();
    c.submit(&subs).unwrap();
    for _ in 0..64 {
        assert!(c.receive(&mut []).unwrap().result.is_ok());
    }
    let mut bufs: Vec<Vec<u8>> = (0..64).map(|_| vec![0u8; 65536]).collect();
    let reads: Vec<Submit> = (0..64)
        .map(|i| Submit { cmd: CMD_READ, flags: 0, offset: i as u64 * 65536, length: 65536, payload: None, slot: i })
        .collect();
    c.submit(&reads).unwrap();
    let mut seen = 0;
    while seen < 64 {
        let done = c.receive(&mut bufs).unwrap();
        assert!(done.result.is_ok());
        assert_eq!(bufs[done.slot], blocks[done.slot]);
        seen += 1;
    }
    assert_eq!(c.in_flight(), 0);
}

#[test]
fn list_and_unknown_export() {
    let srv = serve(1 << 20);
    let l = Connection::list(&srv.uri, &ConnectOptions::default()).unwrap();
    assert_eq!(l, vec![(String::new(), "in-process".to_string())]);
    let mut u = srv.uri.clone();
    u.export = "missing".into();
    let e = Connection::connect(&u, &ConnectOptions::default()).err().unwrap().to_string();
    assert!(e.contains("no such export"), "{e}");
}

#[test]
fn file_export_reads_with_sendfile_and_holes() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img");
    let mut content = vec![0u8; 4 << 20];
    for (i, b) in content[1 << 20..(1 << 20) + 300_000].iter_mut().enumerate() {
        *b = (i % 241) as u8 + 1;
    }
    for (i, b) in content[3 << 20..].iter_mut().enumerate() {
        *b = (i % 13) as u8 + 7;
    }
    std::fs::write(&img, &content).unwrap();
    // punch the zero ranges so the file really has holes
    let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
    let punch = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
    let _ = rustix::fs::fallocate(&f, punch, 0, 1 << 20);
    let _ = rustix::fs::fallocate(&f, punch, 2 << 20, 1 << 20);
    let backend = Arc::new(ferry_backend::FileBackend::open(&img, false).unwrap());
    let srv = serve_backend(backend, dir);
    for opts in modes() {
        let mut c = Connection::connect(&srv.uri, &opts).unwrap();
        for (off, len) in [(0u64, 4usize << 20), (1 << 20, 300_000), (100, 70_000), ((3 << 20) + 5, 500_000)] {
            let mut buf = vec![0xAAu8; len];
            c.pread(&mut buf, off).unwrap();
            assert!(buf == content[off as usize..off as usize + len], "mismatch at {off}+{len} with {opts:?}");
        }
    }
}

/// Large WRITEs into a file export, in one batch: a small write whose successor's payload
/// partly arrives in the same read, payloads from memory and from a file (sendfile), FUA,
/// and a write past the end whose payload must still be consumed, so the requests after
/// it stay in step.
#[test]
fn file_export_large_writes_in_every_mode() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img");
    let size = 4usize << 20;
    std::fs::write(&img, vec![0u8; size]).unwrap();
    let src_path = dir.path().join("src");
    let src_bytes: Vec<u8> = (0..1_000_000u32).map(|i| (i % 239) as u8 + 3).collect();
    std::fs::write(&src_path, &src_bytes).unwrap();
    let src = std::fs::File::open(&src_path).unwrap();
    let backend = Arc::new(ferry_backend::FileBackend::open(&img, false).unwrap());
    let srv = serve_backend(backend, dir);
    let mut want = vec![0u8; size];
    for (round, opts) in modes().into_iter().enumerate() {
        let mut c = Connection::connect(&srv.uri, &opts).unwrap();
        assert!(c.can_send_file());
        let fill = |n: usize, k: usize| -> Vec<u8> { (0..n).map(|i| ((i * 31 + k * 7 + round) % 251) as u8).collect() };
        let small = fill(1000, 1);
        let big = fill(700_000, 2);
        let fua = fill(300_000, 3);
        let past_end = fill(200_000, 4);
        let after = fill(100_000, 5);
        use std::os::fd::AsFd;
        let file_payload = Payload::File { fd: src.as_fd(), offset: 12_345, len: 600_000 };
        fn w(offset: u64, flags: u16, payload: Payload<'_>, slot: usize) -> Submit<'_> {
            Submit { cmd: CMD_WRITE, flags, offset, length: payload.len() as u64, payload: Some(payload), slot }
        }
        let subs = vec![
            w(10, 0, Payload::Bytes(&small), 0),
            w(5000, 0, Payload::Bytes(&big), 1),
            w(1 << 20, 0, file_payload, 2),
            w(2 << 20, CMD_FLAG_FUA, Payload::Bytes(&fua), 3),
            w(size as u64 - 100_000, 0, Payload::Bytes(&past_end), 4),
            w(3 << 20, 0, Payload::Bytes(&after), 5),
        ];
        c.submit(&subs).unwrap();
        let mut results = vec![None; subs.len()];
        for _ in 0..subs.len() {
            let done = c.receive(&mut []).unwrap();
            results[done.slot] = Some(done.result.is_ok());
        }
        assert_eq!(results, [true, true, true, true, false, true].map(Some), "{opts:?}");
        let mut expect = |offset: usize, bytes: &[u8]| want[offset..offset + bytes.len()].copy_from_slice(bytes);
        expect(10, &small);
        expect(5000, &big);
        expect(1 << 20, &src_bytes[12_345..12_345 + 600_000]);
        expect(2 << 20, &fua);
        expect(3 << 20, &after);
        let mut back = vec![0u8; size];
        c.pread(&mut back, 0).unwrap();
        assert!(back == want, "file contents differ with {opts:?}");
    }
}

/// A file payload that cannot be sent whole (the file is shorter than the range) fails
/// the submit, and the connection is closed rather than left out of step: the next call
/// fails at once instead of the server taking it for payload bytes.
#[test]
fn a_failed_file_payload_closes_the_connection() {
    let srv = serve(1 << 20);
    let dir = tempfile::tempdir().unwrap();
    let short = dir.path().join("short");
    std::fs::write(&short, vec![1u8; 1000]).unwrap();
    let f = std::fs::File::open(&short).unwrap();
    let mut c = Connection::connect(&srv.uri, &ConnectOptions::default()).unwrap();
    use std::os::fd::AsFd;
    let payload = Payload::File { fd: f.as_fd(), offset: 0, len: 100_000 };
    let w = Submit { cmd: CMD_WRITE, flags: 0, offset: 0, length: 100_000, payload: Some(payload), slot: 0 };
    let e = c.submit(&[w]).unwrap_err().to_string();
    assert!(e.contains("truncated"), "{e}");
    let mut buf = vec![0u8; 4096];
    assert!(c.pread(&mut buf, 0).is_err(), "a connection out of step was used again");
}

/// Memory behind a request queue that records how many reads were in flight at each
/// submission and fails every read at [`Queued::BAD`]. Its queue carries out each request
/// only when the server asks for the result, and never reports one done before that, so
/// the server has to wait for every request it answers.
struct Queued {
    inner: Arc<MemoryBackend>,
    depths: Arc<std::sync::Mutex<Vec<usize>>>,
    /// WRITEs that went through the queue.
    writes: Arc<std::sync::atomic::AtomicUsize>,
}

impl Queued {
    const BAD: u64 = 3 << 16;

    fn read_at(inner: &MemoryBackend, buf: &mut [u8], offset: u64) -> ferry_backend::Result<()> {
        if offset == Self::BAD {
            return Err(ferry_backend::Error::new(ferry_backend::ErrorKind::Io, "read", offset, buf.len() as u64));
        }
        ferry_backend::Backend::read(inner, buf, offset)
    }
}

struct LazyQueue {
    inner: Arc<MemoryBackend>,
    depths: Arc<std::sync::Mutex<Vec<usize>>>,
    writes: Arc<std::sync::atomic::AtomicUsize>,
    /// Buffer, offset, and whether it is a write.
    reqs: std::collections::VecDeque<(Vec<u8>, u64, bool)>,
}

impl ferry_backend::IoQueue for LazyQueue {
    fn submit_read(&mut self, buf: Vec<u8>, offset: u64) {
        self.reqs.push_back((buf, offset, false));
        self.depths.lock().unwrap().push(self.reqs.len());
    }
    fn submit_write(&mut self, buf: Vec<u8>, offset: u64) {
        self.reqs.push_back((buf, offset, true));
        self.writes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    fn len(&self) -> usize {
        self.reqs.len()
    }
    fn oldest_done(&self) -> bool {
        false
    }
    fn complete(&mut self) -> Option<(Vec<u8>, ferry_backend::Result<()>)> {
        let (mut buf, offset, write) = self.reqs.pop_front()?;
        let r = if write {
            ferry_backend::Backend::write(&*self.inner, &buf, offset, false)
        } else {
            Queued::read_at(&self.inner, &mut buf, offset)
        };
        Some((buf, r))
    }
}

impl ferry_backend::Backend for Queued {
    fn describe(&self) -> String {
        "queued".into()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn caps(&self) -> ferry_backend::Capabilities {
        self.inner.caps()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> ferry_backend::Result<()> {
        Self::read_at(&self.inner, buf, offset)
    }
    fn io_queue(&self) -> Option<Box<dyn ferry_backend::IoQueue>> {
        Some(Box::new(LazyQueue {
            inner: self.inner.clone(),
            depths: self.depths.clone(),
            writes: self.writes.clone(),
            reqs: Default::default(),
        }))
    }
    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> ferry_backend::Result<()> {
        self.inner.write(buf, offset, fua)
    }
    fn flush(&self) -> ferry_backend::Result<()> {
        self.inner.flush()
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> ferry_backend::Result<()> {
        self.inner.trim(offset, length, fua)
    }
    fn zero(&self, offset: u64, length: u64, mode: ferry_backend::ZeroMode, fua: bool) -> ferry_backend::Result<()> {
        self.inner.zero(offset, length, mode, fua)
    }
}

#[test]
fn queued_reads_answer_every_request() {
    let size = 1u64 << 20;
    let backend = Arc::new(Queued {
        inner: Arc::new(MemoryBackend::new(size)),
        depths: Default::default(),
        writes: Default::default(),
    });
    let srv = serve_backend(backend.clone(), tempfile::tempdir().unwrap());
    let image: Vec<u8> = (0..size as u32).map(|i| (i * 31 % 251) as u8).collect();
    for opts in modes() {
        let mut c = Connection::connect(&srv.uri, &opts).unwrap();
        c.pwrite(&image, 0, false).unwrap();
        backend.depths.lock().unwrap().clear();
        // 8 reads, one failing in the backend, one past the end (refused before the
        // backend), a WRITE in the middle (executed beside the reads), lengths that differ.
        let len = |i: usize| 1000 + i * 4096;
        let mut subs: Vec<Submit> = (0..8)
            .map(|i| Submit {
                cmd: CMD_READ,
                flags: 0,
                offset: i as u64 * 65536,
                length: len(i) as u64,
                payload: None,
                slot: i,
            })
            .collect();
        subs.insert(5, Submit { cmd: CMD_READ, flags: 0, offset: size - 10, length: 20, payload: None, slot: 8 });
        // The WRITE overlaps no read: requests in flight together have no order.
        let patch = [7u8; 100];
        let at = 600_000;
        subs.insert(
            7,
            Submit {
                cmd: CMD_WRITE,
                flags: 0,
                offset: at,
                length: 100,
                payload: Some(Payload::Bytes(&patch)),
                slot: 9,
            },
        );
        c.submit(&subs).unwrap();
        let mut bufs: Vec<Vec<u8>> = (0..9).map(|i| vec![0u8; if i < 8 { len(i) } else { 20 }]).collect();
        let mut ok = [None; 10];
        for _ in 0..subs.len() {
            let done = c.receive(&mut bufs).unwrap();
            ok[done.slot] = Some(done.result.is_ok());
        }
        for i in 0..8 {
            let off = i * 65536;
            if off as u64 == Queued::BAD {
                assert_eq!(ok[i], Some(false), "{opts:?}");
            } else {
                assert_eq!(ok[i], Some(true), "{opts:?}");
                assert!(bufs[i] == image[off..off + len(i)], "read {i} differs with {opts:?}");
            }
        }
        assert_eq!(ok[8], Some(false), "past the end: {opts:?}");
        assert_eq!(ok[9], Some(true), "{opts:?}");
        let depths = backend.depths.lock().unwrap().clone();
        assert_eq!(depths.len(), 8, "every valid READ goes through the queue: {depths:?} {opts:?}");
        assert!(depths.iter().any(|&n| n > 1), "no two reads were in flight together: {depths:?} {opts:?}");
        let mut got = vec![0u8; 100];
        c.pread(&mut got, at).unwrap();
        assert_eq!(got, patch, "{opts:?}");
        assert!(backend.writes.load(std::sync::atomic::Ordering::SeqCst) > 0, "the WRITE went through the queue");
        c.pwrite(&image[at as usize..at as usize + 100], at, false).unwrap();
    }
}
