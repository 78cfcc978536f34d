//! The GPU backend's front half, verified without a GPU: kernel plans lowered to a GPU kernel
//! IR ([`ir`], printable), and an interpreter ([`interp`]) that runs that IR on the CPU with
//! the semantics of the PTX it maps to. [`forward`] is the SIMT f32 forward kernel, [`forward_tc`]
//! the tensor-core (mma.sync, bf16) one.
//!
//! [`decode`] is the SIMT decode kernel over cache segments (split-KV). With the `cuda` feature,
//! [`llvm`] translates the IR to LLVM IR and PTX. Still to come (issue 7): `cp.async` staging
//! and double buffering, tensor-core decode.

pub mod decode;
pub mod forward;
pub mod forward_tc;
pub mod interp;
pub mod ir;
#[cfg(feature = "cuda")]
pub mod llvm;
mod print;

/// A forward kernel as the host launches it.
#[derive(Clone, Debug)]
pub struct ForwardKernel {
    /// The kernel.
    pub kernel: ir::Kernel,
    /// Keys per tile (the host's tile codes follow it).
    pub key_tile: u32,
    /// The element type of `q`, `k` and `v` in global memory: the spec's bf16 or f16 on tensor
    /// cores, else f32
    /// (`out` and `lse` are f32 either way).
    pub inputs: attn_dsl::DType,
}

/// The forward kernel a plan runs on GPUs: tensor cores for bf16 and f16 specs, SIMT f32
/// otherwise.
pub fn forward_kernel(plan: &crate::KernelPlan) -> ForwardKernel {
    if forward_tc::supports(plan) {
        ForwardKernel {
            kernel: forward_tc::lower(plan),
            key_tile: forward_tc::key_tile(plan),
            inputs: plan.dtype,
        }
    } else {
        ForwardKernel {
            kernel: forward::lower(plan),
            key_tile: forward::key_tile(plan),
            inputs: attn_dsl::DType::F32,
        }
    }
}
