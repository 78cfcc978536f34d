//! The generated functions of CPU backward kernels: `rotate_rows` (RoPE and a factor on rows in
//! place: the queries and keys as the forward saw them, and with transposed tables, dq and dk
//! rotated back) and `grad_tile` (one query block against one key tile: the probabilities
//! recomputed from the saved lse, and `dS`). What varies with the spec (RoPE, the score program,
//! its derivative and the mask) is generated here; the five dense tile products around
//! `grad_tile` are the runtime's native microkernels.

use super::abi::{GradTileArgs, RotateArgs};
use super::emit::{Refs, field, rotate, scale_row};
use super::fx::Fx;
use super::score::{GroupEnv, RowEnv, ScoreLowering, Tables, Uniforms};
use super::step::kept_lanes;
use crate::plan::{K_TILE, KernelPlan, TileCode};
use attn_dsl::modifier::Expr;
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{F32, F32X4, I64};
use cranelift_codegen::ir::{InstBuilder, Value};

/// `rotate_rows(args: *const RotateArgs)`.
pub(super) fn rotate_rows(fx: &mut Fx, plan: &KernelPlan, args: Value) {
    let width = i64::from(plan.shape.qk_dim);
    let x = field!(fx, args, I64, RotateArgs.x);
    let stride = field!(fx, args, I64, RotateArgs.row_stride);
    let rows = field!(fx, args, I64, RotateArgs.rows);
    let pos0 = field!(fx, args, I64, RotateArgs.pos0);
    let factor = field!(fx, args, F32, RotateArgs.factor);
    let tables = [
        field!(fx, args, I64, RotateArgs.rope_cos),
        field!(fx, args, I64, RotateArgs.rope_sin),
        field!(fx, args, I64, RotateArgs.table_pos0),
    ];
    let zero = fx.i64(0);
    fx.for_range(zero, rows, 1, |fx, r| {
        let row = fx.elem_scaled(x, r, stride);
        if let Some(rope) = &plan.rope {
            let pos = fx.b.ins().iadd(pos0, r);
            rotate(fx, rope, row, pos, tables);
        }
        scale_row(fx, row, width, factor, false);
    });
    fx.b.ins().return_(&[]);
}

/// `grad_tile(args: *const GradTileArgs)`.
pub(super) fn grad_tile(
    fx: &mut Fx,
    plan: &KernelPlan,
    refs: &Refs,
    tables: &mut Tables,
    args: Value,
) {
    let grad = plan
        .score_grad
        .as_ref()
        .expect("grad_tile is emitted for backward plans, which have a score derivative");
    let s = field!(fx, args, I64, GradTileArgs.s);
    let dp = field!(fx, args, I64, GradTileArgs.dp);
    let rows = field!(fx, args, I64, GradTileArgs.rows);
    let lse = field!(fx, args, I64, GradTileArgs.lse);
    let delta = field!(fx, args, I64, GradTileArgs.delta);
    let q_pos0 = field!(fx, args, I64, GradTileArgs.q_pos0);
    let qi0 = field!(fx, args, I64, GradTileArgs.qi0);
    let batch = field!(fx, args, I64, GradTileArgs.batch);
    let head = field!(fx, args, I64, GradTileArgs.head);
    let first_key = field!(fx, args, I64, GradTileArgs.first_key);
    let k_pos0 = field!(fx, args, I64, GradTileArgs.k_pos0);
    let cols = field!(fx, args, I64, GradTileArgs.cols);
    let code = field!(fx, args, I64, GradTileArgs.code);

    let tile = i64::from(K_TILE);
    let partial = fx.b.ins().icmp_imm_s(IntCC::SignedLessThan, cols, tile);
    let mixed =
        fx.b.ins()
            .icmp_imm_s(IntCC::Equal, code, TileCode::Masked as i64);
    let per_element = fx.b.ins().bor(partial, mixed);
    let key_end = fx.b.ins().iadd(first_key, cols);
    let tile_v = fx.i64(tile);
    let zero = fx.i64(0);
    fx.for_range(zero, rows, 1, |fx, r| {
        let row = RowEnv {
            batch,
            head,
            query: fx.b.ins().iadd(q_pos0, r),
            query_index: fx.b.ins().iadd(qi0, r),
        };
        let s_row = fx.elem_scaled(s, r, tile_v);
        let dp_row = fx.elem_scaled(dp, r, tile_v);
        let at = fx.elem(lse, r);
        let lse_r = fx.load(F32, at, 0);
        let at = fx.elem(delta, r);
        let delta_r = fx.load(F32, at, 0);
        let neg_inf = fx.f32(f32::NEG_INFINITY);
        // A row that kept no key has lse -inf and carries no gradient.
        let empty = fx.b.ins().fcmp(FloatCC::Equal, lse_r, neg_inf);
        let row_pass = RowPass {
            s_row,
            dp_row,
            // The program is in half base-2 units: P = 2^(2 (t - lse log2(e) / 2)).
            lse_half: {
                let unit = fx.f32(std::f32::consts::LOG2_E / 2.0);
                let h = fx.b.ins().fmul(lse_r, unit);
                fx.splat_f32(h)
            },
            delta: fx.splat_f32(delta_r),
            key0: k_pos0,
            first_key,
            key_end,
        };
        fx.if_else(
            empty,
            |fx| {
                let zero_f = fx.f32(0.0);
                scale_row(fx, s_row, tile, zero_f, true);
                scale_row(fx, dp_row, tile, zero_f, true);
            },
            |fx| {
                let exprs: Vec<&Expr> = vec![&plan.program.score, grad, &plan.program.mask];
                let uniforms = ScoreLowering {
                    logf: refs.logf,
                    tables: &mut *tables,
                }
                .row_uniforms(fx, &row, &exprs);
                // A masked and an unmasked version of the row.
                fx.versions(per_element, |fx, masked| {
                    row_pass.emit(fx, plan, grad, refs, tables, &uniforms, masked);
                });
            },
        );
    });
    fx.b.ins().return_(&[]);
}

/// One row of a tile: where its scores and `dP` are, and what the row's lse and `D` are.
struct RowPass {
    s_row: Value,
    dp_row: Value,
    /// f32x4 of the row's lse in half base-2 units.
    lse_half: Value,
    /// f32x4 of the row's `D`.
    delta: Value,
    /// Position and index of the tile's first key; keys at or past `key_end` are outside.
    key0: Value,
    first_key: Value,
    key_end: Value,
}

impl RowPass {
    /// `P` and `dS` for the row, four keys at a time; `masked` applies the key bound and the
    /// mask per element.
    #[allow(clippy::too_many_arguments)] // the pieces of one lowering, passed through
    fn emit(
        &self,
        fx: &mut Fx,
        plan: &KernelPlan,
        grad: &Expr,
        refs: &Refs,
        tables: &mut Tables,
        uniforms: &Uniforms,
        masked: bool,
    ) {
        let (z, end) = (fx.i64(0), fx.i64(i64::from(K_TILE)));
        fx.for_range(z, end, 4, |fx, c| {
            let ps = fx.elem(self.s_row, c);
            let pdp = fx.elem(self.dp_row, c);
            let raw = fx.load(F32X4, ps, 0);
            let g = GroupEnv {
                score: raw,
                key0: fx.b.ins().iadd(self.key0, c),
                key_index0: fx.b.ins().iadd(self.first_key, c),
            };
            let mut lowering = ScoreLowering {
                logf: refs.logf,
                tables: &mut *tables,
            };
            let t = lowering.float4(fx, uniforms, &g, &plan.program.score);
            let shifted = fx.b.ins().fsub(t, self.lse_half);
            let mut p = fx.exp2_of_double_4(shifted);
            let slope = lowering.float4(fx, uniforms, &g, grad);
            let dpv = fx.load(F32X4, pdp, 0);
            let centered = fx.b.ins().fsub(dpv, self.delta);
            let weighted = fx.b.ins().fmul(p, centered);
            let mut ds = fx.b.ins().fmul(weighted, slope);
            if masked {
                let keep = kept_lanes(fx, plan, &mut lowering, uniforms, &g, self.key_end);
                let zero4 = fx.f32x4(0.0);
                p = fx.b.ins().bitselect(keep, p, zero4);
                ds = fx.b.ins().bitselect(keep, ds, zero4);
            }
            fx.store(p, ps, 0);
            fx.store(ds, pdp, 0);
        });
    }
}
