//! `ferry copy --resume`: where a copy's journal lives and the identities that key it
//! (the journal itself and how the engine keeps it: `ferry_client::copy::journal`).
//!
//! A local destination file has its journal beside it (`DST.ferry-resume`); any other
//! destination (NBD, RBD, a block device) has it in the state directory (`--resume-dir`,
//! else `$XDG_STATE_HOME/ferry/resume`, else `~/.local/state/ferry/resume`), named by a
//! hash of the destination's spec (without a password or query string, so that a
//! re-signed URL finds its journal). The state directory is made 0700, journals are 0600.
//!
//! What identifies the source, so that one changed since the first run is refused:
//! * each local file read (the image, its backing chain): device, inode, size and mtime;
//! * a block device: its node (device number), size, what backs it (a loop device's
//!   backing file with that file's device, inode, size and mtime; a device-mapper
//!   device's UUID, which a re-created LVM snapshot does not keep) and a SHA-256 of 16
//!   blocks of 4 KiB sampled across it (first and last included), read again on resume;
//! * a remote object: what its backend says ([`ferry_backend::Backend::identity`]: the
//!   URL without secrets, size and validator), else its spec without secrets.
//!
//! The destination is identified by its spec (without secrets) and, for a local file,
//! device and inode. No identity holds a password, a query string or a token, and
//! errors show identities redacted.
//!
//! An upload to S3 keeps no watermark: parts are durable once stored, and the store
//! itself lists them (ListParts). Its journal keys the copy as any other does and names
//! the multipart upload (`s3://BUCKET/KEY upload=ID`); a resumed run continues that
//! upload and copies only what no stored part holds. `--restart`, or a copy onto the
//! same object without `--resume`, aborts the upload a journal names before removing it.

use super::CopyArgs;
use crate::remote_args::shown;
use anyhow::{bail, Context, Result};
use ferry_client::copy::journal::{self, Journal, Record};
use ferry_client::copy::Endpoint;
use ferry_http::HttpOptions;
use ferry_open::{Location, ResumableUpload, Source, Store};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

/// A `--resume` copy before its destination is opened: the journal's place, the key
/// without the destination's identity, and the journal found there (already checked for
/// everything but the destination).
pub struct Prepared {
    path: PathBuf,
    key: Record,
    stored: Option<Record>,
}

/// How a journal's destination names the S3 upload it continues.
const UPLOAD_TAG: &str = " upload=";

/// The multipart upload a journal of a copy onto `dst_loc` names, if it is an S3 one.
fn upload_of<'a>(dst_loc: &Location, r: &'a Record) -> Option<&'a str> {
    matches!(dst_loc, Location::Image { store: Store::S3(_), .. })
        .then(|| r.destination.rsplit_once(UPLOAD_TAG).map(|(_, id)| id))
        .flatten()
        .filter(|id| !id.is_empty())
}

/// Removes the journal at `path` of an earlier copy onto `dst_loc`, first aborting the
/// S3 upload it names (whose parts nothing would ever complete or delete otherwise). An
/// upload that cannot be aborted keeps its journal, and the copy stops: the journal is
/// the only record of it.
fn discard(args: &CopyArgs, dst_loc: &Location, path: &Path, http: &HttpOptions) -> Result<()> {
    // A journal that cannot be read names nothing to abort.
    if let Ok(Some(r)) = journal::load(path) {
        if let Some(id) = upload_of(dst_loc, &r) {
            ferry_open::abort_upload(&args.dst, id, http).with_context(|| {
                format!(
                    "the resume journal {} names the upload {id} an earlier --resume copy kept, and it could not be \
                     aborted: try again, or abort it yourself (`aws s3api abort-multipart-upload --upload-id {id} \
                     ...`) and delete the journal",
                    path.display()
                )
            })?;
            log::warn!("aborted the upload {id} an earlier --resume copy kept");
        }
    }
    journal::remove(path)?;
    Ok(())
}

/// The local file a destination location names, if any.
fn local_path(loc: &Location) -> Option<&Path> {
    match loc {
        Location::Image { store: Store::File(p), .. } => Some(p),
        _ => None,
    }
}

/// The state directory for journals of destinations other than local files.
fn state_dir(args: &CopyArgs) -> Result<PathBuf> {
    if let Some(d) = &args.resume_dir {
        return Ok(d.clone());
    }
    let base = match (std::env::var_os("XDG_STATE_HOME"), std::env::var_os("HOME")) {
        (Some(x), _) if Path::new(&x).is_absolute() => PathBuf::from(x),
        (_, Some(h)) if !h.is_empty() => Path::new(&h).join(".local/state"),
        _ => bail!("--resume: neither XDG_STATE_HOME nor HOME is set; name a directory with --resume-dir"),
    };
    Ok(base.join("ferry/resume"))
}

/// Where the journal of a copy onto `dst_loc` is: beside a regular (or new) local file,
/// else in the state directory.
fn journal_path(args: &CopyArgs, dst_loc: &Location) -> Result<PathBuf> {
    if let Some(p) = local_path(dst_loc) {
        let regular = std::fs::metadata(p).map_or(true, |m| m.is_file());
        if regular {
            let mut s = p.as_os_str().to_owned();
            s.push(".ferry-resume");
            return Ok(PathBuf::from(s));
        }
    }
    // Without secrets: a URL signed again names the same destination and journal.
    let mut digest = [0u8; 32];
    ferry_hash::Algorithm::Sha256.digest_into(shown(&args.dst).as_bytes(), &mut digest);
    Ok(state_dir(args)?.join(format!("{}.ferry-resume", ferry_hash::hex(&digest[..16]))))
}

/// Device, inode, size and mtime of a local file; of a block device source (`content`)
/// what backs it and a fingerprint of its content too (see the module's notes).
fn file_identity(p: &Path, content: bool) -> Result<String> {
    let m = std::fs::metadata(p).with_context(|| format!("--resume: cannot look at {}", p.display()))?;
    let canon = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let mut s = format!("file:{} dev={} ino={}", canon.display(), m.dev(), m.ino());
    if m.file_type().is_file() && content {
        s += &format!(" size={} mtime={}.{:09}", m.size(), m.mtime(), m.mtime_nsec());
    }
    if !m.file_type().is_file() {
        s += &format!(" rdev={}", m.rdev());
    }
    if content && std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()) {
        s += &device_identity(p, m.rdev())?;
    }
    Ok(s)
}

/// Blocks of [`FINGERPRINT_BLOCK`] bytes a block device's fingerprint samples.
const FINGERPRINT_BLOCKS: u64 = 16;
const FINGERPRINT_BLOCK: u64 = 4096;

/// What pins a block device's content beyond its node, which a loop device or an LVM
/// snapshot re-created with other contents keeps: its size, its backing (a loop device's
/// file: path, device, inode, size, mtime; a device-mapper UUID) and a SHA-256 of 16
/// sampled 4 KiB blocks at fixed places (first and last included).
fn device_identity(p: &Path, rdev: u64) -> Result<String> {
    let f = std::fs::File::open(p).with_context(|| format!("--resume: cannot open {} to identify it", p.display()))?;
    let size = std::io::Seek::seek(&mut &f, std::io::SeekFrom::End(0))
        .with_context(|| format!("--resume: the size of {}", p.display()))?;
    let mut s = format!(" size={size}");
    // Linux's dev_t: major in bits 8-19 and 32-63, minor in bits 0-7 and 20-31.
    let (major, minor) = (((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff), (rdev & 0xff) | ((rdev >> 12) & !0xff));
    let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    let read = |rel: &str| std::fs::read_to_string(sys.join(rel)).ok().map(|t| t.trim_end_matches('\n').to_string());
    if let Some(backing) = read("loop/backing_file") {
        s += &format!(" loop-backing={backing:?}");
        let file = backing.strip_suffix(" (deleted)").unwrap_or(&backing);
        match std::fs::metadata(file) {
            Ok(b) => {
                s += &format!(
                    " backing-dev={} backing-ino={} backing-size={} backing-mtime={}.{:09}",
                    b.dev(),
                    b.ino(),
                    b.size(),
                    b.mtime(),
                    b.mtime_nsec()
                )
            }
            Err(_) => s += " backing-gone",
        }
        if let Some(off) = read("loop/offset") {
            s += &format!(" loop-offset={off}");
        }
    }
    if let Some(uuid) = read("dm/uuid").filter(|u| !u.is_empty()) {
        s += &format!(" dm-uuid={uuid}");
    }
    // The fingerprint: whole blocks at fixed places, the last one ending at the end.
    let mut sample = Vec::with_capacity((FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK) as usize);
    let mut buf = vec![0u8; FINGERPRINT_BLOCK as usize];
    let last = size.saturating_sub(FINGERPRINT_BLOCK);
    for i in 0..FINGERPRINT_BLOCKS {
        let at = last / (FINGERPRINT_BLOCKS - 1) * i;
        let at = if i == FINGERPRINT_BLOCKS - 1 { last } else { at / FINGERPRINT_BLOCK * FINGERPRINT_BLOCK };
        let n = FINGERPRINT_BLOCK.min(size - at.min(size)) as usize;
        f.read_exact_at(&mut buf[..n], at)
            .with_context(|| format!("--resume: cannot read {} at offset {at} to identify it", p.display()))?;
        sample.extend_from_slice(&buf[..n]);
    }
    let mut digest = [0u8; 32];
    ferry_hash::Algorithm::Sha256.digest_into(&sample, &mut digest);
    s += &format!(" sampled-sha256={}", ferry_hash::hex(&digest));
    Ok(s)
}

/// The source's identity: its spec, and every local file it reads.
fn source_identity(args: &CopyArgs, source: &Source) -> Result<String> {
    if matches!(source.endpoint, Endpoint::Stdio) {
        bail!("--resume: the source {:?} is a stream, which cannot be read from the middle", shown(&args.src));
    }
    if source.files.is_empty() {
        return match &source.endpoint {
            Endpoint::File(p) => file_identity(p, true),
            // A remote object: its validator where the backend has one; never a secret.
            Endpoint::Backend(b) => Ok(b.backend().identity().unwrap_or_else(|| shown(&args.src))),
            _ => Ok(shown(&args.src)),
        };
    }
    // A local image: its files, however the spec names them.
    let ids: Result<Vec<String>> = source.files.iter().map(|f| file_identity(&f.path, true)).collect();
    Ok(ids?.join(" + "))
}

impl Prepared {
    /// `--resume`/`--restart`: finds the journal and checks a stored one against this
    /// copy (all but the destination's identity). Without them: `None`, and a journal
    /// left by an earlier `--resume` copy onto the same destination is removed, since
    /// this copy rewrites what it recorded.
    pub fn new(
        args: &CopyArgs,
        source: &Source,
        dst_loc: &Location,
        request_size: u64,
        http: &HttpOptions,
    ) -> Result<Option<Prepared>> {
        if !args.resume && !args.restart {
            if args.resume_dir.is_some() || args.resume_interval.is_some() || args.resume_seconds.is_some() {
                bail!("--resume-dir, --resume-interval and --resume-seconds go with --resume");
            }
            if let Ok(p) = journal_path(args, dst_loc) {
                if p.exists() {
                    log::warn!(
                        "removing the resume journal {} of an earlier copy: this copy is not --resume",
                        p.display()
                    );
                    discard(args, dst_loc, &p, http)?;
                }
            }
            return Ok(None);
        }
        if args.dirty_bitmap.is_some() || args.extents_from.is_some() {
            bail!(
                "--resume cannot be combined with --dirty-bitmap or --extents-from: run the incremental copy again \
                 without --resume (it rewrites only the selected ranges)"
            );
        }
        if matches!(dst_loc, Location::Stdio | Location::Null) {
            bail!("--resume: the destination {:?} is a stream or null:, which cannot be resumed", shown(&args.dst));
        }
        let path = journal_path(args, dst_loc)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // The state directory: its owner's only (a journal names what is copied).
            std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
                .create(dir)
                .with_context(|| format!("--resume: cannot create {}", dir.display()))?;
        }
        if args.restart {
            discard(args, dst_loc, &path, http)?;
        }
        let key = Record {
            ferry_version: env!("CARGO_PKG_VERSION").to_string(),
            source: source_identity(args, source)?,
            destination: String::new(),
            options: format!("request-size={request_size} sparse={}", args.sparse),
            source_size: ferry_open::source_size(&source.endpoint).context("--resume: the source's size")?,
            watermark: 0,
            destination_zeroed: false,
        };
        let stored = journal::load(&path)?;
        if let Some(r) = &stored {
            // Everything but the destination, before it is opened.
            if let Some(why) = r.differs(&Record { destination: r.destination.clone(), ..key.clone() }) {
                return Err(journal::JournalError::Mismatch { path: path.display().to_string(), why }.into());
            }
        }
        Ok(Some(Prepared { path, key, stored }))
    }

    /// For an S3 destination: keep the upload if this run does not finish it, and
    /// continue the one a stored journal names.
    pub fn upload(&self, dst_loc: &Location) -> Option<ResumableUpload> {
        matches!(dst_loc, Location::Image { store: Store::S3(_), .. }).then(|| ResumableUpload {
            continue_id: self.stored.as_ref().and_then(|r| upload_of(dst_loc, r)).map(str::to_string),
        })
    }

    /// With the upload open (`upload_id`: its ID): the journal that keys this copy and
    /// names the upload, stored now by a first run (before any part is sent), checked
    /// against this copy by a resumed one.
    pub fn open_upload(self, args: &CopyArgs, upload_id: &str) -> Result<UploadJournal> {
        let record = Record { destination: format!("{}{UPLOAD_TAG}{upload_id}", shown(&args.dst)), ..self.key };
        match &self.stored {
            Some(r) => {
                if let Some(why) = r.differs(&record) {
                    return Err(journal::JournalError::Mismatch { path: self.path.display().to_string(), why }.into());
                }
            }
            None => journal::store(&self.path, &record)?,
        }
        Ok(UploadJournal { path: self.path })
    }

    /// A stored journal of this copy is resumed: the destination must be reopened.
    pub fn resuming(&self) -> bool {
        self.stored.is_some()
    }

    /// With the destination open (or made): its identity completes the key, and the
    /// journal is opened (a stored one must name this destination).
    pub fn open(self, args: &CopyArgs, dst: &Endpoint) -> Result<Journal> {
        let destination = match dst {
            Endpoint::File(p) => {
                if self.stored.is_none() && std::fs::symlink_metadata(p).is_err() {
                    // The copy makes the file: made here (empty), so that its identity
                    // is known before the first journal names it.
                    std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(p)
                        .with_context(|| format!("cannot create destination {}", p.display()))?;
                }
                file_identity(p, false)?
            }
            Endpoint::Backend(b) => match local_file_of(args) {
                Some(p) => format!("{} [{}]", shown(b.name()), file_identity(&p, false)?),
                None => shown(b.name()),
            },
            Endpoint::Nbd(_) => shown(&args.dst),
            Endpoint::Stdio | Endpoint::Null => {
                bail!("--resume: the destination {:?} is a stream or null:, which cannot be resumed", shown(&args.dst))
            }
        };
        let key = Record { destination, ..self.key };
        let mut j = Journal::open(self.path, key, false)?;
        if let Some(b) = args.resume_interval {
            j = j.interval(b, args.resume_seconds.unwrap_or(journal::DEFAULT_INTERVAL_TIME));
        } else if let Some(t) = args.resume_seconds {
            j = j.interval(journal::DEFAULT_INTERVAL_BYTES, t);
        }
        Ok(j)
    }
}

/// The local file behind a destination spec (a qcow2 image), if it is one.
fn local_file_of(args: &CopyArgs) -> Option<PathBuf> {
    let loc = Location::parse(&args.dst).ok()?;
    local_path(&loc).filter(|p| p.exists()).map(Path::to_path_buf)
}

/// The journal of a `--resume` upload to S3 (see the module's notes).
pub struct UploadJournal {
    path: PathBuf,
}

impl UploadJournal {
    /// The upload is complete, or aborted: nothing is left to resume.
    pub fn finish(&self) -> Result<()> {
        Ok(journal::remove(&self.path)?)
    }
}
