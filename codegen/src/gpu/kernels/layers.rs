//! The non-attention pieces of a decoder, lowered to GPU IR like the attention kernels (no
//! hand-written CUDA): row norms (RMSNorm, LayerNorm), the MLP activations (SwiGLU's
//! `silu(gate) * up`, tanh-GELU), residual adds, embedding lookups and the argmax that greedy
//! decoding samples with. All take and give f32 rows in global memory; an embedding table may be
//! bf16 or f16 as its checkpoint stored it.
//!
//! Row kernels (norms, argmax) run one CTA per row, each thread striding over the row and the
//! CTA reducing through warp shuffles and one shared slot per warp. Elementwise kernels run one
//! thread per element.

use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Half, Kernel, Reg, Space, Special, Stmt, Ty, Un};
use crate::gpu::kernels::Regs;
use crate::gpu::launch::LaunchRecord;

/// Threads per CTA of every layer kernel (8 warps).
pub const THREADS: u32 = 256;
const WARPS: i64 = THREADS as i64 / 32;

/// A row norm.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormKind {
    /// `x / sqrt(mean(x^2) + eps) * w`.
    Rms,
    /// `(x - mean) / sqrt(var + eps) * w + b`.
    Layer,
}

/// An MLP activation, in place on `up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `up = silu(gate) * up`.
    SwiGlu,
    /// `up = gelu(up)` (tanh approximation).
    Gelu,
    /// `up = up Phi(up)`, the exact GELU (the normal distribution's `Phi` through erf, by
    /// Abramowitz and Stegun's 7.1.26: at most 1.5e-7 from the true erf).
    GeluExact,
    /// `up = gelu(gate) * up` (tanh approximation).
    GeGlu,
    /// gpt-oss: `g = min(gate, limit)`, `up = (clamp(up, -limit, limit) + 1) g sigmoid(alpha
    /// g)`; the two constants as f32 bits (so the kind compares exactly).
    ClampedSwiGlu {
        /// `alpha.to_bits()`.
        alpha: u32,
        /// `limit.to_bits()`.
        limit: u32,
    },
}

crate::gpu::launch::launch_record! {
    /// A norm launch: one CTA per row.
    NormArgs {
        /// `[rows, width]` f32 inputs.
        x: Address,
        /// `[width]` f32 weights.
        weight: Address,
        /// `[width]` f32 biases (LayerNorm), else unused.
        bias: Address,
        /// `[rows, width]` f32 outputs.
        out: Address,
    }
}

crate::gpu::launch::launch_record! {
    /// An elementwise launch: one thread per element.
    ElementwiseArgs {
        /// The buffer written in place (`up` for activations, the residual for adds).
        x: Address,
        /// The other operand (`gate`, or the added rows); unused by GELU.
        other: Address,
        /// Elements.
        count: Scalar,
    }
}

crate::gpu::launch::launch_record! {
    /// An embedding lookup: one CTA per token.
    EmbedArgs {
        /// `[tokens]` i32 token ids (checked against the vocabulary by the host).
        tokens: Address,
        /// `[vocab, width]` rows of the table's type.
        table: Address,
        /// `[tokens, width]` f32 outputs.
        out: Address,
    }
}

crate::gpu::launch::launch_record! {
    /// A row argmax: one CTA per row.
    ArgmaxArgs {
        /// `[rows, width]` f32 values.
        x: Address,
        /// `[rows]` i32 outputs: the index of each row's largest value (the first of equals).
        out: Address,
    }
}

fn p<R: LaunchRecord>(name: &str) -> Expr {
    Expr::Param(R::position(name))
}

fn tid() -> Expr {
    cast(Expr::Special(Special::Tid), Ty::I64)
}

fn row() -> Expr {
    cast(Expr::Special(Special::Ctaid(0)), Ty::I64)
}

/// `for i in tid..width step THREADS { body(i) }`.
fn strided(i: Reg, width: u32, body: Vec<Stmt>) -> Stmt {
    Stmt::For {
        reg: i,
        start: tid(),
        end: i64(i64::from(width)),
        step: i64::from(THREADS),
        body,
    }
}

/// Sums `acc` over the CTA: a butterfly within each warp, one shared slot per warp (from byte
/// `slot0`), then every thread adds the slots, so each ends with the total in `acc`.
fn cta_sum(acc: Reg, slot0: i64) -> Vec<Stmt> {
    let mut s: Vec<Stmt> = [16, 8, 4, 2, 1]
        .into_iter()
        .map(|m| Stmt::Set(acc, add(reg(acc), Expr::ShflXor(Box::new(reg(acc)), m))))
        .collect();
    let warp = bin(Bin::Div, tid(), i64(32));
    s.push(Stmt::If(
        bin(Bin::Eq, cast(Expr::Special(Special::Lane), Ty::I64), i64(0)),
        vec![Stmt::Store(
            Space::Shared,
            add(i64(slot0), mul(warp, i64(4))),
            reg(acc),
        )],
        vec![],
    ));
    s.push(Stmt::Barrier);
    s.push(Stmt::Set(acc, f32(0.0)));
    for w in 0..WARPS {
        s.push(Stmt::Set(
            acc,
            add(reg(acc), load(Space::Shared, Ty::F32, i64(slot0 + 4 * w))),
        ));
    }
    // The slots are read before any thread writes them again.
    s.push(Stmt::Barrier);
    s
}

fn kernel(
    name: &str,
    params: Vec<(String, Ty)>,
    regs: Regs,
    shared: u32,
    body: Vec<Stmt>,
) -> Kernel {
    Kernel {
        name: name.into(),
        params,
        regs: regs.list,
        shared_bytes: shared,
        threads: THREADS,
        ctas_per_sm: 4,
        body,
    }
}

/// The norm of rows of `width` values with epsilon `eps` (statistics in f32, two passes for
/// LayerNorm's variance), `bias` added when `with_bias`. The weights (and biases) hold
/// `weight_rows` rows of `width` that repeat down the rows: row `r` takes weight row
/// `r % weight_rows` (1: one row for all; a head count: cohere's per-head q/k norms).
pub fn norm(kind: NormKind, width: u32, eps: f32, with_bias: bool, weight_rows: u32) -> Kernel {
    type A = NormArgs;
    let mut r = Regs { list: Vec::new() };
    let (i, acc, mean, inv, v) = (
        r.add("i", Ty::I64),
        r.add("acc", Ty::F32),
        r.add("mean", Ty::F32),
        r.add("inv", Ty::F32),
        r.add("v", Ty::F32),
    );
    let at = |base: Expr, i: Reg| add(base, mul(reg(i), i64(4)));
    let x_at = |i: Reg| {
        load(
            Space::Global,
            Ty::F32,
            at(add(p::<A>("x"), mul(row(), i64(4 * i64::from(width)))), i),
        )
    };
    let n = f32(width as f32);
    let mut body = vec![Stmt::Set(mean, f32(0.0))];
    if kind == NormKind::Layer {
        body.push(Stmt::Set(acc, f32(0.0)));
        body.push(strided(
            i,
            width,
            vec![Stmt::Set(acc, add(reg(acc), x_at(i)))],
        ));
        body.extend(cta_sum(acc, 0));
        body.push(Stmt::Set(mean, bin(Bin::Div, reg(acc), n.clone())));
    }
    body.push(Stmt::Set(acc, f32(0.0)));
    body.push(strided(
        i,
        width,
        vec![
            Stmt::Set(v, sub(x_at(i), reg(mean))),
            Stmt::Set(acc, fma(reg(v), reg(v), reg(acc))),
        ],
    ));
    body.extend(cta_sum(acc, 0));
    body.push(Stmt::Set(
        inv,
        bin(
            Bin::Div,
            f32(1.0),
            un(Un::Sqrt, add(bin(Bin::Div, reg(acc), n), f32(eps))),
        ),
    ));
    // The row's weights: the one row, or row `r % weight_rows`.
    let w_at = |base: Expr| match weight_rows {
        1 => at(base, i),
        n => at(
            add(
                base,
                mul(
                    bin(Bin::Rem, row(), i64(i64::from(n))),
                    i64(4 * i64::from(width)),
                ),
            ),
            i,
        ),
    };
    let weighted = mul(
        mul(sub(x_at(i), reg(mean)), reg(inv)),
        load(Space::Global, Ty::F32, w_at(p::<A>("weight"))),
    );
    let value = if with_bias {
        add(weighted, load(Space::Global, Ty::F32, w_at(p::<A>("bias"))))
    } else {
        weighted
    };
    body.push(strided(
        i,
        width,
        vec![Stmt::Store(
            Space::Global,
            at(add(p::<A>("out"), mul(row(), i64(4 * i64::from(width)))), i),
            value,
        )],
    ));
    let name = match kind {
        NormKind::Rms => "rms_norm",
        NormKind::Layer => "layer_norm",
    };
    kernel(name, A::params(), r, 4 * WARPS as u32, body)
}

/// `e^x` through `ex2` (`ex2.approx`).
fn exp(x: Expr) -> Expr {
    un(Un::Ex2, mul(x, f32(std::f32::consts::LOG2_E)))
}

/// An MLP activation over `count` elements in place on `x` (`other` is SwiGLU's gate).
pub fn activation(kind: Activation) -> Kernel {
    type A = ElementwiseArgs;
    let mut r = Regs { list: Vec::new() };
    let (i, u, g) = (
        r.add("i", Ty::I64),
        r.add("u", Ty::F32),
        r.add("g", Ty::F32),
    );
    let x_at = add(p::<A>("x"), mul(reg(i), i64(4)));
    // 0.5 x (1 + tanh(y)) = x - x / (e^{2y} + 1), y = sqrt(2/pi) (x + 0.044715 x^3).
    let gelu = |x: Reg| {
        let y = mul(
            f32(0.797_884_6),
            fma(mul(f32(0.044_715), mul(reg(x), reg(x))), reg(x), reg(x)),
        );
        sub(
            reg(x),
            bin(Bin::Div, reg(x), add(exp(mul(y, f32(2.0))), f32(1.0))),
        )
    };
    // The exact GELU's erf keeps its `t` in `g` (set once `u` is loaded).
    let (set_t, phi) = normal_cdf(u, g);
    let value = match kind {
        // silu(g) * u = g u / (1 + e^-g).
        Activation::SwiGlu => bin(
            Bin::Div,
            mul(reg(g), reg(u)),
            add(f32(1.0), exp(un(Un::Neg, reg(g)))),
        ),
        Activation::Gelu => gelu(u),
        Activation::GeluExact => mul(reg(u), phi),
        Activation::GeGlu => mul(gelu(g), reg(u)),
        Activation::ClampedSwiGlu { alpha, limit } => {
            let (alpha, limit) = (f32::from_bits(alpha), f32::from_bits(limit));
            let gate = bin(Bin::Min, reg(g), f32(limit));
            let up = bin(Bin::Max, bin(Bin::Min, reg(u), f32(limit)), f32(-limit));
            // (up + 1) g / (1 + e^(-alpha g)).
            bin(
                Bin::Div,
                mul(add(up, f32(1.0)), gate.clone()),
                add(f32(1.0), exp(mul(gate, f32(-alpha)))),
            )
        }
    };
    let mut run = vec![Stmt::Set(u, load(Space::Global, Ty::F32, x_at.clone()))];
    if !matches!(kind, Activation::Gelu | Activation::GeluExact) {
        run.push(Stmt::Set(
            g,
            load(
                Space::Global,
                Ty::F32,
                add(p::<A>("other"), mul(reg(i), i64(4))),
            ),
        ));
    }
    if kind == Activation::GeluExact {
        run.push(set_t);
    }
    run.push(Stmt::Store(Space::Global, x_at, value));
    let name = match kind {
        Activation::SwiGlu => "swiglu",
        Activation::Gelu => "gelu",
        Activation::GeluExact => "gelu_exact",
        Activation::GeGlu => "geglu",
        Activation::ClampedSwiGlu { .. } => "clamped_swiglu",
    };
    kernel(
        name,
        A::params(),
        r,
        0,
        per_thread(i, 1, p::<A>("count"), run),
    )
}

/// The standard normal distribution's `Phi(x) = (1 + erf(x / sqrt 2)) / 2`, with `t` a scratch
/// register: for `z = |x| / sqrt 2`, `1 - erf(z) = poly(1 / (1 + 0.3275911 z)) e^(-z^2)`
/// (Abramowitz and Stegun 7.1.26), so `Phi(x)` is `1 - tail / 2` for `x >= 0` and `tail / 2`
/// below. The statement sets `t` and must run before the expression.
fn normal_cdf(x: Reg, t: Reg) -> (Stmt, Expr) {
    const A: [f32; 5] = [
        0.254_829_6,
        -0.284_496_74,
        1.421_413_8,
        -1.453_152,
        1.061_405_4,
    ];
    let z = mul(un(Un::Abs, reg(x)), f32(std::f32::consts::FRAC_1_SQRT_2));
    let t_of = bin(
        Bin::Div,
        f32(1.0),
        fma(f32(0.327_591_1), z.clone(), f32(1.0)),
    );
    // Horner: ((((a5 t + a4) t + a3) t + a2) t + a1) t.
    let poly = A[..4]
        .iter()
        .rev()
        .fold(f32(A[4]), |acc, &a| fma(acc, reg(t), f32(a)));
    let half_tail = mul(
        mul(mul(poly, reg(t)), f32(0.5)),
        exp(un(Un::Neg, mul(z.clone(), z))),
    );
    let phi = select(
        bin(Bin::Ge, reg(x), f32(0.0)),
        sub(f32(1.0), half_tail.clone()),
        half_tail,
    );
    (Stmt::Set(t, t_of), phi)
}

/// A map of `count` elements in place on `x` (`other` unused).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pointwise {
    /// `x = factor x` (embedding, residual and logit multipliers).
    Scale(f32),
    /// `x = cap tanh(x / cap)` (a final logit softcap).
    Softcap(f32),
}

/// `op` over `count` elements in place on `x`.
pub fn pointwise(op: Pointwise) -> Kernel {
    type A = ElementwiseArgs;
    let mut r = Regs { list: Vec::new() };
    let (i, v) = (r.add("i", Ty::I64), r.add("v", Ty::F32));
    let x_at = add(p::<A>("x"), mul(reg(i), i64(4)));
    let (name, value) = match op {
        Pointwise::Scale(factor) => ("scale", mul(reg(v), f32(factor))),
        // cap tanh(y) = cap - 2 cap / (e^{2y} + 1), y = x / cap: +-cap where e^{2y} overflows
        // or vanishes.
        Pointwise::Softcap(cap) => (
            "softcap",
            sub(
                f32(cap),
                bin(
                    Bin::Div,
                    f32(2.0 * cap),
                    add(exp(mul(reg(v), f32(2.0 / cap))), f32(1.0)),
                ),
            ),
        ),
    };
    let body = vec![
        Stmt::Set(v, load(Space::Global, Ty::F32, x_at.clone())),
        Stmt::Store(Space::Global, x_at, value),
    ];
    kernel(
        name,
        A::params(),
        r,
        0,
        per_thread(i, 1, p::<A>("count"), body),
    )
}

crate::gpu::launch::launch_record! {
    /// Learned sinks folded into attention rows: one thread per output element.
    SinkArgs {
        /// `[rows, width]` f32 attention outputs, scaled in place.
        out: Address,
        /// `[rows]` f32 log-sum-exps of the rows (without the sink).
        lse: Address,
        /// `[heads]` f32 sink logits.
        sinks: Address,
        /// `rows * width`.
        count: Scalar,
        /// Values per row.
        width: Scalar,
        /// Row `r` is of head `(r / per_head) % heads`: the rows of one head's queries
        /// (head-major rows), or 1 (token-major rows).
        per_head: Scalar,
        /// Query heads.
        heads: Scalar,
    }
}

/// A learned sink per head added to each row's softmax as one more logit with no value: the
/// row times `e^lse / (e^lse + e^sink) = 1 / (1 + e^(sink - lse))` (0 for an empty row, whose
/// `lse` is `-inf`). The sinks must be finite (the host checks).
pub fn sink_rows() -> Kernel {
    type A = SinkArgs;
    let mut r = Regs { list: Vec::new() };
    let (i, row_i, head) = (
        r.add("i", Ty::I64),
        r.add("row", Ty::I64),
        r.add("head", Ty::I64),
    );
    let f32_at = |base: Expr, index: Expr| add(base, mul(index, i64(4)));
    let x_at = f32_at(p::<A>("out"), reg(i));
    let lse = load(Space::Global, Ty::F32, f32_at(p::<A>("lse"), reg(row_i)));
    let sink = load(Space::Global, Ty::F32, f32_at(p::<A>("sinks"), reg(head)));
    let keep = bin(Bin::Div, f32(1.0), add(f32(1.0), exp(sub(sink, lse))));
    let body = vec![
        Stmt::Set(row_i, bin(Bin::Div, reg(i), p::<A>("width"))),
        Stmt::Set(
            head,
            bin(
                Bin::Rem,
                bin(Bin::Div, reg(row_i), p::<A>("per_head")),
                p::<A>("heads"),
            ),
        ),
        Stmt::Store(
            Space::Global,
            x_at.clone(),
            mul(load(Space::Global, Ty::F32, x_at), keep),
        ),
    ];
    kernel(
        "sink_rows",
        A::params(),
        r,
        0,
        per_thread(i, 1, p::<A>("count"), body),
    )
}

/// `x += other` over `count` elements.
pub fn residual_add() -> Kernel {
    type A = ElementwiseArgs;
    let mut r = Regs { list: Vec::new() };
    let i = r.add("i", Ty::I64);
    let x_at = add(p::<A>("x"), mul(reg(i), i64(4)));
    let sum = add(
        load(Space::Global, Ty::F32, x_at.clone()),
        load(
            Space::Global,
            Ty::F32,
            add(p::<A>("other"), mul(reg(i), i64(4))),
        ),
    );
    kernel(
        "residual_add",
        A::params(),
        r,
        0,
        per_thread(
            i,
            1,
            p::<A>("count"),
            vec![Stmt::Store(Space::Global, x_at, sum)],
        ),
    )
}

/// The body of a kernel with a thread per `per` consecutive values: `i = (ctaid.x * THREADS +
/// tid) * per`, then `body` when `i < count`.
fn per_thread(i: Reg, per: i64, count: Expr, body: Vec<Stmt>) -> Vec<Stmt> {
    vec![
        Stmt::Set(
            i,
            mul(add(mul(row(), i64(i64::from(THREADS))), tid()), i64(per)),
        ),
        Stmt::If(bin(Bin::Lt, reg(i), count), body, vec![]),
    ]
}

/// Rows of `width` values looked up by token; `table` holds f32 rows, or 16-bit ones.
pub fn embed(width: u32, table: Option<Half>) -> Kernel {
    type A = EmbedArgs;
    let mut r = Regs { list: Vec::new() };
    let (i, token) = (r.add("i", Ty::I64), r.add("token", Ty::I64));
    let size = if table.is_some() { 2 } else { 4 };
    let src = add(
        add(
            p::<A>("table"),
            mul(reg(token), i64(size * i64::from(width))),
        ),
        mul(reg(i), i64(size)),
    );
    let value = match table {
        Some(half) => Expr::LoadHalf(Space::Global, half, Box::new(src)),
        None => load(Space::Global, Ty::F32, src),
    };
    let body = vec![
        Stmt::Set(
            token,
            cast(
                load(
                    Space::Global,
                    Ty::I32,
                    add(p::<A>("tokens"), mul(row(), i64(4))),
                ),
                Ty::I64,
            ),
        ),
        strided(
            i,
            width,
            vec![Stmt::Store(
                Space::Global,
                add(
                    add(p::<A>("out"), mul(row(), i64(4 * i64::from(width)))),
                    mul(reg(i), i64(4)),
                ),
                value,
            )],
        ),
    ];
    kernel("embed", A::params(), r, 0, body)
}

/// What [`argmax`] gives for a row with no value above `-inf` (all NaN, say): no index.
pub const NO_CHOICE: u32 = i32::MAX as u32;

/// The index of each row's largest value (the first of equal ones; NaN is never chosen over a
/// number, and a row with no value above `-inf`, NaN throughout, gives [`NO_CHOICE`]), for
/// rows of `width` values.
pub fn argmax(width: u32) -> Kernel {
    type A = ArgmaxArgs;
    let mut r = Regs { list: Vec::new() };
    let (i, best, at, v, ov, oi, w) = (
        r.add("i", Ty::I64),
        r.add("best", Ty::F32),
        r.add("at", Ty::I32),
        r.add("v", Ty::F32),
        r.add("other_v", Ty::F32),
        r.add("other_i", Ty::I32),
        r.add("w", Ty::I64),
    );
    // (v, index) beats (best, at) when larger, or equal at a lower index.
    let better = |v: Expr, idx: Expr| {
        bin(
            Bin::Or,
            bin(Bin::Gt, v.clone(), reg(best)),
            bin(
                Bin::And,
                bin(Bin::Eq, v, reg(best)),
                bin(Bin::Lt, idx, reg(at)),
            ),
        )
    };
    let take = |v: Expr, idx: Expr| {
        vec![Stmt::If(
            better(v.clone(), idx.clone()),
            vec![Stmt::Set(best, v), Stmt::Set(at, idx)],
            vec![],
        )]
    };
    let mut body = vec![
        Stmt::Set(best, f32(f32::NEG_INFINITY)),
        Stmt::Set(at, Expr::Int(i64::from(i32::MAX), Ty::I32)),
        strided(
            i,
            width,
            [
                vec![Stmt::Set(
                    v,
                    load(
                        Space::Global,
                        Ty::F32,
                        add(
                            add(p::<A>("x"), mul(row(), i64(4 * i64::from(width)))),
                            mul(reg(i), i64(4)),
                        ),
                    ),
                )],
                take(reg(v), cast(reg(i), Ty::I32)),
            ]
            .concat(),
        ),
    ];
    for m in [16, 8, 4, 2, 1] {
        body.push(Stmt::Set(ov, Expr::ShflXor(Box::new(reg(best)), m)));
        body.push(Stmt::Set(oi, Expr::ShflXor(Box::new(reg(at)), m)));
        body.extend(take(reg(ov), reg(oi)));
    }
    // One (value, index) pair per warp in shared memory, then thread 0 picks among them.
    let warp = bin(Bin::Div, tid(), i64(32));
    body.push(Stmt::If(
        bin(Bin::Eq, cast(Expr::Special(Special::Lane), Ty::I64), i64(0)),
        vec![
            Stmt::Store(Space::Shared, mul(warp.clone(), i64(8)), reg(best)),
            Stmt::Store(Space::Shared, add(mul(warp, i64(8)), i64(4)), reg(at)),
        ],
        vec![],
    ));
    body.push(Stmt::Barrier);
    let pick = Stmt::For {
        reg: w,
        start: i64(0),
        end: i64(WARPS),
        step: 1,
        body: [
            vec![
                Stmt::Set(ov, load(Space::Shared, Ty::F32, mul(reg(w), i64(8)))),
                Stmt::Set(
                    oi,
                    load(Space::Shared, Ty::I32, add(mul(reg(w), i64(8)), i64(4))),
                ),
            ],
            take(reg(ov), reg(oi)),
        ]
        .concat(),
    };
    body.push(Stmt::If(
        bin(Bin::Eq, tid(), i64(0)),
        vec![
            pick,
            Stmt::Store(
                Space::Global,
                add(p::<A>("out"), mul(row(), i64(4))),
                reg(at),
            ),
        ],
        vec![],
    ));
    kernel("argmax", A::params(), r, 8 * WARPS as u32, body)
}

crate::gpu::launch::launch_record! {
    /// A swap of the two outer axes of `[a, b, width]` rows: one thread per output element (or
    /// pair of elements, for 16-bit outputs).
    SwapArgs {
        /// `[a, b, width]` f32 inputs.
        x: Address,
        /// `[b, a, width]` outputs.
        out: Address,
        /// The outer axis of the input.
        a: Scalar,
        /// The middle axis of the input.
        b: Scalar,
        /// Values per row (even for 16-bit outputs).
        width: Scalar,
    }
}

/// `[a, b, width]` f32 rows to `[b, a, width]`, as f32 or packed into a 16-bit format (rows of
/// q, k and v from projections `[tokens, heads, dim]` to the attention kernels' `[heads, tokens,
/// dim]` and back).
pub fn swap_outer(out: Option<Half>) -> Kernel {
    type A = SwapArgs;
    let mut r = Regs { list: Vec::new() };
    let (e, col, ib, ia, src, dst) = (
        r.add("e", Ty::I64),
        r.add("col", Ty::I64),
        r.add("ib", Ty::I64),
        r.add("ia", Ty::I64),
        r.add("src", Ty::I64),
        r.add("dst", Ty::I64),
    );
    // Each thread moves `per` values: one f32, or two packed 16-bit ones.
    let per = if out.is_some() { 2 } else { 1 };
    let total = mul(mul(p::<A>("a"), p::<A>("b")), p::<A>("width"));
    let x_at = |offset: i64| {
        load(
            Space::Global,
            Ty::F32,
            add(p::<A>("x"), mul(add(reg(src), i64(offset)), i64(4))),
        )
    };
    let store = match out {
        None => Stmt::Store(
            Space::Global,
            add(p::<A>("out"), mul(reg(dst), i64(4))),
            x_at(0),
        ),
        Some(half) => Stmt::Store(
            Space::Global,
            add(p::<A>("out"), mul(reg(dst), i64(2))),
            Expr::PackHalf(half, Box::new(x_at(0)), Box::new(x_at(1))),
        ),
    };
    let body = per_thread(
        e,
        per,
        total,
        vec![
            // e = (ia b + ib) width + col in the input.
            Stmt::Set(col, bin(Bin::Rem, reg(e), p::<A>("width"))),
            Stmt::Set(
                ib,
                bin(
                    Bin::Rem,
                    bin(Bin::Div, reg(e), p::<A>("width")),
                    p::<A>("b"),
                ),
            ),
            Stmt::Set(
                ia,
                bin(
                    Bin::Div,
                    bin(Bin::Div, reg(e), p::<A>("width")),
                    p::<A>("b"),
                ),
            ),
            Stmt::Set(src, reg(e)),
            Stmt::Set(
                dst,
                add(
                    mul(add(mul(reg(ib), p::<A>("a")), reg(ia)), p::<A>("width")),
                    reg(col),
                ),
            ),
            store,
        ],
    );
    let name = match out {
        None => "swap_outer_f32",
        Some(Half::Bf16) => "swap_outer_bf16",
        Some(Half::F16) => "swap_outer_f16",
    };
    kernel(name, A::params(), r, 0, body)
}

crate::gpu::launch::launch_record! {
    /// A bias added to rows: one thread per element.
    BiasArgs {
        /// `[rows, width]` f32 values, in place.
        x: Address,
        /// `[width]` f32 biases.
        bias: Address,
        /// Elements (`rows * width`).
        count: Scalar,
        /// Values per row.
        width: Scalar,
    }
}

/// `x[i] += bias[i % width]` over `count` elements.
pub fn bias_add() -> Kernel {
    type A = BiasArgs;
    let mut r = Regs { list: Vec::new() };
    let i = r.add("i", Ty::I64);
    let x_at = add(p::<A>("x"), mul(reg(i), i64(4)));
    let sum = add(
        load(Space::Global, Ty::F32, x_at.clone()),
        load(
            Space::Global,
            Ty::F32,
            add(
                p::<A>("bias"),
                mul(bin(Bin::Rem, reg(i), p::<A>("width")), i64(4)),
            ),
        ),
    );
    let body = per_thread(
        i,
        1,
        p::<A>("count"),
        vec![Stmt::Store(Space::Global, x_at, sum)],
    );
    kernel("bias_add", A::params(), r, 0, body)
}

/// How keys are rotated as they enter a cache: `dim` dimensions from `first_dim`, paired as
/// `layout` says; cos and sin rows of `dim / 2` per position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendRope {
    /// Rotated dimensions.
    pub dim: u32,
    /// The first rotated dimension of a row.
    pub first_dim: u32,
    /// How dimensions pair.
    pub layout: attn_dsl::RopeLayout,
}

crate::gpu::launch::launch_record! {
    /// New tokens' rows appended to a head-major cache `[kv_heads, capacity, width]`: one
    /// thread per stored value (or pair, for 16-bit caches).
    AppendArgs {
        /// `[tokens, kv_heads, width]` f32 rows (a projection's output).
        rows: Address,
        /// The cache's first byte.
        cache: Address,
        /// New tokens.
        tokens: Scalar,
        /// Kv heads.
        kv_heads: Scalar,
        /// Tokens the cache holds per head.
        capacity: Scalar,
        /// The position (and cache slot) of the first new token.
        pos0: Scalar,
        /// RoPE cosines: row `t` for the new token `t` (unused without RoPE).
        rope_cos: Address,
        /// RoPE sines, as `rope_cos`.
        rope_sin: Address,
    }
}

/// Appends rows of `width` values to a cache of `dtype` (`None`: f32), rotating them first when
/// `rope` says so (keys), as the host caches store them.
pub fn cache_append(width: u32, dtype: Option<Half>, rope: Option<AppendRope>) -> Kernel {
    type A = AppendArgs;
    let mut r = Regs { list: Vec::new() };
    let (e, col, tok, head) = (
        r.add("e", Ty::I64),
        r.add("col", Ty::I64),
        r.add("tok", Ty::I64),
        r.add("head", Ty::I64),
    );
    let w = i64::from(width);
    let per = if dtype.is_some() { 2 } else { 1 };
    let total = mul(mul(p::<A>("tokens"), p::<A>("kv_heads")), i64(w));
    let row_base = add(
        p::<A>("rows"),
        mul(
            add(mul(reg(tok), p::<A>("kv_heads")), reg(head)),
            i64(4 * w),
        ),
    );
    let x = |c: Expr| {
        load(
            Space::Global,
            Ty::F32,
            add(row_base.clone(), mul(c, i64(4))),
        )
    };
    // The stored value of column `c` (an I64 expression): rotated inside the RoPE columns.
    let value = |c: Expr| -> Expr {
        let Some(rope) = rope else { return x(c) };
        let (dim, base) = (i64::from(rope.dim), i64::from(rope.first_dim));
        let half = dim / 2;
        let rel = sub(c.clone(), i64(base));
        let inside = bin(
            Bin::And,
            bin(Bin::Ge, rel.clone(), i64(0)),
            bin(Bin::Lt, rel.clone(), i64(dim)),
        );
        // Column `rel` of the span: whether it is its pair's first element, the pair (its
        // table entry), and its partner's column.
        let pairing = rope.layout.pairing(rope.dim);
        let is_first = || {
            if pairing.stride == 1 {
                bin(Bin::Lt, rel.clone(), i64(pairing.half as i64))
            } else {
                let stride = i64(pairing.stride as i64);
                bin(Bin::Eq, bin(Bin::Rem, rel.clone(), stride), i64(0))
            }
        };
        let j = if pairing.stride == 1 {
            bin(Bin::Rem, rel.clone(), i64(pairing.half as i64))
        } else {
            bin(Bin::Div, rel.clone(), i64(pairing.stride as i64))
        };
        let to_partner = i64(pairing.partner as i64);
        let (first, partner) = (
            is_first(),
            select(
                is_first(),
                add(c.clone(), to_partner.clone()),
                sub(c.clone(), to_partner),
            ),
        );
        // Outside the rotated columns the table index is clamped to 0 (and unused).
        let entry = mul(
            add(mul(reg(tok), i64(half)), select(inside.clone(), j, i64(0))),
            i64(4),
        );
        let cos = load(
            Space::Global,
            Ty::F32,
            add(p::<A>("rope_cos"), entry.clone()),
        );
        let sin = load(Space::Global, Ty::F32, add(p::<A>("rope_sin"), entry));
        let partner = select(inside.clone(), partner, c.clone());
        let (xe, xp) = (x(c), x(partner));
        // (a, b) -> (a cos - b sin, b cos + a sin), the host caches' order of operations.
        let rotated = select(
            first,
            sub(mul(xe.clone(), cos.clone()), mul(xp.clone(), sin.clone())),
            add(mul(xe.clone(), cos), mul(xp, sin)),
        );
        select(inside, rotated, xe)
    };
    let slot = add(
        mul(reg(head), p::<A>("capacity")),
        add(p::<A>("pos0"), reg(tok)),
    );
    let dst = |size: i64| {
        add(
            p::<A>("cache"),
            mul(add(mul(slot.clone(), i64(w)), reg(col)), i64(size)),
        )
    };
    let store = match dtype {
        None => Stmt::Store(Space::Global, dst(4), value(reg(col))),
        Some(half) => Stmt::Store(
            Space::Global,
            dst(2),
            Expr::PackHalf(
                half,
                Box::new(value(reg(col))),
                Box::new(value(add(reg(col), i64(1)))),
            ),
        ),
    };
    let body = per_thread(
        e,
        per,
        total,
        vec![
            // e = (tok kv_heads + head) width + col.
            Stmt::Set(col, bin(Bin::Rem, reg(e), i64(w))),
            Stmt::Set(
                head,
                bin(Bin::Rem, bin(Bin::Div, reg(e), i64(w)), p::<A>("kv_heads")),
            ),
            Stmt::Set(
                tok,
                bin(Bin::Div, bin(Bin::Div, reg(e), i64(w)), p::<A>("kv_heads")),
            ),
            store,
        ],
    );
    kernel("cache_append", A::params(), r, 0, body)
}

crate::gpu::launch::launch_record! {
    /// Rows gathered by index: one thread per value.
    GatherArgs {
        /// `[.., width]` f32 rows.
        x: Address,
        /// `[rows]` i32 indices of the rows to take.
        index: Address,
        /// `[rows, width]` f32 outputs.
        out: Address,
        /// Rows gathered.
        rows: Scalar,
        /// Values per row.
        width: Scalar,
    }
}

/// `out[r] = x[index[r]]` for rows of `width` values.
pub fn gather_rows() -> Kernel {
    type A = GatherArgs;
    let mut r = Regs { list: Vec::new() };
    let (e, src) = (r.add("e", Ty::I64), r.add("src", Ty::I64));
    let width = p::<A>("width");
    let body = per_thread(
        e,
        1,
        mul(p::<A>("rows"), width.clone()),
        vec![
            Stmt::Set(
                src,
                cast(
                    load(
                        Space::Global,
                        Ty::I32,
                        add(
                            p::<A>("index"),
                            mul(bin(Bin::Div, reg(e), width.clone()), i64(4)),
                        ),
                    ),
                    Ty::I64,
                ),
            ),
            Stmt::Store(
                Space::Global,
                add(p::<A>("out"), mul(reg(e), i64(4))),
                load(
                    Space::Global,
                    Ty::F32,
                    add(
                        p::<A>("x"),
                        mul(
                            add(mul(reg(src), width.clone()), bin(Bin::Rem, reg(e), width)),
                            i64(4),
                        ),
                    ),
                ),
            ),
        ],
    );
    kernel("gather_rows", A::params(), r, 0, body)
}

crate::gpu::launch::launch_record! {
    /// A column range of `[a, b, in_width]` f32 rows copied into `[b, a, out_width]` rows at a
    /// column offset (MLA's queries and keys split and joined): one thread per copied value.
    ColumnsArgs {
        /// `[a, b, in_width]` f32 inputs.
        x: Address,
        /// `[b, a, out_width]` f32 outputs (the other columns untouched).
        out: Address,
        /// Outer axis of `x` (1: rows keep their order).
        a: Scalar,
        /// Middle axis of `x`.
        b: Scalar,
        /// Values per input row.
        in_width: Scalar,
        /// First input column copied.
        in_first: Scalar,
        /// Values per output row.
        out_width: Scalar,
        /// Output column of the first copied value.
        out_first: Scalar,
        /// Columns copied per row.
        width: Scalar,
    }
}

/// `out[j, i, out_first + c] = x[i, j, in_first + c]` for `c < width`: columns of rows copied
/// with the two outer axes swapped (`a = 1`: in order).
pub fn columns() -> Kernel {
    type A = ColumnsArgs;
    let mut r = Regs { list: Vec::new() };
    let (e, row, c, i, j) = (
        r.add("e", Ty::I64),
        r.add("row", Ty::I64),
        r.add("c", Ty::I64),
        r.add("i", Ty::I64),
        r.add("j", Ty::I64),
    );
    let width = p::<A>("width");
    let f32_at = |base: Expr, index: Expr| add(base, mul(index, i64(4)));
    let src = add(
        mul(add(mul(reg(i), p::<A>("b")), reg(j)), p::<A>("in_width")),
        add(p::<A>("in_first"), reg(c)),
    );
    let dst = add(
        mul(add(mul(reg(j), p::<A>("a")), reg(i)), p::<A>("out_width")),
        add(p::<A>("out_first"), reg(c)),
    );
    let body = per_thread(
        e,
        1,
        mul(mul(p::<A>("a"), p::<A>("b")), width.clone()),
        vec![
            // Input row `row = i b + j`, column `c`.
            Stmt::Set(row, bin(Bin::Div, reg(e), width.clone())),
            Stmt::Set(c, bin(Bin::Rem, reg(e), width)),
            Stmt::Set(i, bin(Bin::Div, reg(row), p::<A>("b"))),
            Stmt::Set(j, bin(Bin::Rem, reg(row), p::<A>("b"))),
            Stmt::Store(
                Space::Global,
                f32_at(p::<A>("out"), dst),
                load(Space::Global, Ty::F32, f32_at(p::<A>("x"), src)),
            ),
        ],
    );
    kernel("columns", A::params(), r, 0, body)
}

crate::gpu::launch::launch_record! {
    /// Weighted rows added back where they were gathered from (an expert's outputs into the
    /// mixture): one thread per value.
    ScatterArgs {
        /// `[.., width]` f32 rows added to.
        out: Address,
        /// `[rows, width]` f32 rows to add.
        x: Address,
        /// `[rows]` i32: the row of `out` each row of `x` adds to (distinct within a launch).
        index: Address,
        /// `[rows]` f32 weights.
        weights: Address,
        /// Rows added.
        rows: Scalar,
        /// Values per row.
        width: Scalar,
    }
}

/// `out[index[r]] += weights[r] x[r]` for rows of `width` values (the indices of one launch
/// distinct, so no two threads write one value).
pub fn scatter_add_rows() -> Kernel {
    type A = ScatterArgs;
    let mut r = Regs { list: Vec::new() };
    let (e, row, dst) = (
        r.add("e", Ty::I64),
        r.add("row", Ty::I64),
        r.add("dst", Ty::I64),
    );
    let width = p::<A>("width");
    let f32_at = |base: Expr, index: Expr| add(base, mul(index, i64(4)));
    let body = per_thread(
        e,
        1,
        mul(p::<A>("rows"), width.clone()),
        vec![
            Stmt::Set(row, bin(Bin::Div, reg(e), width.clone())),
            Stmt::Set(
                dst,
                f32_at(
                    p::<A>("out"),
                    add(
                        mul(
                            cast(
                                load(Space::Global, Ty::I32, f32_at(p::<A>("index"), reg(row))),
                                Ty::I64,
                            ),
                            width.clone(),
                        ),
                        bin(Bin::Rem, reg(e), width),
                    ),
                ),
            ),
            Stmt::Store(
                Space::Global,
                reg(dst),
                fma(
                    load(Space::Global, Ty::F32, f32_at(p::<A>("weights"), reg(row))),
                    load(Space::Global, Ty::F32, f32_at(p::<A>("x"), reg(e))),
                    load(Space::Global, Ty::F32, reg(dst)),
                ),
            ),
        ],
    );
    kernel("scatter_add_rows", A::params(), r, 0, body)
}

crate::gpu::launch::launch_record! {
    /// The partitions of split-KV attention merged by their log-sum-exp: one thread per output
    /// value.
    MergeArgs {
        /// `[partial rows, width]` f32 normalized partial outputs.
        parts: Address,
        /// `[partial rows]` f32 log-sum-exp of each partial row (`-inf`: no kept key).
        lse: Address,
        /// `[rows, slots]` i32: the partial rows of each output row, `-1` past its last.
        map: Address,
        /// `[rows, width]` f32 merged outputs.
        out: Address,
        /// `[rows]` f32 merged log-sum-exp (`-inf` for a row with no kept key, NaN for a NaN one).
        out_lse: Address,
        /// Output rows.
        rows: Scalar,
        /// Partial rows per output row, at most.
        slots: Scalar,
        /// Values per row.
        width: Scalar,
    }
}

/// Merges partial attention rows: `out = sum_p e^(l_p - m) o_p / sum_p e^(l_p - m)` with `m`
/// the largest `l_p`, and `lse = m + ln(sum_p e^(l_p - m))`; a row whose parts kept no key is 0
/// with lse `-inf`, and a NaN or +inf part (a score past `f32::MAX`) makes the row NaN (as the
/// host merge does).
pub fn merge_partitions() -> Kernel {
    type A = MergeArgs;
    let mut r = Regs { list: Vec::new() };
    let (e, out_row, col, slot, part, m, l, total, acc, nan) = (
        r.add("e", Ty::I64),
        r.add("row", Ty::I64),
        r.add("col", Ty::I64),
        r.add("slot", Ty::I64),
        r.add("part", Ty::I64),
        r.add("m", Ty::F32),
        r.add("l", Ty::F32),
        r.add("total", Ty::F32),
        r.add("acc", Ty::F32),
        r.add("nan", Ty::Pred),
    );
    let width = p::<A>("width");
    let part_of = add(
        p::<A>("map"),
        mul(add(mul(reg(out_row), p::<A>("slots")), reg(slot)), i64(4)),
    );
    let lse_of = |part: Expr| {
        load(
            Space::Global,
            Ty::F32,
            add(p::<A>("lse"), mul(part, i64(4))),
        )
    };
    // Visits the row's parts: `body` runs with `part` and `l` set, for parts that exist.
    let each = |body: Vec<Stmt>| Stmt::For {
        reg: slot,
        start: i64(0),
        end: p::<A>("slots"),
        step: 1,
        body: vec![
            Stmt::Set(
                part,
                cast(load(Space::Global, Ty::I32, part_of.clone()), Ty::I64),
            ),
            Stmt::If(
                bin(Bin::Ge, reg(part), i64(0)),
                [vec![Stmt::Set(l, lse_of(reg(part)))], body].concat(),
                vec![],
            ),
        ],
    };
    let value = load(
        Space::Global,
        Ty::F32,
        add(
            p::<A>("parts"),
            mul(add(mul(reg(part), width.clone()), reg(col)), i64(4)),
        ),
    );
    let weight = exp(sub(reg(l), reg(m)));
    let body = per_thread(
        e,
        1,
        mul(p::<A>("rows"), width.clone()),
        vec![
            Stmt::Set(out_row, bin(Bin::Div, reg(e), width.clone())),
            Stmt::Set(col, bin(Bin::Rem, reg(e), width)),
            Stmt::Set(m, f32(f32::NEG_INFINITY)),
            Stmt::Set(nan, Expr::Pred(false)),
            // NaN != NaN: a NaN lse marks the row, and so does +inf (a score past f32::MAX).
            each(vec![
                Stmt::Set(m, bin(Bin::Max, reg(m), reg(l))),
                Stmt::Set(nan, bin(Bin::Or, reg(nan), bin(Bin::Ne, reg(l), reg(l)))),
                Stmt::Set(
                    nan,
                    bin(Bin::Or, reg(nan), bin(Bin::Eq, reg(l), f32(f32::INFINITY))),
                ),
            ]),
            Stmt::Set(total, f32(0.0)),
            Stmt::Set(acc, f32(0.0)),
            Stmt::If(
                bin(Bin::Gt, reg(m), f32(f32::NEG_INFINITY)),
                vec![each(vec![
                    Stmt::Set(total, add(reg(total), weight.clone())),
                    Stmt::Set(acc, fma(weight, value, reg(acc))),
                ])],
                vec![],
            ),
            Stmt::Store(
                Space::Global,
                add(p::<A>("out"), mul(reg(e), i64(4))),
                select(
                    reg(nan),
                    f32(f32::NAN),
                    select(
                        bin(Bin::Gt, reg(total), f32(0.0)),
                        bin(Bin::Div, reg(acc), reg(total)),
                        f32(0.0),
                    ),
                ),
            ),
            // The row's first column writes its lse: m + ln(total).
            Stmt::If(
                bin(Bin::Eq, reg(col), i64(0)),
                vec![Stmt::Store(
                    Space::Global,
                    add(p::<A>("out_lse"), mul(reg(out_row), i64(4))),
                    select(
                        reg(nan),
                        f32(f32::NAN),
                        select(
                            bin(Bin::Gt, reg(total), f32(0.0)),
                            add(
                                reg(m),
                                mul(un(Un::Lg2, reg(total)), f32(std::f32::consts::LN_2)),
                            ),
                            f32(f32::NEG_INFINITY),
                        ),
                    ),
                )],
                vec![],
            ),
        ],
    );
    kernel("merge_partitions", A::params(), r, 0, body)
}
