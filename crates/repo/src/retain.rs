//! Retention rules (`ferry repo forget --keep-*`): which snapshots of one disk a policy
//! keeps, and why. Pure: snapshots, the policy, a time zone and the time now in, one list
//! of reasons per snapshot out (an empty list: removed).
//!
//! The rules are restic's (`restic forget`), so that a policy written for restic keeps the
//! same snapshots here:
//! - the disk's latest snapshot (the repository's order, FORMAT.md §7: the one a restore
//!   takes) is always kept, whatever the clocks said;
//! - the snapshots are taken newest first by their times (a stable sort: a disk's list is in
//!   parent order, which a wrong clock can contradict); `--keep-last N` keeps the N newest;
//! - `--keep-hourly/daily/weekly/monthly/yearly N` keep the newest snapshot of each of the
//!   N latest hours (days, ISO weeks, months, years) that have one, the calendar read in
//!   the local time zone; while such a rule still has a count left when the oldest
//!   snapshot comes, the oldest is kept too (restic 0.15 and later: the longest history
//!   the counts allow);
//! - `--keep-within 1y2m3d4h` keeps every snapshot newer than that span before the
//!   newest snapshot that is not in the future (before now; when every snapshot is in the
//!   future, every one is within, as restic): years, months and days
//!   are taken off the calendar date (a day that does not exist rolls over, as Go's
//!   `AddDate` does: March 31 less one month is March 3, or 2 in a leap year), hours off
//!   the instant;
//! - `--keep-tag T` keeps every snapshot that has tag T (`T1,T2`: all of them);
//! - ferry's own: a protected snapshot (`ferry repo protect`) is always kept, and one
//!   whose time cannot be read is kept.
//!
//! restic files a snapshot under the time zone it was taken in (its time records the
//! writer's offset); ferry's manifests record UTC, so ferry files them under the time
//! zone of the host that runs forget (`TZ`, else the system's): the same as restic's
//! whenever backups and forget run in one zone.

use crate::repo::{parse_time, Repository, SnapshotInfo};
use crate::{Error, Result};
use jiff::civil::{Date, DateTime};
use jiff::tz::TimeZone;
use jiff::{SignedDuration, Timestamp};
use std::collections::HashSet;
use std::fmt;

/// A retention policy; `None` rules are not given.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    pub keep_last: Option<u32>,
    pub keep_hourly: Option<u32>,
    pub keep_daily: Option<u32>,
    pub keep_weekly: Option<u32>,
    pub keep_monthly: Option<u32>,
    pub keep_yearly: Option<u32>,
    pub keep_within: Option<Within>,
    /// Tag lists: a snapshot that has every tag of one of them is kept.
    pub keep_tags: Vec<Vec<String>>,
}

impl Policy {
    /// No rule given (then forget keeps everything).
    pub fn is_empty(&self) -> bool {
        self.counts().iter().all(|(n, _)| n.is_none()) && self.keep_within.is_none() && self.keep_tags.is_empty()
    }

    /// Whether every rule given would keep nothing: counts of 0 only (a span or a tag keeps
    /// what it names).
    pub fn keeps_nothing(&self) -> bool {
        !self.is_empty()
            && self.keep_within.as_ref().is_none_or(Within::is_zero)
            && self.keep_tags.is_empty()
            && self.counts().iter().all(|(n, _)| n.is_none_or(|n| n == 0))
    }

    fn counts(&self) -> [(Option<u32>, Bucket); 6] {
        [
            (self.keep_last, Bucket::Last),
            (self.keep_hourly, Bucket::Hour),
            (self.keep_daily, Bucket::Day),
            (self.keep_weekly, Bucket::Week),
            (self.keep_monthly, Bucket::Month),
            (self.keep_yearly, Bucket::Year),
        ]
    }
}

/// A span of calendar time, as restic writes it: `1y2m3d4h` (each part optional, in any
/// order, at least one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Within {
    pub years: u32,
    pub months: u32,
    pub days: u32,
    pub hours: u32,
}

/// The longest number a part of a span may have (a million years is more than enough).
const MAX_PART: u32 = 1_000_000;

impl Within {
    /// Parses `1y2m3d4h`.
    pub fn parse(s: &str) -> Result<Within> {
        let bad = |why: &str| {
            Error::Invalid(format!(
                "{s:?} is not a span of time ({why}): write numbers each followed by y (years), m (months), d (days) \
                 or h (hours), e.g. 1y2m3d4h or 7d"
            ))
        };
        let mut w = Within::default();
        let mut num: Option<u32> = None;
        for c in s.chars() {
            if let Some(d) = c.to_digit(10) {
                let n = num.unwrap_or(0).checked_mul(10).and_then(|n| n.checked_add(d)).filter(|n| *n <= MAX_PART);
                num = Some(n.ok_or_else(|| bad(&format!("a number above {MAX_PART}")))?);
                continue;
            }
            let n = num.take().ok_or_else(|| bad(&format!("{c:?} without a number before it")))?;
            let part = match c {
                'y' => &mut w.years,
                'm' => &mut w.months,
                'd' => &mut w.days,
                'h' => &mut w.hours,
                _ => return Err(bad(&format!("unknown unit {c:?}"))),
            };
            *part = part.saturating_add(n).min(MAX_PART);
        }
        if num.is_some() {
            return Err(bad("a number without a unit"));
        }
        if s.is_empty() {
            return Err(bad("empty"));
        }
        Ok(w)
    }

    pub fn is_zero(&self) -> bool {
        *self == Within::default()
    }

    /// `t` less this span, in `tz`: years, months and days off its calendar date (rolled
    /// over as Go's `AddDate`), then hours off the instant. `None` past the calendar's range.
    fn before(&self, t: Timestamp, tz: &TimeZone) -> Option<Timestamp> {
        let local = t.to_zoned(tz.clone()).datetime();
        // Months counted from year 0, so that the year and month roll over together.
        let months = i64::from(local.year()) * 12 + i64::from(local.month())
            - 1
            - i64::from(self.years) * 12
            - i64::from(self.months);
        let year = i16::try_from(months.div_euclid(12)).ok()?;
        let month = (months.rem_euclid(12) + 1) as i8;
        // Day 1 of that month, then the days: a day past the month's end rolls over.
        let first = Date::new(year, month, 1).ok()?;
        let days = i64::from(local.day()) - 1 - i64::from(self.days);
        let date = first.checked_add(jiff::Span::new().try_days(days).ok()?).ok()?;
        let dt = DateTime::from_parts(date, local.time());
        let at = dt.to_zoned(tz.clone()).ok()?.timestamp();
        at.checked_sub(SignedDuration::from_hours(i64::from(self.hours))).ok()
    }
}

impl fmt::Display for Within {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, unit) in [(self.years, 'y'), (self.months, 'm'), (self.days, 'd'), (self.hours, 'h')] {
            if n != 0 {
                write!(f, "{n}{unit}")?;
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bucket {
    Last,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Bucket {
    fn reason(self) -> &'static str {
        match self {
            Bucket::Last => "last snapshot",
            Bucket::Hour => "hourly snapshot",
            Bucket::Day => "daily snapshot",
            Bucket::Week => "weekly snapshot",
            Bucket::Month => "monthly snapshot",
            Bucket::Year => "yearly snapshot",
        }
    }

    /// The bucket of the `nr`th snapshot (newest first), at local time `t`.
    fn key(self, t: DateTime, nr: usize) -> i64 {
        let (y, m, d, h) = (i64::from(t.year()), i64::from(t.month()), i64::from(t.day()), i64::from(t.hour()));
        match self {
            Bucket::Last => nr as i64,
            Bucket::Hour => ((y * 100 + m) * 100 + d) * 100 + h,
            Bucket::Day => (y * 100 + m) * 100 + d,
            Bucket::Week => {
                let w = t.date().iso_week_date();
                i64::from(w.year()) * 100 + i64::from(w.week())
            }
            Bucket::Month => y * 100 + m,
            Bucket::Year => y,
        }
    }
}

/// Why each of one disk's snapshots is kept under `policy`: an empty list for a snapshot it
/// removes, in the order given: newest first in the repository's order (FORMAT.md §7).
/// The first (the disk's latest) is always kept; the rules run over them as restic's do,
/// newest first by time, each filed under its own time, and a bucket counts once. `protected` are the ids `ferry repo protect` marked; `tz`
/// the zone the calendar is read in; `now` bounds the newest snapshot `keep_within` counts
/// from (one in the future is not it).
pub fn reasons(
    snaps: &[SnapshotInfo],
    policy: &Policy,
    protected: &HashSet<String>,
    tz: &TimeZone,
    now: Timestamp,
) -> Vec<Vec<String>> {
    let times: Vec<Option<Timestamp>> = snaps.iter().map(|s| parse_time(&s.manifest.time)).collect();
    let mut out: Vec<Vec<String>> = vec![Vec::new(); snaps.len()];
    for (i, s) in snaps.iter().enumerate() {
        if is_protected(protected, s) {
            out[i].push("protected".into());
        }
    }
    if policy.is_empty() {
        out.iter_mut().for_each(|r| r.push("policy is empty".into()));
        return out;
    }
    let latest = times.iter().flatten().filter(|t| **t < now).max().copied();
    // `None` inside: a span that reaches past the calendar, or no snapshot before now (all
    // in the future: restic then counts every snapshot as within).
    let since = match &policy.keep_within {
        Some(w) if !w.is_zero() => Some((w, latest.and_then(|l| w.before(l, tz)))),
        _ => None,
    };
    let mut buckets: Vec<(u32, Bucket, HashSet<i64>)> =
        policy.counts().iter().filter_map(|(n, b)| n.filter(|n| *n > 0).map(|n| (n, *b, HashSet::new()))).collect();
    // The rules run as restic's do: newest first by time (a stable sort of the order given,
    // so snapshots of one time stay in the repository's order). Each snapshot is filed
    // under its own time, and a bucket counts once. The disk's latest in the repository's
    // order (FORMAT.md §7: the one a restore takes) is kept below whatever the clocks said.
    let mut order: Vec<usize> = (0..snaps.len()).collect();
    order.sort_by(|&a, &b| times[b].cmp(&times[a]));
    let last = order.iter().rposition(|&i| times[i].is_some());
    for (nr, &i) in order.iter().enumerate() {
        let s = &snaps[i];
        let r = &mut out[i];
        let Some(t) = times[i] else {
            r.push("its time cannot be read".into());
            continue;
        };
        for tags in &policy.keep_tags {
            if tags.iter().all(|t| s.manifest.tags.contains(t)) {
                r.push(format!("tag {}", tags.join(",")));
            }
        }
        if let Some((w, since)) = &since {
            // A span reaching past the calendar, or one counted from no snapshot, keeps everything.
            if since.is_none_or(|since| t > since) {
                r.push(format!("within {w}"));
            }
        }
        let local = t.to_zoned(tz.clone()).datetime();
        for (count, bucket, seen) in buckets.iter_mut() {
            if *count == 0 {
                continue;
            }
            let key = bucket.key(local, nr);
            if seen.insert(key) || Some(nr) == last {
                *count -= 1;
                r.push(bucket.reason().into());
            }
        }
    }
    // The disk's latest snapshot is always kept: a host whose clock was behind may have
    // dated it before others, and forgetting it would lose the newest data.
    if let Some(r) = out.first_mut().filter(|r| r.is_empty()) {
        r.push(LATEST.into());
    }
    out
}

/// Why the disk's latest snapshot is kept when no rule keeps it ([`reasons`]).
pub const LATEST: &str = "the disk's latest snapshot";

/// Which of one disk's snapshots (newest first) `policy` keeps, the calendar in UTC and
/// nothing protected (see [`reasons`]).
pub fn keep(snaps: &[SnapshotInfo], policy: &Policy) -> Vec<bool> {
    reasons(snaps, policy, &HashSet::new(), &TimeZone::UTC, Timestamp::now()).iter().map(|r| !r.is_empty()).collect()
}

/// The time zone retention reads the calendar in: `TZ`, else the system's, else UTC.
pub fn local_zone() -> TimeZone {
    TimeZone::try_system().unwrap_or(TimeZone::UTC)
}

/// Where the mark of a protected snapshot is (FORMAT.md "Protected snapshots").
pub(crate) const PROTECTED: &str = "protected/";

/// The ids of the protected snapshots: the names under `protected/` that are snapshot ids
/// (anything else there is not a mark, and is ignored). Only names are read: no object
/// content is parsed.
pub fn protected(repo: &Repository) -> Result<HashSet<String>> {
    let names = repo
        .store
        .list(PROTECTED)
        .map_err(|e| Error::store(format!("cannot list {PROTECTED} in {}", repo.store.describe()), e))?;
    Ok(names
        .into_iter()
        .filter_map(|(n, _)| n.strip_prefix(PROTECTED).map(str::to_string))
        .filter(|id| id.len() == 64 && id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        .collect())
}

/// Whether snapshot `s` is protected, given the ids [`protected`] read: its own mark, or
/// the mark of the manifest it was migrated from (a migrate moves the mark, and one
/// stopped between storing the new manifest and moving the mark leaves the old one).
pub fn is_protected(protected: &HashSet<String>, s: &SnapshotInfo) -> bool {
    protected.contains(&s.id) || s.manifest.migrated_from.as_ref().is_some_and(|old| protected.contains(old))
}

/// Marks snapshot `snap` protected (`protect`) or removes its mark; true when that changed
/// anything. The mark is an object named after the id, holding the id and the time it was
/// made (for people: no reader parses it). It holds the forget lock meanwhile (waiting up
/// to `wait` for it), so a forget never removes a snapshot protected before it began. A
/// snapshot protected by the mark of the id it was migrated from (a migrate stopped before
/// moving the mark, [`is_protected`]) is protected already, and unprotecting it removes
/// that mark too.
pub fn set_protected(
    repo: &Repository,
    snap: &SnapshotInfo,
    protect: bool,
    wait: Option<std::time::Duration>,
) -> Result<bool> {
    let lock = crate::lock::acquire(&repo.store, crate::format::LockKind::Forget, None, wait)?;
    let id = &snap.id;
    let marks = protected(repo)?;
    let describe = repo.store.describe();
    match (protect, is_protected(&marks, snap)) {
        (true, false) => {
            // A forget that ran between the caller's resolving the id and this lock may have
            // removed the snapshot: a mark of it would protect nothing.
            let manifest = format!("snapshots/{id}");
            match repo.store.len(&manifest) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(Error::NotFound(format!(
                        "snapshot {id} is no longer in {describe} (a forget removed it): nothing to protect"
                    )))
                }
                Err(e) => return Err(Error::store(format!("cannot read {manifest} in {describe}"), e)),
            }
            lock.check()?;
            let object = format!("{PROTECTED}{id}");
            let body = format!("{id} protected at {}\n", crate::repo::now_seconds());
            repo.store
                .put(&object, body.as_bytes())
                .map_err(|e| Error::store(format!("cannot write {object} in {describe}"), e))?;
        }
        (false, true) => {
            for old in std::iter::once(id).chain(snap.manifest.migrated_from.as_ref()).filter(|m| marks.contains(*m)) {
                let object = format!("{PROTECTED}{old}");
                lock.check()?;
                repo.store
                    .delete(&object)
                    .map_err(|e| Error::store(format!("cannot remove {object} from {describe}"), e))?;
            }
        }
        _ => return Ok(false),
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_parse_as_restic_writes_them() {
        let w = Within::parse("1y2m3d4h").unwrap();
        assert_eq!(w, Within { years: 1, months: 2, days: 3, hours: 4 });
        assert_eq!(w.to_string(), "1y2m3d4h");
        assert_eq!(Within::parse("7d").unwrap().to_string(), "7d");
        assert_eq!(Within::parse("2d3d").unwrap().days, 5);
        for bad in ["", "7", "d", "1w", "1y-2d", "99999999999d", " 1d"] {
            assert!(Within::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_span_rolls_over_as_go_adddate() {
        let tz = TimeZone::UTC;
        let t = |s: &str| s.parse::<Timestamp>().unwrap();
        let m1 = Within { months: 1, ..Within::default() };
        // March 31 less a month: "February 31", which is March 3 (2026) or 2 (2024).
        assert_eq!(m1.before(t("2026-03-31T10:00:00Z"), &tz), Some(t("2026-03-03T10:00:00Z")));
        assert_eq!(m1.before(t("2024-03-31T10:00:00Z"), &tz), Some(t("2024-03-02T10:00:00Z")));
        let y1 = Within { years: 1, days: 40, hours: 5, ..Within::default() };
        assert_eq!(y1.before(t("2026-01-10T10:00:00Z"), &tz), Some(t("2024-12-01T05:00:00Z")));
    }
}
