//! One opener for every spec ferry takes, below the binary: `serve`, `copy`, `hash` and
//! `info` parse a spec once into a [`Location`] and open it here.
//!
//! A location is a format on a store, as qemu's block layer puts qcow2 on file, rbd or
//! curl. Each store is one module: local files (here), Ceph RBD (`rbd.rs`), HTTP(S)
//! (`ferry-http`) and S3 (`s3.rs`, on `ferry-s3`). A format sits on
//! any store: raw is the store itself, qcow2 is `ferry_qcow2::Qcow2` opened on a local
//! file (read-write, with its backing chain and locks) or on any other store as a
//! [`Backend`] (read-only). NBD URIs, streams and `null:` go to the copy engine's own
//! endpoints.
//!
//! # Opening
//!
//! `crates/open` (`ferry-open`) is the one opener for `serve`, `copy`, `hash` and `info`.
//! `Location::parse` turns a spec into a format (`qcow2:`, `raw:`, `file:`, or none: probed)
//! on a store (a local path, `rbd:`, `http(s)://`, `s3://`), or an NBD URI, `-`, `null:` or a
//! backend spec; a new store is one module and one arm of `open_store`. A qcow2 image on a
//! local file is opened read-write with its backing chain and locks; on any other store it
//! is `Qcow2::open_on(store backend)`, read-only (writing would need a store that grows).
//! The server and the copy engine do not know the format: they see a `Backend`
//! whose `caps()` say what it can do (multi-conn: one shared object, so a FLUSH on any
//! connection covers every connection's writes).
//!
//! See also the untrusted-image rules in `ferry-qcow2`'s docs ("Safety"): a writable local file whose raw format was guessed is wrapped in `ferry_backend::GuessedRaw`, and `destination` refuses to update in place a file only its bytes call qcow2.
//!
//! # What this crate owns
//!
//! `Location::parse` (one parse of a spec: a format on a store, an NBD URI, a stream,
//! `null:`, a backend spec) and the opener every command calls: `open_backend` (serve,
//! info), `source` (copy, hash; local files locked as qemu-img locks them), `destination`
//! (copy: new files, qcow2 images and overlays, RBD images created with the source's size,
//! S3 uploads finished or aborted), `open_on_store` (a format on a store other than a local
//! file); `repo` (a backup repository's store, directory or S3, opened and unlocked with
//! its passphrase; `REPO::NAME[@ID]` as a read-only `SnapshotImage`, refused as a copy
//! destination); `partitions` (a disk's MBR or GPT, parsed with no I/O, for `ferry mount`)
//!
//! `unsafe`: forbidden.

pub mod location;
pub mod partitions;
mod rbd;
pub mod repo;
mod s3;

pub use location::{Format, Location, ParseError, Store};
pub use s3::abort_upload;

use anyhow::{bail, Context, Result};
use ferry_backend::{Access, Backend, FileBackend, FileId, ImageUse, OpenFile};
use ferry_client::copy::{BackendEndpoint, Endpoint};
use ferry_client::ConnectOptions;
use ferry_qcow2::{has_qcow2_magic, Qcow2, MAGIC};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `spec` as messages and digest lines may show it: an http(s):// or s3:// URL (after an
/// optional `raw:` or `qcow2:`) without its userinfo, query string and fragment, where a
/// password or a presigned signature would be; anything else (paths, NBD URIs) unchanged.
pub fn shown(spec: &str) -> String {
    let (prefix, rest) = match spec.split_once(':') {
        Some((p @ ("raw" | "qcow2"), r)) => (&spec[..p.len() + 1], r),
        _ => ("", spec),
    };
    let scheme = rest.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    match scheme.as_deref() {
        Some("http" | "https" | "s3") => format!("{prefix}{}", ferry_http::redact(rest)),
        _ if rest.starts_with("rbd:") => format!("{prefix}{}", ferry_backend::redact_rbd(rest)),
        _ => spec.to_string(),
    }
}

/// Whether `p` is a regular file or a block device: something with an image in it that
/// can be probed and locked. A FIFO or character device is a stream: opening it to look
/// or to lock would take (and lose) what its writer sends, or wait for one.
pub fn is_image_file(p: &Path) -> bool {
    p.metadata().is_ok_and(|m| m.is_file() || m.file_type().is_block_device())
}

/// The format of a local file: the one asked for, else qcow2 when it starts with the
/// qcow2 magic, else raw. `file:` warns when it is about to hide a qcow2 image.
fn local_format(p: &Path, format: Option<Format>, file_prefix: bool) -> Format {
    if file_prefix && has_qcow2_magic(p) {
        log::warn!(
            "{0} holds a qcow2 image but file: treats it as raw (its guest would see the qcow2 container); \
             use qcow2:{0} to use the image, or raw:{0} to silence this warning",
            p.display()
        );
    }
    format.unwrap_or_else(|| if is_image_file(p) && has_qcow2_magic(p) { Format::Qcow2 } else { Format::Raw })
}

/// Whether a local file is qcow2 by its bytes alone: no format named (`qcow2:`,
/// `--format`), not `file:`, and no `.qcow2`/`.qcow` name. Such an image may not name
/// other files ([`ferry_qcow2::Options::guessed`]).
fn guessed(p: &Path, format: Option<Format>, file_prefix: bool) -> bool {
    let named = p.extension().is_some_and(|e| e.eq_ignore_ascii_case("qcow2") || e.eq_ignore_ascii_case("qcow"));
    format.is_none() && !file_prefix && !named
}

/// The format of a local file image (probed, as every opener here probes it); `None`
/// for other locations.
pub fn local_format_of(loc: &Location) -> Option<Format> {
    match loc {
        Location::Image { store: Store::File(p), format, file_prefix } => Some(local_format(p, *format, *file_prefix)),
        _ => None,
    }
}

/// The format of an image on a store other than a local file: the one asked for, else
/// qcow2 when its first bytes are the qcow2 magic (HTTP and S3), else raw. An RBD image
/// is raw unless named `qcow2:`, as it always was: a guest can write any bytes at the
/// start of a raw image, and a spec that meant raw must not turn into another format.
fn store_format(store: &Store, backend: &dyn Backend, format: Option<Format>) -> Result<Format> {
    if let Some(f) = format {
        return Ok(f);
    }
    if matches!(store, Store::Rbd(_)) || backend.size() < MAGIC.len() as u64 {
        return Ok(Format::Raw);
    }
    let mut head = [0u8; 4];
    backend.read(&mut head, 0).with_context(|| format!("cannot read the start of {}", backend.describe()))?;
    Ok(if ferry_qcow2::is_qcow2(&head) { Format::Qcow2 } else { Format::Raw })
}

/// Opens a qcow2 image locked for `usage`, with the path in every error.
pub fn open_qcow2(p: &Path, read_only: bool, usage: ImageUse) -> Result<Arc<Qcow2>> {
    open_qcow2_with(p, &ferry_qcow2::Options { read_only, ..Default::default() }, usage)
}

/// A local qcow2 image as `loc` names it (`ferry info`), read-only: refused as
/// [`ferry_qcow2::Options::guessed`] says when its format was only probed.
pub fn open_local_qcow2_image(loc: &Location, usage: ImageUse) -> Result<Arc<Qcow2>> {
    match loc {
        Location::Image { store: Store::File(p), format, file_prefix } => {
            let opts = ferry_qcow2::Options { read_only: true, ..Default::default() };
            open_local_qcow2(p, *format, *file_prefix, opts, usage)
        }
        _ => bail!("open_local_qcow2_image is for local files"),
    }
}

/// A local qcow2 image as `loc` names it, opened for writing with the locks qemu's
/// writers take (an image another program uses is refused), for a backup that reads it and
/// keeps its change-tracking bitmap (`ferry backup`). `None` when `loc` is not a local
/// qcow2 image.
pub fn open_local_qcow2_for_backup(loc: &Location) -> Result<Option<Arc<Qcow2>>> {
    match loc {
        Location::Image { store: Store::File(p), format, file_prefix }
            if local_format(p, *format, *file_prefix) == Format::Qcow2 =>
        {
            let opts = ferry_qcow2::Options { read_only: false, ..Default::default() };
            open_local_qcow2(p, *format, *file_prefix, opts, ImageUse::new(Access::Write)).map(Some)
        }
        _ => Ok(None),
    }
}

/// A local qcow2 image named as `format` (`None`: its format was probed).
fn open_local_qcow2(
    p: &Path,
    format: Option<Format>,
    file_prefix: bool,
    opts: ferry_qcow2::Options,
    usage: ImageUse,
) -> Result<Arc<Qcow2>> {
    open_qcow2_with(p, &ferry_qcow2::Options { guessed: guessed(p, format, file_prefix), ..opts }, usage)
}

fn open_qcow2_with(p: &Path, opts: &ferry_qcow2::Options, usage: ImageUse) -> Result<Arc<Qcow2>> {
    Ok(Arc::new(Qcow2::open_for(p, opts, usage).with_context(|| format!("cannot open qcow2 image {}", p.display()))?))
}

/// How to reach images on network stores: HTTP trust, headers and retries (S3 takes its
/// credentials, region and endpoint from the environment, as the AWS tools do).
#[derive(Debug, Clone, Default)]
pub struct Remote {
    pub http: ferry_http::HttpOptions,
}

/// A store other than a local file, opened raw: what a format sits on. HTTP and S3
/// objects are read-only.
fn open_store(store: &Store, read_only: bool, remote: &Remote) -> Result<Arc<dyn Backend>> {
    match store {
        Store::File(p) => bail!("{} is a local file: it is opened with its locks", p.display()),
        Store::Rbd(spec) => rbd::open(spec, read_only),
        Store::Http(_) | Store::S3(_) if !read_only => bail!(
            "{} is read-only over HTTP: serve it with --read-only (an S3 object can be a copy destination)",
            ferry_http::redact(store_name(store))
        ),
        Store::Http(url) => Ok(Arc::new(ferry_http::HttpBackend::open(url, &remote.http)?)),
        Store::S3(url) => s3::open(url, &remote.http),
    }
}

fn store_name(store: &Store) -> &str {
    match store {
        Store::Rbd(s) | Store::Http(s) | Store::S3(s) => s,
        Store::File(p) => p.to_str().unwrap_or("a local file"),
    }
}

/// An image opened on a store other than a local file.
pub enum StoreImage {
    Raw(Arc<dyn Backend>),
    Qcow2(Arc<Qcow2>),
}

impl StoreImage {
    pub fn backend(self) -> Arc<dyn Backend> {
        match self {
            StoreImage::Raw(b) => b,
            StoreImage::Qcow2(q) => q,
        }
    }
}

/// A format on a store other than a local file. qcow2 there is read-only: writing needs
/// an image that can grow, with its clusters allocated from its refcounts.
pub fn open_on_store(store: &Store, format: Option<Format>, read_only: bool, remote: &Remote) -> Result<StoreImage> {
    if matches!(store, Store::File(_)) {
        bail!("open_on_store is for stores other than local files");
    }
    let raw = open_store(store, read_only || format == Some(Format::Qcow2), remote)?;
    match store_format(store, raw.as_ref(), format)? {
        Format::Raw => Ok(StoreImage::Raw(raw)),
        Format::Qcow2 if !read_only => bail!(
            "a qcow2 image on {} is opened read-only: serve it with --read-only, or copy it to a local file \
             to write it",
            raw.describe()
        ),
        Format::Qcow2 => {
            let name = raw.describe();
            let q = Qcow2::open_on(raw).map_err(|e| match e {
                // It names the image already.
                e @ ferry_qcow2::Qcow2Error::Refused(_) => anyhow::Error::new(e),
                e => anyhow::Error::new(e).context(format!("cannot open the qcow2 image on {name}")),
            })?;
            Ok(StoreImage::Qcow2(Arc::new(q)))
        }
    }
}

fn format_on_store(
    store: &Store,
    format: Option<Format>,
    read_only: bool,
    remote: &Remote,
) -> Result<Arc<dyn Backend>> {
    open_on_store(store, format, read_only, remote).map(StoreImage::backend)
}

/// A writable local file whose raw format was guessed (no `raw:`, `file:` or `qcow2:`),
/// guarded so that its writers cannot turn it into a qcow2 image (see
/// [`ferry_backend::GuessedRaw`]), with a warning: probing an image a guest writes is
/// dangerous, as qemu warns.
fn guard_guessed_raw(p: &Path, b: Arc<dyn Backend>) -> Arc<dyn Backend> {
    log::warn!(
        "{0}: its format was guessed (raw, as it holds no qcow2 header) and it is written: writes that would \
         make its first sector look like a qcow2 image are refused, or the next opening of {0} would read it \
         as one (a guest could name any local file as its backing file). Name it raw:{0} to serve it as \
         raw without this guard",
        p.display()
    );
    let probe = |first: &[u8]| ferry_qcow2::is_qcow2(first).then_some("qcow2");
    Arc::new(ferry_backend::GuessedRaw::new(b, p.display().to_string(), probe, MAGIC.len() as u64))
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

/// Opens a location as a backend (what `ferry serve` exports, what `ferry info` maps),
/// with the local files it keeps open. Files are locked as qemu-nbd locks them.
pub fn open_backend(loc: &Location, how: ServeOpen, remote: &Remote) -> Result<(Arc<dyn Backend>, Vec<OpenFile>)> {
    let ServeOpen { read_only, force_share, allow_truncated } = how;
    let usage = ImageUse::serve(read_only).force_share(force_share);
    Ok(match loc {
        Location::Image { store: Store::File(p), format, file_prefix } => {
            match local_format(p, *format, *file_prefix) {
                // Both open with `read_only`, so they declare it themselves.
                Format::Qcow2 => {
                    let opts = ferry_qcow2::Options { read_only, allow_truncated, ..Default::default() };
                    let q = open_local_qcow2(p, *format, *file_prefix, opts, usage)?;
                    let files = q.open_files().to_vec();
                    (q, files)
                }
                Format::Raw => {
                    let f = FileBackend::open_with(p, read_only, usage.raw())
                        .with_context(|| format!("cannot open {}", p.display()))?;
                    let files = vec![f.open_file()?];
                    let b: Arc<dyn Backend> = Arc::new(f);
                    match format {
                        None if !read_only => (guard_guessed_raw(p, b), files),
                        _ => (b, files),
                    }
                }
            }
        }
        Location::Image { store, format, .. } => (format_on_store(store, *format, read_only, remote)?, Vec::new()),
        Location::Spec(s) => (ferry_backend::open(s, read_only)?, Vec::new()),
        Location::Repo { repo, name, id } if !read_only => bail!(
            "{} is a snapshot in a backup repository, which is read-only: serve it with --read-only (-r)",
            Location::repo_spec(repo, name, id.as_deref())
        ),
        Location::Repo { repo, name, id } => (repo::open_snapshot(repo, name, id.as_deref(), remote)?, Vec::new()),
        Location::Nbd(u) => bail!("{u} is an NBD export: it cannot be opened as a local image (copy from it instead)"),
        Location::Null => bail!("null: needs a size to be an image: null:SIZE, e.g. null:1T"),
        Location::Stdio => bail!("- (stdin or stdout) is a stream: it cannot be opened as an image"),
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

impl Source {
    /// An endpoint opened by the caller, with no local files or locks.
    pub fn plain(endpoint: Endpoint) -> Source {
        Source { endpoint, files: Vec::new(), _guard: None }
    }
}

/// A copy or hash source: NBD URIs and `-` as the copy engine's endpoints, raw files as
/// files (sendfile, SEEK_HOLE), qcow2 images, stores and backend specs as backends.
/// Local files are locked as qemu-img convert locks its source (writers are kept out
/// while they are read, and a file being written is refused) unless `force_share`.
pub fn source(loc: &Location, force_share: bool, remote: &Remote) -> Result<Source> {
    let plain = |endpoint| Source { endpoint, files: Vec::new(), _guard: None };
    let usage = ImageUse::new(Access::Source).force_share(force_share);
    Ok(match loc {
        Location::Stdio => plain(Endpoint::Stdio),
        Location::Null => bail!("null: can only be a destination"),
        Location::Nbd(u) => plain(Endpoint::Nbd(u.clone())),
        Location::Spec(s) => plain(Endpoint::Backend(BackendEndpoint::new(s.clone(), ferry_backend::open(s, true)?))),
        Location::Repo { repo, name, id } => {
            let img = repo::open_snapshot(repo, name, id.as_deref(), remote)?;
            let shown = Location::repo_spec(repo, name, id.as_deref());
            plain(Endpoint::Backend(BackendEndpoint::new(shown, img)))
        }
        Location::Image { store: Store::File(p), format, file_prefix } => {
            match local_format(p, *format, *file_prefix) {
                Format::Qcow2 => {
                    let opts = ferry_qcow2::Options { read_only: true, ..Default::default() };
                    let q = open_local_qcow2(p, *format, *file_prefix, opts, usage)?;
                    let files = q.open_files().to_vec();
                    Source {
                        endpoint: Endpoint::Backend(BackendEndpoint::new(p.display().to_string(), q)),
                        files,
                        _guard: None,
                    }
                }
                Format::Raw if !is_image_file(p) => plain(Endpoint::File(p.clone())),
                Format::Raw => {
                    let guard = ferry_backend::lock::lock_path(p, usage.raw())
                        .with_context(|| format!("cannot open {}", p.display()))?;
                    let files = vec![OpenFile { id: FileId::of(&guard)?, path: p.clone(), writable: false }];
                    Source { endpoint: Endpoint::File(p.clone()), files, _guard: Some(guard) }
                }
            }
        }
        Location::Image { store: Store::Rbd(spec), format: None | Some(Format::Raw), .. } => plain(rbd::source(spec)?),
        Location::Image { store, format, .. } => {
            let b = format_on_store(store, *format, true, remote)?;
            plain(Endpoint::Backend(BackendEndpoint::new(b.describe(), b)))
        }
    })
}

/// The format a local destination is written in: `format` (--format), else the spec's
/// `qcow2:`/`raw:`, else the extension (.qcow2, .qcow), else raw. `None` when the
/// location is not a local file.
pub fn destination_format(loc: &Location, format: Option<Format>) -> Option<(Format, &Path)> {
    let Location::Image { store: Store::File(p), format: prefixed, .. } = loc else { return None };
    let by_ext = match p.extension().and_then(|e| e.to_str()) {
        Some("qcow2") | Some("qcow") => Format::Qcow2,
        _ => Format::Raw,
    };
    Some((format.or(*prefixed).unwrap_or(by_ext), p))
}

/// How a copy's destination is made.
#[derive(Debug, Clone, Default)]
pub struct DestinationOptions {
    /// `--format`: local destinations only.
    pub format: Option<Format>,
    /// `--backing FILE`: a new local qcow2 overlay of FILE.
    pub backing: Option<PathBuf>,
    /// `--flush`: a new qcow2 image is synced when finished.
    pub flush: bool,
    /// The copy writes selected ranges only (`--dirty-bitmap`, `--extents-from`): an
    /// existing local qcow2 image is updated in place.
    pub selective: bool,
    /// `--resume` of a journalled copy: an existing destination is reopened, never made
    /// anew (a local qcow2 image is opened read-write; a raw file is not emptied, which
    /// the copy engine sees to).
    pub resume: bool,
    /// An S3 destination of a `--resume` copy: an upload the copy does not finish is
    /// kept for a later run (not aborted), and `Some(ID)` continues the upload an earlier
    /// run kept, its stored parts counting as written.
    pub upload: Option<ResumableUpload>,
    /// `ferry copy -n`: a local destination must exist, and is written in place (a qcow2
    /// image opened read-write, a raw file not emptied or sized).
    pub existing: bool,
}

/// How a `--resume` copy uploads to S3 ([`DestinationOptions::upload`]).
#[derive(Debug, Clone, Default)]
pub struct ResumableUpload {
    /// The multipart upload an earlier run kept; `None`: a new one.
    pub continue_id: Option<String>,
}

/// A copy destination, opened (and created when it did not exist).
pub struct Destination {
    pub endpoint: Endpoint,
    /// The local file this opening created (removed again if the copy proves wrong).
    pub created: Option<PathBuf>,
    /// A new qcow2 image, finished when the copy is done.
    new_qcow2: Option<Arc<Qcow2>>,
    /// An S3 object being uploaded: it appears when the copy is done (and is aborted,
    /// leaving nothing, if the copy fails).
    upload: Option<Arc<ferry_s3::S3Writer>>,
}

impl Destination {
    /// After a successful copy: nothing a backend destination holds in this process (a
    /// new qcow2 image's metadata, an RBD image's write-back cache) is lost when it
    /// exits, and failures are reported. A new qcow2 image is finished (synced only
    /// with --flush), any other backend flushed.
    /// An S3 object is completed (it appears only now) and reopened for reading, so
    /// `endpoint` can be read back (`--verify`).
    pub fn finish(&mut self, remote: &Remote) -> Result<()> {
        if let Some(w) = &self.upload {
            // Still `upload` while completing fails: the caller can tell (is_upload).
            w.complete().with_context(|| format!("cannot finish the upload to {}", w.url()))?;
            let name = w.url().to_string();
            self.upload = None;
            self.endpoint = Endpoint::Backend(BackendEndpoint::new(name.clone(), s3::open(&name, &remote.http)?));
            return Ok(());
        }
        match (&self.new_qcow2, &self.endpoint) {
            (Some(q), _) => q.finish().with_context(|| format!("cannot finish {}", q.describe())),
            (None, Endpoint::Backend(b)) => b.backend().flush().with_context(|| format!("cannot finish {}", b.name())),
            _ => Ok(()),
        }
    }

    /// Whether the destination is an object being uploaded (nothing of it exists until
    /// [`Destination::finish`]).
    pub fn is_upload(&self) -> bool {
        self.upload.is_some()
    }

    /// The object being uploaded, until [`Destination::finish`] or
    /// [`Destination::abort`].
    pub fn upload(&self) -> Option<&ferry_s3::S3Writer> {
        self.upload.as_deref()
    }

    /// Gives up an upload: nothing is left at the destination. (Dropping an unfinished
    /// destination does the same.) An abort that fails leaves `is_upload` true: the
    /// upload may still exist.
    pub fn abort(&mut self) -> Result<()> {
        let Some(w) = &self.upload else { return Ok(()) };
        w.abort().with_context(|| format!("cannot abort the upload to {}", w.url()))?;
        self.upload = None;
        Ok(())
    }
}

/// Opens (or creates) the destination of a copy from `src`.
pub fn destination(loc: &Location, src: &Endpoint, opts: &DestinationOptions, remote: &Remote) -> Result<Destination> {
    let plain = |endpoint| Destination { endpoint, created: None, new_qcow2: None, upload: None };
    let Some((format, path)) = destination_format(loc, opts.format) else {
        if opts.format.is_some() || opts.backing.is_some() {
            bail!("--format and --backing apply to local destinations only");
        }
        return Ok(match loc {
            Location::Stdio => plain(Endpoint::Stdio),
            Location::Null => plain(Endpoint::Null),
            Location::Nbd(u) => plain(Endpoint::Nbd(u.clone())),
            Location::Repo { repo, name, .. } => bail!(
                "{repo}::{name} is a disk in a backup repository: a copy cannot write a snapshot; use \
                 `ferry backup SRC {repo}::{name}` to back up into it"
            ),
            Location::Spec(s) => {
                plain(Endpoint::Backend(BackendEndpoint::new(s.clone(), ferry_backend::open(s, false)?)))
            }
            Location::Image { store: Store::Rbd(spec), format: None | Some(Format::Raw), .. } => {
                plain(rbd::destination(spec, || source_size(src))?)
            }
            Location::Image { store: Store::S3(url), format: None | Some(Format::Raw), .. } => {
                let size = source_size(src)?;
                let w = match &opts.upload {
                    Some(ResumableUpload { continue_id: Some(id) }) => s3::resume_writer(url, size, id, &remote.http)?,
                    _ => s3::writer(url, size, &remote.http)?,
                };
                if opts.upload.is_some() {
                    w.keep_unfinished();
                }
                let e = Endpoint::Backend(BackendEndpoint::new(w.url().to_string(), w.clone()));
                Destination { endpoint: e, created: None, new_qcow2: None, upload: Some(w) }
            }
            Location::Image { store: Store::Http(url), .. } => bail!(
                "{} cannot be a copy destination: HTTP images are read-only (copy to a file, an NBD export, \
                 an RBD image or s3://BUCKET/KEY)",
                ferry_http::redact(url)
            ),
            Location::Image { store, format: Some(Format::Qcow2), .. } => {
                bail!(
                    "a qcow2 image on {} cannot be a copy destination: write it raw, or to a local qcow2 file",
                    ferry_http::redact(store_name(store))
                )
            }
            Location::Image { store, .. } => {
                bail!("{} cannot be a copy destination", ferry_http::redact(store_name(store)))
            }
        });
    };
    let existed = path.symlink_metadata().is_ok();
    let name = path.display().to_string();
    let is_qcow2 =
        format == Format::Qcow2 || existed && opts.format.is_none() && local_format_of(loc) == Some(Format::Qcow2);
    if opts.existing && !existed {
        bail!("{name} does not exist: -n writes into an existing image (create it first, or copy without -n)");
    }
    let updated = (opts.selective && opts.backing.is_none() || opts.resume || opts.existing) && existed;
    if updated && is_qcow2 && format != Format::Qcow2 {
        // Only the bytes say qcow2, and they may be a guest's (a raw backup of its disk):
        // opened as qcow2, they would choose the backing file this copy reads.
        bail!(
            "{name} starts with a qcow2 header, but neither its name nor the command says it is one (its bytes \
             may be a guest's, so ferry does not guess): name it qcow2:{name} or add --format qcow2 to update the \
             qcow2 image, or name it raw:{name} to write its bytes as raw"
        );
    }
    if updated && is_qcow2 {
        // An incremental copy onto an existing qcow2 image updates it in place (opened
        // read-write, never taken for zeroed).
        let how = ServeOpen { read_only: false, ..Default::default() };
        let (b, _) = open_backend(
            &Location::Image { store: Store::File(path.into()), format: Some(Format::Qcow2), file_prefix: false },
            how,
            remote,
        )?;
        return Ok(plain(Endpoint::Backend(BackendEndpoint::new(name, b))));
    }
    let created = (!existed).then(|| path.to_path_buf());
    Ok(match format {
        Format::Qcow2 => {
            let q = match &opts.backing {
                Some(file) => overlay(file, src, path, opts.flush)?,
                None => {
                    let size = source_size(src)?;
                    let q = Qcow2::create(path, size, 64 << 10)
                        .with_context(|| format!("cannot create qcow2 image {name}"))?;
                    // Without --flush nothing is synced, as for a raw destination: the
                    // metadata is written and left to the kernel (on ext4 a sync of the
                    // whole new image at the end measured about 40% of a conversion's time).
                    Arc::new(if opts.flush { q } else { q.without_sync_on_close() })
                }
            };
            // An overlay is not `zeroed`: unwritten clusters read the backing file, so
            // the source's holes and zero blocks must be written (as zero clusters).
            let e = BackendEndpoint::new(name, q.clone());
            let e = if opts.backing.is_some() { e } else { e.zeroed() };
            Destination { endpoint: Endpoint::Backend(e), created, new_qcow2: Some(q), upload: None }
        }
        Format::Raw if opts.backing.is_some() => bail!(
            "--backing makes a qcow2 overlay: name the destination qcow2:PATH or PATH.qcow2, or add --format qcow2"
        ),
        Format::Raw => {
            Destination { endpoint: Endpoint::File(path.to_path_buf()), created, new_qcow2: None, upload: None }
        }
    })
}

/// A new qcow2 image at `path` over `file`, which must be the source's size.
fn overlay(file: &Path, src: &Endpoint, path: &Path, flush: bool) -> Result<Arc<Qcow2>> {
    let size = source_size(src)?;
    let backing =
        ferry_qcow2::Backing::for_image(file, path).with_context(|| format!("--backing {}", file.display()))?;
    // Opened (and locked as a backing file) to learn its size before anything is created.
    let usage = ImageUse::new(Access::Backing);
    let backing_size = if backing.format == "qcow2" {
        open_qcow2(file, true, usage)?.size()
    } else {
        FileBackend::open_with(file, true, usage.raw())
            .with_context(|| format!("cannot open backing file {}", file.display()))?
            .size()
    };
    if backing_size != size {
        bail!(
            "backing file {} ({}) is {backing_size} bytes but the source is {size} bytes: an overlay must have \
             its backing file's size",
            file.display(),
            backing.format
        );
    }
    let q = Qcow2::create_with(path, size, 64 << 10, Some(&backing))
        .with_context(|| format!("cannot create qcow2 image {} over {}", path.display(), file.display()))?;
    Ok(Arc::new(if flush { q } else { q.without_sync_on_close() }))
}

/// The size of a source, to create a destination image that does not exist yet.
pub fn source_size(src: &Endpoint) -> Result<u64> {
    Ok(match src {
        Endpoint::Backend(b) => b.backend().size(),
        Endpoint::File(p) => {
            use std::io::Seek;
            if std::fs::metadata(p).is_ok_and(|m| m.file_type().is_char_device()) {
                bail!(
                    "{} is a character device: it has no size to create an image with; copy a known amount \
                     with head -c SIZE {} | ferry copy - DST into an existing destination",
                    p.display(),
                    p.display()
                );
            }
            let mut f = std::fs::File::open(p).with_context(|| format!("cannot open {}", p.display()))?;
            f.seek(std::io::SeekFrom::End(0))?
        }
        Endpoint::Nbd(u) => {
            let c = ferry_client::Connection::connect(u, &ConnectOptions::default())
                .with_context(|| format!("connecting to {u}"))?;
            let size = c.size();
            let _ = c.disconnect();
            size
        }
        Endpoint::Stdio | Endpoint::Null => {
            bail!("a stream has no size to create an image with; create the destination first")
        }
    })
}

/// Copy workers (`-C`) when not given and an end is on a network store: 8. A worker's
/// call waits for the network, not for a core, so more of them than cores keep more
/// requests in flight (measured: 2 workers took 1.3-2x as long as 8 for rbd -> file,
/// with 8 as fast as qemu-img convert's 8 coroutines; BENCHMARKING.md).
pub fn copy_workers(src: &Location, dst: &Location) -> Option<usize> {
    let remote = |l: &Location| match l {
        Location::Image { store, .. } => store.is_remote(),
        Location::Repo { repo, .. } => repo.get(..5).is_some_and(|p| p.eq_ignore_ascii_case("s3://")),
        _ => false,
    };
    (remote(src) || remote(dst)).then_some(8)
}

/// `ferry info` of an RBD image: `Some(exit code)` when the location is one.
pub fn rbd_info(loc: &Location, json: bool) -> Result<Option<i32>> {
    match loc {
        Location::Image { store: Store::Rbd(spec), format: None | Some(Format::Raw), .. } => {
            rbd::info(spec, json).map(Some)
        }
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_hides_what_may_be_secret() {
        assert_eq!(shown("http://u:pw@h:8/a/b?sig=x#f"), "http://h:8/a/b");
        assert_eq!(shown("raw:https://u:pw@h/q.qcow2"), "raw:https://h/q.qcow2");
        assert_eq!(shown("qcow2:HTTPS://u:pw@h/q"), "qcow2:https://h/q");
        assert_eq!(shown("s3://bkt/key"), "s3://bkt/key");
        assert_eq!(shown("qcow2:rbd:p/i:key=AQB1:id=u"), "qcow2:rbd:p/i:key=***:id=u");
        for kept in ["/tmp/a?b@c", "raw:/x?y", "nbd+unix:///e?socket=/s", "null:", "-", "rbd:p/i?conf=/c"] {
            assert_eq!(shown(kept), kept);
        }
    }

    #[test]
    fn formats() {
        let dir = tempfile::tempdir().unwrap();
        let q = dir.path().join("a.img");
        std::fs::write(&q, b"QFI\xfb\0\0\0\x03").unwrap();
        let r = dir.path().join("b.img");
        std::fs::write(&r, b"raw bytes").unwrap();
        assert_eq!(local_format(&q, None, false), Format::Qcow2);
        assert_eq!(local_format(&r, None, false), Format::Raw);
        assert_eq!(local_format(&q, Some(Format::Raw), true), Format::Raw);
        assert_eq!(local_format(&r, Some(Format::Qcow2), false), Format::Qcow2);
        let d = |s: &str, f| {
            let l = Location::parse(s).unwrap();
            destination_format(&l, f).map(|(f, p)| (f, p.display().to_string()))
        };
        assert_eq!(d("out.qcow2", None), Some((Format::Qcow2, "out.qcow2".into())));
        assert_eq!(d("out.qcow2", Some(Format::Raw)), Some((Format::Raw, "out.qcow2".into())));
        assert_eq!(d("out.img", Some(Format::Qcow2)), Some((Format::Qcow2, "out.img".into())));
        assert_eq!(d("qcow2:out.img", None), Some((Format::Qcow2, "out.img".into())));
        assert_eq!(d("out.img", None), Some((Format::Raw, "out.img".into())));
        assert_eq!(d("nbd://h/x", None), None);
        assert_eq!(d("memory:1G", None), None);
    }
}
