//! The interpreter's control flow: a resumable walk of structured statements, so that the two
//! sides of a divergent `if` can run as coroutines. An `if` runs its `then` side until that
//! finishes or blocks at an mbarrier wait whose phase has not completed, then its `else` side,
//! and so on, until both finish; when neither can move, the `if` is blocked in turn, and so on
//! up to the kernel (a deadlock, reported). Kernels without such waits run exactly as in
//! lockstep: the whole `then` side, then the whole `else` side. Warp-specialized kernels (a
//! producer's loop and a consumer's loop on opposite sides of one `if`, synchronized by
//! mbarriers) run as on hardware, each side as far as its waits allow.
//!
//! Nesting follows the program's (bounded by the parser and the lowerings); loops are frames,
//! never recursion.

use super::{Cta, Val};
use crate::gpu::ir::{Reg, Stmt};

/// A resumable run of statements.
#[derive(Clone)]
pub(super) struct Stepper<'k> {
    frames: Vec<Frame<'k>>,
}

#[derive(Clone)]
enum Frame<'k> {
    /// `body[next..]` for the threads of `mask`.
    Block {
        body: &'k [Stmt],
        next: usize,
        mask: Vec<bool>,
    },
    /// A loop over `body` for the threads of `mask` whose counter is below its end; `last` is
    /// the set of threads that ran the previous pass (their counters advance next).
    Loop {
        reg: Reg,
        step: i64,
        body: &'k [Stmt],
        mask: Vec<bool>,
        ends: Vec<i64>,
        last: Option<Vec<bool>>,
    },
    /// The two sides of an `if`, taking turns.
    Fork {
        sides: Box<[Stepper<'k>; 2]>,
        done: [bool; 2],
        turn: usize,
    },
}

/// How far a run got.
pub(super) enum Run {
    /// Everything ran.
    Done,
    /// Stopped at a wait that cannot complete yet, and why; whether any statement ran first.
    Blocked { why: String, moved: bool },
}

impl<'k> Stepper<'k> {
    pub(super) fn new(body: &'k [Stmt], mask: Vec<bool>) -> Stepper<'k> {
        Stepper {
            frames: vec![Frame::Block {
                body,
                next: 0,
                mask,
            }],
        }
    }

    /// The same run for the threads of `keep` only.
    fn restricted(&self, keep: &[bool]) -> Stepper<'k> {
        let and = |m: &[bool]| {
            m.iter()
                .zip(keep)
                .map(|(a, b)| *a && *b)
                .collect::<Vec<_>>()
        };
        let frames = self
            .frames
            .iter()
            .map(|f| match f {
                Frame::Block { body, next, mask } => Frame::Block {
                    body,
                    next: *next,
                    mask: and(mask),
                },
                Frame::Loop {
                    reg,
                    step,
                    body,
                    mask,
                    ends,
                    last,
                } => Frame::Loop {
                    reg: *reg,
                    step: *step,
                    body,
                    mask: and(mask),
                    ends: ends.clone(),
                    last: last.as_deref().map(and),
                },
                Frame::Fork { sides, done, turn } => Frame::Fork {
                    sides: Box::new([sides[0].restricted(keep), sides[1].restricted(keep)]),
                    done: *done,
                    turn: *turn,
                },
            })
            .collect();
        Stepper { frames }
    }
}

impl<'a> Cta<'a> {
    /// The kernel's body for every thread, to the end.
    pub(super) fn run_body(&mut self) -> Result<(), String> {
        let kernel: &'a crate::gpu::ir::Kernel = self.kernel;
        let mut all = Stepper::new(&kernel.body, vec![true; kernel.threads as usize]);
        match self.step(&mut all)? {
            Run::Done => Ok(()),
            Run::Blocked { why, .. } => Err(format!("deadlock: {why}")),
        }
    }

    /// Runs a stepper until it finishes or blocks.
    pub(super) fn step(&mut self, s: &mut Stepper<'a>) -> Result<Run, String> {
        let mut moved = false;
        loop {
            // Threads of one run that part at a named barrier (some pass, some wait) continue
            // as two runs, the passing one past the barrier.
            let mut split: Option<[Vec<bool>; 2]> = None;
            let Some(frame) = s.frames.last_mut() else {
                return Ok(Run::Done);
            };
            match frame {
                Frame::Block { body, next, mask } => {
                    let (body, mask_now) = (*body, &*mask);
                    if *next == body.len() || !mask_now.iter().any(|&m| m) {
                        s.frames.pop();
                        continue;
                    }
                    let stmt = &body[*next];
                    match stmt {
                        Stmt::If(c, then, otherwise) => {
                            let frame = self.if_frame(c, [then, otherwise], mask_now)?;
                            *next += 1;
                            s.frames.push(frame);
                        }
                        Stmt::For {
                            reg,
                            start,
                            end,
                            step,
                            body: inner,
                        } => {
                            let frame =
                                self.loop_frame(*reg, [start, end], *step, inner, mask_now)?;
                            *next += 1;
                            s.frames.push(frame);
                        }
                        Stmt::NamedBarrier {
                            id,
                            threads,
                            wait: true,
                        } => {
                            let [pass, wait] = self.named_sync(mask_now, id, *threads)?;
                            if !wait.contains(&true) {
                                *next += 1;
                            } else if !pass.contains(&true) {
                                return Ok(Run::Blocked {
                                    why: format!(
                                        "threads wait at a named barrier that not enough \
                                         threads reach ({threads} needed)"
                                    ),
                                    moved,
                                });
                            } else {
                                split = Some([pass, wait]);
                            }
                        }
                        Stmt::MbarWait { bar, parity } => {
                            if let Some(why) = self.mbar_pending(mask_now, bar, parity)? {
                                return Ok(Run::Blocked { why, moved });
                            }
                            self.leaf(stmt, mask_now)?;
                            *next += 1;
                        }
                        _ => {
                            self.leaf(stmt, mask_now)?;
                            *next += 1;
                        }
                    }
                    moved = true;
                }
                Frame::Loop {
                    reg,
                    step,
                    body,
                    mask,
                    ends,
                    last,
                } => {
                    let active = self.next_pass(*reg, *step, mask, ends, last)?;
                    if !active.contains(&true) {
                        s.frames.pop();
                        continue;
                    }
                    *last = Some(active.clone());
                    let body = *body;
                    s.frames.push(Frame::Block {
                        body,
                        next: 0,
                        mask: active,
                    });
                }
                Frame::Fork { sides, done, turn } => {
                    if let Some(why) = self.run_fork(sides, done, turn, &mut moved)? {
                        return Ok(Run::Blocked { why, moved });
                    }
                    s.frames.pop();
                }
            }
            if let Some([pass, wait]) = split {
                let mut passing = s.restricted(&pass);
                if let Some(Frame::Block { next, .. }) = passing.frames.last_mut() {
                    *next += 1;
                }
                let waiting = s.restricted(&wait);
                s.frames = vec![Frame::Fork {
                    sides: Box::new([passing, waiting]),
                    done: [false; 2],
                    turn: 0,
                }];
            }
        }
    }

    /// The frame of an `if` for the threads of `mask`: one side's block when every thread
    /// takes it, else a fork of both.
    fn if_frame(
        &mut self,
        c: &crate::gpu::ir::Expr,
        [then, otherwise]: [&'a [Stmt]; 2],
        mask: &[bool],
    ) -> Result<Frame<'a>, String> {
        let mut sides = [vec![false; mask.len()], vec![false; mask.len()]];
        for (t, c) in self.eval_all(c, mask)?.into_iter().enumerate() {
            if let Some(c) = c {
                sides[usize::from(!c.pred()?)][t] = true;
            }
        }
        let [yes, no] = sides;
        Ok(match (yes.contains(&true), no.contains(&true)) {
            (true, false) => Stepper::new(then, yes).frames.remove(0),
            (false, true) => Stepper::new(otherwise, no).frames.remove(0),
            _ => Frame::Fork {
                sides: Box::new([Stepper::new(then, yes), Stepper::new(otherwise, no)]),
                done: [false; 2],
                turn: 0,
            },
        })
    }

    /// The frame of a loop for the threads of `mask`: each thread's counter set to its start,
    /// its end kept.
    fn loop_frame(
        &mut self,
        reg: Reg,
        [start, end]: [&crate::gpu::ir::Expr; 2],
        step: i64,
        body: &'a [Stmt],
        mask: &[bool],
    ) -> Result<Frame<'a>, String> {
        let starts = self.eval_all(start, mask)?;
        let ends = self.eval_all(end, mask)?;
        let mut ends_of = vec![0i64; mask.len()];
        for (t, (st, e)) in starts.into_iter().zip(ends).enumerate() {
            if let (Some(st), Some(e)) = (st, e) {
                self.check_not_busy(t, reg)?;
                self.regs[t][reg.0 as usize] = Val::I64(st.int()?);
                ends_of[t] = e.int()?;
            }
        }
        Ok(Frame::Loop {
            reg,
            step,
            body,
            mask: mask.to_vec(),
            ends: ends_of,
            last: None,
        })
    }

    /// A loop's next pass: the counters of the threads that ran the last one (`last`, taken)
    /// advance by `step`; the threads of `mask` still below their ends run it.
    fn next_pass(
        &mut self,
        reg: Reg,
        step: i64,
        mask: &[bool],
        ends: &[i64],
        last: &mut Option<Vec<bool>>,
    ) -> Result<Vec<bool>, String> {
        let r = reg.0 as usize;
        if let Some(ran) = last.take() {
            for t in (0..ran.len()).filter(|&t| ran[t]) {
                let v = self.regs[t][r].int()?;
                self.regs[t][r] = Val::I64(v + step);
            }
        }
        (0..mask.len())
            .map(|t| Ok(mask[t] && self.regs[t][r].int()? < ends[t]))
            .collect()
    }

    /// The two sides of a fork in turn, each until it finishes or blocks: `None` once both
    /// finished, or why the fork blocks (both sides in turn, or the one left, ran without
    /// moving). `moved` is set when either side ran a statement.
    fn run_fork(
        &mut self,
        sides: &mut [Stepper<'a>; 2],
        done: &mut [bool; 2],
        turn: &mut usize,
        moved: &mut bool,
    ) -> Result<Option<String>, String> {
        let mut still = 0;
        while !(done[0] && done[1]) {
            let side = *turn;
            *turn = 1 - side;
            if done[side] {
                continue;
            }
            let run = self.step(&mut sides[side])?;
            let progressed = match &run {
                Run::Done => {
                    done[side] = true;
                    true
                }
                Run::Blocked { moved: m, .. } => *m,
            };
            if progressed {
                *moved = true;
                still = 0;
            } else {
                still += 1;
            }
            if let Run::Blocked { why, .. } = run
                && (still >= 2 || (still >= 1 && done[1 - side]))
            {
                return Ok(Some(why));
            }
        }
        Ok(None)
    }
}
