//! Decode plans lowered to GPU IR: the query rows of one work item (the query heads of a kv
//! head times a few queries) against a list of key segments read where a cache keeps them (the
//! rows of its pages: no gather), for one partition of the keys; a second kernel
//! (`layers::merge_partitions`) merges partitions by their log-sum-exp (split-KV). [`lower`]
//! picks the kernel: on tensor cores for 16-bit caches ([`tc`], warps over keys;
//! [`wide`], warps over head dims, for MLA), else the SIMT f32 kernel of this
//! module ([`lower_simt`]), which runs any decode plan.
//!
//! Buffers: `q_rows` (f32 `[rows][qk_dim]`, before RoPE), `tasks` (per CTA, nine i64: first row,
//! rows, queries per head, position and call index of query 0, batch, first head, first segment,
//! segments), `segments` (seven i64 each: key row address, value row address (each plus the
//! launch's `k_base` or `v_base`), first key, keys, tile code, elements between key rows,
//! between value rows; rows of `qk_dim` or `v_dim` values in the cache's dtype, f32, bf16 or
//! f16), `out` (f32 `[rows][v_dim]`, normalized), `lse` (f32
//! per row), RoPE tables for the query positions. Keys sit at the positions of their indices,
//! rotated already.

mod mma;
pub mod pages;
mod records;
mod simt;
pub mod tc;
pub mod wide;

use crate::gpu::ir::Kernel;
use crate::plan::KernelPlan;
pub use records::{SEGMENT_FIELDS, TASK_FIELDS, THREADS};
pub use simt::lower_simt;
use simt::{simt_segment_keys, simt_task_rows};

/// Keys per segment of a plan's decode kernel (the host's segment records follow it).
pub fn segment_keys(plan: &KernelPlan) -> u32 {
    if tc::supports(plan) {
        tc::SEGMENT_KEYS
    } else if wide::supports(plan) {
        wide::SEGMENT_KEYS
    } else {
        simt_segment_keys(plan)
    }
}

/// Query rows per task (work item) of a plan's decode kernel.
pub fn task_rows(plan: &KernelPlan) -> u32 {
    if tc::supports(plan) {
        tc::TASK_ROWS
    } else if wide::supports(plan) {
        wide::TASK_ROWS
    } else {
        simt_task_rows(plan)
    }
}

/// Lowers the decode kernel a plan runs: on tensor cores for 16-bit caches ([`tc`] for
/// per-head caches of head dims up to 256, [`wide`] for MLA's absorbed rows and wider
/// heads), else [`lower_simt`].
pub fn lower(plan: &KernelPlan) -> Kernel {
    if tc::supports(plan) {
        tc::lower(plan)
    } else if wide::supports(plan) {
        wide::lower(plan)
    } else {
        lower_simt(plan)
    }
}
