//! The scaling pass: a float expression times a positive constant, with the factor pushed into
//! the expression's constants, tables and score factors where it costs no operation.
//!
//! Kernels use it to move the softmax into base 2: `score * log2 e` lets them compute
//! probabilities as `2^(s - m)`, and pushed inward the factor usually vanishes into constants
//! (a softcap's outer factor, ALiBi's slope table) or into the score scale hoisted into q.

use super::{BinOp, Expr, UnOp, Var};

/// `expr * c`, equal in real arithmetic (floats differ only by rounding). `c` must be positive
/// and finite, which keeps min, max, abs and the order of a select's arms unchanged; `expr` must
/// be float-typed.
pub fn scale(expr: &Expr, c: f64) -> Expr {
    debug_assert!(c > 0.0 && c.is_finite(), "scale factor {c}");
    if !absorbs(expr) {
        return Expr::binary(BinOp::Mul, expr.clone(), Expr::Float(c));
    }
    match expr {
        Expr::Float(x) => Expr::Float(x * c),
        Expr::Table(values, index) => {
            Expr::Table(values.iter().map(|v| v * c).collect(), index.clone())
        }
        Expr::Var(_) => Expr::binary(BinOp::Mul, expr.clone(), Expr::Float(c)),
        Expr::Unary(op @ (UnOp::Neg | UnOp::Abs), a) => Expr::unary(*op, scale(a, c)),
        Expr::Binary(BinOp::Mul, a, b) => match (&**a, &**b) {
            // score * x: one factor, which the kernel can hoist into q.
            (Expr::Var(Var::Score), Expr::Float(x)) | (Expr::Float(x), Expr::Var(Var::Score)) => {
                Expr::binary(BinOp::Mul, Expr::Var(Var::Score), Expr::Float(x * c))
            }
            _ if absorbs(a) => Expr::binary(BinOp::Mul, scale(a, c), (**b).clone()),
            _ => Expr::binary(BinOp::Mul, (**a).clone(), scale(b, c)),
        },
        Expr::Binary(BinOp::Div, a, b) => Expr::binary(BinOp::Div, scale(a, c), (**b).clone()),
        Expr::Binary(op @ (BinOp::Add | BinOp::Sub | BinOp::Min | BinOp::Max), a, b) => {
            Expr::binary(*op, scale(a, c), scale(b, c))
        }
        Expr::Select(cond, t, f) => {
            Expr::Select(cond.clone(), Box::new(scale(t, c)), Box::new(scale(f, c)))
        }
        _ => unreachable!("absorbs() admits only the forms above"),
    }
}

/// Whether scaling `expr` costs no operation beyond what it has: every path to a value ends in
/// a constant, a table or the score (whose factor q absorbs).
fn absorbs(expr: &Expr) -> bool {
    match expr {
        Expr::Float(_) | Expr::Table(..) | Expr::Var(Var::Score) => true,
        Expr::Unary(UnOp::Neg | UnOp::Abs, a) => absorbs(a),
        Expr::Binary(BinOp::Mul, a, b) => absorbs(a) || absorbs(b),
        Expr::Binary(BinOp::Div, a, _) => absorbs(a),
        Expr::Binary(BinOp::Add | BinOp::Sub | BinOp::Min | BinOp::Max, a, b) => {
            absorbs(a) && absorbs(b)
        }
        Expr::Select(_, t, f) => absorbs(t) && absorbs(f),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Expr {
        let spec: crate::AttentionSpec = format!("heads = 4, head_dim = 16, score_mod = {text}")
            .parse()
            .unwrap();
        crate::modifier::ScoreProgram::of(&spec).folded().score
    }

    #[test]
    fn factors_vanish_into_constants_tables_and_the_score() {
        let softcap = parse("|s, b, h, q, k| (s / 30.0).tanh() * 30.0");
        assert_eq!(
            scale(&softcap, 2.0).to_string(),
            softcap.to_string().replace("* 30", "* 60")
        );
        let alibi = Expr::binary(
            BinOp::Add,
            Expr::binary(BinOp::Mul, Expr::Var(Var::Score), Expr::Float(0.5)),
            Expr::binary(
                BinOp::Mul,
                Expr::Table(vec![1.0, 0.25], Box::new(Expr::Var(Var::Head))),
                Expr::cast(Expr::Var(Var::Key), crate::modifier::Ty::F32),
            ),
        );
        assert_eq!(
            scale(&alibi, 4.0).to_string(),
            "score * 2.0 + [4.0, 1.0][h] * k as f32"
        );
    }

    #[test]
    fn what_cannot_absorb_is_multiplied_once() {
        let e = Expr::unary(UnOp::Exp, Expr::Var(Var::Score));
        assert_eq!(
            scale(&e, 3.0),
            Expr::binary(BinOp::Mul, e, Expr::Float(3.0))
        );
    }
}
