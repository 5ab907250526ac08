//! Data safety of qcow2 images ferry writes: persistent dirty bitmaps are kept true
//! (qcow2_bitmaps.rs has the details), writes that would overwrite metadata are refused (and the
//! image marked corrupt, as qemu does), and images with clusters past the end of their
//! file are not written unless asked for.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn qemu_img(args: &[&str]) -> Output {
    require("qemu-img");
    run_ok(&mut cmd("qemu-img", args))
}

/// Runs qemu-io on `target` and returns what it printed (it exits 1 when a command
/// failed: the callers look for the failures they expect).
/// qemu-io that must succeed in every command.
fn qemu_io_ok(opts: &[&str], target: &str, cmds: &[&str]) {
    let out = qemu_io_opts(opts, target, cmds);
    assert!(!out.contains("fail") && !out.contains("qemu-io:"), "{cmds:?} on {target}:\n{out}");
}

fn qemu_io_opts(opts: &[&str], target: &str, cmds: &[&str]) -> String {
    require("qemu-io");
    let mut c = cmd("qemu-io", opts);
    for x in cmds {
        c.arg("-c").arg(x);
    }
    c.arg(target);
    let out = run(&mut c);
    format!("{}{}", out.stdout, out.stderr)
}

fn info(img: &Path) -> Json {
    Json::must_parse(&qemu_img(&["info", "--output=json", s(img)]).stdout)
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

/// `qemu-img check` finds no errors and no leaks.
fn check_clean(img: &Path) {
    let out = qemu_img(&["check", s(img)]);
    assert!(out.stdout.contains("No errors were found"), "{}", out.describe());
}

/// The flags `qemu-img info` shows for bitmap `name`.
fn bitmap_flags(img: &Path, name: &str) -> Vec<String> {
    let v = info(img);
    let list = v.at("format-specific").at("data").array_at("bitmaps");
    let b = list.iter().find(|b| b.at("name").as_str() == Some(name)).unwrap_or_else(|| panic!("no {name} in {v}"));
    let flags = b.array_at("flags");
    flags.iter().map(|f| f.as_str().unwrap().to_string()).collect()
}

/// `qemu-nbd -B name` on `img`: Err with what it said when it refuses the bitmap.
fn qemu_nbd_bitmap(img: &Path, name: &str) -> Result<(), String> {
    require("qemu-nbd");
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("q.sock");
    let mut c = cmd("qemu-nbd", ["-r", "-f", "qcow2", "-B", name, "-k", s(&sock), "--fork", s(img)]);
    let out = run_timeout(&mut c, Duration::from_secs(20));
    if !out.status.success() {
        return Err(out.stderr);
    }
    // It serves the bitmap: end that server (a client's disconnect ends a non-persistent one).
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    run(&mut cmd("nbdinfo", ["--size", &uri]));
    Ok(())
}

#[test]
fn dirty_bitmaps_are_kept_true_and_unknown_autoclear_bits_cleared() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("bm.qcow2");
    qemu_img(&["create", "-f", "qcow2", s(&img), "64M"]);
    qemu_io_ok(&["-f", "qcow2"], s(&img), &["write -P 0x11 0 1M"]);
    qemu_img(&["bitmap", "--add", s(&img), "b0"]);
    qemu_img(&["bitmap", "--add", "--disable", s(&img), "frozen"]);
    // An autoclear bit ferry does not know (bit 5): a writer must clear it first.
    let mut b = fs::read(&img).unwrap();
    assert_eq!(b[95], 1, "qemu-img set the bitmaps autoclear bit");
    b[95] |= 1 << 5;
    fs::write(&img, &b).unwrap();
    assert_eq!(bitmap_flags(&img, "b0"), ["auto"]);

    // Read-only, and read-write without a write: nothing changes.
    for ro in [true, false] {
        let mut sb = ServerBuilder::new(s(&img));
        if ro {
            sb = sb.read_only();
        }
        let server = sb.start();
        qemu_io_ok(&["-r", "-f", "raw"], &server.uri(), &["read -P 0x11 0 1M"]);
        drop(server);
        assert_eq!(fs::read(&img).unwrap(), b, "read-only={ro}: the image changed");
    }

    let server = ServerBuilder::new(s(&img)).start();
    qemu_io_ok(&["-f", "raw"], &server.uri(), &["write -P 0x22 4M 64k", "flush"]);
    drop(server);

    // The auto bitmap recorded the write (see qcow2_bitmaps.rs) and was written back at
    // the clean stop: qemu trusts it. The disabled one is not concerned by writes.
    assert_eq!(bitmap_flags(&img, "b0"), ["auto"]);
    assert_eq!(bitmap_flags(&img, "frozen"), Vec::<String>::new());
    qemu_nbd_bitmap(&img, "b0").unwrap();
    qemu_nbd_bitmap(&img, "frozen").unwrap();
    check_clean(&img);
    let after = fs::read(&img).unwrap();
    assert_eq!(after[88..96], [0, 0, 0, 0, 0, 0, 0, 1], "autoclear: bitmaps bit kept, bit 5 cleared");
    qemu_io_ok(&["-f", "qcow2"], s(&img), &["read -P 0x11 0 1M", "read -P 0x22 4M 64k"]);
}

/// A fresh image (4 KiB clusters: one L2 table maps 2 MiB) with data at 0 and 4 MiB,
/// then `patch` applied to its bytes (given the L1 table's offset, the first L2 table's
/// and the refcount table's).
fn crafted(dir: &Path, name: &str, patch: impl FnOnce(&mut Vec<u8>, u64, u64, u64)) -> PathBuf {
    let img = dir.join(name);
    qemu_img(&["create", "-f", "qcow2", "-o", "cluster_size=4096", s(&img), "64M"]);
    qemu_io_ok(&["-f", "qcow2"], s(&img), &["write -P 0x11 0 64k", "write -P 0x33 4M 64k"]);
    let mut b = fs::read(&img).unwrap();
    let l1 = be64(&b, 40);
    let l2 = be64(&b, l1 as usize) & 0x00ff_ffff_ffff_fe00;
    let rt = be64(&b, 48);
    patch(&mut b, l1, l2, rt);
    fs::write(&img, &b).unwrap();
    img
}

/// Serves `img`, writes at 0 (must fail with EIO: it would overwrite `what`), reads at
/// 4 MiB (must still work), writes elsewhere (refused too, the image being corrupt now);
/// afterwards the image is marked corrupt and nothing else in it changed.
fn write_is_refused(img: &Path, what: &str) {
    let before = fs::read(img).unwrap();
    let server = ServerBuilder::new(s(img)).start();
    let out = qemu_io_opts(
        &["-f", "raw"],
        &server.uri(),
        &["write -P 0x55 0 4k", "read -P 0x33 4M 64k", "write -P 0x66 8M 4k", "read -P 0 8M 4k"],
    );
    let log = server.stderr();
    drop(server);
    let failed: Vec<&str> = out.lines().filter(|l| l.contains("fail") || l.contains("qemu-io:")).collect();
    assert_eq!(
        failed,
        ["write failed: Input/output error", "write failed: Input/output error"],
        "{out}\n--- server ---\n{log}"
    );
    assert!(log.contains(&format!("would overwrite {what}")), "{log}");
    assert!(info(img).at("format-specific").at("data").bool_at("corrupt"), "not marked corrupt");
    let after = fs::read(img).unwrap();
    assert_eq!(after[..72], before[..72]);
    assert!(after[80..] == before[80..], "{what} or other metadata changed");
}

#[test]
fn a_guest_write_over_the_l1_table_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Guest cluster 0 maps (COPIED) to the L1 table itself.
    let img = crafted(dir.path(), "l1.qcow2", |b, l1, l2, _| {
        b[l2 as usize..l2 as usize + 8].copy_from_slice(&(l1 | 1 << 63).to_be_bytes());
    });
    write_is_refused(&img, "the L1 table");
}

#[test]
fn an_l2_table_where_the_refcount_table_is_is_never_written() {
    let dir = tempfile::tempdir().unwrap();
    // L1 entry 0 names the refcount table as its L2 table.
    let img = crafted(dir.path(), "rt.qcow2", |b, l1, _, rt| {
        b[l1 as usize..l1 as usize + 8].copy_from_slice(&(rt | 1 << 63).to_be_bytes());
    });
    write_is_refused(&img, "the refcount table");
}

#[test]
fn clusters_past_the_end_of_the_file_are_not_written_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("cut.qcow2");
    qemu_img(&["create", "-f", "qcow2", s(&img), "64M"]);
    qemu_io_ok(&["-f", "qcow2"], s(&img), &["write -P 0x11 0 4M"]);
    let f = fs::OpenOptions::new().write(true).open(&img).unwrap();
    f.set_len(1 << 20).unwrap();
    drop(f);
    let before = fs::read(&img).unwrap();

    let sock = dir.path().join("x.sock");
    let out = run_timeout(
        &mut cmd(ferry_bin().to_str().unwrap(), ["serve", "-U", s(&sock), s(&img)]),
        Duration::from_secs(20),
    );
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr.contains("past the end of its file") && out.stderr.contains("--allow-truncated"),
        "{}",
        out.describe()
    );
    assert_eq!(fs::read(&img).unwrap(), before);

    let server = ServerBuilder::new(s(&img)).read_only().start();
    qemu_io_ok(&["-r", "-f", "raw"], &server.uri(), &["read -P 0x11 0 64k", "read -P 0 2M 64k"]);
    assert!(server.stderr().contains("past the end of its file"), "{}", server.stderr());
    drop(server);
    assert_eq!(fs::read(&img).unwrap(), before);

    let server = ServerBuilder::new(s(&img)).arg("--allow-truncated").start();
    qemu_io_ok(&["-f", "raw"], &server.uri(), &["write -P 0x22 8M 64k", "read -P 0x22 8M 64k"]);
    assert!(server.stderr().contains("past the end of its file"), "{}", server.stderr());
}
