//! What this host knows of each repository it used, kept between runs: the repository's
//! id, whether it is encrypted and a fingerprint of its key, each disk's newest snapshot
//! this host wrote or saw, and the snapshots this host forgot. With it a command notices
//! a store that went back (docs/safety.md, "What someone who can write the store can
//! do"): a disk's newest snapshot gone with nothing in its place that continues it or
//! comes after it in FORMAT.md §7's order (hosts' clocks differ: raw times are not
//! compared), or there but unreadable (the latest that can be read is then older), a
//! forgotten snapshot back, an encrypted repository turned unencrypted or given another
//! key.
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
    /// `way_out` ends the refusal: what the user can do. With `damaged` (what else the
    /// user can do, may be empty), the disk's newest snapshot this host saw being there
    /// but unreadable is refused too: the latest that can be read is an older one, and a
    /// command that takes the latest would take it (without, it is warned about).
    Refuse { disk: Option<String>, back: bool, way_out: String, damaged: Option<String> },
    /// A snapshot named by id (`REPO::NAME@ID`): refuses only when the snapshot of `disk`
    /// whose id starts with `id` is one this host forgot; warns about the rest.
    Pinned { disk: String, id: String },
    /// The store's state is accepted (`--accept-rollback`): the record follows it.
    Accept,
}

/// A disk's newest snapshot as this host saw it: its id and its order time (FORMAT.md
/// §7: the latest `time` along it and its parents; records written before order times
/// hold the snapshot's own `time`, never later).
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

/// Checks a record given as bytes (its location the first line, the record the rest):
/// what fuzzing drives. Never panics, whatever the bytes; a record taken reads back the
/// same from the JSON it is written as.
pub fn fuzz(data: &[u8]) {
    let (location, bytes) = match data.iter().position(|b| *b == b'\n') {
        Some(i) => (String::from_utf8_lossy(&data[..i]).into_owned(), &data[i + 1..]),
        None => (String::new(), data),
    };
    if let Ok(r) = Record::parse(bytes, &location) {
        let again = serde_json::to_vec(&r).map(|j| Record::parse(&j, &location));
        assert!(matches!(again, Ok(Ok(ref a)) if *a == r), "a record taken does not read back");
    }
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

/// A listing (oldest first, FORMAT.md §7's order) as the record reads it (pure): each
/// snapshot's order time, and each disk's snapshots in that order (the last its latest).
struct Listing<'a> {
    snaps: &'a [SnapshotInfo],
    order: Vec<Option<jiff::Timestamp>>,
    present: HashSet<&'a str>,
    of_disk: BTreeMap<&'a str, Vec<usize>>,
    latest: BTreeMap<&'a str, usize>,
}

impl<'a> Listing<'a> {
    fn new(snaps: &'a [SnapshotInfo]) -> Listing<'a> {
        let order = crate::repo::order_keys(snaps).into_iter().map(|k| k.0).collect();
        let mut of_disk: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, s) in snaps.iter().enumerate() {
            of_disk.entry(s.manifest.name.as_str()).or_default().push(i);
        }
        let latest = of_disk.iter().filter_map(|(d, v)| Some((*d, *v.last()?))).collect();
        Listing { snaps, order, present: snaps.iter().map(|s| s.id.as_str()).collect(), of_disk, latest }
    }

    /// Snapshot `i` as the record keeps it: its id and order time, no earlier than `floor`.
    fn seen(&self, i: usize, floor: Option<&str>) -> Seen {
        let own = self.order[i].or_else(|| parse_time(&self.snaps[i].manifest.time));
        let t = match (own, floor.and_then(parse_time)) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let time = t.map_or_else(|| self.snaps[i].manifest.time.clone(), |t| t.to_string());
        Seen { id: self.snaps[i].id.clone(), time }
    }

    /// The disk's latest, as the record keeps it.
    fn latest(&self, disk: &str) -> Option<Seen> {
        self.latest.get(disk).map(|&i| self.seen(i, None))
    }

    /// What the record keeps as the newest of `disk` after `seen`: the disk's latest
    /// when it is `seen` or descends from it (its parents lead to it), or when it comes
    /// after `seen` in FORMAT.md §7's order (`seen` listed, or the latest's order time
    /// later); else the last snapshot of the disk that descends from `seen`; `None` when
    /// nothing does (`seen` gone, and the store went back). Raw times are not compared:
    /// hosts' clocks differ. One pass: each snapshot comes after its listed parent. What
    /// descends from `seen` keeps its order time at least `seen`'s.
    fn after(&self, disk: &str, seen: &Seen) -> Option<Seen> {
        let mut below: HashSet<&str> = HashSet::new();
        let mut last = None;
        for &i in self.of_disk.get(disk).into_iter().flatten() {
            let s = &self.snaps[i];
            if s.id == seen.id || s.manifest.parent.as_deref().is_some_and(|p| p == seen.id || below.contains(p)) {
                below.insert(&s.id);
                last = Some(i);
            }
        }
        let &l = self.latest.get(disk)?;
        let later = matches!((self.order[l], parse_time(&seen.time)), (Some(a), Some(b)) if a > b);
        if last == Some(l) {
            Some(self.seen(l, Some(&seen.time)))
        } else if later || self.present.contains(seen.id.as_str()) {
            Some(self.seen(l, None))
        } else {
            last.map(|i| self.seen(i, Some(&seen.time)))
        }
    }
}

/// What a listing shows that the record says should not be.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Finding {
    /// The newest snapshot of `disk` this host saw is gone, and no later one is there.
    Gone { disk: String, seen: Seen, latest: Option<Seen> },
    /// A snapshot this host forgot is listed again (`latest`: as its disk's latest).
    Back { disk: String, id: String, time: String, at: String, latest: bool },
    /// The newest snapshot of `disk` this host saw is there but cannot be read, and
    /// nothing listed supersedes it: the latest that can be read is older.
    Damaged { disk: String, seen: Seen, latest: Option<Seen> },
}

impl Finding {
    fn disk(&self) -> &str {
        match self {
            Finding::Gone { disk, .. } | Finding::Back { disk, .. } | Finding::Damaged { disk, .. } => disk,
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
            Finding::Damaged { disk, seen, latest } => format!(
                "{location}: snapshot {} of {disk} ({}), the newest this host wrote or saw, cannot be read (damaged, \
                 or changed by someone who can write the store; `ferry repo check` says why), so {}",
                seen.id,
                when(&seen.time),
                match latest {
                    Some(l) => format!(
                        "the latest snapshot of {disk} that can be read, {} ({}), is an older one",
                        short(&l.id),
                        when(&l.time)
                    ),
                    None => format!("no snapshot of {disk} can be read"),
                }
            ),
        }
    }

    /// Whether it says the store went back (a damaged snapshot is damage, which check
    /// and verify report as such).
    fn went_back(&self) -> bool {
        !matches!(self, Finding::Damaged { .. })
    }
}

/// What `snaps` (oldest first, FORMAT.md §7's order) and the manifests that could not
/// be read (`unreadable`, ids) show against the record (pure).
fn findings(r: &Record, snaps: &[SnapshotInfo], unreadable: &HashSet<&str>) -> Vec<Finding> {
    let list = Listing::new(snaps);
    let forgotten: HashMap<&str, &Gone> = r.forgotten.iter().map(|g| (g.id.as_str(), g)).collect();
    // A snapshot that `ferry repo migrate` made again under a new id is still there.
    let migrated: HashSet<&str> = snaps.iter().filter_map(|s| s.manifest.migrated_from.as_deref()).collect();
    let mut out = Vec::new();
    for (disk, seen) in &r.disks {
        if list.present.contains(seen.id.as_str())
            || migrated.contains(seen.id.as_str())
            || forgotten.contains_key(seen.id.as_str())
        {
            continue;
        }
        if list.after(disk, seen).is_some() {
            continue; // superseded: a snapshot of the disk descends from it, or comes after it
        }
        let (disk, seen, latest) = (disk.clone(), seen.clone(), list.latest(disk));
        out.push(match unreadable.contains(seen.id.as_str()) {
            true => Finding::Damaged { disk, seen, latest },
            false => Finding::Gone { disk, seen, latest },
        });
    }
    for s in snaps {
        if let Some(g) = forgotten.get(s.id.as_str()) {
            out.push(Finding::Back {
                disk: s.manifest.name.clone(),
                id: s.id.clone(),
                time: s.manifest.time.clone(),
                at: g.at.clone(),
                latest: list.latest.get(s.manifest.name.as_str()).is_some_and(|&l| snaps[l].id == s.id),
            });
        }
    }
    out
}

/// The record after a listing (pure): each disk's newest is what supersedes it in the
/// listing ([`Listing::after`]), or the listing's latest for a disk it did not follow,
/// except for the disks with a finding (kept, so that the next run sees it again)
/// unless `accept`; accepted snapshots that came back are no longer forgotten.
fn follow(r: &mut Record, snaps: &[SnapshotInfo], found: &[Finding], accept: bool) {
    let held: HashSet<&str> = if accept { HashSet::new() } else { found.iter().map(|f| f.disk()).collect() };
    let list = Listing::new(snaps);
    let forgotten: HashSet<&str> = r.forgotten.iter().map(|g| g.id.as_str()).collect();
    // A disk with no snapshot listed and no finding: its newest was forgotten by this
    // host (no longer followed) or cannot be read (followed still).
    r.disks.retain(|disk, seen| {
        list.latest.contains_key(disk.as_str())
            || held.contains(disk.as_str())
            || (!accept && !forgotten.contains(seen.id.as_str()))
    });
    for &disk in list.latest.keys() {
        if held.contains(disk) {
            continue;
        }
        if r.disks.len() >= MAX_DISKS && !r.disks.contains_key(disk) {
            log::warn!("this host follows {MAX_DISKS} disks of {} already: {disk} is not followed", r.location);
            continue;
        }
        let next = match r.disks.get(disk) {
            Some(seen) if !accept && !forgotten.contains(seen.id.as_str()) => list.after(disk, seen),
            _ => list.latest(disk),
        };
        if let Some(next) = next {
            r.disks.insert(disk.to_string(), next);
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
    /// The repository as the user wrote it, for the commands messages give.
    shown: String,
    /// What a listing does when the store went back ([`Known::hold_to`] changes it).
    on: Mutex<OnRollback>,
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
            shown: location.into(),
            on: Mutex::new(on),
            said: Mutex::new(HashSet::new()),
            went_back: Default::default(),
        })
    }

    /// The same, with `repo` as the user wrote it for the commands messages give (the
    /// location otherwise).
    pub fn shown_as(mut self, repo: &str) -> Known {
        self.shown = repo.into();
        self
    }

    /// From now on, listings act as `on` says (one opened repository, several disks each
    /// held to its own: `ferry backup libvirt:` refuses a rollback of the disk it backs up).
    pub fn hold_to(&self, on: OnRollback) {
        *self.on.lock().unwrap_or_else(|e| e.into_inner()) = on;
    }

    fn on(&self) -> OnRollback {
        self.on.lock().unwrap_or_else(|e| e.into_inner()).clone()
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
        let on = self.on();
        self.with_record(|rec| {
            let Some(r) = rec.as_mut().filter(|r| r.id == old.id) else { return Ok(()) };
            let accept = matches!(on, OnRollback::Accept);
            let mut refused = Vec::new();
            let mut damaged = Vec::new();
            for f in &found {
                let refuse = match &on {
                    OnRollback::Warn | OnRollback::Accept => false,
                    OnRollback::Refuse { disk, back, damaged: d, .. } => {
                        disk.as_deref().is_none_or(|d| d == f.disk())
                            && match f {
                                Finding::Gone { .. } => true,
                                Finding::Back { latest, .. } => *back && *latest,
                                Finding::Damaged { .. } => d.is_some(),
                            }
                    }
                    OnRollback::Pinned { disk, id } => {
                        matches!(f, Finding::Back { disk: d, id: i, .. } if d == disk && i.starts_with(&id.to_ascii_lowercase()))
                    }
                };
                let what = f.describe(&self.location);
                if let (true, Finding::Damaged { disk, seen, .. }) = (refuse, f) {
                    damaged.push(self.damaged_way_out(&on, what, disk, &seen.id));
                } else if refuse {
                    refused.push(what);
                } else if accept {
                    self.say_once(format!("accepted: {what}"));
                } else if !f.went_back() {
                    // Damage, which check and verify report as such.
                    if !matches!(on, OnRollback::Warn) {
                        self.say_once(format!("{what}; going on, as this command needs nothing from it"));
                    }
                } else {
                    let only_reads = matches!(on, OnRollback::Warn);
                    self.say_once(format!("{what}{}", if only_reads { "; going on, as this command only reads" } else { "" }));
                }
            }
            if found.iter().any(Finding::went_back) && !accept {
                self.went_back.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            follow(r, snaps, &found, accept);
            if refused.is_empty() && damaged.is_empty() {
                return Ok(());
            }
            let way_out = match &on {
                OnRollback::Refuse { way_out, .. } => way_out.clone(),
                _ => "forget that snapshot again (`ferry repo forget`), or accept the store's state with `ferry backup \
                      --accept-rollback`"
                    .into(),
            };
            if !refused.is_empty() {
                damaged.insert(0, format!("{}. Refused: {way_out}", refused.join("; ")));
            }
            Err(Error::Invalid(damaged.join(". Also ")))
        })
    }

    /// The refusal of a command that takes the latest snapshot of `disk` while its newest,
    /// `id`, cannot be read (`what`: the finding, described).
    fn damaged_way_out(&self, on: &OnRollback, what: String, disk: &str, id: &str) -> String {
        let more = match on {
            OnRollback::Refuse { damaged: Some(more), .. } if !more.is_empty() => format!("; {more}"),
            _ => String::new(),
        };
        let repo = &self.shown;
        format!(
            "{what}. Refused, so as not to give an older state of {disk} as its latest: to restore, serve or hash an \
             older snapshot, name it: {repo}::{disk}@ID (`ferry repo list {repo} {disk}` shows the ids){more}. If the \
             damaged snapshot cannot be had back (`ferry repo check {repo}`), `ferry repo forget {repo} {id}` drops \
             it, and this host then takes the latest one left as the latest (another host that saw it as the newest \
             says the store went back until it runs once with --accept-rollback)"
        )
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

    /// Records a snapshot this host wrote: its order time is its own time, or the
    /// recorded newest's when it continues that one and it is later (FORMAT.md §7).
    pub fn committed(&self, snap: &SnapshotInfo) {
        self.with_record(|rec| {
            if let Some(r) = rec.as_mut() {
                let name = &snap.manifest.name;
                let parent = r.disks.get(name).filter(|s| snap.manifest.parent.as_deref() == Some(s.id.as_str()));
                let time = match parent {
                    Some(p) if later(&p.time, &snap.manifest.time) => p.time.clone(),
                    _ => snap.manifest.time.clone(),
                };
                r.disks.insert(name.clone(), Seen { id: snap.id.clone(), time });
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
        SnapshotInfo::new(id(n), m)
    }

    /// Snapshot `n` of `disk` at `time`, continuing `parent`.
    fn snap_at(n: u8, disk: &str, time: &str, parent: Option<u8>) -> SnapshotInfo {
        let mut s = snap(n, disk, 1);
        s.manifest.time = time.into();
        s.manifest.parent = parent.map(id);
        s
    }

    fn sorted(mut snaps: Vec<SnapshotInfo>) -> Vec<SnapshotInfo> {
        crate::repo::sort_snapshots(&mut snaps);
        snaps
    }

    #[test]
    fn snapshots_of_a_host_whose_clock_is_behind_supersede_what_they_continue() {
        let none = HashSet::new();
        let mut r = rec();
        // Host A writes S1 at 12:00; host B, 10 minutes behind, S2 on it at 11:55, then
        // forgets S1.
        let s1 = snap_at(1, "vm1", "2026-11-02T12:00:00Z", None);
        let s2 = snap_at(2, "vm1", "2026-11-02T11:55:00Z", Some(1));
        follow(&mut r, std::slice::from_ref(&s1), &[], false);
        assert_eq!(r.disks["vm1"].id, id(1));
        let now = sorted(vec![s2.clone()]);
        assert!(findings(&r, &now, &none).is_empty());
        follow(&mut r, &now, &[], false);
        // Followed, at S1's order time (S2 comes after S1).
        assert_eq!(r.disks["vm1"], Seen { id: id(2), time: "2026-11-02T12:00:00Z".into() });
        // S2 deleted, S1 put back: the store went back, though S1's time is later than S2's.
        let f = findings(&r, std::slice::from_ref(&s1), &none);
        assert!(matches!(&f[..], [Finding::Gone { seen, .. }] if seen.id == id(2)), "{f:?}");
        // Both listed: S2 is the latest (after its parent), and the record stays.
        let both = sorted(vec![s2.clone(), s1.clone()]);
        assert_eq!(both.last().unwrap().id, id(2));
        assert!(findings(&r, &both, &none).is_empty());
        // A chain: S4 on S3 on S2 on S1, S1 forgotten: superseded by descent along it.
        let mut ra = rec();
        follow(&mut ra, std::slice::from_ref(&s1), &[], false);
        let s3 = snap_at(3, "vm1", "2026-11-02T11:56:00Z", Some(2));
        let s4 = snap_at(4, "vm1", "2026-11-02T11:57:00Z", Some(3));
        let later_ones = sorted(vec![s4.clone(), s3.clone(), s2.clone()]);
        assert!(findings(&ra, &later_ones, &none).is_empty());
        follow(&mut ra, &later_ones, &[], false);
        assert_eq!(ra.disks["vm1"].id, id(4));
        // A snapshot of the disk that does not descend from it and comes before it in the
        // order does not supersede it.
        let mut rb = rec();
        follow(&mut rb, std::slice::from_ref(&s1), &[], false);
        let other = snap_at(5, "vm1", "2026-11-02T11:58:00Z", None);
        assert!(matches!(&findings(&rb, std::slice::from_ref(&other), &none)[..], [Finding::Gone { .. }]));
        // One later in the order does (another host's backup, then its forget).
        let newer = snap_at(6, "vm1", "2026-11-02T12:01:00Z", None);
        assert!(findings(&rb, std::slice::from_ref(&newer), &none).is_empty());
        // Of another disk: no.
        let elsewhere = snap_at(7, "vm2", "2026-11-02T11:55:00Z", Some(1));
        assert!(matches!(&findings(&rb, std::slice::from_ref(&elsewhere), &none)[..], [Finding::Gone { .. }]));
        // A listed newest stays, a listed latest before it in the order is still after it.
        follow(&mut rb, &sorted(vec![s1.clone(), s2.clone()]), &[], false);
        assert_eq!(rb.disks["vm1"].id, id(2));
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
        // Unreadable: damage, but what a command taking the latest would read is older.
        let unreadable = id(2);
        let f = findings(&r, &[s1.clone(), t1.clone()], &HashSet::from([unreadable.as_str()]));
        assert!(matches!(&f[..], [Finding::Damaged { disk, seen, latest: Some(l) }]
            if disk == "vm1" && seen.id == id(2) && l.id == id(1)));
        assert!(!f[0].went_back());
        // Held while it stands.
        let mut held = r.clone();
        follow(&mut held, &[s1.clone(), t1.clone()], &f, false);
        assert_eq!(held.disks["vm1"].id, id(2));
        // An unreadable manifest that is not the newest seen: no finding.
        let old = id(1);
        assert!(findings(&r, &[s2.clone(), t1.clone()], &HashSet::from([old.as_str()])).is_empty());
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
    fn a_repository_opened_once_holds_each_disk_to_its_own_refusal() {
        let dir = tempfile::tempdir().unwrap();
        let k = Known::open(dir.path(), "/r", OnRollback::Warn).unwrap();
        k.opened(&repo(false)).unwrap();
        let (a, b) = (snap(1, "vm-vda", 1), snap(2, "vm-vdb", 1));
        k.listed(k.before_listing(), &[a, b.clone()], &[]).unwrap();
        // vm-vda's newest is gone: a run's listing warns...
        k.listed(k.before_listing(), std::slice::from_ref(&b), &[]).unwrap();
        let refuse = |disk: &str| OnRollback::Refuse {
            disk: Some(disk.into()),
            back: true,
            way_out: "look first".into(),
            damaged: None,
        };
        // ...the backup of vm-vdb goes on, and the one of vm-vda is refused.
        k.hold_to(refuse("vm-vdb"));
        k.listed(k.before_listing(), std::slice::from_ref(&b), &[]).unwrap();
        k.hold_to(refuse("vm-vda"));
        let e = k.listed(k.before_listing(), std::slice::from_ref(&b), &[]).unwrap_err().to_string();
        assert!(e.contains("look first"), "{e}");
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
