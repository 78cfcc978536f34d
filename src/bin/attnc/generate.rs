//! `attnc generate`: a prompt continued by a checkpoint or research model, streamed as text
//! (through the checkpoint's tokenizer) or printed as token ids.

use crate::backend_arg::Backend;
use crate::model_load::{load_on, parse_tokens, resident_device};
use attn::runtime::model::{Progress, Request, ResidentModel, Sampling, TextTokenizer};
use std::io::Write;
use std::path::{Path, PathBuf};

/// `attnc generate`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json and *.safetensors), or a research model's TOML
    /// file (random weights).
    #[arg(long, value_name = "PATH")]
    model: PathBuf,
    /// Seed of a research model's random weights.
    #[arg(long, value_name = "S", default_value_t = 0)]
    init_seed: u64,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_name = "IDS", conflicts_with_all = ["prompt", "prompt_file"])]
    tokens: Option<String>,
    /// Prompt text, tokenized by the checkpoint's tokenizer.json.
    #[arg(
        long,
        value_name = "TEXT",
        allow_hyphen_values = true,
        conflicts_with = "prompt_file"
    )]
    prompt: Option<String>,
    /// Prompt text read from a file (UTF-8, at most 16 MiB), tokenized as --prompt is.
    #[arg(long, value_name = "PATH")]
    prompt_file: Option<PathBuf>,
    /// The tokenizer.json for --prompt and the text out (default: the checkpoint's own; for a
    /// research model of 256 ids, bytes).
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
    /// Most tokens to generate.
    #[arg(long, value_name = "N", default_value_t = 32)]
    max_new_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, value_name = "T", default_value_t = 0.0)]
    temperature: f32,
    /// Sample among the K most likely tokens.
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// Sample among the most likely tokens that reach probability P.
    #[arg(long, value_name = "P")]
    top_p: Option<f32>,
    /// Sampler seed.
    #[arg(long, value_name = "S", default_value_t = 0)]
    seed: u64,
    /// Token ids that end the generation, comma-separated.
    #[arg(long, value_name = "IDS")]
    stop: Option<String>,
    /// Where the model runs: cpu; gpu-sim or cuda hold the whole model on the device (weights,
    /// activations and KV caches).
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
}

/// `attnc generate`.
pub fn command(args: Args) -> Result<(), String> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        return Err(format!(
            "error: --temperature {}: expected 0 or more",
            args.temperature
        ));
    }
    if args.top_k == Some(0) {
        return Err("error: --top-k 0 keeps no token; expected at least 1".to_string());
    }
    if args.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
        return Err("error: --top-p: expected a probability in (0, 1]".to_string());
    }
    let stop = match &args.stop {
        Some(s) => parse_tokens(s)?,
        None => Vec::new(),
    };
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    let prompt = match (&args.tokens, args.prompt, &args.prompt_file) {
        (Some(ids), _, _) => Prompt::Ids(parse_tokens(ids)?),
        (None, Some(text), _) => Prompt::Text(text, "--prompt"),
        (None, None, Some(path)) => Prompt::Text(read_prompt(path)?, "--prompt-file"),
        (None, None, None) => {
            return Err(
                "error: a prompt is needed: --tokens IDS, --prompt TEXT or --prompt-file PATH"
                    .into(),
            );
        }
    };
    let generation = Generation {
        max_new_tokens: args.max_new_tokens,
        sampling,
        stop,
        backend: args.backend,
        tokenizer: args.tokenizer,
    };
    let out = generate(&args.model, args.init_seed, prompt, generation)?;
    println!("{out}");
    Ok(())
}

/// Longest prompt file read.
const MAX_PROMPT_BYTES: usize = 16 << 20;

/// The text of a prompt file: a regular file of UTF-8, bounded.
fn read_prompt(path: &Path) -> Result<String, String> {
    crate::spec_arg::read_bounded(path, MAX_PROMPT_BYTES)
        .map_err(|e| format!("error: --prompt-file {}: {e}", path.display()))
}

/// A prompt: token ids, or text for the model's tokenizer and the flag that gave it.
enum Prompt {
    Ids(Vec<u32>),
    Text(String, &'static str),
}

/// How long and how to generate.
struct Generation {
    max_new_tokens: usize,
    sampling: Sampling,
    stop: Vec<u32>,
    backend: Backend,
    tokenizer: Option<PathBuf>,
}

/// The tokenizer of text for the model at `path`: `--tokenizer`, the checkpoint's own, or bytes
/// for a research model of 256 ids.
fn tokenizer_for(path: &Path, given: Option<&Path>, vocab: usize) -> Result<TextTokenizer, String> {
    let err = |e: attn::runtime::RuntimeError| format!("error: {e}");
    match given {
        Some(file) => {
            TextTokenizer::from_file(file).map_err(|e| format!("error: --tokenizer: {e}"))
        }
        None if path.is_dir() => TextTokenizer::from_dir(path).map_err(err),
        None if vocab == 256 => Ok(TextTokenizer::bytes()),
        None => Err(format!(
            "error: {} is a research model of {vocab} token ids, which has no tokenizer: give \
             its tokenizer.json with --tokenizer, or ids with --tokens",
            path.display()
        )),
    }
}

/// The prompt's ids, checked against the model's context (its `max_position_embeddings`)
/// before a long text is tokenized whole; warns when the generation would run past it.
fn prompt_ids(
    prompt: Prompt,
    tokenizer: Option<&TextTokenizer>,
    config: &attn::runtime::model::ModelConfig,
    max_new_tokens: usize,
) -> Result<Vec<u32>, String> {
    let context = config.context.unwrap_or(usize::MAX);
    let (ids, flag) = match prompt {
        Prompt::Ids(ids) => (ids, "--tokens"),
        Prompt::Text(text, flag) => {
            let tokenizer = tokenizer.expect("a tokenizer for text");
            let what = format!("the prompt ({flag})");
            let ids = tokenizer
                .encode_within(&text, context, &what)
                .map_err(|e| {
                    format!("error: {e} (the model's context, max_position_embeddings)")
                })?;
            if ids.is_empty() {
                return Err(format!("error: {flag} is empty once tokenized"));
            }
            (ids, flag)
        }
    };
    if ids.len() > context {
        return Err(format!(
            "error: {flag}: the prompt is {}; allowed: at most {context}, the model's context \
             (max_position_embeddings)",
            crate::outputs::counted(ids.len() as u64, "token")
        ));
    }
    if ids.len().saturating_add(max_new_tokens) > context {
        eprintln!(
            "warning: the prompt's {} tokens and --max-new-tokens {max_new_tokens} run past the \
             model's context of {context} positions (max_position_embeddings); tokens past it \
             are extrapolation",
            ids.len()
        );
    }
    Ok(ids)
}

/// Generates from one prompt with the model at `path`. Ids in: returns the new ids, with a
/// progress line on stderr. Text in: streams the new text to stdout as tokens complete it,
/// returns what is still held back, and prints the rates on stderr at the end.
fn generate(path: &Path, seed: u64, prompt: Prompt, args: Generation) -> Result<String, String> {
    let err = |e: attn::runtime::RuntimeError| format!("error: {e}");
    let config = crate::model_load::load_config(path)?;
    let tokenizer = match &prompt {
        Prompt::Text(..) => Some(tokenizer_for(
            path,
            args.tokenizer.as_deref(),
            config.vocab,
        )?),
        Prompt::Ids(_) => None,
    };
    let ids = prompt_ids(prompt, tokenizer.as_ref(), &config, args.max_new_tokens)?;
    // Each step frees and allocates the same activations: keep the memory rather than fault
    // it in again.
    attn::runtime::memory::keep_freed_memory();
    let model = load_on(path, seed, args.backend)?;
    if let Some(tokenizer) = &tokenizer {
        tokenizer.check_fits(model.config.vocab).map_err(err)?;
    }
    let request = Request {
        prompt: ids,
        max_new_tokens: args.max_new_tokens,
        stop: args.stop,
    };
    let mut stream = tokenizer.as_ref().map(TextTokenizer::stream);
    let mut failed = None;
    let mut last = None;
    let mut report = |p: Progress| {
        if let Some(stream) = stream.as_mut() {
            for &(_, token) in &p.new_tokens {
                match stream.push(token) {
                    Ok(piece) => {
                        print!("{piece}");
                        let _ = std::io::stdout().flush();
                    }
                    Err(e) => failed = Some(e),
                }
            }
        } else {
            eprint!("\r  {}", rates(&p));
            let _ = std::io::stderr().flush();
        }
        last = Some(p);
    };
    // On gpu-sim or cuda the model runs resident on the device.
    let out = match resident_device(args.backend)? {
        Some(device) => vec![
            ResidentModel::new(&model, device)
                .and_then(|m| m.generate(&request, args.sampling, &mut report))
                .map_err(err)?,
        ],
        None => model
            .generate(&[request], args.sampling, &mut report)
            .map_err(err)?,
    };
    if let Some(e) = failed {
        return Err(err(e));
    }
    match stream.as_mut() {
        Some(stream) => {
            let rest = stream.finish().map_err(err)?;
            if let Some(p) = &last {
                eprintln!("  {}", rates(p));
            }
            Ok(rest)
        }
        None => {
            eprintln!();
            Ok(out[0]
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(","))
        }
    }
}

/// Tokens so far and the decoding rate (the first token comes from the prefill; the rate is
/// that of decode steps).
fn rates(p: &Progress) -> String {
    let decoded = p.generated.saturating_sub(1);
    let rate = if decoded == 0 {
        0.0
    } else {
        decoded as f64 / p.decoding.as_secs_f64()
    };
    format!(
        "{}, {rate:.1} tokens/s decoding (prefill {:.1} ms)",
        crate::outputs::counted(p.generated as u64, "token"),
        p.prefill.as_secs_f64() * 1e3
    )
}
