//! `attnc explain`: KV-cache bytes, parameters and FLOPs of a spec.

use crate::{attnc, row, stderr, stdout};

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
fn explain_model_shows_each_attention_kind_and_its_layers() {
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf-tiny/qwen3_sliding"
    );
    let o = attnc(&["explain", "--model", model, "--seq", "64"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = stdout(&o);
    assert!(
        t.starts_with("3 layers, width 64, 2 attention kinds"),
        "{t}"
    );
    assert!(
        t.contains("kind 0: layers 0\n") && t.contains("kind 1: layers 1, 2\n"),
        "{t}"
    );
    // The sliding kind's cache holds its window of 8 tokens: 256 bytes x 8 x 2 layers.
    assert!(
        t.contains("4.00 KiB (4096 bytes) at 8 tokens (the window; --seq 64) x 2 layers"),
        "{t}"
    );
    // A spec and a model together are refused.
    let o = attnc(&["explain", "heads = 2, head_dim = 8", "--model", model]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = attnc(&["explain", "--model", "/nonexistent/model"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("no such file or folder"),
        "{}",
        stderr(&o)
    );
}
