//! `attnc sweep`: a grid's results against its runs' own files and hand-counted costs,
//! skipped combinations, resuming, and bad input. Needs the `candle` feature, as training does
//! (`train.rs` checks what an attnc without it says).

use crate::{attnc, stderr};
use std::path::{Path, PathBuf};

/// A fresh folder of this test process for `tag`.
fn folder(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("attnc-sweep-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A base model and a corpus in `dir`.
fn inputs(dir: &Path) -> (String, String) {
    let base = dir.join("base.toml");
    std::fs::write(
        &base,
        "vocab = 256\nhidden = 16\nlayers = 2\nintermediate = 32\n\
         attention = \"heads = 2, kv_heads = 2, head_dim = 8, mask = causal, position = rope\"\n",
    )
    .unwrap();
    let data = dir.join("corpus.txt");
    std::fs::write(&data, "a sweep trains every variant. ".repeat(40)).unwrap();
    (
        base.to_str().unwrap().to_string(),
        data.to_str().unwrap().to_string(),
    )
}

/// `attnc sweep` of `base` on `data` into `out`, small and quick, with `extra` flags.
fn sweep(base: &str, data: &str, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "sweep",
        "--base",
        base,
        "--data",
        data,
        "--out",
        out.to_str().unwrap(),
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--warmup",
        "1",
        "--batch",
        "2",
        "--seq",
        "16",
    ];
    args.extend(extra);
    attnc(&args)
}

/// The fields of a CSV line (RFC 4180 quoting).
fn fields(line: &str) -> Vec<String> {
    let (mut out, mut field, mut quoted, mut chars) =
        (Vec::new(), String::new(), false, line.chars().peekable());
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => out.push(std::mem::take(&mut field)),
            _ => field.push(c),
        }
    }
    out.push(field);
    out
}

/// The last validation loss in a run folder's metrics.jsonl.
fn last_val_loss(run: &Path) -> f64 {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    last["val_loss"].as_f64().unwrap()
}

#[test]
fn a_sweep_reports_every_valid_variant_from_its_runs_and_resumes() {
    let dir = folder("grid");
    let (base, data) = inputs(&dir);
    let out = dir.join("out");
    let vary = [
        "--vary",
        "kv_heads=1,2,3",
        "--vary",
        "mask=causal,sliding_window(4)",
    ];
    let o = sweep(&base, &data, &out, &vary);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("skipped kv_heads=3 mask=causal"), "{err}");
    assert!(err.contains("kv_heads = 3 is out of range"), "{err}");

    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    let mut lines = csv.lines();
    let header = fields(lines.next().unwrap());
    let column = |name: &str| header.iter().position(|h| h == name).unwrap();
    let rows: Vec<Vec<String>> = lines.map(fields).collect();
    assert_eq!(rows.len(), 4, "{csv}");
    for row in &rows {
        assert_eq!(row.len(), header.len(), "{row:?}");
        let variant = &row[column("variant")];
        let kv_heads: u64 = if variant.contains("kv_heads=1") { 1 } else { 2 };
        // Each layer caches kv_heads * (8 + 8) f32 values per token; two layers.
        assert_eq!(
            row[column("kv_bytes_per_token")],
            (kv_heads * 16 * 4 * 2).to_string()
        );
        // Embedding 256x16 (tied), and per layer q and o 16x16, k and v 16x(8 kv_heads),
        // SwiGLU 3 x 16x32, two norms of 16; then the final norm.
        let layer = 2 * 256 + 2 * 16 * 8 * kv_heads + 3 * 16 * 32 + 2 * 16;
        let params = 256 * 16 + 2 * layer + 16;
        assert_eq!(row[column("params")], params.to_string());
        let spec: attn::dsl::AttentionSpec = row[column("attention")].parse().unwrap();
        assert_eq!(spec.kv_heads(), kv_heads as u32);
        // The loss is the mean of the two seeds' last evaluations, read from their runs.
        let runs = out.join("runs").join(&row[column("folder")]);
        let (a, b) = (
            last_val_loss(&runs.join("seed0")),
            last_val_loss(&runs.join("seed1")),
        );
        let mean: f64 = row[column("val_loss")].parse().unwrap();
        assert!(
            (mean - (a + b) / 2.0).abs() < 1e-4,
            "{mean} against {a} and {b}"
        );
        let std: f64 = row[column("val_loss_std")].parse().unwrap();
        assert!((std - (a - b).abs() / 2f64.sqrt()).abs() < 1e-4, "{std}");
        for speed in [
            "train_tokens_per_s",
            "prefill_gflops",
            "decode_tokens_per_s",
        ] {
            let v: f64 = row[column(speed)].parse().unwrap();
            assert!(v > 0.0 && v.is_finite(), "{speed} = {v}");
        }
    }
    // The terminal table, after the runs' progress lines, is sorted by validation loss.
    let stdout = crate::stdout(&o);
    let table = &stdout[stdout.find("variant ").unwrap()..];
    let losses: Vec<f64> = table
        .lines()
        .skip(1)
        .map(|l| {
            let cell = l
                .split("  ")
                .map(str::trim)
                .find(|c| c.contains('±'))
                .unwrap();
            cell.split(' ').next().unwrap().parse().unwrap()
        })
        .collect();
    assert_eq!(losses.len(), 4, "{table}");
    assert!(losses.windows(2).all(|w| w[0] <= w[1]), "{table}");
    // Curves in the JSON lines, the plots, and a page that needs nothing but itself.
    let jsonl = std::fs::read_to_string(out.join("results.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(jsonl.lines().next().unwrap()).unwrap();
    assert_eq!(first["curves"][0]["step"], serde_json::json!([2, 4]));
    for svg in ["loss.svg", "pareto.svg", "speed.svg"] {
        let text = std::fs::read_to_string(out.join(svg)).unwrap();
        assert!(
            text.contains("<svg") && text.contains("kv_heads=1"),
            "{svg}"
        );
    }
    let page = std::fs::read_to_string(out.join("index.html")).unwrap();
    assert_eq!(page.matches("<svg").count(), 3);
    assert!(
        !page.contains("src=") && !page.contains("href=\"http"),
        "{page}"
    );

    // A rerun keeps the finished runs; a removed run trains again, alone.
    let kept = out.join("runs").join(&rows[0][column("folder")]);
    std::fs::remove_dir_all(kept.join("seed1")).unwrap();
    let o = sweep(&base, &data, &out, &vary);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        stderr(&o).matches(": training ").count(),
        1,
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).contains(&format!("{} seed 1: training", rows[0][column("variant")])));
    let again = std::fs::read_to_string(out.join("results.csv")).unwrap();
    assert_eq!(again.lines().count(), 5);
    // Other options are never trained over the kept runs.
    let o = sweep(&base, &data, &out, &[&vary[..], &["--lr", "1e-3"]].concat());
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("other options"), "{}", stderr(&o));
    // Nor are runs of another corpus reported for this one.
    let other = dir.join("other.txt");
    std::fs::write(&other, "another corpus, other losses. ".repeat(40)).unwrap();
    let o = sweep(&base, other.to_str().unwrap(), &out, &vary);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("the run trained on another corpus"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        std::fs::read_to_string(out.join("results.csv")).unwrap(),
        again
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_grids_are_refused_with_what_is_allowed() {
    let dir = folder("bad");
    let (base, data) = inputs(&dir);
    let out = dir.join("out");
    let refused = |extra: &[&str], says: &str| {
        let o = sweep(&base, &data, &out, extra);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{extra:?}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    };
    refused(&["--vary", "kv_head=1,2"], "allowed: hidden, layers");
    refused(
        &["--vary", "layers=1", "--vary", "layers=2"],
        "varied twice",
    );
    refused(&["--vary", "layers=1,,2"], "empty");
    refused(&["--vary", "layers"], "KEY=V1,V2");
    refused(&["--vary", "kv_heads=3,5"], "every combination was refused");
    refused(
        &["--vary", "position=sideways"],
        "every combination was refused",
    );
    refused(&["--seeds", "0"], "--seeds");
    let weights = dir.join("trained.toml");
    std::fs::write(
        &weights,
        std::fs::read_to_string(&base).unwrap() + "weights = \"model.safetensors\"\n",
    )
    .unwrap();
    let o = sweep(weights.to_str().unwrap(), &data, &out, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("random weights"), "{}", stderr(&o));
    // Nothing was written for any refused grid.
    assert!(!out.exists());
    // An output over an input is refused before any training.
    let named_like_output = dir.join("results.csv");
    std::fs::copy(&data, &named_like_output).unwrap();
    let o = sweep(&base, named_like_output.to_str().unwrap(), &dir, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("overwrite"), "{}", stderr(&o));
    assert!(!dir.join("runs").exists());
    // A folder of other files is no sweep's: nothing is written into it.
    let notes = dir.join("notes");
    std::fs::create_dir_all(&notes).unwrap();
    std::fs::write(notes.join("todo.txt"), "keep me").unwrap();
    let o = sweep(&base, &data, &notes, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("not an attnc sweep folder"),
        "{}",
        stderr(&o)
    );
    assert_eq!(std::fs::read_dir(&notes).unwrap().count(), 1);
    std::fs::remove_dir_all(&dir).ok();
}
