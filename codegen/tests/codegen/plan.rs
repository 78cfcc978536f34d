//! Kernel plans of the named specs (insta snapshots) and the tile maps they imply.

use attn_dsl::AttentionSpec;
use attn_dsl::catalog::{NAMED_SPECS, named};
use attn_dsl::modifier::interval::TileClass;
use codegen::plan::{Frequencies, KernelPlan, TileMasking};

fn plan(name: &str) -> KernelPlan {
    let spec: AttentionSpec = named(name).unwrap().parse().unwrap();
    KernelPlan::forward(&spec)
}

#[test]
fn named_specs_plan_as_recorded() {
    for (name, text) in NAMED_SPECS {
        let spec: AttentionSpec = text.parse().unwrap();
        let plan = KernelPlan::forward(&spec);
        let map = plan.tile_map(256, 256, 0);
        insta::with_settings!({ omit_expression => true }, {
            insta::assert_snapshot!(*name, format!("{plan}\n\ntiles at Sq = Skv = 256:\n{map}"));
        });
    }
}

/// The class causal masking gives the tile of query rows `q0..=q1` and keys `k0..=k1`
/// (Sq == Skv, so positions equal indices).
fn causal_class(q0: u64, q1: u64, k0: u64, k1: u64) -> TileClass {
    if k1 <= q0 {
        TileClass::AllKept
    } else if k0 > q1 {
        TileClass::AllMasked
    } else {
        TileClass::Mixed
    }
}

#[test]
fn causal_tiles_are_mixed_exactly_on_the_diagonal() {
    let p = plan("mha_causal");
    let (rows, cols) = (u64::from(p.tiles.q_rows), u64::from(p.tiles.k_cols));
    for n in [1024u64, 1000, 65] {
        let map = p.tile_map(n, n, 0);
        assert_eq!(map.classes.len() as u64, n.div_ceil(rows));
        for (r, row) in map.classes.iter().enumerate() {
            assert_eq!(row.len() as u64, n.div_ceil(cols));
            for (c, class) in row.iter().enumerate() {
                let (q0, k0) = (r as u64 * rows, c as u64 * cols);
                let want = causal_class(q0, (q0 + rows).min(n) - 1, k0, (k0 + cols).min(n) - 1);
                assert_eq!(*class, want, "N {n}, tile ({r}, {c})");
            }
        }
    }
}

#[test]
fn an_unmasked_spec_classifies_nothing() {
    let p = plan("mqa_unmasked_f16");
    assert_eq!(p.masking, TileMasking::Unmasked);
    let map = p.tile_map(100, 300, 0);
    assert_eq!(map.count(TileClass::AllKept), map.classes.len() * 5);
    assert_eq!(
        map.count(TileClass::Mixed) + map.count(TileClass::AllMasked),
        0
    );
}

#[test]
fn mla_plans_one_shared_latent_head() {
    let p = plan("deepseek_v3_mla");
    assert_eq!(
        (p.shape.kv_heads, p.shape.qk_dim, p.shape.v_dim),
        (1, 576, 512)
    );
    assert_eq!(p.shape.group(), 128);
    let rope = p.rope.as_ref().unwrap();
    assert_eq!((rope.first_dim, rope.rope.dim), (512, 64));
    // mscale == mscale_all_dim: the attention factor is 1.
    assert_eq!(rope.attention_factor, 1.0);
}

#[test]
fn dynamic_ntk_frequencies_are_left_to_the_launch() {
    assert_eq!(
        plan("rope_dynamic_ntk").rope.unwrap().frequencies,
        Frequencies::PerLaunch
    );
    match plan("llama3_8b").rope.unwrap().frequencies {
        Frequencies::Static(f) => assert_eq!(f.len(), 64),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_per_head_mask_reads_the_head() {
    match plan("custom_local_global").masking {
        TileMasking::Classified { reads } => {
            let names: Vec<&str> = reads.iter().map(|v| v.canonical_name()).collect();
            assert_eq!(names, ["h", "q", "k"]);
        }
        other => panic!("{other:?}"),
    }
}

/// `live_rows` against the rows that keep a key, written out for causal and sliding-window
/// masks (Sq == Skv): every live row inside, at most a row group of dead rows at either end.
#[test]
fn live_rows_trim_rows_that_see_no_key_of_the_tile() {
    use attn_dsl::modifier::interval::Interval;
    use codegen::plan::ROW_GROUP;
    let n = 512i64;
    let (call, plans) = causal_and_window(n, 100);
    for (text, p, keeps) in plans {
        let mut narrowed = 0;
        for (q0, q1) in [(0i64, 127i64), (128, 255), (100, 227), (384, 511)] {
            for k0 in (0..n).step_by(64) {
                let (rows, keys) = (Interval::new(q0, q1), Interval::new(k0, k0 + 63));
                if p.classify_tile(rows, keys, call) != TileClass::Mixed {
                    continue;
                }
                let live: Vec<i64> = (q0..=q1)
                    .filter(|&q| (k0..k0 + 64).any(|k| keeps(q, k)))
                    .collect();
                let got = p.live_rows(rows, keys, call);
                let (Some(first), Some(last)) = (live.first(), live.last()) else {
                    assert_eq!(got, None, "{text}: rows {q0}..={q1}, keys from {k0}");
                    continue;
                };
                let got = got.expect("live rows exist");
                assert!(
                    got.lo <= *first && got.hi >= *last,
                    "{text}: {got:?} misses rows"
                );
                let slack = i64::from(ROW_GROUP);
                assert!(
                    *first - got.lo < slack && got.hi - *last < slack,
                    "{text}: {got:?}"
                );
                narrowed += usize::from(got.lo > q0 || got.hi < q1);
            }
        }
        assert!(narrowed > 0, "{text}: no tile was narrowed");
    }
}

/// Plans keep scores in half base-2 units at no cost: for every named spec the planned program
/// is no deeper than the spec's folded one (the factor vanishes into q's scale, constants and
/// tables), and, fed the score q's scale makes, it gives the spec's score times log2(e) / 2.
#[test]
fn plans_score_in_half_base_2_units_at_no_cost() {
    use attn_dsl::modifier::{Env, ScoreProgram, eval};
    for (name, text) in NAMED_SPECS {
        let spec: AttentionSpec = text.parse().unwrap();
        let plan = KernelPlan::forward(&spec);
        let base = ScoreProgram::of(&spec).folded();
        assert!(
            plan.program.score.depth() <= base.score.depth(),
            "{name}: {} is deeper than {}",
            plan.program.score,
            base.score
        );
        for (h, q, k, dot) in [(0, 10, 3, 1.5), (1, 100, 99, -0.25), (3, 7, 7, 4.0)] {
            let at = |score: f64| Env {
                score,
                h,
                q,
                k,
                ..Env::default()
            };
            let want = eval(&base.score, &at(dot)).as_f64() * std::f64::consts::LOG2_E / 2.0;
            let got = eval(&plan.program.score, &at(dot * plan.q_scale)).as_f64();
            assert!(
                (got - want).abs() <= 1e-12 * want.abs().max(1.0),
                "{name}: {got} != {want}"
            );
        }
    }
}

#[test]
fn named_specs_plan_their_backward_as_recorded() {
    for (name, text) in NAMED_SPECS {
        let spec: AttentionSpec = text.parse().unwrap();
        if spec.mla().is_some() {
            continue;
        }
        let plan = KernelPlan::backward(&spec).unwrap();
        insta::with_settings!({ omit_expression => true }, {
            insta::assert_snapshot!(format!("backward_{name}"), plan.to_string());
        });
    }
}

#[test]
fn a_backward_plan_carries_the_scaled_derivative() {
    // No modifiers: the score is the raw dot with q scaled, so d score / d raw is 2 ln 2 in the
    // plan's units (half base 2 after the hoisted scale).
    let spec: AttentionSpec = "heads = 4, head_dim = 64, mask = causal".parse().unwrap();
    let plan = KernelPlan::backward(&spec).unwrap();
    assert_eq!(plan.kind, codegen::plan::PlanKind::Backward);
    let want = 2.0 * std::f64::consts::LN_2;
    match plan.score_grad {
        Some(attn_dsl::modifier::Expr::Float(g)) => assert!((g - want).abs() < 1e-15, "{g}"),
        other => panic!("{other:?}"),
    }
    assert!(KernelPlan::forward(&spec).score_grad.is_none());
    assert!(u64::from(plan.tiles.q_rows) <= u64::from(plan.tiles.k_cols));
}

/// `kept_from` against the rows that keep every key of the tile, written out for causal and
/// sliding-window masks: none of the rows from it on drops a key, and it lies within a row group
/// of the first row from which they all keep every key.
#[test]
fn kept_from_marks_the_rows_that_keep_every_key() {
    use attn_dsl::modifier::interval::Interval;
    use codegen::plan::ROW_GROUP;
    let n = 1024i64;
    let (call, plans) = causal_and_window(n, 300);
    for (text, p, keeps) in plans {
        let mut unmasked = 0;
        for q0 in (0..n).step_by(256) {
            for k0 in (0..n).step_by(64) {
                let (rows, keys) = (Interval::new(q0, q0 + 255), Interval::new(k0, k0 + 63));
                if p.classify_tile(rows, keys, call) != TileClass::Mixed {
                    continue;
                }
                let Some(live) = p.live_rows(rows, keys, call) else {
                    continue;
                };
                let from = p.kept_from(live, keys, call);
                let all_kept = |q: i64| (k0..k0 + 64).all(|k| keeps(q, k));
                assert!(
                    (from..=live.hi).all(all_kept),
                    "{text}: rows {from}..={} of keys {k0}.. drop a key",
                    live.hi
                );
                // The rows from the first that starts an all-kept run to the end.
                let first = (live.lo..=live.hi + 1)
                    .find(|&r| (r..=live.hi).all(all_kept))
                    .unwrap();
                assert!(
                    from - first < i64::from(ROW_GROUP)
                        && (from - live.lo) % i64::from(ROW_GROUP) == 0,
                    "{text}: rows {q0}.., keys {k0}..: kept from {from}, first {first}"
                );
                unmasked += usize::from(from <= live.hi);
            }
        }
        assert!(
            unmasked > 0,
            "{text}: no mixed tile had rows that keep every key"
        );
    }
}

/// A call of `n` queries against `n` keys, and the causal and sliding-window plans with who keeps
/// whom, written out.
type Keeps = Box<dyn Fn(i64, i64) -> bool>;
fn causal_and_window(
    n: i64,
    width: i64,
) -> (
    codegen::plan::CallShape<'static>,
    Vec<(String, KernelPlan, Keeps)>,
) {
    use attn_dsl::modifier::interval::Interval;
    let call = codegen::plan::CallShape {
        sq: n,
        skv: n,
        p0: 0,
        query_shift: 0,
        batch: Interval::point(0),
        head: Interval::point(0),
        data: None,
    };
    let plans = [
        ("heads = 2, head_dim = 32, mask = causal".to_string(), None),
        (
            format!("heads = 2, head_dim = 32, mask = sliding_window({width})"),
            Some(width),
        ),
    ]
    .into_iter()
    .map(|(text, window)| {
        let p = KernelPlan::forward(&text.parse::<AttentionSpec>().unwrap());
        let keeps: Keeps =
            Box::new(move |q: i64, k: i64| k <= q && window.is_none_or(|w| q - k < w));
        (text, p, keeps)
    })
    .collect();
    (call, plans)
}
