//! `ferry backup libvirt:DOMAIN REPO` and `ferry restore REPO::DOMAIN` against a real
//! libvirtd and qemu (KVM where /dev/kvm exists, TCG otherwise): guests with no OS, two
//! small qcow2 disks, written through the running virtio disks with qemu-io (the HMP
//! `qemu-io` command), so each test knows exactly what each disk holds at each point.
//!
//! The daemon is started once for the tests of this file (the first that needs it starts
//! it, the last that ends stops it), in the foreground, in a private mount namespace whose
//! /etc/libvirt, /run/libvirt and /var/{lib,cache,log}/libvirt are directories of the
//! test, so it neither sees nor touches the host's libvirt. Its qemu.conf is the one a
//! container without cgroups or systemd needs (issue 36). scripts/test installs
//! libvirt-daemon, libvirt-daemon-driver-qemu, libvirt-clients and qemu-system-x86.

use crate::common::{cmd, ferry_bin, require, run, run_fails, run_ok, MIB};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub(crate) const DISK: u64 = 64 * MIB;

/// The daemon and how many tests use it.
struct Daemon {
    dir: tempfile::TempDir,
    /// The certificates of its backup jobs' TLS exports (qemu.conf backup_tls_x509_cert_dir).
    pki: tempfile::TempDir,
    child: Child,
    uri: String,
    /// The same daemon over TCP (`qemu+tcp://127.0.0.1:PORT/system`, no authentication,
    /// on 127.0.0.1 only): a connection ferry takes for one to another host.
    tcp_uri: String,
}

static DAEMON: Mutex<(usize, Option<Daemon>)> = Mutex::new((0, None));

/// A test's hold on the daemon: started by the first, stopped when the last lets go.
pub(crate) struct Libvirt {
    uri: String,
}

impl Libvirt {
    pub(crate) fn get() -> Libvirt {
        let mut d = DAEMON.lock().unwrap_or_else(|e| e.into_inner());
        if d.1.is_none() {
            d.1 = Some(start_daemon());
        }
        d.0 += 1;
        Libvirt { uri: d.1.as_ref().unwrap().uri.clone() }
    }

    pub(crate) fn virsh(&self, args: &[&str]) -> Command {
        let mut c = Command::new("virsh");
        c.arg("-c").arg(&self.uri).arg("-q").args(args);
        c
    }

    pub(crate) fn virsh_ok(&self, args: &[&str]) -> String {
        run_ok(&mut self.virsh(args)).stdout
    }

    pub(crate) fn ferry(&self, args: &[&str]) -> Command {
        let mut c = Command::new(ferry_bin());
        c.env("LIBVIRT_DEFAULT_URI", &self.uri).env("TMPDIR", self.tmp()).env_remove("FERRY_PASSWORD").args(args);
        c
    }

    /// The certificates of the daemon's TLS exports: the CA (ca-cert.pem), the server's,
    /// and a client's it accepts (client-cert.pem, client-key.pem).
    pub(crate) fn pki(&self) -> PathBuf {
        let d = DAEMON.lock().unwrap_or_else(|e| e.into_inner());
        d.1.as_ref().unwrap().pki.path().to_path_buf()
    }

    /// The daemon as a connection to another host (`--connect qemu+tcp://127.0.0.1:PORT/system`).
    pub(crate) fn tcp_uri(&self) -> String {
        let d = DAEMON.lock().unwrap_or_else(|e| e.into_inner());
        d.1.as_ref().unwrap().tcp_uri.clone()
    }

    /// The TMPDIR of ferry: where its backup jobs' private directories are.
    fn tmp(&self) -> PathBuf {
        let d = DAEMON.lock().unwrap_or_else(|e| e.into_inner());
        let t = d.1.as_ref().unwrap().dir.path().join("tmp");
        std::fs::create_dir_all(&t).unwrap();
        t
    }

    /// The checkpoints of `domain`, sorted.
    pub(crate) fn checkpoints(&self, domain: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .virsh_ok(&["checkpoint-list", domain, "--name"])
            .lines()
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty())
            .collect();
        v.sort();
        v
    }

    /// Writes `len` bytes of `byte` at `offset` of the running disk `index` (virtio-diskN).
    pub(crate) fn write(&self, domain: &str, index: usize, byte: u8, offset: u64, len: u64) {
        let io = format!(
            "qemu-io -d /machine/peripheral/virtio-disk{index}/virtio-backend \"write -P {byte:#x} {offset} {len}\""
        );
        let out = self.virsh_ok(&["qemu-monitor-command", domain, "--hmp", &io]);
        assert!(!out.contains("rror"), "{io}: {out}");
    }

    /// Defines and (with `start`) starts a domain of `disks` (target, qcow2 image).
    pub(crate) fn domain(&self, name: &str, disks: &[(&str, &Path)], start: bool, dir: &Path) {
        let kind = if Path::new("/dev/kvm").exists() { "kvm" } else { "qemu" };
        let mut x = format!(
            "<domain type='{kind}'><name>{name}</name><memory unit='MiB'>128</memory><vcpu>1</vcpu>\
             <os><type arch='x86_64' machine='pc'>hvm</type></os><features><acpi/></features><devices>"
        );
        for (t, p) in disks {
            x += &format!(
                "<disk type='file' device='disk'><driver name='qemu' type='qcow2'/><source file='{}'/>\
                 <target dev='{t}' bus='virtio'/></disk>",
                p.display()
            );
        }
        x += "</devices></domain>";
        let f = dir.join(format!("{name}.xml"));
        std::fs::write(&f, x).unwrap();
        self.virsh_ok(&["define", f.to_str().unwrap()]);
        if start {
            self.virsh_ok(&["start", name]);
        }
    }

    pub(crate) fn remove(&self, name: &str) {
        let _ = run(&mut self.virsh(&["destroy", name]));
        let _ = run(&mut self.virsh(&["undefine", name, "--checkpoints-metadata"]));
    }
}

impl Drop for Libvirt {
    fn drop(&mut self) {
        let mut d = DAEMON.lock().unwrap_or_else(|e| e.into_inner());
        d.0 -= 1;
        if d.0 == 0 {
            if let Some(mut daemon) = d.1.take() {
                // Guests first (qemu outlives its daemon), then the daemon.
                let list = Command::new("virsh").args(["-c", &daemon.uri, "-q", "list", "--name"]).output();
                for name in list.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default().lines() {
                    let _ = Command::new("virsh").args(["-c", &daemon.uri, "destroy", name.trim()]).output();
                }
                unsafe {
                    libc::kill(daemon.child.id() as libc::pid_t, libc::SIGTERM);
                }
                let _ = daemon.child.wait();
                let _ = &daemon.dir;
            }
        }
    }
}

fn start_daemon() -> Daemon {
    for tool in ["libvirtd", "virsh", "qemu-system-x86_64", "qemu-img", "unshare"] {
        assert!(
            crate::common::which(tool).is_some() || Path::new("/usr/sbin").join(tool).exists(),
            "`{tool}` is missing: scripts/test installs libvirt-daemon, libvirt-daemon-driver-qemu, libvirt-clients \
             and qemu-system-x86 (bookworm-backports)"
        );
    }
    let dir = tempfile::Builder::new().prefix("ferry-libvirtd-").tempdir().unwrap();
    let d = dir.path();
    for sub in ["etc", "run", "lib", "cache", "log", "sock"] {
        std::fs::create_dir(d.join(sub)).unwrap();
    }
    // TCP exports with TLS (--export tcp) present this certificate and want a client's.
    let pki = crate::interop_tls::make_pki("ferry libvirtd CA");
    std::fs::write(
        d.join("etc/qemu.conf"),
        format!(
            "user = \"root\"\ngroup = \"root\"\ncgroup_controllers = [ ]\nnamespaces = [ ]\nsecurity_driver = \"none\"\n\
             stdio_handler = \"file\"\nbackup_tls_x509_cert_dir = \"{}\"\nbackup_tls_x509_verify = 1\n",
            pki.path().display()
        ),
    )
    .unwrap();
    let sock = d.join("sock");
    // Also on TCP (127.0.0.1 only, no authentication): `qemu+tcp://` is, to ferry, a
    // connection to another host.
    let tcp_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    std::fs::write(
        d.join("libvirtd.conf"),
        format!(
            "unix_sock_dir = \"{}\"\nauth_unix_rw = \"none\"\nlog_outputs = \"2:stderr\"\nlisten_tls = 0\n\
             listen_tcp = 1\nauth_tcp = \"none\"\nlisten_addr = \"127.0.0.1\"\ntcp_port = \"{tcp_port}\"\n",
            sock.display()
        ),
    )
    .unwrap();
    let mounts: String = [
        ("etc", "/etc/libvirt"),
        ("run", "/run/libvirt"),
        ("lib", "/var/lib/libvirt"),
        ("cache", "/var/cache/libvirt"),
        ("log", "/var/log/libvirt"),
    ]
    .iter()
    .map(|(s, t)| format!("mkdir -p {t} && mount --bind {}/{s} {t} && ", d.display()))
    .collect();
    let script = format!("{mounts}exec libvirtd --listen -f {}/libvirtd.conf -p {}/pid", d.display(), d.display());
    let log = std::fs::File::create(d.join("libvirtd.log")).unwrap();
    let child = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start libvirtd");
    let uri = format!("qemu:///system?socket={}/libvirt-sock", sock.display());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ok = Command::new("virsh").args(["-c", &uri, "-q", "version"]).output().map(|o| o.status.success());
        if ok.unwrap_or(false) {
            break;
        }
        if Instant::now() > deadline {
            panic!(
                "libvirtd did not answer within 30 s:\n{}",
                std::fs::read_to_string(d.join("libvirtd.log")).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let tcp_uri = format!("qemu+tcp://127.0.0.1:{tcp_port}/system");
    Daemon { dir, pki, child, uri, tcp_uri }
}

/// A qcow2 image of `DISK` bytes.
pub(crate) fn image(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    run_ok(&mut cmd("qemu-img", ["create", "-q", "-f", "qcow2", p.to_str().unwrap(), &DISK.to_string()]));
    p
}

/// What a disk holds: writes applied to zeroes.
#[derive(Clone, Default)]
pub(crate) struct Model(pub(crate) Vec<(u8, u64, u64)>);

impl Model {
    pub(crate) fn bytes(&self) -> Vec<u8> {
        let mut v = vec![0u8; DISK as usize];
        for &(b, o, l) in &self.0 {
            v[o as usize..(o + l) as usize].fill(b);
        }
        v
    }
}

pub(crate) fn json(out: &crate::common::Output) -> serde_json::Value {
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e})\n{}", out.describe()))
}

/// Each disk's `read` bytes and changes kind in a `--json` report.
pub(crate) fn reads(doc: &serde_json::Value) -> Vec<(u64, String)> {
    doc["disks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["read"].as_u64().unwrap(), d["changes"]["kind"].as_str().unwrap().to_string()))
        .collect()
}

/// Restores point `id` and checks both disks against `models`.
pub(crate) fn check_point(lv: &Libvirt, repo: &str, domain: &str, id: &str, models: &[Model; 2], dir: &Path) {
    let to = dir.join(format!("restore-{id}"));
    run_ok(&mut lv.ferry(&["restore", &format!("{repo}::{domain}@{}", &id[..12]), "--to", to.to_str().unwrap()]));
    for (i, t) in ["vda", "vdb"].iter().enumerate() {
        let got = std::fs::read(to.join(format!("{domain}-{t}.raw"))).unwrap();
        assert!(got == models[i].bytes(), "point {id}: disk {t} differs from what it held at that point");
    }
    let xml = std::fs::read_to_string(to.join(format!("{domain}.xml"))).unwrap();
    assert!(xml.contains(&format!("{}/{domain}-vda.raw", to.display())), "{xml}");
    std::fs::remove_dir_all(&to).unwrap();
}

/// Checkpoints left: the one of a user's, and ferry's newest only.
fn only_newest(lv: &Libvirt, domain: &str) {
    let c = lv.checkpoints(domain);
    assert!(c.contains(&"users-own".to_string()), "a checkpoint ferry did not create was deleted: {c:?}");
    assert_eq!(ferry_checkpoints(lv, domain).len(), 1, "{c:?}");
}

/// ferry's checkpoints of `domain`.
pub(crate) fn ferry_checkpoints(lv: &Libvirt, domain: &str) -> Vec<String> {
    lv.checkpoints(domain).into_iter().filter(|c| c.starts_with("ferry-")).collect()
}

/// Starts `ferry backup` (slowed down) of `domain` and, once its backup job runs (however
/// loaded the machine is) and a moment more, does `then`; the backup's output.
pub(crate) fn interrupt(
    lv: &Libvirt,
    domain: &str,
    args: &[&str],
    then: impl FnOnce(&mut Child),
) -> std::process::Output {
    let mut c = lv.ferry(args);
    let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !run(&mut lv.virsh(&["backup-dumpxml", domain])).status.success() {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            panic!("ferry ended ({status}) before its backup job started: {}", String::from_utf8_lossy(&out.stderr));
        }
        assert!(Instant::now() < deadline, "the backup job of {domain} did not start within 60 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    then(&mut child);
    child.wait_with_output().unwrap()
}

/// Ten days of one domain with two disks (issue 36): full, incremental, ferry killed (-9)
/// in the middle of day 3's backup, the domain destroyed in the middle of day 4's, a lost
/// checkpoint (day 5), one disk left out (day 6), scattered writes (days 6 and 7), the
/// domain shut off and its images written directly (days 8 and 9: the second backup reads
/// only what changed), running again (day 10). After each day only ferry's newest
/// checkpoint is left (beside a user's own); every point restored equals both disks as
/// they were; a restored copy defined under a new name starts with both disks open.
#[test]
fn a_running_domain_day_by_day_with_a_kill_and_a_destroy() {
    let lv = Libvirt::get();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let dom = "ferry-days";
    lv.remove(dom);
    let (a, b) = (image(d, "a.qcow2"), image(d, "b.qcow2"));
    lv.domain(dom, &[("vda", &a), ("vdb", &b)], true, d);
    lv.virsh_ok(&["checkpoint-create-as", dom, "users-own"]);
    let repo = d.join("repo");
    let repo = repo.to_str().unwrap();
    run_ok(&mut lv.ferry(&["repo", "init", repo]));
    let backup = |extra: &[&str]| {
        let mut a = vec!["backup", "--json"];
        a.extend_from_slice(extra);
        let src = format!("libvirt:{dom}");
        a.push(&src);
        a.push(repo);
        json(&run_ok(&mut lv.ferry(&a)))
    };
    let mut models: [Model; 2] = Default::default();
    let mut points: Vec<(String, [Model; 2])> = Vec::new();

    // --quiesce with no guest agent: a clear error, no job started, no checkpoint made.
    let src = format!("libvirt:{dom}");
    let e = run_fails(&mut lv.ferry(&["backup", "--quiesce", &src, repo])).stderr;
    assert!(e.contains("guest agent of ferry-days"), "{e}");
    assert_eq!(lv.checkpoints(dom), ["users-own"]);
    assert!(!run(&mut lv.virsh(&["backup-dumpxml", dom])).status.success(), "no job is left");

    // Day 1: everything.
    lv.write(dom, 0, 0x11, 0, MIB);
    models[0].0.push((0x11, 0, MIB));
    let day = backup(&[]);
    assert_eq!(reads(&day).iter().map(|r| r.1.as_str()).collect::<Vec<_>>(), ["full", "full"]);
    points.push((day["point"].as_str().unwrap().into(), models.clone()));
    only_newest(&lv, dom);

    // Day 2: only what changed is read.
    lv.write(dom, 0, 0x22, 8 * MIB, MIB);
    lv.write(dom, 1, 0x23, 20 * MIB, MIB / 2);
    models[0].0.push((0x22, 8 * MIB, MIB));
    models[1].0.push((0x23, 20 * MIB, MIB / 2));
    let day = backup(&[]);
    assert_eq!(reads(&day), [(MIB, "dirty-bitmap".to_string()), (MIB / 2, "dirty-bitmap".to_string())], "{day}");
    points.push((day["point"].as_str().unwrap().into(), models.clone()));
    only_newest(&lv, dom);

    // Day 3: ferry is killed (-9) in the middle; the guest writes on; the next run ends
    // the job left behind and misses nothing.
    lv.write(dom, 0, 0x33, 30 * MIB, 4 * MIB);
    models[0].0.push((0x33, 30 * MIB, 4 * MIB));
    let scratch = lv.tmp();
    let scratch = scratch.to_str().unwrap();
    let out = interrupt(&lv, dom, &["backup", "--rate", "1M", "--scratch-dir", scratch, &src, repo], |c| {
        // The running job's directory is the owner's alone.
        use std::os::unix::fs::PermissionsExt;
        let dirs: Vec<_> = std::fs::read_dir(lv.tmp())
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| e.file_name().to_string_lossy().starts_with("ferry-libvirt-"))
            .collect();
        assert_eq!(dirs.len(), 1, "{dirs:?}");
        assert_eq!(dirs[0].metadata().unwrap().permissions().mode() & 0o777, 0o700);
        // A second run meanwhile is refused (it would end the first one's job).
        let e = run_fails(&mut lv.ferry(&["backup", &src, repo])).stderr;
        assert!(e.contains("another `ferry backup libvirt:ferry-days` runs on this host"), "{e}");
        c.kill().unwrap()
    });
    assert!(!out.status.success());
    assert!(run(&mut lv.virsh(&["backup-dumpxml", dom])).status.success(), "the killed run's job is still there");
    lv.write(dom, 0, 0x34, 40 * MIB, 64 * 1024);
    lv.write(dom, 1, 0x35, 0, 64 * 1024);
    models[0].0.push((0x34, 40 * MIB, 64 * 1024));
    models[1].0.push((0x35, 0, 64 * 1024));
    let day = backup(&[]);
    let r = reads(&day);
    assert_eq!(r[0], (4 * MIB + 64 * 1024, "dirty-bitmap".to_string()), "{day}");
    assert_eq!(r[1], (64 * 1024, "dirty-bitmap".to_string()), "{day}");
    assert!(!run(&mut lv.virsh(&["backup-dumpxml", dom])).status.success(), "no job is left");
    let left: Vec<_> = std::fs::read_dir(lv.tmp())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("ferry-libvirt-"))
        .collect();
    assert!(left.is_empty(), "the killed run's directory (socket, scratch files) is left: {left:?}");
    points.push((day["point"].as_str().unwrap().into(), models.clone()));
    only_newest(&lv, dom);

    // Day 4: the domain is destroyed in the middle of a backup, started again, written.
    lv.write(dom, 1, 0x44, 2 * MIB, 4 * MIB);
    models[1].0.push((0x44, 2 * MIB, 4 * MIB));
    let out = interrupt(&lv, dom, &["backup", "--rate", "1M", "--retries", "0", &src, repo], |_| {
        lv.virsh_ok(&["destroy", dom]);
    });
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    lv.virsh_ok(&["start", dom]);
    lv.write(dom, 1, 0x45, 50 * MIB, 64 * 1024);
    models[1].0.push((0x45, 50 * MIB, 64 * 1024));
    let day = backup(&[]);
    points.push((day["point"].as_str().unwrap().into(), models.clone()));
    only_newest(&lv, dom);

    // Libvirt loses ferry's checkpoint (its metadata, as when the domain is redefined):
    // the next backup reads both disks whole, with a notice, and misses nothing.
    let ck = lv.checkpoints(dom).into_iter().find(|c| c.starts_with("ferry-")).unwrap();
    lv.virsh_ok(&["checkpoint-delete", dom, &ck, "--metadata"]);
    lv.write(dom, 0, 0x4a, 10 * MIB, 64 * 1024);
    models[0].0.push((0x4a, 10 * MIB, 64 * 1024));
    let out = run_ok(&mut lv.ferry(&["backup", "--json", &src, repo]));
    assert!(out.stderr.contains(&format!("no longer has checkpoint {ck} tracking it")), "{}", out.describe());
    let day = json(&out);
    assert_eq!(reads(&day).iter().map(|r| r.1.as_str()).collect::<Vec<_>>(), ["full", "full"], "{day}");
    points.push((day["point"].as_str().unwrap().into(), models.clone()));
    only_newest(&lv, dom);

    // Day 5: one disk left out (--exclude): its checkpoint stays for its next backup,
    // which reads only what changed since its last one.
    lv.write(dom, 0, 0x55, 60 * MIB, MIB);
    lv.write(dom, 1, 0x56, 61 * MIB, MIB);
    models[0].0.push((0x55, 60 * MIB, MIB));
    models[1].0.push((0x56, 61 * MIB, MIB));
    let day = backup(&["--exclude", "vdb"]);
    assert_eq!(reads(&day), [(MIB, "dirty-bitmap".to_string())], "{day}");
    let day = backup(&["--disk", "vdb"]);
    assert_eq!(reads(&day), [(MIB, "dirty-bitmap".to_string())], "{day}");
    // Two of ferry's checkpoints: vda's (of the --exclude run) and the newest (vdb's).
    assert_eq!(ferry_checkpoints(&lv, dom).len(), 2, "{:?}", lv.checkpoints(dom));

    // Days 6 and 7: both disks again, scattered writes; only the newest checkpoint is left.
    for (k, byte) in [(6u64, 0x66u8), (7, 0x77)] {
        let mut read = [0, 0];
        for i in 0..2 {
            for j in 0..3 {
                let (o, l) = ((k + 7 * j) * MIB + 128 * 1024 * i as u64, 64 * 1024 * (j + 1));
                lv.write(dom, i, byte + i as u8, o, l);
                models[i].0.push((byte + i as u8, o, l));
                read[i] += l;
            }
        }
        let day = backup(&[]);
        let kind = "dirty-bitmap".to_string();
        assert_eq!(reads(&day), [(read[0], kind.clone()), (read[1], kind)], "day {k}: {day}");
        points.push((day["point"].as_str().unwrap().into(), models.clone()));
        only_newest(&lv, dom);
    }

    // Days 8 and 9: the domain is shut off and its images written directly (qemu-io): it
    // is backed up from its images, the second time reading only what changed; libvirt's
    // checkpoints are left as they were.
    let kept = lv.checkpoints(dom);
    lv.virsh_ok(&["destroy", dom]);
    let offline = |models: &mut [Model; 2], byte: u8, offset: u64| {
        for (i, img) in [&a, &b].iter().enumerate() {
            let w = format!("write -P {} {offset} 65536", byte + i as u8);
            run_ok(&mut cmd("qemu-io", ["-f", "qcow2", "-c", &w, img.to_str().unwrap()]));
            models[i].0.push((byte + i as u8, offset, 64 * 1024));
        }
    };
    offline(&mut models, 0x88, 12 * MIB);
    let day = backup(&[]);
    points.push((day["point"].as_str().unwrap().into(), models.clone()));
    assert_eq!(lv.checkpoints(dom), kept);
    offline(&mut models, 0x99, 44 * MIB);
    let day = backup(&[]);
    assert_eq!(reads(&day).iter().map(|r| r.0).collect::<Vec<_>>(), [64 * 1024, 64 * 1024], "{day}");
    points.push((day["point"].as_str().unwrap().into(), models.clone()));
    assert_eq!(lv.checkpoints(dom), kept);

    // Day 10: running again. The latest snapshots are of the shut-off images, which no
    // checkpoint continues: both disks are read whole, and the older checkpoint goes.
    lv.virsh_ok(&["start", dom]);
    lv.write(dom, 0, 0xaa, 63 * MIB, MIB);
    models[0].0.push((0xaa, 63 * MIB, MIB));
    let day = backup(&[]);
    assert_eq!(reads(&day).iter().map(|r| r.1.as_str()).collect::<Vec<_>>(), ["full", "full"], "{day}");
    points.push((day["point"].as_str().unwrap().into(), models.clone()));
    only_newest(&lv, dom);
    assert!(!kept.iter().any(|c| lv.checkpoints(dom).contains(c) && c.starts_with("ferry-")), "{kept:?}");

    // Every point restored equals both disks as they were then.
    for (id, m) in &points {
        check_point(&lv, repo, dom, id, m, d);
    }
    // A restored copy defined under a new name starts (qemu opens its disks). (The
    // latest point holds vdb alone: a point holds the disks its run backed up.)
    let to = d.join("copy");
    let day4 = format!("{repo}::{dom}@{}", &points[3].0[..8]);
    run_ok(&mut lv.ferry(&[
        "restore",
        &day4,
        "--to",
        to.to_str().unwrap(),
        "--format",
        "qcow2",
        "--define",
        "ferry-days-copy",
    ]));
    lv.virsh_ok(&["start", "ferry-days-copy"]);
    let xml = lv.virsh_ok(&["dumpxml", "ferry-days-copy"]);
    assert!(xml.contains(&format!("{}/{dom}-vda.qcow2", to.display())), "{xml}");
    // qemu has both restored images open.
    let blocks = lv.virsh_ok(&["qemu-monitor-command", "ferry-days-copy", "--hmp", "info block"]);
    for t in ["vda", "vdb"] {
        assert!(blocks.contains(&format!("{}/{dom}-{t}.qcow2", to.display())), "{blocks}");
    }
    let uuid = |n: &str| lv.virsh_ok(&["domuuid", n]);
    assert_ne!(uuid(dom), uuid("ferry-days-copy"));
    lv.remove("ferry-days-copy");
    lv.remove(dom);
}

#[test]
fn bad_domains_and_disks_are_clear_errors() {
    require("qemu-io");
    let lv = Libvirt::get();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo = d.join("repo");
    let repo = repo.to_str().unwrap();
    run_ok(&mut lv.ferry(&["repo", "init", repo]));
    let err = |args: &[&str]| run_fails(&mut lv.ferry(args)).stderr;
    let e = err(&["backup", "libvirt:ferry-no-such-domain", repo]);
    assert!(e.contains("no domain \"ferry-no-such-domain\""), "{e}");
    // A shut-off domain with a network disk: named, with what to do.
    let a = image(d, "a.qcow2");
    let dom = "ferry-bad-disk";
    lv.remove(dom);
    lv.domain(dom, &[("vda", &a)], false, d);
    let x = lv.virsh_ok(&["dumpxml", dom]).replace(
        "</devices>",
        "<disk type='network' device='disk'><driver name='qemu' type='raw'/><source protocol='nbd' name='x'>\
         <host name='127.0.0.1' port='1'/></source><target dev='vdb' bus='virtio'/></disk></devices>",
    );
    std::fs::write(d.join("bad.xml"), x).unwrap();
    lv.virsh_ok(&["define", d.join("bad.xml").to_str().unwrap()]);
    let e = err(&["backup", &format!("libvirt:{dom}"), repo]);
    assert!(e.contains("disk vdb is a network disk") && e.contains("--exclude vdb"), "{e}");
    let e = err(&["backup", "--disk", "vdz", &format!("libvirt:{dom}"), repo]);
    assert!(e.contains("no disk \"vdz\""), "{e}");
    let e = err(&["backup", "--since", "abcd", &format!("libvirt:{dom}"), repo]);
    assert!(e.contains("--since is not for a libvirt:DOMAIN source"), "{e}");
    let e = err(&["backup", "--disk", "vda", "/dev/null", &format!("{repo}::x")]);
    assert!(e.contains("are for a libvirt:DOMAIN source"), "{e}");

    // Shut off, its qcow2 image is read as `ferry backup IMAGE` reads it: the second
    // backup reads only what changed.
    let out = run_ok(&mut lv.ferry(&["backup", "--json", "--exclude", "vdb", &format!("libvirt:{dom}"), repo]));
    assert_eq!(reads(&json(&out))[0].1, "full");
    run_ok(&mut cmd("qemu-io", ["-f", "qcow2", "-c", "write -P 0x61 1M 64k", a.to_str().unwrap()]));
    let out = run_ok(&mut lv.ferry(&["backup", "--json", "--exclude", "vdb", &format!("libvirt:{dom}"), repo]));
    assert_eq!(reads(&json(&out))[0].0, 64 * 1024, "{}", out.describe());
    // The domain's XML is stored sealed in an encrypted repository, and `repo list` shows
    // the point with its disk.
    let enc = d.join("enc");
    let enc = enc.to_str().unwrap();
    let pw = d.join("pw");
    std::fs::write(&pw, "secret words\n").unwrap();
    let pwf = pw.to_str().unwrap();
    run_ok(&mut lv.ferry(&["repo", "init", "--encrypt", "--kdf-memory", "8M", "--password-file", pwf, enc]));
    let out =
        run_ok(&mut lv.ferry(&["backup", "--password-file", pwf, "--exclude", "vdb", &format!("libvirt:{dom}"), enc]));
    let point = out.stdout.lines().last().unwrap().split(' ').nth(1).unwrap().to_string();
    // points/TAG/ID: the tag does not name the domain either.
    let tags: Vec<_> = std::fs::read_dir(d.join("enc/points")).unwrap().map(|t| t.unwrap().path()).collect();
    assert_eq!(tags.len(), 1, "{tags:?}");
    assert!(!tags[0].to_string_lossy().contains(dom), "{tags:?}");
    for f in std::fs::read_dir(&tags[0]).unwrap() {
        let bytes = std::fs::read(f.unwrap().path()).unwrap();
        assert!(!String::from_utf8_lossy(&bytes).contains("domain"), "the point is not sealed");
    }
    let list = run_ok(lv.ferry(&["repo", "list", enc]).env("FERRY_PASSWORD_FILE", pwf)).stdout;
    assert!(list.contains(&point) && list.contains(&format!("{dom}-vda@")), "{list}");
    let to = d.join("enc-restore");
    let to = to.to_str().unwrap();
    run_ok(&mut lv.ferry(&["restore", "--password-file", pwf, &format!("{enc}::{dom}"), "--to", to]));
    run_ok(&mut cmd("qemu-img", ["convert", "-O", "raw", a.to_str().unwrap(), &format!("{to}/a.raw")]));
    let got = std::fs::read(format!("{to}/{dom}-vda.raw")).unwrap();
    assert!(got == std::fs::read(format!("{to}/a.raw")).unwrap(), "the restored disk differs from the image");
    lv.remove(dom);
}

/// A `virsh` on PATH that logs each command line it is given to `log`, then runs the real
/// one: the directory to put first on ferry's PATH.
fn logging_virsh(dir: &Path, log: &Path) -> PathBuf {
    let real = run_ok(&mut cmd("sh", ["-c", "command -v virsh"])).stdout;
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let script = format!("#!/bin/sh\nprintf '%s\\n' \"$*\" >> '{}'\nexec '{}' \"$@\"\n", log.display(), real.trim());
    let f = bin.join("virsh");
    std::fs::write(&f, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

/// A SIGINT while the passphrase is asked for (a slow password command) ends the run
/// before its backup job starts: no job, no checkpoint, no `backup-begin` at all. A day's
/// incremental backup of two disks starts few virsh processes (one asks everything the
/// run needs first). `ferry restore` asks for the passphrase once for all the disks.
#[test]
fn a_signal_before_the_job_leaves_nothing_and_runs_and_restores_ask_little() {
    let lv = Libvirt::get();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let dom = "ferry-signal";
    lv.remove(dom);
    let (a, b) = (image(d, "a.qcow2"), image(d, "b.qcow2"));
    lv.domain(dom, &[("vda", &a), ("vdb", &b)], true, d);
    let repo = d.join("repo");
    let repo = repo.to_str().unwrap();
    let pw = d.join("pw");
    std::fs::write(&pw, "secret words\n").unwrap();
    let pwf = pw.to_str().unwrap();
    run_ok(&mut lv.ferry(&["repo", "init", "--encrypt", "--kdf-memory", "8M", "--password-file", pwf, repo]));
    let log = d.join("virsh.log");
    let path = format!("{}:{}", logging_virsh(d, &log).display(), std::env::var("PATH").unwrap_or_default());
    let src = format!("libvirt:{dom}");

    // The signal comes while the password command runs.
    let asking = d.join("asking");
    let slow = format!("touch '{}'; sleep 2; echo 'secret words'", asking.display());
    let mut c = lv.ferry(&["backup", "--password-command", &slow, &src, repo]);
    let child = c.env("PATH", &path).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !asking.exists() {
        assert!(Instant::now() < deadline, "the password command did not run within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("stopped before the backup job of ferry-signal started"), "{err}");
    let calls = std::fs::read_to_string(&log).unwrap();
    assert!(!calls.contains("backup-begin") && !calls.contains("checkpoint-delete"), "{calls}");
    assert!(ferry_checkpoints(&lv, dom).is_empty());
    assert!(!run(&mut lv.virsh(&["backup-dumpxml", dom])).status.success(), "a backup job runs");

    // Day 1 (full), then day 2 (incremental): the virsh processes of day 2.
    let backup = |src: &str| run_ok(lv.ferry(&["backup", "--password-file", pwf, src, repo]).env("PATH", &path));
    backup(&src);
    lv.write(dom, 0, 0x55, 4 * MIB, MIB);
    std::fs::remove_file(&log).unwrap();
    let out = backup(&src);
    assert!(out.stdout.contains("changes since checkpoint"), "{}", out.describe());
    let calls = std::fs::read_to_string(&log).unwrap();
    // Asking first (1), the checkpoint it continues (1), the job's start (1) and abort (1),
    // the older checkpoint deleted (1): 5, besides `backup-dumpxml` alone (whose job it is,
    // then polled every 100 ms until libvirt no longer lists the ended job, so that the
    // next run does not take it for another ferry's: as many as libvirt's timing takes);
    // one process per command took 11.
    let polls = calls.lines().filter(|l| l.trim_end().ends_with("-q backup-dumpxml --domain ferry-signal")).count();
    assert!(polls >= 1 && calls.lines().count() - polls <= 5, "{calls}");
    assert_eq!(ferry_checkpoints(&lv, dom).len(), 1);

    // A restore of both disks runs the password command once.
    let count = d.join("count");
    let counting = format!("echo >> '{}'; echo 'secret words'", count.display());
    let to = d.join("restored");
    let mut c = lv.ferry(&["restore", &format!("{repo}::{dom}"), "--to", to.to_str().unwrap()]);
    run_ok(c.env("FERRY_PASSWORD_COMMAND", &counting));
    assert_eq!(std::fs::read_to_string(&count).unwrap().lines().count(), 1, "one opening of the repository");
    let got = std::fs::read(to.join(format!("{dom}-vda.raw"))).unwrap();
    let mut want = vec![0u8; DISK as usize];
    want[(4 * MIB) as usize..(5 * MIB) as usize].fill(0x55);
    assert!(got == want, "the restored disk differs");
    lv.remove(dom);
}
