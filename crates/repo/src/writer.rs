//! A backup in progress: a write-only image that the copy engine writes into, on top of
//! the disk's previous snapshot (or of zeroes), committed as a new snapshot.
use crate::format::Changes;
use crate::repo::{Repository, SnapshotInfo};
use crate::Result;
use ferry_backend::{Backend, Capabilities};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct BackupOptions {
    /// The disk's name.
    pub name: String,
    /// The disk's size (the source's).
    pub size: u64,
    /// What the new snapshot starts from: unwritten ranges keep this snapshot's content
    /// (incremental backups), or read as zeroes when `None`.
    pub base: Option<SnapshotInfo>,
    /// The source, as shown (credentials removed).
    pub source: String,
    pub changes: Changes,
    /// Close packs at this size.
    pub pack_size: usize,
    /// zstd level.
    pub level: i32,
    /// Wait this long for a backup of the same disk (or a gc) to end, instead of failing.
    pub wait_lock: Option<Duration>,
}

#[derive(Debug, Clone, Default)]
pub struct WriterStats {
    pub written_chunks: u64,
    pub zero_chunks: u64,
    pub new_chunks: u64,
    pub new_plain: u64,
    pub new_stored: u64,
}

pub struct SnapshotWriter {
    _repo: Arc<Repository>,
}

impl SnapshotWriter {
    /// Takes the disk's backup lock and loads the index and the base's pages.
    pub fn start(repo: Arc<Repository>, opts: BackupOptions) -> Result<Arc<SnapshotWriter>> {
        let _ = (repo, opts);
        todo!()
    }

    /// Stores what is pending (partial chunks are completed from the base), the index
    /// object and the manifest, then releases the lock. `read` is the bytes read from the
    /// source, for the manifest's stats.
    pub fn commit(&self, read: u64) -> Result<SnapshotInfo> {
        let _ = read;
        todo!()
    }

    pub fn stats(&self) -> WriterStats {
        todo!()
    }
}

impl Backend for SnapshotWriter {
    fn describe(&self) -> String {
        todo!()
    }
    fn size(&self) -> u64 {
        todo!()
    }
    fn caps(&self) -> Capabilities {
        todo!()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> ferry_backend::Result<()> {
        let _ = (buf, offset);
        todo!()
    }
    fn flush(&self) -> ferry_backend::Result<()> {
        todo!()
    }
}
