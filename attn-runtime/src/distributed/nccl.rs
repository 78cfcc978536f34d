//! The NCCL engine (feature `nccl`): cudarc's NCCL bindings, for ranks that each drive one
//! NVIDIA GPU. Buffers cross to the device and back around each collective (attn's context
//! parallelism runs on the CPU backend; the engine is here for the collectives themselves).
//! NCCL runs on its own service thread ([`super::served`]); a group of several ranks is
//! started over another communicator (MPI, say), which carries NCCL's unique id from rank 0.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::result::{group_end, group_start};
use cudarc::nccl::{Comm, Id, ReduceOp};

use super::comm::{CommError, Communicator};
use super::served::{Call, Engine, Reply, ServedComm, served_communicator};
use super::threads::DEFAULT_TIMEOUT;

/// This rank of an NCCL group, on one GPU.
pub struct NcclComm(ServedComm);

served_communicator!(NcclComm);

impl NcclComm {
    /// A group of one rank on GPU `ordinal` (a check that NCCL and the device work).
    pub fn single(ordinal: usize) -> Result<NcclComm, CommError> {
        Self::start(ordinal, None, DEFAULT_TIMEOUT)
    }

    /// This rank's NCCL communicator on GPU `ordinal`, for the same ranks as `bootstrap` (rank
    /// 0 makes NCCL's unique id and the others receive it over `bootstrap`).
    pub fn over(bootstrap: &dyn Communicator, ordinal: usize) -> Result<NcclComm, CommError> {
        let mut id = vec![0f32; 128];
        if bootstrap.rank() == 0 {
            let made = Id::new().map_err(|e| bootstrap.error(format!("NCCL's id: {e:?}")))?;
            for (x, b) in id.iter_mut().zip(made.internal()) {
                *x = f32::from(*b as u8);
            }
        }
        // The others add zeros: every rank ends with rank 0's id.
        bootstrap.all_reduce_sum(&mut id)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (b, x) in internal.iter_mut().zip(&id) {
            *b = *x as u8 as std::ffi::c_char;
        }
        let group = (bootstrap.rank(), bootstrap.size(), internal);
        Self::start(ordinal, Some(group), DEFAULT_TIMEOUT)
    }

    /// Ends this rank's process with `code` (after NCCL's thread stops), for a rank that cannot
    /// go on: its launcher then ends the other ranks.
    pub fn abort(&self, code: i32) {
        let _ = self.0.call(Call::Abort(code));
    }

    fn start(
        ordinal: usize,
        group: Option<(usize, usize, [std::ffi::c_char; 128])>,
        timeout: Duration,
    ) -> Result<NcclComm, CommError> {
        ServedComm::start("nccl", timeout, move || {
            let ctx = CudaContext::new(ordinal).map_err(|e| format!("GPU {ordinal}: {e:?}"))?;
            let stream = ctx.default_stream();
            let comm = match group {
                None => Comm::from_devices(vec![Arc::clone(&stream)])
                    .map_err(|e| format!("NCCL: {e:?}"))?
                    .pop()
                    .ok_or("NCCL made no communicator")?,
                Some((rank, size, id)) => {
                    Comm::from_rank(Arc::clone(&stream), rank, size, Id::uninit(id))
                        .map_err(|e| format!("NCCL: {e:?}"))?
                }
            };
            Ok(Nccl { comm, stream })
        })
        .map(NcclComm)
    }
}

/// An NCCL communicator and its stream, on the service thread.
struct Nccl {
    comm: Comm,
    stream: Arc<CudaStream>,
}

fn nccl<E: std::fmt::Debug>(e: E) -> String {
    format!("NCCL: {e:?}")
}

impl Nccl {
    fn upload(&self, values: &[f32]) -> Result<CudaSlice<f32>, String> {
        self.stream.clone_htod(values).map_err(nccl)
    }

    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, String> {
        self.stream.alloc_zeros::<f32>(n).map_err(nccl)
    }

    fn download(&self, values: &CudaSlice<f32>) -> Result<Vec<f32>, String> {
        self.stream.clone_dtoh(values).map_err(nccl)
    }

    /// Every rank's `len`, compared: another length on any rank is an error on every rank.
    fn same_lengths(&self, len: usize, what: &str) -> Result<(), String> {
        let size = self.comm.world_size();
        let mine = self.upload(&[len as f32])?;
        let mut all = self.zeros(size)?;
        self.comm.all_gather(&mine, &mut all).map_err(nccl)?;
        let lengths = self.download(&all)?;
        if lengths.iter().all(|&n| n == lengths[0]) {
            return Ok(());
        }
        Err(format!(
            "the ranks called {what} with buffers of different lengths: {lengths:?}"
        ))
    }

    /// Sends `send` to each rank of `to` while receiving from each of `from` (one group call).
    fn exchange(
        &self,
        sends: &[(&CudaSlice<f32>, usize)],
        recvs: &mut [(&mut CudaSlice<f32>, usize)],
    ) -> Result<(), String> {
        group_start().map_err(nccl)?;
        for (s, to) in sends {
            self.comm.send(*s, *to as i32).map_err(nccl)?;
        }
        for (r, from) in recvs.iter_mut() {
            self.comm.recv(*r, *from as i32).map_err(nccl)?;
        }
        group_end().map_err(nccl)?;
        Ok(())
    }
}

impl Engine for Nccl {
    fn rank_and_size(&self) -> (usize, usize) {
        (self.comm.rank(), self.comm.world_size())
    }

    fn run(&mut self, call: Call) -> Reply {
        let size = self.comm.world_size();
        match call {
            Call::SendRecv {
                send,
                to,
                recv_len,
                from,
            } => {
                if to == from && to == self.comm.rank() {
                    return Ok(send);
                }
                // Lengths first, so that a wrong-sized buffer is an error, not a bad receive.
                let (len, mut got) = (self.upload(&[send.len() as f32])?, self.zeros(1)?);
                self.exchange(&[(&len, to)], &mut [(&mut got, from)])?;
                let got = self.download(&got)?[0] as usize;
                if got != recv_len {
                    return Err(format!(
                        "rank {from} sent {got} values; this call expects {recv_len}"
                    ));
                }
                let (send, mut recv) = (self.upload(&send)?, self.zeros(recv_len)?);
                self.exchange(&[(&send, to)], &mut [(&mut recv, from)])?;
                self.download(&recv)
            }
            Call::AllToAll(send) => {
                self.same_lengths(send.len(), "all-to-all")?;
                let n = send.len() / size;
                let me = self.comm.rank();
                let blocks: Vec<CudaSlice<f32>> = send
                    .chunks(n.max(1))
                    .map(|b| self.upload(b))
                    .collect::<Result<_, _>>()?;
                let mut recv: Vec<CudaSlice<f32>> =
                    (0..size).map(|_| self.zeros(n)).collect::<Result<_, _>>()?;
                let sends: Vec<(&CudaSlice<f32>, usize)> = blocks
                    .iter()
                    .enumerate()
                    .filter(|(peer, _)| *peer != me)
                    .map(|(peer, b)| (b, peer))
                    .collect();
                let mut recvs: Vec<(&mut CudaSlice<f32>, usize)> = recv
                    .iter_mut()
                    .enumerate()
                    .filter(|(peer, _)| *peer != me)
                    .map(|(peer, r)| (r, peer))
                    .collect();
                self.exchange(&sends, &mut recvs)?;
                let mut out = Vec::with_capacity(send.len());
                for (peer, r) in recv.iter().enumerate() {
                    match peer == me {
                        true => out.extend_from_slice(&send[me * n..(me + 1) * n]),
                        false => out.extend(self.download(r)?),
                    }
                }
                Ok(out)
            }
            Call::AllReduce(values) => {
                self.same_lengths(values.len(), "all-reduce")?;
                let (send, mut sum) = (self.upload(&values)?, self.zeros(values.len())?);
                self.comm
                    .all_reduce(&send, &mut sum, &ReduceOp::Sum)
                    .map_err(nccl)?;
                self.download(&sum)
            }
            Call::AllGather(send) => {
                self.same_lengths(send.len(), "all-gather")?;
                let (mine, mut all) = (self.upload(&send)?, self.zeros(send.len() * size)?);
                self.comm.all_gather(&mine, &mut all).map_err(nccl)?;
                self.download(&all)
            }
            Call::Abort(code) => std::process::exit(code),
        }
    }
}
