//! Errors of codegen.

/// Why a kernel could not be produced.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CodegenError {
    /// Cranelift rejected the function or the host is not supported.
    #[error("cranelift: {0}")]
    Cranelift(String),
}
