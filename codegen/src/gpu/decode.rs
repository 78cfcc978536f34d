//! A decode plan lowered to GPU IR (SIMT f32): the query rows of one work item (the query
//! heads of a kv head times a few queries, one row per thread) against a list of key segments
//! read where a cache keeps them (the rows of its pages: no gather), for one partition of the
//! keys; the host merges partitions by their log-sum-exp (split-KV).
//!
//! Buffers: `q_rows` (f32 `[rows][qk_dim]`, before RoPE), `tasks` (per CTA, nine i64: first row,
//! rows, queries per head, position and call index of query 0, batch, first head, first segment,
//! segments), `segments` (seven i64 each: key row address, value row address, first key, keys,
//! tile code, elements between key rows, between value rows; rows of `qk_dim` or `v_dim` values
//! in the cache's dtype, f32, bf16 or f16), `out` (f32
//! `[rows][v_dim]`, normalized), `lse` (f32 per row), RoPE tables for the query positions. Keys
//! sit at the positions of their indices, rotated already.

use super::forward::{
    Env, KeyLoop, ROWS, Regs, RowState, TileShared, scaled_q_and_running_state, simt_epilogue,
    simt_tile, special64,
};
use super::ir::build::*;
use super::ir::{Bin, Expr, Half, Kernel, Reg, Space, Special, Stmt, Ty};
use crate::plan::{KernelPlan, PlanKind};
use attn_dsl::{DType, RopeLayout};

/// Parameters, in order.
pub const PARAMS: [&str; 8] = [
    "q_rows",
    "tasks",
    "segments",
    "out",
    "lse",
    "rope_cos",
    "rope_sin",
    "rope_pos0",
];

/// i64 fields of a task record.
pub const TASK_FIELDS: usize = 9;

/// i64 fields of a segment record.
pub const SEGMENT_FIELDS: usize = 7;

/// Keys per segment the kernel stages (K, V and scores within 48 KiB of shared memory).
pub fn segment_keys(plan: &KernelPlan) -> u32 {
    if plan.shape.qk_dim + plan.shape.v_dim <= 256 {
        32
    } else {
        16
    }
}

fn param(name: &str) -> Expr {
    let i = PARAMS
        .iter()
        .position(|p| *p == name)
        .expect("a known parameter");
    Expr::Param(i as u32)
}

/// Field `i` of the record at `base` (i64s).
fn field(base: &Expr, i: usize) -> Expr {
    load(Space::Global, Ty::I64, add(base.clone(), i64(8 * i as i64)))
}

/// Lowers the decode kernel of a plan (per-head KV; keys and values rows of `qk_dim` and
/// `v_dim` f32 in the cache).
pub fn lower(plan: &KernelPlan) -> Kernel {
    assert_eq!(
        plan.kind,
        PlanKind::Decode,
        "the GPU decode kernel lowers decode plans"
    );
    let (d, dv) = (plan.shape.qk_dim as i64, plan.shape.v_dim as i64);
    let seg = i64::from(segment_keys(plan));
    let rows_max = i64::from(ROWS);
    let mut r = Regs { list: Vec::new() };
    let mut body = Vec::new();
    let tid = special64(Special::Tid);

    // The task.
    let task = r.add("task", Ty::I64);
    body.push(Stmt::Set(
        task,
        add(
            param("tasks"),
            mul(special64(Special::Ctaid(0)), i64(8 * TASK_FIELDS as i64)),
        ),
    ));
    let names = [
        "row0", "rows", "q_len", "q_pos0", "qi0", "batch", "head0", "seg0", "nseg",
    ];
    let f: Vec<Reg> = names.iter().map(|n| r.add(*n, Ty::I64)).collect();
    for (i, &reg_i) in f.iter().enumerate() {
        body.push(Stmt::Set(reg_i, field(&reg(task), i)));
    }
    let [row0, rows, q_len, q_pos0, qi0, batch, head0, seg0, nseg] =
        <[Reg; 9]>::try_from(f).expect("nine fields");

    // This thread's row: head head0 + r / q_len, query r % q_len.
    let (row, head, qoff) = (
        r.add("row", Ty::I64),
        r.add("head", Ty::I64),
        r.add("q_off", Ty::I64),
    );
    body.push(Stmt::Set(
        row,
        bin(Bin::Min, tid.clone(), sub(reg(rows), i64(1))),
    ));
    body.push(Stmt::Set(
        head,
        add(reg(head0), bin(Bin::Div, reg(row), reg(q_len))),
    ));
    body.push(Stmt::Set(qoff, bin(Bin::Rem, reg(row), reg(q_len))));
    let qpos = add(reg(q_pos0), reg(qoff));

    // q: loaded, rotated, scaled.
    let q: Vec<Reg> = (0..d).map(|i| r.add(format!("q{i}"), Ty::F32)).collect();
    let q_row = add(param("q_rows"), mul(add(reg(row0), reg(row)), i64(4 * d)));
    for (i, &qi) in q.iter().enumerate() {
        body.push(Stmt::Set(
            qi,
            load(
                Space::Global,
                Ty::F32,
                add(q_row.clone(), i64(4 * i as i64)),
            ),
        ));
    }
    if let Some(rope) = &plan.rope {
        let half = i64::from(rope.rope.dim / 2);
        let first = rope.first_dim as usize;
        let (c, s, a, b) = (
            r.add("cos", Ty::F32),
            r.add("sin", Ty::F32),
            r.add("rot_a", Ty::F32),
            r.add("rot_b", Ty::F32),
        );
        let table_row = sub(qpos.clone(), param("rope_pos0"));
        for i in 0..half as usize {
            let (ia, ib) = match rope.rope.layout {
                RopeLayout::Half => (first + i, first + i + half as usize),
                RopeLayout::Interleaved => (first + 2 * i, first + 2 * i + 1),
            };
            let entry = add(mul(table_row.clone(), i64(half * 4)), i64(4 * i as i64));
            body.extend([
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
                Stmt::Set(a, reg(q[ia])),
                Stmt::Set(b, reg(q[ib])),
                Stmt::Set(q[ia], sub(mul(reg(a), reg(c)), mul(reg(b), reg(s)))),
                Stmt::Set(q[ib], add(mul(reg(b), reg(c)), mul(reg(a), reg(s)))),
            ]);
        }
    }
    let (m, l, acc) = scaled_q_and_running_state(plan, &mut r, &mut body, &q, dv);

    // Shared: K [seg][d], V [seg][dv], scores [ROWS][seg].
    let k_sh = 0;
    let v_sh = k_sh + seg * d * 4;
    let s_sh = v_sh + seg * dv * 4;
    let shared_bytes = s_sh + rows_max * seg * 4;

    let (si, srec, kaddr, vaddr, first, len, code) = (
        r.add("segment", Ty::I64),
        r.add("segment_record", Ty::I64),
        r.add("k_addr", Ty::I64),
        r.add("v_addr", Ty::I64),
        r.add("first_key", Ty::I64),
        r.add("keys", Ty::I64),
        r.add("code", Ty::I64),
    );
    let (k_stride, v_stride) = (r.add("k_stride", Ty::I64), r.add("v_stride", Ty::I64));
    let mut seg_body = vec![Stmt::Set(
        srec,
        add(
            param("segments"),
            mul(reg(si), i64(8 * SEGMENT_FIELDS as i64)),
        ),
    )];
    let fields = [kaddr, vaddr, first, len, code, k_stride, v_stride];
    for (i, &x) in fields.iter().enumerate() {
        seg_body.push(Stmt::Set(x, field(&reg(srec), i)));
    }
    let mut run = Vec::new();
    // Stage the segment's K and V rows (packed, in the cache's f32, bf16 or f16) into shared
    // memory as f32: element c of each region by thread c % ROWS, coalesced, in a loop (an
    // unrolled row per thread had ptxas hoist every load and spill).
    let half = match plan.dtype {
        DType::Bf16 => Some(Half::Bf16),
        DType::F16 => Some(Half::F16),
        DType::F32 => None,
    };
    let elem = if half.is_some() { 2 } else { 4 };
    let cache_load = |addr: Expr| match half {
        Some(h) => Expr::LoadHalf(Space::Global, h, Box::new(addr)),
        None => load(Space::Global, Ty::F32, addr),
    };
    let element = r.add("stage_element", Ty::I64);
    for (base, stride, width, shared) in [(kaddr, k_stride, d, k_sh), (vaddr, v_stride, dv, v_sh)] {
        // Element c is column c % width of row c / width, rows `stride` elements apart.
        let at = add(
            mul(bin(Bin::Div, reg(element), i64(width)), reg(stride)),
            bin(Bin::Rem, reg(element), i64(width)),
        );
        let src = add(reg(base), mul(at, i64(elem)));
        let dst = add(mul(reg(element), i64(4)), i64(shared));
        run.push(Stmt::For {
            reg: element,
            start: tid.clone(),
            end: mul(reg(len), i64(width)),
            step: i64::from(ROWS),
            body: vec![Stmt::Store(Space::Shared, dst, cache_load(src))],
        });
    }
    run.push(Stmt::Barrier);

    // Pass 1, the rescale, pass 2 (keys sit at the positions of their indices).
    let (j, key) = (r.add("j", Ty::I64), r.add("key", Ty::I64));
    let row_state = RowState {
        q: &q,
        acc: &acc,
        m,
        l,
    };
    let shared = TileShared {
        k: k_sh,
        v: v_sh,
        s: s_sh,
        keys: seg,
    };
    run.extend(simt_tile(
        &mut r,
        plan,
        &row_state,
        &shared,
        KeyLoop {
            j,
            key,
            key_at: add(reg(first), reg(j)),
            count: reg(len),
            in_range: None,
            masked_tile: bin(Bin::Eq, reg(code), i64(2)),
        },
        |score| Env {
            score,
            batch: reg(batch),
            head: reg(head),
            query: qpos.clone(),
            key: reg(key),
            query_index: add(reg(qi0), reg(qoff)),
            key_index: reg(key),
        },
    ));
    run.push(Stmt::Barrier);
    seg_body.push(Stmt::If(bin(Bin::Ne, reg(code), i64(0)), run, vec![]));
    body.push(Stmt::For {
        reg: si,
        start: reg(seg0),
        end: add(reg(seg0), reg(nseg)),
        step: 1,
        body: seg_body,
    });

    // Epilogue for the task's rows.
    body.push(simt_epilogue(
        &row_state,
        param("out"),
        param("lse"),
        add(reg(row0), tid.clone()),
        bin(Bin::Lt, tid, reg(rows)),
    ));

    Kernel {
        name: "attention_decode".into(),
        params: PARAMS.iter().map(|p| (p.to_string(), Ty::I64)).collect(),
        regs: r.list,
        shared_bytes: shared_bytes as u32,
        threads: ROWS,
        body,
    }
}
