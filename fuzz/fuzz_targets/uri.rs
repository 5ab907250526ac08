#![no_main]
//! NBD URIs as `ferry copy` and `ferry info` take them from the command line.
use ferry_client::{Transport, Uri};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(u) = Uri::parse(s) else {
        return;
    };
    match &u.transport {
        Transport::Tcp { host, .. } => assert!(!host.is_empty(), "TCP URI without a host"),
        Transport::Unix { path } => assert!(!path.as_os_str().is_empty(), "Unix URI without a socket"),
    }
    let _ = u.to_string();
});
