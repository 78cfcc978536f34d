//! The one exception attn raises: `attn.AttnError`, a `ValueError` whose text is attn's message
//! (a spec's errors with the source line and carets, as `attnc check` prints them).

use pyo3::PyErr;
use pyo3::exceptions::PyValueError;

pyo3::create_exception!(
    attn,
    AttnError,
    PyValueError,
    "An input attn refuses: a spec with errors, or tensors that do not fit it."
);

/// `message` as an [`AttnError`].
pub fn refuse(message: impl Into<String>) -> PyErr {
    AttnError::new_err(message.into())
}

/// A runtime error as an [`AttnError`] carrying its message.
pub fn from_runtime(e: attn::RuntimeError) -> PyErr {
    refuse(e.to_string())
}
