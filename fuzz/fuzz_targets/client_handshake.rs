#![no_main]
//! The client side of the handshake fed a server's bytes in pieces. Input: one byte of
//! switches (extended, structured, meta context, list, TLS, piece sizes), then the
//! server's stream. STARTTLS is taken as a TLS handshake that succeeded.
use ferry_proto::client::{ClientConfig, ClientHandshake, ClientProgress};
use ferry_proto::consts::*;
use ferry_proto::ReplyMode;
use libfuzzer_sys::fuzz_target;

/// What the client sent after its flags: whole options, each with the option magic.
fn check_options(mut b: &[u8]) {
    while !b.is_empty() {
        assert!(b.len() >= 16 && b.starts_with(&IHAVEOPT.to_be_bytes()), "option framing");
        let len = u32::from_be_bytes(b[12..16].try_into().unwrap()) as usize;
        assert!(b.len() >= 16 + len, "option framing");
        b = &b[16 + len..];
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&sw, input)) = data.split_first() else {
        return;
    };
    let cfg = ClientConfig {
        export: "disk".into(),
        extended: sw & 1 != 0,
        structured: sw & 2 != 0,
        meta_context: sw & 4 != 0,
        list: sw & 8 != 0,
        tls: sw & 16 != 0,
        // Several contexts (ids and names the server grants are checked), or a listing.
        contexts: vec![META_BASE_ALLOCATION.into(), format!("{META_DIRTY_BITMAP_PREFIX}b0")],
        list_contexts: sw & 32 != 0,
    };
    let max = usize::from(sw >> 6) * 7 + 1;
    let mut hs = ClientHandshake::new(cfg.clone());
    let mut out = Vec::new();
    let (mut pos, mut avail) = (0, 0);
    let mut greeted = false;
    loop {
        avail = (avail + 1 + (pos * 31 + avail) % max).min(input.len());
        let before = out.len();
        let Ok((n, p)) = hs.feed(&input[pos..avail], &mut out) else { return };
        assert!(n <= avail - pos, "consumed more than it was given");
        if n > 0 && !greeted {
            greeted = true;
            assert!(out.len() >= before + 4, "no client flags after the greeting");
            check_options(&out[before + 4..]);
        } else if !matches!(p, ClientProgress::Connected(_)) {
            check_options(&out[before..]);
        }
        pos += n;
        match p {
            ClientProgress::Continue => {}
            ClientProgress::StartTls => {
                assert!(cfg.tls, "STARTTLS without asking for TLS");
                let b = out.len();
                hs.tls_started(&mut out);
                check_options(&out[b..]);
            }
            ClientProgress::Connected(neg) => {
                assert!(!cfg.list);
                if neg.used_go {
                    assert_ne!(neg.flags & FLAG_HAS_FLAGS, 0, "GO finished without NBD_INFO_EXPORT");
                }
                match neg.mode {
                    Some(ReplyMode::Extended) => assert!(cfg.extended),
                    Some(ReplyMode::Structured) => assert!(cfg.structured),
                    Some(ReplyMode::Simple) => panic!("simple mode is None"),
                    None => {}
                }
                assert!(neg.meta_context.is_none() || (cfg.meta_context && neg.mode.is_some()));
                // Every granted context was asked for, each id and each name once.
                for (i, (id, name)) in neg.contexts.iter().enumerate() {
                    assert!(cfg.contexts.contains(name), "granted a context not asked for");
                    assert!(neg.contexts[..i].iter().all(|(j, n)| j != id && n != name), "granted twice");
                }
                assert!(hs.feed(&input[pos..], &mut Vec::new()).is_err(), "bytes after the handshake");
                return;
            }
            ClientProgress::ContextsListed(names) => {
                assert!(cfg.list_contexts);
                assert!(names.len() <= 65536, "unbounded listing");
                assert!(hs.feed(&input[pos..], &mut Vec::new()).is_err(), "bytes after the listing");
                return;
            }
            ClientProgress::Listed(_) => {
                assert!(cfg.list);
                assert!(hs.feed(&input[pos..], &mut Vec::new()).is_err(), "bytes after the listing");
                return;
            }
        }
        if n == 0 && avail == input.len() {
            return;
        }
    }
});
