//! TLS for ferry's NBD connections: X.509 certificates and TLS 1.3 pre-shared keys, on
//! OpenSSL (see "Why OpenSSL" below for why OpenSSL and not rustls).
//!
//! The NBD handshake upgrades a plaintext socket with `NBD_OPT_STARTTLS`; this crate
//! turns a [`Stream`] into a [`TlsStream`] on either side and gives the server and the
//! client one [`Transport`] type for both, so the data path is written once.
//!
//! The data path follows seed 001 and 004: a reply's header and payload are encrypted
//! into the same records (small pieces are corked into one 16 KiB record, large payloads
//! are encrypted straight from the caller's buffer in whole records), and the records of
//! one batch reach the socket in one send. Received ciphertext is read in large chunks,
//! not a record header and a record body at a time.
//!
//! # TLS
//!
//! `NBD_OPT_STARTTLS` is part of the handshake state machines: `ServerHandshake::with_tls`
//! takes the policy (`--tls=off|on|require`); with `require`, every option but STARTTLS and
//! ABORT is answered `NBD_REP_ERR_TLS_REQD` (EXPORT_NAME, which has no error reply, drops the
//! connection), so not even the export list leaks. The machine returns `Progress::StartTls`;
//! the connection driver then refuses any plaintext byte the client sent after the option
//! (an injection, of the kind of CVE-2021-3716), runs the TLS handshake under the remaining
//! handshake timeout, calls `tls_started()` (which forgets what was negotiated in plaintext)
//! and goes on over `Transport::Tls`. The client side mirrors it (`ClientProgress::StartTls`).
//!
//! The data path under TLS keeps the rules of seeds 001 and 004. `TlsStream::send_all`
//! takes the same iovecs as the plaintext `writev`: small pieces (headers, small payloads)
//! are corked into one 16 KiB record; a large payload first tops up the current record, then
//! is encrypted from the arena in whole records, with no staging copy; the ciphertext of the
//! whole batch is gathered and leaves in one `send`. Reads take ciphertext 256 KiB at a
//! time, so OpenSSL does not make two syscalls per record. sendfile and zero-copy need the
//! kernel to send file or arena bytes as they are, so they are off on TLS connections;
//! `--zerocopy=on` with TLS is refused at start.
//!
//! **Why OpenSSL.** The issue asks for X.509 and TLS 1.3 PSK with proven interop against
//! GnuTLS peers (nbdkit, qemu, libnbd), preferably in one stack. rustls has no external PSK
//! (its issue 174), so it would need a second stack for PSK. OpenSSL does both through one
//! API, its TLS 1.3 PSK callbacks use SHA-256 as GnuTLS does (checked here both ways with
//! gnutls-cli/gnutls-serv and then with the real peers, in `tests/interop_tls.rs`), and its
//! AES-GCM is the fastest available on this CPU (AES-NI/VAES assembly). The cost: C code
//! under a safe Rust API (the `openssl` crate, maintained by the rust-openssl project), and
//! build time. The crate builds OpenSSL from source by default (`vendored`, about 3
//! minutes, needs only the C compiler, make and perl a fresh Debian machine has), so the
//! two commands of the README (serve, test) work without a `-dev` package; set `OPENSSL_NO_VENDOR=1` to
//! link the distribution's libssl instead and take its security updates.
//!
//! # What this crate owns
//!
//! `ServerTls`/`ClientTls` (contexts from `--tls-certificates` DIR, `--tls-psk` FILE, or
//! the URI's `tls-*` parameters), `TlsStream` (OpenSSL session over a ferry `Stream`),
//! `Transport` (plaintext or TLS, one type for the server's and the client's data path),
//! `PskKeys` (psktool's file format)
//!
//! `unsafe`: forbidden (OpenSSL's own `unsafe` stays inside the `openssl` crate).

use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ferry_sock::{Counters, SendLimit, Stream};
use openssl::error::ErrorStack;
use openssl::ssl::{
    ErrorCode, HandshakeError, Ssl, SslConnector, SslContext, SslContextBuilder, SslFiletype, SslMethod, SslOptions,
    SslStream, SslVerifyMode, SslVersion,
};
use openssl::x509::store::X509Lookup;
use openssl::x509::verify::X509VerifyFlags;
use openssl::x509::X509VerifyResult;

/// Plaintext bytes per TLS record (the protocol's maximum).
pub const RECORD: usize = 16 * 1024;
/// Ciphertext handed to the socket once this much has accumulated within one send.
const WIRE_FLUSH: usize = 1 << 20;
/// Ciphertext read from the socket per syscall.
const WIRE_READ: usize = 256 * 1024;
/// TLS 1.3 suites, fastest first on CPUs with AES instructions. AES-128-GCM-SHA256
/// also serves PSK sessions (OpenSSL's PSK callbacks imply SHA-256, as GnuTLS does).
const CIPHERSUITES: &str = "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256";

/// Why TLS could not be set up or established, in words for the user.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what} {path}: {source}")]
    File { what: &'static str, path: PathBuf, source: io::Error },
    #[error("{what} {path}: {reason}")]
    Load { what: &'static str, path: PathBuf, reason: String },
    #[error("PSK file {path}, line {line}: {reason} (expected IDENTITY:HEXKEY, as psktool writes)")]
    PskSyntax { path: PathBuf, line: usize, reason: String },
    #[error("PSK file {path} has no key for identity {identity:?}")]
    PskIdentity { path: PathBuf, identity: String },
    #[error("TLS setup failed: {0}")]
    Setup(#[from] ErrorStack),
    #[error("TLS handshake failed: {0}")]
    Handshake(String),
    #[error("{0}")]
    Config(String),
}

/// Pre-shared keys in psktool's format: one `identity:hexkey` per line.
#[derive(Clone)]
pub struct PskKeys {
    path: PathBuf,
    keys: HashMap<String, Vec<u8>>,
}

impl std::fmt::Debug for PskKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        f.debug_struct("PskKeys").field("path", &self.path).field("identities", &self.keys.len()).finish()
    }
}

/// Longest PSK identity and key OpenSSL's callbacks accept.
const MAX_PSK_IDENTITY: usize = 128;
const MAX_PSK_KEY: usize = 256;

impl PskKeys {
    pub fn load(path: &Path) -> Result<PskKeys, TlsError> {
        let text = std::fs::read_to_string(path).map_err(|source| TlsError::File {
            what: "cannot read PSK file",
            path: path.into(),
            source,
        })?;
        Self::parse(path, &text)
    }

    fn parse(path: &Path, text: &str) -> Result<PskKeys, TlsError> {
        let bad = |line: usize, reason: &str| TlsError::PskSyntax { path: path.into(), line, reason: reason.into() };
        let mut keys = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() {
                continue;
            }
            let (identity, key) = line.rsplit_once(':').ok_or_else(|| bad(i + 1, "no ':'"))?;
            if identity.is_empty() || identity.len() > MAX_PSK_IDENTITY {
                return Err(bad(i + 1, "identity must be 1 to 128 bytes"));
            }
            let key = hex::decode(key.trim()).map_err(|e| bad(i + 1, &format!("key is not hex: {e}")))?;
            if key.is_empty() || key.len() > MAX_PSK_KEY {
                return Err(bad(i + 1, "key must be 1 to 256 bytes"));
            }
            keys.insert(identity.to_string(), key);
        }
        if keys.is_empty() {
            return Err(bad(0, "no keys"));
        }
        Ok(PskKeys { path: path.into(), keys })
    }

    fn get(&self, identity: &str) -> Option<&[u8]> {
        self.keys.get(identity).map(Vec::as_slice)
    }
}

/// What `ferry serve --tls-*` configured.
#[derive(Debug, Clone, Default)]
pub struct ServerTlsConfig {
    /// Directory with `server-cert.pem`, `server-key.pem`, `ca-cert.pem` and optionally
    /// `ca-crl.pem` (nbdkit's and qemu's `tls-creds-x509` layout).
    pub certificates: Option<PathBuf>,
    /// psktool-format key file.
    pub psk: Option<PathBuf>,
    /// Require client certificates signed by `ca-cert.pem`.
    pub verify_peer: bool,
}

/// A server's TLS context, shared by every connection.
#[derive(Clone)]
pub struct ServerTls {
    ctx: Arc<SslContext>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerTls")
    }
}

fn pem(dir: &Path, name: &str, what: &'static str) -> Result<PathBuf, TlsError> {
    let p = dir.join(name);
    std::fs::metadata(&p).map_err(|source| TlsError::File { what, path: p.clone(), source })?;
    Ok(p)
}

fn load<T>(what: &'static str, path: &Path, r: Result<T, ErrorStack>) -> Result<T, TlsError> {
    r.map_err(|e| TlsError::Load { what, path: path.into(), reason: e.to_string() })
}

/// Loads `ca-crl.pem` from a credentials directory when it is there (optional in the
/// layout of nbdkit and qemu), and makes verification check it.
fn load_crl(b: &mut SslContextBuilder, dir: &Path) -> Result<(), TlsError> {
    let crl = dir.join("ca-crl.pem");
    if !crl.exists() {
        return Ok(());
    }
    let store = b.cert_store_mut();
    load(
        "certificate revocation list",
        &crl,
        store.add_lookup(X509Lookup::file()).and_then(|l| l.load_crl_file(&crl, SslFiletype::PEM)),
    )?;
    store.set_flags(X509VerifyFlags::CRL_CHECK)?;
    Ok(())
}

fn common(b: &mut SslContextBuilder) -> Result<(), TlsError> {
    b.set_min_proto_version(Some(SslVersion::TLS1_2))?;
    b.set_ciphersuites(CIPHERSUITES)?;
    // NBD frames every message itself, so a peer that closes without close_notify
    // cannot truncate anything unnoticed: treat it as end of stream.
    b.set_options(SslOptions::IGNORE_UNEXPECTED_EOF | SslOptions::NO_RENEGOTIATION);
    Ok(())
}

impl ServerTls {
    pub fn new(cfg: &ServerTlsConfig) -> Result<ServerTls, TlsError> {
        if cfg.certificates.is_none() && cfg.psk.is_none() {
            return Err(TlsError::Config("TLS needs --tls-certificates DIR or --tls-psk FILE".into()));
        }
        if cfg.verify_peer && cfg.certificates.is_none() {
            return Err(TlsError::Config("--tls-verify-peer needs --tls-certificates DIR (its ca-cert.pem)".into()));
        }
        let mut b = SslContext::builder(SslMethod::tls_server())?;
        common(&mut b)?;
        b.set_options(SslOptions::CIPHER_SERVER_PREFERENCE);
        // Sessions are not resumed: no tickets to compute and send after each handshake.
        b.set_num_tickets(0)?;
        if let Some(dir) = &cfg.certificates {
            let cert = pem(dir, "server-cert.pem", "server certificate")?;
            let key = pem(dir, "server-key.pem", "server key")?;
            load("server certificate", &cert, b.set_certificate_chain_file(&cert))?;
            load("server key", &key, b.set_private_key_file(&key, SslFiletype::PEM))?;
            load("server key", &key, b.check_private_key())?;
            if cfg.verify_peer {
                let ca = pem(dir, "ca-cert.pem", "CA certificate")?;
                load("CA certificate", &ca, b.set_ca_file(&ca))?;
                load_crl(&mut b, dir)?;
                b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
            }
        }
        if let Some(path) = &cfg.psk {
            let keys = PskKeys::load(path)?;
            b.set_psk_server_callback(move |_ssl, identity, out| {
                let id = identity.map(String::from_utf8_lossy).unwrap_or_default();
                match keys.get(&id) {
                    Some(k) if k.len() <= out.len() => {
                        out[..k.len()].copy_from_slice(k);
                        Ok(k.len())
                    }
                    _ => {
                        log::warn!("TLS client offered unknown PSK identity {id:?}");
                        Ok(0)
                    }
                }
            });
        }
        Ok(ServerTls { ctx: Arc::new(b.build()) })
    }

    /// Runs the server side of the TLS handshake on `stream`. The caller bounds each wait
    /// with a read timeout on the socket; when one passes, `go_on()` says whether to keep
    /// waiting (so a stalled peer can be given up on for a deadline or a shutdown, each
    /// looked at once per read timeout).
    pub fn accept(&self, stream: Stream, mut go_on: impl FnMut() -> bool) -> Result<TlsStream, TlsError> {
        let ssl = Ssl::new(&self.ctx)?;
        let mut r = ssl.accept(Wire::new(stream));
        loop {
            r = match r {
                Err(HandshakeError::WouldBlock(mid)) if go_on() => mid.handshake(),
                r => return finish(r),
            };
        }
    }
}

/// What a client URI asked for (`tls-certificates=`, `tls-psk-file=`, the URI's user,
/// `tls-hostname=`, `tls-verify-peer=`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTlsConfig {
    /// Directory with `ca-cert.pem`, optionally `ca-crl.pem`, and
    /// `client-cert.pem`/`client-key.pem` when the server wants a client certificate.
    /// Without it, the system's CAs are used.
    pub certificates: Option<PathBuf>,
    pub psk_file: Option<PathBuf>,
    /// PSK identity; defaults to the login name, as libnbd does.
    pub psk_identity: Option<String>,
    /// Name the server's certificate must carry; none (Unix sockets) checks the chain only.
    pub hostname: Option<String>,
    /// Verify the server's certificate (default: yes).
    pub verify_peer: bool,
}

impl Default for ClientTlsConfig {
    fn default() -> Self {
        ClientTlsConfig { certificates: None, psk_file: None, psk_identity: None, hostname: None, verify_peer: true }
    }
}

/// A client's TLS context.
#[derive(Clone)]
pub struct ClientTls {
    connector: Arc<SslConnector>,
    hostname: Option<String>,
    verify_peer: bool,
}

fn login_name() -> String {
    std::env::var("USER").or_else(|_| std::env::var("LOGNAME")).unwrap_or_else(|_| "root".into())
}

/// Where Debian and most distributions keep the system's CA bundle (the vendored
/// OpenSSL does not know the distribution's paths).
const SYSTEM_CA_FILES: &[&str] = &["/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt"];

impl ClientTls {
    pub fn new(cfg: &ClientTlsConfig) -> Result<ClientTls, TlsError> {
        let mut b = SslConnector::builder(SslMethod::tls_client())?;
        common(&mut b)?;
        if let Some(dir) = &cfg.certificates {
            let ca = pem(dir, "ca-cert.pem", "CA certificate")?;
            load("CA certificate", &ca, b.set_ca_file(&ca))?;
            load_crl(&mut b, dir)?;
            let (cert, key) = (dir.join("client-cert.pem"), dir.join("client-key.pem"));
            if cert.exists() && key.exists() {
                load("client certificate", &cert, b.set_certificate_chain_file(&cert))?;
                load("client key", &key, b.set_private_key_file(&key, SslFiletype::PEM))?;
                load("client key", &key, b.check_private_key())?;
            }
        } else if cfg.psk_file.is_none() {
            match std::env::var_os("SSL_CERT_FILE").map(PathBuf::from) {
                Some(f) => load("CA bundle (SSL_CERT_FILE)", &f.clone(), b.set_ca_file(&f))?,
                None => match SYSTEM_CA_FILES.iter().map(Path::new).find(|p| p.exists()) {
                    Some(f) => load("system CA bundle", f, b.set_ca_file(f))?,
                    None => b.set_default_verify_paths()?,
                },
            }
        }
        if let Some(path) = &cfg.psk_file {
            let keys = PskKeys::load(path)?;
            let identity = cfg.psk_identity.clone().unwrap_or_else(login_name);
            let key = keys
                .get(&identity)
                .ok_or_else(|| TlsError::PskIdentity { path: path.clone(), identity: identity.clone() })?
                .to_vec();
            b.set_psk_client_callback(move |_ssl, _hint, id_out, key_out| {
                let id = identity.as_bytes();
                if id.len() >= id_out.len() || key.len() > key_out.len() {
                    return Ok(0);
                }
                id_out[..id.len()].copy_from_slice(id);
                id_out[id.len()] = 0;
                key_out[..key.len()].copy_from_slice(&key);
                Ok(key.len())
            });
        }
        b.set_verify(if cfg.verify_peer { SslVerifyMode::PEER } else { SslVerifyMode::NONE });
        Ok(ClientTls { connector: Arc::new(b.build()), hostname: cfg.hostname.clone(), verify_peer: cfg.verify_peer })
    }

    /// Runs the client side of the TLS handshake on `stream`.
    pub fn connect(&self, stream: Stream) -> Result<TlsStream, TlsError> {
        let mut c = self.connector.configure()?;
        let name = self.hostname.as_deref().unwrap_or("");
        if self.hostname.is_none() || !self.verify_peer {
            c = c.verify_hostname(false).use_server_name_indication(self.hostname.is_some());
        }
        let ssl = c.into_ssl(name)?;
        finish(ssl.connect(Wire::new(stream)))
    }
}

fn finish(r: Result<SslStream<Wire>, HandshakeError<Wire>>) -> Result<TlsStream, TlsError> {
    match r {
        Ok(ssl) => Ok(TlsStream { ssl, cork: Vec::with_capacity(RECORD) }),
        Err(HandshakeError::SetupFailure(e)) => Err(TlsError::Setup(e)),
        Err(HandshakeError::Failure(mid)) | Err(HandshakeError::WouldBlock(mid)) => {
            let verify = mid.ssl().verify_result();
            let e = mid.error();
            let mut msg = match e.io_error() {
                Some(io) if matches!(io.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    "the peer did not finish the TLS handshake in time".to_string()
                }
                Some(io) => format!("{io}"),
                None => match e.ssl_error() {
                    Some(s) => s.to_string(),
                    None => "the peer closed the connection during the TLS handshake".to_string(),
                },
            };
            if verify != X509VerifyResult::OK {
                msg = format!("certificate verification failed: {} ({msg})", verify.error_string());
            }
            Err(TlsError::Handshake(msg))
        }
    }
}

/// The socket under OpenSSL: large reads, and writes gathered until [`Wire::flush`]
/// so the records of one batch leave in one syscall.
struct Wire {
    stream: Stream,
    /// Ciphertext read ahead; empty while the connection is parked (allocated on the
    /// next read).
    rbuf: Vec<u8>,
    rpos: usize,
    rlen: usize,
    wbuf: Vec<u8>,
}

impl Wire {
    fn new(stream: Stream) -> Wire {
        Wire { stream, rbuf: Vec::new(), rpos: 0, rlen: 0, wbuf: Vec::new() }
    }
}

impl Read for Wire {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.rpos == self.rlen {
            if self.rbuf.is_empty() {
                self.rbuf = vec![0; WIRE_READ];
            }
            self.rlen = self.stream.read(&mut self.rbuf)?;
            self.rpos = 0;
        }
        let n = buf.len().min(self.rlen - self.rpos);
        buf[..n].copy_from_slice(&self.rbuf[self.rpos..self.rpos + n]);
        self.rpos += n;
        Ok(n)
    }
}

impl Write for Wire {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.wbuf.extend_from_slice(buf);
        if self.wbuf.len() >= WIRE_FLUSH {
            self.flush()?;
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        if !self.wbuf.is_empty() {
            self.stream.send_all(&mut [IoSlice::new(&self.wbuf)])?;
            self.wbuf.clear();
        }
        Ok(())
    }
}

/// A TLS session over a ferry socket.
pub struct TlsStream {
    ssl: SslStream<Wire>,
    /// Plaintext waiting to fill a record.
    cork: Vec<u8>,
}

/// An OpenSSL error on an established session, as an I/O error that says it is TLS
/// and, for the common case, what to do.
fn session_error(e: openssl::ssl::Error) -> io::Error {
    match e.into_io_error() {
        Ok(io) => io,
        Err(e) => {
            let text = e.to_string();
            let hint = if text.contains("certificate required") {
                " (the server wants a client certificate: put client-cert.pem and client-key.pem \
                 beside ca-cert.pem in the tls-certificates directory)"
            } else {
                ""
            };
            io::Error::other(format!("TLS: {text}{hint}"))
        }
    }
}

impl TlsStream {
    fn plain(&mut self, mut buf: &[u8]) -> io::Result<()> {
        while !buf.is_empty() {
            match self.ssl.ssl_write(buf) {
                Ok(n) => buf = &buf[n..],
                Err(e) if e.code() == ErrorCode::WANT_WRITE && e.io_error().is_none() => {}
                Err(e) => return Err(session_error(e)),
            }
        }
        Ok(())
    }

    /// Encrypts what is corked (if anything) and empties the cork, keeping its memory.
    fn uncork(&mut self) -> io::Result<()> {
        if self.cork.is_empty() {
            return Ok(());
        }
        let cork = std::mem::take(&mut self.cork);
        let r = self.plain(&cork);
        self.cork = cork;
        self.cork.clear();
        r
    }

    /// Encrypts `bufs` into as few records as possible and sends them, flushing at the
    /// end: small pieces (headers, small payloads) share records; large payloads are
    /// encrypted from the caller's memory in whole records, after topping up the
    /// current record.
    pub fn send_all(&mut self, bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
        for s in bufs.iter() {
            let mut s: &[u8] = s;
            if self.cork.len() + s.len() < RECORD {
                self.cork.extend_from_slice(s);
                continue;
            }
            if !self.cork.is_empty() {
                let take = RECORD - self.cork.len();
                self.cork.extend_from_slice(&s[..take]);
                s = &s[take..];
                self.uncork()?;
            }
            let whole = s.len() / RECORD * RECORD;
            if whole > 0 {
                self.plain(&s[..whole])?;
            }
            self.cork.extend_from_slice(&s[whole..]);
        }
        self.uncork()?;
        self.ssl.get_mut().flush()
    }

    /// Plaintext is ready without reading the socket.
    pub fn buffered(&self) -> bool {
        let w = self.ssl.get_ref();
        self.ssl.ssl().pending() > 0 || w.rpos < w.rlen
    }

    /// Gives back the read-ahead, cork and write buffers while nothing is in them (an
    /// idle connection); they are allocated again when needed.
    pub fn release_buffers(&mut self) {
        let w = self.ssl.get_mut();
        if w.rpos == w.rlen {
            (w.rbuf, w.rpos, w.rlen) = (Vec::new(), 0, 0);
        }
        if w.wbuf.is_empty() {
            w.wbuf = Vec::new();
        }
        if self.cork.is_empty() {
            self.cork = Vec::new();
        }
    }

    /// Sends close_notify (best effort).
    pub fn close(&mut self) {
        let _ = self.ssl.shutdown();
        let _ = self.ssl.get_mut().flush();
    }

    /// The negotiated protocol version and cipher, for logs and `ferry info`.
    pub fn description(&self) -> String {
        let s = self.ssl.ssl();
        let cipher = s.current_cipher().map_or("?", |c| c.name());
        let psk = if s.peer_certificate().is_none() && s.certificate().is_none() { ", PSK" } else { "" };
        format!("{} {cipher}{psk}", s.version_str())
    }

    fn stream(&self) -> &Stream {
        &self.ssl.get_ref().stream
    }
}

impl Read for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = loop {
            match self.ssl.ssl_read(buf) {
                Ok(n) => break n,
                Err(e) if e.code() == ErrorCode::ZERO_RETURN => return Ok(0),
                Err(e) if e.code() == ErrorCode::SYSCALL && e.io_error().is_none() => return Ok(0),
                Err(e) if e.code() == ErrorCode::WANT_READ && e.io_error().is_none() => {}
                Err(e) => return Err(session_error(e)),
            }
        };
        // OpenSSL may answer something (a key update) while reading.
        if !self.ssl.get_ref().wbuf.is_empty() {
            self.ssl.get_mut().flush()?;
        }
        Ok(n)
    }
}

/// A connection's byte stream: plaintext, or TLS after `NBD_OPT_STARTTLS`.
pub enum Transport {
    Plain(Stream),
    Tls(Box<TlsStream>),
    /// Only seen if an upgrade failed half way; every operation fails.
    Broken,
}

fn broken() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the connection was lost during the TLS upgrade")
}

impl Transport {
    /// Upgrades a plaintext transport with the server side of a TLS handshake.
    /// `go_on` as in [`ServerTls::accept`].
    pub fn start_tls_server(&mut self, tls: &ServerTls, go_on: impl FnMut() -> bool) -> Result<(), TlsError> {
        let Transport::Plain(s) = std::mem::replace(self, Transport::Broken) else {
            return Err(TlsError::Config("TLS is already active".into()));
        };
        *self = Transport::Tls(Box::new(tls.accept(s, go_on)?));
        Ok(())
    }

    /// Upgrades a plaintext transport with the client side of a TLS handshake.
    pub fn start_tls_client(&mut self, tls: &ClientTls) -> Result<(), TlsError> {
        let Transport::Plain(s) = std::mem::replace(self, Transport::Broken) else {
            return Err(TlsError::Config("TLS is already active".into()));
        };
        *self = Transport::Tls(Box::new(tls.connect(s)?));
        Ok(())
    }

    fn stream(&self) -> Option<&Stream> {
        match self {
            Transport::Plain(s) => Some(s),
            Transport::Tls(t) => Some(t.stream()),
            Transport::Broken => None,
        }
    }

    /// The plaintext socket, when there is no TLS (for zero-copy sends).
    pub fn plain_mut(&mut self) -> Option<&mut Stream> {
        match self {
            Transport::Plain(s) => Some(s),
            _ => None,
        }
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, Transport::Tls(_))
    }

    /// Whether the socket underneath is a Unix socket.
    pub fn is_unix(&self) -> bool {
        self.stream().is_some_and(Stream::is_unix)
    }

    /// Sends every byte of `bufs` (encrypted under TLS), in as few syscalls as possible.
    pub fn send_all(&mut self, bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
        match self {
            Transport::Plain(s) => s.send_all(bufs).map(drop),
            Transport::Tls(t) => t.send_all(bufs),
            Transport::Broken => Err(broken()),
        }
    }

    /// sendfile(2): only on plaintext connections (TLS must see the bytes).
    pub fn send_file(&mut self, file: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<()> {
        match self {
            Transport::Plain(s) => s.send_file(file, offset, len).map(drop),
            _ => Err(io::Error::new(io::ErrorKind::Unsupported, "sendfile cannot be used under TLS")),
        }
    }

    /// [`Transport::send_file`], adding the bytes sent to `sent` (see
    /// [`Stream::send_file_counted`]).
    pub fn send_file_counted(
        &mut self,
        file: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        sent: &mut usize,
    ) -> io::Result<()> {
        match self {
            Transport::Plain(s) => s.send_file_counted(file, offset, len, sent).map(drop),
            _ => Err(io::Error::new(io::ErrorKind::Unsupported, "sendfile cannot be used under TLS")),
        }
    }

    /// Gives back buffers held between reads (see [`TlsStream::release_buffers`]).
    pub fn release_buffers(&mut self) {
        if let Transport::Tls(t) = self {
            t.release_buffers();
        }
    }

    /// Data can be read without waiting for the socket.
    pub fn buffered(&self) -> bool {
        match self {
            Transport::Tls(t) => t.buffered(),
            _ => false,
        }
    }

    pub fn stats(&self) -> Counters {
        self.stream().map(|s| s.stats).unwrap_or_default()
    }

    pub fn stats_mut(&mut self) -> Option<&mut Counters> {
        match self {
            Transport::Plain(s) => Some(&mut s.stats),
            Transport::Tls(t) => Some(&mut t.ssl.get_mut().stream.stats),
            Transport::Broken => None,
        }
    }

    /// Counts handled requests in the socket's statistics.
    pub fn count_requests(&mut self, n: u64) {
        if let Some(s) = self.stats_mut() {
            s.requests += n;
        }
    }

    pub fn peer(&self) -> String {
        self.stream().map_or_else(|| "?".into(), Stream::peer)
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.stream().ok_or_else(broken)?.set_read_timeout(t)
    }

    /// Bounds every later send, TLS records included (see [`Stream::set_send_limit`]).
    pub fn set_send_limit(&mut self, limit: SendLimit, tick: Duration) -> io::Result<()> {
        match self {
            Transport::Plain(s) => s.set_send_limit(limit, tick),
            Transport::Tls(t) => t.ssl.get_mut().stream.set_send_limit(limit, tick),
            Transport::Broken => Err(broken()),
        }
    }

    /// Ends the session: close_notify under TLS, then shuts the socket down for `how`.
    pub fn shutdown(&mut self, how: Shutdown) -> io::Result<()> {
        if let Transport::Tls(t) = self {
            t.close();
        }
        self.stream().ok_or_else(broken)?.shutdown(how)
    }

    /// Protocol and cipher under TLS.
    pub fn tls_description(&self) -> Option<String> {
        match self {
            Transport::Tls(t) => Some(t.description()),
            _ => None,
        }
    }
}

impl Read for Transport {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Transport::Plain(s) => s.read(buf),
            Transport::Tls(t) => t.read(buf),
            Transport::Broken => Err(broken()),
        }
    }
}

impl AsFd for Transport {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Transport::Plain(s) => s.as_fd(),
            Transport::Tls(t) => t.stream().as_fd(),
            // A transport is only Broken after a failed upgrade has already been
            // reported; nobody polls it afterwards.
            Transport::Broken => unreachable!("polled a connection whose TLS upgrade failed"),
        }
    }
}

impl From<Stream> for Transport {
    fn from(s: Stream) -> Self {
        Transport::Plain(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_files_parse_as_psktool_writes_them() {
        let p = Path::new("keys.psk");
        let k = PskKeys::parse(p, "alice:0123abcd\nbob:ff\n\n").unwrap();
        assert_eq!(k.get("alice"), Some(&[0x01, 0x23, 0xab, 0xcd][..]));
        assert_eq!(k.get("bob"), Some(&[0xff][..]));
        assert!(k.get("carol").is_none());
        assert!(!format!("{k:?}").contains("0123"), "keys must not be printed");
        for bad in ["", "alice", "alice:zz", ":00", "alice:"] {
            let e = PskKeys::parse(p, bad).unwrap_err().to_string();
            assert!(e.contains("keys.psk"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn missing_credentials_are_named() {
        let e = ServerTls::new(&ServerTlsConfig::default()).err().unwrap().to_string();
        assert!(e.contains("--tls-certificates"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let cfg = ServerTlsConfig { certificates: Some(dir.path().into()), ..Default::default() };
        let e = ServerTls::new(&cfg).err().unwrap().to_string();
        assert!(e.contains("server-cert.pem"), "{e}");
    }
}
