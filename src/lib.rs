//! attn: a compiler for attention variants.
//!
//! This facade re-exports the crates of the workspace:
//! - [`dsl`] (attn-dsl): the spec language, validation, accounting and the reference semantics;
//! - [`attention`] (attn-macros): `#[attention(...)]` on a struct;
//! - [`codegen`]: kernel plans and backends;
//! - [`runtime`] (attn-runtime): tensors, launches, caches and models; [`Attention`], the typed
//!   API of a declared variant.
//!
//! The types a program uses are at the root: a [`Variant`] (a spec validated and planned once)
//! runs on a [`Backend`] ([`CpuBackend`], [`GpuSim`], or one [`backends::open`] names) over
//! [`Inputs`] or cached [`Queries`]; a [`Model`] composes variants into a transformer
//! ([`hf`] loads checkpoints, [`research`] reads model files) and generates under a [`Request`]
//! and [`Sampling`]. A spec's costs are in [`accounting`], its meaning in [`reference`];
//! [`inputs`] draws deterministic test inputs.
//! [`prelude`] holds the common ones.
//!
//! The `attnc` binary is the command-line front end.
//!
//! ```
//! let spec: attn::AttentionSpec = "heads = 8, kv_heads = 2, head_dim = 64, mask = causal"
//!     .parse()
//!     .unwrap();
//! assert_eq!(attn::accounting::kv_cache_bytes_per_token(&spec), 2 * 2 * 64 * 4);
//! ```

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub use attn_dsl as dsl;
pub use attn_dsl::{AttentionSpec, DType, KvLayout, Mask, Position, Rope, RopeScaling};
pub use attn_dsl::{accounting, reference};
pub use attn_macros::attention;
pub use attn_runtime as runtime;
pub use attn_runtime::cpu::CpuBackend;
pub use attn_runtime::gpu::sim::GpuSim;
pub use attn_runtime::model::{DeviceModel, Model, Request, Sampling, hf, research};
pub use attn_runtime::{
    Attention, Backend, BackwardInputs, DecodeOptions, Gradients, HeadGradients, HeadsBackward,
    Inputs, MlaBackward, MlaGradients, MlaQueries, MlaTensors, Output, Queries, RuntimeError,
    Tensor, Variant, backends,
};
pub use attn_runtime::{cache, inputs};
pub use codegen;

/// A spec's GPU kernels and where the runtime takes their PTX from (embedded at cargo time, the
/// disk cache, or compiled), and with the `cuda` feature the CUDA backend.
pub mod gpu {
    #[cfg(feature = "cuda")]
    pub use attn_runtime::gpu::cuda::CudaBackend;
    pub use attn_runtime::gpu::ptx::{Ptx, PtxOrigin, ptx_for};
    pub use codegen::gpu::artifacts::{SpecKernel, spec_kernels};
    pub use codegen::gpu::ir::target::Arch;
}

/// What most programs use: `use attn::prelude::*;`.
pub mod prelude {
    pub use crate::{
        Attention, AttentionSpec, Backend, BackwardInputs, CpuBackend, DType, DecodeOptions,
        GpuSim, HeadsBackward, Inputs, MlaTensors, Model, Output, Queries, RuntimeError, Tensor,
        Variant, attention,
    };
}
