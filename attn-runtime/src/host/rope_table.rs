//! The cos/sin tables generated kernels read for RoPE: one row of `dim/2` values per position,
//! with the attention factor applied, computed in f64 (positions of 10^5 and more are real).

use codegen::plan::{Frequencies, RopePrologue};

/// Positions between direct evaluations of sin and cos.
const ANCHOR: usize = 64;

/// Tables for a range of positions.
pub struct RopeTables {
    /// `cos[(pos - pos0) * half + i]`.
    pub cos: Vec<f32>,
    /// `sin[(pos - pos0) * half + i]`.
    pub sin: Vec<f32>,
    /// The first position.
    pub pos0: i64,
}

impl RopeTables {
    /// Tables for positions `first..end`; `total_len` (`Skv + p0`) picks the dynamic NTK base.
    pub fn new(rope: &RopePrologue, first: i64, end: i64, total_len: u64) -> Self {
        let freqs = match &rope.frequencies {
            Frequencies::Static(f) => f.clone(),
            Frequencies::PerLaunch => attn_dsl::reference::rope::inv_freq(&rope.rope, total_len),
        };
        let half = freqs.len();
        let n = (end - first).max(0) as usize;
        let (mut cos, mut sin) = (vec![0f32; n * half], vec![0f32; n * half]);
        let a = rope.attention_factor;
        for (i, f) in freqs.iter().enumerate() {
            // Rotate by one step per position (angle addition in f64), re-anchored with a direct
            // sin/cos every ANCHOR positions so rounding cannot drift.
            let (step_sin, step_cos) = f.sin_cos();
            let (mut s, mut c) = (0.0, 1.0);
            for (row, p) in (first..end).enumerate() {
                if row % ANCHOR == 0 {
                    (s, c) = (p as f64 * f).sin_cos();
                } else {
                    (s, c) = (s * step_cos + c * step_sin, c * step_cos - s * step_sin);
                }
                cos[row * half + i] = (c * a) as f32;
                sin[row * half + i] = (s * a) as f32;
            }
        }
        RopeTables {
            cos,
            sin,
            pos0: first,
        }
    }
}
