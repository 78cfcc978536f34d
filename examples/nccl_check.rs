//! The NCCL engine on one GPU (feature `nccl`): a one-rank group's collectives give what they
//! should, and a context-parallel call over it equals the single call. `scripts/gpu-check.sh`
//! runs it where a GPU is lent; exit code 1 on a wrong result.
//!
//!   cargo run --release --features nccl --example nccl_check

use attn::distributed::{Communicator, ContextParallel, NcclComm, Scheme};
use attn::{Backend, CpuBackend, Inputs, Learned, RuntimeError, Variant};

fn main() {
    if let Err(e) = check() {
        eprintln!("nccl_check: {e}");
        std::process::exit(1);
    }
    println!("nccl_check: a one-rank NCCL group's collectives and a ring call over it are right");
}

fn check() -> Result<(), RuntimeError> {
    let comm = NcclComm::single(0)?;
    let mut sum = vec![1.0, 2.0, 3.0];
    comm.all_reduce_sum(&mut sum)?;
    let mut gathered = vec![0.0; 2];
    comm.all_gather(&[4.0, 5.0], &mut gathered)?;
    let mut moved = vec![0.0; 2];
    comm.all_to_all(&[6.0, 7.0], &mut moved)?;
    let mut ring = vec![0.0; 2];
    comm.send_recv(&[8.0, 9.0], 0, &mut ring, 0)?;
    let got = [sum, gathered, moved, ring];
    let want = [
        vec![1.0, 2.0, 3.0],
        vec![4.0, 5.0],
        vec![6.0, 7.0],
        vec![8.0, 9.0],
    ];
    if got != want {
        return Err(RuntimeError::Data(format!(
            "collectives gave {got:?}, expected {want:?}"
        )));
    }
    let variant = Variant::parse("heads = 4, head_dim = 32, mask = causal, position = rope")?;
    let q = attn::inputs::tensor(attn::DType::F32, &[1, 4, 64, 32], 1)?;
    let cpu = CpuBackend::new();
    let whole = cpu.forward(&variant, Inputs::heads(&q, &q, &q), 0)?;
    let cp = ContextParallel::new(&comm, &cpu, Scheme::Ring);
    let part = cp.forward(&variant, [&q, &q, &q], 0, Learned::none())?;
    let worst = whole
        .out
        .to_f32_vec()
        .iter()
        .zip(part.out.to_f32_vec())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    if worst > 1e-5 {
        return Err(RuntimeError::Data(format!(
            "the ring call differs by {worst}"
        )));
    }
    Ok(())
}
