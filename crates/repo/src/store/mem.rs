//! A store in memory, for tests. It keeps when each object was written, by a clock of its
//! own: this machine's, moved by [`MemStore::set_clock_offset`] (a store whose clock is
//! off the reader's, or objects written long ago).
use super::{invalid_name, valid_name, Store, StoreTime};
use std::collections::BTreeMap;
use std::io;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

#[derive(Default)]
pub struct MemStore {
    objects: Mutex<BTreeMap<String, Vec<u8>>>,
    written: Mutex<BTreeMap<String, SystemTime>>,
    /// The store's clock minus this machine's, in seconds.
    offset: Mutex<i64>,
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
    /// Sets the store's clock to this machine's plus `secs` (negative: behind it).
    pub fn set_clock_offset(&self, secs: i64) {
        *self.offset.lock().unwrap() = secs;
    }
    fn now(&self) -> SystemTime {
        let off = *self.offset.lock().unwrap();
        let d = Duration::from_secs(off.unsigned_abs());
        if off >= 0 {
            SystemTime::now() + d
        } else {
            SystemTime::now() - d
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
    fn local(&self) -> bool {
        true
    }
    fn get(&self, name: &str, limit: u64) -> io::Result<Vec<u8>> {
        let m = self.objects.lock().unwrap();
        let v = m.get(name).ok_or_else(|| not_found(name))?;
        if v.len() as u64 > limit {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{name} is larger than {limit} bytes")));
        }
        Ok(v.clone())
    }
    fn get_timed(&self, name: &str, limit: u64) -> io::Result<(Vec<u8>, Option<StoreTime>)> {
        let v = self.get(name, limit)?;
        let modified = self.written.lock().unwrap().get(name).copied();
        Ok((v, modified.map(|modified| StoreTime { modified, now: Some(self.now()) })))
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
        let mut objects = self.objects.lock().unwrap();
        self.written.lock().unwrap().insert(name.to_string(), self.now());
        objects.insert(name.to_string(), data.to_vec());
        Ok(())
    }
    fn delete(&self, name: &str) -> io::Result<()> {
        let mut objects = self.objects.lock().unwrap();
        self.written.lock().unwrap().remove(name);
        objects.remove(name);
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
