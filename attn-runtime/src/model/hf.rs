//! Hugging Face checkpoints: `config.json` and `*.safetensors` (one file, or shards listed in
//! `model.safetensors.index.json`; f32, bf16 or f16 weights, computed in f32).
//!
//! Families: `llama` (every RoPE scaling, from `rope_parameters` or the older `rope_theta` /
//! `rope_scaling` keys), `mistral` (sliding window), `qwen2` (q/k/v biases), `qwen3` (per-head
//! norms on q and k), `smollm3` (layers without RoPE), `gemma` (GeGLU, norms of `1 + w`, a
//! scaled embedding), `gemma2` (sandwich norms, softcaps, alternating sliding layers),
//! `gemma3_text` (q/k norms, a RoPE per layer type), `olmo2` (norms after the sublayers, q/k
//! norms over the whole projection), `mixtral`, `qwen2_moe` (with a gated shared expert) and
//! `qwen3_moe` (mixture-of-experts MLPs),
//! `granite` (embedding, attention, residual and logit multipliers), `cohere` (attention and
//! MLP in parallel on one LayerNorm without bias, interleaved RoPE, a logit scale),
//! `starcoder2` (LayerNorms with biases, a GELU MLP `c_fc`/`c_proj`, biases everywhere),
//! `phi3` (fused `qkv_proj` and `gate_up_proj`, partial RoPE, LongRoPE), `gpt_oss`
//! (learned sinks, experts in three-dimensional tensors behind a biased router, a clamped
//! SwiGLU, YaRN unrounded), `gpt_neox` (its own tensor names, q, k, v fused head by head,
//! attention and MLP in parallel with a LayerNorm each, partial RoPE, the exact GELU),
//! `bloom` (ALiBi, a LayerNorm on the embedding, q, k, v fused head by head, checkpoints with
//! or without the `transformer.` prefix), `deepseek_v2` and `deepseek_v3` (MLA; grouped mixture-of-experts routing with shared
//! experts). Layers differ where the config says so (`layer_types`: sliding and full attention; `no_rope_layers`): each distinct
//! attention is one kind of the [`ModelConfig`], and the layers point at their kinds.

use super::Model;
use super::config::{
    ExpertNames, MAX_LAYERS, MAX_WIDTH, MlpKind, MlpNames, ModelConfig, Moe, NormKind,
    NormPlacement, Projections, QkNorm, Router, SharedExpert, TensorNames,
};
use super::json_fields::{Fields, bad};
use super::weights;
use crate::error::RuntimeError;
use crate::files::{MAX_CONFIG_BYTES, read_text};
use crate::io::read_safetensors;
use crate::tensor::Tensor;
use attn_dsl::{
    AttentionSpec, CausalAlign, KvLayout, LongRope, Mask, Mla, Position, Rope, RopeLayout,
    RopeScaling, Sinks, Yarn,
};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Families this loader knows.
pub const FAMILIES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "smollm3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "olmo2",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "granite",
    "cohere",
    "starcoder2",
    "phi3",
    "gpt_oss",
    "gpt_neox",
    "bloom",
    "deepseek_v2",
    "deepseek_v3",
];

/// A checkpoint's parsed `config.json`.
struct Config {
    path: PathBuf,
    json: Value,
}

impl Config {
    /// Reads and parses `dir/config.json` (a regular file of at most
    /// [`MAX_CONFIG_BYTES`](crate::files::MAX_CONFIG_BYTES)).
    fn read(dir: &Path) -> Result<Config, RuntimeError> {
        let path = dir.join("config.json");
        let text = read_text(&path, MAX_CONFIG_BYTES, "config.json")?;
        let json =
            serde_json::from_str(&text).map_err(|e| bad(&path, format!("not valid JSON: {e}")))?;
        Ok(Config { path, json })
    }

    fn fields(&self) -> Result<Fields<'_>, RuntimeError> {
        Fields::top(&self.path, &self.json)
    }
}

/// YaRN's magnitude scale as transformers defines it: `0.1 m ln(s) + 1` for `s > 1`, else 1.
fn yarn_mscale(s: f64, m: f64) -> f64 {
    if s > 1.0 { 0.1 * m * s.ln() + 1.0 } else { 1.0 }
}

/// The RoPE parameters of a config (`rope_parameters` in transformers 5, `rope_scaling`
/// before), with `rope_type` (or the older `type`; `default` when absent).
fn rope_params<'a>(c: Fields<'a>) -> Result<(Option<Fields<'a>>, &'a str), RuntimeError> {
    let newer = c.object("rope_parameters", "rope_parameters.")?;
    let older = c.object("rope_scaling", "rope_scaling.")?;
    let params = newer.or(older);
    let kind = match params {
        Some(p) => {
            let (newer, older) = (p.str_opt("rope_type")?, p.str_opt("type")?);
            newer.or(older)
        }
        None => None,
    };
    Ok((params, kind.unwrap_or("default")))
}

/// DeepSeek-V2/V3's softmax scale: `1/sqrt(qk_dim)`, times `mscale(factor, mscale_all_dim)^2`
/// when the RoPE scaling is not the default one and sets a nonzero `mscale_all_dim`
/// (transformers' DeepseekV3Attention).
fn deepseek_scale(c: Fields, qk_dim: usize) -> Result<f64, RuntimeError> {
    let base = 1.0 / (qk_dim as f64).sqrt();
    let (params, kind) = rope_params(c)?;
    let Some(params) = params else {
        return Ok(base);
    };
    let all_dim = params.float_or("mscale_all_dim", 0.0)?;
    Ok(match params.float_opt("factor")? {
        Some(factor) if kind != "default" && all_dim != 0.0 => {
            let m = yarn_mscale(factor, all_dim);
            base * m * m
        }
        _ => base,
    })
}

/// The numeric keys of the RoPE parameters, across every scaling.
const ROPE_NUMBERS: &[&str] = &[
    "rope_theta",
    "factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "low_freq_factor",
    "high_freq_factor",
];

/// The RoPE of the checkpoint's attention over the first `dim` dims, from its RoPE keys.
fn rope(c: Fields, dim: usize, layout: RopeLayout) -> Result<Rope, RuntimeError> {
    // transformers 5 nests everything in `rope_parameters`; older files use `rope_theta` and
    // `rope_scaling`.
    let (params, kind) = rope_params(c)?;
    rope_from(c, params, kind, dim, layout, Outer::Priority)
}

/// Whether a top-level `original_max_position_embeddings` (phi3's place for it) wins over
/// the RoPE parameters' own: transformers gives it priority for one RoPE of the whole model,
/// not for RoPEs given per layer type.
#[derive(Clone, Copy, PartialEq)]
enum Outer {
    Priority,
    Ignored,
}

/// The RoPE of the layers of `layer_type` (gemma3 keys `rope_parameters` by layer type:
/// `full_attention`, `sliding_attention`), or the model's one RoPE where it does not.
fn rope_of_type(
    c: Fields,
    layer_type: &'static str,
    dim: usize,
    layout: RopeLayout,
) -> Result<Rope, RuntimeError> {
    let nested = match c.object("rope_parameters", "rope_parameters.")? {
        Some(all) if all.has(layer_type) => all.object(
            layer_type,
            match layer_type {
                "full_attention" => "rope_parameters.full_attention.",
                _ => "rope_parameters.sliding_attention.",
            },
        )?,
        _ => None,
    };
    let Some(params) = nested else {
        return rope(c, dim, layout);
    };
    let (newer, older) = (params.str_opt("rope_type")?, params.str_opt("type")?);
    let kind = newer.or(older).unwrap_or("default");
    rope_from(c, Some(params), kind, dim, layout, Outer::Ignored)
}

/// The RoPE of `kind` from its parameters `params` (and the top-level keys it falls back on,
/// or that win over them where `outer` says so).
fn rope_from(
    c: Fields,
    params: Option<Fields>,
    kind: &str,
    dim: usize,
    layout: RopeLayout,
    outer: Outer,
) -> Result<Rope, RuntimeError> {
    let num = |k: &str| params.map_or(Ok(None), |p| p.float_opt(k));
    // Every key a scaling reads is type-checked whatever the scaling, and so is the position
    // count any of them may fall back on.
    for key in ROPE_NUMBERS {
        num(key)?;
    }
    if let Some(p) = params {
        p.uint_opt("original_max_position_embeddings")?;
    }
    c.uint_opt("max_position_embeddings")?;
    // Older gpt_neox files name the base `rotary_emb_base`.
    let outer_base = c
        .float_opt("rope_theta")?
        .or(c.float_opt("rotary_emb_base")?);
    let base = num("rope_theta")?.or(outer_base).unwrap_or(10_000.0);
    let top = match outer {
        Outer::Priority => c.uint_opt("original_max_position_embeddings")?,
        Outer::Ignored => None,
    };
    // The scalings transformers moves a top-level value into the parameters for.
    let takes_top = matches!(kind, "yarn" | "llama3");
    let original = || {
        let nested = params.map_or(Ok(None), |p| p.uint_opt("original_max_position_embeddings"))?;
        match top.filter(|_| takes_top).or(nested) {
            Some(n) => Ok(n as u64),
            None => c
                .uint_opt("max_position_embeddings")?
                .map(|n| n as u64)
                .ok_or_else(|| {
                    bad(
                        c.path(),
                        format!("rope type `{kind}` needs original_max_position_embeddings"),
                    )
                }),
        }
    };
    let factor = || {
        num("factor")?.ok_or_else(|| bad(c.path(), format!("rope type `{kind}` needs a factor")))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "dynamic" => RopeScaling::Dynamic {
            factor: factor()?,
            original_max_position: original()?,
        },
        // LongRoPE; phi3 reads the older `su` and `yarn` as it.
        "longrope" | "su" => longrope(c, params, dim, top)?,
        "yarn" if c.str_opt("model_type")? == Some("phi3") => longrope(c, params, dim, top)?,
        "yarn" => {
            let mut yarn = Yarn::new(factor()?, original()?);
            yarn.beta_fast = num("beta_fast")?.unwrap_or(yarn.beta_fast);
            yarn.beta_slow = num("beta_slow")?.unwrap_or(yarn.beta_slow);
            // transformers rounds the correction range outward unless `truncate` is false.
            if let Some(p) = params {
                yarn.truncate = !p.has("truncate") || p.flag("truncate")?;
            }
            // transformers divides the two mscales only when both are set and nonzero; else
            // the attention factor is mscale(factor, 1).
            if let (Some(m), Some(all)) = (num("mscale")?, num("mscale_all_dim")?)
                && m != 0.0
                && all != 0.0
            {
                (yarn.mscale, yarn.mscale_all_dim) = (Some(m), Some(all));
            }
            RopeScaling::Yarn(yarn)
        }
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: num("low_freq_factor")?.unwrap_or(1.0),
            high_freq_factor: num("high_freq_factor")?.unwrap_or(4.0),
            original_max_position: original()?,
        },
        other => {
            return Err(bad(
                c.path(),
                format!(
                    "rope type `{other}` is not supported; supported: default, linear, dynamic, \
                     yarn, llama3, longrope"
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

/// LongRoPE over `dim` rotated dims, as transformers reads it: `short_factor` and `long_factor`
/// (one per rotated pair), `original_max_position_embeddings` (`top`, the top-level value as
/// phi3 keeps it, first; else the parameters'), and `attention_factor`, by default
/// `sqrt(1 + ln s / ln original)` for `s = factor` (by default `max_position_embeddings /
/// original`) above 1, else 1.
fn longrope(
    c: Fields,
    params: Option<Fields>,
    dim: usize,
    top: Option<usize>,
) -> Result<RopeScaling, RuntimeError> {
    let path = c.path();
    let p = params.ok_or_else(|| bad(path, "rope type `longrope` needs its parameters"))?;
    let pairs = dim / 2;
    let list = |key: &str| {
        p.list_opt(
            key,
            (pairs, "rotated pair"),
            serde_json::Value::as_f64,
            "numbers",
        )?
        .ok_or_else(|| bad(path, format!("rope type `longrope` needs `{key}`")))
    };
    let (short, long) = (list("short_factor")?, list("long_factor")?);
    let original = match top.or(p.uint_opt("original_max_position_embeddings")?) {
        Some(n) => n,
        None => c.uint("max_position_embeddings")?,
    };
    let factor = match p.float_opt("factor")? {
        Some(f) => f,
        None => c.uint("max_position_embeddings")? as f64 / original as f64,
    };
    let attention_factor = match p.float_opt("attention_factor")? {
        Some(a) => a,
        None if factor <= 1.0 => 1.0,
        // An original of 0 or 1 makes this NaN or infinite, which validation refuses.
        None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
    };
    Ok(RopeScaling::LongRope(LongRope {
        short: short.into(),
        long: long.into(),
        original_max_position: original as u64,
        attention_factor,
    }))
}

/// Reads `dir/config.json` into a model config and the spec of its attention. Keys the model
/// needs must be there; optional ones take transformers' defaults when absent, and any key
/// present with the wrong JSON type is an error naming it.
pub fn config(dir: &Path) -> Result<ModelConfig, RuntimeError> {
    let file = Config::read(dir)?;
    let c = file.fields()?;
    let path = file.path.as_path();
    let (family, hidden, heads, layers) = shape_of(c, path)?;
    let (attention, pattern) = attention_of(c, path, &family, [heads, hidden, layers])?;
    let gemma = family.starts_with("gemma");
    let cohere = family == "cohere";
    let neox = family == "gpt_neox";
    let bloom = family == "bloom";
    refuse_unsupported(c, path, &family)?;
    let starcoder = family == "starcoder2";
    let use_bias = starcoder && (!c.has("use_bias") || c.flag("use_bias")?);
    packed_experts(c, &family)?;
    let mlp = activation(c, &family)?;
    // qwen2 has biases on q, k and v only; elsewhere `attention_bias` puts them on all four.
    // gpt-oss's and gpt_neox's `attention_bias` default to true.
    let attention_bias = match family.as_str() {
        "gpt_oss" | "gpt_neox" => !c.has("attention_bias") || c.flag("attention_bias")?,
        "bloom" => true,
        _ => c.flag("attention_bias")?,
    };
    let config = ModelConfig {
        vocab: c.uint("vocab_size")?,
        hidden,
        layers,
        attention,
        pattern,
        context: c.uint_opt("max_position_embeddings")?,
        qk_norm: match family.as_str() {
            "qwen3" | "qwen3_moe" | "gemma3_text" => Some(QkNorm::PerHead),
            "olmo2" => Some(QkNorm::Whole),
            "cohere" if c.flag("use_qk_norm")? => Some(QkNorm::PerHeadLayer),
            _ => None,
        },
        placement: match family.as_str() {
            "gemma2" | "gemma3_text" => NormPlacement::Sandwich,
            "olmo2" => NormPlacement::Post,
            "cohere" => NormPlacement::Parallel,
            "gpt_neox" if !c.has("use_parallel_residual") || c.flag("use_parallel_residual")? => {
                NormPlacement::ParallelTwoNorms
            }
            _ => NormPlacement::Pre,
        },
        norm: if cohere || starcoder || neox || bloom {
            NormKind::Layer
        } else {
            NormKind::Rms
        },
        norm_eps: match family.as_str() {
            "cohere" => c.float_or("layer_norm_eps", 1e-5)?,
            "starcoder2" => c.float_or("norm_epsilon", 1e-5)?,
            "gpt_neox" => c.float_or("layer_norm_eps", 1e-5)?,
            "bloom" => c.float_or("layer_norm_epsilon", 1e-5)?,
            _ => c.float_or("rms_norm_eps", 1e-6)?,
        },
        norm_bias: starcoder || neox || bloom,
        // starcoder2's `use_bias` (default true) puts biases on every projection; llama,
        // smollm3 and granite read `mlp_bias`; the other families have none.
        mlp_bias: match family.as_str() {
            "llama" | "smollm3" | "granite" => c.flag("mlp_bias")?,
            // gpt-oss's experts and gpt_neox's and bloom's MLPs have biases.
            "gpt_oss" | "gpt_neox" | "bloom" => true,
            _ => use_bias,
        },
        mlp_names: if starcoder {
            MlpNames::FcProj
        } else {
            MlpNames::GateUpDown
        },
        projections: match family.as_str() {
            "phi3" => Projections::Fused,
            "gpt_neox" | "bloom" => Projections::FusedPerHead,
            _ => Projections::Separate,
        },
        tensor_names: match family.as_str() {
            "gpt_neox" => TensorNames::GptNeox,
            // `load` drops the prefix where the checkpoint's names lack it.
            "bloom" => TensorNames::Bloom { prefixed: true },
            _ => TensorNames::Llama,
        },
        norm_unit_offset: gemma,
        mlp,
        // bloom's MLP is four times as wide as the model.
        intermediate: match bloom {
            true => hidden.saturating_mul(4),
            false => c.uint("intermediate_size")?,
        },
        // bloom ties them unless told otherwise (transformers' base default).
        tie_embeddings: match bloom {
            true => !c.has("tie_word_embeddings") || c.flag("tie_word_embeddings")?,
            false => c.flag("tie_word_embeddings")?,
        },
        qkv_bias: match family.as_str() {
            "qwen2" => true,
            // qwen2_moe's `qkv_bias` defaults to true.
            "qwen2_moe" => !c.has("qkv_bias") || c.flag("qkv_bias")?,
            _ => attention_bias || use_bias,
        },
        o_bias: match family.as_str() {
            "qwen2" | "qwen2_moe" => false,
            _ => attention_bias || use_bias,
        },
        embed_multiplier: match family.as_str() {
            "granite" => c.float_opt("embedding_multiplier")?,
            _ => gemma.then(|| (hidden as f64).sqrt()),
        },
        embed_norm: bloom,
        residual_multiplier: match family.as_str() {
            "granite" => c.float_opt("residual_multiplier")?,
            _ => None,
        },
        logit_multiplier: match family.as_str() {
            "granite" => c.float_opt("logits_scaling")?.map(|s| 1.0 / s),
            "cohere" => Some(c.float_or("logit_scale", 0.0625)?),
            _ => None,
        },
        final_softcap: match family.as_str() {
            "gemma2" => defaulted(c, "final_logit_softcapping", Some(30.0))?,
            "gemma3_text" => c.float_opt("final_logit_softcapping")?,
            _ => None,
        },
        moe: experts(c, &family, layers)?,
    };
    config
        .validate()
        .map_err(|e| bad(path, e.to_string().replace("model config: ", "")))?;
    Ok(config)
}

/// The family, width, heads and layers of a config.json, each checked.
fn shape_of(c: Fields, path: &Path) -> Result<(String, usize, usize, usize), RuntimeError> {
    let family = c
        .str_opt("model_type")?
        .ok_or_else(|| bad(path, "`model_type` is missing"))?
        .to_string();
    if !FAMILIES.contains(&family.as_str()) {
        return Err(bad(
            path,
            format!(
                "model family `{family}` is not supported; supported: {}",
                FAMILIES.join(", ")
            ),
        ));
    }
    // bloom's files may use its older names.
    let hidden = c.uint_or_alias("hidden_size", "n_embed")?;
    let heads = c.uint_or_alias("num_attention_heads", "n_head")?;
    if heads == 0 {
        return Err(bad(
            path,
            "`num_attention_heads` is 0; allowed: a whole number of at least 1",
        ));
    }
    let layers = c.uint_or_alias("num_hidden_layers", "n_layer")?;
    if !(1..=MAX_LAYERS).contains(&layers) {
        return Err(bad(
            path,
            format!("`num_hidden_layers` = {layers} is out of range; allowed: 1 to {MAX_LAYERS}"),
        ));
    }
    Ok((family, hidden, heads, layers))
}

/// The attention kinds of a family's layers and each layer's kind, every spec validated.
fn attention_of(
    c: Fields,
    path: &Path,
    family: &str,
    [heads, hidden, layers]: [usize; 3],
) -> Result<(Vec<AttentionSpec>, Vec<usize>), RuntimeError> {
    let (attention, pattern) = if family.starts_with("deepseek") {
        (vec![deepseek_attention(c, heads)?], vec![0])
    } else {
        per_head_layers(c, family, heads, hidden, layers)?
    };
    for spec in &attention {
        spec.validate().map_err(|findings| {
            let findings: Vec<String> = findings.iter().map(ToString::to_string).collect();
            bad(
                path,
                format!(
                    "the attention it describes is invalid: {}",
                    findings.join("; ")
                ),
            )
        })?;
    }
    Ok((attention, pattern))
}

/// Refuses settings of a family's config.json that no model here runs: bloom's residual after
/// the norm, and bidirectional attention.
fn refuse_unsupported(c: Fields, path: &Path, family: &str) -> Result<(), RuntimeError> {
    if family == "bloom" && c.flag("apply_residual_connection_post_layernorm")? {
        return Err(bad(
            path,
            "`apply_residual_connection_post_layernorm` = true (bloom's residual taken after \
             the norm) is not supported; supported: false",
        ));
    }
    if c.flag("use_bidirectional_attention")? {
        return Err(bad(
            path,
            "`use_bidirectional_attention` = true is not supported; supported: causal decoders",
        ));
    }
    Ok(())
}

/// Whether the checkpoint stores gpt-oss's experts packed as MXFP4 (`quantization_config` with
/// `quant_method` `mxfp4`); any other quantization is an error naming it.
fn packed_experts(c: Fields, family: &str) -> Result<bool, RuntimeError> {
    let Some(q) = c.object("quantization_config", "quantization_config.")? else {
        return Ok(false);
    };
    match q.str_opt("quant_method")? {
        Some("mxfp4") if family == "gpt_oss" => Ok(true),
        method => Err(bad(
            c.path(),
            format!(
                "quantized weights (`quantization_config.quant_method` = {}) are not supported; \
                 supported: unquantized weights, and gpt-oss's experts in mxfp4",
                method.map_or("none".to_string(), |m| format!("`{m}`"))
            ),
        )),
    }
}

/// The MLP of the family from its activation: SwiGLU (`silu`), or GeGLU for gemma
/// (`gelu_pytorch_tanh`; gemma's legacy `gelu` means the same, as transformers reads it).
fn activation(c: Fields, family: &str) -> Result<MlpKind, RuntimeError> {
    // bloom has no activation key: its GELU is the tanh one.
    if family == "bloom" {
        return Ok(MlpKind::Gelu);
    }
    if family == "gpt_neox" {
        return match c.str_opt("hidden_act")?.unwrap_or("gelu") {
            "gelu" => Ok(MlpKind::GeluExact),
            "gelu_new" | "gelu_fast" | "gelu_pytorch_tanh" => Ok(MlpKind::Gelu),
            act => Err(bad(
                c.path(),
                format!(
                    "hidden_act `{act}` is not supported for gpt_neox; supported: gelu, gelu_new, \
                     gelu_fast, gelu_pytorch_tanh"
                ),
            )),
        };
    }
    if family == "gpt_oss" {
        return Ok(MlpKind::ClampedSwiGlu {
            alpha: c.float_or("swiglu_alpha", 1.702)? as f32,
            limit: c.float_or("swiglu_limit", 7.0)? as f32,
        });
    }
    if family == "starcoder2" {
        return match c.str_opt("hidden_act")?.unwrap_or("gelu_pytorch_tanh") {
            "gelu_pytorch_tanh" => Ok(MlpKind::Gelu),
            act => Err(bad(
                c.path(),
                format!(
                    "hidden_act `{act}` is not supported for {family}; supported: \
                     gelu_pytorch_tanh"
                ),
            )),
        };
    }
    if !family.starts_with("gemma") {
        let act = c.str_opt("hidden_act")?.unwrap_or("silu");
        return match act {
            "silu" => Ok(MlpKind::SwiGlu),
            _ => Err(bad(
                c.path(),
                format!("hidden_act `{act}` is not supported for {family}; supported: silu"),
            )),
        };
    }
    let key = if family == "gemma" {
        "hidden_act"
    } else {
        "hidden_activation"
    };
    match c.str_opt(key)?.unwrap_or("gelu_pytorch_tanh") {
        "gelu_pytorch_tanh" => Ok(MlpKind::GeGlu),
        "gelu" if family == "gemma" => Ok(MlpKind::GeGlu),
        act => Err(bad(
            c.path(),
            format!("{key} `{act}` is not supported for {family}; supported: gelu_pytorch_tanh"),
        )),
    }
}

/// The mixture-of-experts MLPs of the family: mixtral's in every layer (the chosen experts'
/// weights renormalized); qwen2_moe's and qwen3_moe's every `decoder_sparse_step`-th layer
/// outside `mlp_only_layers` (renormalized where `norm_topk_prob`; qwen2_moe's with its gated
/// shared expert); none elsewhere.
fn experts(c: Fields, family: &str, layers: usize) -> Result<Option<Moe>, RuntimeError> {
    let top_k = c.uint_opt("num_experts_per_tok")?.unwrap_or(2);
    Ok(Some(match family {
        "mixtral" => Moe {
            experts: c.uint_opt("num_local_experts")?.unwrap_or(8),
            top_k,
            intermediate: c.uint("intermediate_size")?,
            normalize: true,
            sparse: vec![true; layers],
            router: Router::Softmax,
            scale: 1.0,
            shared: None,
            names: ExpertNames::Mixtral,
        },
        "qwen3_moe" | "qwen2_moe" => {
            let step = c.uint_opt("decoder_sparse_step")?.unwrap_or(1);
            if step == 0 {
                return Err(bad(
                    c.path(),
                    "`decoder_sparse_step` is 0; allowed: a whole number of at least 1",
                ));
            }
            let dense = layer_list(c, "mlp_only_layers")?;
            // transformers 5 writes `num_local_experts`; older files `num_experts`.
            let newer = c.uint_opt("num_local_experts")?;
            Moe {
                experts: newer.or(c.uint_opt("num_experts")?).unwrap_or(128),
                top_k,
                intermediate: c.uint("moe_intermediate_size")?,
                normalize: c.flag("norm_topk_prob")?,
                sparse: (0..layers)
                    .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
                    .collect(),
                router: Router::Softmax,
                scale: 1.0,
                shared: match family {
                    "qwen2_moe" => Some(SharedExpert {
                        width: c.uint("shared_expert_intermediate_size")?,
                        gated: true,
                    }),
                    _ => None,
                },
                names: ExpertNames::Qwen,
            }
        }
        "gpt_oss" => Moe {
            experts: c.uint_opt("num_local_experts")?.unwrap_or(128),
            top_k: c.uint_opt("num_experts_per_tok")?.unwrap_or(4),
            intermediate: c.uint("intermediate_size")?,
            normalize: false,
            router: Router::TopKSoftmax,
            scale: 1.0,
            sparse: vec![true; layers],
            shared: None,
            names: ExpertNames::GptOss,
        },
        "deepseek_v2" | "deepseek_v3" => return deepseek_experts(c, family, layers),
        _ => return Ok(None),
    }))
}

/// DeepSeek-V2/V3's mixture-of-experts MLPs, from layer `first_k_dense_replace` on (none
/// without `n_routed_experts`): V2 routes by softmax, greedily or within the best
/// `topk_group` groups, weights not renormalized; V3 by sigmoid plus a correction bias within
/// the best groups, weights renormalized where `norm_topk_prob`; both scale them by
/// `routed_scaling_factor` and add `n_shared_experts` shared experts' MLP.
fn deepseek_experts(c: Fields, family: &str, layers: usize) -> Result<Option<Moe>, RuntimeError> {
    let Some(experts) = c.uint_opt("n_routed_experts")? else {
        return Ok(None);
    };
    let dense = c.uint_opt("first_k_dense_replace")?.unwrap_or(0);
    let groups = || -> Result<(usize, usize), RuntimeError> {
        Ok((
            c.uint_opt("n_group")?.unwrap_or(1),
            c.uint_opt("topk_group")?.unwrap_or(1),
        ))
    };
    let v3 = family == "deepseek_v3";
    let router = if v3 {
        let (groups, topk_group) = groups()?;
        Router::SigmoidGroups { groups, topk_group }
    } else {
        match c.str_opt("topk_method")?.unwrap_or("greedy") {
            "greedy" => Router::Softmax,
            "group_limited_greedy" => {
                let (groups, topk_group) = groups()?;
                Router::SoftmaxGroups { groups, topk_group }
            }
            other => {
                return Err(bad(
                    c.path(),
                    format!(
                        "topk_method `{other}` is not supported; supported: greedy, \
                         group_limited_greedy"
                    ),
                ));
            }
        }
    };
    let width = c.uint("moe_intermediate_size")?;
    let shared = c.uint_opt("n_shared_experts")?.unwrap_or(0);
    Ok(Some(Moe {
        experts,
        top_k: c.uint_opt("num_experts_per_tok")?.unwrap_or(2),
        intermediate: width,
        normalize: v3 && (!c.has("norm_topk_prob") || c.flag("norm_topk_prob")?),
        router,
        scale: c.float_or("routed_scaling_factor", if v3 { 2.5 } else { 1.0 })?,
        sparse: (0..layers).map(|i| i >= dense).collect(),
        shared: (shared > 0).then_some(SharedExpert {
            width: width.saturating_mul(shared),
            gated: false,
        }),
        names: ExpertNames::Qwen,
    }))
}

/// A list of layer indices (`[]` when absent; at most [`MAX_LAYERS`] of them).
fn layer_list(c: Fields, key: &str) -> Result<Vec<usize>, RuntimeError> {
    let Some(v) = c.get(key) else {
        return Ok(Vec::new());
    };
    let items = v
        .as_array()
        .filter(|a| a.len() <= MAX_LAYERS)
        .ok_or_else(|| {
            bad(
                c.path(),
                format!("`{key}` must be a list of at most {MAX_LAYERS} layer indices"),
            )
        })?;
    items
        .iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_u64().map(|x| x as usize).ok_or_else(|| {
                bad(
                    c.path(),
                    format!("`{key}[{i}]` is {x}; expected a layer index"),
                )
            })
        })
        .collect()
}

/// A number that takes `default` when the key is absent (transformers' default) and none when
/// it is `null`.
fn defaulted(c: Fields, key: &str, default: Option<f64>) -> Result<Option<f64>, RuntimeError> {
    if c.has(key) {
        c.float_opt(key)
    } else {
        Ok(default)
    }
}

/// DeepSeek-V2/V3's MLA attention (every layer's).
fn deepseek_attention(c: Fields, heads: usize) -> Result<AttentionSpec, RuntimeError> {
    let (dn, dr, dv, r) = (
        c.uint("qk_nope_head_dim")?,
        c.uint("qk_rope_head_dim")?,
        c.uint("v_head_dim")?,
        c.uint("kv_lora_rank")?,
    );
    // Counts are at most u32::MAX (`Fields::uint`). DeepSeek rotates interleaved pairs (V3
    // halves under `rope_interleave: false`); its softmax scale is 1/sqrt(nope + rope), times
    // YaRN's mscale(factor, mscale_all_dim)^2 where the config sets mscale_all_dim.
    let layout = match c.str_opt("model_type")? {
        Some("deepseek_v3") if c.has("rope_interleave") && !c.flag("rope_interleave")? => {
            RopeLayout::Half
        }
        _ => RopeLayout::Interleaved,
    };
    Ok(AttentionSpec {
        kv: KvLayout::Mla(Mla {
            latent_rank: r as u32,
            rope_dim: dr as u32,
        }),
        v_head_dim: dv as u32,
        mask: Mask::Causal(CausalAlign::BottomRight),
        position: Position::Rope(rope(c, dr, layout)?),
        scale: Some(deepseek_scale(c, dn + dr)?),
        ..AttentionSpec::new(heads as u32, dn as u32)
    })
}

/// The attention of each layer of a per-head family, as distinct kinds and each layer's kind
/// (`layers` is at most [`MAX_LAYERS`]).
fn per_head_layers(
    c: Fields,
    family: &str,
    heads: usize,
    hidden: usize,
    layers: usize,
) -> Result<(Vec<AttentionSpec>, Vec<usize>), RuntimeError> {
    let kv_heads = c.uint_opt("num_key_value_heads")?.unwrap_or(heads);
    let head_dim = c.uint_opt("head_dim")?.unwrap_or(hidden / heads);
    // cohere rotates interleaved pairs; the others rotate halves.
    let layout = match family {
        "cohere" => RopeLayout::Interleaved,
        _ => RopeLayout::Half,
    };
    let rope_dim = rotary_dims(c, head_dim)?;
    let ropes = [
        rope_of_type(c, "full_attention", rope_dim, layout)?,
        rope_of_type(c, "sliding_attention", rope_dim, layout)?,
    ];
    let has_rope = rope_layers(c, family, layers)?;
    let sliding = sliding_layers(c, family, layers, &has_rope)?;
    // Read (and type-checked) whatever the family; used where a layer slides.
    let window = c.uint_opt("sliding_window")?;
    // gemma2 and gemma3 scale by `query_pre_attn_scalar^-1/2` and may softcap the scores.
    let later_gemma = matches!(family, "gemma2" | "gemma3_text");
    let scale = match (later_gemma, family) {
        (true, _) => Some(1.0 / c.float_or("query_pre_attn_scalar", 256.0)?.sqrt()),
        // granite's scores are scaled by `attention_multiplier`.
        (false, "granite") => c.float_opt("attention_multiplier")?,
        (false, _) => None,
    };
    let softcap = match family {
        "gemma2" => defaulted(c, "attn_logit_softcapping", Some(50.0))?,
        "gemma3_text" => c.float_opt("attn_logit_softcapping")?,
        _ => None,
    };
    let mut kinds: Vec<AttentionSpec> = Vec::new();
    let mut pattern = Vec::with_capacity(layers);
    for i in 0..layers {
        // Counts are at most u32::MAX (`Fields::uint`).
        let spec = AttentionSpec {
            kv: KvLayout::Heads {
                kv_heads: kv_heads as u32,
            },
            mask: match window.filter(|_| sliding[i]) {
                Some(window) => Mask::SlidingWindow {
                    window: window as u64,
                },
                None => Mask::Causal(CausalAlign::BottomRight),
            },
            // bloom's heads add ALiBi's slopes times the key's position.
            position: if family == "bloom" {
                Position::Alibi
            } else if has_rope[i] {
                Position::Rope(ropes[usize::from(sliding[i])].clone())
            } else {
                Position::None
            },
            scale,
            softcap,
            sinks: match family {
                "gpt_oss" => Sinks::Learned,
                _ => Sinks::None,
            },
            ..AttentionSpec::new(heads as u32, head_dim as u32)
        };
        let kind = match kinds.iter().position(|k| *k == spec) {
            Some(kind) => kind,
            None => {
                kinds.push(spec);
                kinds.len() - 1
            }
        };
        pattern.push(kind);
    }
    Ok((kinds, pattern))
}

/// The head dims RoPE rotates: `head_dim` times `partial_rotary_factor` (in `rope_parameters`,
/// or at the top in older files; 1 by default), rounded down as transformers does.
fn rotary_dims(c: Fields, head_dim: usize) -> Result<usize, RuntimeError> {
    let nested = match c.object("rope_parameters", "rope_parameters.")? {
        Some(p) => p.float_opt("partial_rotary_factor")?,
        None => None,
    };
    let factor = match nested {
        Some(f) => f,
        // Older gpt_neox files say `rotary_pct` (transformers' default 0.25).
        None => match c.float_opt("partial_rotary_factor")? {
            Some(f) => f,
            None if c.has("rotary_pct") || c.str_opt("model_type")? == Some("gpt_neox") => {
                c.float_or("rotary_pct", 0.25)?
            }
            None => 1.0,
        },
    };
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(bad(
            c.path(),
            format!(
                "`partial_rotary_factor` = {factor} is out of range; allowed: above 0, up to 1"
            ),
        ));
    }
    Ok((head_dim as f64 * factor) as usize)
}

/// Which layers rotate q and k: all, except where smollm3's `no_rope_layers` (1 = RoPE) says
/// otherwise (by default every `no_rope_layer_interval`-th layer, 4, has none).
fn rope_layers(c: Fields, family: &str, layers: usize) -> Result<Vec<bool>, RuntimeError> {
    if family != "smollm3" {
        return Ok(vec![true; layers]);
    }
    let listed = c.list_opt(
        "no_rope_layers",
        (layers, "layer"),
        |v| v.as_u64().filter(|&x| x <= 1).map(|x| x == 1),
        "0 or 1",
    )?;
    if let Some(listed) = listed {
        return Ok(listed);
    }
    let interval = c.uint_opt("no_rope_layer_interval")?.unwrap_or(4);
    if interval == 0 {
        return Err(bad(
            c.path(),
            "`no_rope_layer_interval` is 0; allowed: a whole number of at least 1",
        ));
    }
    Ok((0..layers).map(|i| (i + 1) % interval != 0).collect())
}

/// Which layers use the sliding window, as transformers decides for the family: mistral's all
/// of them (where it has a window); qwen2's, qwen3's and smollm3's those `layer_types` calls
/// `sliding_attention` (by default qwen's from `max_window_layers` on, smollm3's those without
/// RoPE), and only with `use_sliding_window`; gemma2's and gemma3's those `layer_types` calls
/// so (by default every other layer, and five of every six).
fn sliding_layers(
    c: Fields,
    family: &str,
    layers: usize,
    has_rope: &[bool],
) -> Result<Vec<bool>, RuntimeError> {
    let window = c.uint_opt("sliding_window")?.is_some();
    let use_window = c.flag("use_sliding_window")?;
    let max_window_layers = c.uint_opt("max_window_layers")?.unwrap_or(28);
    let types = c.list_opt(
        "layer_types",
        (layers, "layer"),
        |v| match v.as_str()? {
            "full_attention" => Some(false),
            "sliding_attention" => Some(true),
            _ => None,
        },
        "\"full_attention\" or \"sliding_attention\"",
    )?;
    let typed = |default: &dyn Fn(usize) -> bool| {
        let on = use_window && window;
        match &types {
            Some(t) => t.iter().map(|&s| s && on).collect(),
            None => (0..layers).map(|i| default(i) && on).collect(),
        }
    };
    // gemma2 and gemma3 slide where `layer_types` says, whatever `use_sliding_window`.
    let gemma_typed = |default: &dyn Fn(usize) -> bool| -> Vec<bool> {
        match &types {
            Some(t) => t.iter().map(|&s| s && window).collect(),
            None => (0..layers).map(|i| default(i) && window).collect(),
        }
    };
    Ok(match family {
        "mistral" | "mixtral" | "starcoder2" | "phi3" => vec![window; layers],
        "qwen2" | "qwen3" | "qwen3_moe" => typed(&|i| i >= max_window_layers),
        "qwen2_moe" => typed(&|i| (i + 1) % 2 != 0 && i < max_window_layers),
        "smollm3" => typed(&|i| !has_rope[i]),
        "gemma2" | "gpt_oss" => gemma_typed(&|i| (i + 1) % 2 != 0),
        "gemma3_text" => {
            let every = c.uint_opt("sliding_window_pattern")?.unwrap_or(6).max(1);
            gemma_typed(&|i| (i + 1) % every != 0)
        }
        _ => vec![false; layers],
    })
}

/// The weight files of a checkpoint and which tensor lives in which.
struct Files {
    by_name: HashMap<String, PathBuf>,
    single: Option<PathBuf>,
}

impl Files {
    fn of(dir: &Path) -> Result<Files, RuntimeError> {
        let index = dir.join("model.safetensors.index.json");
        // Present even as a link to nothing (a Hugging Face cache whose blob is gone): then it
        // is read, and its error names it, rather than another file being used instead.
        if std::fs::symlink_metadata(&index).is_ok() {
            let text = read_text(&index, MAX_CONFIG_BYTES, "the shard index")?;
            let json: Value = serde_json::from_str(&text)
                .map_err(|e| bad(&index, format!("not valid JSON: {e}")))?;
            let map = json
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| bad(&index, "`weight_map` is missing"))?;
            let by_name = map
                .iter()
                .map(|(name, file)| {
                    let file = file.as_str().ok_or_else(|| {
                        bad(
                            &index,
                            format!("`weight_map.{name}` is not a string; expected a file name"),
                        )
                    })?;
                    shard_path(dir, file)
                        .ok_or_else(|| {
                            bad(
                                &index,
                                format!(
                                    "`weight_map.{name}` = {file:?} is not a file name in the \
                                 checkpoint's directory; allowed: a plain name such as \
                                 model-00001-of-00002.safetensors"
                                ),
                            )
                        })
                        .map(|path| (name.clone(), path))
                })
                .collect::<Result<_, _>>()?;
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

    /// Whether the checkpoint holds a tensor `name` (the single file's header is read).
    fn holds(&self, name: &str) -> Result<bool, RuntimeError> {
        match &self.single {
            Some(file) => Ok(crate::io::tensor_names(file)?.iter().any(|n| n == name)),
            None => Ok(self.by_name.contains_key(name)),
        }
    }

    /// Reads the named tensors as stored, in order.
    fn read_raw(&self, names: &[String]) -> Result<Vec<crate::io::RawTensor>, RuntimeError> {
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            out.extend(crate::io::read_raw(&self.file_of(name)?, &[name.as_str()])?);
        }
        Ok(out)
    }

    /// The file holding tensor `name`.
    fn file_of(&self, name: &str) -> Result<PathBuf, RuntimeError> {
        match &self.single {
            Some(f) => Ok(f.clone()),
            None => self.by_name.get(name).cloned().ok_or_else(|| {
                RuntimeError::Data(format!(
                    "tensor `{name}` is not in the checkpoint's weight map"
                ))
            }),
        }
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

/// `dir/file` when `file` is one plain file name (no directories, no `..`, not absolute): a shard
/// index names files beside it, never elsewhere.
fn shard_path(dir: &Path, file: &str) -> Option<PathBuf> {
    let mut parts = Path::new(file).components();
    match (parts.next(), parts.next()) {
        (Some(std::path::Component::Normal(name)), None) => Some(dir.join(name)),
        _ => None,
    }
}

/// Loads a checkpoint directory.
pub fn load(dir: &Path) -> Result<Model, RuntimeError> {
    let mut config = config(dir)?;
    let files = Files::of(dir)?;
    let q_lora = match config.attention[0].mla() {
        Some(_) => read_q_lora(dir)?,
        None => None,
    };
    if let TensorNames::Bloom { .. } = config.tensor_names {
        let prefixed = files.holds("transformer.word_embeddings.weight")?;
        config.tensor_names = TensorNames::Bloom { prefixed };
    }
    let mut names = weights::tensor_names(&config, q_lora);
    // gpt-oss's experts packed as MXFP4 are read packed and dequantized.
    let packed: Vec<String> = match read_packed(dir)? {
        true => {
            let is_packed = |n: &String| {
                n.ends_with("mlp.experts.gate_up_proj") || n.ends_with("mlp.experts.down_proj")
            };
            let packed = names.iter().filter(|n| is_packed(n)).cloned().collect();
            names.retain(|n| !is_packed(n));
            packed
        }
        false => Vec::new(),
    };
    let mut tensors = files.read(&names)?;
    let dequantized = !packed.is_empty();
    if let Some(moe) = &config.moe {
        let (d, w) = (config.hidden, moe.intermediate);
        for name in packed {
            let parts = [format!("{name}_blocks"), format!("{name}_scales")];
            let [blocks, scales] = <[_; 2]>::try_from(files.read_raw(&parts)?)
                .map_err(|_| RuntimeError::Data("internal: two packed tensors".into()))?;
            let [cols, rows] = match name.ends_with("gate_up_proj") {
                true => [d, 2 * w],
                false => [w, d],
            };
            let t = super::mxfp4::dequantize(&name, &blocks, &scales, [moe.experts, cols, rows])?;
            tensors.insert(name, t);
        }
    }
    let tied = config.tie_embeddings;
    let head = config.tensor_names.of("lm_head.weight");
    let mut model = weights::assemble(config, tensors, q_lora, "config.json")?;
    if dequantized {
        // Held in bf16 exactly; transformers' reference multiplies them in f32.
        model.keep_expert_inputs_exact();
    }
    if tied && files.holds(&head)? {
        model.warn(format!(
            "the checkpoint holds `{head}`, but config.json ties the LM head to the embedding \
             (`tie_word_embeddings` = true): the embedding is used and `{head}` is ignored, as \
             transformers does"
        ));
    }
    Ok(model)
}

/// Whether a checkpoint stores its experts packed as MXFP4 ([`packed_experts`]).
fn read_packed(dir: &Path) -> Result<bool, RuntimeError> {
    let file = Config::read(dir)?;
    let c = file.fields()?;
    packed_experts(c, c.str_opt("model_type")?.unwrap_or_default())
}

/// The rank through which a DeepSeek checkpoint factors its queries (`q_lora_rank`), if it
/// does.
fn read_q_lora(dir: &Path) -> Result<Option<usize>, RuntimeError> {
    let file = Config::read(dir)?;
    match file.fields()?.uint_opt("q_lora_rank")? {
        None => Ok(None),
        Some(rank @ 1..=MAX_WIDTH) => Ok(Some(rank)),
        Some(rank) => Err(bad(
            &file.path,
            format!("`q_lora_rank` = {rank} is out of range; allowed: 1 to {MAX_WIDTH}"),
        )),
    }
}
