//! A run's checkpoints, written so that a kill at any moment leaves the last whole one.
//!
//! A run folder holds:
//! - `attnc-run.json`: the marker, locked while a process writes the folder ([`Folder`]);
//! - `state.json`: the record of the last checkpoint ([`State`]): written last, by a rename, it
//!   is what makes a checkpoint count;
//! - `model-N.safetensors` and `optimizer-N.safetensors`: the weights and AdamW's moments at
//!   step N, the step `state.json` names (those of other steps are debris of an interrupted
//!   checkpoint, or of the one before it, and are removed);
//! - `model.toml`: the model with `weights = "model-N.safetensors"`, for `attnc generate`;
//! - `metrics.jsonl` and `steps.jsonl`: one line per evaluation and per step, appended before
//!   the record; lines past its step are dropped when the run resumes;
//! - `loss.svg`: the loss curves.

use super::folder::Folder;
use super::state::{Metrics, Record, State, StepLoss, checkpoint_step, log_lines, read_log};
use std::path::Path;

/// The files of a run besides its marker and checkpoint files.
pub const RUN_FILES: [&str; 5] = [
    "state.json",
    "model.toml",
    "metrics.jsonl",
    "steps.jsonl",
    "loss.svg",
];

/// A checkpoint read back: its record and the run's logs up to it.
pub struct Saved {
    pub state: State,
    pub metrics: Vec<Metrics>,
    pub losses: Vec<StepLoss>,
}

/// What one checkpoint writes besides its record.
pub struct Writes<'a> {
    pub weights: &'a dyn Fn(&Path) -> Result<(), String>,
    pub optimizer: &'a dyn Fn(&Path) -> Result<(), String>,
    /// The steps since the checkpoint before, and this checkpoint's evaluation.
    pub losses: &'a [StepLoss],
    pub metrics: Metrics,
    /// The model's TOML naming the checkpoint's weights.
    pub model_toml: &'a str,
    /// The loss curves, as SVG text.
    pub plot: &'a dyn Fn() -> Result<String, String>,
}

/// Writes the checkpoint of `state` into `folder`: its weights and moments, the logs, then the
/// record, then what is made from it, and removes the checkpoint before.
pub fn write(folder: &Folder, state: &State, w: Writes) -> Result<(), String> {
    folder.write_with(&state.weights(), w.weights)?;
    folder.write_with(&state.optimizer(), w.optimizer)?;
    folder.append(StepLoss::FILE, &log_lines(w.losses))?;
    folder.append(Metrics::FILE, &log_lines(&[w.metrics]))?;
    folder.write("state.json", state.to_json().as_bytes())?;
    folder.write("model.toml", w.model_toml.as_bytes())?;
    folder.write("loss.svg", (w.plot)()?.as_bytes())?;
    remove_other_checkpoints(folder, state.step);
    Ok(())
}

/// The last checkpoint in `folder`, its files checked; the logs are cut back to it and what
/// an interrupted checkpoint left is removed. `flag` names the folder's option in errors.
pub fn restore(folder: &Folder, flag: &str) -> Result<Saved, String> {
    let dir = folder.path();
    if !exists(folder) {
        return Err(format!(
            "error: {flag} {}: the run holds no checkpoint yet (it stopped before its first \
             evaluation); start it again with --out {}",
            dir.display(),
            dir.display()
        ));
    }
    let state = State::read(dir, flag)?;
    for name in [state.weights(), state.optimizer()] {
        if !dir.join(&name).is_file() {
            return Err(format!(
                "error: {flag} {}: the last checkpoint's {name} is missing; the run cannot \
                 continue",
                dir.display()
            ));
        }
    }
    let metrics: Vec<Metrics> = read_log(dir, state.step, flag)?;
    let losses: Vec<StepLoss> = read_log(dir, state.step, flag)?;
    folder.write(Metrics::FILE, log_lines(&metrics).as_bytes())?;
    folder.write(StepLoss::FILE, log_lines(&losses).as_bytes())?;
    // A kill after the record can leave the plot a checkpoint behind.
    let plot = super::plot::loss_curves(&metrics, &losses, state.options.eval_every)?;
    folder.write("loss.svg", plot.as_bytes())?;
    folder.remove_partials();
    remove_other_checkpoints(folder, state.step);
    Ok(Saved {
        state,
        metrics,
        losses,
    })
}

/// Whether `folder` holds a checkpoint.
pub fn exists(folder: &Folder) -> bool {
    folder.path().join("state.json").exists()
}

/// Removes what a run that never finished its first checkpoint left, for a new run.
pub fn clear(folder: &Folder) {
    folder.remove_partials();
    remove_other_checkpoints(folder, 0);
    for name in RUN_FILES {
        folder.remove(name);
    }
}

/// Removes the weights and moments of every step but `keep`.
fn remove_other_checkpoints(folder: &Folder, keep: u64) {
    for name in folder.entries() {
        if checkpoint_step(&name).is_some_and(|step| step != keep) {
            folder.remove(&name);
        }
    }
}
