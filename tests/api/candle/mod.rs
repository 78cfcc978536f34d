//! `attn::candle`: attention as a candle op, forward and backward through candle's autograd
//! (feature `candle`). Gradients are compared with PyTorch's float64 autograd (the golden
//! gradient fixtures), with candle's own naive attention, and with finite differences; one
//! AdamW step of a small model is compared with the same model on naive attention; bad input
//! gives errors, never panics.
#![cfg(feature = "candle")]

mod adamw;
mod bad_input;
mod data;
mod finite_difference;
mod golden;
mod model;
mod naive;
mod varlen;

use attn::candle::core::{Device, Tensor, Var};

/// A variable of deterministic test values in `[-1, 1)`.
fn var(dims: &[usize], seed: u64) -> Var {
    Var::from_tensor(&tensor(dims, seed)).unwrap()
}

/// A tensor of deterministic test values in `[-1, 1)`.
fn tensor(dims: &[usize], seed: u64) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(attn::inputs::values(n, seed), dims, &Device::Cpu).unwrap()
}

/// A tensor's values as f64, in logical order.
fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(attn::candle::core::DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// Asserts `got` within `abs + rel * |want|` of `want`, element by element.
fn assert_close(what: &str, got: &Tensor, want: &Tensor, abs: f64, rel: f64) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    for (i, (g, w)) in values(got).iter().zip(values(want)).enumerate() {
        assert!(
            (g - w).abs() <= abs + rel * w.abs(),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}
