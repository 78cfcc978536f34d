//! `normalize = softmax | sigmoid(bias = B)`: parsed, printed back, refused where it does not
//! compose, and what the reference computes, by hand.

use crate::support::rejects;
use attn_dsl::reference::{Array, Inputs, attention};
use attn_dsl::{Normalize, SigmoidBias, parse_str};

#[test]
fn each_spelling_parses_and_prints_back() {
    for (text, want, printed) in [
        ("normalize = softmax", Normalize::Softmax, None),
        (
            "normalize = sigmoid",
            Normalize::Sigmoid(SigmoidBias::Value(0.0)),
            Some("sigmoid"),
        ),
        (
            "normalize = sigmoid(bias = -2.5)",
            Normalize::Sigmoid(SigmoidBias::Value(-2.5)),
            Some("sigmoid(bias = -2.5)"),
        ),
        (
            "normalize = sigmoid(bias = -ln(4096))",
            Normalize::Sigmoid(SigmoidBias::NegLn(4096)),
            Some("sigmoid(bias = -ln(4096))"),
        ),
        (
            "normalize = stick_breaking",
            Normalize::StickBreaking,
            Some("stick_breaking"),
        ),
    ] {
        let spec = parse_str(&format!("heads = 2, head_dim = 8, {text}")).unwrap();
        assert_eq!(spec.normalize, want, "{text}");
        let shown = spec.to_string();
        match printed {
            Some(p) => assert!(shown.contains(&format!("normalize = {p}")), "{shown}"),
            None => assert!(!shown.contains("normalize"), "{shown}"),
        }
        assert_eq!(parse_str(&shown).unwrap(), spec);
    }
    assert_eq!(SigmoidBias::NegLn(4096).value(), -(4096f64).ln());
}

#[test]
fn combinations_that_do_not_hold_are_refused() {
    let m = "heads = 2, head_dim = 8, ";
    rejects(
        &format!("{m}normalize = sigmoid, sinks = learned"),
        "there is none for a sink to join",
        "normalize = ",
        "sigmoid",
    );
    rejects(
        &format!("{m}mla(latent_rank = 16, rope_dim = 8), normalize = sigmoid"),
        "not built for mla(...) yet",
        "normalize = ",
        "sigmoid",
    );
    rejects(
        &format!("{m}normalize = stick_breaking, sinks = learned"),
        "normalize = stick_breaking weighs each key without a denominator",
        "normalize = ",
        "stick_breaking",
    );
    rejects(
        &format!("{m}normalize = tanh"),
        "softmax, sigmoid, sigmoid(bias = B), sigmoid(bias = -ln(N)), stick_breaking",
        "normalize = ",
        "tanh",
    );
    rejects(
        &format!("{m}normalize = sigmoid(scale = 2.0)"),
        "unknown argument `scale` of sigmoid(...)",
        "(",
        "scale",
    );
    rejects(
        &format!("{m}normalize = sigmoid(bias = -ln(0))"),
        "-ln(N) for N of at least 1",
        "normalize = ",
        "sigmoid",
    );
}

/// One query, three keys, by hand: `out = sum_j sigmoid(s_j + B) v_j`, `lse = ln(sum_j w_j)`.
#[test]
fn the_reference_weighs_each_key_by_its_sigmoid() {
    let spec = parse_str("heads = 1, head_dim = 2, scale = 1.0, normalize = sigmoid(bias = -1.0)")
        .unwrap();
    let q = Array::from_vec(&[1, 1, 1, 2], vec![1.0, 2.0]).unwrap();
    let k = Array::from_vec(&[1, 1, 3, 2], vec![0.5, 0.0, -1.0, 1.0, 2.0, -3.0]).unwrap();
    let v = Array::from_vec(&[1, 1, 3, 2], vec![1.0, 0.0, 0.0, 1.0, 2.0, 2.0]).unwrap();
    let got = attention(
        &spec,
        &Inputs {
            q: &q,
            k: &k,
            v: &v,
            position_offset: 0,
        },
    )
    .unwrap();
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    // Scores 0.5, 1.0, -4.0; each shifted by the bias.
    let w = [sig(-0.5), sig(0.0), sig(-5.0)];
    let out = [w[0] + 2.0 * w[2], w[1] + 2.0 * w[2]];
    for (g, e) in got.out.data().iter().zip(out) {
        assert!((g - e).abs() < 1e-15, "{g} vs {e}");
    }
    let lse = (w[0] + w[1] + w[2]).ln();
    assert!((got.lse.data()[0] - lse).abs() < 1e-15);

    // A row with no kept key: out 0, lse -inf.
    let masked =
        parse_str("heads = 1, head_dim = 2, normalize = sigmoid, mask_mod = |b, h, q, k| false")
            .unwrap();
    let got = attention(
        &masked,
        &Inputs {
            q: &q,
            k: &k,
            v: &v,
            position_offset: 0,
        },
    )
    .unwrap();
    assert_eq!(got.out.data(), &[0.0, 0.0]);
    assert_eq!(got.lse.data()[0], f64::NEG_INFINITY);
}

/// One query, three kept keys and one masked, by hand in the paper's product form: from the
/// nearest key, `A_j = sigmoid(s_j) prod_{l nearer, kept} (1 - sigmoid(s_l))`.
#[test]
fn the_reference_breaks_the_stick_from_the_nearest_key() {
    let spec = parse_str(
        "heads = 1, head_dim = 2, scale = 1.0, normalize = stick_breaking, \
         mask_mod = |b, h, q, k| k != 1",
    )
    .unwrap();
    let q = Array::from_vec(&[1, 1, 1, 2], vec![1.0, 2.0]).unwrap();
    let k = Array::from_vec(
        &[1, 1, 4, 2],
        vec![0.5, 0.0, 9.0, 9.0, -1.0, 1.0, 2.0, -3.0],
    )
    .unwrap();
    let v = Array::from_vec(&[1, 1, 4, 2], vec![1.0, 0.0, 5.0, 5.0, 0.0, 1.0, 2.0, 2.0]).unwrap();
    let inputs = Inputs {
        q: &q,
        k: &k,
        v: &v,
        position_offset: 0,
    };
    let got = attention(&spec, &inputs).unwrap();
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    // Kept scores 0.5 (key 0), 1.0 (key 2), -4.0 (key 3, the nearest); key 1 is masked.
    let (s0, s2, s3) = (sig(0.5), sig(1.0), sig(-4.0));
    let a3 = s3;
    let a2 = s2 * (1.0 - s3);
    let a0 = s0 * (1.0 - s2) * (1.0 - s3);
    let out = [a0 + 2.0 * a3, a2 + 2.0 * a3];
    for (g, e) in got.out.data().iter().zip(out) {
        assert!((g - e).abs() < 1e-15, "{g} vs {e}");
    }
    assert!((got.lse.data()[0] - (a0 + a2 + a3).ln()).abs() < 1e-15);
}
