//! Moving a constant factor of the raw score out of a score program and into the queries'
//! scale (the plan's `q_scale`).

use attn_dsl::modifier::{BinOp, Expr, Var};

/// When every use of the raw score is `score * c` (or `score / d`, `c = 1/d`) with one constant
/// `c`, the program with those replaced by `score`, and `c`: `(q * c) . k == c * (q . k)` up to
/// rounding, so the kernel scales q once per row instead of every score. Applied until nothing
/// is left to hoist (softcap's `score * s / cap` hoists both factors), or until the factor would
/// grow q (the caller keeps such factors in the program).
pub(crate) fn hoist_score_factor(score: &Expr) -> Option<(Expr, f64)> {
    fn factors(e: &Expr, found: &mut Vec<Option<f64>>) {
        match e {
            Expr::Binary(BinOp::Mul, a, b) => match (&**a, &**b) {
                (Expr::Var(Var::Score), Expr::Float(c))
                | (Expr::Float(c), Expr::Var(Var::Score)) => found.push(Some(*c)),
                _ => {
                    factors(a, found);
                    factors(b, found);
                }
            },
            Expr::Binary(BinOp::Div, a, b) => match (&**a, &**b) {
                (Expr::Var(Var::Score), Expr::Float(d)) => found.push(Some(1.0 / d)),
                _ => {
                    factors(a, found);
                    factors(b, found);
                }
            },
            Expr::Var(Var::Score) => found.push(None),
            // Indices never read the score.
            Expr::Var(_) | Expr::Float(_) | Expr::Int(_) | Expr::Bool(_) | Expr::Param(_) => {}
            Expr::Unary(_, a) | Expr::Cast(a, _) | Expr::Table(_, a) => factors(a, found),
            Expr::Binary(_, a, b) => {
                factors(a, found);
                factors(b, found);
            }
            Expr::Select(c, t, f) => {
                factors(c, found);
                factors(t, found);
                factors(f, found);
            }
        }
    }
    fn strip(e: &Expr, c: f64) -> Expr {
        match e {
            Expr::Binary(BinOp::Mul, a, b) => match (&**a, &**b) {
                (Expr::Var(Var::Score), Expr::Float(x))
                | (Expr::Float(x), Expr::Var(Var::Score))
                    if *x == c =>
                {
                    Expr::Var(Var::Score)
                }
                _ => Expr::binary(BinOp::Mul, strip(a, c), strip(b, c)),
            },
            Expr::Binary(BinOp::Div, a, b) => match (&**a, &**b) {
                (Expr::Var(Var::Score), Expr::Float(d)) if 1.0 / *d == c => Expr::Var(Var::Score),
                _ => Expr::binary(BinOp::Div, strip(a, c), strip(b, c)),
            },
            Expr::Unary(op, a) => Expr::unary(*op, strip(a, c)),
            Expr::Cast(a, ty) => Expr::cast(strip(a, c), *ty),
            Expr::Table(v, a) => Expr::Table(v.clone(), Box::new(strip(a, c))),
            Expr::Binary(op, a, b) => Expr::binary(*op, strip(a, c), strip(b, c)),
            Expr::Select(x, t, f) => Expr::Select(
                Box::new(strip(x, c)),
                Box::new(strip(t, c)),
                Box::new(strip(f, c)),
            ),
            leaf => leaf.clone(),
        }
    }
    let mut found = Vec::new();
    factors(score, &mut found);
    let first = (*found.first()?)?;
    let same = found.iter().all(|f| *f == Some(first))
        && first.is_finite()
        && first != 0.0
        && first != 1.0;
    same.then(|| (strip(score, first), first))
}
