//! The CPU backend against `attn_dsl::reference`: every variant, lengths that break tiling,
//! head dims that are not powers of two, every dtype and every microkernel instruction set.

use crate::support;

use crate::support::values;
use attn_dsl::AttentionSpec;
use attn_dsl::reference::{self, Array, Inputs, MlaInputs};
use attn_runtime::MlaTensors;
use attn_runtime::Tensor;
use attn_runtime::cpu::CpuBackend;
use attn_runtime::cpu::microkernels::Isa;
use proptest::prelude::*;

/// A tensor of `spec`'s dtype, and the exact values it holds as a reference array.
fn input(spec: &AttentionSpec, shape: &[usize], seed: u64, scale: f32) -> (Tensor, Array) {
    let v: Vec<f32> = values(shape.iter().product(), seed)
        .iter()
        .map(|x| x * scale)
        .collect();
    let t = Tensor::from_f32_as(spec.dtype, shape, v).unwrap();
    let exact = t.to_f32_vec().iter().map(|x| f64::from(*x)).collect();
    (t, Array::from_vec(shape, exact).unwrap())
}

/// Max abs error of `got` against `want` after checking every element within tolerance; `-inf`
/// and NaN must match exactly.
fn compare(what: &str, got: &[f32], want: &Array, abs: f64, rel: f64) -> f64 {
    assert_eq!(got.len(), want.data().len(), "{what}: length");
    let mut max: f64 = 0.0;
    for (i, (g, w)) in got.iter().zip(want.data()).enumerate() {
        let g = f64::from(*g);
        if w.is_infinite() {
            assert_eq!(g, *w, "{what}[{i}]");
            continue;
        }
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
            continue;
        }
        let err = (g - w).abs();
        assert!(err <= abs + rel * w.abs(), "{what}[{i}]: got {g}, want {w}");
        max = max.max(err);
    }
    max
}

fn tolerance(spec: &AttentionSpec) -> (f64, f64) {
    match spec.dtype {
        attn_dsl::DType::F32 => (1e-5, 1e-4),
        _ => (2e-2, 0.0),
    }
}

/// Runs a per-head spec on the backend and the reference and compares out and lse.
fn check(backend: &CpuBackend, text: &str, batch: usize, sq: usize, skv: usize, p0: i64) {
    let spec: AttentionSpec = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
    let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let (q, qa) = input(&spec, &[batch, h, sq, d], 1, 1.0);
    let (k, ka) = input(&spec, &[batch, hkv, skv, d], 2, 1.0);
    let (v, va) = input(&spec, &[batch, hkv, skv, dv], 3, 1.0);
    let got = support::forward(backend, &spec, &q, &k, &v, p0).unwrap();
    let want = reference::attention(
        &spec,
        &Inputs {
            q: &qa,
            k: &ka,
            v: &va,
            position_offset: p0,
        },
    )
    .unwrap();
    let (abs, rel) = tolerance(&spec);
    let what = format!(
        "{text} [B {batch}, Sq {sq}, Skv {skv}, p0 {p0}, {:?}]",
        backend.isa()
    );
    assert_eq!(got.out.dtype(), spec.dtype);
    compare(
        &format!("{what} out"),
        &got.out.to_f32_vec(),
        &want.out,
        abs,
        rel,
    );
    compare(
        &format!("{what} lse"),
        &got.lse.to_f32_vec(),
        &want.lse,
        1e-4,
        1e-5,
    );
}

const VARIANTS: &[&str] = &[
    "heads = 2, head_dim = 16",
    "heads = 4, kv_heads = 2, head_dim = 64, mask = causal",
    "heads = 4, kv_heads = 1, head_dim = 40, v_head_dim = 24, mask = causal(top_left)",
    "heads = 3, head_dim = 48, mask = sliding_window(37), position = alibi",
    "heads = 2, head_dim = 72, mask = causal, softcap = 2.0, scale = 0.5",
    "heads = 2, kv_heads = 2, head_dim = 32, mask = causal, position = rope(base = 500.0)",
    "heads = 2, head_dim = 36, position = rope(dim = 16, layout = interleaved, \
     scaling = linear(factor = 2.0))",
    "heads = 2, head_dim = 32, mask = causal, position = rope(scaling = ntk(factor = 3.0))",
    "heads = 2, head_dim = 32, mask = causal, position = rope(scaling = dynamic(factor = 2.0, \
     original_max_position = 64))",
    "heads = 2, head_dim = 32, mask = causal, position = rope(scaling = yarn(factor = 8.0, \
     original_max_position = 64, mscale = 0.8, mscale_all_dim = 0.6))",
    "heads = 2, head_dim = 32, mask = causal, position = rope(base = 50000.0, scaling = \
     llama3(factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, \
     original_max_position = 64))",
    "heads = 4, head_dim = 24, mask = causal, \
     score_mod = |s, b, h, q, k| s - 0.1 * ((q - k) as f32).abs() + (h as f32) * 0.25, \
     mask_mod = |b, h, q, k| (q / 16) == (k / 16) || h == 0",
    "heads = 2, head_dim = 20, score_mod = |s, b, h, q, k| if k % 3 == 0 { s.tanh() } else { \
     (s * 0.5).exp().ln() + ((k - q) as f32).abs().sqrt().min(2.0).max(-1.0) }, \
     mask_mod = |b, h, q, k| k % 5 != 1 && (b + h + q - k) / (k - 7) != 3",
];

#[test]
fn every_variant_matches_the_reference_at_lengths_that_break_tiling() {
    let backend = CpuBackend::new();
    for text in VARIANTS {
        for (sq, skv) in [
            (1, 1),
            (7, 7),
            (63, 65),
            (64, 64),
            (65, 129),
            (129, 63),
            (16, 300),
        ] {
            check(&backend, text, 2, sq, skv, 0);
        }
        check(&backend, text, 1, 20, 90, 1000);
    }
}

#[test]
fn empty_queries_or_keys() {
    let backend = CpuBackend::new();
    for text in VARIANTS.iter().take(6) {
        check(&backend, text, 1, 5, 0, 0);
        check(&backend, text, 1, 0, 5, 0);
        check(&backend, text, 0, 3, 3, 0);
    }
}

#[test]
fn long_sequences_and_large_positions() {
    let backend = CpuBackend::new();
    check(
        &backend,
        "heads = 2, kv_heads = 1, head_dim = 32, mask = causal",
        1,
        1000,
        1000,
        0,
    );
    check(
        &backend,
        "heads = 2, head_dim = 64, mask = sliding_window(128), position = rope(base = 1000000.0)",
        1,
        100,
        700,
        123_456,
    );
}

#[test]
fn head_dims_from_16_to_256() {
    let backend = CpuBackend::new();
    for d in [16, 24, 33, 64, 80, 96, 100, 128, 160, 200, 256] {
        let text = format!(
            "heads = 2, head_dim = {d}, mask = causal, position = rope(dim = {})",
            d / 2 * 2
        );
        check(&backend, &text, 1, 70, 70, 0);
    }
}

/// Value rows a multiple of 512 bytes apart are copied with padded rows before the forward:
/// widths 256 and 512, f32 and bf16, GQA, with the values a strided view as well.
#[test]
fn values_whose_rows_are_copied_further_apart() {
    let backend = CpuBackend::new();
    for text in [
        "heads = 4, kv_heads = 2, head_dim = 32, v_head_dim = 256, mask = causal",
        "heads = 2, head_dim = 16, v_head_dim = 512, mask = sliding_window(40), \
         position = rope",
        "heads = 2, head_dim = 64, v_head_dim = 256, mask = causal, dtype = bf16",
    ] {
        check(&backend, text, 2, 70, 90, 5);
    }
    let text = "heads = 2, head_dim = 16, v_head_dim = 256, mask = causal";
    let spec: AttentionSpec = text.parse().unwrap();
    let (b, s, h) = (1, 70, 2);
    let q = Tensor::from_f32(&[b, h, s, 16], values(b * h * s * 16, 1)).unwrap();
    // [B, S, H, 256] read as [B, H, S, 256]: rows 2 KiB apart, heads 1 KiB.
    let bshd = Tensor::from_f32(&[b, s, h, 256], values(b * s * h * 256, 2)).unwrap();
    let view = bshd.permute(&[0, 2, 1, 3]).unwrap();
    let copy = Tensor::from_f32(&[b, h, s, 256], view.to_f32_vec()).unwrap();
    let k = Tensor::from_f32(&[b, h, s, 16], values(b * h * s * 16, 3)).unwrap();
    let a = support::forward(&backend, &spec, &q, &k, &view, 0).unwrap();
    let c = support::forward(&backend, &spec, &q, &k, &copy, 0).unwrap();
    assert_eq!(
        a.out.to_f32_vec(),
        c.out.to_f32_vec(),
        "{text}: strided values"
    );
}

#[test]
fn half_precision_storage() {
    let backend = CpuBackend::new();
    for dtype in ["f16", "bf16"] {
        for text in [
            "heads = 4, kv_heads = 2, head_dim = 64, mask = causal",
            "heads = 2, head_dim = 48, mask = sliding_window(50), position = alibi, softcap = 20.0",
            // Odd and past the widest dim bf16's `qk_tile` takes (which scales scores after).
            "heads = 2, head_dim = 33, mask = causal, scale = 0.3",
            "heads = 1, head_dim = 264",
        ] {
            check(
                &backend,
                &format!("{text}, dtype = {dtype}"),
                1,
                100,
                140,
                0,
            );
        }
    }
}

#[test]
fn every_instruction_set_this_cpu_has() {
    for isa in Isa::ALL {
        let Some(backend) = CpuBackend::with_isa(isa) else {
            continue;
        };
        for text in VARIANTS.iter().take(4) {
            check(&backend, text, 1, 65, 130, 5);
        }
        check(
            &backend,
            "heads = 2, head_dim = 100, v_head_dim = 72",
            1,
            9,
            70,
            0,
        );
    }
}

#[test]
fn mla_absorbed_matches_the_reference() {
    let backend = CpuBackend::new();
    for text in [
        "heads = 4, head_dim = 16, v_head_dim = 24, mla(latent_rank = 32, rope_dim = 8), \
         mask = causal",
        "heads = 2, head_dim = 8, mla(latent_rank = 64, rope_dim = 16), mask = causal, \
         position = rope(scaling = yarn(factor = 4.0, original_max_position = 32))",
    ] {
        let spec: AttentionSpec = text.parse().unwrap();
        let mla = spec.mla().unwrap();
        let (h, dn, dv) = (
            spec.heads as usize,
            spec.head_dim as usize,
            spec.v_head_dim as usize,
        );
        let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
        let (b, sq, skv) = (2, 33, 70);
        let (q_nope, qn) = input(&spec, &[b, h, sq, dn], 1, 1.0);
        let (q_pe, qp) = input(&spec, &[b, h, sq, dr], 2, 1.0);
        let (c_kv, ck) = input(&spec, &[b, skv, r], 3, 1.0);
        let (k_pe, kp) = input(&spec, &[b, skv, dr], 4, 1.0);
        let (w_kv_b, w) = input(&spec, &[h * (dn + dv), r], 5, 0.3);
        let got = support::forward_mla(
            &backend,
            &spec,
            &MlaTensors {
                q_nope: &q_nope,
                q_pe: &q_pe,
                c_kv: &c_kv,
                k_pe: &k_pe,
                w_kv_b: &w_kv_b,
            },
            11,
        )
        .unwrap();
        let want = reference::mla_expanded(
            &spec,
            &MlaInputs {
                q_nope: &qn,
                q_pe: &qp,
                c_kv: &ck,
                k_pe: &kp,
                w_kv_b: &w,
                position_offset: 11,
            },
        )
        .unwrap();
        compare(text, &got.out.to_f32_vec(), &want.out, 1e-5, 1e-4);
        compare(text, &got.lse.to_f32_vec(), &want.lse, 1e-4, 1e-5);
    }
}

#[test]
fn wrong_inputs_are_errors_naming_the_tensor() {
    let backend = CpuBackend::new();
    let spec: AttentionSpec = "heads = 4, kv_heads = 2, head_dim = 8".parse().unwrap();
    let t = |shape: &[usize]| Tensor::from_f32(shape, vec![0.0; shape.iter().product()]).unwrap();
    let err = support::forward(
        &backend,
        &spec,
        &t(&[1, 4, 3, 8]),
        &t(&[1, 4, 3, 8]),
        &t(&[1, 2, 3, 8]),
        0,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("`k`") && err.contains("[1, 2, 3, 8]"), "{err}");
    let half = Tensor::from_f32_as(attn_dsl::DType::Bf16, &[1, 4, 3, 8], vec![0.0; 96]).unwrap();
    let err = support::forward(
        &backend,
        &spec,
        &half,
        &t(&[1, 2, 3, 8]),
        &t(&[1, 2, 3, 8]),
        0,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("`q` is bf16, expected f32"), "{err}");
}

/// A BSHD tensor read as BHSD through a view gives what its contiguous copy gives, in every
/// dtype (16-bit queries and keys are widened from the view a block at a time).
#[test]
fn strided_bshd_inputs_are_read_in_place() {
    let backend = CpuBackend::new();
    for dtype in ["f32", "bf16", "f16"] {
        let text = format!("heads = 3, head_dim = 16, mask = causal, dtype = {dtype}");
        let spec: AttentionSpec = text.parse().unwrap();
        let (b, s, h, d) = (2, 70, 3, 16);
        let bshd =
            Tensor::from_f32_as(spec.dtype, &[b, s, h, d], values(b * s * h * d, 9)).unwrap();
        let bhsd_view = bshd.permute(&[0, 2, 1, 3]).unwrap();
        let bhsd_copy =
            Tensor::from_f32_as(spec.dtype, &[b, h, s, d], bhsd_view.to_f32_vec()).unwrap();
        let a = support::forward(&backend, &spec, &bhsd_view, &bhsd_view, &bhsd_view, 0).unwrap();
        let c = support::forward(&backend, &spec, &bhsd_copy, &bhsd_copy, &bhsd_copy, 0).unwrap();
        assert_eq!(a.out.to_f32_vec(), c.out.to_f32_vec(), "{text}");
        assert_eq!(a.lse.to_f32_vec(), c.lse.to_f32_vec(), "{text}");
    }
}

#[test]
fn kernels_compile_once_per_spec() {
    let backend = CpuBackend::new();
    let spec: AttentionSpec = "heads = 2, head_dim = 8, mask = causal, softcap = 3.0"
        .parse()
        .unwrap();
    let a = backend.forward_kernel(&spec).unwrap();
    let b = backend.forward_kernel(&spec).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &b));
}

fn random_spec() -> impl Strategy<Value = String> {
    let heads = prop_oneof![
        Just((1u32, 1u32)),
        Just((2, 1)),
        Just((4, 2)),
        Just((3, 3)),
        Just((6, 2))
    ];
    let mask = prop_oneof![
        Just("none".to_string()),
        Just("causal".to_string()),
        Just("causal(top_left)".to_string()),
        (1u32..100).prop_map(|w| format!("sliding_window({w})")),
    ];
    let position = prop_oneof![
        Just("none".to_string()),
        Just("alibi".to_string()),
        Just("rope".to_string()),
        Just("rope(layout = interleaved, base = 100.0)".to_string()),
    ];
    let extra = prop_oneof![
        Just(String::new()),
        Just(", softcap = 3.0".to_string()),
        Just(", score_mod = |s, b, h, q, k| s * 0.5 + (h - b) as f32".to_string()),
        Just(", mask_mod = |b, h, q, k| (q + k) % 3 != 0".to_string()),
    ];
    (heads, 1u32..40, 1u32..40, mask, position, extra).prop_map(
        |((h, kv), d, dv, mask, position, extra)| {
            let d = d * 2;
            format!(
                "heads = {h}, kv_heads = {kv}, head_dim = {d}, v_head_dim = {dv}, mask = {mask}, \
                 position = {position}{extra}"
            )
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn random_specs_and_shapes_match_the_reference(
        text in random_spec(),
        batch in 1usize..3,
        sq in 1usize..90,
        skv in 1usize..150,
        p0 in 0i64..500,
    ) {
        check(&CpuBackend::new(), &text, batch, sq, skv, p0);
    }
}

/// The softmax's exponential to a few ulp, not only to the differential tolerance: with one-hot
/// values, `out[j] / out[0]` is the kernel's `p_j / p_0 = e^(s_j - s_0)`. Scores are products of
/// short binary fractions (exact in f32), from 0 down to -126 (past where f32 underflows); the
/// allowance grows with the score's size because the kernel rounds `score * log2 e` once.
#[test]
fn softmax_probabilities_are_accurate_to_a_few_ulp() {
    let backend = CpuBackend::new();
    let (sq, skv, d) = (64, 64, 64);
    // The softcap's tanh (within 5e-7 of tanh in f32) moves each capped score by up to
    // 30 * 5e-7, and a ratio of two probabilities by twice that.
    for (text, tanh_allowance) in [
        ("heads = 1, head_dim = 64, scale = 1.0", 0.0),
        (
            "heads = 1, head_dim = 64, scale = 1.0, position = alibi",
            0.0,
        ),
        (
            "heads = 1, head_dim = 64, scale = 1.0, softcap = 30.0",
            2.0 * 30.0 * 5e-7,
        ),
    ] {
        let spec: AttentionSpec = text.parse().unwrap();
        let a = |i: usize| (i + 1) as f64 / 8.0;
        let x = |j: usize| -(j as f64) / 4.0;
        let mut q = vec![0.0; sq * d];
        let mut k = vec![0.0; skv * d];
        let mut v = vec![0.0; skv * d];
        for i in 0..sq {
            q[i * d] = a(i);
        }
        for j in 0..skv {
            k[j * d] = x(j);
            v[j * d + j] = 1.0;
        }
        let tensor = |n: usize, data: &[f64]| {
            let f: Vec<f32> = data.iter().map(|&x| x as f32).collect();
            Tensor::from_f32_as(spec.dtype, &[1, 1, n, d], f).unwrap()
        };
        let got = support::forward(
            &backend,
            &spec,
            &tensor(sq, &q),
            &tensor(skv, &k),
            &tensor(skv, &v),
            0,
        )
        .unwrap()
        .out
        .to_f32_vec();
        let array = |n: usize, data: Vec<f64>| Array::from_vec(&[1, 1, n, d], data).unwrap();
        let want = reference::attention(
            &spec,
            &Inputs {
                q: &array(sq, q.clone()),
                k: &array(skv, k.clone()),
                v: &array(skv, v.clone()),
                position_offset: 0,
            },
        )
        .unwrap()
        .out;
        let mut checked = 0;
        for i in 0..sq {
            // |score| <= a_i * 63/4 plus the ALiBi bias (slope 1/256, distance < 64).
            let bound = a(i) * 15.75 + 0.25;
            let allowed = 6e-7 + 3e-7 * bound + tanh_allowance;
            let row = |o: &[f64], j: usize| o[i * d + j] / o[i * d];
            let got_row: Vec<f64> = got.iter().map(|&g| f64::from(g)).collect();
            for j in 1..skv {
                let (g, w) = (row(&got_row, j), row(want.data(), j));
                if w > 1e-30 {
                    assert!(
                        (g - w).abs() <= allowed * w,
                        "{text}: q {i} key {j}: p_j/p_0 = {g:e}, want {w:e} (rel {:e})",
                        (g - w).abs() / w
                    );
                    checked += 1;
                } else {
                    assert!(g <= 2.0 * w + 1e-37, "{text}: q {i} key {j}: {g:e} > {w:e}");
                }
            }
        }
        assert!(
            checked > 2000,
            "{text}: only {checked} probabilities above 1e-30"
        );
    }
}
