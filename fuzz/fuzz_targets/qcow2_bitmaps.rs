#![no_main]
//! A hostile qcow2 image's persistent bitmaps (extension, directory, tables, data):
//! load them, list them and walk their dirty runs.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ferry_qcow2::fuzz_bitmaps(data));
