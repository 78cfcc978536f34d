//! A forward plan lowered for sm_90a after FlashAttention-3's design: warp specialization, TMA
//! and `wgmma`.
//!
//! A CTA of three warpgroups handles [`ROWS`] query rows of one (batch, head). Warpgroup 0 is
//! the producer: it lowers its register budget (`setmaxnreg`) and one of its threads brings the
//! CTA's Q once, then each running tile's K and V, by TMA into a two-stage shared ring (128-byte
//! swizzle), each stage guarded by a full and an empty mbarrier for K and for V. Warpgroups 1
//! and 2 are consumers of 64 rows each: they raise their budget, and per tile compute
//! `S = Q K^T` with `wgmma` (both operands K-major in shared memory), release the K stage,
//! apply the score program and mask and the online softmax in registers (the accumulator's
//! layout is the `mma.sync` C fragment's, so [`super::forward_tc`]'s per-element code serves),
//! repack P into A fragments in registers, and accumulate `O += P V` with `wgmma` (V N-major),
//! then release the V stage. Tile codes skip or unmask tiles; producer and consumers walk the
//! same running tiles, so stage and phase follow a count of them.
//!
//! With RoPE, the producer warpgroup rotates Q and each K tile in place once its copies land
//! (in the `Q K^T` operands' format: f16 for bf16 specs whose RoPE rotates every column, as
//! [`super::forward_tc::qk_half`] says), fences its stores for the async proxy, and releases
//! them to the consumers through ready barriers. The producer's code is in `producer.rs`.
//!
//! Scheduling, as FlashAttention-3's: within a consumer, tile t's `Q K^T` is issued before tile
//! t-1's `P V`, so the softmax overlaps that product; between the consumers, named barriers
//! ping-pong (one issues its products while the other's softmax runs).
//!
//! Scope: bf16 and f16 per-head specs whose head dims are multiples of 64 up to 256 (RoPE
//! pairs on even columns). MLA and other dims stay on [`super::forward_tc`]. Not yet: clusters,
//! more than two stages.

mod producer;

use super::forward_tc::qk_half;
use super::{TileScores, epilogue, half_of, online_softmax, score_tile, tile_code};
use crate::gpu::ir::build::*;
use crate::gpu::ir::tma::{Swizzle, TensorMap};
use crate::gpu::ir::{Bin, Expr, Kernel, Reg, Special, Stmt, Ty, Wgmma, WgmmaA};
use crate::gpu::kernels::{Regs, param, special64};
use crate::gpu::launch::{ForwardArgs, LaunchRecord};
use crate::plan::{KernelPlan, PlanKind, TileCode};
use attn_dsl::DType;

/// Threads per CTA: a producer warpgroup and two consumers.
pub const THREADS: u32 = 384;

/// Query rows per CTA: 64 per consumer warpgroup.
pub const ROWS: u32 = 128;

/// Register budgets after `setmaxnreg`, the producer's and each consumer's: 24 and 240, or
/// with RoPE (which the producer applies) 40 and 232; either way 128 p + 256 c fits the SM's 64K.
fn budgets(plan: &KernelPlan) -> (u32, u32) {
    if plan.rope.is_some() {
        (40, 232)
    } else {
        (24, 240)
    }
}

/// Stages of the K and V ring.
const STAGES: i64 = 2;

/// Columns per TMA box and per swizzled block: 64 16-bit values, one 128-byte row.
const BLOCK_COLS: usize = 64;

/// Whether the plan runs on this kernel.
pub fn supports(plan: &KernelPlan) -> bool {
    let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    plan.kind == PlanKind::Forward
        && matches!(plan.dtype, DType::Bf16 | DType::F16)
        && plan.mla.is_none()
        // Stick-breaking's weights are taken by the SIMT kernels only.
        && !plan.stick_breaking()
        && plan.params.is_empty()
        && plan.rope.as_ref().is_none_or(|r| {
            let pairing = r.rope.layout.pairing(r.rope.dim);
            r.first_dim.is_multiple_of(2)
                && (pairing.adjacent() || pairing.partner.is_multiple_of(2))
        })
        && [d, dv]
            .iter()
            .all(|&x| x.is_multiple_of(BLOCK_COLS) && x <= 256)
}

/// Keys per tile: 128 up to head dim 128, else 64 (the O accumulator takes `v_dim / 2`
/// registers a thread, S `key_tile / 2`).
pub fn key_tile(plan: &KernelPlan) -> u32 {
    if plan.shape.qk_dim.max(plan.shape.v_dim) <= 128 {
        128
    } else {
        64
    }
}

/// Where things are in shared memory (bytes, each 1024-aligned).
struct Layout {
    /// Q: consumer c's 64 rows at `q + c * q_per_consumer`, `d / 64` blocks of 64 x 128 bytes.
    q_per_consumer: i64,
    /// Stage s's K at `stage(s)`, V after it: `dims / 64` blocks of `key_tile` x 128 bytes.
    k_bytes: i64,
    v_bytes: i64,
    /// The mbarriers: q_full, q_ready, then per stage k_full, v_full, k_empty, v_empty,
    /// k_ready (the ready ones with RoPE: the tile rotated in place).
    bars: i64,
}

impl Layout {
    fn new(plan: &KernelPlan) -> Layout {
        let (d, dv) = (plan.shape.qk_dim as i64, plan.shape.v_dim as i64);
        let bc = i64::from(key_tile(plan));
        let q_per_consumer = 64 * d * 2;
        let (k_bytes, v_bytes) = (bc * d * 2, bc * dv * 2);
        Layout {
            q_per_consumer,
            k_bytes,
            v_bytes,
            bars: 2 * q_per_consumer + STAGES * (k_bytes + v_bytes),
        }
    }

    fn stage(&self, s: Expr) -> Expr {
        add(
            i64(2 * self.q_per_consumer),
            mul(s, i64(self.k_bytes + self.v_bytes)),
        )
    }

    fn q_full(&self) -> Expr {
        i64(self.bars)
    }

    fn q_ready(&self) -> Expr {
        i64(self.bars + 8)
    }

    /// Barrier `which` (0 k_full, 1 v_full, 2 k_empty, 3 v_empty, 4 k_ready) of stage `s`.
    fn bar(&self, which: i64, s: Expr) -> Expr {
        add(i64(self.bars + 16 + 8 * which * STAGES), mul(s, i64(8)))
    }

    fn bytes(&self) -> u32 {
        (self.bars + 16 + 8 * 5 * STAGES) as u32
    }
}

/// The tensor maps of a launch on `[batch, Sq, Skv]` with q, k and v at the given addresses:
/// each tensor as `[batch * heads][rows][dims]` 16-bit, boxes of 64 columns by 64 query rows
/// (Q) or a key tile (K, V), 128-byte swizzle. Rows past a head's end read as zeros.
pub fn tensor_maps(
    plan: &KernelPlan,
    [b, sq, skv]: [usize; 3],
    [q, k, v]: [i64; 3],
) -> [TensorMap; 3] {
    let (hq, hkv) = (plan.shape.heads as u64, plan.shape.kv_heads as u64);
    let (d, dv) = (plan.shape.qk_dim as u64, plan.shape.v_dim as u64);
    let map = |global: i64, cols: u64, rows: u64, heads: u64, box_rows: u32| TensorMap {
        elem_bytes: 2,
        global,
        dims: vec![cols, rows, b as u64 * heads],
        strides: vec![2 * cols, 2 * cols * rows],
        boxes: vec![BLOCK_COLS as u32, box_rows, 1],
        swizzle: Swizzle::B128,
    };
    let bc = key_tile(plan);
    [
        map(q, d, sq as u64, hq, 64),
        map(k, d, skv as u64, hkv, bc),
        map(v, dv, skv as u64, hkv, bc),
    ]
}

/// The kernel's parameters: the forward launch record's, then the tensor maps of q, k and v.
pub fn params() -> Vec<(String, Ty)> {
    let mut p = ForwardArgs::params();
    for name in ["q_map", "k_map", "v_map"] {
        p.push((name.to_string(), Ty::TensorMap));
    }
    p
}

/// A 128-byte-swizzled matrix descriptor of the tile at shared offset `at`: 8-row groups 1024
/// bytes apart, 64-column blocks `leading` bytes apart (N-major operands; K-major ones ignore
/// it).
fn descriptor(at: Expr, leading: i64) -> Expr {
    let start = bin(
        Bin::Div,
        bin(Bin::And, Expr::SharedAddress(Box::new(at)), i64(0x3ffff)),
        i64(16),
    );
    let fields = ((leading >> 4) << 16)
        | ((1024 >> 4) << 32)
        | (Swizzle::B128.descriptor_code() << 62) as i64;
    bin(Bin::Or, start, i64(fields))
}

fn i32c(x: i64) -> Expr {
    Expr::Int(x, Ty::I32)
}

/// Lowers the kernel. The plan must be [`supports`]ed.
pub fn lower(plan: &KernelPlan) -> Kernel {
    assert!(
        supports(plan),
        "the wgmma kernel runs bf16 and f16 per-head plans with head dims of 64 to 256"
    );
    let mut r = Regs { list: Vec::new() };
    let (k, mut body) = Cta::locate(plan, &mut r);
    body.push(thread0(k.init_barriers()));
    body.push(Stmt::Barrier);
    let producer = k.producer(&mut r);
    let (c, setup) = k.consumer(&mut r);
    let consumer_body = [setup, k.consume(&mut r, &c)].concat();
    body.push(Stmt::If(
        bin(Bin::Lt, special64(Special::Tid), i64(128)),
        producer,
        consumer_body,
    ));

    Kernel {
        name: "attention_forward_wgmma".into(),
        params: params(),
        regs: r.list,
        shared_bytes: k.lay.bytes(),
        threads: THREADS,
        ctas_per_sm: 1,
        body,
    }
}

/// The kernel being built: the plan, its shared layout, and the registers every thread of the
/// CTA has (its batch, head and KV head, and the walk over running tiles: the tile, its code,
/// how many ran before it, its stage). Each phase of [`lower`] is a method.
struct Cta<'a> {
    plan: &'a KernelPlan,
    lay: Layout,
    /// Head dims of Q and K, and of V.
    d: usize,
    dv: usize,
    /// Query and KV heads.
    hq: i64,
    hkv: i64,
    /// Keys per tile.
    bc: usize,
    batch: Reg,
    head: Reg,
    kvh: Reg,
    tile: Reg,
    code: Reg,
    count: Reg,
    stage: Reg,
}

/// A consumer thread: its warpgroup (`consumer`, 0 or 1), its thread-in-group `q`, its first
/// row (`row_base`: row `g` of its warp's 16), the running max and sum of its rows `g` and
/// `g + 8`, and its O and S accumulators.
struct Consumer {
    consumer: Reg,
    q: Reg,
    row_base: Reg,
    m: Vec<[Reg; 2]>,
    l: Vec<[Reg; 2]>,
    o: Vec<Vec<[Reg; 4]>>,
    s: Vec<Vec<[Reg; 4]>>,
}

impl Consumer {
    /// Row `h` (0 or 1: `g` or `g + 8`) of the thread.
    fn row_of(&self, h: usize) -> Expr {
        add(reg(self.row_base), i64(8 * h as i64))
    }

    fn o_regs(&self) -> Vec<Reg> {
        self.o[0].iter().flatten().copied().collect()
    }

    fn s_regs(&self) -> Vec<Reg> {
        self.s[0].iter().flatten().copied().collect()
    }
}

impl<'a> Cta<'a> {
    /// The kernel's sizes and the CTA's registers, with the statements that set where it is.
    fn locate(plan: &'a KernelPlan, r: &mut Regs) -> (Cta<'a>, Vec<Stmt>) {
        let (hq, hkv) = (plan.shape.heads as i64, plan.shape.kv_heads as i64);
        let k = Cta {
            plan,
            lay: Layout::new(plan),
            d: plan.shape.qk_dim as usize,
            dv: plan.shape.v_dim as usize,
            hq,
            hkv,
            bc: key_tile(plan) as usize,
            batch: r.add("batch", Ty::I64),
            head: r.add("head", Ty::I64),
            kvh: r.add("kv_head", Ty::I64),
            tile: r.add("tile", Ty::I64),
            code: r.add("code", Ty::I32),
            count: r.add("running", Ty::I64),
            stage: r.add("stage", Ty::I64),
        };
        let body = vec![
            Stmt::Set(k.batch, special64(Special::Ctaid(2))),
            Stmt::Set(k.head, special64(Special::Ctaid(1))),
            Stmt::Set(k.kvh, bin(Bin::Div, reg(k.head), i64(hq / hkv))),
        ];
        (k, body)
    }

    fn rope(&self) -> bool {
        self.plan.rope.is_some()
    }

    /// The CTA's first query row.
    fn first_row(&self) -> Expr {
        mul(special64(Special::Ctaid(0)), i64(i64::from(ROWS)))
    }

    /// A walk over the running tiles: `code` and `stage` set, `count` their number so far.
    fn running_tiles(&self, inner: Vec<Stmt>) -> Vec<Stmt> {
        let bc64 = self.bc as i64;
        let n_tiles = bin(Bin::Div, add(param("skv"), i64(bc64 - 1)), i64(bc64));
        let code_of = tile_code(self.head, [i64::from(ROWS), bc64], reg(self.tile));
        let (count, stage) = (self.count, self.stage);
        vec![
            Stmt::Set(count, i64(0)),
            Stmt::For {
                reg: self.tile,
                start: i64(0),
                end: n_tiles,
                step: 1,
                body: vec![
                    Stmt::Set(self.code, code_of),
                    Stmt::If(
                        bin(Bin::Ne, reg(self.code), i32c(TileCode::Skip as i64)),
                        [
                            vec![Stmt::Set(stage, bin(Bin::Rem, reg(count), i64(STAGES)))],
                            inner,
                            vec![Stmt::Set(count, add(reg(count), i64(1)))],
                        ]
                        .concat(),
                        vec![],
                    ),
                ],
            },
        ]
    }

    /// The phase parity of the running tile's use of its stage.
    fn use_parity(&self) -> Expr {
        let uses = bin(Bin::Div, reg(self.count), i64(STAGES));
        cast(bin(Bin::Rem, uses, i64(2)), Ty::I32)
    }

    /// The phase parity of the release of the stage's previous use (a fresh barrier's phase of
    /// parity 1 counts as complete).
    fn release_parity(&self) -> Expr {
        cast(
            bin(
                Bin::Rem,
                add(bin(Bin::Div, reg(self.count), i64(STAGES)), i64(1)),
                i64(2),
            ),
            Ty::I32,
        )
    }

    /// A consumer's registers, and its setup: its rows are g and g + 8 of its warp's 16 of its
    /// warpgroup's 64; the running state starts empty; it waits for Q (under RoPE, rotated).
    fn consumer(&self, r: &mut Regs) -> (Consumer, Vec<Stmt>) {
        let tid = special64(Special::Tid);
        let lane = cast(Expr::Special(Special::Lane), Ty::I64);
        let (consumer, warp, g, q) = (
            r.add("consumer", Ty::I64),
            r.add("warp", Ty::I64),
            r.add("g", Ty::I64),
            r.add("q", Ty::I64),
        );
        let row_base = r.add("row_base", Ty::I64);
        let (_, consumer_regs) = budgets(self.plan);
        let mut setup = vec![
            Stmt::SetMaxNReg {
                inc: true,
                regs: consumer_regs,
            },
            Stmt::Set(consumer, sub(bin(Bin::Div, tid.clone(), i64(128)), i64(1))),
            Stmt::Set(warp, bin(Bin::Rem, bin(Bin::Div, tid, i64(32)), i64(4))),
            Stmt::Set(g, bin(Bin::Div, lane.clone(), i64(4))),
            Stmt::Set(q, bin(Bin::Rem, lane, i64(4))),
            Stmt::Set(
                row_base,
                add(
                    add(self.first_row(), mul(reg(consumer), i64(64))),
                    add(mul(reg(warp), i64(16)), reg(g)),
                ),
            ),
        ];
        let m = vec![[0, 1].map(|h| r.add(format!("m{h}"), Ty::F32))];
        let l = vec![[0, 1].map(|h| r.add(format!("l{h}"), Ty::F32))];
        for h in 0..2 {
            setup.push(Stmt::Set(m[0][h], f32(f32::NEG_INFINITY)));
            setup.push(Stmt::Set(l[0][h], f32(0.0)));
        }
        let accumulator = |name: &str, cols: usize, r: &mut Regs| -> Vec<[Reg; 4]> {
            (0..cols / 8)
                .map(|j| [0, 1, 2, 3].map(|i| r.add(format!("{name}{j}_{i}"), Ty::F32)))
                .collect()
        };
        let o = vec![accumulator("o", self.dv, r)];
        let s = vec![accumulator("s", self.bc, r)];
        for x in o.iter().flatten().flatten() {
            setup.push(Stmt::Set(*x, f32(0.0)));
        }
        let lay = &self.lay;
        setup.push(Stmt::MbarWait {
            bar: if self.rope() {
                lay.q_ready()
            } else {
                lay.q_full()
            },
            parity: i32c(0),
        });
        let c = Consumer {
            consumer,
            q,
            row_base,
            m,
            l,
            o,
            s,
        };
        (c, setup)
    }

    /// S = Q K^T of the running tile, issued asynchronously: per 16 columns of d, Q's and K's
    /// descriptors advance 32 bytes inside a 64-column block, a block at a time past it.
    fn q_times_k(&self, c: &Consumer) -> Stmt {
        let (lay, bc) = (&self.lay, self.bc);
        let q_at = add(i64(0), mul(reg(c.consumer), i64(lay.q_per_consumer)));
        let steps = (0..self.d / 16)
            .map(|ks| {
                let inside = (32 * (ks % 4)) as i64;
                let q_desc = descriptor(
                    add(q_at.clone(), i64((ks / 4 * 64 * 128) as i64 + inside)),
                    0,
                );
                let k_desc = descriptor(
                    add(
                        lay.stage(reg(self.stage)),
                        i64((ks / 4 * bc * 128) as i64 + inside),
                    ),
                    0,
                );
                (WgmmaA::Shared(q_desc), k_desc)
            })
            .collect();
        Stmt::Wgmma(Box::new(Wgmma {
            half: qk_half(self.plan),
            n: bc as u32,
            d: c.s_regs(),
            accumulate: Expr::Pred(false),
            steps,
            b_n_major: false,
        }))
    }

    /// O += P V of the previous running tile (its stage in `prev`), once its V has landed: V
    /// N-major, 16 keys (2048 bytes) a step, 64-column blocks a key tile apart.
    fn previous_p_times_v(&self, c: &Consumer, prev: Reg, pa: &[[Reg; 4]]) -> Vec<Stmt> {
        let lay = &self.lay;
        let v_at = add(lay.stage(reg(prev)), i64(lay.k_bytes));
        let steps = pa
            .iter()
            .enumerate()
            .map(|(ks, frag)| {
                let at = add(v_at.clone(), i64(ks as i64 * 16 * 128));
                (WgmmaA::Regs(*frag), descriptor(at, self.bc as i64 * 128))
            })
            .collect();
        let previous = sub(reg(self.count), i64(1));
        vec![
            Stmt::Set(prev, bin(Bin::Rem, previous.clone(), i64(STAGES))),
            Stmt::MbarWait {
                bar: lay.bar(1, reg(prev)),
                parity: cast(
                    bin(Bin::Rem, bin(Bin::Div, previous, i64(STAGES)), i64(2)),
                    Ty::I32,
                ),
            },
            Stmt::Wgmma(Box::new(Wgmma {
                half: half_of(self.plan),
                n: self.dv as u32,
                d: c.o_regs(),
                accumulate: Expr::Pred(true),
                steps,
                b_n_major: true,
            })),
        ]
    }

    /// Lane 0 of each consumer warp releases barrier `which` of `stage`.
    fn release(&self, which: i64, stage: Reg) -> Stmt {
        let lane = cast(Expr::Special(Special::Lane), Ty::I64);
        Stmt::If(
            bin(Bin::Eq, lane, i64(0)),
            vec![Stmt::MbarArrive {
                bar: self.lay.bar(which, reg(stage)),
                tx: None,
            }],
            vec![],
        )
    }

    /// Every running tile and the epilogue, for a consumer. Pipelined as FlashAttention-3 does
    /// within a warpgroup: the previous tile's `P V` is issued after this tile's `Q K^T`, so
    /// waiting for all but one group completes S, and the softmax of this tile overlaps the
    /// previous tile's product until its rescale of O. Ping-pong between the two consumers: a
    /// consumer issues its products only in its turn (named barrier 1 + its index), then
    /// hands the turn to the other (2 - its index), so one's softmax runs while the other's
    /// products do.
    fn consume(&self, r: &mut Regs, c: &Consumer) -> Vec<Stmt> {
        let plan = self.plan;
        let prev = r.add("prev_stage", Ty::I64);
        let pa: Vec<[Reg; 4]> = (0..self.bc / 16)
            .map(|ks| [0, 1, 2, 3].map(|i| r.add(format!("pa{ks}_{i}"), Ty::I32)))
            .collect();
        let turn = |of_other: bool, wait: bool| Stmt::NamedBarrier {
            id: cast(
                if of_other {
                    sub(i64(2), reg(c.consumer))
                } else {
                    add(i64(1), reg(c.consumer))
                },
                Ty::I32,
            ),
            threads: 256,
            wait,
        };
        let has_prev = bin(Bin::Gt, reg(self.count), i64(0));
        let s_regs = c.s_regs();
        let mut consume = vec![
            Stmt::MbarWait {
                bar: self
                    .lay
                    .bar(if self.rope() { 4 } else { 0 }, reg(self.stage)),
                parity: self.use_parity(),
            },
            turn(false, true),
            self.q_times_k(c),
            Stmt::If(
                has_prev.clone(),
                self.previous_p_times_v(c, prev, &pa),
                vec![],
            ),
            turn(true, false),
            Stmt::If(
                has_prev.clone(),
                vec![Stmt::WgmmaWait {
                    groups: 1,
                    regs: s_regs.clone(),
                }],
                vec![Stmt::WgmmaWait {
                    groups: 0,
                    regs: s_regs,
                }],
            ),
            self.release(2, self.stage),
        ];
        let row_of = |_rb: usize, h: usize| c.row_of(h);
        let pos_of = |_rb: usize, h: usize| {
            add(
                add(param("p0"), sub(param("skv"), param("sq"))),
                c.row_of(h),
            )
        };
        let scores = TileScores {
            s: &c.s,
            tile: self.tile,
            key_tile: self.bc as i64,
            q: c.q,
            batch: self.batch,
            head: self.head,
            row_of: &row_of,
            pos_of: &pos_of,
        };
        consume.push(score_tile(plan, &scores, self.code));
        // The previous product finishes (and its V stage is released) before O is rescaled.
        let o_done = Stmt::WgmmaWait {
            groups: 0,
            regs: c.o_regs(),
        };
        let release_prev_v = self.release(3, prev);
        let finish_prev = vec![
            o_done.clone(),
            Stmt::If(has_prev.clone(), vec![release_prev_v.clone()], vec![]),
        ];
        let (m, l, o) = (&c.m, &c.l, &c.o);
        consume.extend(online_softmax(plan, r, &c.s, [m, l], o, finish_prev));
        consume.extend(pack_p(plan, &c.s[0], &pa));
        // After the last running tile (`count` of them), its product.
        let last_pv = Stmt::If(
            has_prev,
            [
                self.previous_p_times_v(c, prev, &pa),
                vec![o_done, release_prev_v],
            ]
            .concat(),
            vec![],
        );
        // Consumer 0 takes the first turn; after the last tile it takes the turn consumer 1
        // hands back, so each barrier's arrivals and waits balance.
        let is_consumer = |i: i64| bin(Bin::Eq, reg(c.consumer), i64(i));
        [
            vec![Stmt::If(is_consumer(1), vec![turn(true, false)], vec![])],
            self.running_tiles(consume),
            vec![
                Stmt::If(is_consumer(0), vec![turn(false, true)], vec![]),
                last_pv,
            ],
            epilogue(plan, o, [m, l], c.q, [self.batch, self.head], &row_of),
        ]
        .concat()
    }
}

/// P's C fragments of key blocks 2 ks and 2 ks + 1 packed into the A fragment `pa[ks]` of step
/// ks.
fn pack_p(plan: &KernelPlan, s: &[[Reg; 4]], pa: &[[Reg; 4]]) -> Vec<Stmt> {
    let half = half_of(plan);
    let mut packed = Vec::new();
    for (ks, frag) in pa.iter().enumerate() {
        let (s0, s1) = (s[2 * ks], s[2 * ks + 1]);
        for (dst, (lo, hi)) in frag.iter().zip([
            (s0[0], s0[1]),
            (s0[2], s0[3]),
            (s1[0], s1[1]),
            (s1[2], s1[3]),
        ]) {
            packed.push(Stmt::Set(
                *dst,
                Expr::PackHalf(half, Box::new(reg(lo)), Box::new(reg(hi))),
            ));
        }
    }
    packed
}

/// `body` on thread 0 alone.
fn thread0(body: Vec<Stmt>) -> Stmt {
    Stmt::If(bin(Bin::Eq, special64(Special::Tid), i64(0)), body, vec![])
}

/// The position of the tensor map `name` among the kernel's parameters.
fn map_param(name: &str) -> u32 {
    let i = params()
        .iter()
        .position(|(n, _)| n == name)
        .expect("a parameter");
    i as u32
}
