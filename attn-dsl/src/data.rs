//! Data tensors in a call (docs/semantics.md, "Data tensors"): the shapes a call gives them,
//! the check that every read along a `batch` or `seq` dimension stays in range over the call's
//! points, and the reads as the reference evaluates them (`seq` indices moved by the call's
//! position offset).
//!
//! Along `seq`, a read at index `i` reads entry `i - position_offset`: a prefill's key `k`
//! reads entry `k - position_offset`, its key index, and a query reads the entry of the key at
//! its own position.

use crate::modifier::interval::{Interval, Range, TileBounds, analyze};
use crate::modifier::{BinOp, Expr, MaskMod, ParamRead, Ty, Var};
use crate::spec::{AttentionSpec, DataDecl, DataDim, DataType};

/// What a call's data tensors are checked against: its batch, query and key counts and the
/// position of key 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallDims {
    /// Batch items (in a variable-length call, the sequences).
    pub batch: usize,
    /// Queries per item.
    pub sq: usize,
    /// Keys per item (the length of a `seq` dimension).
    pub skv: usize,
    /// The position of key 0.
    pub position_offset: i64,
    /// How far the queries lie past bottom-right alignment (a piece of a context-parallel
    /// call; 0 otherwise): query `i` is at `position_offset + skv - sq + query_shift + i`.
    pub query_shift: i64,
    /// Where the data tensors' `seq` dimension lies, its first position and its length, when
    /// not over the call's own keys (a piece of a context-parallel call reads the whole
    /// sequence's data).
    pub data_seq: Option<(i64, usize)>,
}

impl CallDims {
    /// A call of `batch` items, `sq` queries against `skv` keys from `position_offset`, its
    /// queries aligned bottom-right and its data over its keys.
    pub fn new(batch: usize, sq: usize, skv: usize, position_offset: i64) -> CallDims {
        CallDims {
            batch,
            sq,
            skv,
            position_offset,
            query_shift: 0,
            data_seq: None,
        }
    }

    /// The first position and the length of the data tensors' `seq` dimension.
    pub fn data_seq(&self) -> (i64, usize) {
        self.data_seq.unwrap_or((self.position_offset, self.skv))
    }

    /// The box of every point the call evaluates a modifier at (queries aligned bottom-right),
    /// `Ok(None)` when it evaluates none (no batch item, query or key); an error when its
    /// positions leave i64.
    fn points(&self, spec: &AttentionSpec) -> Result<Option<TileBounds>, String> {
        if self.batch == 0 || self.sq == 0 || self.skv == 0 {
            return Ok(None);
        }
        let as_i64 = |n: usize| i64::try_from(n).ok();
        let positions = || {
            let (sq, skv, p0) = (as_i64(self.sq)?, as_i64(self.skv)?, self.position_offset);
            let last_key = p0.checked_add(skv - 1)?;
            let first_query = last_key
                .checked_sub(sq - 1)?
                .checked_add(self.query_shift)?;
            Some((first_query, last_key, sq, skv))
        };
        let (first_query, last_key, sq, skv) = positions().ok_or_else(|| {
            format!(
                "{} queries and {} keys from position {} leave the range of positions",
                self.sq, self.skv, self.position_offset
            )
        })?;
        Ok(Some(TileBounds {
            batch: Interval::new(0, self.batch as i64 - 1),
            head: Interval::new(0, i64::from(spec.heads.max(1)) - 1),
            query: Interval::new(first_query, first_query + (sq - 1)),
            key: Interval::new(self.position_offset, last_key),
            query_index: Interval::new(0, sq - 1),
            key_index: Interval::new(0, skv - 1),
        }))
    }
}

/// Every data tensor the spec declares, with its shape in the call, in declaration order.
pub fn call_shapes(spec: &AttentionSpec, call: &CallDims) -> Vec<(String, Vec<usize>)> {
    spec.data
        .iter()
        .map(|d| {
            (
                d.name.clone(),
                spec.data_shape(d, call.batch, call.data_seq().1),
            )
        })
        .collect()
}

/// Checks that every read of a data tensor along a `batch` or `seq` dimension is in range at
/// every point of the call (a `seq` index after subtracting the position offset); the error
/// names the tensor, the index expression and both ranges.
pub fn check_reads(spec: &AttentionSpec, call: &CallDims) -> Result<(), String> {
    if spec.data.is_empty() {
        return Ok(());
    }
    let Some(points) = call.points(spec)? else {
        return Ok(());
    };
    for (modifier, read) in data_reads(spec) {
        let decl = spec
            .data_decl(&read.name)
            .expect("validation resolves every read");
        for (axis, (index, dim)) in read.indices.iter().zip(&decl.dims).enumerate() {
            let (len, shift, what) = match dim {
                DataDim::Batch => (call.batch, 0, "the batch"),
                DataDim::Seq => {
                    let (origin, len) = call.data_seq();
                    (len, origin, "the keys")
                }
                _ => continue,
            };
            let Range::Int(r) = analyze(index, &points) else {
                return Err(format!("index {axis} of `{}` is not an integer", read.name));
            };
            let (lo, hi) = (r.lo.saturating_sub(shift), r.hi.saturating_sub(shift));
            if lo < 0 || hi > len as i64 - 1 {
                let shifted = if shift == 0 {
                    String::new()
                } else {
                    format!(" (minus the position offset {shift})")
                };
                return Err(format!(
                    "{modifier} reads `{}` at index {axis} `{index}`, which over this call's \
                     points may be anywhere in [{lo}, {hi}]{shifted}; allowed: 0 to {} \
                     (dimension {axis} is {what}, {len} long); clamp the index or change the \
                     call's shapes",
                    read.name,
                    len as i64 - 1
                ));
            }
        }
    }
    Ok(())
}

/// The spec with each `seq` index of a data read moved by `-position_offset`: the reads of a
/// call at that offset, as plain clamped reads (how the reference evaluates them).
pub fn reads_at_offset(spec: &AttentionSpec, position_offset: i64) -> AttentionSpec {
    let mut out = spec.clone();
    if spec.data.is_empty() || position_offset == 0 {
        return out;
    }
    if let Some(m) = &mut out.score_mod {
        m.body = shift(&m.body, spec, position_offset);
    }
    if let Some(m) = &mut out.mask_mod {
        m.body = shift(&m.body, spec, position_offset);
    }
    out
}

/// A warning for each read of a data tensor's `seq` dimension at an index that uses the query
/// position `q`, for users coming from FlexAttention: attn aligns queries bottom-right, so with
/// fewer queries than keys (a chunk after a prefix, a decode step) query row `i` reads the entry
/// of the key at its position, `Skv - Sq + i`, where FlexAttention's `q_idx` would read entry
/// `i`.
pub fn query_alignment_warnings(spec: &AttentionSpec) -> Vec<String> {
    let mut out = Vec::new();
    for (modifier, read) in data_reads(spec) {
        let decl = spec
            .data_decl(&read.name)
            .expect("validation resolves every read");
        for (index, dim) in read.indices.iter().zip(&decl.dims) {
            if *dim == DataDim::Seq && index.uses(crate::modifier::Var::Query) {
                out.push(format!(
                    "{modifier} reads `{}` along `seq` at `{index}`: queries are aligned \
                     bottom-right, so when a call has fewer queries than keys, query row i reads \
                     the entry of the key at its position (Skv - Sq + i), not entry i as \
                     FlexAttention's q_idx would",
                    read.name
                ));
            }
        }
    }
    out
}

/// The name of the document-id tensor [`with_document_mask`] adds.
pub const DOCUMENT_IDS: &str = "doc";

/// `spec` restricted to documents: the data tensor `doc: [batch, seq] i32` (each key's document
/// id) and `doc[b, q] == doc[b, k]` ANDed with its mask (a packed window's documents attend
/// only within themselves). An error for a spec that declares a tensor named `doc` already, or
/// that the addition leaves invalid (MLA, say).
pub fn with_document_mask(spec: &AttentionSpec) -> Result<AttentionSpec, String> {
    if spec.data_decl(DOCUMENT_IDS).is_some() || spec.param(DOCUMENT_IDS).is_some() {
        return Err(format!(
            "a document mask adds a data tensor `{DOCUMENT_IDS}`; this spec has a tensor of \
             that name"
        ));
    }
    let read = |at: Var| {
        Expr::Param(ParamRead {
            name: DOCUMENT_IDS.to_string(),
            indices: vec![Expr::Var(Var::Batch), Expr::Var(at)],
            ty: Ty::I64,
        })
    };
    let same_document = Expr::binary(BinOp::Eq, read(Var::Query), read(Var::Key));
    let mut out = spec.clone();
    out.data.push(DataDecl {
        name: DOCUMENT_IDS.to_string(),
        dims: vec![DataDim::Batch, DataDim::Seq],
        dtype: DataType::I32,
    });
    out.mask_mod = Some(match &spec.mask_mod {
        Some(m) => MaskMod {
            params: m.params.clone(),
            body: Expr::binary(BinOp::And, m.body.clone(), same_document),
            lets: m.lets.clone(),
        },
        None => MaskMod {
            params: ["b", "h", "q", "k"].map(String::from),
            body: same_document,
            lets: Vec::new(),
        },
    });
    out.validate().map_err(|findings| {
        let said: Vec<String> = findings.iter().map(|f| f.message.clone()).collect();
        format!(
            "with a document mask the spec is invalid: {}",
            said.join("; ")
        )
    })?;
    Ok(out)
}

/// Every data read of the modifiers, with the modifier's name.
fn data_reads(spec: &AttentionSpec) -> Vec<(&'static str, ParamRead)> {
    let score = spec.score_mod.iter().map(|m| ("score_mod", &m.body));
    let mask = spec.mask_mod.iter().map(|m| ("mask_mod", &m.body));
    score
        .chain(mask)
        .flat_map(|(what, body)| body.param_reads().into_iter().map(move |r| (what, r)))
        .filter(|(_, r)| spec.data_decl(&r.name).is_some())
        .collect()
}

/// `e` with `seq` indices of data reads moved by `-p0`. Recursive: validation bounds the depth
/// of every modifier.
fn shift(e: &Expr, spec: &AttentionSpec, p0: i64) -> Expr {
    let go = |x: &Expr| Box::new(shift(x, spec, p0));
    match e {
        Expr::Var(_) | Expr::Float(_) | Expr::Int(_) | Expr::Bool(_) => e.clone(),
        Expr::Unary(op, a) => Expr::Unary(*op, go(a)),
        Expr::Binary(op, a, b) => Expr::Binary(*op, go(a), go(b)),
        Expr::Select(c, t, f) => Expr::Select(go(c), go(t), go(f)),
        Expr::Cast(a, ty) => Expr::Cast(go(a), *ty),
        Expr::Table(values, i) => Expr::Table(values.clone(), go(i)),
        Expr::Param(read) => {
            let dims = spec.data_decl(&read.name).map(|d| d.dims.as_slice());
            let indices = read
                .indices
                .iter()
                .enumerate()
                .map(|(axis, i)| match dims.and_then(|d| d.get(axis)) {
                    Some(DataDim::Seq) => {
                        Expr::binary(crate::modifier::BinOp::Sub, i.clone(), Expr::Int(p0))
                    }
                    _ => i.clone(),
                })
                .collect();
            Expr::Param(ParamRead {
                name: read.name.clone(),
                indices,
                ty: read.ty,
            })
        }
    }
}
