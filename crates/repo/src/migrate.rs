//! `ferry repo migrate` (FORMAT.md §9): a version 1 (unencrypted) or version 2 repository
//! upgraded in place to version 3, whose snapshots are located (§7c). Under the `gc` lock
//! (no backup, forget or gc beside it): the config first, then each version 1 manifest,
//! parents before children: its located pages stored (packs, then one index object),
//! then its version 2 manifest, then (for a protected snapshot) the mark of its new id,
//! then the old manifest deleted, then the old mark. A crash at any point leaves
//! a repository that reads whole, and a second run finishes the job.
use crate::blob;
use crate::format::{self, BlobAt, BlobEntry, BlobKind, Config, Digest, Manifest, PackBlobs, ZERO};
use crate::lock;
use crate::repo::{first_at, pack_name, sha256, Repository, SnapshotInfo, AAD_SNAPSHOT, AAD_TRAILER};
use crate::runs::{BlobLookup, RunIndex};
use crate::writer::DEFAULT_LEVEL;
use crate::{Error, Result};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Packs are closed at this size.
const PACK_SIZE: usize = 32 << 20;

/// A pack is closed at this many blobs, if it is not full before (FORMAT.md §5): a
/// reader refuses a trailer of more than [`format::MAX_TRAILER_ENTRIES`].
#[cfg(not(test))]
const PACK_BLOBS: usize = format::PACK_BLOBS;
/// A few in the crate's tests, so that a migration of a few pages splits its packs.
#[cfg(test)]
pub(crate) const PACK_BLOBS: usize = 4;

/// What a migrate did, or would do (`dry_run`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigrateReport {
    /// The version the repository had.
    pub from_version: u32,
    /// Whether the config was (or would be) rewritten.
    pub config: bool,
    /// Version 1 manifests made again as version 2.
    pub migrated: usize,
    /// Old manifests deleted that an earlier, interrupted run had migrated already.
    pub finished: usize,
    /// Located pages stored.
    pub pages: u64,
    /// The manifests skipped, each with why: those that cannot be read, and those one of
    /// whose pages cannot (they stay as they are; `ferry repo check` lists the damage).
    pub skipped: Vec<String>,
}

/// The test hook: `FERRY_TEST_MIGRATE_ABORT=N` ends the process after the Nth write of a
/// migrate (config, pack, index object, manifest, deletion), as a kill -9 would (it only
/// stops early: a migrate stopped anywhere leaves a repository that reads whole).
fn abort_hook() -> Option<u64> {
    std::env::var("FERRY_TEST_MIGRATE_ABORT").ok()?.parse().ok()
}

struct Writes<'a> {
    done: u64,
    abort_after: Option<u64>,
    /// The `gc` lock (none for a dry run).
    guard: Option<&'a lock::LockGuard>,
}

impl Writes<'_> {
    /// Whether the lock is still held: called before each store and each deletion, so that
    /// a migrate whose lock another host took for stale (and whose gc may run now) stops.
    fn check(&self) -> Result<()> {
        self.guard.map_or(Ok(()), |g| g.check())
    }

    fn one(&mut self) {
        self.done += 1;
        if self.abort_after == Some(self.done) {
            // As a kill -9: nothing after this write happens, nothing is cleaned up (no
            // destructor runs: the lock stays, as a killed process leaves it).
            eprintln!("FERRY_TEST_MIGRATE_ABORT: stopped after write {}", self.done);
            std::process::exit(137);
        }
    }
}

/// Upgrades `repo` to version 3 (FORMAT.md §9). `progress` is told each step.
pub fn migrate(repo: &Arc<Repository>, dry_run: bool, progress: &mut dyn FnMut(&str)) -> Result<MigrateReport> {
    let from = repo.config.version;
    if from == 1 && repo.config.encryption.is_some() {
        return Err(Error::Invalid(format!(
            "{} is an encrypted version 1 repository: its objects are sealed under one key, and version 3 seals \
             each under its own, so upgrading it would seal every pack again, which migrate does not do. It stays \
             readable and writable as version 1; to move it to version 3, copy its disks into a new repository",
            repo.store.describe()
        )));
    }
    let mut report = MigrateReport { from_version: from, ..MigrateReport::default() };
    let guard = if dry_run { None } else { Some(lock::acquire(&repo.store, format::LockKind::Gc, None, None)?) };
    let mut writes = Writes { done: 0, abort_after: abort_hook(), guard: guard.as_ref() };
    if from < format::LOCATED_CONFIG_VERSION {
        report.config = true;
        progress(&format!("config: version {from} to {}", format::LOCATED_CONFIG_VERSION));
        if !dry_run {
            writes.check()?;
            put_config(repo)?;
            writes.one();
        }
    }
    let snaps = list_all(repo, &mut report.skipped)?;
    // Old id → new id, of every manifest migrated (by this run or an earlier one).
    let mut moved: HashMap<String, String> =
        snaps.iter().filter_map(|s| s.manifest.migrated_from.as_ref().map(|old| (old.clone(), s.id.clone()))).collect();
    let todo: Vec<&SnapshotInfo> = snaps.iter().filter(|s| s.manifest.version == format::VERSION).collect();
    if todo.is_empty() {
        progress("every snapshot is located already");
        return Ok(report);
    }
    let index = if dry_run { None } else { Some(present_index(repo)?) };
    let protected = crate::retain::protected(repo)?;
    let mut stored: HashMap<Digest, BlobAt> = HashMap::new();
    let total = todo.len();
    for (k, snap) in todo.into_iter().enumerate() {
        let shown = format!("{}@{}", snap.manifest.name, &snap.id[..8]);
        if moved.contains_key(&snap.id) {
            // An earlier run stored its new manifest and stopped before deleting it.
            progress(&format!("[{}/{total}] {shown}: migrated already, its old manifest deleted", k + 1));
            report.finished += 1;
            if !dry_run {
                writes.check()?;
                move_mark(repo, &protected, &snap.id, &moved[&snap.id], &mut writes)?;
                writes.check()?;
                delete(repo, &snap.id)?;
                writes.one();
                writes.check()?;
                unmark(repo, &protected, &snap.id, &mut writes)?;
            }
            continue;
        }
        progress(&format!("[{}/{total}] {shown}: its pages located", k + 1));
        let Some(index) = &index else {
            report.migrated += 1;
            continue;
        };
        let parent = snap.manifest.parent.as_ref().map(|p| moved.get(p).cloned().unwrap_or_else(|| p.clone()));
        let made = located_manifest(repo, index, snap, &mut stored, &mut writes);
        let Some((manifest, pages)) = skip_damaged(&format!("snapshots/{}", snap.id), made, &mut report.skipped)?
        else {
            continue;
        };
        report.migrated += 1;
        report.pages += pages;
        let mut manifest = manifest;
        manifest.parent = parent;
        let id = put_manifest(repo, &manifest, &mut writes)?;
        writes.check()?;
        // Its protection moves to the new id before the old manifest goes (until then the
        // old id's mark counts for the manifest migrated from it, FORMAT.md §11).
        move_mark(repo, &protected, &snap.id, &id, &mut writes)?;
        writes.check()?;
        delete(repo, &snap.id)?;
        writes.one();
        writes.check()?;
        unmark(repo, &protected, &snap.id, &mut writes)?;
        moved.insert(snap.id.clone(), id);
    }
    Ok(report)
}

/// Stores the migrated manifest, with the lock checked before and after: when it was lost
/// meanwhile (a gc of another host may have marked without it), the new manifest is deleted
/// again and the old one stays, so that the snapshot is never only in a manifest whose
/// pages that gc may free.
fn put_manifest(repo: &Repository, manifest: &Manifest, writes: &mut Writes) -> Result<String> {
    let sealed = repo.crypto.seal(AAD_SNAPSHOT, &manifest.to_bytes());
    let id = format::hex(&sha256(&sealed));
    let name = format!("snapshots/{id}");
    writes.check()?;
    repo.store
        .put(&name, &sealed)
        .map_err(|e| Error::store(format!("cannot store {name} in {}", repo.store.describe()), e))?;
    writes.one();
    if let Err(e) = writes.check() {
        if let Err(d) = delete(repo, &id) {
            log::warn!("{d}: it stays beside the old manifest it was made from; run migrate again");
        }
        return Err(e);
    }
    Ok(id)
}

/// Migrate's last step, for a migrate that stopped before it: deletes each old manifest
/// that one of `snaps` (the listing, old manifests hidden) names in `migrated_from`, under
/// `guard` (a gc or forget lock, which no migrate runs beside). Until then the old manifest
/// is hidden, so gc would free its pages and a forget of the new one would bring it back
/// damaged. Returns how many were deleted.
pub(crate) fn finish_migrated(repo: &Repository, snaps: &[SnapshotInfo], guard: &lock::LockGuard) -> Result<usize> {
    let old: HashSet<&str> = snaps.iter().filter_map(|s| s.manifest.migrated_from.as_deref()).collect();
    if old.is_empty() {
        return Ok(0);
    }
    let names = repo
        .store
        .list("snapshots/")
        .map_err(|e| Error::store(format!("cannot list the snapshots of {}", repo.store.describe()), e))?;
    let mut done = 0;
    for (n, _) in names {
        if n.strip_prefix("snapshots/").is_some_and(|id| old.contains(id)) {
            guard.check()?;
            repo.store
                .delete(&n)
                .map_err(|e| Error::store(format!("cannot delete {n} from {}", repo.store.describe()), e))?;
            log::info!("deleted {n}: it was migrated, and an interrupted migrate left it");
            done += 1;
        }
    }
    Ok(done)
}

/// `r`, or `None` when it failed with damage to `object` (or what damage makes invalid):
/// the object is skipped, with a warning that names it, and recorded in `skipped`; other
/// failures (the store, the lock) stop the migrate.
fn skip_damaged<T>(object: &str, r: Result<T>, skipped: &mut Vec<String>) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e @ (Error::Damaged { .. } | Error::Invalid(_) | Error::NotFound(_))) => {
            log::warn!(
                "{object} is not migrated: {}; it stays as it is (`ferry repo check` lists the damage)",
                e.reason()
            );
            skipped.push(format!("{object}: {}", e.reason()));
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Every manifest that can be read, as stored (none hidden, parents as written), parents
/// before children; those that cannot be read are skipped, and added to `skipped`.
fn list_all(repo: &Repository, skipped: &mut Vec<String>) -> Result<Vec<SnapshotInfo>> {
    let names = repo
        .store
        .list("snapshots/")
        .map_err(|e| Error::store(format!("cannot list the snapshots of {}", repo.store.describe()), e))?;
    let mut snaps = Vec::with_capacity(names.len());
    for (n, _) in names {
        if let Some(s) = skip_damaged(&n, repo.read_snapshot(&n), skipped)? {
            snaps.push(s);
        }
    }
    // Parents before children: by the depth of each one's chain of present parents.
    let by_id: HashMap<String, Option<String>> =
        snaps.iter().map(|s| (s.id.clone(), s.manifest.parent.clone())).collect();
    let depth = |id: &str| {
        let mut d = 0usize;
        let mut at = by_id.get(id).cloned().flatten();
        while let Some(p) = at {
            d += 1;
            if d > by_id.len() {
                break;
            }
            at = by_id.get(&p).cloned().flatten();
        }
        d
    };
    let mut keyed: Vec<(usize, SnapshotInfo)> = snaps.into_iter().map(|s| (depth(&s.id), s)).collect();
    keyed.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.id.cmp(&b.1.id)));
    Ok(keyed.into_iter().map(|(_, s)| s).collect())
}

/// The index through the local cache, with copies in packs present in the store only.
fn present_index(repo: &Arc<Repository>) -> Result<RunIndex> {
    let index = RunIndex::open(repo)?;
    let present = repo.present_packs()?;
    Ok(index.only_present(present))
}

/// Refuses to write through `repo` when the stored config no longer has the format it was
/// opened with: a `ferry repo migrate` ran since (a backup opened before it would write
/// version 1 pages into a version 3 repository). Called by a backup once it holds its
/// disk's lock, which no migrate runs beside. A new key (`repo key passwd`) changes
/// nothing written, so `encryption` is not compared.
pub(crate) fn refuse_if_changed(repo: &Repository) -> Result<()> {
    let describe = repo.store.describe();
    let stored = repo
        .store
        .get("config", format::MAX_CONFIG)
        .map_err(|e| Error::store(format!("cannot read {describe}/config"), e))?;
    let now = Config::parse(&stored).map_err(|e| Error::damaged("config", e.0))?;
    let was = &repo.config;
    let version = now.version;
    let same = Config { encryption: was.encryption.clone(), ..now } == *was;
    if !same {
        return Err(Error::Invalid(format!(
            "the config of {describe} changed since this command opened it (version {} then, {} now: a `ferry repo \
             migrate` ran meanwhile?): nothing was written; run the command again",
            was.version, version
        )));
    }
    Ok(())
}

/// `config` with version 3, after checking it is still the one read; read back.
fn put_config(repo: &Repository) -> Result<()> {
    repo.replace_config(Config { version: format::LOCATED_CONFIG_VERSION, ..repo.config.clone() }, "")
}

fn delete(repo: &Repository, id: &str) -> Result<()> {
    let name = format!("snapshots/{id}");
    repo.store
        .delete(&name)
        .map_err(|e| Error::store(format!("cannot delete {name} from {}", repo.store.describe()), e))
}

/// Marks `new` protected when `old` (the manifest it was migrated from) is (FORMAT.md §11).
fn move_mark(repo: &Repository, protected: &HashSet<String>, old: &str, new: &str, writes: &mut Writes) -> Result<()> {
    if !protected.contains(old) || protected.contains(new) {
        return Ok(());
    }
    let name = format!("{}{new}", crate::retain::PROTECTED);
    let body = format!("{new} protected at {} (migrated from {old})\n", crate::repo::now_seconds());
    repo.store
        .put(&name, body.as_bytes())
        .map_err(|e| Error::store(format!("cannot store {name} in {}", repo.store.describe()), e))?;
    writes.one();
    Ok(())
}

/// Removes the mark of `old`, whose manifest is gone (its new one has its own mark).
fn unmark(repo: &Repository, protected: &HashSet<String>, old: &str, writes: &mut Writes) -> Result<()> {
    if !protected.contains(old) {
        return Ok(());
    }
    let name = format!("{}{old}", crate::retain::PROTECTED);
    repo.store
        .delete(&name)
        .map_err(|e| Error::store(format!("cannot delete {name} from {}", repo.store.describe()), e))?;
    writes.one();
    Ok(())
}

/// Blobs gathered into packs, each stored once it is full or [`PackOut::finish`]ed.
struct PackOut<'a> {
    repo: &'a Repository,
    buf: Vec<u8>,
    entries: Vec<BlobEntry>,
    closed: Vec<PackBlobs>,
}

impl PackOut<'_> {
    /// Appends a blob; its place is known once its pack is stored.
    fn add(&mut self, id: Digest, kind: BlobKind, plain: &[u8], writes: &mut Writes) -> Result<()> {
        let offset = self.buf.len() as u32;
        blob::encode_into(&self.repo.crypto, kind, &id, plain, DEFAULT_LEVEL, &mut self.buf);
        let stored_len = self.buf.len() as u32 - offset;
        self.entries.push(BlobEntry { id, kind, offset, stored_len, plain_len: plain.len() as u32 });
        if self.buf.len() >= PACK_SIZE || self.entries.len() >= PACK_BLOBS {
            self.close(writes)?;
        }
        Ok(())
    }

    /// Stores the open pack (FORMAT.md §5).
    fn close(&mut self, writes: &mut Writes) -> Result<()> {
        if self.entries.is_empty() {
            return Ok(());
        }
        let trailer = format::encode_trailer(&self.entries);
        let blobs_end = self.buf.len();
        self.repo.crypto.seal_into(AAD_TRAILER, &trailer, &mut self.buf);
        let sealed_len = (self.buf.len() - blobs_end) as u32;
        self.buf.extend_from_slice(&format::pack_tail(sealed_len));
        let digest = sha256(&self.buf);
        let name = pack_name(&digest);
        writes.check()?;
        self.repo
            .store
            .put(&name, &self.buf)
            .map_err(|e| Error::store(format!("cannot store {name} in {}", self.repo.store.describe()), e))?;
        writes.one();
        self.buf.clear();
        self.closed.push(PackBlobs { pack: digest, blobs: std::mem::take(&mut self.entries) });
        Ok(())
    }

    /// Stores the open pack and one index object for every pack stored: the places of
    /// their blobs.
    fn finish(&mut self, writes: &mut Writes) -> Result<Vec<PackBlobs>> {
        self.close(writes)?;
        let packs = std::mem::take(&mut self.closed);
        if !packs.is_empty() {
            writes.check()?;
            self.repo.put_index(&packs)?;
            writes.one();
        }
        Ok(packs)
    }
}

/// The version 2 manifest of version 1 snapshot `snap`: its located pages stored (those
/// not stored before: `stored`, by this run), with the places of its chunks from the
/// index; and how many pages were stored.
fn located_manifest(
    repo: &Repository,
    index: &RunIndex,
    snap: &SnapshotInfo,
    stored: &mut HashMap<Digest, BlobAt>,
    writes: &mut Writes,
) -> Result<(Manifest, u64)> {
    let entries = repo.entries(index, snap)?;
    let pe = repo.config.page_entries as usize;
    let mut out = PackOut { repo, buf: Vec::new(), entries: Vec::new(), closed: Vec::new() };
    let mut digests = Vec::new();
    let mut new_pages = 0u64;
    for slice in entries.chunks(pe) {
        if slice.iter().all(|e| *e == ZERO) {
            digests.push(ZERO);
            continue;
        }
        let at: Vec<Option<BlobAt>> = slice
            .iter()
            .map(|d| (*d != ZERO).then(|| first_at(index, &repo.crypto.blob_id(d), BlobKind::Data)).flatten())
            .collect();
        let page = format::encode_located_page(slice, &at);
        let d = sha256(&page);
        let id = repo.crypto.blob_id(&d);
        if !stored.contains_key(&id) && !index.contains(&id) {
            out.add(id, BlobKind::Located, &page, writes)?;
            new_pages += 1;
        }
        digests.push(d);
    }
    drop(entries);
    for p in out.finish(writes)? {
        for b in p.blobs {
            stored.insert(b.id, BlobAt { pack: p.pack, offset: b.offset, stored_len: b.stored_len });
        }
    }
    // The manifest's pages with their places.
    let places = digests.into_iter().map(|d| {
        let id = repo.crypto.blob_id(&d);
        let at =
            (d != ZERO).then(|| stored.get(&id).copied().or_else(|| first_at(index, &id, BlobKind::Located))).flatten();
        (d, at)
    });
    let (packs, pages) = format::hinted_pages(places.collect::<Vec<_>>());
    let mut m = snap.manifest.clone().map_pages(|_, _| (pages, packs));
    m.version = format::LOCATED_VERSION;
    m.migrated_from = Some(snap.id.clone());
    m.validate(&repo.limits()).map_err(|e| Error::Invalid(format!("the migrated manifest of {}: {e}", snap.id)))?;
    Ok((m, new_pages))
}
