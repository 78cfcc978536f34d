//! The GPU runtime path without a GPU: calls prepared by `gpu::GpuCall` (tile codes, RoPE
//! tables, layouts; the tensor-core kernel for bf16 specs) and run on the GPU IR interpreter,
//! against the reference. With the `cuda` feature, the device backend either reports that there
//! is no driver or, on a machine with a GPU, computes the same results.

use crate::support;

use crate::support::values;
use attn_dsl::AttentionSpec;
use attn_dsl::reference::{self, Array, Inputs};
use attn_runtime::Output;
use attn_runtime::Tensor;
use attn_runtime::gpu::GpuCall;
use attn_runtime::gpu::sim::GpuSim;

struct Case {
    spec: AttentionSpec,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    p0: i64,
}

fn case(text: &str, b: usize, sq: usize, skv: usize, p0: i64) -> Case {
    let spec: AttentionSpec = text.parse().unwrap();
    let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let t = |shape: &[usize], seed| {
        Tensor::from_f32_as(spec.dtype, shape, values(shape.iter().product(), seed)).unwrap()
    };
    Case {
        q: t(&[b, h, sq, d], 1),
        k: t(&[b, hkv, skv, d], 2),
        v: t(&[b, hkv, skv, dv], 3),
        spec,
        p0,
    }
}

fn check(c: &Case, got: &Output) {
    let arr = |t: &Tensor| {
        Array::from_vec(
            t.shape(),
            t.to_f32_vec().iter().map(|x| f64::from(*x)).collect(),
        )
        .unwrap()
    };
    let want = reference::attention(
        &c.spec,
        &Inputs {
            q: &arr(&c.q),
            k: &arr(&c.k),
            v: &arr(&c.v),
            position_offset: c.p0,
        },
    )
    .unwrap();
    let tol = if c.spec.dtype == attn_dsl::DType::F32 {
        1e-5
    } else {
        1e-2
    };
    for (i, (g, w)) in got.out.to_f32_vec().iter().zip(want.out.data()).enumerate() {
        let g = f64::from(*g);
        assert!(
            (g - w).abs() <= tol + 1e-4 * w.abs(),
            "{} out[{i}]: {g} vs {w}",
            c.spec
        );
    }
    for (i, (g, w)) in got.lse.to_f32_vec().iter().zip(want.lse.data()).enumerate() {
        let g = f64::from(*g);
        assert!(
            (w.is_infinite() && g == *w) || (g - w).abs() <= 1e-4 + 1e-5 * w.abs(),
            "{} lse[{i}]: {g} vs {w}",
            c.spec
        );
    }
}

fn cases() -> Vec<Case> {
    vec![
        case(
            "heads = 4, kv_heads = 2, head_dim = 16, mask = causal",
            2,
            70,
            70,
            0,
        ),
        case(
            "heads = 2, head_dim = 16, mask = sliding_window(9), position = rope(scaling = \
             llama3(factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, \
             original_max_position = 16))",
            1,
            20,
            40,
            5,
        ),
        case(
            "heads = 2, head_dim = 8, mask = causal, softcap = 3.0, dtype = bf16",
            1,
            9,
            9,
            0,
        ),
        case("heads = 2, head_dim = 8", 1, 0, 5, 0),
        // Tensor cores (bf16, head dims multiples of 16).
        case(
            "heads = 4, kv_heads = 2, head_dim = 32, mask = causal, position = alibi, dtype = bf16",
            2,
            40,
            70,
            0,
        ),
    ]
}

#[test]
fn prepared_calls_run_on_the_interpreter_match_the_reference() {
    for c in cases() {
        let call = GpuCall::forward(&c.spec, &c.q, &c.k, &c.v, c.p0).unwrap();
        check(&c, &call.run_on_sim().unwrap());
    }
    let c = cases().remove(0);
    let err = GpuCall::forward(&c.spec, &c.k, &c.k, &c.v, 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("`q`"), "{err}");
}

/// The sm_90a forward through the host path: tile codes for its 128-row blocks and key tiles,
/// the q, k and v tensor maps, the launch record with the maps after it.
#[test]
fn the_sm_90a_kernel_runs_through_the_host_path() {
    for c in [
        case(
            "heads = 8, kv_heads = 2, head_dim = 64, mask = causal, dtype = bf16",
            1,
            257,
            257,
            0,
        ),
        case(
            "heads = 2, head_dim = 128, mask = sliding_window(100), position = alibi, \
             softcap = 20.0, dtype = f16",
            2,
            140,
            300,
            0,
        ),
        // RoPE tables from the host, rotated in place by the producer warpgroup.
        case(
            "heads = 4, kv_heads = 2, head_dim = 64, mask = causal, position = rope, \
             dtype = bf16",
            1,
            70,
            90,
            11,
        ),
    ] {
        let call = GpuCall::forward_wgmma(&c.spec, &c.q, &c.k, &c.v, c.p0).unwrap();
        assert_eq!(call.kernel.name, "attention_forward_wgmma");
        assert_eq!(call.tensor_maps.len(), 3);
        check(&c, &call.run_on_sim().unwrap());
    }
    let c = cases().remove(1);
    let err = GpuCall::forward_wgmma(&c.spec, &c.q, &c.k, &c.v, c.p0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("multiples of 64"), "{err}");
}

#[cfg(feature = "cuda")]
#[test]
fn the_device_backend_runs_or_says_there_is_no_gpu() {
    use attn_runtime::Variant;
    use attn_runtime::gpu::cuda::CudaBackend;
    match CudaBackend::new(0) {
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("no CUDA driver") || msg.contains("device"),
                "{msg}"
            );
        }
        Ok(gpu) => {
            for c in cases() {
                check(
                    &c,
                    &support::forward(&gpu, &c.spec, &c.q, &c.k, &c.v, c.p0).unwrap(),
                );
            }
            check_decode(&|spec, q, cache, seqs, options| {
                support::decode(&gpu, spec, q, cache, seqs, options).unwrap()
            });
            check_mla_decode(&|spec, queries, cache, seqs, options| {
                support::decode_mla(&gpu, spec, queries, cache, seqs, options).unwrap()
            });
            check_mla_forward(&|spec, x, p0| support::forward_mla(&gpu, spec, x, p0).unwrap());
            // Against a copy of the cache uploaded once; a copy older than the cache is refused.
            check_decode(&|spec, q, cache, seqs, options| {
                let resident = gpu.upload_cache(cache).unwrap();
                gpu.decode_resident(
                    &Variant::shared(spec).unwrap(),
                    q,
                    cache,
                    &resident,
                    seqs,
                    options,
                )
                .unwrap()
            });
            stale_device_copies_are_refused(&gpu);
            check_ragged(&|spec, q, offsets, cache, seqs, options| {
                support::attend_ragged(&gpu, spec, q, offsets, cache, seqs, options).unwrap()
            });
        }
    }
}

/// A decode entry point under test, on a paged cache.
type Decode<'a> = &'a dyn Fn(
    &AttentionSpec,
    &Tensor,
    &attn_runtime::cache::PagedCache,
    &[attn_runtime::cache::SeqId],
    attn_runtime::DecodeOptions,
) -> Output;

/// A ragged-batch entry point under test, on a paged cache.
type AttendRagged<'a> = &'a dyn Fn(
    &AttentionSpec,
    &Tensor,
    &[usize],
    &attn_runtime::cache::PagedCache,
    &[attn_runtime::cache::SeqId],
    attn_runtime::DecodeOptions,
) -> Output;

/// An MLA decode entry point under test, on a paged latent cache.
type DecodeMla<'a> = &'a dyn Fn(
    &AttentionSpec,
    attn_runtime::MlaQueries,
    &attn_runtime::cache::PagedCache,
    &[attn_runtime::cache::SeqId],
    attn_runtime::DecodeOptions,
) -> Output;

/// The GPU decode kernel (on the interpreter) reads paged caches through their segments and
/// merges split-KV partitions: it must equal the CPU backend's decode (itself checked against
/// the reference in decode.rs).
#[test]
fn gpu_decode_on_the_interpreter_equals_the_cpu_decode() {
    check_decode(&|spec, q, cache, seqs, options| {
        support::decode(&GpuSim::new(), spec, q, cache, seqs, options).unwrap()
    });
}

/// `decode` against the CPU backend's decode, for per-head specs (f32 and bf16 caches).
fn check_decode(decode: Decode) {
    use attn_runtime::DecodeOptions;
    use attn_runtime::cache::PagedCache;
    use attn_runtime::cpu::CpuBackend;
    for text in [
        "heads = 4, kv_heads = 2, head_dim = 16, mask = causal",
        "heads = 2, head_dim = 8, mask = sliding_window(9), position = alibi, softcap = 4.0",
        "heads = 2, kv_heads = 1, head_dim = 16, mask = causal, position = rope(base = 500.0)",
        "heads = 2, head_dim = 8, mask_mod = |b, h, q, k| (k + b + h) % 3 != 0",
        // bf16 and f16 caches, read as such by the kernel.
        "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, dtype = bf16",
        "heads = 2, head_dim = 8, mask = causal, position = alibi, dtype = f16",
        "heads = 2, kv_heads = 1, head_dim = 16, position = rope, softcap = 4.0, dtype = bf16",
        // More rows than a task takes (32 at v_dim 128): items split the query heads.
        "heads = 12, kv_heads = 1, head_dim = 128, mask = causal, dtype = bf16",
        // Outputs that do not tile the CTA evenly, a head dim the dot product cannot unroll,
        // and a v_dim of two outputs per thread and row.
        "heads = 2, head_dim = 6, v_head_dim = 24, mask = causal",
        "heads = 2, head_dim = 32, v_head_dim = 256, mask = causal, position = rope",
    ] {
        let spec: AttentionSpec = text.parse().unwrap();
        let dtype = spec.dtype;
        // 16-bit outputs of the two backends may round an f32 result to neighbouring values.
        let (abs, rel) = if dtype != attn_dsl::DType::F32 {
            (1e-3, 8e-3)
        } else {
            (2e-5, 1e-4)
        };
        let (hkv, d, dv) = (
            spec.kv_heads() as usize,
            spec.head_dim as usize,
            spec.v_head_dim as usize,
        );
        let h = spec.heads as usize;
        let mut cache = PagedCache::new(&spec, 7, 40).unwrap();
        let lens = [45usize, 70];
        let seqs: Vec<_> = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let seq = cache.add_sequence();
                let k = Tensor::from_f32_as(
                    dtype,
                    &[hkv, len, d],
                    values(hkv * len * d, 10 + i as u64),
                )
                .unwrap();
                let v = Tensor::from_f32_as(
                    dtype,
                    &[hkv, len, dv],
                    values(hkv * len * dv, 20 + i as u64),
                )
                .unwrap();
                cache.append(seq, &k, &v).unwrap();
                seq
            })
            .collect();
        for (n, parts) in [(1, None), (3, Some(3))] {
            let q = Tensor::from_f32_as(dtype, &[2, h, n, d], values(2 * h * n * d, 5)).unwrap();
            let options = DecodeOptions { partitions: parts };
            let want =
                support::decode(&CpuBackend::new(), &spec, &q, &cache, &seqs, options).unwrap();
            let got = decode(&spec, &q, &cache, &seqs, options);
            assert_outputs_close(&got, &want, (abs, rel), &format!("{text} n {n}"));
        }
    }
}

/// The tensor-core decode kernel (16-bit per-head caches, head dims 16 to 256) over every
/// kind of score and mask program, RoPE layouts, GQA groups that fill a task's 16 rows and
/// split past them, pages that cut segments short, and enough segments for several rounds of
/// its four warps and its ring: it must equal the CPU backend's decode.
#[test]
fn tensor_core_decode_on_the_interpreter_equals_the_cpu_for_every_variant() {
    use attn_runtime::DecodeOptions;
    use attn_runtime::cache::PagedCache;
    use attn_runtime::cpu::CpuBackend;
    for (text, page, q_len) in [
        (
            "heads = 32, kv_heads = 8, head_dim = 128, dtype = bf16",
            64,
            1,
        ),
        (
            "heads = 8, kv_heads = 2, head_dim = 64, mask = causal, dtype = f16",
            13,
            4,
        ),
        (
            "heads = 4, kv_heads = 1, head_dim = 64, mask = sliding_window(40), \
             position = rope(layout = interleaved), dtype = bf16",
            16,
            2,
        ),
        (
            "heads = 6, kv_heads = 2, head_dim = 32, mask = causal, position = alibi, \
             softcap = 5.0, dtype = bf16",
            9,
            3,
        ),
        (
            "heads = 2, head_dim = 16, v_head_dim = 48, \
             score_mod = |s, b, h, q, k| s - 0.1 * ((q - k) as f32).abs() + (h as f32) * 0.25, \
             mask_mod = |b, h, q, k| (k + b + h) % 5 != 0, dtype = bf16",
            10,
            1,
        ),
        (
            "heads = 2, kv_heads = 1, head_dim = 256, mask = causal, dtype = bf16",
            32,
            2,
        ),
    ] {
        let spec: AttentionSpec = text.parse().unwrap();
        assert!(
            codegen::gpu::kernels::decode::tc::supports(&codegen::KernelPlan::decode(&spec)),
            "{text}"
        );
        let (h, hkv, d, dv) = (
            spec.heads as usize,
            spec.kv_heads() as usize,
            spec.head_dim as usize,
            spec.v_head_dim as usize,
        );
        let lens = [150usize, 37];
        let pages = lens.iter().map(|l| l.div_ceil(page)).sum();
        let mut cache = PagedCache::new(&spec, page, pages).unwrap();
        let seqs: Vec<_> = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let seq = cache.add_sequence();
                let t = |w: usize, seed: u64| {
                    Tensor::from_f32_as(spec.dtype, &[hkv, len, w], values(hkv * len * w, seed))
                        .unwrap()
                };
                cache
                    .append(seq, &t(d, 30 + i as u64), &t(dv, 40 + i as u64))
                    .unwrap();
                seq
            })
            .collect();
        let q = Tensor::from_f32_as(spec.dtype, &[2, h, q_len, d], values(2 * h * q_len * d, 9))
            .unwrap();
        for parts in [None, Some(2)] {
            let options = DecodeOptions { partitions: parts };
            let want =
                support::decode(&CpuBackend::new(), &spec, &q, &cache, &seqs, options).unwrap();
            let got = support::decode(&GpuSim::new(), &spec, &q, &cache, &seqs, options).unwrap();
            assert_outputs_close(&got, &want, (1e-3, 8e-3), &format!("{text} {parts:?}"));
        }
    }
}

/// MLA decoding on the GPU decode kernel (queries absorbed on the host, the kernel over the
/// latent cache) equals the CPU backend's `decode_mla`, which the decode tests check against
/// the forward kernel and the reference.
#[test]
fn gpu_mla_decode_on_the_interpreter_equals_the_cpu_decode() {
    check_mla_decode(&|spec, queries, cache, seqs, options| {
        support::decode_mla(&GpuSim::new(), spec, queries, cache, seqs, options).unwrap()
    });
}

/// `decode` against the CPU backend's `decode_mla`.
fn check_mla_decode(decode: DecodeMla) {
    use attn_runtime::cache::PagedCache;
    use attn_runtime::cpu::CpuBackend;
    use attn_runtime::{DecodeOptions, MlaQueries};
    for text in [
        "heads = 4, head_dim = 16, v_head_dim = 24, mla(latent_rank = 32, rope_dim = 8), \
         mask = causal",
        "heads = 2, head_dim = 8, mla(latent_rank = 64, rope_dim = 16), mask = causal, \
         position = rope(scaling = yarn(factor = 4.0, original_max_position = 32))",
        // 16-bit latent caches run on the wide tensor-core kernel: MLA's own widths (576 +
        // 512) with more heads than a task's 16 rows, and a narrower one under RoPE and
        // softcap.
        "heads = 20, head_dim = 16, mla(latent_rank = 512, rope_dim = 64), mask = causal, \
         dtype = bf16",
        "heads = 3, head_dim = 16, mla(latent_rank = 128, rope_dim = 64), mask = causal, \
         position = rope, softcap = 8.0, dtype = f16",
    ] {
        let spec: AttentionSpec = text.parse().unwrap();
        let mla = spec.mla().unwrap();
        let (h, dn, dv) = (
            spec.heads as usize,
            spec.head_dim as usize,
            spec.v_head_dim as usize,
        );
        let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
        let t = |shape: &[usize], seed: u64| {
            Tensor::from_f32_as(spec.dtype, shape, values(shape.iter().product(), seed)).unwrap()
        };
        let wide =
            codegen::gpu::kernels::decode::wide::supports(&codegen::KernelPlan::decode(&spec));
        assert_eq!(wide, spec.dtype != attn_dsl::DType::F32, "{text}");
        let mut cache = PagedCache::new(&spec, 7, 40).unwrap();
        let seqs: Vec<_> = [37usize, 61]
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let seq = cache.add_sequence();
                let (c_kv, k_pe) = (t(&[len, r], 10 + i as u64), t(&[len, dr], 20 + i as u64));
                cache.append(seq, &c_kv, &k_pe).unwrap();
                seq
            })
            .collect();
        let w_kv_b = t(&[h * (dn + dv), r], 3);
        for (n, parts) in [(1, None), (2, Some(3))] {
            let (q_nope, q_pe) = (t(&[2, h, n, dn], 4), t(&[2, h, n, dr], 5));
            let queries = || MlaQueries {
                q_nope: &q_nope,
                q_pe: &q_pe,
                w_kv_b: &w_kv_b,
            };
            let options = DecodeOptions { partitions: parts };
            let cpu = CpuBackend::new();
            let want = support::decode_mla(&cpu, &spec, queries(), &cache, &seqs, options).unwrap();
            let got = decode(&spec, queries(), &cache, &seqs, options);
            assert_eq!(got.out.shape(), [2, h, n, dv]);
            let what = format!("{text} n {n}");
            if wide {
                // The tensor cores take P in 16 bits, and W_uv's 512-term sums of the latent
                // outputs cancel: each output is held to 1% of its row's largest (a 16-bit
                // output's own rounding is 0.4% of it), the lse to 1e-4 (S is f32-exact).
                assert_rows_close(&got, &want, dv, 1e-2, &what);
            } else {
                assert_outputs_close(&got, &want, (1e-4, 1e-4), &what);
            }
        }
    }
}

/// A ragged batch (one, no and seventeen new tokens) on the GPU decode kernel equals the CPU
/// backend's `attend_ragged`.
#[test]
fn gpu_ragged_batches_on_the_interpreter_equal_the_cpu() {
    check_ragged(&|spec, q, offsets, cache, seqs, options| {
        support::attend_ragged(&GpuSim::new(), spec, q, offsets, cache, seqs, options).unwrap()
    });
}

/// `attend` against the CPU backend's `attend_ragged`.
fn check_ragged(attend: AttendRagged) {
    use attn_runtime::DecodeOptions;
    use attn_runtime::cache::PagedCache;
    use attn_runtime::cpu::CpuBackend;
    for text in [
        "heads = 4, kv_heads = 2, head_dim = 16, mask = causal",
        "heads = 2, head_dim = 16, mask = sliding_window(20), position = rope, dtype = bf16",
    ] {
        let spec: AttentionSpec = text.parse().unwrap();
        let (h, hkv, d, dv) = (
            spec.heads as usize,
            spec.kv_heads() as usize,
            spec.head_dim as usize,
            spec.v_head_dim as usize,
        );
        let mut cache = PagedCache::new(&spec, 8, 40).unwrap();
        let seqs: Vec<_> = [50usize, 33, 70]
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let seq = cache.add_sequence();
                let t = |w: usize, seed: u64| {
                    Tensor::from_f32_as(spec.dtype, &[hkv, len, w], values(hkv * len * w, seed))
                        .unwrap()
                };
                cache
                    .append(seq, &t(d, 10 + i as u64), &t(dv, 20 + i as u64))
                    .unwrap();
                seq
            })
            .collect();
        let offsets = [0, 1, 1, 18];
        let q = Tensor::from_f32_as(spec.dtype, &[18, h, d], values(18 * h * d, 7)).unwrap();
        for parts in [None, Some(2)] {
            let options = DecodeOptions { partitions: parts };
            let cpu = CpuBackend::new();
            let want =
                support::attend_ragged(&cpu, &spec, &q, &offsets, &cache, &seqs, options).unwrap();
            let got = attend(&spec, &q, &offsets, &cache, &seqs, options);
            assert_eq!(got.out.shape(), [18, h, dv]);
            let tolerance = if spec.dtype == attn_dsl::DType::Bf16 {
                (1e-3, 8e-3)
            } else {
                (2e-5, 1e-4)
            };
            assert_outputs_close(&got, &want, tolerance, text);
        }
    }
}

/// `out` within `rel` of the largest magnitude of its row of `width` in the other backend's,
/// and `lse` within 1e-4 (or the same infinity).
fn assert_rows_close(got: &Output, want: &Output, width: usize, rel: f32, what: &str) {
    let (g, w) = (got.out.to_f32_vec(), want.out.to_f32_vec());
    assert_eq!(g.len(), w.len(), "{what}");
    for (row, (gr, wr)) in g.chunks(width).zip(w.chunks(width)).enumerate() {
        let scale = wr.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (c, (a, b)) in gr.iter().zip(wr).enumerate() {
            assert!(
                (a - b).abs() <= rel * scale,
                "{what} row {row} col {c}: {a} vs {b} (row scale {scale})"
            );
        }
    }
    let no_out = |o: &Output| Output {
        out: Tensor::from_f32(&[0], vec![]).unwrap(),
        lse: o.lse.clone(),
        latent: None,
    };
    assert_outputs_close(&no_out(got), &no_out(want), (0.0, 0.0), what);
}

/// `out` within `abs + rel |want|` of the other backend's, and `lse` within 1e-4 (or the same
/// infinity, for rows with no key).
fn assert_outputs_close(got: &Output, want: &Output, (abs, rel): (f32, f32), what: &str) {
    let pairs = |a: &Tensor, b: &Tensor| -> Vec<(f32, f32)> {
        a.to_f32_vec().into_iter().zip(b.to_f32_vec()).collect()
    };
    for (i, (g, w)) in pairs(&got.out, &want.out).into_iter().enumerate() {
        assert!(
            (g - w).abs() <= abs + rel * w.abs(),
            "{what} out[{i}]: {g} vs {w}"
        );
    }
    for (i, (g, w)) in pairs(&got.lse, &want.lse).into_iter().enumerate() {
        assert!(
            (w.is_infinite() && g == w) || (g - w).abs() <= 1e-4,
            "{what} lse[{i}]: {g} vs {w}"
        );
    }
}

/// MLA prefill on the GPU forward kernel (inputs absorbed on the host, the kernel over the
/// shared latent head) equals the CPU backend's `forward_mla`, which the fixtures and the
/// differential tests check against the reference.
#[test]
fn gpu_mla_forward_on_the_interpreter_equals_the_cpu() {
    check_mla_forward(&|spec, x, p0| support::forward_mla(&GpuSim::new(), spec, x, p0).unwrap());
}

/// `forward` against the CPU backend's `forward_mla`.
fn check_mla_forward(forward: &dyn Fn(&AttentionSpec, &attn_runtime::MlaTensors, i64) -> Output) {
    use attn_runtime::MlaTensors;
    use attn_runtime::cpu::CpuBackend;
    for (text, sq, skv, p0) in [
        (
            "heads = 4, head_dim = 16, v_head_dim = 24, mla(latent_rank = 32, rope_dim = 8), \
             mask = causal",
            40,
            40,
            0,
        ),
        (
            "heads = 2, head_dim = 8, mla(latent_rank = 64, rope_dim = 16), mask = causal, \
             position = rope(scaling = yarn(factor = 4.0, original_max_position = 32))",
            17,
            50,
            3,
        ),
    ] {
        let spec: AttentionSpec = text.parse().unwrap();
        let mla = spec.mla().unwrap();
        let (h, dn, dv) = (
            spec.heads as usize,
            spec.head_dim as usize,
            spec.v_head_dim as usize,
        );
        let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
        let t = |shape: &[usize], seed: u64| {
            Tensor::from_f32(shape, values(shape.iter().product(), seed)).unwrap()
        };
        let (q_nope, q_pe) = (t(&[2, h, sq, dn], 1), t(&[2, h, sq, dr], 2));
        let (c_kv, k_pe) = (t(&[2, skv, r], 3), t(&[2, skv, dr], 4));
        let w_kv_b = t(&[h * (dn + dv), r], 5);
        let x = MlaTensors {
            q_nope: &q_nope,
            q_pe: &q_pe,
            c_kv: &c_kv,
            k_pe: &k_pe,
            w_kv_b: &w_kv_b,
        };
        let want = support::forward_mla(&CpuBackend::new(), &spec, &x, p0).unwrap();
        let got = forward(&spec, &x, p0);
        assert_eq!(got.out.shape(), [2, h, sq, dv]);
        assert_outputs_close(&got, &want, (1e-4, 1e-4), text);
    }
}

/// Decoding against a copy of the cache resident on the interpreter's memory gives what a copy
/// uploaded per call gives; a stale copy is refused, then brought up to date.
#[test]
fn resident_caches_on_the_interpreter_decode_and_refuse_stale_copies() {
    let gpu = GpuSim::new();
    check_decode(&|spec, q, cache, seqs, options| {
        let resident = gpu.upload_cache(cache).unwrap();
        let variant = attn_runtime::Variant::shared(spec).unwrap();
        gpu.decode_resident(&variant, q, cache, &resident, seqs, options)
            .unwrap()
    });
    stale_device_copies_are_refused(&gpu);
}

/// What the interpreter does not have is a typed error, not a silent nothing: kernel timing;
/// and its cost guard refuses a call it would spend minutes on, before running it.
#[test]
fn the_interpreter_refuses_kernel_timing_and_calls_too_slow_for_it() {
    use attn_runtime::device::Device;
    use attn_runtime::{Backend, Inputs, RuntimeError, Variant};
    let gpu = GpuSim::new();
    match gpu.device().time_kernels(true) {
        Err(RuntimeError::Unsupported { backend, what }) => {
            assert_eq!(backend, "gpu-sim");
            assert!(what.contains("timing"), "{what}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(gpu.device().last_kernel_us(), None);
    // About 4.3 GFLOP: 430 s at the interpreter's rate, past its 300 s.
    let spec: AttentionSpec = "heads = 8, head_dim = 64, mask = causal".parse().unwrap();
    let variant = Variant::new(spec).unwrap();
    let shape = [1, 8, 2048, 64];
    let (q, k) = (
        Tensor::from_f32(&shape, vec![0.0; 8 * 2048 * 64]).unwrap(),
        Tensor::from_f32(&shape, vec![0.0; 8 * 2048 * 64]).unwrap(),
    );
    let inputs = Inputs::Heads {
        q: &q,
        k: &k,
        v: &k,
    };
    let err = gpu.forward(&variant, inputs, 0).unwrap_err().to_string();
    assert!(err.contains("this forward"), "{err}");
}

/// A device copy of a cache that has changed since it was uploaded is an error, not a stale
/// answer.
fn stale_device_copies_are_refused<D: attn_runtime::device::Device + 'static>(
    gpu: &attn_runtime::gpu::backend::GpuBackend<D>,
) {
    use attn_runtime::DecodeOptions;
    use attn_runtime::cache::PagedCache;
    let spec: AttentionSpec = "heads = 2, head_dim = 16, mask = causal".parse().unwrap();
    let variant = attn_runtime::Variant::new(spec.clone()).unwrap();
    let mut cache = PagedCache::new(&spec, 8, 4).unwrap();
    let seq = cache.add_sequence();
    let kv =
        |len: usize, seed: u64| Tensor::from_f32(&[2, len, 16], values(32 * len, seed)).unwrap();
    cache.append(seq, &kv(5, 1), &kv(5, 2)).unwrap();
    let mut resident = gpu.upload_cache(&cache).unwrap();
    cache.append(seq, &kv(1, 3), &kv(1, 4)).unwrap();
    let q = Tensor::from_f32(&[1, 2, 1, 16], values(32, 5)).unwrap();
    let options = DecodeOptions::default();
    let e = gpu
        .decode_resident(&variant, &q, &cache, &resident, &[seq], options)
        .unwrap_err();
    assert!(e.to_string().contains("out of date"), "{e}");
    // Brought up to date by copying the new token's rows (a key and a value row of 16 f32 per
    // kv head), it decodes as a fresh upload does.
    assert_eq!(
        gpu.sync_cache(&mut resident, &cache).unwrap(),
        2 * 2 * 16 * 4
    );
    let synced = gpu
        .decode_resident(&variant, &q, &cache, &resident, &[seq], options)
        .unwrap();
    let fresh = support::decode(gpu, &variant.spec().clone(), &q, &cache, &[seq], options).unwrap();
    assert_eq!(synced.out.to_f32_vec(), fresh.out.to_f32_vec());
}

/// Sigmoid and stick-breaking attention decode on the interpreter as on the CPU: sigmoid's
/// split-KV partitions added by the merge kernel (16-bit caches on the tensor-core decode
/// kernel, its four warps' parts added), stick-breaking's rows kept whole (segments from the
/// last, on the SIMT kernel) whatever partitions are asked for. The tensor cores take the
/// weights rounded to the cache's format, an error that grows with the row's sum of weights:
/// bf16 with the paper's bias, f16 with weights near 0.6.
#[test]
fn gpu_unnormalized_decode_on_the_interpreter_equals_the_cpu_decode() {
    use attn_runtime::DecodeOptions;
    use attn_runtime::cache::PagedCache;
    use attn_runtime::cpu::CpuBackend;
    for text in [
        "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, normalize = sigmoid(bias = -ln(64))",
        "heads = 2, head_dim = 16, position = rope, mask = sliding_window(30), dtype = f16, \
         normalize = sigmoid(bias = 0.5)",
        "heads = 8, kv_heads = 2, head_dim = 64, mask = causal, dtype = bf16, \
         normalize = sigmoid(bias = -ln(64)), softcap = 20.0",
        "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, normalize = stick_breaking",
        "heads = 2, head_dim = 16, position = rope, mask = sliding_window(30), dtype = bf16, \
         normalize = stick_breaking",
    ] {
        let spec: AttentionSpec = text.parse().unwrap();
        let (h, hkv, d) = (
            spec.heads as usize,
            spec.kv_heads() as usize,
            spec.head_dim as usize,
        );
        let mut cache = PagedCache::new(&spec, 7, 40).unwrap();
        let seqs: Vec<_> = [45usize, 70]
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let seq = cache.add_sequence();
                let n = hkv * len * d;
                let k = Tensor::from_f32_as(spec.dtype, &[hkv, len, d], values(n, 10 + i as u64));
                let v = Tensor::from_f32_as(spec.dtype, &[hkv, len, d], values(n, 20 + i as u64));
                cache.append(seq, &k.unwrap(), &v.unwrap()).unwrap();
                seq
            })
            .collect();
        let tol = if spec.dtype == attn_dsl::DType::F32 {
            (2e-5, 1e-4)
        } else {
            (1e-3, 8e-3)
        };
        for (n, parts) in [(1, None), (3, Some(3))] {
            let q = Tensor::from_f32_as(spec.dtype, &[2, h, n, d], values(2 * h * n * d, 5));
            let q = q.unwrap();
            let options = DecodeOptions { partitions: parts };
            let want =
                support::decode(&CpuBackend::new(), &spec, &q, &cache, &seqs, options).unwrap();
            let got = support::decode(&GpuSim::new(), &spec, &q, &cache, &seqs, options).unwrap();
            assert_outputs_close(&got, &want, tol, &format!("{text} n {n}"));
        }
    }
}
