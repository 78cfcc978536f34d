//! Accounting: what a spec costs in KV-cache memory, parameters and FLOPs.

use crate::spec::{AttentionSpec, CausalAlign, KvLayout, Mask};

/// Bytes of KV cache one token takes in one layer, in the spec's dtype.
///
/// Per-head layouts cache `kv_heads * (head_dim + v_head_dim)` values (with differential heads,
/// each value head once per component: what attn's caches hold); MLA caches only the latent
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
    /// `(name, count)` per learnable tensor of the spec (`params(...)`, then `sinks`).
    pub learned: Vec<(String, u64)>,
}

impl AttentionParams {
    /// The total over all parts and learnable tensors (checked to fit when they were counted).
    pub fn total(&self) -> u64 {
        self.parts.iter().map(|(_, n)| n).sum::<u64>()
            + self.learned.iter().map(|(_, n)| n).sum::<u64>()
    }
}

/// Parameter count of one attention layer (no biases); `None` when a count does not fit in 64
/// bits.
///
/// Per-head layouts: `q_proj`, `k_proj`, `v_proj`, `o_proj`. MLA (DeepSeek layout, without a
/// query low-rank compression): `q_proj` to `heads * (head_dim + rope_dim)`, `kv_a_proj` (down to
/// `latent_rank + rope_dim`), `kv_a_norm` (RMSNorm weight of the latent), `kv_b_proj` (up to
/// `heads * (head_dim + v_head_dim)`), `o_proj`. Differential heads project `kv_heads / 2` value
/// heads and `heads / 2` output heads, and add lambda's four vectors and the per-head norm
/// (`subln`). Learnable tensors count by their elements.
pub fn attention_params(spec: &AttentionSpec, model_dim: u64) -> Option<AttentionParams> {
    let d = model_dim;
    let h = u64::from(spec.heads);
    let (dk, dv) = (u64::from(spec.head_dim), u64::from(spec.v_head_dim));
    // Every factor but the model width is a u32 of the spec: products of two fit in u64.
    let parts = match spec.kv {
        KvLayout::Heads { kv_heads } => {
            let hkv = u64::from(kv_heads);
            let (hv, ho) = (
                u64::from(spec.value_heads()),
                u64::from(spec.output_heads()),
            );
            let mut parts = vec![
                ("q_proj", d.checked_mul(h * dk)?),
                ("k_proj", d.checked_mul(hkv * dk)?),
                ("v_proj", d.checked_mul(hv * dv)?),
                ("o_proj", d.checked_mul(ho * dv)?),
            ];
            if spec.differential.is_some() {
                parts.extend([("lambda", 4 * dk), ("subln", dv)]);
            }
            parts
        }
        KvLayout::Mla(mla) => {
            let (r, dr) = (u64::from(mla.latent_rank), u64::from(mla.rope_dim));
            vec![
                ("q_proj", d.checked_mul(h * (dk + dr))?),
                ("kv_a_proj", d.checked_mul(r + dr)?),
                ("kv_a_norm", r),
                ("kv_b_proj", r.checked_mul(h * (dk + dv))?),
                ("o_proj", d.checked_mul(h * dv)?),
            ]
        }
    };
    // Validation bounds learnable tensors to 2^24 elements in all.
    let learned: Vec<(String, u64)> = spec
        .learnable_tensors()
        .into_iter()
        .map(|(name, shape)| (name, shape.iter().map(|&d| d as u64).product()))
        .collect();
    parts
        .iter()
        .map(|(_, n)| *n)
        .chain(learned.iter().map(|(_, n)| *n))
        .try_fold(0u64, |sum, n| sum.checked_add(n))?;
    Some(AttentionParams { parts, learned })
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
/// `latent_rank`). Projections are not included. Counted in closed form, in time independent of
/// the lengths; `None` when a count does not fit in 64 bits.
pub fn forward_flops(spec: &AttentionSpec, batch: u64, sq: u64, skv: u64) -> Option<Flops> {
    let (dqk, dv) = match spec.kv {
        KvLayout::Heads { .. } => (u64::from(spec.head_dim), u64::from(spec.v_head_dim)),
        KvLayout::Mla(mla) => (
            u64::from(mla.latent_rank) + u64::from(mla.rope_dim),
            u64::from(mla.latent_rank),
        ),
    };
    let per_pair = (2 * (dqk + dv))
        .checked_mul(batch)?
        .checked_mul(u64::from(spec.heads))?;
    Some(Flops {
        dense: per_pair.checked_mul(sq.checked_mul(skv)?)?,
        with_skipping: per_pair.checked_mul(kept_pairs(spec.mask, sq, skv)?)?,
        custom_mask: spec.mask_mod.is_some(),
    })
}

/// Number of (query, key) pairs the built-in mask keeps for `sq` queries against `skv` keys
/// (queries are the last `sq` positions, docs/semantics.md), in closed form; `None` when it
/// does not fit in 64 bits.
pub fn kept_pairs(mask: Mask, sq: u64, skv: u64) -> Option<u64> {
    let (n, keys) = (i128::from(sq), i128::from(skv));
    // Row i keeps clamp(first + i) keys, less clamp(first + i - window) under a window.
    let first = match mask {
        Mask::None => return sq.checked_mul(skv),
        Mask::Causal(CausalAlign::TopLeft) => 1,
        Mask::Causal(CausalAlign::BottomRight) | Mask::SlidingWindow { .. } => keys - n + 1,
    };
    let kept = clamped_sum(first, n, keys)?;
    let kept = match mask {
        Mask::SlidingWindow { window } => kept - clamped_sum(first - i128::from(window), n, keys)?,
        _ => kept,
    };
    u64::try_from(kept).ok()
}

/// The sum over `i` in `0..n` of `start + i` clamped into `[0, hi]`, for `n, hi >= 0`.
fn clamped_sum(start: i128, n: i128, hi: i128) -> Option<i128> {
    // Terms before index `rise` are below 0 and add nothing; from `top` on (top >= rise, as
    // hi >= 0) they are hi.
    let rise = (-start).clamp(0, n);
    let top = (hi - start).clamp(0, n);
    let (count, first) = (top - rise, start + rise);
    let linear = if count > 0 {
        // first + (first + 1) + ... + (first + count - 1)
        count
            .checked_mul(first)?
            .checked_add(count.checked_mul(count - 1)? / 2)?
    } else {
        0
    };
    linear.checked_add((n - top).checked_mul(hi)?)
}
