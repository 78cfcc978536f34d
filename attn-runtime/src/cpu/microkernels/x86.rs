//! The x86-64 microkernels: AVX-512 (with `avx512_bf16` products) and AVX2 with FMA, each
//! under `#[target_feature]`, chosen at run time by the CPU's features.

// Index loops mirror the register blocking (rows x vectors) and keep the accumulators in
// registers; iterator chains over two arrays would obscure that.
#![allow(clippy::needless_range_loop)]

use super::{K, Weights};
use std::arch::x86_64::*;
use std::ptr::null;

/// AVX-512 `qk_tile`: six rows by 64 keys (24 accumulators) per step.
///
/// # Safety
/// The module contract, on a CPU with AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe extern "C" fn qk_avx512(
    q: *const f32,
    q_stride: i64,
    rows: i64,
    dim: i64,
    kt: *const f32,
    s: *mut f32,
    row_max: *mut f32,
) {
    let (rows, dim, qs) = (rows as usize, dim as usize, q_stride as usize);
    let mut r = 0;
    // SAFETY: rows r..r+R < `rows`; the callee stays within d < `dim` and K key lanes.
    unsafe {
        while r + 6 <= rows {
            qk_rows::<6>(q, qs, dim, kt, s, row_max, r);
            r += 6;
        }
        while r + 2 <= rows {
            qk_rows::<2>(q, qs, dim, kt, s, row_max, r);
            r += 2;
        }
        while r < rows {
            qk_rows::<1>(q, qs, dim, kt, s, row_max, r);
            r += 1;
        }
    }
}

/// Rows `r..r+R` of `qk_tile`; `R` is a constant so the `4R` accumulators stay in registers.
///
/// # Safety
/// As [`qk_avx512`], with `r + R <= rows`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn qk_rows<const R: usize>(
    q: *const f32,
    qs: usize,
    dim: usize,
    kt: *const f32,
    s: *mut f32,
    row_max: *mut f32,
    r: usize,
) {
    // SAFETY: rows r..r+R, d < dim, key lanes < K (the module contract).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for d in 0..dim {
            let kd = kt.add(d * K);
            let k = [0, 16, 32, 48].map(|o| _mm512_loadu_ps(kd.add(o)));
            for i in 0..R {
                let x = _mm512_set1_ps(*q.add((r + i) * qs + d));
                for j in 0..4 {
                    acc[i][j] = _mm512_fmadd_ps(x, k[j], acc[i][j]);
                }
            }
        }
        for i in 0..R {
            for j in 0..4 {
                _mm512_storeu_ps(s.add((r + i) * K + 16 * j), acc[i][j]);
            }
            if !row_max.is_null() {
                let m01 = _mm512_max_ps(acc[i][0], acc[i][1]);
                let m23 = _mm512_max_ps(acc[i][2], acc[i][3]);
                *row_max.add(r + i) = _mm512_reduce_max_ps(_mm512_max_ps(m01, m23));
            }
        }
    }
}

/// AVX-512 `pv_tile`: six rows by up to 64 value dims per step, masked at the dim edge.
///
/// # Safety
/// The module contract, on a CPU with AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe extern "C" fn pv_avx512(
    p: *const f32,
    rows: i64,
    cols: i64,
    v: *const f32,
    v_stride: i64,
    acc: *mut f32,
    dv: i64,
) {
    // SAFETY: the module contract, on a CPU with AVX-512F.
    unsafe {
        pv_avx512_with(
            Weights::<false> { p },
            rows,
            cols,
            v,
            v_stride,
            acc,
            dv,
            null(),
        )
    }
}

/// AVX-512 transposed `pv_tile` (`super::transposed_pv`).
///
/// # Safety
/// The contract of `transposed_pv`, on a CPU with AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe extern "C" fn pt_avx512(
    p: *const f32,
    rows: i64,
    cols: i64,
    v: *const f32,
    v_stride: i64,
    acc: *mut f32,
    dv: i64,
) {
    // SAFETY: the contract of `transposed_pv`, on a CPU with AVX-512F.
    unsafe {
        pv_avx512_with(
            Weights::<true> { p },
            rows,
            cols,
            v,
            v_stride,
            acc,
            dv,
            null(),
        )
    }
}

/// AVX-512 spanned `pv_tile`, transposed when `T` (`super::spanned_pv`).
///
/// # Safety
/// The contract of `spanned_pv`, on a CPU with AVX-512F.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
pub unsafe extern "C" fn spanned_avx512<const T: bool>(
    p: *const f32,
    rows: i64,
    cols: i64,
    v: *const f32,
    v_stride: i64,
    acc: *mut f32,
    dv: i64,
    spans: *const u32,
) {
    let w = Weights::<T> { p };
    // SAFETY: the contract of `spanned_pv`, on a CPU with AVX-512F.
    unsafe { pv_avx512_with(w, rows, cols, v, v_stride, acc, dv, spans) }
}

/// # Safety
/// As `pv_avx512` or `pt_avx512`, by `w`'s layout; `spans` null or as `spanned_pv` says.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn pv_avx512_with<const T: bool>(
    w: Weights<T>,
    rows: i64,
    cols: i64,
    v: *const f32,
    v_stride: i64,
    acc: *mut f32,
    dv: i64,
    spans: *const u32,
) {
    let (rows, dv) = (rows as usize, dv as usize);
    let mut c0 = 0;
    while c0 < dv {
        let width = (dv - c0).min(64);
        let masks: [__mmask16; 4] = [0, 1, 2, 3].map(|k| {
            let lanes = width.saturating_sub(16 * k).min(16);
            ((1u32 << lanes) - 1) as __mmask16
        });
        let panel = Panel {
            w,
            cols: cols as usize,
            spans,
            v: v.wrapping_add(c0),
            v_stride: v_stride as usize,
            acc: acc.wrapping_add(c0),
            dv,
            masks,
        };
        // SAFETY: the panel addresses the contract's ranges.
        unsafe {
            if width == 64 {
                pv_panel::<false, T>(&panel, rows);
            } else {
                pv_panel::<true, T>(&panel, rows);
            }
        }
        c0 += 64;
    }
}

/// One 64-dim panel of `pv_tile`: value columns `c0..c0+64` (masked past `dv`).
struct Panel<const T: bool> {
    w: Weights<T>,
    cols: usize,
    /// Null, or per row the range of keys outside which its weights are zero.
    spans: *const u32,
    v: *const f32,
    v_stride: usize,
    acc: *mut f32,
    dv: usize,
    masks: [__mmask16; 4],
}

impl<const T: bool> Panel<T> {
    /// The keys rows `r..r + n` sum over: every key, or the union of their spans.
    ///
    /// # Safety
    /// `spans` is null or holds the spans of rows `r..r + n`.
    unsafe fn keys(&self, r: usize, n: usize) -> std::ops::Range<usize> {
        if self.spans.is_null() {
            return 0..self.cols;
        }
        // SAFETY: the caller's contract.
        let spans = unsafe { std::slice::from_raw_parts(self.spans.add(2 * r), 2 * n) };
        let live = || spans.chunks_exact(2).filter(|s| s[0] < s[1]);
        let lo = live().map(|s| s[0]).min().unwrap_or(0) as usize;
        let hi = live().map(|s| s[1]).max().unwrap_or(0) as usize;
        lo.min(hi)..hi.min(self.cols)
    }
}

/// All `rows` of a panel, six at a time. `MASKED` panels are narrower than 64 dims; full ones
/// load without masks, since a masked load costs an extra vector uop, on the ports the FMAs
/// need.
///
/// # Safety
/// As [`pv_avx512`]; a panel that is not `MASKED` is 64 dims wide.
#[target_feature(enable = "avx512f")]
unsafe fn pv_panel<const MASKED: bool, const T: bool>(panel: &Panel<T>, rows: usize) {
    let mut r = 0;
    // SAFETY: rows r..r+R < `rows` and the panel addresses the contract's ranges.
    unsafe {
        while r + 6 <= rows {
            pv_rows::<6, MASKED, T>(panel, r);
            r += 6;
        }
        while r + 2 <= rows {
            pv_rows::<2, MASKED, T>(panel, r);
            r += 2;
        }
        while r < rows {
            pv_rows::<1, MASKED, T>(panel, r);
            r += 1;
        }
    }
}

/// Rows `r..r+R` of a panel; `R` is a constant so the `4R` accumulators stay in registers.
///
/// # Safety
/// As [`pv_panel`], with `r + R <= rows`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn pv_rows<const R: usize, const MASKED: bool, const T: bool>(x: &Panel<T>, r: usize) {
    // SAFETY: rows r..r+R, keys j < cols, value lanes masked to the panel's width.
    unsafe {
        let load = |at: *const f32, k: usize| {
            if MASKED {
                _mm512_maskz_loadu_ps(x.masks[k], at)
            } else {
                _mm512_loadu_ps(at)
            }
        };
        let mut a = [[_mm512_setzero_ps(); 4]; R];
        for i in 0..R {
            for k in 0..4 {
                a[i][k] = load(x.acc.add((r + i) * x.dv + 16 * k), k);
            }
        }
        for j in x.keys(r, R) {
            let vj = x.v.add(j * x.v_stride);
            let vals = [0, 1, 2, 3].map(|k| load(vj.add(16 * k), k));
            for i in 0..R {
                let w = _mm512_set1_ps(x.w.at(r + i, j));
                for k in 0..4 {
                    a[i][k] = _mm512_fmadd_ps(w, vals[k], a[i][k]);
                }
            }
        }
        for i in 0..R {
            for k in 0..4 {
                let at = x.acc.add((r + i) * x.dv + 16 * k);
                if MASKED {
                    _mm512_mask_storeu_ps(at, x.masks[k], a[i][k]);
                } else {
                    _mm512_storeu_ps(at, a[i][k]);
                }
            }
        }
    }
}

/// AVX2 `qk_tile`: two rows by 32 keys (8 accumulators) per step, two halves per tile.
///
/// # Safety
/// The module contract, on a CPU with AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe extern "C" fn qk_avx2(
    q: *const f32,
    q_stride: i64,
    rows: i64,
    dim: i64,
    kt: *const f32,
    s: *mut f32,
    row_max: *mut f32,
) {
    let (rows, dim, qs) = (rows as usize, dim as usize, q_stride as usize);
    // SAFETY: rows r..r+R < `rows`; the callee stays within d < `dim` and K key lanes.
    unsafe {
        for half in [0, 32] {
            let mut r = 0;
            while r + 2 <= rows {
                qk_rows_avx2::<2>(q, qs, dim, kt, s, r, half);
                r += 2;
            }
            if r < rows {
                qk_rows_avx2::<1>(q, qs, dim, kt, s, r, half);
            }
        }
        if !row_max.is_null() {
            for r in 0..rows {
                let row = std::slice::from_raw_parts(s.add(r * K), K);
                *row_max.add(r) = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            }
        }
    }
}

/// Rows `r..r+R`, keys `half..half+32` of the AVX2 `qk_tile`.
///
/// # Safety
/// As [`qk_avx2`], with `r + R <= rows` and `half` 0 or 32.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn qk_rows_avx2<const R: usize>(
    q: *const f32,
    qs: usize,
    dim: usize,
    kt: *const f32,
    s: *mut f32,
    r: usize,
    half: usize,
) {
    // SAFETY: rows r..r+R, d < dim, key lanes half..half+32 < K.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        for d in 0..dim {
            let kd = kt.add(d * K + half);
            let k = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(kd.add(o)));
            for i in 0..R {
                let x = _mm256_set1_ps(*q.add((r + i) * qs + d));
                for j in 0..4 {
                    acc[i][j] = _mm256_fmadd_ps(x, k[j], acc[i][j]);
                }
            }
        }
        for i in 0..R {
            for j in 0..4 {
                _mm256_storeu_ps(s.add((r + i) * K + half + 8 * j), acc[i][j]);
            }
        }
    }
}

/// AVX2 `pv_tile`: two rows by 32 value dims per step; the dim tail in scalar code.
///
/// # Safety
/// The module contract, on a CPU with AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe extern "C" fn pv_avx2(
    p: *const f32,
    rows: i64,
    cols: i64,
    v: *const f32,
    v_stride: i64,
    acc: *mut f32,
    dv: i64,
) {
    // SAFETY: the module contract, on a CPU with AVX2 and FMA.
    unsafe { pv_avx2_with(Weights::<false> { p }, rows, cols, v, v_stride, acc, dv) }
}

/// AVX2 transposed `pv_tile` (`super::transposed_pv`).
///
/// # Safety
/// The contract of `transposed_pv`, on a CPU with AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe extern "C" fn pt_avx2(
    p: *const f32,
    rows: i64,
    cols: i64,
    v: *const f32,
    v_stride: i64,
    acc: *mut f32,
    dv: i64,
) {
    // SAFETY: the contract of `transposed_pv`, on a CPU with AVX2 and FMA.
    unsafe { pv_avx2_with(Weights::<true> { p }, rows, cols, v, v_stride, acc, dv) }
}

/// # Safety
/// As `pv_avx2` or `pt_avx2`, by `w`'s layout.
#[target_feature(enable = "avx2,fma")]
unsafe fn pv_avx2_with<const T: bool>(
    p: Weights<T>,
    rows: i64,
    cols: i64,
    v: *const f32,
    v_stride: i64,
    acc: *mut f32,
    dv: i64,
) {
    let (rows, cols, vs, dv) = (rows as usize, cols as usize, v_stride as usize, dv as usize);
    let vec_dims = dv / 32 * 32;
    // SAFETY: rows r..r+R < `rows`, keys j < `cols`, dims < `dv` (the module contract).
    unsafe {
        for c0 in (0..vec_dims).step_by(32) {
            let mut r = 0;
            while r + 2 <= rows {
                pv_rows_avx2::<2, T>(p, cols, v.add(c0), vs, acc.add(c0), dv, r);
                r += 2;
            }
            if r < rows {
                pv_rows_avx2::<1, T>(p, cols, v.add(c0), vs, acc.add(c0), dv, r);
            }
        }
        for r in 0..rows {
            for j in 0..cols {
                let w = p.at(r, j);
                for c in vec_dims..dv {
                    *acc.add(r * dv + c) += w * *v.add(j * vs + c);
                }
            }
        }
    }
}

/// Rows `r..r+R` of a 32-dim panel of the AVX2 `pv_tile`.
///
/// # Safety
/// As [`pv_avx2`], with `r + R <= rows` and 32 dims from `v` and `acc`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn pv_rows_avx2<const R: usize, const T: bool>(
    p: Weights<T>,
    cols: usize,
    v: *const f32,
    vs: usize,
    acc: *mut f32,
    dv: usize,
    r: usize,
) {
    // SAFETY: rows r..r+R, keys j < cols, 32 dims of the panel.
    unsafe {
        let mut a = [[_mm256_setzero_ps(); 4]; R];
        for i in 0..R {
            for k in 0..4 {
                a[i][k] = _mm256_loadu_ps(acc.add((r + i) * dv + 8 * k));
            }
        }
        for j in 0..cols {
            let vj = v.add(j * vs);
            let x = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(vj.add(o)));
            for i in 0..R {
                let w = _mm256_set1_ps(p.at(r + i, j));
                for k in 0..4 {
                    a[i][k] = _mm256_fmadd_ps(w, x[k], a[i][k]);
                }
            }
        }
        for i in 0..R {
            for k in 0..4 {
                _mm256_storeu_ps(acc.add((r + i) * dv + 8 * k), a[i][k]);
            }
        }
    }
}
