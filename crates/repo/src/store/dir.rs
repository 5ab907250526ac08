//! A repository in a local directory: one file per object, written to a temporary file,
//! fsync'ed, renamed into place, and the directory fsync'ed.
//!
//! Every path is walked from the root's descriptor one segment at a time with
//! `O_NOFOLLOW` (directories and files alike), so no symbolic link planted inside the
//! repository leads out of it, and names are checked by [`valid_name`] first, so none
//! can name `..` or an absolute path. Directories are made 0700 and files 0600: a
//! repository's objects are the user's disks, even when they are encrypted.
use super::{invalid_name, valid_name, Store, StoreTime};
use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Temporary files start with this: never a valid object name, so [`DirStore::list`]
/// skips them.
const TEMP_PREFIX: &str = ".tmp-";
/// How deep a listing goes: a name has at most 4 segments.
const MAX_DEPTH: usize = 4;

pub struct DirStore {
    root: PathBuf,
    dir: OwnedFd,
    /// Not on a network file system ([`Store::local`]).
    local: bool,
    /// Packs opened for ranged reads lately ([`DirStore::open_pack`]).
    packs: Mutex<OpenPacks>,
}

/// Packs (`data/`) opened for ranged reads in the last [`OPEN_PACK_AGE`], at most
/// [`OPEN_PACKS`], on a local file system only: a served snapshot's misses read the same
/// packs thousands of times a second, and each open walks the path (an `openat` a
/// directory, the file's, its `fstat`, and the closes: a tenth of a miss's CPU). A pack is
/// named by the SHA-256 of its bytes, which never change; one deleted or replaced by
/// another process is read through the descriptor opened before for at most that age (its
/// bytes are still checked against their ids, as every blob's are), and one deleted or
/// written through this store not at all. Descriptors older than that are closed at the
/// next pack opened (a deleted pack's space comes back then, or when the process ends). A
/// read that fails through a kept descriptor is made again through a new one. A network
/// file system (NFS: a stale handle once another host deletes the pack) keeps none.
#[derive(Default)]
struct OpenPacks {
    files: std::collections::HashMap<String, (Arc<File>, u64, Instant)>,
    /// Opens of packs for ranged reads, for tests.
    #[cfg(test)]
    opened: usize,
}

const OPEN_PACKS: usize = 64;
const OPEN_PACK_AGE: Duration = Duration::from_secs(1);

/// The `statfs` magic numbers of file systems whose reads may cross a network: NFS, SMB
/// (CIFS and SMB2), 9p, Ceph, AFS (OpenAFS's and the kernel's), FUSE (sshfs, s3fs and the
/// like), Lustre, GPFS, BeeGFS, Coda and OrangeFS.
const NETWORK_FS: [u32; 13] = [
    0x6969,
    0xFF53_4D42,
    0xFE53_4D42,
    0x0102_1997,
    0x00C3_6400,
    0x5346_414F,
    0x6B41_4653,
    0x6573_5546,
    0x0BD0_0BD0,
    0x4750_4653,
    0x1983_0326,
    0x7375_7245,
    0x2003_0528,
];

/// Whether the file system of `dir` may cross a network: one of [`NETWORK_FS`], or one
/// whose kind cannot be told ([`Store::local`] is false unless the store is known local).
fn on_network_fs(dir: BorrowedFd<'_>) -> bool {
    // The magic number is 32 bits wide, whatever the width of the field holding it.
    network_fs_type(rustix::fs::fstatfs(dir).ok().map(|st| st.f_type as u64 as u32))
}

/// Whether a file system of `statfs` magic number `f_type` (`None`: unknown) counts as
/// one that may cross a network.
fn network_fs_type(f_type: Option<u32>) -> bool {
    f_type.is_none_or(|t| NETWORK_FS.contains(&t))
}

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// `io::Error` from rustix's, with what was being done and to what, its kind kept.
fn ctx(e: impl Into<io::Error>, what: impl std::fmt::Display) -> io::Error {
    let e: io::Error = e.into();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl DirStore {
    /// A store at `root`, which must exist (see [`DirStore::create`]).
    pub fn open(root: &Path) -> io::Result<DirStore> {
        let dir = rustix::fs::open(root, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| ctx(e, format!("cannot open the repository directory {}", root.display())))?;
        let local = !on_network_fs(dir.as_fd());
        Ok(DirStore { root: root.to_path_buf(), dir, local, packs: Mutex::default() })
    }

    /// Makes `root` (and its parents), which must be absent or an empty directory.
    pub fn create(root: &Path) -> io::Result<DirStore> {
        match std::fs::read_dir(root) {
            Ok(mut entries) => {
                if entries.next().is_some() {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!("{} is not empty: a repository is made in a new or empty directory", root.display()),
                    ));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                use std::os::unix::fs::DirBuilderExt;
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(root)
                    .map_err(|e| ctx(e, format!("cannot make the directory {}", root.display())))?;
            }
            Err(e) => return Err(ctx(e, format!("{} is not a directory to make a repository in", root.display()))),
        }
        DirStore::open(root)
    }

    fn shown(&self, name: &str) -> String {
        format!("{}/{name}", self.root.display())
    }

    /// The directory holding object `name` (checked here) and the object's file name:
    /// walked from the root without following links, its missing directories made (0700,
    /// each made one fsync'ed into its parent) when `create`.
    fn parent<'n>(&self, name: &'n str, create: bool) -> io::Result<(Option<OwnedFd>, &'n str)> {
        if !valid_name(name) {
            return Err(invalid_name(name));
        }
        let Some((dirs, file)) = name.rsplit_once('/') else { return Ok((None, name)) };
        let mut cur: Option<OwnedFd> = None;
        let mut walked = String::new();
        for seg in dirs.split('/') {
            let at = cur.as_ref().map_or(self.dir.as_fd(), |f| f.as_fd());
            if !walked.is_empty() {
                walked.push('/');
            }
            walked.push_str(seg);
            let next = match rustix::fs::openat(at, seg, dir_flags(), Mode::empty()) {
                Err(rustix::io::Errno::NOENT) if create => {
                    match rustix::fs::mkdirat(at, seg, Mode::from_raw_mode(0o700)) {
                        Ok(()) => {
                            rustix::fs::fsync(at).map_err(|e| ctx(e, format!("fsync of {}", self.root.display())))?
                        }
                        Err(rustix::io::Errno::EXIST) => {}
                        Err(e) => return Err(ctx(e, format!("cannot make the directory {}", self.shown(&walked)))),
                    }
                    rustix::fs::openat(at, seg, dir_flags(), Mode::empty())
                }
                other => other,
            };
            cur = Some(next.map_err(|e| ctx(e, self.shown(&walked)))?);
        }
        Ok((cur, file))
    }

    /// Opens object `name` for reading (not following a link).
    fn open_object(&self, name: &str) -> io::Result<(File, u64)> {
        let (dir, file) = self.parent(name, false)?;
        let at = dir.as_ref().map_or(self.dir.as_fd(), |f| f.as_fd());
        // NONBLOCK: a FIFO planted under an object's name would block the open until a
        // writer came; it is refused below instead (no effect on a regular file's reads).
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
        let fd = rustix::fs::openat(at, file, flags, Mode::empty()).map_err(|e| ctx(e, self.shown(name)))?;
        let f = File::from(fd);
        let meta = f.metadata().map_err(|e| ctx(e, self.shown(name)))?;
        if !meta.is_file() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{} is not a file", self.shown(name))));
        }
        Ok((f, meta.len()))
    }

    /// Pack `name` open for reading, with its length, and whether the descriptor is one
    /// kept from an earlier read (opened in the last [`OPEN_PACK_AGE`]: [`OpenPacks`]).
    fn open_pack(&self, name: &str) -> io::Result<(Arc<File>, u64, bool)> {
        if !self.local {
            let (f, len) = self.open_object(name)?;
            return Ok((Arc::new(f), len, false));
        }
        let now = Instant::now();
        let fresh = |at: &Instant| now.saturating_duration_since(*at) < OPEN_PACK_AGE;
        if let Some((f, len, _)) =
            self.packs.lock().unwrap_or_else(|e| e.into_inner()).files.get(name).filter(|(_, _, at)| fresh(at))
        {
            return Ok((f.clone(), *len, true));
        }
        let (f, len) = match self.open_object(name) {
            // Out of descriptors: those kept are given back, and the open tried again.
            Err(e)
                if [rustix::io::Errno::MFILE, rustix::io::Errno::NFILE]
                    .iter()
                    .any(|n| e.raw_os_error() == Some(n.raw_os_error())) =>
            {
                self.packs.lock().unwrap_or_else(|e| e.into_inner()).files.clear();
                self.open_object(name)?
            }
            r => r?,
        };
        let f = Arc::new(f);
        let mut p = self.packs.lock().unwrap_or_else(|e| e.into_inner());
        #[cfg(test)]
        {
            p.opened += 1;
        }
        p.files.retain(|_, (_, _, at)| fresh(at));
        {
            while p.files.len() >= OPEN_PACKS {
                let Some(oldest) = p.files.iter().min_by_key(|(_, (_, _, at))| *at).map(|(n, _)| n.clone()) else {
                    break;
                };
                p.files.remove(&oldest);
            }
        }
        p.files.insert(name.to_string(), (f.clone(), len, now));
        Ok((f, len, false))
    }

    /// Bytes `offset..offset + len` of object `name`, open as `f`, `size` bytes long.
    fn range_of(&self, name: &str, f: &File, size: u64, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let end = offset.checked_add(len).filter(|&e| e <= size).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{} ends at byte {size}, before byte {}", self.shown(name), offset.saturating_add(len)),
            )
        })?;
        let mut v = vec![0u8; (end - offset) as usize];
        f.read_exact_at(&mut v, offset).map_err(|e| ctx(e, format!("{} (bytes {offset}..{end})", self.shown(name))))?;
        Ok(v)
    }

    /// Closes the descriptor kept for pack `name`, if any: it is written or deleted.
    fn forget_pack(&self, name: &str) {
        self.packs.lock().unwrap_or_else(|e| e.into_inner()).files.remove(name);
    }

    /// Each entry of the directory `dir` (whose path from the root is `rel`, ending in `/`
    /// unless empty) whose name `wanted` takes, never `.` or `..`: its name, its path from
    /// the root, and what `statat` says of it without following links. An entry removed
    /// since it was listed is skipped.
    fn each_entry(
        &self,
        dir: BorrowedFd,
        rel: &str,
        wanted: impl Fn(&str) -> bool,
        mut f: impl FnMut(&str, String, &rustix::fs::Stat) -> io::Result<()>,
    ) -> io::Result<()> {
        let shown = || self.shown(rel.trim_end_matches('/'));
        let mut entries = rustix::fs::Dir::read_from(dir).map_err(|e| ctx(e, shown()))?;
        while let Some(entry) = entries.read() {
            let entry = entry.map_err(|e| ctx(e, shown()))?;
            let Ok(seg) = entry.file_name().to_str() else { continue };
            if seg == "." || seg == ".." || !wanted(seg) {
                continue;
            }
            let path = format!("{rel}{seg}");
            let st = match rustix::fs::statat(dir, seg, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                // Deleted since it was listed.
                Err(rustix::io::Errno::NOENT) => continue,
                Err(e) => return Err(ctx(e, self.shown(&path))),
            };
            f(seg, path, &st)?;
        }
        Ok(())
    }

    /// The subdirectory `seg` of `dir` (`path` from the root), or `None` when it was
    /// removed since it was listed.
    fn open_subdir(&self, dir: BorrowedFd, seg: &str, path: &str) -> io::Result<Option<OwnedFd>> {
        match rustix::fs::openat(dir, seg, dir_flags(), Mode::empty()) {
            Ok(fd) => Ok(Some(fd)),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(ctx(e, self.shown(path))),
        }
    }

    /// Every object under the directory `dir` (whose path from the root is `rel`, ending
    /// in `/` unless empty) whose name starts with `prefix`.
    fn walk(
        &self,
        dir: BorrowedFd,
        rel: &str,
        prefix: &str,
        depth: usize,
        out: &mut Vec<(String, u64)>,
    ) -> io::Result<()> {
        // Not temporary files, nor anything else that is not an object's.
        let object_like = |seg: &str| seg.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        self.each_entry(dir, rel, object_like, |seg, path, st| {
            match FileType::from_raw_mode(st.st_mode) {
                FileType::RegularFile if path.starts_with(prefix) && valid_name(&path) => {
                    out.push((path, st.st_size as u64))
                }
                FileType::Directory if depth + 1 < MAX_DEPTH => {
                    let sub = format!("{path}/");
                    if sub.starts_with(prefix) || prefix.starts_with(&sub) {
                        if let Some(fd) = self.open_subdir(dir, seg, &path)? {
                            self.walk(fd.as_fd(), &sub, prefix, depth + 1, out)?;
                        }
                    }
                }
                // Links, devices, and directories deeper than any name.
                _ => {}
            }
            Ok(())
        })
    }

    /// An object's bytes (at most `limit`) and its file's modification time.
    fn read_object(&self, name: &str, limit: u64) -> io::Result<(Vec<u8>, Option<std::time::SystemTime>)> {
        let (f, len) = self.open_object(name)?;
        let modified = f.metadata().and_then(|m| m.modified()).ok();
        let too_large =
            || io::Error::new(io::ErrorKind::InvalidData, format!("{} is larger than {limit} bytes", self.shown(name)));
        if len > limit {
            return Err(too_large());
        }
        let mut v = Vec::with_capacity(len as usize);
        // A file that grew since its length was read still yields at most `limit` bytes.
        f.take(limit.saturating_add(1)).read_to_end(&mut v).map_err(|e| ctx(e, self.shown(name)))?;
        if v.len() as u64 > limit {
            return Err(too_large());
        }
        Ok((v, modified))
    }

    /// The file system's clock now, as it stamps a new file in the directory of `name`
    /// (a temporary file, removed at once; one a crash leaves is never listed).
    fn clock(&self, name: &str) -> io::Result<std::time::SystemTime> {
        let (dir, _) = self.parent(name, false)?;
        let at = dir.as_ref().map_or(self.dir.as_fd(), |f| f.as_fd());
        let (f, temp) = create_temp(at)?;
        // Written, so that a file system that stamps times lazily stamps this one.
        let stamped = (&f).write_all(b"clock").and_then(|()| f.metadata()).and_then(|m| m.modified());
        let _ = rustix::fs::unlinkat(at, temp.as_str(), AtFlags::empty());
        stamped
    }
}

/// A new temporary file (mode 0600, never an existing name or a link) in the directory
/// `at`, and its name (listings never show it).
fn create_temp(at: BorrowedFd<'_>) -> io::Result<(File, String)> {
    let temp = format!("{TEMP_PREFIX}{}", crate::format::hex(&crate::crypto::random::<8>()));
    let fd = rustix::fs::openat(
        at,
        temp.as_str(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    Ok((File::from(fd), temp))
}

impl Store for DirStore {
    fn describe(&self) -> String {
        self.root.display().to_string()
    }

    /// A directory on this machine's disks; not one on a network file system.
    fn local(&self) -> bool {
        self.local
    }

    fn get(&self, name: &str, limit: u64) -> io::Result<Vec<u8>> {
        self.read_object(name, limit).map(|(v, _)| v)
    }

    /// The file's modification time, by the clock of whoever stamps the file system's
    /// times (this machine's for a local file system, an NFS server's for its files), and
    /// that clock now: the modification time of a temporary file created beside it just
    /// after reading it, then removed.
    fn get_timed(&self, name: &str, limit: u64) -> io::Result<(Vec<u8>, Option<StoreTime>)> {
        let (v, modified) = self.read_object(name, limit)?;
        let now = modified.and_then(|_| self.clock(name).ok());
        Ok((v, modified.map(|modified| StoreTime { modified, now })))
    }

    fn get_range(&self, name: &str, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        if !name.starts_with("data/") {
            let (f, size) = self.open_object(name)?;
            return self.range_of(name, &f, size, offset, len);
        }
        let (f, size, kept) = self.open_pack(name)?;
        match self.range_of(name, &f, size, offset, len) {
            // Through a descriptor kept from before: again through a new one.
            Err(_) if kept => {
                self.forget_pack(name);
                let (f, size, _) = self.open_pack(name)?;
                self.range_of(name, &f, size, offset, len)
            }
            r => r,
        }
    }

    fn len(&self, name: &str) -> io::Result<u64> {
        let (dir, file) = self.parent(name, false)?;
        let at = dir.as_ref().map_or(self.dir.as_fd(), |f| f.as_fd());
        let st = rustix::fs::statat(at, file, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| ctx(e, self.shown(name)))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{} is not a file", self.shown(name))));
        }
        Ok(st.st_size as u64)
    }

    fn put(&self, name: &str, data: &[u8]) -> io::Result<()> {
        self.forget_pack(name);
        let (dir, file) = self.parent(name, true)?;
        let at = dir.as_ref().map_or(self.dir.as_fd(), |f| f.as_fd());
        let (mut f, temp) =
            create_temp(at).map_err(|e| ctx(e, format!("cannot create a temporary file for {}", self.shown(name))))?;
        let written = f
            .write_all(data)
            .and_then(|()| f.sync_all())
            .and_then(|()| rustix::fs::renameat(at, temp.as_str(), at, file).map_err(io::Error::from));
        // Again once renamed: a read beside this one may have kept the old file meanwhile.
        self.forget_pack(name);
        if let Err(e) = written {
            let _ = rustix::fs::unlinkat(at, temp.as_str(), AtFlags::empty());
            return Err(ctx(e, format!("cannot write {}", self.shown(name))));
        }
        rustix::fs::fsync(at).map_err(|e| ctx(e, format!("fsync of the directory of {}", self.shown(name))))
    }

    fn delete(&self, name: &str) -> io::Result<()> {
        self.forget_pack(name);
        let (dir, file) = match self.parent(name, false) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            other => other?,
        };
        let at = dir.as_ref().map_or(self.dir.as_fd(), |f| f.as_fd());
        let unlinked = rustix::fs::unlinkat(at, file, AtFlags::empty());
        // Again once unlinked: a read beside this one may have kept the file meanwhile.
        self.forget_pack(name);
        match unlinked {
            Ok(()) => {}
            Err(rustix::io::Errno::NOENT) => return Ok(()),
            Err(e) => return Err(ctx(e, format!("cannot delete {}", self.shown(name)))),
        }
        // Deletions are made durable in the order they are done: gc deletes index
        // objects before the packs they name.
        rustix::fs::fsync(at).map_err(|e| ctx(e, format!("fsync of the directory of {}", self.shown(name))))
    }

    fn list(&self, prefix: &str) -> io::Result<Vec<(String, u64)>> {
        let mut out = Vec::new();
        // Start in the deepest directory the prefix names whole.
        let (dirs, _) = prefix.rsplit_once('/').unwrap_or(("", prefix));
        let mut cur: Option<OwnedFd> = None;
        let mut rel = String::new();
        if !dirs.is_empty() {
            for seg in dirs.split('/') {
                if seg.is_empty() || !seg.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()) {
                    return Ok(out);
                }
                let at = cur.as_ref().map_or(self.dir.as_fd(), |f| f.as_fd());
                rel.push_str(seg);
                rel.push('/');
                match rustix::fs::openat(at, seg, dir_flags(), Mode::empty()) {
                    Ok(fd) => cur = Some(fd),
                    Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR) => return Ok(out),
                    Err(e) => return Err(ctx(e, self.shown(rel.trim_end_matches('/')))),
                }
            }
        }
        let depth = rel.matches('/').count();
        if depth >= MAX_DEPTH {
            return Ok(out);
        }
        let at = cur.as_ref().map_or(self.dir.as_fd(), |f| f.as_fd());
        self.walk(at, &rel, prefix, depth, &mut out)?;
        Ok(out)
    }

    fn remove_partial(&self, prefix: &str, min_age: std::time::Duration) -> io::Result<(u64, u64)> {
        let mut removed = (0, 0);
        let before = std::time::SystemTime::now()
            .checked_sub(min_age)
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(i64::MIN, |d| d.as_secs() as i64);
        if prefix.is_empty() {
            // The top level only (`config` is replaced through a temporary file there); its
            // folders are each asked for by name.
            self.remove_temps(self.dir.as_fd(), "", MAX_DEPTH - 1, before, &mut removed)?;
            return Ok(removed);
        }
        let top = prefix.trim_end_matches('/');
        if top.contains('/') || !valid_name(top) {
            return Err(invalid_name(prefix));
        }
        let fd = match rustix::fs::openat(self.dir.as_fd(), top, dir_flags(), Mode::empty()) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok((0, 0)),
            Err(e) => return Err(ctx(e, self.shown(top))),
        };
        self.remove_temps(fd.as_fd(), &format!("{top}/"), 1, before, &mut removed)?;
        Ok(removed)
    }
}

/// A file's modification time in seconds since the epoch (`st_mtime` is narrower on some
/// targets).
#[allow(clippy::unnecessary_cast)]
fn mtime_secs(st: &rustix::fs::Stat) -> i64 {
    st.st_mtime as i64
}

impl DirStore {
    /// Removes the temporary files under `dir` (`rel`): left by a writer killed between
    /// creating one and renaming it into place.
    /// Only those last modified at or before `before` (seconds since the epoch).
    fn remove_temps(
        &self,
        dir: BorrowedFd,
        rel: &str,
        depth: usize,
        before: i64,
        removed: &mut (u64, u64),
    ) -> io::Result<()> {
        let mut found = false;
        self.each_entry(
            dir,
            rel,
            |_| true,
            |seg, path, st| {
                match FileType::from_raw_mode(st.st_mode) {
                    FileType::RegularFile if seg.starts_with(TEMP_PREFIX) && mtime_secs(st) <= before => {
                        match rustix::fs::unlinkat(dir, seg, AtFlags::empty()) {
                            Ok(()) | Err(rustix::io::Errno::NOENT) => {}
                            Err(e) => return Err(ctx(e, format!("cannot delete {}", self.shown(&path)))),
                        }
                        removed.0 += 1;
                        removed.1 += st.st_size as u64;
                        found = true;
                    }
                    FileType::Directory if depth + 1 < MAX_DEPTH && valid_name(&path) => {
                        if let Some(fd) = self.open_subdir(dir, seg, &path)? {
                            self.remove_temps(fd.as_fd(), &format!("{path}/"), depth + 1, before, removed)?;
                        }
                    }
                    _ => {}
                }
                Ok(())
            },
        )?;
        if found {
            rustix::fs::fsync(dir)
                .map_err(|e| ctx(e, format!("fsync of {}", self.shown(rel.trim_end_matches('/')))))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, MetadataExt};

    fn store() -> (tempfile::TempDir, DirStore) {
        let t = tempfile::tempdir().unwrap();
        let s = DirStore::create(&t.path().join("repo")).unwrap();
        (t, s)
    }

    fn sorted(mut v: Vec<(String, u64)>) -> Vec<(String, u64)> {
        v.sort();
        v
    }

    /// Network and cluster file systems are told by their `statfs` magic numbers, and a
    /// file system whose kind cannot be told counts as one (not local); disks' do not.
    #[test]
    fn network_file_systems_are_told_by_their_magic_numbers() {
        let lustre_gpfs_beegfs_afs_coda_orangefs =
            [0x0BD0_0BD0, 0x4750_4653, 0x1983_0326, 0x6B41_4653, 0x7375_7245, 0x2003_0528];
        for t in [0x6969, 0xFF53_4D42, 0x6573_5546].into_iter().chain(lustre_gpfs_beegfs_afs_coda_orangefs) {
            assert!(network_fs_type(Some(t)), "{t:#x}");
        }
        assert!(network_fs_type(None), "a file system of unknown kind counts as not local");
        // ext4, XFS, Btrfs, tmpfs, ZFS.
        for t in [0xEF53, 0x5846_5342, 0x9123_683E, 0x0102_1994, 0x2FC1_2FC1] {
            assert!(!network_fs_type(Some(t)), "{t:#x}");
        }
    }

    /// A lock's age is told by the file system's clock alone: its modification time and
    /// the time the file system stamps on a new file now; the probe leaves nothing behind.
    #[test]
    fn timed_reads_give_the_file_systems_clock() {
        let (t, s) = store();
        s.put("locks/00ff", b"lock").unwrap();
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
        let f = std::fs::File::options().write(true).open(t.path().join("repo/locks/00ff")).unwrap();
        f.set_modified(old).unwrap();
        let (v, at) = s.get_timed("locks/00ff", 100).unwrap();
        assert_eq!(v, b"lock");
        let at = at.unwrap();
        assert_eq!(at.modified, old);
        let now = at.now.expect("the directory's clock");
        let age = now.duration_since(at.modified).unwrap().as_secs();
        assert!((7190..7300).contains(&age), "{age}");
        assert_eq!(s.list("locks/").unwrap().len(), 1);
        assert_eq!(std::fs::read_dir(t.path().join("repo/locks")).unwrap().count(), 1);
    }

    /// A pack read again and again is opened once (its descriptor kept), and again once its
    /// descriptor is older than OPEN_PACK_AGE: a pack replaced by another process is read
    /// anew by then. One deleted or written through the store is never read through an old
    /// descriptor; other objects (index objects, manifests) are opened for each read.
    #[test]
    fn packs_read_often_are_opened_once_a_while() {
        let (t, s) = store();
        let opened = || s.packs.lock().unwrap().opened;
        let pack = "data/ab/ab01";
        s.put(pack, b"0123456789").unwrap();
        for _ in 0..50 {
            assert_eq!(s.get_range(pack, 2, 3).unwrap(), b"234");
        }
        if !s.local {
            // TMPDIR on a network file system: nothing kept, each read opens the pack.
            assert_eq!(opened(), 0);
            assert!(s.packs.lock().unwrap().files.is_empty());
            return;
        }
        assert_eq!(opened(), 1);
        // Replaced behind the store's back (same name: only a damaged copy's repair would).
        let path = t.path().join("repo/data/ab/ab01");
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"abcdefghij").unwrap();
        std::thread::sleep(OPEN_PACK_AGE + Duration::from_millis(50));
        assert_eq!(s.get_range(pack, 2, 3).unwrap(), b"cde");
        assert_eq!(opened(), 2);
        // Deleted through the store: gone at once.
        s.delete(pack).unwrap();
        assert_eq!(s.get_range(pack, 2, 3).unwrap_err().kind(), io::ErrorKind::NotFound);
        // Written through the store: read anew at once.
        s.put(pack, b"ABCDEFGHIJ").unwrap();
        assert_eq!(s.get_range(pack, 2, 3).unwrap(), b"CDE");
        // Not a pack: opened each time.
        s.put("index/00aa", b"index").unwrap();
        let before = opened();
        s.get_range("index/00aa", 0, 5).unwrap();
        std::fs::write(t.path().join("repo/index/00aa"), b"INDEX").unwrap();
        assert_eq!(s.get_range("index/00aa", 0, 5).unwrap(), b"INDEX");
        assert_eq!(opened(), before);
        // At most OPEN_PACKS kept.
        for i in 0..OPEN_PACKS + 10 {
            let n = format!("data/cd/cd{i:04}");
            s.put(&n, b"x").unwrap();
            s.get_range(&n, 0, 1).unwrap();
        }
        assert!(s.packs.lock().unwrap().files.len() <= OPEN_PACKS);
        // Those older than OPEN_PACK_AGE are closed at the next pack opened.
        std::thread::sleep(OPEN_PACK_AGE + Duration::from_millis(50));
        s.get_range(pack, 0, 1).unwrap();
        assert_eq!(s.packs.lock().unwrap().files.len(), 1);
    }

    #[test]
    fn objects_are_written_read_listed_and_deleted() {
        let (t, s) = store();
        let root = t.path().join("repo");
        assert_eq!(std::fs::metadata(&root).unwrap().mode() & 0o777, 0o700);
        s.put("config", b"{}").unwrap();
        s.put("data/ab/ab12", b"pack one").unwrap();
        s.put("data/cd/cd34", b"pack two!").unwrap();
        s.put("snapshots/ee", b"m").unwrap();
        assert_eq!(s.get("data/ab/ab12", 100).unwrap(), b"pack one");
        assert_eq!(s.len("data/cd/cd34").unwrap(), 9);
        assert_eq!(s.get_range("data/cd/cd34", 5, 4).unwrap(), b"two!");
        assert_eq!(s.get_range("data/cd/cd34", 9, 0).unwrap(), b"");
        // Modes: 0700 directories, 0600 files.
        assert_eq!(std::fs::metadata(root.join("data/ab")).unwrap().mode() & 0o777, 0o700);
        assert_eq!(std::fs::metadata(root.join("data/ab/ab12")).unwrap().mode() & 0o777, 0o600);

        assert_eq!(sorted(s.list("data/").unwrap()), [("data/ab/ab12".to_string(), 8), ("data/cd/cd34".into(), 9)]);
        assert_eq!(s.list("data/a").unwrap(), [("data/ab/ab12".to_string(), 8)]);
        assert_eq!(s.list("data/cd/").unwrap(), [("data/cd/cd34".to_string(), 9)]);
        assert_eq!(s.list("snapshots/").unwrap(), [("snapshots/ee".to_string(), 1)]);
        assert_eq!(s.list("locks/").unwrap(), []);
        assert_eq!(s.list("config").unwrap(), [("config".to_string(), 2)]);
        assert_eq!(s.list("").unwrap().len(), 4);
        assert_eq!(s.list("../").unwrap(), []);

        // A rewrite replaces the object whole; no temporary file stays behind.
        s.put("config", b"{\"v\":2}").unwrap();
        assert_eq!(s.get("config", 100).unwrap(), b"{\"v\":2}");
        let names: Vec<_> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(names.iter().all(|n| !n.to_string_lossy().starts_with(TEMP_PREFIX)), "{names:?}");

        s.delete("data/ab/ab12").unwrap();
        s.delete("data/ab/ab12").unwrap();
        s.delete("nothing/here").unwrap();
        assert_eq!(s.list("data/").unwrap(), [("data/cd/cd34".to_string(), 9)]);
        assert_eq!(s.describe(), root.display().to_string());
    }

    #[test]
    fn missing_objects_are_not_found_and_limits_hold() {
        let (_t, s) = store();
        for r in [s.get("config", 10).map(drop), s.get_range("a/b", 0, 1).map(drop), s.len("snapshots/x").map(drop)] {
            assert_eq!(r.unwrap_err().kind(), io::ErrorKind::NotFound);
        }
        s.put("index/aa", &[7; 100]).unwrap();
        let e = s.get("index/aa", 99).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("index/aa") && e.to_string().contains("99"), "{e}");
        assert_eq!(s.get("index/aa", 100).unwrap().len(), 100);
        for (o, l) in [(0, 101), (100, 1), (101, 0), (u64::MAX, 2)] {
            assert_eq!(s.get_range("index/aa", o, l).unwrap_err().kind(), io::ErrorKind::UnexpectedEof, "{o} {l}");
        }
        // A directory where an object is expected is not one.
        assert_eq!(s.get("index", 100).unwrap_err().kind(), io::ErrorKind::InvalidData);
        assert!(s.len("index").is_err());
    }

    #[test]
    fn only_object_names_are_accepted() {
        let (t, s) = store();
        for bad in ["", "/etc/passwd", "../x", "a/../b", "a//b", "A", "a.b", ".tmp-1", "a/", "a/b/c/d/e", "x\0"] {
            assert_eq!(s.put(bad, b"x").unwrap_err().kind(), io::ErrorKind::InvalidInput, "{bad:?}");
            assert_eq!(s.get(bad, 10).unwrap_err().kind(), io::ErrorKind::InvalidInput, "{bad:?}");
            assert!(s.get_range(bad, 0, 1).is_err() && s.len(bad).is_err() && s.delete(bad).is_err());
        }
        assert!(!t.path().join("x").exists());
    }

    #[test]
    fn a_fifo_under_an_object_name_is_refused_not_waited_on() {
        let (t, s) = store();
        let fifo = t.path().join("repo").join("config");
        rustix::fs::mknodat(rustix::fs::CWD, &fifo, rustix::fs::FileType::Fifo, Mode::from_raw_mode(0o600), 0).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(s.get("config", 100).map_err(|e| e.kind()));
        });
        let got = rx.recv_timeout(std::time::Duration::from_secs(5)).expect("reading a FIFO object blocked");
        assert_eq!(got, Err(io::ErrorKind::InvalidData));
    }

    #[test]
    fn links_never_lead_out_of_the_repository() {
        let (t, s) = store();
        let root = t.path().join("repo");
        let outside = t.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("abc"), b"secret").unwrap();
        symlink(&outside, root.join("data")).unwrap();
        symlink(outside.join("abc"), root.join("config")).unwrap();
        assert!(s.get("data/abc", 100).is_err());
        assert!(s.get_range("data/abc", 0, 1).is_err());
        assert!(s.len("data/abc").is_err());
        assert!(s.get("config", 100).is_err());
        assert!(s.len("config").is_err());
        assert!(s.put("data/new", b"x").is_err());
        assert!(s.delete("data/abc").is_err());
        assert_eq!(s.list("data/").unwrap(), []);
        assert_eq!(s.list("").unwrap(), []);
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
        assert_eq!(std::fs::read(outside.join("abc")).unwrap(), b"secret");
        // Putting "config" replaces the link itself, not its target.
        s.put("config", b"mine").unwrap();
        assert_eq!(std::fs::read(outside.join("abc")).unwrap(), b"secret");
        assert_eq!(s.get("config", 10).unwrap(), b"mine");
    }

    #[test]
    fn listings_skip_temporary_and_foreign_files() {
        let (t, s) = store();
        let root = t.path().join("repo");
        s.put("locks/aa", b"l").unwrap();
        std::fs::write(root.join("locks/.tmp-0123"), b"half").unwrap();
        std::fs::write(root.join("locks/README.txt"), b"x").unwrap();
        std::fs::create_dir_all(root.join("locks/a/b/c/d")).unwrap();
        std::fs::write(root.join("locks/a/b/c/d/e"), b"too deep").unwrap();
        assert_eq!(s.list("locks/").unwrap(), [("locks/aa".to_string(), 1)]);
    }

    #[test]
    fn remove_partial_removes_temporary_files_only() {
        let (t, s) = store();
        let root = t.path().join("repo");
        s.put("data/ab/ab12", b"pack").unwrap();
        s.put("index/cd", b"index").unwrap();
        s.put("locks/ee", b"lock").unwrap();
        std::fs::write(root.join("data/ab/.tmp-0123"), b"half a pack").unwrap();
        std::fs::write(root.join("index/.tmp-4567"), b"half").unwrap();
        std::fs::write(root.join("locks/.tmp-89ab"), b"being written").unwrap();
        std::fs::write(root.join("data/ab/README"), b"foreign").unwrap();
        // A file written just now may be a running writer's: kept when an age is asked.
        let hour = std::time::Duration::from_secs(3600);
        assert_eq!(s.remove_partial("data/", hour).unwrap(), (0, 0));
        assert!(root.join("data/ab/.tmp-0123").exists());
        let zero = std::time::Duration::ZERO;
        assert_eq!(s.remove_partial("data/", zero).unwrap(), (1, 11));
        assert_eq!(s.remove_partial("index/", zero).unwrap(), (1, 4));
        assert_eq!(s.remove_partial("snapshots/", zero).unwrap(), (0, 0));
        assert!(s.remove_partial("../", zero).is_err());
        // The top level: a killed `repo migrate`'s half-written config goes, nothing in the
        // folders below (each is asked for by name).
        std::fs::write(root.join(".tmp-cdef"), b"half a config").unwrap();
        std::fs::write(root.join("locks/.tmp-4321"), b"being written").unwrap();
        assert_eq!(s.remove_partial("", zero).unwrap(), (1, 13));
        assert!(!root.join(".tmp-cdef").exists() && root.join("locks/.tmp-4321").exists());
        assert!(!root.join("data/ab/.tmp-0123").exists() && !root.join("index/.tmp-4567").exists());
        // Objects, foreign files and other prefixes are left alone.
        assert!(root.join("locks/.tmp-89ab").exists() && root.join("data/ab/README").exists());
        assert_eq!(s.list("data/").unwrap(), [("data/ab/ab12".to_string(), 4)]);
        assert_eq!(s.get("index/cd", 100).unwrap(), b"index");
    }

    #[test]
    fn create_wants_a_new_or_empty_directory() {
        let t = tempfile::tempdir().unwrap();
        let deep = t.path().join("a/b/repo");
        DirStore::create(&deep).unwrap().put("config", b"x").unwrap();
        let e = DirStore::create(&deep).err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert!(e.to_string().contains("not empty"), "{e}");
        let empty = t.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        DirStore::create(&empty).unwrap();
        std::fs::write(t.path().join("file"), b"").unwrap();
        assert!(DirStore::create(&t.path().join("file")).is_err());
        assert_eq!(DirStore::open(&t.path().join("nothing")).err().unwrap().kind(), io::ErrorKind::NotFound);
        assert_eq!(DirStore::open(&deep).unwrap().get("config", 10).unwrap(), b"x");
    }

    #[test]
    fn threads_write_side_by_side() {
        let (_t, s) = store();
        std::thread::scope(|sc| {
            for i in 0..8u8 {
                let s = &s;
                sc.spawn(move || {
                    for j in 0..20u8 {
                        s.put(&format!("data/{i:02x}/{j:02x}"), &[i, j]).unwrap();
                    }
                });
            }
        });
        assert_eq!(s.list("data/").unwrap().len(), 160);
        assert_eq!(s.get("data/07/13", 2).unwrap(), [7, 0x13]);
    }
}
