//! The typed API of an attention variant declared with `#[attention(...)]`.

use crate::backend::Backend;
use crate::cache::{KvCache, PagedCache, SeqId};
use crate::calls::{
    BackwardInputs, DecodeOptions, HeadGradients, HeadsBackward, Inputs, MlaBackward, MlaGradients,
    MlaQueries, MlaTensors, Output, Queries,
};
use crate::cpu::CpuBackend;
use crate::learned::Learned;
use crate::variant::Variant;
use crate::varlen::{Varlen, VarlenSaved};
use crate::{RuntimeError, Tensor};
use attn_dsl::{AttentionSpec, DType};
use codegen::KernelPlan;
use std::sync::Arc;

/// An attention variant whose spec is fixed at compile time.
///
/// `#[attention(...)]` implements it for the annotated struct; the spec is validated when the
/// crate compiles, so [`Attention::spec`] cannot fail. The constants let code be typed by the
/// spec (e.g. buffers sized by `HEAD_DIM`). The entry points run on the CPU backend; the
/// `_on` ones on a backend given.
pub trait Attention {
    /// The spec in normalized form.
    const SPEC_TEXT: &'static str;
    /// Query heads.
    const HEADS: u32;
    /// Key/value heads the kernels read (1 for MLA).
    const KV_HEADS: u32;
    /// Query/key head dim (the non-rotary dim for MLA).
    const HEAD_DIM: u32;
    /// Value head dim.
    const V_HEAD_DIM: u32;
    /// Storage dtype.
    const DTYPE: DType;
    /// The spec's learnable tensors, `(name, shape)`: each parameter of `params(...)`, then
    /// `sinks` (`[HEADS]`) with `sinks = learned`. Empty for most specs. The `*_learned`
    /// methods take a tensor of each, by name.
    const LEARNED: &'static [(&'static str, &'static [usize])] = &[];

    /// The spec (built as data by the macro, on first use).
    fn spec() -> &'static AttentionSpec;

    /// The variant: the spec validated and planned once, with the kernels built for it (and,
    /// on first use, the embedded kernels registered with the GPU backends).
    fn variant() -> &'static Arc<Variant>;

    /// The GPU kernels compiled at cargo time for the spec's `targets` (attn's `aot` feature):
    /// PTX and launch records. Empty without targets.
    fn embedded_kernels() -> &'static [crate::gpu::ptx::EmbeddedKernel] {
        &[]
    }

    /// The forward kernel plan of the spec.
    fn forward_plan() -> &'static KernelPlan {
        Self::variant().forward_plan()
    }

    /// Attention output `[B, HEADS, Sq, V_HEAD_DIM]` for q `[B, HEADS, Sq, HEAD_DIM]`, k and v
    /// `[B, KV_HEADS, Skv, ..]`, keys at positions `0..Skv` (CPU backend).
    fn forward(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor, RuntimeError> {
        Ok(Self::forward_with_lse(q, k, v, 0)?.out)
    }

    /// Output and log-sum-exp, keys at positions `position_offset + j` (CPU backend).
    fn forward_with_lse(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        Self::forward_on(&CpuBackend::new(), q, k, v, position_offset)
    }

    /// Gradients `(dq, dk, dv)` for `dout = dL/dout`, given the forward's inputs and what
    /// [`Attention::forward_with_lse`] returned (`out` and `lse`, which is all the backward
    /// saves: it recomputes the probabilities tile by tile), keys at positions `0..Skv` (CPU
    /// backend). dq and dk are with respect to q and k before RoPE.
    fn backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
    ) -> Result<HeadGradients, RuntimeError> {
        Self::backward_with(&HeadsBackward {
            q,
            k,
            v,
            out,
            lse,
            dout,
            position_offset: 0,
        })
    }

    /// [`Attention::backward`] with every input named, keys at `x.position_offset + j`.
    fn backward_with(x: &HeadsBackward) -> Result<HeadGradients, RuntimeError> {
        Self::backward_on(&CpuBackend::new(), x)
    }

    /// [`Attention::forward_with_lse`] on any backend, such as the CUDA one, which runs the
    /// kernels embedded for the device's target (`targets = [..]`), else cached or compiled
    /// ones, else says what is missing.
    fn forward_on(
        backend: &dyn Backend,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        backend.forward(Self::variant(), Inputs::heads(q, k, v), position_offset)
    }

    /// [`Attention::forward_with_lse`] with the spec's learnable tensors, one for each entry of
    /// [`Attention::LEARNED`] (f32, that shape), by name (CPU backend).
    fn forward_learned(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        learned: &[(&str, &Tensor)],
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        CpuBackend::new().forward_learned(
            Self::variant(),
            Inputs::heads(q, k, v),
            position_offset,
            Learned::new(learned),
        )
    }

    /// [`Attention::backward_with`] with the learnable tensors the forward took; their
    /// gradients are [`HeadGradients::learned`] (CPU backend).
    fn backward_learned(
        x: &HeadsBackward,
        learned: &[(&str, &Tensor)],
    ) -> Result<HeadGradients, RuntimeError> {
        CpuBackend::new()
            .backward_learned(
                Self::variant(),
                &BackwardInputs::Heads(*x),
                Learned::new(learned),
            )?
            .heads()
    }

    /// [`Attention::forward_on`] with the call's learnable and data tensors (`data(...)`:
    /// `Learned::new(&learned).with_data(&data)`), on any backend.
    fn forward_with_data_on(
        backend: &dyn Backend,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        tensors: Learned,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        backend.forward_learned(
            Self::variant(),
            Inputs::heads(q, k, v),
            position_offset,
            tensors,
        )
    }

    /// The gradients of [`Attention::forward_with_data_on`], the tensors it took again: each f32
    /// data tensor's read by the score modifier (`d<name>`) among
    /// [`HeadGradients::learned`].
    fn backward_with_data_on(
        backend: &dyn Backend,
        x: &HeadsBackward,
        tensors: Learned,
    ) -> Result<HeadGradients, RuntimeError> {
        backend
            .backward_learned(Self::variant(), &BackwardInputs::Heads(*x), tensors)?
            .heads()
    }

    /// [`Attention::backward_with`] on any backend (see [`Attention::forward_on`]).
    fn backward_on(
        backend: &dyn Backend,
        x: &HeadsBackward,
    ) -> Result<HeadGradients, RuntimeError> {
        backend
            .backward(Self::variant(), &BackwardInputs::Heads(*x))?
            .heads()
    }

    /// Attention over a variable-length batch ([`crate::varlen`]: q, k and v packed, with
    /// `cu_seqlens_q` and `cu_seqlens_k`) on any backend, with the spec's learnable tensors by
    /// name: `out [total_q, heads, v_head_dim]`, `lse [total_q, heads]`.
    fn forward_varlen_on(
        backend: &dyn Backend,
        x: Varlen,
        learned: &[(&str, &Tensor)],
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        backend.forward_varlen(Self::variant(), x, position_offset, Learned::new(learned))
    }

    /// The gradients of [`Attention::forward_varlen_on`] for `dL/dout` (`saved` holds its
    /// `out` and `lse`), packed as the batch is.
    fn backward_varlen_on(
        backend: &dyn Backend,
        x: Varlen,
        saved: VarlenSaved,
        learned: &[(&str, &Tensor)],
        position_offset: i64,
    ) -> Result<HeadGradients, RuntimeError> {
        let learned = Learned::new(learned);
        backend.backward_varlen(Self::variant(), x, saved, position_offset, learned)
    }

    /// [`Attention::decode`] on any backend (see [`Attention::forward_on`]).
    fn decode_on(
        backend: &dyn Backend,
        q: &Tensor,
        cache: &dyn KvCache,
        seqs: &[SeqId],
    ) -> Result<Output, RuntimeError> {
        let queries = Queries::Uniform(q);
        backend.attend_cached(
            Self::variant(),
            queries,
            cache,
            seqs,
            DecodeOptions::default(),
        )
    }

    /// MLA output and log-sum-exp, and the latent output the MLA backward takes (CPU backend,
    /// absorbed form).
    fn forward_mla(x: &MlaTensors, position_offset: i64) -> Result<Output, RuntimeError> {
        CpuBackend::new().forward(Self::variant(), Inputs::Mla(*x), position_offset)
    }

    /// MLA's gradients (q_nope, q_pe, c_kv, k_pe, w_kv_b) for `x.dout`, given what
    /// [`Attention::forward_mla`] returned (CPU backend). q_pe and k_pe are before RoPE.
    fn backward_mla(x: &MlaBackward) -> Result<MlaGradients, RuntimeError> {
        CpuBackend::new()
            .backward(Self::variant(), &BackwardInputs::Mla(*x))?
            .mla()
    }

    /// The decode kernel plan of the spec.
    fn decode_plan() -> &'static KernelPlan {
        Self::variant().decode_plan()
    }

    /// A paged KV cache laid out for this spec: `num_blocks` blocks of `block_size` tokens.
    fn paged_cache(block_size: usize, num_blocks: usize) -> Result<PagedCache, RuntimeError> {
        PagedCache::new(Self::spec(), block_size, num_blocks)
    }

    /// A decoding step: q `[B, HEADS, q_len, HEAD_DIM]` holds the last `q_len` tokens of each
    /// sequence of `seqs`, whose keys and values the cache already holds (CPU backend).
    fn decode(q: &Tensor, cache: &impl KvCache, seqs: &[SeqId]) -> Result<Output, RuntimeError> {
        Self::decode_on(&CpuBackend::new(), q, cache, seqs)
    }

    /// An MLA decoding step against a latent cache (absorbed form, CPU backend).
    fn decode_mla(
        queries: MlaQueries,
        cache: &impl KvCache,
        seqs: &[SeqId],
    ) -> Result<Output, RuntimeError> {
        let queries = Queries::Mla(queries);
        CpuBackend::new().attend_cached(
            Self::variant(),
            queries,
            cache,
            seqs,
            DecodeOptions::default(),
        )
    }
}
