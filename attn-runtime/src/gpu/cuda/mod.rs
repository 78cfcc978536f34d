//! CUDA devices (feature `cuda`): PTX from codegen's LLVM lowering (or embedded, or cached),
//! loaded and launched through cudarc, GEMMs through cuBLAS. [`CudaBackend`] is the GPU
//! backend on one; without a driver, [`CudaBackend::new`] is a clean error.
//!
//! Here: the device, its kernel loading and kernel timing; its [`Device`](crate::device::Device)
//! implementation (buffers, launches, tensor maps, GEMMs) in `device.rs`.

mod device;

use super::backend::GpuBackend;
use super::ptx::{PtxOrigin, ptx_for};
use crate::error::RuntimeError;
use codegen::gpu::ir::Kernel;
use codegen::gpu::ir::target::{Arch, dynamic_shared_bytes};
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub(super) fn cuda_error(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Device(e.to_string())
}

/// The GPU backend on a CUDA device.
pub type CudaBackend = GpuBackend<CudaDevice>;

impl CudaBackend {
    /// The backend on device `ordinal` ([`CudaDevice::new`]).
    pub fn new(ordinal: usize) -> Result<Self, RuntimeError> {
        Ok(GpuBackend::on(CudaDevice::new(ordinal)?))
    }
}

/// A CUDA device with its stream and the kernels loaded on it.
#[derive(Debug)]
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    arch: Arch,
    /// Loaded functions by the address of their shared kernel (kept alive here).
    loaded: Mutex<HashMap<usize, (Arc<Kernel>, CudaFunction)>>,
    /// Where each loaded kernel's PTX came from, in load order.
    origins: Mutex<Vec<(String, PtxOrigin)>>,
    /// Buffers made through the `Device` interface, by device address, with their sizes.
    pub(super) buffers: Mutex<std::collections::BTreeMap<i64, (CudaSlice<u8>, usize)>>,
    /// cuBLAS, made on first use.
    pub(super) blas: std::sync::OnceLock<cudarc::cublas::CudaBlas>,
    /// Whether spans of launches are timed by events (`Device::time_kernels`).
    time_kernels: std::sync::atomic::AtomicBool,
    /// The device time of the last timed decode's kernels, in microseconds.
    last_kernel_us: Mutex<Option<f64>>,
}

impl CudaDevice {
    /// The device `ordinal`. Errors (never panics) when there is no CUDA driver, no such
    /// device, or a GPU older than sm_80.
    pub fn new(ordinal: usize) -> Result<Self, RuntimeError> {
        // SAFETY: only tries to load the driver library (libcuda) by name.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(cuda_error(
                "no CUDA driver (libcuda) on this machine: the cuda backend needs an NVIDIA GPU \
                 and its driver; use --backend cpu",
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_error)?;
        let (major, minor) = ctx.compute_capability().map_err(cuda_error)?;
        let arch = Arch::for_capability(major as u32, minor as u32).ok_or_else(|| {
            cuda_error(format!(
                "GPU {ordinal} is sm_{major}{minor}; the kernels need sm_80 or newer"
            ))
        })?;
        let stream = ctx.default_stream();
        Ok(CudaDevice {
            ctx,
            stream,
            arch,
            loaded: Mutex::new(HashMap::new()),
            origins: Mutex::new(Vec::new()),
            buffers: Mutex::new(std::collections::BTreeMap::new()),
            time_kernels: std::sync::atomic::AtomicBool::new(false),
            last_kernel_us: Mutex::new(None),
            blas: std::sync::OnceLock::new(),
        })
    }

    /// The architecture kernels are loaded for.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// Every kernel loaded so far, by entry point, and where its PTX came from (embedded,
    /// disk cache or compiled), in load order.
    pub fn kernel_origins(&self) -> Vec<(String, PtxOrigin)> {
        self.origins
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The kernel loaded on the device (its PTX found or compiled, and loaded, once per
    /// process; see [`super::ptx`]).
    pub(super) fn load(&self, kernel: &Arc<Kernel>) -> Result<CudaFunction, RuntimeError> {
        // Lowered kernels are shared (`Arc`), so the same kernel is the same allocation: its
        // address is the key, and the map keeps the kernel alive so the address stays its own.
        let key = Arc::as_ptr(kernel) as usize;
        let mut loaded = self
            .loaded
            .lock()
            .map_err(|_| cuda_error("kernel cache poisoned"))?;
        if let Some((_, f)) = loaded.get(&key) {
            return Ok(f.clone());
        }
        // sm_90a kernels (wgmma) run on compute capability 9.0 alone.
        let arch = if codegen::gpu::ir::target::needs_sm90a(kernel) {
            let (major, minor) = self.ctx.compute_capability().map_err(cuda_error)?;
            if (major, minor) != (9, 0) {
                return Err(cuda_error(format!(
                    "kernel {} is for sm_90a, and this GPU is sm_{major}{minor}; unset \
                     ATTN_GPU_WGMMA",
                    kernel.name
                )));
            }
            Arch::Sm90a
        } else {
            self.arch
        };
        let ptx = ptx_for(kernel, arch, None)?;
        self.origins
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((kernel.name.clone(), ptx.origin));
        let module = self
            .ctx
            .load_module(Ptx::from_src(ptx.text.to_string()))
            .map_err(cuda_error)?;
        let f = module.load_function(&kernel.name).map_err(cuda_error)?;
        let dynamic = dynamic_shared_bytes(kernel);
        if dynamic > 0 {
            f.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dynamic as i32,
            )
            .map_err(cuda_error)?;
        }
        loaded.insert(key, (Arc::clone(kernel), f.clone()));
        Ok(f)
    }
}
