//! GPU IR as text: kernels written in the printed form (`tests/gpu_ir/*.gir`), parsed, verified
//! and run on the interpreter, against the expectations in their `#` lines:
//! - `# grid: X Y Z` — the grid to run (the kernel runs only when one is given);
//! - `# buffer NAME: f32 x N` / `# buffer NAME: f32 = v0 v1 ..` — a global f32 buffer bound to
//!   parameter `$NAME` (zeros, or the values);
//! - `# scalar NAME = V` — an i64 argument;
//! - `# expect NAME: v0 v1 ..` — buffer NAME's values after the run (within 1e-6 relative);
//! - `# expect verify: TEXT` — a verifier error containing TEXT (one line per error expected);
//! - `# expect run error: TEXT` / `# expect parse: TEXT` — the run, or the parse, fails so.
//!
//! And every kernel the lowerings produce prints, parses back to the same kernel and verifies.

use attn_dsl::AttentionSpec;
use codegen::KernelPlan;
use codegen::gpu::choice::ForwardChoice;
use codegen::gpu::interp::{Memory, Val, run};
use codegen::gpu::ir::Kernel;
use codegen::gpu::ir::parse::{MAX_DEPTH, parse};
use codegen::gpu::ir::verify::verify;
use std::collections::HashMap;

#[derive(Default)]
struct Case {
    grid: Option<[u32; 3]>,
    buffers: Vec<(String, Vec<f32>)>,
    scalars: HashMap<String, i64>,
    expect: Vec<(String, Vec<f32>)>,
    verify: Vec<String>,
    run_error: Option<String>,
    parse_error: Option<String>,
}

fn numbers(text: &str) -> Vec<f32> {
    text.split_whitespace()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("`{v}` is not a number"))
        })
        .collect()
}

fn case(text: &str) -> Case {
    let mut c = Case::default();
    for line in text.lines().filter_map(|l| l.trim().strip_prefix('#')) {
        let line = line.trim();
        if let Some(g) = line.strip_prefix("grid:") {
            let v: Vec<u32> = g.split_whitespace().map(|x| x.parse().unwrap()).collect();
            c.grid = Some(v.try_into().expect("three grid sizes"));
        } else if let Some(b) = line.strip_prefix("buffer ") {
            let (name, spec) = b.split_once(':').expect("buffer NAME: ..");
            let spec = spec.trim();
            let values = match spec.strip_prefix("f32 x ") {
                Some(n) => vec![0.0; n.trim().parse().unwrap()],
                None => numbers(spec.strip_prefix("f32 =").expect("f32 x N or f32 = ..")),
            };
            c.buffers.push((name.trim().to_string(), values));
        } else if let Some(s) = line.strip_prefix("scalar ") {
            let (name, v) = s.split_once('=').expect("scalar NAME = V");
            c.scalars
                .insert(name.trim().to_string(), v.trim().parse().unwrap());
        } else if let Some(v) = line.strip_prefix("expect verify:") {
            c.verify.push(v.trim().to_string());
        } else if let Some(v) = line.strip_prefix("expect run error:") {
            c.run_error = Some(v.trim().to_string());
        } else if let Some(v) = line.strip_prefix("expect parse:") {
            c.parse_error = Some(v.trim().to_string());
        } else if let Some(v) = line.strip_prefix("expect ") {
            let (name, values) = v.split_once(':').expect("expect NAME: values");
            c.expect.push((name.trim().to_string(), numbers(values)));
        }
    }
    c
}

/// Runs the kernel with the case's arguments; returns each buffer's values after the run.
fn execute(kernel: &Kernel, c: &Case, grid: [u32; 3]) -> Result<HashMap<String, Vec<f32>>, String> {
    let mut mem = Memory::default();
    let mut addresses = HashMap::new();
    for (name, values) in &c.buffers {
        addresses.insert(name.clone(), (mem.alloc_f32(values), values.len()));
    }
    let args: Vec<Val> = kernel
        .params
        .iter()
        .map(
            |(name, _)| match (addresses.get(name), c.scalars.get(name)) {
                (Some((addr, _)), _) => Val::I64(*addr),
                (_, Some(v)) => Val::I64(*v),
                _ => panic!("no buffer or scalar for parameter `${name}`"),
            },
        )
        .collect();
    run(kernel, grid, &args, &mut mem)?;
    Ok(addresses
        .into_iter()
        .map(|(name, (addr, n))| (name, mem.read_f32(addr, n).unwrap()))
        .collect())
}

fn check_file(path: &std::path::Path) {
    let what = path.display();
    let text = std::fs::read_to_string(path).unwrap();
    let c = case(&text);
    let kernel = match parse(&text) {
        Ok(k) => {
            assert!(
                c.parse_error.is_none(),
                "{what}: parsed, expected a parse error"
            );
            k
        }
        Err(e) => {
            let expected = c.parse_error.as_deref().unwrap_or_else(|| {
                panic!("{what}: {e}");
            });
            assert!(e.to_string().contains(expected), "{what}: {e}");
            return;
        }
    };
    // The text is the kernel's printed form: it prints back the same.
    assert_eq!(
        parse(&kernel.to_string()).unwrap(),
        kernel,
        "{what}: printing and parsing again changed the kernel"
    );
    match verify(&kernel) {
        Ok(()) => assert!(
            c.verify.is_empty(),
            "{what}: verified, expected {:?}",
            c.verify
        ),
        Err(errors) => {
            let found: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
            assert!(!c.verify.is_empty(), "{what}: {found:?}");
            assert_eq!(found.len(), c.verify.len(), "{what}: {found:?}");
            for (f, e) in found.iter().zip(&c.verify) {
                assert!(f.contains(e.as_str()), "{what}: `{f}` lacks `{e}`");
            }
            return;
        }
    }
    let Some(grid) = c.grid else {
        return;
    };
    match execute(&kernel, &c, grid) {
        Err(e) => {
            let expected = c
                .run_error
                .as_deref()
                .unwrap_or_else(|| panic!("{what}: {e}"));
            assert!(e.contains(expected), "{what}: {e}");
        }
        Ok(buffers) => {
            assert!(c.run_error.is_none(), "{what}: ran, expected an error");
            assert!(!c.expect.is_empty(), "{what}: runs, but expects nothing");
            for (name, want) in &c.expect {
                let got = &buffers[name];
                assert_eq!(got.len(), want.len(), "{what}: {name}");
                for (g, w) in got.iter().zip(want) {
                    assert!(
                        (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                        "{what}: {name} = {got:?}, expected {want:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn text_kernels_parse_verify_and_run_as_expected() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gpu_ir");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gir"))
        .collect();
    files.sort();
    assert!(files.len() >= 10, "{files:?}");
    for f in &files {
        check_file(f);
    }
}

#[test]
fn every_lowered_kernel_prints_parses_back_and_verifies() {
    let specs = [
        "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, position = rope",
        "heads = 2, head_dim = 8, mask = sliding_window(5), position = alibi, softcap = 20.0",
        "heads = 2, head_dim = 16, dtype = bf16, mask = causal, position = rope(dim = 8)",
        "heads = 2, head_dim = 16, dtype = f16, mask = causal(top_left)",
        // Also the sm_90a kernel: TMA, mbarriers, wgmma, setmaxnreg.
        "heads = 2, head_dim = 64, dtype = bf16, mask = causal, position = rope",
        "heads = 2, head_dim = 8, mla(latent_rank = 16, rope_dim = 4), mask = causal",
        "heads = 2, head_dim = 8, mask_mod = |b, h, q, k| (q / 4) == (k / 4), \
         score_mod = |s, b, h, q, k| s - ((q - k) as f32).abs() * 0.5",
    ];
    for text in specs {
        let spec: AttentionSpec = text.parse().unwrap();
        let forward = KernelPlan::forward(&spec);
        let kernels = [
            codegen::gpu::forward_kernel(&forward).unwrap().kernel,
            ForwardChoice::Simt.lower(&forward).unwrap().kernel,
            std::sync::Arc::new(codegen::gpu::decode_kernel(&KernelPlan::decode(&spec)).unwrap()),
        ];
        let hopper = ForwardChoice::Wgmma.lower(&forward).ok().map(|k| k.kernel);
        for k in kernels.into_iter().chain(hopper) {
            let printed = k.to_string();
            let parsed = parse(&printed).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(parsed.to_string(), printed, "{text}");
            assert_eq!(parsed.body, k.body, "{text}");
            assert_eq!(parsed.params, k.params, "{text}");
            let types = |k: &Kernel| k.regs.iter().map(|(_, t)| *t).collect::<Vec<_>>();
            assert_eq!(types(&parsed), types(&k), "{text}");
            verify(&parsed).unwrap_or_else(|e| panic!("{text}: {e:?}"));
        }
    }
}

#[test]
fn hostile_text_is_refused_cleanly() {
    let header = "kernel k($out: i64) threads 1 (1 CTAs per SM) shared 0 bytes {\n  reg %x: f32\n";
    let deep = format!(
        "{header}  %x = {}1.0{}\n}}\n",
        "neg(".repeat(MAX_DEPTH + 10),
        ")".repeat(MAX_DEPTH + 10)
    );
    let cases = [
        (String::new(), "expected `kernel`"),
        ("kernel".to_string(), "the kernel's name"),
        (format!("{header}  %x = 1.0\n"), "expected `}`"),
        (deep, "nested deeper than"),
        (
            format!("{header}  %x = (1.0 ^ 2.0)\n}}\n"),
            "unexpected character `^`",
        ),
        (
            format!("{header}  %x = 99999999999999999999:i64\n}}\n"),
            "not an integer",
        ),
        (
            format!("{header}  for %x in 0:i64..1:i64 step 99999999999999999999 {{\n  }}\n}}\n"),
            "out of range",
        ),
        (
            format!("{header}  reg %x: f32\n  %x = 1.0\n}}\n"),
            "declared twice",
        ),
        (
            format!("{header}  %x = 1.0\n  reg %y: f32\n}}\n"),
            "expected a statement",
        ),
        (format!("{header}  %x = 7\n}}\n"), "needs a type"),
        (format!("{header}}}\n}}\n"), "text after"),
        (
            format!("{header}  {{%x}} = ldmatrix.x2.shared.b16 [0:i64]\n}}\n"),
            "writes 2 registers",
        ),
        (
            format!("{header}  {{%x}} = wgmma.m64nQk16.bf16.kmajor(true) {{\n  }}\n}}\n"),
            "unknown wgmma form",
        ),
        (
            format!("{header}  tma.load [0:i64], $nope[0:i32], [8:i64]\n}}\n"),
            "not declared",
        ),
    ];
    for (text, expected) in cases {
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains(expected), "{text:?}: {err}");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Mangled kernel text (bytes replaced, cut short, spliced) parses or is refused, never a
    /// panic; what parses also verifies or is refused, and prints.
    #[test]
    fn mangled_text_never_panics(
        hopper in proptest::prelude::any::<bool>(),
        cut in 0usize..4000,
        edits in proptest::collection::vec((0usize..4000, proptest::prelude::any::<char>()), 0..8),
    ) {
        // The mma.sync kernel, or the sm_90a one (its asynchronous statements).
        let text = if hopper {
            "heads = 2, head_dim = 64, dtype = bf16, mask = causal, position = rope"
        } else {
            "heads = 2, head_dim = 8, mask = causal, position = rope"
        };
        let plan = KernelPlan::forward(&text.parse::<AttentionSpec>().unwrap());
        let kernel = match ForwardChoice::Wgmma.lower(&plan) {
            Ok(k) if hopper => k.kernel,
            _ => codegen::gpu::forward_kernel(&plan).unwrap().kernel,
        };
        let mut chars: Vec<char> = kernel.to_string().chars().collect();
        for (at, c) in edits {
            let at = at % chars.len();
            chars[at] = c;
        }
        chars.truncate(chars.len().min(cut.max(1) * 4));
        let text: String = chars.into_iter().collect();
        if let Ok(k) = parse(&text) {
            let _ = verify(&k);
            let _ = k.to_string();
        }
    }
}
