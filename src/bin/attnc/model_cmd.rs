//! `attnc logits`, `attnc generate` and `attnc params`: Hugging Face checkpoints (a directory)
//! or research models (a TOML file, random weights) on the CPU.

use attn::dsl::accounting::kv_cache_bytes_per_token;
use attn::runtime::Tensor;
use attn::runtime::device::{Device, SimDevice};
use attn::runtime::io::write_safetensors;
use attn::runtime::model::{
    DeviceModel, Model, Progress, Request, Sampling, TextTokenizer, hf, research,
};
use std::io::Write;
use std::path::Path;

/// Longest research model TOML file read.
const MAX_TOML_BYTES: usize = 1 << 20;

/// A checkpoint directory, or a research model's TOML file with weights seeded by `seed`.
pub fn load(path: &Path, seed: u64) -> Result<Model, String> {
    let err = |e: attn::runtime::RuntimeError| format!("error: {e}");
    if path.is_file() {
        let text = crate::spec_arg::read_bounded(path, MAX_TOML_BYTES)
            .map_err(|e| format!("error: {}: {e}", path.display()))?;
        let config = research::config_from_toml(&text)
            .map_err(|e| format!("error: {}: {e}", path.display()))?;
        return Model::random(&config, seed).map_err(err);
    }
    let model = hf::load(path).map_err(err)?;
    for warning in model.warnings() {
        eprintln!("warning: {warning}");
    }
    Ok(model)
}

/// [`load`], with the model's attention on `backend`.
pub fn load_on(path: &Path, seed: u64, backend: crate::run::Backend) -> Result<Model, String> {
    let mut model = load(path, seed)?;
    let name = backend.name();
    let opened = attn::runtime::backends::open(name).map_err(|e| format!("error: {e}"))?;
    model.set_backend(opened.into());
    model.set_layer_ops(attn::runtime::backends::layer_ops(name));
    Ok(model)
}

/// Token ids from `1,2,3`.
pub fn parse_tokens(text: &str) -> Result<Vec<u32>, String> {
    let tokens: Result<Vec<u32>, _> = text
        .split(',')
        .map(|t| t.trim().parse::<u32>().map_err(|_| t.trim().to_string()))
        .collect();
    match tokens {
        Ok(t) if !t.is_empty() => Ok(t),
        Ok(_) => Err("error: --tokens is empty; expected ids like 1,2,3".into()),
        Err(bad) => Err(format!(
            "error: --tokens: `{bad}` is not a token id; expected non-negative integers like 1,2,3"
        )),
    }
}

/// The device a model can be resident on for `backend`: the interpreter for gpu-sim, CUDA
/// device 0 for cuda; `None` on the CPU, and for models not yet resident on devices (MLA).
fn resident_device(
    model: &Model,
    backend: crate::run::Backend,
) -> Result<Option<std::sync::Arc<dyn Device>>, String> {
    if model.variant().spec().mla().is_some() {
        return Ok(None);
    }
    match backend {
        crate::run::Backend::Cpu => Ok(None),
        crate::run::Backend::GpuSim => Ok(Some(std::sync::Arc::new(SimDevice::new()))),
        crate::run::Backend::Cuda => cuda_device().map(Some),
    }
}

#[cfg(feature = "cuda")]
fn cuda_device() -> Result<std::sync::Arc<dyn Device>, String> {
    attn::runtime::gpu::cuda::CudaBackend::new(0)
        .map(|b| std::sync::Arc::new(b) as std::sync::Arc<dyn Device>)
        .map_err(|e| format!("error: {e}"))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device() -> Result<std::sync::Arc<dyn Device>, String> {
    Err(
        "error: this attnc was built without the `cuda` feature; rebuild with --features cuda \
         (scripts/setup-cuda-toolchain.sh), or use --backend gpu-sim"
            .into(),
    )
}

/// Writes the logits of `tokens` (`[1, T, vocab]` f32 as `logits`): one full forward, or with
/// `incremental = Some(P)` a prefill of P tokens then one token at a time. On gpu-sim or cuda
/// the whole model runs resident on the device (weights uploaded once, every activation and
/// the KV caches in device memory).
pub fn logits(
    model: &Model,
    tokens: &[u32],
    incremental: Option<usize>,
    output: &Path,
    backend: crate::run::Backend,
) -> Result<String, String> {
    let err = |e: attn::runtime::RuntimeError| format!("error: {e}");
    let logits = match incremental {
        None => match resident_device(model, backend)? {
            Some(device) => DeviceModel::new(model, device)
                .and_then(|m| m.forward(tokens))
                .map_err(err)?,
            None => model.forward(tokens).map_err(err)?,
        },
        Some(p) if p == 0 || p > tokens.len() => {
            return Err(format!(
                "error: --incremental {p}: the prefill must be 1 to {} tokens",
                tokens.len()
            ));
        }
        Some(p) => match resident_device(model, backend)? {
            Some(device) => {
                let on_device = DeviceModel::new(model, device).map_err(err)?;
                let mut session = on_device.session(tokens.len()).map_err(err)?;
                let mut all = session.step(&tokens[..p]).map_err(err)?;
                for t in p..tokens.len() {
                    all.extend(session.step(&tokens[t..t + 1]).map_err(err)?);
                }
                all
            }
            None => {
                let mut session = model.session(tokens.len(), 16).map_err(err)?;
                let mut all = session.step(&tokens[..p]).map_err(err)?;
                for t in p..tokens.len() {
                    all.extend(session.step(&tokens[t..t + 1]).map_err(err)?);
                }
                all
            }
        },
    };
    let vocab = model.config.vocab;
    let t = Tensor::from_f32(&[1, tokens.len(), vocab], logits).map_err(err)?;
    write_safetensors(output, &[("logits", &t)]).map_err(err)?;
    Ok(format!(
        "wrote logits [1, {}, {vocab}] to {}",
        tokens.len(),
        output.display()
    ))
}

/// A prompt: token ids, or text for the checkpoint's tokenizer.
pub enum Prompt {
    Ids(Vec<u32>),
    Text(String),
}

/// How long and how to generate.
pub struct GenerateArgs {
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    pub stop: Vec<u32>,
    pub backend: crate::run::Backend,
}

/// Generates from one prompt with the model at `path`. Ids in: returns the new ids, with a
/// progress line on stderr. Text in: streams the new text to stdout as tokens complete it,
/// returns what is still held back, and prints the rates on stderr at the end.
pub fn generate(
    path: &Path,
    seed: u64,
    prompt: Prompt,
    args: GenerateArgs,
) -> Result<String, String> {
    let err = |e: attn::runtime::RuntimeError| format!("error: {e}");
    let tokenizer = match &prompt {
        Prompt::Text(_) if path.is_file() => {
            return Err(format!(
                "error: {} is a research model, which has no tokenizer; use --tokens",
                path.display()
            ));
        }
        Prompt::Text(_) => Some(TextTokenizer::from_dir(path).map_err(err)?),
        Prompt::Ids(_) => None,
    };
    let ids = match prompt {
        Prompt::Ids(ids) => ids,
        Prompt::Text(text) => {
            let ids = tokenizer
                .as_ref()
                .expect("read above")
                .encode(&text)
                .map_err(err)?;
            if ids.is_empty() {
                return Err("error: --prompt is empty once tokenized".to_string());
            }
            ids
        }
    };
    let model = load_on(path, seed, args.backend)?;
    if let Some(tokenizer) = &tokenizer {
        tokenizer.check_fits(model.config.vocab).map_err(err)?;
    }
    let request = Request {
        prompt: ids,
        max_new_tokens: args.max_new_tokens,
        stop: args.stop,
    };
    let mut stream = tokenizer.as_ref().map(TextTokenizer::stream);
    let mut failed = None;
    let mut last = None;
    let mut report = |p: Progress| {
        if let Some(stream) = stream.as_mut() {
            for &(_, token) in &p.new_tokens {
                match stream.push(token) {
                    Ok(piece) => {
                        print!("{piece}");
                        let _ = std::io::stdout().flush();
                    }
                    Err(e) => failed = Some(e),
                }
            }
        } else {
            eprint!("\r  {}", rates(&p));
            let _ = std::io::stderr().flush();
        }
        last = Some(p);
    };
    // On gpu-sim or cuda the model runs resident on the device (MLA models: their attention).
    let out = match resident_device(&model, args.backend)? {
        Some(device) => vec![
            DeviceModel::new(&model, device)
                .and_then(|m| m.generate(&request, args.sampling, &mut report))
                .map_err(err)?,
        ],
        None => model
            .generate(&[request], args.sampling, &mut report)
            .map_err(err)?,
    };
    if let Some(e) = failed {
        return Err(err(e));
    }
    match stream.as_mut() {
        Some(stream) => {
            let rest = stream.finish().map_err(err)?;
            if let Some(p) = &last {
                eprintln!("  {}", rates(p));
            }
            Ok(rest)
        }
        None => {
            eprintln!();
            Ok(out[0]
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(","))
        }
    }
}

/// Tokens so far and the decoding rate (the first token comes from the prefill; the rate is
/// that of decode steps).
fn rates(p: &Progress) -> String {
    let decoded = p.generated.saturating_sub(1);
    let rate = if decoded == 0 {
        0.0
    } else {
        decoded as f64 / p.decoding.as_secs_f64()
    };
    format!(
        "{} tokens, {rate:.1} tokens/s decoding (prefill {:.1} ms)",
        p.generated,
        p.prefill.as_secs_f64() * 1e3
    )
}

/// The parameter breakdown and KV-cache costs of a checkpoint.
pub fn params(model: &Model, seq: u64) -> Result<String, String> {
    let c = &model.config;
    let mut s = format!(
        "{} layers, width {}, vocabulary {}, attention: {}\n",
        c.layers, c.hidden, c.vocab, c.attention
    );
    let parts = model.parameters();
    let total: u64 = parts.iter().map(|(_, n)| n).sum();
    for (name, n) in &parts {
        let note = if *name == "lm_head" && c.tie_embeddings {
            " (tied to the embedding)"
        } else {
            ""
        };
        s += &format!("  {name:<10} {n:>14}{note}\n");
    }
    s += &format!("  {:<10} {total:>14}\n", "total");
    let per_layer = kv_cache_bytes_per_token(&c.attention);
    let per_token = per_layer * c.layers as u64;
    let at_seq = per_token.checked_mul(seq).ok_or_else(|| {
        format!("error: the KV cache at --seq {seq} would exceed 2^64 bytes; allowed: less")
    })?;
    s += &format!(
        "KV cache: {per_token} bytes per token ({per_layer} per layer), {:.1} MiB at {seq} tokens",
        at_seq as f64 / (1 << 20) as f64
    );
    Ok(s)
}
