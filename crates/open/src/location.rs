//! What a spec on the command line names, parsed once, before anything is opened.
//!
//! A spec is one of: `-` (stdin or stdout), `null:` (a destination that discards), an NBD
//! URI, a backend spec (`memory:1G`, `null:1T`, `pattern:1G`), or an image: a format
//! (`qcow2:`, `raw:`, or none, meaning "probe it") on a store (a local path, `rbd:POOL/IMAGE`,
//! an `http://` or `https://` URL, `s3://BUCKET/KEY`). So `qcow2:rbd:pool/img` and
//! `qcow2:https://host/disk.qcow2` are qcow2 images on those stores, as qemu stacks its
//! qcow2 driver on file, rbd or curl.

use ferry_client::Uri;
use std::fmt;
use std::path::{Path, PathBuf};

/// Disk image formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Raw,
    Qcow2,
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
        })
    }
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Format, String> {
        match s.to_ascii_lowercase().as_str() {
            "raw" => Ok(Format::Raw),
            "qcow2" => Ok(Format::Qcow2),
            _ => Err(format!("{s:?} is not a format ferry writes: use raw or qcow2")),
        }
    }
}

/// Where an image's bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Store {
    /// A local file or block device (or a FIFO or character device, read or written as a stream).
    File(PathBuf),
    /// A Ceph RBD image: the whole `rbd:POOL/IMAGE[@SNAP][?...]` spec.
    Rbd(String),
    /// An `http://` or `https://` URL (credentials may be in it: never print it whole).
    Http(String),
    /// An `s3://BUCKET/KEY` object.
    S3(String),
}

impl Store {
    /// Whether the store is somewhere else on the network (read through a client that
    /// retries, in many requests in flight).
    pub fn is_remote(&self) -> bool {
        matches!(self, Store::Rbd(_) | Store::Http(_) | Store::S3(_))
    }
}

/// A parsed spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// `-`: stdin as a source, stdout as a destination.
    Stdio,
    /// `null:`: a destination that discards.
    Null,
    Nbd(Uri),
    /// A backend spec for [`ferry_backend::open`] (`memory:1G`, `null:1T`, `pattern:1G`).
    Spec(String),
    /// An image on a store. `format: None` is probed when opened (a local file or remote
    /// object starting with the qcow2 magic is qcow2; an RBD image is raw unless named
    /// `qcow2:`). `file_prefix`: it was written `file:PATH` (raw, with a warning when it
    /// holds a qcow2 image).
    Image {
        store: Store,
        format: Option<Format>,
        file_prefix: bool,
    },
    /// `REPO::NAME[@ID]`: a snapshot of the disk NAME in the backup repository REPO (a
    /// directory or `s3://BUCKET/PREFIX`): the latest one, or the one whose id starts
    /// with ID (at least 4 hex digits, lower-cased here).
    Repo {
        repo: String,
        name: String,
        id: Option<String>,
    },
}

/// A spec that names nothing ferry can open, with what to write instead.
#[derive(Debug)]
pub struct ParseError(pub String);

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ParseError {}

impl Location {
    /// Parses a spec. Only NBD URIs, `s3://` and the format prefixes are checked here;
    /// what a path or URL holds is learnt when it is opened.
    pub fn parse(spec: &str) -> Result<Location, ParseError> {
        if spec.is_empty() {
            return Err(ParseError("an empty spec names nothing: give a path, a URI or - for stdin/stdout".into()));
        }
        if spec == "-" {
            return Ok(Location::Stdio);
        }
        if spec == "null:" {
            return Ok(Location::Null);
        }
        if Uri::looks_like(spec) {
            return Uri::parse(spec).map(Location::Nbd).map_err(|e| ParseError(e.to_string()));
        }
        if let Some(repo) = repo_spec(spec)? {
            return Ok(repo);
        }
        let (format, rest, file_prefix) = match spec.split_once(':') {
            Some(("qcow2", r)) => (Some(Format::Qcow2), r, false),
            Some(("raw", r)) => (Some(Format::Raw), r, false),
            Some(("file", r)) => (Some(Format::Raw), r, true),
            _ => (None, spec, false),
        };
        if format.is_some() {
            if rest.is_empty() {
                return Err(ParseError(format!("{spec:?} names no image: write {spec}PATH or {spec}URL")));
            }
            if file_prefix {
                return Ok(Location::Image { store: Store::File(rest.into()), format, file_prefix });
            }
            if rest == "-"
                || rest == "null:"
                || Uri::looks_like(rest)
                || rest.starts_with("qcow2:")
                || rest.starts_with("raw:")
            {
                return Err(ParseError(format!(
                    "{spec:?}: a format prefix goes on a file, rbd:, http(s):// or s3:// image, not on {rest:?}"
                )));
            }
        }
        let store = store(rest)?;
        match (store, format) {
            (Some(store), _) => Ok(Location::Image { store, format, file_prefix }),
            (None, None) => Ok(Location::Spec(spec.to_string())),
            (None, Some(f)) => {
                Err(ParseError(format!("{spec:?}: {f}: goes on an image, not on the backend spec {rest:?}")))
            }
        }
    }

    /// A snapshot spec as written back in messages: `REPO::NAME[@ID]`.
    pub fn repo_spec(repo: &str, name: &str, id: Option<&str>) -> String {
        match id {
            Some(id) => format!("{repo}::{name}@{id}"),
            None => format!("{repo}::{name}"),
        }
    }

    /// The local path of a file image, if it is one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Location::Image { store: Store::File(p), .. } => Some(p),
            _ => None,
        }
    }
}

/// `REPO::NAME[@ID]`, split at the last `::`, or `None` when `spec` is not one. An
/// http(s):// URL is never one (an IPv6 host holds `::`), nor is a spec whose tail is not
/// made of a disk name's characters (`/a::b/c` is a path).
fn repo_spec(spec: &str) -> Result<Option<Location>, ParseError> {
    let lower = spec.get(..8).unwrap_or(spec).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Ok(None);
    }
    let Some((repo, tail)) = spec.rsplit_once("::") else { return Ok(None) };
    let tail_chars = |c: char| c.is_ascii_alphanumeric() || "._-@".contains(c);
    if !tail.chars().all(tail_chars) {
        return Ok(None);
    }
    let (name, id) = match tail.split_once('@') {
        Some((n, i)) => (n, Some(i)),
        None => (tail, None),
    };
    if repo.is_empty() {
        return Err(ParseError(format!(
            "{spec:?} names no repository: write REPO::{tail} (a directory or s3://BUCKET/PREFIX)"
        )));
    }
    if repo.starts_with("qcow2:") || repo.starts_with("raw:") || repo.starts_with("file:") {
        return Err(ParseError(format!(
            "{spec:?}: a snapshot in a backup repository has no format prefix: write REPO::NAME[@ID]"
        )));
    }
    if !ferry_repo::format::valid_name(name) {
        return Err(ParseError(format!(
            "{spec:?}: {name:?} is not a disk name: 1 to 200 of A-Z a-z 0-9 . _ -, not starting with . or -"
        )));
    }
    let id = match id {
        None => None,
        Some(i) if (4..=64).contains(&i.len()) && i.bytes().all(|b| b.is_ascii_hexdigit()) => {
            Some(i.to_ascii_lowercase())
        }
        Some(i) => {
            return Err(ParseError(format!(
            "{spec:?}: {i:?} is not a snapshot id: give at least 4 of its hex digits, as `ferry repo list` prints it"
        )))
        }
    };
    Ok(Some(Location::Repo { repo: repo.to_string(), name: name.to_string(), id }))
}

/// The store `s` names, or `None` for a backend spec (`KIND:ARG` that is not a path
/// that exists).
fn store(s: &str) -> Result<Option<Store>, ParseError> {
    let lower = s.get(..8).unwrap_or(s).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Ok(Some(Store::Http(s.to_string())));
    }
    if lower.starts_with("s3://") {
        // Checked whole here (a key with a `.` or `..` segment is refused before anything
        // is opened or created), and kept as written: `?` and `#` are part of the key.
        return match ferry_s3::S3Url::parse(s) {
            Ok(_) => Ok(Some(Store::S3(s.to_string()))),
            Err(e) => Err(ParseError(e.to_string())),
        };
    }
    if s.starts_with("rbd:") {
        return Ok(Some(Store::Rbd(s.to_string())));
    }
    match s.split_once(':') {
        Some((kind, _)) if !kind.is_empty() && !kind.contains('/') && !Path::new(s).exists() => Ok(None),
        _ => Ok(Some(Store::File(s.into()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(store: Store, format: Option<Format>) -> Location {
        Location::Image { store, format, file_prefix: false }
    }

    #[test]
    fn snapshots() {
        let r = |repo: &str, name: &str, id: Option<&str>| Location::Repo {
            repo: repo.into(),
            name: name.into(),
            id: id.map(String::from),
        };
        let p = Location::parse;
        assert_eq!(p("/backups::vm1-sda").unwrap(), r("/backups", "vm1-sda", None));
        assert_eq!(p("rel/dir::d.0@AbCd12").unwrap(), r("rel/dir", "d.0", Some("abcd12")));
        assert_eq!(p("s3://bkt/pre::disk").unwrap(), r("s3://bkt/pre", "disk", None));
        // Split at the last `::`.
        assert_eq!(p("/a::b::disk").unwrap(), r("/a::b", "disk", None));
        // NBD URIs and http(s) URLs first (an IPv6 host has `::`), paths whose tail is no name.
        assert!(matches!(p("nbd://[::1]/x").unwrap(), Location::Nbd(_)));
        assert!(matches!(p("http://[::1]:8080/disk").unwrap(), Location::Image { store: Store::Http(_), .. }));
        assert!(matches!(p("/a::b/c").unwrap(), Location::Image { store: Store::File(_), .. }));
        for bad in ["::disk", "/r::.hidden", "/r::-x", "/r::", "/r::d@12", "/r::d@xyz1", "qcow2:/r::d"] {
            assert!(p(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn kinds() {
        let p = Location::parse;
        assert_eq!(p("-").unwrap(), Location::Stdio);
        assert_eq!(p("null:").unwrap(), Location::Null);
        assert!(matches!(p("nbd://localhost/x").unwrap(), Location::Nbd(_)));
        assert!(p("nbd://[bad").is_err());
        assert_eq!(p("memory:1G").unwrap(), Location::Spec("memory:1G".into()));
        assert_eq!(p("null:1T").unwrap(), Location::Spec("null:1T".into()));
        assert_eq!(p("disk.img").unwrap(), image(Store::File("disk.img".into()), None));
        assert_eq!(p("/a/b:c").unwrap(), image(Store::File("/a/b:c".into()), None));
        assert_eq!(p("qcow2:disk.img").unwrap(), image(Store::File("disk.img".into()), Some(Format::Qcow2)));
        assert_eq!(p("raw:x.qcow2").unwrap(), image(Store::File("x.qcow2".into()), Some(Format::Raw)));
        assert_eq!(
            p("file:x").unwrap(),
            Location::Image { store: Store::File("x".into()), format: Some(Format::Raw), file_prefix: true }
        );
        assert_eq!(p("rbd:pool/img").unwrap(), image(Store::Rbd("rbd:pool/img".into()), None));
        assert_eq!(p("qcow2:rbd:pool/img@s").unwrap(), image(Store::Rbd("rbd:pool/img@s".into()), Some(Format::Qcow2)));
        assert_eq!(p("https://h/d.qcow2").unwrap(), image(Store::Http("https://h/d.qcow2".into()), None));
        assert_eq!(p("HTTP://h/d").unwrap(), image(Store::Http("HTTP://h/d".into()), None));
        assert_eq!(p("qcow2:http://h/d").unwrap(), image(Store::Http("http://h/d".into()), Some(Format::Qcow2)));
        assert_eq!(p("s3://b/k/x").unwrap(), image(Store::S3("s3://b/k/x".into()), None));
        assert!(p("s3://b").is_err());
        assert!(p("s3:///k").is_err());
        assert_eq!(p("s3://b/q?x=1#f").unwrap(), image(Store::S3("s3://b/q?x=1#f".into()), None));
        for dots in ["s3://a/../b/k", "raw:s3://b/d/./s/../k", "s3://b/..", "s3://b/%2e%2e/k"] {
            let e = p(dots).unwrap_err().to_string();
            assert!(e.contains("segment"), "{dots}: {e}");
        }
        assert!(p("").is_err());
        assert!(p("qcow2:").is_err());
        assert!(p("qcow2:-").is_err());
        assert!(p("raw:nbd://h/x").is_err());
        assert!(p("qcow2:memory:1G").is_err());
    }

    #[test]
    fn no_panics_on_odd_input() {
        for s in ["é:", ":", "::", "s3:/", "\u{1F600}http://", "https:", "qcow2:qcow2:x", "rbd:", "file:"] {
            let _ = Location::parse(s);
        }
    }
}
