//! What every kernel builds with: its registers, the forward launch record's parameters, and
//! special registers widened to i64.

use crate::gpu::ir::build::*;
use crate::gpu::ir::{Expr, Reg, Special, Ty};
use crate::gpu::launch::{ForwardArgs, LaunchRecord};

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
