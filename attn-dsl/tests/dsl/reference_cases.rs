//! The reference on small cases computed by hand, one semantic rule at a time.

use attn_dsl::AttentionSpec;
use attn_dsl::inputs::values_f64;
use attn_dsl::reference::{self, Array, Inputs, MlaInputs};

fn spec(text: &str) -> AttentionSpec {
    text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn arr(shape: &[usize], data: &[f64]) -> Array {
    Array::from_vec(shape, data.to_vec()).expect("shape matches data")
}

fn run(spec: &AttentionSpec, q: &Array, k: &Array, v: &Array, offset: i64) -> reference::Output {
    reference::attention(
        spec,
        &Inputs {
            q,
            k,
            v,
            position_offset: offset,
        },
    )
    .unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn one_key_gives_its_value_and_its_score() {
    let s = spec("heads = 1, head_dim = 2");
    let o = run(
        &s,
        &arr(&[1, 1, 1, 2], &[1.0, 0.0]),
        &arr(&[1, 1, 1, 2], &[2.0, 0.0]),
        &arr(&[1, 1, 1, 2], &[3.0, 4.0]),
        0,
    );
    assert_eq!(o.out.data(), &[3.0, 4.0]);
    // s = <q,k> / sqrt(2) = 2 / sqrt(2).
    assert!(close(o.lse.data()[0], 2f64.sqrt()));
}

#[test]
fn two_keys_weight_values_by_softmax() {
    // scores 0 and ln 3: weights 1/4 and 3/4.
    let s = spec("heads = 1, head_dim = 1, scale = 1.0");
    let o = run(
        &s,
        &arr(&[1, 1, 1, 1], &[1.0]),
        &arr(&[1, 1, 2, 1], &[0.0, 3f64.ln()]),
        &arr(&[1, 1, 2, 1], &[4.0, 8.0]),
        0,
    );
    assert!(close(o.out.data()[0], 7.0));
    assert!(close(o.lse.data()[0], 4f64.ln()));
}

/// q = 0 makes every score 0, so `out` is the mean of the kept values and `lse = ln(kept)`.
fn uniform(text: &str, sq: usize, skv: usize) -> reference::Output {
    let s = spec(text);
    let q = Array::zeros(&[1, 1, sq, 1]);
    let k = Array::zeros(&[1, 1, skv, 1]);
    let v = Array::from_fn(&[1, 1, skv, 1], |ix| (1usize << ix[2]) as f64);
    run(&s, &q, &k, &v, 0)
}

#[test]
fn causal_is_bottom_right_aligned() {
    // 2 queries against 4 keys: the queries are positions 2 and 3.
    let o = uniform("heads = 1, head_dim = 1, mask = causal", 2, 4);
    assert!(close(o.out.data()[0], (1.0 + 2.0 + 4.0) / 3.0));
    assert!(close(o.out.data()[1], (1.0 + 2.0 + 4.0 + 8.0) / 4.0));
    assert!(close(o.lse.data()[0], 3f64.ln()));
}

#[test]
fn top_left_causal_aligns_query_i_with_key_i() {
    let o = uniform("heads = 1, head_dim = 1, mask = causal(top_left)", 2, 4);
    assert!(close(o.out.data()[0], 1.0));
    assert!(close(o.out.data()[1], 1.5));
}

#[test]
fn sliding_window_keeps_the_last_w_keys_including_its_own() {
    let o = uniform("heads = 1, head_dim = 1, mask = sliding_window(2)", 3, 3);
    assert!(close(o.out.data()[0], 1.0));
    assert!(close(o.out.data()[1], 1.5));
    assert!(close(o.out.data()[2], 3.0));
    assert!(close(o.lse.data()[2], 2f64.ln()));
}

#[test]
fn fully_masked_rows_give_zero_and_minus_infinity() {
    // 3 queries against 1 key: query positions -2, -1, 0; only the last sees key 0.
    let o = uniform("heads = 1, head_dim = 1, mask = causal", 3, 1);
    assert_eq!(o.out.data(), &[0.0, 0.0, 1.0]);
    assert_eq!(o.lse.data()[..2], [f64::NEG_INFINITY, f64::NEG_INFINITY]);
    assert!(close(o.lse.data()[2], 0.0));
    assert!(o.out.data().iter().all(|x| !x.is_nan()));
}

#[test]
fn softcap_applies_tanh_after_scale() {
    let s = spec("heads = 1, head_dim = 1, scale = 2.0, softcap = 30.0");
    let o = run(
        &s,
        &arr(&[1, 1, 1, 1], &[5.0]),
        &arr(&[1, 1, 1, 1], &[10.0]),
        &arr(&[1, 1, 1, 1], &[1.0]),
        0,
    );
    assert!(close(o.lse.data()[0], 30.0 * (100.0f64 / 30.0).tanh()));
}

#[test]
fn alibi_adds_slope_times_relative_position() {
    // One head: slope 2^-8. Query at position 1, keys at 0 and 1: biases -1/256 and 0.
    let o = uniform(
        "heads = 1, head_dim = 1, mask = causal, position = alibi",
        1,
        2,
    );
    let (a, b) = ((-1.0f64 / 256.0).exp(), 1.0);
    assert!(close(o.lse.data()[0], (a + b).ln()));
    assert!(close(o.out.data()[0], (a * 1.0 + b * 2.0) / (a + b)));
}

#[test]
fn alibi_slopes_follow_the_bloom_recipe() {
    let eight: Vec<f64> = (1..=8).map(|i| 2f64.powi(-i)).collect();
    assert_eq!(reference::alibi::slopes(8), eight);
    // 12 heads: the 8-head slopes, then the odd powers of the 16-head slopes.
    let mut twelve = eight.clone();
    twelve.extend([-0.5, -1.5, -2.5, -3.5].map(|e| 2f64.powf(e)));
    assert_eq!(reference::alibi::slopes(12), twelve);
    assert_eq!(reference::alibi::slopes(1), vec![2f64.powi(-8)]);
}

#[test]
fn query_heads_read_their_group_of_kv_heads() {
    let s = spec("heads = 4, kv_heads = 2, head_dim = 1");
    let q = Array::zeros(&[1, 4, 1, 1]);
    let k = Array::zeros(&[1, 2, 1, 1]);
    let v = arr(&[1, 2, 1, 1], &[10.0, 20.0]);
    let o = run(&s, &q, &k, &v, 0);
    assert_eq!(o.out.data(), &[10.0, 10.0, 20.0, 20.0]);
}

#[test]
fn custom_modifiers_see_heads_and_absolute_positions() {
    // score_mod adds the head index and the query position; mask_mod drops key position 5.
    let s = spec(
        "heads = 2, head_dim = 1, mask = causal, \
         score_mod = |score, b, h, q, k| score + (h + 10 * q) as f32, \
         mask_mod = |b, h, q, k| k != 5",
    );
    let q = Array::zeros(&[1, 2, 1, 1]);
    let k = Array::zeros(&[1, 2, 3, 1]);
    let v = Array::from_fn(&[1, 2, 3, 1], |ix| (ix[2] + 1) as f64);
    // Keys at positions 5, 6, 7 (offset 5); the query is at 7. Key 5 is masked.
    let o = run(&s, &q, &k, &v, 5);
    for h in 0..2 {
        let bias = h as f64 + 70.0;
        assert!(close(o.lse.get(&[0, h, 0]), bias + 2f64.ln()), "head {h}");
        assert!(close(o.out.get(&[0, h, 0, 0]), 2.5));
    }
}

fn pseudo_random(shape: &[usize], seed: u64) -> Array {
    let n = shape.iter().product();
    Array::from_vec(shape, values_f64(n, seed)).expect("the values fill the shape")
}

#[test]
fn plain_rope_scores_depend_only_on_relative_position() {
    let s = spec("heads = 2, head_dim = 8, mask = causal, position = rope(base = 100.0)");
    let (q, k, v) = (
        pseudo_random(&[1, 2, 5, 8], 1),
        pseudo_random(&[1, 2, 7, 8], 2),
        pseudo_random(&[1, 2, 7, 8], 3),
    );
    let a = run(&s, &q, &k, &v, 0);
    let b = run(&s, &q, &k, &v, 100_000);
    for (x, y) in a.out.data().iter().zip(b.out.data()) {
        assert!((x - y).abs() < 1e-9, "{x} vs {y}");
    }
}

#[test]
fn dynamic_ntk_changes_once_the_length_exceeds_the_original() {
    let s = spec(
        "heads = 1, head_dim = 8, position = rope(scaling = dynamic(factor = 4.0, \
         original_max_position = 16))",
    );
    let (q, k, v) = (
        pseudo_random(&[1, 1, 4, 8], 4),
        pseudo_random(&[1, 1, 8, 8], 5),
        pseudo_random(&[1, 1, 8, 8], 6),
    );
    // Lengths 8 and 16 are within the original context: the base is unchanged, and plain RoPE
    // is relative, so the outputs agree. Past 16 the base grows and they differ.
    let within = run(&s, &q, &k, &v, 0);
    let at_edge = run(&s, &q, &k, &v, 8);
    let beyond = run(&s, &q, &k, &v, 100);
    let diff = |a: &reference::Output, b: &reference::Output| {
        a.out
            .data()
            .iter()
            .zip(b.out.data())
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    };
    assert!(diff(&within, &at_edge) < 1e-12);
    assert!(diff(&within, &beyond) > 1e-6);
}

#[test]
fn mla_absorbed_equals_expanded() {
    let s = spec(
        "heads = 3, head_dim = 4, v_head_dim = 5, mla(latent_rank = 6, rope_dim = 4), \
         mask = causal, position = rope(base = 50.0), softcap = 5.0",
    );
    let (b, sq, skv) = (2, 3, 5);
    let x = MlaInputs {
        q_nope: &pseudo_random(&[b, 3, sq, 4], 7),
        q_pe: &pseudo_random(&[b, 3, sq, 4], 8),
        c_kv: &pseudo_random(&[b, skv, 6], 9),
        k_pe: &pseudo_random(&[b, skv, 4], 10),
        w_kv_b: &pseudo_random(&[3 * (4 + 5), 6], 11),
        position_offset: 7,
    };
    let expanded = reference::mla_expanded(&s, &x).unwrap();
    let absorbed = reference::mla_absorbed(&s, &x).unwrap();
    assert_eq!(expanded.out.shape(), &[b, 3, sq, 5]);
    for (e, a) in expanded.out.data().iter().zip(absorbed.output.out.data()) {
        assert!((e - a).abs() < 1e-12, "{e} vs {a}");
    }
    for (e, a) in expanded.lse.data().iter().zip(absorbed.output.lse.data()) {
        assert!((e - a).abs() < 1e-12, "{e} vs {a}");
    }
}

#[test]
fn bad_shapes_are_errors_naming_the_tensor() {
    let s = spec("heads = 4, kv_heads = 2, head_dim = 8");
    let q = Array::zeros(&[1, 4, 3, 8]);
    let k = Array::zeros(&[1, 4, 3, 8]);
    let v = Array::zeros(&[1, 2, 3, 8]);
    let err = reference::attention(
        &s,
        &Inputs {
            q: &q,
            k: &k,
            v: &v,
            position_offset: 0,
        },
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("`k`") && text.contains("[1, 2, 3, 8]"),
        "{text}"
    );

    let mla = spec("heads = 2, head_dim = 4, mla(latent_rank = 8, rope_dim = 2)");
    let wrong_entry = reference::attention(
        &mla,
        &Inputs {
            q: &q,
            k: &k,
            v: &v,
            position_offset: 0,
        },
    );
    assert!(
        wrong_entry
            .unwrap_err()
            .to_string()
            .contains("mla_absorbed")
    );
}

#[test]
fn invalid_specs_built_in_code_are_rejected_not_run() {
    let mut s = AttentionSpec::new(4, 8);
    s.kv = attn_dsl::KvLayout::Heads { kv_heads: 3 };
    let q = Array::zeros(&[1, 4, 1, 8]);
    let kv = Array::zeros(&[1, 3, 1, 8]);
    let err = reference::attention(
        &s,
        &Inputs {
            q: &q,
            k: &kv,
            v: &kv,
            position_offset: 0,
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("not a multiple"), "{err}");
}
