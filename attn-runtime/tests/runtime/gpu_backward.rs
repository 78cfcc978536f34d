//! The GPU backward kernels (delta, dq, dk and dv; SIMT for f32, tensor cores for the bf16 and
//! f16 specs they support), run on the GPU IR interpreter, against
//! `attn_dsl::reference::backward`: masks, GQA/MQA, RoPE, ALiBi, softcap, custom modifiers, fully
//! masked rows, Sq != Skv and lengths that break the tiles.

use crate::support;

use crate::support::values;
use attn_dsl::reference::{self, Array, Inputs};
use attn_dsl::{AttentionSpec, DType};
use attn_runtime::cpu::CpuBackend;
use attn_runtime::gpu::sim::GpuSim;
use attn_runtime::{HeadsBackward, Tensor, Variant};

fn input(dtype: DType, shape: &[usize], seed: u64) -> (Tensor, Array) {
    let t = Tensor::from_f32_as(dtype, shape, values(shape.iter().product(), seed)).unwrap();
    let exact = t.to_f32_vec().iter().map(|x| f64::from(*x)).collect();
    (t, Array::from_vec(shape, exact).unwrap())
}

/// Checks the GPU backward of `text` against the reference; returns the largest error of the
/// gradients (absolute, past the relative part of the tolerance) and whether the kernels ran on
/// tensor cores.
fn check(text: &str, batch: usize, sq: usize, skv: usize, p0: i64) -> (f64, bool) {
    let spec: AttentionSpec = text.parse().unwrap();
    let variant = Variant::new(spec.clone()).unwrap();
    let tensor_cores = codegen::gpu::backward_kernels(variant.backward_plan().unwrap())
        .unwrap()
        .tensor_cores;
    let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let (q, qa) = input(spec.dtype, &[batch, h, sq, d], 1);
    let (k, ka) = input(spec.dtype, &[batch, hkv, skv, d], 2);
    let (v, va) = input(spec.dtype, &[batch, hkv, skv, dv], 3);
    let (dout, douta) = input(spec.dtype, &[batch, h, sq, dv], 4);
    let saved = support::forward(&CpuBackend::new(), &spec, &q, &k, &v, p0).unwrap();
    let x = HeadsBackward {
        q: &q,
        k: &k,
        v: &v,
        out: &saved.out,
        lse: &saved.lse,
        dout: &dout,
        position_offset: p0,
    };
    let got = support::backward(&GpuSim::new(), variant.spec(), &x).unwrap();
    let inputs = Inputs {
        q: &qa,
        k: &ka,
        v: &va,
        position_offset: p0,
    };
    let want = reference::backward(&spec, &inputs, &douta).unwrap();
    // ex2.approx and the tanh through it: a few ulp per probability.
    let (abs, rel) = match spec.dtype {
        DType::F32 => (1e-4, 1e-3),
        _ => (4e-2, 2e-2),
    };
    let mut worst = 0f64;
    for (name, g, w) in [
        ("dq", &got.dq, &want.dq),
        ("dk", &got.dk, &want.dk),
        ("dv", &got.dv, &want.dv),
    ] {
        assert_eq!(g.shape(), w.shape(), "{text} {name}");
        for (i, (g, w)) in g.to_f32_vec().iter().zip(w.data()).enumerate() {
            let g = f64::from(*g);
            assert!(
                (g - w).abs() <= abs + rel * w.abs(),
                "{text} [B {batch}, Sq {sq}, Skv {skv}] {name}[{i}]: got {g}, want {w}"
            );
            worst = worst.max((g - w).abs() - rel * w.abs());
        }
    }
    (worst, tensor_cores)
}

/// [`check`] on the tensor-core kernels, which must take the spec.
fn check_tc(text: &str, batch: usize, sq: usize, skv: usize, p0: i64) {
    let (worst, tensor_cores) = check(text, batch, sq, skv, p0);
    assert!(tensor_cores, "{text}: expected the tensor-core backward");
    eprintln!("{text} [B {batch}, Sq {sq}, Skv {skv}, p0 {p0}]: max error {worst:.2e}");
}

#[test]
fn masks_and_lengths_that_break_tiles() {
    check("heads = 2, head_dim = 8, mask = causal", 1, 37, 37, 0);
    check("heads = 2, head_dim = 8", 2, 5, 70, 0);
    check(
        "heads = 2, head_dim = 8, mask = sliding_window(9)",
        1,
        40,
        40,
        3,
    );
    check(
        "heads = 2, head_dim = 8, mask = causal(top_left)",
        1,
        33,
        20,
        0,
    );
}

#[test]
fn gqa_positions_and_modifiers() {
    check(
        "heads = 4, kv_heads = 2, head_dim = 8, v_head_dim = 4, mask = causal, position = rope",
        1,
        20,
        35,
        4,
    );
    check(
        "heads = 3, kv_heads = 1, head_dim = 8, position = rope(layout = interleaved)",
        1,
        9,
        9,
        0,
    );
    check(
        "heads = 4, head_dim = 8, mask = causal, position = alibi, softcap = 2.0",
        1,
        17,
        17,
        0,
    );
    check(
        "heads = 2, head_dim = 8, score_mod = |s, b, h, q, k| (s * 0.5).tanh() * 3.0 - 0.02 * \
         (q - k).abs() as f32, mask_mod = |b, h, q, k| (q + k) % 3 != 1 && q != 6",
        2,
        12,
        15,
        0,
    );
}

#[test]
fn low_precision_inputs() {
    check(
        "heads = 2, kv_heads = 1, head_dim = 16, mask = causal, dtype = bf16",
        1,
        20,
        20,
        0,
    );
}

#[test]
fn tensor_cores_masks_lengths_and_head_dims() {
    check_tc(
        "heads = 2, head_dim = 64, mask = causal, dtype = bf16",
        1,
        130,
        130,
        0,
    );
    check_tc("heads = 2, head_dim = 32, dtype = f16", 2, 7, 65, 0);
    check_tc("heads = 2, head_dim = 16, dtype = bf16", 1, 1, 63, 5);
    check_tc(
        "heads = 2, head_dim = 128, v_head_dim = 64, mask = causal, dtype = bf16",
        1,
        70,
        100,
        0,
    );
    check_tc(
        "heads = 1, head_dim = 48, v_head_dim = 112, mask = sliding_window(20), dtype = f16",
        1,
        90,
        90,
        2,
    );
    check_tc(
        "heads = 2, head_dim = 32, mask = causal(top_left), dtype = bf16",
        1,
        40,
        20,
        0,
    );
}

#[test]
fn tensor_cores_gqa_rope_and_modifiers() {
    check_tc(
        "heads = 4, kv_heads = 1, head_dim = 64, mask = causal, position = rope, dtype = bf16",
        1,
        33,
        80,
        3,
    );
    check_tc(
        "heads = 4, kv_heads = 2, head_dim = 32, position = rope(layout = interleaved, \
         dim = 16), dtype = f16",
        2,
        20,
        20,
        0,
    );
    check_tc(
        "heads = 2, kv_heads = 1, head_dim = 128, mask = causal, position = rope(dim = 32, \
         scaling = yarn(factor = 4.0, original_max_position = 64)), dtype = f16",
        1,
        40,
        72,
        0,
    );
    check_tc(
        "heads = 3, head_dim = 32, mask = causal, position = alibi, softcap = 2.0, dtype = bf16",
        1,
        45,
        45,
        0,
    );
    check_tc(
        "heads = 2, head_dim = 16, score_mod = |s, b, h, q, k| (s * 0.5).tanh() * 3.0 - 0.02 * \
         (q - k).abs() as f32, mask_mod = |b, h, q, k| (q + k) % 3 != 1 && q != 6, dtype = bf16",
        2,
        12,
        70,
        0,
    );
}

#[test]
fn tensor_cores_fully_masked_rows_carry_nothing() {
    // Queries 0..4 keep no key (the window misses every key under top-left alignment's
    // shift), and the rows stay zero, never NaN.
    check_tc(
        "heads = 2, head_dim = 16, mask_mod = |b, h, q, k| q >= 5 && k <= q, dtype = bf16",
        1,
        24,
        24,
        0,
    );
}

#[test]
fn tensor_cores_take_the_saved_lse_of_the_gpu_forward() {
    // bf16 under RoPE over every column: the tensor-core forward computes its scores from f16
    // operands, and the backward recomputes them the same way, so P matches the saved lse.
    let text =
        "heads = 4, kv_heads = 2, head_dim = 64, mask = causal, position = rope, dtype = bf16";
    let spec: AttentionSpec = text.parse().unwrap();
    let variant = Variant::new(spec.clone()).unwrap();
    assert!(
        codegen::gpu::backward_kernels(variant.backward_plan().unwrap())
            .unwrap()
            .tensor_cores
    );
    let (b, sq) = (1, 40);
    let (q, qa) = input(spec.dtype, &[b, 4, sq, 64], 11);
    let (k, ka) = input(spec.dtype, &[b, 2, sq, 64], 12);
    let (v, va) = input(spec.dtype, &[b, 2, sq, 64], 13);
    let (dout, douta) = input(spec.dtype, &[b, 4, sq, 64], 14);
    let saved = support::forward(&GpuSim::new(), variant.spec(), &q, &k, &v, 0).unwrap();
    let x = HeadsBackward {
        q: &q,
        k: &k,
        v: &v,
        out: &saved.out,
        lse: &saved.lse,
        dout: &dout,
        position_offset: 0,
    };
    let got = support::backward(&GpuSim::new(), variant.spec(), &x).unwrap();
    let inputs = Inputs {
        q: &qa,
        k: &ka,
        v: &va,
        position_offset: 0,
    };
    let want = reference::backward(&spec, &inputs, &douta).unwrap();
    for (name, g, w) in [
        ("dq", &got.dq, &want.dq),
        ("dk", &got.dk, &want.dk),
        ("dv", &got.dv, &want.dv),
    ] {
        for (i, (g, w)) in g.to_f32_vec().iter().zip(w.data()).enumerate() {
            let g = f64::from(*g);
            assert!(
                (g - w).abs() <= 4e-2 + 2e-2 * w.abs(),
                "{name}[{i}]: got {g}, want {w}"
            );
        }
    }
}
