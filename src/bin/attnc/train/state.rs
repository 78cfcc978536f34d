//! What a run folder holds besides the weights: `state.json` (the options and where the run
//! is, for `--resume`) and `metrics.jsonl` (one line per evaluation).

use super::corpus::Rng;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

/// The options a run keeps for the whole of its length.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    pub tokenizer: Option<PathBuf>,
    pub steps: u64,
    pub batch: usize,
    pub seq: usize,
    pub lr: f64,
    pub warmup: u64,
    pub weight_decay: f64,
    pub seed: u64,
    pub eval_every: u64,
}

/// A run's options and progress: the steps done and the batch generator's state after them.
#[derive(Clone, Debug, PartialEq)]
pub struct State {
    pub options: Options,
    pub step: u64,
    pub rng: Rng,
}

/// One evaluation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Metrics {
    pub step: u64,
    pub train_loss: f64,
    pub val_loss: f64,
    pub tokens_per_s: f64,
    pub elapsed_s: f64,
}

impl Metrics {
    pub fn to_json(self) -> String {
        json!({
            "step": self.step,
            "train_loss": self.train_loss,
            "val_loss": self.val_loss,
            "tokens_per_s": self.tokens_per_s,
            "elapsed_s": self.elapsed_s,
        })
        .to_string()
    }

    fn from_json(v: &Value) -> Option<Metrics> {
        Some(Metrics {
            step: v["step"].as_u64()?,
            train_loss: v["train_loss"].as_f64()?,
            val_loss: v["val_loss"].as_f64()?,
            tokens_per_s: v["tokens_per_s"].as_f64()?,
            elapsed_s: v["elapsed_s"].as_f64()?,
        })
    }
}

/// Largest state.json or metrics.jsonl read.
const MAX_BYTES: u64 = 64 << 20;

impl State {
    pub fn to_json(&self) -> String {
        let o = &self.options;
        let state = json!({
            "step": self.step,
            "rng": self.rng.state(),
            "options": {
                "tokenizer": o.tokenizer.as_ref().map(|p| p.display().to_string()),
                "steps": o.steps,
                "batch": o.batch,
                "seq": o.seq,
                "lr": o.lr,
                "warmup": o.warmup,
                "weight_decay": o.weight_decay,
                "seed": o.seed,
                "eval_every": o.eval_every,
            },
        });
        serde_json::to_string_pretty(&state).expect("a JSON value prints")
    }

    /// `dir/state.json`, checked field by field; errors start with `context` (the flag that
    /// named `dir`).
    pub fn read(dir: &Path, context: &str) -> Result<State, String> {
        let path = dir.join("state.json");
        let bad = |what: &str| {
            format!(
                "error: {context}: {}: {what}; expected the state.json attnc train writes",
                path.display()
            )
        };
        let text = attn::runtime::files::read_text(&path, MAX_BYTES, "the run's state")
            .map_err(|e| format!("error: {context}: {e}"))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| bad(&format!("not JSON ({e})")))?;
        let o = &v["options"];
        let uint = |v: &Value, k: &str| {
            v[k].as_u64()
                .ok_or_else(|| bad(&format!("`{k}` is missing or not a count")))
        };
        let float = |k: &str| {
            o[k].as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| bad(&format!("`options.{k}` is missing or not a number")))
        };
        let size = |k: &str| {
            uint(o, k).and_then(|n| {
                usize::try_from(n)
                    .ok()
                    .filter(|&n| (1..=65_536).contains(&n))
                    .ok_or_else(|| bad(&format!("`options.{k}` = {n} is out of range")))
            })
        };
        let options = Options {
            tokenizer: match &o["tokenizer"] {
                Value::Null => None,
                Value::String(s) => Some(PathBuf::from(s)),
                _ => return Err(bad("`options.tokenizer` is not a path")),
            },
            steps: uint(o, "steps")?,
            batch: size("batch")?,
            seq: size("seq")?,
            lr: float("lr")?,
            warmup: uint(o, "warmup")?,
            weight_decay: float("weight_decay")?,
            seed: uint(o, "seed")?,
            eval_every: uint(o, "eval_every")?.max(1),
        };
        Ok(State {
            options,
            step: uint(&v, "step")?,
            rng: Rng::from_state(uint(&v, "rng")?)
                .ok_or_else(|| bad("`rng` is 0, which no generator reaches"))?,
        })
    }
}

/// The evaluations in `dir/metrics.jsonl` up to step `up_to` (a resumed run drops those past
/// its checkpoint); none when the file is missing.
pub fn read_metrics(dir: &Path, up_to: u64) -> Result<Vec<Metrics>, String> {
    let path = dir.join("metrics.jsonl");
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = attn::runtime::files::read_text(&path, MAX_BYTES, "the run's metrics")
        .map_err(|e| format!("error: --resume: {e}"))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str::<Value>(l)
                .ok()
                .as_ref()
                .and_then(Metrics::from_json)
                .ok_or_else(|| {
                    format!(
                        "error: --resume: {}: a line is not a metrics record: {l}",
                        path.display()
                    )
                })
        })
        .filter(|m| m.as_ref().map_or(true, |m| m.step <= up_to))
        .collect()
}

/// Writes `text` to `dir/name` through a temporary file and a rename, so an interrupted write
/// leaves the previous file whole.
pub fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), String> {
    let path = dir.join(name);
    let temporary = dir.join(format!(".{name}.partial"));
    std::fs::write(&temporary, bytes)
        .and_then(|()| std::fs::rename(&temporary, &path))
        .map_err(|e| format!("error: --out: cannot write {}: {e}", path.display()))
}
