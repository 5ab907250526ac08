//! HTTP(S) images as read-only [`ferry_backend::Backend`]s.
//!
//! Interface shared with `ferry-s3` (which reads objects through presigned GETs) and the
//! opener. The implementation fills in `HttpBackend`.

use std::ops::Range;
use std::path::PathBuf;
use std::time::Duration;

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
    /// Time a request may go without progress before it counts as failed.
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
}
