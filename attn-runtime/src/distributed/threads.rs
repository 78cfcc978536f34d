//! The in-process engine: ranks are threads of one process, messages go over channels. For
//! tests, for `--ranks N` in every build, and as the reference the other engines meet.
//!
//! A rank that returns (or fails) drops its [`ThreadComm`], and with it its ends of the
//! channels: a peer waiting on it gets an error at once, and a peer that waits on a live but
//! silent rank gets one after the group's timeout. Nothing waits forever.

use std::sync::Mutex;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::Duration;

use super::comm::{CommError, Communicator, block_len};

/// How long a rank waits for a peer's message before it gives up, unless the group is made with
/// another timeout ([`group_with_timeout`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// One rank of an in-process group ([`group`]).
pub struct ThreadComm {
    rank: usize,
    /// `to[j]`: messages from this rank to rank `j`.
    to: Vec<Sender<Vec<f32>>>,
    /// `from[i]`: messages from rank `i` to this one.
    from: Vec<Mutex<Receiver<Vec<f32>>>>,
    timeout: Duration,
}

/// A group of `ranks` ranks, one [`ThreadComm`] each (hand each to its own thread), with the
/// [`DEFAULT_TIMEOUT`].
pub fn group(ranks: usize) -> Vec<ThreadComm> {
    group_with_timeout(ranks, DEFAULT_TIMEOUT)
}

/// [`group`] with a rank's wait for a message bounded by `timeout`.
pub fn group_with_timeout(ranks: usize, timeout: Duration) -> Vec<ThreadComm> {
    // channels[i][j] carries messages from rank i to rank j.
    let mut senders: Vec<Vec<Sender<Vec<f32>>>> = (0..ranks).map(|_| Vec::new()).collect();
    let mut receivers: Vec<Vec<Mutex<Receiver<Vec<f32>>>>> =
        (0..ranks).map(|_| Vec::new()).collect();
    for sent_by in senders.iter_mut() {
        for received_by in receivers.iter_mut() {
            let (tx, rx) = channel();
            sent_by.push(tx);
            received_by.push(Mutex::new(rx));
        }
    }
    senders
        .into_iter()
        .zip(receivers)
        .enumerate()
        .map(|(rank, (to, from))| ThreadComm {
            rank,
            to,
            from,
            timeout,
        })
        .collect()
}

impl ThreadComm {
    fn send(&self, to: usize, values: &[f32]) -> Result<(), CommError> {
        let channel = self.to.get(to).ok_or_else(|| self.no_rank(to))?;
        channel
            .send(values.to_vec())
            .map_err(|_| self.error(format!("rank {to} left the group before this send")))
    }

    /// Receives rank `from`'s next message into `into`, which must be as long.
    fn recv(&self, from: usize, into: &mut [f32]) -> Result<(), CommError> {
        let channel = self.from.get(from).ok_or_else(|| self.no_rank(from))?;
        let channel = channel
            .lock()
            .map_err(|_| self.error("a receive panicked on another thread".into()))?;
        let message = channel.recv_timeout(self.timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => self.error(format!(
                "no message from rank {from} within {:.1} s",
                self.timeout.as_secs_f64()
            )),
            RecvTimeoutError::Disconnected => self.error(format!("rank {from} left the group")),
        })?;
        if message.len() != into.len() {
            return Err(self.error(format!(
                "rank {from} sent {} values; this call expects {}",
                message.len(),
                into.len()
            )));
        }
        into.copy_from_slice(&message);
        Ok(())
    }

    fn no_rank(&self, rank: usize) -> CommError {
        self.error(format!(
            "there is no rank {rank} in a group of {}",
            self.to.len()
        ))
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.to.len()
    }

    fn engine(&self) -> &'static str {
        "threads"
    }

    fn send_recv(
        &self,
        send: &[f32],
        to: usize,
        recv: &mut [f32],
        from: usize,
    ) -> Result<(), CommError> {
        // Channels are unbounded: the send never waits, so the exchange cannot deadlock.
        self.send(to, send)?;
        self.recv(from, recv)
    }

    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let n = block_len(self, send.len())?;
        if recv.len() != send.len() {
            return Err(self.error(format!(
                "all-to-all receives {} values into a buffer of {}",
                send.len(),
                recv.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        for (to, block) in send.chunks(n).enumerate() {
            self.send(to, block)?;
        }
        for (from, block) in recv.chunks_mut(n).enumerate() {
            self.recv(from, block)?;
        }
        Ok(())
    }

    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<(), CommError> {
        let mut every = vec![0f32; values.len() * self.size()];
        self.all_gather(values, &mut every)?;
        // Summed in rank order on every rank: the same bits everywhere.
        values.fill(0.0);
        for part in every.chunks(values.len().max(1)) {
            for (x, y) in values.iter_mut().zip(part) {
                *x += y;
            }
        }
        Ok(())
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        if recv.len() != send.len() * self.size() {
            return Err(self.error(format!(
                "all-gather of {} values from {} ranks into a buffer of {}",
                send.len(),
                self.size(),
                recv.len()
            )));
        }
        for to in 0..self.size() {
            self.send(to, send)?;
        }
        if send.is_empty() {
            // Still one (empty) message from every rank: a barrier.
            for from in 0..self.size() {
                self.recv(from, &mut [])?;
            }
            return Ok(());
        }
        for (from, block) in recv.chunks_mut(send.len()).enumerate() {
            self.recv(from, block)?;
        }
        Ok(())
    }
}
