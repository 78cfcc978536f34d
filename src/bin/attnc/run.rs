//! `attnc run`: attention on tensors from a safetensors file, written to another.

use attn::AttentionSpec;
use attn::runtime::io::{read_safetensors, write_safetensors};
use attn::runtime::{MlaTensors, Output};
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

impl Backend {
    /// The backend's name, as `attn::runtime::backend::open` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::GpuSim => "gpu-sim",
        }
    }
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
    let backend = attn::runtime::backend::open(backend.name())?;
    let variant = attn::runtime::Variant::new(spec.clone())?;
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
        backend.forward_mla(&variant, &x, offset)?
    } else {
        let [q, k, v]: [Tensor; 3] = read_safetensors(input, &["q", "k", "v"])?
            .try_into()
            .expect("one tensor per name");
        backend.forward(&variant, &q, &k, &v, offset)?
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
