//! Persistent dirty bitmaps (qemu's docs/interop/qcow2.rst, "Bitmaps extension",
//! "Bitmap directory", "Bitmap table"): parsed, checked and loaded into memory at open.
//!
//! Every bitmap's bits are loaded on open (read-only too: `qemu:dirty-bitmap:NAME`
//! metadata contexts are served from them). A writable open records every WRITE,
//! WRITE_ZEROES and TRIM in the enabled (`auto`) bitmaps, after the first-write hook
//! (`overlap.rs`) marked them `in_use` on disk; a clean close writes them back and
//! clears `in_use` (`persist.rs`). A bitmap found `in_use` at open was left by a crash:
//! it is inconsistent, never offered nor changed, and kept as it is until removed.
//! Bitmaps without `auto` are disabled: writes do not concern them.
//!
//! Every size is checked against the spec's and qemu's limits before anything is
//! allocated from it; a hostile directory or table is an error naming the bitmap.

use crate::header::{be32, be64, Header, AUTOCLEAR_BITMAPS};
use crate::store::Store;
use crate::{io_err, Qcow2Error};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use ferry_proto::consts::STATE_DIRTY;
/// Directory entry flags.
pub const FLAG_IN_USE: u32 = 1 << 0;
pub const FLAG_AUTO: u32 = 1 << 1;
pub const FLAG_EXTRA_DATA_COMPATIBLE: u32 = 1 << 2;
const FLAGS_KNOWN: u32 = FLAG_IN_USE | FLAG_AUTO | FLAG_EXTRA_DATA_COMPATIBLE;
/// Bitmap type 1: dirty tracking bitmap (the only one defined).
pub const TYPE_DIRTY_TRACKING: u8 = 1;
/// Granularities: 512 B to 2 GiB.
pub const MIN_GRANULARITY_BITS: u32 = 9;
pub const MAX_GRANULARITY_BITS: u32 = 31;
/// Bits held in memory in all (every bitmap of an image): 512 MiB of them, a 1 TiB disk
/// at 512 B granularity twice over.
pub(crate) const MAX_BITS_BYTES: u64 = 512 << 20;
/// qemu's limits: 65535 bitmaps, names of at most 1023 bytes, a directory of at most
/// 1 KiB per bitmap.
pub const MAX_BITMAPS: u32 = 65535;
pub const MAX_NAME: usize = 1023;
pub const MAX_DIRECTORY_BYTES: u64 = 1024 * MAX_BITMAPS as u64;
/// Bitmap table bytes read in all (to find the data clusters): 64 MiB covers 65535
/// bitmaps of a 16 TiB disk at qemu's default 64 KiB granularity.
const MAX_TABLES_BYTES: u64 = 64 << 20;
/// Bytes of a directory entry before its extra data and name.
pub const ENTRY_FIXED: usize = 24;
/// Bits 9-55 of a bitmap table entry: a data cluster's offset.
pub const TABLE_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

fn bad(why: String) -> Qcow2Error {
    Qcow2Error::Corrupt(format!("persistent bitmaps: {why}"))
}

/// The bitmaps header extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extension {
    pub nb_bitmaps: u32,
    pub directory_size: u64,
    pub directory_offset: u64,
}

impl Extension {
    pub fn parse(data: &[u8], cluster_size: u64) -> Result<Extension, Qcow2Error> {
        if data.len() != 24 {
            return Err(bad(format!("the extension is {} bytes, not 24", data.len())));
        }
        let ext =
            Extension { nb_bitmaps: be32(data, 0), directory_size: be64(data, 8), directory_offset: be64(data, 16) };
        if ext.nb_bitmaps == 0 || ext.nb_bitmaps > MAX_BITMAPS {
            return Err(bad(format!("{} bitmaps (1 to {MAX_BITMAPS} can be stored)", ext.nb_bitmaps)));
        }
        if be32(data, 4) != 0 {
            return Err(bad("the extension's reserved field is not zero".into()));
        }
        let min = ext.nb_bitmaps as u64 * ENTRY_FIXED as u64;
        if ext.directory_size < min || ext.directory_size > MAX_DIRECTORY_BYTES {
            return Err(bad(format!("a directory of {} bytes for {} bitmaps", ext.directory_size, ext.nb_bitmaps)));
        }
        if !ext.directory_offset.is_multiple_of(cluster_size) || ext.directory_offset == 0 {
            return Err(bad(format!("the directory offset {:#x} is not a cluster offset", ext.directory_offset)));
        }
        Ok(ext)
    }
}

/// One bitmap directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bitmap {
    pub name: String,
    pub flags: u32,
    pub table_offset: u64,
    /// Entries of the bitmap table.
    pub table_size: u32,
    /// File offset of this entry's flags field.
    pub flags_at: u64,
    /// log2 of the bytes of guest data one bit stands for (9 to 31).
    pub granularity_bits: u32,
    /// The entry's extra data (kept as found: only with `extra_data_compatible`).
    pub extra: Vec<u8>,
}

impl Bitmap {
    /// Whether writes must be tracked in it (`auto`) but it is not yet marked `in_use`.
    pub fn needs_in_use(&self) -> bool {
        self.flags & FLAG_AUTO != 0 && self.flags & FLAG_IN_USE == 0
    }
}

/// Parses the directory `buf` (read from `directory_offset`), bounded by the buffer.
pub fn parse_directory(buf: &[u8], ext: &Extension, cluster_size: u64) -> Result<Vec<Bitmap>, Qcow2Error> {
    let mut out: Vec<Bitmap> = Vec::new();
    let mut at = 0usize;
    for i in 0..ext.nb_bitmaps {
        if buf.len() - at < ENTRY_FIXED {
            return Err(bad(format!("directory entry {i} runs past the directory's end")));
        }
        let e = &buf[at..];
        let table_offset = be64(e, 0);
        let table_size = be32(e, 8);
        let flags = be32(e, 12);
        let name_size = usize::from(u16::from_be_bytes([e[18], e[19]]));
        let extra = be32(e, 20) as usize;
        if name_size == 0 || name_size > MAX_NAME {
            return Err(bad(format!("directory entry {i} has a name of {name_size} bytes")));
        }
        let len = ENTRY_FIXED.checked_add(extra).and_then(|l| l.checked_add(name_size)).filter(|&l| l <= e.len());
        let Some(len) = len else {
            return Err(bad(format!("directory entry {i} runs past the directory's end")));
        };
        let name = String::from_utf8_lossy(&e[ENTRY_FIXED + extra..len]).into_owned();
        if e[16] != TYPE_DIRTY_TRACKING {
            return Err(bad(format!("bitmap {name:?} has type {} (only 1, dirty tracking, is defined)", e[16])));
        }
        let granularity_bits = u32::from(e[17]);
        if !(MIN_GRANULARITY_BITS..=MAX_GRANULARITY_BITS).contains(&granularity_bits) {
            return Err(bad(format!(
                "bitmap {name:?} has a granularity of 2^{granularity_bits} bytes (512 B to 2 GiB are valid)"
            )));
        }
        if flags & !FLAGS_KNOWN != 0 {
            return Err(bad(format!("bitmap {name:?} has unknown flags {:#x}", flags & !FLAGS_KNOWN)));
        }
        if extra != 0 && flags & FLAG_EXTRA_DATA_COMPATIBLE == 0 {
            return Err(bad(format!("bitmap {name:?} has {extra} bytes of extra data ferry does not know")));
        }
        if !table_offset.is_multiple_of(cluster_size) || (table_offset == 0 && table_size != 0) {
            return Err(bad(format!("bitmap {name:?}: table offset {table_offset:#x} is not a cluster offset")));
        }
        if out.iter().any(|b| b.name == name) {
            return Err(bad(format!("two bitmaps are named {name:?}")));
        }
        out.push(Bitmap {
            name,
            flags,
            table_offset,
            table_size,
            flags_at: ext.directory_offset + at as u64 + 12,
            granularity_bits,
            extra: e[ENTRY_FIXED..ENTRY_FIXED + extra].to_vec(),
        });
        at += len.next_multiple_of(8).min(e.len());
    }
    Ok(out)
}

/// Reads and parses the directory.
pub fn read_directory(store: &dyn Store, ext: &Extension, cluster_size: u64) -> Result<Vec<Bitmap>, Qcow2Error> {
    let end = ext.directory_offset.checked_add(ext.directory_size);
    if end.is_none_or(|e| e > store.size()) {
        return Err(bad(format!(
            "the directory at {:#x} ({} bytes) runs past the end of the file",
            ext.directory_offset, ext.directory_size
        )));
    }
    let mut buf = vec![0u8; ext.directory_size as usize];
    store.read_at(&mut buf, ext.directory_offset).map_err(io_err("cannot read the bitmap directory"))?;
    parse_directory(&buf, ext, cluster_size)
}

/// Every bitmap's table entries (checked: a data cluster offset, or 0 / 1 for all
/// zeroes / all ones), bounded in all.
pub fn read_tables(store: &dyn Store, bitmaps: &[Bitmap], cluster_size: u64) -> Result<Vec<Vec<u64>>, Qcow2Error> {
    let total: u64 = bitmaps.iter().map(|b| u64::from(b.table_size) * 8).sum();
    if total > MAX_TABLES_BYTES {
        return Err(bad(format!("bitmap tables of {total} bytes in all (ferry reads up to {MAX_TABLES_BYTES})")));
    }
    let mut out = Vec::with_capacity(bitmaps.len());
    for b in bitmaps {
        let bytes = u64::from(b.table_size) * 8;
        if b.table_offset.checked_add(bytes).is_none_or(|e| e > store.size()) {
            return Err(bad(format!("the table of bitmap {:?} runs past the end of the file", b.name)));
        }
        let mut raw = vec![0u8; bytes as usize];
        store.read_at(&mut raw, b.table_offset).map_err(io_err("cannot read a bitmap table"))?;
        let mut t = Vec::with_capacity(b.table_size as usize);
        for c in raw.chunks_exact(8) {
            let e = be64(c, 0);
            let off = e & TABLE_OFFSET_MASK;
            if e & !TABLE_OFFSET_MASK & !1 != 0 || (off != 0 && e & 1 != 0) {
                return Err(bad(format!("the table of bitmap {:?} has an invalid entry {e:#x}", b.name)));
            }
            if off != 0 && (!off.is_multiple_of(cluster_size) || off >= store.size()) {
                return Err(bad(format!(
                    "the table of bitmap {:?} points at {off:#x}, not a cluster inside the file",
                    b.name
                )));
            }
            t.push(e);
        }
        out.push(t);
    }
    Ok(out)
}

/// The bitmaps of an image whose bitmaps extension is consistent (autoclear bit 0; qemu
/// ignores an inconsistent one), each with its data cluster offsets, and the extension.
#[allow(clippy::type_complexity)]
pub fn read_all(store: &dyn Store, h: &Header) -> Result<Option<(Extension, Vec<(Bitmap, Vec<u64>)>)>, Qcow2Error> {
    let Some(data) = h.bitmaps.as_deref().filter(|_| h.autoclear & AUTOCLEAR_BITMAPS != 0) else {
        return Ok(None);
    };
    let cs = h.cluster_size();
    let ext = Extension::parse(data, cs)?;
    let dir = read_directory(store, &ext, cs)?;
    let tables = read_tables(store, &dir, cs)?;
    Ok(Some((ext, dir.into_iter().zip(tables).collect())))
}

/// The bits of one bitmap in memory: bit `g` (granule `g`, guest bytes
/// `g << granularity_bits ..`) is bit `g % 64` of word `g / 64`, so the words' little-
/// endian bytes are the bitmap's data as stored (bit 0 of byte 0 first). Set with atomic
/// ORs: writes on every connection record concurrently.
pub struct Bits {
    words: Vec<AtomicU64>,
    granularity_bits: u32,
    /// Granules (bits) in all.
    count: u64,
    /// The guest size covered.
    size: u64,
    /// Changed since loaded (or since written back).
    changed: AtomicBool,
}

impl Bits {
    /// Bytes of bitmap data for `size` guest bytes at this granularity.
    pub fn data_bytes(size: u64, granularity_bits: u32) -> u64 {
        size.div_ceil(1 << granularity_bits).div_ceil(8)
    }

    /// All clear.
    pub fn new(size: u64, granularity_bits: u32) -> Bits {
        let count = size.div_ceil(1 << granularity_bits);
        let words = (0..count.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        Bits { words, granularity_bits, count, size, changed: AtomicBool::new(false) }
    }

    pub fn granularity_bits(&self) -> u32 {
        self.granularity_bits
    }

    pub fn changed(&self) -> bool {
        self.changed.load(Ordering::Acquire)
    }

    pub fn set_changed(&self, v: bool) {
        self.changed.store(v, Ordering::Release)
    }

    /// Sets the bits of granules `first..end`.
    fn set_range(&self, first: u64, end: u64) {
        let end = end.min(self.count);
        let mut g = first;
        while g < end {
            let w = g / 64;
            let lo = g % 64;
            let hi = (end - w * 64).min(64);
            let mask = if hi - lo == 64 { u64::MAX } else { ((1u64 << (hi - lo)) - 1) << lo };
            if let Some(word) = self.words.get(w as usize) {
                word.fetch_or(mask, Ordering::Relaxed);
            }
            g = w * 64 + hi;
        }
    }

    /// Records a change of guest bytes `offset..offset + len`: every granule it touches.
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 || offset >= self.size {
            return;
        }
        let first = offset >> self.granularity_bits;
        let last = (offset.saturating_add(len) - 1) >> self.granularity_bits;
        self.set_range(first, last + 1);
        // Stored only when it changes: every writer reads this cache line.
        if !self.changed.load(Ordering::Relaxed) {
            self.changed.store(true, Ordering::Release);
        }
    }

    /// Clears every bit.
    pub fn clear(&self) {
        for w in &self.words {
            w.store(0, Ordering::Relaxed);
        }
        self.changed.store(true, Ordering::Release);
    }

    fn bit(&self, g: u64) -> bool {
        self.words.get((g / 64) as usize).is_some_and(|w| w.load(Ordering::Relaxed) >> (g % 64) & 1 != 0)
    }

    /// The first granule at or after `g` (below `end`) whose bit is not `state`, else `end`.
    fn next_change(&self, g: u64, state: bool, end: u64) -> u64 {
        let mut g = g;
        while g < end {
            let w = g / 64;
            let mut v = self.words.get(w as usize).map_or(0, |x| x.load(Ordering::Relaxed));
            if state {
                v = !v;
            }
            v &= u64::MAX << (g % 64);
            if v != 0 {
                return (w * 64 + u64::from(v.trailing_zeros())).min(end);
            }
            g = (w + 1) * 64;
        }
        end
    }

    /// The dirty runs of guest bytes `offset..offset + length`: extents flagged
    /// `STATE_DIRTY` or 0, merged, at most `max` (at least one), clipped to the range.
    pub fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<ferry_backend::Extent>) {
        let end = offset.saturating_add(length).min(self.size);
        let gb = self.granularity_bits;
        let gend = end.div_ceil(1 << gb).min(self.count);
        let mut pos = offset;
        let mut n = 0;
        while pos < end && n < max.max(1) {
            let g = pos >> gb;
            let state = self.bit(g);
            let next = self.next_change(g + 1, state, gend);
            let stop = (next << gb).min(end);
            let flags = if state { STATE_DIRTY } else { 0 };
            out.push(ferry_backend::Extent { length: stop - pos, flags });
            n += 1;
            pos = stop;
        }
    }

    /// The data bytes `at..at + buf.len()` of the bitmap as stored.
    pub fn read_data(&self, at: u64, buf: &mut [u8]) {
        let mut i = 0usize;
        while i < buf.len() {
            let k = at + i as u64;
            let first = (k % 8) as usize;
            let n = (8 - first).min(buf.len() - i);
            let v = self.words.get((k / 8) as usize).map_or(0, |w| w.load(Ordering::Relaxed));
            let bytes = v.to_le_bytes();
            buf[i..i + n].copy_from_slice(&bytes[first..first + n]);
            i += n;
        }
    }

    /// ORs stored data bytes in at byte `at`; bits past the last granule are ignored.
    pub fn or_data(&self, at: u64, data: &[u8]) {
        let mut i = 0usize;
        while i < data.len() {
            let k = at + i as u64;
            let first = (k % 8) as usize;
            let n = (8 - first).min(data.len() - i);
            let mut bytes = [0u8; 8];
            bytes[first..first + n].copy_from_slice(&data[i..i + n]);
            let mut v = u64::from_le_bytes(bytes);
            let w = k / 8;
            if v != 0 {
                if let Some(word) = self.words.get(w as usize) {
                    let base = w * 64;
                    if base + 64 > self.count {
                        v &= (1u64 << (self.count - base)) - 1;
                    }
                    word.fetch_or(v, Ordering::Relaxed);
                }
            }
            i += n;
        }
    }

    /// Whether the bits stored in data bytes `at..at + len` are all clear (`state`
    /// false) or all set (true); bits past the last granule do not count.
    pub fn all(&self, at: u64, len: u64, state: bool) -> bool {
        let first = at * 8;
        let end = ((at + len) * 8).min(self.count);
        first >= end || self.next_change(first, state, end) == end
    }

    /// ORs every dirty run of `other` (any granularity) into these bits.
    pub fn merge(&self, other: &Bits) {
        let mut g = 0;
        let gb = other.granularity_bits;
        while g < other.count {
            let start = other.next_change(g, false, other.count);
            if start >= other.count {
                break;
            }
            let stop = other.next_change(start, true, other.count);
            let (a, b) = (start << gb, (stop << gb).min(other.size));
            self.mark(a, b.saturating_sub(a));
            g = stop;
        }
        self.changed.store(true, Ordering::Release);
    }

    /// Counts the set bits (tests, info).
    pub fn count_dirty(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.load(Ordering::Relaxed).count_ones())).sum()
    }
}

/// One bitmap of an open image: its directory entry, its table and, when consistent, its
/// bits.
pub struct Loaded {
    pub entry: Bitmap,
    /// The table entries as stored (`read_tables`).
    pub table: Vec<u64>,
    /// `None` for a bitmap `in_use` at open: inconsistent, kept as it is.
    pub bits: Option<Arc<Bits>>,
}

impl Loaded {
    /// Consistent and enabled: writes are recorded in it.
    pub fn enabled(&self) -> bool {
        self.bits.is_some() && self.entry.flags & FLAG_AUTO != 0
    }
}

/// What `Qcow2::bitmaps` lists, as qemu-img info shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapInfo {
    pub name: String,
    pub granularity: u64,
    /// Enabled: writes are recorded in it (qemu's `auto` flag).
    pub auto: bool,
    /// Marked in use on disk: inconsistent when found so at open (left by a crash), or
    /// being recorded in now.
    pub in_use: bool,
    /// Bytes of guest data marked dirty (0 for an inconsistent bitmap).
    pub dirty_bytes: u64,
}

/// An image's persistent bitmaps, as opened.
#[derive(Default)]
pub struct Set {
    pub ext: Option<Extension>,
    pub list: Vec<Loaded>,
    /// Removed since the directory was written: their clusters are freed then.
    pub removed: Vec<Loaded>,
}

impl Set {
    /// The bits of the enabled bitmaps: where writes are recorded.
    pub fn recording(&self) -> Vec<Arc<Bits>> {
        self.list.iter().filter(|l| l.enabled()).filter_map(|l| l.bits.clone()).collect()
    }
}

/// Loads the bitmaps of an image of `size` guest bytes: directory, tables, and the bits
/// of every consistent bitmap, each checked (table sizes, clusters inside the file, no
/// cluster used twice nor by the header, the L1 or refcount table), memory bounded.
pub fn load(store: &dyn Store, h: &Header) -> Result<Set, Qcow2Error> {
    let Some((ext, list)) = read_all(store, h)? else { return Ok(Set::default()) };
    let cs = h.cluster_size();
    let bits = h.cluster_bits;
    // Clusters claimed so far: (cluster, owner name) for a clear error.
    let mut claimed: std::collections::BTreeMap<u64, String> = std::collections::BTreeMap::new();
    let mut fixed = |what: &str, off: u64, len: u64| {
        for c in off >> bits..(off + len.max(1)).div_ceil(cs) {
            claimed.insert(c, what.to_string());
        }
    };
    fixed("the image header", 0, cs);
    fixed("the L1 table", h.l1_table_offset, u64::from(h.l1_size) * 8);
    fixed("the refcount table", h.refcount_table_offset, u64::from(h.refcount_table_clusters) * cs);
    fixed("the bitmap directory", ext.directory_offset, ext.directory_size);
    let mut total = 0u64;
    for (b, _) in &list {
        if b.flags & FLAG_IN_USE == 0 {
            total += Bits::data_bytes(h.size, b.granularity_bits);
        }
    }
    if total > MAX_BITS_BYTES {
        let name = list.iter().map(|(b, _)| b.name.as_str()).next_back().unwrap_or("");
        return Err(bad(format!(
            "the bitmaps (the last {name:?}) need {total} bytes of memory in all (ferry holds up to {MAX_BITS_BYTES})"
        )));
    }
    let mut out = Vec::with_capacity(list.len());
    let mut chunk = vec![0u8; cs as usize];
    for (b, table) in list {
        let bytes = Bits::data_bytes(h.size, b.granularity_bits);
        let want = bytes.div_ceil(cs);
        if u64::from(b.table_size) != want {
            return Err(bad(format!(
                "bitmap {:?}: a table of {} entries, where the virtual size and a granularity of {} need {want}",
                b.name,
                b.table_size,
                1u64 << b.granularity_bits
            )));
        }
        let mut own = |what: &str, off: u64, len: u64| -> Result<(), Qcow2Error> {
            for c in off >> bits..(off + len.max(1)).div_ceil(cs) {
                if let Some(other) = claimed.insert(c, format!("bitmap {:?}'s {what}", b.name)) {
                    return Err(bad(format!("bitmap {:?}: its {what} at {:#x} overlaps {other}", b.name, c << bits)));
                }
            }
            Ok(())
        };
        if b.table_size > 0 {
            own("table", b.table_offset, u64::from(b.table_size) * 8)?;
        }
        for &e in &table {
            if e & TABLE_OFFSET_MASK != 0 {
                own("data cluster", e & TABLE_OFFSET_MASK, cs)?;
            }
        }
        let loaded_bits = if b.flags & FLAG_IN_USE == 0 {
            let m = Bits::new(h.size, b.granularity_bits);
            for (i, &e) in table.iter().enumerate() {
                let at = i as u64 * cs;
                let n = (bytes - at).min(cs) as usize;
                let off = e & TABLE_OFFSET_MASK;
                if off != 0 {
                    store.read_at(&mut chunk[..n], off).map_err(io_err(format!("cannot read bitmap {:?}", b.name)))?;
                    m.or_data(at, &chunk[..n]);
                } else if e & 1 != 0 {
                    chunk[..n].fill(0xff);
                    m.or_data(at, &chunk[..n]);
                }
            }
            m.set_changed(false);
            Some(Arc::new(m))
        } else {
            None
        };
        out.push(Loaded { entry: b, table, bits: loaded_bits });
    }
    Ok(Set { ext: Some(ext), list: out, removed: Vec::new() })
}

/// `qemu:dirty-bitmap:NAME` of one consistent bitmap.
pub struct DirtyContext {
    pub name: String,
    pub bits: Arc<Bits>,
}

impl ferry_backend::MetaContext for DirtyContext {
    fn name(&self) -> &str {
        &self.name
    }
    fn extents(
        &self,
        offset: u64,
        length: u64,
        max: usize,
        out: &mut Vec<ferry_backend::Extent>,
    ) -> ferry_backend::Result<()> {
        self.bits.extents(offset, length, max, out);
        Ok(())
    }
}

/// What the bitmaps fuzz target does with each input: an image in memory whose
/// bitmaps are loaded, listed and walked. Never panics, hangs or allocates without bound.
#[doc(hidden)]
pub fn fuzz_bitmaps(data: &[u8]) {
    let mem = Arc::new(ferry_backend::MemoryBackend::new(data.len() as u64));
    if ferry_backend::Backend::write(&*mem, data, 0, false).is_err() {
        return;
    }
    let store = crate::store::BackendStore(mem);
    let first = data.len().min(2 << 20);
    let Ok(h) = Header::parse(&data[..first], data.len() as u64) else { return };
    let Ok(set) = load(&store, &h) else { return };
    for l in &set.list {
        if let Some(b) = &l.bits {
            let mut ex = Vec::new();
            b.extents(0, h.size, 64, &mut ex);
            let total: u64 = ex.iter().map(|e| e.length).sum();
            assert!(ex.len() <= 64 && total <= h.size, "bad extents {ex:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, table: u64, size: u32, flags: u32, extra: usize) -> Vec<u8> {
        let mut e = Vec::new();
        e.extend_from_slice(&table.to_be_bytes());
        e.extend_from_slice(&size.to_be_bytes());
        e.extend_from_slice(&flags.to_be_bytes());
        e.extend_from_slice(&[1, 16]);
        e.extend_from_slice(&(name.len() as u16).to_be_bytes());
        e.extend_from_slice(&(extra as u32).to_be_bytes());
        e.extend(std::iter::repeat_n(0u8, extra));
        e.extend_from_slice(name.as_bytes());
        e.resize(e.len().next_multiple_of(8), 0);
        e
    }

    fn ext(nb: u32, size: usize, off: u64) -> Vec<u8> {
        let mut x = nb.to_be_bytes().to_vec();
        x.extend_from_slice(&[0; 4]);
        x.extend_from_slice(&(size as u64).to_be_bytes());
        x.extend_from_slice(&off.to_be_bytes());
        x
    }

    #[test]
    fn parses_entries_and_finds_auto_bitmaps() {
        let mut dir = entry("b0", 0x40000, 1, FLAG_AUTO, 0);
        dir.extend(entry("frozen", 0x60000, 2, FLAG_EXTRA_DATA_COMPATIBLE, 5));
        dir.extend(entry("stale", 0x70000, 1, FLAG_AUTO | FLAG_IN_USE, 0));
        let x = Extension::parse(&ext(3, dir.len(), 0x50000), 65536).unwrap();
        let b = parse_directory(&dir, &x, 65536).unwrap();
        assert_eq!(b.iter().map(|b| b.name.as_str()).collect::<Vec<_>>(), ["b0", "frozen", "stale"]);
        assert_eq!(b.iter().map(|b| b.needs_in_use()).collect::<Vec<_>>(), [true, false, false]);
        assert_eq!(b[0].flags_at, 0x50000 + 12);
        assert_eq!(b[1].flags_at, 0x50000 + 32 + 12);
        assert_eq!((b[1].table_offset, b[1].table_size), (0x60000, 2));
    }

    fn seed() -> Vec<u8> {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/qcow2/seed-bitmaps.qcow2");
        std::fs::read(p).unwrap()
    }

    /// The seed qemu made: 512-byte clusters, an auto bitmap that recorded a write and
    /// a disabled one.
    #[test]
    fn reads_the_bitmaps_qemu_wrote() {
        let b = seed();
        let mem = std::sync::Arc::new(ferry_backend::MemoryBackend::new(b.len() as u64));
        ferry_backend::Backend::write(&*mem, &b, 0, false).unwrap();
        let store = crate::store::BackendStore(mem);
        let h = Header::parse(&b[..512], b.len() as u64).unwrap();
        let (_, bms) = read_all(&store, &h).unwrap().unwrap();
        let names: Vec<_> = bms.iter().map(|(b, _)| (b.name.as_str(), b.needs_in_use())).collect();
        assert_eq!(names, [("b0", true), ("frozen", false)]);
        assert!(bms[0].1.iter().any(|&d| d != 0), "b0 has a data cluster");
    }

    #[test]
    fn a_writable_open_refuses_bitmaps_it_cannot_read() {
        let mut b = seed();
        let h = Header::parse(&b[..512], b.len() as u64).unwrap();
        let x = Extension::parse(h.bitmaps.as_deref().unwrap(), 512).unwrap();
        let name_size = x.directory_offset as usize + 18;
        b[name_size..name_size + 2].copy_from_slice(&2000u16.to_be_bytes());
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.qcow2");
        std::fs::write(&p, &b).unwrap();
        let e = crate::Qcow2::open(&p, false).err().unwrap().to_string();
        assert!(e.contains("a name of 2000 bytes") && e.contains("qemu-img bitmap --remove"), "{e}");
        crate::Qcow2::open(&p, true).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b);
    }

    #[test]
    fn refuses_hostile_directories() {
        let err = |x: &[u8], dir: &[u8]| {
            Extension::parse(x, 65536).and_then(|x| parse_directory(dir, &x, 65536)).unwrap_err().to_string()
        };
        let dir = entry("b0", 0x40000, 1, FLAG_AUTO, 0);
        assert!(err(&ext(0, dir.len(), 0x50000), &dir).contains("0 bitmaps"));
        assert!(err(&ext(1, dir.len(), 0x50001), &dir).contains("directory offset"));
        assert!(err(&ext(1, 8, 0x50000), &dir).contains("a directory of 8 bytes"));
        assert!(err(&ext(1, dir.len(), 0x50000)[..20], &dir).contains("not 24"));
        // Two entries announced, one present; an entry whose name runs past the end.
        assert!(err(&ext(2, 48, 0x50000), &dir).contains("entry 1 runs past"));
        assert!(err(&ext(1, dir.len(), 0x50000), &dir[..20]).contains("entry 0 runs past"));
        let mut long = dir.clone();
        long[20..24].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(err(&ext(1, long.len(), 0x50000), &long).contains("entry 0 runs past"));
        let mut twice = dir.clone();
        twice.extend(dir.clone());
        assert!(err(&ext(2, twice.len(), 0x50000), &twice).contains("two bitmaps"));
        let odd = entry("b0", 0x40001, 1, FLAG_AUTO, 0);
        assert!(err(&ext(1, odd.len(), 0x50000), &odd).contains("not a cluster offset"));
        let mut g = dir.clone();
        g[17] = 32;
        assert!(err(&ext(1, g.len(), 0x50000), &g).contains("bitmap \"b0\" has a granularity of 2^32"));
        g[17] = 8;
        assert!(err(&ext(1, g.len(), 0x50000), &g).contains("granularity of 2^8"));
        let mut t = dir.clone();
        t[16] = 2;
        assert!(err(&ext(1, t.len(), 0x50000), &t).contains("has type 2"));
        let x = entry("b0", 0x40000, 1, 0, 3);
        assert!(err(&ext(1, x.len(), 0x50000), &x).contains("extra data"));
        let f = entry("b0", 0x40000, 1, 1 << 7, 0);
        assert!(err(&ext(1, f.len(), 0x50000), &f).contains("unknown flags"));
        assert!(err(&ext(65536, 65536 * 24, 0x50000), &dir).contains("65536 bitmaps"));
    }

    fn seeds() -> Vec<Vec<u8>> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/qcow2_bitmaps");
        let mut v: Vec<Vec<u8>> =
            std::fs::read_dir(&dir).unwrap().map(|e| std::fs::read(e.unwrap().path()).unwrap()).collect();
        v.push(seed());
        assert!(v.len() >= 4, "fuzz seeds missing in {}", dir.display());
        v
    }

    /// The fuzz target's function on the seeds, whole, mutated and cut short.
    #[test]
    fn the_fuzz_target_survives_its_seeds_mutated() {
        for good in seeds() {
            fuzz_bitmaps(&good);
            let h = Header::parse(&good[..good.len().min(65536)], good.len() as u64).unwrap();
            assert!(!load(&crate::store::BackendStore(mem(&good)), &h).unwrap().list.is_empty());
            let mut seed = 0x2545_f491_4f6c_dd1du64;
            let mut next = || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed
            };
            for _ in 0..500 {
                let mut b = good.clone();
                for _ in 0..1 + next() % 6 {
                    let at = (next() % b.len() as u64) as usize;
                    b[at] = next() as u8;
                }
                fuzz_bitmaps(&b);
                crate::fuzz_image(&b);
            }
            for cut in [0, 100, 511, 2048, good.len() / 2, good.len() - 1] {
                fuzz_bitmaps(&good[..cut]);
            }
        }
    }

    fn mem(b: &[u8]) -> Arc<ferry_backend::MemoryBackend> {
        let m = Arc::new(ferry_backend::MemoryBackend::new(b.len() as u64));
        ferry_backend::Backend::write(&*m, b, 0, false).unwrap();
        m
    }

    /// (directory offset, table offset of the first bitmap) of an image.
    fn first_entry(b: &[u8]) -> (usize, usize) {
        let h = Header::parse(&b[..512], b.len() as u64).unwrap();
        let x = Extension::parse(h.bitmaps.as_deref().unwrap(), 512).unwrap();
        let d = x.directory_offset as usize;
        (d, be64(b, d) as usize)
    }

    /// Hostile directories and tables: a writable open is refused naming the bitmap and
    /// writes nothing; a read-only open goes on without the bitmaps.
    #[test]
    fn corrupt_tables_are_refused_naming_the_bitmap() {
        let good = std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../fuzz/seeds/qcow2_bitmaps/seed-qemu-recorded.qcow2"),
        )
        .unwrap();
        let (d, t) = first_entry(&good);
        let l1 = be64(&good, 40);
        type Patch = Box<dyn Fn(&mut Vec<u8>)>;
        let cases: Vec<(Patch, &str)> = vec![
            (Box::new(move |b| b[d..d + 8].copy_from_slice(&l1.to_be_bytes())), "overlaps the L1 table"),
            (Box::new(move |b| b[d + 8..d + 12].copy_from_slice(&7u32.to_be_bytes())), "a table of 7 entries"),
            (Box::new(move |b| b[d..d + 8].copy_from_slice(&(1u64 << 40).to_be_bytes())), "past the end of the file"),
            (
                Box::new(move |b| b[t..t + 8].copy_from_slice(&(1u64 << 40).to_be_bytes())),
                "not a cluster inside the file",
            ),
            (
                Box::new(move |b| b[t..t + 8].copy_from_slice(&(d as u64).to_be_bytes())),
                "overlaps the bitmap directory",
            ),
            (Box::new(move |b| b[d + 17] = 40), "granularity of 2^40"),
        ];
        let dir = tempfile::tempdir().unwrap();
        for (patch, want) in cases {
            let mut b = good.clone();
            patch(&mut b);
            let p = dir.path().join("t.qcow2");
            std::fs::write(&p, &b).unwrap();
            let e = crate::Qcow2::open(&p, false).err().unwrap_or_else(|| panic!("{want}: opened")).to_string();
            assert!(e.contains(want) && e.contains("\"b0\""), "{want}: {e}");
            let q = Arc::new(crate::Qcow2::open(&p, true).unwrap());
            assert!(q.bitmaps().is_empty());
            let names: Vec<String> =
                ferry_backend::Backend::meta_contexts(q.clone()).iter().map(|c| c.name().to_string()).collect();
            assert_eq!(names, ["qemu:allocation-depth"], "{want}: no bitmap is offered");
            drop(q);
            assert_eq!(std::fs::read(&p).unwrap(), b, "{want}: the file changed");
        }
    }

    #[test]
    fn extents_are_merged_clipped_and_bounded() {
        let b = Bits::new(10 << 20, 16);
        b.mark(65536, 1);
        b.mark(3 * 65536 - 1, 2);
        b.mark((10 << 20) - 1, 100);
        let mut ex = Vec::new();
        b.extents(0, 10 << 20, 100, &mut ex);
        let got: Vec<(u64, u32)> = ex.iter().map(|e| (e.length, e.flags)).collect();
        assert_eq!(got, [(65536, 0), (3 * 65536, 1), ((10 << 20) - 5 * 65536, 0), (65536, 1)]);
        let mut ex = Vec::new();
        b.extents(70000, 200000, 2, &mut ex);
        let got: Vec<(u64, u32)> = ex.iter().map(|e| (e.length, e.flags)).collect();
        assert_eq!(got, [(4 * 65536 - 70000, 1), (270_000 - 4 * 65536, 0)]);
        let mut ex = Vec::new();
        b.extents(3 * 65536 + 5, 10, 0, &mut ex);
        assert_eq!(ex.iter().map(|e| (e.length, e.flags)).collect::<Vec<_>>(), [(10, 1)]);
        // Data bytes round trip, all-set and all-clear tests.
        let mut d = vec![0u8; 20];
        b.read_data(0, &mut d);
        assert_eq!(d[0], 0b1110, "granule 1 is bit 1 of byte 0");
        assert_eq!(d[19], 0x80);
        let c = Bits::new(10 << 20, 16);
        c.or_data(0, &d);
        assert_eq!(c.count_dirty(), b.count_dirty());
        assert!(c.all(1, 18, false) && !c.all(0, 1, false));
        c.mark(0, 10 << 20);
        assert!(c.all(0, 20, true));
        // Merging a finer bitmap into a coarser one covers whole granules.
        let fine = Bits::new(10 << 20, 9);
        fine.mark(1 << 20, 512);
        let coarse = Bits::new(10 << 20, 21);
        coarse.merge(&fine);
        let mut ex = Vec::new();
        coarse.extents(0, 10 << 20, 10, &mut ex);
        assert_eq!(ex[0].length, 2 << 20);
        assert_eq!(ex[0].flags, STATE_DIRTY);
    }

    /// A 1 TiB bitmap with 100,000 dirty runs is walked in well under a second.
    #[test]
    fn a_large_bitmap_is_walked_fast() {
        let size = 1u64 << 40;
        let b = Bits::new(size, 16);
        for i in 0..100_000u64 {
            b.mark(i * (size / 100_000), 65536 * (1 + i % 3));
        }
        let t = std::time::Instant::now();
        let (mut pos, mut dirty, mut calls) = (0, 0, 0);
        while pos < size {
            let mut ex = Vec::new();
            b.extents(pos, size - pos, 1024, &mut ex);
            for e in &ex {
                dirty += u64::from(e.flags == STATE_DIRTY);
                pos += e.length;
            }
            calls += 1;
        }
        assert_eq!(dirty, 100_000);
        assert!(calls > 100);
        assert!(t.elapsed() < std::time::Duration::from_millis(900), "{:?}", t.elapsed());
    }

    /// Writes on many threads record concurrently.
    #[test]
    fn marks_from_many_threads_all_land() {
        let b = Arc::new(Bits::new(64 << 20, 12));
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let b = b.clone();
                s.spawn(move || {
                    for i in 0..2048u64 {
                        b.mark((i * 8 + t) << 12, 1);
                    }
                });
            }
        });
        assert_eq!(b.count_dirty(), 16384);
    }
}
