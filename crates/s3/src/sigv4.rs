//! AWS Signature Version 4 in the `Authorization` header, with the payload's SHA-256
//! signed (`x-amz-content-sha256`): what UploadPart sends so that the server checks each
//! part's bytes. rusty-s3 only presigns URLs, whose payload is `UNSIGNED-PAYLOAD`.
//! No I/O: the caller gives the time and sends the headers.
//!
//! <https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-header-based-auth.html>

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};
use std::fmt::Write as _;

type HmacSha256 = Hmac<Sha256>;

/// Who signs: the key pair (and session token) and the region.
pub(crate) struct Signer<'a> {
    pub key: &'a str,
    pub secret: &'a str,
    pub token: Option<&'a str>,
    pub region: &'a str,
}

/// The hex SHA-256 of `bytes`: the `x-amz-content-sha256` of a body.
pub(crate) fn payload_sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// AWS's URI encoding of a query parameter's name or value: every byte but the
/// unreserved `A-Z a-z 0-9 - _ . ~` as `%XX`.
pub(crate) fn uri_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The query string of `query` (sorted by name) as both the URL and the canonical
/// request carry it.
pub(crate) fn query_string(query: &[(&str, &str)]) -> String {
    let mut q: Vec<(String, String)> = query.iter().map(|(k, v)| (uri_encode(k), uri_encode(v))).collect();
    q.sort();
    q.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&")
}

impl Signer<'_> {
    /// The headers that sign a `method` request of `url` (its path already
    /// percent-encoded, its query made by [`query_string`]) carrying `signed` headers
    /// (lowercase names, sent as given) and a body whose hex SHA-256 is
    /// `payload_sha256`, at `now`: `x-amz-date`, `x-amz-content-sha256`,
    /// `x-amz-security-token` with a session token, and `authorization`.
    pub(crate) fn sign(
        &self,
        method: &str,
        url: &url::Url,
        signed: &[(&str, &str)],
        payload_sha256: &str,
        now: &jiff::Timestamp,
    ) -> Vec<(String, String)> {
        let date_time = now.strftime("%Y%m%dT%H%M%SZ").to_string();
        let date = &date_time[..8];
        let host = match url.port() {
            Some(p) => format!("{}:{p}", url.host_str().unwrap_or_default()),
            None => url.host_str().unwrap_or_default().to_string(),
        };
        let mut out: Vec<(String, String)> =
            vec![("x-amz-content-sha256".into(), payload_sha256.into()), ("x-amz-date".into(), date_time.clone())];
        if let Some(t) = self.token {
            out.push(("x-amz-security-token".into(), t.into()));
        }
        let mut headers: Vec<(String, String)> = vec![("host".into(), host)];
        // SigV4's Trimall: no blanks around a value, one space for each run of them inside.
        headers.extend(
            signed
                .iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v.split_ascii_whitespace().collect::<Vec<_>>().join(" "))),
        );
        headers.extend(out.iter().cloned());
        // A name given twice is one canonical header, its values joined by commas in
        // the order given (the sort is stable).
        headers.sort_by(|a, b| a.0.cmp(&b.0));
        headers.dedup_by(|later, first| {
            let same = later.0 == first.0;
            if same {
                first.1 = format!("{},{}", first.1, later.1);
            }
            same
        });
        let signed_names = headers.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(";");
        let mut canonical = format!("{method}\n{}\n{}\n", url.path(), url.query().unwrap_or(""));
        for (k, v) in &headers {
            let _ = writeln!(canonical, "{k}:{v}");
        }
        let _ = write!(canonical, "\n{signed_names}\n{payload_sha256}");
        let scope = format!("{date}/{}/s3/aws4_request", self.region);
        let to_sign = format!("AWS4-HMAC-SHA256\n{date_time}\n{scope}\n{}", hex(&Sha256::digest(canonical.as_bytes())));
        let mut k = hmac(format!("AWS4{}", self.secret).as_bytes(), date.as_bytes());
        for part in [self.region, "s3", "aws4_request"] {
            k = hmac(&k, part.as_bytes());
        }
        let signature = hex(&hmac(&k, to_sign.as_bytes()));
        out.push((
            "authorization".into(),
            format!(
                "AWS4-HMAC-SHA256 Credential={}/{scope},SignedHeaders={signed_names},Signature={signature}",
                self.key
            ),
        ));
        out
    }
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    // HMAC takes a key of any length.
    let mut m = <HmacSha256 as KeyInit>::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC takes any key"));
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GET example of AWS's "Signature Calculations for the Authorization Header".
    #[test]
    fn aws_example_get_object() {
        let s = Signer {
            key: "AKIAIOSFODNN7EXAMPLE",
            secret: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            token: None,
            region: "us-east-1",
        };
        let url = url::Url::parse("https://examplebucket.s3.amazonaws.com/test.txt").unwrap();
        let now: jiff::Timestamp = "2013-05-24T00:00:00Z".parse().unwrap();
        let empty = payload_sha256(b"");
        assert_eq!(empty, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        let h = s.sign("GET", &url, &[("range", "bytes=0-9")], &empty, &now);
        let auth = &h.iter().find(|(k, _)| k == "authorization").unwrap().1;
        assert_eq!(
            auth,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,\
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,\
             Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
        assert!(h.contains(&("x-amz-date".into(), "20130524T000000Z".into())));
        // A session token is signed and sent.
        let s = Signer { token: Some("TOKEN"), ..s };
        let h = s.sign("PUT", &url, &[], &empty, &now);
        assert!(h.contains(&("x-amz-security-token".into(), "TOKEN".into())));
        assert!(h
            .last()
            .unwrap()
            .1
            .contains("SignedHeaders=host;x-amz-content-sha256;x-amz-date;x-amz-security-token"));
    }

    #[test]
    fn headers_given_are_signed_and_a_repeated_name_is_one_header() {
        let s = Signer { key: "K", secret: "S", token: None, region: "us-east-1" };
        let url = url::Url::parse("http://127.0.0.1:9000/b/k?partNumber=1&uploadId=u").unwrap();
        let now: jiff::Timestamp = "2013-05-24T00:00:00Z".parse().unwrap();
        let given = [("X-Amz-Meta-A", " 2 "), ("content-md5", "bWQ1"), ("x-amz-meta-a", "1")];
        let h = s.sign("PUT", &url, &given, &payload_sha256(b""), &now);
        let auth = &h.last().unwrap().1;
        assert!(
            auth.contains("SignedHeaders=content-md5;host;x-amz-content-sha256;x-amz-date;x-amz-meta-a,"),
            "{auth}"
        );
        // The values joined in the order given: the same signature as one header "2,1".
        let one = s.sign("PUT", &url, &[("content-md5", "bWQ1"), ("x-amz-meta-a", "2,1")], &payload_sha256(b""), &now);
        assert_eq!(auth, &one.last().unwrap().1);
        // Runs of blanks inside a value count as one space (SigV4's Trimall).
        let spaced = s.sign("PUT", &url, &[("x-amz-meta-n", " a   b ")], &payload_sha256(b""), &now);
        let single = s.sign("PUT", &url, &[("x-amz-meta-n", "a b")], &payload_sha256(b""), &now);
        assert_eq!(spaced.last().unwrap().1, single.last().unwrap().1);
    }

    #[test]
    fn query_strings_are_sorted_and_encoded() {
        assert_eq!(
            query_string(&[("uploadId", "a b/c+d~"), ("partNumber", "7")]),
            "partNumber=7&uploadId=a%20b%2Fc%2Bd~"
        );
        assert_eq!(uri_encode("é"), "%C3%A9");
    }
}
