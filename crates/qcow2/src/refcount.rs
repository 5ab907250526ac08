//! Refcounts (16-bit) for writable images: the refcount table, cached refcount blocks,
//! allocation (freed clusters first, found from a hint the way qemu's
//! `free_cluster_index` does, else at the end of the allocated area), and frees that are
//! applied only after the metadata that stopped using a cluster is on disk.

use crate::header::{Header, MAX_REFTABLE_BYTES, REFTABLE_OFFSET_AT};
use crate::map::OFFSET_MASK;
use crate::overlap::Metadata;
use crate::store::Store;
use crate::{io_err, Qcow2Error};
use std::collections::{BTreeSet, HashMap};

struct Block {
    counts: Vec<u16>,
    dirty: bool,
}

pub struct Refcounts {
    cluster_bits: u32,
    table: Vec<u64>,
    table_offset: u64,
    /// Table entries changed since the last flush.
    table_dirty: BTreeSet<usize>,
    /// The table moved (it grew): the whole table and then the header must be written,
    /// then the old table's clusters freed.
    table_moved: Option<(u64, u64)>,
    blocks: HashMap<usize, Block>,
    /// Host offset of the end of the allocated area: past every cluster in use (and
    /// past the end of the file as opened). Allocations that find no freed cluster
    /// below it go here.
    next_free: u64,
    /// Cluster index below which no cluster is free (every scan for a free run starts
    /// here; a free lowers it).
    free_hint: u64,
    /// Clusters to decrement once the metadata no longer referring to them is on disk:
    /// (host offset, whether the file should be told to discard it once it is free).
    pending_free: Vec<(u64, bool)>,
}

/// The refcount table's entries as stored (unchecked).
pub(crate) fn read_table(store: &dyn Store, h: &Header) -> Result<Vec<u64>, Qcow2Error> {
    let mut raw = vec![0u8; (u64::from(h.refcount_table_clusters) * h.cluster_size()) as usize];
    store.read_at(&mut raw, h.refcount_table_offset).map_err(io_err("cannot read the refcount table"))?;
    Ok(raw.chunks_exact(8).map(|c| u64::from_be_bytes(c.try_into().unwrap_or([0; 8]))).collect())
}

impl Refcounts {
    pub fn load(store: &dyn Store, h: &Header) -> Result<Refcounts, Qcow2Error> {
        let cs = h.cluster_size();
        let table = read_table(store, h)?;
        for (i, &e) in table.iter().enumerate() {
            if e & !OFFSET_MASK != 0 || e & (cs - 1) != 0 {
                return Err(Qcow2Error::Corrupt(format!("refcount table entry {i} ({e:#x}) is not a cluster offset")));
            }
        }
        let mut r = Refcounts {
            cluster_bits: h.cluster_bits,
            table,
            table_offset: h.refcount_table_offset,
            table_dirty: BTreeSet::new(),
            table_moved: None,
            blocks: HashMap::new(),
            next_free: 0,
            free_hint: 0,
            pending_free: Vec::new(),
        };
        // Allocate after the end of the file and after the last cluster in use (a
        // cluster may be counted but never written).
        let mut next = store.size().div_ceil(cs);
        if let Some(last) = r.table.iter().rposition(|&e| e != 0) {
            let b = r.block(store, last)?;
            if let Some(i) = b.and_then(|b| b.counts.iter().rposition(|&c| c != 0)) {
                next = next.max((last as u64 * r.per_block()) + i as u64 + 1);
            }
        }
        r.next_free = next * cs;
        Ok(r)
    }

    fn cs(&self) -> u64 {
        1 << self.cluster_bits
    }

    fn per_block(&self) -> u64 {
        self.cs() / 2
    }

    fn block(&mut self, store: &dyn Store, idx: usize) -> Result<Option<&mut Block>, Qcow2Error> {
        let off = match self.table.get(idx) {
            Some(&o) if o != 0 => o,
            _ => return Ok(None),
        };
        if !self.blocks.contains_key(&idx) {
            let mut b = vec![0u8; self.cs() as usize];
            store.read_at(&mut b, off).map_err(io_err(format!("cannot read the refcount block at {off:#x}")))?;
            let counts = b.chunks_exact(2).map(|c| u16::from_be_bytes([c[0], c[1]])).collect();
            self.blocks.insert(idx, Block { counts, dirty: false });
        }
        Ok(self.blocks.get_mut(&idx))
    }

    /// Allocates up to `n` contiguous clusters with refcount 1: the first run of free
    /// clusters below the end of the allocated area, else `n` at its end. Returns the
    /// first one's offset and how many.
    pub fn alloc(&mut self, store: &dyn Store, n: u64) -> Result<(u64, u64), Qcow2Error> {
        if let Some((c, got)) = self.find_free(store, n)? {
            for i in c..c + got {
                self.set(store, i, |old| match old {
                    0 => Ok(1),
                    _ => Err(Qcow2Error::Corrupt(format!("free cluster {i} has refcount {old}"))),
                })?;
            }
            self.free_hint = c + got;
            return Ok((c << self.cluster_bits, got));
        }
        Ok((self.alloc_end(store, n)?, n))
    }

    /// Whether a free cluster lies below the end of the allocated area.
    pub fn has_free(&mut self, store: &dyn Store) -> Result<bool, Qcow2Error> {
        Ok(self.find_free(store, 1)?.is_some())
    }

    /// The first run (at most `n` long, inside one refcount block) of clusters with
    /// refcount 0 at or after the hint and below the end of the allocated area. Moves
    /// the hint to it, or to the end when there is none: each cluster in use is passed
    /// over once between frees, not once per allocation.
    fn find_free(&mut self, store: &dyn Store, n: u64) -> Result<Option<(u64, u64)>, Qcow2Error> {
        let per = self.per_block();
        let end = self.next_free >> self.cluster_bits;
        let mut c = self.free_hint;
        while c < end {
            let idx = c / per;
            let block_end = ((idx + 1) * per).min(end);
            let found = match self.block(store, idx as usize)? {
                // A range no refcount block counts is not known to be free.
                None => None,
                Some(b) => {
                    let (lo, hi) = ((c - idx * per) as usize, (block_end - idx * per) as usize);
                    b.counts[lo..hi].iter().position(|&x| x == 0).map(|i| {
                        let len = b.counts[lo + i..hi].iter().take(n as usize).take_while(|&&x| x == 0).count();
                        (c + i as u64, len as u64)
                    })
                }
            };
            if let Some((start, len)) = found {
                self.free_hint = start;
                return Ok(Some((start, len)));
            }
            c = block_end;
        }
        self.free_hint = end;
        Ok(None)
    }

    /// Allocates `n` contiguous clusters at the end of the allocated area and returns the
    /// first's offset. Refcount blocks (and a larger refcount table) needed to count them
    /// are allocated first, just before them.
    fn alloc_end(&mut self, store: &dyn Store, n: u64) -> Result<u64, Qcow2Error> {
        let cs = self.cs();
        let base = self.next_free;
        loop {
            let end = self.next_free + n * cs;
            let first_blk = (base >> self.cluster_bits) / self.per_block();
            let last_blk = ((end >> self.cluster_bits) - 1) / self.per_block();
            let missing = (first_blk..=last_blk).find(|&b| self.table.get(b as usize).is_none_or(|&e| e == 0));
            let Some(blk) = missing else { break };
            let blk = blk as usize;
            if blk >= self.table.len() {
                self.grow_table(blk + 1)?;
                store.metadata_allocated(Metadata::RefcountTable, self.table_offset, self.table.len() as u64 * 8);
                continue;
            }
            let at = self.next_free;
            self.next_free += cs;
            self.table[blk] = at;
            store.metadata_allocated(Metadata::RefcountBlock(blk as u32), at, cs);
            self.table_dirty.insert(blk);
            self.blocks.insert(blk, Block { counts: vec![0; self.per_block() as usize], dirty: true });
        }
        let start = self.next_free;
        let end = start + n * cs;
        // Count the new metadata clusters (base..start) and the data clusters.
        let mut c = base >> self.cluster_bits;
        while c < end >> self.cluster_bits {
            self.set(store, c, |old| {
                if old != 0 {
                    Err(Qcow2Error::Corrupt(format!(
                        "cluster {c} past the end of the image already has refcount {old}"
                    )))
                } else {
                    Ok(1)
                }
            })?;
            c += 1;
        }
        self.next_free = end;
        if self.free_hint >= base >> self.cluster_bits {
            self.free_hint = end >> self.cluster_bits;
        }
        Ok(start)
    }

    /// Makes the in-memory table large enough for `entries` entries, at a new place.
    fn grow_table(&mut self, entries: usize) -> Result<(), Qcow2Error> {
        let cs = self.cs();
        let want = (entries as u64).max(self.table.len() as u64 * 2) * 8;
        let clusters = want.div_ceil(cs);
        if clusters * cs > MAX_REFTABLE_BYTES {
            return Err(Qcow2Error::Io {
                what: "the refcount table would exceed 8 MiB".into(),
                source: std::io::Error::from_raw_os_error(27), // EFBIG
            });
        }
        let old = (self.table_offset, (self.table.len() as u64 * 8).div_ceil(cs));
        // An earlier move not yet written: its table was never used, nothing to free.
        if self.table_moved.is_none() {
            self.table_moved = Some(old);
        } else {
            self.pending_free.extend((0..old.1).map(|i| (old.0 + i * cs, false)));
        }
        self.table_offset = self.next_free;
        self.next_free += clusters * cs;
        self.table.resize((clusters * cs / 8) as usize, 0);
        Ok(())
    }

    fn set(
        &mut self,
        store: &dyn Store,
        cluster: u64,
        f: impl FnOnce(u16) -> Result<u16, Qcow2Error>,
    ) -> Result<(), Qcow2Error> {
        let per = self.per_block();
        let idx = (cluster / per) as usize;
        let i = (cluster % per) as usize;
        let Some(b) = self.block(store, idx)? else {
            return Err(Qcow2Error::Corrupt(format!("no refcount block for cluster {cluster}")));
        };
        b.counts[i] = f(b.counts[i])?;
        b.dirty = true;
        Ok(())
    }

    /// Frees (decrements) every cluster that `host..host + len` touches, later; with
    /// `discard`, a cluster whose refcount reaches 0 is then discarded from the file.
    pub fn free(&mut self, host: u64, len: u64, discard: bool) {
        let cs = self.cs();
        let first = host / cs;
        let last = (host + len.max(1) - 1) / cs;
        self.pending_free.extend((first..=last).map(|c| (c * cs, discard)));
    }

    /// Bytes of clusters waiting to be freed.
    pub fn pending_bytes(&self) -> u64 {
        (self.pending_free.len() as u64) << self.cluster_bits
    }

    pub fn dirty(&self) -> bool {
        !self.table_dirty.is_empty() || self.table_moved.is_some() || self.blocks.values().any(|b| b.dirty)
    }

    pub fn has_frees(&self) -> bool {
        !self.pending_free.is_empty()
    }

    /// Where the never-allocated clusters begin: nothing at or past it is counted, so
    /// nothing may refer to it yet.
    pub fn high_water(&self) -> u64 {
        self.next_free
    }

    /// Writes dirty refcount blocks and table entries; when the table moved, the whole
    /// new table, then (after `sync`) the header pointing at it.
    pub fn write(
        &mut self,
        store: &dyn Store,
        sync: &dyn Fn(&str) -> Result<(), Qcow2Error>,
    ) -> Result<(), Qcow2Error> {
        let cs = self.cs();
        for (idx, b) in self.blocks.iter_mut().filter(|(_, b)| b.dirty) {
            let off = self.table[*idx];
            let bytes: Vec<u8> = b.counts.iter().flat_map(|c| c.to_be_bytes()).collect();
            store.write_at(&bytes, off).map_err(io_err(format!("cannot write the refcount block at {off:#x}")))?;
            b.dirty = false;
        }
        if let Some((old_off, old_clusters)) = self.table_moved {
            let bytes: Vec<u8> = self.table.iter().flat_map(|e| e.to_be_bytes()).collect();
            store.write_at(&bytes, self.table_offset).map_err(io_err("cannot write the refcount table"))?;
            sync("the refcount table")?;
            let mut h = Vec::with_capacity(12);
            h.extend_from_slice(&self.table_offset.to_be_bytes());
            h.extend_from_slice(&((bytes.len() as u64 / cs) as u32).to_be_bytes());
            store.write_at(&h, REFTABLE_OFFSET_AT).map_err(io_err("cannot write the header"))?;
            self.table_moved = None;
            self.table_dirty.clear();
            self.pending_free.extend((0..old_clusters).map(|i| (old_off + i * cs, false)));
        } else {
            for &i in &self.table_dirty {
                store
                    .write_at(&self.table[i].to_be_bytes(), self.table_offset + i as u64 * 8)
                    .map_err(io_err("cannot write the refcount table"))?;
            }
            self.table_dirty.clear();
        }
        Ok(())
    }

    /// Applies the pending frees to the cached blocks (written by the next `write`); the
    /// clusters they make free can be allocated again from now on. Returns the ranges
    /// (offset, length) of those freed with `discard`, merged, for the file to discard.
    pub fn apply_frees(&mut self, store: &dyn Store) -> Result<Vec<(u64, u64)>, Qcow2Error> {
        let cs = self.cs();
        let mut pending = std::mem::take(&mut self.pending_free);
        pending.sort_unstable();
        let mut discard: Vec<(u64, u64)> = Vec::new();
        for (off, wanted) in pending {
            let c = off / cs;
            let mut now_free = false;
            self.set(store, c, |old| match old {
                0 => {
                    log::error!("freeing cluster {c} whose refcount is already 0 (left as is)");
                    Ok(0)
                }
                n => {
                    now_free = n == 1;
                    Ok(n - 1)
                }
            })?;
            if now_free {
                store.cluster_freed(off);
                self.free_hint = self.free_hint.min(c);
                if wanted {
                    match discard.last_mut() {
                        Some((o, l)) if *o + *l == off => *l += cs,
                        _ => discard.push((off, cs)),
                    }
                }
            }
        }
        Ok(discard)
    }

    /// Moves the end of the allocated area back over the free clusters just before it;
    /// returns the new end when it moved (the file may be cut there).
    pub fn shrink_end(&mut self, store: &dyn Store) -> Result<Option<u64>, Qcow2Error> {
        let per = self.per_block();
        let old = self.next_free >> self.cluster_bits;
        // A refcount block at a time, scanning its counts backwards.
        let mut c = old;
        while c > 0 {
            let idx = (c - 1) / per;
            let Some(b) = self.block(store, idx as usize)? else { break };
            let hi = (c - idx * per) as usize;
            match b.counts[..hi].iter().rposition(|&x| x != 0) {
                Some(i) => {
                    c = idx * per + i as u64 + 1;
                    break;
                }
                None => c = idx * per,
            }
        }
        if c == old {
            return Ok(None);
        }
        self.next_free = c << self.cluster_bits;
        self.free_hint = self.free_hint.min(c);
        Ok(Some(self.next_free))
    }
}
