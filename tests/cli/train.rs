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
        svg.starts_with("<svg") && svg.contains("validation"),
        "{svg}"
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
    let o = attnc(&["train", "--resume", out_s, "--data", &data]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("has done 9 steps already"),
        "{}",
        stderr(&o)
    );
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
    assert!(stderr(&o).contains("overwrite"), "{}", stderr(&o));
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
/// is left as it was.
#[cfg(feature = "candle")]
#[test]
fn a_nan_loss_stops_the_run_and_names_the_last_checkpoint() {
    let dir = folder("nan");
    let (m, data) = (model(&dir, 256), corpus(&dir));
    let out = dir.join("run");
    let out_s = out.to_str().unwrap();
    let o = train(&m, &data, out_s, &["--steps", "3"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // The same weights under a score modifier that makes every score infinite: the softmax
    // of infinities is NaN from the next step on.
    let toml = out.join("model.toml");
    let text = std::fs::read_to_string(&toml).unwrap();
    let mask = "mask = causal";
    assert!(text.contains(mask), "{text}");
    let nan = text.replacen(
        mask,
        &format!("{mask}, score_mod = |s, b, h, q, k| s * 1e38 * 1e38"),
        1,
    );
    std::fs::write(&toml, nan).unwrap();
    let weights = std::fs::read(out.join("model.safetensors")).unwrap();
    let o = attnc(&["train", "--resume", out_s, "--data", &data, "--steps", "6"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("NaN at step 4"), "{err}");
    assert!(err.contains("is step 3"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        weights
    );
    std::fs::remove_dir_all(&dir).ok();
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
