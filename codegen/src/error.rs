//! Errors of codegen.

/// Why a kernel could not be produced.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CodegenError {
    /// Cranelift rejected the function or the host is not supported.
    #[error("cranelift: {0}")]
    Cranelift(String),
    /// A lowered GPU kernel failed the GPU IR verifier (a bug in the lowering).
    #[error("GPU IR verifier: kernel `{kernel}`: {errors}")]
    Verify {
        /// The kernel's name.
        kernel: String,
        /// What the verifier found.
        errors: String,
    },
    /// An environment setting has a value it does not take.
    #[error("environment setting {0}")]
    Setting(String),
    /// LLVM rejected the module or could not generate PTX.
    #[error("llvm: {0}")]
    Llvm(String),
    /// The spec uses something this kind of kernel does not implement.
    #[error("{0}")]
    Unsupported(String),
}
