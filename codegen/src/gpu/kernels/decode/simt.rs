//! The SIMT f32 decode kernel, which runs any decode plan (see [`super`] for the buffers).
//!
//! Decode has few rows and many keys, so the CTA's threads split each segment's work, not the
//! rows: a thread per (row, key) score, a thread per row for the softmax, and a thread per
//! (row, output column) group of accumulators for `P V`. Q (rotated and scaled), the segment's
//! K and V rows (widened to f32; K rows padded by one float, so a warp reading 32 keys' column
//! hits 32 banks) and the scores sit in shared memory. Under `normalize = stick_breaking` the
//! segments and each row's keys are taken from the last (the nearest), the row's running max
//! being its running sum of `softplus`; the host then gives each task all of its row's keys.

use super::records::{Segment, Strided, THREADS, Task, param, stage_q};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Half, Kernel, Reg, Space, Special, Stmt, Ty, Un};
use crate::gpu::kernels::{
    Env, Regs, StickKey, exp2_twice, from_last, lse_of_half, program, reciprocal, rescale_to,
    sigmoid_weight, special64,
};
use crate::gpu::launch::{DecodeArgs, LaunchRecord};
use crate::plan::{KernelPlan, PlanKind, TileCode};
use attn_dsl::DType;
use attn_dsl::modifier::Expr as M;

/// Output accumulators a thread may hold (`task_rows x v_dim / THREADS`).
const ACCUMULATORS: u32 = 32;

/// Accumulators updated by one key loop of `P V`, skipped together when their rows are past
/// the task's.
const OUTPUT_GROUP: usize = 8;

/// Keys per segment the SIMT kernel stages.
pub(super) fn simt_segment_keys(plan: &KernelPlan) -> u32 {
    if plan.shape.qk_dim + plan.shape.v_dim <= 256 {
        32
    } else {
        16
    }
}

/// Query rows per task of the SIMT kernel: at most 64, and few enough that the task's outputs
/// fit 32 accumulator registers a thread (32 rows at `v_dim` 128, 8 for MLA's 512).
pub(super) fn simt_task_rows(plan: &KernelPlan) -> u32 {
    (ACCUMULATORS * THREADS / plan.shape.v_dim).clamp(1, 64)
}

/// Shared memory of the kernel, byte offsets.
struct Layout {
    q: i64,
    k: i64,
    v: i64,
    s: i64,
    alpha: i64,
    bytes: i64,
}

impl Layout {
    fn of(plan: &KernelPlan) -> Layout {
        let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
        let (seg, rows) = (
            i64::from(simt_segment_keys(plan)),
            i64::from(simt_task_rows(plan)),
        );
        let q = 0;
        let k = q + rows * d * 4;
        let v = k + seg * (d + 1) * 4;
        let s = v + seg * dv * 4;
        let alpha = s + rows * seg * 4;
        Layout {
            q,
            k,
            v,
            s,
            alpha,
            bytes: alpha + rows * 4,
        }
    }
}

/// Lowers the SIMT decode kernel of a plan (per-head KV, or MLA's absorbed form: keys and
/// values rows of `qk_dim` and `v_dim` in the cache's dtype); every decode plan runs on it.
pub fn lower_simt(plan: &KernelPlan) -> Kernel {
    assert_eq!(
        plan.kind,
        PlanKind::Decode,
        "the GPU decode kernel lowers decode plans"
    );
    let mut r = Regs { list: Vec::new() };
    let mut body = Vec::new();
    let task = Task::load(&mut r, &mut body);
    let strided = Strided::new(&mut r);
    let sh = Layout::of(plan);
    body.extend(stage_q(plan, &mut r, &task, sh.q, None));
    let (k, init) = Simt::start(plan, &mut r, task, strided, sh);
    body.extend(init);

    // The segments.
    let si = r.add("segment", Ty::I64);
    let (segment, mut seg_body) = Segment::load(&mut r, reg(si));
    let mut run = k.stage_segment(&segment);
    run.extend(k.scores(&mut r, &segment));
    let (softmax, j) = k.softmax(&mut r, segment.keys);
    run.extend(softmax);
    run.extend(k.p_times_v(j, segment.keys));
    seg_body.push(Stmt::If(
        bin(Bin::Ne, reg(segment.code), i64(TileCode::Skip as i64)),
        run,
        vec![],
    ));
    let (mut step, mut range) = (si, [reg(task.seg0), add(reg(task.seg0), reg(task.nseg))]);
    if plan.stick_breaking() {
        // Stick-breaking weighs keys from the nearest: segments from the last.
        step = r.add("segment_step", Ty::I64);
        let segment = add(reg(task.seg0), from_last(reg(task.nseg), reg(step)));
        seg_body.insert(0, Stmt::Set(si, segment));
        range = [i64(0), reg(task.nseg)];
    }
    let [start, end] = range;
    body.push(Stmt::For {
        reg: step,
        start,
        end,
        step: 1,
        body: seg_body,
    });
    body.extend(k.epilogue());

    Kernel {
        name: "attention_decode".into(),
        params: DecodeArgs::params(),
        regs: r.list,
        shared_bytes: k.sh.bytes as u32,
        threads: THREADS,
        // Decode waits on memory: three CTAs (12 warps) per SM hide more of it than two, at up
        // to 168 registers a thread (at four, 128, the D 128 kernel spills).
        ctas_per_sm: 3,
        body,
    }
}

/// The kernel being built: the plan's sizes, the shared layout, the task, the element loops,
/// and the running state (a thread per row keeps its max `m` and sum `l`; each thread its
/// accumulators `acc`, outputs `tid + THREADS i`, row `o / v_dim`, column `o % v_dim`; under
/// stick-breaking `m` is the row's running sum of `softplus`). Each
/// phase of [`lower_simt`] is a method.
struct Simt<'a> {
    plan: &'a KernelPlan,
    /// Head dims of Q and K, and of V.
    d: i64,
    dv: i64,
    /// Keys per segment.
    seg: i64,
    sh: Layout,
    task: Task,
    strided: Strided,
    m: Reg,
    l: Reg,
    acc: Vec<Reg>,
}

impl<'a> Simt<'a> {
    /// The running state's registers, and the statements that start it.
    fn start(
        plan: &'a KernelPlan,
        r: &mut Regs,
        task: Task,
        strided: Strided,
        sh: Layout,
    ) -> (Simt<'a>, Vec<Stmt>) {
        let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
        let (rows_max, threads) = (i64::from(simt_task_rows(plan)), i64::from(THREADS));
        let (m, l) = (r.add("m", Ty::F32), r.add("l", Ty::F32));
        // Stick-breaking's running softplus sum starts at 0.
        let m0 = match plan.stick_breaking() {
            true => 0.0,
            false => f32::NEG_INFINITY,
        };
        let mut init = vec![Stmt::Set(m, f32(m0)), Stmt::Set(l, f32(0.0))];
        let n_acc = (rows_max * dv + threads - 1) / threads;
        let acc: Vec<_> = (0..n_acc)
            .map(|i| r.add(format!("acc{i}"), Ty::F32))
            .collect();
        for &a in &acc {
            init.push(Stmt::Set(a, f32(0.0)));
        }
        let k = Simt {
            plan,
            d,
            dv,
            seg: i64::from(simt_segment_keys(plan)),
            sh,
            task,
            strided,
            m,
            l,
            acc,
        };
        (k, init)
    }

    /// Output i's row and column: with v_dim dividing THREADS the column is the thread's for
    /// every i and the row steps by a constant; with THREADS dividing v_dim, the row is i's.
    fn output(&self, i: i64) -> (Expr, Expr) {
        let (tid, threads, dv) = (special64(Special::Tid), i64::from(THREADS), self.dv);
        let o = add(tid.clone(), i64(threads * i));
        if threads % dv == 0 {
            (
                add(bin(Bin::Div, tid.clone(), i64(dv)), i64(i * (threads / dv))),
                bin(Bin::Rem, tid, i64(dv)),
            )
        } else if dv % threads == 0 {
            let per_row = dv / threads;
            (i64(i / per_row), add(tid, i64(threads * (i % per_row))))
        } else {
            (bin(Bin::Div, o.clone(), i64(dv)), bin(Bin::Rem, o, i64(dv)))
        }
    }

    /// Score `(row, key)` of the segment in shared memory.
    fn s_at(&self, row: Expr, key: Expr) -> Expr {
        add(
            i64(self.sh.s),
            mul(add(mul(row, i64(self.seg)), key), i64(4)),
        )
    }

    /// Stage the segment's K and V rows (in the cache's f32, bf16 or f16) as f32: element c of
    /// each region by thread c % THREADS, coalesced, in a loop.
    fn stage_segment(&self, segment: &Segment) -> Vec<Stmt> {
        let (d, dv, sh) = (self.d, self.dv, &self.sh);
        let (row, col) = (self.strided.row, self.strided.col);
        let half = match self.plan.dtype {
            DType::Bf16 => Some(Half::Bf16),
            DType::F16 => Some(Half::F16),
            DType::F32 => None,
        };
        let elem = if half.is_some() { 2 } else { 4 };
        let cache_load = |addr: Expr| match half {
            Some(h) => Expr::LoadHalf(Space::Global, h, Box::new(addr)),
            None => load(Space::Global, Ty::F32, addr),
        };
        let mut run = Vec::new();
        for (base, stride, width, shared, padded) in [
            (segment.k_addr, segment.k_stride, d, sh.k, d + 1),
            (segment.v_addr, segment.v_stride, dv, sh.v, dv),
        ] {
            let mut stage = self.strided.split(width);
            let src = add(
                reg(base),
                mul(add(mul(reg(row), reg(stride)), reg(col)), i64(elem)),
            );
            let dst = add(
                i64(shared),
                mul(add(mul(reg(row), i64(padded)), reg(col)), i64(4)),
            );
            stage.push(Stmt::Store(Space::Shared, dst, cache_load(src)));
            run.push(self.strided.over(mul(reg(segment.keys), i64(width)), stage));
        }
        run.push(Stmt::Barrier);
        run
    }

    /// Scores: a thread per (row, key) pair, `q . k` over shared memory, through the score
    /// program and (on masked segments) the mask; keys sit at the positions of their indices.
    fn scores(&self, r: &mut Regs, segment: &Segment) -> Vec<Stmt> {
        let (plan, d, sh, task) = (self.plan, self.d, &self.sh, &self.task);
        let (row, col) = (self.strided.row, self.strided.col);
        let q_sh = |row: Expr, col: Expr| add(i64(sh.q), mul(add(mul(row, i64(d)), col), i64(4)));
        let (dot, key) = (r.add("dot", Ty::F32), r.add("key", Ty::I64));
        let dd = r.add("dd", Ty::I64);
        let unroll = if d % 4 == 0 { 4 } else { 1 };
        let mut dot_body = Vec::new();
        for u in 0..unroll {
            let at = add(reg(dd), i64(u));
            dot_body.push(Stmt::Set(
                dot,
                fma(
                    load(Space::Shared, Ty::F32, q_sh(reg(row), at.clone())),
                    load(
                        Space::Shared,
                        Ty::F32,
                        add(i64(sh.k), mul(add(mul(reg(col), i64(d + 1)), at), i64(4))),
                    ),
                    reg(dot),
                ),
            ));
        }
        let mut score = self.strided.split(self.seg);
        score.push(Stmt::Set(dot, f32(0.0)));
        score.push(Stmt::For {
            reg: dd,
            start: i64(0),
            end: i64(d),
            step: unroll,
            body: dot_body,
        });
        score.push(Stmt::Set(key, add(reg(segment.first_key), reg(col))));
        let env = Env {
            score: reg(dot),
            batch: reg(task.batch),
            head: task.head_of(reg(row)),
            query: add(reg(task.q_pos0), task.query_of(reg(row))),
            key: reg(key),
            query_index: add(reg(task.qi0), task.query_of(reg(row))),
            key_index: reg(key),
            params: (!plan.params.is_empty())
                .then(|| (super::records::param("params"), plan.params.clone())),
        };
        let mut value = program(&plan.program.score, &env);
        if !matches!(plan.program.mask, M::Bool(true)) {
            let keep = bin(
                Bin::Or,
                bin(Bin::Ne, reg(segment.code), i64(TileCode::Masked as i64)),
                program(&plan.program.mask, &env),
            );
            value = select(keep, value, f32(f32::NEG_INFINITY));
        }
        score.push(Stmt::If(
            bin(Bin::Lt, reg(col), reg(segment.keys)),
            vec![Stmt::Store(
                Space::Shared,
                self.s_at(reg(row), reg(col)),
                value,
            )],
            vec![],
        ));
        vec![
            self.strided.over(mul(reg(task.rows), i64(self.seg)), score),
            Stmt::Barrier,
        ]
    }

    /// The softmax: thread `row` takes its row's max over the segment's `len` keys, rescales
    /// its sum, turns scores into probabilities `2^(s - m)` and leaves the rescale factor for
    /// `P V`. Also returns the key loop's register.
    fn softmax(&self, r: &mut Regs, len: Reg) -> (Vec<Stmt>, Reg) {
        let (m, l, tid) = (self.m, self.l, special64(Special::Tid));
        let (j, mt, m_use, alpha, p) = (
            r.add("j", Ty::I64),
            r.add("tile_max", Ty::F32),
            r.add("m_use", Ty::F32),
            r.add("alpha", Ty::F32),
            r.add("p", Ty::F32),
        );
        let own_s = self.s_at(tid.clone(), reg(j));
        if self.plan.unnormalized() {
            // Each key weighs sigmoid(s) on its own, or (stick-breaking, keys from the last)
            // behind its row's running softplus sum in `m`: no max; the accumulator's factor
            // is 1.
            let (mut weigh, mut step) = (Vec::new(), j);
            let s_j = load(Space::Shared, Ty::F32, own_s.clone());
            if self.plan.stick_breaking() {
                let stick = StickKey::new(r);
                step = r.add("j_step", Ty::I64);
                weigh.push(Stmt::Set(j, from_last(reg(len), reg(step))));
                weigh.extend(stick.weigh(s_j, reg(m)));
                weigh.push(Stmt::Set(p, reg(stick.weight)));
                weigh.push(Stmt::Set(m, add(reg(m), reg(stick.added))));
            } else {
                weigh.push(Stmt::Set(p, sigmoid_weight(s_j)));
            }
            weigh.extend([
                Stmt::Store(Space::Shared, own_s, reg(p)),
                Stmt::Set(l, add(reg(l), reg(p))),
            ]);
            let softmax = vec![
                Stmt::For {
                    reg: step,
                    start: i64(0),
                    end: reg(len),
                    step: 1,
                    body: weigh,
                },
                Stmt::Store(
                    Space::Shared,
                    at(i64(self.sh.alpha), tid.clone(), 4),
                    f32(1.0),
                ),
            ];
            let run = vec![
                Stmt::If(bin(Bin::Lt, tid, reg(self.task.rows)), softmax, vec![]),
                Stmt::Barrier,
            ];
            return (run, j);
        }
        let m_new = bin(Bin::Max, reg(m), reg(mt));
        let mut softmax = vec![
            Stmt::Set(mt, f32(f32::NEG_INFINITY)),
            Stmt::For {
                reg: j,
                start: i64(0),
                end: reg(len),
                step: 1,
                body: vec![Stmt::Set(
                    mt,
                    bin(
                        Bin::Max,
                        reg(mt),
                        load(Space::Shared, Ty::F32, own_s.clone()),
                    ),
                )],
            },
        ];
        softmax.extend(rescale_to(m_new, [m, l, m_use, alpha]));
        softmax.extend([
            Stmt::For {
                reg: j,
                start: i64(0),
                end: reg(len),
                step: 1,
                body: vec![
                    Stmt::Set(
                        p,
                        exp2_twice(sub(load(Space::Shared, Ty::F32, own_s.clone()), reg(m_use))),
                    ),
                    Stmt::Store(Space::Shared, own_s, reg(p)),
                    Stmt::Set(l, add(reg(l), reg(p))),
                ],
            },
            Stmt::Store(
                Space::Shared,
                at(i64(self.sh.alpha), tid.clone(), 4),
                reg(alpha),
            ),
        ]);
        let run = vec![
            Stmt::If(bin(Bin::Lt, tid, reg(self.task.rows)), softmax, vec![]),
            Stmt::Barrier,
        ];
        (run, j)
    }

    /// O = O alpha + P V: a thread's outputs in groups of OUTPUT_GROUP, each group's key loop
    /// (`j` over the segment's `len` keys) only where its first row is one of the task's (a
    /// task of 4 rows at v_dim 128 runs one group of 8; rows past the task's inside a group are
    /// clamped: they compute, unstored).
    fn p_times_v(&self, j: Reg, len: Reg) -> Vec<Stmt> {
        let (sh, rows) = (&self.sh, self.task.rows);
        let clamp_row = |row: Expr| bin(Bin::Min, row, sub(reg(rows), i64(1)));
        let mut run = Vec::new();
        for (g, group) in self.acc.chunks(OUTPUT_GROUP).enumerate() {
            let first = (g * OUTPUT_GROUP) as i64;
            let mut update = Vec::new();
            let mut pv = Vec::new();
            for (k, &a) in group.iter().enumerate() {
                let (row, col) = self.output(first + k as i64);
                let factor = load(
                    Space::Shared,
                    Ty::F32,
                    at(i64(sh.alpha), clamp_row(row.clone()), 4),
                );
                update.push(Stmt::Set(a, mul(reg(a), factor)));
                let pj = load(Space::Shared, Ty::F32, self.s_at(clamp_row(row), reg(j)));
                let vj = load(
                    Space::Shared,
                    Ty::F32,
                    add(i64(sh.v), mul(add(mul(reg(j), i64(self.dv)), col), i64(4))),
                );
                pv.push(Stmt::Set(a, fma(pj, vj, reg(a))));
            }
            update.push(Stmt::For {
                reg: j,
                start: i64(0),
                end: reg(len),
                step: 1,
                body: pv,
            });
            let (row, _) = self.output(first);
            run.push(Stmt::If(bin(Bin::Lt, row, reg(rows)), update, vec![]));
        }
        run.push(Stmt::Barrier);
        run
    }

    /// Epilogue: row owners publish their sums (in the alpha slots) and write lse; every
    /// thread writes its outputs O / l.
    fn epilogue(&self) -> Vec<Stmt> {
        let (tid, sh, l) = (special64(Special::Tid), &self.sh, self.l);
        let (row0, rows) = (self.task.row0, self.task.rows);
        let own_row = add(reg(row0), tid.clone());
        let lse = if self.plan.unnormalized() {
            mul(un(Un::Lg2, reg(l)), f32(std::f32::consts::LN_2))
        } else {
            lse_of_half(reg(self.m), reg(l))
        };
        let mut body = vec![
            Stmt::If(
                bin(Bin::Lt, tid.clone(), reg(rows)),
                vec![
                    Stmt::Store(Space::Shared, at(i64(sh.alpha), tid, 4), reg(l)),
                    Stmt::Store(
                        Space::Global,
                        at(param("lse"), own_row, 4),
                        select(bin(Bin::Ne, reg(l), f32(0.0)), lse, f32(f32::NEG_INFINITY)),
                    ),
                ],
                vec![],
            ),
            Stmt::Barrier,
        ];
        for (i, &a) in self.acc.iter().enumerate() {
            let (row, col) = self.output(i as i64);
            let sum = load(Space::Shared, Ty::F32, at(i64(sh.alpha), row.clone(), 4));
            // Sigmoid and stick-breaking weights are not normalized: out is the accumulator.
            let value = if self.plan.unnormalized() {
                reg(a)
            } else {
                select(
                    bin(Bin::Ne, sum.clone(), f32(0.0)),
                    mul(reg(a), reciprocal(sum)),
                    f32(0.0),
                )
            };
            let addr = add(
                param("out"),
                mul(
                    add(mul(add(reg(row0), row.clone()), i64(self.dv)), col),
                    i64(4),
                ),
            );
            body.push(Stmt::If(
                bin(Bin::Lt, row, reg(rows)),
                vec![Stmt::Store(Space::Global, addr, value)],
                vec![],
            ));
        }
        body
    }
}
