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

fn tiny_llama() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf-tiny/llama_gqa"
    )
    .to_string()
}

/// `bench-model --json`: one object with a positive rate per prompt and context length, the
/// weights a step reads (the fixture's projections and LM head, f32) and the roofline they give.
#[test]
fn bench_model_prints_rates_per_length() {
    let model = tiny_llama();
    let o = attnc(&[
        "bench-model",
        "--model",
        &model,
        "--prefill",
        "4,16",
        "--contexts",
        "8",
        "--steps",
        "2",
        "--reps",
        "1",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let line = stdout(&o);
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    let prefill = v["attn"]["prefill"].as_array().unwrap();
    let lengths: Vec<u64> = prefill
        .iter()
        .map(|r| r["tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(lengths, [4, 16]);
    let decode = v["attn"]["decode"].as_array().unwrap();
    assert_eq!(decode.len(), 1);
    assert_eq!(decode[0]["context"].as_u64(), Some(8));
    for r in prefill.iter().chain(decode) {
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0, "{line}");
    }
    // The fixture's config: every projection and the LM head, in f32.
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{model}/config.json")).unwrap())
            .unwrap();
    let n = |k: &str| config[k].as_u64().unwrap();
    let (d, heads, kv) = (
        n("hidden_size"),
        n("num_attention_heads"),
        n("num_key_value_heads"),
    );
    let head_dim = config["head_dim"].as_u64().unwrap_or(d / heads);
    let attention = d * head_dim * (2 * heads + 2 * kv);
    let mlp = 3 * d * n("intermediate_size");
    let weights = n("num_hidden_layers") * (attention + mlp) + n("vocab_size") * d;
    assert_eq!(v["step_weight_bytes"].as_u64(), Some(4 * weights), "{line}");
    let roofline = v["decode_roofline_tokens_per_s"].as_f64().unwrap();
    let gbps = v["memory_gbps"].as_f64().unwrap();
    // Both printed to two decimals.
    assert!(
        (roofline / (gbps * 1e9 / (4 * weights) as f64) - 1.0).abs() < 1e-3,
        "{line}"
    );
    // After 8 tokens a step reads 9 rows of keys and values per layer and kv head.
    let cache = n("num_hidden_layers") * kv * 2 * head_dim * 4 * 9;
    assert_eq!(
        decode[0]["step_cache_bytes"].as_u64(),
        Some(cache),
        "{line}"
    );
    assert!(v.get("transformers").is_none());
}

/// Bad lengths, a missing model, a research model against transformers and a Python that is
/// not there are refused by name, with exit code 2 and nothing on stdout.
#[test]
fn bench_model_refuses_bad_input() {
    let model = tiny_llama();
    let toml = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/models/llama-100m.toml"
    );
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--model", &model, "--prefill", "0"], "--prefill 0"),
        (vec!["--model", &model, "--contexts", "9x"], "--contexts 9x"),
        (vec!["--model", &model, "--prefill", "70000"], "1 to 65536"),
        (vec!["--model", "/no/such/model"], "no such file or folder"),
        (vec!["--model", toml, "--against-torch"], "research model"),
        (
            vec![
                "--model",
                &model,
                "--against-torch",
                "--python",
                "/no/such/python",
                "--prefill",
                "4",
                "--contexts",
                "4",
                "--steps",
                "1",
                "--reps",
                "1",
            ],
            "--python /no/such/python",
        ),
    ];
    for (args, expect) in cases {
        let mut all = vec!["bench-model"];
        all.extend(&args);
        let o = attnc(&all);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(expect), "{args:?}: {}", stderr(&o));
        assert!(stdout(&o).is_empty(), "{args:?}");
    }
}

/// `--documents`: more documents than keys, a spec that declares data of its own, a CUDA
/// backend, and a data spec without `--documents`: each refused with exit code 2, saying why.
#[test]
fn bench_documents_refuses_what_it_cannot_time() {
    let plain = "heads = 2, head_dim = 32, mask = causal";
    let with_data = "heads = 2, head_dim = 32, mask = causal, data(doc: [batch, seq] i32), \
                     mask_mod = |b, h, q, k| doc[b, q] == doc[b, k]";
    for (args, says) in [
        (
            vec!["bench", plain, "--seq", "64", "--documents", "65"],
            "--documents 65 is more documents than the 64 keys",
        ),
        (
            vec!["bench", with_data, "--seq", "64", "--documents", "2"],
            "declares data(...) already",
        ),
        (
            vec![
                "bench",
                plain,
                "--seq",
                "64",
                "--documents",
                "2",
                "--backend",
                "cuda",
            ],
            "--documents times the CPU backend only",
        ),
        (
            vec!["bench", with_data, "--seq", "64"],
            "cannot make up this spec's data tensors",
        ),
    ] {
        let o = attnc(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{args:?}: {}", stderr(&o));
    }
    // Documents that divide the keys: one JSON line, GFLOP/s over the kept pairs.
    let o = attnc(&[
        "bench",
        plain,
        "--seq",
        "128",
        "--documents",
        "4",
        "--reps",
        "2",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert!(v["gflops"].as_f64().unwrap() > 0.0);
}
