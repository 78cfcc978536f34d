//! The reference semantics: what every kernel of every backend must compute.
//!
//! Plain f64, O(Sq·Skv) memory, written to be read next to docs/semantics.md, not to be
//! fast. Inputs are BHSD arrays (MLA: the DeepSeek tensors). Outputs are `out` and `lse`, the
//! natural log of the softmax denominator over the kept keys; a row with no kept key gives
//! `out = 0` and `lse = -inf`.

pub mod alibi;
mod array;
mod backward;
mod differential;
mod learned;
mod mla;
pub mod rope;

pub use array::Array;
pub use backward::{Gradients, backward, backward_learned};
pub use differential::{
    DifferentialGradients, DifferentialOutput, LambdaVectors, differential, differential_backward,
};
pub use learned::Learned;
pub use mla::{MlaAbsorbed, MlaGradients, MlaInputs, backward_mla, mla_absorbed, mla_expanded};

use crate::error::ReferenceError;
use crate::modifier::ParamValues;
use crate::spec::{AttentionSpec, CausalAlign, Mask, Normalize, Position};

/// Inputs of per-head attention (MHA/GQA/MQA).
#[derive(Clone, Copy, Debug)]
pub struct Inputs<'a> {
    /// Queries `[B, Hq, Sq, D]`, before RoPE.
    pub q: &'a Array,
    /// Keys `[B, Hkv, Skv, D]`, before RoPE.
    pub k: &'a Array,
    /// Values `[B, Hkv, Skv, Dv]`.
    pub v: &'a Array,
    /// Position of key 0 (`p0`): key `j` is at `p0 + j`, query `i` at `p0 + Skv - Sq + i`.
    pub position_offset: i64,
}

/// Outputs of attention.
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    /// `[B, Hq, Sq, Dv]`.
    pub out: Array,
    /// `[B, Hq, Sq]`, natural log of the softmax denominator; `-inf` for fully masked rows.
    pub lse: Array,
}

/// Largest magnitude of a position: every query and key position of a call lies in
/// `-MAX_POSITION..=MAX_POSITION` (the range of an i32, which every backend computes positions and
/// their differences in exactly, and far past any context length in use).
pub const MAX_POSITION: i64 = i32::MAX as i64;

/// Checks that every position of a call of `sq` queries against `skv` keys at offset `p0` (keys
/// `p0..p0 + skv`, queries ending at the last key, docs/semantics.md) lies within
/// [`MAX_POSITION`]. The error says which positions and what is allowed.
pub fn check_positions(sq: usize, skv: usize, p0: i64) -> Result<(), ReferenceError> {
    let (sq, skv) = (sq as i128, skv as i128);
    let first = i128::from(p0) + (skv - sq).min(0);
    let last = i128::from(p0) + skv - 1;
    let limit = i128::from(MAX_POSITION);
    if first < -limit || last.max(i128::from(p0)) > limit {
        return Err(ReferenceError::Positions(format!(
            "position offset {p0} with {sq} queries and {skv} keys puts positions at {first} to \
             {last}; allowed: positions from -{limit} to {limit}"
        )));
    }
    Ok(())
}

/// Largest xPos exponent ([`rope::decay_exponent`]) the f64 reference takes: factors up to
/// `e^600` and down to `e^-600` stay normal numbers.
const MAX_DECAY_EXPONENT: f64 = 600.0;

/// Refuses positions whose xPos factors leave f64's range.
fn check_decay(r: &crate::spec::Rope, positions: &Positions) -> Result<(), ReferenceError> {
    let far = positions
        .queries()
        .into_iter()
        .chain(positions.keys())
        .map(|p| p.unsigned_abs())
        .max()
        .unwrap_or(0);
    if rope::decay_exponent(r, far as f64) > MAX_DECAY_EXPONENT {
        return Err(ReferenceError::Positions(format!(
            "xpos: position {far} scales q and k by e^{:.0}, past f64's range; allowed: \
             positions whose factor stays within e^{MAX_DECAY_EXPONENT}",
            rope::decay_exponent(r, far as f64)
        )));
    }
    Ok(())
}

/// Computes attention for a per-head spec without learnable tensors.
pub fn attention(spec: &AttentionSpec, inputs: &Inputs) -> Result<Output, ReferenceError> {
    attention_learned(spec, inputs, &[])
}

/// Computes attention for a per-head spec, with the values of its learnable tensors
/// (parameters by their declared names, and `sinks`).
pub fn attention_learned(
    spec: &AttentionSpec,
    inputs: &Inputs,
    learned: &[ParamValues],
) -> Result<Output, ReferenceError> {
    let (q, k, positions) = attention_inputs(spec, inputs)?;
    let learned = Learned::check(spec, learned, &call_dims(inputs))?;
    let spec = &crate::data::reads_at_offset(spec, inputs.position_offset);
    Ok(attend(spec, &q, &k, inputs.v, &positions, &learned))
}

/// Checks a per-head call's spec, shapes and positions; returns q and k after RoPE and the
/// call's positions.
fn attention_inputs(
    spec: &AttentionSpec,
    inputs: &Inputs,
) -> Result<(Array, Array, Positions), ReferenceError> {
    check_spec(spec)?;
    if spec.differential.is_some() {
        return Err(ReferenceError::WrongEntryPoint(
            "this spec has differential heads: use reference::differential",
        ));
    }
    if spec.mla().is_some() {
        return Err(ReferenceError::WrongEntryPoint(
            "this is an MLA spec: use reference::mla_absorbed or reference::mla_expanded",
        ));
    }
    let [b, _, sq, d] = dims4("q", inputs.q)?;
    let (hkv, dv) = (spec.kv_heads() as usize, spec.v_head_dim as usize);
    expect(
        "q",
        inputs.q,
        &[b, spec.heads as usize, sq, spec.head_dim as usize],
    )?;
    let [_, _, skv, _] = dims4("k", inputs.k)?;
    expect("k", inputs.k, &[b, hkv, skv, d])?;
    expect("v", inputs.v, &[b, hkv, skv, dv])?;
    check_positions(sq, skv, inputs.position_offset)?;
    let positions = Positions::new(sq, skv, inputs.position_offset);
    if let Some(r) = spec.rope() {
        check_decay(r, &positions)?;
    }
    Ok(match &spec.position {
        Position::Rope(r) => (
            rope::apply(
                r,
                inputs.q,
                &positions.queries(),
                positions.total_len(),
                rope::Side::Query,
            ),
            rope::apply(
                r,
                inputs.k,
                &positions.keys(),
                positions.total_len(),
                rope::Side::Key,
            ),
            positions,
        ),
        _ => (inputs.q.clone(), inputs.k.clone(), positions),
    })
}

/// The call's dimensions, for its data tensors (the shapes were checked).
fn call_dims(inputs: &Inputs) -> crate::data::CallDims {
    crate::data::CallDims::new(
        inputs.q.shape()[0],
        inputs.q.shape()[2],
        inputs.k.shape()[2],
        inputs.position_offset,
    )
}

fn check_spec(spec: &AttentionSpec) -> Result<(), ReferenceError> {
    spec.validate().map_err(|findings| {
        ReferenceError::Spec(
            findings
                .iter()
                .map(|f| f.to_string())
                .collect::<Vec<_>>()
                .join("; "),
        )
    })
}

fn dims4(name: &'static str, a: &Array) -> Result<[usize; 4], ReferenceError> {
    a.shape().try_into().map_err(|_| ReferenceError::Shape {
        name,
        found: a.shape().to_vec(),
        expected: "a 4-D array [B, H, S, D]".to_string(),
    })
}

fn expect(name: &'static str, a: &Array, shape: &[usize]) -> Result<(), ReferenceError> {
    if a.shape() == shape {
        Ok(())
    } else {
        Err(ReferenceError::Shape {
            name,
            found: a.shape().to_vec(),
            expected: format!("{shape:?}"),
        })
    }
}

/// Absolute positions of queries and keys (docs/semantics.md, "Scores, masks and positions").
#[derive(Clone, Copy, Debug)]
struct Positions {
    sq: usize,
    skv: usize,
    offset: i64,
}

impl Positions {
    fn new(sq: usize, skv: usize, offset: i64) -> Self {
        Positions { sq, skv, offset }
    }

    fn query(&self, i: usize) -> i64 {
        self.offset + self.skv as i64 - self.sq as i64 + i as i64
    }

    fn key(&self, j: usize) -> i64 {
        self.offset + j as i64
    }

    fn queries(&self) -> Vec<i64> {
        (0..self.sq).map(|i| self.query(i)).collect()
    }

    fn keys(&self) -> Vec<i64> {
        (0..self.skv).map(|j| self.key(j)).collect()
    }

    /// The current total length, `Skv + p0` (what dynamic NTK scaling reads).
    fn total_len(&self) -> u64 {
        (self.skv as i64 + self.offset).max(0) as u64
    }
}

/// Where a (query, key) pair is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pair {
    /// Batch index.
    pub b: usize,
    /// Query head.
    pub h: usize,
    /// Absolute query position.
    pub pos_q: i64,
    /// Absolute key position.
    pub pos_k: i64,
    /// Query row index in the call.
    pub i: usize,
    /// Key index in the call.
    pub j: usize,
}

/// The score of a pair whose (roped) `<q, k>` is `dot`, after scale, softcap, ALiBi and the
/// custom score modifier, or `None` when the built-in or custom mask drops the pair.
pub fn pair_score(spec: &AttentionSpec, dot: f64, at: Pair) -> Option<f64> {
    let slopes = match spec.position {
        Position::Alibi => alibi::slopes(spec.heads),
        _ => Vec::new(),
    };
    score(spec, &slopes, dot, at, &[])
}

/// [`pair_score`] with the values of the tensors the modifiers read (parameters and data, by
/// name; `seq` entries read relative to position 0, as a call at offset 0 reads them).
pub fn pair_score_with(
    spec: &AttentionSpec,
    dot: f64,
    at: Pair,
    tensors: &[ParamValues],
) -> Option<f64> {
    let slopes = match spec.position {
        Position::Alibi => alibi::slopes(spec.heads),
        _ => Vec::new(),
    };
    score(spec, &slopes, dot, at, tensors)
}

/// [`pair_score`] with the ALiBi slopes computed once by the caller, and the parameters the
/// score modifier reads.
fn score(
    spec: &AttentionSpec,
    slopes: &[f64],
    dot: f64,
    at: Pair,
    params: &[ParamValues],
) -> Option<f64> {
    let (pq, pk) = (at.pos_q, at.pos_k);
    let keep = match spec.mask {
        Mask::None => true,
        Mask::Causal(CausalAlign::BottomRight) => pk <= pq,
        Mask::Causal(CausalAlign::TopLeft) => at.j <= at.i,
        Mask::SlidingWindow { window } => pk <= pq && (pq - pk) < window as i64,
    };
    let (bi, hi) = (at.b as i64, at.h as i64);
    if !keep
        || spec
            .mask_mod
            .as_ref()
            .is_some_and(|m| !m.keeps_with(bi, hi, pq, pk, params))
    {
        return None;
    }
    let mut s = spec.effective_scale() * dot;
    if let Some(c) = spec.softcap {
        s = c * (s / c).tanh();
    }
    if let Position::Alibi = spec.position {
        s += slopes[at.h] * (pk - pq) as f64;
    }
    if let Some(m) = &spec.score_mod {
        s = m.apply_with(s, bi, hi, pq, pk, params);
    }
    // Scores are f32 values: one past f32::MAX is +inf (its row is NaN), one below -f32::MAX
    // is -inf (it weighs nothing, as a masked key).
    if s.abs() > f64::from(f32::MAX) {
        s = s.signum() * f64::INFINITY;
    }
    Some(s)
}

/// Softmax attention over already-rotated q `[B, Hq, Sq, Dqk]`, k `[B, Hkv, Skv, Dqk]` and
/// v `[B, Hkv, Skv, Dv]`; query head `h` reads KV head `h / (Hq / Hkv)`. A sink joins each
/// row's softmax as one more logit with no value.
fn attend(
    spec: &AttentionSpec,
    q: &Array,
    k: &Array,
    v: &Array,
    pos: &Positions,
    learned: &Learned,
) -> Output {
    let [b_n, hq, sq, _]: [usize; 4] = q.shape().try_into().expect("checked by the caller");
    let hkv = k.shape()[1];
    let dv = v.shape()[3];
    let group = hq / hkv;
    let slopes = alibi::slopes(hq as u32);
    let mut out = Array::zeros(&[b_n, hq, sq, dv]);
    let mut lse = Array::zeros(&[b_n, hq, sq]);
    let mut scores = Vec::with_capacity(pos.skv);
    for b in 0..b_n {
        for h in 0..hq {
            let kvh = h / group;
            for i in 0..sq {
                let qi = q.row(&[b, h, i]);
                scores.clear();
                scores.extend((0..pos.skv).map(|j| {
                    let dot = dot(qi, k.row(&[b, kvh, j]));
                    let at = Pair {
                        b,
                        h,
                        pos_q: pos.query(i),
                        pos_k: pos.key(j),
                        i,
                        j,
                    };
                    score(spec, &slopes, dot, at, &learned.params)
                }));
                let weights = match spec.normalize {
                    Normalize::Sigmoid(bias) => Some(sigmoid_weights(&scores, bias.value())),
                    Normalize::StickBreaking => Some(stick_breaking_weights(&scores)),
                    Normalize::Softmax => None,
                };
                if let Some(weights) = weights {
                    lse.set(&[b, h, i], weights.lse);
                    let row = out.row_mut(&[b, h, i]);
                    for (j, w) in weights.of.iter().enumerate() {
                        if let Some(w) = w {
                            for (o, x) in row.iter_mut().zip(v.row(&[b, kvh, j])) {
                                *o += w * x;
                            }
                        }
                    }
                    continue;
                }
                let sink = learned.sink(h);
                // A NaN or +inf score of a kept key (or sink) makes the row NaN (as in PyTorch:
                // inf - inf); masked keys never reach it.
                if scores
                    .iter()
                    .flatten()
                    .chain(&sink)
                    .any(|s| s.is_nan() || *s == f64::INFINITY)
                {
                    lse.set(&[b, h, i], f64::NAN);
                    out.row_mut(&[b, h, i]).fill(f64::NAN);
                    continue;
                }
                let max = scores
                    .iter()
                    .flatten()
                    .chain(&sink)
                    .copied()
                    .fold(f64::NEG_INFINITY, f64::max);
                if max == f64::NEG_INFINITY {
                    lse.set(&[b, h, i], f64::NEG_INFINITY);
                    continue;
                }
                let denom: f64 = scores
                    .iter()
                    .flatten()
                    .chain(&sink)
                    .map(|s| (s - max).exp())
                    .sum();
                lse.set(&[b, h, i], max + denom.ln());
                let row = out.row_mut(&[b, h, i]);
                for (j, s) in scores.iter().enumerate() {
                    if let Some(s) = s {
                        let p = (s - max).exp() / denom;
                        for (o, x) in row.iter_mut().zip(v.row(&[b, kvh, j])) {
                            *o += p * x;
                        }
                    }
                }
            }
        }
    }
    Output { out, lse }
}

/// The weights of one row under `normalize = sigmoid(bias)`: `sigmoid(s_j + bias)` for each
/// kept key (`None` for a masked one), and `lse = ln(sum of the weights)` (`-inf` for a row
/// with no kept key or weights that all underflow). A NaN score gives a NaN weight, so its
/// row's out and lse are NaN; a score of `+inf` weighs 1 and `-inf` nothing.
pub(crate) struct SigmoidRow {
    pub of: Vec<Option<f64>>,
    pub lse: f64,
}

pub(crate) fn sigmoid_weights(scores: &[Option<f64>], bias: f64) -> SigmoidRow {
    let of: Vec<Option<f64>> = scores
        .iter()
        .map(|s| s.map(|s| sigmoid(s + bias)))
        .collect();
    let sum: f64 = of.iter().flatten().sum();
    SigmoidRow { of, lse: sum.ln() }
}

/// The weights of one row under `normalize = stick_breaking`, in the form of
/// [`sigmoid_weights`]: from the nearest kept key (the largest position, the last index) to
/// the farthest, `A_j = exp(ln sigmoid(s_j) - R_j)` with `R_j` the sum of `softplus(s_l)` over
/// the kept keys nearer than `j` (`-ln(1 - sigmoid(s)) = softplus(s)`). A NaN score makes its
/// weight and every farther one NaN; `+inf` weighs 1 and leaves nothing farther.
pub(crate) fn stick_breaking_weights(scores: &[Option<f64>]) -> SigmoidRow {
    let mut of = vec![None; scores.len()];
    let mut nearer = 0.0;
    for (j, s) in scores.iter().enumerate().rev() {
        let Some(s) = *s else { continue };
        of[j] = Some(if s == f64::NEG_INFINITY {
            0.0
        } else {
            (-softplus(-s) - nearer).exp()
        });
        nearer += softplus(s);
    }
    let sum: f64 = of.iter().flatten().sum();
    SigmoidRow { of, lse: sum.ln() }
}

/// `ln(1 + exp(x))`, without overflow for either sign.
pub(crate) fn softplus(x: f64) -> f64 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// `1 / (1 + exp(-x))`, without overflow for either sign.
pub(crate) fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
