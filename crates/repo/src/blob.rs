//! One chunk or page as stored in a pack (FORMAT.md §4): zstd or raw, then sealed.
use crate::crypto::Crypto;
use crate::format::{BlobKind, Digest};

/// SHA-256 of a blob's plain bytes.
pub fn digest(plain: &[u8]) -> Digest {
    let _ = plain;
    todo!()
}

/// The additional data of a blob's AEAD: "ferry blob " || kind || id.
pub fn aad(kind: BlobKind, id: &Digest) -> Vec<u8> {
    let mut a = b"ferry blob ".to_vec();
    a.push(kind as u8);
    a.extend_from_slice(id);
    a
}

/// Appends the stored form of `plain` (a blob of `kind` with id `id`) to `out`, and
/// returns its length. `level` is the zstd level.
pub fn encode_into(crypto: &Crypto, kind: BlobKind, id: &Digest, plain: &[u8], level: i32, out: &mut Vec<u8>) -> usize {
    let _ = (crypto, kind, id, plain, level, out);
    todo!()
}

/// A stored blob back to its plain bytes, checked against its id (`crypto.blob_id` of
/// the plain bytes' digest must be `id`): at most `max_plain` bytes are ever allocated
/// for the plain bytes. The error says what failed (authentication, decompression,
/// length, digest).
pub fn decode(
    crypto: &Crypto,
    kind: BlobKind,
    id: &Digest,
    stored: &[u8],
    max_plain: usize,
) -> Result<Vec<u8>, String> {
    let _ = (crypto, kind, id, stored, max_plain);
    todo!()
}
