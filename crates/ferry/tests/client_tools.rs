//! `ferry copy`, `ferry info` and `ferry hash` against three servers: ferry serve,
//! nbdkit and qemu-nbd, with data checked byte for byte.

use crate::common::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A peer NBD server (nbdkit or qemu-nbd) on a Unix socket, serving a file.
struct Peer {
    child: Child,
    sock: PathBuf,
}

impl Peer {
    fn nbdkit(dir: &Path, args: &[&str]) -> Peer {
        require("nbdkit");
        let sock = dir.join("nbdkit.sock");
        let child = Command::new("nbdkit")
            .args(["-f", "--exit-with-parent", "-U"])
            .arg(&sock)
            .args(args)
            .stdin(Stdio::null())
            .spawn()
            .expect("start nbdkit");
        Peer::wait(child, sock)
    }

    fn qemu_nbd(dir: &Path, file: &Path) -> Peer {
        require("qemu-nbd");
        let sock = dir.join("qemu.sock");
        let child = Command::new("qemu-nbd")
            .args(["-t", "-e", "8", "-f", "raw", "--cache=writeback", "-k"])
            .arg(&sock)
            .arg(file)
            .stdin(Stdio::null())
            .spawn()
            .expect("start qemu-nbd");
        Peer::wait(child, sock)
    }

    fn wait(child: Child, sock: PathBuf) -> Peer {
        let ok = wait_until(Duration::from_secs(10), || std::os::unix::net::UnixStream::connect(&sock).is_ok());
        assert!(ok, "peer server did not start listening on {}", sock.display());
        Peer { child, sock }
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.sock.display())
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The three servers, each serving a zeroed file of `size` bytes it owns (the last
/// field keeps the file's directory alive).
#[allow(dead_code)]
enum Any {
    Ferry(Server, PathBuf, tempfile::TempDir),
    Peer(Peer, PathBuf, tempfile::TempDir),
}

impl Any {
    fn uri(&self) -> String {
        match self {
            Any::Ferry(s, ..) => s.uri(),
            Any::Peer(p, ..) => p.uri(),
        }
    }
    fn file(&self) -> &Path {
        match self {
            Any::Ferry(_, f, _) | Any::Peer(_, f, _) => f,
        }
    }
}

fn zero_file(dir: &Path, size: u64) -> PathBuf {
    let p = dir.join("disk.img");
    fs::File::create(&p).unwrap().set_len(size).unwrap();
    p
}

fn servers(size: u64) -> Vec<(&'static str, Any)> {
    let fdir = tempfile::tempdir().unwrap();
    let ffile = zero_file(fdir.path(), size);
    let ferry = Server::unix(&format!("file:{}", ffile.display()), &[]);
    let kdir = tempfile::tempdir().unwrap();
    let kfile = zero_file(kdir.path(), size);
    let k = Peer::nbdkit(kdir.path(), &["file", kfile.to_str().unwrap()]);
    let qdir = tempfile::tempdir().unwrap();
    let qfile = zero_file(qdir.path(), size);
    let q = Peer::qemu_nbd(qdir.path(), &qfile);
    vec![
        ("ferry", Any::Ferry(ferry, ffile, fdir)),
        ("nbdkit", Any::Peer(k, kfile, kdir)),
        ("qemu-nbd", Any::Peer(q, qfile, qdir)),
    ]
}

fn ferry(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args);
    c
}

#[test]
fn round_trip_with_holes_and_odd_size_against_every_server() {
    // Not a multiple of the request size; a multiple of 512 for qemu-nbd's sake.
    let size = 9 * MIB + 3 * 512;
    let data = data_with_holes(size as usize, 11);
    let work = tempfile::tempdir().unwrap();
    let src = write_sparse_file(work.path(), "src.img", &data);
    for (name, srv) in servers(size) {
        let uri = srv.uri();
        for conns in ["1", "4"] {
            run_ok(&mut ferry(&["copy", "-C", conns, "--request-size", "64K", src.to_str().unwrap(), &uri]));
            assert_file_eq(srv.file(), &data);
            let back = work.path().join(format!("back-{name}-{conns}.img"));
            run_ok(&mut ferry(&["copy", "-C", conns, &uri, back.to_str().unwrap()]));
            assert_file_eq(&back, &data);
        }
    }
}

#[test]
fn unaligned_size_round_trip() {
    let size = 5 * MIB + 4097;
    let data = data_with_holes(size as usize, 12);
    let work = tempfile::tempdir().unwrap();
    let src = write_sparse_file(work.path(), "src.img", &data);
    let srv = Server::unix(&format!("memory:{size}"), &[]);
    run_ok(&mut ferry(&["copy", src.to_str().unwrap(), &srv.uri()]));
    let back = work.path().join("back.img");
    run_ok(&mut ferry(&["copy", "--request-size", "100000", &srv.uri(), back.to_str().unwrap()]));
    assert_file_eq(&back, &data);
    let k = Peer::nbdkit(work.path(), &["memory", &size.to_string()]);
    run_ok(&mut ferry(&["copy", "-C", "3", &srv.uri(), &k.uri()]));
    let back2 = work.path().join("back2.img");
    run_ok(&mut ferry(&["copy", &k.uri(), back2.to_str().unwrap()]));
    assert_file_eq(&back2, &data);
}

#[test]
fn streaming_through_pipes() {
    let size = 6 * MIB;
    let data = data_with_holes(size as usize, 13);
    let work = tempfile::tempdir().unwrap();
    let src = write_sparse_file(work.path(), "src.img", &data);
    let srv = Server::unix(&format!("memory:{size}"), &[]);
    let sh = format!(
        "cat {} | {} copy - '{}' && {} copy '{}' - > {}/out.img",
        src.display(),
        ferry_bin().display(),
        srv.uri(),
        ferry_bin().display(),
        srv.uri(),
        work.path().display()
    );
    run_ok(&mut cmd("sh", ["-c", sh.as_str()]));
    assert_file_eq(&work.path().join("out.img"), &data);
}

#[test]
fn nbd_to_nbd_between_peers() {
    let size = 8 * MIB;
    let work = tempfile::tempdir().unwrap();
    let k = Peer::nbdkit(work.path(), &["pattern", &size.to_string()]);
    let srv = Server::unix(&format!("memory:{size}"), &[]);
    run_ok(&mut ferry(&["copy", "-C", "4", &k.uri(), &srv.uri()]));
    let out = work.path().join("out.img");
    run_ok(&mut ferry(&["copy", &srv.uri(), out.to_str().unwrap()]));
    assert_file_eq(&out, &pattern_bytes(0, size as usize));
}

#[test]
fn sparse_copies_make_holes() {
    let size = 16 * MIB;
    let mut data = vec![0u8; size as usize];
    data[..MIB as usize].fill(7);
    data[(12 * MIB) as usize..(13 * MIB) as usize].fill(9);
    let work = tempfile::tempdir().unwrap();
    // a fully allocated source: the zeroes must be detected, not read from holes
    let src = work.path().join("dense.img");
    fs::write(&src, &data).unwrap();
    let srv = Server::unix(&format!("memory:{size}"), &[]);
    run_ok(&mut ferry(&["copy", src.to_str().unwrap(), &srv.uri()]));
    let map = run_ok(&mut ferry(&["info", "--map", "--json", &srv.uri()]));
    let rows: serde_json::Value = serde_json::from_str(&map.stdout).unwrap();
    let holes: u64 = rows
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["description"] == "hole,zero")
        .map(|r| r["length"].as_u64().unwrap())
        .sum();
    assert!(holes >= 13 * MIB, "zero blocks became data on the server: {}", map.stdout);
    // NBD to a local file: the file is sparse
    let out = work.path().join("out.img");
    run_ok(&mut ferry(&["copy", &srv.uri(), out.to_str().unwrap()]));
    assert_file_eq(&out, &data);
    use std::os::unix::fs::MetadataExt;
    let allocated = fs::metadata(&out).unwrap().blocks() * 512;
    assert!(allocated <= 4 * MIB, "destination file is not sparse: {allocated} bytes allocated");
    // --sparse=false writes every byte
    let full = work.path().join("full.img");
    run_ok(&mut ferry(&["copy", "--sparse=false", &srv.uri(), full.to_str().unwrap()]));
    assert_file_eq(&full, &data);
}

#[test]
fn errors_are_clear_and_nonzero() {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src.img");
    fs::write(&src, vec![1u8; 4 * MIB as usize]).unwrap();
    // unreachable server
    let missing = format!("nbd+unix:///?socket={}/nobody.sock", work.path().display());
    let o = run_fails(&mut ferry(&["copy", src.to_str().unwrap(), &missing]));
    assert!(o.stderr.contains("cannot connect"), "{}", o.describe());
    // export not found
    let srv = Server::unix("memory:2M", &[]);
    let o = run_fails(&mut ferry(&["copy", src.to_str().unwrap(), &srv.uri_export("nope")]));
    assert!(o.stderr.contains("no such export") || o.stderr.contains("nope"), "{}", o.describe());
    let o = run_fails(&mut ferry(&["info", &srv.uri_export("nope")]));
    assert!(o.stderr.contains("nope"), "{}", o.describe());
    // destination too small: refused before anything is written
    let o = run_fails(&mut ferry(&["copy", src.to_str().unwrap(), &srv.uri()]));
    assert!(o.stderr.contains("smaller"), "{}", o.describe());
    let back = work.path().join("back.img");
    run_ok(&mut ferry(&["copy", &srv.uri(), back.to_str().unwrap()]));
    assert!(fs::read(&back).unwrap().iter().all(|&b| b == 0), "a refused copy wrote data");
    // read-only destination
    let ro = Server::unix("memory:8M", &["--read-only"]);
    let o = run_fails(&mut ferry(&["copy", src.to_str().unwrap(), &ro.uri()]));
    assert!(o.stderr.contains("read-only"), "{}", o.describe());
    // a bad URI says why
    let o = run_fails(&mut ferry(&["copy", "nbd+unix:///disk", "null:"]));
    assert!(o.stderr.contains("socket"), "{}", o.describe());
}

#[test]
fn server_dying_mid_copy_is_an_error() {
    let work = tempfile::tempdir().unwrap();
    // Every read takes 20 ms; 64K requests, 4 at a time, make the copy last about 5 s, so
    // it is still running when the server dies.
    let mut k = Peer::nbdkit(work.path(), &["--filter=delay", "pattern", "64M", "rdelay=20ms"]);
    let out = work.path().join("out.img");
    let child = ferry(&["copy", "-C", "1", "-R", "4", "--request-size", "64K", &k.uri(), out.to_str().unwrap()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    k.kill();
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "copy succeeded although the server died: {stderr}");
    // The server's end shows as a closed connection or, when the kill lands while a
    // reply is being sent, a reset one; either way the error names the source.
    let said = ["offset", "closed", "reset by peer"].iter().any(|w| stderr.contains(w));
    assert!(said && stderr.contains("source"), "unclear error: {stderr}");
}

/// `ferry info --json` and `nbdinfo --json` describe the same export the same way.
#[test]
fn info_json_agrees_with_nbdinfo() {
    require("nbdinfo");
    let work = tempfile::tempdir().unwrap();
    let img = zero_file(work.path(), 4 * MIB);
    let f = Server::unix(&format!("file:{}", img.display()), &["--description", "a disk"]);
    let fro = Server::unix("pattern:3M", &[]);
    let k = Peer::nbdkit(work.path(), &["memory", "5M"]);
    let qdir = tempfile::tempdir().unwrap();
    let qimg = zero_file(qdir.path(), 2 * MIB);
    let q = Peer::qemu_nbd(qdir.path(), &qimg);
    for uri in [f.uri(), fro.uri(), k.uri(), q.uri()] {
        let ours: serde_json::Value =
            serde_json::from_str(&run_ok(&mut ferry(&["info", "--json", &uri])).stdout).unwrap();
        let theirs: serde_json::Value =
            serde_json::from_str(&run_ok(&mut cmd("nbdinfo", ["--json", uri.as_str()])).stdout).unwrap();
        let (a, b) = (&ours["exports"][0], &theirs["exports"][0]);
        for key in [
            "export-size",
            "is_read_only",
            "is_rotational",
            "can_cache",
            "can_df",
            "can_fast_zero",
            "can_flush",
            "can_fua",
            "can_multi_conn",
            "can_trim",
            "can_zero",
            "block_size_minimum",
            "block_size_preferred",
            "block_size_maximum",
            "description",
        ] {
            assert_eq!(a.get(key), b.get(key), "{key} differs for {uri}:\nferry: {a}\nnbdinfo: {b}");
        }
        assert_eq!(a["contexts"], b["contexts"], "contexts differ for {uri}");
    }
    // --size and --list
    assert_eq!(run_ok(&mut ferry(&["info", "--size", &f.uri()])).stdout.trim(), (4 * MIB).to_string());
    let multi = ServerBuilder::new("memory:1M").export("second", "null:2M").export("third", "pattern:3M").start();
    let l: serde_json::Value =
        serde_json::from_str(&run_ok(&mut ferry(&["info", "--list", "--json", &multi.uri()])).stdout).unwrap();
    let mut names: Vec<(String, u64)> = l["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["export-name"].as_str().unwrap().to_string(), e["export-size"].as_u64().unwrap()))
        .collect();
    names.sort();
    assert_eq!(names, vec![("".into(), MIB), ("second".into(), 2 * MIB), ("third".into(), 3 * MIB)]);
}

/// The blkhash definition, computed by Python's hashlib from the plain bytes.
fn reference_blkhash(path: &Path) -> String {
    let script = "import hashlib,sys\nd=open(sys.argv[1],'rb').read()\nbs=65536\n\
                  o=b''.join(hashlib.sha256(d[i:i+bs]).digest() for i in range(0,len(d),bs))\n\
                  print(hashlib.sha256(o+len(d).to_bytes(8,'little')).hexdigest())";
    run_ok(&mut cmd(SYSTEM_PYTHON, ["-c", script, path.to_str().unwrap()])).stdout.trim().to_string()
}

fn first_word(s: &str) -> String {
    s.split_whitespace().next().unwrap_or("").to_string()
}

#[test]
fn hash_is_the_same_everywhere() {
    let size = 7 * MIB + 65536 * 3 + 1000; // not a block multiple, not 512-aligned
    let data = data_with_holes(size as usize, 21);
    let work = tempfile::tempdir().unwrap();
    let sparse = write_sparse_file(work.path(), "sparse.img", &data);
    let dense = work.path().join("dense.img");
    fs::write(&dense, &data).unwrap();
    let want = reference_blkhash(&dense);
    let h = |args: &[&str]| first_word(&run_ok(&mut ferry(args)).stdout);
    assert_eq!(h(&["hash", dense.to_str().unwrap()]), want);
    assert_eq!(h(&["hash", "--threads", "1", sparse.to_str().unwrap()]), want);
    assert_eq!(h(&["hash", "--threads", "4", sparse.to_str().unwrap()]), want);
    let piped = run_ok(&mut cmd("sh", ["-c", &format!("{} hash - < {}", ferry_bin().display(), dense.display())]));
    assert_eq!(first_word(&piped.stdout), want);
    assert_eq!(h(&["copy", "--hash", sparse.to_str().unwrap(), "null:"]), want);
    // as exports of three servers
    let f = Server::unix(&format!("file:{}", sparse.display()), &["--read-only"]);
    assert_eq!(h(&["hash", &f.uri()]), want);
    let k = Peer::nbdkit(work.path(), &["file", sparse.to_str().unwrap()]);
    assert_eq!(h(&["hash", &k.uri()]), want);
    let qdir = tempfile::tempdir().unwrap();
    let padded = work.path().join("padded.img"); // qemu-nbd serves whole sectors
    let mut pdata = data.clone();
    pdata.resize(size.div_ceil(512) as usize * 512, 0);
    fs::write(&padded, &pdata).unwrap();
    let q = Peer::qemu_nbd(qdir.path(), &padded);
    assert_eq!(h(&["hash", &q.uri()]), reference_blkhash(&padded));
    // empty input: the known vector
    let empty = work.path().join("empty");
    fs::write(&empty, b"").unwrap();
    assert_eq!(
        h(&["hash", empty.to_str().unwrap()]),
        "af5570f5a1810b7af78caf4bc70a660f0df51e42baf91d4de5b2328de0e83dfc"
    );
}

/// A local file into a ferry file export over plaintext sockets: over a Unix socket
/// WRITE payloads leave the source with sendfile. Zero detection still sees a block whose
/// data starts late (its probe is all zero) and a block of zeroes, and every byte
/// arrives, over Unix and TCP.
#[test]
fn file_to_file_export_with_sendfile_keeps_every_byte() {
    const K: usize = 1024;
    let size = 8 * MIB as usize + 12345;
    let mut data = pattern_bytes(0, size);
    data[256 * K..512 * K].fill(0);
    data[512 * K - 1] = 5; // data only in the last byte of the second block
    data[512 * K..768 * K].fill(0); // the third block is all zeroes
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src.img");
    fs::write(&src, &data).unwrap();
    for tcp in [false, true] {
        let dst = work.path().join("dst.img");
        fs::write(&dst, vec![0xAAu8; size]).unwrap();
        let spec = format!("file:{}", dst.display());
        let srv = if tcp { Server::tcp(&spec, &[]) } else { Server::unix(&spec, &[]) };
        let out = run_ok(&mut ferry(&["copy", "--stats", "-C", "2", src.to_str().unwrap(), &srv.uri()]));
        assert_file_eq(&dst, &data);
        let stats = &out.stderr;
        assert!(stats.contains(&format!("{} zeroes detected", 256 * K)), "tcp={tcp}: {stats}");
        assert_eq!(stats.contains("+ 0 bytes in 0 sendfile"), tcp, "sendfile only over Unix: {stats}");
    }
}

/// A sparse local file's holes are never read (the allocation map skips them), and a
/// dense file is copied whole.
#[test]
fn local_holes_are_skipped() {
    let work = tempfile::tempdir().unwrap();
    let sparse = work.path().join("sparse.img");
    let f = fs::File::create(&sparse).unwrap();
    f.set_len(64 * MIB).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&vec![7u8; MIB as usize], 10 * MIB).unwrap();
    drop(f);
    let dense = work.path().join("dense.img");
    fs::write(&dense, pattern_bytes(0, 8 * MIB as usize)).unwrap();
    for (src, holes) in [(&sparse, 63 * MIB), (&dense, 0)] {
        let srv = Server::unix(&format!("memory:{}", 64 * MIB), &[]);
        let out = run_ok(&mut ferry(&["copy", "--stats", src.to_str().unwrap(), &srv.uri()]));
        assert!(out.stderr.contains(&format!(" {holes} holes skipped")), "{}", out.stderr);
        let back = work.path().join("back.img");
        run_ok(&mut ferry(&["copy", &srv.uri(), back.to_str().unwrap()]));
        let want = fs::read(src).unwrap();
        assert_file_eq(
            &back,
            &[want, vec![0u8; (64 * MIB) as usize - fs::metadata(src).unwrap().len() as usize]].concat(),
        );
    }
}

/// A server without WRITE_ZEROES (nbdkit's nozero filter) still gets an exact copy: the
/// source's holes and zero blocks go as WRITEs of zeroes over what was there before.
#[test]
fn zeroes_go_as_data_to_a_server_without_write_zeroes() {
    let work = tempfile::tempdir().unwrap();
    let size = 8 * MIB as usize;
    let mut peer = Peer::nbdkit(work.path(), &["--filter=nozero", "memory", "8M", "zeromode=none"]);
    let info = run_ok(&mut ferry(&["info", "--json", &peer.uri()]));
    assert!(!info.stdout.contains("\"can_zero\": true"), "the filter should hide WRITE_ZEROES: {}", info.stdout);
    // Fill the export with data, then copy a source of holes, a zero block and data over it.
    let full = work.path().join("full.img");
    fs::write(&full, vec![0x5Au8; size]).unwrap();
    run_ok(&mut ferry(&["copy", full.to_str().unwrap(), &peer.uri()]));
    let src = work.path().join("sparse.img");
    let f = fs::File::create(&src).unwrap();
    f.set_len(size as u64).unwrap();
    use std::os::unix::fs::FileExt;
    let mut block = vec![9u8; 3 * MIB as usize];
    block[MIB as usize..(MIB + 256 * 1024) as usize].fill(0); // a zero block inside the data
    f.write_all_at(&block, 2 * MIB).unwrap();
    drop(f);
    let out = run_ok(&mut ferry(&["copy", "--stats", src.to_str().unwrap(), &peer.uri()]));
    assert!(out.stderr.contains(" 262144 zeroes detected"), "{}", out.stderr);
    let back = work.path().join("back.img");
    run_ok(&mut ferry(&["copy", &peer.uri(), back.to_str().unwrap()]));
    assert_file_eq(&back, &fs::read(&src).unwrap());
    peer.kill();
}

/// A preallocated source (fallocate: space reserved, never written) is copied exactly.
/// Where the file system reports unwritten space as holes (ext4, XFS), it is skipped
/// without being read; on tmpfs ferry takes an allocated file as all data (there a hole
/// search walks every page), and zero detection finds the same zeroes.
#[test]
fn preallocated_source_is_skipped_where_the_file_system_reports_holes() {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("prealloc.img");
    run_ok(&mut cmd("fallocate", ["-l", "64M", src.to_str().unwrap()]));
    let f = fs::OpenOptions::new().write(true).open(&src).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&[7u8; 1000], 5 * MIB).unwrap();
    drop(f);
    let fstype = run_ok(&mut cmd("stat", ["-f", "-c", "%T", work.path().to_str().unwrap()])).stdout;
    let srv = Server::unix(&format!("memory:{}", 64 * MIB), &[]);
    let out = run_ok(&mut ferry(&["copy", "--stats", src.to_str().unwrap(), &srv.uri()]));
    let count = |what: &str| -> u64 {
        let before = out.stderr.split(what).next().unwrap_or("");
        before.rsplit(' ').next().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{what}: {}", out.stderr))
    };
    let (holes, zeroes) = (count(" holes skipped"), count(" zeroes detected"));
    if fstype.trim() == "tmpfs" {
        assert!(holes + zeroes >= 63 * MIB, "{}", out.stderr);
    } else {
        assert!(holes >= 63 * MIB, "preallocated space on {fstype} was read, not skipped: {}", out.stderr);
    }
    let back = work.path().join("back.img");
    run_ok(&mut ferry(&["copy", &srv.uri(), back.to_str().unwrap()]));
    assert_file_eq(&back, &fs::read(&src).unwrap());
}
