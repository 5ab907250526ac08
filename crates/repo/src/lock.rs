//! Repository locks (FORMAT.md §8) over a [`Store`].
use crate::format::LockKind;
use crate::store::Store;
use crate::Result;
use std::sync::Arc;
use std::time::Duration;

/// A held lock: refreshed in the background every 5 minutes, removed when dropped.
pub struct LockGuard {
    _store: Arc<dyn Store>,
}

/// Takes a lock of `kind` (`disk`: the disk's tag, for backups). A conflicting lock held
/// by a live process gives [`crate::Error::Locked`] naming its holder (kind, host, pid,
/// since when), unless `wait` is given: then it is retried until it is free or `wait`
/// has passed. Stale locks are removed with a warning.
pub fn acquire(
    store: &Arc<dyn Store>,
    kind: LockKind,
    disk: Option<String>,
    wait: Option<Duration>,
) -> Result<LockGuard> {
    let _ = (store, kind, disk, wait);
    todo!()
}

/// The locks in the repository now, with whether each is stale (for `ferry repo list`
/// and messages).
pub fn list(store: &Arc<dyn Store>) -> Result<Vec<(String, crate::format::Lock, bool)>> {
    let _ = store;
    todo!()
}
