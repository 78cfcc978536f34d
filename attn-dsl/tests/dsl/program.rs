//! The score program of a spec (built-ins lowered into the modifier IR, composed with custom
//! modifiers) against the reference's direct implementation of the semantics, before and after
//! folding.

use crate::support;

use attn_dsl::modifier::fold::fold;
use attn_dsl::modifier::scale::scale;
use attn_dsl::modifier::typecheck::typecheck;
use attn_dsl::modifier::{Env, ScoreProgram, Value, eval};
use attn_dsl::reference::{Pair, pair_score};
use proptest::prelude::*;

fn same(a: f64, b: f64) -> bool {
    same_up_to(a, b, 1e-12)
}

fn same_up_to(a: f64, b: f64, rel: f64) -> bool {
    (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= rel * a.abs().max(b.abs())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn program_equals_the_reference_pipeline(
        spec in support::spec(),
        dot in -50.0f64..50.0,
        b in 0usize..4,
        h_pick in 0usize..1024,
        p0 in -5i64..100_000,
        i in 0usize..300,
        j in 0usize..300,
        excess in 0i64..300,
    ) {
        prop_assume!(spec.validate().is_ok());
        let h = h_pick % spec.heads as usize;
        let pos_q = p0 + excess + i as i64;
        let pos_k = p0 + j as i64;
        let at = Pair { b, h, pos_q, pos_k, i, j };
        let env = Env {
            score: dot,
            b: b as i64,
            h: h as i64,
            q: pos_q,
            k: pos_k,
            qi: i as i64,
            ki: j as i64,
            ..Env::default()
        };
        let program = ScoreProgram::of(&spec);
        program.typecheck().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let folded = program.folded();
        folded.typecheck().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let want = pair_score(&spec, dot, at);
        for p in [&program, &folded] {
            let kept = eval(&p.mask, &env) == Value::B(true);
            prop_assert_eq!(kept, want.is_some(), "mask {}", p.mask);
            if let Some(want) = want {
                let got = eval(&p.score, &env).as_f64();
                prop_assert!(same(got, want), "score {}: {} vs {}", p.score, got, want);
            }
        }
    }

    #[test]
    fn folding_keeps_values_and_is_idempotent(
        e in support::expr(attn_dsl::modifier::Ty::F32, true, 4),
        score in -10.0f64..10.0,
        b in 0i64..3, h in 0i64..8, q in -100i64..100, k in -100i64..100,
    ) {
        let env = Env { score, b, h, q, k, ..Env::default() };
        let folded = fold(&e);
        prop_assert!(same(eval(&e, &env).as_f64(), eval(&folded, &env).as_f64()), "{} -> {}", e, folded);
        // Compared as text: a folded NaN constant is not == to itself.
        prop_assert_eq!(fold(&folded).to_string(), folded.to_string());
    }

    #[test]
    fn scaling_multiplies_the_value(
        e in support::expr(attn_dsl::modifier::Ty::F32, true, 4),
        c in prop_oneof![Just(std::f64::consts::LOG2_E), 1e-3f64..1e3],
        score in -10.0f64..10.0,
        b in 0i64..3, h in 0i64..8, q in -100i64..100, k in -100i64..100,
    ) {
        let env = Env { score, b, h, q, k, ..Env::default() };
        let scaled = scale(&e, c);
        let ty = typecheck(&scaled).map_err(|err| TestCaseError::fail(format!("{scaled}: {err}")))?;
        prop_assert_eq!(ty, attn_dsl::modifier::Ty::F32);
        let (got, want) = (eval(&scaled, &env).as_f64(), eval(&e, &env).as_f64() * c);
        prop_assert!(same_up_to(got, want, 1e-9), "{} x {} -> {}: {} vs {}", e, c, scaled, got, want);
    }
}

#[test]
fn builtins_print_as_ir() {
    let spec = "heads = 4, head_dim = 64, mask = sliding_window(128), position = alibi, \
                softcap = 30.0, score_mod = |s, b, h, q, k| s - 0.5, mask_mod = |b, h, q, k| \
                h != 3"
        .parse()
        .unwrap();
    let p = ScoreProgram::of(&spec).folded();
    assert_eq!(
        p.to_string(),
        "score = 30.0 * (score * 0.125 / 30.0).tanh() + [0.25, 0.0625, 0.015625, \
         0.00390625][h] * (k - q) as f32 - 0.5\n\
         mask = k <= q && q - k < 128 && h != 3"
    );
}
