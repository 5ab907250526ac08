//! `ferry copy --rate` (issue 21): the data rate over all connections stays near the
//! limit, holes are free. Timings are checked loosely (the machine is shared).

use crate::common::*;
use std::process::Command;
use std::time::{Duration, Instant};

fn ferry(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args);
    c
}

fn data(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 | 1).collect()
}

#[test]
fn an_8_mib_copy_at_4_mib_per_second_takes_about_2_seconds_over_all_connections() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let bytes = data(8 << 20);
    std::fs::write(&src, &bytes).unwrap();
    for conns in ["1", "4"] {
        let dst = dir.path().join(format!("dst-{conns}.img"));
        let t = Instant::now();
        run_ok(&mut ferry(&["copy", "-C", conns, "--rate", "4M", src.to_str().unwrap(), dst.to_str().unwrap()]));
        let took = t.elapsed();
        // 8 MiB at 4 MiB/s: 2 s, less the last request's share (1 MiB: 0.25 s).
        assert!(took >= Duration::from_millis(1500), "-C {conns}: {took:?} is faster than the rate");
        assert!(took < Duration::from_secs(6), "-C {conns}: {took:?} is far slower than the rate");
        assert!(std::fs::read(&dst).unwrap() == bytes);
    }
}

#[test]
fn holes_are_free() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("sparse.img");
    let f = std::fs::File::create(&src).unwrap();
    f.set_len(256 << 20).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&data(1 << 20), 100 << 20).unwrap();
    drop(f);
    let dst = dir.path().join("dst.img");
    let t = Instant::now();
    // 256 MiB at 1 MiB/s would take minutes; the 1 MiB of data takes a second at most.
    run_ok(&mut ferry(&["copy", "--rate", "1M", src.to_str().unwrap(), dst.to_str().unwrap()]));
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(std::fs::read(&dst).unwrap() == std::fs::read(&src).unwrap());
}

#[test]
fn out_of_range_rates_are_refused_at_parse_time() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    std::fs::write(&src, [1u8; 4096]).unwrap();
    let dst = dir.path().join("dst.img");
    for bad in ["0", "100", "2T", "-1", "fast"] {
        let out = run_fails(&mut ferry(&["copy", "--rate", bad, src.to_str().unwrap(), dst.to_str().unwrap()]));
        assert_eq!(out.status.code(), Some(2), "{}", out.describe());
        assert!(!dst.exists());
    }
}
