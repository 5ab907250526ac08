//! Backup repositories (`ferry-repo`): a directory or `s3://BUCKET/PREFIX` opened as a
//! store, the repository on it unlocked with its passphrase, and a snapshot
//! (`REPO::NAME[@ID]`) opened as a read-only image.
//!
//! The passphrase of an encrypted repository comes from `--password-file FILE` where a
//! command takes it, else the environment: `FERRY_PASSWORD`, else the first line of the
//! file `FERRY_PASSWORD_FILE` names. It is never asked for on a terminal.

use crate::Remote;
use anyhow::{bail, Context, Result};
use ferry_repo::store::{DirStore, S3Store, Store};
use ferry_repo::{Repository, SnapshotImage, SnapshotInfo};
use std::path::Path;
use std::sync::Arc;

/// How to give a passphrase, for messages.
pub const PASSPHRASE_HOW: &str =
    "give its passphrase with --password-file FILE (where the command takes it), FERRY_PASSWORD=... or \
     FERRY_PASSWORD_FILE=FILE";

fn is_s3(repo: &str) -> bool {
    repo.get(..5).is_some_and(|p| p.eq_ignore_ascii_case("s3://"))
}

/// The store of an existing repository (`create`: a directory is made if missing, for
/// `ferry repo init`; an S3 prefix needs nothing made).
pub fn repo_store(repo: &str, remote: &Remote, create: bool) -> Result<Arc<dyn Store>> {
    if is_s3(repo) {
        let cfg = ferry_s3::S3Config::from_env().with_context(|| format!("cannot reach {repo}"))?;
        let http = crate::s3::http_for_s3(&remote.http)?;
        let s = S3Store::open(repo, &cfg, &http).with_context(|| format!("cannot open the repository {repo}"))?;
        return Ok(Arc::new(s));
    }
    let p = Path::new(repo);
    let s = if create { DirStore::create(p) } else { DirStore::open(p) };
    let s = s.with_context(|| {
        if create {
            format!("cannot create the repository {repo}")
        } else {
            format!("cannot open the repository {repo} (make one with `ferry repo init {repo}`)")
        }
    })?;
    Ok(Arc::new(s))
}

/// The first line of `file`, without its line end.
fn first_line(file: &Path) -> Result<Vec<u8>> {
    let bytes = std::fs::read(file).with_context(|| format!("cannot read the passphrase file {}", file.display()))?;
    let line = bytes.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    Ok(line.to_vec())
}

/// The passphrase given (`--password-file`, `FERRY_PASSWORD`, `FERRY_PASSWORD_FILE`), or
/// `None` when none is. An empty one is refused.
pub fn passphrase(password_file: Option<&Path>) -> Result<Option<Vec<u8>>> {
    let p = match (password_file, std::env::var_os("FERRY_PASSWORD"), std::env::var_os("FERRY_PASSWORD_FILE")) {
        (Some(f), _, _) => first_line(f)?,
        (None, Some(v), _) => {
            use std::os::unix::ffi::OsStrExt;
            v.as_bytes().to_vec()
        }
        (None, None, Some(f)) => first_line(Path::new(&f))?,
        (None, None, None) => return Ok(None),
    };
    if p.is_empty() {
        bail!("the passphrase given is empty: an empty passphrase protects nothing");
    }
    Ok(Some(p))
}

/// Opens the repository at `repo`, unlocking it with the passphrase given when it is
/// encrypted.
pub fn open_repository(repo: &str, remote: &Remote, password_file: Option<&Path>) -> Result<Arc<Repository>> {
    let store = repo_store(repo, remote, false)?;
    let given = passphrase(password_file)?;
    let ask = || -> ferry_repo::Result<Vec<u8>> {
        given.clone().ok_or_else(|| {
            ferry_repo::Error::Passphrase(format!("the repository {repo} is encrypted: {PASSPHRASE_HOW}"))
        })
    };
    let r = Repository::open(store, &ask).with_context(|| format!("cannot open the repository {repo}"))?;
    Ok(Arc::new(r))
}

/// The snapshot `name` and `id` mean in `repo`.
pub fn resolve(repo: &Repository, name: &str, id: Option<&str>) -> Result<SnapshotInfo> {
    repo.resolve(name, id).map_err(anyhow::Error::new)
}

/// A snapshot `REPO::NAME[@ID]`, opened as a read-only image.
pub fn open_snapshot(repo: &str, name: &str, id: Option<&str>, remote: &Remote) -> Result<Arc<SnapshotImage>> {
    let shown = crate::Location::repo_spec(repo, name, id);
    let r = open_repository(repo, remote, None)?;
    let snap = resolve(&r, name, id).with_context(|| shown.clone())?;
    SnapshotImage::open(r, &snap).with_context(|| format!("cannot open the snapshot {shown}"))
}
