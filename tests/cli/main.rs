//! `attnc` end to end: outputs, messages and exit codes, one module per command. The helpers
//! here run attnc and read what it wrote.

mod bench;
mod cache;
mod check;
mod data;
mod emit;
mod explain;
mod grad;
mod hostile;
mod ir;
mod model;
mod peak;
mod readme;
mod run;
#[cfg(feature = "candle")]
mod sweep;
mod train;
#[cfg(feature = "candle")]
mod train_fuzz;

use std::process::{Command, Output};

/// attnc with `args`, its kernel cache in a directory of this test process (never the user's).
fn attnc(args: &[&str]) -> Output {
    attnc_with_cache(args, &test_cache())
}

fn attnc_with_cache(args: &[&str], cache: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_attnc"))
        .args(args)
        .env("ATTN_CACHE_DIR", cache)
        .output()
        .expect("attnc runs")
}

/// attnc with `args` under the shell limits `limits` (`ulimit -v 600000`; with `trap '' XFSZ;
/// ulimit -f 40` writes past 40 blocks fail as on a full disk), run through `sh`.
#[cfg(target_os = "linux")]
fn attnc_under(limits: &str, args: &[&str]) -> Output {
    let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
    let script = format!(
        "{limits} && exec {} {}",
        env!("CARGO_BIN_EXE_attnc"),
        quoted.join(" ")
    );
    Command::new("sh")
        .args(["-c", &script])
        .env("ATTN_CACHE_DIR", test_cache())
        .output()
        .expect("sh runs")
}

/// A copy of the safetensors file `from` at `to` with value `at` (f32) of tensor `name` made
/// `value`: a checkpoint whose weights hold NaN, say.
fn with_value(from: &std::path::Path, to: &std::path::Path, name: &str, at: usize, value: f32) {
    let bytes = std::fs::read(from).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<u8>, Vec<usize>, safetensors::Dtype)> = file
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.data().to_vec(), t.shape().to_vec(), t.dtype()))
        .collect();
    let t = tensors.iter_mut().find(|t| t.0 == name).unwrap();
    assert_eq!(t.3, safetensors::Dtype::F32, "{name}");
    t.1[4 * at..4 * at + 4].copy_from_slice(&value.to_le_bytes());
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, t)| {
            let view = safetensors::tensor::TensorView::new(*t, s.clone(), d).unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, to).unwrap();
}

fn test_cache() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("attnc-cache-{}", std::process::id()))
}

/// Tensor `name` of a safetensors file as f64 values (f64, f32, bf16 or f16 stored).
fn tensor_values(path: impl AsRef<std::path::Path>, name: &str) -> Vec<f64> {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = file.tensor(name).unwrap();
    let data = t.data();
    let half = |c: &[u8]| u16::from_le_bytes([c[0], c[1]]);
    match t.dtype() {
        safetensors::Dtype::F64 => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        safetensors::Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        safetensors::Dtype::BF16 => data
            .chunks_exact(2)
            .map(|c| f64::from(f32::from_bits(u32::from(half(c)) << 16)))
            .collect(),
        safetensors::Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| f64::from(half::f16::from_bits(half(c)).to_f32()))
            .collect(),
        other => panic!("{name}: a {other:?} tensor"),
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The value column of the row whose label is `label`.
fn row<'a>(table: &'a str, label: &str) -> &'a str {
    table
        .lines()
        .find(|l| l.starts_with(label) && l[label.len()..].starts_with("  "))
        .unwrap_or_else(|| panic!("no row `{label}` in:\n{table}"))[label.len()..]
        .trim()
}

fn fixture(name: &str) -> String {
    format!(
        "{}/tests/fixtures/attention/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("attnc-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn bad_flags_and_missing_arguments_exit_with_2() {
    for args in [
        &["explain", "heads = 8, head_dim = 64", "--seq", "0"][..],
        &["explain", "heads = 8, head_dim = 64", "--layers", "many"][..],
        &["check"][..],
        &["frobnicate"][..],
    ] {
        let o = attnc(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).is_empty());
    }
}
