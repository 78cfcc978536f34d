//! What the machine can hold: large allocations are checked against the memory available
//! before they are made, so a size too large is refused with an error instead of aborting the
//! process when the allocation fails. Also the pool of large f32 buffers that outputs come from
//! and dropped f32 tensors go back to ([`written_zeros`], [`recycle`]): at most 1 GiB, freed
//! by [`release_pooled`], and freed before an allocation the memory available would refuse.

use crate::error::RuntimeError;

/// How much memory a new allocation may take, and which limit says so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Available {
    /// Bytes.
    pub bytes: u64,
    /// The limit in words: "this machine", "the process's address-space limit (RLIMIT_AS)" or
    /// "the memory limit of this process's cgroup".
    pub limit: &'static str,
}

/// The memory available for new allocations: the least of the machine's free memory
/// (`MemAvailable`), what the process's address-space limit (`RLIMIT_AS`) leaves above its
/// present size, and what its cgroup's memory limit (v2 or v1, at every level up to the root)
/// leaves above the group's working set. `None` where none can be read (not Linux).
pub fn available() -> Option<Available> {
    [
        machine_available().map(|bytes| Available {
            bytes,
            limit: "this machine",
        }),
        address_space_headroom().map(|bytes| Available {
            bytes,
            limit: "the process's address-space limit (RLIMIT_AS)",
        }),
        cgroup_headroom().map(|bytes| Available {
            bytes,
            limit: "the memory limit of this process's cgroup",
        }),
    ]
    .into_iter()
    .flatten()
    .min_by_key(|a| a.bytes)
}

/// Bytes of memory available for new allocations ([`available`]); `None` where it cannot be
/// read.
pub fn available_bytes() -> Option<u64> {
    available().map(|a| a.bytes)
}

/// `MemAvailable` in /proc/meminfo.
fn machine_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    kib_field(&info, "MemAvailable:")
}

/// The value of a `Name:   N kB` line, in bytes.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// What `RLIMIT_AS` leaves above the process's present virtual size; `None` when unlimited.
#[cfg(unix)]
fn address_space_headroom() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid rlimit for getrlimit to write; it reads nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } != 0
        || limit.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let size = kib_field(&status, "VmSize:").unwrap_or(0);
    Some(limit.rlim_cur.saturating_sub(size))
}

#[cfg(not(unix))]
fn address_space_headroom() -> Option<u64> {
    None
}

/// Most cgroup levels looked at (a path deeper than this is cut at it).
const MAX_CGROUP_DEPTH: usize = 64;

/// The least headroom (limit minus working set) of the cgroups this process is in, at every
/// level from its own up to the root; `None` when no level has a limit.
fn cgroup_headroom() -> Option<u64> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut least: Option<u64> = None;
    for line in membership.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        // v2: `0::/path`, files memory.max and memory.current; v1: `N:memory:/path` (the
        // controller may share its line), files memory.limit_in_bytes and
        // memory.usage_in_bytes.
        let (root, files) = if controllers.is_empty() {
            ("/sys/fs/cgroup", V2)
        } else if controllers.split(',').any(|c| c == "memory") {
            ("/sys/fs/cgroup/memory", V1)
        } else {
            continue;
        };
        let mut dir = std::path::PathBuf::from(root);
        let mut levels = vec![dir.clone()];
        for part in path
            .split('/')
            .filter(|p| !p.is_empty())
            .take(MAX_CGROUP_DEPTH)
        {
            dir.push(part);
            levels.push(dir.clone());
        }
        for level in levels {
            if let Some(room) = headroom_at(&level, files) {
                least = Some(least.map_or(room, |l| l.min(room)));
            }
        }
    }
    least
}

/// A cgroup version's file names: limit, usage, and the memory.stat key of reclaimable page
/// cache.
type CgroupFiles = (&'static str, &'static str, &'static str);
const V2: CgroupFiles = ("memory.max", "memory.current", "inactive_file");
const V1: CgroupFiles = (
    "memory.limit_in_bytes",
    "memory.usage_in_bytes",
    "total_inactive_file",
);

/// Limit minus working set (usage less inactive page cache, which the kernel reclaims before it
/// refuses memory) of the cgroup at `dir`; `None` when it has no limit or no files.
fn headroom_at(dir: &std::path::Path, (limit, usage, inactive): CgroupFiles) -> Option<u64> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let limit: u64 = read(limit)?.trim().parse().ok()?; // "max" (no limit) does not parse
    // v1 writes "no limit" as a number near 2^63.
    if limit >= 1 << 60 {
        return None;
    }
    let usage: u64 = read(usage)?.trim().parse().ok()?;
    let cache = read("memory.stat")
        .and_then(|stat| {
            stat.lines().find_map(|l| {
                let (key, value) = l.split_once(' ')?;
                (key == inactive).then(|| value.trim().parse::<u64>().ok())?
            })
        })
        .unwrap_or(0);
    Some(limit.saturating_sub(usage.saturating_sub(cache)))
}

/// Requests of fewer bytes are not checked ([`ensure_fits`]).
pub const CHECKED_FROM: u64 = 16 << 20;

/// Refuses `bytes` (`None`: a count that overflowed) of `what` when they exceed the memory
/// [available], naming both and the limit that binds. Requests under [`CHECKED_FROM`] (16 MiB)
/// pass unchecked.
pub fn ensure_fits(what: &str, bytes: Option<u64>) -> Result<(), RuntimeError> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let Some(bytes) = bytes else {
        return Err(RuntimeError::Data(format!(
            "{what} would need more than 2^64 bytes of memory"
        )));
    };
    // Below this, a request is not worth the files the limits are read from (a decode step
    // asks once per token): if memory is that short, the process is at its end anyway.
    if bytes < CHECKED_FROM {
        return Ok(());
    }
    // Pooled buffers count as used: free them before refusing.
    if available_bytes().is_some_and(|free| bytes > free) {
        release_pooled();
    }
    match available() {
        Some(free) if bytes > free.bytes => Err(RuntimeError::Data(format!(
            "{what} would need {:.2} GiB of memory; {} leaves {:.2} GiB available",
            gib(bytes),
            free.limit,
            gib(free.bytes)
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

/// Bytes below which the C allocator serves a block from its heap once
/// [`keep_freed_memory`] has run (glibc's default is 128 KiB, raised as blocks are freed).
pub const HEAP_BLOCKS_UP_TO: usize = 32 << 20;
/// Free bytes the C allocator keeps at the top of its heap once [`keep_freed_memory`] has run
/// (glibc's default is 128 KiB).
pub const HEAP_KEEPS_FREE: usize = 1 << 30;

/// Makes the C allocator keep the memory a process frees for its next allocations: blocks up
/// to [`HEAP_BLOCKS_UP_TO`] come from the heap rather than from fresh mappings, and the heap
/// returns memory to the system only past [`HEAP_KEEPS_FREE`] free. For a loop that frees and
/// allocates the same few megabytes per step (candle's training step allocates a fresh tensor
/// per operation), this turns a page fault per page touched, each a TLB flush on every core,
/// into reuse (measured: 1.4x the tokens/s of a training step on a 2-core VM). The price is a
/// resident size that stays near its peak. Does nothing where the C library is not glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let (blocks, free) = (
            HEAP_BLOCKS_UP_TO as libc::c_int,
            HEAP_KEEPS_FREE as libc::c_int,
        );
        // SAFETY: mallopt only sets two of glibc's tuning parameters, to values within the
        // ranges its manual allows; it touches no memory of ours and is safe to call at any
        // time, from any thread.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, blocks);
            libc::mallopt(libc::M_TRIM_THRESHOLD, free);
        }
    }
}

/// An empty buffer with room for `len` values, from the [pool](recycle) when it holds one of
/// about that size: a copy into it touches no fresh pages (an input copied in once per
/// training step, say).
pub fn with_capacity(len: usize) -> Vec<f32> {
    match pooled(len) {
        Some(mut buffer) => {
            buffer.clear();
            buffer
        }
        None => Vec::with_capacity(len),
    }
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
    fn a_cgroup_limit_leaves_its_limit_less_the_working_set() {
        let dir = std::env::temp_dir().join(format!("attn-cgroup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
        write("memory.max", "1000000\n");
        write("memory.current", "600000\n");
        write(
            "memory.stat",
            "anon 500000\ninactive_file 100000\nactive_file 0\n",
        );
        // 1000000 - (600000 - 100000): the inactive page cache is reclaimable.
        assert_eq!(headroom_at(&dir, V2), Some(500_000));
        write("memory.max", "max\n");
        assert_eq!(headroom_at(&dir, V2), None, "no limit");
        write("memory.limit_in_bytes", "9223372036854771712\n");
        write("memory.usage_in_bytes", "10\n");
        assert_eq!(headroom_at(&dir, V1), None, "v1's number for no limit");
        write("memory.limit_in_bytes", "100\n");
        write("memory.usage_in_bytes", "300\n");
        assert_eq!(
            headroom_at(&dir, V1),
            Some(0),
            "over the limit: nothing left"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_memory_available_is_at_most_the_machines() {
        // MemAvailable moves while the other tests allocate: read it on both sides.
        let before = machine_available().expect("Linux has /proc/meminfo");
        let all = available().expect("Linux has /proc/meminfo");
        let after = machine_available().expect("Linux has /proc/meminfo");
        assert!(all.bytes <= before.max(after));
    }

    #[test]
    fn a_recycled_buffer_comes_back_empty_with_room() {
        // A size of its own: the pool is shared by the tests of this binary.
        let len = 5 * LEN + 77;
        let used = vec![1f32; len];
        let address = used.as_ptr();
        recycle(used);
        let again = with_capacity(len - 10);
        assert_eq!(again.as_ptr(), address, "the pooled buffer was not reused");
        assert!(again.is_empty() && again.capacity() >= len - 10);
        // Nothing pooled of this size: a new buffer, with room all the same.
        let fresh = with_capacity(len * 3);
        assert!(fresh.is_empty() && fresh.capacity() >= len * 3);
    }

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
