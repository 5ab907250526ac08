#![no_main]
//! Specs as every command takes them (`ferry_open::Location::parse`), and the parsers of
//! remote stores: HTTP header values (`Content-Range`, `no_proxy`), `s3://` URLs, the AWS
//! CLI's INI files, the tags of S3's XML answers.
use ferry_open::{Location, Store};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(Location::Image { store: Store::S3(u), .. }) = Location::parse(s) {
        assert!(u.len() > 5, "an s3:// location without a bucket and key");
    }
    ferry_http::fuzz(s);
    ferry_s3::fuzz(s);
});
