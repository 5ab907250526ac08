//! Wire constants, named as in the NBD specification (`doc/proto.md`).
//!
//! Everything on the wire is big-endian ("network byte order").

/// `NBDMAGIC`, the first 8 bytes a server sends. (proto.md "Newstyle negotiation")
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: second server magic, and the magic of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every fixed-newstyle option reply. (proto.md "Fixed newstyle negotiation")
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

/// Compact request header magic. (proto.md "Request message")
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Extended (64-bit) request header magic.
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Simple reply magic. (proto.md "Simple reply message")
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Structured reply chunk magic. (proto.md "Structured reply chunk message")
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Extended reply chunk magic. (proto.md "Extended reply chunk message")
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// Sizes of the fixed headers.
pub const COMPACT_REQUEST_LEN: usize = 28;
pub const EXTENDED_REQUEST_LEN: usize = 32;
pub const SIMPLE_REPLY_LEN: usize = 16;
pub const STRUCTURED_REPLY_LEN: usize = 20;
pub const EXTENDED_REPLY_LEN: usize = 32;
pub const OPTION_HEADER_LEN: usize = 16;

// Handshake flags (server, 16 bits). (proto.md "Handshake flags")
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;

// Client flags (32 bits). (proto.md "Client flags")
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Transmission flags (16 bits). (proto.md "Transmission flags")
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_SEND_DF: u16 = 1 << 7;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const FLAG_SEND_RESIZE: u16 = 1 << 9;
pub const FLAG_SEND_CACHE: u16 = 1 << 10;
pub const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;
pub const FLAG_BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;

// Option types. (proto.md "Option types")
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_PEEK_EXPORT: u32 = 4;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

// Option reply types. (proto.md "Option reply types")
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = 0x8000_0001;
pub const REP_ERR_POLICY: u32 = 0x8000_0002;
pub const REP_ERR_INVALID: u32 = 0x8000_0003;
pub const REP_ERR_PLATFORM: u32 = 0x8000_0004;
pub const REP_ERR_TLS_REQD: u32 = 0x8000_0005;
pub const REP_ERR_UNKNOWN: u32 = 0x8000_0006;
pub const REP_ERR_SHUTDOWN: u32 = 0x8000_0007;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = 0x8000_0008;
pub const REP_ERR_TOO_BIG: u32 = 0x8000_0009;
pub const REP_ERR_EXT_HEADER_REQD: u32 = 0x8000_000a;

// Information types for NBD_REP_INFO. (proto.md "NBD_REP_INFO")
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Command flags (16 bits). (proto.md "Command flags")
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
pub const CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

// Reply flags. (proto.md "Structured and extended header reply flags")
pub const REPLY_FLAG_DONE: u16 = 1 << 0;

// Structured reply types. (proto.md "Structured reply types")
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

// Request types. (proto.md "Request types")
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// base:allocation status flags. (proto.md "`base:allocation` metadata context")
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// The one metadata context ferry serves.
pub const META_BASE_ALLOCATION: &str = "base:allocation";
/// Prefix of qemu's persistent/dirty bitmap contexts: `qemu:dirty-bitmap:NAME`.
pub const META_DIRTY_BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";
/// qemu's allocation depth context: each extent's value is the layer of the backing
/// chain that holds it (0 unallocated anywhere, 1 the image itself, 2 its backing file...).
pub const META_ALLOCATION_DEPTH: &str = "qemu:allocation-depth";
/// Flag of a `qemu:dirty-bitmap:` extent that changed since the bitmap was cleared.
pub const STATE_DIRTY: u32 = 1 << 0;

/// Error values. (proto.md "Error values")
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum NbdError {
    Perm = 1,
    Io = 5,
    NoMem = 12,
    Inval = 22,
    NoSpc = 28,
    Overflow = 75,
    NotSup = 95,
    Shutdown = 108,
}

impl NbdError {
    pub fn code(self) -> u32 {
        self as u32
    }

    /// Short human text for the error, sent in structured error chunks.
    pub fn text(self) -> &'static str {
        match self {
            NbdError::Perm => "operation not permitted",
            NbdError::Io => "input/output error",
            NbdError::NoMem => "cannot allocate memory",
            NbdError::Inval => "invalid argument",
            NbdError::NoSpc => "no space left on device",
            NbdError::Overflow => "value too large",
            NbdError::NotSup => "operation not supported",
            NbdError::Shutdown => "server is shutting down",
        }
    }
}

/// Largest payload ferry accepts or sends in one request (the spec's portable default).
pub const MAX_PAYLOAD: u32 = 32 * 1024 * 1024;
/// Largest option data ferry accepts during the handshake.
pub const MAX_OPTION_DATA: u32 = 64 * 1024;
/// Longest string (export name, description, query) the spec allows.
pub const MAX_STRING: usize = 4096;

/// Human name of a command, for logs and error messages.
pub fn command_name(cmd: u16) -> &'static str {
    match cmd {
        CMD_READ => "READ",
        CMD_WRITE => "WRITE",
        CMD_DISC => "DISC",
        CMD_FLUSH => "FLUSH",
        CMD_TRIM => "TRIM",
        CMD_CACHE => "CACHE",
        CMD_WRITE_ZEROES => "WRITE_ZEROES",
        CMD_BLOCK_STATUS => "BLOCK_STATUS",
        _ => "unknown",
    }
}

/// Human name of an option, for logs.
pub fn option_name(opt: u32) -> &'static str {
    match opt {
        OPT_EXPORT_NAME => "EXPORT_NAME",
        OPT_ABORT => "ABORT",
        OPT_LIST => "LIST",
        OPT_PEEK_EXPORT => "PEEK_EXPORT",
        OPT_STARTTLS => "STARTTLS",
        OPT_INFO => "INFO",
        OPT_GO => "GO",
        OPT_STRUCTURED_REPLY => "STRUCTURED_REPLY",
        OPT_LIST_META_CONTEXT => "LIST_META_CONTEXT",
        OPT_SET_META_CONTEXT => "SET_META_CONTEXT",
        OPT_EXTENDED_HEADERS => "EXTENDED_HEADERS",
        _ => "unknown",
    }
}
