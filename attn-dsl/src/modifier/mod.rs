//! The modifier IR: typed scalar expressions for scores and masks.
//!
//! Custom modifiers are written as Rust closures: a score modifier `|score, b, h, q, k| expr`
//! maps an f32 score to an f32 score, a mask predicate `|b, h, q, k| expr` says whether a key is
//! kept. `b` is the batch index, `h` the query head, and `q`, `k` the absolute positions of the
//! query and the key (i64, docs/semantics.md, "Scores, masks and positions").
//!
//! The built-in parts of a spec (scale, softcap, ALiBi, causal, top-left causal, sliding window)
//! are expressed in the same IR by [`ScoreProgram::of`], so a backend sees one mechanism. Each
//! step is a pass over the IR that can be run and printed alone:
//! - `lower`: syn closure AST to typed IR, with spans on every error;
//! - [`typecheck`]: the types of an IR tree built in code;
//! - [`fold`]: constant folding and algebraic simplification;
//! - [`grad`]: the derivative of a score program with respect to the raw score (the backward
//!   pass's `d score_mod / d score`);
//! - [`interval`]: interval analysis, classifying a tile of (query, key) positions as all kept,
//!   all masked, or mixed, soundly.
//!
//! The text form (`Display` of [`Expr`] and [`ScoreProgram`]) is Rust expression syntax with the
//! canonical names `score, b, h, q, k, qi, ki`; tables print as `[v0, v1, ..][index]`.

mod eval;
pub mod fold;
pub mod grad;
pub mod interval;
mod lower;
mod notes;
mod print;
mod program;
pub mod scale;
pub mod typecheck;

pub use eval::{Env, ParamValues, Value, eval};
pub(crate) use lower::{Readable, lower_mask_mod, lower_score_mod};
pub(crate) use notes::score_mod_notes;
pub use program::ScoreProgram;

/// Most IR nodes the `let` bindings of one closure may add by substitution (each use of a
/// binding copies its expression), so that a chain of bindings cannot grow a tree without bound.
pub const MAX_LET_EXPANSION: usize = 20_000;

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

/// A variable of a modifier expression.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Var {
    /// The score: in a custom score modifier, after the built-in modifiers; in a
    /// [`ScoreProgram`], the raw `<q, k>` (after RoPE) the whole pipeline starts from.
    Score,
    /// Batch index.
    Batch,
    /// Query head index.
    Head,
    /// Absolute query position.
    Query,
    /// Absolute key position.
    Key,
    /// Index of the query row in this call, `0..Sq` (built-ins only, e.g. top-left causal).
    QueryIndex,
    /// Index of the key in this call, `0..Skv` (built-ins only).
    KeyIndex,
}

impl Var {
    /// Every variable, in [`Var::index`] order.
    pub const ALL: [Var; 7] = [
        Var::Score,
        Var::Batch,
        Var::Head,
        Var::Query,
        Var::Key,
        Var::QueryIndex,
        Var::KeyIndex,
    ];

    /// The type of the variable.
    pub fn ty(self) -> Ty {
        match self {
            Var::Score => Ty::F32,
            _ => Ty::I64,
        }
    }

    /// Position in [`Var::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The name the IR text form uses.
    pub fn canonical_name(self) -> &'static str {
        ["score", "b", "h", "q", "k", "qi", "ki"][self.index()]
    }
}

/// The parameters of a score modifier closure, in order.
pub const SCORE_MOD_PARAMS: [Var; 5] = [Var::Score, Var::Batch, Var::Head, Var::Query, Var::Key];
/// The parameters of a mask predicate closure, in order.
pub const MASK_MOD_PARAMS: [Var; 4] = [Var::Batch, Var::Head, Var::Query, Var::Key];

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

impl BinOp {
    /// The operator as written (`min`/`max` for the methods).
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::Rem => "%",
            BinOp::Min => "min",
            BinOp::Max => "max",
            BinOp::Lt => "<",
            BinOp::Le => "<=",
            BinOp::Gt => ">",
            BinOp::Ge => ">=",
            BinOp::Eq => "==",
            BinOp::Ne => "!=",
            BinOp::And => "&&",
            BinOp::Or => "||",
        }
    }
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
    /// `[v0, v1, ..][index]`: a constant f32 table (e.g. ALiBi slopes by head); the index is
    /// clamped into the table.
    Table(Vec<f64>, Box<Expr>),
    /// `name[i, ..]`: one element of a learnable parameter tensor (f32) or of a data tensor
    /// (f32, or i32 read as i64), indices i64 and clamped into each dimension (the spec proves
    /// fixed dimensions in range, a call its batch and sequence dimensions).
    Param(ParamRead),
}

/// A read of one element of a learnable parameter or a data tensor: `name[i, j, ..]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamRead {
    /// The tensor's name, as declared in `params(...)` or `data(...)`.
    pub name: String,
    /// One i64 index per dimension, outermost first.
    pub indices: Vec<Expr>,
    /// The type of the value read: f32 for parameters and f32 data, i64 for i32 data.
    pub ty: Ty,
}

impl Expr {
    /// `a op b`.
    pub fn binary(op: BinOp, a: Expr, b: Expr) -> Expr {
        Expr::Binary(op, Box::new(a), Box::new(b))
    }

    /// `op a`.
    pub fn unary(op: UnOp, a: Expr) -> Expr {
        Expr::Unary(op, Box::new(a))
    }

    /// `a as ty`.
    pub fn cast(a: Expr, ty: Ty) -> Expr {
        Expr::Cast(Box::new(a), ty)
    }

    /// The expression with every occurrence of `var` replaced by `with`.
    pub fn substitute(&self, var: Var, with: &Expr) -> Expr {
        let sub = |e: &Expr| Box::new(e.substitute(var, with));
        match self {
            Expr::Var(v) if *v == var => with.clone(),
            Expr::Var(_) | Expr::Float(_) | Expr::Int(_) | Expr::Bool(_) => self.clone(),
            Expr::Unary(op, a) => Expr::Unary(*op, sub(a)),
            Expr::Binary(op, a, b) => Expr::Binary(*op, sub(a), sub(b)),
            Expr::Select(c, t, e) => Expr::Select(sub(c), sub(t), sub(e)),
            Expr::Cast(a, ty) => Expr::Cast(sub(a), *ty),
            Expr::Table(values, i) => Expr::Table(values.clone(), sub(i)),
            Expr::Param(read) => Expr::Param(ParamRead {
                name: read.name.clone(),
                indices: read
                    .indices
                    .iter()
                    .map(|i| i.substitute(var, with))
                    .collect(),
                ty: read.ty,
            }),
        }
    }

    /// The number of nodes on the longest path from the root to a leaf, counted without
    /// recursion (so any tree, however deep, can be measured before a recursive pass runs).
    pub fn depth(&self) -> usize {
        let mut deepest = 0;
        let mut stack = vec![(self, 1)];
        while let Some((e, d)) = stack.pop() {
            deepest = deepest.max(d);
            match e {
                Expr::Var(_) | Expr::Float(_) | Expr::Int(_) | Expr::Bool(_) => {}
                Expr::Unary(_, a) | Expr::Cast(a, _) | Expr::Table(_, a) => stack.push((a, d + 1)),
                Expr::Binary(_, a, b) => stack.extend([(&**a, d + 1), (&**b, d + 1)]),
                Expr::Select(c, t, o) => {
                    stack.extend([(&**c, d + 1), (&**t, d + 1), (&**o, d + 1)]);
                }
                Expr::Param(read) => stack.extend(read.indices.iter().map(|i| (i, d + 1))),
            }
        }
        deepest
    }

    /// The number of nodes in the expression, counted without recursion.
    pub fn size(&self) -> usize {
        let mut nodes = 0;
        self.visit(&mut |_| nodes += 1);
        nodes
    }

    /// Whether `var` occurs in the expression.
    pub fn uses(&self, var: Var) -> bool {
        match self {
            Expr::Var(v) => *v == var,
            Expr::Float(_) | Expr::Int(_) | Expr::Bool(_) => false,
            Expr::Unary(_, a) | Expr::Cast(a, _) | Expr::Table(_, a) => a.uses(var),
            Expr::Binary(_, a, b) => a.uses(var) || b.uses(var),
            Expr::Select(c, t, e) => c.uses(var) || t.uses(var) || e.uses(var),
            Expr::Param(read) => read.indices.iter().any(|i| i.uses(var)),
        }
    }

    /// Whether the expression reads a learnable parameter.
    pub fn reads_params(&self) -> bool {
        let mut found = false;
        self.visit(&mut |e| found |= matches!(e, Expr::Param(_)));
        found
    }

    /// Every distinct parameter read in the expression (equal reads once), in first-seen
    /// preorder.
    pub fn param_reads(&self) -> Vec<ParamRead> {
        let mut reads: Vec<ParamRead> = Vec::new();
        self.visit(&mut |e| {
            if let Expr::Param(read) = e
                && !reads.contains(read)
            {
                reads.push(read.clone());
            }
        });
        reads
    }

    /// Calls `f` on every node, parents before children, without recursion.
    pub fn visit(&self, f: &mut dyn FnMut(&Expr)) {
        let mut stack = vec![self];
        while let Some(e) = stack.pop() {
            f(e);
            match e {
                Expr::Var(_) | Expr::Float(_) | Expr::Int(_) | Expr::Bool(_) => {}
                Expr::Unary(_, a) | Expr::Cast(a, _) | Expr::Table(_, a) => stack.push(a),
                Expr::Binary(_, a, b) => stack.extend([&**b, &**a]),
                Expr::Select(c, t, o) => stack.extend([&**o, &**t, &**c]),
                Expr::Param(read) => stack.extend(read.indices.iter().rev()),
            }
        }
    }
}

/// A custom score modifier `|score, b, h, q, k| body`.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreMod {
    /// The parameter names as written (for printing back).
    pub params: [String; 5],
    /// The body, of type f32, with every `let` binding substituted.
    pub body: Expr,
    /// The closure's `let` bindings, for printing back.
    pub lets: Vec<Let>,
}

/// A custom mask predicate `|b, h, q, k| body`.
#[derive(Clone, Debug, PartialEq)]
pub struct MaskMod {
    /// The parameter names as written (for printing back).
    pub params: [String; 4],
    /// The body, of type bool, with every `let` binding substituted.
    pub body: Expr,
    /// The closure's `let` bindings, for printing back.
    pub lets: Vec<Let>,
}

/// A `let NAME = value;` of a modifier closure. Bindings are substituted where they are used
/// (the IR has no variables of its own), so the body alone says what the closure computes;
/// they are kept to print the closure back as written: the printer names each subtree equal to
/// a binding's value. `value` is closed over the closure's parameters (earlier bindings
/// substituted); every binding of a closure has a name of its own.
#[derive(Clone, Debug, PartialEq)]
pub struct Let {
    /// The name bound.
    pub name: String,
    /// The bound expression.
    pub value: Expr,
}

impl ScoreMod {
    /// The modified score for one (batch, head, query position, key position), for a modifier
    /// that reads no parameter.
    pub fn apply(&self, score: f64, b: i64, h: i64, q: i64, k: i64) -> f64 {
        self.apply_with(score, b, h, q, k, &[])
    }

    /// [`ScoreMod::apply`] with the values of the parameters the modifier reads.
    pub fn apply_with(
        &self,
        score: f64,
        b: i64,
        h: i64,
        q: i64,
        k: i64,
        params: &[ParamValues],
    ) -> f64 {
        let env = Env {
            score,
            b,
            h,
            q,
            k,
            params,
            ..Env::default()
        };
        eval(&self.body, &env).as_f64()
    }
}

impl MaskMod {
    /// Whether the key is kept, for a mask that reads no data tensor.
    pub fn keeps(&self, b: i64, h: i64, q: i64, k: i64) -> bool {
        self.keeps_with(b, h, q, k, &[])
    }

    /// [`MaskMod::keeps`] with the values of the data tensors the mask reads.
    pub fn keeps_with(&self, b: i64, h: i64, q: i64, k: i64, data: &[ParamValues]) -> bool {
        let env = Env {
            b,
            h,
            q,
            k,
            params: data,
            ..Env::default()
        };
        eval(&self.body, &env).as_bool()
    }
}
