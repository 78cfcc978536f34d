//! `position = ..`: none, ALiBi, RoPE with its scalings, and xPos.

use super::values::{Args, Value};
use crate::spec::{LongRope, RopeLayout, RopeScaling, XPos, Yarn};
use proc_macro2::TokenStream;
use std::collections::HashMap;

/// RoPE as written: the dim may default to the rotated head dimension, known only at the end.
pub(super) enum RawPosition {
    None,
    Alibi,
    Rope(RawRope),
}

/// `rope(..)` or `xpos(..)` as written.
pub(super) struct RawRope {
    pub(super) base: f64,
    pub(super) dim: Option<u32>,
    pub(super) layout: RopeLayout,
    pub(super) scaling: RopeScaling,
    pub(super) xpos: Option<XPos>,
}

/// The tokens that set each field, by its dotted path (the parser's spans).
type Spans = HashMap<&'static str, TokenStream>;

/// `none`, `alibi`, `rope[(..)]` or `xpos[(..)]`.
pub(super) fn position(spans: &mut Spans, v: &Value) -> syn::Result<RawPosition> {
    const FORMS: &str = "none, alibi, rope, rope(base = .., dim = .., layout = .., \
                         scaling = ..), xpos, xpos(base = .., dim = .., layout = .., \
                         scaling = .., scale_base = .., gamma = ..)";
    if let Some(word) = v.as_word() {
        return match word.as_str() {
            "none" => Ok(RawPosition::None),
            "alibi" => Ok(RawPosition::Alibi),
            "rope" => Ok(RawPosition::Rope(rope_defaults(None))),
            "xpos" => Ok(RawPosition::Rope(rope_defaults(Some(XPos::PAPER)))),
            _ => Err(v.expected(FORMS)),
        };
    }
    match v.as_call() {
        Some((name, args)) if name == "rope" => rope(spans, args, None),
        Some((name, args)) if name == "xpos" => rope(spans, args, Some(XPos::PAPER)),
        _ => Err(v.expected(FORMS)),
    }
}

/// RoPE, or xPos (`xpos` given), with every parameter at its default: xPos pairs dims as
/// the paper's code does (interleaved).
fn rope_defaults(xpos: Option<XPos>) -> RawRope {
    RawRope {
        base: 10000.0,
        dim: None,
        layout: match xpos {
            Some(_) => RopeLayout::Interleaved,
            None => RopeLayout::Half,
        },
        scaling: RopeScaling::None,
        xpos,
    }
}

/// `rope(..)`, or `xpos(..)` (`xpos` holds its defaults), which also takes `scale_base`
/// and `gamma`.
fn rope(spans: &mut Spans, args: Args, xpos: Option<XPos>) -> syn::Result<RawPosition> {
    let (name, allowed): (&str, &[&str]) = match xpos {
        Some(_) => (
            "xpos",
            &["base", "dim", "layout", "scaling", "scale_base", "gamma"],
        ),
        None => ("rope", &["base", "dim", "layout", "scaling"]),
    };
    let mut named = args.named(name, allowed)?;
    let mut raw = rope_defaults(xpos);
    if let Some((span, v)) = named.take("base") {
        spans.insert("position.base", span);
        raw.base = v.float()?;
    }
    if let Some((span, v)) = named.take("dim") {
        spans.insert("position.dim", span);
        raw.dim = Some(v.u32()?);
    }
    if let Some((span, v)) = named.take("layout") {
        spans.insert("position.layout", span);
        raw.layout = match v.word(&["half", "interleaved"])? {
            "half" => RopeLayout::Half,
            _ => RopeLayout::Interleaved,
        };
    }
    if let Some((span, v)) = named.take("scaling") {
        spans.insert("position.scaling", span);
        raw.scaling = scaling(spans, &v)?;
    }
    if let Some(x) = raw.xpos.as_mut() {
        if let Some((span, v)) = named.take("scale_base") {
            spans.insert("position.scale_base", span);
            x.scale_base = v.float()?;
        }
        if let Some((span, v)) = named.take("gamma") {
            spans.insert("position.gamma", span);
            x.gamma = v.float()?;
        }
    }
    Ok(RawPosition::Rope(raw))
}

fn scaling(spans: &mut Spans, v: &Value) -> syn::Result<RopeScaling> {
    const FORMS: &str = "none, linear(factor = ..), ntk(factor = ..), dynamic(factor = .., \
                         original_max_position = ..), yarn(factor = .., \
                         original_max_position = .., ..), llama3(factor = .., \
                         low_freq_factor = .., high_freq_factor = .., original_max_position = ..), \
                         longrope(short = [..], long = [..], original_max_position = .., \
                         attention_factor = ..)";
    if v.as_word().as_deref() == Some("none") {
        return Ok(RopeScaling::None);
    }
    let Some((name, args)) = v.as_call() else {
        return Err(v.expected(FORMS));
    };
    let allowed: &[&str] = match name.as_str() {
        "linear" | "ntk" => &["factor"],
        "dynamic" => &["factor", "original_max_position"],
        "yarn" => &[
            "factor",
            "original_max_position",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ],
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position",
        ],
        "longrope" => &["short", "long", "original_max_position", "attention_factor"],
        _ => return Err(v.expected(FORMS)),
    };
    let mut named = args.named(&name, allowed)?;
    let mut get = |key: &'static str, field: &'static str| -> Option<Value<'_>> {
        named.take(key).map(|(span, v)| {
            spans.insert(field, span);
            v
        })
    };
    let factor = get("factor", "position.scaling.factor");
    let orig = get(
        "original_max_position",
        "position.scaling.original_max_position",
    );
    let missing = |what: &str| {
        syn::Error::new(
            args.span,
            format!(
                "{name}(...) needs `{what} = ..`; its parameters: {}",
                allowed.join(", ")
            ),
        )
    };
    let need_orig = || -> syn::Result<u64> {
        orig.as_ref()
            .ok_or_else(|| missing("original_max_position"))?
            .u64()
    };
    if name == "longrope" {
        let mut list = |key: &'static str, field: &'static str| {
            get(key, field).ok_or_else(|| missing(key))?.floats()
        };
        let short = list("short", "position.scaling.short")?;
        let long = list("long", "position.scaling.long")?;
        let attention_factor = get("attention_factor", "position.scaling.attention_factor")
            .ok_or_else(|| missing("attention_factor"))?
            .float()?;
        return Ok(RopeScaling::LongRope(LongRope {
            short: short.into(),
            long: long.into(),
            original_max_position: need_orig()?,
            attention_factor,
        }));
    }
    let factor = factor.ok_or_else(|| missing("factor"))?.float()?;
    Ok(match name.as_str() {
        "linear" => RopeScaling::Linear { factor },
        "ntk" => RopeScaling::Ntk { factor },
        "dynamic" => RopeScaling::Dynamic {
            factor,
            original_max_position: need_orig()?,
        },
        "yarn" => {
            let mut y = Yarn::new(factor, need_orig()?);
            if let Some(v) = get("beta_fast", "position.scaling.beta_fast") {
                y.beta_fast = v.float()?;
            }
            if let Some(v) = get("beta_slow", "position.scaling.beta_slow") {
                y.beta_slow = v.float()?;
            }
            if let Some(v) = get("mscale", "position.scaling.mscale") {
                y.mscale = Some(v.float()?);
            }
            if let Some(v) = get("mscale_all_dim", "position.scaling.mscale_all_dim") {
                y.mscale_all_dim = Some(v.float()?);
            }
            if let Some(v) = get("truncate", "position.scaling.truncate") {
                y.truncate = v.boolean()?;
            }
            RopeScaling::Yarn(y)
        }
        _ => {
            let low = get("low_freq_factor", "position.scaling.low_freq_factor")
                .ok_or_else(|| missing("low_freq_factor"))?
                .float()?;
            let high = get("high_freq_factor", "position.scaling.high_freq_factor")
                .ok_or_else(|| missing("high_freq_factor"))?
                .float()?;
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position: need_orig()?,
            }
        }
    })
}
