//! The decode kernel on tensor cores for wide rows: MLA's absorbed form (576-wide keys, whose
//! first 512 columns are the values) and 16-bit heads wider than [`super::tc`] takes.
//! After FlashMLA's design: all of a task's query heads are the M rows of `mma.sync` (a task of
//! up to [`TASK_ROWS`]), the latent and RoPE key of each key read once per task, and the rows'
//! work split across warps rather than the keys.
//!
//! The four warps of a CTA take the same 16-key segment each round. Its rows arrive by 16-byte
//! `cp.async` from all 128 threads into a two-stage ring (the next round's copies fly while this
//! round computes). Warp `w` computes `S = Q K^T` over a quarter of the head dim (Q's A
//! fragments for those columns stay in its registers, in two 16-bit parts as in the other
//! kernel) and publishes its partial S in shared memory; after a barrier every warp sums the
//! four (the same in each, so every warp keeps the same running max and sum) and runs the score
//! program and the online softmax, then `O += P V` for its quarter of the value columns. No
//! merge at the end: each warp writes its own columns. Two barriers a round.

use super::mma::{
    self, Lane, QFragments, Rest, RowCopy, RowState, SegmentRing, half_of, k_lane, runs, v_lane,
};
use super::records::{Segment, THREADS, Task, param};
use super::tc;
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Reg, Space, Special, Stmt, Ty};
use crate::gpu::kernels::{Regs, lse_of_half, reciprocal, special64};
use crate::gpu::launch::{DecodeArgs, LaunchRecord};
use crate::plan::{KernelPlan, PlanKind};

/// Keys per segment (every warp's, each round).
pub const SEGMENT_KEYS: u32 = mma::KEYS;

/// Query rows per task.
pub const TASK_ROWS: u32 = mma::ROWS;

/// Warps per CTA, each a quarter of the head dims.
const WARPS: usize = THREADS as usize / 32;

/// Buffers in the ring of staged segments.
const STAGES: i64 = 2;

/// The most head dims the registers take: a warp holds `qk_dim / 8` registers of Q's two parts
/// and `v_dim / 8` of O's accumulators.
const MAX_DIMS: u32 = 1280;

/// Whether a decode plan runs on this kernel: a 16-bit cache too wide for
/// [`tc::supports`] (MLA's absorbed rows, or heads past 256), with `qk_dim` and `v_dim`
/// multiples of 64 (a warp's quarter of whole `k16` steps and pairs of 8-column blocks).
pub fn supports(plan: &KernelPlan) -> bool {
    let (d, dv) = (plan.shape.qk_dim, plan.shape.v_dim);
    plan.kind == PlanKind::Decode
        && mma::sixteen_bit(plan)
        && !tc::supports(plan)
        // Parameters, sigmoid and stick-breaking weights are taken by the SIMT kernel only.
        && !plan.unnormalized()
        && plan.params.is_empty()
        && d.is_multiple_of(64)
        && dv.is_multiple_of(64)
        && d + dv <= MAX_DIMS
        && (plan.mla.is_none() || dv <= d)
}

/// Byte offsets of the kernel's shared memory.
struct Layout {
    /// Bytes between staged K rows, and between V rows (padded by 16).
    k_row: i64,
    v_row: i64,
    /// Bytes of a stage: K rows, then V rows unless the values are the keys' first columns.
    stage: i64,
    /// The warps' partial scores (after the ring).
    partial: i64,
    /// Q staged in f32 (over the ring, before the first copies), then a word per thread.
    words: i64,
    bytes: i64,
}

impl Layout {
    fn of(plan: &KernelPlan) -> Layout {
        let keys = i64::from(SEGMENT_KEYS);
        let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
        let k_row = 2 * d + 16;
        let v_row = if plan.mla.is_some() {
            k_row
        } else {
            2 * dv + 16
        };
        let stage = keys * k_row + if plan.mla.is_some() { 0 } else { keys * v_row };
        let partial = STAGES * stage;
        let partial_bytes = (WARPS * 8 * 32 * 4) as i64;
        let words = i64::from(TASK_ROWS) * d * 4;
        Layout {
            k_row,
            v_row,
            stage,
            partial,
            words,
            bytes: (partial + partial_bytes).max(words + 4 * i64::from(THREADS)),
        }
    }

    /// A round's copies: the segment's K rows (and V rows, unless the values are the keys'
    /// first columns), by every thread, into the ring's buffer.
    fn copies(&self, plan: &KernelPlan, ring: &SegmentRing, d: usize, dv: usize) -> Vec<Stmt> {
        let (seg, tid) = (&ring.seg, special64(Special::Tid));
        let mut copies = RowCopy {
            addr: seg.k_addr,
            stride: seg.k_stride,
            keys: seg.keys,
            width: d,
            dst: reg(ring.buffer),
            row_bytes: self.k_row,
        }
        .statements(&tid, THREADS as usize);
        if plan.mla.is_none() {
            copies.extend(
                RowCopy {
                    addr: seg.v_addr,
                    stride: seg.v_stride,
                    keys: seg.keys,
                    width: dv,
                    dst: add(reg(ring.buffer), i64(i64::from(SEGMENT_KEYS) * self.k_row)),
                    row_bytes: self.v_row,
                }
                .statements(&tid, THREADS as usize),
            );
        }
        copies
    }

    /// Element `i` of fragment `nb` of warp `warp`'s partial S, for this lane.
    fn partial_at(&self, warp: Expr, nb: usize, i: usize) -> Expr {
        let slot = add(mul(warp, i64(8)), i64((4 * nb + i) as i64));
        add(
            i64(self.partial),
            mul(add(mul(slot, i64(32)), special64(Special::Lane)), i64(4)),
        )
    }

    /// The warp's partial S, published.
    fn publish_partial(&self, s: &[[Reg; 4]; 2], lane: &Lane) -> Vec<Stmt> {
        let mut stores = Vec::new();
        for (nb, frag) in s.iter().enumerate() {
            for (i, &x) in frag.iter().enumerate() {
                let at = self.partial_at(reg(lane.warp), nb, i);
                stores.push(Stmt::Store(Space::Shared, at, reg(x)));
            }
        }
        stores
    }

    /// S, the sum of the four warps' partial S.
    fn sum_partials(&self, s: &[[Reg; 4]; 2]) -> Vec<Stmt> {
        let mut sums = Vec::new();
        for (nb, frag) in s.iter().enumerate() {
            for (i, &x) in frag.iter().enumerate() {
                let sum = (0..WARPS).fold(f32(0.0), |acc, w| {
                    let part = self.partial_at(i64(w as i64), nb, i);
                    add(acc, load(Space::Shared, Ty::F32, part))
                });
                sums.push(Stmt::Set(x, sum));
            }
        }
        sums
    }
}

/// Lowers the wide tensor-core decode kernel. The plan must be [`supports`]ed.
pub fn lower(plan: &KernelPlan) -> Kernel {
    assert!(
        supports(plan),
        "the wide tensor-core decode kernel runs 16-bit decode plans of wide rows"
    );
    let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    let (steps, columns) = (d / 16 / WARPS, dv / WARPS);
    let sh = Layout::of(plan);
    let mut r = Regs { list: Vec::new() };
    let mut body = Vec::new();
    let task = Task::load(&mut r, &mut body);
    let lane = Lane::new(&mut r, &mut body, &task);

    // Q's fragments of the warp's quarter of the head dim, both parts in registers.
    let qa = QFragments::stage(
        plan,
        &mut r,
        &mut body,
        &task,
        &lane,
        [0, sh.words],
        (mul(reg(lane.warp), i64(steps as i64)), steps),
        Rest::Registers,
    );
    let state = RowState::new(&mut r, &mut body, columns / 8);

    // Rounds: segment seg0 + round, staged in buffer round % 2.
    let round = r.add("round", Ty::I64);
    let buffer_of = |round: Expr| mul(bin(Bin::Rem, round, i64(STAGES)), i64(sh.stage));
    let mut ring = SegmentRing::new(&mut r);
    ring.copies = sh.copies(plan, &ring, d, dv);
    body.extend(ring.issue(&task, add(reg(task.seg0), i64(0)), buffer_of(i64(0))));

    // The lane's `ldmatrix` addresses in a buffer: K rows; V rows (for MLA the K rows' first
    // columns), at the warp's quarter of the value columns.
    let (k_at, v_at) = (r.add("k_lane", Ty::I64), r.add("v_lane", Ty::I64));
    let v_rows = if plan.mla.is_some() {
        0
    } else {
        i64::from(SEGMENT_KEYS) * sh.k_row
    };
    body.extend([
        Stmt::Set(k_at, k_lane(sh.k_row)),
        Stmt::Set(
            v_at,
            add(
                add(v_lane(sh.v_row), i64(v_rows)),
                mul(reg(lane.warp), i64(2 * columns as i64)),
            ),
        ),
    ]);

    // This round's segment: the warp's partial S, published; then, after a barrier, the sum
    // of the four, the score program, the softmax and the warp's columns of O += P V.
    let buffer = r.add("buffer", Ty::I64);
    let (seg, load_seg) = Segment::load(&mut r, add(reg(task.seg0), reg(round)));
    let [bm, pa] = ["bm", "pa"].map(|n| [0, 1, 2, 3].map(|i| r.add(format!("{n}{i}"), Ty::I32)));
    let s: [[_; 4]; 2] =
        [0, 1].map(|nb| [0, 1, 2, 3].map(|i| r.add(format!("s{nb}_{i}"), Ty::F32)));
    let mut partial: Vec<Stmt> = s
        .iter()
        .flatten()
        .map(|&x| Stmt::Set(x, f32(0.0)))
        .collect();
    partial.extend(qa.qk(half_of(plan), bm, &add(reg(buffer), reg(k_at)), &s));
    partial.extend(sh.publish_partial(&s, &lane));
    let mut run = sh.sum_partials(&s);
    let at = (&lane, &task, &seg);
    let v = add(reg(buffer), reg(v_at));
    run.extend(mma::softmax_pv(plan, &s, at, &state, [pa, bm], &v));

    // Per round: the copies land and are visible (every warp is done with the buffer the next
    // round's copies fill), the next round's fly while this one computes.
    let next = add(reg(round), i64(1));
    let mut round_body = vec![Stmt::CpAsyncWait(0), Stmt::Barrier];
    round_body.extend(ring.issue(&task, add(reg(task.seg0), next.clone()), buffer_of(next)));
    round_body.push(Stmt::Set(buffer, buffer_of(reg(round))));
    round_body.extend(load_seg);
    round_body.extend([
        Stmt::If(runs(&seg), partial, vec![]),
        Stmt::Barrier,
        Stmt::If(runs(&seg), run, vec![]),
    ]);
    body.push(Stmt::For {
        reg: round,
        start: i64(0),
        end: reg(task.nseg),
        step: 1,
        body: round_body,
    });
    body.extend(state.quad_sums());
    body.extend(store_rows(&state, &lane, &task, dv));

    Kernel {
        name: "attention_decode_wide".into(),
        params: DecodeArgs::params(),
        regs: r.list,
        shared_bytes: sh.bytes as u32,
        threads: THREADS,
        // Two CTAs per SM: up to 255 registers a thread (Q's parts and O take 136 at MLA's
        // 576 + 512).
        ctas_per_sm: 2,
        body,
    }
}

/// Every warp holds the same sums: each writes its columns of `O / l`, warp 0 the lse.
fn store_rows(state: &RowState, lane: &Lane, task: &Task, dv: usize) -> Vec<Stmt> {
    let columns = dv / WARPS;
    let mut body = Vec::new();
    for h in 0..2 {
        let l = state.l[h];
        let nonempty = bin(Bin::Ne, reg(l), f32(0.0));
        let out_row = add(reg(task.row0), lane.row(h));
        let mut store = Vec::new();
        for (vb, frag) in state.o.iter().enumerate() {
            for j in 0..2 {
                let col = add(mul(reg(lane.warp), i64(columns as i64)), lane.column(vb, j));
                store.push(Stmt::Store(
                    Space::Global,
                    at(
                        param("out"),
                        add(mul(out_row.clone(), i64(dv as i64)), col),
                        4,
                    ),
                    select(
                        nonempty.clone(),
                        mul(reg(frag[2 * h + j]), reciprocal(reg(l))),
                        f32(0.0),
                    ),
                ));
            }
        }
        store.push(Stmt::If(
            bin(
                Bin::And,
                bin(Bin::Eq, reg(lane.warp), i64(0)),
                bin(Bin::Eq, reg(lane.q), i64(0)),
            ),
            vec![Stmt::Store(
                Space::Global,
                at(param("lse"), out_row, 4),
                select(
                    nonempty,
                    lse_of_half(reg(state.m[h]), reg(l)),
                    f32(f32::NEG_INFINITY),
                ),
            )],
            vec![],
        ));
        body.push(Stmt::If(
            bin(Bin::Lt, lane.row(h), reg(task.rows)),
            store,
            vec![],
        ));
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(text: &str) -> KernelPlan {
        KernelPlan::decode(&text.parse().unwrap())
    }

    #[test]
    fn mla_and_heads_past_256_run_on_the_wide_kernel() {
        let mla = "heads = 128, head_dim = 128, mla(latent_rank = 512, rope_dim = 64), \
                   dtype = bf16";
        assert!(supports(&plan(mla)));
        assert!(supports(&plan("heads = 4, head_dim = 512, dtype = f16")));
        // Narrower heads take the other kernel; f32 and ragged widths the SIMT one.
        assert!(!supports(&plan("heads = 4, head_dim = 128, dtype = bf16")));
        assert!(!supports(&plan(
            "heads = 4, head_dim = 128, mla(latent_rank = 512, rope_dim = 64), dtype = f32"
        )));
        assert!(!supports(&plan("heads = 4, head_dim = 288, dtype = bf16")));
    }
}
