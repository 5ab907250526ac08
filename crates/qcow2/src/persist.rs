//! Writing persistent bitmaps back, and managing them (`ferry bitmap`).
//!
//! A clean close (or [`Qcow2::close`]) writes every bitmap whose bits changed to new
//! clusters: each table entry's data cluster, or 0 / 1 for a cluster of all clear / all
//! set bits; then the table, then a new directory (flags as they should be: `in_use`
//! cleared on the bitmaps ferry kept), all counted in the refcounts and synced; then
//! the header's bitmaps extension is switched to the new directory (added when the
//! image had none, dropped when no bitmap is left) and synced; only then are the old
//! directory, tables and data clusters freed. A crash before the switch leaves the old
//! directory, whose enabled bitmaps are `in_use` (the first-write hook set it), so qemu
//! treats them as inconsistent, and at most leaked clusters.

use crate::bitmaps::{
    self, BitmapInfo, Bits, Extension, Loaded, ENTRY_FIXED, FLAG_AUTO, FLAG_EXTRA_DATA_COMPATIBLE, FLAG_IN_USE,
    MAX_BITMAPS, MAX_DIRECTORY_BYTES, MAX_GRANULARITY_BITS, MAX_NAME, MIN_GRANULARITY_BITS, TYPE_DIRTY_TRACKING,
};
use crate::header::{be32, be64, AUTOCLEAR_AT, AUTOCLEAR_BITMAPS};
use crate::overlap::Metadata;
use crate::{io_err, Qcow2, Qcow2Error, State};
use std::sync::atomic::Ordering;
use std::sync::Arc;

const EXT_BITMAPS: u32 = 0x2385_2875;

fn invalid(m: String) -> Qcow2Error {
    Qcow2Error::Bitmap(m)
}

impl Qcow2 {
    /// The image's persistent bitmaps, in directory order.
    pub fn bitmaps(&self) -> Vec<BitmapInfo> {
        let set = self.bitmap_set();
        set.list
            .iter()
            .map(|l| BitmapInfo {
                name: l.entry.name.clone(),
                granularity: 1 << l.entry.granularity_bits,
                auto: l.entry.flags & FLAG_AUTO != 0,
                in_use: l.bits.is_none() || (self.writable && l.enabled() && self.safety.bitmaps_marked()),
                dirty_bytes: l.bits.as_ref().map_or(0, |b| b.count_dirty() << l.entry.granularity_bits),
            })
            .collect()
    }

    /// The bits of the consistent bitmap `name` (for merging into another image's).
    pub fn bitmap_bits(&self, name: &str) -> Result<Arc<Bits>, Qcow2Error> {
        let set = self.bitmap_set();
        let l = find(&set.list, name)?;
        l.bits.clone().ok_or_else(|| inconsistent(name))
    }

    fn bitmap_set(&self) -> std::sync::MutexGuard<'_, bitmaps::Set> {
        self.bitmaps.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn manage(&self, f: impl FnOnce(&mut bitmaps::Set) -> Result<(), Qcow2Error>) -> Result<(), Qcow2Error> {
        if !self.writable {
            return Err(invalid("the image is open read-only: its bitmaps cannot be changed".into()));
        }
        let mut set = self.bitmap_set();
        f(&mut set)?;
        self.bitmaps_changed.store(true, Ordering::Release);
        let mut rec = self.recording.write().unwrap_or_else(|e| e.into_inner());
        *rec = set.recording();
        self.recording_any.store(!rec.is_empty(), Ordering::Release);
        Ok(())
    }

    /// Adds an empty bitmap (`qemu-img bitmap --add`): `granularity` a power of two from
    /// 512 B to 2 GiB (default: the cluster size, at least 4 KiB), enabled unless
    /// `disabled`. Written at close.
    pub fn bitmap_add(&self, name: &str, granularity: Option<u64>, disabled: bool) -> Result<(), Qcow2Error> {
        let g = granularity.unwrap_or(self.geo.cluster_size.max(4096));
        if !g.is_power_of_two() || !(MIN_GRANULARITY_BITS..=MAX_GRANULARITY_BITS).contains(&g.trailing_zeros()) {
            return Err(invalid(format!("bitmap {name:?}: granularity {g} is not a power of two from 512 to 2G")));
        }
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(invalid(format!("a bitmap name must have 1 to {MAX_NAME} bytes, not {}", name.len())));
        }
        let size = self.geo.size;
        self.manage(|set| {
            if set.list.iter().any(|l| l.entry.name == name) {
                return Err(invalid(format!("the image already has a bitmap named {name:?}")));
            }
            if set.list.len() >= MAX_BITMAPS as usize {
                return Err(invalid(format!("the image has {MAX_BITMAPS} bitmaps, the most qcow2 can hold")));
            }
            let bits = g.trailing_zeros();
            let memory: u64 = set
                .list
                .iter()
                .filter(|l| l.bits.is_some())
                .map(|l| Bits::data_bytes(size, l.entry.granularity_bits))
                .sum::<u64>()
                + Bits::data_bytes(size, bits);
            if memory > bitmaps::MAX_BITS_BYTES {
                return Err(invalid(format!(
                    "bitmap {name:?}: the bitmaps would need {memory} bytes of memory (ferry holds up to {})",
                    bitmaps::MAX_BITS_BYTES
                )));
            }
            let b = Bits::new(size, bits);
            b.set_changed(true);
            set.list.push(Loaded {
                entry: bitmaps::Bitmap {
                    name: name.to_string(),
                    flags: if disabled { 0 } else { FLAG_AUTO },
                    table_offset: 0,
                    table_size: 0,
                    flags_at: 0,
                    granularity_bits: bits,
                    extra: Vec::new(),
                },
                table: Vec::new(),
                bits: Some(Arc::new(b)),
            });
            Ok(())
        })
    }

    /// Removes a bitmap (consistent or not).
    pub fn bitmap_remove(&self, name: &str) -> Result<(), Qcow2Error> {
        self.manage(|set| {
            let i = set.list.iter().position(|l| l.entry.name == name).ok_or_else(|| no_such(name))?;
            let l = set.list.remove(i);
            set.removed.push(l);
            Ok(())
        })
    }

    /// Clears every bit of a consistent bitmap.
    pub fn bitmap_clear(&self, name: &str) -> Result<(), Qcow2Error> {
        self.manage(|set| {
            find(&set.list, name)?.bits.as_ref().ok_or_else(|| inconsistent(name))?.clear();
            Ok(())
        })
    }

    /// Enables (writes are recorded: `auto`) or disables a consistent bitmap.
    pub fn bitmap_enable(&self, name: &str, enable: bool) -> Result<(), Qcow2Error> {
        self.manage(|set| {
            let l = set.list.iter_mut().find(|l| l.entry.name == name).ok_or_else(|| no_such(name))?;
            let Some(b) = &l.bits else { return Err(inconsistent(name)) };
            b.set_changed(true);
            l.entry.flags = if enable { l.entry.flags | FLAG_AUTO } else { l.entry.flags & !FLAG_AUTO };
            Ok(())
        })
    }

    /// ORs `source` (a bitmap of this image or another, any granularity) into the
    /// consistent bitmap `name`.
    pub fn bitmap_merge(&self, name: &str, source: &Bits) -> Result<(), Qcow2Error> {
        self.manage(|set| {
            find(&set.list, name)?.bits.as_ref().ok_or_else(|| inconsistent(name))?.merge(source);
            Ok(())
        })
    }

    /// Closes the image: writes the metadata and the bitmaps back, and reports a failure
    /// (dropping does the same, logging one).
    pub fn close(self) -> Result<(), Qcow2Error> {
        self.close_inner()
    }

    /// Writes the metadata, then the bitmaps when they changed (clearing `in_use`; the
    /// next write marks it again).
    pub(crate) fn close_inner(&self) -> Result<(), Qcow2Error> {
        if !self.writable || self.safety.is_corrupt() {
            return Ok(());
        }
        self.write_metadata(self.sync_on_close)?;
        self.store_bitmaps()
    }

    /// Writes the bitmaps back when anything about them changed (see the module's
    /// comment).
    fn store_bitmaps(&self) -> Result<(), Qcow2Error> {
        let mut set = self.bitmap_set();
        let changed = self.bitmaps_changed.load(Ordering::Acquire)
            || set.list.iter().any(|l| l.bits.as_ref().is_some_and(|b| b.changed()));
        if !changed && !self.safety.bitmaps_marked() {
            return Ok(());
        }
        let sync = self.sync_on_close;
        let cs = self.geo.cluster_size;
        let store = self.store.clone();
        let mut st = self.lock();
        let mut to_free: Vec<(u64, u64)> = Vec::new();
        let mut chunk = vec![0u8; cs as usize];
        let mut new_tables: Vec<Option<(u64, Vec<u64>)>> = Vec::with_capacity(set.list.len());
        for (i, l) in set.list.iter().enumerate() {
            let Some(b) = l.bits.as_ref().filter(|b| b.changed() || l.entry.table_offset == 0) else {
                new_tables.push(None);
                continue;
            };
            let bytes = Bits::data_bytes(self.geo.size, l.entry.granularity_bits);
            let n = bytes.div_ceil(cs);
            let mut table = Vec::with_capacity(n as usize);
            for k in 0..n {
                let at = k * cs;
                let len = (bytes - at).min(cs);
                if b.all(at, len, false) {
                    table.push(0);
                } else if b.all(at, len, true) {
                    table.push(1);
                } else {
                    let (h, _) = self.alloc_run(&mut st, 1)?;
                    store.metadata_allocated(Metadata::BitmapData(i as u32), h, cs);
                    chunk.fill(0);
                    b.read_data(at, &mut chunk[..len as usize]);
                    store.write_at(&chunk, h).map_err(io_err(format!("cannot write bitmap {:?}", l.entry.name)))?;
                    table.push(h);
                }
            }
            let tbytes: Vec<u8> = table.iter().flat_map(|e| e.to_be_bytes()).collect();
            let toff = if tbytes.is_empty() {
                0
            } else {
                let (t, _) = self.alloc_run(&mut st, (tbytes.len() as u64).div_ceil(cs))?;
                store.metadata_allocated(Metadata::BitmapTable(i as u32), t, tbytes.len() as u64);
                store
                    .write_at(&tbytes, t)
                    .map_err(io_err(format!("cannot write the table of bitmap {:?}", l.entry.name)))?;
                t
            };
            old_clusters(l, cs, &mut to_free);
            new_tables.push(Some((toff, table)));
        }
        for l in &set.removed {
            old_clusters(l, cs, &mut to_free);
        }
        // The directory: every entry with its (new) table and the flags it should have.
        let mut dir: Vec<u8> = Vec::new();
        let mut flags_at = Vec::with_capacity(set.list.len());
        for (l, t) in set.list.iter().zip(&new_tables) {
            let (toff, tsize) = match t {
                Some((o, t)) => (*o, t.len() as u32),
                None => (l.entry.table_offset, l.entry.table_size),
            };
            let flags = if l.bits.is_some() { l.entry.flags & !FLAG_IN_USE } else { l.entry.flags };
            let flags = if l.entry.extra.is_empty() { flags } else { flags | FLAG_EXTRA_DATA_COMPATIBLE };
            flags_at.push(dir.len() as u64 + 12);
            dir.extend_from_slice(&toff.to_be_bytes());
            dir.extend_from_slice(&tsize.to_be_bytes());
            dir.extend_from_slice(&flags.to_be_bytes());
            dir.push(TYPE_DIRTY_TRACKING);
            dir.push(l.entry.granularity_bits as u8);
            dir.extend_from_slice(&(l.entry.name.len() as u16).to_be_bytes());
            dir.extend_from_slice(&(l.entry.extra.len() as u32).to_be_bytes());
            dir.extend_from_slice(&l.entry.extra);
            dir.extend_from_slice(l.entry.name.as_bytes());
            dir.resize(dir.len().next_multiple_of(8), 0);
        }
        debug_assert!(dir.len() >= ENTRY_FIXED * set.list.len());
        if dir.len() as u64 > MAX_DIRECTORY_BYTES {
            return Err(invalid(format!("a bitmap directory of {} bytes is too large", dir.len())));
        }
        let new_ext = if set.list.is_empty() {
            None
        } else {
            let (d, _) = self.alloc_run(&mut st, (dir.len() as u64).div_ceil(cs))?;
            store.metadata_allocated(Metadata::BitmapDirectory, d, dir.len() as u64);
            store.write_at(&dir, d).map_err(io_err("cannot write the bitmap directory"))?;
            Some(Extension { nb_bitmaps: set.list.len() as u32, directory_size: dir.len() as u64, directory_offset: d })
        };
        // The new clusters are counted and on disk before the header points at them.
        self.write_metadata_locked(&mut st, sync)?;
        if sync {
            store.sync().map_err(io_err("cannot sync the bitmaps"))?;
        }
        self.write_bitmaps_extension(new_ext)?;
        if let Some(x) = set.ext {
            to_free.push((x.directory_offset, x.directory_size));
        }
        if let Some(refs) = st.refs.as_mut() {
            for (off, len) in to_free {
                refs.free(off, len, false);
            }
        }
        self.write_metadata_locked(&mut st, sync)?;
        // What is on disk now.
        set.ext = new_ext;
        set.removed.clear();
        for ((l, t), at) in set.list.iter_mut().zip(new_tables).zip(flags_at) {
            if let Some((o, t)) = t {
                l.entry.table_offset = o;
                l.entry.table_size = t.len() as u32;
                l.table = t;
            }
            if let Some(x) = new_ext {
                l.entry.flags_at = x.directory_offset + at;
            }
            if let Some(b) = &l.bits {
                b.set_changed(false);
            }
        }
        self.bitmaps_changed.store(false, Ordering::Release);
        let rearm = set
            .list
            .iter()
            .filter(|l| l.enabled() && new_ext.is_some())
            .map(|l| (l.entry.flags_at, l.entry.flags | FLAG_IN_USE, l.entry.name.clone()))
            .collect();
        self.safety.rearm_in_use(rearm);
        Ok(())
    }

    /// `n` contiguous new clusters (freed runs too short are given back).
    fn alloc_run(&self, st: &mut State, n: u64) -> Result<(u64, u64), Qcow2Error> {
        let cs = self.geo.cluster_size;
        let refs = st.refs.as_mut().ok_or_else(|| invalid("the image is read-only".into()))?;
        let mut short = Vec::new();
        let r = loop {
            let (off, got) = refs.alloc(&*self.store, n)?;
            if got >= n {
                break (off, got);
            }
            short.push((off, got));
        };
        for (off, got) in short {
            refs.free(off, got * cs, false);
        }
        Ok(r)
    }

    /// Points the header's bitmaps extension at `ext` (adding or dropping the extension
    /// as needed) and sets the autoclear bit that says the bitmaps are consistent: the
    /// header cluster is rebuilt (fixed header, extensions, backing file name), then
    /// synced.
    fn write_bitmaps_extension(&self, ext: Option<Extension>) -> Result<(), Qcow2Error> {
        let cs = self.geo.cluster_size as usize;
        let mut buf = vec![0u8; cs];
        self.store.read_at(&mut buf, 0).map_err(io_err("cannot read the header"))?;
        let hl = be32(&buf, 100) as usize;
        if !(104..=cs).contains(&hl) {
            return Err(invalid(format!("header_length {hl}")));
        }
        let mut exts: Vec<(u32, Vec<u8>)> = Vec::new();
        let mut at = hl;
        while at + 8 <= cs {
            let (typ, len) = (be32(&buf, at), be32(&buf, at + 4) as usize);
            at += 8;
            if typ == 0 || len > cs - at {
                break;
            }
            if typ != EXT_BITMAPS {
                exts.push((typ, buf[at..at + len].to_vec()));
            }
            at += len.div_ceil(8) * 8;
        }
        if let Some(x) = ext {
            let mut d = x.nb_bitmaps.to_be_bytes().to_vec();
            d.extend_from_slice(&[0; 4]);
            d.extend_from_slice(&x.directory_size.to_be_bytes());
            d.extend_from_slice(&x.directory_offset.to_be_bytes());
            exts.push((EXT_BITMAPS, d));
        }
        let backing = match (be64(&buf, 8), be32(&buf, 16) as usize) {
            (0, _) | (_, 0) => None,
            (o, n) => buf.get(o as usize..o as usize + n).map(<[u8]>::to_vec),
        };
        let mut area = Vec::new();
        for (typ, d) in &exts {
            area.extend_from_slice(&typ.to_be_bytes());
            area.extend_from_slice(&(d.len() as u32).to_be_bytes());
            area.extend_from_slice(d);
            area.resize(area.len().next_multiple_of(8), 0);
        }
        area.extend_from_slice(&[0; 8]);
        let name_at = hl + area.len();
        if let Some(n) = &backing {
            area.extend_from_slice(n);
        }
        if hl + area.len() > cs {
            return Err(invalid("the header extensions do not fit in the first cluster".into()));
        }
        let mut out = buf[..hl].to_vec();
        out.extend_from_slice(&area);
        out.resize(cs, 0);
        if backing.is_some() {
            out[8..16].copy_from_slice(&(name_at as u64).to_be_bytes());
        }
        let autoclear = if ext.is_some() { AUTOCLEAR_BITMAPS } else { 0 };
        out[AUTOCLEAR_AT as usize..AUTOCLEAR_AT as usize + 8].copy_from_slice(&autoclear.to_be_bytes());
        self.store.write_at(&out, 0).map_err(io_err("cannot write the header"))?;
        self.store.sync().map_err(io_err("cannot sync the header"))
    }
}

/// The table and data clusters a bitmap held on disk.
fn old_clusters(l: &Loaded, cs: u64, out: &mut Vec<(u64, u64)>) {
    if l.entry.table_offset != 0 && l.entry.table_size > 0 {
        out.push((l.entry.table_offset, u64::from(l.entry.table_size) * 8));
    }
    for &e in &l.table {
        let off = e & bitmaps::TABLE_OFFSET_MASK;
        if off != 0 {
            out.push((off, cs));
        }
    }
}

fn find<'a>(list: &'a [Loaded], name: &str) -> Result<&'a Loaded, Qcow2Error> {
    list.iter().find(|l| l.entry.name == name).ok_or_else(|| no_such(name))
}

fn no_such(name: &str) -> Qcow2Error {
    invalid(format!("the image has no bitmap named {name:?}"))
}

fn inconsistent(name: &str) -> Qcow2Error {
    invalid(format!(
        "bitmap {name:?} is inconsistent (in use: the program that wrote it did not close the image cleanly); \
         remove it with ferry bitmap --remove and start a new full backup"
    ))
}

#[cfg(test)]
mod tests {
    use crate::Qcow2;
    use ferry_backend::{Backend, ZeroMode};
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// Runs a command, spawned while no other test thread is between fork and exec (a
    /// child shares every descriptor until it execs, so an image another test just
    /// closed would briefly still hold its locks against qemu-img).
    fn run(args: &[&str]) -> String {
        static SPAWN: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let child = {
            let _one = SPAWN.lock().unwrap_or_else(|e| e.into_inner());
            Command::new(args[0])
                .args(&args[1..])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
        };
        let o = child.and_then(|c| c.wait_with_output()).unwrap_or_else(|e| panic!("{}: {e}", args[0]));
        assert!(
            o.status.success(),
            "{args:?}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn s(p: &Path) -> &str {
        p.to_str().unwrap()
    }

    /// What qemu reads of bitmap `b` (qemu-nbd -B, nbdinfo --map).
    fn qemu_map(img: &Path, b: &str) -> String {
        let map = format!("--map=qemu:dirty-bitmap:{b}");
        run(&["nbdinfo", &map, "--json", "--", "[", "qemu-nbd", "-r", "-B", b, "-f", "qcow2", s(img), "]"])
    }

    fn check(img: &Path) {
        run(&["qemu-img", "check", s(img)]);
    }

    fn info(img: &Path) -> String {
        run(&["qemu-img", "info", "--output=json", s(img)])
    }

    fn twins(dir: &Path, size: &str, cluster: &str) -> (PathBuf, PathBuf) {
        let a = dir.join("ferry.qcow2");
        let b = dir.join("qemu.qcow2");
        run(&["qemu-img", "create", "-q", "-f", "qcow2", "-o", &format!("cluster_size={cluster}"), s(&a), size]);
        run(&["qemu-img", "bitmap", "--add", s(&a), "b0"]);
        run(&["qemu-img", "bitmap", "--add", "-g", "512", s(&a), "fine"]);
        run(&["qemu-img", "bitmap", "--add", "-g", "4M", s(&a), "coarse"]);
        run(&["qemu-img", "bitmap", "--add", "--disable", s(&a), "frozen"]);
        std::fs::copy(&a, &b).unwrap();
        (a, b)
    }

    /// ferry's writes, zeroes and trims are recorded as qemu records the same operations
    /// on a twin image; the image checks clean and qemu reads the bitmaps.
    #[test]
    fn records_what_qemu_records() {
        for cluster in ["65536", "512"] {
            let dir = tempfile::tempdir().unwrap();
            let (a, b) = twins(dir.path(), "64M", cluster);
            {
                let q = Qcow2::open(&a, false).unwrap();
                assert!(q.bitmaps().iter().all(|i| !i.in_use));
                q.write(&[1u8; 70_000], 1 << 20, false).unwrap();
                q.write(&[2u8; 1], 33_333_333, false).unwrap();
                q.zero(5 << 20, 1 << 20, ZeroMode { may_trim: true, fast: false }, false).unwrap();
                q.zero(7 << 20, 3000, ZeroMode::default(), false).unwrap();
                q.trim(10 << 20, 131_072, false).unwrap();
                q.write(&[3u8; 4096], (64 << 20) - 4096, false).unwrap();
                let infos = q.bitmaps();
                assert!(infos.iter().find(|i| i.name == "b0").unwrap().in_use);
            }
            run(&[
                "qemu-io",
                "-c",
                "write 1M 70000",
                "-c",
                "write 33333333 1",
                "-c",
                "write -z -u 5M 1M",
                "-c",
                "write -z 7M 3000",
                "-c",
                "discard 10M 128k",
                "-c",
                "write 67104768 4096",
                s(&b),
            ]);
            check(&a);
            let i = info(&a);
            assert!(!i.contains("in-use"), "{i}");
            for bm in ["b0", "fine", "coarse", "frozen"] {
                assert_eq!(qemu_map(&a, bm), qemu_map(&b, bm), "bitmap {bm}, {cluster}-byte clusters");
            }
            assert!(qemu_map(&a, "frozen").contains("\"length\": 67108864, \"type\": 0"));
        }
    }

    /// A bitmap being recorded in stays in use when ferry is killed; a clean reopen
    /// keeps it inconsistent and does not offer it.
    #[test]
    fn a_crash_leaves_the_bitmap_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _) = twins(dir.path(), "16M", "65536");
        let q = Qcow2::open(&a, false).unwrap();
        q.write(&[1u8; 512], 0, true).unwrap();
        // What a kill -9 leaves: the file as it is before the close.
        let crashed = dir.path().join("crashed.qcow2");
        std::fs::copy(&a, &crashed).unwrap();
        drop(q);
        assert!(!info(&a).contains("in-use"));
        let a = crashed;
        let i = info(&a);
        assert!(i.contains("in-use"), "{i}");
        let q = Qcow2::open(&a, false).unwrap();
        let names: Vec<String> = std::sync::Arc::new(q).meta_contexts().iter().map(|c| c.name().to_string()).collect();
        assert!(!names.contains(&"qemu:dirty-bitmap:b0".to_string()), "{names:?}");
        assert!(names.contains(&"qemu:dirty-bitmap:frozen".to_string()), "{names:?}");
        let i = info(&a);
        assert!(i.contains("in-use"), "{i}");
        check(&a);
    }

    /// Management: add, merge, clear, disable, remove; every step checks clean.
    #[test]
    fn manages_bitmaps_as_qemu_img_does() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("m.qcow2");
        run(&["qemu-img", "create", "-q", "-f", "qcow2", s(&a), "32M"]);
        {
            let q = Qcow2::open(&a, false).unwrap();
            q.bitmap_add("one", None, false).unwrap();
            q.bitmap_add("two", Some(1 << 21), true).unwrap();
            assert!(q.bitmap_add("one", None, false).is_err());
            q.close().unwrap();
        }
        check(&a);
        let i = info(&a);
        assert!(i.contains("\"one\"") && i.contains("2097152"), "{i}");
        {
            let q = Qcow2::open(&a, false).unwrap();
            q.write(&[9u8; 100], 3 << 20, false).unwrap();
            let src = q.bitmap_bits("one").unwrap();
            q.bitmap_merge("two", &src).unwrap();
            q.bitmap_enable("one", false).unwrap();
        }
        check(&a);
        assert!(qemu_map(&a, "two").contains("\"offset\": 2097152, \"length\": 2097152, \"type\": 1"));
        assert!(qemu_map(&a, "one").contains("\"offset\": 3145728, \"length\": 65536, \"type\": 1"));
        {
            let q = Qcow2::open(&a, false).unwrap();
            q.write(&[9u8; 100], 9 << 20, false).unwrap();
            q.bitmap_clear("two").unwrap();
            q.bitmap_remove("one").unwrap();
        }
        check(&a);
        let i = info(&a);
        assert!(!i.contains("\"one\"") && i.contains("\"two\""), "{i}");
        assert!(qemu_map(&a, "two").contains("\"length\": 33554432, \"type\": 0"));
        {
            let q = Qcow2::open(&a, false).unwrap();
            q.bitmap_remove("two").unwrap();
        }
        check(&a);
        assert!(!info(&a).contains("bitmaps"));
    }
}
