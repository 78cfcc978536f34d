//! Variable-length batches (`Backend::forward_varlen`, `Backend::backward_varlen`) on the CPU
//! and on gpu-sim, against the f64 reference run on each sequence alone; and their bad input.

use crate::support::values;
use attn_dsl::AttentionSpec;
use attn_dsl::modifier::ParamValues;
use attn_dsl::reference::{self, Array};
use attn_runtime::cpu::CpuBackend;
use attn_runtime::gpu::sim::GpuSim;
use attn_runtime::varlen::{Varlen, VarlenSaved};
use attn_runtime::{Backend, Learned, RuntimeError, Tensor, Variant};

/// A packed batch: per sequence `(queries, keys)`, and its tensors.
struct Batch {
    spec: AttentionSpec,
    lens: Vec<(usize, usize)>,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Vec<i32>,
    cu_k: Vec<i32>,
    /// The learnable tensors' values, as the runtime and the reference take them.
    learned: Vec<(String, Tensor)>,
}

impl Batch {
    fn new(text: &str, lens: &[(usize, usize)], seed: u64) -> Batch {
        let spec: AttentionSpec = text.parse().unwrap();
        let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let (tq, tk): (usize, usize) = (
            lens.iter().map(|l| l.0).sum(),
            lens.iter().map(|l| l.1).sum(),
        );
        let tensor = |shape: &[usize], seed: u64| {
            let n = shape.iter().product();
            Tensor::from_f32_as(spec.dtype, shape, values(n, seed)).unwrap()
        };
        let cumulative = |pick: fn(&(usize, usize)) -> usize| {
            std::iter::once(0)
                .chain(lens.iter().scan(0, |sum, l| {
                    *sum += pick(l) as i32;
                    Some(*sum)
                }))
                .collect()
        };
        let learned = spec
            .learnable_tensors()
            .into_iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let n = shape.iter().product();
                let v: Vec<f32> = values(n, seed + 10 + i as u64)
                    .iter()
                    .map(|x| 0.5 * x)
                    .collect();
                (name, Tensor::from_f32(&shape, v).unwrap())
            })
            .collect();
        Batch {
            q: tensor(&[tq, h, d], seed),
            k: tensor(&[tk, hkv, d], seed + 1),
            v: tensor(&[tk, hkv, dv], seed + 2),
            cu_q: cumulative(|l| l.0),
            cu_k: cumulative(|l| l.1),
            lens: lens.to_vec(),
            learned,
            spec,
        }
    }

    fn varlen(&self) -> Varlen<'_> {
        Varlen {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            cu_seqlens_q: &self.cu_q,
            cu_seqlens_k: &self.cu_k,
        }
    }

    fn learned(&self) -> Vec<(&str, &Tensor)> {
        self.learned.iter().map(|(n, t)| (n.as_str(), t)).collect()
    }

    fn reference_learned(&self) -> Vec<ParamValues> {
        self.learned
            .iter()
            .map(|(name, t)| ParamValues {
                name: name.clone(),
                shape: t.shape().to_vec(),
                values: t.to_f32_vec().iter().map(|&x| f64::from(x)).collect(),
            })
            .collect()
    }
}

/// Rows `first..first + len` of a packed `[tokens, heads, width]` tensor as a `[1, heads, len,
/// width]` reference array (written here apart from the runtime's own unpacking).
fn sequence(t: &Tensor, first: usize, len: usize) -> Array {
    let [_, heads, width] = t.shape().try_into().unwrap();
    let v = t.to_f32_vec();
    Array::from_fn(&[1, heads, len, width], |i| {
        f64::from(v[((first + i[2]) * heads + i[1]) * width + i[3]])
    })
}

/// The reference's inputs of the sequence whose queries start at row `fq` (`lq` of them) and
/// keys at row `fk` (`lk`).
fn reference_inputs(
    batch: &Batch,
    (fq, lq): (usize, usize),
    (fk, lk): (usize, usize),
) -> [Array; 3] {
    [
        sequence(&batch.q, fq, lq),
        sequence(&batch.k, fk, lk),
        sequence(&batch.v, fk, lk),
    ]
}

/// Asserts packed `got` (`[tokens, heads, width]` or `[tokens, heads]`) rows `first..` equal
/// the reference's `[1, heads, len(, width)]`.
fn assert_rows(what: &str, got: &Tensor, first: usize, want: &Array, (abs, rel): (f64, f64)) {
    let g = got.to_f32_vec();
    let shape = got.shape();
    let (heads, width) = (shape[1], shape.get(2).copied().unwrap_or(1));
    let len = want.shape()[2];
    for i in 0..len {
        for h in 0..heads {
            for c in 0..width {
                let got = f64::from(g[((first + i) * heads + h) * width + c]);
                let index: Vec<usize> = if shape.len() == 3 {
                    vec![0, h, i, c]
                } else {
                    vec![0, h, i]
                };
                let want = want.get(&index);
                if want.is_infinite() && got == want {
                    continue;
                }
                assert!(
                    (got - want).abs() <= abs + rel * want.abs(),
                    "{what}: row {} head {h} col {c}: {got} against {want}",
                    first + i
                );
            }
        }
    }
}

const SPECS: [&str; 8] = [
    "heads = 4, kv_heads = 2, head_dim = 16, mask = causal",
    "heads = 2, head_dim = 16, mask = sliding_window(7)",
    "heads = 2, kv_heads = 1, head_dim = 16, mask = causal, position = rope",
    "heads = 4, head_dim = 8, mask = causal, position = alibi",
    "heads = 2, head_dim = 16, softcap = 5.0",
    "heads = 2, head_dim = 16, mask = causal, sinks = learned",
    "heads = 2, head_dim = 16, mask = causal, params(slope: [heads]), \
     score_mod = |s, b, h, q, k| s - slope[h] * ((q - k) as f32)",
    "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, position = rope, dtype = bf16",
];

/// Self-attention with an empty sequence among others, and chunked prefill (more keys than
/// queries, the queries the last of each sequence).
const LENGTHS: [&[(usize, usize)]; 2] = [
    &[(5, 5), (0, 0), (17, 17), (33, 33)],
    &[(3, 10), (1, 1), (8, 20)],
];

/// Tolerances of `out` and of `lse`: f32 throughout, or 16-bit inputs (products of rounded
/// values on tensor cores, outputs rounded to the format).
fn tolerance(spec: &AttentionSpec) -> [(f64, f64); 2] {
    match spec.dtype {
        attn_dsl::DType::F32 => [(2e-5, 2e-5), (1e-4, 1e-4)],
        _ => [(2e-2, 2e-2), (2e-3, 2e-3)],
    }
}

fn check_forward(backend: &dyn Backend) {
    for text in SPECS {
        for (n, lens) in LENGTHS.iter().enumerate() {
            let batch = Batch::new(text, lens, 7 + n as u64);
            let variant = Variant::new(batch.spec.clone()).unwrap();
            let learned = batch.learned();
            let p0 = 3;
            let got = backend
                .forward_varlen(&variant, batch.varlen(), p0, Learned::new(&learned))
                .unwrap();
            assert_eq!(got.out.shape()[0], batch.q.shape()[0], "{text}");
            let (mut fq, mut fk) = (0, 0);
            for &(lq, lk) in &batch.lens {
                if lq > 0 {
                    let [q, k, v] = reference_inputs(&batch, (fq, lq), (fk, lk));
                    let inputs = reference::Inputs {
                        q: &q,
                        k: &k,
                        v: &v,
                        position_offset: p0,
                    };
                    let want = reference::attention_learned(
                        &batch.spec,
                        &inputs,
                        &batch.reference_learned(),
                    )
                    .unwrap();
                    let what = format!("{} {text}, sequence at row {fq}", backend.name());
                    let [out_tol, lse_tol] = tolerance(&batch.spec);
                    assert_rows(&format!("out of {what}"), &got.out, fq, &want.out, out_tol);
                    assert_rows(&format!("lse of {what}"), &got.lse, fq, &want.lse, lse_tol);
                }
                (fq, fk) = (fq + lq, fk + lk);
            }
        }
    }
}

#[test]
fn varlen_forwards_on_the_cpu_equal_the_reference_per_sequence() {
    check_forward(&CpuBackend::new());
}

#[test]
fn varlen_forwards_on_gpu_sim_equal_the_reference_per_sequence() {
    check_forward(&GpuSim::new());
}

fn check_backward(backend: &dyn Backend, texts: &[&str]) {
    for text in texts {
        let batch = Batch::new(text, LENGTHS[0], 21);
        let variant = Variant::new(batch.spec.clone()).unwrap();
        let learned = batch.learned();
        let p0 = 0;
        let forward = backend
            .forward_varlen(&variant, batch.varlen(), p0, Learned::new(&learned))
            .unwrap();
        let dout = Tensor::from_f32_as(
            batch.spec.dtype,
            forward.out.shape(),
            values(forward.out.shape().iter().product(), 99),
        )
        .unwrap();
        let saved = VarlenSaved {
            out: &forward.out,
            lse: &forward.lse,
            dout: &dout,
        };
        let got = backend
            .backward_varlen(&variant, batch.varlen(), saved, p0, Learned::new(&learned))
            .unwrap();
        assert_eq!(got.dq.shape(), batch.q.shape());
        assert_eq!(got.dk.shape(), batch.k.shape());
        let mut dparams: Vec<Vec<f64>> = Vec::new();
        let (mut fq, mut fk) = (0, 0);
        for &(lq, lk) in &batch.lens {
            if lq > 0 {
                let [q, k, v] = reference_inputs(&batch, (fq, lq), (fk, lk));
                let inputs = reference::Inputs {
                    q: &q,
                    k: &k,
                    v: &v,
                    position_offset: p0,
                };
                let d = sequence(&dout, fq, lq);
                let want = reference::backward_learned(
                    &batch.spec,
                    &inputs,
                    &d,
                    &batch.reference_learned(),
                )
                .unwrap();
                let what = format!("{} {text}, sequence at row {fq}", backend.name());
                let tol = (1e-4, 1e-3);
                assert_rows(&format!("dq of {what}"), &got.dq, fq, &want.dq, tol);
                assert_rows(&format!("dk of {what}"), &got.dk, fk, &want.dk, tol);
                assert_rows(&format!("dv of {what}"), &got.dv, fk, &want.dv, tol);
                for (i, p) in want.learned.iter().enumerate() {
                    if dparams.len() <= i {
                        dparams.push(vec![0.0; p.values.len()]);
                    }
                    dparams[i]
                        .iter_mut()
                        .zip(&p.values)
                        .for_each(|(s, v)| *s += v);
                }
            }
            (fq, fk) = (fq + lq, fk + lk);
        }
        // Each learnable tensor's gradient is the sum over the sequences.
        assert_eq!(got.learned.len(), dparams.len(), "{text}");
        for ((name, g), want) in got.learned.iter().zip(&dparams) {
            for (g, w) in g.to_f32_vec().iter().zip(want) {
                assert!(
                    (f64::from(*g) - w).abs() <= 1e-4 + 1e-3 * w.abs(),
                    "{name} of {text}: {g} against {w}"
                );
            }
        }
    }
}

#[test]
fn varlen_backwards_on_the_cpu_equal_the_reference_per_sequence() {
    check_backward(&CpuBackend::new(), &SPECS[..7]);
}

#[test]
fn varlen_backwards_on_gpu_sim_equal_the_reference_per_sequence() {
    check_backward(&GpuSim::new(), &[SPECS[0], SPECS[2], SPECS[5], SPECS[6]]);
}

/// Offsets that do not describe the tensors, and tensors of the wrong shape, are errors naming
/// what is wrong; a modifier that reads the batch index is refused rather than given 0.
#[test]
fn bad_varlen_batches_are_errors_naming_what_is_wrong() {
    let cpu = CpuBackend::new();
    let batch = Batch::new(SPECS[0], &[(4, 4), (6, 6)], 3);
    let variant = Variant::new(batch.spec.clone()).unwrap();
    let run = |cu_q: &[i32], cu_k: &[i32]| {
        let x = Varlen {
            cu_seqlens_q: cu_q,
            cu_seqlens_k: cu_k,
            ..batch.varlen()
        };
        cpu.forward_varlen(&variant, x, 0, Learned::none())
            .unwrap_err()
            .to_string()
    };
    let ok = [0, 4, 10];
    for (cu_q, words) in [
        (&[][..], "cu_seqlens_q: empty"),
        (&[1, 4, 10][..], "starts at 1"),
        (&[0, 4, 9][..], "ends at 9; expected the tensor's 10 rows"),
        (&[0, 6, 4, 10][..], "offset 2 is 4 after 6"),
        (
            &[0, 10][..],
            "cu_seqlens_q holds 1 sequences and cu_seqlens_k 2",
        ),
    ] {
        let err = run(cu_q, &ok);
        assert!(err.contains(words), "{cu_q:?}: {err}");
    }
    let wrong = Tensor::from_f32(&[10, 4, 8], vec![0.0; 320]).unwrap();
    let x = Varlen {
        q: &wrong,
        ..batch.varlen()
    };
    let err = cpu
        .forward_varlen(&variant, x, 0, Learned::none())
        .unwrap_err();
    assert!(
        matches!(err, RuntimeError::Shape { ref tensor, .. } if tensor == "q"),
        "{err}"
    );
    let four = Tensor::from_f32(&[1, 10, 4, 16], vec![0.0; 640]).unwrap();
    let x = Varlen {
        q: &four,
        ..batch.varlen()
    };
    assert!(
        cpu.forward_varlen(&variant, x, 0, Learned::none())
            .unwrap_err()
            .to_string()
            .contains("rank 3")
    );
    let by_batch = Batch::new(
        "heads = 4, kv_heads = 2, head_dim = 16, mask_mod = |b, h, q, k| b == 0 || q >= k",
        &[(4, 4), (6, 6)],
        3,
    );
    let variant = Variant::new(by_batch.spec.clone()).unwrap();
    let err = cpu
        .forward_varlen(&variant, by_batch.varlen(), 0, Learned::none())
        .unwrap_err();
    assert!(err.to_string().contains("batch index `b`"), "{err}");
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config::with_cases(64))]

    /// Any offsets, against tensors of 10 query and 12 key rows: an answer or an error, never a
    /// panic; an answer only for offsets that describe the tensors.
    #[test]
    fn any_offsets_give_an_answer_or_an_error(
        cu_q in proptest::collection::vec(-3i32..14, 0..5),
        cu_k in proptest::collection::vec(-3i32..14, 0..5),
    ) {
        let batch = Batch::new(SPECS[0], &[(10, 12)], 5);
        let variant = Variant::new(batch.spec.clone()).unwrap();
        let x = Varlen { cu_seqlens_q: &cu_q, cu_seqlens_k: &cu_k, ..batch.varlen() };
        let valid = |cu: &[i32], total: i32| {
            cu.first() == Some(&0) && cu.last() == Some(&total) && cu.windows(2).all(|w| w[0] <= w[1])
        };
        let result = CpuBackend::new().forward_varlen(&variant, x, 0, Learned::none());
        let describes = valid(&cu_q, 10) && valid(&cu_k, 12) && cu_q.len() == cu_k.len();
        proptest::prop_assert_eq!(result.is_ok(), describes, "{:?} {:?}: {:?}", cu_q, cu_k, result.err());
    }
}
