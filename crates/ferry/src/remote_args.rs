//! Flags for images on HTTP(S) and S3 stores, shared by serve, copy, hash and info.

use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug, Clone, Default)]
pub struct RemoteArgs {
    /// For https:// and s3:// images: trust the CA certificates in this PEM file instead
    /// of the system store (which SSL_CERT_FILE and SSL_CERT_DIR replace, as for curl).
    #[arg(long, value_name = "FILE")]
    pub ca: Option<PathBuf>,
    /// For https:// and s3:// images: do not check the server's certificate. Anyone on
    /// the path can then read and change the data; use --ca instead where you can.
    #[arg(long)]
    pub insecure: bool,
    /// An extra HTTP request header for http(s):// images, `NAME: VALUE` (repeatable),
    /// e.g. `--header 'Authorization: Bearer TOKEN'`. (Basic authentication can also be
    /// written in the URL: https://USER:PASSWORD@HOST/PATH.)
    #[arg(long = "header", value_name = "NAME: VALUE", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
}

impl RemoteArgs {
    /// The opener's options; `retries` and `retry_delay` from `ferry copy`'s flags where
    /// given (other commands keep ferry-http's defaults: 5 retries from 0.5 s).
    pub fn remote(&self) -> ferry_open::Remote {
        let http = ferry_http::HttpOptions {
            ca: self.ca.clone(),
            insecure: self.insecure,
            headers: self.headers.clone(),
            ..ferry_http::HttpOptions::default()
        };
        ferry_open::Remote { http }
    }
}

pub use ferry_open::shown;

fn parse_header(s: &str) -> Result<(String, String), String> {
    let (name, value) =
        s.split_once(':').ok_or_else(|| format!("{s:?} is not NAME: VALUE (e.g. 'Authorization: Bearer TOKEN')"))?;
    let name = name.trim();
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if name.is_empty() || !name.chars().all(token) {
        return Err(format!("{name:?} is not an HTTP header name"));
    }
    let value = value.trim();
    if value.chars().any(|c| c == '\r' || c == '\n' || c == '\0') {
        return Err("a header value cannot hold CR, LF or NUL".into());
    }
    Ok((name.to_string(), value.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers() {
        assert_eq!(parse_header("Authorization: Bearer x").unwrap(), ("Authorization".into(), "Bearer x".into()));
        assert_eq!(parse_header("X-A:b").unwrap(), ("X-A".into(), "b".into()));
        assert!(parse_header("nocolon").is_err());
        assert!(parse_header(": v").is_err());
        assert!(parse_header("Bad Name: v").is_err());
        assert!(parse_header("A: b\r\nEvil: c").is_err());
    }
}
