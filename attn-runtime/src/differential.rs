//! Differential heads (`differential = lambda(init = L)`, `attn_dsl::differential`) on any
//! backend: the component heads run as one call of the backend's kernels for the spec without
//! `differential`, over the values each given to both components of a head, and the pairs are
//! combined on the host, `out_h = O_2h - lambda * O_2h+1`.
//!
//! The backward is one backward call of the components, with output gradients `dout_h` and
//! `-lambda * dout_h`; lambda's gradient is `-sum dout_h . O_2h+1`, and a value head's the sum
//! of its two copies'. The components' outputs and log-sum-exps are what the forward saves.
//!
//! Padded batches (`[B, H, S, D]`, [`Differential::forward`]) and packed ones
//! (`[total, H, D]` with cumulative offsets, [`Differential::forward_varlen`]) alike: heads are
//! the second axis of both, so a pair is two consecutive blocks of what follows it.

use crate::backend::Backend;
use crate::calls::{BackwardInputs, HeadGradients, HeadsBackward, Inputs, Output};
use crate::error::RuntimeError;
use crate::learned::Learned;
use crate::tensor::Tensor;
use crate::variant::Variant;
use crate::varlen::{Varlen, VarlenSaved};
use attn_dsl::{AttentionSpec, LAMBDA_NAMES};
use rayon::prelude::*;
use std::sync::Arc;

/// lambda's learnable vectors `[lambda_q1, lambda_k1, lambda_q2, lambda_k2]`, each
/// `[head_dim]`.
pub type Lambda<'a> = [&'a Tensor; 4];

/// The inputs of a differential call.
#[derive(Clone, Copy, Debug)]
pub struct DifferentialInputs<'a> {
    /// `[B, heads, Sq, head_dim]`, before RoPE.
    pub q: &'a Tensor,
    /// `[B, kv_heads, Skv, head_dim]`, before RoPE.
    pub k: &'a Tensor,
    /// `[B, kv_heads / 2, Skv, v_head_dim]`: one value head per pair of key heads.
    pub v: &'a Tensor,
    /// lambda's vectors.
    pub lambda: Lambda<'a>,
    /// The position of key 0.
    pub position_offset: i64,
    /// The spec's learnable and data tensors.
    pub learned: Learned<'a>,
}

/// The inputs of a differential call over a packed batch ([`crate::varlen`]'s layout).
#[derive(Clone, Copy, Debug)]
pub struct DifferentialVarlen<'a> {
    /// q `[total_q, heads, head_dim]`, k `[total_k, kv_heads, head_dim]`, v `[total_k,
    /// kv_heads / 2, v_head_dim]` and the sequences' offsets.
    pub batch: Varlen<'a>,
    /// lambda's vectors.
    pub lambda: Lambda<'a>,
    /// The position of each sequence's key 0.
    pub position_offset: i64,
    /// The spec's learnable and data tensors.
    pub learned: Learned<'a>,
}

/// A differential spec, its component heads planned as a [`Variant`].
#[derive(Clone, Debug)]
pub struct Differential {
    spec: AttentionSpec,
    components: Arc<Variant>,
    pairing: attn_dsl::Differential,
}

/// What a differential forward returns.
#[derive(Clone, Debug)]
pub struct DifferentialOutput {
    /// `[B, heads / 2, Sq, v_head_dim]` (packed: `[total_q, heads / 2, v_head_dim]`) in the
    /// spec's dtype.
    pub out: Tensor,
    /// lambda, as the vectors gave it.
    pub lambda: f32,
    /// The component heads' output and log-sum-exp, `[B, heads, Sq, ..]` (packed: `[total_q,
    /// heads, ..]`): what the backward takes.
    pub components: Output,
}

/// The gradients of a differential call.
#[derive(Clone, Debug)]
pub struct DifferentialGradients {
    /// `dq [B, heads, Sq, D]`, `dk [B, kv_heads, Skv, D]`, `dv [B, kv_heads / 2, Skv, Dv]`
    /// (packed: `[total, heads, ..]` each) and the spec's learnable tensors'.
    pub inputs: HeadGradients,
    /// The gradients of lambda's vectors, `(d<name>, [head_dim] f32)` in [`LAMBDA_NAMES`]'s
    /// order.
    pub lambda: Vec<(String, Tensor)>,
}

impl Differential {
    /// Validates a differential spec and plans its component heads.
    pub fn new(spec: AttentionSpec) -> Result<Differential, RuntimeError> {
        let Some(d) = spec.differential else {
            return Err(RuntimeError::Spec(
                "this spec has no differential heads (differential = lambda(...)); run it as a \
                 Variant"
                    .into(),
            ));
        };
        spec.validate().map_err(|findings| {
            let all: Vec<String> = findings.iter().map(|f| f.to_string()).collect();
            RuntimeError::Spec(all.join("; "))
        })?;
        Ok(Differential {
            components: Variant::new(spec.differential_components())?,
            spec,
            pairing: d,
        })
    }

    /// The differential spec.
    pub fn spec(&self) -> &AttentionSpec {
        &self.spec
    }

    /// The component heads' variant (the spec without `differential`).
    pub fn components(&self) -> &Arc<Variant> {
        &self.components
    }

    /// lambda for the vectors: `exp(q1 . k1) - exp(q2 . k2) + init`, in f64. Each vector must be
    /// `[head_dim]`, and lambda finite.
    pub fn lambda(&self, vectors: Lambda) -> Result<f64, RuntimeError> {
        let d = self.spec.head_dim as usize;
        let mut values = Vec::with_capacity(4);
        for (name, t) in LAMBDA_NAMES.iter().zip(vectors) {
            if t.shape() != [d] {
                return Err(RuntimeError::Shape {
                    tensor: name.to_string(),
                    found: t.shape().to_vec(),
                    expected: format!("[{d}] (head_dim)"),
                });
            }
            values.push(
                t.to_f32_vec()
                    .into_iter()
                    .map(f64::from)
                    .collect::<Vec<_>>(),
            );
        }
        let lambda = self
            .pairing
            .lambda([&values[0], &values[1], &values[2], &values[3]]);
        if !(lambda.is_finite() && lambda.abs() <= f64::from(f32::MAX)) {
            return Err(RuntimeError::Data(format!(
                "lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + {} is {lambda}; \
                 allowed: vectors whose lambda is a finite f32",
                self.pairing.lambda_init
            )));
        }
        Ok(lambda)
    }

    /// Differential attention over `x` on `backend`.
    pub fn forward(
        &self,
        backend: &dyn Backend,
        x: &DifferentialInputs,
    ) -> Result<DifferentialOutput, RuntimeError> {
        let lambda = self.lambda(x.lambda)? as f32;
        let both = self.values_per_component(x.k, x.v)?;
        let components = backend.forward_learned(
            &self.components,
            Inputs::heads(x.q, x.k, &both),
            x.position_offset,
            x.learned,
        )?;
        paired_output(components, lambda)
    }

    /// Differential attention over a packed batch on `backend`.
    pub fn forward_varlen(
        &self,
        backend: &dyn Backend,
        x: &DifferentialVarlen,
    ) -> Result<DifferentialOutput, RuntimeError> {
        let lambda = self.lambda(x.lambda)? as f32;
        let both = self.values_per_component(x.batch.k, x.batch.v)?;
        let batch = Varlen {
            v: &both,
            ..x.batch
        };
        let components =
            backend.forward_varlen(&self.components, batch, x.position_offset, x.learned)?;
        paired_output(components, lambda)
    }

    /// The gradients of [`Differential::forward`] for `dout = dL/dout`
    /// (`[B, heads / 2, Sq, Dv]`), given its inputs and what it returned.
    pub fn backward(
        &self,
        backend: &dyn Backend,
        x: &DifferentialInputs,
        saved: &DifferentialOutput,
        dout: &Tensor,
    ) -> Result<DifferentialGradients, RuntimeError> {
        let lambda = self.checked_lambda(x.lambda, saved, dout)?;
        let dcomponents = unpaired(dout, saved.components.out.dtype(), lambda as f32)?;
        let both = self.values_per_component(x.k, x.v)?;
        let call = BackwardInputs::Heads(HeadsBackward {
            q: x.q,
            k: x.k,
            v: &both,
            out: &saved.components.out,
            lse: &saved.components.lse,
            dout: &dcomponents,
            position_offset: x.position_offset,
        });
        let g = backend
            .backward_learned(&self.components, &call, x.learned)?
            .heads()?;
        self.gradients(g, x.lambda, (dout, saved))
    }

    /// The gradients of [`Differential::forward_varlen`] for `dout = dL/dout`
    /// (`[total_q, heads / 2, Dv]`), given its inputs and what it returned.
    pub fn backward_varlen(
        &self,
        backend: &dyn Backend,
        x: &DifferentialVarlen,
        saved: &DifferentialOutput,
        dout: &Tensor,
    ) -> Result<DifferentialGradients, RuntimeError> {
        let lambda = self.checked_lambda(x.lambda, saved, dout)?;
        let dcomponents = unpaired(dout, saved.components.out.dtype(), lambda as f32)?;
        let both = self.values_per_component(x.batch.k, x.batch.v)?;
        let batch = Varlen {
            v: &both,
            ..x.batch
        };
        let call = VarlenSaved {
            out: &saved.components.out,
            lse: &saved.components.lse,
            dout: &dcomponents,
        };
        let g =
            backend.backward_varlen(&self.components, batch, call, x.position_offset, x.learned)?;
        self.gradients(g, x.lambda, (dout, saved))
    }

    /// lambda for the backward's vectors, checked against the forward's, after checking
    /// `dout`'s shape against the output's.
    fn checked_lambda(
        &self,
        vectors: Lambda,
        saved: &DifferentialOutput,
        dout: &Tensor,
    ) -> Result<f64, RuntimeError> {
        let lambda = self.lambda(vectors)?;
        if lambda as f32 != saved.lambda {
            return Err(RuntimeError::Data(format!(
                "lambda's vectors give {lambda}, but the forward ran with {}; allowed: the \
                 forward's vectors",
                saved.lambda
            )));
        }
        if dout.shape() != saved.out.shape() {
            return Err(RuntimeError::Shape {
                tensor: "dout".into(),
                found: dout.shape().to_vec(),
                expected: format!("{:?}, the differential output's", saved.out.shape()),
            });
        }
        Ok(lambda)
    }

    /// The call's gradients from the components': each value head's two copies summed, and
    /// lambda's vectors' from `dL/dlambda = -sum dout_h . O_2h+1`.
    fn gradients(
        &self,
        mut g: HeadGradients,
        vectors: Lambda,
        (dout, saved): (&Tensor, &DifferentialOutput),
    ) -> Result<DifferentialGradients, RuntimeError> {
        g.dv = pairs(&g.dv, |a, b| a + b)?;
        let dlambda = lambda_gradient(dout, &saved.components.out);
        let vectors: Vec<Vec<f64>> = vectors
            .iter()
            .map(|t| t.to_f32_vec().into_iter().map(f64::from).collect())
            .collect();
        let per_vector =
            self.pairing
                .lambda_gradients([&vectors[0], &vectors[1], &vectors[2], &vectors[3]]);
        let mut named = Vec::with_capacity(4);
        for (name, grad) in LAMBDA_NAMES.iter().zip(per_vector) {
            let values = grad.iter().map(|x| (x * dlambda) as f32).collect();
            named.push((format!("d{name}"), Tensor::from_f32(&[grad.len()], values)?));
        }
        Ok(DifferentialGradients {
            inputs: g,
            lambda: named,
        })
    }

    /// v (`[B, kv_heads / 2, Skv, Dv]`, or packed `[total_k, kv_heads / 2, Dv]`) with each
    /// head given twice, after checking it against the spec and k (`[B, kv_heads, Skv, D]` or
    /// `[total_k, kv_heads, D]`).
    fn values_per_component(&self, k: &Tensor, v: &Tensor) -> Result<Tensor, RuntimeError> {
        let mut want = k.shape().to_vec();
        let packed = want.len() == 3;
        if let [_, heads, .., last] = want.as_mut_slice() {
            (*heads, *last) = (
                self.spec.value_heads() as usize,
                self.spec.v_head_dim as usize,
            );
        }
        if !(want.len() == 3 || want.len() == 4) || v.shape() != want {
            let layout = match packed {
                true => "[total_k, kv_heads / 2, v_head_dim]",
                false => "[B, kv_heads / 2, Skv, v_head_dim]",
            };
            return Err(RuntimeError::Shape {
                tensor: "v".into(),
                found: v.shape().to_vec(),
                expected: format!("{want:?}: {layout}, one value head per pair of key heads"),
            });
        }
        let values = v.f32_values();
        let head = block(v.shape());
        let mut both = crate::memory::written_zeros(2 * values.len());
        both.par_chunks_mut(2 * head)
            .zip(values.par_chunks(head))
            .for_each(|(two, one)| {
                let (first, second) = two.split_at_mut(one.len());
                first.copy_from_slice(one);
                second.copy_from_slice(one);
            });
        want[1] *= 2;
        Tensor::from_f32_as(v.dtype(), &want, both)
    }
}

/// Values in one head's block of a tensor whose second axis is the head: the product of the
/// axes after it (at least 1, so that empty tensors chunk).
fn block(shape: &[usize]) -> usize {
    shape.iter().skip(2).product::<usize>().max(1)
}

/// `shape` with its head axis (the second) times `num / den`.
fn heads_scaled(shape: &[usize], num: usize, den: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    s[1] = s[1] * num / den;
    s
}

/// The forward's result from the components' output: the pairs combined with `lambda`.
fn paired_output(components: Output, lambda: f32) -> Result<DifferentialOutput, RuntimeError> {
    let out = pairs(&components.out, |a, b| a - lambda * b)?;
    Ok(DifferentialOutput {
        out,
        lambda,
        components,
    })
}

/// `[N, 2H, ..]` into `[N, H, ..]`, element `f(x[2h], x[2h + 1])`, in x's dtype.
fn pairs(x: &Tensor, f: impl Fn(f32, f32) -> f32 + Sync) -> Result<Tensor, RuntimeError> {
    let values = x.f32_values();
    let head = block(x.shape());
    let mut out = crate::memory::written_zeros(values.len() / 2);
    out.par_chunks_mut(head)
        .zip(values.par_chunks(2 * head))
        .for_each(|(out, pair)| {
            let (a, b) = pair.split_at(head);
            for ((o, a), b) in out.iter_mut().zip(a).zip(b) {
                *o = f(*a, *b);
            }
        });
    Tensor::from_f32_as(x.dtype(), &heads_scaled(x.shape(), 1, 2), out)
}

/// The components' output gradients for `dout [N, H, ..]`: `dout_h` and `-lambda * dout_h`
/// at heads `2h` and `2h + 1`, in `dtype`.
fn unpaired(dout: &Tensor, dtype: attn_dsl::DType, lambda: f32) -> Result<Tensor, RuntimeError> {
    let values = dout.f32_values();
    let head = block(dout.shape());
    let mut out = crate::memory::written_zeros(2 * values.len());
    out.par_chunks_mut(2 * head)
        .zip(values.par_chunks(head))
        .for_each(|(two, g)| {
            let (first, second) = two.split_at_mut(g.len());
            first.copy_from_slice(g);
            for (o, g) in second.iter_mut().zip(g) {
                *o = -lambda * g;
            }
        });
    Tensor::from_f32_as(dtype, &heads_scaled(dout.shape(), 2, 1), out)
}

/// `dL/dlambda = -sum dout_h . O_2h+1`, in f64.
fn lambda_gradient(dout: &Tensor, components: &Tensor) -> f64 {
    let head = block(dout.shape());
    let (g, o) = (dout.f32_values(), components.f32_values());
    g.par_chunks(head)
        .zip(o.par_chunks(2 * head))
        .map(|(g, pair)| {
            let second = &pair[head..];
            -g.iter()
                .zip(second)
                .map(|(g, o)| f64::from(*g) * f64::from(*o))
                .sum::<f64>()
        })
        .sum()
}
