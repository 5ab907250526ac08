//! Points of a virtual machine (FORMAT.md, "Points"): which snapshot of each of a
//! domain's disks was taken at one instant, the libvirt checkpoint that instant began, and
//! the domain's XML. `points/TAG/ID`, TAG the domain's tag (so that a backup reads its own
//! domain's points only), ID the SHA-256 of its stored bytes; immutable, sealed as
//! manifests are. Points stored before TAG was (`points/ID`) are read too, and moved
//! under their domain's TAG by the next backup of any domain.
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

/// Checks a point record given as bytes (as opened from the store): what fuzzing drives.
/// Never panics, whatever the bytes; a point taken reads back the same from the JSON it
/// is stored as.
pub fn fuzz(data: &[u8]) {
    if let Ok(p) = PointRecord::parse(data) {
        let again = serde_json::to_vec(&p).map(|j| PointRecord::parse(&j));
        assert!(matches!(again, Ok(Ok(ref a)) if *a == p), "a point taken does not read back");
    }
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

/// Who reads a domain's points ([`Repository::points_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PointsFor {
    /// A restore (or any other reader): every point of the domain, wherever it is; moves
    /// nothing.
    Restore,
    /// A backup, under the host's lock of the domain: moves the domain's older points
    /// under its TAG. `moved`: an earlier backup's move is known to have finished (the
    /// caller's record, made once a backup's `points_of` returned).
    Backup { moved: bool },
}

impl Repository {
    /// Where the points of `domain` are: `points/TAG/`, TAG the tag (FORMAT.md §8) of
    /// `domain:` and the domain's name (no disk name has a `:`, so no disk's tag is it).
    pub fn points_prefix(&self, domain: &str) -> String {
        format!("points/{}/", self.crypto().disk_tag(&format!("domain:{domain}")))
    }

    /// Stores a point; its id (the object's name without `points/TAG/`).
    pub fn put_point(&self, point: &PointRecord) -> Result<String> {
        point.validate().map_err(|e| Error::Invalid(e.0))?;
        let json = serde_json::to_vec(point).map_err(|e| Error::Invalid(e.to_string()))?;
        let sealed = self.crypto().seal(AAD_POINT, &json);
        if sealed.len() as u64 > MAX_POINT {
            return Err(Error::Invalid(format!("the point would be {} bytes, more than {MAX_POINT}", sealed.len())));
        }
        let id = crate::format::hex(&crate::repo::sha256(&sealed));
        let name = format!("{}{id}", self.points_prefix(&point.domain));
        self.store()
            .put(&name, &sealed)
            .map_err(|e| Error::store(format!("cannot store {name} in {}", self.store().describe()), e))?;
        Ok(id)
    }

    /// Reads and checks one point (`object`: `points/ID` or `points/TAG/ID`).
    fn point_at(&self, object: &str) -> Result<PointRecord> {
        let prefix = object.rsplit_once('/').map_or("points/", |(dir, _)| &object[..dir.len() + 1]);
        let json = self.read_named(object, prefix, MAX_POINT, AAD_POINT)?;
        PointRecord::parse(&json).map_err(|e| Error::damaged(object, e.0))
    }

    /// The point objects (name, id) listed under `prefix` (`points/` or a domain's
    /// `points/TAG/`): `points/ID` (stored before domains had a TAG) and `points/TAG/ID`.
    /// Anything else is a point that cannot be read.
    fn point_objects(&self, prefix: &str) -> Result<(Vec<(String, String)>, Failures)> {
        let names = self
            .store()
            .list(prefix)
            .map_err(|e| Error::store(format!("cannot list the points of {}", self.store().describe()), e))?;
        let mut found = Vec::new();
        let mut bad: Failures = Vec::new();
        for (n, _) in names {
            let rest = n.strip_prefix("points/").unwrap_or(&n);
            let id = match rest.split_once('/') {
                Some((tag, id)) if is_hex(tag, 64) => id,
                Some(_) => "",
                None => rest,
            };
            match is_hex(id, 64) {
                true => found.push((n.clone(), id.to_string())),
                false => bad.push((n.clone(), Error::damaged(&n, "its name is not points/ID or points/TAG/ID"))),
            }
        }
        Ok((found, bad))
    }

    /// Reads `objects` (name, id): each point that reads well (id, record), oldest first,
    /// once (one being moved under its TAG may be listed at both places), those that do
    /// not with why, and how many were gone when read (moved under their TAG or deleted by
    /// another run since the listing: neither read nor bad).
    fn read_points(&self, objects: &[(String, String)]) -> Result<(Points, Failures, usize)> {
        let mut good: Vec<(String, PointRecord)> = Vec::new();
        let mut bad = Vec::new();
        let mut gone = 0;
        for ((object, id), r) in objects.iter().zip(par_map(objects, FETCH_THREADS, |(o, _)| self.point_at(o))) {
            match r {
                Ok(_) if good.iter().any(|(g, _)| g == id) => {}
                Ok(p) => good.push((id.clone(), p)),
                Err(e @ Error::Store { .. }) => return Err(e),
                Err(_) if self.store().len(object).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) => {
                    gone += 1
                }
                Err(e) => bad.push((object.clone(), e)),
            }
        }
        sort_points(&mut good);
        Ok((good, bad, gone))
    }

    /// Every point that reads well (id, record), oldest first, and those that do not
    /// with why.
    pub fn points(&self) -> Result<(Vec<(String, PointRecord)>, Failures)> {
        let (objects, mut bad) = self.point_objects("points/")?;
        let (mut good, more, gone) = self.read_points(&objects)?;
        bad.extend(more);
        if gone > 0 {
            // One was moved under its TAG (or deleted) since the listing: the listing
            // again has it at its new place, if anywhere.
            let (objects, again) = self.point_objects("points/")?;
            let (now, more, _) = self.read_points(&objects)?;
            (good, bad) = (now, again);
            bad.extend(more);
        }
        Ok((good, bad))
    }

    /// [`Repository::points`], each disk's snapshot id followed through `ferry repo
    /// migrate` in the listing `snaps` ([`follow_migrations`]).
    pub fn points_in(&self, snaps: &[SnapshotInfo]) -> Result<(Vec<(String, PointRecord)>, Failures)> {
        let (mut good, bad) = self.points()?;
        follow_migrations(&mut good, snaps);
        Ok((good, bad))
    }

    /// [`Repository::points_in`] of `domain` alone, and the points that cannot be read
    /// among those read. A backup ([`PointsFor::Backup`]: it writes, under the host's lock
    /// of `domain`) whose earlier backup is known to have moved every older point
    /// (`points/ID`) of `domain` under its TAG (`moved`) lists `points/TAG/` alone once a
    /// point there reads well: those of other domains (and their damage) are not its
    /// business. Otherwise (no backup of the domain is known to have finished the move, and
    /// a restore, which must find every point) the points stored before points had a TAG
    /// (`points/ID`, of any domain: read to tell) are read first, then the points under its
    /// TAG, listed after, so that one another run moves under its TAG meanwhile is found
    /// there; a backup then moves each old one of `domain` under its TAG, newest first (a
    /// run stopped midway has moved the point its next run continues), and returns only
    /// once every one is moved: the caller then records that the move is done.
    pub fn points_of(
        &self,
        domain: &str,
        snaps: &[SnapshotInfo],
        reader: PointsFor,
    ) -> Result<(Vec<(String, PointRecord)>, Failures)> {
        if reader == (PointsFor::Backup { moved: true }) {
            let (mine, mut bad) = self.point_objects(&self.points_prefix(domain))?;
            let (mut good, more, _) = self.read_points(&mine)?;
            if !good.is_empty() {
                bad.extend(more);
                follow_migrations(&mut good, snaps);
                return Ok((good, bad));
            }
        }
        let flat = |o: &str| o.matches('/').count() == 1;
        let (old, mut bad) = self.point_objects("points/")?;
        let old: Vec<_> = old.into_iter().filter(|(o, _)| flat(o)).collect();
        bad.retain(|(o, _)| flat(o));
        let (old, more, _) = self.read_points(&old)?;
        bad.extend(more);
        let old: Vec<_> = old.into_iter().filter(|(_, p)| p.domain == domain).collect();
        if matches!(reader, PointsFor::Backup { .. }) {
            // Newest first: the newest names the checkpoint the next backup continues. An
            // error: the caller must not record the move as done.
            for (id, _) in old.iter().rev() {
                self.move_point(id, domain)?;
            }
        }
        let (mine, more) = self.point_objects(&self.points_prefix(domain))?;
        bad.extend(more);
        let (mut good, more, _) = self.read_points(&mine)?;
        bad.extend(more);
        let old = old.into_iter().filter(|(id, _)| !good.iter().any(|(g, _)| g == id));
        good.extend(old.collect::<Vec<_>>());
        sort_points(&mut good);
        follow_migrations(&mut good, snaps);
        Ok((good, bad))
    }

    /// Moves `points/ID` (a point of `domain`, stored before points had a TAG) under its
    /// domain's TAG: the same bytes (so the same id) stored there first, then removed from
    /// `points/`, so that it is at one place at least whenever a run stops. One that a
    /// `forget` removed meanwhile (no longer at `points/ID` once the copy is stored) has its
    /// copy removed too: it stays forgotten.
    fn move_point(&self, id: &str, domain: &str) -> Result<()> {
        let old = format!("points/{id}");
        let new = format!("{}{id}", self.points_prefix(domain));
        let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
        let bytes = match self.store().get(&old, MAX_POINT) {
            Err(e) if gone(&e) => return Ok(()),
            r => r.map_err(|e| Error::store(format!("cannot read {old}"), e))?,
        };
        if crate::format::hex(&crate::repo::sha256(&bytes)) != id {
            return Err(Error::damaged(&old, "its content does not match its name (SHA-256)"));
        }
        self.store().put(&new, &bytes).map_err(|e| Error::store(format!("cannot store {new}"), e))?;
        match self.store().len(&old) {
            Err(e) if gone(&e) => {
                return match self.store().delete(&new) {
                    Err(e) if !gone(&e) => Err(Error::store(format!("cannot remove {new}"), e)),
                    _ => Ok(()),
                }
            }
            r => r.map_err(|e| Error::store(format!("cannot read {old}"), e))?,
        };
        match self.store().delete(&old) {
            Err(e) if !gone(&e) => Err(Error::store(format!("cannot remove {old}"), e)),
            _ => Ok(()),
        }
    }

    /// Removes point `id` of `domain` (the snapshots it names stay), wherever it is
    /// (under the domain's TAG, or at `points/ID` where older ferry stored it).
    pub fn delete_point(&self, id: &str, domain: &str) -> Result<()> {
        for name in [format!("{}{id}", self.points_prefix(domain)), format!("points/{id}")] {
            match self.store().delete(&name) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::store(format!("cannot remove {name}"), e))
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Points (id, record).
type Points = Vec<(String, PointRecord)>;

/// Points by the instant they were taken, then id: `...:00Z` and `...:00.5Z` compare
/// wrongly as text.
fn sort_points(points: &mut [(String, PointRecord)]) {
    let at = |p: &PointRecord| p.time.parse::<jiff::Timestamp>().ok();
    points.sort_by(|a, b| (at(&a.1), &a.0).cmp(&(at(&b.1), &b.0)));
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
            repo.delete_point(&id, &p.domain)?;
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

    /// A domain's backup before any move is known to have finished.
    const BACKUP: PointsFor = PointsFor::Backup { moved: false };

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
    fn a_domain_reads_its_own_points_and_older_ones_move_under_their_domain() {
        use crate::store::Store;
        for encrypted in [false, true] {
            let (store, repo) = crate::tests::new_repo(encrypted);
            let of = |domain: &str, time: &str| PointRecord { domain: domain.into(), time: time.into(), ..point() };
            // Two points stored as ferry stored them before TAG: at points/ID.
            let mut old = Vec::new();
            for p in [of("vm1", "2026-11-28T09:00:00Z"), of("vm2", "2026-11-28T09:00:01Z")] {
                let id = repo.put_point(&p).unwrap();
                let new = format!("{}{id}", repo.points_prefix(&p.domain));
                let bytes = store.get(&new, MAX_POINT).unwrap();
                store.put(&format!("points/{id}"), &bytes).unwrap();
                store.delete(&new).unwrap();
                old.push(id);
            }
            let ids = |v: Vec<(String, PointRecord)>| v.into_iter().map(|(id, _)| id).collect::<Vec<_>>();
            // The older points are read (a reader moves nothing)...
            assert_eq!(ids(repo.points_of("vm1", &[], PointsFor::Restore).unwrap().0), [old[0].clone()]);
            assert!(store.get(&format!("points/{}", old[0]), MAX_POINT).is_ok());
            assert_eq!(repo.points().unwrap().0.len(), 2);
            // ...and a domain's first backup moves its domain's under its TAG, the ids kept,
            // then stores its own point there.
            assert_eq!(ids(repo.points_of("vm1", &[], BACKUP).unwrap().0), [old[0].clone()]);
            let flat = |id: &str| store.get(&format!("points/{id}"), MAX_POINT).is_ok();
            assert!(!flat(&old[0]) && flat(&old[1]));
            let vm1 = repo.put_point(&of("vm1", "2026-11-28T10:00:00Z")).unwrap();
            assert_eq!(ids(repo.points_of("vm1", &[], BACKUP).unwrap().0), [old[0].clone(), vm1.clone()]);
            assert_eq!(ids(repo.points_of("vm2", &[], BACKUP).unwrap().0), [old[1].clone()]);
            assert!(!flat(&old[1]));
            let vm2 = repo.put_point(&of("vm2", "2026-11-28T10:00:00Z")).unwrap();
            assert_eq!(ids(repo.points_of("vm2", &[], PointsFor::Restore).unwrap().0), [old[1].clone(), vm2.clone()]);
            assert_eq!(ids(repo.points_of("vm2", &[], BACKUP).unwrap().0), [old[1].clone(), vm2.clone()]);
            // From then on a domain's points are read alone: another domain's damaged
            // point is not even read.
            let theirs = format!("{}{vm2}", repo.points_prefix("vm2"));
            store.put(&theirs, b"not a point").unwrap();
            let (mine, bad) = repo.points_of("vm1", &[], PointsFor::Restore).unwrap();
            assert_eq!((ids(mine), bad.len()), (vec![old[0].clone(), vm1.clone()], 0));
            assert_eq!(repo.points().unwrap().1.len(), 1, "all points: the damaged one is read");
            // The tag does not show the domain's name, and differs by domain.
            assert!(!repo.points_prefix("vm1").contains("vm1"));
            assert_ne!(repo.points_prefix("vm1"), repo.points_prefix("vm2"));
            // Deleting takes a point from wherever it is.
            repo.delete_point(&vm1, "vm1").unwrap();
            assert_eq!(ids(repo.points_of("vm1", &[], PointsFor::Restore).unwrap().0), [old[0].clone()]);
        }
    }

    /// One domain's damaged point is reported in that domain's backups only; a damaged
    /// `points/ID` (whose domain cannot be told) in a domain's first backup since points
    /// had a TAG only, and in restores (which read every older point).
    #[test]
    fn a_damaged_point_is_reported_to_its_own_domain_only() {
        use crate::store::Store;
        let (store, repo) = crate::tests::new_repo(true);
        let of = |domain: &str| PointRecord { domain: domain.into(), ..point() };
        let vm1 = repo.put_point(&of("vm1")).unwrap();
        let vm2 = repo.put_point(&of("vm2")).unwrap();
        let damaged_flat = format!("points/{}", "d".repeat(64));
        store.put(&damaged_flat, b"not a point").unwrap();
        let damaged_vm2 = format!("{}{}", repo.points_prefix("vm2"), "e".repeat(64));
        store.put(&damaged_vm2, b"not a point either").unwrap();
        let bad_of = |domain: &str, reader: PointsFor| {
            let (good, bad) = repo.points_of(domain, &[], reader).unwrap();
            (
                good.into_iter().map(|(id, _)| id).collect::<Vec<_>>(),
                bad.into_iter().map(|(o, _)| o).collect::<Vec<_>>(),
            )
        };
        let moved = PointsFor::Backup { moved: true };
        assert_eq!(bad_of("vm1", moved), (vec![vm1.clone()], vec![]));
        assert_eq!(bad_of("vm2", moved), (vec![vm2.clone()], vec![damaged_vm2.clone()]));
        // A domain's first backup reads the older points once; a restore reads them always.
        assert_eq!(bad_of("vm3", BACKUP), (vec![], vec![damaged_flat.clone()]));
        assert_eq!(bad_of("vm1", PointsFor::Restore).1, std::slice::from_ref(&damaged_flat));
        assert_eq!(bad_of("vm2", PointsFor::Restore).1.len(), 2);
        // A backup whose move is recorded as done but whose folder holds no point that
        // reads well reads the older points too.
        let damaged_vm4 = format!("{}{}", repo.points_prefix("vm4"), "f".repeat(64));
        store.put(&damaged_vm4, b"not a point").unwrap();
        let vm4 = put_flat(&*store, &repo, &of("vm4"));
        assert_eq!(bad_of("vm4", moved), (vec![vm4], vec![damaged_flat, damaged_vm4]));
    }

    /// Stores `p` where ferry stored points before TAG: at `points/ID`; its id.
    fn put_flat(store: &dyn crate::store::Store, repo: &Repository, p: &PointRecord) -> String {
        let id = repo.put_point(p).unwrap();
        let new = format!("{}{id}", repo.points_prefix(&p.domain));
        let bytes = store.get(&new, MAX_POINT).unwrap();
        store.put(&format!("points/{id}"), &bytes).unwrap();
        store.delete(&new).unwrap();
        id
    }

    #[test]
    fn a_point_moved_by_another_run_between_listing_and_reading_is_still_seen() {
        use crate::tests::{Hooked, Op, When};
        use std::sync::Arc;
        let (mem, repo) = crate::tests::new_repo(false);
        let id = put_flat(&*mem, &repo, &PointRecord { domain: "vm2".into(), ..point() });
        let other = Arc::new(Repository::open(mem.clone(), &|| unreachable!()).unwrap());
        let store = Arc::new(Hooked::new(mem.clone()));
        let hooked = Repository::open(store.clone(), &|| unreachable!()).unwrap();
        // Right after this run lists `points/`, other runs (of vm1, then of vm2 on another
        // host) move the old points of their domains under their TAGs.
        let mut once = Some(other);
        store.set_hook(Some(Box::new(move |_, when, op, name| {
            if (when, op, name) == (When::After, Op::List, "points/") {
                if let Some(other) = once.take() {
                    other.points_of("vm1", &[], BACKUP).unwrap();
                    other.points_of("vm2", &[], BACKUP).unwrap();
                }
            }
            Ok(())
        })));
        let (points, bad) = hooked.points_of("vm2", &[], PointsFor::Restore).unwrap();
        assert_eq!(points.into_iter().map(|(i, _)| i).collect::<Vec<_>>(), [id]);
        assert!(bad.is_empty(), "{bad:?}");
    }

    #[test]
    fn a_point_forgotten_while_it_is_moved_stays_forgotten() {
        use crate::store::Store;
        use crate::tests::{Hooked, Op, When};
        use std::sync::Arc;
        let (mem, repo) = crate::tests::new_repo(false);
        let id = put_flat(&*mem, &repo, &PointRecord { domain: "vm1".into(), ..point() });
        let store = Arc::new(Hooked::new(mem.clone()));
        let hooked = Repository::open(store.clone(), &|| unreachable!()).unwrap();
        // A forget removes the point from both places after the move read it, before it
        // stored the copy.
        let (gone, mut reads) = (format!("points/{id}"), 0);
        store.set_hook(Some(Box::new(move |s, when, op, name| {
            if (when, op) == (When::After, Op::Get) && name == gone {
                reads += 1;
                if reads == 2 {
                    s.delete(name)?;
                }
            }
            Ok(())
        })));
        hooked.points_of("vm1", &[], BACKUP).unwrap();
        store.set_hook(None);
        assert!(repo.points().unwrap().0.is_empty(), "the forgotten point came back");
    }

    /// A first backup whose move of the older points fails midway (or is killed) moved
    /// the newest first; as it returned no success its caller records no finished move, so
    /// the next backup reads and moves the rest.
    #[test]
    fn a_move_stopped_midway_is_finished_by_the_next_backup() {
        use crate::store::Store;
        use crate::tests::{Hooked, Op, When};
        use std::sync::Arc;
        let (mem, repo) = crate::tests::new_repo(false);
        let of = |time: &str| PointRecord { time: time.into(), ..point() };
        let times = ["2026-11-28T08:00:00Z", "2026-11-28T09:00:00Z", "2026-11-28T10:00:00Z"];
        let old: Vec<String> = times.iter().map(|t| put_flat(&*mem, &repo, &of(t))).collect();
        let store = Arc::new(Hooked::new(mem.clone()));
        let hooked = Repository::open(store.clone(), &|| unreachable!()).unwrap();
        // The second copy stored under the TAG fails.
        let (prefix, mut puts) = (repo.points_prefix("vm1"), 0);
        store.set_hook(Some(Box::new(move |_, when, op, name| {
            if (when, op) == (When::Before, Op::Put) && name.starts_with(&prefix) {
                puts += 1;
                if puts == 2 {
                    return Err(std::io::Error::other("crash"));
                }
            }
            Ok(())
        })));
        assert!(hooked.points_of("vm1", &[], BACKUP).is_err());
        store.set_hook(None);
        let flat = |id: &str| mem.get(&format!("points/{id}"), MAX_POINT).is_ok();
        assert_eq!(old.iter().map(|id| flat(id)).collect::<Vec<_>>(), [true, true, false], "newest moved first");
        let ids = |v: Vec<(String, PointRecord)>| v.into_iter().map(|(id, _)| id).collect::<Vec<_>>();
        assert_eq!(ids(hooked.points_of("vm1", &[], BACKUP).unwrap().0), old);
        assert!(old.iter().all(|id| !flat(id)), "the rest moved");
        // Once the move is done, the TAG's folder alone has every point.
        let moved = PointsFor::Backup { moved: true };
        assert_eq!(ids(hooked.points_of("vm1", &[], moved).unwrap().0), old);
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
