//! An external sorter of fixed-size records (a blob id first, then a small payload), so
//! that gc's per-blob sets cost a bounded amount of memory however large the repository
//! is: records are held in memory up to a budget, then sorted, deduplicated and written
//! as a run to a file, and the runs are merged (k-way, bounded fan-in) when the records
//! are read back, in order, each distinct record once.
//!
//! The files have no name: each is unlinked as soon as it is made, so it goes when the
//! sorter is dropped or the process is killed, and nothing is left to clean up. They are
//! not repository objects; they live in the repository's cache directory (the system's
//! temporary directory where there is none).
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
/// Runs written (the crate's tests: that a gc spilled).
#[cfg(test)]
pub(crate) static RUNS_WRITTEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Runs merged at once; where more are written, they are merged into one first.
const FAN_IN: usize = 32;
/// Bytes read ahead from each run while they are merged.
const READ_AHEAD: usize = 64 << 10;

/// One sorted, deduplicated run in an unlinked file.
struct Run {
    file: File,
    records: u64,
}

/// Records of `N` bytes, gathered, then read back sorted and deduplicated.
pub(crate) struct Sorter<const N: usize> {
    held: Vec<[u8; N]>,
    /// Records held at most.
    most: usize,
    dir: PathBuf,
    runs: Vec<Run>,
    /// What the records are, for errors ("gc's live set").
    what: String,
}

impl<const N: usize> Sorter<N> {
    /// A sorter that holds up to `budget` bytes of records in memory (at least one), and
    /// writes its runs to unlinked files in `dir`.
    pub(crate) fn new(dir: &Path, budget: usize, what: &str) -> Sorter<N> {
        Sorter { held: Vec::new(), most: (budget / N).max(1), dir: dir.into(), runs: Vec::new(), what: what.into() }
    }

    /// A sorter of [`BUDGET`] in the repository's cache directory, else the system's
    /// temporary directory.
    pub(crate) fn for_repo(repo: &crate::Repository, what: &str) -> Sorter<N> {
        let dir = match repo.index_cache() {
            Some(c) => c.spill_dir().to_path_buf(),
            None => std::env::temp_dir(),
        };
        Sorter::new(&dir, BUDGET, what)
    }

    fn fail(&self, e: io::Error) -> Error {
        Error::Store {
            what: format!(
                "cannot keep {} in a temporary file in {} (free space there, or set FERRY_CACHE_DIR to a directory \
                 with room)",
                self.what,
                self.dir.display()
            ),
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

    /// Writes the records held as a run; merges the runs into one where there are
    /// [`FAN_IN`].
    fn spill(&mut self) -> io::Result<()> {
        self.held.sort_unstable();
        self.held.dedup();
        let run = write_run(&self.dir, self.held.drain(..).map(Ok))?;
        self.runs.push(run);
        if self.runs.len() >= FAN_IN {
            let runs = std::mem::take(&mut self.runs);
            let mut merged = Merge::<N>::new(runs, Vec::new())?;
            let run = write_run(&self.dir, std::iter::from_fn(|| merged.next().transpose()))?;
            self.runs.push(run);
        }
        Ok(())
    }

    /// The records, sorted, each distinct one once.
    pub(crate) fn finish(mut self) -> Result<Sorted<N>> {
        self.held.sort_unstable();
        self.held.dedup();
        let held = std::mem::take(&mut self.held);
        let runs = std::mem::take(&mut self.runs);
        let merge = Merge::new(runs, held).map_err(|e| self.fail(e))?;
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
        let run = write_run(&self.sorter.dir, recs).map_err(|e| self.sorter.fail(e))?;
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

/// Writes `recs` (sorted) to a new run.
fn write_run<const N: usize>(dir: &Path, recs: impl Iterator<Item = io::Result<[u8; N]>>) -> io::Result<Run> {
    let mut out = BufWriter::with_capacity(READ_AHEAD, crate::entries::unlinked(dir, "spill")?);
    let mut records = 0;
    for r in recs {
        out.write_all(&r?)?;
        records += 1;
    }
    let mut file = out.into_inner().map_err(|e| e.into_error())?;
    file.rewind()?;
    #[cfg(test)]
    RUNS_WRITTEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(Run { file, records })
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
/// once.
struct Merge<const N: usize> {
    readers: Vec<Reader>,
    held: std::vec::IntoIter<[u8; N]>,
    /// The next record of each source (the readers', then `held`'s at `readers.len()`).
    heap: BinaryHeap<std::cmp::Reverse<([u8; N], usize)>>,
    last: Option<[u8; N]>,
}

impl<const N: usize> Merge<N> {
    fn new(runs: Vec<Run>, held: Vec<[u8; N]>) -> io::Result<Merge<N>> {
        let readers = runs
            .into_iter()
            .map(|r| Reader { input: BufReader::with_capacity(READ_AHEAD, r.file), left: r.records })
            .collect();
        let mut m = Merge { readers, held: held.into_iter(), heap: BinaryHeap::new(), last: None };
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
            if self.last != Some(rec) {
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
        assert!((FAN_IN - 1..FAN_IN).contains(&most_runs), "{most_runs} runs");
        assert!(!s.runs.is_empty());
        let want = expected(recs);
        assert_eq!(drain(s), want);
        // The files have no names.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
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
