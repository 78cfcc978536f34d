//! Tile classification by interval analysis: exact on the built-in masks and block-diagonal
//! masks at aligned tiles, and never wrong (all-kept / all-masked only when every element agrees)
//! for any mask.

use crate::support;

use attn_dsl::AttentionSpec;
use attn_dsl::modifier::interval::{Interval, TileBounds, TileClass, classify};
use attn_dsl::modifier::{Env, Expr, ScoreProgram, Ty, Value, eval};
use proptest::prelude::*;

fn mask_of(spec: &str) -> Expr {
    let spec: AttentionSpec = spec.parse().unwrap();
    ScoreProgram::of(&spec).folded().mask
}

/// Every element of the tile, for one batch and head.
fn elements(bounds: &TileBounds) -> impl Iterator<Item = Env<'static>> + '_ {
    let shift = bounds.query.lo - bounds.query_index.lo;
    let kshift = bounds.key.lo - bounds.key_index.lo;
    let rows = bounds.query_index.lo..=bounds.query_index.hi;
    rows.flat_map(move |qi| {
        (bounds.key_index.lo..=bounds.key_index.hi).flat_map(move |ki| {
            (bounds.batch.lo..=bounds.batch.hi).flat_map(move |b| {
                (bounds.head.lo..=bounds.head.hi).map(move |h| Env {
                    score: 0.0,
                    b,
                    h,
                    q: qi + shift,
                    k: ki + kshift,
                    qi,
                    ki,
                    params: &[],
                })
            })
        })
    })
}

/// The classification by evaluating the mask at every element.
fn brute_force(mask: &Expr, bounds: &TileBounds) -> TileClass {
    let (mut kept, mut masked) = (false, false);
    for env in elements(bounds) {
        match eval(mask, &env) {
            Value::B(true) => kept = true,
            _ => masked = true,
        }
    }
    match (kept, masked) {
        (true, false) => TileClass::AllKept,
        (false, true) => TileClass::AllMasked,
        _ => TileClass::Mixed,
    }
}

fn tile(row: i64, col: i64, size: i64, n: i64) -> TileBounds {
    let mut b = TileBounds::for_tile(
        Interval::new(row * size, row * size + size - 1),
        Interval::new(col * size, col * size + size - 1),
        n,
        n,
        0,
    );
    b.batch = Interval::point(0);
    b.head = Interval::point(0);
    b
}

#[test]
fn causal_marks_exactly_the_diagonal_tiles_mixed() {
    let mask = mask_of("heads = 1, head_dim = 8, mask = causal");
    for row in 0..16 {
        for col in 0..16 {
            let want = match col.cmp(&row) {
                std::cmp::Ordering::Less => TileClass::AllKept,
                std::cmp::Ordering::Equal => TileClass::Mixed,
                std::cmp::Ordering::Greater => TileClass::AllMasked,
            };
            assert_eq!(
                classify(&mask, &tile(row, col, 64, 1024)),
                want,
                "tile ({row}, {col})"
            );
        }
    }
}

#[test]
fn sliding_window_and_block_diagonal_are_classified_exactly() {
    // Mixed tiles: the diagonal, plus the tiles the window edge crosses (W = 256: offsets 4;
    // W = 100: offsets 1 and 2); block-diagonal tiles are whole; `%` tiles are all mixed.
    for (spec, mixed) in [
        ("heads = 1, head_dim = 8, mask = sliding_window(256)", 28),
        ("heads = 1, head_dim = 8, mask = sliding_window(100)", 45),
        ("heads = 1, head_dim = 8, mask = causal(top_left)", 16),
        (
            "heads = 1, head_dim = 8, mask_mod = |b, h, q, k| (q / 64) == (k / 64)",
            0,
        ),
        (
            "heads = 1, head_dim = 8, mask_mod = |b, h, q, k| q % 64 >= k % 64",
            256,
        ),
    ] {
        let mask = mask_of(spec);
        let mut count = 0;
        for row in 0..16 {
            for col in 0..16 {
                let bounds = tile(row, col, 64, 1024);
                let got = classify(&mask, &bounds);
                assert_eq!(
                    got,
                    brute_force(&mask, &bounds),
                    "{spec}: tile ({row}, {col})"
                );
                count += usize::from(got == TileClass::Mixed);
            }
        }
        assert_eq!(count, mixed, "{spec}: mixed tiles");
    }
}

#[test]
fn chunked_prefill_shifts_the_causal_diagonal() {
    // 64 queries against 1024 keys: the queries are positions 960..1023.
    let mask = mask_of("heads = 1, head_dim = 8, mask = causal");
    let classes: Vec<TileClass> = (0..16)
        .map(|col| {
            let bounds = TileBounds::for_tile(
                Interval::new(0, 63),
                Interval::new(col * 64, col * 64 + 63),
                64,
                1024,
                0,
            );
            classify(&mask, &bounds)
        })
        .collect();
    assert!(classes[..15].iter().all(|c| *c == TileClass::AllKept));
    assert_eq!(classes[15], TileClass::Mixed);
}

fn any_mask() -> impl Strategy<Value = Expr> {
    prop_oneof![
        support::spec().prop_map(|s| ScoreProgram::of(&s).mask),
        support::expr(Ty::Bool, false, 3),
        (support::spec(), support::expr(Ty::Bool, false, 3)).prop_map(|(s, e)| {
            let m = ScoreProgram::of(&s).mask;
            Expr::binary(attn_dsl::modifier::BinOp::And, m, e)
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn classification_never_contradicts_an_element(
        mask in any_mask(),
        q0 in 0i64..200, rows in 1i64..12,
        k0 in 0i64..200, cols in 1i64..12,
        sq_extra in 0i64..50, skv_extra in 0i64..50,
        p0 in -20i64..2000,
        b0 in 0i64..3, h0 in 0i64..16, bh in 0i64..2,
    ) {
        let sq = q0 + rows + sq_extra;
        let skv = k0 + cols + skv_extra;
        let mut bounds = TileBounds::for_tile(
            Interval::new(q0, q0 + rows - 1),
            Interval::new(k0, k0 + cols - 1),
            sq,
            skv,
            p0,
        );
        bounds.batch = Interval::new(b0, b0 + bh);
        bounds.head = Interval::new(h0, h0 + bh);
        let got = classify(&mask, &bounds);
        let truth = brute_force(&mask, &bounds);
        if got != TileClass::Mixed {
            prop_assert_eq!(got, truth, "mask {}", mask);
        }
    }
}

fn contains(range: attn_dsl::modifier::interval::Range, v: Value) -> bool {
    use attn_dsl::modifier::interval::{Range, Truth};
    match (range, v) {
        (Range::Int(i), Value::I(x)) => i.lo <= x && x <= i.hi,
        (Range::Float { lo, hi, nan }, Value::F(x)) => (x.is_nan() && nan) || (lo <= x && x <= hi),
        (Range::Bool(t), Value::B(b)) => t == Truth::Unknown || (t == Truth::Always) == b,
        _ => false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn every_value_lies_in_its_range(
        ty in prop_oneof![Just(Ty::I64), Just(Ty::F32), Just(Ty::Bool)],
        seed in any::<u64>(),
        q0 in -300i64..300, rows in 1i64..6,
        k0 in -300i64..300, cols in 1i64..6,
    ) {
        use proptest::strategy::ValueTree;
        use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
        let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[seed as u8; 32]);
        let mut runner = TestRunner::new_with_rng(Config::default(), rng);
        let expr = support::expr(ty, false, 4).new_tree(&mut runner).unwrap().current();
        let mut bounds = TileBounds::for_tile(
            Interval::new(q0, q0 + rows - 1),
            Interval::new(k0, k0 + cols - 1),
            0,
            0,
            0,
        );
        bounds.batch = Interval::new(0, 1);
        bounds.head = Interval::new(0, 2);
        let range = attn_dsl::modifier::interval::analyze(&expr, &bounds);
        for env in elements(&bounds) {
            let v = eval(&expr, &env);
            prop_assert!(contains(range, v), "{} = {:?} outside {:?}", expr, v, range);
        }
    }
}
