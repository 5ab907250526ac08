//! ferry's NBD client: URIs, the handshake, and a connection that keeps many requests
//! in flight.
//!
//! The data path follows the same rules as the server: requests are batched into one
//! vectored send with WRITE payloads sent straight from the caller's buffers, and READ
//! payloads are received straight into the caller's buffers (only the few bytes that
//! arrive together with a header are copied out of the receive buffer).
#![forbid(unsafe_code)]

pub mod conn;
pub mod copy;
pub mod uri;

pub use conn::{Completion, ConnectOptions, Connection, Error, Payload, RemoteError, Submit};
pub use uri::{Transport, Uri, UriError};
