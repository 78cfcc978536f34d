//! Decoding on the GPU decode kernel, run on the interpreter: the same work items, partitions
//! and lse merge as the CPU backend (`cpu::decode`), the kernel reading the cache's segments
//! where they lie. On the interpreter the segments' rows are copied into its memory first (a
//! device keeps the cache in its own memory; the kernel reads it through the segment table).

use crate::cache::{CacheLayout, KvCache, SeqId};
use crate::cpu::decode::AbsorbedQueries;
use crate::cpu::decode::{Layout, items, merge, partitions, row_strides, tasks};
use crate::cpu::rope_table::RopeTables;
use crate::cpu::{DecodeOptions, MlaQueries, Output, check_dtype, finish};
use crate::error::RuntimeError;
use crate::tensor::Tensor;
use attn_dsl::{AttentionSpec, DType};
use codegen::KernelPlan;
use codegen::gpu::decode::{lower, segment_keys};
use codegen::gpu::interp::{Memory, Val, run};
use codegen::plan::Frequencies;

/// `CpuBackend::decode`'s call (q `[B, heads, q_len, head_dim]`, the last `q_len` tokens of each
/// sequence) on the GPU decode kernel, run on the interpreter. f32 and bf16 per-head caches
/// with static RoPE frequencies.
pub fn decode_emulated(
    spec: &AttentionSpec,
    q: &Tensor,
    cache: &impl KvCache,
    seqs: &[SeqId],
    options: DecodeOptions,
) -> Result<Output, RuntimeError> {
    crate::error::check_spec(spec)?;
    if spec.mla().is_some() {
        return Err(RuntimeError::Spec(
            "this is an MLA spec: use decode_mla_emulated with q_nope, q_pe and w_kv_b".into(),
        ));
    }
    check_dtype("q", q, spec.dtype)?;
    let plan = checked_plan(spec, cache)?;
    let (h, d, dv) = (
        spec.heads as usize,
        spec.head_dim as usize,
        spec.v_head_dim as usize,
    );
    let [b, n] = match q.shape() {
        [b, hh, n, dd] if *hh == h && *dd == d && *b == seqs.len() => [*b, *n],
        found => {
            return Err(RuntimeError::Shape {
                tensor: "q".into(),
                found: found.to_vec(),
                expected: format!("[{}, {h}, q_len, {d}]", seqs.len()),
            });
        }
    };
    let q_lens = vec![n; b];
    let call = Layout {
        q_lens: &q_lens,
        q_at: &|s, i, head| ((s * h + head) * n + i) * d,
        out_row: &|s, i, head| (s * h + head) * n + i,
        out_rows: b * h * n,
    };
    let (out, lse) = run_rows(&plan, &q.to_f32_vec(), &call, cache, seqs, options)?;
    finish(spec.dtype, [b, h, n, dv], out, lse)
}

/// `CpuBackend::decode_mla`'s call on the GPU decode kernel, run on the interpreter: the
/// queries absorbed on the host as the CPU backend does, the kernel over the latent cache
/// (latent plus RoPE key per token; values are the latent part of the key rows), the latent
/// outputs expanded by `W_uv` on the host.
pub fn decode_mla_emulated(
    spec: &AttentionSpec,
    queries: MlaQueries,
    cache: &impl KvCache,
    seqs: &[SeqId],
    options: DecodeOptions,
) -> Result<Output, RuntimeError> {
    crate::error::check_spec(spec)?;
    let a = AbsorbedQueries::of(spec, queries, seqs.len())?;
    let plan = checked_plan(spec, cache)?;
    let (latent, lse) =
        a.with_layout(|layout| run_rows(&plan, &a.q, layout, cache, seqs, options))?;
    a.finish(spec, &latent, lse)
}

/// The decode plan of a spec, after checking that the cache was made for it and that the
/// kernel runs it.
fn checked_plan(spec: &AttentionSpec, cache: &impl KvCache) -> Result<KernelPlan, RuntimeError> {
    let layout = CacheLayout::of(spec)?;
    if *cache.layout() != layout {
        return Err(RuntimeError::Cache(
            "the cache was made for another spec".into(),
        ));
    }
    if !matches!(layout.dtype, DType::F32 | DType::Bf16) {
        return Err(RuntimeError::Spec(
            "the GPU decode kernel reads f32 and bf16 caches, not f16 yet".into(),
        ));
    }
    let plan = KernelPlan::decode(spec);
    if plan
        .rope
        .as_ref()
        .is_some_and(|r| matches!(r.frequencies, Frequencies::PerLaunch))
    {
        return Err(RuntimeError::Spec(
            "the GPU decode kernel does not run dynamic NTK scaling yet".into(),
        ));
    }
    Ok(plan)
}

/// Runs the decode kernel on the interpreter over f32 query rows of the plan's `qk_dim` (at
/// `call.q_at`): the work items, partitions and lse merge of the CPU backend. Returns `out`
/// (`call.out_rows` rows of the plan's `v_dim`) and `lse`.
fn run_rows(
    plan: &KernelPlan,
    qv: &[f32],
    call: &Layout,
    cache: &impl KvCache,
    seqs: &[SeqId],
    options: DecodeOptions,
) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
    let layout = cache.layout().clone();
    let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    let q_lens = call.q_lens;
    let items = items(plan, cache, seqs, q_lens, segment_keys(plan) as usize)?;
    let tasks = tasks(&items, partitions(&items, options));
    let (k_stride, v_stride) = row_strides(&layout);

    let mut mem = Memory::default();
    let (mut q_rows, mut task_records, mut segment_records) = (Vec::new(), Vec::new(), Vec::new());
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
        let seg0 = segment_records.len() / 5;
        for s in &item.segments[task.segments.clone()] {
            let keys = s.len as usize;
            let size = layout.dtype.size_bytes() as usize;
            // The segment's rows, packed, in the cache's dtype (a device keeps them in its
            // memory; here they are copied into the interpreter's).
            let packed = |start: *const u8, stride: usize, width: usize| -> Vec<u8> {
                // SAFETY: `items` built the segment from the cache's runs: `keys` rows of
                // `stride` elements of `size` bytes from `start`, inside the cache borrowed here.
                let bytes = unsafe {
                    std::slice::from_raw_parts(start, ((keys - 1) * stride + width) * size)
                };
                (0..keys)
                    .flat_map(|j| bytes[j * stride * size..(j * stride + width) * size].to_vec())
                    .collect()
            };
            segment_records.extend([
                mem.alloc_bytes(packed(s.k, k_stride, d)),
                mem.alloc_bytes(packed(s.v, v_stride, dv)),
                s.first_key,
                s.len,
                s.code,
            ]);
        }
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
    let i64s = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let max_len = items.iter().map(|i| i.len).max().unwrap_or(0) as i64;
    let tables = plan
        .rope
        .as_ref()
        .map(|r| RopeTables::new(r, 0, max_len, max_len as u64));
    let (cos, sin) = match &tables {
        Some(t) if !t.cos.is_empty() => (mem.alloc_f32(&t.cos), mem.alloc_f32(&t.sin)),
        _ => (0, 0),
    };
    let args: Vec<Val> = [
        mem.alloc_f32(&q_rows),
        mem.alloc_bytes(i64s(&task_records)),
        if segment_records.is_empty() {
            0
        } else {
            mem.alloc_bytes(i64s(&segment_records))
        },
        mem.alloc_f32(&vec![0.0; total_rows * dv]),
        mem.alloc_f32(&vec![0.0; total_rows]),
        cos,
        sin,
        0,
    ]
    .into_iter()
    .map(Val::I64)
    .collect();
    let (out_addr, lse_addr) = match (&args[3], &args[4]) {
        (Val::I64(o), Val::I64(l)) => (*o, *l),
        _ => unreachable!("addresses are i64"),
    };
    run(&lower(plan), [tasks.len() as u32, 1, 1], &args, &mut mem).map_err(RuntimeError::Data)?;
    let out = mem
        .read_f32(out_addr, total_rows * dv)
        .map_err(RuntimeError::Data)?;
    let lse = mem
        .read_f32(lse_addr, total_rows)
        .map_err(RuntimeError::Data)?;
    let results: Vec<(Vec<f32>, Vec<f32>)> = rows_of
        .iter()
        .map(|&(row0, rows)| {
            (
                out[row0 * dv..(row0 + rows) * dv].to_vec(),
                lse[row0..row0 + rows].to_vec(),
            )
        })
        .collect();
    Ok(merge(&items, &tasks, &results, call, dv))
}
