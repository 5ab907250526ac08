//! Image locking that qemu, its tools and cloud-hypervisor understand.
//!
//! Every file opened as an image (a raw image, a qcow2 container, a backing file, an
//! external data file) declares which permissions it holds and which it does not let
//! others hold, with OFD byte-range read locks, as qemu's file driver does: one byte per
//! permission at offset 100 + bit for a permission held, and at 200 + bit for a
//! permission not shared. Bits: 0 consistent read, 1 write, 2 write unchanged, 3 resize.
//! A user conflicts with another when it holds a permission the other does not share, or
//! does not share one the other holds. The locks are taken first and checked after (with
//! F_OFD_GETLK for a write lock on the other side's byte), so of two users opening at once
//! at least one sees the other. OFD locks belong to the open file description: they last
//! as long as the `File` they were taken on, and two openings of one file conflict even
//! within one process.
//!
//! What each use locks was measured with qemu 10 (`/proc/locks` and strace of qemu-nbd,
//! qemu-io, qemu-img info and convert); see [`Access`].

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// A set of qemu block permissions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Perms(u8);

impl Perms {
    pub const NONE: Perms = Perms(0);
    pub const CONSISTENT_READ: Perms = Perms(1);
    pub const WRITE: Perms = Perms(2);
    pub const WRITE_UNCHANGED: Perms = Perms(4);
    pub const RESIZE: Perms = Perms(8);
    const NAMES: [&'static str; 4] = ["consistent read", "write", "write unchanged", "resize"];

    pub const fn union(self, o: Perms) -> Perms {
        Perms(self.0 | o.0)
    }

    fn bits(self) -> impl Iterator<Item = u8> + Clone {
        (0..Self::NAMES.len() as u8).filter(move |b| self.0 & (1 << b) != 0)
    }
}

/// Byte of the lock that says a permission is held.
const HELD_BASE: i64 = 100;
/// Byte of the lock that says a permission is not shared.
const UNSHARED_BASE: i64 = 200;

/// The locks one opening of a file takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Locking {
    pub held: Perms,
    pub unshared: Perms,
}

const CR: Perms = Perms::CONSISTENT_READ;
const W: Perms = Perms::WRITE;
const RS: Perms = Perms::RESIZE;

/// What ferry opens an image for. Each maps to the locks qemu 10 takes for the same use
/// (held / not shared):
///
/// | use | raw image | qcow2 container | external data file |
/// |---|---|---|---|
/// | `Write` (serve, qemu-nbd) | read, write / resize | read, write, resize / write, resize | read, write, resize / resize |
/// | `Export` (serve -r, qemu-nbd -r) | read / resize | read / write, resize | read / resize |
/// | `Source` (copy, hash; convert's source) | read / write, resize | read / write, resize | read / resize |
/// | `Backing` (a backing file) | read / - | read / write, resize | read / resize |
/// | `Inspect` (info; qemu-img info) | - / - | - / write, resize | - / resize |
/// | `Destination` (copy's raw target; convert's) | read, write / - | as `Write` | as `Write` |
///
/// With force-share nothing is unshared (qemu's `-U`, for read-only uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Write,
    Export,
    Source,
    Backing,
    Inspect,
    Destination,
}

/// An access and whether others' locks are ignored (`-U`/`--force-share`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageUse {
    pub access: Access,
    pub force_share: bool,
}

impl ImageUse {
    pub const fn new(access: Access) -> ImageUse {
        ImageUse { access, force_share: false }
    }

    /// A writable image (`Write`) or one exported read-only (`Export`).
    pub const fn serve(read_only: bool) -> ImageUse {
        ImageUse::new(if read_only { Access::Export } else { Access::Write })
    }

    pub const fn force_share(self, force_share: bool) -> ImageUse {
        ImageUse { force_share, ..self }
    }

    fn finish(self, held: Perms, unshared: Perms) -> Locking {
        Locking { held, unshared: if self.force_share { Perms::NONE } else { unshared } }
    }

    /// The locks on a raw image file.
    pub fn raw(self) -> Locking {
        match self.access {
            Access::Write => self.finish(CR.union(W), RS),
            Access::Export => self.finish(CR, RS),
            Access::Source => self.finish(CR, W.union(RS)),
            Access::Backing => self.finish(CR, Perms::NONE),
            Access::Inspect => self.finish(Perms::NONE, Perms::NONE),
            Access::Destination => self.finish(CR.union(W), Perms::NONE),
        }
    }

    /// The locks on a qcow2 image's own file (qemu's qcow2 driver never shares writes
    /// or resizes of it).
    pub fn qcow2(self) -> Locking {
        match self.access {
            Access::Write | Access::Destination => self.finish(CR.union(W).union(RS), W.union(RS)),
            Access::Export | Access::Source | Access::Backing => self.finish(CR, W.union(RS)),
            Access::Inspect => self.finish(Perms::NONE, W.union(RS)),
        }
    }

    /// The locks on a qcow2 image's external data file.
    pub fn data_file(self) -> Locking {
        match self.access {
            Access::Write | Access::Destination => self.finish(CR.union(W).union(RS), RS),
            Access::Export | Access::Source | Access::Backing => self.finish(CR, RS),
            Access::Inspect => self.finish(Perms::NONE, RS),
        }
    }

    /// How the backing file of an image opened for this use is opened.
    pub fn backing(self) -> ImageUse {
        let access = if self.access == Access::Inspect { Access::Inspect } else { Access::Backing };
        ImageUse { access, ..self }
    }
}

/// A file's identity: device and inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

impl FileId {
    pub fn of(file: &File) -> io::Result<FileId> {
        let m = file.metadata()?;
        Ok(FileId { dev: m.dev(), ino: m.ino() })
    }

    /// The identity of the file at `path` (following symlinks).
    pub fn of_path(path: &Path) -> io::Result<FileId> {
        let m = std::fs::metadata(path)?;
        Ok(FileId { dev: m.dev(), ino: m.ino() })
    }
}

/// A file opened as (part of) an image: what a caller needs to tell two openings of one
/// file apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenFile {
    pub id: FileId,
    pub path: PathBuf,
    pub writable: bool,
}

/// Why an image's locks could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("{}", conflict_message(perm, *theirs_held, *byte, holder, *read_only))]
    Conflict { path: PathBuf, perm: &'static str, theirs_held: bool, byte: i64, holder: Holder, read_only: bool },
    #[error("cannot lock {} (byte {byte}): {source}; the file system may not support OFD locks", path.display())]
    Os {
        path: PathBuf,
        byte: i64,
        #[source]
        source: io::Error,
    },
}

impl From<LockError> for io::Error {
    fn from(e: LockError) -> io::Error {
        let kind =
            if matches!(e, LockError::Conflict { .. }) { io::ErrorKind::ResourceBusy } else { io::ErrorKind::Other };
        io::Error::new(kind, e)
    }
}

/// Who holds a conflicting lock, as far as /proc tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// Another opening in this process: the same image given twice, or as another
    /// image's backing or data file.
    ThisProcess,
    Process {
        pid: u32,
        name: String,
    },
    Unknown,
}

fn conflict_message(perm: &str, theirs_held: bool, byte: i64, holder: &Holder, read_only: bool) -> String {
    let who = match holder {
        Holder::ThisProcess => {
            "this ferry process has it open already (the same image given twice, or as another image's \
             backing or data file), and that opening"
                .to_string()
        }
        Holder::Process { pid, name } => format!("process {pid} ({name})"),
        Holder::Unknown => "another process".to_string(),
    };
    let what = if theirs_held {
        format!("holds the {perm:?} permission, which this opening does not share")
    } else {
        format!("does not share the {perm:?} permission, which this opening needs")
    };
    let todo = match (holder, read_only) {
        (Holder::ThisProcess, _) => "Open each image once".to_string(),
        (_, true) => "Stop that program first, or pass --force-share to read it anyway (-U for ferry copy, \
                      hash and info; what is read may be inconsistent while it is written)"
            .to_string(),
        (_, false) => "Stop that program first; only read-only openings can ignore the lock (-U/--force-share; \
                       ferry serve --read-only --force-share)"
            .to_string(),
    };
    format!("the file is in use: {who} {what} (lock byte {byte}). {todo}")
}

fn flock(l_type: libc::c_short, byte: i64) -> libc::flock {
    libc::flock { l_type, l_whence: libc::SEEK_SET as libc::c_short, l_start: byte, l_len: 1, l_pid: 0 }
}

/// Takes `locking`'s locks on `file` (opened from `path`), then checks that no other
/// opening conflicts. On error some locks may be held: drop the file.
pub fn lock(file: &File, path: &Path, locking: Locking) -> Result<(), LockError> {
    use nix::fcntl::{fcntl, FcntlArg};
    let os = |byte: i64| move |e: nix::errno::Errno| LockError::Os { path: path.to_owned(), byte, source: e.into() };
    let held: Vec<u8> = locking.held.bits().collect();
    let unshared: Vec<u8> = locking.unshared.bits().collect();
    let bytes = held.iter().map(|b| HELD_BASE + *b as i64).chain(unshared.iter().map(|b| UNSHARED_BASE + *b as i64));
    for byte in bytes {
        fcntl(file.as_fd(), FcntlArg::F_OFD_SETLK(&flock(libc::F_RDLCK as libc::c_short, byte))).map_err(os(byte))?;
    }
    // For each permission held: does another opening not share it? For each not shared:
    // does another opening hold it?
    let checks = held
        .iter()
        .map(|b| (*b, UNSHARED_BASE + *b as i64, false))
        .chain(unshared.iter().map(|b| (*b, HELD_BASE + *b as i64, true)));
    for (bit, byte, theirs_held) in checks {
        let mut probe = flock(libc::F_WRLCK as libc::c_short, byte);
        fcntl(file.as_fd(), FcntlArg::F_OFD_GETLK(&mut probe)).map_err(os(byte))?;
        // A conflict may be an opening this process closed that a child still shares
        // for the instant between fork and exec (any thread's spawn copies every
        // descriptor): look again a few times over 100 ms before naming a holder.
        for _ in 0..20 {
            if probe.l_type == libc::F_UNLCK as libc::c_short {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
            probe = flock(libc::F_WRLCK as libc::c_short, byte);
            fcntl(file.as_fd(), FcntlArg::F_OFD_GETLK(&mut probe)).map_err(os(byte))?;
        }
        if probe.l_type != libc::F_UNLCK as libc::c_short {
            return Err(LockError::Conflict {
                path: path.to_owned(),
                perm: Perms::NAMES[bit as usize],
                theirs_held,
                byte,
                holder: holder(file, byte),
                read_only: !locking.held.bits().any(|b| b == 1 || b == 3),
            });
        }
    }
    Ok(())
}

/// Opens `path` read-only and locks it: a guard for a file another part of the program
/// reads or writes through its own opening. The locks last as long as the returned file.
pub fn lock_path(path: &Path, locking: Locking) -> io::Result<File> {
    let f = File::open(path)?;
    lock(&f, path, locking)?;
    Ok(f)
}

/// Who holds a lock on `byte` of `file`, as far as /proc tells: OFD locks report no pid
/// (-1) through F_OFD_GETLK and /proc/locks, but /proc/PID/fdinfo/FD lists the locks of
/// each opening, so the processes this user may look into can be named.
fn holder(file: &File, byte: i64) -> Holder {
    let unknown = Holder::Unknown;
    let Ok(m) = file.metadata() else { return unknown };
    let dev = m.dev();
    let key = format!("{:02x}:{:02x}:{}", rustix::fs::major(dev), rustix::fs::minor(dev), m.ino());
    let me = std::process::id();
    let mine = file.as_fd();
    let my_fd = std::os::fd::AsRawFd::as_raw_fd(&mine);
    let Ok(procs) = std::fs::read_dir("/proc") else { return unknown };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(fds) = std::fs::read_dir(p.path().join("fdinfo")) else { continue };
        for fd in fds.flatten() {
            if pid == me && fd.file_name().to_str() == Some(&my_fd.to_string()) {
                continue;
            }
            let Ok(info) = std::fs::read_to_string(fd.path()) else { continue };
            if !info.lines().any(|l| lock_line_covers(l, &key, byte)) {
                continue;
            }
            if pid == me {
                return Holder::ThisProcess;
            }
            let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
            return Holder::Process { pid, name: comm.trim().to_string() };
        }
    }
    unknown
}

/// `lock:\t1: OFDLCK ADVISORY  READ -1 fe:00:123 100 101`: an OFD lock on file `key`
/// covering `byte`.
fn lock_line_covers(line: &str, key: &str, byte: i64) -> bool {
    let Some(rest) = line.strip_prefix("lock:") else { return false };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let Some(i) = f.iter().position(|x| *x == key) else { return false };
    if f.get(1) != Some(&"OFDLCK") {
        return false;
    }
    let start = f.get(i + 1).and_then(|s| s.parse::<i64>().ok());
    let end = f.get(i + 2).map(|s| if *s == "EOF" { Some(i64::MAX) } else { s.parse::<i64>().ok() });
    matches!((start, end), (Some(s), Some(Some(e))) if s <= byte && byte <= e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(p: &Path, l: Locking) -> Result<File, LockError> {
        let f = File::open(p).unwrap();
        lock(&f, p, l).map(|()| f)
    }

    #[test]
    fn openings_conflict_as_qemu_says() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("img");
        std::fs::write(&p, [0u8; 512]).unwrap();
        let rw = |a: Access| ImageUse::new(a);
        // qcow2 held for writing: no other writer, reader or inspector (qemu-img info).
        let w = open(&p, rw(Access::Write).qcow2()).unwrap();
        for other in [rw(Access::Write).qcow2(), rw(Access::Source).qcow2(), rw(Access::Inspect).qcow2()] {
            let e = open(&p, other).unwrap_err();
            assert!(matches!(e, LockError::Conflict { .. }), "{e}");
            assert!(matches!(&e, LockError::Conflict { holder: Holder::ThisProcess, .. }), "{e}");
        }
        // ... except with force-share.
        open(&p, rw(Access::Source).force_share(true).qcow2()).unwrap();
        open(&p, rw(Access::Inspect).force_share(true).qcow2()).unwrap();
        drop(w);
        // A raw image written by two: allowed (qemu-nbd and qemu-io do), but it cannot
        // be a copy's source, and a copy's source cannot be written.
        let a = open(&p, rw(Access::Write).raw()).unwrap();
        let _b = open(&p, rw(Access::Write).raw()).unwrap();
        open(&p, rw(Access::Source).raw()).unwrap_err();
        drop((a, _b));
        let s = open(&p, rw(Access::Source).raw()).unwrap();
        let e = open(&p, rw(Access::Destination).raw()).unwrap_err();
        assert!(e.to_string().contains("does not share the \"write\""), "{e}");
        open(&p, rw(Access::Export).raw()).unwrap();
        drop(s);
        // Locks go with the opening.
        open(&p, rw(Access::Destination).raw()).unwrap();
    }

    #[test]
    fn lock_lines() {
        let l = "lock:\t1: OFDLCK ADVISORY  READ -1 fe:00:10011113 100 101";
        assert!(lock_line_covers(l, "fe:00:10011113", 101));
        assert!(!lock_line_covers(l, "fe:00:10011113", 102));
        assert!(!lock_line_covers(l, "fe:00:1001111", 100));
        assert!(lock_line_covers("lock:\t2: OFDLCK ADVISORY  READ -1 08:01:7 0 EOF", "08:01:7", 203));
        assert!(!lock_line_covers("lock:\t2: POSIX  ADVISORY  READ 12 08:01:7 0 EOF", "08:01:7", 203));
    }
}
