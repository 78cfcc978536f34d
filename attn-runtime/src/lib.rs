//! attn-runtime: memory, launches, caches and models.
//!
//! **Invariant:** attn-runtime owns memory and launches; it is the only crate that calls
//! generated code (and so the only one with `unsafe`, each block with a SAFETY comment).
//!
//! - [`backend`]: the [`Backend`] trait every backend implements (CPU, CUDA,
//!   the GPU IR interpreter); [`calls`], what its calls take and give; [`backends`], opening
//!   one by name;
//! - [`Tensor`]: dtype, shape and strides over CPU storage;
//! - [`files`]: reads of user paths (regular files only, bounded);
//! - [`io`]: safetensors files;
//! - [`memory`]: checks of large allocations against the memory available, zeroed buffers
//!   reused from a pool of dropped ones;
//! - [`cache`]: KV caches for decoding (contiguous, paged, MLA latent);
//! - `host`: host preparation every backend shares (checks, RoPE tables, MLA absorption,
//!   ragged layouts, work items and the lse merge);
//! - [`device`]: device memory, launches and GEMMs for models resident on a GPU (or on the
//!   interpreter);
//! - [`cpu`]: the CPU backend (kernel cache, microkernels, parallel launcher, decode,
//!   backward);
//! - [`gpu`]: GPU calls, run on a CUDA device (feature `cuda`) or on the GPU IR interpreter;
//!   where each kernel's PTX comes from (embedded, the disk cache, or LLVM with `llvm`);
//! - [`ops`]: a decoder's norms, activations, adds, lookups and argmax ([`ops::LayerOps`]);
//! - [`model`]: transformers composed at run time, Hugging Face checkpoints;
//! - [`Attention`] and [`DifferentialAttention`]: the typed APIs `#[attention(...)]` implements.

#![warn(missing_docs)]

mod attention;
pub mod backend;
pub mod backends;
pub mod buffer;
pub mod cache;
pub mod calls;
pub mod cpu;
pub mod device;
pub mod differential;
mod differential_attention;
pub mod distributed;
mod error;
pub mod files;
pub mod gpu;
mod host;
pub mod inputs;
pub mod io;
pub mod learned;
pub mod memory;
pub mod model;
pub mod ops;
pub mod placement;
mod tensor;
mod variant;
pub mod varlen;
mod varlen_data;

pub use attention::Attention;
pub use backend::Backend;
pub use calls::{
    BackwardInputs, DecodeOptions, Gradients, HeadGradients, HeadsBackward, Inputs, MlaBackward,
    MlaGradients, MlaQueries, MlaTensors, Output, Queries,
};
pub use codegen;
pub use differential_attention::DifferentialAttention;
pub use error::RuntimeError;
pub use learned::Learned;
pub use placement::Placement;
pub use tensor::{Storage, Tensor};
pub use variant::Variant;
