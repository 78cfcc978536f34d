//! Kernel timing on the device: CUDA events around each launch when asked, and repeated calls
//! timed for `attnc bench`.

use super::{CudaBackend, device};
use crate::error::RuntimeError;
use crate::gpu::GpuCall;

impl CudaBackend {
    /// Times every decode step's kernels (the decode kernel and the partition merge) by CUDA
    /// events from now on, or stops; [`CudaBackend::last_kernel_us`] reads the last. The events
    /// cost a few microseconds of host time a step, so they are off unless asked for.
    pub fn time_kernels(&self, on: bool) {
        self.time_kernels
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The device time, in microseconds, from the start of the last timed decode's kernel to
    /// the end of its merge (`None` before the first timed decode).
    pub fn last_kernel_us(&self) -> Option<f64> {
        *self
            .last_kernel_us
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Times a prepared call on the device: the kernel is loaded (its PTX emitted and loaded,
    /// `load_ms`) and the inputs uploaded once, one launch warms up, then each of `reps` launches
    /// is timed to its completion. Returns `(load_ms, per-launch ms)`.
    pub fn time(&self, call: &GpuCall, reps: usize) -> Result<(f64, Vec<f64>), RuntimeError> {
        let start = std::time::Instant::now();
        let f = self.load(&call.kernel)?;
        let load_ms = start.elapsed().as_secs_f64() * 1e3;
        let mut buffers = self.upload(call)?;
        self.launch(call, &f, &mut buffers)?;
        self.stream.synchronize().map_err(device)?;
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            let start = std::time::Instant::now();
            self.launch(call, &f, &mut buffers)?;
            self.stream.synchronize().map_err(device)?;
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        Ok((load_ms, times))
    }
}
