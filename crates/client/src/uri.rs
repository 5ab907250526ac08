//! NBD URIs, as the NBD project's `doc/uri.md` and libnbd define them:
//! `nbd://host[:port]/export` and `nbd+unix:///export?socket=PATH`, and their TLS forms
//! `nbds://[identity@]host[:port]/export` and `nbds+unix:///export?socket=PATH` with the
//! query parameters `tls-certificates=DIR`, `tls-psk-file=FILE`, `tls-hostname=NAME`
//! and `tls-verify-peer=false`.

use ferry_tls::ClientTlsConfig;
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
    /// `nbds` / `nbds+unix`: TLS is required, with these credentials.
    pub tls: Option<ClientTlsConfig>,
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
    #[error("{0:?}: {1} only applies to TLS; use nbds:// or nbds+unix://")]
    TlsParamWithoutTls(String, String),
    #[error("{0:?}: tls-verify-peer={1:?} is not a boolean (true/false)")]
    BadBool(String, String),
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
        let (parsed, unix_user) = split_unix_user(s);
        let u = url::Url::parse(&parsed).map_err(|e| UriError::Syntax(s.into(), e.to_string()))?;
        let (unix, tls) = match u.scheme() {
            "nbd" | "nbd+tcp" => (false, false),
            "nbds" | "nbds+tcp" => (false, true),
            "nbd+unix" => (true, false),
            "nbds+unix" => (true, true),
            other => return Err(UriError::Scheme(s.into(), other.into())),
        };
        let param = |name: &str| u.query_pairs().find(|(k, _)| k == name).map(|(_, v)| v.into_owned());
        let tls_params = ["tls-certificates", "tls-psk-file", "tls-hostname", "tls-verify-peer"];
        if !tls {
            if let Some(p) = tls_params.iter().find(|p| param(p).is_some()) {
                return Err(UriError::TlsParamWithoutTls(s.into(), (*p).into()));
            }
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
        let tls = if tls {
            let verify_peer = match param("tls-verify-peer").as_deref() {
                None | Some("true" | "1" | "yes" | "on") => true,
                Some("false" | "0" | "no" | "off") => false,
                Some(other) => return Err(UriError::BadBool(s.into(), other.into())),
            };
            let user = unix_user.unwrap_or_else(|| u.username().to_string());
            let user = percent_encoding::percent_decode_str(&user).decode_utf8_lossy().into_owned();
            let hostname = param("tls-hostname").or(match &transport {
                Transport::Tcp { host, .. } => Some(host.clone()),
                Transport::Unix { .. } => None,
            });
            Some(ClientTlsConfig {
                certificates: param("tls-certificates").map(PathBuf::from),
                psk_file: param("tls-psk-file").map(PathBuf::from),
                psk_identity: (!user.is_empty()).then_some(user),
                hostname,
                verify_peer,
            })
        } else {
            None
        };
        Ok(Uri { transport, export, tls })
    }
}

/// `nbds+unix://alice@/?socket=...` names a PSK identity without a host, which libnbd
/// accepts and the `url` crate refuses ("empty host"): take the user out before parsing.
fn split_unix_user(s: &str) -> (String, Option<String>) {
    if let Some((scheme, rest)) = s.split_once("://") {
        if scheme.ends_with("+unix") {
            let end = rest.find(['/', '?']).unwrap_or(rest.len());
            if let Some(user) = rest[..end].strip_suffix('@') {
                return (format!("{scheme}://{}", &rest[end..]), Some(user.to_string()));
            }
        }
    }
    (s.to_string(), None)
}

impl std::fmt::Display for Uri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let export: String =
            percent_encoding::utf8_percent_encode(&self.export, percent_encoding::NON_ALPHANUMERIC).to_string();
        let s = if self.tls.is_some() { "s" } else { "" };
        match &self.transport {
            Transport::Tcp { host, port } if host.contains(':') => write!(f, "nbd{s}://[{host}]:{port}/{export}"),
            Transport::Tcp { host, port } => write!(f, "nbd{s}://{host}:{port}/{export}"),
            Transport::Unix { path } => write!(f, "nbd{s}+unix:///{export}?socket={}", path.display()),
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
        assert!(matches!(Uri::parse("nbd://x/?tls-psk-file=k"), Err(UriError::TlsParamWithoutTls(..))));
        assert!(matches!(Uri::parse("nbds://x/?tls-verify-peer=maybe"), Err(UriError::BadBool(..))));
        assert!(matches!(Uri::parse("not a uri"), Err(UriError::Syntax(..))));
        assert!(Uri::looks_like("nbd+unix:///?socket=x"));
        assert!(!Uri::looks_like("/tmp/file"));
    }

    #[test]
    fn tls_uris_carry_credentials() {
        let u = Uri::parse("nbds://alice@example.com/disk?tls-psk-file=/k.psk").unwrap();
        let t = u.tls.unwrap();
        assert_eq!(t.psk_identity.as_deref(), Some("alice"));
        assert_eq!(t.psk_file, Some(PathBuf::from("/k.psk")));
        assert_eq!(t.hostname.as_deref(), Some("example.com"));
        assert!(t.verify_peer);
        let u = Uri::parse("nbds+unix:///d?socket=/s&tls-certificates=/pki&tls-verify-peer=false").unwrap();
        let t = u.tls.unwrap();
        assert_eq!(t.certificates, Some(PathBuf::from("/pki")));
        assert_eq!(t.hostname, None);
        assert!(!t.verify_peer);
        let u = Uri::parse("nbds+unix://bob@/d?socket=/s").unwrap();
        assert_eq!(u.export, "d");
        assert_eq!(u.tls.unwrap().psk_identity.as_deref(), Some("bob"));
        let u = Uri::parse("nbds+unix:///d?socket=/s&tls-hostname=srv").unwrap();
        assert_eq!(u.tls.unwrap().hostname.as_deref(), Some("srv"));
        assert!(Uri::parse("nbd://x/").unwrap().tls.is_none());
    }

    #[test]
    fn display_round_trips() {
        for s in ["nbd://example.com:10809/disk", "nbd+unix:///a%20b?socket=/tmp/s"] {
            let u = Uri::parse(s).unwrap();
            assert_eq!(Uri::parse(&u.to_string()).unwrap(), u);
        }
    }
}
