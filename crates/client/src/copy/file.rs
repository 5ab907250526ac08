//! Local files and block devices: positioned reads and writes, SEEK_DATA/SEEK_HOLE for
//! the allocation map, fallocate for zeroes, and the file itself for sendfile payloads.

use super::endpoint::{push_range, read_each, write_each, Caps, Data, Done, Kind, Map, Ops, Read, Write};
use super::{pipe, zero_chunks, CopyError, ZEROES};
use ferry_sock::AlignedBuf;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub(crate) struct FileEnd {
    file: File,
    path: PathBuf,
    /// A block device (its size is fixed; zeroes are ZERO_RANGE, not holes).
    block: bool,
    /// Just created or emptied: every byte reads as zero already.
    fresh: bool,
    /// "source" or "destination", for messages.
    what: &'static str,
    size: Option<u64>,
    /// Taken around each write to a regular file, shared by every opening: the kernel
    /// runs one buffered write of a file at a time (the inode lock: ext4, XFS, tmpfs), and
    /// a writer queued there spins on a core while the other copies (a third of the CPU
    /// of a qcow2 -> raw copy on ext4, measured); queued here, it sleeps.
    write_lock: Option<Arc<Mutex<()>>>,
}

fn local<'p>(what: &'static str, path: &'p Path) -> impl FnOnce(io::Error) -> CopyError + 'p {
    move |source| CopyError::Local { what, path: path.display().to_string(), source }
}

/// The size of a block device (its metadata says 0).
fn device_size(f: &File, what: &'static str, p: &Path) -> Result<u64, CopyError> {
    rustix::fs::seek(f, rustix::fs::SeekFrom::End(0)).map_err(|e| local(what, p)(e.into()))
}

/// Opens a source: a regular file or block device, or a FIFO as a stream (read to its
/// end, like stdin). A character device is refused: it has no size, and many never end
/// (`/dev/zero`, `/dev/urandom`).
pub(crate) fn open_source(p: &Path) -> Result<Box<dyn Ops>, CopyError> {
    let ty = std::fs::metadata(p).map_err(local("cannot open source", p))?.file_type();
    if ty.is_char_device() {
        return Err(CopyError::Setup(format!(
            "source {} is a character device, which has no size (and may have no end); give it on stdin \
             as `-`, limited to the bytes wanted: `head -c SIZE {0} | ferry copy - DST`",
            p.display()
        )));
    }
    let file = File::open(p).map_err(local("cannot open source", p))?;
    if ty.is_fifo() {
        return Ok(Box::new(pipe::reader(file, p.display().to_string())));
    }
    let meta = file.metadata().map_err(local("cannot stat source", p))?;
    let block = meta.file_type().is_block_device();
    let size = if block { device_size(&file, "cannot size source", p)? } else { meta.len() };
    Ok(Box::new(FileEnd {
        file,
        path: p.to_owned(),
        block,
        fresh: false,
        what: "source",
        size: Some(size),
        write_lock: None,
    }))
}

/// Opens (or creates) a destination for a source of `src_size` bytes: a regular file is
/// emptied and sized to the source (all hole); a block device is used as it is; a
/// character device or a FIFO is written as a stream (in order, zeroes as data, nothing
/// sized, truncated or sought).
pub(crate) fn open_destination(p: &Path, src_size: Option<u64>, in_place: bool) -> Result<Box<dyn Ops>, CopyError> {
    let exists = std::fs::metadata(p).ok();
    if in_place {
        // Selected ranges update the previous copy: it must be there, and is kept.
        if exists.is_none() {
            return Err(CopyError::Setup(format!(
                "destination {} does not exist: a copy of selected ranges updates an earlier full copy in place, \
                 and -n writes into an existing destination",
                p.display()
            )));
        }
        let file = OpenOptions::new().write(true).open(p).map_err(local("cannot open destination", p))?;
        let block = ty_is_block(&exists);
        let size = device_size(&file, "cannot size destination", p)?;
        let write_lock = (!block).then(Arc::default);
        return Ok(Box::new(FileEnd {
            file,
            path: p.to_owned(),
            block,
            fresh: false,
            what: "destination",
            size: Some(size),
            write_lock,
        }));
    }
    let ty = exists.as_ref().map(|m| m.file_type());
    if ty.is_some_and(|t| t.is_char_device() || t.is_fifo()) {
        let file = OpenOptions::new().write(true).open(p).map_err(local("cannot open destination", p))?;
        return Ok(Box::new(pipe::writer(file, p.display().to_string())));
    }
    let block = ty.is_some_and(|t| t.is_block_device());
    if !block {
        // A copy makes the file exactly the source: empty it (then size it, all hole).
        // Through an opening of its own: ext4 writes a file truncated to zero back when
        // that opening closes (auto_da_alloc, for replace-by-truncate), which at the end
        // of a copy cost 0.2-0.5 s per GiB on this machine; closed empty, it writes nothing.
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(p)
            .map_err(local("cannot create destination", p))?;
    }
    let file = OpenOptions::new().write(true).open(p).map_err(local("cannot open destination", p))?;
    let size = if block {
        Some(device_size(&file, "cannot size destination", p)?)
    } else {
        if let Some(s) = src_size {
            file.set_len(s).map_err(local("cannot size destination", p))?;
        }
        src_size
    };
    let write_lock = (!block).then(Arc::default);
    Ok(Box::new(FileEnd { file, path: p.to_owned(), block, fresh: !block, what: "destination", size, write_lock }))
}

fn ty_is_block(m: &Option<std::fs::Metadata>) -> bool {
    m.as_ref().is_some_and(|m| m.file_type().is_block_device())
}

impl Ops for FileEnd {
    fn name(&self) -> String {
        self.path.display().to_string()
    }

    fn size(&self) -> Option<u64> {
        self.size
    }

    fn caps(&self) -> Caps {
        Caps { parallel: true, zero: true, zeroed: self.fresh, extents: true, ..Caps::default() }
    }

    fn reopen(&self) -> Result<Box<dyn Ops>, CopyError> {
        let what = if self.what == "source" { "cannot reopen source" } else { "cannot reopen destination" };
        let file = self.file.try_clone().map_err(local(what, &self.path))?;
        Ok(Box::new(FileEnd { file, path: self.path.clone(), write_lock: self.write_lock.clone(), ..*self }))
    }

    fn extents(&mut self, size: u64) -> Result<Map, CopyError> {
        Ok(file_map(&self.file, size))
    }

    fn file(&self) -> Option<&File> {
        Some(&self.file)
    }

    fn read(&mut self, reqs: &[Read], bufs: &mut [AlignedBuf], done: &mut Done<'_>) -> Result<(), CopyError> {
        read_each(reqs, bufs, done, |buf, at| self.file.read_exact_at(buf, at))
    }

    fn write(&mut self, reqs: &[Write<'_>], done: &mut Done<'_>) -> Result<(), CopyError> {
        write_each(reqs, done, |w| match w.data {
            Data::Bytes(b) => {
                let _turn = self.write_lock.as_ref().map(|l| l.lock().unwrap_or_else(|e| e.into_inner()));
                self.file.write_all_at(b, w.offset)
            }
            Data::Zero(n) => zero_file(&self.file, self.block, w.offset, n),
            Data::File { .. } => Err(io::Error::other("a file takes no file payloads")),
        })
    }

    fn set_stream_length(&mut self, len: u64) -> Result<(), CopyError> {
        if !self.block {
            self.file.set_len(len).map_err(local("cannot size destination", &self.path))?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), CopyError> {
        self.file.sync_all().map_err(|e| CopyError::Local { what: "cannot flush", path: self.name(), source: e })
    }
}

/// Allocation map of a local file, from SEEK_DATA/SEEK_HOLE (all data where unsupported).
fn file_map(f: &File, size: u64) -> Map {
    use rustix::fs::{seek, SeekFrom};
    use std::os::unix::fs::MetadataExt;
    // On tmpfs one SEEK_HOLE scans every page up to the next hole (24 ms for 2 GiB, all
    // before the first byte is copied), so a tmpfs file with as many bytes allocated as it
    // is long is taken as all data without asking. The one case that misses: fallocated
    // pages never written read as zeroes, which zero detection then finds. Elsewhere
    // (ext4, XFS: extent maps) asking is cheap, and preallocated files are common there.
    const TMPFS_MAGIC: u64 = 0x0102_1994;
    let tmpfs = rustix::fs::fstatfs(f).is_ok_and(|s| s.f_type as u64 == TMPFS_MAGIC);
    if tmpfs && f.metadata().is_ok_and(|m| m.is_file() && m.blocks().saturating_mul(512) >= size) {
        return vec![(0, size, Kind::Data)];
    }
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < size {
        let data = match seek(f, SeekFrom::Data(pos)) {
            Ok(d) => d.min(size),
            Err(rustix::io::Errno::NXIO) => size,
            Err(_) => return vec![(0, size, Kind::Data)],
        };
        if data > pos {
            push_range(&mut out, pos, data - pos, Kind::Zero);
            pos = data;
            continue;
        }
        let hole = match seek(f, SeekFrom::Hole(pos)) {
            Ok(h) => h.clamp(pos + 1, size),
            Err(_) => size,
        };
        push_range(&mut out, pos, hole - pos, Kind::Data);
        pos = hole;
    }
    out
}

/// Zeroes a range of an existing file or block device.
fn zero_file(f: &File, block: bool, offset: u64, len: u64) -> io::Result<()> {
    use rustix::fs::{fallocate, FallocateFlags};
    let flags = if block { FallocateFlags::ZERO_RANGE } else { FallocateFlags::PUNCH_HOLE } | FallocateFlags::KEEP_SIZE;
    if fallocate(f, flags, offset, len).is_ok() {
        return Ok(());
    }
    zero_chunks(offset, len).try_for_each(|(at, k)| f.write_all_at(&ZEROES[..k], at))
}
