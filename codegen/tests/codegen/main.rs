//! codegen's tests, one module per subject: kernel plans (snapshots), GPU IR kernels run on the
//! interpreter against the reference, their text form (`tests/gpu_ir/*.gir`), the Hopper
//! synchronization checks, and with `llvm` their PTX (`support` finds and runs ptxas).

mod gpu_cp_async;
mod gpu_hopper;
mod gpu_interp;
mod gpu_ir_text;
mod gpu_layers;
mod gpu_ldmatrix;
mod gpu_mma;
mod gpu_ptx;
mod plan;
#[cfg(feature = "llvm")]
mod support;
