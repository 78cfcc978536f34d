//! The dense products of decode kernels, on keys and values read where a cache stores them (rows
//! of f32, bf16 or f16), converted to f32 in registers: `qk_rows` and `pv_rows`. AVX-512, or
//! portable Rust (also what AVX2-only CPUs use: decoding is bound by memory, not arithmetic).
//!
//! Contract (see `codegen::cpu::abi::Imports`): `qk_rows(q, q_stride, rows, dim, k, k_stride, n,
//! s, row_max, then, then_stride)` writes `s[r*K + j] = sum_d q[r*q_stride + d]
//! k[j*k_stride + d]` for `r < rows`, `j < n <= K`, and
//! `row_max[r] = max_{j < n} s[r*K + j]`; `pv_rows(p, rows, cols, v, v_stride, acc, dv, then,
//! then_stride)` adds `sum_{j < cols} p[r*K + j] * v[j*v_stride + c]` to `acc[r*dv + c]`.
//! `then` (rows `then_stride` elements apart, or null) is what the caller reads next, only ever
//! prefetched.

use super::microkernels::Isa;
use attn_dsl::DType;
use codegen::plan::K_TILE;
use half::{bf16, f16};

const K: usize = K_TILE as usize;

/// A storage element of a cache.
pub(crate) trait Elem: Copy {
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl Elem for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

type QkRows = unsafe extern "C" fn(
    *const f32,
    i64,
    i64,
    i64,
    *const u8,
    i64,
    i64,
    *mut f32,
    *mut f32,
    *const u8,
    i64,
);
type PvRows =
    unsafe extern "C" fn(*const f32, i64, i64, *const u8, i64, *mut f32, i64, *const u8, i64);

/// `qk_rows` and `pv_rows` for an instruction set and storage dtype, as C-ABI addresses.
pub fn addresses(isa: Isa, dtype: DType) -> (usize, usize) {
    let (qk, pv): (QkRows, PvRows) = match (isa.vectors(), dtype) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, DType::F32) => (x86::qk_rows::<f32>, x86::pv_rows::<f32>),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, DType::Bf16) => (x86::qk_rows::<bf16>, x86::pv_rows::<bf16>),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, DType::F16) => (x86::qk_rows::<f16>, x86::pv_rows::<f16>),
        (_, DType::F32) => (qk_portable::<f32>, pv_portable::<f32>),
        (_, DType::Bf16) => (qk_portable::<bf16>, pv_portable::<bf16>),
        (_, DType::F16) => (qk_portable::<f16>, pv_portable::<f16>),
    };
    (qk as usize, pv as usize)
}

/// Portable `qk_rows`.
///
/// # Safety
/// The pointers must address the ranges in the module contract, `k` holding elements `E`.
unsafe extern "C" fn qk_portable<E: Elem>(
    q: *const f32,
    q_stride: i64,
    rows: i64,
    dim: i64,
    k: *const u8,
    k_stride: i64,
    n: i64,
    s: *mut f32,
    row_max: *mut f32,
    _then: *const u8,
    _then_stride: i64,
) {
    let (rows, dim, q_stride, k_stride, n) = (
        rows as usize,
        dim as usize,
        q_stride as usize,
        k_stride as usize,
        n as usize,
    );
    if rows == 0 || n == 0 {
        return;
    }
    // SAFETY: the module contract: `rows` query rows, `n` key rows, `rows * K` scores and `rows`
    // maxima.
    let (q, k, s, row_max) = unsafe {
        (
            std::slice::from_raw_parts(q, (rows - 1) * q_stride + dim),
            std::slice::from_raw_parts(k.cast::<E>(), (n - 1) * k_stride + dim),
            std::slice::from_raw_parts_mut(s, rows * K),
            std::slice::from_raw_parts_mut(row_max, rows),
        )
    };
    for j in 0..n {
        let key: Vec<f32> = k[j * k_stride..j * k_stride + dim]
            .iter()
            .map(|x| x.to_f32())
            .collect();
        for r in 0..rows {
            let qr = &q[r * q_stride..r * q_stride + dim];
            s[r * K + j] = qr.iter().zip(&key).map(|(a, b)| a * b).sum();
        }
    }
    for r in 0..rows {
        row_max[r] = s[r * K..r * K + n]
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
    }
}

/// Portable `pv_rows`.
///
/// # Safety
/// The pointers must address the ranges in the module contract, `v` holding elements `E`.
unsafe extern "C" fn pv_portable<E: Elem>(
    p: *const f32,
    rows: i64,
    cols: i64,
    v: *const u8,
    v_stride: i64,
    acc: *mut f32,
    dv: i64,
    _then: *const u8,
    _then_stride: i64,
) {
    let (rows, cols, v_stride, dv) = (rows as usize, cols as usize, v_stride as usize, dv as usize);
    if rows == 0 || cols == 0 {
        return;
    }
    // SAFETY: the module contract: `rows * K` probabilities, `cols` value rows, `rows * dv` acc.
    let (p, v, acc) = unsafe {
        (
            std::slice::from_raw_parts(p, rows * K),
            std::slice::from_raw_parts(v.cast::<E>(), (cols - 1) * v_stride + dv),
            std::slice::from_raw_parts_mut(acc, rows * dv),
        )
    };
    for j in 0..cols {
        let value: Vec<f32> = v[j * v_stride..j * v_stride + dv]
            .iter()
            .map(|x| x.to_f32())
            .collect();
        for r in 0..rows {
            let w = p[r * K + j];
            for (o, x) in acc[r * dv..(r + 1) * dv].iter_mut().zip(&value) {
                *o += w * x;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
// Index loops mirror the register blocking (rows x vectors).
#[allow(clippy::needless_range_loop)]
pub(crate) mod x86 {
    use super::{Elem, K};
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Sixteen elements at `ptr` as f32 lanes; lanes at or past `count` (< 16 only at a row's
    /// end) are zero and not read.
    pub(crate) trait Load16: Elem {
        /// # Safety
        /// `ptr..ptr + count.min(16)` must be readable; AVX-512F must be present.
        unsafe fn load16(ptr: *const Self, count: usize) -> __m512;
    }

    /// How far ahead of the row being computed `qk_rows` and `pv_rows` prefetch (into L2), in
    /// bytes of rows: the hardware prefetcher restarts at every 4 KiB page (16 bf16 or 8 f32
    /// rows of 128), so without this a row's lines are asked for only when it is read.
    /// Measured at kv 32768 on a 2-core Xeon: f32 +20-40% and bf16 +50-70% over none, into L1
    /// a little worse for f32. Once the prefetch ran on into the rows read next ([`Ahead`]),
    /// 16 KiB beat 8 (bf16 14-16 -> 16-21 GB/s on a 2-core Zen 4) and 32 was worse.
    const PREFETCH_BYTES: usize = 16384;

    /// Where prefetching runs ahead of a kernel's rows: `PREFETCH_BYTES` further on, through its
    /// own rows and then the rows its caller reads next (a segment's values after its keys, the
    /// next segment's keys after the values), since the two are not adjacent in a paged cache.
    #[derive(Clone, Copy)]
    struct Ahead {
        own: *const u8,
        own_stride: usize,
        own_rows: usize,
        then: *const u8,
        then_stride: usize,
        /// Rows ahead.
        distance: usize,
    }

    impl Ahead {
        /// Rows `stride` elements `E` apart, `rows` of them, followed by `then`'s (null: none);
        /// rows of `row_bytes` set the distance.
        fn new<E>(
            own: *const E,
            stride: usize,
            rows: usize,
            (then, then_stride): (*const u8, i64),
            row_bytes: usize,
        ) -> Self {
            let size = size_of::<E>();
            Ahead {
                own: own.cast(),
                own_stride: stride * size,
                own_rows: rows,
                then,
                then_stride: (then_stride as usize).wrapping_mul(size),
                distance: (PREFETCH_BYTES / row_bytes.max(1)).max(1),
            }
        }

        /// The same rows from element `offset` of each (a panel of columns).
        fn columns<E>(self, offset: usize) -> Self {
            let skip = offset * size_of::<E>();
            Ahead {
                own: self.own.wrapping_add(skip),
                then: if self.then.is_null() {
                    self.then
                } else {
                    self.then.wrapping_add(skip)
                },
                ..self
            }
        }

        /// The row `distance` past row `j < own_rows`; `None` past the last when there is no
        /// `then`. Addresses are only computed (wrapping), never read.
        fn row(&self, j: usize) -> Option<*const u8> {
            let t = j + self.distance;
            if t < self.own_rows {
                Some(self.own.wrapping_add(t * self.own_stride))
            } else if self.then.is_null() {
                None
            } else {
                Some(
                    self.then
                        .wrapping_add((t - self.own_rows) * self.then_stride),
                )
            }
        }

        /// Prefetches `bytes` of the row `distance` past row `j`.
        fn prefetch(&self, j: usize, bytes: usize) {
            if let Some(row) = self.row(j) {
                prefetch_row(row, bytes);
            }
        }
    }

    /// Prefetches the `bytes` of a row at `ptr` into L2 (never faults, so the row may lie past
    /// the caller's: the address is only computed, with wrapping arithmetic).
    #[inline]
    fn prefetch_row(ptr: *const u8, bytes: usize) {
        let mut line = 0;
        while line < bytes {
            // SAFETY: a prefetch reads nothing the program can observe and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(ptr.wrapping_add(line).cast()) };
            line += 64;
        }
    }

    fn lane_mask(count: usize) -> __mmask16 {
        if count >= 16 {
            0xffff
        } else {
            ((1u32 << count) - 1) as __mmask16
        }
    }

    /// Sixteen 16-bit values, through a zeroed buffer at a row's end.
    ///
    /// # Safety
    /// As [`Load16::load16`].
    #[target_feature(enable = "avx512f")]
    unsafe fn load_halves(ptr: *const u16, count: usize) -> __m256i {
        // SAFETY: a full load reads 16 values the caller guarantees; a partial one copies only
        // `count` of them.
        unsafe {
            if count >= 16 {
                _mm256_loadu_si256(ptr.cast())
            } else {
                let mut buf = [0u16; 16];
                std::ptr::copy_nonoverlapping(ptr, buf.as_mut_ptr(), count);
                _mm256_loadu_si256(buf.as_ptr().cast())
            }
        }
    }

    impl Load16 for f32 {
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(ptr: *const f32, count: usize) -> __m512 {
            // SAFETY: masked lanes are not read.
            unsafe { _mm512_maskz_loadu_ps(lane_mask(count), ptr) }
        }
    }

    impl Load16 for bf16 {
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(ptr: *const bf16, count: usize) -> __m512 {
            // SAFETY: as `load_halves`; bf16 is the upper half of an f32.
            unsafe {
                let h = load_halves(ptr.cast(), count);
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
            }
        }
    }

    impl Load16 for f16 {
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(ptr: *const f16, count: usize) -> __m512 {
            // SAFETY: as `load_halves`.
            unsafe { _mm512_cvtph_ps(load_halves(ptr.cast(), count)) }
        }
    }

    /// AVX-512 `qk_rows`: each key row is read once per four query rows.
    ///
    /// # Safety
    /// The module contract, on a CPU with AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe extern "C" fn qk_rows<E: Load16>(
        q: *const f32,
        q_stride: i64,
        rows: i64,
        dim: i64,
        k: *const u8,
        k_stride: i64,
        n: i64,
        s: *mut f32,
        row_max: *mut f32,
        then: *const u8,
        then_stride: i64,
    ) {
        let (rows, dim, q_stride, k_stride, n) = (
            rows as usize,
            dim as usize,
            q_stride as usize,
            k_stride as usize,
            n as usize,
        );
        let k = k.cast::<E>();
        let row_bytes = dim * size_of::<E>();
        let x = Qk {
            q,
            q_stride,
            dim,
            k,
            k_stride,
            s,
            ahead: Ahead::new(k, k_stride, n, (then, then_stride), row_bytes),
        };
        // SAFETY: rows r < rows, keys j < n, dims d < dim (tails masked): the contract's ranges.
        unsafe {
            let mut j = 0;
            // Two keys at a time for blocks of four rows: each query vector loaded serves both
            // (with the prefetch, faster for f32 caches too).
            while j + 2 <= n {
                let mut r = 0;
                while r + 4 <= rows {
                    qk_four_rows_two_keys::<E>(&x, r, j);
                    r += 4;
                }
                while r < rows {
                    qk_group::<E, 1>(&x, r, j);
                    qk_group::<E, 1>(&x, r, j + 1);
                    r += 1;
                }
                j += 2;
            }
            while j < n {
                let mut r = 0;
                while r + 4 <= rows {
                    qk_group::<E, 4>(&x, r, j);
                    r += 4;
                }
                while r < rows {
                    qk_group::<E, 1>(&x, r, j);
                    r += 1;
                }
                j += 1;
            }
            for r in 0..rows {
                let mut m = f32::NEG_INFINITY;
                for j in 0..n {
                    m = m.max(*s.add(r * K + j));
                }
                *row_max.add(r) = m;
            }
        }
    }

    /// The operands of `qk_rows`.
    struct Qk<E> {
        q: *const f32,
        q_stride: usize,
        dim: usize,
        k: *const E,
        k_stride: usize,
        s: *mut f32,
        ahead: Ahead,
    }

    /// Scores of key `j` for rows `r..r+R`; `R` is a constant so the accumulators stay in
    /// registers.
    ///
    /// # Safety
    /// As [`qk_rows`], with `r + R <= rows` and `j < n`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn qk_group<E: Load16, const R: usize>(x: &Qk<E>, r: usize, j: usize) {
        // SAFETY: the caller's ranges.
        unsafe {
            let key = x.k.add(j * x.k_stride);
            if r == 0 {
                x.ahead.prefetch(j, x.dim * size_of::<E>());
            }
            let mut acc = [_mm512_setzero_ps(); R];
            let mut d = 0;
            while d < x.dim {
                let count = x.dim - d;
                let kv = E::load16(key.add(d), count);
                let mask = lane_mask(count);
                for i in 0..R {
                    let qv = _mm512_maskz_loadu_ps(mask, x.q.add((r + i) * x.q_stride + d));
                    acc[i] = _mm512_fmadd_ps(qv, kv, acc[i]);
                }
                d += 16;
            }
            for i in 0..R {
                *x.s.add((r + i) * K + j) = _mm512_reduce_add_ps(acc[i]);
            }
        }
    }

    /// Scores of keys `j` and `j + 1` for rows `r..r+4`: eight accumulators, the query vectors
    /// loaded once for both keys, and each key's four sums reduced together.
    ///
    /// # Safety
    /// As [`qk_rows`], with `r + 4 <= rows` and `j + 2 <= n`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn qk_four_rows_two_keys<E: Load16>(x: &Qk<E>, r: usize, j: usize) {
        // SAFETY: the caller's ranges.
        unsafe {
            let (key0, key1) = (x.k.add(j * x.k_stride), x.k.add((j + 1) * x.k_stride));
            if r == 0 {
                for key in [j, j + 1] {
                    x.ahead.prefetch(key, x.dim * size_of::<E>());
                }
            }
            let mut a0 = [_mm512_setzero_ps(); 4];
            let mut a1 = [_mm512_setzero_ps(); 4];
            let mut d = 0;
            while d < x.dim {
                let count = x.dim - d;
                let (k0, k1) = (E::load16(key0.add(d), count), E::load16(key1.add(d), count));
                let mask = lane_mask(count);
                for i in 0..4 {
                    let qv = _mm512_maskz_loadu_ps(mask, x.q.add((r + i) * x.q_stride + d));
                    a0[i] = _mm512_fmadd_ps(qv, k0, a0[i]);
                    a1[i] = _mm512_fmadd_ps(qv, k1, a1[i]);
                }
                d += 16;
            }
            for (key, acc) in [(j, a0), (j + 1, a1)] {
                let sums: [f32; 4] = std::mem::transmute(reduce4(acc));
                for (i, s) in sums.iter().enumerate() {
                    *x.s.add((r + i) * K + key) = *s;
                }
            }
        }
    }

    /// The four sums of four vectors, lane `i` of the result for vector `i`: halves added,
    /// then horizontal adds that pair the vectors up.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn reduce4(v: [__m512; 4]) -> __m128 {
        let half = |a: __m512| {
            _mm256_add_ps(
                _mm512_castps512_ps256(a),
                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)),
            )
        };
        let (h0, h1, h2, h3) = (half(v[0]), half(v[1]), half(v[2]), half(v[3]));
        // [v0 01, v0 23, v1 01, v1 23 | v0 45, v0 67, v1 45, v1 67], then the same for 2 and 3.
        let (p01, p23) = (_mm256_hadd_ps(h0, h1), _mm256_hadd_ps(h2, h3));
        // [v0 0-3, v1 0-3, v2 0-3, v3 0-3 | v0 4-7, v1 4-7, v2 4-7, v3 4-7].
        let q = _mm256_hadd_ps(p01, p23);
        _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1))
    }

    /// AVX-512 `pv_rows`: four rows by 64 value dims per step; each value row is read once per
    /// four query rows.
    ///
    /// # Safety
    /// The module contract, on a CPU with AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe extern "C" fn pv_rows<E: Load16>(
        p: *const f32,
        rows: i64,
        cols: i64,
        v: *const u8,
        v_stride: i64,
        acc: *mut f32,
        dv: i64,
        then: *const u8,
        then_stride: i64,
    ) {
        let (rows, cols, v_stride, dv) =
            (rows as usize, cols as usize, v_stride as usize, dv as usize);
        let v = v.cast::<E>();
        // Whole rows set the distance; each panel prefetches its own columns.
        let ahead = Ahead::new(v, v_stride, cols, (then, then_stride), dv * size_of::<E>());
        // SAFETY: rows r < rows, value rows j < cols, columns c < dv (tails masked).
        unsafe {
            let mut c0 = 0;
            while c0 < dv {
                let width = (dv - c0).min(64);
                let x = Pv {
                    p,
                    cols,
                    v: v.add(c0),
                    v_stride,
                    acc: acc.add(c0),
                    dv,
                    counts: [0, 1, 2, 3].map(|q| width.saturating_sub(16 * q).min(16)),
                    ahead: ahead.columns::<E>(c0),
                };
                let mut r = 0;
                while r + 4 <= rows {
                    pv_group::<E, 4>(&x, r);
                    r += 4;
                }
                while r < rows {
                    pv_group::<E, 1>(&x, r);
                    r += 1;
                }
                c0 += 64;
            }
        }
    }

    /// One 64-column panel of `pv_rows`.
    struct Pv<E> {
        p: *const f32,
        cols: usize,
        v: *const E,
        v_stride: usize,
        acc: *mut f32,
        dv: usize,
        /// Lanes of each of the panel's four vectors (0 past `dv`).
        counts: [usize; 4],
        ahead: Ahead,
    }

    /// Rows `r..r+R` of a panel; `R` is a constant so the `4R` accumulators stay in registers.
    ///
    /// # Safety
    /// As [`pv_rows`], with `r + R <= rows`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn pv_group<E: Load16, const R: usize>(x: &Pv<E>, r: usize) {
        // SAFETY: the caller's ranges; lanes past `counts` are neither read nor written.
        unsafe {
            let masks = x.counts.map(lane_mask);
            let mut a = [[_mm512_setzero_ps(); 4]; R];
            for i in 0..R {
                for q in 0..4 {
                    a[i][q] = _mm512_maskz_loadu_ps(masks[q], x.acc.add((r + i) * x.dv + 16 * q));
                }
            }
            for j in 0..x.cols {
                let row = x.v.add(j * x.v_stride);
                if r == 0 {
                    x.ahead
                        .prefetch(j, x.counts.iter().sum::<usize>() * size_of::<E>());
                }
                let mut vals = [_mm512_setzero_ps(); 4];
                for q in 0..4 {
                    if x.counts[q] > 0 {
                        vals[q] = E::load16(row.add(16 * q), x.counts[q]);
                    }
                }
                for i in 0..R {
                    let w = _mm512_set1_ps(*x.p.add((r + i) * K + j));
                    for q in 0..4 {
                        a[i][q] = _mm512_fmadd_ps(w, vals[q], a[i][q]);
                    }
                }
            }
            for i in 0..R {
                for q in 0..4 {
                    _mm512_mask_storeu_ps(x.acc.add((r + i) * x.dv + 16 * q), masks[q], a[i][q]);
                }
            }
        }
    }
}
