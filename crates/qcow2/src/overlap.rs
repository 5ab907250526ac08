//! What keeps a writable image's metadata safe from writes that would destroy it.
//!
//! * **The metadata map.** Every cluster holding metadata (header, L1 table, L2 tables,
//!   refcount table and blocks, bitmap directory, tables and data) is claimed in an
//!   ordered set, built at open from the L1 table, the refcount table and the bitmap
//!   directory (no L2 table is read), and kept current through [`Store`]'s
//!   `metadata_allocated` and `cluster_freed` hooks.
//! * **The guard.** A writable image reads and writes its file through two [`Guard`]s:
//!   one for guest data, one for metadata. Every write is checked against the map (one
//!   ordered-set lookup): guest data must touch no metadata, and metadata must not touch
//!   a cluster that two kinds of metadata claim (an L2 table where the refcount table
//!   is, say). A write that fails the check is refused with EIO, the corrupt bit is set
//!   in the header and the overlap logged, as qemu does ("Preventing invalid write on
//!   metadata"), and from then on every write is refused while reads go on.
//! * **The first write.** Before anything is written (and before a write is recorded
//!   in them), the guard marks the enabled persistent bitmaps `in_use` and clears the
//!   autoclear bits ferry does not maintain, synced; a clean close writes the bitmaps
//!   back and clears `in_use` (`persist.rs`), so only a crash leaves them in use. A
//!   read-only open, or a writable one that never writes, changes nothing.
//! * **Clusters past the end of the file.** At open, L2 tables, refcount blocks, bitmap
//!   clusters and the highest counted cluster are compared with the file's size (cheap:
//!   no L2 table is read); an L2 table is checked for data clusters past the end when it
//!   is loaded. Read-only, that is a warning; read-write it is refused unless the caller
//!   allows it ([`crate::Options::allow_truncated`]), and a write through an L2 table that
//!   maps clusters past the end marks the image corrupt.

use crate::bitmaps::{self, FLAG_IN_USE};
use crate::header::{Header, AUTOCLEAR_AT, AUTOCLEAR_BITMAPS, INCOMPATIBLE_AT, INCOMPAT_CORRUPT};
use crate::map::{Geometry, OFFSET_MASK, OFLAG_COMPRESSED};
use crate::store::Store;
use crate::{io_err, Qcow2Error};
use std::collections::BTreeSet;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// A kind of metadata, as claimed in the map and named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Metadata {
    Header,
    L1Table,
    /// The L2 table of this L1 entry.
    L2Table(u32),
    RefcountTable,
    /// The refcount block of this refcount table entry.
    RefcountBlock(u32),
    BitmapDirectory,
    /// The table of the n-th bitmap in the directory.
    BitmapTable(u32),
    /// A data cluster of the n-th bitmap.
    BitmapData(u32),
}

impl Metadata {
    /// Structures of one kind may share clusters (two L1 entries, one L2 table); two
    /// kinds never.
    fn kind(self) -> u8 {
        match self {
            Metadata::Header => 0,
            Metadata::L1Table => 1,
            Metadata::L2Table(_) => 2,
            Metadata::RefcountTable => 3,
            Metadata::RefcountBlock(_) => 4,
            Metadata::BitmapDirectory => 5,
            Metadata::BitmapTable(_) => 6,
            Metadata::BitmapData(_) => 7,
        }
    }
}

impl std::fmt::Display for Metadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Metadata::Header => write!(f, "the image header"),
            Metadata::L1Table => write!(f, "the L1 table"),
            Metadata::L2Table(i) => write!(f, "the L2 table of L1 entry {i}"),
            Metadata::RefcountTable => write!(f, "the refcount table"),
            Metadata::RefcountBlock(i) => write!(f, "refcount block {i}"),
            Metadata::BitmapDirectory => write!(f, "the bitmap directory"),
            Metadata::BitmapTable(i) => write!(f, "the table of bitmap {i}"),
            Metadata::BitmapData(i) => write!(f, "a data cluster of bitmap {i}"),
        }
    }
}

/// Metadata clusters: (cluster index, what). A cluster two structures claim has two
/// entries.
#[derive(Default)]
struct Claims {
    set: BTreeSet<(u64, Metadata)>,
    /// L2 tables (host offsets) found mapping clusters past the end of the file.
    truncated_l2: BTreeSet<u64>,
}

/// Whom a guard writes for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Data,
    Metadata,
}

/// What the first write must do first.
struct FirstWrite {
    /// Bitmaps to mark in use: (file offset of the flags field, new flags, name).
    in_use: Vec<(u64, u32, String)>,
    /// The autoclear bits to keep, when some must be cleared.
    autoclear: Option<u64>,
}

/// State shared by an image's two guards.
pub struct Shared {
    name: String,
    inner: Arc<dyn Store>,
    cluster_bits: u32,
    incompatible: u64,
    allow_truncated: bool,
    claims: RwLock<Claims>,
    corrupt: AtomicBool,
    prepared: AtomicBool,
    first_write: Mutex<Option<FirstWrite>>,
    /// The first-write hook marked bitmaps in use on disk.
    marked: AtomicBool,
}

impl Shared {
    fn claims(&self) -> std::sync::RwLockReadGuard<'_, Claims> {
        self.claims.read().unwrap_or_else(|e| e.into_inner())
    }

    fn claims_mut(&self) -> std::sync::RwLockWriteGuard<'_, Claims> {
        self.claims.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the image corrupt (once: header bit, synced, and an error logged) and
    /// returns the error for the write that found it.
    fn corrupt(&self, what: String) -> Qcow2Error {
        if !self.corrupt.swap(true, Ordering::AcqRel) {
            log::error!(
                "{}: {what}; the image is now marked corrupt: ferry refuses every further write to it \
                 (reads go on); check and repair it with qemu-img check -r all",
                self.name
            );
            let bits = (self.incompatible | INCOMPAT_CORRUPT).to_be_bytes();
            if let Err(e) = self.inner.write_at(&bits, INCOMPATIBLE_AT).and_then(|()| self.inner.sync()) {
                log::error!("{}: cannot set the corrupt bit in the header: {e}", self.name);
            }
        }
        Qcow2Error::Corrupt(format!("{what}; the write was refused"))
    }

    fn refuse_if_corrupt(&self) -> Result<(), Qcow2Error> {
        if self.corrupt.load(Ordering::Acquire) {
            return Err(Qcow2Error::Corrupt(
                "an earlier write would have overwritten its metadata, so ferry refuses every further write \
                 (reads go on)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// What a write of `len` bytes at `offset` would overwrite: for guest data, any
    /// metadata; for metadata, a cluster two kinds of metadata claim. Returns the
    /// cluster's offset and the metadata there (two for a shared cluster).
    fn conflict(&self, role: Role, offset: u64, len: u64) -> Option<(u64, Metadata, Option<Metadata>)> {
        if len == 0 {
            return None;
        }
        let first = offset >> self.cluster_bits;
        let last = (offset + len - 1) >> self.cluster_bits;
        let claims = self.claims();
        let mut hits = claims.set.range((first, Metadata::Header)..(last + 1, Metadata::Header));
        let (c, a, b) = match role {
            Role::Data => hits.next().map(|&(c, m)| (c, m, None))?,
            Role::Metadata => {
                let mut prev: Option<(u64, Metadata)> = None;
                hits.find_map(|&(c, m)| {
                    let shared =
                        prev.filter(|&(pc, pm)| pc == c && pm.kind() != m.kind()).map(|(_, pm)| (c, pm, Some(m)));
                    prev = Some((c, m));
                    shared
                })?
            }
        };
        Some((c << self.cluster_bits, a, b))
    }

    /// Refuses (marking the image corrupt) a write that fails the check.
    fn check(&self, role: Role, offset: u64, len: u64) -> Result<(), Qcow2Error> {
        let Some((at, a, b)) = self.conflict(role, offset, len) else { return Ok(()) };
        Err(self.corrupt(match b {
            None => format!("refused a write of guest data at host offset {offset:#x} ({len} bytes): it would overwrite {a} at {at:#x}"),
            Some(b) => format!("refused a metadata write at host offset {offset:#x}: {a} and {b} share the cluster at {at:#x}"),
        }))
    }

    /// Marks bitmaps in use and clears autoclear bits, once, before the first write.
    fn before_write(&self) -> Result<(), Qcow2Error> {
        self.refuse_if_corrupt()?;
        if self.prepared.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut pending = self.first_write.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(fw) = pending.as_ref() {
            for (at, flags, _) in &fw.in_use {
                self.inner
                    .write_at(&flags.to_be_bytes(), *at)
                    .map_err(io_err("cannot mark a persistent bitmap in use before the first write"))?;
            }
            if let Some(bits) = fw.autoclear {
                self.inner
                    .write_at(&bits.to_be_bytes(), AUTOCLEAR_AT)
                    .map_err(io_err("cannot clear the autoclear feature bits before the first write"))?;
            }
            self.inner.sync().map_err(io_err("cannot sync the header before the first write"))?;
            if !fw.in_use.is_empty() {
                self.marked.store(true, Ordering::Release);
            }
            *pending = None;
        }
        self.prepared.store(true, Ordering::Release);
        Ok(())
    }
}

fn to_io(e: Qcow2Error) -> io::Error {
    match e {
        Qcow2Error::Io { what, source } => io::Error::new(source.kind(), format!("{what}: {source}")),
        other => io::Error::other(other.to_string()),
    }
}

/// A writable image's file, as the format layer writes it: every write checked (see
/// the module's comment).
pub struct Guard {
    shared: Arc<Shared>,
    role: Role,
}

impl Store for Guard {
    fn size(&self) -> u64 {
        self.shared.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.shared.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.shared.before_write().map_err(to_io)?;
        self.shared.check(self.role, offset, buf.len() as u64).map_err(to_io)?;
        self.shared.inner.write_at(buf, offset)
    }
    fn sync(&self) -> io::Result<()> {
        self.shared.inner.sync()
    }
    fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.shared.inner.fd()
    }
    fn open_file(&self) -> Option<ferry_backend::OpenFile> {
        self.shared.inner.open_file()
    }
    /// Freed clusters only: one that still holds metadata is never punched out.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.shared.check(Role::Data, offset, len).map_err(to_io)?;
        self.shared.inner.discard(offset, len)
    }
    /// Free clusters at the end only: the file is never cut under metadata.
    fn truncate(&self, len: u64) -> io::Result<()> {
        let size = self.shared.inner.size();
        if size > len {
            self.shared.check(Role::Data, len, size - len).map_err(to_io)?;
        }
        self.shared.inner.truncate(len)
    }
    fn metadata_allocated(&self, what: Metadata, offset: u64, len: u64) {
        let bits = self.shared.cluster_bits;
        let mut claims = self.shared.claims_mut();
        for c in offset >> bits..(offset + len.max(1)).div_ceil(1 << bits) {
            claims.set.insert((c, what));
        }
    }
    fn cluster_freed(&self, offset: u64) {
        // Called for every freed cluster, nearly all guest data with no claim: a shared
        // look first, the exclusive lock only for a cluster that held metadata.
        let c = offset >> self.shared.cluster_bits;
        let span = (c, Metadata::Header)..(c + 1, Metadata::Header);
        if self.shared.claims().set.range(span.clone()).next().is_none() {
            return;
        }
        let mut claims = self.shared.claims_mut();
        while let Some(&g) = claims.set.range(span.clone()).next() {
            claims.set.remove(&g);
        }
    }
}

/// An image's safety state: the guards' shared part when it is writable.
pub struct Safety {
    shared: Option<Arc<Shared>>,
    /// What past the end of the file was already warned about (once per image).
    warned_past_eof: AtomicBool,
}

/// What [`survey`] found.
struct Survey {
    /// Built for writable images only.
    build: bool,
    claims: BTreeSet<(u64, Metadata)>,
    /// Descriptions of clusters past the end of the file (the first few).
    past_eof: Vec<String>,
    past_eof_count: usize,
}

impl Survey {
    fn claim(&mut self, bits: u32, what: Metadata, offset: u64, len: u64, file_len: u64) {
        if self.build {
            for c in offset >> bits..(offset + len.max(1)).div_ceil(1 << bits) {
                self.claims.insert((c, what));
            }
        }
        if offset >= file_len {
            self.past(format!("{what} at {offset:#x}"));
        }
    }

    fn past(&mut self, what: String) {
        if self.past_eof.len() < 4 {
            self.past_eof.push(what);
        }
        self.past_eof_count += 1;
    }
}

/// The highest cluster a refcount block counts, if any (any refcount width).
fn highest_counted(block: &[u8], refcount_order: u32) -> Option<u64> {
    let p = block.iter().rposition(|&b| b != 0)? as u64;
    let bits = 1u64 << refcount_order;
    Some(if bits >= 8 {
        p / (bits / 8)
    } else {
        // Entries narrower than a byte fill it from the least significant bit.
        let top = 7 - u64::from(block[p as usize].leading_zeros());
        p * (8 / bits) + top / bits
    })
}

/// Claims every metadata cluster found from the header, the L1 table, the refcount
/// table and the bitmaps, and notes which lie past the end of the file.
fn survey(
    store: &dyn Store,
    h: &Header,
    l1: &[u64],
    bitmaps: &[bitmaps::Loaded],
    bitmap_dir: Option<(u64, u64)>,
    build: bool,
) -> Result<Survey, Qcow2Error> {
    let file_len = store.size();
    let cs = h.cluster_size();
    let bits = h.cluster_bits;
    let mut s = Survey { build, claims: BTreeSet::new(), past_eof: Vec::new(), past_eof_count: 0 };
    s.claim(bits, Metadata::Header, 0, cs, file_len);
    s.claim(bits, Metadata::L1Table, h.l1_table_offset, u64::from(h.l1_size) * 8, file_len);
    for (i, e) in l1.iter().enumerate() {
        let off = e & OFFSET_MASK;
        if off != 0 {
            s.claim(bits, Metadata::L2Table(i as u32), off, cs, file_len);
        }
    }
    let rt_bytes = u64::from(h.refcount_table_clusters) * cs;
    s.claim(bits, Metadata::RefcountTable, h.refcount_table_offset, rt_bytes, file_len);
    let table: Vec<u64> = crate::refcount::read_table(store, h)?.into_iter().map(|e| e & OFFSET_MASK).collect();
    for (i, &off) in table.iter().enumerate() {
        if off != 0 {
            s.claim(bits, Metadata::RefcountBlock(i as u32), off, cs, file_len);
        }
    }
    // The highest counted cluster: from the last refcount block back (a few at most).
    let per_block = (cs * 8) >> h.refcount_order;
    let mut block = vec![0u8; cs as usize];
    for (i, &off) in table.iter().enumerate().rev().filter(|(_, &o)| o != 0).take(16) {
        store.read_at(&mut block, off).map_err(io_err(format!("cannot read the refcount block at {off:#x}")))?;
        if let Some(top) = highest_counted(&block, h.refcount_order) {
            let at = (i as u64 * per_block + top).saturating_mul(cs);
            if at >= file_len {
                s.past(format!("the refcounts count clusters up to {at:#x}"));
            }
            break;
        }
    }
    if let Some((off, len)) = bitmap_dir {
        s.claim(bits, Metadata::BitmapDirectory, off, len, file_len);
    }
    for (i, l) in bitmaps.iter().enumerate() {
        let b = &l.entry;
        if b.table_size > 0 {
            s.claim(bits, Metadata::BitmapTable(i as u32), b.table_offset, u64::from(b.table_size) * 8, file_len);
        }
        for d in l.table.iter().map(|&e| e & bitmaps::TABLE_OFFSET_MASK).filter(|&d| d != 0) {
            s.claim(bits, Metadata::BitmapData(i as u32), d, cs, file_len);
        }
    }
    Ok(s)
}

impl Safety {
    /// Surveys an image at open. Writable: parses the bitmaps, builds the metadata map,
    /// and refuses an image with clusters past the end of the file unless
    /// `allow_truncated`. Read-only: warns about such clusters.
    pub fn open(
        name: &str,
        store: &Arc<dyn Store>,
        h: &Header,
        l1: &[u64],
        writable: bool,
        allow_truncated: bool,
        set: &bitmaps::Set,
    ) -> Result<Safety, Qcow2Error> {
        let ext = set.ext;
        let bms = &set.list;
        let s = survey(&**store, h, l1, bms, ext.map(|x| (x.directory_offset, x.directory_size)), writable)?;
        if s.past_eof_count > 0 {
            let what = format!(
                "the image uses clusters past the end of its file ({} bytes): {}{}; the file was cut short (an \
                 interrupted copy?) or the image is corrupt, and what is missing reads as zeroes",
                store.size(),
                s.past_eof.join(", "),
                match s.past_eof_count - s.past_eof.len() {
                    0 => String::new(),
                    n => format!(" and {n} more"),
                },
            );
            if writable && !allow_truncated {
                return Err(Qcow2Error::Corrupt(format!(
                    "{what}. ferry refuses to write to it: serve it --read-only, or pass --allow-truncated to \
                     write to it anyway"
                )));
            }
            log::warn!("{name}: {what}; check it with qemu-img check");
        }
        if !writable {
            return Ok(Safety { shared: None, warned_past_eof: AtomicBool::new(false) });
        }
        let in_use: Vec<(u64, u32, String)> = bms
            .iter()
            .map(|l| &l.entry)
            .filter(|b| b.needs_in_use())
            .map(|b| (b.flags_at, b.flags | FLAG_IN_USE, b.name.clone()))
            .collect();
        // Bit 0 stays when the bitmaps are kept consistent (in use where ferry would
        // leave them stale); every other autoclear bit is one ferry does not maintain.
        let keep = h.autoclear & if ext.is_some() { AUTOCLEAR_BITMAPS } else { 0 };
        let first_write = FirstWrite { in_use, autoclear: (keep != h.autoclear).then_some(keep) };
        let pending = !first_write.in_use.is_empty() || first_write.autoclear.is_some();
        let shared = Shared {
            name: name.to_string(),
            inner: store.clone(),
            cluster_bits: h.cluster_bits,
            incompatible: h.incompatible,
            allow_truncated,
            claims: RwLock::new(Claims { set: s.claims, truncated_l2: BTreeSet::new() }),
            corrupt: AtomicBool::new(false),
            prepared: AtomicBool::new(!pending),
            first_write: Mutex::new(pending.then_some(first_write)),
            marked: AtomicBool::new(false),
        };
        Ok(Safety { shared: Some(Arc::new(shared)), warned_past_eof: AtomicBool::new(false) })
    }

    /// The image's file for metadata and for guest data: checking guards when writable.
    pub fn wrap(&self, store: Arc<dyn Store>, data: Arc<dyn Store>) -> (Arc<dyn Store>, Arc<dyn Store>) {
        match &self.shared {
            Some(sh) => (
                Arc::new(Guard { shared: sh.clone(), role: Role::Metadata }),
                Arc::new(Guard { shared: sh.clone(), role: Role::Data }),
            ),
            None => (store, data),
        }
    }

    /// Refuses writes once the image was marked corrupt.
    pub fn refuse_if_corrupt(&self) -> Result<(), Qcow2Error> {
        self.shared.as_ref().map_or(Ok(()), |s| s.refuse_if_corrupt())
    }

    /// Runs the first-write hook now (before a write is recorded in the bitmaps).
    pub fn before_write(&self) -> Result<(), Qcow2Error> {
        self.shared.as_ref().map_or(Ok(()), |s| s.before_write())
    }

    /// After the bitmaps were written back (not in use on disk any more): the next write
    /// marks `in_use` (file offset of the flags, new flags, name) first again.
    pub fn rearm_in_use(&self, in_use: Vec<(u64, u32, String)>) {
        let Some(sh) = &self.shared else { return };
        let mut pending = sh.first_write.lock().unwrap_or_else(|e| e.into_inner());
        sh.marked.store(false, Ordering::Release);
        if !in_use.is_empty() {
            *pending = Some(FirstWrite { in_use, autoclear: None });
            sh.prepared.store(false, Ordering::Release);
        }
    }

    /// Whether the first-write hook marked bitmaps in use on disk (they must be written
    /// back and the mark cleared at close).
    pub fn bitmaps_marked(&self) -> bool {
        self.shared.as_ref().is_some_and(|s| s.marked.load(Ordering::Acquire))
    }

    pub fn is_corrupt(&self) -> bool {
        self.shared.as_ref().is_some_and(|s| s.corrupt.load(Ordering::Acquire))
    }

    /// A freshly read L2 table (`raw` words at host offset `l2_off`): clusters it maps
    /// at or past `limit` (the end of the data file; writable, the first cluster never
    /// counted nor allocated) are warned about (read-only, or allowed) or make the table
    /// one no write may go through.
    pub fn l2_loaded(&self, name: &str, geo: &Geometry, l2_off: u64, raw: &[u64], limit: u64) {
        let step = if geo.extended_l2 { 2 } else { 1 };
        let past = raw.iter().step_by(step).find_map(|&e| {
            let host = if e & OFLAG_COMPRESSED != 0 {
                e & ((1u64 << (62 - (geo.cluster_bits - 8))) - 1)
            } else {
                e & OFFSET_MASK
            };
            (host != 0 && host >= limit).then_some(host)
        });
        let Some(host) = past else { return };
        match &self.shared {
            Some(sh) if !sh.allow_truncated => {
                sh.claims_mut().truncated_l2.insert(l2_off);
                log::error!(
                    "{name}: the L2 table at {l2_off:#x} maps guest data to {host:#x}, a cluster past the end of \
                     the file that no refcount counts: it reads as zeroes, and writes through this table are refused"
                );
            }
            _ => {
                if !self.warned_past_eof.swap(true, Ordering::AcqRel) {
                    log::warn!(
                        "{name}: the L2 table at {l2_off:#x} maps guest data to {host:#x}, past the end of the file \
                         ({limit:#x}): it reads as zeroes; check the image with qemu-img check"
                    );
                }
            }
        }
    }

    /// Before a write changes the L2 table at `l2_off` (of L1 entry `l1_index`): the
    /// table must not share a cluster with other metadata nor map clusters past the end
    /// of the file.
    pub fn check_l2_write(&self, l1_index: usize, l2_off: u64, guest: u64) -> Result<(), Qcow2Error> {
        let Some(sh) = &self.shared else { return Ok(()) };
        sh.refuse_if_corrupt()?;
        if sh.claims().truncated_l2.contains(&l2_off) {
            return Err(sh.corrupt(format!(
                "refused a write at guest offset {guest}: its L2 table at {l2_off:#x} maps clusters past the end of \
                 the file"
            )));
        }
        match sh.conflict(Role::Metadata, l2_off, 1 << sh.cluster_bits) {
            None => Ok(()),
            Some((at, a, b)) => {
                let other = if matches!(a, Metadata::L2Table(_)) { b.unwrap_or(a) } else { a };
                Err(sh.corrupt(format!(
                    "refused a write at guest offset {guest}: its L2 table (L1 entry {l1_index}) at {l2_off:#x} would \
                     overwrite {other} at {at:#x}"
                )))
            }
        }
    }
}

pub(crate) fn cannot_mark(e: Qcow2Error) -> Qcow2Error {
    let e = match e {
        Qcow2Error::Corrupt(m) => m,
        other => other.to_string(),
    };
    Qcow2Error::Corrupt(format!(
        "{e}; ferry must keep the image's dirty bitmaps true when writing to it and cannot read them: serve it \
         --read-only, or remove the bitmaps with qemu-img bitmap --remove"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Options, Qcow2};
    use ferry_backend::Backend;

    /// An image (4 KiB clusters, 2 MiB per L2 table) whose guest cluster 1 is mapped to
    /// the cluster where the next allocation will go, just past the end of the file.
    fn image_mapping_past_its_end(dir: &std::path::Path) -> std::path::PathBuf {
        let p = dir.join("t.qcow2");
        {
            let q = Qcow2::create(&p, 8 << 20, 4096).unwrap();
            q.write(&[1; 4096], 0, false).unwrap();
        }
        let mut b = std::fs::read(&p).unwrap();
        let end = b.len() as u64;
        let l2 = crate::header::be64(&b, crate::header::be64(&b, 40) as usize) & OFFSET_MASK;
        b[l2 as usize + 8..l2 as usize + 16].copy_from_slice(&(end | crate::map::OFLAG_COPIED).to_be_bytes());
        std::fs::write(&p, &b).unwrap();
        p
    }

    fn corrupt_bit(p: &std::path::Path) -> bool {
        std::fs::read(p).unwrap()[79] & 2 != 0
    }

    #[test]
    fn writes_through_an_l2_table_mapping_past_the_end_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = image_mapping_past_its_end(dir.path());
        let q = Qcow2::open(&p, false).unwrap();
        let e = q.write(&[2; 4096], 8192, false).unwrap_err().to_string();
        assert!(e.contains("past the end of the file"), "{e}");
        let mut b = vec![0u8; 4096];
        q.read(&mut b, 0).unwrap();
        assert_eq!(b, [1; 4096]);
        drop(q);
        assert!(corrupt_bit(&p));
    }

    #[test]
    fn metadata_allocated_while_writing_is_guarded() {
        let dir = tempfile::tempdir().unwrap();
        let p = image_mapping_past_its_end(dir.path());
        let q =
            Qcow2::open_with(&p, &Options { read_only: false, allow_truncated: true, ..Options::default() }).unwrap();
        // L1 entry 1's new L2 table takes the cluster guest cluster 1 points at.
        q.write(&[3; 4096], 2 << 20, false).unwrap();
        let e = q.write(&[2; 4096], 4096, false).unwrap_err().to_string();
        assert!(e.contains("would overwrite the L2 table of L1 entry 1"), "{e}");
        // Reads go on; writes do not, even harmless ones.
        let mut b = vec![0u8; 4096];
        q.read(&mut b, 2 << 20).unwrap();
        assert_eq!(b, [3; 4096]);
        assert!(q.write(&[4; 512], 0, false).unwrap_err().to_string().contains("refuses every further write"));
        drop(q);
        assert!(corrupt_bit(&p));
    }

    #[test]
    fn highest_counted_cluster_of_any_width() {
        let mut b = vec![0u8; 512];
        assert_eq!(highest_counted(&b, 4), None);
        b[7] = 1; // 16-bit entry 3
        assert_eq!(highest_counted(&b, 4), Some(3));
        assert_eq!(highest_counted(&b, 3), Some(7));
        assert_eq!(highest_counted(&b, 6), Some(0));
        b[7] = 0b0100_0000; // 1-bit entry 7*8+6, 2-bit entry 7*4+3, 4-bit entry 7*2+1
        assert_eq!(highest_counted(&b, 0), Some(62));
        assert_eq!(highest_counted(&b, 1), Some(31));
        assert_eq!(highest_counted(&b, 2), Some(15));
    }
}
