//! The derivative pass: `d expr / d score` of a float-typed modifier expression, as modifier IR.
//!
//! The backward pass needs, for every kept (query, key) pair, the derivative of the final score
//! with respect to the raw `<q, k>` ([`Var::Score`] in a [`super::ScoreProgram`]): the scale,
//! softcap and any custom score modifier chained. The result is an ordinary expression, so it is
//! folded, interval-analysed, printed and lowered like any other program.
//!
//! Rules: sums and differences add; products and quotients by the product and quotient rules;
//! `tanh`, `exp`, `ln`, `sqrt` by their derivatives; `abs` by the sign (0 at 0, as PyTorch);
//! `min` and `max` by the chosen operand (half each at a tie, as PyTorch's `minimum`/`maximum`);
//! a `select` by its chosen branch; integers, booleans, tables indexed by integers and casts to
//! integers have derivative 0. Where the result is only piecewise (the score reaches a kink or a
//! condition) or zero almost everywhere (the score is rounded to an integer), a [`GradNote`] says
//! where.

use super::{BinOp, Expr, ParamRead, Ty, UnOp, Var};
use std::fmt;

/// Largest derivative, in expression nodes, the pass builds: the product and chain rules copy
/// operands, so a derivative can grow quadratically in the depth of its expression.
pub const MAX_GRAD_NODES: usize = 1 << 16;

/// What the derivative of a program is like, where it is not smooth.
#[derive(Clone, Debug, PartialEq)]
pub struct GradNote {
    /// The subexpression concerned, printed.
    pub at: String,
    /// What happens there.
    pub kind: GradNoteKind,
}

/// The kinds of [`GradNote`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradNoteKind {
    /// The derivative jumps where the score crosses a kink or a condition (`abs`, `min`, `max`,
    /// a condition on the score): defined piecewise, as autograd does.
    Piecewise,
    /// The score is converted to an integer: the derivative through it is 0 almost everywhere.
    Discrete,
}

impl fmt::Display for GradNote {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self.kind {
            GradNoteKind::Piecewise => write!(
                f,
                "`{}`: the derivative is piecewise in the score (each piece's derivative, as \
                 autograd takes it)",
                self.at
            ),
            GradNoteKind::Discrete => write!(
                f,
                "`{}`: the score is rounded to an integer here, so no gradient flows through it",
                self.at
            ),
        }
    }
}

/// A derivative and the notes on its smoothness.
#[derive(Clone, Debug, PartialEq)]
pub struct Gradient {
    /// `d expr / d score` (f32), not yet folded.
    pub expr: Expr,
    /// Where it is piecewise or zero almost everywhere, outermost first.
    pub notes: Vec<GradNote>,
}

/// Why no derivative was built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GradError {
    /// The derivative would exceed [`MAX_GRAD_NODES`].
    #[error(
        "the derivative of the score program has more than {MAX_GRAD_NODES} nodes; allowed: \
         smaller score modifiers"
    )]
    TooLarge,
}

/// `d expr / d score` for a float-typed expression.
pub fn derivative(expr: &Expr) -> Result<Gradient, GradError> {
    run(expr, Wrt::Score)
}

/// `d expr / d read` for a float-typed expression: the derivative with respect to the value of
/// one parameter element read, `read` (reads equal to it read the same element, so they count
/// together). The notes are the same as for the score.
pub fn derivative_wrt_param(expr: &Expr, read: &ParamRead) -> Result<Gradient, GradError> {
    run(expr, Wrt::Param(read))
}

/// What a derivative is taken with respect to.
#[derive(Clone, Copy)]
enum Wrt<'r> {
    Score,
    Param(&'r ParamRead),
}

impl Wrt<'_> {
    fn occurs_in(self, e: &Expr) -> bool {
        match self {
            Wrt::Score => e.uses(Var::Score),
            Wrt::Param(read) => {
                let mut found = false;
                e.visit(&mut |x| found |= matches!(x, Expr::Param(r) if r == read));
                found
            }
        }
    }
}

fn run(expr: &Expr, wrt: Wrt<'_>) -> Result<Gradient, GradError> {
    let mut pass = Pass {
        notes: Vec::new(),
        wrt,
    };
    let expr = pass.d(expr).unwrap_or(Expr::Float(0.0));
    if node_count(&expr) > MAX_GRAD_NODES {
        return Err(GradError::TooLarge);
    }
    Ok(Gradient {
        expr,
        notes: pass.notes,
    })
}

struct Pass<'r> {
    notes: Vec<GradNote>,
    wrt: Wrt<'r>,
}

impl Pass<'_> {
    fn note(&mut self, at: &Expr, kind: GradNoteKind) {
        let at = at.to_string();
        if !self.notes.iter().any(|n| n.at == at && n.kind == kind) {
            self.notes.push(GradNote { at, kind });
        }
    }

    /// The derivative, or `None` where it is identically 0 (so zeros never reach the program:
    /// `0 * x` is not 0 for an infinite `x`, and fold rightly keeps it).
    fn d(&mut self, e: &Expr) -> Option<Expr> {
        if !self.wrt.occurs_in(e) {
            return None;
        }
        match e {
            Expr::Var(Var::Score) => Some(Expr::Float(1.0)),
            // The read itself (indices never hold the score or a parameter).
            Expr::Param(_) => Some(Expr::Float(1.0)),
            Expr::Var(_) | Expr::Float(_) | Expr::Int(_) | Expr::Bool(_) => None,
            Expr::Unary(op, a) => self.unary(e, *op, a),
            Expr::Binary(op, a, b) => self.binary(e, *op, a, b),
            Expr::Select(c, t, f) => {
                if self.wrt.occurs_in(c) {
                    self.note(c, GradNoteKind::Piecewise);
                }
                let (dt, df) = (self.d(t), self.d(f));
                if dt.is_none() && df.is_none() {
                    return None;
                }
                Some(Expr::Select(
                    c.clone(),
                    Box::new(dt.unwrap_or(Expr::Float(0.0))),
                    Box::new(df.unwrap_or(Expr::Float(0.0))),
                ))
            }
            Expr::Cast(a, Ty::F32) if is_float(a) => self.d(a),
            Expr::Cast(a, _) | Expr::Table(_, a) => {
                if is_float(a) || self.wrt.occurs_in(a) {
                    self.note(e, GradNoteKind::Discrete);
                }
                None
            }
        }
    }

    fn unary(&mut self, e: &Expr, op: UnOp, a: &Expr) -> Option<Expr> {
        if !is_float(a) {
            // An integer or boolean operand: piecewise constant in the score.
            self.note(e, GradNoteKind::Discrete);
            return None;
        }
        let da = self.d(a)?;
        let a = a.clone();
        let inner = match op {
            UnOp::Neg => return Some(neg(da)),
            UnOp::Not => return None,
            UnOp::Abs => {
                self.note(e, GradNoteKind::Piecewise);
                // sign(a): 1, -1, or 0 at 0 (and for NaN).
                let zero = Expr::Float(0.0);
                let sign = Expr::Select(
                    Box::new(Expr::binary(BinOp::Gt, a.clone(), zero.clone())),
                    Box::new(Expr::Float(1.0)),
                    Box::new(Expr::Select(
                        Box::new(Expr::binary(BinOp::Lt, a, zero.clone())),
                        Box::new(Expr::Float(-1.0)),
                        Box::new(zero),
                    )),
                );
                return Some(mul(sign, da));
            }
            UnOp::Exp => Expr::unary(UnOp::Exp, a),
            UnOp::Ln => return Some(Expr::binary(BinOp::Div, da, a)),
            UnOp::Tanh => {
                let t = Expr::unary(UnOp::Tanh, a);
                Expr::binary(
                    BinOp::Sub,
                    Expr::Float(1.0),
                    Expr::binary(BinOp::Mul, t.clone(), t),
                )
            }
            UnOp::Sqrt => {
                let twice = Expr::binary(BinOp::Mul, Expr::Float(2.0), Expr::unary(UnOp::Sqrt, a));
                return Some(Expr::binary(BinOp::Div, da, twice));
            }
        };
        Some(mul(inner, da))
    }

    fn binary(&mut self, e: &Expr, op: BinOp, a: &Expr, b: &Expr) -> Option<Expr> {
        use BinOp::*;
        if !is_float(a) && !is_float(b) {
            // Integer arithmetic or a comparison/logic result: piecewise constant.
            if matches!(op, Add | Sub | Mul | Div | Rem | Min | Max) {
                self.note(e, GradNoteKind::Discrete);
            }
            return None;
        }
        if matches!(op, Lt | Le | Gt | Ge | Eq | Ne | And | Or) {
            return None;
        }
        let (da, db) = (self.d(a), self.d(b));
        let (a, b) = (a.clone(), b.clone());
        match op {
            Add => sum(da, db),
            Sub => sum(da, db.map(neg)),
            Mul => sum(da.map(|x| mul(x, b.clone())), db.map(|x| mul(a.clone(), x))),
            Div => {
                // a'/b - a b' / b^2
                let first = da.map(|x| Expr::binary(Div, x, b.clone()));
                let second = db.map(|x| {
                    neg(Expr::binary(
                        Div,
                        mul(a.clone(), x),
                        Expr::binary(Mul, b.clone(), b.clone()),
                    ))
                });
                sum(first, second)
            }
            Rem => {
                // a - trunc(a / b) * b: a' - trunc(a / b) * b'.
                self.note(e, GradNoteKind::Piecewise);
                let quotient = Expr::cast(
                    Expr::cast(Expr::binary(Div, a.clone(), b.clone()), Ty::I64),
                    Ty::F32,
                );
                sum(da, db.map(|x| neg(mul(quotient, x))))
            }
            Min | Max => {
                self.note(e, GradNoteKind::Piecewise);
                let zero = || Expr::Float(0.0);
                let (da, db) = (da.unwrap_or_else(zero), db.unwrap_or_else(zero));
                let (first_wins, second_wins) = if op == Min { (Lt, Gt) } else { (Gt, Lt) };
                let half = Expr::binary(
                    Mul,
                    Expr::Float(0.5),
                    Expr::binary(Add, da.clone(), db.clone()),
                );
                Some(Expr::Select(
                    Box::new(Expr::binary(first_wins, a.clone(), b.clone())),
                    Box::new(da),
                    Box::new(Expr::Select(
                        Box::new(Expr::binary(second_wins, a, b)),
                        Box::new(db),
                        Box::new(half),
                    )),
                ))
            }
            _ => None,
        }
    }
}

/// Whether a well-typed expression is float-typed (closure bodies are typechecked on lowering;
/// programs built in code keep to the same rules: integer literals and variables are i64).
fn is_float(e: &Expr) -> bool {
    match e {
        Expr::Var(v) => v.ty() == Ty::F32,
        Expr::Float(_) | Expr::Table(..) | Expr::Param(_) => true,
        Expr::Int(_) | Expr::Bool(_) => false,
        Expr::Cast(_, ty) => *ty == Ty::F32,
        Expr::Unary(UnOp::Not, _) => false,
        Expr::Unary(_, a) => is_float(a),
        Expr::Binary(op, a, b) => {
            use BinOp::*;
            match op {
                Lt | Le | Gt | Ge | Eq | Ne | And | Or => false,
                _ => is_float(a) || is_float(b),
            }
        }
        Expr::Select(_, t, _) => is_float(t),
    }
}

fn neg(x: Expr) -> Expr {
    match x {
        Expr::Float(v) => Expr::Float(-v),
        x => Expr::unary(UnOp::Neg, x),
    }
}

fn mul(a: Expr, b: Expr) -> Expr {
    match (&a, &b) {
        (Expr::Float(x), _) if *x == 1.0 => b,
        (_, Expr::Float(x)) if *x == 1.0 => a,
        _ => Expr::binary(BinOp::Mul, a, b),
    }
}

fn sum(a: Option<Expr>, b: Option<Expr>) -> Option<Expr> {
    match (a, b) {
        (Some(a), Some(b)) => Some(Expr::binary(BinOp::Add, a, b)),
        (a, b) => a.or(b),
    }
}

/// Nodes in an expression, counted without recursion.
fn node_count(e: &Expr) -> usize {
    let mut count = 0;
    let mut stack = vec![e];
    while let Some(e) = stack.pop() {
        count += 1;
        match e {
            Expr::Var(_) | Expr::Float(_) | Expr::Int(_) | Expr::Bool(_) => {}
            Expr::Unary(_, a) | Expr::Cast(a, _) | Expr::Table(_, a) => stack.push(a),
            Expr::Binary(_, a, b) => stack.extend([&**a, &**b]),
            Expr::Select(c, t, f) => stack.extend([&**c, &**t, &**f]),
            Expr::Param(read) => stack.extend(&read.indices),
        }
    }
    count
}
