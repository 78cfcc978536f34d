//! `y = x W^T` for many rows `x` (a prompt's tokens) on AVX-512F with f32 FMAs, over weights
//! `W [rows, cols]` stored as f32, bf16 or f16: the products of a prefill where `vdpbf16ps`
//! is missing or the weights are not bf16. (The `gemm` crate has no AVX-512 kernel on stable
//! Rust; its AVX2 kernel leaves half of an AVX-512 core's FMA width unused.)
//!
//! A task widens a panel of 32 weight rows to f32 once, column-major (column `c` is two
//! vectors: rows 0..16 and 16..32), and the kernel broadcasts each of [`ROWS`] inputs' value
//! at a column against them: twelve inputs by 32 outputs in 24 registers. The inputs are
//! packed once per product the same way, twelve rows interleaved column by column, so a call
//! reads both operands front to back.

use super::microkernels::Isa;
#[cfg(target_arch = "x86_64")]
use super::panels::{self, Out, PANEL, PanelKernel};
use crate::tensor::Storage;
#[cfg(target_arch = "x86_64")]
use rayon::prelude::*;

/// Inputs per kernel call.
#[cfg(target_arch = "x86_64")]
const ROWS: usize = 12;

/// Whether [`matmul_t`] runs for `isa`: AVX-512 (with or without `avx512_bf16`), on a CPU
/// that has it.
pub(crate) fn available(isa: Isa) -> bool {
    isa.vectors() == Isa::Avx512 && isa.runs_here()
}

/// `n x rows` outputs `x W^T` for `n x cols` inputs `x` and the `rows x cols` matrix `w`
/// (both row-major) with `isa`'s kernels, the inputs rounded to bf16 first where
/// `round_inputs`; `None` where [`available`] is false for it.
pub(crate) fn matmul_t(
    isa: Isa,
    w: &Storage,
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    round_inputs: bool,
) -> Option<Vec<f32>> {
    #[cfg(target_arch = "x86_64")]
    if available(isa) {
        return Some(run(w, rows, cols, x, n, round_inputs));
    }
    let _ = (w, rows, cols, x, n, round_inputs);
    None
}

/// [`matmul_t`] where it runs.
#[cfg(target_arch = "x86_64")]
fn run(w: &Storage, rows: usize, cols: usize, x: &[f32], n: usize, round: bool) -> Vec<f32> {
    assert_eq!(w.len(), rows * cols, "weights of {rows} x {cols}");
    assert_eq!(x.len(), n * cols, "inputs of {n} x {cols}");
    // Inputs by calls of ROWS rows, interleaved: value `i` of column `c` at `c * ROWS + i`
    // (zero rows past `n`). `interleave` writes every value of its block, so the buffer
    // starts uninitialized.
    let len = n.div_ceil(ROWS) * ROWS * cols;
    let mut inputs: Vec<f32> = Vec::with_capacity(len);
    inputs.spare_capacity_mut()[..len]
        .par_chunks_mut((ROWS * cols).max(1))
        .zip(x.par_chunks((ROWS * cols).max(1)))
        // SAFETY: AVX-512F is here (`available`); each block holds ROWS rows of `cols` and
        // each chunk of `x` at most ROWS whole rows.
        .for_each(|(block, rows)| unsafe { x86::interleave(rows, cols, round, block) });
    // SAFETY: the blocks cover the first `len` values (one per call of ROWS rows, as many as
    // `x` has chunks), and `interleave` wrote every value of each.
    unsafe { inputs.set_len(len) };
    let kernel = Widened {
        w,
        cols,
        inputs: &inputs,
    };
    panels::by_panels(&kernel, rows, n)
}

/// The f32 products by panels: weight rows widened column-major, inputs interleaved by calls.
#[cfg(target_arch = "x86_64")]
struct Widened<'a> {
    w: &'a Storage,
    cols: usize,
    inputs: &'a [f32],
}

#[cfg(target_arch = "x86_64")]
impl PanelKernel for Widened<'_> {
    type Packed = f32;
    const ROWS: usize = ROWS;

    fn packed_len(&self) -> usize {
        self.cols * PANEL
    }

    fn pack(&self, first: usize, count: usize, packed: &mut [f32]) {
        // SAFETY: AVX-512F is here (`available`, checked by `matmul_t`).
        unsafe { x86::pack(self.w, first, count, self.cols, packed) };
    }

    fn prefetch(&self, first: usize, part: usize, parts: usize) {
        let lines =
            |len: usize| (first * self.cols).min(len)..((first + PANEL) * self.cols).min(len);
        match self.w {
            Storage::F32(v) => panels::x86::prefetch(&v[lines(v.len())], part, parts),
            Storage::Bf16(v) => panels::x86::prefetch(&v[lines(v.len())], part, parts),
            Storage::F16(v) => panels::x86::prefetch(&v[lines(v.len())], part, parts),
        }
    }

    unsafe fn multiply(&self, packed: &[f32], start: usize, out: Out) {
        let inputs = &self.inputs[start * self.cols..(start + ROWS) * self.cols];
        // SAFETY: AVX-512F is here (`available`); `inputs` holds one call's ROWS interleaved
        // rows of `cols`; `out` is the caller's to write.
        unsafe { x86::kernel(packed, inputs, self.cols, out) };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::ROWS;
    use crate::cpu::bf16_gemm::x86::round_lanes;
    use crate::cpu::panels::x86::{pack_transposed, store, transpose};
    use crate::cpu::panels::{Out, PANEL};
    use crate::tensor::Storage;
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// Up to ROWS `rows` of `cols` into `block` interleaved, value `(i, c)` at `c * ROWS + i`,
    /// rounded to bf16 where `round` (as `gemv::round_to_bf16` rounds); rows past the last as
    /// 0. Sixteen columns are loaded and transposed at a time.
    ///
    /// Every value of `block` is written.
    ///
    /// # Safety
    /// AVX-512F must be present; `rows` holds whole rows, at most ROWS, and
    /// `block.len() == ROWS * cols` (asserted).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn interleave(
        rows: &[f32],
        cols: usize,
        round: bool,
        block: &mut [MaybeUninit<f32>],
    ) {
        let count = rows.len() / cols.max(1);
        assert!(count <= ROWS && count * cols == rows.len() && block.len() == ROWS * cols);
        let lanes = ((1u32 << ROWS) - 1) as __mmask16;
        for first in (0..cols).step_by(16) {
            let width = (cols - first).min(16);
            let mask = ((1u32 << width) - 1) as __mmask16;
            let mut by_row = [_mm512_setzero_si512(); 16];
            for (i, v) in by_row.iter_mut().enumerate().take(count) {
                // SAFETY: row i < count, columns first..first + width inside it; masked lanes
                // are not read.
                let x = unsafe { _mm512_maskz_loadu_ps(mask, rows.as_ptr().add(i * cols + first)) };
                *v = match round {
                    // The bf16 bits in the high half: the rounded value as an f32.
                    true => _mm512_slli_epi32::<16>(round_lanes(x)),
                    false => _mm512_castps_si512(x),
                };
            }
            let by_column = transpose(by_row);
            for (k, column) in by_column.iter().enumerate().take(width) {
                // SAFETY: column first + k < cols: its ROWS values are inside `block`.
                unsafe {
                    let to = block.as_mut_ptr().add((first + k) * ROWS);
                    _mm512_mask_storeu_epi32(to.cast(), lanes, *column);
                }
            }
        }
    }

    /// `width <= 16` 16-bit values from `src`, packed (0 past `width`).
    ///
    /// # Safety
    /// AVX-512F must be present; `width` values from `src` are readable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn halves(src: *const u16, width: usize) -> __m256i {
        // SAFETY: the caller's contract; a short row is copied first so no byte past it is read.
        unsafe {
            if width == 16 {
                return _mm256_loadu_si256(src.cast());
            }
            let mut buf = [0u16; 16];
            std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), width);
            _mm256_loadu_si256(buf.as_ptr().cast())
        }
    }

    /// `width <= 16` weights from index `at` of `w`, widened to f32 lanes (0 past `width`).
    ///
    /// # Safety
    /// AVX-512F must be present; `at + width <= w.len()`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn lanes(w: &Storage, at: usize, width: usize) -> __m512i {
        debug_assert!(at + width <= w.len());
        // SAFETY: values `at..at + width` are inside `w`; masked lanes are not read.
        unsafe {
            match w {
                Storage::F32(v) => {
                    let mask = ((1u32 << width) - 1) as __mmask16;
                    _mm512_castps_si512(_mm512_maskz_loadu_ps(mask, v.as_ptr().add(at)))
                }
                // bf16 is the high half of an f32.
                Storage::Bf16(v) => _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves(
                    v.as_ptr().add(at).cast(),
                    width,
                ))),
                Storage::F16(v) => {
                    _mm512_castps_si512(_mm512_cvtph_ps(halves(v.as_ptr().add(at).cast(), width)))
                }
            }
        }
    }

    /// Weight rows `first..first + count` (`count <= PANEL`, of `cols`) widened column-major
    /// into `packed`: value `(first + j, c)` at `c * PANEL + j`, rows past `count` 0. Sixteen
    /// rows by sixteen columns are loaded and transposed at a time.
    ///
    /// # Safety
    /// AVX-512F must be present. The rows lie inside `w` and `packed.len() == cols * PANEL`
    /// (asserted).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack(
        w: &Storage,
        first: usize,
        count: usize,
        cols: usize,
        packed: &mut [f32],
    ) {
        assert!(count <= PANEL && (first + count) * cols <= w.len());
        // SAFETY: row first + r is inside `w` (asserted), columns block..block + width inside
        // the row.
        let load = |r: usize, block: usize, width: usize| unsafe {
            lanes(w, (first + r) * cols + block, width)
        };
        // SAFETY: `load` reads rows below `count`, columns below `cols`; `packed` holds
        // `cols * PANEL` values (asserted there).
        unsafe { pack_transposed(count, cols, packed, load) };
    }

    /// The sums of ROWS inputs against a packed panel: output `i`'s column `j` is the sum over
    /// columns `c` of input `i`'s value times panel row `j`'s; rows `live..` and columns
    /// `count..` are not stored.
    ///
    /// # Safety
    /// AVX-512F must be present. `packed` holds `cols * PANEL` values and `inputs`
    /// `ROWS * cols` (asserted); `out` names `live <= ROWS` writable rows of `count <= PANEL`
    /// columns.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn kernel(packed: &[f32], inputs: &[f32], cols: usize, out: Out) {
        assert!(packed.len() >= cols * PANEL && inputs.len() >= ROWS * cols);
        assert!(out.live <= ROWS && out.count <= PANEL);
        let (w, x) = (packed.as_ptr(), inputs.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
        // SAFETY: column c < cols of the panel and of the interleaved inputs: in the asserted
        // ranges.
        unsafe {
            for c in 0..cols {
                let w0 = _mm512_loadu_ps(w.add(c * PANEL));
                let w1 = _mm512_loadu_ps(w.add(c * PANEL + 16));
                for (i, sums) in acc.iter_mut().enumerate() {
                    let v = _mm512_set1_ps(*x.add(c * ROWS + i));
                    sums[0] = _mm512_fmadd_ps(w0, v, sums[0]);
                    sums[1] = _mm512_fmadd_ps(w1, v, sums[1]);
                }
            }
            // SAFETY: `out` is writable as the caller promised.
            store(&acc, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::gemv::round_to_bf16;
    use half::{bf16, f16};

    /// Every dtype, with shapes that leave a partial panel, a partial call of inputs and a
    /// partial block of sixteen columns, matches the f64 product of the stored weights and the
    /// inputs (rounded to bf16 where asked).
    #[test]
    fn matches_the_f64_product_in_every_dtype() {
        if !available(Isa::Avx512) {
            return; // no AVX-512 here: models take the gemm crate, tested with Matrix
        }
        let value = |i: usize, seed: usize| {
            let h = (i.wrapping_mul(2654435761).wrapping_add(seed) >> 7) % 2001;
            h as f32 / 1000.0 - 1.0
        };
        let shapes = [
            (1, 1, 1),
            (33, 7, 13),
            (70, 64, 25),
            (40, 301, 9),
            (50, 33, 30),
        ];
        for (rows, cols, n) in shapes {
            let raw: Vec<f32> = (0..rows * cols).map(|i| value(i, 3)).collect();
            let stores = [
                Storage::F32(raw.clone().into()),
                Storage::Bf16(raw.iter().map(|&v| bf16::from_f32(v)).collect()),
                Storage::F16(raw.iter().map(|&v| f16::from_f32(v)).collect()),
            ];
            let x: Vec<f32> = (0..n * cols).map(|i| value(i, 5)).collect();
            for (store, round) in stores.iter().flat_map(|s| [(s, false), (s, true)]) {
                let wide = |i: usize| match store {
                    Storage::F32(v) => v[i] as f64,
                    Storage::Bf16(v) => v[i].to_f64(),
                    Storage::F16(v) => v[i].to_f64(),
                };
                let input = |v: f32| match round {
                    true => round_to_bf16(v) as f64,
                    false => v as f64,
                };
                let y = matmul_t(Isa::Avx512, store, rows, cols, &x, n, round).unwrap();
                assert_eq!(y.len(), n * rows);
                for t in 0..n {
                    for o in 0..rows {
                        let want: f64 = (0..cols)
                            .map(|i| wide(o * cols + i) * input(x[t * cols + i]))
                            .sum();
                        let got = y[t * rows + o] as f64;
                        let tol = 1e-6 * (cols as f64).sqrt() * (1.0 + want.abs());
                        assert!(
                            (got - want).abs() <= tol,
                            "{rows}x{cols} n={n} round={round} [{t}, {o}]: {got} against {want}"
                        );
                    }
                }
            }
        }
    }
}
