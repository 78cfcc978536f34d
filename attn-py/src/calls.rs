//! The op's two calls, forward and backward, on attn's CPU kernels: torch tensors read in place,
//! the GIL released while the kernels run, outputs handed back as DLPack capsules.

use crate::dlpack::capsule;
use crate::error::{from_runtime, refuse};
use crate::torch_memory::{Element, TorchTensor};
use crate::variant::planned;
use attn::runtime::buffer::Buffer;
use attn::runtime::learned::{Data, DataValues};
use attn::runtime::varlen::{Varlen, VarlenSaved};
use attn::{
    Backend, BackwardInputs, CpuBackend, HeadGradients, HeadsBackward, Inputs, Learned, Output,
    Tensor, Variant,
};
use pyo3::prelude::*;
use std::sync::Arc;

/// Tensors given by name from Python.
pub(crate) type Named<'py> = Vec<(String, Bound<'py, PyAny>)>;

/// A call's learnable tensors (read in place) and data tensors (their values in place).
pub(crate) struct CallTensors {
    learned: Vec<(String, Tensor)>,
    data: Vec<(String, Vec<usize>, DataBuffer)>,
}

/// A call's learnable tensors and data tensors as views by name.
pub(crate) type Views<'a> = (Vec<(&'a str, &'a Tensor)>, Vec<(&'a str, Data<'a>)>);

/// A data tensor's values.
enum DataBuffer {
    I32(Buffer<i32>),
    F32(Buffer<f32>),
}

impl CallTensors {
    /// Reads `params` (float32, any strides) and `data` (contiguous, of the types the spec
    /// declares) in place.
    pub(crate) fn read(
        py: Python<'_>,
        variant: &Variant,
        params: &Named,
        data: &Named,
    ) -> PyResult<CallTensors> {
        let mut learned = Vec::with_capacity(params.len());
        for (name, obj) in params {
            let t = TorchTensor::read(obj, name)?;
            if t.element != Some(Element::F32) {
                return Err(refuse(format!(
                    "learnable tensor `{name}` is {}; learnable tensors are torch.float32",
                    t.dtype_name
                )));
            }
            learned.push((name.clone(), t.attn_tensor(py)?));
        }
        let mut read_data = Vec::with_capacity(data.len());
        for (name, obj) in data {
            let t = TorchTensor::read(obj, name)?;
            let declared = variant.spec().data_decl(name).map(|d| d.dtype);
            let values = match declared {
                Some(attn::dsl::DataType::F32) => DataBuffer::F32(t.values(py, Element::F32)?),
                // Undeclared names are refused by the runtime, which lists the declared ones.
                _ => DataBuffer::I32(t.i32_values(py)?),
            };
            read_data.push((name.clone(), t.shape.clone(), values));
        }
        Ok(CallTensors {
            learned,
            data: read_data,
        })
    }

    /// The tensors as the runtime's [`Learned`] takes them.
    pub(crate) fn views(&self) -> Views<'_> {
        let learned = self.learned.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let data = self
            .data
            .iter()
            .map(|(n, shape, values)| {
                let values = match values {
                    DataBuffer::I32(v) => DataValues::I32(v),
                    DataBuffer::F32(v) => DataValues::F32(v),
                };
                (n.as_str(), Data { shape, values })
            })
            .collect();
        (learned, data)
    }
}

/// A variable-length batch's offsets, both or neither.
fn offsets(
    cu_seqlens_q: Option<Vec<i32>>,
    cu_seqlens_k: Option<Vec<i32>>,
) -> PyResult<Option<(Vec<i32>, Vec<i32>)>> {
    match (cu_seqlens_q, cu_seqlens_k) {
        (Some(q), Some(k)) => Ok(Some((q, k))),
        (None, None) => Ok(None),
        _ => Err(refuse(
            "`cu_seqlens_q` and `cu_seqlens_k` go together: give both or neither",
        )),
    }
}

/// The checked variant of a call: refused for MLA, whose five inputs `attention_mla` takes.
pub(crate) fn per_head_variant(spec: &str) -> PyResult<Arc<Variant>> {
    let variant = planned(spec)?;
    if variant.spec().mla().is_some() {
        return Err(refuse(format!(
            "spec `{}` is MLA: its five inputs go to attn.attention_mla",
            variant.text()
        )));
    }
    Ok(variant)
}

/// A tensor's storage, contiguous, as a DLPack capsule with its shape.
pub(crate) fn export(py: Python<'_>, t: Tensor) -> PyResult<Py<PyAny>> {
    let shape = t.shape().to_vec();
    capsule(py, t.into_storage(), &shape)
}

/// The forward of attention: `(out, lse)` as DLPack capsules. q, k and v are
/// `[B, H, S, D]` (or, with `cu_seqlens_*`, packed `[total, H, D]`) in the spec's dtype.
#[pyfunction]
#[pyo3(signature = (spec, q, k, v, position_offset, params, data, cu_seqlens_q, cu_seqlens_k))]
#[allow(clippy::too_many_arguments)]
pub fn forward(
    py: Python<'_>,
    spec: &str,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    position_offset: i64,
    params: Named,
    data: Named,
    cu_seqlens_q: Option<Vec<i32>>,
    cu_seqlens_k: Option<Vec<i32>>,
) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    let variant = per_head_variant(spec)?;
    let [q, k, v] = [(q, "q"), (k, "k"), (v, "v")]
        .map(|(t, name)| TorchTensor::read(t, name).and_then(|t| t.attn_tensor(py)));
    let (q, k, v) = (q?, k?, v?);
    let tensors = CallTensors::read(py, &variant, &params, &data)?;
    let cu = offsets(cu_seqlens_q, cu_seqlens_k)?;
    let output: Output = py
        .detach(|| {
            let (learned, data) = tensors.views();
            let learned = Learned::new(&learned).with_data(&data);
            let backend = CpuBackend::new();
            match &cu {
                None => backend.forward_learned(
                    &variant,
                    Inputs::heads(&q, &k, &v),
                    position_offset,
                    learned,
                ),
                Some((cq, ck)) => backend.forward_varlen(
                    &variant,
                    Varlen {
                        q: &q,
                        k: &k,
                        v: &v,
                        cu_seqlens_q: cq,
                        cu_seqlens_k: ck,
                    },
                    position_offset,
                    learned,
                ),
            }
        })
        .map_err(from_runtime)?;
    Ok((export(py, output.out)?, export(py, output.lse)?))
}

/// The gradients of [`forward`] for `dout`: `(dq, dk, dv, [(name, d<name>)])` as DLPack
/// capsules, the last for each learnable tensor and each float32 data tensor. `out` and `lse`
/// are the forward's (the lse carries no gradient: the op marks it non-differentiable).
#[pyfunction]
#[pyo3(signature = (spec, q, k, v, out, lse, dout, position_offset, params, data,
                    cu_seqlens_q, cu_seqlens_k))]
#[allow(clippy::too_many_arguments)]
pub fn backward(
    py: Python<'_>,
    spec: &str,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    lse: &Bound<'_, PyAny>,
    dout: &Bound<'_, PyAny>,
    position_offset: i64,
    params: Named,
    data: Named,
    cu_seqlens_q: Option<Vec<i32>>,
    cu_seqlens_k: Option<Vec<i32>>,
) -> PyResult<GradientCapsules> {
    let variant = per_head_variant(spec)?;
    let read = |t: &Bound<'_, PyAny>, name: &str| TorchTensor::read(t, name)?.attn_tensor(py);
    let (q, k, v) = (read(q, "q")?, read(k, "k")?, read(v, "v")?);
    let (out, lse, dout) = (read(out, "out")?, read(lse, "lse")?, read(dout, "dout")?);
    let tensors = CallTensors::read(py, &variant, &params, &data)?;
    let cu = offsets(cu_seqlens_q, cu_seqlens_k)?;
    let grads: HeadGradients = py
        .detach(|| {
            let (learned, data) = tensors.views();
            let learned = Learned::new(&learned).with_data(&data);
            let backend = CpuBackend::new();
            match &cu {
                None => {
                    let x = HeadsBackward {
                        q: &q,
                        k: &k,
                        v: &v,
                        out: &out,
                        lse: &lse,
                        dout: &dout,
                        position_offset,
                    };
                    backend
                        .backward_learned(&variant, &BackwardInputs::Heads(x), learned)
                        .and_then(|g| g.heads())
                }
                Some((cq, ck)) => backend.backward_varlen(
                    &variant,
                    Varlen {
                        q: &q,
                        k: &k,
                        v: &v,
                        cu_seqlens_q: cq,
                        cu_seqlens_k: ck,
                    },
                    VarlenSaved {
                        out: &out,
                        lse: &lse,
                        dout: &dout,
                    },
                    position_offset,
                    learned,
                ),
            }
        })
        .map_err(from_runtime)?;
    export_gradients(py, grads)
}

/// Gradients as capsules: dq, dk, dv, and each learnable tensor's by its name (without `d`).
pub(crate) fn export_gradients(py: Python<'_>, grads: HeadGradients) -> PyResult<GradientCapsules> {
    let mut named = Vec::with_capacity(grads.learned.len());
    for (name, t) in grads.learned {
        let name = name.strip_prefix('d').unwrap_or(&name).to_string();
        named.push((name, export(py, t)?));
    }
    Ok((
        export(py, grads.dq)?,
        export(py, grads.dk)?,
        export(py, grads.dv)?,
        named,
    ))
}

/// `(dq, dk, dv, [(name, d<name>)])` as capsules.
pub(crate) type GradientCapsules = (Py<PyAny>, Py<PyAny>, Py<PyAny>, Vec<(String, Py<PyAny>)>);
