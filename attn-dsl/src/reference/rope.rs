//! Rotary position embeddings in f64, with every scaling of docs/semantics.md (as the
//! transformers library defines them).

use super::Array;
use crate::spec::{Rope, RopeScaling};
use std::f64::consts::PI;

/// The inverse frequencies `inv_freq[i]`, `i < dim/2`, after scaling. `seq_len` is the current
/// total length (`Skv + position_offset`); only dynamic NTK scaling and LongRoPE read it.
pub fn inv_freq(rope: &Rope, seq_len: u64) -> Vec<f64> {
    let dim = f64::from(rope.dim);
    let half = rope.dim as usize / 2;
    let plain = |base: f64| -> Vec<f64> {
        (0..half)
            .map(|i| base.powf(-(2.0 * i as f64) / dim))
            .collect()
    };
    match rope.scaling {
        RopeScaling::None => plain(rope.base),
        RopeScaling::LongRope(ref l) => {
            let factors = if seq_len > l.original_max_position {
                &l.long
            } else {
                &l.short
            };
            plain(rope.base)
                .iter()
                .zip(factors.iter())
                .map(|(f, s)| f / s)
                .collect()
        }
        RopeScaling::Linear { factor } => plain(rope.base).iter().map(|f| f / factor).collect(),
        RopeScaling::Ntk { factor } => plain(rope.base * factor.powf(dim / (dim - 2.0))),
        RopeScaling::Dynamic {
            factor,
            original_max_position,
        } => {
            let orig = original_max_position as f64;
            let len = (seq_len as f64).max(orig);
            if len > orig {
                let base =
                    rope.base * (factor * len / orig - (factor - 1.0)).powf(dim / (dim - 2.0));
                plain(base)
            } else {
                plain(rope.base)
            }
        }
        RopeScaling::Yarn(y) => {
            let orig = y.original_max_position as f64;
            let correction = |rotations: f64| {
                dim * (orig / (2.0 * PI * rotations)).ln() / (2.0 * rope.base.ln())
            };
            let (lo, hi) = (correction(y.beta_fast), correction(y.beta_slow));
            let (lo, hi) = match y.truncate {
                true => (lo.floor(), hi.ceil()),
                false => (lo, hi),
            };
            let (lo, mut hi) = (lo.max(0.0), hi.min(dim - 1.0));
            if lo == hi {
                hi += 0.001;
            }
            plain(rope.base)
                .iter()
                .enumerate()
                .map(|(i, &f)| {
                    let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                    (f / y.factor) * ramp + f * (1.0 - ramp)
                })
                .collect()
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            let orig = original_max_position as f64;
            let low_wavelen = orig / low_freq_factor;
            let high_wavelen = orig / high_freq_factor;
            plain(rope.base)
                .iter()
                .map(|&f| {
                    let wavelen = 2.0 * PI / f;
                    if wavelen > low_wavelen {
                        f / factor
                    } else if wavelen < high_wavelen {
                        f
                    } else {
                        let t = (orig / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - t) * f / factor + t * f
                    }
                })
                .collect()
        }
    }
}

/// The factor cos and sin are multiplied by: YaRN's and LongRoPE's attention factors, 1
/// otherwise.
pub fn attention_factor(rope: &Rope) -> f64 {
    let g = |s: f64, m: f64| if s > 1.0 { 0.1 * m * s.ln() + 1.0 } else { 1.0 };
    match rope.scaling {
        RopeScaling::Yarn(y) => match (y.mscale, y.mscale_all_dim) {
            (Some(m), Some(all)) => g(y.factor, m) / g(y.factor, all),
            _ => g(y.factor, 1.0),
        },
        RopeScaling::LongRope(ref l) => l.attention_factor,
        _ => 1.0,
    }
}

/// Rotates the first `rope.dim` entries of `x` for position `pos`.
pub fn rotate(rope: &Rope, x: &mut [f64], pos: i64, inv_freq: &[f64], factor: f64) {
    let pairing = rope.layout.pairing(rope.dim);
    for (i, &f) in inv_freq.iter().enumerate() {
        let angle = pos as f64 * f;
        let (sin, cos) = (angle.sin() * factor, angle.cos() * factor);
        let (a, b) = pairing.pair(i);
        let (xa, xb) = (x[a], x[b]);
        x[a] = xa * cos - xb * sin;
        x[b] = xb * cos + xa * sin;
    }
}

/// Which operand of the score a rotated row is: xPos scales queries and keys oppositely.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// A query row.
    Query,
    /// A key row.
    Key,
}

/// xPos's factor on each rotated pair of a row on `side` at `pos`: `zeta_i^(pos / scale_base)`
/// for a query, its inverse for a key (docs/semantics.md); `None` without xPos. Positions may
/// be measured from any common origin: it cancels in every score.
pub fn decay(rope: &Rope, pos: f64, side: Side) -> Option<Vec<f64>> {
    let x = rope.xpos?;
    let power = match side {
        Side::Query => pos / x.scale_base,
        Side::Key => -pos / x.scale_base,
    };
    Some(
        x.zetas(rope.dim as usize / 2)
            .iter()
            .map(|z| z.powf(power))
            .collect(),
    )
}

/// The natural log of the largest xPos factor (or its inverse) that a row `distance` positions
/// from the origin gets: `distance * ln(1 / zeta_0) / scale_base`; 0 without xPos. Callers
/// bound it to their float format's range.
pub fn decay_exponent(rope: &Rope, distance: f64) -> f64 {
    rope.xpos.map_or(0.0, |x| {
        let slowest = x
            .zetas(rope.dim as usize / 2)
            .first()
            .copied()
            .unwrap_or(1.0);
        distance.abs() * -slowest.ln() / x.scale_base
    })
}

/// Applies RoPE (with xPos's decay for `side`) to every row of `x` (`[..., S, D]`), row `s` at
/// position `positions[s]`.
pub fn apply(rope: &Rope, x: &Array, positions: &[i64], seq_len: u64, side: Side) -> Array {
    each_row(rope, x, positions, seq_len, side, false)
}

/// The transpose of [`apply`], which takes a gradient back to the unrotated row: the rotation
/// by the negated position, times the same decay.
pub fn apply_transposed(
    rope: &Rope,
    x: &Array,
    positions: &[i64],
    seq_len: u64,
    side: Side,
) -> Array {
    each_row(rope, x, positions, seq_len, side, true)
}

fn each_row(
    rope: &Rope,
    x: &Array,
    positions: &[i64],
    seq_len: u64,
    side: Side,
    transposed: bool,
) -> Array {
    let freqs = inv_freq(rope, seq_len);
    let factor = attention_factor(rope);
    let pairing = rope.layout.pairing(rope.dim);
    let shape = x.shape();
    let s_axis = shape.len() - 2;
    let mut out = x.clone();
    let mut lead = vec![0; s_axis + 1];
    let rows: usize = shape[..=s_axis].iter().product();
    for r in 0..rows {
        let mut rest = r;
        for axis in (0..=s_axis).rev() {
            lead[axis] = rest % shape[axis];
            rest /= shape[axis];
        }
        let pos = positions[lead[s_axis]];
        let row = out.row_mut(&lead);
        let angle_pos = if transposed { -pos } else { pos };
        rotate(rope, row, angle_pos, &freqs, factor);
        for (i, d) in decay(rope, pos as f64, side)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let (a, b) = pairing.pair(i);
            row[a] *= d;
            row[b] *= d;
        }
    }
    out
}
