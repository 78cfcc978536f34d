//! A forward plan lowered to GPU IR: the SIMT f32 path (no tensor cores), a FlashAttention-2
//! structure in its plainest form.
//!
//! A CTA handles [`ROWS`] query rows of one (batch, head), one row per thread. Per key tile the
//! CTA stages K (rotated by RoPE as it loads) and V in shared memory; each thread computes its
//! row's scores through the score program (half base 2) and the mask, keeps its running max and sum
//! (online softmax), and accumulates `P V` in registers. Tiles the plan classifies as all-masked
//! are skipped (the host passes one code per (head, query block, key tile)); all-kept tiles skip
//! the mask program. Under `normalize = stick_breaking` the tiles and each tile's keys are
//! taken from the last (the nearest), and the running max is the row's running sum of
//! `softplus` over the keys already weighed. Inputs are contiguous BHSD f32.

use super::{
    Env, Regs, Side, StickKey, exp2_twice, from_last, lse_of_half, param, program, reciprocal,
    rope_params, rotate, sigmoid_weight, special64, tile_code,
};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Reg, Space, Special, Stmt, Ty, Un};
use crate::gpu::launch::{ForwardArgs, LaunchRecord};
use crate::plan::{KernelPlan, PlanKind, RopePrologue, TileCode};
use attn_dsl::modifier::Expr as M;

/// Query rows (threads) per CTA.
pub const ROWS: u32 = 64;

/// Keys per tile for a plan: as many as keep K and V tiles within 32 KiB of shared memory.
pub fn key_tile(plan: &KernelPlan) -> u32 {
    let width = plan.shape.qk_dim + plan.shape.v_dim;
    if width <= 128 {
        32
    } else if width <= 256 {
        16
    } else {
        8
    }
}

/// Lowers the forward plan's SIMT f32 kernel.
pub fn lower(plan: &KernelPlan) -> Kernel {
    assert_eq!(
        plan.kind,
        PlanKind::Forward,
        "the GPU forward kernel lowers forward plans"
    );
    let mut r = Regs { list: Vec::new() };
    let (at, mut body) = Thread::locate(plan, &mut r);
    let (d, dv, bc) = (at.d, at.dv, at.bc);
    let rows = i64::from(ROWS);
    let q = at.load_q(plan, &mut r, &mut body);
    let (m, l, acc) = scaled_q_and_running_state(plan, &mut r, &mut body, &q, dv);

    // Shared memory: K tile [bc][d], V tile [bc][dv], scores [ROWS][bc].
    let shared = TileShared {
        k: 0,
        v: bc * d * 4,
        s: bc * d * 4 + bc * dv * 4,
        keys: bc,
    };
    let shared_bytes = shared.s + rows * bc * 4;

    let (t, code) = (r.add("tile", Ty::I64), r.add("code", Ty::I32));
    let mut run = at.stage_tile(plan, &mut r, t, &shared);

    // Pass 1 (scores through the program and mask, into shared; the max), the rescale, pass 2.
    let (j, key) = (r.add("j", Ty::I64), r.add("key", Ty::I64));
    let row_state = RowState {
        q: &q,
        acc: &acc,
        m,
        l,
    };
    run.extend(simt_tile(
        &mut r,
        plan,
        &row_state,
        &shared,
        KeyLoop {
            j,
            key,
            key_at: add(mul(reg(t), i64(bc)), reg(j)),
            count: i64(bc),
            in_range: Some(bin(Bin::Lt, reg(key), param("skv"))),
            masked_tile: bin(
                Bin::Eq,
                reg(code),
                Expr::Int(TileCode::Masked as i64, Ty::I32),
            ),
        },
        |score| Env {
            score,
            batch: reg(at.batch),
            head: reg(at.head),
            query: reg(at.qpos),
            key: add(param("p0"), reg(key)),
            query_index: reg(at.row),
            key_index: reg(key),
            params: (!plan.params.is_empty()).then(|| (param("params"), plan.params.clone())),
        },
    ));
    run.push(Stmt::Barrier);
    let run_tile = bin(
        Bin::Ne,
        reg(code),
        Expr::Int(TileCode::Skip as i64, Ty::I32),
    );
    let tiles = bin(Bin::Div, add(param("skv"), i64(bc - 1)), i64(bc));
    let mut per_tile = vec![
        Stmt::Set(code, tile_code(at.head, [rows, bc], reg(t))),
        Stmt::If(run_tile, run, vec![]),
    ];
    let mut step = t;
    if plan.stick_breaking() {
        // Stick-breaking weighs keys from the nearest: tiles from the last.
        step = r.add("tile_step", Ty::I64);
        per_tile.insert(0, Stmt::Set(t, from_last(tiles.clone(), reg(step))));
    }
    body.push(Stmt::For {
        reg: step,
        start: i64(0),
        end: tiles,
        step: 1,
        body: per_tile,
    });

    // Epilogue: out = acc / l, lse = (m + log2 l) ln 2; rows with no kept key: 0 and -inf.
    let out_row = add(
        mul(
            add(mul(reg(at.batch), i64(at.hq)), reg(at.head)),
            param("sq"),
        ),
        reg(at.row),
    );
    let valid = bin(Bin::Lt, reg(at.row), param("sq"));
    body.push(simt_epilogue(
        plan,
        &row_state,
        param("out"),
        param("lse"),
        out_row,
        valid,
    ));

    Kernel {
        name: "attention_forward".into(),
        params: ForwardArgs::params(),
        regs: r.list,
        shared_bytes: shared_bytes as u32,
        threads: ROWS,
        ctas_per_sm: 2,
        body,
    }
}

/// Where this thread is: its row (and the row it computes on, `qrow`: rows past Sq compute on
/// the last row, their results not stored), that row's position, its batch, head and KV head;
/// with the plan's sizes.
struct Thread {
    row: Reg,
    batch: Reg,
    head: Reg,
    kvh: Reg,
    qrow: Reg,
    qpos: Reg,
    /// Head dims of Q and K, and of V.
    d: i64,
    dv: i64,
    /// Query and KV heads.
    hq: i64,
    hkv: i64,
    /// Keys per tile.
    bc: i64,
}

impl Thread {
    /// The thread's registers, and the statements that set them.
    fn locate(plan: &KernelPlan, r: &mut Regs) -> (Thread, Vec<Stmt>) {
        let (hq, hkv) = (plan.shape.heads as i64, plan.shape.kv_heads as i64);
        let at = Thread {
            row: r.add("row", Ty::I64),
            batch: r.add("batch", Ty::I64),
            head: r.add("head", Ty::I64),
            kvh: r.add("kv_head", Ty::I64),
            qrow: r.add("q_row", Ty::I64),
            qpos: r.add("q_pos", Ty::I64),
            d: plan.shape.qk_dim as i64,
            dv: plan.shape.v_dim as i64,
            hq,
            hkv,
            bc: key_tile(plan) as i64,
        };
        let body = vec![
            Stmt::Set(
                at.row,
                add(
                    mul(special64(Special::Ctaid(0)), i64(i64::from(ROWS))),
                    special64(Special::Tid),
                ),
            ),
            Stmt::Set(at.batch, special64(Special::Ctaid(2))),
            Stmt::Set(at.head, special64(Special::Ctaid(1))),
            Stmt::Set(at.kvh, bin(Bin::Div, reg(at.head), i64(hq / hkv))),
            Stmt::Set(
                at.qrow,
                bin(Bin::Min, reg(at.row), sub(param("sq"), i64(1))),
            ),
            Stmt::Set(
                at.qpos,
                add(
                    add(param("p0"), sub(param("skv"), param("sq"))),
                    reg(at.qrow),
                ),
            ),
        ];
        (at, body)
    }

    /// q: loaded and rotated (the scale comes with the running state).
    fn load_q(&self, plan: &KernelPlan, r: &mut Regs, body: &mut Vec<Stmt>) -> Vec<Reg> {
        let d = self.d;
        let q: Vec<Reg> = (0..d).map(|i| r.add(format!("q{i}"), Ty::F32)).collect();
        let q_base = mul(
            add(
                mul(
                    add(mul(reg(self.batch), i64(self.hq)), reg(self.head)),
                    param("sq"),
                ),
                reg(self.qrow),
            ),
            i64(d * 4),
        );
        for (i, &qi) in q.iter().enumerate() {
            let addr = add(param("q"), add(q_base.clone(), i64(4 * i as i64)));
            body.push(Stmt::Set(qi, load(Space::Global, Ty::F32, addr)));
        }
        if let Some(rope) = &plan.rope {
            let tables = rope_params(param, Side::Query);
            body.extend(rotate(r, rope, &q, reg(self.qpos), &tables, false));
        }
        q
    }

    /// Row 0 of (batch, KV head) in K and V.
    fn kv_base(&self) -> Expr {
        mul(
            add(mul(reg(self.batch), i64(self.hkv)), reg(self.kvh)),
            param("skv"),
        )
    }

    /// Stage tile `t` (zeros past Skv). Rows RoPE rotates (K with RoPE): thread j < bc loads
    /// key t*bc + j into registers, rotates it and stores it. Everything else: element c of
    /// the tile's region by thread c % ROWS in a loop, coalesced (an unrolled row per thread
    /// had ptxas hoist every load and spill). Ends with a barrier.
    fn stage_tile(&self, plan: &KernelPlan, r: &mut Regs, t: Reg, sh: &TileShared) -> Vec<Stmt> {
        let (d, dv, bc) = (self.d, self.dv, self.bc);
        let rotated = plan.rope.is_some();
        let tid = special64(Special::Tid);
        let element = r.add("stage_element", Ty::I64);
        let mut run = Vec::new();
        let regions = [(!rotated, "k", d, sh.k), (true, "v", dv, sh.v)];
        for (by_element, name, width, shared) in regions {
            if !by_element {
                continue;
            }
            let key = add(
                mul(reg(t), i64(bc)),
                bin(Bin::Div, reg(element), i64(width)),
            );
            let row = add(
                self.kv_base(),
                bin(Bin::Min, key.clone(), sub(param("skv"), i64(1))),
            );
            let src = add(
                param(name),
                mul(
                    add(
                        mul(row, i64(width)),
                        bin(Bin::Rem, reg(element), i64(width)),
                    ),
                    i64(4),
                ),
            );
            run.push(Stmt::For {
                reg: element,
                start: tid.clone(),
                end: i64(bc * width),
                step: i64::from(ROWS),
                body: vec![Stmt::Store(
                    Space::Shared,
                    add(mul(reg(element), i64(4)), i64(shared)),
                    select(
                        bin(Bin::Lt, key, param("skv")),
                        load(Space::Global, Ty::F32, src),
                        f32(0.0),
                    ),
                )],
            });
        }
        if let Some(rope) = &plan.rope {
            let stage = self.stage_rotated_k(r, rope, t, sh.k);
            run.push(Stmt::If(bin(Bin::Lt, tid, i64(bc)), stage, vec![]));
        }
        run.push(Stmt::Barrier);
        run
    }

    /// Thread j's key of tile `t` loaded, rotated by RoPE and stored at row j of the K tile
    /// (at `k_sh`).
    fn stage_rotated_k(&self, r: &mut Regs, rope: &RopePrologue, t: Reg, k_sh: i64) -> Vec<Stmt> {
        let (d, bc, tid) = (self.d, self.bc, special64(Special::Tid));
        let (key_l, kv_row) = (r.add("load_key", Ty::I64), r.add("load_row", Ty::I64));
        let kv_tmp: Vec<Reg> = (0..d).map(|i| r.add(format!("k{i}"), Ty::F32)).collect();
        let last_key = sub(param("skv"), i64(1));
        let mut stage = vec![
            Stmt::Set(key_l, add(mul(reg(t), i64(bc)), tid.clone())),
            Stmt::Set(
                kv_row,
                add(self.kv_base(), bin(Bin::Min, reg(key_l), last_key.clone())),
            ),
        ];
        let inside_l = bin(Bin::Lt, reg(key_l), param("skv"));
        for (i, &ki) in kv_tmp.iter().enumerate() {
            let addr = add(
                param("k"),
                add(mul(reg(kv_row), i64(d * 4)), i64(4 * i as i64)),
            );
            stage.push(Stmt::Set(
                ki,
                select(
                    inside_l.clone(),
                    load(Space::Global, Ty::F32, addr),
                    f32(0.0),
                ),
            ));
        }
        // Keys past Skv (zeros) rotate at the last position, inside the tables.
        let pos = add(param("p0"), bin(Bin::Min, reg(key_l), last_key));
        let tables = rope_params(param, Side::Key);
        stage.extend(rotate(r, rope, &kv_tmp, pos, &tables, false));
        for (i, &ki) in kv_tmp.iter().enumerate() {
            let addr = add(mul(tid.clone(), i64(d * 4)), i64(k_sh + 4 * i as i64));
            stage.push(Stmt::Store(Space::Shared, addr, reg(ki)));
        }
        stage
    }
}

/// The row's q scaled by the plan's hoisted score factor, then a new running state: max `-inf`,
/// sum 0, `dv` accumulators 0. Returns `(m, l, acc)`.
fn scaled_q_and_running_state(
    plan: &KernelPlan,
    r: &mut Regs,
    body: &mut Vec<Stmt>,
    q: &[Reg],
    dv: i64,
) -> (Reg, Reg, Vec<Reg>) {
    if plan.q_scale != 1.0 {
        for &qi in q {
            body.push(Stmt::Set(qi, mul(reg(qi), f32(plan.q_scale as f32))));
        }
    }
    let (m, l) = (r.add("m", Ty::F32), r.add("l", Ty::F32));
    // Stick-breaking's running softplus sum starts at 0.
    let m0 = match plan.stick_breaking() {
        true => 0.0,
        false => f32::NEG_INFINITY,
    };
    body.push(Stmt::Set(m, f32(m0)));
    body.push(Stmt::Set(l, f32(0.0)));
    let acc: Vec<Reg> = (0..dv).map(|i| r.add(format!("acc{i}"), Ty::F32)).collect();
    for &a in &acc {
        body.push(Stmt::Set(a, f32(0.0)));
    }
    (m, l, acc)
}

/// A thread's row of the SIMT kernel: its rotated, scaled query, output accumulator, running
/// max (under stick-breaking its running sum of `softplus`) and sum.
struct RowState<'a> {
    pub q: &'a [Reg],
    pub acc: &'a [Reg],
    pub m: Reg,
    pub l: Reg,
}

/// Byte offsets in shared memory of a staged tile: K rows, V rows, and the scores (a row of
/// `keys` per thread).
struct TileShared {
    pub k: i64,
    pub v: i64,
    pub s: i64,
    pub keys: i64,
}

/// The loop over a tile's keys: `j` runs over `0..count`, `key` is set to `key_at` (the key's
/// index) each step; keys are kept where `in_range` holds (if given) and, on tiles where
/// `masked_tile` holds, where the plan's mask holds.
struct KeyLoop {
    pub j: Reg,
    pub key: Reg,
    pub key_at: Expr,
    pub count: Expr,
    pub in_range: Option<Expr>,
    pub masked_tile: Expr,
}

/// One staged key tile for a thread's row: pass 1 (each key's score through the score program
/// and the mask, into shared memory, and the tile's max), the online-softmax rescale of the sum
/// and accumulator, pass 2 (probabilities `2^(s - m)`, their sum, `P V`). `env` gives the
/// program's variables for a score.
fn simt_tile(
    r: &mut Regs,
    plan: &KernelPlan,
    row: &RowState,
    sh: &TileShared,
    keys: KeyLoop,
    env: impl FnOnce(Expr) -> Env,
) -> Vec<Stmt> {
    let (d, dv) = (plan.shape.qk_dim as i64, plan.shape.v_dim as i64);
    let (j, key) = (keys.j, keys.key);
    let (s, mt) = (r.add("s", Ty::F32), r.add("tile_max", Ty::F32));
    let tid = special64(Special::Tid);
    let mut out = vec![Stmt::Set(mt, f32(f32::NEG_INFINITY))];
    let mut pass1 = vec![Stmt::Set(key, keys.key_at), Stmt::Set(s, f32(0.0))];
    for (i, &qi) in row.q.iter().enumerate() {
        let kd = load(
            Space::Shared,
            Ty::F32,
            add(mul(reg(j), i64(d * 4)), i64(sh.k + 4 * i as i64)),
        );
        pass1.push(Stmt::Set(s, fma(reg(qi), kd, reg(s))));
    }
    let env = env(reg(s));
    pass1.push(Stmt::Set(s, program(&plan.program.score, &env)));
    let mut keep = keys.in_range;
    if !matches!(plan.program.mask, M::Bool(true)) {
        let mask = bin(
            Bin::Or,
            un(Un::Not, keys.masked_tile),
            program(&plan.program.mask, &env),
        );
        keep = Some(match keep {
            Some(k) => bin(Bin::And, k, mask),
            None => mask,
        });
    }
    if let Some(keep) = keep {
        pass1.push(Stmt::Set(s, select(keep, reg(s), f32(f32::NEG_INFINITY))));
    }
    let s_addr = add(mul(add(mul(tid, i64(sh.keys)), reg(j)), i64(4)), i64(sh.s));
    pass1.push(Stmt::Store(Space::Shared, s_addr.clone(), reg(s)));
    pass1.push(Stmt::Set(mt, bin(Bin::Max, reg(mt), reg(s))));
    out.push(Stmt::For {
        reg: j,
        start: i64(0),
        end: keys.count.clone(),
        step: 1,
        body: pass1,
    });

    // Pass 2: weights, their sum, P V.
    let s_stored = load(Space::Shared, Ty::F32, s_addr);
    let mut pass2 = Vec::new();
    let mut step = j;
    let weight = if plan.stick_breaking() {
        // Keys from the last (the nearest), each weighed behind the row's running sum of
        // softplus (in `m`), which it then joins.
        let stick = StickKey::new(r);
        step = r.add("j_step", Ty::I64);
        pass2.push(Stmt::Set(j, from_last(keys.count.clone(), reg(step))));
        pass2.extend(stick.weigh(s_stored, reg(row.m)));
        pass2.push(Stmt::Set(row.m, add(reg(row.m), reg(stick.added))));
        reg(stick.weight)
    } else if plan.sigmoid() {
        // Each key weighs sigmoid(s) on its own: no max, no rescale.
        sigmoid_weight(s_stored)
    } else {
        let m_use = rescale(r, row, mt, &mut out);
        exp2_twice(sub(s_stored, reg(m_use)))
    };
    let p = r.add("p", Ty::F32);
    pass2.push(Stmt::Set(p, weight));
    pass2.push(Stmt::Set(row.l, add(reg(row.l), reg(p))));
    pass2.extend(value_product(row, sh, j, dv, p));
    out.push(Stmt::For {
        reg: step,
        start: i64(0),
        end: keys.count,
        step: 1,
        body: pass2,
    });
    out
}

/// The online softmax's move to the new max (the row's and the tile's `mt`): the rescale of
/// the sum and accumulator, pushed to `out`; returns the register of the shift the tile's
/// probabilities take (`m_use`, 0 while the max is still `-inf`).
fn rescale(r: &mut Regs, row: &RowState, mt: Reg, out: &mut Vec<Stmt>) -> Reg {
    let (m, l) = (row.m, row.l);
    let (m_use, alpha) = (r.add("m_use", Ty::F32), r.add("alpha", Ty::F32));
    let m_new = bin(Bin::Max, reg(m), reg(mt));
    out.push(Stmt::Set(
        m_use,
        select(
            bin(Bin::Eq, m_new.clone(), f32(f32::NEG_INFINITY)),
            f32(0.0),
            m_new.clone(),
        ),
    ));
    out.push(Stmt::Set(alpha, exp2_twice(sub(reg(m), reg(m_use)))));
    out.push(Stmt::Set(m, m_new));
    out.push(Stmt::Set(l, mul(reg(l), reg(alpha))));
    for &a in row.acc {
        out.push(Stmt::Set(a, mul(reg(a), reg(alpha))));
    }
    m_use
}

/// `acc += p v_j` for the staged value row of key `j`.
fn value_product(row: &RowState, sh: &TileShared, j: Reg, dv: i64, p: Reg) -> Vec<Stmt> {
    row.acc
        .iter()
        .enumerate()
        .map(|(i, &a)| {
            let vd = load(
                Space::Shared,
                Ty::F32,
                add(mul(reg(j), i64(dv * 4)), i64(sh.v + 4 * i as i64)),
            );
            Stmt::Set(a, fma(reg(p), vd, reg(a)))
        })
        .collect()
}

/// Where `valid` holds, writes the row's output `acc / l` (as `acc` times one reciprocal) to
/// row `out_row` of `out` (f32 rows of `acc.len()`) and its log-sum-exp `(m + log2 l) ln 2` to
/// `lse`; rows with no kept key get 0 and `-inf`. Under `normalize = sigmoid` or
/// `stick_breaking` (weights not normalized), `acc` and `ln l`.
fn simt_epilogue(
    plan: &KernelPlan,
    row: &RowState,
    out: Expr,
    lse: Expr,
    out_row: Expr,
    valid: Expr,
) -> Stmt {
    let (m, l) = (row.m, row.l);
    let dv = row.acc.len() as i64;
    // The sum is 0 only when no key was kept; a NaN sum (a NaN score) carries NaN through.
    let nonempty = bin(Bin::Ne, reg(l), f32(0.0));
    let mut store = Vec::new();
    for (i, &a) in row.acc.iter().enumerate() {
        let addr = add(
            out.clone(),
            add(mul(out_row.clone(), i64(dv * 4)), i64(4 * i as i64)),
        );
        // Sigmoid and stick-breaking weights are not normalized: out is the accumulator.
        let value = if plan.unnormalized() {
            reg(a)
        } else {
            select(nonempty.clone(), mul(reg(a), reciprocal(reg(l))), f32(0.0))
        };
        store.push(Stmt::Store(Space::Global, addr, value));
    }
    let lse_value = if plan.unnormalized() {
        mul(un(Un::Lg2, reg(l)), f32(std::f32::consts::LN_2))
    } else {
        lse_of_half(reg(m), reg(l))
    };
    store.push(Stmt::Store(
        Space::Global,
        at(lse, out_row, 4),
        select(nonempty, lse_value, f32(f32::NEG_INFINITY)),
    ));
    Stmt::If(valid, store, vec![])
}
