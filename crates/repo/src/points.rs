//! Points of a virtual machine (FORMAT.md, "Points"): which snapshot of each of a
//! domain's disks was taken at one instant, the libvirt checkpoint that instant began,
//! and the domain's XML. `points/ID`, immutable, named by the SHA-256 of its stored
//! bytes, sealed as manifests are.
//!
//! A point binds a checkpoint to snapshot ids: a backup continues a disk from a
//! checkpoint only when the point that names it also names the disk's latest snapshot,
//! so a checkpoint of another repository, or one whose snapshot was forgotten, is never
//! taken for it.

use crate::format::{bounded_json, check_time, is_hex, valid_name, FormatError};
use crate::repo::{par_map, Failures, Repository, SnapshotInfo, FETCH_THREADS};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

const AAD_POINT: &[u8] = b"ferry point";
/// The version of a point record (its own, not the repository's).
pub const POINT_VERSION: u32 = 1;
/// Most bytes of a stored point.
pub const MAX_POINT: u64 = 4 << 20;
/// Most bytes of the domain's XML in a point.
pub const MAX_POINT_XML: usize = 2 << 20;
/// Most disks in a point.
pub const MAX_POINT_DISKS: usize = 1024;
/// Most bytes of the domain's name, a checkpoint's name, a disk's target or source.
pub const MAX_POINT_FIELD: usize = 4096;

/// One point of a domain (FORMAT.md, "Points").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PointRecord {
    pub version: u32,
    /// The libvirt domain's name.
    pub domain: String,
    /// The domain's UUID, which tells two domains of one name apart (on two hosts, or one
    /// defined anew); absent in points stored before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// When the point was stored (RFC 3339, UTC).
    pub time: String,
    pub host: String,
    /// The libvirt checkpoint created at the instant the disks were read; `None` when
    /// none was (a shut-off domain, read from its images).
    pub checkpoint: Option<String>,
    /// The domain's XML as libvirt gave it (inactive definition).
    pub xml: String,
    pub disks: Vec<PointDisk>,
}

/// One disk of a point.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PointDisk {
    /// The disk's target in the domain (`vda`).
    pub target: String,
    /// The repository disk its snapshot is of (`vm1-vda`).
    pub name: String,
    /// The snapshot taken at the point (64 hex).
    pub snapshot: String,
    /// Whether `checkpoint` tracks this disk's changes from the point on.
    pub tracked: bool,
}

impl PointRecord {
    /// A point of `domain` (its UUID `uuid`) taken now, on this host.
    pub fn new(
        domain: &str,
        uuid: Option<String>,
        checkpoint: Option<String>,
        xml: String,
        disks: Vec<PointDisk>,
    ) -> PointRecord {
        PointRecord {
            version: POINT_VERSION,
            domain: domain.to_string(),
            uuid,
            time: jiff::Timestamp::now().to_string(),
            host: crate::repo::hostname(),
            checkpoint,
            xml,
            disks,
        }
    }

    pub fn parse(json: &[u8]) -> std::result::Result<PointRecord, FormatError> {
        let r: PointRecord = bounded_json(json, MAX_POINT, "point")?;
        r.validate()?;
        Ok(r)
    }

    pub fn validate(&self) -> std::result::Result<(), FormatError> {
        let bad = |why: String| Err(FormatError(why));
        if self.version != POINT_VERSION {
            return bad(format!(
                "the point has version {}; this ferry reads version {POINT_VERSION} only (use a newer ferry)",
                self.version
            ));
        }
        check_time("the point's time", &self.time)?;
        let long = [&self.domain, &self.host]
            .into_iter()
            .chain(self.checkpoint.as_ref())
            .chain(self.uuid.as_ref())
            .any(|s| s.len() > MAX_POINT_FIELD);
        if self.domain.is_empty() || long {
            return bad(format!(
                "the point's domain, uuid, host or checkpoint is empty or longer than {MAX_POINT_FIELD} bytes"
            ));
        }
        if self.xml.len() > MAX_POINT_XML {
            return bad(format!("the point's XML is longer than {MAX_POINT_XML} bytes"));
        }
        if self.disks.is_empty() || self.disks.len() > MAX_POINT_DISKS {
            return bad(format!("a point has 1 to {MAX_POINT_DISKS} disks, this one {}", self.disks.len()));
        }
        for (i, d) in self.disks.iter().enumerate() {
            if d.target.is_empty()
                || d.target.len() > MAX_POINT_FIELD
                || !valid_name(&d.name)
                || !is_hex(&d.snapshot, 64)
            {
                return bad(format!("disk {i} of the point has a bad target, name or snapshot id"));
            }
        }
        Ok(())
    }
}

impl Repository {
    /// Stores a point; its id (the object's name without `points/`).
    pub fn put_point(&self, point: &PointRecord) -> Result<String> {
        point.validate().map_err(|e| Error::Invalid(e.0))?;
        let json = serde_json::to_vec(point).map_err(|e| Error::Invalid(e.to_string()))?;
        let sealed = self.crypto().seal(AAD_POINT, &json);
        if sealed.len() as u64 > MAX_POINT {
            return Err(Error::Invalid(format!("the point would be {} bytes, more than {MAX_POINT}", sealed.len())));
        }
        let id = crate::format::hex(&crate::repo::sha256(&sealed));
        let name = format!("points/{id}");
        self.store()
            .put(&name, &sealed)
            .map_err(|e| Error::store(format!("cannot store {name} in {}", self.store().describe()), e))?;
        Ok(id)
    }

    /// Reads and checks one point (`points/ID`).
    pub fn point(&self, id: &str) -> Result<PointRecord> {
        let object = format!("points/{id}");
        let json = self.read_named(&object, "points/", MAX_POINT, AAD_POINT)?;
        PointRecord::parse(&json).map_err(|e| Error::damaged(&object, e.0))
    }

    /// Every point that reads well (id, record), oldest first, and those that do not
    /// with why.
    pub fn points(&self) -> Result<(Vec<(String, PointRecord)>, Failures)> {
        let names = self
            .store()
            .list("points/")
            .map_err(|e| Error::store(format!("cannot list the points of {}", self.store().describe()), e))?;
        let ids: Vec<String> =
            names.into_iter().filter_map(|(n, _)| n.strip_prefix("points/").map(String::from)).collect();
        let mut good = Vec::new();
        let mut bad = Vec::new();
        for (id, r) in ids.iter().zip(par_map(&ids, FETCH_THREADS, |id| self.point(id))) {
            match r {
                Ok(p) => good.push((id.clone(), p)),
                Err(e @ Error::Store { .. }) => return Err(e),
                Err(e) => bad.push((format!("points/{id}"), e)),
            }
        }
        // By the instant, not the text: `...:00Z` and `...:00.5Z` compare wrongly as strings.
        let at = |p: &PointRecord| p.time.parse::<jiff::Timestamp>().ok();
        good.sort_by(|a, b| (at(&a.1), &a.0).cmp(&(at(&b.1), &b.0)));
        Ok((good, bad))
    }

    /// [`Repository::points`], each disk's snapshot id followed through `ferry repo
    /// migrate` in the listing `snaps` ([`follow_migrations`]).
    pub fn points_in(&self, snaps: &[SnapshotInfo]) -> Result<(Vec<(String, PointRecord)>, Failures)> {
        let (mut good, bad) = self.points()?;
        follow_migrations(&mut good, snaps);
        Ok((good, bad))
    }

    /// Removes a point (the snapshots it names stay).
    pub fn delete_point(&self, id: &str) -> Result<()> {
        let name = format!("points/{id}");
        self.store().delete(&name).map_err(|e| Error::store(format!("cannot remove {name}"), e))
    }
}

/// Removes the points whose snapshots are all gone: none is among `present` (the listing
/// after a forget) nor `unreadable` (ids of manifests that could not be read, which may
/// be there). A point that cannot be read is kept. The ids of the points removed (or, with
/// `dry_run`, that would be), with their domains.
pub(crate) fn prune_points(
    repo: &Repository,
    present: &[SnapshotInfo],
    unreadable: &[String],
    dry_run: bool,
) -> Result<Vec<(String, String)>> {
    let (mut points, _) = repo.points()?;
    follow_migrations(&mut points, present);
    let mut removed = Vec::new();
    for (id, p) in points {
        let there = |s: &str| present.iter().any(|p| p.id == s) || unreadable.iter().any(|u| u == s);
        if p.disks.iter().any(|d| there(&d.snapshot)) {
            continue;
        }
        if !dry_run {
            repo.delete_point(&id)?;
        }
        removed.push((id, p.domain));
    }
    Ok(removed)
}

/// Points with each disk's snapshot id as the listing `snaps` has it now: `ferry repo
/// migrate` (FORMAT.md §9) gives a snapshot a new id, and its new manifest names the old
/// one in `migrated_from`; a point keeps the id it was stored with.
pub fn follow_migrations(points: &mut [(String, PointRecord)], snaps: &[SnapshotInfo]) {
    let moved: HashMap<&str, &str> =
        snaps.iter().filter_map(|s| Some((s.manifest.migrated_from.as_deref()?, s.id.as_str()))).collect();
    if moved.is_empty() {
        return;
    }
    for d in points.iter_mut().flat_map(|(_, p)| p.disks.iter_mut()) {
        // A snapshot migrated more than once is followed along (a few steps at most).
        for _ in 0..8 {
            match moved.get(d.snapshot.as_str()) {
                Some(new) => d.snapshot = new.to_string(),
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point() -> PointRecord {
        PointRecord {
            version: POINT_VERSION,
            domain: "vm1".into(),
            uuid: Some("0b7d5e29-3c4f-4a3e-9d1e-0a4f6f1c2b3d".into()),
            time: "2026-11-28T10:00:00.5Z".into(),
            host: "h".into(),
            checkpoint: Some("ferry-0123-1".into()),
            xml: "<domain/>".into(),
            disks: vec![PointDisk {
                target: "vda".into(),
                name: "vm1-vda".into(),
                snapshot: "a".repeat(64),
                tracked: true,
            }],
        }
    }

    #[test]
    fn points_round_trip_and_bad_ones_are_refused() {
        let p = point();
        assert_eq!(PointRecord::parse(&serde_json::to_vec(&p).unwrap()).unwrap(), p);
        // A point stored before the uuid was recorded reads with none.
        let mut old = serde_json::to_value(&p).unwrap();
        old.as_object_mut().unwrap().remove("uuid");
        assert_eq!(PointRecord::parse(&serde_json::to_vec(&old).unwrap()).unwrap().uuid, None);
        let mut q = p.clone();
        q.disks[0].snapshot = "xyz".into();
        assert!(PointRecord::parse(&serde_json::to_vec(&q).unwrap()).is_err());
        let mut q = p.clone();
        q.disks.clear();
        assert!(PointRecord::parse(&serde_json::to_vec(&q).unwrap()).is_err());
        let mut q = p.clone();
        q.version = 2;
        assert!(PointRecord::parse(&serde_json::to_vec(&q).unwrap()).is_err());
        let mut q = p;
        q.time = "yesterday".into();
        assert!(PointRecord::parse(&serde_json::to_vec(&q).unwrap()).is_err());
        assert!(PointRecord::parse(b"{\"version\":1").is_err());
        assert!(PointRecord::parse(&vec![b' '; MAX_POINT as usize + 1]).is_err());
    }

    #[test]
    fn points_are_ordered_by_instant_not_text() {
        let (_store, repo) = crate::tests::new_repo(false);
        let mut a = point();
        a.time = "2026-11-28T10:00:00.5Z".into();
        let mut b = point();
        b.time = "2026-11-28T10:00:01Z".into();
        // As text, "...:00.5Z" sorts before "...:00Z" ('.' < 'Z'): half a second too early.
        let mut c = point();
        c.time = "2026-11-28T10:00:00Z".into();
        for p in [&b, &a, &c] {
            repo.put_point(p).unwrap();
        }
        let times: Vec<String> = repo.points().unwrap().0.into_iter().map(|(_, p)| p.time).collect();
        assert_eq!(times, [c.time, a.time, b.time]);
    }
}
