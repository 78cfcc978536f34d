//! What the SIMT backward's kernels share: rows loaded, rotated and stored, K and V or Q and dO
//! tiles staged in shared memory, the probabilities recomputed from the saved lse, and the delta
//! and parameter-gradient kernels.

use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Reg, Space, Special, Stmt, Ty};
use crate::gpu::kernels::score::param_element;
use crate::gpu::kernels::{
    Env, Regs, Side, exp2_twice, program, rope_params, rotate, sigmoid_slope, sigmoid_weight,
    special64,
};
use crate::gpu::launch::{BackwardArgs, LaunchRecord};
use crate::plan::{KernelPlan, ParamLayout};
use attn_dsl::modifier::Expr as M;

/// Threads per CTA: query rows (`backward_delta`, `backward_dq`) or keys (`backward_dkdv`).
pub const ROWS: u32 = 64;

pub(super) fn param(name: &str) -> Expr {
    Expr::Param(BackwardArgs::position(name))
}

/// The grids of [`lower`]'s kernels for a call of `[batch, Sq, Skv]` whose parameter buffer
/// holds `param_len` values.
pub fn grids(plan: &KernelPlan, [b, sq, skv]: [usize; 3], param_len: usize) -> Vec<[u32; 3]> {
    let rows = ROWS as usize;
    let (hq, hkv) = (plan.shape.heads, plan.shape.kv_heads);
    let delta = [(b * hq as usize * sq).div_ceil(rows) as u32, 1, 1];
    let dkdv = [skv.div_ceil(rows) as u32, hkv, b as u32];
    if plan.params.is_empty() {
        return vec![delta, [sq.div_ceil(rows) as u32, hq, b as u32], dkdv];
    }
    let ctas = (param_copies(plan, [b, sq, skv], param_len) / rows) as u32;
    let sums = [param_len.div_ceil(rows) as u32, 1, 1];
    vec![delta, [ctas, 1, 1], dkdv, sums]
}

/// Bytes of partial parameter gradients a call may hold: each `backward_dq` thread keeps its
/// own copy of every parameter's gradient, so the copies are capped by this.
const PARTIALS_BYTES: usize = 1 << 28;

/// `backward_dq` CTAs at most for a plan with parameters: enough to fill a large GPU.
const MAX_PARAM_CTAS: usize = 1024;

/// The copies of the parameters' gradients a call of `[batch, Sq, Skv]` with `param_len`
/// parameter values sums (`backward_dq`'s threads: a CTA of [`ROWS`] per block of query rows,
/// down to what [`PARTIALS_BYTES`] holds, at least one CTA), 0 for a plan without parameters.
/// It depends on the plan and the call's shapes alone, so the sums are the same from run to run.
pub fn param_copies(plan: &KernelPlan, [b, sq, _]: [usize; 3], param_len: usize) -> usize {
    let len = if plan.params.is_empty() { 0 } else { param_len };
    if len == 0 {
        return 0;
    }
    let rows = ROWS as usize;
    let blocks = b * plan.shape.heads as usize * sq.div_ceil(rows);
    let fits = PARTIALS_BYTES / (rows * len * 4);
    blocks.min(fits).clamp(1, MAX_PARAM_CTAS) * rows
}

pub(super) fn kernel(name: &str, r: Regs, shared_bytes: i64, body: Vec<Stmt>) -> Kernel {
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
pub(super) fn load_row(regs: &[Reg], base: Expr, row: Expr) -> Vec<Stmt> {
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

/// [`load_row`], then RoPE at position `pos` for operand `side` when the plan has it.
pub(super) fn load_rotated_row(
    r: &mut Regs,
    plan: &KernelPlan,
    regs: &[Reg],
    (base, row): (Expr, Expr),
    (pos, side): (Expr, Side),
) -> Vec<Stmt> {
    let mut out = load_row(regs, base, row);
    if let Some(rope) = &plan.rope {
        out.extend(rotate(r, rope, regs, pos, &rope_params(param, side), false));
    }
    out
}

/// `base[row * width + c] = regs[c]` for every `c` (f32, global).
pub(super) fn store_row(regs: &[Reg], base: Expr, row: Expr) -> Vec<Stmt> {
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
pub(super) fn dot_shared(regs: &[Reg], at: Expr) -> Expr {
    regs.iter().enumerate().fold(f32(0.0), |acc, (c, &x)| {
        let y = load(Space::Shared, Ty::F32, add(at.clone(), i64(4 * c as i64)));
        fma(reg(x), y, acc)
    })
}

/// `acc[c] += w * shared[at + 4 c]` for every `c`.
pub(super) fn axpy_shared(acc: &[Reg], w: Expr, at: Expr) -> Vec<Stmt> {
    acc.iter()
        .enumerate()
        .map(|(c, &a)| {
            let y = load(Space::Shared, Ty::F32, add(at.clone(), i64(4 * c as i64)));
            Stmt::Set(a, fma(w.clone(), y, reg(a)))
        })
        .collect()
}

pub(super) fn f32_regs(r: &mut Regs, name: &str, n: i64) -> Vec<Reg> {
    (0..n)
        .map(|i| r.add(format!("{name}{i}"), Ty::F32))
        .collect()
}

/// Rows `first..first + tile` of a tensor (rows of `width` f32 from `base`, `count` rows in
/// all) into shared memory at `shared`, times `factor`, zeros past `count`. Rows to rotate when
/// the plan has RoPE: thread `t < tile` loads row `first + t` into registers, rotates it and
/// stores it. Otherwise every thread copies elements, coalesced.
pub(super) struct Stage<'a> {
    pub(super) base: Expr,
    pub(super) first: Expr,
    pub(super) count: Expr,
    pub(super) width: i64,
    pub(super) tile: i64,
    pub(super) shared: i64,
    pub(super) factor: f32,
    pub(super) rotation: Option<Rotation<'a>>,
}

/// How staged rows of operand `side` rotate: through registers `tmp`, row `r` at position
/// `pos(r)`.
pub(super) struct Rotation<'a> {
    pub(super) tmp: &'a [Reg],
    pub(super) pos: &'a dyn Fn(Expr) -> Expr,
    pub(super) side: Side,
}

pub(super) fn stage(r: &mut Regs, plan: &KernelPlan, s: Stage) -> Vec<Stmt> {
    let tid = special64(Special::Tid);
    let rows = i64::from(ROWS);
    let clamp = |row: Expr| bin(Bin::Min, row, sub(s.count.clone(), i64(1)));
    let factor = s.factor;
    match (s.rotation, &plan.rope) {
        (Some(Rotation { tmp, pos, side }), Some(rope)) => {
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
                &rope_params(param, side),
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
pub(in crate::gpu::kernels) fn stage_row_stats(
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
pub(super) fn delta(plan: &KernelPlan) -> Kernel {
    let (regs, body) = delta_body(plan, param, None, ROWS);
    kernel("backward_delta", regs, 0, body)
}

/// The body of a delta kernel (one thread per query row, `threads` a CTA): `delta[row] =
/// sum_c dout[row][c] * out[row][c]`, with out f32 and dout f32 or (`dout_half`) 16-bit, the
/// record's fields by `param`.
pub(in crate::gpu::kernels) fn delta_body(
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
pub(super) struct Pair {
    pub(super) env: Env,
    /// The key is inside the call and the row kept some key.
    pub(super) inside: Expr,
}

/// `keep = ` whether the pair is kept, then `p = 2^(2 (score - lse))`, `ds = p (dp - D) * d
/// score / d raw`, and `dS_final = p (dp - D)` (the parameters' factor), each 0 unless kept.
/// Under `normalize = sigmoid`: `p = sigmoid(score)` and `dS_final = dp p (1 - p)`, with no
/// row term (`lse_half` and `delta` are not read).
pub(super) fn probabilities(
    plan: &KernelPlan,
    pair: &Pair,
    keep: Reg,
    lse_half: Expr,
    dp: Expr,
    delta: Expr,
) -> (Stmt, [Expr; 3]) {
    let grad = plan
        .score_grad
        .as_ref()
        .expect("backward plans have a score derivative");
    let mut kept = pair.inside.clone();
    if !matches!(plan.program.mask, M::Bool(true)) {
        kept = bin(Bin::And, kept, program(&plan.program.mask, &pair.env));
    }
    let score = program(&plan.program.score, &pair.env);
    let (p, ds_final) = if plan.sigmoid() {
        let p = select(reg(keep), sigmoid_weight(score.clone()), f32(0.0));
        (p, mul(dp, sigmoid_slope(score)))
    } else {
        let p = select(reg(keep), exp2_twice(sub(score, lse_half)), f32(0.0));
        (p.clone(), mul(p, sub(dp, delta)))
    };
    // Selected after the product: the derivative may be NaN or infinite where the pair is not
    // kept.
    let ds = select(
        reg(keep),
        mul(ds_final.clone(), program(grad, &pair.env)),
        f32(0.0),
    );
    let ds_final = select(reg(keep), ds_final, f32(0.0));
    (Stmt::Set(keep, kept), [p, ds, ds_final])
}

/// The parameter buffer of a plan's score program, for the kernels' [`Env`].
pub(super) fn param_buffer(plan: &KernelPlan) -> Option<(Expr, ParamLayout)> {
    (!plan.params.is_empty()).then(|| (param("params"), plan.params.clone()))
}

/// A `backward_dq` thread's own copy of the parameters' gradients, in `param_partials` (plans
/// with parameters): copy `ctaid.x * ROWS + tid`, written by that thread alone, in the order
/// of its rows and keys, so the sums need no atomics and come out the same every run.
pub(super) struct ParamPartials {
    /// The thread's copy, of `param_len` floats.
    pub(super) copy: Reg,
}

impl ParamPartials {
    pub(super) fn new(plan: &KernelPlan, r: &mut Regs) -> Option<ParamPartials> {
        (!plan.params.is_empty()).then(|| ParamPartials {
            copy: r.add("param_copy", Ty::I64),
        })
    }

    /// The address of element `element` of the thread's copy.
    pub(super) fn at(&self, element: Expr) -> Expr {
        let first = mul(reg(self.copy), param("param_len"));
        at(param("param_partials"), add(first, element), 4)
    }

    /// Sets the thread's copy and zeros it.
    pub(super) fn zero(&self, r: &mut Regs) -> Vec<Stmt> {
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
                end: param("param_len"),
                step: 1,
                body: vec![Stmt::Store(Space::Global, self.at(reg(e)), f32(0.0))],
            },
        ]
    }

    /// For each parameter read of the score program, `partial[element] += dS * d score / d
    /// read` where `counted` (the pair is kept and the row is the thread's own), `dS = p (dP -
    /// D)` (`centered`).
    pub(super) fn scatter(
        &self,
        plan: &KernelPlan,
        env: &Env,
        counted: Expr,
        centered: Expr,
    ) -> Vec<Stmt> {
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
pub(super) fn dparams() -> Kernel {
    let len = param("param_len");
    let mut r = Regs { list: Vec::new() };
    let (e, c, acc) = (
        r.add("element", Ty::I64),
        r.add("copy", Ty::I64),
        r.add("acc", Ty::F32),
    );
    let partial = at(
        param("param_partials"),
        add(mul(reg(c), len.clone()), reg(e)),
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
        Stmt::If(bin(Bin::Lt, reg(e), len), sum, vec![]),
    ];
    kernel("backward_dparams", r, 0, body)
}
