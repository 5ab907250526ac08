//! ferry against libnbd's clients: nbdcopy, nbdinfo and the Python bindings (the
//! scripts in tests/python, run with /usr/bin/python3).

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use std::fs;

fn nbdcopy(args: &[&str]) -> Output {
    require("nbdcopy");
    run_ok(&mut cmd("nbdcopy", args))
}

fn nbdinfo(args: &[&str]) -> Output {
    require("nbdinfo");
    run_ok(&mut cmd("nbdinfo", args))
}

/// nbdinfo --json output of one export.
fn nbdinfo_json(uri: &str) -> Json {
    let out = nbdinfo(&["--json", uri]);
    let j = Json::must_parse(&out.stdout);
    let exports = j.array_at("exports");
    assert_eq!(exports.len(), 1, "one export expected: {}", out.stdout);
    exports[0].clone()
}

/// (offset, length, type) of `nbdinfo --map --json`, adjacent equal types merged.
fn nbdinfo_map(uri: &str) -> Vec<(u64, u64, u64)> {
    let out = nbdinfo(&["--map", "--json", uri]);
    let j = Json::must_parse(&out.stdout);
    let mut v: Vec<(u64, u64, u64)> = Vec::new();
    for e in j.as_array().expect("map is an array") {
        let (o, l, t) = (e.u64_at("offset"), e.u64_at("length"), e.u64_at("type"));
        match v.last_mut() {
            Some(last) if last.2 == t && last.0 + last.1 == o => last.1 += l,
            _ => v.push((o, l, t)),
        }
    }
    v
}

const HOLE_ZERO: u64 = 3;
const DATA: u64 = 0;

// ---------------------------------------------------------------------------------
// nbdcopy
// ---------------------------------------------------------------------------------

fn nbdcopy_roundtrip(server: &Server, seed: u64, size: usize, opts: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let data = data_with_holes(size, seed);
    let input = write_sparse_file(dir.path(), "in.img", &data);
    let output = dir.path().join("out.img");
    let uri = server.uri();
    let mut a: Vec<&str> = opts.to_vec();
    a.extend([input.to_str().unwrap(), uri.as_str()]);
    nbdcopy(&a);
    let mut a: Vec<&str> = opts.to_vec();
    a.extend([uri.as_str(), output.to_str().unwrap()]);
    nbdcopy(&a);
    assert_file_eq(&output, &data);
}

#[test]
fn nbdcopy_roundtrip_default() {
    let server = Server::unix("memory:32M", &[]);
    nbdcopy_roundtrip(&server, 11, 32 * MIB as usize, &[]);
}

#[test]
fn nbdcopy_roundtrip_four_connections() {
    let server = Server::tcp("memory:32M", &[]);
    nbdcopy_roundtrip(&server, 12, 32 * MIB as usize, &["--connections=4", "--requests=16", "--flush"]);
}

#[test]
fn nbdcopy_roundtrip_synchronous_small_requests() {
    let server = Server::unix("memory:8M", &[]);
    nbdcopy_roundtrip(&server, 13, 8 * MIB as usize, &["--synchronous", "--request-size=65536"]);
}

#[test]
fn nbdcopy_between_two_servers() {
    let a = Server::unix("memory:16M", &[]);
    let b = Server::tcp("memory:16M", &[]);
    let dir = tempfile::tempdir().unwrap();
    let data = data_with_holes(16 * MIB as usize, 14);
    let input = write_sparse_file(dir.path(), "in.img", &data);
    nbdcopy(&[input.to_str().unwrap(), &a.uri()]);
    nbdcopy(&["--connections=2", &a.uri(), &b.uri()]);
    let out = dir.path().join("out.img");
    nbdcopy(&[&b.uri(), out.to_str().unwrap()]);
    assert_file_eq(&out, &data);
}

#[test]
fn nbdcopy_from_pattern() {
    let size = 24 * MIB as usize;
    let server = Server::unix("pattern:24M", &[]);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("pattern.img");
    nbdcopy(&["--connections=4", &server.uri(), out.to_str().unwrap()]);
    let got = fs::read(&out).unwrap();
    assert_same_bytes(&got, &pattern_bytes(0, size), "pattern export copied by nbdcopy");
    // Spot-check the definition: the word at offset 8*k holds k*8 big-endian.
    assert_eq!(&got[0x12340..0x12348], &0x12340u64.to_be_bytes());
}

#[test]
fn nbdcopy_into_file_export() {
    let dir = tempfile::tempdir().unwrap();
    let size = 8 * MIB as usize;
    let disk = write_sparse_file(dir.path(), "disk.img", &vec![0x5au8; size]);
    let server = Server::unix(&format!("file:{}", disk.display()), &[]);
    let data = data_with_holes(size, 15);
    let input = write_sparse_file(dir.path(), "in.img", &data);
    // Zero ranges of the source must overwrite the old 0x5a bytes (nbdcopy zeroes
    // them with WRITE_ZEROES or writes zeroes).
    nbdcopy(&["--flush", input.to_str().unwrap(), &server.uri()]);
    assert_file_eq(&disk, &data);
}

/// null: accepts writes, reads back zeroes, and is all hole.
#[test]
fn nbdcopy_null_export_discards() {
    let server = Server::unix("null:16M", &[]);
    let dir = tempfile::tempdir().unwrap();
    let data = data_with_holes(16 * MIB as usize, 16);
    let input = write_sparse_file(dir.path(), "in.img", &data);
    nbdcopy(&[input.to_str().unwrap(), &server.uri()]);
    let out = dir.path().join("out.img");
    nbdcopy(&[&server.uri(), out.to_str().unwrap()]);
    assert_file_eq(&out, &vec![0u8; 16 * MIB as usize]);
    assert_eq!(nbdinfo_map(&server.uri()), vec![(0, 16 * MIB, HOLE_ZERO)]);
}

// ---------------------------------------------------------------------------------
// nbdinfo
// ---------------------------------------------------------------------------------

#[test]
fn nbdinfo_json_memory_export() {
    let server = Server::unix("memory:64M", &["--description", "ferry test disk"]);
    let e = nbdinfo_json(&server.uri());
    assert_eq!(e.u64_at("export-size"), 64 * MIB, "{e}");
    assert_eq!(e.at("description").as_str(), Some("ferry test disk"), "{e}");
    assert_eq!(e.at("export-name").as_str(), Some(""), "{e}");
    assert!(!e.bool_at("is_read_only"), "{e}");
    for k in ["can_flush", "can_fua", "can_trim", "can_zero", "can_fast_zero", "can_multi_conn", "can_cache", "can_df"]
    {
        assert!(e.bool_at(k), "{k} must be true for a memory export: {e}");
    }
    let ctx: Vec<_> = e.array_at("contexts").iter().filter_map(|c| c.as_str()).collect();
    assert!(ctx.contains(&"base:allocation"), "{e}");
}

#[test]
fn nbdinfo_json_read_only_export() {
    let server = Server::tcp("memory:64M", &["--read-only"]);
    let e = nbdinfo_json(&server.uri());
    assert_eq!(e.u64_at("export-size"), 64 * MIB, "{e}");
    assert!(e.bool_at("is_read_only"), "{e}");
    for k in ["can_trim", "can_zero", "can_fast_zero"] {
        assert!(!e.bool_at(k), "{k} must be false on a read-only export: {e}");
    }
    assert!(e.bool_at("can_multi_conn"), "{e}");
}

#[test]
fn nbdinfo_json_pattern_and_null() {
    let p = Server::unix("pattern:5M", &[]);
    let e = nbdinfo_json(&p.uri());
    assert_eq!(e.u64_at("export-size"), 5 * MIB, "{e}");
    assert!(e.bool_at("is_read_only"), "pattern: is read-only: {e}");
    assert!(!e.bool_at("can_zero"), "{e}");
    let n = Server::unix("null:1T", &[]);
    let e = nbdinfo_json(&n.uri());
    assert_eq!(e.u64_at("export-size"), 1 << 40, "{e}");
    assert!(!e.bool_at("is_read_only"), "{e}");
    assert!(e.bool_at("can_multi_conn"), "{e}");
}

#[test]
fn nbdinfo_map_sparse_memory() {
    let server = Server::unix("memory:64M", &[]);
    assert_eq!(nbdinfo_map(&server.uri()), vec![(0, 64 * MIB, HOLE_ZERO)], "fresh disk is one hole");
    run_python(
        "pwrite.py",
        &[
            &server.uri(),
            &format!("{}:{}:0x11", 2 * MIB, MIB),
            &format!("{}:{}:0x22", 10 * MIB, 3 * MIB),
            &format!("{}:{}:0x33", 20 * MIB + 5, 100),
        ],
    );
    let map = nbdinfo_map(&server.uri());
    // The 100-byte write allocates whatever the memory granularity is; find it.
    let small = map
        .iter()
        .find(|e| e.0 <= 20 * MIB + 5 && 20 * MIB + 105 <= e.0 + e.1)
        .copied()
        .unwrap_or_else(|| panic!("no extent covers the small write: {map:?}"));
    assert_eq!(small.2, DATA, "the small write must be data: {map:?}");
    assert!(small.0 >= 20 * MIB - 64 * KIB && small.1 <= 256 * KIB, "small write extent too large: {map:?}");
    let want = vec![
        (0, 2 * MIB, HOLE_ZERO),
        (2 * MIB, MIB, DATA),
        (3 * MIB, 7 * MIB, HOLE_ZERO),
        (10 * MIB, 3 * MIB, DATA),
        (13 * MIB, small.0 - 13 * MIB, HOLE_ZERO),
        small,
        (small.0 + small.1, 64 * MIB - small.0 - small.1, HOLE_ZERO),
    ];
    assert_eq!(map, want);
}

#[test]
fn nbdinfo_map_pattern_is_data() {
    let server = Server::unix("pattern:8M", &[]);
    assert_eq!(nbdinfo_map(&server.uri()), vec![(0, 8 * MIB, DATA)]);
}

fn listed_exports(uri: &str) -> Vec<Json> {
    let out = nbdinfo(&["--list", "--json", uri]);
    Json::must_parse(&out.stdout).array_at("exports").to_vec()
}

#[test]
fn nbdinfo_list_shows_all_exports() {
    let server = ServerBuilder::new("memory:16M")
        .export("alpha", "memory:1M")
        .export("beta", "null:2M")
        .export("gamma", "pattern:3M")
        .start();
    let exports = listed_exports(&server.uri());
    let mut names: Vec<&str> = exports.iter().map(|e| e.at("export-name").as_str().unwrap()).collect();
    names.sort();
    assert_eq!(names, vec!["", "alpha", "beta", "gamma"]);
    // Plain-text listing too.
    let out = nbdinfo(&["--list", &server.uri()]);
    for n in ["export=\"\"", "export=\"alpha\"", "export=\"beta\"", "export=\"gamma\""] {
        assert!(out.stdout.contains(n), "{n} missing from nbdinfo --list\n{}", out.stdout);
    }
}

/// Each named export is its own disk with its own size and kind (ferry-only: the
/// nbdkit shim serves one plugin under every name).
#[test]
fn nbdinfo_list_sizes_per_export() {
    let server = ServerBuilder::new("memory:16M")
        .export("alpha", "memory:1M")
        .export("beta", "null:2M")
        .export("gamma", "pattern:3M")
        .start();
    let exports = listed_exports(&server.uri());
    let size_of = |name: &str| {
        exports
            .iter()
            .find(|e| e.at("export-name").as_str() == Some(name))
            .unwrap_or_else(|| panic!("export {name:?} not listed"))
            .u64_at("export-size")
    };
    assert_eq!(size_of(""), 16 * MIB);
    assert_eq!(size_of("alpha"), MIB);
    assert_eq!(size_of("beta"), 2 * MIB);
    assert_eq!(size_of("gamma"), 3 * MIB);
    let g = nbdinfo_json(&server.uri_export("gamma"));
    assert!(g.bool_at("is_read_only"), "{g}");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("g.img");
    nbdcopy(&[&server.uri_export("gamma"), out.to_str().unwrap()]);
    assert_file_eq(&out, &pattern_bytes(0, 3 * MIB as usize));
    // A missing export is refused.
    let o = run_fails(&mut cmd("nbdinfo", [server.uri_export("nonexistent")]));
    assert!(!o.stderr.is_empty(), "{}", o.describe());
}

// ---------------------------------------------------------------------------------
// libnbd Python scripts
// ---------------------------------------------------------------------------------

/// OFFSET_HOLE chunks for untouched ranges (nbdkit never sends them, so against the
/// nbdkit shim set FERRY_EXPECT_HOLES=0).
#[test]
fn libnbd_structured_read_holes() {
    let server = Server::unix("memory:64M", &[]);
    run_python("structured_read.py", &[&server.uri()]);
}

#[test]
fn libnbd_block_status() {
    let server = Server::unix("memory:64M", &[]);
    run_python("block_status.py", &[&server.uri()]);
}

#[test]
fn libnbd_write_zero_trim_flush_cache() {
    let server = Server::tcp("memory:16M", &[]);
    run_python("write_ops.py", &[&server.uri()]);
}

#[test]
fn libnbd_error_codes() {
    let rw = Server::unix("memory:16M", &[]);
    let ro = Server::unix("memory:16M", &["--read-only"]);
    run_python("errors.py", &[&rw.uri(), &ro.uri()]);
}

#[test]
fn libnbd_option_negotiation() {
    let server = ServerBuilder::new("memory:16M")
        .arg("--description")
        .arg("the default disk")
        .export("second", "memory:8M")
        .start();
    run_python(
        "opt_mode.py",
        &[&server.uri(), &(16 * MIB).to_string(), "second", &(8 * MIB).to_string(), "the default disk"],
    );
}

#[test]
fn libnbd_multi_conn_memory() {
    let server = Server::unix("memory:16M", &[]);
    run_python("multi_conn.py", &[&server.uri()]);
}

#[test]
fn libnbd_multi_conn_file() {
    let dir = tempfile::tempdir().unwrap();
    let disk = write_sparse_file(dir.path(), "disk.img", &vec![0u8; 8 * MIB as usize]);
    let server = Server::tcp(&format!("file:{}", disk.display()), &[]);
    run_python("multi_conn.py", &[&server.uri()]);
}

#[test]
fn libnbd_simple_replies() {
    let server = Server::unix("memory:40M", &[]);
    run_python("simple_replies.py", &[&server.uri()]);
}

#[test]
fn libnbd_many_requests_in_flight() {
    let server = Server::unix("memory:16M", &[]);
    run_python("aio_inflight.py", &[&server.uri(), "64"]);
}

#[test]
fn libnbd_many_requests_in_flight_tcp() {
    let server = Server::tcp("memory:16M", &[]);
    run_python("aio_inflight.py", &[&server.uri(), "64"]);
}
