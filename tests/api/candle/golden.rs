//! Every golden gradient case (PyTorch float64 autograd) through candle's autograd: the loss
//! `sum(out * dout)` has the fixture's dout as its gradient, so candle's gradients of q, k and
//! v (and of each learnable tensor, a `Var` too) must be the fixture's dq, dk and dv (and
//! d<name>), within the tolerance `attnc grad` meets: 2e-5 abs + 2e-4 rel for f32, and 2x
//! PyTorch's own error in the case's dtype for f16 and bf16.

use super::values;
use attn::candle::core::{DType, Device, Tensor, Var};
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gradients")
}

#[test]
fn every_golden_gradient_case_passes_through_candle_autograd() {
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("manifest.json")).unwrap())
            .unwrap();
    let cases = manifest["cases"].as_object().unwrap();
    let mut ran = 0;
    for (name, case) in cases {
        let spec: attn::AttentionSpec = case["spec"].as_str().unwrap().parse().unwrap();
        // Differential heads run their component heads' variant (the spec itself otherwise).
        let variant = attn::Variant::new(spec.differential_components()).unwrap();
        let file = fixtures().join(case["file"].as_str().unwrap());
        let t: HashMap<String, Tensor> =
            attn::candle::core::safetensors::load(&file, &Device::Cpu).unwrap();
        if case.get("grads").is_some() {
            // MLA takes five tensors: refused with a clear error.
            let q = &t["q_nope"];
            let err = attn::candle::attention(&variant, q, q, q).unwrap_err();
            assert!(err.to_string().contains("MLA"), "{name}: {err}");
            continue;
        }
        let (q, k, v) = (
            Var::from_tensor(&t["q"]).unwrap(),
            Var::from_tensor(&t["k"]).unwrap(),
            Var::from_tensor(&t["v"]).unwrap(),
        );
        let offset = case["position_offset"].as_i64().unwrap();
        let names: Vec<&str> = case
            .get("learned")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let learned: Vec<Var> = names
            .iter()
            .map(|n| Var::from_tensor(&t[*n]).unwrap())
            .collect();
        let by_name: Vec<(&str, &Tensor)> = names
            .iter()
            .zip(&learned)
            .map(|(n, v)| (*n, v.as_tensor()))
            .collect();
        let out = match spec.differential {
            Some(d) => {
                let lambda = [0, 1, 2, 3].map(|i| learned[i].as_tensor());
                let x = [q.as_tensor(), k.as_tensor(), v.as_tensor()];
                attn::candle::differential(&variant, x, lambda, d.lambda_init, &[], offset)
            }
            None => attn::candle::attention_learned(&variant, &q, &k, &v, &by_name, offset),
        }
        .unwrap();
        let dout = t["dout"].to_dtype(DType::F32).unwrap();
        let loss = out
            .to_dtype(DType::F32)
            .unwrap()
            .mul(&dout)
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let learned_grads: Vec<String> = names.iter().map(|n| format!("d{n}")).collect();
        let checked = [("dq", &q), ("dk", &k), ("dv", &v)]
            .into_iter()
            .chain(learned_grads.iter().map(String::as_str).zip(&learned));
        for (grad, var) in checked {
            let got = grads.get(var).unwrap();
            assert_eq!(got.dtype(), var.dtype(), "{name} {grad}: dtype");
            assert_eq!(got.dims(), t[grad].dims(), "{name} {grad}: shape");
            let (g, w) = (values(got), values(&t[grad]));
            if case["dtype"] == "f32" {
                for (i, (g, w)) in g.iter().zip(&w).enumerate() {
                    assert!(
                        (g - w).abs() <= 2e-5 + 2e-4 * w.abs(),
                        "{name} {grad}[{i}]: got {g}, want {w}"
                    );
                }
            } else {
                let max_err = g
                    .iter()
                    .zip(&w)
                    .map(|(g, w)| (g - w).abs())
                    .fold(0.0, f64::max);
                let torch = case["torch_lowp_grad_max_abs_err"][grad].as_f64().unwrap();
                assert!(
                    max_err <= 2.0 * torch,
                    "{name} {grad}: max error {max_err}, PyTorch's own {torch}"
                );
            }
        }
        ran += 1;
    }
    assert!(ran >= 7, "only {ran} per-head cases ran");
}

#[test]
fn the_lse_is_the_fixtures_and_detached() {
    let case = "gqa_rope_offset_f32";
    let variant = attn::Variant::parse(
        "heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = rope",
    )
    .unwrap();
    let t = attn::candle::core::safetensors::load(
        fixtures().join(format!("{case}.safetensors")),
        &Device::Cpu,
    )
    .unwrap();
    let q = Var::from_tensor(&t["q"]).unwrap();
    let (out, lse) = attn::candle::attention_with_lse(&variant, &q, &t["k"], &t["v"], 5).unwrap();
    assert_eq!(lse.dtype(), DType::F32);
    super::assert_close("lse", &lse, &t["lse"], 1e-4, 1e-4);
    super::assert_close("out", &out, &t["out"], 2e-5, 2e-4);
    // The lse carries no graph: a loss of it alone has no gradient for q.
    let grads = lse.sum_all().unwrap().backward().unwrap();
    assert!(grads.get(&q).is_none());
}
