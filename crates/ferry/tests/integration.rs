//! ferry's integration tests, one module per file, built as one test binary: one
//! compile and link (with the release profile's LTO) instead of one for every file,
//! which took most of the suite's build time.
//!
//! Run one file's tests with its module name as the filter:
//! `cargo test --release -p ferry --test integration copy_resume::`.

mod common;

mod activation;
mod admin;
mod bench_socket;
mod cli;
mod client_tools;
mod conns;
mod copy_proof;
mod copy_rate;
mod copy_resume;
mod copy_retry;
mod dirty_copy;
mod docs;
mod everyday;
mod faults;
mod hostile_clients;
mod hostile_remotes;
mod hostile_servers;
mod incremental_backup;
mod interop_fio;
mod interop_libnbd;
mod interop_qemu;
mod interop_tls;
mod libvirt;
mod libvirt_remote;
mod lifecycle;
mod locking;
mod man;
mod meta_contexts;
mod mount;
mod peer_spellings;
mod qcow2;
mod qcow2_bitmaps;
mod qcow2_compact;
mod qcow2_overlay;
mod qcow2_safety;
mod rbd;
mod remote_images;
mod repo_backup;
mod repo_base;
mod repo_bounded;
mod repo_copy;
mod repo_crash;
mod repo_filter;
mod repo_gc;
mod repo_heal;
mod repo_keys;
mod repo_list;
mod repo_located;
mod repo_locks;
mod repo_recover;
mod repo_resume;
mod repo_s3;
mod repo_scale;
mod repo_trust;
mod resume_safety;
mod retention;
mod robustness;
mod untrusted_images;
mod zerocopy;
