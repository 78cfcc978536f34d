//! The log-sum-exp of bf16 specs under RoPE against float64, on the GPU tensor-core kernel (run
//! on the GPU IR interpreter, which rounds as the tensor cores do) and the CPU backend: within
//! 1e-3 of `1 + |lse|`. Rotated q and k are rounded to 16 bits for the tensor cores; f16 keeps
//! them close enough where bf16 did not (up to 6e-3 on these cases).

use crate::support;

use crate::support::values;
use attn_dsl::AttentionSpec;
use attn_dsl::reference::{self, Array, Inputs};
use attn_runtime::Tensor;
use attn_runtime::cpu::CpuBackend;
use attn_runtime::gpu::GpuCall;

struct Inputs3 {
    q: Tensor,
    k: Tensor,
    v: Tensor,
}

fn inputs(spec: &AttentionSpec, sq: usize, skv: usize, scale: f32) -> Inputs3 {
    let (h, hkv, d) = (
        spec.heads as usize,
        spec.kv_heads() as usize,
        spec.head_dim as usize,
    );
    let make = |shape: &[usize], seed| {
        Tensor::from_f32_as(
            spec.dtype,
            shape,
            values(shape.iter().product(), seed)
                .iter()
                .map(|x| x * scale)
                .collect(),
        )
        .unwrap()
    };
    Inputs3 {
        q: make(&[1, h, sq, d], 1),
        k: make(&[1, hkv, skv, d], 2),
        v: make(&[1, hkv, skv, d], 3),
    }
}

fn exact(t: &Tensor) -> Array {
    Array::from_vec(
        t.shape(),
        t.to_f32_vec().iter().map(|x| f64::from(*x)).collect(),
    )
    .unwrap()
}

/// The largest |lse - float64| / (1 + |float64|) of the GPU kernel and of the CPU backend.
fn lse_errors(spec: &AttentionSpec, x: &Inputs3) -> (f64, f64) {
    let inputs = Inputs {
        q: &exact(&x.q),
        k: &exact(&x.k),
        v: &exact(&x.v),
        position_offset: 0,
    };
    let want = reference::attention(spec, &inputs).unwrap();
    let error = |got: &Tensor| {
        got.to_f32_vec()
            .iter()
            .zip(want.lse.data())
            .map(|(g, w)| (f64::from(*g) - w).abs() / (1.0 + w.abs()))
            // A NaN (or infinite) miss is the largest.
            .fold(0.0, |worst: f64, e| {
                if e.is_nan() {
                    f64::INFINITY
                } else {
                    worst.max(e)
                }
            })
    };
    let gpu = GpuCall::forward(spec, &x.q, &x.k, &x.v, 0)
        .unwrap()
        .run_on_sim()
        .unwrap();
    let cpu = support::forward(&CpuBackend::new(), spec, &x.q, &x.k, &x.v, 0).unwrap();
    (error(&gpu.lse), error(&cpu.lse))
}

#[test]
fn bf16_rope_lse_is_within_1e_3_of_float64() {
    for mask in ["none", "causal"] {
        for layout in ["half", "interleaved"] {
            let text = format!(
                "heads = 4, kv_heads = 2, head_dim = 64, mask = {mask}, dtype = bf16, \
                 position = rope(base = 10000.0, layout = {layout})"
            );
            let spec: AttentionSpec = text.parse().unwrap();
            for scale in [1.7, 3.4, 5.1] {
                let (gpu, cpu) = lse_errors(&spec, &inputs(&spec, 128, 128, scale));
                assert!(
                    gpu < 1e-3,
                    "{text}, inputs x{scale}: GPU lse error {gpu:.2e}"
                );
                assert!(
                    cpu < 1e-3,
                    "{text}, inputs x{scale}: CPU lse error {cpu:.2e}"
                );
            }
        }
    }
}

#[test]
fn inputs_past_the_f16_operand_range_run_in_f32() {
    // A pair of q values of 60000 (columns 1 and 9, a RoPE pair): rotated at query 3, one of
    // them is about 83000, past f16's range, so the call runs on the SIMT kernel (f32) and
    // still meets float64.
    let spec: AttentionSpec =
        "heads = 2, head_dim = 16, mask = causal, dtype = bf16, position = rope"
            .parse()
            .unwrap();
    let mut x = inputs(&spec, 40, 40, 0.05);
    let mut q = x.q.to_f32_vec();
    q[3 * 16 + 1] = 60000.0;
    q[3 * 16 + 9] = 60000.0;
    x.q = Tensor::from_f32_as(spec.dtype, &[1, 2, 40, 16], q).unwrap();
    let (gpu, cpu) = lse_errors(&spec, &x);
    assert!(gpu < 1e-3, "GPU lse error {gpu:.2e}");
    assert!(cpu < 1e-3, "CPU lse error {cpu:.2e}");
}
