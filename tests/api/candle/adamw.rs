//! One AdamW step of a two-layer attention model: with attn's op and with candle's naive
//! attention, from the same weights, the loss before the step, the loss after it and the
//! updated weights agree.

use super::naive::{Naive, naive_attention};
use super::values;
use attn::candle::core::{Device, Tensor, Var};
use attn::candle::nn::{AdamW, Optimizer, ParamsAdamW};

const VOCAB: usize = 16;
const MODEL: usize = 32;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 8;
const SEQ: usize = 12;
const BATCH: usize = 2;
const SPEC: &str = "heads = 4, kv_heads = 2, head_dim = 8, mask = causal";

/// The weights: an embedding, two layers of (wq, wk, wv, wo), and the output head.
fn weights() -> Vec<Var> {
    let kv = KV_HEADS * HEAD_DIM;
    let mut shapes = vec![(VOCAB, MODEL)];
    for _ in 0..2 {
        shapes.extend([(MODEL, MODEL), (MODEL, kv), (MODEL, kv), (MODEL, MODEL)]);
    }
    shapes.push((MODEL, VOCAB));
    shapes
        .iter()
        .enumerate()
        .map(|(i, &(r, c))| {
            let init = super::tensor(&[r, c], 100 + i as u64)
                .affine(0.3, 0.0)
                .unwrap();
            Var::from_tensor(&init).unwrap()
        })
        .collect()
}

/// The mean cross-entropy of next-token prediction, attention by `attend` (BHSD in and out).
fn loss(
    w: &[Var],
    tokens: &Tensor,
    targets: &Tensor,
    attend: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
) -> Tensor {
    let heads = |x: &Tensor, weight: &Var, h: usize| {
        x.broadcast_matmul(weight)
            .unwrap()
            .reshape((BATCH, SEQ, h, HEAD_DIM))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    };
    let mut x = w[0]
        .embedding(&tokens.flatten_all().unwrap())
        .unwrap()
        .reshape((BATCH, SEQ, MODEL))
        .unwrap();
    for layer in w[1..9].chunks(4) {
        let q = heads(&x, &layer[0], HEADS);
        let k = heads(&x, &layer[1], KV_HEADS);
        let v = heads(&x, &layer[2], KV_HEADS);
        let a = attend(&q, &k, &v)
            .transpose(1, 2)
            .unwrap()
            .reshape((BATCH, SEQ, MODEL))
            .unwrap();
        x = (x + a.broadcast_matmul(&layer[3]).unwrap()).unwrap();
    }
    let logits = x
        .broadcast_matmul(&w[9])
        .unwrap()
        .reshape((BATCH * SEQ, VOCAB))
        .unwrap();
    attn::candle::nn::loss::cross_entropy(&logits, targets).unwrap()
}

#[test]
fn one_adamw_step_changes_the_loss_as_the_naive_models_does() {
    let variant = attn::Variant::parse(SPEC).unwrap();
    let ours =
        |q: &Tensor, k: &Tensor, v: &Tensor| attn::candle::attention(&variant, q, k, v).unwrap();
    let naive = Naive {
        heads: HEADS,
        kv_heads: KV_HEADS,
        keep: |i, j| j <= i,
        softcap: None,
    };
    let theirs = |q: &Tensor, k: &Tensor, v: &Tensor| naive_attention(&naive, q, k, v);
    let ids: Vec<u32> = (0..BATCH * (SEQ + 1))
        .map(|i| ((i * 7 + i / 3) % VOCAB) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (BATCH, SEQ + 1), &Device::Cpu).unwrap();
    let tokens = ids.narrow(1, 0, SEQ).unwrap();
    let targets = ids.narrow(1, 1, SEQ).unwrap().flatten_all().unwrap();

    let mut before_after = Vec::new();
    let mut trained = Vec::new();
    for attend in [
        &ours as &dyn Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
        &theirs,
    ] {
        let w = weights();
        let params = ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        };
        let mut opt = AdamW::new(w.clone(), params).unwrap();
        let before = loss(&w, &tokens, &targets, attend);
        opt.backward_step(&before).unwrap();
        let after = loss(&w, &tokens, &targets, attend);
        before_after.push((
            before.to_scalar::<f32>().unwrap(),
            after.to_scalar::<f32>().unwrap(),
        ));
        trained.push(w);
    }
    let [(b_ours, a_ours), (b_naive, a_naive)] = before_after[..] else {
        unreachable!()
    };
    assert!(
        (b_ours - b_naive).abs() <= 1e-5 * b_naive,
        "before: {b_ours} vs {b_naive}"
    );
    assert!(
        (a_ours - a_naive).abs() <= 1e-4 * a_naive,
        "after: {a_ours} vs {a_naive}"
    );
    assert!(
        a_ours < b_ours - 1e-3,
        "the step did not lower the loss: {b_ours} -> {a_ours}"
    );
    for (i, (x, y)) in trained[0].iter().zip(&trained[1]).enumerate() {
        let (x, y) = (values(x.as_tensor()), values(y.as_tensor()));
        let worst = x
            .iter()
            .zip(&y)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(worst <= 1e-4, "weight {i}: updates differ by {worst}");
    }
}
