//! The encodings of FORMAT.md: every object's bytes to and from Rust values. No I/O, no
//! cryptography (callers seal and open; see [`crate::crypto`]). Every parser checks each
//! length, count and offset against the input and the limits before it allocates.
use serde::{Deserialize, Serialize};

/// A SHA-256 digest or a blob id.
pub type Digest = [u8; 32];
/// The entry of a zero chunk, and the digest of an all-zero page (FORMAT.md §7).
pub const ZERO: Digest = [0; 32];

pub const FORMAT_NAME: &str = "ferry-repository";
pub const VERSION: u32 = 1;
pub const PACK_MAGIC: &[u8; 8] = b"FERRYPK1";
pub const INDEX_MAGIC: &[u8; 8] = b"FERRYIX1";
/// `le32 trailer length || magic` at a pack's end.
pub const PACK_TAIL: usize = 12;
/// One trailer or index entry: id, kind, offset, stored and plain length.
pub const ENTRY_LEN: usize = 45;

pub const MAX_CONFIG: u64 = 64 << 10;
pub const MAX_PACK: u64 = 1 << 30;
pub const MAX_INDEX: u64 = 256 << 20;
pub const MAX_MANIFEST: u64 = 64 << 20;
pub const MAX_LOCK: u64 = 4 << 10;
pub const MAX_TRAILER_ENTRIES: u32 = 1 << 20;
pub const MAX_PAGES: u64 = 1 << 24;

/// A format violation: what is wrong, without the object's name (the caller adds it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FormatError(pub String);

/// `config` (FORMAT.md §3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub format: String,
    pub version: u32,
    pub id: String,
    pub created: String,
    pub chunk_size: u32,
    pub page_entries: u32,
    pub compression: String,
    pub encryption: Option<Encryption>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Encryption {
    pub cipher: String,
    pub kdf: Kdf,
    /// hex of nonce || ciphertext || tag.
    pub key: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KdfCost {
    pub m_kib: u32,
    pub t: u32,
    pub p: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Kdf {
    pub name: String,
    pub m_kib: u32,
    pub t: u32,
    pub p: u32,
    /// 64 hex digits.
    pub salt: String,
}

impl Config {
    /// Parses and validates (format, version, chunk_size, page_entries, compression,
    /// cipher and KDF names and cost limits, hex lengths).
    pub fn parse(bytes: &[u8]) -> Result<Config, FormatError> {
        let _ = bytes;
        todo!()
    }
    pub fn to_bytes(&self) -> Vec<u8> {
        todo!()
    }
}

/// Kinds of blobs (FORMAT.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlobKind {
    Data = 0,
    Page = 1,
}

/// One blob in a pack: from a trailer or an index object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobEntry {
    pub id: Digest,
    pub kind: BlobKind,
    pub offset: u32,
    pub stored_len: u32,
    pub plain_len: u32,
}

/// Bounds of blob sizes, from the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub chunk_size: u32,
    pub page_entries: u32,
}

impl Limits {
    /// The most plain bytes a blob of `kind` may have.
    pub fn max_plain(&self, kind: BlobKind) -> usize {
        match kind {
            BlobKind::Data => self.chunk_size as usize,
            BlobKind::Page => 32 * self.page_entries as usize,
        }
    }
}

/// The plain trailer of a pack (without the tail).
pub fn encode_trailer(entries: &[BlobEntry]) -> Vec<u8> {
    let _ = entries;
    todo!()
}

/// Parses a plain trailer; `blobs_len` is the length of the pack before its stored
/// trailer (every blob must lie inside it, without overlaps).
pub fn parse_trailer(plain: &[u8], blobs_len: u64, limits: &Limits) -> Result<Vec<BlobEntry>, FormatError> {
    let _ = (plain, blobs_len, limits);
    todo!()
}

/// The tail of a pack: `le32 len(trailer_stored) || PACK_MAGIC`.
pub fn pack_tail(trailer_stored_len: u32) -> [u8; PACK_TAIL] {
    let _ = trailer_stored_len;
    todo!()
}

/// From a pack's last [`PACK_TAIL`] bytes and its total length: the stored trailer's
/// length, checked to fit.
pub fn parse_pack_tail(tail: &[u8], pack_len: u64) -> Result<u32, FormatError> {
    let _ = (tail, pack_len);
    todo!()
}

/// The blobs of one pack, in an index object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackBlobs {
    pub pack: Digest,
    pub blobs: Vec<BlobEntry>,
}

/// The plain form of an index object (FORMAT.md §6).
pub fn encode_index(packs: &[PackBlobs]) -> Vec<u8> {
    let _ = packs;
    todo!()
}

pub fn parse_index(plain: &[u8], limits: &Limits) -> Result<Vec<PackBlobs>, FormatError> {
    let _ = (plain, limits);
    todo!()
}

/// A page's plain bytes: its entries.
pub fn encode_page(entries: &[Digest]) -> Vec<u8> {
    let _ = entries;
    todo!()
}

/// Parses a page that must have exactly `entries` entries.
pub fn parse_page(plain: &[u8], entries: usize) -> Result<Vec<Digest>, FormatError> {
    let _ = (plain, entries);
    todo!()
}

/// What a snapshot's change map was (FORMAT.md §7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Changes {
    Full,
    DirtyBitmap { bitmap: String },
    ExtentsFrom { file: String },
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotStats {
    /// Bytes read from the source.
    pub read: u64,
    /// Chunks written by the backup (changed or read), zero chunks included.
    pub written_chunks: u64,
    /// Chunks not in the repository before.
    pub new_chunks: u64,
    /// Stored bytes added (new blobs, pages included).
    pub new_stored: u64,
    pub zero_chunks: u64,
}

/// A snapshot manifest (FORMAT.md §7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u32,
    pub name: String,
    pub time: String,
    pub size: u64,
    pub chunk_size: u32,
    pub page_entries: u32,
    /// hex digests; "" for an all-zero page.
    pub pages: Vec<String>,
    pub parent: Option<String>,
    pub source: String,
    pub changes: Changes,
    pub blkhash: Option<String>,
    #[serde(default)]
    pub stats: SnapshotStats,
    #[serde(default)]
    pub host: String,
    #[serde(default)]
    pub ferry: String,
}

impl Manifest {
    /// Parses and validates against the repository's limits: version, name, size, page
    /// count and digests, time.
    pub fn parse(json: &[u8], limits: &Limits) -> Result<Manifest, FormatError> {
        let _ = (json, limits);
        todo!()
    }
    pub fn to_bytes(&self) -> Vec<u8> {
        todo!()
    }
    /// Chunks in the disk.
    pub fn chunks(&self) -> u64 {
        self.size.div_ceil(self.chunk_size as u64)
    }
    /// The page digests, decoded (`ZERO` for an all-zero page). Valid after `parse`.
    pub fn page_digests(&self) -> Vec<Digest> {
        todo!()
    }
}

/// Whether `name` is a valid disk name (FORMAT.md §7).
pub fn valid_name(name: &str) -> bool {
    let _ = name;
    todo!()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LockKind {
    Backup,
    Forget,
    Gc,
}

/// A lock (FORMAT.md §8).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lock {
    pub kind: LockKind,
    #[serde(default)]
    pub disk: Option<String>,
    pub host: String,
    pub pid: u32,
    pub time: String,
    pub refreshed: String,
}

impl Lock {
    pub fn parse(json: &[u8]) -> Result<Lock, FormatError> {
        let _ = json;
        todo!()
    }
    pub fn to_bytes(&self) -> Vec<u8> {
        todo!()
    }
}

pub fn hex(d: &[u8]) -> String {
    let _ = d;
    todo!()
}

/// Parses exactly 64 hex digits.
pub fn parse_digest(s: &str) -> Option<Digest> {
    let _ = s;
    todo!()
}

/// Runs every parser on `data` (the fuzz target): none may panic or allocate beyond its
/// limits.
pub fn fuzz(data: &[u8]) {
    let _ = data;
    todo!()
}
