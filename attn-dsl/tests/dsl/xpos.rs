//! xPos (`position = xpos(..)`): parsed with the paper's defaults, printed back, refused where it
//! does not hold, and the reference's scores against the paper's formula worked out apart:
//! each rotated pair's share of `q . k` times `zeta_i^((n - m) / scale_base)`.

use crate::support::rejects;
use attn_dsl::reference::rope::{self, Side};
use attn_dsl::{Position, RopeLayout, XPos, parse_str};

#[test]
fn xpos_parses_with_the_papers_defaults_and_prints_back() {
    let spec = parse_str("heads = 2, head_dim = 16, position = xpos").unwrap();
    let Position::Rope(r) = &spec.position else {
        panic!("{spec}")
    };
    assert_eq!(r.xpos, Some(XPos::PAPER));
    assert_eq!(
        (r.base, r.dim, r.layout),
        (10000.0, 16, RopeLayout::Interleaved)
    );
    let shown = spec.to_string();
    assert!(shown.contains("position = xpos(base = 10000"), "{shown}");
    assert!(
        shown.contains("scale_base = 512.0, gamma = 0.4)"),
        "{shown}"
    );
    assert_eq!(parse_str(&shown).unwrap(), spec);

    let text = "heads = 2, head_dim = 16, position = xpos(base = 500.0, dim = 8, layout = half, \
                scaling = linear(factor = 2.0), scale_base = 64.0, gamma = 0.25)";
    let spec = parse_str(text).unwrap();
    let r = spec.rope().unwrap();
    assert_eq!(
        (r.dim, r.layout, r.xpos),
        (
            8,
            RopeLayout::Half,
            Some(XPos {
                scale_base: 64.0,
                gamma: 0.25
            })
        )
    );
    assert_eq!(parse_str(&spec.to_string()).unwrap(), spec);
    // Plain RoPE prints as before.
    let plain = parse_str("heads = 2, head_dim = 16, position = rope").unwrap();
    assert!(plain.to_string().contains("position = rope("), "{plain}");
    assert_eq!(plain.rope().unwrap().xpos, None);
}

#[test]
fn bad_xpos_parameters_are_refused() {
    let m = "heads = 2, head_dim = 16, ";
    rejects(
        &format!("{m}position = xpos(scale_base = 0.5)"),
        "xpos scale_base = 0.5 is invalid; allowed: a finite number of at least 1",
        "scale_base = ",
        "0.5",
    );
    rejects(
        &format!("{m}position = xpos(gamma = -1.0)"),
        "xpos gamma = -1 is invalid",
        "gamma = ",
        "-1.0",
    );
    rejects(
        &format!("{m}position = rope(scale_base = 64.0)"),
        "scale_base",
        "rope(",
        "scale_base",
    );
    rejects(
        &format!("{m}mla(latent_rank = 16, rope_dim = 8), position = xpos"),
        "xpos is not built for mla(...)",
        "position = ",
        "xpos",
    );
}

/// q . k over one call's rotated rows at positions `n` and `m`, as the reference rotates them.
fn score(r: &attn_dsl::Rope, q: &[f64], k: &[f64], n: i64, m: i64) -> f64 {
    let (mut q, mut k) = (q.to_vec(), k.to_vec());
    let freqs = rope::inv_freq(r, 0);
    rope::rotate(r, &mut q, n, &freqs, 1.0);
    rope::rotate(r, &mut k, m, &freqs, 1.0);
    let decay = |side, p| rope::decay(r, p as f64, side).unwrap();
    let (dq, dk) = (decay(Side::Query, n), decay(Side::Key, m));
    let pairing = r.layout.pairing(r.dim);
    (0..r.dim as usize / 2)
        .map(|i| {
            let (a, b) = pairing.pair(i);
            (q[a] * k[a] + q[b] * k[b]) * dq[i] * dk[i]
        })
        .sum()
}

#[test]
fn scores_decay_as_the_paper_writes_them() {
    let r = parse_str("heads = 1, head_dim = 8, position = xpos(scale_base = 16.0)")
        .unwrap()
        .rope()
        .unwrap()
        .clone();
    let q = [0.3, -1.2, 0.7, 0.25, -0.5, 0.9, 1.1, -0.4];
    let k = [-0.6, 0.2, 0.45, -1.0, 0.8, 0.35, -0.15, 0.6];
    for (n, m) in [(5, 5), (40, 3), (100, 99), (7, 30)] {
        // The paper: pair i of the rotated q . k (angle (n - m) theta_i) times zeta_i^((n-m)/B),
        // zeta_i = (2i/d + 0.4) / 1.4, theta_i = 10000^(-2i/d), pairs (2i, 2i + 1).
        let want: f64 = (0..4)
            .map(|i| {
                let zeta = (2.0 * i as f64 / 8.0 + 0.4) / 1.4;
                let theta = 10000f64.powf(-2.0 * i as f64 / 8.0) * (n - m) as f64;
                let (qa, qb, ka, kb) = (q[2 * i], q[2 * i + 1], k[2 * i], k[2 * i + 1]);
                let dot = (qa * ka + qb * kb) * theta.cos() - (qb * ka - qa * kb) * theta.sin();
                dot * zeta.powf((n - m) as f64 / 16.0)
            })
            .sum();
        let got = score(&r, &q, &k, n, m);
        assert!((got - want).abs() < 1e-12, "({n}, {m}): {got} vs {want}");
        // Shifting both positions leaves the score: only n - m matters.
        let shifted = score(&r, &q, &k, n + 1000, m + 1000);
        assert!(
            (shifted - want).abs() < 1e-9 * want.abs().max(1.0),
            "shift ({n}, {m})"
        );
    }
}

#[test]
fn the_transpose_takes_a_gradient_back() {
    // <apply(x), y> = <x, apply_transposed(y)> for any x, y: the backward's rotation.
    let r = parse_str("heads = 1, head_dim = 8, position = xpos(layout = half, scale_base = 4.0)")
        .unwrap()
        .rope()
        .unwrap()
        .clone();
    let x =
        attn_dsl::reference::Array::from_fn(&[3, 8], |ix| (ix[0] * 8 + ix[1]) as f64 * 0.1 - 1.0);
    let y =
        attn_dsl::reference::Array::from_fn(&[3, 8], |ix| ((ix[0] + 2 * ix[1]) % 5) as f64 - 2.0);
    let positions = [2, 9, 17];
    for side in [Side::Query, Side::Key] {
        let ax = rope::apply(&r, &x, &positions, 0, side);
        let aty = rope::apply_transposed(&r, &y, &positions, 0, side);
        let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f64>();
        let (lhs, rhs) = (dot(ax.data(), y.data()), dot(x.data(), aty.data()));
        assert!(
            (lhs - rhs).abs() < 1e-9 * lhs.abs().max(1.0),
            "{side:?}: {lhs} vs {rhs}"
        );
    }
}
