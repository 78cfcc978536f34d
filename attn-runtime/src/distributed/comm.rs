//! The collectives context and data parallelism need, over an existing engine: threads in one
//! process ([`super::threads`]), MPI (feature `mpi`), NCCL (feature `nccl`).

use std::fmt;

/// A communication failure: a rank left, a message had another size than the call expected, a
/// peer did not answer in time, or the engine reported an error. Every rank of a failed
/// collective gets one (a rank that fails leaves the group, so its peers' next receive fails).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommError {
    /// The rank that saw the failure.
    pub rank: usize,
    /// What failed, in words.
    pub what: String,
}

impl fmt::Display for CommError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}: {}", self.rank, self.what)
    }
}

impl std::error::Error for CommError {}

/// A group of ranks and the collectives over it, on f32 buffers. Every rank of the group calls
/// the same collectives in the same order; each checks what it receives against what it
/// expects, so a wrong-sized buffer is an error, not memory read past its end.
pub trait Communicator: Send + Sync {
    /// This rank, `0..size`.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn size(&self) -> usize;

    /// The engine's name (`threads`, `mpi`), for messages.
    fn engine(&self) -> &'static str;

    /// Sends `send` to rank `to` while receiving `recv.len()` values from rank `from` (a ring
    /// exchange: `to` one rank on, `from` one rank back).
    fn send_recv(
        &self,
        send: &[f32],
        to: usize,
        recv: &mut [f32],
        from: usize,
    ) -> Result<(), CommError>;

    /// All-to-all of equal blocks: block `j` of `send` (its length over the ranks) goes to rank
    /// `j`, and block `i` of `recv` (as long as `send`) comes from rank `i`.
    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError>;

    /// The element-wise sum over the ranks, in place, the same bits on every rank.
    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<(), CommError>;

    /// Every rank's `send` (all of one length), in rank order, into `recv`.
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError>;

    /// Waits until every rank has called it.
    fn barrier(&self) -> Result<(), CommError> {
        self.all_reduce_sum(&mut [])
    }

    /// A [`CommError`] of this rank.
    fn error(&self, what: String) -> CommError {
        CommError {
            rank: self.rank(),
            what,
        }
    }
}

/// A shared communicator is one (a rank's `Arc` handed to the ops that keep it).
impl<C: Communicator + ?Sized> Communicator for std::sync::Arc<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn size(&self) -> usize {
        (**self).size()
    }

    fn engine(&self) -> &'static str {
        (**self).engine()
    }

    fn send_recv(
        &self,
        send: &[f32],
        to: usize,
        recv: &mut [f32],
        from: usize,
    ) -> Result<(), CommError> {
        (**self).send_recv(send, to, recv, from)
    }

    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        (**self).all_to_all(send, recv)
    }

    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<(), CommError> {
        (**self).all_reduce_sum(values)
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        (**self).all_gather(send, recv)
    }
}

/// Checks that a buffer of `len` values splits into `parts` equal blocks, for all-to-all.
pub(crate) fn block_len(comm: &dyn Communicator, len: usize) -> Result<usize, CommError> {
    let n = comm.size();
    if !len.is_multiple_of(n) {
        return Err(comm.error(format!(
            "all-to-all of {len} values over {n} ranks: the buffer must split into {n} equal \
             blocks"
        )));
    }
    Ok(len / n)
}
