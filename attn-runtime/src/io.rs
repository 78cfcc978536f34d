//! Reading and writing tensors in safetensors files.

use crate::error::RuntimeError;
use crate::tensor::{Storage, Tensor};
use half::{bf16, f16};
use safetensors::Dtype;
use safetensors::tensor::Metadata;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// Largest safetensors header read (the safetensors crate's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// An open safetensors file with its parsed header.
struct Opened {
    file: std::fs::File,
    size: u64,
    metadata: Metadata,
    /// Where the tensor data begins.
    data_start: u64,
}

/// Opens a safetensors file (a regular file only) and reads its header.
fn open(path: &Path) -> Result<Opened, RuntimeError> {
    let io = |message: String| RuntimeError::Io {
        path: path.display().to_string(),
        message,
    };
    let mut file = crate::files::open_regular(path)?;
    let size = file.metadata().map_err(|e| io(e.to_string()))?.len();
    let mut word = [0u8; 8];
    file.read_exact(&mut word)
        .map_err(|e| io(format!("not a valid safetensors file: {e}")))?;
    let header_len = u64::from_le_bytes(word);
    if header_len > MAX_HEADER_BYTES.min(size.saturating_sub(8)) {
        return Err(io(format!(
            "not a valid safetensors file: a header of {header_len} bytes in a file of {size}"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .map_err(|e| io(format!("not a valid safetensors file: {e}")))?;
    // Deserializing validates the offsets: contiguous, each tensor's size matching its shape.
    let metadata: Metadata = serde_json::from_slice(&header)
        .map_err(|e| io(format!("not a valid safetensors file: {e}")))?;
    Ok(Opened {
        file,
        size,
        metadata,
        data_start: 8 + header_len,
    })
}

/// The names of the tensors in a safetensors file, sorted; only its header is read.
pub fn tensor_names(path: &Path) -> Result<Vec<String>, RuntimeError> {
    let mut names: Vec<String> = open(path)?.metadata.tensors().into_keys().collect();
    names.sort();
    Ok(names)
}

/// Most names an error lists of a file's tensors.
const NAMES_SHOWN: usize = 8;

/// Up to [`NAMES_SHOWN`] of `available` in words, those sharing the longest prefix with
/// `missing` first, and how many there are in all: a checkpoint may hold 10^5 tensors.
fn some_names(missing: &str, mut available: Vec<String>) -> String {
    let shared = |name: &str| {
        name.bytes()
            .zip(missing.bytes())
            .take_while(|(a, b)| a == b)
            .count()
    };
    available.sort_by(|a, b| shared(b).cmp(&shared(a)).then_with(|| a.cmp(b)));
    let total = available.len();
    let mut shown = available
        .iter()
        .take(NAMES_SHOWN)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if total > NAMES_SHOWN {
        shown += &format!(", ... ({total} tensors in all)");
    }
    shown
}

/// The named tensors of a safetensors file, in order (f32, f16 and bf16). A missing tensor or
/// one of another dtype is an error naming it; other tensors in the file are ignored. Only the
/// header and the named tensors' bytes are read, one tensor at a time, so a checkpoint's weights
/// take their own size in memory and no more.
pub fn read_safetensors(path: &Path, names: &[&str]) -> Result<Vec<Tensor>, RuntimeError> {
    let io = |message: String| RuntimeError::Io {
        path: path.display().to_string(),
        message,
    };
    read_raw(path, names)?
        .into_iter()
        .zip(names)
        .map(|(raw, name)| {
            let (shape, data) = (&raw.shape, &raw.data);
            match raw.dtype {
                Dtype::F32 => Tensor::from_f32(shape, le(data, f32::from_le_bytes)),
                Dtype::F16 => Tensor::from_f16(shape, le(data, f16::from_le_bytes)),
                Dtype::BF16 => Tensor::from_bf16(shape, le(data, bf16::from_le_bytes)),
                other => {
                    return Err(io(format!(
                        "tensor `{name}` is {other:?}; supported: F32, F16, BF16"
                    )));
                }
            }
            .map_err(|e| io(format!("tensor `{name}`: {e}")))
        })
        .collect()
}

/// The one-dimensional i32 tensor `name` of a safetensors file (offsets such as
/// `cu_seqlens_q`); another dtype or rank is an error naming it.
pub fn read_i32(path: &Path, name: &str) -> Result<Vec<i32>, RuntimeError> {
    let raw = read_raw(path, &[name])?.remove(0);
    let io = |message: String| RuntimeError::Io {
        path: path.display().to_string(),
        message,
    };
    if raw.dtype != Dtype::I32 || raw.shape.len() != 1 {
        return Err(io(format!(
            "tensor `{name}` is {:?} of shape {:?}; expected I32 of one dimension",
            raw.dtype, raw.shape
        )));
    }
    Ok(le(&raw.data, i32::from_le_bytes))
}

/// The data tensor `name` of a safetensors file, stored as the type `dtype` its declaration
/// names (i32 as I32, f32 as F32); another dtype is an error naming it.
pub fn read_data(
    path: &Path,
    name: &str,
    dtype: attn_dsl::DataType,
) -> Result<crate::learned::DataBuf, RuntimeError> {
    let raw = read_raw(path, &[name])?.remove(0);
    let values = match (dtype, raw.dtype) {
        (attn_dsl::DataType::I32, Dtype::I32) => {
            crate::learned::DataVec::I32(le(&raw.data, i32::from_le_bytes))
        }
        (attn_dsl::DataType::F32, Dtype::F32) => {
            crate::learned::DataVec::F32(le(&raw.data, f32::from_le_bytes))
        }
        (want, found) => {
            return Err(RuntimeError::Io {
                path: path.display().to_string(),
                message: format!(
                    "data tensor `{name}` is stored as {found:?}; the spec declares it {}, stored \
                     as {}",
                    want.name(),
                    want.name().to_uppercase()
                ),
            });
        }
    };
    Ok(crate::learned::DataBuf {
        shape: raw.shape,
        values,
    })
}

/// A tensor as stored: its dtype, shape and little-endian bytes.
#[derive(Debug)]
pub(crate) struct RawTensor {
    /// The stored dtype.
    pub(crate) dtype: Dtype,
    /// Its shape.
    pub(crate) shape: Vec<usize>,
    /// Its bytes (`shape`'s product times the dtype's size, as the header was checked).
    pub(crate) data: Vec<u8>,
}

/// The named tensors of a safetensors file as stored, in order, whatever their dtype (packed
/// quantized weights are `U8`): what [`read_safetensors`] reads, before any conversion.
pub(crate) fn read_raw(path: &Path, names: &[&str]) -> Result<Vec<RawTensor>, RuntimeError> {
    let shown = path.display().to_string();
    let io = |message: String| RuntimeError::Io {
        path: shown.clone(),
        message,
    };
    let Opened {
        mut file,
        size,
        metadata,
        data_start,
    } = open(path)?;
    let infos = names
        .iter()
        .map(|&name| {
            metadata.info(name).ok_or_else(|| RuntimeError::Missing {
                path: shown.clone(),
                tensor: name.to_string(),
                available: some_names(name, metadata.tensors().into_keys().collect()),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let data_end = infos
        .iter()
        .map(|i| i.data_offsets.1 as u64)
        .max()
        .unwrap_or(0);
    if data_start.saturating_add(data_end) > size {
        return Err(io(format!(
            "not a valid safetensors file: its tensors end at byte {}, past its {size} bytes",
            data_start.saturating_add(data_end)
        )));
    }
    let wanted = infos
        .iter()
        .map(|i| (i.data_offsets.1 - i.data_offsets.0) as u64)
        .sum();
    crate::memory::ensure_fits(&format!("the tensors of {shown}"), Some(wanted))?;
    names
        .iter()
        .zip(infos)
        .map(|(&name, info)| {
            let (begin, end) = info.data_offsets;
            let mut data = vec![0u8; end - begin];
            file.seek(SeekFrom::Start(data_start + begin as u64))
                .and_then(|_| file.read_exact(&mut data))
                .map_err(|e| io(format!("tensor `{name}`: {e}")))?;
            Ok(RawTensor {
                dtype: info.dtype,
                shape: info.shape.clone(),
                data,
            })
        })
        .collect()
}

fn le<T, const N: usize>(bytes: &[u8], from: fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| from(c.try_into().expect("chunks_exact gives N bytes")))
        .collect()
}

/// Writes tensors (contiguous, in their dtype) to a safetensors file.
pub fn write_safetensors(path: &Path, tensors: &[(&str, &Tensor)]) -> Result<(), RuntimeError> {
    let buffers: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, t)| {
            let (dtype, bytes) = match &t.contiguous_storage() {
                Storage::F32(v) => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
                Storage::F16(v) => (Dtype::F16, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
                Storage::Bf16(v) => (
                    Dtype::BF16,
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                ),
            };
            (name.to_string(), dtype, t.shape().to_vec(), bytes)
        })
        .collect();
    let shown = path.display().to_string();
    let err = |message: String| RuntimeError::Io {
        path: shown.clone(),
        message,
    };
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = buffers
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| err(format!("tensor `{name}`: {e}")))
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_tensor_lists_a_few_names_nearest_first_and_the_count() {
        let names: Vec<String> = (0..200_000)
            .map(|i| format!("model.layers.{i}.mlp.weight"))
            .chain(["lm_head.weight".to_string()])
            .collect();
        let listed = some_names("lm_head.bias", names);
        assert!(listed.starts_with("lm_head.weight, "), "{listed}");
        assert!(listed.ends_with("... (200001 tensors in all)"), "{listed}");
        assert_eq!(listed.matches(", ").count(), NAMES_SHOWN);
        assert_eq!(some_names("x", vec!["b".into(), "a".into()]), "a, b");
    }
}
