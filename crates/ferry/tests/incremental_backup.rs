//! Incremental backup end to end: a full backup and two incrementals, each restored with
//! `qemu-img convert` and compared byte for byte with the guest-visible content saved at
//! its backup point, every file passing `qemu-img check`.
//!
//! Two ways of getting at the changed blocks, as users do:
//!
//! * **A stopped VM's image** (KubeVirt's offline backups, virtnbdbackup's offline mode):
//!   a qcow2 image with a persistent bitmap (`qemu-img bitmap --add b0`), changed with
//!   `qemu-io` (scattered writes, write-zeroes over data, discards), exported with
//!   `qemu-nbd -r -B b0` or `ferry serve -r -B b0` (or read directly from the image);
//!   `qemu-img bitmap --clear b0` after each backup.
//! * **libvirt's pull mode**: `qemu-storage-daemon` driven over QMP as libvirt drives
//!   qemu: a file and a qcow2 node, `nbd-server-start` on a Unix socket, a writable
//!   export the "guest" writes through, and at each backup point a fleecing image and a
//!   `transaction` that adds the next persistent bitmap, disables the previous one and
//!   starts a `blockdev-backup sync=none` job (copy-before-write into the fleecing image),
//!   then a read-only export of the fleecing node with `bitmaps: [previous]` that the
//!   backup reads while the guest keeps writing.
//!
//! Each scenario runs with two tools: ferry (`ferry copy SRC full.qcow2`, `ferry copy
//! --dirty-bitmap NAME --backing PREV SRC incN.qcow2`), and the reference, qemu's tools and
//! bench/nbd_incremental.py (libnbd Python, the way virtnbdbackup copies: dirty map first,
//! then pread/pwrite of each dirty extent into a `qemu-img create -b PREV` overlay served by
//! qemu-nbd). The reference runs prove the harness itself; the ferry runs prove ferry.
//!
//! Besides restoring exactly, an incremental must be thin: every cluster allocated in its
//! top layer lies in a range the bitmap marked dirty, a dirty range that reads as zeroes
//! is stored as zeroes (never as data), and its backing file is the previous backup, by a
//! name relative to it.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Virtual size of every test image.
const SIZE: u64 = 64 * MIB;
/// Cluster size of the qcow2 backups (ferry's and qemu-img's default) and the bitmaps'
/// granularity (qemu's default for a 64 KiB-cluster image).
const CLUSTER: u64 = 64 * KIB;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Tool {
    Ferry,
    Reference,
}

// ---------------------------------------------------------------------------------
// Tools
// ---------------------------------------------------------------------------------

pub(crate) fn qemu_img(args: &[&str]) -> Output {
    require("qemu-img");
    run_ok(&mut cmd("qemu-img", args))
}

pub(crate) fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs qemu-io commands on `target` (`-f FMT` file or NBD URI); every command must work.
pub(crate) fn qemu_io(fmt: &str, target: &str, cmds: &[String]) {
    require("qemu-io");
    let mut c = cmd("qemu-io", ["-f", fmt]);
    for x in cmds {
        c.arg("-c").arg(x);
    }
    c.arg(target);
    let out = run_ok(&mut c);
    assert!(
        !out.stdout.contains("failed") && !out.stderr.contains("failed"),
        "qemu-io reported a failure\n{}",
        out.describe()
    );
}

fn ferry(args: &[&str]) -> Output {
    run_ok(Command::new(ferry_bin()).args(args))
}

fn unix_uri(sock: &Path, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", sock.display())
}

/// A daemon this test started (qemu-nbd, qemu-storage-daemon): SIGTERM on drop, SIGKILL
/// if it lingers; its stderr is shown when the test fails.
pub(crate) struct Daemon {
    child: Option<Child>,
    log: PathBuf,
    what: String,
}

impl Daemon {
    fn spawn(mut c: Command, log: PathBuf) -> Daemon {
        let what = format!("{c:?}");
        let f = fs::File::create(&log).unwrap();
        c.stdin(Stdio::null()).stdout(f.try_clone().unwrap()).stderr(f);
        let child = c.spawn().unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        Daemon { child: Some(child), log, what }
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `sock` accepts connections (the daemon is up).
    fn wait_socket(&mut self, sock: &Path) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("{} exited with {st} before listening\n{}", self.what, self.log());
            }
            if UnixStream::connect(sock).is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "{} did not listen on {}\n{}", self.what, sock.display(), self.log());
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM and wait for a clean exit (qemu-nbd stores the bitmaps and the image then).
    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                assert!(
                    st.success() || st.code().is_none() || st.code() == Some(0),
                    "{} exited with {st}\n{}",
                    self.what,
                    self.log()
                );
                return;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{} did not exit within 20 s of SIGTERM\n{}", self.what, self.log());
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the daemon to exit on its own (after QMP `quit`).
    fn wait_exit(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                assert!(st.success(), "{} exited with {st}\n{}", self.what, self.log());
                return;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{} did not exit within 20 s\n{}", self.what, self.log());
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        if thread::panicking() {
            eprintln!("--- {} ---\n{}", self.what, self.log());
        }
    }
}

/// An NBD server for an image: qemu-nbd or ferry serve, on a Unix socket.
pub(crate) struct Export {
    daemon: Daemon,
    sock: PathBuf,
}

impl Export {
    /// `qemu-nbd -t [-r] [-B BITMAP] -f FMT IMAGE` on `dir/NAME.sock`.
    pub(crate) fn qemu_nbd(
        dir: &Path,
        name: &str,
        image: &Path,
        fmt: &str,
        read_only: bool,
        bitmap: Option<&str>,
    ) -> Export {
        require("qemu-nbd");
        let sock = dir.join(format!("{name}.sock"));
        let mut c = Command::new("qemu-nbd");
        c.args(["-t", "-f", fmt, "-k"]).arg(&sock);
        if read_only {
            c.arg("-r");
        }
        if let Some(b) = bitmap {
            c.args(["-B", b]);
        }
        c.arg(image);
        let mut daemon = Daemon::spawn(c, dir.join(format!("{name}.log")));
        daemon.wait_socket(&sock);
        Export { daemon, sock }
    }

    /// `ferry serve -U SOCK [-r] [-B BITMAP] IMAGE`.
    fn ferry(dir: &Path, name: &str, image: &Path, read_only: bool, bitmap: Option<&str>) -> Export {
        let sock = dir.join(format!("{name}.sock"));
        let mut c = Command::new(ferry_bin());
        c.arg("serve").arg("-U").arg(&sock);
        if read_only {
            c.arg("-r");
        }
        if let Some(b) = bitmap {
            c.args(["-B", b]);
        }
        c.arg(image);
        let mut daemon = Daemon::spawn(c, dir.join(format!("{name}.log")));
        daemon.wait_socket(&sock);
        Export { daemon, sock }
    }

    pub(crate) fn uri(&self) -> String {
        unix_uri(&self.sock, "")
    }

    pub(crate) fn stop(mut self) {
        self.daemon.stop();
    }
}

// ---------------------------------------------------------------------------------
// QMP (qemu-storage-daemon)
// ---------------------------------------------------------------------------------

/// A QMP connection: one command at a time; events are kept for [`Qmp::wait_event`].
pub(crate) struct Qmp {
    w: UnixStream,
    r: BufReader<UnixStream>,
    events: Vec<Json>,
}

impl Qmp {
    fn connect(sock: &Path) -> Qmp {
        let w = UnixStream::connect(sock).unwrap();
        w.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let r = BufReader::new(w.try_clone().unwrap());
        let mut q = Qmp { w, r, events: Vec::new() };
        let greeting = q.read();
        assert!(greeting.get("QMP").is_some(), "not a QMP greeting: {greeting}");
        q.exec("qmp_capabilities", serde_json::json!({}));
        q
    }

    fn read(&mut self) -> Json {
        let mut line = String::new();
        let n = self.r.read_line(&mut line).expect("reading QMP");
        assert!(n > 0, "QMP connection closed");
        Json::must_parse(&line)
    }

    /// Runs `command` with `arguments`; returns its `return` value, failing on `error`.
    fn exec(&mut self, command: &str, arguments: Json) -> Json {
        let req = serde_json::json!({ "execute": command, "arguments": arguments });
        writeln!(self.w, "{req}").unwrap();
        loop {
            let v = self.read();
            if v.get("event").is_some() {
                self.events.push(v);
                continue;
            }
            if let Some(e) = v.get("error") {
                panic!("QMP {req} failed: {e}");
            }
            return v.at("return").clone();
        }
    }

    /// Waits for (and consumes) the event `name` whose `data.KEY` is `value`, also if it
    /// came while a command was running.
    fn wait_event(&mut self, name: &str, key: &str, value: &str) {
        let matches = |v: &Json| {
            v.get("event").and_then(Json::as_str) == Some(name)
                && v.get("data").and_then(|d| d.get(key)).and_then(Json::as_str) == Some(value)
        };
        if let Some(i) = self.events.iter().position(matches) {
            self.events.remove(i);
            return;
        }
        loop {
            let v = self.read();
            if matches(&v) {
                return;
            }
            self.events.push(v);
        }
    }
}

// ---------------------------------------------------------------------------------
// Workloads: what the "guest" writes between backups
// ---------------------------------------------------------------------------------

/// qemu-io commands of round `round`: scattered writes of odd sizes, write-zeroes over
/// data, discards, writes at the end of the disk; 40 scattered 4 KiB writes.
pub(crate) fn workload(round: u32) -> Vec<String> {
    let m = MIB;
    let mut v: Vec<String> = match round {
        0 => vec![
            format!("write -P 0x11 0 {}", 8 * m),
            format!("write -P 0x22 {} {}", 20 * m, 4 * m),
            format!("write -P 0x23 {} 65536", 40 * m),
            format!("write -P 0x24 {} {}", 44 * m, 2 * m),
        ],
        1 => vec![
            format!("write -P 0x33 {} 102400", m),
            format!("write -z {} {}", 20 * m, m),
            format!("discard {} {}", 2 * m, 2 * m),
            format!("write -P 0x44 {} 3000", 50 * m),
            format!("write -P 0x45 {} {}", 63 * m, m),
            "write -P 0x46 123392 1024".to_string(),
            format!("write -z {} {}", 44 * m, 512 * KIB),
        ],
        _ => vec![
            format!("write -P 0x55 {} 65536", m),
            format!("write -P 0x56 {} {}", 30 * m, 2 * m),
            "write -z 0 524288".to_string(),
            format!("discard {} 65536", 50 * m),
            format!("write -P 0x57 {} 65536", 21 * m),
            format!("write -z {} {}", 46 * m, m),
        ],
    };
    let mut rng = Rng::new(0x1ac0 + round as u64);
    for i in 0..40 {
        let off = rng.below(SIZE / 4096) * 4096;
        v.push(format!("write -P {} {off} 4096", 0x60 + i));
    }
    v
}

/// What the guest writes while backup `round` runs (pull mode): over ranges that round
/// changed and beside them, so a backup that reads the live disk instead of the
/// point-in-time view, or a next incremental that misses them, restores wrong bytes.
pub(crate) fn during_backup(round: u32) -> Vec<String> {
    let p = 0x90 + round;
    vec![
        format!("write -P {p:#x} {} 65536", MIB),
        format!("write -P {p:#x} {} 131072", 33 * MIB + 4096 * round as u64),
        format!("write -z {} 65536", 22 * MIB),
        format!("discard {} 65536", 45 * MIB),
        format!("write -P {p:#x} {} 65536", 63 * MIB),
    ]
}

// ---------------------------------------------------------------------------------
// Backups and their checks
// ---------------------------------------------------------------------------------

/// The guest-visible content of `src` (a file of format `fmt`, or an NBD URI: `fmt` raw)
/// saved as a raw file.
pub(crate) fn snapshot(src: &str, fmt: &str, out: &Path) -> Vec<u8> {
    qemu_img(&["convert", "-f", fmt, "-O", "raw", src, s(out)]);
    let data = fs::read(out).unwrap();
    assert_eq!(data.len() as u64, SIZE);
    data
}

/// The format of a backup file: raw when named `*.raw`, else qcow2.
fn format_of(p: &Path) -> &'static str {
    if p.extension().is_some_and(|e| e == "raw") {
        "raw"
    } else {
        "qcow2"
    }
}

/// A full backup of `src` (a local image or an NBD URI) into the new file `dst` (qcow2,
/// or raw when named `*.raw`).
fn full_backup(tool: Tool, src: &str, src_fmt: &str, dst: &Path) {
    match tool {
        Tool::Ferry => {
            ferry(&["copy", src, s(dst)]);
        }
        Tool::Reference => {
            qemu_img(&["convert", "-f", src_fmt, "-O", format_of(dst), src, s(dst)]);
        }
    }
}

/// Dirty ranges `[start, end)` of `qemu:dirty-bitmap:BITMAP` on the export `uri`, as
/// nbdinfo reports them.
fn dirty_map(uri: &str, bitmap: &str) -> Vec<(u64, u64)> {
    require("nbdinfo");
    let out = run_ok(&mut cmd("nbdinfo", ["--json", &format!("--map=qemu:dirty-bitmap:{bitmap}"), uri]));
    let v = Json::must_parse(&out.stdout);
    let arr = v.as_array().unwrap_or_else(|| panic!("nbdinfo --map --json is not an array: {v}"));
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for e in arr {
        let (off, len, ty) = (e.u64_at("offset"), e.u64_at("length"), e.u64_at("type"));
        if ty & 1 == 0 {
            continue;
        }
        match ranges.last_mut() {
            Some(last) if last.1 == off => last.1 = off + len,
            _ => ranges.push((off, off + len)),
        }
    }
    ranges
}

/// `ferry info --map=qemu:dirty-bitmap:BITMAP URI` prints what nbdinfo prints (the same
/// lines, field for field), so scripts switch by changing the program name.
fn assert_ferry_map_matches_nbdinfo(uri: &str, bitmap: &str) {
    let arg = format!("--map=qemu:dirty-bitmap:{bitmap}");
    let theirs = run_ok(&mut cmd("nbdinfo", [arg.as_str(), uri])).stdout;
    let ours = ferry(&["info", &arg, uri]).stdout;
    let fields = |t: &str| -> Vec<Vec<String>> {
        t.lines()
            .map(|l| l.split_whitespace().map(str::to_string).collect())
            .filter(|v: &Vec<String>| !v.is_empty())
            .collect()
    };
    assert_eq!(fields(&ours), fields(&theirs), "ferry info {arg}:\n{ours}\nnbdinfo {arg}:\n{theirs}");
    assert!(theirs.contains("dirty"), "no dirty extent in {uri}: {theirs}");
}

/// An incremental backup of the extents `bitmap` marks dirty in `src` (an NBD URI or,
/// for ferry, a local qcow2 image) into the new qcow2 `dst` backed by `backing` (same
/// directory).
fn incremental_backup(tool: Tool, bitmap: &str, src: &str, backing: &Path, dst: &Path) {
    let dir = dst.parent().unwrap();
    match tool {
        Tool::Ferry => {
            ferry(&["copy", "--dirty-bitmap", bitmap, "--backing", s(backing), src, s(dst)]);
        }
        Tool::Reference => {
            assert!(src.starts_with("nbd"), "the reference reads NBD exports only");
            let name = backing.file_name().unwrap().to_str().unwrap();
            qemu_img(&["create", "-q", "-f", "qcow2", "-b", name, "-F", format_of(backing), s(dst), &SIZE.to_string()]);
            let out = Export::qemu_nbd(dir, "overlay", dst, "qcow2", false, None);
            require("python3-libnbd");
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/nbd_incremental.py");
            run_ok(Command::new(SYSTEM_PYTHON).arg(&script).args(["--bitmap", bitmap, "--flush", src, &out.uri()]));
            out.stop();
        }
    }
}

/// `qemu-img check` finds nothing wrong with `img` (a raw file: `qemu-img info` says raw).
fn check_clean(img: &Path) {
    if format_of(img) == "raw" {
        let info = Json::must_parse(&qemu_img(&["info", "--output=json", s(img)]).stdout);
        assert_eq!(info.at("format").as_str(), Some("raw"), "{info}");
        return;
    }
    let out = run(&mut cmd("qemu-img", ["check", "--output=json", s(img)]));
    assert!(out.status.success(), "qemu-img check {}\n{}", img.display(), out.describe());
    let v = Json::must_parse(&out.stdout);
    assert_eq!(v.get("check-errors").and_then(Json::as_u64), Some(0), "{}", out.describe());
    for k in ["corruptions", "leaks"] {
        assert!(v.get(k).is_none_or(|c| c == 0), "{k} in {}\n{}", img.display(), out.describe());
    }
}

/// `img` restores (qemu-img convert to raw) to exactly `want`, and `qemu-img compare` agrees.
fn assert_restores(img: &Path, want_raw: &Path, want: &[u8]) {
    check_clean(img);
    let restored = img.with_extension("restored.raw");
    qemu_img(&["convert", "-O", "raw", s(img), s(&restored)]);
    let got = fs::read(&restored).unwrap();
    assert_same_bytes(&got, want, &format!("{} restored", img.display()));
    qemu_img(&["compare", "-f", format_of(img), "-F", "raw", s(img), s(want_raw)]);
    fs::remove_file(&restored).unwrap();
}

/// `inc` is a thin overlay on `backing`: backing file named relative to `inc`, every
/// cluster of its top layer inside a dirty range, and a dirty range that reads as zeroes
/// never stored as data.
fn assert_thin(inc: &Path, backing: &Path, dirty: &[(u64, u64)], content: &[u8]) {
    let info = Json::must_parse(&qemu_img(&["info", "--output=json", s(inc)]).stdout);
    let want_name = backing.file_name().unwrap().to_str().unwrap();
    assert_eq!(
        info.at("backing-filename").as_str(),
        Some(want_name),
        "{} should name its backing file relative to itself: {info}",
        inc.display()
    );
    if let Some(f) = info.get("backing-filename-format") {
        assert_eq!(f.as_str(), Some(format_of(backing)), "backing format of {}: {info}", inc.display());
    }
    assert_eq!(info.u64_at("virtual-size"), SIZE);
    let map = Json::must_parse(&qemu_img(&["map", "--output=json", s(inc)]).stdout);
    let mut top = 0u64;
    for e in map.as_array().unwrap() {
        if e.u64_at("depth") != 0 {
            continue;
        }
        let (start, len) = (e.u64_at("start"), e.u64_at("length"));
        let present = e.bool_at("data") || e.bool_at("zero");
        if !present {
            continue;
        }
        top += len;
        let end = start + len;
        let mut o = start;
        while o < end {
            let inside = dirty.iter().any(|&(a, b)| a <= o && o < b);
            assert!(inside, "{}: cluster at {o} is allocated in the top layer but was clean: {map}", inc.display());
            o += CLUSTER.min(end - o);
        }
        if e.bool_at("data") {
            // Stored as data: some cluster of it holds a non-zero byte.
            let mut c = start;
            while c < end {
                let ce = (c + CLUSTER).min(end);
                assert!(
                    content[c as usize..ce as usize].iter().any(|&b| b != 0),
                    "{}: the zero range {c}..{ce} is stored as data",
                    inc.display()
                );
                c = ce;
            }
        }
    }
    let dirty_bytes: u64 = dirty.iter().map(|(a, b)| b - a).sum();
    assert!(dirty_bytes > 0 && dirty_bytes < SIZE / 2, "implausible dirty map {dirty:?}");
    assert!(top > 0, "{} has nothing in its top layer: {map}", inc.display());
}

// ---------------------------------------------------------------------------------
// (a) A stopped VM's image
// ---------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Source {
    /// `qemu-nbd -r -B b0` of the image.
    QemuNbd,
    /// `ferry serve -r -B b0` of the image.
    FerryServe,
    /// The local image itself (ferry reads qcow2 bitmaps directly).
    LocalImage,
}

/// Who writes the image between backups (the "VM").
#[derive(Clone, Copy, Debug, PartialEq)]
enum Writer {
    /// qemu-io on the image file.
    QemuIo,
    /// qemu-io through `ferry serve IMAGE` (read-write), stopped with SIGTERM after each
    /// round: ferry records the writes in the image's bitmaps and stores them on close.
    FerryServe,
}

fn write_round(writer: Writer, dir: &Path, img: &Path, round: u32) {
    match writer {
        Writer::QemuIo => qemu_io("qcow2", s(img), &workload(round)),
        Writer::FerryServe => {
            let e = Export::ferry(dir, "vm", img, false, None);
            qemu_io("raw", &e.uri(), &workload(round));
            e.stop();
        }
    }
}

fn stopped_vm(tool: Tool, source: Source) {
    stopped_vm_with(tool, source, Writer::QemuIo, "full.qcow2")
}

fn stopped_vm_written_by(tool: Tool, source: Source, writer: Writer) {
    stopped_vm_with(tool, source, writer, "full.qcow2")
}

/// Full backup to `full_name` (qcow2, or raw if `*.raw`), then two incrementals.
fn stopped_vm_with(tool: Tool, source: Source, writer: Writer, full_name: &str) {
    require("qemu-img");
    let dir = tempfile::Builder::new().prefix("ferry-incr").tempdir().unwrap();
    let d = dir.path();
    let img = d.join("vm.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), &SIZE.to_string()]);
    qemu_io("qcow2", s(&img), &workload(0));
    qemu_img(&["bitmap", "--add", s(&img), "b0"]);

    // Full backup, straight from the image (nobody holds it).
    let snap0 = d.join("snap0.raw");
    let want0 = snapshot(s(&img), "qcow2", &snap0);
    let full = d.join(full_name);
    full_backup(tool, s(&img), "qcow2", &full);
    assert_restores(&full, &snap0, &want0);

    let mut prev = full.clone();
    let mut chain = vec![(full.clone(), snap0.clone(), want0)];
    for round in 1..=2u32 {
        write_round(writer, d, &img, round);
        let snap = d.join(format!("snap{round}.raw"));
        let want = snapshot(s(&img), "qcow2", &snap);
        let inc = d.join(format!("inc{round}.qcow2"));

        // The dirty map, as qemu reports it, for the thinness check.
        let q = Export::qemu_nbd(d, "map", &img, "qcow2", true, Some("b0"));
        let dirty = dirty_map(&q.uri(), "b0");
        q.stop();

        match source {
            Source::QemuNbd => {
                let e = Export::qemu_nbd(d, "src", &img, "qcow2", true, Some("b0"));
                incremental_backup(tool, "b0", &e.uri(), &prev, &inc);
                e.stop();
            }
            Source::FerryServe => {
                let e = Export::ferry(d, "src", &img, true, Some("b0"));
                incremental_backup(tool, "b0", &e.uri(), &prev, &inc);
                e.stop();
            }
            Source::LocalImage => incremental_backup(tool, "b0", s(&img), &prev, &inc),
        }
        assert_restores(&inc, &snap, &want);
        assert_thin(&inc, &prev, &dirty, &want);
        // The backup left b0 as it was (consistent, same map): a failed backup can be
        // taken again, and only a successful one clears the bitmap.
        let q = Export::qemu_nbd(d, "map", &img, "qcow2", true, Some("b0"));
        assert_eq!(dirty_map(&q.uri(), "b0"), dirty, "the backup changed b0");
        q.stop();
        qemu_img(&["bitmap", "--clear", s(&img), "b0"]);
        chain.push((inc.clone(), snap, want));
        prev = inc;
    }

    // Each backup of the chain still restores to its own point.
    for (img, snap, want) in &chain {
        assert_restores(img, snap, want);
    }
    // The backups never touched the image or its bitmap.
    check_clean(&img);
    let info = Json::must_parse(&qemu_img(&["info", "--output=json", s(&img)]).stdout);
    let bitmaps = info.at("format-specific").at("data").array_at("bitmaps");
    assert_eq!(bitmaps.len(), 1, "{info}");
    assert_eq!(bitmaps[0].at("name").as_str(), Some("b0"));
    assert_eq!(bitmaps[0].array_at("flags"), [Json::from("auto")], "{info}");
}

#[test]
fn stopped_vm_reference_qemu_nbd() {
    stopped_vm(Tool::Reference, Source::QemuNbd);
}

#[test]
fn stopped_vm_ferry_copy_from_qemu_nbd() {
    stopped_vm(Tool::Ferry, Source::QemuNbd);
}

#[test]
fn stopped_vm_ferry_copy_from_ferry_serve() {
    stopped_vm(Tool::Ferry, Source::FerryServe);
}

#[test]
fn stopped_vm_ferry_serve_read_by_nbd_incremental_py() {
    stopped_vm(Tool::Reference, Source::FerryServe);
}

#[test]
fn stopped_vm_ferry_copy_from_local_image() {
    stopped_vm(Tool::Ferry, Source::LocalImage);
}

/// The full backup is a raw file; the first incremental is a qcow2 overlay on it
/// (`backing_fmt=raw`).
#[test]
fn stopped_vm_raw_full_reference() {
    stopped_vm_with(Tool::Reference, Source::QemuNbd, Writer::QemuIo, "full.raw");
}

#[test]
fn stopped_vm_raw_full_ferry_copy() {
    stopped_vm_with(Tool::Ferry, Source::QemuNbd, Writer::QemuIo, "full.raw");
}

/// ferry is the "VM": the guest's writes go through `ferry serve`, which keeps b0; qemu
/// reads the bitmap ferry stored (qemu-nbd -B, refused if ferry left it inconsistent).
#[test]
fn stopped_vm_written_through_ferry_serve_qemu_backup() {
    stopped_vm_written_by(Tool::Reference, Source::QemuNbd, Writer::FerryServe);
}

/// All ferry: writes through `ferry serve`, backups read from `ferry serve -r -B b0`.
#[test]
fn stopped_vm_written_through_ferry_serve_ferry_backup() {
    stopped_vm_written_by(Tool::Ferry, Source::FerryServe, Writer::FerryServe);
}

// ---------------------------------------------------------------------------------
// (b) libvirt's pull mode against qemu-storage-daemon
// ---------------------------------------------------------------------------------

pub(crate) struct Qsd {
    daemon: Daemon,
    qmp: Qmp,
    nbd_sock: PathBuf,
}

impl Qsd {
    /// qemu-storage-daemon with QMP on `dir/qmp.sock`, `image` opened as node `disk0`
    /// (qcow2 on a file node, discards passed down), an NBD server on `dir/nbd.sock`, and
    /// the writable export `guest` the guest's writes go through.
    pub(crate) fn start(dir: &Path, image: &Path) -> Qsd {
        require("qemu-storage-daemon");
        let qmp_sock = dir.join("qmp.sock");
        let mut c = Command::new("qemu-storage-daemon");
        c.arg("--chardev")
            .arg(format!("socket,path={},server=on,wait=off,id=qmp0", qmp_sock.display()))
            .args(["--monitor", "chardev=qmp0"]);
        let mut daemon = Daemon::spawn(c, dir.join("qsd.log"));
        daemon.wait_socket(&qmp_sock);
        let mut qmp = Qmp::connect(&qmp_sock);
        qmp.exec(
            "blockdev-add",
            serde_json::json!({"driver": "file", "node-name": "file0", "filename": s(image), "discard": "unmap"}),
        );
        qmp.exec(
            "blockdev-add",
            serde_json::json!({"driver": "qcow2", "node-name": "disk0", "file": "file0", "discard": "unmap"}),
        );
        let nbd_sock = dir.join("nbd.sock");
        qmp.exec("nbd-server-start", serde_json::json!({"addr": {"type": "unix", "data": {"path": s(&nbd_sock)}}}));
        qmp.exec(
            "block-export-add",
            serde_json::json!({"type": "nbd", "id": "guest", "node-name": "disk0", "name": "guest", "writable": true}),
        );
        Qsd { daemon, qmp, nbd_sock }
    }

    pub(crate) fn uri(&self, export: &str) -> String {
        unix_uri(&self.nbd_sock, export)
    }

    /// The backup point, as libvirt's pull mode makes it: a fleecing image `NAME.qcow2`
    /// (backed by the disk) is added, then one transaction adds the persistent bitmap
    /// `new` (the next checkpoint), disables `old` and starts a `blockdev-backup` job with
    /// `sync: none` from the disk into the fleecing image (copy-before-write: the guest's
    /// later writes first copy the old data there). The read-only export `NAME` of the
    /// fleecing node shows the disk frozen at this point and offers `old`
    /// (`qemu:dirty-bitmap:OLD`, a bitmap of the disk node).
    pub(crate) fn begin_backup(&mut self, dir: &Path, name: &str, old: Option<&str>, new: &str) {
        let fleece = dir.join(format!("{name}.fleece.qcow2"));
        qemu_img(&["create", "-q", "-f", "qcow2", s(&fleece), &SIZE.to_string()]);
        self.qmp.exec(
            "blockdev-add",
            serde_json::json!({"driver": "qcow2", "node-name": name, "backing": "disk0",
                "file": {"driver": "file", "filename": s(&fleece)}}),
        );
        let mut actions = vec![serde_json::json!({
            "type": "block-dirty-bitmap-add",
            "data": {"node": "disk0", "name": new, "persistent": true}
        })];
        if let Some(old) = old {
            actions.push(serde_json::json!({
                "type": "block-dirty-bitmap-disable",
                "data": {"node": "disk0", "name": old}
            }));
        }
        actions.push(serde_json::json!({
            "type": "blockdev-backup",
            "data": {"job-id": name, "device": "disk0", "target": name, "sync": "none"}
        }));
        self.qmp.exec("transaction", serde_json::json!({ "actions": actions }));
        let bitmaps: Vec<Json> = old.iter().map(|b| serde_json::json!({"node": "disk0", "name": b})).collect();
        self.qmp.exec(
            "block-export-add",
            serde_json::json!({"type": "nbd", "id": name, "node-name": name, "name": name, "bitmaps": bitmaps}),
        );
    }

    /// Ends the backup: export removed, fleecing job cancelled, fleecing node deleted.
    pub(crate) fn end_backup(&mut self, name: &str) {
        self.qmp.exec("block-export-del", serde_json::json!({ "id": name }));
        self.qmp.wait_event("BLOCK_EXPORT_DELETED", "id", name);
        self.qmp.exec("block-job-cancel", serde_json::json!({ "device": name }));
        self.qmp.wait_event("BLOCK_JOB_CANCELLED", "device", name);
        self.qmp.exec("blockdev-del", serde_json::json!({ "node-name": name }));
    }

    /// QMP `quit`: a clean exit that stores the persistent bitmaps in the image.
    pub(crate) fn quit(mut self) {
        self.qmp.exec("quit", serde_json::json!({}));
        self.daemon.wait_exit();
    }
}

fn pull_mode(tool: Tool) {
    require("qemu-img");
    let dir = tempfile::Builder::new().prefix("ferry-pull").tempdir().unwrap();
    let d = dir.path();
    let img = d.join("disk.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), &SIZE.to_string()]);
    let mut qsd = Qsd::start(d, &img);
    let guest = qsd.uri("guest");
    qemu_io("raw", &guest, &workload(0));

    // Backup 0: full, and the first checkpoint b0.
    qsd.begin_backup(d, "backup0", None, "b0");
    let src = qsd.uri("backup0");
    let snap0 = d.join("snap0.raw");
    let want0 = snapshot(&src, "raw", &snap0);
    // The guest writes on while the backup runs; the backup must not see it.
    qemu_io("raw", &guest, &during_backup(0));
    let full = d.join("full.qcow2");
    full_backup(tool, &src, "raw", &full);
    qsd.end_backup("backup0");
    assert_restores(&full, &snap0, &want0);

    let mut prev = full.clone();
    let mut chain = vec![(full.clone(), snap0.clone(), want0)];
    for round in 1..=2u32 {
        qemu_io("raw", &guest, &workload(round));
        let (old, new) = (format!("b{}", round - 1), format!("b{round}"));
        let name = format!("backup{round}");
        qsd.begin_backup(d, &name, Some(&old), &new);
        let src = qsd.uri(&name);
        let snap = d.join(format!("snap{round}.raw"));
        let want = snapshot(&src, "raw", &snap);
        qemu_io("raw", &guest, &during_backup(round));
        let dirty = dirty_map(&src, &old);
        let inc = d.join(format!("inc{round}.qcow2"));
        incremental_backup(tool, &old, &src, &prev, &inc);
        assert_restores(&inc, &snap, &want);
        assert_thin(&inc, &prev, &dirty, &want);
        if tool == Tool::Ferry {
            // Checked last, so that a difference in output does not hide the backup's result.
            assert_ferry_map_matches_nbdinfo(&src, &old);
        }
        qsd.end_backup(&name);
        chain.push((inc.clone(), snap, want));
        prev = inc;
    }
    qsd.quit();

    for (img, snap, want) in &chain {
        assert_restores(img, snap, want);
    }
    // The checkpoints are in the image: b0 and b1 disabled, b2 recording.
    check_clean(&img);
    let info = Json::must_parse(&qemu_img(&["info", "--output=json", s(&img)]).stdout);
    let bitmaps = info.at("format-specific").at("data").array_at("bitmaps");
    let mut names: Vec<(&str, bool)> = bitmaps
        .iter()
        .map(|b| (b.at("name").as_str().unwrap(), b.array_at("flags").contains(&Json::from("auto"))))
        .collect();
    names.sort();
    assert_eq!(names, [("b0", false), ("b1", false), ("b2", true)], "{info}");
}

#[test]
fn pull_mode_reference_qemu_storage_daemon() {
    pull_mode(Tool::Reference);
}

#[test]
fn pull_mode_ferry_copy_from_qemu_storage_daemon() {
    pull_mode(Tool::Ferry);
}

// ---------------------------------------------------------------------------------
// The checks themselves
// ---------------------------------------------------------------------------------

/// The checks above catch a backup that misses a change and one that is not thin: an
/// incremental taken after the bitmap was cleared restores to the old content, and an
/// overlay holding a full copy allocates clean clusters.
#[test]
fn harness_catches_missed_and_fat_backups() {
    require("qemu-img");
    let dir = tempfile::Builder::new().prefix("ferry-incr").tempdir().unwrap();
    let d = dir.path();
    let img = d.join("vm.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), &SIZE.to_string()]);
    qemu_io("qcow2", s(&img), &workload(0));
    qemu_img(&["bitmap", "--add", s(&img), "b0"]);
    let full = d.join("full.qcow2");
    full_backup(Tool::Reference, s(&img), "qcow2", &full);
    qemu_io("qcow2", s(&img), &workload(1));
    let snap = d.join("snap1.raw");
    let want = snapshot(s(&img), "qcow2", &snap);

    // Missed: the bitmap was cleared before the backup, so nothing is copied.
    let e = Export::qemu_nbd(d, "src", &img, "qcow2", true, Some("b0"));
    let dirty = dirty_map(&e.uri(), "b0");
    e.stop();
    qemu_img(&["bitmap", "--clear", s(&img), "b0"]);
    let e = Export::qemu_nbd(d, "src", &img, "qcow2", true, Some("b0"));
    let missed = d.join("missed.qcow2");
    incremental_backup(Tool::Reference, "b0", &e.uri(), &full, &missed);
    e.stop();
    let r = std::panic::catch_unwind(|| assert_restores(&missed, &snap, &want));
    assert!(r.is_err(), "a backup that missed the changes passed the restore check");

    // Fat: every cluster of the image copied into the overlay.
    let fat = d.join("fat.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", "-b", "full.qcow2", "-F", "qcow2", s(&fat), &SIZE.to_string()]);
    qemu_img(&["convert", "-n", "-f", "qcow2", "-O", "qcow2", s(&img), s(&fat)]);
    assert_restores(&fat, &snap, &want);
    let r = std::panic::catch_unwind(|| assert_thin(&fat, &full, &dirty, &want));
    assert!(r.is_err(), "an overlay holding a full copy passed the thinness check");
}

/// The dirty map of one image: `ferry info --map=qemu:dirty-bitmap:b0` prints nbdinfo's
/// lines, and `ferry serve -r -B b0` serves what `qemu-nbd -r -B b0` serves (nbdinfo's
/// view of both, line for line).
#[test]
fn ferry_dirty_map_matches_qemu_nbd_and_nbdinfo() {
    require("qemu-img");
    let dir = tempfile::Builder::new().prefix("ferry-incr").tempdir().unwrap();
    let d = dir.path();
    let img = d.join("vm.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), &SIZE.to_string()]);
    qemu_io("qcow2", s(&img), &workload(0));
    qemu_img(&["bitmap", "--add", s(&img), "b0"]);
    qemu_io("qcow2", s(&img), &workload(1));
    let q = Export::qemu_nbd(d, "q", &img, "qcow2", true, Some("b0"));
    let from_qemu = run_ok(&mut cmd("nbdinfo", ["--map=qemu:dirty-bitmap:b0", &q.uri()])).stdout;
    assert_ferry_map_matches_nbdinfo(&q.uri(), "b0");
    q.stop();
    let f = Export::ferry(d, "f", &img, true, Some("b0"));
    let from_ferry = run_ok(&mut cmd("nbdinfo", ["--map=qemu:dirty-bitmap:b0", &f.uri()])).stdout;
    assert_eq!(from_ferry, from_qemu, "nbdinfo --map=qemu:dirty-bitmap:b0: ferry serve vs qemu-nbd");
    assert_ferry_map_matches_nbdinfo(&f.uri(), "b0");
    f.stop();
}
