//! The score program (modifier IR) lowered to GPU IR, with the reference evaluator's
//! semantics, and applied with the mask to a tensor-core tile of scores ([`score_tile`]).

use super::build::param;
use super::softmax::scale_folds;
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Reg, Space, Stmt, Ty, Un};
use crate::plan::{KernelPlan, ParamLayout, TileCode};
use attn_dsl::modifier::{BinOp, Expr as M, ParamRead, Ty as MTy, UnOp, Var};

/// The values of the score program's variables for one (row, key).
pub(crate) struct Env {
    pub score: Expr,
    pub batch: Expr,
    pub head: Expr,
    pub query: Expr,
    pub key: Expr,
    pub query_index: Expr,
    pub key_index: Expr,
    /// The parameter buffer's global address and its layout, for plans with parameters (the
    /// kernels that read them: the SIMT forward, decode and backward).
    pub params: Option<(Expr, crate::plan::ParamLayout)>,
}

/// A modifier-IR expression as GPU IR, with the reference evaluator's semantics: wrapping i64,
/// integer division and remainder by zero give 0, tables clamp their index; `exp`, `ln` and
/// `tanh` through `ex2` and `lg2`.
pub(crate) fn program(e: &M, env: &Env) -> Expr {
    let go = |e: &M| program(e, env);
    match e {
        M::Var(v) => match v {
            Var::Score => env.score.clone(),
            Var::Batch => env.batch.clone(),
            Var::Head => env.head.clone(),
            Var::Query => env.query.clone(),
            Var::Key => env.key.clone(),
            Var::QueryIndex => env.query_index.clone(),
            Var::KeyIndex => env.key_index.clone(),
        },
        M::Float(x) => f32(*x as f32),
        M::Int(x) => i64(*x),
        M::Bool(b) => Expr::Pred(*b),
        M::Param(read) => {
            let (base, layout) = env
                .params
                .as_ref()
                .expect("only kernels given a parameter buffer lower plans with parameters");
            let addr = at(base.clone(), param_element(read, layout, env), 4);
            if read.ty == MTy::I64 {
                cast(load(Space::Global, Ty::I32, addr), Ty::I64)
            } else {
                load(Space::Global, Ty::F32, addr)
            }
        }
        M::Unary(op, a) => {
            let a = go(a);
            match op {
                UnOp::Neg => un(Un::Neg, a),
                UnOp::Abs => un(Un::Abs, a),
                UnOp::Not => un(Un::Not, a),
                UnOp::Sqrt => un(Un::Sqrt, a),
                UnOp::Exp => un(Un::Ex2, mul(a, f32(std::f32::consts::LOG2_E))),
                UnOp::Ln => mul(un(Un::Lg2, a), f32(std::f32::consts::LN_2)),
                UnOp::Tanh => {
                    // tanh|x| = (1 - e) / (1 + e), e = 2^(-2 |x| log2 e); the sign of x.
                    let e = un(
                        Un::Ex2,
                        mul(un(Un::Abs, a.clone()), f32(-2.0 * std::f32::consts::LOG2_E)),
                    );
                    let t = bin(Bin::Div, sub(f32(1.0), e.clone()), add(f32(1.0), e));
                    select(bin(Bin::Lt, a, f32(0.0)), un(Un::Neg, t.clone()), t)
                }
            }
        }
        M::Binary(op, a, b) => {
            let float = attn_dsl::modifier::typecheck::typecheck(a).ok() == Some(MTy::F32);
            let (x, y) = (go(a), go(b));
            let op_ir = match op {
                BinOp::Add => Bin::Add,
                BinOp::Sub => Bin::Sub,
                BinOp::Mul => Bin::Mul,
                BinOp::Div => Bin::Div,
                BinOp::Rem => Bin::Rem,
                BinOp::Min => Bin::Min,
                BinOp::Max => Bin::Max,
                BinOp::Lt => Bin::Lt,
                BinOp::Le => Bin::Le,
                BinOp::Gt => Bin::Gt,
                BinOp::Ge => Bin::Ge,
                BinOp::Eq => Bin::Eq,
                BinOp::Ne => Bin::Ne,
                BinOp::And => Bin::And,
                BinOp::Or => Bin::Or,
            };
            if !float && matches!(op, BinOp::Div | BinOp::Rem) {
                // PTX leaves integer division by zero undefined; the semantics say 0.
                let zero = bin(Bin::Eq, y.clone(), i64(0));
                let safe = select(zero.clone(), i64(1), y);
                select(zero, i64(0), bin(op_ir, x, safe))
            } else if float && matches!(op, BinOp::Min | BinOp::Max) {
                // `min.f32` and `max.f32` return the other operand for NaN; the semantics say
                // NaN, as PyTorch's `minimum` and `maximum` (`x != x` holds for NaN alone).
                let m = bin(op_ir, x.clone(), y.clone());
                let y_nan = bin(Bin::Ne, y.clone(), y.clone());
                let x_nan = bin(Bin::Ne, x.clone(), x.clone());
                select(x_nan, x, select(y_nan, y, m))
            } else {
                bin(op_ir, x, y)
            }
        }
        M::Select(c, a, b) => select(go(c), go(a), go(b)),
        M::Cast(a, ty) => cast(
            go(a),
            match ty {
                MTy::F32 => Ty::F32,
                MTy::I64 => Ty::I64,
                MTy::Bool => Ty::Pred,
            },
        ),
        M::Table(values, index) => Expr::Table(
            values.iter().map(|v| *v as f32).collect(),
            Box::new(go(index)),
        ),
    }
}

/// The element of the parameter buffer (laid out as `layout`) that `read` reads: row-major,
/// each index clamped into its dimension (the spec proved it in range; the clamp keeps memory
/// safety from resting on the proof).
pub(crate) fn param_element(read: &ParamRead, layout: &ParamLayout, env: &Env) -> Expr {
    if let Some(slot) = layout.data_slot(&read.name) {
        return data_element(read, slot.header as i64, env);
    }
    let slot = layout
        .slot(&read.name)
        .expect("validation resolves every read to a declared parameter");
    let mut flat = i64(slot.offset as i64);
    let mut stride = 1i64;
    for (index, &dim) in read.indices.iter().zip(&slot.shape).rev() {
        let clamped = bin(
            Bin::Min,
            bin(Bin::Max, program(index, env), i64(0)),
            i64(dim as i64 - 1),
        );
        flat = add(flat, mul(clamped, i64(stride)));
        stride *= dim as i64;
    }
    flat
}

/// The element of the buffer a data tensor's `read` reads, through its header at word `header`
/// ([`crate::plan::DataSlot`]): each index less its origin, clamped into its dimension (min
/// before max: an empty dimension reads the first element, which the call keeps in the buffer).
fn data_element(read: &ParamRead, header: i64, env: &Env) -> Expr {
    let base = &env
        .params
        .as_ref()
        .expect("only kernels given a parameter buffer lower plans with data")
        .0;
    let word = |at_word: i64| {
        cast(
            load(Space::Global, Ty::I32, at(base.clone(), i64(at_word), 4)),
            Ty::I64,
        )
    };
    let rank = read.indices.len() as i64;
    let mut flat = word(header);
    let mut stride: Option<Expr> = None;
    for (axis, index) in read.indices.iter().enumerate().rev() {
        let len = word(header + 1 + axis as i64);
        let shifted = sub(program(index, env), word(header + 1 + rank + axis as i64));
        let clamped = bin(
            Bin::Max,
            bin(Bin::Min, shifted, sub(len.clone(), i64(1))),
            i64(0),
        );
        flat = add(
            flat,
            match &stride {
                Some(s) => mul(clamped, s.clone()),
                None => clamped,
            },
        );
        stride = Some(match stride {
            Some(s) => mul(s, len),
            None => len,
        });
    }
    flat
}

/// A tile's scores as `mma` C fragments: `s[rb][nb][i]` holds key `8 nb + 2 q + i % 2` of tile
/// `tile` for row `h = i / 2` of row block `rb` (`row_of(rb, h)`, at position `pos_of(rb, h)`).
pub(crate) struct TileScores<'a> {
    pub s: &'a [Vec<[Reg; 4]>],
    pub tile: Reg,
    pub key_tile: i64,
    pub q: Reg,
    pub batch: Reg,
    pub head: Reg,
    pub row_of: &'a dyn Fn(usize, usize) -> Expr,
    pub pos_of: &'a dyn Fn(usize, usize) -> Expr,
}

/// The score program, per element. A tile of code 1 keeps every key (the launch gives code 1
/// only to tiles inside Skv), so the mask and the Skv bound apply under code 2 alone. When the
/// program is the scaled score itself, S stays unscaled: its max is taken raw and the scale
/// applies inside the exponent, `2^(s c - m c)`, one fused multiply-add per score.
pub(crate) fn score_tile(plan: &KernelPlan, tile: &TileScores, code: Reg) -> Stmt {
    let scale = plan.q_scale as f32;
    let folded = scale_folds(plan);
    let keep_mask = !matches!(plan.program.mask, M::Bool(true));
    let (mut kept, mut masked) = (Vec::new(), Vec::new());
    for (rb, block) in tile.s.iter().enumerate() {
        for (nb, frag) in block.iter().enumerate() {
            for (i, &x) in frag.iter().enumerate() {
                let h = i / 2;
                let key = add(
                    mul(reg(tile.tile), i64(tile.key_tile)),
                    add(mul(reg(tile.q), i64(2)), i64((8 * nb + i % 2) as i64)),
                );
                let env = Env {
                    score: mul(reg(x), f32(scale)),
                    batch: reg(tile.batch),
                    head: reg(tile.head),
                    query: (tile.pos_of)(rb, h),
                    key: add(param("p0"), key.clone()),
                    query_index: (tile.row_of)(rb, h),
                    key_index: key.clone(),
                    params: None,
                };
                let value = if folded {
                    reg(x)
                } else {
                    program(&plan.program.score, &env)
                };
                if !folded {
                    kept.push(Stmt::Set(x, value.clone()));
                }
                let mut keep = bin(Bin::Lt, key, param("skv"));
                if keep_mask {
                    keep = bin(Bin::And, keep, program(&plan.program.mask, &env));
                }
                masked.push(Stmt::Set(x, select(keep, value, f32(f32::NEG_INFINITY))));
            }
        }
    }
    Stmt::If(
        bin(
            Bin::Eq,
            reg(code),
            Expr::Int(TileCode::Masked as i64, Ty::I32),
        ),
        masked,
        kept,
    )
}
