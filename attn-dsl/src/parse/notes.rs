//! The backward pass's notes on a spec string's score modifier, placed at its tokens.

use super::{limits, params};
use crate::error::SpecError;
use crate::modifier::Readable;
use crate::spec::{DataDecl, ParamDecl};
use proc_macro2::TokenStream;

/// The backward pass's notes on a spec string's `score_mod`: where its derivative with respect
/// to the score is only piecewise (`abs`, `min`, `max`, a condition on the score) or zero
/// almost everywhere (the score made an integer), each at the tokens it is about (render them
/// with [`SpecError::render_as`] and the label `note`). Empty for a spec without a score
/// modifier, and for one that does not parse ([`super::parse_str`] says why).
pub fn gradient_notes(source: &str) -> Vec<SpecError> {
    let Ok(tokens) = source.parse::<TokenStream>() else {
        return Vec::new();
    };
    if limits::check(&tokens).is_err() {
        return Vec::new();
    }
    let Ok(items) = params::split_items(tokens) else {
        return Vec::new();
    };
    let declared: Vec<ParamDecl> = items
        .params
        .iter()
        .filter_map(|item| params::declarations(item).ok())
        .flat_map(|(decls, _)| decls)
        .map(|(decl, _)| decl)
        .collect();
    let data: Vec<DataDecl> = items
        .data
        .iter()
        .filter_map(|item| params::data_declarations(item).ok())
        .flat_map(|(decls, _)| decls)
        .map(|(decl, _)| decl)
        .collect();
    let closure = items.rest.iter().find_map(|item| match item {
        syn::Expr::Assign(a) => match (&*a.left, &*a.right) {
            (syn::Expr::Path(p), syn::Expr::Closure(c)) if p.path.is_ident("score_mod") => Some(c),
            _ => None,
        },
        _ => None,
    });
    closure.map_or_else(Vec::new, |c| {
        let readable = Readable {
            params: &declared,
            data: &data,
        };
        crate::modifier::score_mod_notes(c, readable)
            .into_iter()
            .map(|(note, span)| SpecError::at(format!("backward: {note}"), span))
            .collect()
    })
}
