//! The SIMT backward under `normalize = stick_breaking`: its dq and dk/dv kernels.
//!
//! Key `j` of row `i` weighs `A_ij = e^(ln sigmoid(x_ij) - R_ij)`, `R_ij` the sum of
//! `softplus` over the row's kept keys nearer than `j`, and its score's gradient is
//! `dS_ij = dP_ij A_ij (1 - sigma_ij) - sigma_ij E_ij`, `E_ij` the sum of `dP A` over the
//! farther keys (docs/semantics.md). Both sums run along the row from the nearest key, so:
//!
//! - `backward_dq` (one thread per query row) sweeps the row's key tiles from the last twice:
//!   first for the row's exact `D = sum_j dP_j A_j`, then with `E` starting at `D` and losing
//!   each key's `dP A` for `dS` and `dq += dS k`. Before the nearest tile of each block of
//!   [`ROWS`] keys (a `backward_dkdv` CTA's keys) it stores the row's `R` and `E` there in
//!   `stick_state` (`[B, Hq, Sq, ceil(Skv / ROWS), 2]` f32).
//! - `backward_dkdv` (one thread per key) takes, per query tile, each pair's score, `dP` and
//!   score derivative into shared memory; then a thread per query row walks the CTA's keys
//!   from the last with the row's stored `R` and `E`, leaving `A` and `dS` in place of the
//!   score and `dP`; then each key's thread adds `dv += A dO` and `dk += dS q`.
//!
//! The delta kernel still runs first (its `D` from the output is not read). With learnable
//! parameters (or f32 data tensors), the dq kernel's second sweep adds each pair's `dS_final`
//! times the score's derivative into the thread's copy of their gradients, as the softmax dq
//! kernel does.

use super::dkdv::KeyRow;
use super::dq::{QueryRow, over_query_rows};
use super::shared::{ParamPartials, ROWS, axpy_shared, dot_shared, kernel, param, param_buffer};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Reg, Space, Special, Stmt, Ty};
use crate::gpu::kernels::forward::key_tile;
use crate::gpu::kernels::{Env, Regs, StickKey, from_last, program, special64};
use crate::plan::KernelPlan;
use attn_dsl::modifier::Expr as M;

/// Blocks of [`ROWS`] keys: the `backward_dkdv` CTAs of a (batch, KV head).
fn key_blocks() -> Expr {
    bin(
        Bin::Div,
        add(param("skv"), i64(i64::from(ROWS) - 1)),
        i64(i64::from(ROWS)),
    )
}

/// Where the stored `R` of (query row `index`, key block `block`) lies; its `E` follows it.
fn state_at(index: Expr, block: Expr) -> Expr {
    at(
        param("stick_state"),
        mul(add(mul(index, key_blocks()), block), i64(2)),
        4,
    )
}

/// A pair's score in half base-2 units where it is kept (`-inf` otherwise) and its score's
/// derivative (0 where not kept), with `keep` set first: `inside` and the plan's mask.
fn kept_score(plan: &KernelPlan, env: &Env, inside: Expr, keep: Reg) -> (Stmt, Expr, Expr) {
    let grad = plan
        .score_grad
        .as_ref()
        .expect("backward plans have a score derivative");
    let mut kept = inside;
    if !matches!(plan.program.mask, M::Bool(true)) {
        kept = bin(Bin::And, kept, program(&plan.program.mask, env));
    }
    let score = select(
        reg(keep),
        program(&plan.program.score, env),
        f32(f32::NEG_INFINITY),
    );
    // Selected: the derivative may be NaN or infinite where the pair is not kept.
    let slope = select(reg(keep), program(grad, env), f32(0.0));
    (Stmt::Set(keep, kept), score, slope)
}

/// `dS_final` of a key once `da = dP A` has left `remaining` (now the farther keys' sum):
/// `da (1 - sigma) - sigma E`, 0 for a key not kept (score `-inf`).
fn stick_ds(stick: &StickKey, score: Expr, da: Expr, remaining: Expr) -> Expr {
    let sig = reg(stick.sigmoid);
    select(
        bin(Bin::Eq, score, f32(f32::NEG_INFINITY)),
        f32(0.0),
        sub(mul(da, sub(f32(1.0), sig.clone())), mul(sig, remaining)),
    )
}

/// `backward_dq` under stick-breaking: one query row per thread, two sweeps from the last key
/// tile (see the module's contract); with parameters, the second adds each kept pair's
/// `dS_final` times the score's derivative into the thread's copy of their gradients.
pub(super) fn dq(plan: &KernelPlan) -> Kernel {
    let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
    let bc = i64::from(key_tile(plan));
    let mut r = Regs { list: Vec::new() };
    let body = over_query_rows(plan, &mut r, &|r, row, partials| {
        let mut body = sweeps(plan, r, row, partials);
        body.push(row.store_dq(plan, r));
        body
    });
    kernel("backward_dq", r, bc * (d + dv) * 4, body)
}

/// The dq kernel's two sweeps over a row's key tiles (see the module's contract).
fn sweeps(
    plan: &KernelPlan,
    r: &mut Regs,
    row: &QueryRow,
    partials: Option<&ParamPartials>,
) -> Vec<Stmt> {
    let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
    let bc = i64::from(key_tile(plan));
    let (nearer, remaining) = (r.add("nearer", Ty::F32), r.add("remaining", Ty::F32));
    let (step, t, jstep, j, key) = (
        r.add("tile_step", Ty::I64),
        r.add("tile", Ty::I64),
        r.add("j_step", Ty::I64),
        r.add("j", Ty::I64),
        r.add("key", Ty::I64),
    );
    let (s, dp, da, keep) = (
        r.add("s", Ty::F32),
        r.add("dp", Ty::F32),
        r.add("da", Ty::F32),
        r.add("keep", Ty::Pred),
    );
    let stick = StickKey::new(r);
    let tiles = bin(Bin::Div, add(param("skv"), i64(bc - 1)), i64(bc));
    let first = mul(reg(t), i64(bc));
    let env = Env {
        score: reg(s),
        batch: reg(row.batch),
        head: reg(row.head),
        query: reg(row.qpos),
        key: add(param("p0"), reg(key)),
        query_index: reg(row.qrow),
        key_index: reg(key),
        params: param_buffer(plan),
    };
    let (set_keep, score, slope) =
        kept_score(plan, &env, bin(Bin::Lt, reg(key), param("skv")), keep);
    let (score_reg, slope_reg) = (r.add("score", Ty::F32), r.add("slope", Ty::F32));
    let k_at = mul(reg(j), i64(d * 4));
    let pair = vec![
        Stmt::Set(j, from_last(i64(bc), reg(jstep))),
        Stmt::Set(key, add(first.clone(), reg(j))),
        Stmt::Set(s, dot_shared(&row.q, k_at.clone())),
        Stmt::Set(
            dp,
            dot_shared(&row.go, add(mul(reg(j), i64(dv * 4)), i64(bc * d * 4))),
        ),
        set_keep,
        Stmt::Set(score_reg, score),
        Stmt::Set(slope_reg, slope),
    ];
    let weigh = |pair: &[Stmt], then: Vec<Stmt>| {
        let mut per_key = pair.to_vec();
        per_key.extend(stick.weigh(reg(score_reg), reg(nearer)));
        per_key.push(Stmt::Set(da, mul(reg(dp), reg(stick.weight))));
        per_key.extend(then);
        per_key.push(Stmt::Set(nearer, add(reg(nearer), reg(stick.added))));
        per_key
    };
    // Sweep 1: the row's exact D (in `remaining`).
    let sweep1 = weigh(
        &pair,
        vec![Stmt::Set(remaining, add(reg(remaining), reg(da)))],
    );
    // Sweep 2: E loses each key's dP A, then dS_final (into `da`), the parameters' share of
    // it, and dq += dS k.
    let mut then = vec![
        Stmt::Set(remaining, sub(reg(remaining), reg(da))),
        Stmt::Set(
            da,
            stick_ds(&stick, reg(score_reg), reg(da), reg(remaining)),
        ),
    ];
    if let Some(partials) = partials {
        // Rows past Sq compute on the last row; only the row's own thread counts it.
        let counted = bin(Bin::And, reg(keep), bin(Bin::Lt, reg(row.row), param("sq")));
        then.extend(partials.scatter(plan, &env, counted, reg(da)));
    }
    then.push(Stmt::Set(da, mul(reg(da), reg(slope_reg))));
    let mut sweep2 = weigh(&pair, then);
    sweep2.extend(axpy_shared(&row.acc, reg(da), k_at));
    // The state before each block's nearest tile: the last tile, or one ending a block.
    let rows = i64::from(ROWS);
    let nearest_of_block = bin(
        Bin::Or,
        bin(Bin::Eq, reg(t), sub(tiles.clone(), i64(1))),
        bin(
            Bin::Eq,
            bin(Bin::Rem, mul(add(reg(t), i64(1)), i64(bc)), i64(rows)),
            i64(0),
        ),
    );
    let state = state_at(reg(row.index), bin(Bin::Div, first.clone(), i64(rows)));
    let store_state = Stmt::If(
        bin(
            Bin::And,
            nearest_of_block,
            bin(Bin::Lt, reg(row.row), param("sq")),
        ),
        vec![
            Stmt::Store(Space::Global, state.clone(), reg(nearer)),
            Stmt::Store(Space::Global, add(state, i64(4)), reg(remaining)),
        ],
        vec![],
    );
    let staged = row.stage_keys(plan, r, first.clone());
    let mut body = Vec::new();
    for (n, per_key) in [(1, sweep1), (2, sweep2)] {
        let mut tile = vec![Stmt::Set(t, from_last(tiles.clone(), reg(step)))];
        tile.extend(staged.iter().cloned());
        if n == 2 {
            tile.push(store_state.clone());
        }
        tile.push(Stmt::For {
            reg: jstep,
            start: i64(0),
            end: i64(bc),
            step: 1,
            body: per_key,
        });
        tile.push(Stmt::Barrier);
        let start = match n {
            1 => f32(0.0),
            _ => reg(remaining),
        };
        body.extend([
            Stmt::Set(nearer, f32(0.0)),
            Stmt::Set(remaining, start),
            Stmt::For {
                reg: step,
                start: i64(0),
                end: tiles.clone(),
                step: 1,
                body: tile,
            },
        ]);
    }
    body
}

/// Shared memory of the stick-breaking `backward_dkdv`, byte offsets: the staged Q and dO,
/// each query row's `R` and `E`, and per (query, key) pair its score (then `A`), `dP` (then
/// `dS`) and score derivative, `[bq][ROWS]` each.
struct DkdvShared {
    state: i64,
    score: i64,
    dp: i64,
    slope: i64,
    bytes: i64,
}

impl DkdvShared {
    fn of(plan: &KernelPlan) -> DkdvShared {
        let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
        let bq = i64::from(key_tile(plan));
        let pairs = bq * i64::from(ROWS) * 4;
        let state = bq * (d + dv) * 4;
        let score = state + bq * 2 * 4;
        DkdvShared {
            state,
            score,
            dp: score + pairs,
            slope: score + 2 * pairs,
            bytes: score + 3 * pairs,
        }
    }

    /// Pair (query `i`, key `c`) of the array at `base`.
    fn pair(base: i64, i: Expr, c: Expr) -> Expr {
        add(i64(base), mul(add(mul(i, i64(i64::from(ROWS))), c), i64(4)))
    }
}

/// `backward_dkdv` under stick-breaking: one key per thread, every query of its group's heads,
/// the rows' walks over the CTA's keys in between (see the module's contract).
pub(super) fn dkdv(plan: &KernelPlan) -> Kernel {
    let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
    let (hq, hkv) = (i64::from(plan.shape.heads), i64::from(plan.shape.kv_heads));
    let (group, bq) = (hq / hkv, i64::from(key_tile(plan)));
    let sh = DkdvShared::of(plan);
    let mut r = Regs { list: Vec::new() };
    let (key, mut body) = KeyRow::load(plan, &mut r);
    let (h, head, t, i, qi) = (
        r.add("h", Ty::I64),
        r.add("head", Ty::I64),
        r.add("tile", Ty::I64),
        r.add("i", Ty::I64),
        r.add("query", Ty::I64),
    );
    let (s, keep) = (r.add("s", Ty::F32), r.add("keep", Ty::Pred));
    let tid = special64(Special::Tid);
    let first = mul(reg(t), i64(bq));
    let head_row0 = mul(add(mul(reg(key.batch), i64(hq)), reg(head)), param("sq"));
    let q_pos = add(add(param("p0"), sub(param("skv"), param("sq"))), reg(qi));
    let (q_at, do_at) = (
        mul(reg(i), i64(d * 4)),
        add(mul(reg(i), i64(dv * 4)), i64(bq * d * 4)),
    );

    let mut tile = key.stage_queries(plan, &mut r, head, first.clone());
    // Each row's R and E at this CTA's block, by threads 0..bq.
    let own_row = bin(
        Bin::Min,
        add(first.clone(), tid.clone()),
        sub(param("sq"), i64(1)),
    );
    let state = state_at(add(head_row0, own_row), special64(Special::Ctaid(0)));
    tile.push(Stmt::If(
        bin(Bin::Lt, tid.clone(), i64(bq)),
        (0..2)
            .map(|n| {
                Stmt::Store(
                    Space::Shared,
                    add(mul(tid.clone(), i64(8)), i64(sh.state + 4 * n)),
                    load(Space::Global, Ty::F32, add(state.clone(), i64(4 * n))),
                )
            })
            .collect(),
        vec![],
    ));
    tile.push(Stmt::Barrier);

    // Per query: the pair's score, dP and score derivative, into shared memory.
    let env = Env {
        score: reg(s),
        batch: reg(key.batch),
        head: reg(head),
        query: q_pos,
        key: reg(key.kpos),
        query_index: reg(qi),
        key_index: reg(key.krow),
        params: param_buffer(plan),
    };
    let inside = bin(
        Bin::And,
        bin(Bin::Lt, reg(qi), param("sq")),
        bin(Bin::Lt, reg(key.row), param("skv")),
    );
    let (set_keep, score, slope) = kept_score(plan, &env, inside, keep);
    let own = |base: i64| DkdvShared::pair(base, reg(i), tid.clone());
    tile.push(Stmt::For {
        reg: i,
        start: i64(0),
        end: i64(bq),
        step: 1,
        body: vec![
            Stmt::Set(qi, add(first.clone(), reg(i))),
            Stmt::Set(s, dot_shared(&key.k, q_at.clone())),
            set_keep,
            Stmt::Store(Space::Shared, own(sh.score), score),
            Stmt::Store(Space::Shared, own(sh.dp), dot_shared(&key.v, do_at.clone())),
            Stmt::Store(Space::Shared, own(sh.slope), slope),
        ],
    });
    tile.push(Stmt::Barrier);
    tile.push(row_walks(&mut r, &sh, bq));
    tile.push(Stmt::Barrier);

    // Per query: dv += A dO, dk += dS q.
    let mut per_query = axpy_shared(&key.dv, load(Space::Shared, Ty::F32, own(sh.score)), do_at);
    per_query.extend(axpy_shared(
        &key.dk,
        load(Space::Shared, Ty::F32, own(sh.dp)),
        q_at,
    ));
    tile.push(Stmt::For {
        reg: i,
        start: i64(0),
        end: i64(bq),
        step: 1,
        body: per_query,
    });
    tile.push(Stmt::Barrier);

    body.push(Stmt::For {
        reg: h,
        start: i64(0),
        end: i64(group),
        step: 1,
        body: vec![
            Stmt::Set(head, add(mul(reg(key.kvh), i64(group)), reg(h))),
            Stmt::For {
                reg: t,
                start: i64(0),
                end: bin(Bin::Div, add(param("sq"), i64(bq - 1)), i64(bq)),
                step: 1,
                body: tile,
            },
        ],
    });
    body.push(key.store(plan, &mut r));
    kernel("backward_dkdv", r, sh.bytes, body)
}

/// Thread `i < bq` walks query row `i` over the CTA's [`ROWS`] keys from the last, from the
/// row's stored `R` and `E`: each pair's score becomes its weight `A`, its `dP` its `dS`.
fn row_walks(r: &mut Regs, sh: &DkdvShared, bq: i64) -> Stmt {
    let tid = special64(Special::Tid);
    let (cstep, c) = (r.add("c_step", Ty::I64), r.add("c", Ty::I64));
    let (nearer, remaining, score, da) = (
        r.add("nearer", Ty::F32),
        r.add("remaining", Ty::F32),
        r.add("score", Ty::F32),
        r.add("da", Ty::F32),
    );
    let stick = StickKey::new(r);
    let pair = |base: i64| DkdvShared::pair(base, tid.clone(), reg(c));
    let mut per_key = vec![
        Stmt::Set(c, from_last(i64(i64::from(ROWS)), reg(cstep))),
        Stmt::Set(score, load(Space::Shared, Ty::F32, pair(sh.score))),
    ];
    per_key.extend(stick.weigh(reg(score), reg(nearer)));
    per_key.extend([
        Stmt::Set(
            da,
            mul(load(Space::Shared, Ty::F32, pair(sh.dp)), reg(stick.weight)),
        ),
        Stmt::Set(remaining, sub(reg(remaining), reg(da))),
        Stmt::Store(Space::Shared, pair(sh.score), reg(stick.weight)),
        Stmt::Store(
            Space::Shared,
            pair(sh.dp),
            mul(
                stick_ds(&stick, reg(score), reg(da), reg(remaining)),
                load(Space::Shared, Ty::F32, pair(sh.slope)),
            ),
        ),
        Stmt::Set(nearer, add(reg(nearer), reg(stick.added))),
    ]);
    let row_state = |n: i64| {
        load(
            Space::Shared,
            Ty::F32,
            add(mul(tid.clone(), i64(8)), i64(sh.state + 4 * n)),
        )
    };
    Stmt::If(
        bin(Bin::Lt, tid.clone(), i64(bq)),
        vec![
            Stmt::Set(nearer, row_state(0)),
            Stmt::Set(remaining, row_state(1)),
            Stmt::For {
                reg: cstep,
                start: i64(0),
                end: i64(i64::from(ROWS)),
                step: 1,
                body: per_key,
            },
        ],
        vec![],
    )
}
