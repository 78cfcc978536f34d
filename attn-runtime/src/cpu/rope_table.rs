//! The cos/sin tables generated kernels read for RoPE: one row of `dim/2` values per position,
//! with the attention factor applied, computed in f64 (positions of 10^5 and more are real).

use codegen::plan::{Frequencies, RopePrologue};

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
        let (mut cos, mut sin) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
        for p in first..end {
            for f in &freqs {
                let (s, c) = (p as f64 * f).sin_cos();
                cos.push((c * rope.attention_factor) as f32);
                sin.push((s * rope.attention_factor) as f32);
            }
        }
        RopeTables {
            cos,
            sin,
            pos0: first,
        }
    }
}
