//! [`S3Writer`]: an object written as a multipart upload by many threads at once.

use crate::client::{xml_text, Client, Method, SIGN_FOR};
use crate::sigv4;
use crate::{S3Config, S3Error, S3Url};
use ferry_backend::{Backend, Capabilities, Error, ErrorKind, ZeroMode};
use ferry_http::HttpOptions;
use md5::{Digest, Md5};
use rusty_s3::actions::{CompleteMultipartUpload, CreateMultipartUpload};
use rusty_s3::S3Action;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// The smallest part ferry uploads (AWS CLI's default; S3's minimum is 5 MiB).
pub const MIN_PART_SIZE: u64 = 8 << 20;
/// The most parts one multipart upload may have (S3's limit).
pub const MAX_PARTS: u64 = 10_000;
/// The largest object S3 stores: 5 TiB.
pub const MAX_OBJECT_SIZE: u64 = 5 << 40;
/// The largest part S3 accepts: 5 GiB.
pub const MAX_PART_SIZE: u64 = 5 << 30;
/// S3's smallest part (except the last).
const S3_MIN_PART: u64 = 5 << 20;
/// Disjoint written pieces kept per part before writes count as too scattered.
const MAX_PIECES: usize = 4096;

/// The part size for an object of `size` bytes: [`MIN_PART_SIZE`], doubled until the
/// object fits in [`MAX_PARTS`] parts (1 GiB: 8 MiB; 100 GiB: 16 MiB; 5 TiB: 1 GiB).
/// Objects over [`MAX_OBJECT_SIZE`] are refused.
pub fn part_size_for(size: u64) -> Result<u64, String> {
    if size > MAX_OBJECT_SIZE {
        return Err(format!(
            "{size} bytes is more than S3's largest object (5 TiB = {MAX_OBJECT_SIZE} bytes): \
             split the image, or copy it to a store without that limit"
        ));
    }
    let mut part = MIN_PART_SIZE;
    while size.div_ceil(part) > MAX_PARTS {
        part *= 2;
    }
    Ok(part)
}

/// The most bytes of part buffers a writer holds: `memory_limit`, raised to three parts
/// (so parts can fill while others upload). With the default 512 MiB that is 512 MiB for
/// parts up to 128 MiB (objects up to 1.2 TiB), then 768 MiB, 1.5 GiB and, for 1 GiB
/// parts (objects over 4.9 TiB), 3 GiB.
pub(crate) fn held_limit(memory_limit: u64, part_size: u64) -> u64 {
    memory_limit.max(part_size.saturating_mul(3))
}

/// How an [`S3Writer`] sizes its parts and its memory.
#[derive(Debug, Clone)]
pub struct WriterOptions {
    /// Bytes per part; `None`: [`part_size_for`] the size. Must be 5 MiB to 5 GiB and give
    /// at most 10,000 parts.
    pub part_size: Option<u64>,
    /// The most bytes held in part buffers at once (written but not yet uploaded), raised
    /// to three parts when parts are larger. A write that needs a new buffer above it waits
    /// for an upload to free one.
    pub memory_limit: u64,
    /// How long a write may wait for memory while nothing moves (no buffer filled, no part
    /// being uploaded) before it fails: writes arriving so far out of order that every buffer
    /// waits for bytes that only waiting writers hold would otherwise wait forever.
    pub stall_timeout: Duration,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions { part_size: None, memory_limit: 512 << 20, stall_timeout: Duration::from_secs(120) }
    }
}

/// The byte ranges of one part written so far, sorted, disjoint and not touching.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Ranges(Vec<(u64, u64)>);

impl Ranges {
    /// Adds `start..end`; false when that would keep more than [`MAX_PIECES`] pieces.
    pub(crate) fn insert(&mut self, start: u64, end: u64) -> bool {
        if start >= end {
            return true;
        }
        // The pieces that overlap or touch start..end are merged with it.
        let first = self.0.partition_point(|&(_, e)| e < start);
        let last = self.0.partition_point(|&(s, _)| s <= end);
        if first == last && self.0.len() >= MAX_PIECES {
            return false;
        }
        let (mut s, mut e) = (start, end);
        if first < last {
            s = s.min(self.0[first].0);
            e = e.max(self.0[last - 1].1);
        }
        self.0.splice(first..last, [(s, e)]);
        true
    }

    pub(crate) fn covers(&self, len: u64) -> bool {
        len == 0 || self.0.first() == Some(&(0, len))
    }

    /// The first range of `0..len` not written.
    pub(crate) fn first_gap(&self, len: u64) -> Option<(u64, u64)> {
        let mut at = 0;
        for &(s, e) in &self.0 {
            if s > at {
                return Some((at, s));
            }
            at = e;
        }
        (at < len).then_some((at, len))
    }
}

enum Part {
    /// No byte written.
    Empty,
    /// Some bytes written into `buf` (the whole part's length).
    Filling { buf: Vec<u8>, have: Ranges },
    /// Being uploaded by some thread.
    Uploading,
    /// Uploaded; S3 named it `etag`.
    Done { etag: String },
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Open,
    Completed,
    Aborted,
}

struct State {
    parts: Vec<Part>,
    /// Bytes of the buffers of parts being filled or uploaded.
    held: u64,
    /// Bumped whenever bytes land in a buffer or memory is freed: what a waiting writer
    /// watches to tell a slow copy from a stuck one.
    progress: u64,
    phase: Phase,
}

/// What a write puts in the object.
#[derive(Clone, Copy)]
enum Src<'a> {
    Bytes(&'a [u8]),
    Zero,
}

/// An S3 object being written as a multipart upload; a write-only [`Backend`] of the
/// size given at creation.
///
/// - The object is cut into parts of [`part_size_for`] the size. The first write into a
///   part allocates its buffer (a write covering a whole part is uploaded straight from
///   the caller's buffer, and a zeroed whole part from one shared zero buffer, without a
///   buffer of its own). Which bytes of a part have arrived is kept as a set of ranges,
///   so a range written twice (a retried request) counts once.
/// - When every byte of a part has arrived, the thread whose write completed it uploads
///   it (UploadPart with its SHA-256 signed, retried on 5xx, timeouts and dropped
///   connections), then frees the buffer. The copy engine's workers thus upload in
///   parallel, and a write returns once its part, if it completed one, is stored.
/// - Memory: at most [`WriterOptions::memory_limit`] bytes (512 MiB by default, at least
///   three parts) of buffers exist at once; a write needing another waits for an upload
///   to free one, and fails after [`WriterOptions::stall_timeout`] without progress.
/// - A part whose upload failed keeps its buffer, and is sent again by the next write
///   into it or by [`S3Writer::complete`].
/// - Nothing is visible in the bucket until [`S3Writer::complete`]; [`S3Writer::abort`],
///   or dropping the writer before completing, aborts the upload so no parts are left
///   (and billed).
/// - Reads are refused (the object does not exist yet); `flush` succeeds and does
///   nothing, since durability comes from `complete`; FUA is not offered.
pub struct S3Writer {
    client: Client,
    size: u64,
    part_size: u64,
    memory_limit: u64,
    stall_timeout: Duration,
    /// `None` for an empty object, written by one PutObject on completion.
    upload_id: Option<String>,
    state: Mutex<State>,
    changed: Condvar,
    zeros: OnceLock<(Vec<u8>, String)>,
    /// Dropped unfinished, leave the upload for a later [`S3Writer::resume_upload`]
    /// instead of aborting it ([`S3Writer::keep_unfinished`]).
    keep: AtomicBool,
}

impl S3Writer {
    /// Starts a multipart upload of a `size`-byte object at `url`, with the default
    /// [`WriterOptions`].
    pub fn create(url: &S3Url, cfg: &S3Config, http: &HttpOptions, size: u64) -> Result<S3Writer, S3Error> {
        S3Writer::create_with(url, cfg, http, size, &WriterOptions::default())
    }

    /// As [`S3Writer::create`], with the part size and memory limit given.
    pub fn create_with(
        url: &S3Url,
        cfg: &S3Config,
        http: &HttpOptions,
        size: u64,
        opts: &WriterOptions,
    ) -> Result<S3Writer, S3Error> {
        checked_part_size(url, size, opts)?;
        let client = Client::new(url, cfg, http)?;
        let upload_id = match size {
            0 => None,
            _ => Some(create_upload(&client)?),
        };
        S3Writer::with_upload(client, size, opts, upload_id)
    }

    /// A writer of the upload `upload_id` (already started).
    fn with_upload(
        client: Client,
        size: u64,
        opts: &WriterOptions,
        upload_id: Option<String>,
    ) -> Result<S3Writer, S3Error> {
        let url = client.url.clone();
        let part_size = checked_part_size(&url, size, opts)?;
        let nparts = usize::try_from(size.div_ceil(part_size))
            .map_err(|_| S3Error::Object { target: url.to_string(), message: "too many parts".into() })?;
        log::debug!("{url}: multipart upload of {size} bytes in {nparts} parts of {part_size} bytes");
        let mut parts = Vec::new();
        parts.resize_with(nparts, || Part::Empty);
        Ok(S3Writer {
            client,
            size,
            part_size,
            memory_limit: held_limit(opts.memory_limit, part_size),
            stall_timeout: opts.stall_timeout,
            upload_id,
            state: Mutex::new(State { parts, held: 0, progress: 0, phase: Phase::Open }),
            changed: Condvar::new(),
            zeros: OnceLock::new(),
            keep: AtomicBool::new(false),
        })
    }

    /// Continues the newest multipart upload of `url` in progress (one an earlier copy
    /// left, interrupted), or starts one when there is none: the parts already stored
    /// (ListParts) count as written, and later writes into them are dropped, so the
    /// source must be the same as the first time. The size must be the same too, and so
    /// must the part size, which is checked against every stored part's length.
    pub fn resume(
        url: &S3Url,
        cfg: &S3Config,
        http: &HttpOptions,
        size: u64,
        opts: &WriterOptions,
    ) -> Result<S3Writer, S3Error> {
        let client = Client::new(url, cfg, http)?;
        let Some(upload_id) = client.pending_uploads()?.pop() else {
            log::info!("{url}: no interrupted upload to resume: starting one");
            return S3Writer::create_with(url, cfg, http, size, opts);
        };
        S3Writer::continue_upload(client, size, opts, upload_id)
    }

    /// Continues the multipart upload `upload_id` of `url`, as [`S3Writer::resume`] does
    /// the newest one: its stored parts count as written. An upload that no longer exists
    /// (aborted, completed, or expired by a lifecycle rule) is an error that says so.
    pub fn resume_upload(
        url: &S3Url,
        cfg: &S3Config,
        http: &HttpOptions,
        size: u64,
        opts: &WriterOptions,
        upload_id: &str,
    ) -> Result<S3Writer, S3Error> {
        let client = Client::new(url, cfg, http)?;
        S3Writer::continue_upload(client, size, opts, upload_id.to_string())
    }

    fn continue_upload(
        client: Client,
        size: u64,
        opts: &WriterOptions,
        upload_id: String,
    ) -> Result<S3Writer, S3Error> {
        let url = &client.url.clone();
        // Checked before the writer exists: a writer dropped on an error would abort an
        // upload that another try, with the right size, could still resume.
        let part_size = checked_part_size(url, size, opts)?;
        let nparts = size.div_ceil(part_size);
        let mut done = Vec::new();
        let stored = client.list_parts(&upload_id, nparts).map_err(|e| match e {
            e if e.code() == Some("NoSuchUpload") => S3Error::Object {
                target: url.to_string(),
                message: format!(
                    "the interrupted upload {upload_id} no longer exists (it was aborted, completed or expired): \
                     nothing is left to resume; start the upload afresh (`ferry copy --restart`)"
                ),
            },
            // A part this upload cannot have (another size or part size), or a hostile answer.
            S3Error::Object { target, message } => S3Error::Object {
                target,
                message: format!(
                    "cannot resume upload {upload_id}: {message}; resume with the size and part size it was \
                     started with, or abort it (`aws s3api abort-multipart-upload`) and copy afresh"
                ),
            },
            _ => e,
        })?;
        for (number, etag, len) in stored {
            let fail = |why: String| S3Error::Object {
                target: url.to_string(),
                message: format!(
                    "cannot resume upload {upload_id}: {why}; resume with the size and part size it was started \
                     with, or abort it (`aws s3api abort-multipart-upload`) and copy afresh"
                ),
            };
            let idx = u64::from(number).wrapping_sub(1);
            if idx >= nparts {
                return Err(fail(format!("it has part {number}, not one of the {nparts} parts of {size} bytes")));
            }
            let expected = part_size.min(size - idx * part_size);
            if len != expected {
                return Err(fail(format!(
                    "its part {number} is {len} bytes where this copy's is {expected} (another size or part size)"
                )));
            }
            done.push((idx as usize, etag));
        }
        let mut w = S3Writer::with_upload(client, size, opts, Some(upload_id.clone()))?;
        let st = w.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let kept = done.len();
        for (idx, etag) in done {
            st.parts[idx] = Part::Done { etag };
        }
        log::info!("{url}: resuming upload {upload_id}: {kept} of {nparts} parts already stored");
        Ok(w)
    }

    /// The byte ranges of the object already stored (uploaded parts), in order: after
    /// [`S3Writer::resume`], what a copy need not send again.
    pub fn stored_ranges(&self) -> Vec<std::ops::Range<u64>> {
        let st = self.lock();
        let mut out: Vec<std::ops::Range<u64>> = Vec::new();
        for (idx, p) in st.parts.iter().enumerate() {
            if let Part::Done { .. } = p {
                let (s, len) = self.part_range(idx);
                match out.last_mut() {
                    Some(last) if last.end == s => last.end = s + len,
                    _ => out.push(s..s + len),
                }
            }
        }
        out
    }

    /// The rest: `(offset, length)` of each stretch not yet stored, in order, the form
    /// of the copy engine's `CopyOptions::ranges`. After [`S3Writer::resume`], a copy of
    /// these ranges finishes the object.
    pub fn unstored_ranges(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut at = 0;
        for r in self.stored_ranges().into_iter().chain(std::iter::once(self.size..self.size)) {
            if r.start > at {
                out.push((at, r.start - at));
            }
            at = r.end;
        }
        out
    }

    /// A resumable copy (`ferry copy --resume`): if this writer is dropped before
    /// [`S3Writer::complete`], the upload and the parts stored so far are kept (and
    /// billed) for a later run to continue with [`S3Writer::resume_upload`], instead of
    /// being aborted. [`S3Writer::abort`] still aborts.
    pub fn keep_unfinished(&self) {
        self.keep.store(true, Ordering::SeqCst);
    }

    /// The object written.
    pub fn url(&self) -> &S3Url {
        &self.client.url
    }

    /// Bytes per part (the last part may be shorter).
    pub fn part_size(&self) -> u64 {
        self.part_size
    }

    /// How many parts the object has.
    pub fn parts(&self) -> u64 {
        self.size.div_ceil(self.part_size)
    }

    /// The multipart upload's ID (`None` for an empty object).
    pub fn upload_id(&self) -> Option<&str> {
        self.upload_id.as_deref()
    }

    /// The object's part `idx` as `(offset, length)`.
    fn part_range(&self, idx: usize) -> (u64, u64) {
        let start = idx as u64 * self.part_size;
        (start, self.part_size.min(self.size - start))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A thread that panicked while holding the lock left consistent data (every
        // change is one assignment), so the state is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn target(&self) -> String {
        self.client.url.to_string()
    }

    fn refused(&self, phase: Phase) -> S3Error {
        let message = match phase {
            Phase::Completed => "the upload is already complete: no more writes".to_string(),
            _ => "the upload was aborted: no more writes".to_string(),
        };
        S3Error::Object { target: self.target(), message }
    }

    /// Puts `src` at `offset..offset + len`, part by part.
    fn put(&self, offset: u64, len: u64, src: Src<'_>) -> Result<(), S3Error> {
        let end = offset.checked_add(len).filter(|&e| e <= self.size).ok_or_else(|| S3Error::Object {
            target: self.target(),
            message: format!("{len} bytes at offset {offset} go past the object's end ({} bytes)", self.size),
        })?;
        let mut at = offset;
        while at < end {
            let idx = usize::try_from(at / self.part_size).unwrap_or(usize::MAX);
            let (pstart, plen) = self.part_range(idx);
            let stop = end.min(pstart + plen);
            let piece = match src {
                Src::Bytes(b) => Src::Bytes(&b[(at - offset) as usize..(stop - offset) as usize]),
                Src::Zero => Src::Zero,
            };
            self.fill(idx, at - pstart, stop - pstart, piece)?;
            at = stop;
        }
        Ok(())
    }

    /// Puts `src` at `lo..hi` of part `idx`, and uploads the part if that completed it.
    fn fill(&self, idx: usize, lo: u64, hi: u64, src: Src<'_>) -> Result<(), S3Error> {
        let plen = self.part_range(idx).1;
        let mut st = self.lock();
        loop {
            if st.phase != Phase::Open {
                return Err(self.refused(st.phase));
            }
            match &mut st.parts[idx] {
                Part::Done { .. } | Part::Uploading => {
                    // The part is stored or being stored: this range was written before
                    // (a retried request), and what was sent then stands.
                    log::debug!("{}: part {} written again after it was complete; ignored", self.target(), idx + 1);
                    return Ok(());
                }
                Part::Filling { buf, have } => {
                    if !have.insert(lo, hi) {
                        return Err(S3Error::Object {
                            target: self.target(),
                            message: format!(
                                "part {} got over {MAX_PIECES} separate pieces of writes; write larger or \
                                 contiguous ranges",
                                idx + 1
                            ),
                        });
                    }
                    let dst = &mut buf[lo as usize..hi as usize];
                    match src {
                        Src::Bytes(b) => dst.copy_from_slice(b),
                        Src::Zero => dst.fill(0),
                    }
                    st.progress += 1;
                    if !matches!(&st.parts[idx], Part::Filling { have, .. } if have.covers(plen)) {
                        return Ok(());
                    }
                    let Part::Filling { buf, .. } = std::mem::replace(&mut st.parts[idx], Part::Uploading) else {
                        unreachable!("matched just above")
                    };
                    drop(st);
                    return self.upload_held(idx, buf);
                }
                Part::Empty if lo == 0 && hi == plen => {
                    // A whole part in one write: straight from the caller's bytes.
                    st.parts[idx] = Part::Uploading;
                    drop(st);
                    let body = match src {
                        Src::Bytes(b) => b,
                        Src::Zero => &self.zeros().0[..plen as usize],
                    };
                    let r = self.upload(idx, body, matches!(src, Src::Zero));
                    let mut st = self.lock();
                    st.parts[idx] = match &r {
                        Ok(etag) => Part::Done { etag: etag.clone() },
                        // Keep the bytes (they were the caller's) for the next try, memory
                        // allowing; else a retried write brings them again.
                        Err(_) if st.phase == Phase::Open && st.held + plen <= self.memory_limit => {
                            st.held += plen;
                            let mut have = Ranges::default();
                            have.insert(0, plen);
                            let buf = match src {
                                Src::Bytes(b) => b.to_vec(),
                                Src::Zero => vec![0; plen as usize],
                            };
                            Part::Filling { buf, have }
                        }
                        Err(_) => Part::Empty,
                    };
                    st.progress += 1;
                    self.changed.notify_all();
                    return r.map(|_| ());
                }
                Part::Empty => {
                    if st.held + plen > self.memory_limit {
                        let seen = st.progress;
                        let (guard, timeout) =
                            self.changed.wait_timeout(st, self.stall_timeout).unwrap_or_else(|p| p.into_inner());
                        st = guard;
                        // An upload in flight will free memory (or fail) within its own
                        // timeouts: only a wait with none and no bytes arriving is stuck.
                        let uploading = st.parts.iter().any(|p| matches!(p, Part::Uploading));
                        if timeout.timed_out() && st.progress == seen && !uploading {
                            return Err(S3Error::Object {
                                target: self.target(),
                                message: format!(
                                    "{} MiB of part buffers (the limit) wait for bytes that have not come for {:?}; \
                                     writes arrive too far out of order: use fewer workers or requests in flight",
                                    st.held >> 20,
                                    self.stall_timeout
                                ),
                            });
                        }
                        continue;
                    }
                    st.held += plen;
                    st.parts[idx] = Part::Filling { buf: vec![0; plen as usize], have: Ranges::default() };
                    // Loops to fill it.
                }
            }
        }
    }

    /// Uploads part `idx` from its own buffer `buf`, then frees the buffer; a failed
    /// upload puts the buffer back, complete, for the next try.
    fn upload_held(&self, idx: usize, buf: Vec<u8>) -> Result<(), S3Error> {
        let r = self.upload(idx, &buf, false);
        let mut st = self.lock();
        match &r {
            Ok(etag) => {
                st.parts[idx] = Part::Done { etag: etag.clone() };
                st.held -= buf.len() as u64;
            }
            Err(_) if st.phase == Phase::Aborted => {
                st.parts[idx] = Part::Empty;
                st.held -= buf.len() as u64;
            }
            Err(_) => {
                let mut have = Ranges::default();
                have.insert(0, buf.len() as u64);
                st.parts[idx] = Part::Filling { buf, have };
            }
        }
        st.progress += 1;
        self.changed.notify_all();
        r.map(|_| ())
    }

    /// One zeroed part's bytes and their SHA-256 (calloc'd: untouched pages cost no memory).
    fn zeros(&self) -> &(Vec<u8>, String) {
        self.zeros.get_or_init(|| {
            let z = vec![0u8; self.part_size as usize];
            let sha = sigv4::payload_sha256(&z);
            (z, sha)
        })
    }

    /// UploadPart of part `idx` (number `idx + 1`): its ETag.
    ///
    /// The server checks the part's bytes by their SHA-256, signed with the request
    /// (SigV4 `x-amz-content-sha256`, `Authorization` header): SHA-256 runs 2 to 3 times
    /// faster than MD5 on CPUs with SHA extensions, so this costs far less than the
    /// `Content-MD5` ferry used to send. What servers check, tried by sending a wrong
    /// value (November 2026; BENCHMARKING.md, "S3 upload integrity"):
    /// - Ceph radosgw 16.2 refuses a wrong signed SHA-256 (`XAmzContentSHA256Mismatch`)
    ///   and a wrong `Content-MD5` (`BadDigest`), but takes a wrong
    ///   `x-amz-checksum-crc32c` (it does not know the header), and a wrong SHA-256 in a
    ///   presigned URL's request (there it checks nothing);
    /// - AWS S3 checks the signed SHA-256 (documented; `XAmzContentSHA256Mismatch`);
    /// - moto 5.2 checks none of them.
    ///
    /// So the hash is always signed in the header, never `UNSIGNED-PAYLOAD`, over
    /// http:// and https:// alike.
    fn upload(&self, idx: usize, body: &[u8], zeros: bool) -> Result<String, S3Error> {
        let Some(upload_id) = &self.upload_id else {
            return Err(S3Error::Object { target: self.target(), message: "no upload to send parts to".into() });
        };
        let number = u16::try_from(idx + 1).map_err(|_| S3Error::Object {
            target: self.target(),
            message: format!("part {} is past S3's {MAX_PARTS} parts", idx + 1),
        })?;
        let sha = match zeros && body.len() as u64 == self.part_size {
            true => self.zeros().1.clone(),
            false => sigv4::payload_sha256(body),
        };
        let c = &self.client;
        let part = number.to_string();
        let mut url = c.bucket.object_url(&c.url.key);
        url.set_query(Some(&sigv4::query_string(&[("partNumber", &part), ("uploadId", upload_id)])));
        let signer = sigv4::Signer {
            key: c.creds.key(),
            secret: c.creds.secret(),
            token: c.creds.token(),
            region: c.bucket.region(),
        };
        // The user's x-amz-* headers (`--header`, e.g. SSE-C's keys), which the client
        // adds to every request, are signed as SigV4 requires.
        let user = c.headers_to_sign();
        let sign = || {
            let headers = signer.sign("PUT", &url, &user, &sha, &jiff::Timestamp::now());
            (url.clone(), headers)
        };
        let op = format!("UploadPart {number}");
        let answer = c.send_with(&op, &sign, Method::Put, &[], body)?;
        let etag = answer.etag.filter(|e| !e.trim_matches('"').is_empty()).ok_or_else(|| S3Error::Object {
            target: self.target(),
            message: format!(
                "the server stored part {number} but gave no ETag for it; the server is not S3-compatible"
            ),
        })?;
        log::debug!("{}: part {number} ({} bytes) stored as {etag}", self.target(), body.len());
        Ok(etag)
    }

    /// Makes the object appear: checks that every byte was written, uploads any part whose
    /// upload failed before, and completes the upload with the parts' ETags in order
    /// (an empty object is one PutObject). Completing twice is harmless.
    pub fn complete(&self) -> Result<(), S3Error> {
        let mut st = self.lock();
        loop {
            match st.phase {
                Phase::Completed => return Ok(()),
                Phase::Aborted => return Err(self.refused(Phase::Aborted)),
                Phase::Open => {}
            }
            if !st.parts.iter().any(|p| matches!(p, Part::Uploading)) {
                break;
            }
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        // Every part must be stored, or held complete.
        let mut missing = Vec::new();
        let mut retry = Vec::new();
        for (idx, p) in st.parts.iter().enumerate() {
            let (start, len) = self.part_range(idx);
            match p {
                Part::Empty => missing.push((start, start + len)),
                Part::Filling { have, .. } => match have.first_gap(len) {
                    Some((s, e)) => missing.push((start + s, start + e)),
                    None => retry.push(idx),
                },
                Part::Uploading | Part::Done { .. } => {}
            }
        }
        if let Some(&(s, e)) = missing.first() {
            return Err(S3Error::Object {
                target: self.target(),
                message: format!(
                    "cannot complete: bytes {s}..{e} were never written ({} part(s) incomplete); the copy did not \
                     finish: copy again",
                    missing.len()
                ),
            });
        }
        for idx in retry {
            let Part::Filling { buf, .. } = std::mem::replace(&mut st.parts[idx], Part::Uploading) else { continue };
            drop(st);
            self.upload_held(idx, buf)?;
            st = self.lock();
        }
        let etags: Vec<String> = st
            .parts
            .iter()
            .filter_map(|p| match p {
                Part::Done { etag } => Some(etag.clone()),
                _ => None,
            })
            .collect();
        if etags.len() != st.parts.len() {
            return Err(S3Error::Object {
                target: self.target(),
                message: "cannot complete: a part changed state while completing (a write raced with complete)".into(),
            });
        }
        drop(st);
        match &self.upload_id {
            None => self.put_empty()?,
            Some(id) => self.complete_upload(id, &etags)?,
        }
        self.lock().phase = Phase::Completed;
        self.changed.notify_all();
        log::info!("{}: {} bytes stored in {} parts", self.target(), self.size, etags.len());
        Ok(())
    }

    fn put_empty(&self) -> Result<(), S3Error> {
        let c = &self.client;
        let sign = || c.bucket.put_object(Some(&c.creds), &c.url.key).sign(SIGN_FOR);
        c.send("PutObject", &sign, Method::Put, &[], &[]).map(|_| ())
    }

    fn complete_upload(&self, upload_id: &str, etags: &[String]) -> Result<(), S3Error> {
        let c = &self.client;
        let action = || {
            CompleteMultipartUpload::new(
                &c.bucket,
                Some(&c.creds),
                &c.url.key,
                upload_id,
                etags.iter().map(String::as_str),
            )
        };
        let body = action().body();
        let sign = || action().sign(SIGN_FOR);
        let answer = match c.send("CompleteMultipartUpload", &sign, Method::Post, &[], body.as_bytes()) {
            Ok(a) => a,
            // A retry after a completion whose answer was lost finds no upload: the
            // object is there if it has our size and, where the parts' ETags are their
            // MD5s (S3 without KMS, radosgw, MinIO), the multipart ETag they make; not an
            // older object of the same size left at the key. The ETags are the ones the
            // server answered each UploadPart with (ferry computes no MD5 of its own).
            Err(e)
                if e.code() == Some("NoSuchUpload")
                    && self.object_head().is_some_and(|(size, etag)| {
                        size == Some(self.size)
                            && multipart_etag(etags)
                                .is_none_or(|want| etag.as_deref().map(unquote) == Some(want.as_str()))
                    }) =>
            {
                log::info!("{}: the upload was already complete (an earlier answer was lost)", self.target());
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        // S3 answers 200 at once and may report a failure in the body, later.
        if answer.body.contains("<Error>") {
            let code = xml_text(&answer.body, "Code");
            let message = xml_text(&answer.body, "Message").unwrap_or_default();
            return Err(c.service_error("CompleteMultipartUpload", answer.status, code, message));
        }
        // The root is CompleteMultipartUploadResult (AWS); some servers say ...Response.
        if !answer.body.contains("<CompleteMultipartUpload") {
            return Err(S3Error::Object {
                target: self.target(),
                message: format!(
                    "CompleteMultipartUpload answered {} without a result ({:?}); the object may not exist: check it",
                    answer.status,
                    answer.body.chars().take(200).collect::<String>()
                ),
            });
        }
        Ok(())
    }

    /// The object's size and ETag by HeadObject, `None` when it cannot be had.
    fn object_head(&self) -> Option<(Option<u64>, Option<String>)> {
        let c = &self.client;
        let sign = || c.bucket.head_object(Some(&c.creds), &c.url.key).sign(SIGN_FOR);
        let a = c.send("HeadObject", &sign, Method::Head, &[], &[]).ok()?;
        Some((a.content_length, a.etag))
    }

    /// Abandons the upload: the parts sent so far are deleted and no object appears.
    /// Waits for uploads in flight first (S3 may keep a part that lands after an abort).
    /// Harmless after completing (the object stays) or aborting.
    pub fn abort(&self) -> Result<(), S3Error> {
        let mut st = self.lock();
        if st.phase != Phase::Open {
            return Ok(());
        }
        st.phase = Phase::Aborted;
        self.changed.notify_all();
        while st.parts.iter().any(|p| matches!(p, Part::Uploading)) {
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        for p in st.parts.iter_mut() {
            if matches!(p, Part::Filling { .. }) {
                *p = Part::Empty;
            }
        }
        st.held = 0;
        drop(st);
        let Some(upload_id) = &self.upload_id else { return Ok(()) };
        self.client.abort_upload(upload_id)?;
        log::info!("{}: upload aborted", self.target());
        Ok(())
    }

    fn backend_error(&self, op: &'static str, offset: u64, length: u64, e: S3Error) -> Error {
        let kind = match &e {
            S3Error::Object { .. } => ErrorKind::Invalid,
            _ => ErrorKind::Io,
        };
        Error { kind, op, offset, length, source: Some(std::io::Error::other(e.to_string())) }
    }
}

/// The part size of `opts` for `size` bytes, checked against S3's limits.
fn checked_part_size(url: &S3Url, size: u64, opts: &WriterOptions) -> Result<u64, S3Error> {
    let fail = |message: String| S3Error::Object { target: url.to_string(), message };
    match opts.part_size {
        None => part_size_for(size).map_err(fail),
        Some(p) => {
            if !(S3_MIN_PART..=MAX_PART_SIZE).contains(&p) {
                return Err(fail(format!("a part size of {p} bytes is outside S3's 5 MiB to 5 GiB")));
            }
            if size > MAX_OBJECT_SIZE || size.div_ceil(p) > MAX_PARTS {
                return Err(fail(format!(
                    "{size} bytes in parts of {p} bytes is more than S3's {MAX_PARTS} parts or 5 TiB: use larger parts"
                )));
            }
            Ok(p)
        }
    }
}

fn create_upload(c: &Client) -> Result<String, S3Error> {
    let sign = || c.bucket.create_multipart_upload(Some(&c.creds), &c.url.key).sign(SIGN_FOR);
    let answer = c.send("CreateMultipartUpload", &sign, Method::Post, &[], &[])?;
    let parsed = CreateMultipartUpload::parse_response(&answer.body).map_err(|e| S3Error::Object {
        target: c.url.to_string(),
        message: format!("CreateMultipartUpload answered something that is not an upload ID ({e})"),
    })?;
    Ok(parsed.upload_id().to_string())
}

fn unquote(etag: &str) -> &str {
    etag.trim().trim_matches('"')
}

/// The ETag S3 gives an object completed from parts with these ETags, when each is a hex
/// MD5: the MD5 of the parts' binary MD5s, in hex, then `-` and the number of parts.
/// `None` when a part's ETag is not an MD5 (encrypted uploads), so nothing can be predicted.
fn multipart_etag(etags: &[String]) -> Option<String> {
    let mut all = Md5::new();
    for e in etags {
        let hex = unquote(e);
        if hex.len() != 32 {
            return None;
        }
        for i in (0..32).step_by(2) {
            all.update([u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()?]);
        }
    }
    let digest = all.finalize();
    Some(format!("{}-{}", digest.iter().map(|b| format!("{b:02x}")).collect::<String>(), etags.len()))
}

impl Drop for S3Writer {
    fn drop(&mut self) {
        let phase = self.lock().phase;
        if phase == Phase::Open && self.upload_id.is_some() && self.keep.load(Ordering::SeqCst) {
            // Parts in flight are done: writes return only once their part is stored.
            let stored = self.lock().parts.iter().filter(|p| matches!(p, Part::Done { .. })).count();
            log::info!(
                "{}: the upload {} was not completed; it is kept for a resumed copy ({stored} of {} parts stored)",
                self.target(),
                self.upload_id.as_deref().unwrap_or_default(),
                self.parts()
            );
        } else if phase == Phase::Open && self.upload_id.is_some() {
            log::warn!("{}: the upload was not completed: aborting it", self.target());
            if let Err(e) = self.abort() {
                let u = &self.client.url;
                log::error!(
                    "{e}; the parts uploaded so far stay (and are billed) until the upload is aborted: \
                     `aws s3api abort-multipart-upload --bucket {} --key '{}' --upload-id {}`",
                    u.bucket,
                    u.key,
                    self.upload_id.as_deref().unwrap_or_default()
                );
            }
        }
    }
}

impl Backend for S3Writer {
    fn describe(&self) -> String {
        format!("{} (multipart upload)", self.client.url)
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn caps(&self) -> Capabilities {
        Capabilities {
            read_only: false,
            flush: true,
            fua: false,
            trim: false,
            zero: true,
            fast_zero: false,
            multi_conn: false,
            cache: false,
            extents: false,
        }
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> ferry_backend::Result<()> {
        let e = S3Error::Object {
            target: self.target(),
            message: "an object being uploaded cannot be read; read it after the upload completes".into(),
        };
        Err(Error { kind: ErrorKind::NotSupported, ..self.backend_error("read", offset, buf.len() as u64, e) })
    }
    fn write(&self, buf: &[u8], offset: u64, _fua: bool) -> ferry_backend::Result<()> {
        self.put(offset, buf.len() as u64, Src::Bytes(buf))
            .map_err(|e| self.backend_error("write", offset, buf.len() as u64, e))
    }
    fn flush(&self) -> ferry_backend::Result<()> {
        Ok(())
    }
    fn trim(&self, offset: u64, length: u64, _fua: bool) -> ferry_backend::Result<()> {
        Err(Error::new(ErrorKind::NotSupported, "trim", offset, length))
    }
    fn zero(&self, offset: u64, length: u64, mode: ZeroMode, _fua: bool) -> ferry_backend::Result<()> {
        if mode.fast {
            return Err(Error::new(ErrorKind::NotSupported, "zero", offset, length));
        }
        self.put(offset, length, Src::Zero).map_err(|e| self.backend_error("zero", offset, length, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn part_sizes() {
        assert_eq!(part_size_for(0).unwrap(), 8 * MIB);
        assert_eq!(part_size_for(GIB).unwrap(), 8 * MIB);
        assert_eq!(GIB.div_ceil(8 * MIB), 128);
        // 8 MiB parts hold 78.1 GiB; 100 GiB needs 16 MiB parts (6400 of them).
        assert_eq!(part_size_for(10_000 * 8 * MIB).unwrap(), 8 * MIB);
        assert_eq!(part_size_for(10_000 * 8 * MIB + 1).unwrap(), 16 * MIB);
        assert_eq!(part_size_for(100 * GIB).unwrap(), 16 * MIB);
        assert_eq!((100 * GIB).div_ceil(16 * MIB), 6400);
        // 5 TiB: 1 GiB parts, 5120 of them, under S3's 5 GiB per part.
        let p = part_size_for(MAX_OBJECT_SIZE).unwrap();
        assert_eq!(p, GIB);
        assert_eq!(MAX_OBJECT_SIZE.div_ceil(p), 5120);
        assert!(p <= MAX_PART_SIZE);
        let e = part_size_for(MAX_OBJECT_SIZE + 1).unwrap_err();
        assert!(e.contains("5 TiB"), "{e}");
        assert!(part_size_for(u64::MAX).is_err());
        for size in [1, 5 * MIB, 77 * GIB, 3 << 40, MAX_OBJECT_SIZE - 1] {
            let p = part_size_for(size).unwrap();
            assert!(size.div_ceil(p) <= MAX_PARTS && p.is_power_of_two() && p >= MIN_PART_SIZE, "{size}");
        }
    }

    #[test]
    fn buffered_bytes_for_every_object_size() {
        let limit = WriterOptions::default().memory_limit;
        assert_eq!(limit, 512 * MIB);
        let held = |size: u64| held_limit(limit, part_size_for(size).unwrap());
        // README: at most 512 MiB up to 1.2 TiB (parts up to 128 MiB) ...
        for size in [0, 1, GIB, 100 * GIB, 10_000 * 128 * MIB] {
            assert_eq!(held(size), 512 * MIB, "{size}");
        }
        // ... then three parts: 768 MiB, 1.5 GiB, and 3 GiB at 5 TiB.
        assert_eq!(held(10_000 * 128 * MIB + 1), 768 * MIB);
        assert_eq!(held(10_000 * 256 * MIB + 1), 1536 * MIB);
        assert_eq!(held(10_000 * 512 * MIB + 1), 3 * GIB);
        assert_eq!(held(MAX_OBJECT_SIZE), 3 * GIB);
    }

    #[test]
    fn ranges_merge_overlaps_and_duplicates() {
        let mut r = Ranges::default();
        assert!(!r.covers(10) && r.covers(0));
        assert_eq!(r.first_gap(10), Some((0, 10)));
        r.insert(4, 6);
        r.insert(0, 2);
        r.insert(8, 10);
        assert_eq!(r.0, [(0, 2), (4, 6), (8, 10)]);
        assert_eq!(r.first_gap(10), Some((2, 4)));
        r.insert(4, 6);
        r.insert(5, 6);
        assert_eq!(r.0, [(0, 2), (4, 6), (8, 10)], "duplicates count once");
        r.insert(2, 4); // touching pieces merge
        assert_eq!(r.0, [(0, 6), (8, 10)]);
        r.insert(1, 9);
        assert_eq!(r.0, [(0, 10)]);
        assert!(r.covers(10) && !r.covers(11));
        assert_eq!(r.first_gap(10), None);
        assert_eq!(r.first_gap(12), Some((10, 12)));
        r.insert(3, 3);
        assert_eq!(r.0, [(0, 10)]);
    }

    #[test]
    fn scattered_writes_are_bounded() {
        let mut r = Ranges::default();
        for i in 0..MAX_PIECES as u64 {
            assert!(r.insert(i * 2, i * 2 + 1));
        }
        assert!(!r.insert(1 << 40, (1 << 40) + 1), "one piece too many");
        assert!(r.insert(1, 2), "a write joining pieces is still taken");
        assert_eq!(r.0.len(), MAX_PIECES - 1);
    }

    #[test]
    fn multipart_etags() {
        // Two parts: MD5("a") and MD5("b"); S3's ETag is MD5 of the two binary digests, "-2".
        let a = format!("\"{:x}\"", Md5::digest(b"a"));
        let b = format!("{:x}", Md5::digest(b"b"));
        let mut both = Md5::digest(b"a").to_vec();
        both.extend_from_slice(&Md5::digest(b"b"));
        assert_eq!(multipart_etag(&[a.clone(), b]).unwrap(), format!("{:x}-2", Md5::digest(&both)));
        assert_eq!(multipart_etag(&[a.clone(), "\"not-an-md5\"".into()]), None);
        assert_eq!(multipart_etag(&[a, "zz".repeat(16)]), None);
    }
}
