//! The generated functions of CPU kernels: `pack_k` (RoPE and transpose the keys of one
//! (batch, kv head) into tiles) and `block` (a block of query rows of one head against every
//! packed key tile) for forward plans; `decode` (the query rows of one kv head's group against a
//! list of key segments read in place, such as a paged cache's blocks) for decode plans. The
//! per-tile work both share is in `step.rs`, the row helpers every generated function uses in
//! `rows.rs`.

use super::abi::{BlockArgs, BlockTile, DecodeArgs, PackArgs, Segment};
use super::fx::Fx;
use super::rows::{Refs, copy, field, rotate};
use super::score::Tables;
use super::step::{BlockState, KeyTile, RowMap, Rows, epilogue, prologue, softmax_step};
use crate::plan::TileCode;
use crate::plan::{K_TILE, KernelPlan};
use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::types::{F32, F32X4, I32, I64};
use cranelift_codegen::ir::{InstBuilder, Value};

/// The address of key `j`'s dim 0 in the packed tiles, `kt[j / K][0][j % K]`; its dim `d` is
/// `d * K` values further.
fn column_base(fx: &mut Fx, kt: Value, j: Value, dim: i64) -> Value {
    let tile = i64::from(K_TILE);
    let t = fx.b.ins().ushr_imm_s(j, tile.trailing_zeros() as i64);
    let col = fx.b.ins().band_imm_s(j, tile - 1);
    let tile_len = fx.i64(dim * tile);
    let tile_base = fx.elem_scaled(kt, t, tile_len);
    fx.elem(tile_base, col)
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
    let dst = column_base(fx, kt, j, dim);
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
    // With RoPE, rows are rotated in a copy (up to four at a time) before they are stored.
    let rows_buf =
        fx.b.create_sized_stack_slot(cranelift_codegen::ir::StackSlotData::new(
            cranelift_codegen::ir::StackSlotKind::ExplicitSlot,
            (4 * dim * 4) as u32,
            4,
        ));
    let source_rows = |fx: &mut Fx, j: Value, n: i64| -> (Value, Value) {
        let src = fx.elem_scaled(k, j, stride);
        let Some(rope) = &plan.rope else {
            return (src, stride);
        };
        let buf = fx.b.ins().stack_addr(I64, rows_buf, 0);
        for i in 0..n {
            let from = fx.b.ins().iadd_imm_s(j, i);
            let from = fx.elem_scaled(k, from, stride);
            let to = fx.b.ins().iadd_imm_s(buf, i * dim * 4);
            copy(fx, to, from, dim);
            let pos = fx.b.ins().iadd(k_pos0, j);
            let pos = fx.b.ins().iadd_imm_s(pos, i);
            rotate(fx, rope, to, pos, tables);
        }
        let dim_v = fx.i64(dim);
        (buf, dim_v)
    };

    // Four keys at a time (four consecutive columns of one tile): 4 x 4 transposes.
    let quads = fx.b.ins().band_imm_s(skv, !3);
    let zero = fx.i64(0);
    fx.for_range(zero, quads, 4, |fx, j| {
        let (rows, row_stride) = source_rows(fx, j, 4);
        let column = column_base(fx, kt, j, dim);
        let row_ptrs: [Value; 4] = [0, 1, 2, 3].map(|i| {
            let i = fx.i64(i);
            fx.elem_scaled(rows, i, row_stride)
        });
        let dim4 = dim / 4 * 4;
        if dim4 > 0 {
            let end = fx.i64(dim4);
            let zero = fx.i64(0);
            let tile_v = fx.i64(tile);
            fx.for_range(zero, end, 4, |fx, d| {
                let lanes = row_ptrs.map(|row| {
                    let at = fx.elem(row, d);
                    fx.load(F32X4, at, 0)
                });
                let columns = fx.transpose4(lanes);
                let dst = fx.elem_scaled(column, d, tile_v);
                for (i, c) in columns.into_iter().enumerate() {
                    fx.store(c, dst, (i as i64 * tile * 4) as i32);
                }
            });
        }
        for d in dim4..dim {
            for (i, row) in row_ptrs.iter().enumerate() {
                let x = fx.load(F32, *row, (d * 4) as i32);
                fx.store(x, column, ((d * tile + i as i64) * 4) as i32);
            }
        }
    });
    // The last keys one at a time, then zeros in the padding columns of the last tile.
    fx.for_range(quads, skv, 1, |fx, j| {
        let (row, _) = source_rows(fx, j, 1);
        store_column(fx, kt, j, dim, |fx, d| {
            let s = fx.elem(row, d);
            fx.load(F32, s, 0)
        });
    });
    let padded = fx.b.ins().iadd_imm_s(skv, tile - 1);
    let padded = fx.b.ins().band_imm_s(padded, !(tile - 1));
    fx.for_range(skv, padded, 1, |fx, j| {
        store_column(fx, kt, j, dim, |fx, _| fx.f32(0.0));
    });
    fx.b.ins().return_(&[]);
}

/// Multiplies `rows` rows of a key tile's raw scores (`K_TILE` values each from `s`) and their
/// maxima by `factor`, for kernels that scale the scores after `qk_tile`
/// ([`Refs::scales_scores`]; the factor is positive, so the maxima stay the rows' maxima).
fn scale_scores(fx: &mut Fx, factor: f32, s: Value, row_max: Value, rows: Value) {
    let factor = fx.f32(factor);
    let factor4 = fx.splat_f32(factor);
    let zero = fx.i64(0);
    let values = fx.b.ins().imul_imm_s(rows, i64::from(K_TILE));
    fx.for_range(zero, values, 4, |fx, i| {
        let at = fx.elem(s, i);
        let x = fx.load(F32X4, at, 0);
        let y = fx.b.ins().fmul(x, factor4);
        fx.store(y, at, 0);
    });
    fx.for_range(zero, rows, 1, |fx, r| {
        let at = fx.elem(row_max, r);
        let m = fx.load(F32, at, 0);
        let y = fx.b.ins().fmul(m, factor);
        fx.store(y, at, 0);
    });
}

/// `block(args: *const BlockArgs)`.
pub(super) fn block(fx: &mut Fx, plan: &KernelPlan, refs: &Refs, tables: &mut Tables, args: Value) {
    if !plan.params.is_empty() {
        let base = field!(fx, args, I64, BlockArgs.params);
        tables.params = Some((base, plan.params.clone()));
    }
    let qk_dim = i64::from(plan.shape.qk_dim);
    let tile = i64::from(K_TILE);
    let rows = field!(fx, args, I64, BlockArgs.rows);
    let q_pos0 = field!(fx, args, I64, BlockArgs.q_pos0);
    let qi0 = field!(fx, args, I64, BlockArgs.qi0);
    let batch = field!(fx, args, I64, BlockArgs.batch);
    let head = field!(fx, args, I64, BlockArgs.head);
    let scratch = field!(fx, args, I64, BlockArgs.scratch);
    let state = BlockState::new(
        fx,
        plan,
        scratch,
        Rows {
            count: rows,
            q_pos0,
            qi0,
            batch,
        },
        RowMap::OneHead { head },
    );
    let q = field!(fx, args, I64, BlockArgs.q);
    let q_stride = field!(fx, args, I64, BlockArgs.q_row_stride);
    let rope_tables = [
        field!(fx, args, I64, BlockArgs.rope_cos),
        field!(fx, args, I64, BlockArgs.rope_sin),
        field!(fx, args, I64, BlockArgs.table_pos0),
    ];
    prologue(
        fx,
        plan,
        &state,
        [q, q_stride],
        rope_tables,
        refs.scales_scores,
    );

    let kt = field!(fx, args, I64, BlockArgs.kt);
    let v = field!(fx, args, I64, BlockArgs.v);
    let v_stride = field!(fx, args, I64, BlockArgs.v_row_stride);
    let skv = field!(fx, args, I64, BlockArgs.skv);
    let k_pos0 = field!(fx, args, I64, BlockArgs.k_pos0);
    let records = field!(fx, args, I64, BlockArgs.tiles);
    let n_tiles = fx.b.ins().iadd_imm_s(skv, tile - 1);
    let n_tiles = fx.b.ins().sshr_imm_s(n_tiles, tile.trailing_zeros() as i64);
    let zero = fx.i64(0);
    fx.for_range(zero, n_tiles, 1, |fx, i| {
        // Stick-breaking weighs keys from the nearest: tiles from the last.
        let t = match plan.stick_breaking() {
            true => {
                let last = fx.b.ins().iadd_imm_s(n_tiles, -1);
                fx.b.ins().isub(last, i)
            }
            false => i,
        };
        let record_len = fx.i64(std::mem::size_of::<BlockTile>() as i64);
        let at = fx.b.ins().imul(t, record_len);
        let record = fx.b.ins().iadd(records, at);
        let code = field!(fx, record, I32, BlockTile.code);
        let code = fx.b.ins().uextend(I64, code);
        let run =
            fx.b.ins()
                .icmp_imm_s(IntCC::NotEqual, code, TileCode::Skip as i64);
        fx.if_then(run, |fx| {
            let first_row = field!(fx, record, I32, BlockTile.first_row);
            let first_row = fx.b.ins().uextend(I64, first_row);
            let end_row = field!(fx, record, I32, BlockTile.end_row);
            let end_row = fx.b.ins().uextend(I64, end_row);
            let kept_from = field!(fx, record, I32, BlockTile.kept_from);
            let kept_from = fx.b.ins().uextend(I64, kept_from);
            let tile_len = fx.i64(qk_dim * tile);
            let kt_t = fx.elem_scaled(kt, t, tile_len);
            let qk_v = fx.i64(qk_dim);
            let tile_v = fx.i64(tile);
            let q_rows = fx.elem_scaled(state.qs, first_row, qk_v);
            let live = fx.b.ins().isub(end_row, first_row);
            let s_rows = fx.elem_scaled(state.s, first_row, tile_v);
            let max_rows = fx.elem(state.tile_max, first_row);
            fx.b.ins()
                .call(refs.qk, &[q_rows, qk_v, live, qk_v, kt_t, s_rows, max_rows]);
            if refs.scales_scores && plan.q_scale != 1.0 {
                scale_scores(fx, plan.q_scale as f32, s_rows, max_rows, live);
            }
            let first_key = fx.b.ins().imul_imm_s(t, tile);
            let left = fx.b.ins().isub(skv, first_key);
            let cols = fx.b.ins().smin(left, tile_v);
            let key_tile = KeyTile {
                code,
                first_key,
                position: fx.b.ins().iadd(k_pos0, first_key),
                cols,
                key_end: skv,
                v: fx.elem_scaled(v, first_key, v_stride),
                v_stride,
                first_row,
                end_row,
                kept_from,
                then: None,
            };
            softmax_step(fx, plan, refs, tables, &state, &key_tile);
        });
    });

    let out = field!(fx, args, I64, BlockArgs.out);
    let out_stride = field!(fx, args, I64, BlockArgs.out_row_stride);
    let lse = field!(fx, args, I64, BlockArgs.lse);
    epilogue(fx, plan, refs, &state, out, out_stride, lse);
    fx.b.ins().return_(&[]);
}

/// `decode(args: *const DecodeArgs)`.
pub(super) fn decode(
    fx: &mut Fx,
    plan: &KernelPlan,
    refs: &Refs,
    tables: &mut Tables,
    args: Value,
) {
    if !plan.params.is_empty() {
        let base = field!(fx, args, I64, DecodeArgs.params);
        tables.params = Some((base, plan.params.clone()));
    }
    let qk_dim = i64::from(plan.shape.qk_dim);
    let rows = field!(fx, args, I64, DecodeArgs.rows);
    let q_pos0 = field!(fx, args, I64, DecodeArgs.q_pos0);
    let qi0 = field!(fx, args, I64, DecodeArgs.qi0);
    let batch = field!(fx, args, I64, DecodeArgs.batch);
    let head0 = field!(fx, args, I64, DecodeArgs.head0);
    let q_len = field!(fx, args, I64, DecodeArgs.q_len);
    let scratch = field!(fx, args, I64, DecodeArgs.scratch);
    let state = BlockState::new(
        fx,
        plan,
        scratch,
        Rows {
            count: rows,
            q_pos0,
            qi0,
            batch,
        },
        RowMap::Grouped { head0, q_len },
    );
    let q = field!(fx, args, I64, DecodeArgs.q);
    let q_stride = field!(fx, args, I64, DecodeArgs.q_row_stride);
    let rope_tables = [
        field!(fx, args, I64, DecodeArgs.rope_cos),
        field!(fx, args, I64, DecodeArgs.rope_sin),
        field!(fx, args, I64, DecodeArgs.table_pos0),
    ];
    prologue(
        fx,
        plan,
        &state,
        [q, q_stride],
        rope_tables,
        refs.scales_scores,
    );

    let segments = field!(fx, args, I64, DecodeArgs.segments);
    let n_segments = field!(fx, args, I64, DecodeArgs.n_segments);
    let k_stride = field!(fx, args, I64, DecodeArgs.k_row_stride);
    let v_stride = field!(fx, args, I64, DecodeArgs.v_row_stride);
    let record = fx.i64(std::mem::size_of::<Segment>() as i64);
    let zero = fx.i64(0);
    // Stick-breaking weighs keys from the nearest: segments from the last.
    let stick = plan.stick_breaking();
    fx.for_range(zero, n_segments, 1, |fx, j| {
        let i = match stick {
            true => {
                let last = fx.b.ins().iadd_imm_s(n_segments, -1);
                fx.b.ins().isub(last, j)
            }
            false => j,
        };
        let at = fx.b.ins().imul(i, record);
        let seg = fx.b.ins().iadd(segments, at);
        let code = field!(fx, seg, I64, Segment.code);
        let run =
            fx.b.ins()
                .icmp_imm_s(IntCC::NotEqual, code, TileCode::Skip as i64);
        fx.if_then(run, |fx| {
            let k = field!(fx, seg, I64, Segment.k);
            let v = field!(fx, seg, I64, Segment.v);
            let first_key = field!(fx, seg, I64, Segment.first_key);
            let cols = field!(fx, seg, I64, Segment.len);
            let qk_v = fx.i64(qk_dim);
            // The next segment's keys (null after the last), which `pv_rows` prefetches.
            let next = fx.b.ins().iadd_imm_s(j, 1);
            let last =
                fx.b.ins()
                    .icmp(IntCC::SignedGreaterThanOrEqual, next, n_segments);
            let next = match stick {
                true => fx.b.ins().iadd_imm_s(i, -1),
                false => next,
            };
            let next_i = fx.b.ins().select(last, i, next);
            let next_at = fx.b.ins().imul(next_i, record);
            let next_seg = fx.b.ins().iadd(segments, next_at);
            let next_k = field!(fx, next_seg, I64, Segment.k);
            let next_k = fx.b.ins().select(last, zero, next_k);
            fx.b.ins().call(
                refs.qk,
                &[
                    state.qs,
                    qk_v,
                    rows,
                    qk_v,
                    k,
                    k_stride,
                    cols,
                    state.s,
                    state.tile_max,
                    v,
                    v_stride,
                ],
            );
            let key_tile = KeyTile {
                code,
                first_key,
                position: first_key,
                cols,
                key_end: fx.b.ins().iadd(first_key, cols),
                v,
                v_stride,
                first_row: fx.i64(0),
                end_row: rows,
                // A masked segment masks every row.
                kept_from: rows,
                then: Some([next_k, k_stride]),
            };
            softmax_step(fx, plan, refs, tables, &state, &key_tile);
        });
    });

    let out = field!(fx, args, I64, DecodeArgs.out);
    let out_stride = field!(fx, args, I64, DecodeArgs.out_row_stride);
    let lse = field!(fx, args, I64, DecodeArgs.lse);
    epilogue(fx, plan, refs, &state, out, out_stride, lse);
    fx.b.ins().return_(&[]);
}
