//! The online softmax in the kernels' half base-2 units (`score * log2(e) / 2`): the
//! exponential of a difference, the move to a new running max, the row's log-sum-exp, and the
//! reciprocal an epilogue multiplies a row by.

use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Reg, Stmt, Un};

/// `2^(2x)` for a difference `x <= 0` of scores in the plan's half base-2 units
/// (`score * log2(e) / 2`): the softmax term of the SIMT kernels. Doubling the
/// difference, not the scores, keeps every finite f32 score finite; `-inf` stays `-inf` and
/// gives 0, NaN gives NaN.
pub(crate) fn exp2_twice(x: Expr) -> Expr {
    un(Un::Ex2Ftz, mul(x, f32(2.0)))
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
