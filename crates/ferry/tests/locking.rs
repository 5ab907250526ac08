//! Images shared with qemu: ferry takes the OFD locks qemu takes (bytes 100+perm held,
//! 200+perm not shared), so ferry and qemu-nbd, qemu-io, qemu-img see each other, and
//! ferry refuses to open one image twice or to copy an image onto itself.

use crate::common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SIZE: u64 = 8 << 20;

fn ferry(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args);
    c
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A qcow2 and a raw image with data, in a fresh directory.
struct Images {
    dir: tempfile::TempDir,
    qcow2: PathBuf,
    raw: PathBuf,
}

fn images() -> Images {
    require("qemu-img");
    require("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let qcow2 = dir.path().join("disk.qcow2");
    let raw = dir.path().join("disk.img");
    run_ok(&mut cmd("qemu-img", ["create", "-q", "-f", "qcow2", s(&qcow2), &SIZE.to_string()]));
    run_ok(&mut cmd("qemu-io", ["-f", "qcow2", "-c", "write -P 0x5a 0 1M", s(&qcow2)]));
    let mut data = Rng::new(19).bytes(SIZE as usize);
    data[..4096].fill(1);
    std::fs::write(&raw, &data).unwrap();
    Images { dir, qcow2, raw }
}

/// A qemu tool holding an image until dropped.
struct Holder {
    child: Child,
    what: String,
}

impl Holder {
    /// Starts `program args` and waits until `ready` exists (a socket it listens on).
    fn start(program: &str, args: &[&str], ready: &Path) -> Holder {
        require(program);
        let what = format!("{program} {}", args.join(" "));
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ready.exists() {
            assert!(child.try_wait().unwrap().is_none(), "{what} exited early");
            assert!(Instant::now() < deadline, "{what} did not create {}", ready.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        Holder { child, what }
    }

    /// qemu-nbd serving `img` (format `fmt`), read-only with `-r`.
    fn qemu_nbd(dir: &Path, fmt: &str, img: &Path, extra: &[&str]) -> Holder {
        let sock = dir.join(format!("qemu-nbd-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&sock);
        let mut args = vec!["-f", fmt, "-k", s(&sock)];
        args.extend_from_slice(extra);
        args.push(s(img));
        Holder::start("qemu-nbd", &args, &sock)
    }

    fn alive(&mut self) {
        assert!(self.child.try_wait().unwrap().is_none(), "{} exited", self.what);
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ferry serve ARGS... --run true`: exits 0 once it served, or fails to start.
fn serve_once(args: &[&str]) -> Command {
    // A free port each time: tests run in parallel.
    let mut c = ferry(&["serve", "--port", "0", "--run", "true"]);
    c.args(args);
    c
}

fn hash(p: &Path) -> String {
    run_ok(&mut ferry(&["hash", s(p)])).stdout
}

/// The error names the image and the way to override it.
fn assert_refused(out: &Output, image: &Path, holder: &str) {
    let name = image.file_name().unwrap().to_str().unwrap();
    assert!(
        out.stderr.contains(name) && out.stderr.contains("in use") && out.stderr.contains(holder),
        "the error should name the image and {holder}\n{}",
        out.describe()
    );
}

#[test]
fn ferry_serving_a_qcow2_image_keeps_qemu_and_ferry_out() {
    let im = images();
    let q = s(&im.qcow2);
    let _server = Server::unix(q, &[]);
    // Writers, and readers that do not share writes, are refused: qemu-io, qemu-nbd
    // (read-write and read-only), qemu-img info.
    for c in [
        cmd("qemu-io", ["-f", "qcow2", "-c", "write -P 1 0 64k", q]),
        cmd("qemu-nbd", ["-f", "qcow2", "-k", s(&im.dir.path().join("x.sock")), q]),
        cmd("qemu-nbd", ["-r", "-f", "qcow2", "-k", s(&im.dir.path().join("y.sock")), q]),
        cmd("qemu-img", ["info", q]),
    ]
    .iter_mut()
    {
        let out = run_fails(c);
        assert!(out.stderr.contains("lock"), "{}", out.describe());
    }
    // ... unless they force sharing, as a read-only user may.
    run_ok(&mut cmd("qemu-img", ["info", "-U", q]));
    run_ok(&mut cmd("qemu-io", ["-r", "-U", "-f", "qcow2", "-c", "read -P 0x5a 0 1M", q]));
    // A second ferry serve, read-write or read-only, is refused; read-only with
    // --force-share it serves.
    assert_refused(&run_fails(&mut serve_once(&[q])), &im.qcow2, "ferry");
    let out = run_fails(&mut serve_once(&["--read-only", q]));
    assert!(out.stderr.contains("--force-share"), "{}", out.describe());
    run_ok(&mut serve_once(&["--read-only", "--force-share", q]));
    // The reading tools are refused, and read with -U.
    let copy = im.dir.path().join("copy.img");
    for args in [vec!["info", q], vec!["hash", q], vec!["copy", q, s(&copy)]] {
        let out = run_fails(&mut ferry(&args));
        assert_refused(&out, &im.qcow2, "ferry");
        assert!(out.stderr.contains("--force-share"), "{}", out.describe());
        let mut forced = args.clone();
        forced.insert(1, "-U");
        run_ok(&mut ferry(&forced));
    }
}

#[test]
fn qemu_nbd_holding_an_image_keeps_ferry_out() {
    let im = images();
    let q = s(&im.qcow2);
    {
        // qemu-nbd on a qcow2 image lets no other writer in, nor a reader that does not
        // share writes.
        let mut h = Holder::qemu_nbd(im.dir.path(), "qcow2", &im.qcow2, &[]);
        let out = run_fails(&mut serve_once(&[q]));
        assert_refused(&out, &im.qcow2, "qemu-nbd");
        run_fails(&mut serve_once(&["--read-only", q]));
        run_ok(&mut serve_once(&["--read-only", "--force-share", q]));
        for args in [vec!["info", q], vec!["hash", q], vec!["copy", q, "null:"]] {
            assert_refused(&run_fails(&mut ferry(&args)), &im.qcow2, "qemu-nbd");
            let mut forced = args.clone();
            forced.insert(1, "--force-share");
            run_ok(&mut ferry(&forced));
        }
        // A copy does not overwrite it, as a new qcow2 image or as raw bytes.
        for dst in [q.to_string(), format!("raw:{q}")] {
            assert_refused(&run_fails(&mut ferry(&["copy", s(&im.raw), &dst])), &im.qcow2, "qemu-nbd");
        }
        h.alive();
    }
    run_ok(&mut cmd("qemu-img", ["check", "-q", q]));
    let out = run_ok(&mut cmd("qemu-io", ["-f", "qcow2", "-c", "read -P 0x5a 0 1M", q]));
    assert!(!out.stdout.contains("failed"), "the image changed\n{}", out.describe());
    {
        // Read-only, it still keeps writers out.
        let _h = Holder::qemu_nbd(im.dir.path(), "qcow2", &im.qcow2, &["-r"]);
        assert_refused(&run_fails(&mut serve_once(&[q])), &im.qcow2, "qemu-nbd");
        run_ok(&mut serve_once(&["--read-only", q]));
        run_ok(&mut ferry(&["hash", q]));
    }
    // qemu-nbd on a raw file shares writes (as with qemu, a second writer may open it),
    // but its writes keep a copy's or hash's source lock out.
    let r = s(&im.raw);
    let _h = Holder::qemu_nbd(im.dir.path(), "raw", &im.raw, &[]);
    run_ok(&mut serve_once(&[r]));
    for args in [vec!["hash", r], vec!["copy", r, "null:"]] {
        assert_refused(&run_fails(&mut ferry(&args)), &im.raw, "qemu-nbd");
        let mut forced = args.clone();
        forced.insert(1, "-U");
        run_ok(&mut ferry(&forced));
    }
    run_ok(&mut ferry(&["info", r]));
}

#[test]
fn a_raw_image_being_converted_is_not_written_and_one_being_written_is_not_converted() {
    require("nbdkit");
    let im = images();
    let r = s(&im.raw);
    // ferry serving the raw image read-write: qemu-img convert cannot read it (unless
    // -U), while qemu-io may write it too, as with qemu-nbd.
    {
        let _server = Server::unix(r, &[]);
        let out =
            run_fails(&mut cmd("qemu-img", ["convert", "-f", "raw", "-O", "raw", r, s(&im.dir.path().join("c1"))]));
        assert!(out.stderr.contains("lock"), "{}", out.describe());
        run_ok(&mut cmd("qemu-img", ["convert", "-U", "-f", "raw", "-O", "raw", r, s(&im.dir.path().join("c2"))]));
        run_ok(&mut cmd("qemu-io", ["-f", "raw", "-c", "write -P 1 0 4k", r]));
    }
    // A convert kept busy by a slow destination: ferry cannot serve its source for writing.
    let sock = im.dir.path().join("slow.sock");
    let _slow = Holder::start(
        "nbdkit",
        &["-f", "-U", s(&sock), "--filter=delay", "memory", &SIZE.to_string(), "wdelay=30"],
        &sock,
    );
    let target = format!("nbd+unix:///?socket={}", s(&sock));
    let ready = im.dir.path().join("never");
    let mut convert =
        Holder::start("qemu-img", &["convert", "-n", "-f", "raw", "-O", "raw", r, &target], &ready_or(&ready));
    wait_for_lock(&im.raw);
    convert.alive();
    let out = run_fails(&mut serve_once(&[r]));
    assert_refused(&out, &im.raw, "qemu-img");
    run_ok(&mut serve_once(&["--read-only", r]));
}

/// `ready` made to exist at once: for holders that create no socket.
fn ready_or(p: &Path) -> PathBuf {
    std::fs::write(p, b"").unwrap();
    p.to_path_buf()
}

/// Waits until some process holds an OFD lock on `p` (/proc/locks names its inode).
fn wait_for_lock(p: &Path) {
    use std::os::unix::fs::MetadataExt;
    let ino = format!(":{} ", std::fs::metadata(p).unwrap().ino());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string("/proc/locks").unwrap().lines().any(|l| l.contains("OFDLCK") && l.contains(&ino)) {
        assert!(Instant::now() < deadline, "nobody locked {}", p.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn one_image_is_not_opened_twice_by_one_server() {
    let im = images();
    let (q, r) = (s(&im.qcow2), s(&im.raw));
    let overlay = im.dir.path().join("overlay.qcow2");
    run_ok(&mut cmd("qemu-img", ["create", "-q", "-f", "qcow2", "-b", r, "-F", "raw", s(&overlay)]));
    for (spec, other) in [(q, q), (r, r), (s(&overlay), r), (r, s(&overlay))] {
        let out = run_fails(&mut serve_once(&[spec, "--export", &format!("b={other}")]));
        assert!(out.stderr.contains("disk."), "the error names the image\n{}", out.describe());
    }
    // Read-only, each export may open it.
    run_ok(&mut serve_once(&["--read-only", r, "--export", &format!("b={r}")]));
    run_ok(&mut serve_once(&["--read-only", s(&overlay), "--export", &format!("b={r}")]));
}

#[test]
fn a_copy_onto_its_own_source_is_refused() {
    let im = images();
    for img in [&im.qcow2, &im.raw] {
        let before = hash(img);
        let out = run_fails(&mut ferry(&["copy", s(img), s(img)]));
        assert!(out.stderr.contains("source itself"), "{}", out.describe());
        for prefixed in [format!("raw:{}", s(img)), format!("qcow2:{}", s(img))] {
            run_fails(&mut ferry(&["copy", s(img), &prefixed]));
        }
        // Through another name of the same file.
        let link = im.dir.path().join("link");
        let _ = std::fs::remove_file(&link);
        std::fs::hard_link(img, &link).unwrap();
        run_fails(&mut ferry(&["copy", s(img), s(&link)]));
        assert_eq!(hash(img), before, "{} changed", img.display());
    }
    // A file of the source's backing chain.
    let overlay = im.dir.path().join("overlay.qcow2");
    run_ok(&mut cmd("qemu-img", ["create", "-q", "-f", "qcow2", "-b", s(&im.raw), "-F", "raw", s(&overlay)]));
    let before = hash(&im.raw);
    let out = run_fails(&mut ferry(&["copy", s(&overlay), s(&im.raw)]));
    assert!(out.stderr.contains("backing chain"), "{}", out.describe());
    assert_eq!(hash(&im.raw), before);
    // An NBD export onto itself, by the same or another name of the server.
    let server = Server::tcp(s(&im.raw), &[]);
    let uri = server.uri();
    let out = run_fails(&mut ferry(&["copy", &uri, &uri]));
    assert!(out.stderr.contains("own export"), "{}", out.describe());
    run_fails(&mut ferry(&["copy", &uri, &uri.replace("127.0.0.1", "localhost")]));
    drop(server);
    let server = Server::unix(s(&im.raw), &[]);
    run_fails(&mut ferry(&["copy", &server.uri(), &server.uri()]));
    drop(server);
    assert_eq!(hash(&im.raw), before);
}

/// The OFD lock ranges every process holds on `p`, as /proc/locks lists them, sorted.
fn lock_ranges(p: &Path) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let ino = format!(":{}", std::fs::metadata(p).unwrap().ino());
    let mut v: Vec<String> = std::fs::read_to_string("/proc/locks")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let i = f.iter().position(|x| x.ends_with(&ino))?;
            let range = format!("{}-{}", f.get(i + 1)?, f.get(i + 2)?);
            (f.get(1) == Some(&"OFDLCK")).then_some(range)
        })
        .collect();
    v.sort();
    v
}

#[test]
fn ferry_serve_takes_the_lock_bytes_qemu_nbd_takes() {
    let im = images();
    let overlay = im.dir.path().join("overlay.qcow2");
    run_ok(&mut cmd("qemu-img", ["create", "-q", "-f", "qcow2", "-b", s(&im.raw), "-F", "raw", s(&overlay)]));
    let with_data = im.dir.path().join("ext.qcow2");
    let data = im.dir.path().join("ext.data");
    let opt = format!("data_file={},data_file_raw=on", s(&data));
    run_ok(&mut cmd("qemu-img", ["create", "-q", "-f", "qcow2", "-o", &opt, s(&with_data), "1M"]));
    // (image, format, files to compare, read-only)
    let cases: [(&Path, &str, Vec<&Path>, bool); 7] = [
        (&im.raw, "raw", vec![&im.raw], false),
        (&im.raw, "raw", vec![&im.raw], true),
        (&im.qcow2, "qcow2", vec![&im.qcow2], false),
        (&im.qcow2, "qcow2", vec![&im.qcow2], true),
        (&overlay, "qcow2", vec![&overlay, &im.raw], false),
        (&overlay, "qcow2", vec![&overlay, &im.raw], true),
        (&with_data, "qcow2", vec![&with_data, &data], true),
    ];
    for (img, fmt, files, ro) in cases {
        // Every file of these images is locked by both servers; on a loaded machine a
        // server's socket can appear before its last file is opened, so look until all are.
        let settled = || {
            let mut v = Vec::new();
            for _ in 0..50 {
                v = files.iter().map(|f| lock_ranges(f)).collect::<Vec<_>>();
                if v.iter().all(|l| !l.is_empty()) {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            v
        };
        let theirs = {
            let _h = Holder::qemu_nbd(im.dir.path(), fmt, img, if ro { &["-r"] } else { &[] });
            settled()
        };
        let ours = {
            let _server = Server::unix(&format!("{fmt}:{}", s(img)), if ro { &["--read-only"] } else { &[] });
            settled()
        };
        assert!(!theirs[0].is_empty(), "qemu-nbd locked nothing on {}", img.display());
        assert_eq!(ours, theirs, "locks on {files:?} served {} (read-only: {ro})", img.display());
    }
}
