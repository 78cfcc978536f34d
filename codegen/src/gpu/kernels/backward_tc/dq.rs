//! `backward_tc_dq`: dQ for a CTA of [`BLOCK`] query rows, per key tile the mask keeps.

use super::shared::{
    BLOCK, Lane, RowSpan, RowStats, Scratch, Source, Tile, blocks_of, by_code, finish_rows, frags,
    inner_tile, kernel, ldmatrix_bases, mma_frags, mma_rows, p_and_ds, pack_frags, param,
    stage_tiles, store_rows, tile_loop,
};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Reg, Special, Stmt, Ty};
use crate::gpu::kernels::forward_tc;
use crate::gpu::kernels::half_of;
use crate::gpu::kernels::{Env, Regs, Side, program, special64};
use crate::plan::KernelPlan;
use attn_dsl::modifier::Expr as M;

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

/// `backward_tc_dq`: [`BLOCK`] query rows of one (batch, head) per CTA.
pub(super) fn dq(plan: &KernelPlan) -> Kernel {
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
        (
            [0, 1].map(|h| pos_of(bin(Bin::Min, row_of(h), sub(param("sq"), i64(1))))),
            Side::Query,
        ),
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
