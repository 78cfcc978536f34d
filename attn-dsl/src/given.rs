//! A call's learnable tensors matched to a spec: every tensor the spec takes
//! ([`AttentionSpec::learnable_tensors`], and with [`match_call`] its data tensors in the
//! call's shapes) given once, by name, with its shape, and nothing else. The reference, the runtime and the candle op each hold the tensors in their own type;
//! they all ask this one function, so they agree on what is accepted and on what the errors say.

use crate::data::{CallDims, call_shapes};
use crate::spec::AttentionSpec;
use std::fmt;

/// Why given learnable tensors do not match a spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// A tensor the spec does not take.
    Unexpected {
        /// Its name.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// What the spec takes, as `name [shape]` items (or `none`).
        takes: String,
    },
    /// A tensor the spec takes is not given.
    Missing {
        /// What it is: "learnable" or "data".
        kind: &'static str,
        /// Its name.
        name: String,
        /// The shape the spec gives it.
        shape: Vec<usize>,
        /// What the spec takes.
        takes: String,
    },
    /// A tensor is given more than once.
    Twice {
        /// What it is: "learnable" or "data".
        kind: &'static str,
        /// Its name.
        name: String,
    },
    /// A tensor's shape is not the spec's.
    Shape {
        /// What it is: "learnable" or "data".
        kind: &'static str,
        /// Its name.
        name: String,
        /// The shape given.
        found: Vec<usize>,
        /// The shape the spec gives it.
        expected: Vec<usize>,
    },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::Unexpected { name, shape, takes } => write!(
                f,
                "tensor `{name}` {shape:?} is not a learnable or data tensor of this spec; it \
                 takes: {takes}"
            ),
            Mismatch::Missing {
                kind,
                name,
                shape,
                takes,
            } => write!(
                f,
                "the spec reads a {kind} tensor `{name}` of shape {shape:?}, which is \
                 missing; it takes: {takes}"
            ),
            Mismatch::Twice { kind, name } => write!(f, "{kind} tensor `{name}` is given twice"),
            Mismatch::Shape {
                kind,
                name,
                found,
                expected,
            } => write!(
                f,
                "{kind} tensor `{name}` has shape {found:?}; the spec gives it shape \
                 {expected:?}"
            ),
        }
    }
}

impl std::error::Error for Mismatch {}

/// The positions in `given` (`(name, shape)` pairs) of the spec's learnable tensors, in the
/// spec's order: each declared parameter, then `sinks`.
pub fn match_learned(
    spec: &AttentionSpec,
    given: &[(&str, &[usize])],
) -> Result<Vec<usize>, Mismatch> {
    let wanted = spec
        .learnable_tensors()
        .into_iter()
        .map(|(n, s)| (n, s, "learnable"))
        .collect();
    match_wanted(wanted, given)
}

/// [`match_learned`] for a call that also gives the spec's data tensors (in the shapes `call`
/// gives them): the positions of the learnable tensors, then of the data tensors in
/// declaration order.
pub fn match_call(
    spec: &AttentionSpec,
    given: &[(&str, &[usize])],
    call: &CallDims,
) -> Result<Vec<usize>, Mismatch> {
    let learnable = spec
        .learnable_tensors()
        .into_iter()
        .map(|(n, s)| (n, s, "learnable"));
    let data = call_shapes(spec, call)
        .into_iter()
        .map(|(n, s)| (n, s, "data"));
    match_wanted(learnable.chain(data).collect(), given)
}

fn match_wanted(
    wanted: Vec<(String, Vec<usize>, &'static str)>,
    given: &[(&str, &[usize])],
) -> Result<Vec<usize>, Mismatch> {
    let takes = || {
        if wanted.is_empty() {
            return "none".to_string();
        }
        let items: Vec<String> = wanted
            .iter()
            .map(|(n, s, _)| format!("{n} {s:?}"))
            .collect();
        items.join(", ")
    };
    if let Some((name, shape)) = given
        .iter()
        .find(|(name, _)| !wanted.iter().any(|(w, _, _)| w == name))
    {
        return Err(Mismatch::Unexpected {
            name: name.to_string(),
            shape: shape.to_vec(),
            takes: takes(),
        });
    }
    let mut order = Vec::with_capacity(wanted.len());
    for (name, shape, kind) in &wanted {
        let mut found = given.iter().enumerate().filter(|(_, (n, _))| n == name);
        let Some((i, (_, found_shape))) = found.next() else {
            return Err(Mismatch::Missing {
                kind,
                name: name.clone(),
                shape: shape.clone(),
                takes: takes(),
            });
        };
        if found.next().is_some() {
            return Err(Mismatch::Twice {
                kind,
                name: name.clone(),
            });
        }
        if *found_shape != shape.as_slice() {
            return Err(Mismatch::Shape {
                kind,
                name: name.clone(),
                found: found_shape.to_vec(),
                expected: shape.clone(),
            });
        }
        order.push(i);
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    type Named<'a> = (&'a str, &'a [usize]);

    fn spec() -> AttentionSpec {
        "heads = 2, head_dim = 8, sinks = learned, params(rel: [heads, 4]), \
         score_mod = |s, b, h, q, k| s + rel[h, (q - k).max(0).min(3)]"
            .parse()
            .unwrap()
    }

    #[test]
    fn the_spec_order_is_returned_whatever_the_given_order() {
        let given: [(&str, &[usize]); 2] = [("sinks", &[2]), ("rel", &[2, 4])];
        assert_eq!(match_learned(&spec(), &given), Ok(vec![1, 0]));
    }

    #[test]
    fn each_mismatch_names_the_tensor() {
        let cases: [(&[Named], &str); 4] = [
            (
                &[("rel", &[2, 4]), ("sinks", &[2]), ("bias", &[3])],
                "tensor `bias` [3] is not a learnable or data tensor of this spec; it takes: rel \
                 [2, 4], sinks [2]",
            ),
            (
                &[("rel", &[2, 4])],
                "the spec reads a learnable tensor `sinks` of shape [2], which is missing",
            ),
            (
                &[("rel", &[2, 4]), ("rel", &[2, 4]), ("sinks", &[2])],
                "learnable tensor `rel` is given twice",
            ),
            (
                &[("rel", &[4, 2]), ("sinks", &[2])],
                "learnable tensor `rel` has shape [4, 2]; the spec gives it shape [2, 4]",
            ),
        ];
        for (given, says) in cases {
            let err = match_learned(&spec(), given).unwrap_err().to_string();
            assert!(err.starts_with(says), "{err}");
        }
        let plain: AttentionSpec = "heads = 2, head_dim = 8".parse().unwrap();
        let err = match_learned(&plain, &[("rel", &[1])]).unwrap_err();
        assert!(err.to_string().ends_with("it takes: none"), "{err}");
    }
}
