//! `s3://BUCKET/KEY` objects: a store on ferry-s3. Credentials, region and endpoint come
//! from where the AWS tools look (AWS_* variables, ~/.aws/credentials and ~/.aws/config),
//! once per process (`S3Config::from_env` keeps them), however many objects a command opens.

use anyhow::{Context, Result};
use ferry_backend::Backend;
use ferry_http::HttpOptions;
use ferry_s3::{S3Config, S3Url, S3Writer, WriterOptions};
use std::sync::Arc;

/// S3 signs each request itself: an extra `Authorization` header, or one of the headers
/// its signature sets (`x-amz-date`, `x-amz-content-sha256`, `x-amz-security-token`),
/// would clash with it.
pub(crate) fn http_for_s3(http: &HttpOptions) -> Result<HttpOptions> {
    let signers = ["x-amz-date", "x-amz-content-sha256", "x-amz-security-token"];
    if let Some((n, _)) = http.headers.iter().find(|(n, _)| signers.iter().any(|s| n.eq_ignore_ascii_case(s))) {
        anyhow::bail!(
            "--header {n} cannot go with s3://: ferry's signature of each request sets it (credentials come \
             from the environment or a profile)"
        );
    }
    if http.headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("authorization")) {
        anyhow::bail!(
            "--header Authorization cannot go with s3:// (requests are signed with the AWS credentials): \
             set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or a profile instead"
        );
    }
    Ok(http.clone())
}

fn parse(url: &str) -> Result<(S3Url, S3Config)> {
    let u = S3Url::parse(url)?;
    let cfg = S3Config::from_env().with_context(|| format!("cannot reach {u}"))?;
    Ok((u, cfg))
}

/// An object opened for reading (parallel ranged GETs through ferry-http).
pub fn open(url: &str, http: &HttpOptions) -> Result<Arc<dyn Backend>> {
    let (u, cfg) = parse(url)?;
    Ok(ferry_s3::open_source(&u, &cfg, &http_for_s3(http)?)?)
}

/// A new object of `size` bytes, written as a multipart upload that appears only when
/// `complete` is called (dropping the writer unfinished aborts the upload).
pub fn writer(url: &str, size: u64, http: &HttpOptions) -> Result<Arc<S3Writer>> {
    let (u, cfg) = parse(url)?;
    Ok(Arc::new(S3Writer::create(&u, &cfg, &http_for_s3(http)?, size)?))
}

/// The upload `upload_id` of `url` (of an object of `size` bytes) that an earlier copy
/// kept, continued: its stored parts count as written.
pub fn resume_writer(url: &str, size: u64, upload_id: &str, http: &HttpOptions) -> Result<Arc<S3Writer>> {
    let (u, cfg) = parse(url)?;
    let w = S3Writer::resume_upload(&u, &cfg, &http_for_s3(http)?, size, &WriterOptions::default(), upload_id)?;
    Ok(Arc::new(w))
}

/// Aborts the upload `upload_id` of `url` that an earlier copy kept.
pub fn abort_upload(url: &str, upload_id: &str, http: &HttpOptions) -> Result<()> {
    let (u, cfg) = parse(url)?;
    ferry_s3::abort_upload(&u, &cfg, &http_for_s3(http)?, upload_id)
        .with_context(|| format!("cannot abort the upload {upload_id} of {u}"))
}
