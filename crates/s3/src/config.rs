//! Where the credentials, region and endpoint come from: the environment and the AWS
//! CLI's shared files, looked up in the order the AWS tools use.

use crate::{credentials, S3Error};
use std::fmt;
use std::path::{Path, PathBuf};

/// The largest shared config or credentials file read (they are a few lines long).
const MAX_FILE_BYTES: u64 = 1 << 20;

/// How to reach S3 and who to be there.
///
/// Built by [`S3Config::from_env`] (or [`S3Config::load`], which takes the environment
/// and home directory as arguments):
///
/// - credentials, from the first source set up, in the AWS SDKs' order:
///   1. `AWS_ACCESS_KEY_ID` + `AWS_SECRET_ACCESS_KEY` (+ `AWS_SESSION_TOKEN`);
///   2. web identity: `AWS_WEB_IDENTITY_TOKEN_FILE` + `AWS_ROLE_ARN` (+
///      `AWS_ROLE_SESSION_NAME`), else the profile's `web_identity_token_file` +
///      `role_arn`, exchanged by AssumeRoleWithWebIdentity at STS (`AWS_ENDPOINT_URL_STS`,
///      else `AWS_ENDPOINT_URL`, else `https://sts.REGION.amazonaws.com`, `.com.cn` in
///      China's `cn-*` regions);
///   3. the profile's `aws_access_key_id` / `aws_secret_access_key` /
///      `aws_session_token` in the credentials file (`[NAME]` sections), else in the
///      config file (`[profile NAME]`, or `[default]`);
///   4. the profile's `credential_process`;
///   5. the EC2 instance metadata service, IMDSv2 (`AWS_EC2_METADATA_SERVICE_ENDPOINT` or
///      the profile's `ec2_metadata_service_endpoint`, else `http://169.254.169.254`;
///      none with `AWS_EC2_METADATA_DISABLED=true`).
///
///   A profile that assumes a role (`role_arn` with `source_profile` or
///   `credential_source`, without a web identity token file), has a `credential_source`
///   or signs in with IAM Identity Center (`sso_*` keys), and has no keys or
///   `credential_process`, is an error: ferry does not do those yet, and never uses
///   another identity (the instance's role) instead.
///
///   A source set up that fails is an error (with its reason); none set up is an error
///   that lists each source tried. Temporary credentials are not refreshed: see
///   [`S3Config::expiration`];
/// - the CA bundle: `AWS_CA_BUNDLE`, else the profile's `ca_bundle`;
/// - the profile: `AWS_PROFILE`, else `default`;
/// - the files: `AWS_SHARED_CREDENTIALS_FILE` (else `~/.aws/credentials`) and
///   `AWS_CONFIG_FILE` (else `~/.aws/config`);
/// - the region: `AWS_REGION`, else `AWS_DEFAULT_REGION`, else the profile's `region`,
///   else `us-east-1`;
/// - the endpoint: `AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL`, else the profile's
///   `endpoint_url`. With an endpoint (radosgw, MinIO, a test server) requests use
///   path-style URLs (`ENDPOINT/BUCKET/KEY`); without one, AWS's virtual-hosted URLs
///   (`https://BUCKET.s3.REGION.amazonaws.com/KEY`).
///
/// `Debug` and every error leave the secret key and the session token out.
#[derive(Clone)]
pub struct S3Config {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
    pub region: String,
    /// `http(s)://host[:port][/prefix]` of an S3-compatible server; `None`: AWS.
    pub endpoint: Option<String>,
    /// Where the credentials were found, for messages (e.g. `the environment`).
    pub credentials_from: String,
    /// A PEM file of CA certificates to trust for S3 (and STS): `AWS_CA_BUNDLE`, else the
    /// profile's `ca_bundle`. `--ca` wins over it.
    pub ca_bundle: Option<PathBuf>,
    /// When temporary credentials (web identity, credential_process, instance metadata)
    /// expire. ferry gets credentials once: a copy running past this fails.
    pub expiration: Option<jiff::Timestamp>,
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field("session_token", &self.session_token.as_ref().map(|_| "<redacted>"))
            .field("region", &self.region)
            .field("endpoint", &self.endpoint)
            .field("credentials_from", &self.credentials_from)
            .field("ca_bundle", &self.ca_bundle)
            .field("expiration", &self.expiration)
            .finish()
    }
}

impl S3Config {
    /// A configuration for an S3-compatible server at `endpoint` with these credentials.
    pub fn with_endpoint(endpoint: &str, access_key_id: &str, secret_access_key: &str, region: &str) -> S3Config {
        S3Config {
            access_key_id: access_key_id.into(),
            secret_access_key: secret_access_key.into(),
            session_token: None,
            region: region.into(),
            endpoint: Some(endpoint.into()),
            credentials_from: "the caller".into(),
            ca_bundle: None,
            expiration: None,
        }
    }

    /// Reads the process environment and `$HOME/.aws` (see [`S3Config`]), once per
    /// process: later calls give the first call's configuration or error again, so a
    /// command that opens S3 twice (a copy from S3 to S3, a writer and its abort) runs a
    /// `credential_process` (which may prompt for an MFA code), STS or the instance
    /// metadata service once.
    pub fn from_env() -> Result<S3Config, S3Error> {
        static LOADED: std::sync::OnceLock<Result<S3Config, String>> = std::sync::OnceLock::new();
        let loaded = LOADED.get_or_init(|| {
            let home = std::env::var_os("HOME").map(PathBuf::from);
            S3Config::load(&|name| std::env::var(name).ok(), home.as_deref()).map_err(|e| match e {
                S3Error::Config(m) => m,
                e => e.to_string(),
            })
        });
        loaded.clone().map_err(S3Error::Config)
    }

    /// As [`S3Config::from_env`], with the environment given as a lookup function and the
    /// home directory as a path, so tests need not change the process's environment.
    /// Empty variables count as unset. Where the chain gets to them, this runs
    /// `credential_process` and asks STS or the instance metadata service.
    pub fn load(env: &dyn Fn(&str) -> Option<String>, home: Option<&Path>) -> Result<S3Config, S3Error> {
        let var = |name: &str| env(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let profile = var("AWS_PROFILE").unwrap_or_else(|| "default".into());
        let aws_dir = home.map(|h| h.join(".aws"));
        let cred_path = var("AWS_SHARED_CREDENTIALS_FILE")
            .map(PathBuf::from)
            .or_else(|| aws_dir.as_ref().map(|d| d.join("credentials")));
        let conf_path =
            var("AWS_CONFIG_FILE").map(PathBuf::from).or_else(|| aws_dir.as_ref().map(|d| d.join("config")));
        let cred_file = cred_path.as_deref().map(read_ini).transpose()?.flatten();
        let conf_file = conf_path.as_deref().map(read_ini).transpose()?.flatten();
        // [NAME] in credentials; [profile NAME] in config, where the default profile is [default].
        let cred_section = cred_file.as_ref().and_then(|f| f.section(&profile));
        let conf_section = conf_file.as_ref().and_then(|f| {
            f.section(&format!("profile {profile}")).or_else(|| {
                if profile == "default" {
                    f.section("default")
                } else {
                    None
                }
            })
        });
        if profile != "default" && var("AWS_PROFILE").is_some() && cred_section.is_none() && conf_section.is_none() {
            return Err(S3Error::Config(format!(
                "AWS_PROFILE names the profile {profile:?}, which is neither [{profile}] in {} nor [profile {profile}] in {}: \
                 fix AWS_PROFILE or add the profile",
                shown(cred_path.as_deref()),
                shown(conf_path.as_deref())
            )));
        }
        let from_profile = |key: &str| {
            cred_section.and_then(|s| s.get(key)).or_else(|| conf_section.and_then(|s| s.get(key))).map(str::to_string)
        };
        let from_config = |key: &str| conf_section.and_then(|s| s.get(key)).map(str::to_string);
        let region = var("AWS_REGION")
            .or_else(|| var("AWS_DEFAULT_REGION"))
            .or_else(|| from_config("region"))
            .unwrap_or_else(|| "us-east-1".into());
        if region.is_empty() || !region.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            return Err(S3Error::Config(format!("the region {region:?} is not a region name (such as eu-west-1)")));
        }
        let ca_bundle = var("AWS_CA_BUNDLE").or_else(|| from_config("ca_bundle")).map(PathBuf::from);
        let config_place = if profile == "default" { "[default]".to_string() } else { format!("[profile {profile}]") };

        // The AWS SDKs' default chain, in order; each source not set up says so in `tried`,
        // for the error when none gives credentials. A source set up that fails is an
        // error at once (as in the SDKs): falling through would hide its reason.
        let mut tried: Vec<String> = Vec::new();
        let found: Found = 'chain: {
            // 1. The environment.
            match (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
                (Some(key), Some(secret)) => {
                    break 'chain Found::fixed(key, secret, var("AWS_SESSION_TOKEN"), "the environment".into())
                }
                (Some(_), None) | (None, Some(_)) => {
                    return Err(S3Error::Config(
                        "only one of AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY is set: set both, or neither to use \
                         the other credential sources"
                            .into(),
                    ))
                }
                (None, None) => {
                    tried.push("the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY): not set".into())
                }
            }
            // 2. A web identity token (as Kubernetes gives a pod: IRSA).
            let env_web = var("AWS_WEB_IDENTITY_TOKEN_FILE").is_some() || var("AWS_ROLE_ARN").is_some();
            let (token_file, role_arn, session, web_from) = if env_web {
                (
                    var("AWS_WEB_IDENTITY_TOKEN_FILE"),
                    var("AWS_ROLE_ARN"),
                    var("AWS_ROLE_SESSION_NAME"),
                    "AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN".to_string(),
                )
            } else {
                (
                    from_config("web_identity_token_file"),
                    from_config("role_arn"),
                    from_config("role_session_name"),
                    format!(
                        "web_identity_token_file and role_arn of {config_place} in {}",
                        shown(conf_path.as_deref())
                    ),
                )
            };
            match (token_file, role_arn) {
                (Some(file), Some(arn)) => {
                    let session = session.unwrap_or_else(|| format!("ferry-{}", jiff::Timestamp::now().as_second()));
                    let sts = var("AWS_ENDPOINT_URL_STS")
                        .or_else(|| var("AWS_ENDPOINT_URL"))
                        .unwrap_or_else(|| sts_endpoint(&region));
                    let f = credentials::web_identity(Path::new(&file), &arn, &session, &sts, ca_bundle.as_deref())?;
                    break 'chain Found::fetched(f, format!("web identity ({web_from}; role {arn})"));
                }
                // A role ARN alone is not web identity: on to the next (a profile's role_arn,
                // an assumed role, is refused below, after its keys and credential_process).
                (None, Some(_)) => tried.push(format!("web identity ({web_from}): no token file")),
                (Some(_), None) => {
                    return Err(S3Error::Config(format!(
                        "web identity: a token file is set but no role ARN ({web_from}): set the role to assume"
                    )))
                }
                (None, None) => tried.push(format!(
                    "web identity (AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN, or {web_from}): not set"
                )),
            }
            // 3. The profile's keys, in the credentials file, then the config file.
            match (from_profile("aws_access_key_id"), from_profile("aws_secret_access_key")) {
                (Some(key), Some(secret)) => {
                    let place = match cred_section.and_then(|s| s.get("aws_access_key_id")) {
                        Some(_) => format!("profile {profile} in {}", shown(cred_path.as_deref())),
                        None => format!("profile {profile} in {}", shown(conf_path.as_deref())),
                    };
                    break 'chain Found::fixed(key, secret, from_profile("aws_session_token"), place);
                }
                (Some(_), None) | (None, Some(_)) => {
                    return Err(S3Error::Config(format!(
                        "profile {profile} has only one of aws_access_key_id and aws_secret_access_key \
                         (in {} / {}): give it both",
                        shown(cred_path.as_deref()),
                        shown(conf_path.as_deref())
                    )))
                }
                (None, None) => {
                    tried.push(format!("[{profile}] of {}: no aws_access_key_id", shown(cred_path.as_deref())));
                    tried.push(format!("{config_place} of {}: no aws_access_key_id", shown(conf_path.as_deref())));
                }
            }
            // 4. The profile's credential_process.
            match from_profile("credential_process") {
                Some(command) => {
                    let f = credentials::process(&command, &profile)?;
                    break 'chain Found::fetched(f, format!("credential_process of profile {profile}"));
                }
                None => tried.push(format!("credential_process of profile {profile}: not set")),
            }
            // A profile that says to assume a role (role_arn with source_profile or
            // credential_source) or to sign in with SSO has no keys of its own: the SDKs
            // assume the role or fail, and never use another identity, so neither does ferry.
            let keys: Vec<&str> = cred_section.iter().chain(conf_section.iter()).flat_map(|s| s.keys()).collect();
            if let Some(what) = unsupported_profile_source(&from_profile, &keys) {
                return Err(S3Error::Config(format!(
                    "profile {profile} (in {} or {}) gets its credentials {what}, which ferry does not support yet \
                     (and it does not run as another identity, such as the EC2 instance's role, instead): export the \
                     credentials first, \
                     e.g. `eval \"$(aws configure export-credentials --profile {profile} --format env)\"`, or give \
                     the profile a credential_process",
                    shown(cred_path.as_deref()),
                    shown(conf_path.as_deref())
                )));
            }
            // An ECS task's (or EKS Pod Identity's) own credentials come from the container
            // endpoint these name; ferry does not fetch them yet, and must not run as the
            // instance's role instead.
            for v in ["AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"] {
                if var(v).is_some() {
                    return Err(S3Error::Config(format!(
                        "{v} is set: this process has container credentials (an ECS task role or EKS Pod \
                         Identity), which ferry does not fetch yet (and it does not run as the EC2 instance's \
                         role instead): export them first, e.g. `eval \"$(aws configure export-credentials \
                         --format env)\"`"
                    )));
                }
            }
            // 5. The EC2 instance metadata service.
            let imds = var("AWS_EC2_METADATA_SERVICE_ENDPOINT")
                .or_else(|| from_config("ec2_metadata_service_endpoint"))
                .unwrap_or_else(|| match var("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE") {
                    Some(m) if m.eq_ignore_ascii_case("ipv6") => "http://[fd00:ec2::254]".into(),
                    _ => "http://169.254.169.254".into(),
                });
            if var("AWS_EC2_METADATA_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
                tried.push(format!("the EC2 instance metadata service at {imds}: off (AWS_EC2_METADATA_DISABLED)"));
            } else {
                match credentials::imds(&imds)? {
                    Ok(f) => break 'chain Found::fetched(f, format!("the EC2 instance metadata service at {imds}")),
                    Err(why) => tried.push(format!("the EC2 instance metadata service at {imds}: {why}")),
                }
            }
            let list: Vec<String> = tried.iter().enumerate().map(|(i, t)| format!("{}. {t}", i + 1)).collect();
            return Err(S3Error::Config(format!(
                "no S3 credentials; tried, in order: {}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, run \
                 `aws configure`, or set up one of the other sources",
                list.join("; ")
            )));
        };
        let Found { access_key_id, secret_access_key, session_token, expiration, credentials_from } = found;
        log::debug!("S3 credentials from {credentials_from}: access key ID {access_key_id}");
        if let Some(t) = expiration {
            log::info!(
                "the S3 credentials from {credentials_from} are temporary and expire at {t}: a copy still running \
                 then fails (ferry gets credentials once, at the start)"
            );
        }
        let (endpoint, endpoint_from) = match (var("AWS_ENDPOINT_URL_S3"), var("AWS_ENDPOINT_URL")) {
            (Some(e), _) => (Some(e), "AWS_ENDPOINT_URL_S3".to_string()),
            (None, Some(e)) => (Some(e), "AWS_ENDPOINT_URL".to_string()),
            (None, None) => (
                conf_section.and_then(|s| s.get("endpoint_url")).map(str::to_string),
                format!("endpoint_url of profile {profile} in {}", shown(conf_path.as_deref())),
            ),
        };
        if let Some(e) = &endpoint {
            check_endpoint(e).map_err(|why| {
                let shown = if e.contains('@') { "(not shown: it holds an '@')".to_string() } else { format!("{e:?}") };
                S3Error::Config(format!("{endpoint_from} = {shown}: {why}"))
            })?;
        }
        Ok(S3Config {
            access_key_id,
            secret_access_key,
            session_token,
            region,
            endpoint,
            credentials_from,
            ca_bundle,
            expiration,
        })
    }
}

/// Credentials as a source gave them.
struct Found {
    access_key_id: String,
    secret_access_key: String,
    session_token: Option<String>,
    expiration: Option<jiff::Timestamp>,
    credentials_from: String,
}

impl Found {
    fn fixed(key: String, secret: String, token: Option<String>, from: String) -> Found {
        Found {
            access_key_id: key,
            secret_access_key: secret,
            session_token: token,
            expiration: None,
            credentials_from: from,
        }
    }
    fn fetched(f: credentials::Fetched, from: String) -> Found {
        Found {
            access_key_id: f.key,
            secret_access_key: f.secret,
            session_token: f.token,
            expiration: f.expiration,
            credentials_from: from,
        }
    }
}

/// `http` with the CA bundle of `cfg` (`AWS_CA_BUNDLE`, the profile's `ca_bundle`) as
/// its trust, unless `http` names one already (`--ca` wins, as `--ca-bundle` does in
/// the AWS CLI).
pub(crate) fn http_with_ca(cfg: &S3Config, http: &ferry_http::HttpOptions) -> ferry_http::HttpOptions {
    let mut h = http.clone();
    if h.ca.is_none() {
        h.ca.clone_from(&cfg.ca_bundle);
    }
    h
}

/// Why `endpoint` cannot be an S3 endpoint, if it cannot.
pub(crate) fn check_endpoint(endpoint: &str) -> Result<url::Url, String> {
    let u = url::Url::parse(endpoint).map_err(|e| format!("not a URL ({e}); write http(s)://HOST[:PORT]"))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err("the endpoint must be an http:// or https:// URL".into());
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err("the endpoint has no host".into());
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err("the endpoint must not carry credentials: use AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY".into());
    }
    Ok(u)
}

/// STS's regional endpoint: China's regions (`cn-*`) are under `amazonaws.com.cn`.
pub(crate) fn sts_endpoint(region: &str) -> String {
    match region.starts_with("cn-") {
        true => format!("https://sts.{region}.amazonaws.com.cn"),
        false => format!("https://sts.{region}.amazonaws.com"),
    }
}

/// How a profile without keys, credential_process or web identity says to get
/// credentials, where ferry does not do it: an assumed role (`role_arn`, with
/// `source_profile` or `credential_source`) or AWS IAM Identity Center (`sso_*` keys).
fn unsupported_profile_source(get: &dyn Fn(&str) -> Option<String>, keys: &[&str]) -> Option<String> {
    if let Some(arn) = get("role_arn") {
        let via = match (get("source_profile"), get("credential_source")) {
            (Some(p), _) => format!(" with the credentials of profile {p}"),
            (None, Some(c)) => format!(" with the credentials of {c}"),
            (None, None) => String::new(),
        };
        return Some(format!("by assuming the role {arn}{via} (role_arn)"));
    }
    if let Some(c) = get("credential_source") {
        return Some(format!("from {c} (credential_source)"));
    }
    let sso: Vec<&str> = keys.iter().copied().filter(|k| k.to_ascii_lowercase().starts_with("sso_")).collect();
    if !sso.is_empty() {
        return Some(format!("by AWS IAM Identity Center sign-in ({})", sso.join(", ")));
    }
    None
}

fn shown(p: Option<&Path>) -> String {
    match p {
        Some(p) => p.display().to_string(),
        None => "(no home directory)".into(),
    }
}

/// An INI file as the AWS CLI writes it: `[section]`, `key = value`, `#`/`;` comments;
/// the indented sub-keys of a nested setting (`s3 =` then indented lines) are skipped.
#[derive(Debug, Default)]
pub(crate) struct Ini {
    sections: Vec<(String, Vec<(String, String)>)>,
}

#[derive(Clone, Copy)]
pub(crate) struct Section<'a>(&'a [(String, String)]);

impl<'a> Section<'a> {
    pub(crate) fn keys(self) -> impl Iterator<Item = &'a str> {
        self.0.iter().map(|(k, _)| k.as_str())
    }

    pub(crate) fn get(self, key: &str) -> Option<&'a str> {
        self.0.iter().rev().find(|(k, _)| k.eq_ignore_ascii_case(key)).map(|(_, v)| v.as_str())
    }
}

impl Ini {
    pub(crate) fn parse(text: &str) -> Ini {
        let mut ini = Ini::default();
        let mut nested = false;
        for line in text.lines() {
            let indented = line.starts_with([' ', '\t']);
            let line = line.trim();
            if line.is_empty() || line.starts_with(['#', ';']) {
                continue;
            }
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                let name = name.split_whitespace().collect::<Vec<_>>().join(" ");
                ini.sections.push((name, Vec::new()));
                nested = false;
                continue;
            }
            if indented && nested {
                continue;
            }
            let Some((k, v)) = line.split_once('=') else { continue };
            let (k, v) = (k.trim(), v.trim());
            nested = v.is_empty();
            if let Some((_, entries)) = ini.sections.last_mut() {
                if !nested {
                    entries.push((k.to_string(), v.to_string()));
                }
            }
        }
        ini
    }

    pub(crate) fn section(&self, name: &str) -> Option<Section<'_>> {
        self.sections.iter().rev().find(|(n, _)| n == name).map(|(_, e)| Section(e))
    }
}

/// The file parsed, `None` when it does not exist.
fn read_ini(path: &Path) -> Result<Option<Ini>, S3Error> {
    let err = |e: std::io::Error| S3Error::Config(format!("cannot read {}: {e}", path.display()));
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(err(e)),
    };
    if meta.len() > MAX_FILE_BYTES {
        return Err(S3Error::Config(format!(
            "{} is {} bytes; an AWS config or credentials file is expected to be under {MAX_FILE_BYTES}",
            path.display(),
            meta.len()
        )));
    }
    let text = std::fs::read_to_string(path).map_err(err)?;
    Ok(Some(Ini::parse(&text)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn load(vars: &[(&str, &str)], home: Option<&Path>) -> Result<S3Config, S3Error> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        S3Config::load(&|k| map.get(k).cloned(), home)
    }

    fn home_with(credentials: &str, config: &str) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join(".aws")).unwrap();
        std::fs::write(d.path().join(".aws/credentials"), credentials).unwrap();
        std::fs::write(d.path().join(".aws/config"), config).unwrap();
        d
    }

    #[test]
    fn the_environment_comes_first() {
        let home = home_with("[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = filesecret\n", "");
        let c = load(
            &[
                ("AWS_ACCESS_KEY_ID", "ENVKEY"),
                ("AWS_SECRET_ACCESS_KEY", "envsecret"),
                ("AWS_SESSION_TOKEN", "tok"),
                ("AWS_DEFAULT_REGION", "eu-west-3"),
                ("AWS_ENDPOINT_URL", "http://127.0.0.1:9000"),
            ],
            Some(home.path()),
        )
        .unwrap();
        assert_eq!((c.access_key_id.as_str(), c.secret_access_key.as_str()), ("ENVKEY", "envsecret"));
        assert_eq!(c.session_token.as_deref(), Some("tok"));
        assert_eq!(c.region, "eu-west-3");
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(c.credentials_from, "the environment");
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("envsecret") && !dbg.contains("tok\""), "{dbg}");
        // AWS_REGION beats AWS_DEFAULT_REGION; the S3-specific endpoint beats the general one.
        let c = load(
            &[
                ("AWS_ACCESS_KEY_ID", "K"),
                ("AWS_SECRET_ACCESS_KEY", "S"),
                ("AWS_REGION", "ap-south-1"),
                ("AWS_DEFAULT_REGION", "eu-west-3"),
                ("AWS_ENDPOINT_URL", "http://a:1"),
                ("AWS_ENDPOINT_URL_S3", "https://b:2/prefix"),
            ],
            None,
        )
        .unwrap();
        assert_eq!(c.region, "ap-south-1");
        assert_eq!(c.endpoint.as_deref(), Some("https://b:2/prefix"));
        let c = load(&[("AWS_ACCESS_KEY_ID", "K"), ("AWS_SECRET_ACCESS_KEY", "S")], None).unwrap();
        assert_eq!((c.region.as_str(), c.endpoint), ("us-east-1", None));
    }

    #[test]
    fn profiles_from_the_shared_files() {
        let home = home_with(
            "# comment\n[default]\naws_access_key_id = DEFKEY\naws_secret_access_key = defsecret\n\n\
             [work]\naws_access_key_id=WORKKEY\naws_secret_access_key=worksecret\naws_session_token = wtok\n",
            "[default]\nregion = eu-central-1\n\n[profile work]\nregion = us-west-2\ns3 =\n  endpoint_url = http://nested:1\n\
             endpoint_url = http://127.0.0.1:7480\n[profile cfgonly]\naws_access_key_id = CK\naws_secret_access_key = CS\n",
        );
        let c = load(&[], Some(home.path())).unwrap();
        assert_eq!(
            (c.access_key_id.as_str(), c.region.as_str(), c.endpoint.as_deref()),
            ("DEFKEY", "eu-central-1", None)
        );
        assert!(c.credentials_from.contains(".aws/credentials"), "{}", c.credentials_from);
        let c = load(&[("AWS_PROFILE", "work")], Some(home.path())).unwrap();
        assert_eq!(c.access_key_id, "WORKKEY");
        assert_eq!(c.secret_access_key, "worksecret");
        assert_eq!(c.session_token.as_deref(), Some("wtok"));
        assert_eq!(c.region, "us-west-2");
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:7480"), "nested s3 keys are skipped");
        let c = load(&[("AWS_PROFILE", "cfgonly")], Some(home.path())).unwrap();
        assert_eq!(c.access_key_id, "CK");
        assert!(c.credentials_from.contains(".aws/config"));
        // The region variable beats the profile's.
        let c = load(&[("AWS_PROFILE", "work"), ("AWS_REGION", "sa-east-1")], Some(home.path())).unwrap();
        assert_eq!(c.region, "sa-east-1");
        let e = load(&[("AWS_PROFILE", "nope")], Some(home.path())).unwrap_err().to_string();
        assert!(e.contains("\"nope\"") && e.contains(".aws/credentials"), "{e}");
    }

    #[test]
    fn file_paths_can_be_moved() {
        let d = tempfile::tempdir().unwrap();
        let cred = d.path().join("c");
        let conf = d.path().join("f");
        std::fs::write(&cred, "[p]\naws_access_key_id = MK\naws_secret_access_key = MS\n").unwrap();
        std::fs::write(&conf, "[profile p]\nregion = eu-north-1\n").unwrap();
        let c = load(
            &[
                ("AWS_PROFILE", "p"),
                ("AWS_SHARED_CREDENTIALS_FILE", cred.to_str().unwrap()),
                ("AWS_CONFIG_FILE", conf.to_str().unwrap()),
            ],
            None,
        )
        .unwrap();
        assert_eq!((c.access_key_id.as_str(), c.region.as_str()), ("MK", "eu-north-1"));
    }

    #[test]
    fn missing_or_half_credentials_say_where_they_were_looked_for() {
        let home = home_with("", "");
        let e = load(&[], Some(home.path())).unwrap_err().to_string();
        assert!(e.contains("AWS_ACCESS_KEY_ID") && e.contains(".aws/credentials") && e.contains(".aws/config"), "{e}");
        let e = load(&[("AWS_ACCESS_KEY_ID", "K")], None).unwrap_err().to_string();
        assert!(e.contains("only one of"), "{e}");
        let home = home_with("[default]\naws_secret_access_key = hidden\n", "");
        let e = load(&[], Some(home.path())).unwrap_err().to_string();
        assert!(e.contains("only one of") && !e.contains("hidden"), "{e}");
    }

    #[test]
    fn bad_endpoints_and_regions_are_refused() {
        let base = [("AWS_ACCESS_KEY_ID", "K"), ("AWS_SECRET_ACCESS_KEY", "S")];
        for (ep, why) in [("ftp://x", "http://"), ("localhost:9000", "URL"), ("http://u:p@h", "credentials")] {
            let mut v = base.to_vec();
            v.push(("AWS_ENDPOINT_URL", ep));
            let e = load(&v, None).unwrap_err().to_string();
            assert!(e.contains("AWS_ENDPOINT_URL") && e.contains(why) && !e.contains("u:p"), "{ep}: {e}");
        }
        let mut v = base.to_vec();
        v.push(("AWS_REGION", "eu west"));
        assert!(load(&v, None).unwrap_err().to_string().contains("region"));
    }
}
