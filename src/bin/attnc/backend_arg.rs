//! The `--backend` argument: where a command computes.

/// Where a command computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// Cranelift-compiled kernels on this machine's CPU.
    Cpu,
    /// The GPU kernel on a CUDA device (needs the `cuda` feature and an NVIDIA GPU).
    Cuda,
    /// The GPU kernel on the GPU IR interpreter (slow; no GPU needed).
    GpuSim,
}

/// Where a timing command runs: the interpreter is no GPU, so it is not one of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Timed {
    /// Cranelift-compiled kernels on this machine's CPU.
    Cpu,
    /// The GPU kernels on CUDA device 0 (needs the `cuda` feature and an NVIDIA GPU).
    Cuda,
}

impl From<Timed> for Backend {
    fn from(t: Timed) -> Backend {
        match t {
            Timed::Cpu => Backend::Cpu,
            Timed::Cuda => Backend::Cuda,
        }
    }
}

impl Backend {
    /// The backend's name, as `attn::runtime::backends::open` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::GpuSim => "gpu-sim",
        }
    }
}
