//! One interface over the backends: what a caller needs to run attention without knowing where
//! it runs. [`CpuBackend`](crate::cpu::CpuBackend) (Cranelift kernels),
//! [`GpuSim`](crate::gpu::sim::GpuSim) (the GPU kernels on the GPU IR interpreter: slow, exact
//! as to what the kernels compute, no GPU needed) and, with the `cuda` feature,
//! `gpu::cuda::CudaBackend` implement it; [`crate::backends::open`] opens one by name. Inputs
//! and outputs are host tensors ([`crate::calls`]); caches are in host memory.

use crate::cache::{KvCache, SeqId};
use crate::calls::{BackwardInputs, DecodeOptions, Gradients, Inputs, Output, Queries};
use crate::error::RuntimeError;
use crate::variant::Variant;

/// Attention on one backend. Every call takes a [`Variant`]: the spec validated and planned
/// once, with the kernels the backend built for it the first time. Inputs of the other kind
/// than the variant's (per-head for an MLA variant, or the reverse) are a spec error; what a
/// backend does not run is [`RuntimeError::Unsupported`].
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
    ) -> Result<Output, RuntimeError>;

    /// Gradients for `dL/dout` (FlashAttention-2 recomputation from the saved lse); dq and dk
    /// (MLA: q_pe and k_pe) are with respect to the inputs before RoPE.
    fn backward(&self, variant: &Variant, x: &BackwardInputs) -> Result<Gradients, RuntimeError>;
}
