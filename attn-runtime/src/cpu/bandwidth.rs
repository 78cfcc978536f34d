//! The memory read ceiling of this machine: what decoding, which reads every cached key and
//! value once per step, is measured against.

use crate::error::RuntimeError;

/// Bytes each thread streams through (far past every cache level).
pub const BYTES_PER_THREAD: usize = 256 << 20;

/// GB/s (10^9 bytes per second) read by `threads` threads, each summing its own buffer of
/// [`BYTES_PER_THREAD`] over and over for `seconds`, the sums kept so the reads stay. The
/// buffers are checked against the memory available first.
pub fn peak_read_gbps(threads: usize, seconds: f64) -> Result<f64, RuntimeError> {
    let threads = threads.max(1);
    crate::memory::ensure_fits(
        "the read-bandwidth buffers",
        (threads as u64).checked_mul(BYTES_PER_THREAD as u64),
    )?;
    let per_thread: Vec<f64> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    // Distinct values per thread, so no page is shared or left untouched.
                    let data: Vec<u64> = (0..BYTES_PER_THREAD / 8)
                        .map(|i| (i % 251 + t) as u64)
                        .collect();
                    let start = std::time::Instant::now();
                    let mut passes = 0u64;
                    let mut total = 0u64;
                    while passes == 0 || start.elapsed().as_secs_f64() < seconds {
                        total = total.wrapping_add(sum(&data));
                        passes += 1;
                    }
                    std::hint::black_box(total);
                    (passes as f64 * BYTES_PER_THREAD as f64) / start.elapsed().as_secs_f64()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(0.0))
            .collect()
    });
    Ok(per_thread.iter().sum::<f64>() / 1e9)
}

/// The wrapping sum of `data` (integer adds vectorize freely and never wait on each other, so
/// the loads set the pace), with the widest vectors this CPU has, as the decode kernels use.
fn sum(data: &[u64]) -> u64 {
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked above).
        return unsafe { sum_avx512(data) };
    }
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { sum_avx2(data) };
    }
    sum_portable(data)
}

/// A plain fold: LLVM unrolls and vectorizes it into independent vector sums.
#[inline(always)]
fn sum_portable(data: &[u64]) -> u64 {
    data.iter().fold(0u64, |a, &x| a.wrapping_add(x))
}

/// [`sum_portable`] compiled for AVX-512.
#[target_feature(enable = "avx512f")]
unsafe fn sum_avx512(data: &[u64]) -> u64 {
    sum_portable(data)
}

/// [`sum_portable`] compiled for AVX2.
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(data: &[u64]) -> u64 {
    sum_portable(data)
}
