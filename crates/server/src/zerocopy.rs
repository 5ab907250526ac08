//! Zero-copy replies (`--zerocopy`): MSG_ZEROCOPY sends of large READ replies on TCP,
//! and the send arenas they pin until the kernel reports them complete.
//!
//! A zero-copy `sendmsg` lends the pages of every slice it sends (reply headers too) to
//! the kernel. So after such a send, the connection's header and data arenas are
//! retired as a pair, tagged with the send's ticket, and a free pair takes their place;
//! a retired pair comes back only once the completion notifications cover its ticket.
//! When [`MAX_IN_FLIGHT`] pairs are out, the connection blocks in `poll` on the error
//! queue until the oldest returns. The arenas the transmission loop writes into are
//! therefore never in flight, and the ordinary (copying) path is untouched.

use ferry_sock::{AlignedBuf, Stream};
use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::time::Duration;

/// `--zerocopy`: whether READ replies go out with MSG_ZEROCOPY.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ZeroCopy {
    /// Never: one copying `writev` per batch, as before zero-copy existed.
    Off,
    /// On TCP connections, until the kernel reports it copied a zero-copy send (it
    /// always does on loopback, and with NICs that cannot scatter-gather): then that
    /// connection goes back to plain sends.
    #[default]
    Auto,
    /// On every connection, whatever the kernel reports. Refused at start where it
    /// cannot work (Unix sockets, a kernel without SO_ZEROCOPY).
    On,
}

/// A batch of replies is sent with MSG_ZEROCOPY only when it carries at least this much
/// READ payload. Below it, pinning pages and reading a notification cost more than the
/// copy they save (the kernel's msg_zerocopy.rst puts the break-even around 10 KB per
/// send; a batch is flushed at 64 KiB of payload anyway, see `DEFAULT_SEND_BATCH`).
pub const ZEROCOPY_MIN: usize = 64 * 1024;
/// Arena pairs a connection may have in flight before it waits for completions.
const MAX_IN_FLIGHT: usize = 8;
/// At the end of a connection, how long to wait for outstanding completions before the
/// arenas still lent to the kernel are leaked rather than freed.
const FINISH_WAIT: Duration = Duration::from_secs(5);

/// The header and data arenas of one batch of replies.
type Arenas = (Vec<u8>, AlignedBuf);

/// One connection's zero-copy sender.
pub(crate) struct ZeroCopySender {
    mode: ZeroCopy,
    /// Still sending with MSG_ZEROCOPY (auto mode clears it on the first COPIED report).
    active: bool,
    /// Auto mode: the ticket of the first zero-copy send, the probe. Until it completes,
    /// batches go out with plain sends; if the kernel copied it, zero-copy stops there
    /// (on loopback, one zero-copy send per connection in all).
    probe: Option<u64>,
    /// Auto mode: the probe was sent.
    probed: bool,
    /// The kernel's first COPIED report on this connection was handled.
    copied_seen: bool,
    /// Arenas lent to the kernel, oldest first, with the ticket that frees them.
    in_flight: VecDeque<(u64, Arenas)>,
    free: Vec<Arenas>,
}

impl ZeroCopySender {
    /// Sets up zero-copy on `stream` as `mode` asks. `Ok(None)`: this connection sends
    /// as before (off; auto on a Unix socket or where the kernel refuses). In `On` mode
    /// a socket that refuses is an error: the connection is dropped, never served
    /// silently without zero-copy.
    pub(crate) fn new(mode: ZeroCopy, stream: &mut Stream) -> io::Result<Option<ZeroCopySender>> {
        match mode {
            ZeroCopy::Off => return Ok(None),
            ZeroCopy::Auto if stream.is_unix() => return Ok(None),
            ZeroCopy::Auto => {
                if let Err(e) = stream.enable_zerocopy() {
                    log::debug!("{}: no zero-copy: {e}", stream.peer());
                    return Ok(None);
                }
            }
            ZeroCopy::On => stream
                .enable_zerocopy()
                .map_err(|e| io::Error::new(e.kind(), format!("--zerocopy=on: cannot set SO_ZEROCOPY: {e}")))?,
        }
        Ok(Some(ZeroCopySender {
            mode,
            active: true,
            probe: None,
            probed: false,
            copied_seen: false,
            in_flight: VecDeque::new(),
            free: Vec::new(),
        }))
    }

    /// A batch with `payload` bytes of READ data should go out with MSG_ZEROCOPY.
    pub(crate) fn wants(&mut self, stream: &mut Stream, payload: usize) -> io::Result<bool> {
        if !self.active || payload < ZEROCOPY_MIN {
            return Ok(false);
        }
        let Some(probe) = self.probe else { return Ok(true) };
        if stream.zerocopy_done() < probe {
            stream.reap_zerocopy()?;
            self.after_reap(stream);
        }
        if !self.active || stream.zerocopy_done() < probe {
            return Ok(false);
        }
        self.probe = None;
        log::debug!("{}: the kernel did not copy the zero-copy probe: zero-copy stays on", stream.peer());
        Ok(true)
    }

    /// Sends `iov` with MSG_ZEROCOPY; returns the ticket to pass to [`Self::retire`].
    pub(crate) fn send(&mut self, stream: &mut Stream, iov: &mut [IoSlice<'_>]) -> io::Result<u64> {
        let ticket = stream.send_zerocopy(iov)?;
        if self.mode == ZeroCopy::Auto && !self.probed {
            self.probed = true;
            self.probe = Some(ticket);
        }
        Ok(ticket)
    }

    /// After a zero-copy send of `headers` and `data`: lends them to the kernel until
    /// `ticket` completes and puts a free pair in their place (waiting for the oldest
    /// pair in flight if [`MAX_IN_FLIGHT`] are out).
    pub(crate) fn retire(
        &mut self,
        stream: &mut Stream,
        ticket: u64,
        headers: &mut Vec<u8>,
        data: &mut AlignedBuf,
    ) -> io::Result<()> {
        stream.reap_zerocopy()?;
        self.after_reap(stream);
        let fresh = match self.free.pop() {
            Some(pair) => pair,
            None if self.in_flight.len() < MAX_IN_FLIGHT => {
                (Vec::with_capacity(headers.capacity()), AlignedBuf::zeroed(data.len()))
            }
            None => {
                let oldest = self.in_flight.front().map_or(0, |(t, _)| *t);
                stream.wait_zerocopy(oldest, None)?;
                self.collect(stream);
                self.free.pop().expect("the oldest pair completed")
            }
        };
        let (mut h, mut d) = fresh;
        h.clear();
        std::mem::swap(headers, &mut h);
        std::mem::swap(data, &mut d);
        self.in_flight.push_back((ticket, (h, d)));
        Ok(())
    }

    /// A zero-copy send (or the wait after it) failed part way: the kernel may still
    /// hold pages of `headers` and `data` from the sends it took, so they join the
    /// arenas in flight (freed by [`Self::finish`] once complete, leaked if never)
    /// instead of being freed and reused while queued data still points at them.
    pub(crate) fn abandon(&mut self, stream: &Stream, headers: &mut Vec<u8>, data: &mut AlignedBuf) {
        let ticket = stream.zerocopy_done() + stream.zerocopy_outstanding();
        let pair = (std::mem::take(headers), std::mem::take(data));
        self.in_flight.push_back((ticket, pair));
    }

    /// After completions were reaped: frees arenas, and reacts to the first COPIED report.
    fn after_reap(&mut self, stream: &Stream) {
        self.collect(stream);
        if !self.copied_seen && stream.stats.zc_copied > 0 {
            self.copied_seen = true;
            self.copied_reported(stream);
        }
    }

    /// Moves every pair whose ticket is complete back to the free list.
    fn collect(&mut self, stream: &Stream) {
        let done = stream.zerocopy_done();
        while self.in_flight.front().is_some_and(|(t, _)| *t <= done) {
            if let Some((_, pair)) = self.in_flight.pop_front() {
                self.free.push(pair);
            }
        }
    }

    fn copied_reported(&mut self, stream: &Stream) {
        match self.mode {
            ZeroCopy::Auto => {
                self.active = false;
                log::info!(
                    "{}: the kernel copied a zero-copy send (loopback, or a NIC without scatter-gather): \
                     zero-copy off for this connection",
                    stream.peer()
                );
            }
            _ => log::info!(
                "{}: the kernel copies zero-copy sends on this connection (loopback?); --zerocopy=on keeps them",
                stream.peer()
            ),
        }
    }

    /// At the end of the connection: waits for every outstanding completion, so the
    /// arenas can be freed. Arenas the kernel still holds after [`FINISH_WAIT`] (a peer
    /// that stopped reading) are leaked: freeing them could change data still queued.
    pub(crate) fn finish(&mut self, stream: &mut Stream) {
        let Some(&(last, _)) = self.in_flight.back() else { return };
        if let Err(e) = stream.wait_zerocopy(last, Some(FINISH_WAIT)) {
            log::debug!("{}: zero-copy completions: {e}", stream.peer());
        }
        self.collect(stream);
        self.free.clear();
        if !self.in_flight.is_empty() {
            log::warn!(
                "{}: {} zero-copy send buffers never reported complete; leaking them",
                stream.peer(),
                self.in_flight.len()
            );
            for (_, pair) in self.in_flight.drain(..) {
                std::mem::forget(pair);
            }
        }
    }
}

impl Drop for ZeroCopySender {
    /// Without [`Self::finish`] (a panic), arenas still lent to the kernel are leaked.
    fn drop(&mut self) {
        for (_, pair) in self.in_flight.drain(..) {
            std::mem::forget(pair);
        }
    }
}
