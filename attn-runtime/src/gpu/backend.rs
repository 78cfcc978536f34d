//! The GPU backend, once for every device: each call prepared on the host (the forward in
//! [`super::GpuCall`], cached attention in `decode.rs`, the backward in `backward.rs`), then
//! uploaded, launched and read back through [`Device`]. `gpu-sim` is this backend on the GPU
//! IR interpreter ([`SimDevice`](crate::device::SimDevice), which refuses calls it would spend
//! minutes on), `cuda` on a CUDA device.
//!
//! Beside the [`Backend`] calls: KV caches resident on the device ([`DeviceCache`], decoded in
//! place), and timing of prepared calls.

use super::GpuCall;
use super::backward::{self, BackwardCall, Prepared};
use super::decode::{self, DecodeLaunch};
use super::sim_cost;
use crate::backend::Backend;
use crate::cache::{KvCache, MirrorSync, SeqId};
use crate::calls::{BackwardInputs, DecodeOptions, Gradients, HeadsBackward, Inputs, MlaQueries};
use crate::calls::{Output, Queries};
use crate::device::{Device, DeviceBuffer, Scratch};
use crate::error::RuntimeError;
use crate::tensor::Tensor;
use crate::variant::Variant;
use std::sync::Arc;

/// The GPU kernels on a device.
#[derive(Debug, Default)]
pub struct GpuBackend<D> {
    device: Arc<D>,
}

impl<D: Device + 'static> GpuBackend<D> {
    /// The backend on `device`.
    pub fn on(device: D) -> Self {
        GpuBackend {
            device: Arc::new(device),
        }
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The device, shared (a model resident on it, [`crate::model::ResidentModel`], takes it).
    pub fn shared_device(&self) -> Arc<D> {
        Arc::clone(&self.device)
    }

    /// A copy of the cache's memory on the device, for [`GpuBackend::decode_resident`]. After
    /// the cache changes, bring it up to date with [`GpuBackend::sync_cache`] (decoding against
    /// an out-of-date copy is an error).
    pub fn upload_cache(&self, cache: &impl KvCache) -> Result<DeviceCache, RuntimeError> {
        let mut resident = DeviceCache {
            device: Arc::clone(&self.device) as Arc<dyn Device>,
            regions: Vec::new(),
            buffers: Vec::new(),
            generation: cache.generation(),
        };
        for host in cache.memory() {
            resident.buffers.push(self.device.upload(host)?);
        }
        resident.regions = cache
            .regions()
            .into_iter()
            .map(|(start, bytes)| (start as usize, bytes))
            .collect();
        Ok(resident)
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
            // The old copy's buffers are freed as it drops.
            MirrorSync::Full => *resident = self.upload_cache(cache)?,
            MirrorSync::Writes(writes) => {
                for w in writes {
                    let bytes = &memory[w.region][w.start..w.start + w.len];
                    self.device
                        .write(resident.buffers[w.region], w.start, bytes)?;
                }
                resident.generation = cache.generation();
            }
        }
        Ok(plan.bytes(total))
    }

    /// [`Queries::Uniform`] against a device copy of `cache` from
    /// [`GpuBackend::upload_cache`]: nothing of the cache is uploaded.
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
            self.run_resident(l, resident)
        })
    }

    /// [`Queries::Mla`] against a device copy of the latent cache from
    /// [`GpuBackend::upload_cache`].
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
            self.run_resident(l, resident)
        })
    }

    /// A decode launch against a resident copy, which must be of the launch's cache as it is.
    fn run_resident(
        &self,
        l: &DecodeLaunch,
        resident: &DeviceCache,
    ) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
        if resident.generation != l.generation || resident.regions != l.regions() {
            return Err(RuntimeError::Cache(
                "the device copy of the cache is out of date (the cache changed after \
                 upload_cache): upload it again"
                    .into(),
            ));
        }
        l.run_on(self.device.as_ref(), Some(&resident.buffers), &[])
    }

    /// Times a prepared call on the device: the kernel is made ready (on CUDA its PTX found or
    /// compiled, and loaded: `load_ms`) and the inputs uploaded once, one launch warms up, then
    /// each of `reps` launches is timed to its completion. Returns `(load_ms, per-launch ms)`.
    pub fn time(&self, call: &GpuCall, reps: usize) -> Result<(f64, Vec<f64>), RuntimeError> {
        let start = std::time::Instant::now();
        self.device.prepare(&call.kernel)?;
        let load_ms = start.elapsed().as_secs_f64() * 1e3;
        let device = self.device.as_ref();
        let mut scratch = Scratch::new(device);
        let buffers = call.upload(&mut scratch)?;
        let times = self.time_launches(reps, &mut || call.launch(device, &buffers))?;
        Ok((load_ms, times))
    }

    /// Times the backward kernels of a call on the device: inputs uploaded and kernels made
    /// ready once, one pass warms up, then each of `reps` passes (delta, dq, dk and dv) is timed
    /// to its completion. Returns the per-pass ms, and whether the kernels ran on tensor cores;
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
        let device = self.device.as_ref();
        let mut scratch = Scratch::new(device);
        let buffers = call.upload(&mut scratch)?;
        let times = self.time_launches(reps, &mut || call.launch(device, &buffers))?;
        Ok(Some((times, call.kernels.tensor_cores)))
    }

    /// One warm-up run of `launches`, then `reps` runs, each timed on the host to the device's
    /// completion of its kernels, in milliseconds.
    fn time_launches(
        &self,
        reps: usize,
        launches: &mut dyn FnMut() -> Result<(), RuntimeError>,
    ) -> Result<Vec<f64>, RuntimeError> {
        launches()?;
        self.device.synchronize()?;
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            let start = std::time::Instant::now();
            launches()?;
            self.device.synchronize()?;
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        Ok(times)
    }
}

impl<D: Device + 'static> Backend for GpuBackend<D> {
    fn name(&self) -> &'static str {
        self.device.name()
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
        let spec = variant.spec();
        match inputs {
            Inputs::Heads { q, k, v } => {
                let [b, _, sq, skv] = bhss(q, k);
                self.device.check_cost("this forward", &|| {
                    sim_cost::attention_seconds(spec, b, sq, skv, false)
                })?;
                GpuCall::forward_in(variant, q, k, v, position_offset, params)?
                    .run_on(self.device.as_ref())
            }
            Inputs::Mla(x) => {
                let (b, sq, skv) = (dim(x.q_nope, 0), dim(x.q_nope, 2), dim(x.c_kv, 1));
                self.device.check_cost("this forward", &|| {
                    sim_cost::attention_seconds(spec, b, sq, skv, false)
                })?;
                let (call, absorbed) = GpuCall::forward_mla(variant, &x, position_offset)?;
                let latent = call.run_on(self.device.as_ref())?;
                absorbed.finish(spec, latent.out.to_f32_vec(), latent.lse.to_f32_vec())
            }
        }
    }

    /// The GPU decode kernel over the cache's segments, with the CPU backend's work items,
    /// partitions and lse merge. The cache lives in host memory, so each call uploads its
    /// memory; [`GpuBackend::decode_resident`] decodes against a copy uploaded once.
    fn attend_cached_bound(
        &self,
        variant: &Variant,
        queries: Queries,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
        params: &[f32],
    ) -> Result<Output, RuntimeError> {
        let run = &|l: &DecodeLaunch| l.run_on(self.device.as_ref(), None, params);
        let q_len = |q: &Tensor| dim(q, 2);
        match queries {
            Queries::Uniform(q) => {
                self.check_cached(variant, cache, seqs.iter().map(|&s| (s, q_len(q))))?;
                decode::decode_with(variant, q, cache, seqs, options, run)
            }
            Queries::Ragged { q, offsets } => {
                let counts = offsets.windows(2).map(|w| w[1].saturating_sub(w[0]) as u64);
                self.check_cached(variant, cache, seqs.iter().copied().zip(counts))?;
                decode::attend_ragged_with(variant, q, offsets, cache, seqs, options, run)
            }
            Queries::Mla(queries) => {
                let n = q_len(queries.q_nope);
                self.check_cached(variant, cache, seqs.iter().map(|&s| (s, n)))?;
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
            BackwardInputs::Heads(x) => {
                let [b, _, sq, skv] = bhss(x.q, x.k);
                self.device.check_cost("this forward and backward", &|| {
                    sim_cost::attention_seconds(variant.spec(), b, sq, skv, true)
                })?;
                backward::run_on(self.device.as_ref(), variant, x, params)
                    .map(|(g, dparams)| (Gradients::Heads(g), dparams))
            }
            BackwardInputs::Mla(_) => Err(RuntimeError::Unsupported {
                backend: self.device.name(),
                what: "the MLA backward (the cpu backend does)".into(),
            }),
        }
    }
}

impl<D: Device + 'static> GpuBackend<D> {
    /// Refuses cached work (`(sequence, queries)` pairs against the cache) the device would
    /// take too long over.
    fn check_cached(
        &self,
        variant: &Variant,
        cache: &dyn KvCache,
        work: impl Iterator<Item = (SeqId, u64)>,
    ) -> Result<(), RuntimeError> {
        let work: Vec<(SeqId, u64)> = work.collect();
        self.device.check_cost("this decode step", &|| {
            work.iter()
                .map(|&(seq, queries)| {
                    let keys = cache.seq_len(seq).unwrap_or(0) as u64 + queries;
                    sim_cost::attention_seconds(variant.spec(), 1, queries, keys, false)
                })
                .sum()
        })
    }
}

/// A KV cache's memory on a device (from [`GpuBackend::upload_cache`]), freed as it drops.
pub struct DeviceCache {
    device: Arc<dyn Device>,
    /// The host ranges copied: `(address, bytes)`.
    regions: Vec<(usize, usize)>,
    /// One buffer per region.
    buffers: Vec<DeviceBuffer>,
    /// The cache's generation when copied.
    generation: u64,
}

impl std::fmt::Debug for DeviceCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceCache")
            .field("device", &self.device.name())
            .field("regions", &self.regions)
            .field("generation", &self.generation)
            .finish()
    }
}

impl Drop for DeviceCache {
    fn drop(&mut self) {
        for b in self.buffers.drain(..) {
            self.device.free(b);
        }
    }
}

/// Dim `i` of `t`, 0 where it has fewer (the call's own checks refuse it after).
fn dim(t: &Tensor, i: usize) -> u64 {
    t.shape().get(i).map_or(0, |&d| d as u64)
}

/// `[batch, heads, queries, keys]` of q `[B, H, Sq, D]` and k `[B, Hkv, Skv, D]`.
fn bhss(q: &Tensor, k: &Tensor) -> [u64; 4] {
    [dim(q, 0), dim(q, 1), dim(q, 2), dim(k, 2)]
}
