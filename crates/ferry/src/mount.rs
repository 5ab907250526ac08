//! `ferry mount REPO::NAME[@ID] DIR`: a snapshot as a read-only FUSE file system, for
//! getting files back without restoring the disk: `disk.raw` (the whole disk), one file
//! per partition of its MBR or GPT (`part1`, `part2`, ..., numbered as Linux numbers
//! them) and `partitions.txt` (each partition's range, type and GPT name).
//!
//! Every read goes through the snapshot reader `ferry copy REPO::...` uses
//! (`SnapshotImage`): verified bytes only; a chunk that cannot be read (damaged, missing)
//! is EIO to the reader and an error line here, never other bytes. The file system runs in
//! the foreground until SIGINT, SIGTERM or SIGHUP unmounts it (or `fusermount3 -u DIR`).
//! FUSE comes from `fuser` with its default features off: the kernel's protocol spoken on
//! /dev/fuse, the mount made by `fusermount3` (or `fusermount`), no libfuse.

use anyhow::{bail, Context, Result};
use clap::Args;
use ferry_backend::Backend;
use ferry_open::partitions::{self, Partition, Scheme, Table};
use ferry_open::Location;
use ferry_repo::SnapshotImage;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner, MountOption,
    OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyXattr,
    Request,
};
use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

#[derive(Args, Debug)]
pub struct MountArgs {
    /// The snapshot, REPO::NAME (the disk's latest) or REPO::NAME@ID.
    #[arg(value_name = "REPO::NAME[@ID]")]
    snapshot: String,
    /// An empty directory to mount it on.
    dir: PathBuf,
    /// Let other users (root among them) read the files: FUSE's allow_other, which
    /// /etc/fuse.conf must allow (`user_allow_other`) for a user who is not root.
    #[arg(short = 'o', value_name = "allow_other", value_parser = ["allow_other"])]
    options: Vec<String>,
    /// Run in the background (as `borg mount` without --foreground): return 0 once the
    /// file system is mounted, or fail with the error and exit status of a mount that
    /// could not be made. Until then it may ask for the passphrase on the terminal; its
    /// later messages (its last error among them) go to syslog (or --log FILE);
    /// `fusermount3 -u DIR` (root: `umount DIR`) or SIGTERM unmounts it and ends it.
    #[arg(short = 'd', long)]
    daemon: bool,
    /// With --daemon: append the messages of the background process to FILE (each with
    /// its time) instead of sending them to syslog.
    #[arg(long, value_name = "FILE", requires = "daemon")]
    log: Option<PathBuf>,
    #[command(flatten)]
    password: crate::password_args::PasswordArgs,
    #[command(flatten)]
    remote: crate::remote_args::RemoteArgs,
}

const ROOT: u64 = 1;
const DISK: u64 = 2;
const LIST: u64 = 3;
/// Partition N is inode `FIRST_PART + N`.
const FIRST_PART: u64 = 16;
/// The kernel may keep what it learnt this long: nothing in a snapshot changes.
const TTL: Duration = Duration::from_secs(3600);

/// One file of the file system.
struct Entry {
    ino: u64,
    name: String,
    /// Where its bytes are on the disk.
    start: u64,
    length: u64,
}

struct SnapshotFs {
    image: Arc<SnapshotImage>,
    shown: String,
    /// disk.raw, then the partitions.
    files: Vec<Entry>,
    /// partitions.txt's text.
    listing: Vec<u8>,
    time: SystemTime,
    uid: u32,
    gid: u32,
}

impl SnapshotFs {
    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let (kind, perm, size, nlink) = match ino {
            ROOT => (FileType::Directory, 0o555, 0, 2),
            LIST => (FileType::RegularFile, 0o444, self.listing.len() as u64, 1),
            _ => (FileType::RegularFile, 0o444, self.files.iter().find(|f| f.ino == ino)?.length, 1),
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: self.time,
            mtime: self.time,
            ctime: self.time,
            crtime: self.time,
            kind,
            perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 65536,
            flags: 0,
        })
    }

    /// Every name in the directory, with its inode and type.
    fn names(&self) -> Vec<(u64, FileType, String)> {
        let mut v = vec![
            (ROOT, FileType::Directory, ".".to_string()),
            (ROOT, FileType::Directory, "..".to_string()),
            (LIST, FileType::RegularFile, "partitions.txt".to_string()),
        ];
        v.extend(self.files.iter().map(|f| (f.ino, FileType::RegularFile, f.name.clone())));
        v
    }
}

impl Filesystem for SnapshotFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = (u64::from(parent) == ROOT)
            .then(|| self.names().into_iter().skip(2).find(|(_, _, n)| OsStr::new(n) == name))
            .flatten();
        match found.and_then(|(ino, _, _)| self.attr(ino)) {
            Some(a) => reply.entry(&TTL, &a, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino.into()) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if self.attr(ino.into()).is_none() {
            return reply.error(Errno::ENOENT);
        }
        if !matches!(flags.acc_mode(), OpenAccMode::O_RDONLY) {
            return reply.error(Errno::EROFS);
        }
        // The bytes never change: the kernel's page cache may keep them across opens.
        reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let ino = u64::from(ino);
        if ino == LIST {
            let from = offset.min(self.listing.len() as u64) as usize;
            let to = (from + size as usize).min(self.listing.len());
            return reply.data(&self.listing[from..to]);
        }
        let Some(f) = self.files.iter().find(|f| f.ino == ino) else {
            return reply.error(Errno::ENOENT);
        };
        let len = u64::from(size).min(f.length.saturating_sub(offset));
        if len == 0 {
            return reply.data(&[]);
        }
        let mut buf = vec![0u8; len as usize];
        match self.image.read(&mut buf, f.start + offset) {
            Ok(()) => reply.data(&buf),
            Err(e) => {
                log::error!(
                    "{}: reading {} bytes at {offset} of {} (byte {} of the disk): {e}: the reader gets EIO",
                    self.shown,
                    len,
                    f.name,
                    f.start + offset
                );
                reply.error(Errno::EIO)
            }
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        if u64::from(ino) != ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        for (i, (ino, kind, name)) in self.names().into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(ino), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    /// Nothing is written: a close has nothing to flush.
    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _owner: LockOwner, reply: ReplyEmpty) {
        reply.ok()
    }

    fn getxattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, _size: u32, reply: ReplyXattr) {
        reply.error(Errno::NO_XATTR);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: ReplyXattr) {
        if size == 0 {
            reply.size(0)
        } else {
            reply.data(&[])
        }
    }
}

/// The files of a disk of `size` bytes with `table` (or none, and why).
fn files(size: u64, table: &std::result::Result<Table, partitions::TableError>) -> (Vec<Entry>, Vec<u8>) {
    let mut files = vec![Entry { ino: DISK, name: "disk.raw".into(), start: 0, length: size }];
    let mut text = format!("disk.raw  the whole disk, {size} bytes\n");
    match table {
        Ok(t) if t.scheme == Scheme::None => text.push_str("no partition table\n"),
        Ok(t) => {
            text.push_str(&format!(
                "{} partition table, {} partition(s):\n",
                if t.scheme == Scheme::Gpt { "GPT" } else { "MBR" },
                t.partitions.len()
            ));
            for p in &t.partitions {
                files.push(Entry {
                    ino: FIRST_PART + u64::from(p.number),
                    name: format!("part{}", p.number),
                    start: p.start,
                    length: p.length,
                });
                text.push_str(&line(p));
            }
        }
        Err(e) => text.push_str(&format!("no partition files: {e}\n")),
    }
    (files, text.into_bytes())
}

fn line(p: &Partition) -> String {
    let name = if p.name.is_empty() { String::new() } else { format!("  name {:?}", p.name) };
    format!("part{}  start {}  size {}  type {}{name}\n", p.number, p.start, p.length, p.kind)
}

/// Set in the environment of the process that `--daemon` starts: that process mounts.
pub const DAEMON: &str = "FERRY_MOUNT_DAEMON";

/// Where the daemon's messages go once it is up: --log FILE, else syslog. Opened before
/// anything is mounted, so that one that cannot be had fails the command.
fn daemon_log(args: &MountArgs) -> Result<Box<dyn std::io::Write + Send>> {
    Ok(match &args.log {
        Some(path) => Box::new(crate::background::LogFile::open(path)?),
        None => Box::new(crate::background::Syslog::connect()?),
    })
}

pub fn run(args: MountArgs) -> Result<i32> {
    let background = args.daemon && crate::background::is_background(DAEMON);
    if args.daemon && !background {
        // In this process group: the new process may still ask for the passphrase on the
        // terminal. It leaves the terminal's session once mounted.
        return Ok(crate::background::start(DAEMON, false, crate::background::Channel::Stderr, "--daemon")?
            .map_or_else(|code| code, |_| 0));
    }
    let log_to = if background { Some(daemon_log(&args)?) } else { None };
    let (repo, name, id) = match Location::parse(&args.snapshot).with_context(|| format!("{:?}", args.snapshot))? {
        Location::Repo { repo, name, id } => (repo, name, id),
        _ => bail!("{:?} is not a snapshot: write REPO::NAME or REPO::NAME@ID", args.snapshot),
    };
    // The daemon leaves its working directory once up (so that it holds no file system
    // busy): the repository's directory and the mount point are made absolute first.
    let mut args = args;
    let open_at = match background && !ferry_open::repo::is_s3(&repo) {
        true => std::path::absolute(&repo)
            .ok()
            .and_then(|p| p.to_str().map(str::to_string))
            .context("--daemon: cannot make the repository's path absolute")?,
        false => repo.clone(),
    };
    if background {
        args.dir = std::path::absolute(&args.dir).context("--daemon: cannot make the mount point's path absolute")?;
    }
    match std::fs::metadata(&args.dir) {
        Ok(m) if m.is_dir() => {}
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => bail!(
            "the mount point {0} is a stale mount of a killed ferry mount: run `fusermount3 -u {0}`",
            args.dir.display()
        ),
        _ => bail!("the mount point {} is not a directory: make it with mkdir", args.dir.display()),
    }
    let shown = Location::repo_spec(&repo, &name, id.as_deref());
    let remote = args.remote.remote();
    let on = ferry_open::repo::snapshot_on_rollback(&repo, &name, id.as_deref());
    let r = args.password.open(&open_at, &remote, on)?;
    let snap = ferry_open::repo::resolve(&r, &name, id.as_deref()).with_context(|| shown.clone())?;
    let image = SnapshotImage::open_with_cache(r, &snap, ferry_open::repo::serve_cache_bytes()?)
        .with_context(|| format!("cannot open the snapshot {shown}"))?;
    let shown = format!("{repo}::{name}@{}", &snap.id[..snap.id.len().min(8)]);
    let size = image.size();
    let table = partitions::scan(size, &mut |offset, buf| image.read(buf, offset).map_err(|e| e.to_string()));
    if let Err(e) = &table {
        log::warn!("{shown}: {e}: only disk.raw is shown");
    }
    let (files, listing) = files(size, &table);
    let time = snap.manifest.time.parse::<jiff::Timestamp>().map_or(SystemTime::UNIX_EPOCH, SystemTime::from);
    let fs = SnapshotFs {
        image,
        shown: shown.clone(),
        files,
        listing,
        time,
        uid: rustix::process::geteuid().as_raw(),
        gid: rustix::process::getegid().as_raw(),
    };
    let names: Vec<String> = fs.files.iter().map(|f| f.name.clone()).collect();
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        MountOption::RO,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoExec,
        MountOption::FSName(fs_name(&shown, rustix::process::geteuid().is_root())),
        MountOption::Subtype("ferry".into()),
    ];
    if args.options.iter().any(|o| o == "allow_other") {
        config.acl = fuser::SessionACL::All;
    }
    // Readers side by side (guestfish, a loop device's queue): the image reads in parallel.
    config.n_threads = Some(4);
    let dir = args.dir.display().to_string();
    let session = fuser::Session::new(fs, &args.dir, &config).map_err(|e| {
        let missing = e.kind() == std::io::ErrorKind::NotFound;
        let hint = if missing {
            " (FUSE needs /dev/fuse and fusermount3 or fusermount: install the fuse3 package)"
        } else {
            ""
        };
        anyhow::Error::new(e).context(format!("cannot mount {shown} on {dir}{hint}"))
    })?;
    watch_signals(dir.clone())?;
    if let Some(to) = log_to {
        // No terminal's hangup or Ctrl-C reaches the daemon from now on.
        rustix::process::setsid().context("--daemon: cannot leave the terminal's session")?;
        crate::background::redirect(to);
        crate::background::say_ready(crate::background::Channel::Stderr, &dir);
        crate::background::detach().context("--daemon")?;
        std::env::set_current_dir("/").context("--daemon: cannot change to /")?;
        log::info!(
            "{shown} mounted on {dir} by process {}: {}, partitions.txt; read-only. `fusermount3 -u {dir}` (or \
             SIGTERM) unmounts",
            std::process::id(),
            names.join(", ")
        );
    } else {
        log::info!(
            "{shown} mounted on {dir}: {}, partitions.txt; read-only. Ctrl-C (or SIGTERM, or `fusermount3 -u {dir}`) \
             unmounts",
            names.join(", ")
        );
    }
    session.run().with_context(|| format!("the file system on {dir} failed"))?;
    log::info!("{dir} unmounted");
    Ok(0)
}

/// The file system's name in /proc/mounts, `ferry:REPO::NAME@ID`. Root mounts with mount(2),
/// which takes it as it is; anyone else through fusermount3's `-o` list, which splits at `,`
/// and unescapes backslashes: both are escaped there (a repository path may hold a comma).
fn fs_name(shown: &str, root: bool) -> String {
    let name = format!("ferry:{shown}");
    if root {
        return name;
    }
    name.replace('\\', "\\\\").replace(',', "\\,")
}

/// SIGINT, SIGTERM and SIGHUP unmount the file system (`session.run` then returns). A
/// mount point still in use is left mounted, with a warning: the next signal tries again.
/// ferry unmounts itself rather than through fuser's `SessionUnmounter`, which gives up its
/// mount on the first failure and makes every later try a silent no-op. Once unmounted, a
/// further signal has its default effect (the process ends).
fn watch_signals(dir: String) -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals =
        signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]).context("installing signal handlers")?;
    std::thread::Builder::new()
        .name("mount-signals".into())
        .spawn(move || {
            let mut unmounted = false;
            for sig in signals.forever() {
                if unmounted {
                    // Whatever keeps the session from returning, this signal is not swallowed.
                    let _ = signal_hook::low_level::emulate_default_handler(sig);
                    continue;
                }
                match unmount(&dir) {
                    Ok(()) => {
                        log::info!("{}: unmounting {dir}", crate::interrupt::name(sig));
                        unmounted = true;
                    }
                    Err(e) => log::warn!(
                        "cannot unmount {dir} ({e}): close what uses it (a shell in it, a loop device, guestmount), \
                         then signal again or run `fusermount3 -u {dir}`"
                    ),
                }
            }
        })
        .context("starting the signal thread")?;
    Ok(())
}

/// Unmounts DIR, never lazily (a busy mount point is an error and stays mounted): root with
/// umount(8), anyone else through the setuid helper, `fusermount3 -u` (or `fusermount -u`).
fn unmount(dir: &str) -> Result<()> {
    let tries: &[(&str, &[&str])] = if rustix::process::geteuid().is_root() {
        &[("umount", &[])]
    } else {
        &[("fusermount3", &["-u"]), ("fusermount", &["-u"])]
    };
    let mut missing = None;
    for (tool, args) in tries {
        let out =
            std::process::Command::new(tool).args(*args).arg("--").arg(dir).stdin(std::process::Stdio::null()).output();
        match out {
            Ok(o) if o.status.success() => return Ok(()),
            Ok(o) => bail!("{tool}: {}", String::from_utf8_lossy(&o.stderr).trim()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => missing = Some(format!("{tool}: {e}")),
            Err(e) => bail!("{tool}: {e}"),
        }
    }
    bail!("{}", missing.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::fs_name;

    #[test]
    fn fs_name_escapes_what_fusermount_splits_on() {
        assert_eq!(fs_name("/b,k\\x::vm@1", true), "ferry:/b,k\\x::vm@1");
        assert_eq!(fs_name("/b,k\\x::vm@1", false), "ferry:/b\\,k\\\\x::vm@1");
    }
}
