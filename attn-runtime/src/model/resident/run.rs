//! A resident model's layers run on its device: the decoder's operations (norms, projections as
//! device GEMMs, attention, MLPs, residual adds) as launches of its kernels, in the steps
//! [`Decoder`] takes.

use super::{
    DeviceAttention, DeviceHeads, DeviceLayer, DeviceLayerMlp, DeviceLearned, DeviceLinear,
    DeviceMatrix, DeviceMlp, DeviceNorm, MlaDims, ResidentModel, blocks,
};
use crate::device::{DeviceBuffer, Scratch, f32_bytes};
use crate::error::RuntimeError;
use crate::gpu::ForwardTables;
use crate::model::decoder::{Decoder, DecoderOps, Multiplier, NormAt};
use codegen::gpu::ir::Kernel;
use codegen::gpu::kernels::layers::{
    BiasArgs, ElementwiseArgs, EmbedArgs, NormArgs, SinkArgs, SwapArgs,
};
use codegen::gpu::launch::{ForwardArgs, LaunchRecord};
use std::sync::Arc;

/// A layer's attention as [`ResidentModel::run_layers`] takes it: `(scratch, layer index, layer,
/// normed rows)` to the attention's output rows.
pub(super) type LayerAttention<'a> = dyn FnMut(&mut Scratch, usize, &DeviceLayer, DeviceBuffer) -> Result<DeviceBuffer, RuntimeError>
    + 'a;

/// The resident model's decoder operations: launches of its kernels on its device.
struct ResidentDecoder<'r, 'm, 's, 'a> {
    model: &'r ResidentModel<'m>,
    scratch: &'r mut Scratch<'s>,
    tokens: &'r [u32],
    attention: &'r mut LayerAttention<'a>,
}

impl ResidentDecoder<'_, '_, '_, '_> {
    /// Values in `n` rows of the hidden width.
    fn hidden(&self) -> usize {
        self.tokens.len() * self.model.model.config.hidden
    }
}

impl DecoderOps for ResidentDecoder<'_, '_, '_, '_> {
    type Rows = DeviceBuffer;
    type Error = RuntimeError;

    fn embed(&mut self) -> Result<DeviceBuffer, RuntimeError> {
        let (m, tokens) = (self.model, self.tokens);
        let vocab = m.model.config.vocab;
        if let Some((i, t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, t)| **t as usize >= vocab)
        {
            return Err(RuntimeError::Data(format!(
                "token {i} is {t}, outside the vocabulary of {vocab}"
            )));
        }
        let n = tokens.len();
        let rows = u32::try_from(n)
            .map_err(|_| RuntimeError::Data(format!("{n} tokens are more than a grid holds")))?;
        let ids: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let x = self.scratch.f32s(self.hidden())?;
        let record = EmbedArgs {
            tokens: self.scratch.upload(&ids)?.addr,
            table: m.embed.buffer.addr,
            out: x.addr,
        };
        m.launch(&m.kernels.embed, [rows, 1, 1], &record)?;
        Ok(x)
    }

    fn norm(&mut self, at: NormAt, x: &DeviceBuffer) -> Result<DeviceBuffer, RuntimeError> {
        let m = self.model;
        let norm = match at {
            NormAt::Embedding => m.embed_norm.as_ref(),
            NormAt::Layer(i, at) => m.layers[i].norm(at),
            NormAt::Final => Some(&m.final_norm),
        };
        let norm = norm.ok_or_else(|| {
            RuntimeError::Data(format!(
                "internal: the resident model has no norm at {at:?}"
            ))
        })?;
        m.norm(self.scratch, norm, *x, self.hidden())
    }

    fn attention(&mut self, i: usize, h: &DeviceBuffer) -> Result<DeviceBuffer, RuntimeError> {
        (self.attention)(self.scratch, i, &self.model.layers[i], *h)
    }

    fn mlp(&mut self, i: usize, h: &DeviceBuffer) -> Result<DeviceBuffer, RuntimeError> {
        let m = self.model;
        m.mlp(self.scratch, i, &m.layers[i], *h, self.tokens.len())
    }

    fn add(&mut self, x: DeviceBuffer, y: &DeviceBuffer) -> Result<DeviceBuffer, RuntimeError> {
        self.model.add(x, *y, self.hidden())?;
        Ok(x)
    }

    fn scale(&mut self, x: DeviceBuffer, by: Multiplier) -> Result<DeviceBuffer, RuntimeError> {
        let k = &self.model.kernels;
        let (kernel, count) = match by {
            Multiplier::Embedding => (&k.embed_scale, self.hidden()),
            Multiplier::Residual => (&k.residual_scale, self.hidden()),
            Multiplier::Logits => (&k.logit_scale, self.logits()),
        };
        let kernel = kernel.as_ref().ok_or_else(|| {
            RuntimeError::Data(format!(
                "internal: the resident model has no {by:?} multiplier"
            ))
        })?;
        self.model.pointwise(Some(kernel), x, count)?;
        Ok(x)
    }

    fn head(&mut self, x: &DeviceBuffer) -> Result<DeviceBuffer, RuntimeError> {
        let (m, n) = (self.model, self.tokens.len());
        match &m.lm_head {
            Some(head) => m.linear(self.scratch, head, *x, n),
            None => {
                let y = self.scratch.f32s(n * m.embed.rows)?;
                m.gemm(*x, &m.embed, y, n)?;
                Ok(y)
            }
        }
    }

    fn softcap(&mut self, logits: DeviceBuffer) -> Result<DeviceBuffer, RuntimeError> {
        let kernel = self.model.kernels.softcap.as_ref().ok_or_else(|| {
            RuntimeError::Data("internal: the resident model has no final softcap".into())
        })?;
        self.model.pointwise(Some(kernel), logits, self.logits())?;
        Ok(logits)
    }
}

impl ResidentDecoder<'_, '_, '_, '_> {
    /// Values in the logits of `n` rows.
    fn logits(&self) -> usize {
        self.tokens.len() * self.model.model.config.vocab
    }
}

impl<'m> ResidentModel<'m> {
    /// The decoder over `tokens` ([`Decoder`]'s steps, as every model runs them) with each
    /// layer's attention from `attention(scratch, layer index, layer, normed rows)`: the
    /// logits buffer.
    pub(super) fn run_layers(
        &self,
        scratch: &mut Scratch,
        tokens: &[u32],
        attention: &mut LayerAttention,
    ) -> Result<DeviceBuffer, RuntimeError> {
        Decoder::of(&self.model.config).run(&mut ResidentDecoder {
            model: self,
            scratch,
            tokens,
            attention,
        })
    }

    /// Layer `i`'s MLP over `n` rows `h`.
    pub(super) fn mlp(
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
    pub(super) fn dense(
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

    pub(super) fn launch<R: LaunchRecord>(
        &self,
        kernel: &Arc<Kernel>,
        grid: [u32; 3],
        record: &R,
    ) -> Result<(), RuntimeError> {
        crate::device::launch(self.device.as_ref(), kernel, grid, record, &[])
    }

    pub(super) fn gemm(
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
    pub(super) fn linear(
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
    pub(super) fn norm(
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

    /// A multiplier or softcap in place over `count` values, where the model has it.
    pub(super) fn pointwise(
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

    pub(super) fn add(
        &self,
        x: DeviceBuffer,
        y: DeviceBuffer,
        count: usize,
    ) -> Result<(), RuntimeError> {
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
    pub(super) fn swap(
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
    pub(super) fn qkv(
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
    pub(super) fn sinks(
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
    pub(super) fn attention(
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
    pub(super) fn forward_kernel(
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
        let t = ForwardTables::of(plan, forward, [1, n, n], 0)?;
        let codes: Vec<u8> = t.codes.iter().flat_map(|c| c.to_le_bytes()).collect();
        let table = |s: &mut Scratch, v: &[f32]| -> Result<i64, RuntimeError> {
            Ok(if v.is_empty() {
                0
            } else {
                s.upload(&f32_bytes(v))?.addr
            })
        };
        let (out, lse) = (s.f32s(heads * n * v_dim)?, s.f32s(heads * n)?);
        let (rope_cos, rope_sin) = (table(s, &t.rope.cos)?, table(s, &t.rope.sin)?);
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
            rope_cos,
            rope_sin,
            // A model's layers have no xPos (`ResidentModel::new` refuses it): the keys read
            // the queries' tables.
            rope_key_cos: rope_cos,
            rope_key_sin: rope_sin,
            rope_pos0: t.rope.pos0,
            params,
        };
        self.launch(&forward.kernel, t.grid, &record)?;
        Ok((out, lse))
    }
}
