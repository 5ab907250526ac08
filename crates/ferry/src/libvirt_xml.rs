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
}

fn parse<'a>(xml: &'a str, what: &str) -> Result<roxmltree::Document<'a>> {
    roxmltree::Document::parse(xml).with_context(|| format!("libvirt gave {what} that is not XML"))
}

/// The disks (`<disk device='disk'>`; cdroms and floppies are no disks to back up).
pub(crate) fn disks(domain_xml: &str) -> Result<Vec<Disk>> {
    let doc = parse(domain_xml, "a domain")?;
    let mut out = Vec::new();
    for d in
        doc.descendants().filter(|n| n.has_tag_name("disk") && n.parent().is_some_and(|p| p.has_tag_name("devices")))
    {
        if d.attribute("device").unwrap_or("disk") != "disk" {
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
        });
    }
    Ok(out)
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
pub(crate) fn backup_socket(backup_xml: &str) -> Option<String> {
    let doc = roxmltree::Document::parse(backup_xml).ok()?;
    doc.descendants().find(|n| n.has_tag_name("server")).and_then(|s| s.attribute("socket")).map(String::from)
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

/// A pull-mode `<domainbackup>` on the Unix socket `dir/nbd.sock`, each disk read as
/// `modes` say (every disk of the domain is named: the others are `backup='no'`), its
/// scratch file (what the guest overwrites while the job runs) `dir/TARGET.scratch`.
pub(crate) fn backup_xml(dir: &str, modes: &[(String, Mode)]) -> String {
    let mut x = format!(
        "<domainbackup mode='pull'>\n  <server transport='unix' socket='{}/{SOCKET}'/>\n  <disks>\n",
        attr(dir)
    );
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
        x += &format!(
            "    <disk name='{t}' backup='yes' type='file' {how}><scratch file='{}/{t}.scratch'/></disk>\n",
            attr(dir)
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

/// The domain's XML for a restored copy: each disk of `files` (target, path, format)
/// pointing at its restored file, and with `rename` a new name, no UUID (libvirt makes
/// one) and no MAC addresses (libvirt makes new ones), so it can be defined beside the
/// original. Disks not in `files` are dropped (they were not backed up).
pub(crate) fn rewrite(domain_xml: &str, files: &[(String, String, String)], rename: Option<&str>) -> Result<String> {
    let doc = parse(domain_xml, "a domain")?;
    // Edits as (byte range, replacement), applied from the end.
    let mut edits: Vec<(std::ops::Range<usize>, String)> = Vec::new();
    for d in
        doc.descendants().filter(|n| n.has_tag_name("disk") && n.parent().is_some_and(|p| p.has_tag_name("devices")))
    {
        if d.attribute("device").unwrap_or("disk") != "disk" {
            continue;
        }
        let target = d.children().find(|c| c.has_tag_name("target")).and_then(|t| t.attribute("dev")).unwrap_or("");
        let Some((_, path, format)) = files.iter().find(|f| f.0 == target) else {
            edits.push((d.range(), String::new()));
            continue;
        };
        let bus = d.children().find(|c| c.has_tag_name("target")).and_then(|t| t.attribute("bus")).unwrap_or("virtio");
        edits.push((
            d.range(),
            format!(
                "<disk type='file' device='disk'>\n      <driver name='qemu' type='{}'/>\n      <source file='{}'/>\n      \
                 <target dev='{}' bus='{}'/>\n    </disk>",
                attr(format),
                attr(path),
                attr(target),
                attr(bus)
            ),
        ));
    }
    if let Some(name) = rename {
        let root = doc.root_element();
        for n in root.children() {
            if n.has_tag_name("name") {
                edits.push((n.range(), format!("<name>{}</name>", attr(name))));
            } else if n.has_tag_name("uuid") {
                edits.push((n.range(), String::new()));
            }
        }
        for m in doc
            .descendants()
            .filter(|n| n.has_tag_name("mac") && n.parent().is_some_and(|p| p.has_tag_name("interface")))
        {
            edits.push((m.range(), String::new()));
        }
    }
    edits.sort_by_key(|e| std::cmp::Reverse(e.0.start));
    let mut out = domain_xml.to_string();
    for (r, s) in edits {
        out.replace_range(r, &s);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
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
                source: Some("/a.qcow2".into())
            }
        );
        assert_eq!(d[1].source.as_deref(), Some("/dev/x"));
        assert_eq!(qemu_owner(DOM), Some((64055, 994)));
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
    fn backup_and_checkpoint_xml() {
        let b = backup_xml(
            "/run/x'y",
            &[
                ("vda".into(), Mode::Incremental("ferry-1".into())),
                ("vdb".into(), Mode::Full),
                ("vdc".into(), Mode::Skip),
            ],
        );
        assert_eq!(backup_socket(&b).as_deref(), Some("/run/x'y/nbd.sock"));
        assert!(b.contains("incremental='ferry-1'") && b.contains("name='vdc' backup='no'"), "{b}");
        let c = checkpoint_xml("ferry-1", &["vda".into(), "vdb".into()], &["vda".into()]);
        assert_eq!(checkpoint_disks(&c).unwrap(), ["vda"]);
    }
}
