//! How much memory this process may use: the machine's (`/proc/meminfo`'s MemTotal), or
//! less where a control group limits it (cgroup v2 `memory.max`, cgroup v1
//! `memory.limit_in_bytes`, of this process's group and every group above it): the
//! smallest wins. A container's limit is what an allocation beyond it meets (the OOM
//! killer), however much the machine has.
//!
//! The parsing is pure (functions of the files' text); [`limit`] reads the files.
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The memory this process may use, in bytes, if anything says; read once.
pub(crate) fn limit() -> Option<u64> {
    static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        let read = |p: &Path| std::fs::read_to_string(p).ok();
        let total = read(Path::new("/proc/meminfo")).and_then(|t| meminfo_total(&t));
        let cgroup = read(Path::new("/proc/self/cgroup")).unwrap_or_default();
        let mountinfo = read(Path::new("/proc/self/mountinfo"));
        let groups = limit_files(&cgroup, mountinfo.as_deref())
            .into_iter()
            .filter_map(|f| read(&f))
            .filter_map(|t| cgroup_value(&t));
        total.into_iter().chain(groups).min()
    })
}

/// MemTotal of `/proc/meminfo`'s text, in bytes.
pub(crate) fn meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// A limit file's value: bytes, or `None` for "max" (none) and anything unreadable. (cgroup
/// v1 says "none" with a huge number, which then never is the smallest.)
pub(crate) fn cgroup_value(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// This process's groups from `/proc/self/cgroup`: the cgroup v2 path (`0::PATH`) and the
/// cgroup v1 memory controller's (`N:...memory...:PATH`).
fn own_groups(text: &str) -> (Option<&str>, Option<&str>) {
    let (mut v2, mut v1) = (None, None);
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else { continue };
        if id == "0" && controllers.is_empty() {
            v2 = Some(path);
        } else if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(path);
        }
    }
    (v2, v1)
}

/// A cgroup file system's mount: the group it shows at its top (`root`) and where.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    root: String,
    point: PathBuf,
}

/// The cgroup v2 mount and the cgroup v1 memory controller's, from
/// `/proc/self/mountinfo`'s text (`ID PARENT MAJ:MIN ROOT POINT OPTIONS [TAGS] - TYPE
/// SOURCE SUPER`).
fn cgroup_mounts(text: &str) -> (Option<Mount>, Option<Mount>) {
    let (mut v2, mut v1) = (None, None);
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else { continue };
        let l: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        let (Some(root), Some(point), Some(fstype)) = (l.get(3), l.get(4), r.first()) else { continue };
        let m = Mount { root: unescape(root), point: PathBuf::from(unescape(point)) };
        match *fstype {
            "cgroup2" if v2.is_none() => v2 = Some(m),
            "cgroup" if v1.is_none() && r.get(2).is_some_and(|o| o.split(',').any(|o| o == "memory")) => v1 = Some(m),
            _ => {}
        }
    }
    (v2, v1)
}

/// mountinfo's octal escapes (`\040` for a space) undone.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let oct = b.get(i + 1..i + 4).filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match oct {
            Some(d) => {
                out.push(d.iter().fold(0u8, |a, c| a.wrapping_mul(8).wrapping_add(c - b'0')));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The limit files that bound this process: `memory.max` (v2) and `memory.limit_in_bytes`
/// (v1) of its group and of each group above it up to the mount's top. Without mountinfo,
/// the usual mounts (`/sys/fs/cgroup`, `/sys/fs/cgroup/memory`) are assumed.
fn limit_files(cgroup: &str, mountinfo: Option<&str>) -> Vec<PathBuf> {
    let (g2, g1) = own_groups(cgroup);
    let (m2, m1) = match mountinfo {
        Some(t) => cgroup_mounts(t),
        None => {
            let m = |p: &str| Some(Mount { root: "/".into(), point: p.into() });
            (m("/sys/fs/cgroup"), m("/sys/fs/cgroup/memory"))
        }
    };
    let mut files = Vec::new();
    for (group, mount, file) in [(g2, m2, "memory.max"), (g1, m1, "memory.limit_in_bytes")] {
        let (Some(group), Some(mount)) = (group, mount) else { continue };
        // The group's path below the mount's top (a group outside it: the top alone).
        let below = match group.strip_prefix(mount.root.trim_end_matches('/')) {
            Some(rest) if rest.is_empty() || rest.starts_with('/') => rest,
            _ => "",
        };
        let mut dir = mount.point.clone();
        let mut dirs = vec![dir.clone()];
        for part in below.split('/').filter(|p| !p.is_empty() && *p != "." && *p != "..") {
            dir.push(part);
            dirs.push(dir.clone());
        }
        files.extend(dirs.into_iter().rev().map(|d| d.join(file)));
    }
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_of_limit_files() {
        assert_eq!(cgroup_value("max\n"), None);
        assert_eq!(cgroup_value("536870912\n"), Some(512 << 20));
        assert_eq!(cgroup_value("9223372036854771712\n"), Some(9223372036854771712));
        assert_eq!(cgroup_value(""), None);
        assert_eq!(cgroup_value("-1"), None);
        assert_eq!(meminfo_total("MemFree: 5 kB\nMemTotal:       24684092 kB\n"), Some(24684092 * 1024));
        assert_eq!(meminfo_total("MemFree: 5 kB\n"), None);
    }

    const V1_MOUNTS: &str = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
        32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n\
        35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
        41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";

    #[test]
    fn limit_files_of_a_hybrid_hierarchy() {
        let cgroup = "9:name=systemd:/\n4:memory:/process_api/3d52\n1:cpu,cpuacct:/\n0::/\n";
        let files = limit_files(cgroup, Some(V1_MOUNTS));
        let want: Vec<PathBuf> = [
            "/sys/fs/cgroup/unified/memory.max",
            "/sys/fs/cgroup/memory/process_api/3d52/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        assert_eq!(files, want);
    }

    #[test]
    fn limit_files_of_cgroup_v2() {
        let mounts = "25 30 0:23 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        let files = limit_files("0::/system.slice/ferry.service\n", Some(mounts));
        let want: Vec<PathBuf> = [
            "/sys/fs/cgroup/system.slice/ferry.service/memory.max",
            "/sys/fs/cgroup/system.slice/memory.max",
            "/sys/fs/cgroup/memory.max",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        assert_eq!(files, want);
        // A container's mount shows its own group at the top: the path below it counts.
        let mounts = "600 500 0:23 /kubepods/pod1 /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n";
        assert_eq!(
            limit_files("0::/kubepods/pod1/c1\n", Some(mounts)),
            [PathBuf::from("/sys/fs/cgroup/c1/memory.max"), PathBuf::from("/sys/fs/cgroup/memory.max")]
        );
        // A group outside the mount: its top alone. No "..", however the path is written.
        assert_eq!(limit_files("0::/other\n", Some(mounts)), [PathBuf::from("/sys/fs/cgroup/memory.max")]);
        assert_eq!(
            limit_files("0::/../../etc\n", Some("1 1 0:1 / /c rw - cgroup2 c rw\n")),
            [PathBuf::from("/c/etc/memory.max"), PathBuf::from("/c/memory.max")]
        );
        // No mountinfo: the usual place. No cgroup line: nothing.
        assert_eq!(
            limit_files("0::/a\n", None),
            [PathBuf::from("/sys/fs/cgroup/a/memory.max"), "/sys/fs/cgroup/memory.max".into()]
        );
        assert!(limit_files("", Some(mounts)).is_empty());
        // Escaped mount points.
        let mounts = "1 1 0:1 / /my\\040cgroups rw - cgroup2 none rw\n";
        assert_eq!(limit_files("0::/\n", Some(mounts)), [PathBuf::from("/my cgroups/memory.max")]);
    }

    #[test]
    fn hostile_text_gives_no_files_and_no_panic() {
        for t in
            ["", "\n", " - ", "a b c d e - ", "0::", "::::", "1 2 3 4 5 - cgroup2", "\\", "\\04", "x - cgroup x memory"]
        {
            let _ = limit_files(t, Some(t));
            let _ = cgroup_value(t);
            let _ = meminfo_total(t);
            let _ = unescape(t);
        }
    }

    #[test]
    fn this_machine_has_a_limit() {
        let l = limit().expect("/proc/meminfo is readable");
        assert!(l <= meminfo_total(&std::fs::read_to_string("/proc/meminfo").unwrap()).unwrap());
    }
}
