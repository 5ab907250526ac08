//! qcow2 overlays: `Qcow2::create_with` and `ferry copy --backing FILE SRC DST`. qemu-img
//! reads the backing file name and format ferry writes, checks the overlays clean and
//! compares them with the source; a zero range of the source becomes zero clusters in
//! the overlay (never the backing file's data), and what is never written reads FILE.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use ferry_backend::Backend;
use ferry_qcow2::{Backing, Qcow2};
use std::fs;
use std::path::Path;
use std::process::Command;

const SIZE: usize = 8 << 20;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn qemu_img(args: &[&str]) -> Output {
    require("qemu-img");
    run_ok(&mut cmd("qemu-img", args))
}

fn ferry(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args).current_dir(dir);
    c
}

fn info(img: &Path) -> Json {
    Json::must_parse(&qemu_img(&["info", "--output=json", s(img)]).stdout)
}

/// Random bytes with no zero 512-byte sector: a backing file whose data shows wherever an
/// overlay wrongly reads through.
fn busy_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut v = Rng::new(seed).bytes(len);
    for c in v.chunks_mut(512) {
        c[0] |= 1;
    }
    v
}

fn check_clean(img: &Path) {
    let out = qemu_img(&["check", s(img)]);
    assert!(out.stdout.contains("No errors"), "{}", out.describe());
}

/// A source with holes and zero runs, copied over a backing file full of data, reads
/// back identical to the source; nothing in the overlay reads through.
fn copy_over(dir: &Path, backing: &Path, src: &str, src_fmt: &str) {
    let dst = dir.join("out.qcow2");
    let _ = fs::remove_file(&dst);
    run_ok(&mut ferry(dir, &["copy", "--backing", s(backing), src, s(&dst)]));
    check_clean(&dst);
    let i = info(&dst);
    assert_eq!(i.at("backing-filename").as_str(), backing.file_name().and_then(|n| n.to_str()), "{i}");
    let cmp = qemu_img(&["compare", "-f", src_fmt, "-F", "qcow2", src, s(&dst)]);
    assert!(cmp.stdout.contains("identical"), "{}", cmp.describe());
    // Every range is this image's own (depth 0 in qemu-img map): data or zero clusters.
    let map = Json::must_parse(&qemu_img(&["map", "--output=json", s(&dst)]).stdout);
    for e in map.as_array().unwrap() {
        assert_eq!(e.u64_at("depth"), 0, "a range reads the backing file: {e}");
    }
    // qemu reads the zero ranges as zeroes through the whole chain.
    let flat = dir.join("flat.raw");
    qemu_img(&["convert", "-O", "raw", s(&dst), s(&flat)]);
    assert!(fs::read(&flat).unwrap() == fs::read(dir.join("src.raw")).unwrap(), "flattened overlay differs");
}

fn sources(dir: &Path) -> Vec<u8> {
    let data = data_with_holes(SIZE, 7);
    write_sparse_file(dir, "src.raw", &data);
    qemu_img(&["convert", "-f", "raw", "-O", "qcow2", s(&dir.join("src.raw")), s(&dir.join("src.qcow2"))]);
    data
}

#[test]
fn copy_backing_raw_file() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    sources(dir);
    fs::write(dir.join("base.raw"), busy_bytes(SIZE, 1)).unwrap();
    copy_over(dir, &dir.join("base.raw"), s(&dir.join("src.raw")), "raw");
    assert_eq!(info(&dir.join("out.qcow2")).at("backing-filename-format").as_str(), Some("raw"));
    copy_over(dir, &dir.join("base.raw"), s(&dir.join("src.qcow2")), "qcow2");
    // --sparse=false writes the zeroes as data: still identical.
    let dst = dir.join("dense.qcow2");
    run_ok(&mut ferry(dir, &["copy", "--sparse=false", "--backing", "base.raw", "src.raw", "dense.qcow2"]));
    check_clean(&dst);
    let cmp = qemu_img(&["compare", "-f", "raw", "-F", "qcow2", s(&dir.join("src.raw")), s(&dst)]);
    assert!(cmp.stdout.contains("identical"), "{}", cmp.describe());
}

#[test]
fn copy_backing_qcow2_image() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    sources(dir);
    fs::write(dir.join("b.raw"), busy_bytes(SIZE, 2)).unwrap();
    qemu_img(&["convert", "-f", "raw", "-O", "qcow2", s(&dir.join("b.raw")), s(&dir.join("base.qcow2"))]);
    copy_over(dir, &dir.join("base.qcow2"), s(&dir.join("src.raw")), "raw");
    let i = info(&dir.join("out.qcow2"));
    assert_eq!(i.at("backing-filename-format").as_str(), Some("qcow2"), "{i}");
    copy_over(dir, &dir.join("base.qcow2"), s(&dir.join("src.qcow2")), "qcow2");
    // A qcow2 spec destination without the extension.
    run_ok(&mut ferry(dir, &["copy", "--backing", "base.qcow2", "src.qcow2", "qcow2:plain.img"]));
    check_clean(&dir.join("plain.img"));
    let cmp =
        qemu_img(&["compare", "-f", "qcow2", "-F", "qcow2", s(&dir.join("src.qcow2")), s(&dir.join("plain.img"))]);
    assert!(cmp.stdout.contains("identical"), "{}", cmp.describe());
}

/// The name stored is relative to the overlay's directory, whatever the working
/// directory: the two directories can move together.
#[test]
fn relative_backing_name() {
    let d = tempfile::tempdir().unwrap();
    let top = d.path().join("top");
    for sub in ["base", "out", "work"] {
        fs::create_dir_all(top.join(sub)).unwrap();
    }
    let data = sources(&top.join("work"));
    fs::write(top.join("base/b.raw"), busy_bytes(SIZE, 3)).unwrap();
    run_ok(&mut ferry(&top.join("work"), &["copy", "--backing", "../base/b.raw", "src.raw", "../out/o.qcow2"]));
    let i = info(&top.join("out/o.qcow2"));
    assert_eq!(i.at("backing-filename").as_str(), Some("../base/b.raw"), "{i}");
    let moved = d.path().join("moved");
    fs::rename(&top, &moved).unwrap();
    let flat = moved.join("flat.raw");
    qemu_img(&["convert", "-O", "raw", s(&moved.join("out/o.qcow2")), s(&flat)]);
    assert!(fs::read(&flat).unwrap() == data, "moved overlay reads differently");
    // An absolute FILE is stored relative too.
    run_ok(&mut ferry(
        &moved,
        &["copy", "--backing", s(&moved.join("base/b.raw")), "work/src.raw", s(&moved.join("out/abs.qcow2"))],
    ));
    assert_eq!(info(&moved.join("out/abs.qcow2")).at("backing-filename").as_str(), Some("../base/b.raw"));
}

/// An overlay made through the library: qemu-img info names the backing file and
/// format, check is clean, and the ranges never written read the backing file.
#[test]
fn create_with_reads_through_unwritten_ranges() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let base = busy_bytes(SIZE, 4);
    fs::write(dir.join("base.raw"), &base).unwrap();
    let img = dir.join("o.qcow2");
    let b = Backing::for_image(&dir.join("base.raw"), &img).unwrap();
    let mut want = base.clone();
    {
        let q = Qcow2::create_with(&img, SIZE as u64, 65536, Some(&b)).unwrap();
        q.write(&[7u8; 100_000], 1_000_000, false).unwrap();
        q.zero(3 << 20, 1 << 20, ferry_backend::ZeroMode { may_trim: true, fast: false }, false).unwrap();
        q.zero(5_000_000, 1000, ferry_backend::ZeroMode { may_trim: true, fast: false }, false).unwrap();
        q.finish().unwrap();
    }
    want[1_000_000..1_100_000].fill(7);
    want[3 << 20..4 << 20].fill(0);
    want[5_000_000..5_001_000].fill(0);
    check_clean(&img);
    let i = info(&img);
    assert_eq!(i.at("backing-filename").as_str(), Some("base.raw"), "{i}");
    assert_eq!(i.at("backing-filename-format").as_str(), Some("raw"), "{i}");
    assert_eq!(i.at("virtual-size").as_u64(), Some(SIZE as u64));
    let flat = dir.join("flat.raw");
    qemu_img(&["convert", "-O", "raw", s(&img), s(&flat)]);
    assert_same_bytes(&fs::read(&flat).unwrap(), &want, "overlay read by qemu");
    // ferry reads it the same, and writes more to it reopened.
    let q = Qcow2::open(&img, false).unwrap();
    let mut got = vec![0u8; SIZE];
    q.read(&mut got, 0).unwrap();
    assert_same_bytes(&got, &want, "overlay read by ferry");
    q.write(&[9u8; 10], 7 << 20, false).unwrap();
    drop(q);
    want[7 << 20..(7 << 20) + 10].fill(9);
    check_clean(&img);
    qemu_img(&["convert", "-O", "raw", s(&img), s(&flat)]);
    assert_same_bytes(&fs::read(&flat).unwrap(), &want, "overlay after a second write");
}

#[test]
fn bad_backing_files_are_refused_before_anything_is_written() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    sources(dir);
    fs::write(dir.join("small.raw"), busy_bytes(SIZE / 2, 5)).unwrap();
    fs::write(dir.join("base.raw"), busy_bytes(SIZE, 6)).unwrap();
    let fails = |args: &[&str], says: &[&str]| {
        let out = run_fails(&mut ferry(dir, args));
        for w in says {
            assert!(out.stderr.contains(w), "expected {w:?}\n{}", out.describe());
        }
    };
    fails(&["copy", "--backing", "missing.raw", "src.raw", "o.qcow2"], &["missing.raw", "No such file"]);
    fails(&["copy", "--backing", "small.raw", "src.raw", "o.qcow2"], &["4194304 bytes", "8388608 bytes"]);
    qemu_img(&["create", "-q", "-f", "qcow2", s(&dir.join("small.qcow2")), "1M"]);
    fails(&["copy", "--backing", "small.qcow2", "src.raw", "o.qcow2"], &["1048576 bytes", "8388608 bytes"]);
    assert!(!dir.join("o.qcow2").exists());
    // Not a qcow2 destination, not a local one.
    fails(&["copy", "--backing", "base.raw", "src.raw", "o.raw"], &["qcow2"]);
    assert!(!dir.join("o.raw").exists());
    fails(&["copy", "--backing", "base.raw", "src.raw", "null:"], &["--backing"]);
    // The destination is the backing file, or in its chain: refused, left whole.
    let before = fs::read(dir.join("base.raw")).unwrap();
    fails(&["copy", "--backing", "base.raw", "src.raw", "qcow2:base.raw"], &["own backing chain"]);
    assert!(fs::read(dir.join("base.raw")).unwrap() == before);
    run_ok(&mut ferry(dir, &["copy", "--backing", "base.raw", "src.raw", "mid.qcow2"]));
    let mid = fs::read(dir.join("mid.qcow2")).unwrap();
    fails(&["copy", "--backing", "top.qcow2", "src.raw", "mid.qcow2"], &["top.qcow2"]);
    qemu_img(&["create", "-q", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", s(&dir.join("top.qcow2"))]);
    fails(&["copy", "--backing", "top.qcow2", "src.raw", "mid.qcow2"], &["own backing chain"]);
    assert!(fs::read(dir.join("mid.qcow2")).unwrap() == mid);
    check_clean(&dir.join("top.qcow2"));
}

/// FILE is locked as a backing file: while another program writes a qcow2 FILE, no
/// overlay of it is made (a raw backing file's writers are not kept out, as qemu does
/// not).
#[test]
fn a_backing_file_being_written_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    sources(dir);
    fs::write(dir.join("b.raw"), busy_bytes(SIZE, 8)).unwrap();
    qemu_img(&["convert", "-f", "raw", "-O", "qcow2", s(&dir.join("b.raw")), s(&dir.join("base.qcow2"))]);
    let mut server = Server::unix(s(&dir.join("base.qcow2")), &[]);
    let out = run_fails(&mut ferry(dir, &["copy", "--backing", "base.qcow2", "src.raw", "o.qcow2"]));
    assert!(out.stderr.contains("lock"), "{}", out.describe());
    assert!(!dir.join("o.qcow2").exists());
    server.stop();
    run_ok(&mut ferry(dir, &["copy", "--backing", "base.qcow2", "src.raw", "o.qcow2"]));
    check_clean(&dir.join("o.qcow2"));
}
