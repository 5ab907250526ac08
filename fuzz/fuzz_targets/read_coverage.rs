#![no_main]
//! The client's record of which bytes of a READ a server's chunks covered, against a
//! byte map. Input: a 2-byte request length (at most 64 KiB), then 4-byte chunks
//! (2-byte offset relative to the request, 2-byte length).
use ferry_proto::reply::ReadCoverage;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let total = u64::from(u16::from_be_bytes([data[0], data[1]]));
    let mut seen = vec![false; total as usize];
    let mut c = ReadCoverage::new();
    for ch in data[2..].chunks_exact(4) {
        let rel = u64::from(u16::from_be_bytes([ch[0], ch[1]]));
        let len = u64::from(u16::from_be_bytes([ch[2], ch[3]]));
        let fits = len > 0 && rel + len <= total && seen[rel as usize..(rel + len) as usize].iter().all(|&s| !s);
        let before = c.covered();
        match c.add(rel, len, total) {
            Ok(()) => {
                assert!(fits, "accepted {len} bytes at {rel} of {total}");
                seen[rel as usize..(rel + len) as usize].fill(true);
                assert_eq!(c.covered(), before + len);
            }
            Err(_) => {
                assert!(!fits, "refused {len} bytes at {rel} of {total}");
                assert_eq!(c.covered(), before);
            }
        }
        assert_eq!(c.covered(), seen.iter().filter(|&&s| s).count() as u64);
    }
});
