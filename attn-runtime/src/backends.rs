//! Opening a backend, and the layer operations that go with it, by the name the CLI and tools
//! give it.

use crate::backend::Backend;
use crate::cpu::CpuBackend;
use crate::device::SimDevice;
use crate::error::RuntimeError;
use crate::gpu::layer_ops::DeviceLayers;
use crate::gpu::sim::GpuSim;
use crate::ops::{CpuLayers, LayerOps};
use std::sync::Arc;

/// The names [`open`] takes.
pub const NAMES: [&str; 3] = ["cpu", "cuda", "gpu-sim"];

/// The backend named `name`: `cpu`, `gpu-sim`, or `cuda` (CUDA device 0; with the `cuda`
/// feature and a driver, else an error that says what is missing).
pub fn open(name: &str) -> Result<Box<dyn Backend>, RuntimeError> {
    match name {
        "cpu" => Ok(Box::new(CpuBackend::new())),
        "gpu-sim" => Ok(Box::new(GpuSim::new())),
        "cuda" => open_cuda(),
        other => Err(RuntimeError::Device(format!(
            "no backend `{other}`; the backends: {}",
            NAMES.join(", ")
        ))),
    }
}

/// Where a model's norms, activations, adds, lookups and greedy choice run beside the backend
/// named `name`: as the GPU kernels on the interpreter for `gpu-sim`, else on the CPU (models
/// resident on a CUDA device run their own, `model::ResidentModel`).
pub fn layer_ops(name: &str) -> Arc<dyn LayerOps> {
    match name {
        "gpu-sim" => Arc::new(DeviceLayers::on(Arc::new(SimDevice::new()))),
        _ => Arc::new(CpuLayers),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda() -> Result<Box<dyn Backend>, RuntimeError> {
    Ok(Box::new(crate::gpu::cuda::CudaBackend::new(0)?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda() -> Result<Box<dyn Backend>, RuntimeError> {
    Err(no_cuda_feature())
}

/// The error every entry point gives for the cuda backend in a build without it.
pub fn no_cuda_feature() -> RuntimeError {
    RuntimeError::NotBuilt(
        "this build is without the `cuda` feature: rebuild with --features cuda \
         (scripts/setup-cuda-toolchain.sh), or use the cpu or gpu-sim backend"
            .into(),
    )
}
