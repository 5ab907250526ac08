//! A compact table of every blob location the index objects list, for check and verify:
//! one row (52 bytes) a location, found by binary search, with no per-blob allocation
//! (where [`crate::Index`] costs a hash-map entry of a full location each), and the
//! index objects read a few at a time rather than all at once.
use crate::damage::DamageSet;
use crate::format::{BlobEntry, BlobKind, Digest, PackBlobs};
use crate::repo::{par_map, Failures, IndexObject, Repository, FETCH_THREADS};
use crate::{Error, Result};
use std::collections::HashMap;

/// One location of one blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Row {
    pub id: Digest,
    /// The pack's number in [`BlobTable::packs`].
    pub pack: u32,
    pub offset: u32,
    pub stored_len: u32,
    pub plain_len: u32,
    pub kind: BlobKind,
}

impl Row {
    pub fn entry(&self) -> BlobEntry {
        BlobEntry {
            id: self.id,
            kind: self.kind,
            offset: self.offset,
            stored_len: self.stored_len,
            plain_len: self.plain_len,
        }
    }
}

/// Every location of every blob in the index objects that read well.
#[derive(Default)]
pub(crate) struct BlobTable {
    /// The packs, numbered in the order the index objects (by name) first list them.
    pub packs: Vec<Digest>,
    numbers: HashMap<Digest, u32>,
    /// Sorted by id; the locations of one id in the order the index objects list them
    /// (the order [`crate::Index::locations`] gives before damage records reorder it);
    /// a location listed twice is kept once.
    rows: Vec<Row>,
    /// Row numbers sorted by (pack, offset), and where each pack's run of them starts.
    by_pack: Vec<u32>,
    pack_start: Vec<u32>,
}

impl BlobTable {
    /// Reads every index object, a few at a time: the table, the index objects cut down
    /// to their page blobs (for [`crate::damage::prefer_good`]: pages are read through an
    /// [`crate::Index`], which is small), and the objects that failed, with why. A store
    /// that cannot be read is an error, as in [`Repository::index_objects`].
    pub fn read(repo: &Repository) -> Result<(BlobTable, Vec<IndexObject>, Failures)> {
        let store = &repo.store;
        let names = store
            .list("index/")
            .map_err(|e| Error::store(format!("cannot list the index of {}", store.describe()), e))?;
        let mut names: Vec<String> = names.into_iter().map(|(n, _)| n).collect();
        names.sort();
        let mut t = BlobTable::default();
        let mut pages = Vec::new();
        let mut bad = Vec::new();
        for batch in names.chunks(FETCH_THREADS) {
            for (name, r) in batch.iter().zip(par_map(batch, FETCH_THREADS, |n| repo.read_index_object(n))) {
                match r {
                    Ok(object) => pages.push((name.clone(), t.add_object(object))),
                    Err(e @ Error::Store { .. }) => return Err(e),
                    Err(e) => bad.push((name.clone(), e)),
                }
            }
        }
        t.finish();
        Ok((t, pages, bad))
    }

    /// Adds the rows of one index object; returns its page blobs.
    fn add_object(&mut self, object: Vec<PackBlobs>) -> Vec<PackBlobs> {
        let mut pages = Vec::new();
        for p in object {
            let next = self.packs.len() as u32;
            let pack = *self.numbers.entry(p.pack).or_insert(next);
            if pack == next {
                self.packs.push(p.pack);
            }
            self.rows.extend(p.blobs.iter().map(|b| Row {
                id: b.id,
                pack,
                offset: b.offset,
                stored_len: b.stored_len,
                plain_len: b.plain_len,
                kind: b.kind,
            }));
            let page_blobs: Vec<BlobEntry> = p.blobs.into_iter().filter(|b| b.kind == BlobKind::Page).collect();
            if !page_blobs.is_empty() {
                pages.push(PackBlobs { pack: p.pack, blobs: page_blobs });
            }
        }
        pages
    }

    /// Sorts the rows by id (a stable sort: each id's locations keep their order), drops
    /// a location listed again, and groups the rows by pack.
    fn finish(&mut self) {
        self.rows.sort_by_key(|r| r.id);
        let mut keep = 0;
        let mut group = 0;
        for i in 0..self.rows.len() {
            let r = self.rows[i];
            if keep == 0 || self.rows[keep - 1].id != r.id {
                group = keep;
            } else if self.rows[group..keep].iter().any(|x| x.pack == r.pack && x.offset == r.offset) {
                continue;
            }
            self.rows[keep] = r;
            keep += 1;
        }
        self.rows.truncate(keep);
        self.rows.shrink_to_fit();
        let rows = &self.rows;
        let mut by_pack: Vec<u32> = (0..rows.len() as u32).collect();
        by_pack.sort_unstable_by_key(|&i| (rows[i as usize].pack, rows[i as usize].offset, i));
        let mut start = vec![0u32; self.packs.len() + 1];
        for &i in &by_pack {
            start[rows[i as usize].pack as usize + 1] += 1;
        }
        for p in 0..self.packs.len() {
            start[p + 1] += start[p];
        }
        self.by_pack = by_pack;
        self.pack_start = start;
    }

    /// The number of locations.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// The row number of `id`'s first location, if it has one.
    pub fn find(&self, id: &Digest) -> Option<usize> {
        let i = self.rows.partition_point(|r| r.id < *id);
        (self.rows.get(i).is_some_and(|r| r.id == *id)).then_some(i)
    }

    /// Every location of `id` (none when it is in no index object).
    pub fn locations(&self, id: &Digest) -> &[Row] {
        match self.find(id) {
            Some(i) => {
                let n = self.rows[i..].iter().take_while(|r| r.id == *id).count();
                &self.rows[i..i + n]
            }
            None => &[],
        }
    }

    /// The location `id` is read from first: its first not recorded damaged, else its
    /// first (as [`crate::damage::prefer_good`] orders them).
    pub fn first(&self, id: &Digest, damage: &DamageSet) -> Option<&Row> {
        let locs = self.locations(id);
        locs.iter().find(|l| !damage.is_damaged(&self.packs[l.pack as usize], id)).or(locs.first())
    }

    /// The pack number of `pack`, if the index lists it.
    pub fn pack_number(&self, pack: &Digest) -> Option<u32> {
        self.numbers.get(pack).copied()
    }

    /// The blobs of pack number `pack`, by offset.
    pub fn pack_rows(&self, pack: u32) -> impl Iterator<Item = &Row> {
        let (a, b) = (self.pack_start[pack as usize] as usize, self.pack_start[pack as usize + 1] as usize);
        self.by_pack[a..b].iter().map(|&i| &self.rows[i as usize])
    }

    /// The pack numbers, by pack digest.
    pub fn packs_sorted(&self) -> Vec<u32> {
        let mut v: Vec<u32> = (0..self.packs.len() as u32).collect();
        v.sort_unstable_by_key(|&p| self.packs[p as usize]);
        v
    }
}
