//! qcow2 images that ferry serves stay compact: freed clusters are reused, clusters freed
//! by TRIM and WRITE_ZEROES are punched out of the file, free clusters at its end are
//! cut off, and `--discard=ignore` keeps everything allocated as qemu-nbd's does. Each
//! test checks the data against a reference and `qemu-img check` (no leaks) as well.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const CLUSTER: u64 = 64 * KIB;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn qemu_img(args: &[&str]) -> Output {
    require("qemu-img");
    run_ok(&mut cmd("qemu-img", args))
}

/// Runs qemu-io commands on `target` (an NBD URI as raw, or an image file as qcow2 with
/// `-d unmap`, qemu's own behaviour to compare with).
fn qemu_io(target: &str, cmds: &[String]) {
    require("qemu-io");
    let mut c = if target.starts_with("nbd") {
        cmd("qemu-io", ["-f", "raw"])
    } else {
        cmd("qemu-io", ["-f", "qcow2", "-d", "unmap"])
    };
    for x in cmds {
        c.arg("-c").arg(x);
    }
    c.arg(target);
    let out = run_ok(&mut c);
    assert!(!out.stdout.contains("failed") && !out.stderr.contains("failed"), "qemu-io failed\n{}", out.describe());
}

fn new_image(dir: &Path, name: &str, size: &str) -> PathBuf {
    let p = dir.join(name);
    qemu_img(&["create", "-q", "-f", "qcow2", "-o", "cluster_size=64k", s(&p), size]);
    p
}

/// (apparent size, allocated bytes) of a file.
fn sizes(p: &Path) -> (u64, u64) {
    let m = fs::metadata(p).unwrap();
    (m.len(), m.blocks() * 512)
}

/// `qemu-img check`: no errors, no leaks; returns the clusters holding guest data.
fn check_clean(img: &Path) -> u64 {
    let out = qemu_img(&["check", "--output=json", s(img)]);
    let j = Json::must_parse(&out.stdout);
    for k in ["check-errors", "corruptions", "leaks"] {
        assert_eq!(j.get(k).and_then(|v| v.as_u64()).unwrap_or(0), 0, "{k} in {}", out.describe());
    }
    j.u64_at("allocated-clusters")
}

/// The file's allocated blocks hold the live data clusters plus a few clusters of
/// metadata and slack; so does its apparent size, but for `holes` bytes freed between
/// live clusters (a file cannot shrink in the middle).
#[track_caller]
fn assert_compact(img: &Path, holes: u64, what: &str) {
    let data = check_clean(img) * CLUSTER;
    // Header, refcount table, L1 table, refcount block, L2 table, and a few to spare.
    let bound = data + 12 * CLUSTER;
    let (len, alloc) = sizes(img);
    eprintln!("{what}: file {len} bytes, {alloc} allocated, for {data} bytes of data");
    assert!(
        len <= bound + holes && alloc <= bound,
        "{what}: file {len} bytes, {alloc} allocated, for {data} bytes of data"
    );
}

#[track_caller]
fn assert_same_content(a: &Path, b: &Path) {
    let out = qemu_img(&["compare", s(a), s(b)]);
    assert!(out.stdout.contains("identical"), "{}", out.describe());
}

/// The first case, smaller: rounds of "write 32 MiB, trim it" at moving
/// offsets, in one client session with no FLUSH until it closes. The file must stay
/// near its live size (before: 10 x 32 MiB, all allocated), the same bytes as qemu's
/// own `discard=unmap` makes of the same commands, and no larger than qemu's.
#[test]
fn write_trim_rounds_keep_the_file_compact() {
    let dir = tempfile::tempdir().unwrap();
    let img = new_image(dir.path(), "a.qcow2", "256M");
    let twin = new_image(dir.path(), "twin.qcow2", "256M");
    let mut cmds = Vec::new();
    for i in 0..10u64 {
        let at = (i * 23 % 224) << 20;
        cmds.push(format!("write -P {} {at} 32M", i + 1));
        cmds.push(format!("discard {at} 32M"));
    }
    // Some live data at the end: partial clusters, and a trim that leaves part of it.
    cmds.push("write -P 0x5a 1000k 3000k".into());
    cmds.push("discard 1500k 1M".into());
    {
        let server = ServerBuilder::new(s(&img)).start();
        qemu_io(&server.uri(), &cmds);
    }
    qemu_io(s(&twin), &cmds);
    assert_same_content(&img, &twin);
    // The last trim freed 1 MiB between live clusters.
    assert_compact(&img, MIB, "after 10 rounds of write and trim");
    let (ours, theirs) = (sizes(&img).1, sizes(&twin).1);
    eprintln!("qemu-io -d unmap on the same commands: {:?} (apparent, allocated)", sizes(&twin));
    assert!(ours <= theirs + 4 * CLUSTER, "ferry's file has {ours} bytes allocated, qemu's {theirs}");
}

/// The second case: `nbdcopy` alternately copies a source that is half zero
/// (holes) and one that is all data into the same image, without flushing. Before, a
/// 64 MiB image grew to 235 MB: each zeroed cluster was freed, never reused, and the
/// next data copy allocated new ones at the end.
#[test]
fn alternating_copies_stay_near_the_live_size() {
    require("nbdcopy");
    let dir = tempfile::tempdir().unwrap();
    let size = 64 * MIB as usize;
    let mut rng = Rng::new(19);
    let full = rng.bytes(size);
    let mut half = rng.bytes(size);
    for (i, c) in half.chunks_mut(MIB as usize).enumerate() {
        if i % 2 == 1 {
            c.fill(0);
        }
    }
    let full_p = write_sparse_file(dir.path(), "full.raw", &full);
    let half_p = write_sparse_file(dir.path(), "half.raw", &half);
    let img = new_image(dir.path(), "a.qcow2", "64M");
    let server = ServerBuilder::new(s(&img)).start();
    let mut peak = 0;
    for round in 0..6 {
        let src = if round % 2 == 0 { &half_p } else { &full_p };
        run_ok(&mut cmd("nbdcopy", [s(src), &server.uri()]));
        let got = dir.path().join("got.raw");
        run_ok(&mut cmd("nbdcopy", [&server.uri(), s(&got)]));
        assert_file_eq(&got, if round % 2 == 0 { &half } else { &full });
        peak = peak.max(sizes(&img).0);
    }
    drop(server);
    assert_compact(&img, 0, "after 6 alternating copies");
    eprintln!("largest apparent size while copying: {peak}");
    // While it ran (no FLUSH at all), the waiting frees were applied before the file grew
    // by more than a few MiB.
    assert!(peak <= (64 + 12) * MIB, "the file reached {peak} bytes");
}

/// WRITE_ZEROES over whole clusters frees their data (punched out of the file); with
/// NO_HOLE (qemu-io's `write -z` without `-u`) the clusters stay allocated as
/// preallocated zeroes, and writing into them again takes no new clusters.
#[test]
fn write_zeroes_frees_whole_clusters() {
    let dir = tempfile::tempdir().unwrap();
    let img = new_image(dir.path(), "a.qcow2", "64M");
    let twin = new_image(dir.path(), "twin.qcow2", "64M");
    let server = ServerBuilder::new(s(&img)).start();
    let run = |cmds: &[&str]| {
        let cmds: Vec<String> = cmds.iter().map(|c| c.to_string()).collect();
        qemu_io(&server.uri(), &cmds);
        qemu_io(s(&twin), &cmds);
    };
    run(&["write -P 0x11 0 40M", "flush"]);
    let before = sizes(&img).1;
    assert!(before >= 40 * MIB, "{before}");
    // Unaligned ends: the partial clusters are written with zeroes.
    run(&["write -z -u 100k 30M", "flush"]);
    let after = sizes(&img).1;
    assert!(after <= before - 29 * MIB, "zeroing 30 MiB: {before} -> {after} bytes allocated");
    // NO_HOLE keeps the clusters; writing over them again reuses them in place.
    run(&["write -z 32M 8M", "flush"]);
    assert!(sizes(&img).1 >= after - CLUSTER, "NO_HOLE zeroes gave space back");
    run(&["write -P 0x22 32M 4M", "write -P 0x33 36M 100k", "flush"]);
    assert!(sizes(&img).1 <= after + 2 * CLUSTER, "writing preallocated zero clusters took new ones");
    drop(server);
    assert_same_content(&img, &twin);
    check_clean(&img);
    let out = qemu_img(&["map", "--output=json", s(&img)]);
    let map = Json::must_parse(&out.stdout);
    let prealloc = map.as_array().unwrap().iter().any(|e| e.bool_at("zero") && e.get("offset").is_some());
    assert!(prealloc, "no preallocated zero clusters in {}", out.stdout);
}

/// TRIM in an image with a backing file must not let the backing file's bytes show:
/// whole clusters become zero clusters (their data is punched out of the file), partial
/// ones keep their data.
#[test]
fn trim_over_a_backing_file_reads_zeroes_and_frees_space() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.raw");
    let base_data = Rng::new(7).bytes(16 * MIB as usize);
    fs::write(&base, &base_data).unwrap();
    let top = dir.path().join("top.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", s(&top)]);
    let server = ServerBuilder::new(s(&top)).start();
    qemu_io(&server.uri(), &["write -P 0x44 0 12M".into(), "flush".into()]);
    let before = sizes(&top).1;
    qemu_io(&server.uri(), &["discard 1000k 10M".into(), "flush".into()]);
    let got = dir.path().join("got.raw");
    run_ok(&mut cmd("qemu-img", ["convert", "-f", "raw", "-O", "raw", &server.uri(), s(&got)]));
    drop(server);
    let mut want = base_data;
    want[..12 << 20].fill(0x44);
    // Whole clusters inside 1000k..11240k read as zeroes, never as the backing file.
    let (a, b) = ((1000 * KIB).next_multiple_of(CLUSTER) as usize, ((1000 * KIB + 10 * MIB) & !(CLUSTER - 1)) as usize);
    want[a..b].fill(0);
    assert_file_eq(&got, &want);
    check_clean(&top);
    let after = sizes(&top).1;
    assert!(after + 9 * MIB <= before, "trimming 10 MiB: {before} -> {after} bytes allocated");
}

/// `--discard=ignore`: TRIM does nothing and WRITE_ZEROES keeps the clusters, as
/// qemu-nbd's `--discard=ignore` does.
#[test]
fn discard_ignore_keeps_the_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let img = new_image(dir.path(), "a.qcow2", "64M");
    let server = ServerBuilder::new(s(&img)).arg("--discard=ignore").start();
    qemu_io(&server.uri(), &["write -P 0x11 0 16M".into(), "flush".into()]);
    let before = sizes(&img).1;
    qemu_io(&server.uri(), &["discard 0 8M".into(), "write -z -u 8M 8M".into(), "flush".into()]);
    let got = dir.path().join("got.raw");
    run_ok(&mut cmd("qemu-img", ["convert", "-f", "raw", "-O", "raw", &server.uri(), s(&got)]));
    drop(server);
    let mut want = vec![0u8; 64 << 20];
    want[..8 << 20].fill(0x11); // the TRIM was ignored
    assert_file_eq(&got, &want);
    assert!(sizes(&img).1 >= before, "space given back: {before} -> {}", sizes(&img).1);
    assert!(check_clean(&img) >= 256, "clusters freed");
}

/// kill -9 while batches are trimmed, written and flushed on several connections, so
/// that clusters freed by one batch's trim are reused by later batches: qemu-img check
/// finds no corruption, every cluster holds zeroes or a batch that was written there
/// (a cluster reused while an L2 entry on disk still pointed at it would show another
/// slot's batch), and the batches flushed last, not yet trimmed, are there.
#[test]
fn crash_while_clusters_are_reused_keeps_the_image_consistent() {
    require("python3-libnbd");
    // Twice: a kill lands between a reuse and the next FLUSH most of the time, not always.
    for _ in 0..2 {
        crash_while_reusing();
    }
}

fn crash_while_reusing() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("crash.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", s(&img), "4M"]);
    let mut server = ServerBuilder::new(s(&img)).start();
    let uri = server.uri();
    let flushed = kill_during_python(&mut server, "qcow2_crash.py", &[&uri, "3", "churn"], Duration::from_millis(1500));
    let flushed = flushed.expect("no batch was flushed before the kill");
    assert!(flushed >= 24, "only {flushed} batches: no cluster was reused");
    let got = crashed_qcow2_contents(&img);
    let value = |k: usize| (k % 250) as u8 + 1;
    // Batches up to flushed + 4 may have been (partly) written.
    for (i, c) in got.chunks(4096).enumerate() {
        let slot = i / 64;
        let ok =
            c.iter().all(|&x| x == 0) || (0..=flushed + 4).any(|k| k % 16 == slot && c.iter().all(|&x| x == value(k)));
        assert!(ok, "cluster {i} of slot {slot} holds bytes no batch wrote there: {:?}", &c[..8]);
    }
    // Batch k is trimmed by batch k + 8, which may have run if k + 8 <= flushed + 4.
    for k in flushed.saturating_sub(3)..=flushed {
        let slot = &got[(k % 16) * 262144..(k % 16 + 1) * 262144];
        assert!(slot.iter().all(|&x| x == value(k)), "batch {k} (flushed up to {flushed}) lost");
    }
}

/// Random writes, trims and zeroes from four connections at once, each on its own
/// stripes (so clusters one frees are reused by another), checked against a model of
/// each connection's bytes; then `qemu-img check` is clean and the file compact.
#[test]
fn concurrent_writes_trims_and_zeroes_read_back_right() {
    let dir = tempfile::tempdir().unwrap();
    let img = new_image(dir.path(), "a.qcow2", "16M");
    {
        let server = ServerBuilder::new(s(&img)).start();
        let out = run_python("qcow2_churn.py", &[&server.uri(), "4", "600", "5"]);
        assert!(out.stdout.contains("ok"), "{}", out.describe());
    }
    assert_compact(&img, 16 * MIB, "after concurrent writes, trims and zeroes");
}
