//! Where a tile's weights may be nonzero, row by row and column by column: the spans the
//! backward's products take (`microkernels::spanned_pv`) on tiles a mask cuts, so that they
//! skip the keys (or query rows) whose weights are all zero.

use super::microkernels::Isa;
use codegen::plan::K_TILE;

const K: usize = K_TILE as usize;

/// The spans [`spanned_pv`](super::microkernels::spanned_pv) takes, of two tiles of `rows <= K`
/// rows of `K` values (`cols <= K` of them used) where a weight is nonzero if it is in either
/// tile: `by_row[2r..2r + 2]` the columns from the first to one past the last nonzero weight of
/// row `r`, `by_col[2c..2c + 2]` the rows from the first to one past the last nonzero weight of
/// column `c` (`0..0` where all are zero; NaN counts as nonzero). The backward passes P and dS, so a NaN that reaches either
/// still reaches the gradients. Only the AVX-512 kernels use spans, so only there are they
/// computed: `false` elsewhere, with the arrays left as they were.
pub fn nonzero_spans(
    isa: Isa,
    tiles: [&[f32]; 2],
    rows: usize,
    cols: usize,
    by_row: &mut [u32],
    by_col: &mut [u32],
) -> bool {
    let (rows, cols) = (rows.min(K), cols.min(K));
    let tiles = tiles.map(|t| &t[..rows * K]);
    let (by_row, by_col) = (&mut by_row[..2 * rows], &mut by_col[..2 * cols]);
    match isa.vectors() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F (it is `isa`); the slices hold the values above.
        Isa::Avx512 => unsafe { x86::nonzero_spans(tiles, cols, by_row, by_col) },
        _ => return false,
    }
    true
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::K;
    use std::arch::x86_64::*;

    /// [`super::nonzero_spans`]: each row's nonzero weights as a 64-bit mask (four compares a
    /// tile), its span from the mask's lowest and highest bits, and each column's first and
    /// last row from the bits that appear first going down and going up.
    ///
    /// # Safety
    /// A CPU with AVX-512F; each tile holds `by_row.len() / 2` rows of `K` values, `cols <= K`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn nonzero_spans(
        tiles: [&[f32]; 2],
        cols: usize,
        by_row: &mut [u32],
        by_col: &mut [u32],
    ) {
        let used = if cols == K {
            u64::MAX
        } else {
            (1u64 << cols) - 1
        };
        let mut all = [0u64; K];
        let masks = &mut all[..by_row.len() / 2];
        for (r, m) in masks.iter_mut().enumerate() {
            *m = (0..8).fold(0u64, |m, i| {
                let (tile, k) = (tiles[i / 4], i % 4);
                // SAFETY: 16 values from lane 16 k of row r < rows, rows of K = 64.
                let x = unsafe { _mm512_loadu_ps(tile.as_ptr().add(r * K + 16 * k)) };
                let nonzero = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(x, _mm512_setzero_ps());
                m | (u64::from(nonzero) << (16 * k))
            }) & used;
        }
        for (r, m) in masks.iter().enumerate() {
            let span = match m {
                0 => [0, 0],
                m => [m.trailing_zeros(), 64 - m.leading_zeros()],
            };
            by_row[2 * r..2 * r + 2].copy_from_slice(&span);
        }
        by_col.fill(0);
        let (mut seen_down, mut seen_up) = (0u64, 0u64);
        for (r, m) in masks.iter().enumerate() {
            for_each_bit(m & !seen_down, |c| by_col[2 * c] = r as u32);
            seen_down |= m;
        }
        for (r, m) in masks.iter().enumerate().rev() {
            for_each_bit(m & !seen_up, |c| by_col[2 * c + 1] = r as u32 + 1);
            seen_up |= m;
        }
    }

    /// Calls `f` with the index of each set bit of `bits`.
    fn for_each_bit(mut bits: u64, mut f: impl FnMut(usize)) {
        while bits != 0 {
            f(bits.trailing_zeros() as usize);
            bits &= bits - 1;
        }
    }
}

#[cfg(test)]
mod test_tiles {
    use super::K;

    /// Two tiles whose weights are zero outside a band, as a sliding causal window leaves them,
    /// with NaN in the second, once inside the band and once outside it.
    pub(crate) fn banded(rows: usize, cols: usize, seed: f32) -> [Vec<f32>; 2] {
        let mut tiles = [vec![0f32; K * K], vec![0f32; K * K]];
        for r in 0..rows {
            for c in 0..cols {
                if c <= r + 3 && r < c + 20 {
                    tiles[0][r * K + c] = ((r * 7 + c * 3) as f32 * seed).sin();
                    tiles[1][r * K + c] = if c % 5 == 0 {
                        0.0
                    } else {
                        0.5 - tiles[0][r * K + c]
                    };
                }
            }
        }
        tiles[1][9 * K + 8] = f32::NAN;
        tiles[1][2 * K + 40] = f32::NAN;
        tiles
    }
}

#[cfg(test)]
pub(crate) use test_tiles::banded;

#[cfg(test)]
mod tests {
    use super::*;

    /// The spans bound each row's and each column's nonzero weights, in either tile.
    #[test]
    fn spans_cover_every_nonzero_weight_and_no_more() {
        let (rows, cols) = (61, 50);
        let tiles = banded(rows, cols, 0.37);
        let (mut by_row, mut by_col) = ([7u32; 2 * K], [7u32; 2 * K]);
        let isa = Isa::detect();
        if !nonzero_spans(
            isa,
            [&tiles[0], &tiles[1]],
            rows,
            cols,
            &mut by_row,
            &mut by_col,
        ) {
            assert_ne!(isa.vectors(), Isa::Avx512);
            return;
        }
        let nonzero = |r: usize, c: usize| tiles[0][r * K + c] != 0.0 || tiles[1][r * K + c] != 0.0;
        // From the first index to one past the last of those where `keep` holds.
        let span = |n: usize, keep: &dyn Fn(usize) -> bool| {
            let at: Vec<u32> = (0..n).filter(|&i| keep(i)).map(|i| i as u32).collect();
            at.first().map_or([0, 0], |&f| [f, at[at.len() - 1] + 1])
        };
        for r in 0..rows {
            let want = span(cols, &|c| nonzero(r, c));
            assert_eq!(by_row[2 * r..2 * r + 2], want, "row {r}");
        }
        for c in 0..cols {
            let want = span(rows, &|r| nonzero(r, c));
            assert_eq!(by_col[2 * c..2 * c + 2], want, "column {c}");
        }
    }
}
