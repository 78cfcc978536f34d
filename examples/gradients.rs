//! Gradients of a custom attention variant: a forward that saves `out` and `lse`, the backward
//! (dq, dk, dv), and a check of a few entries against finite differences of the forward.
//!
//! Run with `cargo run --release --example gradients`.

use attn::inputs::values;
use attn::{Attention, RuntimeError, Tensor, attention};

/// Grouped-query attention with RoPE, a soft cap and a custom distance penalty.
#[attention(
    heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = rope, softcap = 30.0,
    score_mod = |s, b, h, q, k| s - 0.01 * (q - k) as f32
)]
struct Layer;

/// The loss `sum(out * dout)` for queries `q`.
fn loss(q: &[f32], k: &Tensor, v: &Tensor, dout: &[f32], shape: &[usize]) -> f64 {
    let q = Tensor::from_f32(shape, q.to_vec()).expect("shape fits");
    let out = Layer::forward(&q, k, v).expect("valid inputs").to_f32_vec();
    out.iter()
        .zip(dout)
        .map(|(o, g)| f64::from(*o) * f64::from(*g))
        .sum()
}

fn main() -> Result<(), RuntimeError> {
    let (b, s) = (1, 100);
    let q_shape = [b, Layer::HEADS as usize, s, Layer::HEAD_DIM as usize];
    let kv_shape = [b, Layer::KV_HEADS as usize, s, Layer::HEAD_DIM as usize];
    let n_q: usize = q_shape.iter().product();
    let n_kv: usize = kv_shape.iter().product();
    let q_values = values(n_q, 1);
    let q = Tensor::from_f32(&q_shape, q_values.clone())?;
    let k = Tensor::from_f32(&kv_shape, values(n_kv, 2))?;
    let v = Tensor::from_f32(&kv_shape, values(n_kv, 3))?;
    let dout_values = values(n_q, 4);
    let dout = Tensor::from_f32(&q_shape, dout_values.clone())?;

    // The forward keeps what the backward needs: out and the log-sum-exp of each row.
    let saved = Layer::forward_with_lse(&q, &k, &v, 0)?;
    let grads = Layer::backward(&q, &k, &v, &saved.out, &saved.lse, &dout)?;
    let norm = |t: &Tensor| t.to_f32_vec().iter().map(|x| x * x).sum::<f32>().sqrt();
    println!("spec: {}", Layer::SPEC_TEXT);
    println!(
        "|dq| = {:.4}, |dk| = {:.4}, |dv| = {:.4}",
        norm(&grads.dq),
        norm(&grads.dk),
        norm(&grads.dv)
    );

    // dq against central differences of the forward, at a few entries.
    let dq = grads.dq.to_f32_vec();
    let step = 1e-2;
    for index in [777, 12_345, 40_005, n_q - 1] {
        let nudged = |delta: f32| {
            let mut x = q_values.clone();
            x[index] += delta;
            loss(&x, &k, &v, &dout_values, &q_shape)
        };
        let numeric = (nudged(step) - nudged(-step)) / (2.0 * f64::from(step));
        println!(
            "dq[{index}]: backward {:+.5}, finite difference {numeric:+.5}",
            dq[index]
        );
    }
    Ok(())
}
