//! The tensor-core kernels' epilogue: each row's sum reduced over its lane quad, `out = O / l`
//! stored from the `mma` accumulators, and the row's log-sum-exp (under `normalize = sigmoid`,
//! `out = O` and `lse = ln l`).

use super::build::param;
use super::softmax::{lse_of_half, reciprocal, scale_folds, scaled, shfl};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Reg, Space, Stmt, Un};
use crate::plan::KernelPlan;

/// The epilogue: the quad's sums; `out = O / l` (accumulators `o` as in [`online_softmax`]);
/// lse from lane `q == 0`; rows past Sq are not stored.
pub(crate) fn epilogue(
    plan: &KernelPlan,
    o: &[Vec<[Reg; 4]>],
    [m, l]: [&[[Reg; 2]]; 2],
    q: Reg,
    [batch, head]: [Reg; 2],
    row_of: &dyn Fn(usize, usize) -> Expr,
) -> Vec<Stmt> {
    let (hq, dv) = (plan.shape.heads as i64, plan.shape.v_dim as usize);
    let folded = scale_folds(plan);
    let mut body = Vec::new();
    for rb in 0..o.len() {
        for h in 0..2 {
            let l = l[rb][h];
            for lane_mask in [1, 2] {
                body.push(Stmt::Set(l, add(reg(l), shfl(reg(l), lane_mask))));
            }
            let out_row = add(
                mul(add(mul(reg(batch), i64(hq)), reg(head)), param("sq")),
                row_of(rb, h),
            );
            // The sum is 0 only when no key was kept; a NaN sum (a NaN score) carries NaN through.
            let nonempty = bin(Bin::Ne, reg(l), f32(0.0));
            let mut store = Vec::new();
            for (vb, frag) in o[rb].iter().enumerate() {
                for j in 0..2 {
                    let col = add(mul(reg(q), i64(2)), i64((8 * vb + j) as i64));
                    let addr = add(
                        param("out"),
                        mul(add(mul(out_row.clone(), i64(dv as i64)), col), i64(4)),
                    );
                    // Sigmoid weights are not normalized: out is the accumulator.
                    let value = match plan.sigmoid() {
                        true => reg(frag[2 * h + j]),
                        false => select(
                            nonempty.clone(),
                            mul(reg(frag[2 * h + j]), reciprocal(reg(l))),
                            f32(0.0),
                        ),
                    };
                    store.push(Stmt::Store(Space::Global, addr, value));
                }
            }
            let lse = if plan.sigmoid() {
                mul(un(Un::Lg2, reg(l)), f32(std::f32::consts::LN_2))
            } else if folded {
                // c m <= m: finite for every finite raw score.
                mul(
                    add(scaled(plan, reg(m[rb][h])), un(Un::Lg2, reg(l))),
                    f32(std::f32::consts::LN_2),
                )
            } else {
                lse_of_half(reg(m[rb][h]), reg(l))
            };
            store.push(Stmt::If(
                bin(Bin::Eq, reg(q), i64(0)),
                vec![Stmt::Store(
                    Space::Global,
                    at(param("lse"), out_row, 4),
                    select(nonempty, lse, f32(f32::NEG_INFINITY)),
                )],
                vec![],
            ));
            body.push(Stmt::If(
                bin(Bin::Lt, row_of(rb, h), param("sq")),
                store,
                vec![],
            ));
        }
    }
    body
}
