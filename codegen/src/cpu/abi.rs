//! The launch ABI of CPU kernels: the argument records the runtime fills and the generated code
//! reads, the tile codes, the scratch layout and the microkernels generated code calls.
//!
//! Generated functions take one argument, a pointer to their record. Pointers are to f32
//! (forward inputs are converted to f32 by the runtime; accumulation is f32 throughout), except
//! decode's keys and values, which are read in the storage dtype of a cache. Strides are in
//! elements.

#[cfg(doc)]
use crate::plan::TileCode;
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
    /// One record per key tile: how this block meets it.
    pub tiles: *const BlockTile,
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
    /// The spec's parameters, concatenated in the order of [`crate::plan::ParamLayout`] (null without
    /// parameters).
    pub params: *const f32,
}

/// Arguments of the generated `decode` function: the query rows of some query heads of one kv
/// head (its GQA group), against a list of key segments read where they lie.
///
/// Row `r` is query head `head0 + r / q_len` and query `qi0 + r % q_len` of the call, at
/// position `q_pos0 + r % q_len`. Keys sit at the positions of their indices (a cache starts at
/// position 0).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DecodeArgs {
    /// Row 0 of the queries (`qk_dim` f32 values per row, before RoPE).
    pub q: *const f32,
    /// Elements between query rows.
    pub q_row_stride: i64,
    /// Rows (at most the plan's `q_rows`).
    pub rows: i64,
    /// Queries per head in this block.
    pub q_len: i64,
    /// Absolute position of query 0.
    pub q_pos0: i64,
    /// Index of query 0 in the call.
    pub qi0: i64,
    /// Batch index (sequence) for the score program.
    pub batch: i64,
    /// Query head of rows `0..q_len`.
    pub head0: i64,
    /// The key segments, in key order.
    pub segments: *const Segment,
    /// Number of segments.
    pub n_segments: i64,
    /// Elements between key rows inside a segment.
    pub k_row_stride: i64,
    /// Elements between value rows inside a segment.
    pub v_row_stride: i64,
    /// Output rows (`v_dim` f32 values each, normalized).
    pub out: *mut f32,
    /// Elements between output rows.
    pub out_row_stride: i64,
    /// Output: one log-sum-exp per row (`-inf` when no key was kept).
    pub lse: *mut f32,
    /// Scratch of [`ScratchLayout::total`] values, private to the caller's thread.
    pub scratch: *mut f32,
    /// RoPE tables for the queries, as in [`PackArgs`] (keys are stored rotated).
    pub rope_cos: *const f32,
    /// See `rope_cos`.
    pub rope_sin: *const f32,
    /// See [`PackArgs::table_pos0`].
    pub table_pos0: i64,
    /// As [`BlockArgs::params`].
    pub params: *const f32,
}

/// A run of at most [`K_TILE`] consecutive keys stored contiguously (rows of the storage dtype),
/// such as part of one page of a paged cache.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    /// Row 0 of its keys.
    pub k: *const u8,
    /// Row 0 of its values.
    pub v: *const u8,
    /// Index (= position) of its first key.
    pub first_key: i64,
    /// Number of keys, 1 to [`K_TILE`].
    pub len: i64,
    /// Its [`TileCode`] for the block's rows.
    pub code: i64,
}

/// How a forward block meets one key tile: its code, and for tiles it does not skip, the rows
/// that can keep a key (rows outside `first_row..end_row` are all masked and skipped).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockTile {
    /// A [`TileCode`].
    pub code: u32,
    /// First row of the block that meets the tile.
    pub first_row: u32,
    /// One past the last.
    pub end_row: u32,
    /// For a `Masked` tile, the first row from which every key is kept: rows from here to
    /// `end_row` run without the mask (the tile's key bound still applies when it is partial).
    pub kept_from: u32,
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
    /// Forward: `qk_tile(q, q_row_stride, rows, dim, kt, s, row_max)`: `s[r][j] = sum_d q[r][d] *
    /// kt[d][j]` for `r < rows`, `j < K_TILE`, and `row_max[r] = max_j s[r][j]` (none when
    /// `row_max` is null, as the backward passes it); `s` has rows of `K_TILE` values.
    pub qk_tile: usize,
    /// Forward: `pv_tile(p, rows, cols, v, v_row_stride, acc, dv)`: `acc[r][:dv] += sum_{j <
    /// cols} p[r][j] * v[j][:dv]`; `p` has rows of `K_TILE` values, `acc` rows of `dv`, `v` is f32.
    pub pv_tile: usize,
    /// Decode: `qk_rows(q, q_row_stride, rows, dim, k, k_row_stride, n, s, row_max, then,
    /// then_row_stride)`: `s[r][j] = sum_d q[r][d] * k[j][d]` for `j < n <= K_TILE`,
    /// `row_max[r] = max_{j < n} s[r][j]`; `k` in the plan's storage dtype. `then` (rows
    /// `then_row_stride` apart, or null) is what the kernel reads next, the segment's values:
    /// a hint to prefetch, never dereferenced.
    pub qk_rows: usize,
    /// Decode: `pv_rows(p, rows, cols, v, v_row_stride, acc, dv, then, then_row_stride)`:
    /// `pv_tile`'s contract with `v` in the plan's storage dtype; `then` as for `qk_rows` (the
    /// next segment's keys, null after the last).
    pub pv_rows: usize,
    /// `logf(x: f32) -> f32`, the natural logarithm (used once per row, and for `ln` in
    /// modifiers).
    pub logf: usize,
    /// Forward and decode: `exp_tile(s, rows, shift, sums)`: `s[r][j] = 2^(2 (s[r][j] -
    /// shift[r]))` and `sums[r] += sum_j s[r][j]` for `r < rows`, `j < K_TILE` (the online
    /// softmax's probabilities, scores in half base-2 units).
    pub exp_tile: usize,
    /// Forward: whether `qk_tile` multiplies the queries and keys exactly as stored (bf16
    /// pairs), so that the kernel leaves the queries unscaled and multiplies each tile's scores
    /// by `q_scale` after it; honoured only for plans that
    /// [`scales_scores`](super::scales_scores) allows.
    pub scores_after_qk: bool,
    /// Backward: `ds_tile(s, dp, rows, lse, delta, factor)`: with `h = lse[r] log2(e) / 2`,
    /// `s[r][j] = 2^(2 (s[r][j] - h))` and `dp[r][j] = s[r][j] (dp[r][j] - delta[r]) factor`
    /// for `j < K_TILE` (`delta` null: 0); rows whose `lse` is `-inf` become 0 in both.
    pub ds_tile: usize,
}

/// Arguments of the generated `rotate_rows` function of a backward kernel: `rows` rows of
/// `qk_dim` values in place, row `r` rotated by RoPE at position `pos0 + r` (when the plan has
/// RoPE) and then multiplied by `factor`. With tables whose sines are negated, it applies the
/// transposed rotation: the backward pass rotates dq and dk back with it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RotateArgs {
    /// Row 0.
    pub x: *mut f32,
    /// Elements between rows.
    pub row_stride: i64,
    /// Number of rows.
    pub rows: i64,
    /// Position of row 0.
    pub pos0: i64,
    /// Factor every value is multiplied by after the rotation.
    pub factor: f32,
    /// RoPE tables, as in [`PackArgs`]; unused without RoPE.
    pub rope_cos: *const f32,
    /// See `rope_cos`.
    pub rope_sin: *const f32,
    /// See [`PackArgs::table_pos0`].
    pub table_pos0: i64,
}

/// Arguments of the generated `grad_tile` function of a backward kernel: one block of query
/// rows of one (batch, head) against one key tile, in place. On entry `s` holds the raw scores
/// (`q_scale q . k` after RoPE) and `dp` holds `dO . v`; on return `s` holds the probabilities
/// `P = exp(score - lse)` and `dp` holds `dS = P (dP - D) * d score / d raw` (both 0 for
/// masked pairs, for keys past the tile's end, and for rows whose lse is `-inf`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GradTileArgs {
    /// Scores in, probabilities out: rows of [`K_TILE`] values.
    pub s: *mut f32,
    /// `dP` in, `dS` out: rows of [`K_TILE`] values. Under `normalize = stick_breaking` the
    /// buffer holds `2 K_TILE^2` values: the pass leaves each score's derivative `K_TILE^2`
    /// values after its dP.
    pub dp: *mut f32,
    /// Rows of the block.
    pub rows: i64,
    /// Natural-log log-sum-exp of each row, from the forward. Under `normalize =
    /// stick_breaking`: each row's running sum of `softplus` over the keys nearer than the
    /// tile (0 before the last tile), advanced by the tile.
    pub lse: *const f32,
    /// `D` of each row: `sum_d dO * out`. Under `normalize = stick_breaking`: `D` less the sum
    /// of `dP A` over the keys nearer than the tile, advanced by the tile.
    pub delta: *const f32,
    /// Absolute position of row 0.
    pub q_pos0: i64,
    /// Index of row 0 in the call.
    pub qi0: i64,
    /// Batch index.
    pub batch: i64,
    /// Query head.
    pub head: i64,
    /// Index of the tile's first key in the call.
    pub first_key: i64,
    /// Absolute position of the tile's first key.
    pub k_pos0: i64,
    /// Keys in the tile, 1 to [`K_TILE`].
    pub cols: i64,
    /// The tile's [`TileCode`] for these rows (not `Skip`).
    pub code: i64,
    /// As [`BlockArgs::params`].
    pub params: *const f32,
    /// With parameters: their gradients, laid out as `params`, which the tile's pairs add to
    /// in a fixed order (the caller's private sums); null without parameters.
    pub dparams: *mut f32,
}

/// The constants of `2^(2x)` as generated code (`Fx::exp2_of_double_4`) and the native passes
/// (`exp_tile`, `ds_tile`) evaluate it, so both give the same probabilities: `2x` clamped at
/// `2 LOWEST`, split as `n + r` by adding `MAGIC`, `2^r = 1 + r P(r)`, `2^n` in the exponent
/// bits.
pub mod exp2 {
    /// Clamp of the argument: `2^(2 * -63.5)` has all exponent bits 0, so `-inf` gives 0.
    pub const LOWEST: f32 = -63.5;
    /// `1.5 * 2^23 + 127`: adding it rounds `2x` to an integer `n` held in the low mantissa
    /// bits as `n + 127`, the biased exponent of `2^n`; shifting the bits left by 23 drops the
    /// rest.
    pub const MAGIC: f32 = 12_583_039.0;
    /// `2^r = 1 + r P(r)` on `[-1/2, 1/2]`: P's coefficients, lowest degree first (a relative
    /// minimax fit: 2e-9 in exact arithmetic, under 1 ulp evaluated in f32).
    pub const P: [f32; 6] = [
        std::f32::consts::LN_2,
        0.240_226_48,
        0.055_503_324,
        0.009_618_437,
        0.001_339_887_5,
        1.535_336_2e-4,
    ];
}
