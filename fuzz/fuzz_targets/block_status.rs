#![no_main]
//! Block status chunk payloads (compact and extended) from an untrusted server: what
//! parses re-encodes to the same bytes. Input: one byte choosing the chunk type, then
//! the payload.
use ferry_proto::consts::*;
use ferry_proto::reply::{parse_block_status, ReplyMode, ReplyWriter};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, p)) = data.split_first() else {
        return;
    };
    let ty = [REPLY_TYPE_BLOCK_STATUS, REPLY_TYPE_BLOCK_STATUS_EXT, sel.into()][usize::from(sel % 3)];
    let mut ex = Vec::new();
    let Ok(id) = parse_block_status(ty, p, &mut ex) else {
        return;
    };
    let (mode, head, entry) = match ty {
        REPLY_TYPE_BLOCK_STATUS => (ReplyMode::Structured, STRUCTURED_REPLY_LEN, 8),
        REPLY_TYPE_BLOCK_STATUS_EXT => (ReplyMode::Extended, EXTENDED_REPLY_LEN, 16),
        t => panic!("block status parsed from chunk type {t}"),
    };
    let fixed = if entry == 8 { 4 } else { 8 };
    assert!(!ex.is_empty());
    assert_eq!(ex.len(), (p.len() - fixed) / entry, "every descriptor is read once");
    let mut v = Vec::new();
    ReplyWriter::new(mode).block_status(7, 0, id, &ex, &mut v);
    // Extended descriptors carry 64-bit flags of which ferry keeps the low 32 bits.
    let high_flags = entry == 16 && p[fixed..].chunks(16).any(|d| d[8..12] != [0; 4]);
    if !high_flags {
        assert_eq!(&v[head..], p, "re-encoding gives other bytes");
    }
});
