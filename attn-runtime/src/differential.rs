//! Differential heads (`differential = lambda(init = L)`, `attn_dsl::differential`) on any
//! backend: the component heads run as one call of the backend's kernels for the spec without
//! `differential`, over the values each given to both components of a head, and the pairs are
//! combined on the host, `out_h = O_2h - lambda * O_2h+1`.
//!
//! The backward is one backward call of the components, with output gradients `dout_h` and
//! `-lambda * dout_h`; lambda's gradient is `-sum dout_h . O_2h+1`, and a value head's the sum
//! of its two copies'. The components' outputs and log-sum-exps are what the forward saves.

use crate::backend::Backend;
use crate::calls::{BackwardInputs, HeadGradients, HeadsBackward, Inputs, Output};
use crate::error::RuntimeError;
use crate::learned::Learned;
use crate::tensor::Tensor;
use crate::variant::Variant;
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
    /// `[B, heads / 2, Sq, v_head_dim]` in the spec's dtype.
    pub out: Tensor,
    /// lambda, as the vectors gave it.
    pub lambda: f32,
    /// The component heads' output and log-sum-exp, `[B, heads, Sq, ..]`: what the backward
    /// takes.
    pub components: Output,
}

/// The gradients of a differential call.
#[derive(Clone, Debug)]
pub struct DifferentialGradients {
    /// `dq [B, heads, Sq, D]`, `dk [B, kv_heads, Skv, D]`, `dv [B, kv_heads / 2, Skv, Dv]` and
    /// the spec's learnable tensors'.
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
        let o = &components.out;
        let out = pairs(o, |a, b| a - lambda * b)?;
        Ok(DifferentialOutput {
            out,
            lambda,
            components,
        })
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
        let lambda = self.lambda(x.lambda)?;
        if lambda as f32 != saved.lambda {
            return Err(RuntimeError::Data(format!(
                "lambda's vectors give {lambda}, but the forward ran with {}; allowed: the \
                 forward's vectors",
                saved.lambda
            )));
        }
        let o = &saved.components.out;
        let out_shape = [o.shape()[0], o.shape()[1] / 2, o.shape()[2], o.shape()[3]];
        if dout.shape() != out_shape {
            return Err(RuntimeError::Shape {
                tensor: "dout".into(),
                found: dout.shape().to_vec(),
                expected: format!("{out_shape:?}, the differential output's"),
            });
        }
        let dcomponents = unpaired(dout, o.dtype(), lambda as f32)?;
        let both = self.values_per_component(x.k, x.v)?;
        let call = BackwardInputs::Heads(HeadsBackward {
            q: x.q,
            k: x.k,
            v: &both,
            out: o,
            lse: &saved.components.lse,
            dout: &dcomponents,
            position_offset: x.position_offset,
        });
        let mut g = backend
            .backward_learned(&self.components, &call, x.learned)?
            .heads()?;
        g.dv = pairs(&g.dv, |a, b| a + b)?;
        let dlambda = lambda_gradient(dout, o);
        let vectors: Vec<Vec<f64>> = x
            .lambda
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

    /// v `[B, kv_heads / 2, Skv, Dv]` with each head given twice, after checking it against the
    /// spec and k.
    fn values_per_component(&self, k: &Tensor, v: &Tensor) -> Result<Tensor, RuntimeError> {
        let (b, skv) = match k.shape() {
            [b, _, skv, _] => (*b, *skv),
            _ => (0, 0),
        };
        let want = [
            b,
            self.spec.value_heads() as usize,
            skv,
            self.spec.v_head_dim as usize,
        ];
        if k.shape().len() != 4 || v.shape() != want {
            return Err(RuntimeError::Shape {
                tensor: "v".into(),
                found: v.shape().to_vec(),
                expected: format!(
                    "{want:?}: [B, kv_heads / 2, Skv, v_head_dim], one value head per pair of \
                     key heads"
                ),
            });
        }
        let values = v.f32_values();
        let head = (skv * want[3]).max(1);
        let mut both = vec![0.0; 2 * values.len()];
        both.par_chunks_mut(2 * head)
            .zip(values.par_chunks(head))
            .for_each(|(two, one)| {
                let (first, second) = two.split_at_mut(one.len());
                first.copy_from_slice(one);
                second.copy_from_slice(one);
            });
        Tensor::from_f32_as(v.dtype(), &[b, 2 * want[1], skv, want[3]], both)
    }
}

/// `[B, 2H, S, D]` into `[B, H, S, D]`, element `f(x[2h], x[2h + 1])`, in x's dtype.
fn pairs(x: &Tensor, f: impl Fn(f32, f32) -> f32 + Sync) -> Result<Tensor, RuntimeError> {
    let s = x.shape().to_vec();
    let values = x.f32_values();
    let head = (s[2] * s[3]).max(1);
    let mut out = vec![0.0; values.len() / 2];
    out.par_chunks_mut(head)
        .zip(values.par_chunks(2 * head))
        .for_each(|(out, pair)| {
            let (a, b) = pair.split_at(head);
            for ((o, a), b) in out.iter_mut().zip(a).zip(b) {
                *o = f(*a, *b);
            }
        });
    Tensor::from_f32_as(x.dtype(), &[s[0], s[1] / 2, s[2], s[3]], out)
}

/// The components' output gradients for `dout [B, H, S, D]`: `dout_h` and `-lambda * dout_h`
/// at heads `2h` and `2h + 1`, in `dtype`.
fn unpaired(dout: &Tensor, dtype: attn_dsl::DType, lambda: f32) -> Result<Tensor, RuntimeError> {
    let s = dout.shape().to_vec();
    let values = dout.f32_values();
    let head = (s[2] * s[3]).max(1);
    let mut out = vec![0.0; 2 * values.len()];
    out.par_chunks_mut(2 * head)
        .zip(values.par_chunks(head))
        .for_each(|(two, g)| {
            let (first, second) = two.split_at_mut(g.len());
            first.copy_from_slice(g);
            for (o, g) in second.iter_mut().zip(g) {
                *o = -lambda * g;
            }
        });
    Tensor::from_f32_as(dtype, &[s[0], 2 * s[1], s[2], s[3]], out)
}

/// `dL/dlambda = -sum dout_h . O_2h+1`, in f64.
fn lambda_gradient(dout: &Tensor, components: &Tensor) -> f64 {
    let s = dout.shape();
    let head = (s[2] * s[3]).max(1);
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
