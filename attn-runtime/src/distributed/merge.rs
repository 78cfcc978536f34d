//! The merge of partial attention results by their log-sum-exp, in f32: each part is softmax
//! attention over some of a row's keys, and the merged row is attention over all of them. Parts
//! of sigmoid attention (`normalize = sigmoid`) are sums of independently weighted values: they
//! add, and their lse still merges as a log-sum-exp.

/// Merges a part (`out` rows of `width` values and their `lse`) into the running result
/// `acc_out`, `acc_lse` (which start as zeros and `-inf`), row by row, in the stable form
/// `out = out - sigmoid(lse_b - lse) * (out - out_b)`, `lse = lse - logsigmoid(lse - lse_b)`.
/// A part with no kept key (`-inf`) leaves a row as it is; a NaN or `+inf` lse makes it NaN,
/// as in a single call (docs/semantics.md, "At the edges").
pub(crate) fn merge_into(
    acc_out: &mut [f32],
    acc_lse: &mut [f32],
    out: &[f32],
    lse: &[f32],
    width: usize,
    sums: bool,
) {
    for (r, (la, &lb)) in acc_lse.iter_mut().zip(lse).enumerate() {
        let row = r * width..(r + 1) * width;
        let (acc, part) = (&mut acc_out[row.clone()], &out[row]);
        let poisoned = |l: f32| l.is_nan() || l == f32::INFINITY;
        if poisoned(*la) || poisoned(lb) {
            acc.fill(f32::NAN);
            *la = f32::NAN;
        } else if lb == f32::NEG_INFINITY {
        } else if *la == f32::NEG_INFINITY {
            acc.copy_from_slice(part);
            *la = lb;
        } else {
            if sums {
                acc.iter_mut().zip(part).for_each(|(a, b)| *a += b);
            } else {
                let w = sigmoid(lb - *la);
                for (a, b) in acc.iter_mut().zip(part) {
                    *a -= w * (*a - b);
                }
            }
            *la -= log_sigmoid(*la - lb);
        }
    }
}

/// Merges a placed call's result over one chunk's query rows (`[outer, rows, width]` out,
/// `[outer, rows]` lse) into a rank's running result (`[outer, local, width]`, `[outer,
/// local]`) at `rows`; `sums` as for [`merge_into`].
pub(crate) fn merge_rows(
    out: &mut [f32],
    lse: &mut [f32],
    part: &crate::calls::Output,
    [outer, local, width]: [usize; 3],
    rows: &std::ops::Range<usize>,
    sums: bool,
) {
    let (part_out, part_lse) = (part.out.f32_values(), part.lse.f32_values());
    let n = rows.len();
    for o in 0..outer {
        let at = o * local + rows.start;
        merge_into(
            &mut out[at * width..(at + n) * width],
            &mut lse[at..at + n],
            &part_out[o * n * width..(o + 1) * n * width],
            &part_lse[o * n..(o + 1) * n],
            width,
            sums,
        );
    }
}

/// `1 / (1 + e^-x)`, without overflow.
fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// `ln sigmoid(x) = -ln(1 + e^-x)`, without overflow.
fn log_sigmoid(x: f32) -> f32 {
    -((-x).max(0.0) + (-x.abs()).exp().ln_1p())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two parts merge to the softmax over both: rows of logits split in two.
    #[test]
    fn two_parts_merge_to_the_softmax_over_both() {
        let logits = [[0.5f32, -1.0, 3.0, 80.0], [-200.0, 1.0, 2.0, -3.0]];
        let values = [1.0f32, -2.0, 0.25, 4.0];
        let part = |row: &[f32; 4], keys: std::ops::Range<usize>| {
            let m = keys.clone().map(|j| row[j]).fold(f32::MIN, f32::max);
            let z: f32 = keys.clone().map(|j| (row[j] - m).exp()).sum();
            let o: f32 = keys.map(|j| (row[j] - m).exp() * values[j]).sum::<f32>() / z;
            (o, m + z.ln())
        };
        for row in &logits {
            let (o1, l1) = part(row, 0..2);
            let (o2, l2) = part(row, 2..4);
            let (want, want_lse) = part(row, 0..4);
            let (mut out, mut lse) = (vec![0.0], vec![f32::NEG_INFINITY]);
            merge_into(&mut out, &mut lse, &[o1], &[l1], 1, false);
            merge_into(&mut out, &mut lse, &[o2], &[l2], 1, false);
            assert!((out[0] - want).abs() < 1e-5, "{} against {want}", out[0]);
            assert!(
                (lse[0] - want_lse).abs() < 1e-5,
                "{} against {want_lse}",
                lse[0]
            );
        }
    }

    /// Empty parts change nothing; a NaN part makes the row NaN.
    #[test]
    fn empty_parts_are_skipped_and_nan_poisons() {
        let (mut out, mut lse) = (vec![0.0, 0.0], vec![f32::NEG_INFINITY, f32::NEG_INFINITY]);
        merge_into(
            &mut out,
            &mut lse,
            &[7.0, 1.0],
            &[0.5, f32::NEG_INFINITY],
            1,
            false,
        );
        assert_eq!((out[0], lse[0]), (7.0, 0.5));
        assert_eq!((out[1], lse[1]), (0.0, f32::NEG_INFINITY));
        merge_into(&mut out, &mut lse, &[1.0, 1.0], &[f32::NAN, 0.0], 1, false);
        assert!(out[0].is_nan() && lse[0].is_nan());
        assert_eq!((out[1], lse[1]), (1.0, 0.0));
    }

    /// Sigmoid parts add: two parts' sums and the log of their weights' total.
    #[test]
    fn sigmoid_parts_add() {
        let (mut out, mut lse) = (vec![0.0, 0.0], vec![f32::NEG_INFINITY]);
        merge_into(&mut out, &mut lse, &[1.5, 2.0], &[0.25f32.ln()], 2, true);
        merge_into(&mut out, &mut lse, &[0.5, -1.0], &[0.75f32.ln()], 2, true);
        assert_eq!(out, [2.0, 1.0]);
        assert!(lse[0].abs() < 1e-6, "ln(0.25 + 0.75) = 0, got {}", lse[0]);
    }
}
