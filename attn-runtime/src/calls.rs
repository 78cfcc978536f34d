//! What a [`Backend`](crate::Backend) call takes and gives: the inputs of a forward (per-head
//! or MLA), the queries of a cached call (uniform, ragged or MLA), the inputs of a backward and
//! the gradients, and the output. Host tensors throughout; every shape is checked against the
//! variant by the backend, which names a tensor that disagrees.

use crate::error::RuntimeError;
use crate::tensor::Tensor;

/// Attention outputs.
#[derive(Clone, Debug)]
pub struct Output {
    /// `[B, Hq, Sq, Dv]` in the spec's dtype.
    pub out: Tensor,
    /// `[B, Hq, Sq]` f32: natural log of the softmax denominator, `-inf` for empty rows.
    pub lse: Tensor,
    /// MLA forwards only: the latent output (`softmax @ c_kv` per head, before `W_uv`),
    /// `[B, Hq, Sq, latent_rank]` f32, which the MLA backward takes.
    pub latent: Option<Tensor>,
}

/// What a forward call attends over.
#[derive(Clone, Copy, Debug)]
pub enum Inputs<'a> {
    /// A per-head variant's q `[B, heads, Sq, head_dim]`, k `[B, kv_heads, Skv, head_dim]` and
    /// v `[B, kv_heads, Skv, v_head_dim]` (q and k before RoPE). Strided views with
    /// contiguous rows are read in place; other layouts and dtypes are converted.
    Heads {
        /// The queries.
        q: &'a Tensor,
        /// The keys.
        k: &'a Tensor,
        /// The values.
        v: &'a Tensor,
    },
    /// An MLA variant's tensors.
    Mla(MlaTensors<'a>),
}

impl<'a> Inputs<'a> {
    /// [`Inputs::Heads`] of `q`, `k` and `v`.
    pub fn heads(q: &'a Tensor, k: &'a Tensor, v: &'a Tensor) -> Inputs<'a> {
        Inputs::Heads { q, k, v }
    }
}

/// Inputs of MLA attention (DeepSeek layout; see `attn_dsl::reference::MlaInputs`).
#[derive(Clone, Copy, Debug)]
pub struct MlaTensors<'a> {
    /// `[B, H, Sq, head_dim]`.
    pub q_nope: &'a Tensor,
    /// `[B, H, Sq, rope_dim]`, before RoPE.
    pub q_pe: &'a Tensor,
    /// `[B, Skv, latent_rank]`, after the latent norm.
    pub c_kv: &'a Tensor,
    /// `[B, Skv, rope_dim]`, before RoPE.
    pub k_pe: &'a Tensor,
    /// `[H * (head_dim + v_head_dim), latent_rank]`.
    pub w_kv_b: &'a Tensor,
}

/// The queries of a call against cached sequences: the last tokens of each sequence, whose
/// keys and values the cache already holds.
#[derive(Clone, Copy, Debug)]
pub enum Queries<'a> {
    /// `[B, heads, q_len, head_dim]`: `q_len` queries for each of the `B` sequences (decode
    /// steps, or speculative ones).
    Uniform(&'a Tensor),
    /// A ragged batch, decode and chunked prefill in one call: `q [tokens, heads, head_dim]`
    /// holds sequence `b`'s queries at rows `offsets[b]..offsets[b + 1]` (cumulative, from 0).
    /// Out is `[tokens, heads, v_head_dim]`, lse `[tokens, heads]`.
    Ragged {
        /// The queries.
        q: &'a Tensor,
        /// `B + 1` cumulative row offsets.
        offsets: &'a [usize],
    },
    /// An MLA variant's queries against a latent cache, `q_len` for each sequence.
    Mla(MlaQueries<'a>),
}

/// The queries of an MLA decoding step and the weights that absorb them.
#[derive(Clone, Copy, Debug)]
pub struct MlaQueries<'a> {
    /// `[B, heads, q_len, head_dim]`.
    pub q_nope: &'a Tensor,
    /// `[B, heads, q_len, rope_dim]`, before RoPE.
    pub q_pe: &'a Tensor,
    /// `[heads * (head_dim + v_head_dim), latent_rank]`.
    pub w_kv_b: &'a Tensor,
}

/// Options of a cached call.
#[derive(Clone, Copy, Debug, Default)]
pub struct DecodeOptions {
    /// Partitions of each item's keys (split-KV); `None` picks enough to keep every thread busy.
    pub partitions: Option<usize>,
}

/// The inputs of a backward call: the forward's inputs and what it returned, and the gradient
/// of the loss with respect to the output.
#[derive(Clone, Copy, Debug)]
pub enum BackwardInputs<'a> {
    /// A per-head variant's.
    Heads(HeadsBackward<'a>),
    /// An MLA variant's.
    Mla(MlaBackward<'a>),
}

/// A per-head backward call's inputs.
#[derive(Clone, Copy, Debug)]
pub struct HeadsBackward<'a> {
    /// `[B, heads, Sq, head_dim]`, before RoPE.
    pub q: &'a Tensor,
    /// `[B, kv_heads, Skv, head_dim]`, before RoPE.
    pub k: &'a Tensor,
    /// `[B, kv_heads, Skv, v_head_dim]`.
    pub v: &'a Tensor,
    /// The forward's output, `[B, heads, Sq, v_head_dim]`.
    pub out: &'a Tensor,
    /// The forward's log-sum-exp, `[B, heads, Sq]`.
    pub lse: &'a Tensor,
    /// `dL/dout`, `[B, heads, Sq, v_head_dim]`.
    pub dout: &'a Tensor,
    /// Position of key 0, as in the forward call.
    pub position_offset: i64,
}

/// An MLA backward call's inputs.
#[derive(Clone, Copy, Debug)]
pub struct MlaBackward<'a> {
    /// The forward's inputs.
    pub x: MlaTensors<'a>,
    /// The forward's latent output, `[B, H, Sq, latent_rank]` ([`Output::latent`]).
    pub latent: &'a Tensor,
    /// The forward's log-sum-exp, `[B, H, Sq]`.
    pub lse: &'a Tensor,
    /// `dL/dout`, `[B, H, Sq, v_head_dim]`.
    pub dout: &'a Tensor,
    /// The position of key 0.
    pub position_offset: i64,
}

/// Gradients of attention with respect to its inputs, in the spec's dtype.
#[derive(Clone, Debug)]
pub enum Gradients {
    /// A per-head variant's.
    Heads(HeadGradients),
    /// An MLA variant's.
    Mla(MlaGradients),
}

impl Gradients {
    /// The per-head gradients; an error for an MLA call's.
    pub fn heads(self) -> Result<HeadGradients, RuntimeError> {
        match self {
            Gradients::Heads(g) => Ok(g),
            Gradients::Mla(_) => Err(RuntimeError::Spec(
                "these are an MLA call's gradients, not per-head ones".into(),
            )),
        }
    }

    /// The MLA gradients; an error for a per-head call's.
    pub fn mla(self) -> Result<MlaGradients, RuntimeError> {
        match self {
            Gradients::Mla(g) => Ok(g),
            Gradients::Heads(_) => Err(RuntimeError::Spec(
                "these are a per-head call's gradients, not MLA ones".into(),
            )),
        }
    }
}

/// Gradients of per-head attention.
#[derive(Clone, Debug)]
pub struct HeadGradients {
    /// `dL/dq`, `[B, heads, Sq, head_dim]` (for q before RoPE).
    pub dq: Tensor,
    /// `dL/dk`, `[B, kv_heads, Skv, head_dim]` (for k before RoPE; summed over each group).
    pub dk: Tensor,
    /// `dL/dv`, `[B, kv_heads, Skv, v_head_dim]` (summed over each group).
    pub dv: Tensor,
    /// The gradient of each learnable tensor, `d<name>` (`dsinks` for the sinks), f32, in the
    /// spec's order; empty without learnable tensors.
    pub learned: Vec<(String, Tensor)>,
}

/// Gradients of MLA attention.
#[derive(Clone, Debug)]
pub struct MlaGradients {
    /// `[B, H, Sq, head_dim]`.
    pub dq_nope: Tensor,
    /// `[B, H, Sq, rope_dim]`, for q_pe before RoPE.
    pub dq_pe: Tensor,
    /// `[B, Skv, latent_rank]`.
    pub dc_kv: Tensor,
    /// `[B, Skv, rope_dim]`, for k_pe before RoPE (summed over heads).
    pub dk_pe: Tensor,
    /// `[H * (head_dim + v_head_dim), latent_rank]`.
    pub dw_kv_b: Tensor,
}
