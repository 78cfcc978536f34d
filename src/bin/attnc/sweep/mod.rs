//! `attnc sweep`: trains every combination of a grid of model and attention settings, over
//! several seeds, and compares them by validation loss, cost and measured speed.

#[cfg(feature = "candle")]
mod grid;
#[cfg(feature = "candle")]
mod measure;
#[cfg(feature = "candle")]
mod plots;
#[cfg(feature = "candle")]
mod report;
#[cfg(feature = "candle")]
mod run;

use crate::train::Training;
use std::path::PathBuf;

/// `attnc sweep`'s arguments.
#[derive(clap::Args, Clone, Debug)]
#[command(
    after_help = "KEY is a model TOML key (hidden, layers, pattern, qk_norm, norm, \
    norm_placement, norm_eps, mlp, intermediate, tie_embeddings, qkv_bias, moe) or a spec key \
    (heads, kv_heads, head_dim, v_head_dim, mask, position, softcap, scale, dtype, score_mod, \
    mask_mod, sinks, normalize, differential), which sets every attention kind, or KIND.KEY, which sets one \
    (local.mask). Values are split at the commas outside brackets, so --vary \
    \"mask=causal,sliding_window(64)\" is two values; a TOML key takes TOML values \
    (pattern=['local','global'], moe={experts = 4, top_k = 2}) and none, which removes \
    it (moe=none: dense); softcap=none is no softcap. \
    The grid is the product of the --vary lists (at most 256 combinations); a combination the \
    model or spec rules refuse is reported and skipped. Each variant trains once per seed \
    (--seed, --seed + 1, ...) as attnc train would, into runs/NNN-NAME/seedS/. Writes into \
    --out, after every variant: results.csv, results.jsonl (with the loss curves), loss.svg, \
    pareto.svg, speed.svg and index.html (the table and plots, self-contained). Rerun the same \
    command to resume: finished runs are kept, unfinished ones continue from their last \
    checkpoint, and a run of another model, options or corpus is refused, never overwritten or \
    reported. --out must be new, empty or a sweep's folder, which attnc marks \
    (attnc-sweep.json) and locks while a sweep writes it."
)]
pub struct Args {
    /// The base research model's TOML file (random weights: no `weights` key).
    #[arg(long, value_name = "M.toml")]
    pub base: PathBuf,
    /// The training text (UTF-8).
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// The folder to write the sweep into (made if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// A setting to vary and its values: KEY=V1,V2,... (repeatable; each KEY once).
    #[arg(long, value_name = "KEY=V1,V2,...")]
    pub vary: Vec<String>,
    /// Training runs per variant, with seeds --seed, --seed + 1, ...
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub seeds: u64,
    /// How to train each run.
    #[command(flatten)]
    pub training: Training,
}

/// `attnc sweep`.
pub fn command(args: Args) -> Result<(), String> {
    crate::train::refuse_cuda(&args.training)?;
    sweep(args)
}

#[cfg(feature = "candle")]
fn sweep(args: Args) -> Result<(), String> {
    run::sweep(args)
}

#[cfg(not(feature = "candle"))]
fn sweep(_: Args) -> Result<(), String> {
    Err(crate::train::WITHOUT_CANDLE.into())
}
