//! NBD URIs, as the NBD project's `doc/uri.md` and libnbd define them:
//! `nbd://host[:port]/export` and `nbd+unix:///export?socket=PATH` (and their `nbds`
//! forms, which need TLS).

use std::path::PathBuf;

/// Where and how to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    Tcp { host: String, port: u16 },
    Unix { path: PathBuf },
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uri {
    pub transport: Transport,
    pub export: String,
    /// `nbds` / `nbds+unix`: TLS is required.
    pub tls: bool,
}

/// A URI ferry cannot honour, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UriError {
    #[error("{0:?} is not a URI: {1}")]
    Syntax(String, String),
    #[error("{0:?}: unknown scheme {1:?}; use nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH")]
    Scheme(String, String),
    #[error("{0:?}: nbd+unix URIs need a socket parameter, e.g. nbd+unix:///?socket=/tmp/nbd.sock")]
    NoSocket(String),
    #[error("{0:?}: a TCP URI needs a host, e.g. nbd://localhost/")]
    NoHost(String),
    #[error("{0:?}: TLS (nbds://, nbds+unix://) is not supported by this ferry yet")]
    TlsUnsupported(String),
    #[error("{0:?}: export name is not valid UTF-8 after percent-decoding")]
    BadExport(String),
}

/// Default NBD port (IANA).
pub const NBD_PORT: u16 = 10809;

impl Uri {
    /// Whether a string looks like an NBD URI (as opposed to a local path).
    pub fn looks_like(s: &str) -> bool {
        ["nbd://", "nbds://", "nbd+unix://", "nbds+unix://", "nbd+tcp://", "nbds+tcp://"]
            .iter()
            .any(|p| s.starts_with(p))
    }

    pub fn parse(s: &str) -> Result<Uri, UriError> {
        let u = url::Url::parse(s).map_err(|e| UriError::Syntax(s.into(), e.to_string()))?;
        let (unix, tls) = match u.scheme() {
            "nbd" | "nbd+tcp" => (false, false),
            "nbds" | "nbds+tcp" => (false, true),
            "nbd+unix" => (true, false),
            "nbds+unix" => (true, true),
            other => return Err(UriError::Scheme(s.into(), other.into())),
        };
        if tls {
            return Err(UriError::TlsUnsupported(s.into()));
        }
        let path = u.path();
        let export = percent_encoding::percent_decode_str(path.strip_prefix('/').unwrap_or(path))
            .decode_utf8()
            .map_err(|_| UriError::BadExport(s.into()))?
            .into_owned();
        let transport = if unix {
            let socket = u.query_pairs().find(|(k, _)| k == "socket").map(|(_, v)| v.into_owned());
            match socket {
                Some(p) if !p.is_empty() => Transport::Unix { path: PathBuf::from(p) },
                _ => return Err(UriError::NoSocket(s.into())),
            }
        } else {
            let host = match u.host() {
                Some(url::Host::Ipv6(a)) => a.to_string(),
                Some(h) => h.to_string(),
                None => return Err(UriError::NoHost(s.into())),
            };
            Transport::Tcp { host, port: u.port().unwrap_or(NBD_PORT) }
        };
        Ok(Uri { transport, export, tls })
    }
}

impl std::fmt::Display for Uri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let export: String =
            percent_encoding::utf8_percent_encode(&self.export, percent_encoding::NON_ALPHANUMERIC).to_string();
        match &self.transport {
            Transport::Tcp { host, port } if host.contains(':') => write!(f, "nbd://[{host}]:{port}/{export}"),
            Transport::Tcp { host, port } => write!(f, "nbd://{host}:{port}/{export}"),
            Transport::Unix { path } => write!(f, "nbd+unix:///{export}?socket={}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_forms_from_the_spec() {
        let u = Uri::parse("nbd://example.com/disk").unwrap();
        assert_eq!(u.transport, Transport::Tcp { host: "example.com".into(), port: 10809 });
        assert_eq!(u.export, "disk");
        assert_eq!(Uri::parse("nbd://example.com").unwrap().export, "");
        assert_eq!(Uri::parse("nbd://example.com/").unwrap().export, "");
        assert_eq!(Uri::parse("nbd://example.com//disk").unwrap().export, "/disk");
        assert_eq!(Uri::parse("nbd://example.com/hello%20world").unwrap().export, "hello world");
        let u = Uri::parse("nbd://[::1]:1234/x").unwrap();
        assert_eq!(u.transport, Transport::Tcp { host: "::1".into(), port: 1234 });
        let u = Uri::parse("nbd+unix:///disk?socket=/tmp/s.sock").unwrap();
        assert_eq!(u.transport, Transport::Unix { path: "/tmp/s.sock".into() });
        assert_eq!(u.export, "disk");
        assert_eq!(Uri::parse("nbd+unix:///?socket=sock").unwrap().export, "");
    }

    #[test]
    fn unusable_uris_say_why() {
        assert!(matches!(Uri::parse("nbd+unix:///disk"), Err(UriError::NoSocket(_))));
        assert!(matches!(Uri::parse("http://x/"), Err(UriError::Scheme(..))));
        assert!(matches!(Uri::parse("nbds://x/"), Err(UriError::TlsUnsupported(_))));
        assert!(matches!(Uri::parse("not a uri"), Err(UriError::Syntax(..))));
        assert!(Uri::looks_like("nbd+unix:///?socket=x"));
        assert!(!Uri::looks_like("/tmp/file"));
    }

    #[test]
    fn display_round_trips() {
        for s in ["nbd://example.com:10809/disk", "nbd+unix:///a%20b?socket=/tmp/s"] {
            let u = Uri::parse(s).unwrap();
            assert_eq!(Uri::parse(&u.to_string()).unwrap(), u);
        }
    }
}
