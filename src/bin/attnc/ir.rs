//! `attnc ir`: each planning pass's output, in order.

use attn::AttentionSpec;
use attn::codegen::KernelPlan;
use attn::dsl::modifier::ScoreProgram;
use attn::dsl::modifier::interval::TileClass;

/// The report: spec, modifier IR as lowered and folded, kernel plan, and optionally the tile map
/// of a call with `(sq, skv)` queries and keys.
pub fn report(spec: &AttentionSpec, tiles_for: Option<(u64, u64)>) -> String {
    let program = ScoreProgram::of(spec);
    let plan = KernelPlan::forward(spec);
    let mut out = format!(
        "spec: {spec}\n\n-- modifier IR, lowered --\n{program}\n\n-- modifier IR, folded --\n{}\n\n\
         -- kernel plan --\n{plan}\n",
        program.folded()
    );
    if let Some((sq, skv)) = tiles_for {
        let map = plan.tile_map(sq, skv, 0);
        out += &format!(
            "\n-- tiles at Sq = {sq}, Skv = {skv} ({} all kept #, {} skipped ., {} mixed /) --\n{map}",
            map.count(TileClass::AllKept),
            map.count(TileClass::AllMasked),
            map.count(TileClass::Mixed)
        );
    }
    out
}
