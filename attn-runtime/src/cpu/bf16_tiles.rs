//! The forward's tile products on `vdpbf16ps` for bf16 specs on CPUs with avx512_bf16
//! ([`Isa::Avx512Bf16`]), with the contracts of the f32 microkernels (`microkernels/mod.rs`) and
//! f32 sums. Each instruction multiplies sixteen pairs and adds both products to an f32 lane,
//! twice an f32 FMA's work.
//!
//! - `pv_tile`: the probabilities and the values rounded to bf16 (to nearest even) as they
//!   enter the product, what PyTorch's bf16 attention and FlashAttention multiply in `P V`.
//!   Each value panel (pairs of keys by 64 value dims) is rounded once per call into a buffer
//!   on the stack and reused by every row; each row of probabilities is rounded once per call.
//! - `qk_tile`, only for kernels that multiply the queries and keys as given and scale the
//!   scores after ([`codegen::cpu::scales_scores`]: no RoPE, no MLA), whose operands are bf16
//!   values already, so the products are exact and pairing them takes their upper halves (no
//!   rounding). The key tile is packed once per call into pairs of dims by 64 keys; each row's
//!   queries are paired as taken. (Rotated or scaled
//!   queries rounded to bf16 would move the scores by about 2^-9 of their size, past the
//!   log-sum-exp's 1e-4 tolerance against the fixtures.)

use super::microkernels::Isa;
use attn_dsl::DType;
use codegen::plan::K_TILE;

const K: usize = K_TILE as usize;

/// The signature of `pv_tile`.
#[cfg(target_arch = "x86_64")]
type Pv = unsafe extern "C" fn(*const f32, i64, i64, *const f32, i64, *mut f32, i64);

/// The signature of `qk_tile`.
#[cfg(target_arch = "x86_64")]
type Qk = unsafe extern "C" fn(*const f32, i64, i64, i64, *const f32, *mut f32, *mut f32);

/// Widest score dim whose key pairs `qk_tile` packs on the stack (32 KiB); wider ones keep the
/// f32 microkernel.
const MAX_QK_DIM: usize = 256;

/// `qk_tile` on `vdpbf16ps` for a spec of `dtype` with scores `qk_dim` wide, as a C-ABI
/// address; `None` unless `isa` is [`Isa::Avx512Bf16`] (on a CPU that has it), the spec is
/// bf16 and `qk_dim` is at most 256. Its queries and keys must be bf16 values (the lower 16
/// bits of each f32 are dropped): the caller imports it only for kernels whose queries and
/// keys reach the product as given.
pub fn qk_address(isa: Isa, dtype: DType, qk_dim: usize) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Bf16 && isa.runs_here() && dtype == DType::Bf16 && qk_dim <= MAX_QK_DIM {
        let qk: Qk = x86::qk_bf16;
        return Some(qk as usize);
    }
    let _ = (isa, dtype, qk_dim);
    None
}

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
// Index loops mirror the register blocking (rows x vectors), as in `microkernels/x86.rs`.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use super::{K, MAX_QK_DIM};
    use crate::cpu::bf16_gemm::x86::{round_lanes, round_pairs};
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// Rows per step.
    const R: usize = 6;

    /// Rows whose weights `pv_bf16` rounds at once (a forward block's most, for D <= 128).
    const MAX_ROWS: usize = 256;

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

    /// `pv_tile` (module contract of `microkernels/mod.rs`) on `vdpbf16ps`, in panels of 64 value
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
        // Each row's weights, rounded to pairs of keys once for every panel.
        let mut wp = [[0u32; K / 2]; MAX_ROWS];
        // vp[t * 64 + c]: the panel's value dim c of keys 2t and 2t + 1.
        let mut vp = [0u32; K / 2 * 64];
        for r0 in (0..rows).step_by(MAX_ROWS) {
            let chunk = (rows - r0).min(MAX_ROWS);
            for (i, w) in wp[..chunk].iter_mut().enumerate() {
                // SAFETY: row r0 + i < rows of `p` holds K >= cols values (the contract).
                let row = unsafe { std::slice::from_raw_parts(p.add((r0 + i) * K), cols) };
                // SAFETY: AVX-512F and BW are present; `pairs` pairs fit a row of `cols`.
                unsafe { round_pairs(row, &mut w[..pairs]) };
            }
            for c0 in (0..dv).step_by(64) {
                let width = (dv - c0).min(64);
                let masks: [__mmask16; 4] = [0, 1, 2, 3].map(|g| {
                    let lanes = width.saturating_sub(16 * g).min(16);
                    ((1u32 << lanes) - 1) as __mmask16
                });
                // SAFETY: keys below `cols` (the odd one past an odd end reads as zero) and
                // value dims below `dv` (masked) of `v` (the contract).
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
                while r < chunk {
                    let n = step(chunk - r);
                    let (w, at) = (&wp[r..], r0 + r);
                    // SAFETY: rows at..at + n < rows of `acc`, at the panel's masked dims.
                    unsafe {
                        match n {
                            R => pv_rows::<R>(&panel, w, at),
                            2 => pv_rows::<2>(&panel, w, at),
                            _ => pv_rows::<1>(&panel, w, at),
                        }
                    }
                    r += n;
                }
            }
        }
    }

    /// Lanes `a` (low halves) and `b` (high halves) paired as bf16 by their upper 16 bits:
    /// exact for bf16 values, without rounding.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn pair_exact(a: __m512, b: __m512) -> __m512i {
        let low = _mm512_srli_epi32::<16>(_mm512_castps_si512(a));
        _mm512_mask_blend_epi16(0xaaaa_aaaa, low, _mm512_castps_si512(b))
    }

    /// A row of bf16 values held as f32 into pairs of consecutive values (`out` holds
    /// `row.len().div_ceil(2)` pairs rounded up to a whole vector of 16; past the row, zeros),
    /// by their upper 16 bits.
    ///
    /// # Safety
    /// AVX-512F and BW must be present; `out.len() >= row.len().div_ceil(32) * 16`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn pair_row(row: &[f32], out: &mut [u32]) {
        // Output half k is the upper half of value k: u16 index 2k + 1 of (a, b).
        let odd: [i16; 32] = std::array::from_fn(|k| (2 * k + 1) as i16);
        let mask = |n: usize| ((1u32 << n.min(16)) - 1) as __mmask16;
        // SAFETY: lanes past the row are masked off (read as zero); `out` holds 16 pairs per
        // 32 values (the caller).
        unsafe {
            let odd = _mm512_loadu_si512(odd.as_ptr().cast());
            for i in (0..row.len()).step_by(32) {
                let left = row.len() - i;
                let a = _mm512_maskz_loadu_ps(mask(left), row.as_ptr().add(i));
                let b = _mm512_maskz_loadu_ps(
                    mask(left.saturating_sub(16)),
                    row.as_ptr().wrapping_add(i + 16),
                );
                let halves =
                    _mm512_permutex2var_epi16(_mm512_castps_si512(a), odd, _mm512_castps_si512(b));
                _mm512_storeu_si512(out.as_mut_ptr().add(i / 2).cast(), halves);
            }
        }
    }

    /// `qk_tile` (module contract of `microkernels/mod.rs`) on `vdpbf16ps`, for `dim <=
    /// MAX_QK_DIM` and bf16 values in `q` and `kt`: the key tile paired by dims once per call,
    /// each row's queries paired as taken, six rows by 64 keys per step.
    ///
    /// # Safety
    /// The `qk_tile` contract with `dim <= MAX_QK_DIM`, on a CPU with AVX-512F, BW and BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe extern "C" fn qk_bf16(
        q: *const f32,
        q_stride: i64,
        rows: i64,
        dim: i64,
        kt: *const f32,
        s: *mut f32,
        row_max: *mut f32,
    ) {
        let (rows, dim, qs) = (rows as usize, dim as usize, q_stride as usize);
        assert!(dim <= MAX_QK_DIM, "qk_bf16 takes at most {MAX_QK_DIM} dims");
        let pairs = dim.div_ceil(2);
        // kp[t * K + j]: dims 2t and 2t + 1 of key j. Only the used part is written.
        let mut kp = [MaybeUninit::<u32>::uninit(); MAX_QK_DIM / 2 * K];
        // SAFETY: dims d < dim of the tile's K keys (`kt` rows of K, the contract); the odd
        // dim past an odd `dim` pairs with zero.
        unsafe {
            for t in 0..pairs {
                for g in 0..4 {
                    let lo = _mm512_loadu_ps(kt.add(2 * t * K + 16 * g));
                    let hi = match 2 * t + 1 < dim {
                        true => _mm512_loadu_ps(kt.add((2 * t + 1) * K + 16 * g)),
                        false => _mm512_setzero_ps(),
                    };
                    let to = kp.as_mut_ptr().add(t * K + 16 * g);
                    _mm512_storeu_si512(to.cast(), pair_exact(lo, hi));
                }
            }
        }
        // SAFETY: the first `pairs * K` values were all written above.
        let kp = unsafe { std::slice::from_raw_parts(kp.as_ptr().cast::<u32>(), pairs * K) };
        // Each row's query pairs (zeros past an odd `dim`).
        let mut qp = [[0u32; MAX_QK_DIM / 2]; R];
        let mut r = 0;
        while r < rows {
            let n = step(rows - r);
            for i in 0..n {
                // SAFETY: row r + i < rows of `q` holds `dim` values (the contract).
                let row = unsafe { std::slice::from_raw_parts(q.add((r + i) * qs), dim) };
                // SAFETY: AVX-512F and BW are present; a row of MAX_QK_DIM / 2 pairs holds
                // whole vectors of 16 for `dim <= MAX_QK_DIM` (a multiple of 32).
                unsafe { pair_row(row, &mut qp[i]) };
            }
            let out = Scores {
                kp,
                pairs,
                s,
                row_max,
            };
            // SAFETY: rows r..r + n < rows of `s` (and of `row_max` when not null).
            unsafe {
                match n {
                    R => qk_rows::<R>(&out, &qp, r),
                    2 => qk_rows::<2>(&out, &qp, r),
                    _ => qk_rows::<1>(&out, &qp, r),
                }
            }
            r += n;
        }
    }

    /// The packed key tile of `qk_bf16` and where its scores go.
    struct Scores<'a> {
        kp: &'a [u32],
        pairs: usize,
        s: *mut f32,
        row_max: *mut f32,
    }

    /// Scores of rows `r..r + N` from their query pairs `qp`.
    ///
    /// # Safety
    /// As [`qk_bf16`], with `r + N <= rows`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn qk_rows<const N: usize>(x: &Scores, qp: &[[u32; MAX_QK_DIM / 2]], r: usize) {
        // SAFETY: pairs t < pairs inside `kp`; rows r..r + N of `s` (K values each) and of
        // `row_max`.
        unsafe {
            let mut a = [[_mm512_setzero_ps(); 4]; N];
            accumulate(&mut a, x.kp, x.pairs, qp);
            for i in 0..N {
                for g in 0..4 {
                    _mm512_storeu_ps(x.s.add((r + i) * K + 16 * g), a[i][g]);
                }
                if !x.row_max.is_null() {
                    let m01 = _mm512_max_ps(a[i][0], a[i][1]);
                    let m23 = _mm512_max_ps(a[i][2], a[i][3]);
                    *x.row_max.add(r + i) = _mm512_reduce_max_ps(_mm512_max_ps(m01, m23));
                }
            }
        }
    }

    /// The product both tiles run: `a[i][g]` gains, for pairs `t < pairs`, row `i`'s pair
    /// `w[i][t]` (broadcast) times lanes `16 g..16 g + 16` of the panel's pair row
    /// `panel[64 t..64 t + 64]`.
    ///
    /// # Safety
    /// `panel` holds `64 * pairs` values and each `w[i]` at least `pairs`; AVX-512F and BF16
    /// must be present.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn accumulate<const N: usize, const W: usize>(
        a: &mut [[__m512; 4]; N],
        panel: &[u32],
        pairs: usize,
        w: &[[u32; W]],
    ) {
        for t in 0..pairs {
            // SAFETY: 64 values of `panel` from 64 t (the caller).
            let cols = [0, 16, 32, 48]
                .map(|o| unsafe { bh(_mm512_loadu_si512(panel.as_ptr().add(64 * t + o).cast())) });
            for i in 0..N {
                let wi = bh(_mm512_set1_epi32(w[i][t] as i32));
                for g in 0..4 {
                    a[i][g] = _mm512_dpbf16_ps(a[i][g], cols[g], wi);
                }
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
            accumulate(&mut a, x.vp, x.pairs, wp);
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
    /// counts, panels past one and masked at the edge, and rows around the blocking and past
    /// the rows rounded at once.
    #[test]
    fn pv_matches_the_product_of_rounded_operands() {
        for (rows, cols, dv) in [
            (1, 1, 1),
            (13, 7, 70),
            (6, 64, 64),
            (64, 64, 128),
            (3, 33, 200),
            (300, 20, 70),
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

    /// Scores of bf16 queries and keys are their f64 products, for odd and the widest dims and
    /// rows around the blocking; the row maxima are the rows' largest scores, and a null
    /// `row_max` is left alone.
    #[test]
    fn qk_matches_the_product_of_bf16_operands() {
        let Some(qk) = qk_address(Isa::Avx512Bf16, DType::Bf16, MAX_QK_DIM) else {
            return; // no avx512_bf16 here
        };
        // SAFETY: `qk_address` gives a function of this signature.
        let qk = unsafe { std::mem::transmute::<usize, Qk>(qk) };
        for (rows, dim, with_max) in [
            (1, 1, true),
            (13, 7, true),
            (6, 128, false),
            (64, 256, true),
            (3, 33, true),
        ] {
            let q_stride = dim + 3;
            let q: Vec<f32> = (0..rows * q_stride)
                .map(|i| round_to_bf16(value(i, 1)))
                .collect();
            let kt: Vec<f32> = (0..dim * K).map(|i| round_to_bf16(value(i, 2))).collect();
            let mut s = vec![f32::NAN; rows * K];
            let mut row_max = vec![f32::NAN; rows];
            let max_ptr = match with_max {
                true => row_max.as_mut_ptr(),
                false => std::ptr::null_mut(),
            };
            // SAFETY: the buffers hold the contract's ranges for rows and dim.
            unsafe {
                qk(
                    q.as_ptr(),
                    q_stride as i64,
                    rows as i64,
                    dim as i64,
                    kt.as_ptr(),
                    s.as_mut_ptr(),
                    max_ptr,
                )
            };
            for r in 0..rows {
                let mut max = f64::NEG_INFINITY;
                for j in 0..K {
                    let want: f64 = (0..dim)
                        .map(|d| q[r * q_stride + d] as f64 * kt[d * K + j] as f64)
                        .sum();
                    let got = s[r * K + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (dim as f64).sqrt() * (1.0 + want.abs()),
                        "rows {rows} dim {dim} [{r}, {j}]: {got} against {want}"
                    );
                    max = max.max(got);
                }
                match with_max {
                    true => assert_eq!(row_max[r] as f64, max, "rows {rows} dim {dim} row {r}"),
                    false => assert!(row_max[r].is_nan(), "row_max written when null"),
                }
            }
        }
    }

    /// Other instruction sets, other dtypes and wider scores keep the f32 microkernels.
    #[test]
    fn only_bf16_specs_on_avx512_bf16_take_it() {
        assert!(pv_address(Isa::Avx512, DType::Bf16).is_none());
        assert!(pv_address(Isa::Avx512Bf16, DType::F32).is_none());
        assert!(pv_address(Isa::Avx512Bf16, DType::F16).is_none());
        assert!(qk_address(Isa::Avx512, DType::Bf16, 128).is_none());
        assert!(qk_address(Isa::Avx512Bf16, DType::F16, 128).is_none());
        assert!(qk_address(Isa::Avx512Bf16, DType::Bf16, MAX_QK_DIM + 1).is_none());
    }
}
