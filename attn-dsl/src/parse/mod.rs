//! The one parser of the spec language, over tokens: strings are tokenized by proc-macro2 and the
//! `#[attention(...)]` macro hands over its attribute tokens, so both get the same grammar, the
//! same checks and errors that point at the offending tokens.
//!
//! The grammar is a comma-separated list of Rust expressions: `key = value` assignments plus the
//! bare item `mla(latent_rank = .., rope_dim = ..)`. Values are literals, identifiers, calls with
//! `name = value` arguments, or closures (custom modifiers).

mod edit;
mod limits;
mod normalize;
mod notes;
mod params;
mod position;
mod values;

pub use edit::{set_key, settable_keys};
pub use notes::gradient_notes;

pub use limits::{MAX_BRACKET_DEPTH, MAX_EXPR_DEPTH, MAX_LITERAL_CHARS, MAX_SPEC_BYTES};

use crate::error::SpecErrors;
use crate::learnable::Subject;
use crate::modifier::{Readable, lower_mask_mod, lower_score_mod};
use crate::spec::{
    AttentionSpec, CausalAlign, DType, DataDecl, Differential, KvLayout, Mask, Mla, Normalize,
    ParamDecl, Position, Rope, Sinks,
};
use position::{RawPosition, RawRope};
use proc_macro2::{Spacing, Span, TokenStream, TokenTree};
use quote::ToTokens;
use std::collections::{HashMap, HashSet};
use values::{Args, Value};

/// Most errors one parse reports; past these, one last error says how many more there were.
pub const MAX_ERRORS: usize = 100;

/// The top-level keys, for "did you mean" suggestions.
const KEYS: &[&str] = &[
    "heads",
    "kv_heads",
    "head_dim",
    "v_head_dim",
    "mask",
    "position",
    "softcap",
    "scale",
    "dtype",
    "score_mod",
    "mask_mod",
    "sinks",
    "mla",
    "params",
    "data",
    "normalize",
    "differential",
];

/// The keys that are items of their own, `NAME(...)`, not `key = value`.
const CALL_ITEMS: &[&str] = &["mla", "params", "data"];

/// Parses a spec from a string. Errors carry line:column locations; render them with
/// [`SpecErrors::render`].
pub fn parse_str(source: &str) -> Result<AttentionSpec, SpecErrors> {
    if source.len() > MAX_SPEC_BYTES {
        return Err(SpecErrors(vec![crate::error::SpecError {
            message: format!(
                "the spec is {} bytes long; allowed: at most {MAX_SPEC_BYTES}",
                source.len()
            ),
            start: crate::Location { line: 1, column: 1 },
            end: crate::Location { line: 1, column: 2 },
        }]));
    }
    let tokens: TokenStream = source.parse().map_err(|e: proc_macro2::LexError| {
        SpecErrors::from_syn(syn::Error::new(
            e.span(),
            format!("cannot tokenize the spec: {e}"),
        ))
    })?;
    parse_tokens(tokens).map_err(SpecErrors::from_syn)
}

/// A key followed by `:` (`heads: 32`, as in JSON or YAML): the error that says to write `=`.
/// Only where a key stands (the first item, or after a top-level comma), so a typed closure
/// parameter is never taken for one.
fn colon_after_key(tokens: &TokenStream) -> Option<syn::Error> {
    let trees: Vec<TokenTree> = tokens.clone().into_iter().collect();
    (0..trees.len().saturating_sub(1)).find_map(|i| {
        let at_key = i == 0 || matches!(&trees[i - 1], TokenTree::Punct(p) if p.as_char() == ',');
        match (&trees[i], &trees[i + 1]) {
            (TokenTree::Ident(key), TokenTree::Punct(colon))
                if at_key && colon.as_char() == ':' && colon.spacing() == Spacing::Alone =>
            {
                Some(syn::Error::new(
                    colon.span(),
                    format!("expected `=` between a key and its value: `{key} = ...`"),
                ))
            }
            _ => None,
        }
    })
}

/// Parses and validates a spec from tokens (the body of `#[attention(...)]`). All errors found
/// are combined into one `syn::Error`, each at the span of its tokens.
pub fn parse_tokens(tokens: TokenStream) -> syn::Result<AttentionSpec> {
    if tokens.is_empty() {
        return Err(syn::Error::new(
            Span::call_site(),
            "the spec is empty; it needs at least `heads = N, head_dim = N`",
        ));
    }
    limits::check(&tokens)?;
    let whole = tokens.clone();
    let items = params::split_items(tokens).map_err(|e| colon_after_key(&whole).unwrap_or(e))?;
    let mut p = SpecParser {
        failed: HashSet::new(),
        spans: HashMap::new(),
        errors: Vec::new(),
        more_errors: 0,
        raw: Raw::default(),
        decl_tokens: Vec::new(),
        data_tokens: Vec::new(),
        reads: Vec::new(),
    };
    // Declarations first: the modifiers' reads are resolved against them.
    for item in &items.params {
        p.params_item(item);
    }
    for item in &items.data {
        p.data_item(item);
    }
    for item in &items.rest {
        p.item(item);
    }
    let spec = p.resolve(&whole);
    let placed = match &spec {
        Some(spec) => p.place_learnable_findings(spec),
        None => HashSet::new(),
    };
    if let Some(Err(findings)) = spec.as_ref().map(AttentionSpec::validate) {
        // A field whose value was already rejected holds a default now: judging it again
        // would only repeat the first error in other words. Findings about parameters were
        // placed at their tokens already.
        let top = |field: &str| field.split('.').next().unwrap_or(field).to_string();
        let findings: Vec<_> = findings
            .into_iter()
            .filter(|f| !p.failed.contains(top(f.field).as_str()))
            .filter(|f| !placed.contains(&f.message))
            .collect();
        for finding in findings {
            let at = p.tokens_of(finding.field, &whole);
            let err = syn::Error::new_spanned(at, finding.message);
            p.error(err);
        }
    }
    if p.more_errors > 0 {
        let more = p.more_errors;
        p.errors.push(syn::Error::new(
            Span::call_site(),
            format!(
                "and {more} more error{} not shown",
                if more == 1 { "" } else { "s" }
            ),
        ));
    }

    let mut errors = p.errors.into_iter();
    match errors.next() {
        None => Ok(spec.expect("no errors means the spec resolved")),
        Some(mut first) => {
            errors.for_each(|e| first.combine(e));
            Err(first)
        }
    }
}

impl std::str::FromStr for AttentionSpec {
    type Err = SpecErrors;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_str(s)
    }
}

/// What the items said, before defaults are resolved.
#[derive(Default)]
struct Raw {
    heads: Option<u32>,
    kv_heads: Option<u32>,
    head_dim: Option<u32>,
    v_head_dim: Option<u32>,
    mask: Option<Mask>,
    position: Option<RawPosition>,
    mla: Option<Mla>,
    softcap: Option<f64>,
    scale: Option<f64>,
    dtype: Option<DType>,
    score_mod: Option<crate::modifier::ScoreMod>,
    mask_mod: Option<crate::modifier::MaskMod>,
    params: Vec<ParamDecl>,
    data: Vec<DataDecl>,
    sinks: Option<Sinks>,
    normalize: Option<Normalize>,
    differential: Option<Option<Differential>>,
}

struct SpecParser {
    /// Keys whose value was rejected.
    failed: HashSet<&'static str>,
    /// The tokens that set each field (dotted paths, as in validation findings).
    spans: HashMap<&'static str, TokenStream>,
    /// The first [`MAX_ERRORS`] errors.
    errors: Vec<syn::Error>,
    /// How many errors came past those.
    more_errors: usize,
    raw: Raw,
    /// The tokens of each declaration in `raw.params`.
    decl_tokens: Vec<TokenStream>,
    /// The tokens of each declaration in `raw.data`.
    data_tokens: Vec<TokenStream>,
    /// The modifiers' tensor reads, with their spans.
    reads: Vec<(crate::modifier::ParamRead, Span)>,
}

impl SpecParser {
    /// The tokens that set `field`, else its nearest parent, else the whole spec.
    fn tokens_of<'t>(&'t self, field: &str, whole: &'t TokenStream) -> &'t TokenStream {
        let mut path = field;
        loop {
            if let Some(tokens) = self.spans.get(path) {
                return tokens;
            }
            match path.rfind('.') {
                Some(dot) => path = &path[..dot],
                None => return whole,
            }
        }
    }

    fn error(&mut self, err: syn::Error) {
        if self.errors.len() < MAX_ERRORS {
            self.errors.push(err);
        } else {
            self.more_errors += 1;
        }
    }

    fn item(&mut self, item: &syn::Expr) {
        match item {
            syn::Expr::Assign(assign) => {
                let Some(key) = values::ident_of(&assign.left) else {
                    self.error(syn::Error::new_spanned(
                        &assign.left,
                        "expected a key name on the left of `=`",
                    ));
                    return;
                };
                if let Err(e) = self.key(&key, &assign.right) {
                    self.error(e);
                }
            }
            syn::Expr::Call(call) if values::ident_of(&call.func).is_some_and(|i| i == "mla") => {
                if let Err(e) = self.mla(call) {
                    self.error(e);
                }
            }
            other => {
                let hint = match values::ident_of(other) {
                    Some(i) if i == "mla" => {
                        "`mla` needs its parameters: mla(latent_rank = 512, rope_dim = 64)"
                            .to_string()
                    }
                    Some(i) if i == "params" => {
                        "`params` needs its declarations: params(NAME: [DIM, ..], ..)".to_string()
                    }
                    Some(i) if i == "data" => {
                        "`data` needs its declarations: data(NAME: [DIM, ..] TYPE, ..)".to_string()
                    }
                    _ => "expected `key = value`, `mla(...)`, `params(...)` or `data(...)`"
                        .to_string(),
                };
                self.error(syn::Error::new_spanned(other, hint));
            }
        }
    }

    /// Records that `field` was set by the tokens `value`; a second setting is an error at
    /// `key`.
    fn claim(
        &mut self,
        field: &'static str,
        key: &dyn ToTokens,
        value: TokenStream,
    ) -> syn::Result<()> {
        if self.spans.contains_key(field) {
            return Err(syn::Error::new_spanned(
                key,
                format!("duplicate key `{field}`; each key may appear once"),
            ));
        }
        self.spans.insert(field, value);
        Ok(())
    }

    fn key(&mut self, key: &syn::Ident, value: &syn::Expr) -> syn::Result<()> {
        let name = key.to_string();
        let Some(field) = KEYS
            .iter()
            .copied()
            .find(|k| *k == name && !CALL_ITEMS.contains(k))
        else {
            return Err(unknown_key(key, &name));
        };
        // Claimed before the value is read, so an invalid value is not also reported missing.
        self.claim(field, key, value.to_token_stream())?;
        let result = self.value(field, value);
        if result.is_err() {
            self.failed.insert(field);
        }
        result
    }

    fn value(&mut self, field: &'static str, value: &syn::Expr) -> syn::Result<()> {
        let v = Value::new(field, value);
        match field {
            "heads" => self.raw.heads = Some(v.u32()?),
            "kv_heads" => self.raw.kv_heads = Some(v.u32()?),
            "head_dim" => self.raw.head_dim = Some(v.u32()?),
            "v_head_dim" => self.raw.v_head_dim = Some(v.u32()?),
            "softcap" => {
                self.raw.softcap = match v.as_word().as_deref() {
                    Some("none") => None,
                    _ => Some(v.float().map_err(|_| v.expected("a number, or none"))?),
                }
            }
            "scale" => self.raw.scale = Some(v.float()?),
            "dtype" => {
                self.raw.dtype = Some(match v.word(&["f32", "f16", "bf16"])? {
                    "f32" => DType::F32,
                    "f16" => DType::F16,
                    _ => DType::Bf16,
                })
            }
            "mask" => self.raw.mask = Some(self.mask(&v)?),
            "position" => self.raw.position = Some(position::position(&mut self.spans, &v)?),
            "score_mod" => {
                let readable = Readable {
                    params: &self.raw.params,
                    data: &self.raw.data,
                };
                let lowered = lower_score_mod(v.closure()?, readable)?;
                self.raw.score_mod = Some(lowered.score_mod);
                self.reads.extend(lowered.reads);
            }
            "sinks" => {
                self.raw.sinks = Some(match v.word(&["none", "learned"])? {
                    "learned" => Sinks::Learned,
                    _ => Sinks::None,
                })
            }
            "normalize" => self.raw.normalize = Some(normalize::normalize(&v)?),
            "differential" => self.raw.differential = Some(normalize::differential(&v)?),
            "mask_mod" => {
                let readable = Readable {
                    params: &self.raw.params,
                    data: &self.raw.data,
                };
                let (mask_mod, reads) = lower_mask_mod(v.closure()?, readable)?;
                self.raw.mask_mod = Some(mask_mod);
                self.reads.extend(reads);
            }
            _ => unreachable!("every key in KEYS is handled"),
        }
        Ok(())
    }

    fn mask(&mut self, v: &Value) -> syn::Result<Mask> {
        const FORMS: &str = "none, causal, causal(top_left), causal(bottom_right), \
                             sliding_window(N)";
        if let Some(word) = v.as_word() {
            return match word.as_str() {
                "none" => Ok(Mask::None),
                "causal" => Ok(Mask::Causal(CausalAlign::BottomRight)),
                _ => Err(v.expected(FORMS)),
            };
        }
        let Some((name, args)) = v.as_call() else {
            return Err(v.expected(FORMS));
        };
        match name.as_str() {
            "causal" => {
                let [arg] = args.positional::<1>("causal(top_left | bottom_right)")?;
                match Value::new("mask", arg).word(&["top_left", "bottom_right"])? {
                    "top_left" => Ok(Mask::Causal(CausalAlign::TopLeft)),
                    _ => Ok(Mask::Causal(CausalAlign::BottomRight)),
                }
            }
            "sliding_window" => {
                let [arg] = args.positional::<1>("sliding_window(N)")?;
                self.spans.insert("mask.window", arg.to_token_stream());
                Ok(Mask::SlidingWindow {
                    window: Value::new("sliding_window", arg).u64()?,
                })
            }
            _ => Err(v.expected(FORMS)),
        }
    }

    fn mla(&mut self, call: &syn::ExprCall) -> syn::Result<()> {
        self.claim("mla", &call.func, call.to_token_stream())?;
        let args = Args::new(call.paren_token.span.join(), &call.args);
        let mut named = args.named("mla", &["latent_rank", "rope_dim"])?;
        let mut get = |key: &str, field: &'static str| -> syn::Result<u32> {
            match named.take(key) {
                Some((span, v)) => {
                    self.spans.insert(field, span);
                    v.u32()
                }
                None => Err(syn::Error::new_spanned(
                    call,
                    format!(
                        "mla(...) needs `{key} = ..`; write mla(latent_rank = 512, rope_dim = 64)"
                    ),
                )),
            }
        };
        let latent_rank = get("latent_rank", "mla.latent_rank")?;
        let rope_dim = get("rope_dim", "mla.rope_dim")?;
        self.raw.mla = Some(Mla {
            latent_rank,
            rope_dim,
        });
        Ok(())
    }

    /// Reads a `params(...)` item's declarations.
    fn params_item(&mut self, item: &TokenStream) {
        if self.claim("params", item, item.clone()).is_err() {
            self.error(syn::Error::new_spanned(
                item,
                "params(...) appears twice; declare every parameter in one params(...)",
            ));
            return;
        }
        match params::declarations(item) {
            Ok((decls, error)) => {
                for (decl, tokens) in decls {
                    self.raw.params.push(decl);
                    self.decl_tokens.push(tokens);
                }
                if let Some(e) = error {
                    self.failed.insert("params");
                    self.error(e);
                }
            }
            Err(e) => {
                self.failed.insert("params");
                self.error(e);
            }
        }
    }

    /// Reads a `data(...)` item's declarations.
    fn data_item(&mut self, item: &TokenStream) {
        if self.claim("data", item, item.clone()).is_err() {
            self.error(syn::Error::new_spanned(
                item,
                "data(...) appears twice; declare every data tensor in one data(...)",
            ));
            return;
        }
        match params::data_declarations(item) {
            Ok((decls, error)) => {
                for (decl, tokens) in decls {
                    self.raw.data.push(decl);
                    self.data_tokens.push(tokens);
                }
                if let Some(e) = error {
                    self.failed.insert("data");
                    self.error(e);
                }
            }
            Err(e) => {
                self.failed.insert("data");
                self.error(e);
            }
        }
    }

    /// Reports the rules about parameters at the tokens each is about; returns the messages,
    /// so validation does not repeat them.
    fn place_learnable_findings(&mut self, spec: &AttentionSpec) -> HashSet<String> {
        let mut placed = HashSet::new();
        for (subject, message) in crate::learnable::findings(spec) {
            let tokens = match &subject {
                Subject::Decl(i) => self.decl_tokens.get(*i).or(self.spans.get("params")),
                Subject::DataDecl(i) => self.data_tokens.get(*i).or(self.spans.get("data")),
                Subject::MaskMod => self.spans.get("mask_mod"),
                Subject::Spec => self.spans.get("mla"),
                Subject::Read(_) | Subject::MaskRead(_) => None,
            };
            let read_span = match &subject {
                Subject::Read(read) | Subject::MaskRead(read) => {
                    self.reads.iter().find(|(r, _)| r == read).map(|r| r.1)
                }
                _ => None,
            };
            let err = match (tokens, read_span) {
                (Some(tokens), _) => syn::Error::new_spanned(tokens, &message),
                (None, Some(span)) => syn::Error::new(span, &message),
                (None, None) => syn::Error::new(Span::call_site(), &message),
            };
            self.error(err);
            placed.insert(message);
        }
        placed
    }

    /// Fills in defaults and checks that required keys are present. Keys that were rejected
    /// take their defaults, so the rest of the spec can still be validated.
    fn resolve(&mut self, whole: &TokenStream) -> Option<AttentionSpec> {
        let raw = std::mem::take(&mut self.raw);
        if raw.heads.is_none() && !self.spans.contains_key("heads") {
            self.error(syn::Error::new_spanned(
                whole,
                "missing `heads = N` (the number of query heads)",
            ));
        }
        if raw.head_dim.is_none() && !self.spans.contains_key("head_dim") {
            self.error(syn::Error::new_spanned(
                whole,
                "missing `head_dim = N` (the query/key dimension per head)",
            ));
        }
        if let (Some(_), Some(_)) = (raw.mla, raw.kv_heads) {
            self.error(syn::Error::new_spanned(
                &self.spans["kv_heads"],
                "kv_heads does not apply with mla(...): all heads share one latent",
            ));
        }
        let (heads, head_dim) = (raw.heads?, raw.head_dim?);
        let kv = match raw.mla {
            Some(mla) => KvLayout::Mla(mla),
            None => KvLayout::Heads {
                kv_heads: raw.kv_heads.unwrap_or(heads),
            },
        };
        let rotary_span = match kv {
            KvLayout::Mla(mla) => mla.rope_dim,
            KvLayout::Heads { .. } => head_dim,
        };
        let position = match raw.position.unwrap_or(RawPosition::None) {
            RawPosition::None => Position::None,
            RawPosition::Alibi => Position::Alibi,
            RawPosition::Rope(RawRope {
                base,
                dim,
                layout,
                scaling,
                xpos,
            }) => Position::Rope(Rope {
                base,
                dim: dim.unwrap_or(rotary_span),
                layout,
                scaling,
                xpos,
            }),
        };
        Some(AttentionSpec {
            heads,
            kv,
            head_dim,
            v_head_dim: raw.v_head_dim.unwrap_or(head_dim),
            mask: raw.mask.unwrap_or(Mask::None),
            position,
            softcap: raw.softcap,
            scale: raw.scale,
            dtype: raw.dtype.unwrap_or(DType::F32),
            score_mod: raw.score_mod,
            mask_mod: raw.mask_mod,
            params: raw.params,
            data: raw.data,
            sinks: raw.sinks.unwrap_or_default(),
            normalize: raw.normalize.unwrap_or_default(),
            differential: raw.differential.flatten(),
        })
    }
}

fn unknown_key(key: &syn::Ident, name: &str) -> syn::Error {
    let best = KEYS
        .iter()
        .map(|k| (strsim::damerau_levenshtein(name, k), *k))
        .min()
        .filter(|(d, k)| *d <= 2.max(k.len() / 3));
    let hint = match best {
        Some((_, "mla")) => "; did you mean `mla(latent_rank = .., rope_dim = ..)`?".to_string(),
        Some((_, "params")) => "; did you mean `params(NAME: [DIM, ..])`?".to_string(),
        Some((_, "data")) => "; did you mean `data(NAME: [DIM, ..] TYPE)`?".to_string(),
        Some((_, k)) => format!("; did you mean `{k}`?"),
        None => format!("; allowed keys: {}", KEYS.join(", ")),
    };
    syn::Error::new_spanned(key, format!("unknown key `{name}`{hint}"))
}
