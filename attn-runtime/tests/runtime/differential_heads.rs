//! Differential heads (`differential = lambda(init = L)`) on the CPU kernels and the GPU kernels
//! (on the interpreter): output, the components' lse and every gradient, lambda's vectors and
//! the spec's learnable tensors included, against `reference::differential`; and what is
//! refused.

use crate::learned::{by_name, compare, input, learned};
use attn_dsl::reference::{self, Inputs};
use attn_dsl::{AttentionSpec, DType};
use attn_runtime::Backend;
use attn_runtime::cpu::CpuBackend;
use attn_runtime::differential::{Differential, DifferentialInputs};
use attn_runtime::gpu::sim::GpuSim;
use attn_runtime::{Learned, RuntimeError, Tensor, Variant};

/// GQA with RoPE and values wider than the keys; a bf16 window with a softcap; sigmoid
/// attention with learnable slopes; learned sinks.
const SPECS: [&str; 4] = [
    "heads = 4, kv_heads = 2, head_dim = 16, v_head_dim = 32, mask = causal, position = rope, \
     differential = lambda",
    "heads = 2, head_dim = 16, mask = sliding_window(20), softcap = 10.0, dtype = bf16, \
     differential = lambda(init = 0.2)",
    "heads = 4, head_dim = 16, mask = causal, normalize = sigmoid(bias = -2.0), \
     params(slopes: [heads]), score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32, \
     differential = lambda",
    "heads = 2, head_dim = 16, sinks = learned, differential = lambda(init = 0.5)",
];

fn lambda_vectors(d: usize) -> Vec<(Tensor, Vec<f64>)> {
    (0..4)
        .map(|i| {
            let v: Vec<f32> = crate::support::values(d, 40 + i)
                .iter()
                .map(|x| 0.3 * x)
                .collect();
            let exact = v.iter().map(|x| f64::from(*x)).collect();
            (Tensor::from_f32(&[d], v).unwrap(), exact)
        })
        .collect()
}

fn check(text: &str, backend: &dyn Backend, (batch, sq, skv, p0): (usize, usize, usize, i64)) {
    let spec: AttentionSpec = text.parse().unwrap();
    let heads = Differential::new(spec.clone()).unwrap();
    let (h, hk) = (spec.heads as usize, spec.kv_heads() as usize);
    let (d, dv, dt) = (spec.head_dim as usize, spec.v_head_dim as usize, spec.dtype);
    let q = input(dt, &[batch, h, sq, d], 1);
    let k = input(dt, &[batch, hk, skv, d], 2);
    let v = input(dt, &[batch, hk / 2, skv, dv], 3);
    let dout = input(dt, &[batch, h / 2, sq, dv], 4);
    let (tensors, values) = learned(&spec, 20);
    let lambda = lambda_vectors(d);
    let named = by_name(&tensors);
    let x = DifferentialInputs {
        q: &q.0,
        k: &k.0,
        v: &v.0,
        lambda: [&lambda[0].0, &lambda[1].0, &lambda[2].0, &lambda[3].0],
        position_offset: p0,
        learned: Learned::new(&named),
    };
    let saved = heads.forward(backend, &x).unwrap();
    let got = heads.backward(backend, &x, &saved, &dout.0).unwrap();

    let r = Inputs {
        q: &q.1,
        k: &k.1,
        v: &v.1,
        position_offset: p0,
    };
    let lv = [
        &lambda[0].1[..],
        &lambda[1].1[..],
        &lambda[2].1[..],
        &lambda[3].1[..],
    ];
    let want = reference::differential(&spec, &r, lv, &values).unwrap();
    let want_g = reference::differential_backward(&spec, &r, lv, &dout.1, &values).unwrap();
    let (abs, rel) = match dt {
        DType::F32 => (5e-5, 5e-4),
        _ => (4e-2, 2e-2),
    };
    let what = format!("{text} on {}", backend.name());
    assert!(
        (f64::from(saved.lambda) - want.lambda).abs() < 1e-6,
        "{what}: lambda"
    );
    assert_eq!(saved.out.shape(), want.out.shape(), "{what}: out shape");
    let out = saved.out.to_f32_vec();
    compare(&format!("{what}: out"), &out, want.out.data(), abs, rel);
    let lse = saved.components.lse.to_f32_vec();
    compare(
        &format!("{what}: lse"),
        &lse,
        want.components.lse.data(),
        1e-4,
        1e-5,
    );
    let pairs = [
        ("dq", &got.inputs.dq, &want_g.inputs.dq),
        ("dk", &got.inputs.dk, &want_g.inputs.dk),
        ("dv", &got.inputs.dv, &want_g.inputs.dv),
    ];
    for (name, g, w) in pairs {
        assert_eq!(g.shape(), w.shape(), "{what}: {name} shape");
        compare(
            &format!("{what}: {name}"),
            &g.to_f32_vec(),
            w.data(),
            abs,
            rel,
        );
    }
    // Sums over every output element: their error scales with the largest term.
    let lambdas = got.lambda.iter().zip(&want_g.lambda);
    for ((name, g), w) in lambdas {
        let scale = w.iter().fold(1.0f64, |m, x| m.max(x.abs()));
        compare(
            &format!("{what}: {name}"),
            &g.to_f32_vec(),
            w,
            abs * scale * 4.0,
            rel,
        );
        assert!(w.iter().any(|x| *x != 0.0), "{what}: {name} is all zero");
    }
    assert_eq!(got.inputs.learned.len(), want_g.inputs.learned.len());
    for ((name, g), w) in got.inputs.learned.iter().zip(&want_g.inputs.learned) {
        let scale = w.values.iter().fold(1.0f64, |m, x| m.max(x.abs()));
        let (g, w) = (g.to_f32_vec(), &w.values);
        compare(&format!("{what}: {name}"), &g, w, abs * scale * 4.0, rel);
    }
}

#[test]
fn cpu_differential_heads_match_the_reference() {
    let cpu = CpuBackend::new();
    for (i, spec) in SPECS.iter().enumerate() {
        check(spec, &cpu, (2, 70 - 10 * i, 90, 2 * i as i64));
    }
}

#[test]
fn gpu_differential_heads_match_the_reference_on_the_interpreter() {
    let gpu = GpuSim::new();
    for (i, spec) in SPECS.iter().enumerate() {
        check(spec, &gpu, (1, 20, 33, i as i64));
    }
}

fn zeros(shape: &[usize]) -> Tensor {
    Tensor::from_f32(shape, vec![0.0; shape.iter().product()]).unwrap()
}

#[test]
fn bad_calls_are_refused_with_what_was_wrong() {
    let spec: AttentionSpec = SPECS[0].parse().unwrap();
    let err = Variant::new(spec.clone()).unwrap_err();
    assert!(err.to_string().contains("Differential"), "{err}");
    let plain: AttentionSpec = "heads = 2, head_dim = 16".parse().unwrap();
    let err = Differential::new(plain).unwrap_err();
    assert!(err.to_string().contains("no differential heads"), "{err}");

    let heads = Differential::new(spec).unwrap();
    let cpu = CpuBackend::new();
    let (q, k) = (zeros(&[1, 4, 5, 16]), zeros(&[1, 2, 5, 16]));
    let (good_v, dim) = (zeros(&[1, 1, 5, 32]), zeros(&[16]));
    let call = |v: &Tensor, lambda: [&Tensor; 4]| {
        let x = DifferentialInputs {
            q: &q,
            k: &k,
            v,
            lambda,
            position_offset: 0,
            learned: Learned::none(),
        };
        heads.forward(&cpu, &x)
    };
    // v with a head per key head, not per pair.
    let err = call(&zeros(&[1, 2, 5, 32]), [&dim; 4]).unwrap_err();
    assert!(
        matches!(&err, RuntimeError::Shape { tensor, .. } if tensor == "v"),
        "{err}"
    );
    let short = zeros(&[15]);
    let err = call(&good_v, [&dim, &dim, &dim, &short]).unwrap_err();
    assert!(err.to_string().contains("lambda_k2"), "{err}");
    let huge = Tensor::from_f32(&[16], vec![30.0; 16]).unwrap();
    let err = call(&good_v, [&huge, &huge, &dim, &dim]).unwrap_err();
    assert!(err.to_string().contains("finite"), "{err}");

    // The backward takes the forward's lambda and an output gradient of the output's shape.
    let saved = call(&good_v, [&dim; 4]).unwrap();
    let one = Tensor::from_f32(&[16], vec![0.1; 16]).unwrap();
    let x = DifferentialInputs {
        q: &q,
        k: &k,
        v: &good_v,
        lambda: [&one, &one, &dim, &dim],
        position_offset: 0,
        learned: Learned::none(),
    };
    let dout = zeros(&[1, 2, 5, 32]);
    let err = heads.backward(&cpu, &x, &saved, &dout).unwrap_err();
    assert!(err.to_string().contains("the forward ran with"), "{err}");
    let x = DifferentialInputs {
        lambda: [&dim; 4],
        ..x
    };
    let err = heads
        .backward(&cpu, &x, &saved, &zeros(&[1, 4, 5, 32]))
        .unwrap_err();
    assert!(
        matches!(&err, RuntimeError::Shape { tensor, .. } if tensor == "dout"),
        "{err}"
    );
    assert!(heads.backward(&cpu, &x, &saved, &dout).is_ok());
}

/// `[1, H, S, D]` rows as `[S, H, D]` (a sequence of a packed batch), as f32 values.
fn token_major(t: &Tensor) -> Vec<f32> {
    let [_, h, s, d] = t.shape().try_into().unwrap();
    let x = t.to_f32_vec();
    let mut out = Vec::with_capacity(x.len());
    for i in 0..s {
        for head in 0..h {
            out.extend_from_slice(&x[(head * s + i) * d..(head * s + i + 1) * d]);
        }
    }
    out
}

/// A packed batch of two sequences (with learnable slopes, GQA and RoPE) gives what each
/// sequence gives as its own padded call: outputs, lse and every gradient, lambda's and the
/// slopes' summed over the sequences.
#[test]
fn packed_batches_equal_their_sequences_called_alone() {
    let cpu = CpuBackend::new();
    for text in [SPECS[0], SPECS[2]] {
        let spec: AttentionSpec = text.parse().unwrap();
        let heads = Differential::new(spec.clone()).unwrap();
        let (h, hk) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let lambda = lambda_vectors(d);
        let lambda = [&lambda[0].0, &lambda[1].0, &lambda[2].0, &lambda[3].0];
        let (tensors, _) = learned(&spec, 20);
        let named = by_name(&tensors);
        let (mut alone, mut packed) = (Vec::new(), [(); 4].map(|_| Vec::new()));
        let mut dlambda = vec![vec![0f32; d]; 4];
        let mut dlearned: Vec<Vec<f32>> = Vec::new();
        for (n, len) in [(0u64, 37usize), (1, 20)] {
            let q = input(DType::F32, &[1, h, len, d], 1 + 10 * n).0;
            let k = input(DType::F32, &[1, hk, len, d], 2 + 10 * n).0;
            let v = input(DType::F32, &[1, hk / 2, len, dv], 3 + 10 * n).0;
            let dout = input(DType::F32, &[1, h / 2, len, dv], 4 + 10 * n).0;
            let x = DifferentialInputs {
                q: &q,
                k: &k,
                v: &v,
                lambda,
                position_offset: 0,
                learned: Learned::new(&named),
            };
            let saved = heads.forward(&cpu, &x).unwrap();
            let g = heads.backward(&cpu, &x, &saved, &dout).unwrap();
            for (all, t) in packed.iter_mut().zip([&q, &k, &v, &dout]) {
                all.extend(token_major(t));
            }
            alone.push([saved.out, g.inputs.dq, g.inputs.dk, g.inputs.dv].map(|t| token_major(&t)));
            for (sum, (_, t)) in dlambda.iter_mut().zip(&g.lambda) {
                sum.iter_mut()
                    .zip(t.to_f32_vec())
                    .for_each(|(s, x)| *s += x);
            }
            dlearned.resize(g.inputs.learned.len(), Vec::new());
            for (sum, (_, t)) in dlearned.iter_mut().zip(&g.inputs.learned) {
                sum.resize(t.shape().iter().product(), 0.0);
                sum.iter_mut()
                    .zip(t.to_f32_vec())
                    .for_each(|(s, x)| *s += x);
            }
        }
        let total = 57;
        let shaped = |i: usize, heads: usize, width: usize| {
            Tensor::from_f32(&[total, heads, width], packed[i].clone()).unwrap()
        };
        let (q, k, v) = (shaped(0, h, d), shaped(1, hk, d), shaped(2, hk / 2, dv));
        let dout = shaped(3, h / 2, dv);
        let cu = [0, 37, 57];
        let x = attn_runtime::differential::DifferentialVarlen {
            batch: attn_runtime::varlen::Varlen {
                q: &q,
                k: &k,
                v: &v,
                cu_seqlens_q: &cu,
                cu_seqlens_k: &cu,
            },
            lambda,
            position_offset: 0,
            learned: Learned::new(&named),
        };
        let saved = heads.forward_varlen(&cpu, &x).unwrap();
        let g = heads.backward_varlen(&cpu, &x, &saved, &dout).unwrap();
        assert_eq!(saved.out.shape(), [total, h / 2, dv], "{text}");
        let got = [&saved.out, &g.inputs.dq, &g.inputs.dk, &g.inputs.dv];
        for (i, (name, got)) in ["out", "dq", "dk", "dv"].iter().zip(got).enumerate() {
            let want: Vec<f64> = alone
                .iter()
                .flat_map(|a| a[i].iter().map(|x| f64::from(*x)))
                .collect();
            compare(
                &format!("{text}: {name}"),
                &got.to_f32_vec(),
                &want,
                1e-6,
                1e-6,
            );
        }
        for (sum, (name, t)) in dlambda.iter().zip(&g.lambda) {
            let want: Vec<f64> = sum.iter().map(|x| f64::from(*x)).collect();
            compare(
                &format!("{text}: {name}"),
                &t.to_f32_vec(),
                &want,
                1e-4,
                1e-4,
            );
        }
        for (sum, (name, t)) in dlearned.iter().zip(&g.inputs.learned) {
            let want: Vec<f64> = sum.iter().map(|x| f64::from(*x)).collect();
            compare(
                &format!("{text}: {name}"),
                &t.to_f32_vec(),
                &want,
                1e-4,
                1e-4,
            );
        }
    }
}
