//! `qemu:allocation-depth` of qcow2 images and chains made by qemu-img/qemu-io, extent by
//! extent against what `qemu-nbd -A` serves (read with nbdinfo). Needs qemu-utils and
//! libnbd-bin; a missing tool fails the test.

use ferry_backend::Backend;
use ferry_backend::Extent;
use ferry_qcow2::{Backing, Qcow2};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const M: u64 = 1 << 20;

fn run(dir: &Path, args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} ({e}); install qemu-utils and libnbd-bin", args[0]));
    assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// What qemu-nbd -A says of `img` (relative to `dir`): (offset, length, depth).
fn qemu_depth(dir: &Path, img: &str, format: &str) -> Vec<(u64, u64, u32)> {
    let sock = dir.join("nbd.sock");
    let _ = std::fs::remove_file(&sock);
    let mut child = Command::new("qemu-nbd")
        .args(["-r", "-A", "-f", format, "-k"])
        .arg(&sock)
        .arg(img)
        .current_dir(dir)
        .stdout(Stdio::null())
        .spawn()
        .expect("cannot run qemu-nbd; install qemu-utils");
    let start = Instant::now();
    while !sock.exists() {
        if start.elapsed() > Duration::from_secs(20) || child.try_wait().ok().flatten().is_some() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("qemu-nbd did not start for {img}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = Command::new("nbdinfo")
        .arg("--map=qemu:allocation-depth")
        .arg(format!("nbd+unix:///?socket={}", sock.display()))
        .output();
    let _ = child.kill();
    let _ = child.wait();
    let out = out.expect("cannot run nbdinfo; install libnbd-bin");
    assert!(out.status.success(), "nbdinfo failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2].parse().unwrap())
        })
        .collect()
}

fn ours(q: &Arc<Qcow2>, offset: u64, length: u64, max: usize) -> Vec<(u64, u64, u32)> {
    let ctx = q.allocation_depth();
    assert_eq!(ctx.name(), "qemu:allocation-depth");
    let mut out: Vec<Extent> = Vec::new();
    ctx.extents(offset, length, max, &mut out).unwrap();
    assert!(!out.is_empty() && out.len() <= max, "{out:?} for max {max}");
    let mut pos = offset;
    out.iter()
        .map(|e| {
            let r = (pos, e.length, e.flags);
            pos += e.length;
            r
        })
        .collect()
}

/// The whole map, then pieces of it: a window in the middle and small `max` values
/// return prefixes of qemu's answer (cut to the window).
fn compare(dir: &Path, img: &str) {
    let want = qemu_depth(dir, img, "qcow2");
    assert!(want.len() >= 3, "{img}: {want:?}");
    let q = Arc::new(Qcow2::open(&dir.join(img), true).unwrap());
    let size = q.size();
    assert_eq!(ours(&q, 0, size, 10_000), want, "{img}");
    for max in 1..want.len() {
        assert_eq!(ours(&q, 0, size, max), want[..max], "{img} max {max}");
    }
    let (a, b) = (size / 3 + 4096, size - size / 5);
    let window: Vec<(u64, u64, u32)> = want
        .iter()
        .filter(|&&(o, l, _)| o + l > a && o < b)
        .map(|&(o, l, d)| (o.max(a), (o + l).min(b) - o.max(a), d))
        .collect();
    assert_eq!(ours(&q, a, b - a, 10_000), window, "{img} window");
}

#[test]
fn depth_matches_qemu_nbd() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    // A raw base of 4M with data at the start; a qcow2 over it with data and zero
    // clusters; a longer qcow2 on top with data, a zero cluster, and data past the
    // middle layer's end.
    run(dir, &["qemu-img", "create", "-q", "-f", "raw", "base.raw", "4M"]);
    run(dir, &["qemu-io", "-f", "raw", "-c", "write -P 1 0 1M", "base.raw"]);
    run(dir, &["qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", "mid.qcow2", "4M"]);
    run(dir, &["qemu-io", "-c", "write -P 2 1M 64k", "-c", "write -z 2M 64k", "mid.qcow2"]);
    run(dir, &["qemu-img", "create", "-q", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", "top.qcow2", "6M"]);
    run(
        dir,
        &["qemu-io", "-c", "write -P 3 3M 64k", "-c", "write -z 128k 64k", "-c", "write -P 4 5M 64k", "top.qcow2"],
    );
    // A qcow2 without backing file (unallocated is depth 0) under a longer overlay.
    run(dir, &["qemu-img", "create", "-q", "-f", "qcow2", "nob.qcow2", "4M"]);
    run(
        dir,
        &["qemu-io", "-c", "write -P 2 1M 64k", "-c", "write -z 2M 64k", "-c", "write -c -P 5 3M 64k", "nob.qcow2"],
    );
    run(dir, &["qemu-img", "create", "-q", "-f", "qcow2", "-b", "nob.qcow2", "-F", "qcow2", "t2.qcow2", "6M"]);
    run(dir, &["qemu-io", "-c", "write -z 128k 64k", "-c", "write -P 7 1088k 4k", "t2.qcow2"]);
    // An overlay shorter than its backing file, with small clusters.
    run(
        dir,
        &[
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=4096",
            "-b",
            "top.qcow2",
            "-F",
            "qcow2",
            "short.qcow2",
            "3M",
        ],
    );
    run(dir, &["qemu-io", "-c", "write -P 8 100k 12k", "short.qcow2"]);
    // Extended L2 entries: zero and data subclusters over a raw base.
    run(
        dir,
        &[
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "extended_l2=on,cluster_size=128k",
            "-b",
            "base.raw",
            "-F",
            "raw",
            "sub.qcow2",
            "4M",
        ],
    );
    run(dir, &["qemu-io", "-c", "write -P 9 8k 4k", "-c", "write -z 1M 8k", "-c", "write -P 9 3M 4k", "sub.qcow2"]);
    // Overlays ferry makes: longer than a raw base, and over the qcow2 chain.
    let zero = ferry_backend::ZeroMode { may_trim: true, fast: false };
    for (name, over, size, cs) in [("f1.qcow2", "base.raw", 6 * M, 4096), ("f2.qcow2", "top.qcow2", 6 * M, 65536)] {
        let b = Backing::for_image(&dir.join(over), &dir.join(name)).unwrap();
        let q = Qcow2::create_with(&dir.join(name), size, cs, Some(&b)).unwrap();
        q.write(&[1u8; 5000], 300_000, false).unwrap();
        q.zero(2 * M, 256 * 1024, zero, false).unwrap();
        q.zero(5 * M + 100, 200_000, zero, false).unwrap();
        q.write(&[2u8; 4096], 3 * M + 8192, false).unwrap();
        q.finish().unwrap();
    }
    for img in ["top.qcow2", "mid.qcow2", "nob.qcow2", "t2.qcow2", "short.qcow2", "sub.qcow2", "f1.qcow2", "f2.qcow2"] {
        compare(dir, img);
    }
}
