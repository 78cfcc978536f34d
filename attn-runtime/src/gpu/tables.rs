//! A forward or backward call's RoPE tables as the GPU kernels read them: the queries', and
//! the keys' where they differ (xPos scales keys by the inverse of the queries' factors).

use super::Scratch;
use crate::RuntimeError;
use crate::host::rope_table::QkTables;
use codegen::plan::KernelPlan;

/// The tables of a call's positions, empty without RoPE.
#[derive(Clone, Debug, Default)]
pub struct CallTables {
    /// The queries' cosines: rows of `rope_dim / 2` f32 from position `pos0`.
    pub cos: Vec<f32>,
    /// The queries' sines.
    pub sin: Vec<f32>,
    /// The keys' cosines and sines, empty where they are the queries' (no xPos).
    pub key: [Vec<f32>; 2],
    /// The position of the tables' first row.
    pub pos0: i64,
}

impl CallTables {
    /// The tables of positions `first..end` (`total_len`, `Skv + p0`, picks the dynamic NTK
    /// base); refuses positions past xPos's range.
    pub(crate) fn of(
        plan: &KernelPlan,
        (first, end): (i64, i64),
        total_len: u64,
    ) -> Result<Self, RuntimeError> {
        let Some(rope) = &plan.rope else {
            return Ok(CallTables::default());
        };
        let QkTables { query, key } = QkTables::new(rope, first, end, total_len)?;
        Ok(CallTables {
            cos: query.cos,
            sin: query.sin,
            key: key.map(|k| [k.cos, k.sin]).unwrap_or_default(),
            pos0: first,
        })
    }

    /// The tables on `s`'s device: `[cos, sin, key cos, key sin]` addresses (0 for empty ones;
    /// the keys' are the queries' without xPos).
    pub(crate) fn upload(&self, s: &mut Scratch) -> Result<[i64; 4], RuntimeError> {
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let [cos, sin] = [&self.cos, &self.sin].map(|t| bytes(t));
        let (cos, sin) = (s.upload_or_null(&cos)?, s.upload_or_null(&sin)?);
        if self.key[0].is_empty() {
            return Ok([cos, sin, cos, sin]);
        }
        let [key_cos, key_sin] = [&self.key[0], &self.key[1]].map(|t| bytes(t));
        Ok([
            cos,
            sin,
            s.upload_or_null(&key_cos)?,
            s.upload_or_null(&key_sin)?,
        ])
    }
}
