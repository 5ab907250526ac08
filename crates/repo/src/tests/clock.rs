//! Snapshot times: each records its writer's clock, never its parent's, and lists order a
//! snapshot after its parent whatever the clocks said (FORMAT.md §7).
use super::*;
use crate::repo::{sha256, sort_snapshots, AAD_SNAPSHOT};

/// `base` dated `ahead` into the future and stored under its new id (as a host with a
/// clock that far ahead would have written it), with `base` as its parent.
fn plant_future(repo: &Repository, base: &SnapshotInfo, ahead: jiff::SignedDuration) -> SnapshotInfo {
    let pages = repo.pages(base).unwrap();
    let mut m =
        base.manifest.clone().map_pages(|_, _| ((*pages).clone(), crate::format::PackIds(pages.packs().to_vec())));
    m.time = (jiff::Timestamp::now() + ahead).to_string();
    m.parent = Some(base.id.clone());
    let sealed = repo.crypto.seal(AAD_SNAPSHOT, &m.to_bytes());
    let id = crate::format::hex(&sha256(&sealed));
    repo.store.put(&format!("snapshots/{id}"), &sealed).unwrap();
    SnapshotInfo::new(id, m)
}

fn secs(s: &SnapshotInfo) -> i64 {
    crate::repo::parse_time(&s.manifest.time).unwrap().as_second()
}

#[test]
fn a_snapshot_after_a_future_dated_one_records_the_real_time() {
    for encrypt in [false, true] {
        let (_, repo) = new_repo(encrypt);
        let data = disk(20 * CS + 100, 1);
        let s1 = backup(&repo, "d", &data, None);
        let future = plant_future(&repo, &s1, jiff::SignedDuration::from_hours(24 * 365));
        assert!(crate::writer::warn_future_parent("d", &future, jiff::Timestamp::now()));
        assert!(!crate::writer::warn_future_parent("d", &s1, jiff::Timestamp::now()));
        // The latest is the future one; each backup continues the latest.
        let mut chain = vec![s1.clone(), future.clone()];
        for i in 0..3 {
            let base = repo.resolve("d", None).unwrap();
            assert_eq!(base.id, chain.last().unwrap().id, "backup {i} continues the one before");
            let s = backup(&repo, "d", &disk(20 * CS + 100, 2 + i), Some(base));
            let now = jiff::Timestamp::now().as_second();
            assert!((now - 60..=now).contains(&secs(&s)), "the real time, not the parent's: {}", s.manifest.time);
            chain.push(s);
        }
        let listed: Vec<String> = repo.snapshots().unwrap().into_iter().map(|s| s.id).collect();
        let want: Vec<String> = chain.iter().map(|s| s.id.clone()).collect();
        assert_eq!(listed, want, "each after its parent");
        // Retention runs in the repository's order: today's newest first, then the future
        // one (its own day), one a day; the first, the oldest, stays too because counts are
        // left when it comes (restic 0.15 and later).
        let mut newest_first = repo.snapshots().unwrap();
        newest_first.reverse();
        let keep = maint::keep(&newest_first, &Policy { keep_daily: Some(7), ..Policy::default() });
        let kept: Vec<&str> = newest_first.iter().zip(keep).filter(|(_, k)| *k).map(|(s, _)| s.id.as_str()).collect();
        assert_eq!(
            kept,
            [chain[4].id.as_str(), future.id.as_str(), chain[0].id.as_str()],
            "two days: today and the future one, then the oldest"
        );
    }
}

#[test]
fn lists_order_a_snapshot_after_its_parent_whatever_the_times() {
    let t = |s: &str, parent: Option<&str>, time: &str| {
        let mut f = fake(s, time);
        f.manifest.parent = parent.map(String::from);
        f
    };
    let mut snaps = vec![
        t("c", Some("b"), "2026-01-07T00:00:00Z"),
        t("e", Some("a"), "2026-01-20T00:00:00Z"),
        t("b", Some("a"), "2026-01-05T00:00:00Z"),
        t("a", None, "2026-01-10T00:00:00Z"),
        t("d", None, "2026-01-06T00:00:00Z"),
        // Same time as its parent: after it.
        t("0f", Some("e"), "2026-01-20T00:00:00Z"),
        // A parent that is not listed (forgotten): by its own time.
        t("g", Some("gone"), "2026-01-01T00:00:00Z"),
    ];
    sort_snapshots(&mut snaps);
    let order: Vec<&str> = snaps.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(order, ["g", "d", "a", "b", "c", "e", "0f"]);
    // A long chain whose times go backwards is ordered by its parents, in one pass.
    let n = 20_000;
    let mut chain: Vec<SnapshotInfo> = (0..n)
        .map(|i| {
            let time = (jiff::Timestamp::UNIX_EPOCH + jiff::SignedDuration::from_secs(1_000_000 - i)).to_string();
            let parent = (i > 0).then(|| format!("{:08}", i - 1));
            t(&format!("{i:08}"), parent.as_deref(), &time)
        })
        .rev()
        .collect();
    let started = std::time::Instant::now();
    sort_snapshots(&mut chain);
    assert!(chain.iter().enumerate().all(|(i, s)| s.id == format!("{i:08}")));
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "{:?}", started.elapsed());
}
