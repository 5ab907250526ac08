//! The credential sources that need a request or a process: STS's
//! AssumeRoleWithWebIdentity (a Kubernetes pod's web identity token), a profile's
//! `credential_process`, and the EC2 instance metadata service (IMDSv2). Each returns the
//! key pair, session token and expiry it got; no error or log line carries the secret, the
//! token, or what the process printed.

use crate::client::xml_text;
use crate::S3Error;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The most of an answer, a token file or a process's output read (they are small).
const MAX_BYTES: u64 = 1 << 20;
/// IMDS: how long to wait for a connection, and for a whole answer. Off EC2 nothing
/// answers at 169.254.169.254, and ferry must not hang on it.
const IMDS_CONNECT: Duration = Duration::from_secs(1);
const IMDS_ANSWER: Duration = Duration::from_secs(3);
/// STS: the longest an AssumeRoleWithWebIdentity exchange may take, answer and all, so
/// that a server trickling its answer cannot hold ferry (each read has 30 s besides).
const STS_ANSWER: Duration = Duration::from_secs(60);
/// The lifetime asked for an IMDSv2 session token (the SDKs' default, 6 hours).
const IMDS_TOKEN_TTL: &str = "21600";

/// Credentials got from a source.
pub(crate) struct Fetched {
    pub key: String,
    pub secret: String,
    pub token: Option<String>,
    /// When temporary credentials stop working.
    pub expiration: Option<jiff::Timestamp>,
}

fn config_error(message: String) -> S3Error {
    S3Error::Config(message)
}

/// An agent for STS (trusting `ca` when given) or, with `imds`, for the instance
/// metadata service (short timeouts, never a proxy).
fn agent(ca: Option<&Path>, imds: bool) -> Result<ureq::Agent, S3Error> {
    if imds {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .timeout_connect(Some(IMDS_CONNECT))
            .timeout_global(Some(IMDS_ANSWER))
            .user_agent(concat!("ferry/", env!("CARGO_PKG_VERSION")))
            .build();
        return Ok(ureq::Agent::new_with_config(config));
    }
    let opts = ferry_http::HttpOptions {
        ca: ca.map(Path::to_path_buf),
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    Ok(ferry_http::agent(&opts)?)
}

fn read_body(resp: &mut ureq::http::Response<ureq::Body>) -> Result<String, ureq::Error> {
    let mut raw = Vec::new();
    resp.body_mut().as_reader().take(MAX_BYTES).read_to_end(&mut raw)?;
    Ok(String::from_utf8_lossy(&raw).into_owned())
}

/// `application/x-www-form-urlencoded` of `pairs`.
fn form(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| format!("{}={}", crate::sigv4::uri_encode(k), crate::sigv4::uri_encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// AssumeRoleWithWebIdentity: the web identity token in `token_file` exchanged at STS
/// (`sts_endpoint`, an unsigned request) for temporary credentials of `role_arn`.
pub(crate) fn web_identity(
    token_file: &Path,
    role_arn: &str,
    session_name: &str,
    sts_endpoint: &str,
    ca: Option<&Path>,
) -> Result<Fetched, S3Error> {
    let what = format!("web identity (role {role_arn}, token file {})", token_file.display());
    let token = read_small(token_file).map_err(|e| config_error(format!("{what}: cannot read the token file: {e}")))?;
    let token = token.trim();
    if token.is_empty() {
        return Err(config_error(format!("{what}: the token file is empty")));
    }
    let body = form(&[
        ("Action", "AssumeRoleWithWebIdentity"),
        ("RoleArn", role_arn),
        ("RoleSessionName", session_name),
        ("Version", "2011-06-15"),
        ("WebIdentityToken", token),
    ]);
    let url = url::Url::parse(sts_endpoint)
        .map_err(|e| config_error(format!("{what}: the STS endpoint {sts_endpoint:?} is not a URL ({e})")))?;
    let mut req = agent(ca, false)?
        .post(url.as_str())
        .header("content-type", "application/x-www-form-urlencoded; charset=utf-8")
        .header("accept", "application/xml")
        .config()
        .timeout_global(Some(STS_ANSWER))
        .build();
    if let Some(p) = ferry_http::proxy_for(&url, sts_endpoint)? {
        req = req.config().proxy(Some(p)).build();
    }
    let answer = req.send(body.as_bytes()).and_then(|mut r| Ok((r.status().as_u16(), read_body(&mut r)?)));
    let (status, text) = answer.map_err(|e| {
        config_error(format!(
            "{what}: no answer from STS at {sts_endpoint}: {e}; check AWS_ENDPOINT_URL_STS or the network"
        ))
    })?;
    if status >= 300 || xml_text(&text, "AccessKeyId").is_none() {
        let code = xml_text(&text, "Code").unwrap_or_else(|| format!("HTTP {status}"));
        let message = xml_text(&text, "Message").unwrap_or_default();
        return Err(config_error(format!(
            "{what}: STS at {sts_endpoint} refused AssumeRoleWithWebIdentity: {code} {message}; check the role's \
             trust policy, the token's audience, and AWS_ROLE_ARN"
        )));
    }
    let field = |tag: &str| xml_text(&text, tag).filter(|v| !v.is_empty());
    match (field("AccessKeyId"), field("SecretAccessKey")) {
        (Some(key), Some(secret)) => Ok(Fetched {
            key,
            secret,
            token: field("SessionToken"),
            expiration: field("Expiration").and_then(|e| e.parse().ok()),
        }),
        _ => {
            Err(config_error(format!("{what}: STS at {sts_endpoint} answered without AccessKeyId and SecretAccessKey")))
        }
    }
}

fn read_small(path: &Path) -> std::io::Result<String> {
    let mut s = String::new();
    std::fs::File::open(path)?.take(MAX_BYTES).read_to_string(&mut s)?;
    Ok(s)
}

/// `command` split into words as the AWS CLI does on Linux and macOS (botocore's
/// `compat_shell_split` is Python's `shlex.split` there, POSIX mode): space, tab, CR and
/// LF separate words; `'...'` is literal; `"..."` keeps blanks and takes `\` only before
/// `"` and `\` (before anything else, `$` and `` ` `` included, the `\` stays); a `\`
/// outside quotes takes the next character, a newline included. No shell runs: `$VAR`,
/// globs and pipes are not expanded.
pub(crate) fn shell_split(command: &str) -> Result<Vec<String>, &'static str> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = command.chars();
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' | '\r' | '\n' => {
                if let Some(w) = word.take() {
                    words.push(w);
                }
            }
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => w.push(c),
                        None => return Err("a ' is not closed"),
                    }
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\')) => w.push(c),
                            Some(c) => {
                                w.push('\\');
                                w.push(c);
                            }
                            None => return Err("a \" is not closed"),
                        },
                        Some(c) => w.push(c),
                        None => return Err("a \" is not closed"),
                    }
                }
            }
            '\\' => match chars.next() {
                Some(c) => word.get_or_insert_with(String::new).push(c),
                None => return Err("it ends with a \\"),
            },
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(word);
    Ok(words)
}

/// Runs a profile's `credential_process` and reads the JSON it prints (`Version` 1,
/// `AccessKeyId`, `SecretAccessKey`, optional `SessionToken` and `Expiration`). Its
/// standard input is ferry's (for a prompt); its output and error output are read and
/// never shown, since they may hold secrets.
pub(crate) fn process(command: &str, profile: &str) -> Result<Fetched, S3Error> {
    let what = format!("credential_process of profile {profile}");
    let argv = shell_split(command).map_err(|why| config_error(format!("{what}: cannot split the command: {why}")))?;
    let Some((program, args)) = argv.split_first() else {
        return Err(config_error(format!("{what} is empty: give the command to run")));
    };
    let mut child = Command::new(program)
        .args(args)
        // A backup repository's passphrase (ferry-repo) is not the helper's to see.
        .env_remove("FERRY_PASSWORD")
        .stdin(Stdio::inherit())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| config_error(format!("{what}: cannot run {program:?}: {e}")))?;
    // Read the error output beside the output, so that neither pipe fills and blocks it.
    let stderr = child.stderr.take();
    let drain = std::thread::spawn(move || {
        if let Some(mut e) = stderr {
            let _ = std::io::copy(&mut e, &mut std::io::sink());
        }
    });
    let mut out = Vec::new();
    let read = match child.stdout.take() {
        Some(o) => o.take(MAX_BYTES + 1).read_to_end(&mut out).map(|_| ()),
        None => Ok(()),
    };
    if out.len() as u64 > MAX_BYTES {
        let _ = child.kill();
    }
    let status = child.wait().map_err(|e| config_error(format!("{what}: cannot wait for {program:?}: {e}")))?;
    let _ = drain.join();
    read.map_err(|e| config_error(format!("{what}: cannot read the output of {program:?}: {e}")))?;
    if !status.success() {
        return Err(config_error(format!(
            "{what}: {program:?} failed ({status}); its output is not shown (it may hold secrets): run the command \
             yourself to see why"
        )));
    }
    if out.len() as u64 > MAX_BYTES {
        return Err(config_error(format!("{what}: {program:?} printed more than {MAX_BYTES} bytes")));
    }
    let bad = |why: &str| {
        config_error(format!(
            "{what}: the output of {program:?} is not the credentials JSON the AWS CLI reads ({why}): \
             {{\"Version\": 1, \"AccessKeyId\": ..., \"SecretAccessKey\": ..., \"SessionToken\": ..., \"Expiration\": ...}}"
        ))
    };
    // serde_json's errors name a position and what was expected, never the text.
    let json: serde_json::Value = serde_json::from_slice(&out).map_err(|_| bad("not JSON"))?;
    if json.get("Version").and_then(serde_json::Value::as_u64) != Some(1) {
        return Err(bad("no \"Version\": 1"));
    }
    let text =
        |name: &str| json.get(name).and_then(serde_json::Value::as_str).filter(|v| !v.is_empty()).map(str::to_string);
    let (Some(key), Some(secret)) = (text("AccessKeyId"), text("SecretAccessKey")) else {
        return Err(bad("AccessKeyId or SecretAccessKey is missing"));
    };
    let expiration = match text("Expiration") {
        None => None,
        Some(e) => Some(e.parse::<jiff::Timestamp>().map_err(|_| bad("Expiration is not an RFC 3339 time"))?),
    };
    Ok(Fetched { key, secret, token: text("SessionToken"), expiration })
}

/// The role credentials of the EC2 instance metadata service at `endpoint` (IMDSv2: a
/// session token first, then the role's name and its credentials). `Ok(Err(reason))` when
/// nothing answers there (not on EC2) or no role is attached: the chain's last source
/// found nothing. An error when the service gives a role whose credentials are unusable.
pub(crate) fn imds(endpoint: &str) -> Result<Result<Fetched, String>, S3Error> {
    let what = format!("the EC2 instance metadata service at {endpoint}");
    let base = endpoint.trim_end_matches('/');
    let agent = agent(None, true)?;
    let token = match agent
        .put(format!("{base}/latest/api/token"))
        .header("x-aws-ec2-metadata-token-ttl-seconds", IMDS_TOKEN_TTL)
        .send(&[][..])
    {
        Ok(mut r) if r.status().is_success() => match read_body(&mut r) {
            Ok(t) if !t.trim().is_empty() => t.trim().to_string(),
            _ => return Ok(Err("no session token in its answer".into())),
        },
        Ok(r) => return Ok(Err(format!("HTTP {} to the session token request", r.status().as_u16()))),
        Err(e) => return Ok(Err(format!("no answer ({e})"))),
    };
    let get = |path: &str| -> Result<String, String> {
        match agent.get(format!("{base}{path}")).header("x-aws-ec2-metadata-token", &token).call() {
            Ok(mut r) if r.status().is_success() => read_body(&mut r).map_err(|e| format!("{path}: {e}")),
            Ok(r) => Err(format!("HTTP {} for {path}", r.status().as_u16())),
            Err(e) => Err(format!("{path}: no answer ({e})")),
        }
    };
    let roles = match get("/latest/meta-data/iam/security-credentials/") {
        Ok(r) => r,
        Err(why) => return Ok(Err(format!("no IAM role ({why})"))),
    };
    let Some(role) = roles.lines().map(str::trim).find(|l| !l.is_empty()) else {
        return Ok(Err("no IAM role attached to the instance".into()));
    };
    if !role.chars().all(|c| c.is_ascii_alphanumeric() || "+=,.@_-".contains(c)) {
        return Err(config_error(format!("{what} named a role that is not an IAM role name: {role:?}")));
    }
    let text = get(&format!("/latest/meta-data/iam/security-credentials/{role}"))
        .map_err(|why| config_error(format!("{what}: cannot get the credentials of role {role}: {why}")))?;
    let bad = |why: &str| config_error(format!("{what}: the credentials of role {role} are not usable ({why})"));
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|_| bad("not JSON"))?;
    let field =
        |name: &str| json.get(name).and_then(serde_json::Value::as_str).filter(|v| !v.is_empty()).map(str::to_string);
    if let Some(code) = field("Code").filter(|c| c != "Success") {
        return Err(bad(&format!("Code {code}")));
    }
    let (Some(key), Some(secret)) = (field("AccessKeyId"), field("SecretAccessKey")) else {
        return Err(bad("no AccessKeyId or SecretAccessKey"));
    };
    Ok(Ok(Fetched { key, secret, token: field("Token"), expiration: field("Expiration").and_then(|e| e.parse().ok()) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_split_as_the_aws_cli_splits_them() {
        let w = |s: &str| shell_split(s).unwrap();
        assert_eq!(w("  /bin/get-creds --profile  x "), ["/bin/get-creds", "--profile", "x"]);
        // What python3 -c 'import shlex; print(shlex.split(...))' gives.
        assert_eq!(w(r#"a 'b c' "d \"e\" \$f \g" h\ i"#), ["a", "b c", r#"d "e" \$f \g"#, "h i"]);
        assert_eq!(w(r#""\`g \\h" a\$b"#), [r#"\`g \h"#, "a$b"]);
        assert_eq!(w("a \\\nb \"c\\\nd\""), ["a", "\nb", "c\\\nd"]);
        assert_eq!(w("x#y #z a\u{a0}b"), ["x#y", "#z", "a\u{a0}b"]);
        assert_eq!(w("'' x\"\"y"), ["", "xy"]);
        assert_eq!(w("echo $HOME | cat"), ["echo", "$HOME", "|", "cat"], "no shell");
        assert!(shell_split("a 'b").is_err() && shell_split("a \"b").is_err() && shell_split("a\\").is_err());
        assert_eq!(w(""), Vec::<String>::new());
    }

    #[test]
    fn forms_are_encoded() {
        assert_eq!(form(&[("A", "b c"), ("T", "x.y/z=")]), "A=b%20c&T=x.y%2Fz%3D");
    }
}
