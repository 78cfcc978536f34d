//! What the machine can hold: large allocations are checked against the memory available
//! before they are made, so a size too large is refused with an error instead of aborting the
//! process when the allocation fails.

use crate::error::RuntimeError;

/// Bytes of memory available for new allocations (Linux: `MemAvailable` in /proc/meminfo);
/// `None` where it cannot be read.
pub fn available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses `bytes` (`None`: a count that overflowed) of `what` when they exceed the memory
/// available, naming both.
pub fn ensure_fits(what: &str, bytes: Option<u64>) -> Result<(), RuntimeError> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let Some(bytes) = bytes else {
        return Err(RuntimeError::Data(format!(
            "{what} would need more than 2^64 bytes of memory"
        )));
    };
    match available_bytes() {
        Some(free) if bytes > free => Err(RuntimeError::Data(format!(
            "{what} would need {:.2} GiB of memory; this machine has {:.2} GiB available",
            gib(bytes),
            gib(free)
        ))),
        _ => Ok(()),
    }
}

/// `Some(product)` of `factors` when it fits in 64 bits.
pub fn checked_product(factors: &[u64]) -> Option<u64> {
    factors.iter().try_fold(1u64, |p, &f| p.checked_mul(f))
}

/// `len` zeros for a kernel to accumulate into, written in parallel rather than left to the
/// allocator. A large zeroed allocation comes from `calloc` as pages mapped to the kernel's
/// shared zero page; a kernel that then reads and adds to each page takes a copy-on-write fault
/// per page, and each one flushes the TLB of every core running the process (measured: 30% of a
/// backward pass on a 2-core VM). Written pages fault once, locally, on whichever thread writes
/// them.
pub fn written_zeros(len: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let mut zeros = Vec::with_capacity(len);
    zeros.par_extend(rayon::iter::repeat_n(0f32, len));
    zeros
}
