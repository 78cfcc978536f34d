//! A spec's whole score pipeline and mask as modifier IR: the built-ins and the custom modifiers
//! composed, so a backend applies one score expression and one mask expression.

use super::typecheck::{TypeError, typecheck};
use super::{BinOp, Expr, ParamRead, Ty, UnOp, Var};
use crate::reference::alibi;
use crate::spec::{AttentionSpec, CausalAlign, Mask, Position};
use std::fmt;

/// The score and mask of a spec.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreProgram {
    /// The final score (f32) from `score` = the raw `<q, k>` after RoPE: scale, softcap, ALiBi,
    /// then the custom score modifier.
    pub score: Expr,
    /// Whether a (query, key) pair is kept (bool): the built-in mask AND the custom mask.
    pub mask: Expr,
}

impl ScoreProgram {
    /// Expresses a spec's built-ins in the IR and composes them with its custom modifiers, in the
    /// order of docs/semantics.md ("Scores, masks and positions"). Not yet folded: see [`super::fold`].
    pub fn of(spec: &AttentionSpec) -> ScoreProgram {
        let mut score = Expr::binary(
            BinOp::Mul,
            Expr::Var(Var::Score),
            Expr::Float(spec.effective_scale()),
        );
        if let Some(c) = spec.softcap {
            // c * tanh(s / c)
            let inner = Expr::binary(BinOp::Div, score, Expr::Float(c));
            score = Expr::binary(BinOp::Mul, Expr::Float(c), Expr::unary(UnOp::Tanh, inner));
        }
        if spec.position == Position::Alibi {
            // s + slope[h] * (k - q) as f32
            let slope = Expr::Table(alibi::slopes(spec.heads), Box::new(Expr::Var(Var::Head)));
            let distance = Expr::cast(
                Expr::binary(BinOp::Sub, Expr::Var(Var::Key), Expr::Var(Var::Query)),
                Ty::F32,
            );
            score = Expr::binary(BinOp::Add, score, Expr::binary(BinOp::Mul, slope, distance));
        }
        if let Some(m) = &spec.score_mod {
            score = m.body.substitute(Var::Score, &score);
        }

        let (q, k) = (Expr::Var(Var::Query), Expr::Var(Var::Key));
        let builtin = match spec.mask {
            Mask::None => Expr::Bool(true),
            Mask::Causal(CausalAlign::BottomRight) => Expr::binary(BinOp::Le, k, q),
            Mask::Causal(CausalAlign::TopLeft) => Expr::binary(
                BinOp::Le,
                Expr::Var(Var::KeyIndex),
                Expr::Var(Var::QueryIndex),
            ),
            Mask::SlidingWindow { window } => Expr::binary(
                BinOp::And,
                Expr::binary(BinOp::Le, k.clone(), q.clone()),
                Expr::binary(
                    BinOp::Lt,
                    Expr::binary(BinOp::Sub, q, k),
                    Expr::Int(i64::try_from(window).unwrap_or(i64::MAX)),
                ),
            ),
        };
        let mask = match (&spec.mask_mod, builtin) {
            (None, builtin) => builtin,
            (Some(m), Expr::Bool(true)) => m.body.clone(),
            (Some(m), builtin) => Expr::binary(BinOp::And, builtin, m.body.clone()),
        };
        ScoreProgram { score, mask }
    }

    /// The program with both expressions folded and simplified.
    pub fn folded(&self) -> ScoreProgram {
        ScoreProgram {
            score: super::fold::fold(&self.score),
            mask: super::fold::fold(&self.mask),
        }
    }

    /// `d score / d raw score` (the raw `<q, k>` after RoPE), folded: the chain of scale,
    /// softcap, ALiBi and the custom score modifier the backward pass multiplies by. The mask has
    /// no derivative: masked pairs carry no gradient.
    pub fn score_gradient(&self) -> Result<super::grad::Gradient, super::grad::GradError> {
        let mut gradient = super::grad::derivative(&self.score)?;
        gradient.expr = super::fold::fold(&gradient.expr);
        Ok(gradient)
    }

    /// For each distinct f32 read of the score (a parameter or f32 data), `d score / d read`
    /// (the value read), folded, in first-read order. A tensor's gradient sums
    /// `dS * d score / d read` over every kept pair, into the element each read reads at that
    /// pair. Reads of i32 data have none.
    pub fn param_gradients(&self) -> Result<Vec<(ParamRead, Expr)>, super::grad::GradError> {
        self.score
            .param_reads()
            .into_iter()
            .filter(|read| read.ty == Ty::F32)
            .map(|read| {
                let gradient = super::grad::derivative_wrt_param(&self.score, &read)?;
                Ok((read, super::fold::fold(&gradient.expr)))
            })
            .collect()
    }

    /// Checks that the score is f32 and the mask bool.
    pub fn typecheck(&self) -> Result<(), TypeError> {
        let expect = |e: &Expr, want: Ty, what: &str| -> Result<(), TypeError> {
            let got = typecheck(e)?;
            if got == want {
                Ok(())
            } else {
                Err(TypeError {
                    expr: e.to_string(),
                    message: format!("the {what} must be {}, is {}", want.name(), got.name()),
                })
            }
        };
        expect(&self.score, Ty::F32, "score")?;
        expect(&self.mask, Ty::Bool, "mask")
    }
}

impl fmt::Display for ScoreProgram {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        writeln!(f, "score = {}", self.score)?;
        write!(f, "mask = {}", self.mask)
    }
}
