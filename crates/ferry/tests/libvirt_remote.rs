//! `ferry backup libvirt:DOMAIN --export tcp`: the backup job exports the disks over NBD on
//! TCP with TLS, as for a domain on another host (issue 36), against the real libvirtd and
//! KVM guest of `libvirt.rs`. That daemon's qemu.conf sets `backup_tls_x509_cert_dir` to
//! certificates it makes (certtool) and `backup_tls_x509_verify`, so qemu presents a
//! server certificate for 127.0.0.1 and wants ferry's client certificate. A real
//! `qemu+ssh://` to another host is not possible here: the export is on 127.0.0.1 of a
//! local connection, which is the same job XML and the same TLS connection.
//!
//! Also a real guest kernel writing its own disk (Debian's cloud kernel and a busybox
//! initramfs the test builds), backed up while it runs.

use crate::common::{assert_same_bytes, pattern_bytes, run, run_fails, run_ok, MIB};
use crate::libvirt::{check_point, ferry_checkpoints, image, interrupt, json, reads, Libvirt, Model};
use std::path::Path;

/// The files under `repo/DIR` (snapshots, points), recursively.
fn stored(repo: &Path, dir: &str) -> usize {
    fn count(p: &Path) -> usize {
        std::fs::read_dir(p)
            .map(|r| r.map(|e| e.unwrap().path()).map(|p| if p.is_dir() { count(&p) } else { 1 }).sum())
            .unwrap_or(0)
    }
    count(&repo.join(dir))
}

/// A new temporary directory holding an empty repository (`repo`) and the two qcow2 disks
/// of `dom`, defined anew and running.
fn domain_and_repo(lv: &Libvirt, dom: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    lv.remove(dom);
    let (a, b) = (image(d, "a.qcow2"), image(d, "b.qcow2"));
    lv.domain(dom, &[("vda", &a), ("vdb", &b)], true, d);
    run_ok(&mut lv.ferry(&["repo", "init", d.join("repo").to_str().unwrap()]));
    dir
}

/// Wrong or missing credentials fail before anything is stored, with no job or checkpoint
/// left; the right ones back up both disks over TLS, full then incremental, and every point
/// restores byte for byte.
#[test]
fn a_running_domain_backed_up_over_tcp_with_tls() {
    let lv = Libvirt::get();
    let dom = "ferry-tls";
    let dir = domain_and_repo(&lv, dom);
    let d = dir.path();
    let repo_dir = d.join("repo");
    let repo = repo_dir.to_str().unwrap();
    let src = format!("libvirt:{dom}");
    let pki = lv.pki();
    let pki = pki.to_str().unwrap();
    let nothing_left = |what: &str| {
        assert!(ferry_checkpoints(&lv, dom).is_empty(), "{what}: a checkpoint is left: {:?}", lv.checkpoints(dom));
        assert!(!run(&mut lv.virsh(&["backup-dumpxml", dom])).status.success(), "{what}: the backup job is left");
        assert_eq!(stored(&repo_dir, "snapshots") + stored(&repo_dir, "points"), 0, "{what}: something was stored");
    };

    // Never in clear unless told: no certificates is a usage error before any job.
    let e = run_fails(&mut lv.ferry(&["backup", "--export", "tcp", &src, repo])).stderr;
    assert!(e.contains("--tls-certs") && e.contains("--insecure-export"), "{e}");
    nothing_left("no certificates");

    // A CA that did not sign the host's certificate: refused at the TLS handshake.
    let wrong = crate::interop_tls::make_pki("another CA");
    let wrong = wrong.path().to_str().unwrap();
    let out =
        run_fails(&mut lv.ferry(&["backup", "--retries", "0", "--export", "tcp", "--tls-certs", wrong, &src, repo]));
    assert!(out.stderr.contains("certificate verification failed"), "{}", out.describe());
    assert!(out.stderr.contains("disk vda"), "the error names the disk: {}", out.describe());
    nothing_left("a wrong CA");

    // The right credentials: both disks read whole, then only what changed.
    let mut models: [Model; 2] = Default::default();
    lv.write(dom, 0, 0x71, 0, MIB);
    lv.write(dom, 1, 0x72, 5 * MIB, 2 * MIB);
    models[0].0.push((0x71, 0, MIB));
    models[1].0.push((0x72, 5 * MIB, 2 * MIB));
    let tls = ["backup", "--json", "--export", "tcp", "--tls-certs", pki, &src, repo];
    let day = json(&run_ok(&mut lv.ferry(&tls)));
    assert_eq!(reads(&day).iter().map(|r| r.1.as_str()).collect::<Vec<_>>(), ["full", "full"], "{day}");
    let mut points = vec![(day["point"].as_str().unwrap().to_string(), models.clone())];
    lv.write(dom, 0, 0x73, 9 * MIB, MIB);
    lv.write(dom, 1, 0x74, 40 * MIB, MIB / 2);
    models[0].0.push((0x73, 9 * MIB, MIB));
    models[1].0.push((0x74, 40 * MIB, MIB / 2));
    let day = json(&run_ok(&mut lv.ferry(&tls)));
    assert_eq!(reads(&day), [(MIB, "dirty-bitmap".to_string()), (MIB / 2, "dirty-bitmap".to_string())], "{day}");
    points.push((day["point"].as_str().unwrap().to_string(), models.clone()));
    assert_eq!(ferry_checkpoints(&lv, dom).len(), 1, "{:?}", lv.checkpoints(dom));

    // ferry killed (-9) in the middle of a TLS backup: its job is left, told from any other
    // by its export names, and the next run ends it, removes its directory and reads all
    // that changed since the last good backup.
    lv.write(dom, 0, 0x76, 20 * MIB, 4 * MIB);
    models[0].0.push((0x76, 20 * MIB, 4 * MIB));
    let scratch = d.join("scratch");
    std::fs::create_dir(&scratch).unwrap();
    let scratch = scratch.to_str().unwrap();
    let slow = ["backup", "--rate", "1M", "--export", "tcp", "--tls-certs", pki, "--scratch-dir", scratch, &src, repo];
    let out = interrupt(&lv, dom, &slow, |c| c.kill().unwrap());
    assert!(!out.status.success());
    let job = lv.virsh_ok(&["backup-dumpxml", dom]);
    assert!(job.contains("tls='yes'") && job.contains("exportname='ferry-libvirt-"), "{job}");
    assert_eq!(std::fs::read_dir(scratch).unwrap().count(), 1, "the killed run's directory");

    // --insecure-export says so on stderr; an explicit port is the one qemu listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    lv.write(dom, 1, 0x75, 60 * MIB, 64 * 1024);
    models[1].0.push((0x75, 60 * MIB, 64 * 1024));
    let plain = ["backup", "--json", "--export", "tcp", "--insecure-export", "--export-port", &port, &src, repo];
    let out = run_ok(&mut lv.ferry(&plain));
    assert!(out.stderr.contains("warning: --insecure-export"), "{}", out.describe());
    assert!(out.stderr.contains("ending the backup job a stopped ferry left"), "{}", out.describe());
    assert_eq!(std::fs::read_dir(scratch).unwrap().count(), 0, "the killed run's directory is left");
    let day = json(&out);
    let want = [(4 * MIB, "dirty-bitmap".to_string()), (64 * 1024, "dirty-bitmap".to_string())];
    assert_eq!(reads(&day), want, "{day}");
    points.push((day["point"].as_str().unwrap().to_string(), models.clone()));
    assert!(!run(&mut lv.virsh(&["backup-dumpxml", dom])).status.success(), "no job is left");

    for (id, m) in &points {
        check_point(&lv, repo, dom, id, m, d);
    }
    lv.remove(dom);
}

/// Waits (up to 30 s) for libvirt to remove the scratch files in `dir`: it does once the
/// ended job's block jobs are gone, a moment after `virsh domjobabort` returns.
fn no_scratch_left(dir: &Path) {
    let start = std::time::Instant::now();
    loop {
        let left: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        if left.is_empty() {
            return;
        }
        assert!(start.elapsed() < std::time::Duration::from_secs(30), "scratch files are left: {left:?}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A domain of another host, as ferry sees it: the daemon through `--connect
/// qemu+tcp://127.0.0.1:PORT/system` (its TCP listener), so the export is TCP with TLS and
/// each disk's scratch file is in --scratch-dir *of that host*, named after the run
/// (libvirt refuses a pull-mode job without one). Full, incremental, ferry killed in the
/// middle (the next run ends the job: libvirt removes its scratch files, ferry its own
/// directory), and every point restores byte for byte.
#[test]
fn a_domain_of_another_host_backed_up_through_a_tcp_connection() {
    let lv = Libvirt::get();
    let dom = "ferry-other-host";
    let dir = domain_and_repo(&lv, dom);
    let d = dir.path();
    let repo_dir = d.join("repo");
    let repo = repo_dir.to_str().unwrap();
    let (src, uri, pki) = (format!("libvirt:{dom}"), lv.tcp_uri(), lv.pki());
    let pki = pki.to_str().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let scratch = d.join("scratch-of-that-host");
    std::fs::create_dir(&scratch).unwrap();
    let scratch = scratch.to_str().unwrap();
    let remote = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<&str> = vec!["backup", "--connect", &uri, "--tls-certs", pki, "--export-port", &port];
        v.extend_from_slice(&["--scratch-dir", scratch]);
        v.extend_from_slice(extra);
        v.extend([src.as_str(), repo]);
        v.into_iter().map(String::from).collect()
    };
    let ferry = |argv: &[String]| lv.ferry(&argv.iter().map(String::as_str).collect::<Vec<_>>());

    let mut models: [Model; 2] = Default::default();
    lv.write(dom, 0, 0x61, 0, MIB);
    lv.write(dom, 1, 0x62, 3 * MIB, 2 * MIB);
    models[0].0.push((0x61, 0, MIB));
    models[1].0.push((0x62, 3 * MIB, 2 * MIB));
    let day = json(&run_ok(&mut ferry(&remote(&["--json"]))));
    assert_eq!(reads(&day).iter().map(|r| r.1.as_str()).collect::<Vec<_>>(), ["full", "full"], "{day}");
    let mut points = vec![(day["point"].as_str().unwrap().to_string(), models.clone())];
    lv.write(dom, 0, 0x63, 9 * MIB, MIB);
    models[0].0.push((0x63, 9 * MIB, MIB));
    let day = json(&run_ok(&mut ferry(&remote(&["--json"]))));
    assert_eq!(reads(&day), [(MIB, "dirty-bitmap".to_string()), (0, "dirty-bitmap".to_string())], "{day}");
    points.push((day["point"].as_str().unwrap().to_string(), models.clone()));
    no_scratch_left(Path::new(scratch));

    // Killed (-9) while its job runs: the scratch files are those of --scratch-dir on the
    // domain's host, named after the run.
    lv.write(dom, 1, 0x64, 20 * MIB, 4 * MIB);
    models[1].0.push((0x64, 20 * MIB, 4 * MIB));
    let slow = remote(&["--rate", "1M"]);
    let out = interrupt(&lv, dom, &slow.iter().map(String::as_str).collect::<Vec<_>>(), |c| c.kill().unwrap());
    assert!(!out.status.success());
    let mut files: Vec<String> =
        std::fs::read_dir(scratch).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    assert_eq!(files.len(), 2, "{files:?}");
    let mark = files[0].strip_suffix(".vda.scratch").unwrap_or_else(|| panic!("{files:?}")).to_string();
    assert!(mark.starts_with("ferry-libvirt-") && files[1] == format!("{mark}.vdb.scratch"), "{files:?}");
    let job = lv.virsh_ok(&["backup-dumpxml", dom]);
    assert!(job.contains(&format!("{scratch}/{mark}.vda.scratch")), "{job}");
    let out = run_ok(&mut ferry(&remote(&["--json"])));
    assert!(out.stderr.contains("ending the backup job a stopped ferry left"), "{}", out.describe());
    no_scratch_left(Path::new(scratch));
    let day = json(&out);
    assert_eq!(reads(&day), [(0, "dirty-bitmap".to_string()), (4 * MIB, "dirty-bitmap".to_string())], "{day}");
    points.push((day["point"].as_str().unwrap().to_string(), models.clone()));
    assert!(!run(&mut lv.virsh(&["backup-dumpxml", dom])).status.success(), "no job is left");
    for (id, m) in &points {
        check_point(&lv, repo, dom, id, m, d);
    }
    lv.remove(dom);
}

/// Where scripts/test unpacks Debian's cloud kernel and busybox-static.
const GUEST: &str = "/var/cache/ferry-tests/guest";
/// The modules the guest loads, in order, to see its virtio disk (the cloud kernel builds
/// them as modules).
const MODULES: [&str; 6] =
    ["virtio_ring", "virtio", "virtio_pci_modern_dev", "virtio_pci_legacy_dev", "virtio_pci", "virtio_blk"];
/// Where the guest writes its pattern, and how much.
const AT: u64 = MIB;
const LEN: usize = MIB as usize;
/// Where it writes a second one once told to (while the backup job runs), and how much.
const AT2: u64 = 8 * MIB;
const LEN2: usize = 512 * 1024;

/// The file `name` under `dir`, searched recursively.
fn find(dir: &Path, name: &str) -> Option<std::path::PathBuf> {
    for e in std::fs::read_dir(dir).ok()? {
        let p = e.ok()?.path();
        if p.file_name().is_some_and(|n| n == name) {
            return Some(p);
        }
        if p.is_dir() && !p.is_symlink() {
            if let Some(f) = find(&p, name) {
                return Some(f);
            }
        }
    }
    None
}

/// An uncompressed initramfs (cpio "newc") of `entries`: (path, mode, contents).
fn cpio(entries: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    let trailer = [("TRAILER!!!", 0, Vec::new())];
    for (ino, (name, mode, data)) in entries.iter().chain(&trailer).enumerate() {
        let fields = [ino + 1, *mode as usize, 0, 0, 1, 0, data.len(), 0, 0, 0, 0, name.len() + 1, 0];
        out.extend_from_slice(b"070701");
        for f in fields {
            out.extend_from_slice(format!("{f:08X}").as_bytes());
        }
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.resize(out.len().next_multiple_of(4), 0);
        out.extend_from_slice(data);
        out.resize(out.len().next_multiple_of(4), 0);
    }
    out
}

/// A real guest kernel (Debian's, with a busybox initramfs) writes a pattern to its own
/// virtio disk through its block layer, says so on its serial console and keeps running;
/// ferry backs the running domain up and the restored disk holds exactly that pattern.
/// While the backup job runs, the test tells the guest (a byte on its second disk, vdb,
/// which it polls) to write a second pattern: the backup is of the job's start (without
/// it: qemu kept the old blocks in the scratch file), the next one reads just that.
/// The guest runs under TCG (about 10 s to its write here): on this machine's nested KVM a
/// kernel hangs as it starts, before it prints a line (a guest with no OS, as in
/// libvirt.rs, runs under KVM).
#[test]
fn a_guest_kernel_writes_its_disk_and_the_running_backup_has_it() {
    let guest = Path::new(GUEST);
    let kernel = std::fs::read_dir(guest.join("boot"))
        .ok()
        .and_then(|r| r.filter_map(|e| e.ok()).map(|e| e.path()).find(|p| p.to_string_lossy().contains("vmlinuz-")));
    let busybox = guest.join("bin/busybox");
    let (Some(kernel), true) = (kernel, busybox.exists()) else {
        panic!("no guest kernel or busybox under {GUEST}: scripts/test unpacks linux-image-cloud-amd64 and busybox-static there");
    };
    let lv = Libvirt::get();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let dom = "ferry-guest";
    lv.remove(dom);
    // Each 8-byte word holds its own offset on the disk: a block written at the wrong place
    // is told from the right one.
    let data = pattern_bytes(AT, LEN);
    let load: String = MODULES.iter().map(|m| format!("/bin/busybox insmod /lib/{m}.ko\n")).collect();
    let init = format!(
        "#!/bin/busybox sh\n/bin/busybox mount -t devtmpfs dev /dev\n{load}\
         /bin/busybox mount -t proc proc /proc\n\
         while [ ! -b /dev/vda ] || [ ! -b /dev/vdb ]; do /bin/busybox sleep 0.1; done\n\
         /bin/busybox dd if=/pattern of=/dev/vda bs=65536 seek={} conv=fsync 2>/dev/null && /bin/busybox sync && \
         echo ferry-guest: written > /dev/ttyS0\n\
         until [ \"$(/bin/busybox dd if=/dev/vdb bs=512 count=1 2>/dev/null | /bin/busybox head -c 1)\" = x ]; do \
         echo 3 > /proc/sys/vm/drop_caches; /bin/busybox sleep 0.2; done\n\
         /bin/busybox dd if=/pattern2 of=/dev/vda bs=65536 seek={} conv=fsync 2>/dev/null && /bin/busybox sync && \
         echo ferry-guest: written again > /dev/ttyS0\n\
         while :; do /bin/busybox sleep 3600; done\n",
        AT / 65536,
        AT2 / 65536
    );
    let data2 = pattern_bytes(AT2, LEN2);
    let mut files = vec![
        ("bin", 0o40755, Vec::new()),
        ("dev", 0o40755, Vec::new()),
        ("proc", 0o40755, Vec::new()),
        ("lib", 0o40755, Vec::new()),
        ("init", 0o100755, init.into_bytes()),
        ("bin/busybox", 0o100755, std::fs::read(&busybox).unwrap()),
        ("pattern", 0o100644, data.clone()),
        ("pattern2", 0o100644, data2.clone()),
    ];
    let names: Vec<String> = MODULES.iter().map(|m| format!("lib/{m}.ko")).collect();
    for (m, name) in MODULES.iter().zip(&names) {
        let ko = find(guest, &format!("{m}.ko")).unwrap_or_else(|| panic!("{m}.ko is not under {GUEST}"));
        files.push((name, 0o100644, std::fs::read(ko).unwrap()));
    }
    let initrd = d.join("initrd.cpio");
    std::fs::write(&initrd, cpio(&files)).unwrap();
    let disk = image(d, "vda.qcow2");
    let trigger = image(d, "vdb.qcow2");
    let console = d.join("console.log");
    let x = format!(
        "<domain type='qemu'><name>{dom}</name><memory unit='MiB'>256</memory><vcpu>1</vcpu><os><type arch='x86_64' \
         machine='pc'>hvm</type><kernel>{}</kernel><initrd>{}</initrd><cmdline>console=ttyS0 panic=-1</cmdline></os>\
         <features><acpi/></features><devices><disk type='file' device='disk'><driver name='qemu' type='qcow2'/>\
         <source file='{}'/><target dev='vda' bus='virtio'/></disk><disk type='file' device='disk'>\
         <driver name='qemu' type='qcow2'/><source file='{}'/><target dev='vdb' bus='virtio'/></disk>\
         <serial type='file'><source path='{}'/><target port='0'/></serial></devices></domain>",
        kernel.display(),
        initrd.display(),
        disk.display(),
        trigger.display(),
        console.display()
    );
    std::fs::write(d.join("guest.xml"), x).unwrap();
    lv.virsh_ok(&["define", d.join("guest.xml").to_str().unwrap()]);
    lv.virsh_ok(&["start", dom]);
    let said = |line: &str, secs: u64| {
        let start = std::time::Instant::now();
        while !std::fs::read_to_string(&console).unwrap_or_default().contains(line) {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(secs),
                "the guest did not say {line:?} within {secs} s; its console:\n{}",
                std::fs::read_to_string(&console).unwrap_or_default()
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        start.elapsed()
    };
    let took = said("ferry-guest: written", 180);
    eprintln!("the guest wrote its disk {:.1} s after it started", took.as_secs_f64());
    let repo_dir = d.join("repo");
    let repo = repo_dir.to_str().unwrap();
    run_ok(&mut lv.ferry(&["repo", "init", repo]));
    let src = format!("libvirt:{dom}");
    // Slowed down, so that the job still runs when the guest has written its second
    // pattern (a few seconds under TCG): the first read goes at once, so a second MiB of
    // data (written through qemu, where the guest does not look) comes 16 s later.
    lv.write(dom, 0, 0x5a, 40 * MIB, MIB);
    let slow = ["backup", "--json", "--rate", "64K", "--exclude", "vdb", &src, repo];
    let mut during = false;
    let out = interrupt(&lv, dom, &slow, |_| {
        lv.write(dom, 1, b'x', 0, 512);
        let took = said("ferry-guest: written again", 60);
        eprintln!("the guest wrote its second pattern {:.1} s after it was told", took.as_secs_f64());
        during = run(&mut lv.virsh(&["backup-dumpxml", dom])).status.success();
    });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(during, "the job ended before the guest's second write: {stderr}");
    let day: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reads(&day).iter().map(|r| r.1.as_str()).collect::<Vec<_>>(), ["full"], "{day}");
    assert_eq!(lv.virsh_ok(&["domstate", dom]).trim(), "running", "the guest ran on through the backup");
    let day2 = json(&run_ok(&mut lv.ferry(&["backup", "--json", "--exclude", "vdb", &src, repo])));
    assert_eq!(reads(&day2), [(LEN2 as u64, "dirty-bitmap".to_string())], "{day2}");
    let mut want = vec![0u8; crate::libvirt::DISK as usize];
    want[AT as usize..AT as usize + LEN].copy_from_slice(&data);
    want[40 * MIB as usize..41 * MIB as usize].fill(0x5a);
    for (point, what) in [(&day, "the first pattern only"), (&day2, "both patterns")] {
        if what == "both patterns" {
            want[AT2 as usize..AT2 as usize + LEN2].copy_from_slice(&data2);
        }
        let id = point["point"].as_str().unwrap();
        let to = d.join(format!("restored-{id}"));
        run_ok(&mut lv.ferry(&["restore", &format!("{repo}::{dom}@{}", &id[..12]), "--to", to.to_str().unwrap()]));
        let got = std::fs::read(to.join(format!("{dom}-vda.raw"))).unwrap();
        assert_same_bytes(&got, &want, &format!("the restored disk against {what}"));
        std::fs::remove_dir_all(&to).unwrap();
    }
    lv.remove(dom);
}
