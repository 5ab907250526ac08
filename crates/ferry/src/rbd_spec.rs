//! `rbd:POOL/IMAGE[@SNAP][?conf=PATH&id=USER&keyring=PATH]` for serve, copy, info and hash.
//!
//! Ceph support is the Cargo feature `rbd` (off by default; scripts/test and release builds turn it on); a build without it still
//! recognises the spec and says how to get it.

use anyhow::Result;
use ferry_backend::Backend;
use ferry_client::copy::Endpoint;
use std::sync::Arc;

/// Whether a spec names an RBD image.
pub fn is_rbd(spec: &str) -> bool {
    spec.starts_with("rbd:")
}

/// The backend a `serve` spec names: an RBD image, or one of ferry-backend's kinds.
pub fn open_backend(spec: &str, read_only: bool) -> Result<Arc<dyn Backend>> {
    if is_rbd(spec) {
        return imp::open(spec, read_only);
    }
    Ok(ferry_backend::open(spec, read_only)?)
}

/// A copy (or hash) source: an RBD image opened read-only, or `None` for other specs.
pub fn source(spec: &str) -> Result<Option<Endpoint>> {
    if !is_rbd(spec) {
        return Ok(None);
    }
    Ok(Some(imp::source(spec)?))
}

/// A copy destination: an RBD image, created with the source's size when it does not
/// exist (then known to read as zeroes), or `None` for other specs.
pub fn destination(spec: &str, src: &Endpoint) -> Result<Option<Endpoint>> {
    if !is_rbd(spec) {
        return Ok(None);
    }
    Ok(Some(imp::destination(spec, src)?))
}

/// Copy workers (`-C`) when not given and an end is an RBD image: 8. A worker's librbd
/// call waits for the OSD over the network, not for a core, so more of them than cores
/// keep more requests in flight (measured: 2 workers took 1.3-2x as long as 8 for
/// rbd -> file, with 8 as fast as qemu-img convert's 8 coroutines; BENCHMARKING.md).
pub fn copy_workers(src: &str, dst: &str) -> Option<usize> {
    (is_rbd(src) || is_rbd(dst)).then_some(8)
}

/// `ferry info rbd:...`: `Some(exit code)` when the spec is an RBD image.
pub fn info(spec: &str, json: bool) -> Result<Option<i32>> {
    if !is_rbd(spec) {
        return Ok(None);
    }
    imp::info(spec, json).map(Some)
}

#[cfg(feature = "rbd")]
mod imp {
    use anyhow::{Context, Result};
    use ferry_backend::Backend;
    use ferry_client::copy::{BackendEndpoint, Endpoint};
    use ferry_rbd::{RbdError, RbdImage};
    use serde_json::json;
    use std::sync::Arc;

    pub fn open(spec: &str, read_only: bool) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(RbdImage::open(spec, read_only)?))
    }

    pub fn source(spec: &str) -> Result<Endpoint> {
        let img = RbdImage::open_with(spec, true, false)?;
        Ok(Endpoint::Backend(BackendEndpoint::new(img.spec().to_string(), Arc::new(img))))
    }

    pub fn destination(spec: &str, src: &Endpoint) -> Result<Endpoint> {
        // Without librbd's cache: see RbdImage::open_with.
        match RbdImage::open_with(spec, false, false) {
            Ok(img) => Ok(Endpoint::Backend(BackendEndpoint::new(img.spec().to_string(), Arc::new(img)))),
            Err(RbdError::NoImage { snap: None, image, .. }) => {
                let size = crate::copy::source_size(src)
                    .with_context(|| format!("{image} does not exist and must be created with the source's size"))?;
                RbdImage::create(spec, size)?;
                log::info!("created {image} ({size} bytes)");
                let img = RbdImage::open_with(spec, false, false)?;
                Ok(Endpoint::Backend(BackendEndpoint::new(img.spec().to_string(), Arc::new(img)).zeroed()))
            }
            Err(e) => Err(e.into()),
        }
    }

    pub fn info(spec: &str, as_json: bool) -> Result<i32> {
        let img = RbdImage::open(spec, true)?;
        let i = img.info()?;
        if as_json {
            let doc = json!({
                "image": img.spec().to_string(),
                "export-size": i.size,
                "object_size": i.object_size,
                "order": i.order,
                "features": i.features,
                "snapshot": i.snapshot,
                "snapshots": i.snapshots.iter().map(|(n, s)| json!({"name": n, "size": s})).collect::<Vec<_>>(),
                "is_read_only": i.read_only,
            });
            println!("{}", serde_json::to_string_pretty(&doc)?);
        } else {
            println!("image: {}", img.spec());
            println!("\tsize: {}", i.size);
            println!("\tobject size: {} (order {})", i.object_size, i.order);
            println!("\tfeatures: {}", i.features.join(", "));
            if let Some(s) = &i.snapshot {
                println!("\tsnapshot: {s} (read-only)");
            }
            println!("\tsnapshots: {}", i.snapshots.len());
            for (n, s) in &i.snapshots {
                println!("\t\t{n}: {s} bytes");
            }
        }
        Ok(0)
    }
}

#[cfg(not(feature = "rbd"))]
mod imp {
    use anyhow::{bail, Result};
    use ferry_backend::Backend;
    use ferry_client::copy::Endpoint;
    use std::sync::Arc;

    const NO: &str = "this ferry was built without Ceph RBD support: rebuild with `--features rbd` (needs librbd-dev)";

    pub fn open(_: &str, _: bool) -> Result<Arc<dyn Backend>> {
        bail!(NO)
    }
    pub fn source(_: &str) -> Result<Endpoint> {
        bail!(NO)
    }
    pub fn destination(_: &str, _: &Endpoint) -> Result<Endpoint> {
        bail!(NO)
    }
    pub fn info(_: &str, _: bool) -> Result<i32> {
        bail!(NO)
    }
}
