//! The typed API of differential heads declared with `#[attention(..., differential = ...)]`.

use crate::backend::Backend;
use crate::cpu::CpuBackend;
use crate::differential::{
    Differential, DifferentialGradients, DifferentialInputs, DifferentialOutput, DifferentialVarlen,
};
use crate::{RuntimeError, Tensor};
use attn_dsl::{AttentionSpec, DType};

/// Differential heads whose spec is fixed at compile time.
///
/// `#[attention(...)]` implements it, in place of [`crate::Attention`], for a spec with
/// `differential = lambda(...)`: the spec is validated when the crate compiles, so
/// [`DifferentialAttention::spec`] cannot fail. Heads pair up (docs/semantics.md, "Differential
/// heads"): q holds `HEADS` component heads, k `KV_HEADS` key heads, v `VALUE_HEADS` value heads,
/// and the output `HEADS / 2` heads. The entry points run on the CPU backend; the `_on` ones on
/// a backend given.
pub trait DifferentialAttention {
    /// The spec in normalized form.
    const SPEC_TEXT: &'static str;
    /// Query heads: the components, two per differential head.
    const HEADS: u32;
    /// Key heads.
    const KV_HEADS: u32;
    /// Value heads, one per pair of key heads (`KV_HEADS / 2`).
    const VALUE_HEADS: u32;
    /// Query/key head dim, which lambda's vectors have too.
    const HEAD_DIM: u32;
    /// Value head dim.
    const V_HEAD_DIM: u32;
    /// Storage dtype.
    const DTYPE: DType;
    /// The spec's learnable tensors, `(name, shape)`, as [`crate::Attention::LEARNED`]; lambda's
    /// four vectors are not among them (they are [`DifferentialInputs::lambda`]).
    const LEARNED: &'static [(&'static str, &'static [usize])] = &[];

    /// The spec (built as data by the macro, on first use).
    fn spec() -> &'static AttentionSpec;

    /// The spec validated and its component heads planned, once (on first use the embedded
    /// kernels are registered with the GPU backends).
    fn differential() -> &'static Differential;

    /// The GPU kernels of the component heads compiled at cargo time for the spec's `targets`
    /// (attn's `aot` feature). Empty without targets.
    fn embedded_kernels() -> &'static [crate::gpu::ptx::EmbeddedKernel] {
        &[]
    }

    /// The output `[B, HEADS / 2, Sq, V_HEAD_DIM]`, lambda, and the components' output and lse
    /// (what the backward takes), for `x` (CPU backend).
    fn forward(x: &DifferentialInputs) -> Result<DifferentialOutput, RuntimeError> {
        Self::forward_on(&CpuBackend::new(), x)
    }

    /// [`DifferentialAttention::forward`] on any backend.
    fn forward_on(
        backend: &dyn Backend,
        x: &DifferentialInputs,
    ) -> Result<DifferentialOutput, RuntimeError> {
        Self::differential().forward(backend, x)
    }

    /// The gradients of [`DifferentialAttention::forward`] for `dout = dL/dout`, given its
    /// inputs and what it returned: dq, dk (before RoPE), dv, the learnable tensors' and
    /// lambda's vectors' (CPU backend).
    fn backward(
        x: &DifferentialInputs,
        saved: &DifferentialOutput,
        dout: &Tensor,
    ) -> Result<DifferentialGradients, RuntimeError> {
        Self::backward_on(&CpuBackend::new(), x, saved, dout)
    }

    /// [`DifferentialAttention::backward`] on any backend.
    fn backward_on(
        backend: &dyn Backend,
        x: &DifferentialInputs,
        saved: &DifferentialOutput,
        dout: &Tensor,
    ) -> Result<DifferentialGradients, RuntimeError> {
        Self::differential().backward(backend, x, saved, dout)
    }

    /// Differential heads over a packed batch ([`crate::varlen`]'s layout, v `[total_k,
    /// VALUE_HEADS, V_HEAD_DIM]`) on any backend.
    fn forward_varlen_on(
        backend: &dyn Backend,
        x: &DifferentialVarlen,
    ) -> Result<DifferentialOutput, RuntimeError> {
        Self::differential().forward_varlen(backend, x)
    }

    /// The gradients of [`DifferentialAttention::forward_varlen_on`], packed as the batch is.
    fn backward_varlen_on(
        backend: &dyn Backend,
        x: &DifferentialVarlen,
        saved: &DifferentialOutput,
        dout: &Tensor,
    ) -> Result<DifferentialGradients, RuntimeError> {
        Self::differential().backward_varlen(backend, x, saved, dout)
    }
}
