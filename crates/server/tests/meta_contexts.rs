//! Several metadata contexts on one export, served in process: a test backend offers
//! two fake contexts (and a third that always fails) beside base:allocation.
//!
//! * python3-libnbd (compact headers, structured replies): LIST with and without
//!   namespace queries, several contexts selected, a BLOCK_STATUS callback per context,
//!   REQ_ONE, extents clipped to the request.
//! * a raw client (extended headers): the context filter payload, a failing context
//!   ending the reply with an error chunk, bad filters refused with EINVAL while the
//!   connection goes on.

use ferry_backend::{Backend, Capabilities, Error, ErrorKind, Extent, MemoryBackend, MetaContext, Result, ZeroMode};
use ferry_proto::consts::*;
use ferry_proto::handshake::encode_option;
use ferry_proto::options::{encode_info_request, encode_meta_request};
use ferry_proto::reply::{parse_block_status, parse_error_chunk, ReplyHeader, ReplyMode};
use ferry_proto::RequestHeader;
use ferry_server::{Config, Export, Exports, Server};
use ferry_sock::Listener;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

const SIZE: u64 = 1 << 20;
const STRIPE: u64 = 64 * 1024;

/// `test:stripes`: 64 KiB stripes, odd ones flagged 1. It answers whole stripes, the
/// last one past the end of the request: the server must clip it.
struct Stripes;
impl MetaContext for Stripes {
    fn name(&self) -> &str {
        "test:stripes"
    }
    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> Result<()> {
        let mut pos = offset;
        while pos < offset + length && out.len() < max {
            let end = (pos / STRIPE + 1) * STRIPE;
            out.push(Extent { length: end - pos, flags: ((pos / STRIPE) % 2) as u32 });
            pos = end;
        }
        Ok(())
    }
}

/// `test:depth`: one value (7) everywhere.
struct Seven;
impl MetaContext for Seven {
    fn name(&self) -> &str {
        "test:depth"
    }
    fn extents(&self, _offset: u64, length: u64, _max: usize, out: &mut Vec<Extent>) -> Result<()> {
        out.push(Extent { length, flags: 7 });
        Ok(())
    }
}

/// `test:broken`: every call fails.
struct Broken;
impl MetaContext for Broken {
    fn name(&self) -> &str {
        "test:broken"
    }
    fn extents(&self, offset: u64, length: u64, _max: usize, _out: &mut Vec<Extent>) -> Result<()> {
        Err(Error::new(ErrorKind::Io, "test:broken extents", offset, length))
    }
}

/// A memory disk whose backend offers the three test contexts.
struct Fake(MemoryBackend);
impl Backend for Fake {
    fn describe(&self) -> String {
        "fake contexts".into()
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn caps(&self) -> Capabilities {
        self.0.caps()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.0.read(buf, offset)
    }
    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.0.write(buf, offset, fua)
    }
    fn flush(&self) -> Result<()> {
        self.0.flush()
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.0.trim(offset, length, fua)
    }
    fn zero(&self, offset: u64, length: u64, mode: ZeroMode, fua: bool) -> Result<()> {
        self.0.zero(offset, length, mode, fua)
    }
    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> Result<()> {
        self.0.extents(offset, length, max, out)
    }
    fn meta_contexts(self: Arc<Self>) -> Vec<Arc<dyn MetaContext>> {
        vec![Arc::new(Stripes), Arc::new(Broken), Arc::new(Seven)]
    }
}

struct Running {
    dir: tempfile::TempDir,
    handle: ferry_server::ShutdownHandle,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Running {
    fn socket(&self) -> PathBuf {
        self.dir.path().join("s")
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.handle.shutdown();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve() -> Running {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(Fake(MemoryBackend::new(SIZE)));
    // 128 KiB of data at 256 KiB: base:allocation has something to say.
    backend.write(&vec![0xa5; 128 * 1024], 256 * 1024, false).unwrap();
    let mut exports = Exports::new();
    exports.add(Export { name: String::new(), description: "meta".into(), backend }).unwrap();
    let mut server = Server::new(exports, Config::default()).unwrap();
    let handle = server.shutdown_handle();
    let listener = Listener::bind_unix(&dir.path().join("s")).unwrap();
    let thread = std::thread::spawn(move || server.run(&[listener]).unwrap());
    Running { dir, handle, thread: Some(thread) }
}

const PY: &str = r#"
import nbd, sys, json
sock = sys.argv[1]
out = {}
h = nbd.NBD()
h.set_opt_mode(True)
h.connect_unix(sock)
for q in [[], ["test:"], ["base:"], ["test:depth", "nope:x", "test:stripes"]]:
    h.clear_meta_contexts()
    for c in q:
        h.add_meta_context(c)
    names = []
    h.opt_list_meta_context(lambda n: names.append(n) or 0)
    out["list " + ",".join(q)] = names
h.clear_meta_contexts()
for c in [nbd.CONTEXT_BASE_ALLOCATION, "test:stripes", "test:depth", "unknown:ctx"]:
    h.add_meta_context(c)
h.opt_go()
out["granted"] = [c for c in [nbd.CONTEXT_BASE_ALLOCATION, "test:stripes", "test:depth", "unknown:ctx"]
                  if h.can_meta_context(c)]
def status(count, offset, flags=0):
    got = {}
    def cb(ctx, off, entries, err):
        got.setdefault(ctx, []).append([off] + list(entries))
        return 0
    h.block_status(count, offset, cb, flags)
    return got
out["whole"] = status(1 << 20, 0)
# From the middle of a stripe, ending in the middle of one: clipped to the request.
out["middle"] = status(100000, 200000)
out["req_one"] = status((1 << 20) - 32768, 32768, nbd.CMD_FLAG_REQ_ONE)
h.shutdown()
print(json.dumps(out))
"#;

#[test]
fn libnbd_reads_several_contexts() {
    let srv = serve();
    let out = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(PY)
        .arg(srv.socket())
        .output()
        .expect("python3 with libnbd (python3-libnbd) is required");
    assert!(out.status.success(), "python3-libnbd failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let names = |k: &str| -> Vec<String> { serde_json::from_value(v[k].clone()).unwrap() };
    let numbers = |v: &serde_json::Value| -> Vec<Vec<u64>> { serde_json::from_value(v.clone()).unwrap() };
    assert_eq!(names("list "), ["base:allocation", "test:stripes", "test:broken", "test:depth"]);
    assert_eq!(names("list test:"), ["test:stripes", "test:broken", "test:depth"]);
    assert_eq!(names("list base:"), ["base:allocation"]);
    assert_eq!(names("list test:depth,nope:x,test:stripes"), ["test:stripes", "test:depth"]);
    assert_eq!(names("granted"), ["base:allocation", "test:stripes", "test:depth"]);

    let whole = &v["whole"];
    // base:allocation: hole, data at [256K, 384K), hole.
    let hz = u64::from(STATE_HOLE | STATE_ZERO);
    assert_eq!(numbers(&whole["base:allocation"]), vec![vec![0, 262144, hz, 131072, 0, 655360, hz]]);
    let mut want = vec![0];
    want.extend((0..16).flat_map(|i| [STRIPE, i % 2]));
    assert_eq!(numbers(&whole["test:stripes"]), vec![want]);
    assert_eq!(numbers(&whole["test:depth"]), vec![vec![0, SIZE, 7]]);

    // [200000, 300000): stripe 3 (odd) from 200000 to 262144, then stripe 4 clipped.
    let middle = &v["middle"];
    assert_eq!(numbers(&middle["test:stripes"]), vec![vec![200000, 62144, 1, 37856, 0]]);
    assert_eq!(numbers(&middle["test:depth"]), vec![vec![200000, 100000, 7]]);
    assert_eq!(numbers(&middle["base:allocation"]), vec![vec![200000, 62144, hz, 37856, 0]]);

    let one = &v["req_one"];
    assert_eq!(numbers(&one["test:stripes"]), vec![vec![32768, 32768, 0]]);
    assert_eq!(numbers(&one["test:depth"]), vec![vec![32768, SIZE - 32768, 7]]);
    assert_eq!(numbers(&one["base:allocation"]), vec![vec![32768, 262144 - 32768, hz]]);
}

/// A minimal raw client speaking extended headers.
struct Raw {
    s: UnixStream,
}

impl Raw {
    fn connect(path: &std::path::Path) -> Raw {
        let mut s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).unwrap();
        s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
        Raw { s }
    }

    /// Sends an option and reads replies up to the final one: (type, data) of each.
    fn option(&mut self, opt: u32, data: &[u8]) -> Vec<(u32, Vec<u8>)> {
        let mut b = Vec::new();
        encode_option(opt, data, &mut b);
        self.s.write_all(&b).unwrap();
        let mut all = Vec::new();
        loop {
            let mut h = [0u8; 20];
            self.s.read_exact(&mut h).unwrap();
            let ty = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
            let mut d = vec![0u8; len];
            self.s.read_exact(&mut d).unwrap();
            all.push((ty, d));
            if ty != REP_META_CONTEXT && ty != REP_INFO && ty != REP_SERVER {
                return all;
            }
        }
    }

    /// Sends a request and reads its reply chunks up to DONE: (type, flags, payload).
    fn request(&mut self, h: RequestHeader, payload: &[u8]) -> Vec<(u16, u16, Vec<u8>)> {
        let mut b = Vec::new();
        h.encode(true, &mut b);
        b.extend_from_slice(payload);
        self.s.write_all(&b).unwrap();
        let mut chunks = Vec::new();
        loop {
            let mut hdr = [0u8; EXTENDED_REPLY_LEN];
            self.s.read_exact(&mut hdr).unwrap();
            let (ReplyHeader::Chunk { flags, ty, cookie, length }, _) =
                ReplyHeader::parse(&hdr, ReplyMode::Extended).unwrap().unwrap()
            else {
                panic!("simple reply with extended headers")
            };
            assert_eq!(cookie, h.cookie);
            let mut p = vec![0u8; length as usize];
            self.s.read_exact(&mut p).unwrap();
            chunks.push((ty, flags, p));
            if flags & REPLY_FLAG_DONE != 0 {
                return chunks;
            }
        }
    }
}

fn filter(effect: u64, ids: &[u32]) -> Vec<u8> {
    let mut p = effect.to_be_bytes().to_vec();
    for id in ids {
        p.extend_from_slice(&id.to_be_bytes());
    }
    p
}

/// (context id, extents) of a block status chunk.
fn status(ty: u16, p: &[u8]) -> (u32, Vec<(u64, u32)>) {
    let mut ex = Vec::new();
    let id = parse_block_status(ty, p, &mut ex).unwrap();
    (id, ex.iter().map(|e| (e.length, e.flags)).collect())
}

#[test]
fn extended_headers_filter_and_failing_context() {
    let srv = serve();
    let mut c = Raw::connect(&srv.socket());
    assert_eq!(c.option(OPT_EXTENDED_HEADERS, &[])[0].0, REP_ACK);
    let mut m = Vec::new();
    encode_meta_request("", &["test:depth", "base:allocation", "test:broken", "test:stripes", "test:none"], &mut m);
    let set = c.option(OPT_SET_META_CONTEXT, &m);
    let ids: Vec<(u32, String)> = set
        .iter()
        .filter(|(ty, _)| *ty == REP_META_CONTEXT)
        .map(|(_, d)| (u32::from_be_bytes(d[..4].try_into().unwrap()), String::from_utf8(d[4..].to_vec()).unwrap()))
        .collect();
    let names: Vec<&str> = ids.iter().map(|(_, n)| n.as_str()).collect();
    assert_eq!(names, ["base:allocation", "test:stripes", "test:broken", "test:depth"]);
    let id = |n: &str| ids.iter().find(|(_, m)| m == n).unwrap().0;
    let mut g = Vec::new();
    encode_info_request("", &[], &mut g);
    let go = c.option(OPT_GO, &g);
    let info = &go.iter().find(|(ty, d)| *ty == REP_INFO && d[..2] == INFO_EXPORT.to_be_bytes()).unwrap().1;
    let flags = u16::from_be_bytes([info[10], info[11]]);
    assert_ne!(flags & FLAG_BLOCK_STATUS_PAYLOAD, 0, "context filter offered with extended headers");
    assert_eq!(go.last().unwrap().0, REP_ACK);

    let bs = |cookie: u64, offset: u64, p: &[u8]| RequestHeader {
        flags: CMD_FLAG_PAYLOAD_LEN,
        cmd: CMD_BLOCK_STATUS,
        cookie,
        offset,
        length: p.len() as u64,
    };
    // Two contexts by filter, in the export's order whatever the payload's.
    let p = filter(256 * 1024, &[id("test:depth"), id("test:stripes")]);
    let r = c.request(bs(1, 0, &p), &p);
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].1, 0, "DONE only on the last chunk");
    assert_eq!(status(r[0].0, &r[0].2), (id("test:stripes"), vec![(STRIPE, 0), (STRIPE, 1), (STRIPE, 0), (STRIPE, 1)]));
    assert_eq!(r[1].1, REPLY_FLAG_DONE);
    assert_eq!(status(r[1].0, &r[1].2), (id("test:depth"), vec![(256 * 1024, 7)]));

    // Without a filter: every context until the failing one, whose error ends the reply.
    let r = c.request(RequestHeader { flags: 0, cmd: CMD_BLOCK_STATUS, cookie: 2, offset: 0, length: SIZE }, &[]);
    assert_eq!(r.len(), 3, "{r:?}");
    assert_eq!(status(r[0].0, &r[0].2).0, id("base:allocation"));
    assert_eq!(status(r[1].0, &r[1].2).0, id("test:stripes"));
    assert_eq!(r[2].0, REPLY_TYPE_ERROR);
    let (err, msg, _) = parse_error_chunk(r[2].0, &r[2].2).unwrap();
    assert_eq!(err, NbdError::Io.code());
    assert!(msg.contains("test:broken"), "{msg}");

    // Bad filters: EINVAL, and the connection goes on.
    for (cookie, p) in [
        (3, filter(4096, &[999])),
        (4, filter(4096, &[id("test:depth"), id("test:depth")])),
        (5, filter(0, &[id("test:depth")])),
        (6, filter(SIZE + 4096, &[id("test:depth")])),
        (7, filter(4096, &[])),
    ] {
        let r = c.request(bs(cookie, 0, &p), &p);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].0, REPLY_TYPE_ERROR, "{p:?}");
        assert_eq!(parse_error_chunk(r[0].0, &r[0].2).unwrap().0, NbdError::Inval.code());
    }
    // REQ_ONE with a filter: one extent per context.
    let p = filter(SIZE - 4096, &[id("test:stripes"), id("base:allocation")]);
    let mut h = bs(8, 4096, &p);
    h.flags |= CMD_FLAG_REQ_ONE;
    let r = c.request(h, &p);
    assert_eq!(status(r[0].0, &r[0].2), (id("base:allocation"), vec![(256 * 1024 - 4096, STATE_HOLE | STATE_ZERO)]));
    assert_eq!(status(r[1].0, &r[1].2), (id("test:stripes"), vec![(STRIPE - 4096, 0)]));
    let mut b = Vec::new();
    RequestHeader { flags: 0, cmd: CMD_DISC, cookie: 9, offset: 0, length: 0 }.encode(true, &mut b);
    c.s.write_all(&b).unwrap();
}
