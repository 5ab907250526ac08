//! Socket buffer flags shared by the commands that open NBD connections.

use anyhow::{Context, Result};
use clap::Args;
use ferry_backend::parse_size;
use ferry_sock::BufferConfig;

#[derive(Args, Debug, Clone, Default)]
pub struct SocketArgs {
    /// SO_SNDBUF for NBD sockets (default: 4M on Unix sockets, as does the environment
    /// variable FERRY_SOCKET_SNDBUF; TCP keeps the kernel's autotuning).
    #[arg(long, value_name = "BYTES")]
    pub sndbuf: Option<String>,
    /// SO_RCVBUF for NBD sockets (default: the kernel's).
    #[arg(long, value_name = "BYTES")]
    pub rcvbuf: Option<String>,
}

impl SocketArgs {
    /// The explicit sizes asked for (Unix sockets add their default send buffer later).
    pub fn buffers(&self) -> Result<BufferConfig> {
        let size = |v: &Option<String>, what: &str| -> Result<Option<usize>> {
            v.as_deref().map(|s| parse_size(s).map(|n| n as usize).with_context(|| format!("--{what}"))).transpose()
        };
        Ok(BufferConfig { sndbuf: size(&self.sndbuf, "sndbuf")?, rcvbuf: size(&self.rcvbuf, "rcvbuf")? })
    }
}
