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
//! fall in different banks.

use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Half, Kernel, Reg, Space, Special, Stmt, Ty, Un};
use crate::gpu::kernels::{
    Env, Regs, RopeWords, lse_of_half, param, program, reciprocal, rotate_pair, special64,
};
use crate::gpu::launch::{ForwardArgs, LaunchRecord};
use crate::plan::{KernelPlan, PlanKind, TileCode};
use attn_dsl::DType;
use attn_dsl::modifier::{Expr as M, Var};

/// Threads per CTA: four warps.
pub const THREADS: u32 = 128;

/// How the kernel divides its work: blocks of 16 query rows per warp, and the CTAs an SM is to
/// hold (the launch bound ptxas fits each thread's registers to).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

/// Whether the score program is the scaled score alone, so the scale can move into the
/// exponent (`2^(s c - m c)`, one fused multiply-add per score, `c` twice the plan's half-unit
/// scale) and S stays unscaled. `c` must be at most 1, so that `m c` cannot overflow for any
/// finite raw score `m`.
fn scale_folds(plan: &KernelPlan) -> bool {
    plan.program.score == M::Var(Var::Score) && plan.q_scale > 0.0 && plan.q_scale <= 0.5
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
        && plan.shape.qk_dim.is_multiple_of(16)
        && plan.shape.v_dim.is_multiple_of(8)
}

/// The 16-bit format of the plan's storage (which the tensor cores take).
pub(super) fn half_of(plan: &KernelPlan) -> Half {
    if plan.dtype == DType::F16 {
        Half::F16
    } else {
        Half::Bf16
    }
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

fn shfl(e: Expr, mask: u32) -> Expr {
    Expr::ShflXor(Box::new(e), mask)
}

/// Element `d` of a row at `row_addr` (16-bit in global memory) as f32, rotated by RoPE at `pos`
/// when the plan has it. With `shift`, the column is `d + 2 shift` (a lane's offset in its
/// fragment); the RoPE pairing is decided on `d`, which the caller guarantees is the same for
/// every shift ([`lane_aligned`]).
fn element(
    plan: &KernelPlan,
    param: Params,
    row_addr: &Expr,
    d: usize,
    pos: &Expr,
    shift: Option<&Expr>,
) -> Expr {
    let lane = |bytes_per_step: i64| shift.map_or(i64(0), |q| mul(q.clone(), i64(bytes_per_step)));
    let at_d = |d: usize| {
        let addr = add(add(row_addr.clone(), i64(2 * d as i64)), lane(4));
        Expr::LoadHalf(Space::Global, half_of(plan), Box::new(addr))
    };
    let Some(rope) = &plan.rope else {
        return at_d(d);
    };
    let (first, half) = (rope.first_dim as usize, (rope.rope.dim / 2) as usize);
    if d < first || d >= first + 2 * half {
        return at_d(d);
    }
    let i = d - first;
    // The pair (a, b) this element belongs to, whether it is a, its frequency index, and how
    // far the index moves per step of `shift`.
    let pairing = rope.rope.layout.pairing(rope.rope.dim);
    let (f, is_a) = pairing.owner(i);
    let (a, b) = pairing.pair(f);
    let (a, b, f_step) = (first + a, first + b, (2 / pairing.stride) as i64);
    let entry = add(
        add(
            mul(sub(pos.clone(), param("rope_pos0")), i64(4 * half as i64)),
            i64(4 * f as i64),
        ),
        lane(4 * f_step),
    );
    let c = load(
        Space::Global,
        Ty::F32,
        add(param("rope_cos"), entry.clone()),
    );
    let s = load(Space::Global, Ty::F32, add(param("rope_sin"), entry));
    let (ra, rb) = rotate_pair(at_d(a), at_d(b), c, s);
    if is_a { ra } else { rb }
}

/// Columns `d` and `d + 1` (`d` even; plus `2 shift`) of a 16-bit row as a packed pair: one 32-bit
/// load where RoPE leaves them as they are (or the row is not `rotated`), else both rotated and
/// repacked.
fn pair(
    plan: &KernelPlan,
    to: &Staging,
    row_addr: &Expr,
    d: usize,
    pos: &Expr,
    shift: Option<&Expr>,
) -> Expr {
    let (qk, param) = (to.qk, to.param);
    let rotated = to.rotated
        && plan.rope.as_ref().is_some_and(|r| {
            let first = r.first_dim as usize;
            d + 1 >= first && d < first + r.rope.dim as usize
        });
    if rotated {
        return Expr::PackHalf(
            qk,
            Box::new(element(plan, param, row_addr, d, pos, shift)),
            Box::new(element(plan, param, row_addr, d + 1, pos, shift)),
        );
    }
    let lane = shift.map_or(i64(0), |q| mul(q.clone(), i64(4)));
    let addr = add(add(row_addr.clone(), i64(2 * d as i64)), lane);
    load(Space::Global, Ty::I32, addr)
}

/// Whether every lane's fragment columns (`8 j + 2 q`, `+1`) pair up under RoPE the same way as
/// lane 0's, so a lane offset can be added to addresses instead of selecting per lane.
pub(super) fn lane_aligned(plan: &KernelPlan) -> bool {
    plan.rope.as_ref().is_none_or(|r| {
        let pairing = r.rope.layout.pairing(r.rope.dim);
        r.first_dim.is_multiple_of(8) && (pairing.adjacent() || pairing.partner.is_multiple_of(8))
    })
}

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
    let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    let (hq, hkv) = (plan.shape.heads as i64, plan.shape.kv_heads as i64);
    let bc = tiling.key_tile(plan) as usize;
    let bc64 = bc as i64;
    let blocks = tiling.row_blocks as usize;
    let cta_rows = i64::from(tiling.rows());
    let mut r = Regs { list: Vec::new() };
    let mut body = Vec::new();
    let tid = special64(Special::Tid);
    let lane = cast(Expr::Special(Special::Lane), Ty::I64);

    // Where this lane is: warp, group g, thread-in-group q.
    let (g, q, batch, head, kvh, warp) = (
        r.add("g", Ty::I64),
        r.add("q", Ty::I64),
        r.add("batch", Ty::I64),
        r.add("head", Ty::I64),
        r.add("kv_head", Ty::I64),
        r.add("warp", Ty::I64),
    );
    body.extend([
        Stmt::Set(g, bin(Bin::Div, lane.clone(), i64(4))),
        Stmt::Set(q, bin(Bin::Rem, lane.clone(), i64(4))),
        Stmt::Set(batch, special64(Special::Ctaid(2))),
        Stmt::Set(head, special64(Special::Ctaid(1))),
        Stmt::Set(kvh, bin(Bin::Div, reg(head), i64(hq / hkv))),
        Stmt::Set(warp, bin(Bin::Div, tid.clone(), i64(32))),
    ]);
    // The lane's rows: g and g + 8 (h = 0, 1) of each of the warp's row blocks, all at
    // constant offsets from one register. Rows past Sq are computed (from clamped Q rows) but
    // not stored; the score program sees their unclamped index, which it may not read memory
    // by (its tables clamp).
    let first_row = mul(special64(Special::Ctaid(0)), i64(cta_rows));
    let row_base = r.add("row_base", Ty::I64);
    body.push(Stmt::Set(
        row_base,
        add(
            first_row.clone(),
            add(mul(reg(warp), i64(16 * blocks as i64)), reg(g)),
        ),
    ));
    let row_of = |rb: usize, h: usize| add(reg(row_base), i64((16 * rb + 8 * h) as i64));
    let pos_of = |rb: usize, h: usize| {
        add(
            add(param("p0"), sub(param("skv"), param("sq"))),
            row_of(rb, h),
        )
    };

    // Shared memory: the CTA's Q rows, one K tile [bc][d] and one V tile [bc][dv], all 16-bit
    // with rows padded by 16 bytes so the eight rows an `ldmatrix` reads fall in different banks.
    let (q_stride, k_stride, v_stride) = (2 * d + 16, 2 * d + 16, 2 * dv + 16);
    let q_sh = 0;
    let k_sh = q_sh + cta_rows as usize * q_stride;
    let v_sh = k_sh + bc * k_stride;
    // With RoPE rotating K in shared memory, the tile's cos and sin rows ([bc][rope_dim / 2]
    // f32 each) arrive by cp.async beside it.
    let rope_half = (plan.rope.as_ref())
        .filter(|_| rotates_k_in_shared(plan))
        .map(|r| (r.rope.dim / 2) as usize);
    let cos_sh = v_sh + bc * v_stride;
    let sin_sh = cos_sh + bc * 4 * rope_half.unwrap_or(0);
    let shared_bytes = sin_sh + bc * 4 * rope_half.unwrap_or(0);

    // Q, rotated by RoPE, staged once: row `local` of the CTA from query row first_row + local
    // (clamped into Sq).
    let q_row_of = |local: Expr| {
        bin(
            Bin::Min,
            add(first_row.clone(), local),
            sub(param("sq"), i64(1)),
        )
    };
    body.extend(stage_rows(
        plan,
        &mut r,
        "q_stage",
        Staging {
            count: cta_rows,
            width: d,
            dst: i64(q_sh as i64),
            qk,
            stride: q_stride,
            rotated: true,
            param,
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
    ));

    // Running state per row: max and (per-lane partial) sum; O accumulators o[rb][vb][i].
    let state = |name: &str, r: &mut Regs| -> Vec<[Reg; 2]> {
        (0..blocks)
            .map(|rb| [0, 1].map(|h| r.add(format!("{name}{rb}_{h}"), Ty::F32)))
            .collect()
    };
    let (m, l) = (state("m", &mut r), state("l", &mut r));
    for rb in 0..blocks {
        for h in 0..2 {
            body.push(Stmt::Set(m[rb][h], f32(f32::NEG_INFINITY)));
            body.push(Stmt::Set(l[rb][h], f32(0.0)));
        }
    }
    let frags = |name: &str, count: usize, ty: Ty, r: &mut Regs| -> Vec<Vec<[Reg; 4]>> {
        (0..blocks)
            .map(|rb| {
                (0..count)
                    .map(|j| [0, 1, 2, 3].map(|i| r.add(format!("{name}{rb}_{j}_{i}"), ty)))
                    .collect()
            })
            .collect()
    };
    let o = frags("o", dv / 8, Ty::F32, &mut r);
    for x in o.iter().flatten().flatten() {
        body.push(Stmt::Set(*x, f32(0.0)));
    }

    let (t, code) = (r.add("tile", Ty::I64), r.add("code", Ty::I32));
    let (next_code, issued) = (r.add("next_code", Ty::I32), r.add("k_issued", Ty::Pred));
    let n_tiles = bin(Bin::Div, add(param("skv"), i64(bc64 - 1)), i64(bc64));
    let code_of = |tile: Expr| tile_code(head, [cta_rows, bc64], tile);
    let kv_base = mul(add(mul(reg(batch), i64(hkv)), reg(kvh)), param("skv"));

    // The copies of a tile's rows (of K, V, or the RoPE tables): 16-byte chunks, chunk
    // c = tid + THREADS i. A tile inside Skv copies without the clamp and the zero fill, every
    // copy of a thread an offset from one source and one destination address; a last, partial
    // tile zero-fills rows past Skv.
    let (copy_src, copy_dst) = (r.add("copy_src", Ty::I64), r.add("copy_dst", Ty::I64));
    let copies = |tile: &Expr, rows: &TileRows, bounded: bool| {
        let mut copies = Vec::new();
        let per_row = rows.row_bytes / 16;
        let total = bc * per_row;
        let src_of = |key: Expr| add(rows.src.clone(), mul(key, i64(rows.row_bytes as i64)));
        // With per_row dividing THREADS (and THREADS the chunks), a thread's column is the
        // same in every copy and its row steps by THREADS / per_row.
        if !bounded
            && (THREADS as usize).is_multiple_of(per_row)
            && total.is_multiple_of(THREADS as usize)
        {
            let (row, col) = (
                bin(Bin::Div, tid.clone(), i64(per_row as i64)),
                mul(bin(Bin::Rem, tid.clone(), i64(per_row as i64)), i64(16)),
            );
            let key = add(mul(tile.clone(), i64(bc64)), row.clone());
            copies.push(Stmt::Set(copy_src, add(src_of(key), col.clone())));
            copies.push(Stmt::Set(
                copy_dst,
                add(
                    i64(rows.dst as i64),
                    add(mul(row, i64(rows.stride as i64)), col),
                ),
            ));
            let rows_per_step = (THREADS as usize / per_row) as i64;
            for i in 0..total.div_ceil(THREADS as usize) as i64 {
                copies.push(Stmt::CpAsync {
                    dst: add(reg(copy_dst), i64(i * rows_per_step * rows.stride as i64)),
                    src: add(
                        reg(copy_src),
                        i64(i * rows_per_step * rows.row_bytes as i64),
                    ),
                    src_bytes: Expr::Int(16, Ty::I32),
                });
            }
            return copies;
        }
        for i in 0..total.div_ceil(THREADS as usize) {
            let c = add(tid.clone(), i64((THREADS as usize * i) as i64));
            let (row, col) = (
                bin(Bin::Div, c.clone(), i64(per_row as i64)),
                bin(Bin::Rem, c.clone(), i64(per_row as i64)),
            );
            let key = add(mul(tile.clone(), i64(bc64)), row.clone());
            let (src_key, src_bytes) = if bounded {
                (
                    bin(Bin::Min, key.clone(), sub(param("skv"), i64(1))),
                    select(
                        bin(Bin::Lt, key, param("skv")),
                        Expr::Int(16, Ty::I32),
                        Expr::Int(0, Ty::I32),
                    ),
                )
            } else {
                (key, Expr::Int(16, Ty::I32))
            };
            let copy = Stmt::CpAsync {
                dst: add(
                    i64(rows.dst as i64),
                    add(mul(row, i64(rows.stride as i64)), mul(col.clone(), i64(16))),
                ),
                src: add(src_of(src_key), mul(col, i64(16))),
                src_bytes,
            };
            if total.is_multiple_of(THREADS as usize) {
                copies.push(copy);
            } else {
                copies.push(Stmt::If(
                    bin(Bin::Lt, c, i64(total as i64)),
                    vec![copy],
                    vec![],
                ));
            }
        }
        copies
    };
    let issue = |tile: Expr, regions: &[TileRows]| {
        let inside = bin(
            Bin::Le,
            mul(add(tile.clone(), i64(1)), i64(bc64)),
            param("skv"),
        );
        let (mut full, mut bounded) = (Vec::new(), Vec::new());
        for rows in regions {
            full.extend(copies(&tile, rows, false));
            bounded.extend(copies(&tile, rows, true));
        }
        vec![Stmt::If(inside, full, bounded), Stmt::CpAsyncCommit]
    };
    let kv_rows = |name: &str, width: usize, dst: usize, stride: usize| TileRows {
        src: add(param(name), mul(kv_base.clone(), i64(2 * width as i64))),
        row_bytes: 2 * width,
        dst,
        stride,
    };
    let mut k_regions = vec![kv_rows("k", d, k_sh, k_stride)];
    if let Some(half) = rope_half {
        // Table row of key j: its position p0 + j less the tables' first position.
        for (name, dst) in [("rope_cos", cos_sh), ("rope_sin", sin_sh)] {
            k_regions.push(TileRows {
                src: add(
                    param(name),
                    mul(sub(param("p0"), param("rope_pos0")), i64(4 * half as i64)),
                ),
                row_bytes: 4 * half,
                dst,
                stride: 4 * half,
            });
        }
    }
    let issue_k = |tile: Expr| issue(tile, &k_regions);
    let issue_v = |tile: Expr| issue(tile, &[kv_rows("v", dv, v_sh, v_stride)]);

    // Per running tile (FlashAttention-2's pipeline, one buffer each): K arrives (issued while
    // the previous tile's P V ran, unless that tile did not know this one runs); a barrier
    // (K visible; every warp is done with the previous V); V's copies fly while S = Q K^T
    // and the softmax run; a barrier (V visible; every warp is done with K); the next tile's
    // K copies fly while O += P V runs. With RoPE, K arrives unrotated with its cos and sin
    // rows and is rotated in shared memory (one more barrier), or, where the tables' rows are
    // not whole 16-byte chunks, rotated as it is staged.
    let k_async = plan.rope.is_none() || rope_half.is_some();
    body.push(Stmt::Set(issued, Expr::Pred(false)));
    let mut run = Vec::new();
    if k_async {
        run.push(Stmt::If(un(Un::Not, reg(issued)), issue_k(reg(t)), vec![]));
    } else {
        run.extend(stage_rows(
            plan,
            &mut r,
            "k_stage",
            Staging {
                count: bc64,
                width: d,
                dst: i64(k_sh as i64),
                stride: k_stride,
                qk,
                rotated: true,
                param,
            },
            |local| {
                let key = add(mul(reg(t), i64(bc64)), local);
                let clamped = bin(Bin::Min, key.clone(), sub(param("skv"), i64(1)));
                let addr = add(
                    param("k"),
                    mul(add(kv_base.clone(), clamped.clone()), i64(2 * d as i64)),
                );
                let inside = bin(Bin::Lt, key, param("skv"));
                (addr, add(param("p0"), clamped), Some(inside))
            },
        ));
    }
    run.push(Stmt::CpAsyncWait(0));
    run.push(Stmt::Barrier);
    if let Some(half) = rope_half {
        // Rows a tile can hold: `bc`, or all the keys when there are fewer.
        let keys = bin(Bin::Min, i64(bc64), param("skv"));
        run.extend(rotate_k(
            plan,
            qk,
            &mut r,
            half,
            [k_sh, k_stride, cos_sh, sin_sh],
            keys,
        ));
        run.extend(issue_v(reg(t)));
        run.push(Stmt::Barrier);
    } else {
        run.extend(issue_v(reg(t)));
    }

    // `ldmatrix` addresses: lane l addresses row l % 8 of matrix l / 8; a per-lane base plus
    // constants. Q (A fragments): matrix i is rows 8 (i % 2).., columns 8 (i / 2).. of a 16 x 16
    // block, so registers 0..4 are the A fragment. K (B fragments of S = Q K^T): matrix i is
    // keys 8 (nb + i / 2).., columns 16 ks + 8 (i % 2).., untransposed, so registers (0, 1) are
    // the fragment of key block nb and (2, 3) of nb + 1. V (B fragments of O += P V): matrix i is keys
    // 16 ks + 8 (i % 2).., columns 8 vb + 8 (i / 2).., transposed, so registers (0, 1) are the
    // fragment of column block vb and (2, 3) of vb + 1.
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
    body.push(Stmt::Set(
        q_base,
        add(
            add(
                mul(
                    add(mul(reg(warp), i64(16 * blocks as i64)), low_high.clone()),
                    i64(q_stride as i64),
                ),
                mul(bin(Bin::Div, lane.clone(), i64(16)), i64(16)),
            ),
            i64(q_sh as i64),
        ),
    ));
    body.push(Stmt::Set(
        k_base,
        add(
            add(
                mul(
                    add(lane_row, mul(bin(Bin::Div, lane.clone(), i64(16)), i64(8))),
                    i64(k_stride as i64),
                ),
                mul(bin(Bin::Rem, lane_matrix, i64(2)), i64(16)),
            ),
            i64(k_sh as i64),
        ),
    ));
    body.push(Stmt::Set(
        v_base,
        add(
            add(
                mul(low_high, i64(v_stride as i64)),
                mul(bin(Bin::Div, lane, i64(16)), i64(16)),
            ),
            i64(v_sh as i64),
        ),
    ));
    let bm = [0, 1, 2, 3].map(|i| r.add(format!("bm{i}"), Ty::I32));

    // S = Q K^T: s[rb][nb][i] for keys nb*8 + 2q + (i % 2), rows g + 8 (i / 2) of block rb.
    // Per k-step, the warp's Q fragments load once and each K fragment serves every row block.
    let s = frags("s", bc / 8, Ty::F32, &mut r);
    let qa: Vec<[Reg; 4]> = (0..blocks)
        .map(|rb| [0, 1, 2, 3].map(|i| r.add(format!("qa{rb}_{i}"), Ty::I32)))
        .collect();
    for x in s.iter().flatten().flatten() {
        run.push(Stmt::Set(*x, f32(0.0)));
    }
    let key_blocks = bc / 8;
    for ks in 0..d / 16 {
        for (rb, regs) in qa.iter().enumerate() {
            let offset = (16 * rb * q_stride + 32 * ks) as i64;
            run.push(Stmt::LdMatrix {
                dst: regs.to_vec(),
                addr: add(reg(q_base), i64(offset)),
                trans: false,
            });
        }
        for nb in (0..key_blocks).step_by(2) {
            let used = if key_blocks - nb >= 2 { 2 } else { 1 };
            let offset = (8 * nb * k_stride + 32 * ks) as i64;
            run.push(Stmt::LdMatrix {
                dst: bm[..2 * used].to_vec(),
                addr: add(reg(k_base), i64(offset)),
                trans: false,
            });
            for step in 0..used {
                for rb in 0..blocks {
                    run.push(Stmt::Mma {
                        half: qk,
                        d: s[rb][nb + step],
                        a: qa[rb],
                        b: [bm[2 * step], bm[2 * step + 1]],
                        c: s[rb][nb + step],
                    });
                }
            }
        }
    }

    let scores = TileScores {
        s: &s,
        tile: t,
        key_tile: bc64,
        q,
        batch,
        head,
        row_of: &row_of,
        pos_of: &pos_of,
    };
    run.push(score_tile(plan, &scores, code));
    run.extend(online_softmax(plan, &mut r, &s, [&m, &l], &o, Vec::new()));

    // V has landed and every warp is done with K: the next tile's K copies fly during P V.
    run.push(Stmt::CpAsyncWait(0));
    run.push(Stmt::Barrier);
    if k_async {
        let next = add(reg(t), i64(1));
        run.push(Stmt::Set(
            next_code,
            select(
                bin(Bin::Lt, next.clone(), n_tiles.clone()),
                code_of(bin(Bin::Min, next.clone(), sub(n_tiles.clone(), i64(1)))),
                Expr::Int(TileCode::Skip as i64, Ty::I32),
            ),
        ));
        run.push(Stmt::Set(
            issued,
            bin(
                Bin::Ne,
                reg(next_code),
                Expr::Int(TileCode::Skip as i64, Ty::I32),
            ),
        ));
        run.push(Stmt::If(reg(issued), issue_k(next), vec![]));
    }

    // O += P V: P's C fragments of key blocks 2ks and 2ks + 1 are the A fragment of step ks;
    // each V fragment serves every row block.
    let pa: Vec<[Reg; 4]> = (0..blocks)
        .map(|rb| [0, 1, 2, 3].map(|i| r.add(format!("pa{rb}_{i}"), Ty::I32)))
        .collect();
    let vblocks = dv / 8;
    for ks in 0..bc / 16 {
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
                dst: bm[..2 * used].to_vec(),
                addr: add(reg(v_base), i64(offset)),
                trans: true,
            });
            for step in 0..used {
                for rb in 0..blocks {
                    let frag = o[rb][vb + step];
                    run.push(Stmt::Mma {
                        half: half_of(plan),
                        d: frag,
                        a: pa[rb],
                        b: [bm[2 * step], bm[2 * step + 1]],
                        c: frag,
                    });
                }
            }
        }
    }
    body.push(Stmt::For {
        reg: t,
        start: i64(0),
        end: n_tiles.clone(),
        step: 1,
        body: vec![
            Stmt::Set(code, code_of(reg(t))),
            Stmt::If(
                bin(
                    Bin::Ne,
                    reg(code),
                    Expr::Int(TileCode::Skip as i64, Ty::I32),
                ),
                run,
                vec![],
            ),
        ],
    });

    body.extend(epilogue(plan, &o, [&m, &l], q, [batch, head], &row_of));

    Kernel {
        name: "attention_forward_tc".into(),
        params: ForwardArgs::params(),
        regs: r.list,
        shared_bytes: shared_bytes as u32,
        threads: THREADS,
        // Two CTAs per SM by default: up to 255 registers a thread.
        ctas_per_sm: tiling.ctas_per_sm,
        body,
    }
}

/// A kernel's parameters by name (its launch record's positions).
pub(super) type Params = fn(&str) -> Expr;

/// Where [`stage_rows`] writes: `count` rows of `width` 16-bit columns at `dst`, `stride`
/// bytes apart.
pub(super) struct Staging {
    pub count: i64,
    pub width: usize,
    pub dst: Expr,
    pub stride: usize,
    /// The format of the `Q K^T` operands the rows are staged as.
    pub qk: Half,
    /// Whether the rows are rotated by the plan's RoPE (queries and keys) or copied (values).
    pub rotated: bool,
    /// The kernel's parameters (the RoPE tables among them).
    pub param: Params,
}

/// Synchronous staging of rows into shared memory, rotated by RoPE where the plan has it.
/// `source(local)` gives row `local`'s global address, its position, and whether it exists
/// (else zeros are stored). Where RoPE pairs line up with lane offsets, four threads share a
/// row, thread p of them taking the column pairs 8 i + 2 p (coalesced); else thread j stages
/// row j whole. The CTA stages THREADS / (threads per row) rows per pass.
pub(super) fn stage_rows(
    plan: &KernelPlan,
    r: &mut Regs,
    name: &str,
    to: Staging,
    source: impl Fn(Expr) -> (Expr, Expr, Option<Expr>),
) -> Vec<Stmt> {
    let tid = special64(Special::Tid);
    let split = lane_aligned(plan);
    let per_row: i64 = if split { 4 } else { 1 };
    let rows_per_pass = i64::from(THREADS) / per_row;
    let passes = (to.count + rows_per_pass - 1) / rows_per_pass;
    let (pass, local, part) = (
        r.add(format!("{name}_pass"), Ty::I64),
        r.add(format!("{name}_row"), Ty::I64),
        r.add(format!("{name}_part"), Ty::I64),
    );
    let (addr, pos, inside) = source(reg(local));
    let (shift, col_step) = if split {
        (Some(reg(part)), 8)
    } else {
        (None, 2)
    };
    let mut stage = vec![Stmt::Set(part, bin(Bin::Rem, tid.clone(), i64(per_row)))];
    for dd in (0..to.width).step_by(col_step) {
        let value = pair(plan, &to, &addr, dd, &pos, shift.as_ref());
        let dst = add(
            add(to.dst.clone(), mul(reg(local), i64(to.stride as i64))),
            add(i64(2 * dd as i64), mul(reg(part), i64(4))),
        );
        let value = match &inside {
            Some(inside) => select(inside.clone(), value, Expr::Int(0, Ty::I32)),
            None => value,
        };
        stage.push(Stmt::Store(Space::Shared, dst, value));
    }
    vec![Stmt::For {
        reg: pass,
        start: i64(0),
        end: i64(passes),
        step: 1,
        body: vec![
            Stmt::Set(
                local,
                add(
                    mul(reg(pass), i64(rows_per_pass)),
                    bin(Bin::Div, tid, i64(per_row)),
                ),
            ),
            Stmt::If(bin(Bin::Lt, reg(local), i64(to.count)), stage, vec![]),
        ],
    }]
}

/// Rows of a tile that `cp.async` copies: the source address of key 0's row (key `j`'s is
/// `row_bytes j` on), and where they go in shared memory.
struct TileRows {
    src: Expr,
    row_bytes: usize,
    dst: usize,
    stride: usize,
}

/// Whether K can arrive unrotated by `cp.async` and be rotated in shared memory: the plan has
/// RoPE on its first dims and a table row (`rope_dim / 2` f32) is whole 16-byte chunks.
fn rotates_k_in_shared(plan: &KernelPlan) -> bool {
    plan.rope
        .as_ref()
        .is_some_and(|r| r.first_dim == 0 && (r.rope.dim / 2).is_multiple_of(4))
}

/// RoPE applied in place to the K tile in shared memory (16-bit rows at `k_sh`, `k_stride`
/// apart) from the tile's cos and sin rows (f32, `half` per key, at `cos_sh` and `sin_sh`):
/// each thread rotates 32-bit words of element pairs, widening to f32 and rounding back.
/// Interleaved pairs are one word; half-split pairs (i, i + half) are rotated two at a time,
/// words at columns 2w and half + 2w. The first `keys` rows are rotated (rows past the last
/// key are masked).
fn rotate_k(
    plan: &KernelPlan,
    qk: Half,
    r: &mut Regs,
    half: usize,
    [k_sh, k_stride, cos_sh, sin_sh]: [usize; 4],
    keys: Expr,
) -> Vec<Stmt> {
    let rope = plan.rope.as_ref().expect("a RoPE plan");
    // Read in the storage format, written in the Q K^T operands'.
    let (h, to) = (half_of(plan), qk);
    let pairing = rope.rope.layout.pairing(rope.rope.dim);
    // Work items per key: pairs (adjacent elements) or pairs of pairs.
    let per_key = if pairing.adjacent() { half } else { half / 2 } as i64;
    let (item, key, w) = (
        r.add("rotate_item", Ty::I64),
        r.add("rotate_key", Ty::I64),
        r.add("rotate_word", Ty::I64),
    );
    let row = add(i64(k_sh as i64), mul(reg(key), i64(k_stride as i64)));
    let elem = |col: Expr| {
        Expr::LoadHalf(
            Space::Shared,
            h,
            Box::new(add(row.clone(), mul(col, i64(2)))),
        )
    };
    let table = |base: usize, i: Expr| {
        load(
            Space::Shared,
            Ty::F32,
            add(
                i64(base as i64),
                mul(add(mul(reg(key), i64(half as i64)), i), i64(4)),
            ),
        )
    };
    // Pair i of the key rotated.
    let rotated =
        |a: Expr, b: Expr, i: Expr| rotate_pair(a, b, table(cos_sh, i.clone()), table(sin_sh, i));
    let word_at = |col: Expr| add(row.clone(), mul(col, i64(2)));
    let mut body = vec![
        Stmt::Set(key, bin(Bin::Div, reg(item), i64(per_key))),
        Stmt::Set(w, bin(Bin::Rem, reg(item), i64(per_key))),
    ];
    let words = RopeWords {
        pairing,
        to,
        elem: &elem,
        word: &word_at,
        rotated: &rotated,
    };
    // Pair w (adjacent elements), or pairs 2 w and 2 w + 1 (split).
    let f0 = if pairing.adjacent() {
        reg(w)
    } else {
        mul(reg(w), i64(2))
    };
    body.extend(words.rotate(r, mul(reg(w), i64(2)), f0));
    // A trip count known only at run time keeps ptxas from unrolling the loop: unrolled, its
    // loads were scheduled together and the head dim 128 kernel spilled at 255 registers.
    vec![Stmt::For {
        reg: item,
        start: special64(Special::Tid),
        end: mul(keys, i64(per_key)),
        step: i64::from(THREADS),
        body,
    }]
}

/// A tile's scores as `mma` C fragments: `s[rb][nb][i]` holds key `8 nb + 2 q + i % 2` of tile
/// `tile` for row `h = i / 2` of row block `rb` (`row_of(rb, h)`, at position `pos_of(rb, h)`).
pub(super) struct TileScores<'a> {
    pub s: &'a [Vec<[Reg; 4]>],
    pub tile: Reg,
    pub key_tile: i64,
    pub q: Reg,
    pub batch: Reg,
    pub head: Reg,
    pub row_of: &'a dyn Fn(usize, usize) -> Expr,
    pub pos_of: &'a dyn Fn(usize, usize) -> Expr,
}

/// The score program, per element. A tile of code 1 keeps every key (the launch gives code 1
/// only to tiles inside Skv), so the mask and the Skv bound apply under code 2 alone. When the
/// program is the scaled score itself, S stays unscaled: its max is taken raw and the scale
/// applies inside the exponent, `2^(s c - m c)`, one fused multiply-add per score.
pub(super) fn score_tile(plan: &KernelPlan, tile: &TileScores, code: Reg) -> Stmt {
    let scale = plan.q_scale as f32;
    let folded = scale_folds(plan);
    let keep_mask = !matches!(plan.program.mask, M::Bool(true));
    let (mut kept, mut masked) = (Vec::new(), Vec::new());
    for (rb, block) in tile.s.iter().enumerate() {
        for (nb, frag) in block.iter().enumerate() {
            for (i, &x) in frag.iter().enumerate() {
                let h = i / 2;
                let key = add(
                    mul(reg(tile.tile), i64(tile.key_tile)),
                    add(mul(reg(tile.q), i64(2)), i64((8 * nb + i % 2) as i64)),
                );
                let env = Env {
                    score: mul(reg(x), f32(scale)),
                    batch: reg(tile.batch),
                    head: reg(tile.head),
                    query: (tile.pos_of)(rb, h),
                    key: add(param("p0"), key.clone()),
                    query_index: (tile.row_of)(rb, h),
                    key_index: key.clone(),
                };
                let value = if folded {
                    reg(x)
                } else {
                    program(&plan.program.score, &env)
                };
                if !folded {
                    kept.push(Stmt::Set(x, value.clone()));
                }
                let mut keep = bin(Bin::Lt, key, param("skv"));
                if keep_mask {
                    keep = bin(Bin::And, keep, program(&plan.program.mask, &env));
                }
                masked.push(Stmt::Set(x, select(keep, value, f32(f32::NEG_INFINITY))));
            }
        }
    }
    Stmt::If(
        bin(
            Bin::Eq,
            reg(code),
            Expr::Int(TileCode::Masked as i64, Ty::I32),
        ),
        masked,
        kept,
    )
}

/// The exponent's scale: twice the half-unit difference; folded, `2 c (s - m)` on raw scores.
fn scaled(plan: &KernelPlan, e: Expr) -> Expr {
    if scale_folds(plan) {
        mul(e, f32(2.0 * plan.q_scale as f32))
    } else {
        mul(e, f32(2.0))
    }
}

/// One tile's online softmax over the scores `s` (laid out as in [`TileScores`]): the row max
/// (this lane's elements, then its quad), the rescale of the running max `m`, sum `l` and the
/// accumulators `o` (`o[rb][vb]`, rows as in `s`; skipped when every row of the warp keeps its
/// maximum; `before_rescale` runs first), and `P = 2^(S - m)` in place of S.
pub(super) fn online_softmax(
    plan: &KernelPlan,
    r: &mut Regs,
    s: &[Vec<[Reg; 4]>],
    [m, l]: [&[[Reg; 2]]; 2],
    o: &[Vec<[Reg; 4]>],
    before_rescale: Vec<Stmt>,
) -> Vec<Stmt> {
    let folded = scale_folds(plan);
    let exponent_scale = if folded {
        2.0 * plan.q_scale as f32
    } else {
        1.0
    };
    let (mt, m_use, neg_max, tile_sum) = (
        r.add("tile_max", Ty::F32),
        r.add("m_use", Ty::F32),
        r.add("neg_max", Ty::F32),
        r.add("tile_sum", Ty::F32),
    );
    let alphas: Vec<[Reg; 2]> = (0..s.len())
        .map(|rb| [0, 1].map(|h| r.add(format!("alpha{rb}_{h}"), Ty::F32)))
        .collect();
    let rescale = r.add("rescale", Ty::I32);
    let mut run = vec![Stmt::Set(rescale, Expr::Int(0, Ty::I32))];
    for rb in 0..s.len() {
        for h in 0..2 {
            let alpha = alphas[rb][h];
            run.push(Stmt::Set(mt, f32(f32::NEG_INFINITY)));
            for frag in &s[rb] {
                for x in [frag[2 * h], frag[2 * h + 1]] {
                    run.push(Stmt::Set(mt, bin(Bin::Max, reg(mt), reg(x))));
                }
            }
            for lane_mask in [1, 2] {
                run.push(Stmt::Set(
                    mt,
                    bin(Bin::Max, reg(mt), shfl(reg(mt), lane_mask)),
                ));
            }
            let m_new = bin(Bin::Max, reg(m[rb][h]), reg(mt));
            run.push(Stmt::Set(
                m_use,
                select(
                    bin(Bin::Eq, m_new.clone(), f32(f32::NEG_INFINITY)),
                    f32(0.0),
                    m_new.clone(),
                ),
            ));
            run.push(Stmt::Set(
                alpha,
                un(Un::Ex2Ftz, scaled(plan, sub(reg(m[rb][h]), reg(m_use)))),
            ));
            run.push(Stmt::Set(m[rb][h], m_new));
            run.push(Stmt::Set(
                rescale,
                bin(
                    Bin::Or,
                    reg(rescale),
                    cast(bin(Bin::Ne, reg(alpha), f32(1.0)), Ty::I32),
                ),
            ));
            run.push(Stmt::Set(neg_max, mul(reg(m_use), f32(-exponent_scale))));
            run.push(Stmt::Set(tile_sum, f32(0.0)));
            for frag in &s[rb] {
                for x in [frag[2 * h], frag[2 * h + 1]] {
                    let exponent = if folded {
                        fma(reg(x), f32(exponent_scale), reg(neg_max))
                    } else {
                        scaled(plan, add(reg(x), reg(neg_max)))
                    };
                    run.push(Stmt::Set(x, un(Un::Ex2Ftz, exponent)));
                    run.push(Stmt::Set(tile_sum, add(reg(tile_sum), reg(x))));
                }
            }
            // The running sum rescaled and the tile's added in one rounding.
            run.push(Stmt::Set(
                l[rb][h],
                fma(reg(l[rb][h]), reg(alpha), reg(tile_sum)),
            ));
        }
    }
    // The accumulators are rescaled only when some row of the warp has a new maximum: after
    // the first tiles a row's maximum rarely moves, and every alpha is then exactly 1 (the
    // multiply would change nothing). The test is warp-uniform, so the branch does not diverge.
    for lane_mask in [1, 2, 4, 8, 16] {
        run.push(Stmt::Set(
            rescale,
            bin(Bin::Or, reg(rescale), shfl(reg(rescale), lane_mask)),
        ));
    }
    // (The accumulators may be in flight until here: `before_rescale` waits for them.)
    run.extend(before_rescale);
    let mut rescale_o = Vec::new();
    for rb in 0..s.len() {
        for h in 0..2 {
            for frag in &o[rb] {
                for x in [frag[2 * h], frag[2 * h + 1]] {
                    rescale_o.push(Stmt::Set(x, mul(reg(x), reg(alphas[rb][h]))));
                }
            }
        }
    }
    run.push(Stmt::If(
        bin(Bin::Ne, reg(rescale), Expr::Int(0, Ty::I32)),
        rescale_o,
        vec![],
    ));
    run
}

/// The epilogue: the quad's sums; `out = O / l` (accumulators `o` as in [`online_softmax`]);
/// lse from lane `q == 0`; rows past Sq are not stored.
pub(super) fn epilogue(
    plan: &KernelPlan,
    o: &[Vec<[Reg; 4]>],
    [m, l]: [&[[Reg; 2]]; 2],
    q: Reg,
    [batch, head]: [Reg; 2],
    row_of: &dyn Fn(usize, usize) -> Expr,
) -> Vec<Stmt> {
    let (hq, dv) = (plan.shape.heads as i64, plan.shape.v_dim as usize);
    let folded = scale_folds(plan);
    let mut body = Vec::new();
    for rb in 0..o.len() {
        for h in 0..2 {
            let l = l[rb][h];
            for lane_mask in [1, 2] {
                body.push(Stmt::Set(l, add(reg(l), shfl(reg(l), lane_mask))));
            }
            let out_row = add(
                mul(add(mul(reg(batch), i64(hq)), reg(head)), param("sq")),
                row_of(rb, h),
            );
            // The sum is 0 only when no key was kept; a NaN sum (a NaN score) carries NaN through.
            let nonempty = bin(Bin::Ne, reg(l), f32(0.0));
            let mut store = Vec::new();
            for (vb, frag) in o[rb].iter().enumerate() {
                for j in 0..2 {
                    let col = add(mul(reg(q), i64(2)), i64((8 * vb + j) as i64));
                    let addr = add(
                        param("out"),
                        mul(add(mul(out_row.clone(), i64(dv as i64)), col), i64(4)),
                    );
                    let value = select(
                        nonempty.clone(),
                        mul(reg(frag[2 * h + j]), reciprocal(reg(l))),
                        f32(0.0),
                    );
                    store.push(Stmt::Store(Space::Global, addr, value));
                }
            }
            let lse = if folded {
                // c m <= m: finite for every finite raw score.
                mul(
                    add(scaled(plan, reg(m[rb][h])), un(Un::Lg2, reg(l))),
                    f32(std::f32::consts::LN_2),
                )
            } else {
                lse_of_half(reg(m[rb][h]), reg(l))
            };
            store.push(Stmt::If(
                bin(Bin::Eq, reg(q), i64(0)),
                vec![Stmt::Store(
                    Space::Global,
                    at(param("lse"), out_row, 4),
                    select(nonempty, lse, f32(f32::NEG_INFINITY)),
                )],
                vec![],
            ));
            body.push(Stmt::If(
                bin(Bin::Lt, row_of(rb, h), param("sq")),
                store,
                vec![],
            ));
        }
    }
    body
}

/// The launch's code for key tile `tile` of this CTA's query block (CTA x of `rows` query rows,
/// tiles of `key_tile` keys) and head `head`: the codes are laid out by (head, query block, key
/// tile), as [`crate::gpu::ForwardKernel::tile_codes`] makes them.
pub(super) fn tile_code(head: Reg, [rows, key_tile]: [i64; 2], tile: Expr) -> Expr {
    let n_tiles = bin(
        Bin::Div,
        add(param("skv"), i64(key_tile - 1)),
        i64(key_tile),
    );
    let n_qblocks = bin(Bin::Div, add(param("sq"), i64(rows - 1)), i64(rows));
    let index = add(
        mul(
            add(mul(reg(head), n_qblocks), special64(Special::Ctaid(0))),
            n_tiles,
        ),
        tile,
    );
    load(Space::Global, Ty::I32, at(param("codes"), index, 4))
}
