//! The training loop: batches, AdamW steps with the schedule and clipping, evaluations and
//! checkpoints.

use super::corpus::{self, Corpus, Rng};
use super::state::{Metrics, Options, State, read_metrics, write_atomically};
use super::{Args, DEFAULT_STEPS, Training};
use attn::candle::CandleModel;
use attn::candle::core::{DType, Device, Tensor, Var};
use attn::candle::nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap, loss};
use attn::research;
use attn::runtime::model::ModelConfig;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::time::Instant;

/// Validation batches per evaluation (always the same windows: a fixed generator).
const EVAL_BATCHES: usize = 8;
/// Gradients are scaled down to this global norm when larger.
const CLIP_NORM: f64 = 1.0;

/// The files a run writes into its folder.
const OUTPUTS: [&str; 5] = [
    "model.safetensors",
    "model.toml",
    "state.json",
    "metrics.jsonl",
    "loss.svg",
];

/// Trains as `args` say.
pub fn train(args: Args) -> Result<(), String> {
    let (config, options, out, resumed) = setup(&args)?;
    let config_vocab = config.vocab;
    let corpus = corpus::read(
        &args.data,
        options.tokenizer.as_deref(),
        config.vocab,
        options.seq,
    )?;
    check_fits(&config, &options)?;
    let inputs: Vec<&std::path::Path> = [args.model.as_deref(), Some(args.data.as_path())]
        .into_iter()
        .chain([options.tokenizer.as_deref()])
        .flatten()
        .collect();
    for name in OUTPUTS {
        crate::outputs::check(&out.join(name), &inputs)?;
    }
    std::fs::create_dir_all(&out).map_err(|e| {
        format!(
            "error: --out {}: cannot make the folder: {e}",
            out.display()
        )
    })?;
    write_atomically(&out, ".write-test", b"")?;
    std::fs::remove_file(out.join(".write-test")).ok();
    let metrics = train_in(config, options, out.clone(), resumed, &corpus, "")?;
    if let Some(last) = metrics.last() {
        eprintln!(
            "validation loss {:.4} against the unigram model's {:.4}",
            last.val_loss,
            corpus.unigram_loss(config_vocab)
        );
    }
    eprintln!(
        "wrote {}: model.toml (attnc generate --model {}), metrics.jsonl, loss.svg",
        out.display(),
        out.join("model.toml").display()
    );
    Ok(())
}

/// The options of a new run from the command line's, with the given seed.
pub fn options(training: &Training, seed: u64) -> Options {
    Options {
        tokenizer: training.tokenizer.clone(),
        steps: training.steps.unwrap_or(DEFAULT_STEPS),
        batch: training.batch as usize,
        seq: training.seq as usize,
        lr: training.lr,
        warmup: training.warmup,
        weight_decay: training.weight_decay,
        seed,
        eval_every: training.eval_every,
    }
}

/// Trains `config` in the folder `out` (which exists) from scratch or from `resumed`, with
/// `label` in front of its progress lines; returns every evaluation of the run.
pub fn train_in(
    config: ModelConfig,
    options: Options,
    out: PathBuf,
    resumed: Option<State>,
    corpus: &Corpus,
    label: &str,
) -> Result<Vec<Metrics>, String> {
    // Each step frees and allocates the same tensors: keep the memory rather than fault it in
    // again.
    attn::runtime::memory::keep_freed_memory();
    Trainer::new(config, options, out, resumed)?.run(corpus, label)
}

/// The config, options and folder of a new run, or of the one `--resume` names.
fn setup(args: &Args) -> Result<(ModelConfig, Options, PathBuf, Option<State>), String> {
    if let Some(dir) = &args.resume {
        let mut state = State::read(dir, "--resume")?;
        if let Some(steps) = args.training.steps {
            state.options.steps = steps;
        }
        let text = attn::runtime::files::read_text(
            &dir.join("model.toml"),
            research::MAX_TOML_BYTES,
            "the run's model",
        )
        .map_err(|e| format!("error: --resume: {e}"))?;
        let config =
            research::config_from_toml(&text).map_err(|e| format!("error: --resume: {e}"))?;
        return Ok((config, state.options.clone(), dir.clone(), Some(state)));
    }
    let (Some(model), Some(out)) = (&args.model, &args.out) else {
        return Err("error: --model and --out are needed (or --resume DIR)".into());
    };
    let text = attn::runtime::files::read_text(model, research::MAX_TOML_BYTES, "the model config")
        .map_err(|e| format!("error: --model: {e}"))?;
    let config = research::config_from_toml(&text)
        .map_err(|e| format!("error: --model {}: {e}", model.display()))?;
    let options = options(&args.training, args.training.seed);
    Ok((config, options, out.clone(), None))
}

/// Refuses a batch whose activations would not fit: the logits and their gradient, and per
/// layer about 16 hidden-wide and 6 MLP-wide f32 values per token, kept for the backward.
pub fn check_fits(config: &ModelConfig, o: &Options) -> Result<(), String> {
    let tokens = (o.batch * o.seq) as u64;
    let per_token = 3 * config.vocab as u64
        + config.layers as u64 * (16 * config.hidden as u64 + 6 * config.intermediate as u64);
    let bytes = tokens.checked_mul(per_token).and_then(|v| v.checked_mul(4));
    attn::runtime::memory::ensure_fits("a training step's activations", bytes)
        .map_err(|e| format!("error: --batch {} --seq {}: {e}", o.batch, o.seq))
}

/// The steps since the last evaluation: their losses and how long they took.
struct Window {
    loss: f64,
    steps: u64,
    start: Instant,
}

impl Window {
    fn new() -> Window {
        Window {
            loss: 0.0,
            steps: 0,
            start: Instant::now(),
        }
    }

    fn add(&mut self, loss: f64) {
        self.loss += loss;
        self.steps += 1;
    }

    fn mean_loss(&self) -> f64 {
        self.loss / self.steps as f64
    }

    fn tokens_per_s(&self, tokens_per_step: usize) -> f64 {
        (self.steps as usize * tokens_per_step) as f64 / self.start.elapsed().as_secs_f64()
    }
}

struct Trainer {
    config: ModelConfig,
    options: Options,
    out: PathBuf,
    varmap: VarMap,
    model: CandleModel,
    /// AdamW over the matrices (with weight decay) and over the vectors (norms, biases: none).
    optimizers: [AdamW; 2],
    step: u64,
    rng: Rng,
    metrics: Vec<Metrics>,
}

impl Trainer {
    fn new(
        config: ModelConfig,
        options: Options,
        out: PathBuf,
        resumed: Option<State>,
    ) -> Result<Trainer, String> {
        let candle = |e: attn::candle::core::Error| format!("error: {e}");
        let mut varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let model = CandleModel::new(&config, vb).map_err(candle)?;
        if resumed.is_none() {
            CandleModel::seed_weights(&varmap, options.seed).map_err(candle)?;
        }
        let (step, rng, metrics) = match &resumed {
            Some(state) => {
                varmap.load(out.join("model.safetensors")).map_err(|e| {
                    format!(
                        "error: --resume: {}: {e}",
                        out.join("model.safetensors").display()
                    )
                })?;
                (state.step, state.rng, read_metrics(&out, state.step)?)
            }
            None => (0, Rng::new(options.seed), Vec::new()),
        };
        let mut vars: Vec<(String, Var)> = varmap
            .data()
            .lock()
            .map_err(|_| "error: the model's variables are poisoned")?
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let (matrices, vectors): (Vec<_>, Vec<_>) = vars
            .into_iter()
            .map(|(_, v)| v)
            .partition(|v| v.rank() >= 2);
        let adamw = |vars: Vec<Var>, weight_decay: f64| {
            let params = ParamsAdamW {
                lr: options.lr,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay,
            };
            AdamW::new(vars, params).map_err(candle)
        };
        let optimizers = [adamw(matrices, options.weight_decay)?, adamw(vectors, 0.0)?];
        Ok(Trainer {
            config,
            options,
            out,
            varmap,
            model,
            optimizers,
            step,
            rng,
            metrics,
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
                 give --steps past {} to train further",
                self.out.display(),
                self.step,
                self.step
            ));
        }
        self.announce(corpus, &label);
        let bar = self.progress_bar();
        let started = Instant::now();
        let elapsed_before = self.metrics.last().map_or(0.0, |m| m.elapsed_s);
        let mut window = Window::new();
        while self.step < o.steps {
            let step = self.step + 1;
            let loss = self.train_step(corpus, step)?;
            if !loss.is_finite() {
                bar.abandon();
                return Err(self.diverged(loss, step));
            }
            self.step = step;
            window.add(loss);
            let tokens_per_s = window.tokens_per_s(o.batch * o.seq);
            bar.set_message(format!("loss {loss:.3}, {tokens_per_s:.0} tokens/s"));
            bar.inc(1);
            if step.is_multiple_of(o.eval_every) || step == o.steps {
                let metrics = Metrics {
                    step,
                    train_loss: window.mean_loss(),
                    val_loss: self.validation_loss(corpus)?,
                    tokens_per_s,
                    elapsed_s: elapsed_before + started.elapsed().as_secs_f64(),
                };
                let line = format!(
                    "{label}step {step}: train loss {:.4}, validation loss {:.4}, {:.0} tokens/s",
                    metrics.train_loss, metrics.val_loss, metrics.tokens_per_s
                );
                bar.suspend(|| println!("{line}"));
                self.metrics.push(metrics);
                self.checkpoint()?;
                window = Window::new();
            }
        }
        bar.finish();
        Ok(self.metrics)
    }

    /// The line that opens a run: the model, its size, the data and the steps ahead.
    fn announce(&self, corpus: &Corpus, label: &str) {
        eprintln!(
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

    /// The error of a loss that is not finite at `step`, naming the last good checkpoint.
    fn diverged(&self, loss: f64, step: u64) -> String {
        let last = self
            .metrics
            .last()
            .map_or("none yet".to_string(), |m| format!("step {}", m.step));
        format!(
            "error: the training loss is {loss} at step {step}; the last good checkpoint in {} is \
             {last} (continue from it with --resume and a lower --lr)",
            self.out.display()
        )
    }

    /// One optimizer step at `step` (from 1); returns its training loss.
    fn train_step(&mut self, corpus: &Corpus, step: u64) -> Result<f64, String> {
        let o = &self.options;
        let candle = |e: attn::candle::core::Error| format!("error: step {step}: {e}");
        let windows = corpus::windows(&corpus.train, o.batch, o.seq, &mut self.rng);
        let loss = self.loss(&windows).map_err(candle)?;
        let value = f64::from(loss.to_scalar::<f32>().map_err(candle)?);
        if !value.is_finite() {
            return Ok(value);
        }
        let mut grads = loss.backward().map_err(candle)?;
        let vars = self.varmap.all_vars();
        let mut squares = 0.0;
        for var in &vars {
            if let Some(g) = grads.get(var) {
                squares += f64::from(
                    g.sqr()
                        .and_then(|s| s.sum_all())
                        .and_then(|s| s.to_scalar::<f32>())
                        .map_err(candle)?,
                );
            }
        }
        let norm = squares.sqrt();
        if norm > CLIP_NORM {
            for var in &vars {
                if let Some(g) = grads.remove(var) {
                    grads.insert(var, (g * (CLIP_NORM / norm)).map_err(candle)?);
                }
            }
        }
        let lr = super::schedule::learning_rate(step, o.steps, o.warmup, o.lr);
        for opt in &mut self.optimizers {
            opt.set_learning_rate(lr);
            opt.step(&grads).map_err(candle)?;
        }
        Ok(value)
    }

    /// Mean next-token cross-entropy of `[B, seq + 1]` windows.
    fn loss(&self, windows: &Tensor) -> attn::candle::core::Result<Tensor> {
        let seq = self.options.seq;
        let inputs = windows.narrow(1, 0, seq)?;
        let targets = windows.narrow(1, 1, seq)?.flatten_all()?;
        let logits = self.model.forward(&inputs)?;
        loss::cross_entropy(&logits.reshape(((), self.config.vocab))?, &targets)
    }

    /// The mean loss over the same validation windows at every evaluation.
    fn validation_loss(&self, corpus: &Corpus) -> Result<f64, String> {
        let mut rng = Rng::new(self.options.seed ^ 0x5EED_0FDA_7A00);
        let mut total = 0.0;
        for _ in 0..EVAL_BATCHES {
            let windows = corpus::windows(
                &corpus.validation,
                self.options.batch,
                self.options.seq,
                &mut rng,
            );
            let loss = self
                .loss(&windows)
                .and_then(|l| l.to_scalar::<f32>())
                .map_err(|e| format!("error: validation: {e}"))?;
            total += f64::from(loss);
        }
        Ok(total / EVAL_BATCHES as f64)
    }

    /// Writes the weights, the model's TOML, the state, the metrics and the plot.
    fn checkpoint(&self) -> Result<(), String> {
        let weights = self.out.join(".model.safetensors.partial");
        self.varmap
            .save(&weights)
            .map_err(|e| format!("error: --out: cannot write {}: {e}", weights.display()))?;
        std::fs::rename(&weights, self.out.join("model.safetensors"))
            .map_err(|e| format!("error: --out: cannot write model.safetensors: {e}"))?;
        let toml = research::config_to_toml(&self.config, Some("model.safetensors"));
        write_atomically(&self.out, "model.toml", toml.as_bytes())?;
        let state = State {
            options: self.options.clone(),
            step: self.step,
            rng: self.rng,
        };
        write_atomically(&self.out, "state.json", state.to_json().as_bytes())?;
        let lines: String = self.metrics.iter().map(|m| m.to_json() + "\n").collect();
        write_atomically(&self.out, "metrics.jsonl", lines.as_bytes())?;
        super::plot::loss_curves(&self.out.join("loss.svg"), &self.metrics)
    }

    fn parameter_count(&self) -> usize {
        self.varmap.all_vars().iter().map(|v| v.elem_count()).sum()
    }
}
