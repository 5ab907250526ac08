//! A backend whose request queue answers reads at once (a served snapshot's cached
//! chunks): the server sends those answers as it goes, not only once it has read every
//! request the client sent. Answered only at the end, client and server took turns, each
//! idle while the other worked (half the IOPS: docs/benchmarks-history.md §31 (speed)).

use ferry_backend::{Backend, Capabilities, IoQueue, MemoryBackend, Result, ZeroMode};
use ferry_proto::consts::*;
use ferry_proto::handshake::encode_option;
use ferry_proto::RequestHeader;
use ferry_server::{Config, Export, Exports, Server};
use ferry_sock::Listener;
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const SIZE: u64 = 1 << 20;

/// Reads answered as they are submitted; `backlog` is the most reads ever submitted
/// and not yet taken back by the server.
struct AtOnce {
    mem: MemoryBackend,
    backlog: Arc<AtomicUsize>,
}

struct Queue {
    mem: Arc<AtOnce>,
    done: VecDeque<(Vec<u8>, Result<()>)>,
}

impl IoQueue for Queue {
    fn submit_read(&mut self, mut buf: Vec<u8>, offset: u64) {
        let r = self.mem.mem.read(&mut buf, offset);
        self.done.push_back((buf, r));
        self.mem.backlog.fetch_max(self.done.len(), Ordering::SeqCst);
    }
    fn submit_write(&mut self, buf: Vec<u8>, offset: u64) {
        let r = self.mem.mem.write(&buf, offset, false);
        self.done.push_back((buf, r));
    }
    fn len(&self) -> usize {
        self.done.len()
    }
    fn oldest_done(&self) -> bool {
        !self.done.is_empty()
    }
    fn complete(&mut self) -> Option<(Vec<u8>, Result<()>)> {
        self.done.pop_front()
    }
}

struct Shared(Arc<AtOnce>);

impl Backend for Shared {
    fn describe(&self) -> String {
        "at-once".into()
    }
    fn size(&self) -> u64 {
        SIZE
    }
    fn caps(&self) -> Capabilities {
        self.0.mem.caps()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.0.mem.read(buf, offset)
    }
    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.0.mem.write(buf, offset, fua)
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.0.mem.trim(offset, length, fua)
    }
    fn zero(&self, offset: u64, length: u64, mode: ZeroMode, fua: bool) -> Result<()> {
        self.0.mem.zero(offset, length, mode, fua)
    }
    fn io_queue(&self) -> Option<Box<dyn IoQueue>> {
        Some(Box::new(Queue { mem: self.0.clone(), done: VecDeque::new() }))
    }
}

#[test]
fn reads_answered_at_once_go_out_as_the_server_goes() {
    let dir = tempfile::tempdir().unwrap();
    let at_once = Arc::new(AtOnce { mem: MemoryBackend::new(SIZE), backlog: Arc::new(AtomicUsize::new(0)) });
    let data: Vec<u8> = (0..SIZE as usize).map(|i| (i / 4096) as u8 ^ (i % 251) as u8).collect();
    at_once.mem.write(&data, 0, false).unwrap();
    let mut exports = Exports::new();
    let backend = Arc::new(Shared(at_once.clone()));
    exports.add(Export { name: String::new(), description: "q".into(), backend }).unwrap();
    let mut server = Server::new(exports, Config::default()).unwrap();
    let handle = server.shutdown_handle();
    let listener = Listener::bind_unix(&dir.path().join("s")).unwrap();
    let thread = std::thread::spawn(move || server.run(&[listener]).unwrap());

    let mut s = UnixStream::connect(dir.path().join("s")).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
    let mut b = Vec::new();
    encode_option(OPT_EXPORT_NAME, b"", &mut b);
    s.write_all(&b).unwrap();
    let mut export = [0u8; 10];
    s.read_exact(&mut export).unwrap();
    assert_eq!(u64::from_be_bytes(export[..8].try_into().unwrap()), SIZE);
    // 64 reads of 4 KiB in one write: the server finds them all received at once.
    let mut b = Vec::new();
    for i in 0..64u64 {
        let h = RequestHeader { flags: 0, cmd: CMD_READ, cookie: i, offset: (i * 7 % 256) * 4096, length: 4096 };
        h.encode(false, &mut b);
    }
    s.write_all(&b).unwrap();
    for i in 0..64u64 {
        let mut hdr = [0u8; 16];
        s.read_exact(&mut hdr).unwrap();
        assert_eq!(u32::from_be_bytes(hdr[4..8].try_into().unwrap()), 0, "read {i} failed");
        assert_eq!(u64::from_be_bytes(hdr[8..16].try_into().unwrap()), i, "replies in order");
        let mut d = vec![0u8; 4096];
        s.read_exact(&mut d).unwrap();
        let o = ((i * 7 % 256) * 4096) as usize;
        assert!(d[..] == data[o..o + 4096], "read {i}");
    }
    drop(s);
    handle.shutdown();
    thread.join().unwrap();
    // Each answer was taken back before the next request was submitted (on main all 64
    // were submitted first).
    let backlog = at_once.backlog.load(Ordering::SeqCst);
    assert!(backlog <= 2, "{backlog} reads answered at once waited for the server to read on");
}
