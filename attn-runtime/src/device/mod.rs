//! A device as a model runs on it: memory addressed like a GPU's, kernel launches and matrix
//! products. [`SimDevice`] is the GPU IR interpreter with host GEMMs standing in for
//! cuBLAS (no GPU needed; what the tests run); with the `cuda` feature,
//! `gpu::cuda::CudaBackend` is one (cudarc, cuBLAS).

mod sim;

pub use sim::SimDevice;

use crate::error::RuntimeError;
use attn_dsl::DType;
use codegen::gpu::ir::Kernel;
use codegen::gpu::ir::tma::TensorMap;
use codegen::gpu::launch::{LaunchRecord, Param, bind_with_maps};
use std::sync::Arc;

/// A buffer in a device's memory: the address kernels take, and its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuffer {
    /// The device address of its first byte.
    pub addr: i64,
    /// Its size in bytes.
    pub bytes: usize,
}

/// Memory, launches and GEMMs.
pub trait Device: Send + Sync {
    /// The device's name, for messages.
    fn name(&self) -> &'static str;

    /// A new buffer holding `bytes`.
    fn upload(&self, bytes: &[u8]) -> Result<DeviceBuffer, RuntimeError>;

    /// A new buffer of `bytes` zero bytes.
    fn zeros(&self, bytes: usize) -> Result<DeviceBuffer, RuntimeError>;

    /// A buffer's bytes.
    fn download(&self, buffer: DeviceBuffer) -> Result<Vec<u8>, RuntimeError>;

    /// Releases a buffer (later use of its address is an error on the interpreter, undefined on
    /// a GPU: callers free only what nothing reads again).
    fn free(&self, buffer: DeviceBuffer);

    /// Runs `kernel` over `grid` CTAs with `args`, one i64 per parameter in order, as
    /// `bind` makes them from a launch record whose fields are `fields` (a device checks that
    /// every address field points into one of its live buffers, or is 0), then the TMA tensor
    /// maps `maps` by value (sm_90a's forward; their `global` set to device addresses).
    fn launch(
        &self,
        kernel: &Arc<Kernel>,
        grid: [u32; 3],
        fields: &[Param],
        args: &[i64],
        maps: &[TensorMap],
    ) -> Result<(), RuntimeError>;

    /// Writes `bytes` into `buffer` from byte `offset` on (a resident copy brought up to date).
    fn write(&self, buffer: DeviceBuffer, offset: usize, bytes: &[u8]) -> Result<(), RuntimeError>;

    /// Makes `kernel` ready to launch (on CUDA: its PTX found or compiled, and loaded), so that
    /// a timing of its launches leaves that out. Devices with nothing to prepare do nothing.
    fn prepare(&self, _kernel: &Arc<Kernel>) -> Result<(), RuntimeError> {
        Ok(())
    }

    /// Waits for every queued launch and copy to finish (devices that run launches as they
    /// are made return at once).
    fn synchronize(&self) -> Result<(), RuntimeError> {
        Ok(())
    }

    /// Refuses work the device would spend too long on: `what`, which would take `seconds()`
    /// on the GPU IR interpreter ([`crate::gpu::sim_cost`]). Devices that run kernels at a
    /// GPU's speed take everything, and never compute the estimate.
    fn check_cost(&self, _what: &str, _seconds: &dyn Fn() -> f64) -> Result<(), RuntimeError> {
        Ok(())
    }

    /// Times every later span of decode launches ([`Device::time_span`]) on the device, or
    /// stops; an error on a device that keeps no kernel times.
    fn time_kernels(&self, _on: bool) -> Result<(), RuntimeError> {
        Err(RuntimeError::Unsupported {
            backend: self.name(),
            what: "kernel timing (a CUDA device times its kernels by events)".into(),
        })
    }

    /// The device time, in microseconds, of the last timed span ([`Device::time_kernels`]);
    /// `None` before the first, or on a device that keeps no kernel times.
    fn last_kernel_us(&self) -> Option<f64> {
        None
    }

    /// Runs `launches` (which queue kernels), timing them on the device where it keeps kernel
    /// times ([`Device::time_kernels`]); other devices just run them.
    fn time_span(
        &self,
        launches: &mut dyn FnMut() -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        launches()
    }

    /// `y [n, out] = x [n, inp] w^T` with `w [out, inp]` row-major in `dtype` (f32, bf16 or
    /// f16), `x` and `y` f32; products accumulate in f32 (16-bit weights may take `x` rounded to
    /// their format, as cuBLAS's mixed-precision GEMMs do).
    #[allow(clippy::too_many_arguments)]
    fn gemm_t(
        &self,
        x: DeviceBuffer,
        w: DeviceBuffer,
        dtype: DType,
        y: DeviceBuffer,
        n: usize,
        inp: usize,
        out: usize,
    ) -> Result<(), RuntimeError>;
}

/// Launches `kernel` over `grid` CTAs on `device` with its launch record (bound to the kernel's
/// parameters by name) and, after it, the TMA tensor maps `maps`.
pub fn launch<R: LaunchRecord>(
    device: &dyn Device,
    kernel: &Arc<Kernel>,
    grid: [u32; 3],
    record: &R,
    maps: &[TensorMap],
) -> Result<(), RuntimeError> {
    let args = bind_with_maps(kernel, record, maps.len()).map_err(RuntimeError::Data)?;
    device.launch(kernel, grid, R::FIELDS, &args, maps)
}

/// Buffers a computation allocates, freed together when it ends (or fails).
pub struct Scratch<'d> {
    device: &'d dyn Device,
    buffers: Vec<DeviceBuffer>,
}

impl<'d> Scratch<'d> {
    /// An empty scratch on `device`.
    pub fn new(device: &'d dyn Device) -> Self {
        Scratch {
            device,
            buffers: Vec::new(),
        }
    }

    /// A zeroed buffer of `count` f32 values.
    pub fn f32s(&mut self, count: usize) -> Result<DeviceBuffer, RuntimeError> {
        let bytes = count
            .checked_mul(4)
            .ok_or_else(|| RuntimeError::Data(format!("{count} f32 values overflow")))?;
        self.keep(self.device.zeros(bytes)?)
    }

    /// A buffer holding `bytes`.
    pub fn upload(&mut self, bytes: &[u8]) -> Result<DeviceBuffer, RuntimeError> {
        self.keep(self.device.upload(bytes)?)
    }

    /// The address of a buffer holding `bytes`, or 0 (no buffer) when there are none: what a
    /// launch record takes for an input a kernel does not read.
    pub fn upload_or_null(&mut self, bytes: &[u8]) -> Result<i64, RuntimeError> {
        if bytes.is_empty() {
            return Ok(0);
        }
        Ok(self.upload(bytes)?.addr)
    }

    /// The address of a zeroed buffer of `count` f32 values, or 0 (no buffer) for none.
    pub fn f32s_or_null(&mut self, count: usize) -> Result<i64, RuntimeError> {
        if count == 0 {
            return Ok(0);
        }
        Ok(self.f32s(count)?.addr)
    }

    /// A zeroed buffer of `bytes` bytes.
    pub fn zeros(&mut self, bytes: usize) -> Result<DeviceBuffer, RuntimeError> {
        self.keep(self.device.zeros(bytes)?)
    }

    fn keep(&mut self, b: DeviceBuffer) -> Result<DeviceBuffer, RuntimeError> {
        self.buffers.push(b);
        Ok(b)
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        for b in self.buffers.drain(..) {
            self.device.free(b);
        }
    }
}

/// A device buffer's bytes as f32 values.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// f32 values as bytes to upload.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}
