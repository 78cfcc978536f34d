//! The type-check pass: the type of an IR tree, or what is ill-typed in it.
//!
//! Trees lowered from closures are typed as they are built; this pass is for trees built or
//! rewritten in code (the built-ins, folding), and states the typing rules in one place.

use super::{BinOp, Expr, Ty, UnOp};

/// An ill-typed expression.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("type error in `{expr}`: {message}")]
pub struct TypeError {
    /// The offending subexpression, in text form.
    pub expr: String,
    /// What is wrong.
    pub message: String,
}

fn error(expr: &Expr, message: String) -> TypeError {
    TypeError {
        expr: expr.to_string(),
        message,
    }
}

/// The type of `expr`.
pub fn typecheck(expr: &Expr) -> Result<Ty, TypeError> {
    match expr {
        Expr::Var(v) => Ok(v.ty()),
        Expr::Float(_) => Ok(Ty::F32),
        Expr::Int(_) => Ok(Ty::I64),
        Expr::Bool(_) => Ok(Ty::Bool),
        Expr::Unary(op, a) => {
            let t = typecheck(a)?;
            let ok = match op {
                UnOp::Not => t == Ty::Bool,
                UnOp::Neg | UnOp::Abs => t != Ty::Bool,
                UnOp::Exp | UnOp::Ln | UnOp::Tanh | UnOp::Sqrt => t == Ty::F32,
            };
            if ok {
                Ok(t)
            } else {
                Err(error(
                    expr,
                    format!("{op:?} does not apply to {}", t.name()),
                ))
            }
        }
        Expr::Binary(op, a, b) => {
            let (ta, tb) = (typecheck(a)?, typecheck(b)?);
            if ta != tb {
                return Err(error(
                    expr,
                    format!("`{}` on {} and {}", op.symbol(), ta.name(), tb.name()),
                ));
            }
            match op {
                BinOp::And | BinOp::Or if ta == Ty::Bool => Ok(Ty::Bool),
                BinOp::Eq | BinOp::Ne => Ok(Ty::Bool),
                BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge if ta != Ty::Bool => Ok(Ty::Bool),
                BinOp::Add
                | BinOp::Sub
                | BinOp::Mul
                | BinOp::Div
                | BinOp::Rem
                | BinOp::Min
                | BinOp::Max
                    if ta != Ty::Bool =>
                {
                    Ok(ta)
                }
                _ => Err(error(
                    expr,
                    format!("`{}` does not apply to {}", op.symbol(), ta.name()),
                )),
            }
        }
        Expr::Select(c, t, e) => {
            if typecheck(c)? != Ty::Bool {
                return Err(error(expr, "the condition is not bool".into()));
            }
            let (tt, te) = (typecheck(t)?, typecheck(e)?);
            if tt == te {
                Ok(tt)
            } else {
                Err(error(
                    expr,
                    format!("branches differ: {} and {}", tt.name(), te.name()),
                ))
            }
        }
        Expr::Cast(a, to) => {
            let from = typecheck(a)?;
            match (from, to) {
                (_, Ty::Bool) | (Ty::Bool, Ty::F32) => Err(error(
                    expr,
                    format!("cannot cast {} to {}", from.name(), to.name()),
                )),
                _ => Ok(*to),
            }
        }
        Expr::Table(values, index) => {
            if values.is_empty() {
                return Err(error(expr, "an empty table".into()));
            }
            match typecheck(index)? {
                Ty::I64 => Ok(Ty::F32),
                t => Err(error(
                    expr,
                    format!("a table index must be i64, not {}", t.name()),
                )),
            }
        }
        Expr::Param(read) => {
            for index in &read.indices {
                match typecheck(index)? {
                    Ty::I64 if !index.uses(super::Var::Score) && !index.reads_params() => {}
                    Ty::I64 => {
                        return Err(error(
                            expr,
                            format!(
                                "an index of `{}` may not depend on the score or on a parameter",
                                read.name
                            ),
                        ));
                    }
                    t => {
                        return Err(error(
                            expr,
                            format!("an index of `{}` must be i64, not {}", read.name, t.name()),
                        ));
                    }
                }
            }
            match read.ty {
                Ty::F32 | Ty::I64 => Ok(read.ty),
                Ty::Bool => Err(error(
                    expr,
                    format!("`{}` is read as bool; tensors hold f32 or i64", read.name),
                )),
            }
        }
    }
}
