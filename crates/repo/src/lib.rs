//! ferry's backup repository: snapshots of disks, deduplicated by fixed-size chunks,
//! compressed with zstd, encrypted when asked, in a directory or under an S3 prefix.
//! The format is specified in `FORMAT.md` beside this crate; this crate is its only
//! implementation.
//!
//! Layers, each depending only on those above it:
//! - [`format`]: the encodings of every object (config, pack trailer, index, page,
//!   manifest, lock). Pure: no I/O; every parser bounded and fuzzed.
//! - [`crypto`]: the key (Argon2id-wrapped), AEAD of objects, keyed chunk ids.
//! - [`blob`]: one chunk or page as stored (compression, encryption, digest check).
//! - [`store`]: the object store interface and its directory, S3 and memory stores.
//! - [`lock`]: repository locks over a store.
//! - [`Repository`] (open/init, the index, snapshots), [`SnapshotWriter`] (a backup, as a
//!   copy destination), [`SnapshotImage`] (a snapshot as a read-only image), [`maint`]
//!   (check, verify, forget, gc, stats).
#![forbid(unsafe_code)]

pub mod blob;
mod checkpoint;
pub mod crypto;
mod diff;
pub mod format;
pub mod lock;
pub mod maint;
mod memory;
mod reader;
mod repo;
pub mod store;
#[cfg(test)]
mod tests;
mod writer;

pub use checkpoint::CheckpointInfo;
pub use diff::SnapshotDiff;
pub use reader::{default_cache_bytes, SnapshotImage, MIN_CACHE_BYTES};
pub use repo::{Index, InitOptions, Location as BlobLocation, Repository, SnapshotInfo};
/// A passphrase as ferry holds it from where it is read to the KDF: zeroed when dropped.
pub type Passphrase = zeroize::Zeroizing<Vec<u8>>;
pub use writer::{
    checkpoint_mismatch, BackupOptions, SnapshotWriter, WriterStats, DEFAULT_CHECKPOINT_EVERY, DEFAULT_LEVEL,
    DEFAULT_PACK_SIZE,
};

/// Errors of repository operations. Each says what is wrong and what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An object is damaged: unreadable, truncated, failing its checksum or its
    /// authentication, or inconsistent with the format. `object` is its name in the store.
    #[error("{object} is damaged: {why} (run `ferry repo check`, then `ferry repo verify`, to see what it affects)")]
    Damaged { object: String, why: String },
    /// The passphrase does not open the repository's key.
    #[error("{0}")]
    Passphrase(String),
    /// Another process holds a conflicting lock.
    #[error("{0}")]
    Locked(String),
    /// A snapshot, disk or object that was asked for does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The store failed (I/O, network, permissions, full disk).
    #[error("{what}: {source}")]
    Store { what: String, source: std::io::Error },
    /// The request cannot be done as asked; the text says why and what to do instead.
    #[error("{0}")]
    Invalid(String),
    /// Stopped by a signal.
    #[error("interrupted")]
    Interrupted,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn damaged(object: impl Into<String>, why: impl Into<String>) -> Error {
        Error::Damaged { object: object.into(), why: why.into() }
    }
    pub fn store(what: impl Into<String>, source: std::io::Error) -> Error {
        Error::Store { what: what.into(), source }
    }
}
