//! Accounting: what a spec costs in KV-cache memory, parameters and FLOPs.

use crate::spec::{AttentionSpec, CausalAlign, KvLayout, Mask};

/// Bytes of KV cache one token takes in one layer, in the spec's dtype.
///
/// Per-head layouts cache `kv_heads * (head_dim + v_head_dim)` values; MLA caches only the latent
/// and the shared RoPE key, `latent_rank + rope_dim` values.
pub fn kv_cache_bytes_per_token(spec: &AttentionSpec) -> u64 {
    let values = match spec.kv {
        KvLayout::Heads { kv_heads } => {
            u64::from(kv_heads) * u64::from(spec.head_dim + spec.v_head_dim)
        }
        KvLayout::Mla(mla) => u64::from(mla.latent_rank) + u64::from(mla.rope_dim),
    };
    values * spec.dtype.size_bytes()
}

/// Parameters of one attention layer for a model of width `model_dim`, by projection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttentionParams {
    /// `(name, count)` per weight, in the order a layer applies them.
    pub parts: Vec<(&'static str, u64)>,
}

impl AttentionParams {
    /// The total over all parts.
    pub fn total(&self) -> u64 {
        self.parts.iter().map(|(_, n)| n).sum()
    }
}

/// Parameter count of one attention layer (no biases).
///
/// Per-head layouts: `q_proj`, `k_proj`, `v_proj`, `o_proj`. MLA (DeepSeek layout, without a
/// query low-rank compression): `q_proj` to `heads * (head_dim + rope_dim)`, `kv_a_proj` (down to
/// `latent_rank + rope_dim`), `kv_a_norm` (RMSNorm weight of the latent), `kv_b_proj` (up to
/// `heads * (head_dim + v_head_dim)`), `o_proj`.
pub fn attention_params(spec: &AttentionSpec, model_dim: u64) -> AttentionParams {
    let d = model_dim;
    let h = u64::from(spec.heads);
    let (dk, dv) = (u64::from(spec.head_dim), u64::from(spec.v_head_dim));
    let parts = match spec.kv {
        KvLayout::Heads { kv_heads } => {
            let hkv = u64::from(kv_heads);
            vec![
                ("q_proj", d * h * dk),
                ("k_proj", d * hkv * dk),
                ("v_proj", d * hkv * dv),
                ("o_proj", h * dv * d),
            ]
        }
        KvLayout::Mla(mla) => {
            let (r, dr) = (u64::from(mla.latent_rank), u64::from(mla.rope_dim));
            vec![
                ("q_proj", d * h * (dk + dr)),
                ("kv_a_proj", d * (r + dr)),
                ("kv_a_norm", r),
                ("kv_b_proj", r * h * (dk + dv)),
                ("o_proj", h * dv * d),
            ]
        }
    };
    AttentionParams { parts }
}

/// Floating-point operations of one forward attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flops {
    /// Every (query, key) pair computed.
    pub dense: u64,
    /// Only the pairs the built-in mask keeps (what a kernel that skips masked tiles approaches).
    pub with_skipping: u64,
    /// Whether a custom `mask_mod` may skip more than counted here.
    pub custom_mask: bool,
}

/// Forward FLOPs of the attention core for a batch of `batch` sequences with `sq` queries
/// against `skv` keys: `2 * (qk_dim + v_dim)` per (head, query, key) pair, where MLA is counted in
/// the absorbed form the kernels run (scores over `latent_rank + rope_dim`, values over
/// `latent_rank`). Projections are not included.
pub fn forward_flops(spec: &AttentionSpec, batch: u64, sq: u64, skv: u64) -> Flops {
    let (dqk, dv) = match spec.kv {
        KvLayout::Heads { .. } => (u64::from(spec.head_dim), u64::from(spec.v_head_dim)),
        KvLayout::Mla(mla) => (
            u64::from(mla.latent_rank + mla.rope_dim),
            u64::from(mla.latent_rank),
        ),
    };
    let per_pair = 2 * (dqk + dv) * batch * u64::from(spec.heads);
    Flops {
        dense: per_pair * sq * skv,
        with_skipping: per_pair * kept_pairs(spec.mask, sq, skv),
        custom_mask: spec.mask_mod.is_some(),
    }
}

/// Number of (query, key) pairs the built-in mask keeps for `sq` queries against `skv` keys
/// (queries are the last `sq` positions, DESIGN.md "Positions").
pub fn kept_pairs(mask: Mask, sq: u64, skv: u64) -> u64 {
    let offset = skv as i128 - sq as i128;
    let clamp = |x: i128| x.clamp(0, skv as i128);
    (0..sq as i128)
        .map(|i| {
            let kept = match mask {
                Mask::None => skv as i128,
                Mask::Causal(CausalAlign::BottomRight) => clamp(offset + i + 1),
                Mask::Causal(CausalAlign::TopLeft) => clamp(i + 1),
                Mask::SlidingWindow { window } => {
                    let pos = offset + i;
                    clamp(pos + 1) - clamp(pos + 1 - window as i128)
                }
            };
            kept as u64
        })
        .sum()
}
