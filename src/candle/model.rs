//! A research model ([`ModelConfig`]) as a candle model that trains, its attention attn's op.
//! Its variables have the names of a Hugging Face llama checkpoint, so the safetensors file its
//! `VarMap` saves loads in attn's runtime (`attn::research::load`, with `weights = FILE` in the
//! model's TOML) and gives the same logits.

use super::{attention_learned, attention_with_data};
use crate::Variant;
use crate::runtime::model::decoder::{Decoder, DecoderOps, LayerNorm, Multiplier, NormAt};
use crate::runtime::model::{
    ExpertNames, MlpKind, MlpNames, ModelConfig, NormKind, Projections, QkNorm, Router, TensorNames,
};
use attn_dsl::data::{DOCUMENT_IDS, with_document_mask};
use candle_core::{D, DType, Module, Result, Tensor};
use candle_nn::{Init, VarBuilder, VarMap};
use std::sync::Arc;

/// GPT-2's initialization scale, as the runtime's random research models.
const INIT_STD: f64 = 0.02;

/// A decoder-only transformer of a [`ModelConfig`]: embedding, blocks (attention and MLP around
/// the residual, their norms where the config's placement puts them), final norm, LM head (the
/// embedding when tied). Layers may
/// differ in attention (the config's kinds and pattern); each kind's variant is made once.
/// Per-head attention only: MLA configs are refused.
pub struct CandleModel {
    config: ModelConfig,
    embed: Tensor,
    layers: Vec<Block>,
    norm: Norm,
    lm_head: Option<Tensor>,
    /// When set, the tokens are one rank's part of each sequence and every attention runs
    /// context-parallel over the ranks.
    context: Option<super::Context>,
}

/// `x W^T + b`.
struct Linear {
    w: Tensor,
    b: Option<Tensor>,
}

impl Linear {
    fn new(vb: &VarBuilder, name: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
        let w = vb.get_with_hints((out, inp), &format!("{name}.weight"), normal())?;
        let b = match bias {
            true => Some(vb.get_with_hints(out, &format!("{name}.bias"), Init::Const(0.0))?),
            false => None,
        };
        Ok(Linear { w, b })
    }
}

/// `x @ w^T` over the last dimension of `x`, as one `[tokens, in] x [in, out]` product: a
/// batched product against a broadcast weight would make the backward sum a copy of the
/// weight's gradient per sequence.
fn times_transposed(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let inp = dims.pop().unwrap_or(1);
    let rows = dims.iter().product::<usize>();
    let y = x.reshape((rows, inp))?.matmul(&w.t()?)?;
    dims.push(w.dim(0)?);
    y.reshape(dims)
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = times_transposed(x, &self.w)?;
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// RMSNorm or LayerNorm over the last dimension, in f32, written with candle's ops (which
/// carry gradients).
struct Norm {
    kind: NormKind,
    weight: Tensor,
    bias: Option<Tensor>,
    eps: f64,
}

impl Norm {
    fn new(vb: &VarBuilder, name: &str, len: usize, config: &ModelConfig) -> Result<Norm> {
        let weight = vb.get_with_hints(len, &format!("{name}.weight"), Init::Const(1.0))?;
        let bias = match config.norm {
            NormKind::Layer if config.norm_bias => {
                Some(vb.get_with_hints(len, &format!("{name}.bias"), Init::Const(0.0))?)
            }
            NormKind::Layer | NormKind::Rms => None,
        };
        Ok(Norm {
            kind: config.norm,
            weight,
            bias,
            eps: config.norm_eps,
        })
    }

    /// An RMSNorm `{name}.weight` over `len` values (the per-head norms on q and k).
    fn rms(vb: &VarBuilder, name: &str, len: usize, eps: f64) -> Result<Norm> {
        Ok(Norm {
            kind: NormKind::Rms,
            weight: vb.get_with_hints(len, &format!("{name}.weight"), Init::Const(1.0))?,
            bias: None,
            eps,
        })
    }
}

impl Module for Norm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = match self.kind {
            NormKind::Rms => x.clone(),
            NormKind::Layer => x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?,
        };
        let scale = (x.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?.sqrt()?;
        let y = x.broadcast_div(&scale)?.broadcast_mul(&self.weight)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// One block, its norms where the config's placement puts them.
struct Block {
    /// Its attention kind's variant, shared by the layers of that kind.
    variant: Arc<Variant>,
    attn_norm: Option<Norm>,
    post_attn_norm: Option<Norm>,
    /// Norms on q and k, before RoPE: per head, or over the whole projection.
    qk_norm: Option<(QkNorm, [Norm; 2])>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    mlp_norm: Option<Norm>,
    post_mlp_norm: Option<Norm>,
    mlp: BlockMlp,
    /// The spec's learnable tensors (`self_attn.{name}`), starting at the spec's initial values.
    learned: Vec<(String, Tensor)>,
    /// The variant restricted to documents, made at the first packed forward.
    packed: std::sync::OnceLock<Arc<Variant>>,
    /// With differential heads: the pairing of the variant's component heads.
    differential: Option<DifferentialHeads>,
}

/// A block's differential heads: lambda's vectors (`self_attn.lambda_q1` ..), the paper's
/// per-head RMSNorm of the paired output (`self_attn.subln`) and its scale `1 - init`.
struct DifferentialHeads {
    lambda: [Tensor; 4],
    init: f64,
    subln: Norm,
}

impl DifferentialHeads {
    /// Layer `layer`'s differential heads (`{prefix}.lambda_*`, `{prefix}.subln`), where its
    /// spec has them: lambda's vectors at their initial values, the norm at 1.
    fn of(
        vb: &VarBuilder,
        prefix: &str,
        spec: &attn_dsl::AttentionSpec,
        layer: usize,
        eps: f64,
    ) -> Result<Option<DifferentialHeads>> {
        let Some(diff) = spec.differential else {
            return Ok(None);
        };
        let lambda = starting(vb, prefix, spec.lambda_initial_values(layer as u64))?;
        let lambda: [Tensor; 4] = lambda
            .into_iter()
            .map(|(_, t)| t)
            .collect::<Vec<_>>()
            .try_into()
            .map_err(|_| candle_core::Error::Msg("four lambda vectors".into()))?;
        let dv = spec.v_head_dim as usize;
        Ok(Some(DifferentialHeads {
            lambda,
            init: diff.lambda_init,
            subln: Norm::rms(vb, &format!("{prefix}.subln"), dv, eps)?,
        }))
    }

    /// The components' outputs `[B, heads, S, Dv]` (f32) paired, normed and scaled.
    fn forward(&self, o: &Tensor) -> Result<Tensor> {
        let [q1, k1, q2, k2] = &self.lambda;
        let paired = super::differential::combine(o, [q1, k1, q2, k2], self.init)?;
        self.subln.forward(&paired)? * (1.0 - self.init)
    }
}

impl Block {
    /// [`Block::variant`] with a document mask ([`with_document_mask`]), made once.
    fn packed_variant(&self) -> Result<&Arc<Variant>> {
        if let Some(v) = self.packed.get() {
            return Ok(v);
        }
        let masked = with_document_mask(self.variant.spec()).map_err(candle_core::Error::Msg)?;
        let variant = Variant::shared(&masked).map_err(candle_core::Error::wrap)?;
        Ok(self.packed.get_or_init(|| variant))
    }
}

/// A dense MLP, or one expert.
struct Mlp {
    /// The gate of SwiGLU and GeGLU.
    gate: Option<Linear>,
    up: Linear,
    down: Linear,
}

impl Mlp {
    /// The MLP `{prefix}.gate_proj`, `.up_proj`, `.down_proj`, `width` wide.
    fn new(vb: &VarBuilder, prefix: &str, config: &ModelConfig, width: usize) -> Result<Mlp> {
        let d = config.hidden;
        Ok(Mlp {
            gate: match config.mlp {
                MlpKind::SwiGlu | MlpKind::GeGlu | MlpKind::ClampedSwiGlu { .. } => Some(
                    Linear::new(vb, &format!("{prefix}.gate_proj"), width, d, false)?,
                ),
                MlpKind::Gelu | MlpKind::GeluExact => None,
            },
            up: Linear::new(vb, &format!("{prefix}.up_proj"), width, d, false)?,
            down: Linear::new(vb, &format!("{prefix}.down_proj"), d, width, false)?,
        })
    }

    fn forward(&self, kind: MlpKind, h: &Tensor) -> Result<Tensor> {
        let up = self.up.forward(h)?;
        let act = match (&self.gate, kind) {
            (Some(gate), MlpKind::GeGlu) => (gate.forward(h)?.gelu()? * up)?,
            (Some(gate), _) => (candle_nn::ops::silu(&gate.forward(h)?)? * up)?,
            (None, MlpKind::GeluExact) => up.gelu_erf()?,
            (None, _) => up.gelu()?,
        };
        self.down.forward(&act)
    }
}

/// A block's MLP: dense, or a mixture of experts (a research model's `[moe]`: softmax routing
/// to the top k, an ungated shared expert if any).
enum BlockMlp {
    Dense(Mlp),
    Moe {
        router: Linear,
        experts: Vec<Mlp>,
        shared: Option<Mlp>,
        top_k: usize,
        normalize: bool,
    },
}

impl Block {
    /// Its norm at `at`, if it has one.
    fn norm(&self, at: LayerNorm) -> Option<&Norm> {
        match at {
            LayerNorm::BeforeAttention => self.attn_norm.as_ref(),
            LayerNorm::AfterAttention => self.post_attn_norm.as_ref(),
            LayerNorm::BeforeMlp => self.mlp_norm.as_ref(),
            LayerNorm::AfterMlp => self.post_mlp_norm.as_ref(),
        }
    }
}

/// The candle model's decoder operations: candle's ops, which carry gradients, and attn's op
/// for attention.
struct CandleDecoder<'m, 't> {
    model: &'m CandleModel,
    /// Token ids `[B, S]`.
    tokens: &'t Tensor,
    /// `(B, S)`.
    shape: (usize, usize),
    /// Each token's document id `[B, S]`, for a packed window (attention within documents).
    documents: Option<&'t Tensor>,
}

impl DecoderOps for CandleDecoder<'_, '_> {
    type Rows = Tensor;
    type Error = candle_core::Error;

    fn embed(&mut self) -> Result<Tensor> {
        let (b, s) = self.shape;
        let rows = self.model.embed.embedding(&self.tokens.flatten_all()?)?;
        rows.reshape((b, s, ()))
    }

    fn norm(&mut self, at: NormAt, x: &Tensor) -> Result<Tensor> {
        let norm = match at {
            NormAt::Layer(i, at) => self.model.layers[i].norm(at),
            NormAt::Final => Some(&self.model.norm),
            // Refused by `CandleModel::new`.
            NormAt::Embedding => None,
        };
        match norm {
            Some(norm) => norm.forward(x),
            None => candle_core::bail!("attn::candle: the model has no norm at {at:?}"),
        }
    }

    fn attention(&mut self, i: usize, h: &Tensor) -> Result<Tensor> {
        self.model
            .attention(&self.model.layers[i], h, self.documents)
    }

    fn mlp(&mut self, i: usize, h: &Tensor) -> Result<Tensor> {
        self.model.mlp(&self.model.layers[i], h)
    }

    fn add(&mut self, x: Tensor, y: &Tensor) -> Result<Tensor> {
        x + y
    }

    fn scale(&mut self, x: Tensor, by: Multiplier) -> Result<Tensor> {
        let c = &self.model.config;
        let m = match by {
            Multiplier::Embedding => c.embed_multiplier,
            Multiplier::Residual => c.residual_multiplier,
            Multiplier::Logits => c.logit_multiplier,
        };
        match m {
            Some(m) => x * m,
            None => candle_core::bail!("attn::candle: the model has no {by:?} multiplier"),
        }
    }

    fn head(&mut self, x: &Tensor) -> Result<Tensor> {
        let head = self.model.lm_head.as_ref().unwrap_or(&self.model.embed);
        times_transposed(x, head)
    }

    fn softcap(&mut self, logits: Tensor) -> Result<Tensor> {
        match self.model.config.final_softcap {
            Some(c) => (logits / c)?.tanh()? * c,
            None => candle_core::bail!("attn::candle: the model has no final softcap"),
        }
    }
}

fn normal() -> Init {
    Init::Randn {
        mean: 0.0,
        stdev: INIT_STD,
    }
}

impl CandleModel {
    /// The model of `config`, its variables made (or found) in `vb` under Hugging Face's names:
    /// normal(0, 0.02) matrices and embeddings, norms at 1, biases at 0.
    pub fn new(config: &ModelConfig, vb: VarBuilder) -> Result<CandleModel> {
        config.validate().map_err(candle_core::Error::wrap)?;
        if config.attention.iter().any(|spec| spec.mla().is_some()) {
            candle_core::bail!("attn::candle: MLA models do not train through candle yet");
        }
        if config.mlp_bias
            || config.mlp_names != MlpNames::GateUpDown
            || config.projections != Projections::Separate
            || config.tensor_names != TensorNames::Llama
        {
            candle_core::bail!(
                "attn::candle: MLP biases, starcoder2's MLP names and phi3's fused projections do \
                 not train through candle yet"
            );
        }
        let research_moe = |m: &crate::runtime::model::Moe| {
            m.router == Router::Softmax
                && m.scale == 1.0
                && m.names == ExpertNames::Qwen
                && m.shared.is_none_or(|s| !s.gated)
        };
        if config.moe.as_ref().is_some_and(|m| !research_moe(m))
            || matches!(config.mlp, MlpKind::ClampedSwiGlu { .. })
        {
            candle_core::bail!(
                "attn::candle: checkpoints' mixtures of experts (grouped, sigmoid or biased \
                 routers, scaled or gated experts) and gpt-oss's clamped SwiGLU do not train \
                 through candle yet; a research model's [moe] does"
            );
        }
        if config.qk_norm == Some(QkNorm::PerHeadLayer) || config.embed_norm {
            candle_core::bail!(
                "attn::candle: cohere's per-head q/k LayerNorms and bloom's embedding norm do \
                 not train through candle yet"
            );
        }
        if config.norm_unit_offset
            || config.embed_multiplier.is_some()
            || config.final_softcap.is_some()
            || config.residual_multiplier.is_some()
            || config.logit_multiplier.is_some()
        {
            candle_core::bail!(
                "attn::candle: norms of 1 + w, multipliers and final logit softcaps (gemma's, \
                 granite's, cohere's) do not train through candle yet"
            );
        }
        // Differential heads run their component heads' variant (the same spec otherwise).
        let variants = config
            .attention
            .iter()
            .map(|spec| {
                Variant::shared(&spec.differential_components()).map_err(candle_core::Error::wrap)
            })
            .collect::<Result<Vec<_>>>()?;
        let (d, inter) = (config.hidden, config.intermediate);
        let bias = config.qkv_bias;
        let layers = (0..config.layers)
            .map(|i| {
                let variant = variants[config.kind_of(i)].clone();
                let spec = &config.attention[config.kind_of(i)];
                let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
                let (hv, ho) = (spec.value_heads() as usize, spec.output_heads() as usize);
                let (dk, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
                let p = format!("model.layers.{i}");
                let a = format!("{p}.self_attn");
                let eps = config.norm_eps;
                let [attn_norm, post_attn_norm, mlp_norm, post_mlp_norm] =
                    config.placement.norm_names().map(|name| {
                        name.map(|n| Norm::new(&vb, &format!("{p}.{n}"), d, config))
                            .transpose()
                    });
                let qk_width = |heads: usize| match config.qk_norm {
                    Some(QkNorm::Whole) => heads * dk,
                    _ => dk,
                };
                Ok(Block {
                    attn_norm: attn_norm?,
                    post_attn_norm: post_attn_norm?,
                    mlp_norm: mlp_norm?,
                    post_mlp_norm: post_mlp_norm?,
                    qk_norm: match config.qk_norm {
                        Some(kind) => Some((
                            kind,
                            [
                                Norm::rms(&vb, &format!("{a}.q_norm"), qk_width(h), eps)?,
                                Norm::rms(&vb, &format!("{a}.k_norm"), qk_width(hkv), eps)?,
                            ],
                        )),
                        None => None,
                    },
                    q: Linear::new(&vb, &format!("{a}.q_proj"), h * dk, d, bias)?,
                    k: Linear::new(&vb, &format!("{a}.k_proj"), hkv * dk, d, bias)?,
                    v: Linear::new(&vb, &format!("{a}.v_proj"), hv * dv, d, bias)?,
                    o: Linear::new(&vb, &format!("{a}.o_proj"), d, ho * dv, config.o_bias)?,
                    mlp: match config.moe.as_ref().filter(|m| m.sparse[i]) {
                        None => BlockMlp::Dense(Mlp::new(&vb, &format!("{p}.mlp"), config, inter)?),
                        Some(moe) => {
                            let (router, experts) = moe.tensor_prefixes(i);
                            let expert = |names: &[String; 3]| {
                                let prefix = names[0].trim_end_matches(".gate_proj");
                                Mlp::new(&vb, prefix, config, moe.intermediate)
                            };
                            BlockMlp::Moe {
                                router: Linear::new(&vb, &router, moe.experts, d, false)?,
                                experts: experts.iter().map(expert).collect::<Result<_>>()?,
                                shared: match moe.shared_prefixes(i) {
                                    Some((names, _)) => Some(Mlp::new(
                                        &vb,
                                        names[0].trim_end_matches(".gate_proj"),
                                        config,
                                        moe.shared.map_or(inter, |s| s.width),
                                    )?),
                                    None => None,
                                },
                                top_k: moe.top_k,
                                normalize: moe.normalize,
                            }
                        }
                    },
                    learned: starting(&vb, &a, spec.initial_values(i as u64))?,
                    differential: DifferentialHeads::of(&vb, &a, spec, i, eps)?,
                    variant,
                    packed: std::sync::OnceLock::new(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = vb.get_with_hints((config.vocab, d), "model.embed_tokens.weight", normal())?;
        let lm_head = match config.tie_embeddings {
            true => None,
            false => Some(vb.get_with_hints((config.vocab, d), "lm_head.weight", normal())?),
        };
        Ok(CandleModel {
            config: config.clone(),
            embed,
            layers,
            norm: Norm::new(&vb, "model.norm", d, config)?,
            lm_head,
            context: None,
        })
    }

    /// Makes the model one rank's part of context-parallel training: the tokens it is given are
    /// the positions [`crate::distributed::ContextParallel::split`] gives this rank of every
    /// window, and each attention runs over the ranks of `context` (`None`: a whole model
    /// again).
    pub fn set_context(&mut self, context: Option<super::Context>) {
        self.context = context;
    }

    /// Sets every matrix of `varmap` (rank 2: projections, embeddings, the head) to values
    /// from normal(0, 0.02) drawn from `seed`, in the order of the variables' names, so that a
    /// model's initial weights depend on the seed alone: candle's CPU generator cannot be
    /// seeded. Norms, biases and learnable attention tensors (`params(...)`, `sinks`, at the
    /// spec's initial values) keep their values.
    pub fn seed_weights(varmap: &VarMap, seed: u64) -> Result<()> {
        let vars = varmap
            .data()
            .lock()
            .map_err(|_| candle_core::Error::Msg("the variables' lock is poisoned".into()))?;
        let mut names: Vec<&String> = vars.keys().collect();
        names.sort();
        let mut rng = crate::inputs::XorShift::new(seed);
        let mut uniform = move || {
            // In (0, 1]: a logarithm of it is finite.
            ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
        };
        for name in names {
            let var = &vars[name];
            // Matrices only: norms keep 1 and learnable attention tensors their initial values.
            if var.rank() != 2 || is_learned(name) {
                continue;
            }
            // Box-Muller: two uniforms make one standard normal value.
            let values: Vec<f32> = (0..var.elem_count())
                .map(|_| {
                    let (u, v) = (uniform(), uniform());
                    let z = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
                    (z * INIT_STD) as f32
                })
                .collect();
            let seeded =
                Tensor::from_vec(values, var.shape(), var.device())?.to_dtype(var.dtype())?;
            var.set(&seeded)?;
        }
        Ok(())
    }

    /// The config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Logits `[B, S, vocab]` (f32) of token ids `[B, S]` (u32), positions from 0.
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        self.run(tokens, None)
    }

    /// [`CandleModel::forward`] over packed windows: `documents [B, S]` (I32, U32 or I64) holds
    /// each token's document id, and every attention keeps the pairs within one document
    /// ([`attn_dsl::data::with_document_mask`]). Positions run on across a window's documents;
    /// RoPE and ALiBi see only differences, which a document mask keeps within a document.
    /// With a context ([`CandleModel::set_context`]), `documents` are the whole windows' ids,
    /// `[B, ranks * S]`, and `tokens` this rank's positions of them.
    pub fn forward_documents(&self, tokens: &Tensor, documents: &Tensor) -> Result<Tensor> {
        let ranks = self.context.as_ref().map_or(1, |c| c.comm.size());
        let (b, s) = tokens.dims2()?;
        if documents.dims() != [b, s * ranks] {
            candle_core::bail!(
                "attn::candle: document ids of shape {:?} for tokens of shape {:?}",
                documents.dims(),
                tokens.dims()
            );
        }
        self.run(tokens, Some(documents))
    }

    fn run(&self, tokens: &Tensor, documents: Option<&Tensor>) -> Result<Tensor> {
        let (b, s) = tokens.dims2()?;
        if let Some(max) = tokens.flatten_all()?.max(0)?.to_scalar::<u32>().ok()
            && max as usize >= self.config.vocab
        {
            candle_core::bail!(
                "token id {max} is out of range; the model's vocabulary has {} ids",
                self.config.vocab
            );
        }
        Decoder::of(&self.config).run(&mut CandleDecoder {
            model: self,
            tokens,
            shape: (b, s),
            documents,
        })
    }

    /// A block's attention over its normed input `h`, `[B, S, hidden]`: projections, q/k
    /// norms, attn's op with the block's learnable tensors (and, for packed windows, within
    /// each token's document), the output projection.
    fn attention(&self, block: &Block, h: &Tensor, documents: Option<&Tensor>) -> Result<Tensor> {
        let spec = block.variant.spec();
        let (b, s, _) = h.dims3()?;
        let dtype = super::convert::candle_dtype(spec.dtype);
        // [B, S, heads * dim] as [B, S, heads, dim], normed where the model norms q and k.
        let split = |t: Tensor, h: u32, dim: u32, norm: Option<(QkNorm, &Norm)>| {
            let t = match norm {
                Some((QkNorm::Whole, n)) => n.forward(&t)?,
                _ => t,
            };
            let t = t.reshape((b, s, h as usize, dim as usize))?;
            match norm {
                Some((QkNorm::PerHead, n)) => n.forward(&t),
                _ => Ok(t),
            }
        };
        // [B, S, heads, dim] as [B, heads, S, dim]: a strided view attn reads as it is.
        let heads = |t: Tensor| t.transpose(1, 2)?.to_dtype(dtype);
        let [q_norm, k_norm] = match &block.qk_norm {
            Some((kind, [q, k])) => [Some((*kind, q)), Some((*kind, k))],
            None => [None, None],
        };
        let hkv = spec.kv_heads();
        let hv = match block.differential {
            Some(_) => hkv / 2,
            None => hkv,
        };
        let q = heads(split(
            block.q.forward(h)?,
            spec.heads,
            spec.head_dim,
            q_norm,
        )?)?;
        let k = heads(split(block.k.forward(h)?, hkv, spec.head_dim, k_norm)?)?;
        let v = heads(split(block.v.forward(h)?, hv, spec.v_head_dim, None)?)?;
        let v = match block.differential {
            Some(_) => super::differential::values_per_component(&v)?,
            None => v,
        };
        let learned: Vec<(&str, &Tensor)> =
            block.learned.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let a = match (documents, &self.context) {
            (None, None) => attention_learned(&block.variant, &q, &k, &v, &learned, 0)?,
            (None, Some(c)) => {
                super::attention_context_parallel(&block.variant, &q, &k, &v, &learned, &[], c)?
            }
            (Some(ids), Some(c)) => {
                let data = [(DOCUMENT_IDS, ids)];
                let variant = block.packed_variant()?;
                super::attention_context_parallel(variant, &q, &k, &v, &learned, &data, c)?
            }
            (Some(ids), None) => {
                let data = [(DOCUMENT_IDS, ids)];
                let variant = block.packed_variant()?;
                attention_with_data(variant, &q, &k, &v, &learned, &data, 0)?.0
            }
        }
        .to_dtype(DType::F32)?;
        let a = match &block.differential {
            Some(heads) => heads.forward(&a)?,
            None => a,
        };
        block.o.forward(&a.transpose(1, 2)?.reshape((b, s, ()))?)
    }

    /// The block's MLP on `h`.
    fn mlp(&self, block: &Block, h: &Tensor) -> Result<Tensor> {
        let kind = self.config.mlp;
        match &block.mlp {
            BlockMlp::Dense(mlp) => mlp.forward(kind, h),
            BlockMlp::Moe {
                router,
                experts,
                shared,
                top_k,
                normalize,
            } => moe(
                kind,
                router,
                experts,
                shared.as_ref(),
                (*top_k, *normalize),
                h,
            ),
        }
    }
}

/// A mixture of experts on `h`: each token's top-k experts by the router's softmax, each expert
/// over its tokens (gathered), their outputs weighted and added back, on top of the shared
/// expert's.
fn moe(
    kind: MlpKind,
    router: &Linear,
    experts: &[Mlp],
    shared: Option<&Mlp>,
    (top_k, normalize): (usize, bool),
    h: &Tensor,
) -> Result<Tensor> {
    // Tokens as rows: `[N, d]`.
    let shape = h.shape().clone();
    let d = *shape.dims().last().unwrap_or(&1);
    let rows = h.reshape(((), d))?;
    let probs = candle_nn::ops::softmax(&router.forward(&rows)?, D::Minus1)?;
    // The choice is made on the values (ties to the lower index, as the runtime chooses);
    // the weights stay on the graph, so the router learns through them.
    let (chosen, weights) = choose(&probs, top_k, normalize)?;
    let mut out = match shared {
        Some(mlp) => mlp.forward(kind, &rows)?,
        None => rows.zeros_like()?,
    };
    for (e, expert) in experts.iter().enumerate() {
        let (token, slot): (Vec<u32>, Vec<u32>) = chosen
            .iter()
            .enumerate()
            .flat_map(|(t, c)| {
                c.iter()
                    .position(|&x| x == e)
                    .map(|s| (t as u32, (t * top_k + s) as u32))
            })
            .unzip();
        if token.is_empty() {
            continue;
        }
        let index = Tensor::new(token.as_slice(), rows.device())?;
        let w = weights.index_select(&Tensor::new(slot.as_slice(), rows.device())?, 0)?;
        let y = expert.forward(kind, &rows.index_select(&index, 0)?)?;
        out = out.index_add(&index, &y.broadcast_mul(&w.unsqueeze(1)?)?, 0)?;
    }
    out.reshape(shape)
}

/// Each row's `top_k` experts by probability (ties to the lower index) and their weights
/// `[rows * top_k]` (row-major, on the graph; divided by their row's sum when `normalize`).
fn choose(probs: &Tensor, top_k: usize, normalize: bool) -> Result<(Vec<Vec<usize>>, Tensor)> {
    let values = probs.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let chosen: Vec<Vec<usize>> = values
        .iter()
        .map(|row| {
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            order.truncate(top_k);
            order
        })
        .collect();
    let index: Vec<u32> = chosen.iter().flatten().map(|&e| e as u32).collect();
    let index = Tensor::from_vec(index, (chosen.len(), top_k), probs.device())?;
    let mut weights = probs.gather(&index, 1)?;
    if normalize {
        weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
    }
    Ok((chosen, weights.flatten_all()?))
}

/// `x` through `norm` where there is one.
/// A layer's learnable attention tensors (`{prefix}.{name}`) at their initial values (the
/// spec's, random ones drawn from the layer's index: the same start on every machine).
fn starting(
    vb: &VarBuilder,
    prefix: &str,
    initial: Vec<attn_dsl::initial::InitialTensor>,
) -> Result<Vec<(String, Tensor)>> {
    initial
        .into_iter()
        .map(|(name, shape, values)| {
            let t =
                vb.get_with_hints(shape.clone(), &format!("{prefix}.{name}"), Init::Const(0.0))?;
            if values.iter().any(|&x| x != 0.0) {
                // In place: `t` shares its storage with the variable `vb` made.
                let start = Tensor::from_vec(values, shape, t.device())?.to_dtype(t.dtype())?;
                t.slice_set(&start, 0, 0)?;
            }
            Ok((name, t))
        })
        .collect()
}

/// Whether a variable is a learnable attention tensor: `...self_attn.{name}` with no
/// `.weight` or `.bias` (projections end in those).
fn is_learned(name: &str) -> bool {
    name.rsplit_once(".self_attn.")
        .is_some_and(|(_, rest)| !rest.contains('.'))
}
