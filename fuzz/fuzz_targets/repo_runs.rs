#![no_main]
//! ferry-repo's parser of the local index cache's run files (crates/repo/src/runs.rs): a
//! header, tables and blocks read from a file this host wrote, but never trusted: any
//! bytes are refused or looked up in without a panic, and no count is allocated before it
//! is checked against the file's length.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_repo::runs::fuzz(data);
});
