//! The decode kernel on tensor cores, for bf16 and f16 per-head caches: FlashDecoding's split
//! over keys inside the CTA, with FlashInfer's treatment of a GQA group (its query heads are
//! the M rows of `mma.sync`, so a CTA reads each of its kv head's keys and values once).
//!
//! A task (the query rows of one work item, at most [`TASK_ROWS`], against a list of segments
//! of at most [`SEGMENT_KEYS`] keys; the records of [`super::decode`]) runs on four warps. Each
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

use super::decode::{Segment, THREADS, Task, param, stage_q};
use super::forward::{Env, Regs, exp2_twice, lse_of_half, program, reciprocal, special64};
use super::ir::build::*;
use super::ir::{Bin, Expr, Half, Kernel, Reg, Space, Special, Stmt, Ty};
use super::launch::{DecodeArgs, LaunchRecord};
use crate::plan::{KernelPlan, PlanKind, TileCode};
use attn_dsl::DType;
use attn_dsl::modifier::Expr as M;

/// Keys per segment: one `k16` step of `P V` (two `n8` blocks of `S`) per warp and round.
pub const SEGMENT_KEYS: u32 = 16;

/// Query rows per task: the M dimension of one `mma.sync`.
pub const TASK_ROWS: u32 = 16;

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
        && matches!(plan.dtype, DType::Bf16 | DType::F16)
        && plan.mla.is_none()
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
}

/// Lowers the tensor-core decode kernel. The plan must be [`supports`]ed.
pub fn lower(plan: &KernelPlan) -> Kernel {
    assert!(
        supports(plan),
        "the tensor-core decode kernel runs 16-bit per-head decode plans"
    );
    let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    let half = if plan.dtype == DType::F16 {
        Half::F16
    } else {
        Half::Bf16
    };
    let pack = |lo: Expr, hi: Expr| Expr::PackHalf(half, Box::new(lo), Box::new(hi));
    let sh = Layout::of(plan);
    let mut r = Regs { list: Vec::new() };
    let mut body = Vec::new();
    let tid = special64(Special::Tid);
    let lane = cast(Expr::Special(Special::Lane), Ty::I64);
    let task = Task::load(&mut r, &mut body);

    // Where this lane is: warp, group g (rows g and g + 8), thread-in-group q.
    let (warp, g, q) = (
        r.add("warp", Ty::I64),
        r.add("g", Ty::I64),
        r.add("q", Ty::I64),
    );
    body.extend([
        Stmt::Set(warp, bin(Bin::Div, tid.clone(), i64(32))),
        Stmt::Set(g, bin(Bin::Div, lane.clone(), i64(4))),
        Stmt::Set(q, bin(Bin::Rem, lane.clone(), i64(4))),
    ]);
    // The lane's two rows' head, position and call index, for the score program.
    let row_of = |h: usize| add(reg(g), i64(8 * h as i64));
    let mut head = Vec::new();
    let mut pos = Vec::new();
    let mut index = Vec::new();
    for h in 0..2 {
        let (hd, p, i) = (
            r.add(format!("head{h}"), Ty::I64),
            r.add(format!("position{h}"), Ty::I64),
            r.add(format!("query_index{h}"), Ty::I64),
        );
        body.extend([
            Stmt::Set(hd, task.head_of(row_of(h))),
            Stmt::Set(p, add(reg(task.q_pos0), task.query_of(row_of(h)))),
            Stmt::Set(i, add(reg(task.qi0), task.query_of(row_of(h)))),
        ]);
        head.push(hd);
        pos.push(p);
        index.push(i);
    }

    // Q: staged in f32 (scaled, rotated, rows past the task's zero) where the second stage
    // will be, then held as A fragments: register i of step ks is row g + 8 (i % 2), columns
    // 16 ks + 8 (i / 2) + 2 q and the next.
    body.extend(stage_q(
        plan,
        &mut r,
        &task,
        sh.stage,
        Some(i64::from(TASK_ROWS)),
    ));
    let q_at = |row: Expr, col: i64| {
        load(
            Space::Shared,
            Ty::F32,
            add(
                i64(sh.stage),
                mul(
                    add(mul(row, i64(d as i64)), add(mul(reg(q), i64(2)), i64(col))),
                    i64(4),
                ),
            ),
        )
    };
    // Q is held as two parts, its 16-bit rounding and the rounding of the rest, and `S = Q K^T`
    // takes an MMA for each: K is exact in its 16-bit format, so the scores are then as exact
    // as f32 products (the tensor cores idle in decode, which waits on memory). A lane reads
    // its rounded pair back through its own word of shared memory to take the rest. Both
    // parts stay in registers up to head dim 128; past it, the rest goes to shared memory
    // (after the ring, in fragment order: conflict-free) and is read back per step.
    let lo_shared = d >= 128;
    let lo_temp = [0, 1, 2, 3].map(|i| r.add(format!("qa_rest{i}"), Ty::I32));
    let qa: Vec<[[Reg; 4]; 2]> = (0..d / 16)
        .map(|ks| {
            let hi = [0, 1, 2, 3].map(|i| r.add(format!("qa{ks}_{i}"), Ty::I32));
            let lo = if lo_shared {
                lo_temp
            } else {
                [0, 1, 2, 3].map(|i| r.add(format!("qa{ks}_rest{i}"), Ty::I32))
            };
            [hi, lo]
        })
        .collect();
    let lo_word = |ks: usize, i: usize| {
        add(
            i64(sh.bytes() + 4 * 32 * (4 * ks + i) as i64),
            mul(lane.clone(), i64(4)),
        )
    };
    let word = add(i64(sh.stage + 64 * d as i64), mul(tid.clone(), i64(4)));
    for (ks, [hi, lo]) in qa.iter().enumerate() {
        for i in 0..4 {
            let (row, col) = (row_of(i % 2), (16 * ks + 8 * (i / 2)) as i64);
            let (x0, x1) = (q_at(row.clone(), col), q_at(row, col + 1));
            let rounded = |byte: i64| {
                Expr::LoadHalf(Space::Shared, half, Box::new(add(word.clone(), i64(byte))))
            };
            let rest = pack(sub(x0.clone(), rounded(0)), sub(x1.clone(), rounded(2)));
            body.extend([
                Stmt::Set(hi[i], pack(x0, x1)),
                Stmt::Store(Space::Shared, word.clone(), reg(hi[i])),
            ]);
            body.push(if lo_shared {
                // Every warp holds the same fragments: warp 0 stores them.
                Stmt::If(
                    bin(Bin::Eq, reg(warp), i64(0)),
                    vec![Stmt::Store(Space::Shared, lo_word(ks, i), rest)],
                    vec![],
                )
            } else {
                Stmt::Set(lo[i], rest)
            });
        }
    }

    // Running state of the lane's rows; O accumulators o[vb][i]: row g + 8 (i / 2), column
    // 8 vb + 2 q + i % 2.
    let (m, l) = (
        [0, 1].map(|h| r.add(format!("m{h}"), Ty::F32)),
        [0, 1].map(|h| r.add(format!("l{h}"), Ty::F32)),
    );
    for h in 0..2 {
        body.push(Stmt::Set(m[h], f32(f32::NEG_INFINITY)));
        body.push(Stmt::Set(l[h], f32(0.0)));
    }
    let o: Vec<[Reg; 4]> = (0..dv / 8)
        .map(|vb| [0, 1, 2, 3].map(|i| r.add(format!("o{vb}_{i}"), Ty::F32)))
        .collect();
    for x in o.iter().flatten() {
        body.push(Stmt::Set(*x, f32(0.0)));
    }

    // Rounds: segment seg0 + 4 round + warp for each warp, staged in buffer round % 2.
    let round = r.add("round", Ty::I64);
    let segment_of = |round: Expr| add(add(reg(task.seg0), mul(round, i64(WARPS))), reg(warp));
    let present = |segment: Expr| bin(Bin::Lt, segment, add(reg(task.seg0), reg(task.nseg)));
    let buffer_of = |round: Expr| {
        add(
            mul(bin(Bin::Rem, round, i64(STAGES)), i64(sh.stage)),
            mul(reg(warp), i64(sh.warp)),
        )
    };
    let runs = |code: Reg| bin(Bin::Ne, reg(code), i64(TileCode::Skip as i64));

    // A round's copies: the warp's segment's K and V rows, 16-byte chunk c = lane + 32 i of
    // each region; rows past the segment's keys read nothing and land as zeros.
    let (next, next_buffer) = (
        r.add("next_segment", Ty::I64),
        r.add("next_buffer", Ty::I64),
    );
    let (seg_next, load_next) = Segment::load(&mut r, reg(next));
    let mut copies = Vec::new();
    for (addr, stride, width, offset, row_bytes) in [
        (seg_next.k_addr, seg_next.k_stride, d, 0, sh.k_row),
        (
            seg_next.v_addr,
            seg_next.v_stride,
            dv,
            sh.k_row * 16,
            sh.v_row,
        ),
    ] {
        let per_row = (width / 8) as i64;
        for i in 0..(width / 16) as i64 {
            let c = add(lane.clone(), i64(32 * i));
            let (row, col) = (
                bin(Bin::Div, c.clone(), i64(per_row)),
                mul(bin(Bin::Rem, c, i64(per_row)), i64(16)),
            );
            let inside = bin(Bin::Lt, row.clone(), reg(seg_next.keys));
            let src_row = select(inside.clone(), row.clone(), i64(0));
            copies.push(Stmt::CpAsync {
                dst: add(
                    add(reg(next_buffer), i64(offset)),
                    add(mul(row, i64(row_bytes)), col.clone()),
                ),
                src: add(add(reg(addr), mul(mul(src_row, reg(stride)), i64(2))), col),
                src_bytes: select(inside, Expr::Int(16, Ty::I32), Expr::Int(0, Ty::I32)),
            });
        }
    }
    let issue = |round: Expr| {
        let mut then = load_next.clone();
        then.push(Stmt::If(runs(seg_next.code), copies.clone(), vec![]));
        vec![
            Stmt::Set(next, segment_of(round.clone())),
            Stmt::Set(next_buffer, buffer_of(round)),
            Stmt::If(present(reg(next)), then, vec![]),
            Stmt::CpAsyncCommit,
        ]
    };
    body.extend(issue(i64(0)));

    // `ldmatrix` lane offsets inside a warp's buffer (lane l addresses row l % 8 of matrix
    // l / 8). K, untransposed: matrix i is keys 8 (i / 2).., columns 8 (i % 2).. of a 16-column
    // step, so registers (0, 1) are key block 0's B fragment and (2, 3) key block 1's. V,
    // transposed: matrix i is keys 8 (i % 2).., columns 8 (i / 2).., so registers (0, 1) are
    // column block vb's B fragment and (2, 3) vb + 1's.
    let (k_lane, v_lane) = (r.add("k_lane", Ty::I64), r.add("v_lane", Ty::I64));
    let (lane_row, lane_matrix) = (
        bin(Bin::Rem, lane.clone(), i64(8)),
        bin(Bin::Div, lane.clone(), i64(8)),
    );
    body.push(Stmt::Set(
        k_lane,
        add(
            mul(
                add(
                    lane_row.clone(),
                    mul(bin(Bin::Div, lane.clone(), i64(16)), i64(8)),
                ),
                i64(sh.k_row),
            ),
            mul(bin(Bin::Rem, lane_matrix.clone(), i64(2)), i64(16)),
        ),
    ));
    body.push(Stmt::Set(
        v_lane,
        add(
            add(
                mul(
                    add(lane_row, mul(bin(Bin::Rem, lane_matrix, i64(2)), i64(8))),
                    i64(sh.v_row),
                ),
                mul(bin(Bin::Div, lane.clone(), i64(16)), i64(16)),
            ),
            i64(16 * sh.k_row),
        ),
    ));

    // This round's segment, from the warp's buffer.
    let (current, buffer) = (r.add("segment", Ty::I64), r.add("buffer", Ty::I64));
    let (seg, load_seg) = Segment::load(&mut r, reg(current));
    let bm = [0, 1, 2, 3].map(|i| r.add(format!("bm{i}"), Ty::I32));
    let s: Vec<[Reg; 4]> = (0..2)
        .map(|nb| [0, 1, 2, 3].map(|i| r.add(format!("s{nb}_{i}"), Ty::F32)))
        .collect();
    let mut run = Vec::new();
    // S = Q K^T: s[nb][i] for key 8 nb + 2 q + i % 2, row g + 8 (i / 2).
    for x in s.iter().flatten() {
        run.push(Stmt::Set(*x, f32(0.0)));
    }
    for (ks, a) in qa.iter().enumerate() {
        if lo_shared {
            for (i, &x) in lo_temp.iter().enumerate() {
                run.push(Stmt::Set(x, load(Space::Shared, Ty::I32, lo_word(ks, i))));
            }
        }
        run.push(Stmt::LdMatrix {
            dst: bm.to_vec(),
            addr: add(add(reg(buffer), reg(k_lane)), i64(32 * ks as i64)),
            trans: false,
        });
        for nb in 0..2 {
            for part in a {
                run.push(Stmt::Mma {
                    half,
                    d: s[nb],
                    a: *part,
                    b: [bm[2 * nb], bm[2 * nb + 1]],
                    c: s[nb],
                });
            }
        }
    }
    // The score program per element; keys past the segment's never count, and the mask
    // applies on masked segments.
    let masks = !matches!(plan.program.mask, M::Bool(true));
    for (nb, frag) in s.iter().enumerate() {
        for (i, &x) in frag.iter().enumerate() {
            let h = i / 2;
            let local = add(mul(reg(q), i64(2)), i64((8 * nb + i % 2) as i64));
            let key = add(reg(seg.first_key), local.clone());
            let env = Env {
                score: reg(x),
                batch: reg(task.batch),
                head: reg(head[h]),
                query: reg(pos[h]),
                key: key.clone(),
                query_index: reg(index[h]),
                key_index: key,
            };
            let mut keep = bin(Bin::Lt, local, reg(seg.keys));
            if masks {
                keep = bin(
                    Bin::And,
                    keep,
                    bin(
                        Bin::Or,
                        bin(Bin::Ne, reg(seg.code), i64(TileCode::Masked as i64)),
                        program(&plan.program.mask, &env),
                    ),
                );
            }
            run.push(Stmt::Set(
                x,
                select(
                    keep,
                    program(&plan.program.score, &env),
                    f32(f32::NEG_INFINITY),
                ),
            ));
        }
    }
    // The online softmax of the lane's rows: the segment's max over the lane's elements, then
    // its quad; the rescale of the sum and O; P = 2^(2 (s - m)).
    let (mt, m_use, alpha) = (
        r.add("tile_max", Ty::F32),
        r.add("m_use", Ty::F32),
        r.add("alpha", Ty::F32),
    );
    for h in 0..2 {
        run.push(Stmt::Set(mt, f32(f32::NEG_INFINITY)));
        for frag in &s {
            for x in [frag[2 * h], frag[2 * h + 1]] {
                run.push(Stmt::Set(mt, bin(Bin::Max, reg(mt), reg(x))));
            }
        }
        for lane_mask in [1, 2] {
            run.push(Stmt::Set(
                mt,
                bin(
                    Bin::Max,
                    reg(mt),
                    Expr::ShflXor(Box::new(reg(mt)), lane_mask),
                ),
            ));
        }
        let m_new = bin(Bin::Max, reg(m[h]), reg(mt));
        run.extend([
            Stmt::Set(
                m_use,
                select(
                    bin(Bin::Eq, m_new.clone(), f32(f32::NEG_INFINITY)),
                    f32(0.0),
                    m_new.clone(),
                ),
            ),
            Stmt::Set(alpha, exp2_twice(sub(reg(m[h]), reg(m_use)))),
            Stmt::Set(m[h], m_new),
            Stmt::Set(l[h], mul(reg(l[h]), reg(alpha))),
        ]);
        for frag in &o {
            for x in [frag[2 * h], frag[2 * h + 1]] {
                run.push(Stmt::Set(x, mul(reg(x), reg(alpha))));
            }
        }
        for frag in &s {
            for x in [frag[2 * h], frag[2 * h + 1]] {
                run.push(Stmt::Set(x, exp2_twice(sub(reg(x), reg(m_use)))));
                run.push(Stmt::Set(l[h], add(reg(l[h]), reg(x))));
            }
        }
    }
    // O += P V: P's C fragments of key blocks 0 and 1 are the A fragment of the one k step.
    let pa = [0, 1, 2, 3].map(|i| r.add(format!("pa{i}"), Ty::I32));
    let (s0, s1) = (s[0], s[1]);
    run.extend([
        Stmt::Set(pa[0], pack(reg(s0[0]), reg(s0[1]))),
        Stmt::Set(pa[1], pack(reg(s0[2]), reg(s0[3]))),
        Stmt::Set(pa[2], pack(reg(s1[0]), reg(s1[1]))),
        Stmt::Set(pa[3], pack(reg(s1[2]), reg(s1[3]))),
    ]);
    for vb in (0..dv / 8).step_by(2) {
        run.push(Stmt::LdMatrix {
            dst: bm.to_vec(),
            addr: add(add(reg(buffer), reg(v_lane)), i64(16 * vb as i64)),
            trans: true,
        });
        for step in 0..2 {
            run.push(Stmt::Mma {
                half,
                d: o[vb + step],
                a: pa,
                b: [bm[2 * step], bm[2 * step + 1]],
                c: o[vb + step],
            });
        }
    }
    let mut compute = load_seg;
    compute.push(Stmt::If(runs(seg.code), run, vec![]));

    // Per round: this round's copies land (and are visible; every warp is done with the
    // buffer the next round's copies fill), the next round's copies fly while this one's
    // segment computes.
    let rounds = bin(Bin::Div, add(reg(task.nseg), i64(WARPS - 1)), i64(WARPS));
    let mut round_body = vec![Stmt::CpAsyncWait(0), Stmt::Barrier];
    round_body.extend(issue(add(reg(round), i64(1))));
    round_body.extend([
        Stmt::Set(current, segment_of(reg(round))),
        Stmt::Set(buffer, buffer_of(reg(round))),
        Stmt::If(present(reg(current)), compute, vec![]),
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
    let rows = i64::from(TASK_ROWS);
    let o_at = |w: Expr, row: Expr, col: Expr| {
        mul(
            add(mul(add(mul(w, i64(rows)), row), i64(dv as i64)), col),
            i64(4),
        )
    };
    let ml_base = WARPS * rows * dv as i64 * 4;
    let m_at = |w: Expr, row: Expr| at(i64(ml_base), add(mul(w, i64(rows)), row), 4);
    let l_at = |w: Expr, row: Expr| {
        at(
            i64(ml_base + WARPS * rows * 4),
            add(mul(w, i64(rows)), row),
            4,
        )
    };
    body.push(Stmt::Barrier);
    for h in 0..2 {
        for lane_mask in [1, 2] {
            body.push(Stmt::Set(
                l[h],
                add(reg(l[h]), Expr::ShflXor(Box::new(reg(l[h])), lane_mask)),
            ));
        }
        body.push(Stmt::If(
            bin(Bin::Eq, reg(q), i64(0)),
            vec![
                Stmt::Store(Space::Shared, m_at(reg(warp), row_of(h)), reg(m[h])),
                Stmt::Store(Space::Shared, l_at(reg(warp), row_of(h)), reg(l[h])),
            ],
            vec![],
        ));
        for (vb, frag) in o.iter().enumerate() {
            for j in 0..2 {
                let col = add(mul(reg(q), i64(2)), i64((8 * vb + j) as i64));
                body.push(Stmt::Store(
                    Space::Shared,
                    o_at(reg(warp), row_of(h), col),
                    reg(frag[2 * h + j]),
                ));
            }
        }
    }
    body.push(Stmt::Barrier);
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
    let mut merge = vec![
        Stmt::Set(row, bin(Bin::Div, reg(e), i64(dv as i64))),
        Stmt::Set(col, bin(Bin::Rem, reg(e), i64(dv as i64))),
        Stmt::Set(big_m, f32(f32::NEG_INFINITY)),
    ];
    let mut valid = Vec::new();
    for w in 0..WARPS {
        valid.push(Stmt::Set(
            big_m,
            bin(
                Bin::Max,
                reg(big_m),
                load(Space::Shared, Ty::F32, m_at(i64(w), reg(row))),
            ),
        ));
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
        valid.extend([
            Stmt::Set(
                factor,
                exp2_twice(sub(
                    load(Space::Shared, Ty::F32, m_at(i64(w), reg(row))),
                    reg(m_all),
                )),
            ),
            Stmt::Set(
                sum,
                fma(
                    load(Space::Shared, Ty::F32, l_at(i64(w), reg(row))),
                    reg(factor),
                    reg(sum),
                ),
            ),
            Stmt::Set(
                acc,
                fma(
                    load(Space::Shared, Ty::F32, o_at(i64(w), reg(row), reg(col))),
                    reg(factor),
                    reg(acc),
                ),
            ),
        ]);
    }
    // The sum is 0 only when no key was kept; a NaN score carries NaN through.
    let nonempty = bin(Bin::Ne, reg(sum), f32(0.0));
    let out_row = add(reg(task.row0), reg(row));
    valid.push(Stmt::Store(
        Space::Global,
        at(
            param("out"),
            add(mul(out_row.clone(), i64(dv as i64)), reg(col)),
            4,
        ),
        select(
            nonempty.clone(),
            mul(reg(acc), reciprocal(reg(sum))),
            f32(0.0),
        ),
    ));
    valid.push(Stmt::If(
        bin(Bin::Eq, reg(col), i64(0)),
        vec![Stmt::Store(
            Space::Global,
            at(param("lse"), out_row, 4),
            select(
                nonempty,
                lse_of_half(reg(big_m), reg(sum)),
                f32(f32::NEG_INFINITY),
            ),
        )],
        vec![],
    ));
    merge.push(Stmt::If(
        bin(Bin::Lt, reg(row), reg(task.rows)),
        valid,
        vec![],
    ));
    body.push(Stmt::For {
        reg: e,
        start: tid,
        end: i64(rows * dv as i64),
        step: i64::from(THREADS),
        body: merge,
    });

    Kernel {
        name: "attention_decode_tc".into(),
        params: DecodeArgs::params(),
        regs: r.list,
        shared_bytes: (sh.bytes() + if lo_shared { 32 * d as i64 } else { 0 }) as u32,
        threads: THREADS,
        // Decode waits on memory: three CTAs (12 warps) per SM up to head dim 128 (170
        // registers a thread); Q's fragments and O's accumulators need more at 256.
        ctas_per_sm: if d + dv <= 256 { 3 } else { 2 },
        body,
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
    }

    #[test]
    fn the_ring_fits_three_ctas_of_an_sm90_at_head_dim_128() {
        let kernel = lower(&plan(
            "heads = 32, kv_heads = 8, head_dim = 128, dtype = bf16",
        ));
        assert!(3 * (kernel.shared_bytes + 1024) <= 228 * 1024);
    }
}
