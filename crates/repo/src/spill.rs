//! An external sorter of fixed-size records (a blob id first, then a small payload), so
//! that gc's per-blob sets cost a bounded amount of memory however large the repository
//! is: records are held in memory up to a budget, then sorted, deduplicated and written
//! as a run to a file, and the runs are merged (k-way, bounded fan-in) when the records
//! are read back, in order, each distinct record once.
//!
//! The runs are levelled: a run written from memory is of level 0, and [`FAN_IN`] runs of
//! one level are merged into one of the next as soon as there are that many, so that each
//! record is written once per level, and `N` records cost `O(N log N)` bytes of I/O (not
//! `O(N²)`, as merging each new run into one big run would). Before the records are read
//! back, the smallest runs are merged until at most [`FAN_IN`] are left.
//!
//! The files have no name ([`crate::entries::unlinked`]: `O_TMPFILE` where the file
//! system has it, else a name removed at once), so each goes when the sorter is dropped
//! or the process is killed. They are not repository objects; they live in the
//! repository's cache directory (the system's temporary directory where there is none).
use crate::{Error, Result};
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Seek, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Bytes of records a sorter holds in memory before it writes them as a run.
#[cfg(not(test))]
pub(crate) const BUDGET: usize = 16 << 20;
/// A few records in the crate's tests, so that every gc in them spills, many runs.
#[cfg(test)]
pub(crate) const BUDGET: usize = 300;
/// Runs merged at once: [`FAN_IN`] runs of one level make one run of the next.
const FAN_IN: usize = 32;
/// Bytes read ahead from each run while they are merged.
const READ_AHEAD: usize = 64 << 10;

/// One sorted, deduplicated run in an unlinked file.
struct Run {
    file: File,
    records: u64,
    /// 0: written from memory; `k + 1`: merged from runs of level `k`.
    level: u32,
}

/// What a sorter wrote to its files.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Written {
    /// Runs (and tables) written.
    pub(crate) runs: u64,
    /// Bytes written, in all.
    pub(crate) bytes: u64,
}

impl std::ops::AddAssign for Written {
    fn add_assign(&mut self, o: Written) {
        self.runs += o.runs;
        self.bytes += o.bytes;
    }
}

/// Records of `N` bytes, gathered, then read back sorted and deduplicated.
pub(crate) struct Sorter<const N: usize> {
    held: Vec<[u8; N]>,
    /// Records held at most.
    most: usize,
    dir: PathBuf,
    /// Levels never rise from one run to the next.
    runs: Vec<Run>,
    /// What the records are, for errors ("gc's live set").
    what: String,
    /// Whether `dir` is the repository's cache directory (else the system's temporary
    /// directory), for what an error tells to do.
    in_cache: bool,
    written: Written,
    /// Records equal in their first `key` bytes are one: the first (smallest) is kept.
    key: usize,
}

#[cfg(test)]
thread_local! {
    /// This thread's sorters whose `what` contains it fail their spills as a full disk
    /// does (the crate's tests).
    pub(crate) static FAIL_SPILLS_OF: std::cell::RefCell<Option<&'static str>> = const { std::cell::RefCell::new(None) };
}

impl<const N: usize> Sorter<N> {
    /// A sorter that holds up to `budget` bytes of records in memory (at least one), and
    /// writes its runs to unlinked files in `dir`.
    pub(crate) fn new(dir: &Path, budget: usize, what: &str) -> Sorter<N> {
        Sorter {
            held: Vec::new(),
            most: (budget / N).max(1),
            dir: dir.into(),
            runs: Vec::new(),
            what: what.into(),
            in_cache: true,
            written: Written::default(),
            key: N,
        }
    }

    /// This sorter, keeping of the records equal in their first `key` bytes only the
    /// first (the smallest), in memory, in each run and in each merge: its files then hold
    /// one record per distinct key, however often a key is pushed.
    pub(crate) fn once_per_key(mut self, key: usize) -> Sorter<N> {
        self.key = key.clamp(1, N);
        self
    }

    /// Sorts the records held and keeps one per key.
    fn sort_held(&mut self) {
        let key = self.key;
        self.held.sort_unstable();
        // `dedup_by` removes the later of two neighbours: the first of a key is kept.
        self.held.dedup_by(|later, first| later[..key] == first[..key]);
    }

    /// A sorter of [`BUDGET`] in the repository's cache directory, else the system's
    /// temporary directory.
    pub(crate) fn for_repo(repo: &crate::Repository, what: &str) -> Sorter<N> {
        match repo.index_cache() {
            Some(c) => Sorter::new(c.spill_dir(), BUDGET, what),
            None => Sorter { in_cache: false, ..Sorter::new(&std::env::temp_dir(), BUDGET, what) },
        }
    }

    fn fail(&self, e: io::Error) -> Error {
        let room = match self.in_cache {
            true => "free space there, or set FERRY_CACHE_DIR to a directory with room",
            false => "free space there, or set TMPDIR to a directory with room",
        };
        Error::Store {
            what: format!("cannot keep {} in a temporary file in {} ({room})", self.what, self.dir.display()),
            source: e,
        }
    }

    pub(crate) fn push(&mut self, rec: [u8; N]) -> Result<()> {
        if self.held.len() >= self.most {
            self.spill().map_err(|e| self.fail(e))?;
        }
        if self.held.capacity() == 0 {
            // Room for the whole budget at once: pages not written to cost nothing, and no
            // copy is made as the list grows.
            self.held.reserve_exact(self.most);
        }
        self.held.push(rec);
        Ok(())
    }

    /// What this sorter wrote to its files so far.
    #[cfg(test)]
    pub(crate) fn written(&self) -> Written {
        self.written
    }

    /// Writes the records held as a run of level 0; merges the last [`FAN_IN`] runs into
    /// one of the next level while they are of one level.
    fn spill(&mut self) -> io::Result<()> {
        #[cfg(test)]
        if FAIL_SPILLS_OF.with(|f| f.borrow().is_some_and(|w| self.what.contains(w))) {
            return Err(io::Error::from(io::ErrorKind::StorageFull));
        }
        self.sort_held();
        let mut run = write_run(&self.dir, self.held.drain(..).map(Ok), &mut self.written)?;
        run.level = 0;
        self.runs.push(run);
        while self.runs.len() >= FAN_IN {
            let tail = &self.runs[self.runs.len() - FAN_IN..];
            if tail[0].level != tail[FAN_IN - 1].level {
                break;
            }
            let level = tail[0].level + 1;
            self.merge_last(FAN_IN, level)?;
        }
        Ok(())
    }

    /// Merges the last `n` runs into one of `level`.
    fn merge_last(&mut self, n: usize, level: u32) -> io::Result<()> {
        let runs = self.runs.split_off(self.runs.len() - n);
        let mut merged = Merge::<N>::new(runs, Vec::new(), self.key)?;
        let mut run = write_run(&self.dir, std::iter::from_fn(|| merged.next().transpose()), &mut self.written)?;
        run.level = level;
        self.runs.push(run);
        Ok(())
    }

    /// The records, sorted, each distinct one once: the smallest runs (the last) are
    /// merged first until at most [`FAN_IN`] are left (with the records held, read from
    /// memory), so that a bounded number of files is read at once.
    pub(crate) fn finish(mut self) -> Result<Sorted<N>> {
        while self.runs.len() > FAN_IN {
            let n = (self.runs.len() - FAN_IN + 1).min(FAN_IN);
            let level = self.runs[self.runs.len() - n].level;
            self.merge_last(n, level).map_err(|e| self.fail(e))?;
        }
        self.sort_held();
        let held = std::mem::take(&mut self.held);
        let runs = std::mem::take(&mut self.runs);
        let merge = Merge::new(runs, held, self.key).map_err(|e| self.fail(e))?;
        Ok(Sorted { merge, sorter: self })
    }
}

/// The records of a [`Sorter`], in order.
pub(crate) struct Sorted<const N: usize> {
    merge: Merge<N>,
    /// For its errors' words.
    sorter: Sorter<N>,
}

impl<const N: usize> Sorted<N> {
    /// What the sorter wrote to its files.
    pub(crate) fn written(&self) -> Written {
        self.sorter.written
    }

    /// The next record, or `None` at the end.
    pub(crate) fn next(&mut self) -> Result<Option<[u8; N]>> {
        self.merge.next().map_err(|e| self.sorter.fail(e))
    }

    /// The records that `keep` takes, in order, written to a [`Table`].
    pub(crate) fn into_table(mut self, mut keep: impl FnMut(&[u8; N]) -> bool) -> Result<Table<N>> {
        let merge = &mut self.merge;
        let recs = std::iter::from_fn(|| merge.next().transpose()).filter(|r| match r {
            Ok(r) => keep(r),
            Err(_) => true,
        });
        let mut written = self.sorter.written;
        let run = write_run(&self.sorter.dir, recs, &mut written).map_err(|e| self.sorter.fail(e))?;
        self.sorter.written = written;
        let Sorted { sorter, .. } = self;
        Ok(Table { file: run.file, len: run.records, sorter })
    }
}

/// Records in order in an unlinked file, read back by their number.
pub(crate) struct Table<const N: usize> {
    file: File,
    len: u64,
    /// For its errors' words.
    sorter: Sorter<N>,
}

impl<const N: usize> Table<N> {
    /// What the sorter wrote to its files, this table included.
    pub(crate) fn written(&self) -> Written {
        self.sorter.written
    }

    /// Records `first..first + n`.
    pub(crate) fn read(&self, first: u64, n: usize) -> Result<Vec<[u8; N]>> {
        if first.checked_add(n as u64).is_none_or(|end| end > self.len) {
            return Err(Error::Invalid(format!(
                "records {first}..+{n} of {} asked for, of {}",
                self.sorter.what, self.len
            )));
        }
        let mut bytes = vec![0u8; n * N];
        self.file.read_exact_at(&mut bytes, first * N as u64).map_err(|e| self.sorter.fail(e))?;
        Ok(bytes.chunks_exact(N).map(|c| c.try_into().unwrap_or([0; N])).collect())
    }
}

/// Writes `recs` (sorted) to a new run (of level 0), counted in `written`.
fn write_run<const N: usize>(
    dir: &Path,
    recs: impl Iterator<Item = io::Result<[u8; N]>>,
    written: &mut Written,
) -> io::Result<Run> {
    let mut out = BufWriter::with_capacity(READ_AHEAD, crate::entries::unlinked(dir, "spill")?);
    let mut records = 0;
    for r in recs {
        out.write_all(&r?)?;
        records += 1;
    }
    let mut file = out.into_inner().map_err(|e| e.into_error())?;
    file.rewind()?;
    written.runs += 1;
    written.bytes += records * N as u64;
    Ok(Run { file, records, level: 0 })
}

/// A run being read.
struct Reader {
    input: BufReader<File>,
    left: u64,
}

impl Reader {
    fn next<const N: usize>(&mut self) -> io::Result<Option<[u8; N]>> {
        if self.left == 0 {
            return Ok(None);
        }
        let mut rec = [0u8; N];
        self.input.read_exact(&mut rec)?;
        self.left -= 1;
        Ok(Some(rec))
    }
}

/// A k-way merge of runs and the records held in memory (sorted), each distinct record
/// once (of the records equal in their first `key` bytes, the first).
struct Merge<const N: usize> {
    readers: Vec<Reader>,
    held: std::vec::IntoIter<[u8; N]>,
    /// The next record of each source (the readers', then `held`'s at `readers.len()`).
    heap: BinaryHeap<std::cmp::Reverse<([u8; N], usize)>>,
    last: Option<[u8; N]>,
    key: usize,
}

impl<const N: usize> Merge<N> {
    fn new(runs: Vec<Run>, held: Vec<[u8; N]>, key: usize) -> io::Result<Merge<N>> {
        let readers = runs
            .into_iter()
            .map(|r| Reader { input: BufReader::with_capacity(READ_AHEAD, r.file), left: r.records })
            .collect();
        let mut m = Merge { readers, held: held.into_iter(), heap: BinaryHeap::new(), last: None, key };
        for k in 0..=m.readers.len() {
            m.refill(k)?;
        }
        Ok(m)
    }

    fn refill(&mut self, k: usize) -> io::Result<()> {
        let rec = match self.readers.get_mut(k) {
            Some(r) => r.next()?,
            None => self.held.next(),
        };
        if let Some(rec) = rec {
            self.heap.push(std::cmp::Reverse((rec, k)));
        }
        Ok(())
    }

    fn next(&mut self) -> io::Result<Option<[u8; N]>> {
        while let Some(std::cmp::Reverse((rec, k))) = self.heap.pop() {
            self.refill(k)?;
            if self.last.is_none_or(|l| l[..self.key] != rec[..self.key]) {
                self.last = Some(rec);
                return Ok(Some(rec));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain<const N: usize>(s: Sorter<N>) -> Vec<[u8; N]> {
        let mut out = Vec::new();
        let mut sorted = s.finish().unwrap();
        while let Some(r) = sorted.next().unwrap() {
            out.push(r);
        }
        out
    }

    /// Pseudo-random records, with repeats.
    fn records(n: usize) -> Vec<[u8; 9]> {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let mut r = [0u8; 9];
                // Few distinct leading bytes: many records equal in their first bytes.
                r[0] = (x % 7) as u8;
                r[1..].copy_from_slice(&(x % 5000).to_be_bytes());
                r
            })
            .collect()
    }

    fn expected(mut v: Vec<[u8; 9]>) -> Vec<[u8; 9]> {
        v.sort_unstable();
        v.dedup();
        v
    }

    #[test]
    fn in_memory_records_come_back_sorted_and_once_each() {
        let dir = tempfile::tempdir().unwrap();
        let recs = records(3000);
        let mut s = Sorter::<9>::new(dir.path(), 1 << 20, "a test");
        for r in &recs {
            s.push(*r).unwrap();
        }
        assert!(s.runs.is_empty());
        assert_eq!(drain(s), expected(recs));
    }

    #[test]
    fn a_tiny_budget_writes_many_runs_and_merges_them() {
        let dir = tempfile::tempdir().unwrap();
        let recs = records(20_000);
        // 10 records a run: 2000 runs, merged FAN_IN at a time as they are written.
        let mut s = Sorter::<9>::new(dir.path(), 90, "a test");
        let mut most_runs = 0;
        for r in &recs {
            s.push(*r).unwrap();
            most_runs = most_runs.max(s.runs.len());
        }
        // Levelled: fewer than FAN_IN runs of each level (here levels 0, 1 and 2).
        assert!((FAN_IN..3 * FAN_IN).contains(&most_runs), "{most_runs} runs");
        assert!(!s.runs.is_empty());
        let want = expected(recs);
        assert_eq!(drain(s), want);
        // The files have no names.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    /// Distinct records in a pseudo-random order.
    fn distinct(n: u64) -> Vec<[u8; 9]> {
        (0..n)
            .map(|i| {
                let mut r = [0u8; 9];
                r[1..].copy_from_slice(&(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i).to_be_bytes());
                r
            })
            .collect()
    }

    /// The bytes a sorter of 10 records a run writes for `n` records, and what it gives
    /// back, checked.
    fn bytes_written(n: u64) -> u64 {
        let dir = tempfile::tempdir().unwrap();
        let recs = distinct(n);
        let mut s = Sorter::<9>::new(dir.path(), 90, "a test");
        for r in &recs {
            s.push(*r).unwrap();
            // Levels never rise, and fewer than FAN_IN runs of each are open.
            assert!(s.runs.windows(2).all(|w| w[0].level >= w[1].level));
            assert!(s.runs.len() < FAN_IN * 4, "{} runs", s.runs.len());
        }
        let written = s.written();
        let mut sorted = s.finish().unwrap();
        assert!(sorted.merge.readers.len() <= FAN_IN);
        let mut got = Vec::new();
        while let Some(r) = sorted.next().unwrap() {
            got.push(r);
        }
        assert_eq!(got, expected(recs));
        // What finish merged is counted too.
        assert!(sorted.written().bytes >= written.bytes);
        sorted.written().bytes
    }

    /// Levelled runs: each record is written once per level, so the bytes written grow
    /// as N log N (a merge of each new run into one big run grows as N²: 32 times the
    /// records would write about 600 times the bytes, not about 50).
    #[test]
    fn the_bytes_written_grow_as_n_log_n() {
        let per_record = |n: u64| bytes_written(n) as f64 / (n * 9) as f64;
        // 99 runs and 10 records held: written once, and 960 of them once more in three
        // runs of level 1 (1.95 bytes a byte).
        let small = per_record(1000);
        // 3,199 runs (3 * 1,024 + 3 * 32 + 31): levels 0, 1 and 2, and the last 6 of
        // level 0 merged by finish to leave 32 (2.95 bytes a byte).
        let large = per_record(32_000);
        assert!((1.0..=2.5).contains(&small), "{small} bytes written per byte of records");
        assert!((2.0..=3.6).contains(&large), "{large} bytes written per byte of records");
        assert!(large - small <= 1.5, "{small} then {large}: more than one more level");
    }

    /// Records many times over with other payloads: a sorter keyed on the first bytes
    /// gives back the smallest record of each key, and writes one record per key to its
    /// runs however often a key comes again.
    #[test]
    fn once_per_key_keeps_the_first_record_of_each_key_and_writes_each_key_once_a_run() {
        let dir = tempfile::tempdir().unwrap();
        // 50 keys, each pushed 400 times with payloads in a shuffled order.
        let recs: Vec<[u8; 9]> = (0..20_000u64)
            .map(|i| {
                let mut r = [0u8; 9];
                r[..4].copy_from_slice(&((i % 50) as u32).to_be_bytes());
                r[4..8].copy_from_slice(&((i.wrapping_mul(0x9e37_79b9) >> 7) as u32).to_be_bytes());
                r
            })
            .collect();
        let mut want: Vec<[u8; 9]> = expected(recs.clone());
        want.dedup_by(|later, first| later[..4] == first[..4]);
        assert_eq!(want.len(), 50);
        // 500 records held: each run holds at most 50 (one per key).
        let mut s = Sorter::<9>::new(dir.path(), 500 * 9, "a test").once_per_key(4);
        for r in &recs {
            s.push(*r).unwrap();
        }
        let w = s.written();
        assert!(w.runs >= 39, "{w:?}");
        assert!(w.bytes <= 50 * 9 * w.runs, "more than one record per key in a run: {w:?}");
        assert_eq!(drain(s), want);
        // Keyed on the whole record: as before.
        let mut s = Sorter::<9>::new(dir.path(), 500 * 9, "a test");
        for r in &recs {
            s.push(*r).unwrap();
        }
        assert!(s.written().bytes > 50 * 9 * s.written().runs);
    }

    #[test]
    fn a_budget_below_one_record_still_sorts() {
        let dir = tempfile::tempdir().unwrap();
        let recs = records(500);
        let mut s = Sorter::<9>::new(dir.path(), 0, "a test");
        for r in &recs {
            s.push(*r).unwrap();
        }
        assert_eq!(drain(s), expected(recs));
    }

    #[test]
    fn a_table_holds_the_records_kept_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let recs = records(5000);
        let mut s = Sorter::<9>::new(dir.path(), 900, "a test");
        for r in &recs {
            s.push(*r).unwrap();
        }
        let want: Vec<[u8; 9]> = expected(recs).into_iter().filter(|r| r[8] % 3 != 0).collect();
        let t = s.finish().unwrap().into_table(|r| r[8] % 3 != 0).unwrap();
        assert_eq!(t.read(0, want.len()).unwrap(), want);
        assert_eq!(t.read(17, 5).unwrap(), want[17..22]);
        assert!(t.read(want.len() as u64 - 1, 2).is_err());
        assert!(t.read(u64::MAX, 2).is_err());
    }

    #[test]
    fn nothing_pushed_reads_nothing() {
        let dir = tempfile::tempdir().unwrap();
        assert!(drain(Sorter::<32>::new(dir.path(), 64, "a test")).is_empty());
    }

    #[test]
    fn a_directory_that_cannot_hold_files_is_an_error_that_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("gone");
        let mut s = Sorter::<9>::new(&gone, 18, "a test's records");
        let mut err = None;
        for r in records(10) {
            if let Err(e) = s.push(r) {
                err = Some(e);
                break;
            }
        }
        let e = err.expect("a spill to a missing directory fails").to_string();
        assert!(e.contains("a test's records") && e.contains(&gone.display().to_string()), "{e}");
        assert!(e.contains("FERRY_CACHE_DIR"), "{e}");
    }
}
