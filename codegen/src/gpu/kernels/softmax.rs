//! The online softmax in the kernels' half base-2 units (`score * log2(e) / 2`): the
//! exponential of a difference, the move to a new running max, the row's log-sum-exp, the
//! reciprocal an epilogue multiplies a row by, and the tensor-core kernels' step over a tile of
//! `mma` C fragments ([`online_softmax`]).

use super::build::Regs;
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Reg, Stmt, Ty, Un};
use crate::plan::KernelPlan;
use attn_dsl::modifier::{Expr as M, Var};

/// `2^(2x)` for a difference `x <= 0` of scores in the plan's half base-2 units
/// (`score * log2(e) / 2`): the softmax term of the SIMT kernels. Doubling the
/// difference, not the scores, keeps every finite f32 score finite; `-inf` stays `-inf` and
/// gives 0, NaN gives NaN.
pub(crate) fn exp2_twice(x: Expr) -> Expr {
    un(Un::Ex2Ftz, mul(x, f32(2.0)))
}

/// `2^(-2t)` for `normalize = sigmoid`'s weight of a score `t` in half base-2 units, with
/// `-t` clamped at 63 so it stays finite (NaN passes).
fn sigmoid_e(t: Expr) -> Expr {
    let x = un(Un::Neg, t);
    un(
        Un::Ex2,
        mul(
            select(bin(Bin::Gt, x.clone(), f32(63.0)), f32(63.0), x),
            f32(2.0),
        ),
    )
}

/// `normalize = sigmoid`'s weight of a score `t` in half base-2 units (the bias in the score):
/// `sigmoid(2 t ln 2) = 1 / (1 + 2^(-2t))`, exactly 0 for a masked key's `-inf`.
pub(crate) fn sigmoid_weight(t: Expr) -> Expr {
    select(
        bin(Bin::Eq, t.clone(), f32(f32::NEG_INFINITY)),
        f32(0.0),
        reciprocal(add(f32(1.0), sigmoid_e(t))),
    )
}

/// The derivative of [`sigmoid_weight`] per natural unit, `p (1 - p) = e p^2` with
/// `e = 2^(-2t)`, exact where `1 - p` would cancel; 0 for `-inf`.
pub(crate) fn sigmoid_slope(t: Expr) -> Expr {
    let p = sigmoid_weight(t.clone());
    mul(mul(sigmoid_e(t), p.clone()), p)
}

/// The online softmax's move to the running max `m_new` (half base-2 units): `m_use` (0 while
/// the max is still -inf, so that no NaN appears), the rescale factor
/// `alpha = 2^(2 (m - m_use))`, the new max, and the sum rescaled.
pub(crate) fn rescale_to(m_new: Expr, [m, l, m_use, alpha]: [Reg; 4]) -> [Stmt; 4] {
    [
        Stmt::Set(
            m_use,
            select(
                bin(Bin::Eq, m_new.clone(), f32(f32::NEG_INFINITY)),
                f32(0.0),
                m_new.clone(),
            ),
        ),
        Stmt::Set(alpha, exp2_twice(sub(reg(m), reg(m_use)))),
        Stmt::Set(m, m_new),
        Stmt::Set(l, mul(reg(l), reg(alpha))),
    ]
}

/// The natural log-sum-exp of a row whose running max `m` is in half base-2 units and whose sum
/// is `l`: `(m + log2(l) / 2) * 2 ln 2`, which stays finite for every finite score.
pub(crate) fn lse_of_half(m: Expr, l: Expr) -> Expr {
    mul(
        fma(un(Un::Lg2, l), f32(0.5), m),
        f32(2.0 * std::f32::consts::LN_2),
    )
}

/// `1 / x`, for an epilogue to multiply a row by: one division per row (LLVM merges the
/// repeats) rather than one per element, each of which is a full IEEE division on the GPU.
pub(crate) fn reciprocal(x: Expr) -> Expr {
    bin(Bin::Div, f32(1.0), x)
}

/// Whether the score program is the scaled score alone, so the scale can move into the
/// exponent (`2^(s c - m c)`, one fused multiply-add per score, `c` twice the plan's half-unit
/// scale) and S stays unscaled. `c` must be at most 1, so that `m c` cannot overflow for any
/// finite raw score `m`.
pub(crate) fn scale_folds(plan: &KernelPlan) -> bool {
    plan.program.score == M::Var(Var::Score) && plan.q_scale > 0.0 && plan.q_scale <= 0.5
}

/// `e` from lane `lane ^ mask` of the warp.
pub(crate) fn shfl(e: Expr, mask: u32) -> Expr {
    Expr::ShflXor(Box::new(e), mask)
}

/// The exponent's scale: twice the half-unit difference; folded, `2 c (s - m)` on raw scores.
pub(crate) fn scaled(plan: &KernelPlan, e: Expr) -> Expr {
    if scale_folds(plan) {
        mul(e, f32(2.0 * plan.q_scale as f32))
    } else {
        mul(e, f32(2.0))
    }
}

/// One tile's online softmax over the scores `s` (laid out as in [`TileScores`]): the row max
/// (this lane's elements, then its quad), the rescale of the running max `m`, sum `l` and the
/// accumulators `o` (`o[rb][vb]`, rows as in `s`; skipped when every row of the warp keeps its
/// maximum; `before_rescale` runs first), and `P = 2^(S - m)` in place of S. Under
/// `normalize = sigmoid`: `P = sigmoid(S)` and their sum into `l`, with no max and no rescale.
pub(crate) fn online_softmax(
    plan: &KernelPlan,
    r: &mut Regs,
    s: &[Vec<[Reg; 4]>],
    [m, l]: [&[[Reg; 2]]; 2],
    o: &[Vec<[Reg; 4]>],
    before_rescale: Vec<Stmt>,
) -> Vec<Stmt> {
    if plan.sigmoid() {
        return sigmoid_weights(plan, r, s, l, before_rescale);
    }
    let folded = scale_folds(plan);
    let exponent_scale = if folded {
        2.0 * plan.q_scale as f32
    } else {
        1.0
    };
    let (mt, m_use, neg_max, tile_sum) = (
        r.add("tile_max", Ty::F32),
        r.add("m_use", Ty::F32),
        r.add("neg_max", Ty::F32),
        r.add("tile_sum", Ty::F32),
    );
    let alphas: Vec<[Reg; 2]> = (0..s.len())
        .map(|rb| [0, 1].map(|h| r.add(format!("alpha{rb}_{h}"), Ty::F32)))
        .collect();
    let rescale = r.add("rescale", Ty::I32);
    let mut run = vec![Stmt::Set(rescale, Expr::Int(0, Ty::I32))];
    for rb in 0..s.len() {
        for h in 0..2 {
            let alpha = alphas[rb][h];
            run.push(Stmt::Set(mt, f32(f32::NEG_INFINITY)));
            for frag in &s[rb] {
                for x in [frag[2 * h], frag[2 * h + 1]] {
                    run.push(Stmt::Set(mt, bin(Bin::Max, reg(mt), reg(x))));
                }
            }
            for lane_mask in [1, 2] {
                run.push(Stmt::Set(
                    mt,
                    bin(Bin::Max, reg(mt), shfl(reg(mt), lane_mask)),
                ));
            }
            let m_new = bin(Bin::Max, reg(m[rb][h]), reg(mt));
            run.push(Stmt::Set(
                m_use,
                select(
                    bin(Bin::Eq, m_new.clone(), f32(f32::NEG_INFINITY)),
                    f32(0.0),
                    m_new.clone(),
                ),
            ));
            run.push(Stmt::Set(
                alpha,
                un(Un::Ex2Ftz, scaled(plan, sub(reg(m[rb][h]), reg(m_use)))),
            ));
            run.push(Stmt::Set(m[rb][h], m_new));
            run.push(Stmt::Set(
                rescale,
                bin(
                    Bin::Or,
                    reg(rescale),
                    cast(bin(Bin::Ne, reg(alpha), f32(1.0)), Ty::I32),
                ),
            ));
            run.push(Stmt::Set(neg_max, mul(reg(m_use), f32(-exponent_scale))));
            run.push(Stmt::Set(tile_sum, f32(0.0)));
            for frag in &s[rb] {
                for x in [frag[2 * h], frag[2 * h + 1]] {
                    let exponent = if folded {
                        fma(reg(x), f32(exponent_scale), reg(neg_max))
                    } else {
                        scaled(plan, add(reg(x), reg(neg_max)))
                    };
                    run.push(Stmt::Set(x, un(Un::Ex2Ftz, exponent)));
                    run.push(Stmt::Set(tile_sum, add(reg(tile_sum), reg(x))));
                }
            }
            // The running sum rescaled and the tile's added in one rounding.
            run.push(Stmt::Set(
                l[rb][h],
                fma(reg(l[rb][h]), reg(alpha), reg(tile_sum)),
            ));
        }
    }
    // The accumulators are rescaled only when some row of the warp has a new maximum: after
    // the first tiles a row's maximum rarely moves, and every alpha is then exactly 1 (the
    // multiply would change nothing). The test is warp-uniform, so the branch does not diverge.
    for lane_mask in [1, 2, 4, 8, 16] {
        run.push(Stmt::Set(
            rescale,
            bin(Bin::Or, reg(rescale), shfl(reg(rescale), lane_mask)),
        ));
    }
    // (The accumulators may be in flight until here: `before_rescale` waits for them.)
    run.extend(before_rescale);
    let mut rescale_o = Vec::new();
    for rb in 0..s.len() {
        for h in 0..2 {
            for frag in &o[rb] {
                for x in [frag[2 * h], frag[2 * h + 1]] {
                    rescale_o.push(Stmt::Set(x, mul(reg(x), reg(alphas[rb][h]))));
                }
            }
        }
    }
    run.push(Stmt::If(
        bin(Bin::Ne, reg(rescale), Expr::Int(0, Ty::I32)),
        rescale_o,
        vec![],
    ));
    run
}

/// [`online_softmax`] under `normalize = sigmoid`: each score `P = sigmoid(S)` in place (S in
/// half base-2 units, or raw and unscaled where the scale folds) and the tile's sum added to
/// `l`; the accumulators keep their scale (`before_rescale` still runs, for what it waits on).
fn sigmoid_weights(
    plan: &KernelPlan,
    r: &mut Regs,
    s: &[Vec<[Reg; 4]>],
    l: &[[Reg; 2]],
    before_rescale: Vec<Stmt>,
) -> Vec<Stmt> {
    let tile_sum = r.add("tile_sum", Ty::F32);
    let half_units = |x: Reg| match scale_folds(plan) {
        true => mul(reg(x), f32(plan.q_scale as f32)),
        false => reg(x),
    };
    let mut run = Vec::new();
    for rb in 0..s.len() {
        for h in 0..2 {
            run.push(Stmt::Set(tile_sum, f32(0.0)));
            for frag in &s[rb] {
                for x in [frag[2 * h], frag[2 * h + 1]] {
                    run.push(Stmt::Set(x, sigmoid_weight(half_units(x))));
                    run.push(Stmt::Set(tile_sum, add(reg(tile_sum), reg(x))));
                }
            }
            run.push(Stmt::Set(l[rb][h], add(reg(l[rb][h]), reg(tile_sum))));
        }
    }
    run.extend(before_rescale);
    run
}
