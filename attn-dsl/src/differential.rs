//! Differential heads (DIFF Transformer, Ye et al., 2024), `differential = lambda(init = L)`.
//!
//! The spec's query and key heads come in pairs: query heads `2h` and `2h + 1` are the two
//! components of differential head `h`, each attending with the spec's scores, mask and
//! normalizer over its own key head (the usual grouping of `heads` over `kv_heads`), and both
//! weighing the same values, value head `h / (heads / kv_heads)` of `kv_heads / 2`. The head's
//! output is `O_2h - lambda * O_2h+1` (`heads / 2` output heads), with
//! `lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + init`, the four vectors
//! learnable tensors of `head_dim` shared by every head (the paper's re-parameterisation).
//! The paper's per-head normalization of the output is the model's (docs/semantics.md).

use crate::spec::AttentionSpec;

/// The differential heads of a spec.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Differential {
    /// The constant added to the learned part of lambda (the paper's `lambda_init`, 0.8 for
    /// deep layers; `0.8 - 0.6 * exp(-0.3 * (layer - 1))` by depth).
    pub lambda_init: f64,
}

/// The names of the four learnable vectors of lambda, in the order
/// `exp(q1 . k1) - exp(q2 . k2)`.
pub const LAMBDA_NAMES: [&str; 4] = ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"];

impl Differential {
    /// The paper's constant for deep layers: `lambda_init = 0.8`.
    pub const PAPER: Differential = Differential { lambda_init: 0.8 };

    /// The paper's `lambda_init` for layer `layer` (from 1): `0.8 - 0.6 * exp(-0.3 * (layer - 1))`.
    pub fn by_depth(layer: u32) -> Differential {
        Differential {
            lambda_init: 0.8 - 0.6 * (-0.3 * (f64::from(layer) - 1.0)).exp(),
        }
    }

    /// lambda for the vectors `[q1, k1, q2, k2]`.
    pub fn lambda(&self, vectors: [&[f64]; 4]) -> f64 {
        let [q1, k1, q2, k2] = vectors;
        dot(q1, k1).exp() - dot(q2, k2).exp() + self.lambda_init
    }

    /// The gradients of lambda with respect to `[q1, k1, q2, k2]`:
    /// `exp(q1 . k1) k1`, `exp(q1 . k1) q1`, `-exp(q2 . k2) k2`, `-exp(q2 . k2) q2`.
    pub fn lambda_gradients(&self, vectors: [&[f64]; 4]) -> [Vec<f64>; 4] {
        let [q1, k1, q2, k2] = vectors;
        let (e1, e2) = (dot(q1, k1).exp(), dot(q2, k2).exp());
        let scaled = |x: &[f64], by: f64| x.iter().map(|v| v * by).collect::<Vec<f64>>();
        [
            scaled(k1, e1),
            scaled(q1, e1),
            scaled(k2, -e2),
            scaled(q2, -e2),
        ]
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

impl AttentionSpec {
    /// The spec of the component heads of a differential spec: itself without
    /// `differential`, whose `heads` query heads attend over `kv_heads` key heads and as many
    /// value heads (each value head of the differential spec given twice).
    pub fn differential_components(&self) -> AttentionSpec {
        AttentionSpec {
            differential: None,
            ..self.clone()
        }
    }

    /// The heads of the output: `heads / 2` with differential heads, else `heads`.
    pub fn output_heads(&self) -> u32 {
        match self.differential {
            Some(_) => self.heads / 2,
            None => self.heads,
        }
    }

    /// The heads of the values: `kv_heads / 2` with differential heads, else `kv_heads`.
    pub fn value_heads(&self) -> u32 {
        match self.differential {
            Some(_) => self.kv_heads() / 2,
            None => self.kv_heads(),
        }
    }

    /// The learnable vectors of lambda, `(name, [head_dim])`, with differential heads.
    pub fn lambda_tensors(&self) -> Vec<(String, Vec<usize>)> {
        match self.differential {
            Some(_) => LAMBDA_NAMES
                .iter()
                .map(|n| (n.to_string(), vec![self.head_dim as usize]))
                .collect(),
            None => Vec::new(),
        }
    }
}
