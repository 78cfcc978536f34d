//! A model resident on a [`Device`]: weights uploaded once in their checkpoint's dtype, every
//! activation kept in device memory from the embedding lookup to the logits, projections as
//! device GEMMs and everything else as generated GPU IR kernels (norms, q/k norms, activations,
//! multipliers, softcaps, residual adds, relayouts, attention, sinks). Only the token ids go up
//! and the logits come back.
//!
//! Layers may differ in attention: each kind has its own kernels, shared by its layers, and
//! each layer its own cache. Every norm placement, MLP kind and multiplier of [`ModelConfig`]
//! runs here, MLA in its absorbed form (a GEMM per head on each side of the kernels over the
//! shared latent head), and mixture-of-experts MLPs with their routing on the host (the
//! router's logits come back, the experts run on the device).
//!
//! [`ModelConfig`]: super::ModelConfig

use super::config::NormKind;
use super::layers::{LayerMlp, Linear, Matrix, Mlp, Norm};
use super::{AttentionWeights, Model};
use crate::device::{Device, DeviceBuffer, Scratch, f32_bytes, f32s};
use crate::error::RuntimeError;
use crate::gpu::{ForwardTables, resident_forward};
use crate::learned::Learned;
use crate::tensor::{Storage, Tensor};
use attn_dsl::DType;
use codegen::gpu::ir::{Half, Kernel};
use codegen::gpu::kernels::layers::{
    self, Activation, BiasArgs, ElementwiseArgs, EmbedArgs, NormArgs, Pointwise, SinkArgs,
    SwapArgs, THREADS,
};
use codegen::gpu::launch::{ForwardArgs, LaunchRecord, bind};
use codegen::gpu::verified;
use std::sync::Arc;

mod experts;
mod mla;
mod session;

pub use session::DeviceSession;

/// A weight matrix on the device.
struct DeviceMatrix {
    buffer: DeviceBuffer,
    dtype: DType,
    rows: usize,
    cols: usize,
}

/// A linear map on the device.
struct DeviceLinear {
    w: DeviceMatrix,
    bias: Option<DeviceBuffer>,
}

/// A norm on the device: its kernel and its weights.
struct DeviceNorm {
    kernel: Arc<Kernel>,
    weight: DeviceBuffer,
    bias: Option<DeviceBuffer>,
    width: usize,
}

/// A layer's learnable attention tensors on the device.
struct DeviceLearned {
    /// The parameters as the kernels read them (0 when the spec has none).
    params: i64,
    /// `[heads]` sink logits, for specs with learned sinks.
    sinks: Option<DeviceBuffer>,
}

struct DeviceLayer {
    /// Its attention kind (an index into the model's kinds).
    kind: usize,
    attn_norm: Option<DeviceNorm>,
    post_attn_norm: Option<DeviceNorm>,
    mlp_norm: Option<DeviceNorm>,
    post_mlp_norm: Option<DeviceNorm>,
    attn: DeviceAttention,
    mlp: DeviceLayerMlp,
}

/// A layer's attention weights on the device.
enum DeviceAttention {
    Heads(Box<DeviceHeads>),
    Mla(Box<DeviceMla>),
}

/// Per-head attention: q, k and v projections, the output projection.
struct DeviceHeads {
    q: DeviceLinear,
    k: DeviceLinear,
    v: DeviceLinear,
    o: DeviceLinear,
    /// Norms on the q and k projections (per head or over the whole projection).
    qk_norm: Option<[DeviceNorm; 2]>,
    learned: DeviceLearned,
}

/// MLA attention in its absorbed form: queries `[W_uk^T q_nope | q_pe]` and keys `[c_kv |
/// k_pe]` over one shared latent head, outputs expanded by `W_uv`; the per-head maps are one
/// device GEMM per head.
struct DeviceMla {
    /// `q_proj`, or `q_a_proj` when the queries are factored.
    q: DeviceLinear,
    /// The factored queries' norm and `q_b_proj`.
    q_b: Option<(DeviceNorm, DeviceLinear)>,
    /// `kv_a_proj_with_mqa`: `[c_kv | k_pe]` before the latent's norm.
    kv_a: DeviceLinear,
    kv_norm: DeviceNorm,
    /// `W_uk^T` per head, `[heads, latent_rank, head_dim]` f32.
    w_uk_t: DeviceBuffer,
    /// `W_uv` per head, `[heads, v_head_dim, latent_rank]` f32.
    w_uv: DeviceBuffer,
    o: DeviceLinear,
}

/// MLA's shapes: heads, `head_dim`, `v_head_dim`, `latent_rank`, `rope_dim`.
#[derive(Clone, Copy)]
struct MlaDims {
    heads: usize,
    d: usize,
    dv: usize,
    r: usize,
    dr: usize,
}

impl MlaDims {
    fn of(spec: &attn_dsl::AttentionSpec) -> Result<MlaDims, RuntimeError> {
        let mla = spec
            .mla()
            .ok_or_else(|| RuntimeError::Spec("MLA weights with a per-head spec".into()))?;
        Ok(MlaDims {
            heads: spec.heads as usize,
            d: spec.head_dim as usize,
            dv: spec.v_head_dim as usize,
            r: mla.latent_rank as usize,
            dr: mla.rope_dim as usize,
        })
    }
}

/// A dense MLP, or one expert, on the device.
struct DeviceMlp {
    gate: Option<DeviceLinear>,
    up: DeviceLinear,
    down: DeviceLinear,
}

/// A mixture-of-experts MLP on the device. The router's logits come back to the host, which
/// routes (`MoeMlp::route`); each expert then runs on the device over the rows routed to it,
/// gathered, and its weighted outputs are added back in expert order.
struct DeviceMoe {
    router: DeviceLinear,
    experts: Vec<DeviceMlp>,
    /// The shared expert, and the `[1, hidden]` map whose sigmoid gates it where it is gated.
    shared: Option<(DeviceMlp, Option<DeviceLinear>)>,
}

/// A layer's MLP on the device.
enum DeviceLayerMlp {
    Dense(DeviceMlp),
    Moe(Box<DeviceMoe>),
}

/// One attention kind's forward kernel and the relayout into its inputs.
struct DeviceKind {
    forward: Arc<codegen::gpu::ForwardKernel>,
    /// `[tokens, heads, dim]` f32 to the forward kernel's `[heads, tokens, dim]` inputs.
    to_heads: Arc<Kernel>,
}

/// The layer kernels a model uses, lowered and verified once.
struct Kernels {
    embed: Arc<Kernel>,
    activation: Arc<Kernel>,
    add: Arc<Kernel>,
    bias: Arc<Kernel>,
    /// The attention output `[heads, tokens, dim]` back to `[tokens, heads, dim]`, f32.
    from_heads: Arc<Kernel>,
    sinks: Arc<Kernel>,
    /// Rows gathered by index (a decode step's query rows, an expert's tokens) and weighted
    /// rows added back (an expert's outputs).
    gather: Arc<Kernel>,
    scatter: Arc<Kernel>,
    /// Column ranges copied between layouts (MLA's queries and keys).
    columns: Arc<Kernel>,
    /// The embedding, residual and logit multipliers and the final softcap, where the model
    /// has them.
    embed_scale: Option<Arc<Kernel>>,
    residual_scale: Option<Arc<Kernel>>,
    logit_scale: Option<Arc<Kernel>>,
    softcap: Option<Arc<Kernel>>,
}

/// A model whose weights live on a device (see the module's documentation).
pub struct DeviceModel<'m> {
    model: &'m Model,
    device: Arc<dyn Device>,
    embed: DeviceMatrix,
    embed_norm: Option<DeviceNorm>,
    layers: Vec<DeviceLayer>,
    final_norm: DeviceNorm,
    lm_head: Option<DeviceLinear>,
    kernels: Kernels,
    kinds: Vec<DeviceKind>,
    /// Every weight buffer, freed with the model.
    owned: Vec<DeviceBuffer>,
}

impl Drop for DeviceModel<'_> {
    fn drop(&mut self) {
        for b in self.owned.drain(..) {
            self.device.free(b);
        }
    }
}

/// Uploads weights, keeping every buffer it makes.
struct Uploader<'d> {
    device: &'d dyn Device,
    owned: Vec<DeviceBuffer>,
}

impl Uploader<'_> {
    fn bytes(&mut self, bytes: &[u8]) -> Result<DeviceBuffer, RuntimeError> {
        let b = self.device.upload(bytes)?;
        self.owned.push(b);
        Ok(b)
    }

    fn matrix(&mut self, m: &Matrix) -> Result<DeviceMatrix, RuntimeError> {
        let (bytes, dtype) = match m.storage() {
            Storage::F32(v) => (f32_bytes(v), DType::F32),
            Storage::Bf16(v) => (
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                DType::Bf16,
            ),
            Storage::F16(v) => (v.iter().flat_map(|x| x.to_le_bytes()).collect(), DType::F16),
        };
        Ok(DeviceMatrix {
            buffer: self.bytes(&bytes)?,
            dtype,
            rows: m.rows,
            cols: m.cols,
        })
    }

    fn linear(&mut self, l: &Linear) -> Result<DeviceLinear, RuntimeError> {
        Ok(DeviceLinear {
            w: self.matrix(&l.w)?,
            bias: l
                .bias
                .as_ref()
                .map(|b| self.bytes(&f32_bytes(b)))
                .transpose()?,
        })
    }

    fn norm(&mut self, n: &Norm) -> Result<DeviceNorm, RuntimeError> {
        let kind = match n.kind {
            NormKind::Rms => layers::NormKind::Rms,
            NormKind::Layer => layers::NormKind::Layer,
        };
        // Each row of weights serves `groups` rows of the input (cohere's heads).
        let groups = n.groups.max(1);
        let width = n.weight.len() / groups;
        let kernel = layers::norm(
            kind,
            width_u32(width)?,
            n.eps as f32,
            n.bias.is_some(),
            width_u32(groups)?,
        );
        Ok(DeviceNorm {
            kernel: Arc::new(verified(kernel)?),
            weight: self.bytes(&f32_bytes(&n.weight))?,
            bias: n
                .bias
                .as_ref()
                .map(|b| self.bytes(&f32_bytes(b)))
                .transpose()?,
            width,
        })
    }

    fn norms(&mut self, n: Option<&Norm>) -> Result<Option<DeviceNorm>, RuntimeError> {
        n.map(|n| self.norm(n)).transpose()
    }

    /// Layer `i`'s attention weights (its spec `spec`).
    fn attention(
        &mut self,
        spec: &attn_dsl::AttentionSpec,
        attn: &AttentionWeights,
        i: usize,
    ) -> Result<DeviceAttention, RuntimeError> {
        Ok(match attn {
            AttentionWeights::Heads {
                q,
                k,
                v,
                o,
                qk_norm,
                learned,
            } => DeviceAttention::Heads(Box::new(DeviceHeads {
                q: self.linear(q)?,
                k: self.linear(k)?,
                v: self.linear(v)?,
                o: self.linear(o)?,
                qk_norm: match qk_norm {
                    Some([qn, kn]) => Some([self.norm(qn)?, self.norm(kn)?]),
                    None => None,
                },
                learned: self.learned(spec, learned, i)?,
            })),
            AttentionWeights::Mla {
                q,
                q_b,
                kv_a,
                kv_norm,
                w_kv_b,
                o,
            } => {
                let MlaDims {
                    heads, d, dv, r, ..
                } = MlaDims::of(spec)?;
                // `w_kv_b` holds per head `d` rows of W_uk, then `dv` rows of W_uv (`[rows, r]`).
                let w = w_kv_b.to_f32_vec();
                let mut uk_t = Vec::with_capacity(heads * r * d);
                let mut uv = Vec::with_capacity(heads * dv * r);
                for head in w.chunks_exact((d + dv) * r) {
                    for col in 0..r {
                        uk_t.extend((0..d).map(|row| head[row * r + col]));
                    }
                    uv.extend_from_slice(&head[d * r..]);
                }
                DeviceAttention::Mla(Box::new(DeviceMla {
                    q: self.linear(q)?,
                    q_b: match q_b {
                        Some((norm, l)) => Some((self.norm(norm)?, self.linear(l)?)),
                        None => None,
                    },
                    kv_a: self.linear(kv_a)?,
                    kv_norm: self.norm(kv_norm)?,
                    w_uk_t: self.bytes(&f32_bytes(&uk_t))?,
                    w_uv: self.bytes(&f32_bytes(&uv))?,
                    o: self.linear(o)?,
                }))
            }
        })
    }

    fn mlp(&mut self, m: &Mlp) -> Result<DeviceMlp, RuntimeError> {
        Ok(DeviceMlp {
            gate: m.gate.as_ref().map(|g| self.linear(g)).transpose()?,
            up: self.linear(&m.up)?,
            down: self.linear(&m.down)?,
        })
    }

    fn layer_mlp(&mut self, m: &LayerMlp) -> Result<DeviceLayerMlp, RuntimeError> {
        Ok(match m {
            LayerMlp::Dense(m) => DeviceLayerMlp::Dense(self.mlp(m)?),
            LayerMlp::Moe(moe) => DeviceLayerMlp::Moe(Box::new(DeviceMoe {
                router: self.linear(&moe.router)?,
                experts: moe
                    .experts
                    .iter()
                    .map(|e| self.mlp(e))
                    .collect::<Result<_, _>>()?,
                shared: match &moe.shared {
                    Some((e, gate)) => Some((
                        self.mlp(e)?,
                        gate.as_ref().map(|g| self.linear(g)).transpose()?,
                    )),
                    None => None,
                },
            })),
        })
    }

    /// Layer `i`'s learnable tensors, checked against its spec; its sinks must be finite.
    fn learned(
        &mut self,
        spec: &attn_dsl::AttentionSpec,
        learned: &[(String, Tensor)],
        i: usize,
    ) -> Result<DeviceLearned, RuntimeError> {
        let named: Vec<(&str, &Tensor)> = learned.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let bound = Learned::new(&named).bind(spec)?;
        let params = match bound.params.is_empty() {
            true => 0,
            false => self.bytes(&f32_bytes(&bound.params))?.addr,
        };
        let sinks = match &bound.sinks {
            Some(s) if s.iter().any(|v| !v.is_finite()) => {
                return Err(RuntimeError::Data(format!(
                    "layer {i}'s sinks are not all finite; a resident model needs finite sinks"
                )));
            }
            Some(s) => Some(self.bytes(&f32_bytes(s))?),
            None => None,
        };
        Ok(DeviceLearned { params, sinks })
    }
}

fn width_u32(width: usize) -> Result<u32, RuntimeError> {
    u32::try_from(width).map_err(|_| RuntimeError::Data(format!("rows of {width} values")))
}

/// A grid of `count` threads in CTAs of the layer kernels' size.
fn blocks(count: usize) -> Result<[u32; 3], RuntimeError> {
    let n = u32::try_from(count.div_ceil(THREADS as usize).max(1))
        .map_err(|_| RuntimeError::Data(format!("{count} elements are more than a grid holds")))?;
    Ok([n, 1, 1])
}

fn half_of(dtype: DType) -> Option<Half> {
    match dtype {
        DType::F32 => None,
        DType::Bf16 => Some(Half::Bf16),
        DType::F16 => Some(Half::F16),
    }
}

impl<'m> DeviceModel<'m> {
    /// Uploads `model`'s weights to `device` and prepares its kernels.
    pub fn new(model: &'m Model, device: Arc<dyn Device>) -> Result<Self, RuntimeError> {
        let c = &model.config;
        let kernel = |k: Kernel| verified(k).map(Arc::new);
        let kinds = model
            .variants()
            .iter()
            .map(|variant| {
                // bf16 specs whose RoPE rotates every column take bf16 Q K^T operands here
                // (f16 ones would need a range check on the device first), as bf16 SDPA
                // computes.
                let forward = resident_forward(variant)?;
                let to_heads = kernel(layers::swap_outer(half_of(forward.inputs)))?;
                Ok(DeviceKind { forward, to_heads })
            })
            .collect::<Result<Vec<_>, RuntimeError>>()?;
        let mut up = Uploader {
            device: device.as_ref(),
            owned: Vec::new(),
        };
        let mut layers_on_device = Vec::with_capacity(model.layers.len());
        for (i, layer) in model.layers.iter().enumerate() {
            let attn = up.attention(c.layer_attention(i), &layer.attn, i)?;
            layers_on_device.push(DeviceLayer {
                kind: c.kind_of(i),
                attn_norm: up.norms(layer.attn_norm.as_ref())?,
                post_attn_norm: up.norms(layer.post_attn_norm.as_ref())?,
                mlp_norm: up.norms(layer.mlp_norm.as_ref())?,
                post_mlp_norm: up.norms(layer.post_mlp_norm.as_ref())?,
                attn,
                mlp: up.layer_mlp(&layer.mlp)?,
            });
        }
        let embed = up.matrix(&model.embed)?;
        let embed_norm = up.norms(model.embed_norm.as_ref())?;
        let final_norm = up.norm(&model.final_norm)?;
        let lm_head = model.lm_head.as_ref().map(|l| up.linear(l)).transpose()?;
        let activation = match c.mlp {
            super::MlpKind::SwiGlu => Activation::SwiGlu,
            super::MlpKind::Gelu => Activation::Gelu,
            super::MlpKind::GeluExact => Activation::GeluExact,
            super::MlpKind::GeGlu => Activation::GeGlu,
            super::MlpKind::ClampedSwiGlu { alpha, limit } => Activation::ClampedSwiGlu {
                alpha: alpha.to_bits(),
                limit: limit.to_bits(),
            },
        };
        let pointwise =
            |op: Option<Pointwise>| op.map(|op| kernel(layers::pointwise(op))).transpose();
        let kernels = Kernels {
            embed: kernel(layers::embed(width_u32(c.hidden)?, half_of(embed.dtype)))?,
            activation: kernel(layers::activation(activation))?,
            add: kernel(layers::residual_add())?,
            bias: kernel(layers::bias_add())?,
            from_heads: kernel(layers::swap_outer(None))?,
            sinks: kernel(layers::sink_rows())?,
            gather: kernel(layers::gather_rows())?,
            scatter: kernel(layers::scatter_add_rows())?,
            columns: kernel(layers::columns())?,
            embed_scale: pointwise(model.embed_multiplier().map(Pointwise::Scale))?,
            residual_scale: pointwise(c.residual_multiplier.map(|m| Pointwise::Scale(m as f32)))?,
            logit_scale: pointwise(c.logit_multiplier.map(|m| Pointwise::Scale(m as f32)))?,
            softcap: pointwise(c.final_softcap.map(|cap| Pointwise::Softcap(cap as f32)))?,
        };
        Ok(DeviceModel {
            model,
            owned: up.owned,
            device,
            embed,
            embed_norm,
            layers: layers_on_device,
            final_norm,
            lm_head,
            kernels,
            kinds,
        })
    }

    /// On the interpreter, refuses a pass of `tokens` new tokens against `keys` keys that would
    /// take it longer than [`sim_cost::MAX_SECONDS`](crate::gpu::sim_cost::MAX_SECONDS).
    fn check_sim_cost(&self, tokens: usize, keys: usize) -> Result<(), RuntimeError> {
        if self.device.name() != "gpu-sim" {
            return Ok(());
        }
        let c = &self.model.config;
        let seconds: f64 = (0..c.layers)
            .map(|i| {
                crate::gpu::sim_cost::layers_seconds(
                    c.layer_attention(i),
                    1,
                    c.hidden as u64,
                    c.intermediate as u64,
                    tokens as u64,
                    keys as u64,
                )
            })
            .sum();
        crate::gpu::sim_cost::check(
            &format!("a pass of {tokens} tokens through {} layers", c.layers),
            seconds,
        )
    }

    /// Logits `[tokens, vocab]` of a whole sequence (causal; positions from 0), computed on the
    /// device.
    pub fn forward(&self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let n = tokens.len();
        self.check_sim_cost(n, n)?;
        let mut s = Scratch::new(self.device.as_ref());
        let logits = self.run_layers(&mut s, tokens, |s, _, layer, h| {
            self.attention(s, layer, h, n)
        })?;
        Ok(f32s(&self.device.download(logits)?))
    }

    /// The decoder over `tokens` with each layer's attention from `attention(scratch, layer
    /// index, layer, normed rows)`: embedding, blocks, final norm, LM head; the logits buffer.
    /// The blocks place their norms as the CPU model does (`Model::run`).
    fn run_layers(
        &self,
        s: &mut Scratch,
        tokens: &[u32],
        mut attention: impl FnMut(
            &mut Scratch,
            usize,
            &DeviceLayer,
            DeviceBuffer,
        ) -> Result<DeviceBuffer, RuntimeError>,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let c = &self.model.config;
        let n = tokens.len();
        if let Some((i, t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, t)| **t as usize >= c.vocab)
        {
            return Err(RuntimeError::Data(format!(
                "token {i} is {t}, outside the vocabulary of {}",
                c.vocab
            )));
        }
        let d = c.hidden;
        let rows = u32::try_from(n)
            .map_err(|_| RuntimeError::Data(format!("{n} tokens are more than a grid holds")))?;
        let ids: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let mut x = s.f32s(n * d)?;
        self.launch(
            &self.kernels.embed,
            [rows, 1, 1],
            &EmbedArgs {
                tokens: s.upload(&ids)?.addr,
                table: self.embed.buffer.addr,
                out: x.addr,
            },
        )?;
        self.pointwise(self.kernels.embed_scale.as_ref(), x, n * d)?;
        if let Some(norm) = &self.embed_norm {
            x = self.norm(s, norm, x, n * d)?;
        }
        let parallel = c.placement.parallel();
        for (i, layer) in self.layers.iter().enumerate() {
            // Without a norm before it, a sublayer reads the stream itself (it only reads).
            let h = self.normed(s, layer.attn_norm.as_ref(), x, n * d)?;
            let a = attention(s, i, layer, h)?;
            if parallel {
                // Both sublayers read the stream (normed once, or each by its own norm) and
                // add to it together.
                let h = match &layer.mlp_norm {
                    Some(norm) => self.norm(s, norm, x, n * d)?,
                    None => h,
                };
                let m = self.mlp(s, i, layer, h, n)?;
                self.add(a, m, n * d)?;
                self.add(x, a, n * d)?;
                continue;
            }
            let a = self.normed(s, layer.post_attn_norm.as_ref(), a, n * d)?;
            self.pointwise(self.kernels.residual_scale.as_ref(), a, n * d)?;
            self.add(x, a, n * d)?;
            let h = self.normed(s, layer.mlp_norm.as_ref(), x, n * d)?;
            let m = self.mlp(s, i, layer, h, n)?;
            let m = self.normed(s, layer.post_mlp_norm.as_ref(), m, n * d)?;
            self.pointwise(self.kernels.residual_scale.as_ref(), m, n * d)?;
            self.add(x, m, n * d)?;
        }
        let h = self.norm(s, &self.final_norm, x, n * d)?;
        let logits = match &self.lm_head {
            Some(head) => self.linear(s, head, h, n)?,
            None => {
                let y = s.f32s(n * self.embed.rows)?;
                self.gemm(h, &self.embed, y, n)?;
                y
            }
        };
        let count = n * c.vocab;
        self.pointwise(self.kernels.logit_scale.as_ref(), logits, count)?;
        self.pointwise(self.kernels.softcap.as_ref(), logits, count)?;
        Ok(logits)
    }

    /// Layer `i`'s MLP over `n` rows `h`.
    fn mlp(
        &self,
        s: &mut Scratch,
        i: usize,
        layer: &DeviceLayer,
        h: DeviceBuffer,
        n: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        match &layer.mlp {
            DeviceLayerMlp::Dense(m) => self.dense(s, m, h, n),
            DeviceLayerMlp::Moe(moe) => self.moe(s, i, moe, h, n),
        }
    }

    /// A dense MLP over `n` rows `h`: up (and gate), the activation, down.
    fn dense(
        &self,
        s: &mut Scratch,
        m: &DeviceMlp,
        h: DeviceBuffer,
        n: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let up = self.linear(s, &m.up, h, n)?;
        let gate = match &m.gate {
            Some(g) => self.linear(s, g, h, n)?,
            None => up,
        };
        let count = n * m.up.w.rows;
        self.launch(
            &self.kernels.activation,
            blocks(count)?,
            &ElementwiseArgs {
                x: up.addr,
                other: gate.addr,
                count: count as i64,
            },
        )?;
        self.linear(s, &m.down, up, n)
    }

    fn launch<R: LaunchRecord>(
        &self,
        kernel: &Arc<Kernel>,
        grid: [u32; 3],
        record: &R,
    ) -> Result<(), RuntimeError> {
        let args = bind(kernel, record).map_err(RuntimeError::Data)?;
        self.device.launch(kernel, grid, R::FIELDS, &args)
    }

    fn gemm(
        &self,
        x: DeviceBuffer,
        w: &DeviceMatrix,
        y: DeviceBuffer,
        n: usize,
    ) -> Result<(), RuntimeError> {
        self.device
            .gemm_t(x, w.buffer, w.dtype, y, n, w.cols, w.rows)
    }

    /// `x W^T (+ b)` for `n` rows, into a new buffer.
    fn linear(
        &self,
        s: &mut Scratch,
        l: &DeviceLinear,
        x: DeviceBuffer,
        n: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let y = s.f32s(n * l.w.rows)?;
        self.gemm(x, &l.w, y, n)?;
        if let Some(b) = l.bias {
            let count = n * l.w.rows;
            self.launch(
                &self.kernels.bias,
                blocks(count)?,
                &BiasArgs {
                    x: y.addr,
                    bias: b.addr,
                    count: count as i64,
                    width: l.w.rows as i64,
                },
            )?;
        }
        Ok(y)
    }

    /// `count` values of `x` normed in rows of the norm's width, into a new buffer.
    fn norm(
        &self,
        s: &mut Scratch,
        norm: &DeviceNorm,
        x: DeviceBuffer,
        count: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let rows = u32::try_from(count / norm.width).map_err(|_| {
            RuntimeError::Data(format!("{count} values are more than a grid holds"))
        })?;
        let out = s.f32s(count)?;
        self.launch(
            &norm.kernel,
            [rows, 1, 1],
            &NormArgs {
                x: x.addr,
                weight: norm.weight.addr,
                bias: norm.bias.unwrap_or(norm.weight).addr,
                out: out.addr,
            },
        )?;
        Ok(out)
    }

    /// [`DeviceModel::norm`] where there is a norm; `x` itself where there is none.
    fn normed(
        &self,
        s: &mut Scratch,
        norm: Option<&DeviceNorm>,
        x: DeviceBuffer,
        count: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        match norm {
            Some(norm) => self.norm(s, norm, x, count),
            None => Ok(x),
        }
    }

    /// A multiplier or softcap in place over `count` values, where the model has it.
    fn pointwise(
        &self,
        kernel: Option<&Arc<Kernel>>,
        x: DeviceBuffer,
        count: usize,
    ) -> Result<(), RuntimeError> {
        let Some(kernel) = kernel else {
            return Ok(());
        };
        self.launch(
            kernel,
            blocks(count)?,
            &ElementwiseArgs {
                x: x.addr,
                other: x.addr,
                count: count as i64,
            },
        )
    }

    fn add(&self, x: DeviceBuffer, y: DeviceBuffer, count: usize) -> Result<(), RuntimeError> {
        self.launch(
            &self.kernels.add,
            blocks(count)?,
            &ElementwiseArgs {
                x: x.addr,
                other: y.addr,
                count: count as i64,
            },
        )
    }

    /// `[a, b, width]` f32 to `[b, a, width]` through `kernel` (f32 or packed 16-bit out).
    #[allow(clippy::too_many_arguments)]
    fn swap(
        &self,
        s: &mut Scratch,
        kernel: &Arc<Kernel>,
        x: DeviceBuffer,
        [a, b, width]: [usize; 3],
        out_size: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let count = a * b * width;
        let out = s.zeros(count * out_size)?;
        self.launch(
            kernel,
            blocks(count / if out_size == 2 { 2 } else { 1 })?,
            &SwapArgs {
                x: x.addr,
                out: out.addr,
                a: a as i64,
                b: b as i64,
                width: width as i64,
            },
        )?;
        Ok(out)
    }

    /// A layer's q, k and v projections of `n` normed rows `h`, q and k normed where the
    /// model norms them (before RoPE, which the attention kernels apply).
    fn qkv(
        &self,
        s: &mut Scratch,
        a: &DeviceHeads,
        h: DeviceBuffer,
        n: usize,
    ) -> Result<[DeviceBuffer; 3], RuntimeError> {
        let (mut q, mut k, v) = (
            self.linear(s, &a.q, h, n)?,
            self.linear(s, &a.k, h, n)?,
            self.linear(s, &a.v, h, n)?,
        );
        if let Some([q_norm, k_norm]) = &a.qk_norm {
            q = self.norm(s, q_norm, q, n * a.q.w.rows)?;
            k = self.norm(s, k_norm, k, n * a.k.w.rows)?;
        }
        Ok([q, k, v])
    }

    /// Folds a layer's sinks into its attention rows `out` (`rows` rows of `width`, row `r`
    /// of head `(r / per_head) % heads`) by their `lse`; nothing without sinks.
    #[allow(clippy::too_many_arguments)]
    fn sinks(
        &self,
        learned: &DeviceLearned,
        out: DeviceBuffer,
        lse: DeviceBuffer,
        [rows, width]: [usize; 2],
        per_head: usize,
        heads: usize,
    ) -> Result<(), RuntimeError> {
        let Some(sinks) = learned.sinks else {
            return Ok(());
        };
        self.launch(
            &self.kernels.sinks,
            blocks(rows * width)?,
            &SinkArgs {
                out: out.addr,
                lse: lse.addr,
                sinks: sinks.addr,
                count: (rows * width) as i64,
                width: width as i64,
                per_head: per_head as i64,
                heads: heads as i64,
            },
        )
    }

    /// One layer's attention over `n` normed rows `h`: the projections, the relayout to
    /// heads, the forward kernel (and sinks), the relayout back and the output projection.
    fn attention(
        &self,
        s: &mut Scratch,
        layer: &DeviceLayer,
        h: DeviceBuffer,
        n: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let variant = &self.model.variants()[layer.kind];
        let kind = &self.kinds[layer.kind];
        let spec = variant.spec();
        let size = kind.forward.inputs.size_bytes() as usize;
        let to = &kind.to_heads;
        let a = match &layer.attn {
            DeviceAttention::Heads(a) => a,
            DeviceAttention::Mla(m) => {
                let x = MlaDims::of(spec)?;
                let [qs, k, c_kv] = self.mla_rows(s, m, x, h, n)?;
                let q = self.mla_queries(s, m, x, qs, n, true)?;
                // One shared latent head: its rows go to the kernel in order, in its dtype.
                let w = x.r + x.dr;
                let q = self.swap(s, to, q, [1, x.heads * n, w], size)?;
                let k = self.swap(s, to, k, [1, n, w], size)?;
                let v = self.swap(s, to, c_kv, [1, n, x.r], size)?;
                let (latent, _) = self.forward_kernel(s, layer.kind, [q, k, v], n, 0)?;
                let rows = self.mla_outputs(s, m, x, latent, n)?;
                return self.linear(s, &m.o, rows, n);
            }
        };
        let (heads, kv_heads) = (spec.heads as usize, spec.kv_heads() as usize);
        let (dim, v_dim) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let [q, k, v] = self.qkv(s, a, h, n)?;
        let q = self.swap(s, to, q, [n, heads, dim], size)?;
        let k = self.swap(s, to, k, [n, kv_heads, dim], size)?;
        let v = self.swap(s, to, v, [n, kv_heads, v_dim], size)?;
        let (out, lse) = self.forward_kernel(s, layer.kind, [q, k, v], n, a.learned.params)?;
        // Rows head-major: `n` rows per head.
        self.sinks(&a.learned, out, lse, [heads * n, v_dim], n, heads)?;
        let rows = self.swap(s, &self.kernels.from_heads, out, [heads, n, v_dim], 4)?;
        self.linear(s, &a.o, rows, n)
    }

    /// Attention kind `kind`'s forward kernel over `n` tokens (positions from 0) of inputs in
    /// its layout and dtype, reading the parameters at `params`: its f32 outputs `[heads, n,
    /// v_dim]` and their log-sum-exps.
    fn forward_kernel(
        &self,
        s: &mut Scratch,
        kind: usize,
        [q, k, v]: [DeviceBuffer; 3],
        n: usize,
        params: i64,
    ) -> Result<(DeviceBuffer, DeviceBuffer), RuntimeError> {
        let variant = &self.model.variants()[kind];
        let forward = &self.kinds[kind].forward;
        let plan = variant.forward_plan();
        let (heads, v_dim) = (plan.shape.heads as usize, plan.shape.v_dim as usize);
        let t = ForwardTables::of(plan, forward, [1, n, n], 0);
        let codes: Vec<u8> = t.codes.iter().flat_map(|c| c.to_le_bytes()).collect();
        let table = |s: &mut Scratch, v: &[f32]| -> Result<i64, RuntimeError> {
            Ok(if v.is_empty() {
                0
            } else {
                s.upload(&f32_bytes(v))?.addr
            })
        };
        let (out, lse) = (s.f32s(heads * n * v_dim)?, s.f32s(heads * n)?);
        let record = ForwardArgs {
            q: q.addr,
            k: k.addr,
            v: v.addr,
            out: out.addr,
            lse: lse.addr,
            codes: s.upload(&codes)?.addr,
            sq: n as i64,
            skv: n as i64,
            p0: 0,
            rope_cos: table(s, &t.rope_cos)?,
            rope_sin: table(s, &t.rope_sin)?,
            rope_pos0: t.rope_pos0,
            params,
        };
        self.launch(&forward.kernel, t.grid, &record)?;
        Ok((out, lse))
    }
}

/// Row indices as the gather and scatter kernels read them (i32; rows of a call fit).
fn i32_bytes(rows: impl Iterator<Item = usize>) -> Vec<u8> {
    rows.flat_map(|r| (r as i32).to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimDevice;
    use crate::model::research::config_from_toml;

    /// Learned slopes read inside the kernels and learned sinks folded in after them, on the
    /// device's forward and its cached steps, against the same model on the CPU.
    #[test]
    fn learned_parameters_and_sinks_run_resident() {
        let config = config_from_toml(
            "vocab = 37\nhidden = 32\nlayers = 2\nattention = \"heads = 4, kv_heads = 2, \
             head_dim = 8, mask = causal, position = rope, sinks = learned, params(slopes: \
             [heads]), score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32\"",
        )
        .unwrap();
        let mut model = Model::random(&config, 5).unwrap();
        for (l, layer) in model.layers.iter_mut().enumerate() {
            let AttentionWeights::Heads { learned, .. } = &mut layer.attn else {
                unreachable!("a per-head model");
            };
            for (t, (_, tensor)) in learned.iter_mut().enumerate() {
                let values = (0..4).map(|h| 0.3 * (h + l + t) as f32 - 0.5).collect();
                *tensor = Tensor::from_f32(&[4], values).unwrap();
            }
        }
        let tokens: Vec<u32> = (0..13).map(|i| (i * 5 + 2) % 37).collect();
        let want = model.forward(&tokens).unwrap();
        let on_device = DeviceModel::new(&model, Arc::new(SimDevice::new())).unwrap();
        let close = |got: &[f32], what: &str| {
            let err = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
                .fold(0.0f32, f32::max);
            assert!(err < 1e-4, "{what}: max relative difference {err}");
        };
        close(&on_device.forward(&tokens).unwrap(), "forward");
        let mut session = on_device.session(tokens.len()).unwrap();
        let mut steps = session.step(&tokens[..6]).unwrap();
        for t in 6..tokens.len() {
            steps.extend(session.step(&tokens[t..t + 1]).unwrap());
        }
        close(&steps, "cached steps");
        drop(session);
        drop(on_device);
        // A sink of +inf would make rows NaN on the CPU: the device refuses it up front.
        let AttentionWeights::Heads { learned, .. } = &mut model.layers[1].attn else {
            unreachable!("a per-head model");
        };
        let sinks = learned.iter_mut().find(|(n, _)| n == "sinks").unwrap();
        sinks.1 = Tensor::from_f32(&[4], vec![0.0, f32::INFINITY, 0.0, 0.0]).unwrap();
        let err = match DeviceModel::new(&model, Arc::new(SimDevice::new())) {
            Ok(_) => panic!("an infinite sink is refused"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("layer 1's sinks"), "{err}");
    }
}
