//! `params(NAME: [DIM, ..], ..)`, `data(NAME: [DIM, ..] TYPE, ..)` and reads `NAME[i, j]`: the
//! forms syn cannot parse as Rust expressions. The spec's tokens are split into its
//! `params(...)` and `data(...)` items, read here, and the rest, in which every
//! `IDENT[a, b, ..]` is rewritten to `IDENT[(a, b, ..)]` (a tuple index, which the modifier
//! lowering unpacks). Rewritten tokens keep their spans.

use crate::spec::{DataDecl, DataDim, DataType, ParamDecl, ParamDim, ParamInit};
use proc_macro2::{Delimiter, Group, TokenStream, TokenTree};
use quote::ToTokens;
use syn::parse::{ParseStream, Parser};
use syn::punctuated::Punctuated;

/// A spec's items: the `params(...)` and `data(...)` ones, and the rest as Rust expressions.
pub(super) struct SpecItems {
    /// Each `params(...)` item's tokens.
    pub params: Vec<TokenStream>,
    /// Each `data(...)` item's tokens.
    pub data: Vec<TokenStream>,
    /// Every other item.
    pub rest: Punctuated<syn::Expr, syn::Token![,]>,
}

/// Splits `tokens` into its `params(...)` and `data(...)` items and the other items, parsed.
pub(super) fn split_items(tokens: TokenStream) -> syn::Result<SpecItems> {
    let mut params = Vec::new();
    let mut data = Vec::new();
    let mut rest = TokenStream::new();
    let mut chunk: Vec<TokenTree> = Vec::new();
    let mut flush = |chunk: &mut Vec<TokenTree>, comma: Option<TokenTree>| {
        if is_declaration_item(chunk, "params") {
            params.push(chunk.drain(..).collect());
        } else if is_declaration_item(chunk, "data") {
            data.push(chunk.drain(..).collect());
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
    let rest = Punctuated::parse_terminated.parse2(bracket_tuples(brace_let_bodies(rest)))?;
    Ok(SpecItems { params, data, rest })
}

/// Whether a top-level chunk between commas is exactly `KEYWORD ( ... )`. (A closure's
/// parameter list also has top-level commas, but no chunk of one is an identifier followed by
/// a parenthesized group.)
fn is_declaration_item(chunk: &[TokenTree], keyword: &str) -> bool {
    matches!(chunk, [TokenTree::Ident(i), TokenTree::Group(g)]
        if i == keyword && g.delimiter() == Delimiter::Parenthesis)
}

/// A closure body that starts with `let` and runs to the item's end, `|..| let d = ..; expr`,
/// as the block `|..| { let d = ..; expr }` Rust would need. (Closures stand at the top level
/// of the items; `| let` occurs nowhere else in an expression.)
fn brace_let_bodies(tokens: TokenStream) -> TokenStream {
    let mut out: Vec<TokenTree> = Vec::new();
    let mut trees = tokens.into_iter().peekable();
    while let Some(tree) = trees.next() {
        let bar = matches!(&tree, TokenTree::Punct(p) if p.as_char() == '|');
        out.push(tree);
        let starts_let = matches!(trees.peek(), Some(TokenTree::Ident(i)) if i == "let");
        if bar && starts_let {
            let mut body = Vec::new();
            while let Some(t) =
                trees.next_if(|t| !matches!(t, TokenTree::Punct(p) if p.as_char() == ','))
            {
                body.push(t);
            }
            let span = body[0].span();
            let mut block = Group::new(Delimiter::Brace, body.into_iter().collect());
            block.set_span(span);
            out.push(TokenTree::Group(block));
        }
    }
    out.into_iter().collect()
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

/// One declaration as written: its name, dimensions, element type (in `data(...)`) and tokens.
struct Written {
    name: syn::Ident,
    dims: Vec<syn::Expr>,
    ty: Option<syn::Ident>,
    /// `= INIT` after a parameter's shape.
    init: Option<syn::Expr>,
    tokens: TokenStream,
}

/// The declarations of one `params(...)` (`typed` false) or `data(...)` item.
fn written(item: &TokenStream, typed: bool) -> syn::Result<Vec<Written>> {
    let (keyword, form) = if typed {
        ("data", "data(NAME: [DIM, ..] TYPE, ..)")
    } else {
        ("params", "params(NAME: [DIM, ..] = INIT, ..)")
    };
    let group = match item.clone().into_iter().nth(1) {
        Some(TokenTree::Group(g)) => g,
        _ => unreachable!("split_items keeps only `{keyword} ( .. )` items"),
    };
    let parse = |input: ParseStream| -> syn::Result<Vec<Written>> {
        let mut decls = Vec::new();
        while !input.is_empty() {
            let name: syn::Ident = input.parse().map_err(|e| {
                syn::Error::new(e.span(), format!("expected a tensor name: {form}"))
            })?;
            let colon: syn::Token![:] = input.parse().map_err(|e| {
                syn::Error::new(
                    e.span(),
                    format!("expected `:` and the shape after `{name}`: {form}"),
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
            let ty = if typed {
                let ty: syn::Ident = input.parse().map_err(|_| {
                    syn::Error::new_spanned(
                        &tokens,
                        format!(
                            "expected the element type of `{name}` after its shape: i32 or f32"
                        ),
                    )
                })?;
                ty.to_tokens(&mut tokens);
                Some(ty)
            } else {
                None
            };
            let init = if !typed && input.peek(syn::Token![=]) {
                input.parse::<syn::Token![=]>()?;
                Some(input.parse::<syn::Expr>()?)
            } else {
                None
            };
            decls.push(Written {
                name,
                dims: dims.into_iter().collect(),
                ty,
                init,
                tokens,
            });
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
            format!("{keyword}(...) declares nothing; write {form}"),
        ));
    }
    Ok(decls)
}

/// The declarations of one `params(...)` item, each with the span of its tokens, and the first
/// error in an initial value (its declaration is kept, starting at 0, so that reads of it do
/// not add errors of their own).
pub(super) fn declarations(
    item: &TokenStream,
) -> syn::Result<(Declared<ParamDecl>, Option<syn::Error>)> {
    let mut first_error = None;
    let mut decls = Vec::new();
    for w in written(item, false)? {
        let dims = w
            .dims
            .iter()
            .map(|e| {
                dimension(e, false).map(|d| match d {
                    DataDim::Fixed(n) => ParamDim::Fixed(n),
                    DataDim::Heads => ParamDim::Heads,
                    _ => ParamDim::KvHeads,
                })
            })
            .collect::<syn::Result<Vec<_>>>()?;
        let mut decl = ParamDecl {
            name: w.name.to_string(),
            dims,
            init: ParamInit::default(),
        };
        if let Some(e) = &w.init {
            let init = initial_value(e).and_then(|init| {
                let checked = ParamDecl {
                    init,
                    ..decl.clone()
                };
                match init.problem(&checked) {
                    Some(problem) => Err(syn::Error::new_spanned(e, problem)),
                    None => Ok(init),
                }
            });
            match init {
                Ok(init) => decl.init = init,
                Err(err) => {
                    first_error.get_or_insert(err);
                }
            }
        }
        decls.push((decl, w.tokens));
    }
    Ok((decls, first_error))
}

/// A parameter's `= INIT`: a number, `normal(STD)`, `uniform(LOW, HIGH)` or `alibi`.
fn initial_value(e: &syn::Expr) -> syn::Result<ParamInit> {
    const ALLOWED: &str = "allowed: a number, normal(STD), uniform(LOW, HIGH) or alibi";
    let number = |e: &syn::Expr| -> syn::Result<f64> {
        let (negative, lit) = match e {
            syn::Expr::Unary(u) if matches!(u.op, syn::UnOp::Neg(_)) => (true, &*u.expr),
            other => (false, other),
        };
        let value = match lit {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Float(f),
                ..
            }) => f.base10_parse()?,
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Int(i),
                ..
            }) => i.base10_parse::<f64>()?,
            other => {
                return Err(syn::Error::new_spanned(other, "expected a number here"));
            }
        };
        Ok(if negative { -value } else { value })
    };
    match e {
        syn::Expr::Path(p) if p.path.is_ident("alibi") => Ok(ParamInit::Alibi),
        syn::Expr::Call(call) => {
            let name = match &*call.func {
                syn::Expr::Path(p) => p.path.get_ident().map(ToString::to_string),
                _ => None,
            };
            let args: Vec<&syn::Expr> = call.args.iter().collect();
            match (name.as_deref(), args.as_slice()) {
                (Some("normal"), [std]) => Ok(ParamInit::Normal(number(std)?)),
                (Some("uniform"), [low, high]) => {
                    Ok(ParamInit::Uniform(number(low)?, number(high)?))
                }
                (Some("normal"), _) => Err(syn::Error::new_spanned(
                    call,
                    "normal takes one argument, the standard deviation: normal(0.02)",
                )),
                (Some("uniform"), _) => Err(syn::Error::new_spanned(
                    call,
                    "uniform takes two arguments, the bounds: uniform(-0.1, 0.1)",
                )),
                _ => Err(syn::Error::new_spanned(
                    &call.func,
                    format!("unknown initial value; {ALLOWED}"),
                )),
            }
        }
        other => number(other).map(ParamInit::Constant).map_err(|_| {
            syn::Error::new_spanned(other, format!("unknown initial value; {ALLOWED}"))
        }),
    }
}

/// Declarations, each with its tokens.
pub(super) type Declared<T> = Vec<(T, TokenStream)>;

/// The declarations of one `data(...)` item, each with the span of its tokens, and the first
/// error in a dimension or type. A declaration with such an error is still returned (the
/// dimension as `seq`, the type as i32), so that reads of it do not add errors of their own.
pub(super) fn data_declarations(
    item: &TokenStream,
) -> syn::Result<(Declared<DataDecl>, Option<syn::Error>)> {
    let mut first_error = None;
    let mut keep = |e: syn::Error| {
        first_error.get_or_insert(e);
    };
    let mut decls = Vec::new();
    for w in written(item, true)? {
        let dims = w
            .dims
            .iter()
            .map(|e| {
                dimension(e, true).unwrap_or_else(|err| {
                    keep(err);
                    DataDim::Seq
                })
            })
            .collect();
        let ty = w.ty.expect("typed declarations carry a type");
        let dtype = match ty.to_string().as_str() {
            "i32" => DataType::I32,
            "f32" => DataType::F32,
            other => {
                keep(syn::Error::new_spanned(
                    &ty,
                    format!("`{other}` is not a data type; allowed: i32 or f32"),
                ));
                DataType::I32
            }
        };
        let name = w.name.to_string();
        decls.push((DataDecl { name, dims, dtype }, w.tokens));
    }
    Ok((decls, first_error))
}

/// One dimension: an integer literal, `heads` or `kv_heads`, and in `data(...)` (`call`)
/// also `batch` and `seq`.
fn dimension(e: &syn::Expr, call: bool) -> syn::Result<DataDim> {
    let allowed = if call {
        "allowed: an integer, `heads`, `kv_heads`, `batch` or `seq`"
    } else {
        "allowed: an integer, `heads` or `kv_heads`"
    };
    match e {
        syn::Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Int(i),
            ..
        }) if i.suffix().is_empty() => i.base10_parse::<u32>().map(DataDim::Fixed).map_err(|_| {
            syn::Error::new_spanned(
                i,
                format!("dimension {i} is too large; allowed: at most {}", u32::MAX),
            )
        }),
        syn::Expr::Path(p) if p.path.is_ident("heads") => Ok(DataDim::Heads),
        syn::Expr::Path(p) if p.path.is_ident("kv_heads") => Ok(DataDim::KvHeads),
        syn::Expr::Path(p) if call && p.path.is_ident("batch") => Ok(DataDim::Batch),
        syn::Expr::Path(p) if call && p.path.is_ident("seq") => Ok(DataDim::Seq),
        other => Err(syn::Error::new_spanned(
            other,
            format!("not a dimension; {allowed}"),
        )),
    }
}
