//! Where a repository's objects live: the [`Store`] interface and its directory, S3 and
//! memory implementations. Names are FORMAT.md §2's (`config`, `data/HH/ID`, ...): `/`
//! separated, relative, made of `[a-z0-9]` and `/` only (a store refuses anything else,
//! so no name can leave the repository).
use std::io;

mod dir;
mod mem;
mod s3;

pub use dir::DirStore;
pub use mem::MemStore;

pub use s3::S3Store;

/// When an object was last written, by the store's clock, and that clock now where the
/// store tells it (else the caller's clock stands in): so that an object's age can be
/// told without trusting the clock of the host that wrote it (locks, FORMAT.md §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreTime {
    pub modified: std::time::SystemTime,
    pub now: Option<std::time::SystemTime>,
}

/// An object store. Every method may be called from many threads at once.
///
/// Errors are `io::Error`s: `ErrorKind::NotFound` for a missing object (what callers test
/// for), anything else for a failure of the store (its text names the object).
pub trait Store: Send + Sync {
    /// What the store is, for messages (a path, or an s3:// URL without credentials).
    fn describe(&self) -> String;
    /// The whole object, refused (`InvalidData`) when it is larger than `limit` bytes,
    /// before it is read into memory.
    fn get(&self, name: &str, limit: u64) -> io::Result<Vec<u8>>;
    /// As [`Store::get`], with when the object was last written where the store can tell
    /// (a file's modification time, S3's `Last-Modified` with the server's `Date`).
    fn get_timed(&self, name: &str, limit: u64) -> io::Result<(Vec<u8>, Option<StoreTime>)> {
        Ok((self.get(name, limit)?, None))
    }
    /// `len` bytes from `offset`; fewer only at the object's end (`UnexpectedEof` if the
    /// object is shorter than `offset + len`).
    fn get_range(&self, name: &str, offset: u64, len: u64) -> io::Result<Vec<u8>>;
    /// The object's length.
    fn len(&self, name: &str) -> io::Result<u64>;
    /// Writes the whole object atomically and durably: once this returns it survives a
    /// crash, and a reader never sees part of it.
    fn put(&self, name: &str, data: &[u8]) -> io::Result<()>;
    /// Removes an object; removing a missing object is not an error.
    fn delete(&self, name: &str) -> io::Result<()>;
    /// Every object whose name starts with `prefix` (e.g. `"snapshots/"`, `"data/"`, which
    /// lists recursively), with its length, in no particular order.
    fn list(&self, prefix: &str) -> io::Result<Vec<(String, u64)>>;
    /// Removes what writes interrupted by a crash left under `prefix` and [`Store::list`]
    /// does not show (a directory store's temporary files); the number of objects and
    /// bytes removed: only those last modified at least `min_age` ago (a writer that may
    /// run beside the caller writes its files within that time; zero: every one, for a
    /// caller that excludes every writer). Stores whose writes leave nothing behind (S3's
    /// PUTs are atomic) have nothing to do.
    fn remove_partial(&self, _prefix: &str, _min_age: std::time::Duration) -> io::Result<(u64, u64)> {
        Ok((0, 0))
    }
    /// Whether reads are served by this machine's own storage (a directory, memory), with
    /// no network round trip to wait out: a reader then needs about one thread per core,
    /// where an object store's latency needs many requests in flight. False unless the
    /// store says so (the many threads are right for a store of unknown kind).
    fn local(&self) -> bool {
        false
    }
}

/// Whether `name` is an object name a store accepts: non-empty `/`-separated segments of
/// `[a-z0-9]`, at most 4 segments and 200 bytes.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && name.split('/').count() <= 4
        && name.split('/').all(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()))
}

pub(crate) fn invalid_name(name: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} is not a repository object name"))
}
