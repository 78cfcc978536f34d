//! Transformers composed at run time: a [`ModelConfig`] (from a Hugging Face checkpoint with
//! [`hf::load`], or written for research with [`research`] and random weights) and its weights,
//! run with the generated attention kernels.
//!
//! Each layer is attention and an MLP around the residual stream, their norms where the
//! config's [`NormPlacement`] puts them (before each sublayer, `x += attn(norm(x))`; before and
//! after; after; or both sublayers side by side); then a final norm and the LM head (the
//! embedding when tied): the steps of [`decoder::Decoder`], which every model runs. Attention
//! is any per-head spec (q, k, v, o projections) or MLA (DeepSeek's low-rank KV with its
//! absorbed kernels). [`Model::forward`] runs a whole sequence; a [`Session`] runs one
//! incrementally against paged KV caches (one per layer), for decoding.

mod attention;
mod config;
pub mod decoder;
mod differential;
mod generate;
pub mod hf;
mod json_fields;
mod mxfp4;
pub mod research;
pub mod resident;
mod sublayers;
mod text;
mod weights;

pub use config::{
    ExpertNames, MAX_EXPERTS, MAX_INTERMEDIATE, MAX_KINDS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH,
    MlpKind, MlpNames, ModelConfig, Moe, NormKind, NormPlacement, Projections, QkNorm, Router,
    SharedExpert, TensorNames,
};
pub use generate::{Progress, Request, Sampling};
pub use resident::ResidentModel;
pub use text::{PIECE_BYTES, TOKENIZER_BYTES_PER_BYTE, TextStream, TextTokenizer, pieces};

use crate::backend::Backend;
use crate::cache::{PagedCache, SeqId};

use crate::cpu::CpuBackend;
use crate::error::RuntimeError;
use crate::ops::{CpuLayers, LayerOps};
use crate::tensor::Tensor;
use crate::variant::Variant;
use decoder::{Decoder, DecoderOps, LayerNorm, Multiplier, NormAt};
use std::sync::Arc;
use sublayers::{LayerMlp, Linear, Matrix, Norm};

/// The attention weights of a layer.
#[derive(Debug)]
pub(crate) enum AttentionWeights {
    /// Per-head projections.
    Heads {
        q: Linear,
        k: Linear,
        v: Linear,
        o: Linear,
        /// Norms on q and k per head, before RoPE (`QkNorm::PerHead`).
        qk_norm: Option<[Norm; 2]>,
        /// The spec's learnable tensors (`params(...)`, `sinks`), f32, by name
        /// (`model.layers.{i}.self_attn.{name}` in a file).
        learned: Vec<(String, Tensor)>,
        /// Differential heads' pairing (`self_attn.lambda_*`, `self_attn.subln`).
        differential: Option<differential::DifferentialWeights>,
    },
    /// DeepSeek MLA: queries (directly, or through a low-rank `q_a` / norm / `q_b`), the joint
    /// `[latent | rope key]` projection, the latent norm, `w_kv_b` and the output projection.
    Mla {
        q: Linear,
        q_b: Option<(Norm, Linear)>,
        kv_a: Linear,
        kv_norm: Norm,
        w_kv_b: Tensor,
        o: Linear,
    },
}

/// One decoder layer; its norms as the config's [`NormPlacement`] places them.
#[derive(Debug)]
pub(crate) struct Layer {
    pub attn_norm: Option<Norm>,
    pub attn: AttentionWeights,
    pub post_attn_norm: Option<Norm>,
    pub mlp_norm: Option<Norm>,
    pub mlp: LayerMlp,
    pub post_mlp_norm: Option<Norm>,
}

impl Layer {
    /// Its norm at `at`, if it has one.
    pub fn norm(&self, at: LayerNorm) -> Option<&Norm> {
        match at {
            LayerNorm::BeforeAttention => self.attn_norm.as_ref(),
            LayerNorm::AfterAttention => self.post_attn_norm.as_ref(),
            LayerNorm::BeforeMlp => self.mlp_norm.as_ref(),
            LayerNorm::AfterMlp => self.post_mlp_norm.as_ref(),
        }
    }

    /// Its norms, in order.
    pub fn norms(&self) -> impl Iterator<Item = &Norm> {
        [
            &self.attn_norm,
            &self.post_attn_norm,
            &self.mlp_norm,
            &self.post_mlp_norm,
        ]
        .into_iter()
        .flatten()
    }
}

/// A model ready to run: its weights in host memory, its attention on a [`Backend`] (the CPU
/// unless [`Model::set_backend`] says otherwise).
pub struct Model {
    /// What it is.
    pub config: ModelConfig,
    /// `[vocab, hidden]`, in the checkpoint's dtype.
    pub(crate) embed: Matrix,
    /// The norm on the embedded rows ([`ModelConfig::embed_norm`]).
    pub(crate) embed_norm: Option<Norm>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) final_norm: Norm,
    /// `[vocab, hidden]`, absent when tied to the embedding.
    pub(crate) lm_head: Option<Linear>,
    /// Each attention kind's variant, validated and planned once, shared by its layers.
    variants: Vec<Arc<Variant>>,
    backend: Arc<dyn Backend>,
    /// Where the norms, activations, adds, lookups and greedy choice run.
    ops: Arc<dyn LayerOps>,
    /// What loading noticed and did not refuse ([`Model::warnings`]).
    warnings: Vec<String>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .field("backend", &self.backend.name())
            .finish_non_exhaustive()
    }
}

/// Where a layer's attention gets its keys: the call's own tokens (one sequence), or a cache
/// holding the sequences of a step.
enum Keys<'a> {
    Full,
    Cached(Step<'a>),
}

/// The sequences of a step in one layer's cache: sequence `i`'s new tokens are rows
/// `offsets[i]..offsets[i + 1]` of the call.
struct Step<'a> {
    cache: &'a mut PagedCache,
    seqs: &'a [SeqId],
    offsets: &'a [usize],
}

impl Model {
    pub(crate) fn new(
        config: ModelConfig,
        embed: Matrix,
        layers: Vec<Layer>,
        final_norm: Norm,
        lm_head: Option<Linear>,
    ) -> Result<Self, RuntimeError> {
        Ok(Model {
            variants: config
                .attention
                .iter()
                // Differential heads run their component heads' variant.
                .map(|spec| Variant::new(spec.differential_components()))
                .collect::<Result<_, _>>()?,
            config,
            embed,
            embed_norm: None,
            layers,
            final_norm,
            lm_head,
            backend: Arc::new(CpuBackend::new()),
            ops: Arc::new(CpuLayers),
            warnings: Vec::new(),
        })
    }

    /// What loading the model noticed and did not refuse (a checkpoint tensor it ignores, as
    /// transformers does): for a front end to show.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Adds a load warning.
    pub(crate) fn warn(&mut self, warning: String) {
        self.warnings.push(warning);
    }

    /// The attention variant of layer `i` (shared by the layers of its kind).
    pub fn layer_variant(&self, i: usize) -> &Arc<Variant> {
        &self.variants[self.config.kind_of(i)]
    }

    /// The variant of each attention kind, in the config's order.
    pub fn variants(&self) -> &[Arc<Variant>] {
        &self.variants
    }

    /// Runs the model's attention on `backend` from now on (the projections stay on the CPU,
    /// and the other layer operations where [`Model::set_layer_ops`] put them).
    pub fn set_backend(&mut self, backend: Arc<dyn Backend>) {
        self.backend = backend;
    }

    /// The backend the attention runs on.
    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// Runs the norms, activations, residual adds, embedding lookups and greedy choice on `ops`
    /// from now on (the CPU's until then; [`crate::backends::layer_ops`] gives a backend's).
    pub fn set_layer_ops(&mut self, ops: Arc<dyn LayerOps>) {
        self.ops = ops;
    }

    /// Where the layer operations run.
    pub fn layer_ops(&self) -> &dyn LayerOps {
        self.ops.as_ref()
    }

    /// Logits `[tokens, vocab]` of a whole sequence (causal; positions from 0).
    pub fn forward(&self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        self.run(tokens, |_| Keys::Full)
    }

    /// A session that runs one sequence incrementally with a paged cache per layer of
    /// `capacity` tokens (blocks of `block_size`).
    pub fn session(&self, capacity: usize, block_size: usize) -> Result<Session<'_>, RuntimeError> {
        let mut batch = self.batch(capacity, block_size)?;
        batch.add_sequence();
        Ok(Session { batch })
    }

    /// A batch of sequences run incrementally, with a paged cache per layer holding
    /// `capacity` tokens in all (blocks of `block_size`).
    pub fn batch(&self, capacity: usize, block_size: usize) -> Result<Batch<'_>, RuntimeError> {
        let blocks = capacity.div_ceil(block_size.max(1));
        let caches = (0..self.layers.len())
            .map(|i| PagedCache::new(self.config.layer_attention(i), block_size, blocks))
            .collect::<Result<_, _>>()?;
        Ok(Batch {
            model: self,
            caches,
            ids: Vec::new(),
            lens: Vec::new(),
        })
    }

    /// Parameters by part, as stored: `(part, count)` for the embedding, each layer kind's
    /// attention, MLP and norms (summed over layers) and the LM head (0 when tied).
    pub fn parameters(&self) -> Vec<(&'static str, u64)> {
        let lin = |l: &Linear| (l.w.len() + l.bias.as_ref().map_or(0, Vec::len)) as u64;
        let norm = |n: &Norm| (n.weight.len() + n.bias.as_ref().map_or(0, Vec::len)) as u64;
        let embed_norm = self.embed_norm.as_ref().map_or(0, norm);
        let (mut attn, mut mlp, mut norms) = (0, 0, norm(&self.final_norm) + embed_norm);
        for layer in &self.layers {
            attn += match &layer.attn {
                AttentionWeights::Heads {
                    q,
                    k,
                    v,
                    o,
                    qk_norm,
                    learned,
                    differential,
                } => {
                    differential
                        .as_ref()
                        .map_or(0, |d| norm(&d.subln) + 4 * d.vector_len as u64)
                        + lin(q)
                        + lin(k)
                        + lin(v)
                        + lin(o)
                        + qk_norm.as_ref().map_or(0, |[a, b]| norm(a) + norm(b))
                        + learned
                            .iter()
                            .map(|(_, t)| t.shape().iter().product::<usize>() as u64)
                            .sum::<u64>()
                }
                AttentionWeights::Mla {
                    q,
                    q_b,
                    kv_a,
                    kv_norm,
                    w_kv_b,
                    o,
                } => {
                    let q_b = q_b.as_ref().map_or(0, |(n, l)| norm(n) + lin(l));
                    lin(q)
                        + q_b
                        + lin(kv_a)
                        + norm(kv_norm)
                        + w_kv_b.shape().iter().product::<usize>() as u64
                        + lin(o)
                }
            };
            mlp += layer.mlp.weight_count();
            norms += layer.norms().map(norm).sum::<u64>();
        }
        vec![
            ("embedding", self.embed.len() as u64),
            ("attention", attn),
            ("mlp", mlp),
            ("norms", norms),
            ("lm_head", self.lm_head.as_ref().map_or(0, lin)),
        ]
    }

    /// The weights of one expert of the model's MoE layers (0 without experts).
    pub fn expert_weights(&self) -> u64 {
        self.layers
            .iter()
            .find_map(|layer| match &layer.mlp {
                LayerMlp::Moe(moe) => moe.experts.first(),
                LayerMlp::Dense(_) => None,
            })
            .map_or(0, |expert| {
                expert
                    .gate
                    .iter()
                    .chain([&expert.up, &expert.down])
                    .map(|l| l.w.len() as u64)
                    .sum()
            })
    }

    /// Marks every expert's matrices of the MoE layers as held exactly in their dtype
    /// ([`sublayers::Matrix::keep_inputs_exact`]): experts dequantized from MXFP4.
    pub(crate) fn keep_expert_inputs_exact(&mut self) {
        for layer in &mut self.layers {
            if let LayerMlp::Moe(moe) = &mut layer.mlp {
                for expert in &mut moe.experts {
                    for linear in expert
                        .gate
                        .iter_mut()
                        .chain([&mut expert.up, &mut expert.down])
                    {
                        linear.w.keep_inputs_exact();
                    }
                }
            }
        }
    }

    /// Bytes of weights one decoding step reads for one token, in their stored dtypes: every
    /// projection of every layer (of an MoE layer: the router, the shared experts and `top_k`
    /// experts' worth) and the LM head (the embedding when tied); norms and the embedding row
    /// are left out. What a step costs at the memory's read rate.
    pub fn step_weight_bytes(&self) -> u64 {
        let bytes = |l: &Linear| l.w.bytes();
        let mut total = match &self.lm_head {
            Some(head) => bytes(head),
            None => self.embed.bytes(),
        };
        for layer in &self.layers {
            total += match &layer.attn {
                AttentionWeights::Heads { q, k, v, o, .. } => [q, k, v, o].map(bytes).iter().sum(),
                AttentionWeights::Mla {
                    q, q_b, kv_a, o, ..
                } => {
                    let q_b = q_b.as_ref().map_or(0, |(_, l)| bytes(l));
                    bytes(q) + q_b + bytes(kv_a) + bytes(o)
                }
            };
            total += match &layer.mlp {
                LayerMlp::Dense(mlp) => {
                    mlp.gate.iter().chain([&mlp.up, &mlp.down]).map(bytes).sum()
                }
                LayerMlp::Moe(moe) => {
                    let expert: u64 = moe.experts.first().map_or(0, |e| {
                        e.gate.iter().chain([&e.up, &e.down]).map(bytes).sum()
                    });
                    let shared: u64 = moe
                        .shared
                        .iter()
                        .flat_map(|(e, gate)| e.gate.iter().chain([&e.up, &e.down]).chain(gate))
                        .map(bytes)
                        .sum();
                    bytes(&moe.router) + shared + expert * moe.top_k as u64
                }
            };
        }
        total
    }

    /// Bytes of cached keys and values one decoding step reads with `context` tokens in the
    /// cache (the new token's included): every layer's rows of each kv head in its spec's
    /// dtype, for the keys its mask lets the query see (the last `window` under a sliding
    /// window). With [`Model::step_weight_bytes`], what a step reads from memory.
    pub fn step_cache_bytes(&self, context: usize) -> u64 {
        let seen = context as u64 + 1;
        (0..self.layers.len())
            .map(|i| {
                let spec = self.layer_variant(i).spec();
                let keys = match spec.mask {
                    attn_dsl::Mask::SlidingWindow { window } => window.min(seen),
                    _ => seen,
                };
                let row = crate::cache::CacheLayout::of(spec).map_or(0, |l| l.bytes_per_token());
                row.saturating_mul(keys)
            })
            .fold(0u64, u64::saturating_add)
    }

    /// The embedding multiplier in the embedding's dtype, as transformers multiplies.
    pub(crate) fn embed_multiplier(&self) -> Option<f32> {
        self.config
            .embed_multiplier
            .map(|m| match self.embed.storage() {
                crate::tensor::Storage::F32(_) => m as f32,
                crate::tensor::Storage::Bf16(_) => half::bf16::from_f64(m).to_f32(),
                crate::tensor::Storage::F16(_) => half::f16::from_f64(m).to_f32(),
            })
    }

    /// The logits of `tokens`, each layer's attention against `keys(layer)`.
    fn run<'c>(
        &self,
        tokens: &[u32],
        keys: impl FnMut(usize) -> Keys<'c>,
    ) -> Result<Vec<f32>, RuntimeError> {
        let n = tokens.len();
        crate::memory::ensure_fits(
            &format!("a forward pass over {n} tokens"),
            self.activation_bytes(n),
        )?;
        Decoder::of(&self.config).run(&mut HostDecoder {
            model: self,
            tokens,
            keys,
        })
    }

    /// Bytes a forward pass over `n` tokens holds at its peak, about: per token the residual
    /// stream and its normed copy, the attention's q, k, v and output (queries and keys at their
    /// widest), the MLP's hidden widths, and the logits, all f32. `None` past 64 bits.
    fn activation_bytes(&self, n: usize) -> Option<u64> {
        let c = &self.config;
        let attention = c
            .attention
            .iter()
            .map(|spec| {
                let heads = u64::from(spec.heads);
                let qk =
                    u64::from(spec.head_dim) + spec.mla().map_or(0, |m| u64::from(m.latent_rank));
                4 * heads * (qk + u64::from(spec.v_head_dim))
            })
            .max()
            .unwrap_or(0);
        let per_token =
            4 * c.hidden as u64 + attention + 3 * c.intermediate as u64 + c.vocab as u64;
        per_token.checked_mul(n as u64)?.checked_mul(4)
    }
}

/// Sequences run incrementally: each step appends the new tokens' keys and values to the
/// layers' caches and attends to everything cached, all sequences in one ragged launch per layer
/// (prefill chunks and single decode tokens alike).
#[derive(Debug)]
pub struct Batch<'m> {
    model: &'m Model,
    caches: Vec<PagedCache>,
    /// `ids[s][layer]`: sequence `s` in each layer's cache.
    ids: Vec<Vec<SeqId>>,
    lens: Vec<usize>,
}

impl Batch<'_> {
    /// Starts an empty sequence; returns its index.
    pub fn add_sequence(&mut self) -> usize {
        self.ids.push(
            self.caches
                .iter_mut()
                .map(PagedCache::add_sequence)
                .collect(),
        );
        self.lens.push(0);
        self.ids.len() - 1
    }

    /// Tokens run so far for sequence `s`.
    pub fn len(&self, s: usize) -> usize {
        self.lens.get(s).copied().unwrap_or(0)
    }

    /// Frees sequence `s`'s cache blocks.
    pub fn free(&mut self, s: usize) -> Result<(), RuntimeError> {
        let ids = self
            .ids
            .get(s)
            .ok_or_else(|| RuntimeError::Cache(format!("no sequence {s} in this batch")))?;
        for (cache, &id) in self.caches.iter_mut().zip(ids) {
            cache.free(id)?;
        }
        Ok(())
    }

    /// Runs the next tokens of some sequences, `(sequence, tokens)` each (a sequence at most
    /// once); returns each input's logits `[tokens, vocab]`.
    pub fn step(&mut self, inputs: &[(usize, &[u32])]) -> Result<Vec<Vec<f32>>, RuntimeError> {
        let mut offsets = vec![0];
        let mut tokens = Vec::new();
        for (i, &(s, t)) in inputs.iter().enumerate() {
            if s >= self.ids.len() || inputs[..i].iter().any(|&(o, _)| o == s) {
                return Err(RuntimeError::Data(format!(
                    "input {i} names sequence {s}: each must be one of the batch's {} sequences, \
                     at most once per step",
                    self.ids.len()
                )));
            }
            tokens.extend_from_slice(t);
            offsets.push(tokens.len());
        }
        let per_layer: Vec<Vec<SeqId>> = (0..self.caches.len())
            .map(|layer| inputs.iter().map(|&(s, _)| self.ids[s][layer]).collect())
            .collect();
        let mut caches = self.caches.iter_mut();
        let model = self.model;
        // The step runs on one of rayon's threads, so each parallel product in it hands work to
        // the other threads directly instead of waking the whole pool from outside and waiting
        // (decoding makes about 50 such hand-offs per step).
        let logits = rayon::scope(|_| {
            model.run(&tokens, |layer| {
                Keys::Cached(Step {
                    cache: caches.next().expect("one cache per layer"),
                    seqs: &per_layer[layer],
                    offsets: &offsets,
                })
            })
        })?;
        let vocab = self.model.config.vocab;
        for &(s, t) in inputs {
            self.lens[s] += t.len();
        }
        Ok(offsets
            .windows(2)
            .map(|w| logits[w[0] * vocab..w[1] * vocab].to_vec())
            .collect())
    }
}

/// One sequence run incrementally (a [`Batch`] of one).
#[derive(Debug)]
pub struct Session<'m> {
    batch: Batch<'m>,
}

impl Session<'_> {
    /// Logits `[tokens, vocab]` of the next tokens of the sequence.
    pub fn step(&mut self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        Ok(self.batch.step(&[(0, tokens)])?.remove(0))
    }

    /// Tokens run so far.
    pub fn len(&self) -> usize {
        self.batch.len(0)
    }

    /// Whether no token has run yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The CPU model's decoder operations: on the host through the model's [`LayerOps`], its
/// attention on its [`Backend`].
struct HostDecoder<'m, 't, K> {
    model: &'m Model,
    tokens: &'t [u32],
    keys: K,
}

impl<'c, K: FnMut(usize) -> Keys<'c>> DecoderOps for HostDecoder<'_, '_, K> {
    type Rows = Vec<f32>;
    type Error = RuntimeError;

    fn embed(&mut self) -> Result<Vec<f32>, RuntimeError> {
        let m = self.model;
        let vocab = m.config.vocab;
        if let Some((i, t)) = self
            .tokens
            .iter()
            .enumerate()
            .find(|(_, t)| **t as usize >= vocab)
        {
            return Err(RuntimeError::Data(format!(
                "token {i} is {t}, outside the vocabulary of {vocab}"
            )));
        }
        m.ops.embed(m.embed.storage(), m.config.hidden, self.tokens)
    }

    fn norm(&mut self, at: NormAt, x: &Vec<f32>) -> Result<Vec<f32>, RuntimeError> {
        let m = self.model;
        let norm = match at {
            NormAt::Embedding => m.embed_norm.as_ref(),
            NormAt::Layer(i, at) => m.layers[i].norm(at),
            NormAt::Final => Some(&m.final_norm),
        };
        norm.ok_or_else(|| missing_norm(at))?
            .apply(m.ops.as_ref(), x)
    }

    fn attention(&mut self, i: usize, h: &Vec<f32>) -> Result<Vec<f32>, RuntimeError> {
        let m = self.model;
        let n = self.tokens.len();
        m.attention(m.layer_variant(i), &m.layers[i].attn, h, n, (self.keys)(i))
    }

    fn mlp(&mut self, i: usize, h: &Vec<f32>) -> Result<Vec<f32>, RuntimeError> {
        let m = self.model;
        m.layers[i].mlp.apply(m.ops.as_ref(), h, self.tokens.len())
    }

    fn add(&mut self, mut x: Vec<f32>, y: &Vec<f32>) -> Result<Vec<f32>, RuntimeError> {
        self.model.ops.add(&mut x, y)?;
        Ok(x)
    }

    fn scale(&mut self, mut x: Vec<f32>, by: Multiplier) -> Result<Vec<f32>, RuntimeError> {
        let c = &self.model.config;
        let m = match by {
            Multiplier::Embedding => self.model.embed_multiplier(),
            Multiplier::Residual => c.residual_multiplier.map(|m| m as f32),
            Multiplier::Logits => c.logit_multiplier.map(|m| m as f32),
        };
        let m = m.ok_or_else(|| RuntimeError::Data(format!("internal: no {by:?} multiplier")))?;
        x.iter_mut().for_each(|v| *v *= m);
        Ok(x)
    }

    fn head(&mut self, x: &Vec<f32>) -> Result<Vec<f32>, RuntimeError> {
        let (m, n) = (self.model, self.tokens.len());
        Ok(match &m.lm_head {
            Some(head) => head.apply(x, n),
            None => m.embed.matmul_t(x, n),
        })
    }

    fn softcap(&mut self, mut logits: Vec<f32>) -> Result<Vec<f32>, RuntimeError> {
        let c = self.model.config.final_softcap;
        let c = c.ok_or_else(|| RuntimeError::Data("internal: no final softcap".into()))? as f32;
        logits.iter_mut().for_each(|v| *v = c * (*v / c).tanh());
        Ok(logits)
    }
}

/// The error of a norm the decoder's steps ask for and the model lacks (a loader out of step
/// with [`NormPlacement::norm_names`]).
fn missing_norm(at: NormAt) -> RuntimeError {
    RuntimeError::Data(format!("internal: the model has no norm at {at:?}"))
}
