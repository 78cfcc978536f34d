//! The GPU backend's front half, verified without a GPU.
//!
//! - [`ir`]: the GPU kernel IR, printable (`ir::print`) and parsed back ([`ir::parse`]),
//!   checked by [`ir::verify`]; [`ir::target`] says what a target needs without LLVM, [`ir::tma`]
//!   what TMA tensor maps hold.
//! - [`kernels`]: plans lowered to that IR. [`kernels::forward`] is the SIMT f32 forward,
//!   [`kernels::forward_tc`] the tensor-core (mma.sync) one, [`kernels::forward_wgmma`] the
//!   sm_90a one (TMA, `wgmma`, warp specialization); [`kernels::decode`] the decode kernels over
//!   cache segments (split-KV); [`kernels::backward`] and [`kernels::backward_tc`] the backward
//!   kernels (delta, dq, dk and dv); [`kernels::layers`] a model's other layers.
//! - [`interp`]: runs the IR on the CPU with the semantics of the PTX it maps to.
//! - `llvm` (feature `llvm`): the IR to LLVM IR and PTX.
//! - [`launch`]: the typed launch records; [`artifacts`]: every kernel of a spec, as embedded
//!   and emitted.
//!
//! - [`choice`]: which kernel a call runs ([`choice::choose`]), for the runtime and for
//!   ahead-of-time builds alike, and the lowering of each choice.
//!
//! Here: the kernels as the host launches them ([`ForwardKernel`], [`BackwardKernels`]), each
//! [`verified`].

pub use choice::{backward_kernels, decode_kernel, forward_kernel};

use crate::CodegenError;

pub mod artifacts;
pub mod choice;
pub mod interp;
pub mod ir;
pub mod kernels;
pub mod launch;
#[cfg(feature = "llvm")]
pub mod llvm;

use kernels::{backward, backward_tc};

/// A forward kernel as the host launches it.
#[derive(Clone, Debug)]
pub struct ForwardKernel {
    /// The kernel (shared: callers keep lowered kernels and hand them to launches).
    pub kernel: std::sync::Arc<ir::Kernel>,
    /// Keys per tile (the host's tile codes follow it).
    pub key_tile: u32,
    /// Query rows per CTA (the grid's first axis counts blocks of them).
    pub rows: u32,
    /// The element type of `q`, `k` and `v` in global memory: the spec's bf16 or f16 on tensor
    /// cores, else f32
    /// (`out` and `lse` are f32 either way).
    pub inputs: attn_dsl::DType,
    /// The kernel takes the TMA maps of q, k and v after its launch record
    /// ([`kernels::forward_wgmma::tensor_maps`]; sm_90a only).
    pub tensor_maps: bool,
}

impl ForwardKernel {
    /// The tile codes of a call on `[batch, Sq, Skv]` with key 0 at position `p0`: one per
    /// (head, block of [`ForwardKernel::rows`] queries, key tile), in that order, from the plan's
    /// interval classification ([`crate::plan::TileCode`]), with the ranges of the data the
    /// mask reads over all batch items. A last tile that runs past Skv is `Masked` at best.
    pub fn tile_codes(
        &self,
        plan: &crate::KernelPlan,
        [b, sq, skv]: [usize; 3],
        p0: i64,
        data: Option<&crate::plan::DataRanges>,
    ) -> Vec<i32> {
        use crate::plan::CallShape;
        use attn_dsl::modifier::interval::Interval;
        let (rows, bc) = (self.rows as usize, self.key_tile as usize);
        let (qblocks, tiles) = (sq.div_ceil(rows), skv.div_ceil(bc));
        let call = |head: usize| CallShape {
            sq: sq as i64,
            skv: skv as i64,
            p0,
            query_shift: 0,
            batch: Interval::new(0, b.max(1) as i64 - 1),
            head: Interval::point(head as i64),
            data,
        };
        let mut codes = Vec::with_capacity(plan.shape.heads as usize * qblocks * tiles);
        for head in 0..plan.shape.heads as usize {
            for qb in 0..qblocks {
                let r = Interval::new((qb * rows) as i64, ((qb + 1) * rows).min(sq) as i64 - 1);
                for t in 0..tiles {
                    let keys = Interval::new((t * bc) as i64, ((t + 1) * bc).min(skv) as i64 - 1);
                    // The kernels bound keys on masked tiles only.
                    let complete = (t + 1) * bc <= skv;
                    codes.push(plan.tile_code(r, keys, call(head), complete) as i32);
                }
            }
        }
        codes
    }
}

/// The backward kernels of a plan as the host launches them: delta, dq, and dk with dv, then
/// (SIMT, plans with parameters) the sum of the parameters' gradients.
#[derive(Clone, Debug)]
pub struct BackwardKernels {
    /// The kernels, in launch order.
    pub kernels: Vec<std::sync::Arc<ir::Kernel>>,
    /// On tensor cores ([`backward_tc`]): inputs in the spec's 16-bit format (lse f32), tile
    /// codes, [`launch::BackwardTcArgs`]. Else SIMT ([`backward`]): f32 inputs,
    /// [`launch::BackwardArgs`].
    pub tensor_cores: bool,
}

impl BackwardKernels {
    /// The grids of the kernels for a call of `[batch, Sq, Skv]` with `param_len` parameter
    /// values, in launch order.
    pub fn grids(
        &self,
        plan: &crate::KernelPlan,
        dims: [usize; 3],
        param_len: usize,
    ) -> Vec<[u32; 3]> {
        if self.tensor_cores {
            backward_tc::grids(plan, dims).to_vec()
        } else {
            backward::grids(plan, dims, param_len)
        }
    }
}

pub(crate) fn verified_all(
    kernels: Vec<ir::Kernel>,
) -> Result<Vec<std::sync::Arc<ir::Kernel>>, CodegenError> {
    kernels
        .into_iter()
        .map(|k| verified(k).map(std::sync::Arc::new))
        .collect()
}

/// The kernel, if the verifier passes it.
pub fn verified(kernel: ir::Kernel) -> Result<ir::Kernel, CodegenError> {
    match ir::verify::verify(&kernel) {
        Ok(()) => Ok(kernel),
        Err(errors) => Err(CodegenError::Verify {
            kernel: kernel.name.clone(),
            errors: errors
                .iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("; "),
        }),
    }
}
