//! A backward plan lowered to GPU IR: the SIMT f32 path, in three kernels (four with parameters).
//!
//! - `backward_delta`: `D = rowsum(dout * out)`, one thread per query row.
//! - `backward_dq`: one thread per query row of one (batch, head), as the forward's SIMT kernel.
//!   Per key tile, the CTA stages K (rotated) and V in shared memory. Each thread recomputes
//!   its row's probabilities from the saved lse and takes `dS = P (dP - D) * d score / d raw`.
//!   It accumulates `dQ += dS K` in registers, then scales dq by the hoisted q factor and
//!   rotates it back.
//! - `backward_dkdv`: one thread per key of one (batch, kv head). Per query tile of each head of
//!   the group, the CTA stages Q (rotated and scaled), dout, lse and D. Each thread accumulates
//!   `dV += P dO` and `dK += dS Q`, summed over the group in registers. Then it rotates dk back.
//!
//! - `backward_dparams` (plans with parameters): the parameters' gradients. `backward_dq` then
//!   runs [`param_copies`] threads, each striding over blocks of query rows, and each adds
//!   `dS * d score / d read` of its own rows into its own copy of every parameter's gradient
//!   (`param_partials`). This kernel sums the copies in copy order, one thread per element.
//!
//! dQ takes a separate pass instead of atomics, for two reasons. The IR has no atomics. A
//! separate pass also keeps the gradients deterministic, as do the parameters' per-thread copies. The cost is recomputing `Q K^T` and
//! `dO V^T` once more (seven tile products instead of five). Every pair evaluates the mask: no
//! tile is skipped yet. Inputs are contiguous BHSD f32.

use super::forward::key_tile;
use super::score::param_element;
use super::{Env, Regs, exp2_twice, program, rope_params, rotate, special64};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Reg, Space, Special, Stmt, Ty};
use crate::gpu::launch::{BackwardArgs, LaunchRecord};
use crate::plan::{KernelPlan, ParamLayout, PlanKind};
use attn_dsl::modifier::Expr as M;

/// Threads per CTA: query rows (`backward_delta`, `backward_dq`) or keys (`backward_dkdv`).
pub const ROWS: u32 = 64;

fn param(name: &str) -> Expr {
    Expr::Param(BackwardArgs::position(name))
}

/// The kernels of a backward plan, in launch order: delta, dq, dk and dv, and for a plan with
/// parameters `backward_dparams`, which sums the dq kernel's partial parameter gradients.
pub fn lower(plan: &KernelPlan) -> Vec<Kernel> {
    assert_eq!(
        plan.kind,
        PlanKind::Backward,
        "the GPU backward kernels lower backward plans"
    );
    let mut kernels = vec![delta(plan), dq(plan), dkdv(plan)];
    if !plan.params.is_empty() {
        kernels.push(dparams(plan));
    }
    kernels
}

/// The grids of [`lower`]'s kernels for a call of `[batch, Sq, Skv]`.
pub fn grids(plan: &KernelPlan, [b, sq, skv]: [usize; 3]) -> Vec<[u32; 3]> {
    let rows = ROWS as usize;
    let (hq, hkv) = (plan.shape.heads, plan.shape.kv_heads);
    let delta = [(b * hq as usize * sq).div_ceil(rows) as u32, 1, 1];
    let dkdv = [skv.div_ceil(rows) as u32, hkv, b as u32];
    if plan.params.is_empty() {
        return vec![delta, [sq.div_ceil(rows) as u32, hq, b as u32], dkdv];
    }
    let ctas = (param_copies(plan, [b, sq, skv]) / rows) as u32;
    let sums = [plan.params.len().div_ceil(rows) as u32, 1, 1];
    vec![delta, [ctas, 1, 1], dkdv, sums]
}

/// Bytes of partial parameter gradients a call may hold: each `backward_dq` thread keeps its
/// own copy of every parameter's gradient, so the copies are capped by this.
const PARTIALS_BYTES: usize = 1 << 28;

/// `backward_dq` CTAs at most for a plan with parameters: enough to fill a large GPU.
const MAX_PARAM_CTAS: usize = 1024;

/// The copies of the parameters' gradients a call of `[batch, Sq, Skv]` sums (`backward_dq`'s
/// threads: a CTA of [`ROWS`] per block of query rows, down to what [`PARTIALS_BYTES`] holds, at
/// least one CTA), 0 for a plan without parameters. It depends on the plan and the call's shape
/// alone, so the sums are the same from run to run.
pub fn param_copies(plan: &KernelPlan, [b, sq, _]: [usize; 3]) -> usize {
    let len = plan.params.len();
    if len == 0 {
        return 0;
    }
    let rows = ROWS as usize;
    let blocks = b * plan.shape.heads as usize * sq.div_ceil(rows);
    let fits = PARTIALS_BYTES / (rows * len * 4);
    blocks.min(fits).clamp(1, MAX_PARAM_CTAS) * rows
}

fn kernel(name: &str, r: Regs, shared_bytes: i64, body: Vec<Stmt>) -> Kernel {
    Kernel {
        name: name.into(),
        params: BackwardArgs::params(),
        regs: r.list,
        shared_bytes: shared_bytes as u32,
        threads: ROWS,
        ctas_per_sm: 1,
        body,
    }
}

/// `regs[c] = base[row * width + c]` for every `c` (f32, global).
fn load_row(regs: &[Reg], base: Expr, row: Expr) -> Vec<Stmt> {
    let width = regs.len() as i64;
    regs.iter()
        .enumerate()
        .map(|(c, &x)| {
            let addr = add(
                base.clone(),
                add(mul(row.clone(), i64(width * 4)), i64(4 * c as i64)),
            );
            Stmt::Set(x, load(Space::Global, Ty::F32, addr))
        })
        .collect()
}

/// [`load_row`], then RoPE at position `pos` when the plan has it.
fn load_rotated_row(
    r: &mut Regs,
    plan: &KernelPlan,
    regs: &[Reg],
    base: Expr,
    row: Expr,
    pos: Expr,
) -> Vec<Stmt> {
    let mut out = load_row(regs, base, row);
    if let Some(rope) = &plan.rope {
        out.extend(rotate(r, rope, regs, pos, &rope_params(param), false));
    }
    out
}

/// `base[row * width + c] = regs[c]` for every `c` (f32, global).
fn store_row(regs: &[Reg], base: Expr, row: Expr) -> Vec<Stmt> {
    let width = regs.len() as i64;
    regs.iter()
        .enumerate()
        .map(|(c, &x)| {
            let addr = add(
                base.clone(),
                add(mul(row.clone(), i64(width * 4)), i64(4 * c as i64)),
            );
            Stmt::Store(Space::Global, addr, reg(x))
        })
        .collect()
}

/// `sum_c regs[c] * shared[at + 4 c]`.
fn dot_shared(regs: &[Reg], at: Expr) -> Expr {
    regs.iter().enumerate().fold(f32(0.0), |acc, (c, &x)| {
        let y = load(Space::Shared, Ty::F32, add(at.clone(), i64(4 * c as i64)));
        fma(reg(x), y, acc)
    })
}

/// `acc[c] += w * shared[at + 4 c]` for every `c`.
fn axpy_shared(acc: &[Reg], w: Expr, at: Expr) -> Vec<Stmt> {
    acc.iter()
        .enumerate()
        .map(|(c, &a)| {
            let y = load(Space::Shared, Ty::F32, add(at.clone(), i64(4 * c as i64)));
            Stmt::Set(a, fma(w.clone(), y, reg(a)))
        })
        .collect()
}

fn f32_regs(r: &mut Regs, name: &str, n: i64) -> Vec<Reg> {
    (0..n)
        .map(|i| r.add(format!("{name}{i}"), Ty::F32))
        .collect()
}

/// Rows `first..first + tile` of a tensor (rows of `width` f32 from `base`, `count` rows in
/// all) into shared memory at `shared`, times `factor`, zeros past `count`. Rows to rotate when
/// the plan has RoPE: thread `t < tile` loads row `first + t` into registers, rotates it and
/// stores it. Otherwise every thread copies elements, coalesced.
struct Stage<'a> {
    base: Expr,
    first: Expr,
    count: Expr,
    width: i64,
    tile: i64,
    shared: i64,
    factor: f32,
    rotation: Option<Rotation<'a>>,
}

/// How staged rows rotate: through registers `tmp`, row `r` at position `pos(r)`.
struct Rotation<'a> {
    tmp: &'a [Reg],
    pos: &'a dyn Fn(Expr) -> Expr,
}

fn stage(r: &mut Regs, plan: &KernelPlan, s: Stage) -> Vec<Stmt> {
    let tid = special64(Special::Tid);
    let rows = i64::from(ROWS);
    let clamp = |row: Expr| bin(Bin::Min, row, sub(s.count.clone(), i64(1)));
    let factor = s.factor;
    match (s.rotation, &plan.rope) {
        (Some(Rotation { tmp, pos }), Some(rope)) => {
            let row = r.add("stage_row", Ty::I64);
            let mut body = vec![Stmt::Set(row, add(s.first.clone(), tid.clone()))];
            let inside = bin(Bin::Lt, reg(row), s.count.clone());
            for (c, &x) in tmp.iter().enumerate() {
                let addr = add(
                    s.base.clone(),
                    add(mul(clamp(reg(row)), i64(s.width * 4)), i64(4 * c as i64)),
                );
                let value = load(Space::Global, Ty::F32, addr);
                body.push(Stmt::Set(x, select(inside.clone(), value, f32(0.0))));
            }
            body.extend(rotate(
                r,
                rope,
                tmp,
                pos(clamp(reg(row))),
                &rope_params(param),
                false,
            ));
            for (c, &x) in tmp.iter().enumerate() {
                let addr = add(
                    mul(tid.clone(), i64(s.width * 4)),
                    i64(s.shared + 4 * c as i64),
                );
                body.push(Stmt::Store(Space::Shared, addr, mul(reg(x), f32(factor))));
            }
            vec![Stmt::If(bin(Bin::Lt, tid, i64(s.tile)), body, vec![])]
        }
        _ => {
            let element = r.add("stage_element", Ty::I64);
            let row = add(s.first.clone(), bin(Bin::Div, reg(element), i64(s.width)));
            let src = add(
                s.base.clone(),
                mul(
                    add(
                        mul(clamp(row.clone()), i64(s.width)),
                        bin(Bin::Rem, reg(element), i64(s.width)),
                    ),
                    i64(4),
                ),
            );
            vec![Stmt::For {
                reg: element,
                start: tid,
                end: i64(s.tile * s.width),
                step: rows,
                body: vec![Stmt::Store(
                    Space::Shared,
                    add(mul(reg(element), i64(4)), i64(s.shared)),
                    select(
                        bin(Bin::Lt, row, s.count),
                        mul(load(Space::Global, Ty::F32, src), f32(factor)),
                        f32(0.0),
                    ),
                )],
            }]
        }
    }
}

/// Threads `0..rows` store the lse (in half base-2 units) and D of query rows `first..first +
/// rows` (clamped into Sq) of the head whose row 0 is `head_row0`, as f32 at the shared byte
/// offsets `[lse_sh, delta_sh]`, the record's fields found by `param`.
pub(super) fn stage_row_stats(
    param: fn(&str) -> Expr,
    rows: i64,
    first: Expr,
    head_row0: Expr,
    [lse_sh, delta_sh]: [i64; 2],
) -> Stmt {
    let tid = special64(Special::Tid);
    let row = bin(Bin::Min, add(first, tid.clone()), sub(param("sq"), i64(1)));
    let stats_at = add(head_row0, row);
    let lse = load(
        Space::Global,
        Ty::F32,
        at(param("lse"), stats_at.clone(), 4),
    );
    Stmt::If(
        bin(Bin::Lt, tid.clone(), i64(rows)),
        vec![
            Stmt::Store(
                Space::Shared,
                add(mul(tid.clone(), i64(4)), i64(lse_sh)),
                mul(lse, f32(std::f32::consts::LOG2_E / 2.0)),
            ),
            Stmt::Store(
                Space::Shared,
                add(mul(tid, i64(4)), i64(delta_sh)),
                load(Space::Global, Ty::F32, at(param("delta"), stats_at, 4)),
            ),
        ],
        vec![],
    )
}

/// `backward_delta`: `delta[row] = sum_c dout[row][c] * out[row][c]`.
fn delta(plan: &KernelPlan) -> Kernel {
    let (regs, body) = delta_body(plan, param, None, ROWS);
    kernel("backward_delta", regs, 0, body)
}

/// The body of a delta kernel (one thread per query row, `threads` a CTA): `delta[row] =
/// sum_c dout[row][c] * out[row][c]`, with out f32 and dout f32 or (`dout_half`) 16-bit, the
/// record's fields by `param`.
pub(super) fn delta_body(
    plan: &KernelPlan,
    param: fn(&str) -> Expr,
    dout_half: Option<crate::gpu::ir::Half>,
    threads: u32,
) -> (Regs, Vec<Stmt>) {
    let dv = i64::from(plan.shape.v_dim);
    let hq = i64::from(plan.shape.heads);
    let mut r = Regs { list: Vec::new() };
    let (row, acc, c) = (
        r.add("row", Ty::I64),
        r.add("acc", Ty::F32),
        r.add("c", Ty::I64),
    );
    let element = add(mul(reg(row), i64(dv)), reg(c));
    let dout = match dout_half {
        Some(half) => Expr::LoadHalf(
            Space::Global,
            half,
            Box::new(at(param("dout"), element.clone(), 2)),
        ),
        None => load(
            Space::Global,
            Ty::F32,
            at(param("dout"), element.clone(), 4),
        ),
    };
    let out = load(Space::Global, Ty::F32, at(param("out"), element, 4));
    // A loop, not unrolled by hand: the kernel is bound by memory, and a row's loads held at
    // once would take a register each.
    let sum = vec![
        Stmt::Set(acc, f32(0.0)),
        Stmt::For {
            reg: c,
            start: i64(0),
            end: i64(dv),
            step: 1,
            body: vec![Stmt::Set(acc, fma(dout, out, reg(acc)))],
        },
        Stmt::Store(Space::Global, at(param("delta"), reg(row), 4), reg(acc)),
    ];
    let total = mul(mul(param("batch"), i64(hq)), param("sq"));
    let body = vec![
        Stmt::Set(
            row,
            add(
                mul(special64(Special::Ctaid(0)), i64(i64::from(threads))),
                special64(Special::Tid),
            ),
        ),
        Stmt::If(bin(Bin::Lt, reg(row), total), sum, vec![]),
    ];
    (r, body)
}

/// The score program's variables, its derivative, and whether the pair is kept, for one
/// (query, key) pair whose raw score is in register `s`.
struct Pair {
    env: Env,
    /// The key is inside the call and the row kept some key.
    inside: Expr,
}

/// `keep = ` whether the pair is kept, then `p = 2^(2 (score - lse))` and `ds = p (dp - D) * d
/// score / d raw`, both 0 unless kept.
fn probabilities(
    plan: &KernelPlan,
    pair: &Pair,
    keep: Reg,
    lse_half: Expr,
    dp: Expr,
    delta: Expr,
) -> (Stmt, [Expr; 2]) {
    let grad = plan
        .score_grad
        .as_ref()
        .expect("backward plans have a score derivative");
    let mut kept = pair.inside.clone();
    if !matches!(plan.program.mask, M::Bool(true)) {
        kept = bin(Bin::And, kept, program(&plan.program.mask, &pair.env));
    }
    let score = program(&plan.program.score, &pair.env);
    let p = select(reg(keep), exp2_twice(sub(score, lse_half)), f32(0.0));
    let ds = mul(mul(p.clone(), sub(dp, delta)), program(grad, &pair.env));
    (Stmt::Set(keep, kept), [p, select(reg(keep), ds, f32(0.0))])
}

/// The parameter buffer of a plan's score program, for the kernels' [`Env`].
fn param_buffer(plan: &KernelPlan) -> Option<(Expr, ParamLayout)> {
    (!plan.params.is_empty()).then(|| (param("params"), plan.params.clone()))
}

/// A `backward_dq` thread's own copy of the parameters' gradients, in `param_partials` (plans
/// with parameters): copy `ctaid.x * ROWS + tid`, written by that thread alone, in the order
/// of its rows and keys, so the sums need no atomics and come out the same every run.
struct ParamPartials {
    /// The thread's copy.
    copy: Reg,
    /// Floats per copy.
    len: i64,
}

impl ParamPartials {
    fn new(plan: &KernelPlan, r: &mut Regs) -> Option<ParamPartials> {
        (!plan.params.is_empty()).then(|| ParamPartials {
            copy: r.add("param_copy", Ty::I64),
            len: plan.params.len() as i64,
        })
    }

    /// The address of element `element` of the thread's copy.
    fn at(&self, element: Expr) -> Expr {
        let first = mul(reg(self.copy), i64(self.len));
        at(param("param_partials"), add(first, element), 4)
    }

    /// Sets the thread's copy and zeros it.
    fn zero(&self, r: &mut Regs) -> Vec<Stmt> {
        let e = r.add("param_element", Ty::I64);
        vec![
            Stmt::Set(
                self.copy,
                add(
                    mul(special64(Special::Ctaid(0)), i64(i64::from(ROWS))),
                    special64(Special::Tid),
                ),
            ),
            Stmt::For {
                reg: e,
                start: i64(0),
                end: i64(self.len),
                step: 1,
                body: vec![Stmt::Store(Space::Global, self.at(reg(e)), f32(0.0))],
            },
        ]
    }

    /// For each parameter read of the score program, `partial[element] += dS * d score / d
    /// read` where `counted` (the pair is kept and the row is the thread's own), `dS = p (dP -
    /// D)` (`centered`).
    fn scatter(&self, plan: &KernelPlan, env: &Env, counted: Expr, centered: Expr) -> Vec<Stmt> {
        let layout = &plan.params;
        plan.param_grads
            .iter()
            .map(|(read, d)| {
                let addr = self.at(param_element(read, layout, env));
                let term = mul(centered.clone(), program(d, env));
                let old = load(Space::Global, Ty::F32, addr.clone());
                Stmt::Store(
                    Space::Global,
                    addr,
                    add(old, select(counted.clone(), term, f32(0.0))),
                )
            })
            .collect()
    }
}

/// `backward_dparams`: one thread per parameter element, `dparams[e] = sum over copies c, in
/// order, of param_partials[c][e]`.
fn dparams(plan: &KernelPlan) -> Kernel {
    let len = plan.params.len() as i64;
    let mut r = Regs { list: Vec::new() };
    let (e, c, acc) = (
        r.add("element", Ty::I64),
        r.add("copy", Ty::I64),
        r.add("acc", Ty::F32),
    );
    let partial = at(
        param("param_partials"),
        add(mul(reg(c), i64(len)), reg(e)),
        4,
    );
    let sum = vec![
        Stmt::Set(acc, f32(0.0)),
        Stmt::For {
            reg: c,
            start: i64(0),
            end: param("param_copies"),
            step: 1,
            body: vec![Stmt::Set(
                acc,
                add(reg(acc), load(Space::Global, Ty::F32, partial)),
            )],
        },
        Stmt::Store(Space::Global, at(param("dparams"), reg(e), 4), reg(acc)),
    ];
    let body = vec![
        Stmt::Set(
            e,
            add(
                mul(special64(Special::Ctaid(0)), i64(i64::from(ROWS))),
                special64(Special::Tid),
            ),
        ),
        Stmt::If(bin(Bin::Lt, reg(e), i64(len)), sum, vec![]),
    ];
    kernel("backward_dparams", r, 0, body)
}

/// `backward_dq`: one query row per thread. With parameters, a CTA strides over the blocks of
/// query rows (the grid is [`param_copies`] threads) and each thread adds its rows' parameter
/// gradients into its own copy.
fn dq(plan: &KernelPlan) -> Kernel {
    let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
    let bc = i64::from(key_tile(plan));
    let shared = bc * (d + dv) * 4;
    let mut r = Regs { list: Vec::new() };
    let Some(partials) = ParamPartials::new(plan, &mut r) else {
        let (row, mut body) = QueryRow::load(plan, &mut r, None);
        body.push(row.key_tiles(plan, &mut r, None));
        body.push(row.store_dq(plan, &mut r));
        return kernel("backward_dq", r, shared, body);
    };
    let (step, block) = (r.add("block_step", Ty::I64), r.add("block", Ty::I64));
    let (row, mut per_block) = QueryRow::load(plan, &mut r, Some(block));
    per_block.push(row.key_tiles(plan, &mut r, Some(&partials)));
    per_block.push(row.store_dq(plan, &mut r));
    per_block.insert(
        0,
        Stmt::Set(
            block,
            add(special64(Special::Ctaid(0)), mul(reg(step), ctas())),
        ),
    );
    let hq = i64::from(plan.shape.heads);
    let blocks = mul(mul(param("batch"), i64(hq)), query_blocks());
    let mut body = partials.zero(&mut r);
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
    kernel("backward_dq", r, shared, body)
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
struct QueryRow {
    row: Reg,
    batch: Reg,
    head: Reg,
    kvh: Reg,
    qrow: Reg,
    qpos: Reg,
    index: Reg,
    q: Vec<Reg>,
    go: Vec<Reg>,
    acc: Vec<Reg>,
    lse_half: Reg,
    delta: Reg,
}

impl QueryRow {
    /// The row's registers, and the statements that load it: in the block of query rows the
    /// CTA's grid position names, or in block `block` (blocks numbered by batch, head, then
    /// rows).
    fn load(plan: &KernelPlan, r: &mut Regs, block: Option<Reg>) -> (QueryRow, Vec<Stmt>) {
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
            param("q"),
            reg(index),
            reg(qpos),
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
    fn key_tiles(&self, plan: &KernelPlan, r: &mut Regs, partials: Option<&ParamPartials>) -> Stmt {
        let (d, dv) = (i64::from(plan.shape.qk_dim), i64::from(plan.shape.v_dim));
        let hkv = i64::from(plan.shape.kv_heads);
        let bc = i64::from(key_tile(plan));
        let (k_sh, v_sh) = (0, bc * d * 4);
        let kv_row0 = mul(
            add(mul(reg(self.batch), i64(hkv)), reg(self.kvh)),
            param("skv"),
        );
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
                shared: k_sh,
                factor: 1.0,
                rotation: Some(Rotation {
                    tmp: &k_tmp,
                    pos: &key_pos,
                }),
            },
        );
        tile.extend(stage(
            r,
            plan,
            Stage {
                base: add(param("v"), mul(kv_row0, i64(dv * 4))),
                first: first.clone(),
                count: param("skv"),
                width: dv,
                tile: bc,
                shared: v_sh,
                factor: 1.0,
                rotation: None,
            },
        ));
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
        let (set_keep, [pv, dsv]) = probabilities(
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
            let centered = mul(reg(p), sub(reg(dp), reg(self.delta)));
            per_key.extend(partials.scatter(plan, &pair.env, counted, centered));
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

    /// dq = q_scale * sum dS K, rotated back to the unrotated q, stored for rows inside Sq.
    fn store_dq(&self, plan: &KernelPlan, r: &mut Regs) -> Stmt {
        let acc = &self.acc;
        let mut store = acc
            .iter()
            .map(|&a| Stmt::Set(a, mul(reg(a), f32(plan.q_scale as f32))))
            .collect::<Vec<_>>();
        if let Some(rope) = &plan.rope {
            let tables = rope_params(param);
            store.extend(rotate(r, rope, acc, reg(self.qpos), &tables, true));
        }
        store.extend(store_row(acc, param("dq"), reg(self.index)));
        Stmt::If(bin(Bin::Lt, reg(self.row), param("sq")), store, vec![])
    }
}

/// `backward_dkdv`: one key per thread, every query of its group's heads.
fn dkdv(plan: &KernelPlan) -> Kernel {
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
struct KeyRow {
    row: Reg,
    batch: Reg,
    kvh: Reg,
    krow: Reg,
    kpos: Reg,
    index: Reg,
    k: Vec<Reg>,
    v: Vec<Reg>,
    dk: Vec<Reg>,
    dv: Vec<Reg>,
}

impl KeyRow {
    /// The key's registers, and the statements that load it.
    fn load(plan: &KernelPlan, r: &mut Regs) -> (KeyRow, Vec<Stmt>) {
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
            param("k"),
            reg(index),
            reg(kpos),
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
                shared: q_sh,
                factor: plan.q_scale as f32,
                rotation: Some(Rotation {
                    tmp: &q_tmp,
                    pos: &q_pos,
                }),
            },
        );
        tile.extend(stage(
            r,
            plan,
            Stage {
                base: add(param("dout"), mul(head_row0.clone(), i64(dv * 4))),
                first: first.clone(),
                count: param("sq"),
                width: dv,
                tile: bq,
                shared: do_sh,
                factor: 1.0,
                rotation: None,
            },
        ));
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
        let (set_keep, [pv, dsv]) = probabilities(plan, &pair, keep, lse_i, reg(dp), delta_i);
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

    /// dk back to the unrotated k; both stored, for keys inside Skv.
    fn store(&self, plan: &KernelPlan, r: &mut Regs) -> Stmt {
        let mut store = Vec::new();
        if let Some(rope) = &plan.rope {
            let tables = rope_params(param);
            store.extend(rotate(r, rope, &self.dk, reg(self.kpos), &tables, true));
        }
        store.extend(store_row(&self.dk, param("dk"), reg(self.index)));
        store.extend(store_row(&self.dv, param("dv"), reg(self.index)));
        Stmt::If(bin(Bin::Lt, reg(self.row), param("skv")), store, vec![])
    }
}
