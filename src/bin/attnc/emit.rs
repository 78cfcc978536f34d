//! `attnc emit`: the GPU forward kernel of a spec (tensor cores for bf16 specs, SIMT f32
//! otherwise) as GPU IR, LLVM IR or PTX.

use attn::AttentionSpec;
use attn::codegen::KernelPlan;
use attn::codegen::gpu::forward_kernel;

/// What to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Emit {
    /// The GPU kernel IR (text).
    GpuIr,
    /// LLVM IR after the O3 pipeline (needs the `cuda` feature).
    LlvmIr,
    /// PTX assembly (needs the `cuda` feature).
    Ptx,
}

/// GPU architectures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// Ampere.
    #[value(name = "sm_80")]
    Sm80,
    /// Hopper.
    #[value(name = "sm_90")]
    Sm90,
}

/// The text of the spec's forward kernel in the requested form.
pub fn emit(spec: &AttentionSpec, target: Target, what: Emit) -> Result<String, String> {
    let kernel = forward_kernel(&KernelPlan::forward(spec))
        .map_err(|e| e.to_string())?
        .kernel;
    match what {
        Emit::GpuIr => Ok(kernel.to_string()),
        Emit::LlvmIr | Emit::Ptx => compile(&kernel, target, what),
    }
}

#[cfg(feature = "cuda")]
fn compile(
    kernel: &attn::codegen::gpu::ir::Kernel,
    target: Target,
    what: Emit,
) -> Result<String, String> {
    use attn::codegen::gpu::llvm::{Arch, emit};
    let arch = match target {
        Target::Sm80 => Arch::Sm80,
        Target::Sm90 => Arch::Sm90,
    };
    let out = emit(kernel, arch).map_err(|e| format!("error: {e}"))?;
    Ok(if what == Emit::Ptx {
        out.ptx
    } else {
        out.llvm_ir
    })
}

#[cfg(not(feature = "cuda"))]
fn compile(_: &attn::codegen::gpu::ir::Kernel, _: Target, what: Emit) -> Result<String, String> {
    Err(format!(
        "error: --emit {} needs LLVM: this attnc was built without the `cuda` feature; \
         run scripts/setup-cuda-toolchain.sh, then build with --features cuda",
        if what == Emit::Ptx { "ptx" } else { "llvm-ir" }
    ))
}
