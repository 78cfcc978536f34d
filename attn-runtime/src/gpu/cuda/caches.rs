//! KV caches resident on the device: uploaded, kept in sync with the host's, and decoded in
//! place, split-KV partitions merged by their log-sum-exp.

use super::{CudaBackend, device};
use crate::cache::{KvCache, MirrorSync, SeqId};
use crate::calls::{DecodeOptions, MlaQueries, Output};
use crate::error::RuntimeError;
use crate::gpu::decode::{self, DecodeLaunch};
use crate::gpu::pages::PagedSegments;
use crate::tensor::Tensor;
use crate::variant::Variant;
use codegen::gpu::ir::target::dynamic_shared_bytes;
use codegen::gpu::kernels::decode::SEGMENT_FIELDS;
use codegen::gpu::launch::{DecodeArgs, bind};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

impl CudaBackend {
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

    /// Runs a prepared decode launch, its cache's memory uploaded now or found in `resident`;
    /// returns `out` and `lse` (all rows).
    pub(super) fn run_decode(
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
}

/// Merged decode rows and their lse on the device, and the merge map's buffer.
type Merged = (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<u8>);

/// A KV cache's memory on the device (from [`CudaBackend::upload_cache`]).
#[derive(Debug)]
pub struct DeviceCache {
    /// The host ranges copied: `(address, bytes)`.
    regions: Vec<(usize, usize)>,
    buffers: Vec<CudaSlice<u8>>,
    /// The cache's generation when copied.
    generation: u64,
}
