//! [`HttpBackend`]: an object read with ranged GETs, or as one stream when the server
//! ignores ranges.

use crate::wire::{parse_content_range, ContentRange, Validators};
use crate::{agent, get, is_credential_header, Agent, HttpError, HttpOptions, Locator, MAX_REDIRECTS};
use ferry_backend::{Backend, Capabilities, Error, ErrorKind, Result};
use std::collections::VecDeque;
use std::io::{self, Read};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use ureq::http::Response;
use ureq::{Body, BodyReader};

/// Bytes asked for by the first GET, kept as a cache of the image's head (qcow2 and
/// partition-table probes read there).
pub const HEAD_BYTES: u64 = 64 * 1024;
/// In stream mode, how many bytes read past on behalf of a later offset are kept for
/// reads that arrive slightly out of order.
pub const STREAM_WINDOW: usize = 32 << 20;
/// Skipped stream bytes are kept in pieces of at most this size.
const STREAM_PIECE: usize = 1 << 20;

/// A plain URL as a [`Locator`]: every GET goes to it.
pub struct UrlLocator {
    url: String,
    name: String,
}

impl UrlLocator {
    /// Checks that `url` is an http:// or https:// URL.
    pub fn new(url: &str) -> std::result::Result<Self, HttpError> {
        let name = redact(url);
        let parsed = url::Url::parse(url)
            .map_err(|e| HttpError::other(&name, format!("not a valid URL ({e}): give an http:// or https:// URL")))?;
        if parsed.scheme() != "http" && parsed.scheme() != "https" {
            return Err(HttpError::other(&name, "only http:// and https:// URLs can be read"));
        }
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(HttpError::other(&name, "the URL names no host"));
        }
        Ok(UrlLocator { url: url.to_string(), name })
    }
}

impl Locator for UrlLocator {
    fn get(&self, _range: Option<Range<u64>>) -> std::result::Result<(String, Vec<(String, String)>), HttpError> {
        Ok((self.url.clone(), Vec::new()))
    }
    fn describe(&self) -> String {
        self.name.clone()
    }
}

/// `url` without what may be secret: the userinfo, the query string (a presigned URL's
/// signature) and the fragment. Text that does not parse as a URL is cut at the first
/// `?` and `#`, and at the last `@` before the path.
///
/// An `s3://BUCKET/KEY` spec is kept as written, less any userinfo: its `?` and `#` are
/// part of the key (as the AWS CLI reads it), and it holds no secret, so messages name
/// exactly the object that is read or written.
pub fn redact(url: &str) -> String {
    if url.get(..5).is_some_and(|p| p.eq_ignore_ascii_case("s3://")) {
        let rest = &url[5..];
        let authority_end = rest.find('/').unwrap_or(rest.len());
        return match rest[..authority_end].rfind('@') {
            Some(at) => format!("{}{}", &url[..5], &rest[at + 1..]),
            None => url.to_string(),
        };
    }
    if let Ok(mut u) = url::Url::parse(url) {
        let _ = u.set_username("");
        let _ = u.set_password(None);
        u.set_query(None);
        u.set_fragment(None);
        return u.to_string();
    }
    let cut = url.find(['?', '#']).unwrap_or(url.len());
    let url = &url[..cut];
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let rest = match rest[..authority_end].rfind('@') {
        Some(at) => &rest[at + 1..],
        None => rest,
    };
    match scheme {
        "" => rest.to_string(),
        s => format!("{s}://{rest}"),
    }
}

/// Why one attempt failed: worth trying again, or not.
enum Fail {
    Retry(String),
    Fatal(HttpError),
}

/// An HTTP(S) object as a read-only backend.
///
/// The first GET asks for the head ([`HEAD_BYTES`]) with `Range: bytes=0-65535`; its
/// `Content-Range: bytes 0-N/TOTAL` gives the size, and its bytes stay cached. Then:
///
/// - **Ranged mode** (the server answered 206): each [`Backend::read`] is one GET of exactly
///   its range, the body read straight into the caller's buffer; any number of threads
///   read at once, each on its own kept-alive connection from the agent's pool. The answer
///   must be a 206 whose `Content-Range` is exactly the range asked for.
/// - **Stream mode** (the server answered the ranged GET with 200, as servers without range
///   support or with `Accept-Ranges: none` do): the size comes from `Content-Length` (an
///   error without one), and reads are served from that one body, in order, under a lock.
///   A read ahead of the stream reads forward, keeping up to [`STREAM_WINDOW`] bytes of what
///   it skipped for reads that arrive slightly out of order (several copy workers); a read
///   behind the stream and not in that window GETs the object again from the start (logged
///   at info level, counted by [`HttpBackend::stream_restarts`]). Correct for any order,
///   fast for ascending reads.
///
/// Every GET is retried ([`HttpOptions::retries`], delays doubling from
/// [`HttpOptions::retry_delay`]) after a 5xx, 408, 429 or 416 answer, a failed or dropped
/// connection, a timeout, a short body or a `Content-Range` that is not the one asked for;
/// never after another 4xx, a TLS failure or a change of the object.
///
/// **Pinning.** The first answer's validators (its `ETag`, `Last-Modified` and S3's
/// `x-amz-version-id`) pin the object: every later GET (ranged, or a stream's restart)
/// carries `If-Match` with a strong ETag, else `If-Unmodified-Since` with the date, and
/// every answer's validators must be the first one's. A `412` or another validator is a
/// permanent error, "changed while it was read", so the bytes of two versions are never
/// mixed, even from a server that ignores the condition. [`Backend::identity`] names the
/// object by its redacted URL, size and validators.
///
/// **Redirects** are followed here (up to [`MAX_REDIRECTS`]), decided by origin as curl
/// does since CVE-2022-27776: once a redirect leaves the URL's scheme, host and port, the
/// URL's `user:password`, `Authorization`, `Cookie`, `Proxy-Authorization` and every
/// header of [`HttpOptions::headers`] stay behind, for that GET and for the later ones
/// that go straight to the remembered target.
///
/// **Timeouts.** [`HttpOptions::timeout`] bounds a whole GET: its headers, then its body
/// (a server that trickles a byte a second fails it too); in stream mode, the headers and
/// then each piece read.
pub struct HttpBackend {
    loc: Arc<dyn Locator>,
    agent: Agent,
    name: String,
    headers: Vec<(String, String)>,
    retries: u32,
    retry_delay: Duration,
    timeout: Option<Duration>,
    size: u64,
    head: Vec<u8>,
    /// The first answer's validators, which every later answer must match.
    pin: Validators,
    /// `Some` in stream mode.
    stream: Option<Mutex<Stream>>,
    retried: AtomicU64,
    restarts: AtomicU64,
    gets: AtomicU64,
    /// Remember where the URL redirects to (plain URLs; a locator's URLs are each new).
    cache_redirects: bool,
    redirect: RwLock<Option<Redirect>>,
}

/// Where a URL's redirects led.
#[derive(Clone)]
struct Redirect {
    /// The target, without userinfo.
    url: url::Url,
    /// The way there left the URL's origin: no credentials or user headers go along.
    crossed: bool,
}

/// The one body of stream mode and what was read past.
struct Stream {
    body: Option<BodyReader<'static>>,
    /// Offset of the body's next byte.
    pos: u64,
    /// Skipped pieces `(offset, bytes)`, oldest first, at most [`STREAM_WINDOW`] bytes.
    kept: VecDeque<(u64, Vec<u8>)>,
    kept_bytes: usize,
}

impl Stream {
    /// Copies from a kept piece holding `offset` into `out`; the number of bytes copied
    /// (0 when none holds it). A piece read to its end is dropped.
    fn copy_kept(&mut self, offset: u64, out: &mut [u8]) -> usize {
        let Some(i) = self.kept.iter().position(|(o, p)| *o <= offset && offset - o < p.len() as u64) else {
            return 0;
        };
        let (start, piece) = &self.kept[i];
        let from = (offset - start) as usize;
        let n = out.len().min(piece.len() - from);
        out[..n].copy_from_slice(&piece[from..from + n]);
        if from + n == piece.len() {
            self.kept_bytes -= piece.len();
            self.kept.remove(i);
        }
        n
    }

    fn keep(&mut self, offset: u64, piece: Vec<u8>) {
        self.kept_bytes += piece.len();
        self.kept.push_back((offset, piece));
        while self.kept_bytes > STREAM_WINDOW {
            match self.kept.pop_front() {
                Some((_, p)) => self.kept_bytes -= p.len(),
                None => break,
            }
        }
    }
}

impl HttpBackend {
    /// Opens `url` (http:// or https://, optionally with `user:password@`), reading its
    /// size with the first ranged GET.
    ///
    /// When the URL redirects, later GETs go straight to where the redirect led, with the
    /// URL's credentials and the user's headers only when the way there stayed on the same
    /// scheme, host and port; when that target fails, the next GET asks `url` again.
    pub fn open(url: &str, opts: &HttpOptions) -> std::result::Result<HttpBackend, HttpError> {
        HttpBackend::open_with(Arc::new(UrlLocator::new(url)?), opts, true)
    }

    /// Opens the object that `loc` gives URLs for (a presigned S3 URL per request, say).
    /// Every GET asks `loc` for its URL (redirects are followed each time).
    pub fn open_located(loc: Arc<dyn Locator>, opts: &HttpOptions) -> std::result::Result<HttpBackend, HttpError> {
        HttpBackend::open_with(loc, opts, false)
    }

    fn open_with(
        loc: Arc<dyn Locator>,
        opts: &HttpOptions,
        cache_redirects: bool,
    ) -> std::result::Result<HttpBackend, HttpError> {
        let mut b = HttpBackend {
            cache_redirects,
            redirect: RwLock::new(None),
            name: loc.describe(),
            loc,
            agent: agent(opts)?,
            headers: opts.headers.clone(),
            retries: opts.retries,
            retry_delay: opts.retry_delay,
            timeout: opts.timeout,
            size: 0,
            head: Vec::new(),
            pin: Validators::default(),
            stream: None,
            retried: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            gets: AtomicU64::new(0),
        };
        let (size, head, body, pin) = b.retrying(0, HEAD_BYTES, || b.probe())?;
        b.size = size;
        b.head = head;
        b.pin = pin;
        if b.pin.is_empty() && size > b.head.len() as u64 {
            log::info!(
                "{}: the server sends no ETag or Last-Modified: a change of the object while it is read cannot be \
                 detected",
                b.name
            );
        }
        if let Some(body) = body {
            log::info!("{}: the server does not serve byte ranges: reading it as one stream, in order", b.name);
            let pos = b.head.len() as u64;
            b.stream = Some(Mutex::new(Stream { body: Some(body), pos, kept: VecDeque::new(), kept_bytes: 0 }));
        }
        log::debug!("{}: {} bytes, {} mode", b.name, b.size, if b.stream.is_some() { "stream" } else { "ranged" });
        Ok(b)
    }

    /// The object, as errors and logs name it (no credentials, no query string).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the GETs go.
    pub fn locator(&self) -> &Arc<dyn Locator> {
        &self.loc
    }

    /// The server does not serve ranges: reads come from one sequential stream.
    pub fn is_stream(&self) -> bool {
        self.stream.is_some()
    }

    /// Retries made so far (each logged once).
    pub fn retries_done(&self) -> u64 {
        self.retried.load(Ordering::Relaxed)
    }

    /// In stream mode, how often the object was read again from the start (a read behind
    /// the stream and its window, or a failure in the middle of the stream).
    pub fn stream_restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }

    /// GET requests sent so far, retries included.
    pub fn requests(&self) -> u64 {
        self.gets.load(Ordering::Relaxed)
    }

    /// The first GET: size, head bytes, the rest of the body when the server ignored
    /// the range, and the object's validators.
    #[allow(clippy::type_complexity)]
    fn probe(&self) -> std::result::Result<(u64, Vec<u8>, Option<BodyReader<'static>>, Validators), Fail> {
        let deadline = self.deadline();
        let mut resp = self.send(Some(0..HEAD_BYTES))?;
        let pin = validators(&resp);
        match resp.status().as_u16() {
            206 => {
                let (first, last, total) = match content_range(&resp) {
                    Some(ContentRange::Bytes { first, last, total: Some(t) }) => (first, last, t),
                    Some(ContentRange::Bytes { total: None, .. }) => {
                        return Err(Fail::Fatal(HttpError::other(
                            &self.name,
                            "the server does not tell the object's size (Content-Range total '*'): ferry needs it",
                        )))
                    }
                    _ => return Err(Fail::Retry(format!("206 answer with a bad Content-Range: {}", raw_range(&resp)))),
                };
                if first != 0 || last != (HEAD_BYTES - 1).min(total - 1) {
                    return Err(Fail::Retry(format!(
                        "asked for bytes 0-{}, the server sent {}",
                        HEAD_BYTES - 1,
                        raw_range(&resp)
                    )));
                }
                let mut head = vec![0; (last + 1) as usize];
                check_length(&resp, last + 1)?;
                let mut r = resp.body_mut().as_reader();
                read_full(&mut r, &mut head, deadline)?;
                finish(&mut r)?;
                Ok((total, head, None, pin))
            }
            200 => {
                let Some(size) = header_u64(&resp, "content-length") else {
                    return Err(Fail::Fatal(HttpError::other(
                        &self.name,
                        "the server ignores Range requests and sends no Content-Length, so the \
                         image's size is unknown: serve it from a server that supports ranges, \
                         or download it first",
                    )));
                };
                let mut head = vec![0; size.min(HEAD_BYTES) as usize];
                let mut r = resp.into_body().into_reader();
                read_full(&mut r, &mut head, deadline)?;
                if head.len() as u64 == size {
                    finish(&mut r)?;
                    return Ok((size, head, None, pin));
                }
                Ok((size, head, Some(r), pin))
            }
            416 => match content_range(&resp) {
                Some(ContentRange::Unsatisfied { total: 0 }) => Ok((0, Vec::new(), None, pin)),
                _ => Err(self.status_fail(&resp)),
            },
            _ => Err(self.status_fail(&resp)),
        }
    }

    /// When a GET started now must be over.
    fn deadline(&self) -> Option<Instant> {
        self.timeout.and_then(|t| Instant::now().checked_add(t))
    }

    /// One GET of `range` (`None`: all of it), redirects followed.
    fn send(&self, range: Option<Range<u64>>) -> std::result::Result<Response<Body>, Fail> {
        let (url, extra) = self.loc.get(range.clone()).map_err(Fail::Fatal)?;
        let cached = match self.cache_redirects {
            true => self.redirect.read().unwrap_or_else(|p| p.into_inner()).clone(),
            false => None,
        };
        if let Some(r) = cached {
            match self.fetch(&url, Some(r), extra.clone(), range.clone()) {
                Ok((resp, ..)) if matches!(resp.status().as_u16(), 200 | 206) => return Ok(resp),
                failed => {
                    let why = match failed {
                        Ok((resp, ..)) => format!("HTTP {}", resp.status()),
                        Err(Fail::Retry(m)) => m,
                        Err(Fail::Fatal(e)) => e.to_string(),
                    };
                    log::info!("{}: the redirect's target failed ({why}): asking the URL itself again", self.name);
                    *self.redirect.write().unwrap_or_else(|p| p.into_inner()) = None;
                }
            }
        }
        let (resp, target) = self.fetch(&url, None, extra, range)?;
        if let (true, Some(target)) = (self.cache_redirects && matches!(resp.status().as_u16(), 200 | 206), target) {
            log::debug!("{}: redirected to {}; reading from there", self.name, redact(target.url.as_str()));
            *self.redirect.write().unwrap_or_else(|p| p.into_inner()) = Some(target);
        }
        Ok(resp)
    }

    /// A GET of `url`, starting at `from` (a remembered redirect's target) when given, and
    /// following redirects: the answer, and where it came from when that is not `url`.
    ///
    /// The URL's `user:password` (as Basic authentication) and the user's headers go to
    /// `url`'s origin only: from the first redirect to another scheme, host or port on,
    /// they stay behind, and so do `Authorization`, `Cookie` and `Proxy-Authorization`
    /// among the locator's headers. A redirect's own userinfo is never used.
    fn fetch(
        &self,
        url: &str,
        from: Option<Redirect>,
        extra: Vec<(String, String)>,
        range: Option<Range<u64>>,
    ) -> std::result::Result<(Response<Body>, Option<Redirect>), Fail> {
        let fatal = |m: String| Fail::Fatal(HttpError::other(&self.name, m));
        let mut first = url::Url::parse(url)
            .map_err(|e| fatal(format!("not a valid URL ({e}): give an http:// or https:// URL")))?;
        let basic = crate::basic_auth(&first);
        let _ = first.set_username("");
        let _ = first.set_password(None);
        let origin = first.origin();
        let user_auth = self.headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("authorization"));
        let (mut cur, mut crossed) = match from {
            Some(r) => (r.url, r.crossed),
            None => (first.clone(), false),
        };
        for hop in 0..=MAX_REDIRECTS {
            let mut headers = Vec::new();
            if !crossed {
                if let (Some(b), false) = (&basic, user_auth) {
                    headers.push(("Authorization".to_string(), b.clone()));
                }
                headers.extend(self.headers.iter().cloned());
            }
            headers.extend(extra.iter().filter(|(n, _)| !crossed || !is_credential_header(n)).cloned());
            if let Some((n, v)) = self.pin.condition() {
                headers.push((n.to_string(), v));
            }
            let resp = self.call(cur.as_str(), headers, range.clone())?;
            let location = match resp.status().as_u16() {
                301 | 302 | 303 | 307 | 308 => resp.headers().get("location").and_then(|v| v.to_str().ok()),
                _ => None,
            };
            // Not a redirect, or one without a usable Location (which status_fail names).
            let Some(location) = location else {
                let target = (cur != first).then_some(Redirect { url: cur, crossed });
                return Ok((resp, target));
            };
            if hop == MAX_REDIRECTS {
                break;
            }
            let mut next = cur
                .join(location.trim())
                .map_err(|_| fatal("a redirect's Location is not a valid URL: check the URL".into()))?;
            if next.scheme() != "http" && next.scheme() != "https" {
                return Err(fatal(format!(
                    "a redirect leads to a {}: URL; only http and https redirects are followed",
                    next.scheme()
                )));
            }
            let _ = next.set_username("");
            let _ = next.set_password(None);
            if !crossed && next.origin() != origin {
                crossed = true;
                log::debug!(
                    "{}: redirected to another origin ({}): its credentials and headers stay behind",
                    self.name,
                    redact(next.as_str())
                );
            }
            cur = next;
        }
        Err(fatal(format!("more than {MAX_REDIRECTS} redirects: check the URL")))
    }

    /// One request to `url`.
    fn call(
        &self,
        url: &str,
        headers: Vec<(String, String)>,
        range: Option<Range<u64>>,
    ) -> std::result::Result<Response<Body>, Fail> {
        let has_range = headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("range"));
        let mut req = get(&self.agent, url, &headers, &self.name).map_err(Fail::Fatal)?;
        if let (Some(r), false) = (range, has_range) {
            req = req.header("Range", format!("bytes={}-{}", r.start, r.end - 1));
        }
        self.gets.fetch_add(1, Ordering::Relaxed);
        req.call().map_err(|e| self.classify(e))
    }

    /// The object changed between the first answer and this one.
    fn changed(&self, why: &str) -> Fail {
        Fail::Fatal(HttpError::other(
            &self.name,
            format!(
                "the object changed while it was read ({why}): what was read would mix two versions of it; \
                 read it again once it is stable"
            ),
        ))
    }

    /// An answer's validators must be the first answer's.
    fn check_pin(&self, resp: &Response<Body>) -> std::result::Result<(), Fail> {
        match self.pin.change(&validators(resp)) {
            Some(why) => Err(self.changed(&why)),
            None => Ok(()),
        }
    }

    fn classify(&self, e: ureq::Error) -> Fail {
        use ureq::Error as E;
        let fatal = |m: String| Fail::Fatal(HttpError::other(&self.name, m));
        match e {
            E::Timeout(t) => Fail::Retry(format!("timed out ({t})")),
            E::Io(e) => Fail::Retry(format!("connection failed: {e}")),
            E::ConnectionFailed => Fail::Retry("could not connect to the server".into()),
            E::Protocol(e) => Fail::Retry(format!("bad HTTP from the server: {e}")),
            E::BodyStalled => Fail::Retry("the body stalled".into()),
            E::HostNotFound => fatal("the host name does not resolve: check the URL".into()),
            E::TooManyRedirects => fatal(format!("more than {} redirects: check the URL", crate::MAX_REDIRECTS)),
            E::RedirectFailed => fatal("a redirect could not be followed (bad or missing Location)".into()),
            E::BadUri(_) => fatal("the URL (or a redirect's target) is not valid".into()),
            E::LargeResponseHeader(_, limit) => {
                fatal(format!("the server's response header is longer than {limit} bytes: refusing it"))
            }
            E::NativeTls(e) => fatal(format!(
                "TLS failed ({e}): if the server's certificate is signed by a private CA, give \
                 that CA with --ca FILE or SSL_CERT_FILE; --insecure skips the check (unsafe)"
            )),
            E::Tls(m) => fatal(format!("TLS failed: {m}")),
            E::ConnectProxyFailed(m) => fatal(format!("the proxy refused the connection: {m}")),
            E::InvalidProxyUrl => fatal("the proxy URL is not valid: fix https_proxy/http_proxy".into()),
            e => fatal(e.to_string()),
        }
    }

    /// What an unexpected status means.
    fn status_fail(&self, resp: &Response<Body>) -> Fail {
        let status = resp.status();
        let code = status.as_u16();
        let reason = status.canonical_reason().unwrap_or("").to_string();
        let advice = match code {
            500..=599 | 408 | 429 | 416 => return Fail::Retry(format!("HTTP {code} {reason}")),
            401 => {
                "the server wants credentials: put them in the URL (https://user:password@host/...) \
                    or pass an Authorization header"
            }
            403 => "access denied: check the credentials or the presigned URL's expiry",
            404 => "the object does not exist",
            412 if self.pin.condition().is_some() => {
                return self.changed("the server answered 412 Precondition Failed to the first answer's validator")
            }
            410 => "the object was removed",
            300..=399 => "a redirect without a usable Location",
            _ => "the server refused the request",
        };
        Fail::Fatal(HttpError::Status { url: self.name.clone(), status: code, reason, advice: advice.into() })
    }

    /// Runs `attempt` until it succeeds, fails for good, or the retries run out.
    fn retrying<T>(
        &self,
        offset: u64,
        length: u64,
        mut attempt: impl FnMut() -> std::result::Result<T, Fail>,
    ) -> std::result::Result<T, HttpError> {
        let mut tries = 0u32;
        loop {
            match attempt() {
                Ok(v) => return Ok(v),
                Err(Fail::Fatal(e)) => return Err(e),
                Err(Fail::Retry(m)) if tries >= self.retries => {
                    let after = match tries {
                        0 => String::new(),
                        n => format!(" (after {n} retries: check the server, or allow more retries)"),
                    };
                    return Err(HttpError::other(
                        &self.name,
                        format!("GET of {length} bytes at offset {offset} failed: {m}{after}"),
                    ));
                }
                Err(Fail::Retry(m)) => {
                    tries += 1;
                    let delay = self.retry_delay.saturating_mul(1 << (tries - 1).min(16));
                    log::warn!(
                        "{}: GET of {length} bytes at offset {offset} failed: {m}; retry {tries} of {} in {delay:?}",
                        self.name,
                        self.retries
                    );
                    self.retried.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(delay);
                }
            }
        }
    }

    /// One ranged GET of exactly `buf.len()` bytes at `offset`, into `buf`.
    fn get_range(&self, buf: &mut [u8], offset: u64) -> std::result::Result<(), Fail> {
        let len = buf.len() as u64;
        let deadline = self.deadline();
        let mut resp = self.send(Some(offset..offset + len))?;
        match resp.status().as_u16() {
            206 => match content_range(&resp) {
                Some(ContentRange::Bytes { first, last, total }) if first == offset && last == offset + len - 1 => {
                    if let Some(t) = total.filter(|t| *t != self.size) {
                        return Err(self.size_changed(t));
                    }
                }
                _ => {
                    return Err(Fail::Retry(format!(
                        "asked for bytes {offset}-{}, the server sent {}",
                        offset + len - 1,
                        raw_range(&resp)
                    )))
                }
            },
            // The whole object, which is what was asked for.
            200 if offset == 0 && len == self.size => {}
            200 => return Err(Fail::Retry("the server answered a ranged GET with the whole object (200)".into())),
            _ => return Err(self.status_fail(&resp)),
        }
        self.check_pin(&resp)?;
        check_length(&resp, len)?;
        let mut r = resp.body_mut().as_reader();
        read_full(&mut r, buf, deadline)?;
        finish(&mut r)
    }

    fn size_changed(&self, now: u64) -> Fail {
        Fail::Fatal(HttpError::other(
            &self.name,
            format!(
                "the object's size changed from {} to {now} bytes while it was read: it is being \
                 modified; read it again once it is stable",
                self.size
            ),
        ))
    }

    /// A GET of the whole object for stream mode.
    fn open_stream(&self) -> std::result::Result<BodyReader<'static>, Fail> {
        let resp = self.send(None)?;
        if resp.status().as_u16() != 200 {
            return Err(self.status_fail(&resp));
        }
        self.check_pin(&resp)?;
        match header_u64(&resp, "content-length") {
            Some(n) if n != self.size => return Err(self.size_changed(n)),
            _ => {}
        }
        Ok(resp.into_body().into_reader())
    }

    /// Stream mode: fills `buf` from the head, the kept pieces and the stream.
    fn read_stream(&self, st: &Mutex<Stream>, buf: &mut [u8], offset: u64) -> std::result::Result<(), HttpError> {
        let mut st = st.lock().unwrap_or_else(|p| p.into_inner());
        let mut done = 0usize;
        self.retrying(offset, buf.len() as u64, || {
            let r = self.stream_step(&mut st, buf, offset, &mut done);
            if r.is_err() {
                st.body = None;
            }
            r
        })
    }

    fn stream_step(
        &self,
        st: &mut Stream,
        buf: &mut [u8],
        offset: u64,
        done: &mut usize,
    ) -> std::result::Result<(), Fail> {
        while *done < buf.len() {
            let cur = offset + *done as u64;
            if cur < self.head.len() as u64 {
                let from = cur as usize;
                let n = (buf.len() - *done).min(self.head.len() - from);
                buf[*done..*done + n].copy_from_slice(&self.head[from..from + n]);
                *done += n;
                continue;
            }
            let n = st.copy_kept(cur, &mut buf[*done..]);
            if n > 0 {
                *done += n;
                continue;
            }
            if cur < st.pos {
                log::info!(
                    "{}: a read at offset {cur} is behind the stream (at {}): reading the object again from the start",
                    self.name,
                    st.pos
                );
                st.body = None;
                st.pos = 0;
            }
            if st.body.is_none() {
                self.restarts.fetch_add(1, Ordering::Relaxed);
                st.body = Some(self.open_stream()?);
                st.pos = 0;
            }
            while st.pos < cur {
                let n = (cur - st.pos).min(STREAM_PIECE as u64) as usize;
                let keep = cur - st.pos <= STREAM_WINDOW as u64;
                let mut piece = vec![0; if keep { n } else { n.min(64 * 1024) }];
                let body = st.body.as_mut().ok_or_else(|| Fail::Retry("the stream is closed".into()))?;
                read_full(body, &mut piece, self.deadline())?;
                let at = st.pos;
                st.pos += piece.len() as u64;
                if keep {
                    st.keep(at, piece);
                }
            }
            let body = st.body.as_mut().ok_or_else(|| Fail::Retry("the stream is closed".into()))?;
            read_full(body, &mut buf[*done..], self.deadline())?;
            st.pos += (buf.len() - *done) as u64;
            *done = buf.len();
            if st.pos == self.size {
                if let Some(mut body) = st.body.take() {
                    finish(&mut body)?;
                }
            }
        }
        Ok(())
    }
}

/// An answer's validators: `ETag`, `Last-Modified`, `x-amz-version-id`.
fn validators(resp: &Response<Body>) -> Validators {
    let h = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok());
    Validators::new(h("etag"), h("last-modified"), h("x-amz-version-id"))
}

/// A header holding a decimal number; `None` when absent or not a number.
fn header_u64(resp: &Response<Body>, name: &str) -> Option<u64> {
    crate::wire::parse_u64(resp.headers().get(name)?.to_str().ok()?.trim())
}

fn content_range(resp: &Response<Body>) -> Option<ContentRange> {
    parse_content_range(resp.headers().get("content-range")?.to_str().ok()?)
}

/// The `Content-Range` as sent, for messages (cut short: it comes from the server).
fn raw_range(resp: &Response<Body>) -> String {
    match resp.headers().get("content-range").map(|v| v.to_str()) {
        None => "no Content-Range".into(),
        Some(Ok(v)) => format!("Content-Range '{}'", v.chars().take(80).collect::<String>()),
        Some(Err(_)) => "a Content-Range that is not text".into(),
    }
}

/// A `Content-Length`, when given, must be the length asked for.
fn check_length(resp: &Response<Body>, len: u64) -> std::result::Result<(), Fail> {
    match header_u64(resp, "content-length") {
        Some(n) if n != len => Err(Fail::Retry(format!("asked for {len} bytes, the server announced {n}"))),
        _ => Ok(()),
    }
}

/// Fills `buf` from `r`; a body that ends early, or is not all there by `deadline`, is a
/// failure worth retrying.
fn read_full(r: &mut impl Read, buf: &mut [u8], deadline: Option<Instant>) -> std::result::Result<(), Fail> {
    let mut done = 0;
    while done < buf.len() {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Fail::Retry(format!(
                "timed out: {done} of {} bytes of the body arrived within the request timeout",
                buf.len()
            )));
        }
        match r.read(&mut buf[done..]) {
            Ok(0) => {
                return Err(Fail::Retry(format!("the body ended after {done} of {} bytes", buf.len())));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(Fail::Retry(format!("reading the body failed after {done} of {} bytes: {e}", buf.len())))
            }
        }
    }
    Ok(())
}

/// Reads the body's end, so the connection goes back to the pool; more bytes than asked
/// for are a failure.
fn finish(r: &mut impl Read) -> std::result::Result<(), Fail> {
    let mut extra = [0u8; 1];
    loop {
        return match r.read(&mut extra) {
            Ok(0) => Ok(()),
            Ok(_) => Err(Fail::Retry("the body is longer than asked for".into())),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => Err(Fail::Retry(format!("reading the end of the body failed: {e}"))),
        };
    }
}

fn to_backend(e: HttpError, offset: u64, length: u64) -> Error {
    Error::io("read", offset, length, io::Error::other(e.to_string()))
}

impl Backend for HttpBackend {
    fn describe(&self) -> String {
        self.name.clone()
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn caps(&self) -> Capabilities {
        Capabilities {
            read_only: true,
            flush: true,
            fua: false,
            trim: false,
            zero: false,
            fast_zero: false,
            multi_conn: true,
            cache: false,
            extents: false,
        }
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        if offset.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(Error::new(ErrorKind::Invalid, "read", offset, len));
        }
        if len == 0 {
            return Ok(());
        }
        if offset + len <= self.head.len() as u64 {
            buf.copy_from_slice(&self.head[offset as usize..(offset + len) as usize]);
            return Ok(());
        }
        match &self.stream {
            Some(st) => self.read_stream(st, buf, offset),
            None => self.retrying(offset, len, || self.get_range(buf, offset)),
        }
        .map_err(|e| to_backend(e, offset, len))
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    /// The redacted URL (for S3: the `s3://` spec), the size, and the strong ETag (else
    /// the Last-Modified date) and version id of the first answer.
    fn identity(&self) -> Option<String> {
        Some(format!("{} size={}{}", self.name, self.size, self.pin.identity()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_drops_credentials_query_and_fragment() {
        assert_eq!(
            redact("https://user:secret@example.com:8443/a/b.img?X-Amz-Signature=abc#frag"),
            "https://example.com:8443/a/b.img"
        );
        assert_eq!(redact("http://host/x"), "http://host/x");
        assert_eq!(redact("ht!tp://u:p@h/x?sig"), "ht!tp://h/x");
        assert!(!redact("u:p@h/x?sig").contains("sig"));
        // An s3:// spec is shown as written: `?`, `#` and dots are part of its key.
        assert_eq!(redact("s3://b/q?x=1#f"), "s3://b/q?x=1#f");
        assert_eq!(redact("S3://b/a/../k"), "S3://b/a/../k");
        assert_eq!(redact("s3://u:p@b/k?x"), "s3://b/k?x");
    }

    #[test]
    fn url_locator_refuses_other_schemes_and_hides_secrets() {
        assert!(UrlLocator::new("ftp://h/x").is_err());
        assert!(UrlLocator::new("not a url").is_err());
        let e = UrlLocator::new("file:///etc/passwd?sig=1").err().unwrap().to_string();
        assert!(!e.contains("sig=1"), "{e}");
        let l = UrlLocator::new("https://a:b@h/x?sig=1").unwrap();
        assert_eq!(l.describe(), "https://h/x");
        assert_eq!(l.get(None).unwrap().0, "https://a:b@h/x?sig=1");
    }

    fn stream() -> Stream {
        Stream { body: None, pos: 0, kept: VecDeque::new(), kept_bytes: 0 }
    }

    #[test]
    fn kept_pieces_serve_out_of_order_reads_and_stay_bounded() {
        let mut st = stream();
        st.keep(100, vec![1; 10]);
        st.keep(110, vec![2; 10]);
        let mut out = [0u8; 15];
        assert_eq!(st.copy_kept(99, &mut out), 0);
        assert_eq!(st.copy_kept(105, &mut out), 5);
        assert_eq!(out[..5], [1; 5]);
        assert_eq!(st.kept.len(), 1, "a piece read to its end is dropped");
        assert_eq!(st.copy_kept(110, &mut out[..4]), 4);
        assert_eq!(st.copy_kept(114, &mut out), 6);
        assert_eq!(st.kept_bytes, 0);
        for i in 0..40u64 {
            st.keep(i << 20, vec![0; 1 << 20]);
        }
        assert!(st.kept_bytes <= STREAM_WINDOW);
        assert_eq!(st.kept.front().map(|k| k.0), Some(8 << 20));
    }
}
