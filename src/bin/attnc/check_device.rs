//! `attnc check-device`: the GPU backend's decode paths on CUDA device 0 (or, with `--backend
//! gpu-sim`, on the GPU IR interpreter) against the CPU backend (itself tested against the
//! reference): per-head decode with the cache uploaded per call and resident on the device (the
//! interpreter keeps resident copies too), ragged batches,
//! MLA decode and MLA prefill, in f32, bf16 and f16. One line per case; `scripts/gpu-check.sh`
//! runs it next to the prefill differential tests.

use crate::backend_arg::Backend;
use attn::AttentionSpec;
use attn::inputs::tensor as random;
use attn::runtime::cache::{PagedCache, SeqId};
use attn::runtime::cpu::CpuBackend;
use attn::runtime::device::Device;
use attn::runtime::gpu::backend::GpuBackend;
use attn::runtime::gpu::sim::GpuSim;
use attn::runtime::{Backend as _, DecodeOptions, Inputs, MlaQueries, MlaTensors, Output, Queries};
use attn::runtime::{RuntimeError, Tensor, Variant};

/// `attnc check-device`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Where to run: cuda (device 0), or gpu-sim (the interpreter; slow, no GPU needed).
    #[arg(long, value_enum, default_value_t = Backend::Cuda)]
    backend: Backend,
}

/// `attnc check-device`: `Ok(true)` when every case agrees with the CPU.
pub fn command(args: Args) -> Result<bool, String> {
    run(args.backend).map_err(|e| format!("error: {e}"))
}

/// The GPU backend under test on its device: every `Backend` call, and decoding against device
/// copies of the cache.
trait Gpu: attn::runtime::Backend {
    /// Decode against a device copy of the cache.
    fn decode_resident(
        &self,
        variant: &Variant,
        q: &Tensor,
        cache: &PagedCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError>;

    /// Decode against a device copy of the cache taken before `step` changed the cache, then
    /// brought up to date (`sync_cache`).
    fn decode_after_sync(
        &self,
        variant: &Variant,
        q: &Tensor,
        cache: &mut PagedCache,
        step: &dyn Fn(&mut PagedCache) -> Result<(), RuntimeError>,
        seqs: &[SeqId],
    ) -> Result<Output, RuntimeError>;
}

impl<D: Device + 'static> Gpu for GpuBackend<D> {
    fn decode_resident(
        &self,
        variant: &Variant,
        q: &Tensor,
        cache: &PagedCache,
        seqs: &[SeqId],
        options: DecodeOptions,
    ) -> Result<Output, RuntimeError> {
        let resident = self.upload_cache(cache)?;
        GpuBackend::decode_resident(self, variant, q, cache, &resident, seqs, options)
    }

    fn decode_after_sync(
        &self,
        variant: &Variant,
        q: &Tensor,
        cache: &mut PagedCache,
        step: &dyn Fn(&mut PagedCache) -> Result<(), RuntimeError>,
        seqs: &[SeqId],
    ) -> Result<Output, RuntimeError> {
        let mut resident = self.upload_cache(cache)?;
        step(cache)?;
        self.sync_cache(&mut resident, cache)?;
        let options = DecodeOptions::default();
        GpuBackend::decode_resident(self, variant, q, cache, &resident, seqs, options)
    }
}

/// The backend to check: CUDA device 0, or the interpreter.
fn gpu(on: Backend) -> Result<Box<dyn Gpu>, RuntimeError> {
    match on {
        Backend::GpuSim => Ok(Box::new(GpuSim::new())),
        #[cfg(feature = "cuda")]
        Backend::Cuda => Ok(Box::new(attn::runtime::gpu::cuda::CudaBackend::new(0)?)),
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda => Err(attn::runtime::backends::no_cuda_feature()),
        Backend::Cpu => Err(RuntimeError::Spec(
            "check-device compares a GPU backend with the CPU: use --backend cuda or gpu-sim"
                .into(),
        )),
    }
}

/// Runs every case; `Ok(true)` when all agree.
fn run(on: Backend) -> Result<bool, RuntimeError> {
    let gpu = gpu(on)?;
    let cpu = CpuBackend::new();
    let mut all = true;
    let mut report = |what: &str, spec: &AttentionSpec, got: Output, want: Output| {
        let (abs, rel) = match spec.dtype {
            attn::dsl::DType::F32 => (1e-4, 1e-4),
            _ => (2e-3, 1e-2),
        };
        let worst = |a: &Tensor, b: &Tensor, rel: f32| {
            a.to_f32_vec()
                .iter()
                .zip(b.to_f32_vec())
                .filter(|(g, w)| !(w.is_infinite() && **g == *w))
                .map(|(g, w)| (g - w).abs() / (1.0 + rel / abs * w.abs()))
                .fold(0f32, f32::max)
        };
        let (out, lse) = (
            worst(&got.out, &want.out, rel),
            worst(&got.lse, &want.lse, 0.0),
        );
        let ok = got.out.shape() == want.out.shape() && out <= abs && lse <= 1e-3;
        all &= ok;
        println!(
            "{} {what}: {spec}: |out - cpu| {out:.2e}, |lse - cpu| {lse:.2e}",
            if ok { "ok  " } else { "FAIL" }
        );
    };

    for text in [
        "heads = 8, kv_heads = 2, head_dim = 128, mask = causal",
        "heads = 32, kv_heads = 8, head_dim = 128, mask = causal, dtype = bf16",
        "heads = 4, head_dim = 64, mask = sliding_window(100), position = alibi, dtype = f16",
        "heads = 8, kv_heads = 2, head_dim = 64, position = rope, softcap = 30.0, dtype = bf16",
    ] {
        let spec: AttentionSpec = text
            .parse()
            .map_err(|e| RuntimeError::Spec(format!("{e}")))?;
        let variant = Variant::new(spec.clone())?;
        let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let mut cache = PagedCache::new(&spec, 16, 64)?;
        let mut seqs = Vec::new();
        for (i, len) in [300usize, 170].into_iter().enumerate() {
            let seq = cache.add_sequence();
            let seed = 10 * i as u64;
            cache.append(
                seq,
                &random(spec.dtype, &[hkv, len, d], seed)?,
                &random(spec.dtype, &[hkv, len, dv], seed + 1)?,
            )?;
            seqs.push(seq);
        }
        for n in [1, 3] {
            let q = random(spec.dtype, &[2, h, n, d], 5)?;
            let options = DecodeOptions::default();
            let queries = Queries::Uniform(&q);
            let want = cpu.attend_cached(&variant, queries, &cache, &seqs, options)?;
            let got = gpu.attend_cached(&variant, queries, &cache, &seqs, options)?;
            report(&format!("decode q_len {n}"), &spec, got, want.clone());
            let got = gpu.decode_resident(&variant, &q, &cache, &seqs, options)?;
            report(&format!("resident decode q_len {n}"), &spec, got, want);
        }
        // A decode step: one more token for the first sequence, the device copy synced.
        let step = |c: &mut PagedCache| {
            c.append(
                seqs[0],
                &random(spec.dtype, &[hkv, 1, d], 30)?,
                &random(spec.dtype, &[hkv, 1, dv], 31)?,
            )
        };
        let q = random(spec.dtype, &[2, h, 1, d], 7)?;
        let got = gpu.decode_after_sync(&variant, &q, &mut cache, &step, &seqs)?;
        let queries = Queries::Uniform(&q);
        let want = cpu.attend_cached(&variant, queries, &cache, &seqs, DecodeOptions::default())?;
        report("resident decode after a step, synced", &spec, got, want);
        let offsets = [0, 1, 9];
        let q = random(spec.dtype, &[9, h, d], 6)?;
        let options = DecodeOptions {
            partitions: Some(3),
        };
        let queries = Queries::Ragged {
            q: &q,
            offsets: &offsets,
        };
        let want = cpu.attend_cached(&variant, queries, &cache, &seqs, options)?;
        let got = gpu.attend_cached(&variant, queries, &cache, &seqs, options)?;
        report("ragged, split-KV", &spec, got, want);
    }

    let text = "heads = 16, head_dim = 64, v_head_dim = 64, mla(latent_rank = 128, rope_dim = 32), \
                mask = causal";
    let spec: AttentionSpec = text
        .parse()
        .map_err(|e| RuntimeError::Spec(format!("{e}")))?;
    let variant = Variant::new(spec.clone())?;
    let mla = spec.mla().expect("an MLA spec");
    let (h, dn, dv) = (16, 64, 64);
    let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
    let (sq, skv) = (40, 200);
    let (c_kv, k_pe) = (
        random(spec.dtype, &[1, skv, r], 1)?,
        random(spec.dtype, &[1, skv, dr], 2)?,
    );
    let w_kv_b = random(spec.dtype, &[h * (dn + dv), r], 3)?;
    let (q_nope, q_pe) = (
        random(spec.dtype, &[1, h, sq, dn], 4)?,
        random(spec.dtype, &[1, h, sq, dr], 5)?,
    );
    let x = MlaTensors {
        q_nope: &q_nope,
        q_pe: &q_pe,
        c_kv: &c_kv,
        k_pe: &k_pe,
        w_kv_b: &w_kv_b,
    };
    let want = cpu.forward(&variant, Inputs::Mla(x), 0)?;
    report(
        "MLA prefill",
        &spec,
        gpu.forward(&variant, Inputs::Mla(x), 0)?,
        want,
    );
    let mut cache = PagedCache::new(&spec, 16, 16)?;
    let seq = cache.add_sequence();
    let rows = |t: &Tensor, w: usize| Tensor::from_f32_as(spec.dtype, &[skv, w], t.to_f32_vec());
    cache.append(seq, &rows(&c_kv, r)?, &rows(&k_pe, dr)?)?;
    let (q_nope, q_pe) = (
        random(spec.dtype, &[1, h, 1, dn], 6)?,
        random(spec.dtype, &[1, h, 1, dr], 7)?,
    );
    let queries = || MlaQueries {
        q_nope: &q_nope,
        q_pe: &q_pe,
        w_kv_b: &w_kv_b,
    };
    let options = DecodeOptions::default();
    let want = cpu.attend_cached(&variant, Queries::Mla(queries()), &cache, &[seq], options)?;
    let got = gpu.attend_cached(&variant, Queries::Mla(queries()), &cache, &[seq], options)?;
    report("MLA decode", &spec, got, want);
    Ok(all)
}
