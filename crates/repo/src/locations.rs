//! Every blob location the index objects list, for check and verify in bounded memory at
//! any repository size (issue 35): the locations are sorted by blob id into a table in an
//! unlinked file ([`crate::spill`]) and read back in order, one id's locations at a time,
//! to be joined with other records sorted the same way (the chunks the snapshots' pages
//! use, the places their hints name); for verify they are sorted again, by pack. A few
//! numbers a pack are kept in memory; nothing a blob.
use crate::format::{BlobEntry, BlobKind, Digest, PackBlobs};
use crate::repo::{each_index_object, Failures, IndexObject, Repository};
use crate::spill::{Sorted, Sorter, Table};
use crate::{Error, Result};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

/// A location as its record holds it: the id, the order listed (big-endian: an id's
/// locations sort in the order the index objects list them), the pack's number, the
/// offset, the stored and the plain length, the kind.
const LOC: usize = 53;

/// One location of one blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    pub id: Digest,
    /// Its place in the order the index objects (by name) list the locations.
    pub listed: u32,
    /// The pack's number in [`Locations::packs`].
    pub pack: u32,
    pub offset: u32,
    pub stored_len: u32,
    pub plain_len: u32,
    pub kind: BlobKind,
}

impl Loc {
    pub fn entry(&self) -> BlobEntry {
        BlobEntry {
            id: self.id,
            kind: self.kind,
            offset: self.offset,
            stored_len: self.stored_len,
            plain_len: self.plain_len,
        }
    }

    fn record(&self) -> [u8; LOC] {
        let mut r = [0u8; LOC];
        r[..32].copy_from_slice(&self.id);
        r[32..36].copy_from_slice(&self.listed.to_be_bytes());
        r[36..40].copy_from_slice(&self.pack.to_be_bytes());
        r[40..44].copy_from_slice(&self.offset.to_be_bytes());
        r[44..48].copy_from_slice(&self.stored_len.to_be_bytes());
        r[48..52].copy_from_slice(&self.plain_len.to_be_bytes());
        r[52] = self.kind as u8;
        r
    }

    fn of(r: &[u8; LOC]) -> Result<Loc> {
        let kind = match r[52] {
            0 => BlobKind::Data,
            1 => BlobKind::Page,
            2 => BlobKind::Located,
            k => return Err(Error::Invalid(format!("check's table of blob locations holds an unknown blob kind {k}"))),
        };
        Ok(Loc {
            id: digest_at(r, 0),
            listed: u32_at(r, 32),
            pack: u32_at(r, 36),
            offset: u32_at(r, 40),
            stored_len: u32_at(r, 44),
            plain_len: u32_at(r, 48),
            kind,
        })
    }

    /// The record of the table by pack: the pack, the offset and the order listed first.
    fn pack_record(&self) -> [u8; LOC] {
        let r = self.record();
        let mut out = [0u8; LOC];
        out[..4].copy_from_slice(&r[36..40]);
        out[4..8].copy_from_slice(&r[40..44]);
        out[8..12].copy_from_slice(&r[32..36]);
        out[12..44].copy_from_slice(&r[..32]);
        out[44..].copy_from_slice(&r[44..]);
        out
    }

    fn of_pack_record(p: &[u8; LOC]) -> Result<Loc> {
        let mut r = [0u8; LOC];
        r[..32].copy_from_slice(&p[12..44]);
        r[32..36].copy_from_slice(&p[8..12]);
        r[36..40].copy_from_slice(&p[..4]);
        r[40..44].copy_from_slice(&p[4..8]);
        r[44..].copy_from_slice(&p[44..]);
        Loc::of(&r)
    }
}

fn u32_at(r: &[u8], i: usize) -> u32 {
    u32::from_be_bytes([r[i], r[i + 1], r[i + 2], r[i + 3]])
}

fn digest_at(r: &[u8], i: usize) -> Digest {
    r[i..i + 32].try_into().unwrap_or([0; 32])
}

/// Bytes [`ByPack::blobs`] holds per blob besides the entries it returns: the records
/// as read, and as copied out one by one.
pub(crate) const BY_PACK_READ_BYTES: usize = 2 * LOC;

/// Records read from a table at a time.
const BLOCK: usize = 4096;

/// Every location of every blob in the index objects that read well.
pub(crate) struct Locations {
    /// The packs, numbered in the order the index objects (by name) first list them.
    pub packs: Vec<Digest>,
    numbers: HashMap<Digest, u32>,
    /// Each pack's end: where its last blob (by offset) ends.
    ends: Vec<u64>,
    by_id: Table<LOC>,
    rows: u64,
    dir: PathBuf,
    budget: usize,
}

impl Locations {
    /// Reads every index object, a few at a time: the locations, the index objects cut
    /// down to their page blobs (for [`crate::damage::prefer_good`]: pages are read
    /// through an [`crate::Index`], which is small), and the objects that failed, with
    /// why. A store that cannot be read is an error, as in [`Repository::index_objects`].
    /// The sorters hold up to `budget` bytes of records each in memory.
    pub fn read(repo: &Repository, budget: usize) -> Result<(Locations, Vec<IndexObject>, Failures)> {
        let store = &repo.store;
        let mut names = store
            .list("index/")
            .map_err(|e| Error::store(format!("cannot list the index of {}", store.describe()), e))?;
        names.sort();
        let dir = match repo.index_cache() {
            Some(c) => c.spill_dir().to_path_buf(),
            None => std::env::temp_dir(),
        };
        let mut sorter = Sorter::<LOC>::new(&dir, budget, "check's table of the blob locations");
        let mut packs = Vec::new();
        let mut numbers: HashMap<Digest, u32> = HashMap::new();
        let mut ends: Vec<u64> = Vec::new();
        let mut rows = 0u64;
        let mut pages = Vec::new();
        let mut bad = Vec::new();
        each_index_object(repo, &names, |name, r| {
            let object = match r {
                Ok(object) => object,
                Err(e) => {
                    bad.push((name.to_string(), e));
                    return Ok(());
                }
            };
            let mut page_packs = Vec::new();
            object.each(|p| {
                let next = packs.len() as u32;
                let pack = *numbers.entry(p.pack).or_insert(next);
                if pack == next {
                    packs.push(p.pack);
                    ends.push(0);
                }
                for b in &p.blobs {
                    let listed = u32::try_from(rows).map_err(|_| {
                        Error::Invalid(format!(
                            "the index objects of {} list more than {} blob locations, more than this version of \
                             ferry can check",
                            store.describe(),
                            u32::MAX
                        ))
                    })?;
                    rows += 1;
                    let end = &mut ends[pack as usize];
                    *end = (*end).max(b.offset as u64 + b.stored_len as u64);
                    let l = Loc {
                        id: b.id,
                        listed,
                        pack,
                        offset: b.offset,
                        stored_len: b.stored_len,
                        plain_len: b.plain_len,
                        kind: b.kind,
                    };
                    sorter.push(l.record())?;
                }
                // Copied out, not collected from `into_iter`: that reuses the pack's whole list (every
                // blob's capacity kept for its few pages: 550 MB at 10M chunks).
                let page_blobs: Vec<BlobEntry> = p.blobs.iter().filter(|b| b.kind.is_page()).cloned().collect();
                if !page_blobs.is_empty() {
                    page_packs.push(PackBlobs { pack: p.pack, blobs: page_blobs });
                }
                Ok(())
            })?;
            pages.push((name.to_string(), page_packs));
            Ok(())
        })?;
        let mut written = 0u64;
        let by_id = sorter.finish()?.into_table(|_| {
            written += 1;
            true
        })?;
        let l = Locations { packs, numbers, ends, by_id, rows: written, dir, budget };
        Ok((l, pages, bad))
    }

    /// What the sorter of this table wrote to its files.
    pub fn written(&self) -> crate::spill::Written {
        self.by_id.written()
    }

    /// A sorter like those of this table (the same directory and budget).
    pub fn sorter<const N: usize>(&self, what: &str) -> Sorter<N> {
        Sorter::new(&self.dir, self.budget, what)
    }

    /// The pack number of `pack`, if the index lists it.
    pub fn pack_number(&self, pack: &Digest) -> Option<u32> {
        self.numbers.get(pack).copied()
    }

    /// Where the last blob of pack number `pack` ends (0 when it has none).
    pub fn end(&self, pack: u32) -> u64 {
        self.ends[pack as usize]
    }

    /// The pack numbers, by pack digest.
    pub fn packs_sorted(&self) -> Vec<u32> {
        let mut v: Vec<u32> = (0..self.packs.len() as u32).collect();
        v.sort_unstable_by_key(|&p| self.packs[p as usize]);
        v
    }

    /// `f` over each id's locations, ids in order, each id's locations in the order the
    /// index objects list them, a location (pack and offset) listed again left out. Reads
    /// the table once, a block at a time.
    pub fn each_id(&self, mut f: impl FnMut(&[Loc]) -> Result<()>) -> Result<()> {
        let mut group: Vec<Loc> = Vec::new();
        // The group's places, once it has many (a hostile index object may list one id
        // millions of times: linear then too).
        let mut seen: HashSet<(u32, u32)> = HashSet::new();
        let mut at = 0u64;
        while at < self.rows {
            let n = (self.rows - at).min(BLOCK as u64) as usize;
            for r in self.by_id.read(at, n)? {
                let l = Loc::of(&r)?;
                if group.first().is_some_and(|g| g.id != l.id) {
                    f(&group)?;
                    group.clear();
                    seen.clear();
                }
                let again = if group.len() > 16 {
                    if seen.is_empty() {
                        seen.extend(group.iter().map(|g| (g.pack, g.offset)));
                    }
                    !seen.insert((l.pack, l.offset))
                } else {
                    group.iter().any(|g| g.pack == l.pack && g.offset == l.offset)
                };
                if !again {
                    group.push(l);
                }
            }
            at += n as u64;
        }
        if !group.is_empty() {
            f(&group)?;
        }
        Ok(())
    }

    /// The locations in the packs that `want` (by pack number) takes, sorted again by
    /// pack, then offset: nothing read or sorted where it takes none.
    pub fn by_pack(&self, want: &[bool]) -> Result<ByPack> {
        if !want.contains(&true) {
            return Ok(ByPack { table: None, at: Vec::new() });
        }
        let mut sorter = self.sorter::<LOC>("verify's table of the packs' blobs");
        let mut count = vec![0u64; self.packs.len()];
        self.each_id(|g| {
            for l in g.iter().filter(|l| want.get(l.pack as usize).copied().unwrap_or(false)) {
                count[l.pack as usize] += 1;
                sorter.push(l.pack_record())?;
            }
            Ok(())
        })?;
        let table = sorter.finish()?.into_table(|_| true)?;
        let mut first = 0u64;
        let at = count
            .into_iter()
            .map(|n| {
                first += n;
                (first - n, n)
            })
            .collect();
        Ok(ByPack { table: Some(table), at })
    }

    /// Joins the locations with the chunks the pages use (records of [`use_record`]) and
    /// the places their hints name ([`hint_record`]), each sorted by id.
    /// Of the used chunks in no index object, the first `held` (by id) are listed, the
    /// others given to `more`; every one is counted per snapshot.
    pub fn join(
        &self,
        uses: Sorter<USE>,
        hints: Sorter<HINT>,
        (held, more): (usize, &mut Sorter<32>),
    ) -> Result<Joined> {
        let mut s = Streams {
            held,
            more,
            uses: uses.finish()?,
            next_use: None,
            hints: hints.finish()?,
            next_hint: None,
            joined: Joined::default(),
        };
        s.next_use = s.uses.next()?;
        s.next_hint = s.hints.next()?;
        self.each_id(|g| s.upto(Some(&g[0].id), g))?;
        s.upto(None, &[])?;
        s.joined.uses_written = s.uses.written();
        s.joined.hints_written = s.hints.written();
        Ok(s.joined)
    }
}

/// Verify's locations by pack, in an unlinked file: each pack's blobs by offset.
pub(crate) struct ByPack {
    /// None where no pack is to be read.
    table: Option<Table<LOC>>,
    /// Per pack number: its first row and how many it has.
    at: Vec<(u64, u64)>,
}

impl ByPack {
    /// How many blobs pack number `pack` has (a location listed again once).
    pub fn count(&self, pack: u32) -> u64 {
        self.at.get(pack as usize).map_or(0, |a| a.1)
    }

    /// The blobs of pack number `pack`, by offset (then the order listed).
    pub fn blobs(&self, pack: u32) -> Result<Vec<BlobEntry>> {
        let (first, n) = self.at.get(pack as usize).copied().unwrap_or((0, 0));
        let Some(table) = self.table.as_ref().filter(|_| n > 0) else {
            return Ok(Vec::new());
        };
        table.read(first, n as usize)?.iter().map(|r| Loc::of_pack_record(r).map(|l| l.entry())).collect()
    }
}

/// A chunk a page uses: its id, the page's position (big-endian) and the snapshot's
/// number (big-endian), so that an id's first record is the first the walk met.
pub(crate) const USE: usize = 44;

pub(crate) fn use_record(id: &Digest, position: u64, snap: u32) -> [u8; USE] {
    let mut r = [0u8; USE];
    r[..32].copy_from_slice(id);
    r[32..40].copy_from_slice(&position.to_be_bytes());
    r[40..].copy_from_slice(&snap.to_be_bytes());
    r
}

/// A located page's hint: the chunk's id, the place (pack number, offset, stored
/// length), the page read's number and the entry's.
pub(crate) const HINT: usize = 52;

pub(crate) fn hint_record(id: &Digest, pack: u32, offset: u32, stored_len: u32, read: u32, entry: u32) -> [u8; HINT] {
    let mut r = [0u8; HINT];
    r[..32].copy_from_slice(id);
    for (i, v) in [pack, offset, stored_len, read, entry].into_iter().enumerate() {
        r[32 + 4 * i..36 + 4 * i].copy_from_slice(&v.to_be_bytes());
    }
    r
}

/// What joining the locations with the walk's records found.
#[derive(Default)]
pub(crate) struct Joined {
    /// The distinct chunks the pages use.
    pub distinct: u64,
    /// Each used chunk that is in no index object: the first page position and snapshot
    /// that use it, and its id; by id. The first `held` of [`Locations::join`] only.
    pub missing: Vec<(u64, u32, Digest)>,
    /// Per snapshot that is the first to use a chunk in no index object: the first page
    /// position where it does, and how many such chunks (all of them, listed or not).
    pub missing_by_snap: std::collections::BTreeMap<u32, (u64, u64)>,
    /// The hints that name a place holding no copy of their chunk, and the page reads
    /// (numbers) that have them.
    pub stale: u64,
    pub stale_reads: HashSet<u32>,
    /// What the sorters of the uses and of the hints wrote to their files.
    pub uses_written: crate::spill::Written,
    pub hints_written: crate::spill::Written,
}

struct Streams<'a> {
    held: usize,
    /// The used chunks in no index object past the first `held`.
    more: &'a mut Sorter<32>,
    uses: Sorted<USE>,
    next_use: Option<[u8; USE]>,
    hints: Sorted<HINT>,
    next_hint: Option<[u8; HINT]>,
    joined: Joined,
}

impl Streams<'_> {
    /// Takes the records of the ids up to `id` (every one left where `None`), whose
    /// locations are `group`: those of smaller ids have none.
    fn upto(&mut self, id: Option<&Digest>, group: &[Loc]) -> Result<()> {
        let below = |rec: &[u8]| id.is_none_or(|id| rec[..32] <= id[..]);
        while let Some(u) = self.next_use.filter(|u| below(u)) {
            let this = digest_at(&u, 0);
            self.joined.distinct += 1;
            if id != Some(&this) {
                let position = u64::from_be_bytes(u[32..40].try_into().unwrap_or([0; 8]));
                let snap = u32_at(&u, 40);
                let at = self.joined.missing_by_snap.entry(snap).or_insert((position, 0));
                at.0 = at.0.min(position);
                at.1 += 1;
                if self.joined.missing.len() < self.held {
                    self.joined.missing.push((position, snap, this));
                } else {
                    self.more.push(this)?;
                }
            }
            // The id's later records (other pages that use it) add nothing.
            while self.next_use.is_some_and(|n| n[..32] == this) {
                self.next_use = self.uses.next()?;
            }
        }
        while let Some(h) = self.next_hint.filter(|h| below(h)) {
            let (pack, offset, stored_len) = (u32_at(&h, 32), u32_at(&h, 36), u32_at(&h, 40));
            let held = id.is_some_and(|id| h[..32] == id[..])
                && group.iter().any(|l| l.pack == pack && l.offset == offset && l.stored_len == stored_len);
            if !held {
                self.joined.stale += 1;
                self.joined.stale_reads.insert(u32_at(&h, 44));
            }
            self.next_hint = self.hints.next()?;
        }
        Ok(())
    }
}
