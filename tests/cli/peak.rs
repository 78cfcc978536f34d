//! `attnc peak`: the machine's read ceiling.

use crate::{attnc, stderr, stdout};

#[test]
fn peak_memory_reports_the_read_ceiling() {
    let o = attnc(&["peak", "--memory", "--seconds", "0.05"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    // "memory reads: X GB/s on 1 thread, Y GB/s on N"
    let rates: Vec<f64> = text
        .split_whitespace()
        .filter_map(|w| w.parse::<f64>().ok())
        .collect();
    assert!(text.starts_with("memory reads:"), "{text}");
    assert!(
        rates.len() >= 2 && rates[0] > 0.0 && rates[1] > 0.0,
        "{text}"
    );
}
