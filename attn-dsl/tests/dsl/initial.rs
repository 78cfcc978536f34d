//! Initial values of learnable tensors: parsed, printed back, drawn deterministically, refused
//! where they cannot hold, and the probe that says when training cannot move them.

use crate::support::rejects;
use attn_dsl::initial::stuck_at_start;
use attn_dsl::{ParamInit, parse_str};

#[test]
fn each_kind_of_start_parses_prints_back_and_gives_its_values() {
    let text = "heads = 8, head_dim = 16, params(rel: [heads, 32] = 0.5, \
                w: [heads, 4096] = normal(0.02), u: [heads, 1000] = uniform(-0.1, 0.3), \
                slopes: [heads] = alibi, z: [2], n: [1] = -1.5), \
                score_mod = |s, b, h, q, k| s * w[h, 0] + rel[h, 0] + u[h, 0] - slopes[h] + z[0] + n[0]";
    let spec = parse_str(text).unwrap();
    let inits: Vec<ParamInit> = spec.params.iter().map(|p| p.init).collect();
    assert_eq!(
        inits,
        [
            ParamInit::Constant(0.5),
            ParamInit::Normal(0.02),
            ParamInit::Uniform(-0.1, 0.3),
            ParamInit::Alibi,
            ParamInit::Constant(0.0),
            ParamInit::Constant(-1.5),
        ]
    );
    let printed = spec.to_string();
    assert!(
        printed.contains(
            "params(rel: [heads, 32] = 0.5, w: [heads, 4096] = normal(0.02), \
             u: [heads, 1000] = uniform(-0.1, 0.3), slopes: [heads] = alibi, z: [2], n: [1] = -1.5)"
        ),
        "{printed}"
    );
    assert_eq!(parse_str(&printed).unwrap(), spec);

    let values = spec.initial_values(7);
    let find = |name: &str| &values.iter().find(|(n, ..)| n == name).unwrap().2;
    assert!(find("rel").iter().all(|&x| x == 0.5));
    assert_eq!(find("rel").len(), 8 * 32);
    assert!(find("z").iter().all(|&x| x == 0.0));
    assert_eq!(find("n"), &vec![-1.5]);
    let w = find("w");
    let mean = w.iter().map(|&x| f64::from(x)).sum::<f64>() / w.len() as f64;
    let std = (w
        .iter()
        .map(|&x| (f64::from(x) - mean).powi(2))
        .sum::<f64>()
        / w.len() as f64)
        .sqrt();
    assert!(mean.abs() < 0.001, "mean {mean}");
    assert!((std - 0.02).abs() < 0.001, "std {std}");
    let u = find("u");
    assert!(u.iter().all(|&x| (-0.1..0.3).contains(&x)));
    let mean = u.iter().map(|&x| f64::from(x)).sum::<f64>() / u.len() as f64;
    assert!((mean - 0.1).abs() < 0.01, "mean {mean}");
    // ALiBi's slopes for 8 heads: 2^-1, 2^-2, .., 2^-8.
    let expected: Vec<f32> = (1..=8).map(|i| 0.5f32.powi(i)).collect();
    assert_eq!(find("slopes"), &expected);

    // The same seed draws the same values; another seed other ones; tensors differ.
    assert_eq!(spec.initial_values(7), values);
    assert_ne!(find("w")[..8], spec.initial_values(8)[1].2[..8]);
    assert_ne!(find("w")[..8], find("u")[..8]);
}

#[test]
fn starts_that_cannot_hold_are_refused_at_their_tokens() {
    let m = "heads = 4, head_dim = 8, ";
    let reads = ", score_mod = |s, b, h, q, k| s";
    rejects(
        &format!("{m}params(x: [heads, 2] = alibi){reads}"),
        "`x` = alibi needs the shape [heads]",
        "= ",
        "alibi",
    );
    rejects(
        &format!("{m}params(x: [heads] = normal(0)){reads}"),
        "the standard deviation must be finite and above 0",
        "= ",
        "normal",
    );
    rejects(
        &format!("{m}params(x: [heads] = uniform(1, -1)){reads}"),
        "allowed: finite bounds with low < high",
        "= ",
        "uniform",
    );
    rejects(
        &format!("{m}params(x: [heads] = 1e39){reads}"),
        "allowed: a finite value within f32's range",
        "= ",
        "1e39",
    );
    rejects(
        &format!("{m}params(x: [heads] = gauss(1)){reads}"),
        "unknown initial value; allowed: a number, normal(STD), uniform(LOW, HIGH) or alibi",
        "= ",
        "gauss",
    );
    rejects(
        &format!("{m}params(x: [heads] = normal(0.1, 2)){reads}"),
        "normal takes one argument",
        "= ",
        "normal",
    );
    rejects(
        &format!("{m}params(x: [heads] = q){reads}"),
        "unknown initial value",
        "= ",
        "q",
    );
}

#[test]
fn specs_built_in_code_are_checked_too() {
    let mut spec = parse_str(
        "heads = 4, head_dim = 8, params(x: [heads, 2]), \
                              score_mod = |s, b, h, q, k| s + x[h, 0]",
    )
    .unwrap();
    spec.params[0].init = ParamInit::Alibi;
    let findings = spec.validate().expect_err("refused");
    assert!(
        findings
            .iter()
            .any(|f| f.message.contains("alibi needs the shape [heads]"))
    );
}

#[test]
fn a_start_where_no_gradient_flows_is_noted() {
    let kerple = |init: &str| {
        parse_str(&format!(
            "heads = 2, head_dim = 8, mask = causal, params(r1: [heads]{init}, r2: [heads]), \
             score_mod = |s, b, h, q, k| s - r1[h] * (1.0 + r2[h] * (q - k).abs() as f32).ln()"
        ))
        .unwrap()
    };
    let note = stuck_at_start(&kerple("")).expect("both at 0: a saddle");
    assert!(note.contains("(r1, r2)"), "{note}");
    assert_eq!(
        stuck_at_start(&kerple(" = 1.0")),
        None,
        "r2 moves once r1 is 1"
    );
    assert_eq!(stuck_at_start(&kerple(" = normal(0.02)")), None);
    // A parameter added to the score moves from 0; so do sinks; no parameters, no note.
    let bias = parse_str(
        "heads = 2, head_dim = 8, params(w: [heads]), \
                          score_mod = |s, b, h, q, k| s + w[h] * (q - k) as f32",
    )
    .unwrap();
    assert_eq!(stuck_at_start(&bias), None);
    let sinks = parse_str("heads = 2, head_dim = 8, sinks = learned").unwrap();
    assert_eq!(stuck_at_start(&sinks), None);
    assert_eq!(
        stuck_at_start(&parse_str("heads = 2, head_dim = 8").unwrap()),
        None
    );
}
