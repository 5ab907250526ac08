//! One opener for what `serve`, `copy`, `hash` and `info` are given: `qcow2:PATH`,
//! `raw:PATH`, `file:PATH` (raw, with a warning when it holds a qcow2 image), a bare local
//! path (probed: the qcow2 magic means the qcow2 layer, anything else is raw), and the
//! backend specs (`memory:`, `null:`, `pattern:`), and Ceph RBD images (`rbd:`, in
//! `rbd_spec`).

use anyhow::{Context, Result};
use ferry_backend::{Access, Backend, FileBackend, FileId, ImageUse, OpenFile};
use ferry_client::copy::{BackendEndpoint, Endpoint};
use ferry_qcow2::{has_qcow2_magic, Qcow2};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What a spec names, before anything is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Spec {
    Qcow2(PathBuf),
    Raw(PathBuf),
    /// A backend spec for `ferry_backend::open` (`memory:1G`, `null:1T`, ...).
    Backend(String),
}

/// Disk image formats a destination can be made in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Raw,
    Qcow2,
}

/// Whether `p` is a regular file or a block device: something with an image in it that
/// can be probed and locked. A FIFO or character device is a stream: opening it to look
/// or to lock would take (and lose) what its writer sends, or wait for one.
pub fn is_image_file(p: &Path) -> bool {
    p.metadata().is_ok_and(|m| m.is_file() || m.file_type().is_block_device())
}

/// Classifies a spec: explicit kinds first, then bare paths by their first bytes.
pub fn classify(spec: &str) -> Spec {
    let probe = |p: &Path| {
        if is_image_file(p) && has_qcow2_magic(p) {
            Spec::Qcow2(p.to_path_buf())
        } else {
            Spec::Raw(p.to_path_buf())
        }
    };
    match spec.split_once(':') {
        Some(("qcow2", p)) => Spec::Qcow2(p.into()),
        Some(("raw", p)) => Spec::Raw(p.into()),
        Some(("file", p)) => {
            if has_qcow2_magic(Path::new(p)) {
                log::warn!(
                    "{p} holds a qcow2 image but file: treats it as raw (its guest would see the qcow2 container); \
                     use qcow2:{p} or the bare path to use the image, or raw:{p} to silence this warning"
                );
            }
            Spec::Raw(p.into())
        }
        Some((kind, _)) if !Path::new(spec).exists() && !kind.contains('/') => Spec::Backend(spec.to_string()),
        _ => probe(Path::new(spec)),
    }
}

/// Opens a qcow2 image locked for `usage`, with the path in every error.
pub fn open_qcow2(p: &Path, read_only: bool, usage: ImageUse) -> Result<Arc<Qcow2>> {
    open_qcow2_with(p, &ferry_qcow2::Options { read_only, ..Default::default() }, usage)
}

fn open_qcow2_with(p: &Path, opts: &ferry_qcow2::Options, usage: ImageUse) -> Result<Arc<Qcow2>> {
    Ok(Arc::new(Qcow2::open_for(p, opts, usage).with_context(|| format!("cannot open qcow2 image {}", p.display()))?))
}

/// How `ferry serve` opens an export.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServeOpen {
    pub read_only: bool,
    /// Read-only only: ignore others' locks, as qemu-nbd's --force-share does.
    pub force_share: bool,
    /// Write a qcow2 image even though clusters it uses lie past the end of its file.
    pub allow_truncated: bool,
}

/// Opens a spec as a backend (what `ferry serve` exports), with the local files it keeps
/// open. Files are locked as qemu-nbd locks them.
pub fn open_backend(spec: &str, how: ServeOpen) -> Result<(Arc<dyn Backend>, Vec<OpenFile>)> {
    let ServeOpen { read_only, force_share, allow_truncated } = how;
    if crate::rbd_spec::is_rbd(spec) {
        return Ok((crate::rbd_spec::open_backend(spec, read_only)?, Vec::new()));
    }
    let usage = ImageUse::serve(read_only).force_share(force_share);
    // Both open with `read_only`, so they declare it themselves.
    Ok(match classify(spec) {
        Spec::Qcow2(p) => {
            let q = open_qcow2_with(&p, &ferry_qcow2::Options { read_only, allow_truncated }, usage)?;
            let files = q.open_files().to_vec();
            (q, files)
        }
        Spec::Raw(p) => {
            let f = FileBackend::open_with(&p, read_only, usage.raw())
                .with_context(|| format!("cannot open {}", p.display()))?;
            let files = vec![f.open_file()?];
            (Arc::new(f), files)
        }
        Spec::Backend(s) => (ferry_backend::open(&s, read_only)?, Vec::new()),
    })
}

/// A copy or hash source, opened and locked for reading.
pub struct Source {
    pub endpoint: Endpoint,
    /// The local files read: the image, its external data file, its backing chain.
    pub files: Vec<OpenFile>,
    /// The locks of a raw file, which the copy engine reads through an opening of its own.
    _guard: Option<std::fs::File>,
}

/// A copy or hash source: NBD URIs, `-` and `null:` as the copy engine parses them, raw
/// files as files (sendfile, SEEK_HOLE), qcow2 images and backend specs as backends.
/// Local files are locked as qemu-img convert locks its source (writers are kept out
/// while they are read, and a file being written is refused) unless `force_share`.
pub fn source(spec: &str, force_share: bool) -> Result<Source> {
    let plain = |endpoint| Source { endpoint, files: Vec::new(), _guard: None };
    if let Some(e) = crate::rbd_spec::source(spec)? {
        return Ok(plain(e));
    }
    let e = Endpoint::parse(spec)?;
    if !matches!(e, Endpoint::File(_)) {
        return Ok(plain(e));
    }
    let usage = ImageUse::new(Access::Source).force_share(force_share);
    Ok(match classify(spec) {
        Spec::Qcow2(p) => {
            let q = open_qcow2(&p, true, usage)?;
            let files = q.open_files().to_vec();
            Source {
                endpoint: Endpoint::Backend(BackendEndpoint::new(p.display().to_string(), q)),
                files,
                _guard: None,
            }
        }
        Spec::Raw(p) if !is_image_file(&p) => plain(Endpoint::File(p)),
        Spec::Raw(p) => {
            let guard = ferry_backend::lock::lock_path(&p, usage.raw())
                .with_context(|| format!("cannot open {}", p.display()))?;
            let files = vec![OpenFile { id: FileId::of(&guard)?, path: p.clone(), writable: false }];
            Source { endpoint: Endpoint::File(p), files, _guard: Some(guard) }
        }
        Spec::Backend(s) => plain(Endpoint::Backend(BackendEndpoint::new(s.clone(), ferry_backend::open(&s, true)?))),
    })
}

/// The format a destination is written in: `--format`, else `qcow2:`/`raw:`, else the
/// extension (.qcow2, .qcow), else raw. Returns the path without the kind prefix.
pub fn destination_format(spec: &str, format: Option<Format>) -> (Format, String) {
    let (prefixed, path) = match spec.split_once(':') {
        Some(("qcow2", p)) => (Some(Format::Qcow2), p),
        Some(("raw", p)) | Some(("file", p)) => (Some(Format::Raw), p),
        _ => (None, spec),
    };
    let by_ext = match Path::new(path).extension().and_then(|e| e.to_str()) {
        Some("qcow2") | Some("qcow") => Format::Qcow2,
        _ => Format::Raw,
    };
    (format.or(prefixed).unwrap_or(by_ext), path.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_and_formats() {
        let dir = tempfile::tempdir().unwrap();
        let q = dir.path().join("a.img");
        std::fs::write(&q, b"QFI\xfb\0\0\0\x03").unwrap();
        let r = dir.path().join("b.img");
        std::fs::write(&r, b"raw bytes").unwrap();
        let qs = q.to_str().unwrap();
        let rs = r.to_str().unwrap();
        assert_eq!(classify(qs), Spec::Qcow2(q.clone()));
        assert_eq!(classify(rs), Spec::Raw(r.clone()));
        assert_eq!(classify(&format!("raw:{qs}")), Spec::Raw(q.clone()));
        assert_eq!(classify(&format!("file:{qs}")), Spec::Raw(q.clone()));
        assert_eq!(classify(&format!("qcow2:{rs}")), Spec::Qcow2(r.clone()));
        assert_eq!(classify("memory:1G"), Spec::Backend("memory:1G".into()));
        assert_eq!(destination_format("out.qcow2", None), (Format::Qcow2, "out.qcow2".into()));
        assert_eq!(destination_format("out.qcow2", Some(Format::Raw)), (Format::Raw, "out.qcow2".into()));
        assert_eq!(destination_format("out.img", Some(Format::Qcow2)), (Format::Qcow2, "out.img".into()));
        assert_eq!(destination_format("qcow2:out.img", None), (Format::Qcow2, "out.img".into()));
        assert_eq!(destination_format("out.img", None), (Format::Raw, "out.img".into()));
    }
}
