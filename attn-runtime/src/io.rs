//! Reading and writing tensors in safetensors files.

use crate::error::RuntimeError;
use crate::tensor::{Storage, Tensor};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

/// The named tensors of a safetensors file, in order (f32, f16 and bf16). A missing tensor or
/// one of another dtype is an error naming it; other tensors in the file are ignored.
pub fn read_safetensors(path: &Path, names: &[&str]) -> Result<Vec<Tensor>, RuntimeError> {
    let shown = path.display().to_string();
    let io = |message: String| RuntimeError::Io {
        path: shown.clone(),
        message,
    };
    // The file is read whole, then its tensors converted: it must fit about twice over.
    let size = std::fs::metadata(path)
        .map_err(|e| io(e.to_string()))?
        .len();
    crate::memory::ensure_fits(&format!("reading {shown}"), size.checked_mul(2))?;
    let bytes = std::fs::read(path).map_err(|e| io(e.to_string()))?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| io(format!("not a valid safetensors file: {e}")))?;
    names
        .iter()
        .map(|&name| {
            let view = file.tensor(name).map_err(|_| {
                let mut available = file.names();
                available.sort();
                RuntimeError::Missing {
                    path: shown.clone(),
                    tensor: name.to_string(),
                    available: available.join(", "),
                }
            })?;
            let (data, shape) = (view.data(), view.shape());
            match view.dtype() {
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
            let (dtype, bytes) = match t.contiguous_storage() {
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
