//! Attention and training beyond one process: a [`Communicator`] over an existing engine
//! (threads in one process, [`threads`]; MPI with the `mpi` feature; NCCL between GPUs with
//! the `nccl` feature), and context-parallel attention over it ([`ContextParallel`]: Ulysses
//! or ring attention, each rank holding the positions a [`SeqSplit`] gives it).

mod comm;
mod context;
mod layout;
mod merge;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod ring;
#[cfg(any(feature = "mpi", feature = "nccl"))]
mod served;
pub mod threads;
mod ulysses;

pub use comm::{CommError, Communicator};
pub use context::{ContextParallel, Scheme};
pub use layout::SeqSplit;
#[cfg(feature = "mpi")]
pub use mpi::MpiComm;
#[cfg(feature = "nccl")]
pub use nccl::NcclComm;
pub use threads::ThreadComm;

use std::sync::Arc;

/// Runs `f` on `ranks` threads, each with its rank of a new in-process group, and returns
/// their results in rank order. A rank's communicator is dropped when its `f` returns and
/// whatever it gave a clone of drops it, so its peers' waits on it end.
pub fn run_ranks<T: Send>(ranks: usize, f: impl Fn(&Arc<ThreadComm>) -> T + Sync) -> Vec<T> {
    run_ranks_with(threads::group(ranks), f)
}

/// [`run_ranks`] over a group made already (with its own timeout, say).
pub fn run_ranks_with<T: Send>(
    group: Vec<ThreadComm>,
    f: impl Fn(&Arc<ThreadComm>) -> T + Sync,
) -> Vec<T> {
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .map(|comm| s.spawn(move || f(&Arc::new(comm))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}
