//! Which GPU kernel a call runs: [`choose`] takes the plan, what the call is ([`Call`]) and what
//! it runs on ([`Target`]) and returns a typed [`KernelChoice`]; the runtime lowers what it
//! returns, and ahead-of-time builds ([`super::artifacts`]) lower what it returns for every call
//! a target may make. The choice is the key under which a variant keeps its lowered kernels.

use super::ir::Half;
use super::ir::target::Arch;
use super::kernels::{backward, backward_tc, decode, forward, forward_tc, forward_wgmma};
use super::{BackwardKernels, ForwardKernel, verified, verified_all};
use crate::CodegenError;
use crate::plan::{KernelPlan, PlanKind};
use std::sync::Arc;

/// What a GPU call is, as far as the choice of its kernel goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Call {
    /// A forward call. `wide`: its q or k (times RoPE's attention factor) go past what the
    /// tensor-core kernel's f16 `Q K^T` operands hold ([`forward_tc::QK_F16_LIMIT`]), so it runs
    /// in f32 on the SIMT kernel.
    Forward {
        /// See [`Call::Forward`].
        wide: bool,
    },
    /// A resident model's attention: its inputs never reach the host, so their range is not
    /// known (the tensor-core kernel takes bf16 `Q K^T` operands, which have f32's range), and
    /// its launch passes no TMA tensor maps (never the sm_90a kernel).
    ResidentForward,
    /// A decode call over cache segments.
    Decode,
    /// A backward call; `wide` as for [`Call::Forward`].
    Backward {
        /// See [`Call::Forward`].
        wide: bool,
    },
}

impl Call {
    /// The kind of plan [`choose`] takes for the call.
    pub fn plan_kind(self) -> PlanKind {
        match self {
            Call::Forward { .. } | Call::ResidentForward => PlanKind::Forward,
            Call::Decode => PlanKind::Decode,
            Call::Backward { .. } => PlanKind::Backward,
        }
    }
}

/// What GPU kernels run on, as far as the choice goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Target {
    /// Forward calls take the sm_90a kernel ([`forward_wgmma`]) where the plan runs on it.
    pub wgmma: bool,
    /// The `mma.sync` forward runs on [`forward_tc::Tiling::TWELVE_WARPS`] rather than the
    /// plan's default tiling.
    pub twelve_warps: bool,
}

impl Target {
    /// The target the process's settings ask for: `ATTN_GPU_WGMMA` and `ATTN_GPU_MMA_WARPS`
    /// ([`crate::settings`]); an error names a setting with a value it does not take.
    pub fn from_settings() -> Result<Target, CodegenError> {
        Ok(Target {
            wgmma: crate::settings::gpu_wgmma().map_err(CodegenError::Setting)?,
            twelve_warps: crate::settings::gpu_mma_twelve_warps().map_err(CodegenError::Setting)?,
        })
    }

    /// The targets a program built ahead of time for `arch` may run its calls on, with the
    /// settings at their defaults: on sm_90a with and without the sm_90a forward.
    pub fn of_arch(arch: Arch) -> &'static [Target] {
        const PORTABLE: Target = Target {
            wgmma: false,
            twelve_warps: false,
        };
        const HOPPER: Target = Target {
            wgmma: true,
            twelve_warps: false,
        };
        match arch {
            Arch::Sm90a => &[HOPPER, PORTABLE],
            Arch::Sm80 | Arch::Sm90 => &[PORTABLE],
        }
    }
}

/// A GPU kernel of a variant, as [`choose`] picks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelChoice {
    /// A forward kernel.
    Forward(ForwardChoice),
    /// The decode kernel over cache segments ([`decode`]).
    Decode,
    /// The backward kernels (delta, dq, dk with dv, and the parameters' gradients).
    Backward(BackwardChoice),
}

impl KernelChoice {
    /// The forward kernel chosen; an error if the choice is of another kind (a call of one
    /// kind given the plan of another).
    pub fn forward(self) -> Result<ForwardChoice, CodegenError> {
        match self {
            KernelChoice::Forward(choice) => Ok(choice),
            other => Err(CodegenError::Unsupported(format!(
                "internal: a forward kernel was asked for, and {other:?} was chosen"
            ))),
        }
    }

    /// The backward kernels chosen; an error if the choice is of another kind.
    pub fn backward(self) -> Result<BackwardChoice, CodegenError> {
        match self {
            KernelChoice::Backward(choice) => Ok(choice),
            other => Err(CodegenError::Unsupported(format!(
                "internal: backward kernels were asked for, and {other:?} was chosen"
            ))),
        }
    }
}

/// Which forward kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ForwardChoice {
    /// SIMT on f32 inputs ([`forward`]): any plan runs on it.
    Simt,
    /// Tensor cores through `mma.sync` ([`forward_tc`]), the `Q K^T` operands in `qk`.
    Mma {
        /// The format of the `Q K^T` operands.
        qk: Half,
        /// How the kernel divides its work.
        tiling: forward_tc::Tiling,
    },
    /// sm_90a's warp-specialized kernel ([`forward_wgmma`]: TMA, `wgmma`).
    Wgmma,
}

/// Which backward kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackwardChoice {
    /// SIMT on f32 inputs ([`backward`]): any backward plan runs on them.
    Simt,
    /// Tensor cores ([`backward_tc`]) on the spec's 16-bit inputs.
    Mma,
}

/// The kernel `call` runs on `target`; `plan` is the variant's plan of the call's kind
/// ([`Call::plan_kind`]).
pub fn choose(call: Call, plan: &KernelPlan, target: Target) -> KernelChoice {
    match call {
        Call::Forward { wide } => KernelChoice::Forward(choose_forward(plan, wide, target)),
        Call::ResidentForward => {
            let tensor_cores = forward_tc::supports(plan);
            KernelChoice::Forward(if tensor_cores {
                ForwardChoice::Mma {
                    qk: Half::Bf16,
                    tiling: tiling(plan, target),
                }
            } else {
                ForwardChoice::Simt
            })
        }
        Call::Decode => KernelChoice::Decode,
        Call::Backward { wide } => {
            KernelChoice::Backward(if !wide && backward_tc::supports(plan) {
                BackwardChoice::Mma
            } else {
                BackwardChoice::Simt
            })
        }
    }
}

fn choose_forward(plan: &KernelPlan, wide: bool, target: Target) -> ForwardChoice {
    if wide {
        ForwardChoice::Simt
    } else if target.wgmma && forward_wgmma::supports(plan) {
        ForwardChoice::Wgmma
    } else if forward_tc::supports(plan) {
        ForwardChoice::Mma {
            qk: forward_tc::qk_half(plan),
            tiling: tiling(plan, target),
        }
    } else {
        ForwardChoice::Simt
    }
}

fn tiling(plan: &KernelPlan, target: Target) -> forward_tc::Tiling {
    if target.twelve_warps {
        forward_tc::Tiling::TWELVE_WARPS
    } else {
        forward_tc::Tiling::of(plan)
    }
}

impl ForwardChoice {
    /// The kernel, lowered from a forward `plan` and verified; an error where the plan does
    /// not run on it.
    pub fn lower(self, plan: &KernelPlan) -> Result<ForwardKernel, CodegenError> {
        let unsupported = |what: &str| {
            Err(CodegenError::Unsupported(format!(
                "the {what} forward kernel does not run this plan"
            )))
        };
        match self {
            ForwardChoice::Simt => Ok(ForwardKernel {
                kernel: Arc::new(verified(forward::lower(plan))?),
                key_tile: forward::key_tile(plan),
                rows: forward::ROWS,
                inputs: attn_dsl::DType::F32,
                tensor_maps: false,
            }),
            ForwardChoice::Mma { qk, tiling } => {
                if !forward_tc::supports(plan) {
                    return unsupported("tensor-core");
                }
                Ok(ForwardKernel {
                    kernel: Arc::new(verified(forward_tc::lower_tiled(plan, qk, tiling))?),
                    key_tile: tiling.key_tile(plan),
                    rows: tiling.rows(),
                    inputs: plan.dtype,
                    tensor_maps: false,
                })
            }
            ForwardChoice::Wgmma => {
                if !forward_wgmma::supports(plan) {
                    return unsupported("sm_90a");
                }
                Ok(ForwardKernel {
                    kernel: Arc::new(verified(forward_wgmma::lower(plan))?),
                    key_tile: forward_wgmma::key_tile(plan),
                    rows: forward_wgmma::ROWS,
                    inputs: plan.dtype,
                    tensor_maps: true,
                })
            }
        }
    }
}

impl BackwardChoice {
    /// The kernels, lowered from a backward `plan` and verified; an error where the plan does
    /// not run on them.
    pub fn lower(self, plan: &KernelPlan) -> Result<BackwardKernels, CodegenError> {
        match self {
            BackwardChoice::Simt => Ok(BackwardKernels {
                kernels: verified_all(backward::lower(plan))?,
                tensor_cores: false,
            }),
            BackwardChoice::Mma if !backward_tc::supports(plan) => Err(CodegenError::Unsupported(
                "the tensor-core backward does not run this plan".into(),
            )),
            BackwardChoice::Mma => Ok(BackwardKernels {
                kernels: verified_all(backward_tc::lower(plan).into())?,
                tensor_cores: true,
            }),
        }
    }
}

/// The decode kernel of a decode plan, verified.
pub fn decode_kernel(plan: &KernelPlan) -> Result<super::ir::Kernel, CodegenError> {
    verified(decode::lower(plan))
}

/// The forward kernel of a plain forward call on the default target (tensor cores for bf16 and
/// f16 specs that run on them, SIMT f32 otherwise), verified.
pub fn forward_kernel(plan: &KernelPlan) -> Result<ForwardKernel, CodegenError> {
    choose(Call::Forward { wide: false }, plan, Target::default())
        .forward()?
        .lower(plan)
}

/// The backward kernels of a plain backward call (tensor cores where [`backward_tc::supports`]
/// the plan, else SIMT), verified.
pub fn backward_kernels(plan: &KernelPlan) -> Result<BackwardKernels, CodegenError> {
    choose(Call::Backward { wide: false }, plan, Target::default())
        .backward()?
        .lower(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_dsl::AttentionSpec;

    fn plans(text: &str) -> (KernelPlan, KernelPlan) {
        let spec: AttentionSpec = text.parse().unwrap();
        (
            KernelPlan::forward(&spec),
            KernelPlan::backward(&spec).unwrap(),
        )
    }

    const HOPPER: Target = Target {
        wgmma: true,
        twelve_warps: false,
    };

    #[test]
    fn forward_calls_take_tensor_cores_where_the_plan_runs_on_them() {
        let (f32_plan, _) = plans("heads = 2, head_dim = 64, mask = causal");
        let (bf16, _) = plans("heads = 2, head_dim = 128, mask = causal, dtype = bf16");
        let plain = Call::Forward { wide: false };
        assert_eq!(
            choose(plain, &f32_plan, HOPPER),
            KernelChoice::Forward(ForwardChoice::Simt)
        );
        let mma = KernelChoice::Forward(ForwardChoice::Mma {
            qk: Half::Bf16,
            tiling: forward_tc::Tiling::of(&bf16),
        });
        assert_eq!(choose(plain, &bf16, Target::default()), mma);
        assert_eq!(
            choose(plain, &bf16, HOPPER),
            KernelChoice::Forward(ForwardChoice::Wgmma)
        );
        // Inputs past f16's range: SIMT, whatever the target.
        assert_eq!(
            choose(Call::Forward { wide: true }, &bf16, HOPPER),
            KernelChoice::Forward(ForwardChoice::Simt)
        );
        let twelve = Target {
            twelve_warps: true,
            ..Target::default()
        };
        assert_eq!(
            choose(plain, &bf16, twelve),
            KernelChoice::Forward(ForwardChoice::Mma {
                qk: Half::Bf16,
                tiling: forward_tc::Tiling::TWELVE_WARPS,
            })
        );
    }

    #[test]
    fn resident_forwards_never_take_tma_and_keep_f32_range() {
        let (f16, _) = plans("heads = 2, head_dim = 128, mask = causal, dtype = f16");
        let plain = choose(Call::Forward { wide: false }, &f16, Target::default());
        assert_eq!(
            plain,
            KernelChoice::Forward(ForwardChoice::Mma {
                qk: Half::F16,
                tiling: forward_tc::Tiling::of(&f16),
            })
        );
        let chosen = choose(Call::ResidentForward, &f16, HOPPER);
        assert_eq!(
            chosen,
            KernelChoice::Forward(ForwardChoice::Mma {
                qk: Half::Bf16,
                tiling: forward_tc::Tiling::of(&f16),
            })
        );
        assert!(!chosen.forward().unwrap().lower(&f16).unwrap().tensor_maps);
    }

    #[test]
    fn backward_calls_and_mismatched_kinds() {
        let (bf16_forward, bf16) = plans("heads = 2, head_dim = 64, dtype = bf16");
        let (_, f32_plan) = plans("heads = 2, head_dim = 64");
        let plain = Call::Backward { wide: false };
        assert_eq!(
            choose(plain, &bf16, Target::default()),
            KernelChoice::Backward(BackwardChoice::Mma)
        );
        assert_eq!(
            choose(Call::Backward { wide: true }, &bf16, Target::default()),
            KernelChoice::Backward(BackwardChoice::Simt)
        );
        assert_eq!(
            choose(plain, &f32_plan, Target::default()),
            KernelChoice::Backward(BackwardChoice::Simt)
        );
        assert!(choose(plain, &bf16, Target::default()).forward().is_err());
        assert!(
            choose(Call::Decode, &bf16, Target::default())
                .backward()
                .is_err()
        );
        // A choice a plan does not run on is an error, not a panic.
        let (odd, _) = plans("heads = 2, head_dim = 96, dtype = bf16");
        assert!(ForwardChoice::Wgmma.lower(&odd).is_err());
        assert!(ForwardChoice::Wgmma.lower(&bf16_forward).is_ok());
        assert!(BackwardChoice::Mma.lower(&f32_plan).is_err());
        let (f32_forward, _) = plans("heads = 2, head_dim = 64");
        assert!(
            ForwardChoice::Mma {
                qk: Half::F16,
                tiling: forward_tc::Tiling::of(&f32_forward)
            }
            .lower(&f32_forward)
            .is_err()
        );
    }
}
