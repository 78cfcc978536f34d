//! `attnc train`: trains a research model (its TOML) on a text file through candle, with the
//! model's attention on attn's kernels, and writes checkpoints `attnc generate` loads.

#[cfg(feature = "candle")]
pub mod checkpoint;
#[cfg(feature = "candle")]
mod context;
#[cfg(feature = "candle")]
pub mod corpus;
#[cfg(feature = "candle")]
pub mod folder;
#[cfg(feature = "candle")]
mod optimizer;
#[cfg(feature = "candle")]
pub mod plot;
#[cfg(feature = "candle")]
pub mod ranks;
#[cfg(feature = "candle")]
pub mod run;
#[cfg(feature = "candle")]
mod schedule;
#[cfg(feature = "candle")]
pub mod state;

use crate::backend_arg::Timed;
use std::path::PathBuf;

/// The most steps a run takes (`--steps`, `--warmup`, `--eval-every`).
pub const MAX_STEPS: u64 = 100_000_000;
/// The most sequences in a step (`--batch`).
pub const MAX_BATCH: u64 = 4096;
/// The longest sequence (`--seq`).
pub const MAX_SEQ: u64 = 65_536;
/// The largest peak learning rate (`--lr`).
pub const MAX_LR: f64 = 10.0;

/// `attnc train`'s arguments.
#[derive(clap::Args, Clone, Debug)]
#[command(
    after_help = "Defaults: AdamW with betas (0.9, 0.95), eps 1e-8 and weight decay on \
    matrices only (not norms or biases); the learning rate rises linearly over --warmup steps, \
    then falls along a cosine to 10% of --lr at the last step; gradients are clipped to norm \
    1.0. Tokens are bytes (the model's vocab must be 256) unless --tokenizer is given. The last \
    10% of the corpus's tokens are the validation set. --out must be a new or empty folder; \
    attnc marks it with attnc-run.json and holds a lock on that file while it trains, so a \
    second run into it is refused. At every eval it writes a checkpoint: model-N.safetensors \
    (the weights), optimizer-N.safetensors (AdamW's moments) and, last, state.json, which makes \
    the checkpoint count; a kill at any moment leaves the last whole checkpoint, and --resume \
    continues from it exactly as the run would have gone on. Beside them: model.toml (which \
    `attnc generate --model` loads), metrics.jsonl (one line per eval), steps.jsonl (one line \
    per step) and loss.svg. A loss, gradient or parameter that is not finite stops the run \
    before anything of that step is written, naming it and the last good checkpoint."
)]
pub struct Args {
    /// The research model's TOML file (its `attention` is a spec). With `weights = FILE`
    /// (as the model.toml of a run), training starts from those weights.
    #[arg(long, value_name = "M.toml", required_unless_present = "resume")]
    pub model: Option<PathBuf>,
    /// The training text (UTF-8). With --resume, the run's own corpus by default; another
    /// file is refused unless its tokens are the same.
    #[arg(long, value_name = "FILE", required_unless_present = "resume")]
    pub data: Option<PathBuf>,
    /// The folder to write the run into: new (made), empty, or a run's that stopped before its
    /// first checkpoint.
    #[arg(long, value_name = "DIR", required_unless_present = "resume")]
    pub out: Option<PathBuf>,
    /// Continue the run in DIR from its last checkpoint, with the options it was started with
    /// (--steps may raise its length, --lr change its peak learning rate from there on).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["model", "out", "tokenizer", "batch", "seq", "warmup", "weight_decay", "seed", "eval_every", "pack"])]
    pub resume: Option<PathBuf>,
    /// Data-parallel ranks in this process (threads): each takes --batch / N sequences of
    /// every step, and the gradients are averaged over them, so the run equals one rank with
    /// the same --batch. Under mpirun (an attnc built with the `mpi` feature) the ranks are
    /// MPI's processes instead.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=MAX_RANKS))]
    pub ranks: u64,
    /// Context parallelism: the N ranks (--ranks N, or mpirun -n N) split every sequence
    /// instead of the batch, each taking its positions of every window, and each attention
    /// runs over them (--scheme); the run equals one rank with the same --batch and --seq.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(2..=MAX_RANKS))]
    pub context_parallel: Option<u64>,
    /// How --context-parallel splits attention: ring (keys and values passed around the
    /// ranks) or ulysses (an all-to-all over heads; the heads must divide over the ranks).
    #[arg(long, value_name = "SCHEME", default_value = "ring", value_parser = ["ring", "ulysses"], requires = "context_parallel")]
    pub scheme: String,
    /// How to train.
    #[command(flatten)]
    pub training: Training,
}

/// The most data-parallel ranks in one process (`--ranks`).
pub const MAX_RANKS: u64 = 64;

/// The options of a training run, shared by `attnc train` and `attnc sweep`.
#[derive(clap::Args, Clone, Debug)]
pub struct Training {
    /// A tokenizer.json to tokenize with (default: bytes).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Optimizer steps [default: 300].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=MAX_STEPS))]
    pub steps: Option<u64>,
    /// Sequences per step.
    #[arg(long, value_name = "B", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=MAX_BATCH))]
    pub batch: u64,
    /// Tokens per sequence.
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=MAX_SEQ))]
    pub seq: u64,
    /// Peak learning rate (a finite number above 0, at most 10) [default: 0.003].
    #[arg(long, value_name = "LR", value_parser = learning_rate, allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// Steps of linear warmup.
    #[arg(long, value_name = "N", default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=MAX_STEPS))]
    pub warmup: u64,
    /// AdamW weight decay of the matrices (a finite number, 0 or more).
    #[arg(long, value_name = "WD", default_value_t = 0.1, value_parser = weight_decay, allow_negative_numbers = true)]
    pub weight_decay: f64,
    /// Seed of the initial weights and of the batches.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Steps between evaluations and checkpoints.
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=MAX_STEPS))]
    pub eval_every: u64,
    /// Where to train: cpu (cuda is not supported by training yet).
    #[arg(long, value_enum, default_value_t = Timed::Cpu)]
    pub backend: Timed,
    /// Packed training: the corpus's documents end with SEPARATOR (a blank line when --pack is
    /// given alone; `\n` and `\t` are a newline and a tab), and each window's tokens attend
    /// only within their own document (a document mask on every attention).
    #[arg(long, value_name = "SEPARATOR", num_args = 0..=1, default_missing_value = "\\n\\n", value_parser = separator)]
    pub pack: Option<String>,
}

/// A `--pack` separator with `\n`, `\t` and `\\` unescaped; an empty one is refused.
fn separator(text: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match (c, c == '\\') {
            (_, true) => match chars.next() {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some('\\') => out.push('\\'),
                other => {
                    return Err(format!(
                        "`\\{}` is not an escape; allowed: \\n, \\t, \\\\",
                        other.map(String::from).unwrap_or_default()
                    ));
                }
            },
            _ => out.push(c),
        }
    }
    if out.is_empty() {
        return Err(
            "the separator is empty; give some text, or --pack alone for a blank line".into(),
        );
    }
    Ok(out)
}

/// Steps when --steps is not given.
#[cfg(feature = "candle")]
pub const DEFAULT_STEPS: u64 = 300;
/// The peak learning rate when --lr is not given.
#[cfg(feature = "candle")]
pub const DEFAULT_LR: f64 = 3e-3;

fn learning_rate(text: &str) -> Result<f64, String> {
    let v = text
        .parse::<f64>()
        .map_err(|_| format!("`{text}` is not a number"))?;
    check_learning_rate(v)
}

fn weight_decay(text: &str) -> Result<f64, String> {
    let v = text
        .parse::<f64>()
        .map_err(|_| format!("`{text}` is not a number"))?;
    check_weight_decay(v)
}

/// A peak learning rate, checked: finite, above 0, at most [`MAX_LR`].
pub fn check_learning_rate(v: f64) -> Result<f64, String> {
    if v.is_finite() && v > 0.0 && v <= MAX_LR {
        Ok(v)
    } else {
        Err(format!(
            "{v} is out of range; allowed: a finite number above 0, at most {MAX_LR}"
        ))
    }
}

/// A weight decay, checked: finite, 0 or more.
pub fn check_weight_decay(v: f64) -> Result<f64, String> {
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!(
            "{v} is out of range; allowed: a finite number, 0 or more"
        ))
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
