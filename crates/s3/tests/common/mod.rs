//! What the tests against real S3 servers (moto.rs, radosgw.rs) share: a server's
//! address and keys, plain signed requests that do not go through ferry-s3 (to make
//! buckets and to check what an object holds), and test data.
#![allow(dead_code)] // each test binary uses its own subset

use ferry_http::HttpOptions;
use ferry_s3::{S3Config, S3Url};
use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};
use std::io::Read;
use std::time::Duration;

pub const MIB: u64 = 1 << 20;

/// An S3 server at `endpoint` (path-style) and a key pair it knows.
pub struct S3Server {
    pub endpoint: String,
    pub access_key_id: String,
    pub secret_access_key: String,
}

impl S3Server {
    pub fn config(&self) -> S3Config {
        S3Config::with_endpoint(&self.endpoint, &self.access_key_id, &self.secret_access_key, "us-east-1")
    }

    pub fn bucket(&self, name: &str) -> Bucket {
        Bucket::new(self.endpoint.parse().unwrap(), UrlStyle::Path, name.to_string(), "us-east-1").unwrap()
    }

    pub fn creds(&self) -> Credentials {
        Credentials::new(&self.access_key_id, &self.secret_access_key)
    }

    /// Creates bucket `name` with a signed PUT.
    pub fn make_bucket(&self, name: &str) {
        let url = self.bucket(name).create_bucket(&self.creds()).sign(Duration::from_secs(600));
        let r = ureq::put(url.as_str()).send_empty().unwrap_or_else(|e| panic!("CreateBucket {name}: {e}"));
        assert_eq!(r.status(), 200, "CreateBucket {name}");
    }

    /// The object's bytes by a plain signed GET, or its HTTP status.
    pub fn get(&self, bucket: &str, key: &str) -> Result<Vec<u8>, u16> {
        let url = self.bucket(bucket).get_object(Some(&self.creds()), key).sign(Duration::from_secs(600));
        let agent = ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
        let mut r = agent.get(url.as_str()).call().expect("GET");
        if r.status() != 200 {
            return Err(r.status().as_u16());
        }
        let mut v = Vec::new();
        r.body_mut().as_reader().read_to_end(&mut v).unwrap();
        Ok(v)
    }

    /// Aborts multipart upload `id` of `bucket/key` with a plain signed DELETE.
    pub fn abort_upload(&self, bucket: &str, key: &str, id: &str) {
        let url =
            self.bucket(bucket).abort_multipart_upload(Some(&self.creds()), key, id).sign(Duration::from_secs(60));
        ureq::delete(url.as_str()).call().unwrap_or_else(|e| panic!("AbortMultipartUpload {bucket}/{key}: {e}"));
    }
}

/// Few retries, soon: the servers are local.
pub fn http() -> HttpOptions {
    HttpOptions { retries: 2, retry_delay: Duration::from_millis(50), ..HttpOptions::default() }
}

pub fn url(bucket: &str, key: &str) -> S3Url {
    S3Url::parse(&format!("s3://{bucket}/{key}")).unwrap()
}

/// Deterministic bytes that differ at every offset.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
