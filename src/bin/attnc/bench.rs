//! `attnc bench`: times the forward kernel of a spec on random inputs, on the CPU or a CUDA
//! device, optionally under a document mask (`--documents`); differential heads on the CPU.

use crate::backend_arg::{Backend as On, Timed};
use crate::bench_documents::{DOC, document_ids, kept_pairs, masked_by_documents};
use attn::AttentionSpec;
use attn::dsl::Mask;
use attn::dsl::accounting::forward_flops;
use attn::inputs::tensor as random;
use attn::runtime::cpu::CpuBackend;
use attn::runtime::learned::{Data, DataBuf};
use attn::runtime::memory::checked_product;
use attn::runtime::{
    Backend, BackwardInputs, HeadsBackward, Inputs, MlaBackward, MlaTensors, Variant,
};
use attn::runtime::{Learned, RuntimeError, Tensor};
use std::time::Instant;

/// `attnc bench`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// The spec, in the spec language, or @FILE to read it from a file.
    #[arg(allow_hyphen_values = true)]
    spec: String,
    /// Queries per sequence.
    #[arg(long, value_name = "N", default_value_t = 2048, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    seq: u64,
    /// Keys per sequence (default: as many as queries).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    kv_len: Option<u64>,
    /// Sequences.
    #[arg(long, value_name = "B", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
    batch: u64,
    /// Timed runs (after two warm-up runs).
    #[arg(long, value_name = "R", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    reps: u64,
    /// Print one JSON line {"median_ms", "gflops", "compile_ms"}.
    #[arg(long)]
    json: bool,
    /// Where to run: cpu, or cuda (device 0; needs the `cuda` feature and an NVIDIA GPU).
    #[arg(long, value_enum, default_value_t = Timed::Cpu)]
    backend: Timed,
    /// Time a forward that saves out and lse plus the backward (`median_ms` of the pair;
    /// GFLOP/s counted as 3.5 forwards), on either backend.
    #[arg(long)]
    backward: bool,
    /// Restrict the spec's mask to N equal documents over the keys (a data tensor `doc` of
    /// document ids and `doc[b, q] == doc[b, k]` ANDed with its mask; on the CPU). GFLOP/s
    /// count the kept pairs.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    documents: Option<u64>,
}

/// `attnc bench`.
pub fn command(args: Args) -> Result<(), String> {
    let (spec, _) = crate::spec_arg::load(&args.spec)?;
    let mut shape = Shape {
        batch: args.batch as usize,
        seq: args.seq as usize,
        kv_len: args.kv_len.unwrap_or(args.seq) as usize,
        reps: args.reps as usize,
        documents: args.documents.map(|n| n as usize),
        kept: None,
    };
    let spec = match shape.documents {
        Some(n) if n > shape.kv_len => {
            return Err(format!(
                "error: --documents {n} is more documents than the {} keys; allowed: 1 to {}",
                shape.kv_len, shape.kv_len
            ));
        }
        Some(_) if args.backend == Timed::Cuda => {
            return Err(
                "error: --documents times the CPU backend only for now; use --backend cpu"
                    .to_string(),
            );
        }
        Some(n) => {
            shape.kept = kept_pairs(&spec, shape.seq, shape.kv_len, n)
                .map(|pairs| pairs / (shape.seq as f64 * shape.kv_len as f64));
            masked_by_documents(&spec)?
        }
        None if !spec.data.is_empty() => {
            return Err(
                "error: attnc bench cannot make up this spec's data tensors; time a document \
                 mask with --documents N instead"
                    .to_string(),
            );
        }
        None => spec,
    };
    if !args.json {
        eprintln!(
            "timing {spec}\n  batch {}, Sq {}, Skv {}, {} runs",
            shape.batch, shape.seq, shape.kv_len, shape.reps
        );
    }
    let on = On::from(args.backend);
    if on == On::Cuda && !spec.learnable_tensors().is_empty() {
        return Err(
            "error: attnc bench does not time specs with learnable tensors (params(...), sinks) \
             on the GPU yet; use --backend cpu"
                .to_string(),
        );
    }
    let differential = spec.differential.is_some();
    if on == On::Cuda && differential {
        return Err(
            "error: attnc bench times differential heads on the CPU only for now; use \
             --backend cpu"
                .to_string(),
        );
    }
    let t = match on {
        _ if differential => bench_differential(&spec, &shape, args.backward, !args.json),
        On::Cuda if args.backward => bench_backward_cuda(&spec, &shape),
        _ if args.backward => bench_backward(&spec, &shape, !args.json),
        On::Cuda => bench_cuda(&spec, &shape),
        _ => bench(&spec, &shape, !args.json),
    }
    .map_err(|e| format!("error: {e}"))?;
    if args.json {
        println!(
            "{{\"median_ms\": {:.4}, \"gflops\": {:.2}, \"compile_ms\": {:.3}}}",
            t.median_ms, t.gflops, t.compile_ms
        );
    } else {
        println!(
            "median {:.3} ms, {:.1} GFLOP/s, kernel compiled in {:.2} ms",
            t.median_ms, t.gflops, t.compile_ms
        );
    }
    Ok(())
}

/// What to time.
#[derive(Clone, Copy)]
struct Shape {
    pub batch: usize,
    pub seq: usize,
    pub kv_len: usize,
    pub reps: usize,
    /// `--documents`.
    pub documents: Option<usize>,
    /// The fraction of (query, key) pairs the documents keep, where it is known.
    pub kept: Option<f64>,
}

/// Timings.
struct Timing {
    pub median_ms: f64,
    pub gflops: f64,
    pub compile_ms: f64,
}

/// Refuses a shape whose tensors would not fit in the memory available, before any is made:
/// each input counted once as the f32 values drawn and once as stored, each output as f32.
fn ensure_fits(spec: &AttentionSpec, shape: &Shape) -> Result<(), RuntimeError> {
    let [b, sq, skv] = [shape.batch, shape.seq, shape.kv_len].map(|v| v as u64);
    let (h, d, dv) = (
        u64::from(spec.heads),
        u64::from(spec.head_dim),
        u64::from(spec.v_head_dim),
    );
    let inputs: Vec<Vec<u64>> = match spec.mla() {
        Some(m) => {
            let (r, dr) = (u64::from(m.latent_rank), u64::from(m.rope_dim));
            vec![
                vec![b, h, sq, d + dr],
                vec![b, skv, r + dr],
                vec![h, d + dv, r],
            ]
        }
        None => {
            let hkv = u64::from(spec.kv_heads());
            vec![
                vec![b, h, sq, d],
                vec![b, hkv, skv, d],
                vec![b, hkv, skv, dv],
            ]
        }
    };
    let outputs = [vec![b, h, sq, dv], vec![b, h, sq]];
    let per_input = 4 + spec.dtype.size_bytes();
    let bytes = inputs
        .iter()
        .map(|dims| checked_product(dims)?.checked_mul(per_input))
        .chain(
            outputs
                .iter()
                .map(|dims| checked_product(dims)?.checked_mul(4)),
        )
        .try_fold(0u64, |sum, n| sum.checked_add(n?));
    attn::runtime::memory::ensure_fits(
        &format!("batch {b} with {sq} queries and {skv} keys of `{spec}`"),
        bytes,
    )
}

/// Random q, k and v of a per-head spec for the shape.
fn inputs(spec: &AttentionSpec, shape: &Shape) -> Result<[Tensor; 3], RuntimeError> {
    let (b, h, sq, skv) = (shape.batch, spec.heads as usize, shape.seq, shape.kv_len);
    let (d, dv, hkv) = (
        spec.head_dim as usize,
        spec.v_head_dim as usize,
        spec.kv_heads() as usize,
    );
    Ok([
        random(spec.dtype, &[b, h, sq, d], 1)?,
        random(spec.dtype, &[b, hkv, skv, d], 2)?,
        random(spec.dtype, &[b, hkv, skv, dv], 3)?,
    ])
}

/// The spec's learnable tensors (parameters and sinks), small random values (seed 5 on).
fn learned(spec: &AttentionSpec) -> Result<Vec<(String, Tensor)>, RuntimeError> {
    spec.learnable_tensors()
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let t = random(attn::DType::F32, &shape, 5 + i as u64)?;
            Ok((name, t))
        })
        .collect()
}

fn by_name(learned: &[(String, Tensor)]) -> Vec<(&str, &Tensor)> {
    learned.iter().map(|(n, t)| (n.as_str(), t)).collect()
}

/// FLOPs counted as `4 B Hq Sq Skv D` (MLA: the absorbed widths), halved for causal masks, the
/// convention of FlashAttention and PyTorch's benchmarks; under `--documents`, times the
/// fraction of pairs kept where it is known.
fn flops(spec: &AttentionSpec, shape: &Shape) -> f64 {
    let dense = forward_flops(
        spec,
        shape.batch as u64,
        shape.seq as u64,
        shape.kv_len as u64,
    )
    .map_or(f64::INFINITY, |f| f.dense as f64);
    let causal = !matches!(spec.mask, Mask::None);
    dense * shape.kept.unwrap_or(if causal { 0.5 } else { 1.0 })
}

/// The call's data tensors: the document ids of `--documents`, else none.
fn data(shape: &Shape) -> Vec<(&'static str, DataBuf)> {
    shape
        .documents
        .map(|n| (DOC, document_ids(shape.batch, shape.kv_len, n)))
        .into_iter()
        .collect()
}

/// Refuses a backward timing whose tensors would not fit: inputs, dout, out and the gradients
/// are about three times the forward's tensors.
fn backward_fits(spec: &AttentionSpec, shape: &Shape) -> Result<(), RuntimeError> {
    let triple = Shape {
        batch: shape.batch.saturating_mul(3),
        ..*shape
    };
    ensure_fits(spec, &triple)
}

/// Times a forward that saves what the backward needs (out and lse) plus the backward, on the
/// CPU: median ms of the pair, GFLOP/s counted as 3.5 forwards (the backward's five tile
/// products are 2.5 forwards, FlashAttention's convention), and the compile time of both kernels.
fn bench_backward(
    spec: &AttentionSpec,
    shape: &Shape,
    progress: bool,
) -> Result<Timing, RuntimeError> {
    backward_fits(spec, shape)?;
    let backend = CpuBackend::new();
    // The process's variant of the spec: the one the timed calls below use.
    let started = Instant::now();
    let variant = Variant::shared(spec)?;
    backend.kernel(&variant, attn::codegen::plan::PlanKind::Forward)?;
    backend.kernel(&variant, attn::codegen::plan::PlanKind::Backward)?;
    let compile_ms = started.elapsed().as_secs_f64() * 1e3;
    let (b, h, sq, dv) = (
        shape.batch,
        spec.heads as usize,
        shape.seq,
        spec.v_head_dim as usize,
    );
    let dout = random(spec.dtype, &[b, h, sq, dv], 4)?;
    if spec.mla().is_some() {
        return bench_backward_mla(spec, shape, &dout, compile_ms, progress);
    }
    let [q, k, v] = inputs(spec, shape)?;
    let variant = Variant::shared(spec)?;
    let tensors = learned(spec)?;
    let named = by_name(&tensors);
    let data = data(shape);
    let data: Vec<(&str, Data)> = data.iter().map(|(n, d)| (*n, d.as_data())).collect();
    let learned = Learned::new(&named).with_data(&data);
    let call = || -> Result<(), RuntimeError> {
        let forward = backend.forward_learned(&variant, Inputs::heads(&q, &k, &v), 0, learned)?;
        let x = BackwardInputs::Heads(HeadsBackward {
            q: &q,
            k: &k,
            v: &v,
            out: &forward.out,
            lse: &forward.lse,
            dout: &dout,
            position_offset: 0,
        });
        backend.backward_learned(&variant, &x, learned).map(drop)
    };
    let times = time_calls(call, shape.reps, progress)?;
    Ok(backward_timing(spec, shape, times, compile_ms))
}

/// [`bench_backward`] for an MLA spec: the forward that keeps the latent output, then the
/// backward, on random MLA inputs.
fn bench_backward_mla(
    spec: &AttentionSpec,
    shape: &Shape,
    dout: &Tensor,
    compile_ms: f64,
    progress: bool,
) -> Result<Timing, RuntimeError> {
    let backend = CpuBackend::new();
    let [q_nope, q_pe, c_kv, k_pe, w_kv_b] = mla_inputs(spec, shape)?;
    let x = MlaTensors {
        q_nope: &q_nope,
        q_pe: &q_pe,
        c_kv: &c_kv,
        k_pe: &k_pe,
        w_kv_b: &w_kv_b,
    };
    let variant = Variant::shared(spec)?;
    let call = || -> Result<(), RuntimeError> {
        let saved = backend.forward(&variant, Inputs::Mla(x), 0)?;
        let latent = saved.latent.as_ref().ok_or_else(|| {
            RuntimeError::Data("the MLA forward returned no latent output".into())
        })?;
        let inputs = BackwardInputs::Mla(MlaBackward {
            x,
            latent,
            lse: &saved.lse,
            dout,
            position_offset: 0,
        });
        backend.backward(&variant, &inputs).map(drop)
    };
    let times = time_calls(call, shape.reps, progress)?;
    Ok(backward_timing(spec, shape, times, compile_ms))
}

/// The median of a forward-plus-backward timing, GFLOP/s counted as 3.5 forwards.
fn backward_timing(
    spec: &AttentionSpec,
    shape: &Shape,
    mut t: Vec<f64>,
    compile_ms: f64,
) -> Timing {
    t.sort_by(f64::total_cmp);
    let median_ms = t[t.len() / 2];
    Timing {
        median_ms,
        gflops: 3.5 * flops(spec, shape) / (median_ms * 1e-3) / 1e9,
        compile_ms,
    }
}

/// Two warm-up calls, then `reps` timed ones (ms each), with progress on stderr.
fn time_calls(
    mut call: impl FnMut() -> Result<(), RuntimeError>,
    reps: usize,
    progress: bool,
) -> Result<Vec<f64>, RuntimeError> {
    call()?;
    call()?;
    let mut times = Vec::with_capacity(reps);
    for i in 0..reps {
        let start = Instant::now();
        call()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        if progress {
            eprint!("\r  {}/{} runs, last {:.2} ms", i + 1, reps, times[i]);
        }
    }
    if progress {
        eprintln!();
    }
    Ok(times)
}

/// Compiles (timed), warms up twice, then times `reps` calls and takes the median.
fn bench(spec: &AttentionSpec, shape: &Shape, progress: bool) -> Result<Timing, RuntimeError> {
    ensure_fits(spec, shape)?;
    let backend = CpuBackend::new();
    let kernel = backend.forward_kernel(spec)?;
    let compile_ms = kernel.compile_time.as_secs_f64() * 1e3;
    let variant = Variant::shared(spec)?;
    let call: Box<dyn FnMut() -> Result<(), RuntimeError>> = match spec.mla() {
        Some(_) => {
            let [q_nope, q_pe, c_kv, k_pe, w_kv_b] = mla_inputs(spec, shape)?;
            Box::new(move || {
                let x = MlaTensors {
                    q_nope: &q_nope,
                    q_pe: &q_pe,
                    c_kv: &c_kv,
                    k_pe: &k_pe,
                    w_kv_b: &w_kv_b,
                };
                backend.forward(&variant, Inputs::Mla(x), 0).map(drop)
            })
        }
        None => {
            let [q, k, v] = inputs(spec, shape)?;
            let tensors = learned(spec)?;
            let data = data(shape);
            Box::new(move || {
                let named = by_name(&tensors);
                let data: Vec<(&str, Data)> = data.iter().map(|(n, d)| (*n, d.as_data())).collect();
                let learned = Learned::new(&named).with_data(&data);
                backend
                    .forward_learned(&variant, Inputs::heads(&q, &k, &v), 0, learned)
                    .map(drop)
            })
        }
    };
    let times = time_calls(call, shape.reps, progress)?;
    Ok(timing(spec, shape, times, compile_ms))
}

/// The median of `times` (ms) and its GFLOP/s.
fn timing(spec: &AttentionSpec, shape: &Shape, mut times: Vec<f64>, compile_ms: f64) -> Timing {
    times.sort_by(f64::total_cmp);
    let median_ms = times[times.len() / 2];
    Timing {
        median_ms,
        gflops: flops(spec, shape) / (median_ms * 1e-3) / 1e9,
        compile_ms,
    }
}

/// Times differential heads on the CPU: their forward (the components' kernel and the pairing
/// on the host) or, with `backward`, the forward plus the backward; lambda's vectors random.
/// GFLOP/s count the component heads' work.
fn bench_differential(
    spec: &AttentionSpec,
    shape: &Shape,
    backward: bool,
    progress: bool,
) -> Result<Timing, RuntimeError> {
    use attn::runtime::differential::{Differential, DifferentialInputs};
    backward_fits(spec, shape)?;
    let backend = CpuBackend::new();
    let started = Instant::now();
    let heads = Differential::new(spec.clone())?;
    backend.kernel(heads.components(), attn::codegen::plan::PlanKind::Forward)?;
    if backward {
        backend.kernel(heads.components(), attn::codegen::plan::PlanKind::Backward)?;
    }
    let compile_ms = started.elapsed().as_secs_f64() * 1e3;
    let (b, sq, skv) = (shape.batch, shape.seq, shape.kv_len);
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
    let q = random(spec.dtype, &[b, h, sq, d], 1)?;
    let k = random(spec.dtype, &[b, hkv, skv, d], 2)?;
    let v = random(spec.dtype, &[b, hkv / 2, skv, dv], 3)?;
    let dout = random(spec.dtype, &[b, h / 2, sq, dv], 4)?;
    let lambda = (0..4)
        .map(|i| random(attn::DType::F32, &[d], 10 + i))
        .collect::<Result<Vec<_>, _>>()?;
    let tensors = learned(spec)?;
    let named = by_name(&tensors);
    let data = data(shape);
    let data: Vec<(&str, Data)> = data.iter().map(|(n, d)| (*n, d.as_data())).collect();
    let x = DifferentialInputs {
        q: &q,
        k: &k,
        v: &v,
        lambda: [&lambda[0], &lambda[1], &lambda[2], &lambda[3]],
        position_offset: 0,
        learned: Learned::new(&named).with_data(&data),
    };
    let call = || -> Result<(), RuntimeError> {
        let saved = heads.forward(&backend, &x)?;
        if backward {
            heads.backward(&backend, &x, &saved, &dout)?;
        }
        Ok(())
    };
    let times = time_calls(call, shape.reps, progress)?;
    Ok(match backward {
        true => backward_timing(spec, shape, times, compile_ms),
        false => timing(spec, shape, times, compile_ms),
    })
}

/// Random MLA inputs of a shape: q_nope, q_pe, c_kv, k_pe, w_kv_b.
fn mla_inputs(spec: &AttentionSpec, shape: &Shape) -> Result<[Tensor; 5], RuntimeError> {
    let mla = spec
        .mla()
        .ok_or_else(|| RuntimeError::Spec("not an MLA spec".into()))?;
    let (b, h, sq, skv) = (shape.batch, spec.heads as usize, shape.seq, shape.kv_len);
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
    Ok([
        random(spec.dtype, &[b, h, sq, d], 1)?,
        random(spec.dtype, &[b, h, sq, dr], 2)?,
        random(spec.dtype, &[b, skv, r], 3)?,
        random(spec.dtype, &[b, skv, dr], 4)?,
        random(spec.dtype, &[h * (d + dv), r], 5)?,
    ])
}

/// Times the GPU forward kernel on CUDA device 0: inputs uploaded once, one warm-up launch,
/// then `reps` launches each timed to completion (median). `compile_ms` is the time to emit the
/// kernel's PTX and load it.
#[cfg(feature = "cuda")]
fn bench_cuda(spec: &AttentionSpec, shape: &Shape) -> Result<Timing, RuntimeError> {
    use attn::runtime::gpu::GpuCall;
    use attn::runtime::gpu::cuda::CudaBackend;
    if spec.mla().is_some() {
        return Err(RuntimeError::Spec(
            "attnc bench does not time MLA specs on the GPU yet (attnc run runs them); use \
             --backend cpu"
                .into(),
        ));
    }
    ensure_fits(spec, shape)?;
    let backend = CudaBackend::new(0)?;
    let [q, k, v] = inputs(spec, shape)?;
    let call = GpuCall::forward(spec, &q, &k, &v, 0)?;
    let (compile_ms, times) = backend.time(&call, shape.reps)?;
    Ok(timing(spec, shape, times, compile_ms))
}

/// Times the GPU backward kernels on CUDA device 0 (delta, dq, dk and dv: on tensor cores for
/// bf16 and f16 specs they take): the forward runs once on the device for `out` and `lse`, then
/// one warm-up pass and `reps` timed ones (median). GFLOP/s count the backward's five tile
/// products (2.5 forwards), as FlashAttention reports them; `compile_ms` is 0 (kernels load on
/// the warm-up pass).
#[cfg(feature = "cuda")]
fn bench_backward_cuda(spec: &AttentionSpec, shape: &Shape) -> Result<Timing, RuntimeError> {
    use attn::runtime::gpu::GpuCall;
    use attn::runtime::gpu::cuda::CudaBackend;
    backward_fits(spec, shape)?;
    let backend = CudaBackend::new(0)?;
    let [q, k, v] = inputs(spec, shape)?;
    let dout = random(
        spec.dtype,
        &[
            shape.batch,
            spec.heads as usize,
            shape.seq,
            spec.v_head_dim as usize,
        ],
        4,
    )?;
    let saved = GpuCall::forward(spec, &q, &k, &v, 0)?.run_on(backend.device())?;
    let variant = Variant::shared(spec)?;
    let x = HeadsBackward {
        q: &q,
        k: &k,
        v: &v,
        out: &saved.out,
        lse: &saved.lse,
        dout: &dout,
        position_offset: 0,
    };
    let (mut times, _) = backend
        .time_backward(&variant, &x, shape.reps)?
        .ok_or_else(|| RuntimeError::Data("the call has no query or no key to time".into()))?;
    times.sort_by(f64::total_cmp);
    let median_ms = times[times.len() / 2];
    Ok(Timing {
        median_ms,
        gflops: 2.5 * flops(spec, shape) / (median_ms * 1e-3) / 1e9,
        compile_ms: 0.0,
    })
}

/// Without the `cuda` feature: an error that says how to get it.
#[cfg(not(feature = "cuda"))]
fn bench_cuda(_: &AttentionSpec, _: &Shape) -> Result<Timing, RuntimeError> {
    Err(attn::runtime::backends::no_cuda_feature())
}

/// Without the `cuda` feature: an error that says how to get it.
#[cfg(not(feature = "cuda"))]
fn bench_backward_cuda(_: &AttentionSpec, _: &Shape) -> Result<Timing, RuntimeError> {
    Err(attn::runtime::backends::no_cuda_feature())
}
