//! The MPI engine (feature `mpi`): the `mpi` crate over the system's MPI library (Open MPI or
//! MPICH). Start the ranks with `mpirun -n N program`.
//!
//! MPI runs on its own service thread ([`super::served`]), which initializes it, owns its
//! handles and finalizes it when the [`MpiComm`] is dropped: the communicator can be shared by
//! the threads of a rank (a ring's exchange runs beside its attention) without MPI being asked
//! for more than `MPI_THREAD_FUNNELED`.

use std::time::Duration;

use mpi::datatype::Equivalence;
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::traits::*;

use super::comm::CommError;
use super::served::{Call, Engine, Reply, ServedComm, served_communicator};
use super::threads::DEFAULT_TIMEOUT;

/// This process's rank of `MPI_COMM_WORLD`.
pub struct MpiComm(ServedComm);

served_communicator!(MpiComm);

impl MpiComm {
    /// Initializes MPI (once per process) on its service thread; a rank's calls wait for it
    /// at most [`DEFAULT_TIMEOUT`].
    pub fn init() -> Result<MpiComm, CommError> {
        Self::init_with_timeout(DEFAULT_TIMEOUT)
    }

    /// [`MpiComm::init`] with a rank's wait for a collective bounded by `timeout`.
    pub fn init_with_timeout(timeout: Duration) -> Result<MpiComm, CommError> {
        ServedComm::start("mpi", timeout, || {
            let universe =
                mpi::initialize().ok_or("MPI was initialized already in this process")?;
            let world = universe.world();
            Ok(Mpi {
                world,
                _universe: universe,
            })
        })
        .map(MpiComm)
    }

    /// Ends every rank of the job (`MPI_Abort`), for a rank that cannot go on: its peers would
    /// otherwise wait in their next collective.
    pub fn abort(&self, code: i32) {
        // The reply never comes: MPI_Abort ends the process.
        let _ = self.0.call(Call::Abort(code));
    }
}

/// MPI's world, on the service thread (dropping the universe finalizes MPI).
struct Mpi {
    world: SimpleCommunicator,
    _universe: mpi::environment::Universe,
}

impl Engine for Mpi {
    fn rank_and_size(&self) -> (usize, usize) {
        (self.world.rank() as usize, self.world.size() as usize)
    }

    fn run(&mut self, call: Call) -> Reply {
        let world = &self.world;
        match call {
            Call::SendRecv {
                send,
                to,
                recv_len,
                from,
            } => send_recv(world, &send, to, recv_len, from),
            Call::AllToAll(send) => {
                same_lengths(world, send.len(), "all-to-all")?;
                let mut recv = vec![0f32; send.len()];
                world.all_to_all_into(&send[..], &mut recv[..]);
                Ok(recv)
            }
            Call::AllReduce(values) => {
                same_lengths(world, values.len(), "all-reduce")?;
                let mut sum = vec![0f32; values.len()];
                world.all_reduce_into(
                    &values[..],
                    &mut sum[..],
                    mpi::collective::SystemOperation::sum(),
                );
                Ok(sum)
            }
            Call::AllGather(send) => {
                same_lengths(world, send.len(), "all-gather")?;
                let mut recv = vec![0f32; send.len() * world.size() as usize];
                world.all_gather_into(&send[..], &mut recv[..]);
                Ok(recv)
            }
            Call::Abort(code) => world.abort(code),
        }
    }
}

/// Every rank's length for a collective, compared: a rank with another length makes the
/// collective an error on every rank (which all see the same lengths).
fn same_lengths(world: &SimpleCommunicator, len: usize, what: &str) -> Result<(), String> {
    let mut lengths = vec![0u64; world.size() as usize];
    world.all_gather_into(&(len as u64), &mut lengths[..]);
    if lengths.iter().all(|&n| n == lengths[0]) {
        return Ok(());
    }
    Err(format!(
        "the ranks called {what} with buffers of different lengths: {lengths:?}"
    ))
}

/// Sends to `to` while receiving `recv_len` values from `from`; a message of another length
/// is received (so that the sender completes) and refused.
fn send_recv(
    world: &SimpleCommunicator,
    send: &[f32],
    to: usize,
    recv_len: usize,
    from: usize,
) -> Reply {
    let size = world.size() as usize;
    if to >= size || from >= size {
        return Err(format!(
            "there is no rank {} in a group of {size}",
            to.max(from)
        ));
    }
    mpi::request::scope(|scope| {
        let sent = world.process_at_rank(to as i32).immediate_send(scope, send);
        let (message, status) = world.process_at_rank(from as i32).matched_probe();
        let count = status.count(f32::equivalent_datatype()) as usize;
        let mut recv = vec![0f32; count];
        message.matched_receive_into(&mut recv[..]);
        sent.wait();
        if count != recv_len {
            return Err(format!(
                "rank {from} sent {count} values; this call expects {recv_len}"
            ));
        }
        Ok(recv)
    })
}
