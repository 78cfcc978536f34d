//! `attnc train`: trains a research model (its TOML) on a text file through candle, with the
//! model's attention on attn's kernels, and writes checkpoints `attnc generate` loads.

#[cfg(feature = "candle")]
pub mod corpus;
#[cfg(feature = "candle")]
pub mod plot;
#[cfg(feature = "candle")]
pub mod run;
#[cfg(feature = "candle")]
mod schedule;
#[cfg(feature = "candle")]
pub mod state;

use crate::backend_arg::Timed;
use std::path::PathBuf;

/// `attnc train`'s arguments.
#[derive(clap::Args, Clone, Debug)]
#[command(
    after_help = "Defaults: AdamW with betas (0.9, 0.95), eps 1e-8 and weight decay on \
    matrices only (not norms or biases); the learning rate rises linearly over --warmup steps, \
    then falls along a cosine to 10% of --lr at the last step; gradients are clipped to norm \
    1.0. Tokens are bytes (the model's vocab must be 256) unless --tokenizer is given. The last \
    10% of the corpus's tokens are the validation set. Writes into --out: metrics.jsonl (one \
    line per eval), model.safetensors and model.toml (which `attnc generate --model` loads), \
    state.json (for --resume) and loss.svg, at every eval."
)]
pub struct Args {
    /// The research model's TOML file (its `attention` is a spec).
    #[arg(long, value_name = "M.toml", required_unless_present = "resume")]
    pub model: Option<PathBuf>,
    /// The training text (UTF-8).
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// The folder to write the run into (made if missing).
    #[arg(long, value_name = "DIR", required_unless_present = "resume")]
    pub out: Option<PathBuf>,
    /// Continue the run in DIR from its last checkpoint, with the options it was started with
    /// (--steps may raise its length). AdamW's moments start again from zero.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["model", "out", "tokenizer", "batch", "seq", "lr", "warmup", "weight_decay", "seed", "eval_every"])]
    pub resume: Option<PathBuf>,
    /// How to train.
    #[command(flatten)]
    pub training: Training,
}

/// The options of a training run, shared by `attnc train` and `attnc sweep`.
#[derive(clap::Args, Clone, Debug)]
pub struct Training {
    /// A tokenizer.json to tokenize with (default: bytes).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Optimizer steps [default: 300].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub steps: Option<u64>,
    /// Sequences per step.
    #[arg(long, value_name = "B", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub batch: u64,
    /// Tokens per sequence.
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub seq: u64,
    /// Peak learning rate (a finite number above 0, at most 10).
    #[arg(long, value_name = "LR", default_value_t = 3e-3, value_parser = learning_rate, allow_negative_numbers = true)]
    pub lr: f64,
    /// Steps of linear warmup.
    #[arg(long, value_name = "N", default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=100_000_000))]
    pub warmup: u64,
    /// AdamW weight decay of the matrices (a finite number, 0 or more).
    #[arg(long, value_name = "WD", default_value_t = 0.1, value_parser = weight_decay, allow_negative_numbers = true)]
    pub weight_decay: f64,
    /// Seed of the initial weights and of the batches.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Steps between evaluations and checkpoints.
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub eval_every: u64,
    /// Where to train: cpu (cuda is not supported by training yet).
    #[arg(long, value_enum, default_value_t = Timed::Cpu)]
    pub backend: Timed,
}

/// Steps when --steps is not given.
#[cfg(feature = "candle")]
pub const DEFAULT_STEPS: u64 = 300;

fn learning_rate(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 10.0 => Ok(v),
        _ => Err(format!(
            "`{text}`: allowed: a finite number above 0, at most 10"
        )),
    }
}

fn weight_decay(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("`{text}`: allowed: a finite number, 0 or more")),
    }
}

/// `attnc train`.
pub fn command(args: Args) -> Result<(), String> {
    refuse_cuda(&args.training)?;
    train(args)
}

/// The error for `--backend cuda`, which training does not support yet.
pub fn refuse_cuda(training: &Training) -> Result<(), String> {
    if training.backend == Timed::Cuda {
        return Err(
            "error: --backend cuda: attnc train runs on the CPU; attn's candle op does \
                    not take CUDA tensors yet"
                .into(),
        );
    }
    Ok(())
}

#[cfg(feature = "candle")]
fn train(args: Args) -> Result<(), String> {
    run::train(args)
}

/// The error of a command that trains, in an attnc built without candle.
#[cfg(not(feature = "candle"))]
pub const WITHOUT_CANDLE: &str = "error: this attnc was built without the `candle` feature, \
    which training needs: cargo install --path . --features candle (or cargo run --features \
    candle -- train ...)";

#[cfg(not(feature = "candle"))]
fn train(_: Args) -> Result<(), String> {
    Err(WITHOUT_CANDLE.into())
}
