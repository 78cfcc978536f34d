//! `loss.svg`: training and validation loss against steps (plotters, SVG text: no fonts read).

use super::state::Metrics;
use plotters::prelude::*;
use std::path::Path;

/// Draws the curves of `metrics` into `path`.
pub fn loss_curves(path: &Path, metrics: &[Metrics]) -> Result<(), String> {
    let fail = |e: String| format!("error: cannot draw {}: {e}", path.display());
    let last = metrics.iter().map(|m| m.step).max().unwrap_or(1).max(1) as f64;
    let losses = metrics.iter().flat_map(|m| [m.train_loss, m.val_loss]);
    let (lo, hi) = losses
        .filter(|l| l.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), l| {
            (lo.min(l), hi.max(l))
        });
    let (lo, hi) = if lo <= hi {
        (lo * 0.95, hi * 1.05 + 1e-9)
    } else {
        (0.0, 1.0)
    };
    let root = SVGBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("loss (nats per token)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(48)
        .build_cartesian_2d(0f64..last, lo..hi)
        .map_err(|e| fail(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    for (name, colour, value) in [
        (
            "train",
            BLUE,
            (|m: &Metrics| m.train_loss) as fn(&Metrics) -> f64,
        ),
        ("validation", RED, |m: &Metrics| m.val_loss),
    ] {
        let points: Vec<(f64, f64)> = metrics.iter().map(|m| (m.step as f64, value(m))).collect();
        chart
            .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))
            .map_err(|e| fail(e.to_string()))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
        chart
            .draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 3, colour.filled())),
            )
            .map_err(|e| fail(e.to_string()))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    root.present().map_err(|e| fail(e.to_string()))
}
