//! The element-wise tile passes generated kernels call once the spec's own work on a tile is
//! done: the exponentials of the online softmax (`exp_tile`) and of the backward's recomputed
//! probabilities with `dS` (`ds_tile`). What varies with a spec (the score program, the mask,
//! the modifier's derivative) stays in generated code, which is limited to 4-lane vectors; these
//! passes are the same for every spec, so they run natively at the CPU's full vector width.
//!
//! Both evaluate `2^(2x)` (scores are in half base-2 units) as the generated code does
//! (`codegen::cpu::fx::Fx::exp2_of_double_4`): clamp at -63.5 so `-inf` gives exactly 0 while
//! NaN passes, split `2x = n + r` by the 1.5 * 2^23 rounding trick, a degree-5 polynomial for
//! `2^r` and `2^n` built in the exponent bits.
//!
//! Contract (see `codegen::cpu::abi::Imports`), on rows of [`K_TILE`] values:
//! - `exp_tile(s, rows, shift, sums)`: `s[r][c] = 2^(2 (s[r][c] - shift[r]))` and
//!   `sums[r] += sum_c s[r][c]`, for `r < rows`, `c < K_TILE`;
//! - `ds_tile(s, dp, rows, lse, delta, factor)`: with `h = lse[r] log2(e) / 2`,
//!   `s[r][c] = 2^(2 (s[r][c] - h))` and `dp[r][c] = s[r][c] (dp[r][c] - delta[r]) factor`
//!   (`delta` may be null: 0); a row whose `lse` is `-inf` becomes 0 in both, and one whose `lse`
//!   is NaN becomes NaN where its score is kept and 0 where it is `-inf` (masked).

use super::microkernels::Isa;
use codegen::cpu::abi::exp2::{LOWEST, MAGIC, P};
use codegen::plan::K_TILE;

const K: usize = K_TILE as usize;

/// Natural log-sum-exp to half base-2 units.
const LSE_TO_HALF: f32 = std::f32::consts::LOG2_E / 2.0;

/// The signature of `exp_tile`.
type ExpTile = unsafe extern "C" fn(*mut f32, i64, *const f32, *mut f32);
/// The signature of `ds_tile`.
type DsTile = unsafe extern "C" fn(*mut f32, *mut f32, i64, *const f32, *const f32, f32);

/// The `exp_tile` and `ds_tile` of `normalize = sigmoid` for an instruction set.
pub fn sigmoid_addresses(isa: Isa) -> (usize, usize) {
    let (exp, ds): (ExpTile, DsTile) = match isa.vectors() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => (x86::sigmoid_avx512, x86::sigmoid_ds_avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => (x86::sigmoid_avx2, x86::sigmoid_ds_avx2),
        _ => (sigmoid_tile, sigmoid_ds_tile),
    };
    (exp as usize, ds as usize)
}

/// `exp_tile` and `ds_tile` for an instruction set, as C-ABI function addresses.
pub fn addresses(isa: Isa) -> (usize, usize) {
    let (exp, ds): (ExpTile, DsTile) = match isa.vectors() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => (x86::exp_avx512, x86::ds_avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => (x86::exp_avx2, x86::ds_avx2),
        _ => (exp_portable, ds_portable),
    };
    (exp as usize, ds as usize)
}

/// `2^(2x)`, one lane of the vector versions.
pub(super) fn exp2_of_double(x: f32) -> f32 {
    // `x < LOWEST ? LOWEST : x`: a NaN passes through.
    let x = if x < LOWEST { LOWEST } else { x };
    let t = x * 2.0 + MAGIC;
    // 2x - n, exact: 2x is, and it lies within 1/2 of the integer n.
    let r = x * 2.0 + (MAGIC - t);
    let r2 = r * r;
    let a = P[1] * r + P[0];
    let b = P[3] * r + P[2];
    let d = P[5] * r + P[4];
    let p = r2 * (r2 * d + b) + a;
    let y = r * p + 1.0;
    y * f32::from_bits(t.to_bits() << 23)
}

/// Portable `exp_tile`.
///
/// # Safety
/// The pointers must address the ranges in the module contract, valid for the access.
pub unsafe extern "C" fn exp_portable(s: *mut f32, rows: i64, shift: *const f32, sums: *mut f32) {
    let rows = rows as usize;
    // SAFETY: the module contract: `rows` rows of K scores, `rows` shifts and sums.
    let (s, shift, sums) = unsafe {
        (
            std::slice::from_raw_parts_mut(s, rows * K),
            std::slice::from_raw_parts(shift, rows),
            std::slice::from_raw_parts_mut(sums, rows),
        )
    };
    for ((row, m), sum) in s.chunks_exact_mut(K).zip(shift).zip(sums) {
        for x in row.iter_mut() {
            *x = exp2_of_double(*x - m);
            *sum += *x;
        }
    }
}

/// Portable `ds_tile`.
///
/// # Safety
/// The pointers must address the ranges in the module contract, valid for the access.
pub unsafe extern "C" fn ds_portable(
    s: *mut f32,
    dp: *mut f32,
    rows: i64,
    lse: *const f32,
    delta: *const f32,
    factor: f32,
) {
    let rows = rows as usize;
    // SAFETY: the module contract: `rows` rows of K scores and dP values, `rows` lse and
    // (unless null) D values.
    let (s, dp, lse, delta) = unsafe {
        (
            std::slice::from_raw_parts_mut(s, rows * K),
            std::slice::from_raw_parts_mut(dp, rows * K),
            std::slice::from_raw_parts(lse, rows),
            (!delta.is_null()).then(|| std::slice::from_raw_parts(delta, rows)),
        )
    };
    for (r, (s, dp)) in s
        .chunks_exact_mut(K)
        .zip(dp.chunks_exact_mut(K))
        .enumerate()
    {
        if lse[r] == f32::NEG_INFINITY {
            s.fill(0.0);
            dp.fill(0.0);
            continue;
        }
        if lse[r].is_nan() {
            nan_row(s, dp);
            continue;
        }
        let (h, d) = (lse[r] * LSE_TO_HALF, delta.map_or(0.0, |d| d[r]));
        for (s, dp) in s.iter_mut().zip(dp.iter_mut()) {
            *s = exp2_of_double(*s - h);
            *dp = *s * (*dp - d) * factor;
        }
    }
}

/// `normalize = sigmoid`'s weight of a score `t` in half base-2 units (`t = (s + B) log2(e) /
/// 2`): `sigmoid(s + B) = e / (1 + e)` with `e = 2^(2t)`, and its derivative per natural unit
/// `p (1 - p) = p / (1 + e)` (neither cancels). `t` is clamped at 63 so `e` stays finite (NaN
/// passes); a masked key's `-inf` gives `e = 0` exactly, so it weighs exactly 0.
fn sigmoid_of_half(t: f32) -> (f32, f32) {
    let e = exp2_of_double(if t > 63.0 { 63.0 } else { t });
    let p = e / (1.0 + e);
    (p, p / (1.0 + e))
}

/// `normalize = sigmoid`'s `exp_tile`: `s[r][c] = sigmoid` of the score (half base-2 units, the
/// bias already added) and `sums[r] += sum_c s[r][c]`; `shift` is not read (no running max).
///
/// # Safety
/// The pointers must address the ranges in the module contract, valid for the access.
pub unsafe extern "C" fn sigmoid_tile(s: *mut f32, rows: i64, _shift: *const f32, sums: *mut f32) {
    let rows = rows as usize;
    // SAFETY: the module contract: `rows` rows of K scores and `rows` sums.
    let (s, sums) = unsafe {
        (
            std::slice::from_raw_parts_mut(s, rows * K),
            std::slice::from_raw_parts_mut(sums, rows),
        )
    };
    for (row, sum) in s.chunks_exact_mut(K).zip(sums) {
        for x in row.iter_mut() {
            *x = sigmoid_of_half(*x).0;
        }
        *sum += row.iter().sum::<f32>();
    }
}

/// `normalize = sigmoid`'s `ds_tile`: `s[r][c] = p = sigmoid` of the score and
/// `dp[r][c] = p (1 - p) dp[r][c] factor` (each weight on its own: no row term, so `lse` and
/// `delta` are not read).
///
/// # Safety
/// The pointers must address the ranges in the module contract, valid for the access.
pub unsafe extern "C" fn sigmoid_ds_tile(
    s: *mut f32,
    dp: *mut f32,
    rows: i64,
    _lse: *const f32,
    _delta: *const f32,
    factor: f32,
) {
    let n = rows as usize * K;
    // SAFETY: the module contract: `rows` rows of K scores and dP values.
    let (s, dp) = unsafe {
        (
            std::slice::from_raw_parts_mut(s, n),
            std::slice::from_raw_parts_mut(dp, n),
        )
    };
    for (s, dp) in s.iter_mut().zip(dp.iter_mut()) {
        let (p, slope) = sigmoid_of_half(*s);
        *dp *= slope * factor;
        *s = p;
    }
}

/// A row whose lse is NaN (a NaN or +inf score it keeps): its kept pairs' probabilities and `dS`
/// are NaN, and its masked pairs' (score `-inf`) are exactly 0, never `2^(-inf - NaN)`, so that
/// NaN reaches only the gradients of pairs the row keeps (docs/semantics.md, "At the edges").
fn nan_row(s: &mut [f32], dp: &mut [f32]) {
    for (s, dp) in s.iter_mut().zip(dp.iter_mut()) {
        let value = if *s == f32::NEG_INFINITY {
            0.0
        } else {
            f32::NAN
        };
        (*s, *dp) = (value, value);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{K, LOWEST, LSE_TO_HALF, MAGIC, P, nan_row};
    use std::arch::x86_64::*;

    /// `exp_tile` and `ds_tile` for one vector width: the same steps as the portable versions,
    /// `LANES` keys at a time, in the intrinsics named.
    macro_rules! tile_passes {
        (
            feature: $feature:literal, vector: $v:ident, lanes: $lanes:literal,
            exp: $exp_name:ident, ds: $ds_name:ident, exp2: $exp2:ident, sum: $sum:expr,
            sigmoid: $sig_name:ident, sigmoid_ds: $sig_ds_name:ident, parts: $parts:ident,
            set1: $set1:ident, zero: $zero:ident, load: $load:ident, store: $store:ident,
            add: $add:ident, sub: $sub:ident, mul: $mul:ident, div: $div:ident, fma: $fma:ident,
            max: $max:ident, min: $min:ident,
            shl23: $shl:expr, to_int: $to_int:ident, to_float: $to_float:ident
        ) => {
            /// `2^(2x)`, lane by lane.
            #[target_feature(enable = $feature)]
            #[inline]
            fn $exp2(x: $v) -> $v {
                // `max(lo, x)` returns `x` when it is NaN.
                let x = $max($set1(LOWEST), x);
                let (two, magic) = ($set1(2.0), $set1(MAGIC));
                let t = $fma(x, two, magic);
                let r = $fma(x, two, $sub(magic, t));
                let c = P.map(|c| $set1(c));
                let r2 = $mul(r, r);
                let a = $fma(c[1], r, c[0]);
                let b = $fma(c[3], r, c[2]);
                let d = $fma(c[5], r, c[4]);
                let p = $fma(r2, $fma(r2, d, b), a);
                let y = $fma(r, p, $set1(1.0));
                $mul(y, $to_float($shl($to_int(t))))
            }

            /// `exp_tile` (the module contract).
            ///
            /// # Safety
            /// The module contract, on a CPU with the target features.
            #[target_feature(enable = $feature)]
            pub unsafe extern "C" fn $exp_name(
                s: *mut f32,
                rows: i64,
                shift: *const f32,
                sums: *mut f32,
            ) {
                // SAFETY: rows r < `rows` of K values, one shift and sum each (the contract).
                unsafe {
                    for r in 0..rows as usize {
                        let row = s.add(r * K);
                        let m = $set1(*shift.add(r));
                        let mut sum = $zero();
                        for c in (0..K).step_by($lanes) {
                            let e = $exp2($sub($load(row.add(c)), m));
                            $store(row.add(c), e);
                            sum = $add(sum, e);
                        }
                        *sums.add(r) += $sum(sum);
                    }
                }
            }

            /// `e = 2^(2t)` with `t` clamped at 63 (NaN passes: `min` returns its second
            /// operand when either is NaN); `p = e / (1 + e)`; and `1 + e`.
            #[target_feature(enable = $feature)]
            #[inline]
            fn $parts(t: $v) -> ($v, $v) {
                let e = $exp2($min($set1(63.0), t));
                let one_e = $add($set1(1.0), e);
                ($div(e, one_e), one_e)
            }

            /// Sigmoid attention's `exp_tile` (the portable `sigmoid_tile`'s steps).
            ///
            /// # Safety
            /// The module contract, on a CPU with the target features.
            #[target_feature(enable = $feature)]
            pub unsafe extern "C" fn $sig_name(
                s: *mut f32,
                rows: i64,
                _shift: *const f32,
                sums: *mut f32,
            ) {
                // SAFETY: rows r < `rows` of K values, one sum each (the contract).
                unsafe {
                    for r in 0..rows as usize {
                        let row = s.add(r * K);
                        let mut sum = $zero();
                        for c in (0..K).step_by($lanes) {
                            let (p, _) = $parts($load(row.add(c)));
                            $store(row.add(c), p);
                            sum = $add(sum, p);
                        }
                        *sums.add(r) += $sum(sum);
                    }
                }
            }

            /// Sigmoid attention's `ds_tile` (the portable `sigmoid_ds_tile`'s steps).
            ///
            /// # Safety
            /// The module contract, on a CPU with the target features.
            #[target_feature(enable = $feature)]
            pub unsafe extern "C" fn $sig_ds_name(
                s: *mut f32,
                dp: *mut f32,
                rows: i64,
                _lse: *const f32,
                _delta: *const f32,
                factor: f32,
            ) {
                // SAFETY: rows r < `rows` of K values in `s` and `dp` (the contract).
                unsafe {
                    let factor = $set1(factor);
                    for i in (0..rows as usize * K).step_by($lanes) {
                        let (p, one_e) = $parts($load(s.add(i)));
                        let slope = $div(p, one_e);
                        $store(s.add(i), p);
                        $store(dp.add(i), $mul($mul($load(dp.add(i)), slope), factor));
                    }
                }
            }

            /// `ds_tile` (the module contract).
            ///
            /// # Safety
            /// The module contract, on a CPU with the target features.
            #[target_feature(enable = $feature)]
            pub unsafe extern "C" fn $ds_name(
                s: *mut f32,
                dp: *mut f32,
                rows: i64,
                lse: *const f32,
                delta: *const f32,
                factor: f32,
            ) {
                // SAFETY: rows r < `rows` of K values in `s` and `dp`, one lse and D each (the
                // contract).
                unsafe {
                    let factor = $set1(factor);
                    for r in 0..rows as usize {
                        let (s, dp) = (s.add(r * K), dp.add(r * K));
                        let lse = *lse.add(r);
                        if lse == f32::NEG_INFINITY {
                            for c in (0..K).step_by($lanes) {
                                $store(s.add(c), $zero());
                                $store(dp.add(c), $zero());
                            }
                            continue;
                        }
                        if lse.is_nan() {
                            nan_row(
                                std::slice::from_raw_parts_mut(s, K),
                                std::slice::from_raw_parts_mut(dp, K),
                            );
                            continue;
                        }
                        let h = $set1(lse * LSE_TO_HALF);
                        let d = $set1(if delta.is_null() { 0.0 } else { *delta.add(r) });
                        for c in (0..K).step_by($lanes) {
                            let p = $exp2($sub($load(s.add(c)), h));
                            let centered = $sub($load(dp.add(c)), d);
                            $store(s.add(c), p);
                            $store(dp.add(c), $mul($mul(p, centered), factor));
                        }
                    }
                }
            }
        };
    }

    tile_passes! {
        feature: "avx512f", vector: __m512, lanes: 16,
        exp: exp_avx512, ds: ds_avx512, exp2: exp2_of_double_16, sum: _mm512_reduce_add_ps,
        sigmoid: sigmoid_avx512, sigmoid_ds: sigmoid_ds_avx512, parts: sigmoid_parts_16,
        set1: _mm512_set1_ps, zero: _mm512_setzero_ps, load: _mm512_loadu_ps,
        store: _mm512_storeu_ps, add: _mm512_add_ps, sub: _mm512_sub_ps, mul: _mm512_mul_ps,
        div: _mm512_div_ps, fma: _mm512_fmadd_ps, max: _mm512_max_ps, min: _mm512_min_ps,
        shl23: _mm512_slli_epi32::<23>,
        to_int: _mm512_castps_si512, to_float: _mm512_castsi512_ps
    }

    tile_passes! {
        feature: "avx2,fma", vector: __m256, lanes: 8,
        exp: exp_avx2, ds: ds_avx2, exp2: exp2_of_double_8, sum: sum_8,
        sigmoid: sigmoid_avx2, sigmoid_ds: sigmoid_ds_avx2, parts: sigmoid_parts_8,
        set1: _mm256_set1_ps, zero: _mm256_setzero_ps, load: _mm256_loadu_ps,
        store: _mm256_storeu_ps, add: _mm256_add_ps, sub: _mm256_sub_ps, mul: _mm256_mul_ps,
        div: _mm256_div_ps, fma: _mm256_fmadd_ps, max: _mm256_max_ps, min: _mm256_min_ps,
        shl23: _mm256_slli_epi32::<23>,
        to_int: _mm256_castps_si256, to_float: _mm256_castsi256_ps
    }

    /// The sum of the 8 lanes.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn sum_8(x: __m256) -> f32 {
        let pairs = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
        let pairs = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
        _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction set this CPU has, with the portable one.
    fn isas() -> Vec<Isa> {
        let mut isas = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                isas.push(Isa::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                isas.push(Isa::Avx512);
            }
        }
        isas
    }

    /// Scores of two rows spanning the range the kernels see, with `-inf`, NaN and values
    /// under the clamp.
    fn scores() -> Vec<f32> {
        let mut s: Vec<f32> = (0..2 * K).map(|i| -30.0 + 0.47 * i as f32).collect();
        s[3] = f32::NEG_INFINITY;
        s[5] = -200.0;
        s[K + 7] = f32::NAN;
        s
    }

    #[test]
    fn exp_tile_matches_f64_exponentials_and_sums() {
        for isa in isas() {
            let (exp, _) = addresses(isa);
            // SAFETY: `addresses` returns an `exp_tile` with this signature.
            let exp: ExpTile = unsafe { std::mem::transmute::<usize, ExpTile>(exp) };
            let input = scores();
            let mut s = input.clone();
            let shift = [1.5f32, -2.0];
            let mut sums = [10.0f32, 0.0];
            // SAFETY: two rows of K scores, two shifts and sums.
            unsafe { exp(s.as_mut_ptr(), 2, shift.as_ptr(), sums.as_mut_ptr()) };
            let mut want_sum = [10.0f64, 0.0];
            for (i, (&x, &got)) in input.iter().zip(&s).enumerate() {
                // The argument is an f32 difference, as in the contract; its exponential exact.
                let want = (2.0 * f64::from(x - shift[i / K])).exp2();
                want_sum[i / K] += want;
                if x.is_nan() {
                    assert!(got.is_nan(), "{isa:?}: NaN score gave {got}");
                } else if want < 1e-37 {
                    assert!(got.abs() < 1e-37, "{isa:?}: 2^(2 {x}) gave {got}");
                } else {
                    let rel = (f64::from(got) - want).abs() / want;
                    assert!(rel < 3e-7, "{isa:?}: 2^(2 ({x} - m)) = {got}, want {want}");
                }
            }
            let rel = (f64::from(sums[0]) - want_sum[0]).abs() / want_sum[0];
            assert!(
                rel < 1e-6,
                "{isa:?}: row sum {} want {}",
                sums[0],
                want_sum[0]
            );
            assert!(
                sums[1].is_nan(),
                "{isa:?}: a NaN score makes its row's sum NaN"
            );
        }
    }

    #[test]
    fn ds_tile_recomputes_probabilities_and_ds() {
        for isa in isas() {
            let (_, ds) = addresses(isa);
            // SAFETY: `addresses` returns a `ds_tile` with this signature.
            let ds: DsTile = unsafe { std::mem::transmute::<usize, DsTile>(ds) };
            for with_delta in [true, false] {
                let input = scores();
                let dp_in: Vec<f32> = (0..2 * K).map(|i| (i as f32 * 0.37).sin()).collect();
                let (mut s, mut dp) = (input.clone(), dp_in.clone());
                let lse = [3.0f32, f32::NEG_INFINITY];
                let delta = [0.25f32, 0.5];
                let delta_ptr = if with_delta {
                    delta.as_ptr()
                } else {
                    std::ptr::null()
                };
                // SAFETY: two rows of K scores and dP values, two lse and D values.
                unsafe {
                    ds(
                        s.as_mut_ptr(),
                        dp.as_mut_ptr(),
                        2,
                        lse.as_ptr(),
                        delta_ptr,
                        1.5,
                    )
                };
                for c in 0..K {
                    let h = lse[0] * LSE_TO_HALF;
                    let p = (2.0 * f64::from(input[c] - h)).exp2();
                    let d = if with_delta { 0.25 } else { 0.0 };
                    let want_ds = p * (f64::from(dp_in[c]) - d) * 1.5;
                    assert!(
                        (f64::from(s[c]) - p).abs() <= 3e-7 * p + 1e-37,
                        "{isa:?} P[{c}]"
                    );
                    assert!(
                        (f64::from(dp[c]) - want_ds).abs() <= 1e-6 * want_ds.abs() + 1e-30,
                        "{isa:?} dS[{c}] = {} want {want_ds}",
                        dp[c]
                    );
                }
                assert!(
                    s[K..].iter().chain(&dp[K..]).all(|&x| x == 0.0),
                    "{isa:?}: a row with lse -inf carries nothing, even past a NaN score"
                );
            }
        }
    }

    /// The sigmoid passes on every instruction set: weights and their derivative against f64,
    /// a masked key's `-inf` weighing exactly 0, a NaN staying NaN, huge scores weighing 1.
    #[test]
    fn sigmoid_tiles_match_f64_on_every_instruction_set() {
        for isa in isas() {
            let (exp, ds) = sigmoid_addresses(isa);
            // SAFETY: `sigmoid_addresses` returns functions with these signatures.
            let (exp, ds) = unsafe {
                (
                    std::mem::transmute::<usize, ExpTile>(exp),
                    std::mem::transmute::<usize, DsTile>(ds),
                )
            };
            let mut input = scores();
            input[9] = 1e30;
            let mut s = input.clone();
            let mut sums = [1.0f32, 0.0];
            // SAFETY: two rows of K scores, two sums; the shift is not read.
            unsafe { exp(s.as_mut_ptr(), 2, std::ptr::null(), sums.as_mut_ptr()) };
            let sigmoid =
                |t: f32| 1.0 / (1.0 + (-2.0 * f64::from(t) * std::f64::consts::LN_2).exp());
            let mut want_sum = 1.0f64;
            for c in 0..K {
                let want = sigmoid(input[c]);
                want_sum += want;
                assert!(
                    (f64::from(s[c]) - want).abs() <= 4e-7 * want + 1e-38,
                    "{isa:?}: sigmoid({}) = {}, want {want}",
                    input[c],
                    s[c]
                );
            }
            assert_eq!(s[3], 0.0, "{isa:?}: -inf weighs exactly 0");
            assert_eq!(s[9], 1.0, "{isa:?}: a huge score weighs 1");
            assert!((f64::from(sums[0]) - want_sum).abs() < 1e-6 * want_sum);
            assert!(s[K + 7].is_nan() && sums[1].is_nan(), "{isa:?}: NaN stays");

            let dp_in: Vec<f32> = (0..2 * K).map(|i| (i as f32 * 0.37).sin()).collect();
            let (mut s, mut dp) = (input.clone(), dp_in.clone());
            // SAFETY: two rows of K scores and dP values; lse and delta are not read.
            unsafe {
                ds(
                    s.as_mut_ptr(),
                    dp.as_mut_ptr(),
                    2,
                    std::ptr::null(),
                    std::ptr::null(),
                    1.5,
                )
            };
            for c in 0..K {
                let p = sigmoid(input[c]);
                let want = f64::from(dp_in[c]) * p * (1.0 - p) * 1.5;
                assert!(
                    (f64::from(dp[c]) - want).abs() <= 1e-6 * want.abs() + 1e-30,
                    "{isa:?}: dS[{c}] = {} want {want}",
                    dp[c]
                );
            }
            assert_eq!(
                (s[3], dp[3]),
                (0.0, 0.0),
                "{isa:?}: a masked key carries nothing"
            );
        }
    }
}
