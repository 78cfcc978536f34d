//! Kernels compiled at cargo time (feature `aot`): every GPU kernel of the spec for each target
//! (`codegen::gpu::artifacts::spec_kernels_for`: for sm_90a also the warp-specialized
//! forward) through LLVM to PTX, embedded as
//! `attn::runtime::gpu::ptx::EmbeddedKernel` records with their launch records.

use proc_macro2::{Span, TokenStream};

/// The embedded kernels of `spec` for `targets`, as an expression of type
/// `&'static [::attn::runtime::gpu::ptx::EmbeddedKernel]`.
#[cfg(feature = "aot")]
pub fn embed(
    spec: &attn_dsl::AttentionSpec,
    targets: &[String],
    span: Span,
) -> syn::Result<TokenStream> {
    use codegen::gpu::artifacts::{launch_json, spec_kernels_for};
    use codegen::gpu::ir::target::{Arch, kernel_hash};
    use quote::quote;
    let fail = |what: String| syn::Error::new(span, what);
    let mut records = Vec::new();
    for target in targets {
        let arch = Arch::from_name(target).expect("targets are checked when parsed");
        let kernels = spec_kernels_for(spec, arch)
            .map_err(|e| fail(format!("cannot lower the spec's kernels: {e}")))?;
        for k in &kernels {
            let ptx = codegen::gpu::llvm::emit(&k.kernel, arch)
                .map_err(|e| fail(format!("cannot compile {} for {target}: {e}", k.role)))?
                .ptx;
            let (role, name, hash, launch) = (
                k.role,
                k.kernel.name.as_str(),
                kernel_hash(&k.kernel),
                launch_json(&k.kernel),
            );
            records.push(quote! {
                ::attn::runtime::gpu::ptx::EmbeddedKernel {
                    role: #role,
                    name: #name,
                    hash: #hash,
                    target: #target,
                    ptx: #ptx,
                    launch: #launch,
                }
            });
        }
    }
    Ok(quote!(&[#(#records),*]))
}

/// Without the `aot` feature a targets list cannot be honoured: an error at it.
#[cfg(not(feature = "aot"))]
pub fn embed(_: &attn_dsl::AttentionSpec, _: &[String], span: Span) -> syn::Result<TokenStream> {
    Err(syn::Error::new(
        span,
        "`targets` compiles GPU kernels at cargo time, which needs the `aot` feature of attn \
         (and LLVM 19 where the crate builds); without it, leave `targets` out and kernels are \
         compiled at run time (feature `llvm`)",
    ))
}
