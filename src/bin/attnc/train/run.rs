//! The training loop: batches, AdamW steps with the schedule and clipping, evaluations and
//! checkpoints; a run started afresh, from trained weights, or resumed from its folder.

use super::checkpoint::{self, Saved, Writes};
use super::corpus::{self, Corpus, Rng};
use super::folder::{Folder, Kind};
use super::optimizer::AdamW;
use super::ranks::Ranks;
use super::state::{Metrics, Options, State, StepLoss};
use super::{Args, DEFAULT_LR, DEFAULT_STEPS, Training};
use attn::candle::core::{DType, Device, Tensor, Var};
use attn::candle::nn::{VarBuilder, VarMap, loss};
use attn::candle::{CandleModel, message};
use attn::research;
use attn::runtime::model::ModelConfig;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Validation batches per evaluation (always the same windows: a fixed generator).
const EVAL_BATCHES: usize = 8;
/// Gradients are scaled down to this global norm when larger.
const CLIP_NORM: f64 = 1.0;

/// Trains as `args` say: in this process, or as one of its data-parallel ranks.
pub fn train(args: Args) -> Result<(), String> {
    super::ranks::with_ranks(args.ranks, |ranks| train_as(&args, ranks))
}

/// Trains as rank `ranks` (or alone): rank 0 claims the folder and writes the run; the other
/// ranks read the same model, corpus and checkpoint, and take their part of every batch.
fn train_as(args: &Args, ranks: Option<Ranks>) -> Result<(), String> {
    let root = ranks.as_ref().is_none_or(Ranks::is_root);
    let context = args.context_parallel.is_some();
    if let Some(r) = &ranks
        && args.resume.is_none()
        && !context
    {
        // A new run's batch is checked before its folder is claimed; a resumed run's below.
        super::ranks::check_batch_splits(args.training.batch as usize, r)?;
    }
    let prepared = match &args.resume {
        Some(dir) => resume(args, dir, root),
        None => start(args, root),
    };
    if let Some(r) = &ranks
        && !r.all_ok(prepared.is_ok())?
    {
        prepared?;
        return Err("error: another rank could not start the run (its error is above)".into());
    }
    let (run, corpus) = prepared?;
    let ranks = match (ranks, args.context_parallel) {
        (Some(r), None) => {
            super::ranks::check_batch_splits(run.options.batch, &r)?;
            Some(r)
        }
        (ranks, Some(n)) => Some(super::context::split_sequences(
            ranks,
            (n, &args.scheme),
            &run.config.attention,
            &run.options,
        )?),
        (None, None) => None,
    };
    let out = run.dir.clone();
    let vocab = run.config.vocab;
    let metrics = run.train_ranked(&corpus, "", ranks)?;
    if !root {
        return Ok(());
    }
    if let Some(last) = metrics.last() {
        say!(
            "validation loss {:.4} against the unigram model's {:.4}",
            last.val_loss,
            corpus.unigram_loss(vocab)
        );
    }
    say!(
        "wrote {}: model.toml (attnc generate --model {}), metrics.jsonl, steps.jsonl, loss.svg",
        out.display(),
        out.join("model.toml").display()
    );
    Ok(())
}

/// The options of a new run from the command line's, with the given seed; the tokenizer's
/// path made absolute, so that a resumed run finds it from any folder.
pub fn options(training: &Training, seed: u64) -> Options {
    Options {
        tokenizer: training
            .tokenizer
            .as_ref()
            .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone())),
        steps: training.steps.unwrap_or(DEFAULT_STEPS),
        batch: training.batch as usize,
        seq: training.seq as usize,
        lr: training.lr.unwrap_or(DEFAULT_LR),
        warmup: training.warmup,
        weight_decay: training.weight_decay,
        seed,
        eval_every: training.eval_every,
        pack: training.pack.clone(),
    }
}

/// Where a run starts: random weights of its seed, trained weights, or a checkpoint.
pub enum Start {
    Seeded,
    Weights(PathBuf),
    Checkpoint(Box<Saved>),
}

/// A run ready to train: its folder (held, by the rank that writes it), model (its config, and
/// its TOML as written, without `weights`), options and where it starts.
pub struct Run {
    /// The run's folder, claimed; `None` on data-parallel ranks other than 0.
    pub folder: Option<Folder>,
    /// The folder's path.
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub model_toml: String,
    pub options: Options,
    pub start: Start,
}

/// A new run: `--model` into `--out`, which must be new, empty, or a run folder of ours that
/// holds no checkpoint. Only with `claim` is the folder claimed (rank 0 of data-parallel
/// ranks); the other ranks read the same model and corpus.
fn start(args: &Args, claim: bool) -> Result<(Run, Corpus), String> {
    let (Some(model), Some(out), Some(data)) = (&args.model, &args.out, &args.data) else {
        return Err("error: --model, --data and --out are needed (or --resume DIR)".into());
    };
    let text = attn::runtime::files::read_text(model, research::MAX_TOML_BYTES, "the model config")
        .map_err(|e| format!("error: --model: {e}"))?;
    let config = research::config_from_toml(&text)
        .map_err(|e| format!("error: --model {}: {e}", model.display()))?;
    let start = match research::weights_file(&text)
        .map_err(|e| format!("error: --model {}: {e}", model.display()))?
    {
        Some(file) => Start::Weights(model.parent().unwrap_or(Path::new(".")).join(file)),
        None => Start::Seeded,
    };
    let options = options(&args.training, args.training.seed);
    check_fits(&config, &options)?;
    let corpus = corpus::read(
        data,
        options.tokenizer.as_deref(),
        config.vocab,
        options.seq,
        options.pack.as_deref(),
    )?;
    let model_toml =
        research::with_weights(&text, None).map_err(|e| format!("error: --model: {e}"))?;
    if !claim {
        let dir = out.clone();
        return Ok((
            run_of(None, dir, config, model_toml, options, start),
            corpus,
        ));
    }
    let folder = Folder::claim(out, Kind::Run, "--out")?;
    if checkpoint::exists(&folder) {
        let step =
            State::read(out, "--out").map_or("a".to_string(), |s| format!("step {}", s.step));
        return Err(format!(
            "error: --out {}: it holds a run (its checkpoint is at {step}); continue it with \
             --resume {} (with --steps to train further), or give another --out",
            out.display(),
            out.display()
        ));
    }
    let inputs: Vec<&Path> = [model.as_path(), data.as_path()]
        .into_iter()
        .chain(options.tokenizer.as_deref())
        .collect();
    for name in checkpoint::RUN_FILES {
        crate::outputs::check(&out.join(name), &inputs, "--out")?;
    }
    checkpoint::clear(&folder);
    let dir = out.clone();
    Ok((
        run_of(Some(folder), dir, config, model_toml, options, start),
        corpus,
    ))
}

/// A [`Run`] of its parts.
fn run_of(
    folder: Option<Folder>,
    dir: PathBuf,
    config: ModelConfig,
    model_toml: String,
    options: Options,
    start: Start,
) -> Run {
    Run {
        folder,
        dir,
        config,
        model_toml,
        options,
        start,
    }
}

/// The run in `dir` from its last checkpoint, with its own options (`--steps` and `--lr` may
/// change) and corpus (`--data` may name where it is now; its tokens must be the same). Only
/// with `claim` is the folder opened for writing (rank 0 of data-parallel ranks); the other
/// ranks read its checkpoint.
fn resume(args: &Args, dir: &Path, claim: bool) -> Result<(Run, Corpus), String> {
    let folder = if claim {
        Some(Folder::open(dir, Kind::Run, "--resume")?)
    } else {
        None
    };
    let saved = match &folder {
        Some(folder) => checkpoint::restore(folder, "--resume")?,
        None => Saved {
            state: State::read(dir, "--resume")?,
            metrics: Vec::new(),
            losses: Vec::new(),
        },
    };
    let mut options = saved.state.options.clone();
    if let Some(steps) = args.training.steps {
        options.steps = steps;
    }
    if let Some(lr) = args.training.lr
        && lr != options.lr
        && claim
    {
        say!(
            "the peak learning rate is {lr} from step {} on (it was {})",
            saved.state.step + 1,
            options.lr
        );
        options.lr = lr;
    }
    let config = research::config_from_toml(&saved.state.model)
        .map_err(|e| format!("error: --resume {}: state.json's model: {e}", dir.display()))?;
    check_fits(&config, &options)?;
    let data = args.data.clone().unwrap_or(saved.state.data.path.clone());
    let corpus = corpus::read(
        &data,
        options.tokenizer.as_deref(),
        config.vocab,
        options.seq,
        options.pack.as_deref(),
    )?;
    check_same_corpus(&saved.state, &corpus, &data)?;
    // A kill between the record and the model's TOML leaves the TOML a checkpoint behind.
    let model_toml = saved.state.model.clone();
    let toml = research::with_weights(&model_toml, Some(&saved.state.weights()))
        .map_err(|e| format!("error: --resume: state.json's model: {e}"))?;
    if let Some(folder) = &folder {
        folder.write("model.toml", toml.as_bytes())?;
    }
    let start = Start::Checkpoint(Box::new(saved));
    let run = run_of(
        folder,
        dir.to_path_buf(),
        config,
        model_toml,
        options,
        start,
    );
    Ok((run, corpus))
}

/// Refuses to continue a run on a corpus other than the one it trained on.
pub fn check_same_corpus(state: &State, corpus: &Corpus, data: &Path) -> Result<(), String> {
    if state.data.same_corpus(&corpus.print) {
        return Ok(());
    }
    Err(format!(
        "error: --data {}: the run trained on another corpus ({}, {} tokens, hash {}); this one \
         has {} tokens, hash {}. Continue it on the same text, or start a new run",
        data.display(),
        state.data.path.display(),
        state.data.tokens,
        state.data.hash,
        corpus.print.tokens,
        corpus.print.hash
    ))
}

/// Refuses a batch whose activations would not fit: the logits and their gradient, and per
/// layer about 16 hidden-wide and 6 MLP-wide f32 values per token kept for the backward; in a
/// mixture-of-experts layer, the MLP's values for each of the `top_k` experts a token runs,
/// its shared expert's and the router's logits.
pub fn check_fits(config: &ModelConfig, o: &Options) -> Result<(), String> {
    let tokens = (o.batch as u64).checked_mul(o.seq as u64);
    let c = |v: usize| v as u64;
    let per_layer = (0..config.layers).try_fold(0u64, |sum, layer| {
        let mlp = match config.moe.as_ref().filter(|m| m.sparse[layer]) {
            Some(moe) => c(moe.top_k)
                .checked_mul(6 * c(moe.intermediate) + 2 * c(config.hidden))?
                .checked_add(6 * c(moe.shared.map_or(0, |s| s.width)))?
                .checked_add(3 * c(moe.experts))?,
            None => 6 * c(config.intermediate),
        };
        sum.checked_add(16 * c(config.hidden))?.checked_add(mlp)
    });
    let bytes = per_layer
        .and_then(|l| l.checked_add(3 * c(config.vocab)))
        .zip(tokens)
        .and_then(|(per_token, tokens)| per_token.checked_mul(tokens))
        .and_then(|v| v.checked_mul(4));
    attn::runtime::memory::ensure_fits("a training step's activations", bytes)
        .map_err(|e| format!("error: --batch {} --seq {}: {e}", o.batch, o.seq))
}

/// The steps since the last evaluation: their losses and how long they took.
struct Window {
    losses: Vec<StepLoss>,
    start: Instant,
}

impl Window {
    fn new() -> Window {
        Window {
            losses: Vec::new(),
            start: Instant::now(),
        }
    }

    fn mean_loss(&self) -> f64 {
        self.losses.iter().map(|l| l.loss).sum::<f64>() / self.losses.len() as f64
    }

    fn tokens_per_s(&self, tokens_per_step: usize) -> f64 {
        (self.losses.len() * tokens_per_step) as f64 / self.start.elapsed().as_secs_f64()
    }
}

impl Run {
    /// Trains to the last step with `label` in front of its progress lines; returns every
    /// evaluation of the run.
    pub fn train(self, corpus: &Corpus, label: &str) -> Result<Vec<Metrics>, String> {
        self.train_ranked(corpus, label, None)
    }

    /// [`Run::train`] as one of data-parallel `ranks`.
    pub fn train_ranked(
        self,
        corpus: &Corpus,
        label: &str,
        ranks: Option<Ranks>,
    ) -> Result<Vec<Metrics>, String> {
        // Each step frees and allocates the same tensors: keep the memory rather than fault it
        // in again.
        attn::runtime::memory::keep_freed_memory();
        Trainer::new(self, corpus, ranks)?.run(corpus, label)
    }
}

struct Trainer {
    /// The data-parallel ranks this trainer is one of.
    ranks: Option<Ranks>,
    config: ModelConfig,
    options: Options,
    /// The run's folder: `None` on data-parallel ranks other than 0, which write nothing.
    folder: Option<Folder>,
    dir: PathBuf,
    /// The model's TOML, without `weights`.
    model_toml: String,
    data: super::state::DataPrint,
    varmap: VarMap,
    model: CandleModel,
    adamw: AdamW,
    step: u64,
    rng: Rng,
    metrics: Vec<Metrics>,
    losses: Vec<StepLoss>,
}

impl Trainer {
    fn new(run: Run, corpus: &Corpus, ranks: Option<Ranks>) -> Result<Trainer, String> {
        let candle = |e: attn::candle::core::Error| format!("error: {}", message(&e));
        let mut varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let mut model = CandleModel::new(&run.config, vb).map_err(candle)?;
        model.set_context(ranks.as_ref().and_then(Ranks::context));
        let vars = sorted_vars(&varmap);
        // Weight decay on the matrices only, not on norms and biases.
        let decay = run.options.weight_decay;
        let mut adamw = AdamW::new(
            vars.into_iter()
                .map(|(name, v)| {
                    let d = if v.rank() >= 2 { decay } else { 0.0 };
                    (name, v, d)
                })
                .collect(),
        )
        .map_err(candle)?;
        let dir = run.dir.clone();
        let (step, rng, metrics, losses) = match run.start {
            Start::Seeded => {
                CandleModel::seed_weights(&varmap, run.options.seed).map_err(candle)?;
                (0, Rng::new(run.options.seed), Vec::new(), Vec::new())
            }
            Start::Weights(file) => {
                varmap.load(&file).map_err(|e| {
                    format!(
                        "error: --model: weights {}: {}",
                        file.display(),
                        message(&e)
                    )
                })?;
                if ranks.as_ref().is_none_or(Ranks::is_root) {
                    say!("starting from the weights in {}", file.display());
                }
                (0, Rng::new(run.options.seed), Vec::new(), Vec::new())
            }
            Start::Checkpoint(saved) => {
                let s = &saved.state;
                let weights = dir.join(s.weights());
                varmap.load(&weights).map_err(|e| {
                    format!("error: --resume: {}: {}", weights.display(), message(&e))
                })?;
                let moments = dir.join(s.optimizer());
                adamw.load(&moments, s.step).map_err(|e| {
                    format!("error: --resume: {}: {}", moments.display(), message(&e))
                })?;
                (s.step, s.rng, saved.metrics, saved.losses)
            }
        };
        Ok(Trainer {
            ranks,
            dir,
            model_toml: run.model_toml,
            config: run.config,
            options: run.options,
            folder: run.folder,
            data: corpus.print.clone(),
            varmap,
            model,
            adamw,
            step,
            rng,
            metrics,
            losses,
        })
    }

    fn run(mut self, corpus: &Corpus, label: &str) -> Result<Vec<Metrics>, String> {
        let label = if label.is_empty() {
            String::new()
        } else {
            format!("{label}: ")
        };
        let o = self.options.clone();
        if self.step >= o.steps {
            return Err(format!(
                "error: the run in {} has done {} steps already, as many as it was asked for; \
                 give a larger --steps to train further (at most {})",
                self.dir.display(),
                self.step,
                super::MAX_STEPS
            ));
        }
        if self.step == 0 {
            self.check_parameters(0)?;
        }
        let root = self.ranks.as_ref().is_none_or(Ranks::is_root);
        if root {
            self.announce(corpus, &label);
        }
        let bar = match root {
            true => self.progress_bar(),
            false => ProgressBar::hidden(),
        };
        let started = Instant::now();
        let elapsed_before = self.metrics.last().map_or(0.0, |m| m.elapsed_s);
        let mut window = Window::new();
        while self.step < o.steps {
            let step = self.step + 1;
            let lr = super::schedule::learning_rate(step, o.steps, o.warmup, o.lr);
            let loss = match self.train_step(corpus, step, lr) {
                Ok(loss) => loss,
                Err(e) => {
                    bar.abandon();
                    return Err(e);
                }
            };
            self.step = step;
            window.losses.push(StepLoss { step, loss, lr });
            let tokens_per_s = window.tokens_per_s(o.batch * o.seq);
            bar.set_message(format!("loss {loss:.3}, {tokens_per_s:.0} tokens/s"));
            bar.inc(1);
            if step.is_multiple_of(o.eval_every) || step == o.steps {
                let val_loss = self.validation_loss(corpus)?;
                if !val_loss.is_finite() {
                    bar.abandon();
                    return Err(self.diverged(&format!("the validation loss is {val_loss}")));
                }
                let metrics = Metrics {
                    step,
                    train_loss: window.mean_loss(),
                    val_loss,
                    tokens_per_s,
                    elapsed_s: elapsed_before + started.elapsed().as_secs_f64(),
                };
                let line = format!(
                    "{label}step {step}: train loss {:.4} (mean of steps {}-{step}), validation \
                     loss {:.4}, {:.0} tokens/s",
                    metrics.train_loss,
                    window.losses[0].step,
                    metrics.val_loss,
                    metrics.tokens_per_s
                );
                if root {
                    bar.suspend(|| println!("{line}"));
                }
                if let Err(e) = self.checkpoint(&window.losses, metrics) {
                    bar.abandon();
                    return Err(e);
                }
                window = Window::new();
            }
        }
        bar.finish();
        Ok(self.metrics)
    }

    /// The line that opens a run: the model, its size, the data and the steps ahead.
    fn announce(&self, corpus: &Corpus, label: &str) {
        say!(
            "{label}training {} ({} parameters) on {} tokens ({} for validation, where a unigram \
             model scores {:.4}), from step {} to {}",
            self.config.attention_summary(),
            self.parameter_count(),
            corpus.train.len() + corpus.validation.len(),
            corpus.validation.len(),
            corpus.unigram_loss(self.config.vocab),
            self.step,
            self.options.steps
        );
        if let (Some(sep), Some((train, validation))) = (&self.options.pack, &corpus.documents) {
            say!(
                "{label}packed: {} documents ending with {sep:?} ({} in the validation set); \
                 each window's tokens attend within their own document",
                train.len() + validation.len() + 2,
                validation.len() + 1
            );
        }
        let unmasked = |s: &attn::AttentionSpec| s.mask == attn::Mask::None && s.mask_mod.is_none();
        if self.config.attention.iter().any(unmasked) {
            say!(
                "{label}warning: an attention kind has mask = none, so each position also sees \
                 the tokens after it, the next one among them: its loss is not a language \
                 model's"
            );
        }
    }

    fn progress_bar(&self) -> ProgressBar {
        let bar = ProgressBar::new(self.options.steps);
        bar.set_position(self.step);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} steps {elapsed} {msg}")
                .expect("a fixed, valid template"),
        );
        bar
    }

    /// The error of a run that stops at step `self.step + 1` because of `what`, naming the
    /// last good checkpoint, which is left as it was.
    fn diverged(&self, what: &str) -> String {
        let (last, advice) = match self.metrics.last() {
            Some(m) => (
                format!("step {}", m.step),
                format!(
                    " (continue from it with a lower learning rate: --resume {} --lr {})",
                    self.dir.display(),
                    // Three significant digits: 0.0003, not 0.00030000000000000003.
                    format!("{:.2e}", self.options.lr / 10.0)
                        .parse::<f64>()
                        .unwrap_or(self.options.lr / 10.0)
                ),
            ),
            None => (
                "none yet".to_string(),
                " (start again with a lower --lr)".into(),
            ),
        };
        format!(
            "error: {what}; the last good checkpoint in {} is {last}{advice}",
            self.dir.display()
        )
    }

    /// One optimizer step at `step` (from 1) with learning rate `lr`; returns its training loss.
    /// A loss or gradient that is not finite stops the run before the weights change.
    fn train_step(&mut self, corpus: &Corpus, step: u64, lr: f64) -> Result<f64, String> {
        let o = &self.options;
        let candle = |e: attn::candle::core::Error| format!("error: step {step}: {}", message(&e));
        let documents = corpus.documents.as_ref().map(|d| d.0.as_slice());
        let windows = corpus::windows(&corpus.train, documents, o.batch, o.seq, &mut self.rng);
        let loss = self
            .part(windows)
            .and_then(|batch| self.loss(&batch))
            .map_err(candle)?;
        let mut value = f64::from(loss.to_scalar::<f32>().map_err(candle)?);
        if let Some(r) = &self.ranks {
            value = r.mean(value)?;
        }
        if !value.is_finite() {
            self.check_parameters(step)?;
            return Err(self.diverged(&format!("the training loss is {value} at step {step}")));
        }
        let mut grads = loss.backward().map_err(candle)?;
        let vars = self.named_vars();
        if let Some(r) = &self.ranks {
            r.average(&mut grads, &vars)?;
        }
        let mut squares = 0.0;
        for (name, var) in &vars {
            if let Some(g) = grads.get(var) {
                let sum = f64::from(
                    g.sqr()
                        .and_then(|s| s.sum_all())
                        .and_then(|s| s.to_scalar::<f32>())
                        .map_err(candle)?,
                );
                if !sum.is_finite() {
                    return Err(self.diverged(&format!(
                        "the gradient of {name} is not finite at step {step}"
                    )));
                }
                squares += sum;
            }
        }
        let norm = squares.sqrt();
        if norm > CLIP_NORM {
            for (_, var) in &vars {
                if let Some(g) = grads.remove(var) {
                    grads.insert(var, (g * (CLIP_NORM / norm)).map_err(candle)?);
                }
            }
        }
        self.adamw.step(&grads, lr).map_err(candle)?;
        Ok(value)
    }

    /// This rank's inputs and targets (`[B', S']` each) of a batch of windows `[B, seq + 1]`
    /// (all of it without ranks), and their document ids.
    fn part(
        &self,
        (windows, documents): (Tensor, Option<Tensor>),
    ) -> attn::candle::core::Result<Batch> {
        let seq = self.options.seq;
        let [inputs, targets] = match &self.ranks {
            Some(r) => r.part(&windows, seq)?,
            None => [windows.narrow(1, 0, seq)?, windows.narrow(1, 1, seq)?],
        };
        // Context-parallel ranks read the whole windows' document ids (their attention meets
        // every position); data-parallel ranks their own windows'.
        let documents = match (documents, &self.ranks) {
            (Some(d), Some(r)) if !r.splits_sequences() => Some(r.part(&d, seq)?[0].clone()),
            (Some(d), _) => Some(d.narrow(1, 0, seq)?),
            (None, _) => None,
        };
        Ok(Batch {
            inputs,
            targets,
            documents,
        })
    }

    /// The model's variables by name, in name order.
    fn named_vars(&self) -> Vec<(String, Var)> {
        sorted_vars(&self.varmap)
    }

    /// Stops the run at `step` when a parameter holds a value that is not finite, naming it.
    fn check_parameters(&self, step: u64) -> Result<(), String> {
        for (name, var) in self.named_vars() {
            let values = var
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|e| format!("error: {name}: {}", message(&e)))?;
            if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                let when = if step == 0 {
                    "before the first step".to_string()
                } else {
                    format!("at step {step}")
                };
                return Err(self.diverged(&format!(
                    "parameter {name} holds {v} (at flat index {i}) {when}"
                )));
            }
        }
        Ok(())
    }

    /// Mean next-token cross-entropy of a batch.
    fn loss(&self, batch: &Batch) -> attn::candle::core::Result<Tensor> {
        let logits = match &batch.documents {
            Some(d) => self.model.forward_documents(&batch.inputs, d)?,
            None => self.model.forward(&batch.inputs)?,
        };
        let targets = batch.targets.flatten_all()?;
        loss::cross_entropy(&logits.reshape(((), self.config.vocab))?, &targets)
    }

    /// The mean loss over the same validation windows at every evaluation.
    fn validation_loss(&self, corpus: &Corpus) -> Result<f64, String> {
        let mut rng = Rng::new(self.options.seed ^ 0x5EED_0FDA_7A00);
        let mut total = 0.0;
        for _ in 0..EVAL_BATCHES {
            let windows = corpus::windows(
                &corpus.validation,
                corpus.documents.as_ref().map(|d| d.1.as_slice()),
                self.options.batch,
                self.options.seq,
                &mut rng,
            );
            let loss = self
                .part(windows)
                .and_then(|w| self.loss(&w))
                .and_then(|l| l.to_scalar::<f32>())
                .map_err(|e| format!("error: validation: {}", message(&e)))?;
            total += match &self.ranks {
                Some(r) => r.mean(f64::from(loss))?,
                None => f64::from(loss),
            };
        }
        Ok(total / EVAL_BATCHES as f64)
    }

    /// Checks the parameters, then writes the checkpoint of this step with its evaluation and
    /// the steps since the one before.
    fn checkpoint(&mut self, steps: &[StepLoss], metrics: Metrics) -> Result<(), String> {
        self.check_parameters(self.step)?;
        self.metrics.push(metrics);
        self.losses.extend_from_slice(steps);
        let Some(folder) = &self.folder else {
            return Ok(());
        };
        let state = State {
            options: self.options.clone(),
            step: self.step,
            rng: self.rng,
            model: self.model_toml.clone(),
            data: self.data.clone(),
        };
        let model_toml = research::with_weights(&self.model_toml, Some(&state.weights()))
            .map_err(|e| format!("error: the model's TOML: {e}"))?;
        let out = |e: attn::candle::core::Error| message(&e);
        checkpoint::write(
            folder,
            &state,
            Writes {
                weights: &|path| self.varmap.save(path).map_err(out),
                optimizer: &|path| self.adamw.save(path).map_err(out),
                losses: steps,
                metrics,
                model_toml: &model_toml,
                plot: &|| {
                    super::plot::loss_curves(&self.metrics, &self.losses, self.options.eval_every)
                },
            },
        )
    }

    fn parameter_count(&self) -> usize {
        self.varmap.all_vars().iter().map(|v| v.elem_count()).sum()
    }
}

/// A step's token ids, `[B, S]` each: the inputs, the next token of each, and (packed
/// training) each input's document id.
struct Batch {
    inputs: Tensor,
    targets: Tensor,
    documents: Option<Tensor>,
}

/// The variables of `varmap` by name, in name order (a poisoned lock still holds them; nothing
/// here panics holding it).
fn sorted_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let data = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
    let mut vars: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}
