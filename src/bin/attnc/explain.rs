//! `attnc explain`: the accounting of a spec as a table.

use attn::AttentionSpec;
use attn::dsl::KvKind;
use attn::dsl::accounting::{attention_params, forward_flops, kv_cache_bytes_per_token};

/// `attnc explain`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// The spec, in the spec language, or @FILE to read it from a file.
    #[arg(allow_hyphen_values = true, required_unless_present = "model")]
    spec: Option<String>,
    /// Instead of a spec, a model (a Hugging Face checkpoint folder or a research model's TOML):
    /// each of its attention kinds, with the layers that have it, at the model's width.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["spec", "model_dim", "layers"])]
    model: Option<std::path::PathBuf>,
    /// Model width for the projection parameter count (default: heads * head_dim).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    model_dim: Option<u64>,
    /// Number of layers.
    #[arg(long, value_name = "L", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    layers: u64,
    /// Sequence length for the cache size and the prefill FLOPs.
    #[arg(long, value_name = "S", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
    seq: u64,
    /// Number of sequences.
    #[arg(long, value_name = "B", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
}

/// `attnc explain`.
pub fn command(args: Args) -> Result<(), String> {
    if let Some(path) = &args.model {
        print!("{}", model_tables(path, &args)?);
        return Ok(());
    }
    let text = args.spec.as_deref().unwrap_or_default();
    let (spec, _) = crate::spec_arg::load(text)?;
    let shape = Shape {
        model_dim: args
            .model_dim
            .unwrap_or(u64::from(spec.heads) * u64::from(spec.head_dim)),
        layers: args.layers,
        seq: args.seq,
        batch: args.batch,
    };
    print!("{}", table(&spec, &shape)?);
    Ok(())
}

/// One table per attention kind of the model at `path`, each headed by the layers of that kind,
/// at the model's width and that kind's layer count.
fn model_tables(path: &std::path::Path, args: &Args) -> Result<String, String> {
    let config = crate::model_load::load_config(path)?;
    let mut out = format!(
        "{}, width {}, {}\n",
        crate::outputs::counted(config.layers as u64, "layer"),
        config.hidden,
        crate::outputs::counted(config.attention.len() as u64, "attention kind"),
    );
    for (kind, spec) in config.attention.iter().enumerate() {
        let layers: Vec<String> = (0..config.layers)
            .filter(|&i| config.kind_of(i) == kind)
            .map(|i| i.to_string())
            .collect();
        let shape = Shape {
            model_dim: config.hidden as u64,
            layers: layers.len() as u64,
            seq: args.seq,
            batch: args.batch,
        };
        out += &format!("\nkind {kind}: layers {}\n", layers.join(", "));
        out += &table(spec, &shape)?;
    }
    Ok(out)
}

/// The model shape the accounting is for.
struct Shape {
    pub model_dim: u64,
    pub layers: u64,
    pub seq: u64,
    pub batch: u64,
}

/// The error when a count of the table does not fit in 64 bits.
fn too_large(what: &str, shape: &Shape) -> String {
    format!(
        "error: the {what} at --seq {}, --layers {}, --batch {}, --model-dim {} does not fit in \
         64 bits; allowed: smaller sizes",
        shape.seq, shape.layers, shape.batch, shape.model_dim
    )
}

/// The table, one `label  value` row per line; an error when a count does not fit in 64 bits.
fn table(spec: &AttentionSpec, shape: &Shape) -> Result<String, String> {
    let mut rows: Vec<(String, String)> = Vec::new();
    let mut row = |label: &str, value: String| rows.push((label.to_string(), value));

    row("spec", spec.to_string());
    row("kv layout", kv_layout(spec));
    row("score scale", format!("{:.6}", spec.effective_scale()));

    let per_token = kv_cache_bytes_per_token(spec);
    row("KV bytes/token/layer", per_token.to_string());
    // A sliding layer's cache holds at most its window.
    let held = match spec.mask {
        attn::Mask::SlidingWindow { window } => shape.seq.min(window),
        _ => shape.seq,
    };
    let cache = [held, shape.layers, shape.batch]
        .into_iter()
        .try_fold(per_token, u64::checked_mul)
        .ok_or_else(|| too_large("KV cache size", shape))?;
    let tokens = match held < shape.seq {
        true => format!(
            "{} (the window; --seq {})",
            crate::outputs::counted(held, "token"),
            shape.seq
        ),
        false => crate::outputs::counted(shape.seq, "token"),
    };
    row(
        "KV cache",
        format!(
            "{} ({cache} bytes) at {tokens} x {} x batch {}",
            human_bytes(cache),
            crate::outputs::counted(shape.layers, "layer"),
            shape.batch
        ),
    );

    let params =
        attention_params(spec, shape.model_dim).ok_or_else(|| too_large("parameters", shape))?;
    let all_params = params
        .total()
        .checked_mul(shape.layers)
        .ok_or_else(|| too_large("parameters", shape))?;
    let parts = params
        .parts
        .iter()
        .map(|(name, n)| (*name, *n))
        .chain(params.learned.iter().map(|(name, n)| (name.as_str(), *n)))
        .map(|(name, n)| format!("{name} {}", group_digits(n)))
        .collect::<Vec<_>>()
        .join(", ");
    row(
        "attention params/layer",
        format!(
            "{} at model dim {} ({parts})",
            group_digits(params.total()),
            shape.model_dim
        ),
    );
    row(
        "attention params",
        format!(
            "{} in {}",
            group_digits(all_params),
            crate::outputs::counted(shape.layers, "layer")
        ),
    );

    let flops = forward_flops(spec, shape.batch, shape.seq, shape.seq)
        .ok_or_else(|| too_large("prefill FLOPs", shape))?;
    let note = if flops.custom_mask {
        " (mask_mod may skip more)"
    } else {
        ""
    };
    row(
        "prefill FLOPs/layer",
        format!(
            "{} dense, {} with masked pairs skipped{note} (Sq = Skv = {}, batch {})",
            human_flops(flops.dense),
            human_flops(flops.with_skipping),
            shape.seq,
            shape.batch
        ),
    );
    let decode = forward_flops(spec, shape.batch, 1, shape.seq)
        .ok_or_else(|| too_large("decode FLOPs", shape))?;
    row(
        "decode FLOPs/layer",
        format!(
            "{} per step at {} cached tokens, batch {}",
            human_flops(decode.with_skipping),
            shape.seq,
            shape.batch
        ),
    );

    let width = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    Ok(rows
        .iter()
        .map(|(label, value)| format!("{label:<width$}  {value}\n"))
        .collect())
}

fn kv_layout(spec: &AttentionSpec) -> String {
    let kv = spec.kv_heads();
    match spec.kv_kind() {
        KvKind::Mha => format!("MHA ({} heads)", spec.heads),
        KvKind::Gqa => format!(
            "GQA ({} query heads over {kv} KV heads, {} per group)",
            spec.heads,
            spec.heads / kv
        ),
        KvKind::Mqa => format!("MQA ({} query heads share 1 KV head)", spec.heads),
        KvKind::Mla => {
            let mla = spec.mla().expect("MLA kind has MLA parameters");
            format!(
                "MLA (latent {} + rope key {}, shared by {} heads)",
                mla.latent_rank, mla.rope_dim, spec.heads
            )
        }
    }
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

fn human_flops(n: u64) -> String {
    let g = n as f64 / 1e9;
    if g >= 1000.0 {
        format!("{:.2} TFLOP", g / 1000.0)
    } else if g >= 1.0 {
        format!("{g:.2} GFLOP")
    } else {
        format!("{:.2} MFLOP", n as f64 / 1e6)
    }
}

fn group_digits(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push('_');
        }
        out.push(c);
    }
    out
}
