//! The parser of GPU IR text: the printed form ([`Kernel`]'s `Display`) back to a kernel, so
//! that kernels can be written, stored and tested as text. `parse(&kernel.to_string())` gives
//! the kernel back (floats print in full; NaN payloads are not kept).
//!
//! Errors say where (line and column) and what was expected. Input of any size or nesting is
//! refused cleanly: nesting past [`MAX_DEPTH`] levels is an error, never a stack overflow.
//! The tokens are made in `lex.rs`; kernels and statements are parsed here, expressions in
//! `expr.rs`.

mod expr;
mod lex;

pub use lex::ParseError;
use lex::{Tok, lex};

use super::{Bin, Expr, Half, Kernel, Reg, Space, Stmt, Ty, Un, Wgmma, WgmmaA};
use std::collections::HashMap;

/// The deepest nesting of expressions and blocks the parser accepts.
pub const MAX_DEPTH: usize = 512;

/// Stack for the parser's thread: the recursive descent takes a few KiB per level of nesting in
/// debug builds, more than a test thread's 2 MiB at [`MAX_DEPTH`].
const PARSER_STACK: usize = 64 << 20;

/// Parses one kernel from its text form. Text after the kernel's closing brace is an error,
/// except blank lines and `#` comment lines (which may also come before it).
pub fn parse(text: &str) -> Result<Kernel, ParseError> {
    let tokens = lex(text)?;
    let spawned = std::thread::Builder::new()
        .name("gpu-ir-parse".into())
        .stack_size(PARSER_STACK)
        .spawn(move || parse_tokens(tokens));
    match spawned {
        Ok(handle) => handle.join().unwrap_or_else(|_| {
            Err(ParseError {
                line: 0,
                column: 0,
                message: "the parser failed".into(),
            })
        }),
        Err(e) => Err(ParseError {
            line: 0,
            column: 0,
            message: format!("cannot start the parser's thread: {e}"),
        }),
    }
}

fn parse_tokens(tokens: Vec<(Tok, usize, usize)>) -> Result<Kernel, ParseError> {
    let mut p = Parser {
        tokens,
        pos: 0,
        regs: Vec::new(),
        names: HashMap::new(),
        params: Vec::new(),
        depth: 0,
    };
    let kernel = p.kernel()?;
    match p.peek() {
        Tok::End => Ok(kernel),
        _ => Err(p.error("text after the kernel's closing brace")),
    }
}

struct Parser {
    tokens: Vec<(Tok, usize, usize)>,
    pos: usize,
    regs: Vec<(String, Ty)>,
    names: HashMap<String, Reg>,
    params: Vec<(String, Ty)>,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> &Tok {
        &self.tokens[self.pos.min(self.tokens.len() - 1)].0
    }

    fn next(&mut self) -> Tok {
        let t = self.peek().clone();
        if self.pos < self.tokens.len() - 1 {
            self.pos += 1;
        }
        t
    }

    fn error(&self, message: impl Into<String>) -> ParseError {
        let (_, line, column) = self.tokens[self.pos.min(self.tokens.len() - 1)];
        ParseError {
            line,
            column,
            message: message.into(),
        }
    }

    fn expected(&self, what: &str) -> ParseError {
        self.error(format!("expected {what}, found {}", self.peek()))
    }

    fn punct(&mut self, p: &'static str) -> Result<(), ParseError> {
        if *self.peek() == Tok::Punct(p) {
            self.next();
            Ok(())
        } else {
            Err(self.expected(&format!("`{p}`")))
        }
    }

    fn word(&mut self, w: &str) -> Result<(), ParseError> {
        if *self.peek() == Tok::Word(w.into()) {
            self.next();
            Ok(())
        } else {
            Err(self.expected(&format!("`{w}`")))
        }
    }

    fn is_punct(&self, p: &str) -> bool {
        matches!(self.peek(), Tok::Punct(q) if *q == p)
    }

    fn is_word(&self, w: &str) -> bool {
        matches!(self.peek(), Tok::Word(x) if x == w)
    }

    fn uint<T: TryFrom<u64>>(&mut self, what: &str) -> Result<T, ParseError> {
        match self.peek().clone() {
            Tok::Number(n) => {
                let value = n
                    .parse::<u64>()
                    .ok()
                    .and_then(|v| T::try_from(v).ok())
                    .ok_or_else(|| self.error(format!("{what} `{n}` is out of range")))?;
                self.next();
                Ok(value)
            }
            _ => Err(self.expected(what)),
        }
    }

    fn ty(&mut self) -> Result<Ty, ParseError> {
        let ty = match self.peek() {
            Tok::Word(w) => ty_named(w),
            _ => None,
        };
        match ty {
            Some(t) => {
                self.next();
                Ok(t)
            }
            None => Err(self.expected("a type (pred, i32, i64, f32, tensormap)")),
        }
    }

    fn enter(&mut self) -> Result<(), ParseError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(self.error(format!("nested deeper than {MAX_DEPTH} levels")));
        }
        Ok(())
    }

    fn kernel(&mut self) -> Result<Kernel, ParseError> {
        self.word("kernel")?;
        let name = match self.next() {
            Tok::Word(w) => w,
            _ => return Err(self.expected("the kernel's name")),
        };
        self.punct("(")?;
        while !self.is_punct(")") {
            let Tok::Param(p) = self.next() else {
                return Err(self.expected("a parameter `$name: type`"));
            };
            if self.params.iter().any(|(n, _)| *n == p) {
                return Err(self.error(format!("parameter `${p}` is declared twice")));
            }
            self.punct(":")?;
            let ty = self.ty()?;
            self.params.push((p, ty));
            if !self.is_punct(")") {
                self.punct(",")?;
            }
        }
        self.punct(")")?;
        self.word("threads")?;
        let threads = self.uint::<u32>("the threads per CTA")?;
        self.punct("(")?;
        let ctas_per_sm = self.uint::<u32>("the CTAs per SM")?;
        for w in ["CTAs", "per", "SM"] {
            self.word(w)?;
        }
        self.punct(")")?;
        self.word("shared")?;
        let shared_bytes = self.uint::<u32>("the shared bytes")?;
        self.word("bytes")?;
        self.punct("{")?;
        while self.is_word("reg") {
            self.next();
            loop {
                let Tok::Reg(r) = self.next() else {
                    return Err(self.expected("a register `%name: type`"));
                };
                self.punct(":")?;
                let ty = self.ty()?;
                if self.names.contains_key(&r) {
                    return Err(self.error(format!("register `%{r}` is declared twice")));
                }
                self.names.insert(r.clone(), Reg(self.regs.len() as u32));
                self.regs.push((r, ty));
                if !self.is_punct(",") {
                    break;
                }
                self.next();
            }
        }
        let body = self.block()?;
        Ok(Kernel {
            name,
            params: std::mem::take(&mut self.params),
            regs: std::mem::take(&mut self.regs),
            shared_bytes,
            threads,
            ctas_per_sm,
            body,
        })
    }

    /// Statements up to and including the closing `}`.
    fn block(&mut self) -> Result<Vec<Stmt>, ParseError> {
        self.enter()?;
        let mut body = Vec::new();
        while !self.is_punct("}") {
            if *self.peek() == Tok::End {
                return Err(self.expected("`}`"));
            }
            body.push(self.stmt()?);
        }
        self.next();
        self.depth -= 1;
        Ok(body)
    }

    fn reg(&mut self) -> Result<Reg, ParseError> {
        match self.peek().clone() {
            Tok::Reg(r) => match self.names.get(&r) {
                Some(reg) => {
                    let reg = *reg;
                    self.next();
                    Ok(reg)
                }
                None => Err(self.error(format!("register `%{r}` is not declared"))),
            },
            _ => Err(self.expected("a register")),
        }
    }

    /// `{%a, %b, ..}`.
    fn reg_list(&mut self) -> Result<Vec<Reg>, ParseError> {
        self.punct("{")?;
        let mut regs = vec![self.reg()?];
        while self.is_punct(",") {
            self.next();
            regs.push(self.reg()?);
        }
        self.punct("}")?;
        Ok(regs)
    }

    fn fixed<const N: usize>(&mut self, what: &str) -> Result<[Reg; N], ParseError> {
        let regs = self.reg_list()?;
        let n = regs.len();
        regs.try_into()
            .map_err(|_| self.error(format!("{what} takes {N} registers, found {n}")))
    }

    fn stmt(&mut self) -> Result<Stmt, ParseError> {
        match self.peek().clone() {
            Tok::Reg(_) => {
                let r = self.reg()?;
                self.punct("=")?;
                Ok(Stmt::Set(r, self.expr()?))
            }
            Tok::Punct("{") => self.collective(),
            Tok::Word(w) => {
                self.next();
                match w.as_str() {
                    "st.global" | "st.shared" => {
                        let space = if w == "st.global" {
                            Space::Global
                        } else {
                            Space::Shared
                        };
                        self.punct("[")?;
                        let addr = self.expr()?;
                        self.punct("]")?;
                        self.punct("=")?;
                        Ok(Stmt::Store(space, addr, self.expr()?))
                    }
                    "if" => {
                        let cond = self.expr()?;
                        self.punct("{")?;
                        let then = self.block()?;
                        let otherwise = if self.is_word("else") {
                            self.next();
                            self.punct("{")?;
                            self.block()?
                        } else {
                            Vec::new()
                        };
                        Ok(Stmt::If(cond, then, otherwise))
                    }
                    "for" => {
                        let reg = self.reg()?;
                        self.word("in")?;
                        let start = self.expr()?;
                        self.punct("..")?;
                        let end = self.expr()?;
                        self.word("step")?;
                        let step = self.uint::<i64>("the loop's step")?;
                        self.punct("{")?;
                        let body = self.block()?;
                        Ok(Stmt::For {
                            reg,
                            start,
                            end,
                            step,
                            body,
                        })
                    }
                    "bar.sync" => Ok(Stmt::Barrier),
                    "cp.async.commit_group" => Ok(Stmt::CpAsyncCommit),
                    "cp.async.wait_group" => Ok(Stmt::CpAsyncWait(self.uint("a group count")?)),
                    "mbarrier.init" => {
                        let bar = self.bracketed()?;
                        self.punct(",")?;
                        let count = self.uint("an arrival count")?;
                        Ok(Stmt::MbarInit { bar, count })
                    }
                    "mbarrier.arrive" => Ok(Stmt::MbarArrive {
                        bar: self.bracketed()?,
                        tx: None,
                    }),
                    "mbarrier.arrive.expect_tx" => {
                        let bar = self.bracketed()?;
                        self.punct(",")?;
                        Ok(Stmt::MbarArrive {
                            bar,
                            tx: Some(self.expr()?),
                        })
                    }
                    "mbarrier.wait" => {
                        let bar = self.bracketed()?;
                        self.punct(",")?;
                        Ok(Stmt::MbarWait {
                            bar,
                            parity: self.expr()?,
                        })
                    }
                    "tma.load" => self.tma_load(),
                    "fence.proxy.async" => Ok(Stmt::FenceProxyAsync),
                    "wgmma.wait_group" => {
                        let groups = self.uint("a group count")?;
                        let regs = if self.is_punct("{") {
                            self.reg_list()?
                        } else {
                            Vec::new()
                        };
                        Ok(Stmt::WgmmaWait { groups, regs })
                    }
                    "bar.sync.named" | "bar.arrive.named" => {
                        let id = self.expr()?;
                        self.punct(",")?;
                        Ok(Stmt::NamedBarrier {
                            id,
                            threads: self.uint("a thread count")?,
                            wait: w == "bar.sync.named",
                        })
                    }
                    "setmaxnreg.inc" | "setmaxnreg.dec" => Ok(Stmt::SetMaxNReg {
                        inc: w == "setmaxnreg.inc",
                        regs: self.uint("a register count")?,
                    }),
                    "cp.async.cg.shared.global" => {
                        self.punct("[")?;
                        let dst = self.expr()?;
                        self.punct("]")?;
                        self.punct(",")?;
                        self.punct("[")?;
                        let src = self.expr()?;
                        self.punct("]")?;
                        self.punct(",")?;
                        if self.uint::<u32>("the copy size 16")? != 16 {
                            return Err(self.error("cp.async copies 16 bytes"));
                        }
                        self.punct(",")?;
                        Ok(Stmt::CpAsync {
                            dst,
                            src,
                            src_bytes: self.expr()?,
                        })
                    }
                    _ => {
                        self.pos -= 1;
                        Err(self.expected("a statement"))
                    }
                }
            }
            _ => Err(self.expected("a statement")),
        }
    }

    /// `[expr]`.
    fn bracketed(&mut self) -> Result<Expr, ParseError> {
        self.punct("[")?;
        let e = self.expr()?;
        self.punct("]")?;
        Ok(e)
    }

    /// `tma.load [dst], $map[c, ..], [bar]`, after the word.
    fn tma_load(&mut self) -> Result<Stmt, ParseError> {
        let dst = self.bracketed()?;
        self.punct(",")?;
        let Tok::Param(p) = self.next() else {
            return Err(self.expected("a tensor map parameter `$name`"));
        };
        let map = self
            .params
            .iter()
            .position(|(n, _)| *n == p)
            .ok_or_else(|| self.error(format!("parameter `${p}` is not declared")))?;
        self.punct("[")?;
        let mut coords = vec![self.expr()?];
        while self.is_punct(",") {
            self.next();
            coords.push(self.expr()?);
        }
        self.punct("]")?;
        self.punct(",")?;
        let bar = self.bracketed()?;
        Ok(Stmt::TmaLoad {
            dst,
            map: map as u32,
            coords,
            bar,
        })
    }

    /// `{..} = wgmma.m64nNk16.T.{kmajor,nmajor}(acc) { a.shared(desc) b(desc) .. }`, after
    /// the accumulator list and the operation's name.
    fn wgmma(&mut self, d: Vec<Reg>, op: &str) -> Result<Stmt, ParseError> {
        let bad = || format!("unknown wgmma form `{op}`");
        let rest = op
            .strip_prefix("wgmma.m64n")
            .ok_or_else(|| self.error(bad()))?;
        let (n, rest) = rest.split_once("k16.").ok_or_else(|| self.error(bad()))?;
        let n = n.parse::<u32>().map_err(|_| self.error(bad()))?;
        let (half, b_n_major) = match rest {
            "bf16.kmajor" => (Half::Bf16, false),
            "bf16.nmajor" => (Half::Bf16, true),
            "f16.kmajor" => (Half::F16, false),
            "f16.nmajor" => (Half::F16, true),
            _ => return Err(self.error(bad())),
        };
        self.punct("(")?;
        let accumulate = self.expr()?;
        self.punct(")")?;
        self.punct("{")?;
        let mut steps = Vec::new();
        while !self.is_punct("}") {
            let a = match self.next() {
                Tok::Word(w) if w == "a.shared" => {
                    self.punct("(")?;
                    let desc = self.expr()?;
                    self.punct(")")?;
                    WgmmaA::Shared(desc)
                }
                Tok::Word(w) if w == "a.regs" => WgmmaA::Regs(self.fixed::<4>("wgmma's A")?),
                _ => {
                    self.pos -= 1;
                    return Err(self.expected("`a.shared(..)`, `a.regs{..}` or `}`"));
                }
            };
            self.word("b")?;
            self.punct("(")?;
            let b = self.expr()?;
            self.punct(")")?;
            steps.push((a, b));
        }
        self.next();
        Ok(Stmt::Wgmma(Box::new(Wgmma {
            half,
            n,
            d,
            accumulate,
            steps,
            b_n_major,
        })))
    }

    /// `{..} = ldmatrix.xN[.trans].shared.b16 [addr]`, `{..} = mma.m16n8k16.T({..}, {..}, {..})`
    /// or a `wgmma`.
    fn collective(&mut self) -> Result<Stmt, ParseError> {
        let dst = self.reg_list()?;
        self.punct("=")?;
        let Tok::Word(op) = self.next() else {
            return Err(self.expected("ldmatrix, mma or wgmma"));
        };
        if op.starts_with("wgmma.") {
            return self.wgmma(dst, &op);
        }
        if let Some(rest) = op.strip_prefix("ldmatrix.x") {
            let (count, trans) = match rest {
                "1.shared.b16" => (1, false),
                "2.shared.b16" => (2, false),
                "4.shared.b16" => (4, false),
                "1.trans.shared.b16" => (1, true),
                "2.trans.shared.b16" => (2, true),
                "4.trans.shared.b16" => (4, true),
                _ => return Err(self.error(format!("unknown ldmatrix form `{op}`"))),
            };
            if dst.len() != count {
                return Err(self.error(format!(
                    "ldmatrix.x{count} writes {count} registers, found {}",
                    dst.len()
                )));
            }
            self.punct("[")?;
            let addr = self.expr()?;
            self.punct("]")?;
            return Ok(Stmt::LdMatrix { dst, addr, trans });
        }
        let half = match op.as_str() {
            "mma.m16n8k16.bf16" => Half::Bf16,
            "mma.m16n8k16.f16" => Half::F16,
            _ => return Err(self.error(format!("unknown collective operation `{op}`"))),
        };
        let d: [Reg; 4] = dst
            .try_into()
            .map_err(|_| self.error("mma writes 4 registers"))?;
        self.punct("(")?;
        let a = self.fixed::<4>("mma's A")?;
        self.punct(",")?;
        let b = self.fixed::<2>("mma's B")?;
        self.punct(",")?;
        let c = self.fixed::<4>("mma's C")?;
        self.punct(")")?;
        Ok(Stmt::Mma { half, d, a, b, c })
    }
}

fn ty_named(w: &str) -> Option<Ty> {
    Some(match w {
        "pred" => Ty::Pred,
        "i32" => Ty::I32,
        "i64" => Ty::I64,
        "f32" => Ty::F32,
        "tensormap" => Ty::TensorMap,
        _ => return None,
    })
}

fn un_named(w: &str) -> Option<Un> {
    Some(match w {
        "neg" => Un::Neg,
        "abs" => Un::Abs,
        "not" => Un::Not,
        "ex2" => Un::Ex2,
        "ex2.ftz" => Un::Ex2Ftz,
        "lg2" => Un::Lg2,
        "sqrt" => Un::Sqrt,
        _ => return None,
    })
}

fn bin_named(p: &str) -> Option<Bin> {
    Some(match p {
        "+" => Bin::Add,
        "-" => Bin::Sub,
        "*" => Bin::Mul,
        "/" => Bin::Div,
        "%" => Bin::Rem,
        "&" => Bin::And,
        "|" => Bin::Or,
        "<<" => Bin::Shl,
        "<" => Bin::Lt,
        "<=" => Bin::Le,
        ">" => Bin::Gt,
        ">=" => Bin::Ge,
        "==" => Bin::Eq,
        "!=" => Bin::Ne,
        _ => return None,
    })
}
