//! `attnc run`: attention on tensors from a safetensors file, written to another.

use attn::AttentionSpec;
use attn::runtime::cpu::{CpuBackend, MlaTensors, Output};
use attn::runtime::io::{read_safetensors, write_safetensors};
use attn::runtime::{RuntimeError, Tensor};
use std::path::Path;

/// Where `attnc run` computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// Cranelift-compiled kernels on this machine's CPU.
    Cpu,
    /// The GPU kernel on a CUDA device (needs the `cuda` feature and an NVIDIA GPU).
    Cuda,
    /// The GPU kernel on the GPU IR interpreter (slow; no GPU needed).
    GpuSim,
}

/// Reads the inputs the spec needs (`q, k, v`, or for MLA `q_nope, q_pe, c_kv, k_pe, w_kv_b`),
/// runs the backend and writes `out` (input dtype) and `lse` (f32).
pub fn run(
    spec: &AttentionSpec,
    input: &Path,
    output: &Path,
    offset: i64,
    backend: Backend,
) -> Result<String, RuntimeError> {
    let gpu_forward = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Output, RuntimeError> {
        match backend {
            Backend::GpuSim => {
                attn::runtime::gpu::GpuCall::forward(spec, q, k, v, offset)?.run_emulated()
            }
            _ => cuda_forward(spec, q, k, v, offset),
        }
    };
    let backend_cpu = CpuBackend::new();
    let backend_is_cpu = backend == Backend::Cpu;
    let Output { out, lse } = if spec.mla().is_some() {
        let names = ["q_nope", "q_pe", "c_kv", "k_pe", "w_kv_b"];
        let [q_nope, q_pe, c_kv, k_pe, w_kv_b]: [Tensor; 5] = read_safetensors(input, &names)?
            .try_into()
            .expect("one tensor per name");
        let x = MlaTensors {
            q_nope: &q_nope,
            q_pe: &q_pe,
            c_kv: &c_kv,
            k_pe: &k_pe,
            w_kv_b: &w_kv_b,
        };
        match backend {
            Backend::Cpu => backend_cpu.forward_mla(spec, &x, offset)?,
            Backend::GpuSim => attn::runtime::gpu::forward_mla_emulated(spec, &x, offset)?,
            Backend::Cuda => cuda_forward_mla(spec, &x, offset)?,
        }
    } else {
        let [q, k, v]: [Tensor; 3] = read_safetensors(input, &["q", "k", "v"])?
            .try_into()
            .expect("one tensor per name");
        if backend_is_cpu {
            backend_cpu.forward(spec, &q, &k, &v, offset)?
        } else {
            gpu_forward(&q, &k, &v)?
        }
    };
    write_safetensors(output, &[("out", &out), ("lse", &lse)])?;
    Ok(format!(
        "wrote {}: out {:?} {}, lse {:?} f32",
        output.display(),
        out.shape(),
        out.dtype().name(),
        lse.shape()
    ))
}

#[cfg(feature = "cuda")]
fn cuda_forward(
    spec: &AttentionSpec,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    offset: i64,
) -> Result<Output, RuntimeError> {
    attn::runtime::gpu::cuda::CudaBackend::new(0)?.forward(spec, q, k, v, offset)
}

#[cfg(not(feature = "cuda"))]
fn cuda_forward(
    _: &AttentionSpec,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: i64,
) -> Result<Output, RuntimeError> {
    cuda_forward_missing()
}

/// Without the `cuda` feature: an error that says how to get it.
#[cfg(not(feature = "cuda"))]
fn cuda_forward_missing() -> Result<Output, RuntimeError> {
    Err(RuntimeError::Device(
        "this attnc was built without the `cuda` feature; rebuild with --features cuda \
         (scripts/setup-cuda-toolchain.sh), or use --backend cpu or gpu-sim"
            .into(),
    ))
}

#[cfg(feature = "cuda")]
fn cuda_forward_mla(
    spec: &AttentionSpec,
    x: &MlaTensors,
    offset: i64,
) -> Result<Output, RuntimeError> {
    attn::runtime::gpu::cuda::CudaBackend::new(0)?.forward_mla(spec, x, offset)
}

#[cfg(not(feature = "cuda"))]
fn cuda_forward_mla(_: &AttentionSpec, _: &MlaTensors, _: i64) -> Result<Output, RuntimeError> {
    cuda_forward_missing()
}
