//! What a model is made of: widths, layer count, norms, MLP and the attention spec.

use crate::error::RuntimeError;
pub use crate::ops::{MlpKind, NormKind};
use attn_dsl::AttentionSpec;

/// A decoder-only transformer: token embedding, `layers` pre-norm blocks (norm, attention,
/// residual; norm, MLP, residual), a final norm and the LM head.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// Residual stream width.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// The attention of every layer.
    pub attention: AttentionSpec,
    /// Norm layers.
    pub norm: NormKind,
    /// Norm epsilon.
    pub norm_eps: f64,
    /// MLP block.
    pub mlp: MlpKind,
    /// MLP hidden width.
    pub intermediate: usize,
    /// The LM head is the token embedding.
    pub tie_embeddings: bool,
    /// Biases on the q, k and v projections (Qwen2).
    pub qkv_bias: bool,
}

/// Largest residual width a config may have.
pub const MAX_WIDTH: usize = 1 << 20;
/// Largest MLP width a config may have.
pub const MAX_INTERMEDIATE: usize = 1 << 22;
/// Largest vocabulary a config may have.
pub const MAX_VOCAB: usize = 1 << 24;
/// Most decoder layers a config may have.
pub const MAX_LAYERS: usize = 4096;

impl ModelConfig {
    /// Checks every field: counts from 1 to their limits, a finite positive norm epsilon and a
    /// valid attention spec. The error names the field, its value and what is allowed.
    pub fn validate(&self) -> Result<(), RuntimeError> {
        let range = |field: &str, value: usize, max: usize| {
            if (1..=max).contains(&value) {
                Ok(())
            } else {
                Err(RuntimeError::Data(format!(
                    "model config: `{field}` = {value} is out of range; allowed: 1 to {max}"
                )))
            }
        };
        range("vocab", self.vocab, MAX_VOCAB)?;
        range("hidden", self.hidden, MAX_WIDTH)?;
        range("layers", self.layers, MAX_LAYERS)?;
        range("intermediate", self.intermediate, MAX_INTERMEDIATE)?;
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(RuntimeError::Data(format!(
                "model config: `norm_eps` = {} is invalid; allowed: a finite number greater \
                 than 0",
                self.norm_eps
            )));
        }
        crate::error::check_spec(&self.attention)
    }

    /// The number of weights (biases and norms included) a model of this config holds,
    /// counted without overflow; `None` when it does not fit in 64 bits. DeepSeek's optional
    /// low-rank query factoring is not counted (the checkpoint's files bound that one).
    pub fn weight_count(&self) -> Option<u64> {
        let spec = &self.attention;
        let [d, inter, vocab] = [self.hidden, self.intermediate, self.vocab].map(|v| v as u64);
        let (h, dk, dv) = (
            u64::from(spec.heads),
            u64::from(spec.head_dim),
            u64::from(spec.v_head_dim),
        );
        let norm = if self.norm == NormKind::Layer {
            2 * d
        } else {
            d
        };
        let attention = match spec.mla() {
            Some(m) => {
                let (r, dr) = (u64::from(m.latent_rank), u64::from(m.rope_dim));
                d * h * (dk + dr) + d * (r + dr) + r + r * h * (dk + dv) + h * dv * d
            }
            None => {
                let hkv = u64::from(spec.kv_heads());
                let bias = if self.qkv_bias {
                    (h + hkv) * dk + hkv * dv
                } else {
                    0
                };
                d * (h * dk + hkv * dk + hkv * dv) + bias + h * dv * d
            }
        };
        let mlp_mats = if self.mlp == MlpKind::SwiGlu { 3 } else { 2 };
        // In a validated config every product fits easily (widths below 2^20, vocabularies
        // below 2^24, MLP widths below 2^22, heads and head dims below 2^11); the sums are checked all the same.
        let layer = attention
            .checked_add(mlp_mats * d * inter)?
            .checked_add(2 * norm)?;
        let heads = if self.tie_embeddings { 1 } else { 2 };
        layer
            .checked_mul(self.layers as u64)?
            .checked_add(heads * vocab * d)?
            .checked_add(norm)
    }
}
