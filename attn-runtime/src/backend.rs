//! One interface over the backends: what a caller needs to run attention without knowing where
//! it runs. [`CpuBackend`] (Cranelift kernels), [`GpuInterpreter`] (the GPU kernels on the GPU
//! IR interpreter: slow, exact as to what the kernels compute, no GPU needed) and, with the
//! `cuda` feature, `gpu::cuda::CudaBackend` implement it. Inputs and outputs are host tensors;
//! caches are paged caches in host memory.

use crate::cache::{PagedCache, SeqId};
use crate::cpu::CpuBackend;
use crate::error::RuntimeError;
use crate::gpu;
use crate::tensor::Tensor;
use attn_dsl::AttentionSpec;

/// Attention outputs.
#[derive(Clone, Debug)]
pub struct Output {
    /// `[B, Hq, Sq, Dv]` in the spec's dtype.
    pub out: Tensor,
    /// `[B, Hq, Sq]` f32: natural log of the softmax denominator, `-inf` for empty rows.
    pub lse: Tensor,
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

/// Attention on one backend: the calls of [`CpuBackend`], which every backend meets.
pub trait Backend: Send + Sync {
    /// The backend's name, as the CLI spells it (`cpu`, `cuda`, `gpu-sim`).
    fn name(&self) -> &'static str;

    /// Attention for a per-head spec (see [`CpuBackend::forward`]).
    fn forward(
        &self,
        spec: &AttentionSpec,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        position_offset: i64,
    ) -> Result<Output, RuntimeError>;

    /// MLA attention in the absorbed form (see [`CpuBackend::forward_mla`]).
    fn forward_mla(
        &self,
        spec: &AttentionSpec,
        x: &MlaTensors,
        position_offset: i64,
    ) -> Result<Output, RuntimeError>;

    /// Queries against cached sequences (see [`CpuBackend::decode`]).
    fn decode(
        &self,
        spec: &AttentionSpec,
        q: &Tensor,
        cache: &PagedCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError>;

    /// MLA queries against a latent cache (see [`CpuBackend::decode_mla`]).
    fn decode_mla(
        &self,
        spec: &AttentionSpec,
        queries: MlaQueries,
        cache: &PagedCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError>;

    /// A ragged batch against cached sequences (see [`CpuBackend::attend_ragged`]).
    fn attend_ragged(
        &self,
        spec: &AttentionSpec,
        q: &Tensor,
        q_offsets: &[usize],
        cache: &PagedCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError>;
}

/// Implements [`Backend`] for a type whose inherent methods have the trait's names and
/// signatures (with generic caches).
macro_rules! backend_by_inherent_methods {
    ($ty:ty, $name:literal) => {
        impl Backend for $ty {
            fn name(&self) -> &'static str {
                $name
            }

            fn forward(
                &self,
                spec: &AttentionSpec,
                q: &Tensor,
                k: &Tensor,
                v: &Tensor,
                position_offset: i64,
            ) -> Result<Output, RuntimeError> {
                <$ty>::forward(self, spec, q, k, v, position_offset)
            }

            fn forward_mla(
                &self,
                spec: &AttentionSpec,
                x: &MlaTensors,
                position_offset: i64,
            ) -> Result<Output, RuntimeError> {
                <$ty>::forward_mla(self, spec, x, position_offset)
            }

            fn decode(
                &self,
                spec: &AttentionSpec,
                q: &Tensor,
                cache: &PagedCache,
                seqs: &[SeqId],
                options: DecodeOptions,
            ) -> Result<Output, RuntimeError> {
                <$ty>::decode(self, spec, q, cache, seqs, options)
            }

            fn decode_mla(
                &self,
                spec: &AttentionSpec,
                queries: MlaQueries,
                cache: &PagedCache,
                seqs: &[SeqId],
                options: DecodeOptions,
            ) -> Result<Output, RuntimeError> {
                <$ty>::decode_mla(self, spec, queries, cache, seqs, options)
            }

            fn attend_ragged(
                &self,
                spec: &AttentionSpec,
                q: &Tensor,
                q_offsets: &[usize],
                cache: &PagedCache,
                seqs: &[SeqId],
                options: DecodeOptions,
            ) -> Result<Output, RuntimeError> {
                <$ty>::attend_ragged(self, spec, q, q_offsets, cache, seqs, options)
            }
        }
    };
}

backend_by_inherent_methods!(CpuBackend, "cpu");
#[cfg(feature = "cuda")]
backend_by_inherent_methods!(gpu::cuda::CudaBackend, "cuda");

/// The GPU kernels run on the GPU IR interpreter, with the launches a device would get.
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuInterpreter;

impl Backend for GpuInterpreter {
    fn name(&self) -> &'static str {
        "gpu-sim"
    }

    fn forward(
        &self,
        spec: &AttentionSpec,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        gpu::GpuCall::forward(spec, q, k, v, position_offset)?.run_emulated()
    }

    fn forward_mla(
        &self,
        spec: &AttentionSpec,
        x: &MlaTensors,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        gpu::forward_mla_emulated(spec, x, position_offset)
    }

    fn decode(
        &self,
        spec: &AttentionSpec,
        q: &Tensor,
        cache: &PagedCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        gpu::decode_emulated(spec, q, cache, seqs, options)
    }

    fn decode_mla(
        &self,
        spec: &AttentionSpec,
        queries: MlaQueries,
        cache: &PagedCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        gpu::decode_mla_emulated(spec, queries, cache, seqs, options)
    }

    fn attend_ragged(
        &self,
        spec: &AttentionSpec,
        q: &Tensor,
        q_offsets: &[usize],
        cache: &PagedCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        gpu::attend_ragged_emulated(spec, q, q_offsets, cache, seqs, options)
    }
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
