//! The folding pass: constant folding and algebraic simplification.
//!
//! Every rewrite keeps the value of the expression at every point (for floats: up to the sign of
//! a zero, which no softmax can see). Constant subtrees are evaluated with the reference
//! evaluator, so folding cannot disagree with evaluation.

use super::{BinOp, Env, Expr, UnOp, Value, eval};

/// The expression, folded and simplified. Idempotent: `fold(&fold(e)) == fold(e)`.
pub fn fold(expr: &Expr) -> Expr {
    let folded = match expr {
        Expr::Var(_) | Expr::Float(_) | Expr::Int(_) | Expr::Bool(_) => return expr.clone(),
        Expr::Unary(op, a) => simplify_unary(*op, fold(a)),
        Expr::Binary(op, a, b) => simplify_binary(*op, fold(a), fold(b)),
        Expr::Select(c, t, e) => match (fold(c), fold(t), fold(e)) {
            (Expr::Bool(true), t, _) => t,
            (Expr::Bool(false), _, e) => e,
            (_, t, e) if t == e => t,
            (c, t, e) => Expr::Select(Box::new(c), Box::new(t), Box::new(e)),
        },
        Expr::Cast(a, ty) => Expr::cast(fold(a), *ty),
        Expr::Table(values, index) => {
            let index = fold(index);
            if values.iter().all(|v| v.to_bits() == values[0].to_bits()) {
                Expr::Float(values[0])
            } else {
                Expr::Table(values.clone(), Box::new(index))
            }
        }
        Expr::Param(read) => Expr::Param(super::ParamRead {
            name: read.name.clone(),
            indices: read.indices.iter().map(fold).collect(),
            ty: read.ty,
        }),
    };
    if is_constant(&folded) {
        constant(eval(&folded, &Env::default()))
    } else {
        folded
    }
}

/// Whether the expression reads no variable (and so has one value everywhere).
fn is_constant(expr: &Expr) -> bool {
    match expr {
        Expr::Var(_) => false,
        Expr::Float(_) | Expr::Int(_) | Expr::Bool(_) => true,
        Expr::Unary(_, a) | Expr::Cast(a, _) | Expr::Table(_, a) => is_constant(a),
        Expr::Binary(_, a, b) => is_constant(a) && is_constant(b),
        Expr::Select(c, t, e) => is_constant(c) && is_constant(t) && is_constant(e),
        // A parameter's value is known only at run time.
        Expr::Param(_) => false,
    }
}

fn constant(v: Value) -> Expr {
    match v {
        Value::F(x) => Expr::Float(x),
        Value::I(i) => Expr::Int(i),
        Value::B(b) => Expr::Bool(b),
    }
}

fn is_float(e: &Expr, x: f64) -> bool {
    matches!(e, Expr::Float(v) if *v == x)
}

fn is_int(e: &Expr, x: i64) -> bool {
    matches!(e, Expr::Int(v) if *v == x)
}

/// `e` is the identity element `x` of its type (0 / 1).
fn is_unit(e: &Expr, x: i64) -> bool {
    is_int(e, x) || is_float(e, x as f64)
}

fn simplify_unary(op: UnOp, a: Expr) -> Expr {
    match (op, a) {
        // --x and !!x
        (UnOp::Neg, Expr::Unary(UnOp::Neg, x)) | (UnOp::Not, Expr::Unary(UnOp::Not, x)) => *x,
        // |(|x|)|
        (UnOp::Abs, Expr::Unary(UnOp::Abs, x)) => Expr::unary(UnOp::Abs, *x),
        (op, a) => Expr::unary(op, a),
    }
}

fn simplify_binary(op: BinOp, a: Expr, b: Expr) -> Expr {
    use BinOp::*;
    match op {
        Add if is_unit(&b, 0) => a,
        Add if is_unit(&a, 0) => b,
        Sub if is_unit(&b, 0) => a,
        Mul if is_unit(&b, 1) => a,
        Mul if is_unit(&a, 1) => b,
        // Only integers: a float times zero is NaN for infinities.
        Mul if is_int(&a, 0) || is_int(&b, 0) => Expr::Int(0),
        Div if is_unit(&b, 1) => a,
        And => match (a, b) {
            (Expr::Bool(true), x) | (x, Expr::Bool(true)) => x,
            (Expr::Bool(false), _) | (_, Expr::Bool(false)) => Expr::Bool(false),
            (a, b) if a == b => a,
            (a, b) => Expr::binary(And, a, b),
        },
        Or => match (a, b) {
            (Expr::Bool(false), x) | (x, Expr::Bool(false)) => x,
            (Expr::Bool(true), _) | (_, Expr::Bool(true)) => Expr::Bool(true),
            (a, b) if a == b => a,
            (a, b) => Expr::binary(Or, a, b),
        },
        Min | Max if a == b => a,
        _ => Expr::binary(op, a, b),
    }
}
