//! The partitions of split-KV attention merged by their log-sum-exp.

use super::{exp, kernel, p, per_thread};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Space, Stmt, Ty, Un};
use crate::gpu::kernels::Regs;
use crate::gpu::launch::LaunchRecord;

crate::gpu::launch::launch_record! {
    /// The partitions of split-KV attention merged by their log-sum-exp: one thread per output
    /// value.
    MergeArgs {
        /// `[partial rows, width]` f32 partial outputs: normalized, or (with `sums`) sums of
        /// independently weighted values.
        parts: Address,
        /// `[partial rows]` f32 log-sum-exp of each partial row (`-inf`: no kept key).
        lse: Address,
        /// `[rows, slots]` i32: the partial rows of each output row, `-1` past its last.
        map: Address,
        /// `[rows, width]` f32 merged outputs.
        out: Address,
        /// `[rows]` f32 merged log-sum-exp (`-inf` for a row with no kept key, NaN for a NaN one).
        out_lse: Address,
        /// Output rows.
        rows: Scalar,
        /// Partial rows per output row, at most.
        slots: Scalar,
        /// Values per row.
        width: Scalar,
        /// 1: the parts add (`normalize = sigmoid`); 0: they merge as softmax parts.
        sums: Scalar,
    }
}

/// Merges partial attention rows: `out = sum_p e^(l_p - m) o_p / sum_p e^(l_p - m)` with `m`
/// the largest `l_p`, and `lse = m + ln(sum_p e^(l_p - m))`; a row whose parts kept no key is 0
/// with lse `-inf`, and a NaN or +inf part (a score past `f32::MAX`) makes the row NaN (as the
/// host merge does). With `sums`, `out = sum_p o_p` (the lse as before).
pub fn merge_partitions() -> Kernel {
    type A = MergeArgs;
    let mut r = Regs { list: Vec::new() };
    let (e, out_row, col, slot, part, m, l, total, acc, nan) = (
        r.add("e", Ty::I64),
        r.add("row", Ty::I64),
        r.add("col", Ty::I64),
        r.add("slot", Ty::I64),
        r.add("part", Ty::I64),
        r.add("m", Ty::F32),
        r.add("l", Ty::F32),
        r.add("total", Ty::F32),
        r.add("acc", Ty::F32),
        r.add("nan", Ty::Pred),
    );
    let width = p::<A>("width");
    let part_of = add(
        p::<A>("map"),
        mul(add(mul(reg(out_row), p::<A>("slots")), reg(slot)), i64(4)),
    );
    let lse_of = |part: Expr| {
        load(
            Space::Global,
            Ty::F32,
            add(p::<A>("lse"), mul(part, i64(4))),
        )
    };
    // Visits the row's parts: `body` runs with `part` and `l` set, for parts that exist.
    let each = |body: Vec<Stmt>| Stmt::For {
        reg: slot,
        start: i64(0),
        end: p::<A>("slots"),
        step: 1,
        body: vec![
            Stmt::Set(
                part,
                cast(load(Space::Global, Ty::I32, part_of.clone()), Ty::I64),
            ),
            Stmt::If(
                bin(Bin::Ge, reg(part), i64(0)),
                [vec![Stmt::Set(l, lse_of(reg(part)))], body].concat(),
                vec![],
            ),
        ],
    };
    let value = load(
        Space::Global,
        Ty::F32,
        add(
            p::<A>("parts"),
            mul(add(mul(reg(part), width.clone()), reg(col)), i64(4)),
        ),
    );
    let weight = exp(sub(reg(l), reg(m)));
    let sums = bin(Bin::Ne, p::<A>("sums"), i64(0));
    let body = per_thread(
        e,
        1,
        mul(p::<A>("rows"), width.clone()),
        vec![
            Stmt::Set(out_row, bin(Bin::Div, reg(e), width.clone())),
            Stmt::Set(col, bin(Bin::Rem, reg(e), width)),
            Stmt::Set(m, f32(f32::NEG_INFINITY)),
            Stmt::Set(nan, Expr::Pred(false)),
            // NaN != NaN: a NaN lse marks the row, and so does +inf (a score past f32::MAX).
            each(vec![
                Stmt::Set(m, bin(Bin::Max, reg(m), reg(l))),
                Stmt::Set(nan, bin(Bin::Or, reg(nan), bin(Bin::Ne, reg(l), reg(l)))),
                Stmt::Set(
                    nan,
                    bin(Bin::Or, reg(nan), bin(Bin::Eq, reg(l), f32(f32::INFINITY))),
                ),
            ]),
            Stmt::Set(total, f32(0.0)),
            Stmt::Set(acc, f32(0.0)),
            Stmt::If(
                bin(Bin::Gt, reg(m), f32(f32::NEG_INFINITY)),
                vec![each(vec![
                    Stmt::Set(total, add(reg(total), weight.clone())),
                    Stmt::Set(
                        acc,
                        fma(select(sums.clone(), f32(1.0), weight), value, reg(acc)),
                    ),
                ])],
                vec![],
            ),
            Stmt::Store(
                Space::Global,
                add(p::<A>("out"), mul(reg(e), i64(4))),
                select(
                    reg(nan),
                    f32(f32::NAN),
                    select(
                        sums,
                        reg(acc),
                        select(
                            bin(Bin::Gt, reg(total), f32(0.0)),
                            bin(Bin::Div, reg(acc), reg(total)),
                            f32(0.0),
                        ),
                    ),
                ),
            ),
            // The row's first column writes its lse: m + ln(total).
            Stmt::If(
                bin(Bin::Eq, reg(col), i64(0)),
                vec![Stmt::Store(
                    Space::Global,
                    add(p::<A>("out_lse"), mul(reg(out_row), i64(4))),
                    select(
                        reg(nan),
                        f32(f32::NAN),
                        select(
                            bin(Bin::Gt, reg(total), f32(0.0)),
                            add(
                                reg(m),
                                mul(un(Un::Lg2, reg(total)), f32(std::f32::consts::LN_2)),
                            ),
                            f32(f32::NEG_INFINITY),
                        ),
                    ),
                )],
                vec![],
            ),
        ],
    );
    kernel("merge_partitions", A::params(), r, 0, body)
}
