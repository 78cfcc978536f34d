//! The GPU backend's front half, verified without a GPU: kernel plans lowered to a GPU kernel
//! IR ([`ir`], printable), and an interpreter ([`interp`]) that runs that IR on the CPU with
//! the semantics of the PTX it maps to. [`forward`] is the SIMT f32 forward kernel.
//!
//! Still to come (issue 7): tensor-core fragments (`mma.sync`, `ldmatrix`) in the IR and the
//! interpreter, the LLVM NVPTX lowering, decode kernels, ptxas checks and the CUDA runtime.

pub mod forward;
pub mod interp;
pub mod ir;
#[cfg(feature = "cuda")]
pub mod llvm;
mod print;
