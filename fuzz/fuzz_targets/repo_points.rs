#![no_main]
//! ferry-repo's parser of point records (`points/TAG/ID`, FORMAT.md "Points": which
//! snapshot of each of a domain's disks one instant made), as opened from the store: any
//! bytes are refused or taken without a panic, bounded before they are parsed, and a
//! point taken reads back the same from the JSON it is stored as.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_repo::points::fuzz(data);
});
