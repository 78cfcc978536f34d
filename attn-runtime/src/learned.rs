//! A call's learnable tensors: the parameters a spec's score modifier reads
//! (`params(NAME: [DIM, ..])`) and its sink logits (`sinks = learned`), and its data tensors
//! (`data(NAME: [DIM, ..] TYPE)`).
//!
//! [`Learned`] names the caller's tensors; binding checks them against the spec and the call
//! (each present once, with its shape; data of its type, read in range) and lays the
//! parameters, the data headers and the data out as kernels read them
//! ([`codegen::plan::ParamLayout`]). Parameters and data are read inside the kernels. Sinks are exact
//! host passes around any backend's kernels (docs/semantics.md, "Learnable tensors"):
//! - forward and cached calls: `lse' = logaddexp(lse, sinks[h])`, `out' = out exp(lse - lse')`
//!   (the kernels' rows never see the sink; a split-KV merge happens before, so each row counts
//!   its sink once);
//! - backward: given `out'` and `lse'`, the kernels' `P = exp(S - lse')` and
//!   `D = rowsum(dout out')` are already right for dq, dk, dv and the parameters; the sinks'
//!   gradient is `dsinks[h] = -sum_rows exp(sinks[h] - lse'_row) D_row`, summed here in f64 in
//!   row order, so it is the same from run to run and for any thread count.

use crate::error::RuntimeError;
use crate::tensor::{Storage, Tensor};
use attn_dsl::data::{CallDims, check_reads};
use attn_dsl::{AttentionSpec, DataDim, DataType, Mismatch, SINKS_NAME, Sinks, match_call};
use codegen::plan::ParamLayout;
use rayon::prelude::*;

/// The learnable tensors of one call, by name, and its data tensors.
#[derive(Clone, Copy, Debug, Default)]
pub struct Learned<'a> {
    tensors: &'a [(&'a str, &'a Tensor)],
    data: &'a [(&'a str, Data<'a>)],
}

/// A data tensor of a call: its shape and its values, row-major.
#[derive(Clone, Copy, Debug)]
pub struct Data<'a> {
    /// The shape.
    pub shape: &'a [usize],
    /// The values.
    pub values: DataValues<'a>,
}

/// The values of a [`Data`] tensor, of the type its declaration names.
#[derive(Clone, Copy, Debug)]
pub enum DataValues<'a> {
    /// i32 values.
    I32(&'a [i32]),
    /// f32 values.
    F32(&'a [f32]),
}

impl Data<'_> {
    /// The number of values.
    pub(crate) fn values_len(&self) -> usize {
        self.values.len()
    }
}

impl DataValues<'_> {
    fn len(&self) -> usize {
        match self {
            DataValues::I32(v) => v.len(),
            DataValues::F32(v) => v.len(),
        }
    }

    fn dtype(&self) -> DataType {
        match self {
            DataValues::I32(_) => DataType::I32,
            DataValues::F32(_) => DataType::F32,
        }
    }
}

/// A data tensor that owns its values (as files are read).
#[derive(Clone, Debug, PartialEq)]
pub struct DataBuf {
    /// The shape.
    pub shape: Vec<usize>,
    /// The values, row-major.
    pub values: DataVec,
}

/// The values of a [`DataBuf`].
#[derive(Clone, Debug, PartialEq)]
pub enum DataVec {
    /// i32 values.
    I32(Vec<i32>),
    /// f32 values.
    F32(Vec<f32>),
}

/// Data tensors owned by name, as a call takes them.
pub fn data_views(owned: &[(String, DataBuf)]) -> Vec<(&str, Data<'_>)> {
    owned
        .iter()
        .map(|(n, d)| (n.as_str(), d.as_data()))
        .collect()
}

impl DataBuf {
    /// The tensor as a call takes it.
    pub fn as_data(&self) -> Data<'_> {
        Data {
            shape: &self.shape,
            values: match &self.values {
                DataVec::I32(v) => DataValues::I32(v),
                DataVec::F32(v) => DataValues::F32(v),
            },
        }
    }
}

/// Most 32-bit words a call's parameters and data may take: kernels index them with i32
/// headers.
const MAX_BUFFER_WORDS: usize = i32::MAX as usize;

impl<'a> Learned<'a> {
    /// No learnable tensors (for specs without parameters or sinks).
    pub fn none() -> Learned<'static> {
        Learned {
            tensors: &[],
            data: &[],
        }
    }

    /// The tensors `(name, tensor)`: each declared parameter by its name, and `sinks`.
    pub fn new(tensors: &'a [(&'a str, &'a Tensor)]) -> Learned<'a> {
        Learned { tensors, data: &[] }
    }

    /// The call's data tensors.
    pub(crate) fn data(&self) -> &'a [(&'a str, Data<'a>)] {
        self.data
    }

    /// These tensors and the call's data tensors `(name, data)`, each declared one by its
    /// name.
    pub fn with_data(self, data: &'a [(&'a str, Data<'a>)]) -> Learned<'a> {
        Learned { data, ..self }
    }

    /// The learnable tensor named `name`, if the call has one.
    pub(crate) fn tensor(&self, name: &str) -> Option<&'a Tensor> {
        self.tensors
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, t)| *t)
    }

    /// Checks the tensors against `spec` and lays them out for the kernels, for a call without
    /// data tensors (a spec that declares some is refused).
    pub fn bind(&self, spec: &AttentionSpec) -> Result<Bound, RuntimeError> {
        if let Some(d) = spec.data.first() {
            return Err(RuntimeError::Spec(format!(
                "this call does not take data tensors yet (the spec declares `{}`); forward and \
                 backward calls do",
                d.name
            )));
        }
        self.bind_call(spec, &CallDims::new(0, 0, 0, 0))
    }

    /// Checks the tensors against `spec` and a call of shape `call` (data tensors of its shapes
    /// and types, every read of one in range) and lays them out for the kernels.
    pub fn bind_call(&self, spec: &AttentionSpec, call: &CallDims) -> Result<Bound, RuntimeError> {
        let named: Vec<(&str, &[usize])> = self
            .tensors
            .iter()
            .map(|(n, t)| (*n, t.shape()))
            .chain(self.data.iter().map(|(n, d)| (*n, d.shape)))
            .collect();
        let order = match_call(spec, &named, call).map_err(|e| match e {
            Mismatch::Shape {
                name,
                found,
                expected,
                ..
            } => RuntimeError::Shape {
                tensor: name,
                found,
                expected: format!("{expected:?} (from the spec)"),
            },
            other => RuntimeError::Spec(other.to_string()),
        })?;
        let layout = ParamLayout::of(spec);
        let mut params = Vec::with_capacity(layout.len());
        let mut sinks = None;
        let mut data = Vec::new();
        for i in order {
            if let Some((name, t)) = self.tensors.get(i) {
                let values = t.to_f32_vec();
                if *name == SINKS_NAME && spec.sinks == Sinks::Learned {
                    sinks = Some(values);
                } else {
                    params.extend(values);
                }
            } else {
                data.push(self.data[i - self.tensors.len()].1);
            }
        }
        check_reads(spec, call).map_err(RuntimeError::Data)?;
        let data_grads = lay_out_data(spec, &layout, call, &data, &mut params)?;
        Ok(Bound {
            params,
            sinks,
            data_grads,
        })
    }
}

/// Appends the data headers and the data (in declaration order, as `data` is) to `params`,
/// and a word past the last, which an empty tensor's clamped reads read. Returns where each
/// f32 tensor lies, for its gradient.
fn lay_out_data(
    spec: &AttentionSpec,
    layout: &ParamLayout,
    call: &CallDims,
    data: &[Data],
    params: &mut Vec<f32>,
) -> Result<Vec<(String, usize, Vec<usize>)>, RuntimeError> {
    if data.is_empty() {
        return Ok(Vec::new());
    }
    let total = data
        .iter()
        .try_fold(layout.len() + 1, |n, d| n.checked_add(d.values.len()))
        .filter(|n| *n <= MAX_BUFFER_WORDS)
        .ok_or_else(|| {
            RuntimeError::Data(format!(
                "the call's data tensors hold more than {MAX_BUFFER_WORDS} values in all; allowed: \
                 at most that"
            ))
        })?;
    let origin = i32::try_from(call.data_seq().0).map_err(|_| {
        RuntimeError::Data(format!(
            "position offset {} is outside i32, which data tensors' `seq` reads index by",
            call.data_seq().0
        ))
    })?;
    let word = |x: i64| f32::from_bits(x as i32 as u32);
    params.resize(layout.len(), 0.0);
    params.reserve(total - layout.len());
    let mut grads = Vec::new();
    for ((decl, slot), d) in spec.data.iter().zip(&layout.data).zip(data) {
        if d.values.dtype() != decl.dtype {
            return Err(RuntimeError::Data(format!(
                "data tensor `{}` is given as {}; the spec declares it {}",
                decl.name,
                d.values.dtype().name(),
                decl.dtype.name()
            )));
        }
        if d.values.len() != d.shape.iter().product::<usize>() {
            return Err(RuntimeError::Data(format!(
                "data tensor `{}` has {} values for shape {:?}",
                decl.name,
                d.values.len(),
                d.shape
            )));
        }
        let first = params.len();
        params[slot.header] = word(first as i64);
        for (axis, (len, dim)) in d.shape.iter().zip(&decl.dims).enumerate() {
            params[slot.header + 1 + axis] = word(*len as i64);
            let o = if *dim == DataDim::Seq { origin } else { 0 };
            params[slot.header + 1 + slot.rank + axis] = word(i64::from(o));
        }
        match d.values {
            DataValues::I32(v) => params.extend(v.iter().map(|x| f32::from_bits(*x as u32))),
            DataValues::F32(v) => {
                grads.push((decl.name.clone(), first, d.shape.to_vec()));
                params.extend_from_slice(v);
            }
        }
    }
    params.push(0.0);
    Ok(grads)
}

/// A call's learnable tensors, checked and laid out.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Bound {
    /// Every parameter, concatenated as [`ParamLayout`] says, then the data headers and the
    /// data; empty without parameters and data.
    pub params: Vec<f32>,
    /// `sinks[h]`, for specs with learned sinks.
    pub sinks: Option<Vec<f32>>,
    /// Each f32 data tensor's name, first element in `params` and shape (where its gradient
    /// lies in the parameters' gradients).
    pub data_grads: Vec<(String, usize, Vec<usize>)>,
}

impl Bound {
    /// Adds the sinks to an output whose `lse` has one entry per row of `out` (per-head
    /// `[B, H, S]` or ragged `[T, H]`), `heads` query heads, in place.
    pub fn apply_sinks(
        &self,
        out: &mut Tensor,
        lse: &mut Tensor,
        heads: usize,
    ) -> Result<(), RuntimeError> {
        let Some(sinks) = &self.sinks else {
            return Ok(());
        };
        let head_of = head_index(lse.shape(), heads)?;
        let (shape, dtype) = (out.shape().to_vec(), out.dtype());
        let mut l = lse.to_f32_vec();
        // f32 outputs are scaled in their own buffer (a fresh output is its only view).
        let taken = std::mem::replace(out, Tensor::from_f32(&[0], Vec::new())?);
        let mut storage = taken.into_storage();
        let mut o = match &mut storage {
            Storage::F32(values) => std::mem::take(values).into_vec(),
            _ => Tensor::new(&shape, storage)?.to_f32_vec(),
        };
        let width = o.len().checked_div(l.len()).unwrap_or(0);
        if width > 0 {
            o.par_chunks_mut(width)
                .zip(l.par_iter_mut())
                .enumerate()
                .for_each(|(r, (row, lse_r))| {
                    let sink = sinks[head_of(r)];
                    // A +inf logit makes its row NaN, as a +inf score does (inf - inf in the
                    // softmax).
                    let merged = if sink == f32::INFINITY {
                        f32::NAN
                    } else {
                        logaddexp(*lse_r, sink)
                    };
                    let keep = if merged.is_nan() {
                        f32::NAN
                    } else if *lse_r == f32::NEG_INFINITY {
                        0.0
                    } else {
                        (*lse_r - merged).exp()
                    };
                    row.iter_mut().for_each(|x| *x *= keep);
                    *lse_r = merged;
                });
        }
        *out = Tensor::from_f32_as(dtype, &shape, o)?;
        *lse = Tensor::from_f32(lse.shape(), l)?;
        Ok(())
    }

    /// `dsinks[h] = -sum_rows exp(sinks[h] - lse_row) rowsum(dout_row out_row)`, over a
    /// backward call's `out`, `lse` and `dout` (with the sinks already in `out` and `lse`).
    pub fn sink_gradient(
        &self,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        heads: usize,
    ) -> Result<Option<Vec<f32>>, RuntimeError> {
        let Some(sinks) = &self.sinks else {
            return Ok(None);
        };
        let head_of = head_index(lse.shape(), heads)?;
        let (o, l, g) = (out.f32_values(), lse.to_f32_vec(), dout.f32_values());
        let width = o.len().checked_div(l.len()).unwrap_or(0);
        // Each row's share in parallel, then summed in row order: the same bits for any thread
        // count.
        let shares: Vec<f64> = (0..l.len())
            .into_par_iter()
            .map(|r| {
                if l[r] == f32::NEG_INFINITY {
                    return 0.0;
                }
                let p_sink = (f64::from(sinks[head_of(r)]) - f64::from(l[r])).exp();
                let rows = (
                    &o[r * width..(r + 1) * width],
                    &g[r * width..(r + 1) * width],
                );
                let delta: f64 = rows
                    .0
                    .iter()
                    .zip(rows.1)
                    .map(|(x, y)| f64::from(*x) * f64::from(*y))
                    .sum();
                p_sink * delta
            })
            .collect();
        let mut d = vec![0f64; sinks.len()];
        for (r, share) in shares.iter().enumerate() {
            d[head_of(r)] -= share;
        }
        Ok(Some(d.into_iter().map(|x| x as f32).collect()))
    }
}

/// `ln(e^a + e^b)`, exact at infinities (`-inf` is no mass; NaN stays NaN).
fn logaddexp(a: f32, b: f32) -> f32 {
    let (a, b) = (f64::from(a), f64::from(b));
    if a.is_nan() || b.is_nan() {
        return f32::NAN;
    }
    let m = a.max(b);
    if m.is_infinite() {
        return m as f32;
    }
    (m + ((a - m).exp() + (b - m).exp()).ln()) as f32
}

/// The query head of each entry of an lse of shape `[B, H, S]` or `[T, H]`.
fn head_index(
    shape: &[usize],
    heads: usize,
) -> Result<impl Fn(usize) -> usize + Sync + use<>, RuntimeError> {
    let per_head = match shape {
        [_, h, s] if *h == heads => *s,
        [_, h] if *h == heads => 1,
        _ => {
            return Err(RuntimeError::Shape {
                tensor: "lse".to_string(),
                found: shape.to_vec(),
                expected: format!("[B, {heads}, S] or [T, {heads}]"),
            });
        }
    };
    Ok(move |r: usize| (r / per_head.max(1)) % heads)
}
