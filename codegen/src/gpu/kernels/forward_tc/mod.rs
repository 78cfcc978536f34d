//! A forward plan lowered to GPU IR on tensor cores (bf16 and f16 specs): FlashAttention-2's
//! dataflow.
//!
//! A CTA of four warps handles [`rows`] query rows of one (batch, head): each warp one or two
//! blocks of 16 rows ([`row_blocks`]), each lane the rows `g` and `g + 8` of a block
//! (`g = lane / 4`) as `mma.sync` fragments. Inputs are 16-bit (the spec's bf16 or f16) in
//! global memory. Q is staged once in shared memory, rotated by RoPE (a column pair is one
//! 32-bit load where RoPE leaves it as it is); the scale applies to S in f32, or inside the
//! exponent when the score program is the scaled score alone. Per key tile, K and V tiles
//! arrive in shared memory by `cp.async` (one buffer each: V's copies fly while S is computed,
//! the next tile's K copies while P V is; with RoPE, K arrives unrotated with its cos and sin
//! rows and is rotated in shared memory),
//! and reach the fragments through `ldmatrix` (transposed for V), each K and V fragment serving
//! every row block of the warp. `S = Q K^T` accumulates in f32 C fragments; the score program
//! and mask apply per element (the mask only on tiles of code 2); the row max and sum reduce
//! over the lane quad with shuffles; `P = 2^(S - m)` is repacked from C fragments straight into
//! A fragments (their layouts line up), and `O += P V` accumulates in registers. Tile codes skip
//! or unmask tiles. Shared rows are padded by 16 bytes so the eight rows an `ldmatrix` reads
//! fall in different banks. The K and V staging (copies, prefetch, rotation in shared memory)
//! is in `kv.rs`.

mod kv;

use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Half, Kernel, Reg, Special, Stmt, Ty};
use crate::gpu::kernels::{
    Regs, Side, Staging, TileScores, epilogue, half_of, online_softmax, param, scale_folds,
    score_tile, special64, stage_rows, tile_code,
};
use crate::gpu::launch::{ForwardArgs, LaunchRecord};
use crate::plan::{KernelPlan, PlanKind, TileCode};
use attn_dsl::DType;

/// Threads per CTA: four warps.
pub const THREADS: u32 = 128;

/// How the kernel divides its work: blocks of 16 query rows per warp, and the CTAs an SM is to
/// hold (the launch bound ptxas fits each thread's registers to).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tiling {
    /// Blocks of 16 query rows per warp: 1 or 2.
    pub row_blocks: u32,
    /// CTAs of four warps per SM.
    pub ctas_per_sm: u32,
}

impl Tiling {
    /// Twelve warps per SM: one row block per warp and three CTAs per SM, so at most 168
    /// registers a thread (ptxas 12.9: none spilled at head dim 64, 12 to 24 bytes at 128),
    /// against the default's eight warps of up to 255. Here to be timed against it on a device.
    pub const TWELVE_WARPS: Tiling = Tiling {
        row_blocks: 1,
        ctas_per_sm: 3,
    };

    /// The default: [`row_blocks`] per warp, two CTAs (eight warps) per SM.
    pub fn of(plan: &KernelPlan) -> Tiling {
        Tiling {
            row_blocks: row_blocks(plan),
            ctas_per_sm: 2,
        }
    }

    /// Keys per tile. With two row blocks per warp: 64 while `qk_dim + v_dim` is at most 128,
    /// else 32 (S then takes 32 registers beside O's 128 at D 128; 64 keys spill). With one: 64
    /// up to 256, else 16.
    pub fn key_tile(self, plan: &KernelPlan) -> u32 {
        let dims = plan.shape.qk_dim + plan.shape.v_dim;
        match self.row_blocks {
            2 if dims <= 128 => 64,
            2 => 32,
            _ if dims <= 256 => 64,
            _ => 16,
        }
    }

    /// Query rows per CTA: four warps of `row_blocks` x 16.
    pub fn rows(self) -> u32 {
        THREADS / 32 * 16 * self.row_blocks
    }
}

/// Keys per tile of the default tiling ([`Tiling::key_tile`]).
pub fn key_tile(plan: &KernelPlan) -> u32 {
    Tiling::of(plan).key_tile(plan)
}

/// Blocks of 16 query rows per warp: two up to head dim 128 when the score program is the
/// scaled score alone (each K and V fragment a warp loads from shared memory then serves 32
/// rows, which halves that traffic per FLOP; the O accumulators take 128 registers at D 128),
/// else one (a score program's own terms, ALiBi's or a softcap's, need the registers).
pub fn row_blocks(plan: &KernelPlan) -> u32 {
    if plan.shape.qk_dim.max(plan.shape.v_dim) <= 128 && scale_folds(plan) {
        2
    } else {
        1
    }
}

/// Query rows per CTA of the default tiling: four warps of [`row_blocks`] x 16.
pub fn rows(plan: &KernelPlan) -> u32 {
    Tiling::of(plan).rows()
}

/// Whether the plan can run on this kernel: bf16 or f16 storage, `qk_dim` a multiple of 16 and `v_dim`
/// of 8 (the mma tile), per-head KV.
pub fn supports(plan: &KernelPlan) -> bool {
    plan.kind == PlanKind::Forward
        && matches!(plan.dtype, DType::Bf16 | DType::F16)
        && plan.mla.is_none()
        // Stick-breaking's weights are taken by the SIMT kernels only.
        && !plan.stick_breaking()
        // Parameters are read by the SIMT kernels only.
        && plan.params.is_empty()
        && plan.shape.qk_dim.is_multiple_of(16)
        && plan.shape.v_dim.is_multiple_of(8)
}

fn pack(plan: &KernelPlan, lo: Expr, hi: Expr) -> Expr {
    Expr::PackHalf(half_of(plan), Box::new(lo), Box::new(hi))
}

/// The 16-bit format of the `Q K^T` operands. bf16 storage under RoPE over every column gives
/// f16: rotated q and k are rounded to 16 bits for the tensor cores either way, and f16 keeps 3
/// more bits of them (the log-sum-exp then stays within 1e-3 of float64 where bf16 misses it),
/// at the same speed. Every column is rotated, so every operand is written by the rotation. Its
/// range is smaller: [`QK_F16_LIMIT`] bounds the inputs such a kernel takes.
pub fn qk_half(plan: &KernelPlan) -> Half {
    match &plan.rope {
        Some(r)
            if plan.dtype == DType::Bf16 && r.first_dim == 0 && r.rope.dim == plan.shape.qk_dim =>
        {
            Half::F16
        }
        _ => half_of(plan),
    }
}

/// Largest magnitude of a q or k input a kernel with f16 `Q K^T` operands takes: rotated by
/// RoPE (at most sqrt 2 times larger, times a YaRN attention factor the runtime also divides
/// by), it stays inside f16's range (65504).
pub const QK_F16_LIMIT: f32 = 32768.0;

/// Lowers the tensor-core forward kernel. The plan must be [`supports`]ed.
pub fn lower(plan: &KernelPlan) -> Kernel {
    lower_with(plan, qk_half(plan))
}

/// [`lower`] with the `Q K^T` operands in `qk` instead of [`qk_half`]'s choice: bf16 for a
/// bf16 plan whose RoPE rotates every column keeps no headroom check on the device (bf16 has
/// f32's range), at bf16's precision, as bf16 SDPA computes.
pub fn lower_with(plan: &KernelPlan, qk: Half) -> Kernel {
    lower_tiled(plan, qk, Tiling::of(plan))
}

/// [`lower_with`] on a given tiling (the default is [`Tiling::of`] the plan).
pub fn lower_tiled(plan: &KernelPlan, qk: Half, tiling: Tiling) -> Kernel {
    assert!(
        supports(plan),
        "the tensor-core kernel runs bf16 and f16 per-head forward plans"
    );
    assert!(
        matches!(tiling.row_blocks, 1 | 2) && tiling.ctas_per_sm > 0,
        "one or two row blocks per warp, at least one CTA per SM"
    );
    let mut r = Regs { list: Vec::new() };
    let (f, mut body) = Forward::locate(plan, qk, tiling, &mut r);
    body.extend(f.stage_q(&mut r));
    let (state, init) = f.running_state(&mut r);
    body.extend(init);
    let tiles = TileLoop {
        tile: r.add("tile", Ty::I64),
        code: r.add("code", Ty::I32),
        next_code: r.add("next_code", Ty::I32),
        k_issued: r.add("k_issued", Ty::Pred),
    };
    let copy = [r.add("copy_src", Ty::I64), r.add("copy_dst", Ty::I64)];

    // Per running tile (FlashAttention-2's pipeline, one buffer each): K arrives (issued while
    // the previous tile's P V ran, unless that tile did not know this one runs); a barrier
    // (K visible; every warp is done with the previous V); V's copies fly while S = Q K^T
    // and the softmax run; a barrier (V visible; every warp is done with K); the next tile's
    // K copies fly while O += P V runs. With RoPE, K arrives unrotated with its cos and sin
    // rows and is rotated in shared memory (one more barrier), or, where the tables' rows are
    // not whole 16-byte chunks, rotated as it is staged.
    body.push(Stmt::Set(tiles.k_issued, Expr::Pred(false)));
    let mut run = f.load_kv(&mut r, &tiles, copy);
    let (bases, init) = f.fragment_bases(&mut r);
    body.extend(init);
    let (s, scores) = f.scores(&mut r, &bases);
    run.extend(scores);
    let row_of = |rb: usize, h: usize| f.row_of(rb, h);
    let pos_of = |rb: usize, h: usize| f.pos_of(rb, h);
    let tile_scores = TileScores {
        s: &s,
        tile: tiles.tile,
        key_tile: f.bc as i64,
        q: f.lane.q,
        batch: f.lane.batch,
        head: f.lane.head,
        row_of: &row_of,
        pos_of: &pos_of,
    };
    run.push(score_tile(plan, &tile_scores, tiles.code));
    let (m, l, o) = (&state.m, &state.l, &state.o);
    run.extend(online_softmax(plan, &mut r, &s, [m, l], o, Vec::new()));
    run.extend(f.prefetch_next_k(&tiles, copy));
    run.extend(f.p_times_v(&mut r, &s, o, &bases));
    body.push(f.tile_loop(&tiles, run));
    let at = [f.lane.batch, f.lane.head];
    body.extend(epilogue(plan, o, [m, l], f.lane.q, at, &row_of));

    Kernel {
        name: "attention_forward_tc".into(),
        params: ForwardArgs::params(),
        regs: r.list,
        shared_bytes: f.sh.bytes as u32,
        threads: THREADS,
        // Two CTAs per SM by default: up to 255 registers a thread.
        ctas_per_sm: tiling.ctas_per_sm,
        body,
    }
}

/// The kernel being built: the plan and its tiling, where this lane is, and the shared
/// memory layout; each phase of [`lower_tiled`] is a method.
struct Forward<'a> {
    plan: &'a KernelPlan,
    /// The format of the `Q K^T` operands.
    qk: Half,
    /// Head dims of Q and K, and of V.
    d: usize,
    dv: usize,
    /// Query and KV heads.
    hq: i64,
    hkv: i64,
    /// Keys per tile.
    bc: usize,
    /// Blocks of 16 rows per warp.
    blocks: usize,
    /// Query rows per CTA.
    cta_rows: i64,
    lane: Lane,
    sh: Shared,
}

/// Where this lane is: its group `g` (lane / 4) and thread-in-group `q`, its batch, head, KV
/// head and warp, and `row_base`, its first row.
struct Lane {
    g: Reg,
    q: Reg,
    batch: Reg,
    head: Reg,
    kvh: Reg,
    warp: Reg,
    row_base: Reg,
}

/// Shared memory: the CTA's Q rows, one K tile `[bc][d]` and one V tile `[bc][dv]`, all 16-bit
/// with rows padded by 16 bytes so the eight rows an `ldmatrix` reads fall in different banks;
/// with RoPE rotating K in shared memory, the tile's cos and sin rows (`[bc][rope_dim / 2]`
/// f32 each) beside them. Offsets and strides in bytes.
struct Shared {
    q: usize,
    k: usize,
    v: usize,
    cos: usize,
    sin: usize,
    q_stride: usize,
    k_stride: usize,
    v_stride: usize,
    /// `rope_dim / 2` when K is rotated in shared memory.
    rope_half: Option<usize>,
    bytes: usize,
}

/// The registers of the loop over key tiles: the tile, its code, the next tile's code, and
/// whether the next tile's K copies were issued.
struct TileLoop {
    tile: Reg,
    code: Reg,
    next_code: Reg,
    k_issued: Reg,
}

/// The running state of the lane's rows: max and (per-lane partial) sum `[rb][h]`, and the O
/// accumulators `o[rb][vb][i]`.
struct RunningState {
    m: Vec<[Reg; 2]>,
    l: Vec<[Reg; 2]>,
    o: Vec<Vec<[Reg; 4]>>,
}

/// The per-lane `ldmatrix` base addresses of Q, K and V, and the B fragment registers.
struct FragmentBases {
    q: Reg,
    k: Reg,
    v: Reg,
    bm: [Reg; 4],
}

impl<'a> Forward<'a> {
    /// The kernel's sizes and layout, and where this lane is (with the statements that say so).
    fn locate(
        plan: &'a KernelPlan,
        qk: Half,
        tiling: Tiling,
        r: &mut Regs,
    ) -> (Forward<'a>, Vec<Stmt>) {
        let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
        let (hq, hkv) = (plan.shape.heads as i64, plan.shape.kv_heads as i64);
        let bc = tiling.key_tile(plan) as usize;
        let blocks = tiling.row_blocks as usize;
        let cta_rows = i64::from(tiling.rows());
        let tid = special64(Special::Tid);
        let lane_id = cast(Expr::Special(Special::Lane), Ty::I64);
        let lane = Lane {
            g: r.add("g", Ty::I64),
            q: r.add("q", Ty::I64),
            batch: r.add("batch", Ty::I64),
            head: r.add("head", Ty::I64),
            kvh: r.add("kv_head", Ty::I64),
            warp: r.add("warp", Ty::I64),
            row_base: r.add("row_base", Ty::I64),
        };
        let mut body = vec![
            Stmt::Set(lane.g, bin(Bin::Div, lane_id.clone(), i64(4))),
            Stmt::Set(lane.q, bin(Bin::Rem, lane_id, i64(4))),
            Stmt::Set(lane.batch, special64(Special::Ctaid(2))),
            Stmt::Set(lane.head, special64(Special::Ctaid(1))),
            Stmt::Set(lane.kvh, bin(Bin::Div, reg(lane.head), i64(hq / hkv))),
            Stmt::Set(lane.warp, bin(Bin::Div, tid, i64(32))),
        ];
        // The lane's rows: g and g + 8 (h = 0, 1) of each of the warp's row blocks, all at
        // constant offsets from one register. Rows past Sq are computed (from clamped Q rows)
        // but not stored; the score program sees their unclamped index, which it may not read
        // memory by (its tables clamp).
        body.push(Stmt::Set(
            lane.row_base,
            add(
                first_row(cta_rows),
                add(mul(reg(lane.warp), i64(16 * blocks as i64)), reg(lane.g)),
            ),
        ));
        let (q_stride, k_stride, v_stride) = (2 * d + 16, 2 * d + 16, 2 * dv + 16);
        let rope_half = (plan.rope.as_ref())
            .filter(|_| rotates_k_in_shared(plan))
            .map(|r| (r.rope.dim / 2) as usize);
        let q_sh = 0;
        let k_sh = q_sh + cta_rows as usize * q_stride;
        let v_sh = k_sh + bc * k_stride;
        let cos_sh = v_sh + bc * v_stride;
        let sin_sh = cos_sh + bc * 4 * rope_half.unwrap_or(0);
        let sh = Shared {
            q: q_sh,
            k: k_sh,
            v: v_sh,
            cos: cos_sh,
            sin: sin_sh,
            q_stride,
            k_stride,
            v_stride,
            rope_half,
            bytes: sin_sh + bc * 4 * rope_half.unwrap_or(0),
        };
        let f = Forward {
            plan,
            qk,
            d,
            dv,
            hq,
            hkv,
            bc,
            blocks,
            cta_rows,
            lane,
            sh,
        };
        (f, body)
    }

    /// Row `h` (0 or 1: `g` or `g + 8`) of the lane's row block `rb`.
    fn row_of(&self, rb: usize, h: usize) -> Expr {
        add(reg(self.lane.row_base), i64((16 * rb + 8 * h) as i64))
    }

    /// The position of [`Forward::row_of`]: queries end where the keys do.
    fn pos_of(&self, rb: usize, h: usize) -> Expr {
        add(
            add(param("p0"), sub(param("skv"), param("sq"))),
            self.row_of(rb, h),
        )
    }

    /// Row 0 of (batch, KV head) in K and V.
    fn kv_base(&self) -> Expr {
        let (batch, kvh) = (self.lane.batch, self.lane.kvh);
        mul(add(mul(reg(batch), i64(self.hkv)), reg(kvh)), param("skv"))
    }

    /// Key tiles in Skv.
    fn n_tiles(&self) -> Expr {
        let bc = self.bc as i64;
        bin(Bin::Div, add(param("skv"), i64(bc - 1)), i64(bc))
    }

    /// The launch's code for key tile `tile`.
    fn code_of(&self, tile: Expr) -> Expr {
        tile_code(self.lane.head, [self.cta_rows, self.bc as i64], tile)
    }

    /// Q, rotated by RoPE, staged once: row `local` of the CTA from query row
    /// `first_row + local` (clamped into Sq).
    fn stage_q(&self, r: &mut Regs) -> Vec<Stmt> {
        let (hq, d) = (self.hq, self.d);
        let (batch, head) = (self.lane.batch, self.lane.head);
        let cta_rows = self.cta_rows;
        let q_row_of = |local: Expr| {
            bin(
                Bin::Min,
                add(first_row(cta_rows), local),
                sub(param("sq"), i64(1)),
            )
        };
        stage_rows(
            self.plan,
            r,
            "q_stage",
            Staging {
                count: cta_rows,
                width: d,
                dst: i64(self.sh.q as i64),
                qk: self.qk,
                stride: self.sh.q_stride,
                rotation: Some(Side::Query),
                param,
                threads: THREADS,
            },
            |local| {
                let row = q_row_of(local);
                let addr = add(
                    param("q"),
                    mul(
                        add(
                            mul(add(mul(reg(batch), i64(hq)), reg(head)), param("sq")),
                            row.clone(),
                        ),
                        i64(2 * d as i64),
                    ),
                );
                let pos = add(add(param("p0"), sub(param("skv"), param("sq"))), row);
                (addr, pos, None)
            },
        )
    }

    /// The running state's registers, and the statements that start it (max -inf, sums and
    /// accumulators 0).
    fn running_state(&self, r: &mut Regs) -> (RunningState, Vec<Stmt>) {
        let blocks = self.blocks;
        let state = |name: &str, r: &mut Regs| -> Vec<[Reg; 2]> {
            (0..blocks)
                .map(|rb| [0, 1].map(|h| r.add(format!("{name}{rb}_{h}"), Ty::F32)))
                .collect()
        };
        let (m, l) = (state("m", r), state("l", r));
        let o = self.frags(r, "o", self.dv / 8, Ty::F32);
        let mut init = Vec::new();
        for rb in 0..blocks {
            for h in 0..2 {
                init.push(Stmt::Set(m[rb][h], f32(f32::NEG_INFINITY)));
                init.push(Stmt::Set(l[rb][h], f32(0.0)));
            }
        }
        for x in o.iter().flatten().flatten() {
            init.push(Stmt::Set(*x, f32(0.0)));
        }
        (RunningState { m, l, o }, init)
    }

    /// `count` fragments of four registers per row block: `name{rb}_{j}_{i}`.
    fn frags(&self, r: &mut Regs, name: &str, count: usize, ty: Ty) -> Vec<Vec<[Reg; 4]>> {
        (0..self.blocks)
            .map(|rb| {
                (0..count)
                    .map(|j| [0, 1, 2, 3].map(|i| r.add(format!("{name}{rb}_{j}_{i}"), ty)))
                    .collect()
            })
            .collect()
    }

    /// `ldmatrix` addresses: lane l addresses row l % 8 of matrix l / 8; a per-lane base plus
    /// constants. Q (A fragments): matrix i is rows 8 (i % 2).., columns 8 (i / 2).. of a
    /// 16 x 16 block, so registers 0..4 are the A fragment. K (B fragments of S = Q K^T):
    /// matrix i is keys 8 (nb + i / 2).., columns 16 ks + 8 (i % 2).., untransposed, so
    /// registers (0, 1) are the fragment of key block nb and (2, 3) of nb + 1. V (B fragments
    /// of O += P V): matrix i is keys 16 ks + 8 (i % 2).., columns 8 vb + 8 (i / 2)..,
    /// transposed, so registers (0, 1) are the fragment of column block vb and (2, 3) of
    /// vb + 1.
    fn fragment_bases(&self, r: &mut Regs) -> (FragmentBases, Vec<Stmt>) {
        let sh = &self.sh;
        let lane = cast(Expr::Special(Special::Lane), Ty::I64);
        let (q_base, k_base, v_base) = (
            r.add("q_base", Ty::I64),
            r.add("k_base", Ty::I64),
            r.add("v_base", Ty::I64),
        );
        let (lane_row, lane_matrix) = (
            bin(Bin::Rem, lane.clone(), i64(8)),
            bin(Bin::Div, lane.clone(), i64(8)),
        );
        let low_high = add(
            lane_row.clone(),
            mul(bin(Bin::Rem, lane_matrix.clone(), i64(2)), i64(8)),
        );
        let warp_rows = mul(reg(self.lane.warp), i64(16 * self.blocks as i64));
        let init = vec![
            Stmt::Set(
                q_base,
                add(
                    add(
                        mul(add(warp_rows, low_high.clone()), i64(sh.q_stride as i64)),
                        mul(bin(Bin::Div, lane.clone(), i64(16)), i64(16)),
                    ),
                    i64(sh.q as i64),
                ),
            ),
            Stmt::Set(
                k_base,
                add(
                    add(
                        mul(
                            add(lane_row, mul(bin(Bin::Div, lane.clone(), i64(16)), i64(8))),
                            i64(sh.k_stride as i64),
                        ),
                        mul(bin(Bin::Rem, lane_matrix, i64(2)), i64(16)),
                    ),
                    i64(sh.k as i64),
                ),
            ),
            Stmt::Set(
                v_base,
                add(
                    add(
                        mul(low_high, i64(sh.v_stride as i64)),
                        mul(bin(Bin::Div, lane, i64(16)), i64(16)),
                    ),
                    i64(sh.v as i64),
                ),
            ),
        ];
        let bm = [0, 1, 2, 3].map(|i| r.add(format!("bm{i}"), Ty::I32));
        let bases = FragmentBases {
            q: q_base,
            k: k_base,
            v: v_base,
            bm,
        };
        (bases, init)
    }

    /// S = Q K^T: `s[rb][nb][i]` for keys `nb*8 + 2q + (i % 2)`, rows `g + 8 (i / 2)` of block
    /// `rb`. Per k-step, the warp's Q fragments load once and each K fragment serves every row
    /// block.
    fn scores(&self, r: &mut Regs, at: &FragmentBases) -> (Vec<Vec<[Reg; 4]>>, Vec<Stmt>) {
        let (bc, blocks) = (self.bc, self.blocks);
        let (q_stride, k_stride) = (self.sh.q_stride, self.sh.k_stride);
        let s = self.frags(r, "s", bc / 8, Ty::F32);
        let qa: Vec<[Reg; 4]> = (0..blocks)
            .map(|rb| [0, 1, 2, 3].map(|i| r.add(format!("qa{rb}_{i}"), Ty::I32)))
            .collect();
        let mut run = Vec::new();
        for x in s.iter().flatten().flatten() {
            run.push(Stmt::Set(*x, f32(0.0)));
        }
        let key_blocks = bc / 8;
        for ks in 0..self.d / 16 {
            for (rb, regs) in qa.iter().enumerate() {
                let offset = (16 * rb * q_stride + 32 * ks) as i64;
                run.push(Stmt::LdMatrix {
                    dst: regs.to_vec(),
                    addr: add(reg(at.q), i64(offset)),
                    trans: false,
                });
            }
            for nb in (0..key_blocks).step_by(2) {
                let used = if key_blocks - nb >= 2 { 2 } else { 1 };
                let offset = (8 * nb * k_stride + 32 * ks) as i64;
                run.push(Stmt::LdMatrix {
                    dst: at.bm[..2 * used].to_vec(),
                    addr: add(reg(at.k), i64(offset)),
                    trans: false,
                });
                for step in 0..used {
                    for rb in 0..blocks {
                        run.push(Stmt::Mma {
                            half: self.qk,
                            d: s[rb][nb + step],
                            a: qa[rb],
                            b: [at.bm[2 * step], at.bm[2 * step + 1]],
                            c: s[rb][nb + step],
                        });
                    }
                }
            }
        }
        (s, run)
    }

    /// O += P V: P's C fragments of key blocks 2ks and 2ks + 1 are the A fragment of step ks;
    /// each V fragment serves every row block.
    fn p_times_v(
        &self,
        r: &mut Regs,
        s: &[Vec<[Reg; 4]>],
        o: &[Vec<[Reg; 4]>],
        at: &FragmentBases,
    ) -> Vec<Stmt> {
        let (plan, blocks, v_stride) = (self.plan, self.blocks, self.sh.v_stride);
        let pa: Vec<[Reg; 4]> = (0..blocks)
            .map(|rb| [0, 1, 2, 3].map(|i| r.add(format!("pa{rb}_{i}"), Ty::I32)))
            .collect();
        let mut run = Vec::new();
        let vblocks = self.dv / 8;
        for ks in 0..self.bc / 16 {
            for rb in 0..blocks {
                let (s0, s1) = (s[rb][2 * ks], s[rb][2 * ks + 1]);
                run.push(Stmt::Set(pa[rb][0], pack(plan, reg(s0[0]), reg(s0[1]))));
                run.push(Stmt::Set(pa[rb][1], pack(plan, reg(s0[2]), reg(s0[3]))));
                run.push(Stmt::Set(pa[rb][2], pack(plan, reg(s1[0]), reg(s1[1]))));
                run.push(Stmt::Set(pa[rb][3], pack(plan, reg(s1[2]), reg(s1[3]))));
            }
            for vb in (0..vblocks).step_by(2) {
                let used = if vblocks - vb >= 2 { 2 } else { 1 };
                let offset = (16 * ks * v_stride + 16 * vb) as i64;
                run.push(Stmt::LdMatrix {
                    dst: at.bm[..2 * used].to_vec(),
                    addr: add(reg(at.v), i64(offset)),
                    trans: true,
                });
                for step in 0..used {
                    for rb in 0..blocks {
                        let frag = o[rb][vb + step];
                        run.push(Stmt::Mma {
                            half: half_of(plan),
                            d: frag,
                            a: pa[rb],
                            b: [at.bm[2 * step], at.bm[2 * step + 1]],
                            c: frag,
                        });
                    }
                }
            }
        }
        run
    }

    /// The loop over key tiles, running `run` on each the launch does not skip.
    fn tile_loop(&self, tiles: &TileLoop, run: Vec<Stmt>) -> Stmt {
        let t = tiles.tile;
        Stmt::For {
            reg: t,
            start: i64(0),
            end: self.n_tiles(),
            step: 1,
            body: vec![
                Stmt::Set(tiles.code, self.code_of(reg(t))),
                Stmt::If(
                    bin(
                        Bin::Ne,
                        reg(tiles.code),
                        Expr::Int(TileCode::Skip as i64, Ty::I32),
                    ),
                    run,
                    vec![],
                ),
            ],
        }
    }
}

/// The CTA's first query row.
fn first_row(cta_rows: i64) -> Expr {
    mul(special64(Special::Ctaid(0)), i64(cta_rows))
}

/// Whether K can arrive unrotated by `cp.async` and be rotated in shared memory: the plan has
/// RoPE on its first dims and a table row (`rope_dim / 2` f32) is whole 16-byte chunks.
fn rotates_k_in_shared(plan: &KernelPlan) -> bool {
    plan.rope
        .as_ref()
        .is_some_and(|r| r.first_dim == 0 && (r.rope.dim / 2).is_multiple_of(4))
}
