//! RoPE in the kernels: the table parameters of a launch, rotating a row held in registers,
//! loads of a table entry, and the rotation of one pair.

use super::build::Regs;
use crate::gpu::ir::Half;
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Expr, Reg, Space, Stmt, Ty, Un};
use crate::plan::RopePrologue;
use attn_dsl::Pairing;

pub(crate) use attn_dsl::reference::rope::Side;

/// The launch parameters holding the cos and sin tables that rows of `side` read: the keys'
/// differ from the queries' under xPos (elsewhere the host passes the same tables twice).
pub(crate) fn table_names(side: Side) -> [&'static str; 2] {
    match side {
        Side::Query => ["rope_cos", "rope_sin"],
        Side::Key => ["rope_key_cos", "rope_key_sin"],
    }
}

/// A kernel's RoPE table parameters for rows of `side`, `[cos, sin, rope_pos0]`, from its
/// launch record's `param` lookup.
pub(crate) fn rope_params(param: impl Fn(&str) -> Expr, side: Side) -> [Expr; 3] {
    let [cos, sin] = table_names(side);
    [param(cos), param(sin), param("rope_pos0")]
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
    let pairing = rope.rope.layout.pairing(rope.rope.dim);
    for i in 0..half as usize {
        let (ia, ib) = pairing.pair(i);
        let (ia, ib) = (first + ia, first + ib);
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

/// One RoPE work item on 16-bit pairs in shared memory: `elem(c)` reads column `c` as f32,
/// `word(c)` is the shared address of the 32-bit word at column `c`, and `rotated(a, b, f)`
/// rotates a pair by table entry `f`; values are written in the format `to`.
pub(crate) struct RopeWords<'a> {
    pub pairing: Pairing,
    pub to: Half,
    pub elem: &'a dyn Fn(Expr) -> Expr,
    pub word: &'a dyn Fn(Expr) -> Expr,
    pub rotated: &'a dyn Fn(Expr, Expr, Expr) -> (Expr, Expr),
}

impl RopeWords<'_> {
    /// The item at column `col` (even), whose first pair is table entry `f0`: a pair of
    /// adjacent elements (one word), or two pairs split `partner` apart (columns `col, col + 1`
    /// and `col + partner, col + partner + 1`, entries `f0, f0 + 1`), all four values read before
    /// either word is written.
    pub fn rotate(&self, r: &mut Regs, col: Expr, f0: Expr) -> Vec<Stmt> {
        let pack = |a: Expr, b: Expr| Expr::PackHalf(self.to, Box::new(a), Box::new(b));
        if self.pairing.adjacent() {
            let (a, b) = (self.rotated)(
                (self.elem)(col.clone()),
                (self.elem)(add(col.clone(), i64(1))),
                f0,
            );
            return vec![Stmt::Store(Space::Shared, (self.word)(col), pack(a, b))];
        }
        let other = add(col.clone(), i64(self.pairing.partner as i64));
        let out = [0, 1, 2, 3].map(|i| r.add(format!("rotated{i}"), Ty::F32));
        let mut body = Vec::new();
        for step in 0..2 {
            let (a, b) = (self.rotated)(
                (self.elem)(add(col.clone(), i64(step))),
                (self.elem)(add(other.clone(), i64(step))),
                add(f0.clone(), i64(step)),
            );
            body.push(Stmt::Set(out[step as usize], a));
            body.push(Stmt::Set(out[2 + step as usize], b));
        }
        for (at, [lo, hi]) in [(col, [out[0], out[1]]), (other, [out[2], out[3]])] {
            body.push(Stmt::Store(
                Space::Shared,
                (self.word)(at),
                pack(reg(lo), reg(hi)),
            ));
        }
        body
    }
}
