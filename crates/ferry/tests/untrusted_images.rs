//! Images whose bytes someone else chose, and what ferry refuses to do for them:
//!
//! * qcow2 images on an HTTP server (ferry-testsupport's nginx) whose header names a
//!   local file (an absolute backing file, a relative one, an external data file):
//!   `ferry copy`, `info`, `hash` and `serve -r` refuse them, and no byte of the local
//!   file comes out;
//! * a guest writing a qcow2 header into the first sector of its disk, served from a file
//!   whose raw format ferry guessed: the write fails with EPERM and is logged, other
//!   writes to the sector pass, and `raw:PATH` lifts the guard;
//! * a local image taken for qcow2 by its bytes alone, naming a local file;
//! * an existing copy destination that only its bytes say is qcow2;
//! * small reads of zero and unallocated qcow2 clusters answered with hole chunks.

use crate::common::ferry_remote as ferry;
use crate::common::json::{Json, JsonExt};
use crate::common::*;
use ferry_testsupport::nginx::{Nginx, NginxConf, NginxSetup};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// What the local "secret" files hold: found anywhere in an output, the file leaked.
const MARKER: &str = "FERRY-UNTRUSTED-SECRET-";
const IMAGE_LEN: usize = MIB as usize;

fn secret_bytes() -> Vec<u8> {
    MARKER.as_bytes().iter().copied().cycle().take(IMAGE_LEN).collect()
}

fn leaks(bytes: &[u8]) -> bool {
    bytes.windows(MARKER.len()).any(|w| w == MARKER.as_bytes())
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The hostile images nginx serves, with what each names.
const HOSTILE: [(&str, &str); 3] = [
    ("abs-backing.qcow2", "a backing file"),
    ("rel-backing.qcow2", "a backing file"),
    ("data-file.qcow2", "an external data file"),
];

struct Site {
    nginx: Nginx,
    /// The local files the images name (absolute paths).
    secrets: Vec<PathBuf>,
}

fn site() -> &'static Site {
    static SITE: OnceLock<Site> = OnceLock::new();
    SITE.get_or_init(start_site)
}

/// The qcow2 images, made by qemu-img beside nginx's document root: the local files
/// they name lie outside it (as /etc/shadow would).
fn start_site() -> Site {
    require("qemu-img");
    let setup = NginxSetup::new("ferry-untrusted-nginx");
    let data = setup.data();
    let dir = setup.dir().to_path_buf();
    let secret = dir.join("secret.raw");
    std::fs::write(&secret, secret_bytes()).unwrap();
    let size = IMAGE_LEN.to_string();
    let create = |args: &[&str]| {
        let mut c = cmd("qemu-img", ["create", "-f", "qcow2"]);
        run_ok(c.args(args));
    };
    create(&["-b", s(&secret), "-F", "raw", s(&data.join("abs-backing.qcow2")), &size]);
    // Relative to the image's directory: data/../secret.raw.
    create(&["-b", "../secret.raw", "-F", "raw", s(&data.join("rel-backing.qcow2")), &size]);
    // data_file_raw maps every cluster to the same offset of the data file, which then
    // gets the secret bytes.
    let data_file = dir.join("secret-data.raw");
    let opts = format!("data_file={},data_file_raw=on", s(&data_file));
    create(&["-o", &opts, s(&data.join("data-file.qcow2")), &size]);
    std::fs::write(&data_file, secret_bytes()).unwrap();
    // qemu reads the secret through each of them: they are what they claim to be.
    for (name, _) in HOSTILE {
        let out = dir.join("qemu.out");
        run_ok(&mut cmd("qemu-img", ["convert", "-O", "raw", s(&data.join(name)), s(&out)]));
        assert!(leaks(&std::fs::read(&out).unwrap()), "qemu-img does not read the secret through {name}");
        std::fs::remove_file(&out).unwrap();
    }
    let conf = NginxConf { ca_name: "ferry untrusted-images test CA", http: "access_log off;", server: "" };
    Site { nginx: setup.start(&conf), secrets: vec![secret, data_file] }
}

/// Asserts `out` failed, saying which image named what and what to do, and printed no
/// byte of a secret.
#[track_caller]
fn assert_refused(out: &Output, image: &str, what: &str) {
    assert!(!out.status.success(), "should have been refused:\n{}", out.describe());
    let all = format!("{}{}", out.stdout, out.stderr);
    assert!(!all.contains("panicked"), "a panic:\n{}", out.describe());
    assert!(!all.contains(MARKER), "a secret's bytes were printed:\n{}", out.describe());
    for want in [image, what, "copy the image"] {
        assert!(all.contains(want), "the error does not say {want:?}:\n{}", out.describe());
    }
}

#[test]
fn a_remote_qcow2_naming_a_local_file_is_refused() {
    let site = site();
    let n = &site.nginx;
    let tmp = tempfile::tempdir().unwrap();
    require("nbdcopy");
    for (name, what) in HOSTILE {
        for url in [n.url(name), format!("qcow2:{}", n.url(name))] {
            let out_file = tmp.path().join(format!("{name}.out"));
            let out = run(&mut ferry(["copy", &url, s(&out_file)]));
            assert_refused(&out, name, what);
            assert!(!out_file.exists() || !leaks(&std::fs::read(&out_file).unwrap()), "{url}: the copy leaked");
            assert_refused(&run(&mut ferry(["hash", &url])), name, what);
            assert_refused(&run(&mut ferry(["info", &url])), name, what);
            assert_refused(&run(&mut ferry(["info", "--json", &url])), name, what);
            // The server never starts, so its --run client never reads anything.
            let got = tmp.path().join(format!("{name}.served"));
            let sock = tmp.path().join("s.sock");
            let client = format!("nbdcopy \"$uri\" {}", s(&got));
            let out = run(&mut ferry(["serve", "-r", "--unix", s(&sock), "--run", &client, &url]));
            assert_refused(&out, name, what);
            assert!(!got.exists(), "{url}: a client of the export read {}", got.display());
        }
        // Its container is still there to look at, as raw bytes.
        let raw = tmp.path().join(format!("{name}.container"));
        run_ok(&mut ferry(["copy", &format!("raw:{}", n.url(name)), s(&raw)]));
        assert_eq!(&std::fs::read(&raw).unwrap()[..4], b"QFI\xfb");
    }
    // The secrets are still there (nothing refused them by their absence).
    for p in &site.secrets {
        assert!(leaks(&std::fs::read(p).unwrap()), "{}", p.display());
    }
}

/// The first sector of a qcow2 image naming `backing` as its raw backing file.
fn qcow2_header(dir: &Path, backing: &Path) -> PathBuf {
    let img = dir.join("hostile.qcow2");
    run_ok(&mut cmd(
        "qemu-img",
        ["create", "-f", "qcow2", "-b", s(backing), "-F", "raw", s(&img), &IMAGE_LEN.to_string()],
    ));
    let head = dir.join("header.bin");
    std::fs::write(&head, &std::fs::read(&img).unwrap()[..512]).unwrap();
    head
}

/// A raw file of `IMAGE_LEN` zero bytes.
fn zeroed_disk(dir: &Path) -> PathBuf {
    let disk = dir.join("disk.img");
    std::fs::File::create(&disk).unwrap().set_len(IMAGE_LEN as u64).unwrap();
    disk
}

fn format_of(path: &Path) -> String {
    let json = Json::must_parse(&run_ok(&mut ferry(["info", "--json", s(path)])).stdout);
    json.at("format").as_str().unwrap_or_default().to_string()
}

const GUESSED: &str = "its format was guessed";

#[test]
fn a_guest_cannot_turn_its_guessed_raw_disk_into_a_qcow2_image() {
    require("qemu-img");
    let tmp = tempfile::tempdir().unwrap();
    let secret = tmp.path().join("secret.raw");
    std::fs::write(&secret, secret_bytes()).unwrap();
    let header = qcow2_header(tmp.path(), &secret);
    let disk = zeroed_disk(tmp.path());

    let mut server = Server::unix(s(&disk), &[]);
    run_python("guessed_raw.py", &[&server.uri(), s(&header), "guarded"]);
    server.stop();
    let log = server.stderr();
    assert_eq!(log.matches(GUESSED).count(), 1, "one warning at start, naming raw:PATH:\n{log}");
    assert!(log.contains(&format!("raw:{}", s(&disk))), "{log}");
    for want in [format!("{}: refused a write of 512 bytes at offset 0", s(&disk)), "offset 3".into()] {
        assert!(log.contains(&want), "the log does not say {want:?}:\n{log}");
    }
    let bytes = std::fs::read(&disk).unwrap();
    assert_eq!(&bytes[510..512], &[0x55, 0xaa], "the partition table was written");
    assert_eq!(format_of(&disk), "raw");
    for args in [&["copy", s(&disk), s(&tmp.path().join("copy"))][..], &["hash", s(&disk)]] {
        let out = run_ok(&mut ferry(args));
        assert!(!out.stdout.contains(MARKER) && !out.stderr.contains(MARKER));
    }
    assert!(!leaks(&std::fs::read(tmp.path().join("copy")).unwrap()));

    // Read-only, or named raw:/file:, nothing is guessed for a writer: no warning.
    for (spec, extra) in [(s(&disk).to_string(), &["-r"][..]), (format!("file:{}", s(&disk)), &[])] {
        let mut server = Server::unix(&spec, extra);
        server.stop();
        assert!(!server.stderr().contains(GUESSED), "{spec} {extra:?}:\n{}", server.stderr());
    }
    // raw:PATH lifts the guard: the header goes in (and the file is a qcow2 image now).
    let mut server = Server::unix(&format!("raw:{}", s(&disk)), &[]);
    run_python("guessed_raw.py", &[&server.uri(), s(&header), "raw"]);
    server.stop();
    assert!(!server.stderr().contains(GUESSED), "{}", server.stderr());
    assert_eq!(&std::fs::read(&disk).unwrap()[..4], b"QFI\xfb");
}

/// A copy that updates an existing destination in place (`--extents-from`,
/// `--dirty-bitmap`, `--resume`) does not take it for qcow2 because its bytes start like
/// one: they may be a guest's (a raw backup of its disk).
#[test]
fn an_existing_destination_is_not_taken_for_qcow2_by_its_bytes() {
    require("qemu-img");
    let tmp = tempfile::tempdir().unwrap();
    let secret = tmp.path().join("secret.raw");
    std::fs::write(&secret, secret_bytes()).unwrap();
    let header = std::fs::read(qcow2_header(tmp.path(), &secret)).unwrap();
    let mut data = header.clone();
    data.resize(IMAGE_LEN, 7);
    let src = format!("raw:{}", s(&write_sparse_file(tmp.path(), "src.raw", &data)));
    let mut before = header.clone();
    before.resize(IMAGE_LEN, 0);
    let dst = write_sparse_file(tmp.path(), "backup.img", &before);
    // qemu-img map's JSON: all of it changed.
    let map = tmp.path().join("map.json");
    let extent = format!(r#"[{{"start":0,"length":{IMAGE_LEN},"depth":0,"present":true,"zero":false,"data":true}}]"#);
    std::fs::write(&map, extent).unwrap();
    let out = run(&mut ferry(["copy", "--extents-from", s(&map), &src, s(&dst)]));
    assert!(!out.status.success(), "{}", out.describe());
    for want in [format!("qcow2:{}", s(&dst)), format!("raw:{}", s(&dst))] {
        assert!(out.stderr.contains(&want), "the error does not suggest {want}:\n{}", out.describe());
    }
    assert_file_eq(&dst, &before);
    // Named raw:, it is updated as raw.
    run_ok(&mut ferry(["copy", "--extents-from", s(&map), &src, &format!("raw:{}", s(&dst))]));
    assert_file_eq(&dst, &data);
}

/// Reads of any size of zero and unallocated qcow2 clusters come back as hole chunks.
#[test]
fn small_reads_of_qcow2_holes_are_hole_chunks() {
    require("qemu-io");
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("holes.qcow2");
    run_ok(&mut cmd("qemu-img", ["create", "-f", "qcow2", s(&img), "4M"]));
    run_ok(&mut cmd(
        "qemu-io",
        ["-f", "qcow2", "-c", "write -P 0x61 0 64k", "-c", "write -z 64k 64k", "-c", "write -P 0x62 1M 64k", s(&img)],
    ));
    let server = Server::unix(s(&img), &["-r"]);
    run_python("small_holes.py", &[&server.uri()]);
}

/// A raw disk whose guest wrote a qcow2 header naming a local file (through a hypervisor
/// without ferry's guard): read by its bare name, its format is only guessed, so ferry
/// opens no file it names, whatever the command; named `qcow2:PATH` or `*.qcow2`, the
/// format is the user's word and the chain is read.
#[test]
fn a_qcow2_image_guessed_from_its_bytes_names_no_file() {
    require("nbdcopy");
    let tmp = tempfile::tempdir().unwrap();
    let secret = tmp.path().join("secret.raw");
    std::fs::write(&secret, secret_bytes()).unwrap();
    let disk = zeroed_disk(tmp.path());
    qcow2_header(tmp.path(), &secret);
    // The header cluster, with the backing file's name in it.
    let head = std::fs::read(tmp.path().join("hostile.qcow2")).unwrap()[..64 << 10].to_vec();
    std::os::unix::fs::FileExt::write_all_at(&std::fs::File::options().write(true).open(&disk).unwrap(), &head, 0)
        .unwrap();
    let out_file = tmp.path().join("out.raw");
    let got = tmp.path().join("served.raw");
    let sock = tmp.path().join("s.sock");
    let client = format!("nbdcopy \"$uri\" {}", s(&got));
    let commands: [&[&str]; 6] = [
        &["copy", s(&disk), s(&out_file)],
        &["hash", s(&disk)],
        &["info", s(&disk)],
        &["info", "--json", s(&disk)],
        &["serve", "-r", "--unix", s(&sock), "--run", &client, s(&disk)],
        &["serve", "--unix", s(&sock), "--run", &client, s(&disk)],
    ];
    for args in commands {
        let out = run(&mut ferry(args));
        assert!(!out.status.success(), "should have been refused:\n{}", out.describe());
        let all = format!("{}{}", out.stdout, out.stderr);
        assert!(!all.contains(MARKER) && !all.contains("panicked"), "{}", out.describe());
        for want in ["from its first bytes alone", s(&secret), "qcow2:", "raw:"] {
            assert!(all.contains(want), "the error does not say {want:?}:\n{}", out.describe());
        }
        for f in [&out_file, &got] {
            assert!(!f.exists() || !leaks(&std::fs::read(f).unwrap()), "{args:?} leaked into {}", f.display());
        }
    }
    // Named by the user: qcow2:PATH, or a .qcow2 name, reads the chain it names.
    run_ok(&mut ferry(["copy", &format!("qcow2:{}", s(&disk)), s(&out_file)]));
    assert!(leaks(&std::fs::read(&out_file).unwrap()), "qcow2:PATH did not read its backing file");
    let named = tmp.path().join("disk.qcow2");
    std::fs::copy(&disk, &named).unwrap();
    std::fs::remove_file(&out_file).unwrap();
    run_ok(&mut ferry(["copy", s(&named), s(&out_file)]));
    assert!(leaks(&std::fs::read(&out_file).unwrap()), "a .qcow2 name did not read its backing file");
    // raw:PATH is the disk as it is.
    run_ok(&mut ferry(["copy", &format!("raw:{}", s(&disk)), s(&out_file)]));
    assert!(std::fs::read(&out_file).unwrap()[..head.len()] == head[..]);
}

/// A trusted image whose backing file has no recorded format, and whose backing file
/// (a raw disk a guest wrote) starts with a qcow2 header naming a local file: the
/// backing file is probed, so it too names no file.
#[test]
fn a_probed_backing_file_names_no_file() {
    let tmp = tempfile::tempdir().unwrap();
    let secret = tmp.path().join("secret.raw");
    std::fs::write(&secret, secret_bytes()).unwrap();
    qcow2_header(tmp.path(), &secret);
    let base = zeroed_disk(tmp.path());
    let head = std::fs::read(tmp.path().join("hostile.qcow2")).unwrap()[..64 << 10].to_vec();
    std::os::unix::fs::FileExt::write_all_at(&std::fs::File::options().write(true).open(&base).unwrap(), &head, 0)
        .unwrap();
    let top = tmp.path().join("top.qcow2");
    run_ok(&mut cmd(
        "qemu-img",
        ["create", "-f", "qcow2", "-b", s(&base), "-F", "raw", s(&top), &IMAGE_LEN.to_string()],
    ));
    // qemu-img records a format always now: turn its backing-format extension
    // (0xe2792aca) into an unknown one, as an image made by an older qemu has none.
    let mut img = std::fs::read(&top).unwrap();
    let at = img.windows(4).position(|w| w == [0xe2, 0x79, 0x2a, 0xca]).expect("a backing format extension");
    img[at..at + 4].copy_from_slice(&[0x0b, 0xad, 0xf0, 0x0d]);
    std::fs::write(&top, &img).unwrap();
    let out_file = tmp.path().join("out.raw");
    let out = run(&mut ferry(["copy", s(&top), s(&out_file)]));
    assert!(!out.status.success(), "should have been refused:\n{}", out.describe());
    for want in ["from its first bytes alone", s(&secret), "record its format"] {
        assert!(out.stderr.contains(want), "the error does not say {want:?}:\n{}", out.describe());
    }
    assert!(!out.stderr.contains(MARKER));
    assert!(!out_file.exists() || !leaks(&std::fs::read(&out_file).unwrap()), "the copy leaked");
}
