//! libvirt's XML as `ferry backup libvirt:` and `ferry restore` read and write it: a
//! domain's disks, a checkpoint's disks, a backup job's socket, the `<domainbackup>` and
//! `<domaincheckpoint>` ferry starts, and a domain rewritten for a restored copy. No I/O.

use anyhow::{bail, Context, Result};

/// A disk of a domain, as its XML says it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Disk {
    /// `vda`.
    pub target: String,
    /// `file`, `block`, `network`, `volume`...
    pub kind: String,
    /// The driver's format: `qcow2`, `raw`...
    pub format: Option<String>,
    /// The file or device (`None` for a network disk, or no medium).
    pub source: Option<String>,
    /// `disk`, or `lun` (a SCSI LUN passed through, which no backup job reads).
    pub device: String,
}

fn parse<'a>(xml: &'a str, what: &str) -> Result<roxmltree::Document<'a>> {
    roxmltree::Document::parse(xml).with_context(|| format!("libvirt gave {what} that is not XML"))
}

/// Whether a `<disk device=...>` holds removable media (a cdrom or a floppy): no disk to
/// back up.
fn removable(device: &str) -> bool {
    device == "cdrom" || device == "floppy"
}

/// The disks (`<disk device='disk'>` and `device='lun'`; cdroms and floppies are no disks
/// to back up).
pub(crate) fn disks(domain_xml: &str) -> Result<Vec<Disk>> {
    let doc = parse(domain_xml, "a domain")?;
    let mut out = Vec::new();
    for d in
        doc.descendants().filter(|n| n.has_tag_name("disk") && n.parent().is_some_and(|p| p.has_tag_name("devices")))
    {
        let device = d.attribute("device").unwrap_or("disk");
        if removable(device) {
            continue;
        }
        let child = |name: &str| d.children().find(|c| c.has_tag_name(name));
        let Some(target) = child("target").and_then(|t| t.attribute("dev")) else {
            bail!("a disk of the domain has no <target dev=...>");
        };
        let source = child("source").and_then(|s| s.attribute("file").or(s.attribute("dev"))).map(String::from);
        out.push(Disk {
            target: target.to_string(),
            kind: d.attribute("type").unwrap_or("file").to_string(),
            format: child("driver").and_then(|t| t.attribute("type")).map(String::from),
            source,
            device: device.to_string(),
        });
    }
    Ok(out)
}

/// The domain's UUID (lower case), if its XML has one.
pub(crate) fn uuid(domain_xml: &str) -> Option<String> {
    let doc = roxmltree::Document::parse(domain_xml).ok()?;
    let u = doc.root_element().children().find(|n| n.has_tag_name("uuid"))?.text()?.trim().to_ascii_lowercase();
    (!u.is_empty()).then_some(u)
}

/// The uid and gid qemu runs as (the live XML's DAC label `+UID:+GID`), if it says.
pub(crate) fn qemu_owner(domain_xml: &str) -> Option<(u32, u32)> {
    let doc = roxmltree::Document::parse(domain_xml).ok()?;
    let label = doc
        .descendants()
        .filter(|n| n.has_tag_name("seclabel") && n.attribute("model") == Some("dac"))
        .find_map(|n| n.children().find(|c| c.has_tag_name("label")).and_then(|l| l.text()))?;
    let (u, g) = label.trim().split_once(':')?;
    Some((u.trim_start_matches('+').parse().ok()?, g.trim_start_matches('+').parse().ok()?))
}

/// The disks a checkpoint tracks (`checkpoint='bitmap'`).
pub(crate) fn checkpoint_disks(checkpoint_xml: &str) -> Result<Vec<String>> {
    let doc = parse(checkpoint_xml, "a checkpoint")?;
    Ok(doc
        .descendants()
        .filter(|n| n.has_tag_name("disk") && n.attribute("checkpoint") == Some("bitmap"))
        .filter_map(|n| n.attribute("name").map(String::from))
        .collect())
}

/// The Unix socket a running backup job exports its disks on, if it says.
#[cfg(test)]
pub(crate) fn backup_socket(backup_xml: &str) -> Option<String> {
    let doc = roxmltree::Document::parse(backup_xml).ok()?;
    doc.descendants().find(|n| n.has_tag_name("server")).and_then(|s| s.attribute("socket")).map(String::from)
}

/// The name of the directory a backup job ferry starts was made from (its mark, which
/// tells that job from any other): the directory of its Unix socket, or for a TCP export
/// the prefix of its export names (`MARK-TARGET`). `None` for a job that has neither.
/// Only a single path component of letters, digits, `-`, `_` and `.` (not `.` or `..`) is
/// a mark: the XML may come from another host's libvirt, and a mark names a directory
/// ferry removes.
pub(crate) fn job_mark(backup_xml: &str) -> Option<String> {
    let doc = roxmltree::Document::parse(backup_xml).ok()?;
    let plain = |m: &str| {
        !m.is_empty() && m != "." && m != ".." && m.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    if let Some(s) = doc.descendants().find(|n| n.has_tag_name("server")).and_then(|s| s.attribute("socket")) {
        let mark = std::path::Path::new(s).parent()?.file_name()?.to_str()?;
        return plain(mark).then(|| mark.to_string());
    }
    doc.descendants().filter(|n| n.has_tag_name("disk") && n.attribute("backup") != Some("no")).find_map(|d| {
        let name = d.attribute("name")?;
        let mark = d.attribute("exportname")?.strip_suffix(name)?.strip_suffix('-')?;
        plain(mark).then(|| mark.to_string())
    })
}

/// The local directory of a backup job's socket and scratch files, if it has one: the
/// socket's, else a scratch file's.
pub(crate) fn job_dir(backup_xml: &str) -> Option<std::path::PathBuf> {
    let doc = roxmltree::Document::parse(backup_xml).ok()?;
    let file = doc
        .descendants()
        .find(|n| n.has_tag_name("server"))
        .and_then(|s| s.attribute("socket"))
        .or_else(|| doc.descendants().filter(|n| n.has_tag_name("scratch")).find_map(|s| s.attribute("file")))?;
    std::path::Path::new(file).parent().map(std::path::Path::to_path_buf)
}

/// `s` as an XML attribute value.
fn attr(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('\'', "&apos;").replace('"', "&quot;")
}

/// The socket's name in the job's directory.
pub(crate) const SOCKET: &str = "nbd.sock";

/// How one disk is read by a backup job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Not read.
    Skip,
    Full,
    /// Only what changed since the checkpoint.
    Incremental(String),
}

/// How a backup job exports the disks it reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Export {
    /// On the Unix socket `DIR/nbd.sock` of the job's directory, each disk under its target
    /// name; the scratch files in that directory.
    Unix,
    /// NBD over TCP: qemu listens on `host:port`, each disk exported as `MARK-TARGET` (MARK
    /// the name of the job's directory), with TLS (the host's qemu.conf
    /// `backup_tls_x509_cert_dir`) unless `tls` is false.
    Tcp {
        host: String,
        port: u16,
        tls: bool,
        /// For a domain of another host, the directory of that host its scratch files go
        /// in (`DIR/MARK.TARGET.scratch`); `None`: in the job's directory (a domain of
        /// this host). libvirt takes a pull-mode disk only with a scratch file.
        remote_scratch: Option<String>,
    },
}

impl Export {
    /// The export name of disk `target` of the job made from directory `dir`.
    pub(crate) fn name(&self, dir: &str, target: &str) -> String {
        match self {
            Export::Unix => target.to_string(),
            Export::Tcp { .. } => {
                let mark = std::path::Path::new(dir).file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
                format!("{mark}-{target}")
            }
        }
    }
}

/// A pull-mode `<domainbackup>` exported as `export` says from the job's directory `dir`,
/// each disk read as `modes` say (every disk of the domain is named: the others are
/// `backup='no'`), its scratch file (what the guest overwrites while the job runs)
/// `dir/TARGET.scratch`, or for a domain of another host `REMOTE/MARK.TARGET.scratch` on
/// that host (MARK the name of `dir`): libvirt refuses a pull-mode disk without one.
pub(crate) fn backup_xml(dir: &str, export: &Export, modes: &[(String, Mode)]) -> String {
    let (server, remote) = match export {
        Export::Unix => (format!("transport='unix' socket='{}/{SOCKET}'", attr(dir)), None),
        Export::Tcp { host, port, tls, remote_scratch } => (
            format!("transport='tcp' name='{}' port='{port}' tls='{}'", attr(host), if *tls { "yes" } else { "no" }),
            remote_scratch.as_deref(),
        ),
    };
    let mark = std::path::Path::new(dir).file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
    let mut x = format!("<domainbackup mode='pull'>\n  <server {server}/>\n  <disks>\n");
    for (target, mode) in modes {
        let t = attr(target);
        let how = match mode {
            Mode::Skip => {
                x += &format!("    <disk name='{t}' backup='no'/>\n");
                continue;
            }
            Mode::Full => "backupmode='full'".to_string(),
            Mode::Incremental(c) => format!("backupmode='incremental' incremental='{}'", attr(c)),
        };
        let name = match export {
            Export::Unix => String::new(),
            Export::Tcp { .. } => format!(" exportname='{}'", attr(&export.name(dir, target))),
        };
        let scratch = match remote {
            None => format!("{dir}/{target}.scratch"),
            Some(r) => format!("{}/{mark}.{target}.scratch", r.trim_end_matches('/')),
        };
        x += &format!(
            "    <disk name='{t}' backup='yes' type='file' {how}{name}><scratch file='{}'/></disk>\n",
            attr(&scratch)
        );
    }
    x + "  </disks>\n</domainbackup>\n"
}

/// A `<domaincheckpoint>` named `name` that tracks the disks `tracked` (every disk of the
/// domain is named, the others `checkpoint='no'`).
pub(crate) fn checkpoint_xml(name: &str, all: &[String], tracked: &[String]) -> String {
    let mut x = format!(
        "<domaincheckpoint>\n  <name>{}</name>\n  <description>made by ferry backup</description>\n  <disks>\n",
        attr(name)
    );
    for t in all {
        let how = if tracked.contains(t) { "bitmap" } else { "no" };
        x += &format!("    <disk name='{}' checkpoint='{how}'/>\n", attr(t));
    }
    x + "  </disks>\n</domaincheckpoint>\n"
}

/// The bus a disk's target name implies, for a disk the XML lacks (`vdX` virtio, `sdX`
/// scsi, `hdX` ide, `xvdX` xen).
fn bus_of(target: &str) -> &'static str {
    match target {
        t if t.starts_with("xvd") => "xen",
        t if t.starts_with("sd") => "scsi",
        t if t.starts_with("hd") => "ide",
        _ => "virtio",
    }
}

/// Sets attribute `name` of `node` to `value` (an edit of its value, or one that adds it
/// after the element's name).
fn set_attr(edits: &mut Vec<(std::ops::Range<usize>, String)>, node: roxmltree::Node, name: &str, value: &str) {
    match node.attributes().find(|a| a.name() == name) {
        Some(a) => edits.push((a.range_value(), attr(value))),
        None => {
            let at = node.range().start + 1 + node.tag_name().name().len();
            edits.push((at..at, format!(" {name}='{}'", attr(value))));
        }
    }
}

/// The domain's XML for a restored copy: each disk of `files` (target, path, format)
/// pointing at its restored file, and with `rename` a new name, no UUID (libvirt makes
/// one), no MAC addresses (libvirt makes new ones) and no `<nvram>` (libvirt makes a new
/// one from the firmware's template), so it can be defined beside the original.
///
/// A restored disk keeps its element: only its `type`, its driver's `type` and its
/// `<source>` change (and a `<backingStore>`, `<auth>` or `<encryption>`, which the
/// restored image has not, goes), so boot order, serial, wwn, cache mode and address
/// stay. A disk of `files` the XML lacks (hot-plugged when the point was taken) is added.
/// Every other disk goes, whatever its device (it was not restored: a copy must not use
/// the original's image or LUN), except that a cdrom or floppy drive stays, empty.
pub(crate) fn rewrite(domain_xml: &str, files: &[(String, String, String)], rename: Option<&str>) -> Result<String> {
    let doc = parse(domain_xml, "a domain")?;
    let root = doc.root_element();
    let Some(devices) = root.children().find(|n| n.has_tag_name("devices")) else {
        bail!("the domain's XML has no <devices>");
    };
    // Edits as (byte range, replacement), none overlapping, applied from the end.
    let mut edits: Vec<(std::ops::Range<usize>, String)> = Vec::new();
    let mut restored = Vec::new();
    for d in devices.children().filter(|n| n.has_tag_name("disk")) {
        let device = d.attribute("device").unwrap_or("disk");
        let child = |name: &str| d.children().find(|c| c.has_tag_name(name));
        let target = child("target").and_then(|t| t.attribute("dev")).unwrap_or("");
        let file = files.iter().find(|f| f.0 == target).filter(|_| !removable(device));
        let (Some((_, path, format)), Some(t)) = (file, child("target")) else {
            match (removable(device), child("source")) {
                (true, Some(s)) => edits.push((s.range(), String::new())),
                (true, None) => {}
                (false, _) => edits.push((d.range(), String::new())),
            }
            continue;
        };
        restored.push(target);
        set_attr(&mut edits, d, "type", "file");
        let mut before_target = String::new();
        match child("driver") {
            Some(dr) => set_attr(&mut edits, dr, "type", format),
            None => before_target += &format!("<driver name='qemu' type='{}'/>", attr(format)),
        }
        let source = format!("<source file='{}'/>", attr(path));
        match child("source") {
            Some(s) => edits.push((s.range(), source)),
            None => before_target += &source,
        }
        if !before_target.is_empty() {
            edits.push((t.range().start..t.range().start, before_target));
        }
        for gone in d.children().filter(|c| ["backingStore", "auth", "encryption"].iter().any(|n| c.has_tag_name(*n))) {
            edits.push((gone.range(), String::new()));
        }
    }
    let added: String = files
        .iter()
        .filter(|f| !restored.contains(&f.0.as_str()))
        .map(|(target, path, format)| {
            format!(
                "  <disk type='file' device='disk'>\n      <driver name='qemu' type='{}'/>\n      <source file='{}'/>\n      \
                 <target dev='{}' bus='{}'/>\n    </disk>\n  ",
                attr(format),
                attr(path),
                attr(target),
                bus_of(target)
            )
        })
        .collect();
    if !added.is_empty() {
        let end = devices.range().end;
        let Some(at) = end.checked_sub("</devices>".len()).filter(|_| domain_xml[..end].ends_with("</devices>")) else {
            bail!("the domain's <devices> has no closing tag to add disks before");
        };
        edits.push((at..at, added));
    }
    if let Some(name) = rename {
        for n in root.children() {
            if n.has_tag_name("name") {
                edits.push((n.range(), format!("<name>{}</name>", attr(name))));
            } else if n.has_tag_name("uuid") {
                edits.push((n.range(), String::new()));
            } else if n.has_tag_name("os") {
                for v in n.children().filter(|c| c.has_tag_name("nvram")) {
                    edits.push((v.range(), String::new()));
                }
            }
        }
        for m in doc
            .descendants()
            .filter(|n| n.has_tag_name("mac") && n.parent().is_some_and(|p| p.has_tag_name("interface")))
        {
            edits.push((m.range(), String::new()));
        }
    }
    // From the end; of two edits at one place (an insertion before a replacement), the
    // later one first.
    edits.sort_by_key(|e| std::cmp::Reverse((e.0.start, e.0.end)));
    let mut out = domain_xml.to_string();
    for (r, s) in edits {
        out.replace_range(r, &s);
    }
    Ok(out)
}

/// Whether the domain's XML has an `<nvram>` (UEFI variables), which a renamed copy must
/// not share with the original.
pub(crate) fn has_nvram(domain_xml: &str) -> bool {
    roxmltree::Document::parse(domain_xml).is_ok_and(|d| d.descendants().any(|n| n.has_tag_name("nvram")))
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_mark_is_one_plain_path_component() {
        let job = |export: &str| {
            format!(
                "<domainbackup mode='pull'><server transport='tcp' name='kvm1' port='1'/><disks>\
                 <disk name='vda' backup='yes' type='file' exportname='{export}'/></disks></domainbackup>"
            )
        };
        assert_eq!(job_mark(&job("ferry-libvirt-Ab12_c-vda")).as_deref(), Some("ferry-libvirt-Ab12_c"));
        for hostile in ["ferry-libvirt-AB12/../../../../etc-vda", "..-vda", "../x-vda", "-vda", "a b-vda"] {
            assert_eq!(job_mark(&job(hostile)), None, "{hostile}");
        }
        let unix = "<domainbackup mode='pull'><server transport='unix' socket='/var/tmp/a b/s'/></domainbackup>";
        assert_eq!(job_mark(unix), None);
    }
    use super::*;

    const DOM: &str = "<domain type='kvm'><name>vm1</name><uuid>u</uuid><devices>\
        <disk type='file' device='disk'><driver name='qemu' type='qcow2'/><source file='/a.qcow2'/><target dev='vda' bus='virtio'/></disk>\
        <disk type='block' device='disk'><driver name='qemu' type='raw'/><source dev='/dev/x'/><target dev='vdb' bus='virtio'/></disk>\
        <disk type='file' device='cdrom'><target dev='sda' bus='sata'/></disk>\
        <interface type='network'><mac address='52:54:00:00:00:01'/></interface>\
        </devices><seclabel type='dynamic' model='dac' relabel='yes'><label>+64055:+994</label></seclabel></domain>";

    #[test]
    fn the_disks_of_a_domain() {
        let d = disks(DOM).unwrap();
        assert_eq!(d.len(), 2, "the cdrom is no disk to back up");
        assert_eq!(
            d[0],
            Disk {
                target: "vda".into(),
                kind: "file".into(),
                format: Some("qcow2".into()),
                source: Some("/a.qcow2".into()),
                device: "disk".into(),
            }
        );
        assert_eq!(d[1].source.as_deref(), Some("/dev/x"));
        assert_eq!(qemu_owner(DOM), Some((64055, 994)));
        assert_eq!(uuid(DOM).as_deref(), Some("u"));
        assert!(disks("<domain").is_err());
    }

    #[test]
    fn a_restored_domain_points_at_its_files_under_a_new_name() {
        let files = [("vda".to_string(), "/r/vm1-vda.raw".to_string(), "raw".to_string())];
        let x = rewrite(DOM, &files, Some("vm1-copy")).unwrap();
        let d = disks(&x).unwrap();
        assert_eq!(d.len(), 1, "{x}");
        assert_eq!(d[0].source.as_deref(), Some("/r/vm1-vda.raw"));
        assert_eq!(d[0].format.as_deref(), Some("raw"));
        assert!(x.contains("<name>vm1-copy</name>") && !x.contains("<uuid>") && !x.contains("52:54:00"), "{x}");
        // Without a new name, the name, UUID and MACs stay.
        let x = rewrite(DOM, &files, None).unwrap();
        assert!(x.contains("<name>vm1</name>") && x.contains("<uuid>u</uuid>") && x.contains("52:54:00"), "{x}");
    }

    #[test]
    fn a_restored_domain_keeps_no_disk_it_did_not_restore_whatever_its_device() {
        let dom = "<domain><name>vm1</name><devices>\
            <disk type='file' device='disk'><driver name='qemu' type='qcow2'/><source file='/a.qcow2'/><target dev='vda' bus='virtio'/></disk>\
            <disk type='block' device='lun'><driver name='qemu' type='raw'/><source dev='/dev/sdz'/><target dev='sda' bus='scsi'/></disk>\
            <disk type='file' device='cdrom'><source file='/iso/x.iso'/><target dev='sdb' bus='sata'/><readonly/></disk>\
            </devices></domain>";
        let files = [("vda".to_string(), "/r/vm1-vda.raw".to_string(), "raw".to_string())];
        let x = rewrite(dom, &files, None).unwrap();
        assert!(!x.contains("/dev/sdz") && !x.contains("device='lun'"), "{x}");
        assert!(
            !x.contains("/iso/x.iso") && x.contains("<target dev='sdb' bus='sata'/>"),
            "the cdrom stays, empty: {x}"
        );
        roxmltree::Document::parse(&x).unwrap();
    }

    #[test]
    fn a_restored_disk_is_edited_in_place_and_missing_ones_are_added() {
        let dom = "<domain><name>vm1</name><os><loader>/l.fd</loader><nvram>/var/n/vm1_VARS.fd</nvram></os><devices>\
            <disk type='block' device='disk'><driver name='qemu' type='raw' cache='none'/><source dev='/dev/vg/x' index='1'/>\
            <backingStore/><target dev='vda' bus='virtio'/><serial>S1</serial><wwn>5000c50015ea71ad</wwn><boot order='2'/></disk>\
            <disk device='disk'><target dev='vdb' bus='scsi'/><serial>S2</serial></disk>\
            </devices></domain>";
        let files = [
            ("vda".to_string(), "/r/vm1-vda.qcow2".to_string(), "qcow2".to_string()),
            ("vdb".to_string(), "/r/vm1-vdb.qcow2".to_string(), "qcow2".to_string()),
            ("vdc".to_string(), "/r/vm1-vdc.qcow2".to_string(), "qcow2".to_string()),
        ];
        let x = rewrite(dom, &files, Some("copy")).unwrap();
        roxmltree::Document::parse(&x).unwrap_or_else(|e| panic!("{e}: {x}"));
        for kept in [
            "<serial>S1</serial>",
            "<wwn>5000c50015ea71ad</wwn>",
            "<boot order='2'/>",
            "cache='none'",
            "<serial>S2</serial>",
            "<loader>/l.fd</loader>",
        ] {
            assert!(x.contains(kept), "{kept} is lost: {x}");
        }
        assert!(!x.contains("backingStore") && !x.contains("nvram") && !x.contains("/dev/vg/x"), "{x}");
        let d = disks(&x).unwrap();
        let got: Vec<_> =
            d.iter().map(|d| (d.target.as_str(), d.kind.as_str(), d.format.as_deref(), d.source.as_deref())).collect();
        assert_eq!(
            got,
            [
                ("vda", "file", Some("qcow2"), Some("/r/vm1-vda.qcow2")),
                ("vdb", "file", Some("qcow2"), Some("/r/vm1-vdb.qcow2")),
                ("vdc", "file", Some("qcow2"), Some("/r/vm1-vdc.qcow2")),
            ],
            "{x}"
        );
        assert!(x.contains("<target dev='vdc' bus='virtio'/>"), "{x}");
        assert!(has_nvram(dom) && !has_nvram(&x));
    }

    #[test]
    fn backup_and_checkpoint_xml() {
        let b = backup_xml(
            "/run/x'y",
            &Export::Unix,
            &[
                ("vda".into(), Mode::Incremental("ferry-1".into())),
                ("vdb".into(), Mode::Full),
                ("vdc".into(), Mode::Skip),
            ],
        );
        assert_eq!(backup_socket(&b).as_deref(), Some("/run/x'y/nbd.sock"));
        assert!(b.contains("incremental='ferry-1'") && b.contains("name='vdc' backup='no'"), "{b}");
        // Not a plain name: no mark (ferry's own are `ferry-libvirt-` and letters).
        assert_eq!(job_mark(&b), None);
        assert_eq!(job_dir(&b), Some("/run/x'y".into()));
        let c = checkpoint_xml("ferry-1", &["vda".into(), "vdb".into()], &["vda".into()]);
        assert_eq!(checkpoint_disks(&c).unwrap(), ["vda"]);
    }

    #[test]
    fn a_tcp_export_names_its_host_port_tls_and_its_run_in_each_export_name() {
        let modes = [("vda".to_string(), Mode::Full), ("vdb".to_string(), Mode::Skip)];
        let tcp = |remote_scratch| Export::Tcp { host: "h<1>".into(), port: 10809, tls: true, remote_scratch };
        let b = backup_xml("/var/tmp/ferry-libvirt-Ab1", &tcp(None), &modes);
        let doc = roxmltree::Document::parse(&b).unwrap_or_else(|e| panic!("{e}: {b}"));
        let server = doc.descendants().find(|n| n.has_tag_name("server")).unwrap();
        let attrs: Vec<_> = server.attributes().map(|a| (a.name(), a.value())).collect();
        assert_eq!(attrs, [("transport", "tcp"), ("name", "h<1>"), ("port", "10809"), ("tls", "yes")]);
        let vda = doc.descendants().find(|n| n.attribute("name") == Some("vda")).unwrap();
        assert_eq!(vda.attribute("exportname"), Some("ferry-libvirt-Ab1-vda"));
        assert_eq!(tcp(None).name("/var/tmp/ferry-libvirt-Ab1", "vda"), "ferry-libvirt-Ab1-vda");
        assert!(b.contains("<scratch file='/var/tmp/ferry-libvirt-Ab1/vda.scratch'/>"), "{b}");
        assert_eq!(backup_socket(&b), None);
        assert_eq!(job_mark(&b).as_deref(), Some("ferry-libvirt-Ab1"));
        assert_eq!(job_dir(&b), Some("/var/tmp/ferry-libvirt-Ab1".into()));
        // On another host the scratch files go in --scratch-dir of that host, named after
        // the run; the job has no local directory, but still its mark.
        let b = backup_xml("/var/tmp/ferry-libvirt-Ab1", &tcp(Some("/srv/s/".into())), &modes);
        let doc = roxmltree::Document::parse(&b).unwrap_or_else(|e| panic!("{e}: {b}"));
        let vda = doc.descendants().find(|n| n.attribute("name") == Some("vda")).unwrap();
        assert_eq!(vda.attribute("type"), Some("file"), "{b}");
        let scratch = vda.children().find(|n| n.has_tag_name("scratch")).unwrap();
        assert_eq!(scratch.attribute("file"), Some("/srv/s/ferry-libvirt-Ab1.vda.scratch"), "{b}");
        assert_eq!(job_mark(&b).as_deref(), Some("ferry-libvirt-Ab1"));
        assert_eq!(job_dir(&b), Some("/srv/s".into()), "the scratch files' directory, not the run's");
        let plain = Export::Tcp { host: "h".into(), port: 1, tls: false, remote_scratch: None };
        assert!(backup_xml("/d", &plain, &modes).contains("tls='no'"));
        // A job of someone else's (export names of their own, or none) has no mark.
        let other = "<domainbackup mode='pull'><server transport='tcp' name='h' port='1'/><disks>\
            <disk name='vda' backup='yes' exportname='vda'/></disks></domainbackup>";
        assert_eq!(job_mark(other), None);
    }
}
