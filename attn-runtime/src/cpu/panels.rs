//! The frame the CPU GEMMs share (`bf16_gemm` on `vdpbf16ps`, `f32_gemm` on f32 FMAs):
//! `y = x W^T` for many inputs `x` and a weight matrix `W [rows, cols]`, the weight rows split
//! into panels of [`PANEL`]. One rayon task per panel packs it once in its kernel's layout and
//! multiplies it with every call's block of inputs, asking for a share of the next panel's
//! lines from memory before each call so that packing it finds them in the cache.

use rayon::prelude::*;

/// Weight rows per panel: two vectors of sixteen f32 lanes.
pub(crate) const PANEL: usize = 32;

/// Where a kernel call's sums go: `live` rows `stride` apart, `count` columns each.
pub(crate) struct Out {
    pub at: *mut f32,
    pub stride: usize,
    pub live: usize,
    pub count: usize,
}

/// The output buffer, written by every panel's task at its own columns.
struct Outputs(*mut f32);
// SAFETY: each task writes only the columns of its own panel, so writes never overlap, and the
// buffer outlives the parallel loop.
unsafe impl Send for Outputs {}
// SAFETY: as above.
unsafe impl Sync for Outputs {}

/// How a GEMM packs and multiplies its panels, for [`by_panels`].
pub(crate) trait PanelKernel: Sync {
    /// The packed panel's element.
    type Packed: Copy + Default + Send;
    /// Inputs one kernel call multiplies.
    const ROWS: usize;
    /// Elements of one packed panel.
    fn packed_len(&self) -> usize;
    /// Packs the `count <= PANEL` weight rows from `first` into `packed` (rows past `count`
    /// as 0).
    fn pack(&self, first: usize, count: usize, packed: &mut [Self::Packed]);
    /// Asks for share `part` of `parts` of the cache lines of the panel from weight row
    /// `first` (which may be past the last row: nothing to ask then).
    fn prefetch(&self, first: usize, part: usize, parts: usize);
    /// Stores the sums of inputs `start..start + ROWS` (zero past the last) against `packed`
    /// at `out`.
    ///
    /// # Safety
    /// `out` names `live <= ROWS` writable rows of `count <= PANEL` columns that no other
    /// call writes; the kernel stores every one of them.
    unsafe fn multiply(&self, packed: &[Self::Packed], start: usize, out: Out);
}

/// The `n x rows` outputs of `kernel` over `rows` weight rows and `n` inputs, row-major.
pub(crate) fn by_panels<K: PanelKernel>(kernel: &K, rows: usize, n: usize) -> Vec<f32> {
    // Every output is stored by exactly one kernel call below, so the buffer starts
    // uninitialized (zeroing it cost 3% of a prefill's products).
    let mut y: Vec<f32> = Vec::with_capacity(n * rows);
    let outputs = Outputs(y.as_mut_ptr());
    (0..rows.div_ceil(PANEL)).into_par_iter().for_each_init(
        || vec![K::Packed::default(); kernel.packed_len()],
        |packed, panel| {
            let first = panel * PANEL;
            let count = PANEL.min(rows - first);
            let at = &outputs;
            kernel.pack(first, count, packed);
            let calls = n.div_ceil(K::ROWS);
            for (call, start) in (0..n).step_by(K::ROWS).enumerate() {
                // The next panel (usually this task's next) comes from memory while this
                // one computes.
                kernel.prefetch(first + PANEL, call, calls);
                // SAFETY: rows `start..start + live` at columns `first..first + count` lie
                // inside `y` (`n x rows`) and belong to this panel's task and this call alone.
                unsafe {
                    kernel.multiply(
                        packed,
                        start,
                        Out {
                            at: at.0.add(start * rows + first),
                            stride: rows,
                            live: K::ROWS.min(n - start),
                            count,
                        },
                    )
                };
            }
        },
    );
    // SAFETY: the panels cover columns 0..rows and each panel's calls cover rows 0..n, and
    // every call stores all its outputs (`PanelKernel::multiply`), so all `n * rows` values
    // were written.
    unsafe { y.set_len(n * rows) };
    y
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// Asks for share `part` of `parts` of the cache lines of `w`, into the L2 cache.
    pub(crate) fn prefetch<T>(w: &[T], part: usize, parts: usize) {
        let lines = std::mem::size_of_val(w).div_ceil(64);
        let base = w.as_ptr().cast::<i8>();
        for line in lines * part / parts..lines * (part + 1) / parts {
            // SAFETY: a prefetch never faults; the address is inside `w`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(64 * line)) };
        }
    }

    /// The 16 x 16 transpose of 32-bit lanes: `out[k]` lane `j` is `rows[j]` lane `k`.
    #[target_feature(enable = "avx512f")]
    pub(crate) fn transpose(rows: [__m512i; 16]) -> [__m512i; 16] {
        // Within each 128-bit lane L: after the 32- and 64-bit interleaves, `by4[4 * g + m]`
        // holds column 4L + m of rows 4g..4g + 4.
        let mut by2 = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            by2[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
            by2[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
        }
        let mut by4 = [_mm512_setzero_si512(); 16];
        for g in 0..4 {
            let b = &by2[4 * g..4 * g + 4];
            by4[4 * g] = _mm512_unpacklo_epi64(b[0], b[2]);
            by4[4 * g + 1] = _mm512_unpackhi_epi64(b[0], b[2]);
            by4[4 * g + 2] = _mm512_unpacklo_epi64(b[1], b[3]);
            by4[4 * g + 3] = _mm512_unpackhi_epi64(b[1], b[3]);
        }
        // Then column 4L + m gathers 128-bit lane L of by4[m], by4[4 + m], by4[8 + m] and
        // by4[12 + m].
        let mut out = [_mm512_setzero_si512(); 16];
        for m in 0..4 {
            let low01 = _mm512_shuffle_i32x4::<0b01_00_01_00>(by4[m], by4[4 + m]);
            let high01 = _mm512_shuffle_i32x4::<0b11_10_11_10>(by4[m], by4[4 + m]);
            let low23 = _mm512_shuffle_i32x4::<0b01_00_01_00>(by4[8 + m], by4[12 + m]);
            let high23 = _mm512_shuffle_i32x4::<0b11_10_11_10>(by4[8 + m], by4[12 + m]);
            out[m] = _mm512_shuffle_i32x4::<0b10_00_10_00>(low01, low23);
            out[4 + m] = _mm512_shuffle_i32x4::<0b11_01_11_01>(low01, low23);
            out[8 + m] = _mm512_shuffle_i32x4::<0b10_00_10_00>(high01, high23);
            out[12 + m] = _mm512_shuffle_i32x4::<0b11_01_11_01>(high01, high23);
        }
        out
    }

    /// Packs a panel of `count <= PANEL` rows of `lanes` 32-bit values each lane-major into
    /// `packed`: lane `k` of row `j` at `k * PANEL + j`, rows past `count` 0. `load(r, k, n)`
    /// gives row `r`'s lanes `k..k + n` (`n <= 16`, 0 past `n`); sixteen rows by sixteen lanes
    /// are loaded and transposed at a time.
    ///
    /// # Safety
    /// `load` may be called for rows below `count` and lanes below `lanes`; `T` is 32 bits and
    /// `packed.len() == lanes * PANEL` (asserted).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn pack_transposed<T>(
        count: usize,
        lanes: usize,
        packed: &mut [T],
        load: impl Fn(usize, usize, usize) -> __m512i,
    ) {
        assert!(count <= super::PANEL && std::mem::size_of::<T>() == 4);
        assert_eq!(packed.len(), lanes * super::PANEL);
        for block in (0..lanes).step_by(16) {
            let width = (lanes - block).min(16);
            for half in 0..2 {
                let mut rows = [_mm512_setzero_si512(); 16];
                for (j, row) in rows
                    .iter_mut()
                    .enumerate()
                    .take(count.saturating_sub(16 * half))
                {
                    *row = load(16 * half + j, block, width);
                }
                let columns = transpose(rows);
                for (k, column) in columns.iter().enumerate().take(width) {
                    // SAFETY: lane block + k < lanes; its values 16 * half.. are in `packed`,
                    // 32 bits each (asserted).
                    unsafe {
                        let at = (block + k) * super::PANEL + 16 * half;
                        _mm512_storeu_si512(packed.as_mut_ptr().add(at).cast(), *column);
                    }
                }
            }
        }
    }

    /// Stores `ROWS` rows of two vectors of sums at `out`: rows `live..` and columns `count..`
    /// are left alone.
    ///
    /// # Safety
    /// `out` names `live` writable rows of `count <= 32` columns.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn store<const ROWS: usize>(acc: &[[__m512; 2]; ROWS], out: super::Out) {
        let mask = |from: usize| {
            (((1u32 << out.count.saturating_sub(from).min(16)) - 1) & 0xffff) as __mmask16
        };
        let (m0, m1) = (mask(0), mask(16));
        for (i, sums) in acc.iter().take(out.live).enumerate() {
            // SAFETY: row i < live, columns below `count`: writable by the caller's contract.
            unsafe {
                let row = out.at.add(i * out.stride);
                _mm512_mask_storeu_ps(row, m0, sums[0]);
                _mm512_mask_storeu_ps(row.add(16), m1, sums[1]);
            }
        }
    }
}
