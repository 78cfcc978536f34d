//! Named specs: well-known model shapes and variants that exercise each feature. Snapshot tests,
//! benchmarks and the GPU checks all draw from this one list.

/// `(name, spec text)` pairs; every entry parses and validates.
pub const NAMED_SPECS: &[(&str, &str)] = &[
    ("mha_causal", "heads = 16, head_dim = 128, mask = causal"),
    (
        "mqa_unmasked_f16",
        "heads = 8, kv_heads = 1, head_dim = 64, dtype = f16",
    ),
    (
        "llama3_8b",
        "heads = 32, kv_heads = 8, head_dim = 128, mask = causal, dtype = bf16, \
         position = rope(base = 500000.0, scaling = llama3(factor = 8.0, low_freq_factor = 1.0, \
         high_freq_factor = 4.0, original_max_position = 8192))",
    ),
    (
        "mistral_sliding_window",
        "heads = 32, kv_heads = 8, head_dim = 128, mask = sliding_window(4096), \
         position = rope(base = 1000000.0)",
    ),
    (
        "top_left_causal",
        "heads = 4, head_dim = 64, mask = causal(top_left)",
    ),
    (
        "alibi_bloom",
        "heads = 16, head_dim = 64, mask = causal, position = alibi",
    ),
    (
        "gemma2_softcap",
        "heads = 8, kv_heads = 4, head_dim = 256, mask = causal, softcap = 50.0, scale = 0.0625, \
         position = rope, dtype = bf16",
    ),
    (
        "rope_linear_interleaved",
        "heads = 8, head_dim = 96, mask = causal, position = rope(dim = 64, layout = interleaved, \
         scaling = linear(factor = 4.0))",
    ),
    (
        "rope_dynamic_ntk",
        "heads = 8, head_dim = 64, mask = causal, position = rope(scaling = dynamic(factor = 2.0, \
         original_max_position = 2048))",
    ),
    (
        "deepseek_v3_mla",
        "heads = 128, head_dim = 128, mla(latent_rank = 512, rope_dim = 64), mask = causal, \
         dtype = bf16, position = rope(scaling = yarn(factor = 40.0, original_max_position = \
         4096, mscale = 1.0, mscale_all_dim = 1.0))",
    ),
    (
        "custom_distance_penalty",
        "heads = 8, head_dim = 64, mask = causal, \
         score_mod = |score, b, h, q, k| score - 0.5 * ((q - k) as f32).abs()",
    ),
    (
        "custom_block_diagonal",
        "heads = 8, head_dim = 64, mask_mod = |b, h, q, k| (q / 64) == (k / 64)",
    ),
    (
        "custom_local_global",
        "heads = 8, head_dim = 64, mask = causal, \
         mask_mod = |b, h, q, k| if h < 4 { q - k < 256 } else { true }, \
         score_mod = |s, b, h, q, k| if h < 4 { s } else { s * 0.5 }",
    ),
];

/// The spec text of a named spec.
pub fn named(name: &str) -> Option<&'static str> {
    NAMED_SPECS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, text)| *text)
}
