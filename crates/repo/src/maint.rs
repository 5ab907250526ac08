//! Repository maintenance: check, verify, forget, gc, stats.
use crate::damage::{found_of, found_record, pack_id, prefer_good, prune_records, DamageSet, DamagedCopies, FOUND};
use crate::format::{self, BlobEntry, Digest, LockKind, PackBlobs, Pages, ZERO};
use crate::locations::{hint_record, use_record, Loc, Locations, HINT, USE};
use crate::repo::{
    pack_name, par_map, parse_time, sha256, BlkHasher, ByteBudget, Index, Repository, SnapshotInfo, AAD_TRAILER,
    FETCH_THREADS,
};
use crate::spill::{Sorted, Sorter, Table};
use crate::table::BlobTable;
use crate::{lock, Error, Result};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

/// A problem found by check or verify, with the snapshots and ranges it hits.
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    /// The damaged object (a pack, an index object, a manifest).
    pub object: String,
    pub why: String,
    /// (snapshot id, disk name, byte offset, length) of every range that reads damaged data
    /// (the first [`RANGES_KEPT`] of each snapshot).
    pub hits: Vec<(String, String, u64, u64)>,
    /// (snapshot id, disk name, ranges, bytes) of the ranges past those in `hits`, only
    /// counted: memory stays bounded however scattered the damage is.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub more_hits: Vec<(String, String, u64, u64)>,
}

/// Ranges of one snapshot listed in a problem's hits; past them they are only counted.
pub const RANGES_KEPT: usize = 1024;

/// What check and verify hold of the damage they find, so that their memory stays
/// bounded however much there is.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Held {
    /// Damaged or missing chunks held (by id, with their problem) to find the snapshots
    /// that read them: past these, they are counted, and said to be.
    pub(crate) chunks: usize,
    /// Ranges of one snapshot listed in a problem's hits ([`RANGES_KEPT`]).
    pub(crate) ranges: usize,
}

/// 256k chunks (about 16 MB) and [`RANGES_KEPT`] ranges.
pub(crate) const DAMAGE_HELD: Held = Held { chunks: 1 << 18, ranges: RANGES_KEPT };

#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub snapshots: usize,
    pub packs: usize,
    pub blobs_checked: u64,
    pub bytes_read: u64,
    /// Verify: the packs read, of those present, and the bytes of those present.
    pub packs_read: usize,
    pub bytes_present: u64,
    pub problems: Vec<Problem>,
    /// Things that are not damage (orphans, stale locks), said once each.
    pub notes: Vec<String>,
    /// The most damaged ids held in memory at once outside the sorters (the chunks traced,
    /// at most what [`Held`] says; a pack's in flight; a damage object's part), and what
    /// verify's sorters of damaged copies wrote to their files.
    #[serde(skip)]
    pub(crate) ids_held: usize,
    #[serde(skip)]
    pub(crate) damage_spilled: crate::spill::Written,
}

impl Report {
    fn problem(&mut self, object: impl Into<String>, why: impl Into<String>) -> usize {
        self.problems.push(Problem { object: object.into(), why: why.into(), hits: Vec::new(), more_hits: Vec::new() });
        self.problems.len() - 1
    }

    /// A problem of `object`, added to the one found for it already if there is one
    /// (verify reading a pack that check's walk named: one entry per object). `by_object`:
    /// the problems' objects, kept by the caller (a lookup a pack, not a scan).
    fn problem_once(&mut self, by_object: &mut HashMap<String, usize>, object: String, why: String) -> usize {
        match by_object.get(&object) {
            Some(&i) => {
                let p = &mut self.problems[i];
                if !p.why.contains(&why) {
                    p.why = format!("{}; {why}", p.why);
                }
                i
            }
            None => {
                let i = self.problem(object.clone(), why);
                by_object.insert(object, i);
                i
            }
        }
    }
}

/// What check learned, for verify to go on from.
pub(crate) struct Walk {
    snaps: Vec<SnapshotInfo>,
    /// Each snapshot's page digests.
    snap_pages: Vec<Arc<Pages>>,
    /// Every location the index objects list, in a table on disk.
    locs: Locations,
    /// The index of the page blobs alone: what pages are read through.
    pages_index: Index,
    /// `data/` as listed: name to length.
    listed: HashMap<String, u64>,
    /// Damaged or missing blob ids, with the problem each belongs to: at most `held`.
    damaged: HashMap<Digest, usize>,
    held: Held,
    /// Damaged or missing blobs not in `damaged` (past `held`): not traced to snapshots.
    untraced: Untraced,
    /// The damage records (FORMAT.md §7b).
    damage: DamageSet,
    /// The problems made of recorded damage: those that no snapshot reads become notes.
    recorded: Vec<usize>,
    /// Page reads made (each distinct page once, unless a page recurs at other positions
    /// after the cache let it go).
    pub(crate) page_reads: u64,
    /// What the sorters wrote to their files.
    pub(crate) spilled: Spilled,
}

/// What check's and verify's sorters wrote to their files, per sorter.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Spilled {
    /// The locations by id.
    pub(crate) locations: crate::spill::Written,
    /// The chunks the pages use.
    pub(crate) uses: crate::spill::Written,
    /// The pages' chunk hints.
    pub(crate) hints: crate::spill::Written,
}

impl Walk {
    /// Blob `id` is damaged or missing, a part of problem `p`: held to be traced to the
    /// snapshots that read it, while fewer than `held` are; else counted.
    fn mark_damaged(&mut self, id: Digest, p: usize) -> Result<()> {
        mark_damaged(&mut self.damaged, &mut self.untraced, self.held.chunks, id, p)
    }
}

/// The damaged or missing chunks that were counted, not traced to snapshots (past what is
/// held), and the problems they belong to: a problem with one of them may be read by a
/// snapshot though none was found to (so recorded damage is never said to be unread).
/// Their ids go to a sorter (to a file past its budget), so that each chunk is counted
/// once however many of its copies are damaged or problems name it.
struct Untraced {
    ids: Sorter<32>,
    problems: HashSet<usize>,
}

impl Untraced {
    fn new(locs: &Locations) -> Untraced {
        let ids = locs.sorter::<32>("the damaged chunks not traced to snapshots").once_per_key(32);
        Untraced { ids, problems: HashSet::new() }
    }

    /// Chunk `id`, of problem `p` where it has one that a recorded damage may clear.
    fn add(&mut self, id: Digest, p: Option<usize>) -> Result<()> {
        self.ids.push(id)?;
        self.problems.extend(p);
        Ok(())
    }

    /// How many distinct chunks were counted.
    fn count(self) -> Result<u64> {
        let mut ids = self.ids.finish()?;
        let mut n = 0u64;
        while ids.next()?.is_some() {
            n += 1;
        }
        Ok(n)
    }
}

/// [`Walk::mark_damaged`] on its fields (for callers that hold others borrowed).
fn mark_damaged(
    damaged: &mut HashMap<Digest, usize>,
    untraced: &mut Untraced,
    held: usize,
    id: Digest,
    p: usize,
) -> Result<()> {
    if damaged.len() < held || damaged.contains_key(&id) {
        damaged.insert(id, p);
        Ok(())
    } else {
        untraced.add(id, Some(p))
    }
}

/// The note that says how many damaged chunks were not traced to snapshots (each chunk
/// once, however many of its copies are damaged).
fn untraced_note(r: &mut Report, w: Walk) -> Result<()> {
    let held = w.held.chunks;
    let n = w.untraced.count()?;
    if n > 0 {
        r.notes.push(format!(
            "{n} more damaged or missing chunk(s) (distinct chunks, not copies) were counted but not traced to the \
             snapshots that read them (the first {held} were, to keep memory bounded): the snapshots listed may not \
             be all that are affected; run check again once the damage above is repaired"
        ));
    }
    Ok(())
}

impl Spilled {
    /// Runs written by them all.
    #[cfg(test)]
    pub(crate) fn runs(&self) -> u64 {
        self.locations.runs + self.uses.runs + self.hints.runs
    }
}

/// Each snapshot's page digests: those it holds (listed with them), else its manifest read
/// again ([`FETCH_THREADS`] at a time).
fn snapshot_pages(repo: &Repository, snaps: &[SnapshotInfo]) -> Result<Vec<Arc<Pages>>> {
    par_map(snaps, FETCH_THREADS, |s| repo.pages(s)).into_iter().collect()
}

/// The distinct non-zero page digests of snapshots' `pages` that `keep` accepts, sorted.
/// Memory: a set of the distinct pages, however many snapshots share them.
fn distinct_pages(pages: &[Arc<Pages>], keep: impl Fn(&Digest) -> bool) -> Vec<Digest> {
    let mut seen: HashSet<Digest> = HashSet::new();
    for p in pages {
        seen.extend(p.nonzero().iter().copied());
    }
    let mut want: Vec<Digest> = seen.into_iter().filter(|d| keep(d)).collect();
    want.sort_unstable();
    want
}

/// Pages read this many at a time (in parallel), so that a bounded number of them is
/// held, not all.
const PAGE_BATCH: usize = 64;

/// gc stops reading pages once this many could not be read (it stops anyway): what it
/// holds of them stays bounded however much of the index was lost.
const GC_FAILED_PAGES: usize = 1024;

/// `f` over each snapshot with its page digests, in order, the manifests read again (those
/// not held) [`FETCH_THREADS`] at a time: only a window of page lists is held at once
/// (gc, to name the snapshot of a page it could not read).
fn each_snapshot_pages(
    repo: &Repository,
    snaps: &[SnapshotInfo],
    mut f: impl FnMut(&SnapshotInfo, &Pages) -> Result<()>,
) -> Result<()> {
    for window in snaps.chunks(FETCH_THREADS) {
        for (s, pages) in window.iter().zip(par_map(window, FETCH_THREADS, |s| repo.pages(s))) {
            f(s, &*pages?)?;
        }
    }
    Ok(())
}

/// `f` over each of `pages`, read (any copy) a batch at a time, in the order given.
fn for_pages(
    repo: &Repository,
    index: &Index,
    pages: &[Digest],
    mut f: impl FnMut(&Digest, Result<Vec<Digest>, String>),
) {
    let _ = try_for_pages(repo, index, pages, |d, page| {
        f(d, page);
        Ok(())
    });
}

/// [`for_pages`] that stops at the first error `f` returns (no further page is read) and
/// returns it.
fn try_for_pages(
    repo: &Repository,
    index: &Index,
    pages: &[Digest],
    mut f: impl FnMut(&Digest, Result<Vec<Digest>, String>) -> Result<()>,
) -> Result<()> {
    for batch in pages.chunks(PAGE_BATCH) {
        for (d, page) in batch.iter().zip(par_map(batch, FETCH_THREADS, |d| repo.read_page(index, d))) {
            f(d, page)?;
        }
    }
    Ok(())
}

/// A located page's chunk hints (FORMAT.md §7c), as records to be joined with the
/// locations (numbered `read` once the page is read), and how many name a pack the index
/// does not list: stale (gc moved or dropped the copy), or never true.
fn page_hints(repo: &Repository, locs: &Locations, page: &format::LocatedPage) -> (Vec<[u8; HINT]>, u64) {
    let mut out = Vec::new();
    let mut unknown = 0;
    for (i, at) in (0..page.entries.len()).filter_map(|i| Some((i, page.at(i)?))) {
        match locs.pack_number(&at.pack) {
            Some(pack) => {
                let id = repo.crypto.blob_id(&page.entries[i]);
                out.push(hint_record(&id, pack, at.offset, at.stored_len, 0, i as u32));
            }
            None => unknown += 1,
        }
    }
    (out, unknown)
}

/// The byte range chunk `ci` of a snapshot covers.
fn chunk_range(snap: &SnapshotInfo, first: u64, count: u64) -> (u64, u64) {
    let cs = snap.manifest.chunk_size as u64;
    let start = first * cs;
    let end = ((first + count) * cs).min(snap.manifest.size);
    (start, end.saturating_sub(start))
}

/// Adds to each problem the ranges of every snapshot that read one of its blobs: a
/// second pass over the pages, made only when there is damage.
fn attribute(repo: &Repository, w: &Walk, problems: &mut [Problem]) {
    if w.damaged.is_empty() {
        return;
    }
    // Per distinct page: which of its entries are damaged (computed once however many
    // snapshots share the page). A page itself damaged hits its whole range below.
    let mut page_hits: HashMap<Digest, Vec<(u64, usize)>> = HashMap::new();
    let want = distinct_pages(&w.snap_pages, |d| !w.damaged.contains_key(&repo.crypto.blob_id(d)));
    for_pages(repo, &w.pages_index, &want, |d, page| {
        if let Ok(entries) = page {
            let hits: Vec<(u64, usize)> = entries
                .iter()
                .enumerate()
                .filter(|(_, e)| **e != ZERO)
                .filter_map(|(i, e)| w.damaged.get(&repo.crypto.blob_id(e)).map(|p| (i as u64, *p)))
                .collect();
            if !hits.is_empty() {
                page_hits.insert(*d, hits);
            }
        }
    });
    for (s, sp) in w.snaps.iter().zip(&w.snap_pages) {
        let pe = s.manifest.page_entries as u64;
        let chunks = s.manifest.chunks();
        // Per problem: its open range (first chunk, count), merged as they come in order,
        // and the ranges closed: listed in its hits up to `kept`, then counted with their
        // bytes.
        let kept = w.held.ranges;
        let mut open: BTreeMap<usize, ((u64, u64), usize, u64, u64)> = BTreeMap::new();
        let close = |problems: &mut [Problem], p: usize, (first, count): (u64, u64), listed: &mut usize| {
            let (off, len) = chunk_range(s, first, count);
            if *listed < kept {
                problems[p].hits.push((s.id.clone(), s.manifest.name.clone(), off, len));
                *listed += 1;
                None
            } else {
                Some(len)
            }
        };
        let mut add = |problems: &mut [Problem], p: usize, first: u64, count: u64| {
            let (range, listed, more, more_bytes) = open.entry(p).or_insert(((first, 0), 0, 0, 0));
            if range.0 + range.1 == first {
                range.1 += count;
                return;
            }
            if let Some(len) = close(problems, p, *range, listed) {
                *more += 1;
                *more_bytes += len;
            }
            *range = (first, count);
        };
        for (i, d) in sp.iter().enumerate() {
            let d = &d;
            if *d == ZERO {
                continue;
            }
            let first = i as u64 * pe;
            let count = chunks.saturating_sub(first).min(pe);
            if let Some(p) = w.damaged.get(&repo.crypto.blob_id(d)) {
                add(problems, *p, first, count);
            } else if let Some(hits) = page_hits.get(d) {
                for (j, p) in hits {
                    add(problems, *p, first + j, 1);
                }
            }
        }
        for (p, (range, mut listed, mut more, mut more_bytes)) in open {
            if let Some(len) = close(problems, p, range, &mut listed) {
                more += 1;
                more_bytes += len;
            }
            if more > 0 {
                problems[p].more_hits.push((s.id.clone(), s.manifest.name.clone(), more, more_bytes));
            }
        }
    }
}

/// A page's entries, or why it could not be read, shared by the cache and its readers.
type PageRead = Arc<Result<Vec<Digest>, String>>;

/// Decoded pages kept for the snapshots that read them next, up to a number of entries:
/// the least recently used goes first.
struct PageCache {
    pages: HashMap<Digest, (u64, PageRead)>,
    by_use: BTreeMap<u64, Digest>,
    tick: u64,
    entries: usize,
    max_entries: usize,
}

impl PageCache {
    fn new(max_entries: usize) -> PageCache {
        PageCache { pages: HashMap::new(), by_use: BTreeMap::new(), tick: 0, entries: 0, max_entries }
    }

    fn get(&mut self, d: &Digest) -> Option<PageRead> {
        let (at, page) = self.pages.get_mut(d)?;
        self.by_use.remove(at);
        self.tick += 1;
        *at = self.tick;
        self.by_use.insert(self.tick, *d);
        Some(page.clone())
    }

    fn put(&mut self, d: Digest, page: Result<Vec<Digest>, String>) {
        let size = |p: &Result<Vec<Digest>, String>| p.as_ref().map_or(1, |v| v.len().max(1));
        self.entries += size(&page);
        self.tick += 1;
        self.by_use.insert(self.tick, d);
        if let Some((at, old)) = self.pages.insert(d, (self.tick, Arc::new(page))) {
            self.by_use.remove(&at);
            self.entries -= size(&old);
        }
        while self.entries > self.max_entries && self.pages.len() > 1 {
            let Some((_, oldest)) = self.by_use.pop_first() else { break };
            if let Some((_, p)) = self.pages.remove(&oldest) {
                self.entries -= size(&p);
            }
        }
    }
}

/// Entries of decoded pages the walk keeps (32 bytes each): 8 MiB.
const PAGE_CACHE_ENTRIES: usize = 1 << 18;

/// What the walk over its pages found of one snapshot.
struct SnapWalk {
    object: String,
    /// Its blkhash so far, while every page read well (only where it has one to check).
    hasher: Option<BlkHasher>,
    /// The problem of the chunks it uses that are in no index object.
    missing: Option<usize>,
    missing_count: u64,
}

#[cfg(test)]
pub(crate) fn check_walk(repo: &Repository) -> Result<(Report, Walk)> {
    check_walk_in(repo, crate::spill::BUDGET)
}

/// [`check_walk`] with sorters that hold up to `budget` bytes of records each in memory.
#[cfg(test)]
pub(crate) fn check_walk_in(repo: &Repository, budget: usize) -> Result<(Report, Walk)> {
    check_walk_held(repo, budget, DAMAGE_HELD)
}

/// [`check_walk_in`] holding at most what `held` says of the damage ([`DAMAGE_HELD`]).
pub(crate) fn check_walk_held(repo: &Repository, budget: usize, held: Held) -> Result<(Report, Walk)> {
    let mut r = Report::default();
    let store = &repo.store;
    let (snaps, bad_snaps) = repo.snapshots_with_pages_lenient()?;
    for (name, e) in bad_snaps {
        r.problem(name, e.reason());
    }
    r.snapshots = snaps.len();
    // Checkpoints of interrupted backups are checked as snapshots are (FORMAT.md §7a).
    let (checkpoints, bad_checkpoints) = repo.checkpoints_lenient()?;
    for (name, e) in bad_checkpoints {
        r.problem(name, format!("{}; `ferry backup` without --resume discards it", e.reason()));
    }
    for c in &checkpoints {
        r.notes.push(match c.superseded_by(&snaps) {
            Some(by) => format!(
                "{} is a leftover checkpoint of {}: its backup stored snapshot {} (nothing to resume; the next \
                 backup of {} removes it)",
                c.object,
                c.checkpoint.name,
                by.id.get(..8).unwrap_or(&by.id),
                c.checkpoint.name
            ),
            None => format!(
                "an interrupted backup of {} ({} of {} bytes stored) can be resumed (`ferry backup --resume`)",
                c.checkpoint.name,
                c.checkpoint.done_bytes(),
                c.checkpoint.size
            ),
        });
    }
    let mut snaps = snaps;
    snaps.extend(checkpoints.iter().map(|c| c.as_snapshot()));
    let (locs, page_objects, bad_index) = Locations::read(repo, budget)?;
    let mut index_damaged = !bad_index.is_empty();
    for (name, e) in bad_index {
        r.problem(
            name,
            format!(
                "{}; the blobs it alone lists are lost to the snapshots below until `ferry repo repair` rebuilds it",
                e.reason()
            ),
        );
    }
    let (damage, bad_damage) = repo.damage_lenient()?;
    for (name, e) in bad_damage {
        r.problem(name, format!("{}; `ferry repo repair` removes it (then run `ferry repo verify`)", e.reason()));
    }
    let pages_index = prefer_good(page_objects, &damage);
    let listed: HashMap<String, u64> = store
        .list("data/")
        .map_err(|e| Error::store(format!("cannot list the packs of {}", store.describe()), e))?
        .into_iter()
        .collect();
    r.packs = listed.len();
    // Packs the index names: present, and long enough.
    let mut bad_packs: HashMap<u32, usize> = HashMap::new();
    for pack in locs.packs_sorted() {
        let name = pack_name(&locs.packs[pack as usize]);
        let end = locs.end(pack);
        match listed.get(&name) {
            None => {
                bad_packs.insert(pack, r.problem(name, "it is missing from the store (the index lists its blobs)"));
            }
            Some(&len) if len < end + format::PACK_TAIL as u64 => {
                let why = format!("it is {len} bytes, shorter than its blobs in the index ({end} bytes and more)");
                bad_packs.insert(pack, r.problem(name, why));
            }
            _ => {}
        }
    }
    // A lost pack whose every blob has a good copy elsewhere (a backup stored them again)
    // loses nothing: gc drops it from the index.
    let mut untraced = Untraced::new(&locs);
    let found = index_damage(&locs, &damage, &listed, &bad_packs, (held.chunks, &mut untraced))?;
    for (pack, p) in &bad_packs {
        if !found.unhealed.contains(pack) {
            r.problems[*p].why.push_str(
                "; every blob in it has a copy in another pack, so no snapshot lost data: `ferry repo gc` drops it \
                 from the index",
            );
        }
    }
    let indexed: HashSet<String> = locs.packs.iter().map(pack_name).collect();
    let orphans = listed.keys().filter(|n| !indexed.contains(*n)).count();
    // A blob is lost only when every copy of it is in a missing or short pack (or, below,
    // recorded damaged).
    let mut damaged: HashMap<Digest, usize> = HashMap::new();
    let recorded = recorded_problems(&mut r, &damage, found.only, &listed, (&mut damaged, &mut untraced, held.chunks))?;
    for (id, pack) in &found.lost {
        mark_damaged(&mut damaged, &mut untraced, held.chunks, *id, bad_packs[pack])?;
    }
    r.ids_held = damaged.len().max(found.lost.len());
    let snap_pages = snapshot_pages(repo, &snaps)?;
    let mut walk = Walk {
        snaps: Vec::new(),
        snap_pages,
        locs,
        pages_index,
        listed,
        damaged,
        held,
        untraced,
        damage,
        recorded,
        page_reads: 0,
        spilled: Spilled::default(),
    };
    walk.spilled.locations = walk.locs.written();
    let blobs_checked = walk_pages(repo, &mut r, &mut walk, &snaps, &mut index_damaged)?;
    walk.snaps = snaps;
    r.blobs_checked = blobs_checked;
    // Packs in no index object are orphans only when the index is whole: else gc would
    // delete what may be the only copy of the chunks the index lost.
    if orphans > 0 && index_damaged {
        r.notes.push(format!(
            "{orphans} pack(s) are in no readable index object, and the index is damaged: they may hold the only \
             copy of what snapshots use; `ferry repo repair` indexes them again (gc refuses to run until then)"
        ));
    } else if orphans > 0 {
        r.notes.push(format!(
            "{orphans} pack(s) are in no index object (left by interrupted backups or gc); `ferry repo gc` removes them"
        ));
    }
    match lock::list(store) {
        Ok(locks) => {
            for (name, l, stale) in locks {
                let state = if stale { "stale" } else { "held" };
                r.notes.push(format!(
                    "{state} lock {name}: {:?} by process {} on {} since {}",
                    l.kind, l.pid, l.host, l.time
                ));
            }
        }
        Err(e) => r.notes.push(format!("cannot read the locks: {e}")),
    }
    Ok((r, walk))
}

/// Reads the pages of `snaps` and checks them: each page's entries indexed (each distinct
/// page once), each snapshot's pages whole and its blkhash theirs. The snapshots advance
/// together, page position by page position, so that the snapshots of one disk, which
/// share most pages at the same positions, read each page once while only a bounded cache
/// of decoded pages is kept; no snapshot's list of entries is kept. Problems are said in
/// the order of a walk of one snapshot after another. Returns the number of distinct
/// chunks checked.
fn walk_pages(
    repo: &Repository,
    r: &mut Report,
    w: &mut Walk,
    snaps: &[SnapshotInfo],
    index_damaged: &mut bool,
) -> Result<u64> {
    let base = r.problems.len();
    // Each problem made here: the snapshot and page position that found it.
    let mut found_at: Vec<(usize, u64)> = Vec::new();
    let mut problem = |r: &mut Report, at: (usize, u64), object: String, why: String| {
        found_at.push(at);
        r.problem(object, why)
    };
    let mut walks: Vec<Option<SnapWalk>> = Vec::with_capacity(snaps.len());
    for (si, s) in snaps.iter().enumerate() {
        let object = if s.id.contains('/') { s.id.clone() } else { format!("snapshots/{}", s.id) };
        // A manifest may describe a disk far larger than its bytes (zero pages): one whose
        // list of entries would not fit in memory is refused, as readers refuse it.
        if let Err(e) = crate::repo::entry_list(s.manifest.chunks(), &object) {
            problem(r, (si, 0), object, e.to_string());
            walks.push(None);
            continue;
        }
        let m = &s.manifest;
        let hasher = m
            .blkhash
            .as_ref()
            .filter(|_| m.chunk_size == 65536)
            .map(|_| BlkHasher::new(m.chunks(), m.size, m.chunk_size));
        walks.push(Some(SnapWalk { object, hasher, missing: None, missing_count: 0 }));
    }
    // The chunks the pages use and the places their hints name, by id, joined with the
    // locations once every page is read.
    // One record per chunk on disk, however many pages use it: the join needs only the
    // first page (position, then snapshot) that uses it, and that is the smallest record.
    let mut uses = w.locs.sorter::<USE>("check's list of the chunks the pages use").once_per_key(32);
    let mut hints = w.locs.sorter::<HINT>("check's list of the pages' chunk hints");
    let mut hint_reads = 0u32;
    let mut pages_done: HashSet<Digest> = HashSet::new();
    let mut page_problem: HashMap<Digest, usize> = HashMap::new();
    let mut cache = PageCache::new(PAGE_CACHE_ENTRIES);
    // Chunk hints that name a pack the index does not list, and the page reads (numbers,
    // as in `hints`) that have them.
    let mut unknown_hints = (0u64, HashSet::new());
    let positions = w.snap_pages.iter().map(|p| p.count()).max().unwrap_or(0) as usize;
    // Each snapshot's page digests, taken in turn as the positions advance: `at[si]` is
    // the digest of snapshot `si`'s page at the current position.
    let pages = std::mem::take(&mut w.snap_pages);
    let mut iters: Vec<_> = pages.iter().map(|p| p.iter()).collect();
    let mut at: Vec<Digest> = vec![ZERO; snaps.len()];
    // The snapshots with a page at the position, in order: each position costs what its
    // snapshots read there, however many shorter snapshots ended before it.
    let mut live: Vec<usize> = (0..snaps.len()).filter(|&si| walks[si].is_some()).collect();
    for i in 0..positions {
        live.retain(|&si| (i as u64) < pages[si].count());
        for &si in &live {
            at[si] = iters[si].next().unwrap_or(ZERO);
        }
        let digest_at = |si: usize, _i: usize| at[si];
        let mut k = 0;
        while k < live.len() {
            // The next snapshots, up to a batch of pages not in the cache, read together.
            let mut want: Vec<Digest> = Vec::new();
            let mut end = k;
            while end < live.len() && want.len() < PAGE_BATCH {
                let d = digest_at(live[end], i);
                if d != ZERO && !want.contains(&d) && cache.get(&d).is_none() {
                    want.push(d);
                }
                end += 1;
            }
            w.page_reads += want.len() as u64;
            let read = par_map(&want, FETCH_THREADS, |d| {
                let page = repo.read_page_hinted(&w.pages_index, d, None);
                let found = page.as_ref().map_or((Vec::new(), 0), |p| page_hints(repo, &w.locs, p));
                (page.map(|p| p.entries), found)
            });
            for (d, (page, (found, unknown))) in want.iter().zip(read) {
                if (unknown > 0 || !found.is_empty()) && !pages_done.contains(d) {
                    let read = hint_reads;
                    hint_reads = hint_reads
                        .checked_add(1)
                        .ok_or_else(|| Error::Invalid(format!("more than {} located pages to check", u32::MAX)))?;
                    if unknown > 0 {
                        unknown_hints.0 += unknown;
                        unknown_hints.1.insert(read);
                    }
                    for mut h in found {
                        h[44..48].copy_from_slice(&read.to_be_bytes());
                        hints.push(h)?;
                    }
                }
                cache.put(*d, page);
            }
            for &si in &live[k..end] {
                let s = &snaps[si];
                let d = digest_at(si, i);
                let pe = s.manifest.page_entries as u64;
                let count = s.manifest.chunks().saturating_sub(i as u64 * pe).min(pe);
                let sw = walks[si].as_mut().expect("live snapshots have a walk");
                if d == ZERO {
                    if let Some(h) = &mut sw.hasher {
                        h.feed_zeros(count);
                    }
                    continue;
                }
                let id = repo.crypto.blob_id(&d);
                let page = match cache.get(&d) {
                    Some(p) => p,
                    // The cache keeps at least the batch just read; read again if not.
                    None => {
                        w.page_reads += 1;
                        Arc::new(repo.read_page(&w.pages_index, &d))
                    }
                };
                match page.as_ref() {
                    Ok(page) if page.len() as u64 == count => {
                        if let Some(h) = &mut sw.hasher {
                            h.feed(page);
                        }
                        if !pages_done.insert(d) {
                            continue;
                        }
                        for e in page.iter().filter(|e| **e != ZERO) {
                            uses.push(use_record(&repo.crypto.blob_id(e), i as u64, si as u32))?;
                        }
                    }
                    other => {
                        sw.hasher = None;
                        if !w.pages_index.contains(&id) {
                            *index_damaged = true;
                        }
                        if w.damaged.contains_key(&id) {
                            continue;
                        }
                        let why = match other {
                            Ok(page) => format!("page {i} has {} entries, not {count}", page.len()),
                            Err(why) => why.clone(),
                        };
                        let obj = w
                            .pages_index
                            .blobs
                            .get(&id)
                            .map(|l| pack_name(&l.pack))
                            .unwrap_or_else(|| sw.object.clone());
                        let p = match page_problem.get(&d) {
                            Some(p) => *p,
                            None => {
                                let p = problem(r, (si, i as u64), obj, why);
                                page_problem.insert(d, p);
                                p
                            }
                        };
                        w.mark_damaged(id, p)?;
                    }
                }
            }
            k = end;
        }
    }
    let joined = w.locs.join(uses, hints, (w.held.chunks, &mut w.untraced.ids))?;
    w.spilled.uses += joined.uses_written;
    w.spilled.hints += joined.hints_written;
    // A chunk in no index object: a problem of the snapshot that uses it first (at the
    // first position where it uses one).
    let mut in_order: Vec<(usize, u64, u64)> =
        joined.missing_by_snap.iter().map(|(si, (i, n))| (*si as usize, *i, *n)).collect();
    in_order.sort_unstable_by_key(|&(si, i, _)| (i, si));
    for (si, i, n) in in_order {
        if let Some(sw) = walks[si].as_mut() {
            sw.missing = Some(problem(r, (si, i), sw.object.clone(), String::new()));
            sw.missing_count = n;
        }
    }
    for (_, si, eid) in &joined.missing {
        if let Some(p) = walks[*si as usize].as_ref().and_then(|sw| sw.missing) {
            w.mark_damaged(*eid, p)?;
        }
    }
    unknown_hints.1.extend(joined.stale_reads);
    let stale = (joined.stale + unknown_hints.0, unknown_hints.1.len() as u64);
    if stale.0 > 0 {
        r.notes.push(format!(
            "{} chunk hint(s) in {} located page(s) name a place that no longer holds their chunk (gc moved or \
             removed it since): not damage, readers find those chunks through the index instead (a lookup more \
             each); the next backup of each disk writes the pages it keeps with current places, and older \
             snapshots keep theirs until they are forgotten",
            stale.0, stale.1
        ));
    }
    for (si, (s, sw)) in snaps.iter().zip(walks).enumerate() {
        let Some(sw) = sw else { continue };
        if let Some(p) = sw.missing {
            r.problems[p].why = format!("{} chunk(s) it uses are in no index object", sw.missing_count);
            *index_damaged = true;
        }
        if let (Some(h), Some(want)) = (sw.hasher, &s.manifest.blkhash) {
            let got = format::hex(&h.finish());
            if *want != got {
                problem(r, (si, u64::MAX), sw.object, format!("its blkhash {want} does not match its pages ({got})"));
            }
        }
    }
    // The problems in the order one snapshot after another finds them.
    let mut order: Vec<usize> = (0..found_at.len()).collect();
    order.sort_by_key(|&j| found_at[j]);
    let mut moved: Vec<Option<Problem>> = r.problems.drain(base..).map(Some).collect();
    let mut new_at = vec![0usize; order.len()];
    for (to, &from) in order.iter().enumerate() {
        new_at[from] = base + to;
        r.problems.extend(moved[from].take());
    }
    for p in w.damaged.values_mut().filter(|p| **p >= base) {
        *p = new_at[*p - base];
    }
    drop(iters);
    w.snap_pages = pages;
    Ok(joined.distinct)
}

/// What the index says of the blobs in packs found missing or short, and of those
/// recorded damaged: one pass over the locations, made only where there are such packs.
#[derive(Default)]
struct IndexDamage {
    /// The bad packs that hold a blob with no good copy in another pack.
    unhealed: HashSet<u32>,
    /// The blobs whose every copy is in a bad pack, each with the pack of the copy a
    /// reader tries first: the first `held` of [`index_damage`] (the others are given to
    /// its `untraced`).
    lost: Vec<(Digest, u32)>,
    /// The recorded copies in packs in the store of blobs that have no good copy (pack and
    /// id, [`found_record`]), sorted on disk: memory stays bounded however many there are.
    only: Option<Sorter<FOUND>>,
}

fn index_damage(
    locs: &Locations,
    damage: &DamageSet,
    listed: &HashMap<String, u64>,
    bad_packs: &HashMap<u32, usize>,
    (held, untraced): (usize, &mut Untraced),
) -> Result<IndexDamage> {
    let mut out = IndexDamage::default();
    let present: Vec<bool> = locs.packs.iter().map(|p| listed.contains_key(&pack_name(p))).collect();
    let records: Vec<Option<&DamagedCopies>> = locs.packs.iter().map(|p| damage.packs.get(p)).collect();
    let records_here = records.iter().zip(&present).any(|(r, p)| r.is_some() && *p);
    if bad_packs.is_empty() && !records_here {
        return Ok(out);
    }
    let bad = |l: &Loc| bad_packs.contains_key(&l.pack);
    let recorded = |l: &Loc| records[l.pack as usize].is_some_and(|c| c.blobs.contains(&l.id));
    let mut only = locs.sorter::<FOUND>("check's recorded copies with no good copy").once_per_key(FOUND);
    locs.each_id(|g| {
        if g.iter().any(bad) {
            if !g.iter().any(|l| !bad(l) && !recorded(l)) {
                out.unhealed.extend(g.iter().filter(|l| bad(l)).map(|l| l.pack));
            }
            if g.iter().all(bad) && out.lost.len() >= held {
                untraced.add(g[0].id, None)?;
            } else if g.iter().all(bad) {
                let first = g.iter().find(|l| !recorded(l)).unwrap_or(&g[0]);
                out.lost.push((g[0].id, first.pack));
            }
        }
        if records_here && !g.iter().any(|l| !recorded(l) && present[l.pack as usize]) {
            for l in g.iter().filter(|l| recorded(l) && present[l.pack as usize]) {
                only.push(found_record(&locs.packs[l.pack as usize], &l.id))?;
            }
        }
        Ok(())
    })?;
    out.only = Some(only);
    Ok(out)
}

/// The damage records' packs that are still in the store: a problem for each whose
/// damaged copies some blob has no other copy than (`only`, sorted by pack and id; its
/// snapshots are named once attributed), else a note that gc removes them. Each such blob
/// counted, the first `held` held.
fn recorded_problems(
    r: &mut Report,
    damage: &DamageSet,
    only: Option<Sorter<FOUND>>,
    listed: &HashMap<String, u64>,
    (damaged, untraced, held): (&mut HashMap<Digest, usize>, &mut Untraced, usize),
) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    let mut only = only.map(|s| s.finish()).transpose()?;
    let mut next_only = || -> Result<Option<(Digest, Digest)>> {
        Ok(match only.as_mut() {
            Some(s) => s.next()?.map(|r| found_of(&r)),
            None => None,
        })
    };
    let mut next = next_only()?;
    let mut packs: Vec<(&Digest, &DamagedCopies)> = damage.packs.iter().collect();
    packs.sort_by_key(|(p, _)| **p);
    for (pack, copies) in packs {
        let name = pack_name(pack);
        if !listed.contains_key(&name) {
            continue;
        }
        let found = format!("recorded damaged by `ferry repo verify` at {}: {}", copies.time, copies.why);
        // A blob with no good copy: each of its copies, this one among them, is recorded
        // damaged or in a pack missing from the store ([`index_damage`] found them).
        while next.is_some_and(|(p, _)| p < *pack) {
            next = next_only()?;
        }
        if next.is_none_or(|(p, _)| p != *pack) {
            let what = if copies.blobs.is_empty() {
                "its chunks read well: `ferry repo gc` copies those in use to a new pack and removes it"
            } else {
                "each damaged chunk in it has a good copy elsewhere or is unused: `ferry repo gc` removes it"
            };
            r.notes.push(format!("{name}: {found}; {what}"));
            continue;
        }
        let p = r.problem(name, String::new());
        let mut count = 0u64;
        while let Some((_, id)) = next.filter(|(p, _)| *p == *pack) {
            mark_damaged(damaged, untraced, held, id, p)?;
            count += 1;
            next = next_only()?;
        }
        r.problems[p].why = format!(
            "{found}; {count} chunk(s) in it have no good copy (a backup that reads them from the disk stores them \
             again; a snapshot that uses them restores once it does, or is damaged until it is forgotten)"
        );
        out.push(p);
    }
    Ok(out)
}

/// Recorded damage that no snapshot reads is said as a note, not as a problem; one with
/// damaged chunks that were counted, not traced (`untraced`), stays a problem, since a
/// snapshot may read those. Recorded damage that verify found mended (`cleared`) is no
/// problem either.
fn unread_records_to_notes(r: &mut Report, recorded: &[usize], cleared: &HashSet<usize>, untraced: &Untraced) {
    let gone: HashSet<usize> = recorded
        .iter()
        .copied()
        .filter(|p| cleared.contains(p) || (r.problems[*p].hits.is_empty() && !untraced.problems.contains(p)))
        .collect();
    if gone.is_empty() {
        return;
    }
    // One pass, however many go (the last first among the notes, as they always were).
    let mut notes = Vec::new();
    for (i, p) in std::mem::take(&mut r.problems).into_iter().enumerate() {
        if !gone.contains(&i) {
            r.problems.push(p);
        } else if cleared.contains(&i) {
            notes.push(format!(
                "{}: it was recorded damaged, and reads back whole now: its record is cleared",
                p.object
            ));
        } else {
            notes.push(format!("{}: {}; no snapshot reads it: `ferry repo gc` removes it", p.object, p.why));
        }
    }
    r.notes.extend(notes.into_iter().rev());
}

/// Metadata only: config, every index object, every manifest and its pages, every
/// referenced blob indexed, every indexed pack present with a plausible size.
pub fn check(repo: &Repository) -> Result<Report> {
    check_in(repo, crate::spill::BUDGET)
}

/// [`check`] with sorters that hold up to `budget` bytes of records each in memory.
pub(crate) fn check_in(repo: &Repository, budget: usize) -> Result<Report> {
    check_held(repo, budget, DAMAGE_HELD)
}

/// [`check_in`] holding at most what `held` says of the damage ([`DAMAGE_HELD`]).
pub(crate) fn check_held(repo: &Repository, budget: usize, held: Held) -> Result<Report> {
    let (mut r, w) = check_walk_held(repo, budget, held)?;
    attribute(repo, &w, &mut r.problems);
    unread_records_to_notes(&mut r, &w.recorded, &HashSet::new(), &w.untraced);
    untraced_note(&mut r, w)?;
    Ok(r)
}

#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// Which packs are read.
    pub read_data: ReadData,
    pub threads: usize,
}

impl VerifyOptions {
    /// Every pack read, with `threads` at once.
    pub fn all(threads: usize) -> VerifyOptions {
        VerifyOptions { read_data: ReadData::Percent(100), threads }
    }
}

/// Which of the packs present verify reads, by their rank in name order (a pack's name is
/// the SHA-256 of its bytes: name order is a random order of the data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadData {
    /// This share of the packs (1 to 100), rounded up: at least one pack whenever there is
    /// one. A window of that many packs that moves on by its own width each day, so that
    /// successive days cover them all.
    Percent(u32),
    /// Subset `N` of `T` (1 ≤ N ≤ T), as restic's `--read-data-subset N/T`: the packs cut
    /// into T slices of as equal counts as can be, and the Nth read, the same every run
    /// while the packs stay; the T subsets together read every pack once. A repository of
    /// fewer than T packs leaves some subsets empty.
    Subset(u32, u32),
}

impl ReadData {
    /// `PERCENT`, `PERCENT%` or `N/T`, as `--read-data` takes it.
    pub fn parse(s: &str) -> Result<ReadData, String> {
        let num = |t: &str| t.trim().parse::<u32>().map_err(|_| format!("{t:?} is not a whole number"));
        let r = match s.split_once('/') {
            Some((n, t)) => ReadData::Subset(num(n)?, num(t)?),
            None => ReadData::Percent(num(s.strip_suffix('%').unwrap_or(s))?),
        };
        match r {
            ReadData::Percent(p) if !(1..=100).contains(&p) => Err(format!("{s}: a share is 1 to 100 (percent)")),
            ReadData::Subset(n, t) if t == 0 || !(1..=t).contains(&n) => {
                Err(format!("{s}: write N/T with 1 <= N <= T, e.g. 2/5 for the second fifth of the packs"))
            }
            r => Ok(r),
        }
    }

    /// Whether the pack of rank `rank` among `count` (in name order) is read on `day`
    /// (days since the epoch).
    pub fn selected(self, rank: usize, count: usize, day: u64) -> bool {
        let (rank, count) = (rank as u128, count as u128);
        if rank >= count {
            return false;
        }
        match self {
            ReadData::Percent(p) if p >= 100 => true,
            ReadData::Percent(p) => {
                let width = (p as u128 * count).div_ceil(100).max(1);
                let start = (day as u128 % count) * width % count;
                (rank + count - start) % count < width
            }
            ReadData::Subset(n, t) => rank * t as u128 / count == n as u128 - 1,
        }
    }
}

/// The most pack bytes (and trailer entries, as bytes) verify holds at once (more when
/// one pack alone is larger): `VERIFY_PACK_BYTES`, or `VERIFY_THREAD_BYTES` a thread where
/// that is more (from four threads on: a default 32 MiB pack and its trailer for each, so
/// a many-core host still verifies a pack on each core).
const VERIFY_PACK_BYTES: u64 = 128 << 20;
const VERIFY_THREAD_BYTES: u64 = 40 << 20;

/// What reading one pack found.
#[derive(Default)]
struct PackCheck {
    bytes: u64,
    blobs: u64,
    /// Why the pack as a whole is wrong (name, trailer), if it is.
    pack_why: Option<String>,
    /// The store could not give the pack (not damage that was seen: not recorded).
    unreadable: bool,
    /// The blobs found damaged (every blob of an unreadable pack), and why the first was:
    /// one reason a pack, not one a blob (a pack may hold a million tiny blobs). Held
    /// while the pack is in flight only: [`sort_out`] gives them to verify's sorters.
    bad_blobs: Vec<Digest>,
    first_bad: Option<String>,
    /// How many blobs were found damaged.
    bad: u64,
    /// What [`sort_out`] decided: the pack reads back whole; its damage is recorded
    /// already (every copy found damaged); its record says otherwise than what was found
    /// (it is rewritten); what was found is to be recorded.
    whole: bool,
    covered: bool,
    stale_record: bool,
    record: bool,
}

/// Gives a pack's damaged copies to verify's sorters (`record`, `trace`) and says what
/// is to be done with them: recorded (new damage, or a record that says otherwise),
/// traced to the snapshots that read them (damage not recorded yet, or copies of a
/// record rewritten). Holds the sorters' locks only for a pack with damage. `held` counts
/// the damaged ids the packs being sorted out hold now, and the most they held at once.
fn sort_out(
    damage: &DamageSet,
    pack: &Digest,
    c: PackCheck,
    (record, trace): &(Mutex<Sorter<FOUND>>, Mutex<Sorter<FOUND>>),
    held: &(AtomicUsize, AtomicUsize),
) -> Result<PackCheck> {
    let n = c.bad_blobs.len();
    held.1.fetch_max(held.0.fetch_add(n, SeqCst) + n, SeqCst);
    let r = sort_out_held(damage, pack, c, (record, trace));
    held.0.fetch_sub(n, SeqCst);
    r
}

/// [`sort_out`], its count of the ids held aside.
fn sort_out_held(
    damage: &DamageSet,
    pack: &Digest,
    mut c: PackCheck,
    (record, trace): (&Mutex<Sorter<FOUND>>, &Mutex<Sorter<FOUND>>),
) -> Result<PackCheck> {
    let bad = std::mem::take(&mut c.bad_blobs);
    c.bad = bad.len() as u64;
    c.whole = c.pack_why.is_none() && bad.is_empty();
    if let Some(rec) = damage.packs.get(pack).filter(|_| !c.unreadable) {
        let now: HashSet<&Digest> = bad.iter().collect();
        c.stale_record = c.whole || rec.blobs.iter().any(|b| !now.contains(b));
        c.covered = bad.iter().all(|b| rec.blobs.contains(b));
    }
    if c.whole {
        return Ok(c);
    }
    c.record = !c.unreadable && (!c.covered || c.stale_record);
    // A record that is not out of date is added to: only the ids it does not list yet
    // are recorded (not the whole list again each verify).
    let known = damage.packs.get(pack).filter(|_| !c.stale_record);
    let new = |id: &Digest| known.is_none_or(|rec| !rec.blobs.contains(id));
    for (to, yes, to_record) in [(record, c.record, true), (trace, !c.covered || c.stale_record, false)] {
        if yes && !bad.is_empty() {
            let mut to = to.lock().unwrap_or_else(|e| e.into_inner());
            for id in bad.iter().filter(|id| !to_record || new(id)) {
                to.push(found_record(pack, id))?;
            }
        }
    }
    Ok(c)
}

/// A sorter given back by the threads that filled it.
fn into_inner(m: Mutex<Sorter<FOUND>>) -> Sorter<FOUND> {
    m.into_inner().unwrap_or_else(|e| e.into_inner())
}

impl PackCheck {
    fn bad(&mut self, id: Digest, why: impl FnOnce() -> String) {
        if self.first_bad.is_none() {
            self.first_bad = Some(why());
        }
        self.bad_blobs.push(id);
    }
}

/// `rows` are the blobs the index places in the pack, by offset.
fn verify_pack(repo: &Repository, pack: &Digest, rows: &[BlobEntry]) -> PackCheck {
    let blobs = || rows.iter().copied();
    let name = pack_name(pack);
    let mut c = PackCheck::default();
    let bytes = match repo.store.get(&name, format::MAX_PACK) {
        Ok(b) => b,
        Err(e) => {
            c.pack_why = Some(format!("cannot be read: {e}"));
            c.unreadable = true;
            c.bad_blobs = blobs().map(|b| b.id).collect();
            c.first_bad = Some("unreadable".to_string());
            return c;
        }
    };
    c.bytes = bytes.len() as u64;
    let mut whys = Vec::new();
    if sha256(&bytes) != *pack {
        whys.push("its content does not match its name (SHA-256)".to_string());
    }
    let len = bytes.len() as u64;
    let trailer = (|| -> Result<Vec<BlobEntry>, String> {
        let tail = bytes.get(bytes.len().saturating_sub(format::PACK_TAIL)..).unwrap_or(&[]);
        let tl = format::parse_pack_tail(tail, len).map_err(|e| e.0)? as u64;
        let blobs_len = len
            .checked_sub(format::PACK_TAIL as u64 + tl)
            .ok_or_else(|| "its trailer is longer than the pack".to_string())?;
        let stored = &bytes[blobs_len as usize..(len as usize - format::PACK_TAIL)];
        let plain = repo.crypto.open(AAD_TRAILER, stored).map_err(|e| e.to_string())?;
        format::parse_trailer(&plain, blobs_len, &repo.limits()).map_err(|e| e.0)
    })();
    match trailer {
        Err(why) => whys.push(format!("its trailer is damaged: {why}")),
        Ok(mut t) => {
            // Sorted in place and searched: no set beside it (a trailer lists up to 2^20).
            let key = |b: &BlobEntry| (b.offset, b.id, b.stored_len);
            t.sort_unstable_by_key(key);
            let off = blobs().filter(|b| t.binary_search_by_key(&key(b), key).is_err()).count();
            if off > 0 {
                whys.push(format!("its trailer does not list {off} blob(s) the index places in it"));
            }
        }
    }
    // Decoded a few at a time, their digests computed side by side.
    let mut rows = blobs().peekable();
    while rows.peek().is_some() {
        let mut plains: Vec<(BlobEntry, Vec<u8>)> = Vec::with_capacity(32);
        for b in rows.by_ref().take(32) {
            c.blobs += 1;
            let loc = crate::BlobLocation::of(*pack, &b);
            let stored = bytes.get(b.offset as usize..b.offset as usize + b.stored_len as usize).unwrap_or(&[]);
            match repo.decode_blob_unchecked(&b.id, &loc, b.kind, stored) {
                Ok(p) => plains.push((b, p)),
                Err(why) => c.bad(b.id, || why),
            }
        }
        let blocks: Vec<&[u8]> = plains.iter().map(|(_, p)| p.as_slice()).collect();
        let mut digests = vec![0u8; blocks.len() * 32];
        ferry_hash::Algorithm::Sha256.digest_many(&blocks, &mut digests);
        for ((b, _), d) in plains.iter().zip(digests.chunks_exact(32)) {
            let d: Digest = d.try_into().unwrap_or([0; 32]);
            if repo.crypto.blob_id(&d) != b.id {
                c.bad(b.id, || {
                    format!(
                        "blob {} at offset {}: its plain bytes do not match its id (their digest differs)",
                        format::hex(&b.id),
                        b.offset
                    )
                });
            }
        }
    }
    if !whys.is_empty() {
        c.pack_why = Some(whys.join("; "));
    }
    c
}

/// check, then read each chosen pack once, whole, and check every blob in it.
pub fn verify(repo: &Repository, opts: &VerifyOptions) -> Result<Report> {
    verify_in(repo, opts, crate::spill::BUDGET)
}

/// [`verify`] with sorters that hold up to `budget` bytes of records each in memory.
pub(crate) fn verify_in(repo: &Repository, opts: &VerifyOptions, budget: usize) -> Result<Report> {
    verify_held(repo, opts, budget, DAMAGE_HELD)
}

/// [`verify_in`] holding at most what `held` says of the damage ([`DAMAGE_HELD`]).
pub(crate) fn verify_held(repo: &Repository, opts: &VerifyOptions, budget: usize, held: Held) -> Result<Report> {
    let (mut r, mut w) = check_walk_held(repo, budget, held)?;
    let day = jiff::Timestamp::now().as_second().max(0) as u64 / 86400;
    let locs = &w.locs;
    let present: Vec<(Digest, u32)> = locs
        .packs_sorted()
        .into_iter()
        .map(|p| (locs.packs[p as usize], p))
        .filter(|(p, _)| w.listed.contains_key(&pack_name(p)))
        .collect();
    let todo: Vec<(Digest, u32)> = present
        .iter()
        .enumerate()
        .filter(|(rank, _)| opts.read_data.selected(*rank, present.len(), day))
        .map(|(_, p)| *p)
        .collect();
    r.packs_read = todo.len();
    r.bytes_present = present.iter().map(|(p, _)| w.listed.get(&pack_name(p)).copied().unwrap_or(0)).sum();
    // From here on, blobs_checked counts the blobs decoded.
    r.blobs_checked = 0;
    // The chosen packs' blobs, sorted by pack into a table on disk: each pack's read when
    // it is verified.
    let mut want = vec![false; locs.packs.len()];
    for (_, n) in &todo {
        want[*n as usize] = true;
    }
    let by_pack = locs.by_pack(&want)?;
    // The damaged copies found, sorted on disk (by pack, then id) as the packs are read:
    // those to record and those to trace to the snapshots that read them. Memory stays
    // bounded however much damage there is, and what is found is the same whatever the
    // number of threads.
    let sorter = |what: &str| Mutex::new(locs.sorter::<FOUND>(what).once_per_key(FOUND));
    let sorters = (sorter("verify's damaged copies to record"), sorter("verify's damaged copies to trace"));
    // Packs in flight are bounded by their bytes, not only by the threads: each thread
    // holds a whole pack (and its trailer) while it checks it.
    let budget = ByteBudget::new(VERIFY_PACK_BYTES.max(opts.threads as u64 * VERIFY_THREAD_BYTES));
    let ids = (AtomicUsize::new(0), AtomicUsize::new(0));
    let results = par_map(&todo, opts.threads.max(1), |(p, n)| {
        // Its bytes, and per blob its records read from the table by pack and its entry
        // made of them, and its trailer entry as stored, plain, parsed and spanned.
        let len = w.listed.get(&pack_name(p)).copied().unwrap_or(0);
        let per_blob =
            crate::locations::BY_PACK_READ_BYTES + 2 * std::mem::size_of::<BlobEntry>() + 2 * format::ENTRY_LEN + 24;
        let held = len.saturating_add(by_pack.count(*n) * per_blob as u64);
        budget.with(held, || {
            by_pack.blobs(*n).and_then(|rows| sort_out(&w.damage, p, verify_pack(repo, p, &rows), &sorters, &ids))
        })
    });
    let results = results.into_iter().collect::<Result<Vec<PackCheck>>>()?;
    // Each pack's damaged ids went to the sorters: none are held past its check; the
    // most held at once were those of the packs being sorted out together.
    r.ids_held = r.ids_held.max(ids.1.into_inner());
    drop(by_pack);
    let (to_record, to_trace) = sorters;
    // The packs to record (in pack order, as `todo` is), each with why.
    let mut found: Vec<(Digest, String)> = Vec::new();
    let mut new_damage = false;
    // Recorded packs that read otherwise now (their records are rewritten), and those of
    // them that read back whole (mended, or read wrong once).
    let mut rewritten: HashSet<Digest> = HashSet::new();
    let mut whole_again: Vec<Digest> = Vec::new();
    // Recorded packs whose record was up to date: every id it lists was found damaged again.
    let mut confirmed: Vec<Digest> = Vec::new();
    let mut problem_of: HashMap<Digest, usize> = HashMap::new();
    let mut by_object: HashMap<String, usize> =
        r.problems.iter().enumerate().rev().map(|(i, p)| (p.object.clone(), i)).collect();
    for ((pack, _), c) in todo.iter().zip(results) {
        r.bytes_read += c.bytes;
        r.blobs_checked += c.blobs;
        let mut why = c.pack_why.clone().unwrap_or_default();
        if let Some(first) = &c.first_bad {
            if !why.is_empty() {
                why.push_str("; ");
            }
            why.push_str(&format!("{} blob(s) damaged (first: {first})", c.bad));
        }
        if !c.stale_record && !c.unreadable && w.damage.packs.contains_key(pack) {
            confirmed.push(*pack);
        }
        if c.stale_record {
            rewritten.insert(*pack);
            if c.whole {
                whole_again.push(*pack);
            }
        }
        if c.record {
            found.push((*pack, why.chars().take(format::MAX_DAMAGE_WHY / 4).collect()));
            new_damage |= !c.stale_record;
        }
        if c.whole || c.covered {
            continue; // whole, or recorded already: check_walk said it
        }
        // One problem per pack: what check found in it already (a page) says this too.
        problem_of.insert(*pack, r.problem_once(&mut by_object, pack_name(pack), why));
    }
    // Each damaged copy, with the problem of its pack (none: a recorded pack whose record
    // is rewritten, traced as a damaged copy only), the first `held` chunks held.
    let mut bad_copies: HashMap<Digest, Vec<(Digest, Option<usize>)>> = HashMap::new();
    let mut trace = into_inner(to_trace).finish()?;
    r.damage_spilled = trace.written();
    while let Some(rec) = trace.next()? {
        let (pack, id) = found_of(&rec);
        let p = problem_of.get(&pack).copied();
        if let Some(v) = bad_copies.get_mut(&id) {
            v.push((pack, p));
        } else if bad_copies.len() < w.held.chunks {
            bad_copies.insert(id, vec![(pack, p)]);
        } else if let Some(p) = p.filter(|_| !w.damaged.contains_key(&id)) {
            // Each chunk counted once, however many of its copies are damaged.
            w.untraced.add(id, Some(p))?;
        }
    }
    drop(trace);
    r.ids_held = r.ids_held.max(bad_copies.len());
    // A damaged copy hurts the snapshots only when no other copy is good (a reader tries
    // each): every other copy is in a pack found missing or damaged too, or recorded
    // damaged (and not read otherwise now).
    let recorded_bad = |pack: &Digest, id: &Digest| !rewritten.contains(pack) && w.damage.is_damaged(pack, id);
    if !bad_copies.is_empty() {
        let (locs, listed, damaged, untraced, held) =
            (&w.locs, &w.listed, &mut w.damaged, &mut w.untraced, w.held.chunks);
        locs.each_id(|g| {
            let id = &g[0].id;
            let Some(copies) = bad_copies.get(id) else { return Ok(()) };
            let Some(p) = copies.iter().find_map(|(_, p)| *p) else { return Ok(()) };
            let bad = |pack: &Digest| copies.iter().any(|(c, _)| c == pack);
            let lost = g
                .iter()
                .map(|l| &locs.packs[l.pack as usize])
                .all(|pack| bad(pack) || recorded_bad(pack, id) || !listed.contains_key(&pack_name(pack)));
            if lost && !damaged.contains_key(id) {
                mark_damaged(damaged, untraced, held, *id, p)?;
            }
            Ok(())
        })?;
    }
    drop(bad_copies);
    // What was found is recorded: in new objects, or, where a recorded pack reads
    // otherwise now, with every record rewritten.
    let rewrite = !rewritten.is_empty();
    // Whether the records were rewritten whole (the mended packs' records cleared).
    let mut corrected = false;
    if !found.is_empty() || rewrite {
        let mut ids = into_inner(to_record).finish()?;
        r.damage_spilled += ids.written();
        match crate::damage::store_found(repo, &found, &mut ids, &w.damage, (&rewritten, &whole_again, &confirmed)) {
            Err(e) => {
                r.notes.push(format!("the damage could not be recorded in the repository (run verify again): {e}"))
            }
            Ok((names, not_corrected, most)) => {
                r.ids_held = r.ids_held.max(most);
                match not_corrected {
                    Some(e) => {
                        r.notes.push(format!("the damage records could not be corrected (run verify again): {e}"))
                    }
                    None => corrected = rewrite,
                }
                if new_damage && !names.is_empty() {
                    r.notes.push(format!(
                        "the damage is recorded in {}: the next backup that reads the damaged chunks stores them \
                         again, readers use any good copy, and `ferry repo gc` removes the damaged copies once none \
                         is needed",
                        match names.as_slice() {
                            [one] => one.clone(),
                            [first, rest @ ..] => {
                                format!("{first} and {} more object(s) of the same record", rest.len())
                            }
                            [] => "no object".to_string(),
                        }
                    ));
                }
            }
        }
    }
    // Packs recorded damaged that read back whole now are no damage (once their records
    // are cleared: else they stay recorded, and are said to be below).
    if !corrected {
        whole_again.clear();
    }
    let whole_again: HashSet<String> = whole_again.iter().map(pack_name).collect();
    let cleared: HashSet<usize> =
        w.recorded.iter().copied().filter(|p| whole_again.contains(&r.problems[*p].object)).collect();
    r.notes.retain(|n| !n.split_once(": recorded damaged").is_some_and(|(name, _)| whole_again.contains(name)));
    w.damaged.retain(|_, p| !cleared.contains(p));
    r.ids_held = r.ids_held.max(w.damaged.len());
    attribute(repo, &w, &mut r.problems);
    unread_records_to_notes(&mut r, &w.recorded, &cleared, &w.untraced);
    untraced_note(&mut r, w)?;
    Ok(r)
}

pub use crate::retain::{keep, Policy};

/// What forget kept and removed, per disk.
#[derive(Debug, Default, Serialize)]
pub struct ForgetReport {
    pub kept: Vec<String>,
    pub removed: Vec<String>,
    /// Said once each: e.g. that no rule was given, so everything was kept.
    pub notes: Vec<String>,
    /// Why each kept snapshot is kept ("daily snapshot", "within 7d", "tag T",
    /// "protected"...), by id.
    pub reasons: BTreeMap<String, Vec<String>>,
}

/// Applies `policy` to each disk (or only `name`): removes the manifests it does not keep.
///
/// With no rule, every snapshot is kept (and the report says so). Rules that are all 0
/// would remove every snapshot: refused.
pub fn forget(repo: &Repository, name: Option<&str>, policy: &Policy, dry_run: bool) -> Result<ForgetReport> {
    forget_with(repo, name, policy, dry_run, None)
}

/// [`forget`], waiting up to `wait` for another forget or a gc to end instead of failing.
pub fn forget_with(
    repo: &Repository,
    name: Option<&str>,
    policy: &Policy,
    dry_run: bool,
    wait: Option<std::time::Duration>,
) -> Result<ForgetReport> {
    let mut report = ForgetReport::default();
    if policy.keeps_nothing() {
        return Err(Error::Invalid(
            "every --keep-* given is 0, which would remove every snapshot: give at least one rule with N of 1 or more"
                .into(),
        ));
    }
    let _lock = if dry_run { None } else { Some(lock::acquire(&repo.store, LockKind::Forget, None, wait)?) };
    // A manifest that cannot be read is kept, and the rules apply to the others: that
    // never removes a snapshot the rules would keep with it counted (leaving one out of
    // a disk's list only moves the others up in it), so at most fewer are removed.
    let (snaps, bad) = repo.snapshots_lenient()?;
    if let Some(l) = &_lock {
        crate::migrate::finish_migrated(repo, &snaps, l)?;
    }
    for (object, e) in &bad {
        report.notes.push(format!(
            "{object} cannot be read ({}): it is kept, and the rules applied to the other snapshots (it may be of \
             any disk)",
            e.reason()
        ));
    }
    let mut disks: BTreeMap<&str, Vec<SnapshotInfo>> = BTreeMap::new();
    for s in &snaps {
        if name.is_none_or(|n| n == s.manifest.name) {
            disks.entry(s.manifest.name.as_str()).or_default().push(s.clone());
        }
    }
    if let Some(n) = name {
        if disks.is_empty() {
            return Err(Error::NotFound(format!("{} has no snapshot of {n}", repo.store.describe())));
        }
    }
    if policy.is_empty() {
        report.notes.push("no --keep-* rule given: every snapshot is kept".into());
    }
    // What this host forgot, for its record of the repository (told also when a delete fails).
    let mut gone: Vec<(String, String)> = Vec::new();
    let tell = |gone: &[(String, String)]| tell_forgotten(repo, gone);
    // Read once the lock is held: a snapshot protected before this forget began is kept.
    let protected = crate::retain::protected(repo)?;
    let (tz, now) = (crate::retain::local_zone(), jiff::Timestamp::now());
    for (_, mut list) in disks {
        list.reverse(); // newest first
        let reasons = crate::retain::reasons(&list, policy, &protected, &tz, now);
        for (s, why) in list.iter().zip(reasons) {
            if !why.is_empty() {
                report.kept.push(s.id.clone());
                report.reasons.insert(s.id.clone(), why);
            } else {
                if !dry_run {
                    let obj = format!("snapshots/{}", s.id);
                    if let Err(e) = repo.store.delete(&obj) {
                        tell(&gone);
                        return Err(Error::store(format!("cannot remove {obj} from {}", repo.store.describe()), e));
                    }
                    gone.push((s.id.clone(), s.manifest.name.clone()));
                }
                report.removed.push(s.id.clone());
            }
        }
    }
    tell(&gone);
    forget_points(repo, &snaps, &bad, &mut report, dry_run)?;
    Ok(report)
}

/// Removes the points (FORMAT.md §12) whose snapshots `report` removed all of, with a note
/// for each.
fn forget_points(
    repo: &Repository,
    snaps: &[SnapshotInfo],
    bad: &crate::repo::Failures,
    report: &mut ForgetReport,
    dry_run: bool,
) -> Result<()> {
    if report.removed.is_empty() {
        return Ok(());
    }
    let present: Vec<SnapshotInfo> = snaps.iter().filter(|s| !report.removed.contains(&s.id)).cloned().collect();
    let unreadable: Vec<String> =
        bad.iter().map(|(n, _)| n.strip_prefix("snapshots/").unwrap_or(n).to_string()).collect();
    for (id, domain) in crate::points::prune_points(repo, &present, &unreadable, dry_run)? {
        report.notes.push(format!(
            "point {} of {domain} {} (its snapshots are all forgotten)",
            &id[..8.min(id.len())],
            if dry_run { "would be removed" } else { "removed" }
        ));
    }
    Ok(())
}

/// Tells this host's record of the repository (if it keeps one) what was forgotten.
pub(crate) fn tell_forgotten(repo: &Repository, gone: &[(String, String)]) {
    if let Some(k) = repo.known() {
        k.forgotten(gone);
    }
}

/// Removes the manifest `snapshots/ID`.
fn remove_snapshot(repo: &Repository, id: &str) -> Result<()> {
    let obj = format!("snapshots/{id}");
    repo.store.delete(&obj).map_err(|e| Error::store(format!("cannot remove {obj} from {}", repo.store.describe()), e))
}

/// Forgets the snapshots `ids` names (each a unique prefix of at least 4 hex digits of a
/// snapshot id; of disk `name` when given): every id is resolved before any manifest is
/// removed. A manifest that cannot be read is forgotten by its id too (without `name`:
/// which disk it is of cannot be told). `kept` lists the other snapshots (of `name`).
pub fn forget_ids(
    repo: &Repository,
    name: Option<&str>,
    ids: &[String],
    dry_run: bool,
    wait: Option<std::time::Duration>,
) -> Result<ForgetReport> {
    if ids.is_empty() {
        return Err(Error::Invalid("give the id of at least one snapshot to forget".into()));
    }
    let _lock = if dry_run { None } else { Some(lock::acquire(&repo.store, LockKind::Forget, None, wait)?) };
    let (snaps, bad) = repo.snapshots_lenient()?;
    if let Some(l) = &_lock {
        crate::migrate::finish_migrated(repo, &snaps, l)?;
    }
    let unreadable: Vec<String> =
        bad.iter().map(|(n, _)| n.strip_prefix("snapshots/").unwrap_or(n).to_string()).collect();
    let describe = repo.store.describe();
    let mut chosen: Vec<String> = Vec::new();
    for given in ids {
        let prefix = given.to_ascii_lowercase();
        if prefix.len() < 4 || prefix.len() > 64 || !prefix.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(Error::Invalid(format!(
                "{given:?} is not a snapshot id: give at least 4 hex digits of one (`ferry repo list` shows them)"
            )));
        }
        let good: Vec<&SnapshotInfo> = snaps.iter().filter(|s| s.id.starts_with(&prefix)).collect();
        let damaged: Vec<&String> = unreadable.iter().filter(|id| id.starts_with(&prefix)).collect();
        let id = match (good.as_slice(), damaged.as_slice()) {
            ([one], []) => match name {
                Some(n) if one.manifest.name != n => {
                    return Err(Error::NotFound(format!(
                        "snapshot {prefix} is not of {n} but of {}: write {describe} {prefix}, or {describe}::{}",
                        one.manifest.name, one.manifest.name
                    )))
                }
                _ => one.id.clone(),
            },
            ([], [one]) if name.is_none() => (*one).clone(),
            ([], [one]) => {
                return Err(Error::Invalid(format!(
                    "the manifest of snapshot {} cannot be read, so its disk cannot be told: forget it as \
                     `ferry repo forget {describe} {prefix}` (without ::NAME)",
                    &one[..8.min(one.len())]
                )))
            }
            ([], []) => {
                return Err(Error::NotFound(format!(
                    "{describe} has no snapshot whose id starts with {prefix} (`ferry repo list` shows them)"
                )))
            }
            _ => {
                return Err(Error::Invalid(format!(
                    "{prefix} names {} snapshots: give more digits",
                    good.len() + damaged.len()
                )))
            }
        };
        if !chosen.contains(&id) {
            chosen.push(id);
        }
    }
    let protected = crate::retain::protected(repo)?;
    let is_protected = |id: &String| {
        protected.contains(id) || snaps.iter().any(|s| &s.id == id && crate::retain::is_protected(&protected, s))
    };
    if let Some(id) = chosen.iter().find(|id| is_protected(id)) {
        return Err(Error::Invalid(format!(
            "snapshot {} is protected: nothing is forgotten (`ferry repo unprotect {describe}::NAME@{}` first, if it \
             is to go)",
            id.get(..8).unwrap_or(id),
            id.get(..8).unwrap_or(id)
        )));
    }
    let mut report = ForgetReport::default();
    for s in snaps.iter().filter(|s| name.is_none_or(|n| n == s.manifest.name)) {
        if !chosen.contains(&s.id) {
            report.kept.push(s.id.clone());
        }
    }
    // What this host forgot, for its record of the repository (told also when a delete fails).
    let mut gone: Vec<(String, String)> = Vec::new();
    for id in chosen {
        if !dry_run {
            if let Err(e) = remove_snapshot(repo, &id) {
                tell_forgotten(repo, &gone);
                return Err(e);
            }
            let disk = snaps.iter().find(|s| s.id == id).map_or(String::new(), |s| s.manifest.name.clone());
            gone.push((id.clone(), disk));
        }
        report.removed.push(id);
    }
    tell_forgotten(repo, &gone);
    forget_points(repo, &snaps, &bad, &mut report, dry_run)?;
    Ok(report)
}

#[derive(Debug, Default, Serialize)]
pub struct GcReport {
    pub packs_deleted: u64,
    pub packs_repacked: u64,
    pub blobs_freed: u64,
    pub bytes_freed: u64,
    pub bytes_before: u64,
    pub bytes_after: u64,
    /// Packs this gc condemned and left for a later one to delete (backups ran beside it).
    pub packs_condemned: u64,
    /// Packs condemned by an earlier gc that wait still: for backups that ran when they were
    /// condemned to end, or for the margin to pass.
    pub packs_waiting: u64,
    /// Packs condemned by an earlier gc that a snapshot uses again: no longer condemned.
    pub packs_spared: u64,
    /// Runs gc's sorters wrote to temporary files (not in the JSON report).
    #[serde(skip)]
    pub spill_runs: u64,
    /// Bytes gc's sorters wrote to temporary files (not in the JSON report).
    #[serde(skip)]
    pub spill_bytes: u64,
    /// Old index objects this gc kept as they were (not in the JSON report).
    #[serde(skip)]
    pub index_kept: u64,
    /// Old index objects this gc wrote anew and removed (not in the JSON report).
    #[serde(skip)]
    pub index_rewritten: u64,
}

/// Frees what no snapshot references (FORMAT.md §9).
///
/// Anything it cannot read (a manifest, an index object, a page) stops it before it
/// deletes anything: what it cannot read, it cannot prove dead.
pub fn gc(repo: &Repository, wait: Option<std::time::Duration>) -> Result<GcReport> {
    gc_with(repo, wait, DEFAULT_REPACK_PERCENT)
}

/// A pack is copied to free its unused blobs only when they are at least this share of
/// its stored bytes (as borg's compact threshold): a scattered change leaves a few dead
/// chunks in most packs, and rewriting all of them would cost far more than it frees.
pub const DEFAULT_REPACK_PERCENT: u32 = 10;

/// How old a condemned record that names running backups must be before a gc deletes its
/// packs (FORMAT.md §8a), unless `FERRY_CONDEMN_MARGIN` (seconds) says otherwise.
pub const DEFAULT_CONDEMN_MARGIN: std::time::Duration = std::time::Duration::from_secs(3600);

/// The margin: `FERRY_CONDEMN_MARGIN` (whole seconds) where it is set and valid, else
/// [`DEFAULT_CONDEMN_MARGIN`].
pub fn condemn_margin_from_env() -> std::time::Duration {
    match std::env::var("FERRY_CONDEMN_MARGIN") {
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(secs) => std::time::Duration::from_secs(secs),
            Err(_) => {
                log::warn!("FERRY_CONDEMN_MARGIN={v:?} is not a number of seconds: the margin is one hour");
                DEFAULT_CONDEMN_MARGIN
            }
        },
        Err(_) => DEFAULT_CONDEMN_MARGIN,
    }
}

/// What a gc does.
#[derive(Debug, Clone)]
pub struct GcOptions {
    /// Wait this long for another gc, a forget or a repair (or an older ferry's backup)
    /// to end, instead of failing.
    pub wait: Option<std::time::Duration>,
    /// Repack a partly unused pack only when at least this share of its bytes is unused.
    pub repack_percent: u32,
    /// How old a condemned record that names backups must be before its packs are deleted.
    pub condemn_margin: std::time::Duration,
}

/// [`gc`], repacking a partly unused pack only when at least `repack_percent` of its
/// stored bytes are unused (0: every such pack; packs with no live blob are always deleted).
pub fn gc_with(repo: &Repository, wait: Option<std::time::Duration>, repack_percent: u32) -> Result<GcReport> {
    gc_opts(repo, &GcOptions { wait, repack_percent, condemn_margin: condemn_margin_from_env() })
}

/// gc writes the index in objects of at most this many plain bytes (a backup's limit is
/// [`crate::repo::INDEX_SPLIT`]): each is encoded and sealed in memory, twice its size,
/// beside everything gc holds, so smaller objects keep its peak down (at 1M chunks the
/// index is about 45 MB: 3 objects).
const GC_INDEX_SPLIT: usize = 16 << 20;

/// A temporary file younger than this may be a running backup's (gc runs beside them).
const TEMP_AGE: std::time::Duration = std::time::Duration::from_secs(3600);

/// The least age `FERRY_GC_TEMP_AGE` may set: a writer's temporary file lives as long as
/// one store of an object (a pack of at most 512 MiB), far less than this; one removed
/// under a running writer fails its store (and the backup), which loses nothing but costs
/// the run.
const TEMP_AGE_FLOOR: std::time::Duration = std::time::Duration::from_secs(600);

/// Set (to anything) by tests that kill writers and want their files gone at once: lets
/// `FERRY_GC_TEMP_AGE` go below [`TEMP_AGE_FLOOR`].
const TEMP_AGE_TEST_ENV: &str = "FERRY_TEST_UNSAFE_GC_TEMP_AGE";

/// How old a temporary file must be for gc to remove it: `FERRY_GC_TEMP_AGE` (seconds),
/// else one hour.
fn temp_age_from_env() -> std::time::Duration {
    temp_age(std::env::var("FERRY_GC_TEMP_AGE").ok().as_deref(), std::env::var_os(TEMP_AGE_TEST_ENV).is_some())
}

/// The age `value` (of `FERRY_GC_TEMP_AGE`) sets: a number of seconds, at least
/// [`TEMP_AGE_FLOOR`] unless `unsafe_ok` ([`TEMP_AGE_TEST_ENV`] is set).
pub(crate) fn temp_age(value: Option<&str>, unsafe_ok: bool) -> std::time::Duration {
    let Some(v) = value else { return TEMP_AGE };
    match v.trim().parse::<u64>() {
        Ok(secs) if secs < TEMP_AGE_FLOOR.as_secs() && !unsafe_ok => {
            log::warn!(
                "FERRY_GC_TEMP_AGE={v:?} is below {} seconds, which could remove a running backup's files: the age \
                 is {} seconds (tests set {TEMP_AGE_TEST_ENV} to go lower)",
                TEMP_AGE_FLOOR.as_secs(),
                TEMP_AGE_FLOOR.as_secs()
            );
            TEMP_AGE_FLOOR
        }
        Ok(secs) => std::time::Duration::from_secs(secs),
        Err(_) => {
            log::warn!("FERRY_GC_TEMP_AGE={v:?} is not a number of seconds: the age is one hour");
            TEMP_AGE
        }
    }
}

/// What the mark read, to tell whether anything that could use a pack was stored since.
struct Marked {
    snapshots: HashSet<String>,
    index: HashSet<String>,
    checkpoints: Vec<(String, crate::format::Checkpoint)>,
}

impl Marked {
    /// Whether no snapshot, index object or checkpoint was stored, changed or removed since
    /// the mark read them.
    fn unchanged(&self, repo: &Repository) -> Result<bool> {
        let names = |prefix: &str| -> Result<HashSet<String>> {
            Ok(repo
                .store
                .list(prefix)
                .map_err(|e| Error::store(format!("cannot list {prefix} of {}", repo.store.describe()), e))?
                .into_iter()
                .map(|(n, _)| n)
                .collect())
        };
        let snaps: HashSet<String> =
            names("snapshots/")?.into_iter().map(|n| n.trim_start_matches("snapshots/").to_string()).collect();
        if snaps != self.snapshots || names("index/")? != self.index {
            return Ok(false);
        }
        let (checkpoints, bad) = repo.checkpoints_lenient()?;
        let mut now: Vec<(String, crate::format::Checkpoint)> =
            checkpoints.into_iter().map(|c| (c.object, c.checkpoint)).collect();
        now.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(bad.is_empty() && now == self.checkpoints)
    }
}

/// [`gc`] with every option (FORMAT.md §8a, §9). Backups of this ferry run beside it:
/// what it finds unused it condemns (a record naming the packs and the running backups),
/// and it deletes the packs that an earlier gc condemned once no backup that could use
/// them runs, the margin has passed and its own mark finds them still unused. What it
/// condemns while no backup runs (and nothing was stored since its mark) it deletes at
/// once.
pub fn gc_opts(repo: &Repository, opts: &GcOptions) -> Result<GcReport> {
    gc_run(repo, opts, false)
}

/// What [`gc_opts`] would do now, changing nothing (no lock taken, no object written or
/// removed): the packs it would delete, condemn and repack, and the bytes that frees
/// (`bytes_after` as it would be; a repacked pack counted as its unused bytes freed).
pub fn gc_dry_run(repo: &Repository, opts: &GcOptions) -> Result<GcReport> {
    gc_run(repo, opts, true)
}

fn gc_run(repo: &Repository, opts: &GcOptions, dry_run: bool) -> Result<GcReport> {
    let store = &repo.store;
    let _lock = if dry_run { None } else { Some(lock::acquire_gc(store, opts.wait)?) };
    // The backups running beside this gc (listed before the mark: a record whose backups
    // are all gone now is executed only after this gc marked what they stored).
    let (running, blocked) = crate::condemn::running_backups(store, !dry_run)?;
    // What writers killed mid-write left (a directory store's temporary files): only
    // files too old to be a running writer's, even when no backup ran at the start (one
    // may start while this gc runs).
    let min_age = temp_age_from_env();
    for prefix in
        ["", "data/", "index/", "snapshots/", "checkpoints/", "gc/", "protected/"].into_iter().filter(|_| !dry_run)
    {
        match store.remove_partial(prefix, min_age) {
            Ok((0, _)) => {}
            Ok((n, bytes)) => log::warn!(
                "removed {n} partly written object(s) ({bytes} bytes) {} of {}, left by interrupted writers",
                if prefix.is_empty() { "at the top".to_string() } else { format!("under {prefix}") },
                store.describe()
            ),
            Err(e) => {
                return Err(Error::store(format!("cannot remove partly written objects from {}", store.describe()), e))
            }
        }
    }
    // The records of earlier gcs: ripe when every backup they name is gone, no older
    // ferry's backup runs, and the margin has passed.
    let condemned = repo.condemned()?;
    let now = jiff::Timestamp::now();
    let margin = jiff::SignedDuration::try_from(opts.condemn_margin).unwrap_or(jiff::SignedDuration::MAX);
    let ripe_record = |r: &crate::format::CondemnedRecord| {
        blocked.is_none()
            && r.backups.iter().all(|b| !running.iter().any(|l| l.lock == b.lock))
            && (r.backups.is_empty() || parse_time(&r.time).is_some_and(|t| now.duration_since(t) >= margin))
    };
    let (ripe, waiting): (Vec<_>, Vec<_>) = condemned.records.iter().partition(|(_, r)| ripe_record(r));
    let pending: HashSet<Digest> = waiting.iter().flat_map(|(_, r)| crate::condemn::record_packs(r)).collect();
    let ripe_packs: HashSet<Digest> =
        ripe.iter().flat_map(|(_, r)| crate::condemn::record_packs(r)).filter(|p| !pending.contains(p)).collect();
    if let Some(why) = &blocked {
        if !condemned.records.is_empty() {
            log::warn!("gc deletes no condemned pack now: {why}");
        }
    }
    let stop =
        |what: String| Error::Invalid(format!("gc stopped before deleting anything: {what}; run `ferry repo check`"));
    // 1. The live set.
    // The snapshots' distinct pages, by id through a sorter that spills to a file past its
    // budget, as the manifests are listed (a few at a time): no list of every snapshot's
    // pages is held (it grows with every snapshot).
    let mut distinct = Sorter::<32>::for_repo(repo, "gc's list of the snapshots' pages");
    // The ids of the manifests whose pages are in `distinct`: those hidden by their
    // migration among them (not in `snaps`) are named if one of their pages fails.
    let mut paged: Vec<String> = Vec::new();
    let mut snaps = repo
        .snapshots_paging(&mut |s, pages| {
            paged.push(s.id.clone());
            pages.nonzero().iter().try_for_each(|d| distinct.push(*d))
        })
        .map_err(|e| match e {
            e @ Error::Store { .. } => e,
            e => stop(e.to_string()),
        })?;
    let hidden = hidden_by_migration(&snaps, paged);
    if let Some(l) = &_lock {
        crate::migrate::finish_migrated(repo, &snaps, l)?;
    }
    if let Some(l) = &_lock {
        prune_marks(repo, &snaps, l)?;
    }
    // Checkpoints of interrupted backups keep what they stored, so that a resume need not
    // store it again (FORMAT.md §7a); one that cannot be read cannot be resumed either.
    let (checkpoints, bad) = repo.checkpoints_lenient()?;
    for (name, e) in bad {
        log::warn!("{name} is not kept: {e}");
    }
    let mut marked = Marked {
        snapshots: snaps.iter().map(|s| s.id.clone()).collect(),
        index: HashSet::new(),
        checkpoints: checkpoints.iter().map(|c| (c.object.clone(), c.checkpoint.clone())).collect(),
    };
    marked.checkpoints.sort_by(|a, b| a.0.cmp(&b.0));
    for c in &checkpoints {
        let s = c.as_snapshot();
        repo.pages(&s)?.nonzero().iter().try_for_each(|d| distinct.push(*d))?;
        snaps.push(s);
    }
    // 2. The index and the packs: each pack's blobs, once each (a pack indexed twice is
    // listed twice), in pack order, in a table on disk; and an index of the pages alone,
    // to read the snapshots' pages through. The index objects are read a few at a time.
    let mut index_listing =
        store.list("index/").map_err(|e| Error::store(format!("cannot list the index of {}", store.describe()), e))?;
    index_listing.sort();
    let mut page_objects: Vec<crate::repo::IndexObject> = Vec::new();
    let mut sorter = Sorter::<PACK_ENTRY>::for_repo(repo, "gc's list of the packs' blobs");
    let mut bad_index = None;
    // What each index object lists (its packs and their entry counts): to tell which of
    // them step 6 may keep as they are.
    let mut listings: Vec<ObjectPacks> = Vec::new();
    crate::repo::each_index_object(repo, &index_listing, |name, object| {
        let ps = match object {
            Ok(ps) => ps,
            Err(e) => {
                bad_index.get_or_insert(e);
                return Ok(());
            }
        };
        let mut listed = Vec::new();
        let mut page_packs = Vec::new();
        ps.each(|p| {
            listed.push((p.pack, p.blobs.len() as u32));
            for b in &p.blobs {
                sorter.push(pack_entry(&p.pack, b))?;
            }
            // Copied out, not collected from `into_iter`: that reuses the pack's whole list (every
            // blob's capacity kept for its few pages: 550 MB at 10M chunks).
            let pages: Vec<BlobEntry> = p.blobs.iter().filter(|b| b.kind.is_page()).cloned().collect();
            if !pages.is_empty() {
                page_packs.push(PackBlobs { pack: p.pack, blobs: pages });
            }
            Ok(())
        })?;
        listings.push(ObjectPacks { name: name.to_string(), packs: listed });
        page_objects.push((name.to_string(), page_packs));
        Ok(())
    })?;
    if let Some(e) = bad_index {
        return Err(stop(format!("{e}; `ferry repo repair` rebuilds the index from the packs")));
    }
    // Which copies are damaged: without the records, gc could keep a damaged copy and
    // free the good one.
    let (mut damage, bad) = repo.damage_lenient()?;
    if let Some((name, e)) = bad.into_iter().next() {
        return Err(stop(format!(
            "{e}; `ferry repo repair` removes {name}, then `ferry repo verify` finds the damage again"
        )));
    }
    let old_index: Vec<String> = index_listing.iter().map(|(n, _)| n.clone()).collect();
    marked.index = old_index.iter().cloned().collect();
    let listed: HashMap<String, u64> = store
        .list("data/")
        .map_err(|e| Error::store(format!("cannot list the packs of {}", store.describe()), e))?
        .into_iter()
        .collect();
    let index_bytes: u64 = index_listing.iter().map(|(_, l)| *l).sum();
    let mut report = GcReport { bytes_before: listed.values().sum::<u64>() + index_bytes, ..GcReport::default() };
    let packs = PackEntries::new(sorter)?;
    let all_present = packs.packs.iter().all(|(p, _, _)| listed.contains_key(&pack_name(p)));
    let index = prefer_good(page_objects, &damage);
    // The live set: each distinct page read once (a batch at a time), its id and its
    // entries' ids given to a sorter that spills to a file past its budget.
    let mut distinct = distinct.finish()?;
    let mut live = Sorter::<32>::for_repo(repo, "gc's live set");
    // Pages that cannot be read stop gc: the first few are kept to say which snapshot
    // they belong to. A record that cannot be spilled (the directory is full) stops the
    // reading at once.
    let mut failed: HashMap<Digest, String> = HashMap::new();
    let mut batch: Vec<Digest> = Vec::with_capacity(PAGE_BATCH);
    while failed.len() < GC_FAILED_PAGES {
        batch.clear();
        while let Some(d) = if batch.len() < PAGE_BATCH { distinct.next()? } else { None } {
            batch.push(d);
        }
        if batch.is_empty() {
            break;
        }
        try_for_pages(repo, &index, &batch, |d, page| match page {
            Ok(entries) => std::iter::once(d)
                .chain(entries.iter().filter(|e| **e != ZERO))
                .try_for_each(|e| live.push(repo.crypto.blob_id(e))),
            Err(why) => {
                failed.insert(*d, why);
                Ok(())
            }
        })?;
    }
    drop(distinct);
    if !failed.is_empty() {
        let mut first = None;
        each_snapshot_pages(repo, &snaps, |s, pages| {
            if first.is_none() {
                first = pages.nonzero().iter().find_map(|d| failed.get(d).map(|why| (object_of(s), *d, why.clone())));
            }
            Ok(())
        })?;
        // A page that only a manifest hidden by its migration lists (read with the others)
        // stops gc too: nothing is freed on a live set that lacks a page.
        let (object, d, why) = match first {
            Some(found) => found,
            None => {
                let (d, why) = failed.iter().min_by_key(|(d, _)| **d).map(|(d, w)| (*d, w.clone())).unwrap_or_default();
                (failed_page_object(repo, &hidden, &d), d, why)
            }
        };
        return Err(match index.blobs.contains_key(&repo.crypto.blob_id(&d)) {
            false => stop(format!(
                "{object}: {why} (where an index object was lost, `ferry repo repair` indexes its packs again)"
            )),
            true => stop(format!("{object}: {why}")),
        });
    }
    drop(index);
    let live = live.finish()?;
    // Each blob's copies in packs that are there: good ones before recorded-damaged ones
    // (FORMAT.md §7b), and copies in condemned packs after the others, else in pack order.
    let is_condemned = |p: &Digest| ripe_packs.contains(p) || pending.contains(p);
    let copies = copies(repo, &packs, &listed, &damage, &is_condemned)?;
    // The copies kept of each live blob (a blob with several keeps one, the others being
    // dead), one bit a copy.
    let mut spilled = crate::spill::Written::default();
    let kept = kept_copies(repo, live, copies, &packs, &mut damage, !dry_run, &mut spilled).map_err(|e| match e {
        e @ Error::Store { .. } => e,
        e => stop(e.to_string()),
    })?;
    spilled += packs.table.written();
    report.spill_runs = spilled.runs;
    report.spill_bytes = spilled.bytes;
    if spilled.runs > 0 {
        log::debug!("gc's sorters wrote {} MiB in {} temporary file(s)", spilled.bytes >> 20, spilled.runs);
    }
    let kept = match kept {
        Ok(kept) => kept,
        Err(id) => {
            return Err(stop(format!(
                "blob {} that a snapshot uses is in no indexed pack of the store (where an index object was lost, \
                 `ferry repo repair` indexes its packs again)",
                format::hex(&id)
            )))
        }
    };
    // 3. Classify packs: every pack that is there stays indexed until it is deleted; the
    // live blobs of partly dead ones are copied out, and those packs condemned.
    let plan =
        classify(&packs, &listed, &kept, &damage, opts.repack_percent, (&ripe_packs, &pending, !running.is_empty()))?;
    let Plan { mut keep, mut delete, condemn: mut to_condemn, repack, spared } = plan;
    report.packs_spared = spared;
    report.packs_waiting = pending.len() as u64;
    if dry_run {
        let backups = (!running.is_empty(), blocked.is_some());
        return Ok(dry_run_report(report, &listed, &delete, &to_condemn, &repack, &packs, backups));
    }
    if delete.is_empty()
        && to_condemn.is_empty()
        && ripe.is_empty()
        && condemned.unreadable.is_empty()
        && all_present
        && index_to_rewrite(&listings, &packs, &listed, &HashSet::new()).is_empty()
    {
        let present: HashSet<Digest> = listed.keys().filter_map(|n| pack_id(n)).collect();
        prune_records(repo, &damage, &present)?;
        report.bytes_after = report.bytes_before;
        report.index_kept = old_index.len() as u64;
        return Ok(report);
    }
    // The live blobs of the repacked packs, read a pack at a time (their entries read from
    // the table on disk, the kept ones by their bit), copied to new packs whose index
    // objects are stored as soon as their entries fill one: what gc holds of them is their
    // names and the new packs' ids.
    let mut new_index = NewIndex::default();
    let mut out = PackOut::default();
    for &(i, _) in &repack {
        let pack = &packs.packs[i].0;
        let name = pack_name(pack);
        let bytes = store.get(&name, format::MAX_PACK).map_err(|e| stop(format!("cannot read {name}: {e}")))?;
        // A pack recorded damaged does not match its name: each blob copied is checked.
        let recorded = damage.packs.contains_key(pack);
        if !recorded && sha256(&bytes) != *pack {
            return Err(stop(format!("{name} does not match its name (SHA-256): it is damaged")));
        }
        packs.each_blob(i, |j, b| {
            if !kept.keeps(i, j) {
                return Ok(());
            }
            let stored = bytes
                .get(b.offset as usize..b.offset as usize + b.stored_len as usize)
                .ok_or_else(|| stop(format!("{name} is shorter than its index says")))?;
            if recorded {
                repo.decode_blob(&b.id, &crate::BlobLocation::of(*pack, &b), b.kind, stored)
                    .map_err(|why| stop(format!("{name}: {why}; run `ferry repo verify`")))?;
            }
            out.add(&b, stored);
            if out.buf.len() >= crate::writer::DEFAULT_PACK_SIZE || out.entries.len() >= GC_PACK_BLOBS {
                new_index.add(repo, out.close(repo)?, GC_INDEX_SPLIT)?;
            }
            Ok(())
        })?;
        report.packs_repacked += 1;
    }
    drop(kept);
    if !out.entries.is_empty() {
        new_index.add(repo, out.close(repo)?, GC_INDEX_SPLIT)?;
    }
    // The new packs' index objects are all stored before the record (step 4): a backup
    // that reads the record finds every repacked copy in the index (a gc stopped here
    // leaves two indexed copies of those blobs, which the next gc sorts as any others).
    new_index.flush(repo, GC_INDEX_SPLIT)?;
    let NewIndex { names: mut new_names, packs: named, .. } = new_index;
    // They are this gc's own: not a sign that a backup stored something since the mark.
    marked.index.extend(new_names.iter().cloned());
    // A pack written again with the same bytes (a repack of a whole pack, or of a gc that
    // stopped before its index) has the name of the one it replaces: never condemned or
    // deleted.
    to_condemn.retain(|(p, _)| !named.contains(p));
    delete.retain(|(p, _)| !named.contains(p));
    // 4. The record of what this gc condemns, stored before anything is deleted. Where
    // no backup runs and nothing was stored since the mark, it is deleted at once.
    let mut own_records = Vec::new();
    let condemned_now: Vec<Digest> = to_condemn.iter().map(|(p, _)| *p).collect();
    match crate::condemn::condemn(repo, &condemned_now)? {
        Some((names, backups)) => {
            if backups.is_empty() && marked.unchanged(repo)? {
                delete.append(&mut to_condemn);
                own_records = names;
            } else {
                report.packs_condemned = to_condemn.len() as u64;
            }
        }
        None => to_condemn.clear(),
    }
    // 5. Index objects for every pack that stays and that an old object to be rewritten
    // lists (the new packs' are stored; an old object that lists only packs that stay,
    // each whole and nowhere else, is kept as it is), all stored before any old one is
    // removed (several when the repository is large: each stays readable).
    let deleting: HashSet<Digest> = delete.iter().map(|(p, _)| *p).collect();
    // A pack deleted now is listed by no new object, nor one written again whole (its
    // name again, step 3): the object stored for it there lists it.
    let gone: HashSet<Digest> = deleting.iter().chain(named.iter()).copied().collect();
    let rewrite = index_to_rewrite(&listings, &packs, &listed, &gone);
    // The packs of the rewritten objects, in the order those objects list them: the new
    // objects keep each old one's packs together, so that a later gc that deletes a few
    // packs again rewrites the objects that list those, not every one (in pack-id order,
    // each new object would hold packs from all over the repository).
    let mut rewritten_packs: HashMap<Digest, usize> = HashMap::new();
    for (p, _) in listings.iter().filter(|o| rewrite.contains(&o.name)).flat_map(|o| o.packs.iter()) {
        let next = rewritten_packs.len();
        rewritten_packs.entry(*p).or_insert(next);
    }
    drop(listings);
    keep.retain(|&i| {
        let p = &packs.packs[i].0;
        !gone.contains(p) && rewritten_packs.contains_key(p)
    });
    keep.sort_by_key(|&i| rewritten_packs[&packs.packs[i].0]);
    report.index_rewritten = rewrite.len() as u64;
    report.index_kept = old_index.len() as u64 - report.index_rewritten;
    log::debug!(
        "gc keeps {} index object(s) as they are and writes the {} of {} pack(s) anew",
        report.index_kept,
        report.index_rewritten,
        keep.len()
    );
    new_names.extend(put_new_index(repo, &packs, &keep, GC_INDEX_SPLIT)?);
    drop(keep);
    // Still ours: a gc whose lock was taken for stale stops before it deletes.
    if let Some(l) = &_lock {
        l.check()?;
    }
    // 6. The old index objects rewritten in step 5.
    for name in old_index.iter().filter(|n| rewrite.contains(*n) && !new_names.contains(n)) {
        store.delete(name).map_err(|e| Error::store(format!("cannot remove {name} from {}", store.describe()), e))?;
    }
    // 7. The packs: condemned by an earlier gc and still unused, or by this one at once.
    for (pack, dead) in &delete {
        let name = pack_name(pack);
        match store.delete(&name) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::store(format!("cannot remove {name} from {}", store.describe()), e)),
        }
        report.packs_deleted += 1;
        report.blobs_freed += dead;
    }
    // 8. The records done with (and those that cannot be read: what they condemned is
    // condemned again when it is still unused).
    for name in ripe.iter().map(|(n, _)| n).chain(own_records.iter()).chain(condemned.unreadable.iter().map(|(n, _)| n))
    {
        crate::condemn::remove(repo, name)?;
    }
    // 9. The damage records of packs that are gone, or were written again from blobs that
    // were each checked (a pack repacked whole has its old name again, §7b).
    let rewritten: HashSet<&Digest> =
        repack.iter().map(|&(i, _)| &packs.packs[i].0).filter(|p| named.contains(*p)).collect();
    let present: HashSet<Digest> =
        listed.keys().filter_map(|n| pack_id(n)).filter(|p| !deleting.contains(p) && !rewritten.contains(p)).collect();
    prune_records(repo, &damage, &present)?;
    let after_data: u64 = store.list("data/").map(|v| v.iter().map(|(_, l)| *l).sum()).unwrap_or(0);
    let after_index: u64 = store.list("index/").map(|v| v.iter().map(|(_, l)| *l).sum()).unwrap_or(0);
    report.bytes_after = after_data + after_index;
    report.bytes_freed = report.bytes_before.saturating_sub(report.bytes_after);
    Ok(report)
}

/// Removes the protection marks (FORMAT.md §11) of snapshots that are gone: no manifest
/// of that id, and none migrated from it. The marks are listed before the snapshots, so
/// that the mark of a snapshot stored meanwhile is kept (its manifest is in the second
/// listing); the gc lock is checked before each removal.
fn prune_marks(repo: &Repository, snaps: &[SnapshotInfo], lock: &lock::LockGuard) -> Result<()> {
    let store = &repo.store;
    let marks = crate::retain::protected(repo)?;
    let present: HashSet<String> = store
        .list("snapshots/")
        .map_err(|e| Error::store(format!("cannot list the snapshots of {}", store.describe()), e))?
        .into_iter()
        .filter_map(|(n, _)| n.strip_prefix("snapshots/").map(str::to_string))
        .collect();
    let migrated: HashSet<&str> = snaps.iter().filter_map(|s| s.manifest.migrated_from.as_deref()).collect();
    for id in marks {
        if present.contains(&id) || migrated.contains(id.as_str()) {
            continue;
        }
        let name = format!("{}{id}", crate::retain::PROTECTED);
        lock.check()?;
        log::info!("removing {name}: its snapshot is gone");
        store.delete(&name).map_err(|e| Error::store(format!("cannot remove {name} from {}", store.describe()), e))?;
    }
    Ok(())
}

/// A dry run's report from gc's plan: the packs deleted (and, with no backup running,
/// those condemned, which gc then deletes at once), condemned (backups running) and
/// repacked, and the bytes that frees. `(backups_running, blocked)`: blocked (a lock of an
/// older ferry's backup, or one that cannot be read), gc condemns nothing, so neither the
/// packs it would condemn nor the repacked ones are freed.
fn dry_run_report(
    mut report: GcReport,
    listed: &HashMap<String, u64>,
    delete: &[(Digest, u64)],
    condemn: &[(Digest, u64)],
    repack: &[(usize, u64)],
    packs: &PackEntries,
    (backups_running, blocked): (bool, bool),
) -> GcReport {
    let size = |p: &Digest| listed.get(&pack_name(p)).copied().unwrap_or(0);
    let mut gone: Vec<&(Digest, u64)> = delete.iter().collect();
    match (blocked, backups_running) {
        (true, _) => {}
        (false, true) => report.packs_condemned = condemn.len() as u64,
        (false, false) => gone.extend(condemn),
    }
    report.packs_deleted = gone.len() as u64;
    report.blobs_freed = gone.iter().map(|(_, dead)| dead).sum();
    // A repacked pack is condemned too: what it frees is what is not copied out of it,
    // once it is deleted (at once when no backup runs).
    let repacked: HashSet<&Digest> = repack.iter().map(|&(i, _)| &packs.packs[i].0).collect();
    report.bytes_freed = gone.iter().filter(|(p, _)| !repacked.contains(p)).map(|(p, _)| size(p)).sum();
    report.packs_repacked = repack.len() as u64;
    for &(i, live_bytes) in repack.iter().filter(|_| !backups_running && !blocked) {
        report.bytes_freed += size(&packs.packs[i].0).saturating_sub(live_bytes);
    }
    report.bytes_after = report.bytes_before.saturating_sub(report.bytes_freed);
    report
}

/// What gc does with each pack.
struct Plan {
    /// Packs that stay indexed (whole: condemned ones too, until they are deleted), by
    /// their number in [`PackEntries`].
    keep: Vec<usize>,
    /// Packs to delete now (condemned by an earlier gc, still unused), with their dead blobs.
    delete: Vec<(Digest, u64)>,
    /// Packs to condemn (unused, repacked or orphans), with their dead blobs.
    condemn: Vec<(Digest, u64)>,
    /// Packs whose live blobs (the copies [`Kept`] keeps) are copied to new packs: their
    /// number in [`PackEntries`] and the bytes of those blobs.
    repack: Vec<(usize, u64)>,
    /// Condemned packs that a snapshot uses again.
    spared: u64,
}

/// Sorts the packs (FORMAT.md §9): `ripe` are condemned by records that may be executed
/// (deleted when still unused, else spared), `pending` by records that wait.
fn classify(
    packs: &PackEntries,
    listed: &HashMap<String, u64>,
    kept: &Kept,
    damage: &DamageSet,
    repack_percent: u32,
    (ripe, pending, backups_running): (&HashSet<Digest>, &HashSet<Digest>, bool),
) -> Result<Plan> {
    let mut plan = Plan { keep: Vec::new(), delete: Vec::new(), condemn: Vec::new(), repack: Vec::new(), spared: 0 };
    // Orphans: in no index object.
    let mut orphans: Vec<Digest> = listed.keys().filter_map(|n| pack_id(n)).filter(|p| !packs.contains(p)).collect();
    orphans.sort_unstable();
    for (i, (pack, _, _)) in packs.packs.iter().enumerate() {
        if !listed.contains_key(&pack_name(pack)) {
            continue; // missing: nothing to keep or delete
        }
        // One pass over its blobs: how many are live, their bytes, and whether a live one
        // is recorded damaged.
        let recorded = damage.packs.contains_key(pack);
        let (mut n_all, mut n_live, mut live_bytes, mut all_bytes, mut live_damaged) =
            (0usize, 0usize, 0u64, 0u64, false);
        packs.each_blob(i, |j, b| {
            n_all += 1;
            all_bytes += b.stored_len as u64;
            if kept.keeps(i, j) {
                n_live += 1;
                live_bytes += b.stored_len as u64;
                live_damaged |= recorded && damage.is_damaged(pack, &b.id);
            }
            Ok(())
        })?;
        let n_dead = (n_all - n_live) as u64;
        if ripe.contains(pack) {
            if n_live == 0 {
                plan.delete.push((*pack, n_dead));
                plan.keep.push(i);
                continue;
            }
            // In use again: no longer condemned, it is sorted as any other pack.
            plan.spared += 1;
        }
        if pending.contains(pack) {
            plan.keep.push(i);
            continue;
        }
        let dead_bytes = all_bytes - live_bytes;
        let worth = dead_bytes.saturating_mul(100) >= all_bytes.saturating_mul(repack_percent as u64);
        if recorded && n_live > 0 {
            // Recorded damage: kept while it holds the only copy of a damaged blob in use;
            // else what is in use is copied out (each blob checked) and it is condemned.
            if !live_damaged {
                plan.repack.push((i, live_bytes));
                plan.condemn.push((*pack, n_dead));
            }
            plan.keep.push(i);
            continue;
        }
        if n_live == n_all || (n_live > 0 && !worth) {
            // Unused blobs below the threshold stay, indexed: still whole, and freed
            // once enough of their pack is unused.
            plan.keep.push(i);
            continue;
        }
        if n_live > 0 {
            plan.repack.push((i, live_bytes));
        }
        plan.condemn.push((*pack, n_dead));
        plan.keep.push(i);
    }
    // An orphan may be a running backup's pack that no index object lists yet: condemned,
    // it would be absent to that disk's next backup (whose base is the running one) until
    // a later gc spares it, and a change-map backup would refuse. So orphans are condemned
    // only by a gc that no backup ran beside when it started; one beside backups leaves
    // them to a later gc.
    for p in orphans {
        if ripe.contains(&p) {
            plan.delete.push((p, 0));
        } else if !pending.contains(&p) && !backups_running {
            plan.condemn.push((p, 0));
        }
    }
    Ok(plan)
}

/// A blob of a pack as gc's table of the packs' blobs holds it: the pack, the offset
/// (big-endian: the records sort in pack order, then by offset), the id, the kind, the
/// stored and the plain length.
const PACK_ENTRY: usize = 77;

fn pack_entry(pack: &Digest, b: &BlobEntry) -> [u8; PACK_ENTRY] {
    let mut r = [0u8; PACK_ENTRY];
    r[..32].copy_from_slice(pack);
    r[32..36].copy_from_slice(&b.offset.to_be_bytes());
    r[36..68].copy_from_slice(&b.id);
    r[68] = b.kind as u8;
    r[69..73].copy_from_slice(&b.stored_len.to_le_bytes());
    r[73..].copy_from_slice(&b.plain_len.to_le_bytes());
    r
}

fn blob_of(r: &[u8; PACK_ENTRY]) -> Result<BlobEntry> {
    let u32_at = |i: usize| [r[i], r[i + 1], r[i + 2], r[i + 3]];
    let mut id = [0u8; 32];
    id.copy_from_slice(&r[36..68]);
    let kind = match r[68] {
        0 => format::BlobKind::Data,
        1 => format::BlobKind::Page,
        2 => format::BlobKind::Located,
        k => return Err(Error::Invalid(format!("gc's table of the packs' blobs holds an unknown blob kind {k}"))),
    };
    Ok(BlobEntry {
        id,
        kind,
        offset: u32::from_be_bytes(u32_at(32)),
        stored_len: u32::from_le_bytes(u32_at(69)),
        plain_len: u32::from_le_bytes(u32_at(73)),
    })
}

/// Rows of gc's table of the packs' blobs read at a time by [`PackEntries::each_blob`].
#[cfg(not(test))]
const PACK_BLOCK: usize = 4096;
/// A few in the crate's tests, so that every pack in them is read in several blocks.
#[cfg(test)]
pub(crate) const PACK_BLOCK: usize = 3;

/// Every pack's blobs, once each (by offset and id), in pack order, then by offset: in a
/// table on disk, with a row per pack in memory.
struct PackEntries {
    /// Each pack (sorted), the number of its first blob in `table`, and how many it has.
    packs: Vec<(Digest, u64, u32)>,
    table: Table<PACK_ENTRY>,
}

impl PackEntries {
    /// The blobs given to `sorter`, each (pack, offset, id) once.
    fn new(sorter: Sorter<PACK_ENTRY>) -> Result<PackEntries> {
        let mut packs: Vec<(Digest, u64, u32)> = Vec::new();
        let mut last: Option<[u8; 68]> = None;
        let mut written = 0u64;
        let table = sorter.finish()?.into_table(|r| {
            let key: [u8; 68] = r[..68].try_into().unwrap_or([0; 68]);
            if last == Some(key) {
                return false;
            }
            last = Some(key);
            let pack: Digest = key[..32].try_into().unwrap_or(ZERO);
            match packs.last_mut() {
                Some(p) if p.0 == pack => p.2 += 1,
                _ => packs.push((pack, written, 1)),
            }
            written += 1;
            true
        })?;
        Ok(PackEntries { packs, table })
    }

    /// The blobs of pack `i`.
    fn blobs(&self, i: usize) -> Result<Vec<BlobEntry>> {
        let (_, first, n) = self.packs[i];
        self.table.read(first, n as usize)?.iter().map(blob_of).collect()
    }

    /// `f` over the blobs of pack `i` (their number in it, and the blob), read from the
    /// table [`PACK_BLOCK`] at a time: a pack of a million tiny blobs costs no list of them.
    fn each_blob(&self, i: usize, mut f: impl FnMut(usize, BlobEntry) -> Result<()>) -> Result<()> {
        let (_, first, n) = self.packs[i];
        let mut j = 0usize;
        while j < n as usize {
            let count = (n as usize - j).min(PACK_BLOCK);
            for r in self.table.read(first + j as u64, count)? {
                f(j, blob_of(&r)?)?;
                j += 1;
            }
        }
        Ok(())
    }

    /// Blob `j` of pack `i`.
    fn blob(&self, i: usize, j: u32) -> Result<BlobEntry> {
        let (_, first, _) = self.packs[i];
        blob_of(&self.table.read(first + j as u64, 1)?[0])
    }

    fn contains(&self, pack: &Digest) -> bool {
        self.packs.binary_search_by_key(pack, |p| p.0).is_ok()
    }
}

/// An index object as gc read it: its name, and each pack it lists with the number of
/// entries it lists for it.
struct ObjectPacks {
    name: String,
    packs: Vec<(Digest, u32)>,
}

/// An index object of fewer plain bytes than this is rewritten (merged with the others
/// rewritten) whenever gc rewrites at least two objects: backups store one small object
/// each, and without this their number would only grow.
#[cfg(not(test))]
const GC_INDEX_SMALL: usize = GC_INDEX_SPLIT / 2;
/// Small in the crate's tests, so that a backup of a few chunks stores an object gc keeps.
#[cfg(test)]
const GC_INDEX_SMALL: usize = 512;

/// The old index objects gc rewrites (FORMAT.md §9, step 5), given the packs it deletes
/// now (`gone`). One is kept as it is only when it says exactly what gc would write for
/// its packs: each pack it lists is in the store and stays (not `gone`), is listed by no
/// other object and only once by this one, and its entries are the pack's entries with
/// none twice (gc's table of the packs' blobs holds each once). The small objects that
/// would be kept are rewritten too when at least two objects are rewritten in all, merged
/// into as few as the split allows.
fn index_to_rewrite(
    objects: &[ObjectPacks],
    packs: &PackEntries,
    listed: &HashMap<String, u64>,
    gone: &HashSet<Digest>,
) -> HashSet<String> {
    let mut listings: HashMap<&Digest, u32> = HashMap::new();
    for o in objects {
        for (p, _) in &o.packs {
            *listings.entry(p).or_default() += 1;
        }
    }
    let exact = |o: &ObjectPacks| {
        o.packs.iter().all(|(p, n)| {
            listings.get(p) == Some(&1)
                && !gone.contains(p)
                && listed.contains_key(&pack_name(p))
                && packs.packs.binary_search_by_key(p, |r| r.0).is_ok_and(|i| packs.packs[i].2 == *n)
        })
    };
    let plain_len =
        |o: &ObjectPacks| 12 + o.packs.iter().map(|(_, n)| 36 + *n as usize * format::ENTRY_LEN).sum::<usize>();
    let mut rewrite = HashSet::new();
    let mut small = Vec::new();
    for o in objects {
        if !exact(o) {
            rewrite.insert(o.name.clone());
        } else if plain_len(o) < GC_INDEX_SMALL {
            small.push(o.name.clone());
        }
    }
    if rewrite.len() + small.len() >= 2 {
        rewrite.extend(small);
    }
    rewrite
}

/// Stores index objects for the packs `keep` of `packs` (FORMAT.md §6), each of at most
/// `split` bytes, reading the blobs of one object's packs at a time. Returns their names.
fn put_new_index(repo: &Repository, packs: &PackEntries, keep: &[usize], split: usize) -> Result<Vec<String>> {
    let counts: Vec<usize> = keep.iter().map(|&i| packs.packs[i].2 as usize).collect();
    let mut names = Vec::new();
    for (start, end) in crate::repo::splits_of(&counts, split) {
        let mut object = Vec::with_capacity(end - start);
        for &i in &keep[start..end] {
            object.push(PackBlobs { pack: packs.packs[i].0, blobs: packs.blobs(i)? });
        }
        names.extend(repo.put_index_split(&object, split)?.0);
    }
    Ok(names)
}

/// The index of the packs a gc writes, stored as they are written: the entries of new
/// packs are held until they fill an index object of at most `split` bytes, which is then
/// stored; the names of those objects and the new packs' ids are kept.
#[derive(Default)]
struct NewIndex {
    held: Vec<PackBlobs>,
    names: Vec<String>,
    packs: HashSet<Digest>,
}

impl NewIndex {
    /// A new pack; stores the index objects that the packs held fill.
    fn add(&mut self, repo: &Repository, pack: PackBlobs, split: usize) -> Result<()> {
        self.packs.insert(pack.pack);
        self.held.push(pack);
        let splits = crate::repo::index_splits(&self.held, split);
        if splits.len() > 1 {
            // Every object but the last is full: stored now, the last one waits for more.
            let (full, _) = splits[splits.len() - 1];
            let (names, _) = repo.put_index_split(&self.held[..full], split)?;
            self.names.extend(names);
            self.held.drain(..full);
        }
        Ok(())
    }

    /// Stores the index object of the packs held.
    fn flush(&mut self, repo: &Repository, split: usize) -> Result<()> {
        if !self.held.is_empty() {
            self.names.extend(repo.put_index_split(&self.held, split)?.0);
            self.held.clear();
        }
        Ok(())
    }
}

/// One copy of a blob, from [`copies`].
#[derive(Clone, Copy)]
struct CopyRef {
    /// The pack, as an index into the list of packs.
    pack: u32,
    /// The blob, as an index into the pack's blobs.
    entry: u32,
}

/// A copy as [`copies`] sorts it: the blob id, a rank (0: a good copy, 1: in a condemned
/// pack, 2: recorded damaged, 3: both), the pack and the entry (big-endian, so that the
/// bytes sort as the numbers do).
const COPY: usize = 41;

fn copy_record(id: &Digest, rank: u8, pack: u32, entry: u32) -> [u8; COPY] {
    let mut r = [0u8; COPY];
    r[..32].copy_from_slice(id);
    r[32] = rank;
    r[33..37].copy_from_slice(&pack.to_be_bytes());
    r[37..].copy_from_slice(&entry.to_be_bytes());
    r
}

fn copy_of(r: &[u8; COPY]) -> CopyRef {
    let u32_at = |i: usize| u32::from_be_bytes([r[i], r[i + 1], r[i + 2], r[i + 3]]);
    CopyRef { pack: u32_at(33), entry: u32_at(37) }
}

/// Every copy of every blob in the packs that are there, sorted by blob id, then by
/// preference (good copies before recorded-damaged ones, FORMAT.md §7b; copies in condemned
/// packs after the others, §8a), then in pack order; kept in a sorter that spills to a file
/// past its budget.
fn copies(
    repo: &Repository,
    packs: &PackEntries,
    listed: &HashMap<String, u64>,
    damage: &DamageSet,
    condemned: &dyn Fn(&Digest) -> bool,
) -> Result<Sorted<COPY>> {
    let mut v = Sorter::<COPY>::for_repo(repo, "gc's list of the copies of each blob");
    for (i, (pack, _, _)) in packs.packs.iter().enumerate() {
        if !listed.contains_key(&pack_name(pack)) {
            continue;
        }
        let in_condemned = u8::from(condemned(pack));
        packs.each_blob(i, |j, b| {
            let rank = 2 * u8::from(damage.is_damaged(pack, &b.id)) + in_condemned;
            v.push(copy_record(&b.id, rank, i as u32, j as u32))
        })?;
    }
    v.finish()
}

/// The copies gc keeps: one bit a copy, per pack (in the order of its blobs), so that what
/// gc holds of the live set is a bit a blob, not its id.
struct Kept(Vec<Vec<u64>>);

impl Kept {
    fn new(packs: &PackEntries) -> Kept {
        Kept(packs.packs.iter().map(|(_, _, n)| vec![0; (*n as usize).div_ceil(64)]).collect())
    }

    fn set(&mut self, c: CopyRef) {
        self.0[c.pack as usize][c.entry as usize / 64] |= 1 << (c.entry % 64);
    }

    /// Whether gc keeps blob `entry` of pack `pack`.
    fn keeps(&self, pack: usize, entry: usize) -> bool {
        self.0[pack][entry / 64] >> (entry % 64) & 1 == 1
    }
}

/// Neighbouring copies that [`kept_copies`] checks are read in one ranged read when the
/// bytes between them are at most this many (read and thrown away: cheaper than another
/// request).
const COPY_GAP: u64 = 1 << 20;
/// The most bytes one ranged read of [`kept_copies`] asks for (unless one copy is larger).
const COPY_SPAN: u64 = 8 << 20;

/// The place of a copy as a record that sorts in pack order: the pack's number and the
/// entry's (big-endian).
fn place_record(c: CopyRef) -> [u8; 8] {
    let mut r = [0u8; 8];
    r[..4].copy_from_slice(&c.pack.to_be_bytes());
    r[4..].copy_from_slice(&c.entry.to_be_bytes());
    r
}

/// The copies gc keeps of each blob of the `live` set, its `copies` (sorted, the preferred
/// first) merged with it in id order. A blob with one copy in packs that are there keeps
/// it; one with several keeps the first that reads back and checks (decoded, its digest
/// its id): no copy is dropped on the strength of another that was not read. Copies that
/// fail the check are recorded damaged in `damage` (and stored when `record`, as `verify`
/// records them; a dry run only says so); where none passes, every copy stays.
/// `Ok(Err(id))`: live blob `id` has no copy in a pack that is there.
///
/// The preferred copies of the blobs with several are read in pack order, neighbours in
/// one ranged read ([`COPY_GAP`], [`COPY_SPAN`]), not a read each in id order: their
/// places, and the copies of those blobs, go through two more sorters, so that memory
/// stays bounded. Only where a preferred copy fails are the others read, one at a time.
/// What the sorters wrote is added to `written`.
fn kept_copies(
    repo: &Repository,
    mut live: Sorted<32>,
    mut copies: Sorted<COPY>,
    packs: &PackEntries,
    damage: &mut DamageSet,
    record: bool,
    written: &mut crate::spill::Written,
) -> Result<Result<Kept, Digest>> {
    let mut kept = Kept::new(packs);
    // The preferred copy of each blob with several, by place; and all their copies.
    let mut first = Sorter::<8>::for_repo(repo, "gc's list of the copies to check");
    let mut several = Sorter::<COPY>::for_repo(repo, "gc's list of the blobs with several copies");
    let mut next = copies.next()?;
    let mut cs: Vec<[u8; COPY]> = Vec::new();
    while let Some(id) = live.next()? {
        // The copies of blobs no snapshot uses (before this one) are not kept.
        while next.is_some_and(|c| c[..32] < id[..]) {
            next = copies.next()?;
        }
        cs.clear();
        while let Some(c) = next.filter(|c| c[..32] == id[..]) {
            cs.push(c);
            next = copies.next()?;
        }
        match cs.len() {
            0 => return Ok(Err(id)),
            1 => kept.set(copy_of(&cs[0])),
            _ => {
                first.push(place_record(copy_of(&cs[0])))?;
                cs.iter().try_for_each(|c| several.push(*c))?;
            }
        }
    }
    *written += live.written();
    *written += copies.written();
    drop((live, copies));
    // The preferred copies, in pack order: those that fail, with why.
    let mut first = first.finish()?;
    let mut failed: HashMap<(u32, u32), String> = HashMap::new();
    let mut entries: Vec<u32> = Vec::new();
    let mut pack = None;
    loop {
        let rec = first.next()?;
        let place = rec.map(|r| copy_of_place(&r));
        if pack.is_some() && place.map(|c| c.pack) != pack {
            let i = pack.unwrap_or(0);
            for (j, why) in check_copies(repo, packs, i, &entries)? {
                match why {
                    None => kept.set(CopyRef { pack: i, entry: j }),
                    Some(why) => {
                        failed.insert((i, j), why);
                    }
                }
            }
            entries.clear();
        }
        let Some(c) = place else { break };
        pack = Some(c.pack);
        entries.push(c.entry);
    }
    *written += first.written();
    drop(first);
    // Each blob with several copies: where its preferred copy checks, every copy of it in
    // that pack is kept; else the next copies are read, one at a time, until one checks.
    let mut several = several.finish()?;
    let mut found: Vec<(Digest, Digest, String)> = Vec::new();
    let mut next = several.next()?;
    while let Some(head) = next {
        cs.clear();
        while let Some(c) = next.filter(|c| c[..32] == head[..32]) {
            cs.push(c);
            next = several.next()?;
        }
        let refs: Vec<CopyRef> = cs.iter().map(copy_of).collect();
        let mut good = Some(refs[0].pack);
        if let Some(why) = failed.remove(&(refs[0].pack, refs[0].entry)) {
            good = None;
            let mut why = Some(why);
            for (k, c) in refs.iter().enumerate() {
                let pack = &packs.packs[c.pack as usize].0;
                let b = packs.blob(c.pack as usize, c.entry)?;
                let result = match why.take() {
                    Some(why) if k == 0 => Err(why),
                    _ => read_copy(repo, pack, &b)?,
                };
                match result {
                    Ok(()) => {
                        good = Some(c.pack);
                        break;
                    }
                    Err(why) => {
                        log::warn!("{}: {why}: this copy is not kept where another reads back well", pack_name(pack));
                        if !damage.is_damaged(pack, &b.id) {
                            found.push((*pack, b.id, why));
                        }
                    }
                }
            }
        }
        // The good copy's pack keeps every copy of the blob in it; where none is good,
        // every copy stays.
        for c in refs.iter().filter(|c| good.is_none_or(|p| c.pack == p)) {
            kept.set(*c);
        }
    }
    *written += several.written();
    if !found.is_empty() && record {
        crate::damage::record_found(repo, damage, found)?;
    } else if !found.is_empty() {
        log::warn!(
            "{} damaged cop(ies) of live blobs found in {} (not recorded: a dry run writes nothing; `ferry repo \
             verify` records them)",
            found.len(),
            repo.store.describe()
        );
    }
    Ok(Ok(kept))
}

fn copy_of_place(r: &[u8; 8]) -> CopyRef {
    CopyRef { pack: u32::from_be_bytes([r[0], r[1], r[2], r[3]]), entry: u32::from_be_bytes([r[4], r[5], r[6], r[7]]) }
}

/// Reads and checks the blobs `entries` (ascending) of pack `i`, neighbours in one ranged
/// read: each entry, and `None` where it checks, else why not. A range that cannot be read
/// whole (a truncated pack) is read again a blob at a time, so that each copy is judged
/// on its own bytes. Any other store error stops gc.
fn check_copies(repo: &Repository, packs: &PackEntries, i: u32, entries: &[u32]) -> Result<Vec<(u32, Option<String>)>> {
    let pack = &packs.packs[i as usize].0;
    // The pack's blobs, read from the table a window at a time (a pack may list up to
    // [`format::PACK_BLOBS`]): each range's blobs are read again for their checks.
    let mut window = PackWindow::new(packs, i as usize);
    let name = pack_name(pack);
    let mut out = Vec::with_capacity(entries.len());
    let mut rest = entries;
    while let Some(&j0) = rest.first() {
        let b0 = window.get(j0)?.ok_or_else(|| Error::Invalid(format!("{name} has no blob {j0}")))?;
        let start = b0.offset as u64;
        let mut end = start + b0.stored_len as u64;
        let mut n = 1;
        while let Some(&j) = rest.get(n) {
            let Some(b) = window.get(j)? else { break };
            let (s, e) = (b.offset as u64, b.offset as u64 + b.stored_len as u64);
            if s < end || s - end > COPY_GAP || e - start > COPY_SPAN {
                break;
            }
            end = e;
            n += 1;
        }
        let (range, after) = rest.split_at(n);
        rest = after;
        let bytes = match repo.store.get_range(&name, start, end - start) {
            Ok(bytes) => Some(bytes),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::InvalidData) => None,
            Err(e) => return Err(Error::store(format!("cannot read {name} from {}", repo.store.describe()), e)),
        };
        for &j in range {
            let b = window.get(j)?.ok_or_else(|| Error::Invalid(format!("{name} has no blob {j}")))?;
            let at = (b.offset as u64 - start) as usize;
            let result = match bytes.as_ref().and_then(|v| v.get(at..at + b.stored_len as usize)) {
                Some(stored) => repo.decode_blob(&b.id, &crate::BlobLocation::of(*pack, &b), b.kind, stored).map(drop),
                None => read_copy(repo, pack, &b)?,
            };
            out.push((j, result.err()));
        }
    }
    Ok(out)
}

/// The blobs of one pack of gc's table, read [`PACK_BLOCK`] rows at a time as they are
/// asked for: at most one block of them held.
struct PackWindow<'a> {
    packs: &'a PackEntries,
    pack: usize,
    /// The number of the first blob held, and the blobs held.
    first: u32,
    rows: Vec<BlobEntry>,
}

impl<'a> PackWindow<'a> {
    fn new(packs: &'a PackEntries, pack: usize) -> PackWindow<'a> {
        PackWindow { packs, pack, first: 0, rows: Vec::new() }
    }

    /// Blob `j` of the pack, `None` past its last; the block that holds it read where it
    /// is not the one held.
    fn get(&mut self, j: u32) -> Result<Option<BlobEntry>> {
        let (_, start, n) = self.packs.packs[self.pack];
        if j >= n {
            return Ok(None);
        }
        if j < self.first || j - self.first >= self.rows.len() as u32 {
            let count = ((n - j) as usize).min(PACK_BLOCK);
            #[cfg(test)]
            PACK_ROWS_MOST.with(|m| m.set(m.get().max(count)));
            self.rows = self.packs.table.read(start + j as u64, count)?.iter().map(blob_of).collect::<Result<_>>()?;
            self.first = j;
        }
        Ok(self.rows.get((j - self.first) as usize).copied())
    }
}

#[cfg(test)]
thread_local! {
    /// The most rows of gc's table of the packs' blobs read at once by this thread to
    /// check copies (the crate's tests).
    pub(crate) static PACK_ROWS_MOST: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Reads and checks one copy: `Ok(Err(why))` where it is damaged (a short or unreadable
/// copy, a truncated pack, is damage as a failed check is); any other store error stops gc.
fn read_copy(repo: &Repository, pack: &Digest, b: &BlobEntry) -> Result<Result<(), String>> {
    let name = pack_name(pack);
    match repo.store.get_range(&name, b.offset as u64, b.stored_len as u64) {
        Ok(stored) => Ok(repo.decode_blob(&b.id, &crate::BlobLocation::of(*pack, b), b.kind, &stored).map(drop)),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::InvalidData) => {
            Ok(Err(format!("it cannot be read whole: {e}")))
        }
        Err(e) => Err(Error::store(format!("cannot read {name} from {}", repo.store.describe()), e)),
    }
}

/// Of the manifests listed with their pages (`paged`, by id), those that `snaps` lacks
/// (hidden by their migration: [`crate::repo::hide_migrated`]), each with the id of the
/// snapshot migrated from it.
fn hidden_by_migration(snaps: &[SnapshotInfo], paged: Vec<String>) -> Vec<(String, String)> {
    let shown: HashSet<&str> = snaps.iter().map(|s| s.id.as_str()).collect();
    let to: HashMap<&str, &str> =
        snaps.iter().filter_map(|s| s.manifest.migrated_from.as_deref().map(|old| (old, s.id.as_str()))).collect();
    paged
        .into_iter()
        .filter(|id| !shown.contains(id.as_str()))
        .map(|id| {
            let new = to.get(id.as_str()).map_or_else(String::new, |n| n.to_string());
            (id, new)
        })
        .collect()
}

/// What gc names for page `d` that failed and that no snapshot or checkpoint it keeps
/// lists: the manifest from before a migration that lists it (read again), else what
/// gc knows of where it came from.
pub(crate) fn failed_page_object(repo: &Repository, hidden: &[(String, String)], d: &Digest) -> String {
    let page = format::hex(d);
    let migrated = |(old, new): &(String, String)| match new.is_empty() {
        true => format!("snapshots/{old}"),
        false => format!("snapshots/{old} (the manifest from before its migration to snapshot {new})"),
    };
    for h in hidden {
        let lists = repo.read_snapshot(&format!("snapshots/{}", h.0)).and_then(|s| repo.pages(&s));
        if lists.is_ok_and(|p| p.nonzero().contains(d)) {
            return format!("page {page} of {}", migrated(h));
        }
    }
    match hidden {
        // Only manifests hidden by their migration were listed beside the snapshots kept:
        // one of them listed it, removed since (this gc finishes migrations first).
        [h] => format!("page {page} of {}, removed since", migrated(h)),
        [] => format!(
            "page {page}, which a manifest listed when gc began and no snapshot or checkpoint lists now (its \
             manifest was removed meanwhile)"
        ),
        _ => format!(
            "page {page} of one of {} manifests from before their migration, removed since ({}, ...)",
            hidden.len(),
            migrated(&hidden[0])
        ),
    }
}

/// The object a snapshot (or a checkpoint read as one) is.
fn object_of(s: &SnapshotInfo) -> String {
    if s.id.contains('/') {
        s.id.clone()
    } else {
        format!("snapshots/{}", s.id)
    }
}

/// gc closes a pack it fills at this many blobs, if it is not full before: a pack of
/// tiny blobs (a few bytes each) would otherwise hold millions, more than a trailer may
/// list (FORMAT.md §5: [`format::MAX_TRAILER_ENTRIES`]), and its entries and trailer,
/// held and copied while it is sealed, would cost gc more memory than its bytes.
const GC_PACK_BLOBS: usize = format::PACK_BLOBS;

/// A pack being filled by gc with stored blobs as they are.
#[derive(Default)]
struct PackOut {
    buf: Vec<u8>,
    entries: Vec<BlobEntry>,
}

impl PackOut {
    fn add(&mut self, b: &BlobEntry, stored: &[u8]) {
        if self.buf.capacity() == 0 {
            // Once, for the whole pack and its trailer: a buffer that grows by doubling
            // holds twice its bytes while it is moved.
            let trailer = GC_PACK_BLOBS * format::ENTRY_LEN + 4096;
            self.buf.reserve_exact(crate::writer::DEFAULT_PACK_SIZE + stored.len().max(2 << 20) + trailer);
            self.entries.reserve_exact(GC_PACK_BLOBS);
        }
        self.entries.push(BlobEntry { offset: self.buf.len() as u32, ..*b });
        self.buf.extend_from_slice(stored);
    }
    fn close(&mut self, repo: &Repository) -> Result<PackBlobs> {
        let mut buf = std::mem::take(&mut self.buf);
        let entries = std::mem::take(&mut self.entries);
        let trailer = format::encode_trailer(&entries);
        let before = buf.len();
        repo.crypto.seal_into(AAD_TRAILER, &trailer, &mut buf);
        let tl = (buf.len() - before) as u32;
        buf.extend_from_slice(&format::pack_tail(tl));
        let digest = sha256(&buf);
        let name = pack_name(&digest);
        repo.store
            .put(&name, &buf)
            .map_err(|e| Error::store(format!("cannot store {name} in {}", repo.store.describe()), e))?;
        Ok(PackBlobs { pack: digest, blobs: entries })
    }
}

/// The snapshots among `snaps` that read a blob whose only copy is recorded damaged
/// (FORMAT.md §7b), each with that copy's pack: what `ferry repo list` marks damaged.
/// Reads the index and the pages only when there are damage records.
pub fn damaged_snapshots(repo: &Repository, snaps: &[SnapshotInfo]) -> Result<HashMap<String, String>> {
    let mut out = HashMap::new();
    let damage = repo.damage()?;
    if damage.is_empty() {
        return Ok(out);
    }
    let (table, page_objects, bad_index) = BlobTable::read(repo)?;
    for (name, e) in bad_index {
        log::warn!("skipping {name}: {e}; `ferry repo repair` rebuilds the index from the packs");
    }
    // The blobs whose every copy is recorded damaged, each with its first copy's pack.
    let mut bad: HashMap<&Digest, Digest> = HashMap::new();
    for id in damage.packs.values().flat_map(|c| c.blobs.iter()) {
        let mut copies = table.locations(id);
        if let Some(first) = copies.clone().next() {
            if copies.all(|l| damage.is_damaged(&table.packs[l.pack as usize], id)) {
                bad.insert(id, table.packs[first.pack as usize]);
            }
        }
    }
    if bad.is_empty() {
        return Ok(out);
    }
    let bad_blob = |d: &Digest| bad.get(&repo.crypto.blob_id(d)).copied();
    // Each distinct page once: the pack of the first damaged blob it reads, if any.
    let pages_index = prefer_good(page_objects, &damage);
    let mut page_hit: HashMap<Digest, Digest> = HashMap::new();
    let snap_pages = snapshot_pages(repo, snaps)?;
    for_pages(repo, &pages_index, &distinct_pages(&snap_pages, |d| bad_blob(d).is_none()), |d, page| {
        if let Some(pack) = page.ok().and_then(|e| e.iter().filter(|e| **e != ZERO).find_map(bad_blob)) {
            page_hit.insert(*d, pack);
        }
    });
    for (s, sp) in snaps.iter().zip(&snap_pages) {
        let hit = sp.nonzero().iter().find_map(|d| bad_blob(d).or_else(|| page_hit.get(d).copied()));
        if let Some(pack) = hit {
            out.insert(s.id.clone(), pack_name(&pack));
        }
    }
    Ok(out)
}

#[derive(Debug, Default, Serialize)]
pub struct Stats {
    pub snapshots: u64,
    pub disks: u64,
    /// Sum of the snapshots' sizes.
    pub logical: u64,
    /// Bytes of the distinct chunks the snapshots reference, before compression.
    pub unique_plain: u64,
    /// Their stored bytes.
    pub unique_stored: u64,
    /// Bytes of every pack and index object in the store.
    pub store_bytes: u64,
    pub packs: u64,
    pub chunks: u64,
}

pub fn stats(repo: &Repository) -> Result<Stats> {
    let store = &repo.store;
    let (snaps, bad) = repo.snapshots_with_pages_lenient()?;
    for (name, e) in &bad {
        crate::repo::warn_skipped(name, e);
    }
    let (table, page_objects, mut bad_index) = BlobTable::read(repo)?;
    if let Some((_, e)) = bad_index.pop() {
        return Err(e);
    }
    let damage = repo.damage()?;
    let pages_index = prefer_good(page_objects, &damage);
    let mut s = Stats { snapshots: snaps.len() as u64, ..Stats::default() };
    let disks: HashSet<&str> = snaps.iter().map(|s| s.manifest.name.as_str()).collect();
    s.disks = disks.len() as u64;
    s.logical = snaps.iter().map(|s| s.manifest.size).sum();
    // Each distinct page once; each chunk counted once (a bit a location), with its size
    // where the index has it.
    let mut seen = vec![0u64; table.len().div_ceil(64)];
    let mut unindexed: HashSet<Digest> = HashSet::new();
    let mut failed = None;
    let snap_pages = snapshot_pages(repo, &snaps)?;
    for_pages(repo, &pages_index, &distinct_pages(&snap_pages, |_| true), |d, page| {
        let page = match page {
            Ok(page) => page,
            Err(why) => {
                failed.get_or_insert_with(|| Error::damaged(format!("page {}", format::hex(d)), why));
                return;
            }
        };
        for e in page.iter().filter(|e| **e != ZERO) {
            let id = repo.crypto.blob_id(e);
            match table.find(&id) {
                Some(row) if seen[row / 64] & (1 << (row % 64)) == 0 => {
                    seen[row / 64] |= 1 << (row % 64);
                    if let Some(l) = table.first(&id, &damage) {
                        s.unique_plain += l.plain_len as u64;
                        s.unique_stored += l.stored_len as u64;
                    }
                }
                Some(_) => {}
                None => {
                    unindexed.insert(id);
                }
            }
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    let seen: u64 = seen.iter().map(|u| u.count_ones() as u64).sum();
    s.chunks = seen + unindexed.len() as u64;
    let data = store.list("data/").map_err(|e| Error::store(format!("cannot list {}", store.describe()), e))?;
    let idx = store.list("index/").map_err(|e| Error::store(format!("cannot list {}", store.describe()), e))?;
    s.packs = data.len() as u64;
    s.store_bytes = data.iter().chain(&idx).map(|(_, l)| *l).sum();
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pack_entry_reads_back_and_an_unknown_kind_is_an_error() {
        let b =
            BlobEntry { id: [7; 32], kind: format::BlobKind::Located, offset: 513, stored_len: 99, plain_len: 4096 };
        let mut r = pack_entry(&[3; 32], &b);
        let back = blob_of(&r).unwrap();
        assert_eq!((back.id, back.kind, back.offset, back.stored_len, back.plain_len), (b.id, b.kind, 513, 99, 4096));
        r[68] = 3;
        assert!(blob_of(&r).is_err());
    }
}
