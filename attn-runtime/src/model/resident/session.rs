//! Incremental decoding against caches resident on the device: a session per sequence, each
//! layer's cache in its attention kind's layout, the decode kernel over it, partitions merged
//! on the device, and generation that brings back only the chosen ids.

use super::{DeviceAttention, DeviceLayer, MlaDims, ResidentModel, blocks, half_of, width_u32};
use crate::device::{Device, DeviceBuffer, Scratch, f32_bytes, f32s};
use crate::error::RuntimeError;
use crate::host::rope_table::{RopeTables, Side};
use codegen::gpu::ir::Kernel;
use codegen::gpu::kernels::layers;
use codegen::gpu::verified;
use std::sync::Arc;

/// A layer's KV cache on the device: keys and values head-major, `[kv_heads, capacity, dim]`,
/// in the spec's dtype, keys rotated as they were appended. MLA's values are the latent part
/// of its key rows, not stored again (`v` is `None`).
struct LayerCache {
    k: DeviceBuffer,
    v: Option<DeviceBuffer>,
}

impl LayerCache {
    fn free(self, device: &dyn Device) {
        device.free(self.k);
        if let Some(v) = self.v {
            device.free(v);
        }
    }
}

/// One attention kind's kernels of incremental steps.
struct KindStep {
    append_k: Arc<Kernel>,
    append_v: Arc<Kernel>,
    decode: Arc<Kernel>,
}

/// Kernels of incremental steps.
struct StepKernels {
    kinds: Vec<KindStep>,
    merge: Arc<Kernel>,
    argmax: Arc<Kernel>,
}

/// One sequence decoded step by step against caches resident on the device. Each step uploads
/// its token ids and the launch tables (task and segment records, RoPE rows, the merge map) and
/// brings back only the logits, or only the chosen token.
pub struct DeviceSession<'s, 'm> {
    model: &'s ResidentModel<'m>,
    caches: Vec<LayerCache>,
    capacity: usize,
    len: usize,
    kernels: StepKernels,
}

impl Drop for DeviceSession<'_, '_> {
    fn drop(&mut self) {
        for c in self.caches.drain(..) {
            c.free(self.model.device.as_ref());
        }
    }
}

impl<'m> ResidentModel<'m> {
    /// A session for one sequence of at most `capacity` tokens, its caches on the device.
    pub fn session(&self, capacity: usize) -> Result<DeviceSession<'_, 'm>, RuntimeError> {
        let kernel = |k: Kernel| verified(k).map(Arc::new);
        let mut kinds = Vec::new();
        for variant in self.model.variants() {
            let layout = variant.cache_layout();
            let half = half_of(layout.dtype);
            if half.is_some() && !(layout.k_dim.is_multiple_of(2) && layout.v_dim.is_multiple_of(2))
            {
                return Err(RuntimeError::Spec(
                    "16-bit device caches need even head dims".into(),
                ));
            }
            let rope = layout.rope.as_ref().map(|r| layers::AppendRope {
                dim: r.rope.dim,
                first_dim: r.first_dim,
                layout: r.rope.layout,
            });
            kinds.push(KindStep {
                append_k: kernel(layers::cache_append(width_u32(layout.k_dim)?, half, rope))?,
                append_v: kernel(layers::cache_append(width_u32(layout.v_dim)?, half, None))?,
                decode: variant.gpu_decode()?,
            });
        }
        let kernels = StepKernels {
            kinds,
            merge: kernel(layers::merge_partitions())?,
            argmax: kernel(layers::argmax(width_u32(self.model.config.vocab)?))?,
        };
        // Every kernel is ready before any cache is allocated: a failure below frees what was.
        let mut caches: Vec<LayerCache> = Vec::with_capacity(self.layers.len());
        let free = |caches: &mut Vec<LayerCache>| {
            for c in caches.drain(..) {
                c.free(self.device.as_ref());
            }
        };
        for layer in &self.layers {
            let layout = self.model.variants()[layer.kind].cache_layout();
            let size = layout.dtype.size_bytes() as usize;
            let bytes = |dim: usize| {
                layout
                    .kv_heads
                    .checked_mul(capacity)
                    .and_then(|v| v.checked_mul(dim))
                    .and_then(|v| v.checked_mul(size))
                    .ok_or_else(|| {
                        RuntimeError::Data(format!("a cache of {capacity} tokens overflows"))
                    })
            };
            let k = match bytes(layout.k_dim).and_then(|b| self.device.zeros(b)) {
                Ok(k) => k,
                Err(e) => {
                    free(&mut caches);
                    return Err(e);
                }
            };
            let v = match layout.values_in_keys {
                true => Ok(None),
                false => bytes(layout.v_dim)
                    .and_then(|b| self.device.zeros(b))
                    .map(Some),
            };
            let v = match v {
                Ok(v) => v,
                Err(e) => {
                    self.device.free(k);
                    free(&mut caches);
                    return Err(e);
                }
            };
            caches.push(LayerCache { k, v });
        }
        Ok(DeviceSession {
            model: self,
            caches,
            capacity,
            len: 0,
            kernels,
        })
    }
}

impl DeviceSession<'_, '_> {
    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets the tokens past the first `len` (a rejected draft, say); later steps write over
    /// their slots.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Appends `tokens` and returns their logits `[tokens, vocab]`.
    pub fn step(&mut self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        let mut s = Scratch::new(self.model.device.as_ref());
        let logits = self.run(&mut s, tokens)?;
        Ok(f32s(&self.model.device.download(logits)?))
    }

    /// Appends `tokens` and returns the logits of the last one (`[vocab]`: the only row
    /// brought back).
    pub fn step_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        let m = self.model;
        let mut s = Scratch::new(m.device.as_ref());
        let logits = self.run(&mut s, tokens)?;
        let vocab = m.model.config.vocab;
        let last = DeviceBuffer {
            addr: logits.addr + (4 * vocab * (tokens.len() - 1)) as i64,
            bytes: 4 * vocab,
        };
        Ok(f32s(&m.device.download(last)?))
    }

    /// Appends `tokens` and returns the greedy next token, chosen on the device: only its id
    /// comes back.
    pub fn step_greedy(&mut self, tokens: &[u32]) -> Result<u32, RuntimeError> {
        let m = self.model;
        let mut s = Scratch::new(m.device.as_ref());
        let logits = self.run(&mut s, tokens)?;
        let vocab = m.model.config.vocab;
        let last = DeviceBuffer {
            addr: logits.addr + (4 * vocab * (tokens.len() - 1)) as i64,
            bytes: 4 * vocab,
        };
        let out = s.zeros(4)?;
        m.launch(
            &self.kernels.argmax,
            [1, 1, 1],
            &layers::ArgmaxArgs {
                x: last.addr,
                out: out.addr,
            },
        )?;
        let id = m.device.download(out)?;
        let id = u32::from_le_bytes([id[0], id[1], id[2], id[3]]);
        if id == crate::ops::NO_CHOICE {
            return Err(RuntimeError::Data(
                "the model's logits hold no number (NaN throughout): its weights or the prompt \
                 make values that are not finite, so no token is chosen from them"
                    .into(),
            ));
        }
        Ok(id)
    }

    /// The forward pass of `tokens` at positions `len..`, appending their keys and values;
    /// the logits buffer.
    fn run(&mut self, s: &mut Scratch, tokens: &[u32]) -> Result<DeviceBuffer, RuntimeError> {
        let n = tokens.len();
        if n == 0 {
            return Err(RuntimeError::Data("a step needs at least one token".into()));
        }
        if self.len + n > self.capacity {
            return Err(RuntimeError::Cache(format!(
                "the session holds {} tokens: {} more do not fit",
                self.capacity, n
            )));
        }
        self.model.check_sim_cost(n, self.len + n)?;
        let session = &*self;
        let tables = (0..self.kernels.kinds.len())
            .map(|kind| session.tables(s, n, kind))
            .collect::<Result<Vec<_>, _>>()?;
        let logits = self.model.run_layers(s, tokens, &mut |s, i, layer, h| {
            let t = &tables[layer.kind];
            session.attention(s, t, layer, &session.caches[i], h, n)
        })?;
        self.len += n;
        Ok(logits)
    }

    /// The launch tables of a step of `n` new tokens, the same for every layer of attention
    /// kind `kind`: work items of
    /// the plan's row blocks, their segments of the cache (as offsets into a layer's cache)
    /// classified by the plan, partitions, the query-row gather and the merge map, and the
    /// RoPE rows of the new positions; all uploaded once per step.
    fn tables(&self, s: &mut Scratch, n: usize, kind: usize) -> Result<StepTables, RuntimeError> {
        use crate::host::work::{Item, segment_codes};
        use attn_dsl::modifier::interval::Interval;
        use codegen::gpu::kernels::decode::{SEGMENT_FIELDS, TASK_FIELDS, segment_keys, task_rows};
        use codegen::plan::{CallShape, TileCode};
        let variant = &self.model.model.variants()[kind];
        let (spec, layout, plan) = (
            variant.spec(),
            variant.cache_layout(),
            variant.decode_plan(),
        );
        let (heads, kv_heads) = (spec.heads as usize, layout.kv_heads);
        // MLA's values are the latent part of its key rows: a value row starts where its key
        // row does, a key row apart.
        let (dim, v_stride) = crate::host::work::row_strides(layout);
        let size = layout.dtype.size_bytes() as usize;
        let group = heads / kv_heads;
        let (pos0, total) = (self.len, self.len + n);
        let (max_rows, seg_keys) = (task_rows(plan) as usize, segment_keys(plan) as usize);
        let nq_max = n.min(max_rows);
        let nh_max = (max_rows / nq_max).clamp(1, group);
        let mut items = Vec::new();
        for g in 0..kv_heads {
            for h0 in (g * group..(g + 1) * group).step_by(nh_max) {
                let nh = nh_max.min((g + 1) * group - h0);
                for i0 in (0..n).step_by(nq_max) {
                    let nq = nq_max.min(n - i0);
                    let call = CallShape {
                        sq: n as i64,
                        skv: total as i64,
                        p0: 0,
                        query_shift: 0,
                        batch: Interval::point(0),
                        head: Interval::new(h0 as i64, (h0 + nh - 1) as i64),
                        data: None,
                    };
                    let rows = Interval::new(i0 as i64, (i0 + nq - 1) as i64);
                    let mut segments = Vec::new();
                    let codes = segment_codes(plan, rows, call, 0, total, seg_keys);
                    for (first, code) in (0..total).step_by(seg_keys).zip(codes) {
                        let count = seg_keys.min(total - first);
                        if code != TileCode::Skip {
                            let row = (g * self.capacity + first) as i64;
                            segments.push(SegmentAt {
                                k: row * (dim * size) as i64,
                                v: row * (v_stride * size) as i64,
                                first: first as i64,
                                len: count as i64,
                                code: code as i64,
                            });
                        }
                    }
                    items.push((
                        Item {
                            b: 0,
                            len: total,
                            n,
                            h0,
                            nh,
                            i0,
                            nq,
                            segments: Vec::new(),
                        },
                        segments,
                    ));
                }
            }
        }
        // Partitions: enough CTAs to fill the device, at least four segments each. A
        // stick-breaking row weighs each key by every nearer one: its keys stay in one.
        let most = items.iter().map(|(_, s)| s.len()).max().unwrap_or(1);
        let parts = match plan.stick_breaking() {
            true => 1,
            false => crate::host::work::GPU_TASKS
                .div_ceil(items.len().max(1))
                .min(most.div_ceil(4))
                .max(1),
        };
        let mut t = StepTables::default();
        let mut index = Vec::new();
        let mut parts_of: Vec<Vec<i32>> = vec![Vec::new(); n * heads];
        for (item, segs) in &items {
            let per = segs.len().div_ceil(parts).max(1);
            for p in 0..parts.min(segs.len().max(1)) {
                let range = (p * per).min(segs.len())..((p + 1) * per).min(segs.len());
                let row0 = index.len();
                // Query rows head-major: (head, query) takes row query * heads + head of q, and
                // its partial output row feeds output row (query, head).
                for head in item.h0..item.h0 + item.nh {
                    for q_i in item.i0..item.i0 + item.nq {
                        parts_of[q_i * heads + head].push(index.len() as i32);
                        index.push((q_i * heads + head) as i32);
                    }
                }
                t.task_records.extend([
                    row0 as i64,
                    (item.nh * item.nq) as i64,
                    item.nq as i64,
                    (item.len - item.n + item.i0) as i64,
                    item.i0 as i64,
                    0,
                    item.h0 as i64,
                    (t.segments.len() / SEGMENT_FIELDS) as i64,
                    range.len() as i64,
                ]);
                for g in &segs[range] {
                    t.segments.extend([
                        g.k,
                        g.v,
                        g.first,
                        g.len,
                        g.code,
                        dim as i64,
                        v_stride as i64,
                    ]);
                }
            }
        }
        debug_assert_eq!(t.task_records.len() % TASK_FIELDS, 0);
        t.tasks = t.task_records.len() / TASK_FIELDS;
        t.rows = index.len();
        t.slots = parts_of.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let map: Vec<i32> = parts_of
            .iter()
            .flat_map(|p| p.iter().copied().chain(std::iter::repeat(-1)).take(t.slots))
            .collect();
        let i32_bytes = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        t.index = s.upload(&i32_bytes(&index))?.addr;
        t.map = s.upload(&i32_bytes(&map))?.addr;
        t.tasks_buffer = s.upload(&i64_bytes(&t.task_records))?.addr;
        if !t.segments.is_empty() {
            t.segments_buffer = s.upload(&i64_bytes(&t.segments))?.addr;
        }
        // Keys are rotated for their positions as they are appended, and the queries of the
        // same positions by the decode kernel: one table serves both. Frequencies that depend
        // on the length (dynamic NTK, LongRoPE) are those of the sequence's length after the
        // step, as transformers rotates each step; earlier keys keep their rotation.
        if let Some(r) = &layout.rope {
            let rope = RopeTables::new(r, pos0 as i64, total as i64, total as u64, Side::Query, 0);
            t.rope_cos = s.upload(&f32_bytes(&rope.cos))?.addr;
            t.rope_sin = s.upload(&f32_bytes(&rope.sin))?.addr;
        }
        t.pos0 = pos0;
        Ok(t)
    }

    /// Appends the new tokens' keys and values to the layer's cache, then attends over the
    /// cache with the decode kernel on the step's tables and merges partitions on the device.
    /// MLA appends `[c_kv | k_pe]` rows, attends with absorbed queries and expands the latent
    /// outputs by `W_uv`.
    fn attention(
        &self,
        s: &mut Scratch,
        t: &StepTables,
        layer: &DeviceLayer,
        cache: &LayerCache,
        h: DeviceBuffer,
        n: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let m = self.model;
        let spec = m.model.variants()[layer.kind].spec();
        match &layer.attn {
            DeviceAttention::Heads(a) => {
                let [q, k, v] = m.qkv(s, a, h, n)?;
                self.append(t, layer.kind, true, [k, cache.k], n)?;
                if let Some(v_cache) = cache.v {
                    self.append(t, layer.kind, false, [v, v_cache], n)?;
                }
                let (rows, rows_lse) =
                    self.decode(s, t, layer.kind, cache, q, n, a.learned.params)?;
                let (heads, v_dim) = (spec.heads as usize, spec.v_head_dim as usize);
                // Rows token-major: row `i * heads + h` is head `h`'s.
                m.sinks(&a.learned, rows, rows_lse, [n * heads, v_dim], 1, heads)?;
                m.linear(s, &a.o, rows, n)
            }
            DeviceAttention::Mla(mla) => {
                let x = MlaDims::of(spec)?;
                let [qs, k, _] = m.mla_rows(s, mla, x, h, n)?;
                self.append(t, layer.kind, true, [k, cache.k], n)?;
                let q = m.mla_queries(s, mla, x, qs, n, false)?;
                let (rows, _) = self.decode(s, t, layer.kind, cache, q, n, 0)?;
                // Token-major latent rows to head-major for the per-head `W_uv`.
                let latent = m.swap(s, &m.kernels.from_heads, rows, [n, x.heads, x.r], 4)?;
                let rows = m.mla_outputs(s, mla, x, latent, n)?;
                m.linear(s, &mla.o, rows, n)
            }
        }
    }

    /// Appends `n` rows (`[n, kv_heads, width]` f32) to a layer's key cache (`keys`: rotated
    /// for their positions) or value cache.
    fn append(
        &self,
        t: &StepTables,
        kind: usize,
        keys: bool,
        [rows, cache]: [DeviceBuffer; 2],
        n: usize,
    ) -> Result<(), RuntimeError> {
        let layout = self.model.model.variants()[kind].cache_layout();
        let kernels = &self.kernels.kinds[kind];
        let (kernel, width) = match keys {
            true => (&kernels.append_k, layout.k_dim),
            false => (&kernels.append_v, layout.v_dim),
        };
        let per = if half_of(layout.dtype).is_some() {
            2
        } else {
            1
        };
        self.model.launch(
            kernel,
            blocks(n * layout.kv_heads * width / per)?,
            &layers::AppendArgs {
                rows: rows.addr,
                cache: cache.addr,
                tokens: n as i64,
                kv_heads: layout.kv_heads as i64,
                capacity: self.capacity as i64,
                pos0: t.pos0 as i64,
                rope_cos: t.rope_cos,
                rope_sin: t.rope_sin,
            },
        )
    }

    /// The decode kernel over a layer's cache for `n` new tokens' queries `q` (`[n, heads,
    /// k_dim]` f32), partitions merged: the output rows `[n, heads, v_dim]` and their
    /// log-sum-exps.
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &self,
        s: &mut Scratch,
        t: &StepTables,
        kind: usize,
        cache: &LayerCache,
        q: DeviceBuffer,
        n: usize,
        params: i64,
    ) -> Result<(DeviceBuffer, DeviceBuffer), RuntimeError> {
        use codegen::gpu::launch::DecodeArgs;
        let m = self.model;
        let variant = &m.model.variants()[kind];
        let layout = variant.cache_layout();
        let heads = variant.spec().heads as usize;
        let (dim, v_dim) = (layout.k_dim, layout.v_dim);
        let q_rows = s.f32s(t.rows * dim)?;
        m.launch(
            &m.kernels.gather,
            blocks(t.rows * dim)?,
            &layers::GatherArgs {
                x: q.addr,
                index: t.index,
                out: q_rows.addr,
                rows: t.rows as i64,
                width: dim as i64,
            },
        )?;
        let (out, lse) = (s.f32s(t.rows * v_dim)?, s.f32s(t.rows)?);
        let ctas = u32::try_from(t.tasks)
            .map_err(|_| RuntimeError::Data("more tasks than a grid holds".into()))?;
        m.launch(
            &self.kernels.kinds[kind].decode,
            [ctas, 1, 1],
            &DecodeArgs {
                q_rows: q_rows.addr,
                tasks: t.tasks_buffer,
                // The step's records hold offsets from a layer's cache.
                segments: t.segments_buffer,
                out: out.addr,
                lse: lse.addr,
                rope_cos: t.rope_cos,
                rope_sin: t.rope_sin,
                rope_pos0: t.pos0 as i64,
                k_base: cache.k.addr,
                // MLA's values lie in its key rows.
                v_base: cache.v.unwrap_or(cache.k).addr,
                params,
            },
        )?;
        let (rows, rows_lse) = (s.f32s(n * heads * v_dim)?, s.f32s(n * heads)?);
        m.launch(
            &self.kernels.merge,
            blocks(n * heads * v_dim)?,
            &layers::MergeArgs {
                parts: out.addr,
                lse: lse.addr,
                map: t.map,
                out: rows.addr,
                out_lse: rows_lse.addr,
                rows: (n * heads) as i64,
                slots: t.slots as i64,
                width: v_dim as i64,
                sums: i64::from(
                    self.model.model.variants()[kind]
                        .decode_plan()
                        .unnormalized(),
                ),
            },
        )?;
        Ok((rows, rows_lse))
    }
}

/// A segment of a layer's cache: byte offsets of its first key and value rows from the
/// cache's start, and its keys.
#[derive(Clone, Copy, Debug)]
struct SegmentAt {
    k: i64,
    v: i64,
    first: i64,
    len: i64,
    code: i64,
}

/// What a step launches with, the same for every layer (see `DeviceSession::tables`).
#[derive(Debug, Default)]
struct StepTables {
    /// Tasks (CTAs of the decode kernel), their records and buffer.
    tasks: usize,
    task_records: Vec<i64>,
    tasks_buffer: i64,
    /// Every task's segment records, in task order, as offsets from a layer's cache (the
    /// launch adds the cache's start), and their buffer (0 when there are none).
    segments: Vec<i64>,
    segments_buffer: i64,
    /// Query rows gathered for the tasks, and the gather's index buffer.
    rows: usize,
    index: i64,
    /// The merge map (`slots` partial rows per output row) buffer.
    slots: usize,
    map: i64,
    /// RoPE rows of the new positions (0 without RoPE), from position `pos0`.
    rope_cos: i64,
    rope_sin: i64,
    pos0: usize,
}

fn i64_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl ResidentModel<'_> {
    /// Generation for one request, resident on the device: the prompt's prefill and every step
    /// against device caches. Greedy tokens are chosen by the argmax kernel (only the id comes
    /// back); sampled ones from the last row of logits, the only row brought back. `progress` is
    /// called after every step, as `Model::generate` calls it.
    pub fn generate(
        &self,
        request: &crate::model::Request,
        sampling: crate::model::Sampling,
        mut progress: impl FnMut(crate::model::Progress),
    ) -> Result<Vec<u32>, RuntimeError> {
        use std::time::{Duration, Instant};
        if request.prompt.is_empty() {
            return Err(RuntimeError::Data("the request has an empty prompt".into()));
        }
        if request.max_new_tokens == 0 {
            return Ok(Vec::new());
        }
        let capacity = request
            .prompt
            .len()
            .checked_add(request.max_new_tokens)
            .ok_or_else(|| RuntimeError::Data("the prompt and new tokens overflow".into()))?;
        let mut session = self.session(capacity)?;
        let mut rng = crate::model::generate::Rng::new(sampling.seed);
        let ops = crate::ops::CpuLayers;
        let mut next_after = |session: &mut DeviceSession, tokens: &[u32]| {
            if sampling.temperature <= 0.0 {
                session.step_greedy(tokens)
            } else {
                let last = session.step_last(tokens)?;
                crate::model::generate::choose(&ops, &last, &sampling, &mut rng)
            }
        };
        let start = Instant::now();
        let mut next = next_after(&mut session, &request.prompt)?;
        let prefill = start.elapsed();
        let decode_start = Instant::now();
        let mut out = Vec::with_capacity(request.max_new_tokens);
        loop {
            out.push(next);
            let done = request.stop.contains(&next) || out.len() == request.max_new_tokens;
            progress(crate::model::Progress {
                generated: out.len(),
                running: usize::from(!done),
                decoding: if out.len() > 1 {
                    decode_start.elapsed()
                } else {
                    Duration::ZERO
                },
                prefill,
                new_tokens: vec![(0, next)],
            });
            if done {
                return Ok(out);
            }
            next = next_after(&mut session, &[next])?;
        }
    }
}
