//! Errors of codegen.

/// Why a kernel could not be produced.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CodegenError {
    /// Cranelift rejected the function or the host is not supported.
    #[error("cranelift: {0}")]
    Cranelift(String),
    /// LLVM rejected the module or could not generate PTX.
    #[error("llvm: {0}")]
    Llvm(String),
}
