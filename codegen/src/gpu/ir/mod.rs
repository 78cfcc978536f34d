//! The GPU kernel IR: one CTA's program in SIMT form, between the kernel plan and LLVM NVPTX.
//!
//! Every thread runs the same structured program over its own registers; threads meet at
//! barriers and exchange values through shared memory and warp shuffles. Operations map one to
//! one onto PTX (`ex2.approx`, `lg2.approx`, `shfl.sync.bfly`, `bar.sync`, `ld`/`st` in the
//! global and shared spaces), so [`super::interp`], which runs this IR on the CPU, proves what
//! the LLVM lowering will run.

pub mod parse;
mod print;
pub mod target;
pub mod tma;
pub mod verify;

/// Types of values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    /// A predicate.
    Pred,
    /// 32-bit integer.
    I32,
    /// 64-bit integer (also addresses, in bytes).
    I64,
    /// 32-bit float.
    F32,
    /// A TMA tensor map (`CUtensorMap`, 128 bytes), only as a kernel parameter, passed by value
    /// as a `__grid_constant__`, and only an operand of [`Stmt::TmaLoad`].
    TensorMap,
}

/// A thread-private register (a mutable variable; LLVM's mem2reg makes it SSA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Reg(pub u32);

/// Values the hardware provides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Special {
    /// `%tid.x`: the thread's index in its CTA.
    Tid,
    /// `%ntid.x`: threads per CTA.
    Ntid,
    /// `%ctaid.{x,y,z}`: the CTA's index in the grid, by axis 0..3.
    Ctaid(u8),
    /// `%laneid`: the thread's lane in its warp.
    Lane,
}

/// Memory spaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Space {
    /// Device memory (kernel parameters point into it).
    Global,
    /// The CTA's shared memory (addresses are byte offsets from its start).
    Shared,
}

/// Unary operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Un {
    /// Arithmetic negation.
    Neg,
    /// Absolute value.
    Abs,
    /// Logical not of a predicate.
    Not,
    /// `2^x` (`ex2.approx.f32`: at most 2 ulp from the true value).
    Ex2,
    /// `2^x` with subnormal inputs and results taken as zero (`ex2.approx.ftz.f32`): one
    /// instruction, where `ex2.approx.f32` takes four to scale subnormal results. For softmax
    /// terms, where a subnormal term is far below the resolution of a sum that holds a 1.
    Ex2Ftz,
    /// `log2 x` (`lg2.approx.f32`).
    Lg2,
    /// Square root (`sqrt.rn.f32`).
    Sqrt,
}

/// Binary operations. Integer operations wrap; integer division and remainder truncate (the
/// lowering guards against zero divisors, which PTX leaves undefined).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bin {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// Float division rounds to nearest (`div.rn.f32`).
    Div,
    /// Remainder with the sign of `a`.
    Rem,
    /// Minimum (for floats: `min.f32`, which returns the non-NaN operand).
    Min,
    /// Maximum (for floats `max.f32`).
    Max,
    /// Logical or bitwise and.
    And,
    /// Logical or bitwise or.
    Or,
    /// Shift left.
    Shl,
    /// `a < b` (a predicate).
    Lt,
    /// `a <= b`.
    Le,
    /// `a > b`.
    Gt,
    /// `a >= b`.
    Ge,
    /// `a == b`.
    Eq,
    /// `a != b`.
    Ne,
}

/// A 16-bit float format in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Half {
    /// bfloat16: the upper half of an f32.
    Bf16,
    /// IEEE binary16.
    F16,
}

/// Expressions, evaluated per thread.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// An integer constant of the given type.
    Int(i64, Ty),
    /// A float constant.
    F32(f32),
    /// A predicate constant.
    Pred(bool),
    /// A register.
    Reg(Reg),
    /// Kernel parameter `i` (by position).
    Param(u32),
    /// A hardware value (an I32).
    Special(Special),
    /// A unary operation.
    Un(Un, Box<Expr>),
    /// A binary operation (operands of one type).
    Bin(Bin, Box<Expr>, Box<Expr>),
    /// `a * b + c` rounded once (`fma.rn.f32`).
    Fma(Box<Expr>, Box<Expr>, Box<Expr>),
    /// `cond ? a : b`.
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
    /// Conversion: int to int (sign-extend or truncate), int to f32 (round to nearest), f32 to
    /// int (truncate toward zero, saturating; NaN gives 0), predicate to int (0 or 1).
    Cast(Box<Expr>, Ty),
    /// `ld.{space}` of a value of the type at a byte address (an I64).
    Load(Space, Ty, Box<Expr>),
    /// `ld.{space}.b16` of a 16-bit float at a byte address (2-aligned), widened to f32
    /// (exactly: `cvt.f32.f16` for f16, a shift for bf16).
    LoadHalf(Space, Half, Box<Expr>),
    /// A constant f32 table indexed by an integer, the index clamped into it.
    Table(Vec<f32>, Box<Expr>),
    /// `shfl.sync.bfly.b32` over the full warp: the value of lane `lane ^ mask`.
    ShflXor(Box<Expr>, u32),
    /// `cvt.rn.{bf16,f16}x2.f32`: two f32 rounded to the 16-bit format (to nearest even) and
    /// packed into an I32, the first in the low half.
    PackHalf(Half, Box<Expr>, Box<Expr>),
    /// The shared-window address (I64) of a byte offset into the kernel's shared memory, as
    /// `wgmma` matrix descriptors encode it. The kernel's shared memory starts on a 1024-byte
    /// boundary, so swizzle patterns computed from offsets and from addresses agree.
    SharedAddress(Box<Expr>),
}

/// The A operand of a [`Wgmma`] step.
#[derive(Clone, Debug, PartialEq)]
pub enum WgmmaA {
    /// A 64x16 tile in shared memory, K-major, by its matrix descriptor (an I64).
    Shared(Expr),
    /// The warpgroup's registers: per thread four I32 of packed 16-bit pairs, the layout of an
    /// `mma.m16n8k16` A fragment for the rows `16 w .. 16 w + 16` of warp `w` of the group.
    Regs([Reg; 4]),
}

/// One `wgmma.fence; wgmma.mma_async x steps; wgmma.commit_group` sequence of a warpgroup on
/// one accumulator, emitted as one asm block: `D = A_0 B_0 + .. + A_k B_k (+ D)`, each step a
/// `m64nNk16` product of f32 accumulation over 16-bit inputs. Every thread of the warpgroup
/// (128 consecutive threads from a multiple of 128) executes it. The accumulator `d` is
/// `n / 2` F32 registers per thread: register `4 j + i` holds row `16 w + g + 8 (i / 2)`,
/// column `8 j + 2 q + i % 2` (warp `w` of the group, `g = lane / 4`, `q = lane % 4`). The
/// products run asynchronously: `d` and register A operands may be touched only after a
/// [`Stmt::WgmmaWait`] completes the group, and shared operands may not be written before.
#[derive(Clone, Debug, PartialEq)]
pub struct Wgmma {
    /// The format of A and B.
    pub half: Half,
    /// The accumulator's columns (N): a multiple of 8 from 8 to 256.
    pub n: u32,
    /// The accumulator (`n / 2` F32 registers).
    pub d: Vec<Reg>,
    /// Whether the first step adds to `d` (a predicate; false overwrites it).
    pub accumulate: Expr,
    /// The steps: A, and B's matrix descriptor (16 x N, an I64).
    pub steps: Vec<(WgmmaA, Expr)>,
    /// B is N-major (`imm-trans-b` 1: N contiguous in shared memory), else K-major.
    pub b_n_major: bool,
}

/// Statements. Control flow is structured; barriers must be reached by every thread of the CTA.
#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// `reg = expr`.
    Set(Reg, Expr),
    /// `st.{space}` of a value at a byte address.
    Store(Space, Expr, Expr),
    /// `if cond { .. } else { .. }` (threads may diverge).
    If(Expr, Vec<Stmt>, Vec<Stmt>),
    /// `for reg in (start..end).step_by(step)` (I64 bounds; `step > 0`).
    For {
        /// The loop variable (an I64 register).
        reg: Reg,
        /// First value.
        start: Expr,
        /// The loop runs while the variable is below it (evaluated once per thread).
        end: Expr,
        /// Increment.
        step: i64,
        /// The loop body.
        body: Vec<Stmt>,
    },
    /// `bar.sync 0`.
    Barrier,
    /// `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 d, a, b, c`: a
    /// warp-collective `D = A B + C` over a 16x16 A, a 16x8 B (both of the 16-bit format
    /// `half`) and 16x8 f32 C/D, each lane holding the fragments of the PTX ISA layout (A: four
    /// I32 registers of two 16-bit values each, B: two, C and D: four F32). Every lane of the
    /// warp must execute it.
    Mma {
        /// The format of A and B.
        half: Half,
        /// The result fragment (four F32 registers).
        d: [Reg; 4],
        /// A fragment (four I32 registers of packed bf16 pairs).
        a: [Reg; 4],
        /// B fragment (two I32 registers of packed bf16 pairs).
        b: [Reg; 2],
        /// The accumulator fragment (four F32 registers).
        c: [Reg; 4],
    },
    /// `ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16 dst, [addr]`: a warp-collective
    /// load of one, two or four 8x8 matrices of 16-bit values from shared memory. Lanes
    /// `8 i .. 8 i + 8` give the byte addresses of matrix `i`'s rows (16 bytes each, 16-byte
    /// aligned). Lane `t` receives, in register `dst[i]`, row `t / 4`, elements `2 (t % 4)` and
    /// `2 (t % 4) + 1` of matrix `i` (the first in the low half); with `trans`, column `t / 4`,
    /// rows `2 (t % 4)` and `2 (t % 4) + 1` instead. Every lane of the warp must execute it.
    LdMatrix {
        /// One I32 register per matrix (one, two or four).
        dst: Vec<Reg>,
        /// This lane's row address (an I64 byte offset into shared memory).
        addr: Expr,
        /// Whether each matrix is transposed as it loads.
        trans: bool,
    },
    /// `cp.async.cg.shared.global [dst], [src], 16, src_bytes`: an asynchronous copy of 16 bytes
    /// from global to shared memory (both 16-byte aligned), of which the first `src_bytes` (an
    /// I32, 0 to 16) are read and the rest are zeros. The copy joins this thread's open group;
    /// its bytes land when a [`Stmt::CpAsyncWait`] completes the group, and are visible to other
    /// threads after a barrier that follows. Reading or writing them before is a race.
    CpAsync {
        /// Shared byte address (I64).
        dst: Expr,
        /// Global byte address (I64).
        src: Expr,
        /// Bytes read from `src` (I32, 0 to 16).
        src_bytes: Expr,
    },
    /// `cp.async.commit_group`: closes this thread's open group of copies.
    CpAsyncCommit,
    /// `cp.async.wait_group n`: waits until at most `n` of this thread's committed groups are
    /// still in flight (the oldest complete first).
    CpAsyncWait(u32),
    /// `mbarrier.init.shared::cta.b64 [bar], count` then `fence.mbarrier_init.release.cluster`:
    /// an mbarrier (8 bytes, 8-aligned, at a shared byte offset) in phase 0 expecting `count`
    /// arrivals per phase. Other threads may use it after a barrier.
    MbarInit {
        /// Shared byte offset (I64).
        bar: Expr,
        /// Arrivals per phase (1 to 2^20 - 1).
        count: u32,
    },
    /// `mbarrier.arrive{.expect_tx}.shared::cta.b64 _, [bar]{, tx}`: each executing thread
    /// arrives once; with `tx` (an I32), it first adds that many bytes the phase also waits for
    /// (copies complete them). A phase completes when every arrival and every byte is in.
    MbarArrive {
        /// Shared byte offset (I64).
        bar: Expr,
        /// Bytes of asynchronous copies the current phase also waits for.
        tx: Option<Expr>,
    },
    /// `mbarrier.try_wait.parity.shared::cta.b64` in a loop: waits until the phase of the
    /// given parity (an I32, 0 or 1) has completed, that is, until the barrier's current phase
    /// has the other parity. What that phase's arrivals and copies did is then visible.
    MbarWait {
        /// Shared byte offset (I64).
        bar: Expr,
        /// Parity of the phase waited for.
        parity: Expr,
    },
    /// `cp.async.bulk.tensor.{n}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes`:
    /// one thread copies a box of a tensor (the tensor map parameter `map`) at the element
    /// coordinates `coords` (I32, innermost first; elements outside the tensor read as zero) to
    /// shared memory at `dst` (1024-aligned under the 128-byte swizzle, else 128-aligned), laid
    /// out and swizzled as the map says. The box's bytes complete on the mbarrier at `bar`; they
    /// land when its phase completes, and only threads that wait for that phase may read them.
    TmaLoad {
        /// Shared byte offset (I64).
        dst: Expr,
        /// The [`Ty::TensorMap`] parameter, by position.
        map: u32,
        /// Coordinates, innermost dimension first (one to five I32).
        coords: Vec<Expr>,
        /// The mbarrier's shared byte offset (I64).
        bar: Expr,
    },
    /// `fence.proxy.async.shared::cta`: orders this thread's earlier ordinary shared-memory
    /// accesses before later asynchronous ones (`wgmma` operand reads, TMA writes).
    FenceProxyAsync,
    /// A warpgroup's matrix products (see [`Wgmma`]).
    Wgmma(Box<Wgmma>),
    /// `wgmma.wait_group.sync.aligned n`: waits until at most `groups` of the warpgroup's
    /// committed `wgmma` groups are in flight. `regs` are the accumulators the completed groups
    /// wrote that the program reads or writes afterwards; the asm block takes them as operands
    /// so that no access to them moves before the wait.
    WgmmaWait {
        /// Groups that may stay in flight.
        groups: u32,
        /// The accumulator registers it orders.
        regs: Vec<Reg>,
    },
    /// `setmaxnreg.{inc,dec}.sync.aligned.u32 regs`: the warpgroup's threads raise or lower
    /// their register budget (24 to 256, a multiple of 8). Every thread of the warpgroup
    /// executes it.
    SetMaxNReg {
        /// Raise (else lower) the budget.
        inc: bool,
        /// The new budget per thread.
        regs: u32,
    },
    /// `bar.sync id, threads` (`wait`) or `bar.arrive id, threads`: named barrier `id` (an I32,
    /// 1 to 15; 0 is [`Stmt::Barrier`]'s) completes a phase when `threads` (a multiple of 32)
    /// have arrived; `bar.sync` waits for it, `bar.arrive` does not. What the arriving threads
    /// did is then visible to the waiting ones. Whole warps execute it.
    NamedBarrier {
        /// The barrier (I32).
        id: Expr,
        /// Threads a phase takes.
        threads: u32,
        /// Whether to wait for the phase (`bar.sync`).
        wait: bool,
    },
}

/// A kernel: parameters, registers, the shared memory it uses, its CTA size and its program.
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    /// The entry point's name.
    pub name: String,
    /// Parameters by position: name and type (pointers are I64 byte addresses).
    pub params: Vec<(String, Ty)>,
    /// Registers by index: name and type.
    pub regs: Vec<(String, Ty)>,
    /// Bytes of shared memory.
    pub shared_bytes: u32,
    /// Threads per CTA.
    pub threads: u32,
    /// CTAs per SM the kernel's registers must allow: ptxas caps a thread at 64K registers /
    /// (`threads` x this), so a higher value trades registers for occupancy.
    pub ctas_per_sm: u32,
    /// The program every thread runs.
    pub body: Vec<Stmt>,
}

/// Whether any statement of a program, inside `if`s and loops too, satisfies `f`.
pub fn any_stmt(body: &[Stmt], f: &impl Fn(&Stmt) -> bool) -> bool {
    body.iter().any(|s| {
        f(s) || match s {
            Stmt::If(_, t, e) => any_stmt(t, f) || any_stmt(e, f),
            Stmt::For { body, .. } => any_stmt(body, f),
            _ => false,
        }
    })
}

impl Kernel {
    /// The type of an expression in this kernel (operand types are assumed consistent; the
    /// interpreter checks them).
    pub fn type_of(&self, e: &Expr) -> Ty {
        match e {
            Expr::Int(_, ty) | Expr::Cast(_, ty) | Expr::Load(_, ty, _) => *ty,
            Expr::PackHalf(..) => Ty::I32,
            Expr::SharedAddress(_) => Ty::I64,
            Expr::LoadHalf(..) => Ty::F32,
            Expr::F32(_) | Expr::Fma(..) | Expr::Table(..) => Ty::F32,
            Expr::Pred(_) => Ty::Pred,
            Expr::Reg(r) => self.regs[r.0 as usize].1,
            Expr::Param(i) => self.params[*i as usize].1,
            Expr::Special(_) => Ty::I32,
            Expr::Un(Un::Not, _) => Ty::Pred,
            Expr::Un(_, a) | Expr::ShflXor(a, _) | Expr::Select(_, a, _) => self.type_of(a),
            Expr::Bin(op, a, _) => match op {
                Bin::Lt | Bin::Le | Bin::Gt | Bin::Ge | Bin::Eq | Bin::Ne => Ty::Pred,
                _ => self.type_of(a),
            },
        }
    }
}

/// Shorthands for building expressions.
#[allow(missing_docs)]
pub mod build {
    use super::*;

    pub fn i64(x: i64) -> Expr {
        Expr::Int(x, Ty::I64)
    }
    pub fn f32(x: f32) -> Expr {
        Expr::F32(x)
    }
    pub fn reg(r: Reg) -> Expr {
        Expr::Reg(r)
    }
    pub fn bin(op: Bin, a: Expr, b: Expr) -> Expr {
        Expr::Bin(op, Box::new(a), Box::new(b))
    }
    pub fn un(op: Un, a: Expr) -> Expr {
        Expr::Un(op, Box::new(a))
    }
    pub fn add(a: Expr, b: Expr) -> Expr {
        bin(Bin::Add, a, b)
    }
    pub fn sub(a: Expr, b: Expr) -> Expr {
        bin(Bin::Sub, a, b)
    }
    pub fn mul(a: Expr, b: Expr) -> Expr {
        bin(Bin::Mul, a, b)
    }
    pub fn fma(a: Expr, b: Expr, c: Expr) -> Expr {
        Expr::Fma(Box::new(a), Box::new(b), Box::new(c))
    }
    pub fn select(c: Expr, a: Expr, b: Expr) -> Expr {
        Expr::Select(Box::new(c), Box::new(a), Box::new(b))
    }
    pub fn cast(a: Expr, ty: Ty) -> Expr {
        Expr::Cast(Box::new(a), ty)
    }
    pub fn load(space: Space, ty: Ty, addr: Expr) -> Expr {
        Expr::Load(space, ty, Box::new(addr))
    }
    /// `base + index * size`, as I64 bytes.
    pub fn at(base: Expr, index: Expr, size: i64) -> Expr {
        add(base, mul(index, i64(size)))
    }
}
