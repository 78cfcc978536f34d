//! attn-runtime: memory, launches, caches and models.
//!
//! **Invariant:** attn-runtime owns memory and launches; it is the only crate that calls
//! generated code (and so the only one with `unsafe`, each block with a SAFETY comment).
//!
//! Today: [`Attention`], the typed API `#[attention(...)]` implements. Tensors, the kernel cache
//! and models arrive with the issues that build them (see ARCHITECTURE.md).

#![warn(missing_docs)]

mod variant;

pub use codegen;
pub use variant::Attention;
