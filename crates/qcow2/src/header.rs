//! The qcow2 header and its extensions (qemu's docs/interop/qcow2.txt, "Header" and
//! "Header extensions"). Every field is checked here, before anything is allocated
//! from it: a hostile header is an error, never a panic or a huge allocation.

use crate::Qcow2Error;

pub const MAGIC: [u8; 4] = *b"QFI\xfb";
/// Bytes of the version 2 header (and of the fixed part of version 3's).
pub const V2_HEADER_LEN: usize = 72;
/// Bytes of the version 3 header qemu writes (with the compression type field).
pub const V3_HEADER_LEN: u32 = 112;

/// Incompatible feature bits.
pub const INCOMPAT_DIRTY: u64 = 1 << 0;
pub const INCOMPAT_CORRUPT: u64 = 1 << 1;
pub const INCOMPAT_DATA_FILE: u64 = 1 << 2;
pub const INCOMPAT_COMPRESSION: u64 = 1 << 3;
pub const INCOMPAT_EXTL2: u64 = 1 << 4;
const INCOMPAT_KNOWN: u64 =
    INCOMPAT_DIRTY | INCOMPAT_CORRUPT | INCOMPAT_DATA_FILE | INCOMPAT_COMPRESSION | INCOMPAT_EXTL2;
/// Autoclear bit: the bitmaps extension's data is consistent.
pub const AUTOCLEAR_BITMAPS: u64 = 1 << 0;
/// Autoclear bit: the external data file is a valid raw image on its own.
pub const AUTOCLEAR_DATA_FILE_RAW: u64 = 1 << 1;
/// Byte offsets of header fields ferry rewrites in place.
pub const INCOMPATIBLE_AT: u64 = 72;
pub const AUTOCLEAR_AT: u64 = 88;

const EXT_END: u32 = 0;
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
const EXT_FEATURE_TABLE: u32 = 0x6803_f857;
const EXT_ENCRYPTION: u32 = 0x0537_be77;
const EXT_DATA_FILE: u32 = 0x4441_5441;
const EXT_BITMAPS: u32 = 0x2385_2875;

/// qemu's limits: an L1 table of at most 32 MiB, a refcount table of at most 8 MiB,
/// backing file names of at most 1023 bytes.
pub const MAX_L1_BYTES: u64 = 32 << 20;
pub const MAX_REFTABLE_BYTES: u64 = 8 << 20;
const MAX_NAME: u32 = 1023;
/// Virtual sizes above 2^61 bytes cannot be addressed by an L2 entry's offset bits anyway.
const MAX_VIRTUAL_SIZE: u64 = 1 << 61;

/// How compressed clusters are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Raw deflate (no zlib header), window of 4 KiB.
    Zlib,
    Zstd,
}

impl Compression {
    pub fn name(self) -> &'static str {
        match self {
            Compression::Zlib => "zlib",
            Compression::Zstd => "zstd",
        }
    }
}

/// A parsed, validated header.
#[derive(Debug, Clone)]
pub struct Header {
    pub version: u32,
    pub backing_file: Option<String>,
    pub backing_format: Option<String>,
    pub cluster_bits: u32,
    pub size: u64,
    pub l1_size: u32,
    pub l1_table_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
    pub nb_snapshots: u32,
    pub incompatible: u64,
    pub compatible: u64,
    pub autoclear: u64,
    pub refcount_order: u32,
    pub header_length: u32,
    pub compression: Compression,
    pub data_file: Option<String>,
    /// The bitmaps extension's data (persistent dirty bitmaps), as found: only a
    /// writable open parses it (`bitmaps.rs`), reading needs none of it.
    pub bitmaps: Option<Vec<u8>>,
}

pub(crate) fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

pub(crate) fn be64(b: &[u8], at: usize) -> u64 {
    (u64::from(be32(b, at)) << 32) | u64::from(be32(b, at + 4))
}

/// Whether `first` (the first bytes of a file) starts with the qcow2 magic.
pub fn is_qcow2(first: &[u8]) -> bool {
    first.len() >= 4 && first[..4] == MAGIC
}

/// Whether the file at `p` starts with the qcow2 magic (false when it cannot be read).
pub fn has_qcow2_magic(p: &std::path::Path) -> bool {
    use std::os::unix::fs::FileExt;
    let mut magic = [0u8; 4];
    std::fs::File::open(p).and_then(|f| f.read_at(&mut magic, 0)).is_ok_and(|n| is_qcow2(&magic[..n]))
}

fn bad(why: String) -> Qcow2Error {
    Qcow2Error::Invalid(why)
}

impl Header {
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    pub fn extended_l2(&self) -> bool {
        self.incompatible & INCOMPAT_EXTL2 != 0
    }

    /// Parses and validates the header from the image's first cluster (or as much of
    /// the file as there is, when it is shorter). `file_len` bounds every offset.
    pub fn parse(buf: &[u8], file_len: u64) -> Result<Header, Qcow2Error> {
        if !is_qcow2(buf) {
            return Err(Qcow2Error::NotQcow2);
        }
        if buf.len() < V2_HEADER_LEN {
            return Err(bad(format!("the header is cut short: {} bytes", buf.len())));
        }
        let version = be32(buf, 4);
        if version != 2 && version != 3 {
            return Err(Qcow2Error::Unsupported(format!("qcow2 version {version} (ferry reads versions 2 and 3)")));
        }
        let cluster_bits = be32(buf, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(bad(format!("cluster_bits {cluster_bits} is outside 9..=21 (512 B to 2 MiB clusters)")));
        }
        let cs = 1u64 << cluster_bits;
        let crypt_method = be32(buf, 32);
        if crypt_method != 0 {
            let what = if crypt_method == 1 { "AES" } else { "LUKS" };
            return Err(Qcow2Error::Unsupported(format!(
                "the image is encrypted ({what}, crypt_method {crypt_method}); decrypt it first, e.g. with qemu-img convert --object secret,... --image-opts"
            )));
        }
        let (incompatible, compatible, autoclear, refcount_order, header_length) = if version == 3 {
            if buf.len() < 104 {
                return Err(bad("the version 3 header is cut short".into()));
            }
            (be64(buf, 72), be64(buf, 80), be64(buf, 88), be32(buf, 96), be32(buf, 100))
        } else {
            (0, 0, 0, 4, V2_HEADER_LEN as u32)
        };
        if version == 3 && (header_length < 104 || !header_length.is_multiple_of(8) || u64::from(header_length) > cs) {
            return Err(bad(format!(
                "header_length {header_length} is not a multiple of 8 between 104 and the cluster size"
            )));
        }
        if header_length as usize > buf.len() {
            return Err(bad("the header is longer than the file".into()));
        }
        let names = feature_names(buf, header_length as usize, cs);
        if incompatible & INCOMPAT_DIRTY != 0 {
            return Err(Qcow2Error::Unsupported(
                "the image has the dirty bit set (it was not closed cleanly with lazy refcounts); repair it with qemu-img check -r all".into(),
            ));
        }
        // The corrupt bit refuses writing only (`write::check_writable`): reading what is
        // left is how a user rescues the data, as qemu allows.
        let unknown = incompatible & !INCOMPAT_KNOWN;
        if unknown != 0 {
            let list: Vec<String> = (0..64)
                .filter(|b| unknown & (1 << b) != 0)
                .map(|b| match names.iter().find(|(bit, _)| *bit == b) {
                    Some((_, n)) => format!("bit {b} ({n})"),
                    None => format!("bit {b}"),
                })
                .collect();
            return Err(Qcow2Error::Unsupported(format!(
                "the image uses unknown incompatible features: {}",
                list.join(", ")
            )));
        }
        if refcount_order > 6 {
            return Err(bad(format!("refcount_order {refcount_order} is above 6 (64-bit refcounts)")));
        }
        let compression = if version == 3 && header_length > 104 {
            match buf[104] {
                0 => Compression::Zlib,
                1 => Compression::Zstd,
                t => return Err(Qcow2Error::Unsupported(format!("compression type {t} (ferry reads zlib and zstd)"))),
            }
        } else {
            Compression::Zlib
        };
        if (compression != Compression::Zlib) != (incompatible & INCOMPAT_COMPRESSION != 0) {
            return Err(bad("the compression type and the compression-type feature bit disagree".into()));
        }
        let size = be64(buf, 24);
        if size > MAX_VIRTUAL_SIZE {
            return Err(bad(format!("virtual size {size} is too large")));
        }
        let l1_size = be32(buf, 36);
        let l1_table_offset = be64(buf, 40);
        let entry_bytes: u64 = if incompatible & INCOMPAT_EXTL2 != 0 { 16 } else { 8 };
        if incompatible & INCOMPAT_EXTL2 != 0 && cluster_bits < 14 {
            return Err(bad("extended L2 entries need clusters of at least 16 KiB".into()));
        }
        let l2_span = (cs / entry_bytes) * cs;
        let needed = size.div_ceil(l2_span);
        if u64::from(l1_size) < needed {
            return Err(bad(format!(
                "the L1 table has {l1_size} entries, fewer than the {needed} the virtual size needs"
            )));
        }
        if u64::from(l1_size) * 8 > MAX_L1_BYTES {
            return Err(bad(format!("the L1 table of {l1_size} entries is larger than 32 MiB")));
        }
        check_table("L1 table", l1_table_offset, u64::from(l1_size) * 8, cs, file_len)?;
        let refcount_table_offset = be64(buf, 48);
        let refcount_table_clusters = be32(buf, 56);
        let rt_bytes = u64::from(refcount_table_clusters) * cs;
        if rt_bytes > MAX_REFTABLE_BYTES {
            return Err(bad(format!("the refcount table of {refcount_table_clusters} clusters is larger than 8 MiB")));
        }
        check_table("refcount table", refcount_table_offset, rt_bytes, cs, file_len)?;
        let nb_snapshots = be32(buf, 60);

        let backing_file_offset = be64(buf, 8);
        let backing_file_size = be32(buf, 16);
        let backing_file = if backing_file_offset != 0 && backing_file_size != 0 {
            if backing_file_size > MAX_NAME {
                return Err(bad(format!("the backing file name is {backing_file_size} bytes, more than 1023")));
            }
            let end = backing_file_offset.checked_add(u64::from(backing_file_size)).filter(|&e| e <= buf.len() as u64);
            let Some(end) = end else {
                return Err(bad("the backing file name lies outside the first cluster".into()));
            };
            Some(name(&buf[backing_file_offset as usize..end as usize], "backing file name")?)
        } else {
            None
        };

        let mut h = Header {
            version,
            backing_file,
            backing_format: None,
            cluster_bits,
            size,
            l1_size,
            l1_table_offset,
            refcount_table_offset,
            refcount_table_clusters,
            nb_snapshots,
            incompatible,
            compatible,
            autoclear,
            refcount_order,
            header_length,
            compression,
            data_file: None,
            bitmaps: None,
        };
        h.extensions(buf)?;
        if incompatible & INCOMPAT_DATA_FILE != 0 && h.data_file.is_none() {
            return Err(bad("the image needs an external data file but names none".into()));
        }
        if incompatible & INCOMPAT_DATA_FILE != 0
            && h.backing_file.is_some()
            && autoclear & AUTOCLEAR_DATA_FILE_RAW != 0
        {
            return Err(bad("a raw external data file cannot have a backing file".into()));
        }
        Ok(h)
    }

    fn extensions(&mut self, buf: &[u8]) -> Result<(), Qcow2Error> {
        let mut at = self.header_length as usize;
        // Extensions end at type 0 or at the end of the first cluster (or of the file).
        while at + 8 <= buf.len() {
            let typ = be32(buf, at);
            let len = be32(buf, at + 4) as usize;
            at += 8;
            if typ == EXT_END {
                break;
            }
            if len > buf.len() - at {
                return Err(bad(format!("header extension {typ:#x} runs past the first cluster")));
            }
            let data = &buf[at..at + len];
            match typ {
                EXT_BACKING_FORMAT => self.backing_format = Some(name(data, "backing format")?),
                EXT_DATA_FILE => self.data_file = Some(name(data, "external data file name")?),
                EXT_BITMAPS => self.bitmaps = Some(data.to_vec()),
                EXT_ENCRYPTION => {
                    return Err(Qcow2Error::Unsupported(
                        "the image has an encryption header (LUKS); decrypt it first".into(),
                    ))
                }
                _ => {}
            }
            at += len.div_ceil(8) * 8;
        }
        Ok(())
    }
}

/// The feature name table, for naming unknown incompatible bits: (bit, name).
fn feature_names(buf: &[u8], header_length: usize, cs: u64) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    let end = buf.len().min(cs as usize);
    let mut at = header_length;
    while at + 8 <= end {
        let typ = be32(buf, at);
        let len = be32(buf, at + 4) as usize;
        at += 8;
        if typ == EXT_END || len > end - at {
            break;
        }
        if typ == EXT_FEATURE_TABLE {
            for e in buf[at..at + len].chunks_exact(48) {
                if e[0] == 0 {
                    let n = &e[2..];
                    let n = &n[..n.iter().position(|&c| c == 0).unwrap_or(n.len())];
                    out.push((u32::from(e[1]), String::from_utf8_lossy(n).into_owned()));
                }
            }
        }
        at += len.div_ceil(8) * 8;
    }
    out
}

fn name(b: &[u8], what: &str) -> Result<String, Qcow2Error> {
    let b = &b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())];
    String::from_utf8(b.to_vec()).map_err(|_| bad(format!("the {what} is not UTF-8")))
}

fn check_table(what: &str, offset: u64, bytes: u64, cs: u64, file_len: u64) -> Result<(), Qcow2Error> {
    if !offset.is_multiple_of(cs) {
        return Err(bad(format!("the {what} offset {offset:#x} is not cluster aligned")));
    }
    if bytes > 0 && offset.checked_add(bytes).is_none_or(|e| e > file_len) {
        return Err(bad(format!(
            "the {what} at {offset:#x} ({bytes} bytes) runs past the end of the file ({file_len} bytes)"
        )));
    }
    Ok(())
}

/// Encodes a version 3 header (112 bytes) for a new image without backing file.
pub fn encode_v3(
    size: u64,
    cluster_bits: u32,
    l1_size: u32,
    l1_table_offset: u64,
    refcount_table_offset: u64,
    refcount_table_clusters: u32,
) -> Vec<u8> {
    let mut h = vec![0u8; V3_HEADER_LEN as usize];
    h[0..4].copy_from_slice(&MAGIC);
    h[4..8].copy_from_slice(&3u32.to_be_bytes());
    h[20..24].copy_from_slice(&cluster_bits.to_be_bytes());
    h[24..32].copy_from_slice(&size.to_be_bytes());
    h[36..40].copy_from_slice(&l1_size.to_be_bytes());
    h[40..48].copy_from_slice(&l1_table_offset.to_be_bytes());
    h[48..56].copy_from_slice(&refcount_table_offset.to_be_bytes());
    h[56..60].copy_from_slice(&refcount_table_clusters.to_be_bytes());
    h[96..100].copy_from_slice(&4u32.to_be_bytes());
    h[100..104].copy_from_slice(&V3_HEADER_LEN.to_be_bytes());
    h
}

/// Adds a backing file to a header from [`encode_v3`]: the backing format extension and
/// the end of the extensions after the 112 header bytes, then the name, which the header
/// points to. All of it must fit in the first cluster (`cluster_size` bytes).
pub fn encode_backing(h: &mut Vec<u8>, name: &str, format: &str, cluster_size: u64) -> Result<(), Qcow2Error> {
    if name.is_empty() || name.len() > MAX_NAME as usize || name.contains('\0') {
        return Err(bad(format!("backing file name {name:?} must be 1 to {MAX_NAME} bytes without NUL")));
    }
    if format.is_empty() || format.len() > 16 || format.contains('\0') {
        return Err(bad(format!("backing format {format:?} must be 1 to 16 bytes without NUL")));
    }
    h.truncate(V3_HEADER_LEN as usize);
    h.extend_from_slice(&EXT_BACKING_FORMAT.to_be_bytes());
    h.extend_from_slice(&(format.len() as u32).to_be_bytes());
    h.extend_from_slice(format.as_bytes());
    h.resize(h.len().next_multiple_of(8), 0);
    h.extend_from_slice(&[0u8; 8]); // EXT_END
    let at = h.len() as u64;
    h.extend_from_slice(name.as_bytes());
    if h.len() as u64 > cluster_size {
        return Err(bad(format!(
            "the backing file name ({} bytes) does not fit in the header's {cluster_size}-byte cluster; use larger clusters",
            name.len()
        )));
    }
    h[8..16].copy_from_slice(&at.to_be_bytes());
    h[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
    Ok(())
}

/// Byte offsets of the refcount table fields, rewritten when the table moves.
pub const REFTABLE_OFFSET_AT: u64 = 48;

#[cfg(test)]
mod tests {
    use super::*;

    fn v3(size: u64, cluster_bits: u32) -> Vec<u8> {
        let cs = 1u64 << cluster_bits;
        let mut b = encode_v3(size, cluster_bits, 1, 3 * cs, cs, 1);
        b.resize(cs as usize, 0);
        b
    }

    #[test]
    fn parses_a_minimal_v3_header() {
        let b = v3(1 << 28, 16);
        let h = Header::parse(&b, 4 << 16).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.size, 1 << 28);
        assert_eq!(h.cluster_size(), 65536);
        assert_eq!(h.compression, Compression::Zlib);
        assert!(h.backing_file.is_none());
    }

    #[test]
    fn refuses_what_it_cannot_read_naming_the_feature() {
        let err = |b: &[u8]| Header::parse(b, 4 << 16).unwrap_err().to_string();
        let mut b = v3(1 << 28, 16);
        b[32..36].copy_from_slice(&2u32.to_be_bytes());
        assert!(err(&b).contains("encrypted (LUKS"), "{}", err(&b));
        let mut b = v3(1 << 28, 16);
        b[79] = 1;
        assert!(err(&b).contains("dirty bit"));
        // The corrupt bit: read-only opens read what is left; writing is refused.
        let mut b = v3(1 << 28, 16);
        b[79] = 2;
        let h = Header::parse(&b, 1 << 20).expect("a corrupt image opens for reading");
        let e = crate::write::check_writable(&h).unwrap_err().to_string();
        assert!(e.contains("corrupt bit") && e.contains("read-only"), "{e}");
        let mut b = v3(1 << 28, 16);
        b[78] = 1; // bit 8
        assert!(err(&b).contains("unknown incompatible features: bit 8"), "{}", err(&b));
        // With a feature name table naming it.
        let at = V3_HEADER_LEN as usize;
        b[at..at + 4].copy_from_slice(&EXT_FEATURE_TABLE.to_be_bytes());
        b[at + 4..at + 8].copy_from_slice(&48u32.to_be_bytes());
        b[at + 8] = 0;
        b[at + 9] = 8;
        b[at + 10..at + 17].copy_from_slice(b"frobbed");
        assert!(err(&b).contains("bit 8 (frobbed)"), "{}", err(&b));
    }

    #[test]
    fn refuses_hostile_fields() {
        let err = |b: &[u8], len: u64| Header::parse(b, len).unwrap_err().to_string();
        assert!(matches!(Header::parse(b"not a qcow2", 100), Err(Qcow2Error::NotQcow2)));
        assert!(err(&b"QFI\xfb"[..], 4).contains("cut short"));
        let mut b = v3(1 << 28, 16);
        b[20..24].copy_from_slice(&30u32.to_be_bytes());
        assert!(err(&b, 1 << 20).contains("cluster_bits"));
        let mut b = v3(1 << 28, 16);
        b[36..40].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(err(&b, 1 << 20).contains("larger than 32 MiB"));
        let b = v3(1 << 40, 16);
        assert!(err(&b, 1 << 20).contains("fewer than"));
        let b = v3(1 << 28, 16);
        assert!(err(&b, 65536).contains("past the end of the file"));
        let mut b = v3(1 << 28, 16);
        b[40..48].copy_from_slice(&12345u64.to_be_bytes());
        assert!(err(&b, 1 << 20).contains("not cluster aligned"));
        let mut b = v3(1 << 28, 16);
        b[8..16].copy_from_slice(&65530u64.to_be_bytes());
        b[16..20].copy_from_slice(&100u32.to_be_bytes());
        assert!(err(&b, 1 << 20).contains("backing file name"));
        let mut b = v3(1 << 28, 16);
        b[4..8].copy_from_slice(&4u32.to_be_bytes());
        assert!(err(&b, 1 << 20).contains("version 4"));
        let mut b = v3(1 << 28, 16);
        b[104] = 1;
        assert!(err(&b, 1 << 20).contains("disagree"));
    }

    #[test]
    fn encoded_backing_parses_back() {
        let mut b = encode_v3(1 << 28, 16, 1, 3 << 16, 1 << 16, 1);
        encode_backing(&mut b, "../base/disk.raw", "raw", 65536).unwrap();
        b.resize(65536, 0);
        let h = Header::parse(&b, 4 << 16).unwrap();
        assert_eq!(h.backing_file.as_deref(), Some("../base/disk.raw"));
        assert_eq!(h.backing_format.as_deref(), Some("raw"));
        let mut b = encode_v3(1 << 20, 9, 1, 3 << 9, 1 << 9, 1);
        let long = "x".repeat(400);
        assert!(encode_backing(&mut b, &long, "qcow2", 512).unwrap_err().to_string().contains("does not fit"));
        assert!(encode_backing(&mut b, "", "qcow2", 512).is_err());
        assert!(encode_backing(&mut b, &"y".repeat(1024), "qcow2", 65536).is_err());
        assert!(encode_backing(&mut b, "a\0b", "qcow2", 65536).is_err());
    }

    #[test]
    fn reads_backing_name_and_format() {
        let mut b = v3(1 << 28, 16);
        let name = b"base.qcow2";
        b[8..16].copy_from_slice(&512u64.to_be_bytes());
        b[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
        b[512..512 + name.len()].copy_from_slice(name);
        let at = V3_HEADER_LEN as usize;
        b[at..at + 4].copy_from_slice(&EXT_BACKING_FORMAT.to_be_bytes());
        b[at + 4..at + 8].copy_from_slice(&5u32.to_be_bytes());
        b[at + 8..at + 13].copy_from_slice(b"qcow2");
        let h = Header::parse(&b, 4 << 16).unwrap();
        assert_eq!(h.backing_file.as_deref(), Some("base.qcow2"));
        assert_eq!(h.backing_format.as_deref(), Some("qcow2"));
    }
}
