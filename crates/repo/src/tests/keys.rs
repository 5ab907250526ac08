//! Passphrases (FORMAT.md §3a): key objects added, changed and removed, the master key and
//! every other object unchanged; a change stopped at any step leaves the old passphrase
//! working; hostile key objects; version 1 repositories keep their version.
use super::*;
use crate::crypto::{KdfLimit, KDF_LIMIT_HOW};
use crate::format::{self, Config};
use crate::keys::CONFIG_KEY;

const CHEAP: KdfCost = KdfCost { m_kib: 8192, t: 1, p: 1 };

fn open(store: Arc<dyn Store>, pw: &str) -> crate::Result<Repository> {
    let pw = pw.as_bytes().to_vec();
    Repository::open(store, &move || Ok(crate::Passphrase::new(pw.clone())))
}

fn opens(store: &Arc<dyn Store>, pw: &str) -> Option<String> {
    match open(store.clone(), pw) {
        Ok(r) => Some(r.key_slot().unwrap().to_string()),
        Err(Error::Passphrase(_)) => None,
        Err(e) => panic!("{pw}: {e}"),
    }
}

/// Every object but `config` and the key objects, with its bytes.
fn data_objects(store: &MemStore) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = objects(store, "")
        .into_iter()
        .filter(|(n, _)| n != "config" && !n.starts_with("keys/"))
        .map(|(n, _)| (n.clone(), store.get(&n, u64::MAX).unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn passphrases_are_added_changed_and_removed_without_touching_the_data() {
    let (mem, repo) = new_repo(true);
    let store: Arc<dyn Store> = mem.clone();
    let data = disk(1 << 20, 7);
    let snap = backup(&repo, "d", &data, None);
    let before = data_objects(&mem);
    let config_before: Config = Config::parse(&mem.get("config", u64::MAX).unwrap()).unwrap();

    // Add a second passphrase: both open, each says which key it opened.
    let second = repo.add_key(b"second", CHEAP, KdfLimit::Default).unwrap();
    assert_eq!(second.len(), 16);
    assert_eq!(opens(&store, "secret words").as_deref(), Some(CONFIG_KEY));
    assert_eq!(opens(&store, "second"), Some(second.clone()));
    let r2 = Arc::new(open(store.clone(), "second").unwrap());
    assert!(read_back(&r2, &r2.resolve("d", None).unwrap()) == data);
    let keys = r2.keys().unwrap();
    assert_eq!(
        keys.iter().map(|k| (k.id.as_str(), k.in_use)).collect::<Vec<_>>(),
        [(CONFIG_KEY, false), (second.as_str(), true)]
    );
    assert_eq!(keys[1].kdf, CHEAP);
    assert!(!keys[1].host.is_empty() && keys[1].created.ends_with('Z'));
    // An empty one is refused.
    assert!(matches!(repo.add_key(b"", CHEAP, KdfLimit::Default), Err(Error::Passphrase(_))));

    // Change the key object's passphrase: a new object replaces it.
    let third = r2.change_key(b"third", CHEAP, KdfLimit::Default).unwrap();
    assert_ne!(third, second);
    assert_eq!(opens(&store, "second"), None);
    assert_eq!(opens(&store, "third"), Some(third.clone()));
    assert_eq!(objects(&mem, "keys/").len(), 1);

    // Change the config's key: config rewritten, the same otherwise.
    let r1 = open(store.clone(), "secret words").unwrap();
    assert_eq!(r1.change_key(b"fourth", CHEAP, KdfLimit::Default).unwrap(), CONFIG_KEY);
    assert_eq!(opens(&store, "secret words"), None);
    assert_eq!(opens(&store, "fourth").as_deref(), Some(CONFIG_KEY));
    let config_after = Config::parse(&mem.get("config", u64::MAX).unwrap()).unwrap();
    assert_eq!(Config { encryption: None, ..config_after.clone() }, Config { encryption: None, ..config_before });

    // Remove: never the one in use (the only one known to open), never the last.
    let r4 = open(store.clone(), "fourth").unwrap();
    let e = r4.remove_key(CONFIG_KEY).unwrap_err();
    assert!(e.to_string().contains("another key's passphrase"), "{e}");
    assert!(matches!(r4.remove_key("0123456789abcdef"), Err(Error::NotFound(_))));
    // Removing the config's key moves the key the passphrase given opened into the config
    // (known to hold this master key), whichever key objects there are.
    let fifth = r4.add_key(b"fifth", CHEAP, KdfLimit::Default).unwrap();
    let by_third = open(store.clone(), "third").unwrap();
    let done = by_third.remove_key(CONFIG_KEY).unwrap();
    assert!(done.contains(&third), "{done}");
    assert_eq!(opens(&store, "fourth"), None);
    assert_eq!(opens(&store, "third").as_deref(), Some(CONFIG_KEY));
    assert_eq!(opens(&store, "fifth"), Some(fifth.clone()));
    let by_third = open(store.clone(), "third").unwrap();
    by_third.remove_key(&fifth).unwrap();
    assert_eq!(opens(&store, "fifth"), None);
    assert!(objects(&mem, "keys/").is_empty());
    let r3 = Arc::new(open(store.clone(), "third").unwrap());
    let e = r3.remove_key(CONFIG_KEY).unwrap_err();
    assert!(e.to_string().contains("only key"), "{e}");
    // The same master key throughout: every other object is as it was, and reads.
    assert_eq!(data_objects(&mem), before);
    assert!(read_back(&r3, &r3.resolve("d", None).unwrap()) == data);
    assert_eq!(r3.resolve("d", None).unwrap().id, snap.id);
    // An unencrypted repository has no keys to manage.
    let (_, plain) = new_repo(false);
    assert!(plain.keys().unwrap_err().to_string().contains("not encrypted"));
    assert!(plain.add_key(b"x", CHEAP, KdfLimit::Default).is_err());
}

#[test]
fn a_key_change_stopped_at_any_step_leaves_the_old_passphrase_working() {
    let (mem, _) = new_repo(true);
    let failing = Arc::new(Failing::new(mem.clone()));
    let store: Arc<dyn Store> = failing.clone();
    let repo = open(store.clone(), "secret words").unwrap();

    // The new key object is not written: nothing changed.
    *failing.fail_put.lock().unwrap() = Some("keys/");
    assert!(repo.add_key(b"new", CHEAP, KdfLimit::Default).is_err());
    assert_eq!(opens(&store, "new"), None);
    // The config is not rewritten: the old passphrase still opens.
    *failing.fail_put.lock().unwrap() = Some("config");
    assert!(repo.change_key(b"new", CHEAP, KdfLimit::Default).is_err());
    assert_eq!(opens(&store, "secret words").as_deref(), Some(CONFIG_KEY));
    assert_eq!(opens(&store, "new"), None);
    *failing.fail_put.lock().unwrap() = None;

    // A key object's change stopped before the old one is removed: both open.
    let id = repo.add_key(b"object", CHEAP, KdfLimit::Default).unwrap();
    let r = open(store.clone(), "object").unwrap();
    *failing.fail_delete.lock().unwrap() = Some("keys/");
    let e = r.change_key(b"changed", CHEAP, KdfLimit::Default).unwrap_err();
    assert!(e.to_string().contains("old passphrase still works"), "{e}");
    assert_eq!(opens(&store, "object"), Some(id.clone()));
    assert!(opens(&store, "changed").is_some());
    // Removing the config's key stopped after the config took a key object's copy: that
    // passphrase opens twice over; the removed one no longer does.
    let r = open(store.clone(), "object").unwrap();
    assert!(r.remove_key(CONFIG_KEY).is_err());
    assert_eq!(opens(&store, "secret words"), None);
    let (a, b) = (opens(&store, "object").unwrap(), opens(&store, "changed").unwrap());
    assert!((a == CONFIG_KEY) != (b == CONFIG_KEY), "{a} {b}");
    assert_eq!(objects(&mem, "keys/").len(), 2);
}

/// A key object that reads but does not hold this repository's master key (planted from
/// another repository, or rotted) never takes the config's place and does not count as a
/// key that opens: only the key the passphrase given opened is known to.
#[test]
fn only_a_key_known_to_open_takes_the_configs_place() {
    let (mem, repo) = new_repo(true);
    let store: Arc<dyn Store> = mem.clone();
    let (other_mem, other) = new_repo(true);
    let theirs = other.add_key(b"theirs", CHEAP, KdfLimit::Default).unwrap();
    let planted = other_mem.get(&format!("keys/{theirs}"), u64::MAX).unwrap();
    // First in name order, as a store writer would place it.
    mem.put("keys/0000000000000000", &planted).unwrap();
    assert!(repo.keys().unwrap().iter().all(|k| k.damaged.is_none()), "it reads as a key");
    // The config's key in use: not removed, whatever other key objects there are.
    let e = repo.remove_key(CONFIG_KEY).unwrap_err();
    assert!(e.to_string().contains("another key's passphrase"), "{e}");
    assert_eq!(opens(&store, "secret words").as_deref(), Some(CONFIG_KEY));
    // With a key the passphrase opened, that key (not the planted one) moves in.
    let mine = repo.add_key(b"mine", CHEAP, KdfLimit::Default).unwrap();
    let done = open(store.clone(), "mine").unwrap().remove_key(CONFIG_KEY).unwrap();
    assert!(done.contains(&mine), "{done}");
    assert_eq!(opens(&store, "secret words"), None);
    assert_eq!(opens(&store, "mine").as_deref(), Some(CONFIG_KEY));
    // The planted one is removed like any key not in use; the last one never.
    let by_mine = open(store.clone(), "mine").unwrap();
    by_mine.remove_key("0000000000000000").unwrap();
    let e = by_mine.remove_key(CONFIG_KEY).unwrap_err();
    assert!(e.to_string().contains("only key"), "{e}");
    assert_eq!(opens(&store, "mine").as_deref(), Some(CONFIG_KEY));
}

#[test]
fn a_concurrent_config_change_is_refused_not_lost() {
    let (mem, _) = new_repo(true);
    let store: Arc<dyn Store> = mem.clone();
    let a = open(store.clone(), "secret words").unwrap();
    let b = open(store.clone(), "secret words").unwrap();
    a.change_key(b"by a", CHEAP, KdfLimit::Default).unwrap();
    let e = b.change_key(b"by b", CHEAP, KdfLimit::Default).unwrap_err();
    assert!(e.to_string().contains("changed since"), "{e}");
    assert_eq!(opens(&store, "by a").as_deref(), Some(CONFIG_KEY));
    assert_eq!(opens(&store, "by b"), None);
}

#[test]
fn hostile_key_objects_are_bounded() {
    let (mem, repo) = new_repo(true);
    let store: Arc<dyn Store> = mem.clone();
    let id = repo.add_key(b"second", CHEAP, KdfLimit::Default).unwrap();
    // A damaged key object is skipped; the others open.
    mem.put("keys/00000000000000aa", b"{ not json").unwrap();
    assert_eq!(opens(&store, "second"), Some(id.clone()));
    assert!(repo.keys().unwrap().iter().any(|k| k.id == "00000000000000aa" && k.damaged.is_some()));
    // One whose KDF cost is over the limit is not run; when nothing else opens, that is said.
    let mut k = format::KeyObject::parse(&mem.get(&format!("keys/{id}"), 4096).unwrap()).unwrap();
    (k.kdf.m_kib, k.kdf.t, k.kdf.p) = (4 << 20, 64, 1);
    mem.put("keys/00000000000000bb", &k.to_bytes()).unwrap();
    let started = std::time::Instant::now();
    match open(store.clone(), "wrong") {
        Err(Error::Invalid(m)) => assert!(m.contains("keys/00000000000000bb") && m.contains(KDF_LIMIT_HOW), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("opened"),
    }
    assert!(started.elapsed().as_secs() < 5);
    assert_eq!(opens(&store, "second"), Some(id));
    // ferry adds at most MAX_ADDED_KEYS.
    for i in objects(&mem, "keys/").len()..crate::keys::MAX_ADDED_KEYS {
        mem.put(&format!("keys/{i:016x}"), b"{}").unwrap();
    }
    let e = repo.add_key(b"more", CHEAP, KdfLimit::Default).unwrap_err();
    assert!(e.to_string().contains("remove one"), "{e}");
    // More key objects than a repository may have: none is tried.
    for i in 0..format::MAX_KEY_OBJECTS {
        mem.put(&format!("keys/{i:016x}"), b"{}").unwrap();
    }
    match open(store.clone(), "second") {
        Err(Error::Invalid(m)) => assert!(m.contains("key objects"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("opened"),
    }
    // The config's key is tried first, before the key objects are listed.
    assert_eq!(opens(&store, "secret words").as_deref(), Some(CONFIG_KEY));
}

#[test]
fn version_1_repositories_are_read_and_written_in_version_1() {
    for version in [1, 2] {
        let mem = Arc::new(MemStore::new());
        let store: Arc<dyn Store> = mem.clone();
        let opts = InitOptions {
            page_entries: 16,
            encrypt: Some((crate::Passphrase::new(b"pw".to_vec()), CHEAP)),
            version,
            ..InitOptions::default()
        };
        let repo = Arc::new(Repository::init(store.clone(), &opts).unwrap());
        let data = disk(1 << 20, 9);
        let s1 = backup(&repo, "d", &data, None);
        let repo = Arc::new(open(store.clone(), "pw").unwrap());
        assert_eq!(repo.config().version, version);
        let mut data2 = data.clone();
        data2[5000..9000].fill(0x5a);
        let s2 = backup(&repo, "d", &data2, Some(s1.clone()));
        assert!(read_back(&repo, &s1) == data && read_back(&repo, &s2) == data2);
        // Every object is sealed as its version says, and only so.
        let manifest = mem.get(&format!("snapshots/{}", s2.id), u64::MAX).unwrap();
        let other = if version == 1 { 2 } else { 1 };
        assert!(repo.crypto().as_version(version).open(crate::repo::AAD_SNAPSHOT, &manifest).is_ok());
        assert!(repo.crypto().as_version(other).open(crate::repo::AAD_SNAPSHOT, &manifest).is_err());
        // Key changes keep the version.
        repo.add_key(b"two", CHEAP, KdfLimit::Default).unwrap();
        repo.change_key(b"pw2", CHEAP, KdfLimit::Default).unwrap();
        let r = Arc::new(open(store.clone(), "two").unwrap());
        assert_eq!(r.config().version, version);
        assert!(read_back(&r, &r.resolve("d", None).unwrap()) == data2);
        let r = maint::verify(&r, &VerifyOptions::all(2)).unwrap();
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        // The version is bound into the key: a config edited to the other version does not open.
        let mut c = Config::parse(&mem.get("config", u64::MAX).unwrap()).unwrap();
        c.version = other;
        mem.put("config", &c.to_bytes()).unwrap();
        assert_eq!(opens(&store, "pw2"), None);
    }
    let bad = InitOptions { version: 4, ..InitOptions::default() };
    assert!(Repository::init(Arc::new(MemStore::new()), &bad).is_err());
}
