//! The reference backward pass: analytic gradients of attention in f64.
//!
//! For a loss L with `dout = dL/dout`, per query row i: `P = softmax(s)` over the kept keys,
//! `D_i = sum_j P_ij dP_ij` with `dP_ij = <dout_i, v_j>`, and
//! `dS_ij = P_ij (dP_ij - D_i) * d score / d <q_i, k_j>` (the scale, softcap, ALiBi and custom
//! modifier chained, from [`ScoreProgram::score_gradient`]). Then `dv_j += P_ij dout_i`,
//! `dq_i += dS_ij k_j`, `dk_j += dS_ij q_i` on the rotated q and k; GQA sums dk and dv over the
//! group, and RoPE's rotation is undone (dq and dk are for the unrotated inputs). Masked pairs and
//! fully masked rows carry no gradient.

use super::{Array, Inputs, Pair, Positions, attention_inputs, dot, rope, score};
use crate::error::ReferenceError;
use crate::modifier::{Env, Expr, ScoreProgram, eval};
use crate::spec::{AttentionSpec, Position};

/// Gradients with respect to the inputs of [`super::attention`].
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients {
    /// `dL/dq`, `[B, Hq, Sq, D]`.
    pub dq: Array,
    /// `dL/dk`, `[B, Hkv, Skv, D]`.
    pub dk: Array,
    /// `dL/dv`, `[B, Hkv, Skv, Dv]`.
    pub dv: Array,
}

/// The gradients of a per-head spec's attention for the output gradient `dout`
/// (`[B, Hq, Sq, Dv]`).
pub fn backward(
    spec: &AttentionSpec,
    inputs: &Inputs,
    dout: &Array,
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
    let derivative = ScoreProgram::of(spec)
        .score_gradient()
        .map_err(|e| ReferenceError::Gradient(e.to_string()))?
        .expr;
    let (dq, dk, dv) = rotated_gradients(spec, &q, &k, inputs.v, dout, &positions, &derivative);
    let (dq, dk) = match &spec.position {
        Position::Rope(r) => {
            // The rotation at position p times the attention factor `a` has the transpose
            // `a R(-p)`: rotating back by the negated position.
            let negate = |p: Vec<i64>| p.into_iter().map(|x| -x).collect::<Vec<_>>();
            let len = positions.total_len();
            (
                rope::apply(r, &dq, &negate(positions.queries()), len),
                rope::apply(r, &dk, &negate(positions.keys()), len),
            )
        }
        _ => (dq, dk),
    };
    Ok(Gradients { dq, dk, dv })
}

/// Gradients with respect to the rotated q and k (and v).
pub(super) fn rotated_gradients(
    spec: &AttentionSpec,
    q: &Array,
    k: &Array,
    v: &Array,
    dout: &Array,
    pos: &Positions,
    derivative: &Expr,
) -> (Array, Array, Array) {
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
                        (at, raw, score(spec, &slopes, raw, at))
                    })
                    .collect();
                // A -inf score weighs nothing, as a masked key: its pair carries no gradient.
                let kept_score =
                    |p: &(Pair, f64, Option<f64>)| p.2.filter(|s| *s != f64::NEG_INFINITY);
                let kept: Vec<f64> = pairs.iter().filter_map(kept_score).collect();
                if kept.is_empty() {
                    continue;
                }
                let max = kept.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let denom: f64 = kept.iter().map(|s| (s - max).exp()).sum();
                let probs: Vec<Option<f64>> = pairs
                    .iter()
                    .map(|p| kept_score(p).map(|s| (s - max).exp() / denom))
                    .collect();
                let dps: Vec<f64> = (0..pos.skv)
                    .map(|j| dot(&go, v.row(&[b, kvh, j])))
                    .collect();
                let d_row: f64 = probs
                    .iter()
                    .zip(&dps)
                    .filter_map(|(p, dp)| p.map(|p| p * dp))
                    .sum();
                for (j, (p, (at, raw, _))) in probs.iter().zip(&pairs).enumerate() {
                    let Some(p) = *p else { continue };
                    let env = Env {
                        score: *raw,
                        b: b as i64,
                        h: h as i64,
                        q: at.pos_q,
                        k: at.pos_k,
                        qi: i as i64,
                        ki: j as i64,
                    };
                    let ds = p * (dps[j] - d_row) * eval(derivative, &env).as_f64();
                    axpy(dv.row_mut(&[b, kvh, j]), p, &go);
                    axpy(dq.row_mut(&[b, h, i]), ds, k.row(&[b, kvh, j]));
                    axpy(dk.row_mut(&[b, kvh, j]), ds, &qi);
                }
            }
        }
    }
    (dq, dk, dv)
}

/// `y += a x`.
fn axpy(y: &mut [f64], a: f64, x: &[f64]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}
