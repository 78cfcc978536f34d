//! A backward plan lowered to GPU IR on tensor cores (bf16 and f16 specs): FlashAttention-2's
//! backward dataflow in three kernels, every tile product on `mma.sync` m16n8k16 with f32
//! accumulation.
//!
//! - `backward_tc_delta`: `D = rowsum(dout * out)`, one thread per query row (dout 16-bit as
//!   the products read it, out f32).
//! - `backward_tc_dq`: a CTA of four warps takes [`BLOCK`] query rows of one (batch, head), each
//!   warp 16 of them, with Q (rotated) and dO staged once in shared memory. Per key tile the
//!   mask does not skip, K (rotated) and V are staged; `S = Q K^T` and `dP = dO V^T` accumulate
//!   in C fragments; `P = 2^(2 (score - lse))` comes back from the saved lse and
//!   `dS = P (dP - D) * d score / d raw` replaces S; dS, repacked from C into A fragments (their
//!   layouts line up), meets K through transposed `ldmatrix` loads for `dQ += dS K`.
//! - `backward_tc_dkdv`: a CTA takes [`BLOCK`] keys of one (batch, kv head), K (rotated) and V
//!   staged once. Per head of the GQA group and query tile the mask does not skip, Q (rotated),
//!   dO, the scaled lse and D are staged; the transposed products `S^T = K Q^T` and
//!   `dP^T = V dO^T` put the keys on the fragments' rows, so `P^T` and `dS^T` are A fragments
//!   for `dV += P^T dO` and `dK += dS^T Q` with no transpose in between. The group's heads sum
//!   into the same registers.
//!
//! The `Q K^T` operands are in the format the forward used ([`forward_tc::qk_half`]: f16 for bf16
//! specs whose RoPE rotates every column), so recomputed scores match the saved lse; the products
//! with Q or K as the other operand (`dQ += dS K`, `dK += dS^T Q`) take dS in that format too.
//! Inputs past f16's range then run on the SIMT kernels (the runtime checks, as for the forward).
//!
//! dQ takes its own pass instead of atomics, as on the SIMT path: the IR has no atomics, the
//! gradients stay deterministic, and the cost is `S` and `dP` recomputed once more (seven tile
//! products instead of five). Tiles are staged synchronously, and tile codes (from the plan's
//! interval classification, made by the host) skip fully masked tiles and unmask full ones. The
//! scale applies to S in f32 (the operands are the raw rotated q and k), so dq and dk take it at
//! the end, and dq and dk are rotated back by RoPE's transpose in registers: supported plans
//! have RoPE pairs that fall in one lane ([`super::forward_tc`]'s lane alignment), head dims
//! that are multiples of 16 and at most 128 (the dk and dv accumulators of 16 keys take
//! `(qk_dim + v_dim) / 4` registers a lane). Other plans run on the SIMT kernels. The dq and
//! dk/dv kernels are in `dq.rs` and `dkdv.rs`; the delta kernel and the fragments, tiles and
//! staging they share in `shared.rs`.

mod dkdv;
mod dq;
mod shared;

use crate::gpu::ir::Kernel;
use crate::plan::KernelPlan;
use dkdv::dkdv;
use dq::dq;
use shared::delta;
pub use shared::{BLOCK, MAX_DIM, THREADS, grids, inner_tile, supports, tile_codes};

/// The three kernels, in launch order: delta, dq, dk and dv. The plan must be [`supports`]ed.
pub fn lower(plan: &KernelPlan) -> [Kernel; 3] {
    assert!(
        supports(plan),
        "the tensor-core backward runs bf16 and f16 per-head backward plans"
    );
    [delta(plan), dq(plan), dkdv(plan)]
}
