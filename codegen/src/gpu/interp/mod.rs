//! Runs GPU IR on the CPU, CTA by CTA, every thread of a CTA in lockstep statement by
//! statement (divergent branches and loops run under an active mask, like a SIMT stack). It
//! checks what the hardware would not: memory accesses in bounds, barriers reached by every
//! thread, shuffles from active lanes, well-typed operands, and shared-memory races between
//! warps that lockstep execution would hide (a byte one warp wrote or read, touched by another
//! with no barrier between, or with no mbarrier phase between; see [`hazards`]). Hopper's
//! asynchronous operations (mbarriers, TMA, `wgmma`) follow the PTX ISA ([`hopper`]). Errors,
//! never panics. Expressions are evaluated in `eval.rs`, memory is `memory.rs`, control flow
//! steps in `stepper.rs`; statements run here.

mod eval;
mod hazards;
mod hopper;
mod memory;
mod stepper;

pub use memory::Memory;

use super::ir::{Expr, Half, Kernel, Reg, Space, Stmt, Ty};
use hazards::Hazards;
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};

/// The first threads of the warps that execute a warp-collective operation: warps with any
/// active lane, each of which must have all 32 active.
fn collective_warps(mask: &[bool], op: &str) -> Result<Vec<usize>, String> {
    let mut warps = Vec::new();
    for warp in (0..mask.len()).step_by(32) {
        let lanes = warp..(warp + 32).min(mask.len());
        if !lanes.clone().any(|t| mask[t]) {
            continue;
        }
        if lanes.len() < 32 || !lanes.clone().all(|t| mask[t]) {
            return Err(format!(
                "{op} in warp {} without all 32 lanes active",
                warp / 32
            ));
        }
        warps.push(warp);
    }
    Ok(warps)
}

/// A runtime value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Val {
    /// A predicate.
    P(bool),
    /// An I32.
    I32(i32),
    /// An I64.
    I64(i64),
    /// An F32.
    F(f32),
}

impl Val {
    fn zero(ty: Ty) -> Val {
        match ty {
            Ty::Pred => Val::P(false),
            Ty::I32 => Val::I32(0),
            Ty::I64 | Ty::TensorMap => Val::I64(0),
            Ty::F32 => Val::F(0.0),
        }
    }

    fn int(self) -> Result<i64, String> {
        match self {
            Val::I32(x) => Ok(i64::from(x)),
            Val::I64(x) => Ok(x),
            other => Err(format!("expected an integer, got {other:?}")),
        }
    }

    fn float(self) -> Result<f32, String> {
        match self {
            Val::F(x) => Ok(x),
            other => Err(format!("expected an f32, got {other:?}")),
        }
    }

    fn pred(self) -> Result<bool, String> {
        match self {
            Val::P(x) => Ok(x),
            other => Err(format!("expected a predicate, got {other:?}")),
        }
    }
}

/// Runs `kernel` over a grid of CTAs with the given arguments (one per parameter, of its type).
pub fn run(
    kernel: &Kernel,
    grid: [u32; 3],
    args: &[Val],
    memory: &mut Memory,
) -> Result<(), String> {
    if args.len() != kernel.params.len() {
        return Err(format!(
            "{} takes {} arguments, got {}",
            kernel.name,
            kernel.params.len(),
            args.len()
        ));
    }
    for z in 0..grid[2] {
        for y in 0..grid[1] {
            for x in 0..grid[0] {
                let (threads, bytes) = (kernel.threads as usize, kernel.shared_bytes as usize);
                let mut cta = Cta {
                    kernel,
                    args,
                    ctaid: [x, y, z],
                    regs: vec![kernel.regs.iter().map(|(_, t)| Val::zero(*t)).collect(); threads],
                    shared: vec![0; bytes],
                    copies: (0..threads).map(|_| ThreadCopies::default()).collect(),
                    in_flight: vec![0; bytes],
                    hazards: RefCell::new(Hazards::new(bytes, threads.div_ceil(32))),
                    generic_writes: vec![0; bytes],
                    mbarriers: HashMap::new(),
                    mma_groups: (0..threads.div_ceil(128))
                        .map(|_| VecDeque::new())
                        .collect(),
                    busy: vec![vec![0; kernel.regs.len()]; threads],
                    busy_count: 0,
                    named: HashMap::new(),
                    named_wait: vec![None; threads],
                    memory,
                };
                cta.run_body()
                    .and_then(|()| cta.all_copies_waited())
                    .and_then(|()| cta.all_products_waited())
                    .map_err(|e| format!("{} CTA ({x}, {y}, {z}): {e}", kernel.name))?;
            }
        }
    }
    Ok(())
}

struct Cta<'a> {
    kernel: &'a Kernel,
    args: &'a [Val],
    ctaid: [u32; 3],
    regs: Vec<Vec<Val>>,
    shared: Vec<u8>,
    /// Each thread's `cp.async` copies not yet completed.
    copies: Vec<ThreadCopies>,
    /// Per shared byte: whether a copy in flight will write it (1) or not (0).
    in_flight: Vec<u8>,
    /// Who touched each shared byte, and what orders the CTA's warps.
    hazards: RefCell<Hazards>,
    /// Per shared byte: 1 + the warp whose ordinary store wrote it with no `fence.proxy.async`
    /// after it (0: none).
    generic_writes: Vec<u8>,
    /// The CTA's mbarriers by shared offset.
    mbarriers: HashMap<usize, hopper::Mbar>,
    /// Per warpgroup: its committed `wgmma` groups in flight, oldest first.
    mma_groups: Vec<VecDeque<hopper::MmaGroup>>,
    /// Per thread and register: how many `wgmma` groups in flight use it.
    busy: Vec<Vec<u16>>,
    /// The sum of `busy`.
    busy_count: usize,
    /// Named barriers by id.
    named: HashMap<i64, hopper::Named>,
    /// Per thread: the named barrier and phase it arrived at and waits for.
    named_wait: Vec<Option<(i64, u64)>>,
    memory: &'a mut Memory,
}

/// Copies a value's little-endian bytes to the front of `out`; returns how many.
fn write_le(out: &mut [u8; 8], bytes: &[u8]) -> usize {
    out[..bytes.len()].copy_from_slice(bytes);
    bytes.len()
}

/// A `cp.async` copy in flight: where it lands and its 16 bytes (read at issue: global memory
/// is not written while a kernel reads its inputs).
struct PendingCopy {
    dst: usize,
    data: [u8; 16],
}

/// One thread's copies in flight: committed groups, oldest first, and its open group.
#[derive(Default)]
struct ThreadCopies {
    committed: std::collections::VecDeque<Vec<PendingCopy>>,
    open: Vec<PendingCopy>,
}

impl Cta<'_> {
    /// One statement other than `if` and `for` (which [`stepper`] runs) for the active threads.
    fn leaf(&mut self, stmt: &Stmt, mask: &[bool]) -> Result<(), String> {
        match stmt {
            Stmt::Set(r, e) => {
                let values = self.eval_all(e, mask)?;
                for (t, v) in values.into_iter().enumerate() {
                    if let Some(v) = v {
                        self.check_not_busy(t, *r)?;
                        self.regs[t][r.0 as usize] = v;
                    }
                }
            }
            Stmt::Store(space, addr, value) => {
                let addrs = self.eval_all(addr, mask)?;
                let values = self.eval_all(value, mask)?;
                for (t, (a, v)) in addrs.into_iter().zip(values).enumerate() {
                    if let (Some(a), Some(v)) = (a, v) {
                        let mut bytes = [0u8; 8];
                        let len = match v {
                            Val::F(x) => write_le(&mut bytes, &x.to_le_bytes()),
                            Val::I32(x) => write_le(&mut bytes, &x.to_le_bytes()),
                            Val::I64(x) => write_le(&mut bytes, &x.to_le_bytes()),
                            Val::P(_) => return Err("cannot store a predicate".into()),
                        };
                        self.store(*space, a.int()?, &bytes[..len], t / 32)?;
                    }
                }
            }
            Stmt::If(..) | Stmt::For { .. } => {
                return Err("control flow reached a leaf statement".into());
            }
            Stmt::Mma { half, d, a, b, c } => self.mma(mask, *half, *d, *a, *b, *c)?,
            Stmt::CpAsync {
                dst,
                src,
                src_bytes,
            } => self.cp_async(mask, dst, src, src_bytes)?,
            Stmt::CpAsyncCommit => {
                for (t, copies) in self.copies.iter_mut().enumerate() {
                    if mask[t] {
                        let group = std::mem::take(&mut copies.open);
                        copies.committed.push_back(group);
                    }
                }
            }
            Stmt::CpAsyncWait(n) => {
                for t in (0..mask.len()).filter(|&t| mask[t]) {
                    while self.copies[t].committed.len() > *n as usize {
                        let group = self.copies[t].committed.pop_front().expect("a group");
                        for copy in group {
                            self.shared[copy.dst..copy.dst + 16].copy_from_slice(&copy.data);
                            self.in_flight[copy.dst..copy.dst + 16].fill(0);
                            self.hazards.borrow_mut().write(t / 32, copy.dst, 16)?;
                            self.generic_writes[copy.dst..copy.dst + 16].fill((t / 32 + 1) as u8);
                        }
                    }
                }
            }
            Stmt::LdMatrix { dst, addr, trans } => self.ldmatrix(mask, dst, addr, *trans)?,
            Stmt::Barrier => {
                if !mask.iter().all(|&m| m) {
                    let waiting = mask.iter().filter(|&&m| m).count();
                    return Err(format!(
                        "bar.sync reached by {waiting} of {} threads (divergent barrier)",
                        mask.len()
                    ));
                }
                self.hazards.borrow_mut().barrier();
            }
            Stmt::MbarInit { bar, count } => self.mbar_init(mask, bar, *count)?,
            Stmt::MbarArrive { bar, tx } => self.mbar_arrive(mask, bar, tx.as_ref())?,
            Stmt::MbarWait { bar, parity } => self.mbar_wait(mask, bar, parity)?,
            Stmt::TmaLoad {
                dst,
                map,
                coords,
                bar,
            } => self.tma_load(mask, dst, *map, coords, bar)?,
            Stmt::FenceProxyAsync => self.fence_proxy_async(mask),
            Stmt::Wgmma(w) => self.wgmma(mask, w)?,
            Stmt::WgmmaWait { groups, regs } => self.wgmma_wait(mask, *groups, regs)?,
            Stmt::SetMaxNReg { regs, .. } => self.setmaxnreg(mask, *regs)?,
            Stmt::NamedBarrier {
                id,
                threads,
                wait: false,
            } => self.named_arrive(mask, id, *threads, false)?,
            Stmt::NamedBarrier { wait: true, .. } => {
                return Err("bar.sync on a named barrier reached a leaf statement".into());
            }
        }
        Ok(())
    }

    /// `mma.m16n8k16` for every warp with active lanes: gathers the fragments by the PTX ISA
    /// layout (lane = 4 group + thread-in-group), multiplies exactly (bf16 products are exact in
    /// f64) and rounds each result to f32 once.
    fn mma(
        &mut self,
        mask: &[bool],
        half: Half,
        d: [Reg; 4],
        a: [Reg; 4],
        b: [Reg; 2],
        c: [Reg; 4],
    ) -> Result<(), String> {
        for warp in collective_warps(mask, "mma.sync")? {
            let (mut am, mut bm, mut cm) = ([[0f64; 16]; 16], [[0f64; 8]; 16], [[0f64; 8]; 16]);
            for lane in 0..32 {
                let (g, q) = (lane / 4, lane % 4);
                let regs = &self.regs[warp + lane];
                let halves = |r: Reg| -> Result<(f64, f64), String> {
                    let bits = regs[r.0 as usize].int()? as u32;
                    let f = |h: u32| match half {
                        Half::Bf16 => f64::from(f32::from_bits(h << 16)),
                        Half::F16 => f64::from(half::f16::from_bits(h as u16).to_f32()),
                    };
                    Ok((f(bits & 0xffff), f(bits >> 16)))
                };
                for (i, &r) in a.iter().enumerate() {
                    let (row, col) = (g + 8 * (i % 2), 2 * q + 8 * (i / 2));
                    (am[row][col], am[row][col + 1]) = halves(r)?;
                }
                for (i, &r) in b.iter().enumerate() {
                    let k = 2 * q + 8 * i;
                    (bm[k][g], bm[k + 1][g]) = halves(r)?;
                }
                for (i, &r) in c.iter().enumerate() {
                    cm[g + 8 * (i / 2)][2 * q + i % 2] = f64::from(regs[r.0 as usize].float()?);
                }
            }
            for lane in 0..32 {
                let (g, q) = (lane / 4, lane % 4);
                for (i, &r) in d.iter().enumerate() {
                    let (row, col) = (g + 8 * (i / 2), 2 * q + i % 2);
                    let sum: f64 =
                        (0..16).map(|k| am[row][k] * bm[k][col]).sum::<f64>() + cm[row][col];
                    self.regs[warp + lane][r.0 as usize] = Val::F(sum as f32);
                }
            }
        }
        Ok(())
    }

    /// Issues a `cp.async` for every active thread: checks alignment, bounds and overlap with
    /// copies in flight, reads the source now and lands the bytes at the group's wait.
    fn cp_async(
        &mut self,
        mask: &[bool],
        dst: &Expr,
        src: &Expr,
        src_bytes: &Expr,
    ) -> Result<(), String> {
        let (dsts, srcs, lens) = (
            self.eval_all(dst, mask)?,
            self.eval_all(src, mask)?,
            self.eval_all(src_bytes, mask)?,
        );
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let (d, s) = (
                dsts[t].ok_or("inactive")?.int()?,
                srcs[t].ok_or("inactive")?.int()?,
            );
            let n = lens[t].ok_or("inactive")?.int()?;
            if !(0..=16).contains(&n) {
                return Err(format!("cp.async of {n} source bytes (0 to 16)"));
            }
            if d % 16 != 0 || s % 16 != 0 {
                return Err(format!(
                    "cp.async addresses must be 16-byte aligned (shared {d}, global {s:#x}, thread {t})"
                ));
            }
            let d = usize::try_from(d)
                .ok()
                .filter(|d| d + 16 <= self.shared.len())
                .ok_or_else(|| {
                    format!(
                        "cp.async to shared {d} is outside {} bytes",
                        self.shared.len()
                    )
                })?;
            if self.in_flight[d..d + 16].iter().any(|&b| b != 0) {
                return Err(format!("cp.async to shared {d} overlaps a copy in flight"));
            }
            let mut data = [0u8; 16];
            if n > 0 {
                data[..n as usize].copy_from_slice(self.memory.bytes(s, n as usize)?);
            }
            self.in_flight[d..d + 16].fill(1);
            self.hazards.borrow_mut().write(t / 32, d, 16)?;
            self.copies[t].open.push(PendingCopy { dst: d, data });
        }
        Ok(())
    }

    /// At the end of a CTA: every copy was waited for.
    fn all_copies_waited(&self) -> Result<(), String> {
        match self
            .copies
            .iter()
            .position(|c| !c.open.is_empty() || c.committed.iter().any(|g| !g.is_empty()))
        {
            Some(t) => Err(format!(
                "thread {t} ended with cp.async copies never waited for"
            )),
            None => Ok(()),
        }
    }

    /// An mbarrier's bytes are only operands of mbarrier operations.
    fn check_not_mbarrier(&self, a: usize, len: usize) -> Result<(), String> {
        if self.mbarriers.is_empty() {
            return Ok(());
        }
        match (a & !7..a + len)
            .step_by(8)
            .find(|b| self.mbarriers.contains_key(b))
        {
            Some(b) => Err(format!(
                "an ordinary shared access of {len} bytes at {a} touches the mbarrier at {b}"
            )),
            None => Ok(()),
        }
    }

    /// Shared bytes a copy in flight will still write may be neither read nor written.
    fn check_not_in_flight(&self, a: usize, len: usize) -> Result<(), String> {
        match self.in_flight.get(a..a + len) {
            Some(bytes) if bytes.iter().any(|&b| b != 0) => Err(format!(
                "shared access of {len} bytes at {a} races a cp.async not yet waited for"
            )),
            _ => Ok(()),
        }
    }

    /// `ldmatrix` for every warp with active lanes: reads the rows the lanes address (checking
    /// alignment and bounds) and hands out their 16-bit elements by the PTX ISA layout.
    fn ldmatrix(
        &mut self,
        mask: &[bool],
        dst: &[Reg],
        addr: &Expr,
        trans: bool,
    ) -> Result<(), String> {
        if ![1, 2, 4].contains(&dst.len()) {
            return Err(format!("ldmatrix of {} matrices", dst.len()));
        }
        let addrs = self.eval_all(addr, mask)?;
        for warp in collective_warps(mask, "ldmatrix")? {
            // matrices[i][row][col]: the 16-bit elements.
            let mut matrices = vec![[[0u16; 8]; 8]; dst.len()];
            for (i, matrix) in matrices.iter_mut().enumerate() {
                for (row, values) in matrix.iter_mut().enumerate() {
                    let lane = warp + 8 * i + row;
                    let a = addrs[lane].ok_or("inactive lane")?.int()?;
                    if a % 16 != 0 {
                        return Err(format!(
                            "ldmatrix row address {a} (lane {}) is not 16-byte aligned",
                            lane % 32
                        ));
                    }
                    for (col, value) in values.iter_mut().enumerate() {
                        let Val::I32(bits) =
                            self.load(Space::Shared, Ty::I32, a + 4 * (col as i64 / 2), warp / 32)?
                        else {
                            unreachable!("an I32 load")
                        };
                        *value = (bits as u32 >> (16 * (col % 2))) as u16;
                    }
                }
            }
            for lane in 0..32 {
                let (g, q) = (lane / 4, lane % 4);
                for (i, r) in dst.iter().enumerate() {
                    let m = &matrices[i];
                    let (lo, hi) = if trans {
                        (m[2 * q][g], m[2 * q + 1][g])
                    } else {
                        (m[g][2 * q], m[g][2 * q + 1])
                    };
                    let bits = (u32::from(hi) << 16) | u32::from(lo);
                    self.regs[warp + lane][r.0 as usize] = Val::I32(bits as i32);
                }
            }
        }
        Ok(())
    }

    /// A store by a thread of `warp`.
    fn store(&mut self, space: Space, addr: i64, bytes: &[u8], warp: usize) -> Result<(), String> {
        match space {
            Space::Global => self.memory.write(addr, bytes),
            Space::Shared => {
                let a = usize::try_from(addr).map_err(|_| format!("shared address {addr}"))?;
                self.check_not_in_flight(a, bytes.len())?;
                self.check_not_mbarrier(a, bytes.len())?;
                self.hazards.borrow_mut().write(warp, a, bytes.len())?;
                if let Some(w) = self.generic_writes.get_mut(a..a + bytes.len()) {
                    w.fill((warp + 1) as u8);
                }
                let dst = self.shared.get_mut(a..a + bytes.len()).ok_or_else(|| {
                    format!(
                        "shared store of {} bytes at {a} is outside {} bytes",
                        bytes.len(),
                        self.kernel.shared_bytes
                    )
                })?;
                dst.copy_from_slice(bytes);
                Ok(())
            }
        }
    }

    /// `len` (at most 8) bytes at an address, read by a thread of `warp`, as a little-endian
    /// word zero-extended to eight bytes.
    fn load_bytes(
        &self,
        space: Space,
        addr: i64,
        len: usize,
        warp: usize,
    ) -> Result<[u8; 8], String> {
        if len > 8 {
            return Err(format!("a load of {len} bytes into one register"));
        }
        if space == Space::Shared
            && let Ok(a) = usize::try_from(addr)
        {
            self.check_not_in_flight(a, len)?;
            self.check_not_mbarrier(a, len)?;
            self.hazards.borrow_mut().read(warp, a, len)?;
        }
        let bytes: &[u8] = match space {
            Space::Global => self.memory.bytes(addr, len)?,
            Space::Shared => usize::try_from(addr)
                .ok()
                .and_then(|a| self.shared.get(a..a + len))
                .ok_or_else(|| {
                    format!(
                        "shared load of {len} bytes at {addr} is outside {} bytes",
                        self.kernel.shared_bytes
                    )
                })?,
        };
        let mut word = [0u8; 8];
        word[..len].copy_from_slice(bytes);
        Ok(word)
    }

    fn load(&self, space: Space, ty: Ty, addr: i64, warp: usize) -> Result<Val, String> {
        let len = match ty {
            Ty::I64 => 8,
            Ty::Pred => return Err("cannot load a predicate".into()),
            _ => 4,
        };
        let word = self.load_bytes(space, addr, len, warp)?;
        let [a, b, c, d, ..] = word;
        Ok(match ty {
            Ty::F32 => Val::F(f32::from_le_bytes([a, b, c, d])),
            Ty::I32 => Val::I32(i32::from_le_bytes([a, b, c, d])),
            _ => Val::I64(i64::from_le_bytes(word)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::ir::build::*;
    use super::super::ir::{Bin, Reg, Special, Stmt};
    use super::*;

    fn kernel(threads: u32, shared: u32, regs: &[Ty], body: Vec<Stmt>) -> Kernel {
        Kernel {
            name: "t".into(),
            params: vec![("out".into(), Ty::I64)],
            regs: regs
                .iter()
                .enumerate()
                .map(|(i, t)| (format!("r{i}"), *t))
                .collect(),
            shared_bytes: shared,
            threads,
            ctas_per_sm: 1,
            body,
        }
    }

    #[test]
    fn shuffles_sum_a_warp_and_barriers_order_shared_memory() {
        // r0 = tid as f32; butterfly sum over the warp; thread 0 of each warp writes it to
        // shared; after the barrier thread 0 adds the two warps' sums and stores the total.
        let tid = cast(Expr::Special(Special::Tid), Ty::I64);
        let mut body = vec![Stmt::Set(
            Reg(0),
            cast(Expr::Special(Special::Tid), Ty::F32),
        )];
        for m in [16, 8, 4, 2, 1] {
            body.push(Stmt::Set(
                Reg(0),
                add(reg(Reg(0)), Expr::ShflXor(Box::new(reg(Reg(0))), m)),
            ));
        }
        let lane0 = bin(Bin::Eq, Expr::Special(Special::Lane), Expr::Int(0, Ty::I32));
        body.push(Stmt::If(
            lane0,
            vec![Stmt::Store(
                Space::Shared,
                bin(Bin::Div, tid.clone(), i64(8)),
                reg(Reg(0)),
            )],
            vec![],
        ));
        body.push(Stmt::Barrier);
        let total = add(
            load(Space::Shared, Ty::F32, i64(0)),
            load(Space::Shared, Ty::F32, i64(4)),
        );
        body.push(Stmt::If(
            bin(Bin::Eq, tid, i64(0)),
            vec![Stmt::Store(Space::Global, Expr::Param(0), total)],
            vec![],
        ));
        let k = kernel(64, 8, &[Ty::F32], body);
        let mut mem = Memory::default();
        let out = mem.alloc_f32(&[0.0]);
        run(&k, [1, 1, 1], &[Val::I64(out)], &mut mem).unwrap();
        assert_eq!(mem.read_f32(out, 1).unwrap(), [(0..64).sum::<i32>() as f32]);
    }

    #[test]
    fn what_the_hardware_would_not_check_is_an_error() {
        let tid = cast(Expr::Special(Special::Tid), Ty::I64);
        let divergent = vec![Stmt::If(
            bin(Bin::Lt, tid.clone(), i64(3)),
            vec![Stmt::Barrier],
            vec![],
        )];
        let oob = vec![Stmt::Store(
            Space::Global,
            add(Expr::Param(0), i64(4)),
            f32(1.0),
        )];
        let shfl = vec![Stmt::If(
            bin(Bin::Lt, tid, i64(16)),
            vec![Stmt::Set(Reg(0), Expr::ShflXor(Box::new(f32(1.0)), 16))],
            vec![],
        )];
        for (body, needle) in [
            (divergent, "divergent barrier"),
            (oob, "outside every buffer"),
            (shfl, "inactive lane"),
        ] {
            let k = kernel(32, 0, &[Ty::F32], body);
            let mut mem = Memory::default();
            let out = mem.alloc_f32(&[0.0]);
            let err = run(&k, [1, 1, 1], &[Val::I64(out)], &mut mem).unwrap_err();
            assert!(err.contains(needle), "{err}");
        }
    }

    /// Two warps share a word through shared memory: warp 0 writes it, warp 1 reads it, then
    /// warp 0 writes it again. Lockstep execution gives the intended values either way; only
    /// the barriers make it race-free on hardware, and each missing one is an error.
    #[test]
    fn shared_memory_races_between_warps_are_errors() {
        let tid = cast(Expr::Special(Special::Tid), Ty::I64);
        let warp0 = |s: Stmt| Stmt::If(bin(Bin::Eq, tid.clone(), i64(0)), vec![s], vec![]);
        let write = warp0(Stmt::Store(Space::Shared, i64(0), f32(2.0)));
        let read = Stmt::If(
            bin(Bin::Eq, tid.clone(), i64(32)),
            vec![Stmt::Store(
                Space::Global,
                Expr::Param(0),
                load(Space::Shared, Ty::F32, i64(0)),
            )],
            vec![],
        );
        let body = |first: bool, second: bool| {
            let mut body = vec![write.clone()];
            body.extend(first.then_some(Stmt::Barrier));
            body.push(read.clone());
            body.extend(second.then_some(Stmt::Barrier));
            body.push(write.clone());
            body
        };
        for (first, second, needle) in [
            (true, true, None),
            (
                false,
                true,
                Some("warp 1 reads shared byte 0, which warp 0 wrote"),
            ),
            (
                true,
                false,
                Some("warp 0 writes shared byte 0, which warp 1 read"),
            ),
        ] {
            let k = kernel(64, 4, &[], body(first, second));
            let mut mem = Memory::default();
            let out = mem.alloc_f32(&[0.0]);
            let result = run(&k, [1, 1, 1], &[Val::I64(out)], &mut mem);
            match needle {
                None => {
                    result.unwrap();
                    assert_eq!(mem.read_f32(out, 1).unwrap(), [2.0]);
                }
                Some(needle) => assert!(result.unwrap_err().contains(needle)),
            }
        }
    }
}
