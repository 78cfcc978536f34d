//! Deterministic pseudo-random inputs for tests, benchmarks, examples and `attnc bench`:
//! attn-dsl's value sequences, and tensors of them.

pub use attn_dsl::inputs::{XorShift, values, values_f64};

use crate::error::RuntimeError;
use crate::memory::checked_product;
use crate::tensor::Tensor;
use attn_dsl::DType;

/// A `shape` tensor of `dtype` holding [`values`] of `seed` (rounded to the dtype).
pub fn tensor(dtype: DType, shape: &[usize], seed: u64) -> Result<Tensor, RuntimeError> {
    let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let n = checked_product(&dims)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| RuntimeError::Data(format!("a tensor of shape {shape:?} is too large")))?;
    Tensor::from_f32_as(dtype, shape, values(n, seed))
}
