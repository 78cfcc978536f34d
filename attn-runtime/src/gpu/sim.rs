//! The `gpu-sim` backend: the GPU backend ([`GpuBackend`]) on the GPU IR interpreter
//! ([`SimDevice`]), so the runtime's GPU path is tested without a GPU: the kernels run with the
//! launches a device would get. Each call's cost is estimated first
//! ([`super::sim_cost`]) and one the interpreter would spend minutes on is refused.

use super::backend::GpuBackend;
use crate::device::SimDevice;

/// The GPU kernels on the GPU IR interpreter.
pub type GpuSim = GpuBackend<SimDevice>;

impl GpuSim {
    /// The backend on an interpreter of its own (empty memory).
    pub fn new() -> Self {
        GpuBackend::on(SimDevice::new())
    }
}
