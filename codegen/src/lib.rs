//! codegen: turns a validated [`attn_dsl::AttentionSpec`] into kernel artifacts (machine code
//! through Cranelift, PTX through LLVM) plus a description of their launch ABI.
//!
//! **Invariant:** codegen never owns tensors or device memory; it produces plans, artifacts and
//! their launch descriptions, and attn-runtime runs them.
//!
//! - [`plan`]: the kernel plan every backend lowers from;
//! - [`cpu`]: the Cranelift backend (JIT machine code for the host);
//! - [`gpu`]: the GPU kernel IR, its CPU interpreter and the plan lowerings to it.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod cpu;
mod error;
pub mod gpu;
mod hoist;
mod param_layout;
pub mod plan;
pub mod settings;

pub use attn_dsl;
pub use error::CodegenError;
pub use plan::KernelPlan;
