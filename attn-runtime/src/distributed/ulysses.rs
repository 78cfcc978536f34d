//! Ulysses (DeepSpeed's all-to-all over heads): each rank trades its sequence part of every
//! head for the whole sequence of its share of the heads, runs an unchanged call over those
//! heads ([`Placement::heads`]: ALiBi slopes, per-head parameters and `h` stay global), and
//! trades the output back.

use super::comm::Communicator;
use crate::error::RuntimeError;

/// `[B, H, L, W]` split over heads in `n` runs: `[B, H/n, n L, W]`, rank `i`'s part of the
/// sequence at rows `i L ..`.
pub(crate) fn seq_to_heads(
    comm: &dyn Communicator,
    x: &[f32],
    [b, h, l, w]: [usize; 4],
) -> Result<Vec<f32>, RuntimeError> {
    let n = comm.size();
    let hl = h / n;
    // Block j: heads j hl .. (j + 1) hl of every batch item.
    let block = hl * l * w;
    let mut send = Vec::with_capacity(x.len());
    for j in 0..n {
        for item in 0..b {
            let at = (item * h + j * hl) * l * w;
            send.extend_from_slice(&x[at..at + block]);
        }
    }
    let mut recv = vec![0f32; send.len()];
    comm.all_to_all(&send, &mut recv)?;
    let mut out = vec![0f32; x.len()];
    for (i, part) in recv.chunks(b * block.max(1)).enumerate().take(n) {
        for item in 0..b {
            for head in 0..hl {
                let src = &part[(item * hl + head) * l * w..][..l * w];
                let at = ((item * hl + head) * n * l + i * l) * w;
                out[at..at + l * w].copy_from_slice(src);
            }
        }
    }
    Ok(out)
}

/// The inverse of [`seq_to_heads`]: `[B, H/n, n L, W]` back to `[B, H, L, W]`.
pub(crate) fn heads_to_seq(
    comm: &dyn Communicator,
    y: &[f32],
    [b, h, l, w]: [usize; 4],
) -> Result<Vec<f32>, RuntimeError> {
    let n = comm.size();
    let hl = h / n;
    let mut send = Vec::with_capacity(y.len());
    for j in 0..n {
        for item in 0..b {
            for head in 0..hl {
                let at = ((item * hl + head) * n * l + j * l) * w;
                send.extend_from_slice(&y[at..at + l * w]);
            }
        }
    }
    let mut recv = vec![0f32; send.len()];
    comm.all_to_all(&send, &mut recv)?;
    let mut out = vec![0f32; y.len()];
    let block = b * hl * l * w;
    for (i, part) in recv.chunks(block.max(1)).enumerate().take(n) {
        for item in 0..b {
            let at = (item * h + i * hl) * l * w;
            out[at..at + hl * l * w].copy_from_slice(&part[item * hl * l * w..][..hl * l * w]);
        }
    }
    Ok(out)
}
