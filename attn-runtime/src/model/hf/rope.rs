//! A checkpoint's RoPE from its config keys: `rope_parameters` or the older `rope_theta` /\n//! `rope_scaling`, every scaling (linear, dynamic NTK, YaRN, Llama 3, LongRoPE), per layer type\n//! where the config has them.

use crate::error::RuntimeError;
use crate::model::json_fields::{Fields, bad};
use attn_dsl::{LongRope, Rope, RopeLayout, RopeScaling, Yarn};

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
pub(super) fn deepseek_scale(c: Fields, qk_dim: usize) -> Result<f64, RuntimeError> {
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
pub(super) fn rope(c: Fields, dim: usize, layout: RopeLayout) -> Result<Rope, RuntimeError> {
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
pub(super) fn rope_of_type(
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
        xpos: None,
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
