//! What every generated CPU function shares: the imported functions it calls ([`Refs`]), loads
//! of launch-record fields ([`field!`]), and operations on one row of f32 values (RoPE, copies,
//! scaling). Used by the forward and decode lowering (`emit.rs`, `step.rs`) and the backward's
//! (`backward.rs`).

use super::fx::Fx;
use crate::plan::{KernelPlan, RopePrologue};
use cranelift_codegen::ir::types::{F32, F32X4};
use cranelift_codegen::ir::{FuncRef, InstBuilder, Value};

/// The imported functions, as referenced from one generated function.
pub(super) struct Refs {
    /// Raw scores of a key tile: `qk_tile` (forward) or `qk_rows` (decode).
    pub qk: FuncRef,
    /// The value product of a key tile (over f32, or over the cache's dtype for decode).
    pub pv: FuncRef,
    pub logf: FuncRef,
    /// The online softmax's exponentials of a tile (`exp_tile`).
    pub exp_tile: FuncRef,
    /// The backward's probabilities and `dS` of a tile (`ds_tile`).
    pub ds_tile: FuncRef,
    /// Whether `qk` gives unscaled scores, which the kernel multiplies by `q_scale` after it
    /// (the queries stay unscaled): [`Imports::scores_after_qk`](super::abi::Imports) where the
    /// plan allows it.
    pub scales_scores: bool,
}

macro_rules! field {
    ($fx:expr, $args:expr, $ty:expr, $record:ident . $field:ident) => {
        $fx.load($ty, $args, std::mem::offset_of!($record, $field) as i32)
    };
}
pub(super) use field;

/// Whether the score program leaves the (q-scaled) score as it is: the score microkernel's row
/// maximum is then the tile's.
pub(super) fn identity_program(plan: &KernelPlan) -> bool {
    plan.program.score == attn_dsl::modifier::Expr::Var(attn_dsl::modifier::Var::Score)
}

/// Rotates one row in place: `row` points at the row's first value, `pos` is its position.
pub(super) fn rotate(fx: &mut Fx, rope: &RopePrologue, row: Value, pos: Value, tables: [Value; 3]) {
    let [cos, sin, pos0] = tables;
    let half = i64::from(rope.rope.dim / 2);
    let table_row = fx.b.ins().isub(pos, pos0);
    let half_v = fx.i64(half);
    let cos_row = fx.elem_scaled(cos, table_row, half_v);
    let sin_row = fx.elem_scaled(sin, table_row, half_v);
    let first = i64::from(rope.first_dim);
    let (zero, end) = (fx.i64(0), fx.i64(half));
    let pairing = rope.rope.layout.pairing(rope.rope.dim);
    // Pair i is dims `first + stride i` and that plus `partner` (strides are powers of two).
    let shift = pairing.stride.trailing_zeros() as i64;
    fx.for_range(zero, end, 1, |fx, i| {
        let scaled = if shift == 0 {
            i
        } else {
            fx.b.ins().ishl_imm_s(i, shift)
        };
        let a = fx.b.ins().iadd_imm_s(scaled, first);
        let b = fx.b.ins().iadd_imm_s(a, pairing.partner as i64);
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
pub(super) fn copy(fx: &mut Fx, dst: Value, src: Value, n: i64) {
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
pub(super) fn scale_row(fx: &mut Fx, dst: Value, n: i64, factor: Value, set: bool) {
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
