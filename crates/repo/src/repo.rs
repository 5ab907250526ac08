//! A repository opened: its config and key, its index, its snapshots.
use crate::blob;
use crate::crypto::{self, Crypto, KdfLimit, KeyContext};
use crate::format::{self, BlobKind, Config, Digest, KdfCost, Limits, Manifest, ManifestSummary, Pages, ZERO};
use crate::runs::BlobLookup;
use crate::store::Store;
use crate::{Error, Result};
use sha2::Digest as _;
use std::collections::{HashMap, HashSet};
use std::io;
use std::sync::Arc;

/// `ferry repo init`'s choices.
#[derive(Debug, Clone)]
pub struct InitOptions {
    pub chunk_size: u32,
    pub page_entries: u32,
    /// A passphrase and the KDF's cost, for an encrypted repository.
    pub encrypt: Option<(crate::Passphrase, KdfCost)>,
    /// Which KDF costs are accepted (the one asked for is refused beyond it).
    pub kdf_limit: KdfLimit,
    /// The format version (FORMAT.md §3): [`format::CONFIG_VERSION`], or 1 for a
    /// repository that ferry versions reading version 1 only can read too.
    pub version: u32,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            chunk_size: 65536,
            page_entries: 256,
            encrypt: None,
            kdf_limit: KdfLimit::Default,
            version: format::CONFIG_VERSION,
        }
    }
}

pub struct Repository {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) config: Config,
    pub(crate) crypto: Crypto,
    /// The key the passphrase opened: [`crate::keys::CONFIG_KEY`] or a key object's id
    /// (FORMAT.md §3a); `None` unencrypted.
    pub(crate) key_slot: Option<String>,
    /// This host's record of the repository, when the opener keeps one (crate::known).
    pub(crate) known: Option<crate::known::Known>,
    /// This host's cache of the index (crate::runs), found or made when first used.
    pub(crate) index_cache: std::sync::OnceLock<Option<Arc<crate::runs::Cache>>>,
}

/// Where a blob is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub pack: Digest,
    pub kind: BlobKind,
    pub offset: u32,
    pub stored_len: u32,
    pub plain_len: u32,
}

impl Location {
    /// Where the blob of index or trailer entry `e` of `pack` is.
    pub fn of(pack: Digest, e: &format::BlobEntry) -> Location {
        Location { pack, kind: e.kind, offset: e.offset, stored_len: e.stored_len, plain_len: e.plain_len }
    }
    /// Its place, as a hint gives it (FORMAT.md §7c).
    pub fn at(&self) -> format::BlobAt {
        format::BlobAt { pack: self.pack, offset: self.offset, stored_len: self.stored_len }
    }
}

/// The index's first usable copy of blob `id` when it is of `kind`: its place, for a hint.
pub(crate) fn first_at(index: &dyn BlobLookup, id: &Digest, kind: BlobKind) -> Option<format::BlobAt> {
    index.first(id).filter(|l| l.kind == kind).map(|l| l.at())
}

/// The union of the index objects: every location of every blob (FORMAT.md §6: any copy
/// is good).
///
/// Most blobs have one copy, so `blobs` holds each blob's first location (in index-object
/// name order) and `more` only the further ones (a chunk stored again after its pack was
/// lost, two backups that stored the same data, a pack that gc has not yet removed): the
/// common case costs one location a blob. A reader tries [`Index::locations`] in turn, so
/// a copy in a missing or damaged pack does not hide a good one.
#[derive(Default)]
pub struct Index {
    /// Each blob's first location.
    pub blobs: HashMap<Digest, Location>,
    /// Each blob's other locations, for the few blobs that have more than one.
    pub more: HashMap<Digest, Vec<Location>>,
    /// Names of the index objects it was read from.
    pub objects: Vec<String>,
}

impl Index {
    /// Every location of `id`, its first one first; none when it is in no index object.
    pub fn locations(&self, id: &Digest) -> impl Iterator<Item = &Location> {
        self.blobs.get(id).into_iter().chain(self.more.get(id).into_iter().flatten())
    }

    /// Whether `id` has at least one location.
    pub fn contains(&self, id: &Digest) -> bool {
        self.blobs.contains_key(id)
    }

    /// Adds a location of `id` (one it has already is not added again).
    pub fn add(&mut self, id: Digest, loc: Location) {
        match self.blobs.entry(id) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(loc);
            }
            std::collections::hash_map::Entry::Occupied(first) => {
                let same = |l: &Location| l.pack == loc.pack && l.offset == loc.offset;
                if same(first.get()) {
                    return;
                }
                let v = self.more.entry(id).or_default();
                if !v.iter().any(same) {
                    v.push(loc);
                }
            }
        }
    }

    /// Keeps only the locations in the packs `keep` accepts: a blob whose first location
    /// goes takes its next one, and a blob left with none leaves the index. Returns how
    /// many blobs left it.
    pub fn retain_packs(&mut self, keep: impl Fn(&Digest) -> bool) -> usize {
        self.more.retain(|_, v| {
            v.retain(|l| keep(&l.pack));
            !v.is_empty()
        });
        let before = self.blobs.len();
        let more = &mut self.more;
        self.blobs.retain(|id, loc| {
            if keep(&loc.pack) {
                return true;
            }
            let Some(v) = more.get_mut(id) else { return false };
            *loc = v.remove(0);
            if v.is_empty() {
                more.remove(id);
            }
            true
        });
        before - self.blobs.len()
    }
}

/// A snapshot: its id (object name) and its manifest but for the page digests (their
/// count only: a list of snapshots costs a few hundred bytes each, whatever their disks'
/// sizes). [`Repository::pages`] reads the pages of the one that is used.
#[derive(Debug, Clone)]
pub struct SnapshotInfo {
    pub id: String,
    pub manifest: ManifestSummary,
    /// Its pages, where they are held: a snapshot just written, a checkpoint read as one.
    pages: Option<Arc<Pages>>,
}

impl SnapshotInfo {
    /// A snapshot whose pages are held (one just written, a checkpoint's entries).
    pub fn new(id: String, manifest: Manifest) -> SnapshotInfo {
        let (manifest, pages) = manifest.split();
        SnapshotInfo { id, manifest, pages: Some(Arc::new(pages)) }
    }
    /// A snapshot listed: its pages are read again when they are asked for.
    pub fn listed(id: String, manifest: ManifestSummary) -> SnapshotInfo {
        SnapshotInfo { id, manifest, pages: None }
    }

    /// Its pages, if they are held (else [`Repository::pages`] reads them).
    pub fn held_pages(&self) -> Option<&Arc<Pages>> {
        self.pages.as_ref()
    }
}

/// An index object's name and content.
pub(crate) type IndexObject = (String, Vec<format::PackBlobs>);
/// Objects that could not be read, with why.
pub type Failures = Vec<(String, Error)>;

/// The additional data of the AEAD of manifests, index objects and pack trailers.
pub(crate) const AAD_SNAPSHOT: &[u8] = b"ferry snapshot";
pub(crate) const AAD_INDEX: &[u8] = b"ferry index";
pub(crate) const AAD_TRAILER: &[u8] = b"ferry pack trailer";

/// How many objects are fetched at once when many small ones are read (manifests, index
/// objects, pages): enough to hide an object store's latency.
pub(crate) const FETCH_THREADS: usize = 8;

/// The store name of a pack: `data/HH/HEX`.
pub(crate) fn pack_name(pack: &Digest) -> String {
    let h = format::hex(pack);
    format!("data/{}/{h}", &h[..2])
}

/// Hex SHA-256 of bytes: the name of an immutable object.
pub(crate) fn sha256(bytes: &[u8]) -> Digest {
    sha2::Sha256::digest(bytes).into()
}

/// Now, as FORMAT.md's times: RFC 3339, UTC, whole seconds.
pub(crate) fn now_seconds() -> String {
    jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Parses a FORMAT.md time.
pub(crate) fn parse_time(s: &str) -> Option<jiff::Timestamp> {
    s.parse::<jiff::Timestamp>().ok()
}

/// This host's name, as locks and manifests record it.
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// `f` over `items` on up to `threads` threads, results in order.
pub(crate) fn par_map<T: Sync, R: Send>(items: &[T], threads: usize, f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = threads.clamp(1, items.len().max(1));
    if threads == 1 {
        return items.iter().map(&f).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<R>>> = items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let r = f(item);
                *results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            });
        }
    });
    results
        .into_iter()
        .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()).expect("every item was mapped"))
        .collect()
}

/// The most bytes of manifests read at once when snapshots are listed (more when one
/// manifest alone is larger): a list of many large manifests costs about one of them.
pub(crate) const MANIFEST_BYTES: u64 = 64 << 20;

/// Bounds the bytes that threads hold at once: each waits until what it asks for fits
/// beside what the others hold, or none holds anything.
pub(crate) struct ByteBudget {
    held: std::sync::Mutex<u64>,
    freed: std::sync::Condvar,
    max: u64,
}

impl ByteBudget {
    pub(crate) fn new(max: u64) -> ByteBudget {
        ByteBudget { held: std::sync::Mutex::new(0), freed: std::sync::Condvar::new(), max }
    }

    /// `f`, run while `bytes` of the budget are held.
    pub(crate) fn with<R>(&self, bytes: u64, f: impl FnOnce() -> R) -> R {
        let lock = || self.held.lock().unwrap_or_else(|e| e.into_inner());
        {
            let mut held = lock();
            while *held > 0 && held.saturating_add(bytes) > self.max {
                held = self.freed.wait(held).unwrap_or_else(|e| e.into_inner());
            }
            *held += bytes;
        }
        // Given back however `f` ends: a panicking thread must not leave the others
        // waiting for bytes it no longer holds.
        struct Release<'a>(&'a ByteBudget, u64);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                *self.0.held.lock().unwrap_or_else(|e| e.into_inner()) -= self.1;
                self.0.freed.notify_all();
            }
        }
        let _release = Release(self, bytes);
        f()
    }
}

/// The store error of reading `name`, or damage when it is missing or too large where it
/// must exist (`missing_is_damage`).
fn read_error(store: &dyn Store, name: &str, e: io::Error) -> Error {
    match e.kind() {
        io::ErrorKind::NotFound => Error::damaged(name, "it is missing from the store"),
        io::ErrorKind::InvalidData | io::ErrorKind::UnexpectedEof => Error::damaged(name, e.to_string()),
        _ => Error::store(format!("cannot read {name} from {}", store.describe()), e),
    }
}

/// An empty chunk list for a snapshot of `chunks` chunks, refused (as damage of `object`,
/// or as too large for this machine) when the list (32 bytes a chunk) would take more
/// than half the memory this process may use (the machine's, or less where its control
/// group limits it: [`crate::memory::limit`]): a manifest of a few MB may describe a disk
/// of 2^63 bytes of zero pages, and allocating its list would abort the process (or get
/// it killed by the container's OOM killer).
pub(crate) fn entry_list(chunks: u64, object: &str) -> Result<Vec<Digest>> {
    entry_list_within(chunks, object, crate::memory::limit())
}

pub(crate) fn entry_list_within(chunks: u64, object: &str, memory: Option<u64>) -> Result<Vec<Digest>> {
    entry_list_fits(chunks, object, memory)?;
    let mut v: Vec<Digest> = Vec::new();
    if v.try_reserve_exact(chunks as usize).is_err() {
        return Err(too_large(chunks, object, memory));
    }
    Ok(v)
}

/// Whether a chunk list of `chunks` chunks would fit as [`entry_list_within`] requires,
/// without allocating it: the same refusal for commands that walk the pages instead (a
/// snapshot no image can open is not hashed either: a crafted manifest of 2^24 zero pages
/// would take billions of steps).
pub(crate) fn entry_list_fits(chunks: u64, object: &str, memory: Option<u64>) -> Result<()> {
    let budget = memory.map_or(u64::MAX, |m| m / 2);
    match chunks.saturating_mul(32) > budget {
        true => Err(too_large(chunks, object, memory)),
        false => Ok(()),
    }
}

fn too_large(chunks: u64, object: &str, memory: Option<u64>) -> Error {
    let bytes = chunks.saturating_mul(32);
    {
        Error::Invalid(format!(
            "{object} describes a disk of {chunks} chunks, whose list of chunk digests ({bytes} bytes) does not fit in \
             the memory this process may use ({}): read it on a machine with more memory, or raise the control \
             group's memory limit (or it is damaged: `ferry repo check`)",
            match memory {
                Some(m) => format!("{m} bytes, the machine's or its control group's limit"),
                None => "unknown".into(),
            }
        ))
    }
}

/// The index objects [`Repository::put_index_split`] makes of `packs`: ranges of them
/// (start, end) of at most `split` plain bytes each (or one pack, where it alone is more).
pub(crate) fn index_splits(packs: &[format::PackBlobs], split: usize) -> Vec<(usize, usize)> {
    splits_of(&packs.iter().map(|p| p.blobs.len()).collect::<Vec<_>>(), split)
}

/// [`index_splits`] of packs with `counts` blobs each.
pub(crate) fn splits_of(counts: &[usize], split: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < counts.len() {
        // Header, then per pack its id and count, then its entries.
        let mut len = 12;
        let mut end = start;
        while end < counts.len() {
            let add = 36 + counts[end] * format::ENTRY_LEN;
            if end > start && len + add > split {
                break;
            }
            len += add;
            end += 1;
        }
        out.push((start, end));
        start = end;
    }
    out
}

/// What [`Repository::snapshots_paging`] gives each snapshot's pages to.
pub(crate) type PagesOf<'a> = dyn FnMut(&SnapshotInfo, &Pages) -> Result<()> + 'a;

#[cfg(test)]
thread_local! {
    /// The most snapshots' page lists [`Repository::snapshots_paging`] held at once, its
    /// window's among them (the crate's tests).
    pub(crate) static PAGE_LISTS_MOST: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Stored bytes of index objects read side by side (each is held as its plain bytes, and
/// the entries of one of its packs at a time, while it is read).
const READ_BATCH: u64 = 8 << 20;

/// An index object read and checked whole, held as its plain bytes: its packs are parsed
/// again one at a time by [`IndexPlain::each`], so that no list of all its entries is
/// held beside its bytes (a 64 MiB object's would be 68 MiB more).
pub(crate) struct IndexPlain {
    plain: Vec<u8>,
    limits: format::Limits,
}

impl IndexPlain {
    /// `f` over its packs, in order, each parsed as it comes.
    pub(crate) fn each(self, mut f: impl FnMut(format::PackBlobs) -> Result<()>) -> Result<()> {
        let mut failed = None;
        // Checked whole when it was read: parsing it again cannot fail.
        let _ = format::each_index_pack(&self.plain, &self.limits, |p| {
            if failed.is_none() {
                failed = f(p).err();
            }
        });
        failed.map_or(Ok(()), Err)
    }
}

/// Reads the index objects `names` (name, stored size), a few side by side (up to
/// [`FETCH_THREADS`] of them, and at most [`READ_BATCH`] stored bytes unless one alone is
/// larger), and gives each to `f` in order, checked whole, or why it could not be read. A
/// store that cannot be read is an error, as in [`Repository::index_objects`].
pub(crate) fn each_index_object(
    repo: &Repository,
    names: &[(String, u64)],
    mut f: impl FnMut(&str, Result<IndexPlain>) -> Result<()>,
) -> Result<()> {
    let read = |name: &str| -> Result<IndexPlain> {
        let plain = repo.read_named(name, "index/", format::MAX_INDEX, AAD_INDEX)?;
        let limits = repo.limits();
        format::each_index_pack(&plain, &limits, drop).map_err(|e| Error::damaged(name, e.0))?;
        Ok(IndexPlain { plain, limits })
    };
    let mut rest = names;
    while !rest.is_empty() {
        let mut n = 0;
        let mut bytes = 0;
        while n < rest.len() && n < FETCH_THREADS && (n == 0 || bytes + rest[n].1 <= READ_BATCH) {
            bytes += rest[n].1;
            n += 1;
        }
        let (batch, after) = rest.split_at(n);
        rest = after;
        for ((name, _), r) in batch.iter().zip(par_map(batch, FETCH_THREADS, |(n, _)| read(n))) {
            match r {
                Err(e @ Error::Store { .. }) => return Err(e),
                r => f(name, r)?,
            }
        }
    }
    Ok(())
}

/// About how many bytes of pages a snapshot's chunk list is read in at a time.
#[cfg(not(test))]
pub(crate) const PAGE_WINDOW_BYTES: usize = 4 << 20;
/// Small in the crate's tests, so that their snapshots are read in several windows.
#[cfg(test)]
pub(crate) const PAGE_WINDOW_BYTES: usize = 4096;

/// Index objects are cut at this many plain bytes, well below the readers' limit
/// (FORMAT.md §6: 256 MiB), so no backup or gc writes one that cannot be read back.
pub(crate) const INDEX_SPLIT: usize = 64 << 20;

impl Repository {
    /// Stores index objects for `packs` (FORMAT.md §6), as many as it takes to keep
    /// each under [`INDEX_SPLIT`] plain bytes. Returns their names and stored bytes.
    pub(crate) fn put_index(&self, packs: &[format::PackBlobs]) -> Result<(Vec<String>, u64)> {
        self.put_index_split(packs, INDEX_SPLIT)
    }

    pub(crate) fn put_index_split(&self, packs: &[format::PackBlobs], split: usize) -> Result<(Vec<String>, u64)> {
        let (mut names, mut stored) = (Vec::new(), 0u64);
        for (start, end) in index_splits(packs, split) {
            let plain = format::encode_index(&packs[start..end]);
            let sealed = self.crypto.seal(AAD_INDEX, &plain);
            let name = format!("index/{}", format::hex(&sha256(&sealed)));
            self.store
                .put(&name, &sealed)
                .map_err(|e| Error::store(format!("cannot store {name} in {}", self.store.describe()), e))?;
            stored += sealed.len() as u64;
            names.push(name);
        }
        Ok((names, stored))
    }

    /// Makes a new repository in an empty store.
    pub fn init(store: Arc<dyn Store>, opts: &InitOptions) -> Result<Repository> {
        match store.len("config") {
            Ok(_) => {
                return Err(Error::Invalid(format!(
                    "{} already holds a repository (it has a config); open it, or give an empty location",
                    store.describe()
                )))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::store(format!("cannot read {}", store.describe()), e)),
        }
        if !format::CONFIG_VERSIONS.contains(&opts.version) {
            return Err(Error::Invalid(format!(
                "format version {} is not one this ferry writes ({} to {})",
                opts.version,
                format::CONFIG_VERSIONS.start(),
                format::CONFIG_VERSIONS.end()
            )));
        }
        let id = format::hex(&crypto::random::<32>());
        let ctx = KeyContext {
            version: opts.version,
            repo_id: &id,
            chunk_size: opts.chunk_size,
            page_entries: opts.page_entries,
        };
        let (encryption, crypto) = match &opts.encrypt {
            None => (None, Crypto::None),
            Some((pass, cost)) => {
                if pass.is_empty() {
                    return Err(Error::Passphrase("the passphrase is empty: give a non-empty one".into()));
                }
                let (enc, c) =
                    crypto::new_key(pass, *cost, opts.kdf_limit, ctx).map_err(|e| Error::Invalid(e.to_string()))?;
                (Some(enc), c)
            }
        };
        let key_slot = encryption.as_ref().map(|_| crate::keys::CONFIG_KEY.to_string());
        let config = Config {
            format: format::FORMAT_NAME.into(),
            version: opts.version,
            id,
            created: now_seconds(),
            chunk_size: opts.chunk_size,
            page_entries: opts.page_entries,
            compression: "zstd".into(),
            encryption,
        };
        let bytes = config.to_bytes();
        // The parser is the one place that knows what a valid config is.
        Config::parse(&bytes).map_err(|e| Error::Invalid(format!("cannot make this repository: {e}")))?;
        store
            .put("config", &bytes)
            .map_err(|e| Error::store(format!("cannot write {}/config", store.describe()), e))?;
        Ok(Repository { store, config, crypto, key_slot, known: None, index_cache: Default::default() })
    }

    /// Opens a repository; `passphrase` is called only if it is encrypted. KDF costs are
    /// accepted up to [`KdfLimit::Default`].
    pub fn open(store: Arc<dyn Store>, passphrase: &dyn Fn() -> Result<crate::Passphrase>) -> Result<Repository> {
        Repository::open_with(store, passphrase, KdfLimit::Default)
    }

    /// [`Repository::open`] with the KDF costs accepted from the config and key objects.
    /// The config's key is tried first, then each key object (FORMAT.md §3a).
    pub fn open_with(
        store: Arc<dyn Store>,
        passphrase: &dyn Fn() -> Result<crate::Passphrase>,
        kdf_limit: KdfLimit,
    ) -> Result<Repository> {
        let bytes = match store.get("config", format::MAX_CONFIG) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(Error::NoRepository(format!(
                    "{} is not a ferry repository (it has no config): make one with `ferry repo init`",
                    store.describe()
                )))
            }
            Err(e) => return Err(read_error(&*store, "config", e)),
        };
        let config = Config::parse(&bytes).map_err(|e| Error::damaged("config", e.0))?;
        let (crypto, key_slot) = match &config.encryption {
            None => (Crypto::None, None),
            Some(enc) => {
                let pass = passphrase()?;
                let (crypto, slot) = crate::keys::unlock_any(&*store, &config, enc, &pass, kdf_limit)?;
                (crypto, Some(slot))
            }
        };
        Ok(Repository { store, config, crypto, key_slot, known: None, index_cache: Default::default() })
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }
    /// Checks the repository against this host's record of it (refusing an encrypted
    /// one turned unencrypted or given another key), then keeps the record up to date
    /// with every listing of the snapshots, each committed snapshot and each forget.
    pub fn set_known(&mut self, known: crate::known::Known) -> Result<()> {
        known.opened(self)?;
        self.known = Some(known);
        Ok(())
    }
    /// This host's record of the repository, when it keeps one.
    pub fn known(&self) -> Option<&crate::known::Known> {
        self.known.as_ref()
    }
    pub fn config(&self) -> &Config {
        &self.config
    }
    /// This host's cache of the index (see crate::runs): in the cache directory, or
    /// private to this process where that cannot be used; `None` where no cache can be
    /// made (the index is then read into memory).
    pub(crate) fn index_cache(&self) -> Option<Arc<crate::runs::Cache>> {
        let open = || {
            let cache = crate::runs::Cache::for_repo(&self.config.id)?;
            // Temporary files that killed processes left there (gc, check and backups
            // all open the cache first).
            let n = crate::entries::remove_stray(cache.spill_dir());
            if n > 0 {
                log::info!("removed {n} temporary file(s) of processes gone from {}", cache.spill_dir().display());
            }
            Some(Arc::new(cache))
        };
        self.index_cache.get_or_init(open).clone()
    }
    /// Uses `cache` as this repository's index cache (tests); false when one is in use.
    #[cfg(test)]
    pub(crate) fn set_index_cache(&self, cache: Option<crate::runs::Cache>) -> bool {
        self.index_cache.set(cache.map(Arc::new)).is_ok()
    }
    pub fn crypto(&self) -> &Crypto {
        &self.crypto
    }

    pub(crate) fn limits(&self) -> Limits {
        Limits { chunk_size: self.config.chunk_size, page_entries: self.config.page_entries }
    }

    /// The plain bytes of an object named by the SHA-256 of its stored bytes
    /// (`PREFIX` + hex): at most `limit` bytes read, the name checked, then opened.
    pub(crate) fn read_named(&self, object: &str, prefix: &str, limit: u64, aad: &[u8]) -> Result<Vec<u8>> {
        let id = object.strip_prefix(prefix).unwrap_or(object);
        let want = format::parse_digest(id)
            .ok_or_else(|| Error::damaged(object, "its name is not a SHA-256 in hex (not written by ferry)"))?;
        let bytes = self.store.get(object, limit).map_err(|e| read_error(&*self.store, object, e))?;
        if sha256(&bytes) != want {
            return Err(Error::damaged(object, "its content does not match its name (SHA-256)"));
        }
        self.crypto.open_owned(aad, bytes).map_err(|e| Error::damaged(object, e.to_string()))
    }

    /// Reads and checks one manifest object (`snapshots/ID`), keeping its pages as `P`
    /// keeps them.
    fn read_manifest<P, K>(&self, object: &str) -> Result<Manifest<P, K>>
    where
        P: format::PageList + serde::de::DeserializeOwned,
        K: format::PackList + serde::de::DeserializeOwned,
    {
        let json = self.read_named(object, "snapshots/", format::MAX_MANIFEST, AAD_SNAPSHOT)?;
        let m: Manifest<P, K> =
            format::parse_manifest(&json, &self.limits()).map_err(|e| Error::damaged(object, e.0))?;
        if m.version == format::LOCATED_VERSION && self.config.version < format::LOCATED_CONFIG_VERSION {
            return Err(Error::damaged(
                object,
                format!("it is a version 2 manifest, which a version {} repository never holds", self.config.version),
            ));
        }
        Ok(m)
    }

    /// Reads and checks one manifest object (`snapshots/ID`); its pages are checked and
    /// counted, not kept.
    pub(crate) fn read_snapshot(&self, object: &str) -> Result<SnapshotInfo> {
        let manifest = self.read_manifest(object)?;
        let id = object.strip_prefix("snapshots/").unwrap_or(object);
        Ok(SnapshotInfo::listed(id.to_string(), manifest))
    }

    /// [`Self::read_snapshot`], holding its page digests too (compactly: [`Pages`]).
    fn read_snapshot_with_pages(&self, object: &str) -> Result<SnapshotInfo> {
        let (manifest, pages) = self.read_manifest::<Pages, format::PackIds>(object)?.split();
        let id = object.strip_prefix("snapshots/").unwrap_or(object);
        Ok(SnapshotInfo { id: id.to_string(), manifest, pages: Some(Arc::new(pages)) })
    }

    /// The page digests of `snap`: those it holds, else read again from its manifest
    /// (which must be the one listed: its object is named by its content, so only
    /// damage since makes it differ).
    pub fn pages(&self, snap: &SnapshotInfo) -> Result<Arc<Pages>> {
        if let Some(p) = &snap.pages {
            return Ok(p.clone());
        }
        let object = format!("snapshots/{}", snap.id);
        if snap.id.contains('/') {
            return Err(Error::Invalid(format!("{} is not a snapshot whose pages can be read", snap.id)));
        }
        let (mut summary, pages) = self.read_manifest::<Pages, format::PackIds>(&object)?.split();
        // A listing names a migrated parent by its new id ([`hide_migrated`]): the one whose
        // manifest says it was migrated from the parent this manifest names.
        if let (Some(stored), Some(listed)) = (&summary.parent, &snap.manifest.parent) {
            if stored != listed && self.migrated_from(&object, listed)?.as_ref() == Some(stored) {
                summary.parent = Some(listed.clone());
            }
        }
        if summary != snap.manifest {
            return Err(Error::damaged(object, "it is not the manifest that was listed under its name"));
        }
        Ok(Arc::new(pages))
    }

    /// The id snapshot `id`, listed as the parent of manifest `child`, was migrated from
    /// (its manifest's `migrated_from`), if any. A manifest of `id` that cannot be read
    /// now (the store failed: it may work again) is a store error, and one that is
    /// damaged (or gone since it was listed) is damage of that manifest: both name it and
    /// `child`, so that neither is taken for damage of `child`.
    fn migrated_from(&self, child: &str, id: &str) -> Result<Option<String>> {
        if !format::is_hex(id, 64) {
            return Ok(None);
        }
        let object = format!("snapshots/{id}");
        match self.read_snapshot(&object) {
            Ok(s) => Ok(s.manifest.migrated_from),
            Err(Error::Store { what, source }) => Err(Error::store(
                format!(
                    "{what} (the manifest of the parent of {child}, which its listing names and which must be read \
                     to check it; a store failure, not damage: try again)"
                ),
                source,
            )),
            Err(Error::Damaged { why, .. }) => Err(Error::damaged(
                object,
                format!("{why}; it is listed as the parent of {child}, which cannot be checked without it"),
            )),
            Err(e) => Err(e),
        }
    }

    /// Every manifest, each read and checked, with the names of those that fail and why;
    /// the good ones oldest first. A store that fails (not damage) is an error.
    pub fn snapshots_lenient(&self) -> Result<(Vec<SnapshotInfo>, Failures)> {
        self.list_snapshots(false)
    }

    /// [`Self::snapshots_lenient`], each snapshot holding its page digests: for the
    /// commands that read every snapshot's pages (check, stats), so that each manifest is
    /// read once, not once to list and again for its pages. (gc lists them without, and
    /// reads them again a few at a time: it holds no list of every snapshot's pages.)
    pub(crate) fn snapshots_with_pages_lenient(&self) -> Result<(Vec<SnapshotInfo>, Failures)> {
        self.list_snapshots(true)
    }

    fn list_snapshots(&self, with_pages: bool) -> Result<(Vec<SnapshotInfo>, Failures)> {
        self.list_snapshots_as(with_pages, None)
    }

    /// [`Self::snapshots`], each snapshot's page digests given to `f` as its manifest is
    /// read (each manifest read once), none kept: the manifests are read [`FETCH_THREADS`]
    /// at a time, so that only their page lists are held at once (gc's live set). A
    /// manifest that a migrated one hides is given too (its pages are kept one gc more).
    pub(crate) fn snapshots_paging(&self, f: &mut PagesOf) -> Result<Vec<SnapshotInfo>> {
        let (good, mut bad) = self.list_snapshots_as(true, Some(f))?;
        match bad.pop() {
            None => Ok(good),
            Some((_, e)) => Err(e),
        }
    }

    fn list_snapshots_as(
        &self,
        with_pages: bool,
        mut on_pages: Option<&mut PagesOf>,
    ) -> Result<(Vec<SnapshotInfo>, Failures)> {
        let before = self.known.as_ref().map(|k| k.before_listing());
        let names = self
            .store
            .list("snapshots/")
            .map_err(|e| Error::store(format!("cannot list the snapshots of {}", self.store.describe()), e))?;
        // A few at a time, and no more bytes at once than [`MANIFEST_BYTES`] (but one):
        // each is parsed into its summary and its JSON dropped before the next is read.
        let budget = ByteBudget::new(MANIFEST_BYTES);
        let read_one = |(n, len): &(String, u64)| {
            budget.with(*len, || if with_pages { self.read_snapshot_with_pages(n) } else { self.read_snapshot(n) })
        };
        // Pages given away are read a window at a time, each window's dropped before the next.
        let window = if on_pages.is_some() { FETCH_THREADS } else { names.len().max(1) };
        let mut good = Vec::new();
        let mut bad = Vec::new();
        for chunk in names.chunks(window) {
            #[cfg(test)]
            if on_pages.is_some() {
                let held = chunk.len() + good.iter().filter(|s: &&SnapshotInfo| s.pages.is_some()).count();
                PAGE_LISTS_MOST.with(|m| m.set(m.get().max(held)));
            }
            for ((name, _), r) in chunk.iter().zip(par_map(chunk, FETCH_THREADS, read_one)) {
                match (r, on_pages.as_mut()) {
                    (Ok(s), Some(f)) => {
                        if let Some(p) = &s.pages {
                            f(&s, p)?;
                        }
                        good.push(SnapshotInfo { pages: None, ..s });
                    }
                    (Ok(s), None) => good.push(s),
                    (Err(e @ Error::Store { .. }), _) => return Err(e),
                    (Err(e), _) => bad.push((name.clone(), e)),
                }
            }
        }
        hide_migrated(&mut good);
        sort_snapshots(&mut good);
        if let (Some(k), Some(before)) = (&self.known, before) {
            let unreadable: Vec<String> =
                bad.iter().map(|(n, _)| n.strip_prefix("snapshots/").unwrap_or(n).to_string()).collect();
            k.listed(before, &good, &unreadable)?;
        }
        Ok((good, bad))
    }

    /// Every snapshot that can be read, oldest first; each manifest that cannot be read is
    /// skipped with a warning that names it (one damaged manifest must not stop the work
    /// on every disk). Returns the names of those skipped too.
    pub fn snapshots_skipping(&self) -> Result<(Vec<SnapshotInfo>, Failures)> {
        let (good, bad) = self.snapshots_lenient()?;
        for (name, e) in &bad {
            warn_skipped(name, e);
        }
        Ok((good, bad))
    }

    /// Every snapshot, oldest first, each after its parent (FORMAT.md §7's order); an error
    /// if any manifest cannot be read (for gc, which must know every snapshot).
    pub fn snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        let (good, mut bad) = self.snapshots_lenient()?;
        match bad.pop() {
            None => Ok(good),
            Some((_, e)) => Err(e),
        }
    }

    /// The snapshot `name` means: the latest of the disk, or the one whose id starts with
    /// `id` (at least 4 hex digits, unique, and of that disk).
    ///
    /// A manifest that cannot be read is skipped with a warning naming it (it may be of
    /// any disk: an encrypted one does not even say which); asking for it by id is an
    /// error that says it is damaged.
    pub fn resolve(&self, name: &str, id: Option<&str>) -> Result<SnapshotInfo> {
        let (all, bad) = self.snapshots_skipping()?;
        resolve_in(&all, &bad, &self.store.describe(), name, id)
    }

    /// Reads and checks one index object.
    pub(crate) fn read_index_object(&self, object: &str) -> Result<Vec<format::PackBlobs>> {
        let plain = self.read_named(object, "index/", format::MAX_INDEX, AAD_INDEX)?;
        format::parse_index(&plain, &self.limits()).map_err(|e| Error::damaged(object, e.0))
    }

    /// Every index object, read and checked: the good ones (name and content) and the
    /// names of those that fail and why.
    pub(crate) fn index_objects(&self) -> Result<(Vec<IndexObject>, Failures)> {
        let names = self
            .store
            .list("index/")
            .map_err(|e| Error::store(format!("cannot list the index of {}", self.store.describe()), e))?;
        let mut names: Vec<String> = names.into_iter().map(|(n, _)| n).collect();
        names.sort();
        let mut good = Vec::new();
        let mut bad = Vec::new();
        for (name, r) in names.iter().zip(par_map(&names, FETCH_THREADS, |n| self.read_index_object(n))) {
            match r {
                Ok(p) => good.push((name.clone(), p)),
                Err(e @ Error::Store { .. }) => return Err(e),
                Err(e) => bad.push((name.clone(), e)),
            }
        }
        Ok((good, bad))
    }

    /// Reads every index object.
    pub fn load_index(&self) -> Result<Index> {
        let (good, mut bad) = self.index_objects()?;
        if let Some((_, e)) = bad.pop() {
            return Err(e);
        }
        Ok(crate::damage::prefer_good(good, &self.damage()?))
    }

    /// Every index object that reads well; those that do not are skipped with a warning
    /// (for readers and backups: a snapshot whose blobs are all listed elsewhere still
    /// reads, and a backup stores again what it cannot find).
    pub(crate) fn load_index_lenient(&self) -> Result<Index> {
        let (good, bad) = self.index_objects()?;
        for (name, e) in bad {
            log::warn!("skipping {name}: {e}; `ferry repo repair` rebuilds the index from the packs");
        }
        Ok(crate::damage::prefer_good(good, &self.damage()?))
    }

    /// The stored bytes of a blob, decoded and checked against its id: the plain bytes,
    /// or why they could not be had.
    pub(crate) fn read_blob(&self, id: &Digest, loc: &Location, kind: BlobKind) -> Result<Vec<u8>, String> {
        if loc.kind != kind {
            return Err(format!("the index says blob {} is a {:?} blob, not {:?}", format::hex(id), loc.kind, kind));
        }
        let pack = pack_name(&loc.pack);
        let stored = self
            .store
            .get_range(&pack, loc.offset as u64, loc.stored_len as u64)
            .map_err(|e| format!("cannot read {pack}: {e}"))?;
        self.decode_blob(id, loc, kind, &stored).map_err(|e| format!("{pack}: {e}"))
    }

    /// Decodes stored bytes read from `loc`.
    pub(crate) fn decode_blob(
        &self,
        id: &Digest,
        loc: &Location,
        kind: BlobKind,
        stored: &[u8],
    ) -> Result<Vec<u8>, String> {
        let plain = self.decode_blob_unchecked(id, loc, kind, stored)?;
        if self.crypto.blob_id(&blob::digest(&plain)) != *id {
            return Err(format!(
                "blob {} at offset {}: its plain bytes do not match its id (their digest differs)",
                format::hex(id),
                loc.offset
            ));
        }
        Ok(plain)
    }

    /// [`Repository::decode_blob`] but for the digest check, which the caller makes
    /// (for several blobs at once) before it uses the bytes.
    pub(crate) fn decode_blob_unchecked(
        &self,
        id: &Digest,
        loc: &Location,
        kind: BlobKind,
        stored: &[u8],
    ) -> Result<Vec<u8>, String> {
        if stored.len() != loc.stored_len as usize {
            return Err(format!("blob {} at offset {} is cut short", format::hex(id), loc.offset));
        }
        let plain = blob::decode_unchecked(&self.crypto, kind, id, stored, self.limits().max_plain(kind))
            .map_err(|e| format!("blob {} at offset {}: {e}", format::hex(id), loc.offset))?;
        if plain.len() != loc.plain_len as usize {
            return Err(format!(
                "blob {} at offset {} has {} bytes, its index entry says {}",
                format::hex(id),
                loc.offset,
                plain.len(),
                loc.plain_len
            ));
        }
        Ok(plain)
    }

    /// The plain bytes of blob `id` from the first of its copies that reads and checks
    /// well; else why none did (each copy's reason).
    pub(crate) fn read_blob_any(&self, index: &dyn BlobLookup, id: &Digest, kind: BlobKind) -> Result<Vec<u8>, String> {
        let mut whys = Vec::new();
        for loc in index.locations(id) {
            match self.read_blob(id, &loc, kind) {
                Ok(plain) => return Ok(plain),
                Err(why) => whys.push(why),
            }
        }
        Err(match whys.len() {
            0 => format!("blob {} is in no index object", format::hex(id)),
            _ => whys.join("; "),
        })
    }

    /// A page's entries, read through the index (any copy) and checked against `digest`.
    /// Its kind (a page or a located page, FORMAT.md §7c) is the one its index entries say:
    /// each copy is read as its entry's kind, and checked as always.
    pub(crate) fn read_page(&self, index: &dyn BlobLookup, digest: &Digest) -> Result<Vec<Digest>, String> {
        self.read_page_hinted(index, digest, None).map(|p| p.entries)
    }

    /// Blob `id` of `kind` read where a hint says it is (FORMAT.md §7c), and checked as
    /// any blob is (§4): its digest decides, whatever the hint said.
    pub(crate) fn read_hinted(&self, id: &Digest, at: &format::BlobAt, kind: BlobKind) -> Result<Vec<u8>, String> {
        let pack = pack_name(&at.pack);
        let stored = self
            .store
            .get_range(&pack, at.offset as u64, at.stored_len as u64)
            .map_err(|e| format!("cannot read {pack}: {e}"))?;
        if stored.len() != at.stored_len as usize {
            return Err(format!("{pack} is shorter than the hint of blob {}", format::hex(id)));
        }
        blob::decode(&self.crypto, kind, id, &stored, self.limits().max_plain(kind))
            .map_err(|e| format!("{pack}: blob {} at offset {}: {e}", format::hex(id), at.offset))
    }

    /// A page read and checked against `digest`: where `hint` says a located page is
    /// (FORMAT.md §7c), else (or when that fails) through the index, any copy, each read as
    /// its index entry's kind. A located page comes with its packs and hints; a page of
    /// kind 1 with none.
    pub(crate) fn read_page_hinted(
        &self,
        index: &dyn BlobLookup,
        digest: &Digest,
        hint: Option<format::BlobAt>,
    ) -> Result<format::LocatedPage, String> {
        let id = self.crypto.blob_id(digest);
        let mut whys = Vec::new();
        if let Some(at) = hint {
            match self.read_hinted(&id, &at, BlobKind::Located) {
                Ok(plain) => {
                    return format::parse_located_page(&plain, &self.limits())
                        .map_err(|e| format!("page {}: {e}", format::hex(digest)))
                }
                Err(why) => {
                    log::debug!("the hint of page {} failed ({why}): read through the index", format::hex(digest));
                    whys.push(why);
                }
            }
        }
        for loc in index.locations(&id) {
            if !loc.kind.is_page() {
                whys.push(format!("the index says blob {} is a data blob", format::hex(&id)));
                continue;
            }
            match self.read_blob(&id, &loc, loc.kind) {
                Ok(plain) if loc.kind == BlobKind::Located => {
                    return format::parse_located_page(&plain, &self.limits())
                        .map_err(|e| format!("page {}: {e}", format::hex(digest)))
                }
                Ok(plain) => {
                    return format::parse_any_page(loc.kind, &plain, &self.limits())
                        .map(|entries| format::LocatedPage { entries, ..Default::default() })
                        .map_err(|e| format!("page {}: {e}", format::hex(digest)))
                }
                Err(why) => whys.push(why),
            }
        }
        Err(match whys.len() {
            0 => format!("page {} is in no index object", format::hex(digest)),
            _ => whys.join("; "),
        })
    }

    /// The packs in the store now (`data/` listed).
    pub(crate) fn present_packs(&self) -> Result<HashSet<Digest>> {
        Ok(self
            .store
            .list("data/")
            .map_err(|e| Error::store(format!("cannot list the packs of {}", self.store.describe()), e))?
            .into_iter()
            .filter_map(|(n, _)| crate::damage::pack_id(&n))
            .collect())
    }

    /// The chunk digests of a snapshot, page by page: reads and checks its pages.
    pub fn entries(&self, index: &dyn BlobLookup, snap: &SnapshotInfo) -> Result<Vec<Digest>> {
        let object = snap_object(snap);
        let mut entries = entry_list(snap.manifest.chunks(), &object)?;
        self.each_page_entries(index, snap, |_, page| {
            entries.extend_from_slice(page);
            Ok(())
        })?;
        Ok(entries)
    }

    /// [`Repository::entries`], its pages read where the manifest's hints say (FORMAT.md
    /// §7c) and through `index` only where they fail; with `hints`, the hints of its
    /// chunks too (none for a snapshot that is not located).
    pub fn entries_hinted(
        &self,
        index: &dyn BlobLookup,
        snap: &SnapshotInfo,
        hints: bool,
    ) -> Result<(Vec<Digest>, ChunkHints)> {
        let object = snap_object(snap);
        let chunks = snap.manifest.chunks();
        let mut entries = entry_list(chunks, &object)?;
        let mut out = ChunkHints::default();
        let mut numbers: HashMap<Digest, u32> = HashMap::new();
        if hints && snap.manifest.version == format::LOCATED_VERSION {
            out.at = vec![[u32::MAX, 0, 0]; chunks as usize];
        }
        self.each_located_page(index, snap, |first, page| {
            if !out.at.is_empty() {
                for (k, h) in page.hints.iter().enumerate().filter(|(_, h)| !h.is_none()) {
                    let Some(pack) = page.packs.get(h.pack as usize) else { continue };
                    let next = out.packs.len() as u32;
                    let no = *numbers.entry(*pack).or_insert(next);
                    if no == next {
                        out.packs.push(*pack);
                    }
                    out.at[first as usize + k] = [no, h.offset, h.stored_len];
                }
            }
            entries.extend_from_slice(&page.entries);
            Ok(())
        })?;
        Ok((entries, out))
    }

    /// Calls `f` with each page's chunk digests of a snapshot, in order (its first chunk,
    /// its entries; a zero page as zero entries): reads and checks its pages, a window
    /// of about [`PAGE_WINDOW_BYTES`] at a time, so that the pages read wait for their
    /// window only, not the whole list. Returns the snapshot's page digests (read
    /// once: a caller that needs them too need not read its manifest again).
    pub(crate) fn each_page_entries(
        &self,
        index: &dyn BlobLookup,
        snap: &SnapshotInfo,
        mut f: impl FnMut(u64, &[Digest]) -> Result<()>,
    ) -> Result<Vec<Digest>> {
        self.each_located_page(index, snap, |first, page| f(first, &page.entries))
    }

    /// [`Repository::each_page_entries`] with each page whole: its entries and, for a
    /// located snapshot, its hints (FORMAT.md §7c; none for a zero page or a plain one).
    /// The pages are read where the manifest's hints say, through `index` where they fail.
    pub(crate) fn each_located_page(
        &self,
        index: &dyn BlobLookup,
        snap: &SnapshotInfo,
        mut f: impl FnMut(u64, &format::LocatedPage) -> Result<()>,
    ) -> Result<Vec<Digest>> {
        let m = &snap.manifest;
        let object = snap_object(snap);
        let chunks = m.chunks();
        let pe = m.page_entries as u64;
        let all = self.pages(snap)?;
        let located = m.version == format::LOCATED_VERSION;
        let digests: Vec<(Digest, Option<format::BlobAt>)> =
            all.iter_hinted()
                .map(|(d, h)| {
                    let at = (!h.is_none())
                        .then(|| all.packs().get(h.pack as usize))
                        .flatten()
                        .map(|p| format::BlobAt { pack: *p, offset: h.offset, stored_len: h.stored_len });
                    (d, at)
                })
                .collect();
        drop(all);
        if digests.len() as u64 != chunks.div_ceil(pe) {
            return Err(Error::damaged(object, "its page count does not match its size"));
        }
        let window = (PAGE_WINDOW_BYTES / (32 * pe.max(1)) as usize).max(FETCH_THREADS);
        let read = |(d, at): &(Digest, Option<format::BlobAt>)| {
            if *d == ZERO {
                Ok(format::LocatedPage::default())
            } else {
                self.read_page_hinted(index, d, if located { *at } else { None })
            }
        };
        let mut pages = Vec::new().into_iter();
        let mut zeroes = format::LocatedPage::default();
        for (i, (d, _)) in digests.iter().enumerate() {
            if i % window == 0 {
                pages = par_map(&digests[i..(i + window).min(digests.len())], FETCH_THREADS, read).into_iter();
            }
            let page = pages.next().unwrap_or_else(|| Err("it was not read".into()));
            let first = i as u64 * pe;
            let count = (chunks - first).min(pe) as usize;
            if *d == ZERO {
                zeroes.entries.resize(count, ZERO);
                f(first, &zeroes)?;
                continue;
            }
            let page = page.map_err(|why| Error::damaged(object.clone(), format!("page {i}: {why}")))?;
            if page.entries.len() != count {
                return Err(Error::damaged(
                    object,
                    format!("page {i} has {} entries, not {count}", page.entries.len()),
                ));
            }
            f(first, &page)?;
        }
        Ok(digests.into_iter().map(|(d, _)| d).collect())
    }
}

/// The object a snapshot was read from: a checkpoint read as a snapshot has its object
/// name as its id.
pub(crate) fn snap_object(snap: &SnapshotInfo) -> String {
    if snap.id.contains('/') {
        snap.id.clone()
    } else {
        format!("snapshots/{}", snap.id)
    }
}

/// Where a located snapshot's chunks are hinted to be (FORMAT.md §7c): per chunk, a pack
/// number into `packs` (`u32::MAX`: no hint), the offset and the stored length. Empty for
/// a snapshot that is not located.
#[derive(Debug, Clone, Default)]
pub struct ChunkHints {
    pub packs: Vec<Digest>,
    pub at: Vec<[u32; 3]>,
}

impl ChunkHints {
    /// Chunk `ci`'s hinted place, if it has one.
    pub fn get(&self, ci: usize) -> Option<format::BlobAt> {
        let [p, offset, stored_len] = *self.at.get(ci)?;
        let pack = *self.packs.get(p as usize)?;
        Some(format::BlobAt { pack, offset, stored_len })
    }
    /// Whether it holds any hint.
    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }
}

/// The index of the given index objects: every location of each blob, the first seen
/// first.
pub(crate) fn build_index(objects: Vec<IndexObject>) -> Index {
    let mut index = Index { objects: Vec::with_capacity(objects.len()), ..Index::default() };
    let total: usize = objects.iter().flat_map(|(_, p)| p.iter().map(|p| p.blobs.len())).sum();
    index.blobs.reserve(total);
    for (name, packs) in objects {
        for p in packs {
            for b in p.blobs {
                index.add(b.id, Location::of(p.pack, &b));
            }
        }
        index.objects.push(name);
    }
    index
}

/// The snapshots as `ferry repo migrate` leaves them at any point (FORMAT.md §9): a
/// manifest that a present one names in `migrated_from` is hidden (a migrate stopped
/// between storing the new manifest and deleting the old), and a `parent` naming a
/// manifest no longer present is the manifest migrated from it.
pub(crate) fn hide_migrated(snaps: &mut Vec<SnapshotInfo>) {
    let moved: HashMap<String, String> =
        snaps.iter().filter_map(|s| s.manifest.migrated_from.as_ref().map(|old| (old.clone(), s.id.clone()))).collect();
    if moved.is_empty() {
        return;
    }
    snaps.retain(|s| !moved.contains_key(&s.id));
    for s in snaps.iter_mut() {
        if let Some(new) = s.manifest.parent.as_ref().and_then(|p| moved.get(p)) {
            s.manifest.parent = Some(new.clone());
        }
    }
}

/// Orders snapshots oldest first, a snapshot always after its parent whatever the clocks
/// said (FORMAT.md §7): by the latest time along its parents (its own, or an ancestor's
/// dated later by a clock that was ahead), then by how many parents share that time, then
/// by id. The times themselves are the writers' clocks, never changed.
pub(crate) fn sort_snapshots(snaps: &mut [SnapshotInfo]) {
    let keys = order_keys(snaps);
    let mut keyed: Vec<(Option<jiff::Timestamp>, usize, &str, usize)> =
        snaps.iter().enumerate().map(|(i, s)| (keys[i].0, keys[i].1, s.id.as_str(), i)).collect();
    keyed.sort();
    let order: Vec<SnapshotInfo> = keyed.iter().map(|k| snaps[k.3].clone()).collect();
    snaps.clone_from_slice(&order);
}

/// Each snapshot's (latest time along its parents, parents in a row with that time), in
/// one pass: a chain of n snapshots costs n steps, not n².
pub(crate) fn order_keys(snaps: &[SnapshotInfo]) -> Vec<(Option<jiff::Timestamp>, usize)> {
    let at: HashMap<&str, usize> = snaps.iter().enumerate().map(|(i, s)| (s.id.as_str(), i)).collect();
    let mut keys: Vec<Option<(Option<jiff::Timestamp>, usize)>> = vec![None; snaps.len()];
    let mut path = Vec::new();
    for first in 0..snaps.len() {
        // Up the parents to one whose key is known (or none).
        path.clear();
        let mut cur = Some(first);
        while let Some(i) = cur.filter(|i| keys[*i].is_none() && path.len() <= snaps.len()) {
            path.push(i);
            cur = snaps[i].manifest.parent.as_deref().and_then(|p| at.get(p).copied());
        }
        let mut above = cur.and_then(|i| keys[i]);
        for &i in path.iter().rev() {
            let t = parse_time(&snaps[i].manifest.time);
            let k = match above {
                Some((pt, depth)) if pt >= t => (pt, depth + 1),
                _ => (t, 0),
            };
            keys[i] = Some(k);
            above = Some(k);
        }
    }
    keys.into_iter().map(|k| k.unwrap_or((None, 0))).collect()
}

/// The blkhash of a snapshot from its entries (FORMAT.md §1): the entries with zero
/// entries replaced by the digest of as many zero bytes, then the size.
pub(crate) fn blkhash_of(entries: &[Digest], size: u64, chunk_size: u32) -> Digest {
    let mut h = BlkHasher::new(entries.len() as u64, size, chunk_size);
    h.feed(entries);
    h.finish()
}

/// [`blkhash_of`] fed a page at a time, so that no whole list of entries is kept.
pub(crate) struct BlkHasher {
    h: sha2::Sha256,
    /// Entries in all, and fed so far.
    n: u64,
    fed: u64,
    zero_full: Digest,
    zero_last: Digest,
    size: u64,
}

impl BlkHasher {
    /// For a snapshot of `n` entries and `size` bytes.
    pub(crate) fn new(n: u64, size: u64, chunk_size: u32) -> BlkHasher {
        let cs = chunk_size as u64;
        let zero_full = sha256(&vec![0u8; chunk_size as usize]);
        let last_len = size - n.saturating_sub(1) * cs;
        let zero_last = if last_len == cs { zero_full } else { sha256(&vec![0u8; last_len as usize]) };
        BlkHasher { h: sha2::Sha256::new(), n, fed: 0, zero_full, zero_last, size }
    }

    /// The next entries, in order.
    pub(crate) fn feed(&mut self, entries: &[Digest]) {
        for e in entries {
            self.fed += 1;
            if *e == ZERO {
                self.h.update(if self.fed == self.n { self.zero_last } else { self.zero_full });
            } else {
                self.h.update(e);
            }
        }
    }

    /// The next `count` entries, all zero.
    pub(crate) fn feed_zeros(&mut self, count: u64) {
        for _ in 0..count {
            self.feed(&[ZERO]);
        }
    }

    pub(crate) fn finish(mut self) -> Digest {
        self.h.update(self.size.to_le_bytes());
        self.h.finalize().into()
    }
}

/// Says that the manifest `name` is skipped, and why.
pub(crate) fn warn_skipped(name: &str, e: &Error) {
    log::warn!(
        "skipping {name}: it cannot be read ({}); `ferry repo check` lists the damage, and the other snapshots are \
         used as if it were not there",
        e.reason()
    );
}

/// [`Repository::resolve`] among snapshots already read (`all`), with the manifests that
/// could not be (`bad`) and the repository as shown (`repo`).
pub fn resolve_in(
    all: &[SnapshotInfo],
    bad: &[(String, Error)],
    repo: &str,
    name: &str,
    id: Option<&str>,
) -> Result<SnapshotInfo> {
    let Some(prefix) = id else {
        return all.iter().rev().find(|s| s.manifest.name == name).cloned().ok_or_else(|| {
            let mut disks: Vec<&str> = all.iter().map(|s| s.manifest.name.as_str()).collect();
            disks.sort();
            disks.dedup();
            Error::NotFound(if disks.is_empty() {
                format!("{repo} has no snapshot yet (of {name} or of any disk)")
            } else {
                format!("{repo} has no snapshot of {name}; its disks are: {}", disks.join(", "))
            })
        });
    };
    let prefix = prefix.to_ascii_lowercase();
    if prefix.len() < 4 || prefix.len() > 64 || !prefix.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Error::Invalid(format!(
            "{prefix:?} is not a snapshot id: give at least 4 hex digits of one (`ferry repo list` shows them)"
        )));
    }
    let hits: Vec<&SnapshotInfo> = all.iter().filter(|s| s.id.starts_with(&prefix)).collect();
    let ours: Vec<&SnapshotInfo> = hits.iter().copied().filter(|s| s.manifest.name == name).collect();
    let damaged: Vec<&(String, Error)> =
        bad.iter().filter(|(n, _)| n.strip_prefix("snapshots/").is_some_and(|i| i.starts_with(&prefix))).collect();
    match (ours.as_slice(), damaged.as_slice()) {
        ([_], [(object, _), ..]) => Err(Error::Invalid(format!(
            "{prefix} names two snapshots: one of {name}, and {object}, which cannot be read; give more digits"
        ))),
        ([], [(object, e), ..]) if hits.is_empty() => {
            Err(Error::damaged(object.clone(), format!("the snapshot asked for cannot be read: {}", e.reason())))
        }
        _ => Ok(()),
    }?;
    match ours.as_slice() {
        [one] => Ok((*one).clone()),
        [] if hits.is_empty() => Err(Error::NotFound(format!(
            "{repo} has no snapshot whose id starts with {prefix} (`ferry repo list` shows them)"
        ))),
        [] => Err(Error::NotFound(format!(
            "snapshot {prefix} is not of {name} but of {}: write {}::{}@{prefix}",
            hits[0].manifest.name, repo, hits[0].manifest.name
        ))),
        many => Err(Error::Invalid(format!(
            "{prefix} names {} snapshots of {name}: {}; give more digits",
            many.len(),
            many.iter()
                .map(|s| format!("{} ({})", &s.id[..16.min(s.id.len())], s.manifest.time))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}
