//! RoPE in the kernels: the table parameters of a launch, rotating a row held in registers,
//! loads of a table entry, and the rotation of one pair.

use super::build::Regs;
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Expr, Reg, Space, Stmt, Ty, Un};
use crate::plan::RopePrologue;
use attn_dsl::RopeLayout;

/// A kernel's RoPE table parameters, `[rope_cos, rope_sin, rope_pos0]`, from its launch
/// record's `param` lookup.
pub(crate) fn rope_params(param: impl Fn(&str) -> Expr) -> [Expr; 3] {
    [param("rope_cos"), param("rope_sin"), param("rope_pos0")]
}

/// RoPE on a row held in registers, at position `pos`, from the per-position cos/sin tables
/// `[cos, sin, pos0]` (rows of `dim / 2` f32 from position `pos0`). `inverse` applies the
/// transposed rotation (sines negated), which takes a gradient back to the unrotated input.
pub(crate) fn rotate(
    r: &mut Regs,
    rope: &RopePrologue,
    row: &[Reg],
    pos: Expr,
    [cos, sin, pos0]: &[Expr; 3],
    inverse: bool,
) -> Vec<Stmt> {
    let half = i64::from(rope.rope.dim / 2);
    let first = rope.first_dim as usize;
    let table_row = r.add("rope_row", Ty::I64);
    let (c, s, a, b) = (
        r.add("cos", Ty::F32),
        r.add("sin", Ty::F32),
        r.add("rot_a", Ty::F32),
        r.add("rot_b", Ty::F32),
    );
    let mut out = vec![Stmt::Set(table_row, sub(pos, pos0.clone()))];
    for i in 0..half as usize {
        let (ia, ib) = match rope.rope.layout {
            RopeLayout::Half => (first + i, first + i + half as usize),
            RopeLayout::Interleaved => (first + 2 * i, first + 2 * i + 1),
        };
        let entry = add(mul(reg(table_row), i64(half * 4)), i64(4 * i as i64));
        out.extend(cos_sin([c, s], [cos.clone(), sin.clone()], entry));
        out.extend([Stmt::Set(a, reg(row[ia])), Stmt::Set(b, reg(row[ib]))]);
        let sine = if inverse { un(Un::Neg, reg(s)) } else { reg(s) };
        let (ra, rb) = rotate_pair(reg(a), reg(b), reg(c), sine);
        out.extend([Stmt::Set(row[ia], ra), Stmt::Set(row[ib], rb)]);
    }
    out
}

/// Loads of a RoPE table entry (a byte offset into both tables) into registers `c` and `s`.
pub(crate) fn cos_sin([c, s]: [Reg; 2], [cos, sin]: [Expr; 2], entry: Expr) -> [Stmt; 2] {
    [
        Stmt::Set(c, load(Space::Global, Ty::F32, add(cos, entry.clone()))),
        Stmt::Set(s, load(Space::Global, Ty::F32, add(sin, entry))),
    ]
}

/// A RoPE pair `(a, b)` rotated by the angle of cosine `c` and sine `s`:
/// `(a c - b s, b c + a s)`.
pub(crate) fn rotate_pair(a: Expr, b: Expr, c: Expr, s: Expr) -> (Expr, Expr) {
    (
        sub(mul(a.clone(), c.clone()), mul(b.clone(), s.clone())),
        add(mul(b, c), mul(a, s)),
    )
}
