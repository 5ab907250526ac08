//! Generates the librbd/librados declarations from the installed headers
//! (Debian: librbd-dev, librados-dev) and links the two libraries.

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rustc-link-lib=rbd");
    println!("cargo:rustc-link-lib=rados");
    let bindings = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("rbd_.*")
        .allowlist_function("rados_.*")
        .allowlist_type("rbd_.*")
        .allowlist_var("RBD_.*")
        .allowlist_var("LIBRADOS_.*")
        .layout_tests(false)
        .generate()
        .unwrap_or_else(|e| {
            panic!("bindgen failed on rbd/librbd.h ({e}): install librbd-dev, librados-dev and libclang-dev")
        });
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings.write_to_file(out.join("bindings.rs")).expect("writing bindings.rs into OUT_DIR");
}
