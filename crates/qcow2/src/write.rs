//! Writing: WRITE, WRITE_ZEROES, TRIM and FLUSH.
//!
//! A write to a cluster this image owns (COPIED) goes straight to its host offset, and so
//! does one to a preallocated zero cluster (an owned cluster with the zero flag, left by
//! WRITE_ZEROES with NO_HOLE). Any other cluster gets a new one: a freed cluster if one is
//! free, else at the end of the allocated area; a partial write fills the rest of the new
//! cluster from the old contents (backing file, zeroes, compressed or shared data), under
//! the metadata lock so two partial writes cannot allocate the same cluster twice. Whole
//! clusters are only mapped under the lock and written after it is released.
//!
//! FLUSH: sync the data, write the refcount increments, sync, write the L2 tables, sync,
//! write the L1 entries, sync, and only then apply and write the frees, sync. A crash at
//! any point leaves clusters counted but unused (leaks), never used but uncounted. A
//! cluster becomes free (and can be allocated again) only at that last step, when no
//! metadata on disk points at it any more; clusters freed by TRIM or WRITE_ZEROES are then
//! punched out of the file (as qemu's `discard=unmap`), and free clusters at the end of
//! the file are cut off. Writes land outside the lock, so that step first waits for those
//! in flight: none can land in a cluster after it was given to another guest range.
//! Frees wait for a FLUSH, but not forever: once [`COMMIT_FREES`] bytes wait and no freed
//! cluster is left, a write that needs clusters writes the metadata first (with FLUSH's
//! syncs), so a client that never flushes does not grow the file either.

use crate::header::Header;
use crate::map::{L2Table, Mapping, OFFSET_MASK, OFLAG_COMPRESSED, OFLAG_COPIED, OFLAG_ZERO};
use crate::overlap::Metadata;
use crate::{io_err, Qcow2, Qcow2Error, State};

/// Waiting frees are applied without a FLUSH once this many bytes of them wait (or 16
/// clusters, whichever is more) and a write finds no free cluster.
pub const COMMIT_FREES: u64 = 8 << 20;

/// A cluster this image owns outright: written in place.
fn owned(e: u64) -> bool {
    e & OFLAG_COPIED != 0 && e & OFLAG_COMPRESSED == 0 && e & OFFSET_MASK != 0
}

/// Refuses (before anything is written) images this layer cannot write safely.
pub fn check_writable(h: &Header) -> Result<(), Qcow2Error> {
    if h.incompatible & crate::header::INCOMPAT_CORRUPT != 0 {
        return Err(Qcow2Error::Unsupported(
            "the image has the corrupt bit set (ferry or qemu found inconsistent metadata and stopped writing to it); \
             open it read-only to rescue its data, or repair it with qemu-img check -r all"
                .into(),
        ));
    }
    let why = if h.version < 3 {
        Some("it is a version 2 (compat=0.10) image".to_string())
    } else if h.extended_l2() {
        Some("it has extended L2 entries (subclusters)".into())
    } else if h.data_file.is_some() {
        Some("it has an external data file".into())
    } else if h.nb_snapshots > 0 {
        Some(format!("it has {} internal snapshot(s)", h.nb_snapshots))
    } else if h.refcount_order != 4 {
        Some(format!("it has {}-bit refcounts (ferry writes 16-bit ones)", 1u32 << h.refcount_order))
    } else {
        None
    };
    match why {
        Some(w) => Err(Qcow2Error::Unsupported(format!(
            "ferry cannot write to this image: {w}; open it read-only, or convert it with qemu-img convert -O qcow2 -o compat=1.1"
        ))),
        None => Ok(()),
    }
}

fn not_writable() -> Qcow2Error {
    Qcow2Error::Io { what: "the image is read-only".into(), source: std::io::Error::from_raw_os_error(30) }
}

impl Qcow2 {
    /// The L2 table for guest offset `guest`, allocating an empty one when the L1 entry
    /// is empty. Returns the table's host offset.
    fn l2_for_write(&self, st: &mut State, guest: u64) -> Result<u64, Qcow2Error> {
        let idx = (guest / self.geo.l2_span()) as usize;
        let e = *st.l1.get(idx).ok_or_else(|| Qcow2Error::Corrupt(format!("no L1 entry for guest offset {guest}")))?;
        let off = e & OFFSET_MASK;
        if off != 0 {
            self.l2_table(st, off)?;
            self.safety.check_l2_write(idx, off, guest)?;
            return Ok(off);
        }
        let (off, _) = self.alloc(st, 1)?;
        self.store.metadata_allocated(Metadata::L2Table(idx as u32), off, self.geo.cluster_size);
        st.l2.insert(off, L2Table::zeroed(self.geo.l2_entries as usize));
        st.l1[idx] = off | OFLAG_COPIED;
        st.l1_dirty.insert(idx);
        Ok(off)
    }

    fn entry_index(&self, guest: u64) -> usize {
        ((guest >> self.geo.cluster_bits) & (self.geo.l2_entries - 1)) as usize
    }

    /// Reads the current guest contents of one cluster (for copy-on-write).
    fn old_cluster(&self, entry: u64, guest_cluster: u64, out: &mut [u8]) -> Result<(), Qcow2Error> {
        let (m, _) = self.geo.decode(entry, 0, guest_cluster)?;
        match m {
            Mapping::Zero => out.fill(0),
            Mapping::Unallocated => self.read_backing(out, guest_cluster)?,
            Mapping::Data(h) => self.data.read_at(out, h).map_err(io_err("cannot read a cluster to copy"))?,
            Mapping::Compressed { host, len, .. } => self.read_compressed(host, len, 0, out)?,
        }
        // The last cluster may reach past the virtual size: keep that tail zero.
        let valid = self.geo.size.saturating_sub(guest_cluster).min(out.len() as u64) as usize;
        out[valid..].fill(0);
        Ok(())
    }

    /// Up to `n` contiguous new clusters: (host offset, how many).
    fn alloc(&self, st: &mut State, n: u64) -> Result<(u64, u64), Qcow2Error> {
        st.refs.as_mut().ok_or_else(not_writable)?.alloc(&*self.store, n)
    }

    /// Applies the waiting frees now (writing the metadata as FLUSH does) when they add
    /// up to [`COMMIT_FREES`] and no freed cluster is left to allocate.
    fn commit_frees_if_due(&self, st: &mut State) -> Result<(), Qcow2Error> {
        let refs = st.refs.as_mut().ok_or_else(not_writable)?;
        if refs.pending_bytes() < COMMIT_FREES.max(16 * self.geo.cluster_size) || refs.has_free(&*self.store)? {
            return Ok(());
        }
        self.write_metadata_locked(st, self.sync_on_close)
    }

    /// What an L2 entry allocates in the file, to free when it is replaced; with
    /// `discard` (TRIM, WRITE_ZEROES), the file is told to discard it once it is free.
    fn release(&self, st: &mut State, entry: u64, discard: bool) {
        let Some(refs) = st.refs.as_mut() else { return };
        if entry & OFLAG_COMPRESSED != 0 {
            if let Ok((Mapping::Compressed { host, len, .. }, _)) = self.geo.decode(entry, 0, 0) {
                refs.free(host, len, discard);
            }
        } else if entry & OFFSET_MASK != 0 {
            refs.free(entry & OFFSET_MASK, self.geo.cluster_size, discard);
        }
    }

    /// Points guest cluster `gc` (L2 table at `l2_off`) at host cluster `h`, whose old
    /// guest contents are given by `old`: a partial write merges them with the new bytes
    /// and is written now (under the lock); a whole cluster is queued in `direct`.
    #[allow(clippy::too_many_arguments)]
    fn map_cluster(
        &self,
        st: &mut State,
        l2_off: u64,
        gc: u64,
        old: u64,
        h: u64,
        buf: &[u8],
        offset: u64,
        direct: &mut Vec<(u64, usize, usize)>,
    ) -> Result<bool, Qcow2Error> {
        let cs = self.geo.cluster_size;
        let end = offset + buf.len() as u64;
        let s = gc.max(offset);
        let t = (gc + cs).min(end);
        let later = t - s == cs;
        if !later {
            let mut cl = vec![0u8; cs as usize];
            self.old_cluster(old, gc, &mut cl)?;
            cl[(s - gc) as usize..(t - gc) as usize]
                .copy_from_slice(&buf[(s - offset) as usize..(t - offset) as usize]);
            self.data.write_at(&cl, h).map_err(io_err(format!("cannot write data at {h:#x}")))?;
        } else {
            push_direct(direct, h, (s - offset) as usize, (t - offset) as usize);
        }
        let idx = self.entry_index(gc);
        let table = self.l2_table(st, l2_off)?;
        table.raw[idx] = h | OFLAG_COPIED;
        table.dirty = true;
        Ok(later)
    }

    /// A write failed after clusters were mapped for data that never landed (`fresh`:
    /// guest cluster, host cluster, the entry to put back): each still mapped so becomes
    /// what it was (preallocated zeroes) or a zero cluster, and a cluster taken for it is
    /// freed. The range then reads zeroes, never stale bytes of another range, and no
    /// counted cluster is left past the end of the file (ENOSPC).
    fn undo_fresh(&self, st: &mut State, fresh: &[(u64, u64, u64)]) {
        for &(gc, h, restore) in fresh {
            let l2_off = st.l1.get((gc / self.geo.l2_span()) as usize).map_or(0, |e| e & OFFSET_MASK);
            if l2_off == 0 {
                continue;
            }
            let idx = self.entry_index(gc);
            let Ok(table) = self.l2_table(st, l2_off) else { continue };
            let e = table.raw[idx];
            if e & OFFSET_MASK != h || e & OFLAG_ZERO != 0 {
                continue; // rewritten since by another request
            }
            table.raw[idx] = restore;
            table.dirty = true;
            if restore & OFFSET_MASK != h {
                if let Some(refs) = st.refs.as_mut() {
                    refs.free(h, self.geo.cluster_size, false);
                }
            }
        }
    }

    /// The part of a write done under the metadata lock: clusters looked up or allocated
    /// and mapped, partial clusters written; whole clusters are left in `direct`, and
    /// those mapped for them in `fresh`.
    fn plan_write(
        &self,
        st: &mut State,
        buf: &[u8],
        offset: u64,
        direct: &mut Vec<(u64, usize, usize)>,
        fresh: &mut Vec<(u64, u64, u64)>,
    ) -> Result<(), Qcow2Error> {
        let cs = self.geo.cluster_size;
        let end = offset + buf.len() as u64;
        self.commit_frees_if_due(st)?;
        let mut pos = offset;
        while pos < end {
            let l2_off = self.l2_for_write(st, pos)?;
            let span_end = end.min((pos / self.geo.l2_span() + 1) * self.geo.l2_span());
            // Classify the clusters of this L2 table's part of the range.
            let first = pos;
            let mut need: Vec<(u64, u64)> = Vec::new(); // (guest cluster start, old entry)
            let mut c = pos & !(cs - 1);
            while c < span_end {
                let idx = self.entry_index(c);
                let e = self.l2_table(st, l2_off)?.raw[idx];
                if owned(e) && e & OFLAG_ZERO != 0 {
                    // Preallocated zeroes: the cluster is ours, its bytes are not.
                    let h = e & OFFSET_MASK;
                    if self.map_cluster(st, l2_off, c, OFLAG_ZERO, h, buf, offset, direct)? {
                        fresh.push((c, h, e));
                    }
                } else if owned(e) {
                    let s = c.max(first);
                    let t = (c + cs).min(span_end);
                    push_direct(direct, (e & OFFSET_MASK) + (s - c), (s - offset) as usize, (t - offset) as usize);
                } else {
                    need.push((c, e));
                }
                c += cs;
            }
            // Allocate runs of consecutive clusters contiguously.
            let mut i = 0;
            while i < need.len() {
                let mut j = i + 1;
                while j < need.len() && need[j].0 == need[j - 1].0 + cs {
                    j += 1;
                }
                // Freed clusters may come in shorter runs.
                let (host, got) = self.alloc(st, (j - i) as u64)?;
                let j = i + got as usize;
                for (k, &(gc, old)) in need[i..j].iter().enumerate() {
                    let h = host + k as u64 * cs;
                    match self.map_cluster(st, l2_off, gc, old, h, buf, offset, direct) {
                        Ok(later) => {
                            if later {
                                fresh.push((gc, h, OFLAG_ZERO));
                            }
                        }
                        Err(e) => {
                            // This cluster and the rest of the run were taken, not mapped.
                            if let Some(refs) = st.refs.as_mut() {
                                refs.free(h, (got - k as u64) * cs, false);
                            }
                            return Err(e);
                        }
                    }
                    self.release(st, old, false);
                }
                i = j;
            }
            pos = span_end;
        }
        Ok(())
    }

    /// Records a change of guest bytes in the enabled persistent bitmaps, after they
    /// were marked in use on disk (the first-write hook).
    fn record(&self, offset: u64, len: u64) -> Result<(), Qcow2Error> {
        if !self.recording_any.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        let rec = self.recording.read().unwrap_or_else(|e| e.into_inner());
        if !rec.is_empty() {
            self.safety.before_write()?;
            for b in rec.iter() {
                b.mark(offset, len);
            }
        }
        Ok(())
    }

    pub(crate) fn write_impl(&self, buf: &[u8], offset: u64, fua: bool) -> Result<(), Qcow2Error> {
        if !self.writable {
            return Err(not_writable());
        }
        self.safety.refuse_if_corrupt()?;
        self.record(offset, buf.len() as u64)?;
        // (host offset, range of buf) written after the lock is released.
        let mut direct: Vec<(u64, usize, usize)> = Vec::new();
        // Clusters mapped for data still to land there (see `undo_fresh`).
        let mut fresh: Vec<(u64, u64, u64)> = Vec::new();
        let gate = {
            let mut st = self.lock();
            if let Err(e) = self.plan_write(&mut st, buf, offset, &mut direct, &mut fresh) {
                self.undo_fresh(&mut st, &fresh);
                return Err(e);
            }
            // Taken before the lock is released: no cluster written below is freed (and
            // given to another range) until these writes have landed.
            self.io_gate.read().unwrap_or_else(|e| e.into_inner())
        };
        let mut failed = None;
        for (host, a, b) in direct {
            if let Err(e) = self.data.write_at(&buf[a..b], host) {
                failed = Some(io_err(format!("cannot write data at {host:#x}"))(e));
                break;
            }
        }
        // The gate goes before the lock is taken again (a FLUSH holds the lock while it
        // waits for the gate).
        drop(gate);
        if let Some(e) = failed {
            self.undo_fresh(&mut self.lock(), &fresh);
            return Err(e);
        }
        if fua {
            self.flush_impl()?;
        }
        Ok(())
    }

    /// WRITE_ZEROES (`zero`) or TRIM: whole clusters become zero clusters (or, without a
    /// backing file, unallocated ones) and their storage is freed; the partial clusters
    /// at the ends are written with zeroes (WRITE_ZEROES) or left alone (TRIM). Without
    /// `may_trim` (WRITE_ZEROES with NO_HOLE), clusters the image owns keep their storage
    /// and get the zero flag (preallocated zeroes, as qemu does without MAY_UNMAP).
    pub(crate) fn discard_impl(
        &self,
        offset: u64,
        length: u64,
        zero: bool,
        may_trim: bool,
        fua: bool,
    ) -> Result<(), Qcow2Error> {
        if !self.writable {
            return Err(not_writable());
        }
        self.safety.refuse_if_corrupt()?;
        self.record(offset, length)?;
        let cs = self.geo.cluster_size;
        let end = offset + length;
        let first_full = offset.next_multiple_of(cs);
        // The last cluster may be partial in the virtual size: it still counts as whole.
        let last_full = if end == self.geo.size { end.next_multiple_of(cs) } else { end & !(cs - 1) };
        let backing = self.backing.is_some();
        // What a whole cluster the image does not own (or may deallocate) becomes.
        let new_entry = if backing || !may_trim { OFLAG_ZERO } else { 0 };
        if first_full < last_full {
            let mut st = self.lock();
            let span = self.geo.l2_span();
            let mut c = first_full;
            while c < last_full {
                let l1e = st.l1.get((c / span) as usize).copied().unwrap_or(0) & OFFSET_MASK;
                let span_end = last_full.min((c / span + 1) * span);
                // Where nothing is allocated and nothing shows through, there is nothing to do.
                if l1e == 0 && !backing {
                    c = span_end;
                    continue;
                }
                let l2_off = self.l2_for_write(&mut st, c)?;
                while c < span_end {
                    let idx = self.entry_index(c);
                    let t = self.l2_table(&mut st, l2_off)?;
                    let old = t.raw[idx];
                    let (new, free) = match old {
                        _ if !may_trim && owned(old) => ((old & OFFSET_MASK) | OFLAG_COPIED | OFLAG_ZERO, false),
                        0 if !backing => (0, false),
                        _ => (new_entry, true),
                    };
                    if old != new {
                        t.raw[idx] = new;
                        t.dirty = true;
                        if free {
                            self.release(&mut st, old, may_trim);
                        }
                    }
                    c += cs;
                }
            }
        }
        if zero {
            let parts = if first_full >= last_full {
                vec![(offset, end)]
            } else {
                vec![(offset, first_full), (last_full, end)]
            };
            for (s, t) in parts {
                if s < t && !self.reads_as_zero(s, t - s)? {
                    let z = vec![0u8; (t - s) as usize];
                    self.write_impl(&z, s, false)?;
                }
            }
        }
        if fua {
            self.flush_impl()?;
        }
        Ok(())
    }

    fn reads_as_zero(&self, offset: u64, len: u64) -> Result<bool, Qcow2Error> {
        let runs = self.runs(offset, len)?;
        Ok(runs.iter().all(|(_, m)| *m == Mapping::Zero || (*m == Mapping::Unallocated && self.backing.is_none())))
    }

    pub(crate) fn flush_impl(&self) -> Result<(), Qcow2Error> {
        self.write_metadata(true)
    }

    /// Writes the dirty metadata in FLUSH's order; with `sync`, syncs before and between
    /// the steps (FLUSH), without, leaves it all to the kernel's writeback (closing an
    /// image made [`Qcow2::without_sync_on_close`]).
    pub(crate) fn write_metadata(&self, sync: bool) -> Result<(), Qcow2Error> {
        if !self.writable {
            return Ok(());
        }
        self.write_metadata_locked(&mut self.lock(), sync)
    }

    pub(crate) fn write_metadata_locked(&self, st: &mut State, sync: bool) -> Result<(), Qcow2Error> {
        // Writes in flight outside the lock land first: no metadata (an L2 entry, a
        // refcount) reaches the disk before the data it describes, and no cluster is freed
        // (and given to another range) under a write still to land.
        let _gate = self.io_gate.write().unwrap_or_else(|e| e.into_inner());
        if sync {
            self.data.sync().map_err(io_err("cannot sync data"))?;
        }
        let refs = st.refs.as_mut().ok_or_else(not_writable)?;
        let store = &*self.store;
        let metadata = refs.dirty() || st.l2.dirty_count() > 0 || !st.l1_dirty.is_empty();
        if !metadata && !refs.has_frees() {
            return Ok(());
        }
        let sync = |what: &str| match sync {
            true => store.sync().map_err(io_err(format!("cannot sync {what}"))),
            false => Ok(()),
        };
        if refs.dirty() {
            refs.write(store, &sync)?;
            sync("refcounts")?;
        }
        if st.l2.dirty_count() > 0 {
            for (off, t) in st.l2.dirty() {
                store
                    .write_at(&t.to_bytes(), *off)
                    .map_err(io_err(format!("cannot write the L2 table at {off:#x}")))?;
                t.dirty = false;
            }
            sync("L2 tables")?;
        }
        if !st.l1_dirty.is_empty() {
            for &i in &st.l1_dirty {
                let at = self.header.l1_table_offset + i as u64 * 8;
                store.write_at(&st.l1[i].to_be_bytes(), at).map_err(io_err("cannot write the L1 table"))?;
            }
            st.l1_dirty.clear();
            sync("the L1 table")?;
        }
        if refs.has_frees() {
            let discard = refs.apply_frees(store)?;
            refs.write(store, &sync)?;
            sync("refcounts")?;
            // A freed compressed cluster's place may hold other bytes from now on.
            *self.zcache.lock().unwrap_or_else(|e| e.into_inner()) = None;
            for (off, len) in discard {
                if let Err(e) = self.data.discard(off, len) {
                    log::warn!("{}: cannot discard {len} bytes at {off:#x} of the file: {e}", self.name);
                }
            }
            if let Some(end) = refs.shrink_end(store)? {
                // Only space is at stake: the metadata is durable, so a failed cut is not
                // a failed FLUSH (the file just stays longer).
                if store.size() > end {
                    if let Err(e) = store.truncate(end) {
                        log::warn!("{}: cannot cut the file to {end} bytes: {e}", self.name);
                    }
                }
            }
        }
        Ok(())
    }
}

fn push_direct(v: &mut Vec<(u64, usize, usize)>, host: u64, a: usize, b: usize) {
    if let Some(last) = v.last_mut() {
        if last.0 + (last.2 - last.1) as u64 == host && last.2 == a {
            last.2 = b;
            return;
        }
    }
    v.push((host, a, b));
}

#[cfg(test)]
mod tests {
    use crate::Qcow2;
    use ferry_backend::{Backend, ZeroMode};
    use std::os::unix::fs::MetadataExt;

    const CS: u64 = 65536;
    const TRIM: ZeroMode = ZeroMode { may_trim: true, fast: false };

    fn host(q: &Qcow2, guest: u64) -> u64 {
        q.file_offset(guest, CS).expect("a data cluster")
    }

    /// A freed cluster is not given out again until the L2 entry that used it is on
    /// disk (a FLUSH); then it is, before the file grows.
    #[test]
    fn freed_clusters_are_reused_only_after_the_flush() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.qcow2");
        let q = Qcow2::create(&p, 64 << 20, CS).unwrap();
        q.write(&[1u8; CS as usize * 4], 0, false).unwrap();
        let old = host(&q, 0);
        q.trim(0, CS, false).unwrap();
        q.write(&[2u8; CS as usize], 8 * CS, false).unwrap();
        assert_ne!(host(&q, 8 * CS), old, "reused before the trim was flushed");
        q.flush().unwrap();
        q.write(&[3u8; CS as usize], 9 * CS, false).unwrap();
        assert_eq!(host(&q, 9 * CS), old, "the freed cluster was not reused");
        let mut b = vec![0u8; CS as usize * 10];
        q.read(&mut b, 0).unwrap();
        assert!(b[..CS as usize].iter().all(|&x| x == 0));
        assert!(b[CS as usize..4 * CS as usize].iter().all(|&x| x == 1));
        assert!(b[8 * CS as usize..9 * CS as usize].iter().all(|&x| x == 2));
        assert!(b[9 * CS as usize..].iter().all(|&x| x == 3));
    }

    /// Trimmed clusters are punched out of the file once free, and free clusters at the
    /// end of the file are cut off.
    #[test]
    fn trim_punches_and_cuts_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.qcow2");
        let q = Qcow2::create(&p, 64 << 20, CS).unwrap();
        q.write(&vec![7u8; 16 << 20], 0, false).unwrap();
        q.flush().unwrap();
        let full = std::fs::metadata(&p).unwrap();
        // The first half: holes in the middle of the file.
        q.trim(0, 8 << 20, false).unwrap();
        q.flush().unwrap();
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.len(), full.len());
        assert!(m.blocks() * 512 <= full.blocks() * 512 - (8 << 20), "{} -> {}", full.blocks(), m.blocks());
        // The rest: the file ends after its metadata again.
        q.zero(8 << 20, 8 << 20, TRIM, false).unwrap();
        q.flush().unwrap();
        assert!(std::fs::metadata(&p).unwrap().len() <= 8 * CS);
        // Allocation goes on from the new end.
        q.write(&[9u8; 100], 20 << 20, true).unwrap();
        assert!(host(&q, 20 << 20) < 8 * CS);
    }

    /// Without a FLUSH, waiting frees are applied once there are enough of them and the
    /// image would otherwise grow.
    #[test]
    fn waiting_frees_are_applied_before_the_file_grows() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.qcow2");
        let q = Qcow2::create(&p, 256 << 20, CS).unwrap();
        let buf = vec![5u8; 16 << 20];
        for i in 0..8u64 {
            q.write(&buf, i * (16 << 20), false).unwrap();
            q.trim(i * (16 << 20), 16 << 20, false).unwrap();
        }
        assert!(std::fs::metadata(&p).unwrap().len() < 40 << 20);
    }

    /// WRITE_ZEROES with NO_HOLE keeps an owned cluster (preallocated zeroes); writing
    /// into it again uses it in place.
    #[test]
    fn no_hole_zeroes_keep_the_cluster() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.qcow2");
        let q = Qcow2::create(&p, 4 << 20, CS).unwrap();
        q.write(&[1u8; CS as usize], 0, false).unwrap();
        let h = host(&q, 0);
        q.zero(0, CS, ZeroMode::default(), false).unwrap();
        let mut b = vec![1u8; CS as usize];
        q.read(&mut b, 0).unwrap();
        assert!(b.iter().all(|&x| x == 0));
        q.write(&[2u8; 100], 1000, false).unwrap();
        assert_eq!(host(&q, 0), h);
        q.read(&mut b, 0).unwrap();
        assert!(b[..1000].iter().all(|&x| x == 0) && b[1000..1100].iter().all(|&x| x == 2));
        assert!(b[1100..].iter().all(|&x| x == 0));
    }

    /// A store whose full-cluster write at `hold` waits until released; `discard` does
    /// nothing (a file system without hole punching).
    struct Slow {
        inner: crate::store::FileStore,
        hold: std::sync::atomic::AtomicU64,
        entered: std::sync::Mutex<Option<std::sync::mpsc::Sender<()>>>,
        release: std::sync::Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    }
    impl crate::store::Store for Slow {
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn read_at(&self, b: &mut [u8], o: u64) -> std::io::Result<()> {
            self.inner.read_at(b, o)
        }
        fn write_at(&self, b: &[u8], o: u64) -> std::io::Result<()> {
            if b.len() as u64 == CS && o == self.hold.load(std::sync::atomic::Ordering::SeqCst) {
                if let Some(tx) = self.entered.lock().unwrap().take() {
                    tx.send(()).unwrap();
                }
                let rx = self.release.lock().unwrap().take();
                if let Some(rx) = rx {
                    rx.recv().unwrap();
                }
            }
            self.inner.write_at(b, o)
        }
        fn sync(&self) -> std::io::Result<()> {
            self.inner.sync()
        }
        fn truncate(&self, l: u64) -> std::io::Result<()> {
            self.inner.truncate(l)
        }
    }

    fn run(prealloc: bool) -> u8 {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.qcow2");
        {
            let q = Qcow2::create(&p, 64 << 20, CS).unwrap();
            q.write(&[0xaa; 2 * CS as usize], 0, false).unwrap();
            q.flush().unwrap();
        }
        let (etx, erx) = std::sync::mpsc::channel();
        let (rtx, rrx) = std::sync::mpsc::channel();
        let slow = std::sync::Arc::new(Slow {
            inner: crate::store::FileStore::open(&p, true, ferry_backend::ImageUse::serve(false).qcow2()).unwrap(),
            hold: std::sync::atomic::AtomicU64::new(u64::MAX),
            entered: std::sync::Mutex::new(Some(etx)),
            release: std::sync::Mutex::new(Some(rrx)),
        });
        let q = std::sync::Arc::new(
            Qcow2::open_store(
                slow.clone(),
                "t".into(),
                &crate::Options::default(),
                ferry_backend::ImageUse::serve(false),
                Some(dir.path()),
                0,
            )
            .unwrap(),
        );
        let h = host(&q, 0);
        let target = if prealloc {
            // WRITE_ZEROES with NO_HOLE: guest cluster 0 keeps its cluster as preallocated zeroes.
            q.zero(0, CS, ZeroMode::default(), false).unwrap();
            q.flush().unwrap();
            0
        } else {
            q.trim(0, CS, false).unwrap();
            q.flush().unwrap();
            5 * CS
        };
        slow.hold.store(h, std::sync::atomic::Ordering::SeqCst);
        let q2 = q.clone();
        let t = std::thread::spawn(move || q2.write(&[0xbb; CS as usize], target, false).unwrap());
        erx.recv().unwrap(); // the direct write is in flight (lock released)
        let rel = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            rtx.send(()).unwrap();
        });
        q.flush().unwrap(); // another connection's FLUSH
                            // What a crash now leaves on disk (read beside the open image, as qemu-img -U).
        let ro = crate::Options { read_only: true, ..Default::default() };
        let r = Qcow2::open_for(&p, &ro, ferry_backend::ImageUse::serve(true).force_share(true)).unwrap();
        let mut b = vec![0u8; CS as usize];
        r.read(&mut b, target).unwrap();
        rel.join().unwrap();
        t.join().unwrap();
        b[0]
    }

    #[test]
    fn a_flush_during_a_write_to_a_reused_cluster_waits_for_its_data() {
        let v = run(false);
        assert!(v == 0 || v == 0xbb, "guest cluster 5 reads {v:#x} from disk (guest 0's old data)");
    }

    #[test]
    fn a_flush_during_a_write_over_preallocated_zeroes_waits_for_its_data() {
        let v = run(true);
        assert!(v == 0 || v == 0xbb, "guest cluster 0 reads {v:#x} from disk (zeroed data resurrected)");
    }

    /// A store whose whole-cluster writes fail with ENOSPC while `fail` is set, and
    /// which punches nothing (old bytes stay in freed clusters).
    struct Full {
        inner: crate::store::FileStore,
        fail: std::sync::atomic::AtomicBool,
    }
    impl crate::store::Store for Full {
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn read_at(&self, b: &mut [u8], o: u64) -> std::io::Result<()> {
            self.inner.read_at(b, o)
        }
        fn write_at(&self, b: &[u8], o: u64) -> std::io::Result<()> {
            if (b.len() as u64).is_multiple_of(CS) && self.fail.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(std::io::Error::from_raw_os_error(28));
            }
            self.inner.write_at(b, o)
        }
        fn sync(&self) -> std::io::Result<()> {
            self.inner.sync()
        }
        fn truncate(&self, l: u64) -> std::io::Result<()> {
            self.inner.truncate(l)
        }
    }

    /// A write whose data never lands (ENOSPC) leaves its range reading zeroes, not the
    /// old bytes of the reused cluster it was given, and no counted cluster past the end
    /// of the file: the image opens read-write again without --allow-truncated.
    #[test]
    fn a_failed_write_leaves_zeroes_and_no_cluster_past_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.qcow2");
        {
            let q = Qcow2::create(&p, 64 << 20, CS).unwrap();
            q.write(&[0xaa; CS as usize], 0, false).unwrap();
            // A cluster after it, so freeing guest 0's does not cut the file.
            q.write(&[0x11; CS as usize], CS, false).unwrap();
            q.flush().unwrap();
        }
        let full = std::sync::Arc::new(Full {
            inner: crate::store::FileStore::open(&p, true, ferry_backend::ImageUse::serve(false).qcow2()).unwrap(),
            fail: std::sync::atomic::AtomicBool::new(false),
        });
        let q = Qcow2::open_store(
            full.clone(),
            "t".into(),
            &crate::Options::default(),
            ferry_backend::ImageUse::serve(false),
            Some(dir.path()),
            0,
        )
        .unwrap();
        // Guest 0's cluster (still holding 0xaa) is freed, then given to guest 5.
        q.trim(0, CS, false).unwrap();
        q.flush().unwrap();
        full.fail.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(q.write(&[0xbb; CS as usize], 5 * CS, false).is_err());
        // And a run that needs new clusters at the end of the file.
        assert!(q.write(&[0xcc; 2 * CS as usize], 8 * CS, false).is_err());
        full.fail.store(false, std::sync::atomic::Ordering::SeqCst);
        let mut b = vec![0u8; 4 * CS as usize];
        q.read(&mut b, 5 * CS).unwrap();
        assert!(b.iter().all(|&x| x == 0), "a failed write's range reads {:#x}", b.iter().find(|&&x| x != 0).unwrap());
        q.read(&mut b, 8 * CS).unwrap();
        assert!(b.iter().all(|&x| x == 0), "a failed write's range reads {:#x}", b.iter().find(|&&x| x != 0).unwrap());
        q.flush().unwrap();
        drop(q);
        drop(full);
        let q = Qcow2::open(&p, false).expect("reopened read-write without --allow-truncated");
        q.read(&mut b, 5 * CS).unwrap();
        assert!(b.iter().all(|&x| x == 0));
    }
}
