//! A sweep's plots (plotters, SVG text: no fonts read): validation curves, KV bytes against
//! loss, and measured speeds.

use super::report::Row;
use crate::train::plot::{Series, line_chart};
use plotters::prelude::*;

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

/// The error of drawing the plot `name`.
fn failure(name: &'static str) -> impl Fn(String) -> String {
    move |e| format!("error: cannot draw {name}: {e}")
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
pub fn loss(rows: &[Row]) -> Result<String, String> {
    let series: Vec<Series> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| Series {
            name: r.variant.clone(),
            colour: Palette99::pick(i).to_rgba(),
            width: 2,
            dots: true,
            points: r
                .mean_curve()
                .into_iter()
                .map(|(s, l)| (s as f64, l))
                .collect(),
        })
        .collect();
    line_chart("validation loss (mean over seeds)", &series)
}

/// Width of the pareto plot's chart and of its key beside it, in pixels.
const PARETO_CHART: u32 = 620;
const PARETO_KEY: u32 = 300;

/// `pareto.svg`: the KV cache at the training context against validation loss: a numbered
/// point per variant (with its spread over seeds where there are several), the frontier of
/// variants no other beats on both, and a key of the numbers beside the chart.
pub fn pareto(rows: &[Row]) -> Result<String, String> {
    let fail = failure("pareto.svg");
    let kv = |r: &Row| r.cost.kv_cache_bytes as f64;
    let (x_lo, x_hi) = padded(rows.iter().map(kv).chain([0.0]));
    let (lo, hi) = padded(
        rows.iter()
            .flat_map(|r| [r.val_loss - r.val_loss_std, r.val_loss + r.val_loss_std]),
    );
    let key_rows = rows.len() as u32;
    let height = (480).max(60 + 18 * key_rows).min(4000);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (PARETO_CHART + PARETO_KEY, height))
            .into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
        let (left, key) = root.split_horizontally(PARETO_CHART);
        let mut chart = ChartBuilder::on(&left)
            .caption("KV cache against validation loss", ("sans-serif", 20))
            .margin(12)
            .margin_right(24)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(x_lo.max(0.0)..x_hi, lo..hi)
            .map_err(|e| fail(e.to_string()))?;
        chart
            .configure_mesh()
            .x_desc("KV-cache bytes at the training context (all layers)")
            .y_desc("validation loss")
            .x_labels(6)
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
            if r.curves.len() > 1 {
                chart
                    .draw_series([PathElement::new(
                        vec![(x, y - r.val_loss_std), (x, y + r.val_loss_std)],
                        colour.stroke_width(2),
                    )])
                    .map_err(|e| fail(e.to_string()))?;
            }
            // The number sits right of its own point, so it names that point whatever the
            // others nearby.
            let point = EmptyElement::at((x, y))
                + Circle::new((0, 0), 5, colour.filled())
                + Text::new(
                    format!("{}", i + 1),
                    (8, -6),
                    ("sans-serif", 13).into_font().color(&BLACK),
                );
            chart
                .draw_series([point])
                .map_err(|e| fail(e.to_string()))?;
        }
        for (i, r) in rows.iter().enumerate() {
            let y = 40 + 18 * i as i32;
            let colour = Palette99::pick(i).to_rgba();
            key.draw(&Circle::new((12, y), 5, colour.filled()))
                .map_err(|e| fail(e.to_string()))?;
            let name: String = r.shown_name().chars().take(44).collect();
            key.draw(&Text::new(
                format!("{}  {name}", i + 1),
                (24, y - 7),
                ("sans-serif", 13).into_font().color(&BLACK),
            ))
            .map_err(|e| fail(e.to_string()))?;
        }
        root.present().map_err(|e| fail(e.to_string()))?;
    }
    Ok(svg)
}

/// `speed.svg`: per variant, training tokens/s, prefill GFLOP/s and decode tokens/s as bars.
pub fn speed(rows: &[Row]) -> Result<String, String> {
    let fail = failure("speed.svg");
    let longest = rows
        .iter()
        .map(|r| r.variant.chars().count())
        .max()
        .unwrap_or(4);
    let label_width = (longest as u32 * 7 + 16).min(360);
    let height = (120 + 28 * rows.len() as u32).min(4000);
    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (label_width + 3 * 260, height)).into_drawing_area();
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
                // Room for the last tick's label, which is centred on the panel's edge.
                .margin_right(24)
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
        // The names, one per bar row: the panels' plot areas start below a caption (about 16
        // px and the margin) and end above the x labels.
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
        root.present().map_err(|e| fail(e.to_string()))?;
    }
    Ok(svg)
}
