//! The rules for learnable parameters (`params(NAME: [DIM, ..])`), data tensors
//! (`data(NAME: [DIM, ..] TYPE)`) and the reads of them in the modifiers, shared by validation
//! (specs built in code) and the parser (which places each finding at the tokens it is about).
//! A data tensor's `batch` and `seq` dimensions are known only to a call: reads along them are
//! checked by [`crate::data::check_reads`] when the call's shapes are.
//!
//! Index bounds are proved by interval analysis over every point a kernel may evaluate:
//! `b` in `0..2^31`, `h` in `0..heads`, and positions `q`, `k` within ±(2^31 - 1). The mask is
//! not used to narrow the range (kernels evaluate the score on masked pairs of a mixed tile
//! too), so a relative-position index needs its own clamp: `rel[h, (q - k).max(0).min(31)]`.

use crate::modifier::ParamRead;
use crate::modifier::interval::{Interval, Range, TileBounds, analyze};
use crate::spec::{AttentionSpec, DataDim, ParamDim, SINKS_NAME};

/// Most parameter tensors a spec declares.
pub const MAX_PARAMS: usize = 16;
/// Most dimensions a parameter has.
pub const MAX_PARAM_DIMS: usize = 4;
/// Most elements all of a spec's parameters hold together.
pub const MAX_PARAM_ELEMENTS: u64 = 1 << 24;
/// Longest parameter name, in bytes.
pub const MAX_PARAM_NAME: usize = 64;
/// Most data tensors a spec declares.
pub const MAX_DATA: usize = 8;

/// Names a parameter may not take: the modifier variables, and the tensors the CLI and the
/// runtime read and write by name.
pub const RESERVED_NAMES: &[&str] = &[
    "score",
    "b",
    "h",
    "q",
    "k",
    "qi",
    "ki",
    "v",
    "out",
    "lse",
    "dout",
    "cu_seqlens_q",
    "cu_seqlens_k",
    SINKS_NAME,
];

/// What a finding is about.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Subject {
    /// The declaration at this position of `params`.
    Decl(usize),
    /// The declaration at this position of `data`.
    DataDecl(usize),
    /// A read in the score modifier.
    Read(ParamRead),
    /// A read in the mask modifier.
    MaskRead(ParamRead),
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
        let shape = Declared {
            what: "parameter",
            name,
            twice: spec.params[..i].iter().any(|p| p.name == *name),
            clashes: name
                .strip_prefix('d')
                .is_some_and(|base| spec.params.iter().any(|p| p.name == base)),
            rank: decl.dims.len(),
            zero: decl.dims.contains(&ParamDim::Fixed(0)),
            dims_allowed: "`heads` or `kv_heads`",
        };
        shape.findings().into_iter().for_each(&mut say);
        if let Some(problem) = decl.init.problem(decl) {
            say(problem);
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
    data_findings(spec, &mut out);
    if let Some(m) = &spec.mask_mod
        && m.body
            .param_reads()
            .iter()
            .any(|r| spec.param(&r.name).is_some())
    {
        out.push((
            Subject::MaskMod,
            "mask_mod reads a parameter; masks are not differentiable, so parameters may be \
             read only in score_mod (data tensors may be read in both)"
                .to_string(),
        ));
    }
    if let Some(m) = &spec.score_mod {
        for read in m.body.param_reads() {
            if let Some(message) = read_finding(spec, &read, "score_mod") {
                out.push((Subject::Read(read), message));
            }
        }
    }
    if let Some(m) = &spec.mask_mod {
        for read in m.body.param_reads() {
            if spec.param(&read.name).is_none()
                && let Some(message) = read_finding(spec, &read, "mask_mod")
            {
                out.push((Subject::MaskRead(read), message));
            }
        }
    }
    out
}

/// The rules about `data(...)` declarations.
fn data_findings(spec: &AttentionSpec, out: &mut Vec<(Subject, String)>) {
    if spec.data.is_empty() {
        return;
    }
    if spec.mla().is_some() {
        out.push((
            Subject::Spec,
            "data(...) is not supported with mla(...) yet".to_string(),
        ));
    }
    if spec.data.len() > MAX_DATA {
        out.push((
            Subject::DataDecl(MAX_DATA),
            format!(
                "{} data tensors are declared; allowed: at most {MAX_DATA}",
                spec.data.len()
            ),
        ));
    }
    for (i, decl) in spec.data.iter().enumerate() {
        let name = &decl.name;
        let mut say = |m: String| out.push((Subject::DataDecl(i), m));
        let gradient_of = |base: &str| {
            spec.params.iter().any(|p| p.name == base)
                || spec
                    .data
                    .iter()
                    .any(|d| d.name == base && d.dtype == crate::spec::DataType::F32)
        };
        let shape = Declared {
            what: "data tensor",
            name,
            twice: spec.data[..i].iter().any(|d| d.name == *name),
            clashes: name.strip_prefix('d').is_some_and(gradient_of),
            rank: decl.dims.len(),
            zero: decl.dims.contains(&DataDim::Fixed(0)),
            dims_allowed: "`heads`, `kv_heads`, `batch` or `seq`",
        };
        shape.findings().into_iter().for_each(&mut say);
        if spec.param(name).is_some() {
            say(format!(
                "`{name}` is declared both in params(...) and in data(...); rename one"
            ));
        }
        // Per batch item and key, a tensor holds the product of its other dimensions.
        let fixed = spec
            .data_shape(decl, 1, 1)
            .iter()
            .fold(1u64, |n, d| n.saturating_mul(*d as u64));
        if fixed > MAX_PARAM_ELEMENTS {
            say(format!(
                "`{name}` holds {fixed} elements per batch item and key; allowed: at most \
                 {MAX_PARAM_ELEMENTS} (2^24)"
            ));
        }
    }
}

/// What a declaration's name and dimensions must satisfy, in `params(...)` and `data(...)`
/// alike.
struct Declared<'a> {
    /// "parameter" or "data tensor".
    what: &'static str,
    name: &'a str,
    /// Whether an earlier declaration has the name.
    twice: bool,
    /// Whether the name is `d` and another tensor's name, whose gradient it would clash with.
    clashes: bool,
    rank: usize,
    /// Whether a dimension is 0.
    zero: bool,
    /// The words a dimension may be besides an integer.
    dims_allowed: &'static str,
}

impl Declared<'_> {
    fn findings(&self) -> Vec<String> {
        let (what, name) = (self.what, self.name);
        let mut out = Vec::new();
        if !is_identifier(name) || name.len() > MAX_PARAM_NAME {
            out.push(format!(
                "`{name}` is not a {what} name; allowed: an identifier of at most \
                 {MAX_PARAM_NAME} bytes"
            ));
        }
        if RESERVED_NAMES.contains(&name) {
            out.push(format!(
                "`{name}` is reserved; a {what} may not be called {}",
                RESERVED_NAMES.join(", ")
            ));
        }
        if self.twice {
            out.push(format!("{what} `{name}` is declared twice"));
        }
        if self.clashes {
            let base = &name[1..];
            out.push(format!(
                "`{name}` would clash with the gradient of `{base}`, which is written as \
                 `{name}`; rename it"
            ));
        }
        if self.rank == 0 || self.rank > MAX_PARAM_DIMS {
            out.push(format!(
                "`{name}` has {} dimensions; allowed: 1 to {MAX_PARAM_DIMS}",
                self.rank
            ));
        }
        if self.zero {
            out.push(format!(
                "`{name}` has a dimension of 0; allowed: 1 or more, {}",
                self.dims_allowed
            ));
        }
        out
    }
}

/// What is wrong with one read: an unknown name, the wrong number of indices, or an index not
/// proved in range.
fn read_finding(spec: &AttentionSpec, read: &ParamRead, modifier: &str) -> Option<String> {
    let name = &read.name;
    // Fixed dimensions resolved; `None` for a call's `batch` and `seq`.
    let (dims, ty): (Vec<Option<usize>>, _) = if let Some(decl) = spec.param(name) {
        let shape = spec.param_shape(decl).into_iter().map(Some).collect();
        (shape, crate::modifier::Ty::F32)
    } else if let Some(decl) = spec.data_decl(name) {
        let shape = spec.data_shape(decl, 0, 0);
        let dims = decl
            .dims
            .iter()
            .zip(shape)
            .map(|(d, n)| (!matches!(d, DataDim::Batch | DataDim::Seq)).then_some(n))
            .collect();
        (dims, decl.dtype.read_ty())
    } else {
        return Some(format!("unknown tensor `{name}` in {modifier}"));
    };
    if read.indices.len() != dims.len() {
        return Some(format!(
            "`{name}` has {} dimensions, read with {} indices",
            dims.len(),
            read.indices.len()
        ));
    }
    if read.ty != ty {
        return Some(format!(
            "`{name}` is read as {}; its elements read as {}",
            read.ty.name(),
            ty.name()
        ));
    }
    let bounds = everywhere(spec);
    for (axis, (index, dim)) in read.indices.iter().zip(dims).enumerate() {
        let Some(dim) = dim else {
            continue;
        };
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
