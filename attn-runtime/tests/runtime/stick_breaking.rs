//! `normalize = stick_breaking` on the backends: the CPU kernels' and the GPU SIMT kernels'
//! forward (key tiles from the last, each row's softplus sum carried) and backward (the same
//! order, with `D` less the nearer keys' `dP A` carried; on the GPU through the row state the dq
//! kernel leaves at each block of keys) against the reference, learnable parameters included
//! (its decode is checked with the other caches' tests, in `decode.rs` and `gpu_runtime.rs`;
//! f32 data tensors in `data.rs`).

use crate::learned::Case;
use attn_runtime::cpu::CpuBackend;
use attn_runtime::gpu::sim::GpuSim;

/// Causal GQA over several key tiles; a window with RoPE and a softcap (a derivative that is not
/// constant); a custom mask and score modifier; bf16; and a non-causal call, where keys after
/// the query are the nearer ones.
const SPECS: [&str; 5] = [
    "heads = 4, kv_heads = 2, head_dim = 32, mask = causal, normalize = stick_breaking",
    "heads = 2, head_dim = 16, mask = sliding_window(40), position = rope, softcap = 5.0, \
     normalize = stick_breaking",
    "heads = 2, head_dim = 16, normalize = stick_breaking, \
     score_mod = |s, b, h, q, k| s - 0.05 * (q - k).abs() as f32, \
     mask_mod = |b, h, q, k| (q + k) % 5 != 2",
    "heads = 2, kv_heads = 1, head_dim = 64, mask = causal, dtype = bf16, \
     normalize = stick_breaking",
    "heads = 2, head_dim = 16, position = xpos(scale_base = 64.0), normalize = stick_breaking",
];

#[test]
fn cpu_stick_breaking_matches_the_reference() {
    let cpu = CpuBackend::new();
    for (i, spec) in SPECS.iter().enumerate() {
        // Three key tiles, a query block that starts mid-sequence, and offsets.
        Case::new(spec, 2, 150 - 20 * i, 170, 3 * i as i64).check(&cpu);
    }
    // One long row: the running sums cross many tiles.
    Case::new(SPECS[0], 1, 4, 700, 0).check(&cpu);
}

/// On the interpreter: key tiles of 32 and (head_dim 80) of 16 keys, rows crossing several
/// blocks of 64 keys (the dk/dv kernel's, whose row state the dq kernel leaves), the window's
/// skipped tiles, GQA, bf16 and a custom mask.
#[test]
fn gpu_sim_stick_breaking_matches_the_reference() {
    let sim = GpuSim::new();
    for (i, spec) in SPECS.iter().enumerate() {
        Case::new(spec, 1, 40 - 5 * i, 150, 2 * i as i64).check(&sim);
    }
    let wide = "heads = 2, kv_heads = 1, head_dim = 80, mask = causal, normalize = stick_breaking";
    Case::new(wide, 1, 20, 140, 0).check(&sim);
}

/// Learnable parameters: their gradients sum each pair's `dS` (known only once the row's chain
/// is walked) times the score's derivative; a multiplier and a bias per head and distance,
/// over several key tiles, on the CPU and (fewer rows) the GPU kernels (f32 data tensors:
/// `data.rs`).
#[test]
fn stick_breaking_learns_parameters() {
    let (cpu, sim) = (CpuBackend::new(), GpuSim::new());
    for spec in [
        "heads = 2, head_dim = 16, mask = causal, normalize = stick_breaking, \
         params(w: [heads]), score_mod = |s, b, h, q, k| s * (1.0 + w[h])",
        "heads = 4, kv_heads = 2, head_dim = 16, mask = sliding_window(50), \
         normalize = stick_breaking, params(rel: [heads, 16]), \
         score_mod = |s, b, h, q, k| s + rel[h, (q - k).max(0).min(15)]",
    ] {
        Case::new(spec, 1, 70, 150, 0).check(&cpu);
        Case::new(spec, 1, 30, 100, 2).check(&sim);
    }
}
