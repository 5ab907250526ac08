//! The peers' spellings ferry takes (docs/switching.md): qemu-nbd's and nbdkit's server
//! flags, nbdinfo's `--can`/`--is`/`-L`, nbdcopy's `--allocated`/`--synchronous`,
//! qemu-img convert's `-O`/`-B`, blksum's `-d`/`-t`/`-l`.

use crate::common::json::*;
use crate::common::*;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn ferry(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args);
    c
}

fn ferry_ok(args: &[&str]) -> Output {
    run_ok(&mut ferry(args))
}

/// For invocations that must fail at once (one that starts serving is killed after 15 s).
fn ferry_fails(args: &[&str]) -> Output {
    let out = run_timeout(&mut ferry(args), Duration::from_secs(15));
    assert!(!out.status.success(), "`ferry {}` must fail\n{}", args.join(" "), out.describe());
    out
}

fn qcow2_image(dir: &Path) -> String {
    let img = dir.join("disk.qcow2").display().to_string();
    run_ok(&mut cmd("qemu-img", ["create", "-q", "-f", "qcow2", &img, "1M"]));
    img
}

/// qemu-nbd's command line, as users write it, works: -t -r -f raw -k SOCK -x NAME -D TEXT
/// -e N --pid-file FILE (the qcow2 image served as raw bytes: its file's size).
#[test]
fn serve_takes_qemu_nbd_spellings() {
    require("nbdinfo");
    require("qemu-img");
    let dir = tempfile::tempdir().unwrap();
    let img = qcow2_image(dir.path());
    let file_size = std::fs::metadata(&img).unwrap().len();
    assert_ne!(file_size, 1 << 20);
    let sock = dir.path().join("s.sock").display().to_string();
    let pid = dir.path().join("pid").display().to_string();
    // The pid file names the server ($PPID of --run's shell) once it accepts connections.
    let run = format!("test \"$(cat {pid})\" = \"$PPID\" && nbdinfo --json \"$uri\"");
    let out = ferry_ok(&[
        "serve",
        "-t",
        "-r",
        "-f",
        "raw",
        "-k",
        &sock,
        "-x",
        "disk",
        "-D",
        "my disk",
        "-e",
        "0",
        "--pid-file",
        &pid,
        &img,
        "--run",
        &run,
    ]);
    let doc = Json::must_parse(&out.stdout);
    let e = &doc.array_at("exports")[0];
    assert_eq!(e.at("export-name").as_str(), Some("disk"), "{doc}");
    assert_eq!(e.at("description").as_str(), Some("my disk"), "{doc}");
    assert!(e.bool_at("is_read_only"), "{doc}");
    assert_eq!(e.u64_at("export-size"), file_size, "-f raw serves the file's bytes: {doc}");
    // Without -f the same image is served through its format; --socket and --readonly too.
    let out = ferry_ok(&["serve", "--readonly", "--socket", &sock, &img, "--run", "nbdinfo --json \"$uri\""]);
    let doc = Json::must_parse(&out.stdout);
    assert_eq!(doc.array_at("exports")[0].u64_at("export-size"), 1 << 20, "{doc}");
    assert!(doc.array_at("exports")[0].bool_at("is_read_only"), "{doc}");
}

/// nbdkit's -i/--ipaddr and qemu-nbd's -b name the TCP address.
#[test]
fn serve_takes_bind_spellings() {
    require("nbdinfo");
    for flag in ["-b", "-i", "--ipaddr"] {
        let out = ferry_ok(&[
            "serve",
            flag,
            "127.0.0.1",
            "-p",
            "0",
            "memory:1M",
            "--run",
            "nbdinfo --size \"$uri\" && echo $uri",
        ]);
        assert!(out.stdout.starts_with("1048576\nnbd://127.0.0.1:"), "{flag}: {}", out.describe());
    }
}

/// -f names a format of an image only, and never contradicts a prefix; -e and
/// --max-connections are one setting.
#[test]
fn serve_format_and_shared_refusals() {
    require("qemu-img");
    let dir = tempfile::tempdir().unwrap();
    let img = qcow2_image(dir.path());
    let raw = dir.path().join("d.raw");
    std::fs::write(&raw, vec![0u8; 65536]).unwrap();
    let raw = raw.display().to_string();
    let sock = dir.path().join("s.sock").display().to_string();
    let out = ferry_fails(&["serve", "-f", "raw", "-U", &sock, "memory:1M"]);
    assert!(out.stderr.contains("--format") && out.stderr.contains("no image"), "{}", out.describe());
    let out = ferry_fails(&["serve", "-f", "raw", "-U", &sock, &format!("qcow2:{img}")]);
    assert!(out.stderr.contains("contradicts"), "{}", out.describe());
    // A raw file is no qcow2 image: qcow2 refuses it.
    let out = ferry_fails(&["serve", "-f", "qcow2", "-U", &sock, &raw]);
    assert!(out.stderr.contains("cannot serve"), "{}", out.describe());
    let out = ferry_fails(&["serve", "-e", "2", "--max-connections", "3", "-U", &sock, "memory:1M"]);
    assert!(out.stderr.contains("cannot be used with"), "{}", out.describe());
    // -e 1: a second client at once is closed.
    require("python3-libnbd");
    let script = "import nbd,os,sys\n\
                  a=nbd.NBD(); a.connect_uri(os.environ['uri'])\n\
                  b=nbd.NBD()\n\
                  try:\n    b.connect_uri(os.environ['uri']); sys.exit('second client served')\n\
                  except nbd.Error: print('refused')\n";
    let py = dir.path().join("two.py");
    std::fs::write(&py, script).unwrap();
    let out = ferry_ok(&[
        "serve",
        "-e",
        "1",
        "-U",
        &sock,
        "memory:1M",
        "--run",
        &format!("{SYSTEM_PYTHON} {}", py.display()),
    ]);
    assert_eq!(out.stdout.trim(), "refused", "{}", out.describe());
    // With a limit, no export is offered as multi-conn: clients that would open several
    // connections (ferry copy, nbdcopy) keep to one and succeed.
    let data: Vec<u8> = (0..1024 * 1024u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&raw, &data).unwrap();
    let copied = dir.path().join("copied.raw").display().to_string();
    let out = ferry_ok(&[
        "serve",
        "-r",
        "-e",
        "2",
        "-U",
        &sock,
        &raw,
        "--run",
        &format!(
            "{} info --can multi-conn \"$uri\"; echo multi=$?; {} copy \"$uri\" {copied}",
            ferry_bin().display(),
            ferry_bin().display()
        ),
    ]);
    assert!(out.stdout.contains("multi=2"), "{}", out.describe());
    assert_eq!(std::fs::read(&copied).unwrap(), data);
}

/// `ferry info --can/--is` answer as nbdinfo's do (exit 0 yes, 2 no), on a writable
/// and a read-only export; `--can connect` is 2 where nothing listens.
#[test]
fn info_can_and_is_answer_as_nbdinfo() {
    require("nbdinfo");
    // A wrong command line is an error (1), never the "no" (2) of --can/--is.
    for args in
        [&["info", "--can", "extents", "nbd://127.0.0.1:1"][..], &["info", "--is=bogus", "x"], &["info", "--can"]]
    {
        let out = run(&mut ferry(args));
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", out.describe());
    }
    let names = [
        ("--can", "cache"),
        ("--can", "connect"),
        ("--can", "df"),
        ("--can", "fast-zero"),
        ("--can", "flush"),
        ("--can", "fua"),
        ("--can", "multi-conn"),
        ("--can", "read"),
        ("--can", "structured-reply"),
        ("--can", "trim"),
        ("--can", "write"),
        ("--can", "zero"),
        ("--is", "read-only"),
        ("--is", "rotational"),
        ("--is", "tls"),
    ];
    let mut answers = Vec::new();
    for extra in [&[][..], &["-r"][..]] {
        let s = Server::unix("memory:1M", extra);
        for (flag, what) in names {
            let ours = run(&mut ferry(&["info", flag, what, &s.uri()]));
            let theirs = run(&mut cmd("nbdinfo", [flag, what, &s.uri()]));
            assert_eq!(ours.status.code(), theirs.status.code(), "{flag} {what} {extra:?}\n{}", ours.describe());
            assert!(ours.stdout.is_empty(), "{}", ours.describe());
            answers.push(ours.status.code());
        }
    }
    // Both answers occur (a test that saw only one could not tell them apart).
    assert!(answers.contains(&Some(0)) && answers.contains(&Some(2)), "{answers:?}");
    let dir = tempfile::tempdir().unwrap();
    let nowhere = format!("nbd+unix:///?socket={}", dir.path().join("none.sock").display());
    assert_eq!(run(&mut ferry(&["info", "--can", "connect", &nowhere])).status.code(), Some(2));
    assert_eq!(run(&mut ferry(&["info", "--can", "write", &nowhere])).status.code(), Some(1));
    let out = ferry_fails(&["info", "--can", "write", "memory:1M"]);
    assert!(out.stderr.contains("ask an NBD server"), "{}", out.describe());
    // nbdinfo's -L is --list.
    let s = ServerBuilder::new("memory:1M").export("two", "memory:2M").start();
    let out = ferry_ok(&["info", "-L", "--json", &s.uri()]);
    assert_eq!(Json::must_parse(&out.stdout).array_at("exports").len(), 2, "{}", out.describe());
}

/// nbdcopy's --allocated writes every byte; --synchronous copies with one request at a
/// time; qemu-img convert's -O and -B make a qcow2 overlay.
#[test]
fn copy_takes_nbdcopy_and_qemu_img_spellings() {
    require("qemu-img");
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    let mut data = vec![0u8; 4 << 20];
    data[..4096].fill(7);
    std::fs::write(p("src.raw"), &data).unwrap();
    ferry_ok(&["copy", &p("src.raw"), &p("sparse.raw")]);
    ferry_ok(&["copy", "--allocated", &p("src.raw"), &p("full.raw")]);
    let allocated = |n: &str| std::fs::metadata(p(n)).unwrap().blocks() * 512;
    assert!(allocated("sparse.raw") < 1 << 20, "{}", allocated("sparse.raw"));
    assert!(allocated("full.raw") >= 4 << 20, "{}", allocated("full.raw"));
    assert_eq!(std::fs::read(p("full.raw")).unwrap(), data);
    let out = ferry_fails(&["copy", "--allocated", "--sparse=true", &p("src.raw"), &p("x.raw")]);
    assert!(out.stderr.contains("cannot be used with"), "{}", out.describe());

    let s = Server::unix(&p("src.raw"), &["-r"]);
    let out = ferry_ok(&["copy", "--synchronous", "--stats", &s.uri(), &p("sync.raw")]);
    assert!(
        out.stderr.contains(" over 1 connection(s)") || out.stdout.contains(" over 1 connection(s)"),
        "{}",
        out.describe()
    );
    assert_eq!(std::fs::read(p("sync.raw")).unwrap(), data);
    let out = ferry_fails(&["copy", "--synchronous", "-C", "2", &s.uri(), &p("y.raw")]);
    assert!(out.stderr.contains("cannot be used with"), "{}", out.describe());

    std::fs::write(p("base.raw"), vec![0u8; 4 << 20]).unwrap();
    ferry_ok(&["copy", "-O", "qcow2", "-B", &p("base.raw"), &p("src.raw"), &p("ovl.img")]);
    let out = run_ok(&mut cmd("qemu-img", ["info", "--output=json", &p("ovl.img")]));
    let info = Json::must_parse(&out.stdout);
    assert_eq!(info.at("format").as_str(), Some("qcow2"), "{info}");
    assert!(info.at("backing-filename").as_str().is_some_and(|b| b.ends_with("base.raw")), "{info}");
    let out = run_ok(&mut cmd("qemu-img", ["compare", "-U", &p("src.raw"), &p("ovl.img")]));
    assert!(out.status.success());
}

/// qemu-img's -f (the source's format, no probing) for copy and info, and info's
/// --output=json.
#[test]
fn copy_and_info_take_qemu_img_format_flags() {
    require("qemu-img");
    let dir = tempfile::tempdir().unwrap();
    let img = qcow2_image(dir.path());
    let out = dir.path().join("bytes.raw").display().to_string();
    // -f raw: the qcow2 file's own bytes, not the guest's megabyte.
    ferry_ok(&["copy", "-f", "raw", &img, &out]);
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&img).unwrap());
    let info = Json::must_parse(&ferry_ok(&["info", "--output=json", "-f", "raw", &img]).stdout);
    assert_eq!(info.at("format").as_str(), Some("raw"), "{info}");
    let info = Json::must_parse(&ferry_ok(&["info", "--output", "json", &img]).stdout);
    assert_eq!(info.at("format").as_str(), Some("qcow2"), "{info}");
    assert_eq!(info.u64_at("virtual-size"), 1 << 20, "{info}");
    // A raw file is no qcow2 image: -f qcow2 refuses it.
    let zeroes = dir.path().join("zeroes.raw");
    std::fs::write(&zeroes, vec![0u8; 65536]).unwrap();
    let zeroes = zeroes.display().to_string();
    let bad = ferry_fails(&["copy", "-f", "qcow2", &zeroes, &dir.path().join("x").display().to_string()]);
    assert!(bad.stderr.contains("qcow2"), "{}", bad.describe());
}

/// blksum's -d, -t and -l.
#[test]
fn hash_takes_blksum_spellings() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("d.raw");
    std::fs::write(&f, vec![5u8; 200_000]).unwrap();
    let f = f.display().to_string();
    let long = ferry_ok(&["hash", "--digest", "sha1", "--threads", "2", &f]).stdout;
    let short = ferry_ok(&["hash", "-d", "sha1", "-t", "2", &f]).stdout;
    assert_eq!(long, short);
    assert_ne!(long, ferry_ok(&["hash", &f]).stdout, "-d sha1 must change the digest");
    let names = ferry_ok(&["hash", "-l"]).stdout;
    for n in names.lines() {
        ferry_ok(&["hash", "--digest", n, &f]);
    }
    assert_eq!(names.lines().count(), 5, "{names}");
}

/// Printing onto a closed pipe (`ferry hash -l | head -0`) ends quietly with the status of
/// a program stopped by SIGPIPE (141), without a panic's backtrace.
#[test]
fn closed_stdout_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("z.raw");
    std::fs::write(&img, vec![0u8; 65536]).unwrap();
    for args in [&["hash", "-l"][..], &["info", "--json", img.to_str().unwrap()]] {
        let (r, w) = std::io::pipe().unwrap();
        drop(r);
        let out = ferry(args).stdout(w).stderr(std::process::Stdio::piped()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
