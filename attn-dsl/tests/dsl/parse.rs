//! The spec language: what it accepts, how it prints, and where its errors point.

use crate::support::rejects;
use attn_dsl::{
    AttentionSpec, CausalAlign, DType, KvKind, KvLayout, Mask, Mla, Position, RopeLayout,
    RopeScaling, SpecErrors, parse_str,
};

fn ok(text: &str) -> AttentionSpec {
    parse_str(text).unwrap_or_else(|e| panic!("`{text}` should parse:\n{}", e.render(text)))
}

fn errors(text: &str) -> SpecErrors {
    match parse_str(text) {
        Ok(spec) => panic!("`{text}` should be rejected, parsed as {spec}"),
        Err(e) => e,
    }
}

#[test]
fn minimal_spec_gets_the_documented_defaults() {
    let s = ok("heads = 32, head_dim = 128");
    assert_eq!(s.kv, KvLayout::Heads { kv_heads: 32 });
    assert_eq!(s.kv_kind(), KvKind::Mha);
    assert_eq!(s.v_head_dim, 128);
    assert_eq!(s.mask, Mask::None);
    assert_eq!(s.position, Position::None);
    assert_eq!(s.dtype, DType::F32);
    assert_eq!(s.scale, None);
    assert!((s.effective_scale() - 1.0 / 128f64.sqrt()).abs() < 1e-15);
    assert_eq!(s, AttentionSpec::new(32, 128));
}

#[test]
fn the_full_example_of_the_design_parses() {
    let s = ok("heads = 32, kv_heads = 8, head_dim = 128, v_head_dim = 128,
        mask = sliding_window(4096),
        position = rope(base = 500000.0, dim = 128, layout = half,
                   scaling = llama3(factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4,
                                    original_max_position = 8192)),
        softcap = 30.0, scale = 0.088, dtype = bf16,
        score_mod = |score, b, h, q, k| score - 0.5 * (q - k).abs() as f32,
        mask_mod = |b, h, q, k| q - k < 256");
    assert_eq!(s.kv_kind(), KvKind::Gqa);
    assert_eq!(s.mask, Mask::SlidingWindow { window: 4096 });
    let rope = s.rope().unwrap();
    assert_eq!(rope.base, 500000.0);
    assert_eq!(rope.layout, RopeLayout::Half);
    assert_eq!(
        rope.scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192
        }
    );
    assert_eq!(
        (s.softcap, s.scale, s.dtype),
        (Some(30.0), Some(0.088), DType::Bf16)
    );
    let m = s.mask_mod.as_ref().unwrap();
    assert!(m.keeps(0, 0, 300, 100));
    assert!(!m.keeps(0, 0, 400, 100));
    let sm = s.score_mod.as_ref().unwrap();
    assert_eq!(sm.apply(1.0, 0, 0, 10, 4), 1.0 - 0.5 * 6.0);
}

#[test]
fn mla_resolves_its_rope_dim_and_scale() {
    let s =
        ok("heads = 128, head_dim = 128, mla(latent_rank = 512, rope_dim = 64), position = rope");
    assert_eq!(
        s.mla(),
        Some(Mla {
            latent_rank: 512,
            rope_dim: 64
        })
    );
    assert_eq!(s.rope().unwrap().dim, 64);
    assert!((s.effective_scale() - 1.0 / 192f64.sqrt()).abs() < 1e-15);
    assert_eq!(s.kv_heads(), 1);
}

#[test]
fn explicit_defaults_equal_omitted_ones() {
    assert_eq!(
        ok("heads = 8, head_dim = 64, position = rope"),
        ok(
            "heads = 8, kv_heads = 8, head_dim = 64, v_head_dim = 64, position = rope(base = \
            10000, dim = 64, layout = half, scaling = none), mask = none, dtype = f32"
        )
    );
    assert_eq!(
        ok("heads = 2, head_dim = 8, mask = causal(bottom_right)").mask,
        Mask::Causal(CausalAlign::BottomRight)
    );
    // No softcap, said outright (a sweep's baseline on a softcap axis).
    assert_eq!(
        ok("heads = 2, head_dim = 8, softcap = none"),
        ok("heads = 2, head_dim = 8")
    );
}

#[test]
fn printing_round_trips() {
    let cases = [
        "heads = 32, head_dim = 128",
        "heads = 32, kv_heads = 1, head_dim = 96, v_head_dim = 64, mask = causal(top_left)",
        "heads = 16, kv_heads = 4, head_dim = 64, mask = sliding_window(4096), position = alibi, \
         softcap = 50.0, scale = 0.1, dtype = f16",
        "heads = 8, head_dim = 64, position = rope(base = 1e6, dim = 32, layout = interleaved, \
         scaling = yarn(factor = 40, original_max_position = 4096, mscale = 0.707, \
         mscale_all_dim = 0.707))",
        "heads = 8, head_dim = 64, position = rope(scaling = dynamic(factor = 2.0, \
         original_max_position = 2048))",
        "heads = 8, head_dim = 64, position = rope(scaling = ntk(factor = 3.5))",
        "heads = 8, head_dim = 64, position = rope(scaling = linear(factor = 0.25))",
        "heads = 128, head_dim = 128, mla(latent_rank = 512, rope_dim = 64), position = \
         rope(scaling = yarn(factor = 40.0, original_max_position = 4096)), dtype = bf16",
        "heads = 4, head_dim = 16, score_mod = |s, _, h, q, k| if q - k > 8 { -s } else { \
         s.tanh() * (h as f32 + 1.0) }, mask_mod = |_b, _h, qi, kj| !(qi / 64 == kj / 64) || \
         qi % 2 == 0 && kj >= 0",
        "heads = 4, head_dim = 16, score_mod = |score, b, h, q, k| (score - 1) / ((q - k) as \
         f32).abs().max(1.0).ln().exp().sqrt().min(2.0f32) - -3.0",
    ];
    for text in cases {
        let spec = ok(text);
        let printed = spec.to_string();
        let again = ok(&printed);
        assert_eq!(again, spec, "`{text}` printed as `{printed}`");
        assert_eq!(again.to_string(), printed, "printing is stable");
    }
}

#[test]
fn integers_are_accepted_where_floats_are_expected() {
    let s = ok("heads = 4, head_dim = 16, softcap = 30, scale = 1");
    assert_eq!((s.softcap, s.scale), (Some(30.0), Some(1.0)));
}

#[test]
fn from_str_is_the_same_parser() {
    let s: AttentionSpec = "heads = 4, head_dim = 16".parse().unwrap();
    assert_eq!(s, AttentionSpec::new(4, 16));
}

#[test]
fn heads_must_be_a_multiple_of_kv_heads() {
    rejects(
        "heads = 32, kv_heads = 5, head_dim = 128",
        "heads (32) is not a multiple of kv_heads (5); allowed: a divisor of 32: 1, 2, 4, 8, 16, 32",
        "kv_heads = ",
        "5",
    );
    rejects(
        "heads = 4, kv_heads = 8, head_dim = 128",
        "kv_heads = 8 is out of range; allowed: 1 to heads (4)",
        "kv_heads = ",
        "8",
    );
}

#[test]
fn a_colon_after_a_key_asks_for_equals() {
    rejects(
        "heads: 32, head_dim = 64",
        "expected `=` between a key and its value: `heads = ...`",
        "",
        ":",
    );
    rejects(
        "heads = 32, head_dim: 64",
        "`head_dim = ...`",
        "32, head_dim",
        ":",
    );
    // A typed closure parameter is not a key: another error stays the one reported.
    let errs = errors("heads = 2 head_dim = 8, score_mod = |s: f32, b, h, q, k| s");
    assert!(
        !errs.0[0].message.contains("between a key and its value"),
        "{errs}"
    );
}

#[test]
fn unknown_keys_get_a_suggestion() {
    rejects(
        "heads = 32, kv_hedas = 8, head_dim = 128",
        "unknown key `kv_hedas`; did you mean `kv_heads`?",
        "",
        "kv_hedas",
    );
    rejects(
        "heads = 32, head_dim = 128, postion = alibi",
        "did you mean `position`?",
        "",
        "postion",
    );
    rejects(
        "heads = 32, head_dim = 128, colour = 3",
        "unknown key `colour`; allowed keys: heads",
        "",
        "colour",
    );
    rejects(
        "heads = 8, head_dim = 64, position = rope(bsae = 3.0)",
        "unknown argument `bsae` of rope(...); did you mean `base`?",
        "",
        "bsae",
    );
}

#[test]
fn zero_and_absurd_sizes_are_rejected() {
    rejects(
        "heads = 0, head_dim = 64",
        "heads = 0 is out of range; allowed: 1 to 1024",
        "",
        "0",
    );
    rejects(
        "heads = 8, head_dim = 100000",
        "head_dim = 100000 is out of range; allowed: 1 to 1024",
        "",
        "100000",
    );
    rejects(
        "heads = 8, head_dim = 64, v_head_dim = 0",
        "v_head_dim = 0 is out of range",
        "v_head_dim = ",
        "0",
    );
    rejects(
        "heads = 99999999999, head_dim = 64",
        "absurdly large",
        "",
        "99999999999",
    );
    rejects(
        "heads = 8, head_dim = 64, mla(latent_rank = 0, rope_dim = 64)",
        "mla.latent_rank = 0 is out of range",
        "latent_rank = ",
        "0",
    );
}

#[test]
fn rope_dims_must_be_even_and_fit() {
    rejects(
        "heads = 8, head_dim = 64, position = rope(dim = 63)",
        "rope dim = 63 is odd; allowed: an even number from 2 to 64 (head_dim)",
        "dim = ",
        "63",
    );
    rejects(
        "heads = 8, head_dim = 64, position = rope(dim = 128)",
        "rope dim = 128 exceeds the rotated head dimension",
        "dim = ",
        "128",
    );
    rejects(
        "heads = 8, head_dim = 64, mla(latent_rank = 256, rope_dim = 32), position = rope(dim = 64)",
        "allowed: an even number from 2 to 32 (mla rope_dim)",
        "rope(dim = ",
        "64",
    );
    rejects(
        "heads = 8, head_dim = 64, position = rope(base = 1.0)",
        "rope base = 1 is invalid",
        "base = ",
        "1.0",
    );
}

#[test]
fn scaling_parameters_are_checked() {
    rejects(
        "heads = 8, head_dim = 64, position = rope(scaling = yarn(factor = 0.5, \
         original_max_position = 4096))",
        "yarn factor = 0.5 is below 1",
        "factor = ",
        "0.5",
    );
    rejects(
        "heads = 8, head_dim = 64, position = rope(scaling = llama3(factor = 8.0, \
         low_freq_factor = 4.0, high_freq_factor = 1.0, original_max_position = 8192))",
        "high_freq_factor (1) must be greater than low_freq_factor (4)",
        "high_freq_factor = ",
        "1.0",
    );
    rejects(
        "heads = 8, head_dim = 64, position = rope(scaling = dynamic(factor = 2.0))",
        "dynamic(...) needs `original_max_position = ..`",
        "dynamic",
        "(",
    );
    rejects(
        "heads = 8, head_dim = 64, position = rope(scaling = linear(factor = -2.0))",
        "position.scaling.factor = -2 is invalid",
        "factor = ",
        "-",
    );
    rejects(
        "heads = 8, head_dim = 64, position = rope(scaling = cubic(factor = 2.0))",
        "allowed: none, linear(factor = ..)",
        "scaling = ",
        "cubic",
    );
}

/// LongRoPE's factor lists: one per rotated pair, each finite and above 0, a list where a list
/// belongs; the spec prints back to itself.
#[test]
fn longrope_parses_prints_and_checks_its_factors() {
    let text = "heads = 2, head_dim = 8, position = rope(dim = 8, scaling = longrope(short = \
                [1.0, 1.5, 2, 4.25], long = [1, 3, 9, 27], original_max_position = 4096, \
                attention_factor = 1.19))";
    let spec = ok(text);
    let Position::Rope(rope) = &spec.position else {
        panic!("a rope, not {:?}", spec.position);
    };
    let RopeScaling::LongRope(l) = &rope.scaling else {
        panic!("longrope, not {:?}", rope.scaling);
    };
    assert_eq!(&*l.short, &[1.0, 1.5, 2.0, 4.25]);
    assert_eq!(&*l.long, &[1.0, 3.0, 9.0, 27.0]);
    assert_eq!((l.original_max_position, l.attention_factor), (4096, 1.19));
    assert_eq!(ok(&spec.to_string()), spec);
    rejects(
        "heads = 2, head_dim = 8, position = rope(dim = 8, scaling = longrope(short = [1, 2], \
         long = [1, 3, 9, 27], original_max_position = 4096, attention_factor = 1))",
        "position.scaling.short has 2 factors; allowed: one per rotated pair, 4",
        "short = ",
        "[",
    );
    rejects(
        "heads = 2, head_dim = 8, position = rope(dim = 8, scaling = longrope(short = [1, 2, \
         3, 4], long = [1, 3, 0, 27], original_max_position = 4096, attention_factor = 1))",
        "position.scaling.long holds 0; allowed: finite factors greater than 0",
        "long = ",
        "[",
    );
    rejects(
        "heads = 2, head_dim = 8, position = rope(dim = 8, scaling = longrope(short = 2, long = \
         [1, 3, 9, 27], original_max_position = 4096, attention_factor = 1))",
        "allowed: a list of numbers",
        "short = ",
        "2",
    );
    rejects(
        "heads = 2, head_dim = 8, position = rope(dim = 8, scaling = longrope(short = [1, 2, \
         3, 4], long = [1, 3, 9, 27], original_max_position = 4096))",
        "longrope(...) needs `attention_factor = ..`",
        "longrope",
        "(",
    );
}

#[test]
fn masks_windows_and_softcaps_are_checked() {
    rejects(
        "heads = 8, head_dim = 64, mask = sliding_window(0)",
        "sliding_window(0) keeps no key",
        "window(",
        "0",
    );
    rejects(
        "heads = 8, head_dim = 64, mask = causa",
        "invalid value for `mask`: found the name `causa`; allowed: none, causal",
        "mask = ",
        "causa",
    );
    rejects(
        "heads = 8, head_dim = 64, softcap = 0",
        "softcap = 0 is invalid; allowed: a finite number greater than 0",
        "softcap = ",
        "0",
    );
    // Finite settings that scale every score past f32's range.
    rejects(
        "heads = 8, head_dim = 64, scale = 1e39",
        "scale = 1e39 is invalid; allowed: a finite number greater than 0, at most 3.4028235e38",
        "scale = ",
        "1e39",
    );
    rejects(
        "heads = 2, head_dim = 4, position = rope(scaling = longrope(short = [1.0, 1.0], \
         long = [1.0, 2.0], original_max_position = 32, attention_factor = 1e30))",
        "the attention factor 1.000e30 multiplies every score by its square, 1.000e60, past \
         f32's range; allowed: a factor of at most 1.845e19",
        "attention_factor = ",
        "1e30",
    );
    rejects(
        "heads = 2, head_dim = 4, position = rope(scaling = yarn(factor = 4.0, \
         original_max_position = 32, mscale = 1e30, mscale_all_dim = 1.0))",
        "the attention factor 1.218e29 multiplies every score by its square",
        "mscale = ",
        "1e30",
    );
    rejects(
        "heads = 8, head_dim = 64, softcap = -3.5",
        "softcap = -3.5 is invalid",
        "softcap = ",
        "-",
    );
    rejects(
        "heads = 8, head_dim = 64, scale = 0.0",
        "scale = 0 is invalid",
        "scale = ",
        "0.0",
    );
}

#[test]
fn mla_needs_its_parameters() {
    rejects(
        "heads = 8, head_dim = 64, mla(latent_rank = 512)",
        "mla(...) needs `rope_dim = ..`",
        "",
        "mla",
    );
    rejects(
        "heads = 8, head_dim = 64, mla",
        "`mla` needs its parameters",
        "",
        "mla",
    );
    rejects(
        "heads = 8, head_dim = 64, mla(latent_rank = 512, rope_dim = 64), kv_heads = 2",
        "kv_heads does not apply with mla(...)",
        "kv_heads = ",
        "2",
    );
}

#[test]
fn duplicate_keys_are_rejected_at_the_second() {
    rejects(
        "heads = 8, head_dim = 64, heads = 4",
        "duplicate key `heads`",
        "64, ",
        "heads",
    );
    rejects(
        "heads = 8, head_dim = 64, position = rope(dim = 8, dim = 16)",
        "duplicate argument `dim` of rope(...)",
        "dim = 8, ",
        "dim",
    );
}

#[test]
fn wrong_value_types_say_what_was_expected() {
    rejects(
        "heads = causal, head_dim = 64",
        "invalid value for `heads`: found the name `causal`; allowed: an integer",
        "",
        "causal",
    );
    rejects(
        "heads = 8, head_dim = 64.0",
        "invalid value for `head_dim`: found the float `64.0`; allowed: an integer",
        "",
        "64.0",
    );
    rejects(
        "heads = 8, head_dim = 64, dtype = fp16",
        "allowed: f32, f16, bf16",
        "",
        "fp16",
    );
    rejects(
        "heads = 8, head_dim = 64, softcap = big",
        "allowed: a number",
        "",
        "big",
    );
    rejects(
        "heads = 8, head_dim = 64, score_mod = 3",
        "allowed: a closure |score, b, h, q, k| expr",
        "score_mod = ",
        "3",
    );
    rejects(
        "heads = -8, head_dim = 64",
        "`heads` cannot be negative",
        "",
        "-",
    );
}

#[test]
fn missing_required_keys_are_named() {
    let e = errors("heads = 8");
    assert_eq!(e.0.len(), 1);
    assert!(e.0[0].message.contains("missing `head_dim = N`"));
    let e = errors("");
    assert!(e.0[0].message.contains("the spec is empty"));
}

#[test]
fn every_error_is_reported_at_once() {
    let e = errors("heads = 8, kv_heads = 3, head_dim = 64, mask = causa, softcap = -1");
    let messages: Vec<&str> = e.0.iter().map(|e| e.message.as_str()).collect();
    assert_eq!(messages.len(), 3, "{messages:?}");
    assert!(messages.iter().any(|m| m.contains("causa")));
    assert!(messages.iter().any(|m| m.contains("not a multiple")));
    assert!(messages.iter().any(|m| m.contains("softcap")));
}

#[test]
fn locations_are_line_and_column_in_multiline_specs() {
    rejects(
        "heads = 8,\nhead_dim = 64,\n    kv_heads = 3",
        "not a multiple",
        "kv_heads = ",
        "3",
    );
    let text = "heads = 8,\n  head_dim = 64, dtype = f64";
    let rendered = errors(text).render(text);
    assert!(rendered.contains(" --> 2:26\n"), "{rendered}");
    assert!(
        rendered.contains("\n2 |   head_dim = 64, dtype = f64\n"),
        "{rendered}"
    );
    let carets = format!("\n  | {}^^^\n", " ".repeat(25));
    assert!(rendered.contains(&carets), "{rendered}");
}

#[test]
fn syntax_errors_are_located() {
    rejects(
        "heads = 8, head_dim = 64 mask = causal",
        "expected `,`",
        "64 ",
        "mask",
    );
    rejects(
        "heads = 8, 64, head_dim = 64",
        "expected `key = value`, `mla(...)`, `params(...)` or `data(...)`",
        "",
        "64",
    );
}

#[test]
fn modifier_errors_point_into_the_closure() {
    let m = "heads = 8, head_dim = 64, ";
    rejects(
        &format!("{m}score_mod = |s, b, h, q| s"),
        "score_mod takes 5 parameters |score, b, h, q, k|, found 4",
        "",
        "s, b",
    );
    rejects(
        &format!("{m}mask_mod = |b, h, q, k| q - k"),
        "mask_mod must evaluate to bool, this expression is i64",
        "| ",
        "q - k",
    );
    rejects(
        &format!("{m}mask_mod = |b, h, q, k| x < 3"),
        "unknown name `x`; the closure's parameters are: b, h, q, k",
        "| ",
        "x",
    );
    rejects(
        &format!("{m}score_mod = |score, b, h, q, k| score * q"),
        "type mismatch: `*` on f32 and i64",
        "score ",
        "*",
    );
    rejects(
        &format!("{m}score_mod = |score, b, h, q, k| score.sin()"),
        "unknown method `sin`",
        "score.",
        "sin",
    );
    rejects(
        &format!("{m}mask_mod = |b, h, q, k| if q > k {{ true }}"),
        "needs an `else` branch",
        "| ",
        "if",
    );
    rejects(
        &format!("{m}score_mod = |score, b, h, q, k| score + (q > k) as f32"),
        "cannot cast bool to f32",
        "+ ",
        "(",
    );
    rejects(
        &format!("{m}score_mod = |score, b, h, q, k| score + q as f64"),
        "modifiers cast only to f32 or i64",
        "as ",
        "f64",
    );
    rejects(
        &format!("{m}mask_mod = |b, h, q, k| q < k.exp()"),
        "`exp` needs an f32, the receiver is i64",
        "k.",
        "exp",
    );
    rejects(
        &format!("{m}mask_mod = |b, h, q, k| q[0] < k"),
        "`q` is a closure parameter and cannot be indexed",
        "| ",
        "q[0]",
    );
    rejects(
        &format!("{m}mask_mod = move |b, h, q, k| q < k"),
        "must be a plain closure",
        "= ",
        "move",
    );
}

#[test]
fn modifier_semantics_follow_rust() {
    let s = ok("heads = 1, head_dim = 1, \
                score_mod = |s, b, h, q, k| if (q / k) % 3 == -1 { s.max(0.5) } else { -s }, \
                mask_mod = |b, h, q, k| (q - k).abs() <= 2 && !(q == 0)");
    let sm = s.score_mod.as_ref().unwrap();
    // Integer division truncates toward zero: -4 / 1 % 3 == -1.
    assert_eq!(sm.apply(0.25, 0, 0, -4, 1), 0.5);
    assert_eq!(sm.apply(0.25, 0, 0, 4, 1), -0.25);
    // Division by zero gives 0 rather than a panic.
    assert_eq!(sm.apply(0.25, 0, 0, 4, 0), -0.25);
    let mm = s.mask_mod.as_ref().unwrap();
    assert!(mm.keeps(0, 0, 5, 3));
    assert!(!mm.keeps(0, 0, 5, 2));
    assert!(!mm.keeps(0, 0, 0, 0));
}
