//! Getting one file back, and the small leftovers of issue 37, through the CLI:
//!
//! * `ferry mount REPO::NAME[@ID] DIR`: `disk.raw` and one file per partition (a GPT made by
//!   sgdisk, an MBR with logical partitions made by sfdisk) read back byte for byte; the
//!   ext4 partition mounted with `mount -o loop,ro` and a file read from it (this test
//!   runs as root, as scripts/test does: it fails, never skips, otherwise); SIGTERM and
//!   SIGINT unmount; an encrypted repository; a missing snapshot exits 1;
//! * `ferry compare -s` fails on a difference of allocation, as `qemu-img compare -s`;
//! * `ferry serve --fork -p 0` prints its URI, with the port it picked;
//! * more than 16 `--tag`s is a usage error (2);
//! * `ferry repo key passwd` on a terminal asks for the new passphrase twice.

use crate::common::*;
use crate::repo_crash::{ferry_cmd, s};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

const MIB: usize = 1 << 20;

fn code(out: &Output) -> i32 {
    out.status.code().unwrap_or_else(|| panic!("killed\n{}", out.describe()))
}

fn is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
}

fn is_mounted(dir: &Path) -> bool {
    let dir = fs::canonicalize(dir).unwrap();
    fs::read_to_string("/proc/self/mounts").unwrap().lines().any(|l| l.split(' ').nth(1) == Some(s(&dir)))
}

/// `ferry mount SNAPSHOT DIR` running in the foreground; unmounted when dropped.
struct Mounted {
    child: Child,
    dir: PathBuf,
    log: PathBuf,
}

impl Mounted {
    fn start(snapshot: &str, dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Mounted {
        fs::create_dir_all(dir).unwrap();
        let log = dir.with_extension("log");
        let mut c = ferry_cmd(&[&["mount", snapshot, s(dir)], extra].concat());
        c.envs(env.iter().copied()).stdin(Stdio::null()).stdout(Stdio::null());
        let child = c.stderr(fs::File::create(&log).unwrap()).spawn().unwrap();
        let mut m = Mounted { child, dir: dir.to_path_buf(), log };
        let up = wait_until(Duration::from_secs(30), || {
            dir.join("disk.raw").exists() || m.child.try_wait().unwrap().is_some()
        });
        assert!(up && dir.join("disk.raw").exists(), "not mounted: {}", m.log());
        m
    }
    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
    fn read(&self, name: &str) -> Vec<u8> {
        fs::read(self.dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}\n{}", self.log()))
    }
    /// Sends `sig` and waits for the exit: the status, and whether DIR was left unmounted.
    fn stop(mut self, sig: &str) -> i32 {
        run_ok(&mut cmd("kill", [format!("-{sig}"), self.child.id().to_string()]));
        let ended = wait_until(Duration::from_secs(20), || self.child.try_wait().unwrap().is_some());
        assert!(ended, "ferry mount did not end on {sig}: {}", self.log());
        assert!(!is_mounted(&self.dir), "{} still mounted after {sig}", self.dir.display());
        self.child.wait().unwrap().code().unwrap_or(-1)
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if is_mounted(&self.dir) {
            let _ = std::process::Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

/// The bytes `start..start + len` of `disk` (in 512-byte sectors).
fn range(disk: &[u8], start: usize, sectors: usize) -> &[u8] {
    &disk[start * 512..(start + sectors) * 512]
}

/// An 8 MiB disk of random bytes with a GPT: partition 1 (2 MiB, "esp stuff"), partition
/// 2 (4 MiB from sector 6144, "root") holding an ext4 file system with `hello.txt`.
fn gpt_disk(d: &Path) -> (PathBuf, Vec<u8>) {
    let disk = d.join("gpt.raw");
    fs::write(&disk, Rng::new(11).bytes(8 * MIB)).unwrap();
    run_ok(&mut cmd(
        "sgdisk",
        [
            "-n",
            "1:2048:6143",
            "-c",
            "1:esp stuff",
            "-t",
            "1:ef00",
            "-n",
            "2:6144:14335",
            "-c",
            "2:root",
            "-t",
            "2:8300",
            s(&disk),
        ],
    ));
    let files = d.join("files");
    fs::create_dir_all(files.join("etc")).unwrap();
    fs::write(files.join("etc/hello.txt"), "one file back\n").unwrap();
    let fs_img = d.join("part2.ext4");
    run_ok(&mut cmd("mkfs.ext4", ["-q", "-F", "-d", s(&files), s(&fs_img), "4M"]));
    let mut bytes = fs::read(&disk).unwrap();
    bytes[6144 * 512..14336 * 512].copy_from_slice(&fs::read(&fs_img).unwrap());
    fs::write(&disk, &bytes).unwrap();
    (disk, bytes)
}

/// An 8 MiB disk of random bytes with an MBR: primary 1 (sectors 2048+4096), an extended
/// partition 2 (6144 to the end) holding logicals 5 (8192+2048) and 6 (12288+2048).
fn mbr_disk(d: &Path) -> (PathBuf, Vec<u8>) {
    let disk = d.join("mbr.raw");
    fs::write(&disk, Rng::new(12).bytes(8 * MIB)).unwrap();
    let table = "label: dos\nstart=2048, size=4096, type=83\nstart=6144, type=5\nstart=8192, size=2048, type=83\n\
                 start=12288, size=2048, type=82\n";
    let mut c = cmd("sfdisk", ["-q", "--no-reread", "--no-tell-kernel", s(&disk)]);
    let mut child = c.stdin(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
    {
        use std::io::Write;
        child.stdin.take().unwrap().write_all(table.as_bytes()).unwrap();
    }
    assert!(child.wait().unwrap().success(), "sfdisk failed");
    let bytes = fs::read(&disk).unwrap();
    (disk, bytes)
}

#[test]
fn mount_shows_the_disk_and_each_partition_and_unmounts_on_signals() {
    for tool in ["sgdisk", "sfdisk", "mkfs.ext4"] {
        require(tool);
    }
    assert!(which("fusermount3").is_some() || which("fusermount").is_some(), "install fuse3 (fusermount3)");
    assert!(is_root(), "this test mounts a loop device: run it as root (scripts/test does)");
    let d = tempfile::tempdir().unwrap();
    let (gpt, gpt_bytes) = gpt_disk(d.path());
    let (mbr, mbr_bytes) = mbr_disk(d.path());
    let repo = d.path().join("repo");
    run_ok(ferry_cmd(&["repo", "init", "--encrypt", "--kdf-memory", "8M", s(&repo)]).env("FERRY_PASSWORD", "pw"));
    for (src, name) in [(&gpt, "gpt"), (&mbr, "mbr")] {
        run_ok(ferry_cmd(&["backup", s(src), &format!("{}::{name}", repo.display())]).env("FERRY_PASSWORD", "pw"));
    }

    // The GPT disk: the whole disk, both partitions, their names.
    let m = Mounted::start(&format!("{}::gpt", repo.display()), &d.path().join("m1"), &[], &[("FERRY_PASSWORD", "pw")]);
    assert_same_bytes(&m.read("disk.raw"), &gpt_bytes, "disk.raw");
    assert_same_bytes(&m.read("part1"), range(&gpt_bytes, 2048, 4096), "part1");
    assert_same_bytes(&m.read("part2"), range(&gpt_bytes, 6144, 8192), "part2");
    let list = String::from_utf8(m.read("partitions.txt")).unwrap();
    assert!(list.contains("GPT") && list.contains("name \"root\"") && list.contains("name \"esp stuff\""), "{list}");
    assert!(list.contains("(EFI system)") && list.contains("(Linux filesystem)"), "{list}");
    let names: Vec<String> =
        fs::read_dir(&m.dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names.len(), 4, "{names:?}");
    // Written to: refused.
    assert!(fs::OpenOptions::new().write(true).open(m.dir.join("disk.raw")).is_err());
    // The ext4 partition through a loop device, read-only.
    let mnt = d.path().join("mnt");
    fs::create_dir(&mnt).unwrap();
    run_ok(&mut cmd("mount", ["-o", "loop,ro", s(&m.dir.join("part2")), s(&mnt)]));
    let hello = fs::read_to_string(mnt.join("etc/hello.txt"));
    run_ok(&mut cmd("umount", [s(&mnt)]));
    assert_eq!(hello.unwrap(), "one file back\n");
    assert_eq!(m.stop("TERM"), 0);

    // The MBR disk: primary 1, logicals 5 and 6; the extended container has no file. The
    // passphrase from --password-command.
    let dir = d.path().join("m2");
    let m = Mounted::start(&format!("{}::mbr", repo.display()), &dir, &["--password-command", "echo pw"], &[]);
    assert_same_bytes(&m.read("disk.raw"), &mbr_bytes, "disk.raw");
    assert_same_bytes(&m.read("part1"), range(&mbr_bytes, 2048, 4096), "part1");
    assert_same_bytes(&m.read("part5"), range(&mbr_bytes, 8192, 2048), "part5");
    assert_same_bytes(&m.read("part6"), range(&mbr_bytes, 12288, 2048), "part6");
    assert!(!dir.join("part2").exists(), "the extended partition is no file");
    let list = String::from_utf8(m.read("partitions.txt")).unwrap();
    assert!(list.contains("MBR") && list.contains("0x82 (Linux swap)"), "{list}");
    assert_eq!(m.stop("INT"), 0);

    // A snapshot that is not there: exit 1 (docs/repo.md, "Exit status"), nothing mounted;
    // no repository: 10; no passphrase for an encrypted one: 12.
    let dir = d.path().join("m3");
    fs::create_dir(&dir).unwrap();
    let o = run(ferry_cmd(&["mount", &format!("{}::nope", repo.display()), s(&dir)]).env("FERRY_PASSWORD", "pw"));
    assert_eq!(code(&o), 1, "{}", o.describe());
    assert!(o.stderr.contains("nope"), "{}", o.describe());
    let o = run(&mut ferry_cmd(&["mount", &format!("{}::gpt", d.path().join("none").display()), s(&dir)]));
    assert_eq!(code(&o), 10, "{}", o.describe());
    let o = run(ferry_cmd(&["mount", &format!("{}::gpt", repo.display()), s(&dir)]).stdin(Stdio::null()));
    assert_eq!(code(&o), 12, "{}", o.describe());
    assert!(!is_mounted(&dir));
}

/// A disk whose chunks are damaged: the read fails with EIO and the log names the
/// damage; never other bytes.
#[test]
fn mount_reads_of_a_damaged_snapshot_fail_with_eio() {
    assert!(which("fusermount3").is_some() || which("fusermount").is_some(), "install fuse3 (fusermount3)");
    let d = tempfile::tempdir().unwrap();
    let disk = d.path().join("d.raw");
    fs::write(&disk, Rng::new(5).bytes(2 * MIB)).unwrap();
    let repo = d.path().join("repo");
    run_ok(&mut ferry_cmd(&["repo", "init", s(&repo)]));
    run_ok(&mut ferry_cmd(&["backup", s(&disk), &format!("{}::d", repo.display())]));
    // Mounted first (the snapshot's pages are read when it opens), then every pack file
    // flipped in its middle.
    let m = Mounted::start(&format!("{}::d", repo.display()), &d.path().join("m"), &[], &[]);
    let mut packs = 0;
    for e in walk(&repo.join("data")) {
        let mut b = fs::read(&e).unwrap();
        let mid = b.len() / 2;
        b[mid] ^= 0xff;
        fs::write(&e, b).unwrap();
        packs += 1;
    }
    assert!(packs > 0);
    let e = fs::read(m.dir.join("disk.raw")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(5), "EIO: {e}");
    // The damage named (the format string's "EIO" is in every read error's line).
    assert!(wait_until(Duration::from_secs(5), || m.log().contains("is damaged")), "{}", m.log());
    assert_eq!(m.stop("TERM"), 0);
}

/// A signal while DIR is in use leaves it mounted, with a warning; once the reader is gone
/// the next signal unmounts it (fuser's own unmounter gave up its mount on the first
/// failure: the second signal was then swallowed and DIR stayed mounted).
#[test]
fn mount_unmounts_on_a_signal_after_a_busy_one() {
    assert!(which("fusermount3").is_some() || which("fusermount").is_some(), "install fuse3 (fusermount3)");
    let d = tempfile::tempdir().unwrap();
    let disk = d.path().join("d.raw");
    fs::write(&disk, Rng::new(6).bytes(MIB)).unwrap();
    let repo = d.path().join("repo");
    run_ok(&mut ferry_cmd(&["repo", "init", s(&repo)]));
    run_ok(&mut ferry_cmd(&["backup", s(&disk), &format!("{}::d", repo.display())]));
    let mut m = Mounted::start(&format!("{}::d", repo.display()), &d.path().join("m"), &[], &[]);
    let mut reader = std::process::Command::new("sleep")
        .arg("60")
        .stdin(fs::File::open(m.dir.join("disk.raw")).unwrap())
        .spawn()
        .unwrap();
    run_ok(&mut cmd("kill", ["-INT".to_string(), m.child.id().to_string()]));
    assert!(wait_until(Duration::from_secs(10), || m.log().contains("cannot unmount")), "{}", m.log());
    assert!(is_mounted(&m.dir) && m.child.try_wait().unwrap().is_none(), "{}", m.log());
    reader.kill().unwrap();
    reader.wait().unwrap();
    assert_eq!(m.stop("INT"), 0);
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// `-s`: one disk with data where the other has a hole fails, as in qemu-img, even when
/// both read as zeroes; without `-s` they are identical.
#[test]
fn compare_strict_fails_on_allocation_as_qemu_img() {
    require("qemu-img");
    let d = tempfile::tempdir().unwrap();
    // A hole, then data to the end (qemu-img's block status also marks the extent that
    // reaches the end of the file: both disks end in data, so only the hole differs).
    let mut data = Rng::new(3).bytes(2 * MIB);
    data[..MIB].fill(0);
    let sparse = write_sparse_file(d.path(), "sparse.raw", &data);
    let dense = d.path().join("dense.raw");
    fs::write(&dense, &data).unwrap();
    let (q1, q2) = (d.path().join("q1.qcow2"), d.path().join("q2.qcow2"));
    run_ok(&mut cmd("qemu-img", ["create", "-q", "-f", "qcow2", s(&q1), "1M"]));
    run_ok(&mut cmd("qemu-img", ["create", "-q", "-f", "qcow2", s(&q2), "1M"]));
    run_ok(&mut cmd("qemu-io", ["-c", "write -P 0 0 64k", s(&q2)]));
    for (args, want) in [
        (vec!["-s", s(&sparse), s(&dense)], 1),
        (vec![s(&sparse), s(&dense)], 0),
        (vec!["-s", s(&dense), s(&dense)], 0),
        (vec!["-s", s(&sparse), s(&sparse)], 0),
        (vec!["-s", s(&q1), s(&q2)], 1),
        (vec![s(&q1), s(&q2)], 0),
    ] {
        let q = run(&mut cmd("qemu-img", [&["compare"], &args[..]].concat()));
        let f = run(&mut ferry_cmd(&[&["compare"], &args[..]].concat()));
        assert_eq!(code(&q), want, "qemu-img compare {args:?}: {}", q.describe());
        assert_eq!(code(&f), want, "ferry compare {args:?}: {}", f.describe());
        assert_eq!(f.stdout, q.stdout, "ferry compare {args:?}");
    }
}

#[test]
fn serve_fork_prints_the_port_it_picked() {
    let d = tempfile::tempdir().unwrap();
    let pid_p = d.path().join("s.pid");
    let o = std::process::Command::new(ferry_bin())
        .args(["serve", "--fork", "-P", s(&pid_p), "-p", "0", "-b", "127.0.0.1", "memory:1M"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let uri = String::from_utf8(o.stdout).unwrap();
    let pid: i32 = fs::read_to_string(&pid_p).unwrap().trim().parse().unwrap();
    let info = run(&mut ferry_cmd(&["info", "--size", uri.trim()]));
    run_ok(&mut cmd("kill", [pid.to_string()]));
    assert!(uri.starts_with("nbd://127.0.0.1:") && uri.ends_with('\n') && !uri.contains(":0\n"), "{uri:?}");
    assert_eq!(info.stdout.trim(), "1048576", "{}", info.describe());
}

#[test]
fn too_many_tags_is_a_usage_error() {
    let d = tempfile::tempdir().unwrap();
    let repo = d.path().join("repo");
    run_ok(&mut ferry_cmd(&["repo", "init", s(&repo)]));
    let img = d.path().join("a.raw");
    fs::write(&img, vec![1u8; 4096]).unwrap();
    let target = format!("{}::a", repo.display());
    let tags = |n: usize| -> Vec<String> { (0..n).flat_map(|i| ["--tag".to_string(), format!("t{i}")]).collect() };
    let with = |n: usize| {
        let mut args = vec!["backup".to_string(), s(&img).to_string(), target.clone()];
        args.extend(tags(n));
        run(&mut ferry_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>()))
    };
    let o = with(17);
    assert_eq!(code(&o), 2, "{}", o.describe());
    assert!(o.stderr.contains("16"), "{}", o.describe());
    let o = with(16);
    assert_eq!(code(&o), 0, "{}", o.describe());
}

/// `ferry repo key passwd` with no new passphrase given, on a terminal: typed twice; two
/// that differ change nothing.
#[test]
fn key_passwd_asks_twice_on_a_terminal() {
    require("script");
    let d = tempfile::tempdir().unwrap();
    let repo = d.path().join("repo");
    run_ok(ferry_cmd(&["repo", "init", "--encrypt", "--kdf-memory", "8M", s(&repo)]).env("FERRY_PASSWORD", "old"));
    let on_tty = |typed: &[&str]| {
        let line = format!("{} repo key passwd --kdf-memory 8M {}", ferry_bin().display(), repo.display());
        let mut c = cmd("script", ["-qec", &line, "/dev/null"]);
        c.env("FERRY_PASSWORD", "old").env_remove("FERRY_NEW_PASSWORD").env_remove("FERRY_NEW_PASSWORD_FILE");
        let mut child = c.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let reader = {
            let seen = seen.clone();
            std::thread::spawn(move || {
                use std::io::Read;
                let mut buf = [0u8; 512];
                while let Ok(n @ 1..) = stdout.read(&mut buf) {
                    seen.lock().unwrap().extend_from_slice(&buf[..n]);
                }
            })
        };
        let text = || String::from_utf8_lossy(&seen.lock().unwrap()).to_string();
        use std::io::Write;
        // Each line once its prompt is up (the terminal echoes what comes before).
        for (t, prompt) in typed.iter().zip(["new passphrase of", "passphrase again"]) {
            assert!(wait_until(Duration::from_secs(30), || text().contains(prompt)), "no {prompt:?}: {}", text());
            stdin.write_all(format!("{t}\n").as_bytes()).unwrap();
        }
        drop(stdin);
        let status = child.wait().unwrap();
        reader.join().unwrap();
        (status.code(), text())
    };
    let opens = |pw: &str| code(&run(ferry_cmd(&["repo", "list", s(&repo)]).env("FERRY_PASSWORD", pw))) == 0;
    let (rc, text) = on_tty(&["New-One", "New-Two"]);
    assert!(text.contains("new passphrase of") && text.contains("again"), "{text}");
    assert!(text.contains("differ"), "{text}");
    assert_ne!(rc, Some(0), "{text}");
    assert!(opens("old") && !opens("New-One"));
    let (rc, text) = on_tty(&["New-One", "New-One"]);
    assert_eq!(rc, Some(0), "{text}");
    assert!(!text.contains("New-One"), "the passphrase was echoed: {text}");
    assert!(opens("New-One") && !opens("old"));
}
