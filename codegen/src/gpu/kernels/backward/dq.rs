//! `backward_dq`: dQ, one thread per query row, over the key tiles the mask keeps.

use super::shared::{
    Pair, ParamPartials, ROWS, Rotation, Stage, axpy_shared, dot_shared, f32_regs, kernel,
    load_rotated_row, load_row, param, param_buffer, probabilities, stage, store_row,
};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Reg, Space, Special, Stmt, Ty};
use crate::gpu::kernels::forward::key_tile;
use crate::gpu::kernels::{Env, Regs, Side, rope_params, rotate, special64};
use crate::plan::KernelPlan;

/// `backward_dq`: one query row per thread. With parameters, a CTA strides over the blocks of
/// query rows (the grid is [`param_copies`] threads) and each thread adds its rows' parameter
/// gradients into its own copy.
pub(super) fn dq(plan: &KernelPlan) -> Kernel {
    let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
    let bc = i64::from(key_tile(plan));
    let mut r = Regs { list: Vec::new() };
    let body = over_query_rows(plan, &mut r, &|r, row, partials| {
        vec![row.key_tiles(plan, r, partials), row.store_dq(plan, r)]
    });
    kernel("backward_dq", r, bc * (d + dv) * 4, body)
}

/// What a row's thread of a dq kernel runs once its row is loaded, given the thread's copy of
/// the parameters' gradients (plans with parameters).
pub(super) type PerRow<'a> = dyn Fn(&mut Regs, &QueryRow, Option<&ParamPartials>) -> Vec<Stmt> + 'a;

/// The body of a dq kernel: a thread per query row runs `per_row`, in the block of rows the
/// CTA's grid position names; with parameters, each CTA strides over the blocks (the grid is
/// [`param_copies`] threads) and each thread's copy of the parameters' gradients is zeroed
/// first.
pub(super) fn over_query_rows(plan: &KernelPlan, r: &mut Regs, per_row: &PerRow) -> Vec<Stmt> {
    let Some(partials) = ParamPartials::new(plan, r) else {
        let (row, mut body) = QueryRow::load(plan, r, None);
        body.extend(per_row(r, &row, None));
        return body;
    };
    let (step, block) = (r.add("block_step", Ty::I64), r.add("block", Ty::I64));
    let (row, mut per_block) = QueryRow::load(plan, r, Some(block));
    per_block.extend(per_row(r, &row, Some(&partials)));
    per_block.insert(
        0,
        Stmt::Set(
            block,
            add(special64(Special::Ctaid(0)), mul(reg(step), ctas())),
        ),
    );
    let hq = i64::from(plan.shape.heads);
    let blocks = mul(mul(param("batch"), i64(hq)), query_blocks());
    let mut body = partials.zero(r);
    body.push(Stmt::For {
        reg: step,
        start: i64(0),
        end: bin(
            Bin::Div,
            add(
                sub(blocks, special64(Special::Ctaid(0))),
                sub(ctas(), i64(1)),
            ),
            ctas(),
        ),
        step: 1,
        body: per_block,
    });
    body
}

/// Blocks of [`ROWS`] query rows per (batch, head).
fn query_blocks() -> Expr {
    bin(
        Bin::Div,
        add(param("sq"), i64(i64::from(ROWS) - 1)),
        i64(i64::from(ROWS)),
    )
}

/// CTAs of a `backward_dq` grid that strides over blocks (plans with parameters).
fn ctas() -> Expr {
    bin(Bin::Div, param("param_copies"), i64(i64::from(ROWS)))
}

/// A thread's query row in `backward_dq`: where it is (rows past Sq compute on the last row,
/// `qrow`; their results are not stored), its position and index in the call, its q (rotated
/// and scaled), dO, dq accumulator, lse (half base 2) and D.
pub(super) struct QueryRow {
    pub(super) row: Reg,
    pub(super) batch: Reg,
    pub(super) head: Reg,
    pub(super) kvh: Reg,
    pub(super) qrow: Reg,
    pub(super) qpos: Reg,
    pub(super) index: Reg,
    pub(super) q: Vec<Reg>,
    pub(super) go: Vec<Reg>,
    pub(super) acc: Vec<Reg>,
    pub(super) lse_half: Reg,
    pub(super) delta: Reg,
}

impl QueryRow {
    /// The row's registers, and the statements that load it: in the block of query rows the
    /// CTA's grid position names, or in block `block` (blocks numbered by batch, head, then
    /// rows).
    pub(super) fn load(
        plan: &KernelPlan,
        r: &mut Regs,
        block: Option<Reg>,
    ) -> (QueryRow, Vec<Stmt>) {
        let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
        let (hq, hkv) = (i64::from(plan.shape.heads), i64::from(plan.shape.kv_heads));
        let (row, batch, head, kvh) = (
            r.add("row", Ty::I64),
            r.add("batch", Ty::I64),
            r.add("head", Ty::I64),
            r.add("kv_head", Ty::I64),
        );
        let [row_block, head_of, batch_of] = match block {
            None => [0, 1, 2].map(|i| special64(Special::Ctaid(i))),
            Some(block) => {
                let batch_head = bin(Bin::Div, reg(block), query_blocks());
                [
                    bin(Bin::Rem, reg(block), query_blocks()),
                    bin(Bin::Rem, batch_head.clone(), i64(hq)),
                    bin(Bin::Div, batch_head, i64(hq)),
                ]
            }
        };
        let mut body = vec![
            Stmt::Set(
                row,
                add(
                    mul(row_block, i64(i64::from(ROWS))),
                    special64(Special::Tid),
                ),
            ),
            Stmt::Set(batch, batch_of),
            Stmt::Set(head, head_of),
            Stmt::Set(kvh, bin(Bin::Div, reg(head), i64(hq / hkv))),
        ];
        let (qrow, qpos, index) = (
            r.add("q_row", Ty::I64),
            r.add("q_pos", Ty::I64),
            r.add("q_index", Ty::I64),
        );
        body.extend([
            Stmt::Set(qrow, bin(Bin::Min, reg(row), sub(param("sq"), i64(1)))),
            Stmt::Set(
                qpos,
                add(add(param("p0"), sub(param("skv"), param("sq"))), reg(qrow)),
            ),
            Stmt::Set(
                index,
                add(
                    mul(add(mul(reg(batch), i64(hq)), reg(head)), param("sq")),
                    reg(qrow),
                ),
            ),
        ]);
        let q = f32_regs(r, "q", d);
        let go = f32_regs(r, "do", dv);
        let acc = f32_regs(r, "dq", d);
        body.extend(load_rotated_row(
            r,
            plan,
            &q,
            (param("q"), reg(index)),
            (reg(qpos), Side::Query),
        ));
        for &x in &q {
            body.push(Stmt::Set(x, mul(reg(x), f32(plan.q_scale as f32))));
        }
        body.extend(load_row(&go, param("dout"), reg(index)));
        let (lse_half, delta) = (r.add("lse_half", Ty::F32), r.add("delta_row", Ty::F32));
        body.extend([
            Stmt::Set(
                lse_half,
                mul(
                    load(Space::Global, Ty::F32, at(param("lse"), reg(index), 4)),
                    f32(std::f32::consts::LOG2_E / 2.0),
                ),
            ),
            Stmt::Set(
                delta,
                load(Space::Global, Ty::F32, at(param("delta"), reg(index), 4)),
            ),
        ]);
        body.extend(acc.iter().map(|&a| Stmt::Set(a, f32(0.0))));
        let row = QueryRow {
            row,
            batch,
            head,
            kvh,
            qrow,
            qpos,
            index,
            q,
            go,
            acc,
            lse_half,
            delta,
        };
        (row, body)
    }

    /// The loop over key tiles: each staged in shared memory (K `[bc][d]` rotated, V
    /// `[bc][dv]`), then per key `p`, `ds`, and `dq += ds k`.
    /// With `partials`, each kept pair of the thread's own row also adds its parameter
    /// gradients there.
    pub(super) fn key_tiles(
        &self,
        plan: &KernelPlan,
        r: &mut Regs,
        partials: Option<&ParamPartials>,
    ) -> Stmt {
        let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
        let bc = i64::from(key_tile(plan));
        let (k_sh, v_sh) = (0, bc * d * 4);
        let (t, j, key, s, dp) = (
            r.add("tile", Ty::I64),
            r.add("j", Ty::I64),
            r.add("key", Ty::I64),
            r.add("s", Ty::F32),
            r.add("dp", Ty::F32),
        );
        let (p, ds, keep) = (
            r.add("p", Ty::F32),
            r.add("ds", Ty::F32),
            r.add("keep", Ty::Pred),
        );
        let first = mul(reg(t), i64(bc));
        let mut tile = self.stage_keys(plan, r, first.clone());
        tile.push(Stmt::Barrier);
        let pair = Pair {
            env: Env {
                score: reg(s),
                batch: reg(self.batch),
                head: reg(self.head),
                query: reg(self.qpos),
                key: add(param("p0"), reg(key)),
                query_index: reg(self.qrow),
                key_index: reg(key),
                params: param_buffer(plan),
            },
            inside: bin(
                Bin::And,
                bin(Bin::Lt, reg(key), param("skv")),
                bin(Bin::Ne, reg(self.lse_half), f32(f32::NEG_INFINITY)),
            ),
        };
        let (set_keep, [pv, dsv, ds_final]) = probabilities(
            plan,
            &pair,
            keep,
            reg(self.lse_half),
            reg(dp),
            reg(self.delta),
        );
        let k_at = add(mul(reg(j), i64(d * 4)), i64(k_sh));
        let mut per_key = vec![
            Stmt::Set(key, add(first, reg(j))),
            Stmt::Set(s, dot_shared(&self.q, k_at.clone())),
            Stmt::Set(
                dp,
                dot_shared(&self.go, add(mul(reg(j), i64(dv * 4)), i64(v_sh))),
            ),
            set_keep,
            Stmt::Set(p, pv),
            Stmt::Set(ds, dsv),
        ];
        if let Some(partials) = partials {
            // Rows past Sq compute on the last row; only the row's own thread counts it.
            let counted = bin(
                Bin::And,
                reg(keep),
                bin(Bin::Lt, reg(self.row), param("sq")),
            );
            per_key.extend(partials.scatter(plan, &pair.env, counted, ds_final));
        }
        per_key.extend(axpy_shared(&self.acc, reg(ds), k_at));
        tile.push(Stmt::For {
            reg: j,
            start: i64(0),
            end: i64(bc),
            step: 1,
            body: per_key,
        });
        tile.push(Stmt::Barrier);
        Stmt::For {
            reg: t,
            start: i64(0),
            end: bin(Bin::Div, add(param("skv"), i64(bc - 1)), i64(bc)),
            step: 1,
            body: tile,
        }
    }

    /// K (rotated) and V rows `first..first + bc` of the row's KV head staged in shared
    /// memory (K `[bc][d]` at 0, V `[bc][dv]` after it; zeros past Skv), then a barrier.
    pub(super) fn stage_keys(&self, plan: &KernelPlan, r: &mut Regs, first: Expr) -> Vec<Stmt> {
        let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
        let hkv = i64::from(plan.shape.kv_heads);
        let bc = i64::from(key_tile(plan));
        let kv_row0 = mul(
            add(mul(reg(self.batch), i64(hkv)), reg(self.kvh)),
            param("skv"),
        );
        let k_tmp = f32_regs(r, "k", d);
        let key_pos = |row: Expr| add(param("p0"), row);
        let mut tile = stage(
            r,
            plan,
            Stage {
                base: add(param("k"), mul(kv_row0.clone(), i64(d * 4))),
                first: first.clone(),
                count: param("skv"),
                width: d,
                tile: bc,
                shared: 0,
                factor: 1.0,
                rotation: Some(Rotation {
                    tmp: &k_tmp,
                    pos: &key_pos,
                    side: Side::Key,
                }),
            },
        );
        tile.extend(stage(
            r,
            plan,
            Stage {
                base: add(param("v"), mul(kv_row0, i64(dv * 4))),
                first,
                count: param("skv"),
                width: dv,
                tile: bc,
                shared: bc * d * 4,
                factor: 1.0,
                rotation: None,
            },
        ));
        tile.push(Stmt::Barrier);
        tile
    }

    /// dq = q_scale * sum dS K, rotated back to the unrotated q, stored for rows inside Sq.
    pub(super) fn store_dq(&self, plan: &KernelPlan, r: &mut Regs) -> Stmt {
        let acc = &self.acc;
        let mut store = acc
            .iter()
            .map(|&a| Stmt::Set(a, mul(reg(a), f32(plan.q_scale as f32))))
            .collect::<Vec<_>>();
        if let Some(rope) = &plan.rope {
            let tables = rope_params(param, Side::Query);
            store.extend(rotate(r, rope, acc, reg(self.qpos), &tables, true));
        }
        store.extend(store_row(acc, param("dq"), reg(self.index)));
        Stmt::If(bin(Bin::Lt, reg(self.row), param("sq")), store, vec![])
    }
}
