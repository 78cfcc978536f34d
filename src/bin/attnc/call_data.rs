//! `attnc ir --data FILE`: a call's data tensors, read from a safetensors file, for the tile map
//! and the mask picture of a spec whose mask reads them: their values (what the mask keeps,
//! pair by pair) and their ranges (how the kernels classify tiles), for batch item 0 of a call
//! with key 0 at position 0.

use crate::input_file::read_data_tensors;
use attn::AttentionSpec;
use attn::codegen::KernelPlan;
use attn::codegen::plan::{CallShape, DataRanges, TileMap};
use attn::dsl::DataDim;
use attn::dsl::data::CallDims;
use attn::dsl::modifier::ParamValues;
use attn::dsl::modifier::interval::Interval;
use attn::runtime::Learned;
use attn::runtime::learned::{DataVec, data_views};
use std::path::Path;

/// A call's data tensors as the mask reads them.
pub struct CallData {
    /// Each tensor's values, by name.
    pub values: Vec<ParamValues>,
    /// The ranges the kernels classify tiles from (`None` when the mask reads no data).
    ranges: Option<DataRanges>,
    /// The plan of the spec's mask alone, whose buffer the ranges were read from.
    plan: KernelPlan,
}

/// The data tensors of `spec` in `path` for a call of `sq` queries and `skv` keys, checked as a
/// call checks them.
pub fn read(spec: &AttentionSpec, path: &Path, sq: u64, skv: u64) -> Result<CallData, String> {
    let shown = path.display();
    if spec.data.is_empty() {
        return Err(format!(
            "error: --data {shown}: the spec declares no data tensors"
        ));
    }
    let tensors = read_data_tensors(path, spec).map_err(|e| format!("error: --data: {e}"))?;
    // The batch size the tensors give (a `batch` dimension's length), else 1.
    let batch = spec
        .data
        .iter()
        .zip(&tensors)
        .find_map(|(decl, (_, t))| {
            let axis = decl.dims.iter().position(|d| *d == DataDim::Batch)?;
            t.shape.get(axis).copied()
        })
        .unwrap_or(1);
    // The mask alone: parameters and sinks are the score's, and no mask reads them.
    let mask_only = AttentionSpec {
        params: Vec::new(),
        score_mod: None,
        sinks: attn::dsl::Sinks::None,
        ..spec.clone()
    };
    let views = data_views(&tensors);
    let call = CallDims::new(batch, sq as usize, skv as usize, 0);
    let bound = Learned::none()
        .with_data(&views)
        .bind_call(&mask_only, &call)
        .map_err(|e| format!("error: --data {shown}: {e}"))?;
    let plan = KernelPlan::forward(&mask_only);
    let ranges = plan.mask_data_ranges(&bound.params);
    let values = tensors
        .iter()
        .map(|(name, d)| ParamValues {
            name: name.clone(),
            shape: d.shape.clone(),
            values: match &d.values {
                DataVec::I32(v) => v.iter().map(|x| f64::from(*x)).collect(),
                DataVec::F32(v) => v.iter().map(|x| f64::from(*x)).collect(),
            },
        })
        .collect();
    Ok(CallData {
        values,
        ranges,
        plan,
    })
}

impl CallData {
    /// The tile map of batch item 0 at `sq` queries and `skv` keys, classified from the data.
    pub fn tile_map(&self, sq: u64, skv: u64) -> TileMap {
        self.plan.tile_map_of(CallShape {
            sq: sq as i64,
            skv: skv as i64,
            p0: 0,
            query_shift: 0,
            batch: Interval::point(0),
            head: Interval::new(0, i64::from(self.plan.shape.heads) - 1),
            data: self.ranges.as_ref(),
        })
    }
}
