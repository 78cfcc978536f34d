//! The generated functions of CPU backward kernels: `rotate_rows` (RoPE and a factor on rows in
//! place: the queries and keys as the forward saw them, and with transposed tables, dq and dk
//! rotated back) and `grad_tile` (one query block against one key tile: the probabilities
//! recomputed from the saved lse, and `dS`). What varies with the spec (RoPE, the score program,
//! its derivative and the mask) is generated here; the five dense tile products around
//! `grad_tile` are the runtime's native microkernels.

use super::abi::{GradTileArgs, RotateArgs};
use super::fx::Fx;
use super::rows::{Refs, field, identity_program, rotate, scale_row};
use super::score::{GroupEnv, RowEnv, ScoreLowering, Tables};
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

/// `grad_tile(args: *const GradTileArgs)`: the spec's part of the tile in generated code (the
/// score program, its derivative and the mask, where they are more than a constant factor),
/// then the probabilities and `dS` natively (`ds_tile`).
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
    let code = field!(fx, args, I64, GradTileArgs.code);
    let cols = field!(fx, args, I64, GradTileArgs.cols);
    let first_key = field!(fx, args, I64, GradTileArgs.first_key);
    let dparams = (!plan.params.is_empty()).then(|| {
        tables.params = Some((
            field!(fx, args, I64, GradTileArgs.params),
            plan.params.clone(),
        ));
        field!(fx, args, I64, GradTileArgs.dparams)
    });
    let pass = TilePass {
        s,
        dp,
        rows,
        delta,
        lse,
        dparams,
        q_pos0: field!(fx, args, I64, GradTileArgs.q_pos0),
        qi0: field!(fx, args, I64, GradTileArgs.qi0),
        batch: field!(fx, args, I64, GradTileArgs.batch),
        head: field!(fx, args, I64, GradTileArgs.head),
        key0: field!(fx, args, I64, GradTileArgs.k_pos0),
        first_key,
        key_end: fx.b.ins().iadd(first_key, cols),
    };

    let partial =
        fx.b.ins()
            .icmp_imm_s(IntCC::SignedLessThan, cols, i64::from(K_TILE));
    let mixed =
        fx.b.ins()
            .icmp_imm_s(IntCC::Equal, code, TileCode::Masked as i64);
    let per_element = fx.b.ins().bor(partial, mixed);
    // After the pass, `s` holds the scores in half base-2 units and `dp` holds (dP - D) times
    // the derivative, so `ds_tile` only exponentiates and multiplies. Under stick-breaking `dp`
    // holds dP and the derivative follows it, and `lse` and `delta` are the rows' running
    // state, which `ds_tile` reads and advances.
    let after_pass = |fx: &mut Fx| {
        let one = fx.f32(1.0);
        let state = match plan.stick_breaking() {
            true => delta,
            false => fx.i64(0),
        };
        fx.b.ins()
            .call(refs.ds_tile, &[s, dp, rows, lse, state, one]);
    };
    let constant_slope = match grad {
        Expr::Float(c) if identity_program(plan) && dparams.is_none() && !plan.stick_breaking() => {
            Some(*c as f32)
        }
        _ => None,
    };
    match constant_slope {
        // Scores used as they are and a constant derivative: unmasked tiles need no pass.
        Some(slope) => fx.if_else(
            per_element,
            |fx| {
                pass.emit(fx, plan, grad, refs, tables, true);
                after_pass(fx);
            },
            |fx| {
                let slope = fx.f32(slope);
                fx.b.ins()
                    .call(refs.ds_tile, &[s, dp, rows, lse, delta, slope]);
            },
        ),
        None => {
            fx.versions(per_element, |fx, masked| {
                pass.emit(fx, plan, grad, refs, tables, masked)
            });
            after_pass(fx);
            if plan.stick_breaking() {
                pass.stick_parameters(fx, plan, refs, tables);
            }
        }
    }
    fx.b.ins().return_(&[]);
}

/// What the generated pass over a tile reads: the `GradTileArgs` fields it needs.
struct TilePass {
    s: Value,
    dp: Value,
    rows: Value,
    delta: Value,
    /// Natural-log lse of each row (for the probabilities the parameter gradients need).
    lse: Value,
    /// The task's parameter-gradient sums, for specs with parameters.
    dparams: Option<Value>,
    q_pos0: Value,
    qi0: Value,
    batch: Value,
    head: Value,
    /// Position and index of the tile's first key; keys at or past `key_end` are outside.
    key0: Value,
    first_key: Value,
    key_end: Value,
}

impl TilePass {
    /// The uniforms of the tile's row `r`: its batch, head, query position and index.
    fn row_env(&self, fx: &mut Fx, r: Value) -> RowEnv {
        RowEnv {
            batch: self.batch,
            head: self.head,
            query: fx.b.ins().iadd(self.q_pos0, r),
            query_index: fx.b.ins().iadd(self.qi0, r),
        }
    }

    /// Every row, four keys at a time: `s = score(s)`, `dp = (dp - D) * d score / d raw`;
    /// `masked` applies the key bound and the mask per element (`s = -inf`, `dp = 0` where
    /// dropped).
    fn emit(
        &self,
        fx: &mut Fx,
        plan: &KernelPlan,
        grad: &Expr,
        refs: &Refs,
        tables: &mut Tables,
        masked: bool,
    ) {
        let tile_v = fx.i64(i64::from(K_TILE));
        let zero = fx.i64(0);
        fx.for_range(zero, self.rows, 1, |fx, r| {
            let row = self.row_env(fx, r);
            let s_row = fx.elem_scaled(self.s, r, tile_v);
            let dp_row = fx.elem_scaled(self.dp, r, tile_v);
            let at = fx.elem(self.delta, r);
            let delta = fx.load(F32, at, 0);
            let delta = fx.splat_f32(delta);
            let row_lse = self.dparams.map(|_| {
                let at = fx.elem(self.lse, r);
                fx.load(F32, at, 0)
            });
            let exprs = [&plan.program.score, grad, &plan.program.mask];
            let uniforms = row_uniforms(fx, (plan, refs, tables), &row, &exprs);
            let (z, end) = (fx.i64(0), fx.i64(i64::from(K_TILE)));
            fx.for_range(z, end, 4, |fx, c| {
                let ps = fx.elem(s_row, c);
                let pdp = fx.elem(dp_row, c);
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
                let mut t = lowering.float4(fx, &uniforms, &g, &plan.program.score);
                let slope = lowering.float4(fx, &uniforms, &g, grad);
                let dpv = fx.load(F32X4, pdp, 0);
                // Sigmoid weights stand alone: dS = dP sigmoid', with no row term D.
                let centered = if plan.sigmoid() {
                    dpv
                } else {
                    fx.b.ins().fsub(dpv, delta)
                };
                let mut weighted = if plan.stick_breaking() {
                    // dS takes every nearer key's dP: `ds_tile` needs dP as it is, and the
                    // derivative apart, in the second half of the dP buffer.
                    let area = 4 * i64::from(K_TILE) * i64::from(K_TILE);
                    let at = fx.b.ins().iadd_imm_s(pdp, area);
                    fx.store(slope, at, 0);
                    dpv
                } else {
                    fx.b.ins().fmul(centered, slope)
                };
                let keep = masked
                    .then(|| kept_lanes(fx, plan, &mut lowering, &uniforms, &g, self.key_end));
                match (self.dparams, row_lse) {
                    // Stick-breaking's dS waits for `ds_tile`: the raw scores are kept for
                    // the parameters' pass after it, in the third area of the dP buffer.
                    (Some(_), _) if plan.stick_breaking() => {
                        let area = 4 * i64::from(K_TILE) * i64::from(K_TILE);
                        let at = fx.b.ins().iadd_imm_s(pdp, 2 * area);
                        fx.store(raw, at, 0);
                    }
                    (Some(dparams), Some(lse)) => {
                        let (ds, row_kept) = recomputed_ds(fx, plan, lse, t, centered);
                        let pass = ParamPass {
                            dparams,
                            ds,
                            row_kept: Some(row_kept),
                            keep,
                        };
                        pass.emit(fx, plan, &mut lowering, &uniforms, &g);
                    }
                    _ => {}
                }
                if let Some(keep) = keep {
                    let neg_inf = fx.f32x4(f32::NEG_INFINITY);
                    let zero4 = fx.f32x4(0.0);
                    t = fx.b.ins().bitselect(keep, t, neg_inf);
                    weighted = fx.b.ins().bitselect(keep, weighted, zero4);
                }
                fx.store(t, ps, 0);
                fx.store(weighted, pdp, 0);
            });
        });
    }
}

impl TilePass {
    /// Stick-breaking's parameter gradients, after `ds_tile` has left each pair's `dS_final`
    /// in the second area of the dP buffer (where the derivatives were): every row, four keys
    /// at a time, the raw scores the first pass kept in the third area, the bound and the mask
    /// recomputed. A null `dparams` (the runtime's first sweep, which only advances the rows'
    /// state) skips it.
    fn stick_parameters(&self, fx: &mut Fx, plan: &KernelPlan, refs: &Refs, tables: &mut Tables) {
        let Some(dparams) = self.dparams else { return };
        let area = 4 * i64::from(K_TILE) * i64::from(K_TILE);
        let given = fx.b.ins().icmp_imm_s(IntCC::NotEqual, dparams, 0);
        fx.if_then(given, |fx| {
            let tile_v = fx.i64(i64::from(K_TILE));
            let zero = fx.i64(0);
            fx.for_range(zero, self.rows, 1, |fx, r| {
                let row = self.row_env(fx, r);
                let dp_row = fx.elem_scaled(self.dp, r, tile_v);
                let uniforms = row_uniforms(fx, (plan, refs, tables), &row, &[&plan.program.mask]);
                let (z, end) = (fx.i64(0), fx.i64(i64::from(K_TILE)));
                fx.for_range(z, end, 4, |fx, c| {
                    let pdp = fx.elem(dp_row, c);
                    let at = fx.b.ins().iadd_imm_s(pdp, area);
                    let ds = fx.load(F32X4, at, 0);
                    let at = fx.b.ins().iadd_imm_s(pdp, 2 * area);
                    let raw = fx.load(F32X4, at, 0);
                    let g = GroupEnv {
                        score: raw,
                        key0: fx.b.ins().iadd(self.key0, c),
                        key_index0: fx.b.ins().iadd(self.first_key, c),
                    };
                    let mut lowering = ScoreLowering {
                        logf: refs.logf,
                        tables: &mut *tables,
                    };
                    let keep = kept_lanes(fx, plan, &mut lowering, &uniforms, &g, self.key_end);
                    let pass = ParamPass {
                        dparams,
                        ds,
                        row_kept: None,
                        keep: Some(keep),
                    };
                    pass.emit(fx, plan, &mut lowering, &uniforms, &g);
                });
            });
        });
    }
}

/// A row's uniform values (what does not vary along its keys) of `exprs` and of the
/// parameters' derivatives and element indices.
fn row_uniforms(
    fx: &mut Fx,
    (plan, refs, tables): (&KernelPlan, &Refs, &mut Tables),
    row: &RowEnv,
    exprs: &[&Expr],
) -> super::score::Uniforms {
    let mut all = exprs.to_vec();
    all.extend(plan.param_grads.iter().map(|(_, d)| d));
    all.extend(
        plan.param_grads
            .iter()
            .flat_map(|(read, _)| read.indices.iter()),
    );
    ScoreLowering {
        logf: refs.logf,
        tables,
    }
    .row_uniforms(fx, row, &all)
}

/// `dS = dS_final` of four keys for the parameters' gradients, recomputed as `ds_tile` does:
/// `p = 2^(2 (score - lse'))` with `lse' = lse log2(e) / 2` and `dS = p (dP - D)` (under
/// `normalize = sigmoid`, `dS = dP p (1 - p)` with `p` the key's sigmoid); with whether the
/// row kept any key (lse not `-inf`).
fn recomputed_ds(
    fx: &mut Fx,
    plan: &KernelPlan,
    lse: Value,
    score: Value,
    centered: Value,
) -> (Value, Value) {
    let slope = if plan.sigmoid() {
        sigmoid_slope4(fx, score)
    } else {
        let half = fx.f32(std::f32::consts::LOG2_E / 2.0);
        let h = fx.b.ins().fmul(lse, half);
        let h = fx.splat_f32(h);
        let x = fx.b.ins().fsub(score, h);
        fx.exp2_of_double_4(x)
    };
    let ds = fx.b.ins().fmul(slope, centered);
    let neg_inf = fx.f32(f32::NEG_INFINITY);
    (ds, fx.b.ins().fcmp(FloatCC::NotEqual, lse, neg_inf))
}

/// One group of four keys' parameter gradients: for each parameter read,
/// `dparams[element] += dS * d score / d read`, lane by lane in key order, so the sums do not
/// depend on anything but the task's order of tiles. Dropped keys, and rows with no kept key,
/// add nothing.
struct ParamPass {
    dparams: Value,
    /// `dS_final` of the four keys (the loss's gradient with respect to their final scores).
    ds: Value,
    /// Whether the row kept any key (scalar), where that is not in `keep`.
    row_kept: Option<Value>,
    /// Kept lanes (all-ones f32 bits), on tiles masked per element.
    keep: Option<Value>,
}

impl ParamPass {
    fn emit(
        &self,
        fx: &mut Fx,
        plan: &KernelPlan,
        lowering: &mut ScoreLowering,
        uniforms: &super::score::Uniforms,
        g: &GroupEnv,
    ) {
        for (read, d) in &plan.param_grads {
            let dv = lowering.float4(fx, uniforms, g, d);
            let mut c = fx.b.ins().fmul(self.ds, dv);
            if let Some(keep) = self.keep {
                let zero4 = fx.f32x4(0.0);
                c = fx.b.ins().bitselect(keep, c, zero4);
            }
            let flat = lowering.param_flat4(fx, uniforms, g, read);
            let lanes = fx.lanes(c);
            for (lane, at) in lanes.into_iter().zip(flat) {
                let lane = match self.row_kept {
                    Some(kept) => {
                        let zero = fx.f32(0.0);
                        fx.b.ins().select(kept, lane, zero)
                    }
                    None => lane,
                };
                let addr = fx.elem(self.dparams, at);
                let old = fx.load(F32, addr, 0);
                let new = fx.b.ins().fadd(old, lane);
                fx.store(new, addr, 0);
            }
        }
    }
}

/// `sigmoid'` of four scores in half base-2 units, `p (1 - p) = e p^2` with `e = 2^(-2t)` and
/// `p = 1 / (1 + e)`, as the runtime's sigmoid `ds_tile` computes it (`-t` clamped at 63 so `e`
/// stays finite; NaN passes).
fn sigmoid_slope4(fx: &mut Fx, t: Value) -> Value {
    let x = fx.b.ins().fneg(t);
    let cap = fx.f32x4(63.0);
    let x = fx.b.ins().fmin(x, cap);
    let e = fx.exp2_of_double_4(x);
    let one = fx.f32x4(1.0);
    let denom = fx.b.ins().fadd(one, e);
    let p = fx.b.ins().fdiv(one, denom);
    let ep = fx.b.ins().fmul(e, p);
    fx.b.ins().fmul(ep, p)
}
