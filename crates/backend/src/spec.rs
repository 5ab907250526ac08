//! Export specs on the command line: `memory:1G`, `file:/path`, `null:10T`, `pattern:1M`.

use crate::*;
use std::path::Path;

/// A spec that cannot be opened, with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error(
        "export spec {0:?} has no kind; write KIND:ARG, e.g. memory:1G, file:/path/disk.img, null:1T or pattern:1G"
    )]
    NoKind(String),
    #[error("unknown export kind {0:?}; use memory, file, null or pattern")]
    UnknownKind(String),
    #[error("bad size {0:?}: {1}")]
    BadSize(String, &'static str),
    #[error("cannot open {path}: {source}")]
    Open { path: String, source: std::io::Error },
}

/// Parses a size such as `4096`, `512K`, `1G`, `1.5T` or `1GiB` (binary units).
pub fn parse_size(s: &str) -> std::result::Result<u64, SpecError> {
    let bad = |why| SpecError::BadSize(s.to_string(), why);
    let t = s.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (num, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                'P' => 50,
                'E' => 60,
                _ => return Err(bad("unknown unit; use K, M, G, T, P or E")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    if num.is_empty() {
        return Err(bad("missing number"));
    }
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_shl(shift).filter(|v| v >> shift == n).ok_or_else(|| bad("too large"));
    }
    let f: f64 = num.parse().map_err(|_| bad("not a number"))?;
    let v = f * (1u64 << shift) as f64;
    if !(0.0..9.2e18).contains(&v) {
        return Err(bad("out of range"));
    }
    Ok(v as u64)
}

/// An `rbd:` spec with the values of options that may be secret (`key`, and any whose
/// name holds `secret`, `password` or `token`) shown as `***`: librados takes a user's
/// key as `rbd:POOL/IMAGE?key=...` or qemu's `rbd:POOL/IMAGE:key=...`, and a spec is
/// printed in errors and kept in resume journals. Other specs come back unchanged.
pub fn redact_rbd(spec: &str) -> String {
    let Some(rest) = spec.strip_prefix("rbd:") else {
        return spec.to_string();
    };
    // As the RBD parser reads names: `?` options percent-decoded (`%6Bey` is `key`).
    let secret = |k: &str| {
        let k = percent_encoding::percent_decode_str(k).decode_utf8_lossy().to_ascii_lowercase();
        k == "key" || ["secret", "password", "token"].iter().any(|w| k.contains(w))
    };
    let hide = |opts: &str, sep: char| -> String {
        let shown: Vec<String> = opts
            .split(sep)
            .map(|kv| match kv.split_once('=') {
                Some((k, _)) if secret(k) => format!("{k}=***"),
                _ => kv.to_string(),
            })
            .collect();
        shown.join(&sep.to_string())
    };
    // qemu's `:`-separated options before any `?` (whatever the parser makes of them),
    // the URI form's `&`-separated ones after it.
    let (head, query) = match rest.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (rest, None),
    };
    let head = match head.split_once(':') {
        Some((path, opts)) => format!("{path}:{}", hide(opts, ':')),
        None => head.to_string(),
    };
    match query {
        Some(q) => format!("rbd:{head}?{}", hide(q, '&')),
        None => format!("rbd:{head}"),
    }
}

/// Opens the backend a spec names. With `read_only`, the backend is wrapped in the
/// [`ReadOnly`] filter (and files are opened read-only).
pub fn open(spec: &str, read_only: bool) -> std::result::Result<Arc<dyn Backend>, SpecError> {
    let (kind, arg) = spec.split_once(':').ok_or_else(|| SpecError::NoKind(spec.to_string()))?;
    let b: Arc<dyn Backend> = match kind {
        "memory" | "mem" => Arc::new(MemoryBackend::new(parse_size(arg)?)),
        "null" => Arc::new(NullBackend::new(parse_size(arg)?)),
        "pattern" => Arc::new(PatternBackend::new(parse_size(arg)?)),
        "file" => Arc::new(
            FileBackend::open(Path::new(arg), read_only)
                .map_err(|source| SpecError::Open { path: arg.to_string(), source })?,
        ),
        other => return Err(SpecError::UnknownKind(other.to_string())),
    };
    if read_only && !b.caps().read_only {
        return Ok(Arc::new(ReadOnly(b)));
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rbd_keys_are_not_shown() {
        assert_eq!(redact_rbd("rbd:p/i?key=AQBsecret&conf=/c"), "rbd:p/i?key=***&conf=/c");
        assert_eq!(redact_rbd("rbd:p/i@s:id=u:key=AQBsecret:mon_host=h"), "rbd:p/i@s:id=u:key=***:mon_host=h");
        assert_eq!(redact_rbd("rbd:p/i?client_secret=x"), "rbd:p/i?client_secret=***");
        assert_eq!(redact_rbd("rbd:p/i?%6Bey=AQBsecret"), "rbd:p/i?%6Bey=***");
        assert_eq!(redact_rbd("rbd:p/i:key=AQBsecret:conf=/x?y=1"), "rbd:p/i:key=***:conf=/x?y=1");
        for kept in ["rbd:p/i", "rbd:p/ns/i@snap", "/tmp/rbd:x", "memory:1G"] {
            assert_eq!(redact_rbd(kept), kept);
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1K").unwrap(), 1024);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("2t").unwrap(), 2 << 40);
        assert_eq!(parse_size("1.5M").unwrap(), 3 << 19);
        assert!(parse_size("abc").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("1X").is_err());
        assert!(parse_size("99999999E").is_err());
    }

    #[test]
    fn specs() {
        assert_eq!(open("memory:1T", false).unwrap().size(), 1 << 40);
        assert!(open("pattern:1M", false).unwrap().caps().read_only);
        assert!(open("null:1M", true).unwrap().caps().read_only);
        assert!(matches!(open("bogus:1", false), Err(SpecError::UnknownKind(_))));
        assert!(matches!(open("memory", false), Err(SpecError::NoKind(_))));
        assert!(matches!(open("file:/nonexistent/x", false), Err(SpecError::Open { .. })));
    }
}
