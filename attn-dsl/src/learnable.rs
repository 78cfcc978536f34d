//! The rules for learnable parameters (`params(NAME: [DIM, ..])`) and the reads of them in a
//! score modifier, shared by validation (specs built in code) and the parser (which places each
//! finding at the tokens it is about).
//!
//! Index bounds are proved by interval analysis over every point a kernel may evaluate:
//! `b` in `0..2^31`, `h` in `0..heads`, and positions `q`, `k` within ±(2^31 - 1). The mask is
//! not used to narrow the range (kernels evaluate the score on masked pairs of a mixed tile
//! too), so a relative-position index needs its own clamp: `rel[h, (q - k).max(0).min(31)]`.

use crate::modifier::ParamRead;
use crate::modifier::interval::{Interval, Range, TileBounds, analyze};
use crate::spec::{AttentionSpec, ParamDim, SINKS_NAME};

/// Most parameter tensors a spec declares.
pub const MAX_PARAMS: usize = 16;
/// Most dimensions a parameter has.
pub const MAX_PARAM_DIMS: usize = 4;
/// Most elements all of a spec's parameters hold together.
pub const MAX_PARAM_ELEMENTS: u64 = 1 << 24;
/// Longest parameter name, in bytes.
pub const MAX_PARAM_NAME: usize = 64;

/// Names a parameter may not take: the modifier variables, and the tensors the CLI and the
/// runtime read and write by name.
pub const RESERVED_NAMES: &[&str] = &[
    "score", "b", "h", "q", "k", "qi", "ki", "v", "out", "lse", "dout", SINKS_NAME,
];

/// What a finding is about.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Subject {
    /// The declaration at this position of `params`.
    Decl(usize),
    /// A read in the score modifier.
    Read(ParamRead),
    /// The mask modifier.
    MaskMod,
    /// The whole spec (a combination not supported).
    Spec,
}

/// Every broken rule about parameters, with what it is about.
pub(crate) fn findings(spec: &AttentionSpec) -> Vec<(Subject, String)> {
    let mut out = Vec::new();
    if spec.mla().is_some() && !spec.learnable_tensors().is_empty() {
        out.push((
            Subject::Spec,
            "params(...) and sinks are not supported with mla(...) yet".to_string(),
        ));
    }
    if spec.params.len() > MAX_PARAMS {
        out.push((
            Subject::Decl(MAX_PARAMS),
            format!(
                "{} parameters are declared; allowed: at most {MAX_PARAMS}",
                spec.params.len()
            ),
        ));
    }
    let mut total: u64 = 0;
    for (i, decl) in spec.params.iter().enumerate() {
        let name = &decl.name;
        let mut say = |m: String| out.push((Subject::Decl(i), m));
        if !is_identifier(name) || name.len() > MAX_PARAM_NAME {
            say(format!(
                "`{name}` is not a parameter name; allowed: an identifier of at most \
                 {MAX_PARAM_NAME} bytes"
            ));
        }
        if RESERVED_NAMES.contains(&name.as_str()) {
            say(format!(
                "`{name}` is reserved; a parameter may not be called {}",
                RESERVED_NAMES.join(", ")
            ));
        }
        if spec.params[..i].iter().any(|p| p.name == *name) {
            say(format!("parameter `{name}` is declared twice"));
        }
        if let Some(base) = name.strip_prefix('d')
            && spec.params.iter().any(|p| p.name == base)
        {
            say(format!(
                "`{name}` would clash with the gradient of `{base}`, which is written as \
                 `{name}`; rename it"
            ));
        }
        if decl.dims.is_empty() || decl.dims.len() > MAX_PARAM_DIMS {
            say(format!(
                "`{name}` has {} dimensions; allowed: 1 to {MAX_PARAM_DIMS}",
                decl.dims.len()
            ));
        }
        if decl.dims.contains(&ParamDim::Fixed(0)) {
            say(format!(
                "`{name}` has a dimension of 0; allowed: 1 or more, `heads` or `kv_heads`"
            ));
        }
        let elements = spec
            .param_shape(decl)
            .iter()
            .fold(1u64, |n, d| n.saturating_mul(*d as u64));
        total = total.saturating_add(elements);
        if total > MAX_PARAM_ELEMENTS {
            say(format!(
                "the parameters hold {total} elements up to `{name}`; allowed: at most \
                 {MAX_PARAM_ELEMENTS} (2^24) in all"
            ));
            total = 0;
        }
    }
    if let Some(m) = &spec.mask_mod
        && m.body.reads_params()
    {
        out.push((
            Subject::MaskMod,
            "mask_mod reads a parameter; masks are not differentiable, so parameters may be \
             read only in score_mod"
                .to_string(),
        ));
    }
    if let Some(m) = &spec.score_mod {
        for read in m.body.param_reads() {
            if let Some(message) = read_finding(spec, &read) {
                out.push((Subject::Read(read), message));
            }
        }
    }
    out
}

/// What is wrong with one read: an unknown name, the wrong number of indices, or an index not
/// proved in range.
fn read_finding(spec: &AttentionSpec, read: &ParamRead) -> Option<String> {
    let name = &read.name;
    let Some(decl) = spec.param(name) else {
        return Some(format!("unknown parameter `{name}` in score_mod"));
    };
    if read.indices.len() != decl.dims.len() {
        return Some(format!(
            "`{name}` has {} dimensions, read with {} indices",
            decl.dims.len(),
            read.indices.len()
        ));
    }
    let bounds = everywhere(spec);
    for (axis, (index, dim)) in read.indices.iter().zip(spec.param_shape(decl)).enumerate() {
        if dim == 0 {
            // An empty dimension is the declaration's error; no index fits it.
            continue;
        }
        let allowed = Interval::new(0, dim as i64 - 1);
        match analyze(index, &bounds) {
            Range::Int(r) if r.lo >= allowed.lo && r.hi <= allowed.hi => {}
            Range::Int(r) => {
                return Some(format!(
                    "index {axis} of `{name}` (`{index}`) may be anywhere in [{}, {}]; allowed: \
                     0 to {} (dimension {axis} has {dim}); clamp it, e.g. \
                     `({index}).max(0).min({})`",
                    r.lo,
                    r.hi,
                    dim - 1,
                    dim - 1
                ));
            }
            _ => return Some(format!("index {axis} of `{name}` is not an integer")),
        }
    }
    None
}

/// Every point a kernel may evaluate the score at.
fn everywhere(spec: &AttentionSpec) -> TileBounds {
    let position = Interval::new(-(i32::MAX as i64), i32::MAX as i64);
    let index = Interval::new(0, i32::MAX as i64);
    TileBounds {
        batch: index,
        head: Interval::new(0, i64::from(spec.heads.max(1)) - 1),
        query: position,
        key: position,
        query_index: index,
        key_index: index,
    }
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}
