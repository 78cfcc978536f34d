//! Data tensors (`data(...)`) in a variable-length batch: a tensor with a `seq` dimension is
//! packed along it as k is (`total_k` entries, sequence `i`'s keys at `cu_seqlens_k[i]..`) and
//! has no `batch` dimension; one without `seq` has `batch` = the number of sequences. Each
//! sequence's call takes its slice (`batch` 1, `seq` its keys), and the gradients of f32 data
//! come back placed where the slices were taken.

use crate::error::RuntimeError;
use crate::learned::{Data, DataBuf, DataValues, DataVec};
use crate::tensor::Tensor;
use attn_dsl::modifier::{Expr, Var};
use attn_dsl::{AttentionSpec, DataDecl, DataDim};
use std::ops::Range;

/// The shape a variable-length call gives `decl`, for `sequences` sequences and `total_k` keys.
pub(crate) fn packed_shape(
    spec: &AttentionSpec,
    decl: &DataDecl,
    sequences: usize,
    total_k: usize,
) -> Vec<usize> {
    let has_seq = decl.dims.contains(&DataDim::Seq);
    decl.dims
        .iter()
        .zip(spec.data_shape(decl, sequences, total_k))
        .filter(|(d, _)| !(has_seq && **d == DataDim::Batch))
        .map(|(_, n)| n)
        .collect()
}

/// Where sequence `i`'s slice of a tensor of `shape` lies: the axis it is cut along and the
/// range of that axis.
fn cut(decl: &DataDecl, shape: &[usize], i: usize, rows_k: &Range<usize>) -> (usize, Range<usize>) {
    match decl.dims.iter().position(|d| *d == DataDim::Seq) {
        Some(seq) => {
            let batch_before = decl.dims[..seq].contains(&DataDim::Batch);
            (seq - usize::from(batch_before), rows_k.clone())
        }
        None => match decl.dims.iter().position(|d| *d == DataDim::Batch) {
            Some(b) => (b, i..i + 1),
            None => (0, 0..shape.first().copied().unwrap_or(0)),
        },
    }
}

/// The flat ranges of a cut: for each combination of the axes before it, one run of elements.
fn runs(shape: &[usize], axis: usize, range: &Range<usize>) -> impl Iterator<Item = Range<usize>> {
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let along = shape.get(axis).copied().unwrap_or(1);
    let range = range.clone();
    (0..outer).map(move |o| {
        let base = o * along * inner;
        base + range.start * inner..base + range.end * inner
    })
}

/// Checks each given data tensor's name and shape against the packed one a variable-length
/// call gives it (the per-sequence calls name the missing and the doubled).
pub(crate) fn check(
    spec: &AttentionSpec,
    data: &[(&str, Data)],
    sequences: usize,
    total_k: usize,
) -> Result<(), RuntimeError> {
    if let Some((name, _)) = data.iter().find(|(n, _)| spec.data_decl(n).is_none()) {
        let declared: Vec<&str> = spec.data.iter().map(|d| d.name.as_str()).collect();
        return Err(RuntimeError::Spec(format!(
            "tensor `{name}` is not a data tensor of this spec; it declares: {}",
            if declared.is_empty() {
                "none".to_string()
            } else {
                declared.join(", ")
            }
        )));
    }
    for decl in &spec.data {
        let want = packed_shape(spec, decl, sequences, total_k);
        for (_, d) in data.iter().filter(|(n, _)| *n == decl.name) {
            if d.shape != want.as_slice() || d.values_len() != want.iter().product::<usize>() {
                return Err(RuntimeError::Shape {
                    tensor: decl.name.clone(),
                    found: d.shape.to_vec(),
                    expected: format!(
                        "{want:?} (a variable-length batch: `seq` packed as k's rows, no \
                         `batch` beside it)"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Sequence `i`'s slices of the data tensors (`batch` 1, `seq` its `rows_k`), as its call
/// takes them.
pub(crate) fn for_sequence(
    spec: &AttentionSpec,
    data: &[(&str, Data)],
    i: usize,
    rows_k: &Range<usize>,
) -> Vec<(String, DataBuf)> {
    data.iter()
        .filter_map(|(name, d)| {
            let decl = spec.data_decl(name)?;
            let (axis, range) = cut(decl, d.shape, i, rows_k);
            let pieces = runs(d.shape, axis, &range);
            let values = match d.values {
                DataValues::I32(v) => DataVec::I32(pieces.flat_map(|r| v[r].to_vec()).collect()),
                DataValues::F32(v) => DataVec::F32(pieces.flat_map(|r| v[r].to_vec()).collect()),
            };
            let shape = spec.data_shape(decl, 1, rows_k.len());
            Some((name.to_string(), DataBuf { shape, values }))
        })
        .collect()
}

/// Places sequence `i`'s gradient `grad` of data tensor `decl` (its slice's shape) into `full`,
/// the gradient of the packed tensor of `shape`.
pub(crate) fn place_gradient(
    decl: &DataDecl,
    shape: &[usize],
    i: usize,
    rows_k: &Range<usize>,
    grad: &Tensor,
    full: &mut [f32],
) {
    let (axis, range) = cut(decl, shape, i, rows_k);
    let values = grad.to_f32_vec();
    let mut at = 0;
    for r in runs(shape, axis, &range) {
        let n = r.len();
        full[r].copy_from_slice(&values[at..at + n]);
        at += n;
    }
}

/// Whether `expr` uses the batch index `b` other than as the `batch` index of a data read
/// (which a sequence's call, slicing the data, gives as 0).
pub(crate) fn reads_batch_index(spec: &AttentionSpec, expr: &Expr) -> bool {
    match expr {
        Expr::Var(v) => *v == Var::Batch,
        Expr::Float(_) | Expr::Int(_) | Expr::Bool(_) => false,
        Expr::Unary(_, a) | Expr::Cast(a, _) | Expr::Table(_, a) => reads_batch_index(spec, a),
        Expr::Binary(_, a, b) => reads_batch_index(spec, a) || reads_batch_index(spec, b),
        Expr::Select(c, t, f) => {
            reads_batch_index(spec, c) || reads_batch_index(spec, t) || reads_batch_index(spec, f)
        }
        Expr::Param(read) => {
            let dims = spec.data_decl(&read.name).map(|d| d.dims.as_slice());
            read.indices.iter().enumerate().any(|(axis, index)| {
                let batch_axis = dims.and_then(|d| d.get(axis)) == Some(&DataDim::Batch);
                !(batch_axis && *index == Expr::Var(Var::Batch)) && reads_batch_index(spec, index)
            })
        }
    }
}
