//! The CUDA device backend (feature `cuda`): PTX from codegen's LLVM lowering, loaded and
//! launched through cudarc. Without a driver, [`CudaBackend::new`] is a clean error.
//!
//! Here: the backend, kernel loading, forward launches and the [`Backend`] calls; resident KV
//! caches and decode in `caches.rs`, the backward in `gradients.rs`, timing in `timing.rs`.

mod caches;
mod gradients;
mod timing;

use super::GpuCall;
use super::decode::{self, DecodeLaunch};
use super::ptx::{PtxOrigin, ptx_for};
use crate::backend::Backend;
use crate::cache::{KvCache, SeqId};
use crate::calls::{BackwardInputs, DecodeOptions, Gradients, Inputs, Output, Queries};
use crate::error::RuntimeError;
use crate::host::checks::finish;
use crate::variant::Variant;
use codegen::gpu::ir::Kernel;
use codegen::gpu::ir::target::{Arch, dynamic_shared_bytes};
use codegen::gpu::ir::tma::{Swizzle, TensorMap};
use codegen::gpu::launch::{ForwardArgs, bind_with_maps};
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub(super) fn device(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Device(e.to_string())
}

/// A CUDA device with its stream and the kernels loaded on it.
#[derive(Debug)]
pub struct CudaBackend {
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
    /// Whether decode launches are timed by events ([`CudaBackend::time_kernels`]).
    time_kernels: std::sync::atomic::AtomicBool,
    /// The device time of the last timed decode's kernels, in microseconds.
    last_kernel_us: Mutex<Option<f64>>,
}

impl CudaBackend {
    /// The device `ordinal`. Errors (never panics) when there is no CUDA driver, no such
    /// device, or a GPU older than sm_80.
    pub fn new(ordinal: usize) -> Result<Self, RuntimeError> {
        // SAFETY: only tries to load the driver library (libcuda) by name.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(device(
                "no CUDA driver (libcuda) on this machine: the cuda backend needs an NVIDIA GPU \
                 and its driver; use --backend cpu",
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(device)?;
        let (major, minor) = ctx.compute_capability().map_err(device)?;
        let arch = Arch::for_capability(major as u32, minor as u32).ok_or_else(|| {
            device(format!(
                "GPU {ordinal} is sm_{major}{minor}; the kernels need sm_80 or newer"
            ))
        })?;
        let stream = ctx.default_stream();
        Ok(CudaBackend {
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
            .map_err(|_| device("kernel cache poisoned"))?;
        if let Some((_, f)) = loaded.get(&key) {
            return Ok(f.clone());
        }
        // sm_90a kernels (wgmma) run on compute capability 9.0 alone.
        let arch = if codegen::gpu::ir::target::needs_sm90a(kernel) {
            let (major, minor) = self.ctx.compute_capability().map_err(device)?;
            if (major, minor) != (9, 0) {
                return Err(device(format!(
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
            .map_err(device)?;
        let f = module.load_function(&kernel.name).map_err(device)?;
        let dynamic = dynamic_shared_bytes(kernel);
        if dynamic > 0 {
            f.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dynamic as i32,
            )
            .map_err(device)?;
        }
        loaded.insert(key, (Arc::clone(kernel), f.clone()));
        Ok(f)
    }

    /// Launches a prepared call and waits for its outputs.
    pub fn run(&self, call: &GpuCall) -> Result<Output, RuntimeError> {
        let [b, h, sq, _] = call.out_shape;
        if b * h * sq == 0 {
            return finish(call.dtype, call.out_shape, Vec::new(), Vec::new());
        }
        let f = self.load(&call.kernel)?;
        let mut buffers = self.upload(call)?;
        self.launch(call, &f, &mut buffers)?;
        let s = &self.stream;
        let out = s.clone_dtoh(&buffers.out).map_err(device)?;
        let lse = s.clone_dtoh(&buffers.lse).map_err(device)?;
        s.synchronize().map_err(device)?;
        finish(call.dtype, call.out_shape, out, lse)
    }

    fn upload(&self, call: &GpuCall) -> Result<Buffers, RuntimeError> {
        call.check_params()?;
        let [b, h, sq, dv] = call.out_shape;
        let s = &self.stream;
        let upload = |v: &[f32]| s.clone_htod(if v.is_empty() { &[0f32][..] } else { v });
        let upload_bytes = |v: &[u8]| s.clone_htod(if v.is_empty() { &[0u8; 4][..] } else { v });
        let (q, k, v) = (
            upload_bytes(&call.q).map_err(device)?,
            upload_bytes(&call.k).map_err(device)?,
            upload_bytes(&call.v).map_err(device)?,
        );
        let codes = s.clone_htod(&call.codes).map_err(device)?;
        let (cos, sin) = (
            upload(&call.rope_cos).map_err(device)?,
            upload(&call.rope_sin).map_err(device)?,
        );
        let out = s.alloc_zeros::<f32>(b * h * sq * dv).map_err(device)?;
        let lse = s.alloc_zeros::<f32>(b * h * sq).map_err(device)?;
        let params = upload(&call.params).map_err(device)?;
        Ok(Buffers {
            q,
            k,
            v,
            codes,
            cos,
            sin,
            out,
            lse,
            params,
        })
    }

    fn launch(
        &self,
        call: &GpuCall,
        f: &CudaFunction,
        x: &mut Buffers,
    ) -> Result<(), RuntimeError> {
        let config = LaunchConfig {
            grid_dim: (call.grid[0], call.grid[1], call.grid[2]),
            block_dim: (call.kernel.threads, 1, 1),
            shared_mem_bytes: dynamic_shared_bytes(&call.kernel),
        };
        let s = &self.stream;
        let ((q, _q), (k, _k), (v, _v)) = (x.q.device_ptr(s), x.k.device_ptr(s), x.v.device_ptr(s));
        let ((codes, _c), (cos, _cs), (sin, _sn)) = (
            x.codes.device_ptr(s),
            x.cos.device_ptr(s),
            x.sin.device_ptr(s),
        );
        let ((out, _o), (lse, _l)) = (x.out.device_ptr_mut(s), x.lse.device_ptr_mut(s));
        let (params, _p) = x.params.device_ptr(s);
        let record = ForwardArgs {
            q: q as i64,
            k: k as i64,
            v: v as i64,
            out: out as i64,
            lse: lse as i64,
            codes: codes as i64,
            sq: call.sq,
            skv: call.skv,
            p0: call.p0,
            rope_cos: cos as i64,
            rope_sin: sin as i64,
            rope_pos0: call.rope_pos0,
            params: if call.params.is_empty() {
                0
            } else {
                params as i64
            },
        };
        let values = bind_with_maps(&call.kernel, &record, call.tensor_maps.len())
            .map_err(RuntimeError::Data)?;
        let maps = call
            .tensor_maps
            .iter()
            .zip([q, k, v])
            .map(|(map, global)| {
                encode_tensor_map(&TensorMap {
                    global: global as i64,
                    ..map.clone()
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut launch = s.launch_builder(f);
        for value in &values {
            launch.arg(value);
        }
        for map in &maps {
            launch.arg(map);
        }
        // SAFETY: `bind_with_maps` checked that the kernel's parameters are the record's
        // fields, in order, all 64-bit: device addresses of buffers of the sizes the kernel
        // indexes (q, k, v, out, lse, codes, the RoPE tables, the parameters, whose length
        // `with_params` checked against the plan's layout; their guards drop after the
        // launch is queued) and i64 scalars, then as many tensor maps as are passed, each
        // encoded by the driver over q, k or v; the grid and CTA size are the ones it was
        // lowered for.
        unsafe { launch.launch(config) }.map_err(device)?;
        Ok(())
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
        return Err(device(format!("cuTensorMapEncodeTiled: {result:?}")));
    }
    Ok(TensorMapArg(out))
}

/// A call's buffers on the device.
struct Buffers {
    q: CudaSlice<u8>,
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
    codes: CudaSlice<i32>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    out: CudaSlice<f32>,
    lse: CudaSlice<f32>,
    /// The spec's parameters (one unused value without).
    params: CudaSlice<f32>,
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    /// Inputs and outputs on the host; MLA's inputs are absorbed on the host, the kernel runs
    /// over the shared latent head, and its output is expanded on the host.
    fn forward_bound(
        &self,
        variant: &Variant,
        inputs: Inputs,
        position_offset: i64,
        params: &[f32],
    ) -> Result<Output, RuntimeError> {
        match inputs {
            Inputs::Heads { q, k, v } => self
                .run(&GpuCall::forward_in(variant, q, k, v, position_offset)?.with_params(params)?),
            Inputs::Mla(x) => {
                let (call, absorbed) = GpuCall::forward_mla(variant, &x, position_offset)?;
                let latent = self.run(&call)?;
                absorbed.finish(
                    variant.spec(),
                    latent.out.to_f32_vec(),
                    latent.lse.to_f32_vec(),
                )
            }
        }
    }

    /// The GPU decode kernel over the cache's segments, with the CPU backend's work items,
    /// partitions and lse merge. The cache lives in host memory, so each call uploads its
    /// memory; [`CudaBackend::decode_resident`] decodes against a copy uploaded once.
    fn attend_cached_bound(
        &self,
        variant: &Variant,
        queries: Queries,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
        params: &[f32],
    ) -> Result<Output, RuntimeError> {
        let run = &|l: &DecodeLaunch| self.run_decode(l, None, params);
        match queries {
            Queries::Uniform(q) => decode::decode_with(variant, q, cache, seqs, options, run),
            Queries::Ragged { q, offsets } => {
                decode::attend_ragged_with(variant, q, offsets, cache, seqs, options, run)
            }
            Queries::Mla(queries) => {
                decode::decode_mla_with(variant, queries, cache, seqs, options, run)
            }
        }
    }

    fn backward_bound(
        &self,
        variant: &Variant,
        x: &BackwardInputs,
        params: &[f32],
    ) -> Result<(Gradients, Vec<f32>), RuntimeError> {
        match x {
            BackwardInputs::Heads(x) => self
                .backward_heads(variant, x, params)
                .map(|(g, dparams)| (Gradients::Heads(g), dparams)),
            BackwardInputs::Mla(_) => Err(RuntimeError::Unsupported {
                backend: "cuda",
                what: "the MLA backward (the cpu backend does)".into(),
            }),
        }
    }
}
