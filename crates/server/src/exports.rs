//! The set of exports a server offers, seen by the handshake as a [`Catalog`].

use ferry_backend::Backend;
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

/// All exports, by name. The default export is the one named `""`.
#[derive(Default)]
pub struct Exports {
    by_name: BTreeMap<String, Arc<Export>>,
}

impl Exports {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an export; a second export with the same name is an error.
    pub fn add(&mut self, export: Export) -> Result<(), String> {
        if self.by_name.contains_key(&export.name) {
            return Err(format!("export {:?} is defined twice", export.name));
        }
        self.by_name.insert(export.name.clone(), Arc::new(export));
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Export>> {
        self.by_name.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Export>> {
        self.by_name.values()
    }
}

impl Catalog for Exports {
    fn export(&self, name: &str) -> Option<ExportInfo> {
        self.get(name).map(|e| e.info())
    }
    fn list(&self) -> Vec<(String, String)> {
        self.by_name.values().map(|e| (e.name.clone(), e.description.clone())).collect()
    }
}
