//! The backward's notes on a `score_mod` closure, placed at its tokens: the notes of the
//! derivative pass, each at the span of the subexpression it is about.

use super::SCORE_MOD_PARAMS;
use super::grad::{GradNote, derivative};
use super::lower::{LoweredScoreMod, Readable, Scope, lower_expr, lower_score_mod};
use proc_macro2::Span;
use syn::spanned::Spanned;

/// The notes of the derivative of a `score_mod` closure with respect to its score (where it is
/// only piecewise, or zero almost everywhere), each at the outermost subexpression of the body
/// it is about (else at the body). Empty when the closure does not lower or has no derivative.
pub(crate) fn score_mod_notes(
    closure: &syn::ExprClosure,
    params: Readable,
) -> Vec<(GradNote, Span)> {
    let Ok(LoweredScoreMod {
        score_mod: lowered, ..
    }) = lower_score_mod(closure, params)
    else {
        return Vec::new();
    };
    let Ok(gradient) = derivative(&lowered.body) else {
        return Vec::new();
    };
    let scope = Scope::new(
        lowered
            .params
            .iter()
            .cloned()
            .zip(SCORE_MOD_PARAMS)
            .collect(),
        params,
    );
    let spans = printed_spans(&closure.body, &scope);
    gradient
        .notes
        .into_iter()
        .map(|note| {
            let span = spans
                .get(&note.at)
                .copied()
                .unwrap_or_else(|| closure.body.span());
            (note, span)
        })
        .collect()
}

/// The span of every subexpression of `body` by the printed form of its lowering, the
/// outermost (then the first in the source) where several print alike. Each subexpression is
/// lowered once, on its own, in the closure's scope: one that uses a `let` binding does not
/// lower there and gets no span of its own (its note falls to an enclosing expression). The
/// walk keeps its own stack (the parser bounds the depth, not the width).
fn printed_spans(body: &syn::Expr, scope: &Scope) -> std::collections::HashMap<String, Span> {
    let mut spans = std::collections::HashMap::new();
    let mut stack = vec![body];
    while let Some(e) = stack.pop() {
        if let Ok((x, _)) = lower_expr(e, scope) {
            spans.entry(x.to_string()).or_insert_with(|| e.span());
        }
        let mut children: Vec<&syn::Expr> = match e {
            syn::Expr::Paren(p) => vec![&p.expr],
            syn::Expr::Group(g) => vec![&g.expr],
            syn::Expr::Block(b) => block_exprs(&b.block).collect(),
            syn::Expr::Unary(u) => vec![&u.expr],
            syn::Expr::Binary(b) => vec![&b.left, &b.right],
            syn::Expr::MethodCall(m) => std::iter::once(&*m.receiver).chain(&m.args).collect(),
            syn::Expr::Cast(c) => vec![&c.expr],
            syn::Expr::Call(c) => c.args.iter().collect(),
            syn::Expr::If(i) => std::iter::once(&*i.cond)
                .chain(block_exprs(&i.then_branch))
                .chain(i.else_branch.as_ref().map(|(_, e)| &**e))
                .collect(),
            _ => Vec::new(),
        };
        // Popped in source order.
        children.reverse();
        stack.extend(children);
    }
    spans
}

/// The expressions of a block's statements.
fn block_exprs(block: &syn::Block) -> impl Iterator<Item = &syn::Expr> {
    block.stmts.iter().filter_map(|s| match s {
        syn::Stmt::Expr(e, _) => Some(e),
        _ => None,
    })
}
