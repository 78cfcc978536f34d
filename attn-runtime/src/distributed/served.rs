//! Communicators whose engine runs on a service thread of its own (MPI, NCCL): the engine is
//! made, used and dropped on that thread, so that handles which may not cross threads never do,
//! and the communicator can be shared by a rank's threads. A rank waits for an answer at most
//! its timeout; a rank that fails ends its process, which makes the launcher end every rank.

use std::sync::Mutex;
use std::sync::mpsc::{RecvTimeoutError, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

use super::comm::{CommError, Communicator, block_len};

/// One collective, as an engine runs it.
pub(crate) enum Call {
    SendRecv {
        send: Vec<f32>,
        to: usize,
        recv_len: usize,
        from: usize,
    },
    AllToAll(Vec<f32>),
    AllReduce(Vec<f32>),
    AllGather(Vec<f32>),
    /// End every rank of the job (the process does not come back).
    Abort(i32),
}

/// A collective's result, or what went wrong.
pub(crate) type Reply = Result<Vec<f32>, String>;

/// A call and where its reply goes.
type Queue = Sender<(Call, Sender<Reply>)>;

/// An engine, on its service thread.
pub(crate) trait Engine {
    /// This rank and the ranks in the group.
    fn rank_and_size(&self) -> (usize, usize);

    /// Runs one collective.
    fn run(&mut self, call: Call) -> Reply;
}

/// A communicator over an engine on its service thread.
pub(crate) struct ServedComm {
    engine: &'static str,
    rank: usize,
    size: usize,
    /// The service thread's queue; `None` once dropped.
    calls: Mutex<Option<Queue>>,
    service: Option<JoinHandle<()>>,
    timeout: Duration,
}

impl ServedComm {
    /// Starts the service thread, which makes the engine with `init` and serves calls until the
    /// communicator is dropped.
    pub fn start<E: Engine + 'static>(
        engine: &'static str,
        timeout: Duration,
        init: impl FnOnce() -> Result<E, String> + Send + 'static,
    ) -> Result<ServedComm, CommError> {
        let (calls, incoming) = channel::<(Call, Sender<Reply>)>();
        let (ready, started) = channel::<Result<(usize, usize), String>>();
        let service = std::thread::Builder::new()
            .name(format!("attn-{engine}"))
            .spawn(move || {
                let mut engine = match init() {
                    Ok(e) => e,
                    Err(what) => {
                        let _ = ready.send(Err(what));
                        return;
                    }
                };
                if ready.send(Ok(engine.rank_and_size())).is_err() {
                    return;
                }
                while let Ok((call, reply)) = incoming.recv() {
                    let _ = reply.send(engine.run(call));
                }
            })
            .map_err(|e| CommError {
                rank: 0,
                what: format!("cannot start {engine}'s thread: {e}"),
            })?;
        let (rank, size) = started
            .recv()
            .map_err(|_| format!("{engine}'s thread ended while starting"))
            .and_then(|r| r)
            .map_err(|what| CommError { rank: 0, what })?;
        Ok(ServedComm {
            engine,
            rank,
            size,
            calls: Mutex::new(Some(calls)),
            service: Some(service),
            timeout,
        })
    }

    /// Runs `call` on the service thread, waiting at most the timeout.
    pub fn call(&self, call: Call) -> Result<Vec<f32>, CommError> {
        let (reply, answer) = channel();
        let calls = self
            .calls
            .lock()
            .map_err(|_| self.error("the engine's queue was poisoned by a panic".into()))?;
        calls
            .as_ref()
            .and_then(|c| c.send((call, reply)).ok())
            .ok_or_else(|| self.error(format!("{}'s thread has ended", self.engine)))?;
        drop(calls);
        match answer.recv_timeout(self.timeout) {
            Ok(reply) => reply.map_err(|what| self.error(what)),
            Err(RecvTimeoutError::Timeout) => Err(self.error(format!(
                "no answer from the other ranks within {:.1} s",
                self.timeout.as_secs_f64()
            ))),
            Err(RecvTimeoutError::Disconnected) => {
                Err(self.error(format!("{}'s thread has ended", self.engine)))
            }
        }
    }

    /// Copies `got` into `into`, which the engine was asked to fill.
    fn fill(&self, got: Vec<f32>, into: &mut [f32]) -> Result<(), CommError> {
        if got.len() != into.len() {
            return Err(self.error(format!(
                "the engine returned {} values; this call expects {}",
                got.len(),
                into.len()
            )));
        }
        into.copy_from_slice(&got);
        Ok(())
    }
}

impl Drop for ServedComm {
    fn drop(&mut self) {
        // Closing the queue ends the service thread, which drops (finalizes) the engine; wait
        // for it, so that the process does not exit first (which `mpirun` counts as a failed
        // rank).
        if let Ok(mut calls) = self.calls.lock() {
            calls.take();
        }
        if let Some(service) = self.service.take() {
            let _ = service.join();
        }
    }
}

impl Communicator for ServedComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn engine(&self) -> &'static str {
        self.engine
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
        self.fill(got, recv)
    }

    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        block_len(self, send.len())?;
        let got = self.call(Call::AllToAll(send.to_vec()))?;
        self.fill(got, recv)
    }

    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<(), CommError> {
        let got = self.call(Call::AllReduce(values.to_vec()))?;
        self.fill(got, values)
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let got = self.call(Call::AllGather(send.to_vec()))?;
        self.fill(got, recv)
    }
}

/// A communicator type over a [`ServedComm`] (its field `0`).
macro_rules! served_communicator {
    ($t:ty) => {
        impl $crate::distributed::Communicator for $t {
            fn rank(&self) -> usize {
                self.0.rank()
            }

            fn size(&self) -> usize {
                self.0.size()
            }

            fn engine(&self) -> &'static str {
                self.0.engine()
            }

            fn send_recv(
                &self,
                send: &[f32],
                to: usize,
                recv: &mut [f32],
                from: usize,
            ) -> Result<(), $crate::distributed::CommError> {
                self.0.send_recv(send, to, recv, from)
            }

            fn all_to_all(
                &self,
                send: &[f32],
                recv: &mut [f32],
            ) -> Result<(), $crate::distributed::CommError> {
                self.0.all_to_all(send, recv)
            }

            fn all_reduce_sum(
                &self,
                values: &mut [f32],
            ) -> Result<(), $crate::distributed::CommError> {
                self.0.all_reduce_sum(values)
            }

            fn all_gather(
                &self,
                send: &[f32],
                recv: &mut [f32],
            ) -> Result<(), $crate::distributed::CommError> {
                self.0.all_gather(send, recv)
            }
        }
    };
}
pub(crate) use served_communicator;
