//! `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP][?key=value&...]`, and qemu's `rbd:POOL/IMAGE[@SNAP][:key=value...]`.

use crate::RbdError;
use std::fmt;
use std::time::Duration;

/// A parsed RBD spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    pub pool: String,
    pub namespace: Option<String>,
    pub image: String,
    pub snap: Option<String>,
    /// Ceph configuration file; `None`: librados' search (`$CEPH_CONF`, `/etc/ceph/ceph.conf`, ...).
    pub conf: Option<String>,
    /// The Ceph user, without `client.` (default `admin`).
    pub user: String,
    pub keyring: Option<String>,
    /// Bound on connecting to the monitors.
    pub timeout: Duration,
    /// Other Ceph options, passed to librados as they are (`mon_host`, `rbd_cache`, ...).
    pub options: Vec<(String, String)>,
}

/// Whether a spec names an RBD image.
pub fn is_rbd(spec: &str) -> bool {
    spec.starts_with("rbd:")
}

impl Spec {
    pub fn parse(s: &str) -> Result<Spec, RbdError> {
        let bad = |why: &str| RbdError::BadSpec { spec: ferry_backend::redact_rbd(s), why: why.to_string() };
        let rest = s.strip_prefix("rbd:").ok_or_else(|| bad("it does not start with rbd:"))?;
        let rest = rest.strip_prefix("//").unwrap_or(rest);
        // Options: after '?' (URI style, percent-encoded) or after the first ':' (qemu style).
        let (path, opts): (&str, Vec<(String, String)>) = if let Some((p, q)) = rest.split_once('?') {
            let mut v = Vec::new();
            for kv in q.split('&').filter(|kv| !kv.is_empty()) {
                let (k, val) = kv.split_once('=').ok_or_else(|| bad("an option is not KEY=VALUE"))?;
                let dec = |x: &str| percent_encoding::percent_decode_str(x).decode_utf8_lossy().into_owned();
                v.push((dec(k), dec(val)));
            }
            (p, v)
        } else if let Some((p, q)) = rest.split_once(':') {
            let mut v = Vec::new();
            for kv in q.split(':').filter(|kv| !kv.is_empty()) {
                let (k, val) = kv.split_once('=').ok_or_else(|| bad("an option is not KEY=VALUE"))?;
                v.push((k.to_string(), val.to_string()));
            }
            (p, v)
        } else {
            (rest, Vec::new())
        };
        let (path, snap) = match path.split_once('@') {
            Some((p, "")) => return Err(bad(&format!("empty snapshot name after {p}@"))),
            Some((p, s)) => (p, Some(s.to_string())),
            None => (path, None),
        };
        let parts: Vec<&str> = path.split('/').collect();
        let (pool, namespace, image) = match parts.as_slice() {
            [pool, image] => (*pool, None, *image),
            [pool, ns, image] => (*pool, Some(ns.to_string()), *image),
            _ => return Err(bad("expected POOL/IMAGE or POOL/NAMESPACE/IMAGE")),
        };
        if pool.is_empty() || image.is_empty() {
            return Err(bad("empty pool or image name"));
        }
        let mut spec = Spec {
            pool: pool.to_string(),
            namespace,
            image: image.to_string(),
            snap,
            conf: None,
            user: "admin".to_string(),
            keyring: None,
            timeout: Duration::from_secs(10),
            options: Vec::new(),
        };
        for (k, v) in opts {
            match k.as_str() {
                "conf" => spec.conf = Some(v),
                "id" => spec.user = v.strip_prefix("client.").unwrap_or(&v).to_string(),
                "keyring" => spec.keyring = Some(v),
                "timeout" => {
                    let secs: f64 = v.parse().map_err(|_| bad("timeout is not a number of seconds"))?;
                    if !(secs > 0.0 && secs < 1e6) {
                        return Err(bad("timeout must be between 0 and 1000000 seconds"));
                    }
                    spec.timeout = Duration::from_secs_f64(secs);
                }
                _ => spec.options.push((k, v)),
            }
        }
        Ok(spec)
    }

    /// `POOL[/NAMESPACE]/IMAGE`, as the `rbd` tool takes it.
    pub fn path(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("{}/{}/{}", self.pool, ns, self.image),
            None => format!("{}/{}", self.pool, self.image),
        }
    }
}

/// `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]`, without options (they may name a keyring).
impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rbd:{}", self.path())?;
        if let Some(s) = &self.snap {
            write!(f, "@{s}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_style() {
        let s = Spec::parse(
            "rbd:rbd/disk@snap1?conf=/x/ceph.conf&id=client.bob&keyring=/k%20r&timeout=2.5&mon_host=1.2.3.4",
        )
        .unwrap();
        assert_eq!((s.pool.as_str(), s.image.as_str(), s.snap.as_deref()), ("rbd", "disk", Some("snap1")));
        assert_eq!(s.conf.as_deref(), Some("/x/ceph.conf"));
        assert_eq!(s.user, "bob");
        assert_eq!(s.keyring.as_deref(), Some("/k r"));
        assert_eq!(s.timeout, Duration::from_millis(2500));
        assert_eq!(s.options, vec![("mon_host".to_string(), "1.2.3.4".to_string())]);
        assert_eq!(s.to_string(), "rbd:rbd/disk@snap1");
    }

    #[test]
    fn qemu_style_and_namespace() {
        let s = Spec::parse("rbd:pool/ns/img:id=admin:conf=/etc/c.conf").unwrap();
        assert_eq!(s.namespace.as_deref(), Some("ns"));
        assert_eq!(s.path(), "pool/ns/img");
        assert_eq!(s.conf.as_deref(), Some("/etc/c.conf"));
        assert_eq!(s.snap, None);
        assert_eq!(s.user, "admin");
    }

    #[test]
    fn refused() {
        for bad in [
            "rbd:",
            "rbd:pool",
            "rbd:/img",
            "rbd:pool/",
            "rbd:a/b/c/d",
            "rbd:p/i@",
            "rbd:p/i?x",
            "rbd:p/i?timeout=0",
            "file:x",
        ] {
            assert!(Spec::parse(bad).is_err(), "{bad} accepted");
        }
        assert!(is_rbd("rbd:p/i") && !is_rbd("file:/rbd:p"));
    }
}
