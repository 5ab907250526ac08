//! ferry's own change tracking of a local qcow2 image (a stopped VM's disk).

use anyhow::{Context, Result};
use std::sync::Arc;

/// Bitmaps ferry keeps in a local qcow2 image it backs up are named
/// `ferry-REPO8-NAME-ID16`: REPO8 the first 8 characters of the repository's id (so one
/// image backed up into two repositories keeps a bitmap for each), NAME the disk, ID16
/// the first 16 hex digits of the snapshot whose read they follow. Earlier ferry named
/// them `ferry-NAME-ID16`: such a bitmap of the disk is removed at the next restart.
const TRACK_PREFIX: &str = "ferry-";
const TRACK_ID: usize = 16;
const TRACK_REPO: usize = 8;

/// The change tracking of a stopped VM's local qcow2 image, kept by ferry. The image is
/// opened for writing (so no one else writes it while it is backed up), read, and only
/// once the snapshot is committed is the bitmap restarted: a bitmap named after the new
/// snapshot is added and the older ones of the same repository and disk removed, while
/// the image is still held, so no write can fall between. A backup reads only what a
/// bitmap marks when it is named after the disk's latest snapshot, enabled and
/// consistent; anything else (the first backup, a failed or interrupted one, a crash
/// between commit and restart, a snapshot forgotten, a bitmap left `in-use` by a crashed
/// VM) reads the whole image. No run can leave a bitmap that misses changes or blocks the
/// next run.
pub(crate) struct Tracker {
    pub(crate) q: Arc<ferry_qcow2::Qcow2>,
    /// `ferry-REPO8-`.
    repo_prefix: String,
    name: String,
}

impl Tracker {
    pub(crate) fn new(q: Arc<ferry_qcow2::Qcow2>, repo_id: &str, name: &str) -> Tracker {
        let repo: String = repo_id.chars().filter(char::is_ascii_alphanumeric).take(TRACK_REPO).collect();
        Tracker { q, repo_prefix: format!("{TRACK_PREFIX}{repo}-"), name: name.to_string() }
    }

    pub(crate) fn name_for(&self, snapshot: &str) -> String {
        format!("{}{}-{}", self.repo_prefix, self.name, &snapshot[..TRACK_ID.min(snapshot.len())])
    }

    /// Whether `bitmap` is one of this repository's and disk's (any snapshot), or one an
    /// earlier ferry kept for this disk: the disk's name must match whole, so that `vm1`
    /// never takes `vm1-off`'s.
    fn is_ours(&self, bitmap: &str) -> bool {
        let of_disk = |rest: &str| {
            rest.rsplit_once('-').is_some_and(|(name, id)| {
                name == self.name && id.len() == TRACK_ID && id.bytes().all(|b| b.is_ascii_hexdigit())
            })
        };
        bitmap.strip_prefix(&self.repo_prefix).is_some_and(of_disk)
            || bitmap.strip_prefix(TRACK_PREFIX).is_some_and(of_disk)
    }

    /// The bitmap that holds every change since `snapshot` was read, if there is one.
    pub(crate) fn continuing(&self, snapshot: &str) -> Option<String> {
        let want = self.name_for(snapshot);
        self.q.bitmaps().into_iter().find(|b| b.name == want && b.auto && !b.in_use).map(|b| b.name)
    }

    /// After `snapshot` is committed: a new, empty bitmap for it; the older ones removed;
    /// the image closed (bitmaps written back).
    pub(crate) fn restart(self, snapshot: &str) -> Result<()> {
        let new = self.name_for(snapshot);
        let old: Vec<String> =
            self.q.bitmaps().into_iter().map(|b| b.name).filter(|n| self.is_ours(n) && *n != new).collect();
        if !self.q.bitmaps().iter().any(|b| b.name == new) {
            self.q.bitmap_add(&new, None, false).with_context(|| format!("adding the bitmap {new}"))?;
        }
        for n in &old {
            self.q.bitmap_remove(n).with_context(|| format!("removing the bitmap {n}"))?;
        }
        // Still shared, it is written back when the last user drops it.
        if let Ok(q) = Arc::try_unwrap(self.q) {
            q.close().context("writing the bitmaps back")?;
        }
        Ok(())
    }
}
