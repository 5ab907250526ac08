//! `ferry copy/hash/info/serve` on images that live on HTTP(S) servers and in S3, driving the
//! release binary against real servers:
//!
//! * one nginx (Debian package `nginx`) for this test binary, on two free loopback ports
//!   (HTTP and HTTPS with a test CA made by the `openssl` CLI), serving a raw image with
//!   holes, a qcow2 made from it by qemu-img and a zstd-compressed qcow2; a Basic-auth area;
//! * a flaky proxy thread in front of nginx (503, 416 and dropped connections now and then);
//! * one moto_server (`pip install 'moto[server]'`) as the S3 API, buckets made and listed
//!   through boto3 (installed with moto).
//!
//! Both servers are ferry-testsupport's harnesses: started once per test binary, stopped
//! when it ends in any way.

use crate::common::ferry_remote as ferry;
use crate::common::json::{Json, JsonExt};
use crate::common::*;
use ferry_testsupport::http::{proxy, Verdict};
use ferry_testsupport::moto::moto;
use ferry_testsupport::nginx::{Nginx, NginxConf, NginxSetup};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The guest data: not a multiple of the qcow2 cluster size, but of 512 (qemu-img rounds
/// a raw file's size up to sectors, so the qcow2 would otherwise be larger).
const DISK_LEN: usize = 13 * MIB as usize + 192 * 1024 + 512;

/// The Basic-auth user and password nginx accepts under /auth/.
const AUTH_USER: &str = "ferry";
const AUTH_PASS: &str = "Corr3ct-h0rse";
/// A wrong password that must never be printed.
const WRONG_PASS: &str = "Wr0ng-b4ttery";

/// The guest data nginx serves, also in data/disk.raw.
fn disk() -> &'static [u8] {
    static DISK: OnceLock<Vec<u8>> = OnceLock::new();
    DISK.get_or_init(|| data_with_holes(DISK_LEN, 0x5eed))
}

/// data/disk.raw in nginx's directory.
fn raw_path() -> PathBuf {
    nginx().dir.join("data/disk.raw")
}

/// The three images nginx serves, all holding the same guest data.
const IMAGES: [(&str, &str); 3] = [("disk.raw", "raw"), ("disk.qcow2", "qcow2"), ("disk-zstd.qcow2", "qcow2")];

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn nginx() -> &'static Nginx {
    static NGINX: OnceLock<Nginx> = OnceLock::new();
    NGINX.get_or_init(start_nginx)
}

fn start_nginx() -> Nginx {
    require("qemu-img");
    let setup = NginxSetup::new("ferry-remote-nginx");
    let data = setup.data();
    let raw = write_sparse_file(&data, "disk.raw", disk());
    run_ok(&mut cmd("qemu-img", ["convert", "-f", "raw", "-O", "qcow2", s(&raw), s(&data.join("disk.qcow2"))]));
    run_ok(&mut cmd(
        "qemu-img",
        [
            "convert",
            "-f",
            "raw",
            "-O",
            "qcow2",
            "-c",
            "-o",
            "compression_type=zstd",
            s(&raw),
            s(&data.join("disk-zstd.qcow2")),
        ],
    ));
    setup.htpasswd(AUTH_USER, AUTH_PASS);
    let dir = setup.dir().display();
    let server =
        format!("location /auth/ {{ alias {dir}/data/; auth_basic \"ferry\"; auth_basic_user_file {dir}/htpasswd; }}");
    let conf = NginxConf { ca_name: "ferry remote-images test CA", http: "access_log off;", server: &server };
    setup.start(&conf)
}

/// The digest line `ferry hash` prints (its first word).
fn digest_of(out: &Output) -> String {
    out.stdout.split_whitespace().next().unwrap_or_else(|| panic!("no digest printed:\n{}", out.describe())).to_string()
}

fn local_hash() -> &'static str {
    static H: OnceLock<String> = OnceLock::new();
    H.get_or_init(|| digest_of(&run_ok(&mut ferry(["hash", s(&raw_path())]))))
}

/// Asserts a failed command named `what` and printed none of `secrets`.
#[track_caller]
fn assert_clear_error(out: &Output, what: &str, secrets: &[&str]) {
    assert!(!out.status.success(), "should have failed:\n{}", out.describe());
    let all = format!("{}{}", out.stdout, out.stderr);
    assert!(all.contains(what), "the error does not name {what}:\n{}", out.describe());
    assert!(!all.contains("panicked"), "a panic:\n{}", out.describe());
    for secret in secrets {
        assert!(!all.contains(secret), "a credential ({secret}) was printed:\n{}", out.describe());
    }
}

// ---------------------------------------------------------------------------------
// HTTP(S) images
// ---------------------------------------------------------------------------------

#[test]
fn copy_over_http_and_https_equals_the_raw_image() {
    let n = nginx();
    let tmp = tempfile::tempdir().unwrap();
    for (name, _) in IMAGES {
        for (scheme, url) in [("http", n.url(name)), ("https", n.https_url(name))] {
            let out = tmp.path().join(format!("{scheme}-{name}.out"));
            let mut c = ferry(["copy", &url, s(&out)]);
            if scheme == "https" {
                c.arg("--ca").arg(n.ca());
            }
            run_ok(&mut c);
            assert_file_eq(&out, disk());
        }
        // The system trust store replaced by SSL_CERT_FILE, as for curl.
        let out = tmp.path().join(format!("env-{name}.out"));
        run_ok(ferry(["copy", &n.https_url(name), s(&out)]).env("SSL_CERT_FILE", n.ca()));
        assert_file_eq(&out, disk());
    }
    // Forced formats: raw: of a qcow2 URL gives the image file itself.
    let out = tmp.path().join("forced-raw.out");
    run_ok(&mut ferry(["copy", &format!("raw:{}", n.url("disk.qcow2")), s(&out)]));
    assert_file_eq(&out, &std::fs::read(n.dir.join("data/disk.qcow2")).unwrap());
    let out = tmp.path().join("forced-qcow2.out");
    run_ok(&mut ferry(["copy", &format!("qcow2:{}", n.url("disk-zstd.qcow2")), s(&out)]));
    assert_file_eq(&out, disk());
}

#[test]
fn hash_of_a_url_equals_the_hash_of_the_local_raw_file() {
    let n = nginx();
    let want = local_hash();
    for (name, _) in IMAGES {
        let got = digest_of(&run_ok(&mut ferry(["hash", &n.url(name)])));
        assert_eq!(got, want, "ferry hash {}", n.url(name));
        let got = digest_of(&run_ok(ferry(["hash", &n.https_url(name), "--ca"]).arg(n.ca())));
        assert_eq!(got, want, "ferry hash {}", n.https_url(name));
    }
}

#[test]
fn info_names_format_and_virtual_size() {
    let n = nginx();
    for (name, format) in IMAGES {
        let url = n.url(name);
        let text = run_ok(&mut ferry(["info", &url])).stdout;
        assert!(text.contains(format), "ferry info {url} does not say {format}:\n{text}");
        assert!(text.contains(&DISK_LEN.to_string()), "ferry info {url} does not give the size {DISK_LEN}:\n{text}");
        let json = Json::must_parse(&run_ok(&mut ferry(["info", "--json", &url])).stdout);
        assert_eq!(json.at("format").as_str(), Some(format), "ferry info --json {url}: {json}");
        assert_eq!(json.u64_at("virtual-size"), DISK_LEN as u64, "ferry info --json {url}: {json}");
        let https = n.https_url(name);
        let json = Json::must_parse(&run_ok(ferry(["info", "--json", &https, "--ca"]).arg(n.ca())).stdout);
        assert_eq!(json.at("format").as_str(), Some(format), "ferry info --json {https}: {json}");
        assert_eq!(json.u64_at("virtual-size"), DISK_LEN as u64, "ferry info --json {https}: {json}");
    }
}

#[test]
fn copy_a_qcow2_url_to_a_new_qcow2_image() {
    let n = nginx();
    let tmp = tempfile::tempdir().unwrap();
    for name in ["disk.qcow2", "disk-zstd.qcow2"] {
        let out = tmp.path().join(format!("{name}.copy.qcow2"));
        run_ok(&mut ferry(["copy", &n.url(name), s(&out)]));
        run_ok(&mut cmd("qemu-img", ["check", "-f", "qcow2", s(&out)]));
        run_ok(&mut cmd("qemu-img", ["compare", "-f", "qcow2", "-F", "raw", s(&out), s(&raw_path())]));
    }
}

#[test]
fn serve_read_only_a_url() {
    let n = nginx();
    require("nbdinfo");
    for (name, format) in IMAGES {
        for (url, extra) in
            [(n.url(name), vec![]), (n.https_url(name), vec!["--ca".to_string(), s(&n.ca()).to_string()])]
        {
            let mut b = ServerBuilder::new(&url).read_only();
            for a in &extra {
                b = b.arg(a);
            }
            let server = b.start();
            run_ok(&mut cmd("qemu-img", ["compare", "-f", "raw", "-F", "raw", &server.uri(), s(&raw_path())]));
            let info = Json::must_parse(&run_ok(&mut cmd("nbdinfo", ["--json", &server.uri()])).stdout);
            let exports = info.array_at("exports");
            assert_eq!(exports[0].u64_at("export-size"), DISK_LEN as u64, "{url} ({format})");
            assert!(exports[0].bool_at("is_read_only"), "{url}");
        }
    }
}

#[test]
fn serve_a_url_without_read_only_is_refused() {
    let n = nginx();
    let url = n.url("disk.raw");
    let tmp = tempfile::tempdir().unwrap();
    let out = run(ferry(["serve", "--unix"]).arg(tmp.path().join("s.sock")).arg(&url));
    assert_clear_error(&out, &url, &[]);
    let text = format!("{}{}", out.stdout, out.stderr).to_lowercase();
    assert!(text.contains("read-only") || text.contains("read only"), "{}", out.describe());
}

#[test]
fn errors_name_the_url_and_never_the_password() {
    let n = nginx();
    let tmp = tempfile::tempdir().unwrap();
    let out_file = tmp.path().join("out");

    // 404.
    let url = n.url("no-such-image");
    for sub in [&["copy", &url, s(&out_file)][..], &["hash", &url], &["info", &url]] {
        let out = run(&mut ferry(sub));
        assert_clear_error(&out, &url, &[]);
        assert!(out.stderr.contains("404"), "{}", out.describe());
    }
    assert!(!out_file.exists(), "a failed copy left {}", out_file.display());

    // A certificate nobody trusts (no --ca, no SSL_CERT_FILE).
    let url = n.https_url("disk.raw");
    let out = run(&mut ferry(["copy", &url, s(&out_file)]));
    assert_clear_error(&out, &url, &[]);
    let text = out.stderr.to_lowercase();
    assert!(text.contains("certificate") || text.contains("--ca"), "{}", out.describe());
    // --insecure reads it anyway.
    run_ok(&mut ferry(["copy", "--insecure", &url, s(&out_file)]));
    assert_file_eq(&out_file, disk());
    std::fs::remove_file(&out_file).unwrap();

    // Basic authentication in the URL: the right password works, a wrong one is an error
    // that names the URL without the password.
    let good = format!("http://{AUTH_USER}:{AUTH_PASS}@127.0.0.1:{}/auth/disk.raw", n.http);
    let got = digest_of(&run_ok(&mut ferry(["hash", &good])));
    assert_eq!(got, local_hash());
    let bad = format!("http://{AUTH_USER}:{WRONG_PASS}@127.0.0.1:{}/auth/disk.raw", n.http);
    let shown = format!("127.0.0.1:{}/auth/disk.raw", n.http);
    // Every command is tried before the test fails, so the report lists all that leak.
    let mut leaks = Vec::new();
    for sub in [&["copy", &bad, s(&out_file)][..], &["hash", &bad], &["info", &bad]] {
        let out = run(&mut ferry(sub));
        assert!(out.stderr.contains("401"), "{}", out.describe());
        if format!("{}{}", out.stdout, out.stderr).contains(WRONG_PASS) {
            leaks.push(out.describe());
        }
        assert_clear_error(&out, &shown, &[]);
    }
    assert!(leaks.is_empty(), "the password in the URL was printed:\n{}", leaks.join("\n"));
    // Without credentials.
    let out = run(&mut ferry(["info", &n.url("auth/disk.raw")]));
    assert_clear_error(&out, &shown, &[]);
    // A password in a failing serve (read-write refused) is not printed either.
    let out = run(ferry(["serve", "--unix"]).arg(tmp.path().join("s.sock")).arg(&good));
    assert_clear_error(&out, &shown, &[AUTH_PASS]);

    // A URL as the destination of a copy.
    let dst = n.url("upload.raw");
    let out = run(&mut ferry(["copy", s(&raw_path()), &dst]));
    assert_clear_error(&out, &dst, &[]);
    let dst = format!("http://{AUTH_USER}:{AUTH_PASS}@127.0.0.1:{}/auth/upload.raw", n.http);
    let out = run(&mut ferry(["copy", s(&raw_path()), &dst]));
    assert_clear_error(&out, "/auth/upload.raw", &[AUTH_PASS]);
    assert!(!n.dir.join("data/upload.raw").exists());
}

// ---------------------------------------------------------------------------------
// A flaky proxy in front of nginx
// ---------------------------------------------------------------------------------

/// A proxy to nginx that answers every `every`-th request (counted from 1 over all
/// connections) with a fault, in turn: 503, 416, a dropped connection. A request already
/// answered with a fault once (the same request line and range) goes through when it is
/// made again: with several requests in flight in step, a retry could otherwise land on
/// every `every`-th turn each time and exhaust its retries (a test that failed by chance).
/// Returns its port, the request count and the fault count.
fn flaky_proxy(upstream: u16, every: u64) -> (u16, Arc<AtomicU64>, Arc<AtomicU64>) {
    let count = Arc::new(AtomicU64::new(0));
    let faults = Arc::new(AtomicU64::new(0));
    let faulted = std::sync::Mutex::new(std::collections::HashSet::new());
    let (c, f) = (count.clone(), faults.clone());
    let port = proxy(upstream, move |req| {
        let n = c.fetch_add(1, Ordering::SeqCst) + 1;
        if !n.is_multiple_of(every) {
            return Verdict::Forward;
        }
        let line = req.lines().next().unwrap_or("");
        let range = req.lines().find(|l| l.to_ascii_lowercase().starts_with("range:")).unwrap_or("");
        if !faulted.lock().unwrap().insert(format!("{line} {range}")) {
            return Verdict::Forward;
        }
        [Verdict::Status503, Verdict::Status416, Verdict::Drop][(f.fetch_add(1, Ordering::SeqCst) % 3) as usize]
    });
    (port, count, faults)
}

#[test]
fn copy_through_a_flaky_proxy_retries_and_equals_the_source() {
    let n = nginx();
    let tmp = tempfile::tempdir().unwrap();
    for (name, _) in IMAGES {
        let (port, count, faults) = flaky_proxy(n.http, 4);
        let url = format!("http://127.0.0.1:{port}/{name}");
        let out = tmp.path().join(format!("{name}.out"));
        run_ok(&mut ferry(["copy", "--retry-delay", "0.01", &url, s(&out)]));
        assert_file_eq(&out, disk());
        assert!(
            faults.load(Ordering::SeqCst) >= 3,
            "{url}: only {} requests, no faults seen",
            count.load(Ordering::SeqCst)
        );
        let got = digest_of(&run_ok(&mut ferry(["hash", &url])));
        assert_eq!(got, local_hash(), "ferry hash {url}");

        // Without retries the first fault ends the copy, naming the URL.
        let (port, _, faults) = flaky_proxy(n.http, 2);
        let url = format!("http://127.0.0.1:{port}/{name}");
        let out_file = tmp.path().join(format!("{name}.noretry"));
        let out = run(&mut ferry(["copy", "--retries", "0", &url, s(&out_file)]));
        assert_clear_error(&out, &url, &[]);
        assert!(faults.load(Ordering::SeqCst) >= 1);
    }
}

// ---------------------------------------------------------------------------------
// S3 (moto_server)
// ---------------------------------------------------------------------------------

const KEY_ID: &str = "AKIDFERRYTEST";
const SECRET: &str = "ferry-secret-never-printed";

fn boto3_python() -> &'static str {
    "python3"
}

/// Sets the AWS_* environment for moto on `c`.
fn aws(c: &mut Command) -> &mut Command {
    for v in
        ["AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_DEFAULT_REGION"]
    {
        c.env_remove(v);
    }
    c.env("AWS_ENDPOINT_URL", &moto().endpoint)
        .env("AWS_ACCESS_KEY_ID", KEY_ID)
        .env("AWS_SECRET_ACCESS_KEY", SECRET)
        .env("AWS_REGION", "us-east-1")
}

pub(crate) fn s3ferry<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut c = ferry(args);
    aws(&mut c);
    c
}

/// Runs a boto3 snippet against moto (`s3` is a client) and returns what it printed.
fn boto3(code: &str) -> String {
    let script = format!(
        "import boto3\ns3 = boto3.client('s3', endpoint_url='{}', aws_access_key_id='{KEY_ID}', \
         aws_secret_access_key='{SECRET}', region_name='us-east-1')\n{code}\n",
        moto().endpoint
    );
    let mut c = cmd(boto3_python(), ["-c", &script]);
    let out = run(&mut c);
    assert!(out.status.success(), "boto3 failed (it comes with `pip install 'moto[server]'`):\n{}", out.describe());
    out.stdout
}

pub(crate) fn make_bucket(name: &str) {
    boto3(&format!("s3.create_bucket(Bucket='{name}')"));
}

/// The keys in `bucket`, by a signed ListObjectsV2.
pub(crate) fn keys(bucket: &str) -> Vec<String> {
    boto3(&format!("for o in s3.list_objects_v2(Bucket='{bucket}').get('Contents', []): print(o['Key'])"))
        .lines()
        .map(str::to_string)
        .collect()
}

/// A file in `dir` holding `data` (sparse).
fn local_image(dir: &Path, name: &str, data: &[u8]) -> PathBuf {
    write_sparse_file(dir, name, data)
}

#[test]
fn s3_upload_download_hash_and_verify() {
    moto();
    make_bucket("rt-bkt");
    let tmp = tempfile::tempdir().unwrap();
    // 13 MiB and a bit: three 5 MiB parts at the default part size or more.
    let data = data_with_holes(DISK_LEN, 77);
    let src = local_image(tmp.path(), "src.raw", &data);
    let want = digest_of(&run_ok(&mut ferry(["hash", s(&src)])));

    run_ok(&mut s3ferry(["copy", s(&src), "s3://rt-bkt/disk.raw"]));
    assert_eq!(keys("rt-bkt"), ["disk.raw"]);
    let out = tmp.path().join("back.raw");
    run_ok(&mut s3ferry(["copy", "s3://rt-bkt/disk.raw", s(&out)]));
    assert_file_eq(&out, &data);
    assert_eq!(digest_of(&run_ok(&mut s3ferry(["hash", "s3://rt-bkt/disk.raw"]))), want);
    let info = run_ok(&mut s3ferry(["info", "s3://rt-bkt/disk.raw"])).stdout;
    assert!(info.contains(&DISK_LEN.to_string()), "{info}");

    // --verify both ways, with the digests printed.
    let v = run_ok(&mut s3ferry(["copy", "--verify", s(&src), "s3://rt-bkt/verified"]));
    assert!(format!("{}{}", v.stdout, v.stderr).contains(&want), "{}", v.describe());
    let out2 = tmp.path().join("verified.raw");
    let v = run_ok(&mut s3ferry(["copy", "--verify", "s3://rt-bkt/verified", s(&out2)]));
    assert!(format!("{}{}", v.stdout, v.stderr).contains(&want), "{}", v.describe());
    assert_file_eq(&out2, &data);

    // --expect-hash right: the object appears; wrong: exit 1 and no object.
    run_ok(&mut s3ferry(["copy", "--expect-hash", &want, s(&src), "s3://rt-bkt/expected"]));
    let wrong = "0".repeat(want.len());
    let out = run(&mut s3ferry(["copy", "--expect-hash", &wrong, s(&src), "s3://rt-bkt/wrong"]));
    assert_eq!(out.status.code(), Some(1), "{}", out.describe());
    assert_clear_error(&out, "s3://rt-bkt/wrong", &[SECRET]);
    let mut k = keys("rt-bkt");
    k.sort();
    assert_eq!(k, ["disk.raw", "expected", "verified"], "the mismatched upload left an object");
    let out = run(&mut s3ferry(["info", "s3://rt-bkt/wrong"]));
    assert_clear_error(&out, "s3://rt-bkt/wrong", &[SECRET]);
    let pending = boto3("print(len(s3.list_multipart_uploads(Bucket='rt-bkt').get('Uploads', [])))");
    assert_eq!(pending.trim(), "0", "an aborted upload is still pending");
}

#[test]
fn s3_errors_are_clear() {
    moto();
    make_bucket("err-bkt");
    let tmp = tempfile::tempdir().unwrap();
    let src = local_image(tmp.path(), "src.raw", &data_with_holes(3 * MIB as usize, 5));
    let out_file = tmp.path().join("out");
    for url in ["s3://no-such-bkt/key", "s3://err-bkt/no-such-key"] {
        for sub in [&["copy", url, s(&out_file)][..], &["hash", url], &["info", url]] {
            let out = run(&mut s3ferry(sub));
            assert_clear_error(&out, url, &[SECRET]);
        }
        assert!(!out_file.exists());
    }
    let out = run(&mut s3ferry(["copy", s(&src), "s3://no-such-bkt/key"]));
    assert_clear_error(&out, "s3://no-such-bkt/key", &[SECRET]);
    // No credentials at all.
    let mut c = ferry(["info", "s3://err-bkt/key"]);
    c.env("AWS_ENDPOINT_URL", &moto().endpoint).env_remove("AWS_ACCESS_KEY_ID").env_remove("AWS_SECRET_ACCESS_KEY");
    let out = run(&mut c);
    assert_clear_error(&out, "s3://err-bkt/key", &[SECRET]);
}

#[test]
fn s3_serve_read_only_and_qcow2_uploaded_raw() {
    moto();
    make_bucket("srv-bkt");
    let tmp = tempfile::tempdir().unwrap();
    let data = data_with_holes(DISK_LEN, 99);
    let raw = local_image(tmp.path(), "d.raw", &data);
    let qcow2 = tmp.path().join("d.qcow2");
    run_ok(&mut cmd("qemu-img", ["convert", "-f", "raw", "-O", "qcow2", s(&raw), s(&qcow2)]));
    run_ok(&mut s3ferry(["copy", s(&raw), "s3://srv-bkt/r"]));
    // The qcow2 file itself, byte for byte.
    run_ok(&mut s3ferry(["copy", &format!("raw:{}", s(&qcow2)), "s3://srv-bkt/q"]));
    let out = tmp.path().join("q.out");
    run_ok(&mut s3ferry(["copy", "raw:s3://srv-bkt/q", s(&out)]));
    assert_file_eq(&out, &std::fs::read(&qcow2).unwrap());

    // Read back as qcow2: the guest data.
    let out = tmp.path().join("guest.raw");
    run_ok(&mut s3ferry(["copy", "s3://srv-bkt/q", s(&out)]));
    assert_file_eq(&out, &data);
    let info = run_ok(&mut s3ferry(["info", "s3://srv-bkt/q"])).stdout;
    assert!(info.contains("qcow2") && info.contains(&DISK_LEN.to_string()), "{info}");

    for key in ["s3://srv-bkt/r", "s3://srv-bkt/q"] {
        let mut b = ServerBuilder::new(key).read_only();
        // ServerBuilder has no env: pass the AWS settings through `env` as a wrapper.
        let endpoint = format!("AWS_ENDPOINT_URL={}", moto().endpoint);
        let (id, secret) = (format!("AWS_ACCESS_KEY_ID={KEY_ID}"), format!("AWS_SECRET_ACCESS_KEY={SECRET}"));
        b = b.wrapper(&["env", &endpoint, &id, &secret, "AWS_REGION=us-east-1"]);
        let server = b.start();
        run_ok(&mut cmd("qemu-img", ["compare", "-f", "raw", "-F", "raw", &server.uri(), s(&raw)]));
    }
    // Without -r: refused, naming the object.
    let mut c = s3ferry(["serve", "--unix"]);
    c.arg(tmp.path().join("s.sock")).arg("s3://srv-bkt/r");
    let out = run(&mut c);
    assert_clear_error(&out, "s3://srv-bkt/r", &[SECRET]);
}

/// The multipart uploads of `bucket/key` in progress: (upload ID, parts stored).
pub(crate) fn pending_uploads(bucket: &str, key: &str) -> Vec<(String, usize)> {
    pending_with_bytes(bucket, key).into_iter().map(|(id, n, _)| (id, n)).collect()
}

/// The same, with the bytes each upload has stored.
fn pending_with_bytes(bucket: &str, key: &str) -> Vec<(String, usize, u64)> {
    boto3(&format!(
        "for u in s3.list_multipart_uploads(Bucket='{bucket}', Prefix='{key}').get('Uploads', []):\n    \
         p = s3.list_parts(Bucket='{bucket}', Key='{key}', UploadId=u['UploadId']).get('Parts', [])\n    \
         print(u['UploadId'], len(p), sum(x['Size'] for x in p))"
    ))
    .lines()
    .filter_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.len() == 3).then(|| (f[0].to_string(), f[1].parse().unwrap(), f[2].parse().unwrap()))
    })
    .collect()
}

/// The resume journals in `dir`.
pub(crate) fn journals(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir).map_or(Vec::new(), |d| d.flatten().map(|e| e.path()).collect())
}

/// Waits (up to 60 s, polling in one Python process) until an upload of `bucket/key` has
/// at least `parts` parts stored: its ID, or `None`.
pub(crate) fn wait_for_parts(bucket: &str, key: &str, parts: usize) -> Option<String> {
    let out = boto3(&format!(
        "import time\nend = time.time() + 60\nwhile time.time() < end:\n    \
         ups = s3.list_multipart_uploads(Bucket='{bucket}', Prefix='{key}').get('Uploads', [])\n    \
         done = [u['UploadId'] for u in ups if len(s3.list_parts(Bucket='{bucket}', Key='{key}', \
         UploadId=u['UploadId']).get('Parts', [])) >= {parts}]\n    \
         if done:\n        print(done[0])\n        break\n    time.sleep(0.05)"
    ));
    out.lines().next().map(str::to_string)
}

/// Runs `ferry copy ARGS` (slowed down with --rate) and kills it with -9 once the upload
/// of `bucket/key` has at least `parts` parts stored: the upload ID.
fn kill_upload_after(args: &[&str], bucket: &str, key: &str, parts: usize) -> String {
    let mut c = s3ferry(args);
    let mut child = c.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("run ferry copy");
    let found = wait_for_parts(bucket, key, parts);
    let _ = child.kill(); // SIGKILL: nothing in ferry runs on the way out
    let status = child.wait().unwrap();
    found.unwrap_or_else(|| panic!("no upload with {parts} parts stored came before ferry ended ({status})"))
}

#[test]
fn s3_upload_killed_with_resume_continues_from_the_stored_parts() {
    moto();
    make_bucket("resume-bkt");
    let tmp = tempfile::tempdir().unwrap();
    // Six parts of 8 MiB, the last one short.
    let data = data_with_holes(40 * MIB as usize + 4096, 31);
    let src = local_image(tmp.path(), "src.raw", &data);
    let want = digest_of(&run_ok(&mut ferry(["hash", s(&src)])));
    let state = tmp.path().join("state");
    let url = "s3://resume-bkt/disk.raw";
    let resume = |extra: &[&str]| {
        let mut a = vec!["copy", "--resume", "--resume-dir", s(&state)];
        a.extend_from_slice(extra);
        a.extend_from_slice(&[s(&src), url]);
        s3ferry(a)
    };

    // Slow, and with few requests in flight, so that parts are stored one after another.
    let args =
        ["copy", "--resume", "--resume-dir", s(&state), "--rate", "2M", "-C", "2", "--requests", "1", s(&src), url];
    let id = kill_upload_after(&args, "resume-bkt", "disk.raw", 2);
    assert!(keys("resume-bkt").is_empty(), "a killed upload made an object");
    assert_eq!(journals(&state).len(), 1, "the first run keeps a journal naming its upload");
    let stored = pending_uploads("resume-bkt", "disk.raw");
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert!(stored[0].1 < 6, "the whole object was stored before the kill: nothing left to resume ({stored:?})");

    // A source changed since the first run is refused, and the upload stays.
    let mtime_of_src = tmp.path().join("mtime");
    std::fs::write(&mtime_of_src, b"").unwrap();
    run_ok(&mut cmd("touch", ["-r", s(&src), s(&mtime_of_src)]));
    run_ok(&mut cmd("touch", ["-d", "2001-02-03", s(&src)]));
    let out = run_fails(&mut resume(&[]));
    assert!(out.stderr.contains("does not match") && out.stderr.contains("--restart"), "{}", out.describe());
    assert_eq!(pending_uploads("resume-bkt", "disk.raw"), stored, "a refused resume touched the upload");
    run_ok(&mut cmd("touch", ["-r", s(&mtime_of_src), s(&src)]));

    // The same command continues the same upload, sends only the parts not stored, and
    // proves the result.
    let stored_bytes = pending_with_bytes("resume-bkt", "disk.raw")[0].2;
    let out = run_ok(&mut resume(&["--verify", "--stats"]));
    assert!(
        out.stderr
            .contains(&format!("resuming the upload to {url}: {stored_bytes} of {} bytes already stored", data.len())),
        "{}",
        out.describe()
    );
    assert!(out.stdout.matches(&want).count() >= 2, "--verify on a resumed upload\n{}", out.describe());
    assert!(!out.stderr.contains(" changed: "), "a resumed upload is no incremental copy\n{}", out.describe());
    // What was copied is exactly what no stored part held: data, holes and zeroes of the
    // unstored ranges add up to the rest of the object.
    let stats = out.stderr.lines().find(|l| l.starts_with("copied ")).unwrap_or_else(|| panic!("{}", out.describe()));
    let n = |what: &str| -> u64 {
        let at = stats.find(what).unwrap_or_else(|| panic!("{what} in {stats}"));
        stats[..at].trim_end().rsplit([' ', ',', ':']).next().unwrap().parse().unwrap()
    };
    assert_eq!(
        n(" data") + n(" holes skipped") + n(" zeroes detected"),
        data.len() as u64 - stored_bytes,
        "the resumed copy read more than the parts not stored\n{}",
        out.describe()
    );
    assert_eq!(keys("resume-bkt"), ["disk.raw"]);
    assert!(pending_uploads("resume-bkt", "disk.raw").is_empty(), "the upload {id} was not completed");
    assert!(journals(&state).is_empty(), "the journal outlived the copy");
    let back = tmp.path().join("back.raw");
    run_ok(&mut s3ferry(["copy", url, s(&back)]));
    assert_file_eq(&back, &data);
}

#[test]
fn s3_failed_resumable_upload_is_kept_until_resumed_restarted_or_replaced() {
    moto();
    make_bucket("kept-bkt");
    let tmp = tempfile::tempdir().unwrap();
    // nbdkit's pattern, whose reads fail once the trigger file exists.
    let trigger = tmp.path().join("fail-now");
    let trigger_arg = format!("error-pread-file={}", trigger.display());
    let kit = Nbdkit::start(
        tmp.path(),
        &["--filter=error", "pattern", "40M", "error-pread=EIO", "error-pread-rate=100%", &trigger_arg],
    );
    let src = kit.uri();
    let want = digest_of(&run_ok(&mut ferry(["hash", &src])));
    // Journals in the default place (under XDG_STATE_HOME), where a copy without
    // --resume looks for one to discard.
    let xdg = tmp.path().join("xdg");
    let state = xdg.join("ferry/resume");
    let url = "s3://kept-bkt/disk.raw";
    let copy = |extra: &[&str]| {
        let mut a = vec!["copy"];
        a.extend_from_slice(extra);
        a.extend_from_slice(&[&src, url]);
        let mut c = s3ferry(a);
        c.env("XDG_STATE_HOME", &xdg);
        c
    };
    // A --resume copy that fails (the source breaks after two parts): the upload is
    // kept, and ferry says so.
    let fail_after_two_parts = |extra: &[&str]| {
        let _ = std::fs::remove_file(&trigger);
        let mut c = copy(extra);
        let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let ok = wait_for_parts("kept-bkt", "disk.raw", 2).is_some();
        std::fs::write(&trigger, b"").unwrap();
        let o = child.wait_with_output().unwrap();
        let out = Output {
            what: "ferry copy of a source that breaks".into(),
            status: o.status,
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        };
        assert!(ok, "no two parts stored\n{}", out.describe());
        assert!(!out.status.success(), "{}", out.describe());
        assert!(out.stderr.contains("is kept") && out.stderr.contains("--restart"), "{}", out.describe());
        let _ = std::fs::remove_file(&trigger);
        let p = pending_uploads("kept-bkt", "disk.raw");
        assert_eq!(p.len(), 1, "the failed --resume upload was not kept: {p:?}");
        p[0].0.clone()
    };

    // 1. Kept, then the upload vanishes (aborted elsewhere): --resume says so.
    let id = fail_after_two_parts(&["--resume", "--rate", "3M", "-C", "2", "--requests", "1", "--retries", "0"]);
    boto3(&format!("s3.abort_multipart_upload(Bucket='kept-bkt', Key='disk.raw', UploadId='{id}')"));
    let out = run_fails(&mut copy(&["--resume"]));
    assert!(out.stderr.contains("no longer exists"), "{}", out.describe());
    assert!(keys("kept-bkt").is_empty());

    // 2. --restart aborts the kept upload and copies afresh.
    run_ok(&mut copy(&["--restart"]));
    let id = fail_after_two_parts(&["--resume", "--rate", "3M", "-C", "2", "--requests", "1", "--retries", "0"]);
    let out = run_ok(&mut copy(&["--restart"]));
    assert!(out.stderr.contains(&format!("aborted the upload {id}")), "{}", out.describe());
    assert!(pending_uploads("kept-bkt", "disk.raw").is_empty(), "--restart left upload {id}\n{}", out.describe());
    assert_eq!(digest_of(&run_ok(&mut s3ferry(["hash", url]))), want);
    assert!(journals(&state).is_empty());

    // 3. A copy without --resume aborts the kept upload it replaces.
    let id = fail_after_two_parts(&["--resume", "--rate", "3M", "-C", "2", "--requests", "1", "--retries", "0"]);
    let out = run_ok(&mut copy(&[]));
    assert!(out.stderr.contains(&format!("aborted the upload {id}")), "{}", out.describe());
    assert!(pending_uploads("kept-bkt", "disk.raw").is_empty());
    assert!(journals(&state).is_empty());
    assert_eq!(digest_of(&run_ok(&mut s3ferry(["hash", url]))), want);

    // 4. A kept upload that cannot be aborted (the server is unreachable) keeps its
    // journal, the only record of it, and the copy stops naming it; a later --restart
    // aborts it.
    let id = fail_after_two_parts(&["--resume", "--rate", "3M", "-C", "2", "--requests", "1", "--retries", "0"]);
    let mut c = copy(&["--restart", "--retries", "0"]);
    c.env("AWS_ENDPOINT_URL", "http://127.0.0.1:9");
    let out = run_fails(&mut c);
    assert!(out.stderr.contains(&format!("names the upload {id}")), "{}", out.describe());
    assert_eq!(journals(&state).len(), 1, "the journal of an upload that could not be aborted was removed");
    let out = run_ok(&mut copy(&["--restart"]));
    assert!(out.stderr.contains(&format!("aborted the upload {id}")), "{}", out.describe());
    assert!(pending_uploads("kept-bkt", "disk.raw").is_empty());

    // Without --resume a failing upload leaves nothing at all.
    std::fs::write(&trigger, b"").unwrap();
    run_fails(&mut copy(&["--retries", "0"]));
    assert!(pending_uploads("kept-bkt", "disk.raw").is_empty());
}
