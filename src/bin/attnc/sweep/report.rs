//! A sweep's results: one row per variant, written as CSV, JSON lines, a terminal table and a
//! self-contained HTML page.

use super::measure::{Cost, Speed};
use crate::train::state::Metrics;
use serde_json::json;

/// One seed's run of a variant.
#[derive(Clone, Debug)]
pub struct Curve {
    pub seed: u64,
    pub points: Vec<Metrics>,
}

/// One variant's results.
#[derive(Clone, Debug)]
pub struct Row {
    pub variant: String,
    /// Its run folder, relative to the sweep's.
    pub folder: String,
    pub attention: String,
    pub cost: Cost,
    pub speed: Speed,
    /// Mean over seeds of each run's mean training throughput.
    pub train_tokens_per_s: f64,
    /// Mean and sample standard deviation over seeds of the last validation loss (0 for one
    /// seed).
    pub val_loss: f64,
    pub val_loss_std: f64,
    pub curves: Vec<Curve>,
    /// An attention kind has no mask (`mask = none`, no `mask_mod`): each position sees the
    /// tokens after it, so its loss does not compare with a language model's.
    pub sees_ahead: bool,
}

/// The note the table and page give rows that see ahead, after their marker.
const SEES_AHEAD: &str = "mask = none: each position also sees the tokens after it, the next \
    one among them, so its loss is not a language model's and does not compare with the others";

impl Row {
    /// The row of finished runs (`curves`, each with at least one evaluation).
    pub fn new(
        variant: String,
        folder: String,
        attention: String,
        cost: Cost,
        speed: Speed,
        curves: Vec<Curve>,
    ) -> Row {
        let finals: Vec<f64> = curves
            .iter()
            .filter_map(|c| c.points.last().map(|m| m.val_loss))
            .collect();
        let (val_loss, val_loss_std) = mean_std(&finals);
        let throughputs: Vec<f64> = curves
            .iter()
            .map(|c| mean_std(&c.points.iter().map(|m| m.tokens_per_s).collect::<Vec<_>>()).0)
            .collect();
        Row {
            variant,
            folder,
            attention,
            cost,
            speed,
            train_tokens_per_s: mean_std(&throughputs).0,
            val_loss,
            val_loss_std,
            curves,
            sees_ahead: false,
        }
    }

    /// The variant's name as the table shows it: marked when it sees ahead.
    pub fn shown_name(&self) -> String {
        match self.sees_ahead {
            true => format!("{} (*)", self.variant),
            false => self.variant.clone(),
        }
    }

    /// The validation loss as the table shows it: the mean and standard deviation over seeds,
    /// or the one seed's loss.
    pub fn loss_cell(&self) -> String {
        match self.curves.len() {
            1 => format!("{:.4} (1 seed)", self.val_loss),
            _ => format!("{:.4} ± {:.4}", self.val_loss, self.val_loss_std),
        }
    }

    /// The mean validation curve over seeds, at the steps every seed evaluated.
    pub fn mean_curve(&self) -> Vec<(u64, f64)> {
        let Some(first) = self.curves.first() else {
            return Vec::new();
        };
        first
            .points
            .iter()
            .filter_map(|p| {
                let losses: Option<Vec<f64>> = self
                    .curves
                    .iter()
                    .map(|c| {
                        c.points
                            .iter()
                            .find(|q| q.step == p.step)
                            .map(|q| q.val_loss)
                    })
                    .collect();
                losses.map(|l| (p.step, mean_std(&l).0))
            })
            .collect()
    }
}

/// Mean and sample standard deviation (0 for fewer than two values; NaN for none).
fn mean_std(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if values.len() < 2 {
        return (mean, 0.0);
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// The CSV columns, in order.
const COLUMNS: &str = "variant,attention,params,kv_bytes_per_token,kv_cache_bytes,\
    flops_per_token,train_tokens_per_s,prefill_gflops,decode_tokens_per_s,val_loss,val_loss_std,seeds,folder";

/// `results.csv`: a header and one line per row.
pub fn csv(rows: &[Row]) -> String {
    let mut out = format!("{COLUMNS}\n");
    for r in rows {
        out += &format!(
            "{},{},{},{},{},{},{:.1},{:.3},{:.1},{:.5},{:.5},{},{}\n",
            csv_field(&r.variant),
            csv_field(&r.attention),
            r.cost.params,
            r.cost.kv_bytes_per_token,
            r.cost.kv_cache_bytes,
            r.cost.flops_per_token,
            r.train_tokens_per_s,
            r.speed.prefill_gflops,
            r.speed.decode_tokens_per_s,
            r.val_loss,
            r.val_loss_std,
            r.curves.len(),
            csv_field(&r.folder),
        );
    }
    out
}

/// A field quoted when it holds a comma, a quote or a line break (RFC 4180).
fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}

/// `results.jsonl`: the CSV's fields plus every seed's curve, one line per row.
pub fn jsonl(rows: &[Row]) -> String {
    rows.iter()
        .map(|r| {
            let curves: Vec<_> = r
                .curves
                .iter()
                .map(|c| {
                    json!({
                        "seed": c.seed,
                        "step": c.points.iter().map(|m| m.step).collect::<Vec<_>>(),
                        "train_loss": c.points.iter().map(|m| m.train_loss).collect::<Vec<_>>(),
                        "val_loss": c.points.iter().map(|m| m.val_loss).collect::<Vec<_>>(),
                        "tokens_per_s": c.points.iter().map(|m| m.tokens_per_s).collect::<Vec<_>>(),
                    })
                })
                .collect();
            json!({
                "variant": r.variant,
                "attention": r.attention,
                "params": r.cost.params,
                "kv_bytes_per_token": r.cost.kv_bytes_per_token,
                "kv_cache_bytes": r.cost.kv_cache_bytes,
                "flops_per_token": r.cost.flops_per_token,
                "train_tokens_per_s": r.train_tokens_per_s,
                "prefill_gflops": r.speed.prefill_gflops,
                "decode_tokens_per_s": r.speed.decode_tokens_per_s,
                "val_loss": r.val_loss,
                "val_loss_std": r.val_loss_std,
                "folder": r.folder,
                "curves": curves,
            })
            .to_string()
                + "\n"
        })
        .collect()
}

/// The rows sorted by validation loss, lowest first.
pub fn by_loss(rows: &[Row]) -> Vec<&Row> {
    let mut sorted: Vec<&Row> = rows.iter().collect();
    sorted.sort_by(|a, b| a.val_loss.total_cmp(&b.val_loss));
    sorted
}

/// The table's header and cells, sorted by validation loss.
fn cells(rows: &[Row]) -> (Vec<&'static str>, Vec<Vec<String>>) {
    let header = vec![
        "variant",
        "val loss",
        "params",
        "KV B/token",
        "KV bytes at seq",
        "MFLOP/token",
        "train tok/s",
        "prefill GFLOP/s",
        "decode tok/s",
    ];
    let body = by_loss(rows)
        .into_iter()
        .map(|r| {
            vec![
                r.shown_name(),
                r.loss_cell(),
                r.cost.params.to_string(),
                r.cost.kv_bytes_per_token.to_string(),
                r.cost.kv_cache_bytes.to_string(),
                format!("{:.2}", r.cost.flops_per_token as f64 / 1e6),
                format!("{:.0}", r.train_tokens_per_s),
                format!("{:.2}", r.speed.prefill_gflops),
                format!("{:.0}", r.speed.decode_tokens_per_s),
            ]
        })
        .collect();
    (header, body)
}

/// The terminal table, sorted by validation loss, columns aligned.
pub fn table(rows: &[Row]) -> String {
    let (header, body) = cells(rows);
    let width = |i: usize| {
        body.iter()
            .map(|r| r[i].chars().count())
            .chain([header[i].len()])
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..header.len()).map(width).collect();
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, w))| {
                let pad = " ".repeat(w - c.chars().count());
                if i == 0 {
                    format!("{c}{pad}")
                } else {
                    format!("{pad}{c}")
                }
            })
            .collect();
        padded.join("  ").trim_end().to_string() + "\n"
    };
    let mut out = line(header.clone());
    for row in &body {
        out += &line(row.iter().map(String::as_str).collect());
    }
    if rows.iter().any(|r| r.sees_ahead) {
        out += &format!("(*) {SEES_AHEAD}\n");
    }
    out
}

/// `index.html`: the table and the plots (inline SVG: the page opens from disk with no
/// network), and a link to each variant's run folder.
pub fn html(rows: &[Row], title: &str, svgs: &[(&str, String)]) -> String {
    let (header, body) = cells(rows);
    let mut page = format!(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{t}</title>\n<style>\
         body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}\
         td,th{{border:1px solid #bbb;padding:4px 8px;text-align:right}}\
         td:first-child,th:first-child{{text-align:left}}code{{font-size:90%}}</style>\
         </head><body>\n<h1>{t}</h1>\n<p>Sorted by validation loss (mean ± standard deviation \
         over seeds). Costs are from attn's accounting (the KV cache at the training context \
         --seq: a sliding-window layer holds at most its window); speeds are attn's CPU runtime \
         on each trained model.</p>\n<table>\n<tr>",
        t = escape(title)
    );
    for h in &header {
        page += &format!("<th>{}</th>", escape(h));
    }
    page += "<th>attention</th></tr>\n";
    for (row, r) in body.iter().zip(by_loss(rows)) {
        page += "<tr>";
        for (i, cell) in row.iter().enumerate() {
            if i == 0 {
                page += &format!(
                    "<td><a href=\"runs/{}/\">{}</a></td>",
                    escape(&r.folder),
                    escape(cell)
                );
            } else {
                page += &format!("<td>{}</td>", escape(cell));
            }
        }
        page += &format!("<td><code>{}</code></td></tr>\n", escape(&r.attention));
    }
    page += "</table>\n";
    if rows.iter().any(|r| r.sees_ahead) {
        page += &format!("<p>(*) {}</p>\n", escape(SEES_AHEAD));
    }
    for (name, svg) in svgs {
        page += &format!("<h2>{}</h2>\n{}\n", escape(name), inline(svg));
    }
    page + "</body></html>\n"
}

/// An SVG file's text from its `<svg` element on (an XML declaration may not stand inside
/// HTML).
fn inline(svg: &str) -> &str {
    svg.find("<svg").map_or("", |i| &svg[i..])
}

/// Text safe inside HTML elements and attribute values.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(step: u64, val_loss: f64, tokens_per_s: f64) -> Metrics {
        Metrics {
            step,
            train_loss: val_loss + 0.1,
            val_loss,
            tokens_per_s,
            elapsed_s: step as f64,
        }
    }

    fn row(variant: &str, finals: &[f64]) -> Row {
        let curves = finals
            .iter()
            .enumerate()
            .map(|(seed, &f)| Curve {
                seed: seed as u64,
                points: vec![metrics(10, 3.0, 100.0), metrics(20, f, 300.0)],
            })
            .collect();
        let cost = Cost {
            params: 1000,
            kv_bytes_per_token: 64,
            kv_cache_bytes: 64 * 16,
            flops_per_token: 2_500_000,
        };
        let speed = Speed {
            prefill_gflops: 1.5,
            decode_tokens_per_s: 900.0,
        };
        Row::new(
            variant.into(),
            format!("000-{variant}"),
            "heads = 4, head_dim = 8, mask = causal".into(),
            cost,
            speed,
            curves,
        )
    }

    #[test]
    fn rows_average_over_seeds() {
        let r = row("a", &[2.0, 2.2, 2.4]);
        assert!((r.val_loss - 2.2).abs() < 1e-12);
        assert!((r.val_loss_std - 0.2).abs() < 1e-12);
        assert_eq!(r.train_tokens_per_s, 200.0);
        let curve = r.mean_curve();
        assert_eq!(curve.iter().map(|p| p.0).collect::<Vec<_>>(), [10, 20]);
        assert!((curve[0].1 - 3.0).abs() < 1e-12 && (curve[1].1 - 2.2).abs() < 1e-12);
        assert_eq!(row("b", &[2.5]).val_loss_std, 0.0);
    }

    #[test]
    fn csv_quotes_fields_with_commas_and_keeps_the_columns() {
        let text = csv(&[row("kv_heads=1", &[2.0, 2.2])]);
        let mut lines = text.lines();
        assert!(lines.next().unwrap().starts_with(
            "variant,attention,params,kv_bytes_per_token,kv_cache_bytes,flops_per_token,\
             train_tokens_per_s,prefill_gflops,decode_tokens_per_s,val_loss,val_loss_std"
        ));
        let line = lines.next().unwrap();
        assert!(
            line.starts_with("kv_heads=1,\"heads = 4, head_dim = 8, mask = causal\",1000,64,1024,")
        );
        assert_eq!(csv_field("a \"b\""), "\"a \"\"b\"\"\"");
    }

    #[test]
    fn the_table_and_page_sort_by_loss_and_escape() {
        let mut rows = [row("worse", &[3.0]), row("<better>", &[2.0, 2.2])];
        let t = table(&rows);
        assert!(!t.contains("(*)"), "{t}");
        rows[1].sees_ahead = true;
        let t = table(&rows);
        assert!(
            t.contains("<better> (*)") && t.contains("(*) mask = none"),
            "{t}"
        );
        assert!(
            t.contains("3.0000 (1 seed)") && !t.contains("± 0.0000"),
            "{t}"
        );
        assert!(t.contains("2.1000 ± 0.1414"), "{t}");
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[1].starts_with("<better>") && lines[2].starts_with("worse"),
            "{t}"
        );
        let page = html(
            &rows,
            "sweep",
            &[("loss", "<?xml version=\"1.0\"?>\n<svg></svg>".into())],
        );
        assert!(page.contains("&lt;better&gt;") && !page.contains("<better>"));
        assert!(page.contains("<svg></svg>") && !page.contains("<?xml"));
        assert!(page.find("&lt;better&gt;").unwrap() < page.find("worse").unwrap());
        let lines: Vec<_> = jsonl(&rows).lines().map(str::to_string).collect();
        let v: serde_json::Value = serde_json::from_str(&lines[1]).unwrap();
        assert_eq!(v["curves"][0]["val_loss"][1], 2.0);
    }
}
