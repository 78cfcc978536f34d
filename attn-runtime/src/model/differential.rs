//! Differential heads inside a model (`differential = lambda(init = L)`): the layer's value rows
//! given to both components of each head before its component heads attend (and are cached),
//! and the components' outputs paired, `O_2h - lambda O_2h+1`, each head normed (`subln`, the
//! DIFF Transformer's RMSNorm) and scaled by `1 - init` before the output projection.

use super::sublayers::Norm;
use crate::error::RuntimeError;
use crate::ops::LayerOps;

/// One layer's pairing: lambda (from its four vectors, fixed once loaded), the constant and
/// the per-head norm.
#[derive(Clone, Debug)]
pub(crate) struct DifferentialWeights {
    pub lambda: f32,
    pub init: f64,
    /// The length of each of lambda's four vectors (`head_dim`).
    pub vector_len: usize,
    /// An RMSNorm over each head's `v_head_dim` values.
    pub subln: Norm,
}

impl DifferentialWeights {
    /// The layer's weights from lambda's vectors `[q1, k1, q2, k2]`; lambda must be finite.
    pub fn new(vectors: [&[f32]; 4], init: f64, subln: Norm) -> Result<Self, RuntimeError> {
        let wide: Vec<Vec<f64>> = vectors
            .iter()
            .map(|v| v.iter().map(|x| f64::from(*x)).collect())
            .collect();
        let lambda = attn_dsl::Differential { lambda_init: init }
            .lambda([&wide[0], &wide[1], &wide[2], &wide[3]]);
        if !(lambda.is_finite() && lambda.abs() <= f64::from(f32::MAX)) {
            return Err(RuntimeError::Data(format!(
                "differential heads: lambda's vectors give lambda = {lambda}; allowed: a finite \
                 f32"
            )));
        }
        Ok(DifferentialWeights {
            lambda: lambda as f32,
            init,
            vector_len: vectors[0].len(),
            subln,
        })
    }

    /// Rows of `[heads, dim]` values as rows of `[2 heads, dim]`, each head given twice.
    pub fn values_per_component(rows: &[f32], dim: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(2 * rows.len());
        for head in rows.chunks(dim.max(1)) {
            out.extend_from_slice(head);
            out.extend_from_slice(head);
        }
        out
    }

    /// Rows of `[2 heads, dim]` component outputs as rows of `[heads, dim]`: paired, normed per
    /// head and scaled by `1 - init`.
    pub fn pair(
        &self,
        ops: &dyn LayerOps,
        rows: &[f32],
        dim: usize,
    ) -> Result<Vec<f32>, RuntimeError> {
        let mut paired = Vec::with_capacity(rows.len() / 2);
        for pair in rows.chunks(2 * dim.max(1)) {
            let (a, b) = pair.split_at(dim.min(pair.len()));
            paired.extend(a.iter().zip(b).map(|(a, b)| a - self.lambda * b));
        }
        let mut normed = self.subln.apply(ops, &paired)?;
        let scale = (1.0 - self.init) as f32;
        normed.iter_mut().for_each(|x| *x *= scale);
        Ok(normed)
    }
}
