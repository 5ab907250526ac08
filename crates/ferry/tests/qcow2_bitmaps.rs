//! Persistent dirty bitmaps of qcow2 images ferry writes stay true: what ferry serve
//! records for a client's writes, zeroes and trims is what qemu records for the same
//! operations; a clean stop writes them back (qemu-img check clean, qemu-nbd -B serves
//! them); kill -9 leaves them in use (qemu-nbd -B refuses them). `ferry bitmap` manages
//! them as qemu-img bitmap does, and `ferry info` lists them.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn qemu_img(args: &[&str]) -> Output {
    require("qemu-img");
    run_ok(&mut cmd("qemu-img", args))
}

fn ferry(args: &[&str]) -> Output {
    run(&mut cmd(ferry_bin().to_str().unwrap(), args))
}

fn ferry_ok(args: &[&str]) -> Output {
    let o = ferry(args);
    assert!(o.status.success(), "ferry {args:?}: {}", o.describe());
    o
}

fn qemu_io(opts: &[&str], target: &str, cmds: &[&str]) {
    require("qemu-io");
    let mut c = cmd("qemu-io", opts);
    for x in cmds {
        c.arg("-c").arg(x);
    }
    c.arg(target);
    let out = run(&mut c);
    let all = format!("{}{}", out.stdout, out.stderr);
    assert!(!all.contains("fail") && !all.contains("qemu-io:"), "{cmds:?} on {target}:\n{all}");
}

fn check_clean(img: &Path) {
    let out = qemu_img(&["check", s(img)]);
    assert!(out.stdout.contains("No errors were found"), "{}", out.describe());
}

/// Bitmaps as `qemu-img info --output=json` lists them: (name, granularity, flags).
fn bitmaps(img: &Path) -> Vec<(String, u64, Vec<String>)> {
    let v = Json::must_parse(&qemu_img(&["info", "--output=json", s(img)]).stdout);
    let data = v.at("format-specific").at("data");
    if data.get("bitmaps").is_none() {
        return Vec::new();
    }
    data.array_at("bitmaps")
        .iter()
        .map(|b| {
            let flags = b.array_at("flags").iter().map(|f| f.as_str().unwrap().to_string()).collect();
            (b.at("name").as_str().unwrap().to_string(), b.at("granularity").as_u64().unwrap(), flags)
        })
        .collect()
}

/// What qemu serves of bitmap `b` (qemu-nbd -r -B, read with nbdinfo --map).
fn qemu_map(img: &Path, b: &str) -> Result<String, String> {
    require("qemu-nbd");
    require("nbdinfo");
    let map = format!("--map=qemu:dirty-bitmap:{b}");
    let mut c = cmd("nbdinfo", [&map, "--json", "--", "[", "qemu-nbd", "-r", "-B", b, "-f", "qcow2", s(img), "]"]);
    let out = run_timeout(&mut c, Duration::from_secs(30));
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(out.stderr)
    }
}

fn twins(dir: &Path) -> (PathBuf, PathBuf) {
    let a = dir.join("ferry.qcow2");
    let b = dir.join("qemu.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&a), "64M"]);
    qemu_io(&["-f", "qcow2"], s(&a), &["write -P 0x11 0 8M"]);
    qemu_img(&["bitmap", "--add", s(&a), "b0"]);
    qemu_img(&["bitmap", "--add", "-g", "512", s(&a), "fine"]);
    qemu_img(&["bitmap", "--add", "-g", "2M", s(&a), "coarse"]);
    qemu_img(&["bitmap", "--add", "--disable", s(&a), "frozen"]);
    std::fs::copy(&a, &b).unwrap();
    (a, b)
}

const OPS: [&str; 6] = [
    "write -P 0x22 1M 70000",
    "write -P 0x33 33333333 1",
    "write -z -u 5M 1M",
    "write -z 7M 3000",
    "discard 2M 128k",
    "write -P 0x44 67104768 4096",
];

/// Stopped with SIGTERM (and, second round, by the end of --run), ferry serve leaves
/// the bitmaps as qemu would have them.
#[test]
fn served_writes_are_recorded_as_qemu_records_them() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = twins(dir.path());
    let before = bitmaps(&a);
    let mut server = ServerBuilder::new(s(&a)).start();
    qemu_io(&["-f", "raw"], &server.uri(), &OPS[..3]);
    let st = server.signal_and_wait(15, Duration::from_secs(20));
    assert!(st.success(), "{st:?}");
    // Second round: the --run command's end closes the image.
    let script = format!(
        "qemu-io -f raw {} \"$uri\"",
        OPS[3..].iter().map(|o| format!("-c '{o}'")).collect::<Vec<_>>().join(" ")
    );
    let sock = dir.path().join("s.sock");
    ferry_ok(&["serve", "--unix", s(&sock), "--run", &script, s(&a)]);
    qemu_io(&["-f", "qcow2"], s(&b), &OPS);
    check_clean(&a);
    assert_eq!(bitmaps(&a), before, "flags and granularities unchanged, none in use");
    for bm in ["b0", "fine", "coarse", "frozen"] {
        assert_eq!(qemu_map(&a, bm).unwrap(), qemu_map(&b, bm).unwrap(), "bitmap {bm}");
    }
    assert!(qemu_map(&a, "frozen").unwrap().contains("\"length\": 67108864, \"type\": 0"), "disabled: untouched");
    assert!(qemu_map(&a, "fine").unwrap().contains("\"type\": 1"));
    qemu_io(&["-f", "qcow2"], s(&a), &["read -P 0x22 1M 70000", "read -P 0x44 67104768 4096"]);
}

/// kill -9 leaves the enabled bitmaps in use: qemu refuses them; the disabled one is
/// still served.
#[test]
fn kill_9_leaves_the_bitmap_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _) = twins(dir.path());
    let mut server = ServerBuilder::new(s(&a)).start();
    qemu_io(&["-f", "raw"], &server.uri(), &["write -P 0x55 4M 64k", "flush"]);
    server.signal_and_wait(9, Duration::from_secs(20));
    let flags: Vec<_> = bitmaps(&a).into_iter().map(|(n, _, f)| (n, f)).collect();
    assert!(flags.contains(&("b0".to_string(), vec!["in-use".to_string(), "auto".to_string()])), "{flags:?}");
    assert!(flags.contains(&("frozen".to_string(), vec![])), "{flags:?}");
    let e = qemu_map(&a, "b0").expect_err("qemu-nbd served an inconsistent bitmap");
    assert!(e.contains("inconsistent"), "{e}");
    qemu_map(&a, "frozen").unwrap();
    // ferry info shows it; ferry keeps it as it is through another clean session.
    let out = ferry_ok(&["info", s(&a)]);
    assert!(out.stdout.contains("bitmap \"b0\": granularity 65536 bytes, flags: in-use, auto"), "{}", out.stdout);
    let mut server = ServerBuilder::new(s(&a)).start();
    qemu_io(&["-f", "raw"], &server.uri(), &["write -P 0x66 9M 4k"]);
    server.signal_and_wait(15, Duration::from_secs(20));
    assert!(bitmaps(&a).iter().any(|(n, _, f)| n == "b0" && f.contains(&"in-use".to_string())));
    check_clean(&a);
    let e = ferry(&["bitmap", "--clear", s(&a), "b0"]);
    assert!(!e.status.success() && e.stderr.contains("inconsistent"), "{}", e.describe());
    // Removing it is how a user starts over.
    ferry_ok(&["bitmap", "--remove", s(&a), "b0"]);
    check_clean(&a);
    assert!(!bitmaps(&a).iter().any(|(n, _, _)| n == "b0"));
}

/// `ferry bitmap` with qemu-img bitmap's spelling; each result checked by qemu-img.
#[test]
fn ferry_bitmap_manages_as_qemu_img_does() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("m.qcow2");
    let other = dir.path().join("o.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&a), "32M"]);
    qemu_img(&["create", "-q", "-f", "qcow2", s(&other), "32M"]);
    ferry_ok(&["bitmap", "--add", s(&a), "b0"]);
    ferry_ok(&["bitmap", "--add", "-g", "512", "--disabled", s(&a), "tiny"]);
    ferry_ok(&["bitmap", "--add", "--granularity", "4M", s(&a), "big"]);
    check_clean(&a);
    assert_eq!(
        bitmaps(&a),
        [
            ("b0".to_string(), 65536, vec!["auto".to_string()]),
            ("tiny".to_string(), 512, vec![]),
            ("big".to_string(), 4 << 20, vec!["auto".to_string()]),
        ]
    );
    // ferry info lists them as qemu-img info does.
    let j = Json::must_parse(&ferry_ok(&["info", "--json", s(&a)]).stdout);
    let first = &j.array_at("bitmaps")[0];
    assert_eq!(first.at("name").as_str(), Some("b0"));
    assert_eq!(first.at("granularity").as_u64(), Some(65536));
    assert_eq!(first.array_at("flags")[0].as_str(), Some("auto"));
    // A write recorded by qemu in another image, merged in from there.
    qemu_img(&["bitmap", "--add", s(&other), "src"]);
    qemu_io(&["-f", "qcow2"], s(&other), &["write 3M 4k"]);
    ferry_ok(&["bitmap", "--merge", "src", "-b", s(&other), s(&a), "tiny"]);
    check_clean(&a);
    let m = qemu_map(&a, "tiny").unwrap();
    assert!(m.contains("\"offset\": 3145728, \"length\": 65536, \"type\": 1"), "{m}");
    // Several operations in order: enable then merge from this image, clear, disable.
    ferry_ok(&["bitmap", "--enable", "--merge", "tiny", s(&a), "b0"]);
    assert!(qemu_map(&a, "b0").unwrap().contains("\"offset\": 3145728, \"length\": 65536, \"type\": 1"));
    ferry_ok(&["bitmap", "--clear", "--disable", s(&a), "tiny"]);
    check_clean(&a);
    assert!(qemu_map(&a, "tiny").unwrap().contains("\"offset\": 0, \"length\": 33554432, \"type\": 0"));
    assert_eq!(bitmaps(&a)[1].2, Vec::<String>::new());
    // Errors: named, nothing changed.
    let before = std::fs::read(&a).unwrap();
    let e = ferry(&["bitmap", "--remove", s(&a), "nope"]);
    assert!(!e.status.success() && e.stderr.contains("no bitmap named \"nope\""), "{}", e.describe());
    let e = ferry(&["bitmap", "--add", "-g", "1000", s(&a), "x"]);
    assert!(!e.status.success() && e.stderr.contains("granularity 1000"), "{}", e.describe());
    let e = ferry(&["bitmap", "--add", s(&a), "b0"]);
    assert!(!e.status.success() && e.stderr.contains("already has a bitmap named \"b0\""), "{}", e.describe());
    assert_eq!(std::fs::read(&a).unwrap(), before);
    // Refused while another program writes the image.
    let server = ServerBuilder::new(s(&a)).start();
    let e = ferry(&["bitmap", "--add", s(&a), "later"]);
    assert!(!e.status.success() && e.stderr.contains("in use"), "{}", e.describe());
    drop(server);
    for n in ["b0", "tiny", "big"] {
        ferry_ok(&["bitmap", "--remove", s(&a), n]);
    }
    check_clean(&a);
    assert!(bitmaps(&a).is_empty());
    // A fresh bitmap on the image works with qemu again.
    ferry_ok(&["bitmap", "--add", s(&a), "again"]);
    qemu_io(&["-f", "qcow2"], s(&a), &["write 1M 4k"]);
    check_clean(&a);
    assert!(qemu_map(&a, "again").unwrap().contains("\"offset\": 1048576, \"length\": 65536, \"type\": 1"));
}

/// Writes on several connections at once (nbdcopy, 4 connections) are all recorded:
/// the same copy into a qemu-nbd twin records the same bitmaps.
#[test]
fn multi_conn_writes_are_all_recorded() {
    require("nbdcopy");
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = twins(dir.path());
    // A sparse source: data here and there, holes between.
    let src = dir.path().join("src.raw");
    let f = std::fs::File::create(&src).unwrap();
    f.set_len(64 << 20).unwrap();
    use std::os::unix::fs::FileExt;
    for i in 0..40u64 {
        let at = i * 1_600_007 % (63 << 20);
        f.write_all_at(&vec![i as u8 + 1; 5000 + (i as usize * 777) % 90_000], at).unwrap();
    }
    drop(f);
    let copy = |dst: &[&str]| {
        let mut c = cmd("nbdcopy", ["--connections=4", "--requests=16", "--destination-is-zero", s(&src)]);
        c.args(dst);
        let o = run_timeout(&mut c, Duration::from_secs(60));
        assert!(o.status.success(), "{}", o.describe());
    };
    let server = ServerBuilder::new(s(&a)).start();
    copy(&[&server.uri()]);
    drop(server);
    copy(&["--", "[", "qemu-nbd", "-f", "qcow2", s(&b), "]"]);
    check_clean(&a);
    for bm in ["b0", "fine", "coarse", "frozen"] {
        assert_eq!(qemu_map(&a, bm).unwrap(), qemu_map(&b, bm).unwrap(), "bitmap {bm}");
    }
    assert!(qemu_map(&a, "fine").unwrap().matches("\"type\": 1").count() >= 20);
}
