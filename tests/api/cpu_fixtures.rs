//! Every golden case (PyTorch float64) through the CPU backend, within the case's tolerance; the
//! low-precision cases also within 2x of PyTorch's own low-precision error.

use attn::prelude::*;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/attention")
}

/// A tensor as stored (f32, bf16 or f16), and f64 reference values.
fn load(st: &SafeTensors, name: &str) -> (Tensor, Vec<f64>) {
    let t = st.tensor(name).unwrap();
    let shape = t.shape();
    let bytes = t.data();
    match t.dtype() {
        Dtype::F32 => {
            let v: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let f = v.iter().map(|x| f64::from(*x)).collect();
            (Tensor::from_f32(shape, v).unwrap(), f)
        }
        Dtype::BF16 => {
            let v: Vec<half::bf16> = bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let f = v.iter().map(|x| x.to_f64()).collect();
            (Tensor::from_bf16(shape, v).unwrap(), f)
        }
        Dtype::F64 => {
            let f: Vec<f64> = bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let t = Tensor::from_f32(shape, f.iter().map(|x| *x as f32).collect()).unwrap();
            (t, f)
        }
        other => panic!("{name}: dtype {other:?} not used by the fixtures"),
    }
}

fn spec_of(case: &Value) -> (AttentionSpec, i64) {
    let int = |k: &str| case[k].as_u64().unwrap();
    let mut parts = vec![];
    if case["kind"] == "mla" {
        parts.push(format!(
            "heads = {}, head_dim = {}, v_head_dim = {}, mla(latent_rank = {}, rope_dim = {})",
            int("H"),
            int("qk_nope_head_dim"),
            int("v_head_dim"),
            int("kv_lora_rank"),
            int("qk_rope_head_dim")
        ));
    } else {
        parts.push(format!(
            "heads = {}, kv_heads = {}, head_dim = {}, v_head_dim = {}",
            int("Hq"),
            int("Hkv"),
            int("D"),
            int("Dv")
        ));
    }
    parts.push(format!(
        "scale = {:?}, dtype = {}",
        case["scale"].as_f64().unwrap(),
        case["dtype"].as_str().unwrap()
    ));
    match case.get("window").and_then(Value::as_u64) {
        Some(w) => parts.push(format!("mask = sliding_window({w})")),
        None => parts.push("mask = causal".into()),
    }
    if let Some(c) = case.get("softcap").and_then(Value::as_f64) {
        parts.push(format!("softcap = {c:?}"));
    }
    if case.get("alibi").and_then(Value::as_bool) == Some(true) {
        parts.push("position = alibi".into());
    }
    let mut offset = 0;
    if let Some(rope) = case.get("rope") {
        let scaling = match rope["type"].as_str().unwrap() {
            "yarn" => format!(
                ", scaling = yarn(factor = {:?}, original_max_position = {})",
                rope["factor"].as_f64().unwrap(),
                rope["original_max_position_embeddings"].as_u64().unwrap()
            ),
            _ => String::new(),
        };
        parts.push(format!(
            "position = rope(base = {:?}, dim = {}, layout = {}{scaling})",
            rope["base"].as_f64().unwrap(),
            rope["rot_dim"].as_u64().unwrap(),
            rope["layout"].as_str().unwrap()
        ));
        offset = rope["pos0"].as_i64().unwrap();
    }
    (parts.join(", ").parse().unwrap(), offset)
}

#[test]
fn cpu_backend_meets_every_fixture_tolerance() {
    let text = std::fs::read_to_string(fixtures().join("manifest.json")).unwrap();
    let manifest: Value = serde_json::from_str(&text).unwrap();
    let backend = CpuBackend::new();
    for (name, case) in manifest["cases"].as_object().unwrap() {
        assert_eq!(case["causal"], "bottom_right", "{name}: mask not mapped");
        let bytes = std::fs::read(fixtures().join(case["file"].as_str().unwrap())).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (spec, offset) = spec_of(case);
        let got = if case["kind"] == "mla" {
            let (q_nope, q_pe, c_kv, k_pe, w_kv_b) = (
                load(&st, "q_nope").0,
                load(&st, "q_pe").0,
                load(&st, "c_kv").0,
                load(&st, "k_pe").0,
                load(&st, "w_kv_b").0,
            );
            let x = MlaTensors {
                q_nope: &q_nope,
                q_pe: &q_pe,
                c_kv: &c_kv,
                k_pe: &k_pe,
                w_kv_b: &w_kv_b,
            };
            let variant = Variant::new(spec.clone()).unwrap();
            backend.forward(&variant, Inputs::Mla(x), offset).unwrap()
        } else {
            let (q, k, v) = (load(&st, "q").0, load(&st, "k").0, load(&st, "v").0);
            let variant = Variant::new(spec.clone()).unwrap();
            backend
                .forward(&variant, Inputs::heads(&q, &k, &v), offset)
                .unwrap()
        };
        // RoPE angles are computed in f64, so the strict tolerance applies to RoPE cases too.
        let tol = &case["suggested_tol"];
        let (abs, rel) = (tol["abs"].as_f64().unwrap(), tol["rel"].as_f64().unwrap());
        let want = load(&st, "out").1;
        let mut max_err: f64 = 0.0;
        for (i, (g, w)) in got.out.to_f32_vec().iter().zip(&want).enumerate() {
            let err = (f64::from(*g) - w).abs();
            assert!(err <= abs + rel * w.abs(), "{name} out[{i}]: {g} vs {w}");
            max_err = max_err.max(err);
        }
        if let Some(torch_err) = case
            .get("torch_lowp_sdpa_max_abs_err")
            .and_then(Value::as_f64)
        {
            assert!(
                max_err <= 2.0 * torch_err,
                "{name}: max err {max_err} vs torch's {torch_err}"
            );
        }
        for (i, (g, w)) in got
            .lse
            .to_f32_vec()
            .iter()
            .zip(&load(&st, "lse").1)
            .enumerate()
        {
            assert!(
                (f64::from(*g) - w).abs() <= 1e-4 + 1e-5 * w.abs(),
                "{name} lse[{i}]: {g} vs {w}"
            );
        }
    }
}
