//! Accounting: KV bytes, parameters and FLOPs, on well-known shapes and against the reference.

use attn_dsl::accounting::{attention_params, forward_flops, kept_pairs, kv_cache_bytes_per_token};
use attn_dsl::reference::{self, Array, Inputs};
use attn_dsl::{AttentionSpec, CausalAlign, Mask};
use proptest::prelude::*;

fn spec(text: &str) -> AttentionSpec {
    text.parse().unwrap()
}

#[test]
fn llama3_8b_caches_4096_bytes_per_token_per_layer() {
    let s = spec("heads = 32, kv_heads = 8, head_dim = 128, dtype = bf16");
    assert_eq!(kv_cache_bytes_per_token(&s), 4096);
    // Llama-3-8B attention: 4096 -> 4096 (q), 1024 (k), 1024 (v), 4096 -> 4096 (o).
    let params = attention_params(&s, 4096).unwrap();
    assert_eq!(
        params.parts,
        vec![
            ("q_proj", 4096 * 4096),
            ("k_proj", 4096 * 1024),
            ("v_proj", 4096 * 1024),
            ("o_proj", 4096 * 4096)
        ]
    );
    assert_eq!(params.total(), 41_943_040);
}

#[test]
fn deepseek_v3_mla_caches_1152_bytes_per_token_per_layer() {
    let s = spec(
        "heads = 128, head_dim = 128, v_head_dim = 128, mla(latent_rank = 512, rope_dim = 64), \
         dtype = bf16",
    );
    assert_eq!(kv_cache_bytes_per_token(&s), 1152);
    let params = attention_params(&s, 7168).unwrap();
    assert_eq!(
        params.parts,
        vec![
            ("q_proj", 7168 * 128 * 192),
            ("kv_a_proj", 7168 * 576),
            ("kv_a_norm", 512),
            ("kv_b_proj", 512 * 128 * 256),
            ("o_proj", 128 * 128 * 7168)
        ]
    );
}

#[test]
fn cache_bytes_scale_with_dtype_and_kv_heads() {
    assert_eq!(
        kv_cache_bytes_per_token(&spec("heads = 32, head_dim = 128")),
        32 * 256 * 4
    );
    assert_eq!(
        kv_cache_bytes_per_token(&spec(
            "heads = 32, kv_heads = 1, head_dim = 128, dtype = f16"
        )),
        256 * 2
    );
    assert_eq!(
        kv_cache_bytes_per_token(&spec("heads = 8, head_dim = 64, v_head_dim = 32")),
        8 * 96 * 4
    );
}

#[test]
fn causal_prefill_counts_half_the_pairs_plus_the_diagonal() {
    let s = spec("heads = 16, head_dim = 128, mask = causal");
    let f = forward_flops(&s, 2, 2048, 2048).unwrap();
    assert_eq!(f.dense, 4 * 2 * 16 * 2048 * 2048 * 128);
    assert_eq!(f.with_skipping, 4 * 2 * 16 * (2048 * 2049 / 2) * 128);
    assert!(!f.custom_mask);
    let decode = forward_flops(&s, 1, 1, 4096).unwrap();
    assert_eq!(decode.with_skipping, decode.dense);
}

#[test]
fn mla_flops_are_counted_in_the_absorbed_form() {
    let s = spec("heads = 4, head_dim = 16, mla(latent_rank = 32, rope_dim = 8)");
    let f = forward_flops(&s, 1, 10, 10).unwrap();
    assert_eq!(f.dense, 2 * (40 + 32) * 4 * 100);
}

/// With q = 0 every kept score is 0, so the reference's `exp(lse)` counts the kept keys of each
/// row: an oracle for [`kept_pairs`] that shares none of its code.
fn kept_by_reference(mask: Mask, sq: usize, skv: usize) -> u64 {
    let mut s = AttentionSpec::new(1, 1);
    s.mask = mask;
    let q = Array::zeros(&[1, 1, sq, 1]);
    let kv = Array::zeros(&[1, 1, skv, 1]);
    let o = reference::attention(
        &s,
        &Inputs {
            q: &q,
            k: &kv,
            v: &kv,
            position_offset: 0,
        },
    )
    .unwrap();
    o.lse.data().iter().map(|l| l.exp().round() as u64).sum()
}

fn any_mask() -> impl Strategy<Value = Mask> {
    prop_oneof![
        Just(Mask::None),
        Just(Mask::Causal(CausalAlign::BottomRight)),
        Just(Mask::Causal(CausalAlign::TopLeft)),
        (1u64..40).prop_map(|window| Mask::SlidingWindow { window }),
    ]
}

proptest! {
    #[test]
    fn kept_pairs_agree_with_the_reference(mask in any_mask(), sq in 1usize..40, skv in 1usize..40) {
        prop_assert_eq!(kept_pairs(mask, sq as u64, skv as u64), Some(kept_by_reference(mask, sq, skv)));
    }
}

#[test]
fn counts_at_extreme_lengths_are_exact_or_refused() {
    let n: u64 = 1 << 31;
    let causal = Mask::Causal(CausalAlign::BottomRight);
    assert_eq!(kept_pairs(causal, n, n), Some(n * (n + 1) / 2));
    assert_eq!(
        kept_pairs(Mask::SlidingWindow { window: 1024 }, n, n),
        Some(1024 * n - 1024 * 1023 / 2)
    );
    // More keys than queries: every row keeps the prefix before the queries too.
    assert_eq!(kept_pairs(causal, 4, 1 << 40), Some(4 * (1 << 40) - 6));
    for mask in [causal, Mask::None, Mask::Causal(CausalAlign::TopLeft)] {
        assert_eq!(kept_pairs(mask, u64::MAX, u64::MAX), None);
    }
    let s = spec("heads = 32, head_dim = 128, mask = causal");
    assert!(forward_flops(&s, 1, u64::MAX, u64::MAX).is_none());
    assert!(forward_flops(&s, u64::MAX, 1, 1).is_none());
    assert!(forward_flops(&s, 1, 1 << 20, 1 << 20).is_some());
    assert!(attention_params(&s, u64::MAX / 2).is_none());
    assert!(attention_params(&s, 1 << 30).is_some());
}

/// The DIFF Transformer's layer at a width of 2048: 8 differential heads of 2 x 128 query/key
/// dims and 256 value dims project as a 16-head softmax layer does, plus lambda and the norm.
#[test]
fn differential_heads_project_half_the_value_and_output_heads() {
    let s = spec(
        "heads = 16, kv_heads = 16, head_dim = 128, v_head_dim = 256, mask = causal, \
         differential = lambda",
    );
    let params = attention_params(&s, 2048).unwrap();
    let part = |name: &str| params.parts.iter().find(|(n, _)| *n == name).unwrap().1;
    assert_eq!(part("q_proj"), 2048 * 2048);
    assert_eq!(part("k_proj"), 2048 * 2048);
    assert_eq!(part("v_proj"), 2048 * 2048);
    assert_eq!(part("o_proj"), 2048 * 2048);
    assert_eq!(part("lambda"), 4 * 128);
    assert_eq!(part("subln"), 256);
    assert_eq!(params.total(), 4 * 2048 * 2048 + 4 * 128 + 256);
    // The caches hold each value head once per component, as the kernels read them.
    assert_eq!(kv_cache_bytes_per_token(&s), 16 * (128 + 256) * 4);
}
