//! S3 objects as ferry backends: a copy source read through `ferry-http` (a presigned,
//! ranged GET per request), and a copy destination written as a parallel multipart upload
//! ([`S3Writer`]).
//!
//! - [`S3Url`] parses `s3://BUCKET/KEY`; [`S3Config`] finds credentials, region and
//!   endpoint where the AWS tools look for them.
//! - [`open_source`] opens an object for reading: it checks the object with one signed
//!   request of its own (so a missing key, bucket or bad credentials give S3's reason, not
//!   just an HTTP status), then hands an [`S3Locator`] to
//!   `ferry_http::HttpBackend::open_located`, which does the reading (a pool of kept-alive
//!   connections, ranged GETs, retries) exactly as for any HTTP image.
//! - [`S3Writer`] is a write-only backend the copy engine fills from many threads: writes
//!   gather in per-part buffers, each part is uploaded as soon as every byte of it has
//!   arrived, and [`S3Writer::complete`] makes the object appear; [`S3Writer::abort`] (or
//!   dropping an unfinished writer) leaves nothing behind.
//! - [`S3Bucket`] reads and writes whole objects of a bucket by key (GET, ranged GET,
//!   HEAD, a payload-signed PUT, DELETE, ListObjectsV2 with its continuation), every
//!   answer bounded: what `ferry-repo`'s S3 store stands on.
//!
//! A copy to S3, as the CLI does it (the destination must not be declared zeroed: an
//! object has no holes, so every byte, zeroes too, has to be written):
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use ferry_backend::Backend;
//! use ferry_client::copy::{copy, BackendEndpoint, CopyOptions, Endpoint, Progress};
//! use ferry_s3::{S3Config, S3Url, S3Writer};
//! use std::sync::Arc;
//!
//! let src: Arc<dyn Backend> = Arc::new(ferry_backend::MemoryBackend::new(1 << 30));
//! let url: S3Url = "s3://bucket/images/disk.raw".parse()?;
//! let (cfg, http) = (S3Config::from_env()?, ferry_http::HttpOptions::default());
//! let w = Arc::new(S3Writer::create(&url, &cfg, &http, src.size())?);
//! let (s, d) = (
//!     Endpoint::Backend(BackendEndpoint::new("source".into(), src.clone())),
//!     Endpoint::Backend(BackendEndpoint::new(url.to_string(), w.clone())),
//! );
//! match copy(&s, &d, &CopyOptions::default(), &Progress::default()) {
//!     Ok(_) => w.complete()?,
//!     Err(e) => {
//!         w.abort()?; // (dropping the last reference to `w` would abort too)
//!         return Err(e.into());
//!     }
//! }
//! // Reading it back: a read-only backend over ferry-http.
//! let back = ferry_s3::open_source(&url, &cfg, &http)?;
//! assert_eq!(back.size(), src.size());
//! # Ok(())
//! # }
//! ```
//!
//! Crates, and why:
//! - **rusty-s3** signs requests (SigV4 presigned URLs, computed locally with HMAC; `jiff`
//!   gives it the time), builds CompleteMultipartUpload's XML and reads
//!   CreateMultipartUpload's answer. It does no I/O, so the HTTP client is ours, and it is
//!   small (a few thousand lines) where the AWS SDK for Rust would bring tokio, hyper, the
//!   smithy runtime and hundreds of crates into a blocking, thread-based tool. Other
//!   answers (errors, ListParts, ListMultipartUploads) are read tag by tag, because S3
//!   servers differ in their root elements' names.
//! - **ureq 3** sends the requests this crate makes itself (everything but the data
//!   reads) through `ferry_http::agent`, so uploads trust, time out and go through proxies
//!   exactly as the reads do (native-tls, i.e. the OpenSSL ferry already links).
//! - **sha2** and **hmac** sign each UploadPart in its `Authorization` header with the
//!   part's SHA-256 (`x-amz-content-sha256`), so the server checks every part's bytes on
//!   arrival (`XAmzContentSHA256Mismatch` otherwise); SHA-256 costs far less CPU than the
//!   `Content-MD5` sent before (see `writer.rs` for which servers check what). **md-5**
//!   only predicts a multipart object's ETag from its parts' ETags.
//! - **serde_json** reads what `credential_process` prints and the instance metadata
//!   service's answers (JSON both); **jiff** reads their expiry times.
//! - **percent-encoding** decodes a key to find its `.` and `..` segments, which are
//!   refused (URL code would resolve them into another object or bucket).
//!
//! Nothing here is specific to one S3 server: the same code runs against AWS, Ceph's
//! radosgw, MinIO or moto. No error or log line carries the secret key, the session token
//! or a presigned URL's signature.
//!
//! # S3 in the path of a copy
//!
//! **S3.** `S3Locator::get` presigns a GET URL for each request (SigV4 by rusty-s3, a local
//! HMAC), so reads go through the same `HttpBackend`. A destination is an `S3Writer`:
//! 1. `CreateMultipartUpload` when the copy starts;
//! 2. the copy's workers `write` and `zero` into per-part buffers, and each part records the
//!    byte ranges it has received, so a retried write counts once;
//! 3. the worker whose write completes a part uploads it, signed in its `Authorization`
//!    header with the part's SHA-256 (`sigv4.rs`: the server checks the bytes; a presigned
//!    URL signs no payload), and frees the buffer. Part uploads are retried like reads;
//! 4. writers wait when 512 MiB of part buffers are held, or three parts when parts are
//!    larger than 170 MiB (objects over 1.2 TiB; 3 GiB for 5 TiB in 1 GiB parts);
//! 5. `Destination::finish` calls `complete`, which checks that every part is stored and
//!    sends `CompleteMultipartUpload`. A `200` with an `<Error>` body counts as a failure;
//! 6. `finish` then reopens the object for reading, for `--verify`.
//!
//! A failed copy, or a failed `--expect-hash`, calls `abort`, and dropping an unfinished
//! writer does the same. Either way no half object is left.
//!
//! A `--resume` copy to S3 is the exception (`ResumableUpload` in `DestinationOptions`):
//! its writer is marked `keep_unfinished`, so dropping it leaves the upload and its stored
//! parts. The binary's `copy_resume.rs` keeps the journal the other destinations have, but
//! with no watermark (an S3 `flush` makes nothing durable; a part is durable once
//! UploadPart answers): it records the source's identity, the options and the upload's ID
//! (`s3://B/K upload=ID`), stored before the first part is sent. A resumed run opens
//! `S3Writer::resume_upload(ID)`, which marks the parts ListParts reports (checked against
//! this copy's part size) as done; the copy engine then gets `unstored_ranges()` as its
//! `CopyOptions::ranges`, so the stored parts are neither read nor sent again, and a digest
//! (`--hash`, `--verify`, `--expect-hash`) is computed over the whole source afterwards.
//! `--restart`, or a later copy onto the same object without `--resume`, aborts the upload
//! a journal names before removing the journal.
//!
//! # What this crate owns
//!
//! `S3Url`, `S3Config` (credentials, region and endpoint where the AWS tools find them),
//! `open_source` (an object read through `ferry-http` with an `S3Locator` that presigns
//! each GET), `S3Writer` (a write-only `Backend`: a multipart upload with parts sized for
//! the 10,000-part limit, each uploaded with its SHA-256 signed in the `Authorization`
//! header (`sigv4.rs`) once all its bytes have arrived, bounded memory,
//! `complete`/`abort`/`resume`); `S3Bucket` (whole objects by key: GET with a size limit,
//! ranged GET, HEAD, payload-signed PUT, DELETE, ListObjectsV2; what ferry-repo's S3 store
//! uses); `credentials.rs`: web identity (STS), `credential_process`, IMDSv2. Presigning by
//! rusty-s3 (no I/O of its own)
//!
//! `unsafe`: forbidden.
#![forbid(unsafe_code)]

mod client;
mod config;
mod credentials;
mod objects;
mod sigv4;
mod url;
mod writer;

pub use config::S3Config;
pub use objects::{http_date, S3Bucket, ServerTimes, MAX_LIST_KEYS};
pub use url::{S3Url, MAX_KEY_BYTES};
pub use writer::{part_size_for, S3Writer, WriterOptions, MAX_OBJECT_SIZE, MAX_PARTS, MAX_PART_SIZE, MIN_PART_SIZE};

use client::{Client, Method, SIGN_FOR};
use ferry_backend::Backend;
use ferry_http::{HttpError, HttpOptions, Locator};
use rusty_s3::{Bucket, Credentials, S3Action};
use std::ops::Range;
use std::sync::Arc;

/// What went wrong, naming the object (`s3://bucket/key`) and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum S3Error {
    /// The text is not an `s3://BUCKET/KEY` name.
    #[error("{url}: {reason}")]
    InvalidUrl { url: String, reason: String },
    /// Credentials, region or endpoint are missing or malformed.
    #[error("S3 configuration: {0}")]
    Config(String),
    /// The server answered with an error (`code` is S3's, such as `NoSuchKey`).
    #[error("{target}: {op} failed: {hint}{}", if message.is_empty() { String::new() } else { format!(" (server: {message})") })]
    Service { target: String, op: String, status: u16, code: Option<String>, message: String, hint: String },
    /// No answer: the connection failed, dropped or timed out (after the retries).
    #[error("{target}: {op} failed: {message}")]
    Transport { target: String, op: String, message: String },
    /// The object cannot be written as asked (too large, incomplete, already aborted...).
    #[error("{target}: {message}")]
    Object { target: String, message: String },
    /// Reading through `ferry-http` failed.
    #[error(transparent)]
    Http(#[from] HttpError),
    /// [`S3Bucket::get`]: the object is larger than the caller allows; it was not read.
    #[error("{target} is {size} bytes long, more than the {limit} bytes expected")]
    TooLarge { target: String, size: u64, limit: u64 },
    /// [`S3Bucket::get_range`]: the object ends before the end of the range asked for.
    #[error("{target} ends before byte {end}")]
    OutOfRange { target: String, end: u64 },
}

impl S3Error {
    /// S3's error code, when the server gave one (`NoSuchKey`, `AccessDenied`, ...).
    pub fn code(&self) -> Option<&str> {
        match self {
            S3Error::Service { code, .. } => code.as_deref(),
            _ => None,
        }
    }

    /// Whether the server said that the object (not its bucket) does not exist:
    /// `NoSuchKey`, or a 404 without a code (a HEAD's answer has no body).
    pub fn is_not_found(&self) -> bool {
        match self {
            S3Error::Service { status: 404, code, .. } => matches!(code.as_deref(), None | Some("NoSuchKey")),
            _ => false,
        }
    }

    /// The HTTP status of a server's error answer.
    pub fn status(&self) -> Option<u16> {
        match self {
            S3Error::Service { status, .. } => Some(*status),
            S3Error::Http(h) => h.status(),
            _ => None,
        }
    }

    fn after_tries(self, tries: u32) -> S3Error {
        match self {
            S3Error::Service { target, op, status, code, message, hint } => {
                S3Error::Service { target, op, status, code, message, hint: format!("{hint} (after {tries} tries)") }
            }
            S3Error::Transport { target, op, message } => {
                S3Error::Transport { target, op, message: format!("{message} (after {tries} tries)") }
            }
            other => other,
        }
    }
}

/// Presigned GET URLs of one object, one per request: what `ferry-http` reads S3
/// through. Signing is local (an HMAC), so a fresh URL per request costs nothing and
/// never expires mid-copy.
pub struct S3Locator {
    bucket: Bucket,
    creds: Credentials,
    key: String,
    name: String,
}

impl S3Locator {
    pub fn new(url: &S3Url, cfg: &S3Config) -> Result<S3Locator, S3Error> {
        let (bucket, _) = client::address(url, cfg)?;
        Ok(S3Locator { bucket, creds: client::credentials(cfg), key: url.key.clone(), name: url.to_string() })
    }
}

impl Locator for S3Locator {
    /// A presigned GetObject URL; `ferry-http` adds the `Range` header itself (presigned
    /// URLs sign only the host, so the range needs no signature).
    fn get(&self, _range: Option<Range<u64>>) -> Result<(String, Vec<(String, String)>), HttpError> {
        let url = self.bucket.get_object(Some(&self.creds), &self.key).sign(SIGN_FOR);
        Ok((url.to_string(), Vec::new()))
    }
    fn describe(&self) -> String {
        self.name.clone()
    }
}

/// An object of no bytes: nothing to read, nothing to ask the server.
struct EmptyObject(String);

impl Backend for EmptyObject {
    fn describe(&self) -> String {
        self.0.clone()
    }
    fn size(&self) -> u64 {
        0
    }
    fn caps(&self) -> ferry_backend::Capabilities {
        ferry_backend::Capabilities {
            read_only: true,
            flush: false,
            fua: false,
            trim: false,
            zero: false,
            fast_zero: false,
            multi_conn: true,
            cache: false,
            extents: false,
        }
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> ferry_backend::Result<()> {
        match buf.len() {
            0 => Ok(()),
            n => Err(ferry_backend::Error::new(ferry_backend::ErrorKind::Invalid, "read", offset, n as u64)),
        }
    }
    fn flush(&self) -> ferry_backend::Result<()> {
        Ok(())
    }
    fn identity(&self) -> Option<String> {
        Some(format!("{} size=0", self.0))
    }
}

/// The IDs of the multipart uploads of `url` in progress (started, neither completed
/// nor aborted), oldest first: what [`S3Writer::resume`] continues, and what is left
/// behind when an upload is neither completed nor aborted.
pub fn pending_uploads(url: &S3Url, cfg: &S3Config, http: &HttpOptions) -> Result<Vec<String>, S3Error> {
    Client::new(url, cfg, http)?.pending_uploads()
}

/// Aborts the multipart upload `upload_id` of `url` (one an interrupted copy kept):
/// its parts are deleted. An upload already gone counts as aborted.
pub fn abort_upload(url: &S3Url, cfg: &S3Config, http: &HttpOptions, upload_id: &str) -> Result<(), S3Error> {
    Client::new(url, cfg, http)?.abort_upload(upload_id)
}

/// Opens `url` for reading: a read-only backend of the object's bytes.
///
/// First one signed GET of the object's first byte (with this crate's own client), so
/// that a missing object or bucket, refused credentials or a wrong region come back as
/// S3's reason and what to do; then `ferry_http::HttpBackend::open_located` with an
/// [`S3Locator`] does the reading, pinned to the object's ETag (and version id) as its
/// first answer gave them: `If-Match` on every later GET, and an object replaced while it
/// is read is an error ("changed while it was read"), never a mix of two versions. Its
/// [`Backend::identity`] is the `s3://` spec, the size and those validators.
pub fn open_source(url: &S3Url, cfg: &S3Config, http: &HttpOptions) -> Result<Arc<dyn Backend>, S3Error> {
    let client = Client::new(url, cfg, http)?;
    let sign = || client.bucket.get_object(Some(&client.creds), &url.key).sign(SIGN_FOR);
    match client.send("GetObject", &sign, Method::Get, &[("range", "bytes=0-0")], &[]) {
        Ok(_) => {}
        // An empty object has no byte 0 to serve (servers differ in how they say so, and
        // in whether they give its size): ask for its length.
        Err(e @ S3Error::Service { status: 416, .. }) => {
            let head = || client.bucket.head_object(Some(&client.creds), &url.key).sign(SIGN_FOR);
            let a = client.send("HeadObject", &head, Method::Head, &[], &[])?;
            if a.content_length == Some(0) {
                return Ok(Arc::new(EmptyObject(url.to_string())));
            }
            return Err(e);
        }
        Err(e) => return Err(e),
    }
    let loc = Arc::new(S3Locator::new(url, cfg)?);
    let backend = ferry_http::HttpBackend::open_located(loc, &config::http_with_ca(cfg, http))?;
    Ok(Arc::new(backend))
}

/// The parsers of what users and servers send, for the fuzz target
/// (`fuzz/fuzz_targets/remote.rs`): `s3://` URLs, the AWS CLI's INI files, the tags of
/// S3's XML answers, `credential_process` command lines. None may panic on any input.
#[doc(hidden)]
pub fn fuzz(text: &str) {
    let _ = S3Url::parse(text);
    let ini = config::Ini::parse(text);
    if let Some(s) = ini.section("default") {
        let _ = s.get("region");
    }
    let _ = client::xml_texts(text, "Code");
    let _ = client::xml_blocks(text, "Part");
    let _ = config::check_endpoint(text);
    let _ = credentials::shell_split(text);
}
