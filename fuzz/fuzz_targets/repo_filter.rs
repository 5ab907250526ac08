#![no_main]
//! ferry-repo's decoder of the local index cache's filter files (crates/repo/src/bloom.rs,
//! FORMAT.md "Local index cache"): a header checked against the run it is bound to
//! before any room is made for its bits, then the bits and their checksum. Any bytes are
//! refused or taken without a panic, and a filter taken encodes to the bytes it came from.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_repo::runs::fuzz_filter(data);
});
