#![no_main]
//! ferry-repo's parser of what this host knows of a repository it used (crates/repo/src/
//! known.rs: `STATE/repositories/HEX`, kept between runs to notice a store that went
//! back): a file of this host, never trusted. Any bytes are refused or taken without a
//! panic, and a record taken reads back the same.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_repo::known::fuzz(data);
});
