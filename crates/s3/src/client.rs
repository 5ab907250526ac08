//! The requests ferry-s3 sends itself (everything but the data reads): one `ureq` agent,
//! made by `ferry_http::agent` so trust, timeouts and proxies are the reads',
//! with kept-alive connections, presigned URLs from `rusty-s3`, retries of what may pass.

use crate::{S3Config, S3Error, S3Url};
use ferry_http::HttpOptions;
use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};
use std::io::Read;
use std::time::Duration;

/// How long a presigned URL stays valid: one request, with room for a slow upload and a
/// clock a little off.
pub(crate) const SIGN_FOR: Duration = Duration::from_secs(3600);
/// The most of an answer's body kept (S3's XML answers are small; a ListParts page of
/// 1000 parts is about 250 KiB).
pub(crate) const MAX_ANSWER_BYTES: u64 = 4 << 20;
/// The longest part ETag kept from ListParts (S3's are 34 bytes; a longer one is refused,
/// so a hostile answer cannot make ferry hold more than 10,000 of these).
pub(crate) const MAX_PART_ETAG_BYTES: usize = 128;
/// The least time a CompleteMultipartUpload may take: S3 assembles the object before it
/// answers (sending blanks meanwhile), which may take minutes for a large one.
pub(crate) const COMPLETE_AT_LEAST: Duration = Duration::from_secs(300);
/// The longest wait between two tries.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(30);

pub(crate) enum Method {
    Get,
    Head,
    Put,
    Post,
    Delete,
}

/// A successful answer.
pub(crate) struct Answer {
    pub status: u16,
    pub etag: Option<String>,
    pub content_length: Option<u64>,
    /// `Last-Modified` and `Date`, as the server sent them (HTTP dates).
    pub last_modified: Option<String>,
    pub date: Option<String>,
    /// The body as text (for XML answers; empty when `data` was asked for).
    pub body: String,
    /// The body's bytes, when [`Client::send_for_data`] asked for them.
    pub data: Vec<u8>,
}

/// A bucket, an object and who to be: everything a request needs.
pub(crate) struct Client {
    agent: ureq::Agent,
    /// The environment's proxy for the server (`https_proxy`, ... as ferry-http reads it).
    proxy: Option<ureq::Proxy>,
    pub bucket: Bucket,
    pub creds: Credentials,
    pub url: S3Url,
    /// The server, for messages: the endpoint or `AWS (REGION)`.
    pub server: String,
    pub credentials_from: String,
    pub retries: u32,
    pub retry_delay: Duration,
    /// `--request-timeout`: the longest a GET, HEAD or DELETE may take, answer and all;
    /// see [`deadline`] for a PUT or POST.
    timeout: Option<Duration>,
    headers: Vec<(String, String)>,
}

impl Client {
    pub(crate) fn new(url: &S3Url, cfg: &S3Config, http: &HttpOptions) -> Result<Client, S3Error> {
        let (bucket, server) = address(url, cfg)?;
        let http = &crate::config::http_with_ca(cfg, http);
        Ok(Client {
            // ferry-http's client: the same trust (--ca, --insecure, SSL_CERT_FILE),
            // timeouts and connection pool as the reads.
            agent: ferry_http::agent(http)?,
            proxy: ferry_http::proxy_for(bucket.base_url(), &url.to_string())?,
            bucket,
            creds: credentials(cfg),
            url: url.clone(),
            server,
            credentials_from: cfg.credentials_from.clone(),
            retries: http.retries,
            retry_delay: http.retry_delay,
            timeout: http.timeout,
            headers: http.headers.clone(),
        })
    }

    /// The user's headers (`--header`) that a header-signed request must sign, since
    /// [`Client::send`] adds them to every request: every `x-amz-*` one (S3 refuses an
    /// unsigned one), and `content-md5` and `content-type`.
    pub(crate) fn headers_to_sign(&self) -> Vec<(&str, &str)> {
        headers_to_sign(&self.headers)
    }

    /// A presigned GET of the bucket with `query` (sorted by name), for the actions
    /// rusty-s3 has no type for (ListMultipartUploads).
    pub(crate) fn sign_bucket_get(&self, query: &[(&str, &str)]) -> url::Url {
        let secs = SIGN_FOR.as_secs();
        rusty_s3::signing::sign(
            &jiff::Timestamp::now(),
            rusty_s3::Method::Get,
            self.bucket.base_url().clone(),
            self.creds.key(),
            self.creds.secret(),
            self.creds.token(),
            self.bucket.region(),
            secs,
            query.iter().copied(),
            std::iter::empty(),
        )
    }

    /// The IDs of the multipart uploads in progress for this object, oldest first
    /// (ListMultipartUploads, following its pages).
    pub(crate) fn pending_uploads(&self) -> Result<Vec<String>, S3Error> {
        let mut ids = Vec::new();
        let (mut key_marker, mut id_marker) = (String::new(), String::new());
        for _page in 0..1000 {
            let mut query = vec![("prefix", self.url.key.as_str())];
            if !key_marker.is_empty() {
                query = vec![("key-marker", key_marker.as_str()), ("prefix", self.url.key.as_str())];
                if !id_marker.is_empty() {
                    query.push(("upload-id-marker", id_marker.as_str()));
                }
            }
            query.push(("uploads", ""));
            let sign = || self.sign_bucket_get(&query);
            let a = self.send("ListMultipartUploads", &sign, Method::Get, &[], &[])?;
            for upload in xml_blocks(&a.body, "Upload") {
                if xml_text(upload, "Key").as_deref() == Some(self.url.key.as_str()) {
                    ids.extend(xml_text(upload, "UploadId"));
                }
            }
            if xml_text(&a.body, "IsTruncated").as_deref() != Some("true") {
                return Ok(ids);
            }
            let next_key = xml_text(&a.body, "NextKeyMarker").unwrap_or_default();
            let next_id = xml_text(&a.body, "NextUploadIdMarker").unwrap_or_default();
            if next_key.is_empty() || (next_key == key_marker && next_id == id_marker) {
                return Ok(ids);
            }
            (key_marker, id_marker) = (next_key, next_id);
        }
        Ok(ids)
    }

    /// Aborts multipart upload `upload_id`: its stored parts are deleted. An upload that
    /// is already gone (aborted, completed, expired) counts as aborted.
    pub(crate) fn abort_upload(&self, upload_id: &str) -> Result<(), S3Error> {
        let sign = || self.bucket.abort_multipart_upload(Some(&self.creds), &self.url.key, upload_id).sign(SIGN_FOR);
        match self.send("AbortMultipartUpload", &sign, Method::Delete, &[], &[]) {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("NoSuchUpload") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The parts of upload `upload_id` stored so far: (number, ETag, length), by number,
    /// following ListParts' pages. The upload has `max_parts` parts: a part numbered
    /// outside `1..=max_parts`, or with an ETag over [`MAX_PART_ETAG_BYTES`], is an error,
    /// and a number listed twice counts once (the later one), so at most `max_parts`
    /// short entries are kept whatever the server sends.
    pub(crate) fn list_parts(&self, upload_id: &str, max_parts: u64) -> Result<Vec<(u16, String, u64)>, S3Error> {
        let mut out = std::collections::BTreeMap::new();
        let mut marker: Option<u16> = None;
        for _page in 0..100 {
            let sign = || {
                let mut a = self.bucket.list_parts(Some(&self.creds), &self.url.key, upload_id);
                if let Some(m) = marker {
                    a.set_part_number_marker(m);
                }
                a.sign(SIGN_FOR)
            };
            let a = self.send("ListParts", &sign, Method::Get, &[], &[])?;
            parse_parts(&a.body, max_parts, &mut out)
                .map_err(|message| S3Error::Object { target: self.url.to_string(), message })?;
            let next = xml_text(&a.body, "NextPartNumberMarker").and_then(|n| n.parse::<u16>().ok());
            match next {
                Some(m) if xml_text(&a.body, "IsTruncated").as_deref() == Some("true") && Some(m) != marker => {
                    marker = Some(m)
                }
                _ => break,
            }
        }
        Ok(out.into_iter().map(|(n, (etag, size))| (n, etag, size)).collect())
    }

    /// Sends a request signed afresh for each try by `sign`, with `headers` (which the
    /// signature covers, when `sign` put them in) and `body`, and tries again after a
    /// dropped connection, a timeout, a 5xx, 429 or S3's RequestTimeout/SlowDown, waiting
    /// `retry_delay` doubled each time. An answer of 300 or more is an error.
    pub(crate) fn send(
        &self,
        op: &str,
        sign: &dyn Fn() -> url::Url,
        method: Method,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Answer, S3Error> {
        self.send_with(op, &|| (sign(), Vec::new()), method, headers, body)
    }

    /// As [`Client::send`], where `sign` gives, for each try, the URL and the headers
    /// that sign it (SigV4 in the `Authorization` header: [`crate::sigv4`]).
    pub(crate) fn send_with(
        &self,
        op: &str,
        sign: &dyn Fn() -> (url::Url, Vec<(String, String)>),
        method: Method,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Answer, S3Error> {
        self.send_keeping(op, sign, method, headers, body, None)
    }

    /// As [`Client::send`], for an answer whose body is data (GetObject): a successful
    /// answer's bytes are in [`Answer::data`], at most `limit` of them. One whose
    /// `Content-Length` is over `limit` is not read (`data` is empty and
    /// `content_length` says why); one without a length is read up to `limit + 1` bytes,
    /// so the caller sees that it is too long.
    pub(crate) fn send_for_data(
        &self,
        op: &str,
        sign: &dyn Fn() -> url::Url,
        headers: &[(&str, &str)],
        limit: u64,
    ) -> Result<Answer, S3Error> {
        self.send_keeping(op, &|| (sign(), Vec::new()), Method::Get, headers, &[], Some(limit))
    }

    fn send_keeping(
        &self,
        op: &str,
        sign: &dyn Fn() -> (url::Url, Vec<(String, String)>),
        method: Method,
        headers: &[(&str, &str)],
        body: &[u8],
        data_limit: Option<u64>,
    ) -> Result<Answer, S3Error> {
        let mut attempt = 0u32;
        loop {
            let (url, auth) = sign();
            let signed: Vec<(&str, &str)> =
                auth.iter().map(|(k, v)| (k.as_str(), v.as_str())).chain(headers.iter().copied()).collect();
            let err = match self.once(op, url, &method, &signed, body, data_limit) {
                // S3 may answer 200 and tell of a failure in the body (CompleteMultipartUpload).
                Ok(a) if a.status < 300 && !is_error_body(&a.body) => return Ok(a),
                Ok(a) => {
                    let code = xml_text(&a.body, "Code");
                    let message = xml_text(&a.body, "Message").unwrap_or_default();
                    let transient = a.status >= 500
                        || a.status == 429
                        || matches!(code.as_deref(), Some("RequestTimeout" | "SlowDown" | "InternalError"));
                    let e = self.service_error(op, a.status, code, message);
                    (e, transient)
                }
                Err(e) => {
                    let permanent = matches!(e, ureq::Error::HostNotFound | ureq::Error::BadUri(_));
                    // A bad URI's text would be the presigned URL, signature and all.
                    let why = match e {
                        ureq::Error::BadUri(_) => "the request's URL is not valid".to_string(),
                        e => e.to_string(),
                    };
                    let e = S3Error::Transport {
                        target: self.url.to_string(),
                        op: op.to_string(),
                        message: format!("no answer from {}: {why}", self.server),
                    };
                    (e, !permanent)
                }
            };
            let (e, transient) = err;
            if !transient || attempt >= self.retries {
                if attempt > 0 {
                    return Err(e.after_tries(attempt + 1));
                }
                return Err(e);
            }
            let delay = self.retry_delay.saturating_mul(1u32 << attempt.min(16)).min(MAX_RETRY_DELAY);
            log::warn!("{e}; trying again in {delay:?} ({} of {} retries)", attempt + 1, self.retries);
            std::thread::sleep(delay);
            attempt += 1;
        }
    }

    fn once(
        &self,
        op: &str,
        url: url::Url,
        method: &Method,
        headers: &[(&str, &str)],
        body: &[u8],
        data_limit: Option<u64>,
    ) -> Result<Answer, ureq::Error> {
        let u = url.as_str();
        let extra = self.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).chain(headers.iter().copied());
        let mut resp = match method {
            Method::Get | Method::Head | Method::Delete => {
                let mut r = match method {
                    Method::Get => self.agent.get(u),
                    Method::Head => self.agent.head(u),
                    _ => self.agent.delete(u),
                };
                for (k, v) in extra {
                    r = r.header(k, v);
                }
                if let Some(p) = &self.proxy {
                    r = r.config().proxy(Some(p.clone())).build();
                }
                // A small answer: a server trickling it cannot hold the request longer.
                // Data (up to a GiB) has the agent's per-read timeouts instead, as an
                // upload's body has.
                if data_limit.is_none() {
                    r = r.config().timeout_global(self.timeout).build();
                }
                r.call()?
            }
            Method::Put | Method::Post => {
                let mut r = match method {
                    Method::Put => self.agent.put(u),
                    _ => self.agent.post(u),
                };
                for (k, v) in extra {
                    r = r.header(k, v);
                }
                if let Some(p) = &self.proxy {
                    r = r.config().proxy(Some(p.clone())).build();
                }
                // Each read and write has `timeout`, and the answer (headers, then body)
                // must come whole within `answer_deadline`, so a server trickling it
                // cannot hold the request. Sending the body has no overall bound: on a
                // slow uplink shared by many parts that is the link's pace, not a hostile
                // server's, and a stalled send still fails by its per-write timeout.
                let answer = answer_deadline(self.timeout, op);
                r = r.config().timeout_recv_response(answer).timeout_recv_body(answer).build();
                r.send(body)?
            }
        };
        let h = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
        let etag = h("etag");
        let content_length = h("content-length").and_then(|v| v.parse().ok());
        let (last_modified, date) = (h("last-modified"), h("date"));
        let status = resp.status().as_u16();
        if let (Some(limit), true) = (data_limit, status < 300) {
            let mut data = Vec::new();
            if content_length.is_none_or(|n| n <= limit) {
                // The length, when given, sizes the buffer: at most `limit` bytes.
                data.reserve_exact(content_length.unwrap_or(0) as usize);
                resp.body_mut().as_reader().take(limit.saturating_add(1)).read_to_end(&mut data)?;
            }
            return Ok(Answer { status, etag, content_length, last_modified, date, body: String::new(), data });
        }
        let mut raw = Vec::new();
        if !matches!(method, Method::Head) {
            resp.body_mut().as_reader().take(MAX_ANSWER_BYTES).read_to_end(&mut raw)?;
        }
        let body = String::from_utf8_lossy(&raw).into_owned();
        Ok(Answer { status, etag, content_length, last_modified, date, body, data: Vec::new() })
    }

    /// The error for an answer with `status` and S3's error `code`, saying what to do.
    pub(crate) fn service_error(&self, op: &str, status: u16, code: Option<String>, message: String) -> S3Error {
        let (bucket, target) = (&self.url.bucket, self.url.to_string());
        // `target` starts the message (see S3Error::Service); the hint says what to do.
        let creds = &self.credentials_from;
        let hint = match code.as_deref() {
            Some("NoSuchKey") => "the object does not exist: check the key (keys are case-sensitive)".to_string(),
            None if status == 404 && op.starts_with("HeadObject") => {
                "the object does not exist (or its bucket does not): check the name".to_string()
            }
            Some("NoSuchBucket") => {
                format!("the bucket {bucket} does not exist at {}: check its name, the endpoint and the region", self.server)
            }
            Some("NoSuchUpload") => {
                "the multipart upload is gone (aborted, completed, or expired by a lifecycle rule): start the copy again"
                    .into()
            }
            Some("InvalidAccessKeyId") => {
                format!("{} does not know the access key ID from {creds}: check the key ID (and the endpoint)", self.server)
            }
            Some("SignatureDoesNotMatch") => {
                format!("the secret access key from {creds} does not match its key ID: check the secret key")
            }
            Some("ExpiredToken" | "TokenRefreshRequired" | "InvalidToken") => {
                format!("the session token from {creds} is expired or invalid: get new temporary credentials")
            }
            Some("AccessDenied") => format!(
                "access denied: the credentials from {creds} are not allowed to do {} on {target}; ask for the permission",
                op.split_whitespace().next().unwrap_or(op)
            ),
            Some(
                "PermanentRedirect"
                | "TemporaryRedirect"
                | "AuthorizationHeaderMalformed"
                | "IllegalLocationConstraintException",
            ) => {
                format!("the bucket {bucket} is not in region {}: set AWS_REGION to its region", self.bucket.region())
            }
            Some("RequestTimeTooSkewed") => "this machine's clock is too far off the server's: set the time".into(),
            Some("EntityTooSmall") => "a part was smaller than S3's 5 MiB minimum".into(),
            Some("EntityTooLarge") => "the object or a part is larger than the server allows".into(),
            Some("BadDigest" | "InvalidDigest") => "the bytes arrived damaged (Content-MD5 did not match)".into(),
            Some("XAmzContentSHA256Mismatch") => "the bytes arrived damaged (their signed SHA-256 did not match)".into(),
            Some("InvalidPart" | "InvalidPartOrder") => "the server does not have every part the upload lists".into(),
            Some("SlowDown") => "the server asks to slow down: retry later or with fewer workers".into(),
            Some(other) => format!("S3 error {other}"),
            None if status == 403 => format!("access denied (HTTP 403): check the credentials from {creds}"),
            None if (300..400).contains(&status) => format!(
                "the server answered with a redirect (HTTP {status}), which signed requests do not follow: \
                 check AWS_ENDPOINT_URL and AWS_REGION"
            ),
            None => format!("HTTP {status}"),
        };
        S3Error::Service { target, op: op.to_string(), status, code, message, hint }
    }
}

/// See [`Client::headers_to_sign`].
pub(crate) fn headers_to_sign(headers: &[(String, String)]) -> Vec<(&str, &str)> {
    let signed = |name: &str| {
        let n = name.to_ascii_lowercase();
        n.starts_with("x-amz-") || n == "content-md5" || n == "content-type"
    };
    headers.iter().filter(|(k, _)| signed(k)).map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// The longest the answer to the PUT or POST `op` may take to come whole, where
/// `timeout` is `--request-timeout` (none: no bound): `timeout`, and for
/// CompleteMultipartUpload at least [`COMPLETE_AT_LEAST`].
pub(crate) fn answer_deadline(timeout: Option<Duration>, op: &str) -> Option<Duration> {
    let t = timeout?;
    match op.starts_with("CompleteMultipartUpload") {
        true => Some(t.max(COMPLETE_AT_LEAST)),
        false => Some(t),
    }
}

/// The bucket of `url` as `cfg` reaches it, and the server's name for messages.
pub(crate) fn address(url: &S3Url, cfg: &S3Config) -> Result<(Bucket, String), S3Error> {
    let (endpoint, style, server) = match &cfg.endpoint {
        Some(e) => {
            let u = crate::config::check_endpoint(e).map_err(|why| {
                let shown = if e.contains('@') { "(not shown: it holds an '@')".to_string() } else { format!("{e:?}") };
                S3Error::Config(format!("endpoint {shown}: {why}"))
            })?;
            (u, UrlStyle::Path, e.trim_end_matches('/').to_string())
        }
        None => {
            // China's regions (cn-*) are under amazonaws.com.cn.
            let suffix = if cfg.region.starts_with("cn-") { ".cn" } else { "" };
            let e = format!("https://s3.{}.amazonaws.com{suffix}", cfg.region);
            let u = url::Url::parse(&e).map_err(|err| S3Error::Config(format!("region {:?}: {err}", cfg.region)))?;
            // Names with dots do not match AWS's certificates as host names, and legacy
            // names with capitals or '_' are not host names at all: those go path-style.
            let virtual_ok = url.bucket.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
            let style = if virtual_ok { UrlStyle::VirtualHost } else { UrlStyle::Path };
            (u, style, format!("AWS ({})", cfg.region))
        }
    };
    let bucket = Bucket::new(endpoint, style, url.bucket.clone(), cfg.region.clone())
        .map_err(|e| S3Error::Config(format!("cannot address the bucket {} at {server}: {e:?}", url.bucket)))?;
    Ok((bucket, server))
}

pub(crate) fn credentials(cfg: &S3Config) -> Credentials {
    match &cfg.session_token {
        Some(t) => Credentials::new_with_token(&cfg.access_key_id, &cfg.secret_access_key, t),
        None => Credentials::new(&cfg.access_key_id, &cfg.secret_access_key),
    }
}

/// The `<Part>`s of one ListParts page, into `out` by number: (ETag, size). Read tag by
/// tag: servers differ in the root's name (ListPartsResult or ...Response) and rusty-s3's
/// typed parser insists on AWS's. Numbers outside `1..=max_parts` and ETags over
/// [`MAX_PART_ETAG_BYTES`] are errors; what `out` holds stays within `max_parts` entries.
pub(crate) fn parse_parts(
    body: &str,
    max_parts: u64,
    out: &mut std::collections::BTreeMap<u16, (String, u64)>,
) -> Result<(), String> {
    let shown = |part: &str| format!("{:?}", part.chars().take(200).collect::<String>());
    for part in xml_blocks(body, "Part") {
        let number = xml_text(part, "PartNumber").and_then(|n| n.parse::<u16>().ok());
        let size = xml_text(part, "Size").and_then(|n| n.parse::<u64>().ok());
        let (Some(n), Some(etag), Some(size)) = (number, xml_text(part, "ETag"), size) else {
            return Err(format!("ListParts answered a part without number, ETag or size: {}", shown(part)));
        };
        if n == 0 || u64::from(n) > max_parts {
            return Err(format!("ListParts answered part {n}, but the upload has parts 1 to {max_parts} only"));
        }
        if etag.len() > MAX_PART_ETAG_BYTES {
            return Err(format!(
                "ListParts answered part {n} with an ETag of {} bytes (at most {MAX_PART_ETAG_BYTES} are expected)",
                etag.len()
            ));
        }
        out.insert(n, (etag, size));
    }
    Ok(())
}

/// `body` is an S3 `<Error>` document.
fn is_error_body(body: &str) -> bool {
    let mut b = body.trim_start();
    if b.starts_with("<?xml") {
        b = b.find("?>").map_or("", |end| b[end + 2..].trim_start());
    }
    b.starts_with("<Error>") || b.starts_with("<Error ")
}

/// The text of the first `<tag>...</tag>` in `xml`, with the five XML entities decoded.
/// Enough for S3's flat answers (`<Error><Code>`, `<UploadId>`); not a general parser.
pub(crate) fn xml_text(xml: &str, tag: &str) -> Option<String> {
    xml_texts(xml, tag).into_iter().next()
}

/// Every `<tag>...</tag>` text in `xml`, in order.
pub(crate) fn xml_texts(xml: &str, tag: &str) -> Vec<String> {
    xml_blocks(xml, tag).into_iter().map(unescape).collect()
}

/// Every `<tag>...</tag>` content in `xml` as it stands (for nested elements).
pub(crate) fn xml_blocks<'a>(xml: &'a str, tag: &str) -> Vec<&'a str> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let mut out = Vec::new();
    let mut rest = xml;
    while let Some(start) = rest.find(&open) {
        let after = &rest[start + open.len()..];
        let Some(end) = after.find(&close) else { break };
        out.push(&after[..end]);
        rest = &after[end + close.len()..];
    }
    out
}

fn unescape(s: &str) -> String {
    s.replace("&quot;", "\"").replace("&apos;", "'").replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aws_addressing() {
        let cfg = S3Config {
            access_key_id: "K".into(),
            secret_access_key: "S".into(),
            session_token: None,
            region: "eu-west-1".into(),
            endpoint: None,
            credentials_from: "test".into(),
            ca_bundle: None,
            expiration: None,
        };
        let (b, server) = address(&S3Url::parse("s3://my-bucket/a b/c").unwrap(), &cfg).unwrap();
        assert_eq!(b.object_url("a b/c").as_str(), "https://my-bucket.s3.eu-west-1.amazonaws.com/a%20b/c");
        assert_eq!(server, "AWS (eu-west-1)");
        let (b, _) = address(&S3Url::parse("s3://my.bucket/k").unwrap(), &cfg).unwrap();
        assert_eq!(b.object_url("k").as_str(), "https://s3.eu-west-1.amazonaws.com/my.bucket/k");
        let cn = S3Config { region: "cn-north-1".into(), ..cfg.clone() };
        let (b, _) = address(&S3Url::parse("s3://bk/k").unwrap(), &cn).unwrap();
        assert_eq!(b.object_url("k").as_str(), "https://bk.s3.cn-north-1.amazonaws.com.cn/k");
        assert_eq!(crate::config::sts_endpoint("cn-northwest-1"), "https://sts.cn-northwest-1.amazonaws.com.cn");
        assert_eq!(crate::config::sts_endpoint("eu-west-1"), "https://sts.eu-west-1.amazonaws.com");
        let cfg = S3Config { endpoint: Some("http://127.0.0.1:7480/".into()), ..cfg };
        let (b, server) = address(&S3Url::parse("s3://bk/x/y").unwrap(), &cfg).unwrap();
        assert_eq!(b.object_url("x/y").as_str(), "http://127.0.0.1:7480/bk/x/y");
        assert_eq!(server, "http://127.0.0.1:7480");
    }

    #[test]
    fn put_and_post_deadlines() {
        let t = Some(Duration::from_secs(60));
        assert_eq!(answer_deadline(None, "UploadPart 1"), None);
        assert_eq!(answer_deadline(t, "CreateMultipartUpload"), t);
        assert_eq!(answer_deadline(t, "UploadPart 3"), t);
        assert_eq!(answer_deadline(t, "CompleteMultipartUpload"), Some(COMPLETE_AT_LEAST));
        let long = Some(Duration::from_secs(600));
        assert_eq!(answer_deadline(long, "CompleteMultipartUpload"), long);
    }

    #[test]
    fn the_users_x_amz_headers_are_to_be_signed() {
        let h: Vec<(String, String)> = [("X-Amz-Meta-A", "1"), ("Content-MD5", "m"), ("X-Other", "o"), ("accept", "a")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(headers_to_sign(&h), [("X-Amz-Meta-A", "1"), ("Content-MD5", "m")]);
    }

    #[test]
    fn xml_texts_of_flat_answers() {
        let x =
            "<?xml version=\"1.0\"?><Error><Code>NoSuchKey</Code><Message>The key &amp; &lt;it&gt;</Message></Error>";
        assert_eq!(xml_text(x, "Code").as_deref(), Some("NoSuchKey"));
        assert_eq!(xml_text(x, "Message").as_deref(), Some("The key & <it>"));
        assert_eq!(xml_text(x, "UploadId"), None);
        assert!(is_error_body("<?xml version=\"1.0\"?>\n  <Error><Code>InternalError</Code></Error>"));
        assert!(is_error_body("<Error>"));
        assert!(!is_error_body("<?xml?><CompleteMultipartUploadResult><Error>no</Error>"));
        assert!(!is_error_body(""));
        let x = "<U><UploadId>a</UploadId><UploadId>b</UploadId><UploadId>c";
        assert_eq!(xml_texts(x, "UploadId"), ["a", "b"]);
    }

    fn part(n: &str, etag: &str) -> String {
        format!("<Part><PartNumber>{n}</PartNumber><ETag>{etag}</ETag><Size>5</Size></Part>")
    }

    #[test]
    fn list_parts_keeps_only_the_uploads_parts() {
        let mut out = std::collections::BTreeMap::new();
        let page = format!(
            "<ListPartsResult>{}{}{}</ListPartsResult>",
            part("2", "\"b\""),
            part("1", "\"a\""),
            part("2", "\"c\"")
        );
        parse_parts(&page, 3, &mut out).unwrap();
        assert_eq!(out.len(), 2, "a number listed twice counts once");
        assert_eq!(out[&2], ("\"c\"".to_string(), 5));
        for bad in ["0", "4", "65535"] {
            let e = parse_parts(&part(bad, "\"x\""), 3, &mut out).unwrap_err();
            assert!(e.contains(&format!("part {bad}")) && e.contains("1 to 3"), "{e}");
        }
        assert!(parse_parts(&part("99999", "\"x\""), 3, &mut out).unwrap_err().contains("without number"));
        let e = parse_parts(&part("1", &"e".repeat(MAX_PART_ETAG_BYTES + 1)), 3, &mut out).unwrap_err();
        assert!(e.contains("ETag of 129 bytes"), "{e}");
        parse_parts(&part("1", &"e".repeat(MAX_PART_ETAG_BYTES)), 3, &mut out).unwrap();

        // A hostile page of 10,000 repeats of one huge part keeps nothing of it; one of
        // many small repeats keeps one entry.
        let huge = part("1", &"e".repeat(100_000)).repeat(40);
        assert!(parse_parts(&huge, 10_000, &mut std::collections::BTreeMap::new()).is_err());
        let mut out = std::collections::BTreeMap::new();
        parse_parts(&part("7", "\"x\"").repeat(10_000), 10_000, &mut out).unwrap();
        assert_eq!(out.len(), 1);
    }
}
