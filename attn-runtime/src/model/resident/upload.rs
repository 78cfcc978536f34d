//! A model's weights uploaded to a device once, in their checkpoint's dtype, and the kernels its
//! layers launch built and loaded.

use super::{
    DeviceAttention, DeviceHeads, DeviceKind, DeviceLayer, DeviceLayerMlp, DeviceLearned,
    DeviceLinear, DeviceMatrix, DeviceMla, DeviceMlp, DeviceMoe, DeviceNorm, Kernels, MlaDims,
    ResidentModel, half_of, width_u32,
};
use crate::device::{Device, DeviceBuffer, f32_bytes};
use crate::error::RuntimeError;
use crate::gpu::forward_kernel;
use crate::learned::Learned;
use crate::model::config::NormKind;
use crate::model::sublayers::{LayerMlp, Linear, Matrix, Mlp, Norm};
use crate::model::{AttentionWeights, Model};
use crate::tensor::{Storage, Tensor};
use attn_dsl::DType;
use codegen::gpu::choice::Call;
use codegen::gpu::ir::Kernel;
use codegen::gpu::kernels::layers::{self, Activation, Pointwise};
use codegen::gpu::verified;
use std::sync::Arc;

impl<'m> ResidentModel<'m> {
    /// Uploads `model`'s weights to `device` and prepares its kernels.
    pub fn new(model: &'m Model, device: Arc<dyn Device>) -> Result<Self, RuntimeError> {
        let c = &model.config;
        if c.attention.iter().any(|spec| spec.differential.is_some()) {
            return Err(RuntimeError::Unsupported {
                backend: device.name(),
                what: "differential heads in a resident model (the CPU model runs them)".into(),
            });
        }
        let kernel = |k: Kernel| verified(k).map(Arc::new);
        let kinds = model
            .variants()
            .iter()
            .map(|variant| {
                // bf16 specs whose RoPE rotates every column take bf16 Q K^T operands here
                // (f16 ones would need a range check on the device first), as bf16 SDPA
                // computes.
                refuse_xpos(variant, device.name())?;
                let forward = forward_kernel(variant, Call::ResidentForward)?;
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
            crate::model::MlpKind::SwiGlu => Activation::SwiGlu,
            crate::model::MlpKind::Gelu => Activation::Gelu,
            crate::model::MlpKind::GeluExact => Activation::GeluExact,
            crate::model::MlpKind::GeGlu => Activation::GeGlu,
            crate::model::MlpKind::ClampedSwiGlu { alpha, limit } => Activation::ClampedSwiGlu {
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
        Ok(ResidentModel {
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
            NormKind::Rms => layers::RowNorm::Rms,
            NormKind::Layer => layers::RowNorm::Layer,
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
                // Refused in `ResidentModel::new`.
                differential: _,
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

/// Refuses xPos in a resident model: its cache-append kernel rotates keys by the queries'
/// tables, and xPos scales keys by their inverse (no model family the loader reads uses xPos).
fn refuse_xpos(variant: &crate::Variant, backend: &'static str) -> Result<(), RuntimeError> {
    match variant.spec().rope().and_then(|r| r.xpos) {
        Some(_) => Err(RuntimeError::Unsupported {
            backend,
            what: "xpos in a resident model (the cpu backend and GpuBackend's calls run it)".into(),
        }),
        None => Ok(()),
    }
}
