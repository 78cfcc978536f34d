//! Differential heads (`differential = lambda(init = L)`) through candle: the component heads
//! as attn's op, the pairing and lambda as candle operations, so that candle's autograd carries
//! the gradients of lambda's vectors and sums each value head's two copies.

use super::attention_learned;
use crate::runtime::Variant;
use candle_core::{Result, Tensor};
use std::sync::Arc;

/// Differential attention: `components` is the variant of the spec without `differential`
/// (`Variant::new(spec.differential_components())`), q `[B, heads, Sq, D]`, k
/// `[B, kv_heads, Skv, D]`, v `[B, kv_heads / 2, Skv, Dv]`, `lambda` the vectors
/// `[lambda_q1, lambda_k1, lambda_q2, lambda_k2]` (`[D]` each) and `lambda_init` the spec's
/// `init`. Out `[B, heads / 2, Sq, Dv]`.
pub fn differential(
    components: &Arc<Variant>,
    [q, k, v]: [&Tensor; 3],
    lambda: [&Tensor; 4],
    lambda_init: f64,
    learned: &[(&str, &Tensor)],
    position_offset: i64,
) -> Result<Tensor> {
    let both = values_per_component(v)?;
    let o = attention_learned(components, q, k, &both, learned, position_offset)?;
    combine(&o, lambda, lambda_init)
}

/// v `[B, H, S, D]` with each head given twice, `[B, 2H, S, D]` (its gradient sums the two).
pub(crate) fn values_per_component(v: &Tensor) -> Result<Tensor> {
    let (b, h, s, d) = v.dims4()?;
    v.unsqueeze(2)?
        .broadcast_as((b, h, 2, s, d))?
        .reshape((b, 2 * h, s, d))
}

/// The components' outputs `[B, 2H, S, D]` paired: `O_2h - lambda O_2h+1`, with
/// `lambda = exp(q1 . k1) - exp(q2 . k2) + init`, computed in f32 (lambda's gradient sums over
/// every output element) and given back in o's dtype.
pub(crate) fn combine(o: &Tensor, lambda: [&Tensor; 4], init: f64) -> Result<Tensor> {
    let (b, h2, s, d) = o.dims4()?;
    let f32 = candle_core::DType::F32;
    let [q1, k1, q2, k2] = lambda.map(|t| t.to_dtype(f32));
    let lambda =
        ((q1? * k1?)?.sum_all()?.exp()? - (q2? * k2?)?.sum_all()?.exp()?)?.affine(1.0, init)?;
    let pairs = o.to_dtype(f32)?.reshape((b, h2 / 2, 2, s, d))?;
    let first = pairs.narrow(2, 0, 1)?.squeeze(2)?;
    let second = pairs.narrow(2, 1, 1)?.squeeze(2)?;
    (first - second.broadcast_mul(&lambda)?)?.to_dtype(o.dtype())
}
