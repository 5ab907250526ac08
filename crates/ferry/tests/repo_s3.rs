//! A backup repository under an S3 prefix (moto_server), plain and encrypted, through
//! the CLI: init, a full and an incremental backup (`--extents-from`), list, restore
//! through `ferry copy s3://...::NAME`, `ferry hash` from the index, verify (and verify
//! finding a byte flipped in a pack object rewritten through boto3), forget + gc (the
//! objects leave the bucket), stats.
//!
//! [`repository_flow`] is also run against Ceph's radosgw by rbd.rs.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use crate::remote_images::{make_bucket, s3ferry};
use crate::repo_crash::{listed, s, Expect, Mk};
use ferry_testsupport::moto::moto;
use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::Command;

/// An S3 API to run boto3 against: endpoint and credentials.
pub(crate) struct S3Api {
    pub(crate) endpoint: String,
    pub(crate) key_id: String,
    pub(crate) secret: String,
}

impl S3Api {
    /// Runs a boto3 snippet (`s3` is a client) and returns what it printed.
    pub(crate) fn boto3(&self, code: &str) -> String {
        let script = format!(
            "import boto3, sys\ns3 = boto3.client('s3', endpoint_url='{}', aws_access_key_id='{}', \
             aws_secret_access_key='{}', region_name='us-east-1')\n{code}\n",
            self.endpoint, self.key_id, self.secret
        );
        let out = run(&mut cmd("python3", ["-c", &script]));
        assert!(out.status.success(), "boto3 failed (it comes with `pip install 'moto[server]'`):\n{}", out.describe());
        out.stdout
    }

    /// Every key under `prefix` in `bucket`, with its size.
    pub(crate) fn objects(&self, bucket: &str, prefix: &str) -> BTreeMap<String, u64> {
        self.boto3(&format!(
            "p = s3.get_paginator('list_objects_v2')\n\
             for page in p.paginate(Bucket='{bucket}', Prefix='{prefix}'):\n    \
             for o in page.get('Contents', []): print(o['Key'], o['Size'])"
        ))
        .lines()
        .map(|l| {
            let (k, n) = l.rsplit_once(' ').unwrap();
            (k.to_string(), n.parse().unwrap())
        })
        .collect()
    }

    /// Flips bit 6 of byte `at` of an object by a GET and a PUT.
    pub(crate) fn flip(&self, bucket: &str, key: &str, at: u64) {
        self.boto3(&format!(
            "b = bytearray(s3.get_object(Bucket='{bucket}', Key='{key}')['Body'].read())\n\
             b[{at}] ^= 0x40\n\
             s3.put_object(Bucket='{bucket}', Key='{key}', Body=bytes(b))"
        ));
    }
}

/// The whole flow on `s3://BUCKET/PREFIX` (the bucket exists), `mk` making ferry
/// commands with the store's environment (and the passphrase when `encrypted`).
pub(crate) fn repository_flow(api: &S3Api, mk: Mk, bucket: &str, prefix: &str, encrypted: bool, d: &Path) {
    let repo = format!("s3://{bucket}/{prefix}");
    let t = format!("{repo}::vm1-sda");
    let mut init = vec!["repo", "init"];
    if encrypted {
        init.extend(["--encrypt", "--kdf-memory", "8M"]);
    }
    init.push(&repo);
    let out = run_ok(&mut mk(&init));
    assert_eq!(out.stdout.contains("not encrypted"), !encrypted, "{}", out.describe());
    let keys = api.objects(bucket, &format!("{prefix}/"));
    assert!(keys.contains_key(&format!("{prefix}/config")), "no config object: {keys:?}");
    // A repository is not made twice.
    let out = run(&mut mk(&init));
    assert!(!out.status.success(), "init over a repository succeeded\n{}", out.describe());

    let mut exp = Expect { known: Default::default(), mk };
    let len = 16 * MIB as usize;
    let mut data = data_with_holes(len, 0x53);
    let img = write_sparse_file(d, "disk.raw", &data);
    let full = Json::must_parse(run_ok(&mut mk(&["backup", "--json", s(&img), &t])).stdout.trim());
    let id0 = full.at("id").as_str().unwrap().to_string();
    exp.known.insert(id0.clone(), hash(mk, s(&img)));
    // An incremental: 4 changed MiB read, through an --extents-from map (a quarter of the
    // full backup's pack, so that gc repacks it once that snapshot is forgotten).
    let at = 5 * MIB as usize;
    Rng::new(0x54).fill(&mut data[at..at + 4 * MIB as usize]);
    fs::write(&img, &data).unwrap();
    let map = d.join("changed.json");
    fs::write(&map, format!(r#"[{{"offset": {at}, "length": {}, "type": 1}}]"#, 4 * MIB)).unwrap();
    let inc = Json::must_parse(
        run_ok(&mut mk(&["backup", "--json", "--extents-from", s(&map), "--since", &id0, s(&img), &t])).stdout.trim(),
    );
    let id1 = inc.at("id").as_str().unwrap().to_string();
    assert!(inc.u64_at("read") <= 4 * MIB, "the incremental read more than the change: {inc}");
    assert_eq!(inc.at("parent").as_str(), Some(id0.as_str()), "{inc}");
    assert!(inc.u64_at("new_stored") <= 4 * MIB + MIB / 4, "{inc}");
    exp.known.insert(id1.clone(), hash(mk, s(&img)));
    // Listed; both restore exactly, through their index and their data.
    let list = listed(mk, &repo);
    assert_eq!(list.len(), 2, "{list:?}");
    exp.assert_restore(&repo, None, d, &format!("two backups to {repo}"));
    let out = d.join("latest.raw");
    run_ok(&mut mk(&["copy", &t, s(&out)]));
    assert_file_eq(&out, &data);
    let v = run_ok(&mut mk(&["repo", "verify", &repo]));
    assert!(v.stdout.contains("no damage"), "{}", v.describe());

    // A flipped byte in the largest pack (the full backup's data): verify finds it and
    // names the pack and both snapshots (the incremental shares its unchanged chunks).
    let packs = api.objects(bucket, &format!("{prefix}/data/"));
    let (victim, _) = packs.iter().max_by_key(|(_, n)| **n).unwrap();
    api.flip(bucket, victim, 300);
    let out = run(&mut mk(&["repo", "verify", &repo]));
    assert_eq!(out.status.code(), Some(13), "verify missed a flipped byte in {victim}\n{}", out.describe());
    let pack_id = victim.rsplit('/').next().unwrap();
    assert!(out.stdout.contains(pack_id), "the pack is not named\n{}", out.describe());
    assert!(out.stdout.contains(&id0[..8]), "the snapshot is not named\n{}", out.describe());
    // A restore of the damaged data fails rather than returning wrong bytes.
    let bad = d.join("bad.raw");
    let out = run(&mut mk(&["copy", &format!("{t}@{id0}"), s(&bad)]));
    assert!(!out.status.success(), "a damaged snapshot restored\n{}", out.describe());
    api.flip(bucket, victim, 300);
    let v = run_ok(&mut mk(&["repo", "verify", &repo]));
    assert!(v.stdout.contains("no damage"), "{}", v.describe());

    // forget the first snapshot, gc: objects leave the bucket, the other restores.
    let before = api.objects(bucket, &format!("{prefix}/"));
    let f = Json::must_parse(&run_ok(&mut mk(&["repo", "forget", "--keep-last", "1", "--json", &t])).stdout);
    assert_eq!(f.array_at("removed").len(), 1, "{f}");
    exp.forget(&repo);
    assert!(!api.objects(bucket, &format!("{prefix}/snapshots/")).keys().any(|k| k.ends_with(&id0)), "manifest left");
    let gc = run_ok(&mut mk(&["repo", "gc", "--repack", "0", &repo]));
    let after = api.objects(bucket, &format!("{prefix}/"));
    let gone: Vec<&String> = before.keys().filter(|k| k.contains("/data/") && !after.contains_key(*k)).collect();
    assert!(!gone.is_empty(), "gc removed no pack from the bucket\n{}", gc.describe());
    let bytes = |m: &BTreeMap<String, u64>| m.iter().filter(|(k, _)| k.contains("/data/")).map(|(_, n)| n).sum::<u64>();
    assert!(bytes(&after) < bytes(&before), "gc freed nothing: {before:?} -> {after:?}");
    assert!(after.keys().all(|k| !k.contains("/locks/")), "locks left: {after:?}");
    exp.assert_restore(&repo, None, d, "forget and gc");
    let c = run_ok(&mut mk(&["repo", "check", &repo]));
    assert!(
        c.stdout.contains("no damage") && !format!("{}{}", c.stdout, c.stderr).contains("in no index"),
        "{}",
        c.describe()
    );
    let v = run_ok(&mut mk(&["repo", "verify", &repo]));
    assert!(v.stdout.contains("no damage"), "{}", v.describe());
    let st = Json::must_parse(&run_ok(&mut mk(&["repo", "stats", "--json", &repo])).stdout);
    assert_eq!(st.u64_at("snapshots"), 1, "{st}");
    assert_eq!(st.u64_at("disks"), 1, "{st}");
    assert_eq!(st.u64_at("logical"), len as u64, "{st}");
    assert_eq!(
        st.u64_at("store_bytes"),
        bytes(&after) + { after.iter().filter(|(k, _)| k.contains("/index/")).map(|(_, n)| n).sum::<u64>() },
        "{st}\n{after:?}"
    );
}

fn hash(mk: Mk, src: &str) -> String {
    let out = run_ok(&mut mk(&["hash", src]));
    out.stdout.split_whitespace().next().unwrap().to_string()
}

fn moto_api() -> S3Api {
    S3Api {
        endpoint: moto().endpoint.clone(),
        key_id: "AKIDFERRYTEST".into(),
        secret: "ferry-secret-never-printed".into(),
    }
}

fn plain(args: &[&str]) -> Command {
    let mut c = s3ferry(args);
    c.env_remove("FERRY_PASSWORD").env_remove("FERRY_PASSWORD_FILE").env_remove("RUST_LOG");
    c
}

fn encrypted(args: &[&str]) -> Command {
    let mut c = plain(args);
    c.env("FERRY_PASSWORD", "s3 horse battery");
    c
}

#[test]
fn repository_on_moto() {
    moto();
    make_bucket("repo-s3-plain");
    let dir = tempfile::tempdir().unwrap();
    repository_flow(&moto_api(), plain, "repo-s3-plain", "backups/host1", false, dir.path());
}

#[test]
fn encrypted_repository_on_moto() {
    moto();
    make_bucket("repo-s3-enc");
    let dir = tempfile::tempdir().unwrap();
    repository_flow(&moto_api(), encrypted, "repo-s3-enc", "enc", true, dir.path());
    // Without the passphrase: refused, saying how to give it.
    let out = run(&mut plain(&["repo", "list", "s3://repo-s3-enc/enc"]));
    assert!(!out.status.success() && out.stderr.contains("FERRY_PASSWORD"), "{}", out.describe());
}
