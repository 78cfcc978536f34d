//! What the tensor-core backward's kernels share: the delta kernel, lanes, tiles and scratch of
//! `mma.sync` fragments, the row statistics, and K, V, Q and dO tiles staged in shared memory.

use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Half, Kernel, Reg, Space, Special, Stmt, Ty, Un};
use crate::gpu::kernels::forward_tc;
use crate::gpu::kernels::{
    Env, Regs, Side, exp2_twice, program, rotate_pair, sigmoid_slope, sigmoid_weight, special64,
    table_names,
};
use crate::gpu::kernels::{Staging, half_of, lane_aligned, stage_rows};
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

pub(super) fn param(name: &str) -> Expr {
    Expr::Param(BackwardTcArgs::position(name))
}

/// Whether the plan's backward runs on these kernels: a per-head backward plan in bf16 or f16,
/// both head dims multiples of 16 up to [`MAX_DIM`], RoPE pairs within one lane.
pub fn supports(plan: &KernelPlan) -> bool {
    let (d, dv) = (plan.shape.qk_dim, plan.shape.v_dim);
    plan.kind == PlanKind::Backward
        && matches!(plan.dtype, DType::Bf16 | DType::F16)
        && plan.mla.is_none()
        // Stick-breaking's weights are taken by the SIMT kernels only.
        && !plan.stick_breaking()
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
        query_shift: 0,
        batch: Interval::new(0, b.max(1) as i64 - 1),
        head: Interval::point(head as i64),
        data: None,
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

pub(super) fn kernel(name: &str, r: Regs, shared_bytes: usize, body: Vec<Stmt>) -> Kernel {
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
pub(super) fn delta(plan: &KernelPlan) -> Kernel {
    let (r, body) =
        crate::gpu::kernels::backward::delta_body(plan, param, Some(half_of(plan)), THREADS);
    kernel("backward_tc_delta", r, 0, body)
}

/// A lane's place in its warp and CTA.
pub(super) struct Lane {
    /// `lane / 4`: the fragment row (and B column) group.
    pub(super) g: Reg,
    /// `lane % 4`: the thread in the group.
    pub(super) q: Reg,
    pub(super) warp: Reg,
}

impl Lane {
    pub(super) fn new(r: &mut Regs, body: &mut Vec<Stmt>) -> Lane {
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
    pub(super) fn first_row(
        &self,
        r: &mut Regs,
        body: &mut Vec<Stmt>,
        name: &str,
        first: &Expr,
    ) -> Reg {
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
pub(super) struct Tile {
    pub(super) at: usize,
    pub(super) stride: usize,
}

impl Tile {
    /// Rows of `width` 16-bit values, padded by 16 bytes so the eight rows an `ldmatrix` reads
    /// fall in different banks.
    pub(super) fn new(at: usize, width: usize) -> Tile {
        Tile {
            at,
            stride: 2 * width + 16,
        }
    }

    /// One past its last byte, for `rows` rows.
    pub(super) fn end(self, rows: usize) -> usize {
        self.at + rows * self.stride
    }

    /// This lane's `ldmatrix` row address for A fragments of the 16 rows from `row0` (matrix
    /// `i = lane / 8` is rows `8 (i % 2)..`, columns `8 (i / 2)..`: registers 0..4 are the A
    /// fragment of a 16 x 16 block; the next block of columns is 32 bytes on), or, with `row0`
    /// 0, for transposed B fragments over the tile's rows (matrix `i` is rows `8 (i % 2)..`,
    /// columns `8 (i / 2)..`, so registers (0, 1) are column block `cb` and (2, 3) `cb + 1`;
    /// the next 16 rows are `16 stride` on, the next column block 16 bytes).
    pub(super) fn a_base(self, row0: Expr) -> Expr {
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
    pub(super) fn b_base(self) -> Expr {
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
pub(super) struct Scratch {
    pub(super) a: [Reg; 4],
    pub(super) b: [Reg; 4],
}

impl Scratch {
    pub(super) fn new(r: &mut Regs) -> Scratch {
        Scratch {
            a: [0, 1, 2, 3].map(|i| r.add(format!("am{i}"), Ty::I32)),
            b: [0, 1, 2, 3].map(|i| r.add(format!("bm{i}"), Ty::I32)),
        }
    }
}

/// `c[nb] += A B^T` over `kdim` columns: A the 16 rows at `a` (an [`Tile::a_base`] register),
/// B the `8 c.len()` rows of a tile at `b` ([`Tile::b_base`]) `b_stride` bytes apart.
#[allow(clippy::too_many_arguments)] // one product's operands
pub(super) fn mma_rows(
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
pub(super) fn mma_frags(
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
pub(super) fn pack_frags(out: &mut Vec<Stmt>, half: Half, c: &[[Reg; 4]], a: &[[Reg; 4]]) {
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

pub(super) fn frags(r: &mut Regs, name: &str, count: usize, ty: Ty) -> Vec<[Reg; 4]> {
    (0..count)
        .map(|j| [0, 1, 2, 3].map(|i| r.add(format!("{name}{j}_{i}"), ty)))
        .collect()
}

/// Accumulator fragments (16 rows, `8 acc.len()` columns, of operand `side`) times
/// `factor`, then, for the plan's RoPE, rotated back by its transpose: row half `h` (elements
/// `2 h`, `2 h + 1`) at position `pos[h]`. Pairs lie in one lane ([`lane_aligned`]): column `8 cb + 2 q + j` pairs
/// with `+ dim / 2` (half layout: fragment `cb + dim / 16`, same element) or with its
/// neighbour (interleaved: elements `j` = 0 and 1).
pub(super) fn finish_rows(
    r: &mut Regs,
    plan: &KernelPlan,
    acc: &[[Reg; 4]],
    q: Reg,
    (pos, side): ([Expr; 2], Side),
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
    let [cos, sin] = table_names(side);
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
                    load(Space::Global, Ty::F32, add(param(cos), entry.clone())),
                ),
                Stmt::Set(s, load(Space::Global, Ty::F32, add(param(sin), entry))),
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
pub(super) fn store_rows(acc: &[[Reg; 4]], h: usize, q: Reg, base: Expr, row: Expr) -> Vec<Stmt> {
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
/// d raw`. Under `normalize = sigmoid`: `p = sigmoid(score)` and `ds = dp p (1 - p) * d score
/// / d raw`, with no row term.
pub(super) fn p_and_ds(
    plan: &KernelPlan,
    env: &Env,
    lse_half: Expr,
    dp: Expr,
    delta: Expr,
) -> (Expr, Expr) {
    let score = program(&plan.program.score, env);
    let (p, ds_final) = match plan.sigmoid() {
        true => (sigmoid_weight(score.clone()), mul(dp, sigmoid_slope(score))),
        false => {
            let p = exp2_twice(sub(score, lse_half));
            (p.clone(), mul(p, sub(dp, delta)))
        }
    };
    (p, mul(ds_final, program(score_grad(plan), env)))
}

/// The masked and unmasked versions of a tile's element-wise step, chosen by its code.
pub(super) fn by_code(code: Reg, masked: Vec<Stmt>, kept: Vec<Stmt>) -> Stmt {
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
pub(super) fn tile_loop(
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
pub(super) struct Source {
    pub(super) name: &'static str,
    pub(super) tile: Tile,
    pub(super) width: usize,
    pub(super) tensor: &'static str,
    /// Which operand the rows are, when RoPE rotates them (`None`: copied as they are).
    pub(super) rotation: Option<Side>,
}

impl Source {
    /// Q (rotated) and dO, `[d, dv]` wide.
    pub(super) fn queries(q: Tile, dout: Tile, [d, dv]: [usize; 2]) -> [Source; 2] {
        Source::pair(
            ["q_stage", "do_stage"],
            ["q", "dout"],
            [q, dout],
            [d, dv],
            Side::Query,
        )
    }

    /// K (rotated) and V, `[d, dv]` wide.
    pub(super) fn keys(k: Tile, v: Tile, [d, dv]: [usize; 2]) -> [Source; 2] {
        Source::pair(
            ["k_stage", "v_stage"],
            ["k", "v"],
            [k, v],
            [d, dv],
            Side::Key,
        )
    }

    /// A rotated source (operand `side`) and one copied as it is.
    fn pair(
        names: [&'static str; 2],
        tensors: [&'static str; 2],
        tiles: [Tile; 2],
        widths: [usize; 2],
        side: Side,
    ) -> [Source; 2] {
        [0, 1].map(|i| Source {
            name: names[i],
            tile: tiles[i],
            width: widths[i],
            tensor: tensors[i],
            rotation: (i == 0).then_some(side),
        })
    }
}

/// The rows a staging reads: rows `first + local` (clamped into the parameter `len`, `sq` or
/// `skv`) from row `row0` of each source tensor, at positions `pos(clamped row)`; past `len`,
/// zeros where `bounded`, else the clamped row.
pub(super) struct RowSpan<'a> {
    pub(super) row0: Expr,
    pub(super) first: Expr,
    pub(super) len: &'static str,
    pub(super) pos: &'a dyn Fn(Expr) -> Expr,
    pub(super) bounded: bool,
}

/// Stages `count` rows of each source synchronously ([`stage_rows`]).
pub(super) fn stage_tiles(
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
                rotation: s.rotation,
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
pub(super) fn ldmatrix_bases<const N: usize>(
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
pub(super) struct RowStats {
    pub(super) lse_half: [Reg; 2],
    pub(super) delta: [Reg; 2],
    pub(super) live: [Reg; 2],
}

impl RowStats {
    /// Loads the stats of the lane's rows `row_of(h)` (clamped into Sq) from the head's row
    /// `head_row0`.
    pub(super) fn load(
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

/// `ceil(param / n)`.
pub(super) fn blocks_of(len: &str, n: i64) -> Expr {
    bin(Bin::Div, add(param(len), i64(n - 1)), i64(n))
}
