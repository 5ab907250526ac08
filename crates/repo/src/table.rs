//! A compact table of every blob location the index objects list, for stats and the
//! damaged snapshots of `ferry repo list` (check and verify sort them on disk instead:
//! [`crate::locations`]): one row (52 bytes) a location and a row number (4 bytes, a
//! list by id), found by binary search, with no per-blob allocation (where
//! [`crate::Index`] costs a hash-map entry of a full location each), and the index objects
//! read a few at a time rather than all at once.
use crate::damage::DamageSet;
use crate::format::{self, BlobEntry, BlobKind, Digest, PackBlobs};
use crate::repo::{each_index_object, Failures, IndexObject, Repository};
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

/// Every location of every blob in the index objects that read well.
#[derive(Default)]
pub(crate) struct BlobTable {
    /// The packs, numbered in the order the index objects (by name) first list them.
    pub packs: Vec<Digest>,
    numbers: HashMap<Digest, u32>,
    /// In the order the index objects (by name) list them.
    rows: Vec<Row>,
    /// Row numbers sorted by id, each id's locations in the order listed (the order
    /// [`crate::Index::locations`] gives before damage records reorder it); a location
    /// listed twice is in it once.
    by_id: Vec<u32>,
    /// Where in `by_id` the ids starting with each `bits`-bit prefix start (ids are
    /// uniformly spread digests: a lookup searches about one row, not log2 of them).
    dir: Vec<u32>,
    bits: u32,
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
        let mut names = names;
        names.sort();
        let mut t = BlobTable::default();
        // An entry takes ENTRY_LEN bytes of an index object: room for all of them at once,
        // rather than copies made as the table grows (reserved room not written to takes
        // no memory). Where the listing claims more than can be reserved, it grows instead.
        let most: u64 = names.iter().map(|(_, len)| (*len).min(format::MAX_INDEX) / format::ENTRY_LEN as u64).sum();
        let _ = t.rows.try_reserve(most.min(u32::MAX as u64) as usize);
        let mut pages = Vec::new();
        let mut bad = Vec::new();
        each_index_object(repo, &names, |name, r| {
            match r {
                Ok(object) => {
                    let mut packs = Vec::new();
                    object.each(|p| {
                        packs.push(p);
                        Ok(())
                    })?;
                    pages.push((name.to_string(), t.add_object(packs)))
                }
                Err(e) => bad.push((name.to_string(), e)),
            }
            if t.rows.len() > u32::MAX as usize {
                return Err(Error::Invalid(format!(
                    "the index objects of {} list more than {} blob locations, more than this version of ferry \
                     can check",
                    store.describe(),
                    u32::MAX
                )));
            }
            Ok(())
        })?;
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
            // Copied out, not collected from `into_iter`: that reuses the pack's whole list (every
            // blob's capacity kept for its few pages: 550 MB at 10M chunks).
            let page_blobs: Vec<BlobEntry> = p.blobs.iter().filter(|b| b.kind.is_page()).cloned().collect();
            if !page_blobs.is_empty() {
                pages.push(PackBlobs { pack: p.pack, blobs: page_blobs });
            }
        }
        pages
    }

    /// Orders the row numbers by id, leaving out a location listed again.
    fn finish(&mut self) {
        let rows = &self.rows;
        // By id: a counting sort on the ids' first bits (digests are spread evenly), then
        // each bucket (about one row) by id; linear, and each id's rows in the order listed.
        let bits = prefix_bits(rows.len());
        let start = bucket_starts(rows.iter().map(|r| prefix(&r.id, bits)), bits);
        let mut by_id = vec![0u32; rows.len()];
        let mut next = start.clone();
        for (i, r) in rows.iter().enumerate() {
            let p = prefix(&r.id, bits);
            by_id[next[p] as usize] = i as u32;
            next[p] += 1;
        }
        drop(next);
        for w in start.windows(2) {
            by_id[w[0] as usize..w[1] as usize]
                .sort_unstable_by(|&a, &b| rows[a as usize].id.cmp(&rows[b as usize].id).then(a.cmp(&b)));
        }
        drop(start);
        // A location listed again within an id's rows: looked for among the rows kept so
        // far, through a set where the id has many (a hostile index object may list one id
        // millions of times: linear then too).
        let mut keep = 0;
        let mut k = 0;
        let mut seen = std::collections::HashSet::new();
        while k < by_id.len() {
            let id = rows[by_id[k] as usize].id;
            let end = k + by_id[k..].iter().take_while(|&&j| rows[j as usize].id == id).count();
            let group = keep;
            let many = end - k > 16;
            seen.clear();
            for k in k..end {
                let r = &rows[by_id[k] as usize];
                let again = if many {
                    !seen.insert((r.pack, r.offset))
                } else {
                    by_id[group..keep]
                        .iter()
                        .any(|&j| rows[j as usize].pack == r.pack && rows[j as usize].offset == r.offset)
                };
                if !again {
                    by_id[keep] = by_id[k];
                    keep += 1;
                }
            }
            k = end;
        }
        drop(seen);
        by_id.truncate(keep);
        by_id.shrink_to_fit();
        // About one id a prefix (at most 2^24 prefixes: 64 MiB of directory).
        self.bits = prefix_bits(by_id.len());
        self.dir = bucket_starts(by_id.iter().map(|&i| prefix(&rows[i as usize].id, self.bits)), self.bits);
        self.rows.shrink_to_fit();
        self.by_id = by_id;
    }

    /// The number of locations (a location listed twice counts once).
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// The position (below [`BlobTable::len`]) of `id`'s first location, if it has one:
    /// the same for every id, whatever its number of locations.
    pub fn find(&self, id: &Digest) -> Option<usize> {
        let p = prefix(id, self.bits);
        let (lo, hi) = match self.dir.get(p..p + 2) {
            Some(&[lo, hi]) => (lo as usize, hi as usize),
            _ => return None,
        };
        let i = lo + self.by_id[lo..hi].partition_point(|&r| self.rows[r as usize].id < *id);
        (i < hi && self.rows[self.by_id[i] as usize].id == *id).then_some(i)
    }

    /// Every location of `id` (none when it is in no index object), in the order listed.
    pub fn locations<'a>(&'a self, id: &'a Digest) -> impl Iterator<Item = &'a Row> + Clone + 'a {
        let from = self.find(id).unwrap_or(self.by_id.len());
        self.by_id[from..].iter().map(|&r| &self.rows[r as usize]).take_while(move |r| r.id == *id)
    }

    /// The location `id` is read from first: its first not recorded damaged, else its
    /// first (as [`crate::damage::prefer_good`] orders them).
    pub fn first<'a>(&'a self, id: &'a Digest, damage: &DamageSet) -> Option<&'a Row> {
        let mut locs = self.locations(id);
        locs.clone().find(|l| !damage.is_damaged(&self.packs[l.pack as usize], id)).or_else(|| locs.next())
    }
}

/// Prefix bits for `n` ids: about one id a prefix, at most 2^24 prefixes.
fn prefix_bits(n: usize) -> u32 {
    (usize::BITS - n.leading_zeros()).min(24)
}

/// Where each of the 2^`bits` buckets starts when items fall in `keys` (and where the
/// last ends): 2^`bits` + 1 positions.
fn bucket_starts(keys: impl Iterator<Item = usize>, bits: u32) -> Vec<u32> {
    let mut start = vec![0u32; (1usize << bits) + 1];
    for k in keys {
        start[k + 1] += 1;
    }
    for p in 0..1usize << bits {
        start[p + 1] += start[p];
    }
    start
}

/// The first `bits` bits of `id`.
fn prefix(id: &Digest, bits: u32) -> usize {
    let top = u32::from_be_bytes([id[0], id[1], id[2], id[3]]) as u64;
    (top >> (32 - bits)) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(pack: u8, blobs: &[(u8, u32)]) -> Vec<PackBlobs> {
        let blobs = blobs
            .iter()
            .map(|&(id, offset)| BlobEntry {
                id: [id; 32],
                kind: BlobKind::Data,
                offset,
                stored_len: 10,
                plain_len: 20,
            })
            .collect();
        vec![PackBlobs { pack: [pack; 32], blobs }]
    }

    #[test]
    fn locations_keep_the_order_listed_and_a_location_listed_twice_once() {
        let mut t = BlobTable::default();
        t.add_object(object(9, &[(1, 0), (2, 10), (1, 0)]));
        t.add_object(object(3, &[(1, 5), (4, 0)]));
        t.add_object(object(9, &[(2, 10), (5, 20)]));
        t.finish();
        assert_eq!(t.len(), 5, "(1, 9, 0) and (2, 9, 10) are listed twice");
        let packs = |id: u8| t.locations(&[id; 32]).map(|r| t.packs[r.pack as usize][0]).collect::<Vec<_>>();
        assert_eq!(packs(1), [9, 3], "the order the index objects list them, not the packs' order");
        assert_eq!(packs(2), [9]);
        assert!(packs(7).is_empty());
        assert_eq!(t.find(&[7; 32]), None);
        assert_eq!(t.find(&[0; 32]), None);
        assert_eq!(t.find(&[255; 32]), None);
        let ids: Vec<Option<usize>> = [1, 2, 4, 5].iter().map(|i| t.find(&[*i; 32])).collect();
        assert!(ids.iter().all(|i| i.is_some_and(|i| i < t.len())), "{ids:?}");
        let mut damage = DamageSet::default();
        damage.packs.insert(
            [9; 32],
            crate::DamagedCopies { why: String::new(), time: String::new(), blobs: [[1; 32]].into_iter().collect() },
        );
        assert_eq!(t.first(&[1; 32], &damage).map(|r| t.packs[r.pack as usize][0]), Some(3));
        assert!(BlobTable::default().find(&[1; 32]).is_none(), "an empty table");
    }
}

#[cfg(test)]
mod many_copies {
    use super::*;

    /// Many copies of one id (as a hostile index object may list) are sorted out in
    /// linear time: each location once, in the order first listed.
    #[test]
    fn many_copies_of_one_id_take_linear_time() {
        for n in [10_000u32, 200_000] {
            // Every location listed twice, the second time in reverse.
            let blobs = (0..n)
                .chain((0..n).rev())
                .map(|i| BlobEntry { id: [1; 32], kind: BlobKind::Data, offset: i * 10, stored_len: 10, plain_len: 20 })
                .collect();
            let mut t = BlobTable::default();
            t.add_object(vec![PackBlobs { pack: [9; 32], blobs }]);
            let start = std::time::Instant::now();
            t.finish();
            let took = start.elapsed();
            assert!(took < std::time::Duration::from_secs(2), "{n} copies of one id: finish took {took:?}");
            assert_eq!(t.by_id.len(), n as usize);
            let offsets: Vec<u32> = t.by_id.iter().map(|&i| t.rows[i as usize].offset).collect();
            assert_eq!(offsets, (0..n).map(|i| i * 10).collect::<Vec<_>>());
        }
    }
}
