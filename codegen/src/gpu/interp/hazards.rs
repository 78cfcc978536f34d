//! Shared-memory races, by vector clocks. The interpreter runs warps in lockstep, which would
//! hide a missing barrier; hardware runs them in any order. So a byte one warp wrote may be
//! neither read nor written by another, and a byte one warp read may not be written by another,
//! unless synchronization orders the two accesses: a `bar.sync` between them, or an mbarrier
//! phase the first side arrived on (or completed a copy on) and the second waited for.
//!
//! Each agent (a warp, or the asynchronous copies completing on one mbarrier) keeps a vector
//! clock: what it knows of every agent's progress. An access is stamped with its agent's own
//! clock; a later access by another agent is ordered after it when the later agent's clock of
//! the first has reached the stamp. Releases (arriving, completing a copy, reaching `bar.sync`)
//! publish a clock and then advance the agent's own; acquires (passing a barrier, waiting for a
//! phase) join a published clock into the agent's.

/// The agents that may write shared memory besides the warps: the TMA copies completing on
/// each of at most this many mbarriers.
pub(super) const MAX_COPY_AGENTS: usize = 16;

pub(super) struct Hazards {
    warps: usize,
    /// Warps and copy agents.
    agents: usize,
    /// `clocks[a * agents + b]`: what agent `a` knows of agent `b`'s clock.
    clocks: Vec<u32>,
    /// Per byte: the agent and stamp of its last write (stamp 0: never written).
    written: Vec<(u16, u32)>,
    /// `read[byte * warps + w]`: warp `w`'s stamp at its last read of the byte (0: never).
    read: Vec<u32>,
    /// The mbarriers (shared offsets) whose copies have an agent, by agent index past the warps.
    copy_agents: Vec<usize>,
}

/// A published vector clock (what an mbarrier phase carries from its arrivals to its waiters).
pub(super) type Clock = Vec<u32>;

impl Hazards {
    pub(super) fn new(bytes: usize, warps: usize) -> Hazards {
        let agents = warps + MAX_COPY_AGENTS;
        let mut clocks = vec![0; agents * agents];
        // Own clocks start at 1, so that no byte counts as touched before its first access.
        for a in 0..agents {
            clocks[a * agents + a] = 1;
        }
        Hazards {
            warps,
            agents,
            clocks,
            written: vec![(0, 0); bytes],
            read: vec![0; bytes * warps],
            copy_agents: Vec::new(),
        }
    }

    /// An empty published clock.
    pub(super) fn zero(&self) -> Clock {
        vec![0; self.agents]
    }

    fn knows(&self, agent: usize, of: usize) -> u32 {
        self.clocks[agent * self.agents + of]
    }

    fn own(&self, agent: usize) -> u32 {
        self.knows(agent, agent)
    }

    fn who(&self, agent: usize) -> String {
        match agent.checked_sub(self.warps) {
            None => format!("warp {agent}"),
            Some(i) => format!(
                "a TMA copy completing on the mbarrier at {}",
                self.copy_agents.get(i).copied().unwrap_or(0)
            ),
        }
    }

    /// The agent of the copies that complete on the mbarrier at `bar`.
    pub(super) fn copy_agent(&mut self, bar: usize) -> Result<usize, String> {
        if let Some(i) = self.copy_agents.iter().position(|&b| b == bar) {
            return Ok(self.warps + i);
        }
        if self.copy_agents.len() == MAX_COPY_AGENTS {
            return Err(format!(
                "TMA copies complete on more than {MAX_COPY_AGENTS} mbarriers (this interpreter \
                 tracks that many)"
            ));
        }
        self.copy_agents.push(bar);
        Ok(self.warps + self.copy_agents.len() - 1)
    }

    /// A read of `len` bytes at `at` by warp `warp`.
    pub(super) fn read(&mut self, warp: usize, at: usize, len: usize) -> Result<(), String> {
        let end = (at + len).min(self.written.len());
        for b in at..end {
            let (writer, stamp) = self.written[b];
            let writer = writer as usize;
            if stamp != 0 && writer != warp && self.knows(warp, writer) < stamp {
                return Err(format!(
                    "warp {warp} reads shared byte {b}, which {} wrote with no barrier between \
                     (a race on hardware)",
                    self.who(writer)
                ));
            }
            self.read[b * self.warps + warp] = self.own(warp);
        }
        Ok(())
    }

    /// A write of `len` bytes at `at` by `agent` (a warp, or a copy agent).
    pub(super) fn write(&mut self, agent: usize, at: usize, len: usize) -> Result<(), String> {
        let end = (at + len).min(self.written.len());
        for b in at..end {
            let (writer, stamp) = self.written[b];
            let writer = writer as usize;
            if stamp != 0 && writer != agent && self.knows(agent, writer) < stamp {
                return Err(format!(
                    "{} writes shared byte {b}, which {} wrote with no barrier between (a race \
                     on hardware)",
                    self.who(agent),
                    self.who(writer)
                ));
            }
            for reader in (0..self.warps).filter(|&r| r != agent) {
                let stamp = self.read[b * self.warps + reader];
                if stamp != 0 && self.knows(agent, reader) < stamp {
                    return Err(format!(
                        "{} writes shared byte {b}, which warp {reader} read with no barrier \
                         between (a race on hardware)",
                        self.who(agent)
                    ));
                }
            }
            self.written[b] = (agent as u16, self.own(agent));
        }
        Ok(())
    }

    /// `bar.sync`: every warp learns what every warp knows, then advances its own clock.
    pub(super) fn barrier(&mut self) {
        let mut joined = self.zero();
        for w in 0..self.warps {
            self.join_into(&mut joined, w);
        }
        for w in 0..self.warps {
            self.acquire(w, &joined);
            self.clocks[w * self.agents + w] += 1;
        }
    }

    fn join_into(&self, clock: &mut Clock, agent: usize) {
        let row = &self.clocks[agent * self.agents..(agent + 1) * self.agents];
        for (c, &k) in clock.iter_mut().zip(row) {
            *c = (*c).max(k);
        }
    }

    /// Joins `agent`'s clock into a published one (an arrival's contribution to a phase), then
    /// advances the agent's own clock.
    pub(super) fn release(&mut self, agent: usize, into: &mut Clock) {
        self.join_into(into, agent);
        self.clocks[agent * self.agents + agent] += 1;
    }

    /// `agent` learns a published clock.
    pub(super) fn acquire(&mut self, agent: usize, clock: &Clock) {
        let row = &mut self.clocks[agent * self.agents..(agent + 1) * self.agents];
        for (k, &c) in row.iter_mut().zip(clock) {
            *k = (*k).max(c);
        }
    }

    /// A copy agent starts a copy issued by `warp`: it knows what the warp knows, so the copy
    /// is ordered after the warp's earlier accesses.
    pub(super) fn issue_copy(&mut self, agent: usize, warp: usize) {
        let mut clock = self.zero();
        self.join_into(&mut clock, warp);
        self.acquire(agent, &clock);
    }
}
