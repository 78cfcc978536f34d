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
use crate::host::rope_table::RopeTables;
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

/// `bytes` bytes of `b` from byte `offset` on.
fn sub(b: DeviceBuffer, offset: usize, bytes: usize) -> DeviceBuffer {
    DeviceBuffer {
        addr: b.addr + offset as i64,
        bytes,
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

    /// Layer `i`'s mixture of experts over `n` rows `h` (see [`DeviceMoe`]): the shared
    /// expert's rows (gated), then each routed expert's weighted rows added in expert order,
    /// as `MoeMlp::apply` computes on the host.
    fn moe(
        &self,
        s: &mut Scratch,
        i: usize,
        moe: &DeviceMoe,
        h: DeviceBuffer,
        n: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let LayerMlp::Moe(host) = &self.model.layers[i].mlp else {
            return Err(RuntimeError::Spec(format!(
                "layer {i} has experts on the device but not in the model"
            )));
        };
        let d = self.model.config.hidden;
        let logits = self.linear(s, &moe.router, h, n)?;
        let routed = host.route(&f32s(&self.device.download(logits)?));
        let out = match &moe.shared {
            Some((expert, gate)) => {
                let y = self.dense(s, expert, h, n)?;
                match gate {
                    Some(gate) => {
                        let g = self.linear(s, gate, h, n)?;
                        let rows: Vec<(usize, f32)> = f32s(&self.device.download(g)?)
                            .into_iter()
                            .map(|g| 1.0 / (1.0 + (-g).exp()))
                            .enumerate()
                            .collect();
                        let out = s.zeros(4 * n * d)?;
                        self.scatter(s, out, y, &rows, d)?;
                        out
                    }
                    None => y,
                }
            }
            None => s.zeros(4 * n * d)?,
        };
        for (expert, rows) in moe.experts.iter().zip(&routed) {
            if rows.is_empty() {
                continue;
            }
            let index = s.upload(&i32_bytes(rows.iter().map(|&(r, _)| r)))?;
            let gathered = s.f32s(rows.len() * d)?;
            self.launch(
                &self.kernels.gather,
                blocks(rows.len() * d)?,
                &layers::GatherArgs {
                    x: h.addr,
                    index: index.addr,
                    out: gathered.addr,
                    rows: rows.len() as i64,
                    width: d as i64,
                },
            )?;
            let y = self.dense(s, expert, gathered, rows.len())?;
            self.scatter(s, out, y, rows, d)?;
        }
        Ok(out)
    }

    /// `out[row] += weight * x[r]` for the `r`-th `(row, weight)` of `rows` (rows of `width`).
    fn scatter(
        &self,
        s: &mut Scratch,
        out: DeviceBuffer,
        x: DeviceBuffer,
        rows: &[(usize, f32)],
        width: usize,
    ) -> Result<(), RuntimeError> {
        let index = s.upload(&i32_bytes(rows.iter().map(|&(r, _)| r)))?;
        let weights: Vec<f32> = rows.iter().map(|&(_, w)| w).collect();
        self.launch(
            &self.kernels.scatter,
            blocks(rows.len() * width)?,
            &layers::ScatterArgs {
                out: out.addr,
                x: x.addr,
                index: index.addr,
                weights: s.upload(&f32_bytes(&weights))?.addr,
                rows: rows.len() as i64,
                width: width as i64,
            },
        )
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

    /// `out[j, i, out_first..] = x[i, j, in_first..]` for `width` columns of `[a, b, in_width]`
    /// rows into `[b, a, out_width]` rows (`a = 1`: rows in order).
    fn columns(
        &self,
        out: DeviceBuffer,
        x: DeviceBuffer,
        [a, b]: [usize; 2],
        [in_width, in_first]: [usize; 2],
        [out_width, out_first]: [usize; 2],
        width: usize,
    ) -> Result<(), RuntimeError> {
        self.launch(
            &self.kernels.columns,
            blocks(a * b * width)?,
            &layers::ColumnsArgs {
                x: x.addr,
                out: out.addr,
                a: a as i64,
                b: b as i64,
                in_width: in_width as i64,
                in_first: in_first as i64,
                out_width: out_width as i64,
                out_first: out_first as i64,
                width: width as i64,
            },
        )
    }

    /// MLA's rows of `n` normed tokens `h`: the queries `[n, heads, d + dr]`, the keys `[c_kv |
    /// k_pe]` `[n, r + dr]` (the latent normed) and the latent `c_kv` `[n, r]` (the values).
    fn mla_rows(
        &self,
        s: &mut Scratch,
        m: &DeviceMla,
        x: MlaDims,
        h: DeviceBuffer,
        n: usize,
    ) -> Result<[DeviceBuffer; 3], RuntimeError> {
        let MlaDims { r, dr, .. } = x;
        let qs = self.linear(s, &m.q, h, n)?;
        let qs = match &m.q_b {
            Some((norm, q_b)) => {
                let normed = self.norm(s, norm, qs, n * m.q.w.rows)?;
                self.linear(s, q_b, normed, n)?
            }
            None => qs,
        };
        let kv = self.linear(s, &m.kv_a, h, n)?;
        let c_kv = s.f32s(n * r)?;
        self.columns(c_kv, kv, [1, n], [r + dr, 0], [r, 0], r)?;
        let c_kv = self.norm(s, &m.kv_norm, c_kv, n * r)?;
        let k = s.f32s(n * (r + dr))?;
        self.columns(k, c_kv, [1, n], [r, 0], [r + dr, 0], r)?;
        self.columns(k, kv, [1, n], [r + dr, r], [r + dr, r], dr)?;
        Ok([qs, k, c_kv])
    }

    /// MLA's absorbed queries `[W_uk^T q_nope | q_pe]` of `n` tokens from their query rows
    /// `qs` (`[n, heads, d + dr]`): `[heads, n, r + dr]` when `head_major`, else `[n, heads,
    /// r + dr]`.
    fn mla_queries(
        &self,
        s: &mut Scratch,
        m: &DeviceMla,
        x: MlaDims,
        qs: DeviceBuffer,
        n: usize,
        head_major: bool,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let MlaDims {
            heads, d, r, dr, ..
        } = x;
        let q_nope = s.f32s(heads * n * d)?;
        self.columns(q_nope, qs, [n, heads], [d + dr, 0], [d, 0], d)?;
        let q_lat = s.f32s(heads * n * r)?;
        self.per_head_gemm(q_nope, m.w_uk_t, [r, d], q_lat, [heads, n])?;
        let q = s.f32s(heads * n * (r + dr))?;
        let w = r + dr;
        if head_major {
            self.columns(q, q_lat, [1, heads * n], [r, 0], [w, 0], r)?;
            self.columns(q, qs, [n, heads], [d + dr, d], [w, r], dr)?;
        } else {
            self.columns(q, q_lat, [heads, n], [r, 0], [w, 0], r)?;
            self.columns(q, qs, [1, n * heads], [d + dr, d], [w, r], dr)?;
        }
        Ok(q)
    }

    /// MLA's outputs `[n, heads * dv]` from the latent outputs `[heads, n, r]`: `W_uv` per head.
    fn mla_outputs(
        &self,
        s: &mut Scratch,
        m: &DeviceMla,
        x: MlaDims,
        latent: DeviceBuffer,
        n: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let MlaDims { heads, dv, r, .. } = x;
        let out = s.f32s(heads * n * dv)?;
        self.per_head_gemm(latent, m.w_uv, [dv, r], out, [heads, n])?;
        self.swap(s, &self.kernels.from_heads, out, [heads, n, dv], 4)
    }

    /// `y[h] = x[h] W[h]^T` for each head `h`: `x` `[heads, n, cols]`, `w` `[heads, rows, cols]`
    /// f32, `y` `[heads, n, rows]`.
    fn per_head_gemm(
        &self,
        x: DeviceBuffer,
        w: DeviceBuffer,
        [rows, cols]: [usize; 2],
        y: DeviceBuffer,
        [heads, n]: [usize; 2],
    ) -> Result<(), RuntimeError> {
        for head in 0..heads {
            let w_h = DeviceMatrix {
                buffer: sub(w, 4 * head * rows * cols, 4 * rows * cols),
                dtype: DType::F32,
                rows,
                cols,
            };
            let x_h = sub(x, 4 * head * n * cols, 4 * n * cols);
            self.gemm(x_h, &w_h, sub(y, 4 * head * n * rows, 4 * n * rows), n)?;
        }
        Ok(())
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

/// A layer's KV cache on the device: keys and values head-major, `[kv_heads, capacity, dim]`,
/// in the spec's dtype, keys rotated as they were appended. MLA's values are the latent part
/// of its key rows, not stored again (`v` is `None`).
struct DeviceCache {
    k: DeviceBuffer,
    v: Option<DeviceBuffer>,
}

impl DeviceCache {
    fn free(self, device: &dyn Device) {
        device.free(self.k);
        if let Some(v) = self.v {
            device.free(v);
        }
    }
}

/// One attention kind's kernels of incremental steps.
struct KindStep {
    append_k: Arc<Kernel>,
    append_v: Arc<Kernel>,
    decode: Arc<Kernel>,
}

/// Kernels of incremental steps.
struct StepKernels {
    kinds: Vec<KindStep>,
    merge: Arc<Kernel>,
    argmax: Arc<Kernel>,
}

/// One sequence decoded step by step against caches resident on the device. Each step uploads
/// its token ids and the launch tables (task and segment records, RoPE rows, the merge map) and
/// brings back only the logits, or only the chosen token.
pub struct DeviceSession<'s, 'm> {
    model: &'s DeviceModel<'m>,
    caches: Vec<DeviceCache>,
    capacity: usize,
    len: usize,
    kernels: StepKernels,
}

impl Drop for DeviceSession<'_, '_> {
    fn drop(&mut self) {
        for c in self.caches.drain(..) {
            c.free(self.model.device.as_ref());
        }
    }
}

impl<'m> DeviceModel<'m> {
    /// A session for one sequence of at most `capacity` tokens, its caches on the device.
    pub fn session(&self, capacity: usize) -> Result<DeviceSession<'_, 'm>, RuntimeError> {
        let kernel = |k: Kernel| verified(k).map(Arc::new);
        let mut kinds = Vec::new();
        for variant in self.model.variants() {
            let layout = variant.cache_layout();
            let half = half_of(layout.dtype);
            if half.is_some() && !(layout.k_dim.is_multiple_of(2) && layout.v_dim.is_multiple_of(2))
            {
                return Err(RuntimeError::Spec(
                    "16-bit device caches need even head dims".into(),
                ));
            }
            let rope = layout.rope.as_ref().map(|r| layers::AppendRope {
                dim: r.rope.dim,
                first_dim: r.first_dim,
                layout: r.rope.layout,
            });
            kinds.push(KindStep {
                append_k: kernel(layers::cache_append(width_u32(layout.k_dim)?, half, rope))?,
                append_v: kernel(layers::cache_append(width_u32(layout.v_dim)?, half, None))?,
                decode: crate::gpu::lowered_decode(variant)?,
            });
        }
        let kernels = StepKernels {
            kinds,
            merge: kernel(layers::merge_partitions())?,
            argmax: kernel(layers::argmax(width_u32(self.model.config.vocab)?))?,
        };
        // Every kernel is ready before any cache is allocated: a failure below frees what was.
        let mut caches: Vec<DeviceCache> = Vec::with_capacity(self.layers.len());
        let free = |caches: &mut Vec<DeviceCache>| {
            for c in caches.drain(..) {
                c.free(self.device.as_ref());
            }
        };
        for layer in &self.layers {
            let layout = self.model.variants()[layer.kind].cache_layout();
            let size = layout.dtype.size_bytes() as usize;
            let bytes = |dim: usize| {
                layout
                    .kv_heads
                    .checked_mul(capacity)
                    .and_then(|v| v.checked_mul(dim))
                    .and_then(|v| v.checked_mul(size))
                    .ok_or_else(|| {
                        RuntimeError::Data(format!("a cache of {capacity} tokens overflows"))
                    })
            };
            let k = match bytes(layout.k_dim).and_then(|b| self.device.zeros(b)) {
                Ok(k) => k,
                Err(e) => {
                    free(&mut caches);
                    return Err(e);
                }
            };
            let v = match layout.values_in_keys {
                true => Ok(None),
                false => bytes(layout.v_dim)
                    .and_then(|b| self.device.zeros(b))
                    .map(Some),
            };
            let v = match v {
                Ok(v) => v,
                Err(e) => {
                    self.device.free(k);
                    free(&mut caches);
                    return Err(e);
                }
            };
            caches.push(DeviceCache { k, v });
        }
        Ok(DeviceSession {
            model: self,
            caches,
            capacity,
            len: 0,
            kernels,
        })
    }
}

impl DeviceSession<'_, '_> {
    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets the tokens past the first `len` (a rejected draft, say); later steps write over
    /// their slots.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Appends `tokens` and returns their logits `[tokens, vocab]`.
    pub fn step(&mut self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        let mut s = Scratch::new(self.model.device.as_ref());
        let logits = self.run(&mut s, tokens)?;
        Ok(f32s(&self.model.device.download(logits)?))
    }

    /// Appends `tokens` and returns the logits of the last one (`[vocab]`: the only row
    /// brought back).
    pub fn step_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        let m = self.model;
        let mut s = Scratch::new(m.device.as_ref());
        let logits = self.run(&mut s, tokens)?;
        let vocab = m.model.config.vocab;
        let last = DeviceBuffer {
            addr: logits.addr + (4 * vocab * (tokens.len() - 1)) as i64,
            bytes: 4 * vocab,
        };
        Ok(f32s(&m.device.download(last)?))
    }

    /// Appends `tokens` and returns the greedy next token, chosen on the device: only its id
    /// comes back.
    pub fn step_greedy(&mut self, tokens: &[u32]) -> Result<u32, RuntimeError> {
        let m = self.model;
        let mut s = Scratch::new(m.device.as_ref());
        let logits = self.run(&mut s, tokens)?;
        let vocab = m.model.config.vocab;
        let last = DeviceBuffer {
            addr: logits.addr + (4 * vocab * (tokens.len() - 1)) as i64,
            bytes: 4 * vocab,
        };
        let out = s.zeros(4)?;
        m.launch(
            &self.kernels.argmax,
            [1, 1, 1],
            &layers::ArgmaxArgs {
                x: last.addr,
                out: out.addr,
            },
        )?;
        let id = m.device.download(out)?;
        Ok(u32::from_le_bytes([id[0], id[1], id[2], id[3]]))
    }

    /// The forward pass of `tokens` at positions `len..`, appending their keys and values;
    /// the logits buffer.
    fn run(&mut self, s: &mut Scratch, tokens: &[u32]) -> Result<DeviceBuffer, RuntimeError> {
        let n = tokens.len();
        if n == 0 {
            return Err(RuntimeError::Data("a step needs at least one token".into()));
        }
        if self.len + n > self.capacity {
            return Err(RuntimeError::Cache(format!(
                "the session holds {} tokens: {} more do not fit",
                self.capacity, n
            )));
        }
        self.model.check_sim_cost(n, self.len + n)?;
        let session = &*self;
        let tables = (0..self.kernels.kinds.len())
            .map(|kind| session.tables(s, n, kind))
            .collect::<Result<Vec<_>, _>>()?;
        let logits = self.model.run_layers(s, tokens, |s, i, layer, h| {
            let t = &tables[layer.kind];
            session.attention(s, t, layer, &session.caches[i], h, n)
        })?;
        self.len += n;
        Ok(logits)
    }

    /// The launch tables of a step of `n` new tokens, the same for every layer of attention
    /// kind `kind`: work items of
    /// the plan's row blocks, their segments of the cache (as offsets into a layer's cache)
    /// classified by the plan, partitions, the query-row gather and the merge map, and the
    /// RoPE rows of the new positions; all uploaded once per step.
    fn tables(&self, s: &mut Scratch, n: usize, kind: usize) -> Result<StepTables, RuntimeError> {
        use crate::host::work::{Item, segment_codes};
        use attn_dsl::modifier::interval::Interval;
        use codegen::gpu::kernels::decode::{SEGMENT_FIELDS, TASK_FIELDS, segment_keys, task_rows};
        use codegen::plan::{CallShape, TileCode};
        let variant = &self.model.model.variants()[kind];
        let (spec, layout, plan) = (
            variant.spec(),
            variant.cache_layout(),
            variant.decode_plan(),
        );
        let (heads, kv_heads) = (spec.heads as usize, layout.kv_heads);
        // MLA's values are the latent part of its key rows: a value row starts where its key
        // row does, a key row apart.
        let (dim, v_stride) = crate::host::work::row_strides(layout);
        let size = layout.dtype.size_bytes() as usize;
        let group = heads / kv_heads;
        let (pos0, total) = (self.len, self.len + n);
        let (max_rows, seg_keys) = (task_rows(plan) as usize, segment_keys(plan) as usize);
        let nq_max = n.min(max_rows);
        let nh_max = (max_rows / nq_max).clamp(1, group);
        let mut items = Vec::new();
        for g in 0..kv_heads {
            for h0 in (g * group..(g + 1) * group).step_by(nh_max) {
                let nh = nh_max.min((g + 1) * group - h0);
                for i0 in (0..n).step_by(nq_max) {
                    let nq = nq_max.min(n - i0);
                    let call = CallShape {
                        sq: n as i64,
                        skv: total as i64,
                        p0: 0,
                        batch: Interval::point(0),
                        head: Interval::new(h0 as i64, (h0 + nh - 1) as i64),
                    };
                    let rows = Interval::new(i0 as i64, (i0 + nq - 1) as i64);
                    let mut segments = Vec::new();
                    let codes = segment_codes(plan, rows, call, 0, total, seg_keys);
                    for (first, code) in (0..total).step_by(seg_keys).zip(codes) {
                        let count = seg_keys.min(total - first);
                        if code != TileCode::Skip {
                            let row = (g * self.capacity + first) as i64;
                            segments.push(SegmentAt {
                                k: row * (dim * size) as i64,
                                v: row * (v_stride * size) as i64,
                                first: first as i64,
                                len: count as i64,
                                code: code as i64,
                            });
                        }
                    }
                    items.push((
                        Item {
                            b: 0,
                            len: total,
                            n,
                            h0,
                            nh,
                            i0,
                            nq,
                            segments: Vec::new(),
                        },
                        segments,
                    ));
                }
            }
        }
        // Partitions: enough CTAs to fill the device, at least four segments each.
        let most = items.iter().map(|(_, s)| s.len()).max().unwrap_or(1);
        let parts = crate::host::work::GPU_TASKS
            .div_ceil(items.len().max(1))
            .min(most.div_ceil(4))
            .max(1);
        let mut t = StepTables::default();
        let mut index = Vec::new();
        let mut parts_of: Vec<Vec<i32>> = vec![Vec::new(); n * heads];
        for (item, segs) in &items {
            let per = segs.len().div_ceil(parts).max(1);
            for p in 0..parts.min(segs.len().max(1)) {
                let range = (p * per).min(segs.len())..((p + 1) * per).min(segs.len());
                let row0 = index.len();
                // Query rows head-major: (head, query) takes row query * heads + head of q, and
                // its partial output row feeds output row (query, head).
                for head in item.h0..item.h0 + item.nh {
                    for q_i in item.i0..item.i0 + item.nq {
                        parts_of[q_i * heads + head].push(index.len() as i32);
                        index.push((q_i * heads + head) as i32);
                    }
                }
                t.task_records.extend([
                    row0 as i64,
                    (item.nh * item.nq) as i64,
                    item.nq as i64,
                    (item.len - item.n + item.i0) as i64,
                    item.i0 as i64,
                    0,
                    item.h0 as i64,
                    (t.segments.len() / SEGMENT_FIELDS) as i64,
                    range.len() as i64,
                ]);
                for g in &segs[range] {
                    t.segments.extend([
                        g.k,
                        g.v,
                        g.first,
                        g.len,
                        g.code,
                        dim as i64,
                        v_stride as i64,
                    ]);
                }
            }
        }
        debug_assert_eq!(t.task_records.len() % TASK_FIELDS, 0);
        t.tasks = t.task_records.len() / TASK_FIELDS;
        t.rows = index.len();
        t.slots = parts_of.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let map: Vec<i32> = parts_of
            .iter()
            .flat_map(|p| p.iter().copied().chain(std::iter::repeat(-1)).take(t.slots))
            .collect();
        let i32_bytes = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        t.index = s.upload(&i32_bytes(&index))?.addr;
        t.map = s.upload(&i32_bytes(&map))?.addr;
        t.tasks_buffer = s.upload(&i64_bytes(&t.task_records))?.addr;
        if !t.segments.is_empty() {
            t.segments_buffer = s.upload(&i64_bytes(&t.segments))?.addr;
        }
        // Keys are rotated for their positions as they are appended, and the queries of the
        // same positions by the decode kernel: one table serves both. Frequencies that depend
        // on the length (dynamic NTK, LongRoPE) are those of the sequence's length after the
        // step, as transformers rotates each step; earlier keys keep their rotation.
        if let Some(r) = &layout.rope {
            let rope = RopeTables::new(r, pos0 as i64, total as i64, total as u64);
            t.rope_cos = s.upload(&f32_bytes(&rope.cos))?.addr;
            t.rope_sin = s.upload(&f32_bytes(&rope.sin))?.addr;
        }
        t.pos0 = pos0;
        Ok(t)
    }

    /// Appends the new tokens' keys and values to the layer's cache, then attends over the
    /// cache with the decode kernel on the step's tables and merges partitions on the device.
    /// MLA appends `[c_kv | k_pe]` rows, attends with absorbed queries and expands the latent
    /// outputs by `W_uv`.
    fn attention(
        &self,
        s: &mut Scratch,
        t: &StepTables,
        layer: &DeviceLayer,
        cache: &DeviceCache,
        h: DeviceBuffer,
        n: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let m = self.model;
        let spec = m.model.variants()[layer.kind].spec();
        match &layer.attn {
            DeviceAttention::Heads(a) => {
                let [q, k, v] = m.qkv(s, a, h, n)?;
                self.append(t, layer.kind, true, [k, cache.k], n)?;
                if let Some(v_cache) = cache.v {
                    self.append(t, layer.kind, false, [v, v_cache], n)?;
                }
                let (rows, rows_lse) =
                    self.decode(s, t, layer.kind, cache, q, n, a.learned.params)?;
                let (heads, v_dim) = (spec.heads as usize, spec.v_head_dim as usize);
                // Rows token-major: row `i * heads + h` is head `h`'s.
                m.sinks(&a.learned, rows, rows_lse, [n * heads, v_dim], 1, heads)?;
                m.linear(s, &a.o, rows, n)
            }
            DeviceAttention::Mla(mla) => {
                let x = MlaDims::of(spec)?;
                let [qs, k, _] = m.mla_rows(s, mla, x, h, n)?;
                self.append(t, layer.kind, true, [k, cache.k], n)?;
                let q = m.mla_queries(s, mla, x, qs, n, false)?;
                let (rows, _) = self.decode(s, t, layer.kind, cache, q, n, 0)?;
                // Token-major latent rows to head-major for the per-head `W_uv`.
                let latent = m.swap(s, &m.kernels.from_heads, rows, [n, x.heads, x.r], 4)?;
                let rows = m.mla_outputs(s, mla, x, latent, n)?;
                m.linear(s, &mla.o, rows, n)
            }
        }
    }

    /// Appends `n` rows (`[n, kv_heads, width]` f32) to a layer's key cache (`keys`: rotated
    /// for their positions) or value cache.
    fn append(
        &self,
        t: &StepTables,
        kind: usize,
        keys: bool,
        [rows, cache]: [DeviceBuffer; 2],
        n: usize,
    ) -> Result<(), RuntimeError> {
        let layout = self.model.model.variants()[kind].cache_layout();
        let kernels = &self.kernels.kinds[kind];
        let (kernel, width) = match keys {
            true => (&kernels.append_k, layout.k_dim),
            false => (&kernels.append_v, layout.v_dim),
        };
        let per = if half_of(layout.dtype).is_some() {
            2
        } else {
            1
        };
        self.model.launch(
            kernel,
            blocks(n * layout.kv_heads * width / per)?,
            &layers::AppendArgs {
                rows: rows.addr,
                cache: cache.addr,
                tokens: n as i64,
                kv_heads: layout.kv_heads as i64,
                capacity: self.capacity as i64,
                pos0: t.pos0 as i64,
                rope_cos: t.rope_cos,
                rope_sin: t.rope_sin,
            },
        )
    }

    /// The decode kernel over a layer's cache for `n` new tokens' queries `q` (`[n, heads,
    /// k_dim]` f32), partitions merged: the output rows `[n, heads, v_dim]` and their
    /// log-sum-exps.
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &self,
        s: &mut Scratch,
        t: &StepTables,
        kind: usize,
        cache: &DeviceCache,
        q: DeviceBuffer,
        n: usize,
        params: i64,
    ) -> Result<(DeviceBuffer, DeviceBuffer), RuntimeError> {
        use codegen::gpu::launch::DecodeArgs;
        let m = self.model;
        let variant = &m.model.variants()[kind];
        let layout = variant.cache_layout();
        let heads = variant.spec().heads as usize;
        let (dim, v_dim) = (layout.k_dim, layout.v_dim);
        let q_rows = s.f32s(t.rows * dim)?;
        m.launch(
            &m.kernels.gather,
            blocks(t.rows * dim)?,
            &layers::GatherArgs {
                x: q.addr,
                index: t.index,
                out: q_rows.addr,
                rows: t.rows as i64,
                width: dim as i64,
            },
        )?;
        let (out, lse) = (s.f32s(t.rows * v_dim)?, s.f32s(t.rows)?);
        let ctas = u32::try_from(t.tasks)
            .map_err(|_| RuntimeError::Data("more tasks than a grid holds".into()))?;
        m.launch(
            &self.kernels.kinds[kind].decode,
            [ctas, 1, 1],
            &DecodeArgs {
                q_rows: q_rows.addr,
                tasks: t.tasks_buffer,
                // The step's records hold offsets from a layer's cache.
                segments: t.segments_buffer,
                out: out.addr,
                lse: lse.addr,
                rope_cos: t.rope_cos,
                rope_sin: t.rope_sin,
                rope_pos0: t.pos0 as i64,
                k_base: cache.k.addr,
                // MLA's values lie in its key rows.
                v_base: cache.v.unwrap_or(cache.k).addr,
                params,
            },
        )?;
        let (rows, rows_lse) = (s.f32s(n * heads * v_dim)?, s.f32s(n * heads)?);
        m.launch(
            &self.kernels.merge,
            blocks(n * heads * v_dim)?,
            &layers::MergeArgs {
                parts: out.addr,
                lse: lse.addr,
                map: t.map,
                out: rows.addr,
                out_lse: rows_lse.addr,
                rows: (n * heads) as i64,
                slots: t.slots as i64,
                width: v_dim as i64,
            },
        )?;
        Ok((rows, rows_lse))
    }
}

/// A segment of a layer's cache: byte offsets of its first key and value rows from the
/// cache's start, and its keys.
#[derive(Clone, Copy, Debug)]
struct SegmentAt {
    k: i64,
    v: i64,
    first: i64,
    len: i64,
    code: i64,
}

/// What a step launches with, the same for every layer (see `DeviceSession::tables`).
#[derive(Debug, Default)]
struct StepTables {
    /// Tasks (CTAs of the decode kernel), their records and buffer.
    tasks: usize,
    task_records: Vec<i64>,
    tasks_buffer: i64,
    /// Every task's segment records, in task order, as offsets from a layer's cache (the
    /// launch adds the cache's start), and their buffer (0 when there are none).
    segments: Vec<i64>,
    segments_buffer: i64,
    /// Query rows gathered for the tasks, and the gather's index buffer.
    rows: usize,
    index: i64,
    /// The merge map (`slots` partial rows per output row) buffer.
    slots: usize,
    map: i64,
    /// RoPE rows of the new positions (0 without RoPE), from position `pos0`.
    rope_cos: i64,
    rope_sin: i64,
    pos0: usize,
}

fn i64_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Row indices as the gather and scatter kernels read them (i32; rows of a call fit).
fn i32_bytes(rows: impl Iterator<Item = usize>) -> Vec<u8> {
    rows.flat_map(|r| (r as i32).to_le_bytes()).collect()
}

impl DeviceModel<'_> {
    /// Generation for one request, resident on the device: the prompt's prefill and every step
    /// against device caches. Greedy tokens are chosen by the argmax kernel (only the id comes
    /// back); sampled ones from the last row of logits, the only row brought back. `progress` is
    /// called after every step, as `Model::generate` calls it.
    pub fn generate(
        &self,
        request: &super::Request,
        sampling: super::Sampling,
        mut progress: impl FnMut(super::Progress),
    ) -> Result<Vec<u32>, RuntimeError> {
        use std::time::{Duration, Instant};
        if request.prompt.is_empty() {
            return Err(RuntimeError::Data("the request has an empty prompt".into()));
        }
        if request.max_new_tokens == 0 {
            return Ok(Vec::new());
        }
        let capacity = request
            .prompt
            .len()
            .checked_add(request.max_new_tokens)
            .ok_or_else(|| RuntimeError::Data("the prompt and new tokens overflow".into()))?;
        let mut session = self.session(capacity)?;
        let mut rng = super::generate::Rng::new(sampling.seed);
        let ops = crate::ops::CpuLayers;
        let mut next_after = |session: &mut DeviceSession, tokens: &[u32]| {
            if sampling.temperature <= 0.0 {
                session.step_greedy(tokens)
            } else {
                let last = session.step_last(tokens)?;
                super::generate::choose(&ops, &last, &sampling, &mut rng)
            }
        };
        let start = Instant::now();
        let mut next = next_after(&mut session, &request.prompt)?;
        let prefill = start.elapsed();
        let decode_start = Instant::now();
        let mut out = Vec::with_capacity(request.max_new_tokens);
        loop {
            out.push(next);
            let done = request.stop.contains(&next) || out.len() == request.max_new_tokens;
            progress(super::Progress {
                generated: out.len(),
                running: usize::from(!done),
                decoding: if out.len() > 1 {
                    decode_start.elapsed()
                } else {
                    Duration::ZERO
                },
                prefill,
                new_tokens: vec![(0, next)],
            });
            if done {
                return Ok(out);
            }
            next = next_after(&mut session, &[next])?;
        }
    }
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
