//! check and verify hold bounded memory however much damage there is (issue 35): every
//! damaged copy verify finds is recorded, through a sorter on disk, in as many damage
//! objects as it needs (each below the limit), the same whatever the number of threads;
//! a later backup stores every damaged chunk again; check counts every recorded chunk
//! with no good copy.
use super::*;
use crate::damage::{PartWriter, DAMAGE_PART_BYTES, DAMAGE_PART_BYTES_SHIPPED};
use crate::format::{self, Digest};
use crate::maint::{Held, DAMAGE_HELD};
use std::collections::HashSet;

/// Damaged copies: (pack, blob id).
type Copies = HashSet<(Digest, Digest)>;
/// Packs as stored: name and bytes.
type Packs = Vec<(String, Vec<u8>)>;

/// A copy of every object of `store`, opened.
fn copy(store: &MemStore) -> (Arc<MemStore>, Arc<Repository>) {
    let to = Arc::new(MemStore::new());
    for (name, _) in store.list("").unwrap() {
        to.put(&name, &store.get(&name, u64::MAX).unwrap()).unwrap();
    }
    let repo = Repository::open(to.clone(), &|| Ok(crate::Passphrase::new(b"secret words".to_vec()))).unwrap();
    (to, Arc::new(repo))
}

/// Damages every data blob copy in the store (a byte flipped in its middle): the
/// (pack, blob id) of each.
fn damage_every_chunk(mem: &MemStore, repo: &Repository) -> Copies {
    damage_chunks(mem, repo, |_| true)
}

/// Damages the data blob copies of each pack whose place in the pack `which` accepts.
fn damage_chunks(mem: &MemStore, repo: &Repository, which: impl Fn(usize) -> bool) -> Copies {
    let mut copies = HashSet::new();
    let (objects, _) = repo.index_objects().unwrap();
    for p in objects.iter().flat_map(|(_, ps)| ps) {
        let data: Vec<&crate::format::BlobEntry> = p
            .blobs
            .iter()
            .filter(|b| !b.kind.is_page())
            .enumerate()
            .filter(|(i, _)| which(*i))
            .map(|(_, b)| b)
            .collect();
        copies.extend(data.iter().map(|b| (p.pack, b.id)));
        mem.tamper(&crate::repo::pack_name(&p.pack), |v| {
            for b in &data {
                v[(b.offset + b.stored_len / 2) as usize] ^= 0xa5;
            }
        });
    }
    copies
}

/// Every damaged copy the records name, and the record objects with their sizes.
fn recorded(store: &MemStore, repo: &Repository) -> (Copies, Vec<(String, u64)>) {
    let set = repo.damage().unwrap();
    let copies = set.packs.iter().flat_map(|(p, c)| c.blobs.iter().map(|b| (*p, *b))).collect();
    (copies, store.list("damage/").unwrap())
}

/// A report as text, less the names of the damage objects verify writes (new each time).
fn text(r: &maint::Report) -> String {
    let notes: Vec<&String> = r.notes.iter().filter(|n| !n.starts_with("the damage is recorded in")).collect();
    let t = format!("{} {} {} {:?} {notes:?}", r.packs, r.blobs_checked, r.bytes_read, r.problems);
    // The time a record was made (two runs compared may fall in two seconds) left out.
    let mark = "recorded damaged by `ferry repo verify` at ";
    let mut out = String::new();
    let mut rest = t.as_str();
    while let Some(i) = rest.find(mark) {
        out.push_str(&rest[..i + mark.len()]);
        rest = &rest[i + mark.len()..];
        rest = rest.find(':').and_then(|c| rest[c..].find('Z').map(|z| &rest[c + z + 1..])).unwrap_or(rest);
        out.push_str("TIME");
    }
    out.push_str(rest);
    out
}

/// A disk of some hundred chunks backed up once, then every chunk damaged.
fn damaged_repo() -> (Arc<MemStore>, Arc<Repository>, Vec<u8>, Copies) {
    let (store, repo) = new_repo(true);
    let data = disk(8 << 20, 35);
    backup(&repo, "d", &data, None);
    let copies = damage_every_chunk(&store, &repo);
    assert!(copies.len() > 80, "{} copies", copies.len());
    (store, repo, data, copies)
}

/// Every damaged copy is recorded, split over several damage objects each at most a
/// part (main stored one object of them all, over a part, and at the shipped part size
/// over the limit, so none); a second verify finds them recorded and writes nothing;
/// repair keeps them; a later backup of the same data stores every damaged chunk again.
#[test]
fn every_damaged_copy_is_recorded_in_parts_and_stored_again_by_the_next_backup() {
    let (store, repo, data, copies) = damaged_repo();
    let v = maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    assert!(!v.problems.is_empty());
    let (got, objects) = recorded(&store, &repo);
    assert_eq!(got, copies, "every damaged copy recorded");
    assert!(objects.len() > 2, "{objects:?}");
    for (name, len) in &objects {
        // The part's JSON, sealed (nonce and tag).
        assert!(*len as usize <= DAMAGE_PART_BYTES + 64, "{name}: {len} bytes");
    }
    let note = v.notes.iter().find(|n| n.starts_with("the damage is recorded in")).unwrap();
    assert!(note.contains(&format!("and {} more object(s) of the same record", objects.len() - 1)), "{note}");
    // A second verify finds every copy recorded: it writes nothing, says the same.
    let again = maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    assert_eq!(recorded(&store, &repo), (copies.clone(), objects.clone()));
    assert!(!again.notes.iter().any(|n| n.starts_with("the damage")), "{:?}", again.notes);
    // repair reads each part (all readable): it removes none.
    let rep = crate::recover::repair(&repo, &crate::recover::RepairOptions::default()).unwrap();
    assert!(rep.damage_removed.is_empty(), "{:?}", rep.damage_removed);
    assert_eq!(recorded(&store, &repo).1, objects);
    // A backup of the same data stores each damaged chunk again: two copies of each.
    let fresh = backup(&repo, "d", &data, None);
    let index = repo.load_index().unwrap();
    let ids: HashSet<Digest> = copies.iter().map(|(_, id)| *id).collect();
    for id in &ids {
        assert_eq!(index.locations(id).count(), 2, "{} stored again", format::hex(id));
    }
    assert_eq!(read_back(&repo, &fresh), data);
    // And check finds every recorded chunk with a good copy now: notes, no problem.
    let c = maint::check(&repo).unwrap();
    assert!(c.problems.is_empty(), "{:?}", c.problems);
}

/// Damage found in packs whose record a verify wrote already (more of their copies
/// damaged since) is added to it: every copy recorded, past any number a record held
/// before (the reverted caps kept a pack's first ids every run, and backups went on
/// using the damaged copies past them).
#[test]
fn a_later_verify_records_the_copies_a_record_does_not_list_yet() {
    // Encrypted: a pack stored again is a new pack (an unencrypted one of the same chunks
    // in the same order has the same bytes, so the same name: it mends the damaged one).
    let (store, repo) = new_repo(true);
    let data = disk(8 << 20, 36);
    let snap = backup(&repo, "d", &data, None);
    let first = damage_chunks(&store, &repo, |i| i % 2 == 0);
    maint::verify(&repo, &VerifyOptions::all(3)).unwrap();
    assert_eq!(recorded(&store, &repo).0, first);
    let second = damage_chunks(&store, &repo, |i| i % 2 == 1);
    assert!(!second.is_empty() && second.is_disjoint(&first));
    let v = maint::verify(&repo, &VerifyOptions::all(3)).unwrap();
    let all: Copies = first.union(&second).copied().collect();
    let (got, objects) = recorded(&store, &repo);
    assert_eq!(got, all, "{:?}", v.notes);
    assert!(objects.len() > 2 && objects.iter().all(|(_, len)| *len as usize <= DAMAGE_PART_BYTES + 64));
    // And the next backup stores each of them again.
    let fresh = backup(&repo, "d", &data, Some(snap));
    let index = repo.load_index().unwrap();
    assert!(all.iter().all(|(_, id)| index.locations(id).count() == 2));
    assert_eq!(read_back(&repo, &fresh), data);
}

/// What verify finds and records is the same with one thread and with four.
#[test]
fn verify_says_and_records_the_same_with_one_thread_and_four() {
    let (store, _, _, copies) = damaged_repo();
    let run = |threads: usize| {
        let (to, repo) = copy(&store);
        let few = Held { chunks: 16, ..DAMAGE_HELD };
        let v = maint::verify_held(&repo, &VerifyOptions::all(threads), 64 * crate::damage::FOUND, few).unwrap();
        let (got, objects) = recorded(&to, &repo);
        let c = maint::check_held(&repo, 64 * crate::damage::FOUND, few).unwrap();
        (text(&v), got, objects.len(), text(&c))
    };
    let one = run(1);
    assert_eq!(one.1, copies);
    assert_eq!(one, run(4));
}

/// verify holds a bounded number of damaged ids however many there are (the ids it
/// traces, its sorters' runs on disk past their budget), and still records every copy;
/// check then counts every recorded chunk with no good copy, past what it holds.
#[test]
fn verify_and_check_hold_bounded_ids_and_count_every_damaged_chunk() {
    let (store, repo, _, copies) = damaged_repo();
    let few = Held { chunks: 8, ..DAMAGE_HELD };
    let budget = 16 * crate::damage::FOUND;
    let v = maint::verify_held(&repo, &VerifyOptions::all(2), budget, few).unwrap();
    assert!(v.ids_held <= most_held(8), "{} ids held", v.ids_held);
    assert!(v.damage_spilled.runs >= 4, "{:?}", v.damage_spilled);
    let counted: u64 = v
        .problems
        .iter()
        .filter_map(|p| p.why.split(" blob(s) damaged").next()?.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(counted as usize, copies.len(), "{:?}", v.problems);
    assert_eq!(recorded(&store, &repo).0, copies, "every copy recorded, past what verify held");
    let ids: HashSet<Digest> = copies.iter().map(|(_, id)| *id).collect();
    let c = maint::check_held(&repo, budget, few).unwrap();
    let counted: u64 = c
        .problems
        .iter()
        .filter_map(|p| {
            p.why.split(" chunk(s) in it have no good copy").next()?.rsplit(' ').next()?.parse::<u64>().ok()
        })
        .sum();
    assert_eq!(counted as usize, ids.len(), "{:?}", c.problems);
    let want = format!("{} more damaged or missing chunk(s)", ids.len() - 8);
    assert!(c.notes.iter().any(|n| n.starts_with(&want)), "{want}: {:?}", c.notes);
}

/// A record too large for one object, at the part size ferry ships: 300,000 damaged ids
/// of one pack (20 MB of JSON, over the 16 MiB limit) are stored as several objects,
/// each within the limit, and read back whole as one record.
#[test]
fn a_record_past_the_object_limit_is_stored_in_parts_at_the_shipped_size() {
    let (store, repo) = new_repo(false);
    let pack = [7u8; 32];
    let mut w = PartWriter::new(&repo, DAMAGE_PART_BYTES_SHIPPED);
    w.pack(&pack, "every blob flipped").unwrap();
    let n = 300_000u32;
    let id = |i: u32| crate::repo::sha256(&i.to_be_bytes());
    for i in 0..n {
        w.blob(&id(i)).unwrap();
    }
    w.pack(&[8u8; 32], "its trailer is damaged").unwrap();
    let names = w.finish().unwrap();
    assert!(names.len() >= 3, "{names:?}");
    for (name, len) in store.list("damage/").unwrap() {
        assert!(len <= DAMAGE_PART_BYTES_SHIPPED as u64 + 64 && len <= format::MAX_DAMAGE, "{name}: {len}");
    }
    let set = repo.damage().unwrap();
    assert_eq!(set.packs[&pack].blobs.len(), n as usize);
    assert!((0..n).all(|i| set.is_damaged(&pack, &id(i))));
    assert!(set.packs[&[8u8; 32]].blobs.is_empty());
    assert_eq!(set.objects.len(), names.len());
}

/// An encrypted repository with a disk backed up once, and each pack's bytes as stored
/// (to mend one later).
fn backed_up(seed: u64) -> (Arc<MemStore>, Arc<Repository>, Packs) {
    let (store, repo) = new_repo(true);
    backup(&repo, "d", &disk(8 << 20, seed), None);
    let packs = store.list("data/").unwrap().into_iter().map(|(n, _)| (n.clone(), store.get(&n, u64::MAX).unwrap()));
    let packs = packs.collect();
    (store, repo, packs)
}

/// Puts back a pack that `copies` names as it was stored first (mends it); its name.
fn mend_one<'a>(store: &MemStore, packs: &'a Packs, copies: &Copies) -> &'a str {
    // The pack with the most damaged copies (ties by name), not the first a hash map
    // happens to give: a pack with a single damaged copy mended and damaged again would
    // read as its record says, and a test that wants a record out of date then failed by
    // chance.
    let damaged = |n: &str| copies.iter().filter(|(p, _)| crate::repo::pack_name(p) == *n).count();
    let (name, bytes) = packs
        .iter()
        .filter(|(n, _)| damaged(n) > 0)
        .max_by(|(a, _), (b, _)| damaged(a).cmp(&damaged(b)).then_with(|| b.cmp(a)))
        .unwrap();
    store.put(name, bytes).unwrap();
    name
}

/// A disk backed up over a [`Hooked`] store, every other data copy of each pack damaged,
/// and verified (recorded): the store below, the store, the repository, the packs as
/// stored first, and the copies damaged.
fn recorded_over_hooks(seed: u64) -> (Arc<MemStore>, Arc<crate::tests::Hooked>, Arc<Repository>, Packs, Copies) {
    use crate::tests::Hooked;
    let inner = Arc::new(MemStore::new());
    let store = Arc::new(Hooked::new(inner.clone()));
    let repo = Arc::new(Repository::init(store.clone(), &init_opts(true)).unwrap());
    backup(&repo, "d", &disk(8 << 20, seed), None);
    let packs: Packs =
        inner.list("data/").unwrap().into_iter().map(|(n, _)| (n.clone(), inner.get(&n, u64::MAX).unwrap())).collect();
    let copies = damage_chunks(&inner, &repo, |i| i % 2 == 0);
    maint::verify(&repo, &VerifyOptions::all(1)).unwrap();
    (inner, store, repo, packs, copies)
}

/// A pack mended (its bytes as stored first) after a record in several objects named
/// it: verify rewrites the records without it, in parts again, every other copy still
/// recorded, and the old objects removed.
#[test]
fn a_mended_pack_leaves_a_record_in_parts_and_the_rest_stays_recorded() {
    let (store, repo, packs) = backed_up(37);
    let copies = damage_every_chunk(&store, &repo);
    maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    let (_, before) = recorded(&store, &repo);
    assert!(before.len() > 2, "{before:?}");
    // Mend the pack with the most damaged copies.
    let (name, bytes) = packs
        .iter()
        .max_by_key(|(n, _)| copies.iter().filter(|(p, _)| crate::repo::pack_name(p) == *n).count())
        .unwrap();
    store.put(name, bytes).unwrap();
    let v = maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    assert!(v.notes.iter().any(|n| n.starts_with(&format!("{name}: it was recorded damaged, and reads back whole"))));
    let rest: Copies = copies.iter().filter(|(p, _)| crate::repo::pack_name(p) != *name).copied().collect();
    assert!(rest.len() < copies.len());
    let (got, after) = recorded(&store, &repo);
    assert_eq!(got, rest);
    assert!(after.len() > 1 && after.iter().all(|(_, len)| *len as usize <= DAMAGE_PART_BYTES + 64), "{after:?}");
    assert!(after.iter().all(|o| !before.contains(o)), "the old objects are removed");
}

/// A damage object over the limit is refused by its length, before it is parsed (the
/// parser's first check, as the fuzz target drives it), and one in the store is refused
/// by the store's read limit, before it is read whole: it is reported, the others read.
#[test]
fn a_damage_object_over_the_limit_is_refused_before_it_is_parsed() {
    let json = vec![b' '; format::MAX_DAMAGE as usize + 1];
    let e = format::DamageRecord::parse(&json).unwrap_err();
    assert!(e.0.contains("at most"), "{e:?}");
    let (store, repo) = new_repo(false);
    let name = format!("damage/{}", format::hex(&crate::repo::sha256(&json)));
    store.put(&name, &json).unwrap();
    let (set, bad) = repo.damage_lenient().unwrap();
    assert!(set.is_empty() && bad.len() == 1 && bad[0].0 == name, "{bad:?}");
}

/// New damage is recorded even when the records cannot be rewritten (a gc or forget holds
/// the lock that rewriting needs): it is added in objects of its own, and the note says
/// the correction is left to the next verify.
#[test]
fn new_damage_is_recorded_when_the_records_cannot_be_rewritten() {
    let (store, repo, packs) = backed_up(38);
    let even = damage_chunks(&store, &repo, |i| i % 2 == 0);
    maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    // One pack mended, then the odd copies of every pack damaged: that pack's record is
    // out of date (a rewrite), the others' odd copies are new damage.
    let mended = mend_one(&store, &packs, &even);
    let odd = damage_chunks(&store, &repo, |i| i % 2 == 1);
    let held = lock::acquire(repo.store(), LockKind::Forget, None, None).unwrap();
    let v = maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    assert!(v.notes.iter().any(|n| n.starts_with("the damage records could not be corrected")), "{:?}", v.notes);
    let (got, _) = recorded(&store, &repo);
    assert!(odd.is_subset(&got), "every new damaged copy recorded");
    drop(held);
    // Once the lock is free, the next verify corrects the mended pack's record.
    maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    let want: Copies = odd
        .union(&even.iter().filter(|(p, _)| crate::repo::pack_name(p) != *mended).copied().collect())
        .copied()
        .collect();
    assert_eq!(recorded(&store, &repo).0, want);
}

/// A verify that rewrites the records (a recorded pack mended) keeps what another verify
/// recorded of a pack after this one read the records and the pack: it writes the ids it
/// found with those recorded meanwhile (it dropped them, and backups reused the copy).
#[test]
fn a_rewrite_keeps_damage_recorded_meanwhile() {
    use crate::tests::{Hooked, Op, When};
    let inner = Arc::new(MemStore::new());
    let store = Arc::new(Hooked::new(inner.clone()));
    let repo = Arc::new(Repository::init(store.clone(), &init_opts(true)).unwrap());
    backup(&repo, "d", &disk(8 << 20, 42), None);
    let (objects, _) = repo.index_objects().unwrap();
    let per_pack: Vec<(Digest, Vec<format::BlobEntry>)> = objects
        .iter()
        .flat_map(|(_, ps)| ps)
        .map(|p| (p.pack, p.blobs.iter().filter(|b| !b.kind.is_page()).copied().collect::<Vec<_>>()))
        .filter(|(_, v)| v.len() >= 3)
        .collect();
    assert!(per_pack.len() >= 2, "{} packs", per_pack.len());
    let ((q, qb), (p, pb)) = (per_pack[0].clone(), per_pack[1].clone());
    let flip = |s: &MemStore, pack: &Digest, b: &format::BlobEntry| {
        let at = (b.offset + b.stored_len / 2) as usize;
        s.tamper(&crate::repo::pack_name(pack), |v| v[at] ^= 0xa5)
    };
    let qbytes = inner.get(&crate::repo::pack_name(&q), u64::MAX).unwrap();
    flip(&inner, &q, &qb[0]);
    flip(&inner, &p, &pb[0]);
    maint::verify(&repo, &VerifyOptions::all(1)).unwrap();
    assert!(repo.damage().unwrap().is_damaged(&p, &pb[0].id));
    inner.put(&crate::repo::pack_name(&q), &qbytes).unwrap(); // Q mended: the next verify rewrites
    flip(&inner, &p, &pb[1]); // new damage in P
    let d = pb[2];
    let name = repo
        .put_damage(vec![format::DamagedPack {
            pack: format::hex(&p),
            why: "found by another verify".into(),
            blobs: vec![format::hex(&d.id)],
        }])
        .unwrap();
    let obj = inner.get(&name, u64::MAX).unwrap();
    inner.delete(&name).unwrap();
    let pn = crate::repo::pack_name(&p);
    let at = (d.offset + d.stored_len / 2) as usize;
    let mut done = false;
    store.set_hook(Some(Box::new(move |s, when, op, n| {
        if when == When::After && op == Op::Get && n == pn && !done {
            done = true;
            // After this verify read P: d rots, and another verify records it.
            s.tamper(&pn, |v| v[at] ^= 0xa5);
            s.put(&name, &obj)?;
        }
        Ok(())
    })));
    let v = maint::verify(&repo, &VerifyOptions::all(1)).unwrap();
    store.set_hook(None);
    let set = repo.damage().unwrap();
    assert!(set.is_damaged(&p, &pb[0].id) && set.is_damaged(&p, &pb[1].id), "{:?}", v.notes);
    assert!(set.is_damaged(&p, &d.id), "the copy recorded meanwhile is kept: {:?}", v.notes);
    assert!(!set.packs.contains_key(&q), "the mended pack's record is cleared");
}

/// Verifies that each find a little more damage in the same packs add only the ids not
/// recorded yet (each verify stored a recorded pack's whole list again), and gc merges
/// the objects they leave once there are clearly more than the union needs (it no longer
/// did): their number stays bounded, every copy recorded.
#[test]
fn damage_objects_stay_bounded_over_verifies_and_gc() {
    let (store, repo, _) = backed_up(41);
    let mut union = Copies::new();
    let mut objects = Vec::new();
    for k in 0..4 {
        union.extend(damage_chunks(&store, &repo, |i| i % 4 == k));
        maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
        let (got, o) = recorded(&store, &repo);
        assert_eq!(got, union, "round {k}");
        let set = repo.damage().unwrap();
        assert_eq!(set.listed, union.len(), "round {k}: no id listed twice");
        objects = o;
    }
    let bytes: u64 = objects.iter().map(|(_, l)| *l).sum();
    maint::gc(&repo, None).unwrap();
    let (got, after) = recorded(&store, &repo);
    assert_eq!(got, union);
    let need = (bytes as usize).div_ceil(DAMAGE_PART_BYTES - 512) + 1;
    assert!(after.len() < objects.len() && after.len() <= need, "{} -> {} objects", objects.len(), after.len());
    // And a gc of merged records leaves them as they are.
    maint::gc(&repo, None).unwrap();
    assert_eq!(recorded(&store, &repo).1, after);
}

/// The most damaged ids verify and check may hold at once outside their sorters when
/// they trace `chunks`: those, or a damage object's part, whichever is more.
fn most_held(chunks: usize) -> usize {
    chunks.max(DAMAGE_PART_BYTES / 67)
}

/// The ids verify and check hold outside their sorters (the chunks traced, a pack's ids
/// past its check, a part of a record, check's damaged chunks) stay below one bound as
/// the damage grows fourfold; every copy is recorded either way.
#[test]
fn ids_held_stay_bounded_as_the_damage_grows() {
    let few = Held { chunks: 8, ..DAMAGE_HELD };
    let budget = 16 * crate::damage::FOUND;
    let mut seen = Vec::new();
    for every in [4, 1] {
        let (store, repo, _) = backed_up(45);
        let copies = damage_chunks(&store, &repo, |i| i % every == 0);
        let v = maint::verify_held(&repo, &VerifyOptions::all(2), budget, few).unwrap();
        assert_eq!(recorded(&store, &repo).0, copies);
        let c = maint::check_held(&repo, budget, few).unwrap();
        assert!(
            v.ids_held <= most_held(8) && c.ids_held <= 8,
            "{} copies: {} {}",
            copies.len(),
            v.ids_held,
            c.ids_held
        );
        seen.push((copies.len(), v.ids_held));
    }
    assert!(seen[1].0 > 3 * seen[0].0 && seen[1].0 > most_held(8), "{seen:?}");
}

/// A failure (a crash) between storing the rewritten records and removing the old ones
/// leaves every copy recorded (the union of old and new); the note says the records
/// could not be corrected (it said they could not be recorded), and the mended pack is
/// not said cleared; the next verify corrects them.
#[test]
fn a_failure_to_remove_the_old_records_leaves_every_copy_recorded() {
    let (inner, store, repo, packs, first) = recorded_over_hooks(43);
    let mended = mend_one(&inner, &packs, &first);
    // The mended pack is left out of the second damage: it reads back whole.
    let saved = inner.get(mended, u64::MAX).unwrap();
    let second: Copies = damage_chunks(&inner, &repo, |i| i % 2 == 1)
        .into_iter()
        .filter(|(p, _)| crate::repo::pack_name(p) != *mended)
        .collect();
    inner.put(mended, &saved).unwrap();
    let of_mended = |c: &Copies| c.iter().filter(|(p, _)| crate::repo::pack_name(p) == *mended).count();
    assert!(of_mended(&first) > 0 && of_mended(&second) == 0);
    *store.fail_delete.lock().unwrap() = Some("damage/");
    let v = maint::verify(&repo, &VerifyOptions::all(1)).unwrap();
    *store.fail_delete.lock().unwrap() = None;
    assert!(v.notes.iter().any(|n| n.starts_with("the damage records could not be corrected")), "{:?}", v.notes);
    assert!(!v.notes.iter().any(|n| n.contains("could not be recorded") || n.contains("its record is cleared")));
    // The mended pack reads whole (what is said of it is its record's reason alone), and it
    // stays recorded, a problem, since its record could not be cleared.
    assert_eq!(inner.get(mended, u64::MAX).unwrap(), saved);
    let said = v.problems.iter().find(|p| p.object == *mended).map(|p| p.why.clone()).unwrap_or_default();
    assert!(said.starts_with("recorded damaged") && said.matches("blob(s) damaged").count() == 1, "{said}");
    let all: Copies = first.union(&second).copied().collect();
    assert!(recorded(&inner, &repo).0 == all, "every copy recorded, the mended pack's too");
    let v = maint::verify(&repo, &VerifyOptions::all(1)).unwrap();
    assert!(v.notes.iter().any(|n| n.starts_with(mended) && n.contains("its record is cleared")), "{:?}", v.notes);
    // The mended pack reads well: no longer recorded.
    let want: Copies = all.iter().filter(|(p, _)| crate::repo::pack_name(p) != *mended).copied().collect();
    assert!(recorded(&inner, &repo).0 == want && want.len() < all.len(), "corrected by the next verify");
}

/// Where the records cannot be rewritten (the lock held), a pack whose record is merely
/// out of date (some copies read well now, none newly damaged) is not stored again: no
/// id is listed twice.
#[test]
fn a_record_merely_out_of_date_is_not_stored_again_when_it_cannot_be_rewritten() {
    let (store, repo, packs) = backed_up(44);
    let even = damage_chunks(&store, &repo, |i| i % 2 == 0);
    maint::verify(&repo, &VerifyOptions::all(1)).unwrap();
    // One pack mended, then its first data copy damaged again: its record lists more.
    let mended = mend_one(&store, &packs, &even);
    let (objects, _) = repo.index_objects().unwrap();
    let pack = objects.iter().flat_map(|(_, ps)| ps).find(|p| crate::repo::pack_name(&p.pack) == *mended).unwrap();
    let b = pack.blobs.iter().find(|b| !b.kind.is_page()).unwrap();
    store.tamper(mended, |v| v[(b.offset + b.stored_len / 2) as usize] ^= 0xa5);
    let before = recorded(&store, &repo).1;
    let held = lock::acquire(repo.store(), LockKind::Forget, None, None).unwrap();
    let v = maint::verify(&repo, &VerifyOptions::all(1)).unwrap();
    drop(held);
    assert!(v.notes.iter().any(|n| n.starts_with("the damage records could not be corrected")), "{:?}", v.notes);
    let set = repo.damage().unwrap();
    assert_eq!(set.listed, even.len(), "no id stored again");
    assert_eq!(recorded(&store, &repo), (even.clone(), before));
}

/// A pack's entry whose first id does not fit the part goes to the next part whole: no
/// part lists it with no ids (which says that only the pack as a whole is damaged).
#[test]
fn a_pack_entry_never_ends_a_part_with_no_ids() {
    let (store, repo) = new_repo(false);
    // A part of the record's cost, two entries and one id: the second entry fits, its
    // id does not.
    let max = 512 + 2 * (128 + 4) + 67 + 10;
    let mut w = PartWriter::new(&repo, max);
    w.pack(&[1u8; 32], "a").unwrap();
    w.blob(&[9u8; 32]).unwrap();
    w.pack(&[2u8; 32], "b").unwrap();
    w.blob(&[10u8; 32]).unwrap();
    w.blob(&[11u8; 32]).unwrap();
    let names = w.finish().unwrap();
    assert!(names.len() >= 2, "{names:?}");
    for (name, _) in store.list("damage/").unwrap() {
        let j = repo.read_named(&name, "damage/", format::MAX_DAMAGE, crate::damage::AAD_DAMAGE).unwrap();
        let r = format::DamageRecord::parse(&j).unwrap();
        assert!(r.packs.iter().all(|p| !p.blobs.is_empty()), "{name}: {:?}", r.packs);
    }
    let set = repo.damage().unwrap();
    assert_eq!(set.packs[&[2u8; 32]].blobs.len(), 2);
}

/// A damage object that a rewrite removes between the reader's listing and its read (the
/// rewrite stored its replacement first) is not skipped: the reader lists the records
/// again and reads the replacement, so every id stays in its set and nothing is a failure.
#[test]
fn a_record_rewritten_while_read_is_read_from_its_replacement() {
    use crate::format::DamagedPack;
    use crate::tests::{Hooked, Op, When};
    let inner = Arc::new(MemStore::new());
    let store = Arc::new(Hooked::new(inner.clone()));
    let repo = Arc::new(Repository::init(store.clone(), &init_opts(false)).unwrap());
    let entry = |pack: u8, blobs: &[u8]| DamagedPack {
        pack: format::hex(&[pack; 32]),
        why: "flipped".into(),
        blobs: blobs.iter().map(|b| format::hex(&[*b; 32])).collect(),
    };
    let old: Vec<String> = (1..=3u8).map(|p| repo.put_damage(vec![entry(p, &[p, p + 10])]).unwrap()).collect();
    // The replacements of the first two objects: one object, then (by a second rewrite
    // while the first replacement is read) another; stored only by the hooks.
    let take = |name: String| {
        let bytes = inner.get(&name, u64::MAX).unwrap();
        inner.delete(&name).unwrap();
        (name, bytes)
    };
    let first = take(repo.put_damage(vec![entry(1, &[1, 11]), entry(2, &[2, 12, 22])]).unwrap());
    let second = take(repo.put_damage(vec![entry(1, &[1, 11]), entry(2, &[2, 12, 22]), entry(4, &[4])]).unwrap());
    let mut rewrites =
        vec![(first.0.clone(), second, vec![first.0.clone()]), (old[0].clone(), first, old[..2].to_vec())];
    store.set_hook(Some(Box::new(move |s, when, op, name| {
        if when == When::Before && op == Op::Get && rewrites.last().is_some_and(|(at, _, _)| at == name) {
            let (_, (new, bytes), gone) = rewrites.pop().unwrap();
            s.put(&new, &bytes).unwrap();
            for g in gone {
                s.delete(&g).unwrap();
            }
        }
        Ok(())
    })));
    let (set, bad) = repo.damage_lenient().unwrap();
    store.set_hook(None);
    assert!(bad.is_empty(), "{bad:?}");
    let ids = |p: u8| set.packs.get(&[p; 32]).map(|c| c.blobs.len());
    assert_eq!((ids(1), ids(2), ids(3), ids(4)), (Some(2), Some(3), Some(2), Some(1)), "every id read");
    let last = inner.list("damage/").unwrap().into_iter().map(|(n, _)| n).collect::<HashSet<_>>();
    assert!(last.iter().all(|n| set.objects.contains(n)), "{:?} read, {last:?} stored", set.objects);
}

/// Two verifies at once: while verify A runs (a mended pack makes it rewrite the records),
/// verify B rewrites them without a pack that A finds damaged as its record said (so A
/// has nothing new to add for it). A's rewrite keeps that pack's ids: they were confirmed.
#[test]
fn a_rewrite_keeps_what_it_confirmed_though_another_verify_removed_it() {
    use crate::format::DamagedPack;
    use crate::tests::{Op, When};
    let (inner, store, repo, packs, copies) = recorded_over_hooks(46);
    let mended = mend_one(&inner, &packs, &copies).to_string();
    // B's records: every pack but one that stays damaged (`lost`), the mended one still in.
    let set = repo.damage().unwrap();
    let lost = *set.packs.keys().find(|p| crate::repo::pack_name(p) != mended).unwrap();
    let mut others: Vec<DamagedPack> = set
        .packs
        .iter()
        .filter(|(p, _)| **p != lost)
        .map(|(p, c)| DamagedPack {
            pack: format::hex(p),
            why: c.why.clone(),
            blobs: c.blobs.iter().map(|b| format::hex(b)).collect(),
        })
        .collect();
    others.sort_by(|a, b| a.pack.cmp(&b.pack));
    let name = repo.put_damage(others).unwrap();
    let bytes = inner.get(&name, u64::MAX).unwrap();
    inner.delete(&name).unwrap();
    let mut lists = 0;
    store.set_hook(Some(Box::new(move |s, when, op, prefix| {
        if when == When::Before && op == Op::List && prefix == "damage/" {
            lists += 1;
            if lists == 2 {
                // B's rewrite, between A's start and its rewrite: stored, then the old removed.
                let old = s.list("damage/").unwrap();
                s.put(&name, &bytes).unwrap();
                for (n, _) in old {
                    s.delete(&n).unwrap();
                }
            }
        }
        Ok(())
    })));
    let v = maint::verify(&repo, &VerifyOptions::all(1)).unwrap();
    store.set_hook(None);
    assert!(!v.notes.iter().any(|n| n.contains("could not be")), "{:?}", v.notes);
    let want: Copies = copies.iter().filter(|(p, _)| crate::repo::pack_name(p) != mended).copied().collect();
    assert!(want.iter().any(|(p, _)| *p == lost));
    assert!(recorded(&inner, &repo).0 == want, "the copies A confirmed stay recorded");
}
