//! The encodings of FORMAT.md: every object's bytes to and from Rust values. No I/O, no
//! cryptography (callers seal and open; see [`crate::crypto`]). Every parser checks each
//! length, count and offset against the input and the limits before it allocates.
use serde::{Deserialize, Serialize};

/// A SHA-256 digest or a blob id.
pub type Digest = [u8; 32];
/// The entry of a zero chunk, and the digest of an all-zero page (FORMAT.md §7).
pub const ZERO: Digest = [0; 32];

pub const FORMAT_NAME: &str = "ferry-repository";
/// The version of manifests and checkpoints (FORMAT.md §7, §7a).
pub const VERSION: u32 = 1;
/// The version of a located manifest, whose pages are located pages (FORMAT.md §7c): in
/// version 3 repositories only.
pub const LOCATED_VERSION: u32 = 2;
/// The repository format version whose snapshots are located (FORMAT.md §7c).
pub const LOCATED_CONFIG_VERSION: u32 = 3;
/// The repository format version `init` writes in `config` (FORMAT.md §3): 3, whose
/// encrypted objects are sealed with per-object keys (§4a) and whose snapshots are
/// located (§7c).
pub const CONFIG_VERSION: u32 = 3;
/// The repository format versions this ferry reads and writes, each as its version says.
pub const CONFIG_VERSIONS: std::ops::RangeInclusive<u32> = 1..=LOCATED_CONFIG_VERSION;
pub const PACK_MAGIC: &[u8; 8] = b"FERRYPK1";
pub const INDEX_MAGIC: &[u8; 8] = b"FERRYIX1";
/// `le32 trailer length || magic` at a pack's end.
pub const PACK_TAIL: usize = 12;
/// The most a blob's stored form exceeds its plain bytes: the encoding's prefix byte and
/// an AEAD's 12-byte nonce and 16-byte tag (FORMAT.md §4).
pub const MAX_BLOB_OVERHEAD: u64 = 1 + 12 + 16;
/// One trailer or index entry: id, kind, offset, stored and plain length.
pub const ENTRY_LEN: usize = 45;

pub const MAX_CONFIG: u64 = 64 << 10;
pub const MAX_PACK: u64 = 1 << 30;
pub const MAX_INDEX: u64 = 256 << 20;
pub const MAX_MANIFEST: u64 = 64 << 20;
pub const MAX_LOCK: u64 = 4 << 10;
pub const MAX_KEY_OBJECT: u64 = 4 << 10;
/// The most `keys/` objects a repository may have (each costs a KDF run to try).
pub const MAX_KEY_OBJECTS: usize = 16;
pub const MAX_TRAILER_ENTRIES: u32 = 1 << 20;
/// The most blobs a writer (backup, gc, migrate) puts in one pack, far below
/// [`MAX_TRAILER_ENTRIES`]: a chunk of a repeated pattern stores in about 20 bytes, so a
/// pack closed by its bytes alone could list more blobs than any reader accepts, and its
/// index object and trailer would then both be refused as damaged.
pub const PACK_BLOBS: usize = 1 << 16;
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

fn err<T>(why: impl Into<String>) -> Result<T, FormatError> {
    Err(FormatError(why.into()))
}

/// The cipher of an encrypted repository (FORMAT.md §3).
pub const CIPHER: &str = "aes-256-gcm";
/// The key-derivation function of an encrypted repository (FORMAT.md §3).
pub const KDF: &str = "argon2id";
/// The one compression of version 1.
pub const COMPRESSION: &str = "zstd";
/// Bounds of the config's parameters (FORMAT.md §3).
pub const MIN_CHUNK_SIZE: u32 = 4096;
pub const MAX_CHUNK_SIZE: u32 = 1 << 20;
pub const MIN_PAGE_ENTRIES: u32 = 16;
pub const MAX_PAGE_ENTRIES: u32 = 65536;
pub const KDF_M_KIB: std::ops::RangeInclusive<u32> = 8192..=4_194_304;
pub const KDF_T: std::ops::RangeInclusive<u32> = 1..=64;
pub const KDF_P: std::ops::RangeInclusive<u32> = 1..=64;
/// The length of the wrapped key: nonce, the 64-byte master key, tag.
pub const WRAPPED_KEY_LEN: usize = 12 + 64 + 16;

/// Checks a KDF cost against FORMAT.md §3's limits (before anything runs the KDF).
pub fn check_kdf_cost(c: &KdfCost) -> Result<(), FormatError> {
    if !KDF_M_KIB.contains(&c.m_kib) {
        return err(format!(
            "the KDF memory is {} KiB; it must be from {} to {} KiB",
            c.m_kib,
            KDF_M_KIB.start(),
            KDF_M_KIB.end()
        ));
    }
    if !KDF_T.contains(&c.t) {
        return err(format!("the KDF passes are {}; they must be from 1 to 64", c.t));
    }
    if !KDF_P.contains(&c.p) {
        return err(format!("the KDF lanes are {}; they must be from 1 to 64", c.p));
    }
    Ok(())
}

/// Checks a chunk size and page length against FORMAT.md §3's limits.
pub fn check_limits(l: &Limits) -> Result<(), FormatError> {
    let (c, p) = (l.chunk_size, l.page_entries);
    if !c.is_power_of_two() || !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&c) {
        return err(format!("chunk_size is {c}; it must be a power of two from 4096 to 1048576"));
    }
    if !p.is_power_of_two() || !(MIN_PAGE_ENTRIES..=MAX_PAGE_ENTRIES).contains(&p) {
        return err(format!("page_entries is {p}; it must be a power of two from 16 to 65536"));
    }
    Ok(())
}

/// Whether `s` is `n` lowercase hex digits.
pub(crate) fn is_hex(s: &str, n: usize) -> bool {
    s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Parses lowercase hex of any even length.
pub fn parse_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !is_hex(s, s.len()) {
        return None;
    }
    let nib = |b: u8| if b.is_ascii_digit() { b - b'0' } else { b - b'a' + 10 };
    Some(s.as_bytes().chunks_exact(2).map(|p| nib(p[0]) << 4 | nib(p[1])).collect())
}

/// Checks an RFC 3339 time (`2026-11-26T22:00:00Z`).
pub(crate) fn check_time(what: &str, t: &str) -> Result<(), FormatError> {
    match t.parse::<jiff::Timestamp>() {
        Ok(_) => Ok(()),
        Err(_) => err(format!("{what} {:?} is not an RFC 3339 time", shorten(t))),
    }
}

/// At most 80 characters of `s`, for messages.
fn shorten(s: &str) -> String {
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

fn json_error(what: &str, e: serde_json::Error) -> FormatError {
    FormatError(format!("the {what} is not valid: {e}"))
}

/// A JSON object of the repository (`what`: the config, a manifest...) of at most `max`
/// bytes, its length checked before anything is parsed.
pub(crate) fn bounded_json<T: serde::de::DeserializeOwned>(
    json: &[u8],
    max: u64,
    what: &str,
) -> Result<T, FormatError> {
    if json.len() as u64 > max {
        return err(format!("the {what} is {} bytes long; at most {max} are allowed", json.len()));
    }
    serde_json::from_slice(json).map_err(|e| json_error(what, e))
}

/// Only a config's format and version: what a config of a later version is told by.
#[derive(Deserialize)]
struct ConfigVersion {
    format: String,
    version: u32,
}

impl Config {
    /// Parses and validates (format, version, chunk_size, page_entries, compression,
    /// cipher and KDF names and cost limits, hex lengths). A config of a version this
    /// ferry does not know is refused as such, whatever fields it has.
    pub fn parse(bytes: &[u8]) -> Result<Config, FormatError> {
        let c: Config = match bounded_json(bytes, MAX_CONFIG, "config") {
            Ok(c) => c,
            Err(e) => {
                return match serde_json::from_slice::<ConfigVersion>(bytes) {
                    Ok(v) if v.format == FORMAT_NAME && !CONFIG_VERSIONS.contains(&v.version) => {
                        Err(unknown_version(v.version))
                    }
                    _ => Err(e),
                }
            }
        };
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), FormatError> {
        if self.format != FORMAT_NAME {
            return err(format!("the config's format is {:?}, not {FORMAT_NAME:?}", shorten(&self.format)));
        }
        if !CONFIG_VERSIONS.contains(&self.version) {
            return Err(unknown_version(self.version));
        }
        if !is_hex(&self.id, 64) {
            return err("the config's id is not 64 hex digits");
        }
        check_time("the config's creation time", &self.created)?;
        check_limits(&self.limits())?;
        if self.compression != COMPRESSION {
            return err(format!(
                "the compression is {:?}; this ferry knows {COMPRESSION:?} only",
                shorten(&self.compression)
            ));
        }
        if let Some(e) = &self.encryption {
            e.validate()?;
        }
        Ok(())
    }

    /// The blob size bounds of this repository.
    pub fn limits(&self) -> Limits {
        Limits { chunk_size: self.chunk_size, page_entries: self.page_entries }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

fn unknown_version(v: u32) -> FormatError {
    FormatError(format!(
        "the repository has format version {v}; this ferry reads versions {} to {} only (use a newer ferry)",
        CONFIG_VERSIONS.start(),
        CONFIG_VERSIONS.end()
    ))
}

/// A `keys/ID` object: one more passphrase's copy of the master key (FORMAT.md §3a).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyObject {
    pub created: String,
    /// The host that made it (at most 255 bytes, no control characters; may be empty).
    pub host: String,
    pub kdf: Kdf,
    /// hex of nonce || ciphertext || tag, as `config`'s `key`.
    pub key: String,
}

impl KeyObject {
    /// Parses and validates (time, host, KDF name, cost limits and salt, key length).
    pub fn parse(bytes: &[u8]) -> Result<KeyObject, FormatError> {
        let k: KeyObject = bounded_json(bytes, MAX_KEY_OBJECT, "key object")?;
        check_time("the key's creation time", &k.created)?;
        if k.host.len() > 255 || k.host.chars().any(char::is_control) {
            return err("the key's host is longer than 255 bytes or holds control characters");
        }
        Encryption { cipher: CIPHER.into(), kdf: k.kdf.clone(), key: k.key.clone() }.validate()?;
        Ok(k)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

/// Whether `s` names a key object: `keys/` and 16 lowercase hex digits.
pub fn is_key_object_name(s: &str) -> bool {
    s.strip_prefix("keys/").is_some_and(|id| is_hex(id, 16))
}

impl Kdf {
    pub fn cost(&self) -> KdfCost {
        KdfCost { m_kib: self.m_kib, t: self.t, p: self.p }
    }
}

impl Encryption {
    /// Checks names, KDF cost limits and hex lengths (FORMAT.md §3).
    pub fn validate(&self) -> Result<(), FormatError> {
        if self.cipher != CIPHER {
            return err(format!("the cipher is {:?}; this ferry knows {CIPHER:?} only", shorten(&self.cipher)));
        }
        if self.kdf.name != KDF {
            return err(format!("the KDF is {:?}; this ferry knows {KDF:?} only", shorten(&self.kdf.name)));
        }
        check_kdf_cost(&self.kdf.cost())?;
        if !is_hex(&self.kdf.salt, 64) {
            return err("the KDF salt is not 64 hex digits");
        }
        if !is_hex(&self.key, 2 * WRAPPED_KEY_LEN) {
            return err(format!("the wrapped key is not {} hex digits", 2 * WRAPPED_KEY_LEN));
        }
        Ok(())
    }
}

/// Kinds of blobs (FORMAT.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlobKind {
    Data = 0,
    Page = 1,
    /// A located page (FORMAT.md §7c): entries with the place of their chunks.
    Located = 2,
}

impl BlobKind {
    /// A page of either kind.
    pub fn is_page(self) -> bool {
        self != BlobKind::Data
    }
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
    pub const DEFAULT: Limits = Limits { chunk_size: 65536, page_entries: 256 };

    /// The most plain bytes a blob of `kind` may have.
    pub fn max_plain(&self, kind: BlobKind) -> usize {
        match kind {
            BlobKind::Data => self.chunk_size as usize,
            BlobKind::Page => 32 * self.page_entries as usize,
            BlobKind::Located => 2 + LOCATED_ENTRY_LEN_PLUS_PACK * self.page_entries as usize,
        }
    }
}

/// The most bytes a sealed object adds to its plain form: nonce and tag.
pub const SEAL_OVERHEAD: usize = 12 + 16;
/// The longest plain trailer: its count and [`MAX_TRAILER_ENTRIES`] entries.
pub const MAX_TRAILER: u64 = 4 + ENTRY_LEN as u64 * MAX_TRAILER_ENTRIES as u64;

fn le32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn put_entry(out: &mut Vec<u8>, e: &BlobEntry) {
    out.extend_from_slice(&e.id);
    out.push(e.kind as u8);
    out.extend_from_slice(&e.offset.to_le_bytes());
    out.extend_from_slice(&e.stored_len.to_le_bytes());
    out.extend_from_slice(&e.plain_len.to_le_bytes());
}

/// One entry from exactly [`ENTRY_LEN`] bytes, checked: a known kind, a plain length
/// within `limits`, a stored length of at least one byte (the encoding's prefix) ending
/// within `max_end`.
fn entry(b: &[u8], max_end: u64, limits: &Limits) -> Result<BlobEntry, FormatError> {
    let mut id = [0u8; 32];
    id.copy_from_slice(&b[..32]);
    let kind = match b[32] {
        0 => BlobKind::Data,
        1 => BlobKind::Page,
        2 => BlobKind::Located,
        k => {
            return err(format!(
                "blob {} has kind {k}, which is none of 0 (data), 1 (page), 2 (located page)",
                hex(&id)
            ))
        }
    };
    let e = BlobEntry { id, kind, offset: le32(b, 33), stored_len: le32(b, 37), plain_len: le32(b, 41) };
    if e.stored_len == 0 {
        return err(format!("blob {} has a stored length of 0", hex(&id)));
    }
    let end = e.offset as u64 + e.stored_len as u64;
    if end > max_end {
        return err(format!(
            "blob {} (bytes {}..{end}) lies past the pack's blobs, which end at {max_end}",
            hex(&id),
            e.offset
        ));
    }
    // The encoding's prefix, the plain bytes at most (zstd is kept only when shorter), and
    // an AEAD's nonce and tag: no reader fetches more than that for one blob.
    if e.stored_len as u64 > e.plain_len as u64 + MAX_BLOB_OVERHEAD {
        return err(format!(
            "blob {} has {} stored bytes for {} plain bytes; at most {MAX_BLOB_OVERHEAD} more are possible",
            hex(&id),
            e.stored_len,
            e.plain_len
        ));
    }
    if e.plain_len as usize > limits.max_plain(kind) {
        return err(format!(
            "blob {} has {} plain bytes; a {} blob has at most {}",
            hex(&id),
            e.plain_len,
            match kind {
                BlobKind::Data => "data",
                BlobKind::Page => "page",
                BlobKind::Located => "located page",
            },
            limits.max_plain(kind)
        ));
    }
    Ok(e)
}

/// Checks that no two blobs of one pack overlap.
fn check_overlaps(blobs: &[BlobEntry]) -> Result<(), FormatError> {
    let mut spans: Vec<(u64, u64, usize)> =
        blobs.iter().enumerate().map(|(i, b)| (b.offset as u64, b.offset as u64 + b.stored_len as u64, i)).collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return err(format!(
                "blobs {} (bytes {}..{}) and {} (bytes {}..{}) overlap",
                hex(&blobs[w[0].2].id),
                w[0].0,
                w[0].1,
                hex(&blobs[w[1].2].id),
                w[1].0,
                w[1].1
            ));
        }
    }
    Ok(())
}

/// The plain trailer of a pack (without the tail).
pub fn encode_trailer(entries: &[BlobEntry]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + ENTRY_LEN * entries.len());
    v.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for e in entries {
        put_entry(&mut v, e);
    }
    v
}

/// Parses a plain trailer; `blobs_len` is the length of the pack before its stored
/// trailer (every blob must lie inside it, without overlaps).
pub fn parse_trailer(plain: &[u8], blobs_len: u64, limits: &Limits) -> Result<Vec<BlobEntry>, FormatError> {
    if plain.len() < 4 {
        return err(format!("the trailer is {} bytes long, too short for its count", plain.len()));
    }
    let count = le32(plain, 0);
    if count > MAX_TRAILER_ENTRIES {
        return err(format!("the trailer lists {count} blobs; at most {MAX_TRAILER_ENTRIES} are allowed"));
    }
    let body = &plain[4..];
    if !body.len().is_multiple_of(ENTRY_LEN) || (body.len() / ENTRY_LEN) as u64 != count as u64 {
        return err(format!(
            "the trailer lists {count} blobs but has {} bytes of entries ({ENTRY_LEN} bytes each)",
            body.len()
        ));
    }
    let blobs = body.chunks_exact(ENTRY_LEN).map(|b| entry(b, blobs_len, limits)).collect::<Result<Vec<_>, _>>()?;
    check_overlaps(&blobs)?;
    Ok(blobs)
}

/// The tail of a pack: `le32 len(trailer_stored) || PACK_MAGIC`.
pub fn pack_tail(trailer_stored_len: u32) -> [u8; PACK_TAIL] {
    let mut t = [0u8; PACK_TAIL];
    t[..4].copy_from_slice(&trailer_stored_len.to_le_bytes());
    t[4..].copy_from_slice(PACK_MAGIC);
    t
}

/// From a pack's last [`PACK_TAIL`] bytes and its total length: the stored trailer's
/// length, checked to fit.
pub fn parse_pack_tail(tail: &[u8], pack_len: u64) -> Result<u32, FormatError> {
    if pack_len > MAX_PACK {
        return err(format!("the pack is {pack_len} bytes long; at most {MAX_PACK} are allowed"));
    }
    if tail.len() != PACK_TAIL || (pack_len as usize) < PACK_TAIL {
        return err(format!("the pack is {pack_len} bytes long, too short for its tail"));
    }
    if &tail[4..] != PACK_MAGIC {
        return err("the pack does not end with FERRYPK1");
    }
    let len = le32(tail, 0);
    if (len as u64) < 4 || len as u64 > MAX_TRAILER + SEAL_OVERHEAD as u64 {
        return err(format!("the pack's trailer is said to be {len} bytes long, which no trailer is"));
    }
    if len as u64 + PACK_TAIL as u64 > pack_len {
        return err(format!("the pack's trailer is said to be {len} bytes long, longer than the pack"));
    }
    Ok(len)
}

/// The blobs of one pack, in an index object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackBlobs {
    pub pack: Digest,
    pub blobs: Vec<BlobEntry>,
}

/// The plain form of an index object (FORMAT.md §6).
pub fn encode_index(packs: &[PackBlobs]) -> Vec<u8> {
    let n: usize = packs.iter().map(|p| 36 + ENTRY_LEN * p.blobs.len()).sum();
    let mut v = Vec::with_capacity(12 + n);
    v.extend_from_slice(INDEX_MAGIC);
    v.extend_from_slice(&(packs.len() as u32).to_le_bytes());
    for p in packs {
        v.extend_from_slice(&p.pack);
        v.extend_from_slice(&(p.blobs.len() as u32).to_le_bytes());
        for e in &p.blobs {
            put_entry(&mut v, e);
        }
    }
    v
}

/// Parses the plain form of an index object: every count checked against the bytes
/// left before anything is allocated for it, every blob against `limits` and its pack's
/// largest size, no blobs of one pack overlapping, nothing after the last pack.
pub fn parse_index(plain: &[u8], limits: &Limits) -> Result<Vec<PackBlobs>, FormatError> {
    let mut packs = Vec::new();
    each_index_pack(plain, limits, |p| packs.push(p))?;
    Ok(packs)
}

/// [`parse_index`] giving each pack to `f` as it is parsed, so that only one pack's
/// entries are held (the packs before an error in the object have been given: check the
/// object with a first pass that keeps nothing where that matters).
pub fn each_index_pack(plain: &[u8], limits: &Limits, mut f: impl FnMut(PackBlobs)) -> Result<(), FormatError> {
    if plain.len() as u64 > MAX_INDEX {
        return err(format!("the index object is {} bytes long; at most {MAX_INDEX} are allowed", plain.len()));
    }
    if plain.len() < 12 || &plain[..8] != INDEX_MAGIC {
        return err("the index object does not start with FERRYIX1");
    }
    let pack_count = le32(plain, 8) as usize;
    let mut rest = &plain[12..];
    // Each pack takes at least its id and count.
    if pack_count > rest.len() / 36 {
        return err(format!("the index lists {pack_count} packs, more than its {} bytes can hold", plain.len()));
    }
    for _ in 0..pack_count {
        if rest.len() < 36 {
            return err("the index object ends inside a pack's header");
        }
        let mut pack = [0u8; 32];
        pack.copy_from_slice(&rest[..32]);
        let count = le32(rest, 32) as usize;
        rest = &rest[36..];
        if count > MAX_TRAILER_ENTRIES as usize || count > rest.len() / ENTRY_LEN {
            return err(format!("the index lists {count} blobs in pack {}, more than its bytes can hold", hex(&pack)));
        }
        let (entries, after) = rest.split_at(count * ENTRY_LEN);
        rest = after;
        let blobs = entries
            .chunks_exact(ENTRY_LEN)
            .map(|b| entry(b, MAX_PACK, limits))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| FormatError(format!("pack {}: {e}", hex(&pack))))?;
        check_overlaps(&blobs).map_err(|e| FormatError(format!("pack {}: {e}", hex(&pack))))?;
        f(PackBlobs { pack, blobs });
    }
    if !rest.is_empty() {
        return err(format!("the index object has {} bytes after its last pack", rest.len()));
    }
    Ok(())
}

/// A page's plain bytes: its entries.
pub fn encode_page(entries: &[Digest]) -> Vec<u8> {
    entries.concat()
}

/// Parses a page that must have exactly `entries` entries.
pub fn parse_page(plain: &[u8], entries: usize) -> Result<Vec<Digest>, FormatError> {
    if entries.checked_mul(32) != Some(plain.len()) {
        return err(format!("the page is {} bytes long; {entries} entries of 32 bytes were expected", plain.len()));
    }
    Ok(plain.chunks_exact(32).map(|c| c.try_into().unwrap_or(ZERO)).collect())
}

/// One entry of a located page: digest, pack number, offset, stored length.
pub const LOCATED_ENTRY_LEN: usize = 42;
/// A located page's bytes per entry at most: the entry and a pack id of its own.
const LOCATED_ENTRY_LEN_PLUS_PACK: usize = LOCATED_ENTRY_LEN + 32;
/// The pack number of an entry without a hint.
pub const NO_PACK: u16 = 0xFFFF;

/// Where a blob is hinted to be (FORMAT.md §7c): bytes `offset .. offset + stored_len` of
/// the pack numbered `pack` in the page's (or manifest's) list; `pack` [`NO_PACK`] when
/// there is no hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Hint {
    pub pack: u16,
    pub offset: u32,
    pub stored_len: u32,
}

impl Hint {
    pub const NONE: Hint = Hint { pack: NO_PACK, offset: 0, stored_len: 0 };
    pub fn is_none(&self) -> bool {
        self.pack == NO_PACK
    }
}

/// A blob's place, for a writer of hints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobAt {
    pub pack: Digest,
    pub offset: u32,
    pub stored_len: u32,
}

/// A located page, parsed: its packs, and each entry's digest and hint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LocatedPage {
    pub packs: Vec<Digest>,
    pub entries: Vec<Digest>,
    pub hints: Vec<Hint>,
}

impl LocatedPage {
    /// Entry `i`'s hinted place, if it has one.
    pub fn at(&self, i: usize) -> Option<BlobAt> {
        let h = self.hints.get(i)?;
        let pack = *self.packs.get(h.pack as usize)?;
        Some(BlobAt { pack, offset: h.offset, stored_len: h.stored_len })
    }
}

/// Checks a hint's range (FORMAT.md §7c): from 1 to `max_stored` bytes, within a pack's
/// largest size.
fn check_hint_range(offset: u32, stored_len: u32, max_stored: u64) -> Result<(), String> {
    if stored_len == 0 || stored_len as u64 > max_stored || offset as u64 + stored_len as u64 > MAX_PACK {
        return Err(format!(
            "hints bytes {offset}..{} (from 1 to {max_stored} bytes within {MAX_PACK})",
            offset as u64 + stored_len as u64
        ));
    }
    Ok(())
}

/// The plain bytes of a located page of `entries`, each with its place in `at` (none for
/// a zero entry, whatever `at` says): packs listed in the order of first use, so that the
/// same entries and places make the same bytes. A page whose entries use more than 65535
/// packs gives the entries after that no hint.
pub fn encode_located_page(entries: &[Digest], at: &[Option<BlobAt>]) -> Vec<u8> {
    let mut packs: Vec<Digest> = Vec::new();
    let mut numbers: std::collections::HashMap<Digest, u16> = std::collections::HashMap::new();
    let mut body = Vec::with_capacity(LOCATED_ENTRY_LEN * entries.len());
    for (i, d) in entries.iter().enumerate() {
        let place = at.get(i).copied().flatten().filter(|_| *d != ZERO);
        let hint = place
            .and_then(|p| {
                let next = packs.len();
                let no = match numbers.get(&p.pack) {
                    Some(n) => *n,
                    None if next < NO_PACK as usize => {
                        numbers.insert(p.pack, next as u16);
                        packs.push(p.pack);
                        next as u16
                    }
                    None => return None,
                };
                Some(Hint { pack: no, offset: p.offset, stored_len: p.stored_len })
            })
            .unwrap_or(Hint::NONE);
        body.extend_from_slice(d);
        body.extend_from_slice(&hint.pack.to_le_bytes());
        body.extend_from_slice(&hint.offset.to_le_bytes());
        body.extend_from_slice(&hint.stored_len.to_le_bytes());
    }
    let mut v = Vec::with_capacity(2 + 32 * packs.len() + body.len());
    v.extend_from_slice(&(packs.len() as u16).to_le_bytes());
    packs.iter().for_each(|p| v.extend_from_slice(p));
    v.extend_from_slice(&body);
    v
}

/// A manifest's pages (version 2, FORMAT.md §7c) from each page's digest and place: the
/// places as hints, their packs numbered in the order of first use (a page past the
/// 65535th pack gets no hint).
pub fn hinted_pages(pages: impl IntoIterator<Item = (Digest, Option<BlobAt>)>) -> (PackIds, Pages) {
    let mut packs = PackIds::default();
    let mut numbers: std::collections::HashMap<Digest, u16> = std::collections::HashMap::new();
    let mut out = Pages::default();
    for (d, at) in pages {
        let hint = at.filter(|_| d != ZERO).and_then(|a| {
            let next = packs.0.len();
            let no = match numbers.get(&a.pack) {
                Some(n) => *n,
                None if next < NO_PACK as usize => {
                    numbers.insert(a.pack, next as u16);
                    packs.0.push(a.pack);
                    next as u16
                }
                None => return None,
            };
            Some(Hint { pack: no, offset: a.offset, stored_len: a.stored_len })
        });
        match hint {
            Some(h) => out.push_hinted(d, h),
            None => out.push(d),
        }
    }
    (packs, out)
}

/// Parses a located page (FORMAT.md §7c); its entries' count is told by its length. Every
/// bound is checked before anything is allocated: the length against the pack count, each
/// hint's pack number, range and order of first use, the packs' uniqueness.
pub fn parse_located_page(plain: &[u8], limits: &Limits) -> Result<LocatedPage, FormatError> {
    if plain.len() > limits.max_plain(BlobKind::Located) || plain.len() < 2 {
        return err(format!("the located page is {} bytes long, which no located page is", plain.len()));
    }
    let pack_count = u16::from_le_bytes([plain[0], plain[1]]) as usize;
    let rest = plain.len() - 2;
    if rest < 32 * pack_count || !(rest - 32 * pack_count).is_multiple_of(LOCATED_ENTRY_LEN) {
        return err(format!(
            "the located page lists {pack_count} packs but is {} bytes long, which does not fit",
            plain.len()
        ));
    }
    let n = (rest - 32 * pack_count) / LOCATED_ENTRY_LEN;
    if pack_count > n || n > limits.page_entries as usize {
        return err(format!("the located page lists {pack_count} packs for {n} entries"));
    }
    let packs: Vec<Digest> =
        plain[2..2 + 32 * pack_count].chunks_exact(32).map(|c| c.try_into().unwrap_or(ZERO)).collect();
    let mut sorted = packs.clone();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[0] == w[1]) {
        return err("the located page lists a pack twice");
    }
    let max_stored = limits.chunk_size as u64 + MAX_BLOB_OVERHEAD;
    let mut page = LocatedPage { packs, entries: Vec::with_capacity(n), hints: Vec::with_capacity(n) };
    let mut used = 0usize;
    for (i, e) in plain[2 + 32 * pack_count..].chunks_exact(LOCATED_ENTRY_LEN).enumerate() {
        let d: Digest = e[..32].try_into().unwrap_or(ZERO);
        let hint = Hint { pack: u16::from_le_bytes([e[32], e[33]]), offset: le32(e, 34), stored_len: le32(e, 38) };
        if hint.is_none() {
            if hint != Hint::NONE {
                return err(format!("entry {i} has no hint but an offset or length"));
            }
        } else {
            if d == ZERO {
                return err(format!("entry {i} is a zero chunk with a hint"));
            }
            match (hint.pack as usize).cmp(&used) {
                std::cmp::Ordering::Less => {}
                std::cmp::Ordering::Equal if used < pack_count => used += 1,
                _ => return err(format!("entry {i} names pack {} out of the order of first use", hint.pack)),
            }
            check_hint_range(hint.offset, hint.stored_len, max_stored)
                .map_err(|e| FormatError(format!("entry {i} {e}")))?;
        }
        page.entries.push(d);
        page.hints.push(hint);
    }
    if used != pack_count {
        return err(format!("the located page lists {pack_count} packs; its entries use {used}"));
    }
    Ok(page)
}

/// The entries of a page blob of `kind` (a page or a located page), checked.
pub fn parse_any_page(kind: BlobKind, plain: &[u8], limits: &Limits) -> Result<Vec<Digest>, FormatError> {
    match kind {
        BlobKind::Located => Ok(parse_located_page(plain, limits)?.entries),
        _ => {
            if plain.is_empty() || !plain.len().is_multiple_of(32) {
                return err(format!("the page has {} bytes, not a multiple of 32", plain.len()));
            }
            parse_page(plain, plain.len() / 32)
        }
    }
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

/// What a manifest's `pages` are parsed into: each page's digest in turn ([`ZERO`] for
/// `""`, an all-zero page), after the parser has checked it.
pub trait PageList: Default {
    fn push(&mut self, d: Digest);
    /// A page with a hint of where its blob is (manifest version 2, FORMAT.md §7c).
    fn push_hinted(&mut self, d: Digest, hint: Hint);
    /// Pages so far.
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// What the hints need checked against the manifest: how many pages have one, the
    /// largest pack number and stored length among them.
    fn hint_bounds(&self) -> HintBounds;
}

/// The hints of a manifest's pages, summed up for [`Manifest::validate`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HintBounds {
    pub hinted: u64,
    pub max_pack: u16,
    pub max_stored: u32,
}

impl HintBounds {
    fn add(&mut self, h: &Hint) {
        self.hinted += 1;
        self.max_pack = self.max_pack.max(h.pack);
        self.max_stored = self.max_stored.max(h.stored_len);
    }
}

/// A manifest's page digests, held compactly: one bit per page (not all-zero) and the
/// digests of the pages that are not, in order: 32 bytes a page at most, an all-zero
/// page one bit. The JSON is parsed one digest at a time (no string is kept), and
/// written back as it was: 64 hex digits, `""` for an all-zero page (FORMAT.md §7).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Pages {
    len: u64,
    /// One bit per page: it is not all-zero.
    present: Vec<u64>,
    /// The digests of the pages that are not all-zero, in page order.
    digests: Vec<Digest>,
    /// Beside `digests`, each page's hint (FORMAT.md §7c); empty while no page has one.
    hints: Vec<Hint>,
    bounds: HintBounds,
    /// The manifest's `page_packs`, which the hints name, once split from it
    /// ([`Manifest::split`]).
    packs: Vec<Digest>,
}

impl PageList for Pages {
    fn push(&mut self, d: Digest) {
        if d != ZERO && !self.hints.is_empty() {
            self.hints.push(Hint::NONE);
        }
        self.push_digest(d);
    }
    fn push_hinted(&mut self, d: Digest, hint: Hint) {
        if hint.is_none() || d == ZERO {
            return self.push(d);
        }
        if self.hints.is_empty() {
            self.hints.resize(self.digests.len(), Hint::NONE);
        }
        self.hints.push(hint);
        self.bounds.add(&hint);
        self.push_digest(d);
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn hint_bounds(&self) -> HintBounds {
        self.bounds
    }
}

impl Pages {
    fn push_digest(&mut self, d: Digest) {
        if self.len.is_multiple_of(64) {
            self.present.push(0);
        }
        if d != ZERO {
            if let Some(w) = self.present.last_mut() {
                *w |= 1 << (self.len % 64);
            }
            self.digests.push(d);
        }
        self.len += 1;
    }

    /// Each page's digest, [`ZERO`] for an all-zero page.
    pub fn iter(&self) -> impl Iterator<Item = Digest> + '_ {
        let mut nonzero = self.digests.iter();
        (0..self.len).map(move |i| match self.present.get((i / 64) as usize).map_or(0, |w| w >> (i % 64) & 1) {
            1 => nonzero.next().copied().unwrap_or(ZERO),
            _ => ZERO,
        })
    }
    /// The digests of the pages that are not all-zero, in order.
    pub fn nonzero(&self) -> &[Digest] {
        &self.digests
    }
    /// The packs the hints name ([`Manifest::split`] moves them here).
    pub fn packs(&self) -> &[Digest] {
        &self.packs
    }
    /// Each page's digest and hint ([`Hint::NONE`] where it has none).
    pub fn iter_hinted(&self) -> impl Iterator<Item = (Digest, Hint)> + '_ {
        let mut k = 0usize;
        self.iter().map(move |d| {
            if d == ZERO {
                return (d, Hint::NONE);
            }
            k += 1;
            (d, self.hints.get(k - 1).copied().unwrap_or(Hint::NONE))
        })
    }
    /// Each page's digest, [`ZERO`] for an all-zero page.
    pub fn to_vec(&self) -> Vec<Digest> {
        self.iter().collect()
    }
    /// The pages' count.
    pub fn count(&self) -> u64 {
        self.len
    }
    /// The bytes it holds on the heap.
    pub fn heap_bytes(&self) -> usize {
        self.present.capacity() * 8 + self.digests.capacity() * 32 + self.hints.capacity() * 12
    }
}

impl FromIterator<Digest> for Pages {
    fn from_iter<I: IntoIterator<Item = Digest>>(it: I) -> Pages {
        let mut p = Pages::default();
        it.into_iter().for_each(|d| p.push(d));
        p
    }
}

impl std::fmt::Debug for Pages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pages({} pages, {} not all-zero)", self.len, self.digests.len())
    }
}

impl Serialize for Pages {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = s.serialize_seq(Some(self.len as usize))?;
        let mut buf = [0u8; 64];
        for (d, h) in self.iter_hinted() {
            if d == ZERO {
                seq.serialize_element("")?;
            } else if h.is_none() {
                seq.serialize_element(hex_into(&d, &mut buf))?;
            } else {
                let s = format!("{} {} {} {}", hex_into(&d, &mut buf), h.pack, h.offset, h.stored_len);
                seq.serialize_element(&s)?;
            }
        }
        seq.end()
    }
}

/// Only how many pages a manifest has, each digest checked and then dropped: what
/// listing snapshots needs (their pages are read again for the one snapshot that is
/// used).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageCount(pub u64, pub HintBounds);

impl PageList for PageCount {
    fn push(&mut self, _: Digest) {
        self.0 += 1;
    }
    fn push_hinted(&mut self, _: Digest, hint: Hint) {
        self.0 += 1;
        self.1.add(&hint);
    }
    fn len(&self) -> u64 {
        self.0
    }
    fn hint_bounds(&self) -> HintBounds {
        self.1
    }
}

/// One element of `pages` as parsed: a digest and maybe a hint, or a string that is none.
struct PageString(Option<(Digest, Hint)>);

/// Parses `"<64 hex> <pack> <offset> <stored_len>"` (decimal numbers, no signs, no
/// leading zeros).
fn parse_hinted(s: &str) -> Option<(Digest, Hint)> {
    let mut it = s.split(' ');
    let d = parse_digest(it.next()?)?;
    let mut num = || -> Option<u32> {
        let t = it.next()?;
        let canonical = !t.is_empty()
            && t.len() <= 10
            && t.bytes().all(|b| b.is_ascii_digit())
            && (t == "0" || !t.starts_with('0'));
        canonical.then(|| t.parse().ok()).flatten()
    };
    let (pack, offset, stored_len) = (num()?, num()?, num()?);
    if it.next().is_some()
        || pack >= NO_PACK as u32
        || d == ZERO
        || check_hint_range(offset, stored_len, MAX_PACK).is_err()
    {
        return None;
    }
    Some((d, Hint { pack: pack as u16, offset, stored_len }))
}

impl<'de> Deserialize<'de> for PageString {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = PageString;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a page digest (64 hex digits, or \"\")")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<PageString, E> {
                Ok(PageString(match s.len() {
                    0 => Some((ZERO, Hint::NONE)),
                    64 => parse_digest(s).map(|d| (d, Hint::NONE)),
                    _ => parse_hinted(s),
                }))
            }
        }
        d.deserialize_str(V)
    }
}

/// Parses `pages` into any [`PageList`]: at most [`MAX_PAGES`], each `""` or 64 hex
/// digits, checked as it comes (nothing is allocated beyond what the list keeps).
struct PagesVisitor<P>(std::marker::PhantomData<P>);

impl<'de, P: PageList> serde::de::Visitor<'de> for PagesVisitor<P> {
    type Value = P;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of page digests")
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<P, A::Error> {
        let mut pages = P::default();
        while let Some(PageString(d)) = seq.next_element()? {
            let i = pages.len();
            if i >= MAX_PAGES {
                return Err(serde::de::Error::custom(format!("there are more than {MAX_PAGES} pages")));
            }
            match d {
                Some((d, h)) if h.is_none() => pages.push(d),
                Some((d, h)) => pages.push_hinted(d, h),
                None => {
                    return Err(serde::de::Error::custom(format!(
                        "page {i}'s digest is neither 64 hex digits nor \"\" (nor, in version 2, one with its place)"
                    )))
                }
            }
        }
        Ok(pages)
    }
}

impl<'de> Deserialize<'de> for Pages {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(PagesVisitor(std::marker::PhantomData))
    }
}

impl<'de> Deserialize<'de> for PageCount {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(PagesVisitor(std::marker::PhantomData))
    }
}

/// What a manifest's `page_packs` are parsed into (FORMAT.md §7c): each pack id in turn,
/// after the parser has checked it.
pub trait PackList: Default {
    fn push(&mut self, d: Digest);
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A manifest's `page_packs`: the packs its page hints name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PackIds(pub Vec<Digest>);

/// Only how many `page_packs` a manifest has: what a listing keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PackCount(pub u64);

impl PackList for PackIds {
    fn push(&mut self, d: Digest) {
        self.0.push(d);
    }
    fn len(&self) -> u64 {
        self.0.len() as u64
    }
}

impl PackList for PackCount {
    fn push(&mut self, _: Digest) {
        self.0 += 1;
    }
    fn len(&self) -> u64 {
        self.0
    }
}

impl Serialize for PackIds {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        let mut buf = [0u8; 64];
        for d in &self.0 {
            seq.serialize_element(hex_into(d, &mut buf))?;
        }
        seq.end()
    }
}

/// Parses `page_packs` into any [`PackList`]: at most [`MAX_PAGES`] pack ids of 64 hex
/// digits each, checked as they come.
struct PacksVisitor<K>(std::marker::PhantomData<K>);

impl<'de, K: PackList> serde::de::Visitor<'de> for PacksVisitor<K> {
    type Value = K;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of pack ids")
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<K, A::Error> {
        let mut packs = K::default();
        while let Some(PageString(d)) = seq.next_element()? {
            if packs.len() >= MAX_PAGES {
                return Err(serde::de::Error::custom(format!("there are more than {MAX_PAGES} page packs")));
            }
            match d {
                Some((d, h)) if d != ZERO && h.is_none() => packs.push(d),
                _ => return Err(serde::de::Error::custom(format!("page pack {} is not 64 hex digits", packs.len()))),
            }
        }
        Ok(packs)
    }
}

impl<'de> Deserialize<'de> for PackIds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(PacksVisitor(std::marker::PhantomData))
    }
}

impl<'de> Deserialize<'de> for PackCount {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(PacksVisitor(std::marker::PhantomData))
    }
}

fn no_packs<K: PackList>(k: &K) -> bool {
    k.is_empty()
}

/// A snapshot manifest (FORMAT.md §7, version 2 §7c).
///
/// `P` is what its pages are kept as: [`Pages`] (the digests, compactly) or, in a
/// [`ManifestSummary`], [`PageCount`] (how many: what listing snapshots needs); `K` its
/// `page_packs`, likewise.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(bound(
    serialize = "P: Serialize, K: Serialize + PackList",
    deserialize = "P: Deserialize<'de>, K: Deserialize<'de> + PackList"
))]
pub struct Manifest<P = Pages, K = PackIds> {
    pub version: u32,
    pub name: String,
    pub time: String,
    pub size: u64,
    pub chunk_size: u32,
    pub page_entries: u32,
    /// The packs the pages' hints name (manifest version 2; FORMAT.md §7c).
    #[serde(default, skip_serializing_if = "no_packs")]
    pub page_packs: K,
    /// The page digests (in JSON: 64 hex digits, "" for an all-zero page; version 2: with
    /// a hint).
    pub pages: P,
    pub parent: Option<String>,
    /// The version 1 manifest that `ferry repo migrate` made this one from (its id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrated_from: Option<String>,
    pub source: String,
    pub changes: Changes,
    pub blkhash: Option<String>,
    #[serde(default)]
    pub stats: SnapshotStats,
    #[serde(default)]
    pub host: String,
    #[serde(default)]
    pub ferry: String,
    /// Where a copied snapshot came from (`ferry repo copy`); `None` for a backup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copied_from: Option<CopiedFrom>,
    /// `ferry backup --tag`: at most [`MAX_TAGS`], each a [`valid_tag`] (FORMAT.md §7).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// `ferry backup --note`: at most [`MAX_NOTE`] bytes, no control characters.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
}

/// The most tags a snapshot has.
pub const MAX_TAGS: usize = 16;
/// The longest note, in bytes.
pub const MAX_NOTE: usize = 1024;

/// A tag: 1 to 64 of `A-Z a-z 0-9 . _ - + @ : =` (no `,`, which separates tags in a
/// `--keep-tag` list, nothing a terminal or a shell would read as more than text).
pub fn valid_tag(t: &str) -> bool {
    (1..=64).contains(&t.len()) && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-+@:=".contains(&b))
}

/// Whether `n` may be a note: at most [`MAX_NOTE`] bytes, no control characters (lists
/// print it as it is).
pub fn valid_note(n: &str) -> bool {
    n.len() <= MAX_NOTE && !n.chars().any(|c| c.is_control() || is_format_char(c))
}

/// Whether `c` is of Unicode's general category Cf (format characters: the bidirectional
/// controls that reorder what a terminal shows, zero-width ones, tags), as of Unicode 15.
fn is_format_char(c: char) -> bool {
    matches!(
        c as u32,
        0xAD | 0x600..=0x605
            | 0x61C
            | 0x6DD
            | 0x70F
            | 0x890..=0x891
            | 0x8E2
            | 0x180E
            | 0x200B..=0x200F
            | 0x202A..=0x202E
            | 0x2060..=0x2064
            | 0x2066..=0x206F
            | 0xFEFF
            | 0xFFF9..=0xFFFB
            | 0x110BD
            | 0x110CD
            | 0x13430..=0x1343F
            | 0x1BCA0..=0x1BCA3
            | 0x1D173..=0x1D17A
            | 0xE0001
            | 0xE0020..=0xE007F
    )
}

/// The snapshot a copy was made of (FORMAT.md §7, `copied_from`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopiedFrom {
    /// The source repository's id (its config's `id`).
    pub repository: String,
    /// The snapshot's id there.
    pub snapshot: String,
    /// Its `time` there.
    pub time: String,
}

/// A manifest without its page digests (only their count): what lists, `info` and the
/// resolution of names keep of each snapshot.
pub type ManifestSummary = Manifest<PageCount, PackCount>;

/// Parses and validates a manifest against the repository's limits: version, name,
/// size, page count and digests, time. The digests are checked as they are parsed, and
/// kept as `P` keeps them.
pub fn parse_manifest<P: PageList + serde::de::DeserializeOwned, K: PackList + serde::de::DeserializeOwned>(
    json: &[u8],
    limits: &Limits,
) -> Result<Manifest<P, K>, FormatError> {
    let m: Manifest<P, K> = bounded_json(json, MAX_MANIFEST, "manifest")?;
    m.validate(limits)?;
    Ok(m)
}

impl<P: PageList, K: PackList> Manifest<P, K> {
    /// The checks of [`Manifest::parse`], for a manifest made in memory.
    pub fn validate(&self, limits: &Limits) -> Result<(), FormatError> {
        let hints = self.pages.hint_bounds();
        match self.version {
            VERSION => {
                if hints.hinted > 0 || !self.page_packs.is_empty() || self.migrated_from.is_some() {
                    return err("the manifest has version 1 but page hints, page packs or migrated_from (version 2's)");
                }
            }
            LOCATED_VERSION => {
                if self.page_packs.len() > self.pages.len() {
                    return err(format!(
                        "the manifest lists {} page packs for {} pages",
                        self.page_packs.len(),
                        self.pages.len()
                    ));
                }
                if hints.hinted > 0 && hints.max_pack as u64 >= self.page_packs.len() {
                    return err(format!(
                        "a page hint names page pack {}; the manifest lists {}",
                        hints.max_pack,
                        self.page_packs.len()
                    ));
                }
                let max = limits.max_plain(BlobKind::Located) as u64 + MAX_BLOB_OVERHEAD;
                if hints.max_stored as u64 > max {
                    return err(format!(
                        "a page hint spans {} bytes; a located page is stored in at most {max}",
                        hints.max_stored
                    ));
                }
                if self.migrated_from.as_deref().is_some_and(|p| !is_hex(p, 64)) {
                    return err("migrated_from is not a snapshot id (64 hex digits)");
                }
            }
            v => {
                return err(format!(
                "the manifest has version {v}; this ferry reads versions {VERSION} and {LOCATED_VERSION} only (use a \
                     newer ferry)"
            ))
            }
        }
        if !valid_name(&self.name) {
            return err(format!(
                "the disk name {:?} is not 1 to 200 of A-Z a-z 0-9 . _ - (not starting with . or -)",
                shorten(&self.name)
            ));
        }
        check_time("the snapshot time", &self.time)?;
        if self.size > 1 << 63 {
            return err(format!("the disk size {} is larger than 2^63", self.size));
        }
        if self.chunk_size != limits.chunk_size || self.page_entries != limits.page_entries {
            return err(format!(
                "the manifest has chunk_size {} and page_entries {}, the repository {} and {}",
                self.chunk_size, self.page_entries, limits.chunk_size, limits.page_entries
            ));
        }
        if self.chunk_size == 0 || self.page_entries == 0 {
            return err("the manifest's chunk_size and page_entries must not be 0");
        }
        let want = self.chunks().div_ceil(self.page_entries as u64);
        if want > MAX_PAGES {
            return err(format!("the disk needs {want} index pages; at most {MAX_PAGES} are allowed"));
        }
        if self.pages.len() != want {
            return err(format!(
                "the manifest has {} pages; a disk of {} bytes has {want}",
                self.pages.len(),
                self.size
            ));
        }
        if self.parent.as_deref().is_some_and(|p| !is_hex(p, 64)) {
            return err("the parent is not a snapshot id (64 hex digits)");
        }
        if self.blkhash.as_deref().is_some_and(|h| !is_hex(h, 64)) {
            return err("the blkhash is not 64 hex digits");
        }
        if let Some(c) = &self.copied_from {
            if !is_hex(&c.repository, 64) || !is_hex(&c.snapshot, 64) {
                return err("copied_from does not name a repository and a snapshot (64 hex digits each)");
            }
            check_time("copied_from's time", &c.time)?;
        }
        if self.tags.len() > MAX_TAGS || !self.tags.iter().all(|t| valid_tag(t)) {
            return err(format!(
                "the tags are more than {MAX_TAGS}, or one is not 1 to 64 of A-Z a-z 0-9 . _ - + @ : ="
            ));
        }
        if !valid_note(&self.note) {
            return err(format!("the note is longer than {MAX_NOTE} bytes or has control characters"));
        }
        Ok(())
    }

    /// Chunks in the disk.
    pub fn chunks(&self) -> u64 {
        self.size.div_ceil(self.chunk_size as u64)
    }

    /// The same manifest with its pages and page packs kept as `f` makes them of these.
    pub fn map_pages<Q, L>(self, f: impl FnOnce(P, K) -> (Q, L)) -> Manifest<Q, L> {
        let (pages, page_packs) = f(self.pages, self.page_packs);
        Manifest {
            version: self.version,
            name: self.name,
            time: self.time,
            size: self.size,
            chunk_size: self.chunk_size,
            page_entries: self.page_entries,
            page_packs,
            pages,
            parent: self.parent,
            migrated_from: self.migrated_from,
            source: self.source,
            changes: self.changes,
            blkhash: self.blkhash,
            stats: self.stats,
            host: self.host,
            ferry: self.ferry,
            copied_from: self.copied_from,
            tags: self.tags,
            note: self.note,
        }
    }
}

impl Manifest {
    /// [`parse_manifest`], keeping the page digests.
    pub fn parse(json: &[u8], limits: &Limits) -> Result<Manifest, FormatError> {
        parse_manifest(json, limits)
    }
    /// [`parse_manifest`], keeping the count of the pages only.
    pub fn parse_summary(json: &[u8], limits: &Limits) -> Result<ManifestSummary, FormatError> {
        parse_manifest(json, limits)
    }
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
    /// The page digests, decoded (`ZERO` for an all-zero page).
    pub fn page_digests(&self) -> Vec<Digest> {
        self.pages.to_vec()
    }
    /// Its summary (the count of its pages for the pages), and its pages (which keep its
    /// page packs, [`Pages::packs`]).
    pub fn split(self) -> (ManifestSummary, Pages) {
        let mut pages = Pages::default();
        let summary = self.map_pages(|mut p, k| {
            let counts = (PageCount(p.len(), p.hint_bounds()), PackCount(k.len()));
            p.packs = k.0;
            pages = p;
            counts
        });
        (summary, pages)
    }
    /// Whether its pages are located pages (FORMAT.md §7c).
    pub fn located(&self) -> bool {
        self.version == LOCATED_VERSION
    }
}

/// A checkpoint of a running backup (FORMAT.md §7a): what `ferry backup --resume`
/// continues from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub version: u32,
    pub name: String,
    pub time: String,
    pub size: u64,
    pub chunk_size: u32,
    pub page_entries: u32,
    /// The snapshot the backup started from (its id), if any.
    pub base: Option<String>,
    /// The source, as shown (credentials removed).
    pub source: String,
    /// What identifies the source's content (its backend's identity, or its shown name).
    pub identity: String,
    pub changes: Changes,
    /// The entries as of the checkpoint, as a manifest's pages.
    pub pages: Pages,
    /// `[first chunk, count]` runs of chunks whose data is stored: sorted, disjoint, not
    /// touching, each count ≥ 1.
    pub done: Vec<[u64; 2]>,
}

/// The largest checkpoint object.
pub const MAX_CHECKPOINT: u64 = MAX_MANIFEST;
/// The longest source identity a checkpoint holds.
pub const MAX_IDENTITY: usize = 4096;

impl Checkpoint {
    /// Parses and validates against the repository's limits: the checks of a manifest,
    /// and runs that are sorted, disjoint and within the disk.
    pub fn parse(json: &[u8], limits: &Limits) -> Result<Checkpoint, FormatError> {
        let c: Checkpoint = bounded_json(json, MAX_CHECKPOINT, "checkpoint")?;
        c.validate(limits)?;
        Ok(c)
    }

    pub fn validate(&self, limits: &Limits) -> Result<(), FormatError> {
        if self.version != VERSION {
            return err(format!(
                "the checkpoint has version {}; this ferry reads version {VERSION} only (use a newer ferry)",
                self.version
            ));
        }
        let mut m = self.as_manifest_with(PageCount(self.pages.len(), self.pages.hint_bounds()));
        m.parent = self.base.clone();
        m.validate(limits).map_err(|e| FormatError(e.0.replace("manifest", "checkpoint")))?;
        if self.identity.len() > MAX_IDENTITY {
            return err(format!("the source identity is longer than {MAX_IDENTITY} bytes"));
        }
        let chunks = m.chunks();
        let mut next = 0u64;
        for (i, [first, count]) in self.done.iter().enumerate() {
            let end = first.checked_add(*count).unwrap_or(u64::MAX);
            if *count == 0 || end > chunks || (i > 0 && *first <= next) {
                return err(format!(
                    "done run {i} ([{first}, {count}]) is empty, past the disk's {chunks} chunks, or not after the one \
                     before"
                ));
            }
            next = end;
        }
        Ok(())
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Its entries as a manifest (to read its pages through): no parent, no blkhash.
    pub fn as_manifest(&self) -> Manifest {
        self.as_manifest_with(self.pages.clone())
    }

    fn as_manifest_with<P>(&self, pages: P) -> Manifest<P> {
        Manifest {
            version: self.version,
            name: self.name.clone(),
            time: self.time.clone(),
            size: self.size,
            chunk_size: self.chunk_size,
            page_entries: self.page_entries,
            page_packs: PackIds::default(),
            pages,
            parent: None,
            migrated_from: None,
            source: self.source.clone(),
            changes: self.changes.clone(),
            blkhash: None,
            stats: SnapshotStats::default(),
            host: String::new(),
            ferry: String::new(),
            copied_from: None,
            tags: Vec::new(),
            note: String::new(),
        }
    }

    /// Bytes of the disk whose chunks are done.
    pub fn done_bytes(&self) -> u64 {
        let cs = self.chunk_size as u64;
        self.done.iter().map(|[f, n]| ((f + n) * cs).min(self.size) - (f * cs).min(self.size)).sum()
    }
}

/// A damage record (FORMAT.md §7b): stored copies of blobs that `verify` found damaged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DamageRecord {
    pub version: u32,
    /// When it was found (RFC 3339).
    pub time: String,
    /// The host that found it.
    pub host: String,
    pub packs: Vec<DamagedPack>,
}

/// One pack's damage in a [`DamageRecord`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DamagedPack {
    /// The pack's id (64 hex digits).
    pub pack: String,
    /// What was wrong, for people (at most [`MAX_DAMAGE_WHY`] bytes).
    pub why: String,
    /// The ids (64 hex digits each) of its blob copies that do not read back; empty when
    /// only the pack as a whole (its name, its trailer) is wrong.
    pub blobs: Vec<String>,
}

/// The largest damage record.
pub const MAX_DAMAGE: u64 = 16 << 20;
/// The longest `why` of a damaged pack.
pub const MAX_DAMAGE_WHY: usize = 4096;

impl DamageRecord {
    /// Parses and validates: at most [`MAX_DAMAGE`] bytes, version 1, an RFC 3339 time,
    /// hex ids, each `why` at most [`MAX_DAMAGE_WHY`] bytes, each pack's blobs at most
    /// [`MAX_TRAILER_ENTRIES`].
    pub fn parse(json: &[u8]) -> Result<DamageRecord, FormatError> {
        let r: DamageRecord = bounded_json(json, MAX_DAMAGE, "damage record")?;
        r.validate()?;
        Ok(r)
    }

    pub fn validate(&self) -> Result<(), FormatError> {
        if self.version != VERSION {
            return err(format!(
                "the damage record has version {}; this ferry reads version {VERSION} only (use a newer ferry)",
                self.version
            ));
        }
        check_time("the damage record's time", &self.time)?;
        for (i, p) in self.packs.iter().enumerate() {
            if !is_hex(&p.pack, 64) {
                return err(format!("damaged pack {i}'s id is not 64 hex digits"));
            }
            if p.why.len() > MAX_DAMAGE_WHY {
                return err(format!("damaged pack {i}'s reason is longer than {MAX_DAMAGE_WHY} bytes"));
            }
            if p.blobs.len() > MAX_TRAILER_ENTRIES as usize {
                return err(format!("damaged pack {i} lists more than {MAX_TRAILER_ENTRIES} blobs"));
            }
            if p.blobs.iter().any(|b| !is_hex(b, 64)) {
                return err(format!("a blob id of damaged pack {i} is not 64 hex digits"));
            }
        }
        Ok(())
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// A condemned record (FORMAT.md §8a): packs that gc found unused and will delete once no
/// backup that could use them runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CondemnedRecord {
    pub version: u32,
    /// When gc stored it (RFC 3339, gc's clock).
    pub time: String,
    /// The host of the gc that stored it.
    pub host: String,
    /// The condemned packs' ids (64 hex digits each).
    pub packs: Vec<String>,
    /// The backup locks present when it was stored.
    pub backups: Vec<CondemnedLock>,
}

/// A backup lock named by a [`CondemnedRecord`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CondemnedLock {
    /// The lock object (`locks/` and 32 hex digits).
    pub lock: String,
    /// The lock's `time` (when it was taken).
    pub time: String,
}

/// The largest condemned record.
pub const MAX_CONDEMNED: u64 = 96 << 20;
/// The most packs one condemned record lists.
pub const MAX_CONDEMNED_PACKS: usize = 1 << 20;
/// The most backup locks one condemned record lists.
pub const MAX_CONDEMNED_LOCKS: usize = 65536;

impl CondemnedRecord {
    /// Parses and validates: at most [`MAX_CONDEMNED`] bytes, version 1, RFC 3339 times,
    /// hex pack ids (at most [`MAX_CONDEMNED_PACKS`]), lock names `locks/` and 32 hex
    /// digits (at most [`MAX_CONDEMNED_LOCKS`]).
    pub fn parse(json: &[u8]) -> Result<CondemnedRecord, FormatError> {
        let r: CondemnedRecord = bounded_json(json, MAX_CONDEMNED, "condemned record")?;
        if r.version != VERSION {
            return err(format!(
                "the condemned record has version {}; this ferry reads version {VERSION} only (use a newer ferry)",
                r.version
            ));
        }
        check_time("the condemned record's time", &r.time)?;
        if r.packs.len() > MAX_CONDEMNED_PACKS {
            return err(format!("the condemned record lists more than {MAX_CONDEMNED_PACKS} packs"));
        }
        if let Some(i) = r.packs.iter().position(|p| !is_hex(p, 64)) {
            return err(format!("condemned pack {i}'s id is not 64 hex digits"));
        }
        if r.backups.len() > MAX_CONDEMNED_LOCKS {
            return err(format!("the condemned record lists more than {MAX_CONDEMNED_LOCKS} backup locks"));
        }
        for (i, b) in r.backups.iter().enumerate() {
            if !b.lock.strip_prefix("locks/").is_some_and(|h| is_hex(h, 32)) {
                return err(format!("backup lock {i} of the condemned record is not locks/ and 32 hex digits"));
            }
            check_time("a backup lock's time in the condemned record", &b.time)?;
        }
        Ok(r)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// Whether `name` is a valid disk name (FORMAT.md §7).
pub fn valid_name(name: &str) -> bool {
    (1..=200).contains(&name.len())
        && !name.starts_with(['.', '-'])
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
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
    /// The holder's machine boot and PID namespace (`BOOT_ID pid:[INODE]`): its `pid` is
    /// tested for life only by a process of the same boot and namespace (containers and
    /// cloned machines share host names, not PIDs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<String>,
    /// When the holder process started, in clock ticks after the boot (`/proc/PID/stat`,
    /// field 22): with `boot`, a `pid` that runs again under this number is another
    /// process (the PID was reused). Locks written before it was recorded lack it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid_start: Option<u64>,
    /// The holder follows the condemned-pack rules (FORMAT.md §8a): a backup that treats
    /// condemned packs as absent, a gc that condemns packs instead of deleting them at
    /// once. Such a gc and such backups run side by side; a lock without it (an older
    /// ferry's) excludes gc as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub condemned: bool,
    /// A reader's lock (FORMAT.md §8: `repo copy`'s lock on its source): a `forget` lock
    /// that does not conflict with other shared ones, so readers run side by side while
    /// every forget and gc waits for them. A ferry that does not know the field takes it
    /// for a plain forget lock, which holds off the same forgets and gcs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
}

impl Lock {
    /// Parses and validates: at most [`MAX_LOCK`] bytes, RFC 3339 times, a `disk` tag
    /// (64 hex digits) on a backup lock and only there.
    pub fn parse(json: &[u8]) -> Result<Lock, FormatError> {
        let l: Lock = bounded_json(json, MAX_LOCK, "lock")?;
        check_time("the lock's time", &l.time)?;
        check_time("the lock's refresh time", &l.refreshed)?;
        match (&l.kind, &l.disk) {
            (LockKind::Backup, Some(d)) if is_hex(d, 64) => {}
            (LockKind::Backup, _) => return err("a backup lock's disk is not 64 hex digits"),
            (_, Some(_)) => return err("only a backup lock names a disk"),
            (_, None) => {}
        }
        if l.shared && l.kind != LockKind::Forget {
            return err("only a forget lock is shared");
        }
        Ok(l)
    }
    /// What the lock is held for, in messages: `backup`, `forget`, `gc`, or `read` for a
    /// shared lock.
    pub fn what(&self) -> &'static str {
        match self.kind {
            LockKind::Backup => "backup",
            LockKind::Forget if self.shared => "read",
            LockKind::Forget => "forget",
            LockKind::Gc => "gc",
        }
    }
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// The hex of a digest, written into `buf`.
fn hex_into<'a>(d: &Digest, buf: &'a mut [u8; 64]) -> &'a str {
    const H: &[u8; 16] = b"0123456789abcdef";
    for (i, &b) in d.iter().enumerate() {
        buf[2 * i] = H[(b >> 4) as usize];
        buf[2 * i + 1] = H[(b & 15) as usize];
    }
    std::str::from_utf8(buf).unwrap_or_default()
}

pub fn hex(d: &[u8]) -> String {
    const H: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(d.len() * 2);
    for &b in d {
        s.push(H[(b >> 4) as usize] as char);
        s.push(H[(b & 15) as usize] as char);
    }
    s
}

/// Parses exactly 64 lowercase hex digits.
pub fn parse_digest(s: &str) -> Option<Digest> {
    if !is_hex(s, 64) {
        return None;
    }
    parse_hex(s)?.try_into().ok()
}

/// Runs every parser on `data` (the fuzz target): none may panic or allocate beyond its
/// limits, and what parses encodes back to what parses the same.
pub fn fuzz(data: &[u8]) {
    // The first byte picks the limits, so that small pages and chunks are reached too.
    let limits = match data.first().copied().unwrap_or(0) % 3 {
        0 => Limits::DEFAULT,
        1 => Limits { chunk_size: MIN_CHUNK_SIZE, page_entries: MIN_PAGE_ENTRIES },
        _ => Limits { chunk_size: MAX_CHUNK_SIZE, page_entries: MAX_PAGE_ENTRIES },
    };
    // Bytes 1..5 give a trailer's `blobs_len`, the rest is the trailer.
    let blobs_len = data.get(1..5).map_or(0, |b| le32(b, 0) as u64);
    let trailer = data.get(5..).unwrap_or_default();
    if let Ok(c) = Config::parse(data) {
        assert_eq!(Config::parse(&c.to_bytes()).as_ref(), Ok(&c));
    }
    let summary = Manifest::parse_summary(data, &limits);
    if let Ok(m) = Manifest::parse(data, &limits) {
        assert_eq!(Manifest::parse(&m.to_bytes(), &limits).as_ref(), Ok(&m));
        assert_eq!(m.pages.iter().count() as u64, m.pages.count());
        assert_eq!(summary, Ok(m.split().0));
    } else {
        assert!(summary.is_err());
    }
    if let Ok(l) = Lock::parse(data) {
        assert_eq!(Lock::parse(&l.to_bytes()).as_ref(), Ok(&l));
    }
    if let Ok(k) = KeyObject::parse(data) {
        assert_eq!(KeyObject::parse(&k.to_bytes()).as_ref(), Ok(&k));
    }
    if let Ok(c) = Checkpoint::parse(data, &limits) {
        assert_eq!(Checkpoint::parse(&c.to_bytes(), &limits).as_ref(), Ok(&c));
        let _ = c.done_bytes();
    }
    if let Ok(r) = DamageRecord::parse(data) {
        assert_eq!(DamageRecord::parse(&r.to_bytes()).as_ref(), Ok(&r));
    }
    if let Ok(r) = CondemnedRecord::parse(data) {
        assert_eq!(CondemnedRecord::parse(&r.to_bytes()).as_ref(), Ok(&r));
    }
    if let Ok(t) = parse_trailer(trailer, blobs_len, &limits) {
        assert_eq!(encode_trailer(&t), trailer);
    }
    if let Ok(ix) = parse_index(data, &limits) {
        assert_eq!(encode_index(&ix), data);
    }
    if data.len() >= PACK_TAIL {
        let _ = parse_pack_tail(&data[data.len() - PACK_TAIL..], data.len() as u64);
    }
    if let Ok(p) = parse_page(data, data.len() / 32) {
        assert_eq!(encode_page(&p), data);
    }
    if let Ok(p) = parse_located_page(data, &limits) {
        let at: Vec<Option<BlobAt>> = (0..p.entries.len()).map(|i| p.at(i)).collect();
        assert_eq!(encode_located_page(&p.entries, &at), data);
        assert_eq!(parse_any_page(BlobKind::Located, data, &limits), Ok(p.entries));
    }
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = valid_name(s);
        if let Some(d) = parse_digest(s) {
            assert_eq!(hex(&d), s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits::DEFAULT;

    fn config() -> Config {
        Config {
            format: FORMAT_NAME.into(),
            version: 1,
            id: "ab".repeat(32),
            created: "2026-11-26T22:00:00Z".into(),
            chunk_size: 65536,
            page_entries: 256,
            compression: "zstd".into(),
            encryption: None,
        }
    }

    fn encryption() -> Encryption {
        Encryption {
            cipher: CIPHER.into(),
            kdf: Kdf { name: KDF.into(), m_kib: 65536, t: 3, p: 4, salt: "01".repeat(32) },
            key: "02".repeat(WRAPPED_KEY_LEN),
        }
    }

    fn refused(c: &Config, what: &str) {
        let e = Config::parse(&c.to_bytes()).unwrap_err();
        assert!(e.0.contains(what), "{e}");
    }

    #[test]
    fn config_round_trips_and_checks_every_parameter() {
        let c = config();
        assert_eq!(Config::parse(&c.to_bytes()).unwrap(), c);
        let e = Config { encryption: Some(encryption()), ..config() };
        assert_eq!(Config::parse(&e.to_bytes()).unwrap(), e);
        assert_eq!(c.limits(), Limits::DEFAULT);

        refused(&Config { format: "restic".into(), ..config() }, "format");
        Config::parse(&Config { version: 2, ..config() }.to_bytes()).unwrap();
        Config::parse(&Config { version: 3, ..config() }.to_bytes()).unwrap();
        refused(&Config { version: 4, ..config() }, "versions 1 to 3 only");
        refused(&Config { version: 0, ..config() }, "versions 1 to 3 only");
        // A later version is told as such even when its fields are new.
        let mut later: serde_json::Value = serde_json::from_slice(&c.to_bytes()).unwrap();
        later["version"] = 4.into();
        later["new_field"] = 1.into();
        let e = Config::parse(later.to_string().as_bytes()).unwrap_err();
        assert!(e.0.contains("format version 4"), "{e}");
        refused(&Config { id: "AB".repeat(32), ..config() }, "id");
        refused(&Config { id: "ab".repeat(31), ..config() }, "id");
        refused(&Config { created: "yesterday".into(), ..config() }, "RFC 3339");
        for cs in [0, 2048, 65535, 65537, 2 << 20] {
            refused(&Config { chunk_size: cs, ..config() }, "chunk_size");
        }
        for cs in [4096, 1 << 20] {
            Config::parse(&Config { chunk_size: cs, ..config() }.to_bytes()).unwrap();
        }
        for pe in [0, 8, 100, 131072] {
            refused(&Config { page_entries: pe, ..config() }, "page_entries");
        }
        refused(&Config { compression: "lz4".into(), ..config() }, "compression");
        let enc = |f: &dyn Fn(&mut Encryption)| {
            let mut e = encryption();
            f(&mut e);
            Config { encryption: Some(e), ..config() }
        };
        refused(&enc(&|e| e.cipher = "chacha20-poly1305".into()), "cipher");
        refused(&enc(&|e| e.kdf.name = "scrypt".into()), "KDF is");
        refused(&enc(&|e| e.kdf.m_kib = 8191), "KDF memory");
        refused(&enc(&|e| e.kdf.m_kib = 4_194_305), "KDF memory");
        refused(&enc(&|e| e.kdf.t = 0), "passes");
        refused(&enc(&|e| e.kdf.t = 65), "passes");
        refused(&enc(&|e| e.kdf.p = 0), "lanes");
        refused(&enc(&|e| e.kdf.p = 65), "lanes");
        refused(&enc(&|e| e.kdf.salt.pop().map(drop).unwrap_or_default()), "salt");
        refused(&enc(&|e| e.key.push_str("00")), "wrapped key");

        // Unknown fields, other JSON, and size.
        let mut j: serde_json::Value = serde_json::from_slice(&c.to_bytes()).unwrap();
        j["extra"] = 1.into();
        assert!(Config::parse(j.to_string().as_bytes()).is_err());
        assert!(Config::parse(b"[]").is_err());
        assert!(Config::parse(b"").is_err());
        let mut big = c.to_bytes();
        big.truncate(big.len() - 2);
        big.extend(std::iter::repeat_n(b' ', MAX_CONFIG as usize));
        big.extend(b"}\n");
        assert!(Config::parse(&big).unwrap_err().0.contains("at most 65536"));
    }

    #[test]
    fn key_objects_round_trip_and_are_checked() {
        let e = encryption();
        let k = KeyObject { created: "2026-11-28T09:00:00Z".into(), host: "backup-1".into(), kdf: e.kdf, key: e.key };
        assert_eq!(KeyObject::parse(&k.to_bytes()).unwrap(), k);
        let bad = |f: &dyn Fn(&mut KeyObject), what: &str| {
            let mut b = k.clone();
            f(&mut b);
            let e = KeyObject::parse(&b.to_bytes()).unwrap_err();
            assert!(e.0.contains(what), "{e}");
        };
        bad(&|k| k.created = "now".into(), "RFC 3339");
        bad(&|k| k.host = "a\nb".into(), "host");
        bad(&|k| k.host = "h".repeat(256), "host");
        bad(&|k| k.kdf.m_kib = 1, "KDF memory");
        bad(&|k| k.kdf.name = "scrypt".into(), "KDF is");
        bad(&|k| k.key.push('0'), "wrapped key");
        let mut big = k.to_bytes();
        big.truncate(big.len() - 2);
        big.extend(std::iter::repeat_n(b' ', MAX_KEY_OBJECT as usize));
        big.extend(b"}\n");
        assert!(KeyObject::parse(&big).unwrap_err().0.contains("at most 4096"));
        assert!(is_key_object_name("keys/0123456789abcdef"));
        for n in ["keys/0123456789abcde", "keys/0123456789ABCDEF", "keys/0123456789abcdef0", "key/0123456789abcdef"] {
            assert!(!is_key_object_name(n), "{n}");
        }
    }

    fn entry(n: u8, kind: BlobKind, offset: u32, stored_len: u32, plain_len: u32) -> BlobEntry {
        BlobEntry { id: [n; 32], kind, offset, stored_len, plain_len }
    }

    fn entries() -> Vec<BlobEntry> {
        vec![
            entry(1, BlobKind::Data, 0, 100, 65536),
            entry(2, BlobKind::Page, 100, 50, 8192),
            entry(3, BlobKind::Data, 150, 1, 1),
        ]
    }

    #[test]
    fn trailers_round_trip_and_every_damage_is_refused() {
        let t = encode_trailer(&entries());
        assert_eq!(t.len(), 4 + 3 * ENTRY_LEN);
        assert_eq!(parse_trailer(&t, 151, &L).unwrap(), entries());
        assert_eq!(parse_trailer(&encode_trailer(&[]), 0, &L).unwrap(), []);
        // Every truncation.
        for n in 0..t.len() {
            assert!(parse_trailer(&t[..n], 151, &L).is_err(), "{n} bytes");
        }
        // Bytes after the entries, and counts that disagree with the length.
        assert!(parse_trailer(&[&t[..], &[0]].concat(), 151, &L).is_err());
        for count in [2u32, 4, MAX_TRAILER_ENTRIES + 1, u32::MAX] {
            let mut b = t.clone();
            b[..4].copy_from_slice(&count.to_le_bytes());
            assert!(parse_trailer(&b, 151, &L).is_err(), "count {count}");
        }
        let bad = |e: Vec<BlobEntry>, blobs_len: u64, what: &str| {
            let msg = parse_trailer(&encode_trailer(&e), blobs_len, &L).unwrap_err().0;
            assert!(msg.contains(what), "{msg}");
        };
        // A blob past the blobs, and one ending right at the end.
        bad(entries(), 150, "past the pack's blobs");
        let mut e = entries();
        e[2].offset = u32::MAX;
        bad(e, 151, "past");
        // Overlaps, in any order.
        let mut e = entries();
        e[2].offset = 149;
        bad(e, 151, "overlap");
        let mut e = entries();
        e.swap(0, 2);
        e[0].offset = 0;
        bad(e, 151, "overlap");
        // Plain lengths over the limits, an empty stored blob, an unknown kind.
        let mut e = entries();
        e[0].plain_len = 65537;
        bad(e, 151, "at most 65536");
        let mut e = entries();
        e[1].plain_len = 8193;
        bad(e, 151, "at most 8192");
        let mut e = entries();
        e[2].stored_len = 0;
        bad(e, 151, "stored length of 0");
        let mut b = t.clone();
        b[4 + 32] = 3;
        assert!(parse_trailer(&b, 151, &L).unwrap_err().0.contains("kind 3"));
    }

    #[test]
    fn pack_tails() {
        let t = pack_tail(1000);
        assert_eq!(&t[4..], PACK_MAGIC);
        assert_eq!(parse_pack_tail(&t, 1012).unwrap(), 1000);
        assert_eq!(parse_pack_tail(&t, 5000).unwrap(), 1000);
        assert!(parse_pack_tail(&t, 1011).unwrap_err().0.contains("longer than the pack"));
        assert!(parse_pack_tail(&t[1..], 1012).is_err());
        assert!(parse_pack_tail(&t, 11).is_err());
        assert!(parse_pack_tail(&t, MAX_PACK + 1).is_err());
        let mut b = t;
        b[11] = b'2';
        assert!(parse_pack_tail(&b, 5000).unwrap_err().0.contains("FERRYPK1"));
        for len in [0, 3, (MAX_TRAILER + SEAL_OVERHEAD as u64 + 1) as u32, u32::MAX] {
            assert!(parse_pack_tail(&pack_tail(len), MAX_PACK).is_err(), "{len}");
        }
    }

    #[test]
    fn index_objects_round_trip_and_every_damage_is_refused() {
        let packs = vec![
            PackBlobs { pack: [9; 32], blobs: entries() },
            PackBlobs { pack: [8; 32], blobs: vec![] },
            PackBlobs { pack: [7; 32], blobs: vec![entry(4, BlobKind::Data, 0, 10, 10)] },
        ];
        let ix = encode_index(&packs);
        assert_eq!(parse_index(&ix, &L).unwrap(), packs);
        assert_eq!(parse_index(&encode_index(&[]), &L).unwrap(), []);
        for n in 0..ix.len() {
            assert!(parse_index(&ix[..n], &L).is_err(), "{n} bytes");
        }
        assert!(parse_index(&[&ix[..], &[0]].concat(), &L).unwrap_err().0.contains("after its last pack"));
        let mut b = ix.clone();
        b[0] = b'X';
        assert!(parse_index(&b, &L).unwrap_err().0.contains("FERRYIX1"));
        // Huge counts are refused before anything is allocated for them.
        for at in [8, 12 + 32] {
            let mut b = ix.clone();
            b[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
            assert!(parse_index(&b, &L).unwrap_err().0.contains("more than"), "at {at}");
        }
        let mut overlapping = packs.clone();
        overlapping[0].blobs[1].offset = 99;
        assert!(parse_index(&encode_index(&overlapping), &L).unwrap_err().0.contains("overlap"));
        let mut large = packs;
        large[2].blobs[0].plain_len = 65537;
        assert!(parse_index(&encode_index(&large), &L).is_err());
    }

    #[test]
    fn pages() {
        let e = [[1u8; 32], ZERO, [3; 32]];
        let p = encode_page(&e);
        assert_eq!(p.len(), 96);
        assert_eq!(parse_page(&p, 3).unwrap(), e);
        assert!(parse_page(&p, 2).is_err());
        assert!(parse_page(&p[..95], 3).is_err());
        assert!(parse_page(&p, usize::MAX).is_err());
        assert_eq!(parse_page(&[], 0).unwrap(), Vec::<Digest>::new());
    }

    fn at(pack: u8, offset: u32, stored_len: u32) -> Option<BlobAt> {
        Some(BlobAt { pack: [pack; 32], offset, stored_len })
    }

    #[test]
    fn located_pages_round_trip_and_are_canonical() {
        let l = Limits { chunk_size: 65536, page_entries: 16 };
        let e = [[1u8; 32], ZERO, [3; 32], [4; 32], [5; 32]];
        // Pack 9 used first, then 7; a zero entry's place is ignored; one chunk unknown.
        let places = [at(9, 100, 50), at(7, 0, 10), at(7, 10, 20), None, at(9, 0, 100)];
        let p = encode_located_page(&e, &places);
        assert_eq!(p.len(), 2 + 2 * 32 + 5 * LOCATED_ENTRY_LEN);
        let page = parse_located_page(&p, &l).unwrap();
        assert_eq!(page.packs, vec![[9; 32], [7; 32]]);
        assert_eq!(page.entries, e);
        assert_eq!(page.at(0), at(9, 100, 50));
        assert_eq!(page.at(1), None);
        assert_eq!(page.at(2), at(7, 10, 20));
        assert_eq!(page.at(3), None);
        assert_eq!(page.at(4), at(9, 0, 100));
        assert_eq!(parse_any_page(BlobKind::Located, &p, &l).unwrap(), e);
        // The same entries and places make the same bytes.
        let again: Vec<Option<BlobAt>> = (0..5).map(|i| page.at(i)).collect();
        assert_eq!(encode_located_page(&e, &again), p);
        // No places at all: no packs.
        let bare = encode_located_page(&e, &[]);
        assert_eq!(bare.len(), 2 + 5 * LOCATED_ENTRY_LEN);
        assert!(parse_located_page(&bare, &l).unwrap().hints.iter().all(Hint::is_none));
        assert!(p.len() <= l.max_plain(BlobKind::Located));
    }

    #[test]
    fn located_pages_that_break_a_rule_are_refused() {
        let l = Limits { chunk_size: 65536, page_entries: 16 };
        let e = [[1u8; 32], [2; 32]];
        let good = encode_located_page(&e, &[at(9, 0, 10), at(7, 10, 20)]);
        let bad = |edit: &dyn Fn(&mut Vec<u8>), why: &str| {
            let mut p = good.clone();
            edit(&mut p);
            let e = parse_located_page(&p, &l).unwrap_err().0;
            assert!(e.contains(why), "{why}: {e}");
        };
        let entry = 2 + 2 * 32;
        let hint_at = |k: usize| entry + k * LOCATED_ENTRY_LEN + 32;
        bad(&|p| p.truncate(p.len() - 1), "does not fit");
        bad(&|p| p.push(0), "does not fit");
        bad(&|p| p[0] = 3, "does not fit");
        bad(&|p| p[2..34].copy_from_slice(&[7; 32]), "twice");
        // The second entry names pack 0 too: pack 1 is unused.
        bad(&|p| p[hint_at(1)..hint_at(1) + 2].copy_from_slice(&0u16.to_le_bytes()), "use 1");
        // The first entry names pack 1 before pack 0 is used.
        bad(&|p| p[hint_at(0)..hint_at(0) + 2].copy_from_slice(&1u16.to_le_bytes()), "order of first use");
        bad(&|p| p[hint_at(0)..hint_at(0) + 2].copy_from_slice(&2u16.to_le_bytes()), "order of first use");
        bad(&|p| p[hint_at(0) + 6..hint_at(0) + 10].copy_from_slice(&0u32.to_le_bytes()), "from 1 to");
        bad(&|p| p[hint_at(0) + 6..hint_at(0) + 10].copy_from_slice(&(65536u32 + 30).to_le_bytes()), "from 1 to");
        bad(&|p| p[hint_at(0) + 2..hint_at(0) + 6].copy_from_slice(&u32::MAX.to_le_bytes()), "from 1 to");
        // A zero chunk with a hint; no hint but a length.
        bad(&|p| p[entry..entry + 32].fill(0), "zero chunk");
        let none = encode_located_page(&e, &[at(9, 0, 10), None]);
        let mut p = none.clone();
        let h = 2 + 32 + LOCATED_ENTRY_LEN + 32 + 6;
        p[h..h + 4].copy_from_slice(&5u32.to_le_bytes());
        assert!(parse_located_page(&p, &l).unwrap_err().0.contains("no hint but"));
        // More entries than a page holds; more packs than entries.
        let long = encode_located_page(&[[1u8; 32]; 17], &[]);
        assert!(parse_located_page(&long, &l).is_err());
        let mut p = encode_located_page(&[[1u8; 32]], &[]);
        p[0] = 2;
        p.splice(2..2, [[5u8; 32], [6u8; 32]].concat());
        assert!(parse_located_page(&p, &l).unwrap_err().0.contains("2 packs for 1 entries"));
        assert!(parse_located_page(&[], &l).is_err());
    }

    /// A version 2 manifest of `manifest()`'s pages, with hints.
    fn located_manifest() -> Manifest {
        let mut m = manifest();
        m.version = LOCATED_VERSION;
        let places = [at(1, 0, 300), None, None, at(2, 77, 400)];
        let (packs, pages) = hinted_pages(m.pages.iter().zip(places));
        m.pages = pages;
        m.page_packs = packs;
        m.migrated_from = Some("ab".repeat(32));
        m
    }

    #[test]
    fn located_manifests_round_trip_with_their_hints() {
        let m = located_manifest();
        m.validate(&Limits::DEFAULT).unwrap();
        let json = m.to_bytes();
        let text = String::from_utf8(json.clone()).unwrap();
        assert!(text.contains(&format!("\"{} 0 0 300\"", hex(&[0xab; 32]))), "{text}");
        assert!(text.contains(&format!("\"{} 1 77 400\"", hex(&[0xef; 32]))), "{text}");
        assert!(text.contains(&format!("\"{}\"", hex(&[0xcd; 32]))), "{text}");
        let back = Manifest::parse(&json, &Limits::DEFAULT).unwrap();
        assert_eq!(back, m);
        let hinted: Vec<(Digest, Hint)> = back.pages.iter_hinted().collect();
        assert_eq!(hinted[0].1, Hint { pack: 0, offset: 0, stored_len: 300 });
        assert!(hinted[1].1.is_none() && hinted[2].1.is_none());
        assert_eq!(hinted[3].1, Hint { pack: 1, offset: 77, stored_len: 400 });
        let (summary, pages) = back.split();
        assert_eq!(pages.packs(), &[[1u8; 32], [2u8; 32]]);
        assert_eq!(summary.page_packs, PackCount(2));
        assert_eq!(Manifest::parse_summary(&json, &Limits::DEFAULT).unwrap(), summary);
        // A version 1 manifest has no hints.
        assert_eq!(String::from_utf8(manifest().to_bytes()).unwrap().matches("page_packs").count(), 0);
    }

    #[test]
    fn located_manifests_that_break_a_rule_are_refused() {
        let l = Limits::DEFAULT;
        let refused = |m: &Manifest, why: &str| {
            let json = m.to_bytes();
            let e = Manifest::parse(&json, &l).unwrap_err().0;
            assert!(e.contains(why), "{why}: {e}");
            assert!(Manifest::parse_summary(&json, &l).is_err());
        };
        let mut m = located_manifest();
        m.version = 1;
        refused(&m, "version 1 but");
        let mut m = located_manifest();
        m.page_packs.0.pop();
        refused(&m, "names page pack 1");
        let mut m = located_manifest();
        m.page_packs.0.extend([[3u8; 32], [4; 32], [5; 32]]);
        refused(&m, "5 page packs for 4 pages");
        let mut m = located_manifest();
        m.migrated_from = Some("xyz".into());
        refused(&m, "migrated_from");
        let mut m = located_manifest();
        m.version = 3;
        refused(&m, "versions 1 and 2 only");
        // Hints that are not canonical, or out of bounds, are no page at all.
        let text = String::from_utf8(located_manifest().to_bytes()).unwrap();
        let d = hex(&[0xab; 32]);
        for bad in ["0 00 300", "0 0 0", "0 +1 300", "65535 0 300", "0 0 300 1", "0 0", "0 4294967295 300"] {
            let json = text.replace(&format!("{d} 0 0 300"), &format!("{d} {bad}"));
            assert!(Manifest::parse(json.as_bytes(), &l).is_err(), "{bad}");
        }
        let json = text.replace(&format!("{d} 0 0 300"), &format!("{d} 0 0 {}", 32 * 256 * 3));
        assert!(Manifest::parse(json.as_bytes(), &l).unwrap_err().0.contains("spans"));
    }

    fn manifest() -> Manifest {
        // 3 full pages and one chunk more: 4 pages.
        let size = 3 * 256 * 65536 + 1000;
        Manifest {
            version: 1,
            name: "vm1-sda".into(),
            time: "2026-11-26T22:00:00Z".into(),
            size,
            chunk_size: 65536,
            page_entries: 256,
            page_packs: PackIds::default(),
            pages: [[0xab; 32], ZERO, [0xcd; 32], [0xef; 32]].into_iter().collect(),
            parent: Some("12".repeat(32)),
            migrated_from: None,
            source: "nbd+unix:///?socket=/tmp/s".into(),
            changes: Changes::DirtyBitmap { bitmap: "b0".into() },
            blkhash: Some("34".repeat(32)),
            stats: SnapshotStats { read: 1, written_chunks: 2, new_chunks: 3, new_stored: 4, zero_chunks: 5 },
            host: "h".into(),
            ferry: "0.1.0".into(),
            copied_from: None,
            tags: Vec::new(),
            note: String::new(),
        }
    }

    fn checkpoint() -> Checkpoint {
        let m = manifest();
        Checkpoint {
            version: 1,
            name: m.name,
            time: m.time,
            size: m.size,
            chunk_size: 65536,
            page_entries: 256,
            base: m.parent,
            source: m.source,
            identity: "file /tmp/d 1000 1234567".into(),
            changes: Changes::Full,
            pages: m.pages,
            done: vec![[0, 10], [11, 5], [768, 1]],
        }
    }

    #[test]
    fn checkpoints_round_trip_and_are_checked() {
        let c = checkpoint();
        assert_eq!(Checkpoint::parse(&c.to_bytes(), &L).unwrap(), c);
        assert_eq!(c.done_bytes(), 15 * 65536 + 1000);
        let bad = |f: &dyn Fn(&mut Checkpoint), want: &str| {
            let mut c = checkpoint();
            f(&mut c);
            let e = Checkpoint::parse(&c.to_bytes(), &L).unwrap_err().0;
            assert!(e.contains(want), "{e}");
        };
        bad(&|c| c.done = vec![[0, 10], [10, 1]], "not after the one before");
        bad(&|c| c.done = vec![[5, 1], [0, 1]], "not after the one before");
        bad(&|c| c.done = vec![[0, 0]], "is empty");
        bad(&|c| c.done = vec![[768, 2]], "past the disk");
        bad(&|c| c.done = vec![[u64::MAX, 2]], "past the disk");
        bad(&|c| c.pages = c.pages.iter().take(3).collect(), "checkpoint has 3 pages");
        bad(&|c| c.base = Some("x".into()), "parent");
        bad(&|c| c.version = 2, "version");
        bad(&|c| c.identity = "x".repeat(5000), "identity");
        assert!(Checkpoint::parse(b"{}", &L).is_err());
    }

    #[test]
    fn tags_and_notes_are_optional_and_bounded() {
        let mut m = manifest();
        let plain = m.to_bytes();
        assert!(!String::from_utf8_lossy(&plain).contains("\"tags\""), "absent when empty");
        m.tags = vec!["daily".into(), "db:pg".into()];
        m.note = "before the upgrade".into();
        assert_eq!(Manifest::parse(&m.to_bytes(), &L).unwrap(), m);
        for (tags, note) in [
            (vec!["a,b".to_string()], ""),
            (vec![String::new()], ""),
            (vec!["x".repeat(65)], ""),
            (vec!["t".to_string(); MAX_TAGS + 1], ""),
            (vec![], "two\nlines"),
            (vec![], "\u{1b}]0;title\u{7}"),
        ] {
            let bad = Manifest { tags, note: note.into(), ..manifest() };
            assert!(Manifest::parse(&bad.to_bytes(), &L).is_err(), "{:?} {:?}", bad.tags, bad.note);
        }
        let long = Manifest { note: "n".repeat(MAX_NOTE + 1), ..manifest() };
        assert!(Manifest::parse(&long.to_bytes(), &L).is_err());
    }

    /// A manifest's JSON with `pages` replaced by `pages`.
    fn with_pages(m: &Manifest, pages: &str) -> Vec<u8> {
        let j = String::from_utf8(m.to_bytes()).unwrap();
        let (start, end) = (j.find("\"pages\":").unwrap() + 8, j.find(",\"parent\"").unwrap());
        format!("{}{pages}{}", &j[..start], &j[end..]).into_bytes()
    }

    #[test]
    fn page_digests_are_checked_as_they_are_parsed() {
        let m = manifest();
        let (ab, ef) = ("ab".repeat(32), "ef".repeat(32));
        let ok = with_pages(&m, &format!(r#"["{ab}","","{}","{ef}"]"#, "cd".repeat(32)));
        assert_eq!(Manifest::parse(&ok, &L).unwrap(), m);
        for (pages, want) in [
            (format!(r#"["{}","","{ab}","{ef}"]"#, "AB".repeat(32)), "page 0's digest"),
            (format!(r#"["{ab}","","0","{ef}"]"#), "page 2's digest"),
            (format!(r#"["{ab}"," ","{ab}","{ef}"]"#), "page 1's digest"),
            (format!(r#"["{ab}","",7,"{ef}"]"#), "page digest"),
            (format!(r#"["{ab}","",null,"{ef}"]"#), "page digest"),
            (format!(r#"{{"a":"{ab}"}}"#), "list of page digests"),
            // An unclosed list takes the next key for a page.
            (format!(r#"["{ab}","","{ab}""#), "page 3's digest"),
        ] {
            let e = Manifest::parse(&with_pages(&m, &pages), &L).unwrap_err().0;
            assert!(e.contains(want), "{pages}: {e}");
            let e = Manifest::parse_summary(&with_pages(&m, &pages), &L).unwrap_err().0;
            assert!(e.contains(want), "{pages}: {e}");
        }
        // Escaped hex is hex.
        let escaped = with_pages(&m, &format!(r#"["\u0061b{}","","{}","{ef}"]"#, "ab".repeat(31), "cd".repeat(32)));
        assert_eq!(Manifest::parse(&escaped, &L).unwrap(), m);
        // A summary keeps the count only, and is the manifest's.
        let s = Manifest::parse_summary(&m.to_bytes(), &L).unwrap();
        assert_eq!(s.pages, PageCount(4, HintBounds::default()));
        assert_eq!(m.clone().split(), (s, m.pages.clone()));
        assert_eq!(m.pages.nonzero(), [[0xab; 32], [0xcd; 32], [0xef; 32]]);
        assert_eq!(m.page_digests(), [[0xab; 32], ZERO, [0xcd; 32], [0xef; 32]]);
    }

    /// What manifests and checkpoints were written as when their pages were hex strings:
    /// the same bytes are written now.
    #[derive(Serialize)]
    struct HexManifest {
        version: u32,
        name: String,
        time: String,
        size: u64,
        chunk_size: u32,
        page_entries: u32,
        pages: Vec<String>,
        parent: Option<String>,
        source: String,
        changes: Changes,
        blkhash: Option<String>,
        stats: SnapshotStats,
        host: String,
        ferry: String,
    }

    #[test]
    fn manifests_are_written_as_before() {
        let m = manifest();
        let hex_pages = |p: &Pages| p.iter().map(|d| if d == ZERO { String::new() } else { hex(&d) }).collect();
        let old = HexManifest {
            version: m.version,
            name: m.name.clone(),
            time: m.time.clone(),
            size: m.size,
            chunk_size: m.chunk_size,
            page_entries: m.page_entries,
            pages: hex_pages(&m.pages),
            parent: m.parent.clone(),
            source: m.source.clone(),
            changes: m.changes.clone(),
            blkhash: m.blkhash.clone(),
            stats: m.stats.clone(),
            host: m.host.clone(),
            ferry: m.ferry.clone(),
        };
        assert_eq!(String::from_utf8(m.to_bytes()).unwrap(), serde_json::to_string(&old).unwrap());
        // More than 64 pages (the bits of a second word), and a checkpoint's.
        let mut big = manifest();
        big.size = 130 * 256 * 65536 - 5;
        big.pages = (0..130u8).map(|i| if i % 3 == 0 { ZERO } else { [i; 32] }).collect();
        let j = big.to_bytes();
        assert_eq!(Manifest::parse(&j, &L).unwrap(), big);
        let v: serde_json::Value = serde_json::from_slice(&j).unwrap();
        let want: Vec<String> = hex_pages(&big.pages);
        assert_eq!(v["pages"], serde_json::json!(want));
        assert_eq!((v["pages"][0].as_str(), v["pages"][64].as_str()), (Some(""), Some(hex(&[64; 32]).as_str())));
        let c = checkpoint();
        let v: serde_json::Value = serde_json::from_slice(&c.to_bytes()).unwrap();
        assert_eq!(v["pages"], serde_json::json!(hex_pages(&c.pages)));
    }

    /// The largest manifest a crafter can make (2^24 all-zero pages, 48 MiB of JSON) is
    /// parsed with its pages held as bits; one page more is refused as it is parsed.
    #[test]
    fn a_maximal_manifest_is_held_compactly() {
        let mut m = manifest();
        m.size = MAX_PAGES * 256 * 65536;
        m.pages = Pages::default();
        let json = with_pages(&m, &format!("[{}\"\"]", "\"\",".repeat(MAX_PAGES as usize - 1)));
        assert!(json.len() > 48 << 20 && json.len() as u64 <= MAX_MANIFEST, "{}", json.len());
        let p = Manifest::parse(&json, &L).unwrap().pages;
        assert_eq!((p.count(), p.nonzero().len()), (MAX_PAGES, 0));
        assert!(p.heap_bytes() <= (MAX_PAGES / 8 + 64) as usize, "{} bytes", p.heap_bytes());
        assert_eq!(Manifest::parse_summary(&json, &L).unwrap().pages, PageCount(MAX_PAGES, HintBounds::default()));
        let more = with_pages(&m, &format!("[{}\"\"]", "\"\",".repeat(MAX_PAGES as usize)));
        let e = Manifest::parse_summary(&more, &L).unwrap_err().0;
        assert!(e.contains("more than 16777216 pages"), "{e}");
        // Digests take their 32 bytes, no more.
        let mut d = manifest();
        d.size = 1000 * 256 * 65536;
        d.pages = (0..1000u32).map(sha256_of).collect();
        let p = Manifest::parse(&d.to_bytes(), &L).unwrap().pages;
        assert!(p.heap_bytes() <= 1000 * 32 + 16 * 8 + 32 * 1000, "{} bytes", p.heap_bytes());
    }

    fn sha256_of(i: u32) -> Digest {
        use sha2::Digest as _;
        sha2::Sha256::digest(i.to_le_bytes()).into()
    }

    #[test]
    fn manifests_round_trip_and_are_checked() {
        let m = manifest();
        let j = m.to_bytes();
        assert_eq!(Manifest::parse(&j, &L).unwrap(), m);
        assert_eq!(m.chunks(), 3 * 256 + 1);
        let d = m.page_digests();
        assert_eq!((d[0], d[1], d[3]), ([0xab; 32], ZERO, [0xef; 32]));
        let v: serde_json::Value = serde_json::from_slice(&j).unwrap();
        assert_eq!(v["changes"], serde_json::json!({"kind": "dirty-bitmap", "bitmap": "b0"}));

        let bad = |f: &dyn Fn(&mut Manifest), what: &str| {
            let mut m = manifest();
            f(&mut m);
            let e = Manifest::parse(&m.to_bytes(), &L).unwrap_err();
            assert!(e.0.contains(what), "{what}: {e}");
        };
        bad(&|m| m.version = 3, "version");
        bad(&|m| m.name = String::new(), "disk name");
        bad(&|m| m.name = ".hidden".into(), "disk name");
        bad(&|m| m.name = "a/b".into(), "disk name");
        bad(&|m| m.time = "now".into(), "time");
        bad(&|m| m.pages.push(ZERO), "has 5 pages");
        bad(&|m| m.pages = m.pages.iter().take(3).collect(), "has 3 pages");
        bad(&|m| m.size = 3 * 256 * 65536, "has 4 pages");
        bad(&|m| m.size = (1 << 63) + 1, "2^63");
        bad(&|m| m.chunk_size = 4096, "chunk_size 4096");
        bad(&|m| m.page_entries = 512, "page_entries 512");
        bad(&|m| m.parent = Some("x".into()), "parent");
        bad(&|m| m.blkhash = Some("x".into()), "blkhash");
        let from = |repository: &str, snapshot: &str, time: &str| {
            Some(CopiedFrom { repository: repository.into(), snapshot: snapshot.into(), time: time.into() })
        };
        bad(&|m| m.copied_from = from("x", &"ab".repeat(32), "2026-11-26T22:00:00Z"), "copied_from");
        bad(&|m| m.copied_from = from(&"ab".repeat(32), &"AB".repeat(32), "2026-11-26T22:00:00Z"), "copied_from");
        bad(&|m| m.copied_from = from(&"ab".repeat(32), &"cd".repeat(32), "yesterday"), "copied_from's time");
        // A copy says where it came from; a backup's manifest has no such field at all.
        let mut copy = manifest();
        copy.copied_from = from(&"ab".repeat(32), &"cd".repeat(32), "2026-11-26T22:00:00.5Z");
        assert_eq!(Manifest::parse(&copy.to_bytes(), &L).unwrap(), copy);
        let v: serde_json::Value = serde_json::from_slice(&copy.to_bytes()).unwrap();
        assert_eq!(v["copied_from"]["snapshot"], "cd".repeat(32));
        assert!(!String::from_utf8(m.to_bytes()).unwrap().contains("copied_from"));

        // The largest disk: 2^63 bytes, exactly 2^24 pages of 256 entries of 2 MiB chunks
        // would be too many at 64 KiB: refused by count, not by allocating.
        let mut huge = manifest();
        huge.size = 1 << 63;
        let e = Manifest::parse(&huge.to_bytes(), &L).unwrap_err();
        assert!(e.0.contains("index pages"), "{e}");
        // An empty disk has no pages; optional fields may be missing.
        let mut empty = manifest();
        (empty.size, empty.pages, empty.parent, empty.blkhash) = (0, Pages::default(), None, None);
        assert_eq!(Manifest::parse(&empty.to_bytes(), &L).unwrap(), empty);
        let mut v: serde_json::Value = serde_json::from_slice(&empty.to_bytes()).unwrap();
        for k in ["blkhash", "stats", "host", "ferry"] {
            v.as_object_mut().unwrap().remove(k);
        }
        let back = Manifest::parse(v.to_string().as_bytes(), &L).unwrap();
        assert_eq!((back.blkhash, back.stats), (None, SnapshotStats::default()));
        assert!(Manifest::parse(b"{", &L).is_err());
    }

    #[test]
    fn disk_names() {
        for ok in ["a", "vm1-sda", "A.b_c-d", "0", &"x".repeat(200)] {
            assert!(valid_name(ok), "{ok:?}");
        }
        for bad in ["", ".a", "-a", "a/b", "a b", "é", "a\0", &"x".repeat(201), "a:b", "a@b"] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn locks() {
        let l = Lock {
            kind: LockKind::Backup,
            disk: Some("aa".repeat(32)),
            host: "h".into(),
            pid: 7,
            time: "2026-11-26T22:00:00Z".into(),
            refreshed: "2026-11-26T22:05:00Z".into(),
            boot: Some("b pid:[1]".into()),
            pid_start: Some(123456),
            condemned: true,
            shared: false,
        };
        assert_eq!(Lock::parse(&l.to_bytes()).unwrap(), l);
        assert!(String::from_utf8(l.to_bytes()).unwrap().contains(r#""condemned":true"#));
        // Without the field (an older ferry's lock): false, and not written when false.
        let older = Lock { condemned: false, ..l.clone() };
        assert!(!String::from_utf8(older.to_bytes()).unwrap().contains("condemned"));
        // A lock of an older ferry (no start time) reads; one of a later ferry with
        // fields this one does not know reads too.
        let old = br#"{"kind":"gc","host":"h","pid":7,"time":"2026-11-26T22:00:00Z","refreshed":"2026-11-26T22:00:00Z","boot":"b pid:[1]"}"#;
        assert_eq!(Lock::parse(old).unwrap().pid_start, None);
        assert!(!Lock::parse(old).unwrap().condemned);
        let later = br#"{"kind":"gc","host":"h","pid":7,"time":"2026-11-26T22:00:00Z","refreshed":"2026-11-26T22:00:00Z","pid_start":5,"more":1}"#;
        assert_eq!(Lock::parse(later).unwrap().pid_start, Some(5));
        let gc = Lock { kind: LockKind::Gc, disk: None, ..l.clone() };
        assert_eq!(Lock::parse(&gc.to_bytes()).unwrap(), gc);
        assert!(String::from_utf8(gc.to_bytes()).unwrap().contains("\"kind\":\"gc\""));
        assert!(Lock::parse(&Lock { disk: None, ..l.clone() }.to_bytes()).is_err());
        assert!(Lock::parse(&Lock { disk: Some("vm1".into()), ..l.clone() }.to_bytes()).is_err());
        assert!(Lock::parse(&Lock { kind: LockKind::Forget, ..l.clone() }.to_bytes()).is_err());
        // A shared lock is a forget lock; an older ferry reads it as a plain one.
        let shared = Lock { kind: LockKind::Forget, disk: None, shared: true, ..l.clone() };
        assert_eq!(Lock::parse(&shared.to_bytes()).unwrap(), shared);
        assert_eq!(shared.what(), "read");
        let mut as_older = serde_json::to_value(&shared).unwrap();
        as_older.as_object_mut().unwrap().remove("shared");
        assert_eq!(Lock::parse(&serde_json::to_vec(&as_older).unwrap()).unwrap().what(), "forget");
        assert!(!String::from_utf8(older.to_bytes()).unwrap().contains("shared"));
        assert!(Lock::parse(&Lock { shared: true, ..gc.clone() }.to_bytes()).is_err());
        assert!(Lock::parse(&Lock { refreshed: "soon".into(), ..l.clone() }.to_bytes()).is_err());
        let mut big = l.to_bytes();
        big.splice(1..1, std::iter::repeat_n(b' ', MAX_LOCK as usize));
        assert!(Lock::parse(&big).unwrap_err().0.contains("at most 4096"));
    }

    #[test]
    fn hex_and_digests() {
        assert_eq!(hex(&[0, 0xff, 0x1a]), "00ff1a");
        let d: Digest = std::array::from_fn(|i| i as u8 * 7);
        assert_eq!(parse_digest(&hex(&d)), Some(d));
        assert_eq!(parse_digest(&hex(&d).to_uppercase()), None);
        assert_eq!(parse_digest(&hex(&d[..31])), None);
        assert_eq!(parse_digest(&format!("{}0", hex(&d))), None);
        assert_eq!(parse_digest(&"g".repeat(64)), None);
        assert_eq!(parse_digest(""), None);
        assert_eq!(parse_hex("0a1"), None);
        assert_eq!(parse_hex("0aff"), Some(vec![10, 255]));
    }

    /// The fuzz target's seeds (fuzz/seeds/repo_format) are valid objects, so the fuzzer
    /// starts past every parser's first checks.
    #[test]
    fn fuzz_seeds_are_valid_objects() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/repo_format");
        let seed = |name: &str| std::fs::read(dir.join(name)).unwrap();
        let c = Config::parse(&seed("config.json")).unwrap();
        assert!(c.encryption.is_none());
        assert!(Config::parse(&seed("config-encrypted.json")).unwrap().encryption.is_some());
        assert_eq!(Config::parse(&seed("config-v2-encrypted.json")).unwrap().version, 2);
        KeyObject::parse(&seed("key.json")).unwrap();
        Manifest::parse(&seed("manifest.json"), &L).unwrap();
        Lock::parse(&seed("lock.json")).unwrap();
        Checkpoint::parse(&seed("checkpoint.json"), &L).unwrap();
        assert_eq!(DamageRecord::parse(&seed("damage.json")).unwrap().packs.len(), 2);
        assert_eq!(CondemnedRecord::parse(&seed("condemned.json")).unwrap().backups.len(), 1);
        let t = seed("trailer.bin");
        assert_eq!(parse_trailer(&t[5..], le32(&t, 1) as u64, &L).unwrap().len(), 3);
        assert_eq!(parse_index(&seed("index.bin"), &L).unwrap().len(), 2);
        let p = seed("pack-tail.bin");
        let n = parse_pack_tail(&p[p.len() - PACK_TAIL..], p.len() as u64).unwrap() as usize;
        let trailer = &p[p.len() - PACK_TAIL - n..p.len() - PACK_TAIL];
        assert_eq!(parse_trailer(trailer, (p.len() - PACK_TAIL - n) as u64, &L).unwrap().len(), 3);
        assert_eq!(parse_page(&seed("page.bin"), 3).unwrap().len(), 3);
        let l = parse_located_page(&seed("located-page.bin"), &L).unwrap();
        assert_eq!((l.packs.len(), l.entries.len()), (2, 4));
        let m = Manifest::parse(&seed("manifest-located.json"), &L).unwrap();
        assert_eq!((m.version, m.page_packs.0.len(), m.pages.hint_bounds().hinted), (LOCATED_VERSION, 2, 2));
        for name in ["blob-raw.bin", "blob-zstd.bin"] {
            let b = seed(name);
            let plain = crate::blob::decode(&crate::crypto::Crypto::None, BlobKind::Data, &[0; 32], &b, 65536);
            assert!(plain.unwrap_err().contains("do not match its id"), "{name}");
        }
    }

    #[test]
    fn fuzz_entry_point_takes_valid_objects_and_their_damage() {
        let mut seeds = vec![
            config().to_bytes(),
            manifest().to_bytes(),
            checkpoint().to_bytes(),
            encode_index(&[PackBlobs { pack: [1; 32], blobs: entries() }]),
            [&[0u8, 151, 0, 0, 0][..], &encode_trailer(&entries())].concat(),
            pack_tail(10).to_vec(),
            encode_page(&[[5; 32]; 4]),
            hex(&[7; 32]).into_bytes(),
            located_manifest().to_bytes(),
            encode_located_page(&[[1; 32], ZERO, [3; 32]], &[at(9, 100, 50), None, at(7, 0, 10)]),
        ];
        seeds.push(Config { encryption: Some(encryption()), ..config() }.to_bytes());
        seeds.push(Config { encryption: Some(encryption()), version: 2, ..config() }.to_bytes());
        let e = encryption();
        seeds.push(
            KeyObject { created: "2026-11-28T09:00:00Z".into(), host: "h".into(), kdf: e.kdf, key: e.key }.to_bytes(),
        );
        for s in &seeds {
            for n in 0..s.len().min(300) {
                fuzz(&s[..n]);
                let mut b = s.clone();
                b[n] ^= 0x55;
                fuzz(&b);
            }
            fuzz(s);
        }
    }
}
