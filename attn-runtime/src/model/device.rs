//! A model resident on a [`Device`]: weights uploaded once in their checkpoint's dtype, every
//! activation kept in device memory from the embedding lookup to the logits, projections as
//! device GEMMs and everything else as generated GPU IR kernels (norms, activations, residual
//! adds, relayouts, attention). Only the token ids go up and the logits come back.
//!
//! So far: whole-sequence forward passes (logits) for per-head attention. Incremental decoding
//! against device-resident caches, device sampling and MLA are not built yet.

use super::config::NormKind;
use super::layers::{LayerMlp, Linear, Matrix, Norm};
use super::{AttentionWeights, Model};
use crate::device::{Device, DeviceBuffer, Scratch, f32_bytes, f32s};
use crate::error::RuntimeError;
use crate::gpu::{ForwardTables, resident_forward};
use crate::host::rope_table::RopeTables;
use crate::tensor::Storage;
use attn_dsl::DType;
use codegen::gpu::ir::{Half, Kernel};
use codegen::gpu::kernels::layers::{
    self, Activation, BiasArgs, ElementwiseArgs, EmbedArgs, NormArgs, SwapArgs, THREADS,
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
        if let Some(what) = model.config.not_resident() {
            return Err(RuntimeError::Spec(format!(
                "models with {what} do not run resident on a device yet; use the cpu or gpu-sim \
                 backend"
            )));
        }
        let variant = model.layer_variant(0);
        // bf16 specs whose RoPE rotates every column take bf16 Q K^T operands here (f16 ones
        // would need a range check on the device first), as bf16 SDPA computes.
        let forward = resident_forward(variant)?;
        let mut up = Uploader {
            device: device.as_ref(),
            owned: Vec::new(),
        };
        let mut layers_on_device = Vec::with_capacity(model.layers.len());
        for layer in &model.layers {
            let AttentionWeights::Heads { q, k, v, o, .. } = &layer.attn else {
                return Err(RuntimeError::Spec("MLA layers in a per-head model".into()));
            };
            let (Some(attn_norm), Some(mlp_norm), LayerMlp::Dense(mlp)) =
                (&layer.attn_norm, &layer.mlp_norm, &layer.mlp)
            else {
                return Err(RuntimeError::Spec(
                    "a pre-norm dense model without its norms or MLP".into(),
                ));
            };
            layers_on_device.push(DeviceLayer {
                attn_norm: up.norm(attn_norm)?,
                q: up.linear(q)?,
                k: up.linear(k)?,
                v: up.linear(v)?,
                o: up.linear(o)?,
                mlp_norm: up.norm(mlp_norm)?,
                gate: mlp.gate.as_ref().map(|g| up.linear(g)).transpose()?,
                up: up.linear(&mlp.up)?,
                down: up.linear(&mlp.down)?,
            });
        }
        let embed = up.matrix(&model.embed)?;
        let final_norm = up.norm(&model.final_norm)?;
        let lm_head = model.lm_head.as_ref().map(|l| up.linear(l)).transpose()?;
        let activation = match model.config.mlp {
            super::MlpKind::SwiGlu => Activation::SwiGlu,
            super::MlpKind::Gelu => Activation::Gelu,
            super::MlpKind::GeluExact => {
                return Err(RuntimeError::Spec(
                    "the exact (erf) GELU does not run resident on a device yet".into(),
                ));
            }
            super::MlpKind::GeGlu => Activation::GeGlu,
            super::MlpKind::ClampedSwiGlu { alpha, limit } => Activation::ClampedSwiGlu {
                alpha: alpha.to_bits(),
                limit: limit.to_bits(),
            },
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

    /// On the interpreter, refuses a pass of `tokens` new tokens against `keys` keys that would
    /// take it longer than [`sim_cost::MAX_SECONDS`](crate::gpu::sim_cost::MAX_SECONDS).
    fn check_sim_cost(&self, tokens: usize, keys: usize) -> Result<(), RuntimeError> {
        if self.device.name() != "gpu-sim" {
            return Ok(());
        }
        let c = &self.model.config;
        let seconds = crate::gpu::sim_cost::layers_seconds(
            c.layer_attention(0),
            c.layers as u64,
            c.hidden as u64,
            c.intermediate as u64,
            tokens as u64,
            keys as u64,
        );
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
        for (i, layer) in self.layers.iter().enumerate() {
            let h = self.norm(s, &layer.attn_norm, x, rows)?;
            let a = attention(s, i, layer, h)?;
            self.add(x, a, n * d)?;
            let h = self.norm(s, &layer.mlp_norm, x, rows)?;
            let up = self.linear(s, &layer.up, h, n)?;
            let gate = match &layer.gate {
                Some(g) => self.linear(s, g, h, n)?,
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
            let m = self.linear(s, &layer.down, up, n)?;
            self.add(x, m, n * d)?;
        }
        let h = self.norm(s, &self.final_norm, x, rows)?;
        match &self.lm_head {
            Some(head) => self.linear(s, head, h, n),
            None => {
                let y = s.f32s(n * self.embed.rows)?;
                self.gemm(h, &self.embed, y, n)?;
                Ok(y)
            }
        }
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
        let spec = self.model.layer_variant(0).spec();
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
        let plan = self.model.layer_variant(0).forward_plan();
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
            // Resident models refuse specs with parameters.
            params: 0,
        };
        self.launch(&self.forward.kernel, t.grid, &record)?;
        let rows = self.swap(s, &self.kernels.from_heads, out, [heads, n, v_dim], 4)?;
        self.linear(s, &layer.o, rows, n)
    }
}

/// A layer's KV cache on the device: keys and values head-major, `[kv_heads, capacity, dim]`,
/// in the spec's dtype, keys rotated as they were appended.
struct DeviceCache {
    k: DeviceBuffer,
    v: DeviceBuffer,
}

/// Kernels of incremental steps.
struct StepKernels {
    append_k: Arc<Kernel>,
    append_v: Arc<Kernel>,
    gather: Arc<Kernel>,
    decode: Arc<Kernel>,
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
            self.model.device.free(c.k);
            self.model.device.free(c.v);
        }
    }
}

impl<'m> DeviceModel<'m> {
    /// A session for one sequence of at most `capacity` tokens, its caches on the device.
    pub fn session(&self, capacity: usize) -> Result<DeviceSession<'_, 'm>, RuntimeError> {
        let variant = self.model.layer_variant(0);
        let layout = variant.cache_layout();
        if variant
            .decode_plan()
            .rope
            .as_ref()
            .is_some_and(|r| matches!(r.frequencies, codegen::plan::Frequencies::PerLaunch))
        {
            return Err(RuntimeError::Spec(
                "the GPU decode kernel does not run dynamic NTK scaling yet".into(),
            ));
        }
        let half = half_of(layout.dtype);
        if half.is_some() && !(layout.k_dim.is_multiple_of(2) && layout.v_dim.is_multiple_of(2)) {
            return Err(RuntimeError::Spec(
                "16-bit device caches need even head dims".into(),
            ));
        }
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
        let mut caches = Vec::with_capacity(self.layers.len());
        for _ in &self.layers {
            let k = self.device.zeros(bytes(layout.k_dim)?)?;
            let v = match self.device.zeros(bytes(layout.v_dim)?) {
                Ok(v) => v,
                Err(e) => {
                    self.device.free(k);
                    return Err(e);
                }
            };
            caches.push(DeviceCache { k, v });
        }
        let rope = layout.rope.as_ref().map(|r| layers::AppendRope {
            dim: r.rope.dim,
            first_dim: r.first_dim,
            layout: r.rope.layout,
        });
        let kernel = |k: Kernel| verified(k).map(Arc::new);
        let kernels = StepKernels {
            append_k: kernel(layers::cache_append(width_u32(layout.k_dim)?, half, rope))?,
            append_v: kernel(layers::cache_append(width_u32(layout.v_dim)?, half, None))?,
            gather: kernel(layers::gather_rows())?,
            decode: crate::gpu::lowered_decode(variant)?,
            merge: kernel(layers::merge_partitions())?,
            argmax: kernel(layers::argmax(width_u32(self.model.config.vocab)?))?,
        };
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
        let tables = session.tables(s, n)?;
        let logits = self.model.run_layers(s, tokens, |s, i, layer, h| {
            session.attention(s, &tables, layer, &session.caches[i], h, n)
        })?;
        self.len += n;
        Ok(logits)
    }

    /// The launch tables of a step of `n` new tokens, the same for every layer: work items of
    /// the plan's row blocks, their segments of the cache (as offsets into a layer's cache)
    /// classified by the plan, partitions, the query-row gather and the merge map, and the
    /// RoPE rows of the new positions; all uploaded once per step.
    fn tables(&self, s: &mut Scratch, n: usize) -> Result<StepTables, RuntimeError> {
        use crate::host::work::{Item, segment_codes};
        use attn_dsl::modifier::interval::Interval;
        use codegen::gpu::kernels::decode::{SEGMENT_FIELDS, TASK_FIELDS, segment_keys, task_rows};
        use codegen::plan::{CallShape, TileCode};
        let variant = self.model.model.layer_variant(0);
        let (spec, layout, plan) = (
            variant.spec(),
            variant.cache_layout(),
            variant.decode_plan(),
        );
        let (heads, kv_heads) = (spec.heads as usize, layout.kv_heads);
        let (dim, v_dim) = (layout.k_dim, layout.v_dim);
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
                                v: row * (v_dim * size) as i64,
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
                    t.segments
                        .extend([g.k, g.v, g.first, g.len, g.code, dim as i64, v_dim as i64]);
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
        // same positions by the decode kernel: one table serves both.
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
    fn attention(
        &self,
        s: &mut Scratch,
        t: &StepTables,
        layer: &DeviceLayer,
        cache: &DeviceCache,
        h: DeviceBuffer,
        n: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        use codegen::gpu::launch::DecodeArgs;
        let m = self.model;
        let layout = m.model.layer_variant(0).cache_layout();
        let heads = m.model.layer_variant(0).spec().heads as usize;
        let (kv_heads, dim, v_dim) = (layout.kv_heads, layout.k_dim, layout.v_dim);
        let (q, k, v) = (
            m.linear(s, &layer.q, h, n)?,
            m.linear(s, &layer.k, h, n)?,
            m.linear(s, &layer.v, h, n)?,
        );
        let per = if half_of(layout.dtype).is_some() {
            2
        } else {
            1
        };
        for (kernel, rows, buffer, width) in [
            (&self.kernels.append_k, k, cache.k, dim),
            (&self.kernels.append_v, v, cache.v, v_dim),
        ] {
            m.launch(
                kernel,
                blocks(n * kv_heads * width / per)?,
                &layers::AppendArgs {
                    rows: rows.addr,
                    cache: buffer.addr,
                    tokens: n as i64,
                    kv_heads: kv_heads as i64,
                    capacity: self.capacity as i64,
                    pos0: t.pos0 as i64,
                    rope_cos: t.rope_cos,
                    rope_sin: t.rope_sin,
                },
            )?;
        }
        let q_rows = s.f32s(t.rows * dim)?;
        m.launch(
            &self.kernels.gather,
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
            &self.kernels.decode,
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
                v_base: cache.v.addr,
                params: 0,
            },
        )?;
        let rows = s.f32s(n * heads * v_dim)?;
        m.launch(
            &self.kernels.merge,
            blocks(n * heads * v_dim)?,
            &layers::MergeArgs {
                parts: out.addr,
                lse: lse.addr,
                map: t.map,
                out: rows.addr,
                out_lse: s.f32s(n * heads)?.addr,
                rows: (n * heads) as i64,
                slots: t.slots as i64,
                width: v_dim as i64,
            },
        )?;
        m.linear(s, &layer.o, rows, n)
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
