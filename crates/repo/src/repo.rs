//! A repository opened: its config and key, its index, its snapshots.
use crate::crypto::Crypto;
use crate::format::{BlobKind, Config, Digest, KdfCost, Manifest};
use crate::store::Store;
use crate::Result;
use std::collections::HashMap;
use std::sync::Arc;

/// `ferry repo init`'s choices.
#[derive(Debug, Clone)]
pub struct InitOptions {
    pub chunk_size: u32,
    pub page_entries: u32,
    /// A passphrase and the KDF's cost, for an encrypted repository.
    pub encrypt: Option<(Vec<u8>, KdfCost)>,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions { chunk_size: 65536, page_entries: 256, encrypt: None }
    }
}

pub struct Repository {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) config: Config,
    pub(crate) crypto: Crypto,
}

/// Where a blob is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub pack: Digest,
    pub kind: BlobKind,
    pub offset: u32,
    pub stored_len: u32,
    pub plain_len: u32,
}

/// The union of the index objects: blob id to where it is.
#[derive(Default)]
pub struct Index {
    pub blobs: HashMap<Digest, Location>,
    /// Names of the index objects it was read from.
    pub objects: Vec<String>,
}

/// A snapshot: its id (object name) and manifest.
#[derive(Debug, Clone)]
pub struct SnapshotInfo {
    pub id: String,
    pub manifest: Manifest,
}

impl Repository {
    /// Makes a new repository in an empty store.
    pub fn init(store: Arc<dyn Store>, opts: &InitOptions) -> Result<Repository> {
        let _ = (store, opts);
        todo!()
    }

    /// Opens a repository; `passphrase` is called only if it is encrypted.
    pub fn open(store: Arc<dyn Store>, passphrase: &dyn Fn() -> Result<Vec<u8>>) -> Result<Repository> {
        let _ = (store, passphrase);
        todo!()
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }
    pub fn config(&self) -> &Config {
        &self.config
    }
    pub fn crypto(&self) -> &Crypto {
        &self.crypto
    }

    /// Every snapshot, oldest first (by time, then id).
    pub fn snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        todo!()
    }

    /// The snapshot `name` means: the latest of the disk, or the one whose id starts with
    /// `id` (at least 4 hex digits, unique, and of that disk).
    pub fn resolve(&self, name: &str, id: Option<&str>) -> Result<SnapshotInfo> {
        let _ = (name, id);
        todo!()
    }

    /// Reads every index object.
    pub fn load_index(&self) -> Result<Index> {
        todo!()
    }

    /// The chunk digests of a snapshot, page by page: reads and checks its pages.
    pub fn entries(&self, index: &Index, snap: &SnapshotInfo) -> Result<Vec<Digest>> {
        let _ = (index, snap);
        todo!()
    }
}
