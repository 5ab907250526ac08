//! Parsing of the few header values ferry-http reads, and the small encoders it needs.
//! Pure functions on strings: no I/O, so every hostile input is easy to test.
//!
//! `Content-Range` is RFC 9110 section 14.4; `Authorization: Basic` is RFC 7617.

/// A `Content-Range` of a 206 or 416 answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ContentRange {
    /// `bytes FIRST-LAST/TOTAL` (`total` is `None` for `*`).
    Bytes { first: u64, last: u64, total: Option<u64> },
    /// `bytes */TOTAL` (a 416 answer: the range asked for is not satisfiable).
    Unsatisfied { total: u64 },
}

/// Parses a `Content-Range` value; `None` when it is malformed (including `last < first`,
/// `last >= total` and numbers that overflow a u64).
pub(crate) fn parse_content_range(value: &str) -> Option<ContentRange> {
    let rest = value.trim().strip_prefix("bytes")?;
    let rest = rest.strip_prefix(|c: char| c == ' ' || c == '\t')?.trim_start();
    let (range, total) = rest.split_once('/')?;
    let total = total.trim();
    if range.trim() == "*" {
        return Some(ContentRange::Unsatisfied { total: parse_u64(total)? });
    }
    let total = match total {
        "*" => None,
        t => Some(parse_u64(t)?),
    };
    let (first, last) = range.trim().split_once('-')?;
    let (first, last) = (parse_u64(first)?, parse_u64(last)?);
    if last < first || total.is_some_and(|t| last >= t) {
        return None;
    }
    Some(ContentRange::Bytes { first, last, total })
}

/// A decimal u64 of ASCII digits only (no sign, no spaces, no overflow).
pub(crate) fn parse_u64(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 20 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Standard base64 with padding (RFC 4648 section 4), for `Authorization: Basic`.
pub(crate) fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Whether `host` is excluded from proxying by a `no_proxy` value: a list of names
/// separated by commas or spaces, each matching the host itself and its subdomains
/// (`example.com` and `.example.com` both match `a.example.com`), `*` matching every host.
/// Names are compared without case; IP addresses match only exactly (no CIDR ranges).
pub(crate) fn no_proxy_matches(no_proxy: &str, host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']').trim_end_matches('.');
    no_proxy.split([',', ' ', '\t']).map(str::trim).filter(|e| !e.is_empty()).any(|entry| {
        if entry == "*" {
            return true;
        }
        let entry = entry.trim_start_matches("*.").trim_start_matches('.');
        let entry = entry.trim_start_matches('[').trim_end_matches(']').trim_end_matches('.');
        if entry.is_empty() {
            return false;
        }
        if host.eq_ignore_ascii_case(entry) {
            return true;
        }
        let (host, entry) = (host.as_bytes(), entry.as_bytes());
        host.len() > entry.len()
            && host[host.len() - entry.len() - 1] == b'.'
            && host[host.len() - entry.len()..].eq_ignore_ascii_case(entry)
    })
}

/// The longest validator (`ETag`, `Last-Modified`, `x-amz-version-id`) kept: real ones
/// are under 100 bytes; a longer one is ignored, not stored.
pub(crate) const MAX_VALIDATOR_BYTES: usize = 256;

/// What pins an object's content (RFC 9110 section 8.8): its `ETag`, `Last-Modified` and,
/// from S3, `x-amz-version-id`, as the first answer gave them. Later answers must carry
/// the same ones, and later requests ask for them (`If-Match`, else
/// `If-Unmodified-Since`), so bytes of two versions of an object are never mixed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Validators {
    pub etag: Option<String>,
    pub last_modified: Option<String>,
    pub version: Option<String>,
}

impl Validators {
    /// From raw header values (`None`: absent or not text); values that are empty, too
    /// long or hold anything but visible ASCII and spaces are ignored.
    pub(crate) fn new(etag: Option<&str>, last_modified: Option<&str>, version: Option<&str>) -> Validators {
        let keep = |v: Option<&str>| {
            v.map(str::trim)
                .filter(|v| {
                    !v.is_empty() && v.len() <= MAX_VALIDATOR_BYTES && v.bytes().all(|b| (b' '..=b'~').contains(&b))
                })
                .map(str::to_string)
        };
        Validators { etag: keep(etag), last_modified: keep(last_modified), version: keep(version) }
    }

    /// The ETag when it is strong (not `W/"..."`): only a strong one may go in `If-Match`.
    pub(crate) fn strong_etag(&self) -> Option<&str> {
        self.etag.as_deref().filter(|e| !e.starts_with("W/"))
    }

    /// No validator at all: a change of the object cannot be detected.
    pub(crate) fn is_empty(&self) -> bool {
        self.etag.is_none() && self.last_modified.is_none() && self.version.is_none()
    }

    /// The conditional header later requests carry: `If-Match` with a strong ETag, else
    /// `If-Unmodified-Since` with the Last-Modified date, else none.
    pub(crate) fn condition(&self) -> Option<(&'static str, String)> {
        match (self.strong_etag(), &self.last_modified) {
            (Some(e), _) => Some(("If-Match", e.to_string())),
            (None, Some(lm)) => Some(("If-Unmodified-Since", lm.clone())),
            (None, None) => None,
        }
    }

    /// How a later answer's validators differ from these (a validator absent from either
    /// side is not compared); `None` when they agree.
    pub(crate) fn change(&self, now: &Validators) -> Option<String> {
        let pairs = [("ETag", &self.etag, &now.etag), ("Last-Modified", &self.last_modified, &now.last_modified)];
        let version = [("version id", &self.version, &now.version)];
        pairs.iter().chain(version.iter()).find_map(|(what, was, is)| match (was, is) {
            (Some(was), Some(is)) if was != is => Some(format!("its {what} was {was}, the server now sends {is}")),
            _ => None,
        })
    }

    /// The part of a resume identity these make: the strong ETag, else the Last-Modified
    /// date; and the version id. Empty when there is none.
    pub(crate) fn identity(&self) -> String {
        let mut out = String::new();
        match (self.strong_etag(), &self.last_modified) {
            (Some(e), _) => out.push_str(&format!(" etag={e}")),
            (None, Some(lm)) => out.push_str(&format!(" last-modified={lm}")),
            (None, None) => {}
        }
        if let Some(v) = &self.version {
            out.push_str(&format!(" version={v}"));
        }
        out
    }
}

/// The parsers above, for the fuzz target (`fuzz/fuzz_targets/remote.rs`): none may
/// panic on any input, and what they accept must be self-consistent.
#[doc(hidden)]
pub fn fuzz(text: &str) {
    if let Some(ContentRange::Bytes { first, last, total }) = parse_content_range(text) {
        assert!(first <= last && total.is_none_or(|t| last < t));
    }
    let _ = parse_u64(text);
    let _ = base64(text.as_bytes());
    if let Some((list, host)) = text.split_once('\n') {
        let _ = no_proxy_matches(list, host);
    }
    let v = Validators::new(Some(text), Some(text), None);
    let _ = (v.condition(), v.change(&Validators::default()), v.identity());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_range_values() {
        assert_eq!(
            parse_content_range("bytes 0-65535/4294967296"),
            Some(ContentRange::Bytes { first: 0, last: 65535, total: Some(1 << 32) })
        );
        assert_eq!(
            parse_content_range("bytes 10-10/*"),
            Some(ContentRange::Bytes { first: 10, last: 10, total: None })
        );
        assert_eq!(parse_content_range("bytes */0"), Some(ContentRange::Unsatisfied { total: 0 }));
        assert_eq!(
            parse_content_range(" bytes  5-9/10 "),
            Some(ContentRange::Bytes { first: 5, last: 9, total: Some(10) })
        );
        for bad in [
            "",
            "bytes",
            "bytes 0-9",
            "bytes 9-0/10",
            "bytes 0-10/10",
            "bytes -1-5/10",
            "bytes 0-+5/10",
            "bytes 0-99999999999999999999/*",
            "bytes 0-18446744073709551616/*",
            "items 0-9/10",
            "bytes0-9/10",
            "bytes */*",
            "bytes 0 - 9/10x",
        ] {
            assert_eq!(parse_content_range(bad), None, "{bad:?}");
        }
        assert_eq!(
            parse_content_range("bytes 0-18446744073709551614/18446744073709551615"),
            Some(ContentRange::Bytes { first: 0, last: u64::MAX - 1, total: Some(u64::MAX) })
        );
    }

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (i, o) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(i.as_bytes()), o);
        }
        assert_eq!(base64(b"Aladdin:open sesame"), "QWxhZGRpbjpvcGVuIHNlc2FtZQ==");
        assert_eq!(base64(&[0xff, 0xfe, 0xfd]), "//79");
    }

    #[test]
    fn validators_pin_an_object() {
        let v = Validators::new(Some(" \"abc\" "), Some("Wed, 21 Oct 2015 07:28:00 GMT"), Some("v1"));
        assert_eq!(v.strong_etag(), Some("\"abc\""));
        assert_eq!(v.condition(), Some(("If-Match", "\"abc\"".to_string())));
        assert_eq!(v.identity(), " etag=\"abc\" version=v1");
        assert_eq!(v.change(&v), None);
        assert_eq!(v.change(&Validators::default()), None, "an answer without validators is not compared");
        let other = Validators::new(Some("\"def\""), None, None);
        assert!(v.change(&other).unwrap().contains("ETag was \"abc\""));
        let other = Validators::new(None, None, Some("v2"));
        assert!(v.change(&other).unwrap().contains("version id"));

        // A weak ETag is compared, never sent in If-Match: Last-Modified is the condition.
        let weak = Validators::new(Some("W/\"x\""), Some("Thu, 01 Jan 2026 00:00:00 GMT"), None);
        assert_eq!(weak.strong_etag(), None);
        assert_eq!(weak.condition(), Some(("If-Unmodified-Since", "Thu, 01 Jan 2026 00:00:00 GMT".to_string())));
        assert_eq!(weak.identity(), " last-modified=Thu, 01 Jan 2026 00:00:00 GMT");
        assert!(weak.change(&Validators::new(Some("W/\"y\""), None, None)).is_some());

        let none = Validators::new(None, Some(""), Some(&"x".repeat(MAX_VALIDATOR_BYTES + 1)));
        assert!(none.is_empty() && none.condition().is_none() && none.identity().is_empty());
        assert!(Validators::new(Some("\"a\r\nX: y\""), None, None).is_empty(), "no control characters");
    }

    #[test]
    fn no_proxy_lists() {
        assert!(no_proxy_matches("*", "anything.example"));
        assert!(no_proxy_matches("localhost,127.0.0.1", "127.0.0.1"));
        assert!(no_proxy_matches("example.com", "a.b.Example.COM"));
        assert!(no_proxy_matches(".example.com", "a.example.com"));
        assert!(no_proxy_matches("*.example.com", "example.com"));
        assert!(no_proxy_matches("foo, example.com", "example.com."));
        assert!(no_proxy_matches("::1", "[::1]"));
        assert!(!no_proxy_matches("example.com", "badexample.com"));
        assert!(!no_proxy_matches("a.example.com", "example.com"));
        assert!(!no_proxy_matches("", "example.com"));
        assert!(!no_proxy_matches(" , .", "example.com"));
        assert!(!no_proxy_matches("127.0.0.1", "127.0.0.10"));
        assert!(no_proxy_matches("é", "x.é"));
        assert!(!no_proxy_matches("éé", "aé"));
    }
}
