//! Learnable tensors in the reference: the parameters a score modifier reads and the sink
//! logits, checked against the spec.
//!
//! Sinks (DESIGN.md "Semantics", gpt-oss): row `i` of head `h` gains a softmax column of logit
//! `sinks[h]` in scaled-score units, after every modifier, with no value: `lse` covers it, and
//! the row's weights sum to `1 - exp(sinks[h] - lse)`. Its gradient is
//! `d sinks[h] = -sum_rows exp(sinks[h] - lse_i) * rowsum(dout_i * out_i)`.

use crate::error::ReferenceError;
use crate::modifier::ParamValues;
use crate::spec::{AttentionSpec, SINKS_NAME, Sinks};

/// A spec's learnable tensors, each present once with the shape the spec gives it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Learned {
    /// The parameters the score modifier reads, in declaration order.
    pub params: Vec<ParamValues>,
    /// `sinks[h]`, when the spec has learned sinks.
    pub sinks: Option<Vec<f64>>,
}

impl Learned {
    /// Checks `given` against what `spec` declares: every declared tensor present once, with
    /// its shape, and nothing else.
    pub fn check(spec: &AttentionSpec, given: &[ParamValues]) -> Result<Learned, ReferenceError> {
        let wanted = spec.learnable_tensors();
        for t in given {
            if !wanted.iter().any(|(name, _)| *name == t.name) {
                let names: Vec<&str> = wanted.iter().map(|(n, _)| n.as_str()).collect();
                return Err(ReferenceError::Learned(format!(
                    "tensor `{}` is not a learnable tensor of this spec; it takes: {}",
                    t.name,
                    if names.is_empty() {
                        "none".to_string()
                    } else {
                        names.join(", ")
                    }
                )));
            }
            if t.values.len() != t.shape.iter().product::<usize>() {
                return Err(ReferenceError::Learned(format!(
                    "tensor `{}` has {} values for shape {:?}",
                    t.name,
                    t.values.len(),
                    t.shape
                )));
            }
        }
        let mut learned = Learned::default();
        for (name, shape) in wanted {
            let mut found = given.iter().filter(|t| t.name == name);
            let Some(t) = found.next() else {
                return Err(ReferenceError::Learned(format!(
                    "the spec reads a tensor `{name}` of shape {shape:?}, which is missing"
                )));
            };
            if found.next().is_some() {
                return Err(ReferenceError::Learned(format!(
                    "tensor `{name}` is given twice"
                )));
            }
            if t.shape != shape {
                return Err(ReferenceError::Learned(format!(
                    "tensor `{name}` has shape {:?}; the spec gives it shape {shape:?}",
                    t.shape
                )));
            }
            if name == SINKS_NAME && spec.sinks == Sinks::Learned {
                learned.sinks = Some(t.values.clone());
            } else {
                learned.params.push(t.clone());
            }
        }
        Ok(learned)
    }

    /// The sink logit of head `h`, if the spec has sinks.
    pub fn sink(&self, h: usize) -> Option<f64> {
        self.sinks.as_ref().map(|s| s[h])
    }
}
