//! What `ferry copy` checks and locks before it writes anything: a destination that is
//! the source itself (the same file, a file of its backing chain, or the same NBD export)
//! is refused, and an existing raw destination is locked as qemu-img convert locks its
//! target, so no copy overwrites an image another program holds.

use anyhow::{bail, Result};
use ferry_backend::{Access, FileId, ImageUse};
use ferry_client::copy::Endpoint;
use ferry_client::uri::Transport;
use ferry_client::Uri;
use ferry_open::{destination_format, Format, Location, Source};
use std::net::ToSocketAddrs;

/// Refuses a destination that would overwrite what the copy reads, then locks a local
/// raw destination that exists (a new qcow2 image is locked as it is created). The
/// returned file holds the locks until the copy ends.
pub fn check_destination(src: &Source, src_spec: &str, dst_loc: &Location, dst: &str) -> Result<Option<std::fs::File>> {
    let path = match (&src.endpoint, dst_loc) {
        (Endpoint::Nbd(a), Location::Nbd(b)) if same_export(a, b) => {
            bail!(
                "{dst:?} is the source's own export: the copy would overwrite what it reads. Copy to another \
                 export or file"
            )
        }
        (_, l) => match destination_format(l, None) {
            Some((_, p)) => p,
            None => return Ok(None),
        },
    };
    let format = destination_format(dst_loc, None).map(|(f, _)| f);
    let Ok(id) = FileId::of_path(path) else { return Ok(None) };
    if let Some(f) = src.files.iter().find(|f| f.id == id) {
        let what = if f.id == src.files[0].id {
            "the source itself".to_string()
        } else {
            format!("the file {} of the source's backing chain (or its data file)", f.path.display())
        };
        bail!(
            "destination {} is {what}: copying {src_spec} onto it would destroy the data being copied. \
             Choose another destination",
            path.display()
        );
    }
    // Only images take locks: a FIFO or character device is written as a stream.
    if format == Some(Format::Raw) && ferry_open::is_image_file(path) {
        let locking = ImageUse::new(Access::Destination).raw();
        // A block device or file another program holds: refused before it is touched.
        let guard = ferry_backend::lock::lock_path(path, locking)
            .map_err(|e| anyhow::anyhow!("cannot write destination {}: {e}", path.display()))?;
        return Ok(Some(guard));
    }
    Ok(None)
}

/// Whether two NBD URIs name the same export of the same server.
fn same_export(a: &Uri, b: &Uri) -> bool {
    if a.export != b.export {
        return false;
    }
    match (&a.transport, &b.transport) {
        (Transport::Unix { path: p }, Transport::Unix { path: q }) => {
            p == q || matches!((FileId::of_path(p), FileId::of_path(q)), (Ok(x), Ok(y)) if x == y)
        }
        (Transport::Tcp { host: h, port: p }, Transport::Tcp { host: i, port: q }) => {
            if p != q {
                return false;
            }
            if h.eq_ignore_ascii_case(i) {
                return true;
            }
            let addrs = |h: &str| (h, *p).to_socket_addrs().map(|a| a.map(|s| s.ip()).collect::<Vec<_>>());
            matches!((addrs(h), addrs(i)), (Ok(x), Ok(y)) if x.iter().any(|ip| y.contains(ip)))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_compared() {
        let u = |s: &str| Uri::parse(s).unwrap();
        assert!(same_export(&u("nbd://localhost:10809/a"), &u("nbd://127.0.0.1:10809/a")));
        assert!(!same_export(&u("nbd://127.0.0.1:10809/a"), &u("nbd://127.0.0.1:10809/b")));
        assert!(!same_export(&u("nbd://127.0.0.1:10809/a"), &u("nbd://127.0.0.1:10810/a")));
        assert!(same_export(&u("nbd+unix:///a?socket=/tmp/s"), &u("nbd+unix:///a?socket=/tmp/./s")));
    }
}
