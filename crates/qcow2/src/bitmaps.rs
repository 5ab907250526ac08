//! Persistent dirty bitmaps (qemu's docs/interop/qcow2.rst, "Bitmaps extension",
//! "Bitmap directory", "Bitmap table"), as far as a writer that does not maintain them
//! needs them.
//!
//! ferry does not update bitmaps. A bitmap with the `auto` flag must reflect every write
//! to the image, so before ferry's first write (`overlap::Guard`) each such bitmap gets
//! the `in_use` flag: qemu then treats it as inconsistent (`qemu-nbd -B` and incremental
//! backups refuse it; `qemu-img check` stays clean; `qemu-img bitmap --remove` drops
//! it), where a bitmap left as it was would silently miss ferry's writes. Bitmaps without
//! `auto` are disabled: writes do not concern them, so they stay as they are. The
//! directory, the tables and the data clusters are metadata for the overlap check.
//!
//! Only a writable open parses any of this; every size is checked against the spec's
//! and qemu's limits before anything is allocated from it.

use crate::header::{be32, be64, Header, AUTOCLEAR_BITMAPS};
use crate::store::Store;
use crate::{io_err, Qcow2Error};

/// Directory entry flags.
pub const FLAG_IN_USE: u32 = 1 << 0;
pub const FLAG_AUTO: u32 = 1 << 1;
/// qemu's limits: 65535 bitmaps, names of at most 1023 bytes, a directory of at most
/// 1 KiB per bitmap.
const MAX_BITMAPS: u32 = 65535;
const MAX_NAME: usize = 1023;
const MAX_DIRECTORY_BYTES: u64 = 1024 * MAX_BITMAPS as u64;
/// Bitmap table bytes read in all (to find the data clusters): 64 MiB covers 65535
/// bitmaps of a 16 TiB disk at qemu's default 64 KiB granularity.
const MAX_TABLES_BYTES: u64 = 64 << 20;
/// Bytes of a directory entry before its extra data and name.
const ENTRY_FIXED: usize = 24;
/// Bits 9-55 of a bitmap table entry: a data cluster's offset.
const TABLE_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

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
        if !table_offset.is_multiple_of(cluster_size) || (table_offset == 0 && table_size != 0) {
            return Err(bad(format!("bitmap {name:?}: table offset {table_offset:#x} is not a cluster offset")));
        }
        if out.iter().any(|b| b.name == name) {
            return Err(bad(format!("two bitmaps are named {name:?}")));
        }
        out.push(Bitmap { name, flags, table_offset, table_size, flags_at: ext.directory_offset + at as u64 + 12 });
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

/// The data cluster offsets of every bitmap's table (0: not allocated), bounded in all.
pub fn read_tables(store: &dyn Store, bitmaps: &[Bitmap]) -> Result<Vec<Vec<u64>>, Qcow2Error> {
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
            t.push(off);
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
    let tables = read_tables(store, &dir)?;
    Ok(Some((ext, dir.into_iter().zip(tables).collect())))
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
        dir.extend(entry("frozen", 0x60000, 2, 0, 5));
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
    }
}
