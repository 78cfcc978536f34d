//! What the two tensor-core decode kernels ([`super::tc`], warps over keys, and
//! [`super::wide`], warps over head dims) share: a lane's place in the `mma.sync`
//! fragments of a 16-row task, Q's A fragments in two 16-bit parts, `cp.async` copies of a
//! segment's rows, `S = Q K^T`, the score program and mask, the online softmax and `O += P V`.
//!
//! Fragment layouts are the PTX ISA's for `m16n8k16`: lane `l` of a warp is in group
//! `g = l / 4` (rows `g` and `g + 8`) at thread `q = l % 4` of it; a C fragment's register `i`
//! is row `g + 8 (i / 2)`, column `2 q + i % 2` of its 8-column block.

use super::records::{Segment, Task, stage_q};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Half, Reg, Space, Special, Stmt, Ty};
use crate::gpu::kernels::{Env, Regs, exp2_twice, program, rescale_to, sigmoid_weight, special64};
use crate::plan::{KernelPlan, TileCode};
use attn_dsl::DType;
use attn_dsl::modifier::Expr as M;

/// Rows of a task: the M dimension of one `mma.sync`.
pub const ROWS: u32 = 16;

/// Keys of a segment: one `k16` step of `P V`, two `n8` blocks of `S`.
pub const KEYS: u32 = 16;

/// The 16-bit format of a plan's cache, which the tensor cores take.
pub(super) fn half_of(plan: &KernelPlan) -> Half {
    if plan.dtype == DType::F16 {
        Half::F16
    } else {
        Half::Bf16
    }
}

/// Whether a plan's cache is 16-bit (what both tensor-core kernels need).
pub(super) fn sixteen_bit(plan: &KernelPlan) -> bool {
    matches!(plan.dtype, DType::Bf16 | DType::F16)
}

/// A lane's place: its warp, group `g` and thread-in-group `q`, and its two rows' head,
/// position and call index for the score program.
pub(super) struct Lane {
    pub warp: Reg,
    pub g: Reg,
    pub q: Reg,
    head: [Reg; 2],
    position: [Reg; 2],
    index: [Reg; 2],
}

impl Lane {
    /// Registers for the lane's place, set by statements pushed onto `body`.
    pub(super) fn new(r: &mut Regs, body: &mut Vec<Stmt>, task: &Task) -> Lane {
        let (tid, lane) = (special64(Special::Tid), special64(Special::Lane));
        let (warp, g, q) = (
            r.add("warp", Ty::I64),
            r.add("g", Ty::I64),
            r.add("q", Ty::I64),
        );
        body.extend([
            Stmt::Set(warp, bin(Bin::Div, tid, i64(32))),
            Stmt::Set(g, bin(Bin::Div, lane.clone(), i64(4))),
            Stmt::Set(q, bin(Bin::Rem, lane, i64(4))),
        ]);
        let per_row =
            |name: &str, r: &mut Regs| [0, 1].map(|h| r.add(format!("{name}{h}"), Ty::I64));
        let (head, position, index) = (
            per_row("head", r),
            per_row("position", r),
            per_row("query_index", r),
        );
        for h in 0..2 {
            let row = add(reg(g), i64(8 * h as i64));
            body.extend([
                Stmt::Set(head[h], task.head_of(row.clone())),
                Stmt::Set(
                    position[h],
                    add(reg(task.q_pos0), task.query_of(row.clone())),
                ),
                Stmt::Set(index[h], add(reg(task.qi0), task.query_of(row))),
            ]);
        }
        Lane {
            warp,
            g,
            q,
            head,
            position,
            index,
        }
    }

    /// Row `g + 8 h` of the task.
    pub(super) fn row(&self, h: usize) -> Expr {
        add(reg(self.g), i64(8 * h as i64))
    }

    /// Column `2 q + j` of a C fragment's 8-column block `block`.
    pub(super) fn column(&self, block: usize, j: usize) -> Expr {
        add(mul(reg(self.q), i64(2)), i64((8 * block + j) as i64))
    }
}

/// Where Q's second 16-bit part lives: in registers, or in shared memory from a byte offset (in
/// fragment order, a word per lane, read back per step), stored by the lanes of warp 0 alone
/// (every warp holds the same fragments there).
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Rest {
    Registers,
    Shared(i64),
}

/// Q's A fragments for some of its `k16` steps, each in two 16-bit parts: its rounding, and
/// the rounding of the rest. `S = Q K^T` takes an MMA for each: K is exact in its 16-bit format,
/// so the scores are as exact as f32 products (the tensor cores idle in decode, which waits on
/// memory).
pub(super) struct QFragments {
    /// The first step (the same in every lane of a warp), and per step the two parts' four
    /// registers (register `i` is row `g + 8 (i % 2)`, columns `16 ks + 8 (i / 2) + 2 q` and
    /// the next).
    first: Expr,
    parts: Vec<[[Reg; 4]; 2]>,
    rest: Rest,
}

impl QFragments {
    /// Stages the task's Q (scaled, rotated; 16 rows, those past the task's zero) in f32 at
    /// `staged` and takes the fragments of `count` steps from step `first` on. A lane reads its rounded pair back
    /// through its own word of shared memory at `words` to take the rest. Ends with a barrier,
    /// after which the staging area may be reused.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn stage(
        plan: &KernelPlan,
        r: &mut Regs,
        body: &mut Vec<Stmt>,
        task: &Task,
        lane: &Lane,
        [staged, words]: [i64; 2],
        (first, count): (Expr, usize),
        rest: Rest,
    ) -> QFragments {
        let d = i64::from(plan.shape.qk_dim);
        let half = half_of(plan);
        let pack = |lo: Expr, hi: Expr| Expr::PackHalf(half, Box::new(lo), Box::new(hi));
        body.extend(stage_q(plan, r, task, staged, Some(i64::from(ROWS))));
        let q_at = |row: Expr, col: Expr| {
            load(
                Space::Shared,
                Ty::F32,
                add(
                    i64(staged),
                    mul(
                        add(mul(row, i64(d)), add(mul(reg(lane.q), i64(2)), col)),
                        i64(4),
                    ),
                ),
            )
        };
        let temp = [0, 1, 2, 3].map(|i| r.add(format!("qa_rest{i}"), Ty::I32));
        let parts: Vec<[[Reg; 4]; 2]> = (0..count)
            .map(|ks| {
                let hi = [0, 1, 2, 3].map(|i| r.add(format!("qa{ks}_{i}"), Ty::I32));
                let lo = match rest {
                    Rest::Shared(_) => temp,
                    Rest::Registers => {
                        [0, 1, 2, 3].map(|i| r.add(format!("qa{ks}_rest{i}"), Ty::I32))
                    }
                };
                [hi, lo]
            })
            .collect();
        let fragments = QFragments { first, parts, rest };
        let word = add(i64(words), mul(special64(Special::Tid), i64(4)));
        for (j, [hi, lo]) in fragments.parts.iter().enumerate() {
            for i in 0..4 {
                let col = add(
                    mul(fragments.first.clone(), i64(16)),
                    i64((16 * j + 8 * (i / 2)) as i64),
                );
                let row = lane.row(i % 2);
                let (x0, x1) = (q_at(row.clone(), col.clone()), q_at(row, add(col, i64(1))));
                let rounded = |byte: i64| {
                    Expr::LoadHalf(Space::Shared, half, Box::new(add(word.clone(), i64(byte))))
                };
                let rest = pack(sub(x0.clone(), rounded(0)), sub(x1.clone(), rounded(2)));
                body.extend([
                    Stmt::Set(hi[i], pack(x0, x1)),
                    Stmt::Store(Space::Shared, word.clone(), reg(hi[i])),
                ]);
                body.push(match fragments.rest {
                    Rest::Shared(_) => Stmt::If(
                        bin(Bin::Eq, reg(lane.warp), i64(0)),
                        vec![Stmt::Store(Space::Shared, fragments.rest_word(j, i), rest)],
                        vec![],
                    ),
                    Rest::Registers => Stmt::Set(lo[i], rest),
                });
            }
        }
        body.push(Stmt::Barrier);
        fragments
    }

    /// Bytes of shared memory the rest takes there (0 in registers).
    pub(super) fn rest_bytes(steps: usize) -> i64 {
        (4 * 4 * 32 * steps) as i64
    }

    /// Lane's word of register `i` of step `j` (of these fragments) of the rest.
    fn rest_word(&self, j: usize, i: usize) -> Expr {
        let Rest::Shared(at) = self.rest else {
            unreachable!("the rest is in registers")
        };
        add(
            i64(at + 4 * 32 * (4 * j + i) as i64),
            mul(special64(Special::Lane), i64(4)),
        )
    }

    /// `S += Q K^T` over these fragments' steps: K's rows from the lane's `ldmatrix` address
    /// `k` (see [`k_lane`]; step `ks` at byte `32 ks` of the rows), into the C fragments of
    /// two key blocks.
    pub(super) fn qk(&self, half: Half, bm: [Reg; 4], k: &Expr, s: &[[Reg; 4]; 2]) -> Vec<Stmt> {
        let mut run = Vec::new();
        for (j, a) in self.parts.iter().enumerate() {
            if let Rest::Shared(_) = self.rest {
                for (i, &x) in a[1].iter().enumerate() {
                    run.push(Stmt::Set(
                        x,
                        load(Space::Shared, Ty::I32, self.rest_word(j, i)),
                    ));
                }
            }
            run.push(Stmt::LdMatrix {
                dst: bm.to_vec(),
                addr: add(
                    add(k.clone(), mul(self.first.clone(), i64(32))),
                    i64(32 * j as i64),
                ),
                trans: false,
            });
            for (nb, block) in s.iter().enumerate() {
                for part in a {
                    run.push(Stmt::Mma {
                        half,
                        d: *block,
                        a: *part,
                        b: [bm[2 * nb], bm[2 * nb + 1]],
                        c: *block,
                    });
                }
            }
        }
        run
    }
}

/// The lane's `ldmatrix` offset into 16 K rows `row_bytes` apart, untransposed: matrix `i`
/// is keys `8 (i / 2)..`, columns `8 (i % 2)..` of a 16-column step, so registers (0, 1) are
/// key block 0's B fragment and (2, 3) key block 1's.
pub(super) fn k_lane(row_bytes: i64) -> Expr {
    let lane = special64(Special::Lane);
    add(
        mul(
            add(
                bin(Bin::Rem, lane.clone(), i64(8)),
                mul(bin(Bin::Div, lane.clone(), i64(16)), i64(8)),
            ),
            i64(row_bytes),
        ),
        mul(bin(Bin::Rem, bin(Bin::Div, lane, i64(8)), i64(2)), i64(16)),
    )
}

/// The lane's `ldmatrix.trans` offset into 16 V rows `row_bytes` apart: matrix `i` is keys
/// `8 (i % 2)..`, columns `8 (i / 2)..`, so registers (0, 1) are column block `vb`'s B
/// fragment and (2, 3) `vb + 1`'s (at byte `16 vb`).
pub(super) fn v_lane(row_bytes: i64) -> Expr {
    let lane = special64(Special::Lane);
    add(
        mul(
            add(
                bin(Bin::Rem, lane.clone(), i64(8)),
                mul(
                    bin(Bin::Rem, bin(Bin::Div, lane.clone(), i64(8)), i64(2)),
                    i64(8),
                ),
            ),
            i64(row_bytes),
        ),
        mul(bin(Bin::Div, lane, i64(16)), i64(16)),
    )
}

/// The `cp.async` copies of a segment's (at most [`KEYS`]) rows of `width` 16-bit values, from
/// `addr` (rows `stride` elements apart) to shared memory at `dst` (rows `row_bytes` apart):
/// 16-byte chunk `c = thread + threads i`; rows past `keys` read nothing and land as zeros. The
/// chunks must divide among the threads.
pub(super) struct RowCopy {
    pub addr: Reg,
    pub stride: Reg,
    pub keys: Reg,
    pub width: usize,
    pub dst: Expr,
    pub row_bytes: i64,
}

impl RowCopy {
    pub(super) fn statements(&self, thread: &Expr, threads: usize) -> Vec<Stmt> {
        let per_row = self.width / 8;
        let chunks = KEYS as usize * per_row;
        assert!(
            chunks.is_multiple_of(threads),
            "{chunks} chunks over {threads} threads"
        );
        (0..chunks / threads)
            .map(|i| {
                let c = add(thread.clone(), i64((threads * i) as i64));
                let (row, col) = (
                    bin(Bin::Div, c.clone(), i64(per_row as i64)),
                    mul(bin(Bin::Rem, c, i64(per_row as i64)), i64(16)),
                );
                let inside = bin(Bin::Lt, row.clone(), reg(self.keys));
                let src_row = select(inside.clone(), row.clone(), i64(0));
                Stmt::CpAsync {
                    dst: add(
                        self.dst.clone(),
                        add(mul(row, i64(self.row_bytes)), col.clone()),
                    ),
                    src: add(
                        add(reg(self.addr), mul(mul(src_row, reg(self.stride)), i64(2))),
                        col,
                    ),
                    src_bytes: select(inside, Expr::Int(16, Ty::I32), Expr::Int(0, Ty::I32)),
                }
            })
            .collect()
    }
}

/// The ring of staged segments: the registers of the next round's segment (its index, the
/// buffer it fills, its record) and the copies of its rows (`copies`, which the kernel sets:
/// they address [`SegmentRing::seg`] and [`SegmentRing::buffer`]).
pub(super) struct SegmentRing {
    next: Reg,
    pub buffer: Reg,
    pub seg: Segment,
    load: Vec<Stmt>,
    pub copies: Vec<Stmt>,
}

impl SegmentRing {
    pub(super) fn new(r: &mut Regs) -> SegmentRing {
        let (next, buffer) = (
            r.add("next_segment", Ty::I64),
            r.add("next_buffer", Ty::I64),
        );
        let (seg, load) = Segment::load(r, reg(next));
        SegmentRing {
            next,
            buffer,
            seg,
            load,
            copies: Vec::new(),
        }
    }

    /// Issues the copies of segment `segment` into the buffer at `buffer`, where the task has
    /// that segment and it runs, and commits them as one group (empty where it has none).
    pub(super) fn issue(&self, task: &Task, segment: Expr, buffer: Expr) -> Vec<Stmt> {
        let mut then = self.load.clone();
        then.push(Stmt::If(runs(&self.seg), self.copies.clone(), vec![]));
        let present = bin(Bin::Lt, reg(self.next), add(reg(task.seg0), reg(task.nseg)));
        vec![
            Stmt::Set(self.next, segment),
            Stmt::Set(self.buffer, buffer),
            Stmt::If(present, then, vec![]),
            Stmt::CpAsyncCommit,
        ]
    }
}

/// The score program, the online softmax (under `normalize = sigmoid`, each key's own weight)
/// and `O += P V` over a segment's `S` (see [`scores`], [`RowState::update`],
/// [`RowState::sigmoid`], [`pv`]).
pub(super) fn softmax_pv(
    plan: &KernelPlan,
    s: &[[Reg; 4]; 2],
    (lane, task, seg): (&Lane, &Task, &Segment),
    state: &RowState,
    [pa, bm]: [[Reg; 4]; 2],
    v: &Expr,
) -> Vec<Stmt> {
    let mut run = scores(plan, s, lane, task, seg);
    match plan.sigmoid() {
        true => run.extend(state.sigmoid(s)),
        false => run.extend(state.update(s)),
    }
    run.extend(pv(half_of(plan), s, [pa, bm], v, &state.o));
    run
}

/// Whether a segment runs (is not skipped).
pub(super) fn runs(seg: &Segment) -> Expr {
    bin(Bin::Ne, reg(seg.code), i64(TileCode::Skip as i64))
}

/// The score program over S's C fragments (keys `8 nb + 2 q + i % 2` of the segment); keys
/// past the segment's never count, and the mask applies on masked segments.
pub(super) fn scores(
    plan: &KernelPlan,
    s: &[[Reg; 4]; 2],
    lane: &Lane,
    task: &Task,
    seg: &Segment,
) -> Vec<Stmt> {
    let masks = !matches!(plan.program.mask, M::Bool(true));
    let mut run = Vec::new();
    for (nb, frag) in s.iter().enumerate() {
        for (i, &x) in frag.iter().enumerate() {
            let h = i / 2;
            let local = lane.column(nb, i % 2);
            let key = add(reg(seg.first_key), local.clone());
            let env = Env {
                score: reg(x),
                batch: reg(task.batch),
                head: reg(lane.head[h]),
                query: reg(lane.position[h]),
                key: key.clone(),
                query_index: reg(lane.index[h]),
                key_index: key,
                params: None,
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
    run
}

/// The running state of a lane's two rows: max and (the lane's part of the) sum in half
/// base-2 units, and O's C fragments.
pub(super) struct RowState {
    pub m: [Reg; 2],
    pub l: [Reg; 2],
    pub o: Vec<[Reg; 4]>,
    temps: [Reg; 3],
}

impl RowState {
    /// Registers for `blocks` 8-column blocks of O, initialized by statements pushed onto
    /// `body`.
    pub(super) fn new(r: &mut Regs, body: &mut Vec<Stmt>, blocks: usize) -> RowState {
        let m = [0, 1].map(|h| r.add(format!("m{h}"), Ty::F32));
        let l = [0, 1].map(|h| r.add(format!("l{h}"), Ty::F32));
        let o: Vec<[Reg; 4]> = (0..blocks)
            .map(|vb| [0, 1, 2, 3].map(|i| r.add(format!("o{vb}_{i}"), Ty::F32)))
            .collect();
        for h in 0..2 {
            body.push(Stmt::Set(m[h], f32(f32::NEG_INFINITY)));
            body.push(Stmt::Set(l[h], f32(0.0)));
        }
        for x in o.iter().flatten() {
            body.push(Stmt::Set(*x, f32(0.0)));
        }
        let temps = [
            r.add("tile_max", Ty::F32),
            r.add("m_use", Ty::F32),
            r.add("alpha", Ty::F32),
        ];
        RowState { m, l, o, temps }
    }

    /// The online softmax over a segment's scores: the max over the lane's elements, then its
    /// quad; the rescale of the sum and O; S becomes `P = 2^(2 (s - m))`.
    pub(super) fn update(&self, s: &[[Reg; 4]; 2]) -> Vec<Stmt> {
        let [mt, m_use, alpha] = self.temps;
        let mut run = Vec::new();
        for h in 0..2 {
            let (m, l) = (self.m[h], self.l[h]);
            run.push(Stmt::Set(mt, f32(f32::NEG_INFINITY)));
            for frag in s {
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
            run.extend(rescale_to(
                bin(Bin::Max, reg(m), reg(mt)),
                [m, l, m_use, alpha],
            ));
            for frag in &self.o {
                for x in [frag[2 * h], frag[2 * h + 1]] {
                    run.push(Stmt::Set(x, mul(reg(x), reg(alpha))));
                }
            }
            for frag in s {
                for x in [frag[2 * h], frag[2 * h + 1]] {
                    run.push(Stmt::Set(x, exp2_twice(sub(reg(x), reg(m_use)))));
                    run.push(Stmt::Set(l, add(reg(l), reg(x))));
                }
            }
        }
        run
    }

    /// Sigmoid attention's weights: S becomes `P = sigmoid(S)` (S in half base-2 units, the
    /// bias in the score program), added to the sum; no max, and O keeps its scale.
    pub(super) fn sigmoid(&self, s: &[[Reg; 4]; 2]) -> Vec<Stmt> {
        let mut run = Vec::new();
        for h in 0..2 {
            for frag in s {
                for x in [frag[2 * h], frag[2 * h + 1]] {
                    run.push(Stmt::Set(x, sigmoid_weight(reg(x))));
                    run.push(Stmt::Set(self.l[h], add(reg(self.l[h]), reg(x))));
                }
            }
        }
        run
    }

    /// The lane's sums over its quad (call once, after the last segment).
    pub(super) fn quad_sums(&self) -> Vec<Stmt> {
        let mut body = Vec::new();
        for l in self.l {
            for lane_mask in [1, 2] {
                body.push(Stmt::Set(
                    l,
                    add(reg(l), Expr::ShflXor(Box::new(reg(l)), lane_mask)),
                ));
            }
        }
        body
    }
}

/// `O += P V` for O's blocks (8 columns each, an even number): P's C fragments of key blocks 0
/// and 1 repacked as the A fragment of the one `k16` step; V's B fragments by `ldmatrix.trans`
/// from the lane's address `v` (see [`v_lane`]; block `vb` at byte `16 vb`).
pub(super) fn pv(
    half: Half,
    s: &[[Reg; 4]; 2],
    [pa, bm]: [[Reg; 4]; 2],
    v: &Expr,
    o: &[[Reg; 4]],
) -> Vec<Stmt> {
    let pack = |lo: Reg, hi: Reg| Expr::PackHalf(half, Box::new(reg(lo)), Box::new(reg(hi)));
    let (s0, s1) = (s[0], s[1]);
    let mut run = vec![
        Stmt::Set(pa[0], pack(s0[0], s0[1])),
        Stmt::Set(pa[1], pack(s0[2], s0[3])),
        Stmt::Set(pa[2], pack(s1[0], s1[1])),
        Stmt::Set(pa[3], pack(s1[2], s1[3])),
    ];
    for vb in (0..o.len()).step_by(2) {
        run.push(Stmt::LdMatrix {
            dst: bm.to_vec(),
            addr: add(v.clone(), i64(16 * vb as i64)),
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
    run
}
