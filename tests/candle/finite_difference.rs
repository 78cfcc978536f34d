//! A custom `score_mod` and `mask_mod`, differentiated by attn's derivative pass: candle's
//! gradients equal central differences of the loss.

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

#[test]
fn gradients_of_a_custom_score_mod_equal_central_differences() {
    let spec = "heads = 2, kv_heads = 1, head_dim = 16, \
                score_mod = |s, b, h, q, k| (s * 0.7).tanh() * 3.0 + 0.1 * s * s - 0.05 * (q - k) as f32, \
                mask_mod = |b, h, q, k| k <= q && (q + k) % 5 != 2";
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
                "d{name}[{i}]: candle's gradient {a}, central difference {numeric}"
            );
        }
        assert!(
            analytic.iter().any(|g| g.abs() > 1e-3),
            "d{name} is all zero"
        );
    }
}
