//! ferry's NBD client: URIs, the handshake, and a connection that keeps many requests
//! in flight.
//!
//! The data path follows the same rules as the server: requests are batched into one
//! vectored send with WRITE payloads sent straight from the caller's buffers, and READ
//! payloads are received straight into the caller's buffers (only the few bytes that
//! arrive together with a header are copied out of the receive buffer).
//!
//! # The copy engine
//!
//! `ferry copy` (and `ferry hash`, which is a copy to `null:` with a hash) lives in
//! `crates/client/src/copy/`, one file per kind of endpoint behind one interface, the way
//! nbdcopy keeps `file-ops.c`, `nbd-ops.c`, `pipe-ops.c` and `null-ops.c` apart:
//!
//! ```text
//! copy/mod.rs       options, planning (allocation map, queue, workers), the worker loop,
//!                   zero detection, the hash; opening an Endpoint is the one match on kinds
//! copy/endpoint.rs  trait Ops + Caps: size, what it can do, extents, batched read/write,
//!                   poll/complete for asynchronous endpoints, flush, close
//! copy/nbd.rs       NBD: many requests in flight per connection, one writev per batch
//! copy/file.rs      files and block devices: pread/pwrite, SEEK_DATA/SEEK_HOLE, fallocate
//! copy/pipe.rs      stdin (a stream of unknown size) and stdout: in order only
//! copy/null.rs      null: discards
//! copy/backend.rs   any ferry_backend::Backend (Endpoint::Backend(BackendEndpoint::new(name,
//!                   Arc<dyn Backend>))): disk image formats and stores as source or destination
//! ```
//!
//! The copy first reads the source's allocation map (`Ops::extents`: NBD block status,
//! SEEK_DATA/SEEK_HOLE, `Backend::extents`), then hands out pieces of `--request-size` from
//! one queue to `--connections` worker threads. Each worker owns its own opening of each end
//! (`Ops::reopen`: another NBD connection, a cloned file descriptor, the same shared
//! `Backend`) and `--requests` buffers; a buffer goes Free → Reading → Full → Writing → Free.
//! The worker knows no endpoint kind; it plans from `Caps`:
//!
//! | capability | who has it | what the worker does with it |
//! |---|---|---|
//! | `parallel` | NBD with multi-conn, files, backends, null | more than one worker |
//! | `in_order` | stdin, stdout | one worker; full buffers go out strictly in offset order |
//! | `extents` | NBD with block status, files, backends | holes are never read |
//! | `zero` | NBD with WRITE_ZEROES, files (fallocate), backends with `caps().zero`, null | zero runs go as `Data::Zero` (which may deallocate: that is all the trimming a copy needs); otherwise as WRITEs from a static page of zeroes |
//! | `zeroed` | a new file, a `BackendEndpoint::zeroed()`, null | zero runs are not written at all |
//! | `file_payloads` | plaintext NBD over a Unix socket | data from a source that offers `Ops::file` goes as sendfile payloads |
//! | `discards` | null | no zero detection (it would change nothing) |
//! | `read_only`, `size` | — | checked once when the destination is opened: a read-only or smaller destination is refused before anything is written |
//!
//! **Why a batch and a `done(slot, bytes)` callback.** The interface has to carry NBD (many
//! requests in flight per connection, replies in any order, later librbd aio) and plain
//! files (a `pwrite` is finished when it returns) without the worker telling them apart.
//! `Ops::read(batch)` and `Ops::write(batch)` take every request the worker has ready; a
//! synchronous endpoint does them in turn and calls `done` for each before returning, an
//! asynchronous one sends the whole batch in one writev (so batching, ferry's largest win on
//! small requests, stays a property of the endpoint) and calls `done` later from
//! `Ops::complete`, once the worker's `poll` on `Ops::poll_fd` saw a reply (or
//! `Ops::buffered` says one is already read). `done` carries bytes, not requests, so an
//! endpoint may split a write as it likes (1 MiB WRITEs of zeroes to a server without
//! WRITE_ZEROES) and a short read can mean the end of a stream (stdin). Buffers stay the
//! worker's: endpoints borrow them for one call, so NBD READ replies land straight in them
//! and WRITE payloads go straight from them, with no copy between source and destination.
//! The alternative, a future or a per-request object, would have given each request an owner
//! and an allocation; a pair of calls per batch and a callback cost nothing on the
//! synchronous path. A librbd endpoint fits the same shape: submit aio in `write`, wake the
//! poll through an eventfd from the completion callback, report in `complete`.
//!
//! **Writes to one local file take turns in user space.** The kernel runs one buffered write
//! of a regular file at a time (ext4, XFS and tmpfs take the inode lock for it), and a second
//! writer queued there spins on its core while the owner copies. So the file endpoint
//! (`copy/file.rs`, shared by every worker's opening) and the qcow2 `FileStore` take a mutex
//! around each `pwrite`: the waiter sleeps, reads still overlap the writes, and a qcow2 <->
//! raw conversion on ext4 burns a quarter to a third less CPU at the same speed (docs/benchmarks-history.md, section 13).
//! A file destination is also emptied through an opening of its own, closed before the copy
//! writes: ext4 writes back a file truncated to zero when that opening closes.
//!
//! Zero detection looks at 256 KiB blocks inside each 1 MiB request: a request becomes a run
//! of WRITEs and zero writes (or nothing where the destination already reads zeroes). Servers
//! without WRITE_ZEROES get zeroes as WRITEs. Holes are never read (on tmpfs, where one
//! SEEK_HOLE scans every page, a file with as many bytes allocated as it is long is taken as
//! all data without asking). A worker blocks in `poll` on its two ends' sockets when it has
//! nothing else to do.
//!
//! From a source that offers its file (`Ops::file`: local files) to a destination that takes
//! file payloads (NBD over a plaintext Unix socket) the data never enters user space: each
//! WRITE's header goes with `sendmsg` and its payload with `sendfile(2)` from the source's
//! page cache (`Data::File` → `Payload::File`), once one byte sent into a pipe has shown the
//! source's file system can feed sendfile. Zero detection then reads only the first 4 KiB of
//! each block and the rest of a block only when those are zero. Over TCP loopback sendfile
//! measured slower, so TCP reads into the buffer as before; under TLS the bytes must pass
//! through the cipher.
//!
//! **Selective copies, retries, proof and rate** (issues 20, 21) stay inside the engine, so
//! every endpoint kind gets them. A selection (`CopyOptions::select_context`: `--dirty-bitmap`;
//! `CopyOptions::ranges`: `--extents-from`) replaces the allocation map at planning:
//! `Ops::select` walks `base:allocation` and the named context in lock step
//! (`copy/contexts.rs`, over NBD block status or `Backend::meta_contexts`), `copy/ranges.rs`
//! parses range files, and the queue then holds only the selected pieces, their zero parts
//! as zero writes; the destination is opened in place and never taken for `zeroed`
//! (`write_caps`, used by first sends and retries alike). A failure goes to `recover`
//! (`copy/retry.rs` classifies it): a transient error reply sends that request again, a lost
//! connection is replaced through `Ops::reopen` and everything in flight on it is sent again,
//! with exponential backoff; anything else ends the copy. `--rate` is one clock
//! (`copy/rate.rs`) every worker takes from before a data read. `--verify` reads the
//! destination back with `verify::hash_range` and compares blkhashes with the one computed
//! on the way. `CopyOptions::cancel` (the binary's `interrupt.rs` sets it on SIGINT/SIGTERM)
//! is checked by every worker between batches, in 100 ms slices of its wait for replies and
//! in the `--rate` and retry sleeps: the copy ends with `CopyError::Interrupted`, and the
//! binary's usual failure path aborts or keeps an upload.
//!
//! **Resume** (`copy/journal.rs`, `CopyOptions::journal`; the binary's `copy_resume.rs`
//! builds the key and finds the file). The queue hands items out in ascending order and,
//! with a journal, keeps the offsets of the items handed out and not finished at the
//! destination (a count per offset: an item may be out twice after a rewind); the lowest of
//! them or the queue's position, whichever is lower, is the watermark W: every byte below it
//! is written. Every journal interval one worker (an atomic flag elects it) stops
//! taking items until its own slots are empty, reads W, flushes its destination opening
//! (a multi-conn FLUSH covers the writes every connection had replied to; an fsync covers
//! every opening of a file) and stores W; the other workers keep going. The first run stores
//! W = 0 once the destination is open (emptied or created), with whether it then read as
//! zeroes; a resumed run starts the queue at W, opens the destination in place, and keeps
//! that `zeroed` flag (above W the destination holds zeroes or the source's own bytes). A
//! resumed copy asked for a hash copies without one, then hashes the whole source with
//! `hash_range`. The journal is a small text file (magic, format, ferry version, source and
//! destination identity, options, source size, W, zeroed flag, CRC-32), replaced
//! atomically (a random `O_EXCL|O_NOFOLLOW` 0600 temporary file, renamed); a stored one
//! that differs from the copy being started is refused naming what differs (identities
//! redacted). After a destination reconnect the queue rewinds to the W of the last
//! successful flush (`Shared::flushed`): the lost server may have acknowledged writes above
//! it that it never flushed, so they go again, and W cannot pass them before they do.
//!
//! # Safety: bounded peers
//!
//! every list, string and reply a server can grow is capped
//! before allocation (option reply 64 KiB, 10,000 exports, 64 non-final replies per
//! option, 4096-byte strings, 65,536 pieces per READ, 4096 error chunks per request,
//! 16 MiB per non-data chunk, 1M ranges in a copy's allocation map, then coarsened); a
//! READ's chunks must cover it exactly once (`ReadCoverage`); the handshake timeout covers
//! the whole handshake.
//!
//! # What this crate owns
//!
//! `Uri` (doc/uri.md), `Connection` (connect, handshake, `submit` many requests in one
//! writev, `receive` completions with READ data landing in the caller's buffers), `copy`
//! (the engine of `ferry copy` and `ferry hash`: one `Ops` interface, one file per endpoint
//! kind — NBD, file/block device, pipe, null, any `Backend`)
//!
//! `unsafe`: forbidden.
#![forbid(unsafe_code)]

pub mod conn;
pub mod copy;
pub mod uri;

pub use conn::{Completion, ConnectOptions, Connection, Error, Payload, RemoteError, Submit};
pub use uri::{Transport, Uri, UriError};
