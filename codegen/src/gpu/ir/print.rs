//! The text form of GPU IR (`attnc emit --emit gpu-ir`, snapshots).

use super::{Bin, Expr, Kernel, Space, Special, Stmt, Ty, Un};
use std::fmt;

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Ty::Pred => "pred",
            Ty::I32 => "i32",
            Ty::I64 => "i64",
            Ty::F32 => "f32",
            Ty::TensorMap => "tensormap",
        })
    }
}

fn space(s: Space) -> &'static str {
    match s {
        Space::Global => "global",
        Space::Shared => "shared",
    }
}

/// The names registers print under: their own where unique, else `name.index` (so the text
/// names each register once and parses back to the same kernel).
pub(super) fn reg_names(k: &Kernel) -> Vec<String> {
    let mut seen = std::collections::HashMap::new();
    for (name, _) in &k.regs {
        *seen.entry(name.as_str()).or_insert(0usize) += 1;
    }
    k.regs
        .iter()
        .enumerate()
        .map(|(i, (name, _))| {
            if seen[name.as_str()] > 1 {
                format!("{name}.{i}")
            } else {
                name.clone()
            }
        })
        .collect()
}

struct Show<'a>(&'a Kernel, &'a [String], &'a Expr);

impl<'a> fmt::Display for Show<'a> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (k, names) = (self.0, self.1);
        let sub = |e: &'a Expr| Show(k, names, e);
        match self.2 {
            Expr::Int(x, ty) => write!(f, "{x}:{ty}"),
            Expr::F32(x) => write!(f, "{x:?}"),
            Expr::Pred(b) => write!(f, "{b}"),
            Expr::Reg(r) => write!(f, "%{}", names[r.0 as usize]),
            Expr::Param(i) => write!(f, "${}", k.params[*i as usize].0),
            Expr::Special(s) => match s {
                Special::Tid => write!(f, "tid"),
                Special::Ntid => write!(f, "ntid"),
                Special::Ctaid(a) => write!(f, "ctaid.{}", ["x", "y", "z"][*a as usize % 3]),
                Special::Lane => write!(f, "lane"),
            },
            Expr::Un(op, a) => {
                let name = match op {
                    Un::Neg => "neg",
                    Un::Abs => "abs",
                    Un::Not => "not",
                    Un::Ex2 => "ex2",
                    Un::Ex2Ftz => "ex2.ftz",
                    Un::Lg2 => "lg2",
                    Un::Sqrt => "sqrt",
                };
                write!(f, "{name}({})", sub(a))
            }
            Expr::Bin(op, a, b) => {
                let name = match op {
                    Bin::Add => "+",
                    Bin::Sub => "-",
                    Bin::Mul => "*",
                    Bin::Div => "/",
                    Bin::Rem => "%",
                    Bin::Min => return write!(f, "min({}, {})", sub(a), sub(b)),
                    Bin::Max => return write!(f, "max({}, {})", sub(a), sub(b)),
                    Bin::And => "&",
                    Bin::Or => "|",
                    Bin::Shl => "<<",
                    Bin::Lt => "<",
                    Bin::Le => "<=",
                    Bin::Gt => ">",
                    Bin::Ge => ">=",
                    Bin::Eq => "==",
                    Bin::Ne => "!=",
                };
                write!(f, "({} {name} {})", sub(a), sub(b))
            }
            Expr::Fma(a, b, c) => write!(f, "fma({}, {}, {})", sub(a), sub(b), sub(c)),
            Expr::Select(c, a, b) => write!(f, "({} ? {} : {})", sub(c), sub(a), sub(b)),
            Expr::Cast(a, ty) => write!(f, "{ty}({})", sub(a)),
            Expr::Load(s, ty, a) => write!(f, "ld.{}.{ty}[{}]", space(*s), sub(a)),
            Expr::LoadHalf(s, h, a) => {
                let name = match h {
                    super::Half::Bf16 => "bf16",
                    super::Half::F16 => "f16",
                };
                write!(f, "ld.{}.{name}[{}]", space(*s), sub(a))
            }
            Expr::Table(v, i) => write!(f, "table{v:?}[{}]", sub(i)),
            Expr::ShflXor(v, m) => write!(f, "shfl.bfly({}, {m})", sub(v)),
            Expr::PackHalf(h, lo, hi) => {
                let name = match h {
                    super::Half::Bf16 => "bf16x2",
                    super::Half::F16 => "f16x2",
                };
                write!(f, "{name}({}, {})", sub(lo), sub(hi))
            }
            Expr::SharedAddress(a) => write!(f, "shared.addr({})", sub(a)),
        }
    }
}

fn half_name(h: super::Half) -> &'static str {
    match h {
        super::Half::Bf16 => "bf16",
        super::Half::F16 => "f16",
    }
}

fn reg_list(names: &[String], rs: &[super::Reg]) -> String {
    rs.iter()
        .map(|r| format!("%{}", names[r.0 as usize]))
        .collect::<Vec<_>>()
        .join(", ")
}

fn stmts(
    f: &mut fmt::Formatter<'_>,
    k: &Kernel,
    names: &[String],
    body: &[Stmt],
    depth: usize,
) -> fmt::Result {
    for s in body {
        stmt(f, k, names, s, depth)?;
    }
    Ok(())
}

/// One statement (and what it nests, a level deeper) at indentation `depth`.
fn stmt(
    f: &mut fmt::Formatter<'_>,
    k: &Kernel,
    names: &[String],
    s: &Stmt,
    depth: usize,
) -> fmt::Result {
    let pad = "  ".repeat(depth);
    let show = |e| Show(k, names, e);
    match s {
        Stmt::Set(r, e) => writeln!(f, "{pad}%{} = {}", names[r.0 as usize], show(e)),
        Stmt::Store(sp, a, v) => {
            writeln!(f, "{pad}st.{}[{}] = {}", space(*sp), show(a), show(v))
        }
        Stmt::If(c, t, e) => {
            writeln!(f, "{pad}if {} {{", show(c))?;
            stmts(f, k, names, t, depth + 1)?;
            if !e.is_empty() {
                writeln!(f, "{pad}}} else {{")?;
                stmts(f, k, names, e, depth + 1)?;
            }
            writeln!(f, "{pad}}}")
        }
        Stmt::For {
            reg,
            start,
            end,
            step,
            body,
        } => {
            writeln!(
                f,
                "{pad}for %{} in {}..{} step {step} {{",
                names[reg.0 as usize],
                show(start),
                show(end)
            )?;
            stmts(f, k, names, body, depth + 1)?;
            writeln!(f, "{pad}}}")
        }
        Stmt::Barrier => writeln!(f, "{pad}bar.sync"),
        Stmt::CpAsync {
            dst,
            src,
            src_bytes,
        } => writeln!(
            f,
            "{pad}cp.async.cg.shared.global [{}], [{}], 16, {}",
            show(dst),
            show(src),
            show(src_bytes)
        ),
        Stmt::CpAsyncCommit => writeln!(f, "{pad}cp.async.commit_group"),
        Stmt::CpAsyncWait(n) => writeln!(f, "{pad}cp.async.wait_group {n}"),
        Stmt::LdMatrix { dst, addr, trans } => writeln!(
            f,
            "{pad}{{{}}} = ldmatrix.x{}{}.shared.b16 [{}]",
            reg_list(names, dst),
            dst.len(),
            if *trans { ".trans" } else { "" },
            show(addr)
        ),
        Stmt::Mma { half, d, a, b, c } => writeln!(
            f,
            "{pad}{{{}}} = mma.m16n8k16.{}({{{}}}, {{{}}}, {{{}}})",
            reg_list(names, d),
            half_name(*half),
            reg_list(names, a),
            reg_list(names, b),
            reg_list(names, c)
        ),
        Stmt::MbarInit { bar, count } => writeln!(f, "{pad}mbarrier.init [{}], {count}", show(bar)),
        Stmt::MbarArrive { bar, tx: None } => writeln!(f, "{pad}mbarrier.arrive [{}]", show(bar)),
        Stmt::MbarArrive { bar, tx: Some(tx) } => writeln!(
            f,
            "{pad}mbarrier.arrive.expect_tx [{}], {}",
            show(bar),
            show(tx)
        ),
        Stmt::MbarWait { bar, parity } => {
            writeln!(f, "{pad}mbarrier.wait [{}], {}", show(bar), show(parity))
        }
        Stmt::TmaLoad {
            dst,
            map,
            coords,
            bar,
        } => {
            let coords: Vec<String> = coords.iter().map(|c| show(c).to_string()).collect();
            writeln!(
                f,
                "{pad}tma.load [{}], ${}[{}], [{}]",
                show(dst),
                k.params.get(*map as usize).map_or("?", |(n, _)| n.as_str()),
                coords.join(", "),
                show(bar)
            )
        }
        Stmt::FenceProxyAsync => writeln!(f, "{pad}fence.proxy.async"),
        Stmt::Wgmma(w) => wgmma(f, k, names, w, &pad),
        Stmt::WgmmaWait { groups, regs } if regs.is_empty() => {
            writeln!(f, "{pad}wgmma.wait_group {groups}")
        }
        Stmt::WgmmaWait { groups, regs } => writeln!(
            f,
            "{pad}wgmma.wait_group {groups} {{{}}}",
            reg_list(names, regs)
        ),
        Stmt::NamedBarrier { id, threads, wait } => writeln!(
            f,
            "{pad}{} {}, {threads}",
            if *wait {
                "bar.sync.named"
            } else {
                "bar.arrive.named"
            },
            show(id)
        ),
        Stmt::SetMaxNReg { inc, regs } => writeln!(
            f,
            "{pad}setmaxnreg.{} {regs}",
            if *inc { "inc" } else { "dec" }
        ),
    }
}

/// A `wgmma` and its steps, one a line.
fn wgmma(
    f: &mut fmt::Formatter<'_>,
    k: &Kernel,
    names: &[String],
    w: &super::Wgmma,
    pad: &str,
) -> fmt::Result {
    let show = |e| Show(k, names, e);
    writeln!(
        f,
        "{pad}{{{}}} = wgmma.m64n{}k16.{}.{}({}) {{",
        reg_list(names, &w.d),
        w.n,
        half_name(w.half),
        if w.b_n_major { "nmajor" } else { "kmajor" },
        show(&w.accumulate)
    )?;
    for (a, b) in &w.steps {
        match a {
            super::WgmmaA::Shared(desc) => write!(f, "{pad}  a.shared({})", show(desc))?,
            super::WgmmaA::Regs(regs) => write!(f, "{pad}  a.regs{{{}}}", reg_list(names, regs))?,
        }
        writeln!(f, " b({})", show(b))?;
    }
    writeln!(f, "{pad}}}")
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let params: Vec<String> = self
            .params
            .iter()
            .map(|(n, t)| format!("${n}: {t}"))
            .collect();
        writeln!(
            f,
            "kernel {}({}) threads {} ({} CTAs per SM) shared {} bytes {{",
            self.name,
            params.join(", "),
            self.threads,
            self.ctas_per_sm,
            self.shared_bytes
        )?;
        let names = reg_names(self);
        let regs: Vec<String> = self
            .regs
            .iter()
            .zip(&names)
            .map(|((_, t), n)| format!("%{n}: {t}"))
            .collect();
        for line in regs.chunks(8) {
            writeln!(f, "  reg {}", line.join(", "))?;
        }
        stmts(f, self, &names, &self.body, 1)?;
        writeln!(f, "}}")
    }
}
