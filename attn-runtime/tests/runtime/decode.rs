//! Decoding against KV caches: paged == contiguous == reference over scrambled block tables,
//! ragged batches and chunked prefill, split-KV partitions, forks, step-by-step decoding against
//! one prefill, memory against the accounting, and the decode fixture cases.

use crate::support;

use crate::support::values;
use attn_dsl::AttentionSpec;
use attn_dsl::reference::{self, Array, Inputs};
use attn_runtime::Tensor;
use attn_runtime::cache::{ContiguousCache, KvCache, PagedCache, SeqId};
use attn_runtime::cpu::CpuBackend;
use attn_runtime::cpu::microkernels::Isa;
use attn_runtime::{DecodeOptions, MlaQueries};

/// A sequence's full K and V `[kv_heads, len, dim]`, rounded to the spec's dtype.
struct History {
    k: Vec<f32>,
    v: Vec<f32>,
    len: usize,
}

fn rounded(spec: &AttentionSpec, shape: &[usize], v: Vec<f32>) -> Vec<f32> {
    Tensor::from_f32_as(spec.dtype, shape, v)
        .unwrap()
        .to_f32_vec()
}

fn history(spec: &AttentionSpec, len: usize, seed: u64) -> History {
    let (hkv, d, dv) = dims(spec);
    History {
        k: rounded(spec, &[hkv * len * d], values(hkv * len * d, seed)),
        v: rounded(spec, &[hkv * len * dv], values(hkv * len * dv, seed + 1)),
        len,
    }
}

fn dims(spec: &AttentionSpec) -> (usize, usize, usize) {
    (
        spec.kv_heads() as usize,
        spec.head_dim as usize,
        spec.v_head_dim as usize,
    )
}

/// Tokens `a..b` of a history as `[kv_heads, b - a, dim]` tensors.
fn slice(spec: &AttentionSpec, h: &History, a: usize, b: usize) -> (Tensor, Tensor) {
    let (hkv, d, dv) = dims(spec);
    let part = |data: &[f32], dim: usize| {
        let mut out = Vec::new();
        for head in 0..hkv {
            out.extend_from_slice(&data[(head * h.len + a) * dim..(head * h.len + b) * dim]);
        }
        Tensor::from_f32_as(spec.dtype, &[hkv, b - a, dim], out).unwrap()
    };
    (part(&h.k, d), part(&h.v, dv))
}

/// The reference for the last `n` queries of a sequence at batch index `b` of a call: out
/// `[heads, n, dv]`, lse `[heads, n]`.
fn expected_at(
    spec: &AttentionSpec,
    b: usize,
    h: &History,
    q: &[f32],
    n: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (hkv, d, dv) = dims(spec);
    let heads = spec.heads as usize;
    // The same sequence in every batch row up to b: the score program may read b.
    let arr = |shape: &[usize], v: &[f32]| {
        let one: Vec<f64> = v.iter().map(|x| f64::from(*x)).collect();
        let data = (0..=b).flat_map(|_| one.clone()).collect();
        Array::from_vec(&[&[b + 1], shape].concat(), data).unwrap()
    };
    let want = reference::attention(
        spec,
        &Inputs {
            q: &arr(&[heads, n, d], q),
            k: &arr(&[hkv, h.len, d], &h.k),
            v: &arr(&[hkv, h.len, dv], &h.v),
            position_offset: 0,
        },
    )
    .unwrap();
    let (o, l) = (heads * n * dv, heads * n);
    (
        want.out.data()[b * o..(b + 1) * o].to_vec(),
        want.lse.data()[b * l..(b + 1) * l].to_vec(),
    )
}

fn expected(spec: &AttentionSpec, h: &History, q: &[f32], n: usize) -> (Vec<f64>, Vec<f64>) {
    expected_at(spec, 0, h, q, n)
}

fn tolerance(spec: &AttentionSpec) -> (f64, f64) {
    match spec.dtype {
        attn_dsl::DType::F32 => (2e-5, 1e-4),
        _ => (2e-2, 2e-2),
    }
}

fn close(what: &str, got: f64, want: f64, (abs, rel): (f64, f64)) {
    if want.is_infinite() {
        assert_eq!(got, want, "{what}");
    } else {
        assert!(
            (got - want).abs() <= abs + rel * want.abs(),
            "{what}: got {got}, want {want}"
        );
    }
}

const SPECS: &[&str] = &[
    "heads = 8, kv_heads = 2, head_dim = 64, mask = causal",
    "heads = 4, kv_heads = 4, head_dim = 40, v_head_dim = 24, mask = causal(top_left)",
    "heads = 6, kv_heads = 3, head_dim = 32, mask = sliding_window(37), position = alibi",
    "heads = 4, kv_heads = 1, head_dim = 48, mask = causal, softcap = 5.0, \
     position = rope(scaling = yarn(factor = 4.0, original_max_position = 64))",
    "heads = 4, kv_heads = 2, head_dim = 32, position = rope(layout = interleaved), \
     mask_mod = |b, h, q, k| (k + b + h) % 5 != 0",
    "heads = 8, kv_heads = 2, head_dim = 64, mask = causal, dtype = bf16",
    "heads = 4, kv_heads = 2, head_dim = 32, mask = causal, dtype = f16",
];

/// Several sequences appended in interleaved chunks (so paged block tables interleave and come
/// back scrambled from the free list), queried as one ragged batch on both caches.
fn check_ragged(spec_text: &str, block: usize, parts: Option<usize>) {
    check_ragged_on(&CpuBackend::new(), spec_text, block, parts);
}

fn check_ragged_on(backend: &CpuBackend, spec_text: &str, block: usize, parts: Option<usize>) {
    let spec: AttentionSpec = spec_text.parse().unwrap();
    let (lens, q_lens) = ([150usize, 1, 77, 300], [1usize, 1, 16, 40]);
    let histories: Vec<History> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| history(&spec, l, 10 + 2 * i as u64))
        .collect();
    let mut paged = PagedCache::new(&spec, block, 600 / block + 16).unwrap();
    // Churn: a sequence that takes blocks and frees them, so later tables are not in order.
    let junk = paged.add_sequence();
    let filler = history(&spec, 90, 99);
    let (k, v) = slice(&spec, &filler, 0, 90);
    paged.append(junk, &k, &v).unwrap();
    let mut contiguous = ContiguousCache::new(&spec).unwrap();
    let p_ids: Vec<SeqId> = lens.iter().map(|_| paged.add_sequence()).collect();
    let c_ids: Vec<SeqId> = lens.iter().map(|_| contiguous.add_sequence(8)).collect();
    let mut done = vec![0usize; lens.len()];
    let mut round = 0;
    while done.iter().zip(&lens).any(|(d, l)| d < l) {
        for i in 0..lens.len() {
            let step = 1 + (round * 7 + i * 13) % 29;
            let (a, b) = (done[i], (done[i] + step).min(lens[i]));
            if a < b {
                let (k, v) = slice(&spec, &histories[i], a, b);
                paged.append(p_ids[i], &k, &v).unwrap();
                contiguous.append(c_ids[i], &k, &v).unwrap();
                done[i] = b;
            }
        }
        if round == 2 {
            paged.free(junk).unwrap();
        }
        round += 1;
    }
    let heads = spec.heads as usize;
    let (_, d, dv) = dims(&spec);
    let total: usize = q_lens.iter().sum();
    let q_all = rounded(&spec, &[total * heads * d], values(total * heads * d, 5));
    let q = Tensor::from_f32_as(spec.dtype, &[total, heads, d], q_all.clone()).unwrap();
    let mut offsets = vec![0];
    for n in q_lens {
        offsets.push(offsets.last().unwrap() + n);
    }
    let options = DecodeOptions { partitions: parts };
    let from_paged =
        support::attend_ragged(backend, &spec, &q, &offsets, &paged, &p_ids, options).unwrap();
    let from_contiguous =
        support::attend_ragged(backend, &spec, &q, &offsets, &contiguous, &c_ids, options).unwrap();
    let tol = tolerance(&spec);
    for got in [&from_paged, &from_contiguous] {
        let (out, lse) = (got.out.to_f32_vec(), got.lse.to_f32_vec());
        for (s, h) in histories.iter().enumerate() {
            let n = q_lens[s];
            // This sequence's queries as [heads, n, d].
            let mut q_seq = vec![0f32; heads * n * d];
            for i in 0..n {
                for head in 0..heads {
                    let src = ((offsets[s] + i) * heads + head) * d;
                    q_seq[(head * n + i) * d..(head * n + i + 1) * d]
                        .copy_from_slice(&q_all[src..src + d]);
                }
            }
            let (want_out, want_lse) = expected_at(&spec, s, h, &q_seq, n);
            for i in 0..n {
                for head in 0..heads {
                    let row = (offsets[s] + i) * heads + head;
                    let what = format!("{spec_text} block {block} seq {s} q {i} head {head}");
                    close(
                        &format!("{what} lse"),
                        f64::from(lse[row]),
                        want_lse[head * n + i],
                        (1e-4, 1e-4),
                    );
                    for c in 0..dv {
                        close(
                            &format!("{what} out[{c}]"),
                            f64::from(out[row * dv + c]),
                            want_out[(head * n + i) * dv + c],
                            tol,
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn paged_and_contiguous_caches_match_the_reference() {
    for (i, spec) in SPECS.iter().enumerate() {
        let block = [16, 1, 7, 64, 100, 3, 32][i % 7];
        check_ragged(spec, block, None);
    }
}

/// Every instruction set's row kernels this CPU runs, on every dtype, and on rotated bf16
/// queries.
#[test]
fn every_instruction_sets_row_kernels_match_the_reference() {
    for isa in Isa::ALL {
        let Some(backend) = CpuBackend::with_isa(isa) else {
            continue;
        };
        for spec in [SPECS[0], SPECS[1], SPECS[5], SPECS[6], ROPE_BF16] {
            check_ragged_on(&backend, spec, 16, None);
        }
    }
}

/// A bf16 cache of rotated keys.
const ROPE_BF16: &str =
    "heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = rope, dtype = bf16";

#[test]
fn split_kv_partitions_merge_to_the_same_result() {
    for parts in [1, 2, 7, 50] {
        check_ragged(SPECS[0], 16, Some(parts));
        check_ragged(SPECS[2], 5, Some(parts));
    }
}

/// `normalize = sigmoid` decodes against both caches, its split-KV partitions summed.
#[test]
fn sigmoid_attention_decodes_and_its_partitions_add() {
    let specs = [
        "heads = 8, kv_heads = 2, head_dim = 64, mask = causal, normalize = sigmoid(bias = -ln(64))",
        "heads = 4, kv_heads = 2, head_dim = 32, position = rope, mask = sliding_window(50), \
         normalize = sigmoid(bias = 0.5), dtype = bf16",
    ];
    for spec in specs {
        for parts in [None, Some(2), Some(7)] {
            check_ragged(spec, 16, parts);
        }
    }
}

/// xPos decodes against both caches: keys stored with their factors from position 0, queries
/// with theirs; positions past the factors' range are refused at the append, the cache unchanged.
#[test]
fn xpos_decodes_and_refuses_positions_past_its_range() {
    let spec = "heads = 4, kv_heads = 2, head_dim = 32, mask = causal, \
                position = xpos(scale_base = 64.0)";
    check_ragged(spec, 16, None);
    check_ragged(spec, 7, Some(3));
    let spec: AttentionSpec = "heads = 1, head_dim = 16, position = xpos(scale_base = 1.0)"
        .parse()
        .unwrap();
    let mut cache = PagedCache::new(&spec, 16, 8).unwrap();
    let seq = cache.add_sequence();
    let h = history(&spec, 60, 3);
    let (k, v) = slice(&spec, &h, 0, 40);
    cache.append(seq, &k, &v).unwrap();
    // 1.25 per position: e^64 is reached at position 51.
    let (k, v) = slice(&spec, &h, 40, 60);
    let err = cache.append(seq, &k, &v).unwrap_err().to_string();
    assert!(
        err.contains("xpos") && err.contains("from position 0"),
        "{err}"
    );
    assert_eq!(cache.seq_len(seq).unwrap(), 40);
}

/// Stick-breaking decodes against both caches, each row's keys in one task from the nearest
/// segment (asked-for partitions are not taken: the keys' weights depend on the nearer ones).
#[test]
fn stick_breaking_decodes_from_the_nearest_segment() {
    let spec = "heads = 4, kv_heads = 2, head_dim = 32, mask = causal, position = rope, \
                normalize = stick_breaking";
    check_ragged(spec, 16, None);
    check_ragged(spec, 7, Some(3));
}

#[test]
fn step_by_step_decoding_equals_one_prefill() {
    let backend = CpuBackend::new();
    for text in [SPECS[0], SPECS[3]] {
        let spec: AttentionSpec = text.parse().unwrap();
        let (hkv, d, dv) = dims(&spec);
        let heads = spec.heads as usize;
        let len = 130;
        let h = history(&spec, len, 3);
        let q_all = values(heads * len * d, 4);
        let prefill = support::forward(
            &backend,
            &spec,
            &Tensor::from_f32(&[1, heads, len, d], q_all.clone()).unwrap(),
            &Tensor::from_f32(&[1, hkv, len, d], h.k.clone()).unwrap(),
            &Tensor::from_f32(&[1, hkv, len, dv], h.v.clone()).unwrap(),
            0,
        )
        .unwrap();
        let (want, want_lse) = (prefill.out.to_f32_vec(), prefill.lse.to_f32_vec());
        let mut cache = PagedCache::new(&spec, 16, 16).unwrap();
        let seq = cache.add_sequence();
        for t in 0..len {
            let (k, v) = slice(&spec, &h, t, t + 1);
            cache.append(seq, &k, &v).unwrap();
            let q: Vec<f32> = (0..heads)
                .flat_map(|head| q_all[(head * len + t) * d..(head * len + t + 1) * d].to_vec())
                .collect();
            let q = Tensor::from_f32(&[1, heads, 1, d], q).unwrap();
            let got = support::decode(
                &backend,
                &spec,
                &q,
                &cache,
                &[seq],
                DecodeOptions::default(),
            )
            .unwrap();
            let (out, lse) = (got.out.to_f32_vec(), got.lse.to_f32_vec());
            for head in 0..heads {
                let row = head * len + t;
                close(
                    &format!("{text} step {t} head {head} lse"),
                    f64::from(lse[head]),
                    f64::from(want_lse[row]),
                    (1e-5, 1e-5),
                );
                for c in 0..dv {
                    close(
                        &format!("{text} step {t} head {head} out[{c}]"),
                        f64::from(out[head * dv + c]),
                        f64::from(want[row * dv + c]),
                        (1e-5, 1e-5),
                    );
                }
            }
        }
    }
}

#[test]
fn forks_share_blocks_and_diverge_on_write() {
    let spec: AttentionSpec = SPECS[0].parse().unwrap();
    let backend = CpuBackend::new();
    let prefix = history(&spec, 40, 7);
    let mut cache = PagedCache::new(&spec, 16, 10).unwrap();
    let a = cache.add_sequence();
    let (k, v) = slice(&spec, &prefix, 0, 40);
    cache.append(a, &k, &v).unwrap();
    assert_eq!(cache.blocks_in_use(), 3);
    let b = cache.fork(a).unwrap();
    assert_eq!(cache.blocks_in_use(), 3, "a fork copies nothing");
    assert_eq!(cache.block_table(a).unwrap(), cache.block_table(b).unwrap());
    // Each branch appends its own next tokens; the shared, partly filled last block is copied.
    let (hkv, d, dv) = dims(&spec);
    let mut branches = Vec::new();
    for (seq, seed) in [(a, 20), (b, 30)] {
        let extra = history(&spec, 5, seed);
        let (k, v) = slice(&spec, &extra, 0, 5);
        cache.append(seq, &k, &v).unwrap();
        let mut full = History {
            k: Vec::new(),
            v: Vec::new(),
            len: 45,
        };
        for head in 0..hkv {
            full.k
                .extend_from_slice(&prefix.k[head * 40 * d..(head + 1) * 40 * d]);
            full.k
                .extend_from_slice(&extra.k[head * 5 * d..(head + 1) * 5 * d]);
            full.v
                .extend_from_slice(&prefix.v[head * 40 * dv..(head + 1) * 40 * dv]);
            full.v
                .extend_from_slice(&extra.v[head * 5 * dv..(head + 1) * 5 * dv]);
        }
        branches.push((seq, full));
    }
    assert_eq!(
        cache.blocks_in_use(),
        4,
        "two shared blocks, two private tails"
    );
    let heads = spec.heads as usize;
    for (seq, full) in &branches {
        let q = values(heads * d, 8);
        let got = support::decode(
            &backend,
            &spec,
            &Tensor::from_f32(&[1, heads, 1, d], q.clone()).unwrap(),
            &cache,
            &[*seq],
            DecodeOptions::default(),
        )
        .unwrap();
        let (want, _) = expected(&spec, full, &q, 1);
        for (i, (g, w)) in got.out.to_f32_vec().iter().zip(&want).enumerate() {
            close(
                &format!("branch {seq:?} out[{i}]"),
                f64::from(*g),
                *w,
                (2e-5, 1e-4),
            );
        }
    }
    cache.free(a).unwrap();
    cache.free(b).unwrap();
    assert_eq!(cache.blocks_in_use(), 0);
    assert_eq!(cache.free_blocks(), 10);
}

#[test]
fn memory_equals_the_accounting() {
    for text in [
        SPECS[0],
        SPECS[5],
        "heads = 16, kv_heads = 4, head_dim = 128, v_head_dim = 64",
    ] {
        let spec: AttentionSpec = text.parse().unwrap();
        let per_token = attn_dsl::accounting::kv_cache_bytes_per_token(&spec);
        let lens = [1usize, 16, 17, 100];
        let mut contiguous = ContiguousCache::new(&spec).unwrap();
        let block = 16;
        let mut paged = PagedCache::new(&spec, block, 64).unwrap();
        for (i, &len) in lens.iter().enumerate() {
            let h = history(&spec, len, i as u64);
            let (k, v) = slice(&spec, &h, 0, len);
            let c = contiguous.add_sequence(1);
            contiguous.append(c, &k, &v).unwrap();
            let p = paged.add_sequence();
            paged.append(p, &k, &v).unwrap();
        }
        let tokens: u64 = lens.iter().map(|&l| l as u64).sum();
        assert_eq!(contiguous.bytes_in_use(), tokens * per_token, "{text}");
        let used = paged.bytes_in_use();
        assert!(used >= tokens * per_token, "{text}");
        let waste = used - tokens * per_token;
        assert!(
            waste < lens.len() as u64 * block as u64 * per_token,
            "{text}: {waste} bytes wasted"
        );
        let blocks: usize = lens.iter().map(|l| l.div_ceil(block)).sum();
        assert_eq!(paged.blocks_in_use(), blocks, "{text}");
    }
}

#[test]
fn the_decode_fixture_cases() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/attention");
    let backend = CpuBackend::new();
    for (file, spec_text, n) in [
        (
            "sliding_window_128_decode_f32.safetensors",
            "heads = 4, kv_heads = 2, head_dim = 64, scale = 0.125, mask = sliding_window(128)",
            1,
        ),
        (
            "chunked_prefill_q16_kv300_f32.safetensors",
            "heads = 4, kv_heads = 2, head_dim = 64, scale = 0.125, mask = causal",
            16,
        ),
    ] {
        let spec: AttentionSpec = spec_text.parse().unwrap();
        let path = format!("{dir}/{file}");
        let t = attn_runtime::io::read_safetensors(std::path::Path::new(&path), &["q", "k", "v"])
            .unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let f64s = |name: &str| -> Vec<f64> {
            st.tensor(name)
                .unwrap()
                .data()
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let (want_out, want_lse) = (f64s("out"), f64s("lse"));
        let (q, k, v) = (&t[0], &t[1], &t[2]);
        let skv = k.shape()[2];
        let mut cache = PagedCache::new(&spec, 16, skv.div_ceil(16)).unwrap();
        let seq = cache.add_sequence();
        let drop_batch = |x: &Tensor| {
            let s = x.shape();
            Tensor::from_f32(&[s[1], s[2], s[3]], x.to_f32_vec()).unwrap()
        };
        cache.append(seq, &drop_batch(k), &drop_batch(v)).unwrap();
        assert_eq!(cache.seq_len(seq).unwrap(), skv);
        let got =
            support::decode(&backend, &spec, q, &cache, &[seq], DecodeOptions::default()).unwrap();
        assert_eq!(got.out.shape(), [1, 4, n, 64]);
        for (i, (g, w)) in got.out.to_f32_vec().iter().zip(&want_out).enumerate() {
            close(&format!("{file} out[{i}]"), f64::from(*g), *w, (1e-5, 1e-4));
        }
        for (i, (g, w)) in got.lse.to_f32_vec().iter().zip(&want_lse).enumerate() {
            close(&format!("{file} lse[{i}]"), f64::from(*g), *w, (1e-5, 1e-5));
        }
    }
}

#[test]
fn bad_calls_are_errors() {
    let spec: AttentionSpec = SPECS[0].parse().unwrap();
    let backend = CpuBackend::new();
    let mut cache = PagedCache::new(&spec, 16, 2).unwrap();
    let seq = cache.add_sequence();
    let h = history(&spec, 40, 1);
    let (k, v) = slice(&spec, &h, 0, 40);
    let err = cache.append(seq, &k, &v).unwrap_err().to_string();
    assert!(err.contains("full"), "{err}");
    assert_eq!(
        cache.seq_len(seq).unwrap(),
        0,
        "a failed append changes nothing"
    );
    let (k, v) = slice(&spec, &h, 0, 4);
    cache.append(seq, &k, &v).unwrap();
    let wrong = Tensor::from_f32(&[3, 4, 64], vec![0.0; 3 * 4 * 64]).unwrap();
    let err = cache.append(seq, &wrong, &v).unwrap_err().to_string();
    assert!(err.contains("`k`") && err.contains("[2, n, 64]"), "{err}");
    let q = Tensor::from_f32(&[1, 8, 5, 64], vec![0.0; 8 * 5 * 64]).unwrap();
    let err = support::decode(
        &backend,
        &spec,
        &q,
        &cache,
        &[seq],
        DecodeOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("4 cached tokens but 5 queries"), "{err}");
    let other = PagedCache::new(&SPECS[2].parse().unwrap(), 16, 2).unwrap();
    let err = support::decode(
        &backend,
        &spec,
        &q,
        &other,
        &[seq],
        DecodeOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("another spec"), "{err}");
    cache.free(seq).unwrap();
    let err = cache.free(seq).unwrap_err().to_string();
    assert!(err.contains("not in this cache"), "{err}");
}

#[test]
fn mla_decoding_against_a_latent_cache_equals_the_forward_kernel() {
    use attn_runtime::MlaTensors;
    let backend = CpuBackend::new();
    for text in [
        "heads = 4, head_dim = 16, v_head_dim = 24, mla(latent_rank = 32, rope_dim = 8), \
         mask = causal",
        "heads = 2, head_dim = 8, mla(latent_rank = 64, rope_dim = 16), mask = causal, \
         position = rope(scaling = yarn(factor = 4.0, original_max_position = 32))",
    ] {
        let spec: AttentionSpec = text.parse().unwrap();
        let mla = spec.mla().unwrap();
        let (h, dn, dv) = (
            spec.heads as usize,
            spec.head_dim as usize,
            spec.v_head_dim as usize,
        );
        let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
        let len = 90;
        let t = |shape: &[usize], seed: u64| {
            Tensor::from_f32(shape, values(shape.iter().product(), seed)).unwrap()
        };
        let (c_kv, k_pe) = (t(&[len, r], 1), t(&[len, dr], 2));
        let w_kv_b = t(&[h * (dn + dv), r], 3);
        let mut paged = PagedCache::new(&spec, 7, 20).unwrap();
        let mut contiguous = ContiguousCache::new(&spec).unwrap();
        let (p, c) = (paged.add_sequence(), contiguous.add_sequence(4));
        for (a, b) in [(0, 1), (1, 30), (30, 31), (31, 90)] {
            let rows = |x: &Tensor, w: usize| {
                Tensor::from_f32(&[b - a, w], x.to_f32_vec()[a * w..b * w].to_vec()).unwrap()
            };
            paged.append(p, &rows(&c_kv, r), &rows(&k_pe, dr)).unwrap();
            contiguous
                .append(c, &rows(&c_kv, r), &rows(&k_pe, dr))
                .unwrap();
        }
        let per_token = attn_dsl::accounting::kv_cache_bytes_per_token(&spec);
        assert_eq!(contiguous.bytes_in_use(), len as u64 * per_token, "{text}");
        assert_eq!(paged.bytes_in_use(), 13 * 7 * per_token, "{text}");
        for n in [1, 3, 40] {
            let (q_nope, q_pe) = (t(&[1, h, n, dn], 4), t(&[1, h, n, dr], 5));
            let with_batch =
                |x: &Tensor, w: usize| Tensor::from_f32(&[1, len, w], x.to_f32_vec()).unwrap();
            let want = support::forward_mla(
                &backend,
                &spec,
                &MlaTensors {
                    q_nope: &q_nope,
                    q_pe: &q_pe,
                    c_kv: &with_batch(&c_kv, r),
                    k_pe: &with_batch(&k_pe, dr),
                    w_kv_b: &w_kv_b,
                },
                0,
            )
            .unwrap();
            let queries = MlaQueries {
                q_nope: &q_nope,
                q_pe: &q_pe,
                w_kv_b: &w_kv_b,
            };
            let runs = [
                support::decode_mla(
                    &backend,
                    &spec,
                    queries,
                    &paged,
                    &[p],
                    DecodeOptions::default(),
                ),
                support::decode_mla(
                    &backend,
                    &spec,
                    queries,
                    &contiguous,
                    &[c],
                    DecodeOptions {
                        partitions: Some(3),
                    },
                ),
            ];
            for got in runs {
                let got = got.unwrap();
                assert_eq!(got.out.shape(), [1, h, n, dv]);
                for (i, (g, w)) in got
                    .out
                    .to_f32_vec()
                    .iter()
                    .zip(want.out.to_f32_vec())
                    .enumerate()
                {
                    close(
                        &format!("{text} n {n} out[{i}]"),
                        f64::from(*g),
                        f64::from(w),
                        (2e-5, 1e-4),
                    );
                }
                for (i, (g, w)) in got
                    .lse
                    .to_f32_vec()
                    .iter()
                    .zip(want.lse.to_f32_vec())
                    .enumerate()
                {
                    close(
                        &format!("{text} n {n} lse[{i}]"),
                        f64::from(*g),
                        f64::from(w),
                        (1e-5, 1e-5),
                    );
                }
            }
        }
    }
}

/// Dynamic NTK in a cache follows transformers: each key keeps the rotation of the step that
/// appended it (frequencies for the length after that step), queries use the current length.
#[test]
fn dynamic_ntk_keys_keep_the_rotation_of_their_step() {
    use attn_dsl::reference::rope;
    let text = "heads = 2, kv_heads = 1, head_dim = 16, mask = causal, position = \
                rope(scaling = dynamic(factor = 2.0, original_max_position = 32))";
    let spec: AttentionSpec = text.parse().unwrap();
    let plain: AttentionSpec = format!(
        "heads = 2, kv_heads = 1, head_dim = 16, mask = causal, scale = {:?}",
        spec.effective_scale()
    )
    .parse()
    .unwrap();
    let r = spec.rope().unwrap().clone();
    let backend = CpuBackend::new();
    let (d, len) = (16, 80);
    let h = history(&spec, len, 11);
    let mut cache = PagedCache::new(&spec, 8, 10).unwrap();
    let seq = cache.add_sequence();
    let mut rotated_k: Vec<f32> = Vec::new();
    for t in 0..len {
        let (k, v) = slice(&spec, &h, t, t + 1);
        cache.append(seq, &k, &v).unwrap();
        let mut key: Vec<f64> = h.k[t * d..(t + 1) * d]
            .iter()
            .map(|&x| f64::from(x))
            .collect();
        let freqs = rope::inv_freq(&r, t as u64 + 1);
        rope::rotate(&r, &mut key, t as i64, &freqs, rope::attention_factor(&r));
        rotated_k.extend(key.iter().map(|&x| x as f32));
        let q = values(2 * d, 100 + t as u64);
        let got = support::decode(
            &backend,
            &spec,
            &Tensor::from_f32(&[1, 2, 1, d], q.clone()).unwrap(),
            &cache,
            &[seq],
            DecodeOptions::default(),
        )
        .unwrap();
        // The reference: the same attention without RoPE over keys and a query rotated as above.
        let freqs = rope::inv_freq(&r, t as u64 + 1);
        let mut q_rot = Vec::new();
        for head in 0..2 {
            let mut row: Vec<f64> = q[head * d..(head + 1) * d]
                .iter()
                .map(|&x| f64::from(x))
                .collect();
            rope::rotate(&r, &mut row, t as i64, &freqs, rope::attention_factor(&r));
            q_rot.extend(row.iter().map(|&x| x as f32));
        }
        let so_far = History {
            k: rotated_k.clone(),
            v: h.v[..(t + 1) * d].to_vec(),
            len: t + 1,
        };
        let (want, _) = expected(&plain, &so_far, &q_rot, 1);
        for (i, (g, w)) in got.out.to_f32_vec().iter().zip(&want).enumerate() {
            close(
                &format!("step {t} out[{i}]"),
                f64::from(*g),
                *w,
                (2e-5, 1e-4),
            );
        }
    }
}

/// Every run a cache hands out lies inside its regions (what a device copy uploads), and every
/// change moves its generation forward (so a stale copy is caught).
#[test]
fn runs_lie_inside_the_regions_and_changes_move_the_generation() {
    let spec: AttentionSpec = "heads = 4, kv_heads = 2, head_dim = 8, mask = causal, dtype = bf16"
        .parse()
        .unwrap();
    let t = |len: usize, seed: u64| {
        Tensor::from_f32_as(spec.dtype, &[2, len, 8], values(2 * len * 8, seed)).unwrap()
    };
    let inside = |cache: &dyn KvCache, seq, len: usize| {
        let regions = cache.regions();
        for head in 0..2 {
            for run in cache.runs(seq, head, 0, len).unwrap() {
                for (ptr, width) in [(run.k, 8), (run.v, 8)] {
                    let (start, end) = (ptr as usize, ptr as usize + (run.len * width - 1) * 2);
                    assert!(
                        regions.iter().any(|&(r, bytes)| {
                            (r as usize) <= start && end < r as usize + bytes
                        }),
                        "a run outside the regions"
                    );
                }
            }
        }
    };
    let mut paged = PagedCache::new(&spec, 4, 10).unwrap();
    let mut contiguous = ContiguousCache::new(&spec).unwrap();
    let (p, c) = (paged.add_sequence(), contiguous.add_sequence(2));
    let (g_paged, g_contiguous) = (paged.generation(), contiguous.generation());
    paged.append(p, &t(9, 1), &t(9, 2)).unwrap();
    contiguous.append(c, &t(9, 1), &t(9, 2)).unwrap();
    assert!(paged.generation() > g_paged && contiguous.generation() > g_contiguous);
    inside(&paged, p, 9);
    inside(&contiguous, c, 9);
    let before = paged.generation();
    let fork = paged.fork(p).unwrap();
    paged.append(fork, &t(2, 3), &t(2, 4)).unwrap();
    assert!(paged.generation() > before);
    inside(&paged, fork, 11);
    let before = paged.generation();
    paged.free(p).unwrap();
    assert!(paged.generation() > before);
}

/// A mirror of a cache's memory (a device copy, say), taken once and then brought up to date
/// by `MirrorSync`, equals the memory after every change: appends, forks and the copy on write
/// of a shared block, frees, and a contiguous sequence's reallocation. A one-token step copies
/// a key row and a value row per kv head, not the cache.
#[test]
fn mirrors_brought_up_to_date_equal_the_cache() {
    use attn_runtime::cache::MirrorSync;
    struct Mirror {
        bytes: Vec<Vec<u8>>,
        regions: Vec<(usize, usize)>,
        generation: u64,
    }
    impl Mirror {
        fn of(cache: &impl KvCache) -> Mirror {
            Mirror {
                bytes: cache.memory().iter().map(|m| m.to_vec()).collect(),
                regions: cache
                    .regions()
                    .into_iter()
                    .map(|(p, n)| (p as usize, n))
                    .collect(),
                generation: cache.generation(),
            }
        }
        /// Syncs and checks; returns the plan's bytes.
        fn sync(&mut self, cache: &impl KvCache, what: &str) -> usize {
            let plan = MirrorSync::plan(cache, &self.regions, self.generation);
            let memory = cache.memory();
            let copied = plan.bytes(memory.iter().map(|m| m.len()).sum());
            match plan {
                MirrorSync::UpToDate => {}
                MirrorSync::Full => *self = Mirror::of(cache),
                MirrorSync::Writes(writes) => {
                    for w in writes {
                        let range = w.start..w.start + w.len;
                        self.bytes[w.region][range.clone()]
                            .copy_from_slice(&memory[w.region][range]);
                    }
                    self.generation = cache.generation();
                }
            }
            let now: Vec<&[u8]> = self.bytes.iter().map(|b| b.as_slice()).collect();
            assert!(now == memory, "{what}: the mirror differs from the cache");
            copied
        }
    }
    let spec: AttentionSpec = "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, \
                               position = rope, dtype = bf16"
        .parse()
        .unwrap();
    let (hkv, d, dv) = dims(&spec);
    let row_pair = hkv * (d + dv) * 2;
    let h = history(&spec, 40, 7);

    let mut paged = PagedCache::new(&spec, 4, 32).unwrap();
    let mut mirror = Mirror::of(&paged);
    let a = paged.add_sequence();
    let (k, v) = slice(&spec, &h, 0, 6);
    paged.append(a, &k, &v).unwrap();
    assert_eq!(mirror.sync(&paged, "paged append 6"), 6 * row_pair);
    assert_eq!(mirror.sync(&paged, "paged unchanged"), 0);
    let (k, v) = slice(&spec, &h, 6, 7);
    paged.append(a, &k, &v).unwrap();
    assert_eq!(mirror.sync(&paged, "paged step"), row_pair);
    // A fork shares the partly filled last block; appending to it copies the block first.
    let b = paged.fork(a).unwrap();
    mirror.sync(&paged, "paged fork");
    let (k, v) = slice(&spec, &h, 7, 8);
    paged.append(b, &k, &v).unwrap();
    let block = 4 * hkv * (d + dv) * 2;
    assert_eq!(mirror.sync(&paged, "paged copy on write"), block + row_pair);
    paged.free(a).unwrap();
    let c = paged.add_sequence();
    let (k, v) = slice(&spec, &h, 0, 9);
    paged.append(c, &k, &v).unwrap();
    paged.append(b, &k, &v).unwrap();
    assert_eq!(mirror.sync(&paged, "paged two appends"), 18 * row_pair);

    let mut contiguous = ContiguousCache::new(&spec).unwrap();
    let mut mirror = Mirror::of(&contiguous);
    let a = contiguous.add_sequence(8);
    let total = |c: &ContiguousCache| c.memory().iter().map(|m| m.len()).sum::<usize>();
    assert_eq!(
        mirror.sync(&contiguous, "contiguous new"),
        total(&contiguous)
    );
    let (k, v) = slice(&spec, &h, 0, 5);
    contiguous.append(a, &k, &v).unwrap();
    assert_eq!(mirror.sync(&contiguous, "contiguous append"), 5 * row_pair);
    let (k, v) = slice(&spec, &h, 5, 6);
    contiguous.append(a, &k, &v).unwrap();
    assert_eq!(mirror.sync(&contiguous, "contiguous step"), row_pair);
    // Past the capacity the sequence moves: everything again.
    let (k, v) = slice(&spec, &h, 6, 12);
    contiguous.append(a, &k, &v).unwrap();
    assert_eq!(
        mirror.sync(&contiguous, "contiguous grown"),
        total(&contiguous)
    );
    let b = contiguous.add_sequence(4);
    let (k, v) = slice(&spec, &h, 0, 2);
    contiguous.append(b, &k, &v).unwrap();
    contiguous.append(a, &k, &v).unwrap();
    mirror.sync(&contiguous, "contiguous second sequence");
    contiguous.free(a).unwrap();
    mirror.sync(&contiguous, "contiguous freed");
    let (k, v) = slice(&spec, &h, 2, 3);
    contiguous.append(b, &k, &v).unwrap();
    assert_eq!(
        mirror.sync(&contiguous, "contiguous step after free"),
        row_pair
    );
}
