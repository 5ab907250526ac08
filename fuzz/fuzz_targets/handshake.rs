#![no_main]
//! The server handshake fed in pieces against a fixed two-export catalog.
//! Input: one byte choosing the TLS policy (seed % 3) and the read sizes (seed / 3),
//! then the client's byte stream. STARTTLS is taken as a TLS handshake that succeeded.
use ferry_proto::consts::{REPLY_MAGIC, REP_ACK};
use ferry_proto::export::{BlockSize, Capabilities, ExportInfo};
use ferry_proto::handshake::{Catalog, Progress, ServerHandshake, TlsPolicy};
use libfuzzer_sys::fuzz_target;

struct Two;
impl Catalog for Two {
    fn export(&self, name: &str) -> Option<ExportInfo> {
        let (name, size, read_only) = match name {
            "" | "disk" => ("disk", 1 << 20, false),
            "ro" => ("ro", 4096, true),
            _ => return None,
        };
        Some(ExportInfo {
            name: name.into(),
            description: format!("{name} export"),
            size,
            caps: Capabilities { read_only, flush: true, trim: true, zero: true, extents: true, ..Default::default() },
            block_size: BlockSize { minimum: 512, ..BlockSize::default() },
        })
    }
    fn list(&self) -> Vec<(String, String)> {
        vec![("disk".into(), "disk export".into()), ("ro".into(), "ro export".into())]
    }
    fn contexts(&self, name: &str) -> Vec<String> {
        let all = ["base:allocation", "qemu:allocation-depth", "qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b1"];
        let n = if name == "disk" { all.len() } else { 1 };
        all[..n].iter().map(|s| s.to_string()).collect()
    }
}

/// What one `feed` sent: whole option replies, the last one final (ACK or an error),
/// or the NBD_OPT_EXPORT_NAME answer (size, flags, maybe 124 zeroes).
fn check_sent(mut b: &[u8], transmission: bool, must_not_leak: bool) {
    if b.is_empty() || (transmission && !b.starts_with(&REPLY_MAGIC.to_be_bytes())) {
        return assert!(b.is_empty() || b.len() == 10 || b.len() == 134, "EXPORT_NAME answer");
    }
    let mut last = 0;
    while !b.is_empty() {
        assert!(b.len() >= 20 && b.starts_with(&REPLY_MAGIC.to_be_bytes()), "reply framing");
        last = u32::from_be_bytes(b[12..16].try_into().unwrap());
        // REP_SERVER, REP_INFO, REP_META_CONTEXT: what --tls=require hides before TLS.
        assert!(!(must_not_leak && (2..=4).contains(&last)), "information leaked before TLS");
        let len = u32::from_be_bytes(b[16..20].try_into().unwrap()) as usize;
        assert!(b.len() >= 20 + len, "reply framing");
        b = &b[20 + len..];
    }
    assert!(last == REP_ACK || last & 0x8000_0000 != 0, "answer ends with a final reply");
}

fuzz_target!(|data: &[u8]| {
    let Some((&seed, input)) = data.split_first() else {
        return;
    };
    let mut out = Vec::new();
    let policy = [TlsPolicy::Off, TlsPolicy::On, TlsPolicy::Require][usize::from(seed % 3)];
    let mut hs = ServerHandshake::with_tls(&mut out, policy);
    assert_eq!(out.len(), 18);
    // Short reads: the first byte bounds the piece size, the position varies it.
    let max = usize::from(seed / 3) + 1;
    let (mut pos, mut avail) = (0, 0);
    loop {
        avail = (avail + 1 + (pos * 31 + avail) % max).min(input.len());
        let before = out.clone();
        let r = hs.feed(&input[pos..avail], &Two, &mut out);
        assert!(out.starts_with(&before), "output only grows");
        let Ok((n, p)) = r else { return };
        assert!(n <= avail - pos, "consumed more than it was given");
        pos += n;
        assert_eq!(hs.is_done(), p != Progress::Continue && p != Progress::StartTls);
        let must_not_leak = policy == TlsPolicy::Require && !hs.tls_active();
        check_sent(&out[before.len()..], matches!(p, Progress::Transmission(_)), must_not_leak);
        if p == Progress::StartTls {
            assert_ne!(policy, TlsPolicy::Off, "STARTTLS accepted with TLS off");
            assert!(!hs.tls_active(), "STARTTLS accepted twice");
            hs.tls_started();
        }
        if let Progress::Transmission(neg) = &p {
            let s = neg.session();
            assert!(s.size == 1 << 20 || s.size == 4096);
            // Selected contexts: real indexes of this export's list, ids never repeated.
            let n = Two.contexts(&neg.export.name).len();
            for (i, &(id, idx)) in neg.meta_contexts.iter().enumerate() {
                assert!(idx < n, "context index out of range");
                assert!(neg.meta_contexts[..i].iter().all(|&(d, j)| d != id && j != idx), "duplicate context");
            }
            assert_eq!(s.min_block, 512);
        }
        if hs.is_done() {
            // Finished: any further byte is an error and nothing more is sent.
            let len = out.len();
            assert!(hs.feed(&input[pos..], &Two, &mut out).is_err());
            return assert_eq!(out.len(), len);
        }
        if n == 0 && avail == input.len() {
            return; // no progress and nothing more to give
        }
    }
});
