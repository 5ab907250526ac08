//! ferry against QEMU's NBD client (qemu-img, qemu-io). QEMU 10 negotiates extended
//! headers, structured replies and base:allocation when the server offers them.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use std::fs;

fn qemu_img(args: &[&str]) -> Output {
    require("qemu-img");
    run_ok(&mut cmd("qemu-img", args))
}

/// Runs qemu-io commands against `uri`; every command must succeed (qemu-io exits 1
/// when any fails, including a `read -P` pattern mismatch).
fn qemu_io(uri: &str, extra: &[&str], cmds: &[&str]) -> Output {
    require("qemu-io");
    let mut c = cmd("qemu-io", ["-f", "raw"]);
    c.args(extra);
    for x in cmds {
        c.arg("-c").arg(x);
    }
    c.arg(uri);
    let out = run_ok(&mut c);
    assert!(
        !out.stdout.contains("failed") && !out.stderr.contains("failed"),
        "qemu-io reported a failure\n{}",
        out.describe()
    );
    out
}

/// Local raw image -> export -> local raw image, with qemu-img compare both ways.
fn convert_roundtrip(server: &Server, seed: u64, size: usize, convert_opts: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let data = data_with_holes(size, seed);
    let input = write_sparse_file(dir.path(), "in.img", &data);
    let input_s = input.to_str().unwrap();
    let uri = server.uri();

    let mut args = vec!["convert", "-n", "-f", "raw", "-O", "raw"];
    args.extend_from_slice(convert_opts);
    args.extend_from_slice(&[input_s, &uri]);
    qemu_img(&args);

    qemu_img(&["compare", "-f", "raw", "-F", "raw", input_s, &uri]);

    let output = dir.path().join("out.img");
    let output_s = output.to_str().unwrap();
    let mut args = vec!["convert", "-f", "raw", "-O", "raw"];
    args.extend_from_slice(convert_opts);
    args.extend_from_slice(&[&uri, output_s]);
    qemu_img(&args);
    assert_file_eq(&output, &data);

    // The comparison is real: one changed byte is noticed.
    let mut changed = data.clone();
    let at = size / 2 + 12345;
    changed[at] ^= 0x5a;
    let other = write_sparse_file(dir.path(), "changed.img", &changed);
    let out = run(&mut cmd("qemu-img", ["compare", "-f", "raw", "-F", "raw", other.to_str().unwrap(), &uri]));
    assert_eq!(out.status.code(), Some(1), "qemu-img compare must report the difference\n{}", out.describe());
}

#[test]
fn qemu_img_convert_roundtrip_unix() {
    require("qemu-img");
    let server = Server::unix("memory:16M", &[]);
    convert_roundtrip(&server, 1, 16 * MIB as usize, &[]);
}

#[test]
fn qemu_img_convert_roundtrip_tcp_parallel() {
    require("qemu-img");
    let server = Server::tcp("memory:16M", &[]);
    assert!(server.uri().starts_with("nbd://127.0.0.1:"));
    // -W: out-of-order writes, -m 8: eight coroutines, so requests overlap in flight.
    convert_roundtrip(&server, 2, 16 * MIB as usize, &["-W", "-m", "8"]);
}

#[test]
fn qemu_img_convert_unaligned_size() {
    require("qemu-img");
    // A size that is not a multiple of 4 KiB or of the memory chunk size (but of 512:
    // QEMU's raw driver rounds other sizes up to whole sectors and writes past the end).
    let size = 5 * MIB as usize + 1536;
    let server = Server::unix(&format!("memory:{size}"), &[]);
    convert_roundtrip(&server, 3, size, &[]);
}

fn virtual_size(uri: &str) -> u64 {
    let out = qemu_img(&["info", "--output=json", "-f", "raw", uri]);
    Json::must_parse(&out.stdout).u64_at("virtual-size")
}

#[test]
fn qemu_img_info_virtual_size() {
    require("qemu-img");
    let s = Server::unix("memory:48M", &[]);
    assert_eq!(virtual_size(&s.uri()), 48 * MIB);
    let s = Server::tcp("null:5G", &[]);
    assert_eq!(virtual_size(&s.uri()), 5 << 30);
    let s = Server::unix("pattern:3M", &[]);
    assert_eq!(virtual_size(&s.uri()), 3 * MIB);
}

/// qemu-img map of a sparse export: written ranges are data, untouched ones are holes.
#[test]
fn qemu_img_map_shows_holes() {
    require("qemu-img");
    require("qemu-io");
    let size = 64 * MIB;
    let server = Server::unix("memory:64M", &[]);
    let uri = server.uri();
    // (offset, length) written with non-zero data.
    let written: [(u64, u64); 3] = [(4 * MIB, MIB), (20 * MIB, 2 * MIB), (40 * MIB + 4096, 4096)];
    qemu_io(
        &uri,
        &[],
        &["write -P 0xab 4M 1M", "write -P 0xcd 20M 2M", &format!("write -P 0xef {} 4096", 40 * MIB + 4096)],
    );

    let out = qemu_img(&["map", "--output=json", "-f", "raw", &uri]);
    let map = Json::must_parse(&out.stdout);
    let entries = map.as_array().expect("map is an array");
    assert!(!entries.is_empty());
    // Entries tile the disk.
    let mut pos = 0;
    let mut data_bytes = 0;
    let mut ranges = Vec::new();
    for e in entries {
        let start = e.u64_at("start");
        let len = e.u64_at("length");
        assert_eq!(start, pos, "map entries must be contiguous: {out:?}");
        let data = e.bool_at("data");
        let zero = e.bool_at("zero");
        if data {
            data_bytes += len;
        }
        ranges.push((start, len, data, zero));
        pos += len;
    }
    assert_eq!(pos, size, "map must cover the whole disk\n{}", out.stdout);

    let overlaps = |a: u64, alen: u64, b: u64, blen: u64| a < b + blen && b < a + alen;
    for &(start, len, data, zero) in &ranges {
        for &(wo, wl) in &written {
            if overlaps(start, len, wo, wl) {
                assert!(data && !zero, "written range {wo}+{wl} reported as data={data} zero={zero}\n{}", out.stdout);
            }
        }
    }
    // Everything at least 1 MiB away from a write is a hole that reads as zero.
    let near =
        |a: u64, alen: u64| written.iter().any(|&(wo, wl)| overlaps(a, alen, wo.saturating_sub(MIB), wl + 2 * MIB));
    for &(start, len, data, zero) in &ranges {
        if !near(start, len) {
            assert!(
                !data && zero,
                "untouched range {start}+{len} must be a hole (data:false zero:true)\n{}",
                out.stdout
            );
        }
    }
    let total_written: u64 = written.iter().map(|w| w.1).sum();
    assert!(
        data_bytes <= total_written + 3 * 2 * MIB,
        "{data_bytes} bytes reported as data, but only {total_written} were written\n{}",
        out.stdout
    );
    assert!(data_bytes >= total_written);

    // And the contents are right.
    qemu_io(
        &uri,
        &["-r"],
        &[
            "read -P 0 0 4M",
            "read -P 0xab 4M 1M",
            "read -P 0 5M 15M",
            "read -P 0xcd 20M 2M",
            &format!("read -P 0 {} 4096", 40 * MIB),
            &format!("read -P 0xef {} 4096", 40 * MIB + 4096),
            &format!("read -P 0 {} 4096", 40 * MIB + 8192),
        ],
    );
}

/// WRITE_ZEROES (with and without unmap), TRIM, FUA, FLUSH and unaligned I/O via
/// qemu-io, each checked by reading back patterns.
#[test]
fn qemu_io_zero_discard_fua_unaligned() {
    let server = Server::tcp("memory:16M", &[]);
    let uri = server.uri();
    qemu_io(
        &uri,
        &[],
        &[
            "write -P 0x55 0 2M",
            "write -z 256k 256k",
            "write -z -u 1M 128k",
            "discard 1536k 64k",
            "write -f -P 0x66 3M 64k",
            "flush",
            // Unaligned writes in the otherwise untouched second half.
            "write -P 0x77 8421375 3",
            "write -P 0x78 8488609 70000",
            "read -P 0x55 0 256k",
            "read -P 0 256k 256k",
            "read -P 0x55 512k 512k",
            "read -P 0 1M 128k",
            "read -P 0x55 1152k 384k",
            "read -P 0 1536k 64k",
            "read -P 0x55 1600k 448k",
            "read -P 0x66 3M 64k",
            "read -P 0 2M 1M",
            "read -P 0 3136k 5056k",
            "read -P 0x77 8421375 3",
            "read -P 0 8421378 67231",
            "read -P 0x78 8488609 70000",
            "read -P 0 8558609 8218607",
        ],
    );
    // The same contents seen by a new connection.
    qemu_io(&uri, &["-r"], &["read -P 0x66 3M 64k", "read -P 0 1M 128k", "read -P 0x78 8488609 70000"]);
}

#[test]
fn qemu_img_compare_pattern_export() {
    require("qemu-img");
    let size = 16 * MIB as usize;
    let server = Server::unix("pattern:16M", &[]);
    let dir = tempfile::tempdir().unwrap();
    let want = pattern_bytes(0, size);
    let local = dir.path().join("pattern.img");
    fs::write(&local, &want).unwrap();
    qemu_img(&["compare", "-f", "raw", "-F", "raw", local.to_str().unwrap(), &server.uri()]);
    let out = dir.path().join("out.img");
    qemu_img(&["convert", "-f", "raw", "-O", "raw", &server.uri(), out.to_str().unwrap()]);
    assert_file_eq(&out, &want);
    // The pattern is read-only: qemu cannot open it for writing.
    let o = run_fails(&mut cmd("qemu-io", ["-f", "raw", "-c", "write -P 1 0 4k", &server.uri()]));
    assert!(!o.stdout.contains("wrote"), "{}", o.describe());
}

#[test]
fn qemu_io_read_only_export_refuses_writes() {
    require("qemu-io");
    let server = Server::unix("memory:16M", &["--read-only"]);
    let uri = server.uri();
    let o = run_fails(&mut cmd("qemu-io", ["-f", "raw", "-c", "write -P 0x11 0 4k", &uri]));
    assert!(!o.stdout.contains("wrote"), "{}", o.describe());
    // Opened read-only, qemu can still read it, and the refused write left no trace.
    qemu_io(&uri, &["-r"], &["read -P 0 0 1M"]);
}

/// A `file:` export: reads see the file, writes land in the file.
#[test]
fn qemu_img_file_export() {
    require("qemu-img");
    let dir = tempfile::tempdir().unwrap();
    let size = 8 * MIB as usize;
    let original = data_with_holes(size, 7);
    let disk = write_sparse_file(dir.path(), "disk.img", &original);
    let server = Server::unix(&format!("file:{}", disk.display()), &[]);
    let out = dir.path().join("out.img");
    qemu_img(&["convert", "-f", "raw", "-O", "raw", &server.uri(), out.to_str().unwrap()]);
    assert_file_eq(&out, &original);

    let newdata = data_with_holes(size, 8);
    let input = write_sparse_file(dir.path(), "new.img", &newdata);
    qemu_img(&["convert", "-n", "-f", "raw", "-O", "raw", input.to_str().unwrap(), &server.uri()]);
    // qemu-img flushes before it exits, so the file holds the new data now.
    assert_file_eq(&disk, &newdata);
    assert_eq!(fs::metadata(&disk).unwrap().len(), size as u64, "file size must not change");
}

/// Named exports are separate disks (ferry-only: the nbdkit shim shares one disk).
#[test]
fn qemu_img_named_export_is_separate() {
    require("qemu-img");
    require("qemu-io");
    let server = ServerBuilder::new("memory:8M").export("disk2", "memory:4M").start();
    assert_eq!(virtual_size(&server.uri_export("disk2")), 4 * MIB);
    assert_eq!(virtual_size(&server.uri()), 8 * MIB);
    qemu_io(&server.uri_export("disk2"), &[], &["write -P 0x42 0 1M"]);
    qemu_io(&server.uri_export("disk2"), &["-r"], &["read -P 0x42 0 1M"]);
    qemu_io(&server.uri(), &["-r"], &["read -P 0 0 8M"]);
}
