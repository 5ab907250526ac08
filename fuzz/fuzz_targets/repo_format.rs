#![no_main]
//! ferry-repo's parsers of what a repository's store holds (FORMAT.md): config, pack
//! tails and trailers, index objects, pages, manifests, checkpoints, locks, damage records;
//! and a blob's decoding, whose zstd frame must never decompress past its limit.
use ferry_repo::blob;
use ferry_repo::crypto::Crypto;
use ferry_repo::format::{self, BlobKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    format::fuzz(data);
    if let Ok(plain) = blob::decode(&Crypto::None, BlobKind::Data, &blob::digest(&[]), data, 65536) {
        assert!(plain.is_empty());
    }
});
