//! The MPI engine (feature `mpi`): the `mpi` crate over the system's MPI library (Open MPI or
//! MPICH). Start the ranks with `mpirun -n N program`.
//!
//! Every MPI call runs on one service thread, which initializes MPI, owns its handles and
//! finalizes it when the [`MpiComm`] is dropped: the communicator can then be shared by the
//! threads of a rank (a ring's exchange runs beside its attention) without MPI being asked for
//! more than `MPI_THREAD_FUNNELED`. A rank waits for the service thread at most the
//! communicator's timeout; after it, the rank's call fails, and a rank that fails ends its
//! process, which makes `mpirun` end every rank.

use std::sync::Mutex;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::Duration;

use mpi::datatype::Equivalence;
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::traits::*;

use super::comm::{CommError, Communicator, block_len};
use super::threads::DEFAULT_TIMEOUT;

/// One collective, as the service thread runs it.
enum Call {
    SendRecv {
        send: Vec<f32>,
        to: usize,
        recv_len: usize,
        from: usize,
    },
    AllToAll(Vec<f32>),
    AllReduce(Vec<f32>),
    AllGather(Vec<f32>),
    Abort(i32),
}

type Reply = Result<Vec<f32>, String>;

/// A call and where its reply goes.
type Queue = Sender<(Call, Sender<Reply>)>;

/// This process's rank of `MPI_COMM_WORLD`.
pub struct MpiComm {
    rank: usize,
    size: usize,
    /// The service thread's queue; `None` once dropped.
    calls: Mutex<Option<Queue>>,
    service: Option<std::thread::JoinHandle<()>>,
    timeout: Duration,
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // Closing the queue ends the service thread, which finalizes MPI; wait for it, so that
        // the process does not exit before (which `mpirun` counts as a failed rank).
        if let Ok(mut calls) = self.calls.lock() {
            calls.take();
        }
        if let Some(service) = self.service.take() {
            let _ = service.join();
        }
    }
}

impl MpiComm {
    /// Initializes MPI (once per process) on its service thread; a rank's calls wait for it
    /// at most [`DEFAULT_TIMEOUT`].
    pub fn init() -> Result<MpiComm, CommError> {
        Self::init_with_timeout(DEFAULT_TIMEOUT)
    }

    /// [`MpiComm::init`] with a rank's wait for a collective bounded by `timeout`.
    pub fn init_with_timeout(timeout: Duration) -> Result<MpiComm, CommError> {
        let (calls, incoming) = channel::<(Call, Sender<Reply>)>();
        let (ready, started) = channel::<Result<(usize, usize), String>>();
        let service = std::thread::Builder::new()
            .name("attn-mpi".into())
            .spawn(move || serve(incoming, ready))
            .map_err(|e| CommError {
                rank: 0,
                what: format!("cannot start MPI's thread: {e}"),
            })?;
        let (rank, size) = started
            .recv()
            .map_err(|_| "MPI's thread ended while starting".to_string())
            .and_then(|r| r)
            .map_err(|what| CommError { rank: 0, what })?;
        Ok(MpiComm {
            rank,
            size,
            calls: Mutex::new(Some(calls)),
            service: Some(service),
            timeout,
        })
    }

    /// Ends every rank of the job (`MPI_Abort`), for a rank that cannot go on: its peers would
    /// otherwise wait in their next collective.
    pub fn abort(&self, code: i32) {
        // The reply never comes: MPI_Abort ends the process.
        let _ = self.call(Call::Abort(code));
    }

    fn call(&self, call: Call) -> Result<Vec<f32>, CommError> {
        let (reply, answer) = channel();
        let calls = self
            .calls
            .lock()
            .map_err(|_| self.error("MPI's queue was poisoned by a panic".into()))?;
        calls
            .as_ref()
            .and_then(|c| c.send((call, reply)).ok())
            .ok_or_else(|| self.error("MPI's thread has ended".into()))?;
        drop(calls);
        match answer.recv_timeout(self.timeout) {
            Ok(reply) => reply.map_err(|what| self.error(what)),
            Err(RecvTimeoutError::Timeout) => Err(self.error(format!(
                "no answer from the other ranks within {:.1} s",
                self.timeout.as_secs_f64()
            ))),
            Err(RecvTimeoutError::Disconnected) => Err(self.error("MPI's thread has ended".into())),
        }
    }
}

/// The service thread: initializes MPI, reports the rank and size, then runs calls until the
/// communicator is dropped, and finalizes MPI.
fn serve(calls: Receiver<(Call, Sender<Reply>)>, ready: Sender<Result<(usize, usize), String>>) {
    let Some(universe) = mpi::initialize() else {
        let _ = ready.send(Err("MPI was initialized already in this process".into()));
        return;
    };
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    if ready.send(Ok((rank, size))).is_err() {
        return;
    }
    while let Ok((call, reply)) = calls.recv() {
        let _ = reply.send(run(&world, call));
    }
}

fn run(world: &SimpleCommunicator, call: Call) -> Reply {
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

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn engine(&self) -> &'static str {
        "mpi"
    }

    fn send_recv(
        &self,
        send: &[f32],
        to: usize,
        recv: &mut [f32],
        from: usize,
    ) -> Result<(), CommError> {
        let got = self.call(Call::SendRecv {
            send: send.to_vec(),
            to,
            recv_len: recv.len(),
            from,
        })?;
        recv.copy_from_slice(&got);
        Ok(())
    }

    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        block_len(self, send.len())?;
        if recv.len() != send.len() {
            return Err(self.error(format!(
                "all-to-all receives {} values into a buffer of {}",
                send.len(),
                recv.len()
            )));
        }
        let got = self.call(Call::AllToAll(send.to_vec()))?;
        recv.copy_from_slice(&got);
        Ok(())
    }

    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<(), CommError> {
        let got = self.call(Call::AllReduce(values.to_vec()))?;
        values.copy_from_slice(&got);
        Ok(())
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        if recv.len() != send.len() * self.size {
            return Err(self.error(format!(
                "all-gather of {} values from {} ranks into a buffer of {}",
                send.len(),
                self.size,
                recv.len()
            )));
        }
        let got = self.call(Call::AllGather(send.to_vec()))?;
        recv.copy_from_slice(&got);
        Ok(())
    }
}
