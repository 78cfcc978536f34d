//! `attnc check`: a spec validated and printed in normalized form, with notes on what the
//! backward pass will make of its score modifier and whether training can move its learnable
//! tensors from their start, and warnings where a data tensor is read at the query position
//! (which FlexAttention users index differently).

use crate::spec_arg;

/// `attnc check`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// The spec, in the spec language, or @FILE to read it from a file.
    #[arg(allow_hyphen_values = true)]
    spec: String,
}

/// `attnc check`.
pub fn command(args: Args) -> Result<(), String> {
    let (spec, source) = spec_arg::load(&args.spec)?;
    println!("{spec}");
    // What the backward pass will make of the score modifier, said at spec time, at the
    // tokens concerned.
    for note in attn::dsl::gradient_notes(&source) {
        eprint!("{}", note.render_as("note", &source));
    }
    for warning in attn::dsl::data::query_alignment_warnings(&spec) {
        eprintln!("warning: {warning}");
    }
    if let Some(note) = attn::dsl::initial::stuck_at_start(&spec) {
        eprintln!("note: training: {note}");
    }
    let program = attn::dsl::modifier::ScoreProgram::of(&spec).folded();
    if let Err(e) = program.score_gradient() {
        eprintln!("note: backward: no gradient: {e}");
    }
    Ok(())
}
