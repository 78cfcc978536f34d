//! xPos on the backends: the CPU kernels' forward and backward against the reference (the
//! decay applied to q and k through separate tables, measured from the middle of the call's
//! positions), the GPU kernels' on the interpreter, calls far from position 0, and positions
//! past the tables' range refused.

use crate::learned::Case;
use attn_runtime::cache::PagedCache;
use attn_runtime::cpu::CpuBackend;
use attn_runtime::gpu::GpuCall;
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
fn gpu_sim_xpos_matches_the_reference() {
    // f32 on the SIMT kernels, bf16 on the tensor-core ones: each reads the keys' tables apart.
    let sim = GpuSim::new();
    for (i, spec) in SPECS.iter().enumerate() {
        Case::new(spec, 1, 30 - 3 * i, 37, 2 * i as i64).check(&sim);
    }
    Case::new(SPECS[3], 1, 20, 70, 3_000).check(&sim);
}

/// The forward on one chosen GPU kernel against the reference.
fn check_gpu_forward(call: &GpuCall, case: &Case, kernel: &str) {
    assert_eq!(call.kernel.name, kernel);
    let got = call.run_on_sim().unwrap();
    let want = case.reference_forward();
    for (what, g, w) in [
        ("out", got.out.to_f32_vec(), want.out.data()),
        ("lse", got.lse.to_f32_vec(), want.lse.data()),
    ] {
        for (i, (g, w)) in g.iter().zip(w).enumerate() {
            let g = f64::from(*g);
            assert!(
                (g - w).abs() <= 4e-2 + 2e-2 * w.abs(),
                "{kernel} {what}[{i}]: {g} vs {w}"
            );
        }
    }
}

#[test]
fn every_gpu_kernel_reads_the_keys_own_tables() {
    // bf16 at head_dim 64: the tensor-core forward (K rotated in shared memory from the keys'
    // table rows), the sm_90a forward (its producer rotating K in place) and the tensor-core
    // backward (K staged and dk rotated back by the keys' tables).
    let text = "heads = 2, kv_heads = 1, head_dim = 64, mask = causal, dtype = bf16, \
                position = xpos(scale_base = 16.0)";
    let case = Case::new(text, 1, 40, 70, 5);
    let [q, k, v] = case.inputs();
    let call = GpuCall::forward(&case.spec, q, k, v, 5).unwrap();
    check_gpu_forward(&call, &case, "attention_forward_tc");
    let call = GpuCall::forward_wgmma(&case.spec, q, k, v, 5).unwrap();
    check_gpu_forward(&call, &case, "attention_forward_wgmma");
    let plan = Variant::new(case.spec.clone()).unwrap();
    let kernels = codegen::gpu::backward_kernels(plan.backward_plan().unwrap()).unwrap();
    assert!(kernels.tensor_cores);
    case.check(&GpuSim::new());
}

#[test]
fn gpu_decode_equals_the_cpu_decode() {
    // The cache's keys carry their factors from position 0; the GPU decode kernel rotates the
    // queries by the queries' tables from the same origin.
    let spec: attn_dsl::AttentionSpec = "heads = 4, kv_heads = 2, head_dim = 32, mask = causal, \
                                         position = xpos(scale_base = 64.0)"
        .parse()
        .unwrap();
    let mut cache = PagedCache::new(&spec, 16, 8).unwrap();
    let seq = cache.add_sequence();
    let values = |n: usize, seed: u64| crate::support::values(n, seed);
    let kv = |seed| Tensor::from_f32(&[2, 90, 32], values(2 * 90 * 32, seed)).unwrap();
    cache.append(seq, &kv(1), &kv(2)).unwrap();
    let q = Tensor::from_f32(&[1, 4, 3, 32], values(4 * 3 * 32, 3)).unwrap();
    let cpu = crate::support::decode(
        &CpuBackend::new(),
        &spec,
        &q,
        &cache,
        &[seq],
        Default::default(),
    )
    .unwrap();
    let gpu = crate::support::decode(
        &GpuSim::new(),
        &spec,
        &q,
        &cache,
        &[seq],
        Default::default(),
    )
    .unwrap();
    for (c, g) in [(&cpu.out, &gpu.out), (&cpu.lse, &gpu.lse)] {
        for (a, b) in c.to_f32_vec().iter().zip(g.to_f32_vec()) {
            assert!((a - b).abs() <= 1e-4 + 1e-4 * a.abs(), "{a} vs {b}");
        }
    }
}
