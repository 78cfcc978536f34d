//! The GPU backend's front half, verified without a GPU: kernel plans lowered to a GPU kernel
//! IR ([`ir`], printable), and an interpreter ([`interp`]) that runs that IR on the CPU with
//! the semantics of the PTX it maps to. [`forward`] is the SIMT f32 forward kernel, [`forward_tc`]
//! the tensor-core (mma.sync, bf16) one.
//!
//! [`decode`] is the SIMT decode kernel over cache segments (split-KV). With the `cuda` feature,
//! [`llvm`] translates the IR to LLVM IR and PTX. Still to come (issue 7): `ldmatrix` and
//! `cp.async` staging, tensor-core decode.

pub mod decode;
pub mod forward;
pub mod forward_tc;
pub mod interp;
pub mod ir;
#[cfg(feature = "cuda")]
pub mod llvm;
mod print;
