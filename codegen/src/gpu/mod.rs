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

/// The forward kernel a plan runs on GPUs (tensor cores for bf16 specs, SIMT f32 otherwise)
/// and its keys per tile (the host's tile codes follow it).
pub fn forward_kernel(plan: &crate::KernelPlan) -> (ir::Kernel, u32) {
    if forward_tc::supports(plan) {
        (forward_tc::lower(plan), forward_tc::key_tile(plan))
    } else {
        (forward::lower(plan), forward::key_tile(plan))
    }
}
