//! The GPU backward kernels (SIMT: delta, dq, dk and dv), run on the GPU IR interpreter, against
//! `attn_dsl::reference::backward`: masks, GQA/MQA, RoPE, ALiBi, softcap, custom modifiers, fully
//! masked rows, Sq != Skv and lengths that break the tiles.

mod common;

use attn_dsl::reference::{self, Array, Inputs};
use attn_dsl::{AttentionSpec, DType};
use attn_runtime::backend::{Backend, GpuInterpreter};
use attn_runtime::cpu::CpuBackend;
use attn_runtime::{BackwardInputs, Tensor, Variant};
use common::values;

fn input(dtype: DType, shape: &[usize], seed: u64) -> (Tensor, Array) {
    let t = Tensor::from_f32_as(dtype, shape, values(shape.iter().product(), seed)).unwrap();
    let exact = t.to_f32_vec().iter().map(|x| f64::from(*x)).collect();
    (t, Array::from_vec(shape, exact).unwrap())
}

fn check(text: &str, batch: usize, sq: usize, skv: usize, p0: i64) {
    let spec: AttentionSpec = text.parse().unwrap();
    let variant = Variant::new(spec.clone()).unwrap();
    let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let (q, qa) = input(spec.dtype, &[batch, h, sq, d], 1);
    let (k, ka) = input(spec.dtype, &[batch, hkv, skv, d], 2);
    let (v, va) = input(spec.dtype, &[batch, hkv, skv, dv], 3);
    let (dout, douta) = input(spec.dtype, &[batch, h, sq, dv], 4);
    let saved = CpuBackend::new().forward(&spec, &q, &k, &v, p0).unwrap();
    let x = BackwardInputs {
        q: &q,
        k: &k,
        v: &v,
        out: &saved.out,
        lse: &saved.lse,
        dout: &dout,
        position_offset: p0,
    };
    let got = GpuInterpreter.backward(&variant, &x).unwrap();
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
        }
    }
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
