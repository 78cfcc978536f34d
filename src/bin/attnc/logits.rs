//! `attnc logits`: the logits of a token sequence from a checkpoint or research model, in one
//! forward or a prefill then one token at a time.

use crate::backend_arg::Backend;
use crate::model_load::{load_on, parse_tokens, resident_device};
use attn::runtime::Tensor;
use attn::runtime::io::write_safetensors;
use attn::runtime::model::{Model, ResidentModel};
use std::path::{Path, PathBuf};

/// `attnc logits`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json and *.safetensors), or a research model's TOML
    /// file (random weights).
    #[arg(long, value_name = "PATH")]
    model: PathBuf,
    /// Seed of a research model's random weights.
    #[arg(long, value_name = "S", default_value_t = 0)]
    init_seed: u64,
    /// Token ids, comma-separated.
    #[arg(long, value_name = "IDS")]
    tokens: String,
    /// Prefill this many tokens, then decode the rest one at a time with the KV cache.
    #[arg(long, value_name = "P")]
    incremental: Option<usize>,
    /// Output safetensors file.
    #[arg(long, value_name = "FILE")]
    output: PathBuf,
    /// Where the model runs: cpu; gpu-sim or cuda hold the whole model on the device (weights,
    /// activations and KV caches).
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
}

/// `attnc logits`.
pub fn command(args: Args) -> Result<(), String> {
    crate::outputs::check(&args.output, &[&args.model], "--output")?;
    let tokens = parse_tokens(&args.tokens)?;
    let model = load_on(&args.model, args.init_seed, args.backend)?;
    let summary = logits(
        &model,
        &tokens,
        args.incremental,
        &args.output,
        args.backend,
    )?;
    println!("{summary}");
    Ok(())
}

/// Writes the logits of `tokens` (`[1, T, vocab]` f32 as `logits`): one full forward, or with
/// `incremental = Some(P)` a prefill of P tokens then one token at a time. On gpu-sim or cuda
/// the whole model runs resident on the device (weights uploaded once, every activation and
/// the KV caches in device memory).
fn logits(
    model: &Model,
    tokens: &[u32],
    incremental: Option<usize>,
    output: &Path,
    backend: Backend,
) -> Result<String, String> {
    let err = |e: attn::runtime::RuntimeError| format!("error: {e}");
    let logits = match incremental {
        None => match resident_device(backend)? {
            Some(device) => ResidentModel::new(model, device)
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
        Some(p) => match resident_device(backend)? {
            Some(device) => {
                let on_device = ResidentModel::new(model, device).map_err(err)?;
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
