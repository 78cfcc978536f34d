//! Attention against a KV cache: ragged batches (each sequence with its own number of new
//! queries and cached keys), decode and chunked prefill alike, with split-KV.
//!
//! Work items are (sequence, kv head, block of rows), the rows being query heads of the kv
//! head's group times queries, so each key is read once for the whole group. An item's keys are
//! the cache's runs cut into segments of at most `K_TILE` keys, classified by the plan (segments
//! all masked, such as those outside a sliding window, are never read). Items are split into
//! partitions of their segments that run in parallel (flash-decoding); partial outputs are merged
//! by their log-sum-exp.

use super::rope_table::RopeTables;
use super::{Absorption, CpuBackend, Output, check_dtype};
use crate::cache::{CacheLayout, KvCache, SeqId};
use crate::error::RuntimeError;
use crate::tensor::Tensor;
use attn_dsl::AttentionSpec;
use attn_dsl::modifier::interval::{Interval, TileClass};
use codegen::KernelPlan;
use codegen::cpu::abi::{DecodeArgs, Segment, TileCode};
use codegen::cpu::{CpuKernel, Entry};
use codegen::plan::{CallShape, K_TILE, PlanKind};
use rayon::prelude::*;

/// Options of a cached call.
#[derive(Clone, Copy, Debug, Default)]
pub struct DecodeOptions {
    /// Partitions of each item's keys (split-KV); `None` picks enough to keep every thread busy.
    pub partitions: Option<usize>,
}

/// The queries of an MLA decoding step and the weights that absorb them.
#[derive(Clone, Copy, Debug)]
pub struct MlaQueries<'a> {
    /// `[B, heads, q_len, head_dim]`.
    pub q_nope: &'a Tensor,
    /// `[B, heads, q_len, rope_dim]`, before RoPE.
    pub q_pe: &'a Tensor,
    /// `[heads * (head_dim + v_head_dim), latent_rank]`.
    pub w_kv_b: &'a Tensor,
}

/// The rows of one work item.
pub(crate) struct Item {
    /// Position of the sequence in the call.
    pub b: usize,
    /// Cached keys of the sequence.
    pub len: usize,
    /// New queries of the sequence (its last `n` tokens).
    pub n: usize,
    /// First query head, and how many.
    pub h0: usize,
    pub nh: usize,
    /// First query, and how many per head.
    pub i0: usize,
    pub nq: usize,
    pub segments: Vec<Segment>,
}

/// One partition of an item's segments.
pub(crate) struct Task {
    pub item: usize,
    pub segments: std::ops::Range<usize>,
}

/// Queries and outputs of a call, addressed by (sequence, query, head).
pub(crate) struct Layout<'a> {
    /// Queries per sequence.
    pub q_lens: &'a [usize],
    /// Element offset of query `i` of sequence `b`, head `h` (`qk_dim` f32 values).
    pub q_at: &'a (dyn Fn(usize, usize, usize) -> usize + Sync),
    /// Row of the output for (sequence, query, head).
    pub out_row: &'a (dyn Fn(usize, usize, usize) -> usize + Sync),
    pub out_rows: usize,
}

// SAFETY: a Segment holds addresses of cache rows that tasks only read while the cache is
// borrowed by the call.
unsafe impl Send for Item {}
// SAFETY: as above.
unsafe impl Sync for Item {}

impl CpuBackend {
    /// Decoding step(s) against a cache: `q [B, heads, q_len, head_dim]` holds the last `q_len`
    /// tokens of each sequence in `seqs` (their keys and values already appended). Returns out
    /// `[B, heads, q_len, v_head_dim]` and lse `[B, heads, q_len]`, equal to
    /// [`CpuBackend::forward`] over each sequence's cached keys and values.
    pub fn decode(
        &self,
        spec: &AttentionSpec,
        q: &Tensor,
        cache: &impl KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        per_head(spec, q)?;
        let (h, d, dv) = head_dims(spec);
        let [b, hh, n, dd] = match q.shape() {
            [b, hh, n, dd] => [*b, *hh, *n, *dd],
            _ => return Err(shape("q", q, "[B, heads, q_len, head_dim]")),
        };
        if hh != h || dd != d || b != seqs.len() {
            return Err(RuntimeError::Shape {
                tensor: "q".into(),
                found: q.shape().to_vec(),
                expected: format!("[{}, {h}, q_len, {d}] (one row per sequence)", seqs.len()),
            });
        }
        let q_lens = vec![n; b];
        let layout = Layout {
            q_lens: &q_lens,
            q_at: &|s, i, head| ((s * h + head) * n + i) * d,
            out_row: &|s, i, head| (s * h + head) * n + i,
            out_rows: b * h * n,
        };
        let (out, lse) = self.cached(spec, &q.to_f32_vec(), cache, seqs, &layout, options)?;
        super::finish(spec.dtype, [b, h, n, dv], out, lse)
    }

    /// MLA decoding step(s) against a latent cache (filled with `c_kv` and `k_pe`), in the
    /// absorbed form: the queries hold the last `q_len` tokens of each sequence. Returns out `[B, heads, q_len,
    /// v_head_dim]` and lse, equal to [`CpuBackend::forward_mla`] over the cached latents.
    pub fn decode_mla(
        &self,
        spec: &AttentionSpec,
        queries: MlaQueries,
        cache: &impl KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        let a = AbsorbedQueries::of(spec, queries, seqs.len())?;
        let (latent, lse) =
            a.with_layout(|layout| self.cached(spec, &a.q, cache, seqs, layout, options))?;
        a.finish(spec, &latent, lse)
    }

    /// A ragged batch against a cache: `q [tokens, heads, head_dim]` holds, for each sequence
    /// `b` of `seqs`, its last `q_offsets[b + 1] - q_offsets[b]` tokens at rows
    /// `q_offsets[b]..q_offsets[b + 1]` (cumulative offsets, starting at 0). Serves decode and
    /// chunked prefill in one launch. Returns out `[tokens, heads, v_head_dim]` and lse
    /// `[tokens, heads]`.
    pub fn attend_ragged(
        &self,
        spec: &AttentionSpec,
        q: &Tensor,
        q_offsets: &[usize],
        cache: &impl KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        let ragged = Ragged::of(spec, q, q_offsets, seqs.len())?;
        let (out, lse) = ragged.with_layout(|layout| {
            self.cached(spec, &q.to_f32_vec(), cache, seqs, layout, options)
        })?;
        ragged.finish(spec, out, lse)
    }

    /// Checks the cache against the spec and runs the decode kernel on f32 queries of
    /// `qk_dim` values (absorbed ones for MLA).
    fn cached(
        &self,
        spec: &AttentionSpec,
        q: &[f32],
        cache: &impl KvCache,
        seqs: &[SeqId],
        layout: &Layout,
        options: DecodeOptions,
    ) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
        let expected = CacheLayout::of(spec)?;
        if *cache.layout() != expected {
            return Err(RuntimeError::Cache(format!(
                "the cache was made for another spec: it stores {} kv heads of {}+{} {} values, \
                 this spec needs {} of {}+{} {}",
                cache.layout().kv_heads,
                cache.layout().k_dim,
                cache.layout().v_dim,
                cache.layout().dtype.name(),
                expected.kv_heads,
                expected.k_dim,
                expected.v_dim,
                expected.dtype.name()
            )));
        }
        let kernel = self.kernel_of(spec, PlanKind::Decode)?;
        let (max_rows, seg_keys) = (kernel.plan.tiles.q_rows as usize, K_TILE as usize);
        let items = items(&kernel.plan, cache, seqs, layout.q_lens, max_rows, seg_keys)?;
        run(&kernel, cache.layout(), &items, q, layout, options)
    }
}

/// A ragged batch's queries, checked: `q [tokens, heads, head_dim]` with cumulative
/// `q_offsets` per sequence (see `CpuBackend::attend_ragged`).
pub(crate) struct Ragged<'a> {
    q_offsets: &'a [usize],
    q_lens: Vec<usize>,
    tokens: usize,
    h: usize,
    d: usize,
}

impl<'a> Ragged<'a> {
    /// Checks `q` and `q_offsets` against the spec and `seqs` sequences.
    pub fn of(
        spec: &AttentionSpec,
        q: &Tensor,
        q_offsets: &'a [usize],
        seqs: usize,
    ) -> Result<Self, RuntimeError> {
        per_head(spec, q)?;
        let (h, d, _) = head_dims(spec);
        let tokens = match q.shape() {
            [t, hh, dd] if *hh == h && *dd == d => *t,
            _ => return Err(shape("q", q, &format!("[tokens, {h}, {d}]"))),
        };
        let valid = q_offsets.len() == seqs + 1
            && q_offsets.first() == Some(&0)
            && q_offsets.last() == Some(&tokens)
            && q_offsets.windows(2).all(|w| w[0] <= w[1]);
        if !valid {
            return Err(RuntimeError::Data(format!(
                "q_offsets must be {} non-decreasing offsets from 0 to {tokens} (one more than \
                 the sequences), got {q_offsets:?}",
                seqs + 1
            )));
        }
        Ok(Ragged {
            q_offsets,
            q_lens: q_offsets.windows(2).map(|w| w[1] - w[0]).collect(),
            tokens,
            h,
            d,
        })
    }

    /// Calls `f` with where the batch's query rows are and where its output rows go.
    pub fn with_layout<R>(&self, f: impl FnOnce(&Layout) -> R) -> R {
        let (h, d, q_offsets) = (self.h, self.d, self.q_offsets);
        let q_at = move |s: usize, i: usize, head: usize| ((q_offsets[s] + i) * h + head) * d;
        let out_row = move |s: usize, i: usize, head: usize| (q_offsets[s] + i) * h + head;
        f(&Layout {
            q_lens: &self.q_lens,
            q_at: &q_at,
            out_row: &out_row,
            out_rows: self.tokens * h,
        })
    }

    /// `out [tokens, heads, v_head_dim]` (the spec's dtype) and `lse [tokens, heads]`.
    pub fn finish(
        &self,
        spec: &AttentionSpec,
        out: Vec<f32>,
        lse: Vec<f32>,
    ) -> Result<Output, RuntimeError> {
        let (_, _, dv) = head_dims(spec);
        let out = Tensor::from_f32_as(spec.dtype, &[self.tokens, self.h, dv], out)?;
        let lse = Tensor::from_f32(&[self.tokens, self.h], lse)?;
        Ok(Output { out, lse })
    }
}

/// An MLA decode call's queries, checked and absorbed (`[W_uk^T q_nope | q_pe]`, rows of
/// `latent_rank + rope_dim`), for a decode kernel over the latent cache.
pub(crate) struct AbsorbedQueries {
    absorption: Absorption,
    w: Vec<f32>,
    /// The absorbed query rows, `[b, heads, n, latent_rank + rope_dim]`.
    pub q: Vec<f32>,
    /// Sequences.
    pub b: usize,
    /// Queries per sequence.
    pub n: usize,
}

impl AbsorbedQueries {
    /// Checks `queries` against the spec (for `seqs` sequences) and absorbs them.
    pub fn of(
        spec: &AttentionSpec,
        queries: MlaQueries,
        seqs: usize,
    ) -> Result<Self, RuntimeError> {
        let Some(mla) = spec.mla() else {
            return Err(RuntimeError::Spec(
                "this spec has per-head KV: use decode with q".into(),
            ));
        };
        let MlaQueries {
            q_nope,
            q_pe,
            w_kv_b,
        } = queries;
        let (h, dn, dv) = head_dims(spec);
        let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
        let [b, n] = match q_nope.shape() {
            [b, hh, n, d] if *hh == h && *d == dn && *b == seqs => [*b, *n],
            _ => {
                return Err(shape(
                    "q_nope",
                    q_nope,
                    &format!("[{seqs}, {h}, q_len, {dn}] (one row per sequence)"),
                ));
            }
        };
        if q_pe.shape() != [b, h, n, dr] {
            return Err(shape("q_pe", q_pe, &format!("[{b}, {h}, {n}, {dr}]")));
        }
        if w_kv_b.shape() != [h * (dn + dv), r] {
            return Err(shape(
                "w_kv_b",
                w_kv_b,
                &format!(
                    "[{}, {r}] (heads * (head_dim + v_head_dim), latent_rank)",
                    h * (dn + dv)
                ),
            ));
        }
        for (name, t) in [("q_nope", q_nope), ("q_pe", q_pe), ("w_kv_b", w_kv_b)] {
            check_dtype(name, t, spec.dtype)?;
        }
        let w = w_kv_b.to_f32_vec();
        let absorption = Absorption { h, dn, dv, r, dr };
        let q = absorption.queries(&q_nope.to_f32_vec(), &q_pe.to_f32_vec(), &w, b * h, n);
        Ok(AbsorbedQueries {
            absorption,
            w,
            q,
            b,
            n,
        })
    }

    /// Calls `f` with where the call's query rows are and where its output rows go.
    pub fn with_layout<R>(&self, f: impl FnOnce(&Layout) -> R) -> R {
        let (h, n) = (self.absorption.h, self.n);
        let wq = self.absorption.r + self.absorption.dr;
        let q_lens = vec![n; self.b];
        let q_at = move |s: usize, i: usize, head: usize| ((s * h + head) * n + i) * wq;
        let out_row = move |s: usize, i: usize, head: usize| (s * h + head) * n + i;
        f(&Layout {
            q_lens: &q_lens,
            q_at: &q_at,
            out_row: &out_row,
            out_rows: self.b * h * n,
        })
    }

    /// `out = W_uv out_latent` per head, and the output in the spec's dtype.
    pub fn finish(
        &self,
        spec: &AttentionSpec,
        latent: &[f32],
        lse: Vec<f32>,
    ) -> Result<Output, RuntimeError> {
        self.absorption
            .finish(spec, &self.w, latent, lse, self.b, self.n)
    }
}

/// Refuses MLA specs in the per-head entry points.
fn per_head(spec: &AttentionSpec, q: &Tensor) -> Result<(), RuntimeError> {
    if spec.mla().is_some() {
        return Err(RuntimeError::Spec(
            "this is an MLA spec: use decode_mla with q_nope, q_pe and w_kv_b".into(),
        ));
    }
    check_dtype("q", q, spec.dtype)
}

fn head_dims(spec: &AttentionSpec) -> (usize, usize, usize) {
    (
        spec.heads as usize,
        spec.head_dim as usize,
        spec.v_head_dim as usize,
    )
}

fn shape(name: &str, t: &Tensor, expected: &str) -> RuntimeError {
    RuntimeError::Shape {
        tensor: name.into(),
        found: t.shape().to_vec(),
        expected: expected.into(),
    }
}

/// The work items of a call: per sequence and kv head, blocks of at most `max_rows` rows (query
/// heads x queries), with key segments of at most `seg_keys` keys.
pub(crate) fn items(
    plan: &KernelPlan,
    cache: &impl KvCache,
    seqs: &[SeqId],
    q_lens: &[usize],
    max_rows: usize,
    seg_keys: usize,
) -> Result<Vec<Item>, RuntimeError> {
    let (hq, hkv) = (plan.shape.heads as usize, plan.shape.kv_heads as usize);
    let group = hq / hkv;
    let mut items = Vec::new();
    for (b, (&seq, &n)) in seqs.iter().zip(q_lens).enumerate() {
        let len = cache.seq_len(seq)?;
        if n > len {
            return Err(RuntimeError::Cache(format!(
                "sequence {b} has {len} cached tokens but {n} queries: append the keys and \
                 values of the new tokens before attending"
            )));
        }
        if n == 0 {
            continue;
        }
        let nq = n.min(max_rows);
        let nh_max = (max_rows / nq).min(group);
        for g in 0..hkv {
            let runs = cache.runs(seq, g, 0, len)?;
            for h0 in (g * group..(g + 1) * group).step_by(nh_max) {
                let nh = nh_max.min((g + 1) * group - h0);
                for i0 in (0..n).step_by(nq) {
                    let nq = nq.min(n - i0);
                    let call = CallShape {
                        sq: n as i64,
                        skv: len as i64,
                        p0: 0,
                        batch: Interval::point(b as i64),
                        head: Interval::new(h0 as i64, (h0 + nh - 1) as i64),
                    };
                    let rows = Interval::new(i0 as i64, (i0 + nq - 1) as i64);
                    let mut segments = Vec::new();
                    for run in &runs {
                        let size = plan.dtype.size_bytes() as usize;
                        let (k_stride, v_stride) = row_strides(cache.layout());
                        let (k_row, v_row) = (k_stride * size, v_stride * size);
                        for start in (0..run.len).step_by(seg_keys) {
                            let count = (run.len - start).min(seg_keys);
                            let first = run.first + start;
                            let keys = Interval::new(first as i64, (first + count - 1) as i64);
                            let code = match plan.classify_tile(rows, keys, call) {
                                TileClass::AllMasked => continue,
                                TileClass::AllKept => TileCode::Full,
                                TileClass::Mixed => TileCode::Masked,
                            };
                            segments.push(Segment {
                                k: run.k.wrapping_add(start * k_row),
                                v: run.v.wrapping_add(start * v_row),
                                first_key: first as i64,
                                len: count as i64,
                                code: code as i64,
                            });
                        }
                    }
                    items.push(Item {
                        b,
                        len,
                        n,
                        h0,
                        nh,
                        i0,
                        nq,
                        segments,
                    });
                }
            }
        }
    }
    Ok(items)
}

/// Elements between consecutive key rows and value rows inside a run (for MLA the values are
/// the latent part of the key rows).
pub(crate) fn row_strides(layout: &CacheLayout) -> (usize, usize) {
    let v = if layout.values_in_keys {
        layout.k_dim
    } else {
        layout.v_dim
    };
    (layout.k_dim, v)
}

/// Partitions per item: enough tasks for every thread several times over, each with at least
/// four segments (256 keys) so merging stays cheap.
pub(crate) fn partitions(items: &[Item], options: DecodeOptions) -> usize {
    if let Some(p) = options.partitions {
        return p.max(1);
    }
    let threads = rayon::current_num_threads();
    let most = items.iter().map(|i| i.segments.len()).max().unwrap_or(1);
    (4 * threads)
        .div_ceil(items.len().max(1))
        .min(most.div_ceil(4))
        .max(1)
}

fn run(
    kernel: &CpuKernel,
    cache_layout: &CacheLayout,
    items: &[Item],
    q: &[f32],
    layout: &Layout,
    options: DecodeOptions,
) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
    let Entry::Decode { decode } = kernel.entry else {
        return Err(RuntimeError::Spec(
            "a forward kernel cannot run a decode call".into(),
        ));
    };
    // SAFETY: `decode` was compiled by codegen::cpu with the signature
    // `extern "C" fn(*const DecodeArgs)`; the address stays valid for the process.
    let decode =
        unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*const DecodeArgs)>(decode) };
    let plan = &kernel.plan;
    let (dqk, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    let (k_stride, v_stride) = row_strides(cache_layout);
    let tasks = tasks(items, partitions(items, options));

    let results: Vec<(Vec<f32>, Vec<f32>)> = tasks
        .par_iter()
        .map_init(
            || vec![0f32; kernel.scratch.total],
            |scratch, task| {
                let item = &items[task.item];
                let rows = item.nh * item.nq;
                // Query rows of the item, head-major, as f32.
                let mut q_rows = Vec::with_capacity(rows * dqk);
                for h in item.h0..item.h0 + item.nh {
                    for i in item.i0..item.i0 + item.nq {
                        let at = (layout.q_at)(item.b, i, h);
                        q_rows.extend_from_slice(&q[at..at + dqk]);
                    }
                }
                let q_pos0 = (item.len - item.n + item.i0) as i64;
                let tables = plan
                    .rope
                    .as_ref()
                    .map(|r| RopeTables::new(r, q_pos0, q_pos0 + item.nq as i64, item.len as u64));
                let (cos, sin, table_pos0) = match &tables {
                    Some(t) => (t.cos.as_ptr(), t.sin.as_ptr(), t.pos0),
                    None => (std::ptr::null(), std::ptr::null(), 0),
                };
                let mut out = vec![0f32; rows * dv];
                let mut lse = vec![0f32; rows];
                let segments = &item.segments[task.segments.clone()];
                let args = DecodeArgs {
                    q: q_rows.as_ptr(),
                    q_row_stride: dqk as i64,
                    rows: rows as i64,
                    q_len: item.nq as i64,
                    q_pos0,
                    qi0: item.i0 as i64,
                    batch: item.b as i64,
                    head0: item.h0 as i64,
                    segments: segments.as_ptr(),
                    n_segments: segments.len() as i64,
                    k_row_stride: k_stride as i64,
                    v_row_stride: v_stride as i64,
                    out: out.as_mut_ptr(),
                    out_row_stride: dv as i64,
                    lse: lse.as_mut_ptr(),
                    scratch: scratch.as_mut_ptr(),
                    rope_cos: cos,
                    rope_sin: sin,
                    table_pos0,
                };
                // SAFETY: `rows` query rows of `dqk` values; segments whose rows lie in the
                // cache, borrowed for the call; `rows` output rows and lse values; a scratch of
                // `ScratchLayout::total` values; RoPE tables covering the queries' positions.
                unsafe { decode(&args) };
                (out, lse)
            },
        )
        .collect();

    Ok(merge(items, &tasks, &results, layout, dv))
}

/// Each item split into `parts` partitions of its segments (at least one, even when empty).
pub(crate) fn tasks(items: &[Item], parts: usize) -> Vec<Task> {
    items
        .iter()
        .enumerate()
        .flat_map(|(i, item)| {
            let n = item.segments.len();
            let per = n.div_ceil(parts).max(1);
            (0..parts.min(n.max(1))).map(move |p| Task {
                item: i,
                segments: (p * per).min(n)..((p + 1) * per).min(n),
            })
        })
        .collect()
}

/// Merges the partitions of each item (`results` per task: out rows of `dv` and lse) by their
/// lse, and scatters rows to the call's layout. Rows with no kept key stay 0 with lse `-inf`.
pub(crate) fn merge(
    items: &[Item],
    tasks: &[Task],
    results: &[(Vec<f32>, Vec<f32>)],
    layout: &Layout,
    dv: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0f32; layout.out_rows * dv];
    let mut lse = vec![f32::NEG_INFINITY; layout.out_rows];
    let mut t = 0;
    while t < tasks.len() {
        let item = &items[tasks[t].item];
        let end = (t..tasks.len())
            .find(|&u| tasks[u].item != tasks[t].item)
            .unwrap_or(tasks.len());
        let parts = &results[t..end];
        for (r, (h, i)) in (item.h0..item.h0 + item.nh)
            .flat_map(|h| (item.i0..item.i0 + item.nq).map(move |i| (h, i)))
            .enumerate()
        {
            let m = parts
                .iter()
                .map(|(_, l)| l[r])
                .fold(f32::NEG_INFINITY, f32::max);
            let row = (layout.out_row)(item.b, i, h);
            let dst = &mut out[row * dv..(row + 1) * dv];
            // A NaN part makes the row NaN (f32::max above passes over it).
            if parts.iter().any(|(_, l)| l[r].is_nan()) {
                dst.fill(f32::NAN);
                lse[row] = f32::NAN;
                continue;
            }
            if m == f32::NEG_INFINITY {
                continue;
            }
            let mut total = 0f32;
            for (o, l) in parts {
                let w = (l[r] - m).exp();
                total += w;
                for (d, x) in dst.iter_mut().zip(&o[r * dv..(r + 1) * dv]) {
                    *d += w * x;
                }
            }
            for d in dst.iter_mut() {
                *d /= total;
            }
            lse[row] = m + total.ln();
        }
        t = end;
    }
    (out, lse)
}
