//! The GPU IR verifier, run after every lowering and on every parsed kernel. It checks what can
//! be known without running the kernel:
//! - every register and parameter exists, and every operation gets operands of its types;
//! - loads and stores address I64 bytes, and shared accesses stay inside the kernel's shared
//!   bytes where their addresses are bounded statically (constants, thread and lane indices,
//!   loop counters with known bounds, registers assigned once, and arithmetic on those). Under
//!   an `if`, whose condition may bound the thread index, only accesses outside for every
//!   address of their range are errors;
//! - barriers are not under control flow that can diverge within a CTA (a condition or loop
//!   bound that depends on the thread's index, directly or through registers and shuffles);
//! - warp-collective operations (`mma`, `ldmatrix`) and warpgroup ones (`wgmma`,
//!   `setmaxnreg`) have fragments and operands of their shapes;
//! - tensor maps are parameters and only operands of TMA copies.
//!
//! The interpreter checks the rest (addresses in bounds at run time, races) as it runs.

use super::{Bin, Expr, Kernel, Reg, Space, Special, Stmt, Ty, Un, Wgmma, WgmmaA};
use std::fmt;

/// What the verifier found wrong, and where (a path of statement indices from the body).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyError {
    /// Statement indices from the kernel's body down to the statement (`if` branches count the
    /// `then` statements first, then the `else` ones).
    pub at: Vec<usize>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at: Vec<String> = self.at.iter().map(|i| i.to_string()).collect();
        write!(f, "statement {}: {}", at.join("."), self.message)
    }
}

/// Errors past this many are not collected.
const MAX_ERRORS: usize = 50;

/// Verifies a kernel; every error found (up to 50), in program order.
pub fn verify(kernel: &Kernel) -> Result<(), Vec<VerifyError>> {
    let mut v = Verifier {
        kernel,
        errors: Vec::new(),
        at: Vec::new(),
        divergent: divergent_registers(kernel),
        ranges: register_ranges(kernel),
        guarded: 0,
    };
    if kernel.threads == 0 || kernel.threads > 1024 {
        v.error(format!(
            "{} threads per CTA; a CTA has 1 to 1024",
            kernel.threads
        ));
    }
    if kernel.ctas_per_sm == 0 {
        v.error("0 CTAs per SM".into());
    }
    for (i, (name, ty)) in kernel.params.iter().enumerate() {
        if !matches!(ty, Ty::I64 | Ty::TensorMap) {
            v.error(format!(
                "parameter {i} `{name}` is {ty}; parameters are i64 or tensormap"
            ));
        }
    }
    for (name, ty) in &kernel.regs {
        if *ty == Ty::TensorMap {
            v.error(format!(
                "register `%{name}` is a tensormap; tensor maps are only parameters"
            ));
        }
    }
    v.block(&kernel.body, false);
    if v.errors.is_empty() {
        Ok(())
    } else {
        Err(v.errors)
    }
}

struct Verifier<'k> {
    kernel: &'k Kernel,
    errors: Vec<VerifyError>,
    at: Vec<usize>,
    /// Per register: whether its value can differ between threads of a CTA.
    divergent: Vec<bool>,
    /// Per register: the values it can hold, where bounded.
    ranges: Vec<Option<(i64, i64)>>,
    /// How many `if`s enclose the statement being checked.
    guarded: usize,
}

impl Verifier<'_> {
    fn error(&mut self, message: String) {
        if self.errors.len() < MAX_ERRORS {
            self.errors.push(VerifyError {
                at: self.at.clone(),
                message,
            });
        }
    }

    fn reg(&mut self, r: Reg) -> Option<Ty> {
        match self.kernel.regs.get(r.0 as usize) {
            Some((_, ty)) => Some(*ty),
            None => {
                self.error(format!(
                    "register {} does not exist ({} registers)",
                    r.0,
                    self.kernel.regs.len()
                ));
                None
            }
        }
    }

    fn expect(&mut self, e: &Expr, ty: Ty, what: &str) {
        if let Some(found) = self.ty(e)
            && found != ty
        {
            self.error(format!("{what} is {found}, expected {ty}"));
        }
    }

    /// The type of an expression, after checking its operands; `None` when ill-typed (and
    /// reported).
    fn ty(&mut self, e: &Expr) -> Option<Ty> {
        let int = |t: Ty| matches!(t, Ty::I32 | Ty::I64);
        Some(match e {
            Expr::Int(_, ty) => {
                if !int(*ty) {
                    self.error(format!("an integer constant of type {ty}"));
                    return None;
                }
                *ty
            }
            Expr::Pred(_) => Ty::Pred,
            Expr::Reg(r) => self.reg(*r)?,
            Expr::Param(i) => match self.kernel.params.get(*i as usize) {
                Some((name, Ty::TensorMap)) => {
                    self.error(format!(
                        "tensor map `${name}` used as a value (only as a TMA copy's map)"
                    ));
                    return None;
                }
                Some((_, ty)) => *ty,
                None => {
                    self.error(format!("parameter {i} does not exist"));
                    return None;
                }
            },
            Expr::Special(_) => Ty::I32,
            Expr::Un(op, a) => {
                let a = self.ty(a)?;
                let ok = match op {
                    Un::Not => a == Ty::Pred,
                    Un::Neg | Un::Abs => a != Ty::Pred,
                    Un::Ex2 | Un::Ex2Ftz | Un::Lg2 | Un::Sqrt => a == Ty::F32,
                };
                if !ok {
                    self.error(format!("{op:?} of {a}"));
                    return None;
                }
                a
            }
            Expr::Bin(op, a, b) => {
                let (a, b) = (self.ty(a)?, self.ty(b)?);
                if a != b {
                    self.error(format!("{op:?} of {a} and {b} (operands of one type)"));
                    return None;
                }
                let compare = matches!(op, Bin::Lt | Bin::Le | Bin::Gt | Bin::Ge);
                let ok = match a {
                    Ty::Pred => matches!(op, Bin::And | Bin::Or | Bin::Eq | Bin::Ne),
                    Ty::F32 => !matches!(op, Bin::And | Bin::Or | Bin::Shl),
                    Ty::I32 | Ty::I64 => true,
                    Ty::TensorMap => false,
                };
                if !ok {
                    self.error(format!("{op:?} on {a}"));
                    return None;
                }
                if compare || matches!(op, Bin::Eq | Bin::Ne) {
                    Ty::Pred
                } else {
                    a
                }
            }
            Expr::Fma(a, b, c) => {
                for (x, which) in [(a, "fma's a"), (b, "fma's b"), (c, "fma's c")] {
                    self.expect(x, Ty::F32, which);
                }
                Ty::F32
            }
            Expr::Select(c, a, b) => {
                self.expect(c, Ty::Pred, "a select's condition");
                let (a, b) = (self.ty(a)?, self.ty(b)?);
                if a != b {
                    self.error(format!("a select between {a} and {b}"));
                    return None;
                }
                a
            }
            Expr::Cast(a, ty) => {
                let a = self.ty(a)?;
                if *ty == Ty::Pred && a != Ty::Pred {
                    self.error(format!("a cast of {a} to pred"));
                    return None;
                }
                *ty
            }
            Expr::Load(space, ty, addr) => {
                if *ty == Ty::Pred {
                    self.error("a load of a predicate".into());
                }
                self.address(*space, addr, if *ty == Ty::I64 { 8 } else { 4 });
                *ty
            }
            Expr::LoadHalf(space, _, addr) => {
                self.address(*space, addr, 2);
                Ty::F32
            }
            Expr::Table(values, index) => {
                if values.is_empty() {
                    self.error("an empty table".into());
                }
                if let Some(t) = self.ty(index)
                    && !int(t)
                {
                    self.error(format!("a table indexed by {t}"));
                }
                Ty::F32
            }
            Expr::F32(_) => Ty::F32,
            Expr::ShflXor(a, mask) => {
                let a = self.ty(a)?;
                if !matches!(a, Ty::F32 | Ty::I32) {
                    self.error(format!("a shuffle of {a} (32-bit values only)"));
                }
                if *mask >= 32 {
                    self.error(format!("a shuffle with lane mask {mask} (0 to 31)"));
                }
                a
            }
            Expr::PackHalf(_, lo, hi) => {
                self.expect(lo, Ty::F32, "a packed half's low value");
                self.expect(hi, Ty::F32, "a packed half's high value");
                Ty::I32
            }
            Expr::SharedAddress(a) => {
                self.address(Space::Shared, a, 0);
                Ty::I64
            }
        })
    }

    /// Checks an access of `bytes` at `addr` in `space`.
    fn address(&mut self, space: Space, addr: &Expr, bytes: i64) {
        self.expect(addr, Ty::I64, "an address");
        if space != Space::Shared {
            return;
        }
        let shared = i64::from(self.kernel.shared_bytes);
        let Some((lo, hi)) = range(addr, &self.ranges, self.kernel.threads) else {
            return;
        };
        // Ranges ignore the conditions of enclosing `if`s (which often bound the thread index):
        // under one, only an access out of bounds for every address in its range is an error.
        let wrong = if self.guarded > 0 {
            hi < 0 || lo.saturating_add(bytes) > shared
        } else {
            lo < 0 || hi.saturating_add(bytes) > shared
        };
        if wrong {
            self.error(format!(
                "a shared access of {bytes} bytes at {lo}..={hi} is outside the kernel's \
                 {shared} shared bytes"
            ));
        }
    }

    fn regs_of(&mut self, regs: &[Reg], ty: Ty, what: &str) {
        for r in regs {
            if let Some(t) = self.reg(*r)
                && t != ty
            {
                self.error(format!("{what} register %{} is {t}, expected {ty}", r.0));
            }
        }
    }

    /// Checks a block; `divergent` says whether threads of a CTA may disagree on reaching it.
    fn block(&mut self, body: &[Stmt], divergent: bool) {
        for (i, s) in body.iter().enumerate() {
            self.at.push(i);
            self.stmt(s, divergent);
            self.at.pop();
        }
    }

    /// A loop: an i64 counter, start and end; a positive step; its body divergent when either
    /// bound depends on the thread.
    fn for_loop(
        &mut self,
        reg: Reg,
        [start, end]: [&Expr; 2],
        step: i64,
        body: &[Stmt],
        divergent: bool,
    ) {
        if let Some(t) = self.reg(reg)
            && t != Ty::I64
        {
            self.error(format!("a loop counter of type {t}"));
        }
        self.expect(start, Ty::I64, "a loop's start");
        self.expect(end, Ty::I64, "a loop's end");
        if step <= 0 {
            self.error(format!("a loop step of {step} (it must be positive)"));
        }
        let inner = divergent
            || depends_on_thread(start, &self.divergent)
            || depends_on_thread(end, &self.divergent);
        self.block(body, inner);
    }

    /// A TMA copy: shared destination and barrier, a tensor-map parameter, 1 to 5 i32
    /// coordinates.
    fn tma_load(&mut self, dst: &Expr, map: u32, coords: &[Expr], bar: &Expr) {
        self.address(Space::Shared, dst, 16);
        self.address(Space::Shared, bar, 8);
        match self.kernel.params.get(map as usize) {
            Some((_, Ty::TensorMap)) => {}
            Some((name, ty)) => {
                self.error(format!("a TMA copy's map `${name}` is {ty}, not tensormap"))
            }
            None => self.error(format!("a TMA copy's map parameter {map} does not exist")),
        }
        if !(1..=5).contains(&coords.len()) {
            self.error(format!(
                "a TMA copy with {} coordinates (1 to 5)",
                coords.len()
            ));
        }
        for c in coords {
            self.expect(c, Ty::I32, "a TMA coordinate");
        }
    }

    /// A `wgmma`: N a multiple of 8 up to 256, N / 2 f32 accumulators, and its steps' operands.
    fn wgmma(&mut self, w: &Wgmma) {
        if w.n == 0 || w.n > 256 || !w.n.is_multiple_of(8) {
            self.error(format!(
                "a wgmma with N {} (a multiple of 8 up to 256)",
                w.n
            ));
        }
        if w.d.len() != w.n as usize / 2 {
            self.error(format!(
                "a wgmma of N {} takes {} accumulator registers, found {}",
                w.n,
                w.n / 2,
                w.d.len()
            ));
        }
        self.regs_of(&w.d, Ty::F32, "a wgmma accumulator");
        self.expect(&w.accumulate, Ty::Pred, "a wgmma's accumulate flag");
        if w.steps.is_empty() {
            self.error("a wgmma with no steps".into());
        }
        for (a, b) in &w.steps {
            match a {
                WgmmaA::Shared(desc) => self.expect(desc, Ty::I64, "a wgmma A descriptor"),
                WgmmaA::Regs(regs) => self.regs_of(regs, Ty::I32, "a wgmma A fragment"),
            }
            self.expect(b, Ty::I64, "a wgmma B descriptor");
        }
    }

    fn stmt(&mut self, s: &Stmt, divergent: bool) {
        match s {
            Stmt::Set(r, e) => {
                if let (Some(want), Some(got)) = (self.reg(*r), self.ty(e))
                    && want != got
                {
                    let name = &self.kernel.regs[r.0 as usize].0;
                    self.error(format!("%{name} is {want}, assigned a {got}"));
                }
            }
            Stmt::Store(space, addr, value) => {
                let bytes = match self.ty(value) {
                    Some(Ty::Pred) => {
                        self.error("a store of a predicate".into());
                        return;
                    }
                    Some(Ty::I64) => 8,
                    _ => 4,
                };
                self.address(*space, addr, bytes);
            }
            Stmt::If(c, then, otherwise) => {
                self.expect(c, Ty::Pred, "an if's condition");
                let inner = divergent || depends_on_thread(c, &self.divergent);
                self.guarded += 1;
                self.block(then, inner);
                let offset = then.len();
                for (i, s) in otherwise.iter().enumerate() {
                    self.at.push(offset + i);
                    self.stmt(s, inner);
                    self.at.pop();
                }
                self.guarded -= 1;
            }
            Stmt::For {
                reg,
                start,
                end,
                step,
                body,
            } => self.for_loop(*reg, [start, end], *step, body, divergent),
            Stmt::Barrier => {
                if divergent {
                    self.error(
                        "bar.sync under control flow that depends on the thread (threads of \
                         the CTA may not all reach it)"
                            .into(),
                    );
                }
            }
            Stmt::Mma { d, a, b, c, .. } => {
                self.regs_of(d, Ty::F32, "an mma result");
                self.regs_of(c, Ty::F32, "an mma accumulator");
                self.regs_of(a, Ty::I32, "an mma A fragment");
                self.regs_of(b, Ty::I32, "an mma B fragment");
            }
            Stmt::LdMatrix { dst, addr, .. } => {
                if ![1, 2, 4].contains(&dst.len()) {
                    self.error(format!("ldmatrix of {} matrices (1, 2 or 4)", dst.len()));
                }
                self.regs_of(dst, Ty::I32, "an ldmatrix");
                self.address(Space::Shared, addr, 16);
            }
            Stmt::CpAsync {
                dst,
                src,
                src_bytes,
            } => {
                self.address(Space::Shared, dst, 16);
                self.expect(src, Ty::I64, "cp.async's source");
                self.expect(src_bytes, Ty::I32, "cp.async's byte count");
            }
            Stmt::CpAsyncCommit | Stmt::CpAsyncWait(_) | Stmt::FenceProxyAsync => {}
            Stmt::MbarInit { bar, count } => {
                self.address(Space::Shared, bar, 8);
                if *count == 0 || *count >= 1 << 20 {
                    self.error(format!(
                        "an mbarrier of {count} arrivals (1 to {})",
                        (1 << 20) - 1
                    ));
                }
            }
            Stmt::MbarArrive { bar, tx } => {
                self.address(Space::Shared, bar, 8);
                if let Some(tx) = tx {
                    self.expect(tx, Ty::I32, "an mbarrier's transaction bytes");
                }
            }
            Stmt::MbarWait { bar, parity } => {
                self.address(Space::Shared, bar, 8);
                self.expect(parity, Ty::I32, "an mbarrier wait's parity");
            }
            Stmt::TmaLoad {
                dst,
                map,
                coords,
                bar,
            } => self.tma_load(dst, *map, coords, bar),
            Stmt::Wgmma(w) => self.wgmma(w),
            Stmt::WgmmaWait { regs, .. } => self.regs_of(regs, Ty::F32, "a wgmma wait's"),
            Stmt::NamedBarrier { id, threads, .. } => {
                self.expect(id, Ty::I32, "a named barrier's id");
                if *threads == 0 || !threads.is_multiple_of(32) || *threads > 1024 {
                    self.error(format!(
                        "a named barrier of {threads} threads (a multiple of 32 up to 1024)"
                    ));
                }
            }
            Stmt::SetMaxNReg { regs, .. } => {
                if !(24..=256).contains(regs) || regs % 8 != 0 {
                    self.error(format!(
                        "setmaxnreg to {regs} registers (24 to 256, a multiple of 8)"
                    ));
                }
            }
        }
    }
}

/// Whether an expression can differ between threads of a CTA, given which registers can.
fn depends_on_thread(e: &Expr, divergent: &[bool]) -> bool {
    match e {
        Expr::Special(Special::Tid | Special::Lane) | Expr::ShflXor(..) => true,
        Expr::Special(Special::Ntid | Special::Ctaid(_)) => false,
        Expr::Int(..) | Expr::F32(_) | Expr::Pred(_) | Expr::Param(_) => false,
        Expr::Reg(r) => divergent.get(r.0 as usize).copied().unwrap_or(true),
        Expr::Un(_, a)
        | Expr::Cast(a, _)
        | Expr::Load(_, _, a)
        | Expr::LoadHalf(_, _, a)
        | Expr::Table(_, a)
        | Expr::SharedAddress(a) => depends_on_thread(a, divergent),
        Expr::Bin(_, a, b) | Expr::PackHalf(_, a, b) => {
            depends_on_thread(a, divergent) || depends_on_thread(b, divergent)
        }
        Expr::Fma(a, b, c) | Expr::Select(a, b, c) => {
            [a, b, c].iter().any(|x| depends_on_thread(x, divergent))
        }
    }
}

/// Which registers can differ between threads of a CTA: those assigned a thread-dependent
/// value, or assigned under thread-dependent control flow, or written by warp-collective
/// operations (fixed point).
fn divergent_registers(kernel: &Kernel) -> Vec<bool> {
    fn mark(r: &Reg, d: &mut [bool], changed: &mut bool) {
        if let Some(slot) = d.get_mut(r.0 as usize)
            && !*slot
        {
            *slot = true;
            *changed = true;
        }
    }
    fn walk(body: &[Stmt], under: bool, d: &mut Vec<bool>, changed: &mut bool) {
        for s in body {
            match s {
                Stmt::Set(r, e) if under || depends_on_thread(e, d) => mark(r, d, changed),
                Stmt::If(c, t, e) => {
                    let inner = under || depends_on_thread(c, d);
                    walk(t, inner, d, changed);
                    walk(e, inner, d, changed);
                }
                Stmt::For {
                    reg,
                    start,
                    end,
                    body,
                    ..
                } => {
                    let inner = under || depends_on_thread(start, d) || depends_on_thread(end, d);
                    if inner {
                        mark(reg, d, changed);
                    }
                    walk(body, inner, d, changed);
                }
                Stmt::Mma { d: out, .. } => out.iter().for_each(|r| mark(r, d, changed)),
                Stmt::LdMatrix { dst, .. } => dst.iter().for_each(|r| mark(r, d, changed)),
                Stmt::Wgmma(w) => w.d.iter().for_each(|r| mark(r, d, changed)),
                _ => {}
            }
        }
    }
    let mut divergent = vec![false; kernel.regs.len()];
    loop {
        let mut changed = false;
        walk(&kernel.body, false, &mut divergent, &mut changed);
        if !changed {
            return divergent;
        }
    }
}

/// The values each integer register can hold, where bounded: a register assigned once (outside
/// any loop that could reassign it from a value it depends on) takes its value's range; a loop
/// counter with bounded `start` and `end` takes `start.lo..end.hi`. Registers assigned more than
/// once are unbounded, so a bound is never a union of unrelated values.
fn register_ranges(kernel: &Kernel) -> Vec<Option<(i64, i64)>> {
    fn count(body: &[Stmt], n: &mut [u32]) {
        for s in body {
            let mut bump = |r: &Reg| {
                if let Some(c) = n.get_mut(r.0 as usize) {
                    *c = c.saturating_add(1);
                }
            };
            match s {
                Stmt::Set(r, _) => bump(r),
                Stmt::If(_, t, e) => {
                    count(t, n);
                    count(e, n);
                }
                Stmt::For { reg, body, .. } => {
                    bump(reg);
                    count(body, n);
                }
                Stmt::Mma { d, .. } => d.iter().for_each(bump),
                Stmt::LdMatrix { dst, .. } => dst.iter().for_each(bump),
                Stmt::Wgmma(w) => w.d.iter().for_each(bump),
                _ => {}
            }
        }
    }
    fn walk(body: &[Stmt], k: &Kernel, once: &[bool], r: &mut [Option<(i64, i64)>]) {
        for s in body {
            match s {
                Stmt::Set(reg, e) if once.get(reg.0 as usize) == Some(&true) => {
                    r[reg.0 as usize] = range(e, r, k.threads);
                }
                Stmt::If(_, t, e) => {
                    walk(t, k, once, r);
                    walk(e, k, once, r);
                }
                Stmt::For {
                    reg,
                    start,
                    end,
                    body,
                    ..
                } => {
                    if once.get(reg.0 as usize) == Some(&true) {
                        r[reg.0 as usize] =
                            match (range(start, r, k.threads), range(end, r, k.threads)) {
                                (Some((lo, _)), Some((_, hi))) => {
                                    Some((lo, hi.saturating_sub(1).max(lo)))
                                }
                                _ => None,
                            };
                    }
                    walk(body, k, once, r);
                }
                _ => {}
            }
        }
    }
    let mut assignments = vec![0u32; kernel.regs.len()];
    count(&kernel.body, &mut assignments);
    let once: Vec<bool> = assignments.iter().map(|&n| n == 1).collect();
    // A register read before its one assignment (in program order) is read as unbounded: the
    // walk fills ranges in program order and starts from nothing.
    let mut ranges = vec![None; kernel.regs.len()];
    walk(&kernel.body, kernel, &once, &mut ranges);
    ranges
}

/// The values an integer expression can take, where bounded.
fn range(e: &Expr, regs: &[Option<(i64, i64)>], threads: u32) -> Option<(i64, i64)> {
    let r = |x: &Expr| range(x, regs, threads);
    let threads = i64::from(threads.max(1));
    match e {
        Expr::Int(x, _) => Some((*x, *x)),
        Expr::Special(Special::Tid) => Some((0, threads - 1)),
        Expr::Special(Special::Lane) => Some((0, 31)),
        Expr::Special(Special::Ntid) => Some((threads, threads)),
        Expr::Reg(reg) => regs.get(reg.0 as usize).copied().flatten(),
        // An I32 value past i32's range would have wrapped: only ranges inside it carry over.
        Expr::Cast(a, Ty::I64) => {
            r(a).filter(|&(lo, hi)| lo >= i64::from(i32::MIN) && hi <= i64::from(i32::MAX))
        }
        Expr::Bin(op, a, b) => {
            let ((a0, a1), (b0, b1)) = (r(a)?, r(b)?);
            let corners = |f: fn(i64, i64) -> Option<i64>| -> Option<(i64, i64)> {
                let v = [f(a0, b0)?, f(a0, b1)?, f(a1, b0)?, f(a1, b1)?];
                Some((*v.iter().min()?, *v.iter().max()?))
            };
            match op {
                Bin::Add => Some((a0.checked_add(b0)?, a1.checked_add(b1)?)),
                Bin::Sub => Some((a0.checked_sub(b1)?, a1.checked_sub(b0)?)),
                Bin::Mul => corners(i64::checked_mul),
                Bin::Min => Some((a0.min(b0), a1.min(b1))),
                Bin::Max => Some((a0.max(b0), a1.max(b1))),
                // Truncating division by a positive constant range is monotonic.
                Bin::Div if b0 > 0 => corners(i64::checked_div),
                Bin::Rem if b0 > 0 && a0 >= 0 => Some((0, a1.min(b1 - 1))),
                Bin::Shl if b0 >= 0 && b1 < 63 && a0 >= 0 => {
                    Some((a0.checked_shl(b0 as u32)?, a1.checked_mul(1 << b1)?))
                }
                _ => None,
            }
        }
        _ => None,
    }
}
