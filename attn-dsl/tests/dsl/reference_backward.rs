//! The reference backward pass checked by central finite differences of the reference forward:
//! for the loss `L = sum(out * dout)`, every gradient entry against `(L(x + e) - L(x - e)) / 2e`.

use attn_dsl::inputs::values_f64;
use attn_dsl::parse_str;
use attn_dsl::reference::{Array, Inputs, attention, backward};

/// A deterministic pseudo-random array in [-1, 1).
fn array(shape: &[usize], seed: u64) -> Array {
    let n = shape.iter().product();
    Array::from_vec(shape, values_f64(n, seed)).expect("the values fill the shape")
}

fn loss(
    spec: &attn_dsl::AttentionSpec,
    q: &Array,
    k: &Array,
    v: &Array,
    p0: i64,
    dout: &Array,
) -> f64 {
    let out = attention(
        spec,
        &Inputs {
            q,
            k,
            v,
            position_offset: p0,
        },
    )
    .unwrap()
    .out;
    out.data().iter().zip(dout.data()).map(|(o, g)| o * g).sum()
}

/// Every entry of `grad` against finite differences of the loss in `which` (0 q, 1 k, 2 v).
fn check(text: &str, b: usize, sq: usize, skv: usize, p0: i64) {
    let spec = parse_str(text).unwrap();
    let (hq, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let inputs = [
        array(&[b, hq, sq, d], 1),
        array(&[b, hkv, skv, d], 2),
        array(&[b, hkv, skv, dv], 3),
    ];
    let dout = array(&[b, hq, sq, dv], 4);
    let grads = backward(
        &spec,
        &Inputs {
            q: &inputs[0],
            k: &inputs[1],
            v: &inputs[2],
            position_offset: p0,
        },
        &dout,
    )
    .unwrap();
    let step = 1e-5;
    for (which, grad) in [&grads.dq, &grads.dk, &grads.dv].into_iter().enumerate() {
        assert_eq!(grad.shape(), inputs[which].shape());
        for flat in 0..grad.data().len() {
            let nudged = |delta: f64| {
                let mut x = inputs.clone();
                let mut data = x[which].data().to_vec();
                data[flat] += delta;
                x[which] = Array::from_vec(x[which].shape(), data).unwrap();
                loss(&spec, &x[0], &x[1], &x[2], p0, &dout)
            };
            let numeric = (nudged(step) - nudged(-step)) / (2.0 * step);
            let analytic = grad.data()[flat];
            assert!(
                (numeric - analytic).abs() < 1e-6 * (1.0 + analytic.abs()),
                "{text}: d{}[{flat}]: finite difference {numeric}, analytic {analytic}",
                ["q", "k", "v"][which]
            );
        }
    }
}

#[test]
fn plain_and_causal() {
    check("heads = 2, head_dim = 4", 1, 3, 5, 0);
    check(
        "heads = 2, head_dim = 4, v_head_dim = 3, mask = causal",
        2,
        4,
        4,
        0,
    );
}

#[test]
fn gqa_mqa_and_sq_above_skv() {
    check(
        "heads = 4, kv_heads = 2, head_dim = 4, mask = causal(top_left)",
        1,
        5,
        3,
        0,
    );
    check(
        "heads = 3, kv_heads = 1, head_dim = 2, mask = sliding_window(2)",
        1,
        4,
        6,
        3,
    );
}

#[test]
fn rope_with_scalings() {
    check(
        "heads = 2, head_dim = 6, mask = causal, position = rope(dim = 4, base = 100.0)",
        1,
        3,
        5,
        7,
    );
    check(
        "heads = 2, head_dim = 4, position = rope(layout = interleaved, base = 50.0, \
         scaling = yarn(factor = 4.0, original_max_position = 16, mscale = 1.0, \
         mscale_all_dim = 0.5))",
        1,
        3,
        4,
        100,
    );
    check(
        "heads = 2, head_dim = 4, position = rope(base = 50.0, scaling = dynamic(factor = 2.0, \
         original_max_position = 4))",
        1,
        2,
        5,
        2,
    );
}

#[test]
fn softcap_alibi_and_custom_modifiers() {
    check(
        "heads = 2, head_dim = 4, softcap = 0.5, position = alibi, mask = causal",
        1,
        3,
        4,
        0,
    );
    check(
        "heads = 2, head_dim = 4, score_mod = |s, b, h, q, k| (s * 3.0).tanh() * 2.0 + \
         (s * s + 1.0).sqrt() - 0.1 * (q - k).abs() as f32, mask_mod = |b, h, q, k| (q + k) % 3 != 1",
        2,
        3,
        4,
        0,
    );
}

#[test]
fn fully_masked_rows_have_zero_gradient() {
    // The query at position 2 keeps no key (the mask_mod drops them all): its dq row is 0.
    let text = "heads = 1, head_dim = 4, mask_mod = |b, h, q, k| q != 2";
    check(text, 1, 3, 3, 0);
    let spec = parse_str(text).unwrap();
    let (q, k, v) = (
        array(&[1, 1, 3, 4], 5),
        array(&[1, 1, 3, 4], 6),
        array(&[1, 1, 3, 4], 7),
    );
    let dout = array(&[1, 1, 3, 4], 8);
    let inputs = Inputs {
        q: &q,
        k: &k,
        v: &v,
        position_offset: 0,
    };
    let grads = backward(&spec, &inputs, &dout).unwrap();
    assert!(grads.dq.row(&[0, 0, 2]).iter().all(|x| *x == 0.0));
    assert!(grads.dq.row(&[0, 0, 0]).iter().any(|x| *x != 0.0));
}

#[test]
fn mla_per_head_entry_point_refuses_with_a_clear_error() {
    let spec = parse_str("heads = 2, head_dim = 8, mla(latent_rank = 16, rope_dim = 8)").unwrap();
    let a = array(&[1, 2, 1, 8], 1);
    let inputs = Inputs {
        q: &a,
        k: &a,
        v: &a,
        position_offset: 0,
    };
    let err = backward(&spec, &inputs, &a).unwrap_err().to_string();
    assert!(err.contains("MLA") && err.contains("backward_mla"), "{err}");
}

/// MLA's gradients (q_nope, q_pe, c_kv, k_pe, w_kv_b) against finite differences of the
/// expanded forward.
fn check_mla(text: &str, b: usize, sq: usize, skv: usize, p0: i64) {
    use attn_dsl::reference::{MlaInputs, backward_mla, mla_expanded};
    let spec = parse_str(text).unwrap();
    let mla = spec.mla().unwrap();
    let (h, dn, dv) = (
        spec.heads as usize,
        spec.head_dim as usize,
        spec.v_head_dim as usize,
    );
    let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
    let inputs = [
        array(&[b, h, sq, dn], 1),
        array(&[b, h, sq, dr], 2),
        array(&[b, skv, r], 3),
        array(&[b, skv, dr], 4),
        array(&[h * (dn + dv), r], 5),
    ];
    let dout = array(&[b, h, sq, dv], 6);
    fn of(x: &[Array; 5], p0: i64) -> MlaInputs<'_> {
        MlaInputs {
            q_nope: &x[0],
            q_pe: &x[1],
            c_kv: &x[2],
            k_pe: &x[3],
            w_kv_b: &x[4],
            position_offset: p0,
        }
    }
    let grads = backward_mla(&spec, &of(&inputs, p0), &dout).unwrap();
    let loss = |x: &[Array; 5]| -> f64 {
        let out = mla_expanded(&spec, &of(x, p0)).unwrap().out;
        out.data().iter().zip(dout.data()).map(|(o, g)| o * g).sum()
    };
    let step = 1e-5;
    let names = ["q_nope", "q_pe", "c_kv", "k_pe", "w_kv_b"];
    let all = [
        &grads.dq_nope,
        &grads.dq_pe,
        &grads.dc_kv,
        &grads.dk_pe,
        &grads.dw_kv_b,
    ];
    for (which, grad) in all.into_iter().enumerate() {
        assert_eq!(grad.shape(), inputs[which].shape(), "{}", names[which]);
        for flat in 0..grad.data().len() {
            let nudged = |delta: f64| {
                let mut x = inputs.clone();
                let mut data = x[which].data().to_vec();
                data[flat] += delta;
                x[which] = Array::from_vec(x[which].shape(), data).unwrap();
                loss(&x)
            };
            let numeric = (nudged(step) - nudged(-step)) / (2.0 * step);
            let analytic = grad.data()[flat];
            assert!(
                (numeric - analytic).abs() < 1e-6 * (1.0 + analytic.abs()),
                "{text}: d{}[{flat}]: finite difference {numeric}, analytic {analytic}",
                names[which]
            );
        }
    }
}

#[test]
fn mla_gradients_match_finite_differences() {
    check_mla(
        "heads = 2, head_dim = 4, v_head_dim = 3, mla(latent_rank = 5, rope_dim = 4), \
         mask = causal, position = rope",
        2,
        4,
        6,
        1,
    );
    check_mla(
        "heads = 3, head_dim = 2, v_head_dim = 2, mla(latent_rank = 3, rope_dim = 2), \
         softcap = 3.0, position = rope(scaling = yarn(factor = 4.0, original_max_position = 4))",
        1,
        5,
        5,
        0,
    );
    check_mla(
        "heads = 2, head_dim = 2, mla(latent_rank = 4, rope_dim = 2), position = rope, \
         score_mod = |s, b, h, q, k| s * 0.7 - 0.1 * (q - k).abs() as f32, \
         mask_mod = |b, h, q, k| q != 1",
        1,
        3,
        4,
        0,
    );
}

#[test]
fn sigmoid_attention_gradients_match_finite_differences() {
    check(
        "heads = 2, head_dim = 4, mask = causal, normalize = sigmoid(bias = -1.5)",
        1,
        4,
        6,
        0,
    );
    check(
        "heads = 4, kv_heads = 2, head_dim = 4, v_head_dim = 3, position = alibi, \
         softcap = 2.0, normalize = sigmoid(bias = -ln(8)), \
         mask_mod = |b, h, q, k| (q - k) % 3 != 1",
        2,
        3,
        5,
        2,
    );
}

#[test]
fn stick_breaking_gradients_match_finite_differences() {
    check(
        "heads = 2, head_dim = 4, mask = causal, normalize = stick_breaking",
        1,
        4,
        6,
        0,
    );
    check(
        "heads = 4, kv_heads = 2, head_dim = 4, v_head_dim = 3, position = rope, \
         softcap = 2.0, normalize = stick_breaking, mask_mod = |b, h, q, k| (q - k) % 3 != 1",
        2,
        3,
        5,
        2,
    );
}
