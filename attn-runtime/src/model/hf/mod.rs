//! Hugging Face checkpoints: `config.json` and `*.safetensors` (one file, or shards listed in
//! `model.safetensors.index.json`; f32, bf16 or f16 weights, computed in f32).
//!
//! Families: `llama` (every RoPE scaling, from `rope_parameters` or the older `rope_theta` /
//! `rope_scaling` keys), `helium` (llama's layers, interleaved RoPE, no output-projection
//! bias), `mistral` (sliding window), `qwen2` (q/k/v biases), `qwen3` (per-head
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
//!
//! Here: the families, the config's shape, attention and layer lists, and [`load`]. The RoPE
//! keys are read in `rope.rs`, the MLP and experts in `mlp.rs`, the files in `files.rs`;
//! `config.json` is read once, and the [`ModelConfig`] carries all that loading needs.

mod files;
mod mlp;
mod rope;

use files::{Config, Files};
use mlp::{activation, experts, packed_experts};
use rope::{deepseek_scale, rope, rope_of_type};

use super::Model;
use super::config::{
    MAX_LAYERS, MAX_WIDTH, MlpNames, ModelConfig, NormKind, NormPlacement, Projections, QkNorm,
    TensorNames,
};
use super::json_fields::{Fields, bad};
use super::weights;
use crate::error::RuntimeError;
use attn_dsl::{AttentionSpec, CausalAlign, KvLayout, Mask, Mla, Position, RopeLayout, Sinks};
use std::path::Path;

/// Families this loader knows.
pub const FAMILIES: &[&str] = &[
    "llama",
    "helium",
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
    let experts_mxfp4 = packed_experts(c, &family)?;
    let q_lora_rank = match attention[0].mla() {
        Some(_) => q_lora(c, path)?,
        None => None,
    };
    let mlp = activation(c, &family)?;
    // qwen2 and helium have biases on q, k and v only; elsewhere `attention_bias` puts them on
    // all four.
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
            "llama" | "helium" | "smollm3" | "granite" => c.flag("mlp_bias")?,
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
            "qwen2" | "qwen2_moe" | "helium" => false,
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
            "gemma2" => c.float_or_absent("final_logit_softcapping", Some(30.0))?,
            "gemma3_text" => c.float_opt("final_logit_softcapping")?,
            _ => None,
        },
        moe: experts(c, &family, layers)?,
        q_lora_rank,
        experts_mxfp4,
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
    // cohere and helium rotate interleaved pairs; the others rotate halves.
    let layout = match family {
        "cohere" | "helium" => RopeLayout::Interleaved,
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
        "gemma2" => c.float_or_absent("attn_logit_softcapping", Some(50.0))?,
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

/// Loads a checkpoint directory.
pub fn load(dir: &Path) -> Result<Model, RuntimeError> {
    let mut config = config(dir)?;
    let files = Files::of(dir)?;
    if let TensorNames::Bloom { .. } = config.tensor_names {
        let prefixed = files.holds("transformer.word_embeddings.weight")?;
        config.tensor_names = TensorNames::Bloom { prefixed };
    }
    let mut names = weights::tensor_names(&config);
    // gpt-oss's experts packed as MXFP4 are read packed and dequantized.
    let packed: Vec<String> = match config.experts_mxfp4 {
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
    let mut model = weights::assemble(config, tensors, "config.json")?;
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

/// The rank through which a DeepSeek checkpoint factors its queries (`q_lora_rank`), if it
/// does.
fn q_lora(c: Fields, path: &Path) -> Result<Option<usize>, RuntimeError> {
    match c.uint_opt("q_lora_rank")? {
        None => Ok(None),
        Some(rank @ 1..=MAX_WIDTH) => Ok(Some(rank)),
        Some(rank) => Err(bad(
            path,
            format!("`q_lora_rank` = {rank} is out of range; allowed: 1 to {MAX_WIDTH}"),
        )),
    }
}
