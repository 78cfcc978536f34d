//! Custom score modifiers and mask predicates: typed scalar expressions written as Rust closures.
//!
//! A score modifier `|score, b, h, q, k| expr` maps an f32 score to an f32 score; a mask predicate
//! `|b, h, q, k| expr` says whether a key is kept. `b` is the batch index, `h` the query head, and
//! `q`, `k` the absolute positions of the query and the key (i64, see DESIGN.md "Positions").
//!
//! The expression tree here is the modifier IR. It is built from syn's closure AST by
//! [`lower`](self::lower), typed as it is built (so every tree in a spec is well typed), printed
//! back as closure syntax by its `Display`, and evaluated by the reference with [`eval`](self::eval).

mod eval;
mod lower;
mod print;

pub use eval::Value;
pub(crate) use lower::{lower_mask_mod, lower_score_mod};

/// The type of a modifier expression.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ty {
    /// A score: f32 in kernels, f64 in the reference.
    F32,
    /// An index or position.
    I64,
    /// A mask decision.
    Bool,
}

impl Ty {
    /// The Rust name of the type.
    pub fn name(self) -> &'static str {
        match self {
            Ty::F32 => "f32",
            Ty::I64 => "i64",
            Ty::Bool => "bool",
        }
    }
}

/// A closure parameter's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Var {
    /// The score after the built-in modifiers (score modifiers only).
    Score,
    /// Batch index.
    Batch,
    /// Query head index.
    Head,
    /// Absolute query position.
    Query,
    /// Absolute key position.
    Key,
}

impl Var {
    /// The type of the variable.
    pub fn ty(self) -> Ty {
        match self {
            Var::Score => Ty::F32,
            _ => Ty::I64,
        }
    }
}

/// A unary operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnOp {
    /// Arithmetic negation (`-x`).
    Neg,
    /// Boolean not (`!x`).
    Not,
    /// Absolute value (`x.abs()`).
    Abs,
    /// Natural exponential (`x.exp()`).
    Exp,
    /// Natural logarithm (`x.ln()`).
    Ln,
    /// Hyperbolic tangent (`x.tanh()`).
    Tanh,
    /// Square root (`x.sqrt()`).
    Sqrt,
}

/// A binary operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    /// `+`
    Add,
    /// `-`
    Sub,
    /// `*`
    Mul,
    /// `/` (integer division truncates; division by zero gives 0)
    Div,
    /// `%` (remainder with the sign of the dividend; by zero gives 0)
    Rem,
    /// `a.min(b)`
    Min,
    /// `a.max(b)`
    Max,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `&&`
    And,
    /// `||`
    Or,
}

/// A modifier expression.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// A closure parameter.
    Var(Var),
    /// A float constant.
    Float(f64),
    /// An integer constant.
    Int(i64),
    /// A boolean constant.
    Bool(bool),
    /// A unary operation.
    Unary(UnOp, Box<Expr>),
    /// A binary operation.
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// `if cond { then } else { otherwise }`.
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
    /// `expr as ty` (f32 <-> i64, bool -> i64).
    Cast(Box<Expr>, Ty),
}

/// A custom score modifier `|score, b, h, q, k| body`.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreMod {
    /// The parameter names as written (for printing back).
    pub params: [String; 5],
    /// The body, of type f32.
    pub body: Expr,
}

/// A custom mask predicate `|b, h, q, k| body`.
#[derive(Clone, Debug, PartialEq)]
pub struct MaskMod {
    /// The parameter names as written (for printing back).
    pub params: [String; 4],
    /// The body, of type bool.
    pub body: Expr,
}

impl ScoreMod {
    /// The modified score for one (batch, head, query position, key position).
    pub fn apply(&self, score: f64, b: i64, h: i64, q: i64, k: i64) -> f64 {
        eval::eval(&self.body, &eval::Env { score, b, h, q, k }).as_f64()
    }
}

impl MaskMod {
    /// Whether the key is kept.
    pub fn keeps(&self, b: i64, h: i64, q: i64, k: i64) -> bool {
        let env = eval::Env {
            score: 0.0,
            b,
            h,
            q,
            k,
        };
        eval::eval(&self.body, &env).as_bool()
    }
}
