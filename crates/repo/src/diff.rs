//! The chunks that differ between two snapshots of one disk, as an NBD dirty bitmap:
//! `ferry serve` offers it on a snapshot's export when another snapshot of the same disk
//! is served beside it, so any NBD backup tool can copy only what changed between them.
use crate::reader::SnapshotImage;
use ferry_backend::{push_extent, Backend, Extent, MetaContext};

/// `STATE_DIRTY` of NBD's `qemu:dirty-bitmap:` contexts.
const DIRTY: u32 = 1;

/// The metadata context `qemu:dirty-bitmap:NAME` of `snapshot` against `since`: a range
/// is dirty where the two snapshots' chunks differ (their digests; a zero chunk equals
/// only a zero chunk).
pub struct SnapshotDiff {
    name: String,
    /// One bit per chunk of the newer snapshot: differs.
    dirty: Vec<u64>,
    chunk: u64,
    size: u64,
}

impl SnapshotDiff {
    /// The changes in `snapshot` since `since`, as the context `qemu:dirty-bitmap:{name}`.
    /// `None` when they are not snapshots of one disk in one repository of one size.
    pub fn new(snapshot: &SnapshotImage, since: &SnapshotImage, name: &str) -> Option<SnapshotDiff> {
        let (a, b) = (&snapshot.info().manifest, &since.info().manifest);
        if a.name != b.name
            || a.size != b.size
            || a.chunk_size != b.chunk_size
            || repository(snapshot) != repository(since)
        {
            return None;
        }
        let (new, old) = (snapshot.entries(), since.entries());
        let mut dirty = vec![0u64; new.len().div_ceil(64)];
        for (i, (n, o)) in new.iter().zip(old.iter()).enumerate() {
            if n != o {
                dirty[i / 64] |= 1 << (i % 64);
            }
        }
        Some(SnapshotDiff {
            name: format!("{}{name}", "qemu:dirty-bitmap:"),
            dirty,
            chunk: a.chunk_size as u64,
            size: a.size,
        })
    }

    fn is_dirty(&self, ci: u64) -> bool {
        self.dirty.get((ci / 64) as usize).is_some_and(|w| w & (1 << (ci % 64)) != 0)
    }
}

impl MetaContext for SnapshotDiff {
    fn name(&self) -> &str {
        &self.name
    }

    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> ferry_backend::Result<()> {
        let end = offset.saturating_add(length).min(self.size);
        if offset >= end {
            out.push(Extent { length: length.max(1), flags: 0 });
            return Ok(());
        }
        let mut mine: Vec<Extent> = Vec::new();
        let mut pos = offset;
        while pos < end {
            let ci = pos / self.chunk;
            let cend = ((ci + 1) * self.chunk).min(end);
            let flags = if self.is_dirty(ci) { DIRTY } else { 0 };
            if mine.len() >= max.max(1) && mine.last().is_some_and(|l| l.flags != flags) {
                break;
            }
            push_extent(&mut mine, cend - pos, flags);
            pos = cend;
        }
        out.extend(mine);
        Ok(())
    }
}

/// The repository id in a snapshot's identity (`ferry-repo:REPO:SNAPSHOT`).
fn repository(s: &SnapshotImage) -> Option<String> {
    let id = s.identity()?;
    Some(id.rsplit_once(':')?.0.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;
    use crate::{BackupOptions, InitOptions, Repository, SnapshotWriter};
    use std::sync::Arc;

    const CS: usize = 64 << 10;

    fn snapshot(
        repo: &Arc<Repository>,
        name: &str,
        data: &[u8],
        base: Option<crate::SnapshotInfo>,
    ) -> Arc<SnapshotImage> {
        let w =
            SnapshotWriter::start(repo.clone(), BackupOptions { base, ..BackupOptions::new(name, data.len() as u64) })
                .unwrap();
        w.write(data, 0, false).unwrap();
        let snap = w.commit(data.len() as u64).unwrap();
        SnapshotImage::open(repo.clone(), &snap).unwrap()
    }

    #[test]
    fn dirty_where_chunks_differ_and_only_for_one_disk() {
        let repo = Arc::new(Repository::init(Arc::new(MemStore::new()), &InitOptions::default()).unwrap());
        let mut day1 = vec![7u8; 10 * CS];
        day1[3 * CS..4 * CS].fill(0);
        let a = snapshot(&repo, "d", &day1, None);
        let mut day2 = day1.clone();
        day2[CS + 5] = 1; // chunk 1 changed
        day2[3 * CS + 9] = 2; // a zero chunk written
        day2[8 * CS..9 * CS].fill(0); // a chunk zeroed
        let b = snapshot(&repo, "d", &day2, Some(a.info().clone()));
        let diff = SnapshotDiff::new(&b, &a, "since").unwrap();
        assert_eq!(diff.name(), "qemu:dirty-bitmap:since");
        let mut out = Vec::new();
        diff.extents(0, (10 * CS) as u64, 100, &mut out).unwrap();
        let mut want = Vec::new();
        for dirty in [0, 1, 0, 1, 0, 0, 0, 0, 1, 0] {
            push_extent(&mut want, CS as u64, dirty);
        }
        assert_eq!(out, want);
        // Limited to max extents, from any offset.
        out.clear();
        diff.extents(CS as u64 + 100, (9 * CS) as u64 - 100, 2, &mut out).unwrap();
        assert_eq!(out, vec![Extent { length: CS as u64 - 100, flags: DIRTY }, Extent { length: CS as u64, flags: 0 }]);
        // Another disk, or a disk of another size, gives no context.
        let other = snapshot(&repo, "e", &day2, None);
        assert!(SnapshotDiff::new(&other, &a, "x").is_none());
        let short = snapshot(&repo, "d", &day2[..9 * CS], None);
        assert!(SnapshotDiff::new(&short, &a, "x").is_none());
    }
}
