//! `s3://BUCKET/KEY` names.

use crate::S3Error;
use std::fmt;

/// The longest key S3 accepts, in bytes of UTF-8.
pub const MAX_KEY_BYTES: usize = 1024;

/// An object named as `s3://BUCKET/KEY`.
///
/// The key is everything after the first `/` following the bucket, taken literally: it
/// may contain further `/`, and it is **not** percent-decoded (`s3://b/a%20b` names the
/// key `a%20b`, as the AWS CLI reads it), so every key S3 can hold can be written down.
/// Characters that need escaping in a URL (space, `%`, `?`, `#`, non-ASCII) are escaped
/// when requests are signed, so `s3://b/q?x=1#f` is the key `q?x=1#f`. The key must be
/// non-empty, at most 1024 bytes, free of control characters, and free of `.` and `..`
/// segments, percent-encoded or not (`a/./b`, `../k`, `a/%2e%2e/b`): URL code resolves
/// those (`s3://a/../b/k` would write to bucket `b`), so no such key is sent anywhere;
/// the bucket is 1 to 255 characters of `A-Z a-z 0-9 . - _` (AWS is
/// stricter, 3-63 lowercase; other S3 servers and old AWS buckets are not, so the server
/// has the last word), and neither `.` nor `..` for the same reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Url {
    pub bucket: String,
    pub key: String,
}

impl S3Url {
    /// Parses `s3://BUCKET/KEY`.
    pub fn parse(s: &str) -> Result<S3Url, S3Error> {
        let bad = |reason: String| S3Error::InvalidUrl { url: redact(s), reason };
        let rest = match s.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("s3") => rest,
            _ => return Err(bad("an S3 object is written s3://BUCKET/KEY".into())),
        };
        let Some((bucket, key)) = rest.split_once('/') else {
            return Err(bad("no key: write s3://BUCKET/KEY (a whole bucket cannot be an image)".into()));
        };
        if bucket.is_empty() {
            return Err(bad("the bucket name is empty: write s3://BUCKET/KEY".into()));
        }
        if bucket.len() > 255 {
            return Err(bad(format!("the bucket name is {} characters long; S3 allows at most 63", bucket.len())));
        }
        if let Some(c) = bucket.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))) {
            return Err(bad(format!(
                "the bucket name contains {c:?}; bucket names are letters, digits, '.', '-' and '_' \
                 (credentials go in the environment or ~/.aws, never in the URL)"
            )));
        }
        if bucket == "." || bucket == ".." {
            return Err(bad(format!(
                "the bucket name is {bucket:?}, a path segment URLs resolve to another bucket: no S3 bucket \
                 has that name; write s3://BUCKET/KEY"
            )));
        }
        if key.is_empty() {
            return Err(bad("the key is empty: write s3://BUCKET/KEY".into()));
        }
        if key.len() > MAX_KEY_BYTES {
            return Err(bad(format!("the key is {} bytes long; S3 allows at most {MAX_KEY_BYTES}", key.len())));
        }
        if key.chars().any(|c| c.is_control()) {
            return Err(bad("the key contains a control character".into()));
        }
        if let Some(seg) = dot_segment(key) {
            return Err(bad(format!(
                "the key has a {seg:?} path segment, which URLs resolve to another object (or bucket): \
                 ferry refuses such keys; rename the object without '.' or '..' segments"
            )));
        }
        Ok(S3Url { bucket: bucket.to_string(), key: key.to_string() })
    }
}

/// The first `.` or `..` segment of `key` (split at `/`), after percent-decoding (so
/// `%2e%2E` and `a%2f..` count too).
fn dot_segment(key: &str) -> Option<&'static str> {
    let decoded: Vec<u8> = percent_encoding::percent_decode_str(key).collect();
    decoded.split(|&b| b == b'/').find_map(|seg| match seg {
        b"." => Some("."),
        b".." => Some(".."),
        _ => None,
    })
}

/// `s` with whatever stands before an `@` in its authority replaced, so a URL someone
/// wrote credentials into is never echoed whole.
fn redact(s: &str) -> String {
    let (head, rest) = s.split_once("://").unwrap_or(("", s));
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{head}://***{}", &rest[at..]),
        None => s.to_string(),
    }
}

impl fmt::Display for S3Url {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.key)
    }
}

impl std::str::FromStr for S3Url {
    type Err = S3Error;
    fn from_str(s: &str) -> Result<Self, S3Error> {
        S3Url::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bucket_and_literal_key() {
        let u = S3Url::parse("s3://my-bucket/dir/sub/disk%20a.img").unwrap();
        assert_eq!(u.bucket, "my-bucket");
        assert_eq!(u.key, "dir/sub/disk%20a.img", "no percent-decoding");
        assert_eq!(u.to_string(), "s3://my-bucket/dir/sub/disk%20a.img");
        let u: S3Url = "S3://b/k?x#y".parse().unwrap();
        assert_eq!((u.bucket.as_str(), u.key.as_str()), ("b", "k?x#y"));
        assert_eq!(S3Url::parse("s3://b//lead").unwrap().key, "/lead");
    }

    #[test]
    fn refuses_what_names_no_object() {
        for (s, why) in [
            ("http://b/k", "s3://BUCKET/KEY"),
            ("s3://bucket", "no key"),
            ("s3://bucket/", "key is empty"),
            ("s3:///key", "bucket name is empty"),
            ("s3://user:pw@b/k", "contains ':'"),
            ("s3://b/a\nb", "control"),
        ] {
            let e = S3Url::parse(s).unwrap_err().to_string();
            assert!(e.contains(why), "{s}: {e}");
            assert!(!e.contains("pw"), "{e}");
        }
        for s in [
            "s3://a/../b/k",
            "s3://b/..",
            "s3://b/.",
            "s3://b/d/./s/../k",
            "s3://b/k/..",
            "s3://b/%2e%2e/k",
            "s3://b/%2E/k",
            "s3://b/.%2e",
            "s3://b/a%2f..%2Fb",
        ] {
            let e = S3Url::parse(s).unwrap_err().to_string();
            assert!(e.contains("segment") && e.contains(s), "{s}: {e}");
        }
        for s in ["s3://../b/k", "s3://./b/k", "s3://../k"] {
            let e = S3Url::parse(s).unwrap_err().to_string();
            assert!(e.contains("segment") && e.contains(s), "{s}: {e}");
        }
        for ok in [
            "s3://b/...",
            "s3://.../k",
            "s3://a..b/k",
            "s3://b/.hidden",
            "s3://b/a./b",
            "s3://b/..k",
            "s3://b/%2e%2ex",
            "s3://b/%zz/.k",
        ] {
            assert!(S3Url::parse(ok).is_ok(), "{ok}");
        }
        let long = format!("s3://b/{}", "k".repeat(1025));
        assert!(S3Url::parse(&long).unwrap_err().to_string().contains("at most 1024"));
        assert!(S3Url::parse(&format!("s3://b/{}", "k".repeat(1024))).is_ok());
    }
}
