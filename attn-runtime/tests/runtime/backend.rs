//! The `Backend` trait: the CPU backend and the GPU kernels on the interpreter, driven through
//! the same trait objects, agree on every call (forward over per-head and MLA inputs, cached
//! calls over uniform, MLA and ragged queries); unknown or unbuilt backends are clear errors.

use crate::support::values;
use attn_dsl::AttentionSpec;
use attn_runtime::Backend;
use attn_runtime::backends::{layer_ops, open};
use attn_runtime::cache::PagedCache;
use attn_runtime::{DecodeOptions, Inputs, MlaQueries, MlaTensors, Output, Queries};
use attn_runtime::{Tensor, Variant};

fn tensor(shape: &[usize], seed: u64) -> Tensor {
    Tensor::from_f32(shape, values(shape.iter().product(), seed)).unwrap()
}

/// Every call on `backend`, in order.
fn calls(backend: &dyn Backend) -> Vec<(&'static str, Output)> {
    let spec: AttentionSpec = "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, \
                               position = rope"
        .parse()
        .unwrap();
    let (q, k, v) = (
        tensor(&[1, 4, 9, 16], 1),
        tensor(&[1, 2, 21, 16], 2),
        tensor(&[1, 2, 21, 16], 3),
    );
    let mut cache = PagedCache::new(&spec, 8, 8).unwrap();
    let (a, b) = (cache.add_sequence(), cache.add_sequence());
    cache
        .append(a, &tensor(&[2, 13, 16], 4), &tensor(&[2, 13, 16], 5))
        .unwrap();
    cache
        .append(b, &tensor(&[2, 6, 16], 6), &tensor(&[2, 6, 16], 7))
        .unwrap();
    let options = DecodeOptions {
        partitions: Some(2),
    };
    let decode_q = tensor(&[2, 4, 1, 16], 8);
    let ragged_q = tensor(&[3, 4, 16], 9);

    let mla: AttentionSpec = "heads = 2, head_dim = 8, mla(latent_rank = 16, rope_dim = 4), \
                              mask = causal"
        .parse()
        .unwrap();
    let (q_nope, q_pe) = (tensor(&[1, 2, 5, 8], 10), tensor(&[1, 2, 5, 4], 11));
    let (c_kv, k_pe) = (tensor(&[1, 7, 16], 12), tensor(&[1, 7, 4], 13));
    let w_kv_b = tensor(&[2 * 16, 16], 14);
    let x = MlaTensors {
        q_nope: &q_nope,
        q_pe: &q_pe,
        c_kv: &c_kv,
        k_pe: &k_pe,
        w_kv_b: &w_kv_b,
    };
    let mut latent = PagedCache::new(&mla, 8, 4).unwrap();
    let s = latent.add_sequence();
    latent
        .append(s, &tensor(&[7, 16], 15), &tensor(&[7, 4], 16))
        .unwrap();
    let (dq_nope, dq_pe) = (tensor(&[1, 2, 1, 8], 17), tensor(&[1, 2, 1, 4], 18));
    let queries = MlaQueries {
        q_nope: &dq_nope,
        q_pe: &dq_pe,
        w_kv_b: &w_kv_b,
    };
    let (spec, mla) = (Variant::new(spec).unwrap(), Variant::new(mla).unwrap());
    vec![
        (
            "forward",
            backend
                .forward(&spec, Inputs::heads(&q, &k, &v), 3)
                .unwrap(),
        ),
        (
            "forward MLA",
            backend.forward(&mla, Inputs::Mla(x), 0).unwrap(),
        ),
        (
            "uniform queries",
            backend
                .attend_cached(&spec, Queries::Uniform(&decode_q), &cache, &[a, b], options)
                .unwrap(),
        ),
        (
            "MLA queries",
            backend
                .attend_cached(&mla, Queries::Mla(queries), &latent, &[s], options)
                .unwrap(),
        ),
        (
            "ragged queries",
            backend
                .attend_cached(
                    &spec,
                    Queries::Ragged {
                        q: &ragged_q,
                        offsets: &[0, 2, 3],
                    },
                    &cache,
                    &[a, b],
                    options,
                )
                .unwrap(),
        ),
    ]
}

#[test]
fn the_cpu_and_the_gpu_interpreter_agree_through_the_trait() {
    let (cpu, sim) = (open("cpu").unwrap(), open("gpu-sim").unwrap());
    assert_eq!((cpu.name(), sim.name()), ("cpu", "gpu-sim"));
    for ((what, want), (_, got)) in calls(cpu.as_ref()).into_iter().zip(calls(sim.as_ref())) {
        assert_eq!(got.out.shape(), want.out.shape(), "{what}");
        let pairs = [
            (got.out.to_f32_vec(), want.out.to_f32_vec()),
            (got.lse.to_f32_vec(), want.lse.to_f32_vec()),
        ];
        for (g, w) in pairs {
            for (g, w) in g.iter().zip(&w) {
                assert!(
                    (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                    "{what}: {g} vs {w}"
                );
            }
        }
    }
}

#[test]
fn unknown_and_unbuilt_backends_are_clear_errors() {
    let err = open("tpu").err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("cpu, cuda, gpu-sim"), "{err}");
    if cfg!(not(feature = "cuda")) {
        let err = open("cuda")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("--features cuda"), "{err}");
    }
}

#[test]
fn a_variant_validates_once_and_keeps_its_kernels() {
    use attn_runtime::codegen::plan::PlanKind;
    use attn_runtime::cpu::CpuBackend;
    let err = Variant::parse("heads = 3, kv_heads = 2, head_dim = 16").unwrap_err();
    assert!(err.to_string().contains("kv_heads"), "{err}");

    let variant = Variant::parse("heads = 2, head_dim = 16, mask = causal").unwrap();
    assert_eq!(variant.text(), variant.spec().to_string());
    assert_eq!(variant.forward_plan().kind, PlanKind::Forward);
    assert_eq!(variant.decode_plan().kind, PlanKind::Decode);
    let cpu = CpuBackend::new();
    let a = cpu.kernel(&variant, PlanKind::Forward).unwrap();
    let b = cpu.kernel(&variant, PlanKind::Forward).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &b), "compiled twice");
    let d = cpu.kernel(&variant, PlanKind::Decode).unwrap();
    assert!(!std::sync::Arc::ptr_eq(&a, &d));

    // Equal specs share the process's variant; the spec-taking entry points use it.
    let spec = variant.spec().clone();
    let shared = Variant::shared(&spec).unwrap();
    assert!(std::sync::Arc::ptr_eq(
        &shared,
        &Variant::shared(&spec).unwrap()
    ));
    assert!(std::sync::Arc::ptr_eq(
        &cpu.forward_kernel(&spec).unwrap(),
        &cpu.kernel(&shared, PlanKind::Forward).unwrap()
    ));
}

#[test]
fn a_cache_made_for_another_variant_is_refused_through_the_trait() {
    let variant = Variant::parse("heads = 4, kv_heads = 2, head_dim = 16").unwrap();
    let other: AttentionSpec = "heads = 4, kv_heads = 1, head_dim = 16".parse().unwrap();
    let mut cache = PagedCache::new(&other, 8, 4).unwrap();
    let seq = cache.add_sequence();
    cache
        .append(seq, &tensor(&[1, 3, 16], 1), &tensor(&[1, 3, 16], 2))
        .unwrap();
    let q = tensor(&[1, 4, 1, 16], 3);
    for name in ["cpu", "gpu-sim"] {
        let backend = open(name).unwrap();
        let err = backend
            .attend_cached(
                &variant,
                Queries::Uniform(&q),
                &cache,
                &[seq],
                DecodeOptions::default(),
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("another spec") && err.contains("2 of 16+16"),
            "{name}: {err}"
        );
    }
}

/// The GPU interpreter's layer kernels (norms, activations, adds, lookups, argmax) agree with
/// the CPU's, through `LayerOps`.
#[test]
fn layer_operations_agree_between_the_cpu_and_the_gpu_kernels() {
    use attn_runtime::Storage;
    use attn_runtime::model::{MlpKind, NormKind};
    let (cpu, sim) = (layer_ops("cpu"), layer_ops("gpu-sim"));
    let close = |a: &[f32], b: &[f32], tol: f32, what: &str| {
        assert_eq!(a.len(), b.len(), "{what}");
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{what}: {x} vs {y}");
        }
    };
    let width = 96;
    let x = values(3 * width, 1);
    let (w, b) = (values(width, 2), values(width, 3));
    // Whole rows, and rows normalized in segments with their own weights (cohere's heads).
    for (kind, bias, groups) in [
        (NormKind::Rms, None, 1),
        (NormKind::Layer, Some(&b[..]), 1),
        (NormKind::Layer, None, 4),
        (NormKind::Rms, Some(&b[..]), 3),
    ] {
        let want = cpu.norm(kind, 1e-6, (&w, groups), bias, &x).unwrap();
        let got = sim.norm(kind, 1e-6, (&w, groups), bias, &x).unwrap();
        close(&got, &want, 1e-5, &format!("{kind:?} in {groups} segments"));
    }
    // Segments that do not divide the weights are errors on both.
    for ops in [&cpu, &sim] {
        let e = ops
            .norm(NormKind::Rms, 1e-6, (&w, 5), None, &x)
            .unwrap_err();
        assert!(e.to_string().contains("5 segments"), "{e}");
    }
    let gate = values(x.len(), 4);
    for kind in [MlpKind::SwiGlu, MlpKind::Gelu] {
        let (mut a, mut c) = (x.clone(), x.clone());
        cpu.activate(kind, &mut a, Some(&gate)).unwrap();
        sim.activate(kind, &mut c, Some(&gate)).unwrap();
        close(&c, &a, 1e-5, &format!("{kind:?}"));
    }
    let (mut a, mut c) = (x.clone(), x.clone());
    cpu.add(&mut a, &gate).unwrap();
    sim.add(&mut c, &gate).unwrap();
    close(&c, &a, 0.0, "add");
    let table = Storage::Bf16(x.iter().map(|v| half::bf16::from_f32(*v)).collect());
    let tokens = [2, 0, 2];
    close(
        &sim.embed(&table, width, &tokens).unwrap(),
        &cpu.embed(&table, width, &tokens).unwrap(),
        0.0,
        "embed",
    );
    // Mismatched sizes are errors on both, never a read past a buffer.
    for ops in [&cpu, &sim] {
        assert!(ops.embed(&table, width, &[3]).is_err());
        assert!(
            ops.activate(MlpKind::SwiGlu, &mut x.clone(), Some(&w))
                .is_err()
        );
        assert!(ops.add(&mut x.clone(), &w).is_err());
        assert!(
            ops.norm(NormKind::Rms, 1e-6, (&w, 1), None, &x[1..])
                .is_err()
        );
        assert!(ops.argmax(&x[1..], width).is_err());
    }
    let mut rows = x.clone();
    rows[width + 5] = 9.0;
    rows[width + 50] = 9.0;
    assert_eq!(
        sim.argmax(&rows, width).unwrap(),
        cpu.argmax(&rows, width).unwrap()
    );
    assert_eq!(cpu.argmax(&rows, width).unwrap()[1], 5);
}

/// The interpreter estimates a call's cost before it runs: a size it would spend many minutes
/// on is refused at once, with the estimate and what to use instead.
#[test]
fn calls_too_large_for_the_interpreter_are_refused_before_they_run() {
    let sim = open("gpu-sim").unwrap();
    let variant = Variant::parse("heads = 4, head_dim = 64, mask = causal").unwrap();
    let big = tensor(&[1, 4, 4096, 64], 1);
    let started = std::time::Instant::now();
    let e = sim
        .forward(&variant, Inputs::heads(&big, &big, &big), 0)
        .expect_err("refused")
        .to_string();
    assert!(e.contains("gpu-sim: this forward would take about"), "{e}");
    assert!(e.contains("--backend cpu"), "{e}");
    let out = open("cpu")
        .unwrap()
        .forward(&variant, Inputs::heads(&big, &big, &big), 0)
        .unwrap();
    let x = attn_runtime::BackwardInputs::Heads(attn_runtime::HeadsBackward {
        q: &big,
        k: &big,
        v: &big,
        out: &out.out,
        lse: &out.lse,
        dout: &big,
        position_offset: 0,
    });
    let e = sim.backward(&variant, &x).expect_err("refused").to_string();
    assert!(e.contains("forward and backward would take"), "{e}");
    assert!(
        started.elapsed().as_secs() < 60,
        "the refusals took {:?}",
        started.elapsed()
    );
    // A small call runs.
    let small = tensor(&[1, 4, 32, 64], 2);
    let small = Inputs::heads(&small, &small, &small);
    assert!(sim.forward(&variant, small, 0).is_ok());
}

/// A view can describe far more elements than its storage holds (a broadcast axis has stride
/// 0): a call whose outputs and copies would not fit in memory is refused before anything is
/// allocated, forward and backward, on each backend.
#[test]
fn broadcast_views_too_large_for_memory_are_refused_before_allocating() {
    let spec: AttentionSpec = attn_dsl::parse_str("heads = 4, kv_heads = 2, head_dim = 8").unwrap();
    let variant = Variant::new(spec).unwrap();
    let view = |heads: usize| {
        let storage = attn_runtime::Storage::F32(vec![0.5; heads * 8].into());
        Tensor::view(storage, &[1 << 20, heads, 1 << 16, 8], &[0, 8, 0, 1], 0).unwrap()
    };
    let (q, k) = (view(4), view(2));
    for name in ["cpu", "gpu-sim"] {
        let backend = open(name).unwrap();
        let err = backend
            .forward(&variant, Inputs::heads(&q, &k, &k), 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("GiB of memory"), "{name}: {err}");
        let lse = Tensor::view(
            attn_runtime::Storage::F32(vec![0.0].into()),
            &[1 << 20, 4, 1 << 16],
            &[0, 0, 0],
            0,
        )
        .unwrap();
        let x = attn_runtime::HeadsBackward {
            q: &q,
            k: &k,
            v: &k,
            out: &q,
            lse: &lse,
            dout: &q,
            position_offset: 0,
        };
        let err = backend
            .backward(&variant, &attn_runtime::BackwardInputs::Heads(x))
            .unwrap_err()
            .to_string();
        assert!(err.contains("GiB of memory"), "{name}: {err}");
    }
}
