//! The CPU backward kernel against `attn_dsl::reference::backward`: every variant, lengths that
//! break tiling, Sq != Skv, GQA/MQA, head dims 16 to 256, the three dtypes, custom score and mask
//! modifiers, fully masked rows, and every microkernel instruction set.

use crate::support;

use crate::support::values;
use attn_dsl::reference::{self, Array, Inputs};
use attn_dsl::{AttentionSpec, DType};
use attn_runtime::cpu::CpuBackend;
use attn_runtime::cpu::microkernels::Isa;
use attn_runtime::{HeadsBackward, MlaBackward, Tensor};

/// A tensor of `dtype`, and the exact values it holds as a reference array.
fn input(dtype: DType, shape: &[usize], seed: u64) -> (Tensor, Array) {
    let t = Tensor::from_f32_as(dtype, shape, values(shape.iter().product(), seed)).unwrap();
    let exact = t.to_f32_vec().iter().map(|x| f64::from(*x)).collect();
    (t, Array::from_vec(shape, exact).unwrap())
}

/// The largest error of `got` against `want`, after checking each element within
/// `abs + rel * |want|` (NaN must match NaN).
fn compare(what: &str, got: &Tensor, want: &Array, abs: f64, rel: f64) -> f64 {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let mut max: f64 = 0.0;
    for (i, (g, w)) in got.to_f32_vec().iter().zip(want.data()).enumerate() {
        let g = f64::from(*g);
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

/// Forward on the backend, then backward, against the reference's gradients for the same
/// inputs; returns the largest error.
fn check(backend: &CpuBackend, text: &str, batch: usize, sq: usize, skv: usize, p0: i64) -> f64 {
    let spec: AttentionSpec = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
    let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let (q, qa) = input(spec.dtype, &[batch, h, sq, d], 1);
    let (k, ka) = input(spec.dtype, &[batch, hkv, skv, d], 2);
    let (v, va) = input(spec.dtype, &[batch, hkv, skv, dv], 3);
    let (dout, douta) = input(spec.dtype, &[batch, h, sq, dv], 4);
    let forward = support::forward(backend, &spec, &q, &k, &v, p0).unwrap();
    let x = HeadsBackward {
        q: &q,
        k: &k,
        v: &v,
        out: &forward.out,
        lse: &forward.lse,
        dout: &dout,
        position_offset: p0,
    };
    let got = support::backward(backend, &spec, &x).unwrap();
    let inputs = Inputs {
        q: &qa,
        k: &ka,
        v: &va,
        position_offset: p0,
    };
    let want = reference::backward(&spec, &inputs, &douta).unwrap();
    let (abs, rel) = match spec.dtype {
        DType::F32 => (2e-5, 2e-4),
        // The output the backward reads is rounded to 16 bits, and so are the gradients.
        DType::Bf16 => (4e-2, 2e-2),
        DType::F16 => (1e-2, 4e-3),
    };
    let what = format!(
        "{text} [B {batch}, Sq {sq}, Skv {skv}, p0 {p0}, {:?}]",
        backend.isa()
    );
    let mut max: f64 = 0.0;
    for (name, g, w) in [
        ("dq", &got.dq, &want.dq),
        ("dk", &got.dk, &want.dk),
        ("dv", &got.dv, &want.dv),
    ] {
        assert_eq!(g.dtype(), spec.dtype, "{what} {name}");
        max = max.max(compare(&format!("{what} {name}"), g, w, abs, rel));
    }
    max
}

/// Every instruction set this CPU runs (avx512_bf16 takes `dO V^T` on `vdpbf16ps` for bf16
/// specs with a bf16 `dout`).
fn backends() -> Vec<CpuBackend> {
    Isa::ALL
        .into_iter()
        .filter_map(CpuBackend::with_isa)
        .collect()
}

#[test]
fn plain_causal_and_windowed_over_lengths_that_break_tiles() {
    for backend in backends() {
        for (sq, skv) in [(1, 1), (7, 7), (63, 65), (65, 63), (129, 129), (5, 130)] {
            check(&backend, "heads = 2, head_dim = 32", 1, sq, skv, 0);
            check(
                &backend,
                "heads = 2, head_dim = 32, mask = causal",
                2,
                sq,
                skv,
                0,
            );
        }
        check(
            &backend,
            "heads = 2, head_dim = 32, mask = sliding_window(40)",
            1,
            150,
            150,
            3,
        );
        check(
            &backend,
            "heads = 2, head_dim = 32, mask = causal(top_left)",
            1,
            70,
            100,
            0,
        );
    }
}

#[test]
fn gqa_mqa_and_head_dims() {
    let backend = CpuBackend::new();
    check(
        &backend,
        "heads = 8, kv_heads = 2, head_dim = 64, mask = causal",
        1,
        70,
        90,
        0,
    );
    check(
        &backend,
        "heads = 4, kv_heads = 1, head_dim = 16, v_head_dim = 24",
        2,
        33,
        65,
        0,
    );
    // One (batch, kv head) unit and many key tiles: the tiles are dealt to several tasks.
    check(
        &backend,
        "heads = 8, kv_heads = 1, head_dim = 32, mask = causal",
        1,
        300,
        300,
        0,
    );
    for d in [16, 40, 96, 128, 256] {
        check(
            &backend,
            &format!("heads = 2, kv_heads = 1, head_dim = {d}, mask = causal"),
            1,
            67,
            67,
            0,
        );
    }
    // Rows a multiple of 512 bytes apart (queries, keys, output gradients) are copied further
    // apart for the tile products: with RoPE rotating them there, and values alone that wide.
    for text in [
        "heads = 4, kv_heads = 2, head_dim = 256, mask = causal, position = rope",
        "heads = 2, head_dim = 32, v_head_dim = 512, mask = sliding_window(30)",
    ] {
        check(&backend, text, 2, 70, 75, 3);
    }
}

#[test]
fn positional_schemes_and_score_modifiers() {
    let backend = CpuBackend::new();
    for text in [
        "heads = 4, kv_heads = 2, head_dim = 64, mask = causal, position = rope",
        "heads = 2, head_dim = 96, position = rope(dim = 64, layout = interleaved, scaling = \
         yarn(factor = 4.0, original_max_position = 64, mscale = 1.0, mscale_all_dim = 0.5))",
        "heads = 2, head_dim = 64, mask = causal, position = rope(base = 500000.0, scaling = \
         llama3(factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, \
         original_max_position = 64))",
        "heads = 2, head_dim = 64, position = rope(scaling = dynamic(factor = 2.0, \
         original_max_position = 32))",
        "heads = 4, head_dim = 64, mask = causal, position = alibi",
        "heads = 2, head_dim = 64, mask = causal, softcap = 2.0",
        "heads = 2, head_dim = 64, score_mod = |s, b, h, q, k| (s * 0.5).tanh() * 4.0 - 0.01 * \
         (q - k).abs() as f32 + (s * s + 1.0).sqrt() * 0.1",
        "heads = 2, head_dim = 64, score_mod = |s, b, h, q, k| if h == 0 { s.max(-1.0) } else \
         { s * 2.0 }, mask_mod = |b, h, q, k| (q + k) % 5 != 2",
    ] {
        check(&backend, text, 2, 70, 100, 9);
    }
}

#[test]
fn low_precision_inputs() {
    let backend = CpuBackend::new();
    for dtype in ["bf16", "f16"] {
        check(
            &backend,
            &format!(
                "heads = 4, kv_heads = 2, head_dim = 64, mask = causal, position = rope, dtype = {dtype}"
            ),
            1,
            80,
            80,
            0,
        );
        check(
            &backend,
            &format!("heads = 2, head_dim = 128, softcap = 5.0, dtype = {dtype}"),
            1,
            33,
            70,
            0,
        );
    }
}

#[test]
fn fully_masked_rows_give_zero_gradient_and_no_nan() {
    let backend = CpuBackend::new();
    // Queries at even positions keep no key; odd ones keep the keys below them.
    let text = "heads = 2, head_dim = 32, mask_mod = |b, h, q, k| q % 2 == 1 && k < q";
    check(&backend, text, 1, 20, 20, 0);
}

#[test]
fn mla_in_the_per_head_entry_point_and_bad_tensors_are_refused_with_clear_errors() {
    let backend = CpuBackend::new();
    let mla: AttentionSpec = "heads = 2, head_dim = 16, mla(latent_rank = 32, rope_dim = 16)"
        .parse()
        .unwrap();
    let t = Tensor::from_f32(&[1, 2, 1, 16], vec![0.0; 32]).unwrap();
    let lse = Tensor::from_f32(&[1, 2, 1], vec![0.0; 2]).unwrap();
    let x = HeadsBackward {
        q: &t,
        k: &t,
        v: &t,
        out: &t,
        lse: &lse,
        dout: &t,
        position_offset: 0,
    };
    let err = support::backward(&backend, &mla, &x)
        .unwrap_err()
        .to_string();
    assert!(err.contains("MLA") && err.contains("Inputs::Mla"), "{err}");

    let spec: AttentionSpec = "heads = 2, head_dim = 16".parse().unwrap();
    let bad_lse = Tensor::from_f32(&[1, 2, 2], vec![0.0; 4]).unwrap();
    let err = support::backward(&backend, &spec, &HeadsBackward { lse: &bad_lse, ..x })
        .unwrap_err()
        .to_string();
    assert!(err.contains("lse") && err.contains("[1, 2, 1]"), "{err}");
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// A tensor of a random small shape (sometimes not 4-D, sometimes empty) and dtype, with
    /// values that may be NaN, infinite or huge.
    fn tensor() -> impl Strategy<Value = Tensor> {
        (
            prop::collection::vec(0usize..5, 1..6),
            prop_oneof![Just(DType::F32), Just(DType::Bf16), Just(DType::F16)],
            prop_oneof![
                Just(0.5f32),
                Just(f32::NAN),
                Just(f32::INFINITY),
                Just(3e38)
            ],
        )
            .prop_map(|(shape, dtype, special)| {
                let n: usize = shape.iter().product();
                let mut v = values(n, n as u64);
                if let Some(x) = v.first_mut() {
                    *x = special;
                }
                Tensor::from_f32_as(dtype, &shape, v).unwrap()
            })
    }

    /// Consistent inputs for the spec below with some of them swapped for random tensors.
    fn inputs() -> impl Strategy<Value = (Vec<Tensor>, i64)> {
        let consistent = (1usize..3, 1usize..5, 1usize..5).prop_map(|(b, sq, skv)| {
            let shape = |h: usize, s: usize| [b, h, s, 8];
            let make = |shape: [usize; 4], seed: u64| {
                Tensor::from_f32(&shape, values(shape.iter().product(), seed)).unwrap()
            };
            vec![
                make(shape(2, sq), 1),
                make(shape(1, skv), 2),
                make(shape(1, skv), 3),
                make(shape(2, sq), 4),
                Tensor::from_f32(&[b, 2, sq], vec![0.5; b * 2 * sq]).unwrap(),
                make(shape(2, sq), 5),
            ]
        });
        (
            consistent,
            prop::collection::vec((0usize..6, tensor()), 0..3),
            prop_oneof![
                Just(0i64),
                Just(-3),
                Just(i64::from(i32::MAX)),
                Just(i64::MAX),
                Just(i64::MIN)
            ],
        )
            .prop_map(|(mut tensors, swaps, p0)| {
                for (i, t) in swaps {
                    tensors[i] = t;
                }
                (tensors, p0)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// No input crashes the backward: it returns gradients or an error that names a tensor
        /// or the positions.
        #[test]
        fn the_backward_never_panics((t, p0) in inputs()) {
            let spec: AttentionSpec = "heads = 2, kv_heads = 1, head_dim = 8, mask = causal, \
                position = rope, softcap = 3.0".parse().unwrap();
            let x = HeadsBackward {
                q: &t[0],
                k: &t[1],
                v: &t[2],
                out: &t[3],
                lse: &t[4],
                dout: &t[5],
                position_offset: p0,
            };
            match support::backward(&CpuBackend::new(), &spec, &x) {
                Ok(g) => {
                    prop_assert_eq!(g.dq.shape(), t[0].shape());
                    prop_assert_eq!(g.dk.shape(), t[1].shape());
                }
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
        }

        /// Nor the MLA backward: consistent MLA inputs with some swapped for random tensors.
        #[test]
        fn the_mla_backward_never_panics(
            (b, sq, skv) in (1usize..3, 1usize..5, 1usize..5),
            swaps in prop::collection::vec((0usize..8, tensor()), 0..3),
            p0 in prop_oneof![Just(0i64), Just(i64::MAX), Just(i64::MIN)],
        ) {
            use attn_runtime::MlaTensors;
            let spec: AttentionSpec = "heads = 2, head_dim = 4, mla(latent_rank = 8, rope_dim = 4), \
                mask = causal, position = rope".parse().unwrap();
            let make = |shape: &[usize], seed: u64| {
                Tensor::from_f32(shape, values(shape.iter().product(), seed)).unwrap()
            };
            let mut t = [
                make(&[b, 2, sq, 4], 1),
                make(&[b, 2, sq, 4], 2),
                make(&[b, skv, 8], 3),
                make(&[b, skv, 4], 4),
                make(&[2 * 8, 8], 5),
                make(&[b, 2, sq, 8], 6),
                make(&[b, 2, sq], 7),
                make(&[b, 2, sq, 4], 8),
            ];
            for (i, x) in swaps {
                t[i] = x;
            }
            let x = MlaTensors {
                q_nope: &t[0],
                q_pe: &t[1],
                c_kv: &t[2],
                k_pe: &t[3],
                w_kv_b: &t[4],
            };
            let inputs = MlaBackward {
                x,
                latent: &t[5],
                lse: &t[6],
                dout: &t[7],
                position_offset: p0,
            };
            match support::backward_mla(&CpuBackend::new(), &spec, &inputs) {
                Ok(g) => prop_assert_eq!(g.dc_kv.shape(), t[2].shape()),
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
        }
    }
}

#[test]
fn an_f32_output_gradient_serves_a_bf16_spec() {
    let backend = CpuBackend::new();
    let spec: AttentionSpec = "heads = 2, head_dim = 32, mask = causal, dtype = bf16"
        .parse()
        .unwrap();
    let (q, qa) = input(DType::Bf16, &[1, 2, 9, 32], 1);
    let (k, ka) = input(DType::Bf16, &[1, 2, 9, 32], 2);
    let (v, va) = input(DType::Bf16, &[1, 2, 9, 32], 3);
    let (dout, douta) = input(DType::F32, &[1, 2, 9, 32], 4);
    let saved = support::forward(&backend, &spec, &q, &k, &v, 0).unwrap();
    let x = HeadsBackward {
        q: &q,
        k: &k,
        v: &v,
        out: &saved.out,
        lse: &saved.lse,
        dout: &dout,
        position_offset: 0,
    };
    let got = support::backward(&backend, &spec, &x).unwrap();
    let inputs = Inputs {
        q: &qa,
        k: &ka,
        v: &va,
        position_offset: 0,
    };
    let want = reference::backward(&spec, &inputs, &douta).unwrap();
    assert_eq!(got.dq.dtype(), DType::Bf16);
    compare("dq", &got.dq, &want.dq, 4e-2, 2e-2);
    compare("dv", &got.dv, &want.dv, 4e-2, 2e-2);
}

/// MLA's backward (absorbed form on the CPU) against `reference::backward_mla`.
fn check_mla(text: &str, b: usize, sq: usize, skv: usize, p0: i64) -> f64 {
    use attn_runtime::MlaTensors;
    let spec: AttentionSpec = text.parse().unwrap();
    let mla = spec.mla().unwrap();
    let (h, dn, dv) = (
        spec.heads as usize,
        spec.head_dim as usize,
        spec.v_head_dim as usize,
    );
    let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
    let (q_nope, qa) = input(spec.dtype, &[b, h, sq, dn], 1);
    let (q_pe, qpa) = input(spec.dtype, &[b, h, sq, dr], 2);
    let (c_kv, ca) = input(spec.dtype, &[b, skv, r], 3);
    let (k_pe, kpa) = input(spec.dtype, &[b, skv, dr], 4);
    let (w_kv_b, wa) = input(spec.dtype, &[h * (dn + dv), r], 5);
    let (dout, douta) = input(spec.dtype, &[b, h, sq, dv], 6);
    let x = MlaTensors {
        q_nope: &q_nope,
        q_pe: &q_pe,
        c_kv: &c_kv,
        k_pe: &k_pe,
        w_kv_b: &w_kv_b,
    };
    let backend = CpuBackend::new();
    let saved = support::forward_mla(&backend, &spec, &x, p0).unwrap();
    let inputs = MlaBackward {
        x,
        latent: saved.latent.as_ref().unwrap(),
        lse: &saved.lse,
        dout: &dout,
        position_offset: p0,
    };
    let got = support::backward_mla(&backend, &spec, &inputs).unwrap();
    let want = reference::backward_mla(
        &spec,
        &reference::MlaInputs {
            q_nope: &qa,
            q_pe: &qpa,
            c_kv: &ca,
            k_pe: &kpa,
            w_kv_b: &wa,
            position_offset: p0,
        },
        &douta,
    )
    .unwrap();
    // Gradients sum over keys and heads of products of O(1) inputs: scale the tolerance by the
    // gradient's own size.
    let (abs, rel) = match spec.dtype {
        DType::F32 => (1e-4, 1e-3),
        _ => (6e-2, 3e-2),
    };
    let mut worst: f64 = 0.0;
    for (name, g, w) in [
        ("dq_nope", &got.dq_nope, &want.dq_nope),
        ("dq_pe", &got.dq_pe, &want.dq_pe),
        ("dc_kv", &got.dc_kv, &want.dc_kv),
        ("dk_pe", &got.dk_pe, &want.dk_pe),
        ("dw_kv_b", &got.dw_kv_b, &want.dw_kv_b),
    ] {
        let scale = w.data().iter().fold(1f64, |m, x| m.max(x.abs()));
        worst = worst.max(compare(&format!("{text} {name}"), g, w, abs * scale, rel));
    }
    worst
}

#[test]
fn mla_gradients_equal_the_reference() {
    for (text, b, sq, skv, p0) in [
        (
            "heads = 2, head_dim = 16, mla(latent_rank = 32, rope_dim = 16), mask = causal, \
             position = rope",
            1,
            65,
            65,
            0,
        ),
        (
            "heads = 3, head_dim = 8, v_head_dim = 16, mla(latent_rank = 24, rope_dim = 8), \
             softcap = 5.0, position = rope(scaling = yarn(factor = 4.0, \
             original_max_position = 32))",
            2,
            7,
            70,
            3,
        ),
        (
            "heads = 2, head_dim = 16, mla(latent_rank = 64, rope_dim = 16), mask = causal, \
             position = rope, dtype = bf16",
            1,
            40,
            40,
            0,
        ),
        (
            "heads = 2, head_dim = 8, mla(latent_rank = 16, rope_dim = 8), position = rope, \
             score_mod = |s, b, h, q, k| s - 0.05 * (q - k).abs() as f32, \
             mask_mod = |b, h, q, k| q % 3 != 1",
            1,
            9,
            12,
            0,
        ),
    ] {
        let worst = check_mla(text, b, sq, skv, p0);
        eprintln!("{text}: max error {worst:.2e}");
    }
}
