//! ALiBi slopes (the ALiBi paper's recipe, as BLOOM implements it).

/// The slope of each of `heads` heads: with `m = 2^floor(log2 heads)`, heads `i < m` get
/// `2^(-8(i+1)/m)`, and the remaining `heads - m` get `2^(-4(2k+1)/m)` for `k = 0, 1, ...`
/// (the odd powers of the slopes for `2m` heads).
pub fn slopes(heads: u32) -> Vec<f64> {
    if heads == 0 {
        return Vec::new();
    }
    let m = 1u32 << (31 - heads.leading_zeros());
    let m_f = f64::from(m);
    let mut out: Vec<f64> = (0..m)
        .map(|i| 2f64.powf(-8.0 * f64::from(i + 1) / m_f))
        .collect();
    out.extend((0..heads - m).map(|k| 2f64.powf(-4.0 * f64::from(2 * k + 1) / m_f)));
    out
}
