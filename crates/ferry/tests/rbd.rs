//! ferry on a real Ceph cluster: one monitor and one memstore OSD started by
//! scripts/ceph-cluster in a temporary directory, shared by every case below and stopped
//! at the end (also when a case fails). The cases run one after another in one test, so
//! the cluster starts once; a failing case does not stop the others, and the test fails
//! listing every case that failed.
//!
//! Built with the `rbd` feature, which scripts/test always turns on.
#![cfg(feature = "rbd")]

use crate::common::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

struct Cluster {
    dir: PathBuf,
    script: PathBuf,
    conf: String,
    /// radosgw's S3 API.
    rgw: crate::repo_s3::S3Api,
}

impl Cluster {
    fn start() -> Cluster {
        for tool in ["ceph-mon", "ceph-osd", "ceph", "rbd", "monmaptool", "ceph-authtool", "uuidgen"] {
            assert!(
                which(tool).is_some(),
                "`{tool}` is not installed: apt-get install ceph-mon ceph-osd ceph-common uuid-runtime (scripts/test does)"
            );
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster");
        let dir = std::env::temp_dir().join(format!("ferry-ceph-{}", std::process::id()));
        for tool in ["radosgw", "radosgw-admin", "curl"] {
            assert!(
                which(tool).is_some(),
                "`{tool}` is not installed: apt-get install radosgw curl (scripts/test does)"
            );
        }
        // With radosgw, for repo_on_radosgw.
        let out = run_timeout(
            cmd(script.to_str().unwrap(), [Path::new("start"), &dir]).env("CEPH_RGW", "1"),
            Duration::from_secs(120),
        );
        assert!(out.status.success(), "starting the Ceph cluster failed\n{}", out.describe());
        let line = out.stdout.lines().find(|l| l.starts_with("CEPH_CONF=")).expect("CEPH_CONF=... KEYRING=... line");
        // The keyring is named in the conf, so CEPH_CONF is all a client needs.
        let conf = line.split_whitespace().find_map(|kv| kv.strip_prefix("CEPH_CONF=")).unwrap().to_string();
        let value = |name: &str| {
            out.stdout
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
                .unwrap_or_else(|| panic!("scripts/ceph-cluster printed no {name}= line:\n{}", out.describe()))
                .to_string()
        };
        let rgw = crate::repo_s3::S3Api {
            endpoint: value("RGW_ENDPOINT"),
            key_id: value("AWS_ACCESS_KEY_ID"),
            secret: value("AWS_SECRET_ACCESS_KEY"),
        };
        Cluster { dir, script, conf, rgw }
    }

    /// `rbd ARGS` against this cluster; must succeed.
    fn rbd(&self, args: &[&str]) -> Output {
        run_ok(Command::new("rbd").arg("-c").arg(&self.conf).args(args))
    }

    /// `rbd export IMAGE -` as bytes.
    fn export(&self, image: &str) -> Vec<u8> {
        let out = Command::new("rbd")
            .arg("-c")
            .arg(&self.conf)
            .args(["export", "--no-progress", image, "-"])
            .output()
            .unwrap();
        assert!(out.status.success(), "rbd export {image}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(&self.script).arg("stop").arg(&self.dir).status();
    }
}

fn ferry(args: &[&str]) -> Command {
    cmd(ferry_bin().to_str().unwrap(), args)
}

/// Data in objects 0, 2 and 5 of a 24 MiB image (4 MiB objects), with zero runs inside;
/// objects 1, 3 and 4 are all zero, so `rbd import` leaves them unallocated.
fn sparse_image_data(seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; 24 << 20];
    let mut rng = Rng::new(seed);
    for obj in [0usize, 2, 5] {
        let s = obj << 22;
        rng.fill(&mut v[s..s + (4 << 20)]);
        v[s + 100_000..s + 200_000].fill(0);
    }
    v
}

/// Runs Python `code` with libnbd's bindings and `h` connected to `uri` (nbdsh's
/// convention, through the system Python that has the bindings), asking for block
/// status and without client-side checks, so that every request reaches the server.
fn nbdsh(uri: &str, code: &str) -> Output {
    require("python3-libnbd");
    let prog = format!(
        "import nbd, sys\nh = nbd.NBD()\nh.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)\n\
         h.set_strict_mode(0)\nh.connect_uri(sys.argv[1])\n{code}h.shutdown()\n"
    );
    run_ok(&mut cmd(SYSTEM_PYTHON, ["-c", prog.as_str(), uri]))
}

fn import_serve_read(c: &Cluster, tmp: &Path) {
    let data = sparse_image_data(1);
    let input = write_sparse_file(tmp, "import.img", &data);
    c.rbd(&["import", "--no-progress", input.to_str().unwrap(), "rbd/imported"]);
    let server = ServerBuilder::new("memory:1M").export("disk", "rbd:rbd/imported").start();
    let uri = server.uri_export("disk");
    // nbdcopy
    require("nbdcopy");
    let out1 = tmp.join("nbdcopy.out");
    run_ok(&mut cmd("nbdcopy", [uri.as_str(), out1.to_str().unwrap()]));
    assert_file_eq(&out1, &data);
    // qemu-img
    require("qemu-img");
    let out2 = tmp.join("qemu.out");
    run_ok(&mut cmd("qemu-img", ["convert", "-f", "raw", "-O", "raw", uri.as_str(), out2.to_str().unwrap()]));
    assert_file_eq(&out2, &data);
    // libnbd: the unallocated objects are holes in block status, the data reads back.
    nbdsh(
        &uri,
        "import nbd\n\
         m = []\n\
         h.block_status(24 << 20, 0, lambda ctx, off, ents, err: m.extend(ents) or 0)\n\
         assert m[0] == 4 << 20 and m[1] == 0, m\n\
         assert m[2] == 4 << 20 and m[3] == nbd.STATE_HOLE | nbd.STATE_ZERO, m\n\
         assert h.pread(4096, 8 << 20) != bytes(4096)\n\
         assert h.pread(4096, 12 << 20) == bytes(4096)\n\
         assert h.can_multi_conn() and h.can_flush() and h.can_fua() and h.can_zero() and h.can_trim()\n",
    );
    // `rbd bench` writes; what it wrote is what ferry serves.
    c.rbd(&["create", "--size", "16M", "rbd/benched"]);
    c.rbd(&[
        "bench",
        "--io-type",
        "write",
        "--io-size",
        "64K",
        "--io-total",
        "8M",
        "--io-pattern",
        "rand",
        "rbd/benched",
    ]);
    let server = ServerBuilder::new("rbd:rbd/benched").read_only().start();
    let out3 = tmp.join("benched.out");
    run_ok(&mut cmd("nbdcopy", [server.uri().as_str(), out3.to_str().unwrap()]));
    assert_file_eq(&out3, &c.export("rbd/benched"));
    // ferry hash of the image equals the hash of its bytes.
    let h1 = run_ok(&mut ferry(&["hash", "rbd:rbd/imported"])).stdout;
    let h2 = run_ok(&mut ferry(&["hash", input.to_str().unwrap()])).stdout;
    assert_eq!(h1.split_whitespace().next(), h2.split_whitespace().next(), "ferry hash rbd vs file");
}

fn write_through_nbd(c: &Cluster, tmp: &Path) {
    c.rbd(&["create", "--size", "24M", "rbd/written"]);
    let server = ServerBuilder::new("rbd:rbd/written").start();
    let uri = server.uri();
    // nbdcopy into the image.
    let data = data_with_holes(24 << 20, 2);
    let input = write_sparse_file(tmp, "w1.img", &data);
    run_ok(&mut cmd("nbdcopy", [input.to_str().unwrap(), uri.as_str()]));
    assert_same_bytes(&c.export("rbd/written"), &data, "rbd export after nbdcopy");
    // qemu-img convert -n over it.
    let data2 = data_with_holes(24 << 20, 3);
    let input2 = write_sparse_file(tmp, "w2.img", &data2);
    run_ok(&mut cmd("qemu-img", ["convert", "-n", "-f", "raw", "-O", "raw", input2.to_str().unwrap(), uri.as_str()]));
    assert_same_bytes(&c.export("rbd/written"), &data2, "rbd export after qemu-img convert -n");
    // libnbd: write, zero (may trim and NO_HOLE), trim, FUA, flush.
    nbdsh(
        &uri,
        "import nbd\n\
         h.pwrite(b'\\xab' * 65536, 1 << 20, nbd.CMD_FLAG_FUA)\n\
         h.zero(3 << 20, 5 << 20)\n\
         h.zero(4096, 9 << 20, nbd.CMD_FLAG_NO_HOLE)\n\
         h.trim(4 << 20, 16 << 20)\n\
         h.flush()\n\
         assert h.pread(65536, 1 << 20) == b'\\xab' * 65536\n\
         assert h.pread(3 << 20, 5 << 20) == bytes(3 << 20)\n",
    );
    let mut want = data2.clone();
    want[1 << 20..(1 << 20) + 65536].fill(0xab);
    want[5 << 20..8 << 20].fill(0);
    want[9 << 20..(9 << 20) + 4096].fill(0);
    let got = c.export("rbd/written");
    // Trim leaves 16..20 MiB unspecified; the rest must be exact.
    assert_same_bytes(&got[..16 << 20], &want[..16 << 20], "rbd export after nbdsh writes");
    assert_same_bytes(&got[20 << 20..], &want[20 << 20..], "rbd export after nbdsh writes (tail)");
    // fio with verify; then what NBD reads is what RBD holds.
    require("fio");
    run_ok(&mut cmd(
        "fio",
        [
            "--name=rbd",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--iodepth=16",
            "--randrepeat=1",
        ],
    ));
    let viewed = tmp.join("after-fio.img");
    run_ok(&mut cmd("nbdcopy", [uri.as_str(), viewed.to_str().unwrap()]));
    assert_file_eq(&viewed, &c.export("rbd/written"));
}

fn copy_roundtrip(c: &Cluster, tmp: &Path) {
    let data = data_with_holes(20 << 20, 4);
    let input = write_sparse_file(tmp, "copy-in.img", &data);
    // A destination that does not exist is created with the source's size.
    let out = run_ok(&mut ferry(&["copy", "--hash", input.to_str().unwrap(), "rbd:rbd/copied"]));
    let info = run_ok(&mut ferry(&["info", "--json", "rbd:rbd/copied"])).stdout;
    assert!(info.contains(&format!("\"export-size\": {}", 20 << 20)), "{info}");
    assert_same_bytes(&c.export("rbd/copied"), &data, "rbd export after ferry copy file->rbd");
    let back = tmp.join("copy-back.img");
    let out2 = run_ok(&mut ferry(&["copy", "--hash", "rbd:rbd/copied", back.to_str().unwrap()]));
    assert_file_eq(&back, &data);
    assert_eq!(out.stdout.split_whitespace().next(), out2.stdout.split_whitespace().next(), "copy --hash both ways");
    // An image without object map and fast-diff: block status from per-object listings
    // (whole objects here too: an object with no snapshot is reported whole).
    let sdata = sparse_image_data(5);
    let sfile = write_sparse_file(tmp, "plain-in.img", &sdata);
    c.rbd(&["import", "--no-progress", "--image-feature", "layering", sfile.to_str().unwrap(), "rbd/plain"]);
    let plain = tmp.join("plain.img");
    run_ok(&mut ferry(&["copy", "rbd:rbd/plain", plain.to_str().unwrap()]));
    assert_file_eq(&plain, &sdata);
    let server = ServerBuilder::new("rbd:rbd/plain").read_only().start();
    nbdsh(
        &server.uri(),
        "m = []\n\
         h.block_status(24 << 20, 0, lambda ctx, off, ents, err: m.extend(ents) or 0)\n\
         assert m[:4] == [4 << 20, 0, 4 << 20, 3], m\n",
    );
    drop(server);
    // rbd -> rbd.
    run_ok(&mut ferry(&["copy", "rbd:rbd/copied", "rbd:rbd/copied2"]));
    assert_same_bytes(&c.export("rbd/copied2"), &data, "rbd export after ferry copy rbd->rbd");
    // A smaller existing destination is refused before anything is written.
    c.rbd(&["create", "--size", "8M", "rbd/small"]);
    let out = run_fails(&mut ferry(&["copy", input.to_str().unwrap(), "rbd:rbd/small"]));
    assert!(out.stderr.contains("smaller than") && out.stderr.contains("nothing was written"), "{}", out.describe());
    assert!(c.export("rbd/small").iter().all(|&b| b == 0), "rbd/small was written to");
    let du = c.rbd(&["du", "rbd/small"]).stdout;
    assert!(du.lines().any(|l| l.starts_with("small") && l.trim_end().ends_with(" 0 B")), "{du}");
}

fn snapshot_read_only(c: &Cluster, tmp: &Path) {
    c.rbd(&["snap", "create", "rbd/imported@s1"]);
    let before = c.export("rbd/imported");
    // Change the image after the snapshot: the snapshot still serves the old bytes.
    let server = ServerBuilder::new("rbd:rbd/imported").start();
    nbdsh(&server.uri(), "h.pwrite(b'\\x11' * 4096, 0)\nh.flush()\n");
    drop(server);
    let snap = ServerBuilder::new("rbd:rbd/imported@s1").start();
    let out = tmp.join("snap.out");
    run_ok(&mut cmd("nbdcopy", [snap.uri().as_str(), out.to_str().unwrap()]));
    assert_file_eq(&out, &before);
    nbdsh(
        &snap.uri(),
        "import nbd, errno\n\
         assert h.is_read_only()\n\
         try:\n    h.pwrite(b'x' * 512, 0)\n    raise SystemExit('write to a snapshot succeeded')\n\
         except nbd.Error as e:\n    assert e.errnum == errno.EPERM, e\n",
    );
    let info = run_ok(&mut ferry(&["info", "rbd:rbd/imported"])).stdout;
    assert!(info.contains("s1:") && info.contains("object size: 4194304") && info.contains("exclusive-lock"), "{info}");
    // A copy into a snapshot is refused.
    let f = write_sparse_file(tmp, "tiny", &[1u8; 4096]);
    run_fails(&mut ferry(&["copy", f.to_str().unwrap(), "rbd:rbd/imported@s1"]));
}

fn errors(c: &Cluster, tmp: &Path) {
    let fails = |spec: &str, want: &str| {
        let t = Instant::now();
        let out = run_timeout(&mut ferry(&["info", spec]), Duration::from_secs(30));
        assert!(!out.status.success() && out.stderr.contains(want), "{spec}: expected {want:?}\n{}", out.describe());
        t.elapsed()
    };
    // Cluster unreachable: a port nothing listens on; bounded by ?timeout=.
    let port = free_port();
    let took = fails(&format!("rbd:rbd/imported?mon_host=127.0.0.1:{port}&timeout=3"), "no Ceph monitor");
    assert!(took < Duration::from_secs(10), "unreachable cluster took {took:?}");
    let out = run_timeout(
        &mut ferry(&["serve", "-p", "0", &format!("rbd:rbd/imported?mon_host=127.0.0.1:{port}&timeout=2")]),
        Duration::from_secs(20),
    );
    assert!(!out.status.success() && out.stderr.contains("within 2 s"), "{}", out.describe());
    fails("rbd:nopool/x", "pool \"nopool\" does not exist");
    fails("rbd:rbd/missing", "no such image");
    fails("rbd:rbd/imported@nosnap", "no snapshot \"nosnap\"");
    // cephx: a keyring with another key for client.admin, and a user that does not exist.
    let bad = tmp.join("bad.keyring");
    run_ok(&mut cmd("ceph-authtool", ["--create-keyring", bad.to_str().unwrap(), "--gen-key", "-n", "client.admin"]));
    fails(&format!("rbd:rbd/imported?keyring={}", bad.display()), "refused client.admin");
    // A user whose caps do not cover the pool.
    run_ok(
        Command::new("ceph")
            .args(["-c", &c.conf, "auth", "get-or-create", "client.ro", "mon", "allow r"])
            .args(["-o", tmp.join("ro.keyring").to_str().unwrap()]),
    );
    fails(&format!("rbd:rbd/imported?id=ro&keyring={}", tmp.join("ro.keyring").display()), "refused client.ro");
    // Locked: a writable server holds the exclusive lock; a second writer is refused,
    // and nothing is written.
    let server = ServerBuilder::new("rbd:rbd/copied").start();
    let before = c.export("rbd/copied");
    let f = write_sparse_file(tmp, "ones", &vec![1u8; 1 << 20]);
    let out = run_fails(&mut ferry(&["copy", f.to_str().unwrap(), "rbd:rbd/copied"]));
    assert!(out.stderr.contains("locked by another client"), "{}", out.describe());
    assert_same_bytes(&c.export("rbd/copied"), &before, "locked image after a refused copy");
    // Read-only access still works while it is locked.
    run_ok(&mut ferry(&["hash", "rbd:rbd/copied"]));
    // A server stopped with SIGTERM closes the image: the lock is released and the copy
    // that was refused now goes through.
    drop(server);
    run_ok(&mut ferry(&["copy", f.to_str().unwrap(), "rbd:rbd/copied"]));
    assert_same_bytes(
        &c.export("rbd/copied")[..1 << 20],
        &vec![1u8; 1 << 20],
        "rbd/copied after the lock was released",
    );
}

fn kill_after_flush(c: &Cluster, tmp: &Path) {
    c.rbd(&["create", "--size", "16M", "rbd/killed"]);
    let mut server = ServerBuilder::new("rbd:rbd/killed").start();
    // The first FLUSH switches librbd's cache to write-back; later writes sit in it
    // until the next FLUSH. Every write before a FLUSH must survive kill -9.
    nbdsh(
        &server.uri(),
        "h.pwrite(b'\\x5a' * (1 << 20), 0)\n\
         h.flush()\n\
         h.pwrite(b'\\xa5' * (2 << 20), 4 << 20)\n\
         h.pwrite(b'\\x3c' * 4096, 10 << 20)\n\
         h.flush()\n",
    );
    server.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    let got = c.export("rbd/killed");
    let mut want = vec![0u8; 16 << 20];
    want[..1 << 20].fill(0x5a);
    want[4 << 20..6 << 20].fill(0xa5);
    want[10 << 20..(10 << 20) + 4096].fill(0x3c);
    assert_same_bytes(&got, &want, "rbd export after kill -9 of ferry");
    let _ = tmp;
}

/// Last, because it kills the OSD: a copy whose OSD dies fails within a bounded time
/// (the OSD op timeout, 5 s here) with a message, instead of hanging. librbd's QoS limit
/// slows the copy to 32 MiB/s so the OSD dies in the middle of it.
fn osd_lost(c: &Cluster, tmp: &Path) {
    let data = data_with_holes(96 << 20, 6);
    let input = write_sparse_file(tmp, "lost.img", &data);
    let spec = "rbd:rbd/lost?rados_osd_op_timeout=5&rbd_qos_write_bps_limit=33554432";
    let t = Instant::now();
    let mut child = ferry(&["copy", input.to_str().unwrap(), spec])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let pid = fs::read_to_string(c.dir.join("run/osd.0.pid")).unwrap().trim().to_string();
    assert!(child.try_wait().unwrap().is_none(), "the copy finished before the OSD was killed");
    run_ok(&mut cmd("kill", ["-9", pid.as_str()]));
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t.elapsed() > Duration::from_secs(100) {
            let _ = child.kill();
            panic!("ferry copy still running 100 s after its OSD was killed");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success() && err.contains("timed out"), "status {status}, stderr: {err}");
    eprintln!("copy failed {:?} after the OSD was killed", t.elapsed() - Duration::from_secs(1));
}

/// A qcow2 image kept in an RBD image (`qcow2:rbd:...`): the format layer on the RBD store,
/// read-only, for copy, hash, info and serve.
fn qcow2_on_rbd(_c: &Cluster, tmp: &Path) {
    let data = data_with_holes(8 << 20, 7);
    let raw = write_sparse_file(tmp, "q-guest.img", &data);
    let q = tmp.join("q.qcow2");
    run_ok(&mut cmd("qemu-img", ["convert", "-f", "raw", "-O", "qcow2", raw.to_str().unwrap(), q.to_str().unwrap()]));
    // The container's bytes go into the RBD image, as they are.
    run_ok(&mut ferry(&["copy", &format!("raw:{}", q.display()), "rbd:rbd/qimg"]));
    let info = run_ok(&mut ferry(&["info", "--json", "qcow2:rbd:rbd/qimg"])).stdout;
    assert!(
        info.contains("\"format\": \"qcow2\"") && info.contains(&format!("\"virtual-size\": {}", 8 << 20)),
        "{info}"
    );
    let out = tmp.join("q-out.img");
    run_ok(&mut ferry(&["copy", "qcow2:rbd:rbd/qimg", out.to_str().unwrap()]));
    assert_file_eq(&out, &data);
    let h = |spec: &str| run_ok(&mut ferry(&["hash", spec])).stdout.split_whitespace().next().unwrap().to_string();
    assert_eq!(h("qcow2:rbd:rbd/qimg"), h(raw.to_str().unwrap()), "ferry hash of qcow2 on rbd vs the guest data");
    let server = ServerBuilder::new("qcow2:rbd:rbd/qimg").read_only().start();
    run_ok(&mut cmd("qemu-img", ["compare", "-f", "raw", "-F", "raw", &server.uri(), raw.to_str().unwrap()]));
    drop(server);
    // Writing a qcow2 image on a store that cannot grow is refused, with the way out.
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let out = run_fails(&mut ferry(&["serve", "--unix", sock.to_str().unwrap(), "qcow2:rbd:rbd/qimg"]));
    assert!(out.stderr.contains("--read-only"), "{}", out.describe());
}

/// The radosgw endpoint and credentials for [`rgw_ferry`].
static RGW: std::sync::OnceLock<(String, String, String)> = std::sync::OnceLock::new();

/// `ferry ARGS` against radosgw (no passphrase).
fn rgw_ferry(args: &[&str]) -> Command {
    let (endpoint, key, secret) = RGW.get().expect("radosgw is up");
    let mut c = ferry(args);
    for v in
        ["AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_ENDPOINT_URL_S3"]
    {
        c.env_remove(v);
    }
    c.env("AWS_ENDPOINT_URL", endpoint)
        .env("AWS_ACCESS_KEY_ID", key)
        .env("AWS_SECRET_ACCESS_KEY", secret)
        .env("AWS_REGION", "us-east-1")
        .env_remove("FERRY_PASSWORD")
        .env_remove("FERRY_PASSWORD_FILE")
        .env_remove("RUST_LOG");
    c
}

/// A backup repository on radosgw: init, a full and an incremental backup, restores,
/// verify (and a flipped byte found), forget + gc (the packs leave the bucket), stats.
fn repo_on_radosgw(c: &Cluster, tmp: &Path) {
    let _ = RGW.set((c.rgw.endpoint.clone(), c.rgw.key_id.clone(), c.rgw.secret.clone()));
    c.rgw.boto3("s3.create_bucket(Bucket='ferry-repo')");
    crate::repo_s3::repository_flow(&c.rgw, rgw_ferry, "ferry-repo", "backups", false, tmp);
}

#[test]
fn rbd_cluster() {
    let t0 = Instant::now();
    let cluster = Cluster::start();
    eprintln!("cluster up in {:?}", t0.elapsed());
    // Every ferry, rbd and qemu process below finds the cluster through CEPH_CONF.
    std::env::set_var("CEPH_CONF", &cluster.conf);
    let tmp = tempfile::tempdir().unwrap();
    type Case = fn(&Cluster, &Path);
    let cases: [(&str, Case); 9] = [
        ("import_serve_read", import_serve_read),
        ("write_through_nbd", write_through_nbd),
        ("copy_roundtrip", copy_roundtrip),
        ("snapshot_read_only", snapshot_read_only),
        ("errors", errors),
        ("kill_after_flush", kill_after_flush),
        ("qcow2_on_rbd", qcow2_on_rbd),
        ("repo_on_radosgw", repo_on_radosgw),
        ("osd_lost", osd_lost),
    ];
    let mut failed = Vec::new();
    for (name, case) in cases {
        let t = Instant::now();
        let dir = tmp.path().join(name);
        fs::create_dir(&dir).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(&cluster, &dir)));
        eprintln!("{name}: {} in {:?}", if r.is_ok() { "ok" } else { "FAILED" }, t.elapsed());
        if r.is_err() {
            failed.push(name);
        }
    }
    drop(cluster);
    assert!(failed.is_empty(), "failed cases: {failed:?}");
}
