//! The one interface every copy endpoint implements (nbdcopy's `rw_ops`).
//!
//! The worker in `mod.rs` moves buffers between two [`Ops`] and knows none of their
//! kinds. Requests go in batches and come back through a `done(slot, bytes)` callback:
//! a synchronous endpoint (file, pipe, backend, null) does the work inside
//! [`Ops::read`]/[`Ops::write`] and calls `done` before returning; an asynchronous one
//! (NBD: many requests in flight per connection) sends the whole batch at once (one
//! writev) and calls `done` later, from [`Ops::complete`], after the worker's `poll` on
//! [`Ops::poll_fd`] said a reply is there. The worker keeps every buffer; endpoints only
//! borrow them for the length of a call.

use super::CopyError;
use ferry_sock::AlignedBuf;
use std::fs::File;
use std::os::fd::BorrowedFd;

/// What a piece of the source holds, as far as its allocation map knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Data,
    /// A hole or a range the source reports as reading zeroes: never read.
    Zero,
}

/// An allocation map: (start, length, kind), in order, covering the source.
pub(crate) type Map = Vec<(u64, u64, Kind)>;

/// Appends a `base:allocation` extent at `pos` to a map (`STATE_ZERO`: a [`Kind::Zero`]
/// range), merging it with the previous one when both are of one kind.
pub(crate) fn push_extent(out: &mut Map, pos: u64, length: u64, flags: u32) {
    let kind = if flags & ferry_proto::consts::STATE_ZERO != 0 { Kind::Zero } else { Kind::Data };
    push_range(out, pos, length, kind);
}

/// Most ranges a map keeps (24 bytes each): a source (or a hostile server) with more
/// fragments than this gets a coarser map, not unbounded memory.
pub(crate) const MAX_MAP_RANGES: usize = 1 << 20;

/// Appends a range to a map, merging it with the previous one when both are of one
/// kind; past [`MAX_MAP_RANGES`] the map is coarsened.
pub(crate) fn push_range(out: &mut Map, pos: u64, length: u64, kind: Kind) {
    match out.last_mut() {
        Some(last) if last.2 == kind && last.0 + last.1 == pos => last.1 += length,
        _ => out.push((pos, length, kind)),
    }
    if out.len() > MAX_MAP_RANGES {
        coarsen(out, MAX_MAP_RANGES / 2);
    }
}

/// Makes a map at most `max` ranges long by reading its shortest zero runs as data
/// (always safe: zero detection still finds them), runs under 4 KiB first, then under
/// twice that, and so on.
pub(crate) fn coarsen(map: &mut Map, max: usize) {
    let mut min = 4096u64;
    while map.len() > max {
        let mut out: Map = Vec::with_capacity(map.len().min(max * 2));
        for &(pos, len, kind) in map.iter() {
            let kind = if kind == Kind::Zero && len < min { Kind::Data } else { kind };
            match out.last_mut() {
                Some(last) if last.2 == kind && last.0 + last.1 == pos => last.1 += len,
                _ => out.push((pos, len, kind)),
            }
        }
        *map = out;
        min = min.saturating_mul(2);
    }
}

/// What an opened endpoint can do; the worker plans from this, never from the kind.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Caps {
    /// Several workers may each have their own opening ([`Ops::reopen`]) at once: NBD
    /// multi-conn, files, backends, null.
    pub parallel: bool,
    /// Bytes go strictly in order, through one worker (pipes).
    pub in_order: bool,
    /// Takes [`Data::Zero`]: zeroes cost no data (WRITE_ZEROES, fallocate,
    /// `Backend::zero`) and may be deallocated, which is all the trimming a copy needs.
    /// Otherwise the worker writes zeroes as data.
    pub zero: bool,
    /// Reads as zeroes everywhere already (a file just created): zero runs need no writing.
    pub zeroed: bool,
    /// Has an allocation map ([`Ops::extents`]): holes are not read.
    pub extents: bool,
    /// Takes [`Data::File`] payloads, sent with sendfile(2) (plaintext NBD over Unix).
    pub file_payloads: bool,
    /// Throws the data away: zero detection would change nothing.
    pub discards: bool,
    /// Refuses writes.
    pub read_only: bool,
}

/// One read of a batch: `len` bytes at `offset` into the worker's buffer `slot`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Read {
    pub slot: usize,
    pub offset: u64,
    pub len: usize,
}

/// What one write of a batch carries.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Data<'a> {
    Bytes(&'a [u8]),
    /// `len` bytes of the source file at the same offset (only to [`Caps::file_payloads`]).
    File {
        fd: BorrowedFd<'a>,
        len: usize,
    },
    /// That many zero bytes (only to [`Caps::zero`]).
    Zero(u64),
}

/// One write of a batch, for the worker's buffer `slot`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Write<'a> {
    pub slot: usize,
    pub offset: u64,
    pub data: Data<'a>,
}

impl Write<'_> {
    pub fn len(&self) -> u64 {
        match self.data {
            Data::Bytes(b) => b.len() as u64,
            Data::File { len, .. } => len as u64,
            Data::Zero(n) => n,
        }
    }
}

/// Called for each finished request: (slot, bytes done). A read shorter than asked
/// means the end of a stream.
pub(crate) type Done<'a> = dyn FnMut(usize, u64) + 'a;

/// Synchronous reads: `read(buffer, offset)` for each request of the batch in turn, each
/// finished at once.
pub(crate) fn read_each<E: std::fmt::Display + 'static>(
    reqs: &[Read],
    bufs: &mut [AlignedBuf],
    done: &mut Done<'_>,
    mut read: impl FnMut(&mut [u8], u64) -> Result<(), E>,
) -> Result<(), CopyError> {
    for r in reqs {
        read(&mut bufs[r.slot][..r.len], r.offset)
            .map_err(|e| CopyError::request("read", r.offset, r.len as u64, e))?;
        done(r.slot, r.len as u64);
    }
    Ok(())
}

/// Synchronous writes: `write(request)` for each request of the batch in turn, each
/// finished at once.
pub(crate) fn write_each<E: std::fmt::Display + 'static>(
    reqs: &[Write<'_>],
    done: &mut Done<'_>,
    mut write: impl FnMut(&Write<'_>) -> Result<(), E>,
) -> Result<(), CopyError> {
    for w in reqs {
        let op = if matches!(w.data, Data::Zero(_)) { "write zeroes" } else { "write" };
        write(w).map_err(|e| CopyError::request(op, w.offset, w.len(), e))?;
        done(w.slot, w.len());
    }
    Ok(())
}

/// One opened endpoint.
pub(crate) trait Ops: Send {
    /// What error messages call it: the URI, path or backend name.
    fn name(&self) -> String;
    /// Size in bytes; `None` for a stream (stdin) or a sink that takes any size.
    fn size(&self) -> Option<u64>;
    fn caps(&self) -> Caps;
    /// Another opening of the same endpoint for another worker (only with
    /// [`Caps::parallel`]).
    fn reopen(&self) -> Result<Box<dyn Ops>, CopyError>;
    /// The allocation map of `0..size` (only with [`Caps::extents`]).
    fn extents(&mut self, size: u64) -> Result<Map, CopyError> {
        Ok(vec![(0, size, Kind::Data)])
    }
    /// The ranges of `0..size` where the metadata context `context` (e.g.
    /// `qemu:dirty-bitmap:NAME`) has a bit of `mask` set, each as data or, where
    /// base:allocation says it reads as zeroes, as zeroes (written, never read). Sources
    /// without metadata contexts refuse.
    fn select(&mut self, context: &str, mask: u32, size: u64) -> Result<Map, CopyError> {
        let _ = (mask, size);
        Err(CopyError::Setup(format!(
            "source {} has no metadata contexts, so it cannot offer {context} (an NBD export or a qcow2 image can)",
            self.name()
        )))
    }
    /// A file holding the bytes at the same offsets, to feed sendfile(2) payloads.
    fn file(&self) -> Option<&File> {
        None
    }
    /// Reads a batch into `bufs` (each buffer already holds at least `len` bytes).
    fn read(&mut self, reqs: &[Read], bufs: &mut [AlignedBuf], done: &mut Done<'_>) -> Result<(), CopyError>;
    /// Writes a batch.
    fn write(&mut self, reqs: &[Write<'_>], done: &mut Done<'_>) -> Result<(), CopyError>;
    /// Asynchronous endpoints: what to poll for replies while requests are in flight.
    fn poll_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    /// Replies already received: ready without polling.
    fn buffered(&self) -> bool {
        false
    }
    /// Asynchronous endpoints: receives the replies at hand (at least one, blocking for
    /// it), READ data straight into `bufs`.
    fn complete(&mut self, bufs: &mut [AlignedBuf], done: &mut Done<'_>) -> Result<(), CopyError> {
        let _ = (bufs, done);
        Ok(())
    }
    /// A streamed copy ended after `len` bytes: a destination made for it takes that size.
    fn set_stream_length(&mut self, len: u64) -> Result<(), CopyError> {
        let _ = len;
        Ok(())
    }
    /// Makes every finished write durable.
    fn flush(&mut self) -> Result<(), CopyError>;
    /// Ends cleanly (NBD: disconnect). Errors no longer matter here.
    fn close(self: Box<Self>) {}
    /// Socket statistics, for NBD.
    fn socket_stats(&self) -> Option<ferry_sock::Counters> {
        None
    }
    /// A lost connection can be opened again with [`Ops::reopen`] and failed requests
    /// sent again (NBD): see `retry.rs`.
    fn reconnects(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragmented_maps_are_coarsened_not_grown() {
        let mut m = Map::new();
        let n = 3 * MAX_MAP_RANGES as u64;
        for i in 0..n {
            push_extent(&mut m, i * 512, 512, if i % 2 == 1 { ferry_proto::consts::STATE_ZERO } else { 0 });
        }
        assert!(m.len() <= MAX_MAP_RANGES, "{}", m.len());
        // Still the whole range, in order, without gaps.
        let mut pos = 0;
        for &(p, len, _) in &m {
            assert_eq!(p, pos);
            pos += len;
        }
        assert_eq!(pos, n * 512);
        // Large holes survive coarsening.
        let mut m: Map =
            (0..10).map(|i| (i << 20, 1 << 20, if i % 2 == 1 { Kind::Zero } else { Kind::Data })).collect();
        m.push((10 << 20, 100, Kind::Zero));
        m.push((10 << 20 | 100, 100, Kind::Data));
        coarsen(&mut m, 11);
        assert_eq!(m.len(), 11);
        assert_eq!(m[1], (1 << 20, 1 << 20, Kind::Zero));
        assert_eq!(m[10], (10 << 20, 200, Kind::Data));
    }
}
