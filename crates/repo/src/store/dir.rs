//! A repository in a local directory: one file per object, written to a temporary file,
//! fsync'ed, renamed into place, and the directory fsync'ed.
use super::Store;
use std::io;
use std::path::{Path, PathBuf};

pub struct DirStore {
    root: PathBuf,
}

impl DirStore {
    /// A store at `root`, which must exist (see [`DirStore::create`]).
    pub fn open(root: &Path) -> io::Result<DirStore> {
        let _ = root;
        todo!()
    }
    /// Makes `root` (and its parents), which must be absent or an empty directory.
    pub fn create(root: &Path) -> io::Result<DirStore> {
        let _ = root;
        todo!()
    }
}

impl Store for DirStore {
    fn describe(&self) -> String {
        self.root.display().to_string()
    }
    fn get(&self, name: &str, limit: u64) -> io::Result<Vec<u8>> {
        let _ = (name, limit);
        todo!()
    }
    fn get_range(&self, name: &str, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let _ = (name, offset, len);
        todo!()
    }
    fn len(&self, name: &str) -> io::Result<u64> {
        let _ = name;
        todo!()
    }
    fn put(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let _ = (name, data);
        todo!()
    }
    fn delete(&self, name: &str) -> io::Result<()> {
        let _ = name;
        todo!()
    }
    fn list(&self, prefix: &str) -> io::Result<Vec<(String, u64)>> {
        let _ = prefix;
        todo!()
    }
}
