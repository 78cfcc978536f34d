//! A model resident on a [`Device`]: weights uploaded once in their checkpoint's dtype, every
//! activation kept in device memory from the embedding lookup to the logits, projections as
//! device GEMMs and everything else as generated GPU IR kernels (norms, activations, residual
//! adds, relayouts, attention). Only the token ids go up and the logits come back.
//!
//! So far: whole-sequence forward passes (logits) for per-head attention. Incremental decoding
//! against device-resident caches, device sampling and MLA are not built yet.

use super::config::NormKind;
use super::layers::{Linear, Matrix, Norm};
use super::{AttentionWeights, Model};
use crate::device::{Device, DeviceBuffer, Scratch, f32_bytes, f32s};
use crate::error::RuntimeError;
use crate::gpu::{ForwardTables, lowered_forward};
use crate::tensor::Storage;
use attn_dsl::DType;
use codegen::gpu::forward_tc;
use codegen::gpu::ir::{Half, Kernel};
use codegen::gpu::launch::{ForwardArgs, LaunchRecord, bind};
use codegen::gpu::layers::{
    self, Activation, BiasArgs, ElementwiseArgs, EmbedArgs, NormArgs, SwapArgs, THREADS,
};
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

struct DeviceLayer {
    attn_norm: DeviceNorm,
    q: DeviceLinear,
    k: DeviceLinear,
    v: DeviceLinear,
    o: DeviceLinear,
    mlp_norm: DeviceNorm,
    gate: Option<DeviceLinear>,
    up: DeviceLinear,
    down: DeviceLinear,
}

/// The layer kernels a model uses, lowered and verified once.
struct Kernels {
    embed: Arc<Kernel>,
    activation: Arc<Kernel>,
    add: Arc<Kernel>,
    bias: Arc<Kernel>,
    /// `[tokens, heads, dim]` f32 to the attention kernel's `[heads, tokens, dim]` inputs.
    to_heads: Arc<Kernel>,
    /// The attention output `[heads, tokens, dim]` back to `[tokens, heads, dim]`, f32.
    from_heads: Arc<Kernel>,
}

/// A model whose weights live on a device (see the module's documentation).
pub struct DeviceModel<'m> {
    model: &'m Model,
    device: Arc<dyn Device>,
    embed: DeviceMatrix,
    layers: Vec<DeviceLayer>,
    final_norm: DeviceNorm,
    lm_head: Option<DeviceLinear>,
    kernels: Kernels,
    forward: Arc<codegen::gpu::ForwardKernel>,
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
        let width = n.weight.len();
        let kernel = layers::norm(kind, width_u32(width)?, n.eps as f32, n.bias.is_some());
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
        let variant = model.variant();
        if variant.spec().mla().is_some() {
            return Err(RuntimeError::Spec(
                "MLA models do not run resident on a device yet; use the cpu or gpu-sim backend"
                    .into(),
            ));
        }
        // The tensor-core kernel takes Q K^T in f16 for some bf16 specs, which activations past
        // f16's range would overflow; on the device nothing checks them first, so those specs
        // take the SIMT kernel.
        let plan = variant.forward_plan();
        let simt = forward_tc::supports(plan) && forward_tc::qk_half(plan) == Half::F16;
        let forward = lowered_forward(variant, simt)?;
        let mut up = Uploader {
            device: device.as_ref(),
            owned: Vec::new(),
        };
        let mut layers_on_device = Vec::with_capacity(model.layers.len());
        for layer in &model.layers {
            let AttentionWeights::Heads { q, k, v, o } = &layer.attn else {
                return Err(RuntimeError::Spec("MLA layers in a per-head model".into()));
            };
            layers_on_device.push(DeviceLayer {
                attn_norm: up.norm(&layer.attn_norm)?,
                q: up.linear(q)?,
                k: up.linear(k)?,
                v: up.linear(v)?,
                o: up.linear(o)?,
                mlp_norm: up.norm(&layer.mlp_norm)?,
                gate: layer.mlp.gate.as_ref().map(|g| up.linear(g)).transpose()?,
                up: up.linear(&layer.mlp.up)?,
                down: up.linear(&layer.mlp.down)?,
            });
        }
        let embed = up.matrix(&model.embed)?;
        let final_norm = up.norm(&model.final_norm)?;
        let lm_head = model.lm_head.as_ref().map(|l| up.linear(l)).transpose()?;
        let activation = match model.config.mlp {
            super::MlpKind::SwiGlu => Activation::SwiGlu,
            super::MlpKind::Gelu => Activation::Gelu,
        };
        let kernel = |k: Kernel| verified(k).map(Arc::new);
        let kernels = Kernels {
            embed: kernel(layers::embed(
                width_u32(model.config.hidden)?,
                half_of(embed.dtype),
            ))?,
            activation: kernel(layers::activation(activation))?,
            add: kernel(layers::residual_add())?,
            bias: kernel(layers::bias_add())?,
            to_heads: kernel(layers::swap_outer(half_of(forward.inputs)))?,
            from_heads: kernel(layers::swap_outer(None))?,
        };
        Ok(DeviceModel {
            model,
            owned: up.owned,
            device,
            embed,
            layers: layers_on_device,
            final_norm,
            lm_head,
            kernels,
            forward,
        })
    }

    /// Logits `[tokens, vocab]` of a whole sequence (causal; positions from 0), computed on the
    /// device.
    pub fn forward(&self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        let c = &self.model.config;
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
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
        let device = self.device.as_ref();
        let mut s = Scratch::new(device);
        let d = c.hidden;
        let rows = u32::try_from(n)
            .map_err(|_| RuntimeError::Data(format!("{n} tokens are more than a grid holds")))?;
        let ids: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let x = s.f32s(n * d)?;
        self.launch(
            &self.kernels.embed,
            [rows, 1, 1],
            &EmbedArgs {
                tokens: s.upload(&ids)?.addr,
                table: self.embed.buffer.addr,
                out: x.addr,
            },
        )?;
        for layer in &self.layers {
            let h = self.norm(&mut s, &layer.attn_norm, x, rows)?;
            let a = self.attention(&mut s, layer, h, n)?;
            self.add(x, a, n * d)?;
            let h = self.norm(&mut s, &layer.mlp_norm, x, rows)?;
            let up = self.linear(&mut s, &layer.up, h, n)?;
            let gate = match &layer.gate {
                Some(g) => self.linear(&mut s, g, h, n)?,
                None => up,
            };
            let count = n * layer.up.w.rows;
            self.launch(
                &self.kernels.activation,
                blocks(count)?,
                &ElementwiseArgs {
                    x: up.addr,
                    other: gate.addr,
                    count: count as i64,
                },
            )?;
            let m = self.linear(&mut s, &layer.down, up, n)?;
            self.add(x, m, n * d)?;
        }
        let h = self.norm(&mut s, &self.final_norm, x, rows)?;
        let logits = match &self.lm_head {
            Some(head) => self.linear(&mut s, head, h, n)?,
            None => {
                let y = s.f32s(n * self.embed.rows)?;
                self.gemm(h, &self.embed, y, n)?;
                y
            }
        };
        Ok(f32s(&device.download(logits)?))
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

    fn norm(
        &self,
        s: &mut Scratch,
        norm: &DeviceNorm,
        x: DeviceBuffer,
        rows: u32,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let out = s.f32s(rows as usize * norm.width)?;
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

    /// One layer's attention over `n` normed rows `h`: the projections, the relayout to
    /// heads, the forward kernel, the relayout back and the output projection.
    fn attention(
        &self,
        s: &mut Scratch,
        layer: &DeviceLayer,
        h: DeviceBuffer,
        n: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let spec = self.model.variant().spec();
        let (heads, kv_heads) = (spec.heads as usize, spec.kv_heads() as usize);
        let (dim, v_dim) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let size = self.forward.inputs.size_bytes() as usize;
        let (q, k, v) = (
            self.linear(s, &layer.q, h, n)?,
            self.linear(s, &layer.k, h, n)?,
            self.linear(s, &layer.v, h, n)?,
        );
        let to = &self.kernels.to_heads;
        let q = self.swap(s, to, q, [n, heads, dim], size)?;
        let k = self.swap(s, to, k, [n, kv_heads, dim], size)?;
        let v = self.swap(s, to, v, [n, kv_heads, v_dim], size)?;
        let plan = self.model.variant().forward_plan();
        let t = ForwardTables::of(plan, &self.forward, [1, n, n], 0);
        let codes: Vec<u8> = t.codes.iter().flat_map(|c| c.to_le_bytes()).collect();
        let table = |s: &mut Scratch, v: &[f32]| -> Result<i64, RuntimeError> {
            Ok(if v.is_empty() {
                0
            } else {
                s.upload(&f32_bytes(v))?.addr
            })
        };
        let out = s.f32s(heads * n * v_dim)?;
        let record = ForwardArgs {
            q: q.addr,
            k: k.addr,
            v: v.addr,
            out: out.addr,
            lse: s.f32s(heads * n)?.addr,
            codes: s.upload(&codes)?.addr,
            sq: n as i64,
            skv: n as i64,
            p0: 0,
            rope_cos: table(s, &t.rope_cos)?,
            rope_sin: table(s, &t.rope_sin)?,
            rope_pos0: t.rope_pos0,
        };
        self.launch(&self.forward.kernel, t.grid, &record)?;
        let rows = self.swap(s, &self.kernels.from_heads, out, [heads, n, v_dim], 4)?;
        self.linear(s, &layer.o, rows, n)
    }
}
