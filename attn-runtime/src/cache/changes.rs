//! The log of writes a cache keeps for [`super::KvCache::changes_since`].

use super::RegionWrite;

/// Entries kept before the oldest are dropped (a decode step writes a few per kv head).
const CAPACITY: usize = 1 << 16;

/// Writes to a cache's memory by generation, merged where they touch, from a floor on: what
/// happened at or before the floor generation is unknown.
#[derive(Debug, Default)]
pub(crate) struct ChangeLog {
    floor: u64,
    entries: std::collections::VecDeque<(u64, RegionWrite)>,
}

impl ChangeLog {
    /// `len` bytes from byte `start` of `region` were written at `generation`.
    pub fn record(&mut self, generation: u64, region: usize, start: usize, len: usize) {
        if let Some((g, last)) = self.entries.back_mut()
            && *g == generation
            && last.region == region
            && last.start + last.len == start
        {
            last.len += len;
            return;
        }
        if self.entries.len() == CAPACITY
            && let Some((g, _)) = self.entries.pop_front()
        {
            self.floor = self.floor.max(g);
        }
        self.entries
            .push_back((generation, RegionWrite { region, start, len }));
    }

    /// The regions changed shape at `generation`: nothing before it can be replayed.
    pub fn reset(&mut self, generation: u64) {
        self.entries.clear();
        self.floor = generation;
    }

    /// The writes after `generation`, or `None` when the log does not reach back to it.
    pub fn since(&self, generation: u64) -> Option<Vec<RegionWrite>> {
        if generation < self.floor {
            return None;
        }
        Some(
            self.entries
                .iter()
                .filter(|(g, _)| *g > generation)
                .map(|(_, w)| *w)
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_merge_and_the_log_says_when_it_no_longer_reaches_back() {
        let mut log = ChangeLog::default();
        log.record(1, 0, 0, 8);
        log.record(1, 0, 8, 8);
        log.record(2, 0, 100, 4);
        let w = |start, len| RegionWrite {
            region: 0,
            start,
            len,
        };
        assert_eq!(log.since(0), Some(vec![w(0, 16), w(100, 4)]));
        assert_eq!(log.since(1), Some(vec![w(100, 4)]));
        assert_eq!(log.since(2), Some(vec![]));
        // Past the capacity, the oldest entries go and the floor rises with them.
        for g in 3..3 + CAPACITY as u64 {
            log.record(g, 0, 0, 2);
        }
        assert_eq!(log.since(1), None);
        assert!(log.since(3).is_some());
        log.reset(10);
        assert_eq!(log.since(9), None);
        assert_eq!(log.since(10), Some(vec![]));
    }
}
