//! The NBD server: exports, the accept loop, and one thread per connection that runs
//! the handshake state machine and then the transmission loop.
#![forbid(unsafe_code)]

mod conn;
mod exports;
mod server;
mod zerocopy;

pub use exports::{Export, Exports};
pub use server::{Config, Server, ShutdownHandle};
pub use zerocopy::{ZeroCopy, ZEROCOPY_MIN};
