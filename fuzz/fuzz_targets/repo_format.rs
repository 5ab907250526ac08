#![no_main]
//! ferry-repo's parsers of what a repository's store holds (FORMAT.md): config, pack
//! tails and trailers, index objects, pages and located pages, manifests (versions 1 and
//! 2, with page hints), checkpoints, locks, key objects, damage records; and a blob's
//! decoding (plain, whose zstd frame must never decompress past its limit, and encrypted
//! in format versions 1, 2 and 3).
use ferry_repo::blob;
use ferry_repo::crypto::Crypto;
use ferry_repo::format::{self, BlobKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    format::fuzz(data);
    if let Ok(plain) = blob::decode(&Crypto::None, BlobKind::Data, &blob::digest(&[]), data, 65536) {
        assert!(plain.is_empty());
    }
    // Encrypted, in every format version (one key; a key per object): forged bytes never
    // open, whatever their lengths.
    for version in [1, 2, 3] {
        let c = ferry_repo::crypto::fixed_for_fuzzing(version);
        assert!(blob::decode(&c, BlobKind::Data, &blob::digest(&[]), data, 65536).is_err());
        assert!(blob::decode(&c, BlobKind::Located, &blob::digest(&[]), data, 2 + 74 * 256).is_err());
        assert!(c.open(b"ferry snapshot", data).is_err());
    }
});
