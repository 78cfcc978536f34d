//! `differential = lambda(init = L)`: parsed, printed back, refused where it does not hold, the
//! reference against the paper's formula written out here, and its gradients (lambda's vectors
//! included) against finite differences.

use crate::support::rejects;
use attn_dsl::inputs::values_f64;
use attn_dsl::reference::{Array, Inputs, differential, differential_backward};
use attn_dsl::{Differential, parse_str};

#[test]
fn each_spelling_parses_and_prints_back() {
    let m = "heads = 4, kv_heads = 2, head_dim = 8";
    for (text, want) in [
        ("", None),
        (", differential = none", None),
        (", differential = lambda", Some(0.8)),
        (", differential = lambda(init = 0.2)", Some(0.2)),
        (", differential = lambda(init = -1.5)", Some(-1.5)),
    ] {
        let spec = parse_str(&format!("{m}{text}")).unwrap();
        assert_eq!(spec.differential.map(|d| d.lambda_init), want, "{text}");
        let shown = spec.to_string();
        assert_eq!(
            shown.contains("differential = lambda(init = "),
            want.is_some()
        );
        assert_eq!(parse_str(&shown).unwrap(), spec, "{shown}");
    }
    let spec = parse_str(&format!("{m}, differential = lambda")).unwrap();
    assert_eq!((spec.output_heads(), spec.value_heads()), (2, 1));
    assert_eq!(spec.lambda_tensors().len(), 4);
    assert!(spec.differential_components().differential.is_none());
    // The paper's schedule: 0.2 at the first layer, towards 0.8.
    assert!((Differential::by_depth(1).lambda_init - 0.2).abs() < 1e-15);
    assert!((Differential::by_depth(40).lambda_init - 0.8).abs() < 1e-5);
}

#[test]
fn combinations_that_do_not_hold_are_refused() {
    rejects(
        "heads = 3, kv_heads = 3, head_dim = 8, differential = lambda",
        "even counts of both",
        "differential = ",
        "lambda",
    );
    rejects(
        "heads = 4, kv_heads = 1, head_dim = 8, differential = lambda",
        "kv_heads = 1",
        "differential = ",
        "lambda",
    );
    rejects(
        "heads = 4, head_dim = 8, mla(latent_rank = 16, rope_dim = 8), differential = lambda",
        "not built for mla(...)",
        "differential = ",
        "lambda",
    );
    rejects(
        "heads = 4, head_dim = 8, differential = lambda(init = 1e9)",
        "allowed: a finite number within ±1e6",
        "differential = ",
        "lambda",
    );
    rejects(
        "heads = 4, head_dim = 8, differential = pairs",
        "none, lambda, lambda(init = L)",
        "differential = ",
        "pairs",
    );
    rejects(
        "heads = 4, head_dim = 8, differential = lambda(scale = 2)",
        "unknown argument `scale` of lambda(...)",
        "(",
        "scale",
    );
    let named = "heads = 4, head_dim = 8, differential = lambda, params(lambda_q1: [8])";
    let errs = parse_str(named).unwrap_err();
    assert!(
        errs.to_string()
            .contains("`lambda_q1` is a learnable vector"),
        "{errs}"
    );
}

fn array(shape: &[usize], seed: u64) -> Array {
    Array::from_vec(shape, values_f64(shape.iter().product(), seed)).unwrap()
}

fn vectors(d: usize, seed: u64) -> [Vec<f64>; 4] {
    // Small, so that lambda stays near its init as in the paper's initialization.
    [0, 1, 2, 3].map(|i| {
        array(&[d], seed + i)
            .data()
            .iter()
            .map(|x| 0.3 * x)
            .collect()
    })
}

fn views(v: &[Vec<f64>; 4]) -> [&[f64]; 4] {
    [&v[0][..], &v[1][..], &v[2][..], &v[3][..]]
}

/// The paper's formula with its GQA as the official code does it (k's heads repeated over the
/// query heads, v's over the differential heads), causal, in plain loops.
#[test]
fn the_reference_is_the_papers_formula() {
    let spec = parse_str(
        "heads = 4, kv_heads = 2, head_dim = 3, v_head_dim = 6, mask = causal, \
         differential = lambda(init = 0.3)",
    )
    .unwrap();
    let (sq, skv) = (3, 5);
    let (q, k, v) = (
        array(&[1, 4, sq, 3], 1),
        array(&[1, 2, skv, 3], 2),
        array(&[1, 1, skv, 6], 3),
    );
    let lv = vectors(3, 7);
    let x = Inputs {
        q: &q,
        k: &k,
        v: &v,
        position_offset: 0,
    };
    let got = differential(&spec, &x, views(&lv), &[]).unwrap();
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let lambda = dot(&lv[0], &lv[1]).exp() - dot(&lv[2], &lv[3]).exp() + 0.3;
    assert!((got.lambda - lambda).abs() < 1e-15);
    let weights = |head: usize, i: usize| -> Vec<f64> {
        // q head `head` reads k head head / 2 (4 query heads over 2 key heads).
        let last = skv - sq + i;
        let s: Vec<f64> = (0..=last)
            .map(|j| dot(q.row(&[0, head, i]), k.row(&[0, head / 2, j])) / 3f64.sqrt())
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
        s.iter().map(|x| (x - m).exp() / z).collect()
    };
    for h in 0..2 {
        for i in 0..sq {
            let (a1, a2) = (weights(2 * h, i), weights(2 * h + 1, i));
            for c in 0..6 {
                let want: f64 = (0..a1.len())
                    .map(|j| (a1[j] - lambda * a2[j]) * v.get(&[0, 0, j, c]))
                    .sum();
                let g = got.out.get(&[0, h, i, c]);
                assert!((g - want).abs() < 1e-14, "h {h} i {i} c {c}: {g} vs {want}");
            }
        }
    }
}

/// Every gradient, lambda's vectors included, against central differences of
/// `L = sum(out * dout)`.
#[test]
fn gradients_match_finite_differences() {
    for text in [
        "heads = 4, kv_heads = 2, head_dim = 4, mask = causal, differential = lambda",
        "heads = 2, head_dim = 4, v_head_dim = 8, position = rope, softcap = 5.0, \
         differential = lambda(init = 0.1)",
        "heads = 4, kv_heads = 4, head_dim = 4, normalize = sigmoid, differential = lambda",
    ] {
        let spec = parse_str(text).unwrap();
        let (b, sq, skv) = (2, 3, 4);
        let (h, hk) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let mut x = [
            array(&[b, h, sq, d], 11),
            array(&[b, hk, skv, d], 12),
            array(&[b, hk / 2, skv, dv], 13),
        ];
        let mut lv = vectors(d, 20);
        let dout = array(&[b, h / 2, sq, dv], 14);
        let loss = |x: &[Array; 3], lv: &[Vec<f64>; 4]| -> f64 {
            let inputs = Inputs {
                q: &x[0],
                k: &x[1],
                v: &x[2],
                position_offset: 0,
            };
            let out = differential(&spec, &inputs, views(lv), &[]).unwrap().out;
            out.data().iter().zip(dout.data()).map(|(o, g)| o * g).sum()
        };
        let inputs = Inputs {
            q: &x[0],
            k: &x[1],
            v: &x[2],
            position_offset: 0,
        };
        let g = differential_backward(&spec, &inputs, views(&lv), &dout, &[]).unwrap();
        let analytic = [g.inputs.dq, g.inputs.dk, g.inputs.dv];
        let e = 1e-6;
        for which in 0..3 {
            for flat in 0..x[which].data().len() {
                let at = index_of(x[which].shape(), flat);
                let base = x[which].get(&at);
                x[which].set(&at, base + e);
                let up = loss(&x, &lv);
                x[which].set(&at, base - e);
                let down = loss(&x, &lv);
                x[which].set(&at, base);
                let numeric = (up - down) / (2.0 * e);
                let a = analytic[which].get(&at);
                assert!(
                    (numeric - a).abs() < 1e-6,
                    "{text}: input {which}[{flat}]: {numeric} vs {a}"
                );
            }
        }
        for (vector, grad) in (0..4).zip(&g.lambda) {
            for i in 0..d {
                let base = lv[vector][i];
                lv[vector][i] = base + e;
                let up = loss(&x, &lv);
                lv[vector][i] = base - e;
                let down = loss(&x, &lv);
                lv[vector][i] = base;
                let numeric = (up - down) / (2.0 * e);
                assert!(
                    (numeric - grad[i]).abs() < 1e-6,
                    "{text}: lambda vector {vector}[{i}]: {numeric} vs {}",
                    grad[i]
                );
            }
        }
    }
}

fn index_of(shape: &[usize], mut flat: usize) -> Vec<usize> {
    let mut at = vec![0; shape.len()];
    for (axis, dim) in shape.iter().enumerate().rev() {
        at[axis] = flat % dim;
        flat /= dim;
    }
    at
}

#[test]
fn the_per_head_entry_points_refuse_a_differential_spec() {
    let spec = parse_str("heads = 2, head_dim = 2, differential = lambda").unwrap();
    let (q, k, v) = (
        array(&[1, 2, 1, 2], 1),
        array(&[1, 2, 1, 2], 2),
        array(&[1, 2, 1, 2], 3),
    );
    let x = Inputs {
        q: &q,
        k: &k,
        v: &v,
        position_offset: 0,
    };
    let err = attn_dsl::reference::attention(&spec, &x).unwrap_err();
    assert!(
        err.to_string().contains("use reference::differential"),
        "{err}"
    );
    // v must hold kv_heads / 2 heads here.
    let lv = vectors(2, 1);
    let err = differential(&spec, &x, views(&lv), &[]).unwrap_err();
    assert!(err.to_string().contains("tensor `v`"), "{err}");
}
