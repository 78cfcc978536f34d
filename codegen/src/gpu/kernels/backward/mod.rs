//! A backward plan lowered to GPU IR: the SIMT f32 path, in three kernels (four with parameters).
//!
//! - `backward_delta`: `D = rowsum(dout * out)`, one thread per query row.
//! - `backward_dq`: one thread per query row of one (batch, head), as the forward's SIMT kernel.
//!   Per key tile, the CTA stages K (rotated) and V in shared memory. Each thread recomputes
//!   its row's probabilities from the saved lse and takes `dS = P (dP - D) * d score / d raw`.
//!   It accumulates `dQ += dS K` in registers, then scales dq by the hoisted q factor and
//!   rotates it back.
//! - `backward_dkdv`: one thread per key of one (batch, kv head). Per query tile of each head of
//!   the group, the CTA stages Q (rotated and scaled), dout, lse and D. Each thread accumulates
//!   `dV += P dO` and `dK += dS Q`, summed over the group in registers. Then it rotates dk back.
//!
//! - `backward_dparams` (plans with parameters): the parameters' gradients. `backward_dq` then
//!   runs [`param_copies`] threads, each striding over blocks of query rows, and each adds
//!   `dS * d score / d read` of its own rows into its own copy of every parameter's gradient
//!   (`param_partials`). This kernel sums the copies in copy order, one thread per element.
//!
//! Under `normalize = stick_breaking` the dq and dk/dv kernels are `stick.rs`'s: each row's
//! running sums go from its nearest key, and the dq kernel leaves them for the dk/dv kernel
//! at each block of keys.
//!
//! dQ takes a separate pass instead of atomics, for two reasons. The IR has no atomics. A
//! separate pass also keeps the gradients deterministic, as do the parameters' per-thread copies. The cost is recomputing `Q K^T` and
//! `dO V^T` once more (seven tile products instead of five). Every pair evaluates the mask: no
//! tile is skipped yet. Inputs are contiguous BHSD f32. The dq and dk/dv kernels are in
//! `dq.rs` and `dkdv.rs`; the staging, the probabilities and the delta and parameter kernels
//! they share in `shared.rs`.

mod dkdv;
mod dq;
mod shared;
mod stick;

use crate::gpu::ir::Kernel;
use crate::plan::{KernelPlan, PlanKind};
use dkdv::dkdv;
use dq::dq;
pub use shared::{ROWS, grids, param_copies};
use shared::{delta, dparams};
pub(super) use shared::{delta_body, stage_row_stats};

/// The kernels of a backward plan, in launch order: delta, dq, dk and dv, and for a plan with
/// parameters `backward_dparams`, which sums the dq kernel's partial parameter gradients.
pub fn lower(plan: &KernelPlan) -> Vec<Kernel> {
    assert_eq!(
        plan.kind,
        PlanKind::Backward,
        "the GPU backward kernels lower backward plans"
    );
    let mut kernels = match plan.stick_breaking() {
        true => vec![delta(plan), stick::dq(plan), stick::dkdv(plan)],
        false => vec![delta(plan), dq(plan), dkdv(plan)],
    };
    if !plan.params.is_empty() {
        kernels.push(dparams());
    }
    kernels
}
