//! Repository maintenance: check, verify, forget, gc, stats.
use crate::repo::{Repository, SnapshotInfo};
use crate::Result;
use serde::Serialize;

/// A problem found by check or verify, with the snapshots and ranges it hits.
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    /// The damaged object (a pack, an index object, a manifest).
    pub object: String,
    pub why: String,
    /// (snapshot id, disk name, byte offset, length) of every range that reads damaged data.
    pub hits: Vec<(String, String, u64, u64)>,
}

#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub snapshots: usize,
    pub packs: usize,
    pub blobs_checked: u64,
    pub bytes_read: u64,
    pub problems: Vec<Problem>,
    /// Things that are not damage (orphans, stale locks), said once each.
    pub notes: Vec<String>,
}

/// Metadata only: config, every index object, every manifest and its pages, every
/// referenced blob indexed, every indexed pack present with a plausible size.
pub fn check(repo: &Repository) -> Result<Report> {
    let _ = repo;
    todo!()
}

#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// Read this share of the packs (1..=100), chosen so that successive runs cover all.
    pub read_data_percent: u32,
    pub threads: usize,
}

/// check, then read each chosen pack once, whole, and check every blob in it.
pub fn verify(repo: &Repository, opts: &VerifyOptions) -> Result<Report> {
    let _ = (repo, opts);
    todo!()
}

#[derive(Debug, Clone, Default)]
pub struct Policy {
    pub keep_last: Option<u32>,
    pub keep_daily: Option<u32>,
    pub keep_weekly: Option<u32>,
    pub keep_monthly: Option<u32>,
}

/// What forget kept and removed, per disk.
#[derive(Debug, Default, Serialize)]
pub struct ForgetReport {
    pub kept: Vec<String>,
    pub removed: Vec<String>,
}

/// Applies `policy` to each disk (or only `name`): removes the manifests it does not keep.
pub fn forget(repo: &Repository, name: Option<&str>, policy: &Policy, dry_run: bool) -> Result<ForgetReport> {
    let _ = (repo, name, policy, dry_run);
    todo!()
}

/// Which snapshots `policy` keeps among one disk's, newest first (pure).
pub fn keep(snaps: &[SnapshotInfo], policy: &Policy) -> Vec<bool> {
    let _ = (snaps, policy);
    todo!()
}

#[derive(Debug, Default, Serialize)]
pub struct GcReport {
    pub packs_deleted: u64,
    pub packs_repacked: u64,
    pub blobs_freed: u64,
    pub bytes_freed: u64,
    pub bytes_before: u64,
    pub bytes_after: u64,
}

/// Frees what no snapshot references (FORMAT.md §9).
pub fn gc(repo: &Repository, wait: Option<std::time::Duration>) -> Result<GcReport> {
    let _ = (repo, wait);
    todo!()
}

#[derive(Debug, Default, Serialize)]
pub struct Stats {
    pub snapshots: u64,
    pub disks: u64,
    /// Sum of the snapshots' sizes.
    pub logical: u64,
    /// Bytes of the distinct chunks the snapshots reference, before compression.
    pub unique_plain: u64,
    /// Their stored bytes.
    pub unique_stored: u64,
    /// Bytes of every pack and index object in the store.
    pub store_bytes: u64,
    pub packs: u64,
    pub chunks: u64,
}

pub fn stats(repo: &Repository) -> Result<Stats> {
    let _ = repo;
    todo!()
}
