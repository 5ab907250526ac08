//! The NBD server: exports, the accept loop, a thread per busy connection that runs
//! the handshake state machine and then the transmission loop, and one poller thread
//! that holds idle connections without threads or buffers.
//!
//! ## Metadata contexts and BLOCK_STATUS
//!
//! An export's metadata contexts are a list of `ferry_backend::MetaContext` objects kept by
//! `ferry_server::Exports` (`base:allocation` first, then the backend's own, filtered by
//! `ferry serve -B/-A`); the protocol crate sees only their names (`Catalog::contexts`).
//! `SET_META_CONTEXT` records (id, index into that list) for every context it selects, ids
//! never reused on a connection; `Negotiated`/`Session::meta_contexts` carry them into the
//! transmission phase, where the connection resolves the indexes to the objects once. A
//! BLOCK_STATUS asks each selected context in turn (or, with extended headers, those the
//! request's filter payload names; `Session::validate_with` checks that payload at the
//! boundary) and queues one status chunk each, DONE on the last; each context's extents are
//! clipped to the request and share one bound on the number of extents. A context that fails
//! ends the reply with an error chunk.
//!
//! # Connections at scale: a thread per busy connection, one poller for idle ones
//!
//! A host serving disks to hundreds of VMs holds thousands of connections, most of them
//! idle at any moment (paused VMs, several multi-conn connections per disk, probes).
//! Measured before the change (docs/benchmarks-history.md, section 11): a thread per connection cost
//! 33 to 75 KiB of resident memory per *fresh* idle connection (its stack pages and
//! allocator arenas; 10,000 reached 900 MiB) and up to 1.5 MiB per connection that had once
//! been busy (the 512 KiB receive buffer and 1 MiB data arena stay resident), plus a second
//! descriptor each (a clone kept for shutdown), and the default cap of 100 locked every
//! further client out. The data path, on the other hand, is fastest as it is: one blocking
//! `read` per batch and one `writev` per batch of replies, no hand-off between threads.
//!
//! So the thread-per-connection path stays for connections that are busy, and idleness is
//! handled beside it:
//!
//! 1. After the handshake a connection's socket gets a receive timeout of the idle grace
//!    period (250 ms, `Config::idle_grace`), so a busy connection pays no extra syscall.
//!    When the loop's `read` times out with every request answered (at most the start of a
//!    request header received: those few bytes are parked with the connection and put back
//!    when it wakes, so one byte of a header cannot pin a thread) (and, under TLS, no
//!    plaintext buffered in OpenSSL), `Transmission::release` frees the
//!    receive buffer, the arenas, the payload buffer and OpenSSL's read-ahead, and
//!    `Poller::park` hands the connection (socket, session, reply mode, counters: about
//!    1 KiB) to the poller thread through a channel and an eventfd. The thread ends.
//! 2. The poller keeps parked connections in one epoll set (rustix, level-triggered). When
//!    one becomes readable (a request, or the client closing) it is taken out of the set and
//!    a new thread (256 KiB stack) allocates fresh buffers (`acquire`) and goes on serving
//!    it. Waking costs a thread start and page faults on fresh buffers, tens of
//!    microseconds, once per burst after 250 ms of silence.
//! 3. Large buffers are freed to the kernel at once: the receive buffer, the data arena and
//!    the write buffer are each their own anonymous mapping (`ferry_sock::AlignedBuf`),
//!    unmapped when the connection parks. glibc's allocator is not tuned for this: fixing
//!    its mmap threshold (as an earlier version did) made every large buffer a library
//!    allocates per request a fresh mapping too, and librbd then took a page fault per
//!    4 KiB of every read (twice the server CPU per GiB; docs/benchmarks-history.md, section 14).
//! 4. `--idle-timeout`: the poller scans parked connections four times per timeout and
//!    closes those silent for longer; a connection in the middle of a request is on a
//!    thread, not parked, and a payload that trickles in is never idleness.
//! 5. Limits: `RLIMIT_NOFILE` is raised to its hard limit at start and the default
//!    `--max-connections` is what it allows (one descriptor per connection, 64 kept for the
//!    server), logged at start. Refusals (either cap, or `accept` failing with EMFILE) are
//!    logged as warnings at most once every 5 s, with a count of the ones held back.
//! 6. Shutdown needs no second descriptor per connection: threads see the stop flag within
//!    one grace period (their read timeout) or after answering what they hold; the poller
//!    closes parked connections, which have nothing in flight.
//! 7. Every send is bounded (`ferry_sock::SendLimit`, `Stream::set_send_limit`): the socket
//!    has a 250 ms send timeout, and a send that makes no progress fails once the
//!    handshake deadline passes (during the handshake, TLS handshake included) or once the
//!    stop flag has been seen for `--shutdown-grace` (default 5 s). So a client that sends
//!    options and never reads the replies is dropped at the handshake deadline, and SIGTERM
//!    ends the server within the grace whatever its peers do.
//!
//! Handshakes still run on a thread each (bounded by `--handshake-timeout`, sends included) with a 4 KiB
//! buffer that grows only for large options. TLS connections are parked like the others:
//! the OpenSSL session moves with the connection, its read-ahead buffer is freed, and a
//! connection with plaintext already decrypted is not parked.
//!
//! Alternatives measured or weighed: a full event loop (every connection non-blocking,
//! one thread per core) would make the busy path pay for readiness polling and partial
//! reads and writes, and the backends block anyway (`pread`, later librbd), so it would need
//! a thread pool behind it; io_uring likewise, with a second code path for TLS. Parking
//! keeps the one data path that is measured fastest and removes the cost that scaled with
//! the number of connections. 10,000 idle connections: 50 to 100 MiB and 2 threads; the
//! server's CPU time per request of a busy client beside them is the same as alone
//! (docs/benchmarks-history.md, section 11).
//!
//! # Safety: replies that cannot lie
//!
//! a sendfile READ's data chunk goes out without
//! DONE and a NONE+DONE chunk follows; if sendfile fails, the chunk is padded to its
//! declared length and an `ERROR_OFFSET` (EIO) chunk ends the reply, so the client gets
//! EIO and the connection stays in step. A zero-copy batch that fails part way keeps its
//! arenas with those in flight until the kernel reports them complete.
//!
//! # What this crate owns
//!
//! `Exports` (the handshake's `Catalog`), `Server::run` (poll on listeners and a wake-up
//! socket; connection limits; shutdown), `conn` (handshake driver and transmission loop),
//! `poller` (one epoll thread holding idle connections, `--idle-timeout`), `zerocopy`
//! (`--zerocopy`: which batches go out with `MSG_ZEROCOPY`, and the send arenas lent to the
//! kernel until their completion)
//!
//! `unsafe`: forbidden.
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
