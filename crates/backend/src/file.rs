//! `file:PATH`: a regular file or a block device.
//!
//! pread/pwrite through the page cache; TRIM punches holes; WRITE_ZEROES uses
//! fallocate (zero-range, or punch-hole when holes are allowed) and falls back to
//! writing zeroes; block status comes from SEEK_DATA/SEEK_HOLE; FLUSH and FUA call
//! fdatasync.

use crate::*;
use rustix::fs::{fallocate, fdatasync, FallocateFlags, SeekFrom};
use rustix::io::Errno;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

pub struct FileBackend {
    file: File,
    path: PathBuf,
    size: u64,
    read_only: bool,
    /// SEEK_DATA/SEEK_HOLE work on this file.
    seek_holes: bool,
    block_device: bool,
    /// The last range SEEK_HOLE proved to be data. On tmpfs one SEEK_HOLE scans every
    /// page up to the next hole (about 1 ms per GiB), so the answer is remembered;
    /// TRIM and WRITE_ZEROES forget it. A stale hint is harmless: a hole read as data
    /// still reads as zeroes.
    data_hint: Mutex<(u64, u64)>,
}

/// Reads shorter than this are not checked for holes: one lseek costs more than
/// sending a few KiB of zeroes.
const SPARSE_READ_THRESHOLD: u64 = 64 * 1024;

static ZEROES: [u8; 1 << 20] = [0; 1 << 20];

impl FileBackend {
    /// Opens `path` for reading and (unless `read_only`) writing, locked as `ferry serve`
    /// locks a raw image (as qemu-nbd does). The file must exist.
    pub fn open(path: &Path, read_only: bool) -> std::io::Result<Self> {
        Self::open_with(path, read_only, crate::ImageUse::serve(read_only).raw())
    }

    /// Opens `path` with the locks `locking` (see [`crate::lock`]), held until the
    /// backend is dropped.
    pub fn open_with(path: &Path, read_only: bool, locking: crate::Locking) -> std::io::Result<Self> {
        let file = OpenOptions::new().read(true).write(!read_only).open(path)?;
        let meta = file.metadata()?;
        use std::os::unix::fs::FileTypeExt;
        let block_device = meta.file_type().is_block_device();
        if !meta.is_file() && !block_device {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{} is neither a regular file nor a block device", path.display()),
            ));
        }
        crate::lock::lock(&file, path, locking)?;
        let size = if block_device { rustix::fs::seek(&file, SeekFrom::End(0))? } else { meta.len() };
        let seek_holes =
            !block_device && rustix::fs::seek(&file, SeekFrom::Data(0)).map_or_else(|e| e == Errno::NXIO, |_| true);
        Ok(FileBackend {
            file,
            path: path.to_owned(),
            size,
            read_only,
            seek_holes,
            block_device,
            data_hint: Mutex::new((0, 0)),
        })
    }

    /// The file, for telling two openings of one file apart.
    pub fn open_file(&self) -> std::io::Result<crate::OpenFile> {
        Ok(crate::OpenFile { id: crate::FileId::of(&self.file)?, path: self.path.clone(), writable: !self.read_only })
    }

    fn sync(&self, op: &'static str, offset: u64, length: u64) -> Result<()> {
        fdatasync(&self.file).map_err(|e| Error::io(op, offset, length, e.into()))
    }

    fn fallocate(&self, flags: FallocateFlags, offset: u64, length: u64) -> std::result::Result<(), Errno> {
        fallocate(&self.file, flags, offset, length)
    }

    fn hint(&self) -> (u64, u64) {
        *self.data_hint.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_hint(&self, start: u64, end: u64) {
        *self.data_hint.lock().unwrap_or_else(|e| e.into_inner()) = (start, end);
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> Result<()> {
        let mut pos = offset;
        let end = offset + length;
        while pos < end {
            let n = (end - pos).min(ZEROES.len() as u64) as usize;
            self.file.write_all_at(&ZEROES[..n], pos).map_err(|e| Error::io("zero", pos, n as u64, e))?;
            pos += n as u64;
        }
        Ok(())
    }
}

impl Backend for FileBackend {
    fn describe(&self) -> String {
        format!("file:{}", self.path.display())
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn caps(&self) -> Capabilities {
        let rw = !self.read_only;
        Capabilities {
            read_only: self.read_only,
            flush: true,
            fua: rw,
            trim: rw,
            zero: rw,
            fast_zero: rw,
            // One file, one page cache: FLUSH on any connection covers every connection.
            multi_conn: true,
            cache: true,
            extents: self.seek_holes,
        }
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file.read_exact_at(buf, offset).map_err(|e| Error::io("read", offset, buf.len() as u64, e))
    }
    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.file.write_all_at(buf, offset).map_err(|e| Error::io("write", offset, buf.len() as u64, e))?;
        if fua {
            self.sync("write", offset, buf.len() as u64)?;
        }
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        self.sync("flush", 0, self.size)
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.set_hint(0, 0);
        // Trim is advisory: a file system that cannot punch holes simply keeps the data.
        match self.fallocate(FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, length) {
            Ok(()) | Err(Errno::OPNOTSUPP) | Err(Errno::NOSYS) => {}
            Err(e) => return Err(Error::io("trim", offset, length, e.into())),
        }
        if fua {
            self.sync("trim", offset, length)?;
        }
        Ok(())
    }
    fn zero(&self, offset: u64, length: u64, mode: ZeroMode, fua: bool) -> Result<()> {
        self.set_hint(0, 0);
        let mut done = false;
        if mode.may_trim && !self.block_device {
            done = self.fallocate(FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, length).is_ok();
        }
        if !done {
            done = self.fallocate(FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE, offset, length).is_ok();
        }
        if !done && !mode.may_trim && !self.block_device {
            // NO_HOLE on a file system without zero-range (tmpfs): punch, then allocate.
            done = self.fallocate(FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, length).is_ok()
                && self.fallocate(FallocateFlags::KEEP_SIZE, offset, length).is_ok();
        }
        if !done {
            if mode.fast {
                return Err(Error::new(ErrorKind::NotSupported, "zero", offset, length));
            }
            self.write_zeroes(offset, length)?;
        }
        if fua {
            self.sync("zero", offset, length)?;
        }
        Ok(())
    }
    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> Result<()> {
        let end = offset + length;
        if !self.seek_holes {
            push_extent(out, length, DATA);
            return Ok(());
        }
        let start_len = out.len();
        let mut pos = offset;
        let (hs, he) = self.hint();
        if hs <= pos && pos < he {
            let h = he.min(end);
            push_extent(out, h - pos, DATA);
            pos = h;
        }
        while pos < end && out.len() - start_len < max {
            let data = match rustix::fs::seek(&self.file, SeekFrom::Data(pos)) {
                Ok(d) => d,
                // No data after pos: the rest is a hole.
                Err(Errno::NXIO) => end,
                Err(e) => return Err(Error::io("block status", pos, end - pos, e.into())),
            };
            if data > pos {
                let h = data.min(end);
                push_extent(out, h - pos, HOLE);
                pos = h;
                continue;
            }
            let hole = match rustix::fs::seek(&self.file, SeekFrom::Hole(pos)) {
                Ok(h) => h,
                Err(Errno::NXIO) => end,
                Err(e) => return Err(Error::io("block status", pos, end - pos, e.into())),
            };
            self.set_hint(pos, hole);
            let h = hole.clamp(pos + 1, end);
            push_extent(out, h - pos, DATA);
            pos = h;
        }
        Ok(())
    }
    fn cache(&self, offset: u64, length: u64) -> Result<()> {
        let len = std::num::NonZeroU64::new(length);
        rustix::fs::fadvise(&self.file, offset, len, rustix::fs::Advice::WillNeed)
            .map_err(|e| Error::io("cache", offset, length, e.into()))
    }
    fn sparse_read_threshold(&self) -> Option<u64> {
        self.seek_holes.then_some(SPARSE_READ_THRESHOLD)
    }
    fn file_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        Some(self.file.as_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holes_zero_and_data() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("img");
        let f = File::create(&p).unwrap();
        f.set_len(4 << 20).unwrap();
        drop(f);
        let b = FileBackend::open(&p, false).unwrap();
        assert_eq!(b.size(), 4 << 20);
        b.write(&[7u8; 65536], 1 << 20, true).unwrap();
        let mut ex = Vec::new();
        b.extents(0, 4 << 20, 100, &mut ex).unwrap();
        assert_eq!(ex.iter().map(|e| e.length).sum::<u64>(), 4 << 20);
        if b.caps().extents {
            assert_eq!(ex[0].flags, HOLE);
            assert!(ex.iter().any(|e| e.flags == DATA));
        }
        b.zero(1 << 20, 4096, ZeroMode { may_trim: false, fast: false }, false).unwrap();
        let mut buf = vec![1u8; 8192];
        b.read(&mut buf, 1 << 20).unwrap();
        assert!(buf[..4096].iter().all(|&x| x == 0));
        assert!(buf[4096..].iter().all(|&x| x == 7));
        b.trim(0, 4 << 20, false).unwrap();
        b.flush().unwrap();
        if b.caps().extents {
            // The data hint from the first query must not survive the trim.
            ex.clear();
            b.extents(1 << 20, 65536, 100, &mut ex).unwrap();
            assert_eq!(ex, vec![Extent { length: 65536, flags: HOLE }]);
        }
        let ro = FileBackend::open(&p, true).unwrap();
        assert!(ro.caps().read_only);
        assert!(FileBackend::open(&dir.path().join("missing"), false).is_err());
    }
}
