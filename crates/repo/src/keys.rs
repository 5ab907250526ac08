//! The passphrases of an encrypted repository (FORMAT.md §3a): the config's key and the key
//! objects `keys/ID`, each a copy of the same master key wrapped under its own passphrase,
//! salt and KDF cost. Opening tries the config's key, then each key object; `ferry repo
//! key` adds, changes, lists and removes them. The master key never changes, so nothing
//! else in the repository is rewritten.
use crate::crypto::{self, Crypto, CryptoError, KdfLimit, KeyContext};
use crate::format::{self, Config, Encryption, KdfCost, KeyObject};
use crate::repo::{hostname, now_seconds};
use crate::store::Store;
use crate::{Error, Repository, Result};
use std::io;

/// The id the config's own key is listed by.
pub const CONFIG_KEY: &str = "config";
/// The most key objects `ferry repo key add` makes: fewer than readers accept
/// ([`format::MAX_KEY_OBJECTS`]), so that a change (a new object written before the old
/// one is removed) always fits.
pub const MAX_ADDED_KEYS: usize = format::MAX_KEY_OBJECTS / 2;

/// One passphrase's key, as `ferry repo key list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct KeyInfo {
    /// [`CONFIG_KEY`] or the key object's 16 hex digits.
    pub id: String,
    /// When it was made (the config's: when the repository was made).
    pub created: String,
    /// The host that made it (empty for the config's key, which does not record it).
    pub host: String,
    pub kdf: KdfCost,
    /// Whether the passphrase given opened this key.
    pub in_use: bool,
    /// Why the key object cannot be read, when it cannot (it can only be removed).
    pub damaged: Option<String>,
}

fn object_name(id: &str) -> String {
    format!("keys/{id}")
}

fn as_encryption(k: &KeyObject) -> Encryption {
    Encryption { cipher: format::CIPHER.into(), kdf: k.kdf.clone(), key: k.key.clone() }
}

/// The key objects' names, sorted; refused beyond [`format::MAX_KEY_OBJECTS`] (each
/// costs a key derivation to try). Names that are not key objects' are skipped.
fn key_object_names(store: &dyn Store) -> Result<Vec<String>> {
    let listed =
        store.list("keys/").map_err(|e| Error::store(format!("cannot list the keys of {}", store.describe()), e))?;
    let mut names: Vec<String> = listed.into_iter().map(|(n, _)| n).filter(|n| format::is_key_object_name(n)).collect();
    names.sort();
    if names.len() > format::MAX_KEY_OBJECTS {
        return Err(Error::Invalid(format!(
            "{} has {} key objects under keys/, more than the {} a repository may have (ferry makes at most {}): \
             each costs a key derivation to try, so they are not tried; remove the ones you did not make",
            store.describe(),
            names.len(),
            format::MAX_KEY_OBJECTS,
            MAX_ADDED_KEYS
        )));
    }
    Ok(names)
}

fn read_key_object(store: &dyn Store, name: &str) -> Result<KeyObject> {
    let bytes = store.get(name, format::MAX_KEY_OBJECT).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => Error::damaged(name, "it is missing from the store"),
        io::ErrorKind::InvalidData => Error::damaged(name, e.to_string()),
        _ => Error::store(format!("cannot read {name} from {}", store.describe()), e),
    })?;
    KeyObject::parse(&bytes).map_err(|e| Error::damaged(name, e.0))
}

/// Opens an encrypted repository's master key with `passphrase`: the config's key, else
/// the first key object it opens. Returns the key's id too. A key whose KDF cost is over
/// `limit` is not tried; when nothing opens, that is said (with how to lift the limit).
pub(crate) fn unlock_any(
    store: &dyn Store,
    config: &Config,
    enc: &Encryption,
    passphrase: &[u8],
    limit: KdfLimit,
) -> Result<(Crypto, String)> {
    let ctx = KeyContext::of(config);
    let mut costly = None;
    match crypto::unlock(enc, passphrase, limit, ctx) {
        Ok(c) => return Ok((c, CONFIG_KEY.into())),
        Err(CryptoError::WrongPassphrase) => {}
        Err(CryptoError::TooCostly(why)) => costly = Some(format!("the config's key: {why}")),
        Err(CryptoError::Damaged(why) | CryptoError::Invalid(why)) => return Err(Error::damaged("config", why)),
    }
    let names = key_object_names(store)?;
    for name in &names {
        let k = match read_key_object(store, name) {
            Ok(k) => k,
            Err(e @ Error::Store { .. }) => return Err(e),
            Err(e) => {
                log::warn!("skipping {name}: {e}");
                continue;
            }
        };
        match crypto::unlock(&as_encryption(&k), passphrase, limit, ctx) {
            Ok(c) => return Ok((c, name["keys/".len()..].to_string())),
            Err(CryptoError::WrongPassphrase) => {}
            Err(CryptoError::TooCostly(why)) => {
                costly.get_or_insert(format!("{name}: {why}"));
            }
            Err(e) => log::warn!("skipping {name}: {e}"),
        }
    }
    if let Some(why) = costly {
        return Err(Error::Invalid(format!("cannot try the passphrase on {}: {why}", store.describe())));
    }
    Err(Error::Passphrase(format!(
        "the passphrase does not open the repository {} (it was tried on the config's key{}: a wrong passphrase, \
         or a damaged config): give the right one (--password-file, --password-command, FERRY_PASSWORD, \
         FERRY_PASSWORD_FILE, FERRY_PASSWORD_COMMAND or the terminal)",
        store.describe(),
        match names.len() {
            0 => String::new(),
            1 => " and 1 key object".into(),
            n => format!(" and {n} key objects"),
        }
    )))
}

impl Repository {
    /// The key the passphrase opened ([`CONFIG_KEY`] or a key object's id); `None` when
    /// the repository is not encrypted.
    pub fn key_slot(&self) -> Option<&str> {
        self.key_slot.as_deref()
    }

    fn encrypted(&self) -> Result<()> {
        match self.crypto {
            Crypto::Aes(_) => Ok(()),
            Crypto::None => Err(Error::Invalid(format!(
                "the repository {} is not encrypted: it has no passphrase (its data cannot be encrypted after the \
                 fact: copy the disks into a new repository made with `ferry repo init --encrypt`)",
                self.store.describe()
            ))),
        }
    }

    /// Every key: the config's first, then the key objects by name.
    pub fn keys(&self) -> Result<Vec<KeyInfo>> {
        self.encrypted()?;
        let in_use = |id: &str| self.key_slot.as_deref() == Some(id);
        let mut out = Vec::new();
        if let Some(enc) = &self.config.encryption {
            out.push(KeyInfo {
                id: CONFIG_KEY.into(),
                created: self.config.created.clone(),
                host: String::new(),
                kdf: enc.kdf.cost(),
                in_use: in_use(CONFIG_KEY),
                damaged: None,
            });
        }
        for name in key_object_names(&*self.store)? {
            let id = name["keys/".len()..].to_string();
            out.push(match read_key_object(&*self.store, &name) {
                Ok(k) => KeyInfo {
                    in_use: in_use(&id),
                    id,
                    created: k.created,
                    host: k.host,
                    kdf: k.kdf.cost(),
                    damaged: None,
                },
                Err(e @ Error::Store { .. }) => return Err(e),
                Err(e) => KeyInfo {
                    in_use: false,
                    id,
                    created: String::new(),
                    host: String::new(),
                    kdf: KdfCost { m_kib: 0, t: 0, p: 0 },
                    damaged: Some(e.to_string()),
                },
            });
        }
        Ok(out)
    }

    /// The master key wrapped under `passphrase` (a new salt), as a key object.
    fn wrap_key(&self, passphrase: &[u8], cost: KdfCost, limit: KdfLimit) -> Result<KeyObject> {
        if passphrase.is_empty() {
            return Err(Error::Passphrase("the new passphrase is empty: an empty passphrase protects nothing".into()));
        }
        let enc = crypto::rewrap(&self.crypto, passphrase, cost, limit, KeyContext::of(&self.config))
            .map_err(|e| Error::Invalid(e.to_string()))?;
        Ok(KeyObject { created: now_seconds(), host: hostname(), kdf: enc.kdf, key: enc.key })
    }

    /// Stores a new key object (a fresh random id), read back to check it.
    fn put_key_object(&self, k: &KeyObject) -> Result<String> {
        let id = format::hex(&crypto::random::<8>());
        let name = object_name(&id);
        let bytes = k.to_bytes();
        self.store.put(&name, &bytes).map_err(|e| Error::store(format!("cannot store {name}"), e))?;
        if read_key_object(&*self.store, &name)? != *k {
            return Err(Error::damaged(name, "it does not read back as it was written"));
        }
        Ok(id)
    }

    /// Rewrites `config` with `enc` as its key ([`Repository::replace_config`]).
    fn put_config_key(&self, enc: Encryption) -> Result<()> {
        self.replace_config(Config { encryption: Some(enc), ..self.config.clone() }, " (another key change?)")
    }

    /// Rewrites `config` as `config`, after checking that the stored config is still the
    /// one this repository was opened with (a concurrent change is not lost silently;
    /// `hint` says what it may have been); read back to check it. One atomic write
    /// (FORMAT.md §2): a crash leaves the old config or the new one.
    pub(crate) fn replace_config(&self, config: Config, hint: &str) -> Result<()> {
        let describe = self.store.describe();
        let stored = self
            .store
            .get("config", format::MAX_CONFIG)
            .map_err(|e| Error::store(format!("cannot read {describe}/config"), e))?;
        if Config::parse(&stored).ok().as_ref() != Some(&self.config) {
            return Err(Error::Invalid(format!(
                "the config of {describe} changed since this command read it{hint}: run it again"
            )));
        }
        let bytes = config.to_bytes();
        Config::parse(&bytes).map_err(|e| Error::Invalid(format!("cannot write this config: {e}")))?;
        self.store.put("config", &bytes).map_err(|e| Error::store(format!("cannot write {describe}/config"), e))?;
        let back = self
            .store
            .get("config", format::MAX_CONFIG)
            .map_err(|e| Error::store(format!("cannot read {describe}/config back"), e))?;
        if back != bytes {
            return Err(Error::damaged("config", "it does not read back as it was written"));
        }
        Ok(())
    }

    /// Adds a passphrase: a new key object. Returns its id.
    pub fn add_key(&self, passphrase: &[u8], cost: KdfCost, limit: KdfLimit) -> Result<String> {
        self.encrypted()?;
        let have = key_object_names(&*self.store)?.len();
        if have >= MAX_ADDED_KEYS {
            return Err(Error::Invalid(format!(
                "the repository has {have} key objects besides its config's key, the most ferry makes: remove one \
                 first (`ferry repo key remove`)"
            )));
        }
        let k = self.wrap_key(passphrase, cost, limit)?;
        self.put_key_object(&k)
    }

    /// Changes the passphrase of the key the given passphrase opened. The config's key is
    /// rewritten in place (one atomic write); a key object is replaced by a new one,
    /// written before the old one is removed (a crash between leaves both working).
    /// Returns the key's id afterwards.
    pub fn change_key(&self, passphrase: &[u8], cost: KdfCost, limit: KdfLimit) -> Result<String> {
        self.encrypted()?;
        let slot = self.key_slot.clone().unwrap_or_default();
        let k = self.wrap_key(passphrase, cost, limit)?;
        if slot == CONFIG_KEY {
            self.put_config_key(as_encryption(&k))?;
            return Ok(slot);
        }
        let id = self.put_key_object(&k)?;
        let old = object_name(&slot);
        self.store.delete(&old).map_err(|e| {
            Error::store(
                format!(
                    "the new passphrase works (key {id}), but the old key object {old} could not be removed, so the \
                     old passphrase still works too: remove it with `ferry repo key remove REPO {slot}`"
                ),
                e,
            )
        })?;
        Ok(id)
    }

    /// Removes a key. Only the key the given passphrase opened is known to hold this
    /// repository's master key (a key object that merely parses may wrap another
    /// repository's key, or have rotted), so that key is never removed: the command is run
    /// with another key's passphrase, which shows that key opens. Removing the config's key
    /// moves the key the passphrase opened into the config (one atomic write), then
    /// removes that object. Returns what was done.
    pub fn remove_key(&self, id: &str) -> Result<String> {
        let keys = self.keys()?;
        let describe = self.store.describe();
        let Some(key) = keys.iter().find(|k| k.id == id) else {
            return Err(Error::NotFound(format!(
                "{describe} has no key {id:?}; its keys are: {}",
                keys.iter().map(|k| k.id.as_str()).collect::<Vec<_>>().join(", ")
            )));
        };
        if keys.len() == 1 {
            return Err(Error::Invalid(format!(
                "key {id} is the only key of {describe}: without it no passphrase would open the repository (add \
                 another with `ferry repo key add`, then remove this one with the new passphrase)"
            )));
        }
        if key.in_use {
            return Err(Error::Invalid(format!(
                "key {id} is the one the passphrase given opened, the only key of {describe} known to open it (a key \
                 object that merely reads may wrap another repository's key, or have rotted: only its passphrase shows \
                 that it opens): to remove this key, run the command with another key's passphrase"
            )));
        }
        if id != CONFIG_KEY {
            let name = object_name(id);
            self.store.delete(&name).map_err(|e| Error::store(format!("cannot remove {name}"), e))?;
            return Ok(format!("removed key {id}"));
        }
        // The config always holds a key: the one the passphrase given opened (known to hold
        // this master key) moves into it.
        let Some(next) = keys.iter().find(|k| k.in_use && k.id != CONFIG_KEY) else {
            return Err(Error::Invalid(format!("no key of {describe} known to open it can take the config's place")));
        };
        let name = object_name(&next.id);
        let k = read_key_object(&*self.store, &name)?;
        self.put_config_key(as_encryption(&k))?;
        self.store.delete(&name).map_err(|e| {
            Error::store(
                format!(
                    "the config's key was replaced by key {}'s copy, but {name} could not be removed (it is the same \
                     passphrase twice: remove it with `ferry repo key remove REPO {}`)",
                    next.id, next.id
                ),
                e,
            )
        })?;
        Ok(format!("removed the config's key; key {} moved into the config (its id is now {CONFIG_KEY})", next.id))
    }
}
