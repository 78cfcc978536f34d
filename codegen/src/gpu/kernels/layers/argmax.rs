//! The row argmax that greedy decoding samples with: one CTA per row.

use super::{WARPS, kernel, p, row, strided, tid};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Space, Special, Stmt, Ty};
use crate::gpu::kernels::Regs;
use crate::gpu::launch::LaunchRecord;

crate::gpu::launch::launch_record! {
    /// A row argmax: one CTA per row.
    ArgmaxArgs {
        /// `[rows, width]` f32 values.
        x: Address,
        /// `[rows]` i32 outputs: the index of each row's largest value (the first of equals).
        out: Address,
    }
}

/// What [`argmax`] gives for a row with no value above `-inf` (all NaN, say): no index.
pub const NO_CHOICE: u32 = i32::MAX as u32;

/// The index of each row's largest value (the first of equal ones; NaN is never chosen over a
/// number, and a row with no value above `-inf`, NaN throughout, gives [`NO_CHOICE`]), for
/// rows of `width` values.
pub fn argmax(width: u32) -> Kernel {
    type A = ArgmaxArgs;
    let mut r = Regs { list: Vec::new() };
    let (i, best, at, v, ov, oi, w) = (
        r.add("i", Ty::I64),
        r.add("best", Ty::F32),
        r.add("at", Ty::I32),
        r.add("v", Ty::F32),
        r.add("other_v", Ty::F32),
        r.add("other_i", Ty::I32),
        r.add("w", Ty::I64),
    );
    // (v, index) beats (best, at) when larger, or equal at a lower index.
    let better = |v: Expr, idx: Expr| {
        bin(
            Bin::Or,
            bin(Bin::Gt, v.clone(), reg(best)),
            bin(
                Bin::And,
                bin(Bin::Eq, v, reg(best)),
                bin(Bin::Lt, idx, reg(at)),
            ),
        )
    };
    let take = |v: Expr, idx: Expr| {
        vec![Stmt::If(
            better(v.clone(), idx.clone()),
            vec![Stmt::Set(best, v), Stmt::Set(at, idx)],
            vec![],
        )]
    };
    let mut body = vec![
        Stmt::Set(best, f32(f32::NEG_INFINITY)),
        Stmt::Set(at, Expr::Int(i64::from(i32::MAX), Ty::I32)),
        strided(
            i,
            width,
            [
                vec![Stmt::Set(
                    v,
                    load(
                        Space::Global,
                        Ty::F32,
                        add(
                            add(p::<A>("x"), mul(row(), i64(4 * i64::from(width)))),
                            mul(reg(i), i64(4)),
                        ),
                    ),
                )],
                take(reg(v), cast(reg(i), Ty::I32)),
            ]
            .concat(),
        ),
    ];
    for m in [16, 8, 4, 2, 1] {
        body.push(Stmt::Set(ov, Expr::ShflXor(Box::new(reg(best)), m)));
        body.push(Stmt::Set(oi, Expr::ShflXor(Box::new(reg(at)), m)));
        body.extend(take(reg(ov), reg(oi)));
    }
    // One (value, index) pair per warp in shared memory, then thread 0 picks among them.
    let warp = bin(Bin::Div, tid(), i64(32));
    body.push(Stmt::If(
        bin(Bin::Eq, cast(Expr::Special(Special::Lane), Ty::I64), i64(0)),
        vec![
            Stmt::Store(Space::Shared, mul(warp.clone(), i64(8)), reg(best)),
            Stmt::Store(Space::Shared, add(mul(warp, i64(8)), i64(4)), reg(at)),
        ],
        vec![],
    ));
    body.push(Stmt::Barrier);
    let pick = Stmt::For {
        reg: w,
        start: i64(0),
        end: i64(WARPS),
        step: 1,
        body: [
            vec![
                Stmt::Set(ov, load(Space::Shared, Ty::F32, mul(reg(w), i64(8)))),
                Stmt::Set(
                    oi,
                    load(Space::Shared, Ty::I32, add(mul(reg(w), i64(8)), i64(4))),
                ),
            ],
            take(reg(ov), reg(oi)),
        ]
        .concat(),
    };
    body.push(Stmt::If(
        bin(Bin::Eq, tid(), i64(0)),
        vec![
            pick,
            Stmt::Store(
                Space::Global,
                add(p::<A>("out"), mul(row(), i64(4))),
                reg(at),
            ),
        ],
        vec![],
    ));
    kernel("argmax", A::params(), r, 8 * WARPS as u32, body)
}
