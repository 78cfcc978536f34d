//! Evaluation of modifier expressions in f64 / i64, the reference meaning of the IR.

use super::{BinOp, Expr, Ty, UnOp, Var};

/// The value of a modifier expression.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    /// A float (f32 in kernels; f64 here).
    F(f64),
    /// An integer.
    I(i64),
    /// A boolean.
    B(bool),
}

impl Value {
    /// The value as a float (integers convert, booleans are 0 or 1).
    pub fn as_f64(self) -> f64 {
        match self {
            Value::F(x) => x,
            Value::I(i) => i as f64,
            Value::B(b) => f64::from(u8::from(b)),
        }
    }

    /// The value as a boolean (numbers are true when non-zero).
    pub fn as_bool(self) -> bool {
        match self {
            Value::B(b) => b,
            Value::I(i) => i != 0,
            Value::F(x) => x != 0.0,
        }
    }
}

/// The values of a learnable parameter tensor, as evaluation reads them.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamValues {
    /// The declared name.
    pub name: String,
    /// The resolved shape (row-major).
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values.
    pub values: Vec<f64>,
}

impl ParamValues {
    /// The element at `indices`, each clamped into its dimension as kernels clamp; NaN when the
    /// tensor is empty or the arity is wrong (a spec that was validated never reads those).
    pub fn at(&self, indices: &[i64]) -> f64 {
        self.flat_index(indices)
            .and_then(|flat| self.values.get(flat).copied())
            .unwrap_or(f64::NAN)
    }

    /// The flat (row-major) position of `indices`, clamped like [`ParamValues::at`].
    pub fn flat_index(&self, indices: &[i64]) -> Option<usize> {
        if indices.len() != self.shape.len() || self.shape.contains(&0) {
            return None;
        }
        Some(
            indices
                .iter()
                .zip(&self.shape)
                .fold(0usize, |flat, (&i, &dim)| {
                    flat * dim + (i.max(0) as usize).min(dim - 1)
                }),
        )
    }
}

/// The values of the variables at one (batch, head, query, key) point.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Env<'p> {
    /// [`Var::Score`].
    pub score: f64,
    /// [`Var::Batch`].
    pub b: i64,
    /// [`Var::Head`].
    pub h: i64,
    /// [`Var::Query`].
    pub q: i64,
    /// [`Var::Key`].
    pub k: i64,
    /// [`Var::QueryIndex`].
    pub qi: i64,
    /// [`Var::KeyIndex`].
    pub ki: i64,
    /// The tensors [`Expr::Param`] reads, by name (a missing one reads as NaN, or 0 as i64).
    pub params: &'p [ParamValues],
}

/// Evaluates a well-typed expression, in f64 for floats (the reference meaning of f32 IR).
/// Integer arithmetic wraps; integer division or remainder by zero gives 0; table indices are
/// clamped. Evaluation never panics.
pub fn eval(expr: &Expr, env: &Env<'_>) -> Value {
    match expr {
        Expr::Var(var) => match var {
            Var::Score => Value::F(env.score),
            Var::Batch => Value::I(env.b),
            Var::Head => Value::I(env.h),
            Var::Query => Value::I(env.q),
            Var::Key => Value::I(env.k),
            Var::QueryIndex => Value::I(env.qi),
            Var::KeyIndex => Value::I(env.ki),
        },
        Expr::Float(x) => Value::F(*x),
        Expr::Int(i) => Value::I(*i),
        Expr::Bool(b) => Value::B(*b),
        Expr::Unary(op, a) => unary(*op, eval(a, env)),
        Expr::Binary(op, a, b) => binary(*op, eval(a, env), eval(b, env)),
        Expr::Select(c, t, e) => {
            if eval(c, env).as_bool() {
                eval(t, env)
            } else {
                eval(e, env)
            }
        }
        Expr::Cast(a, ty) => cast(eval(a, env), *ty),
        Expr::Table(values, index) => {
            let i = match eval(index, env) {
                Value::I(i) => i,
                other => other.as_f64() as i64,
            };
            let last = values.len().saturating_sub(1);
            Value::F(
                values
                    .get((i.max(0) as usize).min(last))
                    .copied()
                    .unwrap_or(0.0),
            )
        }
        Expr::Param(read) => {
            let indices: Vec<i64> = read
                .indices
                .iter()
                .map(|i| match eval(i, env) {
                    Value::I(i) => i,
                    other => other.as_f64() as i64,
                })
                .collect();
            let x = env
                .params
                .iter()
                .find(|p| p.name == read.name)
                .map_or(f64::NAN, |p| p.at(&indices));
            match read.ty {
                // i32 data: exact in f64; a missing tensor reads as 0.
                Ty::I64 => Value::I(if x.is_nan() { 0 } else { x as i64 }),
                _ => Value::F(x),
            }
        }
    }
}

fn unary(op: UnOp, a: Value) -> Value {
    match (op, a) {
        (UnOp::Neg, Value::I(i)) => Value::I(i.wrapping_neg()),
        (UnOp::Abs, Value::I(i)) => Value::I(i.wrapping_abs()),
        (UnOp::Not, v) => Value::B(!v.as_bool()),
        (op, v) => {
            let x = v.as_f64();
            Value::F(match op {
                UnOp::Neg => -x,
                UnOp::Abs => x.abs(),
                UnOp::Exp => x.exp(),
                UnOp::Ln => x.ln(),
                UnOp::Tanh => x.tanh(),
                UnOp::Sqrt => x.sqrt(),
                UnOp::Not => unreachable!("handled above"),
            })
        }
    }
}

fn binary(op: BinOp, a: Value, b: Value) -> Value {
    use BinOp::*;
    match op {
        And => return Value::B(a.as_bool() && b.as_bool()),
        Or => return Value::B(a.as_bool() || b.as_bool()),
        _ => {}
    }
    match (a, b) {
        (Value::I(x), Value::I(y)) => match op {
            Add => Value::I(x.wrapping_add(y)),
            Sub => Value::I(x.wrapping_sub(y)),
            Mul => Value::I(x.wrapping_mul(y)),
            Div => Value::I(x.checked_div(y).unwrap_or(0)),
            Rem => Value::I(x.checked_rem(y).unwrap_or(0)),
            Min => Value::I(x.min(y)),
            Max => Value::I(x.max(y)),
            _ => Value::B(compare(op, x.cmp(&y))),
        },
        (Value::B(x), Value::B(y)) => Value::B(compare(op, x.cmp(&y))),
        (a, b) => {
            let (x, y) = (a.as_f64(), b.as_f64());
            match op {
                Add => Value::F(x + y),
                Sub => Value::F(x - y),
                Mul => Value::F(x * y),
                Div => Value::F(x / y),
                Rem => Value::F(x % y),
                // NaN when either is NaN, as PyTorch's `minimum` and `maximum` (Rust's
                // `min` and `max` return the other operand).
                Min | Max if x.is_nan() || y.is_nan() => Value::F(f64::NAN),
                Min => Value::F(x.min(y)),
                Max => Value::F(x.max(y)),
                _ => Value::B(match x.partial_cmp(&y) {
                    Some(ord) => compare(op, ord),
                    // Every comparison with NaN is false, except `!=`.
                    None => op == Ne,
                }),
            }
        }
    }
}

fn compare(op: BinOp, ord: std::cmp::Ordering) -> bool {
    use std::cmp::Ordering::*;
    match op {
        BinOp::Lt => ord == Less,
        BinOp::Le => ord != Greater,
        BinOp::Gt => ord == Greater,
        BinOp::Ge => ord != Less,
        BinOp::Eq => ord == Equal,
        BinOp::Ne => ord != Equal,
        _ => unreachable!("not a comparison: {op:?}"),
    }
}

fn cast(v: Value, ty: Ty) -> Value {
    match ty {
        // Rust's `as`: truncation toward zero, saturating, NaN to 0.
        Ty::I64 => match v {
            Value::F(x) => Value::I(x as i64),
            Value::I(i) => Value::I(i),
            Value::B(b) => Value::I(i64::from(b)),
        },
        Ty::F32 => Value::F(v.as_f64()),
        Ty::Bool => Value::B(v.as_bool()),
    }
}
