//! Checkpoints of running backups (FORMAT.md §7a): reading, listing and removing them.
//! A [`crate::SnapshotWriter`] writes them ([`crate::SnapshotWriter::checkpoint`]) and
//! resumes from one ([`crate::SnapshotWriter::resume`]).
use crate::format::{self, Checkpoint};
use crate::repo::{par_map, parse_time, ByteBudget, Failures, Repository, SnapshotInfo, FETCH_THREADS, MANIFEST_BYTES};
use crate::{Error, Result};
use std::io;

/// The additional data of a checkpoint's AEAD.
pub(crate) const AAD_CHECKPOINT: &[u8] = b"ferry checkpoint";

/// A checkpoint and its object name (`checkpoints/TAG`).
#[derive(Debug, Clone)]
pub struct CheckpointInfo {
    pub object: String,
    pub checkpoint: Checkpoint,
}

impl CheckpointInfo {
    /// Its entries as a snapshot (id: the object name), to read its pages as a
    /// snapshot's.
    pub(crate) fn as_snapshot(&self) -> SnapshotInfo {
        SnapshotInfo::new(self.object.clone(), self.checkpoint.as_manifest())
    }

    /// The snapshot that makes this checkpoint a leftover, if one does (`snaps`: the
    /// repository's snapshots, oldest first): the disk's latest snapshot, when it does
    /// not continue from the checkpoint's base itself but from the base or a later
    /// snapshot of it (or the checkpoint had no base), and was made no earlier than the
    /// checkpoint was stored. Every backup of the disk that starts after a checkpoint was
    /// stored resumes it or discards it before it commits, so such a checkpoint was left
    /// by a backup stopped between storing its snapshot and removing its checkpoint: what
    /// it would resume is in the snapshot already, and resuming it could only be refused
    /// (its base is no longer the latest). The snapshot that continues the base on the way
    /// to the latest must be one that backup could have stored: of the same source, with
    /// the same change map and size; a snapshot of the base stored otherwise (another
    /// backup, one planted) leaves the checkpoint an interrupted backup that cannot be
    /// resumed.
    ///
    /// A checkpoint of a copy (`ferry repo copy`) is superseded by the copy it was making:
    /// a snapshot of the disk whose `copied_from` names the snapshot its identity does
    /// (a copy keeps its source's older time, so the times tell nothing).
    pub fn superseded_by<'a>(&self, snaps: &'a [SnapshotInfo]) -> Option<&'a SnapshotInfo> {
        let ck = &self.checkpoint;
        if crate::copy::is_copy(ck) {
            let made = snaps.iter().rev().find(|s| {
                s.manifest.name == ck.name
                    && s.manifest.copied_from.as_ref().is_some_and(|c| crate::copy::copy_identity(c) == ck.identity)
            });
            if made.is_some() {
                return made;
            }
        }
        let latest = snaps.iter().rev().find(|s| s.manifest.name == ck.name)?;
        if ck.base.as_deref() == Some(latest.id.as_str()) {
            return None;
        }
        let (made, stored) = (parse_time(&latest.manifest.time)?, parse_time(&ck.time)?);
        if made < stored {
            return None;
        }
        let Some(base) = &ck.base else { return Some(latest) };
        // The base among the latest snapshot's ancestors (a parent whose manifest was
        // forgotten still names its own parent nowhere: the walk stops there).
        let mut at = latest;
        for _ in 0..snaps.len() {
            match &at.manifest.parent {
                Some(p) if p == base => {
                    let m = &at.manifest;
                    let same = m.source == ck.source && m.changes == ck.changes && m.size == ck.size;
                    return same.then_some(latest);
                }
                Some(p) => at = snaps.iter().find(|s| s.id == *p && s.manifest.name == ck.name)?,
                None => return None,
            }
        }
        None
    }
}

impl Repository {
    /// The object name of disk `name`'s checkpoint.
    pub fn checkpoint_object(&self, name: &str) -> String {
        format!("checkpoints/{}", self.crypto.disk_tag(name))
    }

    /// Reads and checks one checkpoint object: sealed, valid, and of the disk its name says.
    pub(crate) fn read_checkpoint_object(&self, object: &str) -> Result<CheckpointInfo> {
        let bytes = self.store.get(object, format::MAX_CHECKPOINT).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => Error::NotFound(format!("{object} is not in {}", self.store.describe())),
            io::ErrorKind::InvalidData => Error::damaged(object, e.to_string()),
            _ => Error::store(format!("cannot read {object} from {}", self.store.describe()), e),
        })?;
        let json = self.crypto.open_owned(AAD_CHECKPOINT, bytes).map_err(|e| Error::damaged(object, e.to_string()))?;
        let checkpoint = Checkpoint::parse(&json, &self.limits()).map_err(|e| Error::damaged(object, e.0))?;
        if self.checkpoint_object(&checkpoint.name) != object {
            return Err(Error::damaged(object, format!("it holds a checkpoint of another disk ({})", checkpoint.name)));
        }
        Ok(CheckpointInfo { object: object.to_string(), checkpoint })
    }

    /// Disk `name`'s checkpoint, if a backup of it was interrupted. A damaged one is an
    /// error naming it.
    pub fn checkpoint(&self, name: &str) -> Result<Option<CheckpointInfo>> {
        match self.read_checkpoint_object(&self.checkpoint_object(name)) {
            Ok(c) => Ok(Some(c)),
            Err(Error::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every checkpoint that reads well, and those that do not with why.
    pub fn checkpoints_lenient(&self) -> Result<(Vec<CheckpointInfo>, Failures)> {
        let names = self
            .store
            .list("checkpoints/")
            .map_err(|e| Error::store(format!("cannot list the checkpoints of {}", self.store.describe()), e))?;
        let mut names = names;
        names.sort();
        // As manifests are listed: a few at a time, within a budget of bytes.
        let budget = ByteBudget::new(MANIFEST_BYTES);
        let read = par_map(&names, FETCH_THREADS, |(n, len)| budget.with(*len, || self.read_checkpoint_object(n)));
        let names: Vec<String> = names.into_iter().map(|(n, _)| n).collect();
        let mut good = Vec::new();
        let mut bad = Vec::new();
        for (name, r) in names.iter().zip(read) {
            match r {
                Ok(c) => good.push(c),
                Err(e @ Error::Store { .. }) => return Err(e),
                // Removed since it was listed: a backup committed.
                Err(Error::NotFound(_)) => {}
                Err(e) => bad.push((name.clone(), e)),
            }
        }
        Ok((good, bad))
    }

    /// Removes disk `name`'s checkpoint (none is not an error). Call it holding the
    /// disk's backup lock (a [`crate::SnapshotWriter`] of it).
    pub fn discard_checkpoint(&self, name: &str) -> Result<()> {
        let object = self.checkpoint_object(name);
        self.store
            .delete(&object)
            .map_err(|e| Error::store(format!("cannot remove {object} from {}", self.store.describe()), e))
    }
}
