//! Decoding on the GPU decode kernel, run on the interpreter: the same work items as the CPU
//! backend (`host::work`), partitions sized for a GPU and merged on the device, the kernel
//! reading the cache's segments where they lie. On the interpreter the segments' rows are copied into its memory first (a
//! device keeps the cache in its own memory; the kernel reads it through the segment table).

use super::pages::{PageTables, PagedSegments, pages_kernel, span_items};
use crate::cache::{KvCache, SeqId};
use crate::calls::{DecodeOptions, MlaQueries, Output};
use crate::device::{Device, DeviceBuffer, Scratch, f32s, launch};
use crate::error::RuntimeError;
use crate::host::checks::check_cache;
use crate::host::mla::AbsorbedQueries;
use crate::host::ragged::{Layout, Ragged, Uniform};
use crate::host::rope_table::{RopeTables, Side};
use crate::host::work::{GPU_TASKS, Item, Task, items, partitions, row_strides, tasks};
use crate::tensor::Tensor;
use crate::variant::Variant;
use codegen::KernelPlan;
use codegen::gpu::ir::Kernel;
use codegen::gpu::kernels::decode::{SEGMENT_FIELDS, segment_keys, task_rows};
use codegen::gpu::kernels::layers::{self, MergeArgs};
use codegen::gpu::launch::DecodeArgs;
use codegen::plan::Frequencies;
use std::sync::Arc;

/// How a prepared decode launch runs: on the interpreter or a device. Returns `out` and `lse`.
pub(crate) type Exec<'a> = &'a dyn Fn(&DecodeLaunch) -> Result<(Vec<f32>, Vec<f32>), RuntimeError>;

/// A ragged batch (`q [tokens, heads, head_dim]`, cumulative `q_offsets` per sequence) on the
/// GPU decode kernel, the launch run by `exec`.
pub(crate) fn attend_ragged_with(
    variant: &Variant,
    q: &Tensor,
    q_offsets: &[usize],
    cache: &dyn KvCache,
    seqs: &[SeqId],
    options: DecodeOptions,
    exec: Exec,
) -> Result<Output, RuntimeError> {
    let ragged = Ragged::of(variant.spec(), q, q_offsets, seqs.len())?;
    let plan = checked_plan(variant, cache)?;
    let qv = q.to_f32_vec();
    let (out, lse) = ragged
        .with_layout(|layout| run_rows(variant, plan, &qv, layout, cache, seqs, options, exec))?;
    ragged.finish(variant.spec(), out, lse)
}

/// Uniform queries (`q [B, heads, q_len, head_dim]`, the last `q_len` tokens of each
/// sequence) on the GPU decode kernel, the launch run by `exec`. f32, bf16 and f16 per-head
/// caches with static RoPE frequencies.
pub(crate) fn decode_with(
    variant: &Variant,
    q: &Tensor,
    cache: &dyn KvCache,
    seqs: &[SeqId],
    options: DecodeOptions,
    exec: Exec,
) -> Result<Output, RuntimeError> {
    let batch = Uniform::of(variant.spec(), q, seqs.len())?;
    let plan = checked_plan(variant, cache)?;
    let qv = q.to_f32_vec();
    let (out, lse) = batch
        .with_layout(|layout| run_rows(variant, plan, &qv, layout, cache, seqs, options, exec))?;
    batch.finish(variant.spec(), out, lse)
}

/// MLA queries on the GPU decode kernel, the launch run by `exec`: the queries absorbed on
/// the host as the CPU backend does, the kernel over the latent cache (latent plus RoPE key per
/// token; values are the latent part of the key rows), the latent outputs expanded by `W_uv`
/// on the host.
pub(crate) fn decode_mla_with(
    variant: &Variant,
    queries: MlaQueries,
    cache: &dyn KvCache,
    seqs: &[SeqId],
    options: DecodeOptions,
    exec: Exec,
) -> Result<Output, RuntimeError> {
    let a = AbsorbedQueries::of(variant.spec(), queries, seqs.len())?;
    let plan = checked_plan(variant, cache)?;
    let (latent, lse) =
        a.with_layout(|layout| run_rows(variant, plan, &a.q, layout, cache, seqs, options, exec))?;
    a.finish(variant.spec(), &latent, lse)
}

/// The decode plan of a variant, after checking that the cache was made for it and that the
/// kernel runs it.
fn checked_plan<'v>(
    variant: &'v Variant,
    cache: &dyn KvCache,
) -> Result<&'v KernelPlan, RuntimeError> {
    check_cache(variant, cache)?;
    let plan = variant.decode_plan();
    if plan
        .rope
        .as_ref()
        .is_some_and(|r| matches!(r.frequencies, Frequencies::PerLaunch))
    {
        return Err(RuntimeError::Spec(
            "the GPU decode kernel over paged caches does not run RoPE frequencies that depend on the length (dynamic NTK, LongRoPE) yet".into(),
        ));
    }
    Ok(plan)
}

/// A decode call prepared for the GPU decode kernel: its buffers as the kernel reads them. The
/// segment records point at the cache's rows where they lie (host addresses inside the cache's
/// `memory`, which the launch borrows); the launcher puts that memory on the device (or finds
/// it there) and translates the addresses.
pub(crate) struct DecodeLaunch<'a> {
    /// The kernel, for the call's plan.
    pub kernel: Arc<Kernel>,
    /// CTAs: one per task.
    pub ctas: u32,
    /// Query rows, f32, `qk_dim` each.
    pub q_rows: Vec<f32>,
    /// Task records (`TASK_FIELDS` i64 each).
    pub tasks: Vec<i64>,
    /// Segment records (`SEGMENT_FIELDS` i64 each), K and V as host addresses; empty when
    /// `pages` makes them on the device.
    pub segments: Vec<i64>,
    /// The segment records' pieces and page tables, for a kernel that makes the records on the
    /// device before the decode kernel runs.
    pub pages: Option<PagedSegments>,
    /// The cache's memory: regions every segment lies inside.
    pub memory: Vec<&'a [u8]>,
    /// The cache's generation when the launch was prepared (a device copy of the cache must be
    /// of the same; only the CUDA launcher has such copies).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub generation: u64,
    /// RoPE tables for the query positions (empty without RoPE).
    pub rope_cos: Vec<f32>,
    /// See `rope_cos`.
    pub rope_sin: Vec<f32>,
    /// Partial output rows the decode kernel writes (of the plan's `v_dim`).
    pub out_rows: usize,
    /// Values per output row.
    pub v_dim: usize,
    /// The kernel that merges partial rows by their lse into the call's rows.
    pub merge: Arc<Kernel>,
    /// The call's output rows, and for each its partial rows (`slots` each, `-1` past the last).
    pub merged_rows: usize,
    /// See `merged_rows`.
    pub map: Vec<i32>,
    /// See `merged_rows`.
    pub slots: usize,
    /// Whether the partial rows add (`normalize = sigmoid`; a stick-breaking row is never
    /// split) rather than merge as softmax parts.
    pub sums: bool,
    /// How many parameter values the kernel reads (the plan's `ParamLayout` length).
    pub param_len: usize,
}

impl DecodeLaunch<'_> {
    /// The cache's memory as `(host address, bytes)` ranges.
    pub fn regions(&self) -> Vec<(usize, usize)> {
        self.memory
            .iter()
            .map(|m| (m.as_ptr() as usize, m.len()))
            .collect()
    }

    /// `segments` with their host addresses turned into device ones, region `i` being at
    /// `bases[i]` on the device.
    pub fn segment_records(&self, bases: &[i64]) -> Result<Vec<i64>, RuntimeError> {
        let regions = self.regions();
        let translate = |host: i64| -> Result<i64, RuntimeError> {
            let host = host as usize;
            regions
                .iter()
                .zip(bases)
                .find(|((start, bytes), _)| (*start..start + bytes).contains(&host))
                .map(|((start, _), base)| base + (host - start) as i64)
                .ok_or_else(|| {
                    RuntimeError::Cache("a cache segment lies outside the cache's regions".into())
                })
        };
        let mut records = self.segments.clone();
        for record in records.chunks_mut(SEGMENT_FIELDS) {
            record[0] = translate(record[0])?;
            record[1] = translate(record[1])?;
        }
        Ok(records)
    }

    /// An error unless `params` holds the values the kernel reads.
    pub fn check_params(&self, params: &[f32]) -> Result<(), RuntimeError> {
        if params.len() == self.param_len {
            return Ok(());
        }
        Err(RuntimeError::Data(format!(
            "{} parameter values given; the decode kernel reads {}",
            params.len(),
            self.param_len
        )))
    }

    /// Runs the launch on `device` with the spec's parameters: the cache's memory uploaded now,
    /// or found on the device at `resident` (one buffer per region of
    /// [`DecodeLaunch::regions`], in order), the segment records made (on the device, from page
    /// tables, where the launch has them), the decode kernel and the merge of its partitions
    /// (timed on the device where it times kernels, [`Device::time_span`]); returns the call's
    /// `out` and `lse` rows.
    pub fn run_on(
        &self,
        device: &dyn Device,
        resident: Option<&[DeviceBuffer]>,
        params: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
        self.check_params(params)?;
        let mut s = Scratch::new(device);
        let bases: Vec<i64> = match resident {
            Some(buffers) => buffers.iter().map(|b| b.addr).collect(),
            None => self
                .memory
                .iter()
                .map(|m| Ok(s.upload(m)?.addr))
                .collect::<Result<_, RuntimeError>>()?,
        };
        let i64s = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let f32s_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let segments = match &self.pages {
            Some(p) => {
                let records = s.zeros(p.records.max(1) * 8 * SEGMENT_FIELDS)?.addr;
                if p.records > 0 {
                    let pages: Vec<u8> = p.pages.iter().flat_map(|x| x.to_le_bytes()).collect();
                    let record = p.args([
                        s.upload_or_null(&i64s(&p.pieces))?,
                        s.upload_or_null(&pages)?,
                        records,
                        bases[p.geometry.region],
                    ]);
                    launch(device, &p.kernel, [p.ctas()?, 1, 1], &record, &[])?;
                }
                records
            }
            None => s.upload_or_null(&i64s(&self.segment_records(&bases)?))?,
        };
        let (out, lse) = (s.f32s(self.out_rows * self.v_dim)?, s.f32s(self.out_rows)?);
        let record = DecodeArgs {
            q_rows: s.upload_or_null(&f32s_bytes(&self.q_rows))?,
            tasks: s.upload_or_null(&i64s(&self.tasks))?,
            segments,
            out: out.addr,
            lse: lse.addr,
            rope_cos: s.upload_or_null(&f32s_bytes(&self.rope_cos))?,
            rope_sin: s.upload_or_null(&f32s_bytes(&self.rope_sin))?,
            rope_pos0: 0,
            k_base: 0,
            v_base: 0,
            params: s.upload_or_null(&f32s_bytes(params))?,
        };
        let map: Vec<u8> = self.map.iter().flat_map(|i| i.to_le_bytes()).collect();
        let map = s.upload_or_null(&map)?;
        let (merged, merged_lse) = (
            s.f32s(self.merged_rows * self.v_dim)?,
            s.f32s(self.merged_rows)?,
        );
        let merge = self.merge_record(out.addr, lse.addr, map, merged.addr, merged_lse.addr);
        device.time_span(&mut || {
            launch(device, &self.kernel, [self.ctas, 1, 1], &record, &[])?;
            launch(device, &self.merge, [self.merge_ctas()?, 1, 1], &merge, &[])
        })?;
        Ok((
            f32s(&device.download(merged)?),
            f32s(&device.download(merged_lse)?),
        ))
    }

    /// The merge launch's record over buffers at these addresses.
    pub fn merge_record(
        &self,
        parts: i64,
        lse: i64,
        map: i64,
        out: i64,
        out_lse: i64,
    ) -> MergeArgs {
        MergeArgs {
            parts,
            lse,
            map,
            out,
            out_lse,
            rows: self.merged_rows as i64,
            slots: self.slots as i64,
            width: self.v_dim as i64,
            sums: i64::from(self.sums),
        }
    }

    /// CTAs of the merge launch: a thread per merged value.
    pub fn merge_ctas(&self) -> Result<u32, RuntimeError> {
        let threads = (self.merged_rows * self.v_dim).div_ceil(layers::THREADS as usize);
        u32::try_from(threads.max(1))
            .map_err(|_| RuntimeError::Data("a merge larger than a grid".into()))
    }
}

/// The merge's map: for each call row (`call.out_row`), the kernel's partial rows of it (task
/// `t`'s rows start at `rows_of[t].0`), padded with -1 to the most any row has (`slots`).
fn merge_map(
    call: &Layout,
    tasks: &[Task],
    items: &[Item],
    rows_of: &[(usize, usize)],
) -> (Vec<i32>, usize) {
    let mut parts_of: Vec<Vec<i32>> = vec![Vec::new(); call.out_rows];
    for (task, &(row0, _)) in tasks.iter().zip(rows_of) {
        let item = &items[task.item];
        let mut r = row0;
        for head in item.h0..item.h0 + item.nh {
            for i in item.i0..item.i0 + item.nq {
                parts_of[(call.out_row)(item.b, i, head)].push(r as i32);
                r += 1;
            }
        }
    }
    let slots = parts_of.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let map = parts_of
        .iter()
        .flat_map(|p| p.iter().copied().chain(std::iter::repeat(-1)).take(slots))
        .collect();
    (map, slots)
}

/// Runs the decode kernel (through `exec`, on the interpreter or a device) over f32 query rows
/// of the plan's `qk_dim` (at `call.q_at`): the work items of the CPU backend, partitions sized
/// for a GPU, and the lse merge as a second kernel on the device. Returns `out` (`call.out_rows`
/// rows of the plan's `v_dim`) and `lse`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_rows(
    variant: &Variant,
    plan: &KernelPlan,
    qv: &[f32],
    call: &Layout,
    cache: &dyn KvCache,
    seqs: &[SeqId],
    options: DecodeOptions,
    exec: Exec,
) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
    let layout = cache.layout().clone();
    let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    let (max_rows, seg_keys) = (task_rows(plan) as usize, segment_keys(plan) as usize);
    // The keys reach the kernel as segment records made here, or, from a paged cache whose
    // blocks hold whole segments, made on the device from the page tables (host work then
    // grows with pages and tasks, not keys).
    let paged = cache
        .page_geometry()
        .filter(|g| g.block_size.is_multiple_of(seg_keys));
    let (items, spans) = match paged {
        Some(_) => {
            let (items, spans) = span_items(plan, cache, seqs, call.q_lens, max_rows, seg_keys)?;
            (items, Some(spans))
        }
        None => (
            items(plan, cache, seqs, call.q_lens, max_rows, seg_keys)?,
            None,
        ),
    };
    let counts: Vec<usize> = match &spans {
        Some(spans) => spans.iter().map(|s| s.count).collect(),
        None => items.iter().map(|i| i.segments.len()).collect(),
    };
    // A stick-breaking row weighs each key by every nearer one: its keys stay in one task.
    let parts = match plan.stick_breaking() {
        true => 1,
        false => partitions(&counts, options, GPU_TASKS),
    };
    let tasks = tasks(&counts, parts);
    let (k_stride, v_stride) = row_strides(&layout);
    let page_tables = match paged {
        Some(geometry) => Some(PageTables::of(cache, seqs, call.q_lens, geometry)?),
        None => None,
    };

    let (mut q_rows, mut task_records, mut segment_records) = (Vec::new(), Vec::new(), Vec::new());
    let (mut pieces, mut records) = (Vec::new(), 0);
    let mut rows_of = Vec::with_capacity(tasks.len());
    for task in &tasks {
        let item = &items[task.item];
        let row0 = q_rows.len() / d;
        for head in item.h0..item.h0 + item.nh {
            for i in item.i0..item.i0 + item.nq {
                let at = (call.q_at)(item.b, i, head);
                q_rows.extend_from_slice(&qv[at..at + d]);
            }
        }
        let seg0 = records;
        match (&spans, &page_tables) {
            (Some(spans), Some(tables)) => spans[task.item].pieces(
                task.segments.clone(),
                seg0,
                [item.len, seg_keys, tables.offsets[item.b]],
                &mut pieces,
            ),
            _ => {
                for s in &item.segments[task.segments.clone()] {
                    segment_records.extend([
                        s.k as i64,
                        s.v as i64,
                        s.first_key,
                        s.len,
                        s.code as i64,
                        k_stride as i64,
                        v_stride as i64,
                    ]);
                }
            }
        }
        records += task.segments.len();
        let rows = item.nh * item.nq;
        task_records.extend([
            row0 as i64,
            rows as i64,
            item.nq as i64,
            (item.len - item.n + item.i0) as i64,
            item.i0 as i64,
            item.b as i64,
            item.h0 as i64,
            seg0 as i64,
            task.segments.len() as i64,
        ]);
        rows_of.push((row0, rows));
    }
    let total_rows = q_rows.len() / d;
    if total_rows == 0 {
        return Ok((
            vec![0.0; call.out_rows * dv],
            vec![f32::NEG_INFINITY; call.out_rows],
        ));
    }
    let max_len = items.iter().map(|i| i.len).max().unwrap_or(0) as i64;
    let tables = plan
        .rope
        .as_ref()
        .map(|r| RopeTables::new(r, 0, max_len, max_len as u64, Side::Query, 0));
    let (rope_cos, rope_sin) = tables.map(|t| (t.cos, t.sin)).unwrap_or_default();
    let (map, slots) = merge_map(call, &tasks, &items, &rows_of);
    let pages = match (paged, page_tables) {
        (Some(geometry), Some(tables)) => Some(PagedSegments {
            kernel: pages_kernel()?,
            pieces,
            pages: tables.pages,
            records,
            geometry,
            elem_bytes: layout.dtype.size_bytes() as usize,
            segment_keys: seg_keys,
        }),
        _ => None,
    };
    let launch = DecodeLaunch {
        param_len: plan.params.len(),
        kernel: variant.gpu_decode()?,
        ctas: tasks.len() as u32,
        q_rows,
        tasks: task_records,
        segments: segment_records,
        pages,
        memory: cache.memory(),
        generation: cache.generation(),
        rope_cos,
        rope_sin,
        out_rows: total_rows,
        v_dim: dv,
        merge: merge_kernel()?,
        merged_rows: call.out_rows,
        map,
        slots,
        sums: plan.unnormalized(),
    };
    exec(&launch)
}

/// The split-KV merge kernel, lowered and verified once per process.
fn merge_kernel() -> Result<Arc<Kernel>, RuntimeError> {
    static MERGE: std::sync::OnceLock<Arc<Kernel>> = std::sync::OnceLock::new();
    if let Some(k) = MERGE.get() {
        return Ok(Arc::clone(k));
    }
    let made = Arc::new(codegen::gpu::verified(layers::merge_partitions())?);
    Ok(Arc::clone(MERGE.get_or_init(|| made)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::PagedCache;
    use crate::tensor::Tensor;
    use attn_dsl::AttentionSpec;

    /// Issue 15's grid bar without a device: a batch of 8 at kv 4096 (bf16, 32 query heads over
    /// 8 kv heads of 128) launches at least two waves of a 132-SM GPU, 264 CTAs.
    #[test]
    fn a_batch_of_eight_at_kv_4096_fills_two_waves() {
        let spec: AttentionSpec = "heads = 32, kv_heads = 8, head_dim = 128, dtype = bf16"
            .parse()
            .unwrap();
        let variant = Variant::new(spec.clone()).unwrap();
        let mut cache = PagedCache::new(&spec, 64, 8 * 4096 / 64).unwrap();
        let zeros =
            Tensor::from_f32_as(spec.dtype, &[8, 4096, 128], vec![0.0; 8 * 4096 * 128]).unwrap();
        let seqs: Vec<SeqId> = (0..8)
            .map(|_| {
                let s = cache.add_sequence();
                cache.append(s, &zeros, &zeros).unwrap();
                s
            })
            .collect();
        let q = Tensor::from_f32_as(spec.dtype, &[8, 32, 1, 128], vec![0.0; 8 * 32 * 128]).unwrap();
        let ctas = std::cell::Cell::new(0);
        let exec = |l: &DecodeLaunch| {
            ctas.set(l.ctas);
            Ok((vec![0.0; l.merged_rows * l.v_dim], vec![0.0; l.merged_rows]))
        };
        decode_with(&variant, &q, &cache, &seqs, DecodeOptions::default(), &exec).unwrap();
        assert!(ctas.get() >= 264, "{} CTAs", ctas.get());
    }
}

#[cfg(test)]
mod page_table_tests {
    use super::*;
    use crate::cache::PagedCache;
    use crate::tensor::Tensor;
    use attn_dsl::AttentionSpec;

    /// From a paged cache whose blocks hold whole segments, the launch carries page tables and
    /// pieces instead of records, and the records the device makes from them (on the
    /// interpreter) are the ones the host makes from the cache's runs: same rows, keys, lengths
    /// and tile codes, task by task. A block size that cuts segments keeps the host records.
    #[test]
    fn records_made_from_page_tables_equal_the_hosts() {
        let spec: AttentionSpec =
            "heads = 4, kv_heads = 2, head_dim = 16, mask = sliding_window(40), dtype = bf16"
                .parse()
                .unwrap();
        let variant = Variant::new(spec.clone()).unwrap();
        let plan = variant.decode_plan();
        for (block_size, device_made) in [(16, true), (32, true), (7, false)] {
            let mut cache = PagedCache::new(&spec, block_size, 64).unwrap();
            let seqs: Vec<SeqId> = [45usize, 97, 16]
                .iter()
                .map(|&len| {
                    let s = cache.add_sequence();
                    let t = Tensor::from_f32_as(spec.dtype, &[2, len, 16], vec![0.5; 2 * len * 16])
                        .unwrap();
                    cache.append(s, &t, &t).unwrap();
                    s
                })
                .collect();
            let q =
                Tensor::from_f32_as(spec.dtype, &[3, 4, 3, 16], vec![0.0; 3 * 4 * 3 * 16]).unwrap();
            let records = std::cell::RefCell::new(None);
            let exec = |l: &DecodeLaunch| {
                assert_eq!(l.pages.is_some(), device_made, "block size {block_size}");
                let made = match &l.pages {
                    Some(p) => {
                        let device = crate::device::SimDevice::new();
                        let base = device.upload(l.memory[0]).unwrap().addr;
                        let out = device.zeros(p.records * 8 * SEGMENT_FIELDS).unwrap();
                        let i64s = |v: &[i64]| -> Vec<u8> {
                            v.iter().flat_map(|x| x.to_le_bytes()).collect()
                        };
                        let pages: Vec<u8> = p.pages.iter().flat_map(|x| x.to_le_bytes()).collect();
                        let record = p.args([
                            device.upload(&i64s(&p.pieces)).unwrap().addr,
                            device.upload(&pages).unwrap().addr,
                            out.addr,
                            base,
                        ]);
                        let grid = [p.ctas().unwrap(), 1, 1];
                        launch(&device, &p.kernel, grid, &record, &[]).unwrap();
                        let bytes = device.download(out).unwrap();
                        let host = l.memory[0].as_ptr() as i64;
                        let mut v: Vec<i64> = bytes
                            .chunks(8)
                            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                            .collect();
                        // Device row addresses back to the host's.
                        for r in v.chunks_mut(SEGMENT_FIELDS) {
                            r[0] += host - base;
                            r[1] += host - base;
                        }
                        v
                    }
                    None => l.segments.clone(),
                };
                *records.borrow_mut() = Some(made);
                Ok((vec![0.0; l.merged_rows * l.v_dim], vec![0.0; l.merged_rows]))
            };
            let options = DecodeOptions {
                partitions: Some(3),
            };
            decode_with(&variant, &q, &cache, &seqs, options, &exec).unwrap();
            let made = records.into_inner().unwrap();
            // The host's records, task by task, from the cache's runs.
            let items = items(plan, &cache, &seqs, &[3, 3, 3], 16, 16).unwrap();
            let counts: Vec<usize> = items.iter().map(|i| i.segments.len()).collect();
            let (k_stride, v_stride) = row_strides(cache.layout());
            let mut want = Vec::new();
            for task in tasks(&counts, partitions(&counts, options, GPU_TASKS)) {
                for s in &items[task.item].segments[task.segments] {
                    want.extend([
                        s.k as i64,
                        s.v as i64,
                        s.first_key,
                        s.len,
                        s.code as i64,
                        k_stride as i64,
                        v_stride as i64,
                    ]);
                }
            }
            assert!(!want.is_empty());
            assert_eq!(made, want, "block size {block_size}");
        }
    }
}
