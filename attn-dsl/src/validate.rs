//! The rules every spec obeys, checked on the plain data so specs built in code get the same
//! errors as parsed ones. The parser maps each finding's field back to the tokens that set it.

use crate::error::Invalid;
use crate::learnable::Subject;
use crate::modifier::Expr;
use crate::parse::MAX_EXPR_DEPTH;
use crate::spec::{
    AttentionSpec, KvLayout, Mask, Normalize, Position, Rope, RopeScaling, SigmoidBias, Sinks, XPos,
};

/// Largest number of query heads accepted.
pub const MAX_HEADS: u32 = 1024;
/// Largest head dimension accepted (query/key, value, MLA rope dim).
pub const MAX_HEAD_DIM: u32 = 1024;
/// Largest MLA latent rank accepted.
pub const MAX_LATENT_RANK: u32 = 16384;

struct Findings(Vec<Invalid>);

impl Findings {
    fn push(&mut self, field: &'static str, message: String) {
        self.0.push(Invalid { field, message });
    }

    fn range(&mut self, field: &'static str, value: u64, lo: u64, hi: u64) -> bool {
        let ok = (lo..=hi).contains(&value);
        if !ok {
            self.push(
                field,
                format!("{field} = {value} is out of range; allowed: {lo} to {hi}"),
            );
        }
        ok
    }

    fn positive(&mut self, field: &'static str, value: f64) {
        if !(value.is_finite() && value > 0.0) {
            self.push(
                field,
                format!("{field} = {value} is invalid; allowed: a finite number greater than 0"),
            );
        }
    }

    /// A number kernels take as f32: positive, and within f32's range.
    fn positive_f32(&mut self, field: &'static str, value: f64) {
        if !(value > 0.0 && value <= f64::from(f32::MAX)) {
            let shown = if value.abs() >= 1e16 {
                format!("{value:e}")
            } else {
                value.to_string()
            };
            self.push(
                field,
                format!(
                    "{field} = {shown} is invalid; allowed: a finite number greater than 0, at \
                     most {:e} (f32's largest)",
                    f32::MAX
                ),
            );
        }
    }

    fn at_least_one(&mut self, field: &'static str, value: f64) {
        if !(value.is_finite() && value >= 1.0) {
            self.push(
                field,
                format!("{field} = {value} is invalid; allowed: a finite number of at least 1.0"),
            );
        }
    }
}

impl AttentionSpec {
    /// Checks every rule of the spec language; returns all findings, in field order.
    pub fn validate(&self) -> Result<(), Vec<Invalid>> {
        let mut f = Findings(Vec::new());
        let heads_ok = f.range("heads", self.heads.into(), 1, MAX_HEADS.into());
        let head_dim_ok = f.range("head_dim", self.head_dim.into(), 1, MAX_HEAD_DIM.into());
        // A defaulted v_head_dim repeats head_dim: report the one the user wrote, once.
        if head_dim_ok || self.v_head_dim != self.head_dim {
            f.range("v_head_dim", self.v_head_dim.into(), 1, MAX_HEAD_DIM.into());
        }
        match self.kv {
            // kv_heads is judged against heads, so only once heads itself is valid.
            KvLayout::Heads { .. } if !heads_ok => {}
            KvLayout::Heads { kv_heads } => {
                if kv_heads == 0 || kv_heads > self.heads {
                    f.push(
                        "kv_heads",
                        format!(
                            "kv_heads = {kv_heads} is out of range; allowed: 1 to heads ({})",
                            self.heads
                        ),
                    );
                } else if !self.heads.is_multiple_of(kv_heads) {
                    f.push(
                        "kv_heads",
                        format!(
                            "heads ({}) is not a multiple of kv_heads ({kv_heads}); allowed: a \
                             divisor of {}: {}",
                            self.heads,
                            self.heads,
                            divisors(self.heads)
                        ),
                    );
                }
            }
            KvLayout::Mla(mla) => {
                f.range(
                    "mla.latent_rank",
                    mla.latent_rank.into(),
                    1,
                    MAX_LATENT_RANK.into(),
                );
                f.range("mla.rope_dim", mla.rope_dim.into(), 1, MAX_HEAD_DIM.into());
            }
        }
        if let Mask::SlidingWindow { window: 0 } = self.mask {
            f.push(
                "mask.window",
                "sliding_window(0) keeps no key; allowed: a window of at least 1 (it counts the \
                 query's own key)"
                    .to_string(),
            );
        }
        if let Position::Rope(rope) = &self.position {
            self.validate_rope(rope, &mut f);
        }
        if let Some(c) = self.softcap {
            f.positive_f32("softcap", c);
        }
        if let Some(s) = self.scale {
            f.positive_f32("scale", s);
        }
        self.validate_normalize(&mut f);
        self.validate_differential(&mut f);
        let bodies = [
            ("score_mod", self.score_mod.as_ref().map(|m| &m.body)),
            ("mask_mod", self.mask_mod.as_ref().map(|m| &m.body)),
        ];
        for (field, body) in bodies {
            if let Some(depth) = body.map(Expr::depth).filter(|d| *d > MAX_EXPR_DEPTH) {
                f.push(
                    field,
                    format!(
                        "{field} is {depth} levels deep; allowed: at most {MAX_EXPR_DEPTH} \
                         (every pass over it recurses once a level)"
                    ),
                );
            }
        }
        for (subject, message) in crate::learnable::findings(self) {
            let field = match subject {
                Subject::Decl(_) => "params",
                Subject::DataDecl(_) => "data",
                Subject::Read(_) => "score_mod",
                Subject::MaskRead(_) => "mask_mod",
                Subject::MaskMod => "mask_mod",
                Subject::Spec => "mla",
            };
            f.push(field, message);
        }
        if f.0.is_empty() { Ok(()) } else { Err(f.0) }
    }

    fn validate_normalize(&self, f: &mut Findings) {
        let name = match self.normalize {
            Normalize::Softmax => return,
            Normalize::Sigmoid(bias) => {
                Self::validate_sigmoid_bias(bias, f);
                "sigmoid"
            }
            Normalize::StickBreaking => "stick_breaking",
        };
        if self.sinks == Sinks::Learned {
            f.push(
                "normalize",
                format!(
                    "normalize = {name} weighs each key without a denominator: there is none \
                     for a sink to join; allowed: sinks = none with {name}, or normalize = \
                     softmax"
                ),
            );
        }
        if self.mla().is_some() {
            f.push(
                "normalize",
                format!("normalize = {name} is not built for mla(...) yet; allowed: softmax"),
            );
        }
    }

    fn validate_differential(&self, f: &mut Findings) {
        let Some(d) = self.differential else { return };
        let init = d.lambda_init;
        if !(init.is_finite() && init.abs() <= 1e6) {
            f.push(
                "differential",
                format!("lambda init = {init} is invalid; allowed: a finite number within ±1e6"),
            );
        }
        if self.mla().is_some() {
            f.push(
                "differential",
                "differential heads are not built for mla(...); allowed: per-head keys and \
                 values (kv_heads)"
                    .to_string(),
            );
            return;
        }
        if !self.heads.is_multiple_of(2) || !self.kv_heads().is_multiple_of(2) {
            f.push(
                "differential",
                format!(
                    "differential heads pair query and key heads, but heads = {} and kv_heads \
                     = {}; allowed: even counts of both (2 components per head)",
                    self.heads,
                    self.kv_heads()
                ),
            );
        }
        for p in &self.params {
            if crate::spec::LAMBDA_NAMES.contains(&p.name.as_str()) {
                f.push(
                    "params",
                    format!(
                        "params: `{}` is a learnable vector of differential heads' lambda; \
                         allowed: another name",
                        p.name
                    ),
                );
            }
        }
    }

    fn validate_sigmoid_bias(bias: SigmoidBias, f: &mut Findings) {
        match bias {
            SigmoidBias::Value(b) if !(b.is_finite() && b.abs() <= f64::from(f32::MAX)) => f.push(
                "normalize",
                format!(
                    "sigmoid bias = {b} is invalid; allowed: a finite number within f32's range"
                ),
            ),
            SigmoidBias::NegLn(0) => f.push(
                "normalize",
                "sigmoid bias = -ln(0) is infinite; allowed: -ln(N) for N of at least 1"
                    .to_string(),
            ),
            _ => {}
        }
    }

    fn validate_rope(&self, rope: &Rope, f: &mut Findings) {
        if !(rope.base.is_finite() && rope.base > 1.0) {
            f.push(
                "position.base",
                format!(
                    "rope base = {} is invalid; allowed: a finite number greater than 1",
                    rope.base
                ),
            );
        }
        let span = self.rotary_span();
        let span_name = if self.mla().is_some() {
            "mla rope_dim"
        } else {
            "head_dim"
        };
        if !rope.dim.is_multiple_of(2) || rope.dim == 0 || rope.dim > span {
            let what = if !rope.dim.is_multiple_of(2) {
                "is odd"
            } else if rope.dim == 0 {
                "rotates nothing"
            } else {
                "exceeds the rotated head dimension"
            };
            f.push(
                "position.dim",
                format!(
                    "rope dim = {} {what}; allowed: an even number from 2 to {span} ({span_name})",
                    rope.dim
                ),
            );
        }
        let needs_dim_above_2 = matches!(
            rope.scaling,
            RopeScaling::Ntk { .. } | RopeScaling::Dynamic { .. }
        );
        if needs_dim_above_2 && rope.dim == 2 {
            f.push(
                "position.dim",
                "NTK scalings raise the base to dim/(dim-2), so they need a rope dim above 2"
                    .to_string(),
            );
        }
        Self::validate_scaling(rope, f);
        Self::validate_attention_factor(rope, f);
        if let Some(x) = rope.xpos {
            self.validate_xpos(x, f);
        }
    }

    /// xPos: a decay of at least one position per power, a `gamma` above 0 (so every
    /// `zeta_i` lies in (0, 1)), and per-head q and k (MLA's shared rotated key is not built).
    fn validate_xpos(&self, x: XPos, f: &mut Findings) {
        if !(x.scale_base.is_finite() && x.scale_base >= 1.0) {
            f.push(
                "position.scale_base",
                format!(
                    "xpos scale_base = {} is invalid; allowed: a finite number of at least 1",
                    x.scale_base
                ),
            );
        }
        if !(x.gamma.is_finite() && x.gamma > 0.0 && x.gamma <= 1e6) {
            f.push(
                "position.gamma",
                format!(
                    "xpos gamma = {} is invalid; allowed: a number above 0, at most 1e6",
                    x.gamma
                ),
            );
        }
        if self.mla().is_some() {
            f.push(
                "position",
                "xpos is not built for mla(...) (its decoupled rotated key is shared by every \
                 head); allowed with mla: none, rope(..)"
                    .to_string(),
            );
        }
    }

    /// The rules of a RoPE scaling's parameters.
    fn validate_scaling(rope: &Rope, f: &mut Findings) {
        match rope.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } | RopeScaling::Ntk { factor } => {
                f.positive("position.scaling.factor", factor);
            }
            RopeScaling::Dynamic {
                factor,
                original_max_position,
            } => {
                f.at_least_one("position.scaling.factor", factor);
                f.range(
                    "position.scaling.original_max_position",
                    original_max_position,
                    1,
                    u32::MAX.into(),
                );
            }
            RopeScaling::Yarn(y) => {
                if !(y.factor.is_finite() && y.factor >= 1.0) {
                    f.push(
                        "position.scaling.factor",
                        format!(
                            "yarn factor = {} is below 1; YaRN extends context, allowed: a \
                             finite factor of at least 1.0",
                            y.factor
                        ),
                    );
                }
                f.range(
                    "position.scaling.original_max_position",
                    y.original_max_position,
                    1,
                    u32::MAX.into(),
                );
                f.positive("position.scaling.beta_slow", y.beta_slow);
                f.positive("position.scaling.beta_fast", y.beta_fast);
                if y.beta_fast <= y.beta_slow {
                    f.push(
                        "position.scaling.beta_fast",
                        format!(
                            "beta_fast ({}) must be greater than beta_slow ({})",
                            y.beta_fast, y.beta_slow
                        ),
                    );
                }
                if let Some(m) = y.mscale {
                    f.positive("position.scaling.mscale", m);
                }
                if let Some(m) = y.mscale_all_dim {
                    f.positive("position.scaling.mscale_all_dim", m);
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                f.positive("position.scaling.factor", factor);
                f.positive("position.scaling.low_freq_factor", low_freq_factor);
                f.positive("position.scaling.high_freq_factor", high_freq_factor);
                if high_freq_factor <= low_freq_factor {
                    f.push(
                        "position.scaling.high_freq_factor",
                        format!(
                            "high_freq_factor ({high_freq_factor}) must be greater than \
                             low_freq_factor ({low_freq_factor})"
                        ),
                    );
                }
                f.range(
                    "position.scaling.original_max_position",
                    original_max_position,
                    1,
                    u32::MAX.into(),
                );
            }
            RopeScaling::LongRope(ref l) => {
                let pairs = rope.dim as usize / 2;
                for (field, list) in [
                    ("position.scaling.short", &l.short),
                    ("position.scaling.long", &l.long),
                ] {
                    if list.len() != pairs {
                        f.push(
                            field,
                            format!(
                                "{field} has {} factors; allowed: one per rotated pair, {pairs} \
                                 (rope dim / 2)",
                                list.len()
                            ),
                        );
                    }
                    if let Some(bad) = list.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                        f.push(
                            field,
                            format!("{field} holds {bad}; allowed: finite factors greater than 0"),
                        );
                    }
                }
                f.range(
                    "position.scaling.original_max_position",
                    l.original_max_position,
                    1,
                    u32::MAX.into(),
                );
                f.positive("position.scaling.attention_factor", l.attention_factor);
            }
        }
    }

    /// cos and sin are multiplied by the scaling's attention factor, so every score by its
    /// square: a square past f32's range makes every score infinite.
    fn validate_attention_factor(rope: &Rope, f: &mut Findings) {
        let factor = crate::reference::rope::attention_factor(rope);
        let field = match rope.scaling {
            RopeScaling::Yarn(_) => "position.scaling.mscale",
            _ => "position.scaling.attention_factor",
        };
        if factor.is_finite() && factor * factor > f64::from(f32::MAX) {
            f.push(
                field,
                format!(
                    "the attention factor {factor:.3e} multiplies every score by its square, \
                     {:.3e}, past f32's range; allowed: a factor of at most {:.3e}",
                    factor * factor,
                    f64::from(f32::MAX).sqrt()
                ),
            );
        }
    }
}

fn divisors(n: u32) -> String {
    (1..=n)
        .filter(|d| n.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
