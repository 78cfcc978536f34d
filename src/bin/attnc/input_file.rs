//! What `attnc run` and `attnc grad` read from their input file besides q, k and v: a
//! variable-length batch's offsets, the spec's learnable tensors and its data tensors.

use attn::AttentionSpec;
use attn::runtime::io::{read_data, read_i32, read_safetensors, tensor_names};
use attn::runtime::learned::DataBuf;
use attn::runtime::{RuntimeError, Tensor};
use std::path::Path;

/// Tensors by name.
pub type Named = Vec<(String, Tensor)>;

/// The cumulative offsets of a variable-length batch, when the input has them
/// (`cu_seqlens_q` and `cu_seqlens_k`; one without the other is an error).
pub fn read_cu_seqlens(
    input: &Path,
    spec: &AttentionSpec,
) -> Result<Option<[Vec<i32>; 2]>, RuntimeError> {
    let names = tensor_names(input)?;
    let has = |n: &str| names.iter().any(|m| m == n);
    match (has("cu_seqlens_q"), has("cu_seqlens_k")) {
        (false, false) => Ok(None),
        (true, true) if spec.mla().is_some() => Err(RuntimeError::Spec(
            "the input has cu_seqlens_q and cu_seqlens_k, and variable-length batches take              per-head specs; this one is MLA"
                .into(),
        )),
        (true, true) => Ok(Some([
            read_i32(input, "cu_seqlens_q")?,
            read_i32(input, "cu_seqlens_k")?,
        ])),
        (q, _) => Err(RuntimeError::Data(format!(
            "the input has {} but not {}; a variable-length batch takes both",
            if q { "cu_seqlens_q" } else { "cu_seqlens_k" },
            if q { "cu_seqlens_k" } else { "cu_seqlens_q" },
        ))),
    }
}

/// The tensors `names` of `input`, and the spec's learnable tensors (its parameters by their
/// names, and `sinks`) by name.
pub fn read_with_learned(
    input: &Path,
    spec: &AttentionSpec,
    names: &[&str],
) -> Result<(Vec<Tensor>, Named), RuntimeError> {
    let learned_names: Vec<String> = spec
        .learnable_tensors()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let all: Vec<&str> = names
        .iter()
        .copied()
        .chain(learned_names.iter().map(String::as_str))
        .collect();
    let mut tensors = read_safetensors(input, &all)?;
    let learned = tensors.split_off(names.len());
    Ok((tensors, learned_names.into_iter().zip(learned).collect()))
}

/// The spec's data tensors (`data(...)`) from `input`, by name, each stored as the type it is
/// declared.
pub fn read_data_tensors(
    input: &Path,
    spec: &AttentionSpec,
) -> Result<Vec<(String, DataBuf)>, RuntimeError> {
    spec.data
        .iter()
        .map(|d| Ok((d.name.clone(), read_data(input, &d.name, d.dtype)?)))
        .collect()
}
