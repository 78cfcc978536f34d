//! `#[attention(...)]` in a user's crate: two variants side by side, each with its spec.

use attn::{AttentionSpec, attention};

#[attention(heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = alibi)]
struct Gqa;

#[attention(
    heads = 16, head_dim = 128, mla(latent_rank = 512, rope_dim = 64),
    position = rope(scaling = yarn(factor = 40, original_max_position = 4096)),
    mask_mod = |b, h, q, k| (q / 64) == (k / 64)
)]
#[derive(Debug, Default)]
struct Latent {
    _label: &'static str,
}

#[test]
fn each_struct_carries_its_own_validated_spec() {
    let gqa = Gqa::spec();
    let expected: AttentionSpec =
        "heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = alibi"
            .parse()
            .unwrap();
    assert_eq!(gqa, expected);
    assert_eq!(Gqa::SPEC_TEXT, expected.to_string());

    let latent = Latent::spec();
    assert_eq!(latent.mla().unwrap().latent_rank, 512);
    assert_eq!(latent.rope().unwrap().dim, 64);
    assert!(latent.mask_mod.as_ref().unwrap().keeps(0, 0, 70, 64));
    assert!(!latent.mask_mod.as_ref().unwrap().keeps(0, 0, 70, 63));
    assert_ne!(gqa, latent);
    // Other attributes and fields are kept.
    assert_eq!(Latent::default()._label, "");
}
