//! Expressions of the GPU IR text: literals, registers, parameters, specials, loads, unary and
//! binary operations.

use super::lex::{ParseError, Tok};
use super::{Parser, bin_named, ty_named, un_named};
use crate::gpu::ir::{Bin, Expr, Half, Space, Special, Ty};

impl Parser {
    pub(super) fn expr(&mut self) -> Result<Expr, ParseError> {
        self.enter()?;
        let e = self.primary();
        self.depth -= 1;
        e
    }

    /// `(e)`-style argument lists: `(a, b, ..)` of `n` expressions.
    pub(super) fn args<const N: usize>(&mut self) -> Result<[Expr; N], ParseError> {
        self.punct("(")?;
        let mut out = Vec::with_capacity(N);
        for i in 0..N {
            if i > 0 {
                self.punct(",")?;
            }
            out.push(self.expr()?);
        }
        self.punct(")")?;
        Ok(out
            .try_into()
            .unwrap_or_else(|_| unreachable!("N arguments")))
    }

    fn number(&mut self, negative: bool) -> Result<Expr, ParseError> {
        let (text, is_number) = match self.peek().clone() {
            Tok::Number(n) => (n, true),
            Tok::Word(w) if w == "inf" || w == "NaN" => (w, false),
            _ => return Err(self.expected("a number")),
        };
        self.next();
        let signed = if negative { format!("-{text}") } else { text };
        // Integers print as `digits:type`; floats always with a `.`, an exponent, inf or NaN
        // (so `0.5 : ..` in a select is a float and the select's colon).
        let integer = is_number && !signed.contains(['.', 'e', 'E']);
        if integer && self.is_punct(":") {
            self.next();
            let ty = self.ty()?;
            if !matches!(ty, Ty::I32 | Ty::I64) {
                return Err(self.error(format!("an integer constant of type {ty}")));
            }
            let value = signed
                .parse::<i64>()
                .map_err(|_| self.error(format!("`{signed}` is not an integer")))?;
            return Ok(Expr::Int(value, ty));
        }
        if integer {
            return Err(self.error(format!(
                "`{signed}` needs a type (`{signed}:i64`) or, as an f32, a point (`{signed}.0`)"
            )));
        }
        signed
            .parse::<f32>()
            .map(Expr::F32)
            .map_err(|_| self.error(format!("`{signed}` is not an f32")))
    }

    fn primary(&mut self) -> Result<Expr, ParseError> {
        match self.peek().clone() {
            Tok::Number(_) => self.number(false),
            Tok::Punct("-") => {
                self.next();
                self.number(true)
            }
            Tok::Reg(_) => Ok(Expr::Reg(self.reg()?)),
            Tok::Param(p) => match self.params.iter().position(|(n, _)| *n == p) {
                Some(i) => {
                    self.next();
                    Ok(Expr::Param(i as u32))
                }
                None => Err(self.error(format!("parameter `${p}` is not declared"))),
            },
            Tok::Punct("(") => {
                self.next();
                let a = self.expr()?;
                if self.is_punct("?") {
                    self.next();
                    let t = self.expr()?;
                    self.punct(":")?;
                    let o = self.expr()?;
                    self.punct(")")?;
                    return Ok(Expr::Select(Box::new(a), Box::new(t), Box::new(o)));
                }
                let op = match self.peek() {
                    Tok::Punct(p) => bin_named(p),
                    _ => None,
                };
                let Some(op) = op else {
                    return Err(self.expected("a binary operator or `?`"));
                };
                self.next();
                let b = self.expr()?;
                self.punct(")")?;
                Ok(Expr::Bin(op, Box::new(a), Box::new(b)))
            }
            Tok::Word(w) => {
                self.next();
                self.word_expr(&w)
            }
            _ => Err(self.expected("an expression")),
        }
    }

    fn word_expr(&mut self, w: &str) -> Result<Expr, ParseError> {
        let boxed = Box::new;
        Ok(match w {
            "true" => Expr::Pred(true),
            "false" => Expr::Pred(false),
            "inf" | "NaN" => {
                self.pos -= 1;
                return self.number(false);
            }
            "tid" => Expr::Special(Special::Tid),
            "ntid" => Expr::Special(Special::Ntid),
            "lane" => Expr::Special(Special::Lane),
            "ctaid.x" => Expr::Special(Special::Ctaid(0)),
            "ctaid.y" => Expr::Special(Special::Ctaid(1)),
            "ctaid.z" => Expr::Special(Special::Ctaid(2)),
            "shared.addr" => {
                let [a] = self.args()?;
                Expr::SharedAddress(boxed(a))
            }
            "min" | "max" => {
                let [a, b] = self.args()?;
                let op = if w == "min" { Bin::Min } else { Bin::Max };
                Expr::Bin(op, boxed(a), boxed(b))
            }
            "fma" => {
                let [a, b, c] = self.args()?;
                Expr::Fma(boxed(a), boxed(b), boxed(c))
            }
            "bf16x2" | "f16x2" => {
                let [a, b] = self.args()?;
                let half = if w == "bf16x2" { Half::Bf16 } else { Half::F16 };
                Expr::PackHalf(half, boxed(a), boxed(b))
            }
            "shfl.bfly" => {
                self.punct("(")?;
                let v = self.expr()?;
                self.punct(",")?;
                let mask = self.uint::<u32>("a lane mask")?;
                self.punct(")")?;
                Expr::ShflXor(boxed(v), mask)
            }
            "table" => {
                self.punct("[")?;
                let mut values = Vec::new();
                while !self.is_punct("]") {
                    if !values.is_empty() {
                        self.punct(",")?;
                    }
                    let negative = self.is_punct("-");
                    if negative {
                        self.next();
                    }
                    match self.number(negative)? {
                        Expr::F32(x) => values.push(x),
                        _ => return Err(self.error("table values are f32")),
                    }
                }
                self.next();
                self.punct("[")?;
                let index = self.expr()?;
                self.punct("]")?;
                Expr::Table(values, boxed(index))
            }
            _ => {
                if let Some(op) = un_named(w) {
                    let [a] = self.args()?;
                    return Ok(Expr::Un(op, boxed(a)));
                }
                if let Some(ty) = ty_named(w) {
                    let [a] = self.args()?;
                    return Ok(Expr::Cast(boxed(a), ty));
                }
                if let Some(rest) = w.strip_prefix("ld.") {
                    return self.load(w, rest);
                }
                self.pos -= 1;
                return Err(self.expected("an expression"));
            }
        })
    }

    /// `ld.{global,shared}.{ty,bf16,f16}[addr]`, after the word.
    fn load(&mut self, word: &str, rest: &str) -> Result<Expr, ParseError> {
        let (space, what) = match rest.split_once('.') {
            Some(("global", what)) => (Space::Global, what),
            Some(("shared", what)) => (Space::Shared, what),
            _ => return Err(self.error(format!("unknown load `{word}`"))),
        };
        self.punct("[")?;
        let addr = Box::new(self.expr()?);
        self.punct("]")?;
        Ok(match what {
            "bf16" => Expr::LoadHalf(space, Half::Bf16, addr),
            "f16" => Expr::LoadHalf(space, Half::F16, addr),
            _ => match ty_named(what) {
                Some(ty) => Expr::Load(space, ty, addr),
                None => return Err(self.error(format!("unknown load type `{what}`"))),
            },
        })
    }
}
