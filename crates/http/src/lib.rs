//! HTTP(S) images as read-only [`ferry_backend::Backend`]s.
//!
//! An image on a web server (or an S3 object through presigned URLs, see `ferry-s3`) is
//! read with ranged GETs: the first one (`Range: bytes=0-65535`) tells the size from its
//! `Content-Range` and keeps the image's head, so probing a qcow2 header costs nothing
//! more; every later read is one ranged GET of exactly that range, its body read straight
//! into the caller's buffer, over a pool of kept-alive connections so many workers can
//! each have a request in flight. A server that ignores ranges (a `200` answer) is read
//! as one sequential stream instead ([`HttpBackend`] documents how).
//!
//! Crates, and why:
//! - **ureq 3** is the HTTP client: blocking (ferry's copy engine runs plain threads, and
//!   reqwest's blocking client would bring a tokio runtime along), small, kept up, and it
//!   checks what a hostile server can make it do: response headers are limited (64 KiB),
//!   bodies are bounded by their `Content-Length`, a connection is reused only when its
//!   body was read to the end. Its agent pools connections and speaks to HTTP and HTTPS
//!   (CONNECT) proxies; redirects are followed by [`HttpBackend`] itself, which decides
//!   by origin what goes along.
//! - **native-tls** (OpenSSL on Linux) is its TLS: ferry already links OpenSSL for NBD
//!   TLS (`ferry-tls`), so HTTPS costs no second TLS stack or crypto build (rustls would
//!   bring ring or aws-lc-rs). Trust is the system store plus `SSL_CERT_FILE` and
//!   `SSL_CERT_DIR`, as with curl and `openssl s_client`: OpenSSL's default verify paths
//!   read both variables, and native-tls also loads what `openssl-probe` finds (those
//!   variables, then the usual Debian/Red Hat/... locations), so a vendored OpenSSL whose
//!   compiled-in paths point nowhere still finds the system store. `--ca FILE`
//!   ([`HttpOptions::ca`]) replaces all of that with the file's certificates.
//! - **url** and **percent-encoding** parse URLs and decode `user:password@` credentials.
//!
//! Nothing here prints a URL's userinfo or query string: a presigned URL carries its
//! signature in the query, so logs and errors name objects by [`Locator::describe`].
//!
//! # Stores on the network: HTTP(S) and S3
//!
//! `ferry-http` and `ferry-s3` are stores in the sense of the format layer: `Backend`s that
//! hold bytes, under which `ferry-open` puts raw or qcow2. The copy engine and the server
//! see a `Backend` and nothing else, so `--retries`, `--rate`, `--verify`, `--hash` and
//! multi-conn serving work on them unchanged.
//!
//! **The path of one READ from `https://host/disk.qcow2`.** `Location::parse` gives
//! `Image { store: Http(url), format: None }`. `HttpBackend::open` sends one
//! `GET Range: bytes=0-65535`: the `206` answer's `Content-Range` gives the size, and its
//! body is kept as the image's head. `store_format` reads the first 4 bytes from that head,
//! finds the qcow2 magic and opens `Qcow2::open_on(http)`. The header, L1 table and refcounts
//! are then ranged GETs, or come from the head. A copy worker's `read(buf, off)` on the qcow2
//! layer walks L1/L2, exactly as on a file. For each data run it calls
//! `HttpBackend::read(&mut buf[..], host_off)`:
//! 1. take a kept-alive connection from ureq's pool;
//! 2. `GET` with `Range: bytes=host_off-host_off+len-1`;
//! 3. check that the status is 206 and that `Content-Range` and `Content-Length` are exactly the range asked for;
//! 4. read the body straight into `buf`. The body is not gathered into a `Vec` first.
//!
//! Zero and unallocated clusters are never fetched. A failure is retried with backoff if
//! it is 5xx, 408, 429, 416, a reset, a timeout or a short body. The try is logged with
//! the offset, the length and the attempt. Several workers have a request in flight each,
//! on their own connections. A server that answers `200` to a ranged GET is read as one
//! stream under a lock. Reads may be up to 32 MiB ahead of the stream; a read behind it
//! starts the GET again from 0, and this is logged.
//!
//! The first answer's `ETag`, `Last-Modified` and `x-amz-version-id` (`wire::Validators`)
//! pin the object: later GETs carry `If-Match` (or `If-Unmodified-Since`), and a `412` or
//! other validators on any answer is a permanent "changed while it was read".
//! `Backend::identity` is the redacted URL, size and validator. Redirects are followed by
//! `HttpBackend` itself (the agent follows none): past a change of origin the URL's
//! credentials, credential headers and user headers stay behind.
//!
//!
//! # What this crate owns
//!
//! `HttpBackend`: an HTTP(S) object as a read-only `Backend` (size from the first ranged
//! GET's `Content-Range`, one ranged GET per read straight into the caller's buffer over a
//! pool of kept-alive connections, stream mode for servers without ranges, retries with
//! backoff, redirects followed by origin, the object pinned by its first answer's
//! ETag/Last-Modified (`If-Match`, `Backend::identity`), Basic auth, proxies from the
//! environment, trust from the system store / `SSL_CERT_FILE` / `--ca`); `Locator` (where
//! each GET goes: a URL, or a presigned S3 URL); errors that never print userinfo or query
//! strings. On ureq 3 with native-tls (the OpenSSL ferry already links)
//!
//! `unsafe`: forbidden.
#![forbid(unsafe_code)]

mod backend;
mod wire;
#[doc(hidden)]
pub use wire::fuzz;

pub use backend::{redact, HttpBackend, UrlLocator, HEAD_BYTES, STREAM_WINDOW};
pub use ureq::Agent;

use std::ops::Range;
use std::path::PathBuf;
use std::time::Duration;
use ureq::tls::{RootCerts, TlsConfig, TlsProvider};
use ureq::typestate::{WithBody, WithoutBody};
use ureq::RequestBuilder;

/// How to reach a server: trust, authentication, retries, parallelism.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// A PEM file of CA certificates to trust instead of the system store.
    pub ca: Option<PathBuf>,
    /// Do not verify the server's certificate (said loudly in the log).
    pub insecure: bool,
    /// Extra request headers (`--header 'Name: value'`), e.g. `Authorization: Bearer ...`.
    pub headers: Vec<(String, String)>,
    /// Retries of a failed request (5xx, 416, a dropped connection, a timeout).
    pub retries: u32,
    /// Delay before the first retry, doubled for each further one.
    pub retry_delay: Duration,
    /// The longest a GET may take, its answer's headers and body together (in stream mode:
    /// the headers, then each piece read), before it counts as failed; also the connect
    /// timeout and, for the requests `ferry-s3` sends, how long an answer's headers may take.
    pub timeout: Option<Duration>,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            ca: None,
            insecure: false,
            headers: Vec::new(),
            retries: 5,
            retry_delay: Duration::from_millis(500),
            timeout: Some(Duration::from_secs(60)),
        }
    }
}

/// Where each GET of an object goes: a plain URL, or one signed per request (S3).
///
/// [`HttpBackend`] asks for a URL before every GET (retries included) and adds
/// `Range: bytes=START-(END-1)` itself unless the returned headers already hold a `Range`
/// (a signer that signs the header returns it). The URL's userinfo becomes Basic auth; its
/// query string is never logged: errors name the object by [`Locator::describe`].
pub trait Locator: Send + Sync + 'static {
    /// The URL and extra headers of a GET of `range` (`None`: the whole object).
    fn get(&self, range: Option<Range<u64>>) -> Result<(String, Vec<(String, String)>), HttpError>;
    /// What errors call the object, with no credentials in it.
    fn describe(&self) -> String;
}

/// An HTTP failure, naming the URL (without credentials) and what to do.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("{url}: {message}")]
    Other { url: String, message: String },
    /// The server answered with a status that retrying cannot change (401, 403, 404, ...).
    #[error("HTTP {status} {reason} for {url}: {advice}")]
    Status { url: String, status: u16, reason: String, advice: String },
}

impl HttpError {
    pub(crate) fn other(url: &str, message: impl Into<String>) -> Self {
        HttpError::Other { url: url.to_string(), message: message.into() }
    }

    /// The HTTP status of a [`HttpError::Status`].
    pub fn status(&self) -> Option<u16> {
        match self {
            HttpError::Status { status, .. } => Some(*status),
            HttpError::Other { .. } => None,
        }
    }
}

/// The longest response header ferry accepts (ureq refuses longer ones).
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// Idle connections kept per host: enough for 16 workers with a request each in flight.
pub const POOL_PER_HOST: usize = 32;
/// Redirects followed before giving up.
pub const MAX_REDIRECTS: u32 = 10;

/// Request headers that carry credentials: never sent past a change of origin.
const CREDENTIAL_HEADERS: [&str; 3] = ["authorization", "cookie", "proxy-authorization"];

/// Whether header `name` carries credentials (`Authorization`, `Cookie`, `Proxy-Authorization`).
pub fn is_credential_header(name: &str) -> bool {
    CREDENTIAL_HEADERS.iter().any(|c| name.eq_ignore_ascii_case(c))
}

/// The client every request of one backend goes through: a pool of kept-alive connections
/// (up to [`POOL_PER_HOST`] idle per host), timeouts from `opts.timeout` (connecting, the
/// answer's headers, and each read or write of the socket), and trust from `opts.ca` /
/// `opts.insecure` / `SSL_CERT_FILE` / `SSL_CERT_DIR` / the system store. Statuses are
/// returned, not turned into errors, and so are redirects: the agent follows none, since
/// ureq would send user headers to any host a redirect names. [`HttpBackend`] follows them
/// itself, deciding by origin (scheme, host and port) what may go along.
/// Proxies are chosen per request by [`get`] (they depend on each URL's scheme and host);
/// ureq reaches http:// URLs through an HTTP proxy with a CONNECT tunnel as well, so the
/// proxy must allow CONNECT to the server's port.
pub fn agent(opts: &HttpOptions) -> Result<Agent, HttpError> {
    let mut tls = TlsConfig::builder().provider(TlsProvider::NativeTls);
    if opts.insecure {
        log::warn!(
            "INSECURE: the HTTPS server's certificate and name are NOT verified (--insecure): \
             anyone on the network path can read and alter the image"
        );
        tls = tls.disable_verification(true);
    } else if let Some(ca) = &opts.ca {
        let pem = std::fs::read(ca)
            .map_err(|e| HttpError::other(&ca.display().to_string(), format!("cannot read the CA file: {e}")))?;
        let mut certs = Vec::new();
        for item in ureq::tls::parse_pem(&pem) {
            match item {
                Ok(ureq::tls::PemItem::Certificate(c)) => certs.push(c),
                Ok(_) => {}
                Err(e) => {
                    return Err(HttpError::other(
                        &ca.display().to_string(),
                        format!("the CA file is not valid PEM ({e}): give a file of PEM certificates"),
                    ))
                }
            }
        }
        if certs.is_empty() {
            return Err(HttpError::other(
                &ca.display().to_string(),
                "the CA file holds no certificate: give a file of PEM certificates (BEGIN CERTIFICATE)",
            ));
        }
        tls = tls.root_certs(RootCerts::new_with_certs(&certs));
    } else {
        // native-tls's built-in roots: OpenSSL's default paths, SSL_CERT_FILE / SSL_CERT_DIR.
        tls = tls.root_certs(RootCerts::PlatformVerifier);
    }
    let config = Agent::config_builder()
        .tls_config(tls.build())
        .http_status_as_error(false)
        .max_redirects(0)
        .redirect_auth_headers(ureq::config::RedirectAuthHeaders::Never)
        .max_idle_connections(2 * POOL_PER_HOST)
        .max_idle_connections_per_host(POOL_PER_HOST)
        .max_response_header_size(MAX_HEADER_BYTES)
        .input_buffer_size(256 * 1024)
        .user_agent(concat!("ferry/", env!("CARGO_PKG_VERSION")))
        .accept_encoding(ureq::config::AutoHeaderValue::None)
        .proxy(None)
        .timeout_connect(opts.timeout)
        .timeout_recv_response(opts.timeout)
        .timeout_per_read(opts.timeout)
        .timeout_per_write(opts.timeout)
        .build();
    Ok(Agent::new_with_config(config))
}

/// A GET of `url` through `agent`, ready for `call()`: `user:password@` in the URL becomes
/// `Authorization: Basic` (and leaves the URL), `headers` are added (an `Authorization`
/// among them wins over the URL's), and the proxy is the environment's for this URL
/// ([`proxy_for`]). `describe` names the URL in errors.
pub fn get(
    agent: &Agent,
    url: &str,
    headers: &[(String, String)],
    describe: &str,
) -> Result<RequestBuilder<WithoutBody>, HttpError> {
    prepare(url, headers, describe, |u| agent.get(u))
}

/// A DELETE, prepared as [`get`] prepares a GET.
pub fn delete(
    agent: &Agent,
    url: &str,
    headers: &[(String, String)],
    describe: &str,
) -> Result<RequestBuilder<WithoutBody>, HttpError> {
    prepare(url, headers, describe, |u| agent.delete(u))
}

/// A PUT (its body given to `send`), prepared as [`get`] prepares a GET.
pub fn put(
    agent: &Agent,
    url: &str,
    headers: &[(String, String)],
    describe: &str,
) -> Result<RequestBuilder<WithBody>, HttpError> {
    prepare(url, headers, describe, |u| agent.put(u))
}

/// A POST (its body given to `send`), prepared as [`get`] prepares a GET.
pub fn post(
    agent: &Agent,
    url: &str,
    headers: &[(String, String)],
    describe: &str,
) -> Result<RequestBuilder<WithBody>, HttpError> {
    prepare(url, headers, describe, |u| agent.post(u))
}

fn prepare<B>(
    url: &str,
    headers: &[(String, String)],
    describe: &str,
    start: impl FnOnce(&str) -> RequestBuilder<B>,
) -> Result<RequestBuilder<B>, HttpError> {
    let mut parsed = url::Url::parse(url)
        .map_err(|e| HttpError::other(describe, format!("not a valid URL ({e}): give an http:// or https:// URL")))?;
    if parsed.scheme() != "http" && parsed.scheme() != "https" {
        return Err(HttpError::other(describe, "only http:// and https:// URLs can be used"));
    }
    let basic = basic_auth(&parsed);
    if basic.is_some() {
        let _ = parsed.set_username("");
        let _ = parsed.set_password(None);
    }
    let proxy = proxy_for(&parsed, describe)?;
    let mut req = start(parsed.as_str());
    let has_auth = headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("authorization"));
    if let (Some(b), false) = (basic, has_auth) {
        req = req.header("Authorization", b);
    }
    for (n, v) in headers {
        req = req.header(n.as_str(), v.as_str());
    }
    if let Some(p) = proxy {
        req = req.config().proxy(Some(p)).build();
    }
    Ok(req)
}

/// `Basic base64(user:password)` from a URL's userinfo, percent-decoded.
pub(crate) fn basic_auth(url: &url::Url) -> Option<String> {
    if url.username().is_empty() && url.password().is_none() {
        return None;
    }
    let mut creds: Vec<u8> = percent_encoding::percent_decode_str(url.username()).collect();
    creds.push(b':');
    creds.extend(percent_encoding::percent_decode_str(url.password().unwrap_or("")));
    Some(format!("Basic {}", wire::base64(&creds)))
}

/// The proxy for `url` from the environment, as curl chooses it: `https_proxy` /
/// `HTTPS_PROXY` for https URLs, `http_proxy` / `HTTP_PROXY` for http ones, else
/// `all_proxy` / `ALL_PROXY`; none when the host is in `no_proxy` / `NO_PROXY`.
pub fn proxy_for(url: &url::Url, describe: &str) -> Result<Option<ureq::Proxy>, HttpError> {
    let var = |names: &[&str]| names.iter().find_map(|n| std::env::var(n).ok().filter(|v| !v.trim().is_empty()));
    let proxy = match url.scheme() {
        "https" => var(&["https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"]),
        _ => var(&["http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"]),
    };
    let Some(proxy) = proxy else { return Ok(None) };
    if let (Some(np), Some(host)) = (var(&["no_proxy", "NO_PROXY"]), url.host_str()) {
        if wire::no_proxy_matches(&np, host) {
            return Ok(None);
        }
    }
    ureq::Proxy::new(proxy.trim()).map(Some).map_err(|e| {
        HttpError::other(
            describe,
            format!("the proxy in the environment is not usable ({e}): fix https_proxy/http_proxy"),
        )
    })
}
