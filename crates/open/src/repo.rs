//! Backup repositories (`ferry-repo`): a directory or `s3://BUCKET/PREFIX` opened as a
//! store, the repository on it unlocked with its passphrase, and a snapshot
//! (`REPO::NAME[@ID]`) opened as a read-only image.
//!
//! The passphrase of an encrypted repository comes from, in this order: `--password-file
//! FILE` or `--password-command CMD` where a command takes them; `FERRY_PASSWORD`; the
//! first line of the file `FERRY_PASSWORD_FILE` names; the first line that the command
//! `FERRY_PASSWORD_COMMAND` prints; else, when standard input is a terminal and the
//! repository is encrypted, a prompt on the terminal (without echo).

use crate::Remote;
use anyhow::{bail, Context, Result};
use ferry_repo::crypto::KdfLimit;
use ferry_repo::known::{Known, OnRollback};
use ferry_repo::store::{DirStore, S3Store, Store};
use ferry_repo::{Passphrase, Repository, SnapshotImage, SnapshotInfo};
use std::path::Path;
use std::sync::Arc;

/// How to give a passphrase, for messages.
pub const PASSPHRASE_HOW: &str =
    "give its passphrase with --password-file FILE or --password-command CMD (where the command takes them), \
     FERRY_PASSWORD=..., FERRY_PASSWORD_FILE=FILE or FERRY_PASSWORD_COMMAND=CMD, or run it on a terminal";

/// `--password-command CMD` of this command line, set once before a repository is opened.
static PASSWORD_COMMAND: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Takes `--password-command CMD` from the command line: it gives the passphrase where
/// `--password-file` is not given (see [`passphrase`]).
pub fn set_password_command(cmd: Option<&str>) {
    if let Some(c) = cmd {
        let _ = PASSWORD_COMMAND.set(c.to_string());
    }
}

/// Whether the repository `repo` is an S3 URL (else it is a directory's path).
pub fn is_s3(repo: &str) -> bool {
    repo.get(..5).is_some_and(|p| p.eq_ignore_ascii_case("s3://"))
}

/// The store of an existing repository (`create`: a directory is made if missing, for
/// `ferry repo init`; an S3 prefix needs nothing made).
pub fn repo_store(repo: &str, remote: &Remote, create: bool) -> Result<Arc<dyn Store>> {
    repo_store_at(repo, remote, create).map(|(s, _)| s)
}

/// [`repo_store`], and where the repository is, as this host's record of it is keyed: a
/// directory's canonical path, or the S3 URL and the server's endpoint.
pub fn repo_store_at(repo: &str, remote: &Remote, create: bool) -> Result<(Arc<dyn Store>, String)> {
    if is_s3(repo) {
        let cfg = ferry_s3::S3Config::from_env().with_context(|| format!("cannot reach {repo}"))?;
        let http = crate::s3::http_for_s3(&remote.http)?;
        let s = S3Store::open(repo, &cfg, &http).with_context(|| format!("cannot open the repository {repo}"))?;
        let at = format!("{} at {}", repo.trim_end_matches('/'), cfg.endpoint.as_deref().unwrap_or("AWS"));
        return Ok((Arc::new(s), at));
    }
    let p = Path::new(repo);
    let s = if create { DirStore::create(p) } else { DirStore::open(p) };
    // No directory there is no repository (an exit status of its own: docs/repo.md).
    let s = s.map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory if !create => {
            anyhow::Error::new(ferry_repo::Error::NoRepository(e.to_string()))
        }
        _ => anyhow::Error::new(e),
    });
    let s = s.with_context(|| {
        if create {
            format!("cannot create the repository {repo}")
        } else {
            format!("cannot open the repository {repo} (make one with `ferry repo init {repo}`)")
        }
    })?;
    let at = std::fs::canonicalize(p).map_or_else(|_| repo.to_string(), |p| p.display().to_string());
    Ok((Arc::new(s), at))
}

/// The most bytes of a passphrase file read to find its first line.
const MAX_PASSPHRASE_FILE: usize = 64 << 10;

/// Warns when the passphrase file is a regular file that the group or others may read
/// (as ssh does for a private key; a pipe or `/dev/stdin` is left alone).
fn warn_if_shared(file: &Path, f: &std::fs::File) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(meta) = f.metadata() else { return };
    let mode = meta.permissions().mode() & 0o777;
    if meta.is_file() && mode & 0o044 != 0 {
        log::warn!(
            "the passphrase file {} can be read by {} (mode {mode:03o}): anyone who reads it can read your backups; \
             make it private: chmod 600 {}",
            file.display(),
            if mode & 0o004 != 0 { "every user of this machine" } else { "its group" },
            file.display()
        );
    }
}

/// The first line of `file`, without its line end.
fn first_line(file: &Path) -> Result<Passphrase> {
    let what = format!("the passphrase file {}", file.display());
    let f = std::fs::File::open(file).with_context(|| format!("cannot read {what}"))?;
    warn_if_shared(file, &f);
    first_line_of(f, &what)
}

/// The first line that `f` (`what`, for messages) gives, without its line end. The bytes
/// are read into a [`Passphrase`] of fixed size (zeroed when dropped, never grown: no copy
/// is left behind in freed memory), at most 64 KiB of them: the line must be shorter.
fn first_line_of(mut f: impl std::io::Read, what: &str) -> Result<Passphrase> {
    let cannot = || format!("cannot read {what}");
    let mut bytes = Passphrase::new(vec![0u8; MAX_PASSPHRASE_FILE]);
    let mut n = 0;
    // Up to the first line end (a pipe or FIFO may send no more) or the buffer's end.
    while n < bytes.len() {
        match f.read(&mut bytes[n..]) {
            Ok(0) => break,
            Ok(k) => {
                n += k;
                if bytes[n - k..n].contains(&b'\n') {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e).with_context(cannot),
        }
    }
    let Some(mut end) = bytes[..n].iter().position(|&b| b == b'\n').or((n < bytes.len()).then_some(n)) else {
        bail!(
            "{what} has no line end in its first {} KiB: its first line is the passphrase",
            MAX_PASSPHRASE_FILE >> 10
        );
    };
    if end > 0 && bytes[end - 1] == b'\r' {
        end -= 1;
    }
    // What follows the line is zeroed before it is cut off (truncate keeps the memory).
    bytes[end..].fill(0);
    bytes.truncate(end);
    Ok(bytes)
}

/// The passphrase given (`--password-file`, `FERRY_PASSWORD`, `FERRY_PASSWORD_FILE`), or
/// `None` when none is. An empty one is refused. It is held as a [`Passphrase`], zeroed
/// when dropped; `FERRY_PASSWORD` itself stays in the process's environment (docs/backups.md
/// says to prefer a file), and ferry clears it from the environment of the processes it
/// starts.
pub fn passphrase(password_file: Option<&Path>) -> Result<Option<Passphrase>> {
    if let (None, Some(cmd)) = (password_file, PASSWORD_COMMAND.get()) {
        return from_command(cmd, "--password-command").map(Some);
    }
    if let Some(p) = passphrase_from(password_file, "FERRY_PASSWORD", "FERRY_PASSWORD_FILE")? {
        return Ok(Some(p));
    }
    match std::env::var("FERRY_PASSWORD_COMMAND") {
        Ok(cmd) if !cmd.is_empty() => from_command(&cmd, "FERRY_PASSWORD_COMMAND").map(Some),
        _ => Ok(None),
    }
}

/// The first line the passphrase command `cmd` (given as `what`) prints: run by `/bin/sh -c`
/// (so that a pipe or a quoted argument works as in a shell), with this standard input
/// and error (a tool that asks on the terminal can), its standard output read up to the
/// first line end (at most 64 KiB). A command that fails gives an error, and nothing it
/// printed is used or shown.
fn from_command(cmd: &str, what: &str) -> Result<Passphrase> {
    keep_out_of_core_dumps();
    let mut child = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(cmd)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run the passphrase command ({what})"))?;
    let line = first_line_of(
        child.stdout.take().context("no pipe from the passphrase command")?,
        &format!("the output of the passphrase command ({what})"),
    );
    // The rest of its output is not read: a command that prints more ends on SIGPIPE.
    let status = child.wait().with_context(|| format!("waiting for the passphrase command ({what})"))?;
    if !status.success() {
        bail!("the passphrase command ({what}) failed ({status}): fix it, or give the passphrase another way");
    }
    let line = line?;
    if line.is_empty() {
        bail!("the passphrase command ({what}) printed an empty line: an empty passphrase protects nothing");
    }
    Ok(line)
}

/// The passphrase typed on the terminal, asked for `repo`, when standard input is one
/// (else `None`): the prompt and the answer go through /dev/tty, with echo off.
pub fn prompt(repo: &str) -> Result<Option<Passphrase>> {
    prompt_line(&format!("passphrase of {repo}: "))
}

/// A new passphrase for `repo` typed on the terminal, twice, when standard input is one
/// (else `None`); two that differ are an error.
pub fn prompt_new(repo: &str) -> Result<Option<Passphrase>> {
    let Some(first) = prompt_line(&format!("new passphrase of {repo}: "))? else { return Ok(None) };
    let Some(again) = prompt_line("the new passphrase again: ")? else { return Ok(None) };
    if first != again {
        bail!("the two passphrases typed differ: nothing was changed; run it again");
    }
    Ok(Some(first))
}

/// The line typed on the terminal after `question`, when standard input is one (else
/// `None`), with echo off.
fn prompt_line(question: &str) -> Result<Option<Passphrase>> {
    use nix::sys::termios::{tcgetattr, tcsetattr, LocalFlags, SetArg};
    use std::io::{IsTerminal, Write};
    if !std::io::stdin().is_terminal() {
        return Ok(None);
    }
    let Ok(mut tty) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/tty") else {
        return Ok(None);
    };
    keep_out_of_core_dumps();
    let before = tcgetattr(&tty).context("cannot read the terminal's settings")?;
    let mut quiet = before.clone();
    quiet.local_flags.remove(LocalFlags::ECHO);
    quiet.local_flags.insert(LocalFlags::ICANON);
    // Echo off before the prompt shows, so that nothing typed once it is up is echoed.
    tcsetattr(&tty, SetArg::TCSANOW, &quiet).context("cannot turn the terminal's echo off")?;
    let line = write!(tty, "{question}")
        .and_then(|()| tty.flush())
        .context("cannot write to the terminal")
        .and_then(|()| first_line_of(&tty, "the passphrase typed"));
    // Echo back on whatever happened, then the line end the typed one did not show.
    let _ = tcsetattr(&tty, SetArg::TCSANOW, &before);
    let _ = writeln!(tty);
    let line = line?;
    if line.is_empty() {
        bail!("no passphrase typed: an empty passphrase protects nothing");
    }
    Ok(Some(line))
}

/// A new passphrase for `ferry repo key add|passwd`, as [`passphrase`] reads the current
/// one: `--new-password-file`, else `FERRY_NEW_PASSWORD`, else the first line of the file
/// `FERRY_NEW_PASSWORD_FILE` names.
pub fn new_passphrase(new_password_file: Option<&Path>) -> Result<Option<Passphrase>> {
    passphrase_from(new_password_file, "FERRY_NEW_PASSWORD", "FERRY_NEW_PASSWORD_FILE")
}

/// The destination's passphrase for `ferry repo copy`, as [`passphrase`] reads the
/// source's: `--to-password-file`, else `FERRY_TO_PASSWORD`, else the first line of the
/// file `FERRY_TO_PASSWORD_FILE` names.
pub fn to_passphrase(to_password_file: Option<&Path>) -> Result<Option<Passphrase>> {
    passphrase_from(to_password_file, "FERRY_TO_PASSWORD", "FERRY_TO_PASSWORD_FILE")
}

fn passphrase_from(file: Option<&Path>, var: &str, file_var: &str) -> Result<Option<Passphrase>> {
    let given = (file, std::env::var_os(var), std::env::var_os(file_var));
    if given != (None, None, None) {
        keep_out_of_core_dumps();
    }
    let p = match given {
        (Some(f), _, _) => first_line(f)?,
        (None, Some(v), _) => {
            use std::os::unix::ffi::OsStringExt;
            // The variable's copy, moved (not copied again) into the zeroed holder.
            Passphrase::new(v.into_vec())
        }
        (None, None, Some(f)) => first_line(Path::new(&f))?,
        (None, None, None) => return Ok(None),
    };
    if p.is_empty() {
        bail!("the passphrase given is empty: an empty passphrase protects nothing");
    }
    Ok(Some(p))
}

/// A process that holds a passphrase, and the key it unlocks, leaves no core dump and
/// cannot be attached to by a debugger of the same user (`prctl(PR_SET_DUMPABLE, 0)`):
/// a core of a crash would hold the repository's master key. The unit of `ferry serve`
/// sets `LimitCORE=0` too; this covers commands run by hand, by cron or by a backup
/// script. A failure is only warned about.
pub fn keep_out_of_core_dumps() {
    use rustix::process::{set_dumpable_behavior, DumpableBehavior};
    if let Err(e) = set_dumpable_behavior(DumpableBehavior::NotDumpable) {
        log::warn!("cannot keep the repository key out of core dumps (prctl PR_SET_DUMPABLE: {e})");
    }
}

/// Which key-derivation costs a repository may ask for: `FERRY_KDF_LIMIT=off` lifts the
/// default bound ([`KdfLimit`]); unset (or `default`) keeps it.
pub fn kdf_limit() -> Result<KdfLimit> {
    kdf_limit_from(std::env::var("FERRY_KDF_LIMIT").ok().as_deref())
}

fn kdf_limit_from(var: Option<&str>) -> Result<KdfLimit> {
    match var {
        None | Some("" | "default") => Ok(KdfLimit::Default),
        Some("off") => Ok(KdfLimit::Off),
        Some(v) => bail!(
            "FERRY_KDF_LIMIT={v:?}: give `off` to accept any key-derivation cost a repository asks for, or unset it"
        ),
    }
}

/// Opens the repository at `repo`, unlocking it with the passphrase given when it is
/// encrypted, checked against this host's record of it; a command that finds the store
/// went back is refused (see [`open_repository_with`] for the other choices).
pub fn open_repository(repo: &str, remote: &Remote, password_file: Option<&Path>) -> Result<Arc<Repository>> {
    let way_out = "if you know why (the snapshot was removed on purpose), run `ferry backup`, `ferry repo forget` or \
     `ferry repo gc` once with --accept-rollback, which makes the store's state the one this host knows"
        .to_string();
    open_repository_with(
        repo,
        remote,
        password_file,
        OnRollback::Refuse { disk: None, back: true, way_out, damaged: None },
    )
}

/// Where the passphrase given comes from, for messages.
fn passphrase_source(password_file: Option<&Path>) -> String {
    let var = |v: &str| std::env::var_os(v).is_some();
    match password_file {
        Some(f) => format!("--password-file {}", f.display()),
        None if PASSWORD_COMMAND.get().is_some() => "--password-command".into(),
        None if var("FERRY_PASSWORD") => "FERRY_PASSWORD".into(),
        None if var("FERRY_PASSWORD_FILE") => "FERRY_PASSWORD_FILE".into(),
        None => "FERRY_PASSWORD_COMMAND".into(),
    }
}

/// This host's record of the repository `repo` (at `location`, see [`repo_store_at`]),
/// when a state directory can be had (else said: the command goes on without it).
fn known(repo: &str, location: &str, on: OnRollback) -> Option<Known> {
    let Some(dir) = ferry_repo::known::state_dir() else {
        log::warn!(
            "no state directory (FERRY_STATE_DIR, XDG_STATE_HOME and HOME are unset): this host keeps no record of \
             {repo}, and would not notice its store going back"
        );
        return None;
    };
    match Known::open(&dir, location, on).map(|k| k.shown_as(repo)) {
        Ok(k) => Some(k),
        Err(e) => {
            log::warn!(
                "cannot keep this host's record of {repo} in {} ({e}): a store that goes back would not be \
                 noticed; set FERRY_STATE_DIR to a directory ferry can write",
                dir.display()
            );
            None
        }
    }
}

/// [`open_repository`], with what to do when the store went back.
pub fn open_repository_with(
    repo: &str,
    remote: &Remote,
    password_file: Option<&Path>,
    on: OnRollback,
) -> Result<Arc<Repository>> {
    open_repository_giving(repo, remote, password_file, on).map(|(r, _)| r)
}

/// [`open_repository_with`], also returning the passphrase given (none when it was
/// asked on the terminal or none was needed): a command that opens a second repository
/// (`ferry repo copy`'s destination) tries it there without running a password command
/// again.
pub fn open_repository_giving(
    repo: &str,
    remote: &Remote,
    password_file: Option<&Path>,
    on: OnRollback,
) -> Result<(Arc<Repository>, Option<Passphrase>)> {
    let given = passphrase(password_file)?;
    let how = Keying {
        given: given.clone().map(|p| (p, passphrase_source(password_file))),
        fallback: None,
        how: PASSPHRASE_HOW,
        sources: "--password-file, --password-command, FERRY_PASSWORD, FERRY_PASSWORD_FILE or FERRY_PASSWORD_COMMAND",
    };
    Ok((open_repository_keyed(repo, remote, how, on)?, given))
}

/// Where the passphrase of a repository comes from (see [`open_repository_keyed`]).
pub struct Keying<'a> {
    /// The passphrase given for it, and where it came from (for messages).
    pub given: Option<(Passphrase, String)>,
    /// Tried when none is given and the repository is encrypted (another repository's
    /// passphrase, as `ferry repo copy` tries the source's on the destination).
    pub fallback: Option<Passphrase>,
    /// How to give one, for the message when none is.
    pub how: &'a str,
    /// The ways to give one, for the message that refuses one given to an unencrypted
    /// repository.
    pub sources: &'a str,
}

/// [`open_repository_with`], the passphrase coming as `keying` says.
pub fn open_repository_keyed(repo: &str, remote: &Remote, keying: Keying, on: OnRollback) -> Result<Arc<Repository>> {
    let (store, location) = repo_store_at(repo, remote, false)?;
    let limit = kdf_limit()?;
    let given = keying.given.as_ref().map(|g| &g.0).or(keying.fallback.as_ref());
    let ask = || -> ferry_repo::Result<Passphrase> {
        if let Some(p) = given {
            return Ok(p.clone());
        }
        // Asked on the terminal only now: the repository is encrypted.
        match prompt(repo) {
            Ok(Some(p)) => Ok(p),
            Ok(None) => {
                Err(ferry_repo::Error::Passphrase(format!("the repository {repo} is encrypted: {}", keying.how)))
            }
            Err(e) => Err(ferry_repo::Error::Passphrase(format!("{e:#}"))),
        }
    };
    let mut r =
        Repository::open_with(store, &ask, limit).with_context(|| format!("cannot open the repository {repo}"))?;
    if let Some((_, from)) = keying.given.as_ref().filter(|_| !r.crypto().is_encrypted()) {
        bail!(
            "the repository {repo} is not encrypted, yet a passphrase was given ({from}): refused, because someone \
             who can write the store can replace an encrypted repository's config with an unencrypted one, and \
             ferry would then store your disks in plain text or restore disks of their choosing. Nothing was read or \
             written. If {repo} is meant to be unencrypted, run without a passphrase (no {})",
            keying.sources
        );
    }
    if let Some(k) = known(repo, &location, on) {
        r.set_known(k).with_context(|| format!("cannot use the repository {repo}"))?;
    }
    Ok(Arc::new(r))
}

/// Records a repository `ferry repo init` just made at `repo` (`location`: from
/// [`repo_store_at`]) as this host's.
pub fn remember_new(repo: &str, location: &str, r: &Repository) {
    if let Some(k) = known(repo, location, OnRollback::Warn) {
        k.made(r);
    }
}

/// The snapshot `name` and `id` mean in `repo`.
pub fn resolve(repo: &Repository, name: &str, id: Option<&str>) -> Result<SnapshotInfo> {
    repo.resolve(name, id).map_err(anyhow::Error::new)
}

/// The cache budget of snapshots read in part: `FERRY_REPO_CACHE` (a size, e.g. `4G`; for
/// every snapshot the process has open together, each keeping at least 16 MiB), else a
/// sixteenth of the memory the process may use, at most 1 GiB. A budget over half that
/// memory (where it is known) is cut to that half, with a warning: a restore, a hash or a
/// compare barely uses the cache, and a value exported for `ferry serve` must not fail them.
pub fn cache_bytes() -> Result<u64> {
    cache_bytes_from(std::env::var("FERRY_REPO_CACHE").ok().as_deref(), ferry_repo::max_cache_bytes(), Over::Clamp)
}

/// As [`cache_bytes`], for what keeps snapshots open to random readers and lives on the
/// cache (`ferry serve`, `ferry mount`): a budget over half the memory is refused before
/// anything is served, naming the most.
pub fn serve_cache_bytes() -> Result<u64> {
    cache_bytes_from(std::env::var("FERRY_REPO_CACHE").ok().as_deref(), ferry_repo::max_cache_bytes(), Over::Refuse)
}

/// What a `FERRY_REPO_CACHE` over the most does.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Over {
    Refuse,
    Clamp,
}

fn cache_bytes_from(var: Option<&str>, max: u64, over: Over) -> Result<u64> {
    let bytes = match var {
        None | Some("") => return Ok(ferry_repo::default_cache_bytes().min(max)),
        Some(v) => ferry_backend::parse_size(v)
            .with_context(|| format!("FERRY_REPO_CACHE={v:?}: give a size such as 512M or 4G"))?,
    };
    if bytes <= max {
        return Ok(bytes);
    }
    match over {
        Over::Refuse => bail!(
            "FERRY_REPO_CACHE={bytes} bytes is more than half the memory this process may use: give at most {max} \
             bytes ({} MiB)",
            max >> 20
        ),
        Over::Clamp => {
            log::warn!(
                "FERRY_REPO_CACHE={bytes} bytes is more than half the memory this process may use: using {max} bytes \
                 ({} MiB)",
                max >> 20
            );
            Ok(max)
        }
    }
}

/// What reading the snapshot `REPO::NAME[@ID]` does when the store went back: the latest
/// of a disk whose newest snapshot is gone is refused (it would be an older state of the
/// disk, given as the latest), a snapshot named by id is read unless this host forgot it.
pub fn snapshot_on_rollback(repo: &str, name: &str, id: Option<&str>) -> OnRollback {
    match id {
        Some(id) => OnRollback::Pinned { disk: name.into(), id: id.into() },
        None => OnRollback::Refuse {
            disk: Some(name.into()),
            back: true,
            way_out: format!(
                "to read the snapshot the store has, name it: {repo}::{name}@ID (`ferry repo list {repo} {name}` shows \
                 the ids); `ferry backup --accept-rollback` makes the store's state the one this host knows"
            ),
            damaged: Some(String::new()),
        },
    }
}

/// A snapshot `REPO::NAME[@ID]`, opened as a read-only image.
/// Its cache budget is [`cache_bytes`]'s.
pub fn open_snapshot(repo: &str, name: &str, id: Option<&str>, remote: &Remote) -> Result<Arc<SnapshotImage>> {
    open_snapshot_cached(repo, name, id, remote, cache_bytes()?)
}

/// As [`open_snapshot`], with the cache budget `cache` (`ferry serve`: [`serve_cache_bytes`]).
pub fn open_snapshot_cached(
    repo: &str,
    name: &str,
    id: Option<&str>,
    remote: &Remote,
    cache: u64,
) -> Result<Arc<SnapshotImage>> {
    let shown = crate::Location::repo_spec(repo, name, id);
    let r = open_repository_with(repo, remote, None, snapshot_on_rollback(repo, name, id))?;
    let snap = resolve(&r, name, id).with_context(|| shown.clone())?;
    SnapshotImage::open_with_cache(r, &snap, cache).with_context(|| format!("cannot open the snapshot {shown}"))
}

/// For `ferry hash`: the blkhash of a snapshot from its pages alone (see
/// [`ferry_repo::snapshot_blkhash`]: without holding its entries) when `blkhash` asks for
/// it and the repository's chunks are 64 KiB; else the snapshot opened as an image to be
/// read ([`open_snapshot`]). The repository is opened once either way.
pub fn snapshot_hash_or_image(
    repo: &str,
    name: &str,
    id: Option<&str>,
    remote: &Remote,
    blkhash: bool,
) -> Result<std::result::Result<ferry_repo::format::Digest, Arc<SnapshotImage>>> {
    let shown = crate::Location::repo_spec(repo, name, id);
    let r = open_repository_with(repo, remote, None, snapshot_on_rollback(repo, name, id))?;
    let snap = resolve(&r, name, id).with_context(|| shown.clone())?;
    if blkhash {
        if let Some(d) = ferry_repo::snapshot_blkhash(&r, &snap).with_context(|| format!("cannot hash {shown}"))? {
            return Ok(Ok(d));
        }
    }
    let img = SnapshotImage::open_with_cache(r, &snap, cache_bytes()?)
        .with_context(|| format!("cannot open the snapshot {shown}"))?;
    Ok(Err(img))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Once given a passphrase, the process leaves no core dump (it will hold the key).
    #[test]
    fn a_process_given_a_passphrase_is_not_dumpable() {
        use rustix::process::{dumpable_behavior, DumpableBehavior};
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pw");
        std::fs::write(&f, b"words\n").unwrap();
        assert!(passphrase(Some(&f)).unwrap().is_some());
        assert_eq!(dumpable_behavior().unwrap(), DumpableBehavior::NotDumpable);
    }

    #[test]
    fn a_passphrase_file_gives_its_first_line_held_zeroed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pw");
        for (content, want) in [
            (&b"correct horse\nsecond line\n"[..], &b"correct horse"[..]),
            (b"crlf\r\nx", b"crlf"),
            (b"no line end", b"no line end"),
        ] {
            std::fs::write(&f, content).unwrap();
            // The type says it: a Passphrase is zeroed when dropped.
            let p: Passphrase = first_line(&f).unwrap();
            assert_eq!(&p[..], want);
            let p: Option<Passphrase> = passphrase(Some(&f)).unwrap();
            assert_eq!(p.as_deref().map(|v| &v[..]), Some(want));
        }
        std::fs::write(&f, b"\nsecond").unwrap();
        assert!(passphrase(Some(&f)).unwrap_err().to_string().contains("empty"));
        // A big file: its first line still, read no further; no line end in 64 KiB: refused.
        let mut big = b"long file\n".to_vec();
        big.resize(1 << 20, b'x');
        std::fs::write(&f, &big).unwrap();
        assert_eq!(&first_line(&f).unwrap()[..], b"long file");
        std::fs::write(&f, vec![b'x'; 1 << 20]).unwrap();
        assert!(first_line(&f).unwrap_err().to_string().contains("no line end"));
        // A FIFO that sends one line and stays open.
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let w = {
            let fifo = fifo.clone();
            std::thread::spawn(move || {
                use std::io::Write;
                let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
                w.write_all(b"from a pipe\n").unwrap();
                std::thread::sleep(std::time::Duration::from_millis(300));
            })
        };
        assert_eq!(&first_line(&fifo).unwrap()[..], b"from a pipe");
        w.join().unwrap();
    }

    #[test]
    fn kdf_limit_from_the_environment() {
        assert_eq!(kdf_limit_from(None).unwrap(), KdfLimit::Default);
        assert_eq!(kdf_limit_from(Some("")).unwrap(), KdfLimit::Default);
        assert_eq!(kdf_limit_from(Some("default")).unwrap(), KdfLimit::Default);
        assert_eq!(kdf_limit_from(Some("off")).unwrap(), KdfLimit::Off);
        assert!(kdf_limit_from(Some("1")).unwrap_err().to_string().contains("FERRY_KDF_LIMIT"));
    }

    #[test]
    fn cache_budget_from_the_environment() {
        let max = u64::MAX;
        for over in [Over::Refuse, Over::Clamp] {
            assert_eq!(cache_bytes_from(Some("4G"), max, over).unwrap(), 4 << 30);
            assert_eq!(cache_bytes_from(Some("0"), max, over).unwrap(), 0);
            assert_eq!(cache_bytes_from(None, max, over).unwrap(), ferry_repo::default_cache_bytes());
            assert_eq!(cache_bytes_from(Some("4G"), 4 << 30, over).unwrap(), 4 << 30);
            assert_eq!(cache_bytes_from(None, 20 << 20, over).unwrap(), 20 << 20);
            let e = format!("{:#}", cache_bytes_from(Some("lots"), max, over).unwrap_err());
            assert!(e.contains("FERRY_REPO_CACHE") && e.contains("512M"), "{e}");
        }
        assert!(ferry_repo::default_cache_bytes() >= 16 << 20);
        assert!(ferry_repo::max_cache_bytes() >= ferry_repo::default_cache_bytes());
        // Serving refuses a budget over the cap before anything is allocated, naming the
        // most that may be given.
        let e = format!("{:#}", cache_bytes_from(Some("8G"), 4 << 30, Over::Refuse).unwrap_err());
        assert!(e.contains("at most 4294967296 bytes (4096 MiB)"), "{e}");
        // A restore, hash or compare with the same value exported runs, with the cap.
        assert_eq!(cache_bytes_from(Some("8G"), 4 << 30, Over::Clamp).unwrap(), 4 << 30);
    }
}
