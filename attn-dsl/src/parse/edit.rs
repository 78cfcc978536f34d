//! Editing a spec's text one item at a time: what `attnc sweep` varies.

use super::KEYS;
use crate::error::SpecErrors;
use proc_macro2::TokenStream;
use quote::ToTokens;

/// The keys a `key = value` item can set: every top-level key but the items `mla(...)` and
/// `params(...)`.
pub fn settable_keys() -> impl Iterator<Item = &'static str> {
    KEYS.iter()
        .copied()
        .filter(|k| !super::CALL_ITEMS.contains(k))
}

/// The spec `source` with its item `key = ...` replaced by `key = value`, or with that item
/// added at the end when `source` sets no `key`. The other items are kept as written, so their
/// defaults (a `v_head_dim` that follows `head_dim`, say) still follow the edit. `source` must
/// be a list of items, but need not be a valid spec (one edit of several may leave it invalid
/// until the next); an unknown `key` is an error naming the allowed ones. The result is not
/// checked: parse it.
pub fn set_key(source: &str, key: &str, value: &str) -> Result<String, SpecErrors> {
    if !settable_keys().any(|k| k == key) {
        return Err(SpecErrors::from_syn(syn::Error::new(
            proc_macro2::Span::call_site(),
            format!(
                "`{key}` is not a spec key; allowed: {}",
                settable_keys().collect::<Vec<_>>().join(", ")
            ),
        )));
    }
    let tokens: TokenStream = source.parse().map_err(|e: proc_macro2::LexError| {
        SpecErrors::from_syn(syn::Error::new(
            e.span(),
            format!("cannot tokenize the spec: {e}"),
        ))
    })?;
    super::limits::check(&tokens).map_err(SpecErrors::from_syn)?;
    let items = super::params::split_items(tokens).map_err(SpecErrors::from_syn)?;
    let mut kept: Vec<String> = items
        .params
        .iter()
        .map(ToString::to_string)
        .chain(
            items
                .rest
                .iter()
                .filter(|item| !sets(item, key))
                .map(|item| item.to_token_stream().to_string()),
        )
        .collect();
    kept.push(format!("{key} = {value}"));
    Ok(kept.join(", "))
}

/// Whether `item` is `key = ...`.
fn sets(item: &syn::Expr, key: &str) -> bool {
    matches!(item, syn::Expr::Assign(a) if super::values::ident_of(&a.left).is_some_and(|i| i == key))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(text: &str) -> crate::AttentionSpec {
        crate::parse_str(text).unwrap()
    }

    #[test]
    fn replaces_an_item_and_keeps_the_others() {
        let base = "heads = 4, kv_heads = 4, head_dim = 16, mask = causal, position = rope";
        let edited = set_key(base, "kv_heads", "2").unwrap();
        let want = "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, position = rope";
        assert_eq!(spec(&edited), spec(want));
        let edited = set_key(base, "mask", "sliding_window(64)").unwrap();
        assert_eq!(
            spec(&edited),
            spec(
                "heads = 4, kv_heads = 4, head_dim = 16, mask = sliding_window(64), position = rope"
            )
        );
    }

    #[test]
    fn adds_a_missing_item_and_defaults_follow_the_edit() {
        let edited = set_key("heads = 2, head_dim = 8", "head_dim", "16").unwrap();
        assert_eq!(spec(&edited).v_head_dim, 16);
        let edited = set_key("heads = 2, head_dim = 8", "softcap", "30.0").unwrap();
        assert_eq!(
            spec(&edited),
            spec("heads = 2, head_dim = 8, softcap = 30.0")
        );
    }

    #[test]
    fn keeps_closures_whose_parameters_hold_commas() {
        let base = "heads = 2, head_dim = 8, score_mod = |s, b, h, q, k| s * 0.5";
        let edited = set_key(base, "heads", "4").unwrap();
        assert_eq!(
            spec(&edited),
            spec("heads = 4, head_dim = 8, score_mod = |s, b, h, q, k| s * 0.5")
        );
    }

    #[test]
    fn refuses_unknown_keys_and_bad_sources() {
        let e = set_key("heads = 2, head_dim = 8", "layers", "2").unwrap_err();
        assert!(e.to_string().contains("allowed: heads, kv_heads"), "{e}");
        assert!(set_key("heads = 2, head_dim = 8", "mla", "1").is_err());
        assert!(set_key("heads = 2,, head_dim", "heads", "4").is_err());
        // An invalid spec is edited all the same: the next edit may make it valid.
        let edited = set_key("heads = 2, kv_heads = 4, head_dim = 8", "heads", "8").unwrap();
        assert_eq!(spec(&edited).heads, 8);
    }
}
