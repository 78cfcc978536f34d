//! The pieces of a decoder layer on f32 rows: linear maps (the `gemm` crate), norms and MLPs.

use super::config::{MlpKind, NormKind};
use crate::cpu::gemm;

/// `y = x W^T (+ b)` with `W [out, in]` row-major (the PyTorch / safetensors layout).
#[derive(Clone, Debug)]
pub(crate) struct Linear {
    pub w: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    pub out: usize,
    pub inp: usize,
}

/// `rows x out` outputs `x W^T` for `rows x inp` inputs and `W [out, inp]`.
pub(crate) fn matmul_t(w: &[f32], out: usize, inp: usize, x: &[f32], rows: usize) -> Vec<f32> {
    let mut y = vec![0f32; rows * out];
    gemm(rows, inp, out, x, (inp, 1), w, (1, inp), &mut y, out);
    y
}

impl Linear {
    /// `rows x out` outputs for `rows x inp` inputs.
    pub fn apply(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut y = matmul_t(&self.w, self.out, self.inp, x, rows);
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(self.out) {
                for (v, b) in row.iter_mut().zip(b) {
                    *v += b;
                }
            }
        }
        y
    }
}

/// A norm over rows of `weight.len()` values.
#[derive(Clone, Debug)]
pub(crate) struct Norm {
    pub kind: NormKind,
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    pub eps: f64,
}

impl Norm {
    /// The normalized rows (statistics in f64, like the references).
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        let n = self.weight.len();
        let mut y = vec![0f32; x.len()];
        for (src, dst) in x.chunks_exact(n).zip(y.chunks_exact_mut(n)) {
            let (mean, centered) = match self.kind {
                NormKind::Rms => (0.0, false),
                NormKind::Layer => (
                    src.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64,
                    true,
                ),
            };
            let var = src
                .iter()
                .map(|&v| (f64::from(v) - mean).powi(2))
                .sum::<f64>()
                / n as f64;
            let inv = 1.0 / (var + self.eps).sqrt();
            for (i, (d, &s)) in dst.iter_mut().zip(src).enumerate() {
                let v = if centered {
                    f64::from(s) - mean
                } else {
                    f64::from(s)
                };
                let b = self.bias.as_ref().map_or(0.0, |b| f64::from(b[i]));
                *d = (v * inv * f64::from(self.weight[i]) + b) as f32;
            }
        }
        y
    }
}

/// An MLP block.
#[derive(Clone, Debug)]
pub(crate) struct Mlp {
    pub kind: MlpKind,
    /// SwiGLU's gate projection.
    pub gate: Option<Linear>,
    pub up: Linear,
    pub down: Linear,
}

impl Mlp {
    pub fn apply(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut h = self.up.apply(x, rows);
        match (self.kind, &self.gate) {
            (MlpKind::SwiGlu, Some(gate)) => {
                let g = gate.apply(x, rows);
                for (h, g) in h.iter_mut().zip(g) {
                    *h *= g / (1.0 + (-g).exp());
                }
            }
            _ => {
                for h in h.iter_mut() {
                    let x = *h;
                    let inner = 0.797_884_6 * (x + 0.044_715 * x * x * x);
                    *h = 0.5 * x * (1.0 + inner.tanh());
                }
            }
        }
        self.down.apply(&h, rows)
    }
}
