//! What a model is made of: widths, layer count, norms, MLP and the attention spec.

use crate::error::RuntimeError;
pub use crate::ops::{MlpKind, NormKind};
use attn_dsl::AttentionSpec;

/// A decoder-only transformer: token embedding, `layers` blocks (attention and MLP, each with
/// its norms as `placement` says, and a residual add), a final norm and the LM head. Layers may
/// differ in their attention: each has one of the config's attention kinds, as `pattern` says.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// Residual stream width.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// The attention of each kind of layer (at least one, at most [`MAX_KINDS`]; each used by
    /// some layer). Layers of one kind share its compiled kernels.
    pub attention: Vec<AttentionSpec>,
    /// The kind of each layer, repeating: layer `i` has `attention[pattern[i % pattern.len()]]`.
    pub pattern: Vec<usize>,
    /// The most positions the model was made for, where its checkpoint says
    /// (`max_position_embeddings`); `None` for research models.
    pub context: Option<usize>,
    /// Norms on the queries and keys before RoPE (RMSNorm, with the model's epsilon).
    pub qk_norm: Option<QkNorm>,
    /// Where the norms sit around each sublayer.
    pub placement: NormPlacement,
    /// Norm layers.
    pub norm: NormKind,
    /// Norm epsilon.
    pub norm_eps: f64,
    /// Norm weights (the q/k norms' too) are stored as offsets from 1: a norm multiplies by
    /// `1 + w` (gemma). Loading adds the 1.
    pub norm_unit_offset: bool,
    /// MLP block.
    pub mlp: MlpKind,
    /// MLP hidden width.
    pub intermediate: usize,
    /// Biases on the MLP's projections (starcoder2), experts' included.
    pub mlp_bias: bool,
    /// How the checkpoint names the dense MLP's projections.
    pub mlp_names: MlpNames,
    /// How the checkpoint stores the q, k, v and MLP projections; loading splits fused ones.
    pub projections: Projections,
    /// The checkpoint's naming scheme.
    pub tensor_names: TensorNames,
    /// The LM head is the token embedding.
    pub tie_embeddings: bool,
    /// Biases on the q, k and v projections (Qwen2).
    pub qkv_bias: bool,
    /// A bias on the attention's output projection (`attention_bias` in llama-like families).
    pub o_bias: bool,
    /// The token embedding's rows times this, before the first layer (gemma: `sqrt(hidden)`,
    /// rounded to the embedding's dtype as transformers does).
    pub embed_multiplier: Option<f64>,
    /// A norm on the embedded rows before the first layer (bloom's
    /// `word_embeddings_layernorm`), of the model's norm kind.
    pub embed_norm: bool,
    /// Logits become `c tanh(logits / c)` (gemma2's `final_logit_softcapping`).
    pub final_softcap: Option<f64>,
    /// Each sublayer's output times this before the residual add (granite).
    pub residual_multiplier: Option<f64>,
    /// Logits times this (cohere's `logit_scale`; granite's `1 / logits_scaling`).
    pub logit_multiplier: Option<f64>,
    /// LayerNorms have a bias (`.bias` beside each `.weight`); RMSNorms never do.
    pub norm_bias: bool,
    /// Mixture-of-experts MLPs, in the layers it names.
    pub moe: Option<Moe>,
    /// The rank through which MLA queries are factored (DeepSeek's `q_lora_rank`: `q_a_proj`,
    /// a norm, `q_b_proj`); `None` where the queries are one projection.
    pub q_lora_rank: Option<usize>,
    /// The experts' weights are stored packed as MXFP4 blocks and scales (gpt-oss), read packed
    /// and dequantized to bf16 values at load.
    pub experts_mxfp4: bool,
}

/// Mixture-of-experts MLPs: a router picks `top_k` of `experts` MLPs (each of the model's MLP
/// kind, `intermediate` wide) per token from its logits, as `router` says; the token's output is
/// the chosen experts' outputs weighted by their scores (renormalized to sum to 1 where
/// `normalize`, then times `scale`), plus a shared expert's where there is one. Each expert
/// runs only on the tokens routed to it.
#[derive(Clone, Debug, PartialEq)]
pub struct Moe {
    /// Experts per MoE layer.
    pub experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Each expert's MLP width.
    pub intermediate: usize,
    /// The chosen experts' weights are divided by their sum.
    pub normalize: bool,
    /// How the router scores and chooses experts.
    pub router: Router,
    /// The chosen experts' weights times this (DeepSeek's `routed_scaling_factor`; 1 elsewhere).
    pub scale: f64,
    /// Which layers are MoE (one entry per layer); the others have the dense MLP.
    pub sparse: Vec<bool>,
    /// A shared expert every token runs, added to the routed experts' output.
    pub shared: Option<SharedExpert>,
    /// The checkpoint's names for the router and the experts.
    pub names: ExpertNames,
}

/// How a MoE router scores the experts and chooses among them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Router {
    /// Softmax of the logits; the top k (mixtral, qwen, DeepSeek-V2's `greedy`).
    Softmax,
    /// The top k logits (the router has a bias), then the softmax of those k (gpt-oss).
    TopKSoftmax,
    /// Softmax; the top k among the experts of the `topk_group` groups (of `groups` equal ones)
    /// whose best score is highest (DeepSeek-V2's `group_limited_greedy`).
    SoftmaxGroups {
        /// Groups the experts fall into, in order.
        groups: usize,
        /// Groups chosen.
        topk_group: usize,
    },
    /// Sigmoid of the logits; experts chosen by score plus a learned correction bias
    /// (`e_score_correction_bias`), the top k among the `topk_group` groups whose two best
    /// biased scores sum highest; weighted by their unbiased scores (DeepSeek-V3).
    SigmoidGroups {
        /// Groups the experts fall into, in order.
        groups: usize,
        /// Groups chosen.
        topk_group: usize,
    },
}

/// A MoE layer's shared expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedExpert {
    /// Its MLP width.
    pub width: usize,
    /// Its output is scaled by `sigmoid(shared_expert_gate(x))` (qwen2_moe); else added as it
    /// is (DeepSeek).
    pub gated: bool,
}

/// How a checkpoint names a MoE layer's tensors (`model.layers.{i}.` then these).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertNames {
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.{j}.w1` (gate), `w3` (up), `w2`
    /// (down): mixtral.
    Mixtral,
    /// `mlp.gate`, `mlp.experts.{j}.gate_proj`, `up_proj`, `down_proj`: qwen2_moe, qwen3_moe
    /// (a shared expert `mlp.shared_expert`, its gate `mlp.shared_expert_gate`), DeepSeek (shared
    /// experts `mlp.shared_experts`, a correction bias `mlp.gate.e_score_correction_bias`).
    Qwen,
    /// `mlp.router` (with a bias), and every expert in three-dimensional tensors:
    /// `mlp.experts.gate_up_proj` `[experts, hidden, 2 width]` (gate and up columns
    /// interleaved) with `gate_up_proj_bias`, `mlp.experts.down_proj` `[experts, width,
    /// hidden]` with `down_proj_bias`: gpt-oss.
    GptOss,
}

/// How a checkpoint stores the q, k and v projections (and the MLP's gate and up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Projections {
    /// Each its own tensor (llama and most families).
    Separate,
    /// `self_attn.qkv_proj` (all of q's rows, then k's, then v's) and `mlp.gate_up_proj` (gate
    /// rows, then up rows): phi3.
    Fused,
    /// One q, k, v tensor whose rows go head by head, q, k and v of each in turn: gpt_neox's
    /// `attention.query_key_value`.
    FusedPerHead,
}

/// A checkpoint's naming scheme for its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorNames {
    /// `model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`, `lm_head`, ...: llama and
    /// most families (the names this crate uses inside).
    Llama,
    /// `gpt_neox.embed_in`, `gpt_neox.layers.{i}.attention.query_key_value`, `.dense`,
    /// `mlp.dense_h_to_4h`, `mlp.dense_4h_to_h`, `gpt_neox.final_layer_norm`, `embed_out`.
    GptNeox,
    /// `transformer.word_embeddings`, `transformer.word_embeddings_layernorm`,
    /// `transformer.h.{i}.self_attention.query_key_value`, `.dense`, `mlp.dense_h_to_4h`,
    /// `mlp.dense_4h_to_h`, `transformer.ln_f` (bloom); without the `transformer.` prefix when
    /// `prefixed` is false (checkpoints saved from the bare `BloomModel`).
    Bloom {
        /// The names start with `transformer.`.
        prefixed: bool,
    },
}

impl TensorNames {
    /// The checkpoint's name for the tensor this crate calls `name` (a llama name).
    pub fn of(self, name: &str) -> String {
        match self {
            TensorNames::Llama => name.to_string(),
            TensorNames::GptNeox => {
                let renames = [
                    ("model.embed_tokens.", "gpt_neox.embed_in."),
                    ("model.norm.", "gpt_neox.final_layer_norm."),
                    ("lm_head.", "embed_out."),
                    ("model.layers.", "gpt_neox.layers."),
                    (".self_attn.qkv_proj.", ".attention.query_key_value."),
                    (".self_attn.o_proj.", ".attention.dense."),
                    (".mlp.up_proj.", ".mlp.dense_h_to_4h."),
                    (".mlp.down_proj.", ".mlp.dense_4h_to_h."),
                ];
                renames
                    .iter()
                    .fold(name.to_string(), |n, (from, to)| n.replacen(from, to, 1))
            }
            TensorNames::Bloom { prefixed } => {
                let renames = [
                    ("model.embed_tokens.", "transformer.word_embeddings."),
                    (
                        "model.embed_norm.",
                        "transformer.word_embeddings_layernorm.",
                    ),
                    ("model.norm.", "transformer.ln_f."),
                    ("model.layers.", "transformer.h."),
                    (".self_attn.qkv_proj.", ".self_attention.query_key_value."),
                    (".self_attn.o_proj.", ".self_attention.dense."),
                    (".mlp.up_proj.", ".mlp.dense_h_to_4h."),
                    (".mlp.down_proj.", ".mlp.dense_4h_to_h."),
                ];
                let n = renames
                    .iter()
                    .fold(name.to_string(), |n, (from, to)| n.replacen(from, to, 1));
                match n.strip_prefix("transformer.") {
                    Some(bare) if !prefixed => bare.to_string(),
                    _ => n,
                }
            }
        }
    }
}

/// How a checkpoint names a dense MLP's projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpNames {
    /// `mlp.gate_proj`, `mlp.up_proj`, `mlp.down_proj` (llama and most families).
    GateUpDown,
    /// `mlp.c_fc` (up), `mlp.c_proj` (down), no gate (starcoder2).
    FcProj,
}

impl MlpNames {
    /// Layer `i`'s gate, up and down projections (no `.weight`); the gate is named even where
    /// the MLP has none.
    pub fn prefixes(self, i: usize) -> [String; 3] {
        let names = match self {
            MlpNames::GateUpDown => ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
            MlpNames::FcProj => ["mlp.c_gate", "mlp.c_fc", "mlp.c_proj"],
        };
        names.map(|n| format!("model.layers.{i}.{n}"))
    }
}

/// Most experts a MoE layer may have.
pub const MAX_EXPERTS: usize = 1024;

impl Moe {
    /// Layer `i`'s shared expert's gate, up and down projections and its gate's linear map
    /// (no `.weight`), where the layer has one.
    pub fn shared_prefixes(&self, i: usize) -> Option<([String; 3], Option<String>)> {
        let shared = self.shared?;
        let p = match shared.gated {
            true => format!("model.layers.{i}.mlp.shared_expert"),
            false => format!("model.layers.{i}.mlp.shared_experts"),
        };
        Some((
            ["gate_proj", "up_proj", "down_proj"].map(|n| format!("{p}.{n}")),
            shared.gated.then(|| format!("{p}_gate")),
        ))
    }

    /// The router's and experts' tensor names of layer `i` (`model.layers.{i}.` prefix): the
    /// router, then each expert's gate, up and down projections (no `.weight`).
    pub fn tensor_prefixes(&self, i: usize) -> (String, Vec<[String; 3]>) {
        let p = format!("model.layers.{i}.");
        let (router, expert) = match self.names {
            ExpertNames::Mixtral => ("block_sparse_moe.gate", "block_sparse_moe.experts"),
            ExpertNames::Qwen => ("mlp.gate", "mlp.experts"),
            ExpertNames::GptOss => ("mlp.router", "mlp.experts"),
        };
        let [gate, up, down] = match self.names {
            ExpertNames::Mixtral => ["w1", "w3", "w2"],
            ExpertNames::Qwen | ExpertNames::GptOss => ["gate_proj", "up_proj", "down_proj"],
        };
        let experts = (0..self.experts)
            .map(|j| [gate, up, down].map(|n| format!("{p}{expert}.{j}.{n}")))
            .collect();
        (format!("{p}{router}"), experts)
    }

    /// Checks the counts against a model of `layers` layers.
    fn validate(&self, layers: usize) -> Result<(), RuntimeError> {
        let err = |m: String| Err(RuntimeError::Data(format!("model config: {m}")));
        if !(1..=MAX_EXPERTS).contains(&self.experts) {
            return err(format!(
                "an expert count of {}; allowed: 1 to {MAX_EXPERTS}",
                self.experts
            ));
        }
        if !(1..=self.experts).contains(&self.top_k) {
            return err(format!(
                "{} experts per token (top-k) with {} experts; allowed: 1 to {}",
                self.top_k, self.experts, self.experts
            ));
        }
        if !(1..=MAX_INTERMEDIATE).contains(&self.intermediate) {
            return err(format!(
                "an expert MLP width of {}; allowed: 1 to {MAX_INTERMEDIATE}",
                self.intermediate
            ));
        }
        if let Router::SoftmaxGroups { groups, topk_group }
        | Router::SigmoidGroups { groups, topk_group } = self.router
        {
            let per_group = self.experts / groups.max(1);
            if groups == 0 || !self.experts.is_multiple_of(groups) {
                return err(format!(
                    "{groups} expert groups for {} experts; allowed: a divisor of the expert count",
                    self.experts
                ));
            }
            if !(1..=groups).contains(&topk_group) || topk_group * per_group < self.top_k {
                return err(format!(
                    "{topk_group} chosen groups of {per_group} experts for a top-k of {}; \
                     allowed: 1 to {groups} groups holding at least top-k experts",
                    self.top_k
                ));
            }
        }
        // The scale multiplies f32 activations: one past f32's range makes every output
        // infinite, then NaN.
        if !(self.scale > 0.0 && self.scale <= f64::from(f32::MAX)) {
            return err(format!(
                "a routed scaling factor of {:e}; allowed: a number above 0 that f32 holds (at \
                 most {:e})",
                self.scale,
                f32::MAX
            ));
        }
        if let Some(width) = self.shared.map(|s| s.width)
            && !(1..=MAX_INTERMEDIATE).contains(&width)
        {
            return err(format!(
                "a shared expert MLP width of {width}; allowed: 1 to {MAX_INTERMEDIATE}"
            ));
        }
        if self.sparse.len() != layers {
            return err(format!(
                "MoE layers are listed for {} layers; the model has {layers}",
                self.sparse.len()
            ));
        }
        Ok(())
    }
}

/// Where a layer's norms sit (each norm over the residual width, of the model's kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormPlacement {
    /// `x += attn(norm(x))`, `x += mlp(norm(x))` (llama and most families).
    Pre,
    /// `x += norm(attn(norm(x)))`, `x += norm(mlp(norm(x)))` (gemma2, gemma3).
    Sandwich,
    /// `x += norm(attn(x))`, `x += norm(mlp(x))` (olmo2).
    Post,
    /// `h = norm(x)`, `x += attn(h) + mlp(h)`: attention and MLP side by side on one norm
    /// (cohere).
    Parallel,
    /// `x += attn(norm1(x)) + mlp(norm2(x))`: side by side, each with its own norm (gpt_neox).
    ParallelTwoNorms,
}

impl NormPlacement {
    /// Whether a sublayer's input is normed.
    pub fn before(self) -> bool {
        self != NormPlacement::Post
    }

    /// Whether attention and MLP read the same stream and add to it together.
    pub fn parallel(self) -> bool {
        matches!(
            self,
            NormPlacement::Parallel | NormPlacement::ParallelTwoNorms
        )
    }

    /// Whether a sublayer's output is normed before the residual add.
    pub fn after(self) -> bool {
        matches!(self, NormPlacement::Sandwich | NormPlacement::Post)
    }

    /// A layer's norms in Hugging Face's names: before attention, after it, before the MLP,
    /// after it (`None` where this placement has none). A pre-norm model's MLP norm is its
    /// `post_attention_layernorm`; a sandwich model's is `pre_feedforward_layernorm`.
    pub fn norm_names(self) -> [Option<&'static str>; 4] {
        let mlp_before = match self {
            NormPlacement::Pre | NormPlacement::ParallelTwoNorms => {
                Some("post_attention_layernorm")
            }
            // The attention's norm serves the MLP too.
            NormPlacement::Parallel => None,
            _ => Some("pre_feedforward_layernorm"),
        };
        let (before, after) = (self.before(), self.after());
        [
            before.then_some("input_layernorm"),
            after.then_some("post_attention_layernorm"),
            mlp_before.filter(|_| before),
            after.then_some("post_feedforward_layernorm"),
        ]
    }
}

/// Where a model normalizes its queries and keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    /// Each head's `head_dim` values, one weight of `[head_dim]` shared by the heads (qwen3,
    /// gemma3): `self_attn.q_norm.weight` and `self_attn.k_norm.weight`.
    PerHead,
    /// The whole projection, `[heads * head_dim]` and `[kv_heads * head_dim]` weights (olmo2).
    Whole,
    /// Each head's `head_dim` values by a LayerNorm without bias, each head with its own
    /// weights: `[heads, head_dim]` and `[kv_heads, head_dim]` (cohere's `use_qk_norm`).
    PerHeadLayer,
}

/// Most attention kinds a config may have.
pub const MAX_KINDS: usize = 64;

/// Largest residual width a config may have.
pub const MAX_WIDTH: usize = 1 << 20;
/// Largest MLP width a config may have.
pub const MAX_INTERMEDIATE: usize = 1 << 22;
/// Largest vocabulary a config may have.
pub const MAX_VOCAB: usize = 1 << 24;
/// Most decoder layers a config may have.
pub const MAX_LAYERS: usize = 4096;

impl ModelConfig {
    /// Checks every field: counts from 1 to their limits, a finite positive norm epsilon and a
    /// valid attention spec. The error names the field, its value and what is allowed.
    pub fn validate(&self) -> Result<(), RuntimeError> {
        let range = |field: &str, value: usize, max: usize| {
            if (1..=max).contains(&value) {
                Ok(())
            } else {
                Err(RuntimeError::Data(format!(
                    "model config: `{field}` = {value} is out of range; allowed: 1 to {max}"
                )))
            }
        };
        range("vocab", self.vocab, MAX_VOCAB)?;
        range("hidden", self.hidden, MAX_WIDTH)?;
        range("layers", self.layers, MAX_LAYERS)?;
        range("intermediate", self.intermediate, MAX_INTERMEDIATE)?;
        if let Some(rank) = self.q_lora_rank {
            range("q_lora_rank", rank, MAX_WIDTH)?;
            if self.attention.iter().any(|a| a.mla().is_none()) {
                return Err(RuntimeError::Data(
                    "model config: `q_lora_rank` factors MLA queries, but an attention kind is \
                     not MLA"
                        .into(),
                ));
            }
        }
        for (field, value) in [
            ("embed_multiplier", self.embed_multiplier),
            ("final_softcap", self.final_softcap),
            ("residual_multiplier", self.residual_multiplier),
            ("logit_multiplier", self.logit_multiplier),
        ] {
            if let Some(v) = value
                && !(v.is_finite() && v > 0.0)
            {
                return Err(RuntimeError::Data(format!(
                    "model config: `{field}` = {v} is invalid; allowed: a finite number greater \
                     than 0"
                )));
            }
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(RuntimeError::Data(format!(
                "model config: `norm_eps` = {} is invalid; allowed: a finite number greater \
                 than 0",
                self.norm_eps
            )));
        }
        self.check_kinds()?;
        if self.projections == Projections::Fused && !self.mlp.gated() {
            return Err(RuntimeError::Data(
                "model config: fused `gate_up_proj` needs a gated MLP (swiglu or geglu)".into(),
            ));
        }
        if let MlpKind::ClampedSwiGlu { alpha, limit } = self.mlp
            && !(alpha.is_finite() && limit.is_finite() && limit > 0.0)
        {
            return Err(RuntimeError::Data(format!(
                "model config: a clamped SwiGLU with swiglu_alpha = {alpha} and swiglu_limit = \
                 {limit}; allowed: a finite alpha and a finite limit above 0"
            )));
        }
        if let Some(moe) = &self.moe {
            moe.validate(self.layers)?;
        }
        for spec in &self.attention {
            crate::error::check_spec(spec)?;
            if spec.differential.is_some() && self.projections != Projections::Separate {
                return Err(RuntimeError::Data(
                    "model config: differential heads need separate q, k and v projections".into(),
                ));
            }
            if self.qk_norm.is_some() && spec.mla().is_some() {
                return Err(RuntimeError::Data(
                    "model config: norms on q and k (`qk_norm`) with MLA attention are not \
                     supported"
                        .into(),
                ));
            }
        }
        Ok(())
    }

    /// The attention of layer `i`.
    pub fn layer_attention(&self, i: usize) -> &AttentionSpec {
        &self.attention[self.kind_of(i)]
    }

    /// The attention kind of layer `i` (an index into `attention`).
    pub fn kind_of(&self, i: usize) -> usize {
        self.pattern[i % self.pattern.len()]
    }

    /// The one attention of every layer, when the layers do not differ.
    pub fn single_attention(&self) -> Option<&AttentionSpec> {
        match self.attention.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }

    /// The attention in words: the one spec of every layer, or each kind's spec and the
    /// pattern of kinds (`kinds 0 0 1: 0 = ..., 1 = ...`).
    pub fn attention_summary(&self) -> String {
        if let Some(spec) = self.single_attention() {
            return spec.to_string();
        }
        let pattern: Vec<String> = self.pattern.iter().map(ToString::to_string).collect();
        let kinds: Vec<String> = self
            .attention
            .iter()
            .enumerate()
            .map(|(k, spec)| format!("{k} = `{spec}`"))
            .collect();
        format!(
            "layer kinds {} (repeating): {}",
            pattern.join(" "),
            kinds.join("; ")
        )
    }

    /// The kinds and the pattern: kinds 1 to [`MAX_KINDS`], a pattern of 1 to [`MAX_LAYERS`]
    /// entries, each naming a kind, and every kind some layer's.
    fn check_kinds(&self) -> Result<(), RuntimeError> {
        let err = |m: String| Err(RuntimeError::Data(format!("model config: {m}")));
        let kinds = self.attention.len();
        if !(1..=MAX_KINDS).contains(&kinds) {
            return err(format!(
                "{kinds} attention kinds; allowed: 1 to {MAX_KINDS}"
            ));
        }
        if !(1..=MAX_LAYERS).contains(&self.pattern.len()) {
            return err(format!(
                "a layer pattern of {} entries; allowed: 1 to {MAX_LAYERS}",
                self.pattern.len()
            ));
        }
        if let Some((i, k)) = self.pattern.iter().enumerate().find(|(_, k)| **k >= kinds) {
            return err(format!(
                "layer pattern entry {i} is kind {k}; there are {kinds} kinds (0 to {})",
                kinds - 1
            ));
        }
        let used = |kind: usize| (0..self.layers.min(MAX_LAYERS)).any(|i| self.kind_of(i) == kind);
        if let Some(kind) = (0..kinds).find(|&k| !used(k)) {
            return err(format!(
                "attention kind {kind} (`{}`) is used by no layer",
                self.attention[kind]
            ));
        }
        Ok(())
    }

    /// The number of weights (biases and norms included) a model of this config holds,
    /// counted without overflow; `None` when it does not fit in 64 bits. DeepSeek's optional
    /// low-rank query factoring is not counted (the checkpoint's files bound that one).
    pub fn weight_count(&self) -> Option<u64> {
        self.parameters()?
            .iter()
            .try_fold(0u64, |sum, (_, n)| sum.checked_add(*n))
    }

    /// The weights by part, as [`super::Model::parameters`] counts a model's: the embedding,
    /// the attention, the MLPs and the norms summed over layers, and the LM head (0 when
    /// tied); `None` past 64 bits. Counted from the config alone, without making the weights.
    pub fn parameters(&self) -> Option<Vec<(&'static str, u64)>> {
        let [d, vocab] = [self.hidden, self.vocab].map(|v| v as u64);
        let norm = if self.norm == NormKind::Layer && self.norm_bias {
            2 * d
        } else {
            d
        };
        let norms = self.placement.norm_names().iter().flatten().count() as u64;
        let (mut attention, mut mlp) = (0u64, 0u64);
        for i in 0..self.layers {
            // In a validated config every product fits easily (widths below 2^20, vocabularies
            // below 2^24, MLP widths below 2^22, heads and head dims below 2^11); the sums are
            // checked all the same.
            attention = attention.checked_add(self.attention_weights(self.layer_attention(i)))?;
            mlp = mlp.checked_add(self.mlp_weights(i))?;
        }
        let layer_norms = (self.layers as u64).checked_mul(norms * norm)?;
        let embed_norm = if self.embed_norm { norm } else { 0 };
        Some(vec![
            ("embedding", vocab * d),
            ("attention", attention),
            ("mlp", mlp),
            ("norms", layer_norms.checked_add(norm + embed_norm)?),
            ("lm_head", if self.tie_embeddings { 0 } else { vocab * d }),
        ])
    }

    /// The weights of one expert of the model's MoE layers (0 without experts).
    pub fn expert_weights(&self) -> u64 {
        let Some(moe) = &self.moe else { return 0 };
        let (d, w) = (self.hidden as u64, moe.intermediate as u64);
        self.mlp_matrices() * d * w + self.mlp_bias(w)
    }

    /// Projections of an MLP: three when gated, else two.
    fn mlp_matrices(&self) -> u64 {
        if self.mlp.gated() { 3 } else { 2 }
    }

    /// The biases of one MLP `w` wide: one per output of each projection.
    fn mlp_bias(&self, w: u64) -> u64 {
        match self.mlp_bias {
            true => (self.mlp_matrices() - 1) * w + self.hidden as u64,
            false => 0,
        }
    }

    /// The weights of layer `i`'s MLP: dense, or its experts, router and shared expert.
    fn mlp_weights(&self, i: usize) -> u64 {
        let [d, inter] = [self.hidden, self.intermediate].map(|v| v as u64);
        let mats = self.mlp_matrices();
        match &self.moe {
            Some(moe) if moe.sparse[i] => {
                let e = moe.experts as u64;
                let shared = moe.shared.map_or(0, |s| {
                    let gate = if s.gated { d } else { 0 };
                    let s = s.width as u64;
                    mats * d * s + self.mlp_bias(s) + gate
                });
                // DeepSeek-V3's correction bias, gpt-oss's router bias: one per expert.
                let per_expert = match (moe.router, moe.names) {
                    (Router::SigmoidGroups { .. }, _) | (_, ExpertNames::GptOss) => e,
                    _ => 0,
                };
                e * d + per_expert + e * self.expert_weights() + shared
            }
            _ => mats * d * inter + self.mlp_bias(inter),
        }
    }

    /// The weights of one layer's attention of `spec`: projections, biases, q/k norms and
    /// learnable tensors.
    fn attention_weights(&self, spec: &AttentionSpec) -> u64 {
        let d = self.hidden as u64;
        let (h, dk, dv) = (
            u64::from(spec.heads),
            u64::from(spec.head_dim),
            u64::from(spec.v_head_dim),
        );
        match spec.mla() {
            Some(m) => {
                let (r, dr) = (u64::from(m.latent_rank), u64::from(m.rope_dim));
                d * h * (dk + dr) + d * (r + dr) + r + r * h * (dk + dv) + h * dv * d
            }
            None => {
                let hkv = u64::from(spec.kv_heads());
                let (hv, ho) = (
                    u64::from(spec.value_heads()),
                    u64::from(spec.output_heads()),
                );
                let bias = if self.qkv_bias {
                    (h + hkv) * dk + hv * dv
                } else {
                    0
                };
                // Differential heads' lambda vectors and per-head norm.
                let differential = match spec.differential {
                    Some(_) => 4 * dk + dv,
                    None => 0,
                };
                let qk_norm = match self.qk_norm {
                    Some(QkNorm::PerHead) => 2 * dk,
                    Some(QkNorm::Whole | QkNorm::PerHeadLayer) => (h + hkv) * dk,
                    None => 0,
                };
                let o_bias = if self.o_bias { d } else { 0 };
                let learned: u64 = spec
                    .learnable_tensors()
                    .iter()
                    .map(|(_, s)| s.iter().product::<usize>() as u64)
                    .sum();
                d * (h * dk + hkv * dk + hv * dv)
                    + bias
                    + qk_norm
                    + learned
                    + differential
                    + ho * dv * d
                    + o_bias
            }
        }
    }
}
