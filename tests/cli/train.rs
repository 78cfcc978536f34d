//! `attnc train`: a run's files, a checkpoint `attnc logits` loads, resuming, and bad input.
//! Training itself needs the `candle` feature; without it the command says so.

use crate::{attnc, stderr};
use std::path::{Path, PathBuf};

/// A fresh folder of this test process for `tag`.
fn folder(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("attnc-train-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A byte-level model's TOML in `dir`.
fn model(dir: &Path, vocab: usize) -> String {
    let path = dir.join("m.toml");
    std::fs::write(
        &path,
        format!(
            "vocab = {vocab}\nhidden = 32\nlayers = 1\n\
             attention = \"heads = 2, head_dim = 16, mask = causal, position = rope\"\n"
        ),
    )
    .unwrap();
    path.to_str().unwrap().to_string()
}

fn corpus(dir: &Path) -> String {
    let path = dir.join("corpus.txt");
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(40);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

/// `attnc train` of `model` on `data` into `out`, small and quick, with `extra` flags.
#[cfg(feature = "candle")]
fn train(model: &str, data: &str, out: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["train", "--model", model, "--data", data, "--out", out];
    args.extend(SMALL);
    args.extend(extra);
    attnc(&args)
}

#[cfg(feature = "candle")]
const SMALL: &[&str] = &[
    "--seq",
    "16",
    "--batch",
    "2",
    "--eval-every",
    "3",
    "--warmup",
    "2",
];

#[cfg(feature = "candle")]
#[test]
fn a_run_writes_metrics_a_checkpoint_and_a_plot_and_resumes() {
    let dir = folder("run");
    let (m, data) = (model(&dir, 256), corpus(&dir));
    let out = dir.join("run");
    let out_s = out.to_str().unwrap();
    let o = train(&m, &data, out_s, &["--steps", "6"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{metrics}");
    for (line, step) in lines.iter().zip([3, 6]) {
        assert_eq!(line["step"], step);
        for key in ["train_loss", "val_loss", "tokens_per_s", "elapsed_s"] {
            let v = line[key].as_f64().unwrap();
            assert!(v.is_finite() && v > 0.0, "{key}: {v}");
        }
    }
    // Byte-level losses start near ln(256) = 5.5 and fall.
    assert!(lines[0]["val_loss"].as_f64().unwrap() < 6.0);
    let svg = std::fs::read_to_string(out.join("loss.svg")).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("validation loss, every 3 steps"),
        "{svg}"
    );
    assert!(svg.contains("training loss, each step"), "{svg}");
    let steps = std::fs::read_to_string(out.join("steps.jsonl")).unwrap();
    assert_eq!(steps.lines().count(), 6, "{steps}");
    assert!(
        out.join("model-6.safetensors").is_file() && out.join("optimizer-6.safetensors").is_file()
    );

    // The checkpoint runs in attn's runtime.
    let toml = out.join("model.toml");
    let o = attnc(&[
        "generate",
        "--model",
        toml.to_str().unwrap(),
        "--tokens",
        "116,104",
        "--max-new-tokens",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        crate::stdout(&o).trim().split(',').count(),
        3,
        "{}",
        crate::stdout(&o)
    );

    // Resuming goes on from step 6 with the run's own options.
    let o = attnc(&["train", "--resume", out_s, "--data", &data, "--steps", "9"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 3, "{metrics}");
    assert!(
        metrics.lines().last().unwrap().contains("\"step\":9"),
        "{metrics}"
    );
    let o = attnc(&["train", "--resume", out_s]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("has done 9 steps already"),
        "{}",
        stderr(&o)
    );
    // Only the last checkpoint is kept.
    assert!(!out.join("model-6.safetensors").exists());
    std::fs::remove_dir_all(&dir).ok();
}

#[cfg(feature = "candle")]
#[test]
fn a_seed_fixes_the_initial_weights_and_the_batches() {
    let dir = folder("seed");
    let (m, data) = (model(&dir, 256), corpus(&dir));
    let losses = |seed: &str, name: &str| {
        let out = dir.join(name);
        let o = train(
            &m,
            &data,
            out.to_str().unwrap(),
            &["--steps", "3", "--seed", seed],
        );
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let line = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
        (
            v["train_loss"].as_f64().unwrap(),
            v["val_loss"].as_f64().unwrap(),
        )
    };
    let (a, b, c) = (losses("7", "a"), losses("7", "b"), losses("8", "c"));
    assert_eq!(a, b, "the same seed");
    assert_ne!(a, c, "another seed");
    std::fs::remove_dir_all(&dir).ok();
}

#[cfg(feature = "candle")]
#[test]
fn bad_corpora_models_and_folders_are_errors_that_say_what_is_wrong() {
    let dir = folder("bad");
    let (m, data) = (model(&dir, 256), corpus(&dir));
    let out = dir.join("out");
    let out_s = out.to_str().unwrap().to_string();
    let run = |model: &str, data: &str, out: &str, extra: &[&str]| {
        let mut flags = vec!["--steps", "2"];
        flags.extend(extra);
        train(model, data, out, &flags)
    };
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p.to_str().unwrap().to_string()
    };
    let empty = write("empty.txt", b"");
    let tiny = write("tiny.txt", b"just a few words");
    let binary = write("binary.bin", &[0xff, 0xfe, 0x00, 0x81, 0x90, 0xc3, 0x28]);
    let vocab_100 = {
        let d = dir.join("v100");
        std::fs::create_dir_all(&d).unwrap();
        model(&d, 100)
    };
    let a_file = write("a-file", b"");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec![m.clone(), empty, out_s.clone()], "too few"),
        (vec![m.clone(), tiny, out_s.clone()], "too few"),
        (vec![m.clone(), binary, out_s.clone()], "not UTF-8"),
        (
            vec![vocab_100, data.clone(), out_s.clone()],
            "the model's vocab is 100",
        ),
        (
            vec![m.clone(), data.clone(), format!("{a_file}/run")],
            "--out",
        ),
        (
            vec![
                m.clone(),
                dir.join("missing.txt").to_str().unwrap().into(),
                out_s.clone(),
            ],
            "--data",
        ),
    ];
    for (args, needle) in cases {
        let o = run(&args[0], &args[1], &args[2], &[]);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }
    for (flag, value) in [
        ("--steps", "0"),
        ("--lr", "NaN"),
        ("--lr", "-1"),
        ("--lr", "inf"),
        ("--weight-decay", "-0.5"),
        ("--backend", "cuda"),
    ] {
        let o = run(&m, &data, &out_s, &[flag, value]);
        assert_eq!(o.status.code(), Some(2), "{flag} {value}");
        assert!(
            stderr(&o).contains(flag) || stderr(&o).contains(value),
            "{flag} {value}: {}",
            stderr(&o)
        );
    }
    // A run folder whose model.toml is the --model file: refused, the input kept.
    let same = dir.join("same");
    std::fs::create_dir_all(&same).unwrap();
    std::fs::copy(&m, same.join("model.toml")).unwrap();
    let input = same.join("model.toml");
    let o = run(input.to_str().unwrap(), &data, same.to_str().unwrap(), &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("not an attnc train run folder"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        std::fs::read_to_string(&input).unwrap(),
        std::fs::read_to_string(&m).unwrap()
    );
    let o = attnc(&[
        "train",
        "--resume",
        dir.join("nothing").to_str().unwrap(),
        "--data",
        &data,
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--resume"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// A loss that turns NaN stops the run at that step and names the last good checkpoint, which
/// is left as it was; resuming it with a lower learning rate is allowed.
#[cfg(feature = "candle")]
#[test]
fn a_nan_loss_stops_the_run_and_names_the_last_checkpoint() {
    let dir = folder("nan");
    let data = corpus(&dir);
    // A learned tensor under square roots that turn NaN once it moves more than 0.02 (one
    // way) or 0.01 (the other): AdamW moves it by up to the learning rate each step.
    let m = dir.join("nan.toml");
    std::fs::write(
        &m,
        "vocab = 256\nhidden = 32\nlayers = 1\nattention = \"heads = 2, head_dim = 16, \
         mask = causal, params(t: [heads]), score_mod = |s, b, h, q, k| s + k as f32 * \
         ((0.02 - t[h]).sqrt() - (0.02 + 2.0 * t[h]).sqrt())\"\n",
    )
    .unwrap();
    let out = dir.join("run");
    let out_s = out.to_str().unwrap();
    let o = train(m.to_str().unwrap(), &data, out_s, &["--steps", "60"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    let step = |after: &str| -> u64 {
        let at = err
            .find(after)
            .unwrap_or_else(|| panic!("no `{after}` in: {err}"))
            + after.len();
        let digits: String = err[at..].chars().take_while(char::is_ascii_digit).collect();
        digits.parse().unwrap()
    };
    let nan = step("the training loss is NaN at step ");
    let good = step(" is step ");
    assert_eq!(good, (nan - 1) / 3 * 3, "{err}");
    assert!(good >= 3, "{err}");
    assert!(err.contains("--lr 0.0003)"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let state = std::fs::read_to_string(out.join("state.json")).unwrap();
    assert!(state.contains(&format!("\"step\": {good}")), "{state}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(!metrics.contains("null"), "{metrics}");
    assert_eq!(metrics.lines().count() as u64, good / 3, "{metrics}");
    // The advice works: a lower learning rate goes on from the good checkpoint.
    let steps = (good + 2).to_string();
    let o = attnc(&[
        "train", "--resume", out_s, "--lr", "0.0001", "--steps", &steps,
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("from step {} on", good + 1)),
        "{}",
        stderr(&o)
    );
    let state = std::fs::read_to_string(out.join("state.json")).unwrap();
    assert!(state.contains("\"lr\": 0.0001"), "{state}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Weights that hold NaN: training from them stops before the first step, naming the
/// parameter; a NaN that a `max` in a modifier would have hidden is found the same way.
#[cfg(feature = "candle")]
#[test]
fn a_parameter_that_is_not_finite_stops_the_run_naming_it() {
    let dir = folder("nanparam");
    let data = corpus(&dir);
    let m = dir.join("m.toml");
    std::fs::write(
        &m,
        "vocab = 256\nhidden = 32\nlayers = 1\nattention = \"heads = 2, head_dim = 16, \
         mask = causal, params(t: [heads]), score_mod = |s, b, h, q, k| s + max(t[h], 0.0)\"\n",
    )
    .unwrap();
    let first = dir.join("first");
    let o = train(
        m.to_str().unwrap(),
        &data,
        first.to_str().unwrap(),
        &["--steps", "3"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // The run's weights with one learned value made NaN.
    let weights = first.join("model-3.safetensors");
    let name = "model.layers.0.self_attn.t";
    let poisoned = dir.join("poisoned.safetensors");
    crate::with_value(&weights, &poisoned, name, 1, f32::NAN);
    let toml = std::fs::read_to_string(first.join("model.toml"))
        .unwrap()
        .replace("model-3.safetensors", "poisoned.safetensors");
    let start = dir.join("start.toml");
    std::fs::write(&start, toml).unwrap();
    let o = train(
        start.to_str().unwrap(),
        &data,
        dir.join("second").to_str().unwrap(),
        &["--steps", "3"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains(&format!(
            "parameter {name} holds NaN (at flat index 1) before the first step"
        )),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `--model` naming trained weights (a run's model.toml) starts from them, not from random
/// weights: the first validation loss is the trained run's last, not a fresh model's.
#[cfg(feature = "candle")]
#[test]
fn a_model_toml_with_weights_starts_from_them() {
    let dir = folder("weights");
    let (m, data) = (model(&dir, 256), corpus(&dir));
    let first = dir.join("first");
    let o = train(
        &m,
        &data,
        first.to_str().unwrap(),
        &["--steps", "12", "--lr", "0.01"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let val = |dir: &Path, i: usize| -> f64 {
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        let line: serde_json::Value = serde_json::from_str(text.lines().nth(i).unwrap()).unwrap();
        line["val_loss"].as_f64().unwrap()
    };
    let trained = val(&first, 3);
    let fresh_start = val(&first, 0);
    let second = dir.join("second");
    let o = train(
        first.join("model.toml").to_str().unwrap(),
        &data,
        second.to_str().unwrap(),
        &["--steps", "3", "--lr", "0.0001"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("starting from the weights in"),
        "{}",
        stderr(&o)
    );
    let continued = val(&second, 0);
    assert!(
        (continued - trained).abs() < (fresh_start - trained).abs() / 4.0,
        "trained {trained}, fresh start {fresh_start}, from the weights {continued}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `--out` writes only into a new, empty or own folder: a checkpoint folder and an earlier
/// run are left as they were, and say why.
#[cfg(feature = "candle")]
#[test]
fn out_refuses_folders_that_are_not_new_runs() {
    let dir = folder("foreign");
    let (m, data) = (model(&dir, 256), corpus(&dir));
    let hf = format!(
        "{}/tests/fixtures/hf-tiny/llama_gqa",
        env!("CARGO_MANIFEST_DIR")
    );
    let copy = dir.join("llama_gqa");
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(&hf).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    let before: Vec<(std::ffi::OsString, Vec<u8>)> = listing(&copy);
    let o = train(&m, &data, copy.to_str().unwrap(), &["--steps", "2"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("not an attnc train run folder"),
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("config.json"), "{}", stderr(&o));
    assert_eq!(listing(&copy), before, "the checkpoint is untouched");
    // An earlier run is not restarted by a fresh run into it.
    let run = dir.join("run");
    let o = train(&m, &data, run.to_str().unwrap(), &["--steps", "4"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let kept = listing(&run);
    let o = train(&m, &data, run.to_str().unwrap(), &["--steps", "2"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o)
            .contains("it holds a run (its checkpoint is at step 4); continue it with --resume"),
        "{}",
        stderr(&o)
    );
    assert_eq!(listing(&run), kept);
    std::fs::remove_dir_all(&dir).ok();
}

/// The names and bytes of a folder's files, in name order.
#[cfg(feature = "candle")]
fn listing(dir: &Path) -> Vec<(std::ffi::OsString, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name(), std::fs::read(e.path()).unwrap())
        })
        .collect();
    files.sort();
    files
}

/// A second run into a folder that a run is writing is refused at once; the first finishes.
#[cfg(feature = "candle")]
#[test]
fn two_runs_cannot_share_a_folder() {
    let dir = folder("lock");
    let (m, data) = (model(&dir, 256), corpus(&dir));
    let out = dir.join("run");
    let out_s = out.to_str().unwrap();
    let mut args: Vec<&str> = vec!["train", "--model", &m, "--data", &data, "--out", out_s];
    args.extend(SMALL);
    args.extend(["--steps", "60"]);
    let mut first = std::process::Command::new(env!("CARGO_BIN_EXE_attnc"))
        .args(&args)
        .env("ATTN_CACHE_DIR", crate::test_cache())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the first holds the folder.
    let marker = out.join("attnc-run.json");
    let started = std::time::Instant::now();
    while !marker.exists() && started.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    for second in [
        train(&m, &data, out_s, &["--steps", "2"]),
        attnc(&["train", "--resume", out_s]),
    ] {
        if first.try_wait().unwrap().is_some() {
            break; // the first finished before the second tried: nothing left to check
        }
        assert_eq!(second.status.code(), Some(2), "{}", stderr(&second));
        assert!(
            stderr(&second).contains("another attnc train is writing this folder now"),
            "{}",
            stderr(&second)
        );
    }
    assert!(first.wait().unwrap().success());
    let state = std::fs::read_to_string(out.join("state.json")).unwrap();
    assert!(state.contains("\"step\": 60"), "{state}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Kills a small run at random moments, resumes it (killing some resumes too) until it
/// finishes, and checks that every such run ends with the weights, moments and logs of an
/// uninterrupted run, bit for bit, or was refused with a reason.
#[cfg(feature = "candle")]
#[test]
fn a_run_killed_at_any_moment_resumes_as_if_never_stopped() {
    let dir = folder("kill");
    let (m, data) = (model(&dir, 256), corpus(&dir));
    let flags = ["--steps", "12"];
    let whole = dir.join("whole");
    let started = std::time::Instant::now();
    let o = train(&m, &data, whole.to_str().unwrap(), &flags);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let span = started.elapsed().as_millis() as u64 + 50;
    let expected = finished(&whole);
    let mut rng = attn::inputs::XorShift::new(0x6b11);
    let spawn = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_attnc"))
            .args(args)
            .env("ATTN_CACHE_DIR", crate::test_cache())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (mut kills, mut refusals) = (0, 0);
    for trial in 0..16 {
        let out = dir.join(format!("killed{trial}"));
        let out_s = out.to_str().unwrap().to_string();
        let mut fresh = vec!["train", "--model", &m, "--data", &data, "--out", &out_s];
        fresh.extend(SMALL);
        fresh.extend(flags);
        let resume = ["train", "--resume", out_s.as_str()];
        let mut attempt = 0;
        loop {
            let holds_checkpoint = out.join("state.json").exists();
            let mut child = spawn(if holds_checkpoint { &resume } else { &fresh });
            // The first attempt and every other one after it are killed at a random moment.
            if attempt < 3 && attempt % 2 == 0 {
                let wait = rng.next_u64() % span;
                std::thread::sleep(std::time::Duration::from_millis(wait));
                if child.try_wait().unwrap().is_none() {
                    child.kill().unwrap();
                    kills += 1;
                }
            }
            let o = child.wait_with_output().unwrap();
            attempt += 1;
            let err = stderr(&o);
            // Killed after its last checkpoint: finished, and a resume says so.
            if o.status.success() || err.contains("has done 12 steps already") {
                break;
            }
            if o.status.code() == Some(2) {
                // A refusal must say why, and is one of the known reasons.
                assert!(err.contains("error:"), "trial {trial}: {err}");
                refusals += 1;
            }
            assert!(
                attempt < 8,
                "trial {trial}: no end after {attempt} attempts: {err}"
            );
        }
        assert_eq!(finished(&out), expected, "trial {trial}");
    }
    assert!(kills >= 8, "only {kills} kills landed");
    eprintln!("{kills} kills, {refusals} refusals");
    std::fs::remove_dir_all(&dir).ok();
}

/// What a finished run must match: its files' names (no debris), its final weights, moments
/// and model.toml, and its logs without the timings.
#[cfg(feature = "candle")]
type Finished = (
    Vec<std::ffi::OsString>,
    Vec<u8>,
    Vec<u8>,
    String,
    Vec<String>,
    String,
);

#[cfg(feature = "candle")]
fn finished(run: &Path) -> Finished {
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let metrics = metrics
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            format!("{} {} {}", v["step"], v["train_loss"], v["val_loss"])
        })
        .collect();
    (
        listing(run).into_iter().map(|(name, _)| name).collect(),
        std::fs::read(run.join("model-12.safetensors")).unwrap(),
        std::fs::read(run.join("optimizer-12.safetensors")).unwrap(),
        std::fs::read_to_string(run.join("model.toml")).unwrap(),
        metrics,
        std::fs::read_to_string(run.join("steps.jsonl")).unwrap(),
    )
}

#[cfg(not(feature = "candle"))]
#[test]
fn without_the_candle_feature_train_and_sweep_say_what_they_need() {
    let dir = folder("nocandle");
    let (m, data) = (model(&dir, 256), corpus(&dir));
    let out = dir.join("out");
    for (command, model_flag) in [("train", "--model"), ("sweep", "--base")] {
        let o = attnc(&[
            command,
            model_flag,
            &m,
            "--data",
            &data,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(2), "{command}");
        assert!(stderr(&o).contains("`candle` feature"), "{}", stderr(&o));
    }
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// A 100 MB corpus trains in 600 MB of address space (it costs about 1.1 times its size, not
/// the 9 times of bytes, ids and copies of both); one over the 1 GiB limit is refused by its
/// size before it is read, and one the memory cannot hold before a byte is read.
#[cfg(all(feature = "candle", target_os = "linux"))]
#[test]
fn a_corpus_costs_about_its_size_and_is_checked_before_it_is_read() {
    let dir = folder("bigcorpus");
    let m = model(&dir, 256);
    let big = dir.join("big.txt");
    let line = "the quick brown fox jumps over the lazy dog, again and again.\n";
    let text = line.repeat(100_000_000 / line.len());
    std::fs::write(&big, &text).unwrap();
    let out = dir.join("run");
    let o = crate::attnc_under(
        "ulimit -v 600000",
        &[
            "train",
            "--model",
            &m,
            "--data",
            big.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--steps",
            "1",
            "--seq",
            "16",
            "--batch",
            "2",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let tokens = format!("on {} tokens", text.len());
    assert!(stderr(&o).contains(&tokens), "{}", stderr(&o));
    // Past the limit: refused by its size, which the message gives.
    let huge = dir.join("huge.txt");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(2 << 30)
        .unwrap();
    let o = train(
        &m,
        huge.to_str().unwrap(),
        dir.join("r2").to_str().unwrap(),
        &[],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("2147483648 bytes; allowed: at most 1073741824"),
        "{}",
        stderr(&o)
    );
    // Within the limit but not the memory: refused naming the limit, before it is read.
    let large = dir.join("large.txt");
    std::fs::File::create(&large)
        .unwrap()
        .set_len(900 << 20)
        .unwrap();
    let o = crate::attnc_under(
        "ulimit -v 400000",
        &[
            "train",
            "--model",
            &m,
            "--data",
            large.to_str().unwrap(),
            "--out",
            dir.join("r3").to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the corpus would need") && stderr(&o).contains("RLIMIT_AS"),
        "{}",
        stderr(&o)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A mixture-of-experts model whose activations the old estimate put at a few MB (it counted
/// no experts) is refused with the memory it needs, not aborted by a failed allocation.
#[cfg(all(feature = "candle", target_os = "linux"))]
#[test]
fn moe_activations_are_counted_before_training() {
    let dir = folder("moe");
    let data = corpus(&dir);
    let m = dir.join("moe.toml");
    std::fs::write(
        &m,
        "vocab = 256\nhidden = 64\nlayers = 1\n\
         attention = \"heads = 4, head_dim = 16, mask = causal\"\n\
         [moe]\nexperts = 64\ntop_k = 64\nintermediate = 4096\n",
    )
    .unwrap();
    let o = crate::attnc_under(
        "ulimit -v 3000000",
        &[
            "train",
            "--model",
            m.to_str().unwrap(),
            "--data",
            &data,
            "--out",
            dir.join("run").to_str().unwrap(),
            "--batch",
            "16",
            "--seq",
            "128",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("--batch 16 --seq 128: a training step's activations would need"),
        "{err}"
    );
    assert!(!dir.join("run").exists(), "nothing written");
    std::fs::remove_dir_all(&dir).ok();
}

/// A run with a tokenizer named by a relative path resumes from any folder (the run keeps
/// the absolute path).
#[cfg(feature = "candle")]
#[test]
fn a_tokenized_run_resumes_from_another_folder() {
    let dir = folder("tokenizer");
    let m = model(&dir, 300);
    let data = corpus(&dir);
    let fixture = format!(
        "{}/tests/fixtures/hf-tiny/llama_tokenizer/tokenizer.json",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::copy(&fixture, dir.join("tokenizer.json")).unwrap();
    let out = dir.join("run");
    let run = |cwd: &Path, args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_attnc"))
            .args(args)
            .current_dir(cwd)
            .env("ATTN_CACHE_DIR", crate::test_cache())
            .output()
            .unwrap()
    };
    let mut args = vec![
        "train",
        "--model",
        &m,
        "--data",
        &data,
        "--out",
        out.to_str().unwrap(),
        "--tokenizer",
        "tokenizer.json",
        "--steps",
        "3",
    ];
    args.extend(SMALL);
    let o = run(&dir, &args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let elsewhere = std::env::temp_dir();
    let o = run(
        &elsewhere,
        &["train", "--resume", out.to_str().unwrap(), "--steps", "6"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// The run's model.toml is the model as written: kinds keep their names (not kind0, kind1), and
/// `generate` loads it.
#[cfg(feature = "candle")]
#[test]
fn a_run_keeps_the_models_kind_names() {
    let dir = folder("kinds");
    let data = corpus(&dir);
    let m = dir.join("hybrid.toml");
    std::fs::write(
        &m,
        "vocab = 256\nhidden = 32\nlayers = 3\npattern = [\"local\", \"local\", \"global\"]\n\
         [attention]\nlocal = \"heads = 2, head_dim = 16, mask = sliding_window(4)\"\n\
         global = \"heads = 2, head_dim = 16, mask = causal\"\n",
    )
    .unwrap();
    let out = dir.join("run");
    let o = train(
        m.to_str().unwrap(),
        &data,
        out.to_str().unwrap(),
        &["--steps", "3"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let toml = std::fs::read_to_string(out.join("model.toml")).unwrap();
    assert!(
        toml.contains("pattern = [\"local\", \"local\", \"global\"]")
            && toml.contains("local = \"heads = 2, head_dim = 16, mask = sliding_window(4)\"")
            && !toml.contains("kind0"),
        "{toml}"
    );
    assert!(toml.contains("weights = \"model-3.safetensors\""), "{toml}");
    let o = attnc(&[
        "generate",
        "--model",
        out.join("model.toml").to_str().unwrap(),
        "--tokens",
        "1,2",
        "--max-new-tokens",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// A disk that fills during a checkpoint (here a file-size limit, `ulimit -f`, with SIGXFSZ
/// ignored, so writes fail as on a full disk) leaves no temporary file and no half checkpoint:
/// the folder is as before, and the error names the file.
#[cfg(all(feature = "candle", target_os = "linux"))]
#[test]
fn a_full_disk_leaves_no_debris() {
    let dir = folder("full");
    let (m, data) = (model(&dir, 256), corpus(&dir));
    let out = dir.join("run");
    let out_s = out.to_str().unwrap();
    let o = crate::attnc_under(
        "trap '' XFSZ; ulimit -f 40",
        &[
            "train",
            "--model",
            &m,
            "--data",
            &data,
            "--out",
            out_s,
            "--steps",
            "3",
            "--seq",
            "16",
            "--batch",
            "2",
            "--eval-every",
            "3",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("cannot write") && stderr(&o).contains("model-3.safetensors"),
        "{}",
        stderr(&o)
    );
    let names: Vec<_> = listing(&out).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["attnc-run.json"], "only the marker");
    // The run starts again in the same folder once there is room.
    let o = train(&m, &data, out.to_str().unwrap(), &["--steps", "3"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// Weights of another shape are refused naming the tensor and both shapes, and candle's
/// backtrace stays out of the message even under RUST_BACKTRACE=1.
#[cfg(feature = "candle")]
#[test]
fn weights_of_another_shape_are_refused_without_a_backtrace() {
    let dir = folder("shapes");
    let (m, data) = (model(&dir, 256), corpus(&dir));
    let first = dir.join("first");
    let o = train(&m, &data, first.to_str().unwrap(), &["--steps", "3"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    std::fs::copy(first.join("model-3.safetensors"), dir.join("w.safetensors")).unwrap();
    let narrow = dir.join("narrow.toml");
    std::fs::write(
        &narrow,
        "vocab = 256\nhidden = 16\nlayers = 1\nweights = \"w.safetensors\"\n\
         attention = \"heads = 2, head_dim = 8, mask = causal\"\n",
    )
    .unwrap();
    let mut args = vec![
        "train",
        "--model",
        narrow.to_str().unwrap(),
        "--data",
        &data,
        "--out",
    ];
    let out = dir.join("second");
    args.push(out.to_str().unwrap());
    args.extend(SMALL);
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_attnc"))
        .args(&args)
        .env("ATTN_CACHE_DIR", crate::test_cache())
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("shape mismatch") && err.contains("w.safetensors"),
        "{err}"
    );
    assert!(
        !err.contains("   0: ") && !err.contains("candle_core::"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `--pack`: the corpus's documents (blank-line separated) each attend within themselves; the
/// separator is kept in the checkpoint, so a resumed run packs as the run did; a packed run's
/// losses are its own (the document mask changes what each token sees).
#[cfg(feature = "candle")]
#[test]
fn a_packed_run_keeps_its_documents_apart_and_resumes_packed() {
    let dir = folder("pack");
    let m = model(&dir, 256);
    let data = dir.join("docs.txt");
    let docs: Vec<String> = (0..60)
        .map(|i| {
            format!(
                "document {i}: the quick brown fox {}",
                "jumps ".repeat(i % 5)
            )
        })
        .collect();
    std::fs::write(&data, docs.join("\n\n")).unwrap();
    let data = data.to_str().unwrap();
    let out = dir.join("packed");
    let out_s = out.to_str().unwrap();
    let o = train(&m, data, out_s, &["--steps", "3", "--pack"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("packed: ") && stderr(&o).contains("documents ending with \"\\n\\n\""),
        "{}",
        stderr(&o)
    );
    let state = std::fs::read_to_string(out.join("state.json")).unwrap();
    let state: serde_json::Value = serde_json::from_str(&state).unwrap();
    assert_eq!(state["options"]["pack"], "\n\n");
    // The same run unpacked draws the same windows, with other losses.
    let plain = dir.join("plain");
    let o = train(&m, data, plain.to_str().unwrap(), &["--steps", "3"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let first_loss = |run: &Path| -> f64 {
        let steps = std::fs::read_to_string(run.join("steps.jsonl")).unwrap();
        let line: serde_json::Value = serde_json::from_str(steps.lines().next().unwrap()).unwrap();
        line["loss"].as_f64().unwrap()
    };
    assert_ne!(first_loss(&out), first_loss(&plain));
    // Resumed, it packs again; --pack beside --resume is refused (the run's own option holds).
    let o = attnc(&["train", "--resume", out_s, "--data", data, "--steps", "6"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("packed: "), "{}", stderr(&o));
    let o = attnc(&["train", "--resume", out_s, "--steps", "9", "--pack"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    // An empty separator or a bad escape is refused.
    for bad in ["", "a\\q"] {
        let o = train(
            &m,
            data,
            dir.join("bad").to_str().unwrap(),
            &["--pack", bad],
        );
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `--ranks 2` splits every batch over two data-parallel ranks and averages their gradients;
/// with `--context-parallel 2` the ranks split every sequence instead (ring and Ulysses). Each
/// run's losses and final weights are those of one process with the same --batch (to float
/// rounding); a data-parallel run resumes with another number of ranks, and a batch that does
/// not split is refused before the folder is made.
#[cfg(feature = "candle")]
#[test]
fn data_parallel_ranks_train_as_one_process_with_the_same_batch() {
    let dir = folder("ranks");
    let (m, data) = (model(&dir, 256), corpus(&dir));
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let mut flags = vec!["--steps", "20", "--batch", "4"];
        flags.extend(extra);
        let mut args = vec!["train", "--model", &m, "--data", &data, "--out"];
        let out_s = out.to_str().unwrap().to_string();
        args.push(&out_s);
        args.extend(["--seq", "16", "--eval-every", "5", "--warmup", "2"]);
        args.extend(flags);
        let o = attnc(&args);
        assert_eq!(o.status.code(), Some(0), "{name}: {}", stderr(&o));
        out
    };
    let losses = step_losses;
    let weights = |out: &Path, step: u64| -> Vec<f32> {
        let bytes = std::fs::read(out.join(format!("model-{step}.safetensors"))).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<&str> = file.names();
        names.sort();
        names
            .iter()
            .flat_map(|n| {
                let t = file.tensor(n).unwrap();
                bytemuck_f32(t.data())
            })
            .collect()
    };
    let one = run("one", &[]);
    let two = run("two", &["--ranks", "2"]);
    let a = losses(&one);
    assert_eq!(a.len(), 20);
    let wa = weights(&one, 20);
    let ring = run("ring", &["--ranks", "2", "--context-parallel", "2"]);
    let ulysses = run(
        "ulysses",
        &[
            "--ranks",
            "2",
            "--context-parallel",
            "2",
            "--scheme",
            "ulysses",
        ],
    );
    for other in [&two, &ring, &ulysses] {
        for (step, (x, y)) in a.iter().zip(&losses(other)).enumerate() {
            let close = (x - y).abs() <= 1e-5 * x.abs();
            assert!(close, "{other:?} step {}: {x} against {y}", step + 1);
        }
        let wb = weights(other, 20);
        assert_eq!(wa.len(), wb.len());
        let worst = wa
            .iter()
            .zip(&wb)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst <= 1e-4, "{other:?}: weights differ by {worst}");
    }
    assert!(
        std::fs::read_dir(&two).unwrap().count() == std::fs::read_dir(&one).unwrap().count(),
        "rank 1 wrote files of its own"
    );

    // Resumed on 4 ranks to step 24, as the one-process run resumed.
    for (out, ranks) in [(&one, "1"), (&two, "4")] {
        let o = attnc(&[
            "train",
            "--resume",
            out.to_str().unwrap(),
            "--steps",
            "24",
            "--ranks",
            ranks,
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    }
    let (a, b) = (losses(&one), losses(&two));
    assert_eq!(b.len(), 24);
    assert!(
        (a[23] - b[23]).abs() <= 1e-5 * a[23].abs(),
        "{} against {}",
        a[23],
        b[23]
    );

    let bad = dir.join("bad");
    let o = attnc(&[
        "train",
        "--model",
        &m,
        "--data",
        &data,
        "--out",
        bad.to_str().unwrap(),
        "--batch",
        "4",
        "--ranks",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("--batch 4 does not split over 3 data-parallel ranks"),
        "{}",
        stderr(&o)
    );
    assert!(!bad.exists(), "the refused run made its folder");
    std::fs::remove_dir_all(&dir).ok();
}

/// Each step's training loss, from a run's steps.jsonl.
#[cfg(feature = "candle")]
fn step_losses(run: &Path) -> Vec<f64> {
    std::fs::read_to_string(run.join("steps.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

/// Little-endian f32 values of a safetensors tensor's bytes.
#[cfg(feature = "candle")]
fn bytemuck_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Packed windows (`--pack`: a document mask on every attention) under `--context-parallel 2`:
/// each rank reads the whole windows' document ids, and the run's losses are those of one
/// process, for the ring and Ulysses.
#[cfg(feature = "candle")]
#[test]
fn packed_windows_train_context_parallel_as_one_process() {
    let dir = folder("packed-context");
    let m = model(&dir, 256);
    let data = dir.join("documents.txt");
    let docs = [
        "the quick brown fox. ",
        "a packed corpus. ",
        "each ends with a blank line. ",
    ];
    let text: Vec<String> = (0..18).map(|i| docs[i % 3].repeat(2 + i % 4)).collect();
    std::fs::write(&data, text.join("\n\n")).unwrap();
    let data = data.to_str().unwrap().to_string();
    let losses = |name: &str, extra: &[&str]| -> Vec<f64> {
        let out = dir.join(name);
        let out_s = out.to_str().unwrap().to_string();
        let mut args = vec![
            "train", "--model", &m, "--data", &data, "--out", &out_s, "--pack",
        ];
        args.extend([
            "--seq",
            "16",
            "--batch",
            "4",
            "--steps",
            "12",
            "--eval-every",
            "4",
        ]);
        args.extend(extra);
        let o = attnc(&args);
        assert_eq!(o.status.code(), Some(0), "{name}: {}", stderr(&o));
        step_losses(&out)
    };
    let one = losses("one", &[]);
    // The mask matters: the same run unpacked ends elsewhere.
    let plain = dir.join("plain");
    let o = attnc(&[
        "train",
        "--model",
        &m,
        "--data",
        &data,
        "--out",
        plain.to_str().unwrap(),
        "--seq",
        "16",
        "--batch",
        "4",
        "--steps",
        "12",
        "--eval-every",
        "4",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let unpacked = step_losses(&plain)[11];
    assert!(
        (one[11] - unpacked).abs() > 1e-4,
        "{} and {unpacked}",
        one[11]
    );
    for scheme in ["ring", "ulysses"] {
        let name = format!("context-{scheme}");
        let got = losses(
            &name,
            &[
                "--ranks",
                "2",
                "--context-parallel",
                "2",
                "--scheme",
                scheme,
            ],
        );
        assert_eq!(got.len(), one.len());
        for (step, (x, y)) in one.iter().zip(&got).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * x.abs(),
                "{scheme} step {}: {x} against {y}",
                step + 1
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
