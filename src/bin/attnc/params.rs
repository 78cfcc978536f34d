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

/// The KV cache of a model: bytes per token over all layers, and bytes at `seq` tokens, where
/// a sliding-window layer holds at most its window; `None` past 64 bits.
fn kv_cache(c: &attn::runtime::model::ModelConfig, seq: u64) -> Option<(u64, u64)> {
    let (mut per_token, mut at_seq) = (0u64, 0u64);
    for i in 0..c.layers {
        let spec = c.layer_attention(i);
        let bytes = kv_cache_bytes_per_token(spec);
        let held = match spec.mask {
            attn::Mask::SlidingWindow { window } => seq.min(window),
            _ => seq,
        };
        per_token = per_token.checked_add(bytes)?;
        at_seq = at_seq.checked_add(bytes.checked_mul(held)?)?;
    }
    Some((per_token, at_seq))
}

/// The parameter breakdown and KV-cache costs of a checkpoint.
fn params(model: &Model, seq: u64) -> Result<String, String> {
    let c = &model.config;
    let mut s = format!(
        "{} layers, width {}, vocabulary {}, attention: {}\n",
        c.layers,
        c.hidden,
        c.vocab,
        c.attention_summary()
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
    if let Some(moe) = &c.moe {
        // Each MoE layer runs top_k of its experts per token.
        let per_expert: u64 = model.expert_weights();
        let idle = moe.sparse.iter().filter(|&&s| s).count() as u64
            * (moe.experts - moe.top_k) as u64
            * per_expert;
        s += &format!(
            "  {:<10} {:>14} (per token: {} of {} experts in {} MoE layers)\n",
            "active",
            total - idle,
            moe.top_k,
            moe.experts,
            moe.sparse.iter().filter(|&&s| s).count()
        );
    }
    let (per_token, at_seq) = kv_cache(c, seq).ok_or_else(|| {
        format!("error: the KV cache at --seq {seq} would exceed 2^64 bytes; allowed: less")
    })?;
    let per_layer = match c.single_attention() {
        Some(spec) => format!("{} per layer", kv_cache_bytes_per_token(spec)),
        None => "summed over the layers' kinds; a sliding layer holds at most its window".into(),
    };
    s += &format!(
        "KV cache: {per_token} bytes per token ({per_layer}), {:.1} MiB at {seq} tokens",
        at_seq as f64 / (1 << 20) as f64
    );
    Ok(s)
}
