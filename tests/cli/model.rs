//! The model commands (`logits`, `generate`, `params`) on a checkpoint, and generation from text.

use crate::{attnc, stderr, stdout};

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

/// `--prompt-file` reads the prompt `--prompt` would take; a prompt is asked for by every way
/// of giving one; a mistyped `--model` path says it does not exist, not that a config.json is
/// missing inside it.
#[test]
fn prompts_from_files_and_clear_words_for_missing_inputs() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf-tiny/llama_tokenizer"
    );
    let file = crate::temp("prompt.txt");
    std::fs::write(&file, "attention is").unwrap();
    let from_text = attnc(&[
        "generate",
        "--model",
        dir,
        "--prompt",
        "attention is",
        "--max-new-tokens",
        "4",
    ]);
    let from_file = attnc(&[
        "generate",
        "--model",
        dir,
        "--prompt-file",
        file.to_str().unwrap(),
        "--max-new-tokens",
        "4",
    ]);
    assert_eq!(from_file.status.code(), Some(0), "{}", stderr(&from_file));
    assert_eq!(stdout(&from_file), stdout(&from_text));
    // A prompt file that is missing or not UTF-8 text: exit 2, naming the flag.
    let binary = crate::temp("prompt.bin");
    std::fs::write(&binary, [0x61, 0xff, 0xfe]).unwrap();
    let missing = crate::temp("no-such-prompt.txt");
    for bad in [&binary, &missing] {
        let o = attnc(&[
            "generate",
            "--model",
            dir,
            "--prompt-file",
            bad.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(
            stderr(&o).starts_with("error: --prompt-file"),
            "{}",
            stderr(&o)
        );
    }
    let o = attnc(&["generate", "--model", dir]);
    assert_eq!(o.status.code(), Some(2));
    for way in ["--tokens", "--prompt ", "--prompt-file"] {
        assert!(stderr(&o).contains(way), "{way}: {}", stderr(&o));
    }
    let typo = crate::temp("llama-100.toml");
    let o = attnc(&["params", "--model", typo.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("no such file or folder") && !stderr(&o).contains("config.json:"),
        "{}",
        stderr(&o)
    );
}

/// On gpu-sim, mixture-of-experts families (routing on the host) and MLA ones run resident and
/// give the CPU's logits.
#[test]
fn moe_and_mla_families_run_resident_on_gpu_sim_as_on_the_cpu() {
    for name in ["gpt_oss", "qwen3_moe", "deepseek_v2_moe"] {
        let dir = format!(
            "{}/tests/fixtures/hf-tiny/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        let out = std::env::temp_dir().join(format!(
            "attn-cli-families-{name}-{}.safetensors",
            std::process::id()
        ));
        let logits_on = |backend: &str| {
            let o = attnc(&[
                "logits",
                "--model",
                &dir,
                "--tokens",
                "5,6,7,8,9",
                "--backend",
                backend,
                "--output",
                out.to_str().unwrap(),
            ]);
            assert_eq!(o.status.code(), Some(0), "{name} {backend}: {}", stderr(&o));
            attn::runtime::io::read_safetensors(&out, &["logits"]).unwrap()[0].to_f32_vec()
        };
        let (cpu, sim) = (logits_on("cpu"), logits_on("gpu-sim"));
        std::fs::remove_file(&out).ok();
        assert_eq!(cpu.len(), 5 * 256);
        for (a, b) in sim.iter().zip(&cpu) {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "{name}: {a} vs {b}"
            );
        }
    }
}

/// Prompts are measured against the model's context before they cost time or memory: a
/// 300 KB prompt on a 256-position checkpoint is refused at once, and a 16 MiB one under a
/// 1.5 GB address-space limit too (tokenized whole it took 3 GB). An empty prompt file is
/// named as such.
#[test]
fn prompts_past_the_context_are_refused_before_they_are_tokenized_whole() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf-tiny/llama_tokenizer"
    );
    let long = crate::temp("long-prompt.txt");
    std::fs::write(&long, "attention is all you need.\n".repeat(300_000 / 27)).unwrap();
    let o = attnc(&[
        "generate",
        "--model",
        dir,
        "--prompt-file",
        long.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the prompt (--prompt-file) is")
            && stderr(&o).contains("allowed: at most 256 (the model's context"),
        "{}",
        stderr(&o)
    );
    #[cfg(target_os = "linux")]
    {
        let huge = crate::temp("huge-prompt.txt");
        let line = "attention is all you need.\n";
        std::fs::write(&huge, line.repeat((16 << 20) / line.len() - 1)).unwrap();
        let o = crate::attnc_under(
            "ulimit -v 1500000",
            &[
                "generate",
                "--model",
                dir,
                "--prompt-file",
                huge.to_str().unwrap(),
            ],
        );
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(
            stderr(&o).contains("allowed: at most 256"),
            "{}",
            stderr(&o)
        );
    }
    let empty = crate::temp("empty-prompt.txt");
    std::fs::write(&empty, "").unwrap();
    let o = attnc(&[
        "generate",
        "--model",
        dir,
        "--prompt-file",
        empty.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("error: --prompt-file is empty once tokenized"),
        "{}",
        stderr(&o)
    );
}

/// A research model of 256 ids reads its prompt as bytes and writes text back.
#[test]
fn byte_level_models_take_text() {
    let toml = crate::temp("bytes.toml");
    std::fs::write(
        &toml,
        "vocab = 256\nhidden = 32\nlayers = 1\n\
         attention = \"heads = 2, head_dim = 16, mask = causal, position = rope\"\n",
    )
    .unwrap();
    let o = attnc(&[
        "generate",
        "--model",
        toml.to_str().unwrap(),
        "--prompt",
        "héllo",
        "--max-new-tokens",
        "8",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("8 tokens"),
        "the text path's rates: {}",
        stderr(&o)
    );
    // Random weights write random bytes, as text: never a list of ids.
    assert!(
        !stdout(&o)
            .trim()
            .split(',')
            .all(|t| t.parse::<u32>().is_ok()),
        "{}",
        stdout(&o)
    );
}

/// A checkpoint whose weights hold NaN gives NaN logits: generation stops with an error
/// saying so, rather than printing token 0 again and again, on the CPU and resident on a
/// device (whose greedy argmax chooses nothing from a row of NaN).
#[test]
fn a_model_with_nan_logits_generates_nothing() {
    let from = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf-tiny/llama_gqa"
    );
    let dir = crate::temp("nan-llama");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(format!("{from}/config.json"), dir.join("config.json")).unwrap();
    let weights = std::path::Path::new(from).join("model.safetensors");
    crate::with_value(
        &weights,
        &dir.join("model.safetensors"),
        "model.norm.weight",
        0,
        f32::NAN,
    );
    for sampling in [
        &[][..],
        &["--temperature", "0.8"][..],
        &["--backend", "gpu-sim"][..],
        &["--backend", "gpu-sim", "--temperature", "0.8"][..],
    ] {
        let mut args = vec![
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--tokens",
            "1,2,3",
        ];
        args.extend(sampling);
        let o = attnc(&args);
        assert_eq!(o.status.code(), Some(2), "{sampling:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("the model's logits hold"),
            "{}",
            stderr(&o)
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
