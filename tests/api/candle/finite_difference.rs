//! Gradients through candle equal central differences of the loss: for a custom `score_mod`
//! and `mask_mod` (differentiated by attn's derivative pass), and for every RoPE scaling,
//! ALiBi with softcap, and a sliding window.

use super::{tensor, values, var};
use attn::candle::core::{Tensor, Var};

fn loss(
    variant: &std::sync::Arc<attn::Variant>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    w: &Tensor,
) -> f64 {
    let out = attn::candle::attention_at(variant, q, k, v, 3).unwrap();
    let l = out.mul(w).unwrap().sum_all().unwrap();
    f64::from(l.to_scalar::<f32>().unwrap())
}

/// `x` with element `i` moved by `by`.
fn nudged(x: &Var, i: usize, by: f32) -> Tensor {
    let mut flat = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    flat[i] += by;
    Tensor::from_vec(flat, x.dims(), x.device()).unwrap()
}

/// candle's gradients of `sum(out * w)` for q, k and v, each at a spread of elements, equal
/// central differences (f32, so to 2e-3 abs + 2e-2 rel).
fn gradients_match_central_differences(spec: &str) {
    let variant = attn::Variant::parse(spec).unwrap();
    let q = var(&[1, 2, 12, 16], 11);
    let k = var(&[1, 1, 12, 16], 12);
    let v = var(&[1, 1, 12, 16], 13);
    let w = tensor(&[1, 2, 12, 16], 14);
    let out = attn::candle::attention_at(&variant, &q, &k, &v, 3).unwrap();
    let grads = out.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    let eps = 1e-2f32;
    for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
        let analytic = values(grads.get(x).unwrap());
        let n = analytic.len();
        // A spread of elements, the first and last among them.
        for i in [0, n / 7, n / 3, n / 2, 2 * n / 3, n - 1] {
            let at = |by: f32| {
                let moved = nudged(x, i, by);
                match name {
                    "q" => loss(&variant, &moved, &k, &v, &w),
                    "k" => loss(&variant, &q, &moved, &v, &w),
                    _ => loss(&variant, &q, &k, &moved, &w),
                }
            };
            let numeric = (at(eps) - at(-eps)) / (2.0 * f64::from(eps));
            let a = analytic[i];
            assert!(
                (a - numeric).abs() <= 2e-3 + 2e-2 * numeric.abs(),
                "{spec}: d{name}[{i}]: candle's gradient {a}, central difference {numeric}"
            );
        }
        assert!(
            analytic.iter().any(|g| g.abs() > 1e-3),
            "{spec}: d{name} is all zero"
        );
    }
}

#[test]
fn gradients_of_a_custom_score_mod_equal_central_differences() {
    gradients_match_central_differences(
        "heads = 2, kv_heads = 1, head_dim = 16, \
         score_mod = |s, b, h, q, k| (s * 0.7).tanh() * 3.0 + 0.1 * s * s - 0.05 * (q - k) as f32, \
         mask_mod = |b, h, q, k| k <= q && (q + k) % 5 != 2",
    );
}

#[test]
fn gradients_under_every_rope_scaling_equal_central_differences() {
    let scalings = [
        "linear(factor = 4.0)",
        "ntk(factor = 3.5)",
        "dynamic(factor = 2.0, original_max_position = 8)",
        "yarn(factor = 8.0, original_max_position = 8)",
        "llama3(factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_position = 8)",
    ];
    for scaling in scalings {
        gradients_match_central_differences(&format!(
            "heads = 2, kv_heads = 1, head_dim = 16, mask = causal, \
             position = rope(base = 100.0, scaling = {scaling})"
        ));
    }
    gradients_match_central_differences(
        "heads = 2, kv_heads = 1, head_dim = 16, mask = causal, \
         position = rope(dim = 8, layout = interleaved)",
    );
}

#[test]
fn gradients_with_alibi_softcap_and_a_window_equal_central_differences() {
    gradients_match_central_differences(
        "heads = 2, kv_heads = 1, head_dim = 16, mask = causal, position = alibi, softcap = 1.5",
    );
    gradients_match_central_differences(
        "heads = 2, kv_heads = 1, head_dim = 16, mask = sliding_window(4), scale = 0.5",
    );
}
