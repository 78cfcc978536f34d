//! RoPE: rotations and every scaling's frequencies, on values worked out by hand.

use attn_dsl::reference::rope;
use attn_dsl::{Rope, RopeLayout, RopeScaling, Yarn};
use std::f64::consts::PI;

fn rope_with(dim: u32, base: f64, scaling: RopeScaling) -> Rope {
    Rope {
        base,
        dim,
        layout: RopeLayout::Half,
        scaling,
        xpos: None,
    }
}

fn assert_all_close(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-14 * w.abs().max(1.0),
            "[{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn plain_frequencies_are_powers_of_the_base() {
    let r = rope_with(8, 10000.0, RopeScaling::None);
    assert_all_close(&rope::inv_freq(&r, 0), &[1.0, 0.1, 0.01, 0.001]);
}

#[test]
fn half_layout_pairs_i_with_i_plus_half() {
    let r = rope_with(4, 10000.0, RopeScaling::None);
    let mut x = [1.0, 0.0, 0.0, 0.0, 7.0];
    rope::rotate(&r, &mut x[..], 3, &rope::inv_freq(&r, 0), 1.0);
    assert_all_close(&x, &[3f64.cos(), 0.0, 3f64.sin(), 0.0, 7.0]);
}

#[test]
fn interleaved_layout_pairs_neighbours() {
    let r = Rope {
        layout: RopeLayout::Interleaved,
        ..rope_with(4, 10000.0, RopeScaling::None)
    };
    let mut x = [1.0, 0.0, 0.0, 1.0];
    rope::rotate(&r, &mut x, 2, &rope::inv_freq(&r, 0), 1.0);
    // Pair (0,1) turns by 2 rad, pair (2,3) by 2 * 0.01 rad.
    let t = 2.0 * 0.01f64;
    assert_all_close(&x, &[2f64.cos(), 2f64.sin(), -t.sin(), t.cos()]);
}

#[test]
fn position_zero_is_the_identity() {
    let r = rope_with(6, 500.0, RopeScaling::None);
    let mut x = [0.3, -1.0, 2.0, 0.5, 0.25, -0.75];
    let before = x;
    rope::rotate(&r, &mut x, 0, &rope::inv_freq(&r, 0), 1.0);
    assert_eq!(x, before);
}

#[test]
fn linear_divides_frequencies_by_the_factor() {
    let r = rope_with(8, 10000.0, RopeScaling::Linear { factor: 4.0 });
    assert_all_close(&rope::inv_freq(&r, 0), &[0.25, 0.025, 0.0025, 0.00025]);
}

/// LongRoPE divides each frequency by its pair's factor: the short ones while the length fits
/// the original context, the long ones past it; cos and sin scale by its attention factor.
#[test]
fn longrope_picks_its_factors_by_the_length() {
    let r = rope_with(
        4,
        10000.0,
        RopeScaling::LongRope(attn_dsl::LongRope {
            short: vec![2.0, 4.0].into(),
            long: vec![8.0, 16.0].into(),
            original_max_position: 100,
            attention_factor: 1.25,
        }),
    );
    assert_all_close(&rope::inv_freq(&r, 100), &[0.5, 0.0025]);
    assert_all_close(&rope::inv_freq(&r, 101), &[0.125, 0.000625]);
    assert_eq!(rope::attention_factor(&r), 1.25);
}

#[test]
fn static_ntk_raises_the_base() {
    // dim 4, factor 4: base' = base * 4^(4/2) = 16 * base.
    let r = rope_with(4, 10000.0, RopeScaling::Ntk { factor: 4.0 });
    assert_all_close(&rope::inv_freq(&r, 0), &[1.0, 1.0 / 400.0]);
}

#[test]
fn dynamic_ntk_grows_the_base_with_the_length() {
    let r = rope_with(
        4,
        10000.0,
        RopeScaling::Dynamic {
            factor: 2.0,
            original_max_position: 100,
        },
    );
    assert_all_close(&rope::inv_freq(&r, 100), &[1.0, 0.01]);
    // L = 200: base' = base * (2 * 200/100 - 1)^2 = 9 * base.
    assert_all_close(&rope::inv_freq(&r, 200), &[1.0, 1.0 / 300.0]);
}

#[test]
fn yarn_blends_interpolation_by_a_ramp_and_scales_by_its_attention_factor() {
    // dim 4, base 10^4, orig 1024: corr(32) = 0.35 -> lo 0; corr(1) = 1.11 -> hi 2.
    // ramp = [0, 0.5]: inv_freq[1] = 0.01/4 * 0.5 + 0.01 * 0.5.
    let r = rope_with(4, 10000.0, RopeScaling::Yarn(Yarn::new(4.0, 1024)));
    assert_all_close(&rope::inv_freq(&r, 0), &[1.0, 0.00625]);
    assert!((rope::attention_factor(&r) - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);

    let with_mscale = Yarn {
        mscale: Some(2.0),
        mscale_all_dim: Some(1.0),
        ..Yarn::new(4.0, 1024)
    };
    let r = rope_with(4, 10000.0, RopeScaling::Yarn(with_mscale));
    let g = |m: f64| 0.1 * m * 4f64.ln() + 1.0;
    assert!((rope::attention_factor(&r) - g(2.0) / g(1.0)).abs() < 1e-15);

    // truncate = false (gpt-oss) keeps the range [0.35, 1.11] unrounded:
    // ramp[1] = (1 - 0.3526) / (1.1130 - 0.3526).
    let exact = Yarn {
        truncate: false,
        ..Yarn::new(4.0, 1024)
    };
    let r = rope_with(4, 10000.0, RopeScaling::Yarn(exact));
    let corr =
        |rot: f64| 4.0 * (1024.0 / (2.0 * std::f64::consts::PI * rot)).ln() / (2.0 * 10000f64.ln());
    let ramp = (1.0 - corr(32.0)) / (corr(1.0) - corr(32.0));
    let want = 0.01 / 4.0 * ramp + 0.01 * (1.0 - ramp);
    let got = rope::inv_freq(&r, 0);
    // Dim 0 is below the range: it keeps its frequency of 1.
    assert_all_close(&got, &[1.0, want]);
    assert!((got[1] - 0.00625).abs() > 1e-4, "the rounding matters here");
    // It prints and parses back.
    let spec: attn_dsl::AttentionSpec =
        "heads = 2, head_dim = 8, position = rope(scaling = yarn(factor = 4.0, \
         original_max_position = 1024, truncate = false))"
            .parse()
            .unwrap();
    assert_eq!(
        spec.to_string().parse::<attn_dsl::AttentionSpec>().unwrap(),
        spec
    );
    assert!(spec.to_string().contains("truncate = false"), "{spec}");
}

#[test]
fn llama3_keeps_high_frequencies_divides_low_ones_and_blends_between() {
    // Wavelengths 2*pi/inv_freq: 6.3, 63, 628, 6283. With orig 1000, low 1, high 4: below 250
    // kept, above 1000 divided by 8, 628 blended with t = (1000/628.3 - 1)/3.
    let r = rope_with(
        8,
        10000.0,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 1000,
        },
    );
    let t = (10.0 / (2.0 * PI) - 1.0) / 3.0;
    let blended = (1.0 - t) * 0.01 / 8.0 + t * 0.01;
    assert_all_close(&rope::inv_freq(&r, 0), &[1.0, 0.1, blended, 0.001 / 8.0]);
}

#[test]
fn rotation_preserves_the_norm_and_large_positions_stay_accurate() {
    let r = rope_with(64, 10000.0, RopeScaling::None);
    let freqs = rope::inv_freq(&r, 0);
    let x: Vec<f64> = (0..64).map(|i| (i as f64 * 0.37).sin()).collect();
    let norm = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>().sqrt();
    let mut y = x.clone();
    rope::rotate(&r, &mut y, 1_000_003, &freqs, 1.0);
    assert!((norm(&x) - norm(&y)).abs() < 1e-12);
    // Rotating by p and then by -p gives the input back.
    rope::rotate(&r, &mut y, -1_000_003, &freqs, 1.0);
    assert_all_close(&y, &x);
}
