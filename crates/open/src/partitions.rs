//! Partition tables of a disk image: MBR (with its extended and logical partitions) and
//! GPT (header and entry array checked by their CRC-32s, behind a protective MBR), for
//! `ferry mount`'s one file per partition.
//!
//! No I/O: [`scan`] asks its caller for the bytes it needs (at most a few sectors at a
//! time, the GPT entry array at most [`MAX_GPT_ARRAY`] bytes) through a closure, and
//! checks everything it is given. Bounded: at most [`MAX_LOGICAL`] logical partitions,
//! [`MAX_GPT_ENTRIES`] GPT entries. Every partition must lie inside the disk and no two may
//! overlap; a table that breaks a rule is a [`TableError`] (the caller shows no
//! partitions and warns), never a panic.
//!
//! References: the UEFI specification 2.10, §5.2 (legacy and protective MBR) and §5.3
//! (GPT header and partition entry array); extended partitions as the Linux kernel reads
//! them (`block/partitions/msdos.c`'s chain of extended boot records).

use std::fmt;

/// The logical sector size of an MBR disk (and the first one a GPT is looked for at).
pub const SECTOR: u64 = 512;
/// The most logical partitions followed along an extended partition's chain.
pub const MAX_LOGICAL: usize = 128;
/// The most GPT entries read.
pub const MAX_GPT_ENTRIES: u32 = 4096;
/// The largest GPT entry array read.
pub const MAX_GPT_ARRAY: usize = 1 << 20;

/// Which table a disk holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// No partition table (a file system on the whole disk, or an empty disk).
    None,
    Mbr,
    Gpt,
}

/// One partition: bytes `start..start + length` of the disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// Its number, as Linux numbers it: GPT entry index + 1; MBR primaries 1-4, logicals
    /// from 5.
    pub number: u32,
    pub start: u64,
    pub length: u64,
    /// Its type: an MBR type byte (`0x83`) or a GPT type GUID, with a name where known.
    pub kind: String,
    /// A GPT partition's name (empty for MBR).
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    pub scheme: Scheme,
    pub partitions: Vec<Partition>,
}

/// Why a table was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableError {
    /// The table breaks a rule.
    Malformed(String),
    /// The caller could not give the bytes asked for.
    Unreadable(String),
}

impl fmt::Display for TableError {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            TableError::Malformed(m) => write!(f, "malformed partition table: {m}"),
            TableError::Unreadable(m) => write!(f, "cannot read the partition table: {m}"),
        }
    }
}

impl std::error::Error for TableError {}

fn bad<T>(m: impl Into<String>) -> Result<T, TableError> {
    Err(TableError::Malformed(m.into()))
}

/// Reads `buf.len()` bytes at an offset of the disk, or says why not.
pub type Read<'a> = dyn FnMut(u64, &mut [u8]) -> Result<(), String> + 'a;

fn get(read: &mut Read, offset: u64, len: usize) -> Result<Vec<u8>, TableError> {
    let mut b = vec![0u8; len];
    read(offset, &mut b).map_err(TableError::Unreadable)?;
    Ok(b)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// The partition table of a disk of `disk_size` bytes, its bytes read through `read`.
pub fn scan(disk_size: u64, read: &mut Read) -> Result<Table, TableError> {
    let none = Table { scheme: Scheme::None, partitions: Vec::new() };
    if disk_size < SECTOR {
        return Ok(none);
    }
    let mbr = get(read, 0, SECTOR as usize)?;
    if mbr[510..512] != [0x55, 0xAA] {
        return Ok(none);
    }
    let entries: Vec<MbrEntry> = (0..4).map(|i| MbrEntry::parse(&mbr[446 + 16 * i..462 + 16 * i])).collect();
    // A boot sector that is no MBR (a FAT file system on the whole disk) has no valid
    // status bytes there.
    if entries.iter().any(|e| e.status & 0x7f != 0) {
        return Ok(none);
    }
    let mut table = if entries.iter().any(|e| e.kind == 0xEE) {
        Table { scheme: Scheme::Gpt, partitions: gpt(disk_size, read)? }
    } else {
        Table { scheme: Scheme::Mbr, partitions: mbr_partitions(disk_size, &entries, read)? }
    };
    check_disjoint(&mut table.partitions)?;
    Ok(table)
}

fn check_disjoint(parts: &mut [Partition]) -> Result<(), TableError> {
    parts.sort_by_key(|p| p.start);
    for w in parts.windows(2) {
        if w[0].start + w[0].length > w[1].start {
            return bad(format!("partitions {} and {} overlap", w[0].number, w[1].number));
        }
    }
    parts.sort_by_key(|p| p.number);
    Ok(())
}

/// Bytes `start_lba..start_lba + sectors` (of `sector` bytes), checked to lie inside the
/// disk and to be no empty range.
fn range(disk_size: u64, sector: u64, start_lba: u64, sectors: u64, number: u32) -> Result<(u64, u64), TableError> {
    let start = start_lba.checked_mul(sector);
    let length = sectors.checked_mul(sector);
    match (start, length) {
        (_, Some(0)) => bad(format!("partition {number} is empty")),
        (Some(s), Some(l)) if s.checked_add(l).is_some_and(|e| e <= disk_size) && s > 0 => Ok((s, l)),
        _ => bad(format!(
            "partition {number} (sectors {start_lba}+{sectors} of {sector} bytes) does not lie inside the disk of \
             {disk_size} bytes"
        )),
    }
}

struct MbrEntry {
    status: u8,
    kind: u8,
    lba: u32,
    sectors: u32,
}

impl MbrEntry {
    fn parse(b: &[u8]) -> MbrEntry {
        MbrEntry { status: b[0], kind: b[4], lba: u32_at(b, 8), sectors: u32_at(b, 12) }
    }
    fn is_extended(&self) -> bool {
        matches!(self.kind, 0x05 | 0x0F | 0x85)
    }
}

fn mbr_kind(kind: u8) -> String {
    let name = match kind {
        0x07 => " (NTFS/exFAT)",
        0x0B | 0x0C => " (FAT32)",
        0x0E | 0x06 | 0x04 => " (FAT16)",
        0x82 => " (Linux swap)",
        0x83 => " (Linux)",
        0x8E => " (Linux LVM)",
        0xFD => " (Linux RAID)",
        0xEF => " (EFI system)",
        _ => "",
    };
    format!("0x{kind:02x}{name}")
}

fn mbr_partitions(disk_size: u64, entries: &[MbrEntry], read: &mut Read) -> Result<Vec<Partition>, TableError> {
    let mut out = Vec::new();
    let mut extended = None;
    for (i, e) in entries.iter().enumerate() {
        let number = i as u32 + 1;
        // An unused slot; one with a type but no sectors is unused too, as Linux reads it.
        if e.kind == 0 || e.sectors == 0 {
            continue;
        }
        let (start, length) = range(disk_size, SECTOR, e.lba.into(), e.sectors.into(), number)?;
        if e.is_extended() {
            if extended.is_some() {
                return bad("more than one extended partition");
            }
            extended = Some((start, length));
            continue;
        }
        out.push(Partition { number, start, length, kind: mbr_kind(e.kind), name: String::new() });
    }
    if let Some((ext_start, ext_len)) = extended {
        logical(disk_size, ext_start, ext_len, read, &mut out)?;
    }
    Ok(out)
}

/// The logical partitions along the chain of extended boot records of the extended
/// partition at `ext_start` (each record's second entry points at the next, from the
/// extended partition's start; each record's first entry is a partition, from the
/// record's own sector). The chain must go forward inside the extended partition; a
/// record without its signature ends it. Numbers go to the logical partitions found, from
/// 5, as Linux numbers them (a record with an empty first entry takes none).
fn logical(
    disk_size: u64,
    ext_start: u64,
    ext_len: u64,
    read: &mut Read,
    out: &mut Vec<Partition>,
) -> Result<(), TableError> {
    let ext_end = ext_start + ext_len;
    let mut at = ext_start;
    let mut number = 5;
    for n in 0..=MAX_LOGICAL {
        if n == MAX_LOGICAL {
            return bad(format!("more than {MAX_LOGICAL} logical partitions"));
        }
        let ebr = get(read, at, SECTOR as usize)?;
        if ebr[510..512] != [0x55, 0xAA] {
            return Ok(());
        }
        let part = MbrEntry::parse(&ebr[446..462]);
        let next = MbrEntry::parse(&ebr[462..478]);
        if part.kind != 0 && part.sectors != 0 {
            let lba = at / SECTOR + u64::from(part.lba);
            let (start, length) = range(disk_size, SECTOR, lba, part.sectors.into(), number)?;
            if start <= at || start + length > ext_end {
                return bad(format!("logical partition {number} does not lie inside its extended partition"));
            }
            out.push(Partition { number, start, length, kind: mbr_kind(part.kind), name: String::new() });
            number += 1;
        }
        if next.kind == 0 {
            return Ok(());
        }
        if !next.is_extended() {
            return bad(format!(
                "the extended boot record of partition {number} links to a partition of type 0x{:02x}",
                next.kind
            ));
        }
        let following = u64::from(next.lba).checked_mul(SECTOR).and_then(|o| o.checked_add(ext_start));
        match following {
            Some(f) if f > at && f + SECTOR <= ext_end => at = f,
            _ => {
                return bad(format!(
                    "the chain of extended boot records after partition {number} goes backwards or outside"
                ))
            }
        }
    }
    Ok(())
}

/// GPT: the primary header (at LBA 1) or, when it fails its checks, the backup (at the
/// last LBA), each looked for with 512- and 4096-byte sectors.
fn gpt(disk_size: u64, read: &mut Read) -> Result<Vec<Partition>, TableError> {
    let mut why = Vec::new();
    for backup in [false, true] {
        for sector in [SECTOR, 4096] {
            if disk_size < 2 * sector {
                continue;
            }
            let lba = if backup { disk_size / sector - 1 } else { 1 };
            match gpt_at(disk_size, sector, lba, read) {
                Ok(p) => {
                    if backup {
                        log::warn!("the primary GPT header is damaged; using the backup at the disk's end");
                    }
                    return Ok(p);
                }
                Err(e @ TableError::Unreadable(_)) => return Err(e),
                Err(TableError::Malformed(m)) => why.push(format!(
                    "{} header at LBA {lba} ({sector}-byte sectors): {m}",
                    if backup { "backup" } else { "primary" }
                )),
            }
        }
    }
    bad(format!("a protective MBR, but no valid GPT: {}", why.join("; ")))
}

fn gpt_at(disk_size: u64, sector: u64, lba: u64, read: &mut Read) -> Result<Vec<Partition>, TableError> {
    let h = get(read, lba * sector, sector as usize)?;
    if &h[..8] != b"EFI PART" {
        return bad("no signature");
    }
    let size = u32_at(&h, 12) as usize;
    if !(92..=h.len()).contains(&size) {
        return bad(format!("header size {size}"));
    }
    let mut copy = h[..size].to_vec();
    copy[16..20].fill(0);
    if crc32fast::hash(&copy) != u32_at(&h, 16) {
        return bad("header CRC-32 mismatch");
    }
    if u64_at(&h, 24) != lba {
        return bad(format!("the header says it is at LBA {}", u64_at(&h, 24)));
    }
    let (first, last) = (u64_at(&h, 40), u64_at(&h, 48));
    let sectors = disk_size / sector;
    if first > last || last >= sectors {
        return bad(format!("usable LBAs {first}..={last} outside the disk's {sectors} sectors"));
    }
    let (array_lba, count, entry_size) = (u64_at(&h, 72), u32_at(&h, 80), u32_at(&h, 84));
    if count > MAX_GPT_ENTRIES {
        return bad(format!("{count} entries (at most {MAX_GPT_ENTRIES} read)"));
    }
    if !(128..=4096).contains(&entry_size) || !entry_size.is_power_of_two() {
        return bad(format!("entry size {entry_size}"));
    }
    let array = count as usize * entry_size as usize;
    if array > MAX_GPT_ARRAY {
        return bad(format!("an entry array of {array} bytes"));
    }
    let array_at =
        array_lba.checked_mul(sector).filter(|a| a.checked_add(array as u64).is_some_and(|e| e <= disk_size));
    let Some(array_at) = array_at else {
        return bad(format!("the entry array at LBA {array_lba} does not lie inside the disk"));
    };
    let entries = get(read, array_at, array)?;
    if crc32fast::hash(&entries) != u32_at(&h, 88) {
        return bad("entry array CRC-32 mismatch");
    }
    let mut out = Vec::new();
    for (i, e) in entries.chunks_exact(entry_size as usize).enumerate() {
        if e[..16].iter().all(|&b| b == 0) {
            continue;
        }
        let number = i as u32 + 1;
        let (lo, hi) = (u64_at(e, 32), u64_at(e, 40));
        if lo < first || hi > last || lo > hi {
            return bad(format!("partition {number} (LBAs {lo}..={hi}) is outside the usable LBAs {first}..={last}"));
        }
        let (start, length) = range(disk_size, sector, lo, hi - lo + 1, number)?;
        let units: Vec<u16> =
            e[56..128].chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).take_while(|&u| u != 0).collect();
        let name = String::from_utf16_lossy(&units);
        out.push(Partition { number, start, length, kind: gpt_kind(&e[..16]), name });
    }
    Ok(out)
}

/// A GPT type GUID as text (its first three fields little-endian), with a name where known.
fn gpt_kind(g: &[u8]) -> String {
    let text = format!(
        "{:08X}-{:04X}-{:04X}-{:02X}{:02X}-{}",
        u32_at(g, 0),
        u16::from_le_bytes([g[4], g[5]]),
        u16::from_le_bytes([g[6], g[7]]),
        g[8],
        g[9],
        g[10..16].iter().map(|b| format!("{b:02X}")).collect::<String>()
    );
    let name = match text.as_str() {
        "C12A7328-F81F-11D2-BA4B-00A0C93EC93B" => " (EFI system)",
        "21686148-6449-6E6F-744E-656564454649" => " (BIOS boot)",
        "0FC63DAF-8483-4772-8E79-3D69D8477DE4" => " (Linux filesystem)",
        "0657FD6D-A4AB-43C4-84E5-0933C84B4F4F" => " (Linux swap)",
        "E6D6D379-F507-44C2-A23C-238F2A3DF928" => " (Linux LVM)",
        "A19D880F-05FC-4D3B-A006-743F0F84911E" => " (Linux RAID)",
        "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709" => " (Linux root x86-64)",
        "EBD0A0A2-B9E5-4433-87C0-68B6B72699C7" => " (Microsoft basic data)",
        "E3C9E316-0B5C-4DB8-817D-F92DF00215AE" => " (Microsoft reserved)",
        "DE94BBA4-06D1-4D40-A16A-BFD50179D6AC" => " (Windows recovery)",
        _ => "",
    };
    format!("{text}{name}")
}

/// For the fuzz target (`fuzz/fuzz_targets/partitions.rs`): the disk is `data` after its
/// first 4 bytes, which give its size in sectors (zeros read past `data`). Whatever the
/// table, every partition found lies inside the disk and none overlap.
pub fn fuzz_scan(data: &[u8]) {
    let Some((size, image)) = data.split_first_chunk::<4>() else { return };
    let disk_size = u64::from(u32::from_le_bytes(*size)) * SECTOR;
    let mut read = |offset: u64, buf: &mut [u8]| -> Result<(), String> {
        if offset.checked_add(buf.len() as u64).is_none_or(|e| e > disk_size) {
            return Err("past the disk's end".into());
        }
        buf.fill(0);
        if let Some(have) = image.get(offset.min(image.len() as u64) as usize..) {
            let n = have.len().min(buf.len());
            buf[..n].copy_from_slice(&have[..n]);
        }
        Ok(())
    };
    if let Ok(t) = scan(disk_size, &mut read) {
        for p in &t.partitions {
            assert!(p.length > 0 && p.start.checked_add(p.length).is_some_and(|e| e <= disk_size));
        }
        let mut by_start: Vec<(u64, u64)> = t.partitions.iter().map(|p| (p.start, p.start + p.length)).collect();
        by_start.sort_unstable();
        for w in by_start.windows(2) {
            assert!(w[0].1 <= w[1].0, "partitions overlap: {w:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader(img: &[u8]) -> impl FnMut(u64, &mut [u8]) -> Result<(), String> + '_ {
        move |offset, buf| {
            let at = usize::try_from(offset).map_err(|e| e.to_string())?;
            let src = img.get(at..at + buf.len()).ok_or("past the end")?;
            buf.copy_from_slice(src);
            Ok(())
        }
    }

    fn mbr_entry(img: &mut [u8], at: usize, slot: usize, kind: u8, lba: u32, sectors: u32) {
        let e = &mut img[at + 446 + 16 * slot..at + 462 + 16 * slot];
        e[4] = kind;
        e[8..12].copy_from_slice(&lba.to_le_bytes());
        e[12..16].copy_from_slice(&sectors.to_le_bytes());
        img[at + 510] = 0x55;
        img[at + 511] = 0xAA;
    }

    /// An MBR disk of 64 KiB sectors: a primary, an extended with two logicals.
    fn mbr_disk() -> Vec<u8> {
        let mut img = vec![0u8; 200 * 512];
        mbr_entry(&mut img, 0, 0, 0x83, 2, 20);
        mbr_entry(&mut img, 0, 1, 0x05, 40, 100);
        // First EBR at sector 40: logical at 40+2, 10 sectors; next EBR at 40+30.
        mbr_entry(&mut img, 40 * 512, 0, 0x83, 2, 10);
        mbr_entry(&mut img, 40 * 512, 1, 0x05, 30, 20);
        mbr_entry(&mut img, 70 * 512, 0, 0x82, 1, 19);
        img
    }

    #[test]
    fn mbr_with_logical_partitions() {
        let img = mbr_disk();
        let t = scan(img.len() as u64, &mut reader(&img)).unwrap();
        assert_eq!(t.scheme, Scheme::Mbr);
        let got: Vec<(u32, u64, u64)> =
            t.partitions.iter().map(|p| (p.number, p.start / 512, p.length / 512)).collect();
        assert_eq!(got, [(1, 2, 20), (5, 42, 10), (6, 71, 19)]);
        assert_eq!(t.partitions[2].kind, "0x82 (Linux swap)");
    }

    /// As Linux reads them: an EBR with an empty first entry takes no number, an EBR without
    /// its signature ends the chain keeping the partitions before it, an entry with a type
    /// but no sectors is unused.
    #[test]
    fn mbr_numbers_and_ends_as_linux() {
        let mut img = mbr_disk();
        // The first EBR's partition gone (the chain goes on through it): the swap is part5.
        mbr_entry(&mut img, 40 * 512, 0, 0, 0, 0);
        // A primary slot with a type and no sectors.
        mbr_entry(&mut img, 0, 2, 0x83, 0, 0);
        let got = |img: &[u8]| -> Vec<(u32, u64, u64)> {
            let t = scan(img.len() as u64, &mut reader(img)).unwrap();
            t.partitions.iter().map(|p| (p.number, p.start / 512, p.length / 512)).collect()
        };
        assert_eq!(got(&img), [(1, 2, 20), (5, 71, 19)]);
        // The second EBR without its signature: the chain ends after the first.
        let mut img = mbr_disk();
        img[70 * 512 + 510] = 0;
        assert_eq!(got(&img), [(1, 2, 20), (5, 42, 10)]);
        // A logical entry with a type and no sectors takes no number either.
        let mut img = mbr_disk();
        mbr_entry(&mut img, 40 * 512, 0, 0x83, 2, 0);
        assert_eq!(got(&img), [(1, 2, 20), (5, 71, 19)]);
    }

    #[test]
    fn malformed_mbrs_are_refused() {
        let img = mbr_disk();
        // A partition past the disk's end.
        let mut b = img.clone();
        mbr_entry(&mut b, 0, 2, 0x83, 150, 100);
        assert!(matches!(scan(b.len() as u64, &mut reader(&b)), Err(TableError::Malformed(_))));
        // Overlapping primaries.
        let mut b = img.clone();
        mbr_entry(&mut b, 0, 2, 0x83, 10, 5);
        let e = scan(b.len() as u64, &mut reader(&b)).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        // An EBR chain that loops back onto itself.
        let mut b = img.clone();
        mbr_entry(&mut b, 70 * 512, 1, 0x05, 0, 20);
        assert!(matches!(scan(b.len() as u64, &mut reader(&b)), Err(TableError::Malformed(_))));
        // No signature: no table at all.
        let mut b = img;
        b[510] = 0;
        assert_eq!(scan(b.len() as u64, &mut reader(&b)).unwrap().scheme, Scheme::None);
    }

    fn gpt_disk() -> Vec<u8> {
        let sectors = 256u64;
        let mut img = vec![0u8; sectors as usize * 512];
        mbr_entry(&mut img, 0, 0, 0xEE, 1, (sectors - 1) as u32);
        let mut entries = vec![0u8; 128 * 128];
        let linux = [0xAF, 0x3D, 0xC6, 0x0F, 0x83, 0x84, 0x72, 0x47, 0x8E, 0x79, 0x3D, 0x69, 0xD8, 0x47, 0x7D, 0xE4];
        for (i, (lo, hi, name)) in [(34u64, 99u64, "root"), (100, 200, "data")].iter().enumerate() {
            let e = &mut entries[i * 128..(i + 1) * 128];
            e[..16].copy_from_slice(&linux);
            e[16] = i as u8 + 1;
            e[32..40].copy_from_slice(&lo.to_le_bytes());
            e[40..48].copy_from_slice(&hi.to_le_bytes());
            for (k, u) in name.encode_utf16().enumerate() {
                e[56 + 2 * k..58 + 2 * k].copy_from_slice(&u.to_le_bytes());
            }
        }
        img[1024..1024 + entries.len()].copy_from_slice(&entries);
        let mut h = vec![0u8; 92];
        h[..8].copy_from_slice(b"EFI PART");
        h[8..12].copy_from_slice(&0x10000u32.to_le_bytes());
        h[12..16].copy_from_slice(&92u32.to_le_bytes());
        h[24..32].copy_from_slice(&1u64.to_le_bytes());
        h[32..40].copy_from_slice(&(sectors - 1).to_le_bytes());
        h[40..48].copy_from_slice(&34u64.to_le_bytes());
        h[48..56].copy_from_slice(&(sectors - 34).to_le_bytes());
        h[72..80].copy_from_slice(&2u64.to_le_bytes());
        h[80..84].copy_from_slice(&128u32.to_le_bytes());
        h[84..88].copy_from_slice(&128u32.to_le_bytes());
        h[88..92].copy_from_slice(&crc32fast::hash(&entries).to_le_bytes());
        let crc = crc32fast::hash(&h);
        h[16..20].copy_from_slice(&crc.to_le_bytes());
        img[512..604].copy_from_slice(&h);
        img
    }

    #[test]
    fn gpt_with_names_and_checks() {
        let img = gpt_disk();
        let t = scan(img.len() as u64, &mut reader(&img)).unwrap();
        assert_eq!(t.scheme, Scheme::Gpt);
        let got: Vec<(u32, u64, u64, &str)> =
            t.partitions.iter().map(|p| (p.number, p.start / 512, p.length / 512, p.name.as_str())).collect();
        assert_eq!(got, [(1, 34, 66, "root"), (2, 100, 101, "data")]);
        assert!(t.partitions[0].kind.ends_with("(Linux filesystem)"), "{}", t.partitions[0].kind);
        // An entry changed: the array's CRC fails, and no backup header is there.
        let mut b = img.clone();
        b[1024 + 40] = 250;
        let e = scan(b.len() as u64, &mut reader(&b)).unwrap_err();
        assert!(e.to_string().contains("entry array CRC-32"), "{e}");
        // The header changed.
        let mut b = img.clone();
        b[512 + 80] = 0xff;
        let e = scan(b.len() as u64, &mut reader(&b)).unwrap_err();
        assert!(e.to_string().contains("header CRC-32"), "{e}");
        // A disk shorter than the table says (the last usable LBA past the end).
        let short = &img[..150 * 512];
        assert!(matches!(scan(short.len() as u64, &mut reader(short)), Err(TableError::Malformed(_))));
        // A read that fails is said as such.
        let mut failing = |_: u64, _: &mut [u8]| -> Result<(), String> { Err("EIO".into()) };
        assert!(matches!(scan(img.len() as u64, &mut failing), Err(TableError::Unreadable(_))));
    }

    #[test]
    fn fuzz_helper_takes_anything() {
        fuzz_scan(&[]);
        fuzz_scan(&[1, 0, 0, 0]);
        let mut d = 256u32.to_le_bytes().to_vec();
        d.extend_from_slice(&gpt_disk()[..4096]);
        fuzz_scan(&d);
        let mut d = 200u32.to_le_bytes().to_vec();
        d.extend_from_slice(&mbr_disk()[..4096]);
        fuzz_scan(&d);
    }
}
