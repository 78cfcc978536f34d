//! `#[attention(..., differential = ...)]`: the struct implements `DifferentialAttention`, its
//! spec built as data equal to its text, and it runs PyTorch's golden differential case
//! (float64 autograd) on the CPU and the GPU interpreter: out, the components' lse, dq, dk, dv
//! and lambda's vectors' gradients within 2e-5 abs + 2e-4 rel.

use crate::grad_fixtures::values;
use attn::runtime::differential::DifferentialInputs;
use attn::runtime::io::read_safetensors;
use attn::{AttentionSpec, Backend, CpuBackend, DifferentialAttention, GpuSim, Learned, attention};
use std::path::PathBuf;

/// The golden case `differential_causal_gqa_rope_f32`'s spec.
#[attention(
    heads = 8, kv_heads = 4, head_dim = 32, v_head_dim = 64, mask = causal, position = rope,
    differential = lambda
)]
struct Paired;

/// An initial lambda that does not print short.
#[attention(heads = 4, head_dim = 16, differential = lambda(init = 0.3), dtype = bf16)]
struct Shallow;

#[test]
fn the_macro_builds_a_differential_spec_as_data_equal_to_its_text() {
    for (data, text) in [
        (Paired::spec(), Paired::SPEC_TEXT),
        (Shallow::spec(), Shallow::SPEC_TEXT),
    ] {
        let parsed: AttentionSpec = text.parse().unwrap();
        assert_eq!(*data, parsed, "{text}");
        assert_eq!(data.to_string(), text);
    }
    assert_eq!(Shallow::spec().differential.unwrap().lambda_init, 0.3);
    assert_eq!(
        (Paired::HEADS, Paired::KV_HEADS, Paired::VALUE_HEADS),
        (8, 4, 2)
    );
    assert_eq!((Paired::HEAD_DIM, Paired::V_HEAD_DIM), (32, 64));
    assert!(Paired::LEARNED.is_empty());
    // Planned once: the component heads are the spec without `differential`.
    assert!(std::ptr::eq(Paired::differential(), Paired::differential()));
    let components = Paired::differential().components().spec();
    assert_eq!(*components, Paired::spec().differential_components());
}

#[test]
fn a_declared_differential_struct_meets_the_golden_case_on_cpu_and_gpu_sim() {
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gradients/differential_causal_gqa_rope_f32.safetensors");
    let names = [
        "q",
        "k",
        "v",
        "dout",
        "lambda_q1",
        "lambda_k1",
        "lambda_q2",
        "lambda_k2",
    ];
    let t = read_safetensors(&file, &names).unwrap();
    let bytes = std::fs::read(&file).unwrap();
    let golden = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let x = DifferentialInputs {
        q: &t[0],
        k: &t[1],
        v: &t[2],
        lambda: [&t[4], &t[5], &t[6], &t[7]],
        position_offset: 3,
        learned: Learned::new(&[]),
    };
    let backends: [&dyn Backend; 2] = [&CpuBackend::new(), &GpuSim::new()];
    for backend in backends {
        let what = backend.name();
        let saved = Paired::forward_on(backend, &x).unwrap();
        let g = Paired::backward_on(backend, &x, &saved, &t[3]).unwrap();
        let mut checked = vec![
            ("out", saved.out.to_f32_vec()),
            ("lse", saved.components.lse.to_f32_vec()),
            ("dq", g.inputs.dq.to_f32_vec()),
            ("dk", g.inputs.dk.to_f32_vec()),
            ("dv", g.inputs.dv.to_f32_vec()),
        ];
        checked.extend(g.lambda.iter().map(|(n, t)| (n.as_str(), t.to_f32_vec())));
        assert_eq!(checked.len(), 9, "{what}: every lambda vector's gradient");
        for (name, got) in checked {
            let expected = values(&golden, name);
            assert_eq!(got.len(), expected.len(), "{what}: {name}");
            for (i, (a, b)) in got.iter().map(|a| f64::from(*a)).zip(&expected).enumerate() {
                let tol = 2e-5 + 2e-4 * b.abs();
                assert!(
                    (a - b).abs() <= tol,
                    "{what}: {name}[{i}] = {a}, PyTorch {b}"
                );
            }
        }
    }
}

#[test]
fn the_cpu_entry_points_match_the_backend_ones() {
    let dims = |s: &[usize]| attn::inputs::tensor(attn::DType::Bf16, s, 5).unwrap();
    let (q, k, v) = (
        dims(&[1, 4, 9, 16]),
        dims(&[1, 4, 9, 16]),
        dims(&[1, 2, 9, 16]),
    );
    let lambda = attn::Tensor::from_f32(&[16], vec![0.1; 16]).unwrap();
    let x = DifferentialInputs {
        q: &q,
        k: &k,
        v: &v,
        lambda: [&lambda; 4],
        position_offset: 0,
        learned: Learned::new(&[]),
    };
    let saved = Shallow::forward(&x).unwrap();
    assert_eq!(saved.out.shape(), &[1, 2, 9, 16]);
    // lambda = exp(0.16) - exp(0.16) + 0.3: the spec's init reached the call.
    assert!((saved.lambda - 0.3).abs() < 1e-6, "{}", saved.lambda);
    let dout = dims(&[1, 2, 9, 16]);
    let g = Shallow::backward(&x, &saved, &dout).unwrap();
    assert_eq!(g.inputs.dv.shape(), v.shape());
    // A wrong value head count is an error naming v, not a panic.
    let err = Shallow::forward(&DifferentialInputs { v: &q, ..x }).unwrap_err();
    assert!(err.to_string().contains('v'), "{err}");
}
