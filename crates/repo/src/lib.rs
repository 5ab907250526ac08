//! ferry's backup repository: snapshots of disks, deduplicated by fixed-size chunks,
//! compressed with zstd, encrypted when asked, in a directory or under an S3 prefix.
//! The format is specified in `FORMAT.md` beside this crate; this crate is its only
//! implementation.
//!
//! Layers, each depending only on those above it:
//! - [`format`](mod@format): the encodings of every object (config, pack trailer, index, page,
//!   manifest, lock). Pure: no I/O; every parser bounded and fuzzed.
//! - [`crypto`]: the key (Argon2id-wrapped), AEAD of objects, keyed chunk ids.
//! - [`keys`]: several passphrases (key objects) and changing them.
//! - [`blob`]: one chunk or page as stored (compression, encryption, digest check).
//! - [`store`]: the object store interface and its directory, S3 and memory stores.
//! - [`lock`]: repository locks over a store.
//! - [`Repository`] (open/init, the index, snapshots), [`SnapshotWriter`] (a backup, as a
//!   copy destination), [`SnapshotImage`] (a snapshot as a read-only image), [`maint`]
//!   (check, verify, forget, gc, stats), [`recover`] (repair, unlock).
//!
//! # The backup repository (`crates/repo`)
//!
//! `ferry-repo` holds `ferry backup`'s repositories: snapshots of disks in fixed-size,
//! content-addressed chunks, compressed, encrypted when asked, in a directory or under an S3
//! prefix. What is stored, byte for byte, is specified in `crates/repo/FORMAT.md`, the
//! contract between versions (as `doc/proto.md` is for NBD); the crate is its only
//! implementation. Its layers, each using only those above it:
//!
//! ```text
//! format.rs          every object's encoding: config, pack trailer, index object, index page,
//!                    manifest, lock. Pure: bytes in, values out; every length, count and
//!                    offset checked against the input and FORMAT.md's limits before anything
//!                    is allocated; fuzzed
//! crypto.rs          the key: Argon2id-wrapped master key (its KDF cost bounded before it
//!                    runs), AES-256-GCM of objects (format 2: a key per object from
//!                    HMAC-SHA256), HMAC-SHA256 chunk ids; keys zeroed on drop; Crypto::None for an
//!                    unencrypted repository (the crates, and why: ARCHITECTURE.md, its dependency list)
//! blob.rs            one chunk or page as stored: zstd (one context per thread;
//!                    decompression bounded by the frame's declared size and chunk_size) or
//!                    raw, sealed, and the digest check (SHA-256 through ferry-hash, the code
//!                    of blkhash's block digests)
//! store/             trait Store: get, get_range, put (atomic and durable), delete, list;
//!                    DirStore (a file per object, every path walked from the root's
//!                    descriptor with O_NOFOLLOW; 0600 temporary file, fsync, rename, fsync
//!                    of the directory), S3Store (ferry-s3's S3Bucket: PREFIX/NAME keys,
//!                    PutObject with its SHA-256 signed, ranged GET, paged ListObjectsV2),
//!                    MemStore (tests)
//! lock.rs            repository locks as objects (locks/), listed after they are written
//! keys.rs            the passphrases: the config's key and key objects (keys/), tried in
//!                    turn at open; add, change, list, remove (`ferry repo key`)
//! repo.rs            Repository: init/open (config, key), the index (the union of the index
//!                    objects), snapshots, resolving NAME[@ID], a snapshot's entries
//! writer.rs          SnapshotWriter: a backup, as a write-only Backend the copy engine fills
//! reader.rs          SnapshotImage: a snapshot, as a read-only Backend
//! diff.rs            SnapshotDiff: the chunks that differ between two snapshots of a disk,
//!                    as a qemu:dirty-bitmap: context (ferry serve offers it when both are
//!                    served)
//! maint.rs           check, verify, forget (policy or ids), gc, stats
//! copy.rs            snapshots copied into another repository (`ferry repo copy`), each
//!                    through that repository's SnapshotWriter: the chunk list carried over
//!                    where the chunk sizes agree (only the chunks it lacks read and stored),
//!                    the bytes cut again where they differ
//! maint.rs           check, verify, forget (policy or ids), gc (and its dry run), stats
//! retain.rs          retention rules (restic's: last/hourly/daily/weekly/monthly/yearly,
//!                    within, tags) with the reason each snapshot is kept; protected
//!                    snapshots (protected/ID marks, read by name only)
//! damage.rs          damage records (damage/): copies verify found damaged; the index lists
//!                    them after good copies, backups store their content again, gc
//!                    drops them once no snapshot needs them
//! condemn.rs         condemned records (gc/condemned/): gc runs beside backups, condemning
//!                    what it finds unused; backups treat condemned packs as absent; a later
//!                    gc deletes them once the backups that ran then have ended
//! recover.rs         repair (index objects rebuilt from pack trailers, unreadable objects
//!                    removed), unlock (stale locks removed)
//! migrate.rs         `ferry repo migrate`: a version 1 or 2 repository upgraded to 3 in
//!                    place (located pages and version 2 manifests, crash-safe)
//! known.rs           this host's record of each repository it used (id, encryption and
//!                    key fingerprint, each disk's newest snapshot, what it forgot), so a
//!                    store that went back or lost its encryption is noticed
//! runs.rs            this host's cache of the index (not part of the format): the index
//!                    objects as sorted, immutable run files (CRC-checked blocks of 128
//!                    entries, a fence of each block's first id), merged into at most 4;
//!                    BlobLookup, which the in-memory Index (check, verify, gc) and
//!                    RunIndex (readers and backups) implement
//! ```
//!
//! The binary reaches it through `ferry-open`: `Location::parse` recognises `REPO::NAME` and
//! `REPO::NAME@ID` (REPO a directory or `s3://BUCKET/PREFIX`), opens the store, asks for the
//! passphrase only if `config` says the repository is encrypted, and gives `copy`, `serve`,
//! `hash` and `info` a `SnapshotImage` like any other `Backend`; `ferry backup` gets a
//! `SnapshotWriter` as its destination, and `ferry repo ...` calls `maint`. The copy engine
//! and the server never name the repository.
//!
//! **The path of one backup.** `ferry backup --dirty-bitmap b0 --since ID URI REPO::vm`:
//! 1. `SnapshotWriter::start` takes the disk's `backup` lock, opens the index through this
//!    host's cache (`RunIndex::open`: the run files of `$FERRY_CACHE_DIR/<id>/index`, after
//!    reading the index objects that no run covers yet; the copies in packs present in
//!    the store, none recorded damaged) and reads the pages of vm's latest snapshot (the base: every
//!    chunk the source does not send keeps the base's entry), which the binary checked is
//!    `ID`, the snapshot the map continues. Base entries with no present copy are lost:
//!    `lost_ranges` gives them to the copy engine to read too, and `commit` refuses a
//!    manifest that would still name one (the base's ids are looked up sorted, 256k at a
//!    time, so neighbours share the blocks read). The chunk list is kept in memory for a
//!    small disk, else in an unlinked file in the cache directory (`entries.rs`), so that
//!    a backup's memory does not grow with its disk. A base whose pages cannot be read is
//!    dropped by a full backup (with a warning) and refused by a change-map one.
//! 2. The binary reads a sample of the chunks the map leaves alone from the source and
//!    compares them with the base's entries (`SnapshotWriter::with_entries`).
//!    The copy engine reads the dirty map (without a bitmap, the allocation map), and its
//!    workers read those ranges from the source into their own buffers, many requests in
//!    flight, and hand them to the writer (`Backend::write`, `zero`, `trim`) from many
//!    threads at once, as they would to a file.
//! 3. The writer cuts each request into whole chunks and parts of chunks. A part is kept
//!    until the rest of its chunk arrives, or is completed at commit from the chunk's
//!    previous content. Whole chunks are hashed in batches, several side by side (SHA-256
//!    through ferry-hash: the digest is blkhash's block digest), and the id derived (the
//!    digest, or its HMAC when encrypted); an all-zero chunk becomes a zero entry and is not
//!    stored.
//! 4. Dedup: an id already in the index (one block of each run file read, `pread`, its
//!    CRC checked, binary-searched), or already stored by this backup, costs nothing
//!    more. A new one is compressed (zstd; kept raw when that does not shrink it) and sealed
//!    (AES-256-GCM, the id and kind as additional data) by the calling worker; only the append
//!    to the open pack happens under a lock.
//! 5. A pack that reaches its size (32 MiB) gets its trailer and is stored (`Store::put`, named
//!    by the SHA-256 of its bytes: `data/HH/ID`) by the worker that filled it, with at most
//!    two packs on their way to the store at once (bounded memory).
//! 6. `commit`: the pending parts of chunks; the index pages that changed (a page covers
//!    16 MiB of the disk and is a blob itself, so unchanged pages are the base's). In a
//!    version 3 repository (FORMAT.md §7c) the data packs are closed first and the pages
//!    are *located*: each entry says where its chunk is (this backup's pack, else the
//!    base's hint, else the index), and a base page is kept only when every pack it names
//!    is present and not condemned; the manifest says where each page is. Then the last
//!    pack; one index object for this backup's packs (`index/ID`); then the manifest
//!    (`snapshots/ID`: the time of this host's clock, size, page digests, parent, source,
//!    kind of change map, blkhash, stats); then the lock is released. A crash before the manifest leaves only
//!    unreferenced objects, which `gc` removes.
//!
//! **The path of one restored READ.** `ferry copy REPO::vm@3f2a out.raw`, or an NBD READ of
//! `ferry serve REPO::vm`:
//! 1. `SnapshotImage::open` (once) resolves the snapshot (the manifests listed a few at a
//!    time, each kept as a summary without its page digests), opens the index through this
//!    host's cache (as a backup does, with every copy), reads that snapshot's manifest again
//!    for its page digests ([`Repository::pages`]) and reads its pages: the digest of every
//!    chunk. A located snapshot (version 3) reads each page where its manifest's hint says
//!    and keeps each chunk's hint (12 bytes); the index is opened only when a hint fails
//!    (a pack gone since a gc repacked it, a range that does not decode or match its
//!    digest), and each chunk is then read from its hint first, its index copies after. The allocation map (`Backend::extents`)
//!    comes from these entries: zero entries are holes, never read.
//! 2. `SnapshotImage::read(buf, offset)` splits the range by chunk. A zero entry is filled
//!    with zeroes; a chunk read in part may come from the cache of decoded chunks (sharded
//!    LRU; one budget for every snapshot the process has open: `FERRY_REPO_CACHE`, by
//!    default a sixteenth of the memory limit, at most 1 GiB, each snapshot keeping at
//!    least 16 MiB); otherwise the id (from the digest) and, from the index cache (one block
//!    of each run read and binary-searched), its pack, offset and stored length.
//! 3. The chunks wanted are sorted by pack and offset, and each run of neighbours in one pack
//!    (gaps under 64 KiB) is fetched with one `Store::get_range`: a `pread` of the pack file,
//!    or a ranged GET on S3. A small read that continues the previous one also fetches the
//!    next chunks of its pack into the cache (read-ahead for sequential readers, such as a
//!    guest booting from `ferry serve`). No lock is held around I/O or decoding, so the copy
//!    engine's workers and the server's connections read side by side; the requests of one
//!    NBD connection go to the snapshot's pool of reader threads (`Backend::io_queue`) and
//!    are answered in order.
//! 4. `blob::decode_unchecked`: open the seal (a wrong key or a changed byte fails here) and
//!    decompress into at most `chunk_size` bytes; then the SHA-256 of every chunk of the run
//!    is checked against its entry's digest, side by side (`digest_many`, multi-buffer). A failure is an I/O error naming the pack and the snapshot's range,
//!    never data, once every copy has been tried: the index keeps every location of a blob
//!    ([`Index::locations`]), and a read that fails on one copy (its pack missing, or its
//!    bytes damaged) reads each of its chunks again from the next copy; a chunk none of whose
//!    packs is there (a `gc` moved its blobs while the snapshot was read) makes the reader
//!    open the index again (the cache reads the index objects gc wrote) and read again.
//! 5. The bytes are copied into the caller's buffer (the copy engine's, or the server's
//!    reply arena); a chunk read in part is remembered in the cache, one read whole (a
//!    restore) is not.
//!
//! `ferry hash REPO::vm` reads none of this: with 64 KiB chunks the snapshot's blkhash is
//! computed from its entries (FORMAT.md §1), and the manifest records it.
//!
//! # What this crate owns
//!
//! The backup repository (`crates/repo`, FORMAT.md beside it): `format` (every object's
//! encoding, pure and fuzzed), `crypto`, `blob`, `store` (`DirStore`, `S3Store`), `lock`,
//! `Repository`, `SnapshotWriter` (a backup, as a copy destination), `SnapshotImage` (a
//! snapshot, as a read-only `Backend`), `maint` (check, verify, forget, gc, stats); see
//! "The backup repository"
//!
//! `unsafe`: forbidden.
#![forbid(unsafe_code)]

pub mod blob;
mod bloom;
mod checkpoint;
mod condemn;
pub mod copy;
pub mod crypto;
mod damage;
mod diff;
mod entries;
pub mod format;
pub mod keys;
pub mod known;
mod locations;
pub mod lock;
pub mod maint;
mod memory;
pub mod migrate;
pub mod points;
mod reader;
pub mod recover;
mod repo;
pub mod retain;
pub mod runs;
mod spill;
pub mod store;
mod table;
#[cfg(test)]
mod tests;
mod writer;

pub use checkpoint::CheckpointInfo;
pub use damage::{DamageSet, DamagedCopies};
pub use diff::SnapshotDiff;
pub use points::{PointDisk, PointRecord, PointsFor};
pub use reader::{default_cache_bytes, max_cache_bytes, snapshot_blkhash, SnapshotImage, MIN_CACHE_BYTES};
pub use repo::{resolve_in, Failures, Index, InitOptions, Location as BlobLocation, Repository, SnapshotInfo};
pub use runs::{BlobLookup, RunIndex};
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
    /// There is no repository where one was named: no directory, or no config in it.
    #[error("{0}")]
    NoRepository(String),
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

/// The failures a script can tell apart by ferry's exit status (docs/repo.md, "Exit
/// status"); every other error is a plain failure. The binary maps each to its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No repository where one was named.
    NoRepository,
    /// Another process holds a conflicting lock.
    Locked,
    /// No passphrase was given for an encrypted repository, or none of its keys opens.
    Passphrase,
    /// Damage was found: an object unreadable, failing its checksum or inconsistent.
    Damaged,
}

impl Error {
    pub fn damaged(object: impl Into<String>, why: impl Into<String>) -> Error {
        Error::Damaged { object: object.into(), why: why.into() }
    }
    /// What is wrong, without the object's name and the advice that a report that names
    /// the object itself (`ferry repo check`) gives once: the `why` of damage, else the
    /// whole message.
    pub fn reason(&self) -> String {
        match self {
            Error::Damaged { why, .. } => why.clone(),
            e => e.to_string(),
        }
    }
    pub fn store(what: impl Into<String>, source: std::io::Error) -> Error {
        Error::Store { what: what.into(), source }
    }
    /// The failure a script can tell apart that this error is, if it is one.
    pub fn failure(&self) -> Option<Failure> {
        match self {
            Error::NoRepository(_) => Some(Failure::NoRepository),
            Error::Locked(_) => Some(Failure::Locked),
            Error::Passphrase(_) => Some(Failure::Passphrase),
            Error::Damaged { .. } => Some(Failure::Damaged),
            Error::NotFound(_) | Error::Store { .. } | Error::Invalid(_) | Error::Interrupted => None,
        }
    }
    /// The failure of an error somewhere in `e`'s chain of causes, the outermost first:
    /// an [`Error`] itself, or one an [`std::io::Error`] carries (a snapshot's read, through
    /// the copy engine).
    pub fn failure_in(e: &(dyn std::error::Error + 'static)) -> Option<Failure> {
        let mut cause = Some(e);
        while let Some(c) = cause {
            if let Some(f) = c.downcast_ref::<Error>().and_then(Error::failure) {
                return Some(f);
            }
            // An io::Error's source() skips the error it carries: that one is next.
            cause = match c.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()) {
                Some(inner) => Some(inner),
                None => c.source(),
            };
        }
        None
    }
}
