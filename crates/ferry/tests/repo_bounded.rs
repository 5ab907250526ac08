//! Memory that does not grow with the disk (issue 35, part "mem35"):
//!
//! * a day-2 `--extents-from` backup of a few MiB of a 256 GiB sparse disk peaks well
//!   under the 128 MiB that its chunk list (32 bytes a chunk, 4M chunks) alone took in
//!   memory before: the list is in an unlinked file in the cache directory, read back a
//!   window at a time. The snapshot is checked, restored, and its changed chunks compared.

use crate::common::*;
use crate::incremental_backup::s;
use std::fs;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

/// `ferry ARGS` on `host`, under GNU time: its output, and its peak RSS in KiB.
fn measured(host: &Path, args: &[&str]) -> (Output, u64) {
    require("/usr/bin/time");
    let mut c = Command::new("/usr/bin/time");
    c.args(["-f", "peak-rss-kib %M"]).arg(ferry_bin()).args(args);
    c.env("FERRY_STATE_DIR", host).env("FERRY_CACHE_DIR", host.join("cache")).env_remove("RUST_LOG");
    let out = run_ok(&mut c);
    let kib = out
        .stderr
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("peak-rss-kib "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no peak RSS from GNU time: {}", out.describe()));
    (out, kib)
}

fn id_of(out: &Output) -> String {
    let j = crate::common::json::Json::must_parse(out.stdout.trim());
    use crate::common::json::JsonExt;
    j.at("id").as_str().unwrap_or_else(|| panic!("no id: {}", out.describe())).to_string()
}

/// The chunks changed on day 2: 64 of them, spread over the disk.
fn changed(size: u64) -> Vec<u64> {
    (0..64u64).map(|i| (i * (size / 64) + i * 7 * 65536) / 65536 * 65536).collect()
}

#[test]
fn a_day2_backup_of_a_large_sparse_disk_keeps_its_chunk_list_out_of_memory() {
    let dir = tempfile::Builder::new().prefix("ferry-bounded-day2").tempdir().unwrap();
    let d = dir.path();
    let host = d.join("host");
    fs::create_dir(&host).unwrap();
    let repo = d.join("repo");
    run_ok(ferry_cmd_on(&host, &["repo", "init", s(&repo)]).as_mut());
    let size: u64 = 256 << 30;
    let disk = d.join("disk.raw");
    let f = fs::File::create(&disk).unwrap();
    f.set_len(size).unwrap();
    let chunks = changed(size);
    for (i, at) in chunks.iter().enumerate() {
        f.write_all_at(&pattern_bytes(*at + i as u64, 65536), *at).unwrap();
    }
    drop(f);
    let target = format!("{}::big", repo.display());
    let (out, day1_kib) = measured(&host, &["backup", "--json", s(&disk), &target]);
    let day1 = id_of(&out);
    // Day 2: every changed chunk written again, listed in the map.
    let f = fs::OpenOptions::new().write(true).open(&disk).unwrap();
    let mut want = Vec::new();
    let mut map = fs::File::create(d.join("map.json")).unwrap();
    write!(map, "[").unwrap();
    for (i, at) in chunks.iter().enumerate() {
        let data = pattern_bytes(*at + 1000 + i as u64, 65536);
        f.write_all_at(&data, *at).unwrap();
        want.push((*at, data));
        write!(map, "{}{{\"offset\": {at}, \"length\": 65536, \"type\": 1}}", if i > 0 { "," } else { "" }).unwrap();
    }
    writeln!(map, "]").unwrap();
    drop((f, map));
    let map = d.join("map.json");
    let (out, day2_kib) =
        measured(&host, &["backup", "--json", "--extents-from", s(&map), "--since", &day1, s(&disk), &target]);
    let day2 = id_of(&out);
    eprintln!(
        "peak RSS: day 1 {day1_kib} KiB, day 2 {day2_kib} KiB (the chunk list is {} KiB)",
        size / 65536 * 32 / 1024
    );
    // The chunk list alone is 128 MiB; what a backup holds besides it is far less.
    assert!(day2_kib < 96 * 1024, "a day-2 backup of a 256 GiB disk peaked at {day2_kib} KiB");
    assert!(day1_kib < 96 * 1024, "a full backup of a 256 GiB sparse disk peaked at {day1_kib} KiB");
    run_ok(ferry_cmd_on(&host, &["repo", "check", s(&repo)]).as_mut());
    // The new snapshot restored (holes stay holes): each changed chunk as written.
    let restored = d.join("restored.raw");
    run_ok(ferry_cmd_on(&host, &["copy", &format!("{target}@{day2}"), s(&restored)]).as_mut());
    let r = fs::File::open(&restored).unwrap();
    assert_eq!(r.metadata().unwrap().len(), size);
    let mut got = vec![0u8; 65536];
    for (at, data) in &want {
        r.read_exact_at(&mut got, *at).unwrap();
        assert!(got == *data, "the chunk at {at} differs");
    }
}

fn ferry_cmd_on(host: &Path, args: &[&str]) -> Box<Command> {
    let mut c = Command::new(ferry_bin());
    c.args(args).env("FERRY_STATE_DIR", host).env("FERRY_CACHE_DIR", host.join("cache")).env_remove("RUST_LOG");
    Box::new(c)
}
