//! `attnc ir --svg`: a picture of a spec's mask at a call shape. Each cell shows which (query,
//! key) pairs are kept (dark: all, light: none, grey between: a share), over the kernel's
//! tiles, coloured by what the kernel does with them: skip, run unmasked, or mask per element.

use attn::AttentionSpec;
use attn::codegen::KernelPlan;
use attn::dsl::modifier::interval::TileClass;
use attn::dsl::reference::{Pair, pair_score};
use plotters::prelude::*;
use std::path::Path;

/// Most cells a side: past it, a cell covers a block of pairs.
const MAX_CELLS: u64 = 256;
/// Pairs sampled along each side of a cell that covers more (a grid of them).
const SAMPLES: u64 = 8;
/// The drawing's side, in pixels, for the cells.
const SIDE: u32 = 640;

/// Whether the pair (query row `i`, key `j`) of a call with `sq` queries and `skv` keys is kept
/// (batch 0, head 0, key 0 at position 0).
fn kept(spec: &AttentionSpec, sq: u64, skv: u64, i: u64, j: u64) -> bool {
    let pos_q = skv as i64 - sq as i64 + i as i64;
    let at = Pair {
        b: 0,
        h: 0,
        pos_q,
        pos_k: j as i64,
        i: i as usize,
        j: j as usize,
    };
    pair_score(spec, 0.0, at).is_some()
}

/// The share of kept pairs among rows `rows` and keys `keys`: all of them when few, else a
/// grid of samples.
fn share(spec: &AttentionSpec, sq: u64, skv: u64, rows: (u64, u64), keys: (u64, u64)) -> f64 {
    let picks = |(lo, hi): (u64, u64)| -> Vec<u64> {
        let n = hi - lo;
        if n <= SAMPLES {
            (lo..hi).collect()
        } else {
            (0..SAMPLES)
                .map(|s| lo + s * n / SAMPLES + n / (2 * SAMPLES))
                .collect()
        }
    };
    let (is, js) = (picks(rows), picks(keys));
    let kept_count = is
        .iter()
        .flat_map(|&i| js.iter().map(move |&j| (i, j)))
        .filter(|&(i, j)| kept(spec, sq, skv, i, j))
        .count();
    kept_count as f64 / (is.len() * js.len()) as f64
}

/// Draws the mask of `spec` at `sq` queries and `skv` keys into `path`.
pub fn draw(spec: &AttentionSpec, sq: u64, skv: u64, path: &Path) -> Result<(), String> {
    let fail = |e: String| format!("error: --svg {}: {e}", path.display());
    let plan = KernelPlan::forward(spec);
    let tiles = plan.tile_map(sq, skv, 0);
    let (tile_q, tile_k) = (u64::from(plan.tiles.q_rows), u64::from(plan.tiles.k_cols));
    let (cells_q, cells_k) = (sq.min(MAX_CELLS), skv.min(MAX_CELLS));
    let px = (f64::from(SIDE) / cells_q.max(cells_k) as f64).max(1.0);
    let (width, height) = ((cells_k as f64 * px) as u32, (cells_q as f64 * px) as u32);
    let (left, top) = (60u32, 70u32);
    let root = SVGBackend::new(path, (width + left + 20, height + top + 20)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    // Pixel coordinates of query row `i` and key `j`.
    let y = |i: u64| top as i32 + (i as f64 * height as f64 / sq as f64) as i32;
    let x = |j: u64| left as i32 + (j as f64 * width as f64 / skv as f64) as i32;
    let colour = |class: TileClass| match class {
        TileClass::AllMasked => RGBColor(235, 235, 235),
        TileClass::AllKept => RGBColor(200, 230, 201),
        TileClass::Mixed => RGBColor(255, 224, 178),
    };
    for (r, row) in tiles.classes.iter().enumerate() {
        for (c, &class) in row.iter().enumerate() {
            let (r, c) = (r as u64, c as u64);
            let corners = [
                (x(c * tile_k), y(r * tile_q)),
                (
                    x(((c + 1) * tile_k).min(skv)),
                    y(((r + 1) * tile_q).min(sq)),
                ),
            ];
            root.draw(&Rectangle::new(corners, colour(class).filled()))
                .map_err(|e| fail(e.to_string()))?;
            root.draw(&Rectangle::new(
                corners,
                RGBColor(120, 120, 120).stroke_width(1),
            ))
            .map_err(|e| fail(e.to_string()))?;
        }
    }
    // One rectangle per run of cells of equal share along a row.
    for a in 0..cells_q {
        let rows = (a * sq / cells_q, (a + 1) * sq / cells_q);
        let keys = |b: u64| (b * skv / cells_k, (b + 1) * skv / cells_k);
        let shares: Vec<f64> = (0..cells_k)
            .map(|b| share(spec, sq, skv, rows, keys(b)))
            .collect();
        let mut start = 0;
        for b in 1..=cells_k as usize {
            if b < shares.len() && shares[b] == shares[start] {
                continue;
            }
            let s = shares[start];
            if s > 0.0 {
                let shade = RGBColor(25, 50, 110).mix(0.25 + 0.6 * s);
                let corners = [
                    (x(keys(start as u64).0), y(rows.0)),
                    (x(keys(b as u64 - 1).1), y(rows.1)),
                ];
                root.draw(&Rectangle::new(corners, shade.filled()))
                    .map_err(|e| fail(e.to_string()))?;
            }
            start = b;
        }
    }
    let text = |s: String, at: (i32, i32), size: u32| {
        root.draw(&Text::new(s, at, ("sans-serif", size).into_font()))
            .map_err(|e| fail(e.to_string()))
    };
    text(format!("mask of `{spec}`"), (8, 6), 12)?;
    text(
        format!(
            "Sq = {sq}, Skv = {skv}; tiles of {tile_q} x {tile_k}: {} skipped (grey), {} unmasked \
             (green), {} masked per element (orange); blue: kept pairs",
            tiles.count(TileClass::AllMasked),
            tiles.count(TileClass::AllKept),
            tiles.count(TileClass::Mixed)
        ),
        (8, 26),
        12,
    )?;
    text("keys ->".into(), (left as i32, top as i32 - 16), 12)?;
    text("queries".into(), (4, top as i32), 12)?;
    root.present().map_err(|e| fail(e.to_string()))
}
