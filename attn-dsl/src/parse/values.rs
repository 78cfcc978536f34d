//! Reading values out of expression tokens, with errors that say what was expected and found.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::punctuated::Punctuated;

/// The identifier an expression consists of, if it is a plain identifier.
pub(super) fn ident_of(expr: &syn::Expr) -> Option<syn::Ident> {
    match expr {
        syn::Expr::Path(p) if p.qself.is_none() => p.path.get_ident().cloned(),
        _ => None,
    }
}

/// A value written for the key (or argument) `what`.
pub(super) struct Value<'a> {
    what: String,
    expr: &'a syn::Expr,
}

impl<'a> Value<'a> {
    pub(super) fn new(what: &str, expr: &'a syn::Expr) -> Self {
        Value {
            what: what.to_string(),
            expr,
        }
    }

    /// An error saying what `what` accepts and what was found instead.
    pub(super) fn expected(&self, allowed: &str) -> syn::Error {
        syn::Error::new_spanned(
            self.expr,
            format!(
                "invalid value for `{}`: found {}; allowed: {allowed}",
                self.what,
                describe(self.expr)
            ),
        )
    }

    /// A non-negative integer literal.
    pub(super) fn u64(&self) -> syn::Result<u64> {
        match self.expr {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Int(i),
                ..
            }) if i.suffix().is_empty() => i.base10_parse::<u64>().map_err(|_| {
                syn::Error::new_spanned(i, format!("`{}` = {i} is too large", self.what))
            }),
            syn::Expr::Unary(syn::ExprUnary {
                op: syn::UnOp::Neg(_),
                ..
            }) => Err(syn::Error::new_spanned(
                self.expr,
                format!(
                    "`{}` cannot be negative; allowed: an integer of at least 1",
                    self.what
                ),
            )),
            _ => Err(self.expected("an integer")),
        }
    }

    /// An integer literal that fits in u32.
    pub(super) fn u32(&self) -> syn::Result<u32> {
        let v = self.u64()?;
        u32::try_from(v).map_err(|_| {
            syn::Error::new_spanned(
                self.expr,
                format!(
                    "`{}` = {v} is absurdly large; allowed: at most {}",
                    self.what,
                    u32::MAX
                ),
            )
        })
    }

    /// A float or integer literal, optionally negated.
    pub(super) fn float(&self) -> syn::Result<f64> {
        let (negated, inner) = match self.expr {
            syn::Expr::Unary(syn::ExprUnary {
                op: syn::UnOp::Neg(_),
                expr,
                ..
            }) => (true, &**expr),
            other => (false, other),
        };
        let value = match inner {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Float(f),
                ..
            }) if f.suffix().is_empty() => f.base10_parse::<f64>()?,
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Int(i),
                ..
            }) if i.suffix().is_empty() => i.base10_parse::<u64>()? as f64,
            _ => return Err(self.expected("a number")),
        };
        Ok(if negated { -value } else { value })
    }

    /// `-ln(N)`, N an integer literal: `Some(N)`; `None` for any other expression.
    pub(super) fn neg_ln(&self) -> syn::Result<Option<u64>> {
        let syn::Expr::Unary(syn::ExprUnary {
            op: syn::UnOp::Neg(_),
            expr,
            ..
        }) = self.expr
        else {
            return Ok(None);
        };
        let syn::Expr::Call(call) = &**expr else {
            return Ok(None);
        };
        if ident_of(&call.func).is_none_or(|f| f != "ln") {
            return Ok(None);
        }
        match call.args.iter().collect::<Vec<_>>().as_slice() {
            [n] => Value::new("ln", n).u64().map(Some),
            _ => Err(syn::Error::new_spanned(
                call,
                "ln takes one argument, a sequence length: -ln(4096)",
            )),
        }
    }

    /// A list of numbers, `[a, b, ..]`.
    pub(super) fn floats(&self) -> syn::Result<Vec<f64>> {
        match self.expr {
            syn::Expr::Array(a) => a
                .elems
                .iter()
                .map(|e| Value::new(&self.what, e).float())
                .collect(),
            _ => Err(self.expected("a list of numbers, [a, b, ..]")),
        }
    }

    /// `true` or `false`.
    pub(super) fn boolean(&self) -> syn::Result<bool> {
        match self.expr {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Bool(b),
                ..
            }) => Ok(b.value),
            _ => Err(self.expected("true or false")),
        }
    }

    /// The identifier, if the value is a plain identifier.
    pub(super) fn as_word(&self) -> Option<String> {
        ident_of(self.expr).map(|i| i.to_string())
    }

    /// One of the identifiers in `allowed`.
    pub(super) fn word(&self, allowed: &[&'static str]) -> syn::Result<&'static str> {
        let word = self.as_word();
        allowed
            .iter()
            .copied()
            .find(|a| word.as_deref() == Some(*a))
            .ok_or_else(|| self.expected(&allowed.join(", ")))
    }

    /// `name(args)`, if the value is a call of a plain identifier.
    pub(super) fn as_call(&self) -> Option<(String, Args<'a>)> {
        match self.expr {
            syn::Expr::Call(call) => {
                let name = ident_of(&call.func)?.to_string();
                Some((name, Args::new(call.paren_token.span.join(), &call.args)))
            }
            _ => None,
        }
    }

    /// A closure (custom modifiers).
    pub(super) fn closure(&self) -> syn::Result<&'a syn::ExprClosure> {
        match self.expr {
            syn::Expr::Closure(c) => Ok(c),
            _ => Err(self.expected(match self.what.as_str() {
                "score_mod" => "a closure |score, b, h, q, k| expr",
                _ => "a closure |b, h, q, k| expr",
            })),
        }
    }
}

/// The arguments of a call, e.g. `rope(base = 10000.0, dim = 64)`.
pub(super) struct Args<'a> {
    /// The span of the parentheses.
    pub span: Span,
    args: &'a Punctuated<syn::Expr, syn::Token![,]>,
}

impl<'a> Args<'a> {
    pub(super) fn new(span: Span, args: &'a Punctuated<syn::Expr, syn::Token![,]>) -> Self {
        Args { span, args }
    }

    /// Exactly `N` positional arguments.
    pub(super) fn positional<const N: usize>(&self, form: &str) -> syn::Result<[&'a syn::Expr; N]> {
        let all: Vec<&syn::Expr> = self.args.iter().collect();
        all.try_into().map_err(|all: Vec<&syn::Expr>| {
            syn::Error::new(
                self.span,
                format!("expected {form}, found {} argument(s)", all.len()),
            )
        })
    }

    /// `key = value` arguments, each key from `allowed` and at most once.
    pub(super) fn named(&self, call: &str, allowed: &[&str]) -> syn::Result<Named<'a>> {
        let mut entries: Vec<(String, &'a syn::Expr)> = Vec::new();
        for arg in self.args {
            let syn::Expr::Assign(assign) = arg else {
                return Err(syn::Error::new_spanned(
                    arg,
                    format!(
                        "{call}(...) takes `name = value` arguments; allowed names: {}",
                        allowed.join(", ")
                    ),
                ));
            };
            let Some(key) = ident_of(&assign.left) else {
                return Err(syn::Error::new_spanned(
                    &assign.left,
                    "expected an argument name",
                ));
            };
            let name = key.to_string();
            if !allowed.contains(&name.as_str()) {
                let suggestion = allowed
                    .iter()
                    .map(|a| (strsim::damerau_levenshtein(&name, a), *a))
                    .min()
                    .filter(|(d, a)| *d <= 2.max(a.len() / 3))
                    .map(|(_, a)| format!("did you mean `{a}`? "))
                    .unwrap_or_default();
                return Err(syn::Error::new_spanned(
                    &key,
                    format!(
                        "unknown argument `{name}` of {call}(...); {suggestion}allowed: {}",
                        allowed.join(", ")
                    ),
                ));
            }
            if entries.iter().any(|(n, ..)| *n == name) {
                return Err(syn::Error::new_spanned(
                    &key,
                    format!("duplicate argument `{name}` of {call}(...)"),
                ));
            }
            entries.push((name, &assign.right));
        }
        Ok(Named { entries })
    }
}

/// Named arguments, taken one by one.
pub(super) struct Named<'a> {
    entries: Vec<(String, &'a syn::Expr)>,
}

impl<'a> Named<'a> {
    /// The value of argument `key`, with its tokens, if given.
    pub(super) fn take(&mut self, key: &str) -> Option<(TokenStream, Value<'a>)> {
        let i = self.entries.iter().position(|(n, _)| n == key)?;
        let (name, expr) = self.entries.remove(i);
        Some((expr.to_token_stream(), Value::new(&name, expr)))
    }
}

/// A short description of what an expression is, for "found ..." messages.
fn describe(expr: &syn::Expr) -> String {
    let text = expr.to_token_stream().to_string();
    let text = if text.len() > 40 {
        format!("{}...", &text[..text.floor_char_boundary(37)])
    } else {
        text
    };
    let kind = match expr {
        syn::Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Int(_),
            ..
        }) => "the integer",
        syn::Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Float(_),
            ..
        }) => "the float",
        syn::Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Str(_),
            ..
        }) => "the string",
        syn::Expr::Path(_) => "the name",
        syn::Expr::Call(_) => "the call",
        syn::Expr::Closure(_) => "a closure",
        _ => "the expression",
    };
    format!("{kind} `{text}`")
}
