//! What a cache stores per token, derived from the spec.

use crate::error::RuntimeError;
use attn_dsl::{AttentionSpec, DType, KvLayout};
use codegen::plan::RopePrologue;

/// The rows a cache keeps per token and kv head, in the spec's dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheLayout {
    /// Storage dtype (the spec's).
    pub dtype: DType,
    /// Kv heads stored (1 for MLA: the latent is shared by every head).
    pub kv_heads: usize,
    /// Values in a key row: `head_dim`, or for MLA `latent_rank + rope_dim` (the latent and the
    /// shared RoPE key).
    pub k_dim: usize,
    /// Values in a value row: `v_head_dim`, or for MLA `latent_rank`.
    pub v_dim: usize,
    /// MLA: values are the first `latent_rank` values of the key rows, not stored twice.
    pub values_in_keys: bool,
    /// RoPE applied to keys as they are appended.
    pub rope: Option<RopePrologue>,
}

impl CacheLayout {
    /// The layout of a valid spec's cache.
    ///
    /// With dynamic NTK scaling, keys keep the rotation of the step that appended them (the
    /// frequencies for the length after that append) while queries use the current length, as
    /// transformers does; decoding then differs from one forward over the whole sequence once it
    /// outgrows the original context.
    pub fn of(spec: &AttentionSpec) -> Result<Self, RuntimeError> {
        crate::error::check_spec(spec)?;
        let rope = RopePrologue::of(spec);
        Ok(match spec.kv {
            KvLayout::Heads { kv_heads } => CacheLayout {
                dtype: spec.dtype,
                kv_heads: kv_heads as usize,
                k_dim: spec.head_dim as usize,
                v_dim: spec.v_head_dim as usize,
                values_in_keys: false,
                rope,
            },
            KvLayout::Mla(m) => CacheLayout {
                dtype: spec.dtype,
                kv_heads: 1,
                k_dim: (m.latent_rank + m.rope_dim) as usize,
                v_dim: m.latent_rank as usize,
                values_in_keys: true,
                rope,
            },
        })
    }

    /// Values stored per token and kv head.
    pub fn values_per_head(&self) -> usize {
        self.k_dim + if self.values_in_keys { 0 } else { self.v_dim }
    }

    /// Bytes stored per token (all kv heads).
    pub fn bytes_per_token(&self) -> u64 {
        (self.kv_heads * self.values_per_head()) as u64 * self.dtype.size_bytes()
    }
}
