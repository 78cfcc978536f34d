//! What every kernel builds with: its registers, the forward launch record's parameters,
//! special registers widened to i64, the plan's 16-bit format, and the launch's tile codes.

use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Half, Reg, Space, Special, Ty};
use crate::gpu::launch::{ForwardArgs, LaunchRecord};
use crate::plan::KernelPlan;
use attn_dsl::DType;

/// Register allocation for the kernel being built.
pub(crate) struct Regs {
    pub list: Vec<(String, Ty)>,
}

impl Regs {
    pub fn add(&mut self, name: impl Into<String>, ty: Ty) -> Reg {
        self.list.push((name.into(), ty));
        Reg(self.list.len() as u32 - 1)
    }
}

/// Parameter `name` of the forward launch record ([`ForwardArgs`]).
pub(crate) fn param(name: &str) -> Expr {
    Expr::Param(ForwardArgs::position(name))
}

/// Special register `s` (thread and CTA indices), as an i64.
pub(crate) fn special64(s: Special) -> Expr {
    cast(Expr::Special(s), Ty::I64)
}

/// The 16-bit format of the plan's storage (which the tensor cores take).
pub(crate) fn half_of(plan: &KernelPlan) -> Half {
    if plan.dtype == DType::F16 {
        Half::F16
    } else {
        Half::Bf16
    }
}

/// The launch's code for key tile `tile` of this CTA's query block (CTA x of `rows` query rows,
/// tiles of `key_tile` keys) and head `head`: the codes are laid out by (head, query block, key
/// tile), as [`crate::gpu::ForwardKernel::tile_codes`] makes them.
pub(crate) fn tile_code(head: Reg, [rows, key_tile]: [i64; 2], tile: Expr) -> Expr {
    let n_tiles = bin(
        Bin::Div,
        add(param("skv"), i64(key_tile - 1)),
        i64(key_tile),
    );
    let n_qblocks = bin(Bin::Div, add(param("sq"), i64(rows - 1)), i64(rows));
    let index = add(
        mul(
            add(mul(reg(head), n_qblocks), special64(Special::Ctaid(0))),
            n_tiles,
        ),
        tile,
    );
    load(Space::Global, Ty::I32, at(param("codes"), index, 4))
}
