//! Loss curves as SVG (plotters, SVG text: no fonts read): `attnc train`'s `loss.svg`, and the
//! line chart `attnc sweep` draws its validation curves with.

use super::state::Metrics;
use plotters::prelude::*;
use std::path::Path;

/// One curve: its legend, its colour and its `(step, loss)` points.
pub struct Series {
    pub name: String,
    pub colour: RGBAColor,
    pub points: Vec<(f64, f64)>,
}

/// `loss.svg`: the training and validation loss of `metrics` against steps.
pub fn loss_curves(path: &Path, metrics: &[Metrics]) -> Result<(), String> {
    let series = |name: &str, colour: RGBColor, value: fn(&Metrics) -> f64| Series {
        name: name.into(),
        colour: colour.to_rgba(),
        points: metrics.iter().map(|m| (m.step as f64, value(m))).collect(),
    };
    line_chart(
        path,
        "loss (nats per token)",
        &[
            series("train", BLUE, |m| m.train_loss),
            series("validation", RED, |m| m.val_loss),
        ],
    )
}

/// Draws `series` against steps into `path` under `caption`, each a line with its points,
/// with a legend.
pub fn line_chart(path: &Path, caption: &str, series: &[Series]) -> Result<(), String> {
    let fail = |e: String| format!("error: cannot draw {}: {e}", path.display());
    let points = || series.iter().flat_map(|s| s.points.iter());
    let last = points().map(|p| p.0).fold(1.0, f64::max);
    let (lo, hi) = points()
        .map(|p| p.1)
        .filter(|l| l.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), l| {
            (lo.min(l), hi.max(l))
        });
    let (lo, hi) = if lo <= hi {
        (lo * 0.98, hi * 1.02 + 1e-9)
    } else {
        (0.0, 1.0)
    };
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(52)
        .build_cartesian_2d(0f64..last, lo..hi)
        .map_err(|e| fail(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss (nats per token)")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.3}"))
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    for s in series {
        let colour = s.colour;
        chart
            .draw_series(LineSeries::new(s.points.clone(), colour.stroke_width(2)))
            .map_err(|e| fail(e.to_string()))?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, colour.filled())))
            .map_err(|e| fail(e.to_string()))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    root.present().map_err(|e| fail(e.to_string()))
}
