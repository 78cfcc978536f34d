//! `attnc ir --svg`: a picture of a spec's mask at a call shape. Each cell shows which (query,
//! key) pairs are kept (dark: all, light: none, grey between: a share), over the kernel's
//! tiles, coloured by what the kernel does with them: skip, run unmasked, or mask per element.

use crate::call_data::CallData;
use attn::AttentionSpec;
use attn::codegen::KernelPlan;
use attn::dsl::modifier::ParamValues;
use attn::dsl::modifier::interval::TileClass;
use attn::dsl::reference::{Pair, pair_score_with};
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
fn kept(spec: &AttentionSpec, data: &[ParamValues], sq: u64, skv: u64, i: u64, j: u64) -> bool {
    let pos_q = skv as i64 - sq as i64 + i as i64;
    let at = Pair {
        b: 0,
        h: 0,
        pos_q,
        pos_k: j as i64,
        i: i as usize,
        j: j as usize,
    };
    pair_score_with(spec, 0.0, at, data).is_some()
}

/// The share of kept pairs among rows `rows` and keys `keys`: all of them when few, else a
/// grid of samples.
fn share(
    spec: &AttentionSpec,
    data: &[ParamValues],
    sq: u64,
    skv: u64,
    rows: (u64, u64),
    keys: (u64, u64),
) -> f64 {
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
        .filter(|&(i, j)| kept(spec, data, sq, skv, i, j))
        .count();
    kept_count as f64 / (is.len() * js.len()) as f64
}

/// A step for about `most` ticks over `0..n`: 1, 2 or 5 times a power of ten.
fn tick_step(n: u64, most: u64) -> u64 {
    let mut step = 1;
    loop {
        for m in [1, 2, 5] {
            if n / (step * m) <= most {
                return step * m;
            }
        }
        step *= 10;
    }
}

/// `text` in lines of at most `width` characters, broken at spaces (a longer word stands
/// alone).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split(' ') {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    lines.push(line);
    lines
}

/// The picture's width in pixels besides the cells, and the most characters a text line
/// holds at the size used (about 6.6 px a character).
const MARGIN: u32 = 70;
const CHARS_PER_PX: f64 = 1.0 / 6.6;

/// Draws the mask of `spec` at `sq` queries and `skv` keys into `path` (written whole).
pub fn draw(
    spec: &AttentionSpec,
    sq: u64,
    skv: u64,
    data: Option<&CallData>,
    path: &Path,
) -> Result<(), String> {
    let svg = picture(spec, sq, skv, data)
        .map_err(|e| format!("error: --svg {}: {e}", path.display()))?;
    crate::outputs::write_whole(path, svg.as_bytes())
}

/// The lines above the picture: the spec, the call's shape and what the kernel does with its
/// tiles, wrapped at `chars`.
fn heading(
    spec: &AttentionSpec,
    [sq, skv]: [u64; 2],
    [tile_q, tile_k]: [u64; 2],
    tiles: &attn::codegen::plan::TileMap,
    chars: usize,
) -> Vec<String> {
    let mut lines = wrap(&format!("mask of `{spec}`"), chars);
    lines.extend(wrap(
        &format!(
            "Sq = {sq}, Skv = {skv} (queries are the last Sq positions); the kernel's tiles of \
             {tile_q} queries x {tile_k} keys: {} skipped, {} unmasked, {} masked per element",
            tiles.count(TileClass::AllMasked),
            tiles.count(TileClass::AllKept),
            tiles.count(TileClass::Mixed)
        ),
        chars,
    ));
    lines
}

/// The picture of the mask of `spec` at `sq` queries and `skv` keys, as SVG text.
fn picture(
    spec: &AttentionSpec,
    sq: u64,
    skv: u64,
    data: Option<&CallData>,
) -> Result<String, String> {
    let plan = KernelPlan::forward(spec);
    let tiles = match data {
        Some(d) => d.tile_map(sq, skv),
        None => plan.tile_map(sq, skv, 0),
    };
    let values = data.map_or(&[][..], |d| d.values.as_slice());
    let (tile_q, tile_k) = (u64::from(plan.tiles.q_rows), u64::from(plan.tiles.k_cols));
    let (cells_q, cells_k) = (sq.min(MAX_CELLS), skv.min(MAX_CELLS));
    let px = (f64::from(SIDE) / cells_q.max(cells_k) as f64).max(1.0);
    let (width, height) = ((cells_k as f64 * px) as u32, (cells_q as f64 * px) as u32);
    let total_width = (width + MARGIN + 30).max(SIDE + MARGIN + 30);
    let chars = (f64::from(total_width - 16) * CHARS_PER_PX) as usize;
    let heading = heading(spec, [sq, skv], [tile_q, tile_k], &tiles, chars);
    let legend_y = 8 + 16 * heading.len() as i32 + 4;
    let (left, top) = (MARGIN, legend_y as u32 + 50);
    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (total_width, height + top + 20)).into_drawing_area();
        let fail = |e: DrawingAreaErrorKind<std::io::Error>| e.to_string();
        root.fill(&WHITE).map_err(fail)?;
        // Pixel coordinates of query row `i` and key `j`.
        let y = |i: u64| top as i32 + (i as f64 * height as f64 / sq as f64) as i32;
        let x = |j: u64| left as i32 + (j as f64 * width as f64 / skv as f64) as i32;
        let colour = |class: TileClass| match class {
            TileClass::AllMasked => RGBColor(225, 225, 225),
            TileClass::AllKept => RGBColor(130, 200, 135),
            TileClass::Mixed => RGBColor(250, 180, 90),
        };
        let kept_colour = RGBColor(25, 50, 110);
        let tile_corners = |r: u64, c: u64| {
            [
                (x(c * tile_k), y(r * tile_q)),
                (
                    x(((c + 1) * tile_k).min(skv)),
                    y(((r + 1) * tile_q).min(sq)),
                ),
            ]
        };
        for (r, row) in tiles.classes.iter().enumerate() {
            for (c, &class) in row.iter().enumerate() {
                let corners = tile_corners(r as u64, c as u64);
                root.draw(&Rectangle::new(corners, colour(class).filled()))
                    .map_err(fail)?;
            }
        }
        // The kept pairs, half transparent so each tile's colour shows through: one rectangle
        // per run of cells of equal share along a row.
        for a in 0..cells_q {
            let rows = (a * sq / cells_q, (a + 1) * sq / cells_q);
            let keys = |b: u64| (b * skv / cells_k, (b + 1) * skv / cells_k);
            let shares: Vec<f64> = (0..cells_k)
                .map(|b| share(spec, values, sq, skv, rows, keys(b)))
                .collect();
            let mut start = 0;
            for b in 1..=cells_k as usize {
                if b < shares.len() && shares[b] == shares[start] {
                    continue;
                }
                let s = shares[start];
                if s > 0.0 {
                    let corners = [
                        (x(keys(start as u64).0), y(rows.0)),
                        (x(keys(b as u64 - 1).1), y(rows.1)),
                    ];
                    let shade = kept_colour.mix(0.2 + 0.45 * s);
                    root.draw(&Rectangle::new(corners, shade.filled()))
                        .map_err(fail)?;
                }
                start = b;
            }
        }
        // Tile borders over everything.
        for r in 0..tiles.classes.len() as u64 {
            for c in 0..tiles.classes.first().map_or(0, Vec::len) as u64 {
                let corners = tile_corners(r, c);
                root.draw(&Rectangle::new(corners, BLACK.mix(0.6).stroke_width(1)))
                    .map_err(fail)?;
            }
        }
        let font = |size: u32| ("sans-serif", size).into_font();
        for (i, line) in heading.iter().enumerate() {
            root.draw(&Text::new(line.clone(), (8, 6 + 16 * i as i32), font(12)))
                .map_err(fail)?;
        }
        // The legend: a swatch and its words.
        let items = [
            (colour(TileClass::AllMasked).mix(1.0), "tile skipped"),
            (colour(TileClass::AllKept).mix(1.0), "tile run unmasked"),
            (colour(TileClass::Mixed).mix(1.0), "tile masked per element"),
            (kept_colour.mix(0.65), "kept (query, key) pairs"),
        ];
        let mut at = 8;
        for (swatch, words) in items {
            root.draw(&Rectangle::new(
                [(at, legend_y), (at + 14, legend_y + 12)],
                swatch.filled(),
            ))
            .map_err(fail)?;
            root.draw(&Text::new(words, (at + 18, legend_y), font(12)))
                .map_err(fail)?;
            at += 18 + (words.len() as i32 * 7) + 16;
        }
        // Position ticks: keys along the top, query rows down the left.
        let tick_font = font(11);
        let key_step = tick_step(skv, 8);
        for j in (0..=skv).step_by(key_step as usize) {
            root.draw(&PathElement::new(
                vec![(x(j), top as i32 - 4), (x(j), top as i32)],
                BLACK,
            ))
            .map_err(fail)?;
            root.draw(&Text::new(
                j.to_string(),
                (x(j) - 6, top as i32 - 18),
                tick_font.clone(),
            ))
            .map_err(fail)?;
        }
        let query_step = tick_step(sq, 8);
        for i in (0..=sq).step_by(query_step as usize) {
            root.draw(&PathElement::new(
                vec![(left as i32 - 4, y(i)), (left as i32, y(i))],
                BLACK,
            ))
            .map_err(fail)?;
            root.draw(&Text::new(
                i.to_string(),
                (left as i32 - 40, y(i) - 6),
                tick_font.clone(),
            ))
            .map_err(fail)?;
        }
        root.draw(&Text::new("key", (left as i32, top as i32 - 34), font(12)))
            .map_err(fail)?;
        root.draw(&Text::new("query", (8, top as i32 - 18), font(12)))
            .map_err(fail)?;
        root.present().map_err(fail)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_and_lines_fit() {
        assert_eq!(tick_step(256, 8), 50);
        assert_eq!(tick_step(1024, 8), 200);
        assert_eq!(tick_step(7, 8), 1);
        assert_eq!(tick_step(64, 8), 10);
        let lines = wrap("a bb ccc dddd eeeee", 8);
        assert_eq!(lines, ["a bb ccc", "dddd", "eeeee"]);
        assert!(wrap(&"word ".repeat(100), 40).iter().all(|l| l.len() <= 40));
    }
}
