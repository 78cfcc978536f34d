//! What a run folder holds besides the weights: `state.json`, the record of its last
//! checkpoint (the options, the model, the corpus and where the run is), and the logs
//! `metrics.jsonl` (one line per evaluation) and `steps.jsonl` (one line per step).

use super::{MAX_BATCH, MAX_SEQ, MAX_STEPS, check_learning_rate, check_weight_decay};
use attn::inputs::XorShift as Rng;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

/// The options a run keeps for the whole of its length.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// The tokenizer.json, as an absolute path (bytes when `None`).
    pub tokenizer: Option<PathBuf>,
    pub steps: u64,
    pub batch: usize,
    pub seq: usize,
    pub lr: f64,
    pub warmup: u64,
    pub weight_decay: f64,
    pub seed: u64,
    pub eval_every: u64,
    /// Packed training: the separator documents end with (`None`: windows cross documents).
    pub pack: Option<String>,
}

impl Options {
    /// The first option out of its range, as the command line would refuse it.
    pub fn check(&self) -> Result<(), String> {
        let count = |flag: &str, v: u64, lo: u64, hi: u64| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(format!("{flag} {v} is out of range; allowed: {lo} to {hi}"))
            }
        };
        count("--steps", self.steps, 1, MAX_STEPS)?;
        count("--batch", self.batch as u64, 1, MAX_BATCH)?;
        count("--seq", self.seq as u64, 1, MAX_SEQ)?;
        count("--warmup", self.warmup, 0, MAX_STEPS)?;
        count("--eval-every", self.eval_every, 1, MAX_STEPS)?;
        check_learning_rate(self.lr).map_err(|e| format!("--lr {e}"))?;
        check_weight_decay(self.weight_decay).map_err(|e| format!("--weight-decay {e}"))?;
        Ok(())
    }
}

/// Which corpus a run trains on: the file, and its tokens' count and hash (the same file
/// tokenized another way, or edited, has another hash).
#[derive(Clone, Debug, PartialEq)]
pub struct DataPrint {
    pub path: PathBuf,
    pub tokens: u64,
    pub hash: String,
}

impl DataPrint {
    /// Whether `other` is the same corpus (wherever its file now is).
    pub fn same_corpus(&self, other: &DataPrint) -> bool {
        self.tokens == other.tokens && self.hash == other.hash
    }
}

/// A run's last checkpoint: its options, model and corpus, the steps done and the batch
/// generator's state after them. The weights and AdamW's moments of that step are in
/// [`State::weights`] and [`State::optimizer`].
#[derive(Clone, Debug, PartialEq)]
pub struct State {
    pub options: Options,
    pub step: u64,
    pub rng: Rng,
    /// The model's TOML, without `weights`.
    pub model: String,
    pub data: DataPrint,
}

/// One evaluation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Metrics {
    pub step: u64,
    /// The mean training loss of the steps since the evaluation before.
    pub train_loss: f64,
    pub val_loss: f64,
    pub tokens_per_s: f64,
    pub elapsed_s: f64,
}

/// One optimizer step: its training loss and learning rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepLoss {
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
}

/// A record of a log file: one JSON object per line, with a `step`.
pub trait Record: Sized + Copy {
    /// The log's file name.
    const FILE: &'static str;
    fn step(&self) -> u64;
    fn to_json(self) -> String;
    fn from_json(v: &Value) -> Option<Self>;
}

impl Record for Metrics {
    const FILE: &'static str = "metrics.jsonl";

    fn step(&self) -> u64 {
        self.step
    }

    fn to_json(self) -> String {
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

impl Record for StepLoss {
    const FILE: &'static str = "steps.jsonl";

    fn step(&self) -> u64 {
        self.step
    }

    fn to_json(self) -> String {
        json!({"step": self.step, "loss": self.loss, "lr": self.lr}).to_string()
    }

    fn from_json(v: &Value) -> Option<StepLoss> {
        Some(StepLoss {
            step: v["step"].as_u64()?,
            loss: v["loss"].as_f64()?,
            lr: v["lr"].as_f64()?,
        })
    }
}

/// Largest state.json or log read.
const MAX_BYTES: u64 = 1 << 30;

/// The format of state.json this attnc writes.
const FORMAT: u64 = 2;

impl State {
    /// The checkpoint's weights file.
    pub fn weights(&self) -> String {
        weights_file(self.step)
    }

    /// The checkpoint's AdamW moments.
    pub fn optimizer(&self) -> String {
        optimizer_file(self.step)
    }

    pub fn to_json(&self) -> String {
        let o = &self.options;
        let state = json!({
            "format": FORMAT,
            "step": self.step,
            "rng": self.rng.state(),
            "weights": self.weights(),
            "optimizer": self.optimizer(),
            "model": self.model,
            "data": {
                "path": self.data.path.display().to_string(),
                "tokens": self.data.tokens,
                "hash": self.data.hash,
            },
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
                "pack": o.pack,
            },
        });
        serde_json::to_string_pretty(&state).expect("a JSON value prints")
    }

    /// `dir/state.json`, checked field by field, its options as the command line checks them;
    /// errors start with `flag`.
    pub fn read(dir: &Path, flag: &str) -> Result<State, String> {
        let path = dir.join("state.json");
        let bad = |what: &str| {
            format!(
                "error: {flag}: {}: {what}; expected the state.json attnc train writes",
                path.display()
            )
        };
        let text = attn::runtime::files::read_text(&path, MAX_BYTES, "the run's state")
            .map_err(|e| format!("error: {flag}: {e}"))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| bad(&format!("not JSON ({e})")))?;
        if v["format"].as_u64() != Some(FORMAT) {
            return Err(bad(&format!("`format` is {}, not {FORMAT}", v["format"])));
        }
        let o = &v["options"];
        let uint = |v: &Value, k: &str| {
            v[k].as_u64()
                .ok_or_else(|| bad(&format!("`{k}` is missing or not a count")))
        };
        let float = |k: &str| {
            o[k].as_f64()
                .ok_or_else(|| bad(&format!("`options.{k}` is missing or not a number")))
        };
        let size = |k: &str| {
            uint(o, k).and_then(|n| {
                usize::try_from(n).map_err(|_| bad(&format!("`options.{k}` = {n} is too large")))
            })
        };
        let string = |v: &Value, k: &str| {
            v[k].as_str()
                .map(str::to_string)
                .ok_or_else(|| bad(&format!("`{k}` is missing or not a string")))
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
            eval_every: uint(o, "eval_every")?,
            // Checkpoints from before packed training have no `pack`: they did not pack.
            pack: match &o["pack"] {
                Value::Null => None,
                Value::String(s) if !s.is_empty() => Some(s.clone()),
                _ => return Err(bad("`options.pack` is not a separator")),
            },
        };
        options
            .check()
            .map_err(|e| bad(&format!("its options are refused: {e}")))?;
        let data = &v["data"];
        let state = State {
            options,
            step: uint(&v, "step")?,
            rng: Rng::from_state(uint(&v, "rng")?)
                .ok_or_else(|| bad("`rng` is 0, which no generator reaches"))?,
            model: string(&v, "model")?,
            data: DataPrint {
                path: PathBuf::from(string(data, "path")?),
                tokens: uint(data, "tokens")?,
                hash: string(data, "hash")?,
            },
        };
        if state.step == 0 || state.step > MAX_STEPS {
            return Err(bad(&format!("`step` {} is out of range", state.step)));
        }
        for (key, expected) in [
            ("weights", state.weights()),
            ("optimizer", state.optimizer()),
        ] {
            if v[key].as_str() != Some(expected.as_str()) {
                return Err(bad(&format!(
                    "`{key}` is {}, not {expected:?} of step {}",
                    v[key], state.step
                )));
            }
        }
        Ok(state)
    }
}

/// The weights file of step `step`.
pub fn weights_file(step: u64) -> String {
    format!("model-{step}.safetensors")
}

/// AdamW's moments at step `step`.
pub fn optimizer_file(step: u64) -> String {
    format!("optimizer-{step}.safetensors")
}

/// The step of a checkpoint file's name (`model-40.safetensors`, `optimizer-40.safetensors`).
pub fn checkpoint_step(name: &str) -> Option<u64> {
    let rest = name
        .strip_prefix("model-")
        .or_else(|| name.strip_prefix("optimizer-"))?;
    let digits = rest.strip_suffix(".safetensors")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The records of the log `R::FILE` in `dir` up to step `up_to`, which the last of them must
/// be (a checkpoint is written after its evaluation and its steps). Lines past `up_to` are
/// those of a checkpoint a kill interrupted, and a last line without its end is a write the
/// kill cut short: both are dropped.
pub fn read_log<R: Record>(dir: &Path, up_to: u64, flag: &str) -> Result<Vec<R>, String> {
    let path = dir.join(R::FILE);
    let text = attn::runtime::files::read_text(&path, MAX_BYTES, "the run's log")
        .map_err(|e| format!("error: {flag}: {e}"))?;
    let complete = match text.rfind('\n') {
        Some(end) => &text[..=end],
        None => "",
    };
    let mut records: Vec<R> = Vec::new();
    for (i, line) in complete.lines().enumerate() {
        let record = serde_json::from_str::<Value>(line)
            .ok()
            .as_ref()
            .and_then(R::from_json)
            .ok_or_else(|| {
                format!(
                    "error: {flag}: {} line {}: not a record attnc train writes: {}",
                    path.display(),
                    i + 1,
                    line.chars().take(200).collect::<String>()
                )
            })?;
        if record.step() > up_to {
            break;
        }
        if records.last().is_some_and(|r| r.step() >= record.step()) {
            return Err(format!(
                "error: {flag}: {} line {}: step {} does not follow step {}",
                path.display(),
                i + 1,
                record.step(),
                records.last().map_or(0, |r| r.step())
            ));
        }
        records.push(record);
    }
    if records.last().map(|r| r.step()) != Some(up_to) {
        return Err(format!(
            "error: {flag}: {} has no record of step {up_to}, the run's last checkpoint; it was \
             edited or cut short, so the run cannot continue as it would have",
            path.display()
        ));
    }
    Ok(records)
}

/// `records` as the lines of their log.
pub fn log_lines<R: Record>(records: &[R]) -> String {
    records.iter().map(|r| r.to_json() + "\n").collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> Options {
        Options {
            tokenizer: None,
            steps: 10,
            batch: 2,
            seq: 16,
            lr: 3e-3,
            warmup: 2,
            weight_decay: 0.1,
            seed: 1,
            eval_every: 5,
            pack: None,
        }
    }

    #[test]
    fn options_out_of_range_are_refused_by_flag() {
        assert!(options().check().is_ok());
        for (o, flag) in [
            (
                Options {
                    lr: -1.0,
                    ..options()
                },
                "--lr",
            ),
            (
                Options {
                    lr: f64::NAN,
                    ..options()
                },
                "--lr",
            ),
            (
                Options {
                    weight_decay: -0.1,
                    ..options()
                },
                "--weight-decay",
            ),
            (
                Options {
                    batch: 65_536,
                    ..options()
                },
                "--batch",
            ),
            (
                Options {
                    seq: 0,
                    ..options()
                },
                "--seq",
            ),
            (
                Options {
                    steps: MAX_STEPS + 1,
                    ..options()
                },
                "--steps",
            ),
            (
                Options {
                    eval_every: 0,
                    ..options()
                },
                "--eval-every",
            ),
        ] {
            let e = o.check().unwrap_err();
            assert!(e.starts_with(flag), "{flag}: {e}");
        }
    }

    #[test]
    fn checkpoint_names_give_their_step() {
        assert_eq!(checkpoint_step(&weights_file(40)), Some(40));
        assert_eq!(checkpoint_step(&optimizer_file(7)), Some(7));
        for other in [
            "model.safetensors",
            "model-.safetensors",
            "model-4x.safetensors",
            "model-40.safetensors.partial",
            "config-40.safetensors",
        ] {
            assert_eq!(checkpoint_step(other), None, "{other}");
        }
    }
}
