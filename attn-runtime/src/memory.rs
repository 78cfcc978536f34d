//! What the machine can hold: large allocations are checked against the memory available
//! before they are made, so a size too large is refused with an error instead of aborting the
//! process when the allocation fails. Also the pool of large f32 buffers that outputs come from
//! and dropped f32 tensors go back to ([`written_zeros`], [`recycle`]): at most 1 GiB, freed
//! by [`release_pooled`], and freed before an allocation the memory available would refuse.

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
    // Pooled buffers count as used: free them before refusing.
    if available_bytes().is_some_and(|free| bytes > free) {
        release_pooled();
    }
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

/// `len` zeros for a kernel to accumulate into or write, written in parallel rather than left to
/// the allocator, in a buffer from the [pool](recycle) when it holds one of about that size.
///
/// Fresh memory is slow to touch: a large zeroed allocation comes from `calloc` as pages mapped
/// to the kernel's shared zero page, and a kernel that then reads and adds to each page takes a
/// copy-on-write fault per page, each of which flushes the TLB of every core running the process
/// (measured: 30% of a backward pass on a 2-core VM). Written pages fault once, locally, on
/// whichever thread writes them; a reused buffer does not fault at all (measured: 6% of a
/// forward plus backward pass).
pub fn written_zeros(len: usize) -> Vec<f32> {
    use rayon::prelude::*;
    if let Some(mut buffer) = pooled(len) {
        buffer.truncate(len);
        buffer.par_chunks_mut(1 << 16).for_each(|c| c.fill(0.0));
        let short = len - buffer.len();
        buffer.par_extend(rayon::iter::repeat_n(0f32, short));
        return buffer;
    }
    let mut zeros = Vec::with_capacity(len);
    zeros.par_extend(rayon::iter::repeat_n(0f32, len));
    zeros
}

/// Buffers of fewer values are left to the allocator, which reuses small blocks itself.
const POOLED_MIN_VALUES: usize = 1 << 18;

/// Most bytes of buffers the pool keeps; a buffer given back past it is freed.
const POOL_MAX_BYTES: usize = 1 << 30;

/// Most buffers the pool keeps.
const POOL_MAX_BUFFERS: usize = 64;

/// Large f32 buffers given back (by [`recycle`], and by every f32 tensor's storage when it is
/// dropped), for [`written_zeros`] to reuse: a loop that runs the same shapes again (a training
/// step, a model's layers) then touches no fresh memory.
static POOL: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

/// The pool, or `None` when a thread panicked while holding it (the pool is then not used).
fn pool() -> Option<std::sync::MutexGuard<'static, Vec<Vec<f32>>>> {
    POOL.lock().ok()
}

/// Takes the pooled buffer that fits `len` values most tightly, if one has room for them and
/// wastes at most a quarter of its capacity.
fn pooled(len: usize) -> Option<Vec<f32>> {
    if len < POOLED_MIN_VALUES {
        return None;
    }
    let mut pool = pool()?;
    let best = pool
        .iter()
        .enumerate()
        .filter(|(_, b)| fits(len, b.capacity()))
        .min_by_key(|(_, b)| b.capacity())
        .map(|(i, _)| i)?;
    Some(pool.swap_remove(best))
}

/// Whether a pooled buffer of `capacity` values serves a request for `len`: it has room, and
/// wastes at most a quarter of itself.
fn fits(len: usize, capacity: usize) -> bool {
    len >= POOLED_MIN_VALUES && (len..=len.saturating_add(len / 4)).contains(&capacity)
}

/// Whether the pool, holding `count` buffers of `bytes` in all, keeps one more of `capacity`
/// values.
fn keeps(count: usize, bytes: usize, capacity: usize) -> bool {
    capacity >= POOLED_MIN_VALUES
        && count < POOL_MAX_BUFFERS
        && bytes.saturating_add(capacity.saturating_mul(4)) <= POOL_MAX_BYTES
}

/// Gives `buffer` to the pool for a later [`written_zeros`] of about its size; small buffers,
/// and any past the pool's bounds (1 GiB, 64 buffers), are freed instead.
pub fn recycle(buffer: Vec<f32>) {
    if buffer.capacity() < POOLED_MIN_VALUES {
        return;
    }
    let Some(mut pool) = pool() else { return };
    let held: usize = pool.iter().map(|b| b.capacity() * 4).sum();
    if keeps(pool.len(), held, buffer.capacity()) {
        pool.push(buffer);
    }
}

/// Frees every pooled buffer; returns the bytes freed.
pub fn release_pooled() -> usize {
    let Some(mut pool) = pool() else { return 0 };
    let bytes = pool.iter().map(|b| b.capacity() * 4).sum();
    pool.clear();
    bytes
}

/// Bytes the pool holds now.
pub fn pooled_bytes() -> usize {
    pool().map_or(0, |p| p.iter().map(|b| b.capacity() * 4).sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A size no other test of this binary asks for, so the shared pool's buffer stays ours.
    const LEN: usize = POOLED_MIN_VALUES + 4099;

    #[test]
    fn a_recycled_buffer_comes_back_as_zeros() {
        let mut used = written_zeros(LEN);
        used.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = i as f32 + 1.0);
        let address = used.as_ptr();
        recycle(used);
        // A little shorter still fits the buffer; its stale values are all overwritten.
        let again = written_zeros(LEN - 100);
        assert_eq!(again.as_ptr(), address, "the pooled buffer was not reused");
        assert_eq!(again.len(), LEN - 100);
        assert!(again.iter().all(|x| *x == 0.0));
        // Longer than the buffer holds: a fresh one.
        recycle(again);
        let longer = written_zeros(LEN + 1);
        assert_ne!(longer.as_ptr(), address);
        assert!(longer.iter().all(|x| *x == 0.0));
    }

    #[test]
    fn only_large_buffers_of_about_the_size_asked_for_are_reused() {
        let n = POOLED_MIN_VALUES;
        assert!(fits(n, n) && fits(n, n + n / 4));
        assert!(!fits(n, n - 1), "too small");
        assert!(!fits(n, n + n / 4 + 1), "wastes more than a quarter");
        assert!(!fits(n - 1, n - 1), "small requests go to the allocator");
        assert!(!fits(usize::MAX, usize::MAX - 1));
    }

    #[test]
    fn the_pool_keeps_at_most_its_bytes_and_buffers() {
        let n = POOLED_MIN_VALUES;
        assert!(keeps(0, 0, n));
        assert!(!keeps(0, 0, n - 1), "small buffers are freed");
        assert!(!keeps(POOL_MAX_BUFFERS, 0, n));
        assert!(keeps(1, POOL_MAX_BYTES - 4 * n, n));
        assert!(!keeps(1, POOL_MAX_BYTES - 4 * n + 1, n));
        assert!(!keeps(0, 0, usize::MAX));
    }

    #[test]
    fn dropped_f32_tensors_feed_the_pool() {
        // Far from the sizes the other test asks for, so neither takes the other's buffer.
        let len = 2 * LEN;
        let t = crate::Tensor::from_f32(&[len], vec![2.0; len]).unwrap();
        let address = t.f32_values().as_ptr();
        drop(t);
        let again = written_zeros(len);
        assert_eq!(
            again.as_ptr(),
            address,
            "the tensor's storage was not reused"
        );
        assert!(again.iter().all(|x| *x == 0.0));
    }
}
