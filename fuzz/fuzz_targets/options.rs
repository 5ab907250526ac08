#![no_main]
//! Option data of NBD_OPT_INFO/GO and NBD_OPT_{LIST,SET}_META_CONTEXT.
use ferry_proto::options::{parse_info_request, parse_meta_request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = parse_info_request(data) {
        // Every byte is accounted for: 4 + name + 2 + 2 * requests.
        assert_eq!(data.len(), 6 + r.name.len() + 2 * r.requests.len());
    }
    if let Ok(r) = parse_meta_request(data) {
        let q: usize = r.queries.iter().map(|q| 4 + q.len()).sum();
        assert_eq!(data.len(), 8 + r.export.len() + q);
    }
});
