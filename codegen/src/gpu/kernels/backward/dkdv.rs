//! `backward_dkdv`: dK and dV, one thread per key row, over the heads of its GQA group and the\n//! query tiles the mask keeps.

use super::shared::{
    Pair, ROWS, Rotation, Stage, axpy_shared, dot_shared, f32_regs, kernel, load_rotated_row,
    load_row, param, param_buffer, probabilities, stage, stage_row_stats, store_row,
};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Reg, Space, Special, Stmt, Ty};
use crate::gpu::kernels::forward::key_tile;
use crate::gpu::kernels::{Env, Regs, Side, rope_params, rotate, special64};
use crate::plan::KernelPlan;

/// `backward_dkdv`: one key per thread, every query of its group's heads.
pub(super) fn dkdv(plan: &KernelPlan) -> Kernel {
    let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
    let bq = i64::from(key_tile(plan));
    let mut r = Regs { list: Vec::new() };
    let (row, mut body) = KeyRow::load(plan, &mut r);
    body.push(row.query_tiles(plan, &mut r));
    body.push(row.store(plan, &mut r));
    kernel("backward_dkdv", r, bq * (d + dv + 2) * 4, body)
}

/// A thread's key in `backward_dkdv`: where it is (keys past Skv compute on the last key,
/// `krow`; their results are not stored), its position and index in the call, its k (rotated)
/// and v, and the dk and dv accumulators.
pub(super) struct KeyRow {
    pub(super) row: Reg,
    pub(super) batch: Reg,
    pub(super) kvh: Reg,
    pub(super) krow: Reg,
    pub(super) kpos: Reg,
    pub(super) index: Reg,
    pub(super) k: Vec<Reg>,
    pub(super) v: Vec<Reg>,
    pub(super) dk: Vec<Reg>,
    pub(super) dv: Vec<Reg>,
}

impl KeyRow {
    /// The key's registers, and the statements that load it.
    pub(super) fn load(plan: &KernelPlan, r: &mut Regs) -> (KeyRow, Vec<Stmt>) {
        let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
        let hkv = i64::from(plan.shape.kv_heads);
        let (row, batch, kvh) = (
            r.add("key_row", Ty::I64),
            r.add("batch", Ty::I64),
            r.add("kv_head", Ty::I64),
        );
        let mut body = vec![
            Stmt::Set(
                row,
                add(
                    mul(special64(Special::Ctaid(0)), i64(i64::from(ROWS))),
                    special64(Special::Tid),
                ),
            ),
            Stmt::Set(batch, special64(Special::Ctaid(2))),
            Stmt::Set(kvh, special64(Special::Ctaid(1))),
        ];
        let (krow, kpos, index) = (
            r.add("k_row", Ty::I64),
            r.add("k_pos", Ty::I64),
            r.add("k_index", Ty::I64),
        );
        body.extend([
            Stmt::Set(krow, bin(Bin::Min, reg(row), sub(param("skv"), i64(1)))),
            Stmt::Set(kpos, add(param("p0"), reg(krow))),
            Stmt::Set(
                index,
                add(
                    mul(add(mul(reg(batch), i64(hkv)), reg(kvh)), param("skv")),
                    reg(krow),
                ),
            ),
        ]);
        let k = f32_regs(r, "k", d);
        let v = f32_regs(r, "v", dv);
        let dk = f32_regs(r, "dk", d);
        let dvr = f32_regs(r, "dv", dv);
        body.extend(load_rotated_row(
            r,
            plan,
            &k,
            (param("k"), reg(index)),
            (reg(kpos), Side::Key),
        ));
        body.extend(load_row(&v, param("v"), reg(index)));
        body.extend(dk.iter().chain(&dvr).map(|&a| Stmt::Set(a, f32(0.0))));
        let key = KeyRow {
            row,
            batch,
            kvh,
            krow,
            kpos,
            index,
            k,
            v,
            dk,
            dv: dvr,
        };
        (key, body)
    }

    /// The loops over the group's heads and their query tiles: each tile staged in shared
    /// memory (Q `[bq][d]` rotated and scaled, dO `[bq][dv]`, lse in half base 2 and D per
    /// row), then per query `p`, `ds`, `dv += p dO` and `dk += ds q`.
    fn query_tiles(&self, plan: &KernelPlan, r: &mut Regs) -> Stmt {
        let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
        let (hq, hkv) = (i64::from(plan.shape.heads), i64::from(plan.shape.kv_heads));
        let group = hq / hkv;
        let bq = i64::from(key_tile(plan));
        let (q_sh, do_sh) = (0, bq * d * 4);
        let lse_sh = do_sh + bq * dv * 4;
        let delta_sh = lse_sh + bq * 4;
        let (h, head, t, i, qi) = (
            r.add("h", Ty::I64),
            r.add("head", Ty::I64),
            r.add("tile", Ty::I64),
            r.add("i", Ty::I64),
            r.add("query", Ty::I64),
        );
        let (s, dp, p, ds, keep) = (
            r.add("s", Ty::F32),
            r.add("dp", Ty::F32),
            r.add("p", Ty::F32),
            r.add("ds", Ty::F32),
            r.add("keep", Ty::Pred),
        );
        let first = mul(reg(t), i64(bq));
        let head_row0 = mul(add(mul(reg(self.batch), i64(hq)), reg(head)), param("sq"));
        let q_offset = sub(param("skv"), param("sq"));
        let q_pos = |row: Expr| add(add(param("p0"), q_offset.clone()), row);
        let mut tile = self.stage_queries(plan, r, head, first.clone());
        // lse (half base 2) and D of the tile's rows, by threads 0..bq.
        tile.push(stage_row_stats(
            param,
            bq,
            first.clone(),
            head_row0,
            [lse_sh, delta_sh],
        ));
        tile.push(Stmt::Barrier);
        let row_stat = |at: i64| load(Space::Shared, Ty::F32, add(mul(reg(i), i64(4)), i64(at)));
        let (lse_i, delta_i) = (row_stat(lse_sh), row_stat(delta_sh));
        let pair = Pair {
            env: Env {
                score: reg(s),
                batch: reg(self.batch),
                head: reg(head),
                query: q_pos(reg(qi)),
                key: reg(self.kpos),
                query_index: reg(qi),
                key_index: reg(self.krow),
                params: param_buffer(plan),
            },
            inside: bin(
                Bin::And,
                bin(Bin::Lt, reg(qi), param("sq")),
                bin(Bin::Ne, lse_i.clone(), f32(f32::NEG_INFINITY)),
            ),
        };
        let (set_keep, [pv, dsv, _]) = probabilities(plan, &pair, keep, lse_i, reg(dp), delta_i);
        let q_at = add(mul(reg(i), i64(d * 4)), i64(q_sh));
        let do_at = add(mul(reg(i), i64(dv * 4)), i64(do_sh));
        let mut per_query = vec![
            Stmt::Set(qi, add(first, reg(i))),
            Stmt::Set(s, dot_shared(&self.k, q_at.clone())),
            Stmt::Set(dp, dot_shared(&self.v, do_at.clone())),
            set_keep,
            Stmt::Set(p, pv),
            Stmt::Set(ds, dsv),
        ];
        per_query.extend(axpy_shared(&self.dv, reg(p), do_at));
        per_query.extend(axpy_shared(&self.dk, reg(ds), q_at));
        tile.push(Stmt::For {
            reg: i,
            start: i64(0),
            end: i64(bq),
            step: 1,
            body: per_query,
        });
        tile.push(Stmt::Barrier);
        let per_head = vec![
            Stmt::Set(head, add(mul(reg(self.kvh), i64(group)), reg(h))),
            Stmt::For {
                reg: t,
                start: i64(0),
                end: bin(Bin::Div, add(param("sq"), i64(bq - 1)), i64(bq)),
                step: 1,
                body: tile,
            },
        ];
        Stmt::For {
            reg: h,
            start: i64(0),
            end: i64(group),
            step: 1,
            body: per_head,
        }
    }

    /// Q rows `first..first + bq` of head `head` (rotated and scaled) staged in shared memory
    /// at 0 (`[bq][d]`), and dO's after them (`[bq][dv]`); zeros past Sq. No barrier.
    pub(super) fn stage_queries(
        &self,
        plan: &KernelPlan,
        r: &mut Regs,
        head: Reg,
        first: Expr,
    ) -> Vec<Stmt> {
        let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
        let hq = i64::from(plan.shape.heads);
        let bq = i64::from(key_tile(plan));
        let head_row0 = mul(add(mul(reg(self.batch), i64(hq)), reg(head)), param("sq"));
        let q_offset = sub(param("skv"), param("sq"));
        let q_pos = |row: Expr| add(add(param("p0"), q_offset.clone()), row);
        let q_tmp = f32_regs(r, "q", d);
        let mut tile = stage(
            r,
            plan,
            Stage {
                base: add(param("q"), mul(head_row0.clone(), i64(d * 4))),
                first: first.clone(),
                count: param("sq"),
                width: d,
                tile: bq,
                shared: 0,
                factor: plan.q_scale as f32,
                rotation: Some(Rotation {
                    tmp: &q_tmp,
                    pos: &q_pos,
                    side: Side::Query,
                }),
            },
        );
        tile.extend(stage(
            r,
            plan,
            Stage {
                base: add(param("dout"), mul(head_row0, i64(dv * 4))),
                first,
                count: param("sq"),
                width: dv,
                tile: bq,
                shared: bq * d * 4,
                factor: 1.0,
                rotation: None,
            },
        ));
        tile
    }

    /// dk back to the unrotated k; both stored, for keys inside Skv.
    pub(super) fn store(&self, plan: &KernelPlan, r: &mut Regs) -> Stmt {
        let mut store = Vec::new();
        if let Some(rope) = &plan.rope {
            let tables = rope_params(param, Side::Key);
            store.extend(rotate(r, rope, &self.dk, reg(self.kpos), &tables, true));
        }
        store.extend(store_row(&self.dk, param("dk"), reg(self.index)));
        store.extend(store_row(&self.dv, param("dv"), reg(self.index)));
        Stmt::If(bin(Bin::Lt, reg(self.row), param("skv")), store, vec![])
    }
}
