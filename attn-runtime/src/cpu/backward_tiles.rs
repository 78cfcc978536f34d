//! The backward's tile classification: each key tile's code and the live rows of its query
//! block, once per (batch item, block) for every head where the mask does not read the head.

use crate::placement::Piece;
use attn_dsl::modifier::interval::Interval;
use codegen::plan::{CallShape, DataRanges, K_TILE, KernelPlan, TileCode};
use rayon::prelude::*;

/// Key tile width and query block height of the backward.
const K: usize = K_TILE as usize;

/// Each key tile's code and live rows, per (batch item, query block): one classification for
/// every head, where the mask does not read the head; `None` where it does.
type Classes = Vec<Vec<TileClassed>>;

/// A key tile's code and the query rows of its block that can keep a key.
pub(super) type TileClassed = (TileCode, Option<Interval>);

/// The [`Classes`] of a call, classified in parallel; `None` for a mask that reads the head.
pub(super) fn shared_classes(
    plan: &KernelPlan,
    [batch, sq, skv]: [usize; 3],
    (position_offset, piece): (i64, Piece),
    data: Option<&DataRanges>,
) -> Option<Classes> {
    if plan.program.mask.uses(attn_dsl::modifier::Var::Head) {
        return None;
    }
    let blocks = sq.div_ceil(K);
    Some(
        (0..batch * blocks)
            .into_par_iter()
            .map(|i| {
                let (b, block) = (i / blocks, i % blocks);
                let call = CallShape {
                    sq: sq as i64,
                    skv: skv as i64,
                    p0: position_offset,
                    query_shift: piece.query_shift,
                    batch: Interval::point(b as i64),
                    head: Interval::point(piece.head0 as i64),
                    data,
                };
                (0..skv.div_ceil(K))
                    .map(|tile| classify(plan, call, block, tile, [sq, skv]))
                    .collect()
            })
            .collect(),
    )
}

/// The code of key tile `tile` for query block `block`, and its live rows.
pub(super) fn classify(
    plan: &KernelPlan,
    call: CallShape,
    block: usize,
    tile: usize,
    [sq, skv]: [usize; 2],
) -> TileClassed {
    let first_key = tile * K;
    let cols = (skv - first_key).min(K);
    let keys = Interval::new(first_key as i64, (first_key + cols - 1) as i64);
    let q0 = block * K;
    let span = Interval::new(q0 as i64, ((q0 + K).min(sq) - 1) as i64);
    let code = plan.tile_code(span, keys, call, cols == K);
    let live = match code {
        TileCode::Skip => None,
        TileCode::Full => Some(span),
        TileCode::Masked => plan.live_rows(span, keys, call),
    };
    (code, live)
}
