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
//! Here: the resident weights and kernels and [`ResidentModel::forward`]; the upload in `upload.rs`,
//! the layers' steps in `run.rs`, MLA and experts in `mla.rs` and `experts.rs`, and cached
//! generation in `session.rs`.
//!
//! [`ModelConfig`]: super::ModelConfig

use super::Model;
use super::decoder::LayerNorm;
use crate::device::{Device, DeviceBuffer, Scratch, f32s};
use crate::error::RuntimeError;
use attn_dsl::DType;
use codegen::gpu::ir::{Half, Kernel};
use codegen::gpu::kernels::layers::THREADS;
use std::sync::Arc;

mod experts;
mod mla;
mod run;
mod session;
mod upload;

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

impl DeviceLayer {
    /// Its norm at `at`, if it has one.
    fn norm(&self, at: LayerNorm) -> Option<&DeviceNorm> {
        match at {
            LayerNorm::BeforeAttention => self.attn_norm.as_ref(),
            LayerNorm::AfterAttention => self.post_attn_norm.as_ref(),
            LayerNorm::BeforeMlp => self.mlp_norm.as_ref(),
            LayerNorm::AfterMlp => self.post_mlp_norm.as_ref(),
        }
    }
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
pub struct ResidentModel<'m> {
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

impl Drop for ResidentModel<'_> {
    fn drop(&mut self) {
        for b in self.owned.drain(..) {
            self.device.free(b);
        }
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

impl<'m> ResidentModel<'m> {
    /// Refuses a pass of `tokens` new tokens against `keys` keys that the device would take too
    /// long over ([`Device::check_cost`]: the interpreter's guard).
    fn check_sim_cost(&self, tokens: usize, keys: usize) -> Result<(), RuntimeError> {
        let c = &self.model.config;
        let seconds = || -> f64 {
            (0..c.layers)
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
                .sum()
        };
        let what = format!("a pass of {tokens} tokens through {} layers", c.layers);
        self.device.check_cost(&what, &seconds)
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
        let logits = self.run_layers(&mut s, tokens, &mut |s, _, layer, h| {
            self.attention(s, layer, h, n)
        })?;
        Ok(f32s(&self.device.download(logits)?))
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
    use crate::model::AttentionWeights;
    use crate::model::research::config_from_toml;
    use crate::tensor::Tensor;

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
        let on_device = ResidentModel::new(&model, Arc::new(SimDevice::new())).unwrap();
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
        let err = match ResidentModel::new(&model, Arc::new(SimDevice::new())) {
            Ok(_) => panic!("an infinite sink is refused"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("layer 1's sinks"), "{err}");
    }
}
