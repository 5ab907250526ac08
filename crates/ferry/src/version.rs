//! `ferry --version`: the version line (`ferry X.Y.Z`, which other tools parse), then the
//! build's optional features and the versions of the libraries that matter, as linked at
//! run time. `-V` prints the first line only.

/// Everything after `ferry ` that `--version` prints (clap wants it for the process's
/// lifetime: it is computed once).
pub fn long() -> &'static str {
    static LONG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    LONG.get_or_init(compute)
}

fn compute() -> String {
    let mut s = env!("CARGO_PKG_VERSION").to_string();
    if cfg!(feature = "rbd") {
        s += "\nrbd: on";
    } else {
        s += "\nrbd: off (built without the rbd feature)";
    }
    #[cfg(feature = "rbd")]
    {
        s += &format!("\nlibrbd: {}", ferry_rbd::librbd_version());
    }
    s += &format!("\nopenssl: {}", openssl::version::version());
    s += &format!("\nzstd: {}", zstd::zstd_safe::version_string());
    s
}
