//! Learnable tensors in the reference: the parameters a score modifier reads and the sink
//! logits, checked against the spec.
//!
//! Sinks (docs/semantics.md, "Learnable tensors"; gpt-oss): row `i` of head `h` gains a softmax column of logit
//! `sinks[h]` in scaled-score units, after every modifier, with no value: `lse` covers it, and
//! the row's weights sum to `1 - exp(sinks[h] - lse)`. Its gradient is
//! `d sinks[h] = -sum_rows exp(sinks[h] - lse_i) * rowsum(dout_i * out_i)`.

use crate::error::ReferenceError;
use crate::given::match_learned;
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
        let learned = |e: String| ReferenceError::Learned(e);
        if let Some(t) = given
            .iter()
            .find(|t| t.values.len() != t.shape.iter().product::<usize>())
        {
            return Err(learned(format!(
                "tensor `{}` has {} values for shape {:?}",
                t.name,
                t.values.len(),
                t.shape
            )));
        }
        let named: Vec<(&str, &[usize])> = given
            .iter()
            .map(|t| (t.name.as_str(), t.shape.as_slice()))
            .collect();
        let order = match_learned(spec, &named).map_err(|e| learned(e.to_string()))?;
        let mut out = Learned::default();
        for i in order {
            let t = &given[i];
            if t.name == SINKS_NAME && spec.sinks == Sinks::Learned {
                out.sinks = Some(t.values.clone());
            } else {
                out.params.push(t.clone());
            }
        }
        Ok(out)
    }

    /// The sink logit of head `h`, if the spec has sinks.
    pub fn sink(&self, h: usize) -> Option<f64> {
        self.sinks.as_ref().map(|s| s[h])
    }
}
