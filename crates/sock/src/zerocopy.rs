//! MSG_ZEROCOPY sends on TCP sockets (Linux 4.14+, `Documentation/networking/msg_zerocopy.rst`).
//!
//! With `SO_ZEROCOPY` set, a `sendmsg(MSG_ZEROCOPY)` pins the pages of its buffers
//! instead of copying them into the socket buffer. The buffers then belong to the kernel
//! until a completion notification covers that send: each successful zero-copy
//! `sendmsg` gets the next sequence number (0, 1, 2, ...), and notifications on the
//! socket's error queue report ranges `ee_info..=ee_data` of them as done. A
//! notification with `SO_EE_CODE_ZEROCOPY_COPIED` says the kernel copied the data after
//! all (always the case on loopback, where the receiver gets a copy anyway), so the
//! pinning was pure overhead.
//!
//! [`Stream::send_zerocopy`] returns a ticket; the caller reuses the buffers it sent once
//! [`Stream::zerocopy_done`] reaches that ticket. Sequence numbers are kept as `u64`
//! here (the kernel's are `u32` and wrap).

use crate::{Stream, IOV_MAX};
use std::collections::VecDeque;
use std::io::{self, IoSlice, Write};
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// `SO_ZEROCOPY` (`asm-generic/socket.h`; the same on every architecture ferry builds for
/// except sparc and mips, whose values differ and are not supported here).
const SO_ZEROCOPY: libc::c_int = 60;
/// `SO_EE_ORIGIN_ZEROCOPY` (`linux/errqueue.h`).
const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;
/// `SO_EE_CODE_ZEROCOPY_COPIED` (`linux/errqueue.h`): the kernel copied the data.
const SO_EE_CODE_ZEROCOPY_COPIED: u8 = 1;

/// Completion tracking for one socket's zero-copy sends.
#[derive(Debug, Default)]
pub(crate) struct Tracker {
    /// The sequence number the next zero-copy send gets.
    next: u64,
    /// Every send below this one is complete.
    done: u64,
    /// Completion of sends `done..`, for notifications that arrive out of order
    /// (TCP reports in order, but the API does not promise it).
    ahead: VecDeque<bool>,
}

impl Tracker {
    /// Marks the kernel's range `lo..=hi` complete. Returns how many sends it covered
    /// that were not complete before (a stale or impossible range covers none).
    fn complete(&mut self, lo: u32, hi: u32) -> u64 {
        let outstanding = self.next - self.done;
        // Extend the kernel's wrapping u32 numbers relative to `done`.
        let a = u64::from(lo.wrapping_sub(self.done as u32));
        let b = u64::from(hi.wrapping_sub(self.done as u32));
        if a > b || b >= outstanding {
            return 0;
        }
        if self.ahead.len() < (b + 1) as usize {
            self.ahead.resize((b + 1) as usize, false);
        }
        let mut newly = 0;
        for slot in self.ahead.range_mut(a as usize..=b as usize) {
            if !*slot {
                *slot = true;
                newly += 1;
            }
        }
        while self.ahead.front() == Some(&true) {
            self.ahead.pop_front();
            self.done += 1;
        }
        newly
    }
}

/// What one pass over the error queue found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reaped {
    /// Sends newly reported complete.
    pub completed: u64,
    /// Of those, sends the kernel reported as copied.
    pub copied: u64,
}

/// Checks that this kernel accepts `SO_ZEROCOPY` on a TCP socket (Linux 4.14 or later).
pub fn zerocopy_supported() -> io::Result<()> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    set_zerocopy(s.as_raw_fd())
}

fn set_zerocopy(fd: std::os::fd::RawFd) -> io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: `fd` is an open socket borrowed for the duration of the call; the option
    // value points to a live c_int and its size is passed alongside it.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_ZEROCOPY,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl Stream {
    /// Sets `SO_ZEROCOPY`, so that [`Stream::send_zerocopy`] can be used. Fails with
    /// `Unsupported` on a Unix socket (the kernel has MSG_ZEROCOPY for TCP and UDP only)
    /// and with the kernel's error where it lacks support.
    pub fn enable_zerocopy(&mut self) -> io::Result<()> {
        if self.is_unix() {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "MSG_ZEROCOPY does not exist for Unix sockets"));
        }
        set_zerocopy(self.as_raw_fd())?;
        self.zc = Some(Tracker::default());
        Ok(())
    }

    /// `SO_ZEROCOPY` is set on this socket.
    pub fn zerocopy_enabled(&self) -> bool {
        self.zc.is_some()
    }

    /// Every zero-copy send below this ticket is complete: buffers sent with a ticket
    /// at or below it may be reused.
    pub fn zerocopy_done(&self) -> u64 {
        self.zc.as_ref().map_or(0, |t| t.done)
    }

    /// Zero-copy sends not yet reported complete.
    pub fn zerocopy_outstanding(&self) -> u64 {
        self.zc.as_ref().map_or(0, |t| t.next - t.done)
    }

    /// Sends every byte of `bufs` with `sendmsg(MSG_ZEROCOPY)`, up to `IOV_MAX` slices
    /// per call, looping on short writes. Returns the ticket: the memory behind `bufs`
    /// must stay untouched (not written, not freed) until [`Stream::zerocopy_done`]
    /// reaches it.
    ///
    /// `ENOBUFS` (too many notifications pending, or pinned pages over `RLIMIT_MEMLOCK`)
    /// is handled by reaping completions and retrying; if nothing is outstanding to reap,
    /// that one call is sent with an ordinary copying `writev` and counted in
    /// `zc_nobufs`.
    pub fn send_zerocopy(&mut self, mut bufs: &mut [IoSlice<'_>]) -> io::Result<u64> {
        if self.zc.is_none() {
            return Err(io::Error::other("send_zerocopy on a socket without SO_ZEROCOPY"));
        }
        while !bufs.is_empty() {
            self.check_send_limit()?;
            let n = bufs.len().min(IOV_MAX);
            let msg = socket2::MsgHdr::new().with_buffers(&bufs[..n]);
            let written = match socket2::SockRef::from(&*self).sendmsg(&msg, libc::MSG_ZEROCOPY) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(w) => {
                    if let Some(t) = &mut self.zc {
                        t.next += 1;
                    }
                    self.stats.zc_sends += 1;
                    self.stats.zc_bytes += w as u64;
                    self.stats.sends += 1;
                    self.stats.send_bytes += w as u64;
                    w
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    self.stats.zc_nobufs += 1;
                    if self.zerocopy_outstanding() > 0 {
                        let want = self.zerocopy_done() + 1;
                        self.wait_zerocopy(want, None)?;
                        continue;
                    }
                    log::debug!("{}: MSG_ZEROCOPY send failed with ENOBUFS and nothing to reap: copying", self.peer());
                    match self.write_vectored(&bufs[..n]) {
                        Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                        Ok(w) => w,
                        Err(e) => {
                            self.retry_send(e)?;
                            continue;
                        }
                    }
                }
                Err(e) => {
                    self.retry_send(e)?;
                    continue;
                }
            };
            self.stats.iovecs += n as u64;
            IoSlice::advance_slices(&mut bufs, written);
        }
        Ok(self.zc.as_ref().map_or(0, |t| t.next))
    }

    /// Reads every completion notification waiting on the error queue, without
    /// blocking, and counts them (`zc_copied` for those the kernel copied).
    pub fn reap_zerocopy(&mut self) -> io::Result<Reaped> {
        let mut total = Reaped::default();
        if self.zc.is_none() {
            return Ok(total);
        }
        // One cmsghdr (16 bytes), one sock_extended_err (16 bytes) and the offender's
        // address (up to a 28-byte sockaddr_in6), with room to spare. Zeroed, because
        // the length the kernel reports is not the length it wrote: on IPv6 it reports
        // CMSG_SPACE (64 bytes) after writing CMSG_LEN (60), so the padding at the end
        // would otherwise be read uninitialised.
        let mut control = [MaybeUninit::new(0u8); 128];
        loop {
            let len = {
                let mut msg = socket2::MsgHdrMut::new().with_control(&mut control);
                // MSG_ERRQUEUE reads never block: an empty queue is EAGAIN.
                match socket2::SockRef::from(&*self).recvmsg(&mut msg, libc::MSG_ERRQUEUE) {
                    Ok(_) => msg.control_len(),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(total),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            };
            // SAFETY: every byte of `control` was initialised (zeroed above, and the kernel
            // writes only initialised bytes over them), `len` is clipped to its size, and
            // u8 has no invalid bit patterns.
            let bytes = unsafe { std::slice::from_raw_parts(control.as_ptr().cast::<u8>(), len.min(control.len())) };
            for ee in extended_errors(bytes) {
                if ee.errno != 0 || ee.origin != SO_EE_ORIGIN_ZEROCOPY {
                    continue;
                }
                let Some(t) = &mut self.zc else { break };
                let n = t.complete(ee.info, ee.data);
                total.completed += n;
                if ee.code & SO_EE_CODE_ZEROCOPY_COPIED != 0 {
                    total.copied += n;
                    self.stats.zc_copied += n;
                }
            }
        }
    }

    /// Reaps completions until every zero-copy send below `ticket` is complete, blocking
    /// in `poll` for the error queue in between. With a timeout, returns `TimedOut`
    /// when it passes first.
    pub fn wait_zerocopy(&mut self, ticket: u64, timeout: Option<Duration>) -> io::Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        // Under a send limit, look at it at least this often.
        const TICK: Duration = Duration::from_millis(100);
        loop {
            self.reap_zerocopy()?;
            if self.zerocopy_done() >= ticket {
                return Ok(());
            }
            self.check_send_limit()?;
            let left = match deadline {
                None if self.limit.is_some() => {
                    Some(rustix::event::Timespec::try_from(TICK).map_err(io::Error::other)?)
                }
                None => None,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "zero-copy completions did not arrive in time",
                        ));
                    }
                    Some(rustix::event::Timespec::try_from(left).map_err(io::Error::other)?)
                }
            };
            // POLLERR is always reported; asking for nothing else waits for the error queue.
            let mut fds = [rustix::event::PollFd::new(&*self, rustix::event::PollFlags::empty())];
            match rustix::event::poll(&mut fds, left.as_ref()) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            let rev = fds[0].revents();
            if rev.contains(rustix::event::PollFlags::ERR) {
                // The error queue has something, or the socket has a pending error.
                let before = self.zerocopy_done();
                self.reap_zerocopy()?;
                if self.zerocopy_done() == before {
                    if let Some(e) = socket2::SockRef::from(&*self).take_error()? {
                        return Err(e);
                    }
                }
            }
            if rev.contains(rustix::event::PollFlags::HUP) && self.zerocopy_done() < ticket {
                // The connection is gone; the kernel freed what it held when it dropped
                // the queued data, so anything still unreported will be reported now.
                self.reap_zerocopy()?;
                if self.zerocopy_done() < ticket {
                    return Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        "connection closed with zero-copy sends pending",
                    ));
                }
            }
        }
    }
}

/// One `sock_extended_err` (`linux/errqueue.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ExtendedErr {
    errno: u32,
    origin: u8,
    code: u8,
    info: u32,
    data: u32,
}

/// The `IP_RECVERR` / `IPV6_RECVERR` control messages in a control buffer, parsed
/// without pointer casts: `cmsghdr` is `{ len: usize, level: i32, type: i32 }` and
/// each message starts at a multiple of `usize`'s size.
fn extended_errors(mut buf: &[u8]) -> impl Iterator<Item = ExtendedErr> + '_ {
    const W: usize = std::mem::size_of::<usize>();
    const HDR: usize = W + 8;
    std::iter::from_fn(move || loop {
        if buf.len() < HDR {
            return None;
        }
        let len = usize::from_ne_bytes(buf[..W].try_into().ok()?);
        let level = i32::from_ne_bytes(buf[W..W + 4].try_into().ok()?);
        let ty = i32::from_ne_bytes(buf[W + 4..W + 8].try_into().ok()?);
        if len < HDR || len > buf.len() {
            return None;
        }
        let data = &buf[HDR..len];
        let next = len.div_ceil(W) * W;
        buf = &buf[next.min(buf.len())..];
        let is_recverr =
            (level == libc::SOL_IP && ty == libc::IP_RECVERR) || (level == libc::SOL_IPV6 && ty == libc::IPV6_RECVERR);
        if is_recverr && data.len() >= 16 {
            let u32_at = |i: usize| u32::from_ne_bytes([data[i], data[i + 1], data[i + 2], data[i + 3]]);
            return Some(ExtendedErr {
                errno: u32_at(0),
                origin: data[4],
                code: data[6],
                info: u32_at(8),
                data: u32_at(12),
            });
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Inner, Listener};
    use std::io::Read;

    #[test]
    fn tracker_in_order_out_of_order_and_wrapping() {
        let mut t = Tracker { next: 5, ..Tracker::default() };
        assert_eq!(t.complete(0, 1), 2);
        assert_eq!(t.done, 2);
        assert_eq!(t.complete(3, 4), 2);
        assert_eq!(t.done, 2, "a gap at 2 holds `done` back");
        assert_eq!(t.complete(2, 2), 1);
        assert_eq!(t.done, 5);
        assert_eq!(t.complete(0, 4), 0, "stale range");
        assert_eq!(t.complete(5, 5), 0, "never sent");
        // Across the kernel's u32 wrap.
        let base = u64::from(u32::MAX) - 1;
        let mut t = Tracker { next: base + 4, done: base, ahead: VecDeque::new() };
        assert_eq!(t.complete(u32::MAX - 1, 1), 4);
        assert_eq!(t.done, base + 4);
    }

    #[test]
    fn parses_control_messages() {
        const W: usize = std::mem::size_of::<usize>();
        let mut buf = Vec::new();
        let mut push = |level: i32, ty: i32, data: &[u8]| {
            let len = W + 8 + data.len();
            buf.extend_from_slice(&len.to_ne_bytes());
            buf.extend_from_slice(&level.to_ne_bytes());
            buf.extend_from_slice(&ty.to_ne_bytes());
            buf.extend_from_slice(data);
            while buf.len() % W != 0 {
                buf.push(0);
            }
        };
        let mut ee = Vec::new();
        ee.extend_from_slice(&0u32.to_ne_bytes());
        ee.extend_from_slice(&[SO_EE_ORIGIN_ZEROCOPY, 0, SO_EE_CODE_ZEROCOPY_COPIED, 0]);
        ee.extend_from_slice(&7u32.to_ne_bytes());
        ee.extend_from_slice(&9u32.to_ne_bytes());
        push(libc::SOL_SOCKET, 1, &[1, 2, 3]);
        push(libc::SOL_IPV6, libc::IPV6_RECVERR, &ee);
        let got: Vec<_> = extended_errors(&buf).collect();
        assert_eq!(
            got,
            vec![ExtendedErr {
                errno: 0,
                origin: SO_EE_ORIGIN_ZEROCOPY,
                code: SO_EE_CODE_ZEROCOPY_COPIED,
                info: 7,
                data: 9
            }]
        );
        assert_eq!(extended_errors(&buf[..20]).count(), 0, "a truncated buffer yields nothing");
    }

    /// Over loopback the kernel copies every zero-copy send and says so.
    #[test]
    fn loopback_sends_complete_and_report_copied() {
        let l = Listener::bind_tcp(&"127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = l.local_tcp_addr().unwrap();
        let mut c = Stream::connect_tcp(&addr).unwrap();
        let mut s = l.accept().unwrap();
        s.enable_zerocopy().unwrap();
        assert!(s.zerocopy_enabled());
        let total = 8 * 256 * 1024;
        let reader = std::thread::spawn(move || {
            let mut v = vec![0u8; total];
            c.read_exact(&mut v).unwrap();
            v
        });
        let mut bufs: Vec<Vec<u8>> = (0..8u8).map(|i| vec![i; 256 * 1024]).collect();
        let mut ticket = 0;
        for b in &bufs {
            ticket = s.send_zerocopy(&mut [IoSlice::new(b)]).unwrap();
        }
        assert!(ticket >= 8);
        s.wait_zerocopy(ticket, Some(Duration::from_secs(10))).unwrap();
        assert_eq!(s.zerocopy_outstanding(), 0);
        // The buffers are ours again.
        bufs.iter_mut().for_each(|b| b.fill(0xee));
        let v = reader.join().unwrap();
        for (i, chunk) in v.chunks(256 * 1024).enumerate() {
            assert!(chunk.iter().all(|&x| x == i as u8), "chunk {i} corrupted");
        }
        assert_eq!(s.stats.zc_sends, ticket);
        assert_eq!(s.stats.zc_bytes, total as u64);
        assert_eq!(s.stats.zc_copied, ticket, "loopback copies every send: {}", s.stats);
    }

    #[test]
    fn unix_sockets_refuse_zerocopy() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut s = Stream::new(Inner::Unix(a));
        let e = s.enable_zerocopy().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Unsupported);
        assert!(!s.zerocopy_enabled());
        zerocopy_supported().expect("this kernel supports SO_ZEROCOPY on TCP");
    }
}
