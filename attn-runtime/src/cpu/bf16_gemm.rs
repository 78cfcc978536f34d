//! `y = x W^T` for many rows `x` (a prompt's tokens) and bf16 weights `W [rows, cols]` on CPUs
//! with `avx512_bf16`: the products of a prefill, on `vdpbf16ps`, which multiplies sixteen
//! pairs of bf16 values and adds each pair's two products to an f32 lane in one instruction
//! (twice the work of an f32 FMA). The inputs are rounded to bf16 first, as every product with
//! bf16 weights is ([`super::gemv::round_to_bf16`]); the sums are f32.
//!
//! A task takes a panel of 32 weight rows and packs it pair-major (lane `j` of pair `p` holds
//! row `j`'s columns `2p` and `2p + 1`), so the kernel loads two vectors of weights per pair
//! and broadcasts each input's pair against them: [`ROWS`] inputs by 32 outputs in 24
//! registers, no horizontal sums. Measured alone on the 2-core Zen 4 VM (512 x 1024 inputs,
//! 2880 x 1024 weights, packing included): 351 GFLOP/s on 2 threads, 179 on one, against
//! 176-196 for the gemm crate's f32 kernel on widened weights.

use super::microkernels::Isa;
#[cfg(target_arch = "x86_64")]
use super::panels::{self, Out, PANEL, PanelKernel};
use half::bf16;
#[cfg(target_arch = "x86_64")]
use rayon::prelude::*;

/// Inputs per kernel call.
#[cfg(target_arch = "x86_64")]
const ROWS: usize = 12;

/// Whether [`matmul_t`] runs for `isa`: [`Isa::Avx512Bf16`], on a CPU that has it.
pub(crate) fn available(isa: Isa) -> bool {
    isa == Isa::Avx512Bf16 && isa.runs_here()
}

/// `n x rows` outputs `x W^T` for `n x cols` inputs `x` and the `rows x cols` bf16 matrix `w`
/// (both row-major) with `isa`'s kernels; `None` where [`available`] is false for it.
pub(crate) fn matmul_t(
    isa: Isa,
    w: &[bf16],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
) -> Option<Vec<f32>> {
    #[cfg(target_arch = "x86_64")]
    if available(isa) {
        return Some(run(w, rows, cols, x, n));
    }
    None
}

/// [`matmul_t`] where it runs.
#[cfg(target_arch = "x86_64")]
fn run(w: &[bf16], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f32> {
    assert_eq!(w.len(), rows * cols, "weights of {rows} x {cols}");
    assert_eq!(x.len(), n * cols, "inputs of {n} x {cols}");
    let pairs = cols.div_ceil(2);
    // Inputs as bf16 pairs, padded to whole calls of ROWS inputs with zero rows.
    let padded = n.div_ceil(ROWS) * ROWS;
    let mut inputs = vec![0u32; padded * pairs];
    inputs
        .par_chunks_mut(pairs.max(1))
        .zip(x.par_chunks(cols.max(1)))
        // SAFETY: `matmul_t` checked `available`, so AVX-512F, BW and BF16 are here; each chunk holds `cols.div_ceil(2)` pairs for a row of `cols`.
        .for_each(|(out, row)| unsafe { x86::round_pairs(row, out) });
    let kernel = Pairs {
        w,
        cols,
        pairs,
        inputs: &inputs,
    };
    panels::by_panels(&kernel, rows, n)
}

/// The bf16 products by panels: weights packed pair-major, inputs as rounded bf16 pairs
/// (`pairs` per row, padded to whole calls).
#[cfg(target_arch = "x86_64")]
struct Pairs<'a> {
    w: &'a [bf16],
    cols: usize,
    pairs: usize,
    inputs: &'a [u32],
}

#[cfg(target_arch = "x86_64")]
impl PanelKernel for Pairs<'_> {
    type Packed = u32;
    const ROWS: usize = ROWS;

    fn packed_len(&self) -> usize {
        self.pairs * PANEL
    }

    fn pack(&self, first: usize, count: usize, packed: &mut [u32]) {
        let rows = &self.w[first * self.cols..(first + count) * self.cols];
        // SAFETY: AVX-512F and BW are here (`available`, checked by `matmul_t`); the panel's
        // rows are whole rows of `w`.
        unsafe { x86::pack(rows, self.cols, packed) };
    }

    fn prefetch(&self, first: usize, part: usize, parts: usize) {
        let next = self.w.get(first * self.cols..).unwrap_or(&[]);
        panels::x86::prefetch(&next[..next.len().min(PANEL * self.cols)], part, parts);
    }

    unsafe fn multiply(&self, packed: &[u32], start: usize, out: Out) {
        let inputs = &self.inputs[start * self.pairs..(start + ROWS) * self.pairs];
        // SAFETY: AVX-512F and AVX512-BF16 are here (`available`); `inputs` holds ROWS rows of
        // `pairs` (padded); `out` is the caller's to write.
        unsafe { x86::kernel(packed, inputs, self.pairs, out) };
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::ROWS;
    use crate::cpu::panels::x86::{pack_transposed, store};
    use crate::cpu::panels::{Out, PANEL};
    use half::bf16;
    use std::arch::x86_64::*;

    /// Sixteen f32 lanes rounded to bf16 (to nearest even, NaNs kept quiet: bit for bit what
    /// `half::bf16::from_f32` gives), as the bf16 bits in the low half of each 32-bit lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn round_lanes(v: __m512) -> __m512i {
        let bits = _mm512_castps_si512(v);
        let high = _mm512_srli_epi32::<16>(bits);
        let odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
        let up = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd);
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, up));
        let magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fff_ffff));
        let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f80_0000));
        let quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
        _mm512_mask_mov_epi32(rounded, nan, quiet)
    }

    /// `row` rounded to bf16 as [`round_lanes`] rounds, into `out` as pairs: pair `p` holds
    /// columns `2p` (low half) and `2p + 1` (high half, 0 past an odd end).
    ///
    /// # Safety
    /// AVX-512F and AVX-512BW must be present; `out.len() == row.len().div_ceil(2)`
    /// (asserted).
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(crate) unsafe fn round_pairs(row: &[f32], out: &mut [u32]) {
        assert_eq!(out.len(), row.len().div_ceil(2));
        let whole = row.len() / 16 * 16;
        let dst = out.as_mut_ptr().cast::<u16>();
        // SAFETY: lanes `i..i + 16` of `row` exist for `i < whole`, and `out` holds
        // `row.len()` halves or one more.
        unsafe {
            for i in (0..whole).step_by(16) {
                let kept = round_lanes(_mm512_loadu_ps(row.as_ptr().add(i)));
                _mm256_storeu_si256(dst.add(i).cast(), _mm512_cvtepi32_epi16(kept));
            }
        }
        for (i, &v) in row.iter().enumerate().skip(whole) {
            // SAFETY: i < row.len() <= 2 * out.len().
            unsafe { *dst.add(i) = bf16::from_f32(v).to_bits() };
        }
        if row.len() % 2 == 1 {
            out[row.len() / 2] &= 0xffff;
        }
    }

    /// The `count <= PANEL` rows `w` (of `cols`) pair-major into `packed`: lane `j` of pair `p`
    /// is row `j`'s columns `2p` (low half) and `2p + 1` (high half); missing rows and an odd
    /// last column are 0. Sixteen rows by sixteen pairs are loaded and transposed at a time.
    ///
    /// # Safety
    /// AVX-512F and AVX-512BW must be present; `w.len()` is a multiple of `cols` up to
    /// `PANEL * cols` and `packed.len() == cols.div_ceil(2) * PANEL` (asserted).
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn pack(w: &[bf16], cols: usize, packed: &mut [u32]) {
        let count = w.len() / cols.max(1);
        let pairs = cols.div_ceil(2);
        assert!(count <= PANEL && count * cols == w.len());
        assert_eq!(packed.len(), pairs * PANEL);
        let src = w.as_ptr().cast::<u16>();
        // SAFETY: row r < count of `w`, pairs `block..block + width` inside it (an odd last
        // column: its missing half is masked); masked lanes are not read.
        let load = |r: usize, block: usize, width: usize| unsafe {
            let halves = (cols - 2 * block).min(2 * width);
            let mask = (u64::MAX >> (64 - halves)) as __mmask32;
            _mm512_maskz_loadu_epi16(mask, src.add(r * cols + 2 * block).cast())
        };
        // SAFETY: `load` reads rows below `count`, pairs below `pairs`; `packed` holds
        // `pairs * PANEL` lanes (asserted).
        unsafe { pack_transposed(count, pairs, packed, load) };
    }

    /// The sums of ROWS inputs against a packed panel: output `i`'s column `j` is the sum over
    /// pairs `p` of the pair products of input `i` and panel row `j`; rows `live..` and columns
    /// `count..` are not stored.
    ///
    /// # Safety
    /// AVX-512F and AVX512-BF16 must be present. `packed` holds `pairs * PANEL` lanes and
    /// `inputs` `ROWS * pairs` (asserted); `out` names `live <= ROWS` writable rows of
    /// `count <= PANEL` columns.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn kernel(packed: &[u32], inputs: &[u32], pairs: usize, out: Out) {
        assert!(packed.len() >= pairs * PANEL && inputs.len() >= ROWS * pairs);
        assert!(out.live <= ROWS && out.count <= PANEL);
        let (w, x) = (packed.as_ptr(), inputs.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
        // SAFETY: pair p < pairs of the panel and of each input row: in the asserted ranges.
        // The transmutes reinterpret 512 bits of bf16 pairs as the vector type `vdpbf16ps`
        // takes.
        unsafe {
            for p in 0..pairs {
                let w0 = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    w.add(p * PANEL).cast(),
                ));
                let w1 = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    w.add(p * PANEL + 16).cast(),
                ));
                for (i, sums) in acc.iter_mut().enumerate() {
                    let pair = _mm512_set1_epi32(*x.add(i * pairs + p) as i32);
                    let pair = std::mem::transmute::<__m512i, __m512bh>(pair);
                    sums[0] = _mm512_dpbf16_ps(sums[0], w0, pair);
                    sums[1] = _mm512_dpbf16_ps(sums[1], w1, pair);
                }
            }
        }
        // SAFETY: `out` is writable as the caller promised.
        unsafe { store(&acc, out) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::gemv::round_to_bf16;

    /// Shapes with a partial panel, partial calls of inputs and an odd column count match the
    /// f64 product of the stored weights and the inputs rounded to bf16.
    #[test]
    fn matches_the_f64_product_of_bf16_inputs() {
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
            let w: Vec<bf16> = (0..rows * cols)
                .map(|i| bf16::from_f32(value(i, 3)))
                .collect();
            let x: Vec<f32> = (0..n * cols).map(|i| value(i, 5)).collect();
            let Some(y) = matmul_t(Isa::Avx512Bf16, &w, rows, cols, &x, n) else {
                return; // no avx512_bf16 here: the GEMM falls back, tested with Matrix
            };
            for t in 0..n {
                for o in 0..rows {
                    let want: f64 = (0..cols)
                        .map(|i| w[o * cols + i].to_f64() * round_to_bf16(x[t * cols + i]) as f64)
                        .sum();
                    let got = y[t * rows + o] as f64;
                    let tol = 1e-6 * (cols as f64).sqrt() * (1.0 + want.abs());
                    assert!(
                        (got - want).abs() <= tol,
                        "{rows}x{cols} n={n} [{t}, {o}]: {got} against {want}"
                    );
                }
            }
        }
    }

    /// The vector rounding of inputs gives `half`'s bf16 bits exactly: ties to even both ways,
    /// overflow to infinity, NaNs quiet, subnormals, and rows of every length around a vector.
    #[test]
    fn inputs_round_as_half_rounds_them() {
        #[cfg(target_arch = "x86_64")]
        if available(Isa::Avx512Bf16) {
            let specials = [
                f32::from_bits(0x3f80_8000), // a tie, even below
                f32::from_bits(0x3f81_8000), // a tie, odd below
                f32::from_bits(0x3f80_8001),
                f32::from_bits(0x7f7f_ffff), // rounds to infinity
                f32::from_bits(0xff7f_ffff),
                f32::from_bits(0x7f80_0001), // a signalling NaN
                f32::from_bits(0xffc0_0000),
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::from_bits(0x0000_8001), // a subnormal
                -0.0,
            ];
            let mut values: Vec<f32> = specials.to_vec();
            values.extend((0..100).map(|i| (i as f32 * 0.7319).sin() * 1e3));
            for len in [1, 15, 16, 17, 33, values.len()] {
                let row = &values[..len];
                let mut pairs = vec![u32::MAX; len.div_ceil(2)];
                // SAFETY: `available` means AVX-512F and BW are here; `pairs` has the length asked.
                unsafe { x86::round_pairs(row, &mut pairs) };
                for (i, &v) in row.iter().enumerate() {
                    let got = (pairs[i / 2] >> (16 * (i % 2))) as u16;
                    let want = bf16::from_f32(v).to_bits();
                    assert_eq!(got, want, "value {i} ({v:e}) of {len}");
                }
                if len % 2 == 1 {
                    assert_eq!(pairs[len / 2] >> 16, 0, "the pad of an odd row is 0");
                }
            }
        }
    }
}
