//! The CUDA device backend (feature `cuda`): PTX from codegen's LLVM lowering, loaded and
//! launched through cudarc. Without a driver, [`CudaBackend::new`] is a clean error.

use super::GpuCall;
use super::backward::{BackwardCall, Prepared};
use super::decode::{self, DecodeLaunch};
use super::pages::PagedSegments;
use super::ptx::{PtxOrigin, ptx_for};
use crate::backend::Backend;
use crate::cache::{KvCache, MirrorSync, SeqId};
use crate::calls::{
    BackwardInputs, DecodeOptions, Gradients, HeadGradients, HeadsBackward, Inputs, MlaQueries,
    Output, Queries,
};
use crate::error::RuntimeError;
use crate::host::checks::finish;
use crate::tensor::Tensor;
use crate::variant::Variant;
use codegen::gpu::ir::Kernel;
use codegen::gpu::ir::target::{Arch, dynamic_shared_bytes};
use codegen::gpu::ir::tma::{Swizzle, TensorMap};
use codegen::gpu::kernels::decode::SEGMENT_FIELDS;
use codegen::gpu::launch::{DecodeArgs, ForwardArgs, bind, bind_with_maps};
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

/// Merged decode rows and their lse on the device, and the merge map's buffer.
type Merged = (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<u8>);

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

    /// A copy of the cache's memory on the device, for [`CudaBackend::decode_resident`]. After
    /// the cache changes, bring it up to date with [`CudaBackend::sync_cache`] (decoding
    /// against an out-of-date copy is an error).
    pub fn upload_cache(&self, cache: &impl KvCache) -> Result<DeviceCache, RuntimeError> {
        let buffers = cache
            .memory()
            .into_iter()
            .map(|host| {
                self.stream
                    .clone_htod(if host.is_empty() {
                        &[0u8; 16][..]
                    } else {
                        host
                    })
                    .map_err(device)
            })
            .collect::<Result<_, _>>()?;
        Ok(DeviceCache {
            regions: cache
                .regions()
                .into_iter()
                .map(|(start, bytes)| (start as usize, bytes))
                .collect(),
            buffers,
            generation: cache.generation(),
        })
    }

    /// Brings a device copy of `cache` up to date: only the bytes written since it was taken
    /// where the cache can say which ([`KvCache::changes_since`]; a decode step appends a row
    /// per kv head), else the whole cache again. Returns the bytes copied.
    pub fn sync_cache(
        &self,
        resident: &mut DeviceCache,
        cache: &impl KvCache,
    ) -> Result<usize, RuntimeError> {
        let memory = cache.memory();
        let total = memory.iter().map(|m| m.len()).sum();
        let plan = MirrorSync::plan(cache, &resident.regions, resident.generation);
        match &plan {
            MirrorSync::UpToDate => {}
            MirrorSync::Full => *resident = self.upload_cache(cache)?,
            MirrorSync::Writes(writes) => {
                for w in writes {
                    let range = w.start..w.start + w.len;
                    let mut dst = resident.buffers[w.region].slice_mut(range.clone());
                    self.stream
                        .memcpy_htod(&memory[w.region][range], &mut dst)
                        .map_err(device)?;
                }
                resident.generation = cache.generation();
            }
        }
        Ok(plan.bytes(total))
    }

    /// [`Queries::Uniform`] against a device copy of `cache` from
    /// [`CudaBackend::upload_cache`]: nothing of the cache is uploaded.
    pub fn decode_resident(
        &self,
        variant: &Variant,
        q: &Tensor,
        cache: &dyn KvCache,
        resident: &DeviceCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        decode::decode_with(variant, q, cache, seqs, options, &|l| {
            self.run_decode(l, Some(resident), &[])
        })
    }

    /// [`Queries::Mla`] against a device copy of the latent cache from
    /// [`CudaBackend::upload_cache`].
    pub fn decode_mla_resident(
        &self,
        variant: &Variant,
        queries: MlaQueries,
        cache: &dyn KvCache,
        resident: &DeviceCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        decode::decode_mla_with(variant, queries, cache, seqs, options, &|l| {
            self.run_decode(l, Some(resident), &[])
        })
    }

    /// The segment records of a launch, made on the device from its page tables (the cache's
    /// region at device address `base`).
    fn segments_from_pages(
        &self,
        p: &PagedSegments,
        base: i64,
    ) -> Result<CudaSlice<u8>, RuntimeError> {
        let s = &self.stream;
        let mut records = s
            .alloc_zeros::<u8>(p.records.max(1) * 8 * SEGMENT_FIELDS)
            .map_err(device)?;
        if p.records == 0 {
            return Ok(records);
        }
        let f = self.load(&p.kernel)?;
        let pieces: Vec<u8> = p.pieces.iter().flat_map(|x| x.to_le_bytes()).collect();
        let pages: Vec<u8> = p.pages.iter().flat_map(|x| x.to_le_bytes()).collect();
        let (pieces, pages) = (
            s.clone_htod(&pieces).map_err(device)?,
            s.clone_htod(if pages.is_empty() {
                &[0u8; 16][..]
            } else {
                &pages
            })
            .map_err(device)?,
        );
        let ((pieces_ptr, _p), (pages_ptr, _g)) = (pieces.device_ptr(s), pages.device_ptr(s));
        let (records_ptr, _r) = records.device_ptr_mut(s);
        let record = p.args([
            pieces_ptr as i64,
            pages_ptr as i64,
            records_ptr as i64,
            base,
        ]);
        let values = bind(&p.kernel, &record).map_err(RuntimeError::Data)?;
        let mut launch = s.launch_builder(&f);
        for value in &values {
            launch.arg(value);
        }
        let config = LaunchConfig {
            grid_dim: (p.ctas()?, 1, 1),
            block_dim: (p.kernel.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `bind` checked the kernel's parameters against its record: device addresses
        // of the pieces and page tables uploaded above, and of `records`, sized for every
        // record the pieces make; the cache region at `base`, whose blocks the page tables
        // index, is alive (the caller's buffers). The guards drop after the launch is queued.
        unsafe { launch.launch(config) }.map_err(device)?;
        drop((_p, _g, _r));
        Ok(records)
    }

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

    /// Runs a prepared decode launch, its cache's memory uploaded now or found in `resident`;
    /// returns `out` and `lse` (all rows).
    fn run_decode(
        &self,
        l: &DecodeLaunch,
        resident: Option<&DeviceCache>,
        params: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
        l.check_params(params)?;
        let f = self.load(&l.kernel)?;
        let s = &self.stream;
        let some = |v: &[u8]| s.clone_htod(if v.is_empty() { &[0u8; 16][..] } else { v });
        let i64_bytes = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let uploaded: Vec<CudaSlice<u8>>;
        let buffers = match resident {
            Some(r) => {
                if r.generation != l.generation || r.regions != l.regions() {
                    return Err(RuntimeError::Cache(
                        "the device copy of the cache is out of date (the cache changed after \
                         upload_cache): upload it again"
                            .into(),
                    ));
                }
                &r.buffers
            }
            None => {
                uploaded = l
                    .memory
                    .iter()
                    .map(|m| some(m).map_err(device))
                    .collect::<Result<_, _>>()?;
                &uploaded
            }
        };
        let bases: Vec<i64> = buffers
            .iter()
            .map(|b| {
                let (ptr, _sync) = b.device_ptr(s);
                ptr as i64
            })
            .collect();
        let segments = match &l.pages {
            Some(p) => self.segments_from_pages(p, bases[p.geometry.region])?,
            None => some(&i64_bytes(&l.segment_records(&bases)?)).map_err(device)?,
        };
        let tasks = some(&i64_bytes(&l.tasks)).map_err(device)?;
        let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let q_rows = some(&f32_bytes(&l.q_rows)).map_err(device)?;
        let (cos, sin) = (
            some(&f32_bytes(&l.rope_cos)).map_err(device)?,
            some(&f32_bytes(&l.rope_sin)).map_err(device)?,
        );
        let param_buffer = some(&f32_bytes(params)).map_err(device)?;
        let mut out = s.alloc_zeros::<f32>(l.out_rows * l.v_dim).map_err(device)?;
        let mut lse = s.alloc_zeros::<f32>(l.out_rows).map_err(device)?;
        let config = LaunchConfig {
            grid_dim: (l.ctas, 1, 1),
            block_dim: (l.kernel.threads, 1, 1),
            shared_mem_bytes: dynamic_shared_bytes(&l.kernel),
        };
        let ((q_rows, _q), (tasks, _t), (segments, _s)) = (
            q_rows.device_ptr(s),
            tasks.device_ptr(s),
            segments.device_ptr(s),
        );
        let ((rope_cos, _c), (rope_sin, _n)) = (cos.device_ptr(s), sin.device_ptr(s));
        let ((out_ptr, _o), (lse_ptr, _l)) = (out.device_ptr_mut(s), lse.device_ptr_mut(s));
        let (param_ptr, _p) = param_buffer.device_ptr(s);
        let record = DecodeArgs {
            q_rows: q_rows as i64,
            tasks: tasks as i64,
            segments: segments as i64,
            out: out_ptr as i64,
            lse: lse_ptr as i64,
            rope_cos: rope_cos as i64,
            rope_sin: rope_sin as i64,
            rope_pos0: 0,
            k_base: 0,
            v_base: 0,
            params: if params.is_empty() {
                0
            } else {
                param_ptr as i64
            },
        };
        let values = bind(&l.kernel, &record).map_err(RuntimeError::Data)?;
        let timed = self.time_kernels.load(std::sync::atomic::Ordering::Relaxed);
        let event = || {
            s.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(device)
        };
        let start = if timed { Some(event()?) } else { None };
        let mut launch = s.launch_builder(&f);
        for value in &values {
            launch.arg(value);
        }
        // SAFETY: `bind` checked that the kernel's parameters are the record's fields, in
        // order, all 64-bit: device addresses of the query rows, task and segment records
        // (whose row addresses point into `buffers`, alive until the launch completes), outputs
        // of `out_rows` rows, RoPE tables and the parameters (as many as the kernel reads,
        // checked above), all alive past the launch (the guards `_q`..`_p` order the stream's
        // accesses and drop after it is queued).
        unsafe { launch.launch(config) }.map_err(device)?;
        drop((_q, _t, _s, _c, _n, _o, _l, _p));
        // The partitions merged on the device; only the call's rows come back.
        // The merge map's buffer stays alive until the stream is synchronized below.
        let (merged, merged_lse, _map) = self.merge_partitions(l, &out, &lse)?;
        let end = if timed { Some(event()?) } else { None };
        let mut out = s.clone_dtoh(&merged).map_err(device)?;
        let mut lse = s.clone_dtoh(&merged_lse).map_err(device)?;
        s.synchronize().map_err(device)?;
        if let (Some(start), Some(end)) = (start, end) {
            let ms = start.elapsed_ms(&end).map_err(device)?;
            *self
                .last_kernel_us
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(f64::from(ms) * 1e3);
        }
        out.truncate(l.merged_rows * l.v_dim);
        lse.truncate(l.merged_rows);
        Ok((out, lse))
    }

    /// Queues the merge of a decode launch's partial rows `out` and `lse` on the device (the
    /// merge kernel); returns the merged rows and their lse, `merged_rows` of each (at least one
    /// allocated), and the merge map's buffer, which the caller keeps until the stream is done.
    fn merge_partitions(
        &self,
        l: &DecodeLaunch,
        out: &CudaSlice<f32>,
        lse: &CudaSlice<f32>,
    ) -> Result<Merged, RuntimeError> {
        let s = &self.stream;
        let some = |v: &[u8]| s.clone_htod(if v.is_empty() { &[0u8; 16][..] } else { v });
        let merge = self.load(&l.merge)?;
        let map = some(
            &l.map
                .iter()
                .flat_map(|i| i.to_le_bytes())
                .collect::<Vec<u8>>(),
        )
        .map_err(device)?;
        let mut merged = s
            .alloc_zeros::<f32>((l.merged_rows * l.v_dim).max(1))
            .map_err(device)?;
        let mut merged_lse = s.alloc_zeros::<f32>(l.merged_rows.max(1)).map_err(device)?;
        let ((parts, _p), (part_lse, _pl), (map_ptr, _m)) =
            (out.device_ptr(s), lse.device_ptr(s), map.device_ptr(s));
        let ((merged_ptr, _o), (merged_lse_ptr, _ol)) =
            (merged.device_ptr_mut(s), merged_lse.device_ptr_mut(s));
        let record = l.merge_record(
            parts as i64,
            part_lse as i64,
            map_ptr as i64,
            merged_ptr as i64,
            merged_lse_ptr as i64,
        );
        let values = bind(&l.merge, &record).map_err(RuntimeError::Data)?;
        let config = LaunchConfig {
            grid_dim: (l.merge_ctas()?, 1, 1),
            block_dim: (l.merge.threads, 1, 1),
            shared_mem_bytes: dynamic_shared_bytes(&l.merge),
        };
        let mut launch = s.launch_builder(&merge);
        for value in &values {
            launch.arg(value);
        }
        // SAFETY: `bind` checked the merge kernel's parameters against its record: device
        // addresses of the partial rows and lse written above, the merge map, and merged
        // outputs of `merged_rows` rows, all alive past the launch; the guards drop after it.
        unsafe { launch.launch(config) }.map_err(device)?;
        drop((_p, _pl, _m, _o, _ol));
        Ok((merged, merged_lse, map))
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

    /// Gradients through the GPU backward kernels (delta, dq, dk and dv: on tensor cores for
    /// the bf16 and f16 specs `codegen::gpu::kernels::backward_tc` supports, else SIMT): inputs uploaded,
    /// three launches, gradients downloaded.
    fn backward_heads(
        &self,
        variant: &Variant,
        x: &HeadsBackward,
        params: &[f32],
    ) -> Result<(HeadGradients, Vec<f32>), RuntimeError> {
        let call = match BackwardCall::prepare(variant, x, params)? {
            Prepared::Launch(call) => call,
            Prepared::Empty(zeros) => return Ok((*zeros, vec![0.0; params.len()])),
        };
        let mut buffers = self.upload_backward(&call)?;
        self.launch_backward(&call, &mut buffers)?;
        let s = &self.stream;
        let mut grads = Vec::with_capacity(3);
        for (buffer, n) in buffers.outputs[1..].iter().zip(call.output_lens()) {
            let mut values = s.clone_dtoh(buffer).map_err(device)?;
            values.truncate(n);
            grads.push(values);
        }
        let mut dparams = s.clone_dtoh(&buffers.params[2]).map_err(device)?;
        dparams.truncate(call.params.len());
        s.synchronize().map_err(device)?;
        let [dq, dk, dv]: [Vec<f32>; 3] = grads
            .try_into()
            .map_err(|_| device("internal: three gradients expected"))?;
        Ok((call.finish([dq, dk, dv])?, dparams))
    }

    /// Times the backward kernels of a call on the device: inputs uploaded and kernels loaded
    /// once, one pass warms up, then each of `reps` passes (delta, dq, dk and dv) is timed to
    /// its completion. Returns the per-pass ms, and whether the kernels ran on tensor cores;
    /// `None` for a call with nothing to compute.
    pub fn time_backward(
        &self,
        variant: &Variant,
        x: &HeadsBackward,
        reps: usize,
    ) -> Result<Option<(Vec<f64>, bool)>, RuntimeError> {
        let call = match BackwardCall::prepare(variant, x, &[])? {
            Prepared::Launch(call) => call,
            Prepared::Empty(_) => return Ok(None),
        };
        let mut buffers = self.upload_backward(&call)?;
        self.launch_backward(&call, &mut buffers)?;
        self.stream.synchronize().map_err(device)?;
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            let start = std::time::Instant::now();
            self.launch_backward(&call, &mut buffers)?;
            self.stream.synchronize().map_err(device)?;
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        Ok(Some((times, call.kernels.tensor_cores)))
    }

    fn upload_backward(&self, call: &BackwardCall) -> Result<BackwardBuffers, RuntimeError> {
        let s = &self.stream;
        let upload = |v: &[u8]| {
            s.clone_htod(if v.is_empty() { &[0u8; 4][..] } else { v })
                .map_err(device)
        };
        let mut inputs = Vec::with_capacity(10);
        for bytes in call.inputs.iter().chain(&call.codes) {
            inputs.push(upload(bytes)?);
        }
        for table in [&call.rope_cos, &call.rope_sin] {
            let bytes: Vec<u8> = table.iter().flat_map(|x| x.to_le_bytes()).collect();
            inputs.push(upload(&bytes)?);
        }
        let lens = call.output_lens();
        let mut outputs = Vec::with_capacity(4);
        for n in [call.rows(), lens[0], lens[1], lens[2]] {
            outputs.push(s.alloc_zeros::<f32>(n.max(1)).map_err(device)?);
        }
        let params = [
            s.clone_htod(if call.params.is_empty() {
                &[0.0f32][..]
            } else {
                &call.params
            })
            .map_err(device)?,
            s.alloc_zeros::<f32>(call.partials_len().max(1))
                .map_err(device)?,
            s.alloc_zeros::<f32>(call.params.len().max(1))
                .map_err(device)?,
        ];
        Ok(BackwardBuffers {
            inputs,
            outputs,
            params,
        })
    }

    fn launch_backward(
        &self,
        call: &BackwardCall,
        x: &mut BackwardBuffers,
    ) -> Result<(), RuntimeError> {
        let s = &self.stream;
        let read: Vec<_> = x.inputs.iter().map(|b| b.device_ptr(s)).collect();
        let written: Vec<_> = x.outputs.iter_mut().map(|b| b.device_ptr_mut(s)).collect();
        let [params, partials, dparams] = &mut x.params;
        let params = params.device_ptr(s);
        let [partials, dparams] = [partials, dparams].map(|b| b.device_ptr_mut(s));
        let address = |i: usize| read[i].0 as i64;
        let at = super::backward::Buffers {
            inputs: [0, 1, 2, 3, 4, 5].map(address),
            outputs: [0, 1, 2, 3].map(|i| written[i].0 as i64),
            codes: if call.kernels.tensor_cores {
                [address(6), address(7)]
            } else {
                [0, 0]
            },
            rope: [address(8), address(9)],
            params: [params.0, partials.0, dparams.0].map(|a| a as i64),
        };
        for (kernel, &grid) in call.kernels.kernels.iter().zip(&call.grids) {
            let f = self.load(kernel)?;
            let config = LaunchConfig {
                grid_dim: (grid[0], grid[1], grid[2]),
                block_dim: (kernel.threads, 1, 1),
                shared_mem_bytes: dynamic_shared_bytes(kernel),
            };
            let values = call.args(kernel, &at)?;
            let mut launch = s.launch_builder(&f);
            for value in &values {
                launch.arg(value);
            }
            // SAFETY: `args` bound the kernel's parameters to its launch record's fields, in
            // order, all 64-bit: device addresses of the buffers above, each of the size the
            // kernel indexes (the call's tensors in the kernels' formats, the tile codes, one
            // delta per query row, the f32 gradients, the RoPE tables, the parameters, their
            // `param_copies` partial sums and their gradients), held by the guards in `read`,
            // `written`, `params`, `partials` and `dparams` until the launches are queued, and
            // i64 scalars; the grid and CTA size are the ones the kernel was lowered for.
            unsafe { launch.launch(config) }.map_err(device)?;
        }
        Ok(())
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

/// A KV cache's memory on the device (from [`CudaBackend::upload_cache`]).
#[derive(Debug)]
pub struct DeviceCache {
    /// The host ranges copied: `(address, bytes)`.
    regions: Vec<(usize, usize)>,
    buffers: Vec<CudaSlice<u8>>,
    /// The cache's generation when copied.
    generation: u64,
}

/// The device buffers of a backward call: q, k, v, out, lse, dout, the two tile-code arrays
/// and the RoPE tables (as bytes), then delta, dq, dk and dv (f32).
struct BackwardBuffers {
    inputs: Vec<CudaSlice<u8>>,
    outputs: Vec<CudaSlice<f32>>,
    /// The parameters, their gradients' partial sums, their gradients.
    params: [CudaSlice<f32>; 3],
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
