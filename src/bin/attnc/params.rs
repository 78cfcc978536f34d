//! `attnc params`: the parameters per part of a checkpoint or research model, and its KV-cache
//! bytes.

use attn::dsl::accounting::kv_cache_bytes_per_token;
use std::path::PathBuf;

/// `attnc params`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json and *.safetensors), or a research model's TOML
    /// file (counted from its config).
    #[arg(long, value_name = "PATH")]
    model: PathBuf,
    /// Length for the cache size.
    #[arg(long, value_name = "N", default_value_t = 4096)]
    seq: u64,
}

/// `attnc params`: a checkpoint's parts counted from its tensors; a research model's from its
/// config alone (no weights are made, so a 7B-shaped TOML answers at once).
pub fn command(args: Args) -> Result<(), String> {
    let config;
    let model;
    let counts = if args.model.is_file() {
        config = crate::model_load::load_config(&args.model)?;
        let parts = config
            .parameters()
            .ok_or("error: the model's parameters pass 2^64")?;
        Counts {
            config: &config,
            expert: config.expert_weights(),
            parts,
        }
    } else {
        model = crate::model_load::load(&args.model, 0)?;
        Counts {
            config: &model.config,
            expert: model.expert_weights(),
            parts: model.parameters(),
        }
    };
    println!("{}", params(&counts, args.seq)?);
    Ok(())
}

/// A model's parameters by part and those of one expert.
struct Counts<'a> {
    config: &'a attn::runtime::model::ModelConfig,
    parts: Vec<(&'static str, u64)>,
    expert: u64,
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

/// The parameter breakdown and KV-cache costs of a model.
fn params(counts: &Counts, seq: u64) -> Result<String, String> {
    let c = counts.config;
    let mut s = format!(
        "{} layers, width {}, vocabulary {}, attention: {}\n",
        c.layers,
        c.hidden,
        c.vocab,
        c.attention_summary()
    );
    let parts = &counts.parts;
    let total = parts
        .iter()
        .try_fold(0u64, |sum, (_, n)| sum.checked_add(*n))
        .ok_or("error: the model's parameters pass 2^64")?;
    for (name, n) in parts {
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
        let per_expert = counts.expert;
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
        "KV cache: {per_token} bytes per token ({per_layer}), {:.1} MiB at {}",
        at_seq as f64 / (1 << 20) as f64,
        crate::outputs::counted(seq, "token")
    );
    Ok(s)
}
