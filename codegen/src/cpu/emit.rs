//! The two generated functions of a CPU kernel: `pack_k` (RoPE and transpose the keys of one
//! (batch, kv head) into tiles) and `block` (a block of query rows against every key tile, with
//! the score program, mask, online softmax and output).

use super::abi::{BlockArgs, PackArgs, ScratchLayout, TileCode};
use super::fx::Fx;
use super::score::{GroupEnv, RowEnv, ScoreLowering, Tables};
use crate::plan::{K_TILE, KernelPlan, RopePrologue, TileMasking};
use attn_dsl::RopeLayout;
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{F32, F32X4, I8, I32, I32X4, I64};
use cranelift_codegen::ir::{FuncRef, InstBuilder, MemFlagsData, Value};
use std::mem::offset_of;

/// The imported functions, as referenced from one generated function.
pub(super) struct Refs {
    pub qk_tile: FuncRef,
    pub pv_tile: FuncRef,
    pub logf: FuncRef,
}

macro_rules! field {
    ($fx:expr, $args:expr, $ty:expr, $record:ident . $field:ident) => {
        $fx.load($ty, $args, offset_of!($record, $field) as i32)
    };
}

/// Whether the score program leaves the (q-scaled) score as it is: the score microkernel's row
/// maximum is then the tile's.
fn identity_program(plan: &KernelPlan) -> bool {
    plan.program.score == attn_dsl::modifier::Expr::Var(attn_dsl::modifier::Var::Score)
}

/// Rotates one row in place: `row` points at the row's first value, `pos` is its position.
fn rotate(fx: &mut Fx, rope: &RopePrologue, row: Value, pos: Value, tables: [Value; 3]) {
    let [cos, sin, pos0] = tables;
    let half = i64::from(rope.rope.dim / 2);
    let table_row = fx.b.ins().isub(pos, pos0);
    let half_v = fx.i64(half);
    let cos_row = fx.elem_scaled(cos, table_row, half_v);
    let sin_row = fx.elem_scaled(sin, table_row, half_v);
    let first = i64::from(rope.first_dim);
    let (zero, end) = (fx.i64(0), fx.i64(half));
    fx.for_range(zero, end, 1, |fx, i| {
        let (a, b) = match rope.rope.layout {
            RopeLayout::Half => {
                let a = fx.b.ins().iadd_imm_s(i, first);
                (a, fx.b.ins().iadd_imm_s(a, half))
            }
            RopeLayout::Interleaved => {
                let a = fx.b.ins().ishl_imm_s(i, 1);
                let a = fx.b.ins().iadd_imm_s(a, first);
                (a, fx.b.ins().iadd_imm_s(a, 1))
            }
        };
        let (pa, pb) = (fx.elem(row, a), fx.elem(row, b));
        let (xa, xb) = (fx.load(F32, pa, 0), fx.load(F32, pb, 0));
        let pc = fx.elem(cos_row, i);
        let ps = fx.elem(sin_row, i);
        let (c, s) = (fx.load(F32, pc, 0), fx.load(F32, ps, 0));
        let (ac, bs) = (fx.b.ins().fmul(xa, c), fx.b.ins().fmul(xb, s));
        let (bc, as_) = (fx.b.ins().fmul(xb, c), fx.b.ins().fmul(xa, s));
        let ra = fx.b.ins().fsub(ac, bs);
        let rb = fx.b.ins().fadd(bc, as_);
        fx.store(ra, pa, 0);
        fx.store(rb, pb, 0);
    });
}

/// Copies `n` f32 values, four at a time where `n` allows.
fn copy(fx: &mut Fx, dst: Value, src: Value, n: i64) {
    let vec_end = n / 4 * 4;
    let zero = fx.i64(0);
    if vec_end > 0 {
        let end = fx.i64(vec_end);
        fx.for_range(zero, end, 4, |fx, i| {
            let s = fx.elem(src, i);
            let v = fx.load(F32X4, s, 0);
            let d = fx.elem(dst, i);
            fx.store(v, d, 0);
        });
    }
    for i in vec_end..n {
        let v = fx.load(F32, src, (i * 4) as i32);
        fx.store(v, dst, (i * 4) as i32);
    }
}

/// `dst[i] = dst[i] * factor` (or `= factor` when `set`) for `n` values.
fn scale_row(fx: &mut Fx, dst: Value, n: i64, factor: Value, set: bool) {
    let vec_end = n / 4 * 4;
    let factor4 = fx.splat_f32(factor);
    let zero = fx.i64(0);
    if vec_end > 0 {
        let end = fx.i64(vec_end);
        fx.for_range(zero, end, 4, |fx, i| {
            let d = fx.elem(dst, i);
            let v = if set {
                factor4
            } else {
                let x = fx.load(F32X4, d, 0);
                fx.b.ins().fmul(x, factor4)
            };
            fx.store(v, d, 0);
        });
    }
    for i in vec_end..n {
        let v = if set {
            factor
        } else {
            let x = fx.load(F32, dst, (i * 4) as i32);
            fx.b.ins().fmul(x, factor)
        };
        fx.store(v, dst, (i * 4) as i32);
    }
}

/// Writes key `j` into the packed tiles: `kt[j / K][d][j % K] = value(d)` for `d < dim`.
fn store_column(
    fx: &mut Fx,
    kt: Value,
    j: Value,
    dim: i64,
    mut value: impl FnMut(&mut Fx, Value) -> Value,
) {
    let tile = i64::from(K_TILE);
    let t = fx.b.ins().ushr_imm_s(j, tile.trailing_zeros() as i64);
    let col = fx.b.ins().band_imm_s(j, tile - 1);
    let tile_len = fx.i64(dim * tile);
    let tile_base = fx.elem_scaled(kt, t, tile_len);
    let dst = fx.elem(tile_base, col);
    let (zero, end) = (fx.i64(0), fx.i64(dim));
    fx.for_range(zero, end, 1, |fx, d| {
        let v = value(fx, d);
        let stride = fx.i64(tile);
        let p = fx.elem_scaled(dst, d, stride);
        fx.store(v, p, 0);
    });
}

/// `pack_k(args: *const PackArgs)`.
pub(super) fn pack_k(fx: &mut Fx, plan: &KernelPlan, args: Value) {
    let dim = i64::from(plan.shape.qk_dim);
    let k = field!(fx, args, I64, PackArgs.k);
    let stride = field!(fx, args, I64, PackArgs.k_row_stride);
    let skv = field!(fx, args, I64, PackArgs.skv);
    let k_pos0 = field!(fx, args, I64, PackArgs.k_pos0);
    let tables = [
        field!(fx, args, I64, PackArgs.rope_cos),
        field!(fx, args, I64, PackArgs.rope_sin),
        field!(fx, args, I64, PackArgs.table_pos0),
    ];
    let kt = field!(fx, args, I64, PackArgs.kt);
    let tile = i64::from(K_TILE);
    let row_buf =
        fx.b.create_sized_stack_slot(cranelift_codegen::ir::StackSlotData::new(
            cranelift_codegen::ir::StackSlotKind::ExplicitSlot,
            (dim * 4) as u32,
            4,
        ));
    let zero = fx.i64(0);
    fx.for_range(zero, skv, 1, |fx, j| {
        // With RoPE, rotate a copy of the row first; then scatter the row into column j % tile
        // of its tile.
        let src = fx.elem_scaled(k, j, stride);
        let row = match &plan.rope {
            Some(rope) => {
                let buf = fx.b.ins().stack_addr(I64, row_buf, 0);
                copy(fx, buf, src, dim);
                let pos = fx.b.ins().iadd(k_pos0, j);
                rotate(fx, rope, buf, pos, tables);
                buf
            }
            None => src,
        };
        store_column(fx, kt, j, dim, |fx, d| {
            let s = fx.elem(row, d);
            fx.load(F32, s, 0)
        });
    });
    // Zero the padding columns of the last tile.
    let padded = fx.b.ins().iadd_imm_s(skv, tile - 1);
    let padded = fx.b.ins().band_imm_s(padded, !(tile - 1));
    fx.for_range(skv, padded, 1, |fx, j| {
        store_column(fx, kt, j, dim, |fx, _| fx.f32(0.0));
    });
    fx.b.ins().return_(&[]);
}

/// `block(args: *const BlockArgs)`.
pub(super) fn block(fx: &mut Fx, plan: &KernelPlan, refs: &Refs, tables: &mut Tables, args: Value) {
    let qk_dim = i64::from(plan.shape.qk_dim);
    let v_dim = i64::from(plan.shape.v_dim);
    let tile = i64::from(K_TILE);
    let layout = ScratchLayout::of(plan);

    let q = field!(fx, args, I64, BlockArgs.q);
    let q_stride = field!(fx, args, I64, BlockArgs.q_row_stride);
    let rows = field!(fx, args, I64, BlockArgs.rows);
    let q_pos0 = field!(fx, args, I64, BlockArgs.q_pos0);
    let qi0 = field!(fx, args, I64, BlockArgs.qi0);
    let batch = field!(fx, args, I64, BlockArgs.batch);
    let head = field!(fx, args, I64, BlockArgs.head);
    let kt = field!(fx, args, I64, BlockArgs.kt);
    let v = field!(fx, args, I64, BlockArgs.v);
    let v_stride = field!(fx, args, I64, BlockArgs.v_row_stride);
    let skv = field!(fx, args, I64, BlockArgs.skv);
    let k_pos0 = field!(fx, args, I64, BlockArgs.k_pos0);
    let codes = field!(fx, args, I64, BlockArgs.tile_codes);
    let out = field!(fx, args, I64, BlockArgs.out);
    let out_stride = field!(fx, args, I64, BlockArgs.out_row_stride);
    let lse = field!(fx, args, I64, BlockArgs.lse);
    let scratch = field!(fx, args, I64, BlockArgs.scratch);
    let rope_tables = [
        field!(fx, args, I64, BlockArgs.rope_cos),
        field!(fx, args, I64, BlockArgs.rope_sin),
        field!(fx, args, I64, BlockArgs.table_pos0),
    ];

    let at = |fx: &mut Fx, offset: usize| fx.b.ins().iadd_imm_s(scratch, (offset * 4) as i64);
    let qs = at(fx, layout.q);
    let s = at(fx, layout.s);
    let acc = at(fx, layout.acc);
    let m = at(fx, layout.m);
    let l = at(fx, layout.l);
    let tile_max = at(fx, layout.tile_max);

    // Prologue: rotated queries, empty running state.
    let zero = fx.i64(0);
    let qk_v = fx.i64(qk_dim);
    let v_dim_v = fx.i64(v_dim);
    fx.for_range(zero, rows, 1, |fx, r| {
        let dst = fx.elem_scaled(qs, r, qk_v);
        let src = fx.elem_scaled(q, r, q_stride);
        copy(fx, dst, src, qk_dim);
        if let Some(rope) = &plan.rope {
            let pos = fx.b.ins().iadd(q_pos0, r);
            rotate(fx, rope, dst, pos, rope_tables);
        }
        if plan.q_scale != 1.0 {
            let factor = fx.f32(plan.q_scale as f32);
            scale_row(fx, dst, qk_dim, factor, false);
        }
        let neg_inf = fx.f32(f32::NEG_INFINITY);
        let zero_f = fx.f32(0.0);
        let pm = fx.elem(m, r);
        fx.store(neg_inf, pm, 0);
        let pl = fx.elem(l, r);
        fx.store(zero_f, pl, 0);
        let pa = fx.elem_scaled(acc, r, v_dim_v);
        scale_row(fx, pa, v_dim, zero_f, true);
    });

    let n_tiles = fx.b.ins().iadd_imm_s(skv, tile - 1);
    let n_tiles = fx.b.ins().sshr_imm_s(n_tiles, tile.trailing_zeros() as i64);
    fx.for_range(zero, n_tiles, 1, |fx, t| {
        let code_addr = fx.b.ins().iadd(codes, t);
        let code = fx.load(I8, code_addr, 0);
        let run =
            fx.b.ins()
                .icmp_imm_s(IntCC::NotEqual, code, TileCode::Skip as i64);
        fx.if_then(run, |fx| {
            tile_step(
                fx,
                plan,
                refs,
                tables,
                &TileArgs {
                    t,
                    code,
                    qs,
                    s,
                    acc,
                    m,
                    l,
                    tile_max,
                    rows,
                    q_pos0,
                    qi0,
                    batch,
                    head,
                    kt,
                    v,
                    v_stride,
                    skv,
                    k_pos0,
                },
            );
        });
    });

    // Epilogue: normalize, write out and lse.
    fx.for_range(zero, rows, 1, |fx, r| {
        let pl = fx.elem(l, r);
        let lsum = fx.load(F32, pl, 0);
        let pm = fx.elem(m, r);
        let mrow = fx.load(F32, pm, 0);
        let zero_f = fx.f32(0.0);
        let nonempty = fx.b.ins().fcmp(FloatCC::GreaterThan, lsum, zero_f);
        let one = fx.f32(1.0);
        let inv = fx.b.ins().fdiv(one, lsum);
        let inv = fx.b.ins().select(nonempty, inv, zero_f);
        let pa = fx.elem_scaled(acc, r, v_dim_v);
        scale_row(fx, pa, v_dim, inv, false);
        let dst = fx.elem_scaled(out, r, out_stride);
        copy(fx, dst, pa, v_dim);
        let neg_inf = fx.f32(f32::NEG_INFINITY);
        let plse = fx.elem(lse, r);
        fx.if_else(
            nonempty,
            |fx| {
                let call = fx.b.ins().call(refs.logf, &[lsum]);
                let ln = fx.b.inst_results(call)[0];
                let ln2 = fx.f32(std::f32::consts::LN_2);
                let value = fx.b.ins().fma(mrow, ln2, ln);
                fx.store(value, plse, 0);
            },
            |fx| fx.store(neg_inf, plse, 0),
        );
    });
    fx.b.ins().return_(&[]);
}

struct TileArgs {
    t: Value,
    code: Value,
    qs: Value,
    s: Value,
    acc: Value,
    m: Value,
    l: Value,
    tile_max: Value,
    rows: Value,
    q_pos0: Value,
    qi0: Value,
    batch: Value,
    head: Value,
    kt: Value,
    v: Value,
    v_stride: Value,
    skv: Value,
    k_pos0: Value,
}

/// One key tile for every row of the block: scores, score program, mask, online softmax, PV.
fn tile_step(fx: &mut Fx, plan: &KernelPlan, refs: &Refs, tables: &mut Tables, a: &TileArgs) {
    let qk_dim = i64::from(plan.shape.qk_dim);
    let v_dim = i64::from(plan.shape.v_dim);
    let tile = i64::from(K_TILE);

    let tile_len = fx.i64(qk_dim * tile);
    let kt_t = fx.elem_scaled(a.kt, a.t, tile_len);
    let qk_v = fx.i64(qk_dim);
    fx.b.ins().call(
        refs.qk_tile,
        &[a.qs, qk_v, a.rows, qk_v, kt_t, a.s, a.tile_max],
    );

    let first_key = fx.b.ins().imul_imm_s(a.t, tile);
    let left = fx.b.ins().isub(a.skv, first_key);
    let tile_v = fx.i64(tile);
    let cols = fx.b.ins().smin(left, tile_v);
    let partial = fx.b.ins().icmp_imm_s(IntCC::SignedLessThan, cols, tile);
    let mixed =
        fx.b.ins()
            .icmp_imm_s(IntCC::Equal, a.code, TileCode::Masked as i64);
    let per_element = fx.b.ins().bor(partial, mixed);
    let tile_key_pos = fx.b.ins().iadd(a.k_pos0, first_key);
    let needs_mask_program = !matches!(plan.masking, TileMasking::Unmasked);
    let identity = identity_program(plan);

    let zero = fx.i64(0);
    let v_dim_v = fx.i64(v_dim);
    fx.for_range(zero, a.rows, 1, |fx, r| {
        let row = RowEnv {
            batch: a.batch,
            head: a.head,
            query: fx.b.ins().iadd(a.q_pos0, r),
            query_index: fx.b.ins().iadd(a.qi0, r),
        };
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
            skv: a.skv,
            max_var,
        };
        let (masked_block, full_block, join) = (
            fx.b.create_block(),
            fx.b.create_block(),
            fx.b.create_block(),
        );
        fx.b.ins()
            .brif(per_element, masked_block, &[], full_block, &[]);
        for (block, masked) in [(masked_block, true), (full_block, false)] {
            fx.b.switch_to_block(block);
            fx.b.seal_block(block);
            if masked || !identity {
                score_pass(fx, plan, refs, tables, &uniforms, &pass, masked);
            } else {
                // The program leaves scores as they are: the microkernel's row max serves.
                let at = fx.elem(a.tile_max, r);
                let mx = fx.load(F32, at, 0);
                let mx = fx.splat_f32(mx);
                fx.b.def_var(max_var, mx);
            }
            fx.b.ins().jump(join, &[]);
        }
        fx.b.switch_to_block(join);
        fx.b.seal_block(join);

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
        // alpha = e^(m_old - m_new) rescales the row's sum and accumulator; 1 unless the max grew.
        let alpha_var = fx.b.declare_var(F32);
        let one = fx.f32(1.0);
        fx.b.def_var(alpha_var, one);
        fx.if_then(grew, |fx| {
            let shift = fx.b.ins().fsub(m_old, m_use);
            let alpha = fx.exp2_1_nonpositive(shift);
            fx.b.def_var(alpha_var, alpha);
        });

        // Pass 2: probabilities and their sum.
        let sum_var = fx.b.declare_var(F32X4);
        let zero4 = fx.f32x4(0.0);
        fx.b.def_var(sum_var, zero4);
        let m4 = fx.splat_f32(m_use);
        let (z, end) = (fx.i64(0), fx.i64(tile));
        // Two groups per iteration: independent exp chains overlap in the pipeline.
        fx.for_range(z, end, 8, |fx, c| {
            let p = fx.elem(s_row, c);
            let mut acc_sum = fx.b.use_var(sum_var);
            for offset in [0, 16] {
                let x = fx.load(F32X4, p, offset);
                let x = fx.b.ins().fsub(x, m4);
                let e = fx.exp2_4_nonpositive(x);
                fx.store(e, p, offset);
                acc_sum = fx.b.ins().fadd(acc_sum, e);
            }
            fx.b.def_var(sum_var, acc_sum);
        });
        let sum4 = fx.b.use_var(sum_var);
        let tile_sum = fx.reduce(sum4, false);
        let pl = fx.elem(a.l, r);
        let l_old = fx.load(F32, pl, 0);
        let alpha = fx.b.use_var(alpha_var);
        let l_new = fx.b.ins().fma(l_old, alpha, tile_sum);
        fx.store(l_new, pl, 0);

        // Rescale the accumulator when the max grew.
        let pa = fx.elem_scaled(a.acc, r, v_dim_v);
        fx.if_then(grew, |fx| scale_row(fx, pa, v_dim, alpha, false));
    });

    let v_tile = fx.elem_scaled(a.v, first_key, a.v_stride);
    fx.b.ins().call(
        refs.pv_tile,
        &[a.s, a.rows, cols, v_tile, a.v_stride, a.acc, v_dim_v],
    );
}

struct ScorePass {
    s_row: Value,
    tile_key_pos: Value,
    first_key: Value,
    skv: Value,
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
    let needs_mask_program = !matches!(plan.masking, TileMasking::Unmasked);
    let (z, end) = (fx.i64(0), fx.i64(i64::from(K_TILE)));
    fx.for_range(z, end, 4, |fx, c| {
        let p = fx.elem(pass.s_row, c);
        let raw = fx.load(F32X4, p, 0);
        let g = GroupEnv {
            score: raw,
            key0: fx.b.ins().iadd(pass.tile_key_pos, c),
            key_index0: fx.b.ins().iadd(pass.first_key, c),
        };
        let mut lowering = ScoreLowering {
            logf: refs.logf,
            tables: &mut *tables,
        };
        let mut value = lowering.float4(fx, uniforms, &g, &plan.program.score);
        if masked {
            // Keys past the end of the sequence, and keys the mask drops, get -inf.
            let inside: [Value; 4] = [0, 1, 2, 3].map(|i| {
                let ki = fx.b.ins().iadd_imm_s(g.key_index0, i);
                let inside = fx.b.ins().icmp(IntCC::SignedLessThan, ki, pass.skv);
                fx.b.ins().bmask(I32, inside)
            });
            let mut keep = fx.gather4(I32X4, inside);
            if needs_mask_program {
                let mask = lowering.mask4(fx, uniforms, &g, &plan.program.mask);
                keep = fx.b.ins().band(keep, mask);
            }
            let keep = fx.b.ins().bitcast(F32X4, MemFlagsData::new(), keep);
            let neg_inf = fx.f32x4(f32::NEG_INFINITY);
            value = fx.b.ins().bitselect(keep, value, neg_inf);
        }
        fx.store(value, p, 0);
        let mx = fx.b.use_var(pass.max_var);
        let mx = fx.pmax4(value, mx);
        fx.b.def_var(pass.max_var, mx);
    });
}
