//! The NBD server: exports, the accept loop, a thread per busy connection that runs
//! the handshake state machine and then the transmission loop, and one poller thread
//! that holds idle connections without threads or buffers.
#![forbid(unsafe_code)]

mod conn;
mod exports;
mod poller;
mod server;
mod zerocopy;

pub use exports::{Export, Exports};
pub use server::{
    connection_ceiling, raise_fd_limit, Config, Server, ShutdownHandle, CONN_STACK, DEFAULT_IDLE_GRACE,
    DEFAULT_SHUTDOWN_GRACE, RESERVED_FDS,
};
pub use zerocopy::{ZeroCopy, ZEROCOPY_MIN};
