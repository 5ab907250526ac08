#![no_main]
//! Reply headers and chunk payloads as ferry's client receives them from a server it
//! does not trust. Input: one byte choosing the reply mode, then the server's stream.
use ferry_proto::consts::*;
use ferry_proto::reply::{parse_block_status, parse_error_chunk, ReplyHeader, ReplyMode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, mut buf)) = data.split_first() else {
        return;
    };
    let mode = [ReplyMode::Simple, ReplyMode::Structured, ReplyMode::Extended][usize::from(sel % 3)];
    while let Ok(Some((h, n))) = ReplyHeader::parse(buf, mode) {
        assert!(n <= buf.len(), "header longer than the input");
        assert_eq!(ReplyHeader::parse(&buf[..n - 1], mode), Ok(None), "a cut header must ask for more");
        let rest = &buf[n..];
        match h {
            ReplyHeader::Simple { .. } => {
                assert_ne!(mode, ReplyMode::Extended, "simple reply accepted with extended headers");
                assert_eq!(n, SIMPLE_REPLY_LEN);
                buf = rest;
            }
            ReplyHeader::Chunk { ty, length, .. } => {
                assert_ne!(mode, ReplyMode::Simple, "chunk accepted without structured replies");
                assert!(mode != ReplyMode::Extended || length <= u64::from(MAX_PAYLOAD) + 4096);
                let take = usize::try_from(length).unwrap_or(usize::MAX).min(rest.len());
                let p = &rest[..take];
                if ty & 0x8000 != 0 {
                    if let Ok((_, _, off)) = parse_error_chunk(ty, p) {
                        assert_eq!(off.is_some(), ty == REPLY_TYPE_ERROR_OFFSET);
                    }
                }
                if ty == REPLY_TYPE_BLOCK_STATUS || ty == REPLY_TYPE_BLOCK_STATUS_EXT {
                    let mut ex = Vec::new();
                    if parse_block_status(ty, p, &mut ex).is_ok() {
                        assert!(!ex.is_empty(), "block status without extents accepted");
                    }
                }
                buf = &rest[take..];
            }
        }
    }
});
