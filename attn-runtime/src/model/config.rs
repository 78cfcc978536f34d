//! What a model is made of: widths, layer count, norms, MLP and the attention spec.

use attn_dsl::AttentionSpec;

/// Normalization layers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormKind {
    /// `x / sqrt(mean(x^2) + eps) * w` (Llama and most current families).
    Rms,
    /// `(x - mean) / sqrt(var + eps) * w + b` (older families).
    Layer,
}

/// MLP blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MlpKind {
    /// `down(silu(gate(x)) * up(x))`.
    SwiGlu,
    /// `down(gelu(up(x)))` (tanh approximation).
    Gelu,
}

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
