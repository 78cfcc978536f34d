//! The reference backward pass: analytic gradients of attention in f64.
//!
//! For a loss L with `dout = dL/dout`, per query row i: `P = softmax(s)` over the kept keys,
//! `D_i = sum_j P_ij dP_ij` with `dP_ij = <dout_i, v_j>`, and
//! `dS_ij = P_ij (dP_ij - D_i) * d score / d <q_i, k_j>` (the scale, softcap, ALiBi and custom
//! modifier chained, from [`ScoreProgram::score_gradient`]). Then `dv_j += P_ij dout_i`,
//! `dq_i += dS_ij k_j`, `dk_j += dS_ij q_i` on the rotated q and k; GQA sums dk and dv over the
//! group, and RoPE's rotation is undone (dq and dk are for the unrotated inputs). Masked pairs and
//! fully masked rows carry no gradient.
//!
//! Learnable tensors: a parameter element gains `P_ij (dP_ij - D_i) * d score / d read` from
//! every kept pair at which a read of the score reads it ([`ScoreProgram::param_gradients`]);
//! a sink gains `-exp(sinks[h] - lse_i) * D_i` from every row of its head.

use super::rope::Side;
use super::{Array, Inputs, Learned, Pair, Positions, attention_inputs, dot, rope, score};
use crate::error::ReferenceError;
use crate::modifier::{Env, Expr, ParamRead, ParamValues, ScoreProgram, eval};
use crate::spec::{AttentionSpec, Normalize, Position, SINKS_NAME};

/// Gradients with respect to the inputs of [`super::attention`].
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients {
    /// `dL/dq`, `[B, Hq, Sq, D]`.
    pub dq: Array,
    /// `dL/dk`, `[B, Hkv, Skv, D]`.
    pub dk: Array,
    /// `dL/dv`, `[B, Hkv, Skv, Dv]`.
    pub dv: Array,
    /// The gradient of each learnable tensor and f32 data tensor, named `d<name>` (`dsinks` for
    /// the sinks): the parameters, the f32 data tensors, then the sinks; empty without them.
    pub learned: Vec<ParamValues>,
}

/// The gradients of a per-head spec's attention for the output gradient `dout`
/// (`[B, Hq, Sq, Dv]`), for a spec without learnable tensors.
pub fn backward(
    spec: &AttentionSpec,
    inputs: &Inputs,
    dout: &Array,
) -> Result<Gradients, ReferenceError> {
    backward_learned(spec, inputs, dout, &[])
}

/// [`backward`] with the values of the spec's learnable tensors; their gradients are in
/// [`Gradients::learned`].
pub fn backward_learned(
    spec: &AttentionSpec,
    inputs: &Inputs,
    dout: &Array,
    learned: &[ParamValues],
) -> Result<Gradients, ReferenceError> {
    if spec.mla().is_some() {
        return Err(ReferenceError::WrongEntryPoint(
            "this is an MLA spec: use reference::backward_mla",
        ));
    }
    let (q, k, positions) = attention_inputs(spec, inputs)?;
    super::expect(
        "dout",
        dout,
        &[
            q.shape()[0],
            q.shape()[1],
            q.shape()[2],
            spec.v_head_dim as usize,
        ],
    )?;
    let learned = Learned::check(spec, learned, &super::call_dims(inputs))?;
    let spec = &crate::data::reads_at_offset(spec, inputs.position_offset);
    let derivative = ScoreProgram::of(spec)
        .score_gradient()
        .map_err(|e| ReferenceError::Gradient(e.to_string()))?
        .expr;
    let ((dq, dk, dv), learned) = rotated_gradients(
        spec,
        &q,
        &k,
        inputs.v,
        dout,
        &positions,
        &derivative,
        &learned,
    );
    let (dq, dk) = match &spec.position {
        Position::Rope(r) => {
            let len = positions.total_len();
            (
                rope::apply_transposed(r, &dq, &positions.queries(), len, Side::Query),
                rope::apply_transposed(r, &dk, &positions.keys(), len, Side::Key),
            )
        }
        _ => (dq, dk),
    };
    Ok(Gradients {
        dq,
        dk,
        dv,
        learned,
    })
}

/// Gradients with respect to the rotated q and k (and v), and of the learnable tensors.
#[allow(clippy::too_many_arguments)]
pub(super) fn rotated_gradients(
    spec: &AttentionSpec,
    q: &Array,
    k: &Array,
    v: &Array,
    dout: &Array,
    pos: &Positions,
    derivative: &Expr,
    learned: &Learned,
) -> ((Array, Array, Array), Vec<ParamValues>) {
    let param_derivatives: Vec<(ParamRead, Expr)> =
        ScoreProgram::of(spec).param_gradients().unwrap_or_default();
    let mut dparams: Vec<ParamValues> = learned
        .params
        .iter()
        .map(|p| ParamValues {
            name: format!("d{}", p.name),
            shape: p.shape.clone(),
            values: vec![0.0; p.values.len()],
        })
        .collect();
    let mut dsinks = learned.sinks.as_ref().map(|s| vec![0.0; s.len()]);
    let [b_n, hq, sq, _]: [usize; 4] = q.shape().try_into().expect("checked by the caller");
    let hkv = k.shape()[1];
    let group = hq / hkv;
    let slopes = super::alibi::slopes(hq as u32);
    let (mut dq, mut dk, mut dv) = (
        Array::zeros(q.shape()),
        Array::zeros(k.shape()),
        Array::zeros(v.shape()),
    );
    for b in 0..b_n {
        for h in 0..hq {
            let kvh = h / group;
            for i in 0..sq {
                let qi = q.row(&[b, h, i]).to_vec();
                let go = dout.row(&[b, h, i]).to_vec();
                let pairs: Vec<(Pair, f64, Option<f64>)> = (0..pos.skv)
                    .map(|j| {
                        let at = Pair {
                            b,
                            h,
                            pos_q: pos.query(i),
                            pos_k: pos.key(j),
                            i,
                            j,
                        };
                        let raw = dot(&qi, k.row(&[b, kvh, j]));
                        (at, raw, score(spec, &slopes, raw, at, &learned.params))
                    })
                    .collect();
                let dps: Vec<f64> = (0..pos.skv)
                    .map(|j| dot(&go, v.row(&[b, kvh, j])))
                    .collect();
                let scores: Vec<Option<f64>> = pairs.iter().map(|p| p.2).collect();
                // Each kept pair's weight and `dS_final` (dS before the modifiers' derivative).
                let terms: Vec<Option<(f64, f64)>> = match spec.normalize {
                    Normalize::Sigmoid(bias) => {
                        // Each weight on its own: dS = dP w (1 - w), with no row term.
                        let weights = super::sigmoid_weights(&scores, bias.value());
                        let each = weights.of.iter().zip(&dps);
                        each.map(|(w, dp)| w.map(|w| (w, dp * w * (1.0 - w))))
                            .collect()
                    }
                    Normalize::StickBreaking => stick_breaking_terms(&scores, &dps),
                    Normalize::Softmax => {
                        let sink = learned.sink(h).filter(|s| *s != f64::NEG_INFINITY);
                        let Some((probs, d_row, sink_p)) = softmax_row(&scores, sink, &dps) else {
                            // Only the sink (if any) is left: out is 0, so every gradient is 0.
                            continue;
                        };
                        if let (Some(p), Some(d)) = (sink_p, dsinks.as_mut()) {
                            d[h] -= p * d_row;
                        }
                        let each = probs.iter().zip(&dps);
                        each.map(|(p, dp)| p.map(|p| (p, p * (dp - d_row))))
                            .collect()
                    }
                };
                for (j, (term, (at, raw, _))) in terms.iter().zip(&pairs).enumerate() {
                    let Some((p, ds_final)) = *term else { continue };
                    let env = Env {
                        score: *raw,
                        b: b as i64,
                        h: h as i64,
                        q: at.pos_q,
                        k: at.pos_k,
                        qi: i as i64,
                        ki: j as i64,
                        params: &learned.params,
                    };
                    for (read, d) in &param_derivatives {
                        accumulate(
                            &mut dparams,
                            learned,
                            read,
                            &env,
                            ds_final * eval(d, &env).as_f64(),
                        );
                    }
                    let ds = ds_final * eval(derivative, &env).as_f64();
                    axpy(dv.row_mut(&[b, kvh, j]), p, &go);
                    axpy(dq.row_mut(&[b, h, i]), ds, k.row(&[b, kvh, j]));
                    axpy(dk.row_mut(&[b, kvh, j]), ds, &qi);
                }
            }
        }
    }
    // i32 data has no gradient.
    dparams.retain(|d| {
        spec.data_decl(&d.name[1..])
            .is_none_or(|decl| decl.dtype == crate::spec::DataType::F32)
    });
    if let Some(values) = dsinks {
        dparams.push(ParamValues {
            name: format!("d{SINKS_NAME}"),
            shape: vec![values.len()],
            values,
        });
    }
    ((dq, dk, dv), dparams)
}

/// A stick-breaking row's weights and `dS_final`: a key's score enters its own weight
/// (`dA_j / ds_j = A_j (1 - sigmoid(s_j))`) and every farther key's (`dA_i / ds_j = -A_i
/// sigmoid(s_j)` for kept `i < j`), so `dS_j = dP_j A_j (1 - sigmoid(s_j)) - sigmoid(s_j)
/// sum_{i < j} dP_i A_i`.
fn stick_breaking_terms(scores: &[Option<f64>], dps: &[f64]) -> Vec<Option<(f64, f64)>> {
    let weights = super::stick_breaking_weights(scores);
    let mut farther = 0.0;
    let mut terms = vec![None; scores.len()];
    for (j, (w, s)) in weights.of.iter().zip(scores).enumerate() {
        let (Some(w), Some(s)) = (*w, *s) else {
            continue;
        };
        let sig = super::sigmoid(s);
        terms[j] = Some((w, dps[j] * w * (1.0 - sig) - sig * farther));
        farther += dps[j] * w;
    }
    terms
}

/// A softmax row's probabilities (`None` for masked keys and `-inf` scores, which carry no
/// gradient), `D = sum_j p_j dP_j`, and the sink's probability; `None` for a row with no kept
/// key.
fn softmax_row(
    scores: &[Option<f64>],
    sink: Option<f64>,
    dps: &[f64],
) -> Option<(Vec<Option<f64>>, f64, Option<f64>)> {
    let kept_score = |s: &Option<f64>| s.filter(|s| *s != f64::NEG_INFINITY);
    let kept: Vec<f64> = scores.iter().filter_map(kept_score).collect();
    if kept.is_empty() {
        return None;
    }
    let max = kept
        .iter()
        .chain(&sink)
        .copied()
        .fold(f64::NEG_INFINITY, f64::max);
    let denom: f64 = kept.iter().chain(&sink).map(|s| (s - max).exp()).sum();
    let probs: Vec<Option<f64>> = scores
        .iter()
        .map(|s| kept_score(s).map(|s| (s - max).exp() / denom))
        .collect();
    let d_row = probs
        .iter()
        .zip(dps)
        .filter_map(|(p, dp)| p.map(|p| p * dp))
        .sum();
    Some((probs, d_row, sink.map(|s| (s - max).exp() / denom)))
}

/// Adds `x` to the element of `dparams` that `read` reads at `env`.
fn accumulate(dparams: &mut [ParamValues], learned: &Learned, read: &ParamRead, env: &Env, x: f64) {
    let Some(slot) = learned.params.iter().position(|p| p.name == read.name) else {
        return;
    };
    let indices: Vec<i64> = read
        .indices
        .iter()
        .map(|i| eval(i, env).as_f64() as i64)
        .collect();
    if let Some(flat) = learned.params[slot].flat_index(&indices) {
        dparams[slot].values[flat] += x;
    }
}

/// `y += a x`.
fn axpy(y: &mut [f64], a: f64, x: &[f64]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}
