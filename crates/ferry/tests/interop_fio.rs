//! ferry under fio's nbd engine (libnbd inside fio) with data verification.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use std::time::Duration;

/// Runs fio with `args` against `uri`, JSON output; asserts success and no job error.
/// Returns the per-job JSON objects.
fn fio_ok(uri: &str, args: &[&str]) -> Vec<Json> {
    let out = fio(uri, args);
    assert!(out.status.success(), "fio failed\n{}", out.describe());
    let jobs = parse_jobs(&out);
    for j in &jobs {
        assert_eq!(j.u64_at("error"), 0, "fio job reported an error\n{}", out.describe());
    }
    assert!(!out.stderr.contains("verify:"), "fio reported verify problems\n{}", out.describe());
    jobs
}

fn fio(uri: &str, args: &[&str]) -> Output {
    require("fio");
    let mut c = cmd(
        "fio",
        [
            "--name=ferry",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--output-format=json",
            "--randrepeat=1",
            "--random_generator=tausworthe64",
        ],
    );
    c.args(args);
    // fio writes verify state files into its working directory: keep them out of the tree.
    let scratch = tempfile::tempdir().unwrap();
    c.current_dir(scratch.path());
    run_timeout(&mut c, Duration::from_secs(180))
}

fn parse_jobs(out: &Output) -> Vec<Json> {
    // The nbd engine prints "fio: connected to NBD server" before the JSON.
    let start = out.stdout.find("\n{").map(|i| i + 1).or_else(|| out.stdout.starts_with('{').then_some(0));
    let start = start.unwrap_or_else(|| panic!("no JSON in fio output\n{}", out.describe()));
    let j = Json::must_parse(&out.stdout[start..]);
    let jobs = j.array_at("jobs").to_vec();
    assert!(!jobs.is_empty(), "fio ran no job\n{}", out.describe());
    jobs
}

fn written(job: &Json) -> u64 {
    job.at("write").u64_at("io_bytes")
}

#[test]
fn fio_randwrite_verify() {
    let server = Server::unix("memory:16M", &[]);
    let jobs = fio_ok(
        &server.uri(),
        &["--rw=randwrite", "--bs=4k", "--size=16M", "--verify=crc32c", "--do_verify=1", "--iodepth=16"],
    );
    assert_eq!(written(&jobs[0]), 16 * MIB, "every block written once");
    assert!(jobs[0].at("read").u64_at("io_bytes") >= 16 * MIB, "verify must read everything back");
}

#[test]
fn fio_randrw_verify_tcp() {
    let server = Server::tcp("memory:16M", &[]);
    let jobs = fio_ok(
        &server.uri(),
        &[
            "--rw=randrw",
            "--bsrange=4k-64k",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_backlog=64",
            "--iodepth=16",
        ],
    );
    assert!(written(&jobs[0]) > 0);
}

#[test]
fn fio_two_jobs_two_connections_verify() {
    let server = Server::unix("memory:16M", &[]);
    let jobs = fio_ok(
        &server.uri(),
        &[
            "--rw=randwrite",
            "--bs=16k",
            "--size=8M",
            "--numjobs=2",
            "--offset_increment=8M",
            "--verify=md5",
            "--do_verify=1",
            "--iodepth=8",
        ],
    );
    assert_eq!(jobs.len(), 2);
    for j in &jobs {
        assert_eq!(written(j), 8 * MIB);
    }
}

#[test]
fn fio_seq_write_verify_file_export() {
    let dir = tempfile::tempdir().unwrap();
    let disk = write_sparse_file(dir.path(), "disk.img", &vec![0u8; 16 * MIB as usize]);
    let server = Server::unix(&format!("file:{}", disk.display()), &[]);
    let jobs = fio_ok(
        &server.uri(),
        &["--rw=write", "--bs=128k", "--size=16M", "--verify=crc32c", "--do_verify=1", "--iodepth=8", "--fsync=16"],
    );
    assert_eq!(written(&jobs[0]), 16 * MIB);
    // The data fio wrote is in the file: every 128 KiB block starts with fio's verify
    // header magic (0xacca, little-endian).
    let bytes = std::fs::read(&disk).unwrap();
    for (i, blk) in bytes.chunks(128 * 1024).enumerate() {
        assert_eq!(&blk[..2], &[0xca, 0xac], "block {i} of the file does not hold fio's data");
    }
}

/// Negative control: fio's verification does catch lost writes (null: discards them),
/// so the tests above would fail on a server that lost data.
#[test]
fn fio_verify_catches_lost_writes_on_null() {
    let server = Server::unix("null:16M", &[]);
    let out = fio(
        &server.uri(),
        &["--rw=randwrite", "--bs=4k", "--size=4M", "--verify=crc32c", "--do_verify=1", "--iodepth=4"],
    );
    assert!(!out.status.success(), "fio must fail verification on null:\n{}", out.describe());
    assert!(out.stderr.contains("verify") || out.stdout.contains("verify"), "{}", out.describe());
    assert!(parse_jobs(&out).iter().any(|j| j.u64_at("error") != 0), "{}", out.describe());
}
