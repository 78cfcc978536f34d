//! Errors of attn-runtime.

/// What went wrong running attention.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A tensor's shape does not fit the spec or the other inputs.
    #[error("tensor `{tensor}` has shape {found:?}, expected {expected}")]
    Shape {
        /// Which tensor.
        tensor: String,
        /// Its shape.
        found: Vec<usize>,
        /// What was expected, in words.
        expected: String,
    },
    /// Tensors disagree on dtype.
    #[error("tensor `{tensor}` is {found}, expected {expected}")]
    DType {
        /// Which tensor.
        tensor: String,
        /// Its dtype.
        found: String,
        /// The expected dtype.
        expected: String,
    },
    /// The data does not fill the shape.
    #[error("{0}")]
    Data(String),
    /// No usable GPU, or the device failed.
    #[error("device: {0}")]
    Device(String),
    /// A collective of a distributed call failed (a rank left, a message of another size, a
    /// timeout).
    #[error("communication: {0}")]
    Comm(#[from] crate::distributed::CommError),
    /// This build lacks what the call needs: a cargo feature, or a kernel's PTX.
    #[error("{0}")]
    NotBuilt(String),
    /// A KV cache cannot do what was asked (unknown sequence, no free block).
    #[error("cache: {0}")]
    Cache(String),
    /// A backend does not run this kind of call (the MLA backward on a GPU backend, say).
    #[error("the {backend} backend does not run {what}")]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// The call, in words.
        what: String,
    },
    /// The spec is invalid, or needs another entry point.
    #[error("spec: {0}")]
    Spec(String),
    /// An environment setting (`ATTN_*`) has a value it does not take.
    #[error("environment setting {0}")]
    Setting(String),
    /// Kernel generation failed.
    #[error(transparent)]
    Codegen(#[from] codegen::CodegenError),
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// What failed.
        message: String,
    },
    /// A required tensor is not in a file.
    #[error("{path}: no tensor `{tensor}` (it has: {available})")]
    Missing {
        /// The file.
        path: String,
        /// The tensor looked for.
        tensor: String,
        /// The tensors it has.
        available: String,
    },
}

/// The spec's validation findings as one error (`Ok` for a valid spec).
pub(crate) fn check_spec(spec: &attn_dsl::AttentionSpec) -> Result<(), RuntimeError> {
    spec.validate().map_err(|findings| {
        RuntimeError::Spec(
            findings
                .iter()
                .map(|f| f.to_string())
                .collect::<Vec<_>>()
                .join("; "),
        )
    })
}
