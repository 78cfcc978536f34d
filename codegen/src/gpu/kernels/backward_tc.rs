//! A backward plan lowered to GPU IR on tensor cores (bf16 and f16 specs): FlashAttention-2's
//! backward dataflow in three kernels, every tile product on `mma.sync` m16n8k16 with f32
//! accumulation.
//!
//! - `backward_tc_delta`: `D = rowsum(dout * out)`, one thread per query row (dout 16-bit as
//!   the products read it, out f32).
//! - `backward_tc_dq`: a CTA of four warps takes [`BLOCK`] query rows of one (batch, head), each
//!   warp 16 of them, with Q (rotated) and dO staged once in shared memory. Per key tile the
//!   mask does not skip, K (rotated) and V are staged; `S = Q K^T` and `dP = dO V^T` accumulate
//!   in C fragments; `P = 2^(2 (score - lse))` comes back from the saved lse and
//!   `dS = P (dP - D) * d score / d raw` replaces S; dS, repacked from C into A fragments (their
//!   layouts line up), meets K through transposed `ldmatrix` loads for `dQ += dS K`.
//! - `backward_tc_dkdv`: a CTA takes [`BLOCK`] keys of one (batch, kv head), K (rotated) and V
//!   staged once. Per head of the GQA group and query tile the mask does not skip, Q (rotated),
//!   dO, the scaled lse and D are staged; the transposed products `S^T = K Q^T` and
//!   `dP^T = V dO^T` put the keys on the fragments' rows, so `P^T` and `dS^T` are A fragments
//!   for `dV += P^T dO` and `dK += dS^T Q` with no transpose in between. The group's heads sum
//!   into the same registers.
//!
//! The `Q K^T` operands are in the format the forward used ([`forward_tc::qk_half`]: f16 for bf16
//! specs whose RoPE rotates every column), so recomputed scores match the saved lse; the products
//! with Q or K as the other operand (`dQ += dS K`, `dK += dS^T Q`) take dS in that format too.
//! Inputs past f16's range then run on the SIMT kernels (the runtime checks, as for the forward).
//!
//! dQ takes its own pass instead of atomics, as on the SIMT path: the IR has no atomics, the
//! gradients stay deterministic, and the cost is `S` and `dP` recomputed once more (seven tile
//! products instead of five). Tiles are staged synchronously, and tile codes (from the plan's
//! interval classification, made by the host) skip fully masked tiles and unmask full ones. The
//! scale applies to S in f32 (the operands are the raw rotated q and k), so dq and dk take it at
//! the end, and dq and dk are rotated back by RoPE's transpose in registers: supported plans
//! have RoPE pairs that fall in one lane ([`super::forward_tc`]'s lane alignment), head dims
//! that are multiples of 16 and at most 128 (the dk and dv accumulators of 16 keys take
//! `(qk_dim + v_dim) / 4` registers a lane). Other plans run on the SIMT kernels.

use super::forward_tc;
use super::{Staging, half_of, lane_aligned, stage_rows};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Half, Kernel, Reg, Space, Special, Stmt, Ty, Un};
use crate::gpu::kernels::{Env, Regs, exp2_twice, program, rotate_pair, special64};
use crate::gpu::launch::{BackwardTcArgs, LaunchRecord};
use crate::plan::{CallShape, KernelPlan, PlanKind, TileCode};
use attn_dsl::DType;
use attn_dsl::modifier::Expr as M;
use attn_dsl::modifier::interval::Interval;

/// Threads per CTA: four warps.
pub const THREADS: u32 = 128;

/// Query rows per CTA of the dq kernel and keys per CTA of the dk/dv kernel: four warps of 16.
pub const BLOCK: u32 = 64;

/// Largest head dim (of q and k, or of v) the tensor-core backward takes.
pub const MAX_DIM: u32 = 128;

fn param(name: &str) -> Expr {
    Expr::Param(BackwardTcArgs::position(name))
}

/// Whether the plan's backward runs on these kernels: a per-head backward plan in bf16 or f16,
/// both head dims multiples of 16 up to [`MAX_DIM`], RoPE pairs within one lane.
pub fn supports(plan: &KernelPlan) -> bool {
    let (d, dv) = (plan.shape.qk_dim, plan.shape.v_dim);
    plan.kind == PlanKind::Backward
        && matches!(plan.dtype, DType::Bf16 | DType::F16)
        && plan.mla.is_none()
        // Parameters and their gradients are taken by the SIMT kernels only.
        && plan.params.is_empty()
        && d.is_multiple_of(16)
        && dv.is_multiple_of(16)
        && d <= MAX_DIM
        && dv <= MAX_DIM
        && lane_aligned(plan)
}

/// Keys per tile of the dq kernel and queries per tile of the dk/dv kernel: 64 while
/// `qk_dim + v_dim` is at most 128, else 32 (S and dP take `tile / 4` registers a lane each,
/// beside the accumulators).
pub fn inner_tile(plan: &KernelPlan) -> u32 {
    if plan.shape.qk_dim + plan.shape.v_dim <= 128 {
        64
    } else {
        32
    }
}

/// The three kernels, in launch order: delta, dq, dk and dv. The plan must be [`supports`]ed.
pub fn lower(plan: &KernelPlan) -> [Kernel; 3] {
    assert!(
        supports(plan),
        "the tensor-core backward runs bf16 and f16 per-head backward plans"
    );
    [delta(plan), dq(plan), dkdv(plan)]
}

/// The grids of the three kernels for a call of `[batch, Sq, Skv]`.
pub fn grids(plan: &KernelPlan, [b, sq, skv]: [usize; 3]) -> [[u32; 3]; 3] {
    let (hq, hkv) = (plan.shape.heads, plan.shape.kv_heads);
    let block = BLOCK as usize;
    [
        [
            (b * hq as usize * sq).div_ceil(THREADS as usize) as u32,
            1,
            1,
        ],
        [sq.div_ceil(block) as u32, hq, b as u32],
        [skv.div_ceil(block) as u32, hkv, b as u32],
    ]
}

/// The tile codes of a call on `[batch, Sq, Skv]` with key 0 at `p0`, from the plan's interval
/// classification: for the dq kernel one per (query head, block of [`BLOCK`] query rows, key
/// tile), for the dk/dv kernel one per (query head, block of [`BLOCK`] keys, query tile). A
/// tile that runs past Skv (or, for dk/dv, past Sq) is `Masked` at best, so the kernels bound
/// keys and queries there only.
pub fn tile_codes(plan: &KernelPlan, [b, sq, skv]: [usize; 3], p0: i64) -> [Vec<i32>; 2] {
    let (block, inner) = (BLOCK as usize, inner_tile(plan) as usize);
    let call = |head: usize| CallShape {
        sq: sq as i64,
        skv: skv as i64,
        p0,
        batch: Interval::new(0, b.max(1) as i64 - 1),
        head: Interval::point(head as i64),
    };
    let span = |first: usize, len: usize, end: usize| {
        Interval::new(first as i64, (first + len).min(end) as i64 - 1)
    };
    let heads = plan.shape.heads as usize;
    let mut dq = Vec::with_capacity(heads * sq.div_ceil(block) * skv.div_ceil(inner));
    let mut dkdv = Vec::with_capacity(heads * skv.div_ceil(block) * sq.div_ceil(inner));
    for head in 0..heads {
        for qb in 0..sq.div_ceil(block) {
            for t in 0..skv.div_ceil(inner) {
                let complete = (t + 1) * inner <= skv;
                let (rows, keys) = (span(qb * block, block, sq), span(t * inner, inner, skv));
                dq.push(plan.tile_code(rows, keys, call(head), complete) as i32);
            }
        }
        for kb in 0..skv.div_ceil(block) {
            for t in 0..sq.div_ceil(inner) {
                let complete = (kb + 1) * block <= skv && (t + 1) * inner <= sq;
                let (rows, keys) = (span(t * inner, inner, sq), span(kb * block, block, skv));
                dkdv.push(plan.tile_code(rows, keys, call(head), complete) as i32);
            }
        }
    }
    [dq, dkdv]
}

fn kernel(name: &str, r: Regs, shared_bytes: usize, body: Vec<Stmt>) -> Kernel {
    Kernel {
        name: name.into(),
        params: BackwardTcArgs::params(),
        regs: r.list,
        shared_bytes: shared_bytes as u32,
        threads: THREADS,
        // Two CTAs per SM: up to 255 registers a thread.
        ctas_per_sm: 2,
        body,
    }
}

fn pack(half: Half, lo: Reg, hi: Reg) -> Expr {
    Expr::PackHalf(half, Box::new(reg(lo)), Box::new(reg(hi)))
}

/// `backward_tc_delta`: `delta[row] = sum_c dout[row][c] * out[row][c]`, dout 16-bit, out f32.
fn delta(plan: &KernelPlan) -> Kernel {
    let (r, body) = super::backward::delta_body(plan, param, Some(half_of(plan)), THREADS);
    kernel("backward_tc_delta", r, 0, body)
}

/// A lane's place in its warp and CTA.
struct Lane {
    /// `lane / 4`: the fragment row (and B column) group.
    g: Reg,
    /// `lane % 4`: the thread in the group.
    q: Reg,
    warp: Reg,
}

impl Lane {
    fn new(r: &mut Regs, body: &mut Vec<Stmt>) -> Lane {
        let lane = cast(Expr::Special(Special::Lane), Ty::I64);
        let l = Lane {
            g: r.add("g", Ty::I64),
            q: r.add("q", Ty::I64),
            warp: r.add("warp", Ty::I64),
        };
        body.extend([
            Stmt::Set(l.g, bin(Bin::Div, lane.clone(), i64(4))),
            Stmt::Set(l.q, bin(Bin::Rem, lane, i64(4))),
            Stmt::Set(l.warp, bin(Bin::Div, special64(Special::Tid), i64(32))),
        ]);
        l
    }

    /// A register `name` set to the lane's first row (or key): row `g` of its warp's 16 from
    /// the CTA's `first`.
    fn first_row(&self, r: &mut Regs, body: &mut Vec<Stmt>, name: &str, first: &Expr) -> Reg {
        let base = r.add(name, Ty::I64);
        body.push(Stmt::Set(
            base,
            add(
                first.clone(),
                add(mul(reg(self.warp), i64(16)), reg(self.g)),
            ),
        ));
        base
    }
}

/// A 16-bit tile in shared memory: rows `stride` bytes apart from byte `at`.
#[derive(Clone, Copy)]
struct Tile {
    at: usize,
    stride: usize,
}

impl Tile {
    /// Rows of `width` 16-bit values, padded by 16 bytes so the eight rows an `ldmatrix` reads
    /// fall in different banks.
    fn new(at: usize, width: usize) -> Tile {
        Tile {
            at,
            stride: 2 * width + 16,
        }
    }

    /// One past its last byte, for `rows` rows.
    fn end(self, rows: usize) -> usize {
        self.at + rows * self.stride
    }

    /// This lane's `ldmatrix` row address for A fragments of the 16 rows from `row0` (matrix
    /// `i = lane / 8` is rows `8 (i % 2)..`, columns `8 (i / 2)..`: registers 0..4 are the A
    /// fragment of a 16 x 16 block; the next block of columns is 32 bytes on), or, with `row0`
    /// 0, for transposed B fragments over the tile's rows (matrix `i` is rows `8 (i % 2)..`,
    /// columns `8 (i / 2)..`, so registers (0, 1) are column block `cb` and (2, 3) `cb + 1`;
    /// the next 16 rows are `16 stride` on, the next column block 16 bytes).
    fn a_base(self, row0: Expr) -> Expr {
        let lane = cast(Expr::Special(Special::Lane), Ty::I64);
        let row = add(
            row0,
            add(
                bin(Bin::Rem, lane.clone(), i64(8)),
                mul(
                    bin(Bin::Rem, bin(Bin::Div, lane.clone(), i64(8)), i64(2)),
                    i64(8),
                ),
            ),
        );
        add(
            i64(self.at as i64),
            add(
                mul(row, i64(self.stride as i64)),
                mul(bin(Bin::Div, lane, i64(16)), i64(16)),
            ),
        )
    }

    /// This lane's `ldmatrix` row address for B fragments of `rows x cols^T` products, the
    /// tile's rows as the B columns (matrix `i` is rows `8 (i / 2)..`, columns `8 (i % 2)..`,
    /// untransposed: registers (0, 1) are row block `nb` and (2, 3) `nb + 1`; the next 16
    /// columns are 32 bytes on, the next row block `8 stride`).
    fn b_base(self) -> Expr {
        let lane = cast(Expr::Special(Special::Lane), Ty::I64);
        let row = add(
            bin(Bin::Rem, lane.clone(), i64(8)),
            mul(bin(Bin::Div, lane.clone(), i64(16)), i64(8)),
        );
        add(
            i64(self.at as i64),
            add(
                mul(row, i64(self.stride as i64)),
                mul(bin(Bin::Rem, bin(Bin::Div, lane, i64(8)), i64(2)), i64(16)),
            ),
        )
    }
}

/// Scratch registers of the products: one A fragment and four `ldmatrix` destinations.
struct Scratch {
    a: [Reg; 4],
    b: [Reg; 4],
}

impl Scratch {
    fn new(r: &mut Regs) -> Scratch {
        Scratch {
            a: [0, 1, 2, 3].map(|i| r.add(format!("am{i}"), Ty::I32)),
            b: [0, 1, 2, 3].map(|i| r.add(format!("bm{i}"), Ty::I32)),
        }
    }
}

/// `c[nb] += A B^T` over `kdim` columns: A the 16 rows at `a` (an [`Tile::a_base`] register),
/// B the `8 c.len()` rows of a tile at `b` ([`Tile::b_base`]) `b_stride` bytes apart.
#[allow(clippy::too_many_arguments)] // one product's operands
fn mma_rows(
    out: &mut Vec<Stmt>,
    half: Half,
    c: &[[Reg; 4]],
    a: Reg,
    b: Reg,
    b_stride: usize,
    kdim: usize,
    x: &Scratch,
) {
    for ks in 0..kdim / 16 {
        out.push(Stmt::LdMatrix {
            dst: x.a.to_vec(),
            addr: add(reg(a), i64(32 * ks as i64)),
            trans: false,
        });
        for nb in (0..c.len()).step_by(2) {
            let used = (c.len() - nb).min(2);
            out.push(Stmt::LdMatrix {
                dst: x.b[..2 * used].to_vec(),
                addr: add(reg(b), i64((8 * nb * b_stride + 32 * ks) as i64)),
                trans: false,
            });
            for step in 0..used {
                out.push(Stmt::Mma {
                    half,
                    d: c[nb + step],
                    a: x.a,
                    b: [x.b[2 * step], x.b[2 * step + 1]],
                    c: c[nb + step],
                });
            }
        }
    }
}

/// `c[cb] += A B`: A the fragments `a` (one per 16 columns), B `16 a.len()` rows of a tile at
/// `bt` ([`Tile::a_base`] of row 0) `stride` bytes apart, loaded transposed; `c` of `c.len()`
/// column blocks.
fn mma_frags(
    out: &mut Vec<Stmt>,
    half: Half,
    c: &[[Reg; 4]],
    a: &[[Reg; 4]],
    bt: Reg,
    stride: usize,
    x: &Scratch,
) {
    for (ks, frag) in a.iter().enumerate() {
        for cb in (0..c.len()).step_by(2) {
            let used = (c.len() - cb).min(2);
            out.push(Stmt::LdMatrix {
                dst: x.b[..2 * used].to_vec(),
                addr: add(reg(bt), i64((16 * ks * stride + 16 * cb) as i64)),
                trans: true,
            });
            for step in 0..used {
                out.push(Stmt::Mma {
                    half,
                    d: c[cb + step],
                    a: *frag,
                    b: [x.b[2 * step], x.b[2 * step + 1]],
                    c: c[cb + step],
                });
            }
        }
    }
}

/// C fragments of column blocks `2 ks` and `2 ks + 1` repacked as the A fragment `a[ks]`.
fn pack_frags(out: &mut Vec<Stmt>, half: Half, c: &[[Reg; 4]], a: &[[Reg; 4]]) {
    for (ks, frag) in a.iter().enumerate() {
        let (c0, c1) = (c[2 * ks], c[2 * ks + 1]);
        out.extend([
            Stmt::Set(frag[0], pack(half, c0[0], c0[1])),
            Stmt::Set(frag[1], pack(half, c0[2], c0[3])),
            Stmt::Set(frag[2], pack(half, c1[0], c1[1])),
            Stmt::Set(frag[3], pack(half, c1[2], c1[3])),
        ]);
    }
}

fn frags(r: &mut Regs, name: &str, count: usize, ty: Ty) -> Vec<[Reg; 4]> {
    (0..count)
        .map(|j| [0, 1, 2, 3].map(|i| r.add(format!("{name}{j}_{i}"), ty)))
        .collect()
}

/// Accumulator fragments (16 rows, `8 acc.len()` columns) times `factor`, then, for the
/// plan's RoPE, rotated back by its transpose: row half `h` (elements `2 h`, `2 h + 1`) at
/// position `pos[h]`. Pairs lie in one lane ([`lane_aligned`]): column `8 cb + 2 q + j` pairs
/// with `+ dim / 2` (half layout: fragment `cb + dim / 16`, same element) or with its
/// neighbour (interleaved: elements `j` = 0 and 1).
fn finish_rows(
    r: &mut Regs,
    plan: &KernelPlan,
    acc: &[[Reg; 4]],
    q: Reg,
    pos: [Expr; 2],
    factor: f32,
) -> Vec<Stmt> {
    let mut out: Vec<Stmt> = acc
        .iter()
        .flatten()
        .map(|&x| Stmt::Set(x, mul(reg(x), f32(factor))))
        .collect();
    let Some(rope) = &plan.rope else {
        return out;
    };
    let first = rope.first_dim as usize;
    let half = (rope.rope.dim / 2) as usize;
    let (c, s, a, b) = (
        r.add("back_cos", Ty::F32),
        r.add("back_sin", Ty::F32),
        r.add("back_a", Ty::F32),
        r.add("back_b", Ty::F32),
    );
    // (a's block, b's block, j of a, j of b, the frequency index at q = 0, its step per q).
    let pairing = rope.rope.layout.pairing(rope.rope.dim);
    let mut pairs = Vec::new();
    for cb in 0..acc.len() {
        let col = 8 * cb;
        if col < first || col >= first + 2 * half {
            continue;
        }
        let (pair, is_first) = pairing.owner(col - first);
        if pairing.adjacent() {
            pairs.push((cb, cb, 0, 1, pair, 1));
        } else if is_first {
            // The block's partner block, `partner` columns on.
            for j in 0..2 {
                pairs.push((cb, cb + pairing.partner / 8, j, j, pair + j, 2));
            }
        }
    }
    for (h, pos) in pos.iter().enumerate() {
        let row = mul(sub(pos.clone(), param("rope_pos0")), i64(4 * half as i64));
        for &(ca, cb, ja, jb, f0, step) in &pairs {
            let f = add(i64(f0 as i64), mul(reg(q), i64(step)));
            let entry = add(row.clone(), mul(f, i64(4)));
            let (ra, rb) = (acc[ca][2 * h + ja], acc[cb][2 * h + jb]);
            let (back_a, back_b) = rotate_pair(reg(a), reg(b), reg(c), un(Un::Neg, reg(s)));
            out.extend([
                Stmt::Set(
                    c,
                    load(
                        Space::Global,
                        Ty::F32,
                        add(param("rope_cos"), entry.clone()),
                    ),
                ),
                Stmt::Set(
                    s,
                    load(Space::Global, Ty::F32, add(param("rope_sin"), entry)),
                ),
                Stmt::Set(a, reg(ra)),
                Stmt::Set(b, reg(rb)),
                Stmt::Set(ra, back_a),
                Stmt::Set(rb, back_b),
            ]);
        }
    }
    out
}

/// Stores row half `h` of accumulator fragments as f32 row `row` of `[.., width]` at `base`.
fn store_rows(acc: &[[Reg; 4]], h: usize, q: Reg, base: Expr, row: Expr) -> Vec<Stmt> {
    let width = 8 * acc.len() as i64;
    let mut out = Vec::new();
    for (cb, frag) in acc.iter().enumerate() {
        for j in 0..2 {
            let col = add(mul(reg(q), i64(2)), i64((8 * cb + j) as i64));
            let addr = add(
                base.clone(),
                mul(add(mul(row.clone(), i64(width)), col), i64(4)),
            );
            out.push(Stmt::Store(Space::Global, addr, reg(frag[2 * h + j])));
        }
    }
    out
}

/// The derivative of the plan's score program with respect to the raw score.
fn score_grad(plan: &KernelPlan) -> &M {
    plan.score_grad
        .as_ref()
        .expect("backward plans have a score derivative")
}

/// `(p, ds)` of one pair: `p = 2^(2 (score - lse_half))`, `ds = p (dp - delta) * d score /
/// d raw`.
fn p_and_ds(plan: &KernelPlan, env: &Env, lse_half: Expr, dp: Expr, delta: Expr) -> (Expr, Expr) {
    let p = exp2_twice(sub(program(&plan.program.score, env), lse_half));
    let ds = mul(
        mul(p.clone(), sub(dp, delta)),
        program(score_grad(plan), env),
    );
    (p, ds)
}

/// The masked and unmasked versions of a tile's element-wise step, chosen by its code.
fn by_code(code: Reg, masked: Vec<Stmt>, kept: Vec<Stmt>) -> Stmt {
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

/// The loop over a CTA's inner tiles: `run` for each tile `t` whose code (from the i32 array
/// `codes`, one per (query head, CTA block, tile)) is not `Skip`, with the code in `code`.
fn tile_loop(
    t: Reg,
    code: Reg,
    head: Reg,
    codes: &str,
    [blocks, tiles]: [Expr; 2],
    run: Vec<Stmt>,
) -> Stmt {
    let index = add(
        mul(
            add(mul(reg(head), blocks), special64(Special::Ctaid(0))),
            tiles.clone(),
        ),
        reg(t),
    );
    Stmt::For {
        reg: t,
        start: i64(0),
        end: tiles,
        step: 1,
        body: vec![
            Stmt::Set(
                code,
                load(Space::Global, Ty::I32, at(param(codes), index, 4)),
            ),
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
    }
}

/// Where one staged tile's rows come from: a tensor (by its parameter name) and whether RoPE
/// rotates them.
struct Source {
    name: &'static str,
    tile: Tile,
    width: usize,
    tensor: &'static str,
    rotated: bool,
}

impl Source {
    /// Q (rotated) and dO, `[d, dv]` wide.
    fn queries(q: Tile, dout: Tile, [d, dv]: [usize; 2]) -> [Source; 2] {
        Source::pair(["q_stage", "do_stage"], ["q", "dout"], [q, dout], [d, dv])
    }

    /// K (rotated) and V, `[d, dv]` wide.
    fn keys(k: Tile, v: Tile, [d, dv]: [usize; 2]) -> [Source; 2] {
        Source::pair(["k_stage", "v_stage"], ["k", "v"], [k, v], [d, dv])
    }

    /// A rotated source and one copied as it is.
    fn pair(
        names: [&'static str; 2],
        tensors: [&'static str; 2],
        tiles: [Tile; 2],
        widths: [usize; 2],
    ) -> [Source; 2] {
        [0, 1].map(|i| Source {
            name: names[i],
            tile: tiles[i],
            width: widths[i],
            tensor: tensors[i],
            rotated: i == 0,
        })
    }
}

/// The rows a staging reads: rows `first + local` (clamped into the parameter `len`, `sq` or
/// `skv`) from row `row0` of each source tensor, at positions `pos(clamped row)`; past `len`,
/// zeros where `bounded`, else the clamped row.
struct RowSpan<'a> {
    row0: Expr,
    first: Expr,
    len: &'static str,
    pos: &'a dyn Fn(Expr) -> Expr,
    bounded: bool,
}

/// Stages `count` rows of each source synchronously ([`stage_rows`]).
fn stage_tiles(
    plan: &KernelPlan,
    r: &mut Regs,
    count: i64,
    sources: [Source; 2],
    span: &RowSpan,
) -> Vec<Stmt> {
    let mut out = Vec::new();
    for s in sources {
        out.extend(stage_rows(
            plan,
            r,
            s.name,
            Staging {
                count,
                width: s.width,
                dst: i64(s.tile.at as i64),
                stride: s.tile.stride,
                qk: forward_tc::qk_half(plan),
                rotated: s.rotated,
                param,
                threads: THREADS,
            },
            |local| {
                let row = add(span.first.clone(), local);
                let clamped = bin(Bin::Min, row.clone(), sub(param(span.len), i64(1)));
                let addr = add(
                    param(s.tensor),
                    mul(
                        add(span.row0.clone(), clamped.clone()),
                        i64(2 * s.width as i64),
                    ),
                );
                let inside = span.bounded.then(|| bin(Bin::Lt, row, param(span.len)));
                (addr, (span.pos)(clamped), inside)
            },
        ));
    }
    out
}

/// Registers `name` set to each `ldmatrix` base address (see [`Tile::a_base`] and
/// [`Tile::b_base`]), in order.
fn ldmatrix_bases<const N: usize>(
    r: &mut Regs,
    body: &mut Vec<Stmt>,
    bases: [(&str, Expr); N],
) -> [Reg; N] {
    bases.map(|(name, e)| {
        let base = r.add(name, Ty::I64);
        body.push(Stmt::Set(base, e));
        base
    })
}

/// Per row half of a `backward_tc_dq` lane: the lse in half base-2 units, D, and whether the
/// row kept any key.
struct RowStats {
    lse_half: [Reg; 2],
    delta: [Reg; 2],
    live: [Reg; 2],
}

impl RowStats {
    /// Loads the stats of the lane's rows `row_of(h)` (clamped into Sq) from the head's row
    /// `head_row0`.
    fn load(
        r: &mut Regs,
        body: &mut Vec<Stmt>,
        head_row0: &Expr,
        row_of: &dyn Fn(usize) -> Expr,
    ) -> RowStats {
        let lse_half = [0, 1].map(|h| r.add(format!("lse_half{h}"), Ty::F32));
        let delta = [0, 1].map(|h| r.add(format!("delta{h}"), Ty::F32));
        let live = [0, 1].map(|h| r.add(format!("live{h}"), Ty::Pred));
        for h in 0..2 {
            let index = add(
                head_row0.clone(),
                bin(Bin::Min, row_of(h), sub(param("sq"), i64(1))),
            );
            body.extend([
                Stmt::Set(
                    lse_half[h],
                    mul(
                        load(Space::Global, Ty::F32, at(param("lse"), index.clone(), 4)),
                        f32(std::f32::consts::LOG2_E / 2.0),
                    ),
                ),
                Stmt::Set(
                    delta[h],
                    load(Space::Global, Ty::F32, at(param("delta"), index, 4)),
                ),
                Stmt::Set(
                    live[h],
                    bin(Bin::Ne, reg(lse_half[h]), f32(f32::NEG_INFINITY)),
                ),
            ]);
        }
        RowStats {
            lse_half,
            delta,
            live,
        }
    }
}

/// A `backward_tc_dq` key tile's products for the lane: `s[nb][i]` (S) and `dp[nb][i]` (dP)
/// for keys `8 nb + 2 q + i % 2` of tile `tile` (`keys` keys), row half `i / 2` (row
/// `row_of(h)` at position `pos_of(row)`).
struct DqScores<'a> {
    s: &'a [[Reg; 4]],
    dp: &'a [[Reg; 4]],
    tile: Reg,
    keys: usize,
    q: Reg,
    batch: Reg,
    head: Reg,
    row_of: &'a dyn Fn(usize) -> Expr,
    pos_of: &'a dyn Fn(Expr) -> Expr,
}

impl DqScores<'_> {
    /// dS in place of S: masked pairs, keys past Skv and rows that kept no key give 0 (the
    /// mask only on tiles of code `Masked`).
    fn ds(&self, plan: &KernelPlan, stats: &RowStats, code: Reg) -> Stmt {
        let scale = plan.q_scale as f32;
        let (s, dp) = (self.s, self.dp);
        let (mut masked, mut kept) = (Vec::new(), Vec::new());
        let keep_mask = !matches!(plan.program.mask, M::Bool(true));
        for nb in 0..self.keys / 8 {
            for i in 0..4 {
                let h = i / 2;
                let key = add(
                    mul(reg(self.tile), i64(self.keys as i64)),
                    add(mul(reg(self.q), i64(2)), i64((8 * nb + i % 2) as i64)),
                );
                let row = (self.row_of)(h);
                let env = Env {
                    score: mul(reg(s[nb][i]), f32(scale)),
                    batch: reg(self.batch),
                    head: reg(self.head),
                    query: (self.pos_of)(row.clone()),
                    key: add(param("p0"), key.clone()),
                    query_index: row,
                    key_index: key.clone(),
                    params: None,
                };
                let (lse, delta, live) = (stats.lse_half[h], stats.delta[h], stats.live[h]);
                let (_, ds) = p_and_ds(plan, &env, reg(lse), reg(dp[nb][i]), reg(delta));
                kept.push(Stmt::Set(s[nb][i], select(reg(live), ds.clone(), f32(0.0))));
                let mut keep = bin(Bin::And, reg(live), bin(Bin::Lt, key, param("skv")));
                if keep_mask {
                    keep = bin(Bin::And, keep, program(&plan.program.mask, &env));
                }
                masked.push(Stmt::Set(s[nb][i], select(keep, ds, f32(0.0))));
            }
        }
        by_code(code, masked, kept)
    }
}

/// A `backward_tc_dkdv` query tile's products for the lane: `st[nb][i]` (S^T) and `dpt[nb][i]`
/// (dP^T) for key half `i / 2` (key `key_of(h)`) and query `8 nb + 2 q + i % 2` of tile `tile`
/// (`queries` queries, at positions `q_pos(query)`), with the tile's lse and D staged in
/// shared memory at `stats`.
struct DkdvScores<'a> {
    st: &'a [[Reg; 4]],
    dpt: &'a [[Reg; 4]],
    tile: Reg,
    queries: usize,
    q: Reg,
    batch: Reg,
    head: Reg,
    key_of: &'a dyn Fn(usize) -> Expr,
    q_pos: &'a dyn Fn(Expr) -> Expr,
    stats: [i64; 2],
}

impl DkdvScores<'_> {
    /// P^T in place of S^T, dS^T in place of dP^T: masked pairs, queries past Sq and rows that
    /// kept no key give 0 (the mask only on tiles of code `Masked`).
    fn p_and_ds(&self, plan: &KernelPlan, r: &mut Regs, code: Reg) -> Stmt {
        let (lse_q, delta_q, live) = (
            r.add("lse_q", Ty::F32),
            r.add("delta_q", Ty::F32),
            r.add("live", Ty::Pred),
        );
        let scale = plan.q_scale as f32;
        let (st, dpt, [lse_sh, delta_sh]) = (self.st, self.dpt, self.stats);
        let (mut masked, mut kept) = (Vec::new(), Vec::new());
        let keep_mask = !matches!(plan.program.mask, M::Bool(true));
        for nb in 0..self.queries / 8 {
            for i in 0..4 {
                let local = add(mul(reg(self.q), i64(2)), i64((8 * nb + i % 2) as i64));
                let query = add(mul(reg(self.tile), i64(self.queries as i64)), local.clone());
                let key = (self.key_of)(i / 2);
                let env = Env {
                    score: mul(reg(st[nb][i]), f32(scale)),
                    batch: reg(self.batch),
                    head: reg(self.head),
                    query: (self.q_pos)(query.clone()),
                    key: add(param("p0"), key.clone()),
                    query_index: query.clone(),
                    key_index: key,
                    params: None,
                };
                let stat = |at: i64| {
                    load(
                        Space::Shared,
                        Ty::F32,
                        add(mul(local.clone(), i64(4)), i64(at)),
                    )
                };
                let stats = [
                    Stmt::Set(lse_q, stat(lse_sh)),
                    Stmt::Set(delta_q, stat(delta_sh)),
                    Stmt::Set(live, bin(Bin::Ne, reg(lse_q), f32(f32::NEG_INFINITY))),
                ];
                let (p, ds) = p_and_ds(plan, &env, reg(lse_q), reg(dpt[nb][i]), reg(delta_q));
                kept.extend(stats.clone());
                kept.extend([
                    Stmt::Set(dpt[nb][i], select(reg(live), ds.clone(), f32(0.0))),
                    Stmt::Set(st[nb][i], select(reg(live), p.clone(), f32(0.0))),
                ]);
                let mut keep = bin(Bin::And, reg(live), bin(Bin::Lt, query, param("sq")));
                if keep_mask {
                    keep = bin(Bin::And, keep, program(&plan.program.mask, &env));
                }
                masked.extend(stats);
                masked.extend([
                    Stmt::Set(dpt[nb][i], select(keep.clone(), ds, f32(0.0))),
                    Stmt::Set(st[nb][i], select(keep, p, f32(0.0))),
                ]);
            }
        }
        by_code(code, masked, kept)
    }
}

/// `ceil(param / n)`.
fn blocks_of(len: &str, n: i64) -> Expr {
    bin(Bin::Div, add(param(len), i64(n - 1)), i64(n))
}

/// `backward_tc_dq`: [`BLOCK`] query rows of one (batch, head) per CTA.
fn dq(plan: &KernelPlan) -> Kernel {
    let (half, qk) = (half_of(plan), forward_tc::qk_half(plan));
    let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    let (hq, hkv) = (i64::from(plan.shape.heads), i64::from(plan.shape.kv_heads));
    let bc = inner_tile(plan) as usize;
    let block = i64::from(BLOCK);
    let scale = plan.q_scale as f32;
    let mut r = Regs { list: Vec::new() };
    let mut body = Vec::new();
    let lane = Lane::new(&mut r, &mut body);
    let (batch, head, kvh) = (
        r.add("batch", Ty::I64),
        r.add("head", Ty::I64),
        r.add("kv_head", Ty::I64),
    );
    body.extend([
        Stmt::Set(batch, special64(Special::Ctaid(2))),
        Stmt::Set(head, special64(Special::Ctaid(1))),
        Stmt::Set(kvh, bin(Bin::Div, reg(head), i64(hq / hkv))),
    ]);
    let first_row = mul(special64(Special::Ctaid(0)), i64(block));
    let row_base = lane.first_row(&mut r, &mut body, "row_base", &first_row);
    // The lane's rows g and g + 8 of its warp's 16. Rows past Sq compute on the last row and
    // are not stored.
    let row_of = |h: usize| add(reg(row_base), i64(8 * h as i64));
    let q_offset = sub(param("skv"), param("sq"));
    let pos_of = |row: Expr| add(add(param("p0"), q_offset.clone()), row);
    let head_row0 = mul(add(mul(reg(batch), i64(hq)), reg(head)), param("sq"));
    let kv_row0 = mul(add(mul(reg(batch), i64(hkv)), reg(kvh)), param("skv"));

    // Shared memory: Q and dO of the CTA's rows, K and V of one key tile.
    let q_t = Tile::new(0, d);
    let do_t = Tile::new(q_t.end(BLOCK as usize), dv);
    let k_t = Tile::new(do_t.end(BLOCK as usize), d);
    let v_t = Tile::new(k_t.end(bc), dv);
    let shared_bytes = v_t.end(bc);

    let sources = Source::queries(q_t, do_t, [d, dv]);
    let span = RowSpan {
        row0: head_row0.clone(),
        first: first_row.clone(),
        len: "sq",
        pos: &pos_of,
        bounded: false,
    };
    body.extend(stage_tiles(plan, &mut r, block, sources, &span));

    let stats = RowStats::load(&mut r, &mut body, &head_row0, &row_of);

    let acc = frags(&mut r, "dq", d / 8, Ty::F32);
    for x in acc.iter().flatten() {
        body.push(Stmt::Set(*x, f32(0.0)));
    }
    let warp_row = mul(reg(lane.warp), i64(16));
    let [q_a, do_a, k_b, v_b, k_bt] = ldmatrix_bases(
        &mut r,
        &mut body,
        [
            ("q_a", q_t.a_base(warp_row.clone())),
            ("do_a", do_t.a_base(warp_row)),
            ("k_b", k_t.b_base()),
            ("v_b", v_t.b_base()),
            ("k_bt", k_t.a_base(i64(0))),
        ],
    );
    let x = Scratch::new(&mut r);

    let (t, code) = (r.add("tile", Ty::I64), r.add("code", Ty::I32));
    let (n_tiles, n_blocks) = (blocks_of("skv", bc as i64), blocks_of("sq", block));

    // Per key tile: every warp is done with the last one; K (rotated) and V staged.
    let mut run = vec![Stmt::Barrier];
    let sources = Source::keys(k_t, v_t, [d, dv]);
    let span = RowSpan {
        row0: kv_row0.clone(),
        first: mul(reg(t), i64(bc as i64)),
        len: "skv",
        pos: &|key| add(param("p0"), key),
        bounded: true,
    };
    run.extend(stage_tiles(plan, &mut r, bc as i64, sources, &span));
    run.push(Stmt::Barrier);

    // S = Q K^T and dP = dO V^T: s[nb][i] and dp[nb][i] for keys 8 nb + 2 q + i % 2, row half
    // i / 2.
    let s = frags(&mut r, "s", bc / 8, Ty::F32);
    let dp = frags(&mut r, "dp", bc / 8, Ty::F32);
    for x in s.iter().chain(&dp).flatten() {
        run.push(Stmt::Set(*x, f32(0.0)));
    }
    mma_rows(&mut run, qk, &s, q_a, k_b, k_t.stride, d, &x);
    mma_rows(&mut run, half, &dp, do_a, v_b, v_t.stride, dv, &x);

    let scores = DqScores {
        s: &s,
        dp: &dp,
        tile: t,
        keys: bc,
        q: lane.q,
        batch,
        head,
        row_of: &row_of,
        pos_of: &pos_of,
    };
    run.push(scores.ds(plan, &stats, code));

    // dQ += dS K.
    let ds_a = frags(&mut r, "ds_a", bc / 16, Ty::I32);
    pack_frags(&mut run, qk, &s, &ds_a);
    mma_frags(&mut run, qk, &acc, &ds_a, k_bt, k_t.stride, &x);

    body.push(tile_loop(
        t,
        code,
        head,
        "dq_codes",
        [n_blocks, n_tiles],
        run,
    ));

    // dq = scale * dS K, rotated back to the unrotated q; rows inside Sq stored.
    body.extend(finish_rows(
        &mut r,
        plan,
        &acc,
        lane.q,
        [0, 1].map(|h| pos_of(bin(Bin::Min, row_of(h), sub(param("sq"), i64(1))))),
        scale,
    ));
    for h in 0..2 {
        let row = add(head_row0.clone(), row_of(h));
        body.push(Stmt::If(
            bin(Bin::Lt, row_of(h), param("sq")),
            store_rows(&acc, h, lane.q, param("dq"), row),
            vec![],
        ));
    }
    kernel("backward_tc_dq", r, shared_bytes, body)
}

/// `backward_tc_dkdv`: [`BLOCK`] keys of one (batch, kv head) per CTA, every query of its
/// group's heads.
fn dkdv(plan: &KernelPlan) -> Kernel {
    let (half, qk) = (half_of(plan), forward_tc::qk_half(plan));
    let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    let (hq, hkv) = (i64::from(plan.shape.heads), i64::from(plan.shape.kv_heads));
    let group = hq / hkv;
    let bq = inner_tile(plan) as usize;
    let block = i64::from(BLOCK);
    let mut r = Regs { list: Vec::new() };
    let mut body = Vec::new();
    let lane = Lane::new(&mut r, &mut body);
    let (batch, kvh) = (r.add("batch", Ty::I64), r.add("kv_head", Ty::I64));
    body.extend([
        Stmt::Set(batch, special64(Special::Ctaid(2))),
        Stmt::Set(kvh, special64(Special::Ctaid(1))),
    ]);
    let first_key = mul(special64(Special::Ctaid(0)), i64(block));
    let key_base = lane.first_row(&mut r, &mut body, "key_base", &first_key);
    // The lane's keys g and g + 8 of its warp's 16; keys past Skv compute on the last key and
    // are not stored.
    let key_of = |h: usize| add(reg(key_base), i64(8 * h as i64));
    let kv_row0 = mul(add(mul(reg(batch), i64(hkv)), reg(kvh)), param("skv"));
    let q_offset = sub(param("skv"), param("sq"));
    let q_pos = |row: Expr| add(add(param("p0"), q_offset.clone()), row);

    // Shared memory: K and V of the CTA's keys; Q, dO, lse (half base 2) and D of one query
    // tile.
    let k_t = Tile::new(0, d);
    let v_t = Tile::new(k_t.end(BLOCK as usize), dv);
    let q_t = Tile::new(v_t.end(BLOCK as usize), d);
    let do_t = Tile::new(q_t.end(bq), dv);
    let lse_sh = do_t.end(bq);
    let delta_sh = lse_sh + 4 * bq;
    let shared_bytes = delta_sh + 4 * bq;

    let sources = Source::keys(k_t, v_t, [d, dv]);
    let span = RowSpan {
        row0: kv_row0.clone(),
        first: first_key.clone(),
        len: "skv",
        pos: &|key| add(param("p0"), key),
        bounded: false,
    };
    body.extend(stage_tiles(plan, &mut r, block, sources, &span));

    let dk = frags(&mut r, "dk", d / 8, Ty::F32);
    let dva = frags(&mut r, "dv", dv / 8, Ty::F32);
    for x in dk.iter().chain(&dva).flatten() {
        body.push(Stmt::Set(*x, f32(0.0)));
    }
    let warp_row = mul(reg(lane.warp), i64(16));
    let [k_a, v_a, q_b, do_b, q_bt, do_bt] = ldmatrix_bases(
        &mut r,
        &mut body,
        [
            ("k_a", k_t.a_base(warp_row.clone())),
            ("v_a", v_t.a_base(warp_row)),
            ("q_b", q_t.b_base()),
            ("do_b", do_t.b_base()),
            ("q_bt", q_t.a_base(i64(0))),
            ("do_bt", do_t.a_base(i64(0))),
        ],
    );
    let x = Scratch::new(&mut r);

    let (h, head, t, code) = (
        r.add("h", Ty::I64),
        r.add("head", Ty::I64),
        r.add("tile", Ty::I64),
        r.add("code", Ty::I32),
    );
    let head_row0 = mul(add(mul(reg(batch), i64(hq)), reg(head)), param("sq"));
    let (n_tiles, n_blocks) = (blocks_of("sq", bq as i64), blocks_of("skv", block));

    // Per query tile: every warp is done with the last one; Q (rotated), dO, lse and D staged.
    let mut run = vec![Stmt::Barrier];
    let sources = Source::queries(q_t, do_t, [d, dv]);
    let span = RowSpan {
        row0: head_row0.clone(),
        first: mul(reg(t), i64(bq as i64)),
        len: "sq",
        pos: &q_pos,
        bounded: true,
    };
    run.extend(stage_tiles(plan, &mut r, bq as i64, sources, &span));
    run.push(super::backward::stage_row_stats(
        param,
        bq as i64,
        mul(reg(t), i64(bq as i64)),
        head_row0.clone(),
        [lse_sh as i64, delta_sh as i64],
    ));
    run.push(Stmt::Barrier);

    // S^T = K Q^T and dP^T = V dO^T: st[nb][i] and dpt[nb][i] for key half i / 2 and query
    // 8 nb + 2 q + i % 2 of the tile.
    let st = frags(&mut r, "st", bq / 8, Ty::F32);
    let dpt = frags(&mut r, "dpt", bq / 8, Ty::F32);
    for x in st.iter().chain(&dpt).flatten() {
        run.push(Stmt::Set(*x, f32(0.0)));
    }
    mma_rows(&mut run, qk, &st, k_a, q_b, q_t.stride, d, &x);
    mma_rows(&mut run, half, &dpt, v_a, do_b, do_t.stride, dv, &x);

    // P^T in place of S^T, dS^T in place of dP^T: masked pairs, queries past Sq and rows that
    // kept no key give 0.
    let scores = DkdvScores {
        st: &st,
        dpt: &dpt,
        tile: t,
        queries: bq,
        q: lane.q,
        batch,
        head,
        key_of: &key_of,
        q_pos: &q_pos,
        stats: [lse_sh as i64, delta_sh as i64],
    };
    run.push(scores.p_and_ds(plan, &mut r, code));

    // dV += P^T dO and dK += dS^T Q.
    let p_a = frags(&mut r, "p_a", bq / 16, Ty::I32);
    pack_frags(&mut run, half, &st, &p_a);
    mma_frags(&mut run, half, &dva, &p_a, do_bt, do_t.stride, &x);
    pack_frags(&mut run, qk, &dpt, &p_a);
    mma_frags(&mut run, qk, &dk, &p_a, q_bt, q_t.stride, &x);

    let per_head = vec![
        Stmt::Set(head, add(mul(reg(kvh), i64(group)), reg(h))),
        tile_loop(t, code, head, "dkdv_codes", [n_blocks, n_tiles], run),
    ];
    body.push(Stmt::For {
        reg: h,
        start: i64(0),
        end: i64(group),
        step: 1,
        body: per_head,
    });

    body.extend(store_dkdv(
        &mut r,
        plan,
        [&dk, &dva],
        lane.q,
        &kv_row0,
        &key_of,
    ));
    kernel("backward_tc_dkdv", r, shared_bytes, body)
}

/// dk = scale * dS^T Q, rotated back to the unrotated k; dv as it is; the lane's keys
/// `key_of(h)` inside Skv stored (at `kv_row0` plus the key).
fn store_dkdv(
    r: &mut Regs,
    plan: &KernelPlan,
    [dk, dv]: [&[[Reg; 4]]; 2],
    q: Reg,
    kv_row0: &Expr,
    key_of: &dyn Fn(usize) -> Expr,
) -> Vec<Stmt> {
    let last_key = sub(param("skv"), i64(1));
    let pos = [0, 1].map(|h| add(param("p0"), bin(Bin::Min, key_of(h), last_key.clone())));
    let mut body = finish_rows(r, plan, dk, q, pos, plan.q_scale as f32);
    for h in 0..2 {
        let row = add(kv_row0.clone(), key_of(h));
        let mut store = store_rows(dk, h, q, param("dk"), row.clone());
        store.extend(store_rows(dv, h, q, param("dv"), row));
        body.push(Stmt::If(
            bin(Bin::Lt, key_of(h), param("skv")),
            store,
            vec![],
        ));
    }
    body
}
