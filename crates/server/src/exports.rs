//! The set of exports a server offers, seen by the handshake as a [`Catalog`].

use ferry_backend::{Backend, MetaContext};
use ferry_proto::{BlockSize, Catalog, ExportInfo};
use std::collections::BTreeMap;
use std::sync::Arc;

/// One export: a name, a description and a backend.
pub struct Export {
    pub name: String,
    pub description: String,
    pub backend: Arc<dyn Backend>,
}

impl Export {
    pub fn info(&self) -> ExportInfo {
        ExportInfo {
            name: self.name.clone(),
            description: self.description.clone(),
            size: self.backend.size(),
            caps: self.backend.caps(),
            block_size: BlockSize::default(),
        }
    }
}

/// An export and the metadata contexts it offers.
struct Entry {
    export: Arc<Export>,
    contexts: Vec<Arc<dyn MetaContext>>,
}

/// All exports, by name. The default export is the one named `""`.
#[derive(Default)]
pub struct Exports {
    by_name: BTreeMap<String, Entry>,
    no_multi_conn: bool,
}

impl Exports {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an export offering every metadata context its backend has
    /// ([`ferry_backend::all_meta_contexts`]); a second export with the same name is an
    /// error.
    pub fn add(&mut self, export: Export) -> Result<(), String> {
        let contexts = ferry_backend::all_meta_contexts(&export.backend);
        self.add_with_contexts(export, contexts)
    }

    /// Adds an export offering exactly `contexts` (`ferry serve -B/-A` choose among
    /// the backend's), in this order. Names must be unique and `base:allocation`, when
    /// offered, should come first, as clients expect.
    pub fn add_with_contexts(&mut self, export: Export, contexts: Vec<Arc<dyn MetaContext>>) -> Result<(), String> {
        if self.by_name.contains_key(&export.name) {
            return Err(format!("export {:?} is defined twice", export.name));
        }
        let mut seen = std::collections::HashSet::with_capacity(contexts.len());
        if let Some(c) = contexts.iter().find(|c| !seen.insert(c.name())) {
            return Err(format!("export {:?} offers metadata context {:?} twice", export.name, c.name()));
        }
        self.by_name.insert(export.name.clone(), Entry { export: Arc::new(export), contexts });
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Export>> {
        self.by_name.get(name).map(|e| &e.export)
    }

    /// The metadata contexts export `name` offers, in the order of [`Catalog::contexts`].
    pub fn meta_contexts(&self, name: &str) -> &[Arc<dyn MetaContext>] {
        self.by_name.get(name).map_or(&[], |e| &e.contexts)
    }

    /// Offer no export as multi-conn (`NBD_FLAG_CAN_MULTI_CONN` cleared): for a server that
    /// limits its connections, where a client that opened several connections on the
    /// strength of the flag would see the extra ones closed.
    pub fn without_multi_conn(&mut self) {
        self.no_multi_conn = true;
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Export>> {
        self.by_name.values().map(|e| &e.export)
    }
}

impl Catalog for Exports {
    fn export(&self, name: &str) -> Option<ExportInfo> {
        self.get(name).map(|e| {
            let mut info = e.info();
            info.caps.multi_conn &= !self.no_multi_conn;
            info
        })
    }
    fn list(&self) -> Vec<(String, String)> {
        self.by_name.values().map(|e| (e.export.name.clone(), e.export.description.clone())).collect()
    }
    fn contexts(&self, name: &str) -> Vec<String> {
        self.meta_contexts(name).iter().map(|c| c.name().to_string()).collect()
    }
}
