//! Learnable tensors on the backends: parameters read by the score modifier and learned sinks,
//! forward, cached calls and backward against `attn_dsl::reference`, parameter gradients
//! bit-for-bit the same for any thread count, and what each backend refuses.

use crate::support::values;
use attn_dsl::modifier::ParamValues;
use attn_dsl::reference::{self, Array, Inputs};
use attn_dsl::{AttentionSpec, DType};
use attn_runtime::cache::{KvCache, PagedCache};
use attn_runtime::cpu::CpuBackend;
use attn_runtime::gpu::sim::GpuSim;
use attn_runtime::{
    Backend, BackwardInputs, DecodeOptions, HeadGradients, HeadsBackward, Inputs as Call, Learned,
    Output, Queries, Tensor, Variant,
};

const SLOPES: &str = "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, \
                      params(slopes: [heads]), \
                      score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32";
const REL: &str = "heads = 2, head_dim = 32, mask = causal, params(rel: [heads, 16]), \
                   score_mod = |s, b, h, q, k| s + rel[h, max(min(q - k, 15), 0)]";
const TEMP: &str = "heads = 2, head_dim = 16, softcap = 20.0, params(temp: [heads]), \
                    score_mod = |s, b, h, q, k| s * (1.0 + temp[h])";
const SINKS_WINDOW: &str =
    "heads = 4, kv_heads = 1, head_dim = 16, mask = sliding_window(20), sinks = learned";
const SINKS_BF16: &str =
    "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, dtype = bf16, sinks = learned";
const BOTH: &str = "heads = 2, head_dim = 16, mask = causal, sinks = learned, \
                    params(slopes: [heads], rel: [heads, 8]), \
                    score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32 \
                    + rel[h, max(min(q - k, 7), 0)]";

const MQA_REL: &str = "heads = 4, kv_heads = 1, head_dim = 16, mask = causal, sinks = learned, \
                       params(rel: [heads, 8]), \
                       score_mod = |s, b, h, q, k| s + rel[h, max(min(q - k, 7), 0)]";
/// FIRE (Li et al., 2023) with a two-unit MLP, written with `let` bindings.
const FIRE: &str = "heads = 2, head_dim = 16, mask = causal, \
                    params(c: [1] = 1.0, thr: [1] = 8.0, w1: [heads, 2] = normal(0.5), \
                    b1: [heads, 2], w2: [heads, 2] = normal(0.5)), \
                    score_mod = |s, b, h, q, k| let rel = (c[0].abs() * (q - k) as f32 + 1.0).ln(); \
                    let norm = (c[0].abs() * max(q as f32, thr[0].abs() + 1.0) + 1.0).ln(); \
                    let x = rel / norm; \
                    s + w2[h, 0] * (w1[h, 0] * x + b1[h, 0]).max(0.0) \
                    + w2[h, 1] * (w1[h, 1] * x + b1[h, 1]).max(0.0)";

fn parse(text: &str) -> AttentionSpec {
    text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
}

/// A tensor of `dtype` and the values it holds exactly, as a reference array.
pub(crate) fn input(dtype: DType, shape: &[usize], seed: u64) -> (Tensor, Array) {
    let t = Tensor::from_f32_as(dtype, shape, values(shape.iter().product(), seed)).unwrap();
    let exact = t.to_f32_vec().iter().map(|x| f64::from(*x)).collect();
    (t, Array::from_vec(shape, exact).unwrap())
}

/// The spec's learnable tensors, f32, and the same values for the reference.
pub(crate) fn learned(
    spec: &AttentionSpec,
    seed: u64,
) -> (Vec<(String, Tensor)>, Vec<ParamValues>) {
    spec.learnable_tensors()
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n = shape.iter().product();
            let v: Vec<f32> = values(n, seed + i as u64).iter().map(|x| x * 0.8).collect();
            let reference = ParamValues {
                name: name.clone(),
                shape: shape.clone(),
                values: v.iter().map(|x| f64::from(*x)).collect(),
            };
            ((name, Tensor::from_f32(&shape, v).unwrap()), reference)
        })
        .unzip()
}

pub(crate) fn by_name(tensors: &[(String, Tensor)]) -> Vec<(&str, &Tensor)> {
    tensors.iter().map(|(n, t)| (n.as_str(), t)).collect()
}

/// Each element within `abs + rel * |want|` (NaN must match NaN).
pub(crate) fn compare(what: &str, got: &[f32], want: &[f64], abs: f64, rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = f64::from(*g);
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
            continue;
        }
        assert!(
            (g - w).abs() <= abs + rel * w.abs(),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

/// One call's inputs (and learnable tensors) for a spec, run forward and backward on a backend
/// against the reference.
pub(crate) struct Case {
    pub(crate) spec: AttentionSpec,
    variant: std::sync::Arc<Variant>,
    tensors: [(Tensor, Array); 4],
    learned: (Vec<(String, Tensor)>, Vec<ParamValues>),
    p0: i64,
}

impl Case {
    pub(crate) fn new(text: &str, batch: usize, sq: usize, skv: usize, p0: i64) -> Case {
        let spec = parse(text);
        let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        Case {
            variant: Variant::shared(&spec).unwrap(),
            tensors: [
                input(spec.dtype, &[batch, h, sq, d], 1),
                input(spec.dtype, &[batch, hkv, skv, d], 2),
                input(spec.dtype, &[batch, hkv, skv, dv], 3),
                input(spec.dtype, &[batch, h, sq, dv], 4),
            ],
            learned: learned(&spec, 20),
            spec,
            p0,
        }
    }

    /// q, k and v.
    pub(crate) fn inputs(&self) -> [&Tensor; 3] {
        [0, 1, 2].map(|i| &self.tensors[i].0)
    }

    /// The reference's forward of the case.
    pub(crate) fn reference_forward(&self) -> reference::Output {
        reference::attention_learned(&self.spec, &self.reference_inputs(), &self.learned.1).unwrap()
    }

    fn reference_inputs(&self) -> Inputs<'_> {
        Inputs {
            q: &self.tensors[0].1,
            k: &self.tensors[1].1,
            v: &self.tensors[2].1,
            position_offset: self.p0,
        }
    }

    pub(crate) fn forward(&self, backend: &dyn Backend) -> Output {
        let [(q, _), (k, _), (v, _), _] = &self.tensors;
        let learned = by_name(&self.learned.0);
        backend
            .forward_learned(
                &self.variant,
                Call::heads(q, k, v),
                self.p0,
                Learned::new(&learned),
            )
            .unwrap()
    }

    /// The backward on `backend` given the forward's output: its error if it refuses.
    fn backward_of(
        &self,
        backend: &dyn Backend,
        forward: &Output,
    ) -> Result<HeadGradients, attn_runtime::RuntimeError> {
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
        let learned = by_name(&self.learned.0);
        backend
            .backward_learned(&self.variant, &x, Learned::new(&learned))?
            .heads()
    }

    fn backward(&self, backend: &dyn Backend, forward: &Output) -> HeadGradients {
        self.backward_of(backend, forward).unwrap()
    }

    fn tolerance(&self) -> (f64, f64) {
        match self.spec.dtype {
            DType::F32 => (5e-5, 5e-4),
            DType::Bf16 => (4e-2, 2e-2),
            DType::F16 => (1e-2, 4e-3),
        }
    }

    /// Forward and backward on `backend` against the reference.
    pub(crate) fn check(&self, backend: &dyn Backend) {
        let forward = self.forward(backend);
        let want =
            reference::attention_learned(&self.spec, &self.reference_inputs(), &self.learned.1)
                .unwrap();
        let (abs, rel) = self.tolerance();
        let what = format!("{} on {}", self.spec, backend.name());
        compare(
            &format!("{what}: out"),
            &forward.out.to_f32_vec(),
            want.out.data(),
            abs,
            rel,
        );
        compare(
            &format!("{what}: lse"),
            &forward.lse.to_f32_vec(),
            want.lse.data(),
            1e-4,
            1e-5,
        );

        let got = self.backward(backend, &forward);
        let want = reference::backward_learned(
            &self.spec,
            &self.reference_inputs(),
            &self.tensors[3].1,
            &self.learned.1,
        )
        .unwrap();
        for (name, g, w) in [
            ("dq", &got.dq, &want.dq),
            ("dk", &got.dk, &want.dk),
            ("dv", &got.dv, &want.dv),
        ] {
            compare(
                &format!("{what}: {name}"),
                &g.to_f32_vec(),
                w.data(),
                abs,
                rel,
            );
        }
        assert_eq!(
            got.learned.len(),
            want.learned.len(),
            "{what}: learned gradients"
        );
        for ((name, g), w) in got.learned.iter().zip(&want.learned) {
            assert_eq!(name, &w.name);
            assert_eq!(g.shape(), w.shape.as_slice(), "{what}: {name} shape");
            // A parameter's gradient sums over many pairs: its error scales with the largest.
            let scale = w.values.iter().fold(1.0f64, |m, x| m.max(x.abs()));
            compare(
                &format!("{what}: {name}"),
                &g.to_f32_vec(),
                &w.values,
                abs * scale * 4.0,
                rel,
            );
            assert!(
                w.values.iter().any(|x| *x != 0.0),
                "{what}: {name} is all zero"
            );
        }
    }
}

#[test]
fn cpu_parameters_and_sinks_match_the_reference() {
    let cpu = CpuBackend::new();
    Case::new(SLOPES, 2, 37, 53, 0).check(&cpu);
    Case::new(REL, 1, 70, 70, 5).check(&cpu);
    Case::new(TEMP, 2, 20, 45, 0).check(&cpu);
    Case::new(SINKS_WINDOW, 1, 66, 66, 0).check(&cpu);
    Case::new(SINKS_BF16, 2, 33, 40, 0).check(&cpu);
    Case::new(BOTH, 1, 40, 40, 0).check(&cpu);
    // One (batch, kv head) unit of five key tiles: the backward splits it among tasks.
    Case::new(MQA_REL, 1, 300, 300, 0).check(&cpu);
    Case::new(FIRE, 2, 40, 40, 0).check(&cpu);
}

/// `normalize = sigmoid`: plain, with GQA and a window, with learned slopes and a custom
/// modifier, with RoPE, bf16; forward and backward against the reference.
const SIGMOID: [&str; 5] = [
    "heads = 2, head_dim = 16, mask = causal, normalize = sigmoid(bias = -ln(64))",
    "heads = 4, kv_heads = 2, head_dim = 16, v_head_dim = 8, mask = sliding_window(20), \
     normalize = sigmoid",
    "heads = 2, head_dim = 16, mask = causal, normalize = sigmoid(bias = -2.0), \
     params(slopes: [heads]), score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32",
    "heads = 2, head_dim = 16, position = rope, softcap = 5.0, normalize = sigmoid(bias = 1.0)",
    "heads = 2, kv_heads = 1, head_dim = 16, mask = causal, dtype = bf16, \
     normalize = sigmoid(bias = -3.0)",
];

#[test]
fn cpu_sigmoid_attention_matches_the_reference() {
    let cpu = CpuBackend::new();
    for (i, spec) in SIGMOID.iter().enumerate() {
        // Lengths past one key tile, and a query block that starts mid-sequence.
        Case::new(spec, 2, 70 - 10 * i, 90, i as i64).check(&cpu);
    }
}

#[test]
fn gpu_sim_sigmoid_attention_matches_the_reference() {
    let sim = GpuSim::new();
    for (i, spec) in SIGMOID.iter().enumerate() {
        Case::new(spec, 1, 30 - 3 * i, 37, i as i64).check(&sim);
    }
}

/// 16-bit sigmoid attention takes the tensor-core forward and backward kernels (each pair's
/// weight and `dS` in place of the softmax's): over several tiles with GQA, a window in f16.
#[test]
fn gpu_sim_sigmoid_attention_on_tensor_cores_matches_the_reference() {
    let sim = GpuSim::new();
    for (text, sq, skv) in [
        (
            "heads = 4, kv_heads = 2, head_dim = 32, mask = causal, dtype = bf16, \
             normalize = sigmoid(bias = -ln(64))",
            70,
            90,
        ),
        (
            "heads = 2, head_dim = 16, mask = sliding_window(20), dtype = f16, \
             normalize = sigmoid(bias = 0.5)",
            40,
            40,
        ),
    ] {
        let variant = attn_runtime::Variant::new(parse(text)).unwrap();
        let forward = attn_runtime::codegen::gpu::forward_kernel(variant.forward_plan()).unwrap();
        assert_eq!(forward.kernel.name, "attention_forward_tc", "{text}");
        let plan = variant.backward_plan().unwrap();
        let backward = attn_runtime::codegen::gpu::backward_kernels(plan).unwrap();
        assert!(backward.tensor_cores, "{text}");
        Case::new(text, 1, sq, skv, 3).check(&sim);
    }
}

#[test]
fn gpu_sim_parameters_and_sinks_match_the_reference() {
    let sim = GpuSim::new();
    // Sinks: the host passes around the kernels. Parameters: the SIMT kernels read them, and
    // the dq kernel's threads sum their gradients, f32 and bf16 inputs alike.
    Case::new(SINKS_WINDOW, 1, 24, 24, 0).check(&sim);
    Case::new(SLOPES, 2, 20, 37, 0).check(&sim);
    Case::new(REL, 1, 70, 70, 5).check(&sim);
    Case::new(TEMP, 1, 20, 45, 0).check(&sim);
    Case::new(BOTH, 1, 17, 17, 0).check(&sim);
    Case::new(MQA_REL, 1, 65, 65, 0).check(&sim);
    Case::new(FIRE, 1, 20, 20, 0).check(&sim);
    let bf16 = SLOPES.replace("mask = causal", "mask = causal, dtype = bf16");
    Case::new(&bf16, 1, 16, 16, 0).check(&sim);
}

#[test]
fn gpu_parameter_gradients_are_the_same_bits_every_run() {
    let case = Case::new(REL, 2, 70, 70, 0);
    let forward = case.forward(&GpuSim::new());
    let first = case.backward(&GpuSim::new(), &forward);
    let again = case.backward(&GpuSim::new(), &forward);
    for ((name, a), (_, b)) in first.learned.iter().zip(&again.learned) {
        let bits = |t: &Tensor| {
            t.to_f32_vec()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(a), bits(b), "{name}");
    }
}

#[test]
fn parameter_gradients_do_not_depend_on_the_thread_count() {
    // Six (batch, kv head) units of one key tile each; then one unit whose key tiles are
    // split among several tasks.
    same_bits_for_any_thread_count(&Case::new(BOTH, 3, 50, 50, 0));
    same_bits_for_any_thread_count(&Case::new(MQA_REL, 1, 300, 300, 0));
}

fn same_bits_for_any_thread_count(case: &Case) {
    let cpu = CpuBackend::new();
    let forward = case.forward(&cpu);
    let runs: Vec<Vec<(String, Vec<u32>)>> = [1, 2, 5, 8]
        .iter()
        .map(|&threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let g = pool.install(|| case.backward(&cpu, &forward));
            g.learned
                .iter()
                .map(|(n, t)| {
                    (
                        n.clone(),
                        t.to_f32_vec().iter().map(|x| x.to_bits()).collect(),
                    )
                })
                .collect()
        })
        .collect();
    assert_eq!(runs[0].len(), case.spec.learnable_tensors().len());
    for run in &runs[1..] {
        assert_eq!(run, &runs[0], "gradients differ between thread counts");
    }
}

#[test]
fn cached_calls_add_each_sink_once_across_partitions() {
    let cpu = CpuBackend::new();
    cached_against_forward(&Case::new(BOTH, 1, 9, 61, 0), &cpu);
    // The GPU kernels on the interpreter: sinks added once after the partitions merge, and
    // parameters read by the SIMT decode kernel.
    cached_against_forward(&Case::new(SINKS_WINDOW, 1, 3, 40, 0), &GpuSim::new());
    cached_against_forward(&Case::new(BOTH, 1, 2, 45, 0), &GpuSim::new());
}

/// The case's last queries against a paged cache of its keys, in 1, 3 and 4 partitions, equal
/// to the CPU forward.
fn cached_against_forward(case: &Case, backend: &dyn Backend) {
    let forward = case.forward(&CpuBackend::new());
    let spec = &case.spec;
    let [(q, _), (k, _), (v, _), _] = &case.tensors;
    let mut cache = PagedCache::new(spec, 16, 8).unwrap();
    let seq = cache.add_sequence();
    let (hkv, skv) = (spec.kv_heads() as usize, k.shape()[2]);
    let as_cache = |t: &Tensor| {
        let shape = [hkv, skv, t.shape()[3]];
        Tensor::from_f32_as(spec.dtype, &shape, t.to_f32_vec()).unwrap()
    };
    cache.append(seq, &as_cache(k), &as_cache(v)).unwrap();
    let learned = by_name(&case.learned.0);
    for partitions in [1, 3, 4] {
        let got = backend
            .attend_cached_learned(
                &case.variant,
                Queries::Uniform(q),
                &cache as &dyn KvCache,
                &[seq],
                DecodeOptions {
                    partitions: Some(partitions),
                },
                Learned::new(&learned),
            )
            .unwrap();
        let what = format!("{} on {}, {partitions} partitions", spec, backend.name());
        let want_out: Vec<f64> = forward
            .out
            .to_f32_vec()
            .iter()
            .map(|x| f64::from(*x))
            .collect();
        let want_lse: Vec<f64> = forward
            .lse
            .to_f32_vec()
            .iter()
            .map(|x| f64::from(*x))
            .collect();
        compare(
            &format!("{what}: out"),
            &got.out.to_f32_vec(),
            &want_out,
            2e-5,
            2e-4,
        );
        compare(
            &format!("{what}: lse"),
            &got.lse.to_f32_vec(),
            &want_lse,
            2e-5,
            1e-5,
        );
    }
}

#[test]
fn missing_misshapen_and_unexpected_tensors_are_named() {
    let case = Case::new(BOTH, 1, 4, 4, 0);
    let cpu = CpuBackend::new();
    let [(q, _), (k, _), (v, _), _] = &case.tensors;
    let call = |tensors: &[(&str, &Tensor)]| {
        cpu.forward_learned(
            &case.variant,
            Call::heads(q, k, v),
            0,
            Learned::new(tensors),
        )
        .unwrap_err()
        .to_string()
    };
    let full = by_name(&case.learned.0);
    let err = call(&full[..2]);
    assert!(
        err.contains("`sinks` of shape [2], which is missing"),
        "{err}"
    );
    let wrong = Tensor::from_f32(&[3], vec![0.0; 3]).unwrap();
    let err = call(&[full[0], ("rel", &wrong), full[2]]);
    assert!(
        err.contains("`rel` has shape [3], expected [2, 8]"),
        "{err}"
    );
    let err = call(&[full[0], full[1], full[2], ("extra", &wrong)]);
    assert!(
        err.contains("`extra`") && err.contains("it takes: slopes [2], rel [2, 8], sinks [2]"),
        "{err}"
    );
    // The calls without learnable tensors refuse a spec that has them.
    let err = cpu
        .forward(&case.variant, Call::heads(q, k, v), 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("`slopes`"), "{err}");
}

#[test]
fn a_nan_parameter_reaches_only_the_rows_that_read_it() {
    let case = Case::new(SLOPES, 1, 6, 6, 0);
    let cpu = CpuBackend::new();
    let [(q, _), (k, _), (v, _), _] = &case.tensors;
    let slopes = Tensor::from_f32(&[4], vec![0.1, f32::NAN, 0.2, 0.3]).unwrap();
    let out = cpu
        .forward_learned(
            &case.variant,
            Call::heads(q, k, v),
            0,
            Learned::new(&[("slopes", &slopes)]),
        )
        .unwrap();
    let lse = out.lse.to_f32_vec();
    for (i, l) in lse.iter().enumerate() {
        let head = i / 6;
        // Row 0 of head 1 keeps only its own key, at distance 0: NaN * 0 is NaN all the same.
        assert_eq!(l.is_nan(), head == 1, "lse[{i}] = {l}");
    }
}

#[test]
fn a_spec_with_parameters_ships_its_gpu_forward_decode_and_backward_kernels() {
    use attn_runtime::codegen::gpu::artifacts::spec_kernels;
    let kernels = spec_kernels(&parse(BOTH)).unwrap();
    let roles: Vec<&str> = kernels.iter().map(|k| k.role).collect();
    for role in ["forward", "decode", "backward dq", "backward dparams"] {
        assert!(roles.contains(&role), "{role}: {roles:?}");
    }
    // The forward and decode read the parameters through the last field of their launch
    // records; the backward's record carries them, their partial sums, their gradients and
    // the buffer's length in a row (a call's data tensors lengthen it).
    for k in &kernels {
        let names: Vec<&str> = k.kernel.params.iter().map(|p| p.0.as_str()).collect();
        match k.role {
            "forward" | "decode" => assert_eq!(names.last(), Some(&"params"), "{}", k.role),
            r if r.starts_with("backward") => {
                let fields = [
                    "params",
                    "param_partials",
                    "param_copies",
                    "dparams",
                    "param_len",
                ];
                assert!(names.windows(5).any(|w| w == fields), "{r}: {names:?}")
            }
            _ => {}
        }
    }
}

/// `min` and `max` carry NaN, as PyTorch's `minimum` and `maximum`: a learned value that became
/// NaN makes the rows that read it NaN on every backend, as in the reference, rather than
/// clamping it away (`max(NaN, 0)` was 0, and a run trained on with a NaN parameter).
#[test]
fn min_and_max_carry_a_nan_parameter_to_its_rows() {
    for text in [
        "heads = 2, head_dim = 16, mask = causal, params(t: [heads]), \
         score_mod = |s, b, h, q, k| s + max(t[h], 0.0) * (k - q) as f32",
        "heads = 2, head_dim = 16, mask = causal, params(t: [heads]), \
         score_mod = |s, b, h, q, k| s + min(max(t[h], -1.0), 1.0)",
        "heads = 2, head_dim = 16, mask = causal, params(t: [heads]), \
         score_mod = |s, b, h, q, k| s * t[h].min(2.0)",
    ] {
        let mut case = Case::new(text, 1, 24, 24, 0);
        // Head 0 reads NaN, head 1 a number.
        let nan = Tensor::from_f32(&[2], vec![f32::NAN, 0.5]).unwrap();
        case.learned.0[0].1 = nan;
        case.learned.1[0].values = vec![f64::NAN, 0.5];
        let want =
            reference::attention_learned(&case.spec, &case.reference_inputs(), &case.learned.1)
                .unwrap();
        let lse = want.lse.data();
        assert!(
            lse[..24].iter().all(|l| l.is_nan()),
            "{text}: head 0 is NaN"
        );
        assert!(
            lse[24..].iter().all(|l| l.is_finite()),
            "{text}: head 1 is not"
        );
        for backend in [&CpuBackend::new() as &dyn Backend, &GpuSim::new()] {
            let got = case.forward(backend);
            let what = format!("{text} on {}", backend.name());
            compare(
                &format!("{what}: lse"),
                &got.lse.to_f32_vec(),
                lse,
                1e-4,
                1e-5,
            );
            compare(
                &format!("{what}: out"),
                &got.out.to_f32_vec(),
                want.out.data(),
                5e-5,
                5e-4,
            );
        }
    }
}
