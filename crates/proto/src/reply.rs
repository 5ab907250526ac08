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
        if self.mode == ReplyMode::Simple {
            return Self::simple(err.code(), cookie, out);
        }
        let msg = clip(msg);
        self.chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR_OFFSET, cookie, req_offset, 14 + msg.len() as u64, out);
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
        debug_assert!(self.chunked());
        if self.mode == ReplyMode::Extended {
            let len = 8 + 16 * extents.len() as u64;
            self.chunk(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS_EXT, cookie, req_offset, len, out);
            out.extend_from_slice(&context_id.to_be_bytes());
            out.extend_from_slice(&(extents.len() as u32).to_be_bytes());
            for e in extents {
                out.extend_from_slice(&e.length.to_be_bytes());
                out.extend_from_slice(&u64::from(e.flags).to_be_bytes());
            }
        } else {
            let len = 4 + 8 * extents.len() as u64;
            self.chunk(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, cookie, req_offset, len, out);
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
    }
}
