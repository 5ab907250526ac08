#![no_main]
//! A request header (first byte picks compact or extended), its payload plan, and
//! validation against a session built from the bytes after the header.
use ferry_proto::consts::MAX_PAYLOAD;
use ferry_proto::request::{Command, PayloadPlan, RequestHeader, Session};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, buf)) = data.split_first() else {
        return;
    };
    let extended = sel & 1 != 0;
    let Ok(Some(h)) = RequestHeader::parse(buf, extended) else {
        return;
    };
    match h.check_payload(extended) {
        Ok(PayloadPlan::Receive(n)) => assert!(n as u64 <= u64::from(MAX_PAYLOAD)),
        Ok(PayloadPlan::Drain(n)) => assert!(!extended && n > u64::from(MAX_PAYLOAD)),
        Err(_) => assert!(extended),
    }
    let mut enc = Vec::new();
    h.encode(extended, &mut enc);
    assert_eq!(&enc[..], &buf[..RequestHeader::wire_len(extended)]);

    // Session from the rest: size u64, flags u16, then one byte of switches.
    let s = &buf[RequestHeader::wire_len(extended)..];
    let mut b = [0u8; 11];
    b[..s.len().min(11)].copy_from_slice(&s[..s.len().min(11)]);
    let sw = b[10];
    let session = Session {
        size: u64::from_be_bytes(b[0..8].try_into().unwrap()),
        flags: u16::from_be_bytes([b[8], b[9]]),
        extended,
        chunked: extended || sw & 1 != 0,
        meta_contexts: if sw & 2 != 0 { vec![(1, 0), (2, 1), (5, 2)] } else { Vec::new() },
        min_block: 1 << (sw >> 4 & 0xf).min(12),
        max_payload: MAX_PAYLOAD,
    };
    // What follows the session bytes is the payload (a BLOCK_STATUS context filter).
    let payload = s.get(11..).unwrap_or_default();
    if let Ok(cmd) = session.validate_with(&h, payload) {
        let (off, len) = match cmd {
            Command::Read { offset, length, .. } | Command::Write { offset, length, .. } => {
                assert!(length <= session.max_payload);
                (offset, u64::from(length))
            }
            Command::Trim { offset, length, .. }
            | Command::Cache { offset, length }
            | Command::WriteZeroes { offset, length, .. }
            | Command::BlockStatus { offset, length, .. } => (offset, length),
            Command::Disc | Command::Flush => return,
        };
        // A valid command is in range, non-empty and aligned.
        assert!(len > 0 && off.checked_add(len).is_some_and(|e| e <= session.size));
        let mb = u64::from(session.min_block);
        assert!(off % mb == 0 && len % mb == 0);
    }
});
