//! `#[attention(...)]`: declares an attention variant on a struct.
//!
//! **Invariant:** the macro parses its attribute with attn-dsl's one parser ([`attn_dsl::parse_tokens`])
//! and validates it there, so a spec that compiles is a spec the string parser accepts, and an
//! invalid spec fails the user's build with the error under the offending tokens.

use proc_macro::TokenStream;
use quote::quote;

/// Declares an attention variant: `#[attention(heads = 8, kv_heads = 2, head_dim = 64,
/// mask = causal)] struct MyAttention;`.
///
/// The spec is validated at compile time. The struct gains `SPEC_TEXT` (the normalized spec in
/// the spec language) and `spec()` (the parsed [`AttentionSpec`](attn_dsl::AttentionSpec)).
#[proc_macro_attribute]
pub fn attention(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item = syn::parse_macro_input!(item as syn::ItemStruct);
    let spec = match attn_dsl::parse_tokens(attr.into()) {
        Ok(spec) => spec,
        Err(err) => {
            let err = err.to_compile_error();
            return quote!(#err #item).into();
        }
    };
    let text = spec.to_string();
    let name = &item.ident;
    let (impl_generics, ty_generics, where_clause) = item.generics.split_for_impl();
    quote! {
        #item

        impl #impl_generics #name #ty_generics #where_clause {
            /// The attention spec of this variant, normalized, in the spec language.
            pub const SPEC_TEXT: &'static str = #text;

            /// The attention spec of this variant (validated when the crate was compiled).
            pub fn spec() -> ::attn::AttentionSpec {
                ::attn::dsl::parse_str(Self::SPEC_TEXT)
                    .expect("the spec was validated by #[attention] at compile time")
            }
        }
    }
    .into()
}
