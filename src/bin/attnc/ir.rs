//! `attnc ir`: each planning pass's output, in order.

use crate::call_data::CallData;
use attn::AttentionSpec;
use attn::codegen::KernelPlan;
use attn::dsl::modifier::ScoreProgram;
use attn::dsl::modifier::interval::{Interval, Range, TileBounds, TileClass, analyze};
use attn::dsl::reference::MAX_POSITION;

/// `attnc ir`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// The spec, in the spec language, or @FILE to read it from a file.
    #[arg(allow_hyphen_values = true)]
    spec: String,
    /// Also print the tile map for this many queries (`#` all kept, `.` skipped, `/` mixed;
    /// at most 16384, a map of 256 x 256 tiles).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=16_384))]
    seq: Option<u64>,
    /// Keys for the tile map (default: as many as queries; at most 16384).
    #[arg(long, value_name = "N", requires = "seq", value_parser = clap::value_parser!(u64).range(1..=16_384))]
    kv_len: Option<u64>,
    /// Also draw the mask at --seq (and --kv-len) into this SVG file: kept pairs over the
    /// kernel's tiles, coloured by what the kernel does with each (skip, unmasked, masked).
    #[arg(long, value_name = "FILE", requires = "seq")]
    svg: Option<std::path::PathBuf>,
    /// The data tensors (`data(...)`, by name, in a safetensors file) the tile map and --svg
    /// classify tiles and draw the mask from: batch item 0 of a call at --seq, key 0 at
    /// position 0. Needed for a mask that reads data.
    #[arg(long, value_name = "FILE", requires = "seq")]
    data: Option<std::path::PathBuf>,
    /// Also print the derivative of the score program (what the backward pass multiplies
    /// by), its range, notes where it is only piecewise, the derivative with respect to each
    /// parameter read (params(...)), the sinks' gradient, and the backward kernel plan.
    #[arg(long)]
    grad: bool,
}

/// `attnc ir`.
pub fn command(args: Args) -> Result<(), String> {
    let (spec, _) = crate::spec_arg::load(&args.spec)?;
    let tiles_for = args.seq.map(|sq| (sq, args.kv_len.unwrap_or(sq)));
    let data = match (&args.data, tiles_for) {
        (Some(path), Some((sq, skv))) => Some(crate::call_data::read(&spec, path, sq, skv)?),
        _ => None,
    };
    let mask_reads_data = spec.mask_mod.as_ref().is_some_and(|m| {
        m.body
            .param_reads()
            .iter()
            .any(|r| spec.data_decl(&r.name).is_some())
    });
    if tiles_for.is_some() && mask_reads_data && data.is_none() {
        return Err(
            "error: the mask reads data tensors: give them with --data FILE for the tile map"
                .to_string(),
        );
    }
    if let (Some(path), Some((sq, skv))) = (&args.svg, tiles_for) {
        let mut inputs = crate::spec_arg::spec_file(&args.spec);
        inputs.extend(args.data.as_deref());
        crate::outputs::check(path, &inputs, "--svg")?;
        crate::mask_svg::draw(&spec, sq, skv, data.as_ref(), path)?;
    }
    print!("{}", report(&spec, tiles_for, data.as_ref(), args.grad));
    Ok(())
}

/// The report: spec, modifier IR as lowered and folded, kernel plan, and optionally the tile map
/// of a call with `(sq, skv)` queries and keys (classified from its data, where given).
fn report(
    spec: &AttentionSpec,
    tiles_for: Option<(u64, u64)>,
    data: Option<&CallData>,
    grad: bool,
) -> String {
    let program = ScoreProgram::of(spec);
    let plan = KernelPlan::forward(spec);
    let mut out = format!(
        "spec: {spec}\n\n-- modifier IR, lowered --\n{program}\n\n-- modifier IR, folded --\n{}\n\n\
         -- kernel plan --\n{plan}\n",
        program.folded()
    );
    if let Some(d) = spec.differential {
        out += &format!(
            "\n-- differential heads --\nthe plan above runs {} component heads; head h of {} \
             takes O_2h - lambda O_2h+1 (value heads: {}, each read by both components), \
             lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + {}\n",
            spec.heads,
            spec.output_heads(),
            spec.value_heads(),
            d.lambda_init
        );
    }
    if grad {
        out += &gradient_report(spec, &program);
    }
    if let Some((sq, skv)) = tiles_for {
        let map = match data {
            Some(d) => d.tile_map(sq, skv),
            None => plan.tile_map(sq, skv, 0),
        };
        out += &format!(
            "\n-- tiles at Sq = {sq}, Skv = {skv} ({} all kept #, {} skipped ., {} mixed /) --\n{map}",
            map.count(TileClass::AllKept),
            map.count(TileClass::AllMasked),
            map.count(TileClass::Mixed)
        );
    }
    out
}

/// The backward pass's view: `d score / d raw score` folded, its range by interval analysis
/// over every score and position, the notes on where it is only piecewise, and the backward
/// kernel plan.
fn gradient_report(spec: &AttentionSpec, program: &ScoreProgram) -> String {
    let gradient = match program.folded().score_gradient() {
        Ok(g) => g,
        Err(e) => return format!("\n-- d score / d raw score --\nnone: {e}\n"),
    };
    let everywhere = Interval::new(-MAX_POSITION, MAX_POSITION);
    let bounds = TileBounds::for_tile(everywhere, everywhere, MAX_POSITION, MAX_POSITION, 0);
    let range = match analyze(&gradient.expr, &bounds) {
        Range::Float { lo, hi, nan } => {
            format!("[{lo:?}, {hi:?}]{}", if nan { ", or NaN" } else { "" })
        }
        other => format!("{other:?}"),
    };
    let mut out = format!(
        "\n-- d score / d raw score (folded) --\n{}\nrange over every score and position: {range}\n",
        gradient.expr
    );
    for note in &gradient.notes {
        out += &format!("note: {note}\n");
    }
    match program.folded().param_gradients() {
        Ok(grads) => {
            for (read, d) in grads {
                let read = attn::dsl::modifier::Expr::Param(read);
                out += &format!("\n-- d score / d {read} (folded) --\n{d}\n");
            }
        }
        Err(e) => out += &format!("\n-- d score / d parameters --\nnone: {e}\n"),
    }
    if spec.sinks == attn::dsl::Sinks::Learned {
        out += "\n-- d score / d sinks --\nd sinks[h] = -sum over rows of exp(sinks[h] - lse) * \
                rowsum(dout * out)\n";
    }
    match KernelPlan::backward(spec) {
        // MLA's backward runs over the absorbed latent head; the chain rule around it is host
        // GEMMs.
        Ok(plan) => out += &format!("\n-- backward kernel plan --\n{plan}\n"),
        Err(e) => out += &format!("\n-- backward kernel plan --\nnone: {e}\n"),
    }
    out
}
