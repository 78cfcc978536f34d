//! A model's weights under Hugging Face's llama-family tensor names (`model.embed_tokens.weight`,
//! `model.layers.{i}.self_attn.q_proj.weight`, ...): which tensors a config needs, and the
//! model assembled from them. Checkpoints (`hf`) and research models with trained weights
//! (`research`) both load through here.

use super::config::{ExpertNames, ModelConfig, NormKind, Projections, QkNorm, Router, TensorNames};
use super::differential::DifferentialWeights;
use super::sublayers::{LayerMlp, Linear, Matrix, Mlp, MoeMlp, Norm};
use super::{AttentionWeights, Layer, Model};
use crate::error::RuntimeError;
use crate::tensor::{Storage, Tensor};
use std::collections::HashMap;

/// The epsilon of DeepSeek's latent norms (`q_a_layernorm`, `kv_a_layernorm`): transformers
/// builds them with the RMSNorm default, not `rms_norm_eps`.
const LATENT_NORM_EPS: f64 = 1e-6;

/// The tensors a model of `config` is made of (DeepSeek's queries factored where the config
/// has a `q_lora_rank`). LayerNorm models with norm biases also have a `.bias` beside
/// each norm's `.weight`; GELU MLPs have no `gate_proj`.
pub(crate) fn tensor_names(config: &ModelConfig) -> Vec<String> {
    let norm = |name: &str| {
        let mut names = vec![format!("{name}.weight")];
        if config.norm == NormKind::Layer && config.norm_bias {
            names.push(format!("{name}.bias"));
        }
        names
    };
    let mut names = vec!["model.embed_tokens.weight".to_string()];
    names.extend(norm("model.norm"));
    if config.embed_norm {
        names.extend(norm("model.embed_norm"));
    }
    if !config.tie_embeddings {
        names.push("lm_head.weight".into());
    }
    for i in 0..config.layers {
        let spec = config.layer_attention(i);
        let mla = spec.mla().is_some();
        let p = format!("model.layers.{i}.");
        for name in config.placement.norm_names().into_iter().flatten() {
            names.extend(norm(&format!("{p}{name}")));
        }
        // An MLP's projections, `.weight` and (with MLP biases) `.bias` each; a gate only
        // where the MLP kind has one.
        let mut mlp_names = |[gate, up, down]: [String; 3]| {
            let gated = config.mlp.gated();
            for prefix in [gated.then_some(gate), Some(up), Some(down)]
                .into_iter()
                .flatten()
            {
                names.push(format!("{prefix}.weight"));
                if config.mlp_bias {
                    names.push(format!("{prefix}.bias"));
                }
            }
        };
        match config.moe.as_ref().filter(|m| m.sparse[i]) {
            Some(moe) if moe.names == ExpertNames::GptOss => {
                let (router, _) = moe.tensor_prefixes(i);
                names.extend([format!("{router}.weight"), format!("{router}.bias")]);
                for n in ["gate_up_proj", "down_proj"] {
                    let t = format!("{p}mlp.experts.{n}");
                    names.extend([t.clone(), format!("{t}_bias")]);
                }
            }
            Some(moe) => {
                let (router, experts) = moe.tensor_prefixes(i);
                experts.into_iter().for_each(&mut mlp_names);
                if let Some((shared, gate)) = moe.shared_prefixes(i) {
                    mlp_names(shared);
                    names.extend(gate.map(|g| format!("{g}.weight")));
                }
                names.push(format!("{router}.weight"));
                if let Router::SigmoidGroups { .. } = moe.router {
                    names.push(format!("{router}.e_score_correction_bias"));
                }
            }
            None if config.projections == Projections::Fused => {
                let bias = config.mlp_bias;
                for n in ["mlp.gate_up_proj", "mlp.down_proj"] {
                    names.push(format!("{p}{n}.weight"));
                    if bias {
                        names.push(format!("{p}{n}.bias"));
                    }
                }
            }
            None => mlp_names(config.mlp_names.prefixes(i)),
        }
        let attn: &[&str] = match (mla, config.q_lora_rank.is_some(), config.qkv_bias) {
            (false, _, false) if config.projections != Projections::Separate => {
                &["self_attn.qkv_proj.weight"]
            }
            (false, _, true) if config.projections != Projections::Separate => {
                &["self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"]
            }
            (true, false, _) => &[
                "self_attn.q_proj.weight",
                "self_attn.kv_a_proj_with_mqa.weight",
                "self_attn.kv_a_layernorm.weight",
                "self_attn.kv_b_proj.weight",
            ],
            (true, true, _) => &[
                "self_attn.q_a_proj.weight",
                "self_attn.q_a_layernorm.weight",
                "self_attn.q_b_proj.weight",
                "self_attn.kv_a_proj_with_mqa.weight",
                "self_attn.kv_a_layernorm.weight",
                "self_attn.kv_b_proj.weight",
            ],
            (false, _, false) => &[
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
            ],
            (false, _, true) => &[
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.q_proj.bias",
                "self_attn.k_proj.bias",
                "self_attn.v_proj.bias",
            ],
        };
        let mut extra = vec!["self_attn.o_proj.weight"];
        if config.o_bias {
            extra.push("self_attn.o_proj.bias");
        }
        if config.qk_norm.is_some() {
            extra.extend(["self_attn.q_norm.weight", "self_attn.k_norm.weight"]);
        }
        let all = attn.iter().chain(&extra);
        names.extend(all.map(|n| format!("{p}{n}")));
        let learned = spec
            .learnable_tensors()
            .into_iter()
            .chain(spec.lambda_tensors());
        names.extend(learned.map(|(n, _)| format!("{p}self_attn.{n}")));
        if spec.differential.is_some() {
            names.push(format!("{p}self_attn.subln.weight"));
        }
    }
    // In the checkpoint's own naming scheme.
    names
        .into_iter()
        .map(|n| config.tensor_names.of(&n))
        .collect()
}

/// The model of `config` made of the tensors in `w` ([`tensor_names`]), each checked against
/// the shape the config gives it; `shapes_from` names where the config came from, for errors.
pub(crate) fn assemble(
    config: ModelConfig,
    w: HashMap<String, Tensor>,
    shapes_from: &str,
) -> Result<Model, RuntimeError> {
    let mut w = Store {
        tensors: w,
        shapes_from,
        names: config.tensor_names,
        norm: config.norm,
        norm_bias: config.norm_bias,
        unit_offset: config.norm_unit_offset,
    };
    let eps = config.norm_eps;
    let d = config.hidden;
    let mut layers = Vec::with_capacity(config.layers);
    for i in 0..config.layers {
        let attn = w.attention(&config, i)?;
        let mlp = w.layer_mlp(&config, i)?;
        let p = format!("model.layers.{i}.");
        let [attn_norm, post_attn_norm, mlp_norm, post_mlp_norm] = config
            .placement
            .norm_names()
            .map(|name| name.map(|n| w.norm(&format!("{p}{n}"), eps, d)).transpose());
        layers.push(Layer {
            attn_norm: attn_norm?,
            attn,
            post_attn_norm: post_attn_norm?,
            mlp_norm: mlp_norm?,
            mlp,
            post_mlp_norm: post_mlp_norm?,
        });
    }
    let embed = w.matrix("model.embed_tokens.weight", [config.vocab, d])?;
    let lm_head = if config.tie_embeddings {
        None
    } else {
        Some(w.linear("lm_head", false, [config.vocab, d])?)
    };
    let final_norm = w.norm("model.norm", eps, d)?;
    let embed_norm = match config.embed_norm {
        true => Some(w.norm("model.embed_norm", eps, d)?),
        false => None,
    };
    let embed = Matrix::new(config.vocab, d, embed.into_storage());
    let mut model = Model::new(config, embed, layers, final_norm, lm_head)?;
    model.embed_norm = embed_norm;
    Ok(model)
}

/// Tensors read from a file, taken as the model is assembled.
struct Store<'a> {
    tensors: HashMap<String, Tensor>,
    shapes_from: &'a str,
    /// The checkpoint's naming scheme: tensors are asked for by their llama names.
    names: TensorNames,
    norm: NormKind,
    /// LayerNorms have biases.
    norm_bias: bool,
    /// Norm weights are offsets from 1 ([`ModelConfig::norm_unit_offset`]).
    unit_offset: bool,
}

impl Store<'_> {
    /// The tensor this crate calls `name` (its checkpoint name in errors).
    fn take(&mut self, name: &str) -> Result<Tensor, RuntimeError> {
        let name = self.names.of(name);
        self.tensors
            .remove(&name)
            .ok_or_else(|| RuntimeError::Data(format!("tensor `{name}` is missing")))
    }

    /// The tensor `name`, which must have `shape`.
    fn shaped(&mut self, name: &str, shape: &[usize]) -> Result<Tensor, RuntimeError> {
        let t = self.take(name)?;
        let name = self.names.of(name);
        if t.shape() != shape {
            return Err(RuntimeError::Shape {
                tensor: name.to_string(),
                found: t.shape().to_vec(),
                expected: format!("{shape:?} (from {})", self.shapes_from),
            });
        }
        Ok(t)
    }

    /// The matrix `name`, which must be `[rows, columns]`.
    fn matrix(&mut self, name: &str, [rows, columns]: [usize; 2]) -> Result<Tensor, RuntimeError> {
        self.shaped(name, &[rows, columns])
    }

    /// `{prefix}.weight` (`[out, in]`) and `{prefix}.bias` (`[out]`) as a linear map.
    fn linear(
        &mut self,
        prefix: &str,
        with_bias: bool,
        [out, inp]: [usize; 2],
    ) -> Result<Linear, RuntimeError> {
        let w = self.matrix(&format!("{prefix}.weight"), [out, inp])?;
        let bias = if with_bias {
            Some(self.shaped(&format!("{prefix}.bias"), &[out])?.to_f32_vec())
        } else {
            None
        };
        Ok(Linear {
            // Kept in the checkpoint's dtype.
            w: Matrix::new(out, inp, w.into_storage()),
            bias,
        })
    }

    /// `{prefix}.weight` (and `.bias`) holding several linear maps' rows, `total` rows over
    /// `cols` inputs in all: map `j` made of the row ranges `maps[j]`, in order.
    fn fused(
        &mut self,
        prefix: &str,
        with_bias: bool,
        total: usize,
        cols: usize,
        maps: &[Vec<std::ops::Range<usize>>],
    ) -> Result<Vec<Linear>, RuntimeError> {
        let w = self.matrix(&format!("{prefix}.weight"), [total, cols])?;
        let bias = match with_bias {
            true => Some(
                self.shaped(&format!("{prefix}.bias"), &[total])?
                    .to_f32_vec(),
            ),
            false => None,
        };
        let storage = w.into_storage();
        Ok(maps
            .iter()
            .map(|rows| {
                let n = rows.iter().map(|r| r.len()).sum();
                let values: Vec<_> = rows.iter().map(|r| r.start * cols..r.end * cols).collect();
                Linear {
                    w: Matrix::new(n, cols, storage.gather(&values)),
                    bias: bias
                        .as_ref()
                        .map(|b| rows.iter().flat_map(|r| &b[r.clone()]).copied().collect()),
                }
            })
            .collect())
    }

    /// Layer `i`'s attention weights (per head, or MLA with the config's query rank).
    fn attention(
        &mut self,
        config: &ModelConfig,
        i: usize,
    ) -> Result<AttentionWeights, RuntimeError> {
        let w = self;
        let (d, eps) = (config.hidden, config.norm_eps);
        let spec = config.layer_attention(i);
        let heads = spec.heads as usize;
        let (dk, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let p = format!("model.layers.{i}.self_attn.");
        Ok(match spec.mla() {
            Some(m) => {
                let (r, dr) = (m.latent_rank as usize, m.rope_dim as usize);
                let q_out = heads * (dk + dr);
                let (q, q_b) = match config.q_lora_rank {
                    Some(qr) => {
                        let q_a = w.linear(&format!("{p}q_a_proj"), false, [qr, d])?;
                        let q_a_norm =
                            w.rms_norm(&format!("{p}q_a_layernorm"), LATENT_NORM_EPS, qr)?;
                        let q_b = w.linear(&format!("{p}q_b_proj"), false, [q_out, qr])?;
                        (q_a, Some((q_a_norm, q_b)))
                    }
                    None => (w.linear(&format!("{p}q_proj"), false, [q_out, d])?, None),
                };
                AttentionWeights::Mla {
                    q,
                    q_b,
                    kv_a: w.linear(&format!("{p}kv_a_proj_with_mqa"), false, [r + dr, d])?,
                    kv_norm: w.rms_norm(&format!("{p}kv_a_layernorm"), LATENT_NORM_EPS, r)?,
                    w_kv_b: {
                        let t =
                            w.matrix(&format!("{p}kv_b_proj.weight"), [heads * (dk + dv), r])?;
                        let shape = t.shape().to_vec();
                        Tensor::from_f32_as(spec.dtype, &shape, t.to_f32_vec())?
                    },
                    o: w.linear(&format!("{p}o_proj"), false, [d, heads * dv])?,
                }
            }
            None => {
                let hkv = spec.kv_heads() as usize;
                let (hv, ho) = (spec.value_heads() as usize, spec.output_heads() as usize);
                let bias = config.qkv_bias;
                let qkv = format!("{p}qkv_proj");
                let (q_rows, kv_rows) = (heads * dk, hkv * dk);
                let [q, k, v] = match config.projections {
                    Projections::Fused => {
                        let kv_end = q_rows + kv_rows;
                        let maps =
                            [0..q_rows, q_rows..kv_end, kv_end..kv_end + hkv * dv].map(|r| vec![r]);
                        w.fused(&qkv, bias, kv_end + hkv * dv, d, &maps)?
                    }
                    // Rows go head by head: q, k and v of each (heads == kv heads).
                    Projections::FusedPerHead => {
                        let per_head = 2 * dk + dv;
                        let of = |first: usize, n: usize| -> Vec<_> {
                            (0..heads)
                                .map(|h| h * per_head + first..h * per_head + first + n)
                                .collect()
                        };
                        let maps = [of(0, dk), of(dk, dk), of(2 * dk, dv)];
                        w.fused(&qkv, bias, heads * per_head, d, &maps)?
                    }
                    Projections::Separate => vec![
                        w.linear(&format!("{p}q_proj"), bias, [q_rows, d])?,
                        w.linear(&format!("{p}k_proj"), bias, [kv_rows, d])?,
                        w.linear(&format!("{p}v_proj"), bias, [hv * dv, d])?,
                    ],
                }
                .try_into()
                .map_err(|_| RuntimeError::Data("internal: three projections".into()))?;
                AttentionWeights::Heads {
                    q,
                    k,
                    v,
                    o: w.linear(&format!("{p}o_proj"), config.o_bias, [d, ho * dv])?,
                    differential: match spec.differential {
                        Some(diff) => {
                            let mut vectors = Vec::with_capacity(4);
                            for (name, shape) in spec.lambda_tensors() {
                                vectors.push(w.shaped(&format!("{p}{name}"), &shape)?.to_f32_vec());
                            }
                            let subln = w.qk_norm(&format!("{p}subln"), eps, dv)?;
                            let [a, b, c, e] = [0, 1, 2, 3].map(|j| vectors[j].as_slice());
                            Some(DifferentialWeights::new(
                                [a, b, c, e],
                                diff.lambda_init,
                                subln,
                            )?)
                        }
                        None => None,
                    },
                    qk_norm: match config.qk_norm {
                        Some(QkNorm::PerHead) => Some([
                            w.qk_norm(&format!("{p}q_norm"), eps, dk)?,
                            w.qk_norm(&format!("{p}k_norm"), eps, dk)?,
                        ]),
                        Some(QkNorm::Whole) => Some([
                            w.qk_norm(&format!("{p}q_norm"), eps, heads * dk)?,
                            w.qk_norm(&format!("{p}k_norm"), eps, hkv * dk)?,
                        ]),
                        Some(QkNorm::PerHeadLayer) => Some([
                            w.head_norms(&format!("{p}q_norm"), eps, [heads, dk])?,
                            w.head_norms(&format!("{p}k_norm"), eps, [hkv, dk])?,
                        ]),
                        None => None,
                    },
                    learned: spec
                        .learnable_tensors()
                        .into_iter()
                        .map(|(name, shape)| {
                            let t = w.shaped(&format!("{p}{name}"), &shape)?;
                            Ok((name, Tensor::from_f32(&shape, t.to_f32_vec())?))
                        })
                        .collect::<Result<_, RuntimeError>>()?,
                }
            }
        })
    }

    /// Layer `i`'s MLP: dense (separate or fused projections) or a mixture of experts.
    fn layer_mlp(&mut self, config: &ModelConfig, i: usize) -> Result<LayerMlp, RuntimeError> {
        let w = self;
        let (d, inter) = (config.hidden, config.intermediate);
        let p = format!("model.layers.{i}.");
        Ok(match config.moe.as_ref().filter(|m| m.sparse[i]) {
            Some(moe) => {
                let (router, experts) = moe.tensor_prefixes(i);
                let gpt_oss = moe.names == ExpertNames::GptOss;
                LayerMlp::Moe(Box::new(MoeMlp {
                    router: w.linear(&router, gpt_oss, [moe.experts, d])?,
                    experts: match gpt_oss {
                        true => w.stacked_experts(config, &p, moe, d)?,
                        false => experts
                            .iter()
                            .map(|[gate, up, down]| {
                                w.mlp(config, [gate, up, down], d, moe.intermediate)
                            })
                            .collect::<Result<_, _>>()?,
                    },
                    top_k: moe.top_k,
                    normalize: moe.normalize,
                    router_kind: moe.router,
                    correction: match moe.router {
                        Router::SigmoidGroups { .. } => w
                            .shaped(&format!("{router}.e_score_correction_bias"), &[moe.experts])?
                            .to_f32_vec(),
                        _ => Vec::new(),
                    },
                    scale: moe.scale as f32,
                    shared: match (moe.shared_prefixes(i), moe.shared) {
                        (Some(([g, u, dn], gate)), Some(shared)) => Some((
                            w.mlp(config, [&g, &u, &dn], d, shared.width)?,
                            gate.map(|gate| w.linear(&gate, false, [1, d]))
                                .transpose()?,
                        )),
                        _ => None,
                    },
                }))
            }
            None if config.projections == Projections::Fused => {
                let bias = config.mlp_bias;
                let maps = [0..inter, inter..2 * inter].map(|r| vec![r]);
                let [gate, up]: [Linear; 2] = w
                    .fused(&format!("{p}mlp.gate_up_proj"), bias, 2 * inter, d, &maps)?
                    .try_into()
                    .map_err(|_| RuntimeError::Data("internal: two projections".into()))?;
                LayerMlp::Dense(Box::new(Mlp {
                    kind: config.mlp,
                    gate: Some(gate),
                    up,
                    down: w.linear(&format!("{p}mlp.down_proj"), bias, [d, inter])?,
                }))
            }
            None => {
                let [gate, up, down] = config.mlp_names.prefixes(i);
                LayerMlp::Dense(Box::new(w.mlp(config, [&gate, &up, &down], d, inter)?))
            }
        })
    }

    /// gpt-oss's experts of layer `{p}` (`model.layers.{i}.`), stored in three-dimensional
    /// tensors ([`ExpertNames::GptOss`]), as one MLP each: gate and up from the interleaved
    /// columns of `gate_up_proj` (`x W` form, so transposed here), down from `down_proj`, with
    /// their biases.
    fn stacked_experts(
        &mut self,
        config: &ModelConfig,
        p: &str,
        moe: &super::config::Moe,
        d: usize,
    ) -> Result<Vec<Mlp>, RuntimeError> {
        let (e, w) = (moe.experts, moe.intermediate);
        let at = |n: &str| format!("{p}mlp.experts.{n}");
        // Weights stay in their stored dtype (bf16 for MXFP4 checkpoints), rearranged.
        let gate_up = self
            .shaped(&at("gate_up_proj"), &[e, d, 2 * w])?
            .contiguous_storage();
        let gate_up_bias = self
            .shaped(&at("gate_up_proj_bias"), &[e, 2 * w])?
            .to_f32_vec();
        let down = self
            .shaped(&at("down_proj"), &[e, w, d])?
            .contiguous_storage();
        let down_bias = self.shaped(&at("down_proj_bias"), &[e, d])?.to_f32_vec();
        let linear = |values: Storage, rows: usize, cols: usize, bias: Vec<f32>| Linear {
            w: Matrix::new(rows, cols, values),
            bias: Some(bias),
        };
        let mut experts = Vec::with_capacity(e);
        for j in 0..e {
            let (gu, gu_bias) = (j * d * 2 * w, &gate_up_bias[j * 2 * w..(j + 1) * 2 * w]);
            // Output r of the gate is column 2r of gate_up; of up, column 2r + 1.
            let half = |first: usize| -> (Storage, Vec<f32>) {
                let values = gate_up
                    .pick((0..w).flat_map(|r| (0..d).map(move |c| gu + c * 2 * w + 2 * r + first)));
                let bias = (0..w).map(|r| gu_bias[2 * r + first]).collect();
                (values, bias)
            };
            let (gate, gate_bias) = half(0);
            let (up, up_bias) = half(1);
            let dn = j * w * d;
            let down_t = down.pick((0..d).flat_map(|r| (0..w).map(move |c| dn + c * d + r)));
            experts.push(Mlp {
                kind: config.mlp,
                gate: Some(linear(gate, w, d, gate_bias)),
                up: linear(up, w, d, up_bias),
                down: linear(down_t, d, w, down_bias[j * d..(j + 1) * d].to_vec()),
            });
        }
        Ok(experts)
    }

    /// An MLP of the config's kind from the projections named `[gate, up, down]` (the gate only
    /// where the kind has one, biases where the config has them), `width` wide over rows of
    /// `d`.
    fn mlp(
        &mut self,
        config: &ModelConfig,
        [gate, up, down]: [&str; 3],
        d: usize,
        width: usize,
    ) -> Result<Mlp, RuntimeError> {
        let bias = config.mlp_bias;
        Ok(Mlp {
            kind: config.mlp,
            gate: match config.mlp {
                kind if !kind.gated() => None,
                _ => Some(self.linear(gate, bias, [width, d])?),
            },
            up: self.linear(up, bias, [width, d])?,
            down: self.linear(down, bias, [d, width])?,
        })
    }

    /// The model's norm `{prefix}` over `len` values: `.weight`, and `.bias` for LayerNorm.
    fn norm(&mut self, prefix: &str, eps: f64, len: usize) -> Result<Norm, RuntimeError> {
        let bias = match self.norm {
            NormKind::Layer if self.norm_bias => {
                Some(self.shaped(&format!("{prefix}.bias"), &[len])?.to_f32_vec())
            }
            NormKind::Layer | NormKind::Rms => None,
        };
        Ok(Norm {
            kind: self.norm,
            weight: self.norm_weight(prefix, len)?,
            bias,
            eps,
            groups: 1,
        })
    }

    /// `{prefix}.weight` over `len` values as the norm multiplies by it: plus 1 where the
    /// model stores offsets from 1.
    fn norm_weight(&mut self, prefix: &str, len: usize) -> Result<Vec<f32>, RuntimeError> {
        let mut w = self
            .shaped(&format!("{prefix}.weight"), &[len])?
            .to_f32_vec();
        if self.unit_offset {
            w.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(w)
    }

    /// The RMSNorm `{prefix}.weight` over `len` values (DeepSeek's latent norms, which are
    /// plain weights).
    fn rms_norm(&mut self, prefix: &str, eps: f64, len: usize) -> Result<Norm, RuntimeError> {
        Ok(Norm {
            kind: NormKind::Rms,
            weight: self
                .shaped(&format!("{prefix}.weight"), &[len])?
                .to_f32_vec(),
            bias: None,
            eps,
            groups: 1,
        })
    }

    /// Cohere's q/k norms `{prefix}.weight`, `[heads, dim]`: a LayerNorm without bias over each
    /// head's `dim` values, with the head's own weights.
    fn head_norms(
        &mut self,
        prefix: &str,
        eps: f64,
        [heads, dim]: [usize; 2],
    ) -> Result<Norm, RuntimeError> {
        Ok(Norm {
            kind: NormKind::Layer,
            weight: self
                .shaped(&format!("{prefix}.weight"), &[heads, dim])?
                .to_f32_vec(),
            bias: None,
            eps,
            groups: heads,
        })
    }

    /// The q/k RMSNorm `{prefix}.weight` over `len` values, stored as the model's norms are.
    fn qk_norm(&mut self, prefix: &str, eps: f64, len: usize) -> Result<Norm, RuntimeError> {
        Ok(Norm {
            kind: NormKind::Rms,
            weight: self.norm_weight(prefix, len)?,
            bias: None,
            eps,
            groups: 1,
        })
    }
}
