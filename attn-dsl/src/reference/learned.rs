//! Learnable tensors in the reference: the parameters a score modifier reads and the sink
//! logits, checked against the spec.
//!
//! Sinks (docs/semantics.md, "Learnable tensors"; gpt-oss): row `i` of head `h` gains a softmax column of logit
//! `sinks[h]` in scaled-score units, after every modifier, with no value: `lse` covers it, and
//! the row's weights sum to `1 - exp(sinks[h] - lse)`. Its gradient is
//! `d sinks[h] = -sum_rows exp(sinks[h] - lse_i) * rowsum(dout_i * out_i)`.

use crate::data::{CallDims, check_reads};
use crate::error::ReferenceError;
use crate::given::match_call;
use crate::modifier::ParamValues;
use crate::spec::{AttentionSpec, DataType, SINKS_NAME, Sinks};

/// A spec's learnable tensors and a call's data tensors, each present once with the shape the
/// spec gives it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Learned {
    /// The parameters the score modifier reads, in declaration order, then the data tensors
    /// (the modifiers read both by name).
    pub params: Vec<ParamValues>,
    /// `sinks[h]`, when the spec has learned sinks.
    pub sinks: Option<Vec<f64>>,
}

impl Learned {
    /// Checks `given` against what `spec` declares for a call of shape `call`: every declared
    /// tensor present once, with its shape, i32 data holding integers in i32's range, every
    /// read of a data tensor in range, and nothing else.
    pub fn check(
        spec: &AttentionSpec,
        given: &[ParamValues],
        call: &CallDims,
    ) -> Result<Learned, ReferenceError> {
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
        let order = match_call(spec, &named, call).map_err(|e| learned(e.to_string()))?;
        let mut out = Learned::default();
        for i in order {
            let t = &given[i];
            if t.name == SINKS_NAME && spec.sinks == Sinks::Learned {
                out.sinks = Some(t.values.clone());
            } else {
                out.params.push(t.clone());
            }
        }
        for decl in spec.data.iter().filter(|d| d.dtype == DataType::I32) {
            let t = out.params.iter().find(|t| t.name == decl.name);
            let bad = t.and_then(|t| {
                t.values.iter().find(|x| {
                    x.fract() != 0.0 || !(f64::from(i32::MIN)..=f64::from(i32::MAX)).contains(x)
                })
            });
            if let Some(x) = bad {
                return Err(learned(format!(
                    "data tensor `{}` is i32, and holds {x}",
                    decl.name
                )));
            }
        }
        check_reads(spec, call).map_err(learned)?;
        Ok(out)
    }

    /// The sink logit of head `h`, if the spec has sinks.
    pub fn sink(&self, h: usize) -> Option<f64> {
        self.sinks.as_ref().map(|s| s[h])
    }
}
