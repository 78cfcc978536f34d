//! The CUDA backend as a [`Device`] for models resident on the GPU: buffers owned by the backend
//! and named by their device addresses, launches of GPU IR kernels loaded as PTX, and GEMMs
//! through cuBLAS (16-bit weights: `cublasGemmEx` on the activations rounded to the weights'
//! format by a generated kernel, accumulating in f32; f32 weights: the same call in f32).

use super::cuda::{CudaBackend, device};
use crate::device::{Device, DeviceBuffer};
use crate::error::RuntimeError;
use attn_dsl::DType;
use codegen::gpu::ir::{Half, Kernel};
use codegen::gpu::kernels::layers::{self, SwapArgs, THREADS};
use codegen::gpu::launch::{LaunchRecord, Param, ParamKind, bind};
use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::{Arc, OnceLock};

impl CudaBackend {
    fn keep(&self, slice: CudaSlice<u8>, bytes: usize) -> Result<DeviceBuffer, RuntimeError> {
        let (ptr, guard) = slice.device_ptr(&self.stream);
        drop(guard);
        let addr = ptr as i64;
        self.buffers
            .lock()
            .map_err(|_| device("the device's buffer map is poisoned"))?
            .insert(addr, (slice, bytes));
        Ok(DeviceBuffer { addr, bytes })
    }

    /// Whether `[addr, addr + 1)` lies inside a live buffer.
    fn owns(&self, addr: i64) -> Result<bool, RuntimeError> {
        let map = self
            .buffers
            .lock()
            .map_err(|_| device("the device's buffer map is poisoned"))?;
        Ok(map
            .range(..=addr)
            .next_back()
            .is_some_and(|(start, (_, bytes))| addr < start + (*bytes).max(1) as i64))
    }

    fn blas(&self) -> Result<&CudaBlas, RuntimeError> {
        if let Some(b) = self.blas.get() {
            return Ok(b);
        }
        let made = CudaBlas::new(Arc::clone(&self.stream)).map_err(device)?;
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

impl Device for CudaBackend {
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
            .map_err(device)?;
        self.keep(slice, bytes.len())
    }

    fn zeros(&self, bytes: usize) -> Result<DeviceBuffer, RuntimeError> {
        let slice = self
            .stream
            .alloc_zeros::<u8>(bytes.max(16))
            .map_err(device)?;
        self.keep(slice, bytes)
    }

    fn download(&self, buffer: DeviceBuffer) -> Result<Vec<u8>, RuntimeError> {
        let map = self
            .buffers
            .lock()
            .map_err(|_| device("the device's buffer map is poisoned"))?;
        // The buffer holding `[addr, addr + bytes)`: a whole buffer or a range inside one.
        let (start, (slice, size)) = map
            .range(..=buffer.addr)
            .next_back()
            .ok_or_else(|| device(format!("no buffer at {:#x}", buffer.addr)))?;
        let offset = (buffer.addr - start) as usize;
        if offset + buffer.bytes > *size {
            return Err(device(format!(
                "{} bytes at {:#x} run past the buffer they start in",
                buffer.bytes, buffer.addr
            )));
        }
        self.stream
            .clone_dtoh(&slice.slice(offset..offset + buffer.bytes))
            .map_err(device)
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
    ) -> Result<(), RuntimeError> {
        if fields.len() != args.len() || args.len() != kernel.params.len() {
            return Err(device(format!(
                "kernel `{}` takes {} arguments; {} given for {} fields",
                kernel.name,
                kernel.params.len(),
                args.len(),
                fields.len()
            )));
        }
        for (field, &value) in fields.iter().zip(args) {
            if field.kind == ParamKind::Address && value != 0 && !self.owns(value)? {
                return Err(device(format!(
                    "argument `{}` of kernel `{}` ({value:#x}) is not in a live buffer",
                    field.name, kernel.name
                )));
            }
        }
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
        // SAFETY: the kernel takes one 64-bit parameter per argument (counts checked above);
        // every address argument is 0 or inside a buffer this backend keeps alive until it is
        // freed, and the launch is queued on the stream those buffers belong to.
        unsafe { launch.launch(config) }.map_err(device)?;
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
            _ => Err(device(format!(
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
            i32::try_from(v).map_err(|_| device(format!("a GEMM dimension of {v} is past i32")))
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
                let args = bind(&kernel, &record).map_err(RuntimeError::Data)?;
                let ctas = u32::try_from((n * inp / 2).div_ceil(THREADS as usize).max(1))
                    .map_err(|_| device("a GEMM's activations are more than a grid holds"))?;
                Device::launch(self, &kernel, [ctas, 1, 1], SwapArgs::FIELDS, &args)?;
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
            self.stream.synchronize().map_err(device)?;
            self.free(tmp);
        }
        result.map_err(device)
    }
}
