//! Where an image's bytes live: a local file, or any [`Backend`] (an RBD image, memory).
//!
//! The format layer reads and writes its container through this trait only, so qcow2 on
//! a file and qcow2 on another store are the same code. Reads past the end of the store
//! read as zeroes (as qemu's file driver does), never as an error or a panic.

use crate::overlap::Metadata;
use ferry_backend::{Backend, FileId, Locking, OpenFile};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub trait Store: Send + Sync {
    /// Current length in bytes.
    fn size(&self) -> u64;
    /// Fills `buf` from `offset`; bytes past the end read as zeroes.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes `buf` at `offset`, growing the store when needed.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes completed writes durable.
    fn sync(&self) -> io::Result<()>;
    /// The file descriptor, for sendfile(2) of data clusters.
    fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }
    /// The store's content identity ([`Backend::identity`]), for a resumed copy.
    fn identity(&self) -> Option<String> {
        None
    }
    /// The format layer put metadata `what` at `offset..offset + len`: a checking store
    /// (a writable image's `overlap::Guard`) refuses guest data written there from now on.
    fn metadata_allocated(&self, _what: Metadata, _offset: u64, _len: u64) {}
    /// The cluster at `offset` was freed (its refcount fell to 0): it holds no metadata.
    fn cluster_freed(&self, _offset: u64) {}
    /// Gives the space of a range no longer used back (its bytes become unspecified);
    /// advisory: a store that cannot does nothing.
    fn discard(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    /// Cuts the store to `len` bytes, when it can shrink (nothing is used past `len`).
    fn truncate(&self, _len: u64) -> io::Result<()> {
        Ok(())
    }
    /// The local file, for telling two openings of one file apart.
    fn open_file(&self) -> Option<OpenFile> {
        None
    }
}

/// A local file.
pub struct FileStore {
    file: File,
    path: std::path::PathBuf,
    writable: bool,
    len: AtomicU64,
    /// Writes take turns here: the kernel runs one buffered write of a file at a time
    /// (the inode lock: ext4, XFS, tmpfs), and a writer queued there spins on a core
    /// while the other copies (30% of the CPU of a raw -> qcow2 copy on ext4, measured);
    /// queued here, it sleeps.
    write_turn: Mutex<()>,
}

impl FileStore {
    /// Opens `path` with the locks `locking` (see [`ferry_backend::lock`]), held as long
    /// as the store.
    pub fn open(path: &std::path::Path, writable: bool, locking: Locking) -> io::Result<FileStore> {
        let file = std::fs::OpenOptions::new().read(true).write(writable).open(path)?;
        ferry_backend::lock::lock(&file, path, locking)?;
        let len = file.metadata()?.len();
        Ok(FileStore { file, path: path.to_owned(), writable, len: AtomicU64::new(len), write_turn: Mutex::new(()) })
    }
}

impl Store for FileStore {
    fn size(&self) -> u64 {
        self.len.load(Ordering::Acquire)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let len = self.size();
        let avail = len.saturating_sub(offset).min(buf.len() as u64) as usize;
        let (data, past) = buf.split_at_mut(avail);
        past.fill(0);
        if data.is_empty() {
            return Ok(());
        }
        // The file may have been shortened behind our back: a short read is zeroes too.
        let mut done = 0;
        while done < data.len() {
            match self.file.read_at(&mut data[done..], offset + done as u64) {
                Ok(0) => {
                    data[done..].fill(0);
                    break;
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let turn = self.write_turn.lock().unwrap_or_else(|e| e.into_inner());
        self.file.write_all_at(buf, offset)?;
        drop(turn);
        self.len.fetch_max(offset + buf.len() as u64, Ordering::AcqRel);
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        Some(self.file.as_fd())
    }
    /// Punches a hole (the file keeps its size); a file system without holes keeps the
    /// bytes.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        use rustix::fs::{fallocate, FallocateFlags};
        match fallocate(&self.file, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, len) {
            Ok(()) => Ok(()),
            Err(e) if e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::NOSYS => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
    fn truncate(&self, len: u64) -> io::Result<()> {
        let turn = self.write_turn.lock().unwrap_or_else(|e| e.into_inner());
        self.file.set_len(len)?;
        self.len.store(len, Ordering::Release);
        drop(turn);
        Ok(())
    }
    fn open_file(&self) -> Option<OpenFile> {
        let id = FileId::of(&self.file).ok()?;
        Some(OpenFile { id, path: self.path.clone(), writable: self.writable })
    }
}

/// Any backend as a store, for images opened read-only (`Qcow2::open_on`): it cannot grow,
/// so a write past its size fails with ENOSPC.
pub struct BackendStore(pub Arc<dyn Backend>);

impl Store for BackendStore {
    fn identity(&self) -> Option<String> {
        self.0.identity()
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let len = self.size();
        let avail = len.saturating_sub(offset).min(buf.len() as u64) as usize;
        let (data, past) = buf.split_at_mut(avail);
        past.fill(0);
        if !data.is_empty() {
            self.0.read(data, offset).map_err(io::Error::other)?;
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if offset.checked_add(buf.len() as u64).is_none_or(|e| e > self.size()) {
            return Err(io::Error::from_raw_os_error(28)); // ENOSPC: the store cannot grow
        }
        self.0.write(buf, offset, false).map_err(io::Error::other)
    }
    fn sync(&self) -> io::Result<()> {
        self.0.flush().map_err(io::Error::other)
    }
}
