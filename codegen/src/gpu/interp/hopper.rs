//! Hopper's asynchronous operations, as the PTX ISA defines them: mbarriers with arrival and
//! transaction counts and phase parities, TMA tensor copies that land when their mbarrier's
//! phase completes, `wgmma` warpgroup products (register fragments, shared operands through
//! matrix descriptors and their swizzles) that complete at `wgmma.wait_group`, and
//! `setmaxnreg`.
//!
//! What hardware leaves undefined is an error: waiting for a phase no thread can complete (a
//! deadlock, found by [`super::stepper`]), touching a `wgmma`'s registers before the wait that completes it,
//! reading a copy's bytes without waiting for its phase, overwriting bytes an unfinished
//! product reads, and `wgmma` reads of bytes that ordinary stores wrote with no
//! `fence.proxy.async` after them.

use super::hazards::Clock;
use super::{Cta, Val};
use crate::gpu::ir::tma::{Swizzle, TensorMap};
use crate::gpu::ir::{Expr, Half, Reg, Wgmma, WgmmaA};

/// Threads of a warpgroup.
const WARPGROUP: usize = 128;

/// An mbarrier's state.
pub(super) struct Mbar {
    /// Arrivals per phase.
    count: u32,
    /// Arrivals the current phase still waits for.
    pending: u32,
    /// Bytes the current phase still waits for (negative while copies run ahead of their
    /// `expect_tx`).
    tx: i64,
    /// Phases completed.
    completed: u64,
    /// What the current phase's arrivals and copies published.
    clock: Clock,
    /// What the last completed phase of each parity published.
    done: [Clock; 2],
    /// Copies (shared offset, bytes) that land when the current phase completes.
    landing: Vec<(usize, Vec<u8>)>,
}

/// A named barrier's state.
pub(super) struct Named {
    /// Threads a phase takes.
    threads: u32,
    /// Threads arrived in the current phase.
    arrived: u32,
    /// Phases completed.
    phase: u64,
    /// What the current phase's arrivals published.
    clock: Clock,
    /// What the last completed phase published.
    done: Clock,
}

/// A committed group of a warpgroup's products.
pub(super) struct MmaGroup {
    /// Registers the group writes or reads asynchronously (accumulators, then A fragments).
    regs: Vec<Reg>,
    /// How many of `regs` are accumulators.
    accumulators: usize,
    /// Shared bytes (offset, length) its products read.
    reads: Vec<(usize, usize)>,
}

/// The first threads of the warpgroups that execute a warpgroup-collective operation: those
/// with any active thread, each of which must have all 128 active.
fn warpgroups(mask: &[bool], op: &str) -> Result<Vec<usize>, String> {
    let mut groups = Vec::new();
    for first in (0..mask.len()).step_by(WARPGROUP) {
        let threads = first..(first + WARPGROUP).min(mask.len());
        if !threads.clone().any(|t| mask[t]) {
            continue;
        }
        if threads.len() < WARPGROUP || !threads.clone().all(|t| mask[t]) {
            return Err(format!(
                "{op} in warpgroup {} without all 128 threads active",
                first / WARPGROUP
            ));
        }
        groups.push(first);
    }
    Ok(groups)
}

/// A decoded `wgmma` matrix descriptor.
struct Descriptor {
    start: usize,
    leading: usize,
    stride: usize,
    swizzle: Swizzle,
}

impl Descriptor {
    fn decode(desc: i64) -> Result<Descriptor, String> {
        let d = desc as u64;
        let field = |shift: u32| (((d >> shift) & 0x3fff) << 4) as usize;
        if (d >> 49) & 7 != 0 {
            return Err(format!(
                "wgmma descriptor {d:#x} has a base offset (this interpreter takes patterns on \
                 their boundaries only)"
            ));
        }
        Ok(Descriptor {
            start: field(0),
            leading: field(16),
            stride: field(32),
            swizzle: Swizzle::from_descriptor_code(d >> 62),
        })
    }

    /// The shared offset of element (`row`, `k`) of a 16-bit operand whose rows (M or N) are
    /// `row` and reduction index `k`, K-major (k contiguous) or MN-major (rows contiguous), by
    /// the PTX ISA's canonical layouts, swizzled.
    fn element(&self, row: usize, k: usize, k_major: bool) -> usize {
        let span = self.swizzle.row_bytes() as usize;
        let offset = match (k_major, self.swizzle) {
            (true, Swizzle::None) => {
                (row / 8) * self.stride + (k / 8) * self.leading + (row % 8) * 16 + (k % 8) * 2
            }
            (true, _) => (row / 8) * self.stride + (row % 8) * span + k * 2,
            (false, Swizzle::None) => {
                (row / 8) * self.stride + (row % 8) * 2 + (k / 8) * self.leading + (k % 8) * 16
            }
            (false, _) => {
                let per_row = span / 2;
                (row / per_row) * self.leading
                    + (row % per_row) * 2
                    + (k / 8) * self.stride
                    + (k % 8) * span
            }
        };
        self.swizzle.apply(self.start + offset)
    }
}

fn half_value(half: Half, bits: u16) -> f64 {
    match half {
        Half::Bf16 => f64::from(f32::from_bits(u32::from(bits) << 16)),
        Half::F16 => f64::from(half::f16::from_bits(bits).to_f32()),
    }
}

impl Cta<'_> {
    fn shared_offset(
        &self,
        t: usize,
        e: &Expr,
        mask: &[bool],
        what: &str,
    ) -> Result<usize, String> {
        let a = self.eval(t, e, mask)?.int()?;
        usize::try_from(a)
            .ok()
            .filter(|a| *a < self.shared.len())
            .ok_or_else(|| {
                format!(
                    "{what} at shared {a} is outside {} bytes",
                    self.shared.len()
                )
            })
    }

    /// The mbarrier an operation names, checked to be initialized.
    fn mbar_at(&self, t: usize, bar: &Expr, mask: &[bool]) -> Result<usize, String> {
        let at = self.shared_offset(t, bar, mask, "an mbarrier")?;
        if !self.mbarriers.contains_key(&at) {
            return Err(format!("mbarrier at shared {at} used before mbarrier.init"));
        }
        Ok(at)
    }

    pub(super) fn mbar_init(
        &mut self,
        mask: &[bool],
        bar: &Expr,
        count: u32,
    ) -> Result<(), String> {
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let at = self.shared_offset(t, bar, mask, "an mbarrier")?;
            if at % 8 != 0 || at + 8 > self.shared.len() {
                return Err(format!("mbarrier at shared {at} (8 bytes, 8-aligned)"));
            }
            if count == 0 || count >= 1 << 20 {
                return Err(format!("mbarrier of {count} arrivals"));
            }
            let zero = self.hazards.borrow().zero();
            self.mbarriers.insert(
                at,
                Mbar {
                    count,
                    pending: count,
                    tx: 0,
                    completed: 0,
                    clock: zero.clone(),
                    done: [zero.clone(), zero],
                    landing: Vec::new(),
                },
            );
        }
        Ok(())
    }

    pub(super) fn mbar_arrive(
        &mut self,
        mask: &[bool],
        bar: &Expr,
        tx: Option<&Expr>,
    ) -> Result<(), String> {
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let at = self.mbar_at(t, bar, mask)?;
            let bytes = match tx {
                Some(e) => self.eval(t, e, mask)?.int()?,
                None => 0,
            };
            if !(0..1 << 20).contains(&bytes) {
                return Err(format!("expect_tx of {bytes} bytes (0 to 2^20 - 1)"));
            }
            let mut hazards = self.hazards.borrow_mut();
            let m = self.mbarriers.get_mut(&at).expect("checked");
            if m.pending == 0 {
                return Err(format!(
                    "more arrivals at the mbarrier at shared {at} than its {} per phase",
                    m.count
                ));
            }
            m.tx += bytes;
            m.pending -= 1;
            hazards.release(t / 32, &mut m.clock);
            drop(hazards);
            self.complete_phase(at)?;
        }
        Ok(())
    }

    /// Completes the mbarrier's phase if every arrival and byte is in: its copies land, and
    /// what it collected is published to its waiters.
    fn complete_phase(&mut self, at: usize) -> Result<(), String> {
        let m = self.mbarriers.get_mut(&at).expect("an mbarrier");
        if m.pending != 0 || m.tx != 0 {
            return Ok(());
        }
        let landing = std::mem::take(&mut m.landing);
        let parity = (m.completed % 2) as usize;
        m.done[parity] = std::mem::replace(&mut m.clock, vec![0; m.done[0].len()]);
        m.completed += 1;
        m.pending = m.count;
        for (dst, bytes) in landing {
            self.shared[dst..dst + bytes.len()].copy_from_slice(&bytes);
        }
        Ok(())
    }

    /// Why an mbarrier wait cannot complete yet for some active thread (its phase has not
    /// completed), or `None`.
    pub(super) fn mbar_pending(
        &self,
        mask: &[bool],
        bar: &Expr,
        parity: &Expr,
    ) -> Result<Option<String>, String> {
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let at = self.mbar_at(t, bar, mask)?;
            let p = self.eval(t, parity, mask)?.int()?;
            let m = &self.mbarriers[&at];
            if (m.completed % 2) as i64 == p {
                return Ok(Some(format!(
                    "thread {t} waits at the mbarrier at shared {at} for the phase of parity {p}, \
                     which no thread can complete ({} phases completed, {} arrivals and {} bytes \
                     missing)",
                    m.completed, m.pending, m.tx
                )));
            }
        }
        Ok(None)
    }

    pub(super) fn mbar_wait(
        &mut self,
        mask: &[bool],
        bar: &Expr,
        parity: &Expr,
    ) -> Result<(), String> {
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let at = self.mbar_at(t, bar, mask)?;
            let p = self.eval(t, parity, mask)?.int()?;
            if !(0..=1).contains(&p) {
                return Err(format!("mbarrier wait for parity {p} (0 or 1)"));
            }
            let m = &self.mbarriers[&at];
            if (m.completed % 2) as i64 == p {
                return Err(format!(
                    "thread {t} waits at the mbarrier at shared {at} for a phase not completed"
                ));
            }
            if m.completed > 0 {
                let clock = m.done[p as usize].clone();
                self.hazards.borrow_mut().acquire(t / 32, &clock);
            }
        }
        Ok(())
    }

    pub(super) fn tma_load(
        &mut self,
        mask: &[bool],
        dst: &Expr,
        map: u32,
        coords: &[Expr],
        bar: &Expr,
    ) -> Result<(), String> {
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let handle = match self.args.get(map as usize) {
                Some(Val::I64(h)) => *h,
                other => return Err(format!("TMA map parameter {map} is {other:?}")),
            };
            let tmap = self.memory.tensor_map(handle)?.clone();
            if coords.len() != tmap.dims.len() {
                return Err(format!(
                    "a TMA copy with {} coordinates from a rank-{} map",
                    coords.len(),
                    tmap.dims.len()
                ));
            }
            let at = self.mbar_at(t, bar, mask)?;
            let dst = self.shared_offset(t, dst, mask, "a TMA copy")?;
            let bytes = tmap.box_bytes() as usize;
            if dst % tmap.swizzle.alignment() != 0 || dst + bytes > self.shared.len() {
                return Err(format!(
                    "a TMA copy of {bytes} bytes to shared {dst} (inside {} bytes, {}-aligned)",
                    self.shared.len(),
                    tmap.swizzle.alignment()
                ));
            }
            let origin = coords
                .iter()
                .map(|c| self.eval(t, c, mask)?.int())
                .collect::<Result<Vec<i64>, String>>()?;
            let data = self.tma_box(&tmap, &origin)?;
            let agent = self.hazards.borrow_mut().copy_agent(at)?;
            self.hazards.borrow_mut().issue_copy(agent, t / 32);
            // The box's bytes, at their swizzled places.
            let mut landing = Vec::with_capacity(data.len() / 16);
            for (chunk, bytes) in data.chunks(16).enumerate() {
                let to = tmap.swizzle.apply(dst + 16 * chunk);
                self.check_not_in_flight(to, 16)?;
                self.check_proxy_fenced(to, 16, "a TMA copy writes")?;
                self.hazards.borrow_mut().write(agent, to, 16)?;
                landing.push((to, bytes.to_vec()));
            }
            let mut hazards = self.hazards.borrow_mut();
            let m = self.mbarriers.get_mut(&at).expect("checked");
            m.landing.extend(landing);
            m.tx -= bytes as i64;
            hazards.release(agent, &mut m.clock);
            drop(hazards);
            self.complete_phase(at)?;
        }
        Ok(())
    }

    /// A box read from global memory in its shared layout before the swizzle (elements past
    /// the tensor's edges are zeros).
    fn tma_box(&self, map: &TensorMap, origin: &[i64]) -> Result<Vec<u8>, String> {
        let elem = map.elem_bytes as usize;
        let mut out = vec![0u8; map.box_bytes() as usize];
        let mut index = vec![0u32; map.dims.len()];
        loop {
            let mut addr = Some(map.global);
            for (d, (&i, &o)) in index.iter().zip(origin).enumerate() {
                let at = o + i64::from(i);
                if at < 0 || at >= map.dims[d] as i64 {
                    addr = None;
                    break;
                }
                let step = if d == 0 {
                    elem as i64
                } else {
                    map.strides[d - 1] as i64
                };
                addr = addr.map(|a| a + at * step);
            }
            if let Some(a) = addr {
                let to = map.box_offset(&index);
                out[to..to + elem].copy_from_slice(self.memory.bytes(a, elem)?);
            }
            // The next index, innermost first.
            let mut d = 0;
            loop {
                if d == index.len() {
                    return Ok(out);
                }
                index[d] += 1;
                if index[d] < map.boxes[d] {
                    break;
                }
                index[d] = 0;
                d += 1;
            }
        }
    }

    /// Ordinary stores of these bytes were followed by `fence.proxy.async` in their thread.
    fn check_proxy_fenced(&self, at: usize, len: usize, what: &str) -> Result<(), String> {
        match self.generic_writes[at..at + len].iter().find(|&&w| w != 0) {
            Some(w) => Err(format!(
                "{what} shared bytes {at}..{} that warp {} stored with no fence.proxy.async \
                 after the store",
                at + len,
                w - 1
            )),
            None => Ok(()),
        }
    }

    pub(super) fn fence_proxy_async(&mut self, mask: &[bool]) {
        for w in (0..mask.len())
            .step_by(32)
            .filter(|&t| mask[t..].iter().take(32).any(|&m| m))
        {
            let writer = (w / 32 + 1) as u8;
            self.generic_writes
                .iter_mut()
                .filter(|b| **b == writer)
                .for_each(|b| *b = 0);
        }
    }

    pub(super) fn setmaxnreg(&self, mask: &[bool], regs: u32) -> Result<(), String> {
        warpgroups(mask, "setmaxnreg")?;
        if !(24..=256).contains(&regs) || !regs.is_multiple_of(8) {
            return Err(format!("setmaxnreg to {regs} (24 to 256, a multiple of 8)"));
        }
        Ok(())
    }

    /// A 16-bit element of a shared operand, read for the warps of a warpgroup.
    fn operand(
        &self,
        first: usize,
        at: usize,
        half: Half,
        reads: &mut Vec<(usize, usize)>,
    ) -> Result<f64, String> {
        if !at.is_multiple_of(2) || at + 2 > self.shared.len() {
            return Err(format!(
                "a wgmma operand element at shared {at} (2-aligned, inside {} bytes)",
                self.shared.len()
            ));
        }
        self.check_not_in_flight(at, 2)?;
        self.check_proxy_fenced(at, 2, "a wgmma reads")?;
        let mut hazards = self.hazards.borrow_mut();
        for w in 0..4 {
            hazards.read(first / 32 + w, at, 2)?;
        }
        reads.push((at, 2));
        Ok(half_value(
            half,
            u16::from_le_bytes([self.shared[at], self.shared[at + 1]]),
        ))
    }

    pub(super) fn wgmma(&mut self, mask: &[bool], w: &Wgmma) -> Result<(), String> {
        let n = w.n as usize;
        if n == 0 || n > 256 || !n.is_multiple_of(8) || w.d.len() != n / 2 {
            return Err(format!("wgmma of N {n} with {} accumulators", w.d.len()));
        }
        for first in warpgroups(mask, "wgmma")? {
            // D as f64, rows 0..64 by columns 0..n.
            let mut d = vec![0f64; 64 * n];
            let accumulate = self.eval(first, &w.accumulate, mask)?.pred()?;
            for lane in 0..WARPGROUP {
                let (warp, g, q) = (lane / 32, (lane % 32) / 4, lane % 4);
                for (r, reg) in w.d.iter().enumerate() {
                    let (j, i) = (r / 4, r % 4);
                    let (row, col) = (16 * warp + g + 8 * (i / 2), 8 * j + 2 * q + i % 2);
                    d[row * n + col] = if accumulate {
                        f64::from(self.regs[first + lane][reg.0 as usize].float()?)
                    } else {
                        0.0
                    };
                }
            }
            let mut reads = Vec::new();
            let mut regs: Vec<Reg> = w.d.clone();
            let accumulators = regs.len();
            for (a, b) in &w.steps {
                let mut am = vec![0f64; 64 * 16];
                match a {
                    WgmmaA::Regs(fragment) => {
                        for lane in 0..WARPGROUP {
                            let (warp, g, q) = (lane / 32, (lane % 32) / 4, lane % 4);
                            for (i, reg) in fragment.iter().enumerate() {
                                let bits = self.regs[first + lane][reg.0 as usize].int()? as u32;
                                let (row, col) = (16 * warp + g + 8 * (i % 2), 2 * q + 8 * (i / 2));
                                am[row * 16 + col] = half_value(w.half, bits as u16);
                                am[row * 16 + col + 1] = half_value(w.half, (bits >> 16) as u16);
                            }
                        }
                        regs.extend(fragment);
                    }
                    WgmmaA::Shared(desc) => {
                        let desc = Descriptor::decode(self.eval(first, desc, mask)?.int()?)?;
                        for row in 0..64 {
                            for k in 0..16 {
                                let at = desc.element(row, k, true);
                                am[row * 16 + k] = self.operand(first, at, w.half, &mut reads)?;
                            }
                        }
                    }
                }
                let desc = Descriptor::decode(self.eval(first, b, mask)?.int()?)?;
                let mut bm = vec![0f64; 16 * n];
                for col in 0..n {
                    for k in 0..16 {
                        let at = desc.element(col, k, !w.b_n_major);
                        bm[k * n + col] = self.operand(first, at, w.half, &mut reads)?;
                    }
                }
                // One rounding to f32 per step, as the f32 accumulator holds.
                for row in 0..64 {
                    for col in 0..n {
                        let sum: f64 = (0..16).map(|k| am[row * 16 + k] * bm[k * n + col]).sum();
                        d[row * n + col] = f64::from((d[row * n + col] + sum) as f32);
                    }
                }
            }
            for lane in 0..WARPGROUP {
                let (warp, g, q) = (lane / 32, (lane % 32) / 4, lane % 4);
                for (r, reg) in w.d.iter().enumerate() {
                    let (j, i) = (r / 4, r % 4);
                    let (row, col) = (16 * warp + g + 8 * (i / 2), 8 * j + 2 * q + i % 2);
                    self.regs[first + lane][reg.0 as usize] = Val::F(d[row * n + col] as f32);
                }
                for reg in &regs {
                    self.busy[first + lane][reg.0 as usize] += 1;
                }
            }
            self.busy_count += WARPGROUP * regs.len();
            self.mma_groups[first / WARPGROUP].push_back(MmaGroup {
                regs,
                accumulators,
                reads,
            });
        }
        Ok(())
    }

    pub(super) fn wgmma_wait(
        &mut self,
        mask: &[bool],
        groups: u32,
        listed: &[Reg],
    ) -> Result<(), String> {
        for first in warpgroups(mask, "wgmma.wait_group")? {
            while self.mma_groups[first / WARPGROUP].len() > groups as usize {
                let group = self.mma_groups[first / WARPGROUP]
                    .pop_front()
                    .expect("a group");
                if let Some(r) = group.regs[..group.accumulators]
                    .iter()
                    .find(|r| !listed.contains(r))
                {
                    return Err(format!(
                        "wgmma.wait_group {groups} completes a group whose accumulator \
                         register {} it does not list (later accesses could move before it)",
                        self.kernel.regs[r.0 as usize].0
                    ));
                }
                for lane in 0..WARPGROUP {
                    for reg in &group.regs {
                        self.busy[first + lane][reg.0 as usize] -= 1;
                    }
                }
                self.busy_count -= WARPGROUP * group.regs.len();
                // The products read their operands until now.
                let mut hazards = self.hazards.borrow_mut();
                for (at, len) in group.reads {
                    for w in 0..4 {
                        hazards.read(first / 32 + w, at, len)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// `bar.arrive` (or the arrival of `bar.sync`) at named barrier `id` by the active threads
    /// that have not arrived yet; with `wait`, each records the phase it waits for.
    pub(super) fn named_arrive(
        &mut self,
        mask: &[bool],
        id: &Expr,
        threads: u32,
        wait: bool,
    ) -> Result<(), String> {
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            if self.named_wait[t].is_some() {
                continue;
            }
            let id = self.eval(t, id, mask)?.int()?;
            if !(1..16).contains(&id) || threads == 0 || !threads.is_multiple_of(32) {
                return Err(format!(
                    "named barrier {id} of {threads} threads (1 to 15, whole warps)"
                ));
            }
            let zero = self.hazards.borrow().zero();
            let b = self.named.entry(id).or_insert_with(|| Named {
                threads,
                arrived: 0,
                phase: 0,
                clock: zero.clone(),
                done: zero,
            });
            if b.threads != threads {
                return Err(format!(
                    "named barrier {id} used with {threads} and {} threads in one phase",
                    b.threads
                ));
            }
            self.hazards.borrow_mut().release(t / 32, &mut b.clock);
            b.arrived += 1;
            if wait {
                self.named_wait[t] = Some((id, b.phase));
            }
            if b.arrived == b.threads {
                b.done = std::mem::replace(&mut b.clock, self.hazards.borrow().zero());
                b.arrived = 0;
                b.phase += 1;
            }
        }
        Ok(())
    }

    /// `bar.sync` at a named barrier: the active threads arrive (once), and those whose phase
    /// has completed pass (they learn what its arrivals did). Returns the threads that pass
    /// and those still waiting.
    pub(super) fn named_sync(
        &mut self,
        mask: &[bool],
        id: &Expr,
        threads: u32,
    ) -> Result<[Vec<bool>; 2], String> {
        self.named_arrive(mask, id, threads, true)?;
        let (mut pass, mut wait) = (vec![false; mask.len()], vec![false; mask.len()]);
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let Some((id, phase)) = self.named_wait[t] else {
                return Err(format!(
                    "thread {t} waits at a named barrier it did not reach"
                ));
            };
            let b = &self.named[&id];
            if b.phase > phase {
                let done = b.done.clone();
                self.hazards.borrow_mut().acquire(t / 32, &done);
                self.named_wait[t] = None;
                pass[t] = true;
            } else {
                wait[t] = true;
            }
        }
        Ok([pass, wait])
    }

    /// A register of an unfinished `wgmma` group may not be touched.
    pub(super) fn check_not_busy(&self, t: usize, r: Reg) -> Result<(), String> {
        if self.busy_count > 0 && self.busy[t][r.0 as usize] > 0 {
            return Err(format!(
                "thread {t} touches register {} while a wgmma that uses it is in flight (no \
                 wgmma.wait_group completed it)",
                self.kernel.regs[r.0 as usize].0
            ));
        }
        Ok(())
    }

    /// At the end of a CTA: every product was waited for.
    pub(super) fn all_products_waited(&self) -> Result<(), String> {
        match self.mma_groups.iter().position(|g| !g.is_empty()) {
            Some(g) => Err(format!(
                "warpgroup {g} ended with wgmma groups never waited for"
            )),
            None => Ok(()),
        }
    }
}
