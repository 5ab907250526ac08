#![no_main]
//! A hostile qcow2 image held in memory: open it, read and ask block status.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ferry_qcow2::fuzz_image(data));
