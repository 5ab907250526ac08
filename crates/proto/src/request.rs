//! Transmission-phase requests: parsing the header, then validating it once, at the
//! boundary, into a typed [`Command`] that the backend can trust.
//! (proto.md "Request message", "Request types", "Error values")

use crate::consts::*;

/// A request header as it came off the wire, compact or extended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub cmd: u16,
    pub cookie: u64,
    pub offset: u64,
    /// Payload length or effect length (see [`RequestHeader::payload_len`]).
    pub length: u64,
}

/// A request stream that cannot be parsed: the only answer is to drop the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("bad request magic 0x{0:08x}: the client is not speaking NBD transmission (or lost sync); closing the connection")]
    BadMagic(u32),
    #[error("request payload of {0} bytes is larger than the {MAX_PAYLOAD}-byte maximum this server advertised; closing the connection")]
    PayloadTooLarge(u64),
}

impl RequestHeader {
    /// Size of the request header on the wire.
    pub const fn wire_len(extended: bool) -> usize {
        if extended {
            EXTENDED_REQUEST_LEN
        } else {
            COMPACT_REQUEST_LEN
        }
    }

    /// Parses one header from the front of `buf`. `Ok(None)` means more bytes are needed.
    pub fn parse(buf: &[u8], extended: bool) -> Result<Option<RequestHeader>, RequestError> {
        let need = Self::wire_len(extended);
        if buf.len() < need {
            return Ok(None);
        }
        let magic = be32(&buf[0..4]);
        let expected = if extended { EXTENDED_REQUEST_MAGIC } else { REQUEST_MAGIC };
        if magic != expected {
            return Err(RequestError::BadMagic(magic));
        }
        let length = if extended { be64(&buf[24..32]) } else { u64::from(be32(&buf[24..28])) };
        Ok(Some(RequestHeader {
            flags: be16(&buf[4..6]),
            cmd: be16(&buf[6..8]),
            cookie: be64(&buf[8..16]),
            offset: be64(&buf[16..24]),
            length,
        }))
    }

    /// Encodes the header (used by tests, fuzz seeds and clients).
    pub fn encode(&self, extended: bool, out: &mut Vec<u8>) {
        if extended {
            out.extend_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
        } else {
            out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        }
        out.extend_from_slice(&self.flags.to_be_bytes());
        out.extend_from_slice(&self.cmd.to_be_bytes());
        out.extend_from_slice(&self.cookie.to_be_bytes());
        out.extend_from_slice(&self.offset.to_be_bytes());
        if extended {
            out.extend_from_slice(&self.length.to_be_bytes());
        } else {
            out.extend_from_slice(&(self.length as u32).to_be_bytes());
        }
    }

    /// Bytes of payload that follow this header on the wire, whatever the command's fate.
    /// Compact headers carry a payload only for WRITE; extended headers say so with
    /// `NBD_CMD_FLAG_PAYLOAD_LEN`.
    ///
    /// WRITE always carries its payload, with or without the flag: the extension text
    /// asks clients to set it, but qemu (8.2 to 10) sends extended WRITEs without it,
    /// and its own server reads the payload either way. ferry does the same.
    pub fn payload_len(&self, extended: bool) -> u64 {
        if self.cmd == CMD_WRITE || (extended && self.flags & CMD_FLAG_PAYLOAD_LEN != 0) {
            self.length
        } else {
            0
        }
    }

    /// Checks that the payload may be received at all. A payload over the advertised
    /// maximum is never buffered: the caller drains it (compact WRITE, whose length
    /// the client could not express otherwise) or drops the connection (extended
    /// headers, as the spec recommends).
    pub fn check_payload(&self, extended: bool) -> Result<PayloadPlan, RequestError> {
        let len = self.payload_len(extended);
        if len <= u64::from(MAX_PAYLOAD) {
            Ok(PayloadPlan::Receive(len as usize))
        } else if extended {
            Err(RequestError::PayloadTooLarge(len))
        } else {
            Ok(PayloadPlan::Drain(len))
        }
    }
}

/// What to do with the bytes after a header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadPlan {
    /// Receive this many bytes (possibly zero) for the command.
    Receive(usize),
    /// Read and discard this many bytes, then fail the request with `NBD_EINVAL`.
    Drain(u64),
}

/// What the transmission phase knows about the negotiated session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub size: u64,
    /// Transmission flags sent to the client.
    pub flags: u16,
    /// Extended headers negotiated.
    pub extended: bool,
    /// Structured or extended replies: chunks may be sent.
    pub chunked: bool,
    /// The metadata contexts the client selected for this export, in the export's
    /// order: (context id, index in the export's list of contexts). Empty: BLOCK_STATUS
    /// is refused.
    pub meta_contexts: Vec<(u32, usize)>,
    pub min_block: u32,
    pub max_payload: u32,
}

/// A request that passed validation. Offsets and lengths are in range, flags are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read {
        offset: u64,
        length: u32,
        df: bool,
    },
    Write {
        offset: u64,
        length: u32,
        fua: bool,
    },
    Disc,
    Flush,
    Trim {
        offset: u64,
        length: u64,
        fua: bool,
    },
    Cache {
        offset: u64,
        length: u64,
    },
    WriteZeroes {
        offset: u64,
        length: u64,
        fua: bool,
        no_hole: bool,
        fast: bool,
    },
    /// `length` is the effect length (from the payload when the client sent a context
    /// filter). `filtered`: the payload names the contexts to answer (see
    /// [`block_status_filter`]); otherwise every selected context is answered.
    BlockStatus {
        offset: u64,
        length: u64,
        req_one: bool,
        filtered: bool,
    },
}

/// The context ids of a BLOCK_STATUS payload that [`Session::validate_with`] accepted
/// (`NBD_CMD_FLAG_PAYLOAD_LEN`: a 64-bit effect length, then 32-bit ids).
pub fn block_status_filter(payload: &[u8]) -> impl Iterator<Item = u32> + '_ {
    payload.get(8..).unwrap_or_default().chunks_exact(4).map(be32)
}

/// Result of validating a request: a command, or the error to reply with.
pub type Validated = Result<Command, NbdError>;

impl Session {
    /// Validates a request header against the session, once, at the boundary.
    /// The payload (if any) has been received or drained by the caller.
    pub fn validate(&self, h: &RequestHeader) -> Validated {
        self.validate_with(h, &[])
    }

    /// [`Session::validate`] for a request whose payload was received: a BLOCK_STATUS
    /// with `NBD_CMD_FLAG_PAYLOAD_LEN` (extended headers, `NBD_FLAG_BLOCK_STATUS_PAYLOAD`
    /// advertised) carries its effect length and the ids of the contexts to answer,
    /// each a selected context, none twice. (proto.md "NBD_CMD_BLOCK_STATUS")
    pub fn validate_with(&self, h: &RequestHeader, payload: &[u8]) -> Validated {
        let filtered = h.cmd == CMD_BLOCK_STATUS && self.extended && h.flags & CMD_FLAG_PAYLOAD_LEN != 0;
        if filtered {
            if self.flags & FLAG_BLOCK_STATUS_PAYLOAD == 0 || payload.len() as u64 != h.length {
                return Err(NbdError::Inval);
            }
            let ids = payload.len().checked_sub(8).ok_or(NbdError::Inval)?;
            // At least one id, whole ids, and no more than were selected (so no
            // duplicate can hide in a long list).
            if ids == 0 || !ids.is_multiple_of(4) || ids / 4 > self.meta_contexts.len() {
                return Err(NbdError::Inval);
            }
            for (i, id) in block_status_filter(payload).enumerate() {
                let selected = self.meta_contexts.iter().any(|&(c, _)| c == id);
                if !selected || block_status_filter(payload).take(i).any(|earlier| earlier == id) {
                    return Err(NbdError::Inval);
                }
            }
            let effect = RequestHeader { length: be64(&payload[..8]), flags: h.flags & !CMD_FLAG_PAYLOAD_LEN, ..*h };
            return match self.validate_header(&effect) {
                Ok(Command::BlockStatus { offset, length, req_one, .. }) => {
                    Ok(Command::BlockStatus { offset, length, req_one, filtered: true })
                }
                other => other,
            };
        }
        self.validate_header(h)
    }

    fn validate_header(&self, h: &RequestHeader) -> Validated {
        let has = |bit: u16| self.flags & bit != 0;
        let fua = h.flags & CMD_FLAG_FUA != 0;
        // Flags each command may carry. FUA is accepted on every command when
        // advertised, as the spec asks ("existing clients are known to set this bit").
        let mut allowed = if has(FLAG_SEND_FUA) { CMD_FLAG_FUA } else { 0 };
        match h.cmd {
            CMD_READ if has(FLAG_SEND_DF) => allowed |= CMD_FLAG_DF,
            CMD_WRITE if self.extended => allowed |= CMD_FLAG_PAYLOAD_LEN,
            CMD_WRITE_ZEROES => {
                allowed |= CMD_FLAG_NO_HOLE;
                if has(FLAG_SEND_FAST_ZERO) {
                    allowed |= CMD_FLAG_FAST_ZERO;
                }
            }
            CMD_BLOCK_STATUS => allowed |= CMD_FLAG_REQ_ONE,
            _ => {}
        }
        if h.flags & !allowed != 0 {
            return Err(NbdError::Inval);
        }
        let writes = matches!(h.cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
        if writes && has(FLAG_READ_ONLY) {
            return Err(NbdError::Perm);
        }
        let in_range = |err: NbdError| -> Result<(), NbdError> {
            if h.length == 0 {
                return Err(NbdError::Inval);
            }
            match h.offset.checked_add(h.length) {
                Some(end) if end <= self.size => {}
                _ => return Err(err),
            }
            let mb = u64::from(self.min_block.max(1));
            if !h.offset.is_multiple_of(mb) || !h.length.is_multiple_of(mb) {
                return Err(NbdError::Inval);
            }
            Ok(())
        };
        match h.cmd {
            CMD_READ => {
                if h.length > u64::from(self.max_payload) {
                    // Structured clients may retry smaller (proto.md NBD_CMD_READ).
                    return Err(if self.chunked { NbdError::Overflow } else { NbdError::Inval });
                }
                in_range(NbdError::Inval)?;
                Ok(Command::Read { offset: h.offset, length: h.length as u32, df: h.flags & CMD_FLAG_DF != 0 })
            }
            CMD_WRITE => {
                if h.length > u64::from(self.max_payload) {
                    return Err(NbdError::Inval);
                }
                in_range(NbdError::NoSpc)?;
                Ok(Command::Write { offset: h.offset, length: h.length as u32, fua })
            }
            CMD_DISC => Ok(Command::Disc),
            CMD_FLUSH if has(FLAG_SEND_FLUSH) => Ok(Command::Flush),
            CMD_TRIM if has(FLAG_SEND_TRIM) => {
                in_range(NbdError::Inval)?;
                Ok(Command::Trim { offset: h.offset, length: h.length, fua })
            }
            CMD_CACHE if has(FLAG_SEND_CACHE) => {
                in_range(NbdError::Inval)?;
                Ok(Command::Cache { offset: h.offset, length: h.length })
            }
            CMD_WRITE_ZEROES if has(FLAG_SEND_WRITE_ZEROES) => {
                in_range(NbdError::NoSpc)?;
                Ok(Command::WriteZeroes {
                    offset: h.offset,
                    length: h.length,
                    fua,
                    no_hole: h.flags & CMD_FLAG_NO_HOLE != 0,
                    fast: h.flags & CMD_FLAG_FAST_ZERO != 0,
                })
            }
            CMD_BLOCK_STATUS if self.chunked && !self.meta_contexts.is_empty() => {
                in_range(NbdError::Inval)?;
                Ok(Command::BlockStatus {
                    offset: h.offset,
                    length: h.length,
                    req_one: h.flags & CMD_FLAG_REQ_ONE != 0,
                    filtered: false,
                })
            }
            _ => Err(NbdError::Inval),
        }
    }
}

pub(crate) fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
pub(crate) fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
pub(crate) fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session() -> Session {
        Session {
            size: 1 << 20,
            flags: FLAG_HAS_FLAGS
                | FLAG_SEND_FLUSH
                | FLAG_SEND_FUA
                | FLAG_SEND_TRIM
                | FLAG_SEND_WRITE_ZEROES
                | FLAG_SEND_FAST_ZERO
                | FLAG_SEND_DF
                | FLAG_SEND_CACHE,
            extended: false,
            chunked: true,
            meta_contexts: vec![(1, 0)],
            min_block: 1,
            max_payload: MAX_PAYLOAD,
        }
    }

    fn hdr(cmd: u16, flags: u16, offset: u64, length: u64) -> RequestHeader {
        RequestHeader { flags, cmd, cookie: 7, offset, length }
    }

    #[test]
    fn round_trip_both_header_forms() {
        for ext in [false, true] {
            let h = hdr(CMD_WRITE, if ext { CMD_FLAG_PAYLOAD_LEN } else { 0 }, 4096, 512);
            let mut b = Vec::new();
            h.encode(ext, &mut b);
            assert_eq!(b.len(), RequestHeader::wire_len(ext));
            assert_eq!(RequestHeader::parse(&b[..b.len() - 1], ext), Ok(None));
            assert_eq!(RequestHeader::parse(&b, ext), Ok(Some(h)));
            assert_eq!(h.payload_len(ext), 512);
        }
    }

    #[test]
    fn bad_magic_is_fatal() {
        let b = [0u8; 28];
        assert_eq!(RequestHeader::parse(&b, false), Err(RequestError::BadMagic(0)));
    }

    #[test]
    fn validation() {
        let s = session();
        assert_eq!(s.validate(&hdr(CMD_READ, 0, 0, 4096)), Ok(Command::Read { offset: 0, length: 4096, df: false }));
        assert_eq!(s.validate(&hdr(CMD_READ, 0, (1 << 20) - 1, 2)), Err(NbdError::Inval));
        assert_eq!(s.validate(&hdr(CMD_READ, 0, u64::MAX, 2)), Err(NbdError::Inval));
        assert_eq!(s.validate(&hdr(CMD_WRITE, 0, (1 << 20) - 1, 2)), Err(NbdError::NoSpc));
        assert_eq!(s.validate(&hdr(CMD_WRITE_ZEROES, 0, 1 << 20, 1)), Err(NbdError::NoSpc));
        assert_eq!(s.validate(&hdr(CMD_READ, CMD_FLAG_REQ_ONE, 0, 1)), Err(NbdError::Inval));
        assert_eq!(s.validate(&hdr(99, 0, 0, 1)), Err(NbdError::Inval));
        assert_eq!(s.validate(&hdr(CMD_READ, 0, 0, 0)), Err(NbdError::Inval));
        assert_eq!(s.validate(&hdr(CMD_READ, 0, 0, u64::from(MAX_PAYLOAD) + 1)), Err(NbdError::Overflow));
        assert!(matches!(
            s.validate(&hdr(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO | CMD_FLAG_NO_HOLE, 0, 10)),
            Ok(Command::WriteZeroes { fast: true, no_hole: true, .. })
        ));
        let ro = Session { flags: s.flags | FLAG_READ_ONLY, ..s.clone() };
        assert_eq!(ro.validate(&hdr(CMD_WRITE, 0, 0, 1)), Err(NbdError::Perm));
        assert_eq!(ro.validate(&hdr(CMD_TRIM, 0, 0, 1)), Err(NbdError::Perm));
        let nometa = Session { meta_contexts: vec![], ..s.clone() };
        assert_eq!(nometa.validate(&hdr(CMD_BLOCK_STATUS, 0, 0, 1)), Err(NbdError::Inval));
        let nofua = Session { flags: s.flags & !FLAG_SEND_FUA, ..s.clone() };
        assert_eq!(nofua.validate(&hdr(CMD_WRITE, CMD_FLAG_FUA, 0, 1)), Err(NbdError::Inval));
        let aligned = Session { min_block: 512, ..s };
        assert_eq!(aligned.validate(&hdr(CMD_READ, 0, 1, 512)), Err(NbdError::Inval));
    }

    #[test]
    fn block_status_context_filter() {
        let s = Session {
            extended: true,
            flags: session().flags | FLAG_BLOCK_STATUS_PAYLOAD,
            meta_contexts: vec![(4, 0), (5, 2), (9, 3)],
            ..session()
        };
        let payload = |effect: u64, ids: &[u32]| {
            let mut p = effect.to_be_bytes().to_vec();
            for id in ids {
                p.extend_from_slice(&id.to_be_bytes());
            }
            p
        };
        let bs = |p: &[u8], flags: u16| hdr(CMD_BLOCK_STATUS, CMD_FLAG_PAYLOAD_LEN | flags, 4096, p.len() as u64);
        let p = payload(8192, &[9, 4]);
        assert_eq!(
            s.validate_with(&bs(&p, CMD_FLAG_REQ_ONE), &p),
            Ok(Command::BlockStatus { offset: 4096, length: 8192, req_one: true, filtered: true })
        );
        assert_eq!(block_status_filter(&p).collect::<Vec<_>>(), vec![9, 4]);
        // Without a payload: every context, the header's length.
        assert_eq!(
            s.validate(&hdr(CMD_BLOCK_STATUS, 0, 0, 10)),
            Ok(Command::BlockStatus { offset: 0, length: 10, req_one: false, filtered: false })
        );
        for bad in [
            payload(8192, &[]),           // no id
            payload(8192, &[4, 4]),       // twice
            payload(8192, &[7]),          // not selected
            payload(8192, &[4, 5, 9, 4]), // more ids than selected
            payload(0, &[4]),             // empty effect
            payload(1 << 20, &[4]),       // past the end
            payload(8192, &[4])[..10].to_vec(),
            vec![0; 4],
        ] {
            assert_eq!(s.validate_with(&bs(&bad, 0), &bad), Err(NbdError::Inval), "{bad:?}");
        }
        // The payload must be what the header announced.
        let p = payload(512, &[5]);
        assert_eq!(s.validate_with(&hdr(CMD_BLOCK_STATUS, CMD_FLAG_PAYLOAD_LEN, 0, 99), &p), Err(NbdError::Inval));
        // Not advertised (no extended headers or no contexts): refused.
        let compact = Session { flags: s.flags & !FLAG_BLOCK_STATUS_PAYLOAD, ..s.clone() };
        assert_eq!(compact.validate_with(&bs(&p, 0), &p), Err(NbdError::Inval));
    }

    #[test]
    fn extended_payloads() {
        let s = Session { extended: true, ..session() };
        // qemu sends extended WRITEs without PAYLOAD_LEN; the payload is there all the same.
        assert!(s.validate(&hdr(CMD_WRITE, 0, 0, 1)).is_ok());
        assert_eq!(hdr(CMD_WRITE, 0, 0, 9).payload_len(true), 9);
        assert_eq!(hdr(CMD_TRIM, CMD_FLAG_PAYLOAD_LEN, 0, 9).payload_len(true), 9);
        assert_eq!(hdr(CMD_TRIM, CMD_FLAG_PAYLOAD_LEN, 0, 9).payload_len(false), 0);
        assert!(s.validate(&hdr(CMD_WRITE, CMD_FLAG_PAYLOAD_LEN, 0, 1)).is_ok());
        assert_eq!(s.validate(&hdr(CMD_READ, CMD_FLAG_PAYLOAD_LEN, 0, 1)), Err(NbdError::Inval));
        let big = hdr(CMD_TRIM, CMD_FLAG_PAYLOAD_LEN, 0, u64::from(MAX_PAYLOAD) + 1);
        assert!(big.check_payload(true).is_err());
        let big = hdr(CMD_WRITE, 0, 0, u64::from(MAX_PAYLOAD) + 1);
        assert_eq!(big.check_payload(false), Ok(PayloadPlan::Drain(u64::from(MAX_PAYLOAD) + 1)));
    }
}
