//! The repository key and what it does (FORMAT.md §3, §4): Argon2id wrapping of the
//! master key, AES-256-GCM of objects (version 2: under a key derived per object),
//! HMAC-SHA256 chunk ids. An unencrypted repository has [`Crypto::None`]: ids are
//! digests and sealing is the identity.
use crate::format::{self, hex, parse_hex, Config, Digest, Encryption, Kdf, KdfCost, Limits};
use aes_gcm::aead::{AeadInOut, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce, Tag};
use hmac::{Hmac, Mac};
use zeroize::{ZeroizeOnDrop, Zeroizing};

const NONCE: usize = 12;
const TAG: usize = 16;

/// The default KDF cost: 64 MiB, 3 passes, 4 lanes (RFC 9106's second recommendation).
pub const DEFAULT_KDF: KdfCost = KdfCost { m_kib: 65536, t: 3, p: 4 };

/// The most KDF memory a config may ask for without [`KdfLimit::Off`]: 1 GiB (and at
/// most half the memory this process may use).
pub const KDF_MAX_M_KIB: u64 = 1 << 20;
/// The most KDF work (memory × passes, in KiB) a config may ask for without
/// [`KdfLimit::Off`]: 4 GiB × 1 pass, a few seconds on one core (the default costs 192 MiB).
pub const KDF_MAX_WORK_KIB: u64 = 4 << 20;

/// Which KDF costs from a config (or asked for a new key) are run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KdfLimit {
    /// At most [`KDF_MAX_M_KIB`] and half the memory this process may use, and at most
    /// [`KDF_MAX_WORK_KIB`] of memory × passes: a hostile config cannot make every command
    /// run Argon2 for minutes with gigabytes before it says "wrong passphrase".
    #[default]
    Default,
    /// Anything FORMAT.md allows that fits in the memory this process may use
    /// (`FERRY_KDF_LIMIT=off`).
    Off,
}

/// How to lift [`KdfLimit::Default`], for messages.
pub const KDF_LIMIT_HOW: &str = "FERRY_KDF_LIMIT=off";

/// Checks a KDF cost against `limit` and the memory this process may use (`memory`,
/// bytes, where known), before the KDF runs.
pub fn check_kdf_limit(cost: &KdfCost, limit: KdfLimit, memory: Option<u64>) -> Result<(), CryptoError> {
    format::check_kdf_cost(cost).map_err(|e| CryptoError::Invalid(e.0))?;
    let (m, t) = (cost.m_kib as u64, cost.t as u64);
    let asks = format!("Argon2id with {} MiB of memory and {t} passes (m={m} KiB, t={t}, p={})", m >> 10, cost.p);
    if let Some(mem) = memory {
        if m << 10 > mem {
            return Err(CryptoError::TooCostly(format!(
                "the key derivation asks for {asks}: more than the {} MiB this process may use (the machine's or its \
                 control group's memory); open the repository on a machine with more memory",
                mem >> 20
            )));
        }
    }
    if limit == KdfLimit::Off {
        return Ok(());
    }
    let max_m = memory.map_or(KDF_MAX_M_KIB, |mem| KDF_MAX_M_KIB.min(mem >> 11));
    if m > max_m || m * t > KDF_MAX_WORK_KIB {
        return Err(CryptoError::TooCostly(format!(
            "the key derivation asks for {asks}: more than ferry runs unless told to (at most {} MiB, half the \
             memory this process may use, and {} MiB times passes), as a config written by someone else could ask \
             for it to exhaust this machine; if this repository's passphrase was set with that cost, set {KDF_LIMIT_HOW}",
            max_m >> 10,
            KDF_MAX_WORK_KIB >> 10
        )));
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CryptoError {
    /// The KDF cost is over the accepted limit (see [`check_kdf_limit`]).
    #[error("{0}")]
    TooCostly(String),
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
/// dropped: the key halves are [`Zeroizing`], aes-gcm's `zeroize` feature clears the
/// cipher's expanded key and GHASH key, and sha2's the HMAC state.
pub struct Keys {
    pub(crate) enc: Zeroizing<[u8; 32]>,
    pub(crate) id: Zeroizing<[u8; 32]>,
    cipher: Aes256Gcm,
    /// Version 2: HMAC-SHA256 keyed by `enc`, from which each object's key is derived
    /// ([`OBJECT_KEY_LABEL`]); version 1: none, every object is sealed by `cipher`.
    object_keys: Option<Hmac<sha2::Sha256>>,
}

/// The label before an object's additional data in its key's derivation (version 2,
/// FORMAT.md §4a): `key = HMAC-SHA256(enc_key, label || aad)`.
const OBJECT_KEY_LABEL: &[u8] = b"ferry-repository 2 object key\0";

/// The AES-256-GCM an object is sealed with: the master cipher, or one keyed for it.
enum ObjectCipher<'a> {
    Master(&'a Aes256Gcm),
    Own(Box<Aes256Gcm>),
}

impl std::ops::Deref for ObjectCipher<'_> {
    type Target = Aes256Gcm;
    fn deref(&self) -> &Aes256Gcm {
        match self {
            ObjectCipher::Master(c) => c,
            ObjectCipher::Own(c) => c,
        }
    }
}

/// Every field is [`ZeroizeOnDrop`] (checked by the tests).
impl ZeroizeOnDrop for Keys {}

impl Keys {
    fn from_master(master: &[u8; 64], version: u32) -> Keys {
        let mut enc = Zeroizing::new([0u8; 32]);
        let mut id = Zeroizing::new([0u8; 32]);
        enc.copy_from_slice(&master[..32]);
        id.copy_from_slice(&master[32..]);
        let cipher = aes_cipher(&enc);
        let object_keys = (version >= 2).then(|| hmac_keyed(&enc[..]));
        Keys { enc, id, cipher, object_keys }
    }
    /// The master key again (`enc_key || id_key`), zeroed when dropped.
    fn master(&self) -> Zeroizing<[u8; 64]> {
        let mut master = Zeroizing::new([0u8; 64]);
        master[..32].copy_from_slice(&self.enc[..]);
        master[32..].copy_from_slice(&self.id[..]);
        master
    }
    /// The cipher of an object whose additional data is `aad`: the master cipher
    /// (version 1), or AES-256-GCM keyed by HMAC-SHA256(enc_key, label || aad)
    /// (version 2). A blob's `aad` holds its id, so each blob has its own key; the other
    /// objects' `aad` is one per kind of object (FORMAT.md §4a gives the bounds).
    fn cipher(&self, aad: &[u8]) -> ObjectCipher<'_> {
        let Some(mac) = &self.object_keys else { return ObjectCipher::Master(&self.cipher) };
        let mut m = mac.clone();
        m.update(OBJECT_KEY_LABEL);
        m.update(aad);
        let mut key = Zeroizing::new([0u8; 32]);
        // Copied from the MAC's output, which is zeroed when dropped: no other copy is left.
        key.copy_from_slice(m.finalize().as_bytes());
        ObjectCipher::Own(Box::new(aes_cipher(&key)))
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

/// HMAC-SHA256 keyed by `key`, before any data. Its state (the key's inner and outer
/// SHA-256 states) is zeroed when it is dropped: sha2's `zeroize` feature.
fn hmac_keyed(key: &[u8]) -> Hmac<sha2::Sha256> {
    // HMAC takes a key of any length: this cannot fail.
    <Hmac<sha2::Sha256> as hmac::KeyInit>::new_from_slice(key).unwrap_or_else(|_| unreachable!())
}

fn hmac_sha256(key: &[u8], data: &[u8]) -> Digest {
    let mut m = hmac_keyed(key);
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
    open_in_place(cipher, aad, stored.to_vec())
}

/// Opens `nonce || ciphertext || tag` in its own buffer, which becomes the plain bytes.
fn open_in_place(cipher: &Aes256Gcm, aad: &[u8], mut stored: Vec<u8>) -> Result<Vec<u8>, ()> {
    let n = stored.len();
    if n < NONCE + TAG {
        return Err(());
    }
    let nonce: [u8; NONCE] = stored[..NONCE].try_into().map_err(|_| ())?;
    let tag: [u8; TAG] = stored[n - TAG..].try_into().map_err(|_| ())?;
    cipher
        .decrypt_inout_detached(&Nonce::from(nonce), aad, (&mut stored[NONCE..n - TAG]).into(), &Tag::from(tag))
        .map_err(|_| ())?;
    stored.truncate(n - TAG);
    stored.drain(..NONCE);
    Ok(stored)
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
                seal_tail(&k.cipher(aad), aad, out, start);
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
            seal_tail(&k.cipher(aad), aad, out, start);
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
        self.open_owned(aad, stored.to_vec())
    }

    /// [`Crypto::open`] of bytes the caller gives up (no copy of a large object is made):
    /// unencrypted, they are the plain form; encrypted, they are opened in place.
    pub fn open_owned(&self, aad: &[u8], stored: Vec<u8>) -> Result<Vec<u8>, CryptoError> {
        match self {
            Crypto::None => Ok(stored),
            Crypto::Aes(_) if stored.len() < NONCE + TAG => Err(CryptoError::Damaged(format!(
                "{} bytes are too few for an encrypted object (nonce and tag are {})",
                stored.len(),
                NONCE + TAG
            ))),
            Crypto::Aes(k) => open_in_place(&k.cipher(aad), aad, stored).map_err(|()| {
                CryptoError::Damaged("its authentication failed (the bytes were changed or damaged)".into())
            }),
        }
    }

    /// The plain text of a stored object, without a copy of it where it is not encrypted:
    /// `stored` itself, else `stored` decrypted into `scratch` (grown as needed, kept by
    /// the caller for its next object), for a reader that puts the plain bytes elsewhere
    /// (a restore decodes each chunk into its output).
    pub fn open_via<'a>(
        &self,
        aad: &[u8],
        stored: &'a [u8],
        scratch: &'a mut Vec<u8>,
    ) -> Result<&'a [u8], CryptoError> {
        let Crypto::Aes(k) = self else { return Ok(stored) };
        let n = stored.len();
        if n < NONCE + TAG {
            return Err(CryptoError::Damaged(format!(
                "{n} bytes are too few for an encrypted object (nonce and tag are {})",
                NONCE + TAG
            )));
        }
        let nonce: [u8; NONCE] = stored[..NONCE].try_into().unwrap_or([0; NONCE]);
        let tag: [u8; TAG] = stored[n - TAG..].try_into().unwrap_or([0; TAG]);
        let len = n - NONCE - TAG;
        if scratch.len() < len {
            scratch.resize(len, 0);
        }
        let out = &mut scratch[..len];
        let inout = aes_gcm::aead::inout::InOutBuf::new(&stored[NONCE..n - TAG], out)
            .map_err(|_| CryptoError::Damaged("unequal buffers".into()))?;
        k.cipher(aad).decrypt_inout_detached(&Nonce::from(nonce), aad, inout, &Tag::from(tag)).map_err(|_| {
            CryptoError::Damaged("its authentication failed (the bytes were changed or damaged)".into())
        })?;
        Ok(&scratch[..len])
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

/// What a wrapped key is bound to (its additional data, FORMAT.md §3): the repository's
/// format version, id, chunk size and page length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyContext<'a> {
    pub version: u32,
    pub repo_id: &'a str,
    pub chunk_size: u32,
    pub page_entries: u32,
}

impl KeyContext<'_> {
    pub fn of(config: &Config) -> KeyContext<'_> {
        KeyContext {
            version: config.version,
            repo_id: &config.id,
            chunk_size: config.chunk_size,
            page_entries: config.page_entries,
        }
    }
}

/// Makes a new master key wrapped by `passphrase` for a repository of these parameters.
pub fn new_key(
    passphrase: &[u8],
    cost: KdfCost,
    limit: KdfLimit,
    ctx: KeyContext,
) -> Result<(Encryption, Crypto), CryptoError> {
    let master = Zeroizing::new(random::<64>());
    let enc = wrap(&master, passphrase, cost, limit, ctx)?;
    Ok((enc, Crypto::Aes(Box::new(Keys::from_master(&master, ctx.version)))))
}

/// The additional data of the wrapped key (FORMAT.md §3).
fn key_aad(ctx: KeyContext) -> Vec<u8> {
    let KeyContext { version, repo_id, chunk_size, page_entries } = ctx;
    // Version 3 wraps its key as version 2 does: a repository upgraded in place keeps the
    // key it had (FORMAT.md §3).
    let version = if version == format::LOCATED_CONFIG_VERSION { 2 } else { version };
    format!("{} {version} {repo_id} {chunk_size} {page_entries}", format::FORMAT_NAME).into_bytes()
}

/// The key-encryption key: Argon2id (version 0x13) of the passphrase, after the cost is
/// checked against FORMAT.md's limits, `limit` and this process's memory.
fn kek(passphrase: &[u8], salt: &[u8], cost: KdfCost, limit: KdfLimit) -> Result<Zeroizing<[u8; 32]>, CryptoError> {
    check_kdf_limit(&cost, limit, crate::memory::limit())?;
    log::debug!("deriving a key from the passphrase (Argon2id, {} KiB, t={}, p={})", cost.m_kib, cost.t, cost.p);
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
    limit: KdfLimit,
    ctx: KeyContext,
) -> Result<Encryption, CryptoError> {
    format::check_limits(&Limits { chunk_size: ctx.chunk_size, page_entries: ctx.page_entries })
        .map_err(|e| CryptoError::Invalid(e.0))?;
    if !format::CONFIG_VERSIONS.contains(&ctx.version) {
        return Err(CryptoError::Invalid(format!("format version {} is not one this ferry writes", ctx.version)));
    }
    let salt: [u8; 32] = random();
    let cipher = aes_cipher(&*kek(passphrase, &salt, cost, limit)?);
    // Room for the tag too: the plain key is never left behind by a reallocation.
    let mut key = Zeroizing::new(Vec::with_capacity(NONCE + master.len() + TAG));
    key.extend_from_slice(&[0; NONCE]);
    key.extend_from_slice(master);
    seal_tail(&cipher, &key_aad(ctx), &mut key, 0);
    Ok(Encryption {
        cipher: format::CIPHER.into(),
        kdf: Kdf { name: format::KDF.into(), m_kib: cost.m_kib, t: cost.t, p: cost.p, salt: hex(&salt) },
        key: hex(&key),
    })
}

/// Opens a wrapped key (a config's `encryption`, or a key object's) with `passphrase`.
/// KDF costs are checked against FORMAT.md's limits, `limit` and this process's memory
/// before the KDF runs.
pub fn unlock(enc: &Encryption, passphrase: &[u8], limit: KdfLimit, ctx: KeyContext) -> Result<Crypto, CryptoError> {
    enc.validate().map_err(|e| CryptoError::Invalid(e.0))?;
    let salt = parse_hex(&enc.kdf.salt).ok_or_else(|| CryptoError::Invalid("the KDF salt is not hex".into()))?;
    let wrapped = parse_hex(&enc.key).ok_or_else(|| CryptoError::Invalid("the wrapped key is not hex".into()))?;
    let cipher = aes_cipher(&*kek(passphrase, &salt, enc.kdf.cost(), limit)?);
    let master =
        Zeroizing::new(open_with(&cipher, &key_aad(ctx), &wrapped).map_err(|()| CryptoError::WrongPassphrase)?);
    let keys = match <&[u8; 64]>::try_from(master.as_slice()) {
        Ok(m) => Keys::from_master(m, ctx.version),
        Err(_) => return Err(CryptoError::Invalid(format!("the wrapped key holds {} bytes, not 64", master.len()))),
    };
    Ok(Crypto::Aes(Box::new(keys)))
}

/// Re-wraps the same master key under a new passphrase (a new salt).
pub fn rewrap(
    crypto: &Crypto,
    passphrase: &[u8],
    cost: KdfCost,
    limit: KdfLimit,
    ctx: KeyContext,
) -> Result<Encryption, CryptoError> {
    let Crypto::Aes(k) = crypto else {
        return Err(CryptoError::Invalid("the repository is not encrypted: it has no passphrase to change".into()));
    };
    wrap(&k.master(), passphrase, cost, limit, ctx)
}

impl Crypto {
    /// The same master key as sealing works in format `version` (tests compare them).
    #[cfg(test)]
    pub(crate) fn as_version(&self, version: u32) -> Crypto {
        match self {
            Crypto::None => Crypto::None,
            Crypto::Aes(k) => Crypto::Aes(Box::new(Keys::from_master(&k.master(), version))),
        }
    }
}

/// A repository's ciphers from a fixed master key, for fuzzing the decoders of encrypted
/// objects (`version` 1 or 2).
#[doc(hidden)]
pub fn fixed_for_fuzzing(version: u32) -> Crypto {
    Crypto::Aes(Box::new(Keys::from_master(&[7; 64], version)))
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

    /// A version 2 repository's key context.
    fn cx(repo_id: &str, chunk_size: u32, page_entries: u32) -> KeyContext<'_> {
        KeyContext { version: 2, repo_id, chunk_size, page_entries }
    }

    fn key() -> (Encryption, Crypto) {
        new_key(b"secret", CHEAP, KdfLimit::Default, cx(ID, 65536, 256)).unwrap()
    }

    /// Compiles only for types that zero their memory when dropped.
    fn zeroed_on_drop<T: ZeroizeOnDrop>() {}

    #[test]
    fn key_material_is_zeroed_on_drop() {
        // The master key's halves and the cipher's expanded keys (aes-gcm's `zeroize`).
        zeroed_on_drop::<Zeroizing<[u8; 32]>>();
        zeroed_on_drop::<Aes256Gcm>();
        zeroed_on_drop::<Keys>();
        // HMAC-SHA256's state is two SHA-256 states keyed by the id key, or by enc_key for the
        // object keys of version 2 (sha2's `zeroize`).
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
        let again = unlock(&enc, b"secret", KdfLimit::Default, cx(ID, 65536, 256)).unwrap();
        let d = [7u8; 32];
        assert_eq!(c.blob_id(&d), again.blob_id(&d));
        assert_ne!(c.blob_id(&d), d);
        let sealed = c.seal(b"aad", b"hello");
        assert_eq!(again.open(b"aad", &sealed).unwrap(), b"hello");

        assert_eq!(
            unlock(&enc, b"Secret", KdfLimit::Default, cx(ID, 65536, 256)).err(),
            Some(CryptoError::WrongPassphrase)
        );
        // The parameters are the key's additional data: an edited config does not open.
        assert_eq!(
            unlock(&enc, b"secret", KdfLimit::Default, cx("other", 65536, 256)).err(),
            Some(CryptoError::WrongPassphrase)
        );
        assert_eq!(
            unlock(&enc, b"secret", KdfLimit::Default, cx(ID, 4096, 256)).err(),
            Some(CryptoError::WrongPassphrase)
        );
        assert_eq!(
            unlock(&enc, b"secret", KdfLimit::Default, cx(ID, 65536, 512)).err(),
            Some(CryptoError::WrongPassphrase)
        );
        // So are the KDF's parameters, through the key they derive.
        let mut t2 = enc.clone();
        t2.kdf.t = 2;
        assert_eq!(
            unlock(&t2, b"secret", KdfLimit::Default, cx(ID, 65536, 256)).err(),
            Some(CryptoError::WrongPassphrase)
        );
        let mut salted = enc.clone();
        salted.kdf.salt = "00".repeat(32);
        assert_eq!(
            unlock(&salted, b"secret", KdfLimit::Default, cx(ID, 65536, 256)).err(),
            Some(CryptoError::WrongPassphrase)
        );
        let mut flipped = enc.clone();
        flipped.key.replace_range(40..41, if &enc.key[40..41] == "0" { "1" } else { "0" });
        assert_eq!(
            unlock(&flipped, b"secret", KdfLimit::Default, cx(ID, 65536, 256)).err(),
            Some(CryptoError::WrongPassphrase)
        );
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
            assert!(
                matches!(unlock(&e, b"secret", KdfLimit::Default, cx(ID, 65536, 256)), Err(CryptoError::Invalid(_))),
                "{m_kib} {t} {p}"
            );
            assert!(started.elapsed().as_millis() < 100);
            let cost = KdfCost { m_kib, t, p };
            assert!(matches!(new_key(b"x", cost, KdfLimit::Default, cx(ID, 65536, 256)), Err(CryptoError::Invalid(_))));
        }
        let mut e = enc.clone();
        e.cipher = "aes-128-gcm".into();
        assert!(matches!(unlock(&e, b"secret", KdfLimit::Default, cx(ID, 65536, 256)), Err(CryptoError::Invalid(_))));
        assert!(matches!(new_key(b"x", CHEAP, KdfLimit::Default, cx(ID, 1000, 256)), Err(CryptoError::Invalid(_))));
    }

    #[test]
    fn rewrap_keeps_the_master_key() {
        let (enc, c) = key();
        let enc2 = rewrap(&c, b"new", CHEAP, KdfLimit::Default, cx(ID, 65536, 256)).unwrap();
        assert_ne!(enc2.kdf.salt, enc.kdf.salt);
        let c2 = unlock(&enc2, b"new", KdfLimit::Default, cx(ID, 65536, 256)).unwrap();
        assert_eq!(c2.blob_id(&[1; 32]), c.blob_id(&[1; 32]));
        assert_eq!(c2.open(b"a", &c.seal(b"a", b"data")).unwrap(), b"data");
        assert_eq!(
            unlock(&enc2, b"secret", KdfLimit::Default, cx(ID, 65536, 256)).err(),
            Some(CryptoError::WrongPassphrase)
        );
        assert!(matches!(
            rewrap(&Crypto::None, b"new", CHEAP, KdfLimit::Default, cx(ID, 65536, 256)),
            Err(CryptoError::Invalid(_))
        ));
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
        // Opened in its own buffer, the same; unencrypted, the bytes are the plain form.
        assert_eq!(c.open_owned(b"ferry index", s.clone()).unwrap(), plain);
        assert!(c.open_owned(b"ferry snapshot", s.clone()).is_err());
        assert!(c.open_owned(b"ferry index", s[..27].to_vec()).is_err());
        assert_eq!(Crypto::None.open_owned(b"ferry index", plain.clone()).unwrap(), plain);
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
    fn version_2_seals_each_object_under_its_own_key() {
        let (v1, v2) = (fixed_for_fuzzing(1), fixed_for_fuzzing(2));
        let aad = b"ferry blob \x00some id";
        let s2 = v2.seal(aad, b"plain bytes");
        assert_eq!(s2.len(), 11 + v2.overhead());
        assert_eq!(v2.open(aad, &s2).unwrap(), b"plain bytes");
        // Not under the master key (version 1), and not under another object's key.
        assert!(v1.open(aad, &s2).is_err());
        assert!(v2.open(b"ferry blob \x00other id", &s2).is_err());
        assert!(v2.open(aad, &v1.seal(aad, b"plain bytes")).is_err());
        // The key is FORMAT.md §4's: HMAC-SHA256(enc_key, label || aad), AES-256-GCM under it.
        let mut input = OBJECT_KEY_LABEL.to_vec();
        input.extend_from_slice(aad);
        assert_eq!(OBJECT_KEY_LABEL, b"ferry-repository 2 object key\0");
        let key: [u8; 32] = hmac_sha256(&[7; 32], &input);
        assert_eq!(open_with(&aes_cipher(&key), aad, &s2).unwrap(), b"plain bytes");
        // Version 1 seals under enc_key itself.
        assert_eq!(open_with(&aes_cipher(&[7; 32]), aad, &v1.seal(aad, b"x")).unwrap(), b"x");
        // Ids do not depend on the version.
        assert_eq!(v1.blob_id(&[1; 32]), v2.blob_id(&[1; 32]));
    }

    #[test]
    fn a_key_is_bound_to_its_format_version() {
        let (enc, _) = key();
        let v1 = KeyContext { version: 1, ..cx(ID, 65536, 256) };
        assert_eq!(unlock(&enc, b"secret", KdfLimit::Default, v1).err(), Some(CryptoError::WrongPassphrase));
        let (enc1, c1) = new_key(b"secret", CHEAP, KdfLimit::Default, v1).unwrap();
        let again = unlock(&enc1, b"secret", KdfLimit::Default, v1).unwrap();
        assert_eq!(again.open(b"a", &c1.seal(b"a", b"old")).unwrap(), b"old");
        assert!(unlock(&enc1, b"secret", KdfLimit::Default, cx(ID, 65536, 256)).is_err());
    }

    #[test]
    fn kdf_costs_over_the_limit_are_refused_before_the_kdf_runs() {
        const GIB: u32 = 1 << 20;
        let cost = |m_kib, t| KdfCost { m_kib, t, p: 1 };
        let gib = Some(16u64 << 30);
        for ok in [DEFAULT_KDF, CHEAP, cost(GIB, 4), cost(65536, 64), cost(GIB / 4, 16)] {
            check_kdf_limit(&ok, KdfLimit::Default, gib).unwrap();
        }
        // Memory over 1 GiB or half the process's, or memory × passes over 4 GiB.
        for (bad, mem) in
            [(cost(4 * GIB, 1), gib), (cost(GIB, 64), gib), (cost(65536 * 2, 64), gib), (cost(GIB, 1), Some(1 << 30))]
        {
            let e = check_kdf_limit(&bad, KdfLimit::Default, mem).unwrap_err();
            assert!(matches!(&e, CryptoError::TooCostly(m) if m.contains(KDF_LIMIT_HOW)), "{e}");
            check_kdf_limit(&bad, KdfLimit::Off, Some(64 << 30)).unwrap();
        }
        // Never more than the process may use, told or not.
        let e = check_kdf_limit(&cost(4 * GIB, 1), KdfLimit::Off, Some(2 << 30)).unwrap_err();
        assert!(matches!(&e, CryptoError::TooCostly(m) if m.contains("more memory")), "{e}");
        // FORMAT.md's ranges hold whatever the limit.
        assert!(matches!(check_kdf_limit(&cost(GIB, 65), KdfLimit::Off, None), Err(CryptoError::Invalid(_))));

        // A hostile config's cost is refused at once.
        let (mut enc, _) = key();
        (enc.kdf.m_kib, enc.kdf.t, enc.kdf.p) = (4 * GIB, 64, 1);
        let started = std::time::Instant::now();
        let e = unlock(&enc, b"secret", KdfLimit::Default, cx(ID, 65536, 256)).err().unwrap();
        assert!(matches!(e, CryptoError::TooCostly(_)), "{e}");
        assert!(e.to_string().contains("4096 MiB of memory and 64 passes"), "{e}");
        assert!(started.elapsed().as_millis() < 100);
        // And so is a new key of that cost.
        let e = new_key(b"x", cost(4 * GIB, 64), KdfLimit::Default, cx(ID, 65536, 256)).err().unwrap();
        assert!(matches!(e, CryptoError::TooCostly(_)), "{e}");
    }

    /// What a version 2 object key costs (one HMAC-SHA256, one AES-256-GCM key setup),
    /// against sealing the 64 KiB chunk it is for: `cargo test --release -p ferry-repo --lib
    /// object_key_cost -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn object_key_cost() {
        let Crypto::Aes(k) = fixed_for_fuzzing(2) else { unreachable!() };
        let aad = crate::blob::aad(format::BlobKind::Data, &[9; 32]);
        let n = 200_000;
        let best = |f: &dyn Fn()| {
            (0..3)
                .map(|_| {
                    let t = std::time::Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::MAX, f64::min)
        };
        let derive = best(&|| {
            for _ in 0..n {
                std::hint::black_box(k.cipher(&aad));
            }
        }) / n as f64;
        let chunk = vec![0x5au8; 65536];
        let seal = best(&|| {
            let mut out = Vec::with_capacity(70000);
            for _ in 0..2000 {
                out.clear();
                out.extend_from_slice(&[0; NONCE]);
                out.extend_from_slice(&chunk);
                seal_tail(&k.cipher, &aad, &mut out, 0);
            }
        }) / 2000.0;
        println!(
            "object key: {:.2} us; sealing 64 KiB under one key: {:.2} us ({:.1}% more)",
            derive * 1e6,
            seal * 1e6,
            derive / seal * 100.0
        );
    }

    #[test]
    fn random_bytes_differ() {
        assert_ne!(random::<32>(), random::<32>());
    }
}
