//! Helpers shared by the attn-dsl tests: proptest generators of valid specs and well-typed
//! modifier expressions, and the check that a spec is refused at the right tokens.

#![allow(dead_code)] // each test binary uses part of this module

use attn_dsl::modifier::{BinOp, Expr, MaskMod, ScoreMod, Ty, UnOp, Var};
use attn_dsl::{
    AttentionSpec, CausalAlign, DType, Differential, KvLayout, LongRope, Mask, Mla, Position, Rope,
    RopeLayout, RopeScaling, XPos, Yarn,
};
use proptest::prelude::*;

pub fn float() -> impl Strategy<Value = f64> {
    prop_oneof![Just(1.0), Just(0.5), Just(30.0), 1e-3f64..1e6]
}

/// Well-typed expressions of type `ty`, over the variables a closure of that kind may use.
pub fn expr(ty: Ty, with_score: bool, depth: u32) -> BoxedStrategy<Expr> {
    let leaf = match ty {
        Ty::F32 if with_score => prop_oneof![
            Just(Expr::Var(Var::Score)),
            (0.0f64..100.0).prop_map(Expr::Float)
        ]
        .boxed(),
        Ty::F32 => (0.0f64..100.0).prop_map(Expr::Float).boxed(),
        Ty::I64 => prop_oneof![
            Just(Expr::Var(Var::Batch)),
            Just(Expr::Var(Var::Head)),
            Just(Expr::Var(Var::Query)),
            Just(Expr::Var(Var::Key)),
            (0i64..1000).prop_map(Expr::Int),
        ]
        .boxed(),
        Ty::Bool => any::<bool>().prop_map(Expr::Bool).boxed(),
    };
    if depth == 0 {
        return leaf;
    }
    let sub = move |t: Ty| expr(t, with_score, depth - 1);
    let bin = |ops: Vec<BinOp>, t: Ty| {
        (proptest::sample::select(ops), sub(t), sub(t))
            .prop_map(|(op, a, b)| Expr::Binary(op, Box::new(a), Box::new(b)))
    };
    let select = (sub(Ty::Bool), sub(ty), sub(ty))
        .prop_map(|(c, t, e)| Expr::Select(Box::new(c), Box::new(t), Box::new(e)));
    use BinOp::*;
    let arith = vec![Add, Sub, Mul, Div, Rem, Min, Max];
    match ty {
        Ty::F32 => prop_oneof![
            leaf,
            bin(arith, Ty::F32),
            (
                proptest::sample::select(vec![
                    UnOp::Neg,
                    UnOp::Abs,
                    UnOp::Exp,
                    UnOp::Ln,
                    UnOp::Tanh,
                    UnOp::Sqrt
                ]),
                sub(Ty::F32)
            )
                .prop_map(|(op, a)| Expr::Unary(op, Box::new(a))),
            sub(Ty::I64).prop_map(|a| Expr::Cast(Box::new(a), Ty::F32)),
            select,
        ]
        .boxed(),
        Ty::I64 => prop_oneof![
            leaf,
            bin(arith, Ty::I64),
            (
                proptest::sample::select(vec![UnOp::Neg, UnOp::Abs]),
                sub(Ty::I64)
            )
                .prop_map(|(op, a)| Expr::Unary(op, Box::new(a))),
            sub(Ty::F32).prop_map(|a| Expr::Cast(Box::new(a), Ty::I64)),
            sub(Ty::Bool).prop_map(|a| Expr::Cast(Box::new(a), Ty::I64)),
            select,
        ]
        .boxed(),
        Ty::Bool => prop_oneof![
            leaf,
            bin(vec![Lt, Le, Gt, Ge, Eq, Ne], Ty::I64),
            bin(vec![Lt, Le, Gt, Ge, Eq, Ne], Ty::F32),
            bin(vec![And, Or, Eq, Ne], Ty::Bool),
            sub(Ty::Bool).prop_map(|a| Expr::Unary(UnOp::Not, Box::new(a))),
            select,
        ]
        .boxed(),
    }
}

pub fn scaling() -> impl Strategy<Value = RopeScaling> {
    prop_oneof![
        Just(RopeScaling::None),
        float().prop_map(|factor| RopeScaling::Linear { factor }),
        float().prop_map(|factor| RopeScaling::Ntk { factor }),
        (1.0f64..64.0, 1u64..100_000).prop_map(|(factor, original_max_position)| {
            RopeScaling::Dynamic {
                factor,
                original_max_position,
            }
        }),
        (
            1.0f64..64.0,
            1u64..100_000,
            proptest::option::of(float()),
            proptest::option::of(float())
        )
            .prop_map(|(f, o, m, a)| RopeScaling::Yarn(Yarn {
                mscale: m,
                mscale_all_dim: a,
                ..Yarn::new(f, o)
            })),
        (float(), 0.5f64..2.0, 2.0f64..8.0, 1u64..100_000).prop_map(|(f, l, h, o)| {
            RopeScaling::Llama3 {
                factor: f,
                low_freq_factor: l,
                high_freq_factor: h,
                original_max_position: o,
            }
        }),
        // Factors for the widest rope; `spec` keeps one per pair of its rope.
        (
            proptest::collection::vec(float(), 128),
            proptest::collection::vec(float(), 128),
            1u64..100_000,
            float()
        )
            .prop_map(|(short, long, o, a)| RopeScaling::LongRope(LongRope {
                short: short.into(),
                long: long.into(),
                original_max_position: o,
                attention_factor: a,
            })),
    ]
}

pub fn spec() -> impl Strategy<Value = AttentionSpec> {
    let shape = (
        proptest::sample::select(vec![1u32, 2, 3, 4, 6, 8, 12, 16, 32, 128]),
        1u32..=256,
        1u32..=256,
        any::<bool>(),
        (1u32..1024, 1u32..=64),
    );
    let mask = prop_oneof![
        Just(Mask::None),
        Just(Mask::Causal(CausalAlign::BottomRight)),
        Just(Mask::Causal(CausalAlign::TopLeft)),
        (1u64..100_000).prop_map(|window| Mask::SlidingWindow { window }),
    ];
    let mods = (
        proptest::option::of(expr(Ty::F32, true, 3)),
        proptest::option::of(expr(Ty::Bool, false, 3)),
    );
    let extras = (
        mask,
        0u8..3,
        (10.0f64..1e7, 0.0f64..1.0, any::<bool>(), scaling()),
        proptest::option::of(float()),
        proptest::option::of(float()),
        proptest::sample::select(vec![DType::F32, DType::F16, DType::Bf16]),
    );
    (shape, extras, mods, any::<usize>()).prop_map(
        |((heads, hd, vd, mla, (rank, rope_dim)), extras, (score, maskm), pick)| {
            let (mask, pos, (base, dim_frac, interleaved, scaling), softcap, scale, dtype) = extras;
            let divisors: Vec<u32> = (1..=heads).filter(|d| heads.is_multiple_of(*d)).collect();
            let kv = if mla {
                KvLayout::Mla(Mla {
                    latent_rank: rank,
                    rope_dim: rope_dim * 2,
                })
            } else {
                KvLayout::Heads {
                    kv_heads: divisors[pick % divisors.len()],
                }
            };
            let mut s = AttentionSpec::new(heads, hd);
            s.kv = kv;
            s.v_head_dim = vd;
            let span = s.rotary_span();
            s.position = match pos {
                0 => Position::None,
                1 => Position::Alibi,
                _ if span < 4 => Position::None,
                _ => {
                    let dim = (((span / 2) as f64 * dim_frac) as u32).clamp(2, span / 2) * 2;
                    let pairs = dim as usize / 2;
                    let scaling = match scaling {
                        RopeScaling::LongRope(l) => RopeScaling::LongRope(LongRope {
                            short: l.short[..pairs].into(),
                            long: l.long[..pairs].into(),
                            ..l
                        }),
                        other => other,
                    };
                    Position::Rope(Rope {
                        base,
                        dim,
                        layout: if interleaved {
                            RopeLayout::Interleaved
                        } else {
                            RopeLayout::Half
                        },
                        scaling,
                        // xPos (per-head layouts only), its parameters drawn from `pick`.
                        xpos: (!mla && pick % 3 == 0).then_some(XPos {
                            scale_base: 1.0 + (pick / 3 % 1000) as f64 * 0.75,
                            gamma: 0.1 + (pick / 7 % 9) as f64 * 0.35,
                        }),
                    })
                }
            };
            // Differential heads where the head counts pair up, lambda's init from `pick`.
            let even = heads.is_multiple_of(2) && s.kv_heads().is_multiple_of(2);
            s.differential = (!mla && even && pick % 5 == 0).then_some(Differential {
                lambda_init: (pick / 5 % 200) as f64 * 0.01 - 1.0,
            });
            s.mask = mask;
            s.softcap = softcap;
            s.scale = scale;
            s.dtype = dtype;
            let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
            s.score_mod = score.map(|body| ScoreMod {
                params: names(&["score", "b", "h", "q", "k"]).try_into().unwrap(),
                body,
                lets: Vec::new(),
            });
            s.mask_mod = maskm.map(|body| MaskMod {
                params: names(&["b", "h", "q", "k"]).try_into().unwrap(),
                body,
                lets: Vec::new(),
            });
            s
        },
    )
}

/// Asserts the spec is rejected with exactly one error whose message contains `message` and
/// whose carets start at the first occurrence of `at` after `after` in the text.
pub fn rejects(text: &str, message: &str, after: &str, at: &str) {
    let errs = match attn_dsl::parse_str(text) {
        Ok(spec) => panic!("`{text}` should be rejected, parsed as {spec}"),
        Err(e) => e,
    };
    assert_eq!(errs.0.len(), 1, "one error expected for `{text}`:\n{errs}");
    let e = &errs.0[0];
    assert!(
        e.message.contains(message),
        "`{text}`: message `{}` lacks `{message}`",
        e.message
    );
    let base = text.find(after).expect("`after` occurs in the text") + after.len();
    let offset = base + text[base..].find(at).expect("`at` occurs after `after`");
    let line = text[..offset].matches('\n').count() + 1;
    let column = offset - text[..offset].rfind('\n').map_or(0, |i| i + 1) + 1;
    assert_eq!(
        e.start,
        attn_dsl::Location { line, column },
        "`{text}`: location of `{at}`"
    );
}
