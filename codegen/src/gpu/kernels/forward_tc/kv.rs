//! K and V tiles staged from global into shared memory for the tensor-core forward: `cp.async`
//! copies issued a tile ahead, K rotated by RoPE in shared memory where the plan asks.

use super::*;
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Half, Reg, Space, Special, Stmt, Ty, Un};
use crate::gpu::kernels::{
    Regs, RopeWords, Side, Staging, half_of, param, rotate_pair, special64, stage_rows, table_names,
};
use crate::plan::{KernelPlan, TileCode};

impl<'a> Forward<'a> {
    /// The copies of a tile's rows (of K, V, or the RoPE tables): 16-byte chunks, chunk
    /// c = tid + THREADS i. A tile inside Skv copies without the clamp and the zero fill, every
    /// copy of a thread an offset from one source and one destination address; a last, partial
    /// tile (`bounded`) zero-fills rows past Skv.
    fn copies(
        &self,
        [copy_src, copy_dst]: [Reg; 2],
        tile: &Expr,
        rows: &TileRows,
        bounded: bool,
    ) -> Vec<Stmt> {
        let tid = special64(Special::Tid);
        let (bc, bc64) = (self.bc, self.bc as i64);
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
    }

    /// Issues the copies of `regions` of tile `tile` (without bounds inside Skv) and commits
    /// them as one group.
    fn issue(&self, copy: [Reg; 2], tile: Expr, regions: &[TileRows]) -> Vec<Stmt> {
        let inside = bin(
            Bin::Le,
            mul(add(tile.clone(), i64(1)), i64(self.bc as i64)),
            param("skv"),
        );
        let (mut full, mut bounded) = (Vec::new(), Vec::new());
        for rows in regions {
            full.extend(self.copies(copy, &tile, rows, false));
            bounded.extend(self.copies(copy, &tile, rows, true));
        }
        vec![Stmt::If(inside, full, bounded), Stmt::CpAsyncCommit]
    }

    /// Rows of the K or V tile (`name`), `width` columns, to `dst`.
    fn kv_rows(&self, name: &str, width: usize, dst: usize, stride: usize) -> TileRows {
        TileRows {
            src: add(param(name), mul(self.kv_base(), i64(2 * width as i64))),
            row_bytes: 2 * width,
            dst,
            stride,
        }
    }

    /// A K tile's copies: its rows and, with RoPE rotated in shared memory, its cos and sin
    /// rows.
    fn issue_k(&self, copy: [Reg; 2], tile: Expr) -> Vec<Stmt> {
        let sh = &self.sh;
        let mut regions = vec![self.kv_rows("k", self.d, sh.k, sh.k_stride)];
        if let Some(half) = sh.rope_half {
            // Table row of key j: its position p0 + j less the tables' first position.
            let [cos, sin] = table_names(Side::Key);
            for (name, dst) in [(cos, sh.cos), (sin, sh.sin)] {
                regions.push(TileRows {
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
        self.issue(copy, tile, &regions)
    }

    /// A V tile's copies.
    fn issue_v(&self, copy: [Reg; 2], tile: Expr) -> Vec<Stmt> {
        let sh = &self.sh;
        self.issue(copy, tile, &[self.kv_rows("v", self.dv, sh.v, sh.v_stride)])
    }

    /// Whether K arrives by `cp.async` (else it is staged, rotated, synchronously).
    fn k_async(&self) -> bool {
        self.plan.rope.is_none() || self.sh.rope_half.is_some()
    }

    /// The tile's K in shared memory (rotated by RoPE) and visible to every warp, and V's
    /// copies in flight.
    pub(super) fn load_kv(&self, r: &mut Regs, tiles: &TileLoop, copy: [Reg; 2]) -> Vec<Stmt> {
        let (t, bc64, d) = (tiles.tile, self.bc as i64, self.d);
        let mut run = Vec::new();
        if self.k_async() {
            run.push(Stmt::If(
                un(Un::Not, reg(tiles.k_issued)),
                self.issue_k(copy, reg(t)),
                vec![],
            ));
        } else {
            let kv_base = self.kv_base();
            run.extend(stage_rows(
                self.plan,
                r,
                "k_stage",
                Staging {
                    count: bc64,
                    width: d,
                    dst: i64(self.sh.k as i64),
                    stride: self.sh.k_stride,
                    qk: self.qk,
                    rotation: Some(Side::Key),
                    param,
                    threads: THREADS,
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
        if let Some(half) = self.sh.rope_half {
            // Rows a tile can hold: `bc`, or all the keys when there are fewer.
            let keys = bin(Bin::Min, i64(bc64), param("skv"));
            let sh = &self.sh;
            let at = [sh.k, sh.k_stride, sh.cos, sh.sin];
            run.extend(rotate_k(self.plan, self.qk, r, half, at, keys));
            run.extend(self.issue_v(copy, reg(t)));
            run.push(Stmt::Barrier);
        } else {
            run.extend(self.issue_v(copy, reg(t)));
        }
        run
    }

    /// V has landed and every warp is done with K: the next tile's K copies fly during P V
    /// (where that tile runs).
    pub(super) fn prefetch_next_k(&self, tiles: &TileLoop, copy: [Reg; 2]) -> Vec<Stmt> {
        let mut run = vec![Stmt::CpAsyncWait(0), Stmt::Barrier];
        if !self.k_async() {
            return run;
        }
        let (next, n_tiles) = (add(reg(tiles.tile), i64(1)), self.n_tiles());
        let skip = Expr::Int(TileCode::Skip as i64, Ty::I32);
        run.push(Stmt::Set(
            tiles.next_code,
            select(
                bin(Bin::Lt, next.clone(), n_tiles.clone()),
                self.code_of(bin(Bin::Min, next.clone(), sub(n_tiles, i64(1)))),
                skip.clone(),
            ),
        ));
        run.push(Stmt::Set(
            tiles.k_issued,
            bin(Bin::Ne, reg(tiles.next_code), skip),
        ));
        run.push(Stmt::If(
            reg(tiles.k_issued),
            self.issue_k(copy, next),
            vec![],
        ));
        run
    }
}

/// Rows of a tile that `cp.async` copies: the source address of key 0's row (key `j`'s is
/// `row_bytes j` on), and where they go in shared memory.
struct TileRows {
    src: Expr,
    row_bytes: usize,
    dst: usize,
    stride: usize,
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
