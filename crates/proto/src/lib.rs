//! The NBD protocol without I/O.
//!
//! Everything in this crate works on byte slices: decoders take `&[u8]` and answer
//! "need more bytes" instead of blocking, encoders write into a caller's buffer, and
//! the handshake is a state machine that takes bytes in and says what to send and
//! what to do next. The socket layer and the server own the sockets.
//!
//! The protocol is the NBD project's `doc/proto.md`, including the extended-headers
//! extension (`NBD_OPT_EXTENDED_HEADERS`, 64-bit requests and replies).
//!
//! # What this crate owns
//!
//! Every byte layout of `doc/proto.md` (with the extended-headers extension), the server
//! handshake as a state machine (`ServerHandshake::feed`: bytes in, bytes to send and a
//! `Progress` out), request validation (`Session::validate` turns a raw header into a typed
//! `Command` or the NBD error to answer with)
//!
//! `unsafe`: forbidden.
#![forbid(unsafe_code)]

pub mod client;
pub mod consts;
pub mod export;
pub mod handshake;
pub mod options;
pub mod reply;
pub mod request;

pub use export::{BlockSize, Capabilities, ExportInfo};
pub use handshake::{Catalog, HandshakeError, Negotiated, Progress, ServerHandshake, TlsPolicy};
pub use reply::{ReplyMode, ReplyWriter};
pub use request::{Command, RequestError, RequestHeader, Validated};
