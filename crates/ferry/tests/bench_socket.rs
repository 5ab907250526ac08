//! Smoke test of `ferry bench socket`: a tiny sweep through the real binary, its table,
//! its JSON and its charts. `FERRY_BIN` overrides the binary under test.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn ferry_bin() -> PathBuf {
    match std::env::var_os("FERRY_BIN") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_BIN_EXE_ferry")),
    }
}

/// Runs `ferry bench socket` with the tiny sweep's arguments plus `extra`, in `dir`.
fn bench(dir: &Path, extra: &[&str]) -> Output {
    let args = [
        "bench",
        "socket",
        "--bytes",
        "16M",
        "--write-sizes",
        "64K",
        "--read-sizes",
        "64K",
        "--streams",
        "1,2",
        "--sndbuf",
        "default,1M",
    ];
    let start = Instant::now();
    let out = Command::new(ferry_bin()).args(args).args(extra).current_dir(dir).output().expect("running ferry");
    let took = start.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "ferry bench socket failed ({:?}):\n{stderr}", out.status);
    assert!(took < Duration::from_secs(60), "the tiny sweep took {took:?}");
    out
}

#[test]
fn table_and_charts() {
    let dir = tempfile::tempdir().unwrap();
    let chart = dir.path().join("x");
    let out = bench(dir.path(), &["--chart", chart.to_str().unwrap()]);
    let stdout = String::from_utf8(out.stdout).unwrap();

    // One row per transport x sndbuf x streams: 2 x 2 x 2.
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| matches!(f.first(), Some(&"unix") | Some(&"tcp")))
        .collect();
    assert_eq!(rows.len(), 8, "expected 8 rows:\n{stdout}");
    let wmem_max: Option<u64> =
        std::fs::read_to_string("/proc/sys/net/core/wmem_max").ok().and_then(|s| s.trim().parse().ok());
    let mut seen = Vec::new();
    for f in &rows {
        // transport sndbuf kernel-sndbuf streams write read GiB/s MiB/s reads short% avg short-writes
        assert_eq!(f.len(), 12, "row {f:?}");
        assert_eq!((f[4], f[5]), ("64K", "64K"), "row {f:?}");
        let gibs: f64 = f[6].parse().unwrap();
        assert!(gibs > 0.0, "no throughput in {f:?}");
        let reads: u64 = f[8].parse().unwrap();
        assert!(reads >= 256, "16 MiB in 64 KiB reads takes at least 256 reads: {f:?}");
        let short: f64 = f[9].parse().unwrap();
        assert!((0.0..=100.0).contains(&short), "{f:?}");
        let kernel: u64 = f[2].split("->").next().unwrap().parse().unwrap();
        assert!(kernel > 0, "{f:?}");
        if let (Some(max), "1M") = (wmem_max, f[1]) {
            // Linux caps the request at wmem_max and doubles it.
            assert_eq!(kernel, 2 * max.min(1 << 20), "kernel SO_SNDBUF in {f:?}");
        }
        seen.push((f[0], f[1], f[3]));
    }
    for t in ["unix", "tcp"] {
        for s in ["default", "1M"] {
            for n in ["1", "2"] {
                assert!(seen.contains(&(t, s, n)), "no row for {t} {s} {n} streams:\n{stdout}");
            }
        }
    }

    for ext in ["svg", "png"] {
        let p = dir.path().join(format!("x.{ext}"));
        let meta = std::fs::metadata(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(meta.len() > 5000, "{} is only {} bytes", p.display(), meta.len());
    }
    let svg = std::fs::read_to_string(dir.path().join("x.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<text") && svg.contains("GiB/s"), "odd SVG");
    let png = std::fs::read(dir.path().join("x.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
}

#[test]
fn json() {
    let dir = tempfile::tempdir().unwrap();
    let out = bench(dir.path(), &["--json", "--transport", "unix", "--repeat", "2"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json prints one JSON object");
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 4);
    for r in results {
        assert_eq!(r["transport"], "unix");
        assert_eq!(r["bytes"], 16 << 20);
        assert!(r["gib_per_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["reads"].as_u64().unwrap() >= 256, "{r}");
        assert_eq!(r["runs_gib_per_s"].as_array().unwrap().len(), 2, "{r}");
        assert!(r["sndbuf_kernel"].as_u64().unwrap() > 0, "{r}");
        match r["sndbuf_requested"].as_u64() {
            None => assert!(r["sndbuf_requested"].is_null()),
            Some(n) => assert_eq!(n, 1 << 20),
        }
    }
}

#[test]
fn bad_arguments_fail_cleanly() {
    for bad in [["--write-sizes", "0"], ["--sndbuf", "lots"], ["--streams", "0"]] {
        let out = Command::new(ferry_bin()).args(["bench", "socket"]).args(bad).output().expect("running ferry");
        assert!(!out.status.success(), "{bad:?} was accepted");
        assert!(!out.stderr.is_empty(), "{bad:?}: no error message");
    }
}
