//! `backward_tc_dkdv`: dK and dV for a CTA of [`BLOCK`] keys, per head of the GQA group and query\n//! tile the mask keeps.

use super::shared::{
    BLOCK, Lane, RowSpan, Scratch, Source, Tile, blocks_of, by_code, finish_rows, frags,
    inner_tile, kernel, ldmatrix_bases, mma_frags, mma_rows, p_and_ds, pack_frags, param,
    stage_tiles, store_rows, tile_loop,
};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Reg, Space, Special, Stmt, Ty};
use crate::gpu::kernels::forward_tc;
use crate::gpu::kernels::half_of;
use crate::gpu::kernels::{Env, Regs, Side, program, special64};
use crate::plan::KernelPlan;
use attn_dsl::modifier::Expr as M;

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

/// `backward_tc_dkdv`: [`BLOCK`] keys of one (batch, kv head) per CTA, every query of its
/// group's heads.
pub(super) fn dkdv(plan: &KernelPlan) -> Kernel {
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
    run.push(crate::gpu::kernels::backward::stage_row_stats(
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
    let mut body = finish_rows(r, plan, dk, q, (pos, Side::Key), plan.q_scale as f32);
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
