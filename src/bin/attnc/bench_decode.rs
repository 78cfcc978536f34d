//! `attnc bench-decode`: times decoding steps against a paged KV cache filled with random keys.

use crate::backend_arg::{Backend, Timed};
use attn::AttentionSpec;
use attn::inputs::tensor as random;
use attn::runtime::Backend as Attend;
use attn::runtime::RuntimeError;
use attn::runtime::Tensor;
use attn::runtime::Variant;
use attn::runtime::cache::SeqId;
use attn::runtime::cache::{KvCache, PagedCache};
use attn::runtime::cpu::CpuBackend;
#[cfg(feature = "cuda")]
use attn::runtime::device::Device as _;
use attn::runtime::{DecodeOptions, MlaQueries, Queries};
use std::time::Instant;

/// `attnc bench-decode`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// The spec, in the spec language, or @FILE to read it from a file.
    #[arg(allow_hyphen_values = true)]
    spec: String,
    /// Cached tokens per sequence.
    #[arg(long, value_name = "L", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    kv_len: u64,
    /// Sequences.
    #[arg(long, value_name = "B", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
    batch: u64,
    /// New queries per sequence and step.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    q_len: u64,
    /// Tokens per cache block.
    #[arg(long, value_name = "T", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    block_size: u64,
    /// Timed steps (after two warm-up steps).
    #[arg(long, value_name = "R", default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    reps: u64,
    /// Print one JSON line {"median_us", "gbps"}, plus "kernel_us" and "kernel_gbps" (the
    /// step's kernels alone) on cuda.
    #[arg(long)]
    json: bool,
    /// Where to run: cpu, or cuda (device 0, against a copy of the cache uploaded once; needs
    /// the `cuda` feature and an NVIDIA GPU).
    #[arg(long, value_enum, default_value_t = Timed::Cpu)]
    backend: Timed,
}

/// `attnc bench-decode`.
pub fn command(args: Args) -> Result<(), String> {
    let (spec, _) = crate::spec_arg::load(&args.spec)?;
    let shape = Shape {
        batch: args.batch as usize,
        kv_len: args.kv_len as usize,
        q_len: args.q_len as usize,
        block_size: args.block_size as usize,
        reps: args.reps as usize,
    };
    if !args.json {
        eprintln!(
            "timing decode steps of {spec}\n  batch {}, cache {} tokens in blocks of {}, {} \
             queries per step, {} steps",
            shape.batch, shape.kv_len, shape.block_size, shape.q_len, shape.reps
        );
    }
    let t =
        bench(&spec, &shape, args.backend.into(), !args.json).map_err(|e| format!("error: {e}"))?;
    if args.json {
        let kernel = t.kernel.map_or(String::new(), |(us, gbps)| {
            format!(", \"kernel_us\": {us:.2}, \"kernel_gbps\": {gbps:.2}")
        });
        println!(
            "{{\"median_us\": {:.2}, \"gbps\": {:.2}{kernel}}}",
            t.median_us, t.gbps
        );
    } else {
        println!(
            "median {:.1} us per step, {:.2} GB/s of K+V read, kernel compiled in {:.2} ms",
            t.median_us, t.gbps, t.compile_ms
        );
        if let Some((us, gbps)) = t.kernel {
            println!(
                "  of which the kernels (decode and merge, CUDA events): {us:.1} us, {gbps:.2} \
                 GB/s; host and copies: {:.1} us",
                t.median_us - us
            );
        }
    }
    Ok(())
}

/// What to time.
struct Shape {
    pub batch: usize,
    pub kv_len: usize,
    pub q_len: usize,
    pub block_size: usize,
    pub reps: usize,
}

/// Timings of one step.
struct Timing {
    /// The whole step, as the host sees it (preparation, copies, launches, results back).
    pub median_us: f64,
    /// Bytes of K and V the step reads (every cached token of every sequence), per second.
    pub gbps: f64,
    pub compile_ms: f64,
    /// On CUDA: the device time of the step's kernels (decode and merge; CUDA events), median,
    /// and the bytes of K and V per second of it.
    pub kernel: Option<(f64, f64)>,
}

/// Fills a paged cache with `kv_len` tokens per sequence, then times `reps` steps of `q_len`
/// queries per sequence (median), on the CPU or on CUDA device 0 (against a copy of the cache
/// uploaded once; a step includes its host-side preparation and the copies of queries and
/// results, and its kernels are also timed alone by CUDA events).
fn bench(
    spec: &AttentionSpec,
    shape: &Shape,
    on: Backend,
    progress: bool,
) -> Result<Timing, RuntimeError> {
    let backend = CpuBackend::new();
    let variant = Variant::new(spec.clone())?;
    let kernel = backend.kernel(&variant, attn::codegen::plan::PlanKind::Decode)?;
    let compile_ms = kernel.compile_time.as_secs_f64() * 1e3;
    let (b, h) = (shape.batch, spec.heads as usize);
    let hkv = spec.kv_heads() as usize;
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let blocks = b * shape.kv_len.div_ceil(shape.block_size);
    let mut cache = PagedCache::new(spec, shape.block_size, blocks)?;
    let mut seqs = Vec::with_capacity(b);
    // Fill in chunks so the random tensors stay small.
    let chunk = 1024;
    for s in 0..b {
        let seq = cache.add_sequence();
        let mut filled = 0;
        while filled < shape.kv_len {
            let n = chunk.min(shape.kv_len - filled);
            let seed = (s * 1000 + filled) as u64;
            // MLA caches take the latent and the RoPE key; others per-head keys and values.
            let (k, v) = match spec.mla() {
                Some(m) => (
                    random(spec.dtype, &[n, m.latent_rank as usize], seed)?,
                    random(spec.dtype, &[n, m.rope_dim as usize], seed + 7)?,
                ),
                None => (
                    random(spec.dtype, &[hkv, n, d], seed)?,
                    random(spec.dtype, &[hkv, n, dv], seed + 7)?,
                ),
            };
            cache.append(seq, &k, &v)?;
            filled += n;
        }
        if progress {
            eprint!("\r  filled {}/{b} sequences", s + 1);
        }
        seqs.push(seq);
    }
    if progress {
        eprintln!();
    }
    let q = random(spec.dtype, &[b, h, shape.q_len, d], 1)?;
    let options = DecodeOptions::default();
    let mla_inputs = match spec.mla() {
        Some(m) => Some((
            random(spec.dtype, &[b, h, shape.q_len, m.rope_dim as usize], 2)?,
            random(spec.dtype, &[h * (d + dv), m.latent_rank as usize], 3)?,
        )),
        None => None,
    };
    let device = device_step(on, spec, &q, mla_inputs.as_ref(), &cache, &seqs)?;
    // A step, and the device time of its kernels where a device runs it.
    let step = || match (&device, &mla_inputs) {
        (Some(device), _) => device(),
        (None, Some((q_pe, w_kv_b))) => {
            let queries = MlaQueries {
                q_nope: &q,
                q_pe,
                w_kv_b,
            };
            let queries = Queries::Mla(queries);
            Attend::attend_cached(&backend, &variant, queries, &cache, &seqs, options).map(|_| None)
        }
        (None, None) => {
            let queries = Queries::Uniform(&q);
            Attend::attend_cached(&backend, &variant, queries, &cache, &seqs, options).map(|_| None)
        }
    };
    step()?;
    step()?;
    let mut times = Vec::with_capacity(shape.reps);
    let mut kernel_times = Vec::new();
    for i in 0..shape.reps {
        let start = Instant::now();
        let kernel_us = step()?;
        times.push(start.elapsed().as_secs_f64() * 1e6);
        kernel_times.extend(kernel_us);
        if progress {
            eprint!(
                "\r  {}/{} steps, last {:.1} us",
                i + 1,
                shape.reps,
                times[i]
            );
        }
    }
    if progress {
        eprintln!();
    }
    let median = |mut times: Vec<f64>| {
        times.sort_by(f64::total_cmp);
        times.get(times.len() / 2).copied()
    };
    let median_us = median(times).unwrap_or(0.0);
    let bytes = b as f64 * cache.seq_len(seqs[0])? as f64 * cache.layout().bytes_per_token() as f64;
    let gbps = |us: f64| bytes / (us * 1e-6) / 1e9;
    Ok(Timing {
        median_us,
        gbps: gbps(median_us),
        compile_ms,
        kernel: median(kernel_times).map(|us| (us, gbps(us))),
    })
}

/// A device step, for `Backend::Cuda`: decoding on CUDA device 0 against a copy of the cache
/// uploaded now; returns the device time of its kernels, in microseconds.
type DeviceStep<'a> = Option<Box<dyn Fn() -> Result<Option<f64>, RuntimeError> + 'a>>;

/// The device step of `on` (`None` on the CPU); MLA specs take their `q_pe` and `W_kv_b`.
#[cfg(feature = "cuda")]
fn device_step<'a>(
    on: Backend,
    spec: &'a AttentionSpec,
    q: &'a Tensor,
    mla: Option<&'a (Tensor, Tensor)>,
    cache: &'a PagedCache,
    seqs: &'a [SeqId],
) -> Result<DeviceStep<'a>, RuntimeError> {
    if on != Backend::Cuda {
        return Ok(None);
    }
    let gpu = attn::runtime::gpu::cuda::CudaBackend::new(0)?;
    let resident = gpu.upload_cache(cache)?;
    let variant = attn::runtime::Variant::new(spec.clone())?;
    gpu.device().time_kernels(true)?;
    let options = DecodeOptions::default();
    Ok(Some(Box::new(move || {
        match mla {
            Some((q_pe, w_kv_b)) => {
                let queries = MlaQueries {
                    q_nope: q,
                    q_pe,
                    w_kv_b,
                };
                gpu.decode_mla_resident(&variant, queries, cache, &resident, seqs, options)?
            }
            None => gpu.decode_resident(&variant, q, cache, &resident, seqs, options)?,
        };
        Ok(gpu.device().last_kernel_us())
    })))
}

/// Without the `cuda` feature: `None` on the CPU, an error that says how to get it on cuda.
#[cfg(not(feature = "cuda"))]
fn device_step<'a>(
    on: Backend,
    _: &'a AttentionSpec,
    _: &'a Tensor,
    _: Option<&'a (Tensor, Tensor)>,
    _: &'a PagedCache,
    _: &'a [SeqId],
) -> Result<DeviceStep<'a>, RuntimeError> {
    if on == Backend::Cuda {
        return Err(attn::runtime::backends::no_cuda_feature());
    }
    Ok(None)
}
