//! The MLA op's two calls: five inputs (DeepSeek's layout, `attn::MlaTensors`), the latent
//! output the backward reads, and the five gradients.

use crate::calls::export;
use crate::error::{from_runtime, refuse};
use crate::torch_memory::TorchTensor;
use crate::variant::planned;
use attn::{Backend, BackwardInputs, CpuBackend, Inputs, Learned, MlaBackward, MlaTensors};
use pyo3::prelude::*;

/// An MLA call's five inputs, read in place.
struct Five {
    q_nope: attn::Tensor,
    q_pe: attn::Tensor,
    c_kv: attn::Tensor,
    k_pe: attn::Tensor,
    w_kv_b: attn::Tensor,
}

impl Five {
    fn read(py: Python<'_>, inputs: [&Bound<'_, PyAny>; 5]) -> PyResult<Five> {
        let read = |i: usize, name: &str| TorchTensor::read(inputs[i], name)?.attn_tensor(py);
        Ok(Five {
            q_nope: read(0, "q_nope")?,
            q_pe: read(1, "q_pe")?,
            c_kv: read(2, "c_kv")?,
            k_pe: read(3, "k_pe")?,
            w_kv_b: read(4, "w_kv_b")?,
        })
    }

    fn tensors(&self) -> MlaTensors<'_> {
        MlaTensors {
            q_nope: &self.q_nope,
            q_pe: &self.q_pe,
            c_kv: &self.c_kv,
            k_pe: &self.k_pe,
            w_kv_b: &self.w_kv_b,
        }
    }
}

/// The planned MLA variant of `spec`: refused for a per-head spec, and for learnable tensors
/// (the MLA backward has no gradient for them yet).
fn mla_variant(spec: &str) -> PyResult<std::sync::Arc<attn::Variant>> {
    let variant = planned(spec)?;
    let why = if variant.spec().mla().is_none() {
        "is not MLA: its three inputs go to attn.attention"
    } else if !variant.spec().learnable_tensors().is_empty() || !variant.spec().data.is_empty() {
        "is MLA with learnable or data tensors, which the MLA op does not take yet"
    } else {
        return Ok(variant);
    };
    Err(refuse(format!("spec `{}` {why}", variant.text())))
}

/// The forward of MLA attention: `(out, lse, latent)` as DLPack capsules; `latent`
/// `[B, H, Sq, latent_rank]` f32 is what [`backward_mla`] takes.
#[pyfunction]
#[pyo3(signature = (spec, q_nope, q_pe, c_kv, k_pe, w_kv_b, position_offset))]
#[allow(clippy::too_many_arguments)]
pub fn forward_mla(
    py: Python<'_>,
    spec: &str,
    q_nope: &Bound<'_, PyAny>,
    q_pe: &Bound<'_, PyAny>,
    c_kv: &Bound<'_, PyAny>,
    k_pe: &Bound<'_, PyAny>,
    w_kv_b: &Bound<'_, PyAny>,
    position_offset: i64,
) -> PyResult<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> {
    let variant = mla_variant(spec)?;
    let five = Five::read(py, [q_nope, q_pe, c_kv, k_pe, w_kv_b])?;
    let output = py
        .detach(|| {
            CpuBackend::new().forward_learned(
                &variant,
                Inputs::Mla(five.tensors()),
                position_offset,
                Learned::none(),
            )
        })
        .map_err(from_runtime)?;
    let latent = output
        .latent
        .ok_or_else(|| refuse("the MLA forward returned no latent output"))?;
    Ok((
        export(py, output.out)?,
        export(py, output.lse)?,
        export(py, latent)?,
    ))
}

/// The gradients of [`forward_mla`] for `dout`: `(dq_nope, dq_pe, dc_kv, dk_pe, dw_kv_b)` as
/// DLPack capsules.
#[pyfunction]
#[pyo3(signature = (spec, q_nope, q_pe, c_kv, k_pe, w_kv_b, latent, lse, dout, position_offset))]
#[allow(clippy::too_many_arguments)]
pub fn backward_mla(
    py: Python<'_>,
    spec: &str,
    q_nope: &Bound<'_, PyAny>,
    q_pe: &Bound<'_, PyAny>,
    c_kv: &Bound<'_, PyAny>,
    k_pe: &Bound<'_, PyAny>,
    w_kv_b: &Bound<'_, PyAny>,
    latent: &Bound<'_, PyAny>,
    lse: &Bound<'_, PyAny>,
    dout: &Bound<'_, PyAny>,
    position_offset: i64,
) -> PyResult<Vec<Py<PyAny>>> {
    let variant = mla_variant(spec)?;
    let five = Five::read(py, [q_nope, q_pe, c_kv, k_pe, w_kv_b])?;
    let read = |t: &Bound<'_, PyAny>, name: &str| TorchTensor::read(t, name)?.attn_tensor(py);
    let (latent, lse, dout) = (
        read(latent, "latent")?,
        read(lse, "lse")?,
        read(dout, "dout")?,
    );
    let grads = py
        .detach(|| {
            let x = MlaBackward {
                x: five.tensors(),
                latent: &latent,
                lse: &lse,
                dout: &dout,
                position_offset,
            };
            CpuBackend::new()
                .backward_learned(&variant, &BackwardInputs::Mla(x), Learned::none())
                .and_then(|g| g.mla())
        })
        .map_err(from_runtime)?;
    [
        grads.dq_nope,
        grads.dq_pe,
        grads.dc_kv,
        grads.dk_pe,
        grads.dw_kv_b,
    ]
    .into_iter()
    .map(|g| export(py, g))
    .collect()
}
