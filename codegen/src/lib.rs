//! codegen: turns a validated [`attn_dsl::AttentionSpec`] into kernel artifacts (machine code
//! through Cranelift, PTX through LLVM) plus a description of their launch ABI.
//!
//! **Invariant:** codegen never owns tensors or device memory; it produces artifacts and their
//! launch descriptions, and attn-runtime runs them.
//!
//! Status: the crate is laid out; the kernel plan and the backends arrive with the issues that
//! build them (see ARCHITECTURE.md).

#![warn(missing_docs)]

pub use attn_dsl;
