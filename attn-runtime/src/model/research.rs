//! Research models: a [`ModelConfig`] written in Rust or in a TOML file, with seeded random
//! weights, so variants can be compared at equal parameter counts.
//!
//! ```toml
//! vocab = 32000
//! hidden = 768
//! layers = 12
//! attention = "heads = 12, kv_heads = 4, head_dim = 64, mask = causal, position = rope"
//! # optional: norm = "rms" | "layer", norm_eps = 1e-5, mlp = "swiglu" | "geglu" | "gelu",
//! # norm_placement = "pre" | "sandwich" | "post" | "parallel" | "parallel_two_norms",
//! # intermediate = 2048 (default 8d/3 for SwiGLU, 4d for GELU, rounded up to 64),
//! # tie_embeddings = true, qkv_bias = false, qk_norm = "per_head" | "whole"
//! # weights = "model.safetensors": trained weights, a file beside this one (see `load`)
//! ```
//!
//! Layers that differ: `attention` is a table of named kinds, and `pattern` lists the kinds of
//! the layers, repeating (here layers 0, 1, 3, 4, ... slide and 2, 5, ... see everything):
//!
//! ```toml
//! pattern = ["local", "local", "global"]
//! [attention]
//! local = "heads = 12, head_dim = 64, mask = sliding_window(512), position = rope"
//! global = "heads = 12, head_dim = 64, mask = causal, position = rope"
//! ```
//!
//! Mixture-of-experts MLPs: a `[moe]` table (softmax routing to the top k, the chosen weights
//! renormalized unless `normalize = false`; `intermediate` each expert's width, by default the
//! model's; `shared` the width of an expert every token runs; every `every`-th layer MoE,
//! by default all):
//!
//! ```toml
//! [moe]
//! experts = 8
//! top_k = 2
//! ```

use super::config::{
    ExpertNames, MAX_LAYERS, MlpKind, MlpNames, ModelConfig, Moe, NormKind, NormPlacement,
    Projections, QkNorm, Router, SharedExpert, TensorNames,
};
use super::differential::DifferentialWeights;
use super::sublayers::{LayerMlp, Linear, Matrix, Mlp, MoeMlp, Norm};
use super::{AttentionWeights, Layer, Model};
use crate::error::RuntimeError;
use crate::files::read_text;
use crate::io::read_safetensors;
use crate::tensor::{Storage, Tensor};
use attn_dsl::AttentionSpec;
use attn_dsl::inputs::XorShift;
use std::path::{Component, Path};

/// The keys a research model's TOML may hold.
pub const KEYS: &[&str] = &[
    "vocab",
    "hidden",
    "layers",
    "attention",
    "pattern",
    "qk_norm",
    "norm",
    "norm_placement",
    "norm_eps",
    "mlp",
    "intermediate",
    "tie_embeddings",
    "qkv_bias",
    "moe",
    "weights",
];

/// The keys of a research model's `[moe]` table.
pub const MOE_KEYS: &[&str] = &[
    "experts",
    "top_k",
    "intermediate",
    "shared",
    "every",
    "normalize",
];

/// Longest research model TOML file read.
pub const MAX_TOML_BYTES: u64 = 1 << 20;

/// The default MLP width: 8d/3 for SwiGLU (the parameters of a 4d GELU MLP), 4d for GELU,
/// rounded up to a multiple of 64.
pub fn default_intermediate(mlp: MlpKind, hidden: usize) -> usize {
    // A width past the limit is refused by validation; clamped here only so the product
    // cannot overflow first.
    let hidden = hidden.min(super::config::MAX_WIDTH);
    let width = match mlp {
        kind if !kind.gated() => 4 * hidden,
        _ => (8 * hidden).div_ceil(3),
    };
    width.div_ceil(64) * 64
}

/// A model config from TOML text (see the module docs for the keys).
pub fn config_from_toml(text: &str) -> Result<ModelConfig, RuntimeError> {
    let err = |m: String| RuntimeError::Data(format!("model config: {m}"));
    let table: toml::Table = text.parse().map_err(|e| err(format!("{e}")))?;
    if let Some(k) = table.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(err(format!(
            "unknown key `{k}`; allowed: {}",
            KEYS.join(", ")
        )));
    }
    let int = |k: &str| positive_int(&table, "", k);
    let required = |k: &str| int(k)?.ok_or_else(|| err(format!("`{k}` is missing")));
    let flag = |k: &str, default: bool| -> Result<bool, RuntimeError> {
        match table.get(k) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| err(format!("`{k}` must be true or false, got {v}"))),
        }
    };
    let word = |k: &str, default: &'static str| -> Result<String, RuntimeError> {
        match table.get(k) {
            None => Ok(default.to_string()),
            Some(v) => v
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| err(format!("`{k}` must be a string, got {v}"))),
        }
    };
    let (attention, pattern) = attention_kinds(&table)?;
    let qk_norm = match table.get("qk_norm") {
        None => None,
        Some(v) if v.as_str() == Some("per_head") => Some(QkNorm::PerHead),
        Some(v) if v.as_str() == Some("whole") => Some(QkNorm::Whole),
        Some(v) => {
            return Err(err(format!(
                "`qk_norm` is {v}; allowed: \"per_head\", \"whole\""
            )));
        }
    };
    let norm = match word("norm", "rms")?.as_str() {
        "rms" => NormKind::Rms,
        "layer" => NormKind::Layer,
        other => return Err(err(format!("`norm` is `{other}`; allowed: rms, layer"))),
    };
    let mlp = match word("mlp", "swiglu")?.as_str() {
        "swiglu" => MlpKind::SwiGlu,
        "geglu" => MlpKind::GeGlu,
        "gelu" => MlpKind::Gelu,
        other => {
            return Err(err(format!(
                "`mlp` is `{other}`; allowed: swiglu, geglu, gelu"
            )));
        }
    };
    let placement = match word("norm_placement", "pre")?.as_str() {
        "pre" => NormPlacement::Pre,
        "sandwich" => NormPlacement::Sandwich,
        "post" => NormPlacement::Post,
        "parallel" => NormPlacement::Parallel,
        "parallel_two_norms" => NormPlacement::ParallelTwoNorms,
        other => {
            return Err(err(format!(
                "`norm_placement` is `{other}`; allowed: pre, sandwich, post, parallel, \
                 parallel_two_norms"
            )));
        }
    };
    let norm_eps = match table.get("norm_eps") {
        None => 1e-5,
        Some(v) => v
            .as_float()
            .filter(|&e| e.is_finite() && e > 0.0)
            .ok_or_else(|| {
                err(format!(
                    "`norm_eps` must be a finite float greater than 0, got {v}"
                ))
            })?,
    };
    let hidden = required("hidden")?;
    let layers = required("layers")?;
    if layers > MAX_LAYERS {
        return Err(err(format!(
            "`layers` = {layers} is out of range; allowed: 1 to {MAX_LAYERS}"
        )));
    }
    if pattern.len() > layers {
        return Err(err(format!(
            "`pattern` names {} layers' kinds for {layers} layers; allowed: at most {layers} (the \
             pattern repeats over the layers, so a longer one would be cut)",
            pattern.len()
        )));
    }
    let mlp_width = int("intermediate")?.unwrap_or(default_intermediate(mlp, hidden));
    let config = ModelConfig {
        vocab: required("vocab")?,
        hidden,
        layers,
        attention,
        pattern,
        context: None,
        qk_norm,
        placement,
        norm,
        norm_eps,
        mlp,
        intermediate: mlp_width,
        tie_embeddings: flag("tie_embeddings", true)?,
        qkv_bias: flag("qkv_bias", false)?,
        o_bias: false,
        norm_unit_offset: false,
        embed_multiplier: None,
        embed_norm: false,
        final_softcap: None,
        residual_multiplier: None,
        logit_multiplier: None,
        norm_bias: true,
        mlp_bias: false,
        mlp_names: MlpNames::GateUpDown,
        projections: Projections::Separate,
        tensor_names: TensorNames::Llama,
        moe: moe_of(&table, layers, mlp_width)?,
        q_lora_rank: None,
        experts_mxfp4: false,
    };
    config.validate()?;
    Ok(config)
}

/// The positive integer under `key` in `table` (whose keys are shown after `scope`), `None`
/// when absent.
fn positive_int(
    table: &toml::Table,
    scope: &str,
    key: &str,
) -> Result<Option<usize>, RuntimeError> {
    match table.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_integer()
            .and_then(|i| usize::try_from(i).ok())
            .filter(|&i| i > 0)
            .map(Some)
            .ok_or_else(|| {
                RuntimeError::Data(format!(
                    "model config: `{scope}{key}` must be a positive integer, got {v}"
                ))
            }),
    }
}

/// The `[moe]` table of a research model's TOML, for `layers` layers whose dense MLP is
/// `intermediate` wide.
fn moe_of(
    table: &toml::Table,
    layers: usize,
    intermediate: usize,
) -> Result<Option<Moe>, RuntimeError> {
    let err = |m: String| RuntimeError::Data(format!("model config: {m}"));
    let Some(value) = table.get("moe") else {
        return Ok(None);
    };
    let moe = value.as_table().ok_or_else(|| {
        err(format!(
            "`moe` must be a table ([moe] with {}), got {value}",
            MOE_KEYS.join(", ")
        ))
    })?;
    if let Some(k) = moe.keys().find(|k| !MOE_KEYS.contains(&k.as_str())) {
        return Err(err(format!(
            "unknown key `moe.{k}`; allowed: {}",
            MOE_KEYS.join(", ")
        )));
    }
    let int = |k: &str| positive_int(moe, "moe.", k);
    let required = |k: &str| int(k)?.ok_or_else(|| err(format!("`moe.{k}` is missing")));
    let every = int("every")?.unwrap_or(1);
    if every > layers {
        return Err(err(format!(
            "`moe.every` = {every} leaves no MoE layer among {layers}; allowed: 1 to {layers}"
        )));
    }
    let normalize = match moe.get("normalize") {
        None => true,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| err(format!("`moe.normalize` must be true or false, got {v}")))?,
    };
    Ok(Some(Moe {
        experts: required("experts")?,
        top_k: required("top_k")?,
        intermediate: int("intermediate")?.unwrap_or(intermediate),
        normalize,
        router: Router::Softmax,
        scale: 1.0,
        sparse: (0..layers).map(|i| (i + 1) % every == 0).collect(),
        shared: int("shared")?.map(|width| SharedExpert {
            width,
            gated: false,
        }),
        names: ExpertNames::Qwen,
    }))
}

/// A config's MoE as a research model's `[moe]` table, where it is one (softmax routing, the
/// layers every `every`-th, an ungated shared expert if any).
fn moe_table(moe: &Moe) -> Option<toml::Table> {
    let every = moe.sparse.iter().position(|&s| s)? + 1;
    let regular = moe
        .sparse
        .iter()
        .enumerate()
        .all(|(i, &s)| s == (i + 1).is_multiple_of(every));
    let research = moe.router == Router::Softmax
        && moe.scale == 1.0
        && moe.names == ExpertNames::Qwen
        && moe.shared.is_none_or(|s| !s.gated);
    if !(regular && research) {
        return None;
    }
    let mut t = toml::Table::new();
    t.insert("experts".into(), toml::Value::Integer(moe.experts as i64));
    t.insert("top_k".into(), toml::Value::Integer(moe.top_k as i64));
    t.insert(
        "intermediate".into(),
        toml::Value::Integer(moe.intermediate as i64),
    );
    t.insert("every".into(), toml::Value::Integer(every as i64));
    t.insert("normalize".into(), toml::Value::Boolean(moe.normalize));
    if let Some(s) = moe.shared {
        t.insert("shared".into(), toml::Value::Integer(s.width as i64));
    }
    Some(t)
}

/// Most characters of an attention kind's name in a research model's TOML.
const MAX_KIND_NAME: usize = 64;

/// The attention kinds and the layer pattern of a research model's TOML: one spec string
/// (every layer's), or a table of named specs with `pattern` naming a kind per layer. Kinds are
/// numbered in the order the pattern first names them.
fn attention_kinds(table: &toml::Table) -> Result<(Vec<AttentionSpec>, Vec<usize>), RuntimeError> {
    let err = |m: String| RuntimeError::Data(format!("model config: {m}"));
    let parse = |name: &str, v: &toml::Value| -> Result<AttentionSpec, RuntimeError> {
        let text = v
            .as_str()
            .ok_or_else(|| err(format!("`{name}` must be a spec string, got {v}")))?;
        text.parse().map_err(|e| err(format!("`{name}`: {e}")))
    };
    match (table.get("attention"), table.get("pattern")) {
        (None, _) => Err(err("`attention` is missing".into())),
        (Some(toml::Value::Table(kinds)), Some(pattern)) => {
            let names = pattern
                .as_array()
                .filter(|a| !a.is_empty() && a.len() <= super::config::MAX_LAYERS)
                .ok_or_else(|| {
                    err(format!(
                        "`pattern` must be a list of 1 to {} kind names, got {pattern}",
                        super::config::MAX_LAYERS
                    ))
                })?;
            let (mut order, mut specs, mut layers) = (Vec::new(), Vec::new(), Vec::new());
            for (i, name) in names.iter().enumerate() {
                let name = name.as_str().ok_or_else(|| {
                    err(format!("`pattern[{i}]` must be a kind name, got {name}"))
                })?;
                let kind = match order.iter().position(|n| n == name) {
                    Some(kind) => kind,
                    None => {
                        let spec = kinds.get(name).ok_or_else(|| {
                            let known: Vec<&str> = kinds.keys().map(String::as_str).collect();
                            err(format!(
                                "`pattern[{i}]` is `{name}`, which is not a kind of \
                                 `[attention]`; its kinds: {}",
                                known.join(", ")
                            ))
                        })?;
                        specs.push(parse(&format!("attention.{name}"), spec)?);
                        order.push(name.to_string());
                        order.len() - 1
                    }
                };
                layers.push(kind);
            }
            if let Some(unused) = kinds.keys().find(|k| !order.contains(k)) {
                return Err(err(format!(
                    "attention kind `{}` is in no layer of `pattern`",
                    unused.chars().take(MAX_KIND_NAME).collect::<String>()
                )));
            }
            Ok((specs, layers))
        }
        (Some(toml::Value::Table(_)), None) => Err(err(
            "`attention` is a table of kinds, so `pattern` must list each layer's kind".into(),
        )),
        (Some(_), Some(_)) => Err(err(
            "`pattern` needs `attention` to be a table of named kinds, e.g. [attention] \
             local = \"...\""
                .into(),
        )),
        (Some(v), None) => Ok((vec![parse("attention", v)?], vec![0])),
    }
}

/// A research model's config from its TOML file (its weights are not read).
pub fn config_from_file(path: &Path) -> Result<ModelConfig, RuntimeError> {
    let text = read_text(path, MAX_TOML_BYTES, "the model config")?;
    config_from_toml(&text).map_err(|e| in_file(path, e))
}

/// A research model from its TOML file. With `weights = "FILE"`, the weights are read from FILE,
/// a safetensors file in the TOML's folder, whose tensors have the names of a Hugging Face
/// llama checkpoint (`model.embed_tokens.weight`, `model.layers.0.self_attn.q_proj.weight`, ...;
/// LayerNorm models also a `.bias` per norm, GELU MLPs no `gate_proj`): what `attnc train`
/// writes. Without it, the weights are seeded random ones ([`Model::random`]).
pub fn load(path: &Path, seed: u64) -> Result<Model, RuntimeError> {
    let text = read_text(path, MAX_TOML_BYTES, "the model config")?;
    let config = config_from_toml(&text).map_err(|e| in_file(path, e))?;
    let Some(file) = weights_file(&text).map_err(|e| in_file(path, e))? else {
        return Model::random(&config, seed);
    };
    let folder = path.parent().unwrap_or(Path::new("."));
    let file = folder.join(file);
    let names = super::weights::tensor_names(&config);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let tensors = read_safetensors(&file, &refs)?;
    let shapes_from = path.display().to_string();
    super::weights::assemble(
        config,
        names.into_iter().zip(tensors).collect(),
        &shapes_from,
    )
}

/// A config as research model TOML, naming `weights` when given: what [`config_from_toml`]
/// and [`load`] read back. Only the research keys are written: a checkpoint's own pieces
/// (experts, multipliers, fused or renamed projections, gpt-oss's clamped SwiGLU) are not.
pub fn config_to_toml(config: &ModelConfig, weights: Option<&str>) -> String {
    let c = config;
    let norm = match c.norm {
        NormKind::Rms => "rms",
        NormKind::Layer => "layer",
    };
    let mlp = match c.mlp {
        MlpKind::SwiGlu | MlpKind::ClampedSwiGlu { .. } => "swiglu",
        MlpKind::GeGlu => "geglu",
        MlpKind::Gelu | MlpKind::GeluExact => "gelu",
    };
    let placement = match c.placement {
        NormPlacement::Pre => "pre",
        NormPlacement::Sandwich => "sandwich",
        NormPlacement::Post => "post",
        NormPlacement::Parallel => "parallel",
        NormPlacement::ParallelTwoNorms => "parallel_two_norms",
    };
    let text = toml::toml! {
        vocab = (c.vocab as i64)
        hidden = (c.hidden as i64)
        layers = (c.layers as i64)
        norm = norm
        norm_placement = placement
        norm_eps = (c.norm_eps)
        mlp = mlp
        intermediate = (c.intermediate as i64)
        tie_embeddings = (c.tie_embeddings)
        qkv_bias = (c.qkv_bias)
    };
    let mut table = text;
    match c.single_attention() {
        Some(spec) => {
            table.insert("attention".into(), toml::Value::String(spec.to_string()));
        }
        None => {
            let name = |kind: usize| format!("kind{kind}");
            let kinds = c
                .attention
                .iter()
                .enumerate()
                .map(|(k, spec)| (name(k), toml::Value::String(spec.to_string())))
                .collect();
            let pattern = c.pattern.iter().map(|&k| toml::Value::String(name(k)));
            table.insert("attention".into(), toml::Value::Table(kinds));
            table.insert("pattern".into(), toml::Value::Array(pattern.collect()));
        }
    }
    // Cohere's per-head LayerNorms are a checkpoint's own piece, not written.
    let qk_name = match c.qk_norm {
        Some(QkNorm::PerHead) => Some("per_head"),
        Some(QkNorm::Whole) => Some("whole"),
        Some(QkNorm::PerHeadLayer) | None => None,
    };
    if let Some(name) = qk_name {
        table.insert("qk_norm".into(), toml::Value::String(name.into()));
    }
    if let Some(moe) = c.moe.as_ref().and_then(moe_table) {
        table.insert("moe".into(), toml::Value::Table(moe));
    }
    if let Some(w) = weights {
        table.insert("weights".into(), toml::Value::String(w.to_string()));
    }
    table.to_string()
}

/// A research model's TOML text with its `weights` key set to `weights` (or removed when
/// `None`), everything else as written: kind names, key order and values (comments are not
/// kept). The text must parse as TOML.
pub fn with_weights(text: &str, weights: Option<&str>) -> Result<String, RuntimeError> {
    let mut table: toml::Table = text
        .parse()
        .map_err(|e| RuntimeError::Data(format!("model config: {e}")))?;
    table.remove("weights");
    if let Some(w) = weights {
        table.insert("weights".into(), toml::Value::String(w.to_string()));
    }
    Ok(table.to_string())
}

/// `path`'s name in front of a config error.
fn in_file(path: &Path, e: RuntimeError) -> RuntimeError {
    RuntimeError::Data(format!("{}: {e}", path.display()))
}

/// The `weights` key of a research model's TOML: a plain file name (no folders), if given.
pub fn weights_file(text: &str) -> Result<Option<String>, RuntimeError> {
    let err = |m: String| RuntimeError::Data(format!("model config: {m}"));
    let table: toml::Table = text.parse().map_err(|e| err(format!("{e}")))?;
    let Some(value) = table.get("weights") else {
        return Ok(None);
    };
    let name = value
        .as_str()
        .ok_or_else(|| err(format!("`weights` must be a string, got {value}")))?;
    let mut parts = Path::new(name).components();
    match (parts.next(), parts.next()) {
        (Some(Component::Normal(_)), None) => Ok(Some(name.to_string())),
        _ => Err(err(format!(
            "`weights` = {name:?} is not a file name; allowed: a plain name of a file beside \
             the TOML, such as model.safetensors"
        ))),
    }
}

/// Seeded uniform values with standard deviation 0.02 (GPT-2's init scale).
struct Init(XorShift);

impl Init {
    fn values(&mut self, n: usize) -> Vec<f32> {
        let a = 0.02 * 3f32.sqrt();
        (0..n).map(|_| self.0.next_f32() * a).collect()
    }

    fn matrix(&mut self, rows: usize, cols: usize) -> Matrix {
        Matrix::new(rows, cols, Storage::F32(self.values(rows * cols).into()))
    }

    fn linear(&mut self, out: usize, inp: usize, bias: bool) -> Linear {
        Linear {
            w: self.matrix(out, inp),
            bias: bias.then(|| vec![0.0; out]),
        }
    }
}

impl Model {
    /// A model with seeded random weights (uniform, standard deviation 0.02; norms at 1).
    pub fn random(config: &ModelConfig, seed: u64) -> Result<Model, RuntimeError> {
        config.validate()?;
        crate::memory::ensure_fits(
            "the model's weights",
            config.weight_count().and_then(|n| n.checked_mul(4)),
        )?;
        let c = config;
        let mut init = Init(XorShift::new(seed));
        let norm = |n: usize| Norm {
            kind: c.norm,
            weight: vec![1.0; n],
            bias: (c.norm == NormKind::Layer && c.norm_bias).then(|| vec![0.0; n]),
            eps: c.norm_eps,
            groups: 1,
        };
        let layers = (0..c.layers)
            .map(|i| {
                let spec = c.layer_attention(i);
                let (heads, d, dv) = (
                    spec.heads as usize,
                    spec.head_dim as usize,
                    spec.v_head_dim as usize,
                );
                let attn = match spec.mla() {
                    Some(m) => {
                        let (r, dr) = (m.latent_rank as usize, m.rope_dim as usize);
                        let w = init.values(heads * (d + dv) * r);
                        Ok::<_, RuntimeError>(AttentionWeights::Mla {
                            q: init.linear(heads * (d + dr), c.hidden, false),
                            q_b: None,
                            kv_a: init.linear(r + dr, c.hidden, false),
                            kv_norm: norm(r),
                            w_kv_b: Tensor::from_f32_as(spec.dtype, &[heads * (d + dv), r], w)?,
                            o: init.linear(c.hidden, heads * dv, false),
                        })
                    }
                    None => {
                        let hkv = spec.kv_heads() as usize;
                        let (hv, ho) = (spec.value_heads() as usize, spec.output_heads() as usize);
                        Ok(AttentionWeights::Heads {
                            q: init.linear(heads * d, c.hidden, c.qkv_bias),
                            k: init.linear(hkv * d, c.hidden, c.qkv_bias),
                            v: init.linear(hv * dv, c.hidden, c.qkv_bias),
                            o: init.linear(c.hidden, ho * dv, c.o_bias),
                            // lambda's vectors as the paper draws them, N(0, 0.1).
                            differential: match spec.differential {
                                Some(diff) => {
                                    let v = spec.lambda_initial_values(i as u64);
                                    let rms = Norm {
                                        kind: NormKind::Rms,
                                        bias: None,
                                        ..norm(dv)
                                    };
                                    let [a, b, c2, e] = [0, 1, 2, 3].map(|j| v[j].2.as_slice());
                                    Some(DifferentialWeights::new(
                                        [a, b, c2, e],
                                        diff.lambda_init,
                                        rms,
                                    )?)
                                }
                                None => None,
                            },
                            qk_norm: c.qk_norm.map(|qk| match qk {
                                // RMSNorm whatever the model's norm kind (as qwen3, olmo2).
                                QkNorm::PerHead | QkNorm::Whole => {
                                    let [q, k] = match qk {
                                        QkNorm::PerHead => [d, d],
                                        _ => [heads * d, hkv * d],
                                    };
                                    [q, k].map(|n| Norm {
                                        kind: NormKind::Rms,
                                        bias: None,
                                        ..norm(n)
                                    })
                                }
                                // A bias-free LayerNorm per head, each its own weights (cohere).
                                QkNorm::PerHeadLayer => [heads, hkv].map(|h| Norm {
                                    kind: NormKind::Layer,
                                    bias: None,
                                    groups: h,
                                    ..norm(h * d)
                                }),
                            }),
                            // Learnable tensors start at 0 (a sink of weight exp(0)).
                            learned: spec
                                .learnable_tensors()
                                .into_iter()
                                .map(|(name, shape)| {
                                    let n = shape.iter().product();
                                    Ok((name, Tensor::from_f32(&shape, vec![0.0; n])?))
                                })
                                .collect::<Result<_, RuntimeError>>()?,
                        })
                    }
                }?;
                let bias = c.mlp_bias;
                let mut mlp = |width: usize| Mlp {
                    kind: c.mlp,
                    gate: c.mlp.gated().then(|| init.linear(width, c.hidden, bias)),
                    up: init.linear(width, c.hidden, bias),
                    down: init.linear(c.hidden, width, bias),
                };
                let mlp = match c.moe.as_ref().filter(|m| m.sparse[i]) {
                    Some(moe) => {
                        let experts = (0..moe.experts).map(|_| mlp(moe.intermediate)).collect();
                        let shared = moe.shared.map(|s| (s.gated, mlp(s.width)));
                        LayerMlp::Moe(Box::new(MoeMlp {
                            experts,
                            shared: shared.map(|(gated, m)| {
                                (m, gated.then(|| init.linear(1, c.hidden, false)))
                            }),
                            router: init.linear(moe.experts, c.hidden, false),
                            top_k: moe.top_k,
                            normalize: moe.normalize,
                            router_kind: moe.router,
                            correction: match moe.router {
                                Router::SigmoidGroups { .. } => vec![0.0; moe.experts],
                                _ => Vec::new(),
                            },
                            scale: moe.scale as f32,
                        }))
                    }
                    None => LayerMlp::Dense(Box::new(mlp(c.intermediate))),
                };
                // The norms the placement has, where a checkpoint has them.
                let [attn_norm, post_attn_norm, mlp_norm, post_mlp_norm] = c
                    .placement
                    .norm_names()
                    .map(|name| name.map(|_| norm(c.hidden)));
                Ok(Layer {
                    attn_norm,
                    attn,
                    post_attn_norm,
                    mlp_norm,
                    mlp,
                    post_mlp_norm,
                })
            })
            .collect::<Result<Vec<_>, RuntimeError>>()?;
        let embed = init.matrix(c.vocab, c.hidden);
        let lm_head = (!c.tie_embeddings).then(|| init.linear(c.vocab, c.hidden, false));
        Model::new(config.clone(), embed, layers, norm(c.hidden), lm_head)
    }
}
