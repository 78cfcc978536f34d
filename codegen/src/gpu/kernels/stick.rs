//! `normalize = stick_breaking` (Tan et al., 2024) in the SIMT kernels: one key's weight from
//! its score and the running sum of `softplus` over the nearer keys of its row, the same
//! arithmetic as the CPU backend's tile passes (`attn-runtime/src/cpu/stick_tiles.rs`).
//!
//! Scores are in the kernels' half base-2 units `t` (the score `x = 2 t ln 2`). From one
//! `e = 2^(-2|t|) = e^(-|x|)` and `L = ln(1 + e)`: `softplus(x) = max(x, 0) + L`,
//! `ln sigmoid(x) = min(x, 0) - L`, so the weight is `e^(ln sigmoid(x) - R)` with `R` the
//! running sum (natural units). A masked key's `-inf` gives `e = 0`, weight 0, `softplus` 0 and
//! `sigmoid` 0 with no special case; a NaN score gives NaN in all three.

use super::build::Regs;
use super::softmax::exp2_twice;
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Reg, Stmt, Ty, Un};

/// Half base-2 units to natural ones.
const HALF_TO_NATURAL: f32 = 2.0 * std::f32::consts::LN_2;

/// Natural units to half base-2 ones.
const NATURAL_TO_HALF: f32 = std::f32::consts::LOG2_E / 2.0;

/// The registers one key's stick-breaking terms are computed in.
pub(crate) struct StickKey {
    /// The key's score (half base-2 units).
    t: Reg,
    /// `e = 2^(-2|t|)`.
    e: Reg,
    /// `L = ln(1 + e)`.
    ln_1p: Reg,
    /// The key's weight `A = e^(ln sigmoid(x) - R)`.
    pub weight: Reg,
    /// `softplus(x)`: what `R` gains past this key.
    pub added: Reg,
    /// `sigmoid(x)` (the backward's).
    pub sigmoid: Reg,
}

impl StickKey {
    /// Registers for a kernel's key terms.
    pub(crate) fn new(r: &mut Regs) -> StickKey {
        StickKey {
            t: r.add("stick_t", Ty::F32),
            e: r.add("stick_e", Ty::F32),
            ln_1p: r.add("stick_ln_1p", Ty::F32),
            weight: r.add("stick_weight", Ty::F32),
            added: r.add("stick_added", Ty::F32),
            sigmoid: r.add("stick_sigmoid", Ty::F32),
        }
    }

    /// Sets `weight`, `added` and `sigmoid` for a key whose score is `t` (half base-2 units)
    /// behind nearer keys whose `softplus` sum is `nearer` (natural units). `ln(1 + e)` is
    /// `2 atanh(u)`, `u = e / (2 + e) <= 1/3`, by its series to `u^13` (the next term is below
    /// `5e-8` of it), where `lg2(1 + e)` would lose every digit of a small `e`.
    pub(crate) fn weigh(&self, t: Expr, nearer: Expr) -> Vec<Stmt> {
        // `u`, then `L` from it, in one register.
        let (e, u, l) = (self.e, self.ln_1p, self.ln_1p);
        let series = [11.0f32, 9.0, 7.0, 5.0, 3.0]
            .iter()
            .fold(f32(1.0 / 13.0), |acc, &n| {
                fma(acc, mul(reg(u), reg(u)), f32(1.0 / n))
            });
        vec![
            Stmt::Set(self.t, t),
            Stmt::Set(e, un(Un::Ex2, mul(un(Un::Abs, reg(self.t)), f32(-2.0)))),
            Stmt::Set(u, bin(Bin::Div, reg(e), add(f32(2.0), reg(e)))),
            Stmt::Set(
                l,
                mul(
                    mul(f32(2.0), reg(u)),
                    fma(series, mul(reg(u), reg(u)), f32(1.0)),
                ),
            ),
            Stmt::Set(
                self.sigmoid,
                bin(
                    Bin::Div,
                    select(bin(Bin::Ge, reg(self.t), f32(0.0)), f32(1.0), reg(e)),
                    add(f32(1.0), reg(e)),
                ),
            ),
            Stmt::Set(
                self.weight,
                exp2_twice(sub(
                    bin(Bin::Min, reg(self.t), f32(0.0)),
                    mul(add(reg(l), nearer), f32(NATURAL_TO_HALF)),
                )),
            ),
            Stmt::Set(
                self.added,
                fma(
                    bin(Bin::Max, reg(self.t), f32(0.0)),
                    f32(HALF_TO_NATURAL),
                    reg(l),
                ),
            ),
        ]
    }
}

/// `count - 1 - i`: a loop's index `i` over `0..count` taken from the last (stick-breaking
/// weighs keys from the nearest).
pub(crate) fn from_last(count: Expr, i: Expr) -> Expr {
    sub(sub(count, i), i64(1))
}
