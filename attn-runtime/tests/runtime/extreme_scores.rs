//! NaN, infinities and scores near `f32::MAX` against the stated semantics (docs/semantics.md,
//! "Semantics"): a row is empty only when the mask drops every key; a NaN that reaches a row
//! makes it NaN; any finite score is a score, however large. On the CPU forward kernel, the
//! decode kernel with split-KV partitions, and the reference.

use crate::support;

use crate::support::values;
use attn_dsl::AttentionSpec;
use attn_dsl::reference::{self, Array, Inputs};
use attn_runtime::Tensor;
use attn_runtime::cache::PagedCache;
use attn_runtime::cpu::CpuBackend;
use attn_runtime::gpu::sim::GpuSim;
use attn_runtime::{DecodeOptions, Output};

struct Case {
    spec: AttentionSpec,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    sq: usize,
    skv: usize,
}

impl Case {
    fn new(text: &str, sq: usize, skv: usize) -> Case {
        let spec: AttentionSpec = text.parse().unwrap();
        let (h, hkv, d, dv) = dims(&spec);
        Case {
            q: values(h * sq * d, 1),
            k: values(hkv * skv * d, 2),
            v: values(hkv * skv * dv, 3),
            spec,
            sq,
            skv,
        }
    }

    /// The values rounded to multiples of 1/8, which bf16 holds exactly.
    fn exact_in_bf16(mut self) -> Case {
        for x in self.q.iter_mut().chain(&mut self.k).chain(&mut self.v) {
            *x = (*x * 8.0).round() / 8.0;
        }
        self
    }

    /// q, k and v in the spec's dtype.
    fn tensors(&self) -> [Tensor; 3] {
        let (h, hkv, d, dv) = dims(&self.spec);
        let t = |shape: &[usize], v: &[f32]| {
            Tensor::from_f32_as(self.spec.dtype, shape, v.to_vec()).unwrap()
        };
        [
            t(&[1, h, self.sq, d], &self.q),
            t(&[1, hkv, self.skv, d], &self.k),
            t(&[1, hkv, self.skv, dv], &self.v),
        ]
    }

    /// The GPU forward kernel the spec runs on, on the GPU IR interpreter.
    fn gpu_forward(&self) -> Output {
        let [q, k, v] = self.tensors();
        attn_runtime::gpu::GpuCall::forward(&self.spec, &q, &k, &v, 0)
            .unwrap()
            .run_on_sim()
            .unwrap()
    }

    fn reference(&self) -> reference::Output {
        let (h, hkv, d, dv) = dims(&self.spec);
        let array = |shape: &[usize], v: &[f32]| {
            Array::from_vec(shape, v.iter().map(|x| f64::from(*x)).collect()).unwrap()
        };
        let (q, k, v) = (
            array(&[1, h, self.sq, d], &self.q),
            array(&[1, hkv, self.skv, d], &self.k),
            array(&[1, hkv, self.skv, dv], &self.v),
        );
        let inputs = Inputs {
            q: &q,
            k: &k,
            v: &v,
            position_offset: 0,
        };
        reference::attention(&self.spec, &inputs).unwrap()
    }

    fn forward(&self) -> Output {
        let [q, k, v] = self.tensors();
        support::forward(&CpuBackend::new(), &self.spec, &q, &k, &v, 0).unwrap()
    }

    /// A paged cache holding all `skv` keys and values, and its one sequence.
    fn cache(&self) -> (PagedCache, attn_runtime::cache::SeqId) {
        let [_, k, v] = self.tensors();
        let (_, hkv, d, dv) = dims(&self.spec);
        let mut cache = PagedCache::new(&self.spec, 16, self.skv.div_ceil(16) + 1).unwrap();
        let seq = cache.add_sequence();
        let as3 = |t: &Tensor, w: usize| {
            Tensor::from_f32_as(self.spec.dtype, &[hkv, self.skv, w], t.to_f32_vec()).unwrap()
        };
        cache.append(seq, &as3(&k, d), &as3(&v, dv)).unwrap();
        (cache, seq)
    }

    /// The last `sq` queries decoded against a paged cache of all `skv` keys, split into
    /// `partitions` parts.
    fn decode(&self, partitions: usize) -> Output {
        let [q, _, _] = self.tensors();
        let (cache, seq) = self.cache();
        let options = DecodeOptions {
            partitions: Some(partitions),
        };
        support::decode(&CpuBackend::new(), &self.spec, &q, &cache, &[seq], options).unwrap()
    }
}

fn dims(spec: &AttentionSpec) -> (usize, usize, usize, usize) {
    (
        spec.heads as usize,
        spec.kv_heads() as usize,
        spec.head_dim as usize,
        spec.v_head_dim as usize,
    )
}

/// `got` equals `want` within `rel` (relative, at least 1e-5 absolute), NaN where it is NaN and
/// infinities exactly.
fn same(what: &str, got: &[f32], want: &[f64], rel: f64) {
    close(what, got, want, 1e-5, rel);
}

/// [`same`] with an absolute tolerance of `abs`.
fn close(what: &str, got: &[f32], want: &[f64], abs: f64, rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = f64::from(*g);
        if w.is_nan() || w.is_infinite() {
            assert!(
                g.is_nan() == w.is_nan() && (w.is_nan() || g == *w),
                "{what}[{i}]: got {g}, want {w}"
            );
        } else {
            assert!(
                (g - w).abs() <= abs + rel * w.abs(),
                "{what}[{i}]: got {g}, want {w}"
            );
        }
    }
}

/// `got`'s out and lse equal `want`'s within the differential tests' tolerance for the spec's dtype (f32:
/// 1e-5 abs and 1e-4 rel; bf16 and f16: 2e-2 abs), NaN and infinities exactly.
fn outputs_match(what: &str, spec: &AttentionSpec, got: &Output, want: &reference::Output) {
    let (abs, rel) = match spec.dtype {
        attn_dsl::DType::F32 => (1e-5, 1e-4),
        _ => (2e-2, 1e-5),
    };
    let (out, lse) = (got.out.to_f32_vec(), got.lse.to_f32_vec());
    close(&format!("{what}: out"), &out, want.out.data(), abs, rel);
    close(&format!("{what}: lse"), &lse, want.lse.data(), abs, rel);
}

fn matches_reference(case: &Case, what: &str) {
    let want = case.reference();
    outputs_match(what, &case.spec, &case.forward(), &want);
    for parts in [1, 3] {
        let what = format!("{what}: decode in {parts} parts");
        outputs_match(&what, &case.spec, &case.decode(parts), &want);
    }
}

/// The rows (head, query) whose lse is NaN.
fn nan_rows(lse: &[f64], sq: usize) -> Vec<(usize, usize)> {
    (0..lse.len())
        .filter(|&r| lse[r].is_nan())
        .map(|r| (r / sq, r % sq))
        .collect()
}

#[test]
fn a_nan_query_makes_its_row_nan() {
    let mut case = Case::new(
        "heads = 4, kv_heads = 2, head_dim = 16, mask = causal",
        40,
        70,
    );
    let d = 16;
    // Head 1, query 7, one element.
    case.q[(40 + 7) * d + 3] = f32::NAN;
    let want = case.reference();
    assert_eq!(nan_rows(want.lse.data(), 40), vec![(1, 7)]);
    matches_reference(&case, "NaN in q");
}

#[test]
fn a_nan_key_makes_every_row_that_keeps_it_nan() {
    for (mask, rows) in [("causal", 10), ("sliding_window(8)", 8)] {
        let text = format!("heads = 2, kv_heads = 1, head_dim = 16, mask = {mask}");
        let mut case = Case::new(&text, 40, 40);
        // Key 30: kept by queries 30.. (causal) or 30..38 (a window of 8).
        case.k[30 * 16 + 5] = f32::NAN;
        let want = case.reference();
        let expected: Vec<_> = (0..2)
            .flat_map(|h| (30..30 + rows).map(move |i| (h, i)))
            .collect();
        assert_eq!(nan_rows(want.lse.data(), 40), expected, "{mask}");
        matches_reference(&case, &format!("NaN in k, {mask}"));
    }
}

#[test]
fn a_nan_value_of_a_kept_key_makes_the_row_nan() {
    let mut case = Case::new("heads = 2, head_dim = 16, mask = causal", 20, 20);
    case.v[(20 + 12) * 16 + 2] = f32::NAN;
    let want = case.reference();
    for got in [case.forward(), case.decode(1), case.decode(3)] {
        let (out, lse) = (got.out.to_f32_vec(), got.lse.to_f32_vec());
        same("lse (values do not touch it)", &lse, want.lse.data(), 1e-5);
        for i in 0..20 {
            let row = &out[(20 + i) * 16..(21 + i) * 16];
            // Rows that keep key 12 are NaN in the value's column. Rows that mask it but share
            // its key tile may be too (0 x NaN in the tile's value product, as in PyTorch's math
            // path).
            if i >= 12 {
                assert!(row[2].is_nan(), "row {i}: {row:?}");
            }
        }
        // The other head reads the other kv head: untouched.
        same("head 0", &out[..320], &want.out.data()[..320], 1e-4);
    }
}

#[test]
fn scores_up_to_f32_max_are_scores() {
    // One key scored near the top of f32 dominates every row that keeps it.
    for big in ["2.4e38", "3.0e38", "3.4028234e38", "1e30", "-3.4e38"] {
        let text = format!(
            "heads = 2, head_dim = 16, mask = causal, score_mod = |s, b, h, q, k| if k == 3 \
             {{ {big} }} else {{ s }}"
        );
        let case = Case::new(&text, 40, 40);
        matches_reference(&case, &format!("score {big} at key 3"));
    }
    // Large q against small k: scores of about 1e37 from the dot product itself.
    let mut case = Case::new("heads = 2, head_dim = 16", 24, 24);
    for (i, q) in case.q.iter_mut().enumerate() {
        *q = if i % 16 == 0 { 3e38 } else { 0.0 };
    }
    matches_reference(&case, "q of 3e38");
}

#[test]
fn scores_that_overflow_f32_are_never_masks() {
    // Every element 3e38: the dot products overflow f32. Such a row is not empty (its keys are
    // kept): it is NaN (inf - inf, as in PyTorch), never -inf with out 0.
    let mut case = Case::new("heads = 2, head_dim = 16, mask = causal", 32, 32);
    case.q.iter_mut().for_each(|q| *q = 3e38);
    for got in [case.forward(), case.decode(2)] {
        for (r, lse) in got.lse.to_f32_vec().iter().enumerate() {
            assert!(*lse != f32::NEG_INFINITY, "row {r}: lse {lse}");
        }
    }
}

#[test]
fn rows_the_mask_empties_are_zero_with_lse_minus_infinity() {
    // Top-left causal with more queries than keys: queries past the last key keep keys, but a
    // mask_mod that drops every key of query 5 empties that row whatever the scores are.
    let mut case = Case::new(
        "heads = 2, head_dim = 16, mask_mod = |b, h, q, k| q != 5",
        12,
        12,
    );
    case.q.iter_mut().for_each(|q| *q *= 1e30);
    let got = case.forward();
    let lse = got.lse.to_f32_vec();
    let out = got.out.to_f32_vec();
    for h in 0..2 {
        assert_eq!(lse[h * 12 + 5], f32::NEG_INFINITY);
        assert!(
            out[(h * 12 + 5) * 16..(h * 12 + 6) * 16]
                .iter()
                .all(|x| *x == 0.0)
        );
    }
    matches_reference(&case, "a mask_mod that empties one row");
}

#[test]
fn positions_past_the_representable_range_are_refused() {
    use attn_dsl::reference::MAX_POSITION;
    let case = Case::new(
        "heads = 2, head_dim = 16, mask = sliding_window(5), position = rope",
        6,
        9,
    );
    let [q, k, v] = case.tensors();
    let cpu = CpuBackend::new();
    let (h, hkv, d, dv) = dims(&case.spec);
    let array = |shape: &[usize], t: &Tensor| {
        Array::from_vec(
            shape,
            t.to_f32_vec().iter().map(|x| f64::from(*x)).collect(),
        )
        .unwrap()
    };
    let (qa, ka, va) = (
        array(&[1, h, 6, d], &q),
        array(&[1, hkv, 9, d], &k),
        array(&[1, hkv, 9, dv], &v),
    );
    // The last key at the largest position, and the first at the smallest: accepted, and the
    // CPU kernel, the GPU kernel on the interpreter and the reference agree there.
    for p0 in [MAX_POSITION - 8, -MAX_POSITION, 0] {
        let inputs = Inputs {
            q: &qa,
            k: &ka,
            v: &va,
            position_offset: p0,
        };
        let want = reference::attention(&case.spec, &inputs).unwrap();
        let got = support::forward(&cpu, &case.spec, &q, &k, &v, p0).unwrap();
        same(
            &format!("p0 {p0}: out"),
            &got.out.to_f32_vec(),
            want.out.data(),
            1e-3,
        );
        let gpu = attn_runtime::gpu::GpuCall::forward(&case.spec, &q, &k, &v, p0)
            .unwrap()
            .run_on_sim()
            .unwrap();
        same(
            &format!("p0 {p0}: gpu out"),
            &gpu.out.to_f32_vec(),
            want.out.data(),
            1e-3,
        );
    }
    // One past either end, and offsets whose sums would wrap i64: refused by all three.
    for p0 in [
        MAX_POSITION - 7,
        -MAX_POSITION - 1,
        i64::MAX,
        i64::MIN,
        i64::MAX - 3,
    ] {
        let inputs = Inputs {
            q: &qa,
            k: &ka,
            v: &va,
            position_offset: p0,
        };
        let err = reference::attention(&case.spec, &inputs)
            .unwrap_err()
            .to_string();
        assert!(err.contains("allowed: positions"), "p0 {p0}: {err}");
        let err = support::forward(&cpu, &case.spec, &q, &k, &v, p0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("allowed: positions"), "p0 {p0}: {err}");
        let err = match attn_runtime::gpu::GpuCall::forward(&case.spec, &q, &k, &v, p0) {
            Ok(_) => panic!("p0 {p0}: the GPU call was prepared"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("allowed: positions"), "p0 {p0}: {err}");
    }
}

#[test]
fn the_gpu_kernels_on_the_interpreter_carry_nan_to_rows() {
    // f32 runs the SIMT kernel, bf16 the tensor-core one.
    for dtype in ["f32", "bf16"] {
        let text =
            format!("heads = 4, kv_heads = 2, head_dim = 16, mask = causal, dtype = {dtype}");
        let mut case = Case::new(&text, 40, 40).exact_in_bf16();
        case.q[(40 + 7) * 16 + 3] = f32::NAN;
        case.k[30 * 16 + 5] = f32::NAN;
        let got = case.gpu_forward();
        outputs_match(&format!("{dtype} GPU"), &case.spec, &got, &case.reference());
        // Query 7 of head 1, and every query from 30 on (kv head 0: heads 0 and 1).
        let lse = got.lse.to_f32_vec();
        assert!(lse[40 + 7].is_nan() && lse[30].is_nan() && lse[40 + 39].is_nan());
        assert!(lse[29].is_finite() && lse[2 * 40 + 35].is_finite());
    }
}

#[test]
fn the_gpu_kernels_on_the_interpreter_keep_scores_up_to_f32_max() {
    for dtype in ["f32", "bf16"] {
        for big in ["2.4e38", "3.4028234e38", "-3.4e38"] {
            let text = format!(
                "heads = 2, head_dim = 16, mask = causal, dtype = {dtype}, score_mod = |s, b, \
                 h, q, k| if k == 3 {{ {big} }} else {{ s }}"
            );
            let case = Case::new(&text, 40, 40).exact_in_bf16();
            let what = format!("{dtype}, score {big} at key 3, GPU");
            outputs_match(&what, &case.spec, &case.gpu_forward(), &case.reference());
        }
    }
    // The GPU decode kernel on the interpreter, with split-KV partitions.
    let text = "heads = 2, head_dim = 16, mask = causal, score_mod = |s, b, h, q, k| if k == 3 \
                { 3.0e38 } else { s }";
    let case = Case::new(text, 4, 40);
    let want = case.reference();
    let [q, k, v] = case.tensors();
    let mut cache = PagedCache::new(&case.spec, 16, 4).unwrap();
    let seq = cache.add_sequence();
    let as3 = |t: &Tensor| Tensor::from_f32(&[2, 40, 16], t.to_f32_vec()).unwrap();
    cache.append(seq, &as3(&k), &as3(&v)).unwrap();
    for parts in [1, 3] {
        let options = DecodeOptions {
            partitions: Some(parts),
        };
        let got = support::decode(&GpuSim::new(), &case.spec, &q, &cache, &[seq], options).unwrap();
        let what = format!("GPU decode in {parts} parts");
        same(
            &format!("{what} lse"),
            &got.lse.to_f32_vec(),
            want.lse.data(),
            1e-5,
        );
        same(
            &format!("{what} out"),
            &got.out.to_f32_vec(),
            want.out.data(),
            1e-4,
        );
    }
}

/// The GPU decode kernel on the interpreter, against a paged cache of all keys, in `parts`
/// partitions.
fn gpu_decode(case: &Case, parts: usize) -> Output {
    let [q, _, _] = case.tensors();
    let (cache, seq) = case.cache();
    let options = DecodeOptions {
        partitions: Some(parts),
    };
    support::decode(&GpuSim::new(), &case.spec, &q, &cache, &[seq], options).unwrap()
}

/// A score past `f32::MAX` is +inf and makes its row NaN, out and lse, on every backend: the
/// CPU forward and decode, the GPU forward and decode kernels (split-KV too), as in the
/// reference. The kernels' scaled units keep such a score finite inside, so without the rule
/// their rows came out as lse +inf with a finite out (forward), NaN (CPU decode) or an empty
/// row (GPU decode's merge).
#[test]
fn scores_past_f32_max_make_their_rows_nan_on_every_backend() {
    for dtype in ["f32", "bf16"] {
        let text = format!(
            "heads = 2, head_dim = 16, mask = causal, dtype = {dtype}, score_mod = |s, b, h, \
             q, k| s * 1.0e38 + 3.0e38"
        );
        let case = Case::new(&text, 24, 24).exact_in_bf16();
        let want = case.reference();
        let nan = nan_rows(want.lse.data(), 24);
        assert!(
            !nan.is_empty() && nan.len() < 48,
            "some rows overflow, not all: {nan:?}"
        );
        let mut got = vec![
            ("CPU forward", case.forward()),
            ("GPU forward", case.gpu_forward()),
        ];
        for parts in [1, 3] {
            got.push(("CPU decode", case.decode(parts)));
            got.push(("GPU decode", gpu_decode(&case, parts)));
        }
        for (what, out) in got {
            outputs_match(&format!("{dtype} {what}"), &case.spec, &out, &want);
        }
    }
}

/// A score below `-f32::MAX` is -inf and weighs nothing, as a masked key; a row whose every
/// kept score is -inf is empty (out 0, lse -inf), as a row the masks empty.
#[test]
fn scores_below_minus_f32_max_weigh_nothing() {
    for (modifier, empty) in [
        ("if k == 3 { s * 1.0e38 - 3.0e38 } else { s }", false),
        ("(s - 3.0e38) * 2.0", true),
    ] {
        let text = format!(
            "heads = 2, head_dim = 16, mask = causal, score_mod = |s, b, h, q, k| {modifier}"
        );
        let case = Case::new(&text, 24, 24);
        let want = case.reference();
        if empty {
            assert!(want.lse.data().iter().all(|l| *l == f64::NEG_INFINITY));
        }
        let mut got = vec![
            ("CPU forward", case.forward()),
            ("GPU forward", case.gpu_forward()),
        ];
        for parts in [1, 3] {
            got.push(("CPU decode", case.decode(parts)));
            got.push(("GPU decode", gpu_decode(&case, parts)));
        }
        for (what, out) in got {
            outputs_match(&format!("{modifier}: {what}"), &case.spec, &out, &want);
        }
    }
}

/// Which rows (keys) of a `[1, H, N, width]` gradient hold a NaN.
fn nan_vectors(t: &[f64], width: usize) -> Vec<usize> {
    (0..t.len() / width)
        .filter(|r| t[r * width..(r + 1) * width].iter().any(|x| x.is_nan()))
        .collect()
}

/// NaN scores (a NaN key under a sliding window): the backward gives its rows NaN
/// probabilities and dS at the pairs they keep and exactly 0 at the pairs they mask, so dk and
/// dv are NaN for the keys those rows keep and for no other, on the CPU and on the GPU kernels,
/// as in the reference. (dq of a row that masks the NaN key may also be NaN where a kernel's
/// tile holds the pair: 0 x NaN in dS K.)
#[test]
fn nan_scores_reach_only_the_key_gradients_of_pairs_their_rows_keep() {
    use attn_runtime::HeadsBackward;
    use attn_runtime::backends::open;
    for dtype in ["f32", "bf16"] {
        for (mask, n) in [("sliding_window(8)", 40), ("sliding_window(8)", 130)] {
            let text = format!("heads = 2, head_dim = 16, mask = {mask}, dtype = {dtype}");
            let mut case = Case::new(&text, n, n).exact_in_bf16();
            case.k[20 * 16 + 3] = f32::NAN;
            let [q, k, v] = case.tensors();
            let dout_values: Vec<f32> = values(2 * n * 16, 9)
                .iter()
                .map(|x| (x * 8.0).round() / 8.0)
                .collect();
            let dout =
                Tensor::from_f32_as(case.spec.dtype, &[1, 2, n, 16], dout_values.clone()).unwrap();
            let array = |shape: &[usize], v: &[f32]| {
                Array::from_vec(shape, v.iter().map(|x| f64::from(*x)).collect()).unwrap()
            };
            let (qa, ka, va) = (
                array(&[1, 2, n, 16], &case.q),
                array(&[1, 2, n, 16], &case.k),
                array(&[1, 2, n, 16], &case.v),
            );
            let inputs = Inputs {
                q: &qa,
                k: &ka,
                v: &va,
                position_offset: 0,
            };
            let want =
                reference::backward(&case.spec, &inputs, &array(&[1, 2, n, 16], &dout_values))
                    .unwrap();
            // Rows 20..28 keep key 20 (a window of 8), so keys 13..28 of kv head 0.
            let nan_keys = nan_vectors(want.dk.data(), 16);
            assert_eq!(nan_keys, (13..28).collect::<Vec<_>>());
            assert_eq!(nan_vectors(want.dv.data(), 16), nan_keys);
            let forward = support::forward(&CpuBackend::new(), &case.spec, &q, &k, &v, 0).unwrap();
            let x = HeadsBackward {
                q: &q,
                k: &k,
                v: &v,
                out: &forward.out,
                lse: &forward.lse,
                dout: &dout,
                position_offset: 0,
            };
            for backend in ["cpu", "gpu-sim"] {
                let g = support::backward(&*open(backend).unwrap(), &case.spec, &x).unwrap();
                let f64s = |t: &Tensor| -> Vec<f64> {
                    t.to_f32_vec().iter().map(|x| f64::from(*x)).collect()
                };
                let what = format!("{dtype} {mask} n {n} {backend}");
                assert_eq!(nan_vectors(&f64s(&g.dk), 16), nan_keys, "{what}: dk");
                assert_eq!(nan_vectors(&f64s(&g.dv), 16), nan_keys, "{what}: dv");
                let nan_queries = nan_vectors(&f64s(&g.dq), 16);
                for row in nan_vectors(want.dq.data(), 16) {
                    assert!(nan_queries.contains(&row), "{what}: dq row {row}");
                }
            }
        }
    }
}

/// Scores up to 0.91 of `f32::MAX` from a modifier that multiplies by 3.4e38, with large
/// queries and small keys, in every dtype: finite scores, so finite rows, on the CPU forward
/// and decode and the GPU kernels alike. (The factor was once moved into the queries as they
/// load, where `12 * 6.1e37` overflowed: those rows came out NaN on the CPU.)
#[test]
fn scores_near_f32_max_from_a_modifier_are_finite_rows() {
    for dtype in ["f32", "f16", "bf16"] {
        let text = format!(
            "heads = 2, head_dim = 16, mask = causal, dtype = {dtype}, score_mod = |s, b, h, \
             q, k| s * 3.4e38"
        );
        let mut case = Case::new(&text, 24, 24);
        // Raw scores (q.k / 4) of 3 k: 0.47 to 0.91, every key's its own within 20 (exact in
        // 16 bits).
        for (i, q) in case.q.iter_mut().enumerate() {
            *q = if i % 16 == 0 { 12.0 } else { 0.0 };
        }
        for (i, k) in case.k.iter_mut().enumerate() {
            *k = if i % 16 == 0 {
                (20 + i / 16 % 20) as f32 / 128.0
            } else {
                0.0
            };
        }
        let want = case.reference();
        let largest = want.lse.data().iter().fold(0.0f64, |m, l| m.max(*l)) / f64::from(f32::MAX);
        assert!(
            largest > 0.9 && largest < 1.0,
            "the largest row's lse is {largest} of f32::MAX"
        );
        assert!(nan_rows(want.lse.data(), 24).is_empty());
        let what = format!("{dtype}, scores to {largest:.2} of f32::MAX");
        matches_reference(&case, &what);
        outputs_match(
            &format!("{what}, GPU"),
            &case.spec,
            &case.gpu_forward(),
            &want,
        );
    }
}
