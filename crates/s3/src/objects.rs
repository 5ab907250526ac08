//! Whole objects of one bucket, by key: GET (whole or a range), HEAD, PUT, DELETE and
//! ListObjectsV2, through the same signed client, retries and error hints as the rest of
//! this crate. What ferry's backup repository (`ferry-repo`'s S3 store) stands on.
//!
//! Every answer is bounded: a GET keeps at most what the caller allows (an object whose
//! `Content-Length` is larger is not read at all), a listing page at most
//! `MAX_ANSWER_BYTES`, a whole listing at most [`MAX_LIST_KEYS`] keys.

use crate::client::{Client, Method, MAX_ANSWER_BYTES, SIGN_FOR};
use crate::{sigv4, S3Config, S3Error, S3Url};
use ferry_http::HttpOptions;
use rusty_s3::S3Action;

/// The most keys [`S3Bucket::list`] gathers (about 320 TB of 32 MiB objects); more is
/// an error rather than unbounded memory.
pub const MAX_LIST_KEYS: usize = 10_000_000;
/// Keys asked for per ListObjectsV2 page (S3's maximum).
const PAGE_KEYS: u32 = 1000;

/// One bucket, its objects named by key.
pub struct S3Bucket {
    client: Client,
    page_keys: u32,
}

impl S3Bucket {
    /// The bucket `bucket` as `cfg` (endpoint, region, credentials) and `http` (trust,
    /// timeouts, retries, proxy) reach it. Nothing is sent yet.
    pub fn new(bucket: &str, cfg: &S3Config, http: &HttpOptions) -> Result<S3Bucket, S3Error> {
        // The bucket's name is checked as an s3:// URL's is.
        let url = S3Url::parse(&format!("s3://{bucket}/k"))?;
        let client = Client::new(&S3Url { bucket: url.bucket, key: String::new() }, cfg, http)?;
        Ok(S3Bucket { client, page_keys: PAGE_KEYS })
    }

    /// Lists `n` keys per request instead of 1000 (tests of the continuation).
    #[doc(hidden)]
    pub fn with_page_keys(mut self, n: u32) -> S3Bucket {
        self.page_keys = n.clamp(1, PAGE_KEYS);
        self
    }

    /// `s3://BUCKET/KEY`, for messages.
    pub fn target(&self, key: &str) -> String {
        format!("s3://{}/{key}", self.client.url.bucket)
    }

    /// Checks `key` as an `s3://` URL's key is checked (no `.`/`..` segments, no control
    /// characters, at most 1024 bytes).
    fn check(&self, key: &str) -> Result<(), S3Error> {
        S3Url::parse(&self.target(key)).map(drop)
    }

    /// The error of `op` on `key`: the client's, naming the object.
    fn named(&self, key: &str, e: S3Error) -> S3Error {
        let t = self.target(key);
        match e {
            S3Error::Service { op, status, code, message, hint, .. } => {
                S3Error::Service { target: t, op, status, code, message, hint }
            }
            S3Error::Transport { op, message, .. } => S3Error::Transport { target: t, op, message },
            S3Error::Object { message, .. } => S3Error::Object { target: t, message },
            other => other,
        }
    }

    /// The whole object, refused ([`S3Error::TooLarge`]) when it is larger than `limit`
    /// bytes: by its `Content-Length` before its body is read, or once `limit + 1` bytes
    /// came without one.
    pub fn get(&self, key: &str, limit: u64) -> Result<Vec<u8>, S3Error> {
        self.get_timed(key, limit).map(|(data, _)| data)
    }

    /// As [`S3Bucket::get`], with the object's `Last-Modified` and the server's `Date`
    /// (its clock when it answered), where the server sent them: so that a caller can
    /// tell an object's age by the server's clock alone.
    pub fn get_timed(&self, key: &str, limit: u64) -> Result<(Vec<u8>, ServerTimes), S3Error> {
        self.check(key)?;
        let c = &self.client;
        let sign = || c.bucket.get_object(Some(&c.creds), key).sign(SIGN_FOR);
        let a = c.send_for_data("GetObject", &sign, &[], limit).map_err(|e| self.named(key, e))?;
        let size = a.content_length.unwrap_or(a.data.len() as u64).max(a.data.len() as u64);
        if size > limit {
            return Err(S3Error::TooLarge { target: self.target(key), size, limit });
        }
        if a.content_length.is_some_and(|n| n != a.data.len() as u64) {
            return Err(S3Error::Object {
                target: self.target(key),
                message: format!("the server sent {} of its {size} bytes", a.data.len()),
            });
        }
        let times = ServerTimes {
            modified: a.last_modified.as_deref().and_then(http_date),
            now: a.date.as_deref().and_then(http_date),
        };
        Ok((a.data, times))
    }

    /// `len` bytes from `offset` (a ranged GET): [`S3Error::OutOfRange`] when the object
    /// ends before `offset + len`.
    pub fn get_range(&self, key: &str, offset: u64, len: u64) -> Result<Vec<u8>, S3Error> {
        self.check(key)?;
        let end =
            offset.checked_add(len).ok_or_else(|| S3Error::OutOfRange { target: self.target(key), end: u64::MAX })?;
        if len == 0 {
            // No byte to ask for: the object only has to be long enough.
            return match self.len(key)? {
                size if size >= offset => Ok(Vec::new()),
                _ => Err(S3Error::OutOfRange { target: self.target(key), end }),
            };
        }
        let c = &self.client;
        let sign = || c.bucket.get_object(Some(&c.creds), key).sign(SIGN_FOR);
        let range = format!("bytes={offset}-{}", end - 1);
        let a = match c.send_for_data("GetObject", &sign, &[("range", &range)], len) {
            Ok(a) => a,
            // Not satisfiable: the object ends at or before `offset`.
            Err(S3Error::Service { status: 416, .. }) => {
                return Err(S3Error::OutOfRange { target: self.target(key), end })
            }
            Err(e) => return Err(self.named(key, e)),
        };
        if a.status != 206 {
            return Err(S3Error::Object {
                target: self.target(key),
                message: format!(
                    "the server answered a ranged GET with HTTP {} instead of 206 (it does not take ranges)",
                    a.status
                ),
            });
        }
        if (a.data.len() as u64) < len {
            return Err(S3Error::OutOfRange { target: self.target(key), end });
        }
        if a.data.len() as u64 > len {
            return Err(S3Error::Object {
                target: self.target(key),
                message: format!("the server sent more than the {len} bytes of {range}"),
            });
        }
        Ok(a.data)
    }

    /// The object's length (HEAD).
    pub fn len(&self, key: &str) -> Result<u64, S3Error> {
        self.check(key)?;
        let c = &self.client;
        let sign = || c.bucket.head_object(Some(&c.creds), key).sign(SIGN_FOR);
        let a = c.send("HeadObject", &sign, Method::Head, &[], &[]).map_err(|e| self.named(key, e))?;
        a.content_length.ok_or_else(|| S3Error::Object {
            target: self.target(key),
            message: "the server gave no Content-Length for the object".into(),
        })
    }

    /// Writes the whole object in one PutObject, its SHA-256 signed in the
    /// `Authorization` header (the server refuses bytes that arrive damaged). S3 makes it
    /// appear whole or not at all. Up to 5 GiB (S3's limit for one PUT).
    pub fn put(&self, key: &str, data: &[u8]) -> Result<(), S3Error> {
        self.check(key)?;
        let c = &self.client;
        let sha = sigv4::payload_sha256(data);
        let url = c.bucket.object_url(key);
        let signer = sigv4::Signer {
            key: c.creds.key(),
            secret: c.creds.secret(),
            token: c.creds.token(),
            region: c.bucket.region(),
        };
        let user = c.headers_to_sign();
        let sign = || (url.clone(), signer.sign("PUT", &url, &user, &sha, &jiff::Timestamp::now()));
        c.send_with("PutObject", &sign, Method::Put, &[], data).map(drop).map_err(|e| self.named(key, e))
    }

    /// Deletes the object; deleting a missing one is not an error (S3 says 204 either way).
    pub fn delete(&self, key: &str) -> Result<(), S3Error> {
        self.check(key)?;
        let c = &self.client;
        let sign = || c.bucket.delete_object(Some(&c.creds), key).sign(SIGN_FOR);
        match c.send("DeleteObject", &sign, Method::Delete, &[], &[]) {
            Ok(_) => Ok(()),
            Err(e) if e.is_not_found() => Ok(()),
            Err(e) => Err(self.named(key, e)),
        }
    }

    /// Every key starting with `prefix`, with its size (ListObjectsV2, following its
    /// continuation tokens), in the server's order.
    pub fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, S3Error> {
        let c = &self.client;
        let shown = self.target(prefix);
        let bad = |message: String| S3Error::Object { target: shown.clone(), message };
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        let max_keys = self.page_keys.to_string();
        loop {
            let mut query = vec![("list-type", "2"), ("max-keys", max_keys.as_str()), ("prefix", prefix)];
            if let Some(t) = &token {
                query.insert(0, ("continuation-token", t.as_str()));
            }
            let sign = || c.sign_bucket_get(&query);
            let a = c.send("ListObjectsV2", &sign, Method::Get, &[], &[]).map_err(|e| self.named(prefix, e))?;
            if a.body.len() as u64 >= MAX_ANSWER_BYTES {
                return Err(bad(format!("a ListObjectsV2 page is longer than {MAX_ANSWER_BYTES} bytes")));
            }
            let page = parse_list_page(&a.body).map_err(bad)?;
            for (key, size) in page.contents {
                if key.starts_with(prefix) {
                    out.push((key, size));
                }
            }
            if out.len() > MAX_LIST_KEYS {
                return Err(bad(format!("more than {MAX_LIST_KEYS} keys")));
            }
            match page.next {
                Some(next) if Some(&next) != token.as_ref() => token = Some(next),
                Some(_) => return Err(bad("ListObjectsV2 gave the same continuation token twice".into())),
                None => return Ok(out),
            }
        }
    }
}

/// An object's `Last-Modified` and the server's `Date`, each when sent and readable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ServerTimes {
    pub modified: Option<std::time::SystemTime>,
    pub now: Option<std::time::SystemTime>,
}

/// An HTTP date (`Sun, 06 Nov 1994 08:49:37 GMT`, RFC 9110's IMF-fixdate, a form of
/// RFC 2822's), or `None`.
pub fn http_date(s: &str) -> Option<std::time::SystemTime> {
    static P: jiff::fmt::rfc2822::DateTimeParser = jiff::fmt::rfc2822::DateTimeParser::new();
    P.parse_timestamp(s.trim()).ok().map(std::time::SystemTime::from)
}

/// One ListObjectsV2 page: its keys and sizes, and the next page's token when it is
/// truncated.
struct ListPage {
    contents: Vec<(String, u64)>,
    next: Option<String>,
}

/// Read tag by tag, as this crate reads every answer (servers differ in root names).
fn parse_list_page(body: &str) -> Result<ListPage, String> {
    let mut contents = Vec::new();
    for block in crate::client::xml_blocks(body, "Contents") {
        let key = crate::client::xml_text(block, "Key");
        let size = crate::client::xml_text(block, "Size").and_then(|s| s.trim().parse::<u64>().ok());
        match (key, size) {
            (Some(k), Some(s)) => contents.push((k, s)),
            _ => {
                let shown: String = block.chars().take(200).collect();
                return Err(format!("ListObjectsV2 answered an entry without key or size: {shown:?}"));
            }
        }
    }
    let truncated = crate::client::xml_text(body, "IsTruncated").is_some_and(|t| t.trim() == "true");
    let next = match truncated {
        false => None,
        true => match crate::client::xml_text(body, "NextContinuationToken") {
            Some(t) if !t.is_empty() => Some(t),
            _ => return Err("ListObjectsV2 said there is more but gave no continuation token".into()),
        },
    };
    Ok(ListPage { contents, next })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_dates() {
        let t = |s: &str| http_date(s).map(|t| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs());
        assert_eq!(t("Sun, 06 Nov 1994 08:49:37 GMT"), Some(784111777));
        assert_eq!(t(" Thu, 01 Jan 1970 00:00:01 GMT "), Some(1));
        for bad in ["", "yesterday", "Sun, 06 Nov 1994 08:49:37", "Sun, 32 Nov 1994 08:49:37 GMT"] {
            assert_eq!(http_date(bad), None, "{bad}");
        }
    }

    #[test]
    fn list_pages() {
        let body = "<?xml version=\"1.0\"?><ListBucketResult><Name>b</Name><IsTruncated>true</IsTruncated>\
            <Contents><Key>p/a&amp;b</Key><Size>12</Size></Contents><Contents><Key>p/c</Key><Size>0</Size>\
            </Contents><NextContinuationToken>tok/+=</NextContinuationToken></ListBucketResult>";
        let p = parse_list_page(body).unwrap();
        assert_eq!(p.contents, [("p/a&b".to_string(), 12), ("p/c".to_string(), 0)]);
        assert_eq!(p.next.as_deref(), Some("tok/+="));
        let last = parse_list_page("<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>").unwrap();
        assert!(last.contents.is_empty() && last.next.is_none());
        assert!(parse_list_page("<IsTruncated>true</IsTruncated>").is_err());
        assert!(parse_list_page("<Contents><Key>k</Key><Size>-1</Size></Contents>").is_err());
        assert!(parse_list_page("<Contents><Size>1</Size></Contents>").is_err());
    }
}
