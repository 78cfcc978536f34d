//! attn's attention as a [candle](https://github.com/huggingface/candle) op, with gradients:
//! put a declared variant inside a model that candle trains (feature `candle`).
//!
//! ```
//! use attn::candle::{attention, core::{Device, Tensor, Var}};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let variant = attn::Variant::parse("heads = 4, kv_heads = 2, head_dim = 16, mask = causal")?;
//! let dev = Device::Cpu;
//! // [batch, heads, sequence, head dim], as `attnc run` takes them.
//! let q = Var::randn(0f32, 1.0, (1, 4, 8, 16), &dev)?;
//! let k = Var::randn(0f32, 1.0, (1, 2, 8, 16), &dev)?;
//! let v = Var::randn(0f32, 1.0, (1, 2, 8, 16), &dev)?;
//! let out = attention(&variant, &q, &k, &v)?;
//! assert_eq!(out.dims(), &[1, 4, 8, 16]);
//! let grads = out.sqr()?.sum_all()?.backward()?;
//! assert_eq!(grads.get(&k).unwrap().dims(), &[1, 2, 8, 16]);
//! # Ok(())
//! # }
//! ```
//!
//! **Layout** (BHSD): q `[B, heads, Sq, head_dim]`, k `[B, kv_heads, Skv, head_dim]`, v `[B,
//! kv_heads, Skv, v_head_dim]`, out `[B, heads, Sq, v_head_dim]`, all in the spec's dtype; lse
//! `[B, heads, Sq]` in f32. q and k are taken before RoPE. Strided inputs (a BSHD tensor
//! transposed to BHSD, say) are read as they are: each input is copied once into attn's own
//! storage, gathering rows where the layout is not contiguous, and never made contiguous by
//! candle first.
//!
//! **Gradients.** [`attention`] is a candle `CustomOp3` whose backward runs attn's backward
//! kernels: FlashAttention-2 recomputation from the forward's log-sum-exp, so nothing of size
//! `Sq x Skv` is ever stored. candle gives a custom op's backward its three inputs, its output
//! and the output's gradient, but no room for a second output: the op itself keeps the lse
//! (`[B, heads, Sq]` f32, O(B·H·S)) from its forward, and candle keeps the op in the graph
//! until the graph is dropped. Gradients of q and k are for q and k before RoPE; those of k
//! and v are summed over each GQA group. The lse that [`attention_with_lse`] returns is
//! detached: no gradient flows back through it.
//!
//! **Devices.** CPU tensors run on attn's CPU kernels (rayon's global pool, as candle's own CPU
//! ops). Tensors on another device are refused with an error.
//!
//! **Cost.** Beside the kernels, each call copies its inputs into attn's storage (buffers from
//! attn's pool, so a training loop copies into memory already mapped), and candle's autograd
//! makes and frees a few tensors of the inputs' size per gradient. glibc gives that memory back
//! to the system between steps and faults it in again; raising its thresholds
//! (`GLIBC_TUNABLES=glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432`)
//! keeps it, which made steps 1.1-2.1x faster in the benchmark (BENCHMARKS.md).
//!
//! **Learnable tensors.** A spec's parameters (`params(...)`) and sinks (`sinks = learned`) are
//! candle tensors, usually `Var`s, passed by name to [`attention_learned`]; their gradients come
//! from attn's backward (exact, the same bits for any thread count) through `backward()`.
//! candle's custom ops take at most three tensors, so with learnable tensors the op's third
//! input is one f32 vector: v's elements followed by each learnable tensor's, made by candle's
//! `cat` (whose backward splits the gradient back into dv and each tensor's). That costs one
//! copy of v per call, and only with learnable tensors.
//!
//! **Data tensors** (`data(...)`) go to [`attention_with_data`] by name: i32 ones are held by
//! the op (no gradient), f32 ones travel in the packed third input as learnable tensors do and
//! get gradients.
//!
//! **MLA** variants are refused: their five inputs do not fit a candle op of at most three.
//! Train MLA in its expanded form (per-head keys and values made from the latent with candle
//! matmuls) with a per-head variant.

mod convert;
mod differential;
mod model;
mod op;

pub use differential::differential;
pub use model::CandleModel;

/// A candle error's message without the backtraces candle attaches under `RUST_BACKTRACE`:
/// what went wrong, and the context and path candle gave it. (candle also formats errors with
/// their backtraces into the text of others: such text is cut at the backtrace's first frame.)
pub fn message(e: &candle_core::Error) -> String {
    use candle_core::Error;
    let text = match e {
        Error::WithBacktrace { inner, .. } => message(inner),
        Error::Context { inner, context } => format!("{context}: {}", message(inner)),
        Error::WithPath { inner, path } => format!("{}: {}", path.display(), message(inner)),
        other => other.to_string(),
    };
    let mut kept = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("0: ") {
            break;
        }
        kept.push(line);
    }
    kept.join("\n").trim_end().to_string()
}

pub use candle_core as core;
pub use candle_nn as nn;

use crate::{Attention, Variant};
use candle_core::Tensor;
use std::sync::Arc;

/// Attention of `variant` over q, k and v, keys at positions `0..Skv`. See the [module
/// docs](self) for layouts and gradients.
pub fn attention(
    variant: &Arc<Variant>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> candle_core::Result<Tensor> {
    attention_at(variant, q, k, v, 0)
}

/// Attention with key `j` at position `position_offset + j` (the queries are the last `Sq` of
/// those positions): what RoPE, ALiBi and the masks see.
pub fn attention_at(
    variant: &Arc<Variant>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    position_offset: i64,
) -> candle_core::Result<Tensor> {
    Ok(attention_with_lse(variant, q, k, v, position_offset)?.0)
}

/// Attention and its log-sum-exp: `(out [B, heads, Sq, v_head_dim], lse [B, heads, Sq] f32)`,
/// with `-inf` in the lse of a row that sees no key (its output row is 0). The lse is detached.
pub fn attention_with_lse(
    variant: &Arc<Variant>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    position_offset: i64,
) -> candle_core::Result<(Tensor, Tensor)> {
    attention_learned_with_lse(variant, q, k, v, &[], position_offset)
}

/// Attention of a variant with learnable tensors (`params(...)`, `sinks = learned`): `learned`
/// names each (f32, the spec's shape, on the CPU), and gradients flow into them as into q, k
/// and v. See the [module docs](self) for how they travel through candle.
pub fn attention_learned(
    variant: &Arc<Variant>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    learned: &[(&str, &Tensor)],
    position_offset: i64,
) -> candle_core::Result<Tensor> {
    Ok(attention_learned_with_lse(variant, q, k, v, learned, position_offset)?.0)
}

/// [`attention_learned`] and its log-sum-exp (detached; the sinks included).
pub fn attention_learned_with_lse(
    variant: &Arc<Variant>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    learned: &[(&str, &Tensor)],
    position_offset: i64,
) -> candle_core::Result<(Tensor, Tensor)> {
    attention_with_data(variant, q, k, v, learned, &[], position_offset)
}

/// Attention of a variant with data tensors (`data(...)`) besides its learnable tensors, and
/// its log-sum-exp (detached). `data` names each: an i32 one as a candle I32, U32 or I64 tensor
/// (no gradient), an f32 one as an F32 tensor, into which gradients flow as into a learnable
/// tensor (the Forgetting Transformer's gates). Shapes as a call gives them (`batch` is q's
/// first dimension, `seq` k's keys).
pub fn attention_with_data(
    variant: &Arc<Variant>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    learned: &[(&str, &Tensor)],
    data: &[(&str, &Tensor)],
    position_offset: i64,
) -> candle_core::Result<(Tensor, Tensor)> {
    op::check_inputs(variant, q, k, v)?;
    let ordered = op::check_learned(variant, learned)?;
    let (fixed, floats) = op::check_data(variant, data)?;
    let (op, third) = op_and_third(variant, v, &ordered, (fixed, floats), position_offset)?;
    let saved = op.saved();
    let out = q.apply_op3(k, &third, op)?;
    let lse = saved.lse_tensor(q.device())?;
    Ok((out, lse))
}

/// The ranks a context-parallel call's sequence is split over, and how
/// ([`crate::distributed::ContextParallel`]).
#[derive(Clone)]
pub struct Context {
    /// The group of ranks.
    pub comm: Arc<dyn crate::distributed::Communicator>,
    /// Ulysses or ring.
    pub scheme: crate::distributed::Scheme,
}

/// One rank's part of context-parallel attention: q, k and v hold the positions
/// [`crate::distributed::ContextParallel::split`] gives this rank of a sequence of `ranks * L`
/// (from position 0); every rank of `context` calls it with its part. Gradients flow into q, k,
/// v, the learnable tensors and f32 data tensors; a learnable tensor's gradient is this rank's
/// share (sum it over the ranks, as data-parallel training does with every weight's). Data
/// tensors (`data`, as [`attention_with_data`] takes them) are the whole sequence's on every
/// rank: a document mask's ids `[B, ranks * L]`.
pub fn attention_context_parallel(
    variant: &Arc<Variant>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    learned: &[(&str, &Tensor)],
    data: &[(&str, &Tensor)],
    context: &Context,
) -> candle_core::Result<Tensor> {
    op::check_inputs(variant, q, k, v)?;
    let ordered = op::check_learned(variant, learned)?;
    let checked = op::check_data(variant, data)?;
    let (op, third) = op_and_third(variant, v, &ordered, checked, 0)?;
    q.apply_op3(k, &third, op.in_context(context))
}

/// The op for a call and its third input: v alone, or v packed with the learnable tensors
/// (`ordered`) and the f32 data tensors (`data.1`; `data.0` the i32 ones the op holds).
fn op_and_third(
    variant: &Arc<Variant>,
    v: &Tensor,
    ordered: &[&Tensor],
    (fixed, floats): op::CheckedData,
    position_offset: i64,
) -> candle_core::Result<(op::AttentionOp, Tensor)> {
    if ordered.is_empty() && variant.spec().data.is_empty() {
        return Ok((op::AttentionOp::new(variant, position_offset), v.clone()));
    }
    let mut parts = vec![v.to_dtype(candle_core::DType::F32)?.flatten_all()?];
    for t in ordered.iter().chain(floats.iter().map(|(_, t)| t)) {
        parts.push(t.flatten_all()?);
    }
    let mut tensors = variant.spec().learnable_tensors();
    tensors.extend(floats.iter().map(|(n, t)| (n.clone(), t.dims().to_vec())));
    let packing = op::Packing {
        v_dims: v.dims().to_vec(),
        tensors,
    };
    Ok((
        op::AttentionOp::packed(variant, position_offset, packing, fixed),
        Tensor::cat(&parts, 0)?,
    ))
}

/// Attention over a variable-length batch in FlashAttention's packed layout (see
/// [`crate::runtime::varlen`]): `q [total_q, heads, head_dim]`, `k [total_k, kv_heads,
/// head_dim]`, `v [total_k, kv_heads, v_head_dim]`, sequence `i` the rows
/// `cu_seqlens_q[i]..cu_seqlens_q[i + 1]` of q against `cu_seqlens_k[i]..cu_seqlens_k[i + 1]` of k
/// and v, each at positions from `position_offset`. Returns `(out [total_q, heads, v_head_dim],
/// lse [total_q, heads] f32)`; gradients flow into q, k, v and the learnable tensors (summed
/// over the sequences). Each sequence is one [`attention_learned_with_lse`] on candle views of
/// its rows.
pub fn attention_varlen(
    variant: &Arc<Variant>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: (&[i32], &[i32]),
    learned: &[(&str, &Tensor)],
    position_offset: i64,
) -> candle_core::Result<(Tensor, Tensor)> {
    attention_varlen_with_data(variant, q, k, v, cu_seqlens, learned, &[], position_offset)
}

/// [`attention_varlen`] with the spec's data tensors, packed as a variable-length batch packs
/// them (docs/semantics.md, "Data tensors": a `seq` dimension along k's rows, with no `batch`
/// beside it; without `seq`, `batch` is the number of sequences). Each sequence takes its
/// slice (candle's `narrow`, so the gradients of f32 data land where the slices were taken).
#[allow(clippy::too_many_arguments)]
pub fn attention_varlen_with_data(
    variant: &Arc<Variant>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (cu_seqlens_q, cu_seqlens_k): (&[i32], &[i32]),
    learned: &[(&str, &Tensor)],
    data: &[(&str, &Tensor)],
    position_offset: i64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let spec = variant.spec();
    let (heads, dv) = (spec.heads as usize, spec.v_head_dim as usize);
    let refuse = |what: String| {
        candle_core::Error::Msg(format!("attn::candle: {what} (spec `{}`)", variant.text()))
    };
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 3 {
            return Err(refuse(format!(
                "`{name}` has shape {:?}, expected rank 3 (a packed variable-length batch)",
                t.dims()
            )));
        }
    }
    let sequences =
        crate::runtime::varlen::sequences(cu_seqlens_q, cu_seqlens_k, q.dims()[0], k.dims()[0])
            .map_err(|e| refuse(e.to_string()))?;
    // [len, heads, width] rows as [1, heads, len, width], and back.
    let heads_first = |t: &Tensor, rows: &std::ops::Range<usize>| {
        t.narrow(0, rows.start, rows.len())?
            .transpose(0, 1)?
            .unsqueeze(0)
    };
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for (i, (rows_q, rows_k)) in sequences.iter().enumerate() {
        if rows_q.is_empty() {
            continue;
        }
        let sliced = data
            .iter()
            .map(|(name, t)| Ok((*name, sequence_slice(spec, name, t, i, rows_k)?)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let sliced: Vec<(&str, &Tensor)> = sliced.iter().map(|(n, t)| (*n, t)).collect();
        let (out, lse) = attention_with_data(
            variant,
            &heads_first(q, rows_q)?,
            &heads_first(k, rows_k)?,
            &heads_first(v, rows_k)?,
            learned,
            &sliced,
            position_offset,
        )?;
        outs.push(out.squeeze(0)?.transpose(0, 1)?);
        lses.push(lse.squeeze(0)?.transpose(0, 1)?);
    }
    if outs.is_empty() {
        let dtype = q.dtype();
        return Ok((
            Tensor::zeros((0, heads, dv), dtype, q.device())?,
            Tensor::zeros((0, heads), candle_core::DType::F32, q.device())?,
        ));
    }
    Ok((
        Tensor::cat(&outs, 0)?.contiguous()?,
        Tensor::cat(&lses, 0)?.contiguous()?,
    ))
}

/// Sequence `i`'s slice of the packed data tensor `name` (its keys `rows_k` along `seq`, else
/// its entry along `batch`), shaped as a call of batch 1 takes it.
fn sequence_slice(
    spec: &crate::AttentionSpec,
    name: &str,
    t: &Tensor,
    i: usize,
    rows_k: &std::ops::Range<usize>,
) -> candle_core::Result<Tensor> {
    use attn_dsl::DataDim;
    let Some(decl) = spec.data_decl(name) else {
        // Not a data tensor of the spec: the call names it.
        return Ok(t.clone());
    };
    let dims = &decl.dims;
    let packed_rank =
        dims.len() - usize::from(dims.contains(&DataDim::Seq) && dims.contains(&DataDim::Batch));
    if t.rank() != packed_rank {
        candle_core::bail!(
            "attn::candle: data tensor `{name}` has shape {:?}; a variable-length batch packs it \
             with {packed_rank} dimensions (`seq` along k's rows, no `batch` beside it)",
            t.dims()
        );
    }
    match dims.iter().position(|d| *d == DataDim::Seq) {
        Some(seq) => {
            let batch = dims.iter().position(|d| *d == DataDim::Batch);
            let axis = seq - usize::from(batch.is_some_and(|b| b < seq));
            let slice = t.narrow(axis, rows_k.start, rows_k.len())?;
            match batch {
                Some(b) => slice.unsqueeze(b),
                None => Ok(slice),
            }
        }
        None => match dims.iter().position(|d| *d == DataDim::Batch) {
            Some(b) => t.narrow(b, i, 1),
            None => Ok(t.clone()),
        },
    }
}

/// [`attention`] on the type an `#[attention]` struct declares: `MyLayer::candle_forward(&q,
/// &k, &v)`.
pub trait CandleAttention: Attention {
    /// [`attention`] of this type's variant.
    fn candle_forward(q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        attention(Self::variant(), q, k, v)
    }

    /// [`attention_at`] of this type's variant.
    fn candle_forward_at(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        position_offset: i64,
    ) -> candle_core::Result<Tensor> {
        attention_at(Self::variant(), q, k, v, position_offset)
    }
}

impl<A: Attention> CandleAttention for A {}
