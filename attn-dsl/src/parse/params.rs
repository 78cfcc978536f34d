//! `params(NAME: [DIM, ..], ..)` and reads `NAME[i, j]`: the two forms syn cannot parse as
//! Rust expressions. The spec's tokens are split into its `params(...)` items, read here, and
//! the rest, in which every `IDENT[a, b, ..]` is rewritten to `IDENT[(a, b, ..)]` (a tuple
//! index, which the modifier lowering unpacks). Rewritten tokens keep their spans.

use crate::spec::{ParamDecl, ParamDim};
use proc_macro2::{Delimiter, Group, TokenStream, TokenTree};
use quote::ToTokens;
use syn::parse::{ParseStream, Parser};
use syn::punctuated::Punctuated;

/// A spec's items: the `params(...)` ones, and the rest as Rust expressions.
pub(super) struct SpecItems {
    /// Each `params(...)` item's tokens.
    pub params: Vec<TokenStream>,
    /// Every other item.
    pub rest: Punctuated<syn::Expr, syn::Token![,]>,
}

/// Splits `tokens` into its `params(...)` items and the other items, parsed.
pub(super) fn split_items(tokens: TokenStream) -> syn::Result<SpecItems> {
    let mut params = Vec::new();
    let mut rest = TokenStream::new();
    let mut chunk: Vec<TokenTree> = Vec::new();
    let mut flush = |chunk: &mut Vec<TokenTree>, comma: Option<TokenTree>| {
        if is_params_item(chunk) {
            params.push(chunk.drain(..).collect());
        } else {
            rest.extend(chunk.drain(..));
            rest.extend(comma);
        }
    };
    for tree in tokens {
        match &tree {
            TokenTree::Punct(p) if p.as_char() == ',' => flush(&mut chunk, Some(tree)),
            _ => chunk.push(tree),
        }
    }
    flush(&mut chunk, None);
    let rest = Punctuated::parse_terminated.parse2(bracket_tuples(rest))?;
    Ok(SpecItems { params, rest })
}

/// Whether a top-level chunk between commas is exactly `params ( ... )`. (A closure's
/// parameter list also has top-level commas, but no chunk of one is an identifier followed by
/// a parenthesized group.)
fn is_params_item(chunk: &[TokenTree]) -> bool {
    matches!(chunk, [TokenTree::Ident(i), TokenTree::Group(g)]
        if i == "params" && g.delimiter() == Delimiter::Parenthesis)
}

/// `IDENT[a, b]` as `IDENT[(a, b)]`, at every depth.
fn bracket_tuples(tokens: TokenStream) -> TokenStream {
    let mut out: Vec<TokenTree> = Vec::new();
    for tree in tokens {
        let tree = match tree {
            TokenTree::Group(g) => {
                let inner = bracket_tuples(g.stream());
                let after_ident = matches!(out.last(), Some(TokenTree::Ident(_)));
                let wrap = g.delimiter() == Delimiter::Bracket
                    && after_ident
                    && has_top_level_comma(&inner);
                let stream = if wrap {
                    let mut tuple = Group::new(Delimiter::Parenthesis, inner);
                    tuple.set_span(g.span());
                    TokenStream::from(TokenTree::Group(tuple))
                } else {
                    inner
                };
                let mut rebuilt = Group::new(g.delimiter(), stream);
                rebuilt.set_span(g.span());
                TokenTree::Group(rebuilt)
            }
            other => other,
        };
        out.push(tree);
    }
    out.into_iter().collect()
}

fn has_top_level_comma(tokens: &TokenStream) -> bool {
    tokens
        .clone()
        .into_iter()
        .any(|t| matches!(t, TokenTree::Punct(p) if p.as_char() == ','))
}

/// The declarations of one `params(...)` item, each with the span of its tokens.
pub(super) fn declarations(item: &TokenStream) -> syn::Result<Vec<(ParamDecl, TokenStream)>> {
    let group = match item.clone().into_iter().nth(1) {
        Some(TokenTree::Group(g)) => g,
        _ => unreachable!("split_items keeps only `params ( .. )` items"),
    };
    let parse = |input: ParseStream| -> syn::Result<Vec<(ParamDecl, TokenStream)>> {
        let mut decls = Vec::new();
        while !input.is_empty() {
            let name: syn::Ident = input.parse().map_err(|e| {
                syn::Error::new(
                    e.span(),
                    "expected a parameter name: params(NAME: [DIM, ..])",
                )
            })?;
            let colon: syn::Token![:] = input.parse().map_err(|e| {
                syn::Error::new(
                    e.span(),
                    format!("expected `:` and the shape after `{name}`: {name}: [DIM, ..]"),
                )
            })?;
            let content;
            let bracket = syn::bracketed!(content in input);
            let dims = Punctuated::<syn::Expr, syn::Token![,]>::parse_terminated(&content)?;
            let mut tokens = name.to_token_stream();
            colon.to_tokens(&mut tokens);
            let mut shape = TokenStream::new();
            bracket.surround(&mut shape, |t| dims.to_tokens(t));
            tokens.extend(shape);
            let dims = dims
                .iter()
                .map(dimension)
                .collect::<syn::Result<Vec<_>>>()?;
            decls.push((
                ParamDecl {
                    name: name.to_string(),
                    dims,
                },
                tokens,
            ));
            if input.is_empty() {
                break;
            }
            input.parse::<syn::Token![,]>()?;
        }
        Ok(decls)
    };
    let decls = parse.parse2(group.stream())?;
    if decls.is_empty() {
        return Err(syn::Error::new(
            group.span(),
            "params(...) declares nothing; write params(NAME: [DIM, ..], ..)",
        ));
    }
    Ok(decls)
}

/// One dimension: an integer literal, `heads` or `kv_heads`.
fn dimension(e: &syn::Expr) -> syn::Result<ParamDim> {
    const ALLOWED: &str = "allowed: an integer, `heads` or `kv_heads`";
    match e {
        syn::Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Int(i),
            ..
        }) if i.suffix().is_empty() => i.base10_parse::<u32>().map(ParamDim::Fixed).map_err(|_| {
            syn::Error::new_spanned(
                i,
                format!("dimension {i} is too large; allowed: at most {}", u32::MAX),
            )
        }),
        syn::Expr::Path(p) if p.path.is_ident("heads") => Ok(ParamDim::Heads),
        syn::Expr::Path(p) if p.path.is_ident("kv_heads") => Ok(ParamDim::KvHeads),
        other => Err(syn::Error::new_spanned(
            other,
            format!("not a dimension; {ALLOWED}"),
        )),
    }
}
