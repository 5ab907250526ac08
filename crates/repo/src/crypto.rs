//! The repository key and what it does (FORMAT.md §3, §4): Argon2id wrapping of the
//! master key, AES-256-GCM of objects, HMAC-SHA256 chunk ids. An unencrypted repository
//! has [`Crypto::None`]: ids are digests and sealing is the identity.
use crate::format::{Digest, Encryption, KdfCost};

/// The default KDF cost: 64 MiB, 3 passes, 4 lanes (RFC 9106's second recommendation).
pub const DEFAULT_KDF: KdfCost = KdfCost { m_kib: 65536, t: 3, p: 4 };

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CryptoError {
    /// The key did not open: a wrong passphrase or a damaged config.
    #[error("the passphrase does not open this repository's key (wrong passphrase, or a damaged config)")]
    WrongPassphrase,
    /// An object failed authentication or is too short to be sealed.
    #[error("{0}")]
    Damaged(String),
    /// The config's encryption parameters are not allowed (unknown cipher or KDF, cost out of range).
    #[error("{0}")]
    Invalid(String),
}

/// What a repository's objects are sealed with.
pub enum Crypto {
    None,
    Aes(Box<Keys>),
}

/// The unwrapped master key. Zeroed when dropped.
pub struct Keys {
    pub(crate) enc: [u8; 32],
    pub(crate) id: [u8; 32],
}

impl Crypto {
    pub fn is_encrypted(&self) -> bool {
        matches!(self, Crypto::Aes(_))
    }

    /// A blob's id from its digest: the digest itself, or HMAC-SHA256(id_key, digest).
    pub fn blob_id(&self, digest: &Digest) -> Digest {
        let _ = digest;
        todo!()
    }

    /// Appends the stored form of `plain` to `out`: `plain` itself unencrypted, else
    /// nonce || AES-256-GCM(plain, aad) || tag.
    pub fn seal_into(&self, aad: &[u8], plain: &[u8], out: &mut Vec<u8>) {
        let _ = (aad, plain, out);
        todo!()
    }

    pub fn seal(&self, aad: &[u8], plain: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        self.seal_into(aad, plain, &mut v);
        v
    }

    /// The plain form of a stored object (a copy, unencrypted).
    pub fn open(&self, aad: &[u8], stored: &[u8]) -> Result<Vec<u8>, CryptoError> {
        let _ = (aad, stored);
        todo!()
    }

    /// The lock tag of a disk name (FORMAT.md §8).
    pub fn disk_tag(&self, name: &str) -> String {
        let _ = name;
        todo!()
    }
}

/// Makes a new master key wrapped by `passphrase` for a repository of these parameters.
pub fn new_key(
    passphrase: &[u8],
    cost: KdfCost,
    repo_id: &str,
    chunk_size: u32,
    page_entries: u32,
) -> Result<(Encryption, Crypto), CryptoError> {
    let _ = (passphrase, cost, repo_id, chunk_size, page_entries);
    todo!()
}

/// Opens the key of a config's `encryption` with `passphrase`. KDF costs are checked
/// against FORMAT.md's limits before the KDF runs.
pub fn unlock(
    enc: &Encryption,
    passphrase: &[u8],
    repo_id: &str,
    chunk_size: u32,
    page_entries: u32,
) -> Result<Crypto, CryptoError> {
    let _ = (enc, passphrase, repo_id, chunk_size, page_entries);
    todo!()
}

/// Re-wraps the same master key under a new passphrase (a new salt).
pub fn rewrap(
    crypto: &Crypto,
    passphrase: &[u8],
    cost: KdfCost,
    repo_id: &str,
    chunk_size: u32,
    page_entries: u32,
) -> Result<Encryption, CryptoError> {
    let _ = (crypto, passphrase, cost, repo_id, chunk_size, page_entries);
    todo!()
}

/// `N` bytes from the operating system's random source.
pub fn random<const N: usize>() -> [u8; N] {
    todo!()
}
