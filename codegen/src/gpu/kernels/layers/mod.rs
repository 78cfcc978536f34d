//! The non-attention pieces of a decoder, lowered to GPU IR like the attention kernels (no
//! hand-written CUDA), one file per kind: row norms (`norm`), elementwise kernels (`elementwise`:
//! the MLP activations, multipliers and softcaps, residual and bias adds, learned sinks), rows
//! moved as a decoder needs them (`rows`: embedding lookups, axis swaps, column ranges, rows
//! gathered for experts and added back), the argmax that greedy decoding samples with
//! (`argmax`), cache appends with RoPE (`cache`), and the split-KV merge (`merge`). All take and
//! give f32 rows in global memory; an embedding table may be bf16 or f16 as its checkpoint
//! stored it, and caches 16-bit values.
//!
//! Row kernels (norms, argmax) run one CTA per row, each thread striding over the row and the
//! CTA reducing through warp shuffles and one shared slot per warp. Elementwise kernels run one
//! thread per element (or a few consecutive ones), behind the shared prologue [`per_thread`].

mod argmax;
mod cache;
mod elementwise;
mod merge;
mod norm;
mod rows;

pub use argmax::*;
pub use cache::*;
pub use elementwise::*;
pub use merge::*;
pub use norm::*;
pub use rows::*;

use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Reg, Space, Special, Stmt, Ty, Un};
use crate::gpu::kernels::Regs;
use crate::gpu::launch::LaunchRecord;

/// Threads per CTA of every layer kernel (8 warps).
pub const THREADS: u32 = 256;

const WARPS: i64 = THREADS as i64 / 32;

fn p<R: LaunchRecord>(name: &str) -> Expr {
    Expr::Param(R::position(name))
}

fn tid() -> Expr {
    cast(Expr::Special(Special::Tid), Ty::I64)
}

fn row() -> Expr {
    cast(Expr::Special(Special::Ctaid(0)), Ty::I64)
}

/// `for i in tid..width step THREADS { body(i) }`.
fn strided(i: Reg, width: u32, body: Vec<Stmt>) -> Stmt {
    Stmt::For {
        reg: i,
        start: tid(),
        end: i64(i64::from(width)),
        step: i64::from(THREADS),
        body,
    }
}

/// Sums `acc` over the CTA: a butterfly within each warp, one shared slot per warp (from byte
/// `slot0`), then every thread adds the slots, so each ends with the total in `acc`.
fn cta_sum(acc: Reg, slot0: i64) -> Vec<Stmt> {
    let mut s: Vec<Stmt> = [16, 8, 4, 2, 1]
        .into_iter()
        .map(|m| Stmt::Set(acc, add(reg(acc), Expr::ShflXor(Box::new(reg(acc)), m))))
        .collect();
    let warp = bin(Bin::Div, tid(), i64(32));
    s.push(Stmt::If(
        bin(Bin::Eq, cast(Expr::Special(Special::Lane), Ty::I64), i64(0)),
        vec![Stmt::Store(
            Space::Shared,
            add(i64(slot0), mul(warp, i64(4))),
            reg(acc),
        )],
        vec![],
    ));
    s.push(Stmt::Barrier);
    s.push(Stmt::Set(acc, f32(0.0)));
    for w in 0..WARPS {
        s.push(Stmt::Set(
            acc,
            add(reg(acc), load(Space::Shared, Ty::F32, i64(slot0 + 4 * w))),
        ));
    }
    // The slots are read before any thread writes them again.
    s.push(Stmt::Barrier);
    s
}

fn kernel(
    name: &str,
    params: Vec<(String, Ty)>,
    regs: Regs,
    shared: u32,
    body: Vec<Stmt>,
) -> Kernel {
    Kernel {
        name: name.into(),
        params,
        regs: regs.list,
        shared_bytes: shared,
        threads: THREADS,
        ctas_per_sm: 4,
        body,
    }
}

/// `e^x` through `ex2` (`ex2.approx`).
fn exp(x: Expr) -> Expr {
    un(Un::Ex2, mul(x, f32(std::f32::consts::LOG2_E)))
}

/// The body of a kernel with a thread per `per` consecutive values: `i = (ctaid.x * THREADS +
/// tid) * per`, then `body` when `i < count`.
fn per_thread(i: Reg, per: i64, count: Expr, body: Vec<Stmt>) -> Vec<Stmt> {
    vec![
        Stmt::Set(
            i,
            mul(add(mul(row(), i64(i64::from(THREADS))), tid()), i64(per)),
        ),
        Stmt::If(bin(Bin::Lt, reg(i), count), body, vec![]),
    ]
}
