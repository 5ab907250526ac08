//! Reading the machine-readable output of nbdinfo, qemu-img and fio: serde_json's
//! `Value` with a few accessors that fail the test with the document when a key is
//! missing or of the wrong type.

pub use serde_json::Value as Json;

pub trait JsonExt {
    fn must_parse(s: &str) -> Json;
    fn at(&self, key: &str) -> &Json;
    fn u64_at(&self, key: &str) -> u64;
    fn bool_at(&self, key: &str) -> bool;
    fn array_at(&self, key: &str) -> &[Json];
}

impl JsonExt for Json {
    #[track_caller]
    fn must_parse(s: &str) -> Json {
        serde_json::from_str(s).unwrap_or_else(|e| panic!("invalid JSON ({e}):\n{s}"))
    }
    /// `self[key]`, panicking with the document if absent.
    #[track_caller]
    fn at(&self, key: &str) -> &Json {
        self.get(key).unwrap_or_else(|| panic!("JSON has no key {key:?}: {self}"))
    }
    #[track_caller]
    fn u64_at(&self, key: &str) -> u64 {
        self.at(key).as_u64().unwrap_or_else(|| panic!("{key:?} is not an unsigned integer in {self}"))
    }
    #[track_caller]
    fn bool_at(&self, key: &str) -> bool {
        self.at(key).as_bool().unwrap_or_else(|| panic!("{key:?} is not a boolean in {self}"))
    }
    #[track_caller]
    fn array_at(&self, key: &str) -> &[Json] {
        self.at(key).as_array().map(Vec::as_slice).unwrap_or_else(|| panic!("{key:?} is not an array in {self}"))
    }
}
