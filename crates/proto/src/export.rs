//! What the protocol needs to know about an export, and the transmission flags it implies.

use crate::consts::*;

/// What an export can do. Backends declare these; the flags the client sees are derived
/// from them, so the server never advertises a command it cannot honour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    pub read_only: bool,
    pub flush: bool,
    pub fua: bool,
    pub trim: bool,
    pub zero: bool,
    pub fast_zero: bool,
    pub multi_conn: bool,
    pub cache: bool,
    /// Block status (`base:allocation`) gives real answers.
    pub extents: bool,
}

impl Capabilities {
    /// A writable export that can do every command, and fast (RAM disks, `null:`).
    pub const fn everything() -> Self {
        Capabilities {
            read_only: false,
            flush: true,
            fua: true,
            trim: true,
            zero: true,
            fast_zero: true,
            multi_conn: true,
            cache: true,
            extents: true,
        }
    }
}

/// Size constraints advertised with `NBD_INFO_BLOCK_SIZE`. (proto.md "Size constraints")
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSize {
    pub minimum: u32,
    pub preferred: u32,
    pub maximum: u32,
}

impl Default for BlockSize {
    fn default() -> Self {
        BlockSize { minimum: 1, preferred: 4096, maximum: MAX_PAYLOAD }
    }
}

/// One export as the handshake sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub description: String,
    pub size: u64,
    pub caps: Capabilities,
    pub block_size: BlockSize,
}

impl ExportInfo {
    /// Transmission flags for this export, given what the client negotiated.
    /// `NBD_FLAG_SEND_DF` is only set when replies can carry chunks.
    pub fn transmission_flags(&self, chunked_replies: bool) -> u16 {
        let c = &self.caps;
        let mut f = FLAG_HAS_FLAGS;
        let set = |f: &mut u16, cond: bool, bit: u16| {
            if cond {
                *f |= bit
            }
        };
        set(&mut f, c.read_only, FLAG_READ_ONLY);
        set(&mut f, c.flush, FLAG_SEND_FLUSH);
        set(&mut f, c.fua, FLAG_SEND_FUA);
        set(&mut f, c.trim && !c.read_only, FLAG_SEND_TRIM);
        set(&mut f, c.zero && !c.read_only, FLAG_SEND_WRITE_ZEROES);
        set(&mut f, c.zero && c.fast_zero && !c.read_only, FLAG_SEND_FAST_ZERO);
        set(&mut f, chunked_replies, FLAG_SEND_DF);
        set(&mut f, c.multi_conn, FLAG_CAN_MULTI_CONN);
        set(&mut f, c.cache, FLAG_SEND_CACHE);
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_only_hides_write_commands() {
        let e = ExportInfo {
            name: String::new(),
            description: String::new(),
            size: 1 << 20,
            caps: Capabilities {
                read_only: true,
                trim: true,
                zero: true,
                fast_zero: true,
                flush: true,
                ..Default::default()
            },
            block_size: BlockSize::default(),
        };
        let f = e.transmission_flags(true);
        assert_eq!(f & FLAG_SEND_TRIM, 0);
        assert_eq!(f & FLAG_SEND_WRITE_ZEROES, 0);
        assert_eq!(f & FLAG_SEND_FAST_ZERO, 0);
        assert_ne!(f & FLAG_READ_ONLY, 0);
        assert_ne!(f & FLAG_SEND_DF, 0);
        assert_eq!(e.transmission_flags(false) & FLAG_SEND_DF, 0);
    }
}
