//! attn: a compiler for attention variants.
//!
//! Declare a variant, and attn validates it when your crate compiles, compiles its kernels on
//! first use (a few milliseconds on the CPU, once per process), and runs it:
//!
//! ```
//! use attn::prelude::*;
//!
//! #[attention(heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = rope)]
//! struct Layer;
//!
//! # fn main() -> Result<(), RuntimeError> {
//! // Tensors are [batch, heads, sequence, head dim], here of deterministic test values.
//! let q = Tensor::from_f32(&[1, 8, 32, 64], attn::inputs::values(8 * 32 * 64, 1))?;
//! let k = attn::inputs::tensor(DType::F32, &[1, 2, 32, 64], 2)?;
//! let v = attn::inputs::tensor(DType::F32, &[1, 2, 32, 64], 3)?;
//! let out = Layer::forward(&q, &k, &v)?;
//! assert_eq!(out.shape(), &[1, 8, 32, 64]);
//!
//! // The same variant through the Backend interface, on any backend.
//! let got = CpuBackend::new().forward(Layer::variant(), Inputs::heads(&q, &k, &v), 0)?;
//! assert_eq!(got.out.to_f32_vec(), out.to_f32_vec());
//! # Ok(())
//! # }
//! ```
//!
//! Where to go next:
//! - [`Attention`]: what a declared variant offers (forward, backward, decode, costs);
//!   [`DifferentialAttention`], what a declared one with differential heads offers;
//! - [`Variant`] and [`Backend`]: a spec planned once, run on [`CpuBackend`], [`GpuSim`] (the
//!   GPU kernels on an interpreter) or a backend [`backends::open`] names, over [`Inputs`] or
//!   cached [`Queries`];
//! - [`cache`]: KV caches for decoding; [`Model`]: transformers of such variants ([`hf`] loads
//!   Hugging Face checkpoints, [`research`] TOML models) that generate under a [`Request`];
//! - [`accounting`] and [`reference`](mod@reference): a spec's costs and its exact meaning;
//! - [`distributed`]: context-parallel attention (Ulysses, ring) over a communicator of
//!   threads or, with the `mpi` feature, MPI processes;
//! - [`gpu`]: a spec's GPU kernels and where their PTX comes from;
//! - `candle` (feature `candle`): attention with gradients as an op on candle tensors, for
//!   models that candle trains;
//! - the crates themselves: [`dsl`] (the spec language), [`codegen`] (plans and kernels),
//!   [`runtime`] (memory, launches, caches, models). [`prelude`] holds the common names.
//!
//! The `attnc` binary is the command-line front end; the README has a guide to both.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

#[doc(inline)]
pub use attn_dsl as dsl;
pub use attn_dsl::{AttentionSpec, DType, KvLayout, Mask, Position, Rope, RopeScaling};
pub use attn_dsl::{accounting, reference};
/// Declares an attention variant on a struct; the spec is validated when the crate compiles:
///
/// ```
/// use attn::{Attention, attention};
///
/// #[attention(heads = 8, kv_heads = 2, head_dim = 64, mask = causal)]
/// struct MyAttention;
///
/// assert_eq!(MyAttention::KV_HEADS, 2);
/// assert_eq!(MyAttention::spec().to_string(), MyAttention::SPEC_TEXT);
/// let bytes = attn::accounting::kv_cache_bytes_per_token(MyAttention::spec());
/// assert_eq!(bytes, 2 * 2 * 64 * 4); // K and V, 2 kv heads, 64 dims, f32
/// ```
#[doc(inline)]
pub use attn_macros::attention;
#[doc(inline)]
pub use attn_runtime as runtime;
pub use attn_runtime::cpu::CpuBackend;
pub use attn_runtime::gpu::sim::GpuSim;
pub use attn_runtime::model::{Model, Request, ResidentModel, Sampling, hf, research};
pub use attn_runtime::{
    Attention, Backend, BackwardInputs, DecodeOptions, DifferentialAttention, Gradients,
    HeadGradients, HeadsBackward, Inputs, Learned, MlaBackward, MlaGradients, MlaQueries,
    MlaTensors, Output, Queries, RuntimeError, Tensor, Variant, backends,
};
pub use attn_runtime::{cache, distributed, inputs};

#[cfg(feature = "candle")]
pub mod candle;
#[doc(inline)]
pub use codegen;

/// A spec's GPU kernels and where the runtime takes their PTX from (embedded at cargo time, the
/// disk cache, or compiled), and with the `cuda` feature the CUDA backend.
pub mod gpu {
    pub use attn_runtime::gpu::backend::{DeviceCache, GpuBackend};
    #[cfg(feature = "cuda")]
    pub use attn_runtime::gpu::cuda::{CudaBackend, CudaDevice};
    pub use attn_runtime::gpu::ptx::{Ptx, PtxOrigin, ptx_for};
    pub use codegen::gpu::artifacts::{SpecKernel, spec_kernels};
    pub use codegen::gpu::ir::target::Arch;
}

/// What most programs use: `use attn::prelude::*;`.
pub mod prelude {
    pub use crate::{
        Attention, AttentionSpec, Backend, BackwardInputs, CpuBackend, DType, DecodeOptions,
        DifferentialAttention, GpuSim, HeadsBackward, Inputs, Learned, MlaTensors, Model, Output,
        Queries, RuntimeError, Tensor, Variant, attention,
    };
}
