//! `#[attention(...)]`: declares an attention variant on a struct.
//!
//! **Invariant:** the macro parses its attribute with attn-dsl's one parser
//! ([`attn_dsl::parse_tokens`]) and validates it there, so a spec that compiles is a spec the
//! string parser accepts, and an invalid spec fails the user's build with the error under the
//! offending tokens.

#![forbid(unsafe_code)]

mod aot;
mod emit;
mod targets;

use proc_macro::TokenStream;
use quote::quote;

/// Declares an attention variant:
///
/// ```text
/// #[attention(heads = 8, kv_heads = 2, head_dim = 64, mask = causal)]
/// struct MyAttention;
/// ```
///
/// (`attn::attention`, this macro re-exported, has the same example as a doctest that runs.)
///
/// The spec is validated at compile time; errors point at the offending tokens. The struct
/// implements `attn::Attention`: `SPEC_TEXT` (the normalized spec), the head constants,
/// `LEARNED` (the names and shapes of its learnable tensors), `spec()` (the spec built as data,
/// not parsed again at run time) and `variant()` (validated and planned once per process). A
/// spec with differential heads (`differential = lambda(...)`) implements
/// `attn::DifferentialAttention` instead: the same constants and `spec()`, `VALUE_HEADS`, and
/// `differential()` (its component heads planned once).
///
/// `targets = [sm_80, sm_90]` (with attn's `aot` feature) compiles every GPU kernel of the spec
/// (of its component heads, for differential heads) to PTX for those targets while the crate builds and embeds them (`embedded_kernels()`): the
/// CUDA backend runs them with no compiler in the program.
#[proc_macro_attribute]
pub fn attention(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item = syn::parse_macro_input!(item as syn::ItemStruct);
    let failed = |err: syn::Error| {
        let err = err.to_compile_error();
        quote!(#err #item).into()
    };
    let (attr, targets) = match targets::split(attr.into()) {
        Ok(split) => split,
        Err(err) => return failed(err),
    };
    let spec = match attn_dsl::parse_tokens(attr) {
        Ok(spec) => spec,
        Err(err) => return failed(err),
    };
    // Differential heads run their component heads' kernels (attn::runtime::differential):
    // those are the kernels to embed.
    let kernels_of = match spec.differential {
        Some(_) => spec.differential_components(),
        None => spec.clone(),
    };
    let embedded = match &targets {
        Some(t) => match aot::embed(&kernels_of, &t.names, t.span) {
            Ok(kernels) => kernels,
            Err(err) => return failed(err),
        },
        None => quote!(&[]),
    };
    let text = spec.to_string();
    let data = emit::spec(&spec);
    let (heads, kv_heads, head_dim, v_head_dim) =
        (spec.heads, spec.kv_heads(), spec.head_dim, spec.v_head_dim);
    let dtype = match spec.dtype {
        attn_dsl::DType::F32 => quote!(F32),
        attn_dsl::DType::F16 => quote!(F16),
        attn_dsl::DType::Bf16 => quote!(Bf16),
    };
    let learned = spec
        .learnable_tensors()
        .into_iter()
        .map(|(name, shape)| quote!((#name, &[#(#shape),*])));
    let consts = quote! {
        const SPEC_TEXT: &'static str = #text;
        const HEADS: u32 = #heads;
        const KV_HEADS: u32 = #kv_heads;
        const HEAD_DIM: u32 = #head_dim;
        const V_HEAD_DIM: u32 = #v_head_dim;
        const DTYPE: ::attn::DType = ::attn::DType::#dtype;
        const LEARNED: &'static [(&'static str, &'static [usize])] = &[#(#learned),*];

        fn spec() -> &'static ::attn::AttentionSpec {
            static SPEC: ::std::sync::OnceLock<::attn::AttentionSpec> =
                ::std::sync::OnceLock::new();
            SPEC.get_or_init(|| #data)
        }

        fn embedded_kernels() -> &'static [::attn::runtime::gpu::ptx::EmbeddedKernel] {
            #embedded
        }
    };
    let name = &item.ident;
    let (impl_generics, ty_generics, where_clause) = item.generics.split_for_impl();
    let doc = format!("Attention variant `{text}`.");
    let implementation = match spec.differential {
        Some(_) => {
            let value_heads = spec.value_heads();
            quote! {
                impl #impl_generics ::attn::DifferentialAttention for #name #ty_generics
                    #where_clause
                {
                    #consts
                    const VALUE_HEADS: u32 = #value_heads;

                    fn differential() -> &'static ::attn::runtime::differential::Differential {
                        static DIFFERENTIAL: ::std::sync::OnceLock<
                            ::attn::runtime::differential::Differential,
                        > = ::std::sync::OnceLock::new();
                        DIFFERENTIAL.get_or_init(|| {
                            ::attn::runtime::gpu::ptx::register_embedded(Self::embedded_kernels());
                            ::attn::runtime::differential::Differential::new(Self::spec().clone())
                                .expect("#[attention] validated this spec at compile time")
                        })
                    }
                }
            }
        }
        None => quote! {
            impl #impl_generics ::attn::Attention for #name #ty_generics #where_clause {
                #consts

                fn variant() -> &'static ::std::sync::Arc<::attn::runtime::Variant> {
                    static VARIANT: ::std::sync::OnceLock<
                        ::std::sync::Arc<::attn::runtime::Variant>,
                    > = ::std::sync::OnceLock::new();
                    VARIANT.get_or_init(|| {
                        ::attn::runtime::gpu::ptx::register_embedded(Self::embedded_kernels());
                        ::attn::runtime::Variant::new(Self::spec().clone())
                            .expect("#[attention] validated this spec at compile time")
                    })
                }
            }
        },
    };
    quote! {
        #item

        #[doc = #doc]
        #implementation
    }
    .into()
}
