//! `normalize = stick_breaking`'s tile passes (Tan et al., 2024), portable: keys are weighed
//! from the nearest (the tile's last column) to the farthest, each row carrying its running sum
//! `R` of `softplus` over the keys already weighed, across tiles (the kernels visit tiles from
//! the last). Scores arrive in half base-2 units `t` (the score `x = 2 t ln 2`); a masked key's
//! is `-inf`, weighs 0 and adds nothing to `R`.
//!
//! - `stick_tile(s, rows, nearer, sums)` (the forward's `exp_tile`): from `c = K - 1` down,
//!   `s[r][c] = e^(ln sigmoid(x) - R[r])`, then `R[r] += softplus(x)`; `sums[r]` gains the
//!   weights. `nearer` holds `R` and is advanced (the kernel passes its row state, writable).
//! - `stick_ds_tile(s, dp, rows, nearer, remaining, factor)` (the backward's `ds_tile`, tiles
//!   visited from the last for each row): `dp` holds `dP` and then, `K_TILE^2` values on, each
//!   score's derivative `d`. From `c = K - 1` down, with `A = e^(ln sigmoid(x) - R)`:
//!   `E -= dP A`, `dp = (dP A (1 - sigmoid(x)) - sigmoid(x) E) d factor`, `s = A`,
//!   `R += softplus(x)`. `E` starts at the row's `D = sum_j dP_j A_j` (= `dO . out`), so after a
//!   key it is the sum over the farther keys: `dS_j = dP_j A_j (1 - sigma_j) - sigma_j
//!   sum_{i farther} dP_i A_i` (docs/semantics.md). `nearer` (`R`) and `remaining` (`E`) are
//!   advanced.

use super::softmax_tiles::exp2_of_double;
use codegen::plan::K_TILE;

const K: usize = K_TILE as usize;

/// Half base-2 units to natural ones.
const HALF_TO_NATURAL: f32 = 2.0 * std::f32::consts::LN_2;

/// One key's weight `e^(ln sigmoid(x) - nearer)`, its `softplus(x)` and its `sigmoid(x)`, from
/// its score `t` in half base-2 units (`x = 2 t ln 2`), all from one `E = e^(-|x|) =
/// 2^(-2|t|)`: with `L = ln(1 + E)`, `softplus(x) = max(x, 0) + L` and `ln sigmoid(x) =
/// min(x, 0) - L`. Both exponentials are the softmax passes' `2^(2x)`; `L` is
/// [`ln_1p_unit`]. A masked key (`-inf`) weighs 0 and adds 0; a NaN gives NaN in all three.
fn weigh(t: f32, nearer: f32) -> (f32, f32, f32) {
    if t == f32::NEG_INFINITY {
        return (0.0, 0.0, 0.0);
    }
    let e = exp2_of_double(-t.abs());
    let l = ln_1p_unit(e);
    let sigmoid = if t >= 0.0 {
        1.0 / (1.0 + e)
    } else {
        e / (1.0 + e)
    };
    let weight = exp2_of_double(t.min(0.0) - (l + nearer) * NATURAL_TO_HALF);
    (weight, t.max(0.0) * HALF_TO_NATURAL + l, sigmoid)
}

/// Natural units to half base-2 ones.
const NATURAL_TO_HALF: f32 = std::f32::consts::LOG2_E / 2.0;

/// `ln(1 + e)` for `e` in `[0, 1]` (NaN passes): `2 atanh(u)`, `u = e / (2 + e) <= 1/3`, by its
/// series to `u^13` (the next term is below `5e-8` of it).
fn ln_1p_unit(e: f32) -> f32 {
    let u = e / (2.0 + e);
    let u2 = u * u;
    let series = 1.0
        + u2 * (1.0 / 3.0
            + u2 * (1.0 / 5.0
                + u2 * (1.0 / 7.0 + u2 * (1.0 / 9.0 + u2 * (1.0 / 11.0 + u2 * (1.0 / 13.0))))));
    2.0 * u * series
}

/// The forward's `exp_tile` under `normalize = stick_breaking` (see the module contract).
///
/// # Safety
/// `s` must address `rows` rows of `K_TILE` scores, and `nearer` and `sums` `rows` values each,
/// all valid for reads and writes (`nearer` is the kernel's row state, passed as a const
/// pointer by the `exp_tile` signature).
pub unsafe extern "C" fn stick_tile(s: *mut f32, rows: i64, nearer: *const f32, sums: *mut f32) {
    let rows = rows as usize;
    // SAFETY: the contract above.
    let (s, nearer, sums) = unsafe {
        (
            std::slice::from_raw_parts_mut(s, rows * K),
            std::slice::from_raw_parts_mut(nearer.cast_mut(), rows),
            std::slice::from_raw_parts_mut(sums, rows),
        )
    };
    for ((row, r), sum) in s.chunks_exact_mut(K).zip(nearer).zip(sums) {
        for x in row.iter_mut().rev() {
            let (w, added, _) = weigh(*x, *r);
            *x = w;
            *r += added;
            *sum += w;
        }
    }
}

/// The `exp_tile` and `ds_tile` of `normalize = stick_breaking`, as C-ABI function addresses.
pub fn addresses() -> (usize, usize) {
    (
        stick_tile as *const () as usize,
        stick_ds_tile as *const () as usize,
    )
}

/// The backward's `ds_tile` under `normalize = stick_breaking` (see the module contract).
///
/// # Safety
/// `s` must address `rows` rows of `K_TILE` scores, `dp` `K_TILE^2` values plus as many
/// derivatives, and `nearer` and `remaining` `rows` values each, all valid for reads and
/// writes (the row state, passed as const pointers by the `ds_tile` signature).
pub unsafe extern "C" fn stick_ds_tile(
    s: *mut f32,
    dp: *mut f32,
    rows: i64,
    nearer: *const f32,
    remaining: *const f32,
    factor: f32,
) {
    let rows = rows as usize;
    // SAFETY: the contract above.
    let (s, dp, slopes, nearer, remaining) = unsafe {
        (
            std::slice::from_raw_parts_mut(s, rows * K),
            std::slice::from_raw_parts_mut(dp, rows * K),
            std::slice::from_raw_parts(dp.add(K * K), rows * K),
            std::slice::from_raw_parts_mut(nearer.cast_mut(), rows),
            std::slice::from_raw_parts_mut(remaining.cast_mut(), rows),
        )
    };
    let rows = s.chunks_exact_mut(K).zip(dp.chunks_exact_mut(K));
    for (((s, dp), slopes), (r, e)) in rows
        .zip(slopes.chunks_exact(K))
        .zip(nearer.iter_mut().zip(remaining.iter_mut()))
    {
        for c in (0..K).rev() {
            let t = s[c];
            if t == f32::NEG_INFINITY {
                (s[c], dp[c]) = (0.0, 0.0);
                continue;
            }
            let (a, added, sig) = weigh(t, *r);
            let da = dp[c] * a;
            *e -= da;
            dp[c] = (da * (1.0 - sig) - sig * *e) * slopes[c] * factor;
            s[c] = a;
            *r += added;
        }
    }
}
