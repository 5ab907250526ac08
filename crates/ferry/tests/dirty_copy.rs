//! Incremental backup against qemu: a qcow2 image with a persistent dirty bitmap `b0`
//! (made by qemu-img, written by qemu-io, which records the writes in b0), served by
//! `qemu-nbd -r -B b0`.
//!
//! - `ferry info --map=qemu:dirty-bitmap:b0` (and `--map`) print what nbdinfo prints,
//!   byte for byte, as text and as JSON.
//! - `ferry copy --dirty-bitmap b0` onto a raw copy of the image as it was before the
//!   writes gives the image after them, reading nothing but dirty data: qemu-nbd traces
//!   every request it receives, and each READ must lie in a range that is both dirty and
//!   data (dirty ranges that read as zeroes are written as zeroes, never read).
//! - `ferry copy --extents-from` with nbdinfo's JSON, qemu-img map's JSON of an overlay
//!   holding the same writes, and a raw bitmap, gives the same result.

use crate::common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A qemu-nbd on a Unix socket, killed when dropped.
struct QemuNbd {
    child: Child,
    sock: PathBuf,
    trace: PathBuf,
}

impl QemuNbd {
    fn start(dir: &Path, name: &str, args: &[&str], image: &Path) -> QemuNbd {
        require("qemu-nbd");
        let sock = dir.join(format!("{name}.sock"));
        let trace = dir.join(format!("{name}.trace"));
        let child = Command::new("qemu-nbd")
            .args(["-t", "-r", "-f", "qcow2", "-k"])
            .arg(&sock)
            .args(["--trace", "nbd_receive_request"])
            .args(args)
            .arg(image)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&trace).unwrap())
            .spawn()
            .expect("qemu-nbd");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !sock.exists() {
            assert!(Instant::now() < deadline, "qemu-nbd did not create {}", sock.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        QemuNbd { child, sock, trace }
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.sock.display())
    }

    /// READs the server received so far: (offset, length).
    fn reads(&self) -> Vec<(u64, u64)> {
        let text = std::fs::read_to_string(&self.trace).unwrap();
        let field = |l: &str, k: &str| -> u64 {
            let s = &l[l.find(k).unwrap() + k.len()..];
            s.split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
        };
        text.lines()
            .filter(|l| l.contains("Got request") && l.contains(".type = 0x0,"))
            .map(|l| (field(l, "from = "), field(l, "len = ")))
            .collect()
    }
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ferry(args: &[&str]) -> Output {
    let mut c = Command::new(ferry_bin());
    c.args(args);
    run(&mut c)
}

fn ferry_ok(args: &[&str]) -> Output {
    let out = ferry(args);
    assert!(out.status.success(), "{}", out.describe());
    out
}

fn qemu(tool: &str, args: &[&str]) -> Output {
    require(tool);
    run_ok(&mut cmd(tool, args))
}

/// The writes recorded in b0: data, zeroes, data across a cluster boundary, zeroes
/// over a hole, a single sector.
const WRITES: &[&str] =
    &["write -P 3 64k 64k", "write -z 4M 128k", "write -P 4 6M 100k", "write -z 9M 64k", "write -P 5 15M 512"];

fn qemu_io(img: &Path, cmds: &[&str]) {
    let mut args = vec!["-f", "qcow2"];
    for c in cmds {
        args.extend(["-c", c]);
    }
    args.push(img.to_str().unwrap());
    qemu("qemu-io", &args);
}

/// (dir, before.raw, after.raw, bitmap image, overlay holding the same writes).
fn images() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let s = |p: &PathBuf| p.to_str().unwrap().to_string();
    let (base, bm, ov, before, after) =
        (p("base.qcow2"), p("bm.qcow2"), p("ov.qcow2"), p("before.raw"), p("after.raw"));
    qemu("qemu-img", &["create", "-f", "qcow2", &s(&base), "16M"]);
    qemu_io(&base, &["write -P 1 0 1M", "write -P 2 4M 512k", "write -P 6 9M 1M", "write -z 12M 1M"]);
    qemu("qemu-img", &["convert", "-O", "raw", &s(&base), &s(&before)]);
    std::fs::copy(&base, &bm).unwrap();
    qemu("qemu-img", &["bitmap", "--add", &s(&bm), "b0"]);
    qemu_io(&bm, WRITES);
    qemu("qemu-img", &["create", "-f", "qcow2", "-b", &s(&base), "-F", "qcow2", &s(&ov)]);
    qemu_io(&ov, WRITES);
    qemu("qemu-img", &["convert", "-O", "raw", &s(&bm), &s(&after)]);
    qemu("qemu-img", &["compare", "-f", "qcow2", "-F", "raw", &s(&ov), &s(&after)]);
    assert_ne!(std::fs::read(&before).unwrap(), std::fs::read(&after).unwrap());
    (dir, before, after, bm, ov)
}

/// Ranges of a nbdinfo JSON map whose type has `bit` set (or clear when `set` is false).
fn map_ranges(json: &str, bit: u64, set: bool) -> Vec<(u64, u64)> {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .filter(|r| (r["type"].as_u64().unwrap() & bit != 0) == set)
        .map(|r| (r["offset"].as_u64().unwrap(), r["length"].as_u64().unwrap()))
        .collect()
}

fn inside(r: (u64, u64), set: &[(u64, u64)]) -> bool {
    set.iter().any(|&(o, l)| r.0 >= o && r.0 + r.1 <= o + l)
}

fn overlap(a: (u64, u64), b: (u64, u64)) -> u64 {
    (a.0 + a.1).min(b.0 + b.1).saturating_sub(a.0.max(b.0))
}

fn nbdinfo(args: &[&str]) -> String {
    qemu("nbdinfo", args).stdout
}

#[test]
fn map_matches_nbdinfo_byte_for_byte() {
    let (dir, _, _, bm, ov) = images();
    let srv = QemuNbd::start(dir.path(), "bm", &["-B", "b0"], &bm);
    let u = srv.uri();
    for map in ["--map=qemu:dirty-bitmap:b0", "--map", "--map=base:allocation"] {
        for json in [None, Some("--json")] {
            let mut args = vec![map, &u];
            args.extend(json);
            let want = nbdinfo(&args);
            let mut fargs = vec!["info"];
            fargs.extend(&args);
            let got = ferry_ok(&fargs).stdout;
            assert_eq!(got, want, "ferry info {args:?} differs from nbdinfo");
        }
    }
    // A local image gives what a server gives for it.
    for json in [None, Some("--json")] {
        let mut args = vec!["--map", &u];
        args.extend(json);
        let want = nbdinfo(&args);
        let mut fargs = vec!["info", "--map", bm.to_str().unwrap()];
        fargs.extend(json);
        assert_eq!(ferry_ok(&fargs).stdout, want, "ferry info --map of the local image");
    }
    // Allocation depth of an overlay.
    let srv2 = QemuNbd::start(dir.path(), "ov", &["-A"], &ov);
    let u2 = srv2.uri();
    for json in [None, Some("--json")] {
        let mut args = vec!["--map=qemu:allocation-depth", &u2];
        args.extend(json);
        let want = nbdinfo(&args);
        let mut fargs = vec!["info"];
        fargs.extend(&args);
        assert_eq!(ferry_ok(&fargs).stdout, want);
    }
    // Two contexts side by side: one row per range where neither changes.
    let out = ferry_ok(&["info", "--map", "--map=qemu:dirty-bitmap:b0", &u]).stdout;
    let rows: Vec<Vec<&str>> = out.lines().map(|l| l.split_whitespace().collect()).collect();
    assert!(rows.iter().any(|r| r[2..] == ["0", "data", "1", "dirty"]), "{out}");
    assert!(rows.iter().any(|r| r[2..] == ["3", "hole,zero", "1", "dirty"]), "{out}");
    let total: u64 = rows.iter().map(|r| r[1].parse::<u64>().unwrap()).sum();
    assert_eq!(total, 16 << 20);
    // A bitmap the server does not have: named, with what it offers.
    let out = ferry(&["info", "--map=qemu:dirty-bitmap:nope", &u]);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("qemu:dirty-bitmap:nope") && out.stderr.contains("base:allocation, qemu:dirty-bitmap:b0"),
        "{}",
        out.describe()
    );
}

#[test]
fn dirty_bitmap_copy_reads_only_dirty_data() {
    let (dir, before, after, bm, _) = images();
    let srv = QemuNbd::start(dir.path(), "bm", &["-B", "b0"], &bm);
    let u = srv.uri();
    let dirty = map_ranges(&nbdinfo(&["--map=qemu:dirty-bitmap:b0", "--json", &u]), 1, true);
    let data = map_ranges(&nbdinfo(&["--map", "--json", &u]), 2, false);
    assert!(!dirty.is_empty());
    let dirty_data: u64 = dirty.iter().flat_map(|&d| data.iter().map(move |&a| overlap(d, a))).sum();
    let dirty_bytes: u64 = dirty.iter().map(|r| r.1).sum();
    let dst = dir.path().join("dst.raw");
    std::fs::copy(&before, &dst).unwrap();
    let n0 = srv.reads().len();
    let out = ferry_ok(&["copy", "--dirty-bitmap", "b0", &u, dst.to_str().unwrap()]);
    assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&after).unwrap(), "copy differs from the image after");
    let reads = srv.reads()[n0..].to_vec();
    assert!(!reads.is_empty());
    for r in &reads {
        assert!(inside(*r, &dirty) && inside(*r, &data), "READ {r:?} outside the dirty data {dirty:?} / {data:?}");
    }
    assert_eq!(reads.iter().map(|r| r.1).sum::<u64>(), dirty_data, "bytes read: only the dirty data, once");
    assert!(out.stderr.contains(&format!("{dirty_bytes} bytes of {} dirty", 16 << 20)), "summary: {}", out.describe());
    // Refusals: no such bitmap (named, with what the export has), --hash, a destination
    // of another size, one that does not exist; nothing written.
    let out = ferry(&["copy", "--dirty-bitmap", "nope", &u, dst.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("qemu:dirty-bitmap:nope") && out.stderr.contains("qemu:dirty-bitmap:b0"),
        "{}",
        out.describe()
    );
    let out = ferry(&["copy", "--dirty-bitmap", "b0", "--hash", &u, dst.to_str().unwrap()]);
    assert!(!out.status.success());
    let small = dir.path().join("small.raw");
    std::fs::write(&small, vec![7u8; 1 << 20]).unwrap();
    let out = ferry(&["copy", "--dirty-bitmap", "b0", &u, small.to_str().unwrap()]);
    assert!(!out.status.success() && out.stderr.contains("same size"), "{}", out.describe());
    assert_eq!(std::fs::read(&small).unwrap(), vec![7u8; 1 << 20]);
    let missing = dir.path().join("missing.raw");
    let out = ferry(&["copy", "--dirty-bitmap", "b0", &u, missing.to_str().unwrap()]);
    assert!(!out.status.success() && out.stderr.contains("does not exist"), "{}", out.describe());
    assert!(!missing.exists());
    // Onto a qcow2 copy of the earlier state, updated in place.
    let q = dir.path().join("dst.qcow2");
    qemu("qemu-img", &["convert", "-O", "qcow2", before.to_str().unwrap(), q.to_str().unwrap()]);
    ferry_ok(&["copy", "--dirty-bitmap", "b0", &u, q.to_str().unwrap()]);
    qemu("qemu-img", &["compare", "-f", "qcow2", "-F", "raw", q.to_str().unwrap(), after.to_str().unwrap()]);
}

#[test]
fn extents_from_files() {
    let (dir, before, after, bm, ov) = images();
    let srv = QemuNbd::start(dir.path(), "bm", &["-B", "b0"], &bm);
    let u = srv.uri();
    let p = |n: &str| dir.path().join(n);
    let nbdinfo_json = nbdinfo(&["--map=qemu:dirty-bitmap:b0", "--json", &u]);
    std::fs::write(p("nbdinfo.json"), &nbdinfo_json).unwrap();
    let qemu_json = qemu("qemu-img", &["map", "--output=json", ov.to_str().unwrap()]).stdout;
    std::fs::write(p("qemu.json"), &qemu_json).unwrap();
    // A raw bitmap at b0's granularity (64 KiB), bit i LSB first.
    let dirty = map_ranges(&nbdinfo_json, 1, true);
    let mut bits = vec![0u8; (16 << 20) / (64 << 10) / 8];
    for (o, l) in &dirty {
        for g in o / (64 << 10)..(o + l).div_ceil(64 << 10) {
            bits[g as usize / 8] |= 1 << (g % 8);
        }
    }
    std::fs::write(p("cbt.bin"), &bits).unwrap();
    let bitmap_spec = format!("bitmap:64K:{}", p("cbt.bin").display());
    for (i, spec) in
        [p("nbdinfo.json").display().to_string(), p("qemu.json").display().to_string(), bitmap_spec].iter().enumerate()
    {
        let dst = p(&format!("dst{i}.raw"));
        std::fs::copy(&before, &dst).unwrap();
        let n0 = srv.reads().len();
        let out = ferry_ok(&["copy", "--extents-from", spec, &u, dst.to_str().unwrap()]);
        assert!(out.stderr.contains("changed"), "{}", out.describe());
        assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&after).unwrap(), "--extents-from {spec}");
        for r in &srv.reads()[n0..] {
            assert!(inside(*r, &dirty), "--extents-from {spec}: READ {r:?} outside {dirty:?}");
        }
    }
    // Bad input: out of range, unsorted, not a map.
    let bad = [
        (r#"[{ "offset": 33554432, "length": 65536, "type": 1}]"#, "past the end"),
        (r#"[{ "offset": 131072, "length": 65536, "type": 1}, { "offset": 0, "length": 65536, "type": 1}]"#, "sorted"),
        (r#"{"not": "a map"}"#, "not a JSON map"),
        (r#"[{ "offset": 0, "length": 65536, "type": 0, "description": "data"}]"#, "another context"),
    ];
    let dst = p("dst0.raw");
    for (j, want) in bad {
        std::fs::write(p("bad.json"), j).unwrap();
        let out = ferry(&["copy", "--extents-from", p("bad.json").to_str().unwrap(), &u, dst.to_str().unwrap()]);
        assert!(!out.status.success() && out.stderr.contains(want), "{j}: {}", out.describe());
    }
    let mut big = bits.clone();
    big.push(1);
    std::fs::write(p("cbt.bin"), &big).unwrap();
    let spec = format!("bitmap:64K:{}", p("cbt.bin").display());
    let out = ferry(&["copy", "--extents-from", &spec, &u, dst.to_str().unwrap()]);
    assert!(!out.status.success() && out.stderr.contains("past the end"), "{}", out.describe());
    assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&after).unwrap(), "refused copies wrote nothing");
}

/// The same from qemu-storage-daemon exporting the bitmap (`bitmaps.0=b0`), which also
/// speaks extended headers.
#[test]
fn dirty_bitmap_copy_from_qemu_storage_daemon() {
    require("qemu-storage-daemon");
    let (dir, before, after, bm, _) = images();
    let sock = dir.path().join("qsd.sock");
    let child = Command::new("qemu-storage-daemon")
        .arg("--blockdev")
        .arg(format!("driver=file,node-name=f0,filename={},read-only=on", bm.display()))
        .args(["--blockdev", "driver=qcow2,node-name=q0,file=f0,read-only=on"])
        .arg("--nbd-server")
        .arg(format!("addr.type=unix,addr.path={}", sock.display()))
        .args(["--export", "type=nbd,id=e0,node-name=q0,name=disk,bitmaps.0=b0"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-storage-daemon");
    let _qsd = QemuNbd { child, sock: sock.clone(), trace: dir.path().join("none") };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sock.exists() {
        assert!(Instant::now() < deadline, "qemu-storage-daemon did not create {}", sock.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    let u = format!("nbd+unix:///disk?socket={}", sock.display());
    let want = nbdinfo(&["--map=qemu:dirty-bitmap:b0", &u]);
    assert_eq!(ferry_ok(&["info", "--map=qemu:dirty-bitmap:b0", &u]).stdout, want);
    let dst = dir.path().join("dst.raw");
    std::fs::copy(&before, &dst).unwrap();
    ferry_ok(&["copy", "--dirty-bitmap", "b0", &u, dst.to_str().unwrap()]);
    assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&after).unwrap());
}
