//! `attnc bench-model`: a whole model's prefill and decode speed on the CPU, optionally side by
//! side with transformers running the same checkpoint.

use crate::model_load::load_on;
use attn::runtime::cpu::bandwidth::peak_read_gbps;
use attn::runtime::model::Model;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// The transformers side, run by `--against-torch` (written to a temporary file first, so the
/// command works from any folder).
const TORCH_SCRIPT: &str = include_str!("../../../scripts/bench_model_torch.py");

/// Longest prompt or context timed.
const MAX_TOKENS: u64 = 1 << 16;

/// `attnc bench-model`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json and *.safetensors), or a research model's TOML file
    /// (random weights; not with --against-torch).
    #[arg(long, value_name = "PATH")]
    model: PathBuf,
    /// Prompt lengths whose prefill is timed (one forward over the prompt), comma-separated.
    #[arg(long, value_name = "N,..", default_value = "128,512,2048")]
    prefill: String,
    /// Context lengths after which single-token decoding steps are timed, comma-separated.
    #[arg(long, value_name = "N,..", default_value = "128,2048")]
    contexts: String,
    /// Timed decoding steps per context (after two warm-up steps).
    #[arg(long, value_name = "S", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    steps: u64,
    /// Timed prefills per prompt length (after one warm-up).
    #[arg(long, value_name = "R", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=1000))]
    reps: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Also time transformers on the same checkpoint (scripts/bench_model_torch.py) with
    /// --python, in the same run.
    #[arg(long)]
    against_torch: bool,
    /// The Python that has torch and transformers, for --against-torch (scripts/setup-torch.sh
    /// installs torch there).
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/opt/torch-venv/bin/python"
    )]
    python: PathBuf,
}

/// Tokens per second at one length: a prefill's prompt or a decode's context.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Rate {
    tokens: usize,
    per_s: f64,
}

/// What one side measured.
#[derive(Debug, Default)]
struct Rates {
    prefill: Vec<Rate>,
    decode: Vec<Rate>,
}

/// `attnc bench-model`.
pub fn command(args: Args) -> Result<(), String> {
    let prefill = lengths("--prefill", &args.prefill)?;
    let contexts = lengths("--contexts", &args.contexts)?;
    if args.against_torch && args.model.is_file() {
        return Err(format!(
            "error: --against-torch needs a Hugging Face checkpoint folder; {} is a research \
             model's TOML file",
            args.model.display()
        ));
    }
    if args.against_torch {
        check_python(&args.python)?;
    }
    // A forward pass frees and allocates the same activations layer after layer: keep the
    // memory rather than fault it in again (as `attnc generate` does; measured: prefill 512
    // at 570-675 tokens/s against 546-563).
    attn::runtime::memory::keep_freed_memory();
    let model = load_on(&args.model, 0, crate::backend_arg::Backend::Cpu)?;
    let threads = attn::runtime::cpu::threads();
    let ours = time_model(&model, &prefill, &contexts, &args, !args.json)?;
    let step_bytes = model.step_weight_bytes();
    let cache_bytes = contexts
        .iter()
        .map(|&c| model.step_cache_bytes(c))
        .collect();
    drop(model);
    let ceiling = peak_read_gbps(threads, 1.0).map_err(|e| format!("error: {e}"))?;
    let theirs = match args.against_torch {
        true => Some(run_torch(&args, threads)?),
        false => None,
    };
    let report = Report {
        model: &args.model,
        threads,
        step_bytes,
        cache_bytes,
        ceiling,
        ours: &ours,
        theirs: theirs.as_ref(),
    };
    match args.json {
        true => println!("{}", report.json()),
        false => print!("{}", report.table()),
    }
    Ok(())
}

/// Comma-separated token counts, each 1 to [`MAX_TOKENS`].
fn lengths(flag: &str, text: &str) -> Result<Vec<usize>, String> {
    text.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| match s.trim().parse::<u64>() {
            Ok(n) if (1..=MAX_TOKENS).contains(&n) => Ok(n as usize),
            _ => Err(format!(
                "error: {flag} {text}: {s:?} is not a token count from 1 to {MAX_TOKENS}"
            )),
        })
        .collect()
}

/// Deterministic token ids below `vocab` (the same as scripts/bench_model_torch.py's).
fn token_ids(count: usize, vocab: usize) -> Vec<u32> {
    (0..count as u64)
        .map(|i| ((i * 2_654_435_761 + 12_345) % vocab as u64) as u32)
        .collect()
}

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Times prefill at each prompt length and decoding after each context, on the CPU.
fn time_model(
    model: &Model,
    prefill: &[usize],
    contexts: &[usize],
    args: &Args,
    progress: bool,
) -> Result<Rates, String> {
    let err = |e: attn::runtime::RuntimeError| format!("error: {e}");
    let vocab = model.config.vocab;
    let steps = args.steps as usize;
    let mut rates = Rates::default();
    for &n in prefill {
        if progress {
            eprintln!("attn: prefill of {n} tokens");
        }
        let ids = token_ids(n, vocab);
        let mut times = Vec::new();
        for rep in 0..=args.reps {
            let mut session = model.session(n, 64).map_err(err)?;
            let start = Instant::now();
            session.step(&ids).map_err(err)?;
            if rep > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        rates.prefill.push(Rate {
            tokens: n,
            per_s: n as f64 / median(times),
        });
    }
    for &context in contexts {
        if progress {
            eprintln!("attn: decoding after {context} tokens");
        }
        let ids = token_ids(context + steps + 2, vocab);
        let mut session = model.session(ids.len(), 64).map_err(err)?;
        session.step(&ids[..context]).map_err(err)?;
        let mut times = Vec::new();
        for (i, &token) in ids[context..].iter().enumerate() {
            let start = Instant::now();
            session.step(&[token]).map_err(err)?;
            if i >= 2 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        rates.decode.push(Rate {
            tokens: context,
            per_s: 1.0 / median(times),
        });
    }
    Ok(rates)
}

/// Refuses, before anything is timed, a `--python` that does not run or lacks torch or
/// transformers.
fn check_python(python: &Path) -> Result<(), String> {
    let why = match Command::new(python)
        .args(["-c", "import torch, transformers"])
        .output()
    {
        Err(e) => e.to_string(),
        Ok(o) if o.status.success() => return Ok(()),
        Ok(o) => {
            let stderr = String::from_utf8_lossy(&o.stderr);
            stderr.lines().last().unwrap_or("failed").to_string()
        }
    };
    Err(format!(
        "error: --python {}: {why}; --against-torch needs a Python with torch and transformers \
         (scripts/setup-torch.sh installs torch in /opt/torch-venv; then pip install \
         transformers there)",
        python.display()
    ))
}

/// Runs scripts/bench_model_torch.py on the same checkpoint and lengths.
fn run_torch(args: &Args, threads: usize) -> Result<Rates, String> {
    let script = std::env::temp_dir().join(format!("attn-bench-model-{}.py", std::process::id()));
    std::fs::write(&script, TORCH_SCRIPT)
        .map_err(|e| format!("error: writing {}: {e}", script.display()))?;
    eprintln!("transformers: timing the same checkpoint");
    let output = Command::new(&args.python)
        .arg(&script)
        .arg("--model")
        .arg(&args.model)
        .args(["--prefill", &args.prefill, "--contexts", &args.contexts])
        .args(["--steps", &args.steps.to_string()])
        .args(["--reps", &args.reps.to_string()])
        .args(["--threads", &threads.to_string()])
        .output();
    let _ = std::fs::remove_file(&script);
    let output = output.map_err(|e| format!("error: --python {}: {e}", args.python.display()))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last: Vec<&str> = stderr.lines().rev().take(5).collect();
        return Err(format!(
            "error: transformers failed ({}): {}",
            output.status,
            last.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    parse_torch(&String::from_utf8_lossy(&output.stdout))
}

/// The script's JSON line.
fn parse_torch(text: &str) -> Result<Rates, String> {
    let bad = |what: &str| format!("error: transformers printed {what}: {}", text.trim());
    let value: serde_json::Value = serde_json::from_str(text.trim()).map_err(|_| bad("no JSON"))?;
    let list = |key: &str, length: &str| -> Result<Vec<Rate>, String> {
        value[key]
            .as_array()
            .ok_or_else(|| bad(&format!("no {key} list")))?
            .iter()
            .map(|r| match (r[length].as_u64(), r["tokens_per_s"].as_f64()) {
                (Some(tokens), Some(per_s)) => Ok(Rate {
                    tokens: tokens as usize,
                    per_s,
                }),
                _ => Err(bad(&format!(
                    "a {key} entry without {length} or tokens_per_s"
                ))),
            })
            .collect()
    };
    Ok(Rates {
        prefill: list("prefill", "tokens")?,
        decode: list("decode", "context")?,
    })
}

/// Both sides' rates and the decoding roofline.
struct Report<'a> {
    model: &'a Path,
    threads: usize,
    /// Weight bytes a decoding step reads.
    step_bytes: u64,
    /// Cache bytes a decoding step reads after each of `ours.decode`'s contexts.
    cache_bytes: Vec<u64>,
    /// `attnc peak --memory` on `threads` threads, GB/s.
    ceiling: f64,
    ours: &'a Rates,
    theirs: Option<&'a Rates>,
}

impl Report<'_> {
    /// Tokens/s if a decoding step took only the time to read its weights at the ceiling.
    fn roofline(&self) -> f64 {
        self.ceiling * 1e9 / self.step_bytes.max(1) as f64
    }

    /// [`Report::roofline`] with decode `i`'s cache reads added to the weights'.
    fn roofline_with_cache(&self, i: usize) -> f64 {
        let cache = self.cache_bytes.get(i).copied().unwrap_or(0);
        self.ceiling * 1e9 / self.step_bytes.saturating_add(cache).max(1) as f64
    }

    fn json(&self) -> String {
        let rates = |list: &[Rate], length: &str| {
            let items: Vec<String> = list
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    // A decode entry says what its step reads from the cache (the same
                    // checkpoint on both sides).
                    let cache = match (length, self.cache_bytes.get(i)) {
                        ("context", Some(bytes)) => format!(", \"step_cache_bytes\": {bytes}"),
                        _ => String::new(),
                    };
                    format!(
                        "{{\"{length}\": {}, \"tokens_per_s\": {:.2}{cache}}}",
                        r.tokens, r.per_s
                    )
                })
                .collect();
            format!("[{}]", items.join(", "))
        };
        let side = |r: &Rates| {
            format!(
                "{{\"prefill\": {}, \"decode\": {}}}",
                rates(&r.prefill, "tokens"),
                rates(&r.decode, "context")
            )
        };
        let theirs = self.theirs.map_or(String::new(), |t| {
            format!(", \"transformers\": {}", side(t))
        });
        format!(
            "{{\"model\": {}, \"threads\": {}, \"step_weight_bytes\": {}, \"memory_gbps\": {:.2}, \
             \"decode_roofline_tokens_per_s\": {:.2}, \"attn\": {}{theirs}}}",
            serde_json::Value::from(self.model.display().to_string()),
            self.threads,
            self.step_bytes,
            self.ceiling,
            self.roofline(),
            side(self.ours)
        )
    }

    fn table(&self) -> String {
        /// Width of the row labels.
        const LABEL: usize = 30;
        let mut out = format!(
            "{} on {} threads; a decoding step reads {:.1} MB of weights: {:.1} tokens/s at \
             {:.1} GB/s (attnc peak --memory)\n\
             decode (% of that roofline, % of the roofline of the weights and the cache read)\n",
            self.model.display(),
            self.threads,
            self.step_bytes as f64 / 1e6,
            self.roofline(),
            self.ceiling
        );
        out += &format!("{:<LABEL$} {:>14}", "", "attn tokens/s");
        if self.theirs.is_some() {
            out += &format!(" {:>22} {:>8}", "transformers tokens/s", "ratio");
        }
        out += "\n";
        let mut row = |label: String, ours: &Rate, theirs: Option<&Rate>| {
            out += &format!("{label:<LABEL$} {:>14.1}", ours.per_s);
            if let Some(t) = theirs {
                out += &format!(" {:>22.1} {:>8.2}", t.per_s, ours.per_s / t.per_s);
            }
            out += "\n";
        };
        let theirs =
            |list: fn(&Rates) -> &Vec<Rate>, i: usize| self.theirs.and_then(|t| list(t).get(i));
        for (i, r) in self.ours.prefill.iter().enumerate() {
            row(
                format!("prefill {}", r.tokens),
                r,
                theirs(|t| &t.prefill, i),
            );
        }
        for (i, r) in self.ours.decode.iter().enumerate() {
            let label = format!("decode after {}", r.tokens);
            let share = 100.0 * r.per_s / self.roofline();
            let with_cache = 100.0 * r.per_s / self.roofline_with_cache(i);
            row(
                format!("{label} ({share:.0}%, {with_cache:.0}%)"),
                r,
                theirs(|t| &t.decode, i),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_are_bounded_counts() {
        assert_eq!(lengths("--prefill", "128, 512,").unwrap(), vec![128, 512]);
        for bad in ["0", "-1", "x", "65537", "99999999999999999999"] {
            let e = lengths("--prefill", bad).unwrap_err();
            assert!(e.contains("--prefill") && e.contains("1 to 65536"), "{e}");
        }
    }

    #[test]
    fn torch_output_is_read_or_refused() {
        let good = r#"{"prefill": [{"tokens": 128, "tokens_per_s": 500.5}],
                       "decode": [{"context": 2048, "tokens_per_s": 30.0}]}"#;
        let rates = parse_torch(&good.replace('\n', " ")).unwrap();
        assert_eq!(
            rates.prefill,
            vec![Rate {
                tokens: 128,
                per_s: 500.5
            }]
        );
        assert_eq!(
            rates.decode,
            vec![Rate {
                tokens: 2048,
                per_s: 30.0
            }]
        );
        for bad in [
            "",
            "not json",
            r#"{"prefill": []}"#,
            r#"{"prefill": [{}], "decode": []}"#,
        ] {
            assert!(parse_torch(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ids_stay_in_the_vocabulary() {
        let ids = token_ids(5000, 97);
        assert_eq!(ids.len(), 5000);
        assert!(ids.iter().all(|&t| t < 97));
    }
}
