//! Ceph RBD images (`rbd:POOL/IMAGE[@SNAP][?conf=PATH&id=USER&keyring=PATH]`): a store.
//!
//! Ceph support is the Cargo feature `rbd` (off by default; scripts/test and release
//! builds turn it on); a build without it still recognises the spec and says how to get it.

pub use imp::*;

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

    pub fn destination(spec: &str, size: impl FnOnce() -> Result<u64>) -> Result<Endpoint> {
        // Without librbd's cache: see RbdImage::open_with.
        match RbdImage::open_with(spec, false, false) {
            Ok(img) => Ok(Endpoint::Backend(BackendEndpoint::new(img.spec().to_string(), Arc::new(img)))),
            Err(RbdError::NoImage { snap: None, image, .. }) => {
                let size = size()
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
    pub fn destination(_: &str, _: impl FnOnce() -> Result<u64>) -> Result<Endpoint> {
        bail!(NO)
    }
    pub fn info(_: &str, _: bool) -> Result<i32> {
        bail!(NO)
    }
}
