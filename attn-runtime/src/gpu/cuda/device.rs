//! The CUDA backend as a [`Device`] for models resident on the GPU: buffers owned by the backend
//! and named by their device addresses, launches of GPU IR kernels loaded as PTX, and GEMMs
//! through cuBLAS (16-bit weights: `cublasGemmEx` on the activations rounded to the weights'
//! format by a generated kernel, accumulating in f32; f32 weights: the same call in f32).

use super::{CudaDevice, cuda_error};
use crate::device::{Device, DeviceBuffer};
use crate::error::RuntimeError;
use attn_dsl::DType;
use codegen::gpu::ir::tma::{Swizzle, TensorMap};
use codegen::gpu::ir::{Half, Kernel};
use codegen::gpu::kernels::layers::{self, SwapArgs, THREADS};
use codegen::gpu::launch::{Param, ParamKind};
use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::{Arc, OnceLock};

impl CudaDevice {
    fn keep(&self, slice: CudaSlice<u8>, bytes: usize) -> Result<DeviceBuffer, RuntimeError> {
        let (ptr, guard) = slice.device_ptr(&self.stream);
        drop(guard);
        let addr = ptr as i64;
        self.buffers
            .lock()
            .map_err(|_| cuda_error("the device's buffer map is poisoned"))?
            .insert(addr, (slice, bytes));
        Ok(DeviceBuffer { addr, bytes })
    }

    /// Whether `[addr, addr + 1)` lies inside a live buffer.
    fn owns(&self, addr: i64) -> Result<bool, RuntimeError> {
        let map = self
            .buffers
            .lock()
            .map_err(|_| cuda_error("the device's buffer map is poisoned"))?;
        Ok(map
            .range(..=addr)
            .next_back()
            .is_some_and(|(start, (_, bytes))| addr < start + (*bytes).max(1) as i64))
    }

    fn blas(&self) -> Result<&CudaBlas, RuntimeError> {
        if let Some(b) = self.blas.get() {
            return Ok(b);
        }
        let made = CudaBlas::new(Arc::clone(&self.stream)).map_err(cuda_error)?;
        Ok(self.blas.get_or_init(|| made))
    }
}

/// The kernel that rounds f32 rows to a 16-bit format (a swap of a unit outer axis).
fn to_half(half: Half) -> Result<Arc<Kernel>, RuntimeError> {
    static KERNELS: OnceLock<[Arc<Kernel>; 2]> = OnceLock::new();
    if KERNELS.get().is_none() {
        let bf16 = Arc::new(codegen::gpu::verified(layers::swap_outer(Some(
            Half::Bf16,
        )))?);
        let f16 = Arc::new(codegen::gpu::verified(layers::swap_outer(Some(Half::F16)))?);
        let _ = KERNELS.set([bf16, f16]);
    }
    let k = KERNELS.get().expect("set above");
    Ok(Arc::clone(match half {
        Half::Bf16 => &k[0],
        Half::F16 => &k[1],
    }))
}

impl Device for CudaDevice {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn upload(&self, bytes: &[u8]) -> Result<DeviceBuffer, RuntimeError> {
        // Empty buffers still get an allocation of their own, so addresses stay unique.
        let slice = self
            .stream
            .clone_htod(if bytes.is_empty() {
                &[0u8; 16][..]
            } else {
                bytes
            })
            .map_err(cuda_error)?;
        self.keep(slice, bytes.len())
    }

    fn zeros(&self, bytes: usize) -> Result<DeviceBuffer, RuntimeError> {
        let slice = self
            .stream
            .alloc_zeros::<u8>(bytes.max(16))
            .map_err(cuda_error)?;
        self.keep(slice, bytes)
    }

    fn download(&self, buffer: DeviceBuffer) -> Result<Vec<u8>, RuntimeError> {
        let map = self
            .buffers
            .lock()
            .map_err(|_| cuda_error("the device's buffer map is poisoned"))?;
        // The buffer holding `[addr, addr + bytes)`: a whole buffer or a range inside one.
        let (start, (slice, size)) = map
            .range(..=buffer.addr)
            .next_back()
            .ok_or_else(|| cuda_error(format!("no buffer at {:#x}", buffer.addr)))?;
        let offset = (buffer.addr - start) as usize;
        if offset + buffer.bytes > *size {
            return Err(cuda_error(format!(
                "{} bytes at {:#x} run past the buffer they start in",
                buffer.bytes, buffer.addr
            )));
        }
        self.stream
            .clone_dtoh(&slice.slice(offset..offset + buffer.bytes))
            .map_err(cuda_error)
    }

    fn write(&self, buffer: DeviceBuffer, offset: usize, bytes: &[u8]) -> Result<(), RuntimeError> {
        let mut map = self
            .buffers
            .lock()
            .map_err(|_| cuda_error("the device's buffer map is poisoned"))?;
        let (slice, size) = map
            .get_mut(&buffer.addr)
            .ok_or_else(|| cuda_error(format!("no buffer at {:#x}", buffer.addr)))?;
        let end = offset
            .checked_add(bytes.len())
            .filter(|&end| end <= *size)
            .ok_or_else(|| {
                cuda_error(format!(
                    "{} bytes at offset {offset} run past a {size}-byte buffer",
                    bytes.len()
                ))
            })?;
        if bytes.is_empty() {
            return Ok(());
        }
        let mut dst = slice.slice_mut(offset..end);
        self.stream.memcpy_htod(bytes, &mut dst).map_err(cuda_error)
    }

    fn prepare(&self, kernel: &Arc<Kernel>) -> Result<(), RuntimeError> {
        self.load(kernel).map(|_| ())
    }

    fn synchronize(&self) -> Result<(), RuntimeError> {
        self.stream.synchronize().map_err(cuda_error)
    }

    fn time_kernels(&self, on: bool) -> Result<(), RuntimeError> {
        self.time_kernels
            .store(on, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn last_kernel_us(&self) -> Option<f64> {
        *self
            .last_kernel_us
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// CUDA events around the span when [`Device::time_kernels`] is on (they cost a few
    /// microseconds of host time, so they are off unless asked for).
    fn time_span(
        &self,
        launches: &mut dyn FnMut() -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        if !self.time_kernels.load(std::sync::atomic::Ordering::Relaxed) {
            return launches();
        }
        let event = || {
            self.stream
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(cuda_error)
        };
        let start = event()?;
        launches()?;
        let end = event()?;
        self.stream.synchronize().map_err(cuda_error)?;
        let ms = start.elapsed_ms(&end).map_err(cuda_error)?;
        *self
            .last_kernel_us
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(f64::from(ms) * 1e3);
        Ok(())
    }

    fn free(&self, buffer: DeviceBuffer) {
        if let Ok(mut map) = self.buffers.lock() {
            map.remove(&buffer.addr);
        }
    }

    fn launch(
        &self,
        kernel: &Arc<Kernel>,
        grid: [u32; 3],
        fields: &[Param],
        args: &[i64],
        maps: &[TensorMap],
    ) -> Result<(), RuntimeError> {
        if fields.len() != args.len() || args.len() + maps.len() != kernel.params.len() {
            return Err(cuda_error(format!(
                "kernel `{}` takes {} arguments; {} given for {} fields and {} tensor maps",
                kernel.name,
                kernel.params.len(),
                args.len(),
                fields.len(),
                maps.len()
            )));
        }
        for (field, &value) in fields.iter().zip(args) {
            if field.kind == ParamKind::Address && value != 0 && !self.owns(value)? {
                return Err(cuda_error(format!(
                    "argument `{}` of kernel `{}` ({value:#x}) is not in a live buffer",
                    field.name, kernel.name
                )));
            }
        }
        for map in maps {
            if !self.owns(map.global)? {
                return Err(cuda_error(format!(
                    "a tensor map of kernel `{}` ({:#x}) is not over a live buffer",
                    kernel.name, map.global
                )));
            }
        }
        let maps = maps
            .iter()
            .map(encode_tensor_map)
            .collect::<Result<Vec<_>, _>>()?;
        let f = self.load(kernel)?;
        let config = LaunchConfig {
            grid_dim: (grid[0], grid[1], grid[2]),
            block_dim: (kernel.threads, 1, 1),
            shared_mem_bytes: codegen::gpu::ir::target::dynamic_shared_bytes(kernel),
        };
        let mut launch = self.stream.launch_builder(&f);
        for value in args {
            launch.arg(value);
        }
        for map in &maps {
            launch.arg(map);
        }
        // SAFETY: the kernel takes one 64-bit parameter per argument, then one 128-byte tensor
        // map per map (counts checked above; `bind_with_maps` made `args`); every address
        // argument is 0 or inside a buffer this backend keeps alive until it is freed, each map
        // was encoded by the driver over such a buffer, and the launch is queued on the stream
        // those buffers belong to.
        unsafe { launch.launch(config) }.map_err(cuda_error)?;
        Ok(())
    }

    fn gemm_t(
        &self,
        x: DeviceBuffer,
        w: DeviceBuffer,
        dtype: DType,
        y: DeviceBuffer,
        n: usize,
        inp: usize,
        out: usize,
    ) -> Result<(), RuntimeError> {
        let size = dtype.size_bytes() as usize;
        let need = |what: &str, b: DeviceBuffer, bytes: Option<usize>| match bytes {
            Some(bytes) if bytes <= b.bytes => Ok(()),
            _ => Err(cuda_error(format!(
                "a GEMM's {what} needs more than its {}-byte buffer",
                b.bytes
            ))),
        };
        need("x", x, n.checked_mul(inp).and_then(|v| v.checked_mul(4)))?;
        need(
            "w",
            w,
            out.checked_mul(inp).and_then(|v| v.checked_mul(size)),
        )?;
        need("y", y, n.checked_mul(out).and_then(|v| v.checked_mul(4)))?;
        let int = |v: usize| {
            i32::try_from(v).map_err(|_| cuda_error(format!("a GEMM dimension of {v} is past i32")))
        };
        let (m_, n_, k_) = (int(out)?, int(n)?, int(inp)?);
        // 16-bit weights take the activations rounded to their format.
        let (b, b_type, a_type, rounded) = match dtype {
            DType::F32 => (
                x.addr,
                cudaDataType_t::CUDA_R_32F,
                cudaDataType_t::CUDA_R_32F,
                None,
            ),
            DType::Bf16 | DType::F16 => {
                let half = if dtype == DType::Bf16 {
                    Half::Bf16
                } else {
                    Half::F16
                };
                let kind = if dtype == DType::Bf16 {
                    cudaDataType_t::CUDA_R_16BF
                } else {
                    cudaDataType_t::CUDA_R_16F
                };
                let tmp = self.zeros(2 * n * inp)?;
                let record = SwapArgs {
                    x: x.addr,
                    out: tmp.addr,
                    a: 1,
                    b: n as i64,
                    width: inp as i64,
                };
                let kernel = to_half(half)?;
                let ctas = u32::try_from((n * inp / 2).div_ceil(THREADS as usize).max(1))
                    .map_err(|_| cuda_error("a GEMM's activations are more than a grid holds"))?;
                crate::device::launch(self, &kernel, [ctas, 1, 1], &record, &[])?;
                (tmp.addr, kind, kind, Some(tmp))
            }
        };
        let (alpha, beta) = (1f32, 0f32);
        // Row-major y [n, out] = x [n, inp] w^T is column-major y^T [out, n] = w [out, inp]
        // (column-major [inp, out], transposed) times x^T (column-major [inp, n]).
        // SAFETY: the three buffers are live device allocations of this backend holding at
        // least the bytes the product reads and writes (checked above), on the stream cuBLAS
        // was bound to; alpha and beta outlive the call.
        let result = unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas()?.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m_,
                n_,
                k_,
                &alpha as *const f32 as *const _,
                w.addr as u64 as *const _,
                a_type,
                k_,
                b as u64 as *const _,
                b_type,
                k_,
                &beta as *const f32 as *const _,
                y.addr as u64 as *mut _,
                cudaDataType_t::CUDA_R_32F,
                m_,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if let Some(tmp) = rounded {
            // The product is queued before the free, on the same stream.
            self.stream.synchronize().map_err(cuda_error)?;
            self.free(tmp);
        }
        result.map_err(cuda_error)
    }
}

/// A tensor map as a kernel parameter: the driver's 128-byte, 64-aligned `CUtensorMap`, passed
/// by value.
#[repr(transparent)]
struct TensorMapArg(cudarc::driver::sys::CUtensorMap);

// SAFETY: `CUtensorMap` is plain bytes (`#[repr(C, align(64))]`, 16 u64) that the driver copies
// into the kernel's parameter space, which declares it `.param .align 64 .b8 [128]`.
unsafe impl cudarc::driver::DeviceRepr for TensorMapArg {}

/// Encodes a map with `cuTensorMapEncodeTiled` (checked first as the interpreter checks it).
fn encode_tensor_map(map: &TensorMap) -> Result<TensorMapArg, RuntimeError> {
    use cudarc::driver::sys;
    map.check().map_err(RuntimeError::Data)?;
    let data = match map.elem_bytes {
        2 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
        4 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT32,
        n => {
            return Err(RuntimeError::Data(format!(
                "a tensor map of {n}-byte elements"
            )));
        }
    };
    let swizzle = match map.swizzle {
        Swizzle::None => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        Swizzle::B32 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_32B,
        Swizzle::B64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        Swizzle::B128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    };
    let rank = map.dims.len();
    let ones = vec![1u32; rank];
    let mut out = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: `out` is a writable CUtensorMap; the dims, strides, box and element strides
    // arrays hold rank, rank - 1, rank and rank values (`check` enforced the counts and the
    // driver's limits); the global address is a device allocation the map describes.
    let result = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut out,
            data,
            rank as u32,
            map.global as usize as *mut std::ffi::c_void,
            map.dims.as_ptr(),
            map.strides.as_ptr(),
            map.boxes.as_ptr(),
            ones.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if result != sys::CUresult::CUDA_SUCCESS {
        return Err(cuda_error(format!("cuTensorMapEncodeTiled: {result:?}")));
    }
    Ok(TensorMapArg(out))
}
