//! A store in memory, for tests.
use super::{invalid_name, valid_name, Store};
use std::collections::BTreeMap;
use std::io;
use std::sync::Mutex;

#[derive(Default)]
pub struct MemStore {
    objects: Mutex<BTreeMap<String, Vec<u8>>>,
}

impl MemStore {
    pub fn new() -> MemStore {
        MemStore::default()
    }
    /// Replaces an object's bytes behind the repository's back (tests of damage).
    pub fn tamper(&self, name: &str, f: impl FnOnce(&mut Vec<u8>)) {
        if let Some(v) = self.objects.lock().unwrap().get_mut(name) {
            f(v)
        }
    }
}

fn not_found(name: &str) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("{name}: no such object"))
}

impl Store for MemStore {
    fn describe(&self) -> String {
        "memory store".into()
    }
    fn get(&self, name: &str, limit: u64) -> io::Result<Vec<u8>> {
        let m = self.objects.lock().unwrap();
        let v = m.get(name).ok_or_else(|| not_found(name))?;
        if v.len() as u64 > limit {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{name} is larger than {limit} bytes")));
        }
        Ok(v.clone())
    }
    fn get_range(&self, name: &str, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let m = self.objects.lock().unwrap();
        let v = m.get(name).ok_or_else(|| not_found(name))?;
        let end = offset.checked_add(len).filter(|&e| e <= v.len() as u64).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{name} ends before byte {}", offset.saturating_add(len)),
            )
        })?;
        Ok(v[offset as usize..end as usize].to_vec())
    }
    fn len(&self, name: &str) -> io::Result<u64> {
        let m = self.objects.lock().unwrap();
        Ok(m.get(name).ok_or_else(|| not_found(name))?.len() as u64)
    }
    fn put(&self, name: &str, data: &[u8]) -> io::Result<()> {
        if !valid_name(name) {
            return Err(invalid_name(name));
        }
        self.objects.lock().unwrap().insert(name.to_string(), data.to_vec());
        Ok(())
    }
    fn delete(&self, name: &str) -> io::Result<()> {
        self.objects.lock().unwrap().remove(name);
        Ok(())
    }
    fn list(&self, prefix: &str) -> io::Result<Vec<(String, u64)>> {
        let m = self.objects.lock().unwrap();
        Ok(m.range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.len() as u64))
            .collect())
    }
}
