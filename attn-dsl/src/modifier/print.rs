//! The text form of the modifier IR: Rust expression syntax with the fewest parentheses that keep
//! the tree the same when parsed again. Closures print with their own parameter names, bare
//! expressions with the canonical names (`score, b, h, q, k, qi, ki`).

use super::{BinOp, Expr, Let, MASK_MOD_PARAMS, MaskMod, SCORE_MOD_PARAMS, ScoreMod, UnOp, Var};
use std::fmt;

/// Binding strength, loosest first (Rust's expression precedence).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Prec {
    /// `if` as an operand: always parenthesized.
    Select,
    Or,
    And,
    Compare,
    Sum,
    Product,
    Cast,
    Prefix,
    Postfix,
}

impl Prec {
    fn tighter(self) -> Prec {
        match self {
            Prec::Select => Prec::Or,
            Prec::Or => Prec::And,
            Prec::And => Prec::Compare,
            Prec::Compare => Prec::Sum,
            Prec::Sum => Prec::Product,
            Prec::Product => Prec::Cast,
            Prec::Cast => Prec::Prefix,
            Prec::Prefix | Prec::Postfix => Prec::Postfix,
        }
    }
}

fn binary_prec(op: BinOp) -> Prec {
    match op {
        BinOp::Or => Prec::Or,
        BinOp::And => Prec::And,
        BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge | BinOp::Eq | BinOp::Ne => Prec::Compare,
        BinOp::Add | BinOp::Sub => Prec::Sum,
        BinOp::Mul | BinOp::Div | BinOp::Rem => Prec::Product,
        BinOp::Min | BinOp::Max => Prec::Postfix,
    }
}

/// Prints expressions with a name for each variable, indexed by [`Var::index`], and a
/// binding's name for each subtree equal to the value of one of `lets` (the latest first).
struct Printer<'a> {
    names: [&'a str; 7],
    lets: &'a [Let],
}

impl<'a> Printer<'a> {
    fn canonical() -> Self {
        Printer {
            names: Var::ALL.map(Var::canonical_name),
            lets: &[],
        }
    }

    /// The name of the binding whose value `expr` is, if any.
    fn bound(&self, expr: &Expr) -> Option<&'a str> {
        self.lets
            .iter()
            .rev()
            .find(|l| l.value == *expr)
            .map(|l| l.name.as_str())
    }

    /// Canonical names, except the closure parameters, which keep the names written.
    fn closure(params: &'a [String], roles: &[Var]) -> Self {
        let mut p = Printer::canonical();
        for (name, role) in params.iter().zip(roles) {
            p.names[role.index()] = name;
        }
        p
    }

    fn name(&self, var: Var) -> &str {
        self.names[var.index()]
    }

    fn prec(expr: &Expr) -> Prec {
        match expr {
            Expr::Binary(op, ..) => binary_prec(*op),
            Expr::Unary(UnOp::Neg | UnOp::Not, _) => Prec::Prefix,
            Expr::Cast(..) => Prec::Cast,
            // Constants may print with a leading minus, and `1.abs()` would lex oddly: as
            // method receivers they get parentheses.
            Expr::Float(_) | Expr::Int(_) => Prec::Prefix,
            Expr::Select(..) => Prec::Select,
            _ => Prec::Postfix,
        }
    }

    /// Writes `expr`, parenthesized when it binds looser than `min`.
    fn operand(&self, f: &mut fmt::Formatter, expr: &Expr, min: Prec) -> fmt::Result {
        if self.bound(expr).is_none() && Self::prec(expr) < min {
            write!(f, "(")?;
            self.expr(f, expr)?;
            write!(f, ")")
        } else {
            self.expr(f, expr)
        }
    }

    fn expr(&self, f: &mut fmt::Formatter, expr: &Expr) -> fmt::Result {
        if let Some(name) = self.bound(expr) {
            return write!(f, "{name}");
        }
        match expr {
            Expr::Var(v) => write!(f, "{}", self.name(*v)),
            Expr::Float(x) => write!(f, "{x:?}"),
            Expr::Int(i) => write!(f, "{i}"),
            Expr::Bool(b) => write!(f, "{b}"),
            Expr::Unary(op @ (UnOp::Neg | UnOp::Not), a) => {
                write!(f, "{}", if *op == UnOp::Neg { "-" } else { "!" })?;
                self.operand(f, a, Prec::Prefix)
            }
            Expr::Unary(op, a) => {
                self.operand(f, a, Prec::Postfix)?;
                let method = match op {
                    UnOp::Abs => "abs",
                    UnOp::Exp => "exp",
                    UnOp::Ln => "ln",
                    UnOp::Tanh => "tanh",
                    UnOp::Sqrt => "sqrt",
                    UnOp::Neg | UnOp::Not => unreachable!("prefix operators handled above"),
                };
                write!(f, ".{method}()")
            }
            Expr::Binary(op @ (BinOp::Min | BinOp::Max), a, b) => {
                self.operand(f, a, Prec::Postfix)?;
                write!(f, ".{}(", op.symbol())?;
                self.expr(f, b)?;
                write!(f, ")")
            }
            Expr::Binary(op, a, b) => {
                let p = binary_prec(*op);
                if p == Prec::Compare {
                    // Comparisons do not chain, so both sides bind tighter. A left side that
                    // ends in a cast (`x as f32 < y`) would read as generic arguments, so it
                    // gets parentheses too.
                    let left_min = if ends_with_cast(a) {
                        Prec::Postfix
                    } else {
                        Prec::Sum
                    };
                    self.operand(f, a, left_min)?;
                    write!(f, " {} ", op.symbol())?;
                    self.operand(f, b, Prec::Sum)
                } else {
                    // Left-associative: the right operand must bind strictly tighter.
                    self.operand(f, a, p)?;
                    write!(f, " {} ", op.symbol())?;
                    self.operand(f, b, p.tighter())
                }
            }
            Expr::Select(c, t, e) => {
                write!(f, "if ")?;
                self.expr(f, c)?;
                write!(f, " {{ ")?;
                self.expr(f, t)?;
                write!(f, " }} else {{ ")?;
                self.expr(f, e)?;
                write!(f, " }}")
            }
            Expr::Cast(a, ty) => {
                self.operand(f, a, Prec::Cast)?;
                write!(f, " as {}", ty.name())
            }
            Expr::Table(values, index) => {
                write!(f, "[")?;
                for (i, v) in values.iter().enumerate() {
                    let sep = if i == 0 { "" } else { ", " };
                    write!(f, "{sep}{v:?}")?;
                }
                write!(f, "][")?;
                self.expr(f, index)?;
                write!(f, "]")
            }
            Expr::Param(read) => {
                write!(f, "{}[", read.name)?;
                for (i, index) in read.indices.iter().enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    self.expr(f, index)?;
                }
                write!(f, "]")
            }
        }
    }
}

/// Whether the printed form of `expr` ends with `as TYPE` (its rightmost operand is a cast).
fn ends_with_cast(expr: &Expr) -> bool {
    match expr {
        Expr::Cast(..) => true,
        Expr::Binary(op, _, b) if binary_prec(*op) != Prec::Postfix => ends_with_cast(b),
        Expr::Unary(UnOp::Neg | UnOp::Not, a) => ends_with_cast(a),
        _ => false,
    }
}

impl fmt::Display for Expr {
    /// The IR text form, with canonical variable names.
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        Printer::canonical().expr(f, self)
    }
}

/// `|params| body`, or `|params| { let a = ..; body }` for a closure with bindings.
fn closure(
    f: &mut fmt::Formatter,
    params: &[String],
    roles: &[Var],
    lets: &[Let],
    body: &Expr,
) -> fmt::Result {
    let mut p = Printer::closure(params, roles);
    write!(f, "|{}| ", params.join(", "))?;
    if lets.is_empty() {
        return p.expr(f, body);
    }
    write!(f, "{{ ")?;
    for (i, binding) in lets.iter().enumerate() {
        p.lets = &lets[..i];
        write!(f, "let {} = ", binding.name)?;
        p.expr(f, &binding.value)?;
        write!(f, "; ")?;
    }
    p.lets = lets;
    p.expr(f, body)?;
    write!(f, " }}")
}

impl fmt::Display for ScoreMod {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        closure(f, &self.params, &SCORE_MOD_PARAMS, &self.lets, &self.body)
    }
}

impl fmt::Display for MaskMod {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        closure(f, &self.params, &MASK_MOD_PARAMS, &self.lets, &self.body)
    }
}
