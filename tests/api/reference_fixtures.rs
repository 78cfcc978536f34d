//! The reference semantics against the golden cases computed by PyTorch in float64
//! (tests/fixtures/attention). The spec of each case is derived
//! from its manifest entry, so a new case is covered without touching this file.

use attn::AttentionSpec;
use attn::dsl::reference::rope::Side;
use attn::dsl::reference::{self, Array, Inputs, MlaInputs};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/attention")
}

fn manifest() -> Value {
    let text = std::fs::read_to_string(fixtures().join("manifest.json")).expect("manifest.json");
    serde_json::from_str(&text).expect("manifest.json is JSON")
}

/// Reads a tensor of any stored dtype as f64 (bf16/f16 values are exact in f64).
fn load(st: &SafeTensors, name: &str) -> Array {
    let t = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("tensor {name}: {e}"));
    let bytes = t.data();
    let data: Vec<f64> = match t.dtype() {
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        Dtype::I64 => bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        other => panic!("tensor {name}: unexpected dtype {other:?}"),
    };
    Array::from_vec(t.shape(), data).expect("shape matches data")
}

/// The spec a manifest case describes, written in the spec language.
fn spec_of(case: &Value) -> (AttentionSpec, i64) {
    let int = |k: &str| case[k].as_u64().unwrap_or_else(|| panic!("{k}"));
    let mut parts = Vec::new();
    let mut offset = 0;
    if case["kind"] == "mla" {
        parts.push(format!("heads = {}", int("H")));
        parts.push(format!("head_dim = {}", int("qk_nope_head_dim")));
        parts.push(format!("v_head_dim = {}", int("v_head_dim")));
        parts.push(format!(
            "mla(latent_rank = {}, rope_dim = {})",
            int("kv_lora_rank"),
            int("qk_rope_head_dim")
        ));
    } else {
        parts.push(format!("heads = {}", int("Hq")));
        parts.push(format!("kv_heads = {}", int("Hkv")));
        parts.push(format!("head_dim = {}", int("D")));
        parts.push(format!("v_head_dim = {}", int("Dv")));
    }
    parts.push(format!("scale = {:?}", case["scale"].as_f64().unwrap()));
    let causal = case["causal"].as_str();
    match (causal, case.get("window").and_then(Value::as_u64)) {
        (Some("bottom_right"), Some(w)) => parts.push(format!("mask = sliding_window({w})")),
        (Some("bottom_right"), None) => parts.push("mask = causal".into()),
        (Some("top_left"), None) => parts.push("mask = causal(top_left)".into()),
        (None, None) => {}
        other => panic!("unexpected mask {other:?}"),
    }
    if let Some(c) = case.get("softcap").and_then(Value::as_f64) {
        parts.push(format!("softcap = {c:?}"));
    }
    if case.get("alibi").and_then(Value::as_bool) == Some(true) {
        parts.push("position = alibi".into());
    }
    if let Some(rope) = case.get("rope") {
        let scaling = match rope["type"].as_str().unwrap() {
            "default" => String::new(),
            "yarn" => format!(
                ", scaling = yarn(factor = {:?}, original_max_position = {})",
                rope["factor"].as_f64().unwrap(),
                rope["original_max_position_embeddings"].as_u64().unwrap()
            ),
            other => panic!("rope type {other} not mapped yet"),
        };
        parts.push(format!(
            "position = rope(base = {:?}, dim = {}, layout = {}{scaling})",
            rope["base"].as_f64().unwrap(),
            rope["rot_dim"].as_u64().unwrap(),
            rope["layout"].as_str().unwrap()
        ));
        offset = rope["pos0"].as_i64().unwrap();
    }
    let text = parts.join(", ");
    let spec = text
        .parse()
        .unwrap_or_else(|e| panic!("spec `{text}`: {e}"));
    (spec, offset)
}

/// Max abs error, after asserting every element within `abs + rel * |expected|`.
fn assert_close(name: &str, got: &Array, want: &Array, abs: f64, rel: f64) -> f64 {
    assert_eq!(got.shape(), want.shape(), "{name}: shape");
    let mut max_err: f64 = 0.0;
    for (i, (g, w)) in got.data().iter().zip(want.data()).enumerate() {
        if w.is_infinite() || g.is_infinite() {
            assert_eq!(g, w, "{name}[{i}]");
            continue;
        }
        let err = (g - w).abs();
        assert!(
            err <= abs + rel * w.abs(),
            "{name}[{i}]: got {g}, want {w} (err {err:e}, tol {abs:e} + {rel:e}*|want|)"
        );
        max_err = max_err.max(err);
    }
    max_err
}

#[test]
fn reference_matches_every_fixture_case() {
    let manifest = manifest();
    let cases = manifest["cases"].as_object().expect("cases");
    assert!(cases.len() >= 11, "fixture cases went missing");
    for (name, case) in cases {
        let bytes = std::fs::read(fixtures().join(case["file"].as_str().unwrap())).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (spec, offset) = spec_of(case);
        let tol = &case["suggested_tol"];
        let (abs, rel) = (tol["abs"].as_f64().unwrap(), tol["rel"].as_f64().unwrap());
        let output = if case["kind"] == "mla" {
            let inputs = MlaInputs {
                q_nope: &load(&st, "q_nope"),
                q_pe: &load(&st, "q_pe"),
                c_kv: &load(&st, "c_kv"),
                k_pe: &load(&st, "k_pe"),
                w_kv_b: &load(&st, "w_kv_b"),
                position_offset: offset,
            };
            let expanded = reference::mla_expanded(&spec, &inputs).unwrap();
            let absorbed = reference::mla_absorbed(&spec, &inputs).unwrap();
            assert_close(
                &format!("{name}/q_latent"),
                &absorbed.q_latent,
                &load(&st, "q_latent"),
                abs,
                rel,
            );
            assert_close(
                &format!("{name}/out_latent"),
                &absorbed.out_latent,
                &load(&st, "out_latent"),
                abs,
                rel,
            );
            assert_close(
                &format!("{name}/absorbed out"),
                &absorbed.output.out,
                &load(&st, "out"),
                abs,
                rel,
            );
            assert_close(
                &format!("{name}/absorbed lse"),
                &absorbed.output.lse,
                &load(&st, "lse"),
                abs,
                rel,
            );
            expanded
        } else {
            let (q, k, v) = (load(&st, "q"), load(&st, "k"), load(&st, "v"));
            let inputs = Inputs {
                q: &q,
                k: &k,
                v: &v,
                position_offset: offset,
            };
            reference::attention(&spec, &inputs).unwrap()
        };
        let e_out = assert_close(
            &format!("{name}/out"),
            &output.out,
            &load(&st, "out"),
            abs,
            rel,
        );
        let e_lse = assert_close(
            &format!("{name}/lse"),
            &output.lse,
            &load(&st, "lse"),
            abs,
            rel,
        );
        // Both sides compute in f64 from the same inputs: far tighter than the case tolerance.
        assert!(
            e_out < 1e-10 && e_lse < 1e-10,
            "{name}: out err {e_out:e}, lse err {e_lse:e}"
        );
    }
}

#[test]
fn alibi_slopes_match_the_fixture() {
    let bytes = std::fs::read(fixtures().join("alibi_causal_8h_f32.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want = load(&st, "alibi_slopes");
    let got = reference::alibi::slopes(8);
    let got = Array::from_vec(&[8], got).unwrap();
    assert_close("alibi_slopes", &got, &want, 1e-15, 0.0);
}

#[test]
fn rope_frequencies_and_rotations_match_the_fixtures() {
    let manifest = manifest();
    for name in ["rope_base10000_half_f32", "rope_yarn_f32"] {
        let case = &manifest["cases"][name];
        let bytes = std::fs::read(fixtures().join(case["file"].as_str().unwrap())).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (spec, offset) = spec_of(case);
        let rope = spec.rope().expect("a rope case");
        let skv = case["Skv"].as_u64().unwrap();
        let sq = case["Sq"].as_u64().unwrap() as i64;
        let total = skv + offset as u64;
        let freqs = reference::rope::inv_freq(rope, total);
        let freqs = Array::from_vec(&[freqs.len()], freqs).unwrap();
        assert_close(
            &format!("{name}/inv_freq"),
            &freqs,
            &load(&st, "inv_freq"),
            1e-15,
            1e-13,
        );
        let factor = reference::rope::attention_factor(rope);
        let want_factor = case["rope"]["attention_factor"].as_f64().unwrap();
        assert!(
            (factor - want_factor).abs() < 1e-14,
            "{name}: factor {factor} vs {want_factor}"
        );

        // The fixture's positions follow docs/semantics.md: keys at p0 + j, queries the last Sq.
        let kpos: Vec<i64> = (0..skv as i64).map(|j| offset + j).collect();
        let qpos: Vec<i64> = (0..sq).map(|i| offset + skv as i64 - sq + i).collect();
        let as_f64 =
            |v: &[i64]| Array::from_vec(&[v.len()], v.iter().map(|&p| p as f64).collect()).unwrap();
        assert_eq!(
            as_f64(&kpos),
            load(&st, "k_positions"),
            "{name}: key positions"
        );
        assert_eq!(
            as_f64(&qpos),
            load(&st, "q_positions"),
            "{name}: query positions"
        );

        let q_rot = reference::rope::apply(rope, &load(&st, "q"), &qpos, total, Side::Query);
        let k_rot = reference::rope::apply(rope, &load(&st, "k"), &kpos, total, Side::Key);
        assert_close(
            &format!("{name}/q_rot"),
            &q_rot,
            &load(&st, "q_rot"),
            1e-10,
            0.0,
        );
        assert_close(
            &format!("{name}/k_rot"),
            &k_rot,
            &load(&st, "k_rot"),
            1e-10,
            0.0,
        );
    }
}
