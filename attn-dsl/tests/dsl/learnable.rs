//! `params(...)`, reads `NAME[i, ..]` and `sinks = learned`: what parses, how it prints, and
//! where each error points.

use crate::support::rejects;
use attn_dsl::modifier::{Env, ParamValues, ScoreProgram, eval};
use attn_dsl::{ParamDim, Sinks, parse_str};

const REL: &str = "heads = 4, head_dim = 16, mask = causal, params(rel: [heads, 32]), \
                   score_mod = |s, b, h, q, k| s + rel[h, max(min(q - k, 31), 0)]";

fn ok(text: &str) -> attn_dsl::AttentionSpec {
    parse_str(text).unwrap_or_else(|e| panic!("`{text}` should parse:\n{}", e.render(text)))
}

#[test]
fn declarations_reads_and_sinks_parse_and_print_back() {
    let spec = ok(REL);
    assert_eq!(spec.params.len(), 1);
    assert_eq!(spec.params[0].name, "rel");
    assert_eq!(
        spec.params[0].dims,
        vec![ParamDim::Heads, ParamDim::Fixed(32)]
    );
    assert_eq!(spec.param_shape(&spec.params[0]), vec![4, 32]);
    assert_eq!(spec.sinks, Sinks::None);
    let printed = spec.to_string();
    assert!(printed.contains("params(rel: [heads, 32])"), "{printed}");
    assert!(
        printed.contains("rel[h, (q - k).min(31).max(0)]"),
        "{printed}"
    );
    assert_eq!(ok(&printed), spec);

    let text = "heads = 8, kv_heads = 2, head_dim = 16, sinks = learned, \
                params(slopes: [heads], t: [kv_heads, 2]), \
                score_mod = |s, b, h, q, k| s * t[h / 4, 1] + slopes[h] * (k - q) as f32";
    let spec = ok(text);
    assert_eq!(spec.sinks, Sinks::Learned);
    assert_eq!(
        spec.learnable_tensors(),
        vec![
            ("slopes".to_string(), vec![8]),
            ("t".to_string(), vec![2, 2]),
            ("sinks".to_string(), vec![8]),
        ]
    );
    assert_eq!(ok(&spec.to_string()), spec);
    // Item order does not matter: reads may come before the declaration.
    let reordered = "heads = 4, head_dim = 16, score_mod = |s, b, h, q, k| s * temp[h], \
                     params(temp: [heads])";
    assert_eq!(ok(reordered).params[0].name, "temp");
}

#[test]
fn reads_evaluate_the_element_they_name() {
    let spec = ok(REL);
    let program = ScoreProgram::of(&spec);
    let rel = ParamValues {
        name: "rel".into(),
        shape: vec![4, 32],
        values: (0..128).map(|i| i as f64).collect(),
    };
    let params = [rel];
    for (h, q, k, want_index) in [(0, 5, 5, 0), (1, 9, 2, 32 + 7), (3, 100, 0, 3 * 32 + 31)] {
        let env = Env {
            score: 0.0,
            h,
            q,
            k,
            params: &params,
            ..Env::default()
        };
        let got = eval(&program.score, &env).as_f64();
        assert_eq!(got, want_index as f64, "h={h} q={q} k={k}");
    }
}

#[test]
fn the_parameter_derivative_is_the_read_s_coefficient() {
    let spec = ok(
        "heads = 2, head_dim = 16, scale = 1.0, params(temp: [heads]), \
                   score_mod = |s, b, h, q, k| s * temp[h] + temp[h]",
    );
    let program = ScoreProgram::of(&spec);
    let grads = program.param_gradients().unwrap();
    assert_eq!(grads.len(), 1);
    // d(s * t + t)/dt = s + 1, checked at two scores.
    for score in [0.5, -3.0] {
        let env = Env {
            score,
            ..Env::default()
        };
        assert_eq!(eval(&grads[0].1, &env).as_f64(), score + 1.0);
    }
}

#[test]
fn each_bad_declaration_is_a_spanned_error() {
    let base = "heads = 4, head_dim = 16, ";
    rejects(
        &format!("{base}params(a: [4], a: [2]), score_mod = |s, b, h, q, k| s + a[0]"),
        "parameter `a` is declared twice",
        "[4], ",
        "a: [2]",
    );
    rejects(
        &format!("{base}params(a: [0]), score_mod = |s, b, h, q, k| s"),
        "has a dimension of 0",
        "params(",
        "a: [0]",
    );
    rejects(
        &format!("{base}params(big: [4096, 8192]), score_mod = |s, b, h, q, k| s"),
        "allowed: at most 16777216",
        "params(",
        "big",
    );
    rejects(
        &format!("{base}params(a: [2]), params(b2: [2]), score_mod = |s, b, h, q, k| s"),
        "params(...) appears twice",
        "[2]), ",
        "params",
    );
    rejects(
        &format!("{base}params(q: [2]), score_mod = |s, b, h, x, k| s"),
        "`q` is reserved",
        "params(",
        "q",
    );
    rejects(
        &format!("{base}params(w: [heads]), score_mod = |s, b, w, q, k| s"),
        "`w` is both a closure parameter and a tensor declared in params(...) or data(...)",
        "|s, b, ",
        "w",
    );
    rejects(
        &format!("{base}params(a: [2, nope]), score_mod = |s, b, h, q, k| s"),
        "not a dimension",
        "[2, ",
        "nope",
    );
    rejects(
        &format!("{base}sinks = learned, sinks = none"),
        "duplicate key `sinks`",
        "learned, ",
        "sinks",
    );
}

#[test]
fn each_bad_read_is_a_spanned_error() {
    let base = "heads = 4, head_dim = 16, params(rel: [heads, 32]), ";
    rejects(
        &format!("{base}score_mod = |s, b, h, q, k| s + other[h]"),
        "unknown tensor `other`; declared: rel",
        "s + ",
        "other",
    );
    rejects(
        &format!("{base}score_mod = |s, b, h, q, k| s + rel[h]"),
        "`rel` has 2 dimensions, this reads it with 1 index",
        "rel[",
        "h",
    );
    rejects(
        &format!("{base}score_mod = |s, b, h, q, k| s + rel[h, q - k]"),
        "index 1 of `rel` (`q - k`) may be anywhere in [-4294967294, 4294967294]; allowed: 0 \
         to 31",
        "s + ",
        "rel[h, q - k]",
    );
    rejects(
        &format!("{base}score_mod = |s, b, h, q, k| s + rel[h + 1, 0]"),
        "index 0 of `rel` (`h + 1`) may be anywhere in [1, 4]; allowed: 0 to 3",
        "s + ",
        "rel",
    );
    rejects(
        &format!("{base}score_mod = |s, b, h, q, k| s + rel[h, s as i64]"),
        "may use only b, h, q, k and constants",
        "rel[h, ",
        "s as i64",
    );
    rejects(
        &format!("{base}mask_mod = |b, h, q, k| rel[h, 0] > 0.0"),
        "mask_mod reads a parameter; masks are not differentiable",
        "mask_mod = ",
        "|b",
    );
}
