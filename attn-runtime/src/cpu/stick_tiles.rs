//! `normalize = stick_breaking`'s tile passes (Tan et al., 2024): keys are weighed from the
//! nearest (the tile's last column) to the farthest, each row carrying its running sum `R` of
//! `softplus` over the keys already weighed, across tiles (the kernels visit tiles from the
//! last). Scores arrive in half base-2 units `t` (the score `x = 2 t ln 2`); a masked key's is
//! `-inf`, weighs 0 and adds nothing to `R`.
//!
//! - `stick_tile(s, rows, nearer, sums)` (the forward's `exp_tile`): from `c = K - 1` down,
//!   `s[r][c] = e^(ln sigmoid(x) - R[r])`, then `R[r] += softplus(x)`; `sums[r]` gains the
//!   weights. `nearer` holds `R` and is advanced (the kernel passes its row state, writable).
//! - `stick_ds_tile(s, dp, rows, nearer, remaining, factor)` (the backward's `ds_tile`, tiles
//!   visited from the last for each row): `dp` holds `dP` and then, `K_TILE^2` values on, each
//!   score's derivative `d`. From `c = K - 1` down, with `A = e^(ln sigmoid(x) - R)`:
//!   `E -= dP A`, `dS = dP A (1 - sigmoid(x)) - sigmoid(x) E`, `dp = dS d factor`, `d = dS`
//!   (the parameters' pass after it reads `dS` there), `s = A`, `R += softplus(x)`. `E` starts
//!   at the row's `D = sum_j dP_j A_j` (= `dO . out`), so after a key it is the sum over the
//!   farther keys: `dS_j = dP_j A_j (1 - sigma_j) - sigma_j sum_{i farther} dP_i A_i`
//!   (docs/semantics.md). A masked key's `dp` and `d` are 0. `nearer` (`R`) and `remaining`
//!   (`E`) are advanced.
//!
//! Only the running sums are a chain from key to key. Each row is taken in passes: the terms
//! every key has on its own (`softplus`, `ln sigmoid`, `sigmoid`, from one `2^x` and one
//! `ln(1 + x)`), the chain's sums alone, then the weights and gradients from them. The
//! element-wise passes are plain loops over a row's [`K_TILE`] keys, compiled once more with
//! AVX2 and FMA, and with AVX-512F, where the compiler vectorizes them ([`addresses`] picks).

use super::microkernels::Isa;
use super::softmax_tiles::exp2_of_double;
use codegen::plan::K_TILE;

const K: usize = K_TILE as usize;

/// Half base-2 units to natural ones.
const HALF_TO_NATURAL: f32 = 2.0 * std::f32::consts::LN_2;

/// Natural units to half base-2 ones.
const NATURAL_TO_HALF: f32 = std::f32::consts::LOG2_E / 2.0;

/// Lanes of the weights' partial sums (a multiple of every vector width here).
const LANES: usize = 16;
const _: () = assert!(K.is_multiple_of(LANES));

/// One key's terms from its score `t` in half base-2 units (`x = 2 t ln 2`), all from one
/// `E = e^(-|x|) = 2^(-2|t|)` (the softmax passes' `2^(2x)`) and `L = ln(1 + E)`
/// ([`ln_1p_unit`]): `softplus(x) = max(x, 0) + L` (natural units), `ln sigmoid(x) =
/// min(x, 0) - L` (half base-2 units) and `sigmoid(x)`. A masked key (`-inf`) gives 0, `-inf`
/// and 0; a NaN, NaN in all three.
#[inline(always)]
fn terms(t: f32) -> (f32, f32, f32) {
    let e = exp2_of_double(-t.abs());
    let l = ln_1p_unit(e);
    let numerator = if t >= 0.0 { 1.0 } else { e };
    (
        t.max(0.0) * HALF_TO_NATURAL + l,
        t.min(0.0) - l * NATURAL_TO_HALF,
        numerator / (1.0 + e),
    )
}

/// `ln(1 + e)` for `e` in `[0, 1]` (NaN passes): `2 atanh(u)`, `u = e / (2 + e) <= 1/3`, by its
/// series to `u^13` (the next term is below `5e-8` of it).
#[inline(always)]
fn ln_1p_unit(e: f32) -> f32 {
    let u = e / (2.0 + e);
    let u2 = u * u;
    let series = 1.0
        + u2 * (1.0 / 3.0
            + u2 * (1.0 / 5.0
                + u2 * (1.0 / 7.0 + u2 * (1.0 / 9.0 + u2 * (1.0 / 11.0 + u2 * (1.0 / 13.0))))));
    2.0 * u * series
}

/// `sum[c]` becomes the sum of `sum[c'] for c' > c` plus `start` (what lies nearer than key
/// `c`); returns the whole sum plus `start`. The only chain of the passes.
#[inline(always)]
fn nearer_sums(sum: &mut [f32; K], start: f32) -> f32 {
    let mut total = start;
    for x in sum.iter_mut().rev() {
        let here = total;
        total += *x;
        *x = here;
    }
    total
}

/// The weights `2^(2 (ln_sigmoid - R / (2 ln 2)))` of a row, over `ln_sigmoid` (half base-2
/// units, `-inf` for a masked key) and `nearer` (`R` before each key), into `out`; returns
/// their sum.
#[inline(always)]
fn weights(out: &mut [f32], ln_sigmoid: &[f32; K], nearer: &[f32; K]) -> f32 {
    let mut lanes = [0f32; LANES];
    let chunks = out.chunks_exact_mut(LANES).zip(
        ln_sigmoid
            .chunks_exact(LANES)
            .zip(nearer.chunks_exact(LANES)),
    );
    for (out, (ls, r)) in chunks {
        for i in 0..LANES {
            // A masked key weighs exactly 0, even behind a NaN.
            let w = match ls[i] == f32::NEG_INFINITY {
                true => 0.0,
                false => exp2_of_double(ls[i] - r[i] * NATURAL_TO_HALF),
            };
            out[i] = w;
            lanes[i] += w;
        }
    }
    lanes.iter().sum()
}

/// The forward's pass over `rows` rows of `s` (see the module contract).
#[inline(always)]
fn stick_rows(s: &mut [f32], nearer: &mut [f32], sums: &mut [f32]) {
    for ((row, r), sum) in s.chunks_exact_mut(K).zip(nearer).zip(sums) {
        let (mut softplus, mut ln_sigmoid) = ([0f32; K], [0f32; K]);
        for c in 0..K {
            (softplus[c], ln_sigmoid[c], _) = terms(row[c]);
        }
        *r = nearer_sums(&mut softplus, *r);
        *sum += weights(row, &ln_sigmoid, &softplus);
    }
}

/// The backward's pass over the rows of `s`, `dp` and `slopes` (see the module contract).
#[inline(always)]
fn stick_ds_rows(
    (s, dp, slopes): (&mut [f32], &mut [f32], &mut [f32]),
    nearer: &mut [f32],
    remaining: &mut [f32],
    factor: f32,
) {
    let rows = s.chunks_exact_mut(K).zip(dp.chunks_exact_mut(K));
    for (((s, dp), slopes), (r, e)) in rows
        .zip(slopes.chunks_exact_mut(K))
        .zip(nearer.iter_mut().zip(remaining.iter_mut()))
    {
        let (mut softplus, mut ln_sigmoid, mut sigmoid) = ([0f32; K], [0f32; K], [0f32; K]);
        for c in 0..K {
            (softplus[c], ln_sigmoid[c], sigmoid[c]) = terms(s[c]);
        }
        *r = nearer_sums(&mut softplus, *r);
        let masked: [bool; K] = std::array::from_fn(|c| s[c] == f32::NEG_INFINITY);
        weights(s, &ln_sigmoid, &softplus);
        // `dP A` of each key (0 where masked, whatever dP is); `E` past key `c` is `D` less
        // the nearer keys' and its own.
        let da: [f32; K] = std::array::from_fn(|c| if masked[c] { 0.0 } else { dp[c] * s[c] });
        let (mut nearer_da, start) = (da, *e);
        *e = start - nearer_sums(&mut nearer_da, 0.0);
        for c in 0..K {
            let farther = start - (nearer_da[c] + da[c]);
            let ds = da[c] * (1.0 - sigmoid[c]) - sigmoid[c] * farther;
            let ds = if masked[c] { 0.0 } else { ds };
            dp[c] = if masked[c] {
                0.0
            } else {
                ds * slopes[c] * factor
            };
            slopes[c] = ds;
        }
    }
}

/// The forward's `exp_tile` under `normalize = stick_breaking` (see the module contract).
///
/// # Safety
/// `s` must address `rows` rows of `K_TILE` scores, and `nearer` and `sums` `rows` values each,
/// all valid for reads and writes (`nearer` is the kernel's row state, passed as a const
/// pointer by the `exp_tile` signature).
pub unsafe extern "C" fn stick_tile(s: *mut f32, rows: i64, nearer: *const f32, sums: *mut f32) {
    // SAFETY: the contract above.
    unsafe { stick_tile_inline(s, rows, nearer, sums) }
}

/// [`stick_tile`]'s body, inlined into each instruction set's version.
///
/// # Safety
/// [`stick_tile`]'s.
#[inline(always)]
unsafe fn stick_tile_inline(s: *mut f32, rows: i64, nearer: *const f32, sums: *mut f32) {
    let rows = rows as usize;
    // SAFETY: the caller's contract.
    unsafe {
        stick_rows(
            std::slice::from_raw_parts_mut(s, rows * K),
            std::slice::from_raw_parts_mut(nearer.cast_mut(), rows),
            std::slice::from_raw_parts_mut(sums, rows),
        )
    }
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
    // SAFETY: the contract above.
    unsafe { stick_ds_tile_inline(s, dp, rows, [nearer, remaining], factor) }
}

/// [`stick_ds_tile`]'s body, inlined into each instruction set's version.
///
/// # Safety
/// [`stick_ds_tile`]'s.
#[inline(always)]
unsafe fn stick_ds_tile_inline(
    s: *mut f32,
    dp: *mut f32,
    rows: i64,
    [nearer, remaining]: [*const f32; 2],
    factor: f32,
) {
    let rows = rows as usize;
    // SAFETY: the caller's contract.
    unsafe {
        stick_ds_rows(
            (
                std::slice::from_raw_parts_mut(s, rows * K),
                std::slice::from_raw_parts_mut(dp, rows * K),
                std::slice::from_raw_parts_mut(dp.add(K * K), rows * K),
            ),
            std::slice::from_raw_parts_mut(nearer.cast_mut(), rows),
            std::slice::from_raw_parts_mut(remaining.cast_mut(), rows),
            factor,
        )
    }
}

/// The `exp_tile` and `ds_tile` of `normalize = stick_breaking` for an instruction set, as
/// C-ABI function addresses.
pub fn addresses(isa: Isa) -> (usize, usize) {
    type ExpTile = unsafe extern "C" fn(*mut f32, i64, *const f32, *mut f32);
    type DsTile = unsafe extern "C" fn(*mut f32, *mut f32, i64, *const f32, *const f32, f32);
    let (exp, ds): (ExpTile, DsTile) = match isa.vectors() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => (x86::stick_tile_avx512, x86::stick_ds_tile_avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => (x86::stick_tile_avx2, x86::stick_ds_tile_avx2),
        _ => (stick_tile, stick_ds_tile),
    };
    (exp as usize, ds as usize)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    /// The portable passes compiled with `$feature`: the same arithmetic, vectorized by the
    /// compiler.
    macro_rules! stick_passes {
        (feature: $feature:literal, exp: $exp:ident, ds: $ds:ident) => {
            /// `stick_tile` with the target features.
            ///
            /// # Safety
            /// `stick_tile`'s, on a CPU with the target features.
            #[target_feature(enable = $feature)]
            pub unsafe extern "C" fn $exp(
                s: *mut f32,
                rows: i64,
                nearer: *const f32,
                sums: *mut f32,
            ) {
                // SAFETY: the caller's contract is `stick_tile`'s.
                unsafe { super::stick_tile_inline(s, rows, nearer, sums) }
            }

            /// `stick_ds_tile` with the target features.
            ///
            /// # Safety
            /// `stick_ds_tile`'s, on a CPU with the target features.
            #[target_feature(enable = $feature)]
            pub unsafe extern "C" fn $ds(
                s: *mut f32,
                dp: *mut f32,
                rows: i64,
                nearer: *const f32,
                remaining: *const f32,
                factor: f32,
            ) {
                // SAFETY: the caller's contract is `stick_ds_tile`'s.
                unsafe { super::stick_ds_tile_inline(s, dp, rows, [nearer, remaining], factor) }
            }
        };
    }

    stick_passes!(feature: "avx2,fma", exp: stick_tile_avx2, ds: stick_ds_tile_avx2);
    stick_passes!(feature: "avx512f", exp: stick_tile_avx512, ds: stick_ds_tile_avx512);
}

#[cfg(test)]
mod tests {
    use super::*;

    type ExpTile = unsafe extern "C" fn(*mut f32, i64, *const f32, *mut f32);
    type DsTile = unsafe extern "C" fn(*mut f32, *mut f32, i64, *const f32, *const f32, f32);

    /// Two rows of scores in half base-2 units over the range the kernels see, with masked
    /// keys, large scores of both signs and (row 1) a NaN.
    fn scores() -> Vec<f32> {
        let mut s: Vec<f32> = (0..2 * K)
            .map(|i| ((i * 37) % 23) as f32 * 0.35 - 4.0)
            .collect();
        for c in [3, 40, K - 1, K + 2] {
            s[c] = f32::NEG_INFINITY;
        }
        (s[10], s[11], s[K + 30]) = (30.0, -45.0, f32::NAN);
        s
    }

    /// The contract in f64, key by key from the last: each weight, `R` and `E` after the row,
    /// and (given `dP` and derivatives) each `dS`.
    fn reference(
        t: &[f32],
        dp: &[f32],
        slope: &[f32],
        [r, e]: [f64; 2],
    ) -> (Vec<f64>, Vec<f64>, [f64; 2]) {
        let (mut w, mut ds) = (vec![0.0; K], vec![0.0; K]);
        let (mut r, mut e) = (r, e);
        for c in (0..K).rev() {
            if t[c] == f32::NEG_INFINITY {
                continue;
            }
            let x = 2.0 * f64::from(t[c]) * std::f64::consts::LN_2;
            let sig = 1.0 / (1.0 + (-x).exp());
            w[c] = sig * (-r).exp();
            let da = f64::from(dp[c]) * w[c];
            e -= da;
            ds[c] = (da * (1.0 - sig) - sig * e) * f64::from(slope[c]) * 0.5;
            r += x.max(0.0) + (-x.abs()).exp().ln_1p();
        }
        (w, ds, [r, e])
    }

    fn close(got: f32, want: f64, what: &str) {
        if want.is_nan() {
            assert!(got.is_nan(), "{what}: {got}, want NaN");
        } else {
            let err = (f64::from(got) - want).abs();
            assert!(
                err <= 2e-6 + 2e-5 * want.abs(),
                "{what}: {got}, want {want}"
            );
        }
    }

    #[test]
    fn every_instruction_sets_passes_match_the_contract_in_f64() {
        let input = scores();
        let dp: Vec<f32> = (0..2 * K)
            .map(|i| ((i * 13) % 7) as f32 * 0.3 - 1.0)
            .collect();
        let slope: Vec<f32> = (0..2 * K).map(|i| 1.0 - 0.005 * i as f32).collect();
        let start = [[0.25f32, 0.5], [0.0, 0.0]];
        for isa in Isa::ALL.into_iter().filter(|isa| isa.runs_here()) {
            let (exp, ds) = addresses(isa);
            // SAFETY: `addresses` returns functions with these signatures.
            let (exp, ds) = unsafe {
                (
                    std::mem::transmute::<usize, ExpTile>(exp),
                    std::mem::transmute::<usize, DsTile>(ds),
                )
            };
            let (mut s, mut nearer, mut sums) = (input.clone(), start[0], [1.0f32, 0.0]);
            // SAFETY: two rows of K scores, two row states and sums.
            unsafe { exp(s.as_mut_ptr(), 2, nearer.as_mut_ptr(), sums.as_mut_ptr()) };
            let mut grads = vec![0f32; 2 * K * K];
            grads[..2 * K].copy_from_slice(&dp);
            grads[K * K..K * K + 2 * K].copy_from_slice(&slope);
            let (mut a, mut state) = (input.clone(), start);
            // SAFETY: two rows of K scores, dP and derivatives K^2 values on, two states.
            unsafe {
                ds(
                    a.as_mut_ptr(),
                    grads.as_mut_ptr(),
                    2,
                    state[0].as_mut_ptr(),
                    state[1].as_mut_ptr(),
                    0.5,
                )
            };
            for row in 0..2 {
                let at = row * K..(row + 1) * K;
                let r0 = [f64::from(start[0][row]), f64::from(start[1][row])];
                let (w, want_ds, [r, e]) =
                    reference(&input[at.clone()], &dp[at.clone()], &slope[at.clone()], r0);
                let what = |name: &str, c: usize| format!("{isa:?} row {row} key {c}: {name}");
                for c in 0..K {
                    close(s[row * K + c], w[c], &what("forward weight", c));
                    close(a[row * K + c], w[c], &what("backward weight", c));
                    close(grads[row * K + c], want_ds[c], &what("dS", c));
                    // dS before the derivative and factor, where the derivative was.
                    let unscaled = want_ds[c] / (f64::from(slope[row * K + c]) * 0.5);
                    close(grads[K * K + row * K + c], unscaled, &what("dS_final", c));
                }
                close(nearer[row], r, &what("forward R", 0));
                close(state[0][row], r, &what("backward R", 0));
                close(state[1][row], e, &what("E", 0));
                let sum = w.iter().sum::<f64>() + if row == 0 { 1.0 } else { 0.0 };
                close(sums[row], sum, &what("sum", 0));
            }
        }
    }
}
