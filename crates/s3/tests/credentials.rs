//! Where ferry-s3 gets credentials besides the AWS_* keys and the profile's keys: a
//! profile's `credential_process` (a shell script here), a web identity token exchanged at
//! STS (moto_server serves STS on the same port as S3), the EC2 instance metadata service
//! (a fake IMDSv2 on 127.0.0.1), and `AWS_CA_BUNDLE`. Each test loads an [`S3Config`] as
//! ferry does, checks the access key ID it got, and stores and reads an object with it
//! (moto takes any key, so the key ID is what shows which source was used).

mod common;

use common::{http, pattern, url, S3Server};
use ferry_backend::Backend;
use ferry_s3::{open_source, S3Config, S3Writer};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn moto() -> S3Server {
    let endpoint = ferry_testsupport::moto::moto().endpoint.clone();
    S3Server { endpoint, access_key_id: "testing-key".into(), secret_access_key: "testing-secret".into() }
}

/// `S3Config::load` with only `vars` set and `home` as the home directory; the instance
/// metadata service is at a closed port unless `vars` says otherwise.
#[allow(clippy::result_large_err)] // S3Error, as the library returns it
fn load(vars: &[(&str, &str)], home: &Path) -> Result<S3Config, ferry_s3::S3Error> {
    let mut map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    map.entry("AWS_EC2_METADATA_SERVICE_ENDPOINT".into())
        .or_insert_with(|| format!("http://127.0.0.1:{}", closed_port()));
    S3Config::load(&|k| map.get(k).cloned(), Some(home))
}

fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Stores an object of a few bytes at moto with `cfg` and reads it back.
fn store_and_read(cfg: &S3Config, bucket: &str) {
    moto().make_bucket(bucket);
    let u = url(bucket, "creds/obj");
    let data = pattern(100_000, 3);
    let w = S3Writer::create(&u, cfg, &http(), data.len() as u64).unwrap();
    w.write(&data, 0, false).unwrap();
    w.complete().unwrap();
    let back = open_source(&u, cfg, &http()).unwrap();
    let mut buf = vec![0; data.len()];
    back.read(&mut buf, 0).unwrap();
    assert!(buf == data, "the object read back differs");
}

fn write_file(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

#[cfg(unix)]
fn executable(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    write_file(path, text);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn credential_process_of_the_profile() {
    let home = tempfile::tempdir().unwrap();
    let script = home.path().join("bin dir/get creds.sh");
    // It gets its arguments as the AWS CLI splits them, and prints to stderr too.
    executable(
        &script,
        "#!/bin/sh\necho \"stderr-secret-$2\" >&2\n[ \"$1\" = 'a b' ] || exit 3\n\
         printf '{\"Version\": 1, \"AccessKeyId\": \"PROCKEY%s\", \"SecretAccessKey\": \"proc-secret\", \
         \"SessionToken\": \"proc-token\", \"Expiration\": \"2099-01-01T00:00:00Z\"}' \"$2\"\n",
    );
    let config = format!(
        "[profile p]\ncredential_process = \"{}\" 'a b' 42\nregion = eu-west-1\n[profile bad]\n\
         credential_process = \"{}\" wrong 7\n",
        script.display(),
        script.display()
    );
    write_file(&home.path().join(".aws/config"), &config);
    let ep = moto().endpoint;
    let cfg = load(&[("AWS_PROFILE", "p"), ("AWS_ENDPOINT_URL", &ep)], home.path()).unwrap();
    assert_eq!(cfg.access_key_id, "PROCKEY42");
    assert_eq!(cfg.session_token.as_deref(), Some("proc-token"));
    assert_eq!(cfg.expiration.map(|t| t.to_string()).as_deref(), Some("2099-01-01T00:00:00Z"));
    assert_eq!(cfg.credentials_from, "credential_process of profile p");
    assert!(!format!("{cfg:?}").contains("proc-secret"));
    store_and_read(&cfg, "process");
    // A failing process: its status, and none of what it printed.
    let e = load(&[("AWS_PROFILE", "bad"), ("AWS_ENDPOINT_URL", &ep)], home.path()).unwrap_err().to_string();
    assert!(e.contains("credential_process of profile bad") && e.contains("exit status: 3"), "{e}");
    assert!(!e.contains("stderr-secret"), "{e}");
    // Output that is not the credentials JSON is not shown either.
    executable(&script, "#!/bin/sh\necho '{\"AccessKeyId\": \"K\", \"SecretAccessKey\": \"leaked-secret\"}'\n");
    let e = load(&[("AWS_PROFILE", "p"), ("AWS_ENDPOINT_URL", &ep)], home.path()).unwrap_err().to_string();
    assert!(e.contains("Version") && !e.contains("leaked-secret"), "{e}");
}

#[test]
fn web_identity_at_motos_sts() {
    let home = tempfile::tempdir().unwrap();
    let token = home.path().join("token");
    write_file(&token, "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQ6ZmVycnkifQ.c2ln\n");
    let ep = moto().endpoint;
    let arn = "arn:aws:iam::123456789012:role/ferry-pod";
    let vars = [
        ("AWS_WEB_IDENTITY_TOKEN_FILE", token.to_str().unwrap()),
        ("AWS_ROLE_ARN", arn),
        ("AWS_ROLE_SESSION_NAME", "ferry-test"),
        ("AWS_ENDPOINT_URL", ep.as_str()),
    ];
    let cfg = load(&vars, home.path()).unwrap();
    // moto's STS makes up temporary credentials: an ASIA... key ID and a session token.
    assert!(cfg.access_key_id.starts_with("ASIA") && cfg.access_key_id.len() == 20, "{}", cfg.access_key_id);
    assert!(cfg.session_token.as_deref().is_some_and(|t| !t.is_empty()));
    assert!(cfg.expiration.is_some());
    assert!(
        cfg.credentials_from.contains("web identity") && cfg.credentials_from.contains(arn),
        "{}",
        cfg.credentials_from
    );
    store_and_read(&cfg, "webidentity");
    // The STS endpoint may differ from S3's: AWS_ENDPOINT_URL_STS, tried first.
    let e = load(
        &[vars[0], vars[1], vars[3], ("AWS_ENDPOINT_URL_STS", &format!("http://127.0.0.1:{}", closed_port()))],
        home.path(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("no answer from STS") && e.contains(arn), "{e}");
    assert!(!e.contains("eyJ"), "the token is not shown: {e}");
    // A token without a role is an error, not a fall-through.
    let e = load(&[vars[0]], home.path()).unwrap_err().to_string();
    assert!(e.contains("a token file is set but no role ARN (AWS_WEB_IDENTITY_TOKEN_FILE"), "{e}");
    // A role ARN alone is not web identity: the chain goes on (and says so).
    let e = load(&[vars[1]], home.path()).unwrap_err().to_string();
    assert!(e.contains("web identity (AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN): no token file"), "{e}");
}

/// A fake EC2 instance metadata service (IMDSv2) on 127.0.0.1: it hands out a session
/// token, one role, and that role's credentials, and only with the token. Every request
/// is logged as `METHOD PATH token=...`.
struct Imds {
    endpoint: String,
    log: Arc<Mutex<Vec<String>>>,
}

fn fake_imds() -> Imds {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", l.local_addr().unwrap());
    let log = Arc::new(Mutex::new(Vec::new()));
    let log2 = log.clone();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(conn) = conn else { break };
            let log = log2.clone();
            std::thread::spawn(move || {
                conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut r = BufReader::new(conn.try_clone().unwrap());
                let mut w = conn;
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let mut words = line.split_whitespace();
                    let (method, path) =
                        (words.next().unwrap_or("").to_string(), words.next().unwrap_or("").to_string());
                    let (mut len, mut token, mut ttl) = (0usize, String::new(), String::new());
                    loop {
                        let mut h = String::new();
                        if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                            break;
                        }
                        let (k, v) = h.split_once(':').unwrap_or((&h, ""));
                        match k.trim().to_ascii_lowercase().as_str() {
                            "content-length" => len = v.trim().parse().unwrap_or(0),
                            "x-aws-ec2-metadata-token" => token = v.trim().to_string(),
                            "x-aws-ec2-metadata-token-ttl-seconds" => ttl = v.trim().to_string(),
                            _ => {}
                        }
                    }
                    let mut body = vec![0; len];
                    let _ = r.read_exact(&mut body);
                    log.lock().unwrap().push(format!("{method} {path} token={token}"));
                    let (status, text) = match (method.as_str(), path.as_str()) {
                        ("PUT", "/latest/api/token") if !ttl.is_empty() => (200, "imds-session-token".to_string()),
                        _ if token != "imds-session-token" => (401, String::new()),
                        ("GET", "/latest/meta-data/iam/security-credentials/") => (200, "ferry-role".into()),
                        ("GET", "/latest/meta-data/iam/security-credentials/ferry-role") => (
                            200,
                            "{\"Code\": \"Success\", \"Type\": \"AWS-HMAC\", \"AccessKeyId\": \"ASIAIMDSFAKE0000KEY1\", \
                             \"SecretAccessKey\": \"imds-secret\", \"Token\": \"imds-token\", \
                             \"Expiration\": \"2099-02-03T04:05:06Z\"}"
                                .into(),
                        ),
                        _ => (404, String::new()),
                    };
                    let head = format!("HTTP/1.1 {status} X\r\nContent-Length: {}\r\n\r\n", text.len());
                    if w.write_all(head.as_bytes()).and_then(|_| w.write_all(text.as_bytes())).is_err() {
                        return;
                    }
                }
            });
        }
    });
    Imds { endpoint, log }
}

#[test]
fn the_instance_metadata_service_last() {
    let home = tempfile::tempdir().unwrap();
    let imds = fake_imds();
    let ep = moto().endpoint;
    let vars = [("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.endpoint.as_str()), ("AWS_ENDPOINT_URL", ep.as_str())];
    let cfg = load(&vars, home.path()).unwrap();
    assert_eq!(cfg.access_key_id, "ASIAIMDSFAKE0000KEY1");
    assert_eq!(cfg.session_token.as_deref(), Some("imds-token"));
    assert_eq!(cfg.expiration.map(|t| t.to_string()).as_deref(), Some("2099-02-03T04:05:06Z"));
    assert!(cfg.credentials_from.contains(&imds.endpoint), "{}", cfg.credentials_from);
    // IMDSv2: a session token first, then both GETs with it.
    assert_eq!(
        *imds.log.lock().unwrap(),
        [
            "PUT /latest/api/token token=",
            "GET /latest/meta-data/iam/security-credentials/ token=imds-session-token",
            "GET /latest/meta-data/iam/security-credentials/ferry-role token=imds-session-token",
        ]
    );
    store_and_read(&cfg, "imds");
    // Keys in the profile come before the instance's role, and the service is asked nothing.
    write_file(
        &home.path().join(".aws/credentials"),
        "[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = s\n",
    );
    assert_eq!(load(&vars, home.path()).unwrap().access_key_id, "FILEKEY");
    assert_eq!(imds.log.lock().unwrap().len(), 3);
    // AWS_EC2_METADATA_DISABLED turns it off.
    std::fs::remove_file(home.path().join(".aws/credentials")).unwrap();
    let e = load(&[vars[0], vars[1], ("AWS_EC2_METADATA_DISABLED", "true")], home.path()).unwrap_err().to_string();
    assert!(e.contains("off (AWS_EC2_METADATA_DISABLED)"), "{e}");
    assert_eq!(imds.log.lock().unwrap().len(), 3);
}

/// A profile that assumes a role or signs in with SSO has no keys of its own: ferry
/// refuses it, saying how to export credentials, and never runs as the instance's role.
#[test]
fn assume_role_and_sso_profiles_are_refused_not_the_instance_role() {
    let home = tempfile::tempdir().unwrap();
    let imds = fake_imds();
    write_file(
        &home.path().join(".aws/credentials"),
        "[base]\naws_access_key_id = BASEKEY\naws_secret_access_key = s\n",
    );
    write_file(
        &home.path().join(".aws/config"),
        "[profile assume]\nrole_arn = arn:aws:iam::123456789012:role/r\nsource_profile = base\n\
         [profile ec2]\nrole_arn = arn:aws:iam::123456789012:role/r\ncredential_source = Ec2InstanceMetadata\n\
         [profile src]\ncredential_source = Environment\n\
         [profile sso]\nsso_session = corp\nsso_account_id = 123456789012\nsso_role_name = Admin\n\
         [profile legacy-sso]\nsso_start_url = https://corp.awsapps.com/start\nsso_region = us-east-1\n\
         [profile keys]\naws_access_key_id = OWNKEY\naws_secret_access_key = s\nrole_arn = arn:aws:iam::1:role/x\n",
    );
    for (profile, says) in [
        ("assume", "role arn:aws:iam::123456789012:role/r with the credentials of profile base"),
        ("ec2", "with the credentials of Ec2InstanceMetadata"),
        ("src", "from Environment (credential_source)"),
        ("sso", "sso_session, sso_account_id, sso_role_name"),
        ("legacy-sso", "sso_start_url, sso_region"),
    ] {
        let vars = [("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.endpoint.as_str()), ("AWS_PROFILE", profile)];
        let e = match load(&vars, home.path()) {
            Ok(cfg) => panic!("profile {profile} got credentials from {}", cfg.credentials_from),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(&format!("profile {profile} ")) && e.contains(says), "{e}");
        assert!(e.contains(&format!("aws configure export-credentials --profile {profile} --format env")), "{e}");
        assert!(e.contains("credential_process") && e.contains("instance's role"), "{e}");
    }
    // An ECS task's (or EKS Pod Identity's) container credentials: refused the same way.
    for v in ["AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"] {
        let vars = [("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.endpoint.as_str()), (v, "/v2/credentials/x")];
        let e = match load(&vars, home.path()) {
            Ok(cfg) => panic!("{v}: got credentials from {}", cfg.credentials_from),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(v) && e.contains("instance's role"), "{e}");
    }
    assert!(imds.log.lock().unwrap().is_empty(), "the instance metadata service was asked");
    // A profile's own keys still come first.
    let vars = [("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.endpoint.as_str()), ("AWS_PROFILE", "keys")];
    assert_eq!(load(&vars, home.path()).unwrap().access_key_id, "OWNKEY");
}

#[test]
fn no_credentials_lists_every_source_tried() {
    let home = tempfile::tempdir().unwrap();
    let port = closed_port();
    let imds = format!("http://127.0.0.1:{port}");
    let start = std::time::Instant::now();
    let e = load(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds)], home.path()).unwrap_err().to_string();
    assert!(start.elapsed() < Duration::from_secs(5), "an absent metadata service is given up on soon");
    let sources = [
        "1. the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY): not set",
        "2. web identity (AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN",
        "3. [default] of ",
        ".aws/credentials",
        "4. [default] of ",
        ".aws/config",
        "5. credential_process of profile default: not set",
        &format!("6. the EC2 instance metadata service at {imds}: no answer"),
    ];
    let mut at = 0;
    for s in sources {
        let found = e[at..].find(s).unwrap_or_else(|| panic!("{s:?} missing (in order) from: {e}"));
        at += found + s.len();
    }
}

#[test]
fn aws_ca_bundle_is_the_trust_of_s3_requests() {
    let home = tempfile::tempdir().unwrap();
    let ca = home.path().join("ca.pem");
    write_file(&ca, "not a certificate\n");
    let ep = moto().endpoint;
    let base = [("AWS_ACCESS_KEY_ID", "CAKEY"), ("AWS_SECRET_ACCESS_KEY", "s"), ("AWS_ENDPOINT_URL", ep.as_str())];
    let mut v = base.to_vec();
    v.push(("AWS_CA_BUNDLE", ca.to_str().unwrap()));
    let cfg = load(&v, home.path()).unwrap();
    assert_eq!(cfg.ca_bundle.as_deref(), Some(ca.as_path()));
    // The bundle is read for S3's requests: this one is no PEM, so nothing goes out.
    moto().make_bucket("cabundle");
    let u = url("cabundle", "x");
    let e = S3Writer::create(&u, &cfg, &http(), 10).err().expect("a CA file that is not PEM is refused").to_string();
    assert!(e.contains("ca.pem") && e.contains("CA file"), "{e}");
    // --ca (HttpOptions::ca) wins over it, as --ca-bundle over AWS_CA_BUNDLE in the AWS CLI.
    let good = ferry_http::HttpOptions { ca: Some(home.path().join("no-such-file")), ..http() };
    let e = S3Writer::create(&u, &cfg, &good, 10).err().unwrap().to_string();
    assert!(e.contains("no-such-file"), "{e}");
    // The profile's ca_bundle, when the variable is not set.
    write_file(&home.path().join(".aws/config"), &format!("[default]\nca_bundle = {}\n", ca.display()));
    assert_eq!(load(&base, home.path()).unwrap().ca_bundle.as_deref(), Some(ca.as_path()));
}
