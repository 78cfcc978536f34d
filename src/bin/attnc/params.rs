//! `attnc params`: the parameters per part of a checkpoint or research model, and its KV-cache
//! bytes.

use attn::dsl::accounting::kv_cache_bytes_per_token;
use attn::runtime::model::Model;
use std::path::PathBuf;

/// `attnc params`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json and *.safetensors), or a research model's TOML
    /// file (random weights).
    #[arg(long, value_name = "PATH")]
    model: PathBuf,
    /// Seed of a research model's random weights.
    #[arg(long, value_name = "S", default_value_t = 0)]
    init_seed: u64,
    /// Length for the cache size.
    #[arg(long, value_name = "N", default_value_t = 4096)]
    seq: u64,
}

/// `attnc params`.
pub fn command(args: Args) -> Result<(), String> {
    let model = crate::model_load::load(&args.model, args.init_seed)?;
    println!("{}", params(&model, args.seq)?);
    Ok(())
}

/// The parameter breakdown and KV-cache costs of a checkpoint.
fn params(model: &Model, seq: u64) -> Result<String, String> {
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
