//! What this host knows of each repository it used, kept between runs: the repository's
//! id, whether it is encrypted and a fingerprint of its key, each disk's newest snapshot
//! this host wrote or saw, and the snapshots this host forgot. With it a command notices
//! a store that went back (docs/safety.md, "What someone who can write the store can
//! do"): a disk's newest snapshot gone with nothing newer in its place, a forgotten
//! snapshot back, an encrypted repository turned unencrypted or given another key.
//!
//! One record per repository location (a directory's canonical path, an S3 URL), a JSON
//! object in `STATE/repositories/HEX` (HEX: the SHA-256 of the location), STATE being
//! [`state_dir`]. The directories are 0700 and the files 0600, written whole to a
//! temporary file, fsync'ed and renamed (the directory store's `put`), read at most
//! [`MAX_RECORD`] bytes, and every read-modify-write holds an exclusive `flock` of STATE.
//! A record that cannot be read or parsed is never trusted: it is reported and made
//! again from what the repository holds now.
use crate::format::{self, hex, parse_digest};
use crate::repo::{parse_time, sha256, SnapshotInfo};
use crate::store::{DirStore, Store};
use crate::{Error, Repository, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The variable that names the state directory.
pub const STATE_DIR_ENV: &str = "FERRY_STATE_DIR";
/// The most bytes of a record read.
pub const MAX_RECORD: u64 = 8 << 20;
/// The most forgotten snapshots a record remembers (the oldest are dropped first): about
/// 2 MB of JSON, 55 years of daily forgets of one disk.
pub const MAX_FORGOTTEN: usize = 20_000;
/// The most disks a record follows (more are not followed, with a warning).
pub const MAX_DISKS: usize = 20_000;

/// Where the records are: `FERRY_STATE_DIR`, else `$XDG_STATE_HOME/ferry`, else
/// `~/.local/state/ferry` (`$HOME`); `None` when none of them is set.
pub fn state_dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = var(STATE_DIR_ENV) {
        return Some(d);
    }
    if let Some(x) = var("XDG_STATE_HOME").filter(|p| p.is_absolute()) {
        return Some(x.join("ferry"));
    }
    var("HOME").filter(|p| p.is_absolute()).map(|h| h.join(".local/state/ferry"))
}

/// What a command does when the store went back.
#[derive(Debug, Clone)]
pub enum OnRollback {
    /// Warns, and goes on (list, check, verify, stats).
    Warn,
    /// Refuses when it concerns `disk`, or any disk when `None`, and warns about the
    /// others: a disk's newest snapshot gone, and with `back` a forgotten snapshot back
    /// as the disk's latest (what a restore of the latest or a backup would use).
    /// `way_out` ends the refusal: what the user can do.
    Refuse { disk: Option<String>, back: bool, way_out: String },
    /// A snapshot named by id (`REPO::NAME@ID`): refuses only when the snapshot of `disk`
    /// whose id starts with `id` is one this host forgot; warns about the rest.
    Pinned { disk: String, id: String },
    /// The store's state is accepted (`--accept-rollback`): the record follows it.
    Accept,
}

/// A disk's newest snapshot as this host saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Seen {
    id: String,
    time: String,
}

/// A snapshot this host forgot, and when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Gone {
    id: String,
    name: String,
    at: String,
}

/// One repository's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Record {
    version: u32,
    location: String,
    id: String,
    encrypted: bool,
    /// Hex of [`crate::crypto::Crypto::key_fingerprint`].
    key: Option<String>,
    disks: BTreeMap<String, Seen>,
    forgotten: Vec<Gone>,
}

impl Record {
    fn new(location: &str, id: &str, key: Option<String>) -> Record {
        Record {
            version: 1,
            location: location.into(),
            id: id.into(),
            encrypted: key.is_some(),
            key,
            disks: BTreeMap::new(),
            forgotten: Vec::new(),
        }
    }

    /// The record in `bytes`, checked (pure), or why it is not one.
    fn parse(bytes: &[u8], location: &str) -> std::result::Result<Record, String> {
        let r: Record = serde_json::from_slice(bytes).map_err(|e| format!("it is not a record ({e})"))?;
        let digest = |s: &str| parse_digest(s).is_some();
        let time = |s: &str| parse_time(s).is_some();
        if r.version != 1 {
            return Err(format!("version {} is not 1", r.version));
        }
        if r.location != location {
            return Err(format!("it is the record of {:?}", r.location));
        }
        if !digest(&r.id) || r.key.as_deref().is_some_and(|k| !digest(k)) || r.encrypted != r.key.is_some() {
            return Err("its repository id or key fingerprint is not valid".into());
        }
        if r.disks.len() > MAX_DISKS || r.forgotten.len() > MAX_FORGOTTEN {
            return Err("it follows more disks or snapshots than ferry writes".into());
        }
        let disks_ok = r.disks.iter().all(|(n, s)| format::valid_name(n) && digest(&s.id) && time(&s.time));
        let gone_ok = r.forgotten.iter().all(|g| format::valid_name(&g.name) && digest(&g.id) && time(&g.at));
        if !disks_ok || !gone_ok {
            return Err("a disk name, snapshot id or time in it is not valid".into());
        }
        Ok(r)
    }
}

/// Whether `a` is a later time than `b` (FORMAT.md times; one that does not parse is
/// never later).
fn later(a: &str, b: &str) -> bool {
    matches!((parse_time(a), parse_time(b)), (Some(a), Some(b)) if a > b)
}

/// What a listing shows that the record says should not be.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Finding {
    /// The newest snapshot of `disk` this host saw is gone, and no later one is there.
    Gone { disk: String, seen: Seen, latest: Option<Seen> },
    /// A snapshot this host forgot is listed again (`latest`: as its disk's latest).
    Back { disk: String, id: String, time: String, at: String, latest: bool },
}

impl Finding {
    fn disk(&self) -> &str {
        match self {
            Finding::Gone { disk, .. } | Finding::Back { disk, .. } => disk,
        }
    }

    fn describe(&self, location: &str) -> String {
        let short = |id: &str| id.get(..8).unwrap_or(id).to_string();
        // As lists show times: to the second.
        let when = |t: &str| t.get(..19).unwrap_or(t).replacen('T', " ", 1);
        match self {
            Finding::Gone { disk, seen, latest } => format!(
                "{location}: snapshot {} of {disk} ({}), the newest this host wrote or saw, is gone from the store, \
                 and {}: the store went back (someone who can write it deleted or hid the snapshot, it was \
                 restored from an older copy, or another host removed the snapshot by hand)",
                short(&seen.id),
                when(&seen.time),
                match latest {
                    Some(l) =>
                        format!("the latest snapshot of {disk} there is the older {} ({})", short(&l.id), when(&l.time)),
                    None => format!("no snapshot of {disk} is there"),
                }
            ),
            Finding::Back { disk, id, time, at, .. } => format!(
                "{location}: snapshot {} of {disk} ({}) is in the store again, though this host forgot it at {}: its \
                 old objects were put back (by someone who can write the store, or by restoring the repository from \
                 an older copy)",
                short(id),
                when(time),
                when(at)
            ),
        }
    }
}

/// What `snaps` (oldest first) and the manifests that could not be read (`unreadable`,
/// ids) show against the record (pure).
fn findings(r: &Record, snaps: &[SnapshotInfo], unreadable: &HashSet<&str>) -> Vec<Finding> {
    let present: HashSet<&str> = snaps.iter().map(|s| s.id.as_str()).collect();
    let forgotten: HashMap<&str, &Gone> = r.forgotten.iter().map(|g| (g.id.as_str(), g)).collect();
    let mut latest: HashMap<&str, &SnapshotInfo> = HashMap::new();
    for s in snaps {
        latest.insert(s.manifest.name.as_str(), s);
    }
    let mut out = Vec::new();
    for (disk, seen) in &r.disks {
        if present.contains(seen.id.as_str())
            || unreadable.contains(seen.id.as_str())
            || forgotten.contains_key(seen.id.as_str())
        {
            continue;
        }
        let l = latest.get(disk.as_str());
        if l.is_some_and(|l| later(&l.manifest.time, &seen.time)) {
            continue; // superseded: a later snapshot of the disk is there
        }
        out.push(Finding::Gone {
            disk: disk.clone(),
            seen: seen.clone(),
            latest: l.map(|l| Seen { id: l.id.clone(), time: l.manifest.time.clone() }),
        });
    }
    for s in snaps {
        if let Some(g) = forgotten.get(s.id.as_str()) {
            out.push(Finding::Back {
                disk: s.manifest.name.clone(),
                id: s.id.clone(),
                time: s.manifest.time.clone(),
                at: g.at.clone(),
                latest: latest.get(s.manifest.name.as_str()).is_some_and(|l| l.id == s.id),
            });
        }
    }
    out
}

/// The record after a listing (pure): each disk's newest is the listing's latest, except
/// for the disks with a finding (kept, so that the next run sees it again) unless
/// `accept`; accepted snapshots that came back are no longer forgotten.
fn follow(r: &mut Record, snaps: &[SnapshotInfo], found: &[Finding], accept: bool) {
    let held: HashSet<&str> = if accept { HashSet::new() } else { found.iter().map(|f| f.disk()).collect() };
    let mut latest: BTreeMap<&str, &SnapshotInfo> = BTreeMap::new();
    for s in snaps {
        latest.insert(s.manifest.name.as_str(), s);
    }
    let forgotten: HashSet<&str> = r.forgotten.iter().map(|g| g.id.as_str()).collect();
    // A disk with no snapshot listed and no finding: its newest was forgotten by this
    // host (no longer followed) or cannot be read (followed still).
    r.disks.retain(|disk, seen| {
        latest.contains_key(disk.as_str())
            || held.contains(disk.as_str())
            || (!accept && !forgotten.contains(seen.id.as_str()))
    });
    for (disk, s) in latest {
        if held.contains(disk) {
            continue;
        }
        if r.disks.len() >= MAX_DISKS && !r.disks.contains_key(disk) {
            log::warn!("this host follows {MAX_DISKS} disks of {} already: {disk} is not followed", r.location);
            continue;
        }
        let keep = r.disks.get(disk).is_some_and(|seen| later(&seen.time, &s.manifest.time) && !accept);
        if !keep {
            r.disks.insert(disk.to_string(), Seen { id: s.id.clone(), time: s.manifest.time.clone() });
        }
    }
    if accept {
        let back: HashSet<&str> = found
            .iter()
            .filter_map(|f| if let Finding::Back { id, .. } = f { Some(id.as_str()) } else { None })
            .collect();
        r.forgotten.retain(|g| !back.contains(g.id.as_str()));
    }
}

/// The record as it was before a listing began ([`Known::before_listing`]).
pub(crate) struct Before(Option<Record>);

/// This host's record of one repository, and what a command does when the store went
/// back. Set on a [`Repository`] ([`Repository::set_known`]), it is told of every listing
/// of the snapshots, of each snapshot a backup commits and of those a forget removes.
pub struct Known {
    root: PathBuf,
    store: DirStore,
    object: String,
    location: String,
    on: OnRollback,
    /// What was said already (a command lists the snapshots more than once).
    said: Mutex<HashSet<String>>,
    /// Whether a listing found the store went back (and it was not accepted).
    went_back: std::sync::atomic::AtomicBool,
}

impl Known {
    /// The record of the repository at `location` in the state directory `root` (made,
    /// 0700, when missing).
    pub fn open(root: &Path, location: &str, on: OnRollback) -> io::Result<Known> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(root)?;
        let mode = std::fs::metadata(root)?.permissions().mode();
        if mode & 0o022 != 0 {
            log::warn!(
                "the state directory {} is writable by other users (mode {:o}): its records of repositories are only \
                 as safe as it is; give ferry its own ({STATE_DIR_ENV}=DIR, a directory only you can write)",
                root.display(),
                mode & 0o7777
            );
        }
        let store = DirStore::open(root)?;
        let object = format!("repositories/{}", hex(&sha256(location.as_bytes())));
        Ok(Known {
            root: root.to_path_buf(),
            store,
            object,
            location: location.into(),
            on,
            said: Mutex::new(HashSet::new()),
            went_back: Default::default(),
        })
    }

    /// The record's file, for messages.
    pub fn path(&self) -> PathBuf {
        self.root.join(&self.object)
    }

    fn say_once(&self, what: String) {
        if self.said.lock().unwrap_or_else(|e| e.into_inner()).insert(what.clone()) {
            log::warn!("{what}");
        }
    }

    /// The record, `None` when there is none yet, or when it cannot be read (said once:
    /// it is made again).
    fn load(&self) -> Option<Record> {
        let bytes = match self.store.get(&self.object, MAX_RECORD) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => {
                self.say_once(format!("cannot read this host's record of {} ({e}): it is made again", self.location));
                return None;
            }
        };
        match Record::parse(&bytes, &self.location) {
            Ok(r) => Some(r),
            Err(why) => {
                self.say_once(format!(
                    "this host's record of {}, {}, is damaged: {why}. It is made again from what the repository holds \
                     now, so a store that went back before now goes unnoticed",
                    self.location,
                    self.path().display()
                ));
                None
            }
        }
    }

    /// `f` on the record, read and (when `f` changed it) written back while this host's
    /// state directory is locked. A record that cannot be written is said once: the
    /// command goes on, unprotected.
    fn with_record<T>(&self, f: impl FnOnce(&mut Option<Record>) -> T) -> T {
        let lock = std::fs::File::open(&self.root).and_then(|d| d.lock().map(|()| d));
        if let Err(e) = &lock {
            self.say_once(format!("cannot lock {} ({e}): its record is updated unlocked", self.root.display()));
        }
        let before = self.load();
        let mut rec = before.clone();
        let out = f(&mut rec);
        if let Some(r) = rec.filter(|r| Some(r) != before.as_ref()) {
            let mut bytes = serde_json::to_vec_pretty(&r).unwrap_or_default();
            bytes.push(b'\n');
            if let Err(e) = self.store.put(&self.object, &bytes) {
                self.say_once(format!(
                    "cannot write this host's record of {} ({e}): a store that goes back is not noticed",
                    self.location
                ));
            }
        }
        drop(lock);
        out
    }

    /// Checks an opened repository against the record, and records it: refuses an
    /// encrypted repository now unencrypted, or with another key.
    pub fn opened(&self, repo: &Repository) -> Result<()> {
        let key = repo.crypto().key_fingerprint().map(|k| hex(&k));
        let id = repo.config().id.clone();
        let loc = &self.location;
        let remove = format!(
            "If you changed it yourself, remove {} (this host's record of it) and run again",
            self.path().display()
        );
        self.with_record(|rec| match rec {
            Some(r) if r.encrypted && key.is_none() => Err(Error::Invalid(format!(
                "{loc} is not encrypted now, but it was{} when this host last used it: someone who can write the store \
                 may have replaced its config, so that ferry would store your disks in plain text, or restore disks \
                 of their choosing. Nothing was read or written. {remove}",
                if r.id == id { "" } else { " (as another repository: its id changed too)" }
            ))),
            Some(r) if r.id == id && r.encrypted && r.key != key => Err(Error::Invalid(format!(
                "{loc} is encrypted with another key than when this host last used it (the same repository id): \
                 someone may have replaced its config. Nothing was read or written. {remove}"
            ))),
            Some(r) if r.id == id => {
                if !r.encrypted && key.is_some() {
                    log::info!("{loc} is encrypted now; it was not when this host last used it");
                    (r.encrypted, r.key) = (true, key.clone());
                }
                Ok(())
            }
            _ => {
                if rec.is_some() {
                    log::info!("{loc} holds another repository than when this host last used it: a new record");
                }
                *rec = Some(Record::new(loc, &id, key.clone()));
                Ok(())
            }
        })
    }

    /// The record as it is before the snapshots are listed: what the listing is held to.
    /// (Compared with the record as it is after, a listing would miss what another
    /// process of this host committed or forgot while it was being read.)
    pub(crate) fn before_listing(&self) -> Before {
        Before(self.load())
    }

    /// Checks a listing of the snapshots (oldest first; `unreadable`: the ids of the
    /// manifests that could not be read) against the record as it was before the listing
    /// began, acts as the command asked ([`OnRollback`]), and records the listing.
    pub(crate) fn listed(&self, before: Before, snaps: &[SnapshotInfo], unreadable: &[String]) -> Result<()> {
        let unreadable: HashSet<&str> = unreadable.iter().map(String::as_str).collect();
        let Some(old) = before.0 else { return Ok(()) };
        let found = findings(&old, snaps, &unreadable);
        self.with_record(|rec| {
            let Some(r) = rec.as_mut().filter(|r| r.id == old.id) else { return Ok(()) };
            let accept = matches!(self.on, OnRollback::Accept);
            let mut refused = Vec::new();
            for f in &found {
                let refuse = match &self.on {
                    OnRollback::Warn | OnRollback::Accept => false,
                    OnRollback::Refuse { disk, back, .. } => {
                        disk.as_deref().is_none_or(|d| d == f.disk())
                            && match f {
                                Finding::Gone { .. } => true,
                                Finding::Back { latest, .. } => *back && *latest,
                            }
                    }
                    OnRollback::Pinned { disk, id } => {
                        matches!(f, Finding::Back { disk: d, id: i, .. } if d == disk && i.starts_with(&id.to_ascii_lowercase()))
                    }
                };
                let what = f.describe(&self.location);
                if refuse {
                    refused.push(what);
                } else if accept {
                    self.say_once(format!("accepted: {what}"));
                } else {
                    let only_reads = matches!(self.on, OnRollback::Warn);
                    self.say_once(format!("{what}{}", if only_reads { "; going on, as this command only reads" } else { "" }));
                }
            }
            if !found.is_empty() && !accept {
                self.went_back.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            follow(r, snaps, &found, accept);
            if refused.is_empty() {
                return Ok(());
            }
            let way_out = match &self.on {
                OnRollback::Refuse { way_out, .. } => way_out.clone(),
                _ => "forget that snapshot again (`ferry repo forget`), or accept the store's state with `ferry backup \
                      --accept-rollback`"
                    .into(),
            };
            Err(Error::Invalid(format!("{}. Refused: {way_out}", refused.join("; "))))
        })
    }

    /// Records a repository this host just made (`ferry repo init`): it replaces whatever
    /// the record held of the location.
    pub fn made(&self, repo: &Repository) {
        let key = repo.crypto().key_fingerprint().map(|k| hex(&k));
        self.with_record(|rec| *rec = Some(Record::new(&self.location, &repo.config().id, key)));
    }

    /// Whether a listing found that the store went back (a disk's newest snapshot gone, a
    /// forgotten one back), unless accepted.
    pub fn went_back(&self) -> bool {
        self.went_back.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records a snapshot this host wrote.
    pub fn committed(&self, snap: &SnapshotInfo) {
        self.with_record(|rec| {
            if let Some(r) = rec.as_mut() {
                let seen = Seen { id: snap.id.clone(), time: snap.manifest.time.clone() };
                r.disks.insert(snap.manifest.name.clone(), seen);
            }
        })
    }

    /// Records the snapshots this host forgot (ids and disks; an empty disk name for a
    /// manifest that could not be read).
    pub fn forgotten(&self, gone: &[(String, String)]) {
        if gone.is_empty() {
            return;
        }
        let at = crate::repo::now_seconds();
        self.with_record(|rec| {
            let Some(r) = rec.as_mut() else { return };
            for (id, name) in gone {
                if name.is_empty() {
                    // A manifest that could not be read: of whichever disk it was the newest.
                    r.disks.retain(|_, s| s.id != *id);
                } else if r.disks.get(name).is_some_and(|s| s.id == *id) {
                    r.disks.remove(name);
                }
                if !r.forgotten.iter().any(|g| g.id == *id) {
                    r.forgotten.push(Gone { id: id.clone(), name: name.clone(), at: at.clone() });
                }
            }
            let over = r.forgotten.len().saturating_sub(MAX_FORGOTTEN);
            r.forgotten.drain(..over);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Changes, Manifest};

    fn id(n: u8) -> String {
        format!("{n:02x}").repeat(32)
    }

    fn snap(n: u8, disk: &str, day: u8) -> SnapshotInfo {
        let m: Manifest = serde_json::from_value(serde_json::json!({
            "version": 1, "name": disk, "time": format!("2026-11-{day:02}T22:00:00Z"), "size": 0,
            "chunk_size": 65536, "page_entries": 256, "pages": [], "parent": null, "source": "x",
            "changes": { "kind": "full" }, "blkhash": null,
            "stats": { "read": 0, "written_chunks": 0, "new_chunks": 0, "new_stored": 0, "zero_chunks": 0 },
            "host": "h", "ferry": "0"
        }))
        .unwrap();
        assert_eq!(m.changes, Changes::Full);
        SnapshotInfo { id: id(n), manifest: m }
    }

    fn rec() -> Record {
        Record::new("/r", &id(200), None)
    }

    #[test]
    fn a_newest_snapshot_gone_is_a_rollback_unless_superseded_forgotten_or_unreadable() {
        let none = HashSet::new();
        let mut r = rec();
        let (s1, s2, s3, t1) = (snap(1, "vm1", 1), snap(2, "vm1", 2), snap(3, "vm1", 3), snap(9, "vm2", 1));
        follow(&mut r, &[s1.clone(), t1.clone(), s2.clone()], &[], false);
        assert_eq!(r.disks["vm1"].id, id(2));
        assert_eq!(r.disks["vm2"].id, id(9));
        // The newest gone: the older one is what the store shows.
        let f = findings(&r, &[s1.clone(), t1.clone()], &none);
        assert!(matches!(&f[..], [Finding::Gone { disk, latest: Some(l), .. }] if disk == "vm1" && l.id == id(1)));
        // Held: the record keeps the newest while the finding stands; vm2 follows.
        follow(&mut r, &[s1.clone(), t1.clone()], &f, false);
        assert_eq!(r.disks["vm1"].id, id(2));
        // Every snapshot of the disk gone.
        assert!(matches!(&findings(&r, std::slice::from_ref(&t1), &none)[..], [Finding::Gone { latest: None, .. }]));
        // Superseded by a later one (another host's backup, then its forget): no finding.
        assert!(findings(&r, &[s1.clone(), t1.clone(), s3.clone()], &none).is_empty());
        // Unreadable (damage, which check reports): no finding either.
        let unreadable = id(2);
        assert!(findings(&r, &[s1.clone(), t1.clone()], &HashSet::from([unreadable.as_str()])).is_empty());
        // Accepted: the record follows the store.
        follow(&mut r, &[s1.clone(), t1.clone()], &f, true);
        assert_eq!(r.disks["vm1"].id, id(1));
        assert!(findings(&r, &[s1.clone(), t1.clone()], &none).is_empty());
    }

    #[test]
    fn a_forgotten_snapshot_back_is_found_until_accepted() {
        let none = HashSet::new();
        let mut r = rec();
        let (s1, s2) = (snap(1, "vm1", 1), snap(2, "vm1", 2));
        follow(&mut r, &[s1.clone(), s2.clone()], &[], false);
        r.forgotten.push(Gone { id: id(1), name: "vm1".into(), at: "2026-11-03T00:00:00Z".into() });
        assert!(findings(&r, std::slice::from_ref(&s2), &none).is_empty());
        let f = findings(&r, &[s1.clone(), s2.clone()], &none);
        assert!(matches!(&f[..], [Finding::Back { id: i, .. }] if *i == id(1)));
        follow(&mut r, &[s1.clone(), s2.clone()], &f, true);
        assert!(r.forgotten.is_empty());
        // This host forgot the newest itself: not a rollback.
        r.forgotten.push(Gone { id: id(2), name: "vm1".into(), at: "2026-11-03T00:00:00Z".into() });
        assert!(findings(&r, std::slice::from_ref(&s1), &none).is_empty());
    }

    #[test]
    fn records_are_checked_when_read() {
        let mut r = rec();
        follow(&mut r, &[snap(1, "vm1", 1)], &[], false);
        let good = serde_json::to_vec(&r).unwrap();
        assert_eq!(Record::parse(&good, "/r").unwrap(), r);
        assert!(Record::parse(&good, "/other").unwrap_err().contains("/r"));
        assert!(Record::parse(b"{", "/r").is_err());
        assert!(Record::parse(&good[..good.len() - 3], "/r").is_err());
        let mut bad = r.clone();
        bad.disks.get_mut("vm1").unwrap().id = "xyz".into();
        assert!(Record::parse(&serde_json::to_vec(&bad).unwrap(), "/r").is_err());
        let mut bad = r.clone();
        bad.encrypted = true;
        assert!(Record::parse(&serde_json::to_vec(&bad).unwrap(), "/r").is_err());
        let mut bad = r.clone();
        bad.version = 2;
        assert!(Record::parse(&serde_json::to_vec(&bad).unwrap(), "/r").is_err());
    }

    fn repo(encrypt: bool) -> Repository {
        let opts = crate::InitOptions {
            encrypt: encrypt
                .then(|| (crate::Passphrase::new(b"words".to_vec()), format::KdfCost { m_kib: 8192, t: 1, p: 1 })),
            ..crate::InitOptions::default()
        };
        Repository::init(std::sync::Arc::new(crate::store::MemStore::new()), &opts).unwrap()
    }

    #[test]
    fn an_encrypted_repository_turned_unencrypted_or_rekeyed_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let k = Known::open(dir.path(), "/r", OnRollback::Warn).unwrap();
        let enc = repo(true);
        k.opened(&enc).unwrap();
        let r = k.load().unwrap();
        assert!(r.encrypted && r.id == enc.config().id);
        assert_eq!(r.key, enc.crypto().key_fingerprint().map(|f| hex(&f)));
        k.opened(&enc).unwrap();
        // Unencrypted now: whatever its id, refused, naming the record to remove.
        let plain = repo(false);
        let e = k.opened(&plain).unwrap_err().to_string();
        assert!(e.contains("not encrypted now") && e.contains(&k.path().display().to_string()), "{e}");
        // The same id, another key.
        k.with_record(|r| r.as_mut().unwrap().key = Some(id(7)));
        let e = k.opened(&enc).unwrap_err().to_string();
        assert!(e.contains("another key"), "{e}");
        // Another encrypted repository at the location (made again): a new record.
        let other = repo(true);
        k.opened(&other).unwrap();
        assert_eq!(k.load().unwrap().id, other.config().id);
        // Made again by this host (`repo init`): whatever was recorded is replaced.
        k.made(&plain);
        k.opened(&plain).unwrap();
        assert!(!k.load().unwrap().encrypted);
        // An unencrypted one made again as another: a new record too.
        let k2 = Known::open(dir.path(), "/r2", OnRollback::Warn).unwrap();
        k2.opened(&plain).unwrap();
        k2.opened(&repo(false)).unwrap();
        assert!(!k2.load().unwrap().encrypted);
    }

    #[test]
    fn records_are_kept_private_and_bounded() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("state/ferry");
        let k = Known::open(&root, "/r", OnRollback::Warn).unwrap();
        assert_eq!(std::fs::metadata(&root).unwrap().permissions().mode() & 0o777, 0o700);
        k.with_record(|r| *r = Some(rec()));
        let gone: Vec<(String, String)> = (0..MAX_FORGOTTEN + 5).map(|i| (format!("{i:064x}"), "vm1".into())).collect();
        k.forgotten(&gone);
        let r = k.load().unwrap();
        assert_eq!(r.forgotten.len(), MAX_FORGOTTEN);
        assert_eq!(std::fs::metadata(k.path()).unwrap().permissions().mode() & 0o777, 0o600);
        // Damaged: not trusted, made again.
        std::fs::write(k.path(), b"{\"version\": 1").unwrap();
        assert!(k.load().is_none());
        std::fs::write(k.path(), vec![b' '; MAX_RECORD as usize + 1]).unwrap();
        assert!(k.load().is_none());
    }
}
