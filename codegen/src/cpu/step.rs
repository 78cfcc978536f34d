//! What the forward `block` and the `decode` functions share: the block's state in scratch,
//! the prologue (rotated, scaled queries; empty running state), the per-tile online-softmax step
//! (score program, mask, base-2 softmax, value product) and the epilogue (out and lse). Under
//! `normalize = sigmoid` the step keeps no running max (each key's weight stands alone: the
//! runtime's `exp_tile` is then the sigmoid's) and the epilogue does not divide by the sum;
//! under `stick_breaking` the same, with each row's running sum of `softplus` where the max
//! was (its `exp_tile` reads and advances it, tiles visited from the last).

use super::abi::ScratchLayout;
use super::fx::Fx;
use super::rows::{Refs, copy, identity_program, rotate, scale_row};
use super::score::{GroupEnv, RowEnv, ScoreLowering, Tables};
use crate::plan::TileCode;
use crate::plan::{K_TILE, KernelPlan, TileMasking};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{F32, F32X4, I32, I32X4};
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value};

/// How a block's rows map to query heads and queries.
#[derive(Clone, Copy)]
pub(super) enum RowMap {
    /// One head: row `r` is query `qi0 + r` (the forward kernel).
    OneHead { head: Value },
    /// The query heads of one kv head: row `r` is head `head0 + r / q_len`, query
    /// `qi0 + r % q_len` (decode: the group's heads share every key read).
    Grouped { head0: Value, q_len: Value },
}

/// A block's rows: how many, the position and call index of its query 0, its batch index.
pub(super) struct Rows {
    pub count: Value,
    pub q_pos0: Value,
    pub qi0: Value,
    pub batch: Value,
}

/// A block of query rows: where its scratch areas are and what its rows are.
pub(super) struct BlockState {
    pub qs: Value,
    pub s: Value,
    pub acc: Value,
    pub m: Value,
    pub l: Value,
    pub tile_max: Value,
    pub rows: Value,
    /// Absolute position of the block's query 0.
    pub q_pos0: Value,
    /// Index in the call of the block's query 0.
    pub qi0: Value,
    pub batch: Value,
    pub map: RowMap,
}

impl BlockState {
    /// The state over `scratch` laid out as `ScratchLayout::of(plan)`.
    pub fn new(fx: &mut Fx, plan: &KernelPlan, scratch: Value, rows: Rows, map: RowMap) -> Self {
        let Rows {
            count: rows,
            q_pos0,
            qi0,
            batch,
        } = rows;
        let layout = ScratchLayout::of(plan);
        let mut at = |offset: usize| fx.b.ins().iadd_imm_s(scratch, (offset * 4) as i64);
        BlockState {
            qs: at(layout.q),
            s: at(layout.s),
            acc: at(layout.acc),
            m: at(layout.m),
            l: at(layout.l),
            tile_max: at(layout.tile_max),
            rows,
            q_pos0,
            qi0,
            batch,
            map,
        }
    }

    /// Row `r`'s query head and query offset (from `q_pos0` / `qi0`).
    pub fn row(&self, fx: &mut Fx, r: Value) -> (Value, Value) {
        match self.map {
            RowMap::OneHead { head } => (head, r),
            RowMap::Grouped { head0, q_len } => {
                let h = fx.b.ins().udiv(r, q_len);
                let h = fx.b.ins().iadd(head0, h);
                (h, fx.b.ins().urem(r, q_len))
            }
        }
    }

    /// The row variables of the score program for row `r`.
    fn row_env(&self, fx: &mut Fx, r: Value) -> RowEnv {
        let (head, offset) = self.row(fx, r);
        RowEnv {
            batch: self.batch,
            head,
            query: fx.b.ins().iadd(self.q_pos0, offset),
            query_index: fx.b.ins().iadd(self.qi0, offset),
        }
    }
}

/// One tile of at most [`K_TILE`] keys, as the softmax step sees it.
pub(super) struct KeyTile {
    /// Its [`TileCode`] (not `Skip`).
    pub code: Value,
    /// Index of its first key in the sequence.
    pub first_key: Value,
    /// Absolute position of its first key.
    pub position: Value,
    /// Keys in the tile.
    pub cols: Value,
    /// `first_key + cols`: keys from here on are masked.
    pub key_end: Value,
    /// Row 0 of its values, and the elements between rows.
    pub v: Value,
    pub v_stride: Value,
    /// The block's rows that meet the tile, `first_row..end_row` (the others are all masked).
    pub first_row: Value,
    pub end_row: Value,
    /// On a `Masked` tile, rows from here on keep every key and run without the mask.
    pub kept_from: Value,
    /// Decode: the rows read after this tile's values (the next segment's keys, null after the
    /// last) and the elements between them, which `pv_rows` prefetches as it ends. `None` in
    /// forward kernels, whose `pv_tile` reads packed tiles.
    pub then: Option<[Value; 2]>,
}

/// Prologue: the block's queries copied to scratch, rotated and scaled (unless the kernel
/// `scales_scores` after `qk_tile` instead); running max `-inf`, sum and accumulator 0. `q`
/// has rows of `q_stride` values.
pub(super) fn prologue(
    fx: &mut Fx,
    plan: &KernelPlan,
    a: &BlockState,
    [q, q_stride]: [Value; 2],
    rope_tables: [Value; 3],
    scales_scores: bool,
) {
    let qk_dim = i64::from(plan.shape.qk_dim);
    let v_dim = i64::from(plan.shape.v_dim);
    let zero = fx.i64(0);
    let qk_v = fx.i64(qk_dim);
    let v_dim_v = fx.i64(v_dim);
    fx.for_range(zero, a.rows, 1, |fx, r| {
        let dst = fx.elem_scaled(a.qs, r, qk_v);
        let src = fx.elem_scaled(q, r, q_stride);
        copy(fx, dst, src, qk_dim);
        if let Some(rope) = &plan.rope {
            let (_, offset) = a.row(fx, r);
            let pos = fx.b.ins().iadd(a.q_pos0, offset);
            rotate(fx, rope, dst, pos, rope_tables);
        }
        if plan.q_scale != 1.0 && !scales_scores {
            let factor = fx.f32(plan.q_scale as f32);
            scale_row(fx, dst, qk_dim, factor, false);
        }
        // The running max starts at -inf; stick-breaking's running softplus sum at 0.
        let m0 = fx.f32(match plan.stick_breaking() {
            true => 0.0,
            false => f32::NEG_INFINITY,
        });
        let zero_f = fx.f32(0.0);
        let pm = fx.elem(a.m, r);
        fx.store(m0, pm, 0);
        let pl = fx.elem(a.l, r);
        fx.store(zero_f, pl, 0);
        let pa = fx.elem_scaled(a.acc, r, v_dim_v);
        scale_row(fx, pa, v_dim, zero_f, true);
    });
}

/// Epilogue: normalize each row; write it to `out` (rows of `out_stride` values) and its
/// natural-log log-sum-exp to `lse`.
pub(super) fn epilogue(
    fx: &mut Fx,
    plan: &KernelPlan,
    refs: &Refs,
    a: &BlockState,
    out: Value,
    out_stride: Value,
    lse: Value,
) {
    let v_dim = i64::from(plan.shape.v_dim);
    let zero = fx.i64(0);
    let v_dim_v = fx.i64(v_dim);
    fx.for_range(zero, a.rows, 1, |fx, r| {
        let pl = fx.elem(a.l, r);
        let lsum = fx.load(F32, pl, 0);
        let pm = fx.elem(a.m, r);
        let mrow = fx.load(F32, pm, 0);
        let zero_f = fx.f32(0.0);
        // A row is empty when no key was kept (sum exactly 0); a NaN sum carries NaN through.
        let nonempty = fx.b.ins().fcmp(FloatCC::NotEqual, lsum, zero_f);
        let pa = fx.elem_scaled(a.acc, r, v_dim_v);
        if !plan.unnormalized() {
            // Sigmoid and stick-breaking weights are not normalized: out is the accumulator
            // as it stands.
            let one = fx.f32(1.0);
            let inv = fx.b.ins().fdiv(one, lsum);
            let inv = fx.b.ins().select(nonempty, inv, zero_f);
            scale_row(fx, pa, v_dim, inv, false);
        }
        let dst = fx.elem_scaled(out, r, out_stride);
        copy(fx, dst, pa, v_dim);
        let neg_inf = fx.f32(f32::NEG_INFINITY);
        let plse = fx.elem(lse, r);
        fx.if_else(
            nonempty,
            |fx| {
                let call = fx.b.ins().call(refs.logf, &[lsum]);
                let ln = fx.b.inst_results(call)[0];
                if plan.unnormalized() {
                    // ln of the sum of the weights.
                    fx.store(ln, plse, 0);
                    return;
                }
                // The running max is in half base-2 units: 2 ln 2 turns it into natural ones.
                let unit = fx.f32(2.0 * std::f32::consts::LN_2);
                let value = fx.b.ins().fma(mrow, unit, ln);
                fx.store(value, plse, 0);
            },
            |fx| fx.store(neg_inf, plse, 0),
        );
    });
}

/// One key tile for every row of the block, its raw scores already in `s`: score program, mask,
/// online softmax, value product.
pub(super) fn softmax_step(
    fx: &mut Fx,
    plan: &KernelPlan,
    refs: &Refs,
    tables: &mut Tables,
    a: &BlockState,
    k: &KeyTile,
) {
    let v_dim = i64::from(plan.shape.v_dim);
    let tile = i64::from(K_TILE);

    let tile_v = fx.i64(tile);
    let (first_key, cols) = (k.first_key, k.cols);
    let partial = fx.b.ins().icmp_imm_s(IntCC::SignedLessThan, cols, tile);
    let mixed =
        fx.b.ins()
            .icmp_imm_s(IntCC::Equal, k.code, TileCode::Masked as i64);
    let tile_key_pos = k.position;
    let needs_mask_program = !matches!(plan.masking, TileMasking::Unmasked);
    let identity = identity_program(plan);

    let v_dim_v = fx.i64(v_dim);
    fx.for_range(k.first_row, k.end_row, 1, |fx, r| {
        // Rows of a mixed tile before `kept_from`, and every row of a partial tile, take the
        // mask and the key bound per element.
        let masked_row = fx.b.ins().icmp(IntCC::SignedLessThan, r, k.kept_from);
        let masked_row = fx.b.ins().band(mixed, masked_row);
        let per_element = fx.b.ins().bor(partial, masked_row);
        let row = a.row_env(fx, r);
        let exprs: Vec<&attn_dsl::modifier::Expr> = if needs_mask_program {
            vec![&plan.program.score, &plan.program.mask]
        } else {
            vec![&plan.program.score]
        };
        let uniforms = ScoreLowering {
            logf: refs.logf,
            tables: &mut *tables,
        }
        .row_uniforms(fx, &row, &exprs);
        let s_row = fx.elem_scaled(a.s, r, tile_v);
        let max_var = fx.b.declare_var(F32X4);
        let init = fx.f32x4(f32::NEG_INFINITY);
        fx.b.def_var(max_var, init);

        // Pass 1, in a masked and an unmasked version: scores through the program, running max.
        let pass = ScorePass {
            s_row,
            tile_key_pos,
            first_key,
            key_end: k.key_end,
            max_var,
        };
        fx.versions(per_element, |fx, masked| {
            if masked || !identity {
                score_pass(fx, plan, refs, tables, &uniforms, &pass, masked);
            } else {
                // The program leaves scores as they are: the microkernel's row max serves.
                let at = fx.elem(a.tile_max, r);
                let mx = fx.load(F32, at, 0);
                let mx = fx.splat_f32(mx);
                fx.b.def_var(max_var, mx);
            }
        });

        if plan.unnormalized() {
            // Sigmoid and stick-breaking keep no running max: nothing to rescale.
            return;
        }
        // New running max; `m_use` keeps exp finite while a row has seen no kept key.
        let mx = fx.b.use_var(max_var);
        let tile_max = fx.reduce(mx, true);
        let pm = fx.elem(a.m, r);
        let m_old = fx.load(F32, pm, 0);
        let grew = fx.b.ins().fcmp(FloatCC::GreaterThan, tile_max, m_old);
        let m_new = fx.b.ins().select(grew, tile_max, m_old);
        fx.store(m_new, pm, 0);
        let neg_inf = fx.f32(f32::NEG_INFINITY);
        let zero_f = fx.f32(0.0);
        let empty = fx.b.ins().fcmp(FloatCC::Equal, m_new, neg_inf);
        let m_use = fx.b.ins().select(empty, zero_f, m_new);
        // alpha = 2^(2 (m_old - m_new)) rescales the row's sum and accumulator (scores are in
        // half base-2 units) when the max grew.
        fx.if_then(grew, |fx| {
            let shift = fx.b.ins().fsub(m_old, m_use);
            let alpha = fx.exp2_of_double_1(shift);
            let pl = fx.elem(a.l, r);
            let l_old = fx.load(F32, pl, 0);
            let l_scaled = fx.b.ins().fmul(l_old, alpha);
            fx.store(l_scaled, pl, 0);
            let pa = fx.elem_scaled(a.acc, r, v_dim_v);
            scale_row(fx, pa, v_dim, alpha, false);
        });
        // The row's shift for pass 2 replaces its tile max, now used.
        let at = fx.elem(a.tile_max, r);
        fx.store(m_use, at, 0);
    });

    // Pass 2, natively (`exp_tile`): probabilities 2^(2 (s - m)), their sums added to the rows'
    // sums. NaN scores stay NaN through each step, so a NaN that reaches a row makes it NaN
    // instead of vanishing like a masked key (as does a score that overflowed f32: `inf - inf`,
    // as in PyTorch).
    let p = fx.elem_scaled(a.s, k.first_row, tile_v);
    let rows = fx.b.ins().isub(k.end_row, k.first_row);
    // Stick-breaking's tile pass reads and advances each row's running softplus sum, kept in
    // the running max's place; softmax's reads the shift just stored.
    let shift = match plan.stick_breaking() {
        true => fx.elem(a.m, k.first_row),
        false => fx.elem(a.tile_max, k.first_row),
    };
    let sums = fx.elem(a.l, k.first_row);
    fx.b.ins().call(refs.exp_tile, &[p, rows, shift, sums]);
    let acc = fx.elem_scaled(a.acc, k.first_row, v_dim_v);
    let mut args = vec![p, rows, cols, k.v, k.v_stride, acc, v_dim_v];
    args.extend(k.then.iter().flatten());
    fx.b.ins().call(refs.pv, &args);
}

/// The lanes of a group of four keys that are kept, as an f32x4 bit mask for `bitselect`: lane
/// `i` is inside the sequence while `i < key_end - key_index0` (clamped to 0..=4 to fit 32 bits),
/// and the plan's mask program keeps it.
pub(super) fn kept_lanes(
    fx: &mut Fx,
    plan: &KernelPlan,
    lowering: &mut ScoreLowering,
    uniforms: &super::score::Uniforms,
    g: &GroupEnv,
    key_end: Value,
) -> Value {
    let lane_index = fx.vconst4(I32X4, [0, 1, 2, 3]);
    let left = fx.b.ins().isub(key_end, g.key_index0);
    let (lo, hi) = (fx.i64(0), fx.i64(4));
    let left = fx.b.ins().smax(left, lo);
    let left = fx.b.ins().smin(left, hi);
    let left = fx.b.ins().ireduce(I32, left);
    let left = fx.b.ins().splat(I32X4, left);
    let mut keep = fx.b.ins().icmp(IntCC::SignedLessThan, lane_index, left);
    if !matches!(plan.masking, TileMasking::Unmasked) {
        let mask = lowering.mask4(fx, uniforms, g, &plan.program.mask);
        keep = fx.b.ins().band(keep, mask);
    }
    fx.b.ins().bitcast(F32X4, MemFlagsData::new(), keep)
}

struct ScorePass {
    s_row: Value,
    tile_key_pos: Value,
    first_key: Value,
    /// Keys at or past this index are outside the sequence.
    key_end: Value,
    max_var: cranelift_frontend::Variable,
}

/// Pass 1 over one row of a tile: `s = score(s)`, masked keys to `-inf`, running max.
fn score_pass(
    fx: &mut Fx,
    plan: &KernelPlan,
    refs: &Refs,
    tables: &mut Tables,
    uniforms: &super::score::Uniforms,
    pass: &ScorePass,
    masked: bool,
) {
    let (z, end) = (fx.i64(0), fx.i64(i64::from(K_TILE)));
    // Two groups per iteration, as in pass 2.
    fx.for_range(z, end, 8, |fx, c| {
        for offset in [0, 4] {
            let group = fx.b.ins().iadd_imm_s(c, offset);
            let p = fx.elem(pass.s_row, group);
            let raw = fx.load(F32X4, p, 0);
            let g = GroupEnv {
                score: raw,
                key0: fx.b.ins().iadd(pass.tile_key_pos, group),
                key_index0: fx.b.ins().iadd(pass.first_key, group),
            };
            let mut lowering = ScoreLowering {
                logf: refs.logf,
                tables: &mut *tables,
            };
            let mut value = lowering.float4(fx, uniforms, &g, &plan.program.score);
            if masked {
                // Keys past the end of the sequence, and keys the mask drops, get -inf.
                let keep = kept_lanes(fx, plan, &mut lowering, uniforms, &g, pass.key_end);
                let neg_inf = fx.f32x4(f32::NEG_INFINITY);
                value = fx.b.ins().bitselect(keep, value, neg_inf);
            }
            fx.store(value, p, 0);
            let mx = fx.b.use_var(pass.max_var);
            let mx = fx.pmax4(value, mx);
            fx.b.def_var(pass.max_var, mx);
        }
    });
}
