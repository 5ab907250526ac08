//! A backup's chunk list (one digest per chunk of the disk): in memory for a small disk,
//! else in an unlinked file in the local cache directory, so that a backup's memory does
//! not grow with its disk (32 bytes a chunk: 512 MiB for a disk of 1 TiB in 64 KiB
//! chunks). The file is written where the backup enters chunks, a batch of chunks at a
//! time (into the page cache: no read), and read back a page (or a window) at a time
//! where every entry is needed: the pages made at a checkpoint or the commit, the
//! blkhash, and the lookups of what is lost or condemned. None of it is a repository
//! object; the file goes when the backup ends, however it ends (it has no name).
use crate::format::{Digest, ZERO};
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// A chunk list of more entries than this is kept in a file (16 MiB of digests in
/// memory at most: a disk of 32 GiB in 64 KiB chunks).
#[cfg(not(test))]
pub(crate) const SPILL_ENTRIES: u64 = 1 << 19;
/// Small in the crate's tests, so that their backups use the file.
#[cfg(test)]
pub(crate) const SPILL_ENTRIES: u64 = 40;

/// Entries read from the file at once where all of them are walked (1 MiB).
pub(crate) const WINDOW: usize = 1 << 15;

/// One digest per chunk.
pub(crate) enum Entries {
    Memory(Vec<Digest>),
    /// `len` entries of 32 bytes each, in order; unwritten ranges read as zeroes ([`ZERO`]).
    File {
        file: File,
        len: u64,
    },
}

impl Entries {
    /// `len` zero entries: in memory up to [`SPILL_ENTRIES`], else in a file in `dir`
    /// (the cache directory; the system's temporary directory where there is none).
    pub(crate) fn zeroes(len: u64, dir: Option<&Path>, what: &str) -> crate::Result<Entries> {
        if len <= SPILL_ENTRIES {
            let mut v = crate::repo::entry_list(len, what)?;
            v.resize(len as usize, ZERO);
            return Ok(Entries::Memory(v));
        }
        let tmp = std::env::temp_dir();
        let dir = dir.unwrap_or(&tmp);
        let file = unlinked_file(dir).and_then(|f| f.set_len(len * 32).map(|()| f)).map_err(|e| {
            crate::Error::Invalid(format!(
                "cannot make the file that holds the chunk list of {what} ({len} chunks) in {}: {e}; free space \
                 there, or set FERRY_CACHE_DIR to a directory with room",
                dir.display()
            ))
        })?;
        Ok(Entries::File { file, len })
    }

    pub(crate) fn len(&self) -> u64 {
        match self {
            Entries::Memory(v) => v.len() as u64,
            Entries::File { len, .. } => *len,
        }
    }

    /// Entries `first..first + n` (within the list): a slice of the list, or read into `buf`.
    pub(crate) fn read<'a>(&'a self, first: u64, n: usize, buf: &'a mut Vec<Digest>) -> io::Result<&'a [Digest]> {
        match self {
            Entries::Memory(v) => Ok(&v[first as usize..first as usize + n]),
            Entries::File { file, .. } => {
                let mut bytes = vec![0u8; n * 32];
                file.read_exact_at(&mut bytes, first * 32)?;
                buf.clear();
                buf.extend(bytes.chunks_exact(32).map(|c| c.try_into().unwrap_or(ZERO)));
                Ok(&buf[..])
            }
        }
    }

    /// The entry of chunk `ci`.
    pub(crate) fn get(&self, ci: u64) -> io::Result<Digest> {
        let mut buf = Vec::new();
        Ok(self.read(ci, 1, &mut buf)?[0])
    }

    /// Sets entries `first..` to `digests`.
    pub(crate) fn write(&mut self, first: u64, digests: &[Digest]) -> io::Result<()> {
        match self {
            Entries::Memory(v) => {
                v[first as usize..first as usize + digests.len()].copy_from_slice(digests);
                Ok(())
            }
            Entries::File { file, .. } => file.write_all_at(digests.as_flattened(), first * 32),
        }
    }

    /// Sets entries `first..first + n` to [`ZERO`].
    pub(crate) fn zero(&mut self, first: u64, n: u64) -> io::Result<()> {
        match self {
            Entries::Memory(v) => {
                v[first as usize..(first + n) as usize].fill(ZERO);
                Ok(())
            }
            Entries::File { .. } => {
                let zeroes = vec![ZERO; n.min(WINDOW as u64) as usize];
                let mut at = first;
                while at < first + n {
                    let k = (first + n - at).min(WINDOW as u64) as usize;
                    self.write(at, &zeroes[..k])?;
                    at += k as u64;
                }
                Ok(())
            }
        }
    }

    /// Calls `f` with each window of entries in order (its first chunk, its entries),
    /// [`WINDOW`] entries at a time (the last one shorter); a read error as `read_error`
    /// makes it.
    pub(crate) fn each_window<E>(
        &self,
        read_error: impl Fn(io::Error) -> E,
        mut f: impl FnMut(u64, &[Digest]) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut buf = Vec::new();
        let mut at = 0;
        while at < self.len() {
            let n = (self.len() - at).min(WINDOW as u64) as usize;
            f(at, self.read(at, n, &mut buf).map_err(&read_error)?)?;
            at += n as u64;
        }
        Ok(())
    }
}

/// A new file in `dir`, readable and writable by this user only, with no name left.
fn unlinked_file(dir: &Path) -> io::Result<File> {
    unlinked(dir, "entries")
}

/// A new file in `dir`, read and written, that has no name: it goes when it is closed,
/// however the process ends. Made with `O_TMPFILE` where the file system has it (never
/// named); else named `.WHAT-PID-RANDOM` and the name removed at once, and a name that a
/// process killed in between left is removed by [`remove_stray`].
pub(crate) fn unlinked(dir: &Path, what: &str) -> io::Result<File> {
    use rustix::fs::{Mode, OFlags};
    let flags = OFlags::RDWR | OFlags::CLOEXEC | OFlags::TMPFILE;
    match rustix::fs::open(dir, flags, Mode::from_raw_mode(0o600)) {
        Ok(fd) => return Ok(File::from(fd)),
        // No O_TMPFILE in this file system (or kernel): a named file.
        Err(e) if [rustix::io::Errno::OPNOTSUPP, rustix::io::Errno::ISDIR, rustix::io::Errno::INVAL].contains(&e) => {}
        Err(e) => return Err(e.into()),
    }
    let r = crate::crypto::random::<12>();
    let path = dir.join(format!(".{what}-{}-{}", std::process::id(), crate::format::hex(&r)));
    let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path)?;
    match std::fs::remove_file(&path) {
        // Another host's (or PID namespace's) `remove_stray` took it for a stray: gone all
        // the same.
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        r => r?,
    }
    Ok(file)
}

/// The temporary files that processes no longer running left in `dir` (killed between
/// making and unlinking one, [`unlinked`]'s named way): removed. Files of a process that
/// runs, or whose number cannot be told gone, stay. Returns how many were removed.
pub(crate) fn remove_stray(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(stray_pid) else { continue };
        if pid == std::process::id() || crate::lock::holder_gone(pid, None).is_none() {
            continue;
        }
        // A name lives microseconds; one younger than a minute may be a live process's that
        // this host cannot see (another PID namespace, or another host on a shared cache).
        let young = e
            .metadata()
            .and_then(|m| m.modified())
            .map_or(true, |t| t.elapsed().map_or(true, |age| age < std::time::Duration::from_secs(60)));
        if young {
            continue;
        }
        match std::fs::remove_file(e.path()) {
            Ok(()) => removed += 1,
            Err(err) => log::debug!("cannot remove {}: {err}", e.path().display()),
        }
    }
    removed
}

/// The process of a name [`unlinked`] gives (`.spill-PID-HEX`, `.entries-PID-HEX` or
/// `.ownrun-PID-HEX`).
fn stray_pid(name: &str) -> Option<u32> {
    let rest = [".spill-", ".entries-", ".ownrun-"].iter().find_map(|p| name.strip_prefix(p))?;
    let (pid, random) = rest.split_once('-')?;
    (random.len() == 24 && random.bytes().all(|b| b.is_ascii_hexdigit())).then_some(())?;
    pid.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unlinked_file_has_no_name_and_strays_of_dead_processes_go() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = unlinked(dir.path(), "spill").unwrap();
        io::Write::write_all(&mut f, b"records").unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        // What a process killed between create and unlink leaves: a dead one's (a number
        // above the kernel's largest) goes, this process's and other names stay.
        let hex = "0123456789abcdef01234567";
        let dead = format!(".spill-{}-{hex}", u32::MAX - 1);
        let dead_entries = format!(".entries-{}-{hex}", u32::MAX - 2);
        let own = format!(".spill-{}-{hex}", std::process::id());
        let others = [own.as_str(), "spill-1-x", ".spill-x-0123", "runs", ".spill-12-short"];
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(120);
        for n in others.iter().chain([&dead.as_str(), &dead_entries.as_str()]) {
            std::fs::File::create(dir.path().join(n)).unwrap().set_modified(old).unwrap();
        }
        // A dead process's name made this minute may be a live one's that this host cannot
        // see (another PID namespace or host on a shared cache): it stays.
        let young = format!(".spill-{}-{hex}", u32::MAX - 3);
        std::fs::write(dir.path().join(&young), b"").unwrap();
        if !Path::new("/proc/1").exists() {
            // Processes hidden (hidepid): no process can be told gone, nothing is removed.
            assert_eq!(remove_stray(dir.path()), 0);
            return;
        }
        assert_eq!(remove_stray(dir.path()), 2);
        let mut left: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        let mut want: Vec<String> = others.iter().map(|s| s.to_string()).chain([young]).collect();
        want.sort();
        assert_eq!(left, want);
        assert_eq!(remove_stray(&dir.path().join("none")), 0);
    }

    #[test]
    fn a_file_and_memory_hold_the_same_entries() {
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path();
        let n = SPILL_ENTRIES * 3 + 7;
        let mut file = Entries::zeroes(n, Some(dir), "a test").unwrap();
        assert!(matches!(file, Entries::File { .. }));
        let mut mem = Entries::Memory(vec![ZERO; n as usize]);
        let d = |i: u64| -> Digest { [i as u8 + 1; 32] };
        for e in [&mut file, &mut mem] {
            let ds: Vec<Digest> = (5..60).map(d).collect();
            e.write(5, &ds).unwrap();
            e.zero(20, 10).unwrap();
            e.write(n - 1, &[d(9)]).unwrap();
        }
        let all = |e: &Entries| {
            let mut v = Vec::new();
            e.each_window(
                |e| e,
                |at, w| -> io::Result<()> {
                    assert_eq!(at, v.len() as u64);
                    v.extend_from_slice(w);
                    Ok(())
                },
            )
            .unwrap();
            v
        };
        let (a, b) = (all(&file), all(&mem));
        assert_eq!(a, b);
        assert_eq!(a.len() as u64, n);
        assert_eq!(a[6], d(6));
        assert_eq!(a[25], ZERO);
        assert_eq!(file.get(n - 1).unwrap(), d(9));
        // No name is left in the directory.
        assert_eq!(std::fs::read_dir(dir).unwrap().count(), 0);
    }
}
