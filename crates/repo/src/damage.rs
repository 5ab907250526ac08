//! Damage records (FORMAT.md §7b): the stored copies of blobs that `verify` found damaged,
//! kept in the repository so that what reads and writes it afterwards knows them.
//!
//! The hooks elsewhere are small: the index ([`Repository::load_index`], check, gc) lists a
//! recorded-damaged copy after every other copy of its blob ([`prefer_good`]), so that a
//! good copy is read wherever one exists; a backup drops recorded-damaged copies from its
//! index ([`exclude_damaged`]), so that it stores their content again where it reads it;
//! `gc` never keeps a recorded-damaged copy when a good one exists, and drops the records
//! of packs that are gone ([`prune_records`]).
use crate::format::LockKind;
use crate::format::{self, DamageRecord, DamagedPack, Digest};
use crate::repo::{build_index, hostname, par_map, Failures, Index, IndexObject, Location, Repository, FETCH_THREADS};
use crate::spill::Sorted;
use crate::{lock, Error, Result};
use std::collections::{HashMap, HashSet};

/// The additional data of a damage record's AEAD.
pub(crate) const AAD_DAMAGE: &[u8] = b"ferry damage";

/// What is recorded of one pack: why, and the ids of its damaged blob copies (none when
/// only the pack as a whole is wrong: its name or its trailer).
#[derive(Debug, Clone, Default)]
pub struct DamagedCopies {
    pub why: String,
    pub time: String,
    pub blobs: HashSet<Digest>,
}

/// The union of every damage record in a repository.
#[derive(Debug, Clone, Default)]
pub struct DamageSet {
    pub packs: HashMap<Digest, DamagedCopies>,
    /// The record objects it was read from (`damage/ID`).
    pub objects: Vec<String>,
    /// The ids those objects list, each as often as listed (more than the ids in `packs`
    /// where several objects list one).
    pub listed: usize,
}

impl DamageSet {
    pub fn is_empty(&self) -> bool {
        self.packs.is_empty()
    }

    /// Whether the copy of blob `id` in `pack` is recorded damaged.
    pub fn is_damaged(&self, pack: &Digest, id: &Digest) -> bool {
        self.packs.get(pack).is_some_and(|p| p.blobs.contains(id))
    }

    /// [`is_damaged`](Self::is_damaged) with the blob's id computed by `id` only where
    /// `pack` has a record: in an encrypted repository the id is an HMAC, too dear to
    /// compute for every chunk of a base when (as nearly always) nothing is damaged.
    pub fn is_damaged_with(&self, pack: &Digest, id: impl FnOnce() -> Digest) -> bool {
        self.packs.get(pack).is_some_and(|p| p.blobs.contains(&id()))
    }

    /// Whether `found` (a pack and the ids of its damaged copies) is recorded already.
    pub fn covers(&self, pack: &Digest, found: &[Digest]) -> bool {
        self.packs.get(pack).is_some_and(|p| found.iter().all(|b| p.blobs.contains(b)))
    }

    fn add(&mut self, r: &DamageRecord) {
        for p in &r.packs {
            self.listed += p.blobs.len();
            let Some(pack) = format::parse_digest(&p.pack) else { continue };
            let e = self.packs.entry(pack).or_insert_with(|| DamagedCopies {
                why: p.why.clone(),
                time: r.time.clone(),
                blobs: HashSet::new(),
            });
            e.blobs.extend(p.blobs.iter().filter_map(|b| format::parse_digest(b)));
        }
    }

    /// The record of the packs for which `keep` holds, as stored.
    #[cfg(test)]
    fn record_of(&self, keep: impl Fn(&Digest) -> bool) -> Vec<DamagedPack> {
        let mut packs: Vec<(&Digest, &DamagedCopies)> = self.packs.iter().filter(|(p, _)| keep(p)).collect();
        packs.sort_by_key(|(p, _)| **p);
        packs
            .into_iter()
            .map(|(p, c)| {
                let mut blobs: Vec<String> = c.blobs.iter().map(|b| format::hex(b)).collect();
                blobs.sort();
                DamagedPack { pack: format::hex(p), why: c.why.clone(), blobs }
            })
            .collect()
    }
}

impl Repository {
    /// Reads and checks one damage record (`damage/ID`).
    fn read_damage_object(&self, object: &str) -> Result<DamageRecord> {
        let json = self.read_named(object, "damage/", format::MAX_DAMAGE, AAD_DAMAGE)?;
        DamageRecord::parse(&json).map_err(|e| Error::damaged(object, e.0))
    }

    /// The names of the damage objects, sorted.
    fn damage_names(&self) -> Result<Vec<String>> {
        let names = self
            .store
            .list("damage/")
            .map_err(|e| Error::store(format!("cannot list the damage records of {}", self.store.describe()), e))?;
        let mut names: Vec<String> = names.into_iter().map(|(n, _)| n).collect();
        names.sort();
        Ok(names)
    }

    /// Whether `object` is missing from the store now.
    fn vanished(&self, object: &str) -> bool {
        self.store.len(object).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
    }

    /// Every damage record that reads well, merged, and those that do not with why.
    ///
    /// An object that vanishes between the listing and its read was removed by a rewrite
    /// of the records (verify's, gc's), which stores the new objects before it removes
    /// the old: the records are listed again and the objects not read yet are read, until
    /// none vanishes (at most [`DAMAGE_ROUNDS`] listings). Only an object still listed and
    /// unreadable, or one that still vanishes after the last round, is a failure.
    pub(crate) fn damage_lenient(&self) -> Result<(DamageSet, Failures)> {
        let mut names = self.damage_names()?;
        let mut set = DamageSet::default();
        let mut bad = Vec::new();
        // The objects read, well or not (a vanished one is not: listed again, it is read again).
        let mut read = HashSet::new();
        for round in 1.. {
            let mut vanished = Vec::new();
            // Read a few objects at a time and merged into the set as they come: what is held
            // besides the set is a batch's parsed records, not every object's.
            for batch in names.chunks(FETCH_THREADS) {
                for (name, r) in batch.iter().zip(par_map(batch, FETCH_THREADS, |n| self.read_damage_object(n))) {
                    match r {
                        Ok(r) => {
                            set.add(&r);
                            set.objects.push(name.clone());
                            read.insert(name.clone());
                        }
                        Err(e @ Error::Store { .. }) => return Err(e),
                        Err(e) if self.vanished(name) => vanished.push((name.clone(), e)),
                        Err(e) => {
                            bad.push((name.clone(), e));
                            read.insert(name.clone());
                        }
                    }
                }
            }
            if vanished.is_empty() {
                break;
            }
            if round == DAMAGE_ROUNDS {
                bad.extend(vanished);
                break;
            }
            names = self.damage_names()?.into_iter().filter(|n| !read.contains(n)).collect();
        }
        Ok((set, bad))
    }

    /// The damage records, for readers and backups: one that cannot be read is skipped
    /// with a warning (what it recorded is then read, and deduplicated against, as
    /// before it was found; `ferry repo repair` removes it, `ferry repo verify` finds the
    /// damage again).
    pub fn damage(&self) -> Result<DamageSet> {
        let (set, bad) = self.damage_lenient()?;
        for (name, e) in bad {
            log::warn!("skipping {name}: {e}; run `ferry repo repair`, then `ferry repo verify`");
        }
        Ok(set)
    }

    /// Stores one damage object of `packs` (at most [`format::MAX_DAMAGE`] bytes); its name.
    pub(crate) fn put_damage(&self, packs: Vec<DamagedPack>) -> Result<String> {
        let record =
            DamageRecord { version: format::VERSION, time: crate::repo::now_seconds(), host: hostname(), packs };
        let sealed = self.crypto.seal(AAD_DAMAGE, &record.to_bytes());
        if sealed.len() as u64 > format::MAX_DAMAGE {
            return Err(Error::Invalid(format!(
                "the damage record would be {} bytes, more than the {} one may have",
                sealed.len(),
                format::MAX_DAMAGE
            )));
        }
        let name = format!("damage/{}", format::hex(&crate::repo::sha256(&sealed)));
        self.store
            .put(&name, &sealed)
            .map_err(|e| Error::store(format!("cannot store {name} in {}", self.store.describe()), e))?;
        Ok(name)
    }
}

/// JSON bytes of one damage object that ferry writes at most (FORMAT.md §7b): a record
/// larger than this is split over several objects, each a record of its own, so that
/// each stays well below [`format::MAX_DAMAGE`] however much damage there is. A few KiB
/// in the crate's tests, so that a test with a few hundred damaged blobs splits.
#[cfg(not(test))]
pub(crate) const DAMAGE_PART_BYTES: usize = 8 << 20;
#[cfg(test)]
pub(crate) const DAMAGE_PART_BYTES: usize = 4 << 10;
/// [`DAMAGE_PART_BYTES`] as ferry ships it (for the tests that use it).
#[cfg(test)]
pub(crate) const DAMAGE_PART_BYTES_SHIPPED: usize = 8 << 20;

/// How many times the damage records are listed at most while objects vanish under the
/// reader (each rewrite that runs meanwhile can make one more listing needed).
const DAMAGE_ROUNDS: usize = 8;

/// What a record's JSON takes besides its packs (version, time, host), at most.
const RECORD_COST: usize = 512;
/// What a pack's entry takes besides its reason and ids (its id, the keys), at most.
const PACK_COST: usize = 128;
/// What one blob id takes in a pack's list: 64 hex digits, quotes and a comma.
const ID_COST: usize = 67;

/// Writes damage records one part at a time: packs, each followed by its damaged blob
/// ids, as they come (in order); a part is stored once the next entry would take it past
/// its size, and a pack whose ids do not fit one part goes on in the next (the same pack
/// and reason in each). Holds one part at most.
pub(crate) struct PartWriter<'a> {
    repo: &'a Repository,
    max: usize,
    packs: Vec<DamagedPack>,
    bytes: usize,
    names: Vec<String>,
    /// The ids held in the part now, and the most held at once.
    ids: usize,
    pub(crate) most: usize,
}

impl<'a> PartWriter<'a> {
    pub(crate) fn new(repo: &'a Repository, max: usize) -> PartWriter<'a> {
        PartWriter { repo, max, packs: Vec::new(), bytes: RECORD_COST, names: Vec::new(), ids: 0, most: 0 }
    }

    /// The JSON bytes of a pack's entry with no ids.
    fn pack_cost(why: &str) -> usize {
        PACK_COST + serde_json::to_string(why).map_or(6 * why.len() + 2, |s| s.len())
    }

    /// Starts pack `pack`'s entry (found damaged for `why`): the ids given next are its.
    pub(crate) fn pack(&mut self, pack: &Digest, why: &str) -> Result<()> {
        let cost = Self::pack_cost(why);
        if !self.packs.is_empty() && self.bytes + cost > self.max {
            self.flush()?;
        }
        self.packs.push(DamagedPack { pack: format::hex(pack), why: why.to_string(), blobs: Vec::new() });
        self.bytes += cost;
        Ok(())
    }

    /// Adds a damaged blob id to the pack started last.
    pub(crate) fn blob(&mut self, id: &Digest) -> Result<()> {
        let Some(last) = self.packs.last() else {
            return Err(Error::Invalid("a damaged blob id given before its pack".into()));
        };
        if self.bytes + ID_COST > self.max || last.blobs.len() >= format::MAX_TRAILER_ENTRIES as usize {
            let (pack, why) = (last.pack.clone(), last.why.clone());
            // An entry with no id yet moves to the next part whole: an empty list would
            // say that only the pack as a whole is damaged.
            if last.blobs.is_empty() {
                self.packs.pop();
            }
            if !self.packs.is_empty() {
                self.flush()?;
            }
            self.bytes = RECORD_COST + Self::pack_cost(&why);
            self.packs.push(DamagedPack { pack, why, blobs: Vec::new() });
        }
        if let Some(last) = self.packs.last_mut() {
            last.blobs.push(format::hex(id));
        }
        self.bytes += ID_COST;
        self.ids += 1;
        self.most = self.most.max(self.ids);
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let packs = std::mem::take(&mut self.packs);
        self.bytes = RECORD_COST;
        self.ids = 0;
        self.names.push(self.repo.put_damage(packs)?);
        Ok(())
    }

    /// Stores what is left; the names of every part stored.
    pub(crate) fn finish(mut self) -> Result<Vec<String>> {
        if !self.packs.is_empty() {
            self.flush()?;
        }
        Ok(self.names)
    }
}

/// A damaged copy as verify sorts them on disk: the pack's id, then the blob's.
pub(crate) const FOUND: usize = 64;

/// The record of the damaged copy of blob `id` in `pack`, sorted by pack, then id.
pub(crate) fn found_record(pack: &Digest, id: &Digest) -> [u8; FOUND] {
    let mut r = [0u8; FOUND];
    r[..32].copy_from_slice(pack);
    r[32..].copy_from_slice(id);
    r
}

/// The pack and blob id of a [`found_record`].
pub(crate) fn found_of(r: &[u8; FOUND]) -> (Digest, Digest) {
    let mut pack = [0u8; 32];
    let mut id = [0u8; 32];
    pack.copy_from_slice(&r[..32]);
    id.copy_from_slice(&r[32..]);
    (pack, id)
}

/// How [`write_merged`] writes the ids of the packs verify found damaged.
#[derive(Clone, Copy)]
enum Merge<'a> {
    /// Only what is found, as is (gc's rewrite: nothing found).
    Plain,
    /// Added in objects of their own: only the ids that `known` (the records verify
    /// compared with) does not list; a pack it lists with no such id is left out (its
    /// record is out of date only: a rewrite corrects it).
    New { known: &'a DamageSet },
    /// Every record rewritten: each pack's ids found, with those of its entry in `kept`
    /// (the records as they are now) that `known` did not list where its record was out of
    /// date (`stale`: recorded meanwhile, by another verify), or all of them elsewhere
    /// (verify then gives only the ids its record does not list yet).
    Rewrite { known: &'a DamageSet, stale: &'a HashSet<Digest> },
}

/// Writes, in pack order, the packs of `kept` (their ids as held) and those of `found`
/// (sorted by pack, each with why; their ids read from `ids`, records sorted by pack and
/// id, of those packs only), a pack of `found` taking the place of its entry in `kept`,
/// its ids merged as `how` says.
fn write_merged(
    w: &mut PartWriter,
    kept: &DamageSet,
    found: &[(Digest, String)],
    mut ids: Option<&mut Sorted<FOUND>>,
    how: Merge,
) -> Result<()> {
    let ours: HashSet<&Digest> = found.iter().map(|(p, _)| p).collect();
    let mut old: Vec<(&Digest, &DamagedCopies)> = kept.packs.iter().filter(|(p, _)| !ours.contains(p)).collect();
    old.sort_by_key(|(p, _)| **p);
    let mut read = || -> Result<Option<(Digest, Digest)>> {
        Ok(match ids.as_mut() {
            Some(s) => s.next()?.map(|r| found_of(&r)),
            None => None,
        })
    };
    let mut next = read()?;
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < found.len() {
        if j >= found.len() || (i < old.len() && *old[i].0 < found[j].0) {
            let (pack, c) = old[i];
            w.pack(pack, &c.why)?;
            let mut blobs: Vec<&Digest> = c.blobs.iter().collect();
            blobs.sort_unstable();
            for b in blobs {
                w.blob(b)?;
            }
            i += 1;
            continue;
        }
        let (pack, why) = &found[j];
        // The ids of its entry now that are written beside those found, sorted.
        let mut also: Vec<&Digest> = match (how, kept.packs.get(pack)) {
            (Merge::Rewrite { known, stale }, Some(c)) => {
                c.blobs.iter().filter(|b| !stale.contains(pack) || !known.is_damaged(pack, b)).collect()
            }
            _ => Vec::new(),
        };
        also.sort_unstable();
        let mut also = also.into_iter().peekable();
        let skip = |id: &Digest| matches!(how, Merge::New { known } if known.is_damaged(pack, id));
        // A pack `known` lists is written only with an id it does not list (Merge::New).
        let mut started = !matches!(how, Merge::New { known } if known.packs.contains_key(pack));
        if started {
            w.pack(pack, why)?;
        }
        let emit = |w: &mut PartWriter, id: &Digest, started: &mut bool| -> Result<()> {
            if !*started {
                w.pack(pack, why)?;
                *started = true;
            }
            w.blob(id)
        };
        loop {
            let from_found = match next {
                Some((p, id)) if p == *pack => Some(id),
                Some((p, _)) if p < *pack => {
                    next = read()?;
                    continue;
                }
                _ => None,
            };
            let take_found = match (from_found, also.peek()) {
                (None, None) => break,
                (Some(id), a) => a.is_none_or(|a| id <= **a),
                (None, Some(_)) => false,
            };
            if let Some(id) = from_found.filter(|_| take_found) {
                if also.peek().is_some_and(|a| **a == id) {
                    also.next();
                }
                if !skip(&id) {
                    emit(w, &id, &mut started)?;
                }
                next = read()?;
            } else if let Some(a) = also.next() {
                emit(w, a, &mut started)?;
            }
        }
        j += 1;
    }
    Ok(())
}

/// Stores what verify found in the packs it read: `found` (sorted by pack, with why)
/// and their damaged copies' ids in `ids` (records sorted by pack and id), against
/// `known`, the records as verify read them. Where `stale` is not empty (recorded packs
/// that read otherwise now), every record is rewritten under a `forget` lock (no gc
/// rewrites them meanwhile), read again: the packs of `cleared` (those that read back
/// whole now) and of `stale` lose what `known` recorded of them, those of `confirmed`
/// (their record up to date when `known` was read) keep all it recorded of them, `found`
/// is added, what was recorded since `known` was read is kept, and the old objects are removed once the
/// new ones are stored; else, or where the lock or the records cannot be had (the error
/// is given back beside the names), what `known` does not list yet is added in objects of
/// its own: what was found is recorded either way. The names stored, and the error that
/// kept the records from being corrected (none: they were, or needed no correction),
/// and the most ids it held at once (a part's).
pub(crate) fn store_found(
    repo: &Repository,
    found: &[(Digest, String)],
    ids: &mut Sorted<FOUND>,
    known: &DamageSet,
    (stale, cleared, confirmed): (&HashSet<Digest>, &[Digest], &[Digest]),
) -> Result<(Vec<String>, Option<Error>, usize)> {
    let mut w = PartWriter::new(repo, DAMAGE_PART_BYTES);
    let held = match stale.is_empty() {
        true => None,
        false => match lock::acquire(&repo.store, LockKind::Forget, None, None) {
            Ok(lock) => Some(repo.damage_lenient().map(|(set, _)| (lock, set))),
            Err(e) => Some(Err(e)),
        },
    };
    let (_lock, mut set) = match held {
        Some(Ok(held)) => held,
        not => {
            write_merged(&mut w, &DamageSet::default(), found, Some(ids), Merge::New { known })?;
            let most = w.most;
            return Ok((w.finish()?, not.and_then(|r| r.err()), most));
        }
    };
    // A mended pack keeps only what was recorded of it since verify read the records.
    for pack in cleared {
        if let Some(c) = set.packs.get_mut(pack) {
            c.blobs.retain(|b| !known.is_damaged(pack, b));
            if c.blobs.is_empty() {
                set.packs.remove(pack);
            }
        }
    }
    // A pack whose record was up to date when verify read it had every id it listed found
    // damaged again: kept even if another verify removed them meanwhile.
    for pack in confirmed {
        if let Some(k) = known.packs.get(pack) {
            let c = set.packs.entry(*pack).or_insert_with(|| DamagedCopies {
                why: k.why.clone(),
                time: k.time.clone(),
                blobs: HashSet::new(),
            });
            c.blobs.extend(k.blobs.iter().copied());
        }
    }
    write_merged(&mut w, &set, found, Some(ids), Merge::Rewrite { known, stale })?;
    let most = w.most;
    let names = w.finish()?;
    // The new records are stored: a failure to remove the old leaves their union, which
    // records every copy (and maybe some mended since): not corrected, nothing lost.
    let not_corrected = remove_others(repo, &set.objects, &names).err();
    Ok((names, not_corrected, most))
}

/// The pack a store name `data/HH/HEX` names.
pub(crate) fn pack_id(name: &str) -> Option<Digest> {
    format::parse_digest(name.rsplit('/').next()?)
}

/// The index of `objects`, every recorded-damaged copy listed after the blob's other
/// copies: readers then use a good copy wherever there is one, and a damaged copy only
/// as the last (its digest is checked when it is read). Only the blobs named by a record
/// are touched, so a blob keeps its one location in the common case.
pub(crate) fn prefer_good(objects: Vec<IndexObject>, damage: &DamageSet) -> Index {
    let mut index = build_index(objects);
    for id in damaged_ids(damage) {
        let (bad, good): (Vec<Location>, Vec<Location>) =
            index.locations(id).copied().partition(|l| damage.is_damaged(&l.pack, id));
        if !bad.is_empty() && !good.is_empty() {
            set_locations(&mut index, id, good.into_iter().chain(bad).collect());
        }
    }
    index
}

/// The blobs some record names (each once).
fn damaged_ids(damage: &DamageSet) -> HashSet<&Digest> {
    damage.packs.values().flat_map(|c| c.blobs.iter()).collect()
}

/// Sets `id`'s locations to `locs`, the first first (none: `id` leaves the index).
fn set_locations(index: &mut Index, id: &Digest, locs: Vec<Location>) {
    let mut locs = locs.into_iter();
    match locs.next() {
        None => {
            index.blobs.remove(id);
            index.more.remove(id);
        }
        Some(first) => {
            index.blobs.insert(*id, first);
            let rest: Vec<Location> = locs.collect();
            if rest.is_empty() {
                index.more.remove(id);
            } else {
                index.more.insert(*id, rest);
            }
        }
    }
}

/// Drops from a backup's index every copy recorded damaged (a blob keeps its good
/// copies): the backup stores again, where it reads it, what has no good copy, instead
/// of pointing at a damaged one. The number of blobs left with no copy. (Backups see
/// the index through the cache instead: `RunIndex::without_damaged`; this is the
/// in-memory reference its tests compare with.)
#[cfg(test)]
pub(crate) fn exclude_damaged(index: &mut Index, damage: &DamageSet) -> usize {
    let mut gone = 0;
    for id in damaged_ids(damage) {
        let locs: Vec<Location> = index.locations(id).copied().collect();
        if locs.is_empty() || !locs.iter().any(|l| damage.is_damaged(&l.pack, id)) {
            continue;
        }
        let good: Vec<Location> = locs.into_iter().filter(|l| !damage.is_damaged(&l.pack, id)).collect();
        gone += usize::from(good.is_empty());
        set_locations(index, id, good);
    }
    gone
}

/// After a gc: the records of packs that are gone are dropped, and records that take
/// clearly more objects than their union needs are merged ([`scattered`]): a new record
/// of the rest is stored before the old ones are removed. `present`: the packs still in
/// the store. The number of record objects removed.
pub(crate) fn prune_records(repo: &Repository, damage: &DamageSet, present: &HashSet<Digest>) -> Result<usize> {
    if damage.objects.is_empty() || (damage.packs.keys().all(|p| present.contains(p)) && !scattered(damage)) {
        return Ok(0);
    }
    let mut rest = damage.clone();
    rest.packs.retain(|p, _| present.contains(p));
    store_set(repo, &rest)
}

/// Whether the records hold clearly more than their union needs: an id listed by more
/// than one object, or more objects than the union's parts and one (verifies that each
/// add a little damage store an object each).
fn scattered(damage: &DamageSet) -> bool {
    let ids: usize = damage.packs.values().map(|c| c.blobs.len()).sum();
    let bytes: usize = damage.packs.values().map(|c| PartWriter::pack_cost(&c.why)).sum::<usize>() + ids * ID_COST;
    damage.listed > ids || damage.objects.len() > bytes.div_ceil(DAMAGE_PART_BYTES - RECORD_COST) + 1
}

/// Stores `set` as records (none when it is empty; several objects where it needs
/// them), then removes the records it was read from; the number removed.
fn store_set(repo: &Repository, set: &DamageSet) -> Result<usize> {
    store_set_named(repo, set).map(|(removed, _)| removed)
}

/// [`store_set`], with the names of the records stored.
fn store_set_named(repo: &Repository, set: &DamageSet) -> Result<(usize, Vec<String>)> {
    let mut w = PartWriter::new(repo, DAMAGE_PART_BYTES);
    write_merged(&mut w, set, &[], None, Merge::Plain)?;
    let new = w.finish()?;
    let removed = remove_others(repo, &set.objects, &new)?;
    Ok((removed, new))
}

/// Removes the record objects `old` but those in `new`; the number removed.
fn remove_others(repo: &Repository, old: &[String], new: &[String]) -> Result<usize> {
    let mut removed = 0;
    for name in old.iter().filter(|n| !new.contains(n)) {
        match repo.store.delete(name) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::store(format!("cannot remove {name} from {}", repo.store.describe()), e))
            }
            _ => removed += 1,
        }
    }
    Ok(removed)
}

/// Adds copies found damaged (pack, blob id, why) to `set` and stores it (by a caller
/// that holds the gc lock, so that no other writer rewrites the records meanwhile);
/// `set` then names the records stored.
pub(crate) fn record_found(repo: &Repository, set: &mut DamageSet, found: Vec<(Digest, Digest, String)>) -> Result<()> {
    let time = crate::repo::now_seconds();
    for (pack, id, why) in found {
        let e =
            set.packs.entry(pack).or_insert_with(|| DamagedCopies { why, time: time.clone(), blobs: HashSet::new() });
        e.blobs.insert(id);
    }
    let (_, new) = store_set_named(repo, set)?;
    set.objects = new;
    set.listed = set.packs.values().map(|c| c.blobs.len()).sum();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{BlobEntry, BlobKind, PackBlobs};

    fn entry(id: u8, offset: u32) -> BlobEntry {
        BlobEntry { id: [id; 32], kind: BlobKind::Data, offset, stored_len: 10, plain_len: 9 }
    }

    fn record(pack: u8, blobs: &[u8]) -> DamageRecord {
        DamageRecord {
            version: format::VERSION,
            time: "2026-11-28T09:00:00Z".into(),
            host: "h".into(),
            packs: vec![DamagedPack {
                pack: format::hex(&[pack; 32]),
                why: "flipped".into(),
                blobs: blobs.iter().map(|b| format::hex(&[*b; 32])).collect(),
            }],
        }
    }

    /// The id is computed only for a pack with a record.
    #[test]
    fn is_damaged_with_computes_the_id_only_for_recorded_packs() {
        let mut set = DamageSet::default();
        set.add(&record(0xaa, &[1]));
        let calls = std::cell::Cell::new(0);
        let id = |b: u8| {
            calls.set(calls.get() + 1);
            [b; 32]
        };
        assert!(!set.is_damaged_with(&[0xbb; 32], || id(1)));
        assert!(!DamageSet::default().is_damaged_with(&[0xaa; 32], || id(1)));
        assert_eq!(calls.get(), 0);
        assert!(set.is_damaged_with(&[0xaa; 32], || id(1)));
        assert!(!set.is_damaged_with(&[0xaa; 32], || id(2)));
        assert_eq!(calls.get(), 2);
    }

    /// Blob 1 is in damaged pack A (listed first) and in good pack B; blob 2 only in A,
    /// damaged; blob 3 only in A, not damaged.
    #[test]
    fn good_copies_first_and_damaged_ones_out_of_dedup() {
        let (a, b) = ([0xaa; 32], [0xbb; 32]);
        let objects = || {
            vec![
                (
                    "index/1".to_string(),
                    vec![PackBlobs { pack: a, blobs: vec![entry(1, 0), entry(2, 10), entry(3, 20)] }],
                ),
                ("index/2".to_string(), vec![PackBlobs { pack: b, blobs: vec![entry(1, 0)] }]),
            ]
        };
        let mut set = DamageSet::default();
        set.add(&record(0xaa, &[1, 2]));
        assert!(set.is_damaged(&a, &[1; 32]) && !set.is_damaged(&b, &[1; 32]) && !set.is_damaged(&a, &[3; 32]));
        assert!(set.covers(&a, &[[2; 32]]) && !set.covers(&a, &[[3; 32]]) && !set.covers(&b, &[]));
        // Without records the first copy is read; with them, the good one.
        assert_eq!(build_index(objects()).blobs[&[1; 32]].pack, a);
        let mut index = prefer_good(objects(), &set);
        assert_eq!(index.blobs[&[1; 32]].pack, b);
        let packs = |index: &Index, id: u8| index.locations(&[id; 32]).map(|l| l.pack).collect::<Vec<_>>();
        assert_eq!(packs(&index, 1), vec![b, a], "the damaged copy is kept, after the good one");
        assert_eq!(index.blobs[&[2; 32]].pack, a, "the damaged copy stays as the last resort");
        assert!(index.more.len() == 1 && !index.more.contains_key(&[3; 32]), "one location for the others");
        assert_eq!(index.objects.len(), 2);
        assert_eq!(exclude_damaged(&mut index, &set), 1);
        assert!(!index.blobs.contains_key(&[2; 32]));
        assert_eq!(index.blobs[&[3; 32]].pack, a);
        assert_eq!(packs(&index, 1), vec![b], "a backup never deduplicates against the damaged copy");
        assert!(index.more.is_empty());
        // A record kept for the packs that stay, sorted.
        let rest = set.record_of(|p| *p == a);
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].blobs, vec![format::hex(&[1; 32]), format::hex(&[2; 32])]);
        assert!(set.record_of(|p| *p == b).is_empty());
    }
}
