//! attn's op against attention written with candle's own ops (matmul, masked softmax, matmul),
//! forward and gradients, for causal, GQA, sliding-window and softcap variants; inputs that
//! arrive as transposed BSHD views give the same results.

use super::{assert_close, var};
use attn::candle::core::{D, Device, Tensor};

/// What the naive attention needs of a variant.
pub(crate) struct Naive {
    pub heads: usize,
    pub kv_heads: usize,
    /// `(query row, key column) -> kept`, for queries aligned at the bottom right.
    pub keep: fn(usize, usize) -> bool,
    pub softcap: Option<f64>,
}

/// Attention through candle's ops: `softmax(mask(softcap(q k^T / sqrt(D)))) v`, with each kv
/// head repeated for its group of query heads.
pub(crate) fn naive_attention(n: &Naive, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let (b, _, sq, d) = q.dims4().unwrap();
    let skv = k.dim(2).unwrap();
    let group = n.heads / n.kv_heads;
    let repeat = |t: &Tensor| {
        let (b, hkv, s, d) = t.dims4().unwrap();
        t.unsqueeze(2)
            .unwrap()
            .expand((b, hkv, group, s, d))
            .unwrap()
            .reshape((b, hkv * group, s, d))
            .unwrap()
    };
    let (k, v) = (repeat(k), repeat(v));
    let mut s = q
        .contiguous()
        .unwrap()
        .matmul(&k.t().unwrap().contiguous().unwrap())
        .unwrap()
        .affine(1.0 / (d as f64).sqrt(), 0.0)
        .unwrap();
    if let Some(c) = n.softcap {
        s = s
            .affine(1.0 / c, 0.0)
            .unwrap()
            .tanh()
            .unwrap()
            .affine(c, 0.0)
            .unwrap();
    }
    let keep: Vec<u8> = (0..sq)
        .flat_map(|i| (0..skv).map(move |j| u8::from((n.keep)(i + skv - sq, j))))
        .collect();
    let keep = Tensor::from_vec(keep, (sq, skv), &Device::Cpu)
        .unwrap()
        .broadcast_as((b, n.heads, sq, skv))
        .unwrap();
    let masked = Tensor::full(f32::NEG_INFINITY, (b, n.heads, sq, skv), &Device::Cpu).unwrap();
    let s = keep.where_cond(&s, &masked).unwrap();
    let p = attn::candle::nn::ops::softmax(&s, D::Minus1).unwrap();
    p.matmul(&v.contiguous().unwrap()).unwrap()
}

fn causal(i: usize, j: usize) -> bool {
    j <= i
}

fn window(i: usize, j: usize) -> bool {
    j <= i && i - j < 8
}

/// The forward and the three gradients of the loss `sum(out * w)` equal through both paths.
fn agree(spec: &str, n: &Naive, sq: usize, skv: usize) {
    let variant = attn::Variant::parse(spec).unwrap();
    let d = 32;
    let q = var(&[2, n.heads, sq, d], 1);
    let k = var(&[2, n.kv_heads, skv, d], 2);
    let v = var(&[2, n.kv_heads, skv, d], 3);
    let w = super::tensor(&[2, n.heads, sq, d], 4);
    let ours = attn::candle::attention(&variant, &q, &k, &v).unwrap();
    let theirs = naive_attention(n, &q, &k, &v);
    assert_close(&format!("{spec}: out"), &ours, &theirs, 1e-5, 1e-4);
    let ours = ours.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    let theirs = theirs
        .mul(&w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
        let (got, want) = (ours.get(x).unwrap(), theirs.get(x).unwrap());
        assert_close(&format!("{spec}: {name}"), got, want, 2e-5, 2e-4);
    }
}

#[test]
fn causal_attention_and_its_gradients_equal_candles_naive_attention() {
    let n = Naive {
        heads: 4,
        kv_heads: 4,
        keep: causal,
        softcap: None,
    };
    agree("heads = 4, head_dim = 32, mask = causal", &n, 40, 40);
    // Fewer queries than keys: the queries are the last ones.
    agree("heads = 4, head_dim = 32, mask = causal", &n, 7, 40);
}

#[test]
fn gqa_attention_and_its_gradients_equal_candles_naive_attention() {
    let n = Naive {
        heads: 8,
        kv_heads: 2,
        keep: causal,
        softcap: None,
    };
    agree(
        "heads = 8, kv_heads = 2, head_dim = 32, mask = causal",
        &n,
        33,
        33,
    );
    let mqa = Naive {
        heads: 4,
        kv_heads: 1,
        keep: |_, _| true,
        softcap: None,
    };
    agree("heads = 4, kv_heads = 1, head_dim = 32", &mqa, 20, 45);
}

#[test]
fn sliding_window_attention_and_its_gradients_equal_candles_naive_attention() {
    let n = Naive {
        heads: 4,
        kv_heads: 2,
        keep: window,
        softcap: None,
    };
    agree(
        "heads = 4, kv_heads = 2, head_dim = 32, mask = sliding_window(8)",
        &n,
        50,
        50,
    );
}

#[test]
fn softcap_attention_and_its_gradients_equal_candles_naive_attention() {
    let n = Naive {
        heads: 4,
        kv_heads: 4,
        keep: causal,
        softcap: Some(2.0),
    };
    agree(
        "heads = 4, head_dim = 32, mask = causal, softcap = 2.0",
        &n,
        30,
        30,
    );
}

#[test]
fn transposed_bshd_views_give_the_results_of_contiguous_inputs() {
    let variant =
        attn::Variant::parse("heads = 4, kv_heads = 2, head_dim = 32, mask = causal").unwrap();
    // [B, S, H, D] storage, read as [B, H, S, D] without a copy.
    let q = var(&[2, 24, 4, 32], 1);
    let k = var(&[2, 24, 2, 32], 2);
    let v = var(&[2, 24, 2, 32], 3);
    let (qt, kt, vt) = (
        q.transpose(1, 2).unwrap(),
        k.transpose(1, 2).unwrap(),
        v.transpose(1, 2).unwrap(),
    );
    assert!(!qt.is_contiguous());
    let strided = attn::candle::attention(&variant, &qt, &kt, &vt).unwrap();
    let (qc, kc, vc) = (
        qt.contiguous().unwrap(),
        kt.contiguous().unwrap(),
        vt.contiguous().unwrap(),
    );
    let contiguous = attn::candle::attention(&variant, &qc, &kc, &vc).unwrap();
    assert_close("out", &strided, &contiguous, 0.0, 0.0);
    // The gradients reach the BSHD variables, in their own layout.
    let grads = strided
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let dq = grads.get(&q).unwrap();
    assert_eq!(dq.dims(), &[2, 24, 4, 32]);
    let n = Naive {
        heads: 4,
        kv_heads: 2,
        keep: causal,
        softcap: None,
    };
    let naive = naive_attention(&n, &qt, &kt, &vt);
    let want = naive.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    assert_close("dq", dq, want.get(&q).unwrap(), 2e-5, 2e-4);
}
