//! Lowering from syn's closure AST to the typed modifier IR. Every error carries the span of the
//! offending tokens.

use super::{
    BinOp, Expr, Let, MASK_MOD_PARAMS, MAX_LET_EXPANSION, MaskMod, ParamRead, SCORE_MOD_PARAMS,
    ScoreMod, Ty, UnOp, Var,
};
use crate::parse::MAX_EXPR_DEPTH;
use crate::spec::{DataDecl, ParamDecl};
use proc_macro2::Span;
use std::cell::RefCell;
use syn::spanned::Spanned;

/// The tensors a modifier may read: the spec's parameters and data tensors.
#[derive(Clone, Copy, Default)]
pub(crate) struct Readable<'s> {
    /// `params(...)`.
    pub params: &'s [ParamDecl],
    /// `data(...)`.
    pub data: &'s [DataDecl],
}

impl Readable<'_> {
    /// The number of dimensions of the tensor `name` and the type its elements read as.
    fn find(&self, name: &str) -> Option<(usize, Ty)> {
        let param = self.params.iter().find(|p| p.name == name);
        let data = self.data.iter().find(|d| d.name == name);
        param
            .map(|p| (p.dims.len(), Ty::F32))
            .or(data.map(|d| (d.dims.len(), d.dtype.read_ty())))
    }

    fn names(&self) -> Vec<&str> {
        let params = self.params.iter().map(|p| p.name.as_str());
        params
            .chain(self.data.iter().map(|d| d.name.as_str()))
            .collect()
    }
}

/// A lowered score modifier and the parameter reads in it, each with the span of its tokens
/// (for the index bounds the spec proves once every dimension is known).
pub(crate) struct LoweredScoreMod {
    pub score_mod: ScoreMod,
    pub reads: Vec<(ParamRead, Span)>,
}

/// Lowers `|score, b, h, q, k| body` (body of type f32); `NAME[i, ..]` reads one of `params`.
pub(crate) fn lower_score_mod(
    closure: &syn::ExprClosure,
    params: Readable,
) -> syn::Result<LoweredScoreMod> {
    let lowered = lower_closure(closure, &SCORE_MOD_PARAMS, Ty::F32, "score_mod", params)?;
    let names = lowered
        .names
        .try_into()
        .expect("arity checked by lower_closure");
    Ok(LoweredScoreMod {
        score_mod: ScoreMod {
            params: names,
            body: lowered.body,
            lets: lowered.lets,
        },
        reads: lowered.reads,
    })
}

/// Lowers `|b, h, q, k| body` (body of type bool). Reads of `params` lower, so that validation
/// can say why a mask may not read them (masks are not differentiable).
pub(crate) fn lower_mask_mod(
    closure: &syn::ExprClosure,
    params: Readable,
) -> syn::Result<(MaskMod, Vec<(ParamRead, Span)>)> {
    let lowered = lower_closure(closure, &MASK_MOD_PARAMS, Ty::Bool, "mask_mod", params)?;
    let mask_mod = MaskMod {
        params: lowered
            .names
            .try_into()
            .expect("arity checked by lower_closure"),
        body: lowered.body,
        lets: lowered.lets,
    };
    Ok((mask_mod, lowered.reads))
}

/// A closure lowered: its parameter names, body, `let` bindings and tensor reads.
struct Lowered {
    names: Vec<String>,
    body: Expr,
    lets: Vec<Let>,
    reads: Vec<(ParamRead, Span)>,
}

fn lower_closure(
    closure: &syn::ExprClosure,
    roles: &[Var],
    want: Ty,
    what: &str,
    params: Readable,
) -> syn::Result<Lowered> {
    let signature = match roles.len() {
        5 => "|score, b, h, q, k|",
        _ => "|b, h, q, k|",
    };
    if closure.inputs.len() != roles.len() {
        return Err(syn::Error::new_spanned(
            &closure.inputs,
            format!(
                "{what} takes {} parameters {signature}, found {}",
                roles.len(),
                closure.inputs.len()
            ),
        ));
    }
    if let Some(kw) = closure
        .movability
        .map(|m| m.span())
        .or(closure.asyncness.map(|a| a.span()))
        .or(closure.capture.map(|c| c.span()))
    {
        return Err(syn::Error::new(
            kw,
            format!("{what} must be a plain closure {signature} expr"),
        ));
    }
    if let syn::ReturnType::Type(arrow, _) = &closure.output {
        return Err(syn::Error::new_spanned(
            arrow,
            format!("{what} takes no return type annotation; its type is fixed"),
        ));
    }
    let mut scope = Vec::new();
    for (pat, role) in closure.inputs.iter().zip(roles) {
        let name = match pat {
            syn::Pat::Ident(p) if p.by_ref.is_none() && p.subpat.is_none() => p.ident.to_string(),
            syn::Pat::Wild(_) => "_".to_string(),
            syn::Pat::Type(t) => {
                return Err(syn::Error::new_spanned(
                    t.colon_token,
                    "modifier parameters take no type annotations (score is f32, b/h/q/k are i64)",
                ));
            }
            other => {
                return Err(syn::Error::new_spanned(
                    other,
                    "expected a parameter name or `_`",
                ));
            }
        };
        if params.find(&name).is_some() {
            return Err(syn::Error::new_spanned(
                pat,
                format!(
                    "`{name}` is both a closure parameter and a tensor declared in \
                     params(...) or data(...); rename one"
                ),
            ));
        }
        scope.push((name, *role));
    }
    let scope = Scope::new(scope, params);
    let (body, ty) = lower_expr(&closure.body, &scope)?;
    if body.depth() > MAX_EXPR_DEPTH {
        return Err(syn::Error::new_spanned(
            &closure.body,
            format!(
                "{what} is {} operations deep once its `let` bindings are substituted; \
                 allowed: at most {MAX_EXPR_DEPTH}",
                body.depth()
            ),
        ));
    }
    if ty != want {
        return Err(syn::Error::new_spanned(
            &closure.body,
            format!(
                "{what} must evaluate to {}, this expression is {}",
                want.name(),
                ty.name()
            ),
        ));
    }
    Ok(Lowered {
        names: scope.vars.into_iter().map(|(name, _)| name).collect(),
        body,
        lets: scope.lets.into_inner(),
        reads: scope.reads.into_inner(),
    })
}

/// What names mean inside a closure body.
pub(super) struct Scope<'p> {
    /// The closure's parameters and the variables they stand for.
    vars: Vec<(String, Var)>,
    /// The tensors `NAME[..]` may read.
    params: Readable<'p>,
    /// The reads lowered so far, with their spans.
    reads: RefCell<Vec<(ParamRead, Span)>>,
    /// Every `let` binding lowered so far, in source order.
    lets: RefCell<Vec<Let>>,
    /// The bindings in scope where lowering stands: indices into `lets`, innermost last, with
    /// each value's type and size.
    visible: RefCell<Vec<(usize, Ty, usize)>>,
    /// IR nodes the uses of bindings have copied so far (bounded by [`MAX_LET_EXPANSION`]).
    expanded: std::cell::Cell<usize>,
}

impl<'p> Scope<'p> {
    pub(super) fn new(vars: Vec<(String, Var)>, params: Readable<'p>) -> Self {
        Scope {
            vars,
            params,
            reads: RefCell::new(Vec::new()),
            lets: RefCell::new(Vec::new()),
            visible: RefCell::new(Vec::new()),
            expanded: std::cell::Cell::new(0),
        }
    }

    /// The value and type of the binding `name` in scope, counting its copy.
    fn binding(&self, name: &str, at: &syn::Ident) -> syn::Result<Option<(Expr, Ty)>> {
        let lets = self.lets.borrow();
        let visible = self.visible.borrow();
        let Some(&(i, ty, size)) = visible.iter().rev().find(|(i, ..)| lets[*i].name == name)
        else {
            return Ok(None);
        };
        let expanded = self.expanded.get() + size;
        if expanded > MAX_LET_EXPANSION {
            return Err(syn::Error::new_spanned(
                at,
                format!(
                    "the closure's `let` bindings expand to more than {MAX_LET_EXPANSION} \
                     operations where they are used (each use copies the bound expression); \
                     allowed: at most {MAX_LET_EXPANSION}"
                ),
            ));
        }
        self.expanded.set(expanded);
        Ok(Some((lets[i].value.clone(), ty)))
    }

    /// Whether `name` is taken: a closure parameter, a tensor or a binding of this closure.
    fn taken(&self, name: &str) -> Option<&'static str> {
        if self.vars.iter().any(|(n, _)| n == name) {
            Some("a closure parameter")
        } else if self.params.find(name).is_some() {
            Some("a tensor declared in params(...) or data(...)")
        } else if self.lets.borrow().iter().any(|l| l.name == name) {
            Some("bound by another `let` of this closure")
        } else {
            None
        }
    }
}

pub(super) fn lower_expr(expr: &syn::Expr, scope: &Scope) -> syn::Result<(Expr, Ty)> {
    match expr {
        syn::Expr::Paren(p) => lower_expr(&p.expr, scope),
        syn::Expr::Group(g) => lower_expr(&g.expr, scope),
        syn::Expr::Block(b) if b.label.is_none() => lower_block(&b.block, scope),
        syn::Expr::Lit(lit) => lower_lit(&lit.lit),
        syn::Expr::Path(path) => lower_path(path, scope),
        syn::Expr::Unary(u) => lower_unary(u, scope),
        syn::Expr::Binary(b) => lower_binary(b, scope),
        syn::Expr::MethodCall(m) => lower_method(m, scope),
        syn::Expr::Cast(c) => lower_cast(c, scope),
        syn::Expr::If(i) => lower_if(i, scope),
        syn::Expr::Index(i) => lower_index(i, scope),
        syn::Expr::Call(c) => lower_call(c, scope),
        other => Err(syn::Error::new_spanned(
            other,
            "unsupported syntax in a modifier; allowed: parameters, numbers, true/false, \
             + - * / %, comparisons, && || !, if/else, `as f32`/`as i64`, the methods \
             abs, min, max, exp, ln, tanh, sqrt, `min(a, b)`, `max(a, b)`, and reads \
             `NAME[i, ..]` of tensors declared in params(...) or data(...)",
        )),
    }
}

/// `NAME[i]` or `NAME[i, j, ..]` (the parser turns the latter into a tuple index).
fn lower_index(i: &syn::ExprIndex, scope: &Scope) -> syn::Result<(Expr, Ty)> {
    let name = match &*i.expr {
        syn::Expr::Path(p) => p.path.get_ident().map(ToString::to_string),
        _ => None,
    };
    let Some(name) = name else {
        return Err(syn::Error::new_spanned(
            &i.expr,
            "only a tensor declared in params(...) or data(...) can be indexed",
        ));
    };
    if scope.vars.iter().any(|(n, _)| *n == name) {
        return Err(syn::Error::new_spanned(
            &i.expr,
            format!(
                "`{name}` is a closure parameter and cannot be indexed; only tensors declared \
                 in params(...) or data(...) can"
            ),
        ));
    }
    let Some((arity, read_ty)) = scope.params.find(&name) else {
        let declared = scope.params.names();
        let known = if declared.is_empty() {
            "no tensors are declared (add `params(NAME: [DIM, ..])` or \
             `data(NAME: [DIM, ..] TYPE)` to the spec)"
                .to_string()
        } else {
            format!("declared: {}", declared.join(", "))
        };
        return Err(syn::Error::new_spanned(
            &i.expr,
            format!("unknown tensor `{name}`; {known}"),
        ));
    };
    let written: Vec<&syn::Expr> = match &*i.index {
        syn::Expr::Tuple(t) => t.elems.iter().collect(),
        one => vec![one],
    };
    if written.len() != arity {
        return Err(syn::Error::new_spanned(
            &i.index,
            format!(
                "`{name}` has {} dimension{}, this reads it with {} ind{}",
                arity,
                if arity == 1 { "" } else { "s" },
                written.len(),
                if written.len() == 1 { "ex" } else { "ices" }
            ),
        ));
    }
    let mut indices = Vec::with_capacity(written.len());
    for index in written {
        let (e, ty) = lower_expr(index, scope)?;
        if ty != Ty::I64 {
            return Err(syn::Error::new_spanned(
                index,
                format!("an index of `{name}` must be i64, this is {}", ty.name()),
            ));
        }
        if e.uses(Var::Score) || e.reads_params() {
            return Err(syn::Error::new_spanned(
                index,
                format!(
                    "an index of `{name}` may use only b, h, q, k and constants, not the score \
                     or another tensor"
                ),
            ));
        }
        indices.push(e);
    }
    let read = ParamRead {
        name,
        indices,
        ty: read_ty,
    };
    scope.reads.borrow_mut().push((read.clone(), i.span()));
    Ok((Expr::Param(read), read_ty))
}

/// `min(a, b)` and `max(a, b)`, the free-function spellings of the methods.
fn lower_call(c: &syn::ExprCall, scope: &Scope) -> syn::Result<(Expr, Ty)> {
    let name = match &*c.func {
        syn::Expr::Path(p) => p.path.get_ident().map(ToString::to_string),
        _ => None,
    };
    let op = match name.as_deref() {
        Some("min") => BinOp::Min,
        Some("max") => BinOp::Max,
        _ => {
            return Err(syn::Error::new_spanned(
                &c.func,
                "unknown function; allowed: min(a, b), max(a, b)",
            ));
        }
    };
    if c.args.len() != 2 {
        return Err(syn::Error::new_spanned(
            &c.func,
            format!(
                "`{}` takes 2 arguments, found {}",
                op.symbol(),
                c.args.len()
            ),
        ));
    }
    let a = lower_expr(&c.args[0], scope)?;
    let b = lower_expr(&c.args[1], scope)?;
    combine(op, a, b, c.func.span())
}

/// `{ let a = ..; let b = ..; expr }`: the bindings are in scope until the block ends.
fn lower_block(block: &syn::Block, scope: &Scope) -> syn::Result<(Expr, Ty)> {
    let Some((syn::Stmt::Expr(last, None), lets)) = block.stmts.split_last() else {
        return Err(syn::Error::new_spanned(
            block,
            "a block in a modifier holds `let NAME = expr;` bindings and ends with one \
             expression (no `;` after it)",
        ));
    };
    let outer = scope.visible.borrow().len();
    let lowered = lets
        .iter()
        .try_for_each(|stmt| lower_let(stmt, scope))
        .and_then(|()| lower_expr(last, scope));
    scope.visible.borrow_mut().truncate(outer);
    lowered
}

/// `let NAME = expr;`, bound in `scope`.
fn lower_let(stmt: &syn::Stmt, scope: &Scope) -> syn::Result<()> {
    let syn::Stmt::Local(local) = stmt else {
        return Err(syn::Error::new_spanned(
            stmt,
            "only `let NAME = expr;` may stand before a block's last expression",
        ));
    };
    let name = match &local.pat {
        syn::Pat::Ident(p)
            if p.by_ref.is_none() && p.mutability.is_none() && p.subpat.is_none() =>
        {
            &p.ident
        }
        syn::Pat::Type(t) => {
            return Err(syn::Error::new_spanned(
                t.colon_token,
                "a modifier's `let` takes no type annotation; its type is the expression's",
            ));
        }
        other => {
            return Err(syn::Error::new_spanned(
                other,
                "a modifier's `let` binds one name: `let NAME = expr;`",
            ));
        }
    };
    let Some(init) = &local.init else {
        return Err(syn::Error::new_spanned(
            local,
            format!("`let {name}` needs a value: `let {name} = expr;`"),
        ));
    };
    if let Some((else_token, _)) = &init.diverge {
        return Err(syn::Error::new_spanned(
            else_token,
            "a modifier's `let` has no `else` branch",
        ));
    }
    if let Some(what) = scope.taken(&name.to_string()) {
        return Err(syn::Error::new_spanned(
            name,
            format!("`{name}` is {what}; a `let` in a modifier binds a new name"),
        ));
    }
    let (value, ty) = lower_expr(&init.expr, scope)?;
    if value.depth() > MAX_EXPR_DEPTH {
        return Err(syn::Error::new_spanned(
            &init.expr,
            format!(
                "`{name}` is {} operations deep once the bindings it uses are substituted; \
                 allowed: at most {MAX_EXPR_DEPTH}",
                value.depth()
            ),
        ));
    }
    let size = value.size();
    let mut lets = scope.lets.borrow_mut();
    scope.visible.borrow_mut().push((lets.len(), ty, size));
    lets.push(Let {
        name: name.to_string(),
        value,
    });
    Ok(())
}

fn lower_lit(lit: &syn::Lit) -> syn::Result<(Expr, Ty)> {
    match lit {
        syn::Lit::Int(i) => {
            let ty = match i.suffix() {
                "" | "i64" => Ty::I64,
                "f32" => Ty::F32,
                s => {
                    return Err(syn::Error::new_spanned(
                        i,
                        format!("unsupported literal suffix `{s}`; allowed: i64, f32 or none"),
                    ));
                }
            };
            let value: i64 = i.base10_parse()?;
            match ty {
                Ty::F32 => Ok((Expr::Float(value as f64), Ty::F32)),
                _ => Ok((Expr::Int(value), Ty::I64)),
            }
        }
        syn::Lit::Float(f) => match f.suffix() {
            "" | "f32" => {
                let value: f64 = f.base10_parse()?;
                // Modifiers compute in f32 on every backend: a constant past its range would be
                // infinite there and finite in the f64 reference.
                if value.abs() > f64::from(f32::MAX) {
                    return Err(syn::Error::new_spanned(
                        f,
                        format!(
                            "`{f}` is out of the f32 range; allowed: a magnitude of at most {:e}",
                            f32::MAX
                        ),
                    ));
                }
                Ok((Expr::Float(value), Ty::F32))
            }
            s => Err(syn::Error::new_spanned(
                f,
                format!("unsupported literal suffix `{s}`; allowed: f32 or none"),
            )),
        },
        syn::Lit::Bool(b) => Ok((Expr::Bool(b.value), Ty::Bool)),
        other => Err(syn::Error::new_spanned(
            other,
            "unsupported literal; allowed: integers, floats, true, false",
        )),
    }
}

fn lower_path(path: &syn::ExprPath, scope: &Scope) -> syn::Result<(Expr, Ty)> {
    let Some(ident) = path.path.get_ident() else {
        return Err(syn::Error::new_spanned(
            path,
            "expected a closure parameter name",
        ));
    };
    let name = ident.to_string();
    if let Some(bound) = scope.binding(&name, ident)? {
        return Ok(bound);
    }
    match scope
        .vars
        .iter()
        .rev()
        .find(|(n, _)| *n == name && n != "_")
    {
        Some((_, var)) => Ok((Expr::Var(*var), var.ty())),
        None => {
            let known: Vec<&str> = scope
                .vars
                .iter()
                .map(|(n, _)| n.as_str())
                .filter(|n| *n != "_")
                .collect();
            Err(syn::Error::new_spanned(
                ident,
                format!(
                    "unknown name `{name}`; the closure's parameters are: {}{}",
                    known.join(", "),
                    if scope.visible.borrow().is_empty() {
                        String::new()
                    } else {
                        let lets = scope.lets.borrow();
                        let bound: Vec<&str> = scope
                            .visible
                            .borrow()
                            .iter()
                            .map(|(i, ..)| lets[*i].name.as_str())
                            .collect();
                        format!("; bound by `let` here: {}", bound.join(", "))
                    }
                ),
            ))
        }
    }
}

fn lower_unary(u: &syn::ExprUnary, scope: &Scope) -> syn::Result<(Expr, Ty)> {
    let (a, ty) = lower_expr(&u.expr, scope)?;
    let (op, symbol, ok) = match u.op {
        syn::UnOp::Neg(_) => (UnOp::Neg, "-", ty != Ty::Bool),
        syn::UnOp::Not(_) => (UnOp::Not, "!", ty == Ty::Bool),
        _ => {
            return Err(syn::Error::new_spanned(u.op, "unsupported unary operator"));
        }
    };
    if !ok {
        return Err(syn::Error::new_spanned(
            u,
            format!("cannot apply `{symbol}` to {}", ty.name()),
        ));
    }
    Ok((Expr::Unary(op, Box::new(a)), ty))
}

fn lower_binary(b: &syn::ExprBinary, scope: &Scope) -> syn::Result<(Expr, Ty)> {
    let op = match b.op {
        syn::BinOp::Add(_) => BinOp::Add,
        syn::BinOp::Sub(_) => BinOp::Sub,
        syn::BinOp::Mul(_) => BinOp::Mul,
        syn::BinOp::Div(_) => BinOp::Div,
        syn::BinOp::Rem(_) => BinOp::Rem,
        syn::BinOp::Lt(_) => BinOp::Lt,
        syn::BinOp::Le(_) => BinOp::Le,
        syn::BinOp::Gt(_) => BinOp::Gt,
        syn::BinOp::Ge(_) => BinOp::Ge,
        syn::BinOp::Eq(_) => BinOp::Eq,
        syn::BinOp::Ne(_) => BinOp::Ne,
        syn::BinOp::And(_) => BinOp::And,
        syn::BinOp::Or(_) => BinOp::Or,
        other => {
            return Err(syn::Error::new_spanned(
                other,
                "unsupported operator; allowed: + - * / % < <= > >= == != && ||",
            ));
        }
    };
    let lhs = lower_expr(&b.left, scope)?;
    let rhs = lower_expr(&b.right, scope)?;
    combine(op, lhs, rhs, b.op.span())
}

/// Types a binary operation. An integer literal next to an f32 operand is read as a float, as
/// people write `score - 1`.
fn combine(
    op: BinOp,
    lhs: (Expr, Ty),
    rhs: (Expr, Ty),
    span: proc_macro2::Span,
) -> syn::Result<(Expr, Ty)> {
    let (lhs, rhs) = coerce_int_literals(lhs, rhs);
    let ((a, ta), (b, tb)) = (lhs, rhs);
    let result = match op {
        BinOp::And | BinOp::Or => (ta == Ty::Bool && tb == Ty::Bool).then_some(Ty::Bool),
        BinOp::Eq | BinOp::Ne => (ta == tb).then_some(Ty::Bool),
        BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge => {
            (ta == tb && ta != Ty::Bool).then_some(Ty::Bool)
        }
        _ => (ta == tb && ta != Ty::Bool).then_some(ta),
    };
    match result {
        Some(ty) => Ok((Expr::Binary(op, Box::new(a), Box::new(b)), ty)),
        None => Err(syn::Error::new(
            span,
            format!(
                "type mismatch: `{}` on {} and {}; convert with `as f32` or `as i64`",
                op.symbol(),
                ta.name(),
                tb.name()
            ),
        )),
    }
}

fn coerce_int_literals(lhs: (Expr, Ty), rhs: (Expr, Ty)) -> ((Expr, Ty), (Expr, Ty)) {
    fn to_float(e: (Expr, Ty)) -> (Expr, Ty) {
        match e {
            (Expr::Int(i), Ty::I64) => (Expr::Float(i as f64), Ty::F32),
            (Expr::Unary(UnOp::Neg, inner), Ty::I64) if matches!(*inner, Expr::Int(_)) => {
                let (x, _) = to_float((*inner, Ty::I64));
                (Expr::Unary(UnOp::Neg, Box::new(x)), Ty::F32)
            }
            other => other,
        }
    }
    match (lhs.1, rhs.1) {
        (Ty::F32, Ty::I64) => (lhs, to_float(rhs)),
        (Ty::I64, Ty::F32) => (to_float(lhs), rhs),
        _ => (lhs, rhs),
    }
}

fn lower_method(m: &syn::ExprMethodCall, scope: &Scope) -> syn::Result<(Expr, Ty)> {
    if let Some(turbofish) = &m.turbofish {
        return Err(syn::Error::new_spanned(
            turbofish,
            "modifier methods take no type arguments",
        ));
    }
    let name = m.method.to_string();
    let receiver = lower_expr(&m.receiver, scope)?;
    let arity = |n: usize| -> syn::Result<()> {
        if m.args.len() == n {
            Ok(())
        } else {
            Err(syn::Error::new_spanned(
                &m.method,
                format!(
                    "`{name}` takes {n} argument{}, found {}",
                    if n == 1 { "" } else { "s" },
                    m.args.len()
                ),
            ))
        }
    };
    let unary = |op: UnOp, float_only: bool| -> syn::Result<(Expr, Ty)> {
        arity(0)?;
        let (a, ty) = receiver.clone();
        let ok = if float_only {
            ty == Ty::F32
        } else {
            ty != Ty::Bool
        };
        if !ok {
            return Err(syn::Error::new_spanned(
                &m.method,
                format!(
                    "`{name}` needs {}, the receiver is {}",
                    if float_only { "an f32" } else { "a number" },
                    ty.name()
                ),
            ));
        }
        Ok((Expr::Unary(op, Box::new(a)), ty))
    };
    match name.as_str() {
        "abs" => unary(UnOp::Abs, false),
        "exp" => unary(UnOp::Exp, true),
        "ln" => unary(UnOp::Ln, true),
        "tanh" => unary(UnOp::Tanh, true),
        "sqrt" => unary(UnOp::Sqrt, true),
        "min" | "max" => {
            arity(1)?;
            let op = if name == "min" {
                BinOp::Min
            } else {
                BinOp::Max
            };
            let arg = lower_expr(&m.args[0], scope)?;
            combine(op, receiver, arg, m.method.span())
        }
        _ => Err(syn::Error::new_spanned(
            &m.method,
            format!("unknown method `{name}`; allowed: abs, min, max, exp, ln, tanh, sqrt"),
        )),
    }
}

fn lower_cast(c: &syn::ExprCast, scope: &Scope) -> syn::Result<(Expr, Ty)> {
    let (a, from) = lower_expr(&c.expr, scope)?;
    let to = match &*c.ty {
        syn::Type::Path(p) if p.path.is_ident("f32") => Ty::F32,
        syn::Type::Path(p) if p.path.is_ident("i64") => Ty::I64,
        other => {
            return Err(syn::Error::new_spanned(
                other,
                "modifiers cast only to f32 or i64",
            ));
        }
    };
    if from == Ty::Bool && to == Ty::F32 {
        return Err(syn::Error::new_spanned(
            c,
            "cannot cast bool to f32; cast to i64 first, or use if/else",
        ));
    }
    Ok((Expr::Cast(Box::new(a), to), to))
}

fn lower_if(i: &syn::ExprIf, scope: &Scope) -> syn::Result<(Expr, Ty)> {
    let (cond, tc) = lower_expr(&i.cond, scope)?;
    if tc != Ty::Bool {
        return Err(syn::Error::new_spanned(
            &i.cond,
            format!("an `if` condition must be bool, this is {}", tc.name()),
        ));
    }
    let Some((_, otherwise)) = &i.else_branch else {
        return Err(syn::Error::new_spanned(
            i.if_token,
            "an `if` in a modifier needs an `else` branch",
        ));
    };
    let then = lower_block(&i.then_branch, scope)?;
    let otherwise = lower_expr(otherwise, scope)?;
    let (then, otherwise) = coerce_int_literals(then, otherwise);
    if then.1 != otherwise.1 {
        return Err(syn::Error::new_spanned(
            i,
            format!(
                "`if` branches differ in type: {} and {}",
                then.1.name(),
                otherwise.1.name()
            ),
        ));
    }
    let ty = then.1;
    Ok((
        Expr::Select(Box::new(cond), Box::new(then.0), Box::new(otherwise.0)),
        ty,
    ))
}
