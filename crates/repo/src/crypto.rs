//! The repository key and what it does (FORMAT.md §3, §4): Argon2id wrapping of the
//! master key, AES-256-GCM of objects, HMAC-SHA256 chunk ids. An unencrypted repository
//! has [`Crypto::None`]: ids are digests and sealing is the identity.
use crate::format::{self, hex, parse_hex, Digest, Encryption, Kdf, KdfCost, Limits};
use aes_gcm::aead::{AeadInOut, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce, Tag};
use hmac::{Hmac, Mac};
use zeroize::{ZeroizeOnDrop, Zeroizing};

const NONCE: usize = 12;
const TAG: usize = 16;

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

/// The unwrapped master key and the cipher keyed by it. Every part is zeroed when
/// dropped: the key halves are [`Zeroizing`], and aes-gcm's `zeroize` feature clears the
/// cipher's expanded key and GHASH key.
pub struct Keys {
    pub(crate) enc: Zeroizing<[u8; 32]>,
    pub(crate) id: Zeroizing<[u8; 32]>,
    cipher: Aes256Gcm,
}

/// Every field is [`ZeroizeOnDrop`] (checked by the tests).
impl ZeroizeOnDrop for Keys {}

impl Keys {
    fn from_master(master: &[u8; 64]) -> Keys {
        let mut enc = Zeroizing::new([0u8; 32]);
        let mut id = Zeroizing::new([0u8; 32]);
        enc.copy_from_slice(&master[..32]);
        id.copy_from_slice(&master[32..]);
        let cipher = aes_cipher(&enc);
        Keys { enc, id, cipher }
    }
    /// The master key again (`enc_key || id_key`), zeroed when dropped.
    fn master(&self) -> Zeroizing<[u8; 64]> {
        let mut master = Zeroizing::new([0u8; 64]);
        master[..32].copy_from_slice(&self.enc[..]);
        master[32..].copy_from_slice(&self.id[..]);
        master
    }
    fn cipher(&self) -> &Aes256Gcm {
        &self.cipher
    }
    fn hmac(&self, data: &[u8]) -> Digest {
        hmac_sha256(&self.id[..], data)
    }
}

/// AES-256-GCM keyed by `key` (expanded from the slice: no copy of the key is left).
fn aes_cipher(key: &[u8; 32]) -> Aes256Gcm {
    // A 32-byte slice is the key length: this cannot fail.
    Aes256Gcm::new_from_slice(key).unwrap_or_else(|_| unreachable!())
}

/// HMAC-SHA256. Its state (the key's inner and outer SHA-256 states) is zeroed when it is
/// dropped: sha2's `zeroize` feature.
fn hmac_sha256(key: &[u8], data: &[u8]) -> Digest {
    // HMAC takes a key of any length: this cannot fail.
    let mut m = <Hmac<sha2::Sha256> as hmac::KeyInit>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    m.update(data);
    m.finalize().into_bytes().into()
}

/// Seals `out[start..]` in place: `out[start..start + 12]` (room the caller left) gets a
/// fresh random nonce, `out[start + 12..]` (the plain text) is encrypted where it lies,
/// and the tag is appended.
fn seal_tail(cipher: &Aes256Gcm, aad: &[u8], out: &mut Vec<u8>, start: usize) {
    let nonce: [u8; NONCE] = random();
    out[start..start + NONCE].copy_from_slice(&nonce);
    let tag = cipher
        .encrypt_inout_detached(&Nonce::from(nonce), aad, (&mut out[start + NONCE..]).into())
        // Only a message over 64 GiB is refused.
        .unwrap_or_else(|_| unreachable!("AES-GCM refused a message of {} bytes", out.len() - start));
    out.extend_from_slice(&tag);
}

/// The plain text of `nonce || ciphertext || tag`, or why not.
fn open_with(cipher: &Aes256Gcm, aad: &[u8], stored: &[u8]) -> Result<Vec<u8>, ()> {
    if stored.len() < NONCE + TAG {
        return Err(());
    }
    let (nonce, rest) = stored.split_at(NONCE);
    let (ct, tag) = rest.split_at(rest.len() - TAG);
    let mut plain = ct.to_vec();
    let nonce: [u8; NONCE] = nonce.try_into().map_err(|_| ())?;
    let tag: [u8; TAG] = tag.try_into().map_err(|_| ())?;
    cipher
        .decrypt_inout_detached(&Nonce::from(nonce), aad, plain.as_mut_slice().into(), &Tag::from(tag))
        .map_err(|_| ())?;
    Ok(plain)
}

impl Crypto {
    pub fn is_encrypted(&self) -> bool {
        matches!(self, Crypto::Aes(_))
    }

    /// A blob's id from its digest: the digest itself, or HMAC-SHA256(id_key, digest).
    pub fn blob_id(&self, digest: &Digest) -> Digest {
        match self {
            Crypto::None => *digest,
            Crypto::Aes(k) => k.hmac(digest),
        }
    }

    /// Appends the stored form of `plain` to `out`: `plain` itself unencrypted, else
    /// nonce || AES-256-GCM(plain, aad) || tag.
    pub fn seal_into(&self, aad: &[u8], plain: &[u8], out: &mut Vec<u8>) {
        match self {
            Crypto::None => out.extend_from_slice(plain),
            Crypto::Aes(k) => {
                out.reserve(plain.len() + NONCE + TAG);
                let start = out.len();
                out.extend_from_slice(&[0; NONCE]);
                out.extend_from_slice(plain);
                seal_tail(k.cipher(), aad, out, start);
            }
        }
    }

    /// Bytes [`Crypto::seal_into`] adds to a plain text.
    pub fn overhead(&self) -> usize {
        match self {
            Crypto::None => 0,
            Crypto::Aes(_) => NONCE + TAG,
        }
    }

    /// Seals in place what a caller wrote at `out[start + self.overhead_before()..]`
    /// (after room for the nonce it left at `start`), appending the tag: so a blob's body
    /// is encoded straight into a pack's buffer and encrypted where it lies.
    pub(crate) fn seal_in_place(&self, aad: &[u8], out: &mut Vec<u8>, start: usize) {
        if let Crypto::Aes(k) = self {
            seal_tail(k.cipher(), aad, out, start);
        }
    }

    /// Bytes a sealed object has before its plain text's place (the nonce).
    pub(crate) fn overhead_before(&self) -> usize {
        match self {
            Crypto::None => 0,
            Crypto::Aes(_) => NONCE,
        }
    }

    pub fn seal(&self, aad: &[u8], plain: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        self.seal_into(aad, plain, &mut v);
        v
    }

    /// The plain form of a stored object (a copy, unencrypted).
    pub fn open(&self, aad: &[u8], stored: &[u8]) -> Result<Vec<u8>, CryptoError> {
        match self {
            Crypto::None => Ok(stored.to_vec()),
            Crypto::Aes(_) if stored.len() < NONCE + TAG => Err(CryptoError::Damaged(format!(
                "{} bytes are too few for an encrypted object (nonce and tag are {})",
                stored.len(),
                NONCE + TAG
            ))),
            Crypto::Aes(k) => open_with(k.cipher(), aad, stored).map_err(|()| {
                CryptoError::Damaged("its authentication failed (the bytes were changed or damaged)".into())
            }),
        }
    }

    /// A fingerprint of the master key, for this host's record of the repository
    /// (docs/safety.md): HMAC-SHA256 keyed by the whole master key (`enc_key || id_key`)
    /// of its own label, so it is no id, tag or key used anywhere else, and tells nothing
    /// of the key. It stays the same when the passphrase that wraps the key changes.
    /// `None` for an unencrypted repository.
    pub fn key_fingerprint(&self) -> Option<Digest> {
        match self {
            Crypto::None => None,
            Crypto::Aes(k) => Some(hmac_sha256(&k.master()[..], b"ferry key fingerprint 1")),
        }
    }

    /// The lock tag of a disk name (FORMAT.md §8).
    pub fn disk_tag(&self, name: &str) -> String {
        match self {
            Crypto::None => {
                let mut d = [0u8; 32];
                ferry_hash::Algorithm::Sha256.digest_into(name.as_bytes(), &mut d);
                hex(&d)
            }
            Crypto::Aes(k) => hex(&k.hmac(name.as_bytes())),
        }
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
    let master = Zeroizing::new(random::<64>());
    let enc = wrap(&master, passphrase, cost, repo_id, chunk_size, page_entries)?;
    Ok((enc, Crypto::Aes(Box::new(Keys::from_master(&master)))))
}

/// The additional data of the wrapped key (FORMAT.md §3).
fn key_aad(repo_id: &str, chunk_size: u32, page_entries: u32) -> Vec<u8> {
    format!("{} {} {repo_id} {chunk_size} {page_entries}", format::FORMAT_NAME, format::VERSION).into_bytes()
}

/// The key-encryption key: Argon2id (version 0x13) of the passphrase, after the cost is
/// checked against FORMAT.md's limits.
fn kek(passphrase: &[u8], salt: &[u8], cost: KdfCost) -> Result<Zeroizing<[u8; 32]>, CryptoError> {
    format::check_kdf_cost(&cost).map_err(|e| CryptoError::Invalid(e.0))?;
    let params = argon2::Params::new(cost.m_kib, cost.t, cost.p, Some(32))
        .map_err(|e| CryptoError::Invalid(format!("Argon2 parameters: {e}")))?;
    let a = argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
    let mut out = Zeroizing::new([0u8; 32]);
    a.hash_password_into(passphrase, salt, &mut out[..])
        .map_err(|e| CryptoError::Invalid(format!("Argon2 failed: {e} (is there {} KiB of memory?)", cost.m_kib)))?;
    Ok(out)
}

fn wrap(
    master: &[u8; 64],
    passphrase: &[u8],
    cost: KdfCost,
    repo_id: &str,
    chunk_size: u32,
    page_entries: u32,
) -> Result<Encryption, CryptoError> {
    format::check_limits(&Limits { chunk_size, page_entries }).map_err(|e| CryptoError::Invalid(e.0))?;
    let salt: [u8; 32] = random();
    let cipher = aes_cipher(&*kek(passphrase, &salt, cost)?);
    // Room for the tag too: the plain key is never left behind by a reallocation.
    let mut key = Zeroizing::new(Vec::with_capacity(NONCE + master.len() + TAG));
    key.extend_from_slice(&[0; NONCE]);
    key.extend_from_slice(master);
    seal_tail(&cipher, &key_aad(repo_id, chunk_size, page_entries), &mut key, 0);
    Ok(Encryption {
        cipher: format::CIPHER.into(),
        kdf: Kdf { name: format::KDF.into(), m_kib: cost.m_kib, t: cost.t, p: cost.p, salt: hex(&salt) },
        key: hex(&key),
    })
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
    enc.validate().map_err(|e| CryptoError::Invalid(e.0))?;
    let salt = parse_hex(&enc.kdf.salt).ok_or_else(|| CryptoError::Invalid("the KDF salt is not hex".into()))?;
    let wrapped = parse_hex(&enc.key).ok_or_else(|| CryptoError::Invalid("the wrapped key is not hex".into()))?;
    let cipher = aes_cipher(&*kek(passphrase, &salt, enc.kdf.cost())?);
    let master = Zeroizing::new(
        open_with(&cipher, &key_aad(repo_id, chunk_size, page_entries), &wrapped)
            .map_err(|()| CryptoError::WrongPassphrase)?,
    );
    let keys = match <&[u8; 64]>::try_from(master.as_slice()) {
        Ok(m) => Keys::from_master(m),
        Err(_) => return Err(CryptoError::Invalid(format!("the wrapped key holds {} bytes, not 64", master.len()))),
    };
    Ok(Crypto::Aes(Box::new(keys)))
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
    let Crypto::Aes(k) = crypto else {
        return Err(CryptoError::Invalid("the repository is not encrypted: it has no passphrase to change".into()));
    };
    wrap(&k.master(), passphrase, cost, repo_id, chunk_size, page_entries)
}

/// `N` bytes from the operating system's random source.
///
/// Panics when the operating system cannot give random bytes (no key, nonce or name
/// could be made safely without them).
pub fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    if let Err(e) = getrandom::fill(&mut b) {
        panic!("the operating system's random source failed: {e}");
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cheapest cost FORMAT.md allows, so that tests are quick.
    const CHEAP: KdfCost = KdfCost { m_kib: 8192, t: 1, p: 1 };
    const ID: &str = "repo-id";

    fn key() -> (Encryption, Crypto) {
        new_key(b"secret", CHEAP, ID, 65536, 256).unwrap()
    }

    /// Compiles only for types that zero their memory when dropped.
    fn zeroed_on_drop<T: ZeroizeOnDrop>() {}

    #[test]
    fn key_material_is_zeroed_on_drop() {
        // The master key's halves and the cipher's expanded keys (aes-gcm's `zeroize`).
        zeroed_on_drop::<Zeroizing<[u8; 32]>>();
        zeroed_on_drop::<Aes256Gcm>();
        zeroed_on_drop::<Keys>();
        // HMAC-SHA256's state is two SHA-256 states keyed by the id key (sha2's `zeroize`).
        zeroed_on_drop::<sha2::Sha256>();
        // The passphrase, from where ferry reads it to the KDF.
        zeroed_on_drop::<crate::Passphrase>();
    }

    #[test]
    fn hmac_sha256_is_rfc_4231() {
        // RFC 4231, test case 2.
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(hex(&mac), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }

    #[test]
    fn keys_unlock_with_their_passphrase_only() {
        let (enc, c) = key();
        assert_eq!((enc.cipher.as_str(), enc.kdf.name.as_str()), ("aes-256-gcm", "argon2id"));
        assert_eq!(enc.kdf.cost(), CHEAP);
        enc.validate().unwrap();
        let again = unlock(&enc, b"secret", ID, 65536, 256).unwrap();
        let d = [7u8; 32];
        assert_eq!(c.blob_id(&d), again.blob_id(&d));
        assert_ne!(c.blob_id(&d), d);
        let sealed = c.seal(b"aad", b"hello");
        assert_eq!(again.open(b"aad", &sealed).unwrap(), b"hello");

        assert_eq!(unlock(&enc, b"Secret", ID, 65536, 256).err(), Some(CryptoError::WrongPassphrase));
        // The parameters are the key's additional data: an edited config does not open.
        assert_eq!(unlock(&enc, b"secret", "other", 65536, 256).err(), Some(CryptoError::WrongPassphrase));
        assert_eq!(unlock(&enc, b"secret", ID, 4096, 256).err(), Some(CryptoError::WrongPassphrase));
        assert_eq!(unlock(&enc, b"secret", ID, 65536, 512).err(), Some(CryptoError::WrongPassphrase));
        // So are the KDF's parameters, through the key they derive.
        let mut t2 = enc.clone();
        t2.kdf.t = 2;
        assert_eq!(unlock(&t2, b"secret", ID, 65536, 256).err(), Some(CryptoError::WrongPassphrase));
        let mut salted = enc.clone();
        salted.kdf.salt = "00".repeat(32);
        assert_eq!(unlock(&salted, b"secret", ID, 65536, 256).err(), Some(CryptoError::WrongPassphrase));
        let mut flipped = enc.clone();
        flipped.key.replace_range(40..41, if &enc.key[40..41] == "0" { "1" } else { "0" });
        assert_eq!(unlock(&flipped, b"secret", ID, 65536, 256).err(), Some(CryptoError::WrongPassphrase));
    }

    #[test]
    fn kdf_costs_are_checked_before_the_kdf_runs() {
        let (enc, _) = key();
        // 4 TiB of memory would fail (or take forever) if the KDF ran: it is refused first.
        for (m_kib, t, p) in [(u32::MAX, 1, 1), (8191, 1, 1), (8192, 0, 1), (8192, 65, 1), (8192, 1, 0), (8192, 1, 65)]
        {
            let mut e = enc.clone();
            (e.kdf.m_kib, e.kdf.t, e.kdf.p) = (m_kib, t, p);
            let started = std::time::Instant::now();
            assert!(matches!(unlock(&e, b"secret", ID, 65536, 256), Err(CryptoError::Invalid(_))), "{m_kib} {t} {p}");
            assert!(started.elapsed().as_millis() < 100);
            let cost = KdfCost { m_kib, t, p };
            assert!(matches!(new_key(b"x", cost, ID, 65536, 256), Err(CryptoError::Invalid(_))));
        }
        let mut e = enc.clone();
        e.cipher = "aes-128-gcm".into();
        assert!(matches!(unlock(&e, b"secret", ID, 65536, 256), Err(CryptoError::Invalid(_))));
        assert!(matches!(new_key(b"x", CHEAP, ID, 1000, 256), Err(CryptoError::Invalid(_))));
    }

    #[test]
    fn rewrap_keeps_the_master_key() {
        let (enc, c) = key();
        let enc2 = rewrap(&c, b"new", CHEAP, ID, 65536, 256).unwrap();
        assert_ne!(enc2.kdf.salt, enc.kdf.salt);
        let c2 = unlock(&enc2, b"new", ID, 65536, 256).unwrap();
        assert_eq!(c2.blob_id(&[1; 32]), c.blob_id(&[1; 32]));
        assert_eq!(c2.open(b"a", &c.seal(b"a", b"data")).unwrap(), b"data");
        assert_eq!(unlock(&enc2, b"secret", ID, 65536, 256).err(), Some(CryptoError::WrongPassphrase));
        assert!(matches!(rewrap(&Crypto::None, b"new", CHEAP, ID, 65536, 256), Err(CryptoError::Invalid(_))));
        // The fingerprint is the master key's: the same under either passphrase, another
        // for another key, none unencrypted; it is no blob id or tag of the key.
        let f = c.key_fingerprint().unwrap();
        assert_eq!(c2.key_fingerprint(), Some(f));
        assert_ne!(key().1.key_fingerprint(), Some(f));
        assert_eq!(Crypto::None.key_fingerprint(), None);
        assert_ne!(c.blob_id(&f), f);
        assert_ne!(hex(&f), c.disk_tag("ferry key fingerprint 1"));
    }

    #[test]
    fn sealed_objects_are_authenticated() {
        let (_, c) = key();
        let plain = b"an index object".to_vec();
        let s = c.seal(b"ferry index", &plain);
        assert_eq!(s.len(), plain.len() + c.overhead());
        assert_ne!(&s[12..12 + plain.len()], &plain[..]);
        assert_eq!(c.open(b"ferry index", &s).unwrap(), plain);
        // Fresh nonces: the same plain text seals differently.
        assert_ne!(c.seal(b"ferry index", &plain), s);
        // Wrong additional data, any changed byte, truncation.
        assert!(matches!(c.open(b"ferry snapshot", &s), Err(CryptoError::Damaged(_))));
        for i in 0..s.len() {
            let mut t = s.clone();
            t[i] ^= 1;
            assert!(matches!(c.open(b"ferry index", &t), Err(CryptoError::Damaged(_))), "byte {i}");
        }
        for n in 0..s.len() {
            assert!(c.open(b"ferry index", &s[..n]).is_err(), "{n} bytes");
        }
        // An empty plain text seals to nonce and tag.
        assert_eq!(c.open(b"", &c.seal(b"", b"")).unwrap(), b"");
        // seal_into appends.
        let mut out = b"head".to_vec();
        c.seal_into(b"x", b"tail", &mut out);
        assert_eq!(c.open(b"x", &out[4..]).unwrap(), b"tail");
    }

    #[test]
    fn unencrypted_repositories_use_digests_and_plain_bytes() {
        let c = Crypto::None;
        assert!(!c.is_encrypted());
        assert_eq!(c.blob_id(&[3; 32]), [3; 32]);
        assert_eq!(c.seal(b"aad", b"plain"), b"plain");
        assert_eq!(c.open(b"aad", b"plain").unwrap(), b"plain");
        // SHA-256("vm1") for the lock tag; keyed when encrypted.
        assert_eq!(c.disk_tag("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        let (_, k) = key();
        assert!(k.is_encrypted());
        assert_ne!(k.disk_tag("abc"), c.disk_tag("abc"));
        assert_eq!(k.disk_tag("abc").len(), 64);
        let (_, other) = key();
        assert_ne!(k.disk_tag("abc"), other.disk_tag("abc"));
    }

    #[test]
    fn random_bytes_differ() {
        assert_ne!(random::<32>(), random::<32>());
    }
}
