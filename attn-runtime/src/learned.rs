//! A call's learnable tensors: the parameters a spec's score modifier reads
//! (`params(NAME: [DIM, ..])`) and its sink logits (`sinks = learned`).
//!
//! [`Learned`] names the caller's tensors; binding checks them against the spec (each present
//! once, f32-convertible, with its shape) and lays the parameters out as kernels read them
//! ([`codegen::plan::ParamLayout`]). Parameters are read inside the kernels. Sinks are exact
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
use attn_dsl::{AttentionSpec, Mismatch, SINKS_NAME, Sinks, match_learned};
use codegen::plan::ParamLayout;
use rayon::prelude::*;

/// The learnable tensors of one call, by name.
#[derive(Clone, Copy, Debug, Default)]
pub struct Learned<'a> {
    tensors: &'a [(&'a str, &'a Tensor)],
}

impl<'a> Learned<'a> {
    /// No learnable tensors (for specs without parameters or sinks).
    pub fn none() -> Learned<'static> {
        Learned { tensors: &[] }
    }

    /// The tensors `(name, tensor)`: each declared parameter by its name, and `sinks`.
    pub fn new(tensors: &'a [(&'a str, &'a Tensor)]) -> Learned<'a> {
        Learned { tensors }
    }

    /// Checks the tensors against `spec` and lays them out for the kernels.
    pub fn bind(&self, spec: &AttentionSpec) -> Result<Bound, RuntimeError> {
        let named: Vec<(&str, &[usize])> =
            self.tensors.iter().map(|(n, t)| (*n, t.shape())).collect();
        let order = match_learned(spec, &named).map_err(|e| match e {
            Mismatch::Shape {
                name,
                found,
                expected,
            } => RuntimeError::Shape {
                tensor: name,
                found,
                expected: format!("{expected:?} (from the spec)"),
            },
            other => RuntimeError::Spec(other.to_string()),
        })?;
        let mut params = Vec::with_capacity(ParamLayout::of(spec).len());
        let mut sinks = None;
        for i in order {
            let (name, t) = self.tensors[i];
            let values = t.to_f32_vec();
            if name == SINKS_NAME && spec.sinks == Sinks::Learned {
                sinks = Some(values);
            } else {
                params.extend(values);
            }
        }
        Ok(Bound { params, sinks })
    }
}

/// A call's learnable tensors, checked and laid out.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Bound {
    /// Every parameter, concatenated as [`ParamLayout`] says; empty without parameters.
    pub params: Vec<f32>,
    /// `sinks[h]`, for specs with learned sinks.
    pub sinks: Option<Vec<f32>>,
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
            Storage::F32(values) => std::mem::take(values),
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
