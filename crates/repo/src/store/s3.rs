//! A repository under an S3 prefix (`s3://BUCKET/PREFIX`): GET (ranged), PUT, DELETE and
//! ListObjectsV2 through ferry-s3's signed client ([`ferry_s3::S3Bucket`]). Object `NAME`
//! is the key `PREFIX/NAME` (`NAME` at the bucket's top without a prefix).
use super::{invalid_name, valid_name, Store, StoreTime};
use ferry_s3::{S3Bucket, S3Error};
use std::io;

pub struct S3Store {
    shown: String,
    bucket: S3Bucket,
    /// The keys' common start: `PREFIX/`, or empty.
    prefix: String,
}

/// An S3 failure as the `io::Error` the [`Store`] interface speaks: a missing object is
/// `NotFound`, one too large `InvalidData`, a range past its end `UnexpectedEof`.
fn io_error(e: S3Error) -> io::Error {
    let kind = match &e {
        e if e.is_not_found() => io::ErrorKind::NotFound,
        S3Error::TooLarge { .. } | S3Error::Object { .. } => io::ErrorKind::InvalidData,
        S3Error::OutOfRange { .. } => io::ErrorKind::UnexpectedEof,
        S3Error::InvalidUrl { .. } => io::ErrorKind::InvalidInput,
        S3Error::Service { status: 403, .. } => io::ErrorKind::PermissionDenied,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e.to_string())
}

impl S3Store {
    /// A store at `url` (`s3://BUCKET[/PREFIX]`), with ferry-s3's configuration (endpoint,
    /// region, credentials from the environment) and HTTP options.
    pub fn open(url: &str, cfg: &ferry_s3::S3Config, http: &ferry_http::HttpOptions) -> io::Result<S3Store> {
        // Credentials never go in the URL; one that holds an '@' is not shown in case.
        let said = if url.contains('@') { "the repository URL" } else { url };
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("{said}: {why}"));
        let rest = match url.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("s3") => rest,
            _ => return Err(bad("an S3 repository is written s3://BUCKET/PREFIX")),
        };
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_end_matches('/');
        if prefix.contains("//") {
            return Err(bad("the prefix has an empty segment ('//')"));
        }
        // The bucket and prefix are checked as an s3:// object's are (no '.' or '..'
        // segments, no control characters, the bucket's characters).
        if !prefix.is_empty() {
            ferry_s3::S3Url::parse(&format!("s3://{bucket}/{prefix}")).map_err(io_error)?;
        }
        let b = S3Bucket::new(bucket, cfg, http).map_err(io_error)?;
        let shown = match prefix {
            "" => format!("s3://{bucket}"),
            p => format!("s3://{bucket}/{p}"),
        };
        let prefix = match prefix {
            "" => String::new(),
            p => format!("{p}/"),
        };
        Ok(S3Store { shown, bucket: b, prefix })
    }

    /// Lists `n` keys per request (tests of ListObjectsV2's continuation).
    #[doc(hidden)]
    pub fn with_page_keys(mut self, n: u32) -> S3Store {
        self.bucket = self.bucket.with_page_keys(n);
        self
    }

    /// The key of object `name`, checked.
    fn key(&self, name: &str) -> io::Result<String> {
        match valid_name(name) {
            true => Ok(format!("{}{name}", self.prefix)),
            false => Err(invalid_name(name)),
        }
    }
}

impl Store for S3Store {
    fn describe(&self) -> String {
        self.shown.clone()
    }
    fn get(&self, name: &str, limit: u64) -> io::Result<Vec<u8>> {
        self.bucket.get(&self.key(name)?, limit).map_err(io_error)
    }
    /// `Last-Modified` and the server's `Date`: both the server's clock.
    fn get_timed(&self, name: &str, limit: u64) -> io::Result<(Vec<u8>, Option<StoreTime>)> {
        let (data, t) = self.bucket.get_timed(&self.key(name)?, limit).map_err(io_error)?;
        Ok((data, t.modified.map(|modified| StoreTime { modified, now: t.now })))
    }
    fn get_range(&self, name: &str, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        self.bucket.get_range(&self.key(name)?, offset, len).map_err(io_error)
    }
    fn len(&self, name: &str) -> io::Result<u64> {
        self.bucket.len(&self.key(name)?).map_err(io_error)
    }
    fn put(&self, name: &str, data: &[u8]) -> io::Result<()> {
        self.bucket.put(&self.key(name)?, data).map_err(io_error)
    }
    fn delete(&self, name: &str) -> io::Result<()> {
        self.bucket.delete(&self.key(name)?).map_err(io_error)
    }
    fn list(&self, prefix: &str) -> io::Result<Vec<(String, u64)>> {
        let all = self.bucket.list(&format!("{}{prefix}", self.prefix)).map_err(io_error)?;
        // Keys under the prefix that are not objects' names (someone else's files) are
        // not the repository's.
        Ok(all
            .into_iter()
            .filter_map(|(k, n)| {
                k.strip_prefix(&self.prefix).filter(|name| valid_name(name)).map(|name| (name.to_string(), n))
            })
            .collect())
    }
}
