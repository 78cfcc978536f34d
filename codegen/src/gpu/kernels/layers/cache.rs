//! New tokens' keys and values appended to a head-major cache, rotated by RoPE first for keys.

use super::{kernel, p, per_thread};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Half, Kernel, Space, Stmt, Ty};
use crate::gpu::kernels::Regs;
use crate::gpu::launch::LaunchRecord;

/// How keys are rotated as they enter a cache: `dim` dimensions from `first_dim`, paired as
/// `layout` says; cos and sin rows of `dim / 2` per position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendRope {
    /// Rotated dimensions.
    pub dim: u32,
    /// The first rotated dimension of a row.
    pub first_dim: u32,
    /// How dimensions pair.
    pub layout: attn_dsl::RopeLayout,
}

crate::gpu::launch::launch_record! {
    /// New tokens' rows appended to a head-major cache `[kv_heads, capacity, width]`: one
    /// thread per stored value (or pair, for 16-bit caches).
    AppendArgs {
        /// `[tokens, kv_heads, width]` f32 rows (a projection's output).
        rows: Address,
        /// The cache's first byte.
        cache: Address,
        /// New tokens.
        tokens: Scalar,
        /// Kv heads.
        kv_heads: Scalar,
        /// Tokens the cache holds per head.
        capacity: Scalar,
        /// The position (and cache slot) of the first new token.
        pos0: Scalar,
        /// RoPE cosines: row `t` for the new token `t` (unused without RoPE).
        rope_cos: Address,
        /// RoPE sines, as `rope_cos`.
        rope_sin: Address,
    }
}

/// Appends rows of `width` values to a cache of `dtype` (`None`: f32), rotating them first when
/// `rope` says so (keys), as the host caches store them.
pub fn cache_append(width: u32, dtype: Option<Half>, rope: Option<AppendRope>) -> Kernel {
    type A = AppendArgs;
    let mut r = Regs { list: Vec::new() };
    let (e, col, tok, head) = (
        r.add("e", Ty::I64),
        r.add("col", Ty::I64),
        r.add("tok", Ty::I64),
        r.add("head", Ty::I64),
    );
    let w = i64::from(width);
    let per = if dtype.is_some() { 2 } else { 1 };
    let total = mul(mul(p::<A>("tokens"), p::<A>("kv_heads")), i64(w));
    let row_base = add(
        p::<A>("rows"),
        mul(
            add(mul(reg(tok), p::<A>("kv_heads")), reg(head)),
            i64(4 * w),
        ),
    );
    let x = |c: Expr| {
        load(
            Space::Global,
            Ty::F32,
            add(row_base.clone(), mul(c, i64(4))),
        )
    };
    // The stored value of column `c` (an I64 expression): rotated inside the RoPE columns.
    let value = |c: Expr| -> Expr {
        let Some(rope) = rope else { return x(c) };
        let (dim, base) = (i64::from(rope.dim), i64::from(rope.first_dim));
        let half = dim / 2;
        let rel = sub(c.clone(), i64(base));
        let inside = bin(
            Bin::And,
            bin(Bin::Ge, rel.clone(), i64(0)),
            bin(Bin::Lt, rel.clone(), i64(dim)),
        );
        // Column `rel` of the span: whether it is its pair's first element, the pair (its
        // table entry), and its partner's column.
        let pairing = rope.layout.pairing(rope.dim);
        let is_first = || {
            if pairing.stride == 1 {
                bin(Bin::Lt, rel.clone(), i64(pairing.half as i64))
            } else {
                let stride = i64(pairing.stride as i64);
                bin(Bin::Eq, bin(Bin::Rem, rel.clone(), stride), i64(0))
            }
        };
        let j = if pairing.stride == 1 {
            bin(Bin::Rem, rel.clone(), i64(pairing.half as i64))
        } else {
            bin(Bin::Div, rel.clone(), i64(pairing.stride as i64))
        };
        let to_partner = i64(pairing.partner as i64);
        let (first, partner) = (
            is_first(),
            select(
                is_first(),
                add(c.clone(), to_partner.clone()),
                sub(c.clone(), to_partner),
            ),
        );
        // Outside the rotated columns the table index is clamped to 0 (and unused).
        let entry = mul(
            add(mul(reg(tok), i64(half)), select(inside.clone(), j, i64(0))),
            i64(4),
        );
        let cos = load(
            Space::Global,
            Ty::F32,
            add(p::<A>("rope_cos"), entry.clone()),
        );
        let sin = load(Space::Global, Ty::F32, add(p::<A>("rope_sin"), entry));
        let partner = select(inside.clone(), partner, c.clone());
        let (xe, xp) = (x(c), x(partner));
        // (a, b) -> (a cos - b sin, b cos + a sin), the host caches' order of operations.
        let rotated = select(
            first,
            sub(mul(xe.clone(), cos.clone()), mul(xp.clone(), sin.clone())),
            add(mul(xe.clone(), cos), mul(xp, sin)),
        );
        select(inside, rotated, xe)
    };
    let slot = add(
        mul(reg(head), p::<A>("capacity")),
        add(p::<A>("pos0"), reg(tok)),
    );
    let dst = |size: i64| {
        add(
            p::<A>("cache"),
            mul(add(mul(slot.clone(), i64(w)), reg(col)), i64(size)),
        )
    };
    let store = match dtype {
        None => Stmt::Store(Space::Global, dst(4), value(reg(col))),
        Some(half) => Stmt::Store(
            Space::Global,
            dst(2),
            Expr::PackHalf(
                half,
                Box::new(value(reg(col))),
                Box::new(value(add(reg(col), i64(1)))),
            ),
        ),
    };
    let body = per_thread(
        e,
        per,
        total,
        vec![
            // e = (tok kv_heads + head) width + col.
            Stmt::Set(col, bin(Bin::Rem, reg(e), i64(w))),
            Stmt::Set(
                head,
                bin(Bin::Rem, bin(Bin::Div, reg(e), i64(w)), p::<A>("kv_heads")),
            ),
            Stmt::Set(
                tok,
                bin(Bin::Div, bin(Bin::Div, reg(e), i64(w)), p::<A>("kv_heads")),
            ),
            store,
        ],
    );
    kernel("cache_append", A::params(), r, 0, body)
}
