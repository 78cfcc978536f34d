//! A seeded spec fuzzer: thousands of mutated specs (tokens deleted, duplicated, swapped and
//! replaced; extreme numbers; deep nesting; long lines; unicode) through parse, validate,
//! print, lowering to the score program, folding, the kernel plan and its tile map, the
//! reference on a tiny input and, for some, the CPU kernel compiler. Every input must come back
//! as a value or an error: no panic, no stack overflow (the test threads have 2 MiB stacks,
//! less than a CLI's main thread), and no runaway time.

use attn::AttentionSpec;
use attn::codegen::plan::KernelPlan;
use attn::dsl::modifier::{ParamValues, ScoreProgram};
use attn::dsl::reference::{self, Array, Inputs};
use attn::runtime::cpu::CpuBackend;
use std::time::{Duration, Instant};

/// A generous bound: the slowest input seen takes milliseconds in a debug build. An input past
/// it has hit something super-linear.
const PER_INPUT: Duration = Duration::from_secs(10);

const SEEDS: &[&str] = &[
    "heads = 8, head_dim = 64",
    "heads = 32, kv_heads = 8, head_dim = 128, mask = causal, position = rope(base = 500000.0, \
     scaling = llama3(factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, \
     original_max_position = 8192))",
    "heads = 8, head_dim = 64, mask = sliding_window(256), position = alibi, softcap = 30.0",
    "heads = 4, head_dim = 16, v_head_dim = 32, mla(latent_rank = 64, rope_dim = 8), \
     position = rope(layout = interleaved, scaling = yarn(factor = 4.0, \
     original_max_position = 32, mscale = 1.0, mscale_all_dim = 1.0))",
    "heads = 4, head_dim = 32, dtype = bf16, mask = causal(top_left), scale = 0.5, \
     score_mod = |score, b, h, q, k| score - 0.5 * (q - k).abs() as f32, \
     mask_mod = |b, h, q, k| q - k < 256 && (h % 2 == 0 || k >= 0)",
    "heads = 2, head_dim = 8, score_mod = |s, b, h, q, k| if q > k { s.tanh() * 2.0 } else \
     if q == k { s.exp().ln() } else { s.max(-1.0).min(1.0).sqrt() }",
    "heads = 6, kv_heads = 2, head_dim = 24, position = rope(dim = 16, scaling = \
     dynamic(factor = 2.0, original_max_position = 64))",
    "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, sinks = learned, \
     params(rel: [heads, 32], t: [kv_heads, 2, 3]), \
     score_mod = |s, b, h, q, k| s * t[h / 2, 1, 2] + rel[h, max(min(q - k, 31), 0)]",
    "heads = 2, head_dim = 8, params(score: [2], w: [heads]), \
     score_mod = |s, b, h, q, k| s * w[h] + w[(k - q).abs().min(1)]",
    "heads = 4, head_dim = 8, mask = causal, position = rope(dim = 8, scaling = \
     longrope(short = [1.0, 1.5, 2, 3], long = [1, 4, 16, 64], original_max_position = 32, \
     attention_factor = 1.2))",
    "heads = 2, head_dim = 8, mask = causal, data(doc: [batch, seq] i32, \
     gate: [batch, heads, seq] f32), mask_mod = |b, h, q, k| doc[b, q] == doc[b, k], \
     score_mod = |s, b, h, q, k| s + gate[b, h, q] - gate[b, h, k]",
    "heads = 4, kv_heads = 2, head_dim = 8, data(lo: [batch, seq] i32, t: [heads, 4] f32), \
     mask_mod = |b, h, q, k| k >= lo[b, q] || k <= q, \
     score_mod = |s, b, h, q, k| s * t[h, (q - k).abs().min(3)]",
    "heads = 2, head_dim = 8, params(w: [heads]), \
     score_mod = |s, b, h, q, k| let d = (q - k) as f32; let e = d * w[h]; s - e * e, \
     mask_mod = |b, h, q, k| { let r = q / 4; r == k / 4 }",
    "heads = 2, head_dim = 8, mask = causal, normalize = sigmoid(bias = -ln(64)), \
     params(w: [heads] = normal(0.02), a: [heads] = alibi), \
     score_mod = |s, b, h, q, k| s * (1.0 + w[h]) - a[h] * (q - k) as f32",
    "heads = 4, kv_heads = 2, head_dim = 16, mask = sliding_window(9), \
     normalize = stick_breaking, position = xpos(dim = 8, scale_base = 64.0, gamma = 0.5)",
    "heads = 4, kv_heads = 2, head_dim = 16, v_head_dim = 32, mask = causal, position = rope, \
     sinks = learned, differential = lambda(init = 0.2)",
];

/// Tokens inserted by mutations: extremes, wrong kinds, unicode, unbalanced brackets.
const INSERTS: &[&str] = &[
    "0",
    "-1",
    "4294967296",
    "18446744073709551616",
    "9223372036854775807",
    "1e308",
    "1e309",
    "-1e308",
    "3.4e38",
    "1e-320",
    "0.0",
    "-0.0",
    "NaN",
    "inf",
    "f32::MAX",
    "\"str\"",
    "'c'",
    "é",
    "注意",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "|",
    "||",
    "=",
    ",",
    "-",
    "!",
    ".abs()",
    "as i64",
    "as f32",
    "/ 0",
    "% 0",
    "heads",
    "mla",
    "rope",
    "causal",
    "score",
    "q",
    "k",
    "i64::MIN",
    "params",
    "sinks",
    "learned",
    ":",
    "rel",
    "rel[h, 0]",
    "[heads, 0]",
    "kv_heads",
];

struct Rng(attn::inputs::XorShift);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Splits a spec into words, operators (runs of operator characters, so `==` stays whole) and
/// single brackets and commas.
fn tokens(text: &str) -> Vec<String> {
    let kind = |c: char| {
        if c.is_alphanumeric() || c == '_' || c == '.' {
            1
        } else if "=<>!&|+-*/%".contains(c) {
            2
        } else {
            3
        }
    };
    let mut out: Vec<String> = Vec::new();
    let mut last = 0;
    for c in text.chars() {
        if c.is_whitespace() {
            last = 0;
            continue;
        }
        let k = kind(c);
        match out.last_mut() {
            Some(word) if k == last && k != 3 => word.push(c),
            _ => out.push(c.to_string()),
        }
        last = k;
    }
    out
}

/// Numbers that keep a spec's syntax but probe every range check.
const NUMBERS: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "7",
    "64",
    "1000",
    "1024",
    "1025",
    "65536",
    "4294967295",
    "4294967296",
    "18446744073709551615",
    "0.0",
    "1.0",
    "0.5",
    "1e-300",
    "1e300",
    "3.4e38",
    "1e309",
    "100000.0",
];

fn mutate(rng: &mut Rng, seed: &str) -> String {
    let mut t = tokens(seed);
    for _ in 0..1 + rng.below(3) * rng.below(2) {
        let i = rng.below(t.len());
        if rng.below(2) == 0 {
            // Most often: a number swapped for another, so the spec still parses as syntax.
            let numbers: Vec<usize> = (0..t.len())
                .filter(|&j| t[j].starts_with(|c: char| c.is_ascii_digit()))
                .collect();
            if !numbers.is_empty() {
                t[numbers[rng.below(numbers.len())]] =
                    NUMBERS[rng.below(NUMBERS.len())].to_string();
                continue;
            }
        }
        match rng.below(5) {
            0 if t.len() > 1 => {
                t.remove(i);
            }
            1 => {
                let tok = t[i].clone();
                t.insert(i, tok);
            }
            2 => {
                let j = rng.below(t.len());
                t.swap(i, j);
            }
            3 => t[i] = INSERTS[rng.below(INSERTS.len())].to_string(),
            _ => t.insert(i, INSERTS[rng.below(INSERTS.len())].to_string()),
        }
    }
    t.join(" ")
}

/// Inputs that are large or deep by construction, each past one limit or just inside it.
fn extremes() -> Vec<String> {
    let m = |body: String| format!("heads = 2, head_dim = 8, score_mod = |s, b, h, q, k| {body}");
    let mut out = Vec::new();
    for n in [10, 31, 32, 33, 100, 3000, 20_000] {
        out.push(m(format!("{}s{}", "(".repeat(n), ")".repeat(n))));
        out.push(m(format!("{}s{}", "[".repeat(n), "]".repeat(n))));
    }
    for n in [100, 250, 257, 7000, 20_000] {
        out.push(m(format!("{}s", "-".repeat(n))));
        out.push(m(format!("{}s", "- ".repeat(n))));
        out.push(m(format!("s{}", " + s".repeat(n))));
        out.push(m(format!("s{}", ".abs()".repeat(n))));
        out.push(m(format!("{} s {}", "if q > k { s } else ".repeat(n), "")));
        out.push(m(format!("s{}", " as f32".repeat(n))));
        out.push(format!(
            "heads = 2, head_dim = 8, mask_mod = |b, h, q, k| {}true",
            "!".repeat(n)
        ));
    }
    for digits in [20, 64, 65, 100_000] {
        out.push(format!("heads = {}, head_dim = 8", "9".repeat(digits)));
        out.push(format!(
            "heads = 2, head_dim = 8, scale = 0.{}",
            "1".repeat(digits)
        ));
    }
    out.push(format!(
        "heads = 8, head_dim = 64{}",
        ", heads = 4".repeat(6000)
    ));
    out.push(format!("heads = 8, head_dim = 64, {}", "x".repeat(70_000)));
    out.push(format!(
        "heads = 8, head_dim = 64, softcap = {}",
        "é".repeat(1000)
    ));
    out.push("-heads = 4, head_dim = 64".to_string());
    let p = |decls: String, body: String| {
        format!("heads = 2, head_dim = 8, params({decls}), score_mod = |s, b, h, q, k| {body}")
    };
    for n in [16, 17, 1000] {
        let decls: Vec<String> = (0..n).map(|i| format!("p{i}: [2]")).collect();
        out.push(p(decls.join(", "), "s + p0[0]".into()));
    }
    for n in [4, 5, 100] {
        out.push(p(format!("a: [{}]", vec!["2"; n].join(", ")), "s".into()));
    }
    out.push(p("a: [4294967295, 4294967295]".into(), "s".into()));
    out.push(p("a: [4294967296]".into(), "s".into()));
    out.push(p(format!("{}: [2]", "a".repeat(100_000)), "s".into()));
    for n in [10, 31, 32, 200] {
        out.push(p(
            "a: [2]".into(),
            format!("s + {}0{}", "a[".repeat(n), "]".repeat(n)),
        ));
        out.push(p(
            "a: [2]".into(),
            format!("s + a[{}0{}]", "(".repeat(n), ")".repeat(n)),
        ));
    }
    out
}

/// Everything downstream of the parser that a valid spec reaches.
fn exercise(spec: &AttentionSpec, compile: bool) {
    spec.validate().expect("a parsed spec is valid");
    let printed = spec.to_string();
    let again: AttentionSpec = printed
        .parse()
        .unwrap_or_else(|e| panic!("the printed form `{printed}` does not parse: {e}"));
    assert_eq!(&again, spec, "parse(print(spec)) == spec");
    let program = ScoreProgram::of(spec);
    program.typecheck().expect("the score program types");
    let _ = program.folded().to_string();
    let plan = KernelPlan::forward(spec);
    for (sq, skv, p0) in [(1, 1, 0), (7, 300, 5), (65, 65, i64::from(i32::MAX))] {
        let _ = plan.tile_map(sq, skv, p0);
    }
    if spec.mla().is_none() && spec.heads <= 64 && spec.head_dim <= 256 && spec.v_head_dim <= 256 {
        let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let q = Array::from_fn(&[1, h, 2, d], |i| (i[3] % 7) as f64 * 0.1 - 0.3);
        let k = Array::from_fn(&[1, hkv, 3, d], |i| (i[3] % 5) as f64 * 0.2 - 0.4);
        let vh = spec.value_heads() as usize;
        let v = Array::from_fn(&[1, vh, 3, dv], |i| (i[2] + i[3]) as f64);
        let inputs = Inputs {
            q: &q,
            k: &k,
            v: &v,
            position_offset: 0,
        };
        // Learnable tensors of up to 2^16 elements, each a small constant.
        let learned: Vec<ParamValues> = spec
            .learnable_tensors()
            .into_iter()
            .map(|(name, shape)| {
                let n: usize = shape.iter().product();
                ParamValues {
                    name,
                    shape,
                    values: vec![0.25; n],
                }
            })
            .collect();
        // Data tensors of the call's shapes (batch 1, 3 keys), small integers.
        let shapes: Vec<Vec<usize>> = spec.data.iter().map(|d| spec.data_shape(d, 1, 3)).collect();
        let elements = |shape: &Vec<usize>| shape.iter().fold(1usize, |n, d| n.saturating_mul(*d));
        let data_size = shapes
            .iter()
            .map(elements)
            .fold(0usize, usize::saturating_add);
        let data: Vec<ParamValues> = if data_size <= 1 << 16 {
            spec.data
                .iter()
                .zip(shapes)
                .map(|(decl, shape)| ParamValues {
                    name: decl.name.clone(),
                    values: (0..elements(&shape)).map(|i| (i % 3) as f64).collect(),
                    shape,
                })
                .collect()
        } else {
            Vec::new()
        };
        let sizes = learned.iter().chain(&data).map(|t| t.values.len());
        if data_size <= 1 << 16 && sizes.sum::<usize>() <= 1 << 16 {
            let all: Vec<ParamValues> = learned.into_iter().chain(data).collect();
            let lambda = vec![0.1; d];
            let result = match spec.differential {
                Some(_) => reference::differential(spec, &inputs, [&lambda; 4], &all).map(|_| ()),
                None => reference::attention_learned(spec, &inputs, &all).map(|_| ()),
            };
            // A read along `batch` or `seq` is checked against the call: one may leave it.
            if spec.data.is_empty() {
                result.expect("the reference runs a valid spec");
            }
        }
    }
    if compile {
        CpuBackend::new()
            .forward_kernel(spec)
            .unwrap_or_else(|e| panic!("`{spec}` does not compile: {e}"));
    }
}

fn run_one(text: &str, compile: bool) {
    let start = Instant::now();
    let result = std::panic::catch_unwind(|| {
        // The backward's notes take any text (spec-time notes in `attnc check`).
        for note in attn::dsl::gradient_notes(text) {
            assert!(note.render_as("note", text).len() < 64 * 1024);
        }
        if let Ok(spec) = attn::dsl::parse_str(text) {
            exercise(&spec, compile);
        } else if let Err(errors) = attn::dsl::parse_str(text) {
            let rendered = errors.render(text);
            assert!(!errors.0.is_empty());
            // Bounded output: a window per error line and a bounded number of errors.
            assert!(
                rendered.len() < 64 * 1024,
                "{} bytes of errors for a {}-byte spec",
                rendered.len(),
                text.len()
            );
        }
    });
    let shown: String = text.chars().take(300).collect();
    if let Err(panic) = result {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        panic!("spec `{shown}` panicked: {message}");
    }
    assert!(
        start.elapsed() < PER_INPUT,
        "spec `{shown}` took {:?}",
        start.elapsed()
    );
}

/// Mutated specs per run; `ATTN_FUZZ_ROUNDS` asks for more (a longer search by hand).
fn rounds() -> usize {
    std::env::var("ATTN_FUZZ_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3000)
}

#[test]
fn mutated_specs_never_panic() {
    let mut rng = Rng(attn::inputs::XorShift::from_state(0x5eed_1234_abcd_ef01).unwrap());
    let mut parsed = 0;
    let rounds = rounds();
    for round in 0..rounds {
        let seed = SEEDS[round % SEEDS.len()];
        let text = mutate(&mut rng, seed);
        parsed += usize::from(attn::dsl::parse_str(&text).is_ok());
        run_one(&text, round % 50 == 0);
    }
    // The mutations must leave a good share valid, or the passes past the parser go untested.
    assert!(
        parsed > rounds / 10,
        "only {parsed} of {rounds} mutated specs parsed"
    );
}

#[test]
fn extreme_specs_are_refused_or_run_within_bounds() {
    for text in extremes() {
        run_one(&text, false);
    }
}

#[test]
fn nesting_at_the_limits_runs_every_pass() {
    // Just inside the limits: 32 bracket levels, and expressions of depth 256.
    let m = |body: String| format!("heads = 2, head_dim = 8, score_mod = |s, b, h, q, k| {body}");
    let inside = [
        m(format!("{}s{}", "(".repeat(31), ")".repeat(31))),
        m(format!("{}s", "- ".repeat(240))),
        m(format!("s{}", " + s".repeat(240))),
        m(format!("s{}", ".abs()".repeat(120))),
    ];
    for text in inside {
        let spec = attn::dsl::parse_str(&text)
            .unwrap_or_else(|e| panic!("`{}...` should parse: {e}", &text[..60]));
        exercise(&spec, true);
        // The GPU kernels lower the same program recursively, and print it.
        let plan = KernelPlan::forward(&spec);
        // Lowered, verified and printed (the verifier walks the kernel recursively too).
        let forward = attn::codegen::gpu::forward_kernel(&plan).expect("the kernel verifies");
        let _ = forward.kernel.to_string();
        let decode = attn::codegen::gpu::decode_kernel(&KernelPlan::decode(&spec))
            .expect("the decode kernel verifies");
        let _ = decode.to_string();
        // And the GPU IR interpreter evaluates it recursively.
        let t = |shape: &[usize]| {
            let n = shape.iter().product();
            attn::runtime::Tensor::from_f32(shape, vec![0.25; n]).unwrap()
        };
        attn::runtime::gpu::GpuCall::forward(
            &spec,
            &t(&[1, 2, 3, 8]),
            &t(&[1, 2, 5, 8]),
            &t(&[1, 2, 5, 8]),
            0,
        )
        .and_then(|call| call.run_on_sim())
        .expect("the GPU kernel runs on the interpreter");
        #[cfg(feature = "llvm")]
        {
            attn::codegen::gpu::llvm::emit(&forward.kernel, attn::codegen::gpu::llvm::Arch::Sm90)
                .expect("the PTX emits");
        }
    }
    let outside = [
        m(format!("{}s{}", "(".repeat(40), ")".repeat(40))),
        m(format!("{}s", "- ".repeat(300))),
        m(format!("s{}", " + s".repeat(300))),
    ];
    for text in outside {
        let errors = attn::dsl::parse_str(&text).expect_err("past the limits");
        assert!(
            errors.0[0].message.contains("nest too deeply")
                || errors.0[0].message.contains("nests too deeply"),
            "{}",
            errors.0[0].message
        );
    }
}
