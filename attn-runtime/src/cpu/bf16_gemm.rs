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
use half::bf16;
use rayon::prelude::*;

/// Weight rows per panel: two vectors of sixteen f32 lanes.
const PANEL: usize = 32;
/// Inputs per kernel call.
const ROWS: usize = 12;
/// Panels computed before their outputs are copied out (2048 weight rows).
const BATCH: usize = 64;

/// Whether [`matmul_t`] runs here: `avx512_bf16`, and AVX-512 chosen (`ATTN_CPU_ISA`).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    if Isa::chosen() == Isa::Avx512 && std::arch::is_x86_feature_detected!("avx512bf16") {
        return true;
    }
    false
}

/// `n x rows` outputs `x W^T` for `n x cols` inputs `x` and the `rows x cols` bf16 matrix `w`
/// (both row-major); `None` where [`available`] is false.
pub(crate) fn matmul_t(
    w: &[bf16],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
) -> Option<Vec<f32>> {
    if !available() {
        return None;
    }
    assert_eq!(w.len(), rows * cols, "weights of {rows} x {cols}");
    assert_eq!(x.len(), n * cols, "inputs of {n} x {cols}");
    let pairs = cols.div_ceil(2);
    // Inputs as bf16 pairs, padded to whole calls of ROWS inputs with zero rows.
    let padded = n.div_ceil(ROWS) * ROWS;
    let mut inputs = vec![0u32; padded * pairs];
    inputs
        .par_chunks_mut(pairs.max(1))
        .zip(x.par_chunks(cols.max(1)))
        .for_each(|(out, row)| {
            for (o, pair) in out.iter_mut().zip(row.chunks(2)) {
                let lo = bf16::from_f32(pair[0]).to_bits() as u32;
                let hi = pair
                    .get(1)
                    .map_or(0, |&v| bf16::from_f32(v).to_bits() as u32);
                *o = lo | hi << 16;
            }
        });
    let mut y = vec![0f32; n * rows];
    // Panels in batches, each batch's outputs copied into y before the next: the panels'
    // outputs never hold more than a batch of columns.
    let all = rows.div_ceil(PANEL);
    for batch in (0..all).step_by(BATCH) {
        let panels: Vec<Vec<f32>> = (batch..all.min(batch + BATCH))
            .into_par_iter()
            .map(|panel| {
                let first = panel * PANEL;
                let count = PANEL.min(rows - first);
                let packed = pack(&w[first * cols..(first + count) * cols], cols, pairs);
                let mut out = vec![0f32; padded * PANEL];
                for start in (0..padded).step_by(ROWS) {
                    // SAFETY: `available` checked AVX-512F and AVX512-BF16; `packed` holds
                    // `pairs * PANEL` lanes, `inputs` ROWS rows of `pairs` from `start`, and
                    // `out` ROWS rows of PANEL from `start`.
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        x86::kernel(
                            &packed,
                            &inputs[start * pairs..(start + ROWS) * pairs],
                            pairs,
                            &mut out[start * PANEL..(start + ROWS) * PANEL],
                        )
                    };
                }
                out
            })
            .collect();
        y.par_chunks_mut(rows.max(1))
            .enumerate()
            .for_each(|(t, dst)| {
                for (i, out) in panels.iter().enumerate() {
                    let first = (batch + i) * PANEL;
                    let count = PANEL.min(rows - first);
                    dst[first..first + count].copy_from_slice(&out[t * PANEL..t * PANEL + count]);
                }
            });
    }
    Some(y)
}

/// The `count <= PANEL` rows `w` (of `cols`) pair-major: lane `j` of pair `p` is row `j`'s
/// columns `2p` (low half) and `2p + 1` (high half); missing rows and an odd last column are 0.
fn pack(w: &[bf16], cols: usize, pairs: usize) -> Vec<u32> {
    let mut packed = vec![0u32; pairs * PANEL];
    for (j, row) in w.chunks_exact(cols.max(1)).enumerate() {
        for (p, pair) in row.chunks(2).enumerate() {
            let lo = pair[0].to_bits() as u32;
            let hi = pair.get(1).map_or(0, |v| v.to_bits() as u32);
            packed[p * PANEL + j] = lo | hi << 16;
        }
    }
    packed
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{PANEL, ROWS};
    use std::arch::x86_64::*;

    /// `out[i * PANEL + j] = sum_p` of the pair products of input `i` and panel row `j`.
    ///
    /// # Safety
    /// AVX-512F and AVX512-BF16 must be present. `packed` holds `pairs * PANEL` lanes,
    /// `inputs` `ROWS * pairs` and `out` `ROWS * PANEL` (asserted).
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn kernel(packed: &[u32], inputs: &[u32], pairs: usize, out: &mut [f32]) {
        assert!(
            packed.len() >= pairs * PANEL
                && inputs.len() >= ROWS * pairs
                && out.len() >= ROWS * PANEL
        );
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
            for (i, sums) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(i * PANEL), sums[0]);
                _mm512_storeu_ps(out.as_mut_ptr().add(i * PANEL + 16), sums[1]);
            }
        }
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
        for (rows, cols, n) in [(1, 1, 1), (33, 7, 13), (70, 64, 25), (40, 301, 9)] {
            let w: Vec<bf16> = (0..rows * cols)
                .map(|i| bf16::from_f32(value(i, 3)))
                .collect();
            let x: Vec<f32> = (0..n * cols).map(|i| value(i, 5)).collect();
            let Some(y) = matmul_t(&w, rows, cols, &x, n) else {
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
}
