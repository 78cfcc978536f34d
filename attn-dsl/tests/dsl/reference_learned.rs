//! The reference with learnable tensors: parameter and sink gradients checked by central finite
//! differences of the reference forward (loss `L = sum(out * dout)`), and sinks checked against
//! their definition as one more softmax logit with no value.

use attn_dsl::inputs::values_f64;
use attn_dsl::modifier::ParamValues;
use attn_dsl::parse_str;
use attn_dsl::reference::{Array, Inputs, attention, attention_learned, backward_learned};

fn array(shape: &[usize], seed: u64) -> Array {
    let n = shape.iter().product();
    Array::from_vec(shape, values_f64(n, seed)).expect("the values fill the shape")
}

/// Each of the spec's learnable tensors, filled from `seed` and scaled by `scale`.
fn learned(spec: &attn_dsl::AttentionSpec, seed: u64, scale: f64) -> Vec<ParamValues> {
    spec.learnable_tensors()
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n = shape.iter().product();
            let values = values_f64(n, seed + i as u64)
                .iter()
                .map(|v| v * scale)
                .collect();
            ParamValues {
                name,
                shape,
                values,
            }
        })
        .collect()
}

struct Case {
    spec: attn_dsl::AttentionSpec,
    q: Array,
    k: Array,
    v: Array,
    dout: Array,
    p0: i64,
}

impl Case {
    fn new(text: &str, sq: usize, skv: usize, p0: i64) -> Case {
        let spec = parse_str(text).unwrap();
        let (hq, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        Case {
            q: array(&[1, hq, sq, d], 1),
            k: array(&[1, hkv, skv, d], 2),
            v: array(&[1, hkv, skv, dv], 3),
            dout: array(&[1, hq, sq, dv], 4),
            spec,
            p0,
        }
    }

    fn inputs(&self) -> Inputs<'_> {
        Inputs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            position_offset: self.p0,
        }
    }

    fn loss(&self, learned: &[ParamValues]) -> f64 {
        let out = attention_learned(&self.spec, &self.inputs(), learned)
            .unwrap()
            .out;
        out.data()
            .iter()
            .zip(self.dout.data())
            .map(|(o, g)| o * g)
            .sum()
    }

    /// Every learnable gradient against finite differences.
    fn check(&self, scale: f64) {
        let values = learned(&self.spec, 10, scale);
        let grads = backward_learned(&self.spec, &self.inputs(), &self.dout, &values).unwrap();
        assert_eq!(grads.learned.len(), values.len());
        let eps = 1e-6;
        for (t, (tensor, grad)) in values.iter().zip(&grads.learned).enumerate() {
            assert_eq!(grad.name, format!("d{}", tensor.name));
            assert_eq!(grad.shape, tensor.shape);
            let mut nonzero = 0;
            for e in 0..tensor.values.len() {
                let mut plus = values.clone();
                plus[t].values[e] += eps;
                let mut minus = values.clone();
                minus[t].values[e] -= eps;
                let numeric = (self.loss(&plus) - self.loss(&minus)) / (2.0 * eps);
                let analytic = grad.values[e];
                assert!(
                    (numeric - analytic).abs() <= 1e-6 * (1.0 + numeric.abs()),
                    "{}: d{}[{e}] analytic {analytic} numeric {numeric}",
                    self.spec,
                    tensor.name
                );
                nonzero += usize::from(analytic != 0.0);
            }
            assert!(
                nonzero > 0,
                "d{} is all zero: the check proves nothing",
                tensor.name
            );
        }
    }
}

#[test]
fn parameter_gradients_match_finite_differences() {
    // Learned ALiBi slopes, a clamped relative-position table, a per-head temperature.
    Case::new(
        "heads = 4, kv_heads = 2, head_dim = 8, mask = causal, params(slopes: [heads]), \
         score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32",
        5,
        7,
        0,
    )
    .check(0.5);
    Case::new(
        "heads = 2, head_dim = 8, params(rel: [heads, 4]), \
         score_mod = |s, b, h, q, k| s + rel[h, max(min(q - k, 3), 0)]",
        6,
        6,
        3,
    )
    .check(1.0);
    Case::new(
        "heads = 2, head_dim = 8, softcap = 5.0, params(temp: [heads]), \
         score_mod = |s, b, h, q, k| s * temp[h].exp()",
        4,
        9,
        0,
    )
    .check(0.3);
}

#[test]
fn sink_gradients_match_finite_differences() {
    Case::new(
        "heads = 4, kv_heads = 2, head_dim = 8, mask = sliding_window(3), sinks = learned",
        6,
        6,
        0,
    )
    .check(1.0);
    Case::new(
        "heads = 2, head_dim = 8, mask = causal, sinks = learned, params(slopes: [heads]), \
         score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32",
        5,
        5,
        0,
    )
    .check(0.5);
}

#[test]
fn a_sink_is_one_more_logit_with_no_value() {
    let case = Case::new(
        "heads = 2, head_dim = 8, mask = causal, sinks = learned",
        4,
        4,
        0,
    );
    let plain = parse_str("heads = 2, head_dim = 8, mask = causal").unwrap();
    let without = attention(&plain, &case.inputs()).unwrap();
    let sinks = [0.7, -20.0];
    let values = [ParamValues {
        name: "sinks".into(),
        shape: vec![2],
        values: sinks.to_vec(),
    }];
    let with = attention_learned(&case.spec, &case.inputs(), &values).unwrap();
    for (h, sink) in sinks.iter().enumerate() {
        for i in 0..4 {
            let lse = without.lse.get(&[0, h, i]);
            let total = (lse.exp() + sink.exp()).ln();
            assert!((with.lse.get(&[0, h, i]) - total).abs() < 1e-12);
            let kept = (lse - total).exp();
            for (a, b) in with
                .out
                .row(&[0, h, i])
                .iter()
                .zip(without.out.row(&[0, h, i]))
            {
                assert!(
                    (a - b * kept).abs() < 1e-12,
                    "h {h} row {i}: {a} vs {b} * {kept}"
                );
            }
        }
    }
}

#[test]
fn missing_extra_and_misshapen_tensors_are_named() {
    let case = Case::new(
        "heads = 2, head_dim = 8, sinks = learned, params(t: [heads]), \
                          score_mod = |s, b, h, q, k| s * t[h]",
        2,
        2,
        0,
    );
    let err = |given: &[ParamValues]| {
        attention_learned(&case.spec, &case.inputs(), given)
            .unwrap_err()
            .to_string()
    };
    let t = |shape: Vec<usize>| ParamValues {
        name: "t".into(),
        values: vec![1.0; shape.iter().product()],
        shape,
    };
    let sinks = ParamValues {
        name: "sinks".into(),
        shape: vec![2],
        values: vec![0.0; 2],
    };
    assert!(err(&[t(vec![2])]).contains("`sinks` of shape [2], which is missing"));
    assert!(
        err(&[t(vec![3]), sinks.clone()])
            .contains("tensor `t` has shape [3]; the spec gives it shape [2]")
    );
    let extra = ParamValues {
        name: "u".into(),
        ..sinks.clone()
    };
    assert!(
        err(&[t(vec![2]), sinks.clone(), extra])
            .contains("`u` [2] is not a learnable or data tensor")
    );
    assert!(attention(&case.spec, &case.inputs()).is_err());
}

#[test]
fn sigmoid_parameter_gradients_match_finite_differences() {
    Case::new(
        "heads = 2, head_dim = 8, mask = causal, normalize = sigmoid(bias = -2.0), \
         params(slopes: [heads]), score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32",
        5,
        7,
        0,
    )
    .check(0.5);
}
