//! qcow2 images made by qemu-img: ferry serves, copies, hashes and describes them, and
//! qemu reads (and `qemu-img check`s) every image ferry wrote.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use std::fs;
use std::path::{Path, PathBuf};

const SIZE: usize = 8 << 20;

fn qemu_img(args: &[&str]) -> Output {
    require("qemu-img");
    run_ok(&mut cmd("qemu-img", args))
}

fn qemu_io(fmt: &str, target: &str, cmds: &[&str]) {
    require("qemu-io");
    let mut c = cmd("qemu-io", ["-f", fmt]);
    for x in cmds {
        c.arg("-c").arg(x);
    }
    c.arg(target);
    let out = run_ok(&mut c);
    assert!(!out.stdout.contains("failed") && !out.stderr.contains("failed"), "qemu-io failed\n{}", out.describe());
}

fn ferry(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args);
    c
}

use std::process::Command;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `qemu-img check` finds no errors and no leaks.
fn check_clean(img: &Path) {
    let out = qemu_img(&["check", s(img)]);
    assert!(out.stdout.contains("No errors were found"), "{}", out.describe());
}

/// The source data every image is made from: data, zero blocks and holes.
fn source(dir: &Path) -> (PathBuf, Vec<u8>) {
    let data = data_with_holes(SIZE, 11);
    (write_sparse_file(dir, "src.raw", &data), data)
}

/// Images of every kind qemu makes, each holding the guest content of `src`, with the
/// raw conversion qemu-img makes of each.
fn images(dir: &Path, src: &Path) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    let conv = |name: &str, extra: &[&str]| {
        let p = dir.join(format!("{name}.qcow2"));
        let mut a = vec!["convert", "-f", "raw", "-O", "qcow2"];
        a.extend_from_slice(extra);
        a.extend_from_slice(&[s(src), s(&p)]);
        qemu_img(&a);
        (name.to_string(), p)
    };
    out.push(conv("v2", &["-o", "compat=0.10"]));
    out.push(conv("v3-512", &["-o", "compat=1.1,cluster_size=512"]));
    out.push(conv("v3-2M", &["-o", "cluster_size=2M"]));
    out.push(conv("zlib", &["-c", "-o", "compression_type=zlib"]));
    out.push(conv("zstd", &["-c", "-o", "compression_type=zstd"]));
    out.push(conv("extl2", &["-o", "extended_l2=on"]));
    out.push(conv("prealloc", &["-o", "preallocation=metadata"]));
    out.push(conv("prealloc-full", &["-o", "preallocation=full"]));
    let df = dir.join("ext.data");
    out.push(conv("datafile", &["-o", &format!("data_file={}", s(&df))]));
    // A chain of three with relative backing names, each layer changing some clusters;
    // the top has zero clusters over data below and partial subcluster writes.
    let base = conv("base", &["-c"]);
    let mid = dir.join("mid.qcow2");
    qemu_img(&["create", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", s(&mid)]);
    qemu_io("qcow2", s(&mid), &["write -P 0x5a 1M 300k", "write -z 3M 1M", "discard 5M 64k"]);
    let top = dir.join("top.qcow2");
    qemu_img(&["create", "-f", "qcow2", "-o", "extended_l2=on", "-b", "mid.qcow2", "-F", "qcow2", s(&top)]);
    qemu_io("qcow2", s(&top), &["write -P 0xa5 1100k 5k", "write -z 0 64k", "write -P 7 7M 2k"]);
    out.push(base);
    // A fourth layer committed into the top (qemu-img commit writes into it).
    let over = dir.join("over-top.qcow2");
    qemu_img(&["create", "-f", "qcow2", "-b", "top.qcow2", "-F", "qcow2", s(&over)]);
    qemu_io("qcow2", s(&over), &["write -P 0x99 6M 70k"]);
    qemu_img(&["commit", s(&over)]);
    out.push(("chain".into(), top));
    // Rebased (safe mode: qemu-img copies what differs) from a qcow2 base onto a raw one.
    let rebased = dir.join("rebased.qcow2");
    qemu_img(&["create", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", s(&rebased)]);
    qemu_io("qcow2", s(&rebased), &["write -P 0x66 2M 10k"]);
    qemu_img(&["rebase", "-b", "src.raw", "-F", "raw", s(&rebased)]);
    out.push(("rebased".into(), rebased));
    // A raw backing file, named without backing_fmt being qcow2.
    let over_raw = dir.join("over-raw.qcow2");
    qemu_img(&["create", "-f", "qcow2", "-b", "src.raw", "-F", "raw", s(&over_raw)]);
    qemu_io("qcow2", s(&over_raw), &["write -P 0x3c 2M 100k"]);
    out.push(("raw-backing".into(), over_raw));
    out
}

fn hash(path: &str) -> String {
    let out = run_ok(&mut ferry(&["hash", path]));
    out.stdout.split_whitespace().next().unwrap().to_string()
}

/// Sum of the data extents qemu sees in its own reading of an image, and in ferry's
/// block status of the export.
fn data_bytes_qemu(img: &Path) -> u64 {
    let out = qemu_img(&["map", "--output=json", s(img)]);
    let v = Json::must_parse(&out.stdout);
    v.as_array().unwrap().iter().filter(|e| e.bool_at("data")).map(|e| e.u64_at("length")).sum()
}

fn data_bytes_ferry(uri: &str) -> u64 {
    let out = run_ok(&mut ferry(&["info", "--map", "--json", uri]));
    let v = Json::must_parse(&out.stdout);
    v.as_array().unwrap().iter().filter(|e| e.u64_at("type") & 1 == 0).map(|e| e.u64_at("length")).sum()
}

#[test]
fn serves_copies_and_hashes_every_kind_of_image() {
    let dir = tempfile::tempdir().unwrap();
    let (src, _) = source(dir.path());
    for (name, img) in images(dir.path(), &src) {
        let reference = dir.path().join(format!("{name}.ref.raw"));
        qemu_img(&["convert", "-O", "raw", s(&img), s(&reference)]);

        // Served (read-only): qemu reading the image itself and through ferry agree.
        let server = ServerBuilder::new(s(&img)).read_only().start();
        let uri = server.uri();
        let cmp = qemu_img(&["compare", "-F", "raw", s(&img), &uri]);
        assert!(cmp.stdout.contains("identical"), "{name}: {}", cmp.describe());
        if !["prealloc", "prealloc-full", "datafile"].contains(&name.as_str()) {
            assert_eq!(data_bytes_ferry(&uri), data_bytes_qemu(&img), "{name}: block status data bytes");
        }
        drop(server);

        // Copied to raw: the same bytes qemu-img convert gives.
        let out = dir.path().join(format!("{name}.out.raw"));
        run_ok(&mut ferry(&["copy", s(&img), s(&out)]));
        assert_eq!(fs::read(&out).unwrap(), fs::read(&reference).unwrap(), "{name}: ferry copy to raw");
        fs::remove_file(&out).unwrap();

        // Hashed: the blkhash of the guest's content.
        assert_eq!(hash(s(&img)), hash(s(&reference)), "{name}: ferry hash");
        fs::remove_file(&reference).unwrap();
    }
}

#[test]
fn info_describes_a_local_image() {
    let dir = tempfile::tempdir().unwrap();
    let (src, _) = source(dir.path());
    let imgs = images(dir.path(), &src);
    let top = &imgs.iter().find(|(n, _)| n == "chain").unwrap().1;
    let out = run_ok(&mut ferry(&["info", "--json", s(top)]));
    let v = Json::must_parse(&out.stdout);
    assert_eq!(v.at("format"), "qcow2");
    assert_eq!(v.u64_at("virtual-size"), SIZE as u64);
    assert_eq!(v.u64_at("cluster-size"), 65536);
    assert!(v.bool_at("extended-l2"));
    let names: Vec<&Json> = v.array_at("backing-chain").iter().map(|c| c.at("filename")).collect();
    assert_eq!(names, ["mid.qcow2", "base.qcow2"]);
    let a = v.at("allocation");
    assert!(a.u64_at("data") > 0 && a.u64_at("zero") > 0, "{}", out.stdout);
    let text = run_ok(&mut ferry(&["info", s(top)])).stdout;
    assert!(text.contains("backing file 2:") && text.contains("base.qcow2"), "{text}");
    let zstd = &imgs.iter().find(|(n, _)| n == "zstd").unwrap().1;
    let v = Json::must_parse(&run_ok(&mut ferry(&["info", "--json", s(zstd)])).stdout);
    assert_eq!(v.at("compression-type"), "zstd");
    assert!(v.at("allocation").u64_at("compressed") > 0);
}

#[test]
fn copies_raw_to_qcow2_that_qemu_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let (src, data) = source(dir.path());
    // By extension, and with --format for another name; metadata written unsynced at the
    // end, and with --flush synced.
    let a = dir.path().join("a.qcow2");
    run_ok(&mut ferry(&["copy", s(&src), s(&a)]));
    let b = dir.path().join("b.img");
    run_ok(&mut ferry(&["copy", "--flush", "--format", "qcow2", s(&src), s(&b)]));
    for img in [&a, &b] {
        check_clean(img);
        let cmp = qemu_img(&["compare", "-f", "raw", s(&src), s(img)]);
        assert!(cmp.stdout.contains("identical"), "{}", cmp.describe());
    }
    // Sparse: the holes and zero blocks of the source take no clusters.
    let used = fs::metadata(&a).unwrap().len();
    let nonzero = data.chunks(65536).filter(|c| c.iter().any(|&x| x != 0)).count() as u64;
    assert!(used < (nonzero + 16) * 65536, "{used} bytes for {nonzero} data clusters");
    // --format raw keeps a .qcow2 name raw.
    let c = dir.path().join("c.qcow2");
    run_ok(&mut ferry(&["copy", "--format", "raw", s(&src), s(&c)]));
    assert_file_eq(&c, &data);
    // qcow2 to qcow2 through the guest view (a chain flattened).
    let imgs = images(dir.path(), &src);
    let top = &imgs.iter().find(|(n, _)| n == "chain").unwrap().1;
    let flat = dir.path().join("flat.qcow2");
    run_ok(&mut ferry(&["copy", s(top), s(&flat)]));
    check_clean(&flat);
    let cmp = qemu_img(&["compare", s(top), s(&flat)]);
    assert!(cmp.stdout.contains("identical"), "{}", cmp.describe());
    // An NBD source to a qcow2 destination.
    let server = ServerBuilder::new(s(&src)).read_only().start();
    let from_nbd = dir.path().join("nbd.qcow2");
    run_ok(&mut ferry(&["copy", &server.uri(), s(&from_nbd)]));
    check_clean(&from_nbd);
    let cmp = qemu_img(&["compare", "-f", "raw", s(&src), s(&from_nbd)]);
    assert!(cmp.stdout.contains("identical"), "{}", cmp.describe());
}

/// The same qemu-io commands through `ferry serve` and applied by qemu to a copy of the
/// image: both images check clean and compare identical.
fn write_both(img: &Path, cmds: &[&str]) {
    let twin = img.with_extension("twin.qcow2");
    fs::copy(img, &twin).unwrap();
    {
        let server = ServerBuilder::new(s(img)).start();
        qemu_io("raw", &server.uri(), cmds);
    }
    qemu_io("qcow2", s(&twin), cmds);
    check_clean(img);
    check_clean(&twin);
    let cmp = qemu_img(&["compare", s(&twin), s(img)]);
    assert!(cmp.stdout.contains("identical"), "{}: {}", img.display(), cmp.describe());
}

#[test]
fn writes_through_serve_keep_the_image_consistent() {
    let dir = tempfile::tempdir().unwrap();
    let (src, _) = source(dir.path());
    let imgs = images(dir.path(), &src);
    let cmds = [
        "write -P 0x11 100k 3k",
        "write -P 0x22 1000k 200k",
        "write -z 2M 64k",
        "write -z 4M 100k",
        "discard 0 128k",
        "write -P 0x33 7M 1M",
        "flush",
        "write -P 0x44 6000k 1k",
    ];
    // A plain image, a compressed one (writes replace compressed clusters) and a chain's
    // top over a compressed base (partial clusters copied up from the backing file).
    let zlib = &imgs.iter().find(|(n, _)| n == "zlib").unwrap().1;
    write_both(zlib, &cmds);
    let top = dir.path().join("top2.qcow2");
    qemu_img(&["create", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", s(&top)]);
    write_both(&top, &cmds);
    // 512-byte clusters: the refcount table must grow several times.
    let small = dir.path().join("small.qcow2");
    qemu_img(&["create", "-f", "qcow2", "-o", "cluster_size=512", s(&small), "32M"]);
    {
        let server = ServerBuilder::new(s(&small)).start();
        qemu_img(&["convert", "-n", "-f", "raw", "-O", "raw", s(&src), &server.uri()]);
        qemu_io("raw", &server.uri(), &["write -P 0x77 20M 5M", "discard 1M 2M"]);
    }
    check_clean(&small);
    let flat = dir.path().join("small.raw");
    qemu_img(&["convert", "-O", "raw", s(&small), s(&flat)]);
    let mut want = fs::read(&src).unwrap();
    want.resize(32 << 20, 0);
    want[20 << 20..25 << 20].fill(0x77);
    want[1 << 20..3 << 20].fill(0); // discarded without a backing file: reads zeroes
    assert_file_eq(&flat, &want);
}

fn refused(args: &[&str], feature: &str) {
    let out = run_fails(&mut ferry(args));
    assert!(out.stderr.contains(feature), "expected {feature:?} in\n{}", out.describe());
}

#[test]
fn refuses_what_it_cannot_handle_naming_the_feature() {
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n);
    // Encrypted (LUKS).
    let enc = d("enc.qcow2");
    qemu_img(&[
        "create",
        "-f",
        "qcow2",
        "--object",
        "secret,id=sec0,data=x",
        "-o",
        "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10",
        s(&enc),
        "1M",
    ]);
    // Dirty, corrupt and an unknown incompatible bit, patched into the header.
    let patched = |name: &str, byte: usize, bit: u8| {
        let p = d(name);
        qemu_img(&["create", "-f", "qcow2", s(&p), "1M"]);
        let mut b = fs::read(&p).unwrap();
        b[byte] |= bit;
        fs::write(&p, &b).unwrap();
        p
    };
    let dirty = patched("dirty.qcow2", 79, 1);
    let corrupt = patched("corrupt.qcow2", 79, 2);
    let unknown = patched("unknown.qcow2", 77, 1); // bit 16
    for (img, feature) in [(&enc, "encrypted"), (&dirty, "dirty bit"), (&unknown, "bit 16")] {
        let before = fs::read(img).unwrap();
        refused(&["serve", "-U", s(&d("x.sock")), s(img)], feature);
        refused(&["info", s(img)], feature);
        refused(&["hash", s(img)], feature);
        let out = d("out.raw");
        refused(&["copy", s(img), s(&out)], feature);
        assert_eq!(fs::read(img).unwrap(), before, "{} was changed", img.display());
    }
    // A corrupt image is read (to rescue its data, as qemu allows), never written.
    let before = fs::read(&corrupt).unwrap();
    refused(&["serve", "-U", s(&d("c.sock")), s(&corrupt)], "corrupt bit");
    run_ok(&mut ferry(&["info", s(&corrupt)]));
    run_ok(&mut ferry(&["hash", s(&corrupt)]));
    run_ok(&mut ferry(&["copy", s(&corrupt), s(&d("rescued.raw"))]));
    let server = ServerBuilder::new(s(&corrupt)).read_only().start();
    run_ok(&mut ferry(&["info", "--size", &server.uri()]));
    drop(server);
    assert_eq!(fs::read(&corrupt).unwrap(), before, "the corrupt image was changed");
    // Writing is refused where ferry cannot write safely; reading works.
    let v2 = d("v2.qcow2");
    qemu_img(&["create", "-f", "qcow2", "-o", "compat=0.10", s(&v2), "1M"]);
    let before = fs::read(&v2).unwrap();
    refused(&["serve", "-U", s(&d("y.sock")), s(&v2)], "version 2");
    assert_eq!(fs::read(&v2).unwrap(), before);
    let server = ServerBuilder::new(s(&v2)).read_only().start();
    run_ok(&mut ferry(&["info", "--size", &server.uri()]));
}

#[test]
fn file_spec_stays_raw_but_warns() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.qcow2");
    qemu_img(&["create", "-f", "qcow2", s(&img), "1M"]);
    let out = run_ok(&mut ferry(&["hash", &format!("file:{}", s(&img))]));
    assert!(out.stderr.contains("holds a qcow2 image"), "{}", out.describe());
    // The container's bytes, not the guest's: the hash differs from the image's.
    assert_ne!(out.stdout.split_whitespace().next().unwrap(), hash(s(&img)));
    let raw = run_ok(&mut ferry(&["hash", &format!("raw:{}", s(&img))]));
    assert!(!raw.stderr.contains("holds a qcow2 image"), "{}", raw.describe());
    assert_eq!(raw.stdout.split_whitespace().next(), out.stdout.split_whitespace().next());
}

/// kill -9 while writes and FLUSHes run on several connections: qemu-img check finds
/// no corruption (leaked clusters at most), and every batch whose FLUSH returned is there.
#[test]
fn crash_after_flush_keeps_flushed_writes_and_a_consistent_image() {
    require("python3-libnbd");
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("crash.qcow2");
    qemu_img(&["create", "-f", "qcow2", "-o", "cluster_size=4096", s(&img), "64M"]);
    let mut server = ServerBuilder::new(s(&img)).start();
    let uri = server.uri();
    let flushed =
        kill_during_python(&mut server, "qcow2_crash.py", &[&uri, "3"], std::time::Duration::from_millis(700));
    let flushed = flushed.expect("no batch was flushed before the kill");
    let got = crashed_qcow2_contents(&img);
    for k in 0..=flushed {
        let v = (k % 250) as u8 + 1;
        let base = k * 262144;
        for (off, n) in [(1000, 30000), (70000, 100000), (200000, 50000)] {
            let piece = &got[base + off..base + off + n];
            assert!(piece.iter().all(|&x| x == v), "batch {k} (flushed up to {flushed}) lost at {}", base + off);
        }
    }
}

fn fio(uri: &str, args: &[&str]) {
    require("fio");
    let mut c = cmd(
        "fio",
        ["--name=q", "--ioengine=nbd", &format!("--uri={uri}"), "--randrepeat=1", "--random_generator=tausworthe64"],
    );
    c.args(args);
    let scratch = tempfile::tempdir().unwrap();
    c.current_dir(scratch.path());
    let out = run_timeout(&mut c, std::time::Duration::from_secs(120));
    assert!(out.status.success() && !out.stderr.contains("verify:"), "fio failed\n{}", out.describe());
}

/// fio random writes of mixed sizes from two connections at once over a compressed
/// backing file, verified through ferry, then verified again through qemu-nbd reading
/// the image ferry wrote; qemu-img check finds it clean.
#[test]
fn fio_multi_conn_writes_verify_through_ferry_and_qemu() {
    require("qemu-nbd");
    let dir = tempfile::tempdir().unwrap();
    let (src, _) = source(dir.path());
    let base = dir.path().join("base.qcow2");
    qemu_img(&["convert", "-c", "-O", "qcow2", "-o", "cluster_size=4096", s(&src), s(&base)]);
    let img = dir.path().join("top.qcow2");
    qemu_img(&["create", "-f", "qcow2", "-o", "cluster_size=16k", "-b", "base.qcow2", "-F", "qcow2", s(&img)]);
    let job = [
        "--rw=randwrite",
        "--bsrange=1k-64k",
        "--size=4M",
        "--numjobs=2",
        "--offset_increment=4M",
        "--iodepth=8",
        "--verify=md5",
        "--verify_state_save=0",
    ];
    {
        let server = ServerBuilder::new(s(&img)).start();
        let mut a = job.to_vec();
        a.push("--do_verify=1");
        fio(&server.uri(), &a);
    }
    check_clean(&img);
    let sock = dir.path().join("qemu.sock");
    let mut q = Command::new("qemu-nbd");
    q.args(["-f", "qcow2", "-k", s(&sock), "--persistent", s(&img)]);
    let mut child = q.spawn().unwrap();
    assert!(wait_until(std::time::Duration::from_secs(10), || sock.exists()), "qemu-nbd did not start");
    let mut a = job.to_vec();
    a.push("--verify_only");
    fio(&format!("nbd+unix:///?socket={}", s(&sock)), &a);
    let _ = child.kill();
    let _ = child.wait();
}
