//! Condemned packs (FORMAT.md §8a): gc runs beside backups. Instead of deleting the packs
//! it finds unused, gc stores `gc/condemned/ID` naming them and the backup locks present;
//! a backup that starts later treats them as absent, and a later gc deletes them once
//! every backup that could use them has ended (and it has marked again).
use crate::format::{self, CondemnedLock, CondemnedRecord, Digest, LockKind};
use crate::repo::{hostname, par_map, sha256, Failures, Repository, FETCH_THREADS};
use crate::{lock, Error, Result};
use std::collections::HashSet;
use std::sync::Arc;

/// The additional data of a condemned record's AEAD.
pub(crate) const AAD_CONDEMNED: &[u8] = b"ferry condemned";
/// Where the records are.
pub(crate) const PREFIX: &str = "gc/condemned/";

/// The condemned records of a repository.
#[derive(Debug, Default)]
pub(crate) struct Condemned {
    /// Each record that reads well, by object name.
    pub records: Vec<(String, CondemnedRecord)>,
    /// The records that cannot be read, with why.
    pub unreadable: Failures,
}

impl Condemned {
    /// Every pack that a readable record names.
    pub fn packs(&self) -> HashSet<Digest> {
        self.records.iter().flat_map(|(_, r)| r.packs.iter().filter_map(|p| format::parse_digest(p))).collect()
    }
}

/// The packs of a record as digests.
pub(crate) fn record_packs(r: &CondemnedRecord) -> impl Iterator<Item = Digest> + '_ {
    r.packs.iter().filter_map(|p| format::parse_digest(p))
}

impl Repository {
    fn read_condemned_object(&self, object: &str) -> Result<CondemnedRecord> {
        let json = self.read_named(object, PREFIX, format::MAX_CONDEMNED, AAD_CONDEMNED)?;
        CondemnedRecord::parse(&json).map_err(|e| Error::damaged(object, e.0))
    }

    /// Every condemned record, those that cannot be read apart. A store that fails is an
    /// error.
    pub(crate) fn condemned(&self) -> Result<Condemned> {
        let names = self
            .store
            .list(PREFIX)
            .map_err(|e| Error::store(format!("cannot list the condemned packs of {}", self.store.describe()), e))?;
        let mut names: Vec<String> = names.into_iter().map(|(n, _)| n).collect();
        names.sort();
        let mut out = Condemned::default();
        for (name, r) in names.iter().zip(par_map(&names, FETCH_THREADS, |n| self.read_condemned_object(n))) {
            match r {
                Ok(r) => out.records.push((name.clone(), r)),
                // Removed by a gc between the listing and the read (a read of a missing
                // object is damage: asked again, it is gone): it condemns nothing.
                Err(Error::Store { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
                Err(Error::Damaged { .. }) if self.removed(name)? => {}
                Err(e @ Error::Store { .. }) => return Err(e),
                Err(e) => out.unreadable.push((name.clone(), e)),
            }
        }
        Ok(out)
    }

    /// Whether `name` is missing from the store now (a store that fails is an error).
    fn removed(&self, name: &str) -> Result<bool> {
        match self.store.len(name) {
            Ok(_) => Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
            Err(e) => Err(Error::store(format!("cannot read {name} from {}", self.store.describe()), e)),
        }
    }

    /// The condemned packs, for a backup: it treats them as absent. A record that cannot
    /// be read is skipped with a warning (no gc deletes by it either: gc removes it).
    pub(crate) fn condemned_packs(&self) -> Result<HashSet<Digest>> {
        let c = self.condemned()?;
        for (name, e) in &c.unreadable {
            log::warn!("skipping {name}: {e}; the next `ferry repo gc` removes it");
        }
        Ok(c.packs())
    }

    /// Stores records of `packs` naming `backups`, each of at most
    /// [`format::MAX_CONDEMNED_PACKS`] packs (several when there are more: each must stay
    /// readable); their object names. More backups than a record may name is an error
    /// (nothing stored).
    pub(crate) fn put_condemned(&self, packs: &[Digest], backups: &[CondemnedLock]) -> Result<Vec<String>> {
        if backups.len() > format::MAX_CONDEMNED_LOCKS {
            return Err(Error::Invalid(format!(
                "{} backups run, more than the {} a condemned record may name",
                backups.len(),
                format::MAX_CONDEMNED_LOCKS
            )));
        }
        let mut packs: Vec<String> = packs.iter().map(|p| format::hex(p)).collect();
        packs.sort();
        packs.dedup();
        let mut names = Vec::new();
        for part in packs.chunks(record_packs_limit().max(1)) {
            match self.put_condemned_one(part.to_vec(), backups) {
                Ok(name) => names.push(name),
                Err(e) => {
                    // Those stored already condemn what is unused: removing them is tidy,
                    // not needed for safety.
                    for n in &names {
                        let _ = remove(self, n);
                    }
                    return Err(e);
                }
            }
        }
        Ok(names)
    }

    fn put_condemned_one(&self, packs: Vec<String>, backups: &[CondemnedLock]) -> Result<String> {
        let record = CondemnedRecord {
            version: format::VERSION,
            time: jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S%.9fZ").to_string(),
            host: hostname(),
            packs,
            backups: backups.to_vec(),
        };
        let sealed = self.crypto.seal(AAD_CONDEMNED, &record.to_bytes());
        if sealed.len() as u64 > format::MAX_CONDEMNED {
            return Err(Error::Invalid(format!(
                "the condemned record would be {} bytes, more than the {} one may have",
                sealed.len(),
                format::MAX_CONDEMNED
            )));
        }
        let name = format!("{PREFIX}{}", format::hex(&sha256(&sealed)));
        self.store
            .put(&name, &sealed)
            .map_err(|e| Error::store(format!("cannot store {name} in {}", self.store.describe()), e))?;
        Ok(name)
    }
}

#[cfg(test)]
thread_local! {
    /// The most packs one record names, smaller in tests that split records.
    pub(crate) static RECORD_PACKS: std::cell::Cell<usize> = const { std::cell::Cell::new(format::MAX_CONDEMNED_PACKS) };
}

/// The most packs one record names: [`format::MAX_CONDEMNED_PACKS`].
fn record_packs_limit() -> usize {
    #[cfg(test)]
    return RECORD_PACKS.with(|c| c.get()).min(format::MAX_CONDEMNED_PACKS);
    #[cfg(not(test))]
    format::MAX_CONDEMNED_PACKS
}

/// The backups running now, as a gc sees them: the live backup locks that follow the
/// condemned-pack rules, and why gc may delete nothing now (`Some`) when there is a
/// backup lock without them (an older ferry's, which does not read the records) or a
/// lock that cannot be read (it may be anyone's). Stale locks are removed when `remove`
/// (skipped otherwise: gc's dry run changes nothing).
pub(crate) fn running_backups(
    store: &Arc<dyn crate::store::Store>,
    remove: bool,
) -> Result<(Vec<CondemnedLock>, Option<String>)> {
    let (locks, unreadable) = lock::live_locks(store, remove)?;
    let mut out = Vec::new();
    let mut blocked =
        unreadable.into_iter().next().map(|(n, why)| format!("{n} is not a lock this ferry can read ({why})"));
    for (name, l) in locks {
        if l.kind != LockKind::Backup {
            continue;
        }
        if !l.condemned {
            blocked.get_or_insert_with(|| {
                format!(
                    "{name} is the lock of a backup by an older ferry (process {} on {}), which does not read them",
                    l.pid, l.host
                )
            });
        }
        out.push(CondemnedLock { lock: name, time: l.time });
    }
    out.sort_by(|a, b| a.lock.cmp(&b.lock));
    Ok((out, blocked))
}

/// How many times gc stores its record again when backups keep starting meanwhile.
const CONDEMN_TRIES: usize = 4;

/// Stores a record condemning `packs` that names every backup lock that may have missed
/// it: after it is stored, the locks are listed again, and while a backup lock shows
/// that the record does not name, a record naming it too replaces it. A backup whose
/// lock is not named took it after the record was stored, so it reads the record (it
/// lists `gc/condemned/` after it takes its lock). `None` (nothing condemned) when the
/// locks do not settle, or a lock appears that cannot be read or is an older ferry's.
pub(crate) fn condemn(repo: &Repository, packs: &[Digest]) -> Result<Option<(Vec<String>, Vec<CondemnedLock>)>> {
    if packs.is_empty() {
        return Ok(None);
    }
    let store = &repo.store;
    let (mut named, blocked) = running_backups(store, true)?;
    if let Some(why) = blocked {
        log::warn!("gc condemns nothing now: {why}");
        return Ok(None);
    }
    let mut records = repo.put_condemned(packs, &named)?;
    for _ in 0..CONDEMN_TRIES {
        let (now, blocked) = running_backups(store, true)?;
        if blocked.is_some() {
            break;
        }
        let new: Vec<CondemnedLock> = now.into_iter().filter(|l| !named.iter().any(|n| n.lock == l.lock)).collect();
        if new.is_empty() {
            return Ok(Some((records, named)));
        }
        named.extend(new);
        named.sort_by(|a, b| a.lock.cmp(&b.lock));
        let again = repo.put_condemned(packs, &named)?;
        for r in &records {
            remove(repo, r)?;
        }
        records = again;
    }
    log::warn!("gc condemns nothing now: backups kept starting while it stored its record; run it again");
    for r in &records {
        remove(repo, r)?;
    }
    Ok(None)
}

/// Removes a record (missing already: done).
pub(crate) fn remove(repo: &Repository, name: &str) -> Result<()> {
    match repo.store.delete(name) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::store(format!("cannot remove {name} from {}", repo.store.describe()), e)),
    }
}
