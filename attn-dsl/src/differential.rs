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

use crate::spec::{AttentionSpec, LAMBDA_NAMES};

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
