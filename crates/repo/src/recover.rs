//! Recovery: `repair` (index objects rebuilt from the packs' trailers, FORMAT.md §5 and
//! §6; unreadable objects dropped) and `unlock` (stale locks removed, FORMAT.md §8).
use crate::damage::pack_id;
use crate::format::{self, LockKind, PackBlobs};
use crate::repo::{pack_name, par_map, Repository, AAD_TRAILER, FETCH_THREADS};
use crate::store::Store;
use crate::{lock, Error, Result};
use serde::Serialize;
use std::collections::HashSet;
use std::io;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, Default)]
pub struct RepairOptions {
    /// Also remove the manifests and checkpoints that cannot be read.
    pub drop_damaged: bool,
    /// Say what would be done; change nothing (and take no lock).
    pub dry_run: bool,
    /// Wait this long for backups, forgets or a gc to end instead of failing.
    pub wait: Option<Duration>,
}

/// An object and why it is listed.
#[derive(Debug, Clone, Serialize)]
pub struct Named {
    pub object: String,
    pub why: String,
}

/// What `repair` found and did (or, with `dry_run`, would do).
#[derive(Debug, Default, Serialize)]
pub struct RepairReport {
    /// Packs in the store.
    pub packs: usize,
    /// Packs that no readable index object lists, indexed again from their trailers.
    pub packs_indexed: Vec<String>,
    /// Blobs those packs hold.
    pub blobs_indexed: u64,
    /// The index objects written for them.
    pub index_written: Vec<String>,
    /// Index objects that cannot be read, removed once the new ones were stored.
    pub index_removed: Vec<Named>,
    /// Packs in no readable index object whose trailer cannot be read: left as they are.
    pub packs_unreadable: Vec<Named>,
    /// Damage records that cannot be read, removed (`verify` finds the damage again).
    pub damage_removed: Vec<Named>,
    /// Manifests that cannot be read (removed with `drop_damaged`).
    pub manifests: Vec<Named>,
    /// Checkpoints that cannot be read (removed with `drop_damaged`).
    pub checkpoints: Vec<Named>,
    pub dropped: bool,
    pub dry_run: bool,
}

/// The blobs of a pack, from its trailer (read with two ranged reads: the tail, then the
/// trailer); why not, when it cannot be read. `Ok(None)`: the pack went away meanwhile.
fn read_trailer(repo: &Repository, name: &str, len: u64) -> Result<Option<Result<PackBlobs, String>>> {
    let Some(pack) = pack_id(name) else {
        return Ok(Some(Err("its name is not a SHA-256 in hex (not written by ferry)".into())));
    };
    let store_err = |e: io::Error| -> Result<Option<Result<PackBlobs, String>>> {
        match e.kind() {
            io::ErrorKind::NotFound => Ok(None),
            io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData => Ok(Some(Err(e.to_string()))),
            _ => Err(Error::store(format!("cannot read {name} from {}", repo.store.describe()), e)),
        }
    };
    let tail_len = format::PACK_TAIL as u64;
    if len < tail_len {
        return Ok(Some(Err(format!("it is {len} bytes long, too short for a pack"))));
    }
    let tail = match repo.store.get_range(name, len - tail_len, tail_len) {
        Ok(t) => t,
        Err(e) => return store_err(e),
    };
    let tl = match format::parse_pack_tail(&tail, len) {
        Ok(tl) => tl as u64,
        Err(e) => return Ok(Some(Err(format!("its tail is damaged: {e}")))),
    };
    let Some(blobs_len) = len.checked_sub(tail_len + tl) else {
        return Ok(Some(Err("its trailer is longer than the pack".into())));
    };
    let stored = match repo.store.get_range(name, blobs_len, tl) {
        Ok(t) => t,
        Err(e) => return store_err(e),
    };
    let plain = match repo.crypto().open(AAD_TRAILER, &stored) {
        Ok(p) => p,
        Err(e) => return Ok(Some(Err(format!("its trailer is damaged: {e}")))),
    };
    Ok(Some(
        format::parse_trailer(&plain, blobs_len, &repo.limits())
            .map(|blobs| PackBlobs { pack, blobs })
            .map_err(|e| format!("its trailer is damaged: {e}")),
    ))
}

/// Rebuilds the index from the packs (FORMAT.md §5: a pack's trailer lists its blobs):
/// every pack that no readable index object lists gets an index object again; then the
/// index objects that cannot be read are removed (everything they could list that is
/// still in the store is indexed by then). Damage records that cannot be read are
/// removed; manifests and checkpoints that cannot be read are listed, and removed only
/// with `drop_damaged`. Holds the `gc` lock (no backup, forget or gc runs meanwhile);
/// with `dry_run` it takes no lock and changes nothing.
///
/// Crash-safe: new index objects are stored before anything is removed, and a pack
/// indexed twice is no harm (FORMAT.md §6).
pub fn repair(repo: &Repository, opts: &RepairOptions) -> Result<RepairReport> {
    let store = repo.store();
    let _lock = if opts.dry_run { None } else { Some(lock::acquire(store, LockKind::Gc, None, opts.wait)?) };
    let mut report = RepairReport { dry_run: opts.dry_run, dropped: opts.drop_damaged, ..RepairReport::default() };
    let named = |v: crate::repo::Failures| -> Vec<Named> {
        v.into_iter().map(|(object, e)| Named { object, why: e.to_string() }).collect()
    };
    let (objects, bad_index) = repo.index_objects()?;
    let covered: HashSet<String> = objects.iter().flat_map(|(_, ps)| ps.iter().map(|p| pack_name(&p.pack))).collect();
    let listed =
        store.list("data/").map_err(|e| Error::store(format!("cannot list the packs of {}", store.describe()), e))?;
    report.packs = listed.len();
    let mut todo: Vec<(String, u64)> = listed.into_iter().filter(|(n, _)| !covered.contains(n)).collect();
    todo.sort();
    let mut rebuilt: Vec<PackBlobs> = Vec::new();
    for ((name, _), r) in todo.iter().zip(par_map(&todo, FETCH_THREADS, |(n, len)| read_trailer(repo, n, *len))) {
        match r? {
            None => {}
            Some(Ok(p)) => {
                report.blobs_indexed += p.blobs.len() as u64;
                report.packs_indexed.push(name.clone());
                rebuilt.push(p);
            }
            Some(Err(why)) => report.packs_unreadable.push(Named { object: name.clone(), why }),
        }
    }
    let (_, bad_damage) = repo.damage_lenient()?;
    let (_, bad_manifests) = repo.snapshots_lenient()?;
    let (_, bad_checkpoints) = repo.checkpoints_lenient()?;
    report.index_removed = named(bad_index);
    report.damage_removed = named(bad_damage);
    report.manifests = named(bad_manifests);
    report.checkpoints = named(bad_checkpoints);
    if opts.dry_run {
        return Ok(report);
    }
    // New index objects first: a crash after this leaves two listings that agree.
    if !rebuilt.is_empty() {
        report.index_written = repo.put_index(&rebuilt)?.0;
    }
    if let Some(l) = &_lock {
        l.check()?;
    }
    let mut remove: Vec<&Named> = report.index_removed.iter().chain(&report.damage_removed).collect();
    if opts.drop_damaged {
        remove.extend(report.manifests.iter().chain(&report.checkpoints));
    }
    // Never one just written: an index object rebuilt from the same trailers can have the
    // very bytes, and so the name, of the damaged one it replaces (unencrypted).
    let mut gone: Vec<(String, String)> = Vec::new();
    for n in remove.into_iter().filter(|n| !report.index_written.contains(&n.object)) {
        if let Err(e) = delete(store, &n.object) {
            crate::maint::tell_forgotten(repo, &gone);
            return Err(e);
        }
        // A dropped manifest is forgotten by this host (of a disk it cannot tell), so its
        // record does not take it for the store going back.
        if let Some(id) = n.object.strip_prefix("snapshots/") {
            gone.push((id.to_string(), String::new()));
        }
    }
    crate::maint::tell_forgotten(repo, &gone);
    Ok(report)
}

fn delete(store: &Arc<dyn Store>, name: &str) -> Result<()> {
    match store.delete(name) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(Error::store(format!("cannot remove {name} from {}", store.describe()), e))
        }
        _ => Ok(()),
    }
}

/// A lock as `unlock` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct LockShown {
    pub object: String,
    /// `backup`, `forget`, `gc` or `read` (shared); empty for a lock that cannot be read.
    pub kind: String,
    pub host: String,
    pub pid: u32,
    /// When it was taken, and last refreshed (RFC 3339; empty when unreadable).
    pub time: String,
    pub refreshed: String,
    /// Seconds since it was taken, by this host's clock (none when unreadable).
    pub age_secs: Option<u64>,
    /// Why it is stale, or that it is live, or why it cannot be read.
    pub state: String,
}

#[derive(Debug, Default, Serialize)]
pub struct UnlockReport {
    pub removed: Vec<LockShown>,
    pub kept: Vec<LockShown>,
}

/// Removes the stale locks (FORMAT.md §8, as every writer judges them); live locks and
/// locks that cannot be read are kept and listed, unless `force`: then every lock goes
/// (for a holder known to be gone that the rules cannot tell: another host that died
/// less than 30 minutes ago).
pub fn unlock(store: &Arc<dyn Store>, force: bool) -> Result<UnlockReport> {
    let (locks, unreadable) = lock::read_locks(store)?;
    let now = jiff::Timestamp::now();
    let mut report = UnlockReport::default();
    let mut shown: Vec<(LockShown, bool)> = Vec::new();
    for (object, l, stale) in locks {
        let age_secs = crate::repo::parse_time(&l.time).map(|t| now.duration_since(t).as_secs().max(0) as u64);
        let kind = l.what();
        let go = stale.is_some() || force;
        let state = stale.unwrap_or_else(|| "its holder looks alive (not stale)".into());
        shown.push((
            LockShown {
                object,
                kind: kind.into(),
                host: l.host,
                pid: l.pid,
                time: l.time,
                refreshed: l.refreshed,
                age_secs,
                state,
            },
            go,
        ));
    }
    for (object, why) in unreadable {
        let s = LockShown {
            object,
            kind: String::new(),
            host: String::new(),
            pid: 0,
            time: String::new(),
            refreshed: String::new(),
            age_secs: None,
            state: format!("it is not a lock this ferry can read: {why}"),
        };
        shown.push((s, force));
    }
    for (s, go) in shown {
        if go {
            delete(store, &s.object)?;
            report.removed.push(s);
        } else {
            report.kept.push(s);
        }
    }
    Ok(report)
}
