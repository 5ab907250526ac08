//! The client against hostile servers: a fake NBD server written here with std sockets
//! (every byte by hand, independently of ferry-proto) misbehaves in one way per test, and
//! `ferry info` / `ferry copy` must stop with a clear error, with bounded memory, and
//! never write garbage to a destination. Also: copies to and from streams (character
//! devices, FIFOs).

use crate::common::*;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const OPT_SET_META_CONTEXT: u32 = 10;

const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_META_CONTEXT: u32 = 4;
const REP_ERR_UNSUP: u32 = 0x8000_0001;

const TFLAG_HAS_FLAGS: u16 = 1;
const TFLAG_READ_ONLY: u16 = 1 << 1;
const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

const CMD_READ: u16 = 0;
const CMD_DISC: u16 = 2;
const CMD_BLOCK_STATUS: u16 = 7;

const REPLY_FLAG_DONE: u16 = 1;
const REPLY_TYPE_NONE: u16 = 0;
const REPLY_TYPE_OFFSET_DATA: u16 = 1;
const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

const STATE_HOLE: u32 = 1;
const STATE_ZERO: u32 = 2;

/// The context id the fake server gives `base:allocation`.
const META_ID: u32 = 7;

/// Time limit for a command against a hostile server: every case here must end in
/// well under a second; a client that hangs is killed and fails the test.
const LIMIT: Duration = Duration::from_secs(20);

/// Address space a client gets (`ulimit -v`): ample for ferry, and a client that
/// accumulates what a server sends hits it (and aborts) instead of eating the machine.
const VMEM_KIB: u64 = 1 << 20;

/// A fake server on a Unix socket: every connection runs `script` on its own thread,
/// with the connection's index (0 for the first).
struct Fake {
    dir: tempfile::TempDir,
    sock: PathBuf,
}

impl Fake {
    fn start(script: impl Fn(UnixStream, usize) + Send + Sync + 'static) -> Fake {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s");
        let l = UnixListener::bind(&sock).unwrap();
        let script = Arc::new(script);
        let n = Arc::new(AtomicUsize::new(0));
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(s) = s else { return };
                let (script, i) = (script.clone(), n.fetch_add(1, Ordering::SeqCst));
                std::thread::spawn(move || script(s, i));
            }
        });
        Fake { dir, sock }
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.sock.display())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// `ferry ARGS` with its address space capped at [`VMEM_KIB`].
fn ferry_capped(args: &[&str]) -> std::process::Command {
    let mut c = std::process::Command::new("sh");
    c.arg("-c").arg(format!("ulimit -v {VMEM_KIB} && exec \"$0\" \"$@\"")).arg(ferry_bin()).args(args);
    c
}

/// Runs ferry against a hostile server: it must fail, within [`LIMIT`], saying `want`.
#[track_caller]
fn fails_saying(args: &[&str], want: &str) -> Output {
    let start = Instant::now();
    let out = run_timeout(&mut ferry_capped(args), LIMIT);
    assert!(!out.status.success(), "ferry should have failed\n{}", out.describe());
    assert!(out.stderr.contains(want), "ferry's error should say {want:?}\n{}", out.describe());
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    out
}

fn be16(v: u16) -> [u8; 2] {
    v.to_be_bytes()
}
fn be32(v: u32) -> [u8; 4] {
    v.to_be_bytes()
}
fn be64(v: u64) -> [u8; 8] {
    v.to_be_bytes()
}

/// Sends the greeting (fixed newstyle, no zeroes) and takes the client's flags.
fn greet(s: &mut UnixStream) -> std::io::Result<()> {
    let mut g = be64(NBDMAGIC).to_vec();
    g.extend(be64(IHAVEOPT));
    g.extend(be16(3));
    s.write_all(&g)?;
    let mut f = [0u8; 4];
    s.read_exact(&mut f)
}

fn read_option(s: &mut UnixStream) -> std::io::Result<(u32, Vec<u8>)> {
    let mut h = [0u8; 16];
    s.read_exact(&mut h)?;
    assert_eq!(h[..8], be64(IHAVEOPT), "option magic");
    let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
    let mut data = vec![0u8; u32::from_be_bytes(h[12..16].try_into().unwrap()) as usize];
    s.read_exact(&mut data)?;
    Ok((opt, data))
}

fn option_reply(opt: u32, typ: u32, data: &[u8]) -> Vec<u8> {
    let mut v = be64(OPT_REPLY_MAGIC).to_vec();
    v.extend(be32(opt));
    v.extend(be32(typ));
    v.extend(be32(data.len() as u32));
    v.extend_from_slice(data);
    v
}

fn info_export(size: u64, flags: u16) -> Vec<u8> {
    [&be16(0)[..], &be64(size), &be16(flags)].concat()
}

/// A dirty bitmap context [`negotiate`] grants when asked for it, and its id.
const GRANTED: &str = "qemu:dirty-bitmap:granted";
const GRANTED_ID: u32 = META_ID + 2;

/// A well-behaved handshake up to GO, with structured replies and `base:allocation`
/// (extended headers refused); `extra_info` goes out with GO's replies before the ACK.
/// Answers LIST with `list`'s bytes. Returns false if the client did not go on to
/// transmission.
fn negotiate(
    s: &mut UnixStream,
    size: u64,
    flags: u16,
    extra_info: &[Vec<u8>],
    list: &dyn Fn(&mut UnixStream),
) -> bool {
    if greet(s).is_err() {
        return false;
    }
    loop {
        let Ok((opt, data)) = read_option(s) else { return false };
        let r = match opt {
            OPT_STRUCTURED_REPLY => option_reply(opt, REP_ACK, &[]),
            OPT_SET_META_CONTEXT => {
                let mut m = be32(META_ID).to_vec();
                m.extend_from_slice(b"base:allocation");
                let mut r = option_reply(opt, REP_META_CONTEXT, &m);
                // A second context, granted only to a client asking for it.
                if data.windows(GRANTED.len()).any(|w| w == GRANTED.as_bytes()) {
                    let mut m = be32(GRANTED_ID).to_vec();
                    m.extend_from_slice(GRANTED.as_bytes());
                    r.extend(option_reply(opt, REP_META_CONTEXT, &m));
                }
                r.extend(option_reply(opt, REP_ACK, &[]));
                r
            }
            OPT_GO => {
                let mut r = option_reply(opt, REP_INFO, &info_export(size, flags | TFLAG_HAS_FLAGS));
                for i in extra_info {
                    r.extend(option_reply(opt, REP_INFO, i));
                }
                r.extend(option_reply(opt, REP_ACK, &[]));
                let _ = s.write_all(&r);
                return true;
            }
            OPT_LIST => {
                list(s);
                continue;
            }
            OPT_ABORT => return false,
            _ => option_reply(opt, REP_ERR_UNSUP, &[]),
        };
        if s.write_all(&r).is_err() {
            return false;
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Req {
    cmd: u16,
    cookie: u64,
    offset: u64,
    len: u32,
}

fn read_request(s: &mut UnixStream) -> Option<Req> {
    let mut h = [0u8; 28];
    s.read_exact(&mut h).ok()?;
    assert_eq!(h[..4], be32(REQUEST_MAGIC), "request magic (compact headers expected)");
    let r = Req {
        cmd: u16::from_be_bytes([h[6], h[7]]),
        cookie: u64::from_be_bytes(h[8..16].try_into().unwrap()),
        offset: u64::from_be_bytes(h[16..24].try_into().unwrap()),
        len: u32::from_be_bytes(h[24..28].try_into().unwrap()),
    };
    (r.cmd != CMD_DISC).then_some(r)
}

fn chunk(flags: u16, ty: u16, cookie: u64, payload: &[u8]) -> Vec<u8> {
    let mut v = be32(STRUCTURED_REPLY_MAGIC).to_vec();
    v.extend(be16(flags));
    v.extend(be16(ty));
    v.extend(be64(cookie));
    v.extend(be32(payload.len() as u32));
    v.extend_from_slice(payload);
    v
}

fn data_chunk(flags: u16, cookie: u64, offset: u64, data: &[u8]) -> Vec<u8> {
    chunk(flags, REPLY_TYPE_OFFSET_DATA, cookie, &[&be64(offset)[..], data].concat())
}

fn status_chunk(flags: u16, cookie: u64, id: u32, extents: &[(u32, u32)]) -> Vec<u8> {
    let mut p = be32(id).to_vec();
    for &(len, fl) in extents {
        p.extend(be32(len));
        p.extend(be32(fl));
    }
    chunk(flags, REPLY_TYPE_BLOCK_STATUS, cookie, &p)
}

/// A read-only export of `data` whose answers to READ and BLOCK_STATUS are `reply`'s
/// (None: the well-behaved answer).
fn export(
    data: Arc<Vec<u8>>,
    flags: u16,
    reply: impl Fn(&mut UnixStream, Req, &[u8]) -> Option<Vec<u8>> + Send + Sync + 'static,
) -> Fake {
    Fake::start(move |mut s, _| {
        if !negotiate(&mut s, data.len() as u64, TFLAG_READ_ONLY | flags, &[], &|_| {}) {
            return;
        }
        while let Some(r) = read_request(&mut s) {
            let range = r.offset as usize..r.offset as usize + r.len as usize;
            let bytes = reply(&mut s, r, &data[range.clone()]).unwrap_or_else(|| match r.cmd {
                CMD_READ => data_chunk(REPLY_FLAG_DONE, r.cookie, r.offset, &data[range]),
                CMD_BLOCK_STATUS => status_chunk(REPLY_FLAG_DONE, r.cookie, META_ID, &[(r.len, 0)]),
                _ => chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, r.cookie, &[&be32(95)[..], &be16(0)].concat()),
            });
            if s.write_all(&bytes).is_err() {
                return;
            }
        }
    })
}

/// Sends `piece` over and over until the client goes away.
fn endless(s: &mut UnixStream, piece: &[u8]) {
    let batch = piece.repeat((64 * 1024 / piece.len()).max(1));
    while s.write_all(&batch).is_ok() {}
}

fn pattern(len: usize) -> Arc<Vec<u8>> {
    Arc::new((0..len).map(|i| (i % 251) as u8 + 1).collect())
}

// ---------------------------------------------------------------------------------
// The handshake
// ---------------------------------------------------------------------------------

/// A server that answers NBD_OPT_LIST with NBD_REP_SERVER forever (once: 4.9 GB in 8 s).
#[test]
fn endless_export_list_is_cut_off() {
    let f = Fake::start(|mut s, _| {
        let _ = greet(&mut s);
        let Ok((OPT_LIST, _)) = read_option(&mut s) else { return };
        let mut e = be32(100).to_vec();
        e.extend(vec![b'n'; 100]);
        e.extend(vec![b'd'; 4000]);
        endless(&mut s, &option_reply(OPT_LIST, REP_SERVER, &e));
    });
    fails_saying(&["info", "--list", &f.uri()], "more than 10000 exports");
}

fn list_of(entries: Vec<(Vec<u8>, Vec<u8>)>) -> impl Fn(&mut UnixStream) + Send + Sync {
    move |s: &mut UnixStream| {
        let mut r = Vec::new();
        for (n, d) in &entries {
            r.extend(option_reply(OPT_LIST, REP_SERVER, &[&be32(n.len() as u32)[..], n, d].concat()));
        }
        r.extend(option_reply(OPT_LIST, REP_ACK, &[]));
        let _ = s.write_all(&r);
    }
}

/// Names and descriptions are at most 4096 bytes (the spec's NBD_MAX_STRING).
#[test]
fn list_entries_over_4096_bytes_are_refused() {
    for (name, desc) in [(vec![b'n'; 4097], vec![]), (b"ok".to_vec(), vec![b'd'; 5000])] {
        let list = list_of(vec![(name, desc)]);
        let f = Fake::start(move |mut s, _| {
            negotiate(&mut s, 1 << 20, 0, &[], &list);
        });
        fails_saying(&["info", "--list", &f.uri()], "over the protocol's limit of 4096 bytes");
    }
    // 4096 bytes is allowed.
    let list = list_of(vec![(vec![b'n'; 4096], vec![b'd'; 4096])]);
    let f = Fake::start(move |mut s, _| {
        negotiate(&mut s, 1 << 20, 0, &[], &list);
    });
    let out = run_timeout(&mut ferry_capped(&["info", "--list", "--json", &f.uri()]), LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    assert!(out.stdout.contains(&"n".repeat(4096)), "{}", out.describe());
}

/// NBD_INFO_DESCRIPTION over 4096 bytes in the reply to GO.
#[test]
fn long_info_description_is_refused() {
    let desc = [&be16(2)[..], &vec![b'd'; 8000]].concat();
    let f = Fake::start(move |mut s, _| {
        negotiate(&mut s, 1 << 20, 0, std::slice::from_ref(&desc), &|_| {});
    });
    fails_saying(&["info", &f.uri()], "over the protocol's limit of 4096 bytes");
}

/// NBD_REP_INFO answers to GO without end.
#[test]
fn endless_info_replies_are_cut_off() {
    let f = Fake::start(|mut s, _| {
        if greet(&mut s).is_err() {
            return;
        }
        while let Ok((opt, _)) = read_option(&mut s) {
            if opt == OPT_GO {
                endless(&mut s, &option_reply(opt, REP_INFO, &[&be16(2)[..], b"again"].concat()));
                return;
            }
            let _ = s.write_all(&option_reply(opt, REP_ERR_UNSUP, &[]));
        }
    });
    fails_saying(&["info", &f.uri()], "more than 64 NBD_REP_INFO replies");
}

/// A description meant for a terminal: escape sequences are shown, not obeyed.
#[test]
fn server_text_cannot_drive_the_terminal() {
    let desc = [&be16(2)[..], b"disk\x1b]0;owned\x07\x1b[2J"].concat();
    let f = Fake::start(move |mut s, _| {
        negotiate(&mut s, 1 << 20, 0, std::slice::from_ref(&desc), &|_| {});
    });
    let out = run_timeout(&mut ferry_capped(&["info", &f.uri()]), LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    assert!(out.stdout.contains("disk"), "{}", out.describe());
    assert!(!out.stdout.contains('\x1b') && !out.stdout.contains('\x07'), "{}", out.describe());
}

/// The handshake timeout covers the whole handshake: a server that sends a byte now
/// and then inside one long option reply does not hold the client forever.
#[test]
fn trickling_handshake_times_out() {
    let f = Fake::start(|mut s, _| {
        if greet(&mut s).is_err() {
            return;
        }
        let Ok((opt, _)) = read_option(&mut s) else { return };
        let reply = option_reply(opt, REP_ERR_UNSUP, &vec![b'x'; 60_000]);
        for b in reply {
            if s.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let uri = ferry_client::Uri::parse(&f.uri()).unwrap();
    let opts = ferry_client::ConnectOptions { handshake_timeout: Duration::from_secs(1), ..Default::default() };
    let start = Instant::now();
    let r = std::thread::spawn(move || ferry_client::Connection::connect(&uri, &opts).map(|_| ()));
    assert!(wait_until(Duration::from_secs(10), || r.is_finished()), "the client still waits after 10 s");
    let e = r.join().unwrap().unwrap_err();
    assert!(e.to_string().contains("did not finish the handshake"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
}

// ---------------------------------------------------------------------------------
// Transmission: READ and BLOCK_STATUS replies
// ---------------------------------------------------------------------------------

/// Copies the fake export to a file: it must fail saying `want`, and the destination
/// must not hold bytes the server did not send as the export's.
#[track_caller]
fn copy_fails(f: &Fake, data: &[u8], want: &str) {
    copy_fails_with(f, &[], data, want)
}

#[track_caller]
fn copy_fails_with(f: &Fake, extra: &[&str], data: &[u8], want: &str) {
    let dst = f.path("dst.raw");
    let uri = f.uri();
    let mut args = vec!["copy", &uri, dst.to_str().unwrap()];
    args.extend_from_slice(extra);
    fails_saying(&args, want);
    if let Ok(got) = std::fs::read(&dst) {
        // Whatever was written is the export's bytes or the file's initial zeroes.
        for (i, (&g, &w)) in got.iter().zip(data).enumerate() {
            assert!(g == w || g == 0, "byte {i} of the destination is {g}, the export's is {w}");
        }
    }
}

/// A READ reply whose data covers only part of the request, then DONE: an error, not
/// a destination with zeroes where the rest should be.
#[test]
fn partial_read_reply_fails_the_copy() {
    let data = pattern(1 << 20);
    let f = export(data.clone(), 0, |_, r, d| {
        (r.cmd == CMD_READ).then(|| data_chunk(REPLY_FLAG_DONE, r.cookie, r.offset, &d[..d.len() / 2]))
    });
    copy_fails(&f, &data, "the server sent only");
}

/// Chunks of no bytes, without end (the client kept a record of each: memory and time
/// without bound).
#[test]
fn empty_read_chunks_fail_the_copy() {
    let data = pattern(1 << 20);
    let f = export(data.clone(), 0, |s, r, _| {
        if r.cmd != CMD_READ {
            return None;
        }
        let mut hole = be64(r.offset).to_vec();
        hole.extend(be32(0));
        endless(s, &chunk(0, REPLY_TYPE_OFFSET_HOLE, r.cookie, &hole));
        Some(Vec::new())
    });
    copy_fails(&f, &data, "a chunk of no bytes");
}

/// Chunks that overlap or fall outside the request.
#[test]
fn overlapping_and_outside_read_chunks_fail_the_copy() {
    let data = pattern(1 << 20);
    let f = export(data.clone(), 0, |_, r, d| {
        (r.cmd == CMD_READ).then(|| {
            let half = d.len() / 2;
            [
                data_chunk(0, r.cookie, r.offset, &d[..half + 1]),
                data_chunk(REPLY_FLAG_DONE, r.cookie, r.offset + half as u64, &d[half..]),
            ]
            .concat()
        })
    });
    copy_fails(&f, &data, "over bytes already sent");
    let f = export(data.clone(), 0, |_, r, d| {
        (r.cmd == CMD_READ).then(|| data_chunk(REPLY_FLAG_DONE, r.cookie, r.offset + 1, d))
    });
    copy_fails(&f, &data, "past the end of the request");
}

/// A reply for a request that was never made (regression: refused before this file).
#[test]
fn reply_for_an_unknown_cookie_fails_the_copy() {
    let data = pattern(1 << 20);
    let f = export(data.clone(), 0, |_, r, d| {
        (r.cmd == CMD_READ).then(|| data_chunk(REPLY_FLAG_DONE, r.cookie + 1000, r.offset, d))
    });
    copy_fails(&f, &data, "reply for unknown cookie");
}

/// A reply that never ends: NONE chunks without DONE, and error chunks without DONE.
#[test]
fn replies_without_done_fail_the_copy() {
    let data = pattern(1 << 20);
    let f = export(data.clone(), 0, |s, r, _| {
        (r.cmd == CMD_READ).then(|| {
            endless(s, &chunk(0, REPLY_TYPE_NONE, r.cookie, &[]));
            Vec::new()
        })
    });
    copy_fails(&f, &data, "a NONE chunk must be empty and the last of its reply");
    let f = export(data.clone(), 0, |s, r, _| {
        (r.cmd == CMD_READ).then(|| {
            endless(s, &chunk(0, REPLY_TYPE_ERROR, r.cookie, &[&be32(5)[..], &be16(3), b"eio"].concat()));
            Vec::new()
        })
    });
    copy_fails(&f, &data, "more than 4096 error chunks");
}

/// Two `base:allocation` chunks in one reply: appended, the second would shift the
/// map (here: data from 64 KiB on taken for zeroes and never read).
#[test]
fn duplicate_block_status_chunks_fail_the_copy() {
    let data = pattern(1 << 20);
    let f = export(data.clone(), 0, |_, r, _| {
        (r.cmd == CMD_BLOCK_STATUS).then(|| {
            [
                status_chunk(0, r.cookie, META_ID, &[(64 << 10, 0)]),
                status_chunk(REPLY_FLAG_DONE, r.cookie, META_ID, &[(r.len, STATE_HOLE | STATE_ZERO)]),
            ]
            .concat()
        })
    });
    copy_fails(&f, &data, "two block status chunks");
    // A context that was never negotiated.
    let f = export(data.clone(), 0, |_, r, _| {
        (r.cmd == CMD_BLOCK_STATUS).then(|| status_chunk(REPLY_FLAG_DONE, r.cookie, META_ID + 1, &[(r.len, 0)]))
    });
    copy_fails(&f, &data, "which was not negotiated");
}

/// Block status extents of no length (which would never advance a map) or starting past
/// the end of the request: the server's fault, named, for a copy and for `info --map`.
#[test]
fn empty_and_overlong_block_status_extents_are_refused() {
    let data = pattern(1 << 20);
    let zero_len = export(data.clone(), 0, |_, r, _| {
        (r.cmd == CMD_BLOCK_STATUS)
            .then(|| status_chunk(REPLY_FLAG_DONE, r.cookie, META_ID, &[(4096, 0), (0, 0), (r.len - 4096, 0)]))
    });
    copy_fails(&zero_len, &data, "zero-length extent");
    fails_saying(&["info", "--map", &zero_len.uri()], "zero-length extent");
    let past = export(data.clone(), 0, |_, r, _| {
        (r.cmd == CMD_BLOCK_STATUS).then(|| status_chunk(REPLY_FLAG_DONE, r.cookie, META_ID, &[(r.len, 0), (4096, 3)]))
    });
    copy_fails(&past, &data, "goes past the end");
    fails_saying(&["info", "--map", "--json", &past.uri()], "goes past the end");
    // Only the last extent may run past the request: it is clipped.
    let long_last = export(data.clone(), 0, |_, r, _| {
        (r.cmd == CMD_BLOCK_STATUS).then(|| status_chunk(REPLY_FLAG_DONE, r.cookie, META_ID, &[(r.len + 4096, 0)]))
    });
    let out = run_timeout(&mut ferry_capped(&["info", "--map", &long_last.uri()]), LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    assert_eq!(out.stdout, format!("{:>10}  {:>10}  {:>3}  data\n", 0, 1 << 20, 0));
}

/// A context the server did not grant: named, with what the server says it offers
/// (this one cannot list them), never a map of something else.
#[test]
fn contexts_the_server_does_not_grant_are_named() {
    let data = pattern(1 << 20);
    let f = export(data.clone(), 0, |_, _, _| None);
    let out = fails_saying(&["info", "--map=qemu:dirty-bitmap:b0", &f.uri()], "qemu:dirty-bitmap:b0");
    assert!(out.stderr.contains("does not offer"), "{}", out.describe());
    let dst = f.path("dst.raw");
    std::fs::write(&dst, vec![9u8; data.len()]).unwrap();
    fails_saying(&["copy", "--dirty-bitmap", "b0", &f.uri(), dst.to_str().unwrap()], "does not offer");
    assert_eq!(std::fs::read(&dst).unwrap(), vec![9u8; data.len()], "nothing written");
}

/// Several contexts in one reply: each checked on its own (a missing one, one sent
/// twice, one with a bad extent: named), and read side by side when they are right.
#[test]
fn several_contexts_are_each_checked() {
    let data = pattern(1 << 20);
    let both = |bitmap: Vec<Vec<u8>>| {
        let bitmap = Arc::new(bitmap);
        export(data.clone(), 0, move |_, r, _| {
            (r.cmd == CMD_BLOCK_STATUS).then(|| {
                let mut v = status_chunk(0, r.cookie, META_ID, &[(r.len / 2, 0), (r.len / 2, 3)]);
                for c in bitmap.iter() {
                    v.extend_from_slice(c);
                }
                v.extend(chunk(REPLY_FLAG_DONE, REPLY_TYPE_NONE, r.cookie, &[]));
                v
            })
        })
    };
    let dirty = |c: u64, ex: &[(u32, u32)]| status_chunk(0, c, GRANTED_ID, ex);
    let map = ["info", "--map", "--map=qemu:dirty-bitmap:granted"];
    // The cookie of the first BLOCK_STATUS is 1 (ferry's cookies count from 1).
    let ok = both(vec![dirty(1, &[(4096, 0), ((1 << 20) - 4096, 1)])]);
    let mut args = map.to_vec();
    let uri = ok.uri();
    args.push(&uri);
    let out = run_timeout(&mut ferry_capped(&args), LIMIT);
    assert!(out.status.success(), "{}", out.describe());
    let want = [
        format!("{:>10}  {:>10}  {:>3}  {:<9}  {:>3}  clean", 0, 4096, 0, "data", 0),
        format!("{:>10}  {:>10}  {:>3}  {:<9}  {:>3}  dirty", 4096, (1 << 19) - 4096, 0, "data", 1),
        format!("{:>10}  {:>10}  {:>3}  {:<9}  {:>3}  dirty", 1 << 19, 1 << 19, 3, "hole,zero", 1),
    ]
    .join("\n")
        + "\n";
    assert_eq!(out.stdout, want);
    for (chunks, why) in [
        (vec![], "no extents for qemu:dirty-bitmap:granted"),
        (
            vec![dirty(1, &[(1 << 20, 1)]), dirty(1, &[(1 << 20, 1)])],
            "two block status chunks for one context (qemu:dirty-bitmap:granted)",
        ),
        (
            vec![dirty(1, &[(4096, 1), (0, 1)])],
            "block status for qemu:dirty-bitmap:granted at offset 0 has a zero-length extent",
        ),
        (vec![status_chunk(0, 1, GRANTED_ID + 1, &[(1 << 20, 1)])], "which was not negotiated"),
    ] {
        let f = both(chunks);
        let uri = f.uri();
        let mut args = map.to_vec();
        args.push(&uri);
        fails_saying(&args, why);
    }
}

/// An allocation map in 1-byte pieces (a block status reply of a million extents, again
/// and again): the copy's map is coarsened, not grown by 24 bytes per byte of the export.
#[test]
fn fragmented_block_status_is_coarsened() {
    let len = 40usize << 20;
    let data: Arc<Vec<u8>> = Arc::new((0..len).map(|i| if i % 2 == 1 { 0 } else { (i % 251) as u8 + 1 }).collect());
    let f = export(data.clone(), 0, |_, r, _| {
        (r.cmd == CMD_BLOCK_STATUS).then(|| {
            let n = (r.len as u64).min(1 << 20) as u32;
            let ex: Vec<(u32, u32)> =
                (0..n).map(|i| (1, if (r.offset + u64::from(i)) % 2 == 1 { STATE_ZERO } else { 0 })).collect();
            status_chunk(REPLY_FLAG_DONE, r.cookie, META_ID, &ex)
        })
    });
    let dst = f.path("dst.raw");
    let out = ferry(&["copy", &f.uri(), dst.to_str().unwrap()]);
    assert!(out.status.success(), "{}", out.describe());
    assert_file_eq(&dst, &data);
}

/// Each connection to a multi-conn export claims another size.
#[test]
fn export_size_that_changes_between_connections() {
    let f = Fake::start(|mut s, i| {
        let size = (1 << 20) * (i as u64 + 1);
        if !negotiate(&mut s, size, TFLAG_READ_ONLY | TFLAG_CAN_MULTI_CONN, &[], &|_| {}) {
            return;
        }
        while let Some(r) = read_request(&mut s) {
            let reply = match r.cmd {
                CMD_READ => data_chunk(REPLY_FLAG_DONE, r.cookie, r.offset, &vec![1u8; r.len as usize]),
                _ => status_chunk(REPLY_FLAG_DONE, r.cookie, META_ID, &[(r.len, 0)]),
            };
            if s.write_all(&reply).is_err() {
                return;
            }
        }
    });
    copy_fails_with(
        &f,
        &["-C", "2"],
        &[1u8; 1 << 20],
        "the export was 1048576 bytes on one connection and 2097152 on another",
    );
}

// ---------------------------------------------------------------------------------
// Streams: character devices and FIFOs
// ---------------------------------------------------------------------------------

fn ferry(args: &[&str]) -> Output {
    run_timeout(&mut ferry_capped(args), LIMIT)
}

fn mkfifo(p: &Path) {
    run_ok(&mut cmd("mkfifo", [p]));
}

#[test]
fn copy_to_dev_null() {
    let dir = tempfile::tempdir().unwrap();
    let raw = write_sparse_file(dir.path(), "a.raw", &data_with_holes(3 << 20, 1));
    let out = ferry(&["copy", raw.to_str().unwrap(), "/dev/null"]);
    assert!(out.status.success(), "{}", out.describe());
    require("qemu-img");
    let q = dir.path().join("a.qcow2");
    run_ok(&mut cmd("qemu-img", ["convert", "-f", "raw", "-O", "qcow2", raw.to_str().unwrap(), q.to_str().unwrap()]));
    let out = ferry(&["copy", q.to_str().unwrap(), "/dev/null"]);
    assert!(out.status.success(), "{}", out.describe());
    // Another character device: /dev/full takes nothing, and says so.
    let out = ferry(&["copy", raw.to_str().unwrap(), "/dev/full"]);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(out.stderr.contains("No space left on device"), "{}", out.describe());
    // /dev/null itself is left a character device.
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata("/dev/null").unwrap().file_type().is_char_device());
}

/// To a FIFO: every byte in order, holes written as zeroes.
#[test]
fn copy_to_a_fifo() {
    let dir = tempfile::tempdir().unwrap();
    let data = data_with_holes(5 << 20, 2);
    let raw = write_sparse_file(dir.path(), "a.raw", &data);
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            let mut v = Vec::new();
            std::fs::File::open(&fifo).unwrap().read_to_end(&mut v).unwrap();
            v
        })
    };
    let out = ferry(&["copy", raw.to_str().unwrap(), fifo.to_str().unwrap()]);
    assert!(out.status.success(), "{}", out.describe());
    assert_same_bytes(&reader.join().unwrap(), &data, "bytes read from the FIFO");
}

/// From a FIFO: read to its end, like stdin.
#[test]
fn copy_from_a_fifo() {
    let dir = tempfile::tempdir().unwrap();
    let data = data_with_holes(3 << 20, 3);
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    let writer = {
        let (fifo, data) = (fifo.clone(), data.clone());
        std::thread::spawn(move || {
            std::fs::OpenOptions::new().write(true).open(&fifo).unwrap().write_all(&data).unwrap()
        })
    };
    let dst = dir.path().join("out.raw");
    let out = ferry(&["copy", fifo.to_str().unwrap(), dst.to_str().unwrap()]);
    assert!(out.status.success(), "{}", out.describe());
    writer.join().unwrap();
    assert_file_eq(&dst, &data);
}

/// A character device as a source has no size (and /dev/zero no end): refused, where
/// it once copied nothing and said nothing.
#[test]
fn copy_from_a_character_device_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join("out.raw");
    let out = ferry(&["copy", "/dev/zero", dst.to_str().unwrap()]);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(out.stderr.contains("character device"), "{}", out.describe());
    // Refused before a new image is made: no empty qcow2 is left behind.
    let q = dir.path().join("out.qcow2");
    let out = ferry(&["copy", "/dev/zero", q.to_str().unwrap()]);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(out.stderr.contains("character device"), "{}", out.describe());
    assert!(!q.exists(), "an image was created for a source that was refused");
}
