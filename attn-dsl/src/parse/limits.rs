//! Limits on the size and shape of spec text, checked on the tokens before syn builds a syntax
//! tree from them.
//!
//! syn's parser, its syntax tree's destructor, our lowering and every pass over the modifier IR
//! recurse once per level of an expression, so an input nested deeply enough would overflow the
//! stack and abort. The walk here is iterative and rejects such input first, with an error at the
//! offending tokens. The depth it measures bounds every later recursion from above: each node of
//! an expression tree takes at least one operator token or one bracket pair.

use proc_macro2::{Span, TokenStream, TokenTree};

/// Longest spec source accepted by [`super::parse_str`], in bytes.
pub const MAX_SPEC_BYTES: usize = 64 * 1024;
/// Deepest nesting of brackets (`()`, `[]`, `{}`) in a spec.
pub const MAX_BRACKET_DEPTH: usize = 32;
/// Largest expression depth in one spec item: along any path into the item, the operator and
/// keyword tokens of every bracket level it passes through, plus one per bracket pair. A flat
/// chain `a + b + c` is as deep as it is long, since its syntax tree is.
pub const MAX_EXPR_DEPTH: usize = 256;
/// Longest literal (number or string) in a spec, in characters. Longer numbers cannot be exact
/// in f64 or u64 anyway, and parsing them costs time quadratic in their length.
pub const MAX_LITERAL_CHARS: usize = 64;

/// One open bracket level of the walk.
struct Level {
    tokens: proc_macro2::token_stream::IntoIter,
    /// Operator and keyword tokens seen at this level (in the current item, at the top).
    operators: usize,
    /// The deepest bracket pair inside this level: 1 + its own depth.
    deepest_child: usize,
    /// Where this level opened (the whole item at the top).
    open: Span,
    /// The operators before the level's first `let`: every statement of a block nests in them.
    statement_base: Option<usize>,
    /// The deepest statement of this level ended by `;` so far (statements do not nest in
    /// one another).
    finished: usize,
}

impl Level {
    fn new(tokens: TokenStream, open: Span) -> Level {
        Level {
            tokens: tokens.into_iter(),
            operators: 0,
            deepest_child: 0,
            open,
            statement_base: None,
            finished: 0,
        }
    }

    fn depth(&self) -> usize {
        self.finished.max(self.operators + self.deepest_child)
    }

    /// A `;` ends a statement: the next one starts from the operators the block nests in.
    fn end_statement(&mut self) {
        self.finished = self.depth();
        self.operators = self.statement_base.unwrap_or(0);
        self.deepest_child = 0;
    }
}

/// Checks `tokens` against the limits above; the error points at the first violation.
pub(super) fn check(tokens: &TokenStream) -> syn::Result<()> {
    let mut stack = vec![Level::new(tokens.clone(), Span::call_site())];
    let mut item_start: Option<Span> = None;
    loop {
        let Some(level) = stack.last_mut() else {
            return Ok(());
        };
        let Some(token) = level.tokens.next() else {
            let done = stack.pop().expect("the loop holds a level");
            let depth = done.depth();
            match stack.last_mut() {
                Some(parent) => {
                    parent.deepest_child = parent.deepest_child.max(depth + 1);
                    check_depth(parent.depth(), done.open)?;
                }
                None => check_depth(depth, item_start.unwrap_or(done.open))?,
            }
            continue;
        };
        let top = stack.len() == 1;
        if top && item_start.is_none() {
            item_start = Some(token.span());
        }
        match token {
            TokenTree::Group(group) => {
                if stack.len() > MAX_BRACKET_DEPTH {
                    return Err(syn::Error::new(
                        group.span_open(),
                        format!(
                            "brackets nest too deeply here; allowed: at most \
                             {MAX_BRACKET_DEPTH} levels"
                        ),
                    ));
                }
                stack.push(Level::new(group.stream(), group.span_open()));
            }
            TokenTree::Punct(punct) if top && punct.as_char() == ',' => {
                // A new item starts: its depth is measured afresh.
                let level = stack.last_mut().expect("the loop holds a level");
                check_depth(level.depth(), item_start.unwrap_or(punct.span()))?;
                level.operators = 0;
                level.deepest_child = 0;
                level.statement_base = None;
                level.finished = 0;
                item_start = None;
            }
            TokenTree::Punct(punct) if punct.as_char() == ';' => {
                let level = stack.last_mut().expect("the loop holds a level");
                check_depth(level.depth(), item_start.unwrap_or(level.open))?;
                level.end_statement();
            }
            TokenTree::Punct(_) => {
                let level = stack.last_mut().expect("the loop holds a level");
                level.operators += 1;
                check_depth(level.depth(), item_start.unwrap_or(level.open))?;
            }
            TokenTree::Ident(ident) => {
                if matches!(
                    ident.to_string().as_str(),
                    "if" | "else" | "as" | "match" | "let" | "loop" | "while" | "for" | "return"
                ) {
                    let level = stack.last_mut().expect("the loop holds a level");
                    if ident == "let" && level.statement_base.is_none() {
                        level.statement_base = Some(level.operators);
                    }
                    level.operators += 1;
                }
            }
            TokenTree::Literal(literal) => {
                let chars = literal.to_string().chars().count();
                if chars > MAX_LITERAL_CHARS {
                    return Err(syn::Error::new(
                        literal.span(),
                        format!(
                            "this literal is {chars} characters long; allowed: at most \
                             {MAX_LITERAL_CHARS}"
                        ),
                    ));
                }
            }
        }
    }
}

fn check_depth(depth: usize, at: Span) -> syn::Result<()> {
    if depth > MAX_EXPR_DEPTH {
        return Err(syn::Error::new(
            at,
            format!(
                "this item nests too deeply: more than {MAX_EXPR_DEPTH} levels of operators \
                 and brackets; allowed: at most {MAX_EXPR_DEPTH} (split the expression or \
                 simplify it)"
            ),
        ));
    }
    Ok(())
}
