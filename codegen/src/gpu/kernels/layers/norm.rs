//! Row norms (RMSNorm, LayerNorm): one CTA per row, statistics in f32.

use super::{WARPS, cta_sum, kernel, p, row, strided};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Reg, Space, Stmt, Ty, Un};
use crate::gpu::kernels::Regs;
use crate::gpu::launch::LaunchRecord;

/// A row norm.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowNorm {
    /// `x / sqrt(mean(x^2) + eps) * w`.
    Rms,
    /// `(x - mean) / sqrt(var + eps) * w + b`.
    Layer,
}

crate::gpu::launch::launch_record! {
    /// A norm launch: one CTA per row.
    NormArgs {
        /// `[rows, width]` f32 inputs.
        x: Address,
        /// `[width]` f32 weights.
        weight: Address,
        /// `[width]` f32 biases (LayerNorm), else unused.
        bias: Address,
        /// `[rows, width]` f32 outputs.
        out: Address,
    }
}

/// The norm of rows of `width` values with epsilon `eps` (statistics in f32, two passes for
/// LayerNorm's variance), `bias` added when `with_bias`. The weights (and biases) hold
/// `weight_rows` rows of `width` that repeat down the rows: row `r` takes weight row
/// `r % weight_rows` (1: one row for all; a head count: cohere's per-head q/k norms).
pub fn norm(kind: RowNorm, width: u32, eps: f32, with_bias: bool, weight_rows: u32) -> Kernel {
    type A = NormArgs;
    let mut r = Regs { list: Vec::new() };
    let (i, acc, mean, inv, v) = (
        r.add("i", Ty::I64),
        r.add("acc", Ty::F32),
        r.add("mean", Ty::F32),
        r.add("inv", Ty::F32),
        r.add("v", Ty::F32),
    );
    let at = |base: Expr, i: Reg| add(base, mul(reg(i), i64(4)));
    let x_at = |i: Reg| {
        load(
            Space::Global,
            Ty::F32,
            at(add(p::<A>("x"), mul(row(), i64(4 * i64::from(width)))), i),
        )
    };
    let n = f32(width as f32);
    let mut body = vec![Stmt::Set(mean, f32(0.0))];
    if kind == RowNorm::Layer {
        body.push(Stmt::Set(acc, f32(0.0)));
        body.push(strided(
            i,
            width,
            vec![Stmt::Set(acc, add(reg(acc), x_at(i)))],
        ));
        body.extend(cta_sum(acc, 0));
        body.push(Stmt::Set(mean, bin(Bin::Div, reg(acc), n.clone())));
    }
    body.push(Stmt::Set(acc, f32(0.0)));
    body.push(strided(
        i,
        width,
        vec![
            Stmt::Set(v, sub(x_at(i), reg(mean))),
            Stmt::Set(acc, fma(reg(v), reg(v), reg(acc))),
        ],
    ));
    body.extend(cta_sum(acc, 0));
    body.push(Stmt::Set(
        inv,
        bin(
            Bin::Div,
            f32(1.0),
            un(Un::Sqrt, add(bin(Bin::Div, reg(acc), n), f32(eps))),
        ),
    ));
    // The row's weights: the one row, or row `r % weight_rows`.
    let w_at = |base: Expr| match weight_rows {
        1 => at(base, i),
        n => at(
            add(
                base,
                mul(
                    bin(Bin::Rem, row(), i64(i64::from(n))),
                    i64(4 * i64::from(width)),
                ),
            ),
            i,
        ),
    };
    let weighted = mul(
        mul(sub(x_at(i), reg(mean)), reg(inv)),
        load(Space::Global, Ty::F32, w_at(p::<A>("weight"))),
    );
    let value = if with_bias {
        add(weighted, load(Space::Global, Ty::F32, w_at(p::<A>("bias"))))
    } else {
        weighted
    };
    body.push(strided(
        i,
        width,
        vec![Stmt::Store(
            Space::Global,
            at(add(p::<A>("out"), mul(row(), i64(4 * i64::from(width)))), i),
            value,
        )],
    ));
    let name = match kind {
        RowNorm::Rms => "rms_norm",
        RowNorm::Layer => "layer_norm",
    };
    kernel(name, A::params(), r, 4 * WARPS as u32, body)
}
