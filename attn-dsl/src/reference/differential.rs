//! The reference of differential heads ([`crate::differential`]): the component heads'
//! attention of the spec without `differential`, over values each given to both components,
//! then `out_h = O_2h - lambda * O_2h+1`.
//!
//! Backward, for `dout = dL/dout`: the components' output gradients are `dout_h` and
//! `-lambda * dout_h`, `dL/dlambda = -sum dout_h . O_2h+1`, and lambda's vectors take
//! `dL/dlambda` times [`Differential::lambda_gradients`]; a value head's gradient is the sum of
//! its two copies'.

use super::{
    Array, Gradients, Inputs, Output, attention_learned, backward_learned, check_spec, dims4,
    expect,
};
use crate::error::ReferenceError;
use crate::modifier::ParamValues;
use crate::spec::{AttentionSpec, Differential, LAMBDA_NAMES};

/// The learnable vectors of lambda, `[q1, k1, q2, k2]`, each of `head_dim` values.
pub type LambdaVectors<'a> = [&'a [f64]; 4];

/// What differential heads compute.
#[derive(Clone, Debug, PartialEq)]
pub struct DifferentialOutput {
    /// `[B, heads / 2, Sq, Dv]`.
    pub out: Array,
    /// lambda.
    pub lambda: f64,
    /// The component heads' outputs and log-sum-exps, `[B, heads, Sq, ..]`.
    pub components: Output,
}

/// The gradients of differential heads.
#[derive(Clone, Debug, PartialEq)]
pub struct DifferentialGradients {
    /// `dq`, `dk` (component heads), `dv` (`[B, kv_heads / 2, Skv, Dv]`) and the spec's
    /// learnable tensors'.
    pub inputs: Gradients,
    /// The gradients of lambda's vectors, in [`LAMBDA_NAMES`]'s order.
    pub lambda: [Vec<f64>; 4],
}

/// Differential heads' attention: q `[B, heads, Sq, D]`, k `[B, kv_heads, Skv, D]`, v
/// `[B, kv_heads / 2, Skv, Dv]`.
pub fn differential(
    spec: &AttentionSpec,
    inputs: &Inputs,
    lambda: LambdaVectors,
    learned: &[ParamValues],
) -> Result<DifferentialOutput, ReferenceError> {
    let d = checked(spec, inputs, lambda)?;
    let v = values_per_component(inputs.v);
    let both = Inputs { v: &v, ..*inputs };
    let components = attention_learned(&spec.differential_components(), &both, learned)?;
    let lambda = d.lambda(lambda);
    let o = &components.out;
    let [b, h2, sq, dv] = dims4("out", o)?;
    let out = Array::from_fn(&[b, h2 / 2, sq, dv], |i| {
        o.get(&[i[0], 2 * i[1], i[2], i[3]]) - lambda * o.get(&[i[0], 2 * i[1] + 1, i[2], i[3]])
    });
    Ok(DifferentialOutput {
        out,
        lambda,
        components,
    })
}

/// The gradients of [`differential`] for `dout` (`[B, heads / 2, Sq, Dv]`).
pub fn differential_backward(
    spec: &AttentionSpec,
    inputs: &Inputs,
    lambda_vectors: LambdaVectors,
    dout: &Array,
    learned: &[ParamValues],
) -> Result<DifferentialGradients, ReferenceError> {
    let d = checked(spec, inputs, lambda_vectors)?;
    let forward = differential(spec, inputs, lambda_vectors, learned)?;
    expect("dout", dout, forward.out.shape())?;
    let lambda = forward.lambda;
    let o = &forward.components.out;
    let shape = o.shape().to_vec();
    let dcomponents = Array::from_fn(&shape, |i| {
        let g = dout.get(&[i[0], i[1] / 2, i[2], i[3]]);
        if i[1] % 2 == 0 { g } else { -lambda * g }
    });
    let mut dlambda = 0.0;
    for (flat, g) in dout.data().iter().enumerate() {
        let (dv, sq, heads) = (shape[3], shape[2], shape[1] / 2);
        let (x, row) = (flat % dv, flat / dv);
        let (s, bh) = (row % sq, row / sq);
        let (h, b) = (bh % heads, bh / heads);
        dlambda -= g * o.get(&[b, 2 * h + 1, s, x]);
    }
    let v = values_per_component(inputs.v);
    let both = Inputs { v: &v, ..*inputs };
    let mut g = backward_learned(
        &spec.differential_components(),
        &both,
        &dcomponents,
        learned,
    )?;
    let [b, h2, skv, dv] = dims4("dv", &g.dv)?;
    let copies = &g.dv;
    g.dv = Array::from_fn(&[b, h2 / 2, skv, dv], |i| {
        copies.get(&[i[0], 2 * i[1], i[2], i[3]]) + copies.get(&[i[0], 2 * i[1] + 1, i[2], i[3]])
    });
    let per_vector = d.lambda_gradients(lambda_vectors);
    Ok(DifferentialGradients {
        inputs: g,
        lambda: per_vector.map(|v| v.into_iter().map(|x| x * dlambda).collect()),
    })
}

/// The spec's differential heads, after checking v's and lambda's shapes.
fn checked(
    spec: &AttentionSpec,
    inputs: &Inputs,
    lambda: LambdaVectors,
) -> Result<Differential, ReferenceError> {
    let Some(d) = spec.differential else {
        return Err(ReferenceError::WrongEntryPoint(
            "this spec has no differential heads: use reference::attention",
        ));
    };
    check_spec(spec)?;
    let [b, _, _, _] = dims4("q", inputs.q)?;
    let [_, _, skv, _] = dims4("k", inputs.k)?;
    let v_shape = [
        b,
        spec.value_heads() as usize,
        skv,
        spec.v_head_dim as usize,
    ];
    expect("v", inputs.v, &v_shape)?;
    for (name, vector) in LAMBDA_NAMES.iter().zip(lambda) {
        if vector.len() != spec.head_dim as usize {
            return Err(ReferenceError::Learned(format!(
                "`{name}` has {} values; expected head_dim = {}",
                vector.len(),
                spec.head_dim
            )));
        }
    }
    Ok(d)
}

/// v `[B, Hv, S, Dv]` with each head given twice, `[B, 2 Hv, S, Dv]`.
fn values_per_component(v: &Array) -> Array {
    let s = v.shape();
    Array::from_fn(&[s[0], 2 * s[1], s[2], s[3]], |i| {
        v.get(&[i[0], i[1] / 2, i[2], i[3]])
    })
}
