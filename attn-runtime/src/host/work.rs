//! The work of a cached call, for every backend: items (sequence, kv head, block of rows, the
//! rows being query heads of the kv head's group times queries, so each key is read once for the
//! whole group) whose keys are the cache's runs cut into segments classified by the plan
//! (segments all masked are never read); partitions of each item's segments (split-KV); and the
//! merge of the partitions' outputs by their log-sum-exp.

use super::ragged::Layout;
use crate::cache::{CacheLayout, KvCache, SeqId};
use crate::calls::DecodeOptions;
use crate::error::RuntimeError;
use attn_dsl::modifier::interval::Interval;
use codegen::KernelPlan;
use codegen::plan::{CallShape, TileCode};

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
    pub segments: Vec<KeySegment>,
}

/// One segment of an item's keys, as every backend reads it: where its key and value rows
/// start (host addresses into the cache's memory, borrowed for the call), the index of its
/// first key, its length (1 to the plan's segment keys) and its tile code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeySegment {
    pub k: usize,
    pub v: usize,
    pub first_key: i64,
    pub len: i64,
    pub code: TileCode,
}

/// One partition of an item's segments.
pub(crate) struct Task {
    pub item: usize,
    pub segments: std::ops::Range<usize>,
}

/// A work item's rows before its keys are cut: sequence `b` (of `len` cached keys, the last
/// `n` of them new), kv head `g`, query heads `h0..h0 + nh`, queries `i0..i0 + nq`.
pub(crate) struct Block {
    pub b: usize,
    pub len: usize,
    pub n: usize,
    pub g: usize,
    pub h0: usize,
    pub nh: usize,
    pub i0: usize,
    pub nq: usize,
}

impl Block {
    /// The call as the plan's tile classification sees this block.
    pub fn call(&self) -> CallShape<'static> {
        CallShape {
            sq: self.n as i64,
            skv: self.len as i64,
            p0: 0,
            query_shift: 0,
            batch: Interval::point(self.b as i64),
            head: Interval::new(self.h0 as i64, (self.h0 + self.nh - 1) as i64),
            data: None,
        }
    }

    /// The work item of this block's rows and these segments.
    pub fn item(&self, segments: Vec<KeySegment>) -> Item {
        Item {
            b: self.b,
            len: self.len,
            n: self.n,
            h0: self.h0,
            nh: self.nh,
            i0: self.i0,
            nq: self.nq,
            segments,
        }
    }

    /// The block's query rows, as the classification sees them.
    pub fn rows(&self) -> Interval {
        Interval::new(self.i0 as i64, (self.i0 + self.nq - 1) as i64)
    }
}

/// The row blocks of a call: per sequence and kv head, blocks of at most `max_rows` rows (query
/// heads x queries; each key is then read once for the block).
pub(crate) fn blocks(
    plan: &KernelPlan,
    cache: &dyn KvCache,
    seqs: &[SeqId],
    q_lens: &[usize],
    max_rows: usize,
) -> Result<Vec<Block>, RuntimeError> {
    let (hq, hkv) = (plan.shape.heads as usize, plan.shape.kv_heads as usize);
    let group = hq / hkv;
    let mut blocks = Vec::new();
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
        let nq_max = n.min(max_rows);
        let nh_max = (max_rows / nq_max).min(group);
        for g in 0..hkv {
            for h0 in (g * group..(g + 1) * group).step_by(nh_max) {
                let nh = nh_max.min((g + 1) * group - h0);
                for i0 in (0..n).step_by(nq_max) {
                    let nq = nq_max.min(n - i0);
                    blocks.push(Block {
                        b,
                        len,
                        n,
                        g,
                        h0,
                        nh,
                        i0,
                        nq,
                    });
                }
            }
        }
    }
    Ok(blocks)
}

/// The work items of a call: its row [`blocks`], with key segments of at most `seg_keys` keys
/// cut from the cache's runs.
pub(crate) fn items(
    plan: &KernelPlan,
    cache: &dyn KvCache,
    seqs: &[SeqId],
    q_lens: &[usize],
    max_rows: usize,
    seg_keys: usize,
) -> Result<Vec<Item>, RuntimeError> {
    let size = plan.dtype.size_bytes() as usize;
    let (k_stride, v_stride) = row_strides(cache.layout());
    let (k_row, v_row) = (k_stride * size, v_stride * size);
    let mut items = Vec::new();
    for block in blocks(plan, cache, seqs, q_lens, max_rows)? {
        let runs = cache.runs(seqs[block.b], block.g, 0, block.len)?;
        let (rows, call) = (block.rows(), block.call());
        let mut segments = Vec::new();
        for run in &runs {
            let codes = segment_codes(plan, rows, call, run.first, run.len, seg_keys);
            for (start, code) in (0..run.len).step_by(seg_keys).zip(codes) {
                if code == TileCode::Skip {
                    continue;
                }
                segments.push(KeySegment {
                    k: (run.k as usize).wrapping_add(start * k_row),
                    v: (run.v as usize).wrapping_add(start * v_row),
                    first_key: (run.first + start) as i64,
                    len: (run.len - start).min(seg_keys) as i64,
                    code,
                });
            }
        }
        items.push(block.item(segments));
    }
    Ok(items)
}

/// The tile codes of the segments of keys `first..first + count` cut every `seg_keys` keys
/// (each bounded by its length, as the decode kernels bound them), found by bisection: a range
/// of segments the plan classifies as a whole as skipped or full is so in every part, so a
/// causal or windowed row block takes a few classifications rather than one per segment (at
/// most twice as many where every segment is masked).
pub(crate) fn segment_codes(
    plan: &KernelPlan,
    rows: Interval,
    call: CallShape,
    first: usize,
    count: usize,
    seg_keys: usize,
) -> Vec<TileCode> {
    let n = count.div_ceil(seg_keys.max(1));
    let mut codes = vec![TileCode::Skip; n];
    let keys = |a: usize, b: usize| {
        Interval::new(
            (first + a * seg_keys) as i64,
            (first + (b * seg_keys).min(count)) as i64 - 1,
        )
    };
    // Ranges of segment indices still to classify; the stack holds at most two per level.
    let mut ranges = vec![(0, n)];
    while let Some((a, b)) = ranges.pop() {
        if a == b {
            continue;
        }
        let code = plan.tile_code(rows, keys(a, b), call, true);
        if code != TileCode::Masked || b - a == 1 {
            codes[a..b].fill(code);
        } else {
            let mid = a + (b - a) / 2;
            ranges.extend([(a, mid), (mid, b)]);
        }
    }
    codes
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

/// Tasks a GPU decode launch aims for: four per SM of a 132-SM GPU (H100, H200), so a launch
/// is at least two waves even when each SM holds two of its CTAs.
pub(crate) const GPU_TASKS: usize = 4 * 132;

/// Partitions per item (of `counts[i]` segments): about `target` tasks in all (the CPU: every thread several times over;
/// a GPU: several waves of its SMs), each with at least four segments so merging stays cheap.
pub(crate) fn partitions(counts: &[usize], options: DecodeOptions, target: usize) -> usize {
    if let Some(p) = options.partitions {
        return p.max(1);
    }
    let most = counts.iter().copied().max().unwrap_or(1);
    target
        .div_ceil(counts.len().max(1))
        .min(most.div_ceil(4))
        .max(1)
}

/// Each item (of `counts[i]` segments) split into `parts` partitions of its segments (at least
/// one, even when empty).
pub(crate) fn tasks(counts: &[usize], parts: usize) -> Vec<Task> {
    counts
        .iter()
        .enumerate()
        .flat_map(|(i, &n)| {
            let per = n.div_ceil(parts).max(1);
            (0..parts.min(n.max(1))).map(move |p| Task {
                item: i,
                segments: (p * per).min(n)..((p + 1) * per).min(n),
            })
        })
        .collect()
}

/// Merges the partitions of each item (`results` per task: out rows of `dv` and lse) by their
/// lse, and scatters rows to the call's layout. Rows with no kept key stay 0 with lse `-inf`;
/// a NaN or +inf part makes its row NaN. `sums`: the parts are sums of independently weighted
/// values (`normalize = sigmoid`), so the row is their sum (lse still their log-sum-exp).
pub(crate) fn merge(
    items: &[Item],
    tasks: &[Task],
    results: &[(Vec<f32>, Vec<f32>)],
    layout: &Layout,
    dv: usize,
    sums: bool,
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
            // A NaN part makes the row NaN (f32::max above passes over it), and so does a +inf
            // one: a score past f32::MAX (docs/semantics.md, "At the edges").
            if parts
                .iter()
                .any(|(_, l)| l[r].is_nan() || l[r] == f32::INFINITY)
            {
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
                let w = if sums { 1.0 } else { w };
                for (d, x) in dst.iter_mut().zip(&o[r * dv..(r + 1) * dv]) {
                    *d += w * x;
                }
            }
            if !sums {
                for d in dst.iter_mut() {
                    *d /= total;
                }
            }
            lse[row] = m + total.ln();
        }
        t = end;
    }
    (out, lse)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bisection gives every segment the code a classification of that segment alone gives
    /// (interval analysis only narrows on narrower keys), for masks that leave whole ranges
    /// full or skipped and for one that masks inside every segment.
    #[test]
    fn segment_codes_by_bisection_equal_one_classification_per_segment() {
        for text in [
            "heads = 4, kv_heads = 2, head_dim = 16, mask = causal",
            "heads = 4, head_dim = 16, mask = sliding_window(100)",
            "heads = 2, head_dim = 16, mask = causal, position = alibi, softcap = 5.0",
            "heads = 2, head_dim = 16, mask_mod = |b, h, q, k| (k + b + h) % 3 != 0",
            "heads = 2, head_dim = 16, mask_mod = |b, h, q, k| k < 40 || k > 300",
        ] {
            let spec: attn_dsl::AttentionSpec = text.parse().unwrap();
            let plan = KernelPlan::decode(&spec);
            for (len, n, first, count, seg_keys) in [
                (1000, 1, 0, 1000, 16),
                (1000, 4, 100, 517, 32),
                (37, 3, 0, 37, 16),
            ] {
                let call = CallShape {
                    sq: n,
                    skv: len,
                    p0: 0,
                    query_shift: 0,
                    batch: Interval::point(0),
                    head: Interval::new(0, 1),
                    data: None,
                };
                let rows = Interval::new(0, n - 1);
                let got = segment_codes(&plan, rows, call, first, count, seg_keys);
                let want: Vec<TileCode> = (0..count)
                    .step_by(seg_keys)
                    .map(|start| {
                        let last = (start + seg_keys).min(count) - 1;
                        let keys = Interval::new((first + start) as i64, (first + last) as i64);
                        plan.tile_code(rows, keys, call, true)
                    })
                    .collect();
                assert_eq!(got, want, "{text}, keys {first}..{}", first + count);
            }
        }
    }
}
