//! Tensors across the boundary: candle's CPU storage (any strides) into attn's tensors, and
//! attn's outputs into candle storage without a copy.

use crate::DType;
use crate::runtime::{Storage, Tensor as AttnTensor};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, WithDType};
use half::{bf16, f16};

/// candle's name for an attn dtype.
pub(super) fn candle_dtype(dtype: DType) -> candle_core::DType {
    match dtype {
        DType::F32 => candle_core::DType::F32,
        DType::F16 => candle_core::DType::F16,
        DType::Bf16 => candle_core::DType::BF16,
    }
}

/// A rank-4 candle tensor's elements in logical order, as an attn tensor: one copy, whole rows
/// at a time where the last dimension is contiguous. The storage's dtype was checked already.
pub(super) fn to_attn(storage: &CpuStorage, layout: &Layout) -> candle_core::Result<AttnTensor> {
    let dims = layout.dims();
    let n = layout.shape().elem_count();
    let converted = match storage {
        // f32 copies go into buffers from attn's pool, to which f32 tensors return when
        // dropped: a training loop then copies into memory that is already mapped.
        CpuStorage::F32(_) => {
            let into = crate::runtime::memory::with_capacity(n);
            AttnTensor::from_f32(dims, gather::<f32>(storage, layout, into)?)
        }
        CpuStorage::F16(_) => {
            AttnTensor::from_f16(dims, gather::<f16>(storage, layout, Vec::with_capacity(n))?)
        }
        CpuStorage::BF16(_) => AttnTensor::from_bf16(
            dims,
            gather::<bf16>(storage, layout, Vec::with_capacity(n))?,
        ),
        other => {
            return Err(candle_core::Error::Msg(format!(
                "attn takes f32, f16 or bf16 tensors, not {:?}",
                other.dtype()
            )));
        }
    };
    converted.map_err(candle_core::Error::wrap)
}

/// The elements of a rank-4 view in logical order, appended to `out` (empty).
fn gather<T: WithDType>(
    storage: &CpuStorage,
    layout: &Layout,
    mut out: Vec<T>,
) -> candle_core::Result<Vec<T>> {
    let data = storage.as_slice::<T>()?;
    if let Some((start, end)) = layout.contiguous_offsets() {
        out.extend_from_slice(&data[start..end]);
        return Ok(out);
    }
    let (dims, strides) = (layout.dims(), layout.stride());
    let &[d0, d1, d2, d3] = dims else {
        return Err(candle_core::Error::Msg(format!(
            "attn takes rank-4 tensors, found shape {dims:?}"
        )));
    };
    for i0 in 0..d0 {
        for i1 in 0..d1 {
            for i2 in 0..d2 {
                let row =
                    layout.start_offset() + i0 * strides[0] + i1 * strides[1] + i2 * strides[2];
                if strides[3] == 1 {
                    out.extend_from_slice(&data[row..row + d3]);
                } else {
                    out.extend((0..d3).map(|i3| data[row + i3 * strides[3]]));
                }
            }
        }
    }
    Ok(out)
}

/// An attn tensor's elements as candle storage, taking the buffer when the tensor is its only,
/// contiguous view.
pub(super) fn to_candle(t: AttnTensor) -> CpuStorage {
    let mut storage = t.into_storage();
    match &mut storage {
        Storage::F32(v) => CpuStorage::F32(std::mem::take(v).into_vec()),
        Storage::F16(v) => CpuStorage::F16(std::mem::take(v).into_vec()),
        Storage::Bf16(v) => CpuStorage::BF16(std::mem::take(v).into_vec()),
    }
}
