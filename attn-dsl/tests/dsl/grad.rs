//! The derivative pass, checked against central finite differences of the program it
//! differentiates, and its notes on smoothness.

use attn_dsl::modifier::grad::GradNoteKind;
use attn_dsl::modifier::{Env, ScoreProgram, eval};
use attn_dsl::parse_str;
use proptest::prelude::*;

/// Specs whose score programs cover every rule: built-ins, and closures with each operation.
const SPECS: &[&str] = &[
    "heads = 4, head_dim = 64",
    "heads = 4, head_dim = 64, softcap = 20.0",
    "heads = 4, head_dim = 64, position = alibi, softcap = 5.0",
    "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| s * s / (1.0 + s.abs())",
    "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| (s * 0.5).tanh() * 3.0 + (s / 4.0).exp()",
    "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| (s * s + 1.0).sqrt() - (s * s + 2.0).ln()",
    "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| s.min(1.5) + s.max(-0.5) * (h as f32)",
    "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| if s > 0.25 { s * 2.0 } else { -s / (k - q + 10) as f32 }",
    "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| s - 0.5 * (q - k).abs() as f32",
    "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| 2.0 / (s * s + 1.0) + s % 0.75",
];

fn env(score: f64, h: i64, q: i64, k: i64) -> Env<'static> {
    Env {
        score,
        h,
        q,
        k,
        qi: q,
        ki: k,
        ..Env::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_derivative_matches_finite_differences(
        which in 0..SPECS.len(),
        score in -4.0f64..4.0,
        h in 0i64..4,
        q in 0i64..64,
        k in 0i64..64,
    ) {
        let spec = parse_str(SPECS[which]).unwrap();
        let program = ScoreProgram::of(&spec);
        let gradient = program.score_gradient().unwrap();
        let f = |s: f64| eval(&program.score, &env(s, h, q, k)).as_f64();
        let step = 1e-6;
        // Points next to a kink of a piecewise program give meaningless differences.
        let (left, right) = (
            eval(&gradient.expr, &env(score - 2.0 * step, h, q, k)).as_f64(),
            eval(&gradient.expr, &env(score + 2.0 * step, h, q, k)).as_f64(),
        );
        prop_assume!((left - right).abs() < 1e-3 * (1.0 + left.abs()));
        let numeric = (f(score + step) - f(score - step)) / (2.0 * step);
        let analytic = eval(&gradient.expr, &env(score, h, q, k)).as_f64();
        prop_assert!(
            (numeric - analytic).abs() <= 1e-5 * (1.0 + analytic.abs()),
            "{}: at {score}: finite difference {numeric}, derivative {analytic} ({})",
            SPECS[which], gradient.expr
        );
    }
}

#[test]
fn the_softcap_chain_is_scale_times_one_minus_tanh_squared() {
    let spec = parse_str("heads = 4, head_dim = 64, softcap = 30.0, scale = 0.125").unwrap();
    let gradient = ScoreProgram::of(&spec).score_gradient().unwrap();
    assert!(gradient.notes.is_empty(), "{:?}", gradient.notes);
    for s in [-300.0, -7.0, 0.0, 0.3, 55.0] {
        let t = (0.125 * s / 30.0_f64).tanh();
        let want = 0.125 * (1.0 - t * t);
        let got = eval(&gradient.expr, &env(s, 0, 0, 0)).as_f64();
        assert!((got - want).abs() < 1e-15, "at {s}: {got} vs {want}");
    }
}

#[test]
fn alibi_and_additive_biases_leave_the_scale() {
    for text in [
        "heads = 8, head_dim = 64, position = alibi",
        "heads = 8, head_dim = 64, score_mod = |s, b, h, q, k| s + 0.25 * (k - q) as f32",
    ] {
        let gradient = ScoreProgram::of(&parse_str(text).unwrap())
            .score_gradient()
            .unwrap();
        assert_eq!(gradient.expr.to_string(), "0.125", "{text}");
        assert!(gradient.notes.is_empty());
    }
}

#[test]
fn kinks_and_rounding_are_noted() {
    let piecewise = "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| s.abs().min(3.0)";
    let notes = ScoreProgram::of(&parse_str(piecewise).unwrap())
        .score_gradient()
        .unwrap()
        .notes;
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(notes.iter().all(|n| n.kind == GradNoteKind::Piecewise));

    let rounded = "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| (s as i64) as f32";
    let gradient = ScoreProgram::of(&parse_str(rounded).unwrap())
        .score_gradient()
        .unwrap();
    assert_eq!(gradient.expr.to_string(), "0.0");
    assert_eq!(gradient.notes.len(), 1);
    assert_eq!(gradient.notes[0].kind, GradNoteKind::Discrete);
    assert!(gradient.notes[0].to_string().contains("no gradient flows"));
}

#[test]
fn selects_on_positions_only_are_smooth() {
    let text =
        "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| if h == 0 { s * 2.0 } else { s }";
    let gradient = ScoreProgram::of(&parse_str(text).unwrap())
        .score_gradient()
        .unwrap();
    assert!(gradient.notes.is_empty(), "{:?}", gradient.notes);
    let at = |h| eval(&gradient.expr, &env(1.0, h, 0, 0)).as_f64();
    assert_eq!((at(0), at(1)), (0.25, 0.125));
}

#[test]
fn notes_point_at_the_tokens_of_a_score_mod() {
    use attn_dsl::{Location, gradient_notes};
    let source = "heads = 4, head_dim = 64,\nscore_mod = |s, b, h, q, k| s.abs() - 0.5 * \
                  (q - k).abs() as f32 + if s > 1.0 { s } else { (s * 2.0) as i64 as f32 }";
    let notes = gradient_notes(source);
    let at = |line, column| Location { line, column };
    let found: Vec<(&str, Location, Location)> = notes
        .iter()
        .map(|n| (n.message.as_str(), n.start, n.end))
        .collect();
    // `s.abs()` (line 2, columns 29..36), the condition `s > 1.0` (from 71), and the rounding
    // (from 90); the
    // distance term has no score in it and no note.
    assert_eq!(found.len(), 3, "{found:?}");
    assert!(
        found[0]
            .0
            .contains("`score.abs()`: the derivative is piecewise")
    );
    assert_eq!((found[0].1, found[0].2), (at(2, 29), at(2, 36)));
    assert!(
        found
            .iter()
            .any(|(m, start, _)| m.contains("piecewise") && *start == at(2, 71))
    );
    assert!(
        found
            .iter()
            .any(|(m, start, _)| m.contains("rounded to an integer") && *start == at(2, 90)),
        "{found:?}"
    );
    // Rendered like an error, under its own label.
    let shown = notes[0].render_as("note", source);
    assert!(
        shown.starts_with("note: backward: `score.abs()`"),
        "{shown}"
    );
    assert!(shown.contains("^^^^^^^"), "{shown}");
    // Nothing to say of smooth or missing modifiers, or of text that does not parse.
    for quiet in [
        "heads = 4, head_dim = 64, softcap = 30.0",
        "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| (s * 0.5).tanh()",
        "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| s.abs(",
    ] {
        assert!(gradient_notes(quiet).is_empty(), "{quiet}");
    }
}
