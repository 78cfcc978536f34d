//! Attention against a KV cache: ragged batches (each sequence with its own number of new
//! queries and cached keys), decode and chunked prefill alike, with split-KV.
//!
//! The work items, their partitions (split-KV, flash-decoding) and the lse merge are the
//! backends' shared host preparation (`host::work`); this module runs each partition on the
//! compiled decode function over rayon's threads.

use super::CpuBackend;
use crate::cache::{KvCache, SeqId};
use crate::calls::{DecodeOptions, MlaQueries, Output};
use crate::error::RuntimeError;
use crate::host::checks::check_cache;
use crate::host::mla::AbsorbedQueries;
use crate::host::ragged::{Layout, Ragged, Uniform};
use crate::host::rope_table::{RopeTables, Side};
use crate::host::work::{Item, items, merge, partitions, row_strides, tasks};
use crate::tensor::Tensor;
use crate::variant::Variant;
use codegen::cpu::abi::{DecodeArgs, Segment};
use codegen::cpu::{CpuKernel, Entry};
use codegen::plan::{K_TILE, PlanKind};
use rayon::prelude::*;

/// What a cached call attends over, and the parameters its kernels read.
pub(super) struct Cached<'a> {
    pub cache: &'a dyn KvCache,
    pub seqs: &'a [SeqId],
    pub options: DecodeOptions,
    /// Laid out as the plan's `ParamLayout`; empty without parameters.
    pub params: &'a [f32],
}

impl CpuBackend {
    /// [`Queries::Uniform`](crate::calls::Queries::Uniform): `q [B, heads, q_len, head_dim]`
    /// holds the last `q_len` tokens of each sequence of `seqs`.
    pub(super) fn decode_uniform(
        &self,
        variant: &Variant,
        q: &Tensor,
        call: &Cached,
    ) -> Result<Output, RuntimeError> {
        let batch = Uniform::of(variant.spec(), q, call.seqs.len())?;
        let (out, lse) =
            batch.with_layout(|layout| self.cached(variant, &q.to_f32_vec(), call, layout))?;
        batch.finish(variant.spec(), out, lse)
    }

    /// [`Queries::Mla`](crate::calls::Queries::Mla), in the absorbed form.
    pub(super) fn decode_mla(
        &self,
        variant: &Variant,
        queries: MlaQueries,
        call: &Cached,
    ) -> Result<Output, RuntimeError> {
        let a = AbsorbedQueries::of(variant.spec(), queries, call.seqs.len())?;
        let (latent, lse) = a.with_layout(|layout| self.cached(variant, &a.q, call, layout))?;
        a.finish(variant.spec(), &latent, lse)
    }

    /// [`Queries::Ragged`](crate::calls::Queries::Ragged): decode and chunked prefill in one
    /// launch.
    pub(super) fn decode_ragged(
        &self,
        variant: &Variant,
        q: &Tensor,
        q_offsets: &[usize],
        call: &Cached,
    ) -> Result<Output, RuntimeError> {
        let ragged = Ragged::of(variant.spec(), q, q_offsets, call.seqs.len())?;
        let (out, lse) =
            ragged.with_layout(|layout| self.cached(variant, &q.to_f32_vec(), call, layout))?;
        ragged.finish(variant.spec(), out, lse)
    }

    /// Checks the cache against the variant and runs its decode kernel on f32 queries of
    /// `qk_dim` values (absorbed ones for MLA).
    fn cached(
        &self,
        variant: &Variant,
        q: &[f32],
        call: &Cached,
        layout: &Layout,
    ) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
        check_cache(variant, call.cache)?;
        let kernel = self.kernel(variant, PlanKind::Decode)?;
        let (max_rows, seg_keys) = (kernel.plan.tiles.q_rows as usize, K_TILE as usize);
        let items = items(
            &kernel.plan,
            call.cache,
            call.seqs,
            layout.q_lens,
            max_rows,
            seg_keys,
        )?;
        run(&kernel, call, &items, q, layout)
    }
}

fn run(
    kernel: &CpuKernel,
    call: &Cached,
    items: &[Item],
    q: &[f32],
    layout: &Layout,
) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
    let Entry::Decode { decode } = kernel.entry else {
        return Err(RuntimeError::Spec(
            "a forward kernel cannot run a decode call".into(),
        ));
    };
    let params = super::launch::param_pointer(&kernel.plan, call.params)?;
    let (cache_layout, options) = (call.cache.layout(), call.options);
    // SAFETY: `decode` was compiled by codegen::cpu with the signature
    // `extern "C" fn(*const DecodeArgs)`; the address stays valid for the process.
    let decode =
        unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*const DecodeArgs)>(decode) };
    let plan = &kernel.plan;
    let (dqk, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    let (k_stride, v_stride) = row_strides(cache_layout);
    let counts: Vec<usize> = items.iter().map(|i| i.segments.len()).collect();
    // A stick-breaking row weighs each key by every nearer one: its keys stay in one task.
    let parts = match plan.stick_breaking() {
        true => 1,
        false => partitions(&counts, options, 4 * rayon::current_num_threads()),
    };
    let tasks = tasks(&counts, parts);

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
                // xPos factors from position 0, as the cache's keys have them; the queries
                // are the cache's last tokens, whose range the append checked.
                let tables = plan.rope.as_ref().map(|r| {
                    let end = q_pos0 + item.nq as i64;
                    RopeTables::new(r, q_pos0, end, item.len as u64, Side::Query, 0)
                });
                let (cos, sin, table_pos0) = match &tables {
                    Some(t) => (t.cos.as_ptr(), t.sin.as_ptr(), t.pos0),
                    None => (std::ptr::null(), std::ptr::null(), 0),
                };
                let mut out = vec![0f32; rows * dv];
                let mut lse = vec![0f32; rows];
                // The kernel's records of the item's neutral ones (addresses as pointers).
                let segments: Vec<Segment> = item.segments[task.segments.clone()]
                    .iter()
                    .map(|s| Segment {
                        k: s.k as *const u8,
                        v: s.v as *const u8,
                        first_key: s.first_key,
                        len: s.len,
                        code: s.code as i64,
                    })
                    .collect();
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
                    params: params.get(),
                };
                // SAFETY: `rows` query rows of `dqk` values; segments whose rows lie in the
                // cache, borrowed for the call; `rows` output rows and lse values; a scratch of
                // `ScratchLayout::total` values; RoPE tables covering the queries' positions;
                // parameters as long as the plan's layout (checked by `param_pointer`).
                unsafe { decode(&args) };
                (out, lse)
            },
        )
        .collect();

    Ok(merge(
        items,
        &tasks,
        &results,
        layout,
        dv,
        plan.unnormalized(),
    ))
}
