//! A validated spec as Rust code that builds the same value: the macro embeds the spec as data,
//! so the user's program never parses spec text again.
//!
//! Floats are emitted by their bits (exact). Modifier expressions become a flat list of `let`
//! bindings in post order, so a deep expression is not a deeply nested Rust expression.

use attn_dsl::modifier::{BinOp, Expr, Ty, UnOp, Var};
use attn_dsl::{
    AttentionSpec, CausalAlign, DType, DataDim, DataType, KvLayout, Mask, Normalize, ParamDim,
    ParamInit, Position, Rope, RopeLayout, RopeScaling, SigmoidBias, Sinks,
};
use proc_macro2::TokenStream;
use quote::{format_ident, quote};

/// An expression of type `::attn::AttentionSpec` equal to `spec`.
pub fn spec(spec: &AttentionSpec) -> TokenStream {
    let AttentionSpec {
        heads,
        kv,
        head_dim,
        v_head_dim,
        mask,
        position,
        softcap,
        scale,
        dtype,
        score_mod,
        mask_mod,
        params,
        data,
        sinks,
        normalize,
        differential,
    } = spec;
    let (kv, mask, position) = (kv_layout(kv), self::mask(mask), self::position(position));
    let (softcap, scale, dtype) = (
        option_f64(*softcap),
        option_f64(*scale),
        self::dtype(*dtype),
    );
    let score_mod = match score_mod {
        Some(m) => {
            let body = expr(&m.body);
            let params = &m.params;
            let lets = lets(&m.lets);
            quote!(::core::option::Option::Some(::attn::dsl::modifier::ScoreMod {
                params: [#(::std::string::String::from(#params)),*],
                body: #body,
                lets: #lets,
            }))
        }
        None => quote!(::core::option::Option::None),
    };
    let mask_mod = match mask_mod {
        Some(m) => {
            let body = expr(&m.body);
            let params = &m.params;
            let lets = lets(&m.lets);
            quote!(::core::option::Option::Some(::attn::dsl::modifier::MaskMod {
                params: [#(::std::string::String::from(#params)),*],
                body: #body,
                lets: #lets,
            }))
        }
        None => quote!(::core::option::Option::None),
    };
    let params = params.iter().map(|p| {
        let name = &p.name;
        let dims = p.dims.iter().map(|d| match d {
            ParamDim::Fixed(n) => quote!(::attn::dsl::ParamDim::Fixed(#n)),
            ParamDim::Heads => quote!(::attn::dsl::ParamDim::Heads),
            ParamDim::KvHeads => quote!(::attn::dsl::ParamDim::KvHeads),
        });
        let init = match p.init {
            ParamInit::Constant(x) => {
                let x = f64_lit(x);
                quote!(::attn::dsl::ParamInit::Constant(#x))
            }
            ParamInit::Normal(std) => {
                let std = f64_lit(std);
                quote!(::attn::dsl::ParamInit::Normal(#std))
            }
            ParamInit::Uniform(low, high) => {
                let (low, high) = (f64_lit(low), f64_lit(high));
                quote!(::attn::dsl::ParamInit::Uniform(#low, #high))
            }
            ParamInit::Alibi => quote!(::attn::dsl::ParamInit::Alibi),
        };
        quote!(::attn::dsl::ParamDecl {
            name: ::std::string::String::from(#name),
            dims: ::std::vec![#(#dims),*],
            init: #init,
        })
    });
    let data = data.iter().map(|d| {
        let name = &d.name;
        let dims = d.dims.iter().map(|d| match d {
            DataDim::Fixed(n) => quote!(::attn::dsl::DataDim::Fixed(#n)),
            DataDim::Heads => quote!(::attn::dsl::DataDim::Heads),
            DataDim::KvHeads => quote!(::attn::dsl::DataDim::KvHeads),
            DataDim::Batch => quote!(::attn::dsl::DataDim::Batch),
            DataDim::Seq => quote!(::attn::dsl::DataDim::Seq),
        });
        let dtype = match d.dtype {
            DataType::I32 => quote!(::attn::dsl::DataType::I32),
            DataType::F32 => quote!(::attn::dsl::DataType::F32),
        };
        quote!(::attn::dsl::DataDecl {
            name: ::std::string::String::from(#name),
            dims: ::std::vec![#(#dims),*],
            dtype: #dtype,
        })
    });
    let normalize = match normalize {
        Normalize::Softmax => quote!(::attn::dsl::Normalize::Softmax),
        Normalize::StickBreaking => quote!(::attn::dsl::Normalize::StickBreaking),
        Normalize::Sigmoid(SigmoidBias::Value(b)) => {
            let b = f64_lit(*b);
            quote!(::attn::dsl::Normalize::Sigmoid(::attn::dsl::SigmoidBias::Value(#b)))
        }
        Normalize::Sigmoid(SigmoidBias::NegLn(n)) => {
            quote!(::attn::dsl::Normalize::Sigmoid(::attn::dsl::SigmoidBias::NegLn(#n)))
        }
    };
    let sinks = match sinks {
        Sinks::None => quote!(::attn::dsl::Sinks::None),
        Sinks::Learned => quote!(::attn::dsl::Sinks::Learned),
    };
    let differential = match differential {
        Some(d) => {
            let init = f64_lit(d.lambda_init);
            quote!(::std::option::Option::Some(::attn::dsl::Differential { lambda_init: #init }))
        }
        None => quote!(::std::option::Option::None),
    };
    quote! {
        ::attn::AttentionSpec {
            heads: #heads,
            kv: #kv,
            head_dim: #head_dim,
            v_head_dim: #v_head_dim,
            mask: #mask,
            position: #position,
            softcap: #softcap,
            scale: #scale,
            dtype: #dtype,
            score_mod: #score_mod,
            mask_mod: #mask_mod,
            params: ::std::vec![#(#params),*],
            data: ::std::vec![#(#data),*],
            sinks: #sinks,
            normalize: #normalize,
            differential: #differential,
        }
    }
}

fn f64_lit(x: f64) -> TokenStream {
    let bits = x.to_bits();
    quote!(f64::from_bits(#bits))
}

fn option_f64(x: Option<f64>) -> TokenStream {
    match x {
        Some(x) => {
            let x = f64_lit(x);
            quote!(::core::option::Option::Some(#x))
        }
        None => quote!(::core::option::Option::None),
    }
}

fn dtype(d: DType) -> TokenStream {
    match d {
        DType::F32 => quote!(::attn::DType::F32),
        DType::F16 => quote!(::attn::DType::F16),
        DType::Bf16 => quote!(::attn::DType::Bf16),
    }
}

fn kv_layout(kv: &KvLayout) -> TokenStream {
    match kv {
        KvLayout::Heads { kv_heads } => quote!(::attn::KvLayout::Heads { kv_heads: #kv_heads }),
        KvLayout::Mla(m) => {
            let (r, d) = (m.latent_rank, m.rope_dim);
            quote!(::attn::KvLayout::Mla(::attn::dsl::Mla { latent_rank: #r, rope_dim: #d }))
        }
    }
}

fn mask(m: &Mask) -> TokenStream {
    match m {
        Mask::None => quote!(::attn::Mask::None),
        Mask::Causal(CausalAlign::BottomRight) => {
            quote!(::attn::Mask::Causal(::attn::dsl::CausalAlign::BottomRight))
        }
        Mask::Causal(CausalAlign::TopLeft) => {
            quote!(::attn::Mask::Causal(::attn::dsl::CausalAlign::TopLeft))
        }
        Mask::SlidingWindow { window } => quote!(::attn::Mask::SlidingWindow { window: #window }),
    }
}

fn position(p: &Position) -> TokenStream {
    match p {
        Position::None => quote!(::attn::Position::None),
        Position::Alibi => quote!(::attn::Position::Alibi),
        Position::Rope(r) => {
            let r = rope(r);
            quote!(::attn::Position::Rope(#r))
        }
    }
}

fn rope(r: &Rope) -> TokenStream {
    let Rope {
        base,
        dim,
        layout,
        scaling,
        xpos,
    } = r;
    let base = f64_lit(*base);
    let xpos = match xpos {
        Some(x) => {
            let (scale_base, gamma) = (f64_lit(x.scale_base), f64_lit(x.gamma));
            quote!(::core::option::Option::Some(::attn::dsl::XPos {
                scale_base: #scale_base,
                gamma: #gamma,
            }))
        }
        None => quote!(::core::option::Option::None),
    };
    let layout = match layout {
        RopeLayout::Half => quote!(::attn::dsl::RopeLayout::Half),
        RopeLayout::Interleaved => quote!(::attn::dsl::RopeLayout::Interleaved),
    };
    let scaling = match scaling {
        RopeScaling::None => quote!(::attn::RopeScaling::None),
        RopeScaling::Linear { factor } => {
            let factor = f64_lit(*factor);
            quote!(::attn::RopeScaling::Linear { factor: #factor })
        }
        RopeScaling::Ntk { factor } => {
            let factor = f64_lit(*factor);
            quote!(::attn::RopeScaling::Ntk { factor: #factor })
        }
        RopeScaling::Dynamic {
            factor,
            original_max_position,
        } => {
            let factor = f64_lit(*factor);
            quote!(::attn::RopeScaling::Dynamic {
                factor: #factor,
                original_max_position: #original_max_position,
            })
        }
        RopeScaling::Yarn(y) => {
            let (factor, fast, slow) = (
                f64_lit(y.factor),
                f64_lit(y.beta_fast),
                f64_lit(y.beta_slow),
            );
            let (mscale, all_dim) = (option_f64(y.mscale), option_f64(y.mscale_all_dim));
            let original = y.original_max_position;
            let truncate = y.truncate;
            quote!(::attn::RopeScaling::Yarn(::attn::dsl::Yarn {
                factor: #factor,
                original_max_position: #original,
                beta_fast: #fast,
                beta_slow: #slow,
                mscale: #mscale,
                mscale_all_dim: #all_dim,
                truncate: #truncate,
            }))
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            let (factor, low, high) = (
                f64_lit(*factor),
                f64_lit(*low_freq_factor),
                f64_lit(*high_freq_factor),
            );
            quote!(::attn::RopeScaling::Llama3 {
                factor: #factor,
                low_freq_factor: #low,
                high_freq_factor: #high,
                original_max_position: #original_max_position,
            })
        }
        RopeScaling::LongRope(l) => {
            let list = |v: &[f64]| {
                let items = v.iter().map(|x| f64_lit(*x));
                quote!(::std::sync::Arc::<[f64]>::from([#(#items),*]))
            };
            let (short, long) = (list(&l.short), list(&l.long));
            let (original, factor) = (l.original_max_position, f64_lit(l.attention_factor));
            quote!(::attn::RopeScaling::LongRope(::attn::dsl::LongRope {
                short: #short,
                long: #long,
                original_max_position: #original,
                attention_factor: #factor,
            }))
        }
    };
    quote!(::attn::Rope {
        base: #base,
        dim: #dim,
        layout: #layout,
        scaling: #scaling,
        xpos: #xpos,
    })
}

/// A block expression building `e`: one `let` per node, children before parents.
/// A closure's `let` bindings, kept for printing back.
fn lets(lets: &[attn_dsl::modifier::Let]) -> TokenStream {
    let each = lets.iter().map(|l| {
        let (name, value) = (&l.name, expr(&l.value));
        quote!(::attn::dsl::modifier::Let {
            name: ::std::string::String::from(#name),
            value: #value,
        })
    });
    quote!(::std::vec![#(#each),*])
}

fn expr(e: &Expr) -> TokenStream {
    let mut lets = Vec::new();
    let root = node(e, &mut lets);
    quote!({ #(#lets)* #root })
}

/// Appends the bindings of `e`'s subtree to `lets` and returns the name bound to `e`. The
/// recursion is bounded: validation caps an expression's depth (attn_dsl's limits).
fn node(e: &Expr, lets: &mut Vec<TokenStream>) -> proc_macro2::Ident {
    let m = quote!(::attn::dsl::modifier);
    let value = match e {
        Expr::Var(v) => {
            let v = var(*v);
            quote!(#m::Expr::Var(#m::Var::#v))
        }
        Expr::Float(x) => {
            let x = f64_lit(*x);
            quote!(#m::Expr::Float(#x))
        }
        Expr::Int(x) => quote!(#m::Expr::Int(#x)),
        Expr::Bool(b) => quote!(#m::Expr::Bool(#b)),
        Expr::Unary(op, a) => {
            let (op, a) = (un_op(*op), node(a, lets));
            quote!(#m::Expr::unary(#m::UnOp::#op, #a))
        }
        Expr::Binary(op, a, b) => {
            let (op, a, b) = (bin_op(*op), node(a, lets), node(b, lets));
            quote!(#m::Expr::binary(#m::BinOp::#op, #a, #b))
        }
        Expr::Select(c, t, o) => {
            let (c, t, o) = (node(c, lets), node(t, lets), node(o, lets));
            quote!(#m::Expr::Select(
                ::std::boxed::Box::new(#c),
                ::std::boxed::Box::new(#t),
                ::std::boxed::Box::new(#o)
            ))
        }
        Expr::Cast(a, ty) => {
            let (a, ty) = (node(a, lets), self::ty(*ty));
            quote!(#m::Expr::cast(#a, #m::Ty::#ty))
        }
        Expr::Table(values, i) => {
            let values = values.iter().map(|v| f64_lit(*v));
            let i = node(i, lets);
            quote!(#m::Expr::Table(::std::vec![#(#values),*], ::std::boxed::Box::new(#i)))
        }
        Expr::Param(read) => {
            let name = &read.name;
            let indices: Vec<_> = read.indices.iter().map(|i| node(i, lets)).collect();
            let ty = self::ty(read.ty);
            quote!(#m::Expr::Param(#m::ParamRead {
                name: ::std::string::String::from(#name),
                indices: ::std::vec![#(#indices),*],
                ty: #m::Ty::#ty,
            }))
        }
    };
    let name = format_ident!("e{}", lets.len());
    lets.push(quote!(let #name = #value;));
    name
}

fn var(v: Var) -> proc_macro2::Ident {
    let name = match v {
        Var::Score => "Score",
        Var::Batch => "Batch",
        Var::Head => "Head",
        Var::Query => "Query",
        Var::Key => "Key",
        Var::QueryIndex => "QueryIndex",
        Var::KeyIndex => "KeyIndex",
    };
    format_ident!("{name}")
}

fn ty(t: Ty) -> proc_macro2::Ident {
    format_ident!(
        "{}",
        match t {
            Ty::F32 => "F32",
            Ty::I64 => "I64",
            Ty::Bool => "Bool",
        }
    )
}

fn un_op(op: UnOp) -> proc_macro2::Ident {
    format_ident!("{op:?}")
}

fn bin_op(op: BinOp) -> proc_macro2::Ident {
    format_ident!("{op:?}")
}
