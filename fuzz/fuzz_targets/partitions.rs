#![no_main]
//! A hostile partition table: an MBR (with a chain of extended boot records) or a GPT
//! behind a protective MBR, on a disk whose size the first 4 bytes give.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ferry_open::partitions::fuzz_scan(data));
