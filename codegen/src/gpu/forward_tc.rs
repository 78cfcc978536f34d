//! A forward plan lowered to GPU IR on tensor cores (bf16 and f16 specs): FlashAttention-2's
//! dataflow.
//!
//! A CTA of four warps handles 64 query rows of one (batch, head); each warp owns 16 rows, and
//! each lane the rows `g` and `g + 8` of them (`g = lane / 4`) as `mma.sync` fragments. Inputs
//! are 16-bit (the spec's bf16 or f16) in global memory: a pair of columns is one 32-bit load, and only columns RoPE
//! rotates are widened to f32 and repacked. Q is held in A fragments (RoPE applied; the scale
//! applies to S in f32). Per key tile the CTA stages
//! K (rotated) and V in shared memory; `S = Q K^T` accumulates in f32 C fragments; the score
//! program and mask apply per element; the row max and sum reduce over the lane quad with
//! shuffles; `P = 2^(S - m)` is repacked from C fragments straight into A fragments (their
//! layouts line up), and `O += P V` accumulates in registers. Tile codes skip or unmask tiles.
//! K and V tiles are 16-bit in shared memory (rows padded against bank conflicts), copied there by
//! `cp.async` into two buffers (the next tile's copies fly while this one is computed; with RoPE
//! on K, K is rotated as it is staged instead), and reach the B fragments through `ldmatrix`
//! (transposed for V).

use super::forward::{Env, PARAMS, ROWS, Regs, param, program, reciprocal, special64};
use super::ir::build::*;
use super::ir::{Bin, Expr, Half, Kernel, Reg, Space, Special, Stmt, Ty, Un};
use crate::plan::{KernelPlan, PlanKind};
use attn_dsl::modifier::{Expr as M, Var};
use attn_dsl::{DType, RopeLayout};

/// Threads per CTA: four warps of 16 query rows.
pub const THREADS: u32 = 128;

/// Keys per tile: 64 up to head dim 128 (two buffers of K and V tiles take 68 KiB at D 128:
/// dynamic shared memory, two CTAs still fit an SM), 16 beyond.
pub fn key_tile(plan: &KernelPlan) -> u32 {
    if plan.shape.qk_dim + plan.shape.v_dim <= 256 {
        64
    } else {
        16
    }
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
fn half_of(plan: &KernelPlan) -> Half {
    if plan.dtype == DType::F16 {
        Half::F16
    } else {
        Half::Bf16
    }
}

fn pack(plan: &KernelPlan, lo: Expr, hi: Expr) -> Expr {
    Expr::PackHalf(half_of(plan), Box::new(lo), Box::new(hi))
}

fn shfl(e: Expr, mask: u32) -> Expr {
    Expr::ShflXor(Box::new(e), mask)
}

/// Element `d` of a row at `row_addr` (16-bit in global memory) as f32, rotated by RoPE at `pos`
/// when the plan has it. With `shift`, the column is `d + 2 shift` (a lane's offset in its
/// fragment); the RoPE pairing is decided on `d`, which the caller guarantees is the same for
/// every shift ([`lane_aligned`]).
fn element(plan: &KernelPlan, row_addr: &Expr, d: usize, pos: &Expr, shift: Option<&Expr>) -> Expr {
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
    let (a, b, is_a, f, f_step) = match rope.rope.layout {
        RopeLayout::Half if i < half => (d, d + half, true, i, 2),
        RopeLayout::Half => (d - half, d, false, i - half, 2),
        RopeLayout::Interleaved if i.is_multiple_of(2) => (d, d + 1, true, i / 2, 1),
        RopeLayout::Interleaved => (d - 1, d, false, i / 2, 1),
    };
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
    if is_a {
        sub(mul(at_d(a), c), mul(at_d(b), s))
    } else {
        add(mul(at_d(b), c), mul(at_d(a), s))
    }
}

/// Columns `d` and `d + 1` (`d` even; plus `2 shift`) of a 16-bit row as a packed pair: one 32-bit
/// load where RoPE leaves them as they are, else both rotated and repacked.
fn pair(plan: &KernelPlan, row_addr: &Expr, d: usize, pos: &Expr, shift: Option<&Expr>) -> Expr {
    let rotated = plan.rope.as_ref().is_some_and(|r| {
        let first = r.first_dim as usize;
        d + 1 >= first && d < first + r.rope.dim as usize
    });
    if rotated {
        return pack(
            plan,
            element(plan, row_addr, d, pos, shift),
            element(plan, row_addr, d + 1, pos, shift),
        );
    }
    let lane = shift.map_or(i64(0), |q| mul(q.clone(), i64(4)));
    let addr = add(add(row_addr.clone(), i64(2 * d as i64)), lane);
    load(Space::Global, Ty::I32, addr)
}

/// Whether every lane's fragment columns (`8 j + 2 q`, `+1`) pair up under RoPE the same way as
/// lane 0's, so a lane offset can be added to addresses instead of selecting per lane.
fn lane_aligned(plan: &KernelPlan) -> bool {
    plan.rope.as_ref().is_none_or(|r| {
        r.first_dim.is_multiple_of(8)
            && (r.rope.layout == RopeLayout::Interleaved || (r.rope.dim / 2).is_multiple_of(8))
    })
}

/// Lowers the tensor-core forward kernel. The plan must be [`supports`]ed.
pub fn lower(plan: &KernelPlan) -> Kernel {
    assert!(
        supports(plan),
        "the tensor-core kernel runs bf16 and f16 per-head forward plans"
    );
    let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    let (hq, hkv) = (plan.shape.heads as i64, plan.shape.kv_heads as i64);
    let bc = key_tile(plan) as usize;
    let mut r = Regs { list: Vec::new() };
    let mut body = Vec::new();
    let tid = special64(Special::Tid);

    // Where this lane is: warp, group g, thread-in-group q; its two rows.
    let (g, q, batch, head, kvh) = (
        r.add("g", Ty::I64),
        r.add("q", Ty::I64),
        r.add("batch", Ty::I64),
        r.add("head", Ty::I64),
        r.add("kv_head", Ty::I64),
    );
    let lane = cast(Expr::Special(Special::Lane), Ty::I64);
    body.extend([
        Stmt::Set(g, bin(Bin::Div, lane.clone(), i64(4))),
        Stmt::Set(q, bin(Bin::Rem, lane, i64(4))),
        Stmt::Set(batch, special64(Special::Ctaid(2))),
        Stmt::Set(head, special64(Special::Ctaid(1))),
        Stmt::Set(kvh, bin(Bin::Div, reg(head), i64(hq / hkv))),
    ]);
    let rows: [Reg; 2] = [r.add("row0", Ty::I64), r.add("row1", Ty::I64)];
    let clamped: [Reg; 2] = [r.add("q_row0", Ty::I64), r.add("q_row1", Ty::I64)];
    let qpos: [Reg; 2] = [r.add("q_pos0", Ty::I64), r.add("q_pos1", Ty::I64)];
    let warp_row = add(
        mul(special64(Special::Ctaid(0)), i64(i64::from(ROWS))),
        mul(bin(Bin::Div, tid.clone(), i64(32)), i64(16)),
    );
    for h in 0..2 {
        body.push(Stmt::Set(
            rows[h],
            add(add(warp_row.clone(), reg(g)), i64(8 * h as i64)),
        ));
        body.push(Stmt::Set(
            clamped[h],
            bin(Bin::Min, reg(rows[h]), sub(param("sq"), i64(1))),
        ));
        body.push(Stmt::Set(
            qpos[h],
            add(
                add(param("p0"), sub(param("skv"), param("sq"))),
                reg(clamped[h]),
            ),
        ));
    }

    // Q as A fragments: a[ks][i], rows g (i even) and g + 8 (i odd), columns 16 ks + 2 q (+8
    // for i >= 2), rotated and rounded to the 16-bit format (the scale applies to S in f32).
    let q_addr = |h: usize| {
        add(
            param("q"),
            mul(
                add(
                    mul(add(mul(reg(batch), i64(hq)), reg(head)), param("sq")),
                    reg(clamped[h]),
                ),
                i64(2 * d as i64),
            ),
        )
    };
    let scale = plan.q_scale as f32;
    let mut a_frags: Vec<[Reg; 4]> = Vec::new();
    for ks in 0..d / 16 {
        let regs = [0, 1, 2, 3].map(|i| r.add(format!("qa{ks}_{i}"), Ty::I32));
        for (i, &ai) in regs.iter().enumerate() {
            let h = i % 2;
            let base_col = 16 * ks + 8 * (i / 2);
            let value = if lane_aligned(plan) {
                // Columns base + 2q and the next: a lane offset on the addresses.
                pair(plan, &q_addr(h), base_col, &reg(qpos[h]), Some(&reg(q)))
            } else {
                // RoPE pairs straddle the lanes' columns: select among the four candidates.
                let mut value = Expr::Int(0, Ty::I32);
                for qq in (0..4).rev() {
                    let col = base_col + 2 * qq;
                    let both = pair(plan, &q_addr(h), col, &reg(qpos[h]), None);
                    value = select(bin(Bin::Eq, reg(q), i64(qq as i64)), both, value);
                }
                value
            };
            body.push(Stmt::Set(ai, value));
        }
        a_frags.push(regs);
    }

    // Running state: per row max and (per-lane partial) sum; O accumulators o[vb][i].
    let m = [r.add("m0", Ty::F32), r.add("m1", Ty::F32)];
    let l = [r.add("l0", Ty::F32), r.add("l1", Ty::F32)];
    for h in 0..2 {
        body.push(Stmt::Set(m[h], f32(f32::NEG_INFINITY)));
        body.push(Stmt::Set(l[h], f32(0.0)));
    }
    let o: Vec<[Reg; 4]> = (0..dv / 8)
        .map(|vb| [0, 1, 2, 3].map(|i| r.add(format!("o{vb}_{i}"), Ty::F32)))
        .collect();
    for frag in &o {
        for &x in frag {
            body.push(Stmt::Set(x, f32(0.0)));
        }
    }

    // Shared memory: two buffers, each a K tile [bc][d] and a V tile [bc][dv] in 16 bits, rows
    // padded by 16 bytes so the eight rows an `ldmatrix` reads fall in different banks. Tile t
    // uses buffer t % 2, so the copies of tile t + 1 fly while tile t is computed.
    let (k_stride, v_stride) = (2 * d + 16, 2 * dv + 16);
    let (k_sh, v_sh) = (0, bc * k_stride);
    let buffer_bytes = v_sh + bc * v_stride;
    let shared_bytes = 2 * buffer_bytes;
    let (t, code) = (r.add("tile", Ty::I64), r.add("code", Ty::I32));
    let (next_code, issued, buf) = (
        r.add("next_code", Ty::I32),
        r.add("issued", Ty::Pred),
        r.add("buffer", Ty::I64),
    );
    let bc64 = bc as i64;
    let n_tiles = bin(Bin::Div, add(param("skv"), i64(bc64 - 1)), i64(bc64));
    let rows64 = i64::from(ROWS);
    let n_qblocks = bin(Bin::Div, add(param("sq"), i64(rows64 - 1)), i64(rows64));
    let code_of = |tile: Expr| {
        let index = add(
            mul(
                add(
                    mul(reg(head), n_qblocks.clone()),
                    special64(Special::Ctaid(0)),
                ),
                n_tiles.clone(),
            ),
            tile,
        );
        load(Space::Global, Ty::I32, at(param("codes"), index, 4))
    };
    let kv_base = mul(add(mul(reg(batch), i64(hkv)), reg(kvh)), param("skv"));
    let buffer_of = |tile: Expr| mul(bin(Bin::Rem, tile, i64(2)), i64(buffer_bytes as i64));

    // The copies of one tile into its buffer: 16-byte chunks of K rows (unless RoPE rotates K:
    // then it is staged when the tile runs) and V rows, chunk c = tid + THREADS i; rows past
    // Skv are zero-filled.
    let k_async = plan.rope.is_none();
    // A tile inside Skv copies without the clamp and the zero fill: every copy of a thread is
    // a constant offset from one source and one destination address (the steady state). A last,
    // partial tile takes the bounded copies.
    let (copy_src, copy_dst) = (r.add("copy_src", Ty::I64), r.add("copy_dst", Ty::I64));
    let copies = |tile: &Expr, bounded: bool| -> Vec<Stmt> {
        let mut copies = Vec::new();
        let regions = [
            (k_async, "k", d, k_sh, k_stride),
            (true, "v", dv, v_sh, v_stride),
        ];
        for (enabled, name, width, base, stride) in regions {
            if !enabled {
                continue;
            }
            let per_row = width / 8;
            let total = bc * per_row;
            let row_bytes = i64(2 * width as i64);
            let dst_tile = add(buffer_of(tile.clone()), i64(base as i64));
            // With per_row dividing THREADS, a thread's column is the same in every copy and
            // its row steps by THREADS / per_row.
            if !bounded && (THREADS as usize).is_multiple_of(per_row) {
                let (row, col) = (
                    bin(Bin::Div, tid.clone(), i64(per_row as i64)),
                    mul(bin(Bin::Rem, tid.clone(), i64(per_row as i64)), i64(16)),
                );
                let key = add(mul(tile.clone(), i64(bc64)), row.clone());
                copies.push(Stmt::Set(
                    copy_src,
                    add(
                        add(
                            param(name),
                            mul(add(kv_base.clone(), key), row_bytes.clone()),
                        ),
                        col.clone(),
                    ),
                ));
                copies.push(Stmt::Set(
                    copy_dst,
                    add(dst_tile, add(mul(row, i64(stride as i64)), col)),
                ));
                let rows_per_step = (THREADS as usize / per_row) as i64;
                for i in 0..total.div_ceil(THREADS as usize) as i64 {
                    copies.push(Stmt::CpAsync {
                        dst: add(reg(copy_dst), i64(i * rows_per_step * stride as i64)),
                        src: add(reg(copy_src), i64(i * rows_per_step * 2 * width as i64)),
                        src_bytes: Expr::Int(16, Ty::I32),
                    });
                }
                continue;
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
                let src = add(
                    add(
                        param(name),
                        mul(add(kv_base.clone(), src_key), row_bytes.clone()),
                    ),
                    mul(col.clone(), i64(16)),
                );
                let dst = add(
                    dst_tile.clone(),
                    add(mul(row, i64(stride as i64)), mul(col, i64(16))),
                );
                let copy = Stmt::CpAsync {
                    dst,
                    src,
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
        }
        copies
    };
    let issue = |tile: Expr| -> Vec<Stmt> {
        let inside = bin(
            Bin::Le,
            mul(add(tile.clone(), i64(1)), i64(bc64)),
            param("skv"),
        );
        vec![
            Stmt::If(inside, copies(&tile, false), copies(&tile, true)),
            Stmt::CpAsyncCommit,
        ]
    };
    body.push(Stmt::Set(issued, Expr::Pred(false)));
    let mut tile_body = vec![Stmt::Set(code, code_of(reg(t)))];
    let mut run = vec![Stmt::Set(buf, buffer_of(reg(t)))];
    // This tile's copies, unless the previous tile issued them; then the next tile's (if it
    // runs) and a wait for all but that newest group.
    run.push(Stmt::If(un(Un::Not, reg(issued)), issue(reg(t)), vec![]));
    let next = add(reg(t), i64(1));
    run.push(Stmt::Set(
        next_code,
        select(
            bin(Bin::Lt, next.clone(), n_tiles.clone()),
            code_of(bin(Bin::Min, next.clone(), sub(n_tiles.clone(), i64(1)))),
            Expr::Int(0, Ty::I32),
        ),
    ));
    run.push(Stmt::Set(
        issued,
        bin(Bin::Ne, reg(next_code), Expr::Int(0, Ty::I32)),
    ));
    let mut prefetch = issue(next);
    prefetch.push(Stmt::CpAsyncWait(1));
    run.push(Stmt::If(reg(issued), prefetch, vec![Stmt::CpAsyncWait(0)]));

    if !k_async {
        // RoPE rotates K as it is staged: where RoPE pairs line up with lane offsets, four
        // threads share a key, thread p of them taking the column pairs 8 i + 2 p (coalesced);
        // else thread j stages key j whole. The CTA stages THREADS / per_key keys per pass.
        let split = lane_aligned(plan);
        let per_key: i64 = if split { 4 } else { 1 };
        let keys_per_pass = i64::from(THREADS) / per_key;
        let passes = (bc64 + keys_per_pass - 1) / keys_per_pass;
        let (pass, local, key_l, kv_row, part) = (
            r.add("load_pass", Ty::I64),
            r.add("load_local", Ty::I64),
            r.add("load_key", Ty::I64),
            r.add("load_row", Ty::I64),
            r.add("load_part", Ty::I64),
        );
        let mut stage = vec![
            Stmt::Set(key_l, add(mul(reg(t), i64(bc64)), reg(local))),
            Stmt::Set(part, bin(Bin::Rem, tid.clone(), i64(per_key))),
            Stmt::Set(
                kv_row,
                add(
                    kv_base.clone(),
                    bin(Bin::Min, reg(key_l), sub(param("skv"), i64(1))),
                ),
            ),
        ];
        let inside = bin(Bin::Lt, reg(key_l), param("skv"));
        let k_row = add(param("k"), mul(reg(kv_row), i64(2 * d as i64)));
        let k_pos = add(
            param("p0"),
            bin(Bin::Min, reg(key_l), sub(param("skv"), i64(1))),
        );
        // This thread's first column pair and the columns it steps by.
        let (shift, col_step) = if split {
            (Some(reg(part)), 8)
        } else {
            (None, 2)
        };
        for dd in (0..d).step_by(col_step) {
            let pair = pair(plan, &k_row, dd, &k_pos, shift.as_ref());
            let dst = add(
                add(reg(buf), mul(reg(local), i64(k_stride as i64))),
                add(i64((k_sh + 2 * dd) as i64), mul(reg(part), i64(4))),
            );
            stage.push(Stmt::Store(
                Space::Shared,
                dst,
                select(inside.clone(), pair, Expr::Int(0, Ty::I32)),
            ));
        }
        run.push(Stmt::For {
            reg: pass,
            start: i64(0),
            end: i64(passes),
            step: 1,
            body: vec![
                Stmt::Set(
                    local,
                    add(
                        mul(reg(pass), i64(keys_per_pass)),
                        bin(Bin::Div, tid.clone(), i64(per_key)),
                    ),
                ),
                Stmt::If(bin(Bin::Lt, reg(local), i64(bc64)), stage, vec![]),
            ],
        });
    }
    run.push(Stmt::Barrier);

    // B fragments come from `ldmatrix`: lane l addresses row l % 8 of matrix l / 8. Each lane's
    // addresses are a per-lane base plus constants (one register each). K (for S = Q K^T):
    // matrix i of a load is keys 8 nb.., columns 16 ks + 8 i.., untransposed, so registers
    // (0, 1) are the B fragment of step ks and (2, 3) of step ks + 1. V (for O += P V): matrix i
    // is keys 16 ks + 8 (i % 2).., columns 8 vb + 8 (i / 2).., transposed, so registers (0, 1)
    // are the fragment of column block vb and (2, 3) of vb + 1.
    let (k_base, v_base) = (r.add("k_base", Ty::I64), r.add("v_base", Ty::I64));
    let lane = cast(Expr::Special(Special::Lane), Ty::I64);
    let (lane_row, lane_matrix) = (
        bin(Bin::Rem, lane.clone(), i64(8)),
        bin(Bin::Div, lane.clone(), i64(8)),
    );
    body.push(Stmt::Set(
        k_base,
        add(
            add(
                mul(lane_row.clone(), i64(k_stride as i64)),
                mul(lane_matrix.clone(), i64(16)),
            ),
            i64(k_sh as i64),
        ),
    ));
    body.push(Stmt::Set(
        v_base,
        add(
            add(
                mul(
                    add(
                        mul(bin(Bin::Rem, lane_matrix.clone(), i64(2)), i64(8)),
                        lane_row,
                    ),
                    i64(v_stride as i64),
                ),
                mul(bin(Bin::Div, lane, i64(16)), i64(16)),
            ),
            i64(v_sh as i64),
        ),
    ));
    let bm = [0, 1, 2, 3].map(|i| r.add(format!("bm{i}"), Ty::I32));

    // S = Q K^T: s[nb][i] for keys nb*8 + 2q + (i % 2), rows g + 8 (i / 2).
    let s: Vec<[Reg; 4]> = (0..bc / 8)
        .map(|nb| [0, 1, 2, 3].map(|i| r.add(format!("s{nb}_{i}"), Ty::F32)))
        .collect();
    let steps = d / 16;
    for (nb, frag) in s.iter().enumerate() {
        for &x in frag {
            run.push(Stmt::Set(x, f32(0.0)));
        }
        for ks in (0..steps).step_by(2) {
            let pair = steps - ks >= 2;
            let offset = (8 * nb * k_stride + 32 * ks) as i64;
            run.push(Stmt::LdMatrix {
                dst: if pair { bm.to_vec() } else { bm[..2].to_vec() },
                addr: add(add(reg(k_base), reg(buf)), i64(offset)),
                trans: false,
            });
            for step in 0..if pair { 2 } else { 1 } {
                run.push(Stmt::Mma {
                    half: half_of(plan),
                    d: *frag,
                    a: a_frags[ks + step],
                    b: [bm[2 * step], bm[2 * step + 1]],
                    c: *frag,
                });
            }
        }
    }

    // The score program, per element. A tile of code 1 keeps every key (the launch gives code
    // 1 only to tiles inside Skv), so the mask and the Skv bound apply under code 2 alone. When
    // the program is the scaled score itself, S stays unscaled: its max is taken raw and the
    // scale applies inside the exponent, `2^(s c - m c)`, one fused multiply-add per score.
    let folded = plan.program.score == M::Var(Var::Score) && scale > 0.0;
    let exponent_scale = if folded { scale } else { 1.0 };
    let keep_mask = !matches!(plan.program.mask, M::Bool(true));
    let (mut kept, mut masked) = (Vec::new(), Vec::new());
    for (nb, frag) in s.iter().enumerate() {
        for (i, &x) in frag.iter().enumerate() {
            let h = i / 2;
            let key = add(
                mul(reg(t), i64(bc64)),
                add(mul(reg(q), i64(2)), i64((8 * nb + i % 2) as i64)),
            );
            let env = Env {
                score: mul(reg(x), f32(scale)),
                batch: reg(batch),
                head: reg(head),
                query: reg(qpos[h]),
                key: add(param("p0"), key.clone()),
                query_index: reg(clamped[h]),
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
    run.push(Stmt::If(
        bin(Bin::Eq, reg(code), Expr::Int(2, Ty::I32)),
        masked,
        kept,
    ));

    // Row max over the tile (this lane's elements, then its quad), the rescale, P.
    let mt = [r.add("tile_max0", Ty::F32), r.add("tile_max1", Ty::F32)];
    let m_use = [r.add("m_use0", Ty::F32), r.add("m_use1", Ty::F32)];
    let alpha = [r.add("alpha0", Ty::F32), r.add("alpha1", Ty::F32)];
    let neg_max = [r.add("neg_max0", Ty::F32), r.add("neg_max1", Ty::F32)];
    let scaled = |e: Expr| {
        if folded {
            mul(e, f32(exponent_scale))
        } else {
            e
        }
    };
    for h in 0..2 {
        run.push(Stmt::Set(mt[h], f32(f32::NEG_INFINITY)));
        for frag in &s {
            for x in [frag[2 * h], frag[2 * h + 1]] {
                run.push(Stmt::Set(mt[h], bin(Bin::Max, reg(mt[h]), reg(x))));
            }
        }
        for lane_mask in [1, 2] {
            run.push(Stmt::Set(
                mt[h],
                bin(Bin::Max, reg(mt[h]), shfl(reg(mt[h]), lane_mask)),
            ));
        }
        let m_new = bin(Bin::Max, reg(m[h]), reg(mt[h]));
        run.push(Stmt::Set(
            m_use[h],
            select(
                bin(Bin::Eq, m_new.clone(), f32(f32::NEG_INFINITY)),
                f32(0.0),
                m_new.clone(),
            ),
        ));
        run.push(Stmt::Set(
            alpha[h],
            un(Un::Ex2Ftz, scaled(sub(reg(m[h]), reg(m_use[h])))),
        ));
        run.push(Stmt::Set(m[h], m_new));
        run.push(Stmt::Set(l[h], mul(reg(l[h]), reg(alpha[h]))));
        for frag in &o {
            for x in [frag[2 * h], frag[2 * h + 1]] {
                run.push(Stmt::Set(x, mul(reg(x), reg(alpha[h]))));
            }
        }
        run.push(Stmt::Set(
            neg_max[h],
            mul(reg(m_use[h]), f32(-exponent_scale)),
        ));
        for frag in &s {
            for x in [frag[2 * h], frag[2 * h + 1]] {
                let exponent = if folded {
                    fma(reg(x), f32(exponent_scale), reg(neg_max[h]))
                } else {
                    add(reg(x), reg(neg_max[h]))
                };
                run.push(Stmt::Set(x, un(Un::Ex2Ftz, exponent)));
                run.push(Stmt::Set(l[h], add(reg(l[h]), reg(x))));
            }
        }
    }

    // O += P V: P's C fragments of key blocks 2ks and 2ks + 1 are the A fragment of step ks.
    let pa = [0, 1, 2, 3].map(|i| r.add(format!("pa{i}"), Ty::I32));
    let blocks = dv / 8;
    for ks in 0..bc / 16 {
        let (s0, s1) = (s[2 * ks], s[2 * ks + 1]);
        run.push(Stmt::Set(pa[0], pack(plan, reg(s0[0]), reg(s0[1]))));
        run.push(Stmt::Set(pa[1], pack(plan, reg(s0[2]), reg(s0[3]))));
        run.push(Stmt::Set(pa[2], pack(plan, reg(s1[0]), reg(s1[1]))));
        run.push(Stmt::Set(pa[3], pack(plan, reg(s1[2]), reg(s1[3]))));
        for vb in (0..blocks).step_by(2) {
            let pair = blocks - vb >= 2;
            let offset = (16 * ks * v_stride + 16 * vb) as i64;
            run.push(Stmt::LdMatrix {
                dst: if pair { bm.to_vec() } else { bm[..2].to_vec() },
                addr: add(add(reg(v_base), reg(buf)), i64(offset)),
                trans: true,
            });
            for step in 0..if pair { 2 } else { 1 } {
                let frag = o[vb + step];
                run.push(Stmt::Mma {
                    half: half_of(plan),
                    d: frag,
                    a: pa,
                    b: [bm[2 * step], bm[2 * step + 1]],
                    c: frag,
                });
            }
        }
    }
    run.push(Stmt::Barrier);
    tile_body.push(Stmt::If(
        bin(Bin::Ne, reg(code), Expr::Int(0, Ty::I32)),
        run,
        vec![],
    ));
    body.push(Stmt::For {
        reg: t,
        start: i64(0),
        end: n_tiles,
        step: 1,
        body: tile_body,
    });

    // Epilogue: the quad's sums; out = O / l; lse from lane q == 0.
    for h in 0..2 {
        for lane_mask in [1, 2] {
            body.push(Stmt::Set(l[h], add(reg(l[h]), shfl(reg(l[h]), lane_mask))));
        }
        let out_row = add(
            mul(add(mul(reg(batch), i64(hq)), reg(head)), param("sq")),
            reg(rows[h]),
        );
        let nonempty = bin(Bin::Gt, reg(l[h]), f32(0.0));
        let mut store = Vec::new();
        for (vb, frag) in o.iter().enumerate() {
            for j in 0..2 {
                let col = add(mul(reg(q), i64(2)), i64((8 * vb + j) as i64));
                let addr = add(
                    param("out"),
                    mul(add(mul(out_row.clone(), i64(dv as i64)), col), i64(4)),
                );
                let value = select(
                    nonempty.clone(),
                    mul(reg(frag[2 * h + j]), reciprocal(reg(l[h]))),
                    f32(0.0),
                );
                store.push(Stmt::Store(Space::Global, addr, value));
            }
        }
        let lse = mul(
            add(scaled(reg(m[h])), un(Un::Lg2, reg(l[h]))),
            f32(std::f32::consts::LN_2),
        );
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
            bin(Bin::Lt, reg(rows[h]), param("sq")),
            store,
            vec![],
        ));
    }

    Kernel {
        name: "attention_forward_tc".into(),
        params: PARAMS.iter().map(|p| (p.to_string(), Ty::I64)).collect(),
        regs: r.list,
        shared_bytes: shared_bytes as u32,
        threads: THREADS,
        body,
    }
}
