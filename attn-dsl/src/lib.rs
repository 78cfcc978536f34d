//! attn-dsl: the attention spec language and what a spec means.
//!
//! **Invariant:** attn-dsl knows nothing of backends or devices. Pure data and math; no unsafe.
//!
//! - [`AttentionSpec`] and its parts are plain data ([`spec`]).
//! - [`parse_str`] and [`parse_tokens`] are the one parser, for strings and for the
//!   `#[attention(...)]` macro; `Display` prints a spec back so that `parse(print(s)) == s`.
//! - [`set_key`] edits one item of a spec's text (what a sweep varies).
//! - [`AttentionSpec::validate`] checks the rules; the parser points its findings at tokens.
//! - [`match_learned`] checks a call's learnable tensors against the spec, for every caller.
//! - [`accounting`] counts KV-cache bytes, parameters and FLOPs.
//! - [`catalog`] names well-known specs for tests and benchmarks.
//! - [`modifier`] is the IR of score modifiers and masks (built-in and custom), with its passes.
//! - [`reference`](mod@reference) is the definition of what a spec computes: plain f64, written for clarity.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod accounting;
pub mod catalog;
pub mod data;
pub mod differential;
mod error;
mod given;
pub mod initial;
pub mod inputs;
pub mod learnable;
pub mod modifier;
mod parse;
mod print;
pub mod reference;
pub mod spec;
mod validate;

pub use error::{Invalid, Location, ReferenceError, SpecError, SpecErrors};
pub use given::{Mismatch, match_call, match_learned};
pub use parse::{
    MAX_BRACKET_DEPTH, MAX_ERRORS, MAX_EXPR_DEPTH, MAX_LITERAL_CHARS, MAX_SPEC_BYTES,
    gradient_notes, parse_str, parse_tokens, set_key, settable_keys,
};
pub use spec::{
    AttentionSpec, CausalAlign, DType, DataDecl, DataDim, DataType, Differential, KvKind, KvLayout,
    LAMBDA_NAMES, LongRope, Mask, Mla, Normalize, Pairing, ParamDecl, ParamDim, ParamInit,
    Position, Rope, RopeLayout, RopeScaling, SINKS_NAME, SigmoidBias, Sinks, XPos, Yarn,
};
pub use validate::{MAX_HEAD_DIM, MAX_HEADS, MAX_LATENT_RANK};
