//! `ferry backup libvirt:DOMAIN --export tcp`: the backup job exports the disks over NBD on
//! TCP with TLS, as for a domain on another host (issue 36), against the real libvirtd and
//! KVM guest of `libvirt.rs`. That daemon's qemu.conf sets `backup_tls_x509_cert_dir` to
//! certificates it makes (certtool) and `backup_tls_x509_verify`, so qemu presents a
//! server certificate for 127.0.0.1 and wants ferry's client certificate. A real
//! `qemu+ssh://` to another host is not possible here: the export is on 127.0.0.1 of a
//! local connection, which is the same job XML and the same TLS connection.

use crate::common::{run, run_fails, run_ok, MIB};
use crate::libvirt::{check_point, ferry_checkpoints, image, json, reads, Libvirt, Model};
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

/// Wrong or missing credentials fail before anything is stored, with no job or checkpoint
/// left; the right ones back up both disks over TLS, full then incremental, and every point
/// restores byte for byte.
#[test]
fn a_running_domain_backed_up_over_tcp_with_tls() {
    let lv = Libvirt::get();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let dom = "ferry-tls";
    lv.remove(dom);
    let (a, b) = (image(d, "a.qcow2"), image(d, "b.qcow2"));
    lv.domain(dom, &[("vda", &a), ("vdb", &b)], true, d);
    let repo_dir = d.join("repo");
    let repo = repo_dir.to_str().unwrap();
    run_ok(&mut lv.ferry(&["repo", "init", repo]));
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

    // --insecure-export says so on stderr; an explicit port is the one qemu listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    lv.write(dom, 1, 0x75, 60 * MIB, 64 * 1024);
    models[1].0.push((0x75, 60 * MIB, 64 * 1024));
    let plain = ["backup", "--json", "--export", "tcp", "--insecure-export", "--export-port", &port, &src, repo];
    let out = run_ok(&mut lv.ferry(&plain));
    assert!(out.stderr.contains("warning: --insecure-export"), "{}", out.describe());
    let day = json(&out);
    assert_eq!(reads(&day), [(0, "dirty-bitmap".to_string()), (64 * 1024, "dirty-bitmap".to_string())], "{day}");
    points.push((day["point"].as_str().unwrap().to_string(), models.clone()));
    assert!(!run(&mut lv.virsh(&["backup-dumpxml", dom])).status.success(), "no job is left");

    for (id, m) in &points {
        check_point(&lv, repo, dom, id, m, d);
    }
    lv.remove(dom);
}
