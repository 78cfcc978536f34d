//! A sweep's plots (plotters, SVG text: no fonts read): validation curves, KV bytes against
//! loss, and measured speeds.

use super::report::Row;
use crate::train::plot::{Series, line_chart};
use plotters::prelude::*;
use std::path::Path;

type Fail = Box<dyn Fn(String) -> String>;

/// A measured quantity of a row.
type Measure = fn(&Row) -> f64;

/// An axis label: whole numbers from 100 up, fewer decimals the larger the value.
fn tick(v: &f64) -> String {
    match v.abs() {
        a if a >= 100.0 || a == 0.0 => format!("{v:.0}"),
        a if a >= 1.0 => format!("{v:.1}"),
        _ => format!("{v:.2}"),
    }
}

fn failure(path: &Path) -> Fail {
    let shown = path.display().to_string();
    Box::new(move |e| format!("error: cannot draw {shown}: {e}"))
}

/// The range of `values` with 5% room each side (0..1 when there are none).
fn padded(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        return (0.0, 1.0);
    }
    let room = ((hi - lo) * 0.05).max(hi.abs() * 0.01).max(1e-9);
    (lo - room, hi + room)
}

/// `loss.svg`: each variant's mean validation curve over its seeds, one colour each.
pub fn loss(path: &Path, rows: &[Row]) -> Result<(), String> {
    let series: Vec<Series> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| Series {
            name: r.variant.clone(),
            colour: Palette99::pick(i).to_rgba(),
            points: r
                .mean_curve()
                .into_iter()
                .map(|(s, l)| (s as f64, l))
                .collect(),
        })
        .collect();
    line_chart(path, "validation loss (mean over seeds)", &series)
}

/// `pareto.svg`: KV-cache bytes per token against validation loss, a labelled point per
/// variant with its spread over seeds, and the frontier of variants no other beats on both.
pub fn pareto(path: &Path, rows: &[Row]) -> Result<(), String> {
    let fail = failure(path);
    let kv = |r: &Row| r.cost.kv_bytes_per_token as f64;
    let (x_lo, x_hi) = padded(rows.iter().map(kv).chain([0.0]));
    let (lo, hi) = padded(
        rows.iter()
            .flat_map(|r| [r.val_loss - r.val_loss_std, r.val_loss + r.val_loss_std]),
    );
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("KV cache against validation loss", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(52)
        // Room on the right for the labels of the widest-cached variants.
        .build_cartesian_2d(x_lo.max(0.0)..x_hi + 0.4 * (x_hi - x_lo.max(0.0)), lo..hi)
        .map_err(|e| fail(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("KV-cache bytes per token (all layers)")
        .y_desc("validation loss")
        .x_label_formatter(&tick)
        .y_label_formatter(&|v| format!("{v:.3}"))
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    let mut frontier: Vec<(f64, f64)> = rows
        .iter()
        .filter(|r| {
            !rows.iter().any(|o| {
                kv(o) <= kv(r)
                    && o.val_loss <= r.val_loss
                    && (kv(o) < kv(r) || o.val_loss < r.val_loss)
            })
        })
        .map(|r| (kv(r), r.val_loss))
        .collect();
    frontier.sort_by(|a, b| a.0.total_cmp(&b.0));
    chart
        .draw_series(LineSeries::new(frontier, BLACK.mix(0.4).stroke_width(1)))
        .map_err(|e| fail(e.to_string()))?;
    for (i, r) in rows.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        let (x, y) = (kv(r), r.val_loss);
        chart
            .draw_series([PathElement::new(
                vec![(x, y - r.val_loss_std), (x, y + r.val_loss_std)],
                colour.stroke_width(2),
            )])
            .map_err(|e| fail(e.to_string()))?;
        // Variants with the same cache share a column: their labels are stacked, in order of
        // loss, so none covers another.
        let below = rows
            .iter()
            .filter(|o| kv(o) == x && (o.val_loss, &o.variant) < (y, &r.variant))
            .count() as i32;
        let label = EmptyElement::at((x, y))
            + Circle::new((0, 0), 5, colour.filled())
            + Text::new(
                r.variant.clone(),
                (10, 14 * below - 6),
                ("sans-serif", 13).into_font().color(&BLACK),
            );
        chart
            .draw_series([label])
            .map_err(|e| fail(e.to_string()))?;
    }
    root.present().map_err(|e| fail(e.to_string()))
}

/// `speed.svg`: per variant, training tokens/s, prefill GFLOP/s and decode tokens/s as bars.
pub fn speed(path: &Path, rows: &[Row]) -> Result<(), String> {
    let fail = failure(path);
    let longest = rows
        .iter()
        .map(|r| r.variant.chars().count())
        .max()
        .unwrap_or(4);
    let label_width = (longest as u32 * 7 + 16).min(360);
    let height = 120 + 28 * rows.len() as u32;
    let root = SVGBackend::new(path, (label_width + 3 * 260, height.min(4000))).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let (names, panels) = root.split_horizontally(label_width);
    let panels = panels.split_evenly((1, 3));
    let measures: [(&str, Measure); 3] = [
        ("training tokens/s", |r| r.train_tokens_per_s),
        ("prefill GFLOP/s", |r| r.speed.prefill_gflops),
        ("decode tokens/s", |r| r.speed.decode_tokens_per_s),
    ];
    let n = rows.len().max(1);
    for (panel, (title, value)) in panels.iter().zip(measures) {
        let top = rows
            .iter()
            .map(value)
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max);
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .build_cartesian_2d(0f64..(top * 1.1).max(1e-9), 0f64..n as f64)
            .map_err(|e| fail(e.to_string()))?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .disable_y_axis()
            .x_labels(4)
            .x_label_formatter(&tick)
            .draw()
            .map_err(|e| fail(e.to_string()))?;
        chart
            .draw_series(rows.iter().enumerate().map(|(i, r)| {
                let y = (n - 1 - i) as f64;
                Rectangle::new(
                    [(0.0, y + 0.15), (value(r).max(0.0), y + 0.85)],
                    Palette99::pick(i).filled(),
                )
            }))
            .map_err(|e| fail(e.to_string()))?;
    }
    // The names, one per bar row: the panels' plot areas start below a caption (about 16 px
    // and the margin) and end above the x labels.
    let (plot_top, plot_bottom) = (10 + 16 + 10, height as i32 - 10 - 30);
    let row_height = (plot_bottom - plot_top) as f64 / n as f64;
    for (i, r) in rows.iter().enumerate() {
        let y = plot_top + (row_height * (i as f64 + 0.5)) as i32 - 6;
        names
            .draw(&Text::new(
                r.variant.clone(),
                (8, y),
                ("sans-serif", 13).into_font().color(&BLACK),
            ))
            .map_err(|e| fail(e.to_string()))?;
    }
    root.present().map_err(|e| fail(e.to_string()))
}
