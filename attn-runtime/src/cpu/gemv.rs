//! Products of a few rows of activations with a weight matrix in its stored dtype: `y = x W^T`
//! for `n` (a handful of) rows `x` and `W [rows, cols]` of f32, bf16 or f16. Decoding runs one
//! token at a time, so each weight is used once per step and the product is bound by how fast
//! the weights stream from memory: each weight is read once per four rows of `x`, widened to f32
//! in registers (bf16 and f16 are never converted into a buffer) and summed in f32. Products
//! with bf16 weights take their inputs rounded to bf16, as every bf16 product here does
//! ([`round_to_bf16`]).
//!
//! AVX-512 where the CPU has it; portable Rust otherwise (the compiler vectorizes the sums).

use super::microkernels::Isa;
use super::row_kernels::Elem;
use crate::tensor::Storage;
use half::{bf16, f16};
use rayon::prelude::*;

/// Rows of `x` the products serve with one read of the weights.
const TOKENS: usize = 4;

/// Rows of `x` up to which [`matmul_t`] is the right product: past this, a GEMM that reuses
/// each weight across many rows wins (reading the weights `n / TOKENS` times costs more than
/// widening them once).
pub(crate) const MAX_ROWS: usize = 8;

/// `n x rows` outputs `x W^T` for `n x cols` inputs `x` (row-major) and `W` the `rows x cols`
/// row-major matrix `w`, on `isa` (the portable code when the CPU lacks it). Output rows are
/// split across rayon's threads. With `round`, bf16 weights multiply the inputs rounded to
/// bf16 ([`round_to_bf16`]); without, the inputs as they are.
pub(crate) fn matmul_t(
    isa: Isa,
    w: &Storage,
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    round: bool,
) -> Vec<f32> {
    matmul_t_many(isa, &[(w, rows)], cols, x, n, round).remove(0)
}

/// [`matmul_t`] for several matrices of `cols` columns (`(weights, rows)` each) against the
/// same inputs, in one parallel pass: decoding's query, key and value projections (or an MLP's
/// gate and up projections) cost one hand-off to the threads instead of three.
pub(crate) fn matmul_t_many(
    isa: Isa,
    mats: &[(&Storage, usize)],
    cols: usize,
    x: &[f32],
    n: usize,
    round: bool,
) -> Vec<Vec<f32>> {
    for (w, rows) in mats {
        assert_eq!(w.len(), rows * cols, "weights of {rows} x {cols}");
    }
    assert_eq!(x.len(), n * cols, "inputs of {n} x {cols}");
    // Outputs by weight row: `yt[o * n + t]`.
    let mut yts: Vec<Vec<f32>> = mats.iter().map(|(_, rows)| vec![0f32; rows * n]).collect();
    let total: usize = mats.iter().map(|(_, rows)| rows).sum();
    if n == 0 || total == 0 || cols == 0 {
        return yts; // all zeros, in either layout
    }
    // Chunks of whole blocks of rows, several per thread so that uneven cores balance.
    let threads = rayon::current_num_threads().max(1);
    let chunk = (total.div_ceil(threads * 8).div_ceil(4) * 4).max(16);
    let bf16 = mats.iter().any(|(w, _)| matches!(w, Storage::Bf16(_)));
    let kernel = Kernel {
        isa,
        cols,
        x: Inputs::new(x, n, cols, bf16, round, isa.vectors() == Isa::Avx512),
    };
    let mut pieces = Vec::new();
    for ((w, _), yt) in mats.iter().zip(&mut yts) {
        for (i, out) in yt.chunks_mut(chunk * n).enumerate() {
            pieces.push((*w, i * chunk * cols, out));
        }
    }
    pieces.into_par_iter().for_each(|(w, start, out)| match w {
        Storage::F32(w) => kernel.rows(&w[start..], out),
        Storage::Bf16(w) => kernel.rows(&w[start..], out),
        Storage::F16(w) => kernel.rows(&w[start..], out),
    });
    if n == 1 {
        return yts;
    }
    yts.into_iter()
        .map(|yt| {
            let rows = yt.len() / n;
            let mut y = vec![0f32; n * rows];
            for (o, values) in yt.chunks_exact(n).enumerate() {
                for (t, v) in values.iter().enumerate() {
                    y[t * rows + o] = *v;
                }
            }
            y
        })
        .collect()
}

/// The product's inputs, shared by the chunks.
struct Kernel<'a> {
    isa: Isa,
    cols: usize,
    x: Inputs<'a>,
}

/// The rows `x` of a product; for bf16 weights the same rows rounded to bf16 when the product
/// rounds (a bf16 weight's product takes its input in bf16, as PyTorch's bf16 products do:
/// [`round_to_bf16`]), and on AVX-512 the rows bf16 weights read split by column parity: per
/// row, the even columns of its whole pieces of [`PAIR_PIECE`] columns, then the odd ones (a
/// bf16 pair read as one 32-bit lane widens to f32 with one shift for the even column and one
/// mask for the odd one, so no lane is moved).
struct Inputs<'a> {
    x: &'a [f32],
    n: usize,
    rounded: Vec<f32>,
    split: Vec<f32>,
}

/// Columns a bf16 pair kernel reads at a time: one 64-byte line.
const PAIR_PIECE: usize = 32;

impl<'a> Inputs<'a> {
    /// `n` rows of `cols` inputs; for products with bf16 weights (`bf16`), rounded copies when
    /// `round`, split by parity when `split`.
    fn new(x: &'a [f32], n: usize, cols: usize, bf16: bool, round: bool, split: bool) -> Self {
        let rounded = match bf16 && round {
            true => x.iter().map(|&v| round_to_bf16(v)).collect(),
            false => Vec::new(),
        };
        let mut inputs = Inputs {
            x,
            n,
            rounded,
            split: Vec::new(),
        };
        if bf16 && split {
            let half = cols / PAIR_PIECE * PAIR_PIECE / 2;
            let mut parted = Vec::with_capacity(n * 2 * half);
            for row in inputs.bf16_rows().chunks_exact(cols.max(1)).take(n) {
                parted.extend(row[..2 * half].iter().step_by(2));
                parted.extend(row[..2 * half].iter().skip(1).step_by(2));
            }
            inputs.split = parted;
        }
        inputs
    }

    /// The rows bf16 weights multiply: rounded, or as given.
    fn bf16_rows(&self) -> &[f32] {
        match self.rounded.is_empty() {
            true => self.x,
            false => &self.rounded,
        }
    }

    /// The rows a product with weights `E` reads.
    fn rows<E: Weight>(&self) -> &[f32] {
        match E::BF16 {
            true => self.bf16_rows(),
            false => self.x,
        }
    }
}

/// `v` rounded to the nearest bf16 (ties to even), as f32: what a product with bf16 weights
/// multiplies. A bf16 times a bf16 is exact in f32, so every path computes the same products
/// and differs only in the order of the f32 sums.
pub(crate) fn round_to_bf16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

impl Kernel<'_> {
    /// Fills `out` (`out.len() / n` weight rows, by row then input row) from the weights `w`,
    /// which start at the chunk's first row.
    fn rows<E: Weight>(&self, w: &[E], out: &mut [f32]) {
        let count = out.len() / self.x.n;
        let w = &w[..count * self.cols];
        match self.isa.vectors() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa` is AVX-512 only when the CPU has it (`Isa::chosen`, or a backend
            // built for it); the slices hold `count` weight rows, `n` inputs and `count * n`
            // outputs of `cols` values each, the ranges the kernel reads and writes.
            Isa::Avx512 => unsafe { E::avx512(w, self.cols, &self.x, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa` is AVX2 only when the CPU has AVX2 and FMA (`Isa::runs_here`).
            Isa::Avx2 => unsafe { portable_avx2(w, self.cols, self.x.rows::<E>(), self.x.n, out) },
            _ => portable(w, self.cols, self.x.rows::<E>(), self.x.n, out),
        }
    }
}

/// A stored weight: f32, bf16 or f16.
trait Weight: Elem + Sync {
    /// Whether the weights are bf16 (whose products may round their inputs).
    const BF16: bool;

    /// The value as f32 (bf16: its bits shifted into the upper half, which vectorizes).
    fn widen(self) -> f32;

    /// [`x86::block_rows`] for this dtype.
    ///
    /// # Safety
    /// AVX-512F must be present; `w` holds `out.len() / x.n` rows of `cols`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx512(w: &[Self], cols: usize, x: &Inputs, out: &mut [f32]);
}

impl Weight for f32 {
    const BF16: bool = false;
    fn widen(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn avx512(w: &[Self], cols: usize, x: &Inputs, out: &mut [f32]) {
        // SAFETY: the trait's contract.
        unsafe { x86::block_rows(w, cols, x.x, x.n, out) }
    }
}

impl Weight for f16 {
    const BF16: bool = false;
    fn widen(self) -> f32 {
        self.to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn avx512(w: &[Self], cols: usize, x: &Inputs, out: &mut [f32]) {
        // SAFETY: the trait's contract.
        unsafe { x86::block_rows(w, cols, x.x, x.n, out) }
    }
}

impl Weight for bf16 {
    const BF16: bool = true;
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn avx512(w: &[Self], cols: usize, x: &Inputs, out: &mut [f32]) {
        // SAFETY: the trait's contract.
        unsafe { x86::bf16_rows(w, cols, x, out) }
    }
}

/// Portable products: each weight row widened a piece at a time into a buffer, then summed
/// against each input in sixteen lanes (fixed-width loops the compiler vectorizes for whatever
/// the function is compiled for: [`portable_avx2`] instantiates it for AVX2).
#[inline(always)]
fn portable<E: Weight>(w: &[E], cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
    const PIECE: usize = 256;
    const LANES: usize = 16;
    let mut wide = [0f32; PIECE];
    let mut sums = vec![[0f32; LANES]; n];
    for (row, y) in w.chunks_exact(cols).zip(out.chunks_exact_mut(n)) {
        sums.iter_mut().for_each(|s| *s = [0.0; LANES]);
        let mut tail = vec![0f32; n];
        for start in (0..cols).step_by(PIECE) {
            let len = PIECE.min(cols - start);
            for (d, s) in wide.iter_mut().zip(&row[start..start + len]) {
                *d = s.widen();
            }
            let whole = len / LANES * LANES;
            for (t, (sum, tail)) in sums.iter_mut().zip(&mut tail).enumerate() {
                let xs = &x[t * cols + start..t * cols + start + len];
                for (a, b) in wide[..whole]
                    .chunks_exact(LANES)
                    .zip(xs.chunks_exact(LANES))
                {
                    for i in 0..LANES {
                        sum[i] += a[i] * b[i];
                    }
                }
                for (a, b) in wide[whole..len].iter().zip(&xs[whole..]) {
                    *tail += a * b;
                }
            }
        }
        for ((y, sum), tail) in y.iter_mut().zip(&sums).zip(&tail) {
            *y = sum.iter().sum::<f32>() + tail;
        }
    }
}

/// [`portable`] compiled for AVX2 with FMA.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn portable_avx2<E: Weight>(w: &[E], cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
    portable(w, cols, x, n, out)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Inputs, PAIR_PIECE, TOKENS};
    use crate::cpu::row_kernels::x86::Load16;
    use half::bf16;
    use std::arch::x86_64::*;

    /// AVX-512 products over whole weight rows: blocks of four rows against groups of up to
    /// [`TOKENS`] inputs, sixteen columns at a time (the last piece masked).
    ///
    /// # Safety
    /// AVX-512F must be present; `w` holds `out.len() / n` rows of `cols` values, `x` `n`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn block_rows<E: Load16>(
        w: &[E],
        cols: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) {
        let rows = out.len() / n;
        assert!(w.len() >= rows * cols && x.len() >= n * cols);
        let mut t = 0;
        while t < n {
            let group = TOKENS.min(n - t);
            let mut r = 0;
            while r < rows {
                let block = if rows - r >= 4 { 4 } else { 1 };
                let at = Block {
                    w: w[r * cols..].as_ptr(),
                    stride: cols,
                    cols,
                    x: x[t * cols..].as_ptr(),
                    x_stride: cols,
                    y: out[r * n + t..].as_mut_ptr(),
                    n,
                };
                // SAFETY: rows r..r + block of w, inputs t..t + group of x and their outputs
                // lie in the slices (checked above); the CPU has AVX-512F.
                unsafe {
                    match (block, group) {
                        (4, 1) => at.run::<4, 1, false>(),
                        (4, 2) => at.run::<4, 2, false>(),
                        (4, 3) => at.run::<4, 3, false>(),
                        (4, _) => at.run::<4, 4, false>(),
                        (_, 1) => at.run::<1, 1, false>(),
                        (_, 2) => at.run::<1, 2, false>(),
                        (_, 3) => at.run::<1, 3, false>(),
                        _ => at.run::<1, 4, false>(),
                    }
                }
                r += block;
            }
            t += group;
        }
    }

    /// AVX-512 products of bf16 rows, one row at a time (a single stream through memory, which
    /// the prefetchers follow best), each 64-byte line read once as sixteen column pairs against
    /// groups of up to [`TOKENS`] inputs; columns past the last whole line go through
    /// [`Block::run`].
    ///
    /// # Safety
    /// AVX-512F must be present; `w` holds `out.len() / x.n` rows of `cols` values and
    /// `x.split` the split inputs.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn bf16_rows(w: &[bf16], cols: usize, x: &Inputs, out: &mut [f32]) {
        let n = x.n;
        let rows = out.len() / n;
        let whole = cols / PAIR_PIECE * PAIR_PIECE;
        assert!(
            w.len() >= rows * cols && x.split.len() == n * whole && x.bf16_rows().len() >= n * cols
        );
        for r in 0..rows {
            let mut t = 0;
            while t < n {
                let group = TOKENS.min(n - t);
                let at = Pairs {
                    w: w[r * cols..].as_ptr(),
                    whole,
                    x: x.split[t * whole..].as_ptr(),
                    y: out[r * n + t..].as_mut_ptr(),
                };
                // SAFETY: row r of w, split inputs t..t + group and their outputs lie in the
                // slices (checked above); the CPU has AVX-512F.
                unsafe {
                    match group {
                        1 => at.run::<1>(),
                        2 => at.run::<2>(),
                        3 => at.run::<3>(),
                        _ => at.run::<4>(),
                    }
                }
                if whole < cols {
                    let rest = Block {
                        w: w[r * cols + whole..].as_ptr(),
                        stride: cols,
                        cols: cols - whole,
                        x: x.bf16_rows()[t * cols + whole..].as_ptr(),
                        x_stride: cols,
                        y: out[r * n + t..].as_mut_ptr(),
                        n,
                    };
                    // SAFETY: as above, for the columns past `whole`; `run` adds to `y`.
                    unsafe {
                        match group {
                            1 => rest.run::<1, 1, true>(),
                            2 => rest.run::<1, 2, true>(),
                            3 => rest.run::<1, 3, true>(),
                            _ => rest.run::<1, 4, true>(),
                        }
                    }
                }
                t += group;
            }
        }
    }

    /// How far ahead of the line being read [`Pairs::run`] asks for weights (into L2), in
    /// values: 4 KiB. The stream runs on into the chunk's next rows, which the prefetch reaches
    /// before the hardware prefetcher would (it restarts at every page). Measured on the 2-core
    /// Zen 4 VM: 2, 4 or 16 KiB ahead all stream at 25-27 GB/s against 20-22 without.
    const PREFETCH: usize = 2048;

    /// One bf16 weight row's whole lines at `w` against `T` split inputs at `x` (`whole`
    /// values each), written to `y[t]`.
    struct Pairs {
        w: *const bf16,
        whole: usize,
        x: *const f32,
        y: *mut f32,
    }

    impl Pairs {
        /// # Safety
        /// `whole` weights at `w`, `T` split rows at `x`, `T` outputs at `y` and the next
        /// row's addresses for the prefetch (computed only); AVX-512F must be present.
        #[target_feature(enable = "avx512f")]
        unsafe fn run<const T: usize>(&self) {
            let half = self.whole / 2;
            let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
            let mut even = [_mm512_setzero_ps(); T];
            let mut odd = [_mm512_setzero_ps(); T];
            let mut c = 0;
            // SAFETY: pieces c..c + 32 < whole of the row, and halves c/2..c/2 + 16 of each
            // split row; the prefetch never faults.
            unsafe {
                while c < self.whole {
                    _mm_prefetch::<_MM_HINT_T1>(self.w.wrapping_add(c + PREFETCH).cast());
                    let v = _mm512_loadu_si512(self.w.add(c).cast());
                    let we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                    let wo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
                    for t in 0..T {
                        let xe = self.x.add(t * self.whole + c / 2);
                        even[t] = _mm512_fmadd_ps(we, _mm512_loadu_ps(xe), even[t]);
                        odd[t] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(xe.add(half)), odd[t]);
                    }
                    c += PAIR_PIECE;
                }
                for t in 0..T {
                    *self.y.add(t) = _mm512_reduce_add_ps(_mm512_add_ps(even[t], odd[t]));
                }
            }
        }
    }

    /// `R` weight rows at `w` (`stride` apart) against `T` inputs at `x` (`x_stride` apart),
    /// over `cols` columns, written to (or, with `ADD`, added to) `y[r * n + t]`.
    struct Block<E> {
        w: *const E,
        stride: usize,
        cols: usize,
        x: *const f32,
        x_stride: usize,
        y: *mut f32,
        n: usize,
    }

    impl<E: Load16> Block<E> {
        /// # Safety
        /// `R` rows of `cols` weights, `T` rows of `cols` inputs and the outputs `y[r * n + t]`
        /// must be valid; AVX-512F must be present.
        #[target_feature(enable = "avx512f")]
        unsafe fn run<const R: usize, const T: usize, const ADD: bool>(&self) {
            let mut acc = [[_mm512_setzero_ps(); T]; R];
            let mut c = 0;
            // SAFETY: every load reads columns c..c + 16 (masked past `cols`) of rows the
            // caller guarantees; the prefetch never faults.
            unsafe {
                while c < self.cols {
                    if c % 32 == 0 {
                        for r in 0..R {
                            let next = self.w.wrapping_add((r + R) * self.stride + c);
                            _mm_prefetch::<_MM_HINT_T0>(next.cast());
                        }
                    }
                    let left = self.cols - c;
                    let mask = if left >= 16 {
                        0xffff
                    } else {
                        ((1u32 << left) - 1) as __mmask16
                    };
                    let mut xs = [_mm512_setzero_ps(); T];
                    for (t, v) in xs.iter_mut().enumerate() {
                        *v = _mm512_maskz_loadu_ps(mask, self.x.add(t * self.x_stride + c));
                    }
                    for (r, sums) in acc.iter_mut().enumerate() {
                        let wv = E::load16(self.w.add(r * self.stride + c), left);
                        for (s, v) in sums.iter_mut().zip(&xs) {
                            *s = _mm512_fmadd_ps(wv, *v, *s);
                        }
                    }
                    c += 16;
                }
                for (r, sums) in acc.iter().enumerate() {
                    for (t, s) in sums.iter().enumerate() {
                        let y = self.y.add(r * self.n + t);
                        let sum = _mm512_reduce_add_ps(*s);
                        *y = if ADD { *y + sum } else { sum };
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The f64 product of the widened weights.
    fn reference(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f64> {
        let mut y = vec![0f64; n * rows];
        for t in 0..n {
            for o in 0..rows {
                y[t * rows + o] = (0..cols)
                    .map(|i| w[o * cols + i] as f64 * x[t * cols + i] as f64)
                    .sum();
            }
        }
        y
    }

    fn values(count: usize, seed: u32) -> Vec<f32> {
        (0..count)
            .map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32)
            .map(|v| v / (1u32 << 24) as f32 - 0.5)
            .collect()
    }

    /// Every dtype, ISA, count of inputs (one to past a group) and shape with partial blocks of
    /// rows and partial pieces of columns matches the f64 product of the stored weights (bf16:
    /// with the inputs rounded to bf16, or as they are).
    #[test]
    fn matches_the_f64_product() {
        let isas: Vec<Isa> = [Isa::Portable, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|isa| isa.runs_here())
            .collect();
        for (rows, cols) in [(1, 1), (5, 17), (37, 70), (130, 256), (3, 0), (0, 5)] {
            let raw = values(rows * cols, 7);
            for n in [1, 2, 3, 4, 5, 8] {
                let x = values(n * cols, 11 + n as u32);
                let stores = [
                    Storage::F32(raw.clone().into()),
                    Storage::Bf16(raw.iter().map(|&v| bf16::from_f32(v)).collect()),
                    Storage::F16(raw.iter().map(|&v| f16::from_f32(v)).collect()),
                ];
                for store in &stores {
                    let wide: Vec<f32> = match store {
                        Storage::F32(v) => v.to_vec(),
                        Storage::Bf16(v) => v.iter().map(|b| b.to_f32()).collect(),
                        Storage::F16(v) => v.iter().map(|b| b.to_f32()).collect(),
                    };
                    for (&isa, round) in isas.iter().flat_map(|i| [(i, true), (i, false)]) {
                        // bf16 weights multiply inputs rounded to bf16 when asked.
                        let inputs: Vec<f32> = match store {
                            Storage::Bf16(_) if round => {
                                x.iter().map(|&v| round_to_bf16(v)).collect()
                            }
                            _ => x.clone(),
                        };
                        let want = reference(&wide, rows, cols, &inputs, n);
                        let got = matmul_t(isa, store, rows, cols, &x, n, round);
                        assert_eq!(got.len(), want.len());
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            let tol = 1e-5 * (1.0 + w.abs()) * (cols as f64).sqrt();
                            assert!(
                                (*g as f64 - w).abs() <= tol,
                                "{isa:?} {rows}x{cols} n={n} [{i}]: {g} against {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Several matrices in one pass give each its own product, whatever their dtypes.
    #[test]
    fn many_matrices_match_one_at_a_time() {
        let cols = 96;
        let x = values(3 * cols, 1);
        let a = Storage::Bf16(
            values(40 * cols, 2)
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect(),
        );
        let b = Storage::F32(values(7 * cols, 3).into());
        let c = Storage::F16(
            values(64 * cols, 4)
                .iter()
                .map(|&v| f16::from_f32(v))
                .collect(),
        );
        let isa = Isa::detect();
        let many = matmul_t_many(isa, &[(&a, 40), (&b, 7), (&c, 64)], cols, &x, 3, true);
        let one = [
            matmul_t(isa, &a, 40, cols, &x, 3, true),
            matmul_t(isa, &b, 7, cols, &x, 3, true),
            matmul_t(isa, &c, 64, cols, &x, 3, true),
        ];
        assert_eq!(many.len(), 3);
        for (m, o) in many.iter().zip(&one) {
            assert_eq!(m, o);
        }
    }
}
