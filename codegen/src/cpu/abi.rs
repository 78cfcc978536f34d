//! The launch ABI of CPU kernels: the argument records the runtime fills and the generated code
//! reads, the tile codes, the scratch layout and the microkernels generated code calls.
//!
//! Generated functions take one argument, a pointer to their record. Every pointer is to f32
//! (inputs are converted to f32 by the runtime; accumulation is f32 throughout). Strides are in
//! elements.

use crate::plan::{K_TILE, KernelPlan};

/// Arguments of the generated `pack_k` function: rotate (RoPE) and transpose the keys of one
/// (batch, kv head) into tiles of [`K_TILE`] keys, `kt[tile][dim][key]`, zero-padded.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PackArgs {
    /// Row 0 of K for this (batch, kv head); rows are `qk_dim` contiguous values.
    pub k: *const f32,
    /// Elements between consecutive rows of `k`.
    pub k_row_stride: i64,
    /// Number of keys.
    pub skv: i64,
    /// Absolute position of key 0.
    pub k_pos0: i64,
    /// RoPE tables `[position - table_pos0][rope_dim / 2]` (cos and sin, attention factor
    /// applied); unused without RoPE.
    pub rope_cos: *const f32,
    /// See `rope_cos`.
    pub rope_sin: *const f32,
    /// The position of the tables' row 0.
    pub table_pos0: i64,
    /// Output: `ceil(skv / K_TILE) * qk_dim * K_TILE` values.
    pub kt: *mut f32,
}

/// Arguments of the generated `block` function: a block of query rows of one (batch, head)
/// against all keys.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockArgs {
    /// Row 0 of the block's queries (`qk_dim` contiguous values per row, before RoPE).
    pub q: *const f32,
    /// Elements between query rows.
    pub q_row_stride: i64,
    /// Rows in this block (at most the plan's `q_rows`).
    pub rows: i64,
    /// Absolute position of row 0.
    pub q_pos0: i64,
    /// Index of row 0 in the call.
    pub qi0: i64,
    /// Batch index.
    pub batch: i64,
    /// Query head.
    pub head: i64,
    /// Packed keys of this (batch, kv head), from `pack_k`.
    pub kt: *const f32,
    /// Row 0 of V for this (batch, kv head).
    pub v: *const f32,
    /// Elements between rows of V.
    pub v_row_stride: i64,
    /// Number of keys.
    pub skv: i64,
    /// Absolute position of key 0.
    pub k_pos0: i64,
    /// One [`TileCode`] per key tile, for this block.
    pub tile_codes: *const u8,
    /// Output rows (`v_dim` values each).
    pub out: *mut f32,
    /// Elements between output rows.
    pub out_row_stride: i64,
    /// Output: one log-sum-exp per row.
    pub lse: *mut f32,
    /// Scratch of [`ScratchLayout::total`] values, private to the caller's thread.
    pub scratch: *mut f32,
    /// RoPE tables, as in [`PackArgs`].
    pub rope_cos: *const f32,
    /// See `rope_cos`.
    pub rope_sin: *const f32,
    /// See [`PackArgs::table_pos0`].
    pub table_pos0: i64,
}

/// How a block meets one key tile (from the plan's interval classification).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileCode {
    /// Every pair masked: the tile is skipped.
    Skip = 0,
    /// Every pair kept: no per-element mask.
    Full = 1,
    /// The mask is evaluated per element.
    Masked = 2,
}

/// Offsets (in f32 values) of the block function's scratch areas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchLayout {
    /// Rotated queries, `q_rows x qk_dim`.
    pub q: usize,
    /// Scores / probabilities, `q_rows x K_TILE`.
    pub s: usize,
    /// Output accumulator, `q_rows x v_dim`.
    pub acc: usize,
    /// Running max per row.
    pub m: usize,
    /// Running sum per row.
    pub l: usize,
    /// Per-row max of the raw scores of the current tile (written by `qk_tile`).
    pub tile_max: usize,
    /// Total values.
    pub total: usize,
}

impl ScratchLayout {
    /// The layout for a plan.
    pub fn of(plan: &KernelPlan) -> Self {
        let rows = plan.tiles.q_rows as usize;
        let q = 0;
        let s = q + rows * plan.shape.qk_dim as usize;
        let acc = s + rows * K_TILE as usize;
        let m = acc + rows * plan.shape.v_dim as usize;
        let l = m + rows;
        let tile_max = l + rows;
        ScratchLayout {
            q,
            s,
            acc,
            m,
            l,
            tile_max,
            total: tile_max + rows,
        }
    }
}

/// Values of packed K for `skv` keys.
pub fn packed_k_len(plan: &KernelPlan, skv: usize) -> usize {
    skv.div_ceil(K_TILE as usize) * plan.shape.qk_dim as usize * K_TILE as usize
}

/// Addresses of the native functions generated code calls. All use the C ABI.
#[derive(Clone, Copy, Debug)]
pub struct Imports {
    /// `qk_tile(q, q_row_stride, rows, dim, kt, s, row_max)`: `s[r][j] = sum_d q[r][d] *
    /// kt[d][j]` for `r < rows`, `j < K_TILE`, and `row_max[r] = max_j s[r][j]`; `s` has rows of
    /// `K_TILE` values.
    pub qk_tile: usize,
    /// `pv_tile(p, rows, cols, v, v_row_stride, acc, dv)`: `acc[r][:dv] += sum_{j < cols}
    /// p[r][j] * v[j][:dv]`; `p` has rows of `K_TILE` values, `acc` rows of `dv`.
    pub pv_tile: usize,
    /// `logf(x: f32) -> f32`, the natural logarithm (used once per row, and for `ln` in
    /// modifiers).
    pub logf: usize,
}
