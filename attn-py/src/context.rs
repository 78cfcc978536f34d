//! Context-parallel attention from PyTorch: attn's Ulysses and ring attention over the caller's
//! `torch.distributed` process group. attn's [`Communicator`] calls back into the group
//! (`attn/distributed.py`'s `_Group`: gloo's collectives on CPU tensors), from whichever thread
//! attn runs a collective on (the ring exchanges on its own thread while the kernels run); the
//! GIL is held only for those calls.

use crate::calls::{
    CallTensors, GradientCapsules, Named, export, export_gradients, per_head_variant,
};
use crate::error::{from_runtime, refuse};
use crate::torch_memory::{Element, TorchTensor};
use attn::distributed::{CommError, Communicator, ContextParallel, Scheme};
use attn::{CpuBackend, HeadsBackward, Learned};
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

/// A torch.distributed group, through the Python `_Group` that calls its collectives.
struct TorchGroup {
    group: Py<PyAny>,
    rank: usize,
    size: usize,
}

impl TorchGroup {
    fn of(group: &Bound<'_, PyAny>) -> PyResult<TorchGroup> {
        Ok(TorchGroup {
            rank: group.getattr("rank")?.extract()?,
            size: group.getattr("size")?.extract()?,
            group: group.clone().unbind(),
        })
    }

    /// Calls the group's `method` on `values` (as a float32 tensor) and `args`, and copies the
    /// float32 tensor it returns into `into`.
    fn call(
        &self,
        method: &str,
        values: &[f32],
        args: (usize, usize, usize),
        into: &mut [f32],
    ) -> Result<(), CommError> {
        let fail = |e: PyErr| self.error(format!("torch.distributed: {e}"));
        Python::attach(|py| {
            let bytes = PyByteArray::new(py, &ne_bytes(values));
            let got = self
                .group
                .bind(py)
                .call_method1(method, (bytes, into.len(), args.0, args.1, args.2))
                .map_err(fail)?;
            let t = TorchTensor::read(&got, "a collective's result").map_err(fail)?;
            let buffer = t.values::<f32>(py, Element::F32).map_err(fail)?;
            if buffer.len() != into.len() {
                return Err(self.error(format!(
                    "{method} returned {} values; this call expects {}",
                    buffer.len(),
                    into.len()
                )));
            }
            into.copy_from_slice(&buffer);
            Ok(())
        })
    }
}

/// The bytes of f32 values (native order, as torch.frombuffer reads them).
fn ne_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

impl Communicator for TorchGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn engine(&self) -> &'static str {
        "torch.distributed"
    }

    fn send_recv(
        &self,
        send: &[f32],
        to: usize,
        recv: &mut [f32],
        from: usize,
    ) -> Result<(), CommError> {
        self.call("send_recv", send, (to, from, 0), recv)
    }

    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        self.call("all_to_all", send, (0, 0, 0), recv)
    }

    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<(), CommError> {
        let send = values.to_vec();
        self.call("all_reduce", &send, (0, 0, 0), values)
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        self.call("all_gather", send, (0, 0, 0), recv)
    }
}

fn scheme_of(scheme: &str) -> PyResult<Scheme> {
    scheme.parse().map_err(refuse)
}

/// The positions (from 0) rank `rank` of `ranks` holds of a sequence of `seq` under `scheme`.
#[pyfunction]
pub fn context_positions(
    spec: &str,
    scheme: &str,
    ranks: usize,
    rank: usize,
    seq: usize,
) -> PyResult<Vec<usize>> {
    let variant = per_head_variant(spec)?;
    if rank >= ranks {
        return Err(refuse(format!("rank {rank} of {ranks} ranks")));
    }
    let split = scheme_of(scheme)?
        .split(&variant, ranks, seq)
        .map_err(from_runtime)?;
    Ok(split.chunks(rank).into_iter().flatten().collect())
}

/// This rank's part of context-parallel attention: `(out, lse)` as DLPack capsules, for q, k,
/// v holding this rank's positions ([`context_positions`]); learnable and data tensors whole.
#[pyfunction]
#[pyo3(signature = (spec, scheme, group, q, k, v, position_offset, params, data))]
#[allow(clippy::too_many_arguments)]
pub fn context_forward(
    py: Python<'_>,
    spec: &str,
    scheme: &str,
    group: &Bound<'_, PyAny>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    position_offset: i64,
    params: Named,
    data: Named,
) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    let (variant, scheme, group) = (
        per_head_variant(spec)?,
        scheme_of(scheme)?,
        TorchGroup::of(group)?,
    );
    let read = |t: &Bound<'_, PyAny>, name: &str| TorchTensor::read(t, name)?.attn_tensor(py);
    let (q, k, v) = (read(q, "q")?, read(k, "k")?, read(v, "v")?);
    let tensors = CallTensors::read(py, &variant, &params, &data)?;
    let output = py
        .detach(|| {
            let (learned, data) = tensors.views();
            let cpu = CpuBackend::new();
            ContextParallel::new(&group, &cpu, scheme).forward(
                &variant,
                [&q, &k, &v],
                position_offset,
                Learned::new(&learned).with_data(&data),
            )
        })
        .map_err(from_runtime)?;
    Ok((export(py, output.out)?, export(py, output.lse)?))
}

/// The gradients of [`context_forward`] on this rank: `(dq, dk, dv, [(name, d<name>)])`, the
/// learnable tensors' as this rank's share (to be reduced over the group as every other
/// parameter's gradient is).
#[pyfunction]
#[pyo3(signature = (spec, scheme, group, q, k, v, out, lse, dout, position_offset, params, data))]
#[allow(clippy::too_many_arguments)]
pub fn context_backward(
    py: Python<'_>,
    spec: &str,
    scheme: &str,
    group: &Bound<'_, PyAny>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    lse: &Bound<'_, PyAny>,
    dout: &Bound<'_, PyAny>,
    position_offset: i64,
    params: Named,
    data: Named,
) -> PyResult<GradientCapsules> {
    let (variant, scheme, group) = (
        per_head_variant(spec)?,
        scheme_of(scheme)?,
        TorchGroup::of(group)?,
    );
    let read = |t: &Bound<'_, PyAny>, name: &str| TorchTensor::read(t, name)?.attn_tensor(py);
    let (q, k, v) = (read(q, "q")?, read(k, "k")?, read(v, "v")?);
    let (out, lse, dout) = (read(out, "out")?, read(lse, "lse")?, read(dout, "dout")?);
    let tensors = CallTensors::read(py, &variant, &params, &data)?;
    let grads = py
        .detach(|| {
            let (learned, data) = tensors.views();
            let cpu = CpuBackend::new();
            let x = HeadsBackward {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                lse: &lse,
                dout: &dout,
                position_offset,
            };
            ContextParallel::new(&group, &cpu, scheme).backward_shares(
                &variant,
                &x,
                Learned::new(&learned).with_data(&data),
            )
        })
        .map_err(from_runtime)?;
    export_gradients(py, grads)
}
