//! Writing: WRITE, WRITE_ZEROES, TRIM and FLUSH.
//!
//! A write to a cluster this image owns (COPIED) goes straight to its host offset. Any
//! other cluster gets a new one at the end of the file; a partial write fills the rest
//! of the new cluster from the old contents (backing file, zeroes, compressed or shared
//! data), under the metadata lock so two partial writes cannot allocate the same cluster
//! twice. Whole clusters are only mapped under the lock and written after it is released.
//!
//! FLUSH: sync the data, write the refcount increments, sync, write the L2 tables, sync,
//! write the L1 entries, sync, and only then apply and write the frees, sync. A crash at
//! any point leaves clusters counted but unused (leaks), never used but uncounted.

use crate::header::Header;
use crate::map::{L2Table, Mapping, OFFSET_MASK, OFLAG_COMPRESSED, OFLAG_COPIED, OFLAG_ZERO};
use crate::overlap::Metadata;
use crate::{io_err, Qcow2, Qcow2Error, State};

/// Refuses (before anything is written) images this layer cannot write safely.
pub fn check_writable(h: &Header) -> Result<(), Qcow2Error> {
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
        let refs = st.refs.as_mut().ok_or_else(not_writable)?;
        let off = refs.alloc(&*self.store, 1)?;
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

    /// What an L2 entry allocates in the file, to free when it is replaced.
    fn release(&self, st: &mut State, entry: u64) {
        let Some(refs) = st.refs.as_mut() else { return };
        if entry & OFLAG_COMPRESSED != 0 {
            if let Ok((Mapping::Compressed { host, len, .. }, _)) = self.geo.decode(entry, 0, 0) {
                refs.free(host, len);
            }
        } else if entry & OFFSET_MASK != 0 {
            refs.free(entry & OFFSET_MASK, self.geo.cluster_size);
        }
    }

    pub(crate) fn write_impl(&self, buf: &[u8], offset: u64, fua: bool) -> Result<(), Qcow2Error> {
        if !self.writable {
            return Err(not_writable());
        }
        self.safety.refuse_if_corrupt()?;
        let cs = self.geo.cluster_size;
        let end = offset + buf.len() as u64;
        // (host offset, range of buf) written after the lock is released.
        let mut direct: Vec<(u64, usize, usize)> = Vec::new();
        {
            let mut st = self.lock();
            let mut pos = offset;
            while pos < end {
                let l2_off = self.l2_for_write(&mut st, pos)?;
                let span_end = end.min((pos / self.geo.l2_span() + 1) * self.geo.l2_span());
                // Classify the clusters of this L2 table's part of the range.
                let first = pos;
                let mut need: Vec<(u64, u64)> = Vec::new(); // (guest cluster start, old entry)
                let mut c = pos & !(cs - 1);
                while c < span_end {
                    let idx = self.entry_index(c);
                    let e = self.l2_table(&mut st, l2_off)?.raw[idx];
                    let owned =
                        e & OFLAG_COPIED != 0 && e & (OFLAG_COMPRESSED | OFLAG_ZERO) == 0 && e & OFFSET_MASK != 0;
                    if owned {
                        let s = c.max(first);
                        let t = (c + cs).min(span_end);
                        push_direct(
                            &mut direct,
                            (e & OFFSET_MASK) + (s - c),
                            (s - offset) as usize,
                            (t - offset) as usize,
                        );
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
                    let refs = st.refs.as_mut().ok_or_else(not_writable)?;
                    let host = refs.alloc(&*self.store, (j - i) as u64)?;
                    for (k, &(gc, old)) in need[i..j].iter().enumerate() {
                        let h = host + k as u64 * cs;
                        let s = gc.max(offset);
                        let t = (gc + cs).min(end);
                        if t - s < cs {
                            // Partial: old contents + new bytes, written now, under the lock.
                            let mut cl = vec![0u8; cs as usize];
                            self.old_cluster(old, gc, &mut cl)?;
                            cl[(s - gc) as usize..(t - gc) as usize]
                                .copy_from_slice(&buf[(s - offset) as usize..(t - offset) as usize]);
                            self.data.write_at(&cl, h).map_err(io_err(format!("cannot write data at {h:#x}")))?;
                        } else {
                            push_direct(&mut direct, h, (s - offset) as usize, (t - offset) as usize);
                        }
                        let idx = self.entry_index(gc);
                        let t = self.l2_table(&mut st, l2_off)?;
                        t.raw[idx] = h | OFLAG_COPIED;
                        t.dirty = true;
                        self.release(&mut st, old);
                    }
                    i = j;
                }
                pos = span_end;
            }
        }
        for (host, a, b) in direct {
            self.data.write_at(&buf[a..b], host).map_err(io_err(format!("cannot write data at {host:#x}")))?;
        }
        if fua {
            self.flush_impl()?;
        }
        Ok(())
    }

    /// WRITE_ZEROES (`zero`) or TRIM: whole clusters become zero clusters (or, without a
    /// backing file, unallocated ones) and their storage is freed; the partial clusters
    /// at the ends are written with zeroes (WRITE_ZEROES) or left alone (TRIM).
    pub(crate) fn discard_impl(&self, offset: u64, length: u64, zero: bool, fua: bool) -> Result<(), Qcow2Error> {
        if !self.writable {
            return Err(not_writable());
        }
        self.safety.refuse_if_corrupt()?;
        let cs = self.geo.cluster_size;
        let end = offset + length;
        let first_full = offset.next_multiple_of(cs);
        // The last cluster may be partial in the virtual size: it still counts as whole.
        let last_full = if end == self.geo.size { end.next_multiple_of(cs) } else { end & !(cs - 1) };
        let new_entry = if self.backing.is_some() { OFLAG_ZERO } else { 0 };
        if first_full < last_full {
            let mut st = self.lock();
            let span = self.geo.l2_span();
            let mut c = first_full;
            while c < last_full {
                let l1e = st.l1.get((c / span) as usize).copied().unwrap_or(0) & OFFSET_MASK;
                let span_end = last_full.min((c / span + 1) * span);
                if l1e == 0 && new_entry == 0 {
                    c = span_end;
                    continue;
                }
                let l2_off = self.l2_for_write(&mut st, c)?;
                while c < span_end {
                    let idx = self.entry_index(c);
                    let t = self.l2_table(&mut st, l2_off)?;
                    let old = t.raw[idx];
                    if old != new_entry {
                        t.raw[idx] = new_entry;
                        t.dirty = true;
                        self.release(&mut st, old);
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
        let mut st = self.lock();
        let st = &mut *st;
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
            refs.apply_frees(store)?;
            refs.write(store, &sync)?;
            sync("refcounts")?;
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
