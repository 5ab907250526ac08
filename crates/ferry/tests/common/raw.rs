//! A minimal raw NBD client for the robustness tests: every byte on the wire is
//! written here by hand (independently of ferry-proto, so a bug there cannot hide
//! itself), including deliberately broken handshakes and requests.

use super::{assert_same_bytes, Rng, Server, Stream};
use std::io::{ErrorKind, Read, Write};
use std::time::{Duration, Instant};

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

pub const FLAG_FIXED_NEWSTYLE: u16 = 1;
pub const FLAG_NO_ZEROES: u16 = 2;
pub const CFLAG_FIXED_NEWSTYLE: u32 = 1;
pub const CFLAG_NO_ZEROES: u32 = 2;

pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_ERR_UNSUP: u32 = 0x8000_0001;
pub const REP_ERR_UNKNOWN: u32 = 0x8000_0006;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

pub const CMD_FLAG_FUA: u16 = 1 << 0;

pub const REPLY_FLAG_DONE: u16 = 1;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;

pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;

pub struct RawClient {
    pub s: Stream,
}

/// One reply to an option.
#[derive(Debug)]
pub struct OptReply {
    pub opt: u32,
    pub typ: u32,
    pub data: Vec<u8>,
}

/// One structured/extended reply chunk.
#[derive(Debug)]
pub struct Chunk {
    pub flags: u16,
    pub typ: u16,
    pub cookie: u64,
    pub payload: Vec<u8>,
}

impl RawClient {
    /// Connects (no bytes exchanged yet).
    pub fn connect(server: &Server) -> RawClient {
        RawClient { s: server.connect().expect("connect to server") }
    }

    /// Connects and completes a fixed-newstyle handshake with NBD_OPT_EXPORT_NAME
    /// for the default export. Returns (client, size, transmission flags).
    pub fn handshake(server: &Server) -> (RawClient, u64, u16) {
        let mut c = RawClient::connect(server);
        let gflags = c.read_greeting();
        assert_ne!(gflags & FLAG_FIXED_NEWSTYLE, 0, "server must offer fixed newstyle");
        c.send_client_flags(CFLAG_FIXED_NEWSTYLE | (gflags as u32 & CFLAG_NO_ZEROES));
        let (size, flags) = c.export_name("", gflags & FLAG_NO_ZEROES != 0);
        (c, size, flags)
    }

    /// Like [`handshake`] but reports failure (e.g. the server closed the connection)
    /// instead of panicking.
    pub fn try_handshake(server: &Server) -> Result<(RawClient, u64, u16), String> {
        let s = server.connect().map_err(|e| format!("connect: {e}"))?;
        let mut c = RawClient { s };
        let mut g = [0u8; 18];
        c.s.read_exact(&mut g).map_err(|e| format!("greeting: {e}"))?;
        if g[..8] != NBDMAGIC.to_be_bytes() || g[8..16] != IHAVEOPT.to_be_bytes() {
            return Err(format!("bad greeting {g:02x?}"));
        }
        let gflags = u16::from_be_bytes([g[16], g[17]]);
        let no_zeroes = gflags & FLAG_NO_ZEROES != 0;
        let cflags = CFLAG_FIXED_NEWSTYLE | if no_zeroes { CFLAG_NO_ZEROES } else { 0 };
        let mut out = cflags.to_be_bytes().to_vec();
        out.extend(Self::option_bytes(OPT_EXPORT_NAME, b""));
        c.s.write_all(&out).map_err(|e| format!("sending options: {e}"))?;
        let mut r = vec![0u8; if no_zeroes { 10 } else { 134 }];
        c.s.read_exact(&mut r).map_err(|e| format!("export reply: {e}"))?;
        let size = u64::from_be_bytes(r[..8].try_into().unwrap());
        let flags = u16::from_be_bytes([r[8], r[9]]);
        Ok((c, size, flags))
    }

    /// Like [`try_handshake`], retried for up to `timeout` (a connection that just left,
    /// such as the readiness probe's, may take a moment to be forgotten by a limit).
    pub fn handshake_within(server: &Server, timeout: Duration) -> Option<RawClient> {
        let deadline = Instant::now() + timeout;
        loop {
            match Self::try_handshake(server) {
                Ok((c, _, _)) => return Some(c),
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
                Err(_) => return None,
            }
        }
    }

    pub fn set_timeout(&self, d: Duration) {
        self.s.set_read_timeout(Some(d));
        self.s.set_write_timeout(Some(d));
    }

    pub fn read_exact_buf(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.s.read_exact(&mut v).unwrap_or_else(|e| panic!("reading {n} bytes from server: {e}"));
        v
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.read_exact_buf(2).try_into().unwrap())
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.read_exact_buf(4).try_into().unwrap())
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.read_exact_buf(8).try_into().unwrap())
    }

    pub fn send(&mut self, b: &[u8]) {
        self.s.write_all(b).unwrap_or_else(|e| panic!("sending {} bytes to server: {e}", b.len()));
    }

    /// Like [`send`] but reports errors (for when the server may have hung up).
    pub fn try_send(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.s.write_all(b)
    }

    /// Reads the 18-byte greeting, checks the magics, returns the handshake flags.
    pub fn read_greeting(&mut self) -> u16 {
        let m = self.u64();
        assert_eq!(m, NBDMAGIC, "bad NBDMAGIC in greeting");
        let m = self.u64();
        assert_eq!(m, IHAVEOPT, "server must speak newstyle (IHAVEOPT)");
        self.u16()
    }

    pub fn send_client_flags(&mut self, f: u32) {
        self.send(&f.to_be_bytes());
    }

    pub fn option_bytes(opt: u32, data: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(16 + data.len());
        v.extend_from_slice(&IHAVEOPT.to_be_bytes());
        v.extend_from_slice(&opt.to_be_bytes());
        v.extend_from_slice(&(data.len() as u32).to_be_bytes());
        v.extend_from_slice(data);
        v
    }

    pub fn send_option(&mut self, opt: u32, data: &[u8]) {
        let v = Self::option_bytes(opt, data);
        self.send(&v);
    }

    pub fn read_opt_reply(&mut self) -> OptReply {
        let m = self.u64();
        assert_eq!(m, OPT_REPLY_MAGIC, "bad option reply magic {m:#x}");
        let opt = self.u32();
        let typ = self.u32();
        let len = self.u32();
        assert!(len <= 1 << 20, "absurd option reply length {len}");
        let data = self.read_exact_buf(len as usize);
        OptReply { opt, typ, data }
    }

    /// NBD_OPT_EXPORT_NAME; returns (size, transmission flags).
    pub fn export_name(&mut self, name: &str, no_zeroes: bool) -> (u64, u16) {
        self.send_option(OPT_EXPORT_NAME, name.as_bytes());
        let size = self.u64();
        let flags = self.u16();
        if !no_zeroes {
            let z = self.read_exact_buf(124);
            assert!(z.iter().all(|&b| b == 0), "the 124 padding bytes must be zero");
        }
        (size, flags)
    }

    /// NBD_OPT_GO for `name` (no info requests). Returns (size, flags) on success or
    /// the error reply type.
    pub fn go(&mut self, name: &str) -> Result<(u64, u16), u32> {
        let mut d = Vec::new();
        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        self.send_option(OPT_GO, &d);
        let mut export = None;
        loop {
            let r = self.read_opt_reply();
            assert_eq!(r.opt, OPT_GO, "reply to the wrong option");
            match r.typ {
                REP_ACK => return Ok(export.expect("GO acked without NBD_INFO_EXPORT")),
                REP_INFO => {
                    let t = u16::from_be_bytes([r.data[0], r.data[1]]);
                    if t == 0 {
                        assert_eq!(r.data.len(), 12, "NBD_INFO_EXPORT is 12 bytes");
                        let size = u64::from_be_bytes(r.data[2..10].try_into().unwrap());
                        let flags = u16::from_be_bytes([r.data[10], r.data[11]]);
                        export = Some((size, flags));
                    }
                }
                t if t & 0x8000_0000 != 0 => return Err(t),
                t => panic!("unexpected reply type {t:#x} to GO"),
            }
        }
    }

    pub fn request_bytes(flags: u16, typ: u16, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
        let mut v = Vec::with_capacity(28);
        v.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        v.extend_from_slice(&flags.to_be_bytes());
        v.extend_from_slice(&typ.to_be_bytes());
        v.extend_from_slice(&cookie.to_be_bytes());
        v.extend_from_slice(&offset.to_be_bytes());
        v.extend_from_slice(&len.to_be_bytes());
        v
    }

    /// A 32-byte request (after NBD_OPT_EXTENDED_HEADERS).
    pub fn ext_request_bytes(flags: u16, typ: u16, cookie: u64, offset: u64, len: u64) -> Vec<u8> {
        let mut v = Vec::with_capacity(32);
        v.extend_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
        v.extend_from_slice(&flags.to_be_bytes());
        v.extend_from_slice(&typ.to_be_bytes());
        v.extend_from_slice(&cookie.to_be_bytes());
        v.extend_from_slice(&offset.to_be_bytes());
        v.extend_from_slice(&len.to_be_bytes());
        v
    }

    pub fn send_request(&mut self, flags: u16, typ: u16, cookie: u64, offset: u64, len: u32) {
        let v = Self::request_bytes(flags, typ, cookie, offset, len);
        self.send(&v);
    }

    /// Reads a simple reply header: (error, cookie).
    pub fn read_simple_reply(&mut self) -> (u32, u64) {
        let m = self.u32();
        assert_eq!(m, SIMPLE_REPLY_MAGIC, "expected a simple reply, got magic {m:#x}");
        let err = self.u32();
        let cookie = self.u64();
        (err, cookie)
    }

    /// WRITE (simple replies); returns the error code.
    pub fn write(&mut self, offset: u64, data: &[u8], flags: u16) -> u32 {
        let cookie = 0x5752_4954_4500_0000 ^ offset;
        let mut v = Self::request_bytes(flags, CMD_WRITE, cookie, offset, data.len() as u32);
        v.extend_from_slice(data);
        self.send(&v);
        let (err, c) = self.read_simple_reply();
        assert_eq!(c, cookie, "reply cookie does not match the request");
        err
    }

    /// READ (simple replies); returns the data or the error code.
    pub fn read(&mut self, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
        let cookie = 0x5245_4144_0000_0000 ^ offset;
        self.send_request(0, CMD_READ, cookie, offset, len);
        let (err, c) = self.read_simple_reply();
        assert_eq!(c, cookie, "reply cookie does not match the request");
        if err != 0 {
            return Err(err);
        }
        Ok(self.read_exact_buf(len as usize))
    }

    /// A command without payload in either direction; returns the error code.
    pub fn simple_cmd(&mut self, flags: u16, typ: u16, offset: u64, len: u32) -> u32 {
        let cookie = 0x434d_4400_0000_0000 ^ ((typ as u64) << 32) ^ offset;
        self.send_request(flags, typ, cookie, offset, len);
        let (err, c) = self.read_simple_reply();
        assert_eq!(c, cookie, "reply cookie does not match the request");
        err
    }

    /// Sends NBD_CMD_DISC.
    pub fn disconnect(&mut self) {
        let v = Self::request_bytes(0, CMD_DISC, 0xd15c, 0, 0);
        let _ = self.try_send(&v);
    }

    /// Reads an extended reply chunk header and payload.
    pub fn read_extended_chunk(&mut self) -> Chunk {
        let m = self.u32();
        assert_eq!(m, EXTENDED_REPLY_MAGIC, "expected an extended reply, got magic {m:#x}");
        let flags = self.u16();
        let typ = self.u16();
        let cookie = self.u64();
        let _offset = self.u64();
        let len = self.u64();
        assert!(len <= 64 << 20, "absurd reply payload length {len}");
        let payload = self.read_exact_buf(len as usize);
        Chunk { flags, typ, cookie, payload }
    }

    /// Returns true if the server closes the connection (EOF or reset) within
    /// `timeout`, discarding whatever it sends before; false if it is still open.
    pub fn closed_within(&mut self, timeout: Duration) -> bool {
        wait_closed(&mut self.s, timeout)
    }
}

/// See [`RawClient::closed_within`].
pub fn wait_closed(s: &mut Stream, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 65536];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))));
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return false,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return true, // reset by peer
        }
    }
}

/// Writes then reads back 256 KiB at `offset` on an established raw connection.
#[track_caller]
pub fn io_roundtrip(c: &mut RawClient, offset: u64, seed: u64) {
    let data = Rng::new(seed).bytes(256 * 1024);
    assert_eq!(c.write(offset, &data, 0), 0, "write at {offset} failed");
    let got = c.read(offset, data.len() as u32).unwrap_or_else(|e| panic!("read at {offset} failed: errno {e}"));
    assert_same_bytes(&got, &data, "read back over a raw connection");
}

/// A fresh client completes the handshake and does I/O.
#[track_caller]
pub fn fresh_client_works(server: &Server, offset: u64, seed: u64) {
    let (mut c, _, _) = RawClient::handshake(server);
    io_roundtrip(&mut c, offset, seed);
    c.disconnect();
}
