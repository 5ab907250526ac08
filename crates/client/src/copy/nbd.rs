//! An NBD export: many requests in flight on each connection, one connection per worker
//! where the server allows multi-conn.

use super::endpoint::{push_extent, Caps, Data, Done, Map, Ops, Read, Write};
use super::{contexts, CopyError};
use crate::conn::{Completion, ConnectOptions, Connection, Payload, Submit};
use crate::uri::Uri;
use ferry_proto::consts::*;
use ferry_proto::reply::Extent;
use ferry_sock::AlignedBuf;
use std::os::fd::{AsFd, BorrowedFd};

/// Shortest zero run of a server's map that is not read.
const MIN_ZERO_RUN: u64 = 4096;

pub(crate) struct Nbd {
    conn: Box<Connection>,
    uri: Uri,
    opts: ConnectOptions,
    /// "source" or "destination", for connection errors.
    what: &'static str,
}

/// Connects to the export `uri` as the copy's `what`.
pub(crate) fn open(uri: &Uri, opts: &ConnectOptions, what: &'static str) -> Result<Nbd, CopyError> {
    let conn = Connection::connect(uri, opts).map_err(|source| CopyError::Connect { what, source })?;
    Ok(Nbd { conn: Box::new(conn), uri: uri.clone(), opts: opts.clone(), what })
}

impl Ops for Nbd {
    fn name(&self) -> String {
        self.uri.to_string()
    }

    fn size(&self) -> Option<u64> {
        Some(self.conn.size())
    }

    fn caps(&self) -> Caps {
        let c = &self.conn;
        Caps {
            parallel: c.has_flag(FLAG_CAN_MULTI_CONN),
            zero: c.has_flag(FLAG_SEND_WRITE_ZEROES),
            extents: c.can_block_status(),
            // Over TCP loopback sendfile measured slower than read + send (2.64 against
            // 2.89 GiB/s, BENCHMARKING.md), as it did for the server's reads.
            file_payloads: c.can_send_file() && c.is_unix(),
            read_only: c.has_flag(FLAG_READ_ONLY),
            ..Caps::default()
        }
    }

    /// Another connection to the same export, which must be the same size: the copy was
    /// planned from the first connection's.
    fn reopen(&self) -> Result<Box<dyn Ops>, CopyError> {
        let other = open(&self.uri, &self.opts, self.what)?;
        let (a, b) = (self.conn.size(), other.conn.size());
        if a != b {
            return Err(CopyError::Setup(format!(
                "{} {}: the export was {a} bytes on one connection and {b} on another; \
                 nothing was copied (is it being resized? copy with -C 1 to use one connection)",
                self.what, self.uri
            )));
        }
        Ok(Box::new(other))
    }

    fn extents(&mut self, size: u64) -> Result<Map, CopyError> {
        let c = &mut self.conn;
        let mut out = Map::new();
        let mut pos = 0;
        // Compact headers carry 32-bit lengths: ask in pieces below 4 GiB.
        let step = if c.mode() == ferry_proto::ReplyMode::Extended { u64::MAX } else { 0xFFFF_F000 };
        while pos < size {
            let len = (size - pos).min(step);
            let ex = c.block_status(pos, len).map_err(|e| CopyError::request("block status", pos, len, e))?;
            for Extent { length, flags } in ex {
                let length = length.min(size - pos);
                if length == 0 {
                    break;
                }
                // Zero runs shorter than a page are read as data (zero detection still
                // finds them): a server answering in tiny pieces would otherwise cost a
                // request per piece.
                let flags = if length < MIN_ZERO_RUN { flags & !STATE_ZERO } else { flags };
                push_extent(&mut out, pos, length, flags);
                pos += length;
            }
        }
        Ok(out)
    }

    fn select(&mut self, context: &str, mask: u32, size: u64) -> Result<Map, CopyError> {
        let c = &mut self.conn;
        let ids = match contexts::granted_ids(c, &[context.to_string()]) {
            Ok(ids) => ids,
            Err(name) => {
                // Closed first: a server taking one client at a time answers the listing.
                c.close();
                return Err(CopyError::Setup(contexts::missing(&self.uri, &self.opts, name).to_string()));
            }
        };
        let ids: Vec<u32> = c.info().meta_context.into_iter().chain(ids).collect();
        let with_base = ids.len() == 2;
        let step = c.max_status_length();
        contexts::select_map(size, step, with_base, mask, |pos, len| contexts::nbd_fetch(c, &ids, pos, len))
            .map_err(|e| CopyError::Setup(format!("{} {}: {context}: {e}", self.what, self.uri)))
    }

    /// Sends the batch of READs in one writev; the data arrives in [`Ops::complete`].
    fn read(&mut self, reqs: &[Read], _bufs: &mut [AlignedBuf], _done: &mut Done<'_>) -> Result<(), CopyError> {
        let Some(first) = reqs.first() else { return Ok(()) };
        let subs: Vec<Submit<'_>> = reqs
            .iter()
            .map(|r| Submit {
                cmd: CMD_READ,
                flags: 0,
                offset: r.offset,
                length: r.len as u64,
                payload: None,
                slot: r.slot,
            })
            .collect();
        self.conn.submit(&subs).map_err(|e| CopyError::request("read", first.offset, first.len as u64, e))?;
        Ok(())
    }

    /// Sends the batch of WRITEs and WRITE_ZEROES in one writev (file payloads with
    /// sendfile); completions arrive in [`Ops::complete`].
    fn write(&mut self, reqs: &[Write<'_>], _done: &mut Done<'_>) -> Result<(), CopyError> {
        if reqs.is_empty() {
            return Ok(());
        }
        let subs: Vec<Submit<'_>> = reqs
            .iter()
            .map(|w| {
                let (cmd, payload) = match w.data {
                    Data::Bytes(b) => (CMD_WRITE, Some(Payload::Bytes(b))),
                    Data::File { fd, len } => (CMD_WRITE, Some(Payload::File { fd, offset: w.offset, len })),
                    Data::Zero(_) => (CMD_WRITE_ZEROES, None),
                };
                Submit { cmd, flags: 0, offset: w.offset, length: w.len(), payload, slot: w.slot }
            })
            .collect();
        if let Err(e) = self.conn.submit(&subs) {
            // The batch's whole range: any of its requests may be the one that failed.
            let start = reqs.iter().map(|w| w.offset).min().unwrap_or(0);
            let end = reqs.iter().map(|w| w.offset + w.len()).max().unwrap_or(0);
            return Err(CopyError::request("write", start, end - start, e));
        }
        Ok(())
    }

    fn poll_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.conn.as_fd())
    }

    fn buffered(&self) -> bool {
        self.conn.buffered()
    }

    /// Receives every reply already at hand (at least one, blocking for it).
    fn complete(&mut self, bufs: &mut [AlignedBuf], done: &mut Done<'_>) -> Result<(), CopyError> {
        let c = &mut self.conn;
        loop {
            let r: Completion = c.receive_into(bufs).map_err(|error| CopyError::Peer {
                what: self.what,
                name: self.uri.to_string(),
                error,
            })?;
            let op = match r.cmd {
                CMD_READ => "read",
                CMD_WRITE_ZEROES => "write zeroes",
                _ => "write",
            };
            r.result.as_ref().map_err(|e| CopyError::Remote {
                op,
                offset: r.offset,
                length: r.length,
                errno: e.errno,
                message: e.to_string(),
            })?;
            done(r.slot, r.length);
            if c.in_flight() == 0 || !c.buffered() {
                return Ok(());
            }
        }
    }

    /// One FLUSH covers every connection of a multi-conn server.
    fn flush(&mut self) -> Result<(), CopyError> {
        self.conn.flush().map_err(|e| CopyError::request("flush", 0, 0, e))
    }

    fn close(self: Box<Self>) {
        let _ = self.conn.disconnect();
    }

    fn reconnects(&self) -> bool {
        true
    }

    fn socket_stats(&self) -> Option<ferry_sock::Counters> {
        Some(self.conn.stats())
    }
}
