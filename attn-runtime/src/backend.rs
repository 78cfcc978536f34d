//! One interface over the backends: what a caller needs to run attention without knowing where
//! it runs. [`CpuBackend`] (Cranelift kernels), [`GpuInterpreter`] (the GPU kernels on the GPU
//! IR interpreter: slow, exact as to what the kernels compute, no GPU needed) and, with the
//! `cuda` feature, `gpu::cuda::CudaBackend` implement it. Inputs and outputs are host tensors;
//! caches are in host memory.

use crate::cache::{KvCache, SeqId};
use crate::cpu::CpuBackend;
use crate::error::RuntimeError;
use crate::gpu;
use crate::gpu::sim_cost;
use crate::model::ops::{CpuLayers, LayerOps};
use crate::tensor::Tensor;
use crate::variant::Variant;

/// Attention outputs.
#[derive(Clone, Debug)]
pub struct Output {
    /// `[B, Hq, Sq, Dv]` in the spec's dtype.
    pub out: Tensor,
    /// `[B, Hq, Sq]` f32: natural log of the softmax denominator, `-inf` for empty rows.
    pub lse: Tensor,
}

/// The inputs of a backward call: the forward's inputs and outputs, and the gradient of the
/// loss with respect to the output.
#[derive(Clone, Copy, Debug)]
pub struct BackwardInputs<'a> {
    /// `[B, heads, Sq, head_dim]`, before RoPE.
    pub q: &'a Tensor,
    /// `[B, kv_heads, Skv, head_dim]`, before RoPE.
    pub k: &'a Tensor,
    /// `[B, kv_heads, Skv, v_head_dim]`.
    pub v: &'a Tensor,
    /// The forward's output, `[B, heads, Sq, v_head_dim]`.
    pub out: &'a Tensor,
    /// The forward's log-sum-exp, `[B, heads, Sq]`.
    pub lse: &'a Tensor,
    /// `dL/dout`, `[B, heads, Sq, v_head_dim]`.
    pub dout: &'a Tensor,
    /// Position of key 0, as in the forward call.
    pub position_offset: i64,
}

/// Gradients of attention with respect to its inputs, in the spec's dtype.
#[derive(Clone, Debug)]
pub struct Gradients {
    /// `dL/dq`, `[B, heads, Sq, head_dim]` (for q before RoPE).
    pub dq: Tensor,
    /// `dL/dk`, `[B, kv_heads, Skv, head_dim]` (for k before RoPE; summed over each group).
    pub dk: Tensor,
    /// `dL/dv`, `[B, kv_heads, Skv, v_head_dim]` (summed over each group).
    pub dv: Tensor,
}

/// Options of a cached call.
#[derive(Clone, Copy, Debug, Default)]
pub struct DecodeOptions {
    /// Partitions of each item's keys (split-KV); `None` picks enough to keep every thread busy.
    pub partitions: Option<usize>,
}

/// Inputs of MLA attention (DeepSeek layout; see `attn_dsl::reference::MlaInputs`).
#[derive(Clone, Copy, Debug)]
pub struct MlaTensors<'a> {
    /// `[B, H, Sq, head_dim]`.
    pub q_nope: &'a Tensor,
    /// `[B, H, Sq, rope_dim]`, before RoPE.
    pub q_pe: &'a Tensor,
    /// `[B, Skv, latent_rank]`, after the latent norm.
    pub c_kv: &'a Tensor,
    /// `[B, Skv, rope_dim]`, before RoPE.
    pub k_pe: &'a Tensor,
    /// `[H * (head_dim + v_head_dim), latent_rank]`.
    pub w_kv_b: &'a Tensor,
}

/// What an MLA forward saves for its backward: the output and lse, and the latent output
/// (`softmax @ c_kv` per head, before `W_uv`), which the gradient of `W_uv` needs.
#[derive(Clone, Debug)]
pub struct MlaSaved {
    /// `[B, H, Sq, v_head_dim]` in the spec's dtype.
    pub out: Tensor,
    /// `[B, H, Sq]` f32.
    pub lse: Tensor,
    /// `[B, H, Sq, latent_rank]` f32.
    pub out_latent: Tensor,
}

/// The inputs of an MLA backward call: the forward's inputs, what it saved, and
/// `dout = dL/dout`.
#[derive(Clone, Copy, Debug)]
pub struct MlaBackwardInputs<'a> {
    /// The forward's inputs.
    pub x: MlaTensors<'a>,
    /// `[B, H, Sq, latent_rank]`, from [`MlaSaved`].
    pub out_latent: &'a Tensor,
    /// `[B, H, Sq]`, from [`MlaSaved`].
    pub lse: &'a Tensor,
    /// `[B, H, Sq, v_head_dim]`.
    pub dout: &'a Tensor,
    /// The position of key 0.
    pub position_offset: i64,
}

/// Gradients of MLA attention with respect to its inputs, in the spec's dtype.
#[derive(Clone, Debug)]
pub struct MlaGradients {
    /// `[B, H, Sq, head_dim]`.
    pub dq_nope: Tensor,
    /// `[B, H, Sq, rope_dim]`, for q_pe before RoPE.
    pub dq_pe: Tensor,
    /// `[B, Skv, latent_rank]`.
    pub dc_kv: Tensor,
    /// `[B, Skv, rope_dim]`, for k_pe before RoPE (summed over heads).
    pub dk_pe: Tensor,
    /// `[H * (head_dim + v_head_dim), latent_rank]`.
    pub dw_kv_b: Tensor,
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

/// Attention on one backend. Every call takes a [`Variant`]: the spec validated and planned
/// once, with the kernels the backend built for it the first time.
pub trait Backend: Send + Sync {
    /// The backend's name, as the CLI spells it (`cpu`, `cuda`, `gpu-sim`).
    fn name(&self) -> &'static str;

    /// Attention for a per-head variant: q `[B, heads, Sq, head_dim]`, k `[B, kv_heads, Skv,
    /// head_dim]`, v `[B, kv_heads, Skv, v_head_dim]`, keys at positions `position_offset + j`
    /// (see [`CpuBackend::forward`]).
    fn forward(
        &self,
        variant: &Variant,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        position_offset: i64,
    ) -> Result<Output, RuntimeError>;

    /// MLA attention in the absorbed form (see [`CpuBackend::forward_mla`]).
    fn forward_mla(
        &self,
        variant: &Variant,
        x: &MlaTensors,
        position_offset: i64,
    ) -> Result<Output, RuntimeError>;

    /// Queries against cached sequences (see [`CpuBackend::decode`]).
    fn decode(
        &self,
        variant: &Variant,
        q: &Tensor,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError>;

    /// MLA queries against a latent cache (see [`CpuBackend::decode_mla`]).
    fn decode_mla(
        &self,
        variant: &Variant,
        queries: MlaQueries,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError>;

    /// A ragged batch against cached sequences (see [`CpuBackend::attend_ragged`]).
    fn attend_ragged(
        &self,
        variant: &Variant,
        q: &Tensor,
        q_offsets: &[usize],
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError>;

    /// Gradients of attention for a per-head variant (see [`CpuBackend::backward`]).
    fn backward(&self, variant: &Variant, x: &BackwardInputs) -> Result<Gradients, RuntimeError>;

    /// An MLA forward that saves what its backward needs (see
    /// [`CpuBackend::forward_mla_saving`]); the CPU backend only, for now.
    fn forward_mla_saving(
        &self,
        _variant: &Variant,
        _x: &MlaTensors,
        _position_offset: i64,
    ) -> Result<MlaSaved, RuntimeError> {
        Err(mla_backward_on(self.name()))
    }

    /// Gradients of MLA attention (see [`CpuBackend::backward_mla`]); the CPU backend only, for
    /// now.
    fn backward_mla(
        &self,
        _variant: &Variant,
        _x: &MlaBackwardInputs,
    ) -> Result<MlaGradients, RuntimeError> {
        Err(mla_backward_on(self.name()))
    }

    /// Where a model's norms, activations, residual adds, embedding lookups and greedy choice
    /// run on this backend (the CPU unless a backend says otherwise).
    fn layers(&self) -> &dyn LayerOps {
        &CpuLayers
    }
}

/// The error of a backend without the MLA backward.
fn mla_backward_on(backend: &str) -> RuntimeError {
    RuntimeError::Spec(format!(
        "the backward pass of MLA specs runs on the cpu backend only for now, not {backend}"
    ))
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn backward(&self, variant: &Variant, x: &BackwardInputs) -> Result<Gradients, RuntimeError> {
        self.backward_in(variant, x)
    }

    fn forward_mla_saving(
        &self,
        variant: &Variant,
        x: &MlaTensors,
        position_offset: i64,
    ) -> Result<MlaSaved, RuntimeError> {
        self.forward_mla_saving_in(variant, x, position_offset)
    }

    fn backward_mla(
        &self,
        variant: &Variant,
        x: &MlaBackwardInputs,
    ) -> Result<MlaGradients, RuntimeError> {
        self.backward_mla_in(variant, x)
    }

    fn forward(
        &self,
        variant: &Variant,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        self.forward_in(variant, q, k, v, position_offset)
    }

    fn forward_mla(
        &self,
        variant: &Variant,
        x: &MlaTensors,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        self.forward_mla_in(variant, x, position_offset)
    }

    fn decode(
        &self,
        variant: &Variant,
        q: &Tensor,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        self.decode_in(variant, q, cache, seqs, options)
    }

    fn decode_mla(
        &self,
        variant: &Variant,
        queries: MlaQueries,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        self.decode_mla_in(variant, queries, cache, seqs, options)
    }

    fn attend_ragged(
        &self,
        variant: &Variant,
        q: &Tensor,
        q_offsets: &[usize],
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        self.attend_ragged_in(variant, q, q_offsets, cache, seqs, options)
    }
}

#[cfg(feature = "cuda")]
impl Backend for gpu::cuda::CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn backward(&self, variant: &Variant, x: &BackwardInputs) -> Result<Gradients, RuntimeError> {
        gpu::cuda::CudaBackend::backward(self, variant, x)
    }

    fn forward(
        &self,
        variant: &Variant,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        gpu::cuda::CudaBackend::forward(self, variant, q, k, v, position_offset)
    }

    fn forward_mla(
        &self,
        variant: &Variant,
        x: &MlaTensors,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        gpu::cuda::CudaBackend::forward_mla(self, variant, x, position_offset)
    }

    fn decode(
        &self,
        variant: &Variant,
        q: &Tensor,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        gpu::cuda::CudaBackend::decode(self, variant, q, cache, seqs, options)
    }

    fn decode_mla(
        &self,
        variant: &Variant,
        queries: MlaQueries,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        gpu::cuda::CudaBackend::decode_mla(self, variant, queries, cache, seqs, options)
    }

    fn attend_ragged(
        &self,
        variant: &Variant,
        q: &Tensor,
        q_offsets: &[usize],
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        gpu::cuda::CudaBackend::attend_ragged(self, variant, q, q_offsets, cache, seqs, options)
    }
}

/// The GPU kernels run on the GPU IR interpreter, with the launches a device would get.
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuInterpreter;

impl Backend for GpuInterpreter {
    fn name(&self) -> &'static str {
        "gpu-sim"
    }

    fn backward(&self, variant: &Variant, x: &BackwardInputs) -> Result<Gradients, RuntimeError> {
        let [b, _, sq, skv] = bhss(x.q, x.k);
        let seconds = sim_cost::attention_seconds(variant.spec(), b, sq, skv, true);
        sim_cost::check("this forward and backward", seconds)?;
        gpu::backward_emulated(variant, x)
    }

    fn forward(
        &self,
        variant: &Variant,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        let [b, _, sq, skv] = bhss(q, k);
        let seconds = sim_cost::attention_seconds(variant.spec(), b, sq, skv, false);
        sim_cost::check("this forward", seconds)?;
        gpu::GpuCall::forward_in(variant, q, k, v, position_offset)?.run_emulated()
    }

    fn forward_mla(
        &self,
        variant: &Variant,
        x: &MlaTensors,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        let dim = |t: &Tensor, i: usize| t.shape().get(i).map_or(0, |&d| d as u64);
        let (b, sq, skv) = (dim(x.q_nope, 0), dim(x.q_nope, 2), dim(x.c_kv, 1));
        let seconds = sim_cost::attention_seconds(variant.spec(), b, sq, skv, false);
        sim_cost::check("this forward", seconds)?;
        gpu::forward_mla_emulated_in(variant, x, position_offset)
    }

    fn decode(
        &self,
        variant: &Variant,
        q: &Tensor,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        let q_len = q.shape().get(2).map_or(0, |&n| n as u64);
        check_decode(variant, cache, seqs.iter().map(|&s| (s, q_len)))?;
        gpu::decode_with(variant, q, cache, seqs, options, &gpu::emulate)
    }

    fn decode_mla(
        &self,
        variant: &Variant,
        queries: MlaQueries,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        let q_len = queries.q_nope.shape().get(2).map_or(0, |&n| n as u64);
        check_decode(variant, cache, seqs.iter().map(|&s| (s, q_len)))?;
        gpu::decode_mla_with(variant, queries, cache, seqs, options, &gpu::emulate)
    }

    fn attend_ragged(
        &self,
        variant: &Variant,
        q: &Tensor,
        q_offsets: &[usize],
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        let queries = q_offsets
            .windows(2)
            .map(|w| w[1].saturating_sub(w[0]) as u64);
        check_decode(variant, cache, seqs.iter().copied().zip(queries))?;
        gpu::attend_ragged_with(variant, q, q_offsets, cache, seqs, options, &gpu::emulate)
    }

    fn layers(&self) -> &dyn LayerOps {
        &gpu::layers::InterpretedLayers
    }
}

/// `[batch, heads, queries, keys]` of q `[B, H, Sq, D]` and k `[B, Hkv, Skv, D]`, 0 where a
/// tensor has fewer dims (the call's own checks refuse it after).
fn bhss(q: &Tensor, k: &Tensor) -> [u64; 4] {
    let dim = |t: &Tensor, i: usize| t.shape().get(i).map_or(0, |&d| d as u64);
    [dim(q, 0), dim(q, 1), dim(q, 2), dim(k, 2)]
}

/// Refuses decode work on the interpreter (`(sequence, queries)` pairs against the cache) that
/// would take it too long.
fn check_decode(
    variant: &Variant,
    cache: &dyn KvCache,
    work: impl Iterator<Item = (SeqId, u64)>,
) -> Result<(), RuntimeError> {
    let seconds: f64 = work
        .map(|(seq, queries)| {
            let keys = cache.seq_len(seq).unwrap_or(0) as u64 + queries;
            sim_cost::attention_seconds(variant.spec(), 1, queries, keys, false)
        })
        .sum();
    sim_cost::check("this decode step", seconds)
}

/// The backend the CLI and tools name `name`: `cpu`, `gpu-sim`, or `cuda` (CUDA device 0; with
/// the `cuda` feature and a driver, else an error that says what is missing).
pub fn open(name: &str) -> Result<Box<dyn Backend>, RuntimeError> {
    match name {
        "cpu" => Ok(Box::new(CpuBackend::new())),
        "gpu-sim" => Ok(Box::new(GpuInterpreter)),
        "cuda" => open_cuda(),
        other => Err(RuntimeError::Device(format!(
            "no backend `{other}`; the backends: cpu, cuda, gpu-sim"
        ))),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda() -> Result<Box<dyn Backend>, RuntimeError> {
    Ok(Box::new(gpu::cuda::CudaBackend::new(0)?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda() -> Result<Box<dyn Backend>, RuntimeError> {
    Err(RuntimeError::Device(
        "this build has no `cuda` feature; rebuild with --features cuda \
         (scripts/setup-cuda-toolchain.sh), or use the cpu or gpu-sim backend"
            .into(),
    ))
}
