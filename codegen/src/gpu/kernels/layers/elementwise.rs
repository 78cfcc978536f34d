//! Elementwise kernels, one thread per element: the MLP activations, pointwise maps
//! (multipliers, softcaps), residual and bias adds, and learned sinks folded into attention rows.

use super::{exp, kernel, p, per_thread};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Reg, Space, Stmt, Ty, Un};
use crate::gpu::kernels::Regs;
use crate::gpu::launch::LaunchRecord;

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
