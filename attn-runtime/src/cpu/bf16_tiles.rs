//! The forward's `pv_tile` on `vdpbf16ps` for bf16 specs on CPUs with avx512_bf16
//! ([`Isa::Avx512Bf16`]): the contract of the f32 microkernel (`microkernels.rs`) with the
//! probabilities and the values rounded to bf16 (to nearest even) as they enter the product,
//! and f32 sums: what PyTorch's bf16 attention and FlashAttention multiply in `P V`. Each
//! instruction multiplies sixteen pairs and adds both products to an f32 lane, twice an f32
//! FMA's work.
//!
//! Scores stay on the f32 `qk_tile`: the kernel scales the queries (and rotates them and the
//! keys) in f32 before the product, so rounding them to bf16 there would move the scores by
//! about 2^-9 of their size, past the log-sum-exp's 1e-4 tolerance against the fixtures.
//!
//! Each value panel (pairs of keys by 64 value dims) is rounded once per call into a buffer on
//! the stack and reused by every row; each row of probabilities is rounded as it is taken.

use super::microkernels::Isa;
use attn_dsl::DType;
use codegen::plan::K_TILE;

const K: usize = K_TILE as usize;

/// The signature of `pv_tile`.
#[cfg(target_arch = "x86_64")]
type Pv = unsafe extern "C" fn(*const f32, i64, i64, *const f32, i64, *mut f32, i64);

/// `pv_tile` on `vdpbf16ps` for a spec of `dtype`, as a C-ABI address; `None` unless `isa` is
/// [`Isa::Avx512Bf16`] (on a CPU that has it) and the spec is bf16.
pub fn pv_address(isa: Isa, dtype: DType) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Bf16 && isa.runs_here() && dtype == DType::Bf16 {
        let pv: Pv = x86::pv_bf16;
        return Some(pv as usize);
    }
    let _ = (isa, dtype);
    None
}

#[cfg(target_arch = "x86_64")]
// Index loops mirror the register blocking (rows x vectors), as in `microkernels.rs`.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use super::K;
    use crate::cpu::bf16_gemm::x86::{round_lanes, round_pairs};
    use std::arch::x86_64::*;

    /// Rows per step.
    const R: usize = 6;

    /// The rows of the next step when `left` remain: six, then two, then one at a time (the
    /// register blockings compiled).
    fn step(left: usize) -> usize {
        match left {
            R.. => R,
            2.. => 2,
            _ => 1,
        }
    }

    /// 512 bits of bf16 pairs as the type `vdpbf16ps` takes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn bh(v: __m512i) -> __m512bh {
        // SAFETY: both are 512 bits of plain data.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// Lanes `a` (low halves) and `b` (high halves) rounded to bf16 and paired.
    ///
    /// # Safety
    /// AVX-512F must be present.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn pair(a: __m512, b: __m512) -> __m512i {
        let (a, b) = (round_lanes(a), round_lanes(b));
        _mm512_or_si512(a, _mm512_slli_epi32::<16>(b))
    }

    /// `pv_tile` (module contract of `microkernels.rs`) on `vdpbf16ps`, in panels of 64 value
    /// dims.
    ///
    /// # Safety
    /// The `pv_tile` contract, on a CPU with AVX-512F, BW and BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe extern "C" fn pv_bf16(
        p: *const f32,
        rows: i64,
        cols: i64,
        v: *const f32,
        v_stride: i64,
        acc: *mut f32,
        dv: i64,
    ) {
        let (rows, cols, vs, dv) = (rows as usize, cols as usize, v_stride as usize, dv as usize);
        let pairs = cols.div_ceil(2);
        // Each row's weights, rounded to pairs of keys.
        let mut wp = [[0u32; K / 2]; R];
        // vp[t * 64 + c]: the panel's value dim c of keys 2t and 2t + 1.
        let mut vp = [0u32; K / 2 * 64];
        for c0 in (0..dv).step_by(64) {
            let width = (dv - c0).min(64);
            let masks: [__mmask16; 4] = [0, 1, 2, 3].map(|g| {
                let lanes = width.saturating_sub(16 * g).min(16);
                ((1u32 << lanes) - 1) as __mmask16
            });
            // SAFETY: keys below `cols` (the odd one past an odd end reads as zero) and value
            // dims below `dv` (masked) of `v` (the contract).
            unsafe {
                for t in 0..pairs {
                    for g in 0..4 {
                        let at = |j: usize| v.add(j * vs + c0 + 16 * g);
                        let lo = _mm512_maskz_loadu_ps(masks[g], at(2 * t));
                        let hi = match 2 * t + 1 < cols {
                            true => _mm512_maskz_loadu_ps(masks[g], at(2 * t + 1)),
                            false => _mm512_setzero_ps(),
                        };
                        let to = vp.as_mut_ptr().add(t * 64 + 16 * g);
                        _mm512_storeu_si512(to.cast(), pair(lo, hi));
                    }
                }
            }
            let panel = Panel {
                vp: &vp,
                pairs,
                acc: acc.wrapping_add(c0),
                dv,
                masks,
            };
            let mut r = 0;
            while r < rows {
                let n = step(rows - r);
                for i in 0..n {
                    // SAFETY: row r + i < rows of `p` holds K >= cols values (the contract).
                    let row = unsafe { std::slice::from_raw_parts(p.add((r + i) * K), cols) };
                    // SAFETY: AVX-512F and BW are present; `pairs` pairs fit a row of `cols`.
                    unsafe { round_pairs(row, &mut wp[i][..pairs]) };
                }
                // SAFETY: rows r..r + n < rows of `acc`, at the panel's masked dims.
                unsafe {
                    match n {
                        R => pv_rows::<R>(&panel, &wp, r),
                        2 => pv_rows::<2>(&panel, &wp, r),
                        _ => pv_rows::<1>(&panel, &wp, r),
                    }
                }
                r += n;
            }
        }
    }

    /// One panel of 64 value dims (masked past `dv`) of `pv_bf16`.
    struct Panel<'a> {
        vp: &'a [u32; K / 2 * 64],
        pairs: usize,
        acc: *mut f32,
        dv: usize,
        masks: [__mmask16; 4],
    }

    /// Rows `r..r + N` of a panel from their rounded weights `wp`.
    ///
    /// # Safety
    /// As [`pv_bf16`], with `r + N <= rows`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn pv_rows<const N: usize>(x: &Panel, wp: &[[u32; K / 2]], r: usize) {
        // SAFETY: rows r..r + N of `acc`, lanes masked to the panel's dims; pairs t < pairs
        // <= K / 2 inside `vp`.
        unsafe {
            let mut a = [[_mm512_setzero_ps(); 4]; N];
            for i in 0..N {
                for g in 0..4 {
                    let at = x.acc.add((r + i) * x.dv + 16 * g);
                    a[i][g] = _mm512_maskz_loadu_ps(x.masks[g], at);
                }
            }
            for t in 0..x.pairs {
                let vals = [0, 16, 32, 48]
                    .map(|o| bh(_mm512_loadu_si512(x.vp.as_ptr().add(t * 64 + o).cast())));
                for i in 0..N {
                    let w = bh(_mm512_set1_epi32(wp[i][t] as i32));
                    for g in 0..4 {
                        a[i][g] = _mm512_dpbf16_ps(a[i][g], vals[g], w);
                    }
                }
            }
            for i in 0..N {
                for g in 0..4 {
                    let at = x.acc.add((r + i) * x.dv + 16 * g);
                    _mm512_mask_storeu_ps(at, x.masks[g], a[i][g]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::gemv::round_to_bf16;

    fn value(i: usize, seed: usize) -> f32 {
        let h = (i.wrapping_mul(2654435761).wrapping_add(seed) >> 9) % 4001;
        h as f32 / 1000.0 - 2.0
    }

    fn pv_tile() -> Option<Pv> {
        let pv = pv_address(Isa::Avx512Bf16, DType::Bf16)?;
        // SAFETY: `pv_address` gives a function of this signature.
        Some(unsafe { std::mem::transmute::<usize, Pv>(pv) })
    }

    /// `acc` gains the f64 products of the weights and values rounded to bf16, for odd key
    /// counts, panels past one and masked at the edge, and rows around the blocking.
    #[test]
    fn pv_matches_the_product_of_rounded_operands() {
        for (rows, cols, dv) in [
            (1, 1, 1),
            (13, 7, 70),
            (6, 64, 64),
            (64, 64, 128),
            (3, 33, 200),
        ] {
            let Some(pv) = pv_tile() else {
                return; // no avx512_bf16 here
            };
            let v_stride = dv + 5;
            let p: Vec<f32> = (0..rows * K).map(|i| value(i, 3).abs() / 2.0).collect();
            let v: Vec<f32> = (0..cols * v_stride).map(|i| value(i, 4)).collect();
            let start: Vec<f32> = (0..rows * dv).map(|i| value(i, 5)).collect();
            let mut acc = start.clone();
            // SAFETY: the buffers hold the contract's ranges for rows, cols and dv.
            unsafe {
                pv(
                    p.as_ptr(),
                    rows as i64,
                    cols as i64,
                    v.as_ptr(),
                    v_stride as i64,
                    acc.as_mut_ptr(),
                    dv as i64,
                )
            };
            for r in 0..rows {
                for c in 0..dv {
                    let sum: f64 = (0..cols)
                        .map(|j| {
                            round_to_bf16(p[r * K + j]) as f64
                                * round_to_bf16(v[j * v_stride + c]) as f64
                        })
                        .sum();
                    let want = start[r * dv + c] as f64 + sum;
                    let got = acc[r * dv + c] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (cols as f64).sqrt() * (1.0 + want.abs()),
                        "rows {rows} cols {cols} dv {dv} [{r}, {c}]: {got} against {want}"
                    );
                }
            }
        }
    }

    /// Other instruction sets and other dtypes keep the f32 microkernel.
    #[test]
    fn only_bf16_specs_on_avx512_bf16_take_it() {
        assert!(pv_address(Isa::Avx512, DType::Bf16).is_none());
        assert!(pv_address(Isa::Avx512Bf16, DType::F32).is_none());
        assert!(pv_address(Isa::Avx512Bf16, DType::F16).is_none());
    }
}
