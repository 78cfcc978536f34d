//! `attnc` end to end: outputs, messages and exit codes.

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

#[test]
fn check_prints_the_normalized_spec() {
    let o = attnc(&[
        "check",
        "heads = 8, kv_heads = 2, head_dim = 64, mask = causal",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        stdout(&o).trim(),
        "heads = 8, kv_heads = 2, head_dim = 64, v_head_dim = 64, mask = causal, position = \
         none, dtype = f32"
    );
}

#[test]
fn check_rejects_a_bad_group_count_with_exit_code_2() {
    let o = attnc(&["check", "heads = 32, kv_heads = 5, head_dim = 128"]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.contains("heads (32) is not a multiple of kv_heads (5)"),
        "{err}"
    );
    assert!(err.contains(" --> 1:24"), "{err}");
    assert!(stdout(&o).is_empty());
}

#[test]
fn check_suggests_the_key_a_typo_meant() {
    let o = attnc(&["check", "heads = 32, kv_hedas = 8, head_dim = 128"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("did you mean `kv_heads`?"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn specs_can_come_from_files() {
    let dir = std::env::temp_dir().join(format!("attnc-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.attn");
    std::fs::write(
        &good,
        "heads = 4,\nhead_dim = 32,\nmask = sliding_window(128)\n",
    )
    .unwrap();
    let o = attnc(&["check", &format!("@{}", good.display())]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("mask = sliding_window(128)"));

    let bad = dir.join("bad.attn");
    std::fs::write(
        &bad,
        "heads = 4,\nhead_dim = 32,\nmask = sliding_window(0)\n",
    )
    .unwrap();
    let o = attnc(&["check", &format!("@{}", bad.display())]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.contains(" --> 3:23") && err.contains("spec file"),
        "{err}"
    );

    let o = attnc(&["check", "@/nonexistent/spec.attn"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("cannot read spec file `/nonexistent/spec.attn`"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn explain_reports_llama3_kv_bytes_and_params() {
    let o = attnc(&[
        "explain",
        "heads = 32, kv_heads = 8, head_dim = 128, dtype = bf16, mask = causal",
        "--model-dim",
        "4096",
        "--layers",
        "32",
        "--seq",
        "8192",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = stdout(&o);
    assert_eq!(row(&t, "KV bytes/token/layer"), "4096");
    // 4096 bytes x 8192 tokens x 32 layers = 1 GiB.
    assert!(
        row(&t, "KV cache").starts_with("1.00 GiB (1073741824 bytes)"),
        "{t}"
    );
    assert!(
        row(&t, "attention params/layer").starts_with("41_943_040"),
        "{t}"
    );
    assert!(
        row(&t, "attention params").starts_with("1_342_177_280 in 32 layers"),
        "{t}"
    );
    assert!(row(&t, "kv layout").starts_with("GQA"), "{t}");
}

#[test]
fn explain_reports_deepseek_v3_mla_kv_bytes() {
    let o = attnc(&[
        "explain",
        "heads = 128, head_dim = 128, mla(latent_rank = 512, rope_dim = 64), dtype = bf16",
        "--model-dim",
        "7168",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = stdout(&o);
    assert_eq!(row(&t, "KV bytes/token/layer"), "1152");
    assert!(row(&t, "kv layout").starts_with("MLA"), "{t}");
}

#[test]
fn explain_counts_causal_skipping() {
    let o = attnc(&[
        "explain",
        "heads = 1, head_dim = 64, mask = causal",
        "--seq",
        "1000",
    ]);
    let t = stdout(&o);
    // dense: 4 * 1000^2 * 64 = 256 MFLOP; causal keeps 1000*1001/2 pairs: 128.13 MFLOP.
    assert_eq!(
        row(&t, "prefill FLOPs/layer"),
        "256.00 MFLOP dense, 128.13 MFLOP with masked pairs skipped (Sq = Skv = 1000, batch 1)"
    );
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

#[test]
fn ir_prints_each_pass_and_the_tile_map() {
    let o = attnc(&[
        "ir",
        "heads = 4, head_dim = 64, mask = causal",
        "--seq",
        "512",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = stdout(&o);
    for section in [
        "-- modifier IR, lowered --\nscore = score * 0.125\nmask = k <= q\n",
        "-- modifier IR, folded --\n",
        "-- kernel plan --\nplan Forward\n",
        // Blocks of 256 query rows by tiles of 64 keys.
        "-- tiles at Sq = 512, Skv = 512 (4 all kept #, 4 skipped ., 8 mixed /) --\n\
         ////....\n####////\n",
    ] {
        assert!(t.contains(section), "missing {section:?} in:\n{t}");
    }
    let o = attnc(&["ir", "heads = 4, head_dim = 64, mask = causal, softcap = 0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("softcap = 0 is invalid"));
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
fn run_reads_a_fixture_and_writes_out_and_lse() {
    let out = temp("mha.safetensors");
    let o = attnc(&[
        "run",
        "--spec",
        "heads = 4, head_dim = 64, mask = causal, scale = 0.125",
        "--input",
        &fixture("mha_causal_f32.safetensors"),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let bytes = std::fs::read(&out).unwrap();
    let written = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let got = written.tensor("out").unwrap();
    assert_eq!(got.shape(), &[2, 4, 129, 64]);
    assert_eq!(got.dtype(), safetensors::Dtype::F32);
    let lse = written.tensor("lse").unwrap();
    assert_eq!(
        (lse.shape(), lse.dtype()),
        (&[2usize, 4, 129][..], safetensors::Dtype::F32)
    );
    let golden_bytes = std::fs::read(fixture("mha_causal_f32.safetensors")).unwrap();
    let golden = safetensors::SafeTensors::deserialize(&golden_bytes).unwrap();
    let want = golden.tensor("out").unwrap();
    let f32s = |b: &[u8]| -> Vec<f64> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect()
    };
    let f64s = |b: &[u8]| -> Vec<f64> {
        b.chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    for (g, w) in f32s(got.data()).iter().zip(f64s(want.data())) {
        assert!((g - w).abs() < 1e-5 + 1e-4 * w.abs(), "{g} vs {w}");
    }
}

#[test]
fn run_rejects_bad_inputs_with_exit_code_2() {
    let out = temp("unused.safetensors");
    let out = out.to_str().unwrap();
    let cases = [
        // A tensor the spec needs is not in the file.
        (
            "heads = 8, head_dim = 32, mla(latent_rank = 64, rope_dim = 16)",
            fixture("mha_causal_f32.safetensors"),
            "no tensor `q_nope`",
        ),
        // Shapes that do not fit the spec name the tensor and the expected shape.
        (
            "heads = 8, head_dim = 64",
            fixture("mha_causal_f32.safetensors"),
            "tensor `q` has shape [2, 4, 129, 64], expected [2, 8, 129, 64]",
        ),
        // The file's dtype differs from the spec's.
        (
            "heads = 8, kv_heads = 2, head_dim = 64",
            fixture("gqa_8q2kv_causal_bf16.safetensors"),
            "tensor `q` is bf16, expected f32",
        ),
        // Not a safetensors file.
        (
            "heads = 4, head_dim = 64",
            fixture("manifest.json"),
            "not a valid safetensors file",
        ),
        (
            "heads = 4, head_dim = 64",
            "/nonexistent.safetensors".into(),
            "/nonexistent.safetensors",
        ),
    ];
    for (spec, input, message) in cases {
        let o = attnc(&["run", "--spec", spec, "--input", &input, "--output", out]);
        assert_eq!(o.status.code(), Some(2), "{spec}: {}", stderr(&o));
        assert!(stderr(&o).contains(message), "{spec}: {}", stderr(&o));
    }
}

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
    let o = attnc(&["bench", spec, "--backend", "gpu-sim"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("use cpu or cuda"), "{}", stderr(&o));
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
    let o = attnc(&["bench-decode", spec, "--backend", "gpu-sim"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("use cpu or cuda"), "{}", stderr(&o));
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
fn model_commands_run_a_checkpoint() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf-tiny/llama_gqa"
    );
    let o = attnc(&["params", "--model", dir, "--seq", "1024"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    // 2 layers x (q 64x64 + k, v 32x64 + o 64x64) = 24576 attention parameters.
    assert!(text.contains("attention           24576"), "{text}");
    assert!(text.contains("512 bytes per token"), "{text}");
    let out = std::env::temp_dir().join(format!(
        "attn-cli-logits-{}.safetensors",
        std::process::id()
    ));
    let o = attnc(&[
        "logits",
        "--model",
        dir,
        "--tokens",
        "5,6,7,8",
        "--incremental",
        "2",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = attn::runtime::io::read_safetensors(&out, &["logits"]).unwrap();
    assert_eq!(t[0].shape(), [1, 4, 256]);
    // The whole model resident on the gpu-sim device gives the CPU's logits.
    let logits_on = |backend: &str| {
        let o = attnc(&[
            "logits",
            "--model",
            dir,
            "--tokens",
            "5,6,7,8",
            "--backend",
            backend,
            "--output",
            out.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(0), "{backend}: {}", stderr(&o));
        attn::runtime::io::read_safetensors(&out, &["logits"]).unwrap()[0].to_f32_vec()
    };
    let (cpu, sim) = (logits_on("cpu"), logits_on("gpu-sim"));
    assert_eq!(cpu.len(), 4 * 256);
    for (a, b) in sim.iter().zip(&cpu) {
        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
    }
    let o = attnc(&[
        "generate",
        "--model",
        dir,
        "--tokens",
        "1,2,3",
        "--max-new-tokens",
        "5",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim().split(',').count(), 5, "{}", stdout(&o));
    for bad in [
        vec!["generate", "--model", dir, "--tokens", "1,x"],
        vec![
            "generate", "--model", dir, "--tokens", "1", "--top-p", "1.5",
        ],
        vec![
            "logits",
            "--model",
            dir,
            "--tokens",
            "1,2",
            "--incremental",
            "3",
            "--output",
            "/tmp/x",
        ],
        vec!["params", "--model", "/nonexistent-model-dir"],
    ] {
        let o = attnc(&bad);
        assert_eq!(o.status.code(), Some(2), "{bad:?}: {}", stderr(&o));
        assert!(stderr(&o).starts_with("error:"), "{bad:?}: {}", stderr(&o));
    }
}

#[test]
fn emit_writes_the_gpu_kernel() {
    let spec = "heads = 2, head_dim = 8, mask = causal, position = alibi";
    let o = attnc(&["emit", spec, "--emit", "gpu-ir"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).starts_with("kernel attention_forward("),
        "{}",
        stdout(&o)
    );
    let out = std::env::temp_dir().join(format!("attn-emit-{}.ptx", std::process::id()));
    let o = attnc(&[
        "emit",
        spec,
        "--target",
        "sm_80",
        "--emit",
        "ptx",
        "-o",
        out.to_str().unwrap(),
    ]);
    if cfg!(feature = "llvm") {
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let ptx = std::fs::read_to_string(&out).unwrap();
        assert!(ptx.contains(".target sm_80") && ptx.contains(".entry attention_forward"));
    } else {
        assert_eq!(o.status.code(), Some(2));
        assert!(stderr(&o).contains("`llvm` feature"), "{}", stderr(&o));
    }
    let o = attnc(&["emit", spec, "--target", "sm_70"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn emit_for_sm_90a_writes_the_warp_specialized_forward() {
    let spec = "heads = 8, head_dim = 128, mask = causal, dtype = bf16";
    let o = attnc(&["emit", spec, "--target", "sm_90a", "--emit", "gpu-ir"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let ir = stdout(&o);
    assert!(ir.starts_with("kernel attention_forward_wgmma("), "{ir}");
    for op in [
        "wgmma.m64n128k16.bf16",
        "tma.load",
        "mbarrier.wait",
        "setmaxnreg.inc 240",
    ] {
        assert!(ir.contains(op), "{op}");
    }
    if cfg!(feature = "llvm") {
        let o = attnc(&["emit", spec, "--target", "sm_90a", "--emit", "ptx"]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let ptx = stdout(&o);
        for op in [
            ".target sm_90a",
            "wgmma.mma_async",
            "cp.async.bulk.tensor",
            "setmaxnreg",
        ] {
            assert!(ptx.contains(op), "{op}");
        }
    }
    // A spec the kernel does not take (head dim 96) gets the mma.sync forward.
    let o = attnc(&[
        "emit",
        "heads = 8, head_dim = 96, position = rope, dtype = bf16",
        "--target",
        "sm_90a",
        "--emit",
        "gpu-ir",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("kernel attention_forward_tc("));
}

/// `ATTN_GPU_WGMMA=1` sends forward calls to the sm_90a kernel; on the interpreter the bf16
/// GQA golden case still meets twice PyTorch's own bf16 error.
/// `attnc run` of the bf16 GQA golden case on `gpu-sim` with the environment setting `name`
/// set to `value`, writing `out`.
fn run_gqa_bf16_on_the_interpreter(name: &str, value: &str, out: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_attnc"))
        .args([
            "run",
            "--spec",
            "heads = 8, kv_heads = 2, head_dim = 64, scale = 0.125, dtype = bf16, mask = causal",
            "--input",
            &fixture("gqa_8q2kv_causal_bf16.safetensors"),
            "--output",
            out.to_str().unwrap(),
            "--backend",
            "gpu-sim",
        ])
        .env("ATTN_CACHE_DIR", test_cache())
        .env(name, value)
        .output()
        .expect("attnc runs")
}

#[test]
fn the_sm_90a_forward_meets_the_bf16_golden_case_on_the_interpreter() {
    let out = temp("gqa-wgmma.safetensors");
    let o = run_gqa_bf16_on_the_interpreter("ATTN_GPU_WGMMA", "1", &out);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_meets_the_gqa_bf16_case(&out);
}

/// `out` in `file` within twice PyTorch's own bf16 error on the bf16 GQA golden case (7.5e-3)
/// of its float64 output.
fn assert_meets_the_gqa_bf16_case(file: &std::path::Path) {
    let g = tensor_values(file, "out");
    let w = tensor_values(fixture("gqa_8q2kv_causal_bf16.safetensors"), "out");
    assert_eq!(g.len(), w.len());
    let worst = g
        .iter()
        .zip(&w)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f64::max);
    assert!(worst <= 2.0 * 7.531473600546956e-3, "max error {worst}");
}

#[test]
fn a_mistyped_wgmma_setting_is_refused_not_ignored() {
    let out = temp("gqa-wgmma-bad.safetensors");
    let o = run_gqa_bf16_on_the_interpreter("ATTN_GPU_WGMMA", "yes", &out);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("ATTN_GPU_WGMMA is `yes`"), "{err}");
    assert!(!out.exists(), "no output is written");
}

#[test]
fn a_mistyped_warps_setting_is_refused_and_twelve_warps_run() {
    let out = temp("gqa-warps-bad.safetensors");
    let o = run_gqa_bf16_on_the_interpreter("ATTN_GPU_MMA_WARPS", "16", &out);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("ATTN_GPU_MMA_WARPS is `16`"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists(), "no output is written");
    let out = temp("gqa-warps-12.safetensors");
    let o = run_gqa_bf16_on_the_interpreter("ATTN_GPU_MMA_WARPS", "12", &out);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_meets_the_gqa_bf16_case(&out);
}

#[test]
fn run_on_the_gpu_backends() {
    let out = temp("seq7-gpu.safetensors");
    let spec = "heads = 4, head_dim = 64, mask = causal, scale = 0.125";
    let args = |backend: &'static str| {
        vec![
            "run".to_string(),
            "--spec".into(),
            spec.into(),
            "--input".into(),
            fixture("seq7_causal_f32.safetensors"),
            "--output".into(),
            out.to_str().unwrap().into(),
            "--backend".into(),
            backend.into(),
        ]
    };
    let run = |backend| {
        let a = args(backend);
        attnc(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let o = run("gpu-sim");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let g = tensor_values(&out, "out");
    let w = tensor_values(fixture("seq7_causal_f32.safetensors"), "out");
    assert_eq!(g.len(), w.len());
    for (g, w) in g.iter().zip(&w) {
        assert!((g - w).abs() < 1e-5 + 1e-4 * w.abs(), "{g} vs {w}");
    }
    // Without a GPU (CI has none), the device backend is a clean error.
    let o = run("cuda");
    if o.status.code() != Some(0) {
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(
            stderr(&o).contains("cuda") || stderr(&o).contains("CUDA"),
            "{}",
            stderr(&o)
        );
    }
}

/// MLA through `attnc run --backend gpu-sim` (inputs absorbed on the host, the GPU kernel on
/// the interpreter) meets the golden case's tolerance.
#[test]
fn run_mla_on_the_gpu_interpreter() {
    let out = temp("mla-gpu.safetensors");
    let spec = "heads = 8, head_dim = 32, mla(latent_rank = 64, rope_dim = 16), mask = causal, \
                scale = 0.14433756729740643";
    let input = fixture("mla_causal_f32.safetensors");
    let o = attnc(&[
        "run",
        "--spec",
        spec,
        "--input",
        &input,
        "--output",
        out.to_str().unwrap(),
        "--backend",
        "gpu-sim",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let bytes = std::fs::read(&out).unwrap();
    let got = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let golden_bytes = std::fs::read(&input).unwrap();
    let golden = safetensors::SafeTensors::deserialize(&golden_bytes).unwrap();
    let got = got.tensor("out").unwrap();
    let want = golden.tensor("out").unwrap();
    assert_eq!(got.shape(), want.shape());
    let g = got
        .data()
        .chunks_exact(4)
        .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())));
    let w = want
        .data()
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()));
    for (g, w) in g.zip(w) {
        assert!((g - w).abs() < 1e-5 + 1e-4 * w.abs(), "{g} vs {w}");
    }
}

/// Inputs that used to crash, hang or wrap: each exits 2 with a message naming the problem,
/// quickly and with bounded output.
#[test]
fn hostile_inputs_are_refused_with_exit_2() {
    let deep = format!(
        "heads = 2, head_dim = 8, score_mod = |s, b, h, q, k| {}s{}",
        "(".repeat(3000),
        ")".repeat(3000)
    );
    let many = format!("heads = 8, head_dim = 64{}", ", heads = 4".repeat(5000));
    let digits = format!("heads = {}, head_dim = 64", "9".repeat(60_000));
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf-tiny/llama_gqa"
    );
    let generate = |extra: &[&'static str]| {
        let mut args = vec!["generate", "--model", model, "--tokens", "1,2"];
        args.extend_from_slice(extra);
        args
    };
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["check", &deep], "brackets nest too deeply"),
        (vec!["check", &many], "more errors"),
        (vec!["check", &digits], "characters long"),
        (
            vec!["check", "-heads = 4, head_dim = 64"],
            "expected a key name",
        ),
        (vec!["check", "@/dev/zero"], "is a character device"),
        (
            vec![
                "explain",
                "heads = 4, head_dim = 64",
                "--seq",
                "18446744073709551615",
            ],
            "does not fit in 64 bits",
        ),
        (
            vec![
                "bench",
                "heads = 4, head_dim = 64",
                "--seq",
                "1048576",
                "--batch",
                "4096",
            ],
            "GiB of memory",
        ),
        (
            vec![
                "bench-decode",
                "heads = 32, head_dim = 128",
                "--kv-len",
                "1048576",
                "--batch",
                "4096",
            ],
            "GiB of memory",
        ),
        (vec!["peak", "--seconds", "inf"], "allowed: more than 0"),
        (
            generate(&["--max-new-tokens", "18446744073709551615"]),
            "2^64 tokens",
        ),
        (generate(&["--top-k", "0"]), "--top-k 0"),
        (
            vec!["ir", "heads = 4, head_dim = 64", "--seq", "1048576"],
            "16384",
        ),
        (vec!["peak", "--seconds", "NaN"], "allowed: more than 0"),
    ];
    for (args, needle) in cases {
        let o = attnc(&args);
        let err = stderr(&o);
        let shown: String = format!("{args:?}").chars().take(120).collect();
        assert_eq!(o.status.code(), Some(2), "{shown}: {err}");
        assert!(err.contains(needle), "{shown}: `{needle}` not in {err}");
        assert!(
            err.len() < 16 * 1024,
            "{shown}: {} bytes on stderr",
            err.len()
        );
    }
}

/// `attnc generate --prompt` prints exactly transformers' greedy continuation of each golden
/// prompt (the fixture's golden_generate.json), byte-level replacement characters included.
#[test]
fn generate_from_text_prints_transformers_continuation() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf-tiny/llama_tokenizer"
    );
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{dir}/golden_generate.json")).unwrap(),
    )
    .unwrap();
    // On the CPU, and resident on the gpu-sim device (every layer as GPU kernels, caches
    // and the argmax on the device).
    for backend in ["cpu", "gpu-sim"] {
        for g in golden["generate"].as_array().unwrap() {
            let prompt = g["prompt"].as_str().unwrap();
            let new_tokens = g["new_ids"].as_array().unwrap().len().to_string();
            let o = attnc(&[
                "generate",
                "--model",
                dir,
                "--prompt",
                prompt,
                "--max-new-tokens",
                &new_tokens,
                "--backend",
                backend,
            ]);
            assert_eq!(o.status.code(), Some(0), "{prompt}: {}", stderr(&o));
            assert_eq!(
                stdout(&o),
                format!("{}\n", g["new_text"].as_str().unwrap()),
                "{prompt} on {backend}"
            );
            assert!(stderr(&o).contains("tokens/s"), "{}", stderr(&o));
        }
    }
    let research = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/models/llama-100m.toml"
    );
    let o = attnc(&["generate", "--model", research, "--prompt", "hi"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("no tokenizer"), "{}", stderr(&o));
    let o = attnc(&[
        "generate", "--model", dir, "--prompt", "hi", "--tokens", "1",
    ]);
    assert_eq!(o.status.code(), Some(2), "--prompt and --tokens together");
    let o = attnc(&["generate", "--model", dir, "--prompt", ""]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--prompt is empty"), "{}", stderr(&o));
    let o = attnc(&[
        "generate",
        "--model",
        dir,
        "--prompt",
        "hi",
        "--backend",
        "tpu",
    ]);
    assert_eq!(o.status.code(), Some(2), "an unknown backend");
}

#[test]
fn peak_memory_reports_the_read_ceiling() {
    let o = attnc(&["peak", "--memory", "--seconds", "0.05"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    // "memory reads: X GB/s on 1 thread, Y GB/s on N"
    let rates: Vec<f64> = text
        .split_whitespace()
        .filter_map(|w| w.parse::<f64>().ok())
        .collect();
    assert!(text.starts_with("memory reads:"), "{text}");
    assert!(
        rates.len() >= 2 && rates[0] > 0.0 && rates[1] > 0.0,
        "{text}"
    );
}

#[test]
fn grad_rejects_bad_inputs_with_exit_code_2() {
    let out = temp("grad-unused.safetensors");
    let out = out.to_str().unwrap();
    // A forward fixture has q, k and v but no dout.
    let o = attnc(&[
        "grad",
        "--spec",
        "heads = 4, head_dim = 64, mask = causal",
        "--input",
        &fixture("mha_causal_f32.safetensors"),
        "--output",
        out,
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("dout"), "{}", stderr(&o));
    // The spec's head count disagrees with the tensors.
    let golden = format!(
        "{}/tests/fixtures/gradients/mha_causal_f32.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let o = attnc(&[
        "grad",
        "--spec",
        "heads = 2, head_dim = 64",
        "--input",
        &golden,
        "--output",
        out,
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("`q`") || stderr(&o).contains("q"),
        "{}",
        stderr(&o)
    );
    // An MLA spec reads MLA's tensors, and says which one the file lacks.
    let o = attnc(&[
        "grad",
        "--spec",
        "heads = 2, head_dim = 16, mla(latent_rank = 32, rope_dim = 16)",
        "--input",
        &golden,
        "--output",
        out,
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("no tensor `q_nope`"), "{}", stderr(&o));
}

#[test]
fn grad_runs_on_the_gpu_interpreter() {
    let golden = format!(
        "{}/tests/fixtures/gradients/top_left_sq_gt_skv_f32.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let out = temp("grad-gpu-sim.safetensors");
    let o = attnc(&[
        "grad",
        "--spec",
        "heads = 2, head_dim = 16, mask = causal(top_left)",
        "--input",
        &golden,
        "--output",
        out.to_str().unwrap(),
        "--backend",
        "gpu-sim",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for name in ["dq", "dk", "dv"] {
        let (g, w) = (tensor_values(&out, name), tensor_values(&golden, name));
        assert_eq!(g.len(), w.len());
        for (g, w) in g.iter().zip(&w) {
            assert!((g - w).abs() <= 1e-4 + 1e-3 * w.abs(), "{name}: {g} vs {w}");
        }
    }
}

#[test]
fn ir_grad_prints_the_derivative_and_its_notes() {
    let o = attnc(&[
        "ir",
        "heads = 4, head_dim = 64, softcap = 30.0, score_mod = |s, b, h, q, k| s.max(-5.0)",
        "--grad",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("-- d score / d raw score (folded) --"),
        "{text}"
    );
    assert!(text.contains("tanh"), "{text}");
    assert!(text.contains("note: `"), "{text}");
    assert!(text.contains("plan Backward"), "{text}");
}

#[test]
fn check_notes_a_piecewise_derivative_on_stderr() {
    let o = attnc(&[
        "check",
        "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| s.abs()",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // At the tokens: `s.abs()` starts at column 55.
    assert!(
        stderr(&o).contains("note: backward: `score.abs()`: the derivative is piecewise")
            && stderr(&o).contains(" --> 1:55\n"),
        "{}",
        stderr(&o)
    );
    let o = attnc(&["check", "heads = 4, head_dim = 64, softcap = 30.0"]);
    assert_eq!(stderr(&o), "");
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
    for (backend, said) in [("cuda", "cuda"), ("gpu-sim", "is not timed")] {
        let o = attnc(&["bench", spec, "--backward", "--backend", backend]);
        assert_eq!(o.status.code(), Some(2));
        assert!(stderr(&o).contains(said), "{}", stderr(&o));
    }
}

#[test]
fn emit_writes_every_kernel_and_a_manifest() {
    let dir = temp("emit-all");
    let spec = "heads = 4, kv_heads = 2, head_dim = 64, mask = causal, dtype = bf16";
    let o = attnc(&[
        "emit",
        spec,
        "--emit",
        "gpu-ir",
        "--target",
        "sm_80",
        "--target",
        "sm_90",
        "--out-dir",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let kernels = manifest["kernels"].as_array().unwrap();
    assert!(
        manifest["spec"]
            .as_str()
            .unwrap()
            .starts_with("heads = 4, kv_heads = 2")
    );
    for role in ["forward", "decode", "backward dq", "backward dkdv"] {
        for target in ["sm_80", "sm_90"] {
            let k = kernels
                .iter()
                .find(|k| k["role"] == role && k["target"] == target)
                .unwrap_or_else(|| panic!("no {role} for {target}"));
            let text = std::fs::read_to_string(dir.join(k["file"].as_str().unwrap())).unwrap();
            let name = k["launch"]["name"].as_str().unwrap();
            assert!(
                text.starts_with(&format!("kernel {name}")),
                "{role}: {}",
                &text[..40]
            );
            assert!(k["launch"]["threads"].as_u64().unwrap() > 0);
        }
    }
    // One kernel for several targets is refused.
    let o = attnc(&["emit", spec, "--target", "sm_80", "--target", "sm_90"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("one --target"), "{}", stderr(&o));
}

#[test]
fn the_kernel_cache_serves_a_second_process() {
    let cache = temp("kernel-cache");
    std::fs::remove_dir_all(&cache).ok();
    let list = attnc_with_cache(&["cache", "list"], &cache);
    assert_eq!(list.status.code(), Some(0), "{}", stderr(&list));
    assert!(stdout(&list).contains("(0 entries)"), "{}", stdout(&list));
    let spec = "heads = 4, head_dim = 64, mask = causal";
    let out = temp("cached.ptx");
    let emit = || {
        attnc_with_cache(
            &[
                "emit",
                spec,
                "--target",
                "sm_80",
                "-o",
                out.to_str().unwrap(),
            ],
            &cache,
        )
    };
    let first = emit();
    if !cfg!(feature = "llvm") {
        // Nothing cached and no compiler: a clear error, exit 2.
        assert_eq!(first.status.code(), Some(2));
        assert!(
            stderr(&first).contains("`llvm` feature"),
            "{}",
            stderr(&first)
        );
        return;
    }
    assert_eq!(first.status.code(), Some(0), "{}", stderr(&first));
    assert!(
        stderr(&first).contains("attention_forward (forward, sm_80): compiled"),
        "{}",
        stderr(&first)
    );
    let compiled = std::fs::read_to_string(&out).unwrap();
    let second = emit();
    assert_eq!(second.status.code(), Some(0), "{}", stderr(&second));
    assert!(
        stderr(&second).contains("(forward, sm_80): disk cache"),
        "{}",
        stderr(&second)
    );
    assert_eq!(std::fs::read_to_string(&out).unwrap(), compiled);
    let list = attnc_with_cache(&["cache", "list"], &cache);
    assert!(stdout(&list).contains("(1 entries)") && stdout(&list).contains("attention_forward"));
    let clear = attnc_with_cache(&["cache", "clear"], &cache);
    assert!(
        stdout(&clear).contains("removed 1 kernels"),
        "{}",
        stdout(&clear)
    );
    assert!(stderr(&emit()).contains(": compiled"));
}
