//! A checkpoint's MLP from its config keys: the activation, and the experts of mixture-of-experts\n//! families (routing, shared experts, packed MXFP4 weights).

use crate::error::RuntimeError;
use crate::model::config::{ExpertNames, MlpKind, Moe, Router, SharedExpert};
use crate::model::json_fields::{Fields, bad};

/// Whether the checkpoint stores gpt-oss's experts packed as MXFP4 (`quantization_config` with
/// `quant_method` `mxfp4`); any other quantization is an error naming it.
pub(super) fn packed_experts(c: Fields, family: &str) -> Result<bool, RuntimeError> {
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
pub(super) fn activation(c: Fields, family: &str) -> Result<MlpKind, RuntimeError> {
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
pub(super) fn experts(c: Fields, family: &str, layers: usize) -> Result<Option<Moe>, RuntimeError> {
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
            let dense = c.layer_list("mlp_only_layers")?;
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
