//! Transmission-phase replies: encoders that write headers into a caller's buffer.
//! Payload bytes are never copied here; the caller sends them from their own buffer
//! right after the header, in the same vectored send.
//! (proto.md "Simple reply message", "Structured reply chunk message",
//! "Extended reply chunk message", "Structured reply types")

use crate::consts::*;

/// Which reply headers the client negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyMode {
    /// Neither structured replies nor extended headers: 16-byte simple replies only.
    Simple,
    /// `NBD_OPT_STRUCTURED_REPLY`: 20-byte chunk headers.
    Structured,
    /// `NBD_OPT_EXTENDED_HEADERS`: 32-byte chunk headers, never simple replies.
    Extended,
}

/// One extent of `base:allocation` status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    /// `NBD_STATE_HOLE` / `NBD_STATE_ZERO` bits.
    pub flags: u32,
}

/// Encodes reply headers for one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyWriter {
    pub mode: ReplyMode,
}

/// Longest header any single call below writes (extended chunk + its fixed fields).
pub const MAX_HEADER_LEN: usize = EXTENDED_REPLY_LEN + 16;

impl ReplyWriter {
    pub fn new(mode: ReplyMode) -> Self {
        ReplyWriter { mode }
    }

    pub fn chunked(&self) -> bool {
        self.mode != ReplyMode::Simple
    }

    /// A chunk header (structured or extended). `req_offset` is echoed by extended headers.
    fn chunk(&self, flags: u16, ty: u16, cookie: u64, req_offset: u64, len: u64, out: &mut Vec<u8>) {
        match self.mode {
            ReplyMode::Extended => {
                out.extend_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
                out.extend_from_slice(&flags.to_be_bytes());
                out.extend_from_slice(&ty.to_be_bytes());
                out.extend_from_slice(&cookie.to_be_bytes());
                out.extend_from_slice(&req_offset.to_be_bytes());
                out.extend_from_slice(&len.to_be_bytes());
            }
            _ => {
                out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
                out.extend_from_slice(&flags.to_be_bytes());
                out.extend_from_slice(&ty.to_be_bytes());
                out.extend_from_slice(&cookie.to_be_bytes());
                out.extend_from_slice(&(len as u32).to_be_bytes());
            }
        }
    }

    fn simple(err: u32, cookie: u64, out: &mut Vec<u8>) {
        out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&err.to_be_bytes());
        out.extend_from_slice(&cookie.to_be_bytes());
    }

    /// Success with no payload (every command but READ and BLOCK_STATUS).
    pub fn ok(&self, cookie: u64, req_offset: u64, out: &mut Vec<u8>) {
        match self.mode {
            // A simple reply is allowed after structured negotiation when there is no payload.
            ReplyMode::Simple | ReplyMode::Structured => Self::simple(0, cookie, out),
            ReplyMode::Extended => self.chunk(REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, req_offset, 0, out),
        }
    }

    /// Failure of a whole request, with a message for the human when chunks are allowed.
    pub fn error(&self, cookie: u64, req_offset: u64, err: NbdError, msg: &str, out: &mut Vec<u8>) {
        match self.mode {
            ReplyMode::Simple => Self::simple(err.code(), cookie, out),
            _ => {
                let msg = clip(msg);
                self.chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, req_offset, 6 + msg.len() as u64, out);
                out.extend_from_slice(&err.code().to_be_bytes());
                out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
                out.extend_from_slice(msg.as_bytes());
            }
        }
    }

    /// Failure at a given offset of a READ (chunked modes only; simple mode sends a plain error).
    pub fn error_offset(&self, cookie: u64, req_offset: u64, err: NbdError, msg: &str, at: u64, out: &mut Vec<u8>) {
        self.error_chunk_at(cookie, req_offset, err, msg, at, true, out)
    }

    /// [`ReplyWriter::error_offset`], with `done` saying whether it ends the reply (more
    /// chunks of the same READ may follow an error chunk; the READ fails as a whole).
    #[allow(clippy::too_many_arguments)]
    pub fn error_chunk_at(
        &self,
        cookie: u64,
        req_offset: u64,
        err: NbdError,
        msg: &str,
        at: u64,
        done: bool,
        out: &mut Vec<u8>,
    ) {
        if self.mode == ReplyMode::Simple {
            return Self::simple(err.code(), cookie, out);
        }
        let msg = clip(msg);
        let flags = if done { REPLY_FLAG_DONE } else { 0 };
        self.chunk(flags, REPLY_TYPE_ERROR_OFFSET, cookie, req_offset, 14 + msg.len() as u64, out);
        out.extend_from_slice(&err.code().to_be_bytes());
        out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
        out.extend_from_slice(msg.as_bytes());
        out.extend_from_slice(&at.to_be_bytes());
    }

    /// Header for `len` bytes of read data at `data_offset`; the caller sends the bytes next.
    /// In simple mode this is the whole-read reply header and must cover the whole request.
    pub fn data(&self, cookie: u64, req_offset: u64, data_offset: u64, len: usize, done: bool, out: &mut Vec<u8>) {
        match self.mode {
            ReplyMode::Simple => Self::simple(0, cookie, out),
            _ => {
                let flags = if done { REPLY_FLAG_DONE } else { 0 };
                self.chunk(flags, REPLY_TYPE_OFFSET_DATA, cookie, req_offset, 8 + len as u64, out);
                out.extend_from_slice(&data_offset.to_be_bytes());
            }
        }
    }

    /// A hole of `len` bytes at `hole_offset` (chunked modes only).
    pub fn hole(&self, cookie: u64, req_offset: u64, hole_offset: u64, len: u32, done: bool, out: &mut Vec<u8>) {
        debug_assert!(self.chunked());
        let flags = if done { REPLY_FLAG_DONE } else { 0 };
        self.chunk(flags, REPLY_TYPE_OFFSET_HOLE, cookie, req_offset, 12, out);
        out.extend_from_slice(&hole_offset.to_be_bytes());
        out.extend_from_slice(&len.to_be_bytes());
    }

    /// The final NONE chunk, closing a multi-chunk reply.
    pub fn done(&self, cookie: u64, req_offset: u64, out: &mut Vec<u8>) {
        self.chunk(REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, req_offset, 0, out);
    }

    /// One status chunk (marked final) for `context_id`. Compact mode needs every
    /// extent length to fit 32 bits; the caller clips extents to the request, whose
    /// length is 32-bit in that mode.
    pub fn block_status(&self, cookie: u64, req_offset: u64, context_id: u32, extents: &[Extent], out: &mut Vec<u8>) {
        self.block_status_chunk(cookie, req_offset, context_id, extents, true, out)
    }

    /// One status chunk for `context_id`; `done` on the last context's chunk of the
    /// reply (a BLOCK_STATUS answers every selected context, one chunk each).
    pub fn block_status_chunk(
        &self,
        cookie: u64,
        req_offset: u64,
        context_id: u32,
        extents: &[Extent],
        done: bool,
        out: &mut Vec<u8>,
    ) {
        debug_assert!(self.chunked());
        let flags = if done { REPLY_FLAG_DONE } else { 0 };
        if self.mode == ReplyMode::Extended {
            let len = 8 + 16 * extents.len() as u64;
            self.chunk(flags, REPLY_TYPE_BLOCK_STATUS_EXT, cookie, req_offset, len, out);
            out.extend_from_slice(&context_id.to_be_bytes());
            out.extend_from_slice(&(extents.len() as u32).to_be_bytes());
            for e in extents {
                out.extend_from_slice(&e.length.to_be_bytes());
                out.extend_from_slice(&u64::from(e.flags).to_be_bytes());
            }
        } else {
            let len = 4 + 8 * extents.len() as u64;
            self.chunk(flags, REPLY_TYPE_BLOCK_STATUS, cookie, req_offset, len, out);
            out.extend_from_slice(&context_id.to_be_bytes());
            for e in extents {
                out.extend_from_slice(&(e.length.min(u64::from(u32::MAX)) as u32).to_be_bytes());
                out.extend_from_slice(&e.flags.to_be_bytes());
            }
        }
    }
}

/// Error messages are at most 4096 bytes (proto.md "NBD_REPLY_TYPE_ERROR"), cut on a char boundary.
fn clip(msg: &str) -> &str {
    if msg.len() <= MAX_STRING {
        return msg;
    }
    let mut end = MAX_STRING;
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    &msg[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_sizes() {
        let mut v = Vec::new();
        ReplyWriter::new(ReplyMode::Simple).ok(1, 0, &mut v);
        assert_eq!(v.len(), SIMPLE_REPLY_LEN);
        v.clear();
        ReplyWriter::new(ReplyMode::Structured).data(1, 0, 0, 4096, true, &mut v);
        assert_eq!(v.len(), STRUCTURED_REPLY_LEN + 8);
        assert_eq!(&v[4..6], &REPLY_FLAG_DONE.to_be_bytes());
        assert_eq!(&v[16..20], &(4096u32 + 8).to_be_bytes());
        v.clear();
        ReplyWriter::new(ReplyMode::Extended).data(1, 512, 512, 4096, true, &mut v);
        assert_eq!(v.len(), EXTENDED_REPLY_LEN + 8);
        assert_eq!(&v[16..24], &512u64.to_be_bytes());
        assert_eq!(&v[24..32], &(4096u64 + 8).to_be_bytes());
        v.clear();
        ReplyWriter::new(ReplyMode::Extended).ok(9, 0, &mut v);
        assert_eq!(v.len(), EXTENDED_REPLY_LEN);
    }

    #[test]
    fn error_chunk_layout() {
        let mut v = Vec::new();
        ReplyWriter::new(ReplyMode::Structured).error(3, 0, NbdError::Inval, "bad", &mut v);
        assert_eq!(v.len(), 20 + 6 + 3);
        assert_eq!(&v[6..8], &REPLY_TYPE_ERROR.to_be_bytes());
        assert_eq!(&v[20..24], &22u32.to_be_bytes());
        assert_eq!(&v[24..26], &3u16.to_be_bytes());
        let long = "x".repeat(10_000);
        v.clear();
        ReplyWriter::new(ReplyMode::Structured).error(3, 0, NbdError::Io, &long, &mut v);
        assert_eq!(v.len(), 20 + 6 + MAX_STRING);
    }

    #[test]
    fn block_status_layouts() {
        let ex = [Extent { length: 4096, flags: 0 }, Extent { length: 8192, flags: STATE_HOLE | STATE_ZERO }];
        let mut v = Vec::new();
        ReplyWriter::new(ReplyMode::Structured).block_status(1, 0, 1, &ex, &mut v);
        assert_eq!(v.len(), 20 + 4 + 16);
        v.clear();
        ReplyWriter::new(ReplyMode::Extended).block_status(1, 0, 1, &ex, &mut v);
        assert_eq!(v.len(), 32 + 8 + 32);
        assert_eq!(&v[36..40], &2u32.to_be_bytes());
        // One chunk per context: only the last is marked DONE.
        for mode in [ReplyMode::Structured, ReplyMode::Extended] {
            let w = ReplyWriter::new(mode);
            v.clear();
            w.block_status_chunk(1, 0, 3, &ex, false, &mut v);
            assert_eq!(&v[4..6], &0u16.to_be_bytes());
            let first = v.len();
            w.block_status_chunk(1, 0, 4, &ex[..1], true, &mut v);
            assert_eq!(&v[first + 4..first + 6], &REPLY_FLAG_DONE.to_be_bytes());
        }
    }
}

/// A reply header as a client receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHeader {
    /// Simple reply; READ data follows when `error == 0` (the client knows the length).
    Simple { error: u32, cookie: u64 },
    /// Structured or extended chunk; `length` payload bytes follow.
    Chunk { flags: u16, ty: u16, cookie: u64, length: u64 },
}

/// A reply stream that cannot be parsed: the client must drop the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    #[error("bad reply magic 0x{0:08x} from the server")]
    BadMagic(u32),
    #[error("server sent a {0}-byte reply chunk, larger than any reply ferry asked for")]
    TooLong(u64),
    #[error("malformed {0} chunk from the server")]
    Malformed(&'static str),
}

impl ReplyHeader {
    pub fn cookie(&self) -> u64 {
        match *self {
            ReplyHeader::Simple { cookie, .. } | ReplyHeader::Chunk { cookie, .. } => cookie,
        }
    }

    /// Parses one reply header from the front of `buf`: `Ok(None)` means more bytes are
    /// needed; otherwise the header and its length on the wire.
    pub fn parse(buf: &[u8], mode: ReplyMode) -> Result<Option<(ReplyHeader, usize)>, ReplyError> {
        use crate::request::{be16, be32, be64};
        if buf.len() < 4 {
            return Ok(None);
        }
        let magic = be32(&buf[..4]);
        match (magic, mode) {
            (SIMPLE_REPLY_MAGIC, ReplyMode::Simple | ReplyMode::Structured) => {
                if buf.len() < SIMPLE_REPLY_LEN {
                    return Ok(None);
                }
                Ok(Some((ReplyHeader::Simple { error: be32(&buf[4..8]), cookie: be64(&buf[8..16]) }, SIMPLE_REPLY_LEN)))
            }
            (STRUCTURED_REPLY_MAGIC, ReplyMode::Structured) => {
                if buf.len() < STRUCTURED_REPLY_LEN {
                    return Ok(None);
                }
                let h = ReplyHeader::Chunk {
                    flags: be16(&buf[4..6]),
                    ty: be16(&buf[6..8]),
                    cookie: be64(&buf[8..16]),
                    length: u64::from(be32(&buf[16..20])),
                };
                Ok(Some((h, STRUCTURED_REPLY_LEN)))
            }
            (EXTENDED_REPLY_MAGIC, ReplyMode::Extended) => {
                if buf.len() < EXTENDED_REPLY_LEN {
                    return Ok(None);
                }
                let length = be64(&buf[24..32]);
                if length > u64::from(MAX_PAYLOAD) + 4096 {
                    return Err(ReplyError::TooLong(length));
                }
                let h = ReplyHeader::Chunk {
                    flags: be16(&buf[4..6]),
                    ty: be16(&buf[6..8]),
                    cookie: be64(&buf[8..16]),
                    length,
                };
                Ok(Some((h, EXTENDED_REPLY_LEN)))
            }
            _ => Err(ReplyError::BadMagic(magic)),
        }
    }
}

/// The payload of an error chunk: error value, message, and offset for ERROR_OFFSET.
pub fn parse_error_chunk(ty: u16, p: &[u8]) -> Result<(u32, String, Option<u64>), ReplyError> {
    use crate::request::{be16, be32, be64};
    if p.len() < 6 {
        return Err(ReplyError::Malformed("error"));
    }
    let err = be32(&p[..4]);
    let mlen = be16(&p[4..6]) as usize;
    if 6 + mlen > p.len() {
        return Err(ReplyError::Malformed("error"));
    }
    // The spec's limit is 4096 bytes; a longer message is cut, not copied whole.
    let msg = crate::client::printable(&p[6..6 + mlen.min(MAX_STRING)]);
    let off = if ty == REPLY_TYPE_ERROR_OFFSET {
        if p.len() < 6 + mlen + 8 {
            return Err(ReplyError::Malformed("error offset"));
        }
        Some(be64(&p[6 + mlen..6 + mlen + 8]))
    } else {
        None
    };
    Ok((err, msg, off))
}

/// The payload of a block status chunk: context id and extents.
pub fn parse_block_status(ty: u16, p: &[u8], out: &mut Vec<Extent>) -> Result<u32, ReplyError> {
    use crate::request::{be32, be64};
    match ty {
        REPLY_TYPE_BLOCK_STATUS => {
            if p.len() < 12 || !(p.len() - 4).is_multiple_of(8) {
                return Err(ReplyError::Malformed("block status"));
            }
            for d in p[4..].chunks_exact(8) {
                out.push(Extent { length: u64::from(be32(&d[..4])), flags: be32(&d[4..8]) });
            }
            Ok(be32(&p[..4]))
        }
        REPLY_TYPE_BLOCK_STATUS_EXT => {
            if p.len() < 24 || !(p.len() - 8).is_multiple_of(16) || be32(&p[4..8]) as usize != (p.len() - 8) / 16 {
                return Err(ReplyError::Malformed("extended block status"));
            }
            for d in p[8..].chunks_exact(16) {
                out.push(Extent { length: be64(&d[..8]), flags: be64(&d[8..16]) as u32 });
            }
            Ok(be32(&p[..4]))
        }
        _ => Err(ReplyError::Malformed("block status")),
    }
}

/// Which parts of a READ its chunks have covered, so that a reply finishes only when
/// every byte arrived exactly once (a gap would leave stale bytes in the caller's buffer;
/// an overlap could make the byte count add up with a gap elsewhere).
///
/// Ranges are kept merged: chunks sent in order (or in reverse) stay one range. A server
/// scattering tiny chunks is stopped at [`ReadCoverage::MAX_RANGES`] separate ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadCoverage {
    /// Disjoint, non-adjacent `(start, end)` ranges relative to the request, in order.
    ranges: Vec<(u64, u64)>,
    covered: u64,
}

/// Why a READ chunk does not fit the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CoverageError {
    #[error("a chunk of no bytes")]
    Empty,
    #[error("a chunk past the end of the request")]
    Outside,
    #[error("a chunk over bytes already sent")]
    Overlap,
    #[error("more than {} separate pieces", ReadCoverage::MAX_RANGES)]
    Scattered,
}

impl ReadCoverage {
    /// Separate ranges kept at most (16 bytes each): far more than any server sends for
    /// one READ (at most 32 MiB), and a bound on what a hostile one can make us keep.
    pub const MAX_RANGES: usize = 65_536;

    pub fn new() -> Self {
        Self::default()
    }

    /// A request of `total` bytes answered in one piece (a simple reply).
    pub fn whole(total: u64) -> Self {
        let ranges = if total > 0 { vec![(0, total)] } else { Vec::new() };
        ReadCoverage { ranges, covered: total }
    }

    /// Bytes covered so far.
    pub fn covered(&self) -> u64 {
        self.covered
    }

    /// Records `len` bytes at `rel` (relative to the request start) of a request of
    /// `total` bytes. Nothing is recorded on error.
    pub fn add(&mut self, rel: u64, len: u64, total: u64) -> Result<(), CoverageError> {
        if len == 0 {
            return Err(CoverageError::Empty);
        }
        let end = rel.checked_add(len).filter(|&e| e <= total).ok_or(CoverageError::Outside)?;
        // The first range that ends after `rel`: the only one that could overlap.
        let i = self.ranges.partition_point(|&(_, e)| e <= rel);
        if self.ranges.get(i).is_some_and(|&(s, _)| s < end) {
            return Err(CoverageError::Overlap);
        }
        let joins_prev = i > 0 && self.ranges[i - 1].1 == rel;
        let joins_next = self.ranges.get(i).is_some_and(|&(s, _)| s == end);
        match (joins_prev, joins_next) {
            (true, true) => {
                self.ranges[i - 1].1 = self.ranges[i].1;
                self.ranges.remove(i);
            }
            (true, false) => self.ranges[i - 1].1 = end,
            (false, true) => self.ranges[i].0 = rel,
            (false, false) => {
                if self.ranges.len() >= Self::MAX_RANGES {
                    return Err(CoverageError::Scattered);
                }
                self.ranges.insert(i, (rel, end));
            }
        }
        self.covered += len;
        Ok(())
    }
}

#[cfg(test)]
mod client_tests {
    use super::*;

    #[test]
    fn reply_headers_round_trip() {
        for mode in [ReplyMode::Simple, ReplyMode::Structured, ReplyMode::Extended] {
            let w = ReplyWriter::new(mode);
            let mut v = Vec::new();
            w.data(77, 0, 0, 4096, true, &mut v);
            let (h, n) = ReplyHeader::parse(&v, mode).unwrap().unwrap();
            assert_eq!(h.cookie(), 77);
            match mode {
                ReplyMode::Simple => assert_eq!((h, n), (ReplyHeader::Simple { error: 0, cookie: 77 }, 16)),
                _ => assert!(matches!(
                    h,
                    ReplyHeader::Chunk { ty: REPLY_TYPE_OFFSET_DATA, length: 4104, flags: REPLY_FLAG_DONE, .. }
                )),
            }
            assert_eq!(ReplyHeader::parse(&v[..n - 1], mode), Ok(None));
        }
        assert!(ReplyHeader::parse(&[0u8; 32], ReplyMode::Extended).is_err());
    }

    #[test]
    fn error_and_status_payloads() {
        let w = ReplyWriter::new(ReplyMode::Structured);
        let mut v = Vec::new();
        w.error_offset(1, 0, NbdError::Io, "disk on fire", 4096, &mut v);
        let (err, msg, off) = parse_error_chunk(REPLY_TYPE_ERROR_OFFSET, &v[20..]).unwrap();
        assert_eq!((err, msg.as_str(), off), (5, "disk on fire", Some(4096)));
        for mode in [ReplyMode::Structured, ReplyMode::Extended] {
            let ex = [Extent { length: 512, flags: 0 }, Extent { length: 1024, flags: STATE_HOLE }];
            let mut v = Vec::new();
            ReplyWriter::new(mode).block_status(1, 0, 9, &ex, &mut v);
            let (h, n) = ReplyHeader::parse(&v, mode).unwrap().unwrap();
            let ReplyHeader::Chunk { ty, .. } = h else { panic!() };
            let mut out = Vec::new();
            assert_eq!(parse_block_status(ty, &v[n..], &mut out), Ok(9));
            assert_eq!(out, ex);
        }
        assert!(parse_block_status(REPLY_TYPE_BLOCK_STATUS, &[0; 5], &mut Vec::new()).is_err());
    }

    #[test]
    fn long_error_messages_are_cut_and_escaped() {
        let mut p = 5u32.to_be_bytes().to_vec();
        p.extend_from_slice(&10_000u16.to_be_bytes());
        p.extend_from_slice(b"\x1b[2J");
        p.resize(6 + 10_000, b'x');
        let (_, msg, _) = parse_error_chunk(REPLY_TYPE_ERROR, &p).unwrap();
        assert!(msg.starts_with("\\u{1b}[2J"), "{msg}");
        assert!(msg.len() < MAX_STRING + 16);
    }

    #[test]
    fn read_coverage_needs_every_byte_once() {
        let mut c = ReadCoverage::new();
        assert_eq!(c.add(0, 0, 100), Err(CoverageError::Empty));
        assert_eq!(c.add(90, 11, 100), Err(CoverageError::Outside));
        assert_eq!(c.add(u64::MAX, 2, 100), Err(CoverageError::Outside));
        c.add(50, 10, 100).unwrap();
        assert_eq!(c.add(55, 10, 100), Err(CoverageError::Overlap));
        assert_eq!(c.add(45, 6, 100), Err(CoverageError::Overlap));
        assert_eq!(c.add(0, 100, 100), Err(CoverageError::Overlap));
        c.add(60, 40, 100).unwrap();
        c.add(0, 20, 100).unwrap();
        assert_eq!(c.covered(), 70);
        c.add(20, 30, 100).unwrap();
        assert_eq!(c.covered(), 100);
        assert_eq!(c.ranges, vec![(0, 100)]);
        // In order, one range however many chunks.
        let mut c = ReadCoverage::new();
        for i in 0..200_000 {
            c.add(i, 1, 200_000).unwrap();
        }
        assert_eq!(c.ranges.len(), 1);
        // Scattered: every other byte, until the limit.
        let mut c = ReadCoverage::new();
        let total = 4 * ReadCoverage::MAX_RANGES as u64;
        for i in 0..ReadCoverage::MAX_RANGES as u64 {
            c.add(2 * i, 1, total).unwrap();
        }
        assert_eq!(c.add(total - 1, 1, total), Err(CoverageError::Scattered));
        c.add(1, 1, total).unwrap(); // joins two ranges: allowed
        let mut c = ReadCoverage::whole(10);
        assert_eq!((c.covered(), c.add(9, 1, 10)), (10, Err(CoverageError::Overlap)));
        assert_eq!(ReadCoverage::whole(0), ReadCoverage::new());
    }
}
