//! Data tensors (`data(...)`) on the backends: document masks with sorted and unsorted ids, a
//! prefix LM per sequence, image intervals and Forgetting-Transformer gates with their gradient,
//! forward and backward against `attn_dsl::reference`, at position offset 0 and past it; and
//! what a call with wrong data is told.

use crate::support::values;
use attn_dsl::modifier::ParamValues;
use attn_dsl::reference::{self, Array, Inputs};
use attn_dsl::{AttentionSpec, DataType};
use attn_runtime::cpu::CpuBackend;
use attn_runtime::gpu::sim::GpuSim;
use attn_runtime::learned::{Data, DataValues};
use attn_runtime::{
    Backend, BackwardInputs, HeadGradients, HeadsBackward, Inputs as Call, Learned, Output, Tensor,
    Variant,
};

const DOCS: &str = "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, \
                    data(doc: [batch, seq] i32), \
                    mask_mod = |b, h, q, k| doc[b, q] == doc[b, k]";
const PREFIX: &str = "heads = 2, head_dim = 16, data(prefix: [batch] i32), \
                      mask_mod = |b, h, q, k| k <= q || k < prefix[b]";
const INTERVALS: &str = "heads = 2, head_dim = 16, data(lo: [batch, seq] i32, hi: [batch, seq] i32), \
                         mask_mod = |b, h, q, k| k >= lo[b, q] && k < hi[b, q]";
const GATES: &str = "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, \
                     data(gate: [batch, heads, seq] f32), \
                     score_mod = |s, b, h, q, k| s + gate[b, h, q] - gate[b, h, k]";

fn parse(text: &str) -> AttentionSpec {
    text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
}

/// One data tensor's values: i32 ones as f64 for the reference.
enum Values {
    I32(Vec<i32>),
    F32(Vec<f32>),
}

struct Case {
    spec: AttentionSpec,
    variant: std::sync::Arc<Variant>,
    tensors: [(Tensor, Array); 4],
    data: Vec<(String, Vec<usize>, Values)>,
    p0: i64,
}

fn input(shape: &[usize], seed: u64) -> (Tensor, Array) {
    let v = values(shape.iter().product(), seed);
    let exact = v.iter().map(|x| f64::from(*x)).collect();
    (
        Tensor::from_f32(shape, v).unwrap(),
        Array::from_vec(shape, exact).unwrap(),
    )
}

impl Case {
    /// A call of `batch` items, `sq` queries against `skv` keys from position `p0`; `fill`
    /// gives each data tensor's values from its name and shape.
    fn new(
        text: &str,
        [batch, sq, skv]: [usize; 3],
        p0: i64,
        fill: impl Fn(&str, &[usize]) -> Values,
    ) -> Case {
        let spec = parse(text);
        let (h, hkv, d) = (
            spec.heads as usize,
            spec.kv_heads() as usize,
            spec.head_dim as usize,
        );
        let data = spec
            .data
            .iter()
            .map(|decl| {
                let shape = spec.data_shape(decl, batch, skv);
                let v = fill(&decl.name, &shape);
                assert!(matches!(
                    (&v, decl.dtype),
                    (Values::I32(_), DataType::I32) | (Values::F32(_), DataType::F32)
                ));
                (decl.name.clone(), shape, v)
            })
            .collect();
        Case {
            variant: Variant::shared(&spec).unwrap(),
            tensors: [
                input(&[batch, h, sq, d], 1),
                input(&[batch, hkv, skv, d], 2),
                input(&[batch, hkv, skv, d], 3),
                input(&[batch, h, sq, d], 4),
            ],
            data,
            spec,
            p0,
        }
    }

    fn call_data(&self) -> Vec<(&str, Data<'_>)> {
        self.data
            .iter()
            .map(|(n, shape, v)| {
                let values = match v {
                    Values::I32(v) => DataValues::I32(v),
                    Values::F32(v) => DataValues::F32(v),
                };
                (n.as_str(), Data { shape, values })
            })
            .collect()
    }

    fn reference_data(&self) -> Vec<ParamValues> {
        self.data
            .iter()
            .map(|(n, shape, v)| ParamValues {
                name: n.clone(),
                shape: shape.clone(),
                values: match v {
                    Values::I32(v) => v.iter().map(|x| f64::from(*x)).collect(),
                    Values::F32(v) => v.iter().map(|x| f64::from(*x)).collect(),
                },
            })
            .collect()
    }

    fn reference_inputs(&self) -> Inputs<'_> {
        Inputs {
            q: &self.tensors[0].1,
            k: &self.tensors[1].1,
            v: &self.tensors[2].1,
            position_offset: self.p0,
        }
    }

    fn forward(&self, backend: &dyn Backend) -> Result<Output, attn_runtime::RuntimeError> {
        let [(q, _), (k, _), (v, _), _] = &self.tensors;
        let data = self.call_data();
        let learned = Learned::none().with_data(&data);
        backend.forward_learned(&self.variant, Call::heads(q, k, v), self.p0, learned)
    }

    fn backward(&self, backend: &dyn Backend, forward: &Output) -> HeadGradients {
        let [(q, _), (k, _), (v, _), (dout, _)] = &self.tensors;
        let x = BackwardInputs::Heads(HeadsBackward {
            q,
            k,
            v,
            out: &forward.out,
            lse: &forward.lse,
            dout,
            position_offset: self.p0,
        });
        let data = self.call_data();
        backend
            .backward_learned(&self.variant, &x, Learned::none().with_data(&data))
            .unwrap()
            .heads()
            .unwrap()
    }

    /// Forward and backward on `backend` against the reference.
    fn check(&self, backend: &dyn Backend) {
        let what = format!("{} at offset {} on {}", self.spec, self.p0, backend.name());
        let forward = self.forward(backend).unwrap();
        let data = self.reference_data();
        let want =
            reference::attention_learned(&self.spec, &self.reference_inputs(), &data).unwrap();
        close(
            &what,
            "out",
            &forward.out.to_f32_vec(),
            want.out.data(),
            5e-5,
        );
        close(
            &what,
            "lse",
            &forward.lse.to_f32_vec(),
            want.lse.data(),
            1e-4,
        );
        let got = self.backward(backend, &forward);
        let want = reference::backward_learned(
            &self.spec,
            &self.reference_inputs(),
            &self.tensors[3].1,
            &data,
        )
        .unwrap();
        for (name, g, w) in [
            ("dq", &got.dq, &want.dq),
            ("dk", &got.dk, &want.dk),
            ("dv", &got.dv, &want.dv),
        ] {
            close(&what, name, &g.to_f32_vec(), w.data(), 5e-5);
        }
        let names: Vec<&str> = got.learned.iter().map(|(n, _)| n.as_str()).collect();
        let wanted: Vec<&str> = want.learned.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, wanted, "{what}: gradients of the data");
        for ((name, g), w) in got.learned.iter().zip(&want.learned) {
            assert_eq!(g.shape(), w.shape.as_slice(), "{what}: {name}");
            assert!(w.values.iter().any(|x| *x != 0.0), "{what}: {name} is 0");
            close(&what, name, &g.to_f32_vec(), &w.values, 2e-4);
        }
    }
}

/// Each element within `tol (1 + |want|)`; -inf where the reference has it.
fn close(what: &str, name: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: {name} length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = f64::from(*g);
        let ok = if w.is_infinite() {
            g == *w
        } else {
            (g - w).abs() <= tol * (1.0 + w.abs())
        };
        assert!(ok, "{what}: {name}[{i}] is {g}, the reference {w}");
    }
}

/// Sorted document ids: item `b`'s documents are `7 + 3b + (j * j) / 97` at key `j` (lengths
/// that grow along the sequence, a different split per item).
fn sorted_docs(_: &str, shape: &[usize]) -> Values {
    let [batch, seq] = shape else { panic!() };
    Values::I32(
        (0..batch * seq)
            .map(|i| {
                let (b, j) = (i / seq, i % seq);
                (7 + 3 * b + (j * j) / (97 + 13 * b)) as i32
            })
            .collect(),
    )
}

/// Ids in no order: documents interleave.
fn unsorted_docs(_: &str, shape: &[usize]) -> Values {
    let n: usize = shape.iter().product();
    Values::I32((0..n).map(|i| ((i * 7 + i / 5) % 3) as i32 - 1).collect())
}

#[test]
fn document_masks_match_the_reference_on_the_cpu() {
    let cpu = CpuBackend::new();
    Case::new(DOCS, [2, 70, 70], 0, sorted_docs).check(&cpu);
    Case::new(DOCS, [1, 150, 150], 0, unsorted_docs).check(&cpu);
    // A chunk of queries after a prefix: positions from 5, 20 queries against 53 keys.
    Case::new(DOCS, [2, 20, 53], 5, sorted_docs).check(&cpu);
}

#[test]
fn document_masks_match_the_reference_on_the_gpu_kernels() {
    let sim = GpuSim::new();
    Case::new(DOCS, [2, 24, 24], 0, sorted_docs).check(&sim);
    Case::new(DOCS, [1, 20, 37], 3, unsorted_docs).check(&sim);
}

#[test]
fn prefix_lm_per_sequence_and_image_intervals_match_the_reference() {
    let prefix =
        |_: &str, shape: &[usize]| Values::I32((0..shape[0]).map(|b| 5 + 9 * b as i32).collect());
    // Each query sees the keys from the start of its "image" (a block of 16) to its own.
    let intervals = |name: &str, shape: &[usize]| {
        let seq = shape[1];
        Values::I32(
            (0..shape.iter().product::<usize>())
                .map(|i| {
                    let j = (i % seq) as i32;
                    if name == "lo" { j - j % 16 } else { j + 1 }
                })
                .collect(),
        )
    };
    let cpu = CpuBackend::new();
    Case::new(PREFIX, [3, 40, 40], 0, prefix).check(&cpu);
    Case::new(INTERVALS, [2, 45, 45], 0, intervals).check(&cpu);
    let sim = GpuSim::new();
    Case::new(PREFIX, [2, 20, 20], 0, prefix).check(&sim);
    Case::new(INTERVALS, [1, 20, 20], 0, intervals).check(&sim);
}

#[test]
fn forgetting_gates_and_their_gradient_match_the_reference() {
    // Cumulative log forget gates: non-increasing along the sequence, as the Forgetting
    // Transformer's are.
    let gates = |_: &str, shape: &[usize]| {
        let seq = shape[2];
        let steps = values(shape.iter().product(), 9);
        let mut out = vec![0f32; steps.len()];
        for row in 0..steps.len() / seq {
            let mut acc = 0f32;
            for j in 0..seq {
                acc -= 0.05 + 0.1 * steps[row * seq + j].abs();
                out[row * seq + j] = acc;
            }
        }
        Values::F32(out)
    };
    Case::new(GATES, [2, 50, 50], 0, gates).check(&CpuBackend::new());
    Case::new(GATES, [1, 30, 64], 7, gates).check(&CpuBackend::new());
    Case::new(GATES, [1, 20, 20], 0, gates).check(&GpuSim::new());
}

/// The gates under stick-breaking: their gradient takes each pair's `dS`, which the row's
/// chain of nearer keys gives, over several key tiles, on the CPU and the GPU kernels.
#[test]
fn stick_breaking_gates_and_their_gradient_match_the_reference() {
    let spec = format!("{GATES}, normalize = stick_breaking");
    let gates = |_: &str, shape: &[usize]| {
        Values::F32(
            values(shape.iter().product(), 9)
                .iter()
                .map(|x| 0.3 * x)
                .collect(),
        )
    };
    Case::new(&spec, [1, 40, 150], 0, gates).check(&CpuBackend::new());
    Case::new(&spec, [1, 20, 90], 0, gates).check(&GpuSim::new());
}

#[test]
fn wrong_data_is_an_error_naming_the_tensor() {
    let cpu = CpuBackend::new();
    let error = |case: &Case| case.forward(&cpu).unwrap_err().to_string();
    let docs = |shape: Vec<usize>| {
        move |_: &str, _: &[usize]| Values::I32(vec![0; shape.iter().product()])
    };
    let mut case = Case::new(DOCS, [2, 8, 8], 0, sorted_docs);
    // The wrong shape, the wrong type, missing.
    case.data[0].1 = vec![2, 9];
    case.data[0].2 = Values::I32(vec![0; 18]);
    let e = error(&case);
    assert!(
        e.contains("doc") && e.contains("[2, 9]") && e.contains("[2, 8]"),
        "{e}"
    );
    case.data[0].1 = vec![2, 8];
    case.data[0].2 = Values::F32(vec![0.0; 16]);
    let e = error(&case);
    assert!(
        e.contains("`doc` is given as f32; the spec declares it i32"),
        "{e}"
    );
    case.data.clear();
    let e = error(&case);
    assert!(
        e.contains("data tensor `doc`") && e.contains("missing"),
        "{e}"
    );
    // A read past the keys: `doc[b, k + 1]` at the last key.
    let past = DOCS.replace("doc[b, k]", "doc[b, k + 1]");
    let case = Case::new(&past, [1, 8, 8], 0, docs(vec![1, 8]));
    let e = error(&case);
    assert!(
        e.contains("`doc` at index 1 `k + 1`") && e.contains("[1, 8]") && e.contains("0 to 7"),
        "{e}"
    );
    // Calls that do not take data yet say so.
    let case = Case::new(DOCS, [1, 4, 4], 0, sorted_docs);
    let [(q, _), (k, _), (v, _), _] = &case.tensors;
    let e = cpu
        .forward(&case.variant, Call::heads(q, k, v), 0)
        .unwrap_err();
    assert!(e.to_string().contains("data tensor `doc`"), "{e}");
}

/// Each tile's class over every pair of one batch item, from the reference mask: all kept, all
/// masked or mixed.
fn brute_class(
    spec: &AttentionSpec,
    data: &[ParamValues],
    b: usize,
    rows: std::ops::Range<usize>,
    keys: std::ops::Range<usize>,
) -> attn_dsl::modifier::interval::TileClass {
    use attn_dsl::modifier::interval::TileClass;
    let mask = spec.mask_mod.as_ref().unwrap();
    let kept: Vec<bool> = rows
        .flat_map(|i| keys.clone().map(move |j| (i, j)))
        .map(|(i, j)| mask.keeps_with(b as i64, 0, i as i64, j as i64, data))
        .collect();
    match (kept.iter().all(|k| *k), kept.iter().any(|k| *k)) {
        (true, _) => TileClass::AllKept,
        (false, false) => TileClass::AllMasked,
        _ => TileClass::Mixed,
    }
}

#[test]
fn tiles_are_classified_from_the_data_exactly_for_sorted_ids_and_soundly_otherwise() {
    use attn_dsl::data::CallDims;
    use attn_dsl::modifier::interval::{Interval, TileClass};
    use attn_runtime::codegen::plan::CallShape;
    let text = "heads = 2, head_dim = 16, data(doc: [batch, seq] i32), \
                mask_mod = |b, h, q, k| doc[b, q] == doc[b, k]";
    let (batch, n) = (2, 300);
    for (fill, exact) in [
        (sorted_docs as fn(&str, &[usize]) -> Values, true),
        (unsorted_docs, false),
    ] {
        let case = Case::new(text, [batch, n, n], 0, fill);
        let data = case.call_data();
        let call = CallDims::new(batch, n, n, 0);
        let bound = Learned::none()
            .with_data(&data)
            .bind_call(&case.spec, &call)
            .unwrap();
        let plan = case.variant.forward_plan();
        let ranges = plan
            .mask_data_ranges(&bound.params)
            .expect("the mask reads doc");
        let reference = case.reference_data();
        let (rows, cols) = (plan.tiles.q_rows as usize, plan.tiles.k_cols as usize);
        let mut skipped = 0;
        for b in 0..batch {
            let map = plan.tile_map_of(CallShape {
                sq: n as i64,
                skv: n as i64,
                p0: 0,
                query_shift: 0,
                batch: Interval::point(b as i64),
                head: Interval::new(0, 1),
                data: Some(&ranges),
            });
            for (qb, row) in map.classes.iter().enumerate() {
                for (kt, class) in row.iter().enumerate() {
                    let truth = brute_class(
                        &case.spec,
                        &reference,
                        b,
                        qb * rows..((qb + 1) * rows).min(n),
                        kt * cols..((kt + 1) * cols).min(n),
                    );
                    skipped += usize::from(*class == TileClass::AllMasked);
                    if exact {
                        assert_eq!(*class, truth, "item {b}, tile ({qb}, {kt})");
                    } else {
                        assert!(
                            *class == TileClass::Mixed || *class == truth,
                            "item {b}, tile ({qb}, {kt}): {class:?}, truly {truth:?}"
                        );
                    }
                }
            }
        }
        assert_eq!(skipped > 0, exact, "sorted documents skip tiles");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config::with_cases(48))]

    /// Any ids (any i32), any declared shape or a wrong one, any position offset and an index
    /// that may leave the keys: an answer equal to the reference, or an error; never a panic.
    #[test]
    fn any_data_gives_the_reference_answer_or_an_error(
        ids in proptest::collection::vec(proptest::num::i32::ANY, 0..40),
        seq in 0usize..20,
        shift in -2i64..3,
        p0 in -5i64..5,
    ) {
        let text = format!(
            "heads = 2, head_dim = 8, mask = causal, data(doc: [batch, seq] i32), \
             mask_mod = |b, h, q, k| doc[b, q] == doc[b, k + {shift}]"
        );
        let mut case = Case::new(&text, [1, 6, 12], p0, sorted_docs);
        case.data[0].1 = vec![1, seq];
        case.data[0].2 = Values::I32(ids.iter().copied().cycle().take(seq).collect());
        let got = case.forward(&CpuBackend::new());
        let want = reference::attention_learned(
            &case.spec,
            &case.reference_inputs(),
            &case.reference_data(),
        );
        proptest::prop_assert_eq!(got.is_ok(), want.is_ok(), "{:?} vs {:?}", got.as_ref().err(), want.as_ref().err());
        if let (Ok(got), Ok(want)) = (got, want) {
            close("any data", "out", &got.out.to_f32_vec(), want.out.data(), 5e-5);
        }
    }
}

/// Data tensors in a variable-length batch: `seq` packed as k's rows (no `batch` beside it),
/// each sequence's slice read as its own call's; the gates' gradient placed back where each
/// slice was taken. Against the reference per sequence, forward and backward, on the CPU.
#[test]
fn a_variable_length_batch_reads_each_sequences_slice_of_the_data() {
    use attn_runtime::varlen::{Varlen, VarlenSaved};
    let spec = parse(
        "heads = 2, head_dim = 8, mask = causal, \
         data(doc: [batch, seq] i32, gate: [batch, heads, seq] f32, bias: [batch] f32), \
         mask_mod = |b, h, q, k| doc[b, q] == doc[b, k], \
         score_mod = |s, b, h, q, k| s + gate[b, h, q] - gate[b, h, k] + bias[b]",
    );
    let variant = Variant::shared(&spec).unwrap();
    let (h, d) = (2, 8);
    let lens = [(5usize, 9usize), (0, 0), (7, 7)];
    let (total_q, total_k) = (12, 16);
    let (cu_q, cu_k) = ([0, 5, 5, 12], [0, 9, 9, 16]);
    let t = |rows: usize, seed: u64| {
        Tensor::from_f32(&[rows, h, d], values(rows * h * d, seed)).unwrap()
    };
    let (q, k, v, dout) = (t(total_q, 1), t(total_k, 2), t(total_k, 3), t(total_q, 4));
    let ids: Vec<i32> = (0..total_k as i32).map(|j| j % 9 / 4).collect();
    let gate: Vec<f32> = values(h * total_k, 5).iter().map(|x| 0.5 * x).collect();
    let bias = vec![0.25f32, -1.0, 0.5];
    let data = [
        (
            "doc",
            Data {
                shape: &[total_k],
                values: DataValues::I32(&ids),
            },
        ),
        (
            "gate",
            Data {
                shape: &[h, total_k],
                values: DataValues::F32(&gate),
            },
        ),
        (
            "bias",
            Data {
                shape: &[3],
                values: DataValues::F32(&bias),
            },
        ),
    ];
    let x = Varlen {
        q: &q,
        k: &k,
        v: &v,
        cu_seqlens_q: &cu_q,
        cu_seqlens_k: &cu_k,
    };
    let cpu = CpuBackend::new();
    let tensors = Learned::none().with_data(&data);
    let out = cpu.forward_varlen(&variant, x, 0, tensors).unwrap();
    let saved = VarlenSaved {
        out: &out.out,
        lse: &out.lse,
        dout: &dout,
    };
    let grads = cpu.backward_varlen(&variant, x, saved, 0, tensors).unwrap();
    let dgate = &grads.learned.iter().find(|(n, _)| n == "dgate").unwrap().1;
    let dbias = &grads.learned.iter().find(|(n, _)| n == "dbias").unwrap().1;
    assert_eq!(dgate.shape(), &[h, total_k]);
    assert_eq!(dbias.shape(), &[3]);
    let (dgate, dbias) = (dgate.to_f32_vec(), dbias.to_f32_vec());
    // [rows, heads, width] rows of a sequence as a [1, heads, len, width] array.
    let heads_first = |t: &Tensor, r: std::ops::Range<usize>| {
        let v = t.to_f32_vec();
        Array::from_fn(&[1, h, r.len(), d], |i| {
            f64::from(v[((r.start + i[2]) * h + i[1]) * d + i[3]])
        })
    };
    let (mut q0, mut k0) = (0, 0);
    for (i, &(lq, lk)) in lens.iter().enumerate() {
        let (rq, rk) = (q0..q0 + lq, k0..k0 + lk);
        (q0, k0) = (q0 + lq, k0 + lk);
        if lq == 0 {
            continue;
        }
        let (qa, ka, va, da) = (
            heads_first(&q, rq.clone()),
            heads_first(&k, rk.clone()),
            heads_first(&v, rk.clone()),
            heads_first(&dout, rq.clone()),
        );
        let x = Inputs {
            q: &qa,
            k: &ka,
            v: &va,
            position_offset: 0,
        };
        let slice = |v: &[f32], rows: usize| -> Vec<f64> {
            (0..rows)
                .flat_map(|r| rk.clone().map(move |j| (r, j)))
                .map(|(r, j)| f64::from(v[r * total_k + j]))
                .collect()
        };
        let reference_data = [
            ParamValues {
                name: "doc".into(),
                shape: vec![1, lk],
                values: ids[rk.clone()].iter().map(|x| f64::from(*x)).collect(),
            },
            ParamValues {
                name: "gate".into(),
                shape: vec![1, h, lk],
                values: slice(&gate, h),
            },
            ParamValues {
                name: "bias".into(),
                shape: vec![1],
                values: vec![f64::from(bias[i])],
            },
        ];
        let want = reference::attention_learned(&spec, &x, &reference_data).unwrap();
        let got: Vec<f32> = rq
            .clone()
            .flat_map(|r| (0..h).flat_map(move |hh| (0..d).map(move |c| (r, hh, c))))
            .map(|(r, hh, c)| out.out.to_f32_vec()[(r * h + hh) * d + c])
            .collect();
        let want_rows: Vec<f64> = (0..lq)
            .flat_map(|r| (0..h).flat_map(move |hh| (0..d).map(move |c| (r, hh, c))))
            .map(|(r, hh, c)| want.out.data()[(hh * lq + r) * d + c])
            .collect();
        close(
            "varlen",
            &format!("sequence {i} out"),
            &got,
            &want_rows,
            5e-5,
        );
        let back = reference::backward_learned(&spec, &x, &da, &reference_data).unwrap();
        let w = |name: &str| &back.learned.iter().find(|p| p.name == name).unwrap().values;
        close(
            "varlen",
            &format!("sequence {i} dgate"),
            &slice(&dgate, h)
                .iter()
                .map(|x| *x as f32)
                .collect::<Vec<_>>(),
            w("dgate"),
            2e-4,
        );
        close(
            "varlen",
            &format!("sequence {i} dbias"),
            &[dbias[i]],
            w("dbias"),
            2e-4,
        );
    }
    // The empty sequence's bias has no gradient.
    assert_eq!(dbias[1], 0.0);
    // A tensor the spec does not declare is named.
    let extra = [data[0], data[1], data[2], ("bias2", data[2].1)];
    let e = cpu
        .forward_varlen(&variant, x, 0, Learned::none().with_data(&extra))
        .unwrap_err();
    assert!(
        e.to_string().contains("`bias2` is not a data tensor"),
        "{e}"
    );
    // The wrong packed shape is named.
    let wrong = [
        (
            "doc",
            Data {
                shape: &[1, total_k],
                values: DataValues::I32(&ids),
            },
        ),
        data[1],
        data[2],
    ];
    let e = cpu
        .forward_varlen(&variant, x, 0, Learned::none().with_data(&wrong))
        .unwrap_err();
    assert!(
        e.to_string().contains("doc") && e.to_string().contains("[16]"),
        "{e}"
    );
}
