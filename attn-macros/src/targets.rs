//! `targets = [sm_80, sm_90]` in `#[attention(...)]`: the GPU targets whose kernels the macro
//! compiles at cargo time (feature `aot`). Not part of the spec: the item is taken out of the
//! attribute's tokens before the spec parser sees them (the other items' tokens pass on
//! untouched, so their errors keep their spans) and checked here, with errors at its tokens.
//! The scan is flat, over top-level tokens only, so no input can make it recurse.

use proc_macro2::{Delimiter, Span, TokenStream, TokenTree};

/// Target names the macro compiles for.
pub const TARGETS: [&str; 3] = ["sm_80", "sm_90", "sm_90a"];

/// A `targets` list: the names, and the span of the item (for errors about it as a whole).
pub struct Targets {
    pub names: Vec<String>,
    pub span: Span,
}

/// The attribute without its `targets = [...]` item, and that item's targets.
pub fn split(attr: TokenStream) -> syn::Result<(TokenStream, Option<Targets>)> {
    let mut rest: Vec<TokenTree> = Vec::new();
    let mut targets: Option<Targets> = None;
    let mut item: Vec<TokenTree> = Vec::new();
    let mut tokens = attr.into_iter().peekable();
    loop {
        let next = tokens.next();
        let end = match &next {
            None => true,
            Some(TokenTree::Punct(p)) => p.as_char() == ',',
            Some(_) => false,
        };
        if !end {
            item.extend(next);
            continue;
        }
        if is_targets(&item) {
            if targets.is_some() {
                return Err(syn::Error::new(item[0].span(), "`targets` is given twice"));
            }
            targets = Some(Targets {
                names: names(&item)?,
                span: item[0].span(),
            });
        } else {
            rest.append(&mut item);
            rest.extend(next.clone());
        }
        item.clear();
        if next.is_none() {
            break;
        }
    }
    Ok((rest.into_iter().collect(), targets))
}

/// Whether an item is `targets = ...`.
fn is_targets(item: &[TokenTree]) -> bool {
    matches!(
        item,
        [TokenTree::Ident(i), TokenTree::Punct(eq), ..] if i == "targets" && eq.as_char() == '='
    )
}

/// The names of `targets = [sm_80, sm_90]`, each known and given once.
fn names(item: &[TokenTree]) -> syn::Result<Vec<String>> {
    let allowed = TARGETS.join(", ");
    let list = match &item[2..] {
        [TokenTree::Group(g)] if g.delimiter() == Delimiter::Bracket => g,
        other => {
            let span = other.first().map_or(item[1].span(), TokenTree::span);
            return Err(syn::Error::new(
                span,
                format!(
                    "`targets` takes a list of GPU targets, such as `[sm_90]`; allowed: {allowed}"
                ),
            ));
        }
    };
    let mut out: Vec<String> = Vec::new();
    let mut expect_name = true;
    for t in list.stream() {
        match (&t, expect_name) {
            (TokenTree::Ident(i), true) => {
                let name = i.to_string();
                if !TARGETS.contains(&name.as_str()) {
                    return Err(syn::Error::new(
                        i.span(),
                        format!("unknown GPU target `{name}`; allowed: {allowed}"),
                    ));
                }
                if out.contains(&name) {
                    return Err(syn::Error::new(
                        i.span(),
                        format!("target `{name}` is listed twice"),
                    ));
                }
                out.push(name);
                expect_name = false;
            }
            (TokenTree::Punct(p), false) if p.as_char() == ',' => expect_name = true,
            _ => {
                return Err(syn::Error::new(
                    t.span(),
                    format!("expected a GPU target name here; allowed: {allowed}"),
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(text: &str) -> Result<(String, Option<Vec<String>>), String> {
        let tokens: TokenStream = text.parse().map_err(|e| format!("{e:?}"))?;
        split(tokens)
            .map(|(rest, t)| (rest.to_string(), t.map(|t| t.names)))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_targets_item_is_taken_out_wherever_it_is() {
        for text in [
            "targets = [sm_80, sm_90], heads = 4, head_dim = 64",
            "heads = 4, targets = [sm_80, sm_90,], head_dim = 64",
            "heads = 4, head_dim = 64, targets = [sm_80, sm_90]",
        ] {
            let (rest, names) = run(text).unwrap();
            assert_eq!(
                rest.replace(' ', "").trim_end_matches(','),
                "heads=4,head_dim=64"
            );
            assert_eq!(names.unwrap(), ["sm_80", "sm_90"]);
        }
        assert_eq!(run("heads = 4, head_dim = 64").unwrap().1, None);
        assert_eq!(run("targets = [], heads = 4").unwrap().1.unwrap().len(), 0);
    }

    #[test]
    fn bad_lists_are_errors_never_panics() {
        let deep = format!("targets = {}sm_90{}", "[".repeat(5000), "]".repeat(5000));
        for (text, said) in [
            ("targets = [sm_75]", "unknown GPU target `sm_75`"),
            ("targets = [sm_90, sm_90]", "listed twice"),
            ("targets = sm_90", "takes a list"),
            ("targets = [sm_90], targets = [sm_80]", "given twice"),
            ("targets = [sm_90 sm_80]", "expected a GPU target name"),
            ("targets = [(sm_90)]", "expected a GPU target name"),
            ("targets =", "takes a list"),
            (deep.as_str(), "expected a GPU target name"),
        ] {
            let err = run(text).expect_err(text);
            assert!(err.contains(said), "{text}: {err}");
        }
    }
}
