//! Rows moved as a decoder needs them: embedding lookups, the swap of two outer axes (projections
//! to heads and back), column ranges (MLA), and rows gathered for experts and added back.

use super::{kernel, p, per_thread, row, strided};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Half, Kernel, Space, Stmt, Ty};
use crate::gpu::kernels::Regs;
use crate::gpu::launch::LaunchRecord;

crate::gpu::launch::launch_record! {
    /// An embedding lookup: one CTA per token.
    EmbedArgs {
        /// `[tokens]` i32 token ids (checked against the vocabulary by the host).
        tokens: Address,
        /// `[vocab, width]` rows of the table's type.
        table: Address,
        /// `[tokens, width]` f32 outputs.
        out: Address,
    }
}

/// Rows of `width` values looked up by token; `table` holds f32 rows, or 16-bit ones.
pub fn embed(width: u32, table: Option<Half>) -> Kernel {
    type A = EmbedArgs;
    let mut r = Regs { list: Vec::new() };
    let (i, token) = (r.add("i", Ty::I64), r.add("token", Ty::I64));
    let size = if table.is_some() { 2 } else { 4 };
    let src = add(
        add(
            p::<A>("table"),
            mul(reg(token), i64(size * i64::from(width))),
        ),
        mul(reg(i), i64(size)),
    );
    let value = match table {
        Some(half) => Expr::LoadHalf(Space::Global, half, Box::new(src)),
        None => load(Space::Global, Ty::F32, src),
    };
    let body = vec![
        Stmt::Set(
            token,
            cast(
                load(
                    Space::Global,
                    Ty::I32,
                    add(p::<A>("tokens"), mul(row(), i64(4))),
                ),
                Ty::I64,
            ),
        ),
        strided(
            i,
            width,
            vec![Stmt::Store(
                Space::Global,
                add(
                    add(p::<A>("out"), mul(row(), i64(4 * i64::from(width)))),
                    mul(reg(i), i64(4)),
                ),
                value,
            )],
        ),
    ];
    kernel("embed", A::params(), r, 0, body)
}

crate::gpu::launch::launch_record! {
    /// A swap of the two outer axes of `[a, b, width]` rows: one thread per output element (or
    /// pair of elements, for 16-bit outputs).
    SwapArgs {
        /// `[a, b, width]` f32 inputs.
        x: Address,
        /// `[b, a, width]` outputs.
        out: Address,
        /// The outer axis of the input.
        a: Scalar,
        /// The middle axis of the input.
        b: Scalar,
        /// Values per row (even for 16-bit outputs).
        width: Scalar,
    }
}

/// `[a, b, width]` f32 rows to `[b, a, width]`, as f32 or packed into a 16-bit format (rows of
/// q, k and v from projections `[tokens, heads, dim]` to the attention kernels' `[heads, tokens,
/// dim]` and back).
pub fn swap_outer(out: Option<Half>) -> Kernel {
    type A = SwapArgs;
    let mut r = Regs { list: Vec::new() };
    let (e, col, ib, ia, src, dst) = (
        r.add("e", Ty::I64),
        r.add("col", Ty::I64),
        r.add("ib", Ty::I64),
        r.add("ia", Ty::I64),
        r.add("src", Ty::I64),
        r.add("dst", Ty::I64),
    );
    // Each thread moves `per` values: one f32, or two packed 16-bit ones.
    let per = if out.is_some() { 2 } else { 1 };
    let total = mul(mul(p::<A>("a"), p::<A>("b")), p::<A>("width"));
    let x_at = |offset: i64| {
        load(
            Space::Global,
            Ty::F32,
            add(p::<A>("x"), mul(add(reg(src), i64(offset)), i64(4))),
        )
    };
    let store = match out {
        None => Stmt::Store(
            Space::Global,
            add(p::<A>("out"), mul(reg(dst), i64(4))),
            x_at(0),
        ),
        Some(half) => Stmt::Store(
            Space::Global,
            add(p::<A>("out"), mul(reg(dst), i64(2))),
            Expr::PackHalf(half, Box::new(x_at(0)), Box::new(x_at(1))),
        ),
    };
    let body = per_thread(
        e,
        per,
        total,
        vec![
            // e = (ia b + ib) width + col in the input.
            Stmt::Set(col, bin(Bin::Rem, reg(e), p::<A>("width"))),
            Stmt::Set(
                ib,
                bin(
                    Bin::Rem,
                    bin(Bin::Div, reg(e), p::<A>("width")),
                    p::<A>("b"),
                ),
            ),
            Stmt::Set(
                ia,
                bin(
                    Bin::Div,
                    bin(Bin::Div, reg(e), p::<A>("width")),
                    p::<A>("b"),
                ),
            ),
            Stmt::Set(src, reg(e)),
            Stmt::Set(
                dst,
                add(
                    mul(add(mul(reg(ib), p::<A>("a")), reg(ia)), p::<A>("width")),
                    reg(col),
                ),
            ),
            store,
        ],
    );
    let name = match out {
        None => "swap_outer_f32",
        Some(Half::Bf16) => "swap_outer_bf16",
        Some(Half::F16) => "swap_outer_f16",
    };
    kernel(name, A::params(), r, 0, body)
}

crate::gpu::launch::launch_record! {
    /// Rows gathered by index: one thread per value.
    GatherArgs {
        /// `[.., width]` f32 rows.
        x: Address,
        /// `[rows]` i32 indices of the rows to take.
        index: Address,
        /// `[rows, width]` f32 outputs.
        out: Address,
        /// Rows gathered.
        rows: Scalar,
        /// Values per row.
        width: Scalar,
    }
}

/// `out[r] = x[index[r]]` for rows of `width` values.
pub fn gather_rows() -> Kernel {
    type A = GatherArgs;
    let mut r = Regs { list: Vec::new() };
    let (e, src) = (r.add("e", Ty::I64), r.add("src", Ty::I64));
    let width = p::<A>("width");
    let body = per_thread(
        e,
        1,
        mul(p::<A>("rows"), width.clone()),
        vec![
            Stmt::Set(
                src,
                cast(
                    load(
                        Space::Global,
                        Ty::I32,
                        add(
                            p::<A>("index"),
                            mul(bin(Bin::Div, reg(e), width.clone()), i64(4)),
                        ),
                    ),
                    Ty::I64,
                ),
            ),
            Stmt::Store(
                Space::Global,
                add(p::<A>("out"), mul(reg(e), i64(4))),
                load(
                    Space::Global,
                    Ty::F32,
                    add(
                        p::<A>("x"),
                        mul(
                            add(mul(reg(src), width.clone()), bin(Bin::Rem, reg(e), width)),
                            i64(4),
                        ),
                    ),
                ),
            ),
        ],
    );
    kernel("gather_rows", A::params(), r, 0, body)
}

crate::gpu::launch::launch_record! {
    /// A column range of `[a, b, in_width]` f32 rows copied into `[b, a, out_width]` rows at a
    /// column offset (MLA's queries and keys split and joined): one thread per copied value.
    ColumnsArgs {
        /// `[a, b, in_width]` f32 inputs.
        x: Address,
        /// `[b, a, out_width]` f32 outputs (the other columns untouched).
        out: Address,
        /// Outer axis of `x` (1: rows keep their order).
        a: Scalar,
        /// Middle axis of `x`.
        b: Scalar,
        /// Values per input row.
        in_width: Scalar,
        /// First input column copied.
        in_first: Scalar,
        /// Values per output row.
        out_width: Scalar,
        /// Output column of the first copied value.
        out_first: Scalar,
        /// Columns copied per row.
        width: Scalar,
    }
}

/// `out[j, i, out_first + c] = x[i, j, in_first + c]` for `c < width`: columns of rows copied
/// with the two outer axes swapped (`a = 1`: in order).
pub fn columns() -> Kernel {
    type A = ColumnsArgs;
    let mut r = Regs { list: Vec::new() };
    let (e, row, c, i, j) = (
        r.add("e", Ty::I64),
        r.add("row", Ty::I64),
        r.add("c", Ty::I64),
        r.add("i", Ty::I64),
        r.add("j", Ty::I64),
    );
    let width = p::<A>("width");
    let f32_at = |base: Expr, index: Expr| add(base, mul(index, i64(4)));
    let src = add(
        mul(add(mul(reg(i), p::<A>("b")), reg(j)), p::<A>("in_width")),
        add(p::<A>("in_first"), reg(c)),
    );
    let dst = add(
        mul(add(mul(reg(j), p::<A>("a")), reg(i)), p::<A>("out_width")),
        add(p::<A>("out_first"), reg(c)),
    );
    let body = per_thread(
        e,
        1,
        mul(mul(p::<A>("a"), p::<A>("b")), width.clone()),
        vec![
            // Input row `row = i b + j`, column `c`.
            Stmt::Set(row, bin(Bin::Div, reg(e), width.clone())),
            Stmt::Set(c, bin(Bin::Rem, reg(e), width)),
            Stmt::Set(i, bin(Bin::Div, reg(row), p::<A>("b"))),
            Stmt::Set(j, bin(Bin::Rem, reg(row), p::<A>("b"))),
            Stmt::Store(
                Space::Global,
                f32_at(p::<A>("out"), dst),
                load(Space::Global, Ty::F32, f32_at(p::<A>("x"), src)),
            ),
        ],
    );
    kernel("columns", A::params(), r, 0, body)
}

crate::gpu::launch::launch_record! {
    /// Weighted rows added back where they were gathered from (an expert's outputs into the
    /// mixture): one thread per value.
    ScatterArgs {
        /// `[.., width]` f32 rows added to.
        out: Address,
        /// `[rows, width]` f32 rows to add.
        x: Address,
        /// `[rows]` i32: the row of `out` each row of `x` adds to (distinct within a launch).
        index: Address,
        /// `[rows]` f32 weights.
        weights: Address,
        /// Rows added.
        rows: Scalar,
        /// Values per row.
        width: Scalar,
    }
}

/// `out[index[r]] += weights[r] x[r]` for rows of `width` values (the indices of one launch
/// distinct, so no two threads write one value).
pub fn scatter_add_rows() -> Kernel {
    type A = ScatterArgs;
    let mut r = Regs { list: Vec::new() };
    let (e, row, dst) = (
        r.add("e", Ty::I64),
        r.add("row", Ty::I64),
        r.add("dst", Ty::I64),
    );
    let width = p::<A>("width");
    let f32_at = |base: Expr, index: Expr| add(base, mul(index, i64(4)));
    let body = per_thread(
        e,
        1,
        mul(p::<A>("rows"), width.clone()),
        vec![
            Stmt::Set(row, bin(Bin::Div, reg(e), width.clone())),
            Stmt::Set(
                dst,
                f32_at(
                    p::<A>("out"),
                    add(
                        mul(
                            cast(
                                load(Space::Global, Ty::I32, f32_at(p::<A>("index"), reg(row))),
                                Ty::I64,
                            ),
                            width.clone(),
                        ),
                        bin(Bin::Rem, reg(e), width),
                    ),
                ),
            ),
            Stmt::Store(
                Space::Global,
                reg(dst),
                fma(
                    load(Space::Global, Ty::F32, f32_at(p::<A>("weights"), reg(row))),
                    load(Space::Global, Ty::F32, f32_at(p::<A>("x"), reg(e))),
                    load(Space::Global, Ty::F32, reg(dst)),
                ),
            ),
        ],
    );
    kernel("scatter_add_rows", A::params(), r, 0, body)
}
