//! Metadata contexts read side by side: `base:allocation`, `qemu:dirty-bitmap:NAME`,
//! `qemu:allocation-depth`, from an NBD export or from a local backend (whose
//! [`ferry_backend::all_meta_contexts`] are what a server would offer for it).
//!
//! [`walk`] asks for every selected context at once over large ranges and steps through
//! their answers in lock step: one row per range where no context's value changes, rows
//! with the same values merged. `ferry info --map` prints those rows; `ferry copy
//! --dirty-bitmap` turns them into the ranges it copies.

use super::endpoint::{Kind, Map};
use crate::conn::{ConnectOptions, Connection, Error as ConnError};
use crate::uri::Uri;
use ferry_backend::{Backend, MetaContext};
use ferry_proto::consts::STATE_ZERO;
use ferry_proto::reply::Extent;
use std::sync::Arc;

/// Most extents asked of a local context per call.
const LOCAL_MAX_EXTENTS: usize = 1 << 16;

/// Walks `0..size` in lock step over `n` contexts. `fetch(pos, len)` returns one list of
/// extents per context, in order, each starting at `pos`, none empty, covering at most
/// `len` bytes (longer ones are clipped); the walk goes on from where the shortest list
/// stopped. `row(offset, length, values)` gets each maximal range over which no
/// context's value changes.
pub fn walk(
    size: u64,
    step: u64,
    n: usize,
    mut fetch: impl FnMut(u64, u64) -> Result<Vec<Vec<Extent>>, String>,
    mut row: impl FnMut(u64, u64, &[u32]) -> Result<(), String>,
) -> Result<(), String> {
    let mut pending: Option<(u64, u64, Vec<u32>)> = None;
    let mut pos = 0u64;
    let step = step.max(1);
    let mut values = vec![0u32; n];
    while pos < size {
        let len = (size - pos).min(step);
        let lists = fetch(pos, len)?;
        if lists.len() != n {
            return Err(format!("{} context answers for {n} contexts at offset {pos}", lists.len()));
        }
        // Where the shortest answer ends.
        let mut covered = len;
        for (i, l) in lists.iter().enumerate() {
            if l.iter().any(|e| e.length == 0) {
                return Err(format!("context {i} has a zero-length extent at offset {pos}"));
            }
            let c = l.iter().fold(0u64, |a, e| a.saturating_add(e.length)).min(len);
            covered = covered.min(c);
        }
        if covered == 0 {
            return Err(format!("no extents at offset {pos}"));
        }
        let end = pos + covered;
        let mut idx = vec![0usize; n];
        let mut rem: Vec<u64> = lists.iter().map(|l| l[0].length).collect();
        let mut at = pos;
        while at < end {
            let mut k = end - at;
            for i in 0..n {
                k = k.min(rem[i]);
                values[i] = lists[i][idx[i]].flags;
            }
            match &mut pending {
                Some(p) if p.2 == values && p.0 + p.1 == at => p.1 += k,
                _ => {
                    if let Some((o, l, v)) = pending.take() {
                        row(o, l, &v)?;
                    }
                    pending = Some((at, k, values.clone()));
                }
            }
            at += k;
            for i in 0..n {
                rem[i] -= k;
                if rem[i] == 0 && at < end {
                    idx[i] += 1;
                    // Covered up to `end` at least, so there is a next extent.
                    rem[i] = lists[i].get(idx[i]).map_or(0, |e| e.length);
                    if rem[i] == 0 {
                        return Err(format!("context {i} ran out of extents at offset {at}"));
                    }
                }
            }
        }
        pos = end;
    }
    if let Some((o, l, v)) = pending {
        row(o, l, &v)?;
    }
    Ok(())
}

/// Where contexts are read from.
pub enum ContextReader {
    /// An NBD connection that selected the contexts (`ids` in the order asked).
    Nbd { conn: Box<Connection>, ids: Vec<u32> },
    /// A local backend's contexts, in the order asked.
    Local { contexts: Vec<Arc<dyn MetaContext>>, size: u64 },
}

/// Why contexts cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    #[error("{0}")]
    Connect(ConnError),
    #[error("{what} does not offer the metadata context {name:?}; it offers: {offered}")]
    Missing { what: String, name: String, offered: String },
    #[error("{0}")]
    Read(String),
}

impl ContextReader {
    /// Connects to `uri` selecting `names` (every one must be granted).
    pub fn nbd(uri: &Uri, opts: &ConnectOptions, names: &[String]) -> Result<ContextReader, ContextError> {
        let opts = ConnectOptions { contexts: names.to_vec(), meta_context: true, ..opts.clone() };
        let conn = Connection::connect(uri, &opts).map_err(ContextError::Connect)?;
        match granted_ids(&conn, names) {
            Ok(ids) => Ok(ContextReader::Nbd { conn: Box::new(conn), ids }),
            Err(name) => {
                let _ = conn.disconnect();
                Err(missing(uri, &opts, name))
            }
        }
    }

    /// `names` among `backend`'s contexts; `what` names it in errors.
    pub fn local(backend: &Arc<dyn Backend>, what: &str, names: &[String]) -> Result<ContextReader, ContextError> {
        Ok(ContextReader::Local { contexts: local_contexts(backend, what, names)?, size: backend.size() })
    }

    pub fn size(&self) -> u64 {
        match self {
            ContextReader::Nbd { conn, .. } => conn.size(),
            ContextReader::Local { size, .. } => *size,
        }
    }

    /// [`walk`] over the whole image: rows of (offset, length, one value per context).
    pub fn walk(&mut self, row: impl FnMut(u64, u64, &[u32]) -> Result<(), String>) -> Result<(), ContextError> {
        let size = self.size();
        match self {
            ContextReader::Nbd { conn, ids } => {
                let step = conn.max_status_length();
                walk(size, step, ids.len(), |pos, len| nbd_fetch(conn, ids, pos, len), row)
            }
            ContextReader::Local { contexts, .. } => {
                walk(size, u64::MAX, contexts.len(), |pos, len| local_fetch(contexts, pos, len), row)
            }
        }
        .map_err(ContextError::Read)
    }

    /// Ends an NBD session cleanly.
    pub fn close(self) {
        if let ContextReader::Nbd { conn, .. } = self {
            let _ = conn.disconnect();
        }
    }
}

/// The ids of `names` on `conn`, or the first name the server did not grant.
pub(crate) fn granted_ids(conn: &Connection, names: &[String]) -> Result<Vec<u32>, String> {
    names.iter().map(|n| conn.info().context_id(n).ok_or_else(|| n.clone())).collect()
}

/// The error for a context `uri` did not grant, listing what it offers. Call it after
/// closing the connection: a server taking one client at a time (qemu-nbd) would not
/// answer the listing otherwise.
pub(crate) fn missing(uri: &Uri, opts: &ConnectOptions, name: String) -> ContextError {
    let offered = match Connection::list_contexts(uri, opts) {
        Ok(l) if l.is_empty() => "none".to_string(),
        Ok(l) => l.join(", "),
        Err(e) => format!("(listing them failed: {e})"),
    };
    ContextError::Missing { what: uri.to_string(), name, offered }
}

/// Most separate ranges a selection keeps (24 bytes each).
pub const MAX_SELECTED_RANGES: usize = 1 << 22;

/// Appends a selected range, merging it with the previous one when they touch and are
/// of one kind; more than [`MAX_SELECTED_RANGES`] is an error (a selection cannot be
/// coarsened: what lies between its ranges must not be touched).
pub(crate) fn push_selected(out: &mut Map, pos: u64, length: u64, kind: Kind) -> Result<(), String> {
    match out.last_mut() {
        Some(last) if last.2 == kind && last.0 + last.1 == pos => last.1 += length,
        _ => {
            if out.len() >= MAX_SELECTED_RANGES {
                return Err(format!("more than {MAX_SELECTED_RANGES} separate ranges to copy"));
            }
            out.push((pos, length, kind))
        }
    }
    Ok(())
}

/// The copy plan of a selection: walks `[context]` or `[base:allocation, context]`
/// (`with_base`) and keeps the ranges where the context has a bit of `mask`, as data, or
/// as zeroes where base:allocation says they read as zeroes (never read then).
pub(crate) fn select_map(
    size: u64,
    step: u64,
    with_base: bool,
    mask: u32,
    fetch: impl FnMut(u64, u64) -> Result<Vec<Vec<Extent>>, String>,
) -> Result<Map, String> {
    let mut out = Map::new();
    let n = if with_base { 2 } else { 1 };
    walk(size, step, n, fetch, |pos, len, v| {
        if v[n - 1] & mask == 0 {
            return Ok(());
        }
        let zero = with_base && v[0] & STATE_ZERO != 0;
        push_selected(&mut out, pos, len, if zero { Kind::Zero } else { Kind::Data })
    })?;
    Ok(out)
}

/// `map` (an allocation map covering the source) cut down to `ranges` (sorted, disjoint).
pub(crate) fn restrict(map: &Map, ranges: &[(u64, u64)]) -> Result<Map, String> {
    let mut out = Map::new();
    let mut j = 0;
    for &(s, l) in ranges {
        let e = s.saturating_add(l);
        while j < map.len() && map[j].0 + map[j].1 <= s {
            j += 1;
        }
        let mut k = j;
        while k < map.len() && map[k].0 < e {
            let (a, b) = (s.max(map[k].0), e.min(map[k].0 + map[k].1));
            if a < b {
                push_selected(&mut out, a, b - a, map[k].2)?;
            }
            k += 1;
        }
    }
    Ok(out)
}

/// One BLOCK_STATUS for every selected context, in the order of `ids`.
pub(crate) fn nbd_fetch(conn: &mut Connection, ids: &[u32], pos: u64, len: u64) -> Result<Vec<Vec<Extent>>, String> {
    let mut all = conn.block_status_all(pos, len).map_err(|e| format!("block status at offset {pos}: {e}"))?;
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        match all.iter().position(|c| c.0 == *id) {
            Some(i) => out.push(std::mem::take(&mut all[i].1)),
            None => return Err(format!("block status at offset {pos}: no extents for context {id}")),
        }
    }
    Ok(out)
}

/// Each local context's extents from `pos`.
pub(crate) fn local_fetch(contexts: &[Arc<dyn MetaContext>], pos: u64, len: u64) -> Result<Vec<Vec<Extent>>, String> {
    let mut out = Vec::with_capacity(contexts.len());
    for c in contexts {
        let mut ex = Vec::new();
        c.extents(pos, len, LOCAL_MAX_EXTENTS, &mut ex).map_err(|e| format!("{} at offset {pos}: {e}", c.name()))?;
        if ex.is_empty() {
            return Err(format!("{} reported no extent at offset {pos}", c.name()));
        }
        out.push(ex.into_iter().map(|e| Extent { length: e.length, flags: e.flags }).collect());
    }
    Ok(out)
}

/// `names` among `backend`'s metadata contexts, in that order; `what` names the backend
/// in errors.
pub(crate) fn local_contexts(
    backend: &Arc<dyn Backend>,
    what: &str,
    names: &[String],
) -> Result<Vec<Arc<dyn MetaContext>>, ContextError> {
    let all = ferry_backend::all_meta_contexts(backend);
    let mut contexts = Vec::new();
    for n in names {
        match all.iter().find(|c| c.name() == n) {
            Some(c) => contexts.push(c.clone()),
            None => {
                return Err(ContextError::Missing {
                    what: what.to_string(),
                    name: n.clone(),
                    offered: all.iter().map(|c| c.name().to_string()).collect::<Vec<_>>().join(", "),
                })
            }
        }
    }
    Ok(contexts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(v: &[(u64, u32)]) -> Vec<Extent> {
        v.iter().map(|&(length, flags)| Extent { length, flags }).collect()
    }

    fn rows(size: u64, step: u64, a: &[(u64, u32)], b: &[(u64, u32)]) -> Result<Vec<(u64, u64, Vec<u32>)>, String> {
        // Two contexts over a fixed layout; each fetch answers from `pos`, the second in
        // pieces of at most 3 extents.
        let layout = |l: &[(u64, u32)], pos: u64, len: u64, max: usize| {
            let mut out = Vec::new();
            let mut at = 0;
            for &(n, f) in l {
                let (s, e) = (at, at + n);
                at = e;
                if e <= pos || s >= pos + len {
                    continue;
                }
                let s = s.max(pos);
                out.push(Extent { length: e.min(pos + len) - s, flags: f });
                if out.len() == max {
                    break;
                }
            }
            out
        };
        let mut out = Vec::new();
        walk(
            size,
            step,
            2,
            |pos, len| Ok(vec![layout(a, pos, len, usize::MAX), layout(b, pos, len, 3)]),
            |o, l, v| {
                out.push((o, l, v.to_vec()));
                Ok(())
            },
        )?;
        Ok(out)
    }

    #[test]
    fn lock_step_rows_split_where_any_context_changes_and_merge_otherwise() {
        let a = [(10, 0), (10, 3), (20, 0)];
        let b = [(5, 0), (5, 0), (5, 1), (5, 1), (5, 1), (15, 0)];
        let r = rows(40, 16, &a, &b).unwrap();
        assert_eq!(r, vec![(0, 10, vec![0, 0]), (10, 10, vec![3, 1]), (20, 5, vec![0, 1]), (25, 15, vec![0, 0])]);
        assert_eq!(r.iter().map(|r| r.1).sum::<u64>(), 40);
    }

    #[test]
    fn selections_keep_only_marked_ranges_with_their_kind() {
        // base: data 0..20, zero 20..40; bitmap: dirty 10..30.
        let fetch = |pos: u64, len: u64| {
            let cut = |l: &[(u64, u64, u32)]| {
                l.iter()
                    .filter(|x| x.1 > pos && x.0 < pos + len)
                    .map(|x| Extent { length: x.1.min(pos + len) - x.0.max(pos), flags: x.2 })
                    .collect::<Vec<_>>()
            };
            Ok(vec![cut(&[(0, 20, 0), (20, 40, 3)]), cut(&[(0, 10, 0), (10, 30, 1), (30, 40, 0)])])
        };
        let m = select_map(40, 7, true, 1, fetch).unwrap();
        assert_eq!(m, vec![(10, 10, Kind::Data), (20, 10, Kind::Zero)]);
        let map: Map = vec![(0, 20, Kind::Data), (20, 20, Kind::Zero)];
        assert_eq!(
            restrict(&map, &[(5, 5), (15, 10), (39, 1)]).unwrap(),
            vec![(5, 5, Kind::Data), (15, 5, Kind::Data), (20, 5, Kind::Zero), (39, 1, Kind::Zero)]
        );
        assert_eq!(restrict(&map, &[]).unwrap(), vec![]);
    }

    #[test]
    fn bad_answers_are_errors_not_hangs() {
        assert!(walk(10, 10, 1, |_, _| Ok(vec![vec![]]), |_, _, _| Ok(())).is_err());
        assert!(walk(10, 10, 1, |_, _| Ok(vec![ex(&[(0, 0)])]), |_, _, _| Ok(())).is_err());
        assert!(walk(10, 10, 2, |_, _| Ok(vec![ex(&[(10, 0)])]), |_, _, _| Ok(())).is_err());
        // Over-long answers are clipped to the image.
        let mut n = 0;
        walk(
            10,
            4,
            1,
            |_, _| Ok(vec![ex(&[(100, 1)])]),
            |_, l, _| {
                n += l;
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(n, 10);
    }
}
