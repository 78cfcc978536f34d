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
