//! `attn._attn`: the extension module under the Python package `attn` (attn-py/python/attn).
//!
//! It holds what the Python layer cannot do itself: parsing and checking specs
//! ([`variant::PyVariant`]), reading torch tensors in place ([`torch_memory`]), running attn's
//! kernels with the GIL released ([`calls`], MLA's in [`mla_calls`]) and handing their outputs to torch without a copy
//! ([`dlpack`]), and context-parallel attention over a torch.distributed group ([`context`]).
//! The torch op, its autograd and its fake (shape) function are Python
//! (`attn/_op.py`), over [`calls::forward`] and [`calls::backward`].

mod calls;
mod context;
mod dlpack;
mod error;
mod mla_calls;
mod torch_memory;
mod variant;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _attn(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("AttnError", m.py().get_type::<error::AttnError>())?;
    m.add_class::<variant::PyVariant>()?;
    m.add_function(wrap_pyfunction!(calls::forward, m)?)?;
    m.add_function(wrap_pyfunction!(calls::backward, m)?)?;
    m.add_function(wrap_pyfunction!(mla_calls::forward_mla, m)?)?;
    m.add_function(wrap_pyfunction!(mla_calls::backward_mla, m)?)?;
    m.add_function(wrap_pyfunction!(variant::normalized, m)?)?;
    m.add_function(wrap_pyfunction!(variant::differential_parts, m)?)?;
    m.add_function(wrap_pyfunction!(context::context_forward, m)?)?;
    m.add_function(wrap_pyfunction!(context::context_backward, m)?)?;
    m.add_function(wrap_pyfunction!(context::context_positions, m)?)?;
    Ok(())
}
