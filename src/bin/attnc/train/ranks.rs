//! Training over ranks: each takes an equal part of every step's global batch (data
//! parallelism: its sequences; context parallelism: its positions of every sequence), with
//! losses and gradients averaged over them (all-reduces), so that every rank takes the same
//! optimizer step and the run equals one process with the same global batch. Ranks are threads
//! of one process (`--ranks N`) or MPI processes (`mpirun`, a build with the `mpi` feature);
//! rank 0 alone writes the run's folder and prints progress.

use std::sync::Arc;

use attn::candle::core::backprop::GradStore;
use attn::candle::core::{Tensor, Var};
use attn::distributed::{Communicator, Scheme};

/// Values per all-reduce of the gradients (buckets of 16 MiB): a large model's gradients are
/// not copied into one buffer the size of the model.
const BUCKET: usize = 4 << 20;

/// This process's (or thread's) place among the ranks, and how they split the batch.
#[derive(Clone)]
pub struct Ranks {
    comm: Arc<dyn Communicator>,
    /// Context parallelism's scheme, when the ranks split every sequence rather than the
    /// batch; its split of the positions is [`Ranks::positions`].
    context: Option<(Scheme, Vec<u32>)>,
}

fn comm_error(e: impl std::fmt::Display) -> String {
    format!("error: data-parallel training: {e}")
}

fn candle_error(e: attn::candle::core::Error) -> String {
    format!("error: data-parallel training: {e}")
}

impl Ranks {
    /// The ranks of `comm`'s group, splitting the batch.
    pub fn new(comm: Arc<dyn Communicator>) -> Ranks {
        Ranks {
            comm,
            context: None,
        }
    }

    /// The ranks splitting every sequence: this rank takes `positions` of each (in order) and
    /// the model's attention runs context-parallel with `scheme`.
    pub fn splitting_sequences(self, scheme: Scheme, positions: Vec<u32>) -> Ranks {
        Ranks {
            context: Some((scheme, positions)),
            ..self
        }
    }

    /// Whether the ranks split every sequence (context parallelism) rather than the batch.
    pub fn splits_sequences(&self) -> bool {
        self.context.is_some()
    }

    /// The context of the model's attention, when the ranks split sequences.
    pub fn context(&self) -> Option<attn::candle::Context> {
        self.context
            .as_ref()
            .map(|(scheme, _)| attn::candle::Context {
                comm: Arc::clone(&self.comm),
                scheme: *scheme,
            })
    }

    /// The group's communicator.
    pub fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    /// This rank's (0-based) rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Whether this is rank 0, which writes the run.
    pub fn is_root(&self) -> bool {
        self.comm.rank() == 0
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// This rank's inputs and targets of windows `[B, seq + 1]` (the batch is checked to divide
    /// over the ranks, or the sequence): `B / ranks` whole windows, or this rank's positions
    /// of every window.
    pub fn part(&self, windows: &Tensor, seq: usize) -> attn::candle::core::Result<[Tensor; 2]> {
        match &self.context {
            None => {
                let n = windows.dim(0)? / self.size();
                let mine = windows.narrow(0, self.comm.rank() * n, n)?;
                Ok([mine.narrow(1, 0, seq)?, mine.narrow(1, 1, seq)?])
            }
            Some((_, positions)) => {
                let at = Tensor::new(positions.as_slice(), windows.device())?;
                let next: Vec<u32> = positions.iter().map(|p| p + 1).collect();
                let next = Tensor::new(next.as_slice(), windows.device())?;
                Ok([
                    windows.index_select(&at, 1)?,
                    windows.index_select(&next, 1)?,
                ])
            }
        }
    }

    /// The mean of every rank's `x`.
    pub fn mean(&self, x: f64) -> Result<f64, String> {
        let mut v = [x as f32];
        self.comm.all_reduce_sum(&mut v).map_err(comm_error)?;
        Ok(f64::from(v[0]) / self.size() as f64)
    }

    /// Whether every rank says `ok` (a rank that could not prepare stops all of them).
    pub fn all_ok(&self, ok: bool) -> Result<bool, String> {
        let mut failed = [if ok { 0.0 } else { 1.0 }];
        self.comm.all_reduce_sum(&mut failed).map_err(comm_error)?;
        Ok(failed[0] == 0.0)
    }

    /// Replaces each rank's gradients of `vars` by their mean over the ranks. A variable has a
    /// gradient afterwards when it had one on any rank (a mixture-of-experts expert no token of
    /// this rank reached still learns from the others').
    pub fn average(&self, grads: &mut GradStore, vars: &[(String, Var)]) -> Result<(), String> {
        // Per variable: 1 when this rank has its gradient, then the gradient (or zeros).
        let mut flat: Vec<f32> = Vec::new();
        for (_, var) in vars {
            match grads.get(var) {
                Some(g) => {
                    flat.push(1.0);
                    let values = g.flatten_all().and_then(|g| g.to_vec1::<f32>());
                    flat.extend(values.map_err(candle_error)?);
                }
                None => {
                    flat.push(0.0);
                    flat.resize(flat.len() + var.elem_count(), 0.0);
                }
            }
        }
        for bucket in flat.chunks_mut(BUCKET) {
            self.comm.all_reduce_sum(bucket).map_err(comm_error)?;
        }
        let scale = 1.0 / self.size() as f32;
        let mut at = 0;
        for (_, var) in vars {
            let n = var.elem_count();
            let (present, values) = (flat[at] > 0.0, &flat[at + 1..at + 1 + n]);
            at += 1 + n;
            if !present {
                grads.remove(var);
                continue;
            }
            let mean: Vec<f32> = values.iter().map(|g| g * scale).collect();
            let g = Tensor::from_vec(mean, var.shape(), var.device()).map_err(candle_error)?;
            grads.insert(var, g);
        }
        Ok(())
    }
}

/// Refuses a batch that does not split evenly over the data-parallel ranks.
pub fn check_batch_splits(batch: usize, ranks: &Ranks) -> Result<(), String> {
    if batch.is_multiple_of(ranks.size()) {
        return Ok(());
    }
    Err(format!(
        "error: --batch {batch} does not split over {} data-parallel ranks; allowed: a multiple \
         of the ranks",
        ranks.size()
    ))
}

/// Runs `train` as the ranks it is given: MPI's processes under `mpirun` (an attnc built with
/// the `mpi` feature), `ranks` threads of this process, or this process alone. With threads,
/// rank 0's error is the one returned (the other ranks' are mostly that rank 0 left).
pub fn with_ranks(
    ranks: u64,
    train: impl Fn(Option<Ranks>) -> Result<(), String> + Sync,
) -> Result<(), String> {
    if launched_by_mpi() {
        if ranks > 1 {
            return Err(
                "error: --ranks under mpirun: the ranks are MPI's processes; give \
                        mpirun -n N or --ranks N, not both"
                    .into(),
            );
        }
        return with_mpi(train);
    }
    if ranks == 1 {
        return train(None);
    }
    let results = attn::distributed::run_ranks(ranks as usize, |comm| {
        train(Some(Ranks::new(Arc::clone(comm) as Arc<dyn Communicator>)))
    });
    match results.iter().position(Result::is_err) {
        None => Ok(()),
        Some(first) => {
            let pick = if results[0].is_err() { 0 } else { first };
            results.into_iter().nth(pick).unwrap_or(Ok(()))
        }
    }
}

/// Whether `mpirun` started this process as one of several ranks.
fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .any(|n| n.parse::<u64>().is_ok_and(|n| n > 1))
}

#[cfg(feature = "mpi")]
fn with_mpi(train: impl Fn(Option<Ranks>) -> Result<(), String>) -> Result<(), String> {
    let comm = Arc::new(attn::distributed::MpiComm::init().map_err(comm_error)?);
    let result = train(Some(Ranks::new(Arc::clone(&comm) as Arc<dyn Communicator>)));
    if let Err(e) = &result {
        // The other ranks may be waiting in a collective for this one: end the job.
        say!("rank {}: {e}", comm.rank());
        comm.abort(2);
    }
    result
}

#[cfg(not(feature = "mpi"))]
fn with_mpi(_: impl Fn(Option<Ranks>) -> Result<(), String>) -> Result<(), String> {
    Err(
        "error: mpirun started this attnc as one of several ranks, but it was built without \
         the `mpi` feature: cargo install --path . --features candle,mpi"
            .into(),
    )
}
