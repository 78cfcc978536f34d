//! Ring attention: every rank keeps its queries while the keys and values pass around the ring,
//! one rank on per step; each step's attention runs while the next step's keys and values are
//! in flight. Partial results merge through their lse. The backward passes the keys' and
//! values' gradients around the ring with them, home after the last step.
//!
//! A rank's queries and keys are chunks of the sequence ([`SeqSplit`]); each (query chunk, key
//! chunk) pair is one placed call whose queries sit at their own positions
//! ([`Placement::query_shift`]), so every modifier sees global positions.

use std::ops::Range;

use super::comm::Communicator;
use super::layout::SeqSplit;
use super::merge::merge_rows;
use crate::backend::Backend;
use crate::calls::{HeadsBackward, Inputs};
use crate::error::RuntimeError;
use crate::learned::Learned;
use crate::placement::Placement;
use crate::tensor::Tensor;
use crate::variant::Variant;
use attn_dsl::DType;

/// One ring call's setting.
pub(crate) struct Ring<'a> {
    pub comm: &'a dyn Communicator,
    pub backend: &'a dyn Backend,
    pub variant: &'a Variant,
    pub split: SeqSplit,
    /// The position of the sequence's first token.
    pub position_offset: i64,
    pub learned: Learned<'a>,
}

/// A chunk of a rank's sequence: its positions (from the offset) and its rows in the rank's
/// tensors.
#[derive(Clone, Debug)]
struct Chunk {
    positions: Range<usize>,
    rows: Range<usize>,
}

/// A rank's keys or values, `[B, heads, L, width]` f32 values (as they travel), as the
/// views of its chunks, in the spec's dtype.
fn chunk_views(
    values: &Tensor,
    chunks: &[Chunk],
    dtype: DType,
) -> Result<Vec<Tensor>, RuntimeError> {
    chunks
        .iter()
        .map(|c| {
            let view = values.narrow(2, c.rows.start, c.rows.len())?;
            match dtype {
                DType::F32 => Ok(view),
                other => Tensor::from_f32_as(other, view.shape(), view.to_f32_vec()),
            }
        })
        .collect()
}

/// The rank's views of `t` (`[B, heads, L, ..]`) at each chunk's rows.
fn chunk_rows(t: &Tensor, chunks: &[Chunk]) -> Result<Vec<Tensor>, RuntimeError> {
    chunks
        .iter()
        .map(|c| t.narrow(2, c.rows.start, c.rows.len()))
        .collect()
}

/// Adds `part`, the rows of one chunk (`[outer, chunk rows, width]`), into its rows of `acc`
/// (`[outer, local, width]`).
fn add_rows(acc: &mut [f32], part: &[f32], [outer, local, width]: [usize; 3], rows: &Range<usize>) {
    let n = rows.len() * width;
    for o in 0..outer {
        let at = (o * local + rows.start) * width;
        for (a, p) in acc[at..at + n].iter_mut().zip(&part[o * n..(o + 1) * n]) {
            *a += p;
        }
    }
}

/// A rank's keys and values as they travel: f32, `[B, KV, L, D]` and `[B, KV, L, Dv]`.
struct Packet {
    k: Tensor,
    v: Tensor,
}

impl Ring<'_> {
    fn chunks(&self, rank: usize) -> Vec<Chunk> {
        let mut at = 0;
        self.split
            .chunks(rank)
            .into_iter()
            .map(|positions| {
                let rows = at..at + positions.len();
                at = rows.end;
                Chunk { positions, rows }
            })
            .collect()
    }

    /// Whether a causal-type mask keeps no pair of query chunk `q` and key chunk `k`.
    fn skipped(&self, q: &Chunk, k: &Chunk) -> bool {
        use attn_dsl::Mask;
        let causal = matches!(
            self.variant.spec().mask,
            Mask::Causal(_) | Mask::SlidingWindow { .. }
        );
        causal && k.positions.start >= q.positions.end
    }

    /// The placement of query chunk `q` against key chunk `k`, and the keys' position offset.
    fn placed(&self, q: &Chunk, k: &Chunk) -> (i64, Placement) {
        let (qs, ks) = (q.positions.start as i64, k.positions.start as i64);
        let (nq, nk) = (q.positions.len() as i64, k.positions.len() as i64);
        // Query 0 of the call is at `p0 + ks + nk - nq + shift`; it must be at `p0 + qs`. Data
        // tensors are the whole sequence's, from `p0`.
        let placement = Placement {
            data_seq: Some((self.position_offset, self.split.seq)),
            ..Placement::shifted(qs - ks - nk + nq)
        };
        (self.position_offset + ks, placement)
    }

    /// The pieces of a step: each (query chunk `i` of `mine`, key chunk `j` of `theirs`) that
    /// can keep a pair, with the keys' position offset and the queries' placement.
    fn pieces<'c>(
        &'c self,
        mine: &'c [Chunk],
        theirs: &'c [Chunk],
    ) -> impl Iterator<Item = (usize, usize, i64, Placement)> + 'c {
        mine.iter().enumerate().flat_map(move |(i, qc)| {
            theirs
                .iter()
                .enumerate()
                .filter(move |(_, kc)| !self.skipped(qc, kc))
                .map(move |(j, kc)| {
                    let (p0, placement) = self.placed(qc, kc);
                    (i, j, p0, placement)
                })
        })
    }

    /// Runs one step's `compute` on `packet`, the keys and values this rank holds now, and
    /// returns the next step's, received while it ran (`None` after the `last` step, which
    /// passes nothing on).
    fn step(
        &self,
        packet: &Packet,
        last: bool,
        compute: impl FnOnce() -> Result<(), RuntimeError>,
    ) -> Result<Option<Packet>, RuntimeError> {
        if last {
            compute()?;
            return Ok(None);
        }
        let ((), next) = self.exchange_while(packet, compute)?;
        Ok(Some(next))
    }

    /// Sends `packet` one rank on and receives the previous rank's while `compute` runs.
    fn exchange_while<T>(
        &self,
        packet: &Packet,
        compute: impl FnOnce() -> Result<T, RuntimeError>,
    ) -> Result<(T, Packet), RuntimeError> {
        let (me, n) = (self.comm.rank(), self.comm.size());
        let (to, from) = ((me + 1) % n, (me + n - 1) % n);
        let (k, v) = (packet.k.f32_values(), packet.v.f32_values());
        let (mut next_k, mut next_v) = (vec![0f32; k.len()], vec![0f32; v.len()]);
        let (computed, exchanged) = std::thread::scope(|s| {
            let exchange = s.spawn(|| {
                self.comm.send_recv(&k, to, &mut next_k, from)?;
                self.comm.send_recv(&v, to, &mut next_v, from)
            });
            let computed = compute();
            (computed, exchange.join())
        });
        let exchanged = exchanged
            .map_err(|_| RuntimeError::Data("the ring exchange's thread panicked".into()))?;
        // A failed exchange is the cause when both fail (the compute may have stopped on it).
        exchanged?;
        let next = Packet {
            k: Tensor::from_f32(packet.k.shape(), next_k)?,
            v: Tensor::from_f32(packet.v.shape(), next_v)?,
        };
        Ok((computed?, next))
    }

    /// The ring forward over this rank's q and k, v (`[B, H, L, D]`, `[B, KV, L, D]`): the
    /// rank's `out` `[B, H, L, Dv]` and `lse` `[B, H, L]`, f32, without sinks.
    pub fn forward(&self, [q, k, v]: [&Tensor; 3]) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
        let spec = self.variant.spec();
        let (me, n) = (self.comm.rank(), self.comm.size());
        let h = spec.heads as usize;
        let (dv, dtype) = (spec.v_head_dim as usize, spec.dtype);
        let (b, local) = (q.shape()[0], self.split.local_len());
        let mine = self.chunks(me);
        let qs = chunk_rows(q, &mine)?;
        let sums = spec.normalize != attn_dsl::Normalize::Softmax;
        // Each chunk's rows are merged in place into the rank's out and lse.
        let mut out = vec![0f32; b * h * local * dv];
        let mut lse = vec![f32::NEG_INFINITY; b * h * local];
        let mut packet = Packet {
            k: Tensor::from_f32(k.shape(), k.to_f32_vec())?,
            v: Tensor::from_f32(v.shape(), v.to_f32_vec())?,
        };
        for step in 0..n {
            let owner = (me + n - step) % n;
            let theirs = self.chunks(owner);
            let compute = || -> Result<(), RuntimeError> {
                let ks = chunk_views(&packet.k, &theirs, dtype)?;
                let vs = chunk_views(&packet.v, &theirs, dtype)?;
                for (i, j, p0, placement) in self.pieces(&mine, &theirs) {
                    let part = self.backend.forward_placed(
                        self.variant,
                        Inputs::heads(&qs[i], &ks[j], &vs[j]),
                        p0,
                        self.learned,
                        placement,
                    )?;
                    let dims = [b * h, local, dv];
                    merge_rows(&mut out, &mut lse, &part, dims, &mine[i].rows, sums);
                }
                Ok(())
            };
            if let Some(next) = self.step(&packet, step + 1 == n, compute)? {
                packet = next;
            }
        }
        Ok((out, lse))
    }

    /// The ring backward of this rank's part (`x` holds its q, k, v, and the merged `out`,
    /// `lse`, sinks included, and `dout`): dq, dk, dv as f32 arrays of the rank's shapes, and
    /// this rank's share of each learnable tensor's gradient (summed over its pieces).
    pub fn backward(&self, x: &HeadsBackward) -> Result<RingGradients, RuntimeError> {
        let spec = self.variant.spec();
        let (me, n) = (self.comm.rank(), self.comm.size());
        let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv, dtype) = (spec.head_dim as usize, spec.v_head_dim as usize, spec.dtype);
        let (b, local) = (x.q.shape()[0], self.split.local_len());
        let mine = self.chunks(me);
        let (qs, outs) = (chunk_rows(x.q, &mine)?, chunk_rows(x.out, &mine)?);
        let (douts, lses) = (chunk_rows(x.dout, &mine)?, chunk_rows(x.lse, &mine)?);
        let mut dq = vec![0f32; b * h * local * d];
        let mut packet = Packet {
            k: Tensor::from_f32(x.k.shape(), x.k.to_f32_vec())?,
            v: Tensor::from_f32(x.v.shape(), x.v.to_f32_vec())?,
        };
        // dk and dv of the keys and values this rank holds, travelling with them.
        let (mut dk, mut dvs) = (
            vec![0f32; b * hkv * local * d],
            vec![0f32; b * hkv * local * dv],
        );
        let mut learned: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
        for step in 0..n {
            let owner = (me + n - step) % n;
            let theirs = self.chunks(owner);
            let compute = || -> Result<(), RuntimeError> {
                let ks = chunk_views(&packet.k, &theirs, dtype)?;
                let vs = chunk_views(&packet.v, &theirs, dtype)?;
                for (i, j, p0, placement) in self.pieces(&mine, &theirs) {
                    let piece = HeadsBackward {
                        q: &qs[i],
                        k: &ks[j],
                        v: &vs[j],
                        out: &outs[i],
                        lse: &lses[i],
                        dout: &douts[i],
                        position_offset: p0,
                    };
                    let g = self.backend.backward_placed(
                        self.variant,
                        &piece,
                        self.learned,
                        placement,
                    )?;
                    let (qr, kr) = (&mine[i].rows, &theirs[j].rows);
                    add_rows(&mut dq, &g.dq.f32_values(), [b * h, local, d], qr);
                    add_rows(&mut dk, &g.dk.f32_values(), [b * hkv, local, d], kr);
                    add_rows(&mut dvs, &g.dv.f32_values(), [b * hkv, local, dv], kr);
                    add_learned(&mut learned, g.learned);
                }
                Ok(())
            };
            if let Some(next) = self.step(&packet, step + 1 == n, compute)? {
                packet = next;
            }
            // The gradients follow their keys and values one rank on; after the last step
            // this brings each rank's own home.
            let (mut next_k, mut next_v) = (vec![0f32; dk.len()], vec![0f32; dvs.len()]);
            let (to, from) = ((me + 1) % n, (me + n - 1) % n);
            self.comm.send_recv(&dk, to, &mut next_k, from)?;
            self.comm.send_recv(&dvs, to, &mut next_v, from)?;
            (dk, dvs) = (next_k, next_v);
        }
        Ok(RingGradients {
            dq,
            dk,
            dv: dvs,
            learned,
        })
    }
}

/// A ring backward's results on one rank (see [`Ring::backward`]).
pub(crate) struct RingGradients {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
    /// `(d<name>, shape, values)` per learnable tensor, this rank's share.
    pub learned: Vec<(String, Vec<usize>, Vec<f32>)>,
}

/// Adds one piece's learnable gradients into the running sums (the same names, in the same
/// order, from every piece of a spec).
fn add_learned(sums: &mut Vec<(String, Vec<usize>, Vec<f32>)>, piece: Vec<(String, Tensor)>) {
    for (name, t) in piece {
        let values = t.to_f32_vec();
        match sums.iter_mut().find(|(n, _, _)| *n == name) {
            Some((_, _, sum)) => sum.iter_mut().zip(&values).for_each(|(s, v)| *s += v),
            None => sums.push((name, t.shape().to_vec(), values)),
        }
    }
}
