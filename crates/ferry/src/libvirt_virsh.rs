//! What `ferry backup libvirt:` and `ferry restore` ask of libvirt, behind one small
//! interface ([`Hypervisor`]), and its implementation by `virsh` ([`Virsh`]).
//!
//! Why `virsh` and not the libvirt project's Rust binding (`virt`): the binding links
//! libvirt.so, found through pkg-config when it is built (libvirt-dev), so it would sit behind a cargo feature and
//! a default `cargo build` (or a ferry built without it) could not back up a VM at all;
//! `virsh` is in libvirt-clients, which every host that runs libvirt has, speaks every
//! URI and authentication libvirt's client config knows (qemu+ssh://, polkit, SASL), and
//! its errors are libvirt's own words. The cost is a process start per call (none per
//! chunk), which was most of a day's time; so the questions a run asks together go to one
//! process ([`Virsh::batch`]): seven processes for an incremental day of two disks, not
//! eleven. Swapping in the binding later means one more `impl Hypervisor`.

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

    /// What a backup asks of the domain first, each answer or its error: its live and
    /// persistent XML, state, running backup job and checkpoints. [`Virsh`] asks in one
    /// process.
    fn survey(&self, domain: &str) -> Survey {
        Survey {
            live: self.domain_xml(domain, false),
            state: self.state(domain),
            inactive: self.domain_xml(domain, true),
            job: self.backup_xml(domain),
            checkpoints: self.checkpoints(domain),
        }
    }

    /// The XML of each of the checkpoints `names`, or its error (one process for all with
    /// [`Virsh`]).
    fn checkpoint_xmls(&self, domain: &str, names: &[&str]) -> Vec<Result<String>> {
        names.iter().map(|n| self.checkpoint_xml(domain, n)).collect()
    }
}

/// The host of a libvirt connection's domains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Host {
    This,
    /// Another host, by the name the connection gives it (`None` for an alias URI).
    Other(Option<String>),
}

/// A domain as a backup finds it ([`Hypervisor::survey`]).
pub(crate) struct Survey {
    pub live: Result<String>,
    pub state: Result<String>,
    pub inactive: Result<String>,
    pub job: Result<Option<String>>,
    pub checkpoints: Result<Vec<String>>,
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
        #[cfg(test)]
        let mut c = tests::FAKE_VIRSH.with_borrow(|f| match f.split_first() {
            Some((program, first)) => {
                let mut c = Command::new(program);
                c.args(first);
                c
            }
            None => Command::new("virsh"),
        });
        #[cfg(not(test))]
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
            bail!(self.failed(args, &String::from_utf8_lossy(&out.stderr)));
        }
        String::from_utf8(out.stdout).context("virsh printed bytes that are not UTF-8")
    }

    /// The error of `virsh ARGS`, from what it printed on standard error.
    fn failed(&self, args: &[&str], stderr: &str) -> String {
        let err = stderr.trim().trim_start_matches("error: ").replace("\nerror: ", ": ");
        format!("virsh {} on {}: {err}", args.first().unwrap_or(&""), self.shown())
    }

    /// Runs the commands `calls` in one virsh process (a virsh start costs more than most
    /// commands): one argument, the commands separated by `;`, each word single-quoted (a
    /// domain or file name is never read as a separator, a quote or a comment; a `'` in it
    /// is written `'\''`, as virsh's parser, like a shell's, reads it). virsh runs every
    /// command whatever the ones before did; after each, `echo` and `echo --err` print a
    /// mark (a random nonce and the command's number) on standard output and error, which
    /// split both streams by command: a command failed when its part of standard error
    /// holds an `error:` line. A virsh that reads none of it (one that lacks an option the
    /// line uses rejects it whole, before it runs any command: no first mark) has each
    /// command run alone. Each command's standard output, or its error.
    fn batch(&self, calls: &[Vec<&str>]) -> Result<Vec<Result<String>>> {
        if calls.is_empty() {
            return Ok(Vec::new());
        }
        let mut nonce = [0u8; 16];
        openssl::rand::rand_bytes(&mut nonce).context("cannot draw a random mark for virsh's output")?;
        let nonce: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
        let mark = |i: usize| format!("ferry-{nonce}-{i}");
        let quote = |w: &str| format!("'{}'", w.replace('\'', "'\\''"));
        let mut line = String::new();
        for (i, c) in calls.iter().enumerate() {
            let words: Vec<String> = c.iter().map(|w| quote(w)).collect();
            line.push_str(&format!("{} ; echo {m} ; echo --err {m} ; ", words.join(" "), m = mark(i)));
        }
        let out = self.command(&[&line]).output().context("cannot run virsh (install libvirt-clients)")?;
        let stdout = String::from_utf8(out.stdout).context("virsh printed bytes that are not UTF-8")?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        let (mut o, mut e) = (stdout.as_str(), &*stderr);
        let mut answers = Vec::new();
        for (i, c) in calls.iter().enumerate() {
            let m = mark(i);
            // `echo` ends its line only where virsh is not quiet; `echo --err` always.
            let (Some((out_i, o_rest)), Some((err_i, e_rest))) =
                (o.split_once(&m), e.split_once(&format!("error: {m}\n")))
            else {
                if i == 0 {
                    // virsh ran nothing of the line (or died at once): each command alone.
                    log::debug!("virsh ran no command of a batch ({}): running each alone", e.trim());
                    return Ok(calls.iter().map(|c| self.run(c)).collect());
                }
                // virsh stopped before this command's mark: this and the next ones failed.
                let why = self.failed(c, e.trim());
                answers.extend(calls[i..].iter().map(|_| Err(anyhow::anyhow!("{why}"))));
                break;
            };
            let failed = err_i.lines().any(|l| l.starts_with("error: "));
            answers.push(match failed {
                true => Err(anyhow::anyhow!(self.failed(c, err_i))),
                false => Ok(out_i.strip_prefix('\n').unwrap_or(out_i).to_string()),
            });
            (o, e) = (o_rest, e_rest);
        }
        Ok(answers)
    }

    fn write(dir: &Path, name: &str, text: &str) -> Result<String> {
        let p = dir.join(name);
        std::fs::write(&p, text).with_context(|| format!("cannot write {}", p.display()))?;
        Ok(p.to_string_lossy().into_owned())
    }
}

impl Virsh {
    /// `e`, a failure to read `domain`'s XML, with what to do.
    fn no_domain(&self, domain: &str, e: anyhow::Error) -> anyhow::Error {
        let text = format!("{e:#}");
        let c = self.uri.as_deref().map(|u| format!("-c {u} ")).unwrap_or_default();
        match text.contains("failed to get domain") || text.contains("Domain not found") {
            true => e.context(format!(
                "no domain {domain:?} on {}: `virsh {c}list --all` lists the domains there",
                self.shown()
            )),
            false => e.context(format!(
                "cannot read the domain {domain:?} from libvirt at {} (is libvirtd running, and is --connect right?)",
                self.shown()
            )),
        }
    }
}

/// `checkpoint-list --name`'s output: one name a line.
fn names(out: &str) -> Vec<String> {
    out.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect()
}

/// `backup-dumpxml`'s answer: the job's XML, `None` when the domain runs none.
fn job_of(answer: Result<String>) -> Result<Option<String>> {
    match answer {
        Ok(x) => Ok(Some(x)),
        Err(e) if format!("{e:#}").contains("no domain backup job") => Ok(None),
        Err(e) => Err(e),
    }
}

impl Hypervisor for Virsh {
    fn domain_xml(&self, domain: &str, inactive: bool) -> Result<String> {
        let mut a = vec!["dumpxml", "--domain", domain];
        if inactive {
            a.push("--inactive");
        }
        self.run(&a).map_err(|e| self.no_domain(domain, e))
    }

    fn survey(&self, domain: &str) -> Survey {
        let calls = vec![
            vec!["dumpxml", "--domain", domain],
            vec!["domstate", "--domain", domain],
            vec!["dumpxml", "--domain", domain, "--inactive"],
            vec!["backup-dumpxml", "--domain", domain],
            vec!["checkpoint-list", "--domain", domain, "--name"],
        ];
        let answers = match self.batch(&calls) {
            Ok(a) => a,
            Err(e) => calls.iter().map(|_| Err(anyhow::anyhow!("{e:#}"))).collect(),
        };
        let mut a = answers.into_iter();
        let mut next = || a.next().unwrap_or_else(|| Err(anyhow::anyhow!("virsh gave no answer")));
        let (live, state, inactive, job, checkpoints) = (next(), next(), next(), next(), next());
        Survey {
            live: live.map_err(|e| self.no_domain(domain, e)),
            state: state.map(|s| s.trim().to_string()),
            inactive,
            job: job_of(job),
            checkpoints: checkpoints.map(|c| names(&c)),
        }
    }

    fn checkpoint_xmls(&self, domain: &str, names: &[&str]) -> Vec<Result<String>> {
        let calls: Vec<Vec<&str>> = names
            .iter()
            .map(|n| vec!["checkpoint-dumpxml", "--domain", domain, "--checkpointname", n, "--no-domain"])
            .collect();
        match self.batch(&calls) {
            Ok(a) => a,
            Err(e) => calls.iter().map(|_| Err(anyhow::anyhow!("{e:#}"))).collect(),
        }
    }

    fn state(&self, domain: &str) -> Result<String> {
        Ok(self.run(&["domstate", "--domain", domain])?.trim().to_string())
    }

    fn checkpoints(&self, domain: &str) -> Result<Vec<String>> {
        self.run(&["checkpoint-list", "--domain", domain, "--name"]).map(|o| names(&o))
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
        job_of(self.run(&["backup-dumpxml", "--domain", domain]))
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

    /// Commands run in one virsh process answer as each run alone does, each error its
    /// own, whatever the words hold (libvirt's test driver, in virsh itself).
    #[test]
    fn commands_in_one_virsh_answer_each_as_alone() {
        let v = Virsh { uri: Some("test:///default".into()) };
        let odd = "no'such; domain \\ # $HOME \"x\"\nline";
        let calls = vec![
            vec!["domstate", "--domain", "test"],
            vec!["domstate", "--domain", odd],
            vec!["echo", odd],
            vec!["dumpxml", "--domain", "test"],
            vec!["domstate", "--domain", "test"],
        ];
        let answers = v.batch(&calls).unwrap();
        assert_eq!(answers.len(), calls.len());
        for (c, a) in calls.iter().zip(&answers) {
            match (v.run(c), a) {
                (Ok(alone), Ok(batched)) => assert_eq!(alone.trim_end(), batched.trim_end(), "{c:?}"),
                (Err(alone), Err(batched)) => assert_eq!(format!("{alone:#}"), format!("{batched:#}"), "{c:?}"),
                (alone, batched) => panic!("{c:?}: alone {alone:?}, batched {batched:?}"),
            }
        }
        assert_eq!(answers[0].as_ref().unwrap().trim(), "running");
        assert!(format!("{:#}", answers[1].as_ref().unwrap_err()).contains("no'such; domain"));
        assert_eq!(answers[2].as_ref().unwrap().trim_end(), odd, "one word, as given");
        assert!(answers[3].as_ref().unwrap().starts_with("<domain"));
        // The survey of a backup: one process, the same answers.
        let s = v.survey("test");
        assert_eq!(s.live.unwrap(), v.domain_xml("test", false).unwrap());
        assert_eq!(s.state.unwrap(), "running");
        assert_eq!(s.inactive.unwrap(), v.domain_xml("test", true).unwrap());
        assert!(v.survey(odd).live.is_err());
        assert!(v.checkpoint_xmls("test", &[]).is_empty());
    }

    std::thread_local! {
        /// The program (and its first arguments) a test's [`Virsh`] runs instead of `virsh`,
        /// on this test's thread; none: `virsh`.
        pub(super) static FAKE_VIRSH: std::cell::RefCell<Vec<std::ffi::OsString>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }

    /// A virsh whose `echo` lacks `--err` (it rejects the batch's line whole) still answers
    /// each command: run alone.
    #[test]
    fn a_virsh_that_rejects_the_batch_answers_each_command_alone() {
        let t = tempfile::tempdir().unwrap();
        let script = t.path().join("virsh");
        // Echoes its arguments after -q; rejects any line with `--err` as an old virsh does.
        let text = "case \"$*\" in *--err*) echo \"error: command 'echo' doesn't support option --err\" >&2; exit 1;; \
                    esac\nshift\ncase \"$1\" in fail) echo 'error: failed' >&2; exit 1;; esac\necho \"$*\"\n";
        std::fs::write(&script, text).unwrap();
        FAKE_VIRSH.set(vec!["/bin/sh".into(), script.into()]);
        let v = Virsh { uri: None };
        let answers = v.batch(&[vec!["domstate", "--domain", "vm"], vec!["fail"], vec!["dumpxml", "vm"]]).unwrap();
        FAKE_VIRSH.set(Vec::new());
        assert_eq!(answers[0].as_ref().unwrap(), "domstate --domain vm\n");
        assert!(format!("{:#}", answers[1].as_ref().unwrap_err()).contains("failed"));
        assert_eq!(answers[2].as_ref().unwrap(), "dumpxml vm\n");
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
