//! One interface over the backends: what a caller needs to run attention without knowing where
//! it runs. [`CpuBackend`](crate::cpu::CpuBackend) (Cranelift kernels),
//! [`GpuSim`](crate::gpu::sim::GpuSim) (the GPU kernels on the GPU IR interpreter: slow, exact
//! as to what the kernels compute, no GPU needed) and, with the `cuda` feature,
//! `gpu::cuda::CudaBackend` implement it; [`crate::backends::open`] opens one by name. Inputs
//! and outputs are host tensors ([`crate::calls`]); caches are in host memory.

use crate::cache::{KvCache, SeqId};
use crate::calls::{
    BackwardInputs, DecodeOptions, Gradients, HeadGradients, HeadsBackward, Inputs, Output, Queries,
};
use crate::error::RuntimeError;
use crate::host::checks::ensure_call_fits;
use crate::learned::{Bound, Learned};
use crate::placement::Placement;
use crate::tensor::Tensor;
use crate::variant::Variant;
use crate::varlen::{Varlen, VarlenSaved};

/// Attention on one backend. Every call takes a [`Variant`]: the spec validated and planned
/// once, with the kernels the backend built for it the first time. Inputs of the other kind
/// than the variant's (per-head for an MLA variant, or the reverse) are a spec error; what a
/// backend does not run is [`RuntimeError::Unsupported`].
///
/// A spec with learnable tensors (`params(...)`, `sinks = learned`) takes them with each call
/// ([`Backend::forward_learned`] and the like); the calls without them refuse such a spec,
/// naming what is missing. A backend implements the `*_bound` methods, which receive the
/// parameters laid out for its kernels; sinks are added around them here.
pub trait Backend: Send + Sync {
    /// The backend's name, as the CLI spells it (`cpu`, `cuda`, `gpu-sim`).
    fn name(&self) -> &'static str;

    /// Attention over `inputs`, keys at positions `position_offset + j` (queries are the last
    /// `Sq` of `position_offset .. position_offset + Skv`). MLA runs in the absorbed form and
    /// also returns its latent output.
    fn forward(
        &self,
        variant: &Variant,
        inputs: Inputs,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        self.forward_learned(variant, inputs, position_offset, Learned::none())
    }

    /// [`Backend::forward`] with the spec's learnable tensors.
    fn forward_learned(
        &self,
        variant: &Variant,
        inputs: Inputs,
        position_offset: i64,
        learned: Learned,
    ) -> Result<Output, RuntimeError> {
        ensure_forward_fits(variant, &inputs)?;
        let bound = match inputs {
            Inputs::Heads { q, k, .. } => learned.bind_call(
                variant.spec(),
                &call_dims(q.shape(), k.shape(), position_offset),
            )?,
            Inputs::Mla(_) => learned.bind(variant.spec())?,
        };
        let mut output = self.forward_bound(variant, inputs, position_offset, &bound.params)?;
        bound.apply_sinks(
            &mut output.out,
            &mut output.lse,
            variant.spec().heads as usize,
        )?;
        Ok(output)
    }

    /// The backend's forward, with the parameters laid out as the plan's
    /// [`codegen::plan::ParamLayout`] says (empty without parameters), and no sinks.
    fn forward_bound(
        &self,
        variant: &Variant,
        inputs: Inputs,
        position_offset: i64,
        params: &[f32],
    ) -> Result<Output, RuntimeError>;

    /// Queries against cached sequences `seqs` (their keys and values appended already):
    /// equal to [`Backend::forward`] over each sequence's cached keys, split into partitions
    /// of keys merged by their log-sum-exp.
    fn attend_cached(
        &self,
        variant: &Variant,
        queries: Queries,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        self.attend_cached_learned(variant, queries, cache, seqs, options, Learned::none())
    }

    /// [`Backend::attend_cached`] with the spec's learnable tensors. Each row's sink is added
    /// once, after the partitions are merged.
    fn attend_cached_learned(
        &self,
        variant: &Variant,
        queries: Queries,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
        learned: Learned,
    ) -> Result<Output, RuntimeError> {
        let bound = learned.bind(variant.spec())?;
        let mut output =
            self.attend_cached_bound(variant, queries, cache, seqs, options, &bound.params)?;
        bound.apply_sinks(
            &mut output.out,
            &mut output.lse,
            variant.spec().heads as usize,
        )?;
        Ok(output)
    }

    /// The backend's cached call, parameters as in [`Backend::forward_bound`], no sinks.
    fn attend_cached_bound(
        &self,
        variant: &Variant,
        queries: Queries,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
        params: &[f32],
    ) -> Result<Output, RuntimeError>;

    /// Gradients for `dL/dout` (FlashAttention-2 recomputation from the saved lse); dq and dk
    /// (MLA: q_pe and k_pe) are with respect to the inputs before RoPE.
    fn backward(&self, variant: &Variant, x: &BackwardInputs) -> Result<Gradients, RuntimeError> {
        self.backward_learned(variant, x, Learned::none())
    }

    /// [`Backend::backward`] with the spec's learnable tensors (the values the forward took;
    /// `out` and `lse` are the forward's, sinks included). Their gradients are in
    /// [`crate::calls::HeadGradients::learned`], each exact and the same for any thread count.
    fn backward_learned(
        &self,
        variant: &Variant,
        x: &BackwardInputs,
        learned: Learned,
    ) -> Result<Gradients, RuntimeError> {
        let spec = variant.spec();
        let tensors = match x {
            BackwardInputs::Heads(h) => vec![h.q, h.k, h.v, h.out, h.lse, h.dout],
            BackwardInputs::Mla(m) => {
                let x = &m.x;
                vec![
                    x.q_nope, x.q_pe, x.c_kv, x.k_pe, x.w_kv_b, m.latent, m.lse, m.dout,
                ]
            }
        };
        // The gradients and each input's converted copy.
        ensure_call_fits("this backward call", &tensors, 0, 2)?;
        let bound = match x {
            BackwardInputs::Heads(h) => learned.bind_call(
                spec,
                &call_dims(h.q.shape(), h.k.shape(), h.position_offset),
            )?,
            BackwardInputs::Mla(_) => learned.bind(spec)?,
        };
        let (mut gradients, dparams) = self.backward_bound(variant, x, &bound.params)?;
        if let (Gradients::Heads(g), BackwardInputs::Heads(x)) = (&mut gradients, x) {
            g.learned = learned_gradients(spec, &bound, dparams, x)?;
        }
        Ok(gradients)
    }

    /// The backend's backward, parameters as in [`Backend::forward_bound`]: the gradients and,
    /// laid out as the parameters, the parameters' gradients (empty without parameters).
    fn backward_bound(
        &self,
        variant: &Variant,
        x: &BackwardInputs,
        params: &[f32],
    ) -> Result<(Gradients, Vec<f32>), RuntimeError>;

    /// Attention over a variable-length batch ([`crate::varlen`]: FlashAttention's packed
    /// layout and cumulative offsets), with the spec's learnable tensors: `out [total_q,
    /// heads, v_head_dim]`, `lse [total_q, heads]`. Each sequence runs as its own call.
    fn forward_varlen(
        &self,
        variant: &Variant,
        x: Varlen,
        position_offset: i64,
        learned: Learned,
    ) -> Result<Output, RuntimeError> {
        crate::varlen::forward(variant, x, learned, |inputs, learned| {
            self.forward_learned(variant, inputs, position_offset, learned)
        })
    }

    /// The gradients of [`Backend::forward_varlen`] for `dL/dout` (`saved` holds the forward's
    /// `out` and `lse`): dq, dk and dv in the batch's layouts, each learnable tensor's summed
    /// over the sequences.
    fn backward_varlen(
        &self,
        variant: &Variant,
        x: Varlen,
        saved: VarlenSaved,
        position_offset: i64,
        learned: Learned,
    ) -> Result<HeadGradients, RuntimeError> {
        crate::varlen::backward(
            variant,
            x,
            saved,
            (position_offset, learned),
            |inputs, learned| self.backward_learned(variant, inputs, learned),
        )
    }

    /// A piece of a larger call ([`Placement`]: some of the spec's heads, or queries that do
    /// not end at the last key), as context parallelism runs one: per-head inputs holding the
    /// placement's heads, the spec's learnable tensors whole (indexed by the spec's heads), and
    /// no sinks, which the pieces' merged result takes once
    /// ([`crate::learned::Bound::apply_sinks`]). Backends that run no placed calls refuse
    /// every placement but a whole call; the CPU backend runs them.
    fn forward_placed(
        &self,
        variant: &Variant,
        inputs: Inputs,
        position_offset: i64,
        learned: Learned,
        placement: Placement,
    ) -> Result<Output, RuntimeError> {
        refuse_placed(self.name(), placement)?;
        ensure_forward_fits(variant, &inputs)?;
        let Inputs::Heads { q, k, .. } = inputs else {
            return Err(not_placed_mla(self.name()));
        };
        let bound = bind_placed(variant.spec(), q, k, position_offset, learned, placement)?;
        self.forward_bound(variant, inputs, position_offset, &bound.params)
    }

    /// The gradients of [`Backend::forward_placed`] for `dL/dout` (`out` and `lse` those of
    /// the merged result, sinks included): dq, dk, dv of the piece's tensors and the learnable
    /// tensors' share from this piece (no `dsinks`: see [`crate::learned::Bound`]).
    fn backward_placed(
        &self,
        variant: &Variant,
        x: &HeadsBackward,
        learned: Learned,
        placement: Placement,
    ) -> Result<HeadGradients, RuntimeError> {
        refuse_placed(self.name(), placement)?;
        let bound = bind_placed(
            variant.spec(),
            x.q,
            x.k,
            x.position_offset,
            learned,
            placement,
        )?;
        let (gradients, dparams) =
            self.backward_bound(variant, &BackwardInputs::Heads(*x), &bound.params)?;
        placed_gradients(variant.spec(), &bound, gradients, dparams, x)
    }
}

/// Refuses a placement other than a whole call on a backend that runs no placed calls.
fn refuse_placed(backend: &'static str, placement: Placement) -> Result<(), RuntimeError> {
    if placement.is_whole() {
        return Ok(());
    }
    Err(RuntimeError::Unsupported {
        backend,
        what: "placed calls (pieces of a context-parallel call); the cpu backend does".into(),
    })
}

/// The error of an MLA call given to [`Backend::forward_placed`].
pub(crate) fn not_placed_mla(backend: &'static str) -> RuntimeError {
    RuntimeError::Unsupported {
        backend,
        what: "MLA calls as placed pieces (context parallelism takes per-head specs)".into(),
    }
}

/// The learnable tensors of a placed call, bound without sinks; its data tensors over the
/// placement's `data_seq` (a shifted call's keys are a piece of a sequence whose data it reads
/// whole).
pub(crate) fn bind_placed(
    spec: &attn_dsl::AttentionSpec,
    q: &Tensor,
    k: &Tensor,
    position_offset: i64,
    learned: Learned,
    placement: Placement,
) -> Result<Bound, RuntimeError> {
    let call = attn_dsl::data::CallDims {
        query_shift: placement.query_shift,
        data_seq: placement.data_seq,
        ..call_dims(q.shape(), k.shape(), position_offset)
    };
    let mut bound = learned.bind_call(spec, &call)?;
    bound.sinks = None;
    Ok(bound)
}

/// A placed backward's gradients with the learnable tensors' (`bound` has no sinks).
pub(crate) fn placed_gradients(
    spec: &attn_dsl::AttentionSpec,
    bound: &Bound,
    gradients: Gradients,
    dparams: Vec<f32>,
    x: &HeadsBackward,
) -> Result<HeadGradients, RuntimeError> {
    let mut g = gradients.heads()?;
    g.learned = learned_gradients(spec, bound, dparams, x)?;
    Ok(g)
}

/// A per-head call's dimensions from its q and k shapes (`[B, H, S, D]`; a shape of another
/// rank gives zeros, and the backend's own checks name it).
fn call_dims(q: &[usize], k: &[usize], position_offset: i64) -> attn_dsl::data::CallDims {
    let at = |s: &[usize], i: usize| if s.len() == 4 { s[i] } else { 0 };
    attn_dsl::data::CallDims::new(at(q, 0), at(q, 2), at(k, 2), position_offset)
}

/// The gradient tensors of a call's learnable tensors, `d<name>` in the spec's order.
fn learned_gradients(
    spec: &attn_dsl::AttentionSpec,
    bound: &Bound,
    dparams: Vec<f32>,
    x: &crate::calls::HeadsBackward,
) -> Result<Vec<(String, Tensor)>, RuntimeError> {
    let layout = codegen::plan::ParamLayout::of(spec);
    let mut out = Vec::new();
    let params = layout
        .slots
        .iter()
        .map(|slot| (&slot.name, slot.offset, &slot.shape));
    let data = bound
        .data_grads
        .iter()
        .map(|(n, at, shape)| (n, *at, shape));
    for (name, offset, shape) in params.chain(data) {
        let n: usize = shape.iter().product();
        let values = dparams
            .get(offset..offset + n)
            .map(<[f32]>::to_vec)
            .ok_or_else(|| {
                RuntimeError::Data(format!(
                    "the backward returned {} parameter gradients; the spec has {}",
                    dparams.len(),
                    layout.len()
                ))
            })?;
        out.push((format!("d{name}"), Tensor::from_f32(shape, values)?));
    }
    if let Some(d) = bound.sink_gradient(x.out, x.lse, x.dout, spec.heads as usize)? {
        let shape = [d.len()];
        out.push((
            format!("d{}", attn_dsl::SINKS_NAME),
            Tensor::from_f32(&shape, d)?,
        ));
    }
    Ok(out)
}

/// [`ensure_call_fits`] for a forward: its inputs (each possibly converted once) and its
/// output, `[B, heads, Sq, v_head_dim]` (and MLA's latent output, `[B, heads, Sq, rank]`).
pub(crate) fn ensure_forward_fits(variant: &Variant, inputs: &Inputs) -> Result<(), RuntimeError> {
    let spec = variant.spec();
    let (tensors, queries) = match inputs {
        Inputs::Heads { q, k, v } => (vec![*q, *k, *v], *q),
        Inputs::Mla(m) => (vec![m.q_nope, m.q_pe, m.c_kv, m.k_pe, m.w_kv_b], m.q_nope),
    };
    // One output row (and lse value) per query row: every axis of q but the last.
    let row_axes: Vec<u64> = queries
        .shape()
        .iter()
        .rev()
        .skip(1)
        .map(|&n| n as u64)
        .collect();
    let width = u64::from(spec.v_head_dim) + spec.mla().map_or(0, |m| u64::from(m.latent_rank));
    let out =
        crate::memory::checked_product(&row_axes).and_then(|rows| rows.checked_mul(width + 1));
    let Some(out) = out else {
        return crate::memory::ensure_fits("this call's output", None);
    };
    ensure_call_fits("this call's inputs and output", &tensors, out, 1)
}
