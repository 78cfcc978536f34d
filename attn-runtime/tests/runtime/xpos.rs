//! xPos on the backends: the CPU kernels' forward and backward against the reference (the
//! decay applied to q and k through separate tables, measured from the middle of the call's
//! positions), calls far from position 0, positions past the tables' range refused, and the
//! GPU backends' refusal.

use crate::learned::Case;
use attn_runtime::cpu::CpuBackend;
use attn_runtime::gpu::sim::GpuSim;
use attn_runtime::{Backend, Inputs as Call, RuntimeError, Tensor, Variant};

/// Causal GQA at the paper's decay; a strong decay with a window and half-layout pairs; a
/// partial rotation with learned slopes; bf16; and a non-causal call, where keys after the
/// query grow.
const SPECS: [&str; 5] = [
    "heads = 4, kv_heads = 2, head_dim = 32, mask = causal, position = xpos",
    "heads = 2, head_dim = 16, mask = sliding_window(30), \
     position = xpos(base = 500.0, layout = half, scale_base = 8.0, gamma = 0.2)",
    "heads = 2, head_dim = 32, mask = causal, position = xpos(dim = 16, scale_base = 32.0), \
     params(slopes: [heads]), score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32",
    "heads = 2, kv_heads = 1, head_dim = 64, mask = causal, dtype = bf16, \
     position = xpos(scale_base = 64.0)",
    "heads = 2, head_dim = 16, position = xpos(scale_base = 128.0), softcap = 10.0",
];

#[test]
fn cpu_xpos_matches_the_reference() {
    let cpu = CpuBackend::new();
    for (i, spec) in SPECS.iter().enumerate() {
        // Past one key tile, a query block that starts mid-sequence, and offsets.
        Case::new(spec, 2, 70 - 10 * i, 90, 3 * i as i64).check(&cpu);
    }
}

#[test]
fn cpu_xpos_far_from_position_zero_matches_the_reference() {
    // At the paper's decay, position 20,000 alone would scale a key by e^49 from position 0:
    // the factors are measured from the middle of the call's positions instead.
    let cpu = CpuBackend::new();
    Case::new(SPECS[0], 1, 40, 64, 20_000).check(&cpu);
    Case::new(SPECS[3], 1, 1, 80, 3_000).check(&cpu);
}

fn zeros(shape: &[usize]) -> Tensor {
    Tensor::from_f32(shape, vec![0.0; shape.iter().product()]).unwrap()
}

#[test]
fn positions_past_the_tables_range_are_refused() {
    // scale_base = 8: the factor at 400 positions from the middle is e^(400 * 1.25 / 8).
    let spec = "heads = 1, head_dim = 16, position = xpos(scale_base = 8.0)";
    let variant = Variant::shared(&spec.parse().unwrap()).unwrap();
    let (q, k) = (zeros(&[1, 1, 1, 16]), zeros(&[1, 1, 900, 16]));
    let err = CpuBackend::new()
        .forward(&variant, Call::heads(&q, &k, &k), 0)
        .unwrap_err();
    let said = err.to_string();
    assert!(matches!(err, RuntimeError::Data(_)), "{said}");
    assert!(said.contains("xpos") && said.contains("allowed"), "{said}");
    // A shorter call at the same positions runs.
    let k = zeros(&[1, 1, 100, 16]);
    let out = CpuBackend::new()
        .forward(&variant, Call::heads(&q, &k, &k), 800)
        .unwrap();
    assert!(out.out.to_f32_vec().iter().all(|x| x.is_finite()));
}

#[test]
fn gpu_backends_refuse_xpos() {
    let variant = Variant::shared(&SPECS[0].parse().unwrap()).unwrap();
    let (q, k) = (zeros(&[1, 4, 8, 32]), zeros(&[1, 2, 8, 32]));
    let err = GpuSim::new()
        .forward(&variant, Call::heads(&q, &k, &k), 0)
        .unwrap_err();
    assert!(matches!(err, RuntimeError::Unsupported { .. }), "{err}");
    assert!(err.to_string().contains("xpos"), "{err}");
}
