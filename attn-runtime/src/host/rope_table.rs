//! The cos/sin tables generated kernels read for RoPE: one row of `dim/2` values per position,
//! with the attention factor (and, under xPos, each pair's decay for the table's operand)
//! applied, computed in f64 (positions of 10^5 and more are real).

use crate::error::RuntimeError;
use attn_dsl::reference::rope::{decay, decay_exponent};
use codegen::plan::{Frequencies, RopePrologue};

pub use attn_dsl::reference::rope::Side;

/// Positions between direct evaluations of sin and cos.
const ANCHOR: usize = 64;

/// Largest natural log of an xPos factor the f32 tables hold ([`decay_exponent`]): `e^64` is
/// about 6e27, so a rotated value stays finite (and the matching small factor normal) for inputs
/// up to about 5e10 in magnitude.
pub const MAX_DECAY_EXPONENT: f64 = 64.0;

/// Tables for a range of positions.
#[derive(Clone)]
pub struct RopeTables {
    /// `cos[(pos - pos0) * half + i]`.
    pub cos: Vec<f32>,
    /// `sin[(pos - pos0) * half + i]`.
    pub sin: Vec<f32>,
    /// The first position.
    pub pos0: i64,
}

/// The tables of one call's queries and keys, which under xPos differ (their factors are
/// inverse) and share the origin the factors are measured from.
pub struct QkTables {
    /// The queries' tables.
    pub query: RopeTables,
    /// The keys' tables, when they differ from the queries' (xPos).
    pub key: Option<RopeTables>,
}

impl QkTables {
    /// Tables for a call's positions `first..end`, xPos factors measured from their middle (so
    /// they stay near 1); `total_len` (`Skv + p0`) picks the dynamic NTK base. Refuses a span
    /// whose factors leave the tables' range.
    pub fn new(
        rope: &RopePrologue,
        first: i64,
        end: i64,
        total_len: u64,
    ) -> Result<Self, RuntimeError> {
        let origin = first + (end - first) / 2;
        check_decay(rope, first, end, origin)?;
        let table = |side| RopeTables::new(rope, first, end, total_len, side, origin);
        Ok(QkTables {
            query: table(Side::Query),
            key: rope.rope.xpos.map(|_| table(Side::Key)),
        })
    }

    /// The keys' tables.
    pub fn key(&self) -> &RopeTables {
        self.key.as_ref().unwrap_or(&self.query)
    }

    /// The queries' and the keys' tables, apart.
    pub fn split(self) -> [RopeTables; 2] {
        let key = self.key.unwrap_or_else(|| self.query.clone());
        [self.query, key]
    }
}

/// Refuses positions `first..end` whose xPos factors, measured from `origin`, leave the f32
/// tables' range ([`MAX_DECAY_EXPONENT`]).
pub fn check_decay(
    rope: &RopePrologue,
    first: i64,
    end: i64,
    origin: i64,
) -> Result<(), RuntimeError> {
    let far = (first - origin).abs().max((end - 1 - origin).abs());
    let exponent = decay_exponent(&rope.rope, far as f64);
    if exponent > MAX_DECAY_EXPONENT {
        let x = rope.rope.xpos.unwrap_or(attn_dsl::XPos::PAPER);
        let reach = MAX_DECAY_EXPONENT / decay_exponent(&rope.rope, 1.0);
        return Err(RuntimeError::Data(format!(
            "xpos: positions {first} to {} lie up to {far} positions from {origin}, where \
             q and k are scaled by e^{exponent:.0} (scale_base = {}, gamma = {}); allowed: \
             positions within {reach:.0} of it (a span of {:.0} in one call; a cache counts \
             from position 0)",
            end - 1,
            x.scale_base,
            x.gamma,
            2.0 * reach
        )));
    }
    Ok(())
}

impl RopeTables {
    /// Tables for positions `first..end` of operand `side`; `total_len` (`Skv + p0`) picks the
    /// dynamic NTK base; xPos factors are measured from `origin` (the same for a call's queries
    /// and keys, in range by [`check_decay`]), and are 1 without xPos.
    pub fn new(
        rope: &RopePrologue,
        first: i64,
        end: i64,
        total_len: u64,
        side: Side,
        origin: i64,
    ) -> Self {
        let freqs = match &rope.frequencies {
            Frequencies::Static(f) => f.clone(),
            Frequencies::PerLaunch => attn_dsl::reference::rope::inv_freq(&rope.rope, total_len),
        };
        let half = freqs.len();
        let n = (end - first).max(0) as usize;
        let (mut cos, mut sin) = (vec![0f32; n * half], vec![0f32; n * half]);
        let a = rope.attention_factor;
        // xPos's factor of each (row, pair), 1 without it.
        let decays: Vec<f64> = match rope.rope.xpos {
            Some(_) => (first..end)
                .flat_map(|p| decay(&rope.rope, (p - origin) as f64, side).unwrap_or_default())
                .collect(),
            None => Vec::new(),
        };
        let factor = |at: usize| a * decays.get(at).copied().unwrap_or(1.0);
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
                let at = row * half + i;
                cos[at] = (c * factor(at)) as f32;
                sin[at] = (s * factor(at)) as f32;
            }
        }
        RopeTables {
            cos,
            sin,
            pos0: first,
        }
    }
}
