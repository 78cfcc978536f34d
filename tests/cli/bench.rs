//! `attnc bench` and `attnc bench-decode`: one JSON line each, and clear refusals.

use crate::{attnc, stderr, stdout};

#[test]
fn bench_prints_one_json_line() {
    let o = attnc(&[
        "bench",
        "heads = 2, head_dim = 32, mask = causal",
        "--seq",
        "128",
        "--reps",
        "2",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let line = stdout(&o);
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    for key in ["median_ms", "gflops", "compile_ms"] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key} in {line}");
    }
    assert_eq!(line.trim().lines().count(), 1);
}

/// Without a GPU (CI has none), `bench --backend cuda` says why it cannot run: no `cuda`
/// feature, or no CUDA driver. The interpreter is not timed.
#[test]
fn bench_on_a_gpu_backend_explains_what_is_missing() {
    let spec = "heads = 2, head_dim = 64, mask = causal, dtype = bf16";
    let o = attnc(&["bench", spec, "--seq", "64", "--backend", "cuda", "--json"]);
    if o.status.code() == Some(0) {
        // A machine with an NVIDIA GPU and a cuda build: a timing.
        let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        assert!(v["median_ms"].as_f64().unwrap() > 0.0);
    } else {
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        let e = stderr(&o);
        assert!(
            e.contains("without the `cuda` feature") || e.contains("no CUDA driver"),
            "{e}"
        );
        assert!(stdout(&o).is_empty());
    }
    // The interpreter is no GPU: the timing commands do not offer it.
    for command in ["bench", "bench-decode"] {
        let o = attnc(&[command, spec, "--backend", "gpu-sim"]);
        assert_eq!(o.status.code(), Some(2));
        assert!(
            stderr(&o).contains("[possible values: cpu, cuda]"),
            "{}",
            stderr(&o)
        );
        let help = stdout(&attnc(&[command, "--help"]));
        assert!(
            help.contains("--backend") && !help.contains("gpu-sim"),
            "{help}"
        );
    }
    let o = attnc(&[
        "bench-decode",
        spec,
        "--kv-len",
        "100",
        "--reps",
        "1",
        "--backend",
        "cuda",
        "--json",
    ]);
    if o.status.code() != Some(0) {
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        let e = stderr(&o);
        assert!(
            e.contains("without the `cuda` feature") || e.contains("no CUDA driver"),
            "{e}"
        );
    }
    let o = attnc(&["check-device"]);
    if o.status.code() != Some(0) {
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        let e = stderr(&o);
        assert!(
            e.contains("without the `cuda` feature") || e.contains("no CUDA driver"),
            "{e}"
        );
    }
}

#[test]
fn bench_decode_prints_one_json_line_and_rejects_bad_specs() {
    let o = attnc(&[
        "bench-decode",
        "heads = 4, kv_heads = 2, head_dim = 32, mask = causal",
        "--kv-len",
        "300",
        "--batch",
        "2",
        "--block-size",
        "16",
        "--reps",
        "2",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let line = stdout(&o);
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    for key in ["median_us", "gbps"] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key} in {line}");
    }
    assert_eq!(line.trim().lines().count(), 1);
    let o = attnc(&[
        "bench-decode",
        "heads = 4, kv_heads = 3, head_dim = 32",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("kv_heads"), "{}", stderr(&o));
}

#[test]
fn bench_backward_times_on_the_cpu_and_refuses_elsewhere() {
    let spec = "heads = 2, head_dim = 32, mask = causal";
    let o = attnc(&[
        "bench",
        spec,
        "--seq",
        "64",
        "--reps",
        "1",
        "--backward",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert!(v["median_ms"].as_f64().unwrap() > 0.0);
    // No GPU here: the cuda backend says why it cannot run (no `cuda` feature, or no driver).
    for (backend, said) in [("cuda", "cuda"), ("gpu-sim", "possible values")] {
        let o = attnc(&["bench", spec, "--backward", "--backend", backend]);
        assert_eq!(o.status.code(), Some(2));
        assert!(stderr(&o).contains(said), "{}", stderr(&o));
    }
}
