//! The decode kernel on tensor cores, for bf16 and f16 per-head caches: FlashDecoding's split
//! over keys inside the CTA, with FlashInfer's treatment of a GQA group (its query heads are
//! the M rows of `mma.sync`, so a CTA reads each of its kv head's keys and values once).
//!
//! A task (the query rows of one work item, at most [`TASK_ROWS`], against a list of segments
//! of at most [`SEGMENT_KEYS`] keys; the records of [`super`]) runs on four warps. Each
//! warp takes every fourth segment: per round, segment `4 i + warp`. A segment's K and V rows
//! arrive in the warp's part of a two-stage ring in shared memory by 16-byte `cp.async`
//! (rows past the segment's keys zero-filled), the next round's copies flying while this
//! round computes; one barrier a round. From there, as in the forward kernel: `S = Q K^T` from
//! Q's A fragments (held in registers for the whole task) and K's B fragments (`ldmatrix`), the
//! score program and mask per element, the online softmax over the lane quad, `P` repacked from
//! C into A fragments, and `O += P V` (V by `ldmatrix.trans`). At the end the four warps' rows
//! (max, sum and unnormalized O each) meet in shared memory and merge by their maxima.
//!
//! Rows are padded by 16 bytes in shared memory so that the eight rows an `ldmatrix` reads fall
//! in different banks. Q is rounded to the cache's 16-bit format for the tensor cores, and P
//! too, as the forward kernel does; sums and O accumulate in f32.

use super::mma::{
    self, Lane, QFragments, Rest, RowCopy, RowState, SegmentRing, half_of, k_lane, runs, v_lane,
};
use super::records::{Segment, THREADS, Task, param};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Space, Special, Stmt, Ty, Un};
use crate::gpu::kernels::{Regs, exp2_twice, lse_of_half, reciprocal, special64};
use crate::gpu::launch::{DecodeArgs, LaunchRecord};
use crate::plan::{KernelPlan, PlanKind};

/// Keys per segment: one `k16` step of `P V` (two `n8` blocks of `S`) per warp and round.
pub const SEGMENT_KEYS: u32 = mma::KEYS;

/// Query rows per task: the M dimension of one `mma.sync`.
pub const TASK_ROWS: u32 = mma::ROWS;

/// Warps per CTA, each taking its own segments.
const WARPS: i64 = THREADS as i64 / 32;

/// Buffers in the ring of staged segments.
const STAGES: i64 = 2;

/// The largest `qk_dim` and `v_dim` the kernel takes (Q's fragments and O's accumulators stay
/// in registers: 192 of them at 256).
const MAX_DIM: u32 = 256;

/// Whether a decode plan runs on this kernel: a bf16 or f16 per-head cache whose `qk_dim` and
/// `v_dim` are multiples of 16 up to 256. MLA's absorbed rows (576 and 512 wide) do not.
pub fn supports(plan: &KernelPlan) -> bool {
    let (d, dv) = (plan.shape.qk_dim, plan.shape.v_dim);
    plan.kind == PlanKind::Decode
        && mma::sixteen_bit(plan)
        && plan.mla.is_none()
        // Parameters and stick-breaking weights are taken by the SIMT kernel only.
        && !plan.stick_breaking()
        && plan.params.is_empty()
        && d.is_multiple_of(16)
        && dv.is_multiple_of(16)
        && (16..=MAX_DIM).contains(&d)
        && (16..=MAX_DIM).contains(&dv)
}

/// Byte offsets of the kernel's shared memory.
struct Layout {
    /// Bytes between K rows, and between V rows (padded by 16).
    k_row: i64,
    v_row: i64,
    /// Bytes of one warp's part of a stage (its K rows, then its V rows).
    warp: i64,
    /// Bytes of a stage.
    stage: i64,
}

impl Layout {
    fn of(plan: &KernelPlan) -> Layout {
        let keys = i64::from(SEGMENT_KEYS);
        let k_row = 2 * i64::from(plan.shape.qk_dim) + 16;
        let v_row = 2 * i64::from(plan.shape.v_dim) + 16;
        let warp = keys * (k_row + v_row);
        Layout {
            k_row,
            v_row,
            warp,
            stage: WARPS * warp,
        }
    }

    /// Bytes of the ring.
    fn bytes(&self) -> i64 {
        STAGES * self.stage
    }

    /// A round's copies: the warp's segment's K and V rows, by the warp's lanes, into the
    /// ring's buffer.
    fn copies(&self, ring: &SegmentRing, d: usize, dv: usize) -> Vec<Stmt> {
        let (seg, lane_id) = (&ring.seg, special64(Special::Lane));
        let mut copies = RowCopy {
            addr: seg.k_addr,
            stride: seg.k_stride,
            keys: seg.keys,
            width: d,
            dst: reg(ring.buffer),
            row_bytes: self.k_row,
        }
        .statements(&lane_id, 32);
        copies.extend(
            RowCopy {
                addr: seg.v_addr,
                stride: seg.v_stride,
                keys: seg.keys,
                width: dv,
                dst: add(reg(ring.buffer), i64(16 * self.k_row)),
                row_bytes: self.v_row,
            }
            .statements(&lane_id, 32),
        );
        copies
    }
}

/// Lowers the tensor-core decode kernel. The plan must be [`supports`]ed.
pub fn lower(plan: &KernelPlan) -> Kernel {
    assert!(
        supports(plan),
        "the tensor-core decode kernel runs 16-bit per-head decode plans"
    );
    let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    let sh = Layout::of(plan);
    let mut r = Regs { list: Vec::new() };
    let mut body = Vec::new();
    let task = Task::load(&mut r, &mut body);
    let lane = Lane::new(&mut r, &mut body, &task);

    // Q: staged in f32 over the second stage of the ring (scaled, rotated, rows past the
    // task's zero), then held as A fragments in two parts; past head dim 128 the second part
    // goes to shared memory after the ring, which keeps D 128 from spilling.
    let rest = if d >= 128 {
        Rest::Shared(sh.bytes())
    } else {
        Rest::Registers
    };
    let qa = QFragments::stage(
        plan,
        &mut r,
        &mut body,
        &task,
        &lane,
        [sh.stage, sh.stage + 64 * d as i64],
        (i64(0), d / 16),
        rest,
    );
    let state = RowState::new(&mut r, &mut body, dv / 8);

    // Rounds: segment seg0 + 4 round + warp for each warp, staged in its part of buffer
    // round % 2.
    let round = r.add("round", Ty::I64);
    let segment_of = |round: Expr| add(add(reg(task.seg0), mul(round, i64(WARPS))), reg(lane.warp));
    let buffer_of = |round: Expr| {
        add(
            mul(bin(Bin::Rem, round, i64(STAGES)), i64(sh.stage)),
            mul(reg(lane.warp), i64(sh.warp)),
        )
    };
    let mut ring = SegmentRing::new(&mut r);
    ring.copies = sh.copies(&ring, d, dv);
    body.extend(ring.issue(&task, segment_of(i64(0)), buffer_of(i64(0))));

    // This round's segment, from the warp's buffer: S = Q K^T, the score program, the softmax,
    // O += P V.
    let (k_at, v_at) = (r.add("k_lane", Ty::I64), r.add("v_lane", Ty::I64));
    body.extend([
        Stmt::Set(k_at, k_lane(sh.k_row)),
        Stmt::Set(v_at, add(v_lane(sh.v_row), i64(16 * sh.k_row))),
    ]);
    let (current, buffer) = (r.add("segment", Ty::I64), r.add("buffer", Ty::I64));
    let (seg, load_seg) = Segment::load(&mut r, reg(current));
    let [bm, pa] = ["bm", "pa"].map(|n| [0, 1, 2, 3].map(|i| r.add(format!("{n}{i}"), Ty::I32)));
    let s: [[_; 4]; 2] =
        [0, 1].map(|nb| [0, 1, 2, 3].map(|i| r.add(format!("s{nb}_{i}"), Ty::F32)));
    let mut run: Vec<Stmt> = s
        .iter()
        .flatten()
        .map(|&x| Stmt::Set(x, f32(0.0)))
        .collect();
    run.extend(qa.qk(half_of(plan), bm, &add(reg(buffer), reg(k_at)), &s));
    let at = (&lane, &task, &seg);
    let v = add(reg(buffer), reg(v_at));
    run.extend(mma::softmax_pv(plan, &s, at, &state, [pa, bm], &v));
    let mut compute = load_seg;
    compute.push(Stmt::If(runs(&seg), run, vec![]));

    // Per round: this round's copies land (and are visible; every warp is done with the
    // buffer the next round's copies fill), the next round's copies fly while this one's
    // segment computes.
    let rounds = bin(Bin::Div, add(reg(task.nseg), i64(WARPS - 1)), i64(WARPS));
    let present = bin(Bin::Lt, reg(current), add(reg(task.seg0), reg(task.nseg)));
    let next = add(reg(round), i64(1));
    let mut round_body = vec![Stmt::CpAsyncWait(0), Stmt::Barrier];
    round_body.extend(ring.issue(&task, segment_of(next.clone()), buffer_of(next)));
    round_body.extend([
        Stmt::Set(current, segment_of(reg(round))),
        Stmt::Set(buffer, buffer_of(reg(round))),
        Stmt::If(present, compute, vec![]),
    ]);
    body.push(Stmt::For {
        reg: round,
        start: i64(0),
        end: rounds,
        step: 1,
        body: round_body,
    });

    // The warps meet: each publishes its rows' max, sum (over its quad) and O in shared memory
    // (over the ring, which every warp is done with), then every thread merges outputs
    // tid + THREADS j across the four warps.
    let meeting = Meeting {
        dv: dv as i64,
        sigmoid: plan.sigmoid(),
    };
    body.push(Stmt::Barrier);
    body.extend(state.quad_sums());
    body.extend(meeting.publish(&state, &lane));
    body.push(Stmt::Barrier);
    body.push(meeting.merge(&mut r, &task));

    Kernel {
        name: "attention_decode_tc".into(),
        params: DecodeArgs::params(),
        regs: r.list,
        shared_bytes: (sh.bytes()
            + match rest {
                Rest::Shared(_) => QFragments::rest_bytes(d / 16),
                Rest::Registers => 0,
            }) as u32,
        threads: THREADS,
        // Decode waits on memory: three CTAs (12 warps) per SM up to head dim 128 (170
        // registers a thread); Q's fragments and O's accumulators need more at 256.
        ctas_per_sm: if d + dv <= 256 { 3 } else { 2 },
        body,
    }
}

/// Where the four warps' rows meet in shared memory at the end (over the ring): each warp's
/// unnormalized O (`[warp][row][v_dim]` f32), then the rows' maxima, then their sums.
struct Meeting {
    dv: i64,
    /// Sigmoid weights: the warps' parts add (no maxima), out is their sum as it stands and
    /// `lse = ln l`.
    sigmoid: bool,
}

impl Meeting {
    const ROWS: i64 = TASK_ROWS as i64;

    fn o_at(&self, w: Expr, row: Expr, col: Expr) -> Expr {
        let (rows, dv) = (Self::ROWS, self.dv);
        mul(add(mul(add(mul(w, i64(rows)), row), i64(dv)), col), i64(4))
    }

    fn m_at(&self, w: Expr, row: Expr) -> Expr {
        let base = WARPS * Self::ROWS * self.dv * 4;
        at(i64(base), add(mul(w, i64(Self::ROWS)), row), 4)
    }

    fn l_at(&self, w: Expr, row: Expr) -> Expr {
        let base = WARPS * Self::ROWS * self.dv * 4 + WARPS * Self::ROWS * 4;
        at(i64(base), add(mul(w, i64(Self::ROWS)), row), 4)
    }

    /// Each warp's rows: max and sum from the lane of `q = 0`, O from every lane.
    fn publish(&self, state: &RowState, lane: &Lane) -> Vec<Stmt> {
        let mut body = Vec::new();
        for h in 0..2 {
            body.push(Stmt::If(
                bin(Bin::Eq, reg(lane.q), i64(0)),
                vec![
                    Stmt::Store(
                        Space::Shared,
                        self.m_at(reg(lane.warp), lane.row(h)),
                        reg(state.m[h]),
                    ),
                    Stmt::Store(
                        Space::Shared,
                        self.l_at(reg(lane.warp), lane.row(h)),
                        reg(state.l[h]),
                    ),
                ],
                vec![],
            ));
            for (vb, frag) in state.o.iter().enumerate() {
                for j in 0..2 {
                    body.push(Stmt::Store(
                        Space::Shared,
                        self.o_at(reg(lane.warp), lane.row(h), lane.column(vb, j)),
                        reg(frag[2 * h + j]),
                    ));
                }
            }
        }
        body
    }

    /// Every thread merges outputs `tid + THREADS j` across the warps by their maxima, and
    /// writes `out` (and from column 0, `lse`) for the task's rows.
    fn merge(&self, r: &mut Regs, task: &Task) -> Stmt {
        let dv = self.dv;
        let (e, row, col) = (
            r.add("element", Ty::I64),
            r.add("element_row", Ty::I64),
            r.add("element_col", Ty::I64),
        );
        let (big_m, m_all, sum, acc, factor) = (
            r.add("merged_max", Ty::F32),
            r.add("merged_use", Ty::F32),
            r.add("merged_sum", Ty::F32),
            r.add("merged_out", Ty::F32),
            r.add("factor", Ty::F32),
        );
        let shared = |addr: Expr| load(Space::Shared, Ty::F32, addr);
        let mut valid = Vec::new();
        for w in 0..WARPS {
            let m_w = shared(self.m_at(i64(w), reg(row)));
            valid.push(Stmt::Set(big_m, bin(Bin::Max, reg(big_m), m_w)));
        }
        valid.extend([
            Stmt::Set(
                m_all,
                select(
                    bin(Bin::Eq, reg(big_m), f32(f32::NEG_INFINITY)),
                    f32(0.0),
                    reg(big_m),
                ),
            ),
            Stmt::Set(sum, f32(0.0)),
            Stmt::Set(acc, f32(0.0)),
        ]);
        for w in 0..WARPS {
            let m_w = shared(self.m_at(i64(w), reg(row)));
            let (l_w, o_w) = (
                shared(self.l_at(i64(w), reg(row))),
                shared(self.o_at(i64(w), reg(row), reg(col))),
            );
            let scale = match self.sigmoid {
                true => f32(1.0),
                false => exp2_twice(sub(m_w, reg(m_all))),
            };
            valid.extend([
                Stmt::Set(factor, scale),
                Stmt::Set(sum, fma(l_w, reg(factor), reg(sum))),
                Stmt::Set(acc, fma(o_w, reg(factor), reg(acc))),
            ]);
        }
        // The sum is 0 only when no key was kept; a NaN score carries NaN through.
        let nonempty = bin(Bin::Ne, reg(sum), f32(0.0));
        let out_row = add(reg(task.row0), reg(row));
        valid.push(Stmt::Store(
            Space::Global,
            at(
                param("out"),
                add(mul(out_row.clone(), i64(dv)), reg(col)),
                4,
            ),
            match self.sigmoid {
                true => reg(acc),
                false => select(
                    nonempty.clone(),
                    mul(reg(acc), reciprocal(reg(sum))),
                    f32(0.0),
                ),
            },
        ));
        let lse = match self.sigmoid {
            true => mul(un(Un::Lg2, reg(sum)), f32(std::f32::consts::LN_2)),
            false => lse_of_half(reg(big_m), reg(sum)),
        };
        valid.push(Stmt::If(
            bin(Bin::Eq, reg(col), i64(0)),
            vec![Stmt::Store(
                Space::Global,
                at(param("lse"), out_row, 4),
                select(nonempty, lse, f32(f32::NEG_INFINITY)),
            )],
            vec![],
        ));
        Stmt::For {
            reg: e,
            start: special64(Special::Tid),
            end: i64(Self::ROWS * dv),
            step: i64::from(THREADS),
            body: vec![
                Stmt::Set(row, bin(Bin::Div, reg(e), i64(dv))),
                Stmt::Set(col, bin(Bin::Rem, reg(e), i64(dv))),
                Stmt::Set(big_m, f32(f32::NEG_INFINITY)),
                Stmt::If(bin(Bin::Lt, reg(row), reg(task.rows)), valid, vec![]),
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(text: &str) -> KernelPlan {
        KernelPlan::decode(&text.parse().unwrap())
    }

    #[test]
    fn sixteen_bit_per_head_caches_up_to_head_dim_256_run_on_tensor_cores() {
        assert!(supports(&plan(
            "heads = 32, kv_heads = 8, head_dim = 128, dtype = bf16"
        )));
        assert!(supports(&plan("heads = 8, head_dim = 256, dtype = f16")));
        assert!(!supports(&plan("heads = 8, head_dim = 128, dtype = f32")));
        assert!(!supports(&plan("heads = 8, head_dim = 24, dtype = bf16")));
        assert!(!supports(&plan(
            "heads = 16, head_dim = 128, mla(latent_rank = 512, rope_dim = 64), dtype = bf16"
        )));
        // Sigmoid's weights stand alone; stick-breaking's walk each row's keys in order.
        assert!(supports(&plan(
            "heads = 8, head_dim = 64, normalize = sigmoid, dtype = bf16"
        )));
        assert!(!supports(&plan(
            "heads = 8, head_dim = 64, normalize = stick_breaking, dtype = bf16"
        )));
    }

    #[test]
    fn the_ring_fits_three_ctas_of_an_sm90_at_head_dim_128() {
        let kernel = lower(&plan(
            "heads = 32, kv_heads = 8, head_dim = 128, dtype = bf16",
        ));
        assert!(3 * (kernel.shared_bytes + 1024) <= 228 * 1024);
    }
}
