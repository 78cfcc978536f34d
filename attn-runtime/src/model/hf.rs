//! Hugging Face checkpoints: `config.json` and `*.safetensors` (one file, or shards listed in
//! `model.safetensors.index.json`; f32, bf16 or f16 weights, computed in f32).
//!
//! Families: `llama` (every RoPE scaling, from `rope_parameters` or the older `rope_theta` /
//! `rope_scaling` keys), `mistral` (sliding window), `qwen2` (q/k/v biases), `deepseek_v2` and
//! `deepseek_v3` (MLA; dense layers only: mixture-of-experts layers are refused).

use super::config::{MAX_WIDTH, MlpKind, ModelConfig, NormKind};
use super::layers::{Linear, Matrix, Mlp, Norm};
use super::{AttentionWeights, Layer, Model};
use crate::error::RuntimeError;
use crate::io::read_safetensors;
use crate::tensor::Tensor;
use attn_dsl::{
    AttentionSpec, CausalAlign, KvLayout, Mask, Mla, Position, Rope, RopeLayout, RopeScaling, Yarn,
};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The epsilon of DeepSeek's latent norms (`q_a_layernorm`, `kv_a_layernorm`): transformers
/// builds them with the RMSNorm default, not `rms_norm_eps`.
const LATENT_NORM_EPS: f64 = 1e-6;

/// Families this loader knows.
pub const FAMILIES: &[&str] = &["llama", "mistral", "qwen2", "deepseek_v2", "deepseek_v3"];

fn bad(path: &Path, message: impl Into<String>) -> RuntimeError {
    RuntimeError::Io {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// A parsed `config.json`, with lookups that name the missing key.
struct Config<'a> {
    path: &'a Path,
    json: Value,
}

impl Config<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    /// A whole number of at most `u32::MAX` (every count and width of a config; larger ones are
    /// refused here, so sums of two cannot overflow).
    fn uint(&self, key: &str) -> Result<usize, RuntimeError> {
        let v = self.get(key).and_then(Value::as_u64).ok_or_else(|| {
            bad(
                self.path,
                format!("`{key}` is missing or not a whole number"),
            )
        })?;
        u32::try_from(v).map(|v| v as usize).map_err(|_| {
            bad(
                self.path,
                format!(
                    "`{key}` = {v} is out of range; allowed: at most {}",
                    u32::MAX
                ),
            )
        })
    }

    fn float_or(&self, key: &str, default: f64) -> f64 {
        self.get(key).and_then(Value::as_f64).unwrap_or(default)
    }

    fn flag(&self, key: &str) -> bool {
        self.get(key).and_then(Value::as_bool).unwrap_or(false)
    }
}

/// YaRN's magnitude scale as transformers defines it: `0.1 m ln(s) + 1` for `s > 1`, else 1.
fn yarn_mscale(s: f64, m: f64) -> f64 {
    if s > 1.0 { 0.1 * m * s.ln() + 1.0 } else { 1.0 }
}

/// The RoPE parameters of a config (`rope_parameters` in transformers 5, `rope_scaling` before).
fn rope_params<'a>(c: &'a Config) -> Option<&'a Value> {
    c.get("rope_parameters").or_else(|| c.get("rope_scaling"))
}

/// DeepSeek-V2/V3's softmax scale: `1/sqrt(qk_dim)`, times `mscale(factor, mscale_all_dim)^2`
/// when the RoPE scaling is not the default one and sets a nonzero `mscale_all_dim`
/// (transformers' DeepseekV3Attention).
fn deepseek_scale(c: &Config, qk_dim: usize) -> f64 {
    let base = 1.0 / (qk_dim as f64).sqrt();
    let params = rope_params(c);
    let field = |k: &str| params.and_then(|p| p.get(k)).filter(|v| !v.is_null());
    let kind = field("rope_type")
        .or_else(|| field("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let all_dim = field("mscale_all_dim")
        .and_then(Value::as_f64)
        .unwrap_or(0.0);
    match field("factor").and_then(Value::as_f64) {
        Some(factor) if kind != "default" && all_dim != 0.0 => {
            let m = yarn_mscale(factor, all_dim);
            base * m * m
        }
        _ => base,
    }
}

/// The RoPE of the checkpoint's attention over the first `dim` dims, from its RoPE keys.
fn rope(c: &Config, dim: usize, layout: RopeLayout) -> Result<Rope, RuntimeError> {
    // transformers 5 nests everything in `rope_parameters`; older files use `rope_theta` and
    // `rope_scaling`.
    let params = rope_params(c);
    let field = |k: &str| params.and_then(|p| p.get(k)).filter(|v| !v.is_null());
    let num = |k: &str| field(k).and_then(Value::as_f64);
    let base = num("rope_theta").unwrap_or_else(|| c.float_or("rope_theta", 10_000.0));
    let kind = field("rope_type")
        .or_else(|| field("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let original = || {
        field("original_max_position_embeddings")
            .and_then(Value::as_u64)
            .or_else(|| c.get("max_position_embeddings").and_then(Value::as_u64))
            .ok_or_else(|| {
                bad(
                    c.path,
                    format!("rope type `{kind}` needs original_max_position_embeddings"),
                )
            })
    };
    let factor =
        || num("factor").ok_or_else(|| bad(c.path, format!("rope type `{kind}` needs a factor")));
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "dynamic" => RopeScaling::Dynamic {
            factor: factor()?,
            original_max_position: original()?,
        },
        "yarn" => {
            let mut yarn = Yarn::new(factor()?, original()?);
            yarn.beta_fast = num("beta_fast").unwrap_or(yarn.beta_fast);
            yarn.beta_slow = num("beta_slow").unwrap_or(yarn.beta_slow);
            // transformers divides the two mscales only when both are set and nonzero; else
            // the attention factor is mscale(factor, 1).
            if let (Some(m), Some(all)) = (num("mscale"), num("mscale_all_dim"))
                && m != 0.0
                && all != 0.0
            {
                (yarn.mscale, yarn.mscale_all_dim) = (Some(m), Some(all));
            }
            RopeScaling::Yarn(yarn)
        }
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: num("low_freq_factor").unwrap_or(1.0),
            high_freq_factor: num("high_freq_factor").unwrap_or(4.0),
            original_max_position: original()?,
        },
        other => {
            return Err(bad(
                c.path,
                format!(
                    "rope type `{other}` is not supported; supported: default, linear, dynamic, \
                     yarn, llama3"
                ),
            ));
        }
    };
    Ok(Rope {
        base,
        dim: dim as u32,
        layout,
        scaling,
    })
}

/// Reads `dir/config.json` into a model config and the spec of its attention.
pub fn config(dir: &Path) -> Result<ModelConfig, RuntimeError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| bad(&path, e.to_string()))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| bad(&path, format!("not valid JSON: {e}")))?;
    let c = Config { path: &path, json };
    let family = c
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(&path, "`model_type` is missing"))?
        .to_string();
    if !FAMILIES.contains(&family.as_str()) {
        return Err(bad(
            &path,
            format!(
                "model family `{family}` is not supported; supported: {}",
                FAMILIES.join(", ")
            ),
        ));
    }
    let hidden = c.uint("hidden_size")?;
    let heads = c.uint("num_attention_heads")?;
    if heads == 0 {
        return Err(bad(
            &path,
            "`num_attention_heads` is 0; allowed: a whole number of at least 1",
        ));
    }
    let layers = c.uint("num_hidden_layers")?;
    let deepseek = family.starts_with("deepseek");
    // The spec is built as data: counts are at most u32::MAX (`Config::uint`).
    let as_u32 = |v: usize| v as u32;
    let attention = if deepseek {
        if let Some(experts) = c.get("n_routed_experts").and_then(Value::as_u64) {
            let dense = c.uint("first_k_dense_replace").unwrap_or(0);
            if experts > 0 && dense < layers {
                return Err(bad(
                    &path,
                    format!(
                        "layers {dense}..{layers} are mixture-of-experts ({experts} routed \
                         experts), which this runtime does not run yet; only dense layers are \
                         supported"
                    ),
                ));
            }
        }
        let (dn, dr, dv, r) = (
            c.uint("qk_nope_head_dim")?,
            c.uint("qk_rope_head_dim")?,
            c.uint("v_head_dim")?,
            c.uint("kv_lora_rank")?,
        );
        // DeepSeek rotates interleaved pairs; its softmax scale is 1/sqrt(nope + rope), times
        // YaRN's mscale(factor, mscale_all_dim)^2 where the config sets mscale_all_dim.
        AttentionSpec {
            kv: KvLayout::Mla(Mla {
                latent_rank: as_u32(r),
                rope_dim: as_u32(dr),
            }),
            v_head_dim: as_u32(dv),
            mask: Mask::Causal(CausalAlign::BottomRight),
            position: Position::Rope(rope(&c, dr, RopeLayout::Interleaved)?),
            scale: Some(deepseek_scale(&c, dn + dr)),
            ..AttentionSpec::new(as_u32(heads), as_u32(dn))
        }
    } else {
        let kv_heads = c
            .get("num_key_value_heads")
            .map_or(Ok(heads), |_| c.uint("num_key_value_heads"))?;
        let head_dim = c
            .get("head_dim")
            .map_or(Ok(hidden / heads), |_| c.uint("head_dim"))?;
        let window = c
            .get("sliding_window")
            .and_then(Value::as_u64)
            .filter(|_| family == "mistral" || (family == "qwen2" && c.flag("use_sliding_window")));
        AttentionSpec {
            kv: KvLayout::Heads {
                kv_heads: as_u32(kv_heads),
            },
            mask: match window {
                Some(window) => Mask::SlidingWindow { window },
                None => Mask::Causal(CausalAlign::BottomRight),
            },
            position: Position::Rope(rope(&c, head_dim, RopeLayout::Half)?),
            ..AttentionSpec::new(as_u32(heads), as_u32(head_dim))
        }
    };
    attention.validate().map_err(|findings| {
        let findings: Vec<String> = findings.iter().map(ToString::to_string).collect();
        bad(
            &path,
            format!(
                "the attention it describes is invalid: {}",
                findings.join("; ")
            ),
        )
    })?;
    let act = c
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("silu");
    if act != "silu" {
        return Err(bad(
            &path,
            format!("hidden_act `{act}` is not supported for {family}; supported: silu"),
        ));
    }
    let config = ModelConfig {
        vocab: c.uint("vocab_size")?,
        hidden,
        layers,
        attention,
        norm: NormKind::Rms,
        norm_eps: c.float_or("rms_norm_eps", 1e-6),
        mlp: MlpKind::SwiGlu,
        intermediate: c.uint("intermediate_size")?,
        tie_embeddings: c.flag("tie_word_embeddings"),
        qkv_bias: family == "qwen2" || c.flag("attention_bias"),
    };
    config
        .validate()
        .map_err(|e| bad(&path, e.to_string().replace("model config: ", "")))?;
    Ok(config)
}

/// The weight files of a checkpoint and which tensor lives in which.
struct Files {
    by_name: HashMap<String, PathBuf>,
    single: Option<PathBuf>,
}

impl Files {
    fn of(dir: &Path) -> Result<Files, RuntimeError> {
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| bad(&index, e.to_string()))?;
            let json: Value = serde_json::from_str(&text)
                .map_err(|e| bad(&index, format!("not valid JSON: {e}")))?;
            let map = json
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| bad(&index, "`weight_map` is missing"))?;
            let by_name = map
                .iter()
                .filter_map(|(k, v)| v.as_str().map(|f| (k.clone(), dir.join(f))))
                .collect();
            return Ok(Files {
                by_name,
                single: None,
            });
        }
        let single = dir.join("model.safetensors");
        if !single.exists() {
            return Err(bad(
                dir,
                "no model.safetensors or model.safetensors.index.json in this directory",
            ));
        }
        Ok(Files {
            by_name: HashMap::new(),
            single: Some(single),
        })
    }

    /// Reads the named tensors, file by file.
    fn read(&self, names: &[String]) -> Result<HashMap<String, Tensor>, RuntimeError> {
        let mut by_file: HashMap<&Path, Vec<&str>> = HashMap::new();
        for name in names {
            let file = match &self.single {
                Some(f) => f.as_path(),
                None => self
                    .by_name
                    .get(name)
                    .map(PathBuf::as_path)
                    .ok_or_else(|| {
                        RuntimeError::Data(format!(
                            "tensor `{name}` is not in the checkpoint's weight map"
                        ))
                    })?,
            };
            by_file.entry(file).or_default().push(name);
        }
        let mut out = HashMap::new();
        for (file, names) in by_file {
            for (name, t) in names.iter().zip(read_safetensors(file, &names)?) {
                out.insert(name.to_string(), t);
            }
        }
        Ok(out)
    }
}

/// Loads a checkpoint directory.
pub fn load(dir: &Path) -> Result<Model, RuntimeError> {
    let config = config(dir)?;
    let files = Files::of(dir)?;
    let mut names = vec![
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".into(),
    ];
    if !config.tie_embeddings {
        names.push("lm_head.weight".into());
    }
    let mla = config.attention.mla().is_some();
    let q_lora = if mla { read_q_lora(dir)? } else { None };
    for i in 0..config.layers {
        let p = format!("model.layers.{i}.");
        for n in [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "self_attn.o_proj.weight",
        ] {
            names.push(format!("{p}{n}"));
        }
        let attn: &[&str] = match (mla, q_lora.is_some(), config.qkv_bias) {
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
        names.extend(attn.iter().map(|n| format!("{p}{n}")));
    }
    let mut w = Store(files.read(&names)?);
    let eps = config.norm_eps;
    let spec = &config.attention;
    let (d, inter, heads) = (config.hidden, config.intermediate, spec.heads as usize);
    let (dk, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let mut layers = Vec::with_capacity(config.layers);
    for i in 0..config.layers {
        let p = format!("model.layers.{i}.self_attn.");
        let attn = match spec.mla() {
            Some(m) => {
                let (r, dr) = (m.latent_rank as usize, m.rope_dim as usize);
                let q_out = heads * (dk + dr);
                let (q, q_b) = match q_lora {
                    Some(qr) => {
                        let q_a = w.linear(&format!("{p}q_a_proj"), false, [qr, d])?;
                        let q_a_norm =
                            w.norm(&format!("{p}q_a_layernorm.weight"), LATENT_NORM_EPS, qr)?;
                        let q_b = w.linear(&format!("{p}q_b_proj"), false, [q_out, qr])?;
                        (q_a, Some((q_a_norm, q_b)))
                    }
                    None => (w.linear(&format!("{p}q_proj"), false, [q_out, d])?, None),
                };
                AttentionWeights::Mla {
                    q,
                    q_b,
                    kv_a: w.linear(&format!("{p}kv_a_proj_with_mqa"), false, [r + dr, d])?,
                    kv_norm: w.norm(&format!("{p}kv_a_layernorm.weight"), LATENT_NORM_EPS, r)?,
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
                let bias = config.qkv_bias;
                AttentionWeights::Heads {
                    q: w.linear(&format!("{p}q_proj"), bias, [heads * dk, d])?,
                    k: w.linear(&format!("{p}k_proj"), bias, [hkv * dk, d])?,
                    v: w.linear(&format!("{p}v_proj"), bias, [hkv * dv, d])?,
                    o: w.linear(&format!("{p}o_proj"), false, [d, heads * dv])?,
                }
            }
        };
        let p = format!("model.layers.{i}.");
        let mlp = Mlp {
            kind: MlpKind::SwiGlu,
            gate: Some(w.linear(&format!("{p}mlp.gate_proj"), false, [inter, d])?),
            up: w.linear(&format!("{p}mlp.up_proj"), false, [inter, d])?,
            down: w.linear(&format!("{p}mlp.down_proj"), false, [d, inter])?,
        };
        layers.push(Layer {
            attn_norm: w.norm(&format!("{p}input_layernorm.weight"), eps, d)?,
            attn,
            mlp_norm: w.norm(&format!("{p}post_attention_layernorm.weight"), eps, d)?,
            mlp,
        });
    }
    let embed = w.matrix("model.embed_tokens.weight", [config.vocab, d])?;
    let lm_head = if config.tie_embeddings {
        None
    } else {
        Some(w.linear("lm_head", false, [config.vocab, d])?)
    };
    let final_norm = w.norm("model.norm.weight", eps, d)?;
    let embed = Matrix::new(config.vocab, d, embed.into_storage());
    Model::new(config, embed, layers, final_norm, lm_head)
}

/// Tensors read from a checkpoint, taken as the model is assembled.
struct Store(HashMap<String, Tensor>);

impl Store {
    fn take(&mut self, name: &str) -> Result<Tensor, RuntimeError> {
        self.0
            .remove(name)
            .ok_or_else(|| RuntimeError::Data(format!("tensor `{name}` is missing")))
    }

    /// The tensor `name`, which must have `shape`.
    fn shaped(&mut self, name: &str, shape: &[usize]) -> Result<Tensor, RuntimeError> {
        let t = self.take(name)?;
        if t.shape() != shape {
            return Err(RuntimeError::Shape {
                tensor: name.to_string(),
                found: t.shape().to_vec(),
                expected: format!("{shape:?} (from config.json)"),
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

    /// The RMSNorm weight `name`, which must have `len` values.
    fn norm(&mut self, name: &str, eps: f64, len: usize) -> Result<Norm, RuntimeError> {
        Ok(Norm {
            kind: NormKind::Rms,
            weight: self.shaped(name, &[len])?.to_f32_vec(),
            bias: None,
            eps,
        })
    }
}

/// The rank through which a DeepSeek checkpoint factors its queries (`q_lora_rank`), if it
/// does.
fn read_q_lora(dir: &Path) -> Result<Option<usize>, RuntimeError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| bad(&path, e.to_string()))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| bad(&path, format!("not valid JSON: {e}")))?;
    let c = Config { path: &path, json };
    if c.get("q_lora_rank").is_none() {
        return Ok(None);
    }
    match c.uint("q_lora_rank")? {
        rank @ 1..=MAX_WIDTH => Ok(Some(rank)),
        rank => Err(bad(
            &path,
            format!("`q_lora_rank` = {rank} is out of range; allowed: 1 to {MAX_WIDTH}"),
        )),
    }
}
