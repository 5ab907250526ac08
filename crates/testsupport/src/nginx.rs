//! An nginx (Debian package `nginx`) for a test binary: its configuration, a test CA and
//! a server certificate for 127.0.0.1 (made with the `openssl` CLI), its logs and the
//! files it serves in a temporary directory; on two free loopback ports (HTTP and HTTPS).
//!
//! It runs in the foreground (`daemon off`) under a tiny `sh` wrapper whose standard input
//! is a pipe this process holds: when the test process ends in any way, the pipe closes,
//! the wrapper's `cat` returns, and it kills nginx by its PID and removes the temporary
//! directory. Keep the [`Nginx`] in a `static OnceLock` so that it starts once per test
//! binary:
//!
//! ```text
//! let setup = NginxSetup::new("ferry-x-nginx");
//! std::fs::write(setup.data().join("img"), b"...").unwrap();
//! let nginx = setup.start(&NginxConf { ca_name: "x test CA", http: "access_log off;", server: "" });
//! ```

use crate::{free_port, run};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A temporary directory being made ready for nginx: `data/` (the document root, for
/// the test to fill), `tmp/` and `logs/`.
pub struct NginxSetup {
    bin: &'static str,
    dir: PathBuf,
}

/// What differs between the tests' nginx configurations.
pub struct NginxConf<'a> {
    /// The common name of the test CA.
    pub ca_name: &'a str,
    /// Directives of the `http` block (logging), one a line.
    pub http: &'a str,
    /// Directives of the `server` block after its `root` (locations), one a line; the
    /// setup's [`dir`](NginxSetup::dir) is known before, for paths.
    pub server: &'a str,
}

/// A running nginx; stopped when the test process exits.
pub struct Nginx {
    /// Its directory: nginx.conf, ca.pem, data/ (the document root), logs/.
    pub dir: PathBuf,
    pub http: u16,
    pub https: u16,
    _wrapper: Mutex<Child>,
}

impl Nginx {
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}/{path}", self.http)
    }
    pub fn https_url(&self, path: &str) -> String {
        format!("https://127.0.0.1:{}/{path}", self.https)
    }
    /// The test CA's certificate (PEM), which signed the server's.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }
}

impl NginxSetup {
    /// Fails the test unless nginx and openssl are installed; makes the directory
    /// (`prefix` and a random suffix, under the system's temporary directory).
    pub fn new(prefix: &str) -> NginxSetup {
        let bin = ["/usr/sbin/nginx", "/usr/bin/nginx"].into_iter().find(|p| Path::new(p).exists()).unwrap_or_else(
            || {
                panic!(
                    "nginx is not installed: these tests need it (Debian: apt-get install nginx; scripts/test installs it)"
                )
            },
        );
        Command::new("openssl")
            .arg("version")
            .output()
            .unwrap_or_else(|e| panic!("the openssl command is missing ({e}): apt-get install openssl"));
        let dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap().keep();
        for sub in ["data", "tmp", "logs"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        NginxSetup { bin, dir }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The document root.
    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Writes `htpasswd` in the directory: `user` with `password` (apr1), for
    /// `auth_basic_user_file`.
    pub fn htpasswd(&self, user: &str, password: &str) {
        let hash = run(Command::new("openssl").args(["passwd", "-apr1", password]));
        std::fs::write(self.dir.join("htpasswd"), format!("{user}:{}\n", hash.trim())).unwrap();
    }

    /// Makes the certificates, writes nginx.conf and starts nginx (up to five tries on
    /// other ports); returns once both ports accept connections.
    pub fn start(self, conf: &NginxConf) -> Nginx {
        let NginxSetup { bin, dir } = self;
        certificates(&dir, conf.ca_name);
        use std::os::unix::fs::MetadataExt;
        let root = std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false);
        let indent = |lines: &str, by: &str| lines.lines().map(|l| format!("{by}{l}\n")).collect::<String>();
        for _ in 0..5 {
            let (http, https) = (free_port(), free_port());
            let text = format!(
                r#"{user}
worker_processes 2;
pid {dir}/nginx.pid;
error_log {dir}/logs/error.log;
events {{ worker_connections 512; }}
http {{
    default_type application/octet-stream;
{http_conf}    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    sendfile on;
    keepalive_requests 1000000;
    server {{
        listen 127.0.0.1:{http};
        listen 127.0.0.1:{https} ssl;
        ssl_certificate {dir}/srv.pem;
        ssl_certificate_key {dir}/srv.key;
        root {dir}/data;
{server_conf}    }}
}}
"#,
                user = if root { "user root;" } else { "" },
                dir = dir.display(),
                http_conf = indent(conf.http, "    "),
                server_conf = indent(conf.server, "        "),
            );
            std::fs::write(dir.join("nginx.conf"), text).unwrap();
            let script = format!(
                "{bin} -c {conf} -p {dir} -g 'daemon off;' & pid=$!; cat >/dev/null; kill $pid; wait $pid; rm -rf {dir}",
                conf = dir.join("nginx.conf").display(),
                dir = dir.display()
            );
            let mut child = Command::new("sh")
                .args(["-c", &script])
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .spawn()
                .expect("cannot run sh");
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if TcpStream::connect(("127.0.0.1", http)).is_ok() && TcpStream::connect(("127.0.0.1", https)).is_ok() {
                    return Nginx { dir, http, https, _wrapper: Mutex::new(child) };
                }
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            drop(child.stdin.take());
            let _ = child.wait();
            eprintln!(
                "nginx did not start on ports {http}/{https}: {}",
                std::fs::read_to_string(dir.join("logs/error.log")).unwrap_or_default()
            );
        }
        panic!("nginx did not start (see the error log above)");
    }
}

/// In `dir`: a CA named `ca_name` (ca.pem, ca.key) and a server certificate for
/// 127.0.0.1 and localhost signed by it (srv.pem, srv.key).
fn certificates(dir: &Path, ca_name: &str) {
    let d = |f: &str| dir.join(f).display().to_string();
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let subj = format!("/CN={ca_name}");
    run(Command::new("openssl").args(["req", "-x509"]).args(ec).args([
        "-keyout",
        &d("ca.key"),
        "-out",
        &d("ca.pem"),
        "-days",
        "3",
        "-subj",
        &subj,
    ]));
    run(Command::new("openssl").args(["req"]).args(ec).args([
        "-keyout",
        &d("srv.key"),
        "-out",
        &d("srv.csr"),
        "-subj",
        "/CN=127.0.0.1",
    ]));
    std::fs::write(dir.join("ext"), "subjectAltName=IP:127.0.0.1,DNS:localhost\n").unwrap();
    run(Command::new("openssl").args([
        "x509",
        "-req",
        "-in",
        &d("srv.csr"),
        "-CA",
        &d("ca.pem"),
        "-CAkey",
        &d("ca.key"),
        "-CAcreateserial",
        "-out",
        &d("srv.pem"),
        "-days",
        "3",
        "-extfile",
        &d("ext"),
    ]));
}
