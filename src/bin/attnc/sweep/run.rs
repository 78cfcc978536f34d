//! The sweep itself: checks the grid, trains each variant's seeds (keeping finished runs),
//! measures it, and rewrites the results after every variant.

use super::Args;
use super::grid::{self, Variant};
use super::measure::{self, Speed};
use super::report::{self, Curve, Row};
use crate::train::checkpoint;
use crate::train::corpus::{self, Corpus};
use crate::train::folder::{Folder, Kind};
use crate::train::ranks::Ranks;
use crate::train::run::{Run, Start, check_fits, check_same_corpus, options};
use crate::train::state::{Metrics, Options};
use attn::candle::CandleModel;
use attn::candle::core::{DType, Device};
use attn::candle::nn::{VarBuilder, VarMap};
use attn::research;
use attn::runtime::model::ModelConfig;
use serde_json::json;
use std::path::Path;

/// The files a sweep writes into its folder (besides `runs/`).
const OUTPUTS: [&str; 6] = [
    "results.csv",
    "results.jsonl",
    "loss.svg",
    "pareto.svg",
    "speed.svg",
    "index.html",
];

/// A variant the rules accept, ready to train: its config and TOML.
struct Planned {
    variant: Variant,
    config: ModelConfig,
    toml: String,
}

/// Runs the sweep `args` describe: in this process, or, under `mpirun`, with the variants
/// handed out to the ranks (variant `i` to rank `i mod N`), each training its variants' runs
/// in their own folders; rank 0 then gathers every variant's results from the runs into the
/// one report.
pub fn sweep(args: Args) -> Result<(), String> {
    crate::train::ranks::with_ranks(1, |ranks| sweep_as(&args, ranks))
}

fn sweep_as(args: &Args, ranks: Option<Ranks>) -> Result<(), String> {
    let args = args.clone();
    let root = ranks.as_ref().is_none_or(Ranks::is_root);
    let axes = grid::axes(&args.vary)?;
    let variants = grid::variants(&axes)?;
    let text =
        attn::runtime::files::read_text(&args.base, research::MAX_TOML_BYTES, "the base model")
            .map_err(|e| format!("error: --base: {e}"))?;
    let base = grid::base(&text)?;
    grid::check_kinds(&base, &axes)?;
    let probe = options(&args.training, args.training.seed);
    let mut planned = Vec::new();
    for variant in variants {
        match plan(&base, &variant, &probe) {
            Ok((config, toml)) => planned.push(Planned {
                variant,
                config,
                toml,
            }),
            Err(e) => say!("skipped {}: {e}", variant.name()),
        }
    }
    let Some(first) = planned.first() else {
        return Err("error: --vary: every combination was refused (the reasons are above)".into());
    };
    let corpus = corpus::read(
        &args.data,
        args.training.tokenizer.as_deref(),
        first.config.vocab,
        probe.seq,
        args.training.pack.as_deref(),
    )?;
    let folder = if root { Some(prepare(&args)) } else { None };
    if let Some(r) = &ranks
        && !r.all_ok(folder.as_ref().is_none_or(Result::is_ok))?
    {
        folder.transpose()?;
        return Err("error: rank 0 could not take the sweep's folder (its error is above)".into());
    }
    let folder = folder.transpose()?;
    if let Some(r) = &ranks {
        let mine = planned.len().div_ceil(r.size());
        say!(
            "sweep: rank {} of {} trains about {mine} of the variants",
            r.rank(),
            r.size()
        );
        for (i, p) in planned.iter().enumerate() {
            if i % r.size() == r.rank() {
                let label = format!(
                    "rank {} [{}/{}] {}",
                    r.rank(),
                    i + 1,
                    planned.len(),
                    p.variant.name()
                );
                if let Err(e) = variant_row(&args, p, &corpus, &label) {
                    say!("{label}: failed: {e}");
                }
            }
        }
        // Every rank's runs are finished (or failed): rank 0 reads them into the report.
        r.all_ok(true)?;
        if !root {
            return Ok(());
        }
    }
    let Some(folder) = folder else {
        return Ok(());
    };
    let runs = planned.len() as u64 * args.seeds;
    say!(
        "sweep: {} variant{} x {} seed{} = {runs} runs of {} steps, into {}",
        planned.len(),
        if planned.len() == 1 { "" } else { "s" },
        args.seeds,
        if args.seeds == 1 { "" } else { "s" },
        probe.steps,
        args.out.display()
    );
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    for (i, p) in planned.iter().enumerate() {
        let label = format!("[{}/{}] {}", i + 1, planned.len(), p.variant.name());
        match variant_row(&args, p, &corpus, &label) {
            Ok(row) => {
                rows.push(row);
                write_results(&folder, &rows)?;
            }
            Err(e) => {
                say!("{label}: failed: {e}");
                failed.push(format!("{}: {e}", p.variant.name()));
            }
        }
    }
    if !rows.is_empty() {
        print!("{}", report::table(&rows));
        say!(
            "wrote {}: results.csv, results.jsonl, loss.svg, pareto.svg, speed.svg, index.html",
            args.out.display()
        );
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "error: {} of {} variants failed:\n  {}",
            failed.len(),
            planned.len(),
            failed.join("\n  ")
        ))
    }
}

/// The config of `variant`, refused when the rules, the candle model or the memory check
/// refuse it.
fn plan(
    base: &toml::Table,
    variant: &Variant,
    probe: &Options,
) -> Result<(ModelConfig, String), String> {
    let (config, toml) = grid::apply(base, variant)?;
    let varmap = VarMap::new();
    CandleModel::new(
        &config,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .map_err(|e| attn::candle::message(&e))?;
    check_fits(&config, probe)?;
    Ok((config, toml))
}

/// Takes the sweep's folder (new, empty, or a sweep's) and refuses outputs that would
/// overwrite an input.
fn prepare(args: &Args) -> Result<Folder, String> {
    let inputs: Vec<&Path> = [args.base.as_path(), args.data.as_path()]
        .into_iter()
        .chain(args.training.tokenizer.as_deref())
        .collect();
    for name in OUTPUTS {
        crate::outputs::check(&args.out.join(name), &inputs, "--out")?;
    }
    let folder = Folder::claim(&args.out, Kind::Sweep, "--out")?;
    std::fs::create_dir_all(args.out.join("runs")).map_err(|e| {
        format!(
            "error: --out {}: cannot make the folder: {e}",
            args.out.display()
        )
    })?;
    Ok(folder)
}

/// Trains (or takes the finished runs of) every seed of a variant, then measures it.
fn variant_row(args: &Args, p: &Planned, corpus: &Corpus, label: &str) -> Result<Row, String> {
    let folder = p.variant.folder();
    let dir = args.out.join("runs").join(&folder);
    let mut curves = Vec::new();
    for seed in (0..args.seeds).map(|s| args.training.seed.wrapping_add(s)) {
        let run = dir.join(format!("seed{seed}"));
        let points = run_seed(
            p,
            options(&args.training, seed),
            &run,
            corpus,
            &format!("{label} seed {seed}"),
        )?;
        if points.is_empty() {
            return Err(format!("{}: the run has no evaluation", run.display()));
        }
        curves.push(Curve { seed, points });
    }
    let first = dir.join(format!("seed{}", args.training.seed));
    let model = research::load(&first.join("model.toml"), 0).map_err(|e| format!("error: {e}"))?;
    let seq = args.training.seq;
    let cost = measure::cost(&model, seq).ok_or("error: the model's costs pass 2^64")?;
    let speed = match read_speed(&dir) {
        Some(speed) => speed,
        None => {
            say!("{label}: timing prefill and decode at {seq} tokens");
            let speed = measure::speed(&model, seq as usize, cost.flops_per_token)?;
            let text = json!({
                "prefill_gflops": speed.prefill_gflops,
                "decode_tokens_per_s": speed.decode_tokens_per_s,
            });
            crate::outputs::write_whole_with(&dir.join("speed.json"), |path| {
                std::fs::write(path, text.to_string()).map_err(|e| e.to_string())
            })?;
            speed
        }
    };
    let mut row = Row::new(
        p.variant.name(),
        folder,
        p.config.attention_summary(),
        cost,
        speed,
        curves,
    );
    row.sees_ahead = p
        .config
        .attention
        .iter()
        .any(|s| s.mask == attn::Mask::None && s.mask_mod.is_none());
    Ok(row)
}

/// One seed's run in `dir`: its evaluations when it has finished; otherwise trained from its
/// last checkpoint, or from the start. A folder holding another model's, options' or
/// corpus's run is an error, never overwritten.
fn run_seed(
    planned: &Planned,
    options: Options,
    dir: &Path,
    corpus: &Corpus,
    label: &str,
) -> Result<Vec<Metrics>, String> {
    let config = &planned.config;
    let folder = Folder::claim(dir, Kind::Run, "--out")?;
    let start = if checkpoint::exists(&folder) {
        let saved = checkpoint::restore(&folder, "--out")?;
        let state = &saved.state;
        let same_model = research::config_from_toml(&state.model).is_ok_and(|c| c == *config);
        if !same_model || state.options != options {
            return Err(format!(
                "error: --out: {} holds a run of another model or other options; give another \
                 --out, or remove that folder to train it again",
                dir.display()
            ));
        }
        check_same_corpus(state, corpus, &corpus.print.path)
            .map_err(|e| format!("{e} ({} is a run of this sweep)", dir.display()))?;
        if state.step >= options.steps {
            return Ok(saved.metrics);
        }
        Start::Checkpoint(Box::new(saved))
    } else {
        checkpoint::clear(&folder);
        Start::Seeded
    };
    let run = Run {
        dir: folder.path().to_path_buf(),
        folder: Some(folder),
        config: config.clone(),
        model_toml: planned.toml.clone(),
        options,
        start,
    };
    run.train(corpus, label)
}

/// The speeds measured on an earlier run of the sweep, if it wrote them.
fn read_speed(dir: &Path) -> Option<Speed> {
    let text = attn::runtime::files::read_text(&dir.join("speed.json"), 4096, "speeds").ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    Some(Speed {
        prefill_gflops: v["prefill_gflops"].as_f64()?,
        decode_tokens_per_s: v["decode_tokens_per_s"].as_f64()?,
    })
}

/// Rewrites every result file from `rows`.
fn write_results(folder: &Folder, rows: &[Row]) -> Result<(), String> {
    folder.write("results.csv", report::csv(rows).as_bytes())?;
    folder.write("results.jsonl", report::jsonl(rows).as_bytes())?;
    let svgs = [
        ("Validation loss", "loss.svg", super::plots::loss(rows)?),
        (
            "KV cache and loss",
            "pareto.svg",
            super::plots::pareto(rows)?,
        ),
        ("Speed", "speed.svg", super::plots::speed(rows)?),
    ];
    for (_, file, svg) in &svgs {
        folder.write(file, svg.as_bytes())?;
    }
    let svgs: Vec<(&str, String)> = svgs.into_iter().map(|(t, _, svg)| (t, svg)).collect();
    let page = report::html(rows, "attnc sweep", &svgs);
    folder.write("index.html", page.as_bytes())
}
