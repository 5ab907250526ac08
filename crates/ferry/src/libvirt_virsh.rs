//! What `ferry backup libvirt:` and `ferry restore` ask of libvirt, behind one small
//! interface ([`Hypervisor`]), and its implementation by `virsh` ([`Virsh`]).
//!
//! Why `virsh` and not the libvirt project's Rust binding (`virt`): the binding links
//! libvirt.so and needs its headers to build, so it would sit behind a cargo feature and
//! a default `cargo build` (or a ferry built without it) could not back up a VM at all;
//! `virsh` is in libvirt-clients, which every host that runs libvirt has, speaks every
//! URI and authentication libvirt's client config knows (qemu+ssh://, polkit, SASL), and
//! its errors are libvirt's own words. The cost is a process per call (a few per backup,
//! none per chunk) and parsing libvirt's XML, which ferry does either way. Swapping in the
//! binding later means one more `impl Hypervisor`.

use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

/// The libvirt calls of a VM backup and restore.
pub(crate) trait Hypervisor {
    /// The domain's XML: its live definition, or with `inactive` the persistent one.
    fn domain_xml(&self, domain: &str, inactive: bool) -> Result<String>;
    /// The domain's state as virsh domstate says it (`running`, `paused`, `shut off`...).
    fn state(&self, domain: &str) -> Result<String>;
    /// The names of the domain's checkpoints.
    fn checkpoints(&self, domain: &str) -> Result<Vec<String>>;
    /// One checkpoint's XML.
    fn checkpoint_xml(&self, domain: &str, name: &str) -> Result<String>;
    fn checkpoint_delete(&self, domain: &str, name: &str) -> Result<()>;
    /// Starts a backup job (`backup` a `<domainbackup>`, `checkpoint` the
    /// `<domaincheckpoint>` it creates at the same instant); files are written in `dir`.
    fn backup_begin(&self, domain: &str, backup: &str, checkpoint: &str, dir: &Path) -> Result<()>;
    /// The running backup job's XML, if the domain has one.
    fn backup_xml(&self, domain: &str) -> Result<Option<String>>;
    /// Ends the domain's running job (a pull-mode backup ends this way).
    fn job_abort(&self, domain: &str) -> Result<()>;
    /// Defines a domain from XML (written in `dir`).
    fn define(&self, xml: &str, dir: &Path) -> Result<()>;
    /// Freezes (`true`) or thaws the guest's file systems through its agent.
    fn freeze(&self, domain: &str, freeze: bool) -> Result<()>;
    /// Where the domains are: this host, unless the connection is to another.
    fn host(&self) -> Host {
        Host::This
    }
}

/// The host of a libvirt connection's domains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Host {
    This,
    /// Another host, by the name the connection gives it (`None` for an alias URI).
    Other(Option<String>),
}

/// The file `define` writes the XML to, in the directory it is given.
pub(crate) const DEFINE_FILE: &str = ".ferry-define.xml";

/// libvirt through the `virsh` command.
pub(crate) struct Virsh {
    /// The connection: --connect, else LIBVIRT_DEFAULT_URI; `None` leaves it to virsh
    /// (its own default: libvirt.conf's uri_default, else qemu:///system for root).
    uri: Option<String>,
}

/// Whether a libvirt URI names another host, or is an alias that cannot be told from one:
/// a transport other than unix (`qemu+ssh://`, `+tcp`, `+tls`, `+libssh2`...) or a host
/// (`qemu://host/system`).
pub(crate) fn remote_uri(uri: &str) -> bool {
    let Some((scheme, rest)) = uri.split_once("://") else { return true };
    let transport = scheme.split_once('+').map(|(_, t)| t);
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = host.split(':').next().unwrap_or("");
    transport.is_some_and(|t| t != "unix") || !(host.is_empty() || host == "localhost")
}

/// The host a remote libvirt URI names (`qemu+ssh://user@host:22/system` names `host`);
/// `None` for an alias or a URI without one.
pub(crate) fn uri_host(uri: &str) -> Option<String> {
    let (_, rest) = uri.split_once("://")?;
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.split(':').next().unwrap_or(""),
    };
    (!host.is_empty()).then(|| host.to_string())
}

impl Virsh {
    /// libvirt at `uri` (--connect), else LIBVIRT_DEFAULT_URI, else virsh's default; a
    /// connection to another host is refused: ferry reads a restored copy's files on this
    /// host.
    pub(crate) fn new(uri: Option<&str>) -> Result<Virsh> {
        let v = Virsh::any_host(uri);
        if let Some(u) = v.uri.as_deref().filter(|u| remote_uri(u)) {
            bail!(
                "the libvirt connection {u:?} is not of this host (or is an alias ferry cannot check): ferry writes \
                 the restored disks on the host it runs on, so run ferry on the domain's host with a local \
                 connection (qemu:///system)"
            );
        }
        Ok(v)
    }

    /// libvirt at `uri` (--connect), else LIBVIRT_DEFAULT_URI, else virsh's default, on this
    /// host or another.
    pub(crate) fn any_host(uri: Option<&str>) -> Virsh {
        let uri = uri.map(String::from).or_else(|| std::env::var("LIBVIRT_DEFAULT_URI").ok().filter(|u| !u.is_empty()));
        Virsh { uri }
    }

    /// The connection, as errors name it.
    fn shown(&self) -> &str {
        self.uri.as_deref().unwrap_or("the default libvirt connection")
    }

    /// `virsh [-c URI] -q ARGS`, in the C locale (its words are parsed).
    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new("virsh");
        if let Some(u) = &self.uri {
            c.arg("-c").arg(u);
        }
        c.arg("-q").args(args).env("LC_ALL", "C").env_remove("LANGUAGE");
        c
    }

    /// Runs `virsh [-c URI] -q ARGS`; its standard output.
    fn run(&self, args: &[&str]) -> Result<String> {
        let out = self.command(args).output().context("cannot run virsh (install libvirt-clients)")?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let err = err.trim().trim_start_matches("error: ").replace("\nerror: ", ": ");
            bail!("virsh {} on {}: {err}", args.first().unwrap_or(&""), self.shown());
        }
        String::from_utf8(out.stdout).context("virsh printed bytes that are not UTF-8")
    }

    fn write(dir: &Path, name: &str, text: &str) -> Result<String> {
        let p = dir.join(name);
        std::fs::write(&p, text).with_context(|| format!("cannot write {}", p.display()))?;
        Ok(p.to_string_lossy().into_owned())
    }
}

impl Hypervisor for Virsh {
    fn domain_xml(&self, domain: &str, inactive: bool) -> Result<String> {
        let mut a = vec!["dumpxml", "--domain", domain];
        if inactive {
            a.push("--inactive");
        }
        self.run(&a).map_err(|e| {
            let text = format!("{e:#}");
            let c = self.uri.as_deref().map(|u| format!("-c {u} ")).unwrap_or_default();
            match text.contains("failed to get domain") || text.contains("Domain not found") {
                true => e.context(format!(
                    "no domain {domain:?} on {}: `virsh {c}list --all` lists the domains there",
                    self.shown()
                )),
                false => e.context(format!(
                    "cannot read the domain {domain:?} from libvirt at {} (is libvirtd running, and is --connect \
                     right?)",
                    self.shown()
                )),
            }
        })
    }

    fn state(&self, domain: &str) -> Result<String> {
        Ok(self.run(&["domstate", "--domain", domain])?.trim().to_string())
    }

    fn checkpoints(&self, domain: &str) -> Result<Vec<String>> {
        let out = self.run(&["checkpoint-list", "--domain", domain, "--name"])?;
        Ok(out.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect())
    }

    fn checkpoint_xml(&self, domain: &str, name: &str) -> Result<String> {
        self.run(&["checkpoint-dumpxml", "--domain", domain, "--checkpointname", name, "--no-domain"])
    }

    fn checkpoint_delete(&self, domain: &str, name: &str) -> Result<()> {
        self.run(&["checkpoint-delete", "--domain", domain, "--checkpointname", name]).map(drop)
    }

    fn backup_begin(&self, domain: &str, backup: &str, checkpoint: &str, dir: &Path) -> Result<()> {
        let b = Self::write(dir, "backup.xml", backup)?;
        let c = Self::write(dir, "checkpoint.xml", checkpoint)?;
        self.run(&["backup-begin", "--domain", domain, "--backupxml", &b, "--checkpointxml", &c]).map(drop)
    }

    fn backup_xml(&self, domain: &str) -> Result<Option<String>> {
        match self.run(&["backup-dumpxml", "--domain", domain]) {
            Ok(x) => Ok(Some(x)),
            Err(e) if format!("{e:#}").contains("no domain backup job") => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn job_abort(&self, domain: &str) -> Result<()> {
        self.run(&["domjobabort", "--domain", domain]).map(drop)
    }

    fn define(&self, xml: &str, dir: &Path) -> Result<()> {
        let f = Self::write(dir, DEFINE_FILE, xml)?;
        self.run(&["define", "--file", &f]).map(drop)
    }

    fn freeze(&self, domain: &str, freeze: bool) -> Result<()> {
        let cmd = if freeze { "domfsfreeze" } else { "domfsthaw" };
        self.run(&[cmd, "--domain", domain]).map(drop).with_context(|| {
            format!(
                "--quiesce: the guest agent of {domain} did not {}: install and start qemu-guest-agent in the guest \
                 (and give the domain its channel), or back up without --quiesce",
                if freeze { "freeze its file systems" } else { "thaw its file systems" }
            )
        })
    }

    fn host(&self) -> Host {
        match self.uri.as_deref().filter(|u| remote_uri(u)) {
            None => Host::This,
            Some(u) => Host::Other(uri_host(u)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_connections_are_told_from_local_ones() {
        for local in ["qemu:///system", "qemu:///session", "qemu+unix:///system?socket=/x", "qemu://localhost/system"] {
            assert!(!remote_uri(local), "{local}");
        }
        for remote in [
            "qemu+ssh://root@host/system",
            "qemu+tcp://host/system",
            "qemu+tls://host:16514/system",
            "qemu://host/system",
            "qemu+libssh2://u@h/system",
            "myalias",
        ] {
            assert!(remote_uri(remote), "{remote}");
        }
        assert!(Virsh::new(Some("qemu+ssh://h/system")).is_err());
        let host = |u: &str| Virsh::any_host(Some(u)).host();
        assert_eq!(host("qemu+ssh://root@kvm1.example:2222/system"), Host::Other(Some("kvm1.example".into())));
        assert_eq!(host("qemu+tls://[fd00::1]:16514/system"), Host::Other(Some("fd00::1".into())));
        assert_eq!(host("myalias"), Host::Other(None));
        assert_eq!(host("qemu:///system"), Host::This);
    }

    #[test]
    fn virsh_runs_in_the_c_locale_and_names_a_connection_only_when_given() {
        let v = Virsh { uri: None };
        let c = v.command(&["domstate", "--domain", "d"]);
        assert_eq!(c.get_args().collect::<Vec<_>>(), ["-q", "domstate", "--domain", "d"]);
        assert!(c.get_envs().any(|(k, v)| k == "LC_ALL" && v == Some("C".as_ref())));
        let v = Virsh { uri: Some("qemu:///session".into()) };
        let c = v.command(&["list"]);
        assert_eq!(c.get_args().collect::<Vec<_>>(), ["-c", "qemu:///session", "-q", "list"]);
    }
}
