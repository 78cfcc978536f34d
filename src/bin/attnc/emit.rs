//! `attnc emit`: a spec's GPU kernels as GPU IR, LLVM IR or PTX. One kernel (the forward the
//! runtime picks) to a file or standard output, or with `--out-dir` every kernel of the spec
//! for every target plus `manifest.json` (their launch records). PTX goes through the kernel
//! disk cache; stderr says where each kernel came from.

use attn::AttentionSpec;
use attn::codegen::KernelPlan;
use attn::codegen::gpu::artifacts::{SpecKernel, json_string, launch_json, spec_kernels_for};
use attn::codegen::gpu::ir::Kernel;
use attn::codegen::gpu::ir::target::{Arch, compiler_version};
use attn::codegen::gpu::kernels::forward_wgmma;
use attn::codegen::gpu::{forward_kernel, verified};
use attn::runtime::gpu::ptx::ptx_for;
use std::path::{Path, PathBuf};

/// `attnc emit`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// The spec, in the spec language, or @FILE to read it from a file.
    #[arg(allow_hyphen_values = true)]
    spec: String,
    /// GPU architecture; repeat it with --out-dir for several (default sm_90).
    #[arg(long, value_enum)]
    target: Vec<Target>,
    /// What to write.
    #[arg(long, value_enum, default_value_t = Emit::Ptx)]
    emit: Emit,
    /// Output file (default: standard output).
    #[arg(short, long, value_name = "FILE", conflicts_with = "out_dir")]
    output: Option<PathBuf>,
    /// Write every kernel of the spec, for every target, and manifest.json here.
    #[arg(long, value_name = "DIR")]
    out_dir: Option<PathBuf>,
}

/// `attnc emit`.
pub fn command(mut args: Args) -> Result<(), String> {
    if args.target.is_empty() {
        args.target.push(Target::Sm90);
    }
    let (spec, _) = crate::spec_arg::load(&args.spec)?;
    if let Some(dir) = &args.out_dir {
        return emit_all(&spec, &args.target, args.emit, dir);
    }
    let text = emit(&spec, &args.target, args.emit)?;
    match &args.output {
        Some(path) => {
            crate::outputs::check(path, &crate::spec_arg::spec_file(&args.spec), "--output")?;
            std::fs::write(path, text).map_err(|e| format!("error: {}: {e}", path.display()))
        }
        None => {
            print!("{text}");
            Ok(())
        }
    }
}

/// What to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Emit {
    /// The GPU kernel IR (text).
    GpuIr,
    /// LLVM IR after the O3 pipeline (needs the `llvm` feature).
    LlvmIr,
    /// PTX assembly (from the disk cache, or compiled: needs the `llvm` feature).
    Ptx,
}

impl Emit {
    fn extension(self) -> &'static str {
        match self {
            Emit::GpuIr => "gpu-ir",
            Emit::LlvmIr => "ll",
            Emit::Ptx => "ptx",
        }
    }
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
    /// Hopper's architecture-specific instructions: the forward on warpgroup MMA, TMA and
    /// warp specialization where the spec runs on it (bf16 and f16 per-head specs, head dims
    /// 64, 128, 192 or 256, RoPE rotated in place by the producer). Runs on compute capability
    /// 9.0 only.
    #[value(name = "sm_90a")]
    Sm90a,
}

impl Target {
    fn arch(self) -> Arch {
        match self {
            Target::Sm80 => Arch::Sm80,
            Target::Sm90 => Arch::Sm90,
            Target::Sm90a => Arch::Sm90a,
        }
    }
}

/// The spec's forward kernel (the one the runtime picks) in the requested form, for `target`.
fn emit(spec: &AttentionSpec, targets: &[Target], what: Emit) -> Result<String, String> {
    let [target] = targets else {
        return Err(format!(
            "error: one kernel is written for one target, {} given; allowed: one --target, or \
             --out-dir DIR for every kernel of the spec for several\n",
            targets.len()
        ));
    };
    // The first of `spec_kernels_for`, lowered alone.
    let plan = KernelPlan::forward(spec);
    let forward = if target.arch() == Arch::Sm90a && forward_wgmma::supports(&plan) {
        SpecKernel {
            role: "forward wgmma",
            kernel: verified(forward_wgmma::lower(&plan)).map_err(|e| format!("error: {e}\n"))?,
        }
    } else {
        SpecKernel {
            role: "forward",
            kernel: (*forward_kernel(&plan)
                .map_err(|e| format!("error: {e}\n"))?
                .kernel)
                .clone(),
        }
    };
    text_of(spec, &forward, target.arch(), what)
}

/// Every kernel of the spec for every target, in `dir`: `<role>.<target>.<ext>` each, and
/// `manifest.json`.
fn emit_all(
    spec: &AttentionSpec,
    targets: &[Target],
    what: Emit,
    dir: &Path,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("error: {}: {e}\n", dir.display()))?;
    // A target given twice is written once.
    let mut unique: Vec<Target> = Vec::new();
    for &t in targets {
        if !unique.contains(&t) {
            unique.push(t);
        }
    }
    let targets = unique.as_slice();
    // The check's error names the path already; a write's error is given it.
    let write = |path: &Path, text: &str| {
        attn::runtime::files::ensure_writable_target(path).map_err(|e| format!("error: {e}\n"))?;
        crate::outputs::write_whole(path, text.as_bytes()).map_err(|e| format!("{e}\n"))
    };
    let mut entries = Vec::new();
    for target in targets {
        let arch = target.arch();
        let kernels = spec_kernels_for(spec, arch).map_err(|e| format!("error: {e}\n"))?;
        for k in &kernels {
            let text = text_of(spec, k, arch, what)?;
            let file = format!(
                "{}.{}.{}",
                k.role.replace(' ', "-"),
                arch.name(),
                what.extension()
            );
            write(&dir.join(&file), &text)?;
            entries.push(format!(
                "    {{\"role\": {}, \"target\": \"{}\", \"file\": {}, \"launch\": {}}}",
                json_string(k.role),
                arch.name(),
                json_string(&file),
                launch_json(&k.kernel)
            ));
        }
    }
    let manifest = format!(
        "{{\n  \"format\": 1,\n  \"spec\": {},\n  \"compiler\": {},\n  \"kernels\": [\n{}\n  ]\n}}\n",
        json_string(&spec.to_string()),
        json_string(&compiler_version()),
        entries.join(",\n")
    );
    write(&dir.join("manifest.json"), &manifest)?;
    eprintln!(
        "wrote {} kernels for {} target{} to {}",
        entries.len(),
        targets.len(),
        if targets.len() == 1 { "" } else { "s" },
        dir.display()
    );
    Ok(())
}

/// One kernel's text; PTX through the disk cache, saying on stderr where it came from.
fn text_of(spec: &AttentionSpec, k: &SpecKernel, arch: Arch, what: Emit) -> Result<String, String> {
    match what {
        Emit::GpuIr => Ok(k.kernel.to_string()),
        Emit::LlvmIr => llvm_ir(&k.kernel, arch),
        Emit::Ptx => {
            let spec_text = spec.to_string();
            let ptx =
                ptx_for(&k.kernel, arch, Some(&spec_text)).map_err(|e| format!("error: {e}\n"))?;
            eprintln!(
                "{} ({}, {}): {}",
                k.kernel.name,
                k.role,
                arch.name(),
                ptx.origin
            );
            Ok(ptx.text.to_string())
        }
    }
}

#[cfg(feature = "llvm")]
fn llvm_ir(kernel: &Kernel, arch: Arch) -> Result<String, String> {
    attn::codegen::gpu::llvm::emit(kernel, arch)
        .map(|out| out.llvm_ir)
        .map_err(|e| format!("error: {e}\n"))
}

#[cfg(not(feature = "llvm"))]
fn llvm_ir(_: &Kernel, _: Arch) -> Result<String, String> {
    Err(
        "error: --emit llvm-ir needs LLVM: this attnc was built without the `llvm` feature; \
         run scripts/setup-cuda-toolchain.sh, then build with --features llvm\n"
            .to_string(),
    )
}
