//! Loss curves as SVG text (plotters, SVG text: no fonts read): `attnc train`'s `loss.svg`, and
//! the line chart `attnc sweep` draws its validation curves with. Callers write the text whole
//! (a temporary file and a rename), so a plot is never left cut short.

use super::state::{Metrics, StepLoss};
use plotters::prelude::*;

/// One curve: its legend, its colour, its line width, whether its points are marked, and its
/// `(step, loss)` points.
pub struct Series {
    pub name: String,
    pub colour: RGBAColor,
    pub width: u32,
    pub dots: bool,
    pub points: Vec<(f64, f64)>,
}

/// The steps the running mean of the training loss spans: a tenth of the steps so far,
/// between 1 and 100.
fn smoothing(steps: usize) -> usize {
    (steps / 10).clamp(1, 100)
}

/// Most points a per-step curve is drawn with: a long run's plot, redrawn at every
/// checkpoint, stays small and quick to make.
const MAX_POINTS: usize = 2000;

/// `points` with every `n`-th kept (and the last) when there are more than [`MAX_POINTS`].
fn thinned(points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    let n = points.len().div_ceil(MAX_POINTS);
    if n <= 1 {
        return points;
    }
    let last = points.last().copied();
    let mut kept: Vec<(f64, f64)> = points.into_iter().step_by(n).collect();
    if kept.last().copied() != last {
        kept.extend(last);
    }
    kept
}

/// `loss.svg`: the training loss of every step, its running mean, and the validation loss at
/// each evaluation (every `eval_every` steps and the last).
pub fn loss_curves(
    metrics: &[Metrics],
    losses: &[StepLoss],
    eval_every: u64,
) -> Result<String, String> {
    let k = smoothing(losses.len());
    let mean: Vec<(f64, f64)> = losses
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let window = &losses[(i + 1).saturating_sub(k)..=i];
            let sum: f64 = window.iter().map(|w| w.loss).sum();
            (l.step as f64, sum / window.len() as f64)
        })
        .collect();
    let mut series = vec![Series {
        name: "training loss, each step".into(),
        colour: if k > 1 {
            BLUE.mix(0.35)
        } else {
            BLUE.to_rgba()
        },
        width: if k > 1 { 1 } else { 2 },
        dots: false,
        points: thinned(losses.iter().map(|l| (l.step as f64, l.loss)).collect()),
    }];
    // A mean over one step is the step itself: drawn only over several.
    if k > 1 {
        series.push(Series {
            name: format!("training loss, mean of the last {k} steps"),
            colour: BLUE.to_rgba(),
            width: 2,
            dots: false,
            points: thinned(mean),
        });
    }
    series.push(Series {
        name: format!("validation loss, every {eval_every} steps"),
        colour: RED.to_rgba(),
        width: 2,
        dots: true,
        points: metrics
            .iter()
            .map(|m| (m.step as f64, m.val_loss))
            .collect(),
    });
    line_chart("loss (nats per token)", &series)
}

/// Draws `series` against steps under `caption`, each a line (with its points where the series
/// says), with a legend; returns the SVG text.
pub fn line_chart(caption: &str, series: &[Series]) -> Result<String, String> {
    let fail = |e: String| format!("error: cannot draw the loss curves: {e}");
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
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (800, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 20))
            .margin(12)
            .margin_right(28)
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
            let (colour, width) = (s.colour, s.width);
            chart
                .draw_series(LineSeries::new(
                    s.points.clone(),
                    colour.stroke_width(s.width),
                ))
                .map_err(|e| fail(e.to_string()))?
                .label(s.name.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(width))
                });
            if s.dots {
                chart
                    .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, colour.filled())))
                    .map_err(|e| fail(e.to_string()))?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| fail(e.to_string()))?;
        root.present().map_err(|e| fail(e.to_string()))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_curves_are_thinned_to_their_most_points_with_the_last_kept() {
        let points: Vec<(f64, f64)> = (0..10_001).map(|i| (i as f64, 1.0)).collect();
        let kept = thinned(points);
        assert!(kept.len() <= MAX_POINTS + 1, "{}", kept.len());
        assert_eq!(kept.first().unwrap().0, 0.0);
        assert_eq!(kept.last().unwrap().0, 10_000.0);
        assert_eq!(thinned(vec![(1.0, 2.0); 5]).len(), 5);
    }
}
