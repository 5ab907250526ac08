//! Refcounts (16-bit) for writable images: the refcount table, cached refcount blocks,
//! allocation at the end of the file, and frees that are applied only after the
//! metadata that stopped using a cluster is on disk.

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
    /// Host offset of the first never-used cluster: every allocation goes here.
    next_free: u64,
    /// Clusters to decrement once the metadata no longer referring to them is on disk.
    pending_free: Vec<u64>,
}

impl Refcounts {
    pub fn load(store: &dyn Store, h: &Header) -> Result<Refcounts, Qcow2Error> {
        let cs = h.cluster_size();
        let mut raw = vec![0u8; (u64::from(h.refcount_table_clusters) * cs) as usize];
        store.read_at(&mut raw, h.refcount_table_offset).map_err(io_err("cannot read the refcount table"))?;
        let table: Vec<u64> = raw.chunks_exact(8).map(|c| u64::from_be_bytes(c.try_into().unwrap_or([0; 8]))).collect();
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

    /// Allocates `n` contiguous clusters with refcount 1 and returns the first's offset.
    /// Refcount blocks (and a larger refcount table) needed to count them are allocated
    /// first, just before them.
    pub fn alloc(&mut self, store: &dyn Store, n: u64) -> Result<u64, Qcow2Error> {
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
            self.pending_free.extend((0..old.1).map(|i| old.0 + i * cs));
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

    /// Frees (decrements) every cluster that `host..host + len` touches, later.
    pub fn free(&mut self, host: u64, len: u64) {
        let cs = self.cs();
        let first = host / cs;
        let last = (host + len.max(1) - 1) / cs;
        self.pending_free.extend((first..=last).map(|c| c * cs));
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
            self.pending_free.extend((0..old_clusters).map(|i| old_off + i * cs));
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

    /// Applies the pending frees to the cached blocks (written by the next `write`).
    pub fn apply_frees(&mut self, store: &dyn Store) -> Result<(), Qcow2Error> {
        let cs = self.cs();
        for off in std::mem::take(&mut self.pending_free) {
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
            }
        }
        Ok(())
    }
}
